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

Long: one resident process's life (spawn, reader, turn bookkeeping, steering, interrupt)
and the pool that bounds residents stay together; Codex's app-server
(:mod:`engine.agents.warm_codex`) uses the pool, the pre-empt handle and the tool clean-up
from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, Protocol, runtime_checkable

from engine.agents.base import AgentOptions
from engine.agents.claude import ClaudeAgent
from engine.agents.stream import (
    TURN_MARKER_VAR,
    EventCallback,
    EventKind,
    JsonLines,
    find_binary,
)
from engine.errors import TurnExecError, TurnIOError, TurnPreempted
from engine.process import (
    STDERR_TAIL,
    PreemptHandle,
    ProcessResult,
    _wait_group_gone,
    lifeline,
    validate_prompt,
)
from engine.reaper import TurnProcess, kill_marked, marked_pids, start_time, wait_gone
from engine.redact import tail
from engine.turn import TurnOutput

__all__ = [
    "WarmClaudeAgent",
    "WarmPool",
    "WarmPreemptHandle",
    "WarmSupport",
    "claude_warm_support",
    "close_agent",
    "report_process",
]

_LOGGER = logging.getLogger(__name__)

_CHUNK: Final = 64 * 1024
_MAX_LINE: Final = 64 * 1024 * 1024
# How long a resident process that was asked to leave (stdin closed) gets to exit before
# its group is killed. It bounds clean-up of an idle process, not any turn.
_CLOSE_GRACE: Final = 5.0
_HELP_TIMEOUT: Final = 60.0
# The CLI saves its transcript some milliseconds after printing the result.
_TRANSCRIPT_WAIT: Final = 2.0
_TRANSCRIPT_POLL: Final = 0.005
_TOOLS_GONE_WAIT: Final = 10.0


class WarmPreemptHandle(PreemptHandle):
    """``/stop`` for a warm session: interrupts the running turn, not the process.

    The session registers how to stop its running turn (:meth:`_begin`); :meth:`stop`
    calls it once and waits until the turn is over, like the per-turn handle waits until
    the process group is gone.
    """

    def __init__(self, *, grace: float = 5.0, session_id: str | None = None) -> None:
        super().__init__(grace=grace, session_id=session_id)
        self._stopper: Callable[[], Awaitable[None]] | None = None

    @property
    def active(self) -> bool:
        return self._stopper is not None

    def _begin(self, stopper: Callable[[], Awaitable[None]]) -> None:
        if self._stopper is not None:
            raise RuntimeError("a turn is already in flight on this pre-empt handle")
        self._stopper = stopper
        self._requested = False
        self._gone.clear()

    def _end(self) -> None:
        self._stopper = None
        self._gone.set()

    async def stop(self) -> bool:
        stopper = self._stopper
        if stopper is None:
            return False
        if not self._requested:
            self._requested = True
            _LOGGER.info("interrupting the warm turn", extra={"session_id": self.session_id})
            await asyncio.shield(stopper())
        await self._gone.wait()
        return True


@runtime_checkable
class WarmMember(Protocol):
    """What the pool needs of a warm session."""

    @property
    def busy(self) -> bool: ...

    @property
    def resident(self) -> bool: ...

    last_used: float

    async def aclose(self) -> None: ...


class WarmPool:
    """At most ``max_sessions`` resident agent processes; idle ones leave after a while.

    A session asks to be admitted before it starts a process (:meth:`admit`): when the
    pool is full, the least recently used idle member is closed to make room; when every
    member is busy, the newcomer is refused and runs that one turn without staying
    resident. Members idle for ``idle_seconds`` are closed by :meth:`sweep`, which a
    background task runs when the earliest one is due (started on the first admission,
    ended by :meth:`aclose`).
    """

    def __init__(
        self,
        *,
        max_sessions: int = 4,
        idle_seconds: float = 15 * 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_sessions = max_sessions
        self.idle_seconds = idle_seconds
        self.clock = clock
        self._members: dict[WarmMember, None] = {}
        self._changed = asyncio.Event()
        self._reaper: asyncio.Task[None] | None = None
        self.evictions = 0
        self.expired = 0

    @property
    def members(self) -> list[WarmMember]:
        """Sessions with a resident process, least recently used first."""
        return sorted(self._members, key=lambda m: m.last_used)

    def __len__(self) -> int:
        return len(self._members)

    async def admit(self, member: WarmMember) -> bool:
        """Make room for ``member``'s new process; False when it must not stay resident."""
        await self.sweep()
        while len([m for m in self._members if m is not member]) >= self.max_sessions:
            idle = [m for m in self.members if m is not member and not m.busy]
            if not idle:
                _LOGGER.info(
                    "all %d warm sessions are busy: this turn's process will not stay",
                    self.max_sessions,
                )
                return False
            victim = idle[0]
            _LOGGER.info("evicting the least recently used warm session to make room")
            self.evictions += 1
            self._members.pop(victim, None)
            await victim.aclose()
        self._members[member] = None
        self._ensure_reaper()
        self._changed.set()
        return True

    def touch(self, member: WarmMember) -> None:
        """A turn of ``member`` ended: its idle time starts now."""
        member.last_used = self.clock()
        self._changed.set()

    def forget(self, member: WarmMember) -> None:
        """``member``'s process is gone."""
        self._members.pop(member, None)
        self._changed.set()

    def _due(self) -> list[WarmMember]:
        now = self.clock()
        return [
            m
            for m in self.members
            if not m.busy and m.resident and now - m.last_used >= self.idle_seconds
        ]

    async def sweep(self) -> int:
        """Close every member idle for ``idle_seconds``; returns how many."""
        due = self._due()
        for member in due:
            if member.busy:  # a turn started while we closed another one
                continue
            _LOGGER.info("closing a warm session idle for %.0f s", self.clock() - member.last_used)
            self._members.pop(member, None)
            self.expired += 1
            await member.aclose()
        return len(due)

    def _next_due_in(self) -> float | None:
        idle = [m.last_used for m in self._members if not m.busy]
        if not idle:
            return None
        return max(0.0, min(idle) + self.idle_seconds - self.clock())

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.create_task(self._reap(), name="warm-pool-reaper")

    async def _reap(self) -> None:
        while True:
            self._changed.clear()
            wait = self._next_due_in()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._changed.wait()
            await self.sweep()

    async def aclose(self) -> None:
        """Close every resident process and stop the background task."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        members, self._members = list(self._members), {}
        for member in members:
            await member.aclose()

    async def __aenter__(self) -> WarmPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


@dataclass(frozen=True, slots=True)
class WarmSupport:
    """Whether an installed CLI can stay resident, and why (for ``agents`` / ``doctor``)."""

    supported: bool
    reason: str


_SUPPORT_CACHE: dict[tuple[str, int, int], WarmSupport] = {}


def claude_warm_support(binary: str, *, path: str | None = None) -> WarmSupport:
    """Whether the installed ``claude`` takes turns on stdin (read from its ``--help``).

    The answer is cached per binary file (path, size and modification time), so a
    CLI upgrade is noticed and the help is read once otherwise.
    """
    program = find_binary(binary, path if path is not None else os.environ.get("PATH"))
    if program is None:
        return WarmSupport(False, f"{binary!r} was not found")
    real = os.path.realpath(program)
    try:
        stat = os.stat(real)
    except OSError as exc:
        return WarmSupport(False, f"{binary!r} cannot be read: {exc.strerror}")
    key = (real, stat.st_size, stat.st_mtime_ns)
    cached = _SUPPORT_CACHE.get(key)
    if cached is not None:
        return cached
    try:
        done = subprocess.run(
            [program, "--help"],
            capture_output=True,
            timeout=_HELP_TIMEOUT,
            check=False,
            env={**os.environ, "DISABLE_AUTOUPDATER": "1"},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return WarmSupport(False, f"`{binary} --help` failed: {exc}")
    text = done.stdout.decode("utf-8", errors="replace")
    missing = [
        flag
        for flag in ("--input-format", "stream-json", "--replay-user-messages")
        if flag not in text
    ]
    if missing:
        support = WarmSupport(
            False, f"this Claude Code version has no {', '.join(missing)} (one process per turn)"
        )
    else:
        support = WarmSupport(True, "takes turn after turn on stdin (stream-json input)")
    _SUPPORT_CACHE[key] = support
    return support


@dataclass(slots=True)
class _Turn:
    """The warm turn in flight."""

    started: float = field(default_factory=time.monotonic)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    results: list[dict[str, Any]] = field(default_factory=list)
    prompt_echoed: bool = False
    steers: deque[asyncio.Event] = field(default_factory=deque)
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    stderr: bytearray = field(default_factory=bytearray)
    exit_code: int | None = None
    failure: BaseException | None = None
    interrupting: bool = False
    last_uuid: str | None = None
    transcript_offset: int = 0


class WarmClaudeAgent(ClaudeAgent):
    """A Claude Code session whose process stays resident between turns.

    Attributes:
        spawns: how many processes this session started (one unless one died or left).
        pool: the pool that bounds resident processes (a private one by default).
        last_used: the pool clock's time at the end of the last turn.
    """

    warm: ClassVar[bool] = True

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
        session_id = session_id or str(uuid.uuid4())
        if preempt is None:
            preempt = WarmPreemptHandle(session_id=session_id)
        elif not isinstance(preempt, WarmPreemptHandle):
            raise TypeError("a warm session needs a WarmPreemptHandle")
        super().__init__(
            options, session_id=session_id, preempt=preempt, resume=resume, on_event=on_event
        )
        self._handle: WarmPreemptHandle = preempt
        self.pool = pool if pool is not None else WarmPool(max_sessions=1)
        self.spawns = 0
        self.last_used = self.pool.clock()
        self._proc: asyncio.subprocess.Process | None = None
        # The resident process's marker: every descendant inherits it, and the turn
        # watchdog kills them all if this process dies (engine.reaper).
        self._marker: str | None = None
        self._reader: asyncio.Task[None] | None = None
        self._stderr_reader: asyncio.Task[None] | None = None
        self._current: _Turn | None = None
        self._transient = False
        self._cost_base = 0.0
        self._controls: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._closing = False

    # -- what the pool sees ------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether a turn is in flight (or about to start)."""
        return self._lock.locked()

    @property
    def resident(self) -> bool:
        """Whether this session's process is running."""
        return self._reader is not None and not self._reader.done()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self.resident else None

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
    async def run_turn(self, prompt: str) -> TurnOutput:
        validate_prompt(prompt)
        self.check_prompt(prompt)
        async with self._lock:
            self.turns_started += 1
            try:
                return await self._run(prompt)
            except asyncio.CancelledError:
                # A cancelled turn (a shutdown that parks it) leaves no process behind.
                await asyncio.shield(self._kill("the turn was cancelled"))
                raise
            finally:
                self.emit(EventKind.TURN_END)
                self.pool.touch(self)
                if self._transient and self.resident:
                    await asyncio.shield(self._close())

    async def _run(self, prompt: str) -> TurnOutput:
        spawned = False
        if not self.resident:
            await self._spawn()
            spawned = True
        if self._proc is not None:
            await report_process(self.preempt, self._proc.pid, self._marker)
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
            if self._proc is not None:
                await report_process(self.preempt, self._proc.pid, self._marker)
            turn = await self._deliver(prompt)
        proc = self._proc
        assert proc is not None
        if self._handle.requested:
            raise TurnPreempted(session_id=self.session_id)
        saved = await self._await_transcript(turn)
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
        out.metadata["transcript_saved"] = saved
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

    def _transcript_size(self) -> int:
        try:
            return self.transcript_path().stat().st_size
        except OSError:
            return 0

    async def _await_transcript(self, turn: _Turn) -> bool:
        """Wait (briefly) until the CLI saved the turn's last message to its transcript.

        The resident CLI writes its transcript a moment after it prints the result (a
        process that exits flushes it first). A process killed in that moment would lose
        the exchange, and the next process would resume without it; so a turn ends once
        its last assistant message is on disk.
        """
        if turn.last_uuid is None or not self.resident:
            return turn.last_uuid is None
        needle = turn.last_uuid.encode()
        path = self.transcript_path()
        deadline = time.monotonic() + _TRANSCRIPT_WAIT
        while True:
            try:
                with path.open("rb") as fh:
                    fh.seek(turn.transcript_offset)
                    if needle in fh.read():
                        return True
            except OSError:
                pass
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
        # The per-turn adapter's invocation: binary lookup, argv (resume or create),
        # environment with isolation, allowlist and the marker every descendant inherits.
        invocation = self.build_invocation("-")
        admitted = await self.pool.admit(self)
        self._transient = not admitted
        marker = os.urandom(16).hex()
        env = {**self.environment(invocation), TURN_MARKER_VAR: marker}
        self._parser = JsonLines(self.cli_name)
        self._cost_base = 0.0
        guard = lifeline()
        guard.begin(marker)
        try:
            proc = await asyncio.create_subprocess_exec(
                *invocation.argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=self.options.cwd,
                env=env,
                start_new_session=True,
                limit=_CHUNK,
            )
        except OSError as exc:
            guard.end(marker)
            self.pool.forget(self)
            raise TurnExecError(
                f"cannot start {invocation.argv[0]!r}: {exc.strerror or exc}",
                binary=invocation.argv[0],
            ) from exc
        guard.spawned(marker, proc.pid)
        self._proc = proc
        self._marker = marker
        self.spawns += 1
        _LOGGER.info(
            "warm %s process started pid=%s (%s)",
            self.cli_name,
            proc.pid,
            "resuming" if "--resume" in invocation.argv else "new session",
            extra={"session_id": self.session_id},
        )
        self._reader = asyncio.create_task(self._read(proc), name=f"warm-stdout-{proc.pid}")
        self._stderr_reader = asyncio.create_task(
            self._read_stderr(proc), name=f"warm-stderr-{proc.pid}"
        )

    def _write(self, message: dict[str, Any]) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdin.is_closing():
            raise TurnIOError(f"{self.cli_name}'s resident process is not taking input")
        message.setdefault("parent_tool_use_id", None)
        message.setdefault("session_id", self.session_id)
        line = json.dumps(message, ensure_ascii=False) + "\n"
        try:
            proc.stdin.write(line.encode("utf-8"))
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise TurnIOError(f"{self.cli_name}'s resident process closed its input") from exc

    def _count(self, size: int) -> None:
        turn = self._current
        if turn is not None:
            turn.stdout_bytes += size

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        failure: BaseException | None = None
        try:
            await read_lines(
                proc.stdout,
                self._line,
                on_chunk=self._count,
                too_long=lambda: TurnIOError(
                    f"{self.cli_name} printed a stdout line over {_MAX_LINE} bytes",
                    line=self._parser.line + 1,
                ),
            )
        except TurnIOError as exc:
            failure = exc
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        except OSError as exc:
            failure = TurnIOError(f"reading {self.cli_name}'s output failed: {exc}")
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        code = await proc.wait()
        if self._marker is not None:
            lifeline().end(self._marker)
        if self._stderr_reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait({self._stderr_reader}, timeout=_CLOSE_GRACE)
        self.pool.forget(self)
        for future in self._controls.values():
            if not future.done():
                future.cancel()
        self._controls.clear()
        turn = self._current
        if not self._closing:
            _LOGGER.info(
                "warm %s process pid=%s exited with code %s%s",
                self.cli_name,
                proc.pid,
                code,
                " during a turn" if turn is not None else "",
                extra={"session_id": self.session_id},
            )
        if turn is not None and not turn.done.is_set():
            turn.exit_code = code
            turn.failure = failure
            turn.done.set()

    async def _read_stderr(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        while chunk := await proc.stderr.read(_CHUNK):
            turn = self._current
            if turn is None:
                continue
            turn.stderr_bytes += len(chunk)
            turn.stderr += chunk
            if len(turn.stderr) > STDERR_TAIL:
                del turn.stderr[: len(turn.stderr) - STDERR_TAIL]

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
        proc = self._proc
        if proc is not None and self._marker is not None:
            await _kill_tools(self._marker, proc.pid)

    async def _kill(self, why: str) -> None:
        """SIGKILL the process group and every process that carries its marker."""
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None:
            _LOGGER.info(
                "killing warm process pid=%s: %s",
                proc.pid,
                why,
                extra={"session_id": self.session_id},
            )
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        await _wait_group_gone(proc.pid)
        if self._marker is not None:
            await wait_gone(kill_marked(self._marker), _TOOLS_GONE_WAIT)
        await self._await_readers()

    async def _await_readers(self) -> None:
        readers = {t for t in (self._reader, self._stderr_reader) if t is not None}
        if readers:
            await asyncio.wait(readers)
        self.pool.forget(self)

    async def _close(self) -> None:
        """Ask the idle process to leave (stdin closed), then make sure it is gone."""
        proc = self._proc
        if proc is None:
            return
        self._closing = True
        try:
            if proc.returncode is None and proc.stdin is not None:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    proc.stdin.close()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_CLOSE_GRACE):
                        await proc.wait()
            await self._kill("it did not leave when asked")
        finally:
            self._closing = False
            self._proc = None

    async def aclose(self) -> None:
        """Stop the resident process (waits for a running turn to end first)."""
        async with self._lock:
            await asyncio.shield(self._close())

    async def __aenter__(self) -> WarmClaudeAgent:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _tool_processes(marker: str, cli_group: int) -> list[int]:
    """Running processes that carry the session's marker outside the CLI's own group."""
    found: list[int] = []
    for pid in marked_pids(marker):
        try:
            group = os.getpgid(pid)
        except OSError:
            continue
        if group != cli_group:
            found.append(pid)
    return found


async def _kill_tools(marker: str, cli_group: int) -> None:
    """SIGKILL the stopped turn's tool processes and wait (bounded) until they are gone."""
    deadline = time.monotonic() + _TOOLS_GONE_WAIT
    while pids := _tool_processes(marker, cli_group):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() >= deadline:
            _LOGGER.warning("tool processes %s of a stopped turn are still running", pids)
            return
        await asyncio.sleep(0.01)


async def report_process(preempt: PreemptHandle, pid: int, marker: str | None) -> None:
    """Tell whoever records the turn which process runs it: the resident one.

    As for a per-turn process (``PreemptHandle.on_spawn``): a start-up after a crash kills
    what is left of a turn that was running, and ``turnstile runs`` tells from the last
    finished turn's process whether a session is still warm.
    """
    if preempt.on_spawn is None or marker is None:
        return
    try:
        await preempt.on_spawn(TurnProcess(pid=pid, start=start_time(pid), marker=marker))
    except Exception:
        # The turn runs on; only a clean-up after a crash would miss it.
        _LOGGER.exception("recording the resident process pid=%s of the turn failed", pid)


async def read_lines(
    stream: asyncio.StreamReader,
    on_line: Callable[[bytes], None],
    *,
    on_chunk: Callable[[int], None],
    too_long: Callable[[], BaseException],
) -> None:
    """Read a resident CLI's stdout to its end, one JSON line at a time: ``on_line`` for
    each line (the last one also without its newline), ``on_chunk`` with each read's size;
    a line growing past :data:`_MAX_LINE` raises ``too_long()``."""
    partial = bytearray()
    while chunk := await stream.read(_CHUNK):
        on_chunk(len(chunk))
        start = 0
        while (nl := chunk.find(b"\n", start)) >= 0:
            partial += chunk[start:nl]
            start = nl + 1
            line = bytes(partial)
            partial.clear()
            on_line(line)
        partial += chunk[start:]
        if len(partial) > _MAX_LINE:
            raise too_long()
    if partial:
        on_line(bytes(partial))


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
