"""Warm sessions: one resident agent process per active session, turn after turn.

Claude Code can stay resident: ``claude -p --input-format stream-json --output-format
stream-json --verbose --replay-user-messages`` reads one user message per stdin line and
prints, for each, the usual records ending in one ``result`` record. A warm session starts
that process on its first turn and keeps it: each turn writes one line and ends when the
CLI reports that turn's result, never on a timer. Everything else is the per-turn adapter's
(:class:`~engine.agents.claude.ClaudeAgent`): argv, environment, tool allowlist, record
parsing, progress events and the :class:`~engine.turn.TurnOutput` it composes.

Measured against Claude Code 2.1.197 (see ``tests/test_agents_warm.py``):

- Every stdin message is echoed back (``"isReplay": true``) once the CLI takes it up.
- A message written while a turn runs (steering) joins the running turn when the agent is
  between tool calls (the next model request carries it, one ``result``); written while
  the model is answering, the CLI runs it right after as a follow-on with a ``result`` of
  its own. Either way the agent is not idle until every message was echoed and a
  ``result`` followed, so that is where a warm turn ends.
- ``{"type": "control_request", "request": {"subtype": "interrupt"}}`` stops the running
  turn (its tool processes too) and the process stays: the CLI answers with a
  ``control_response`` and ends the turn with an ``error_during_execution`` result.
- ``total_cost_usd`` in a ``result`` counts from the process's start; ``usage`` is the
  turn's own.

A process that dies (crash, ``kill -9``, eviction, a restart) is simply gone: the next turn
starts a new one on the same session id with ``--resume``. The :class:`WarmPool` bounds how
many processes stay resident and stops idle ones (an operator's memory policy).

What does not depend on the CLI (the process in a session of its own, its readers, the
stderr tail, closing it, the pool and the pre-empt handle) is
:mod:`engine.agents.resident`'s, shared with Codex's app-server
(:mod:`engine.agents.warm_codex`); the pool, the handle and :func:`report_process` are
re-exported here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Final

from engine.agents.base import AgentOptions
from engine.agents.claude import ClaudeAgent
from engine.agents.probe import Finished, Probe, ask, ask_async
from engine.agents.resident import (
    ResidentAgent,
    ResidentTurn,
    WarmMember,
    WarmPool,
    WarmPreemptHandle,
    read_lines,
    report_process,
)
from engine.agents.stream import EventCallback
from engine.approvals.listener import ApprovalListener
from engine.errors import TurnIOError, TurnPreempted, TurnstileError
from engine.process import STDERR_TAIL, PreemptHandle, ProcessResult, lifeline, validate_prompt
from engine.redact import tail
from engine.turn import TurnOutput

__all__ = [
    "WarmClaudeAgent",
    "WarmMember",
    "WarmPool",
    "WarmPreemptHandle",
    "WarmSupport",
    "claude_warm_support",
    "claude_warm_support_async",
    "close_agent",
    "read_lines",
    "report_process",
]

_LOGGER = logging.getLogger(__name__)

_HELP_TIMEOUT: Final = 60.0
# The CLI saves its transcript some milliseconds after printing the result.
_TRANSCRIPT_WAIT: Final = 2.0
_TRANSCRIPT_POLL: Final = 0.005


@dataclass(frozen=True, slots=True)
class WarmSupport:
    """Whether an installed CLI can stay resident, and why (for ``agents`` / ``doctor``)."""

    supported: bool
    reason: str


_NEEDED_FLAGS: Final = ("--input-format", "stream-json", "--replay-user-messages")


def _read_help(done: Finished) -> WarmSupport:
    text = done.stdout.decode("utf-8", errors="replace")
    missing = [flag for flag in _NEEDED_FLAGS if flag not in text]
    if missing:
        return WarmSupport(
            False, f"this Claude Code version has no {', '.join(missing)} (one process per turn)"
        )
    return WarmSupport(True, "takes turn after turn on stdin (stream-json input)")


_HELP_PROBE: Final = Probe(
    name="claude-warm-1",
    label="`claude --help`",
    answer_type=WarmSupport,
    args=lambda _folder: ["--help"],
    read=_read_help,
    failed=lambda reason: WarmSupport(False, reason),
    env=lambda _folder: {**os.environ, "DISABLE_AUTOUPDATER": "1"},
    timeout=_HELP_TIMEOUT,
)


def claude_warm_support(
    binary: str, *, path: str | None = None, cache: Path | None = None
) -> WarmSupport:
    """Whether the installed ``claude`` takes turns on stdin (read from its ``--help``).

    Asked once per binary file and version (:mod:`engine.agents.probe`), the answer kept
    in memory and in the file ``cache``; inside a running event loop an answer not known
    yet is "not supported, being asked" (async code awaits
    :func:`claude_warm_support_async`).
    """
    return ask(_HELP_PROBE, binary, path=path, cache=cache)


async def claude_warm_support_async(
    binary: str, *, path: str | None = None, cache: Path | None = None
) -> WarmSupport:
    """:func:`claude_warm_support` for async code: the CLI runs off the event loop."""
    return await ask_async(_HELP_PROBE, binary, path=path, cache=cache)


@dataclass(slots=True)
class _Turn(ResidentTurn):
    """The warm turn in flight."""

    results: list[dict[str, Any]] = field(default_factory=list)
    prompt_echoed: bool = False
    steers: deque[asyncio.Event] = field(default_factory=deque)
    interrupting: bool = False
    last_uuid: str | None = None
    transcript_offset: int = 0


class WarmClaudeAgent(ResidentAgent[_Turn], ClaudeAgent):
    """A Claude Code session whose process stays resident between turns (the process's
    life is :class:`~engine.agents.resident.ResidentAgent`'s)."""

    process_label: ClassVar[str] = "Claude Code process"

    def __init__(
        self,
        options: AgentOptions,
        *,
        session_id: str | None = None,
        preempt: PreemptHandle | None = None,
        resume: bool = False,
        on_event: EventCallback | None = None,
        pool: WarmPool | None = None,
    ) -> None:
        super().__init__(
            options,
            session_id=session_id or str(uuid.uuid4()),
            preempt=preempt,
            resume=resume,
            on_event=on_event,
            pool=pool,
        )
        self._cost_base = 0.0
        self._controls: dict[str, asyncio.Future[dict[str, Any]]] = {}
        # Turns whose answers were returned and that the CLI is still saving to its
        # transcript (each task: whether it was saved in time).
        self._saving: set[asyncio.Task[bool]] = set()
        self._transcript: Path | None = None
        self._prestarted = False

    # -- argv --------------------------------------------------------------------------
    def io_args(self) -> list[str]:
        return [
            "-p",
            "--input-format",
            "stream-json",
            "--output-format",
            "stream-json",
            "--verbose",
            "--replay-user-messages",
        ]

    # -- turns -------------------------------------------------------------------------
    async def prestart(self) -> None:
        """Start the resident process ahead of the first turn (while its prompt is being
        prepared: the CLI's start-up runs meanwhile). A failure is left for that turn to
        report."""
        async with self._lock:
            if self.resident:
                return
            try:
                await self._spawn()
            except TurnstileError as exc:
                _LOGGER.info("could not start the resident process ahead: %s", exc)
                return
            self._prestarted = True

    async def _run(self, prompt: str) -> TurnOutput:
        # The last turn is saved first: the CLI, given the next message at once, leaves
        # the earlier turn unsaved while it works on it (a process lost meanwhile would
        # take that turn with it).
        await self.settled()
        spawned = self._prestarted and self.resident
        self._prestarted = False
        if not self.resident:
            await self._spawn()
            spawned = True
        await self._report()
        turn = await self._deliver(prompt)
        if (
            not spawned
            and not self._handle.requested
            and turn.exit_code is not None
            and turn.stdout_bytes == 0
        ):
            # The process had died between turns (killed, evicted by the OS) before it
            # printed a thing for this prompt: it never took it. A new one does.
            _LOGGER.info(
                "the resident process was gone before the turn; starting a new one",
                extra={"session_id": self.session_id},
            )
            await self._await_readers()
            await self._spawn()
            spawned = True
            await self._report()
            turn = await self._deliver(prompt)
        proc = self._proc
        assert proc is not None
        if self._handle.requested:
            raise TurnPreempted(session_id=self.session_id)
        saved = self._saved(turn)
        if not saved and turn.failure is None:
            self._settle(turn)
        if turn.failure is not None:
            raise turn.failure
        code = turn.exit_code
        if turn.results:
            final = self._merge(turn.results)
            self.turn.result = final
            code = 1 if final.get("is_error") else 0
        elif code is None:
            code = -1
        result = ProcessResult(
            exit_code=code,
            stdout="",
            stdout_size=turn.stdout_bytes,
            spill_path=None,
            stderr_tail=tail(bytes(turn.stderr), STDERR_TAIL) if turn.stderr else "",
            stderr_size=turn.stderr_bytes,
            pid=proc.pid,
            duration=time.monotonic() - turn.started,
        )
        out = self.compose(result)
        out.metadata["warm"] = True
        out.metadata["process_started"] = spawned
        if turn.results and len(turn.results) > 1:
            out.metadata["follow_on_results"] = len(turn.results) - 1
        return out

    async def _deliver(self, prompt: str) -> _Turn:
        """Write the prompt and wait until the agent is idle or its process is gone."""
        turn = _Turn(transcript_offset=self._transcript_size())
        self._current = turn
        self.turn = type(self.turn)()
        self._handle._begin(self._interrupt)
        try:
            try:
                self._write({"type": "user", "message": {"role": "user", "content": prompt}})
            except TurnIOError:
                # The process is going: its reader ends the turn when its output closes.
                _LOGGER.info("the resident process did not take the prompt")
            await turn.done.wait()
        finally:
            self._current = None
            self._handle._end()
        return turn

    def transcript_path(self) -> Path:
        # Fixed for the session (its config folder, cwd and id): worked out once.
        if self._transcript is None:
            self._transcript = super().transcript_path()
        return self._transcript

    def _transcript_size(self) -> int:
        try:
            return self.transcript_path().stat().st_size
        except OSError:
            return 0

    def _saved(self, turn: _Turn) -> bool:
        """Whether the turn's last message is in the transcript already (or there is none
        to wait for: the turn printed no message, or its process is gone, which flushed)."""
        if turn.last_uuid is None or not self.resident:
            return True
        try:
            with self.transcript_path().open("rb") as fh:
                fh.seek(turn.transcript_offset)
                return turn.last_uuid.encode() in fh.read()
        except OSError:
            return False

    def _settle(self, turn: _Turn) -> None:
        """Let the CLI save the turn in the background: the answer goes out now.

        The resident CLI writes its transcript a moment (~85 ms) after it prints the
        result. Until it has, the next turn does not start and the process is not closed
        (:meth:`settled`); and if turnstile dies meanwhile, the turn watchdog lets the
        process finish saving and leave by itself before anything is killed
        (:meth:`engine.reaper.Lifeline.settling`, and the sandbox's keeper,
        :mod:`engine.keeper`). So an answer that was shown is never
        missing from the session a later process resumes.
        """
        marker = self._marker
        if marker is not None:
            lifeline().settling(marker, True)
        task = asyncio.create_task(
            self._await_transcript(turn), name=f"warm-transcript-{self.session_id}"
        )
        self._saving.add(task)

        def saved(done: asyncio.Task[bool]) -> None:
            self._saving.discard(done)
            if marker is not None and not self._saving:
                lifeline().settling(marker, False)

        task.add_done_callback(saved)

    async def settled(self) -> bool:
        """Wait until the turns answered so far are in the transcript (False: one was
        not saved in time)."""
        if not self._saving:
            return True
        done = await asyncio.shield(asyncio.gather(*self._saving))
        return all(done)

    async def _kill(self, why: str) -> None:
        await self.settled()
        await super()._kill(why)

    async def _close(self) -> None:
        await self.settled()
        await super()._close()

    async def _await_transcript(self, turn: _Turn) -> bool:
        """Wait (briefly) until the CLI saved the turn's last message to its transcript.

        A process killed before that would lose the exchange, and the next process would
        resume without it.
        """
        if turn.last_uuid is None or not self.resident:
            return turn.last_uuid is None
        path = self.transcript_path()
        deadline = time.monotonic() + _TRANSCRIPT_WAIT
        while True:
            if self._saved(turn):
                return True
            if time.monotonic() >= deadline or not self.resident:
                _LOGGER.warning(
                    "Claude Code had not saved the turn to %s after %.0f s",
                    path,
                    _TRANSCRIPT_WAIT,
                    extra={"session_id": self.session_id},
                )
                return False
            await asyncio.sleep(_TRANSCRIPT_POLL)

    def _merge(self, results: list[dict[str, Any]]) -> dict[str, Any]:
        """One result record for the turn (a steered turn may have had follow-ons)."""
        final = dict(results[-1])
        if len(results) > 1:
            texts = [str(r["result"]) for r in results if isinstance(r.get("result"), str)]
            final["result"] = "\n\n".join(t for t in texts if t)
            final["num_turns"] = sum(int(r.get("num_turns") or 0) for r in results)
        cost = final.get("total_cost_usd")
        if isinstance(cost, int | float):
            # The CLI counts cost from its start; a turn reports its own share.
            final["total_cost_usd"] = max(0.0, round(float(cost) - self._cost_base, 10))
            self._cost_base = float(cost)
        return final

    async def steer(self, text: str) -> bool:
        """Deliver ``text`` to the running turn.

        Returns:
            True once the CLI took the message up (it reached the agent during this
            turn); False when no turn is running, so the caller queues it as usual.
        """
        validate_prompt(text)
        turn = self._current
        if turn is None or not self.resident or self._handle.requested or turn.done.is_set():
            return False
        ack = asyncio.Event()
        turn.steers.append(ack)
        try:
            self._write({"type": "user", "message": {"role": "user", "content": text}})
        except TurnIOError:
            turn.steers.remove(ack)
            return False
        done = asyncio.create_task(turn.done.wait(), name=f"steer-wait-{self.session_id}")
        acked = asyncio.create_task(ack.wait(), name=f"steer-ack-{self.session_id}")
        try:
            await asyncio.wait({done, acked}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (done, acked):
                task.cancel()
        _LOGGER.info(
            "steering message %s",
            "taken up" if ack.is_set() else "not taken up",
            extra={"session_id": self.session_id},
        )
        return ack.is_set()

    # -- the process ---------------------------------------------------------------------
    async def _spawn(self) -> None:
        # The permission server lives as long as the process (the CLI connects once).
        await self._release_process()
        if self.options.approval is not None:
            listener = ApprovalListener(self.options.approval, worktree=self.options.cwd)
            await listener.__aenter__()
            self._listener = listener
        # The per-turn adapter's invocation: binary lookup, argv (resume or create),
        # environment with isolation, allowlist and the marker every descendant inherits.
        try:
            invocation = self.build_invocation("-")
        except BaseException:
            await self._release_process()
            raise
        self._cost_base = 0.0
        proc = await self._start(invocation.argv, invocation)
        _LOGGER.info(
            "warm %s process started pid=%s (%s)",
            self.cli_name,
            proc.pid,
            "resuming" if "--resume" in invocation.argv else "new session",
            extra={"session_id": self.session_id},
        )
        self._watch_output(proc)

    def _write(self, message: dict[str, Any]) -> None:
        message.setdefault("parent_tool_use_id", None)
        message.setdefault("session_id", self.session_id)
        self._send(message)

    async def _release_process(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            await listener.aclose()

    def _exited(self, code: int) -> None:
        for future in self._controls.values():
            if not future.done():
                future.cancel()
        self._controls.clear()

    def _line(self, raw: bytes) -> None:
        record = self._parser.parse(raw)
        if record is None:
            return
        kind = record.get("type")
        if kind == "control_response":
            response = record.get("response")
            request_id = response.get("request_id") if isinstance(response, dict) else None
            future = self._controls.pop(str(request_id), None)
            if future is not None and not future.done():
                future.set_result(record)
            return
        turn = self._current
        if turn is None:
            _LOGGER.debug("record between turns ignored: %s", kind)
            return
        if kind == "user" and record.get("isReplay"):
            if not turn.prompt_echoed:
                turn.prompt_echoed = True
            elif turn.steers:
                turn.steers.popleft().set()
            return
        self.turn.events += 1
        self.handle(record)
        if kind == "assistant" and isinstance(record.get("uuid"), str):
            turn.last_uuid = record["uuid"]
        if kind == "result":
            turn.results.append(record)
            # The result answers the prompt even if the CLI did not echo it.
            turn.prompt_echoed = True
            if turn.interrupting or not turn.steers:
                turn.done.set()

    async def _interrupt(self) -> None:
        """Stop the running turn: the CLI's interrupt, else the process group goes."""
        turn = self._current
        if turn is None or turn.done.is_set():
            return
        if not self.resident:
            await turn.done.wait()
            return
        turn.interrupting = True
        request_id = f"req_{uuid.uuid4().hex[:12]}"
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._controls[request_id] = answer
        try:
            self._write(
                {
                    "type": "control_request",
                    "request_id": request_id,
                    "request": {"subtype": "interrupt"},
                }
            )
            async with asyncio.timeout(self.preempt.grace):
                await turn.done.wait()
        except (TimeoutError, TurnIOError):
            await self._kill("the interrupt did not end the turn")
            return
        finally:
            self._controls.pop(request_id, None)
        if turn.steers:
            # Messages the CLI had not taken up yet would run as a turn nobody waits for.
            await self._kill("steering messages were still queued when the turn stopped")
            return
        # The CLI stops its tools itself, yet a tool command lives in a session of its
        # own and may take a moment to go: "stopped" means they are gone.
        await self._kill_tool_processes()


async def close_agent(agent: object) -> None:
    """Close ``agent``'s resident process, if it has one (per-turn agents have none).

    A wrapper (a run's session, an auto-mode runner) is seen through: its ``agent``.
    """
    for _ in range(4):
        if isinstance(agent, WarmMember):
            break
        inner = getattr(agent, "agent", None)
        if inner is None:
            return
        agent = inner
    if isinstance(agent, WarmMember) and getattr(agent, "warm", False):
        await agent.aclose()
