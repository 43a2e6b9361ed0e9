"""Warm Codex sessions: one resident ``codex app-server`` per session, turn after turn.

``codex app-server`` (experimental in the pinned 0.171.0) speaks JSON-RPC 2.0, one JSON
object per line, over stdin and stdout. What it takes and says was read from the installed
CLI itself (``codex app-server generate-json-schema``) and measured against the fake model
API (``tests/test_agents_warm_codex.py``):

- A connection opens with an ``initialize`` request and an ``initialized`` notification.
- ``thread/start`` creates the session's thread (its id is the session id, the same id
  ``codex exec`` names its threads by); ``thread/resume`` loads it from the rollout on disk
  in a new process. Sandbox, approval policy, model and cwd are the thread's parameters.
- ``turn/start`` answers at once with the turn's id; the turn is over when the server sends
  ``turn/completed`` for it (status ``completed``, ``failed`` or ``interrupted``), never on
  a timer. Progress comes as ``item/started`` / ``item/completed`` notifications.
- ``turn/steer`` adds a message to the running turn (the next model request carries it);
  ``turn/interrupt`` stops the running turn within milliseconds and the process stays.

A process that dies (crash, ``kill -9``, eviction, a restart) is simply gone: the next turn
starts a new one and resumes the same thread. Everything else is the per-turn adapter's
(:class:`~engine.agents.codex.CodexAgent`): binary lookup, isolation, sandbox from the tool
allowlist, the :class:`~engine.turn.TurnOutput` it composes and its metadata. The pool that
bounds resident processes, the ``/stop`` handle and the resident process's life (its own
session, readers, stderr tail, closing) are :mod:`engine.agents.resident`'s, shared with
Claude Code's warm sessions.

Long: the app-server's protocol (the JSON-RPC calls, turn bookkeeping, steering, interrupt)
is one object, as for Claude Code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final

from engine.agents.base import AgentOptions
from engine.agents.codex import _MISSING, CodexAgent, codex_sandbox_args
from engine.agents.probe import Finished, Probe, ask, ask_async
from engine.agents.resident import ResidentAgent, ResidentTurn, WarmPool
from engine.agents.stream import (
    EventCallback,
    EventKind,
    TurnState,
)
from engine.agents.warm import WarmSupport
from engine.errors import TurnIOError, TurnPreempted
from engine.process import (
    STDERR_TAIL,
    PreemptHandle,
    ProcessResult,
    validate_prompt,
)
from engine.redact import redact, tail
from engine.turn import TurnOutput

__all__ = ["WarmCodexAgent", "codex_warm_support", "codex_warm_support_async"]

_LOGGER = logging.getLogger(__name__)

# Bounds on the CLI's answers to set-up requests, never on a turn.
_SETUP_TIMEOUT: Final = 120.0
_SCHEMA_TIMEOUT: Final = 60.0
# Codex appends the turn to its rollout a moment after it reports the turn complete.
_ROLLOUT_WAIT: Final = 2.0
_ROLLOUT_POLL: Final = 0.005

# What a warm session needs of the app-server (requests, and the notification a turn
# ends on); steering is used where the CLI has it.
_NEEDED_REQUESTS: Final = ("initialize", "thread/start", "thread/resume", "turn/start")
_INTERRUPT: Final = "turn/interrupt"
_STEER: Final = "turn/steer"
_TOOL_ITEMS: Final = {
    "commandExecution": "command_execution",
    "fileChange": "file_change",
    "mcpToolCall": "mcp_tool_call",
    "dynamicToolCall": "dynamic_tool_call",
    "webSearch": "web_search",
}


@dataclass(frozen=True, slots=True)
class CodexWarmSupport(WarmSupport):
    """:class:`WarmSupport` plus what the app-server offers beyond the minimum."""

    interrupt: bool = False
    steer: bool = False


def _methods(schema: object) -> set[str]:
    """Every ``method`` constant in a JSON schema bundle."""
    found: set[str] = set()
    stack: list[object] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            method = node.get("properties", {}).get("method") if "properties" in node else None
            if isinstance(method, dict):
                for key in ("enum", "const"):
                    value = method.get(key)
                    if isinstance(value, list):
                        found.update(str(v) for v in value)
                    elif isinstance(value, str):
                        found.add(value)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found


def _schema_args(folder: Path) -> list[str]:
    return ["app-server", "generate-json-schema", "--out", str(folder / "schema")]


def _schema_env(folder: Path) -> dict[str, str]:
    # A private home: asking for the schema must not touch anyone's Codex state.
    return {**os.environ, "HOME": str(folder), "CODEX_HOME": str(folder / ".codex")}


def _read_schema(done: Finished) -> CodexWarmSupport:
    if done.returncode != 0:
        return CodexWarmSupport(
            False,
            "this Codex version has no app-server protocol schema "
            f"(`codex app-server generate-json-schema` exited {done.returncode}; "
            "one process per turn)",
        )
    out = done.folder / "schema"
    try:
        requests = _methods(json.loads((out / "ClientRequest.json").read_text("utf-8")))
        notes = _methods(json.loads((out / "ServerNotification.json").read_text("utf-8")))
    except (OSError, ValueError) as exc:
        return CodexWarmSupport(False, f"the app-server schema could not be read: {exc}")
    missing = [m for m in _NEEDED_REQUESTS if m not in requests]
    if "turn/completed" not in notes:
        missing.append("turn/completed")
    if missing:
        return CodexWarmSupport(
            False, f"this Codex app-server lacks {', '.join(missing)} (one process per turn)"
        )
    interrupt, steer = _INTERRUPT in requests, _STEER in requests
    extras = [
        "interrupts a turn" if interrupt else "no interrupt (a stop ends the process)",
        "steers a running turn" if steer else "no steering (messages wait for the next turn)",
    ]
    return CodexWarmSupport(
        True,
        f"takes turn after turn on its app-server ({', '.join(extras)})",
        interrupt=interrupt,
        steer=steer,
    )


_SCHEMA_PROBE: Final = Probe(
    name="codex-warm-1",
    label="`codex app-server generate-json-schema`",
    answer_type=CodexWarmSupport,
    args=_schema_args,
    read=_read_schema,
    failed=lambda reason: CodexWarmSupport(False, reason),
    env=_schema_env,
    timeout=_SCHEMA_TIMEOUT,
)


def codex_warm_support(
    binary: str, *, path: str | None = None, cache: Path | None = None
) -> CodexWarmSupport:
    """Whether the installed ``codex`` has an app-server a warm session can drive.

    Read from the CLI's own protocol schema (``codex app-server generate-json-schema``),
    asked once per binary file and version (:mod:`engine.agents.probe`), the answer kept
    in memory and in the file ``cache``; inside a running event loop an answer not known
    yet is "not supported, being asked" (async code awaits
    :func:`codex_warm_support_async`).
    """
    return ask(_SCHEMA_PROBE, binary, path=path, cache=cache)


async def codex_warm_support_async(
    binary: str, *, path: str | None = None, cache: Path | None = None
) -> CodexWarmSupport:
    """:func:`codex_warm_support` for async code: the CLI runs off the event loop."""
    return await ask_async(_SCHEMA_PROBE, binary, path=path, cache=cache)


class _RpcError(Exception):
    """The app-server answered a request with a JSON-RPC error."""

    def __init__(self, method: str, error: Mapping[str, Any]) -> None:
        self.method = method
        self.code = error.get("code")
        self.text = str(error.get("message", "error"))
        super().__init__(f"{method}: {self.text}")


@dataclass(slots=True)
class _Turn(ResidentTurn):
    """The warm turn in flight."""

    turn_id: str | None = None
    completed: dict[str, Any] | None = None
    rollout_offset: int = 0


class WarmCodexAgent(ResidentAgent[_Turn], CodexAgent):
    """A Codex thread whose ``codex app-server`` stays resident between turns (the
    process's life is :class:`~engine.agents.resident.ResidentAgent`'s).

    Attributes:
        support: what the installed app-server offers (interrupt, steering).
    """

    process_label: ClassVar[str] = "Codex app-server"

    def __init__(
        self,
        options: AgentOptions,
        *,
        session_id: str | None = None,
        preempt: PreemptHandle | None = None,
        resume: bool = False,
        on_event: EventCallback | None = None,
        pool: WarmPool | None = None,
        support: CodexWarmSupport | None = None,
    ) -> None:
        super().__init__(
            options,
            session_id=session_id,
            preempt=preempt,
            resume=resume,
            on_event=on_event,
            pool=pool,
        )
        self.support = support or CodexWarmSupport(True, "assumed", interrupt=True, steer=True)
        self._watcher: asyncio.Task[None] | None = None
        self._next_id = 0
        self._calls: dict[int, tuple[str, asyncio.Future[dict[str, Any]]]] = {}
        self._rollout: Path | None = None

    # -- argv --------------------------------------------------------------------------
    def server_argv(self, program: str) -> list[str]:
        """The resident process's argv (sandbox and model go with the thread)."""
        argv = [program, "app-server", "-c", "check_for_update_on_startup=false"]
        argv += ["-c", "analytics.enabled=false"]
        sandbox = codex_sandbox_args(self.options.allowlist)
        # ``-s MODE`` is a thread parameter here; any ``-c`` override stays a flag.
        argv += [a for i, a in enumerate(sandbox) if a == "-c" or (i and sandbox[i - 1] == "-c")]
        # As ``codex exec``: the commands keep their TMPDIR when Codex's own is moved so
        # that its sandbox can run them (:func:`~engine.agents.codex.codex_tmpdir_redirect`).
        argv += self.codex_config_args()
        argv += list(self.options.passthrough)
        return argv

    def thread_params(self) -> dict[str, Any]:
        """Parameters of ``thread/start`` and ``thread/resume``: what ``exec`` takes as flags."""
        sandbox = codex_sandbox_args(self.options.allowlist)
        params: dict[str, Any] = {
            "cwd": str(self.options.cwd),
            "sandbox": sandbox[sandbox.index("-s") + 1],
            # As ``codex exec``: the agent never stops to ask; the sandbox is the limit.
            "approvalPolicy": "never",
        }
        if self.options.model:
            params["model"] = self.options.model
        return params

    # -- turns -------------------------------------------------------------------------
    async def _run(self, prompt: str) -> TurnOutput:
        spawned = False
        missing: str | None = None
        if not self.resident:
            missing = await self._spawn()
            spawned = True
        if missing is not None:
            return self._missing(missing)
        await self._report()
        turn = await self._deliver(prompt)
        if not spawned and not self._handle.requested and turn.turn_id is None:
            # The process died between turns before it accepted this prompt (killed,
            # evicted by the OS): it never took it. A new one resumes the thread.
            _LOGGER.info(
                "the resident Codex process was gone before the turn; starting a new one",
                extra={"session_id": self.session_id},
            )
            await self._await_readers()
            missing = await self._spawn()
            spawned = True
            if missing is not None:
                return self._missing(missing)
            await self._report()
            turn = await self._deliver(prompt)
        proc = self._proc
        assert proc is not None
        if self._handle.requested:
            raise TurnPreempted(session_id=self.session_id)
        if turn.failure is not None:
            raise turn.failure
        saved = await self._await_rollout(turn)
        completed = turn.completed
        if completed is None:
            code = turn.exit_code if turn.exit_code is not None else -1
        else:
            status = completed.get("status")
            failed = status != "completed"
            code = 1 if failed else 0
            if failed:
                error = completed.get("error")
                message = error.get("message") if isinstance(error, dict) else None
                text = str(message or f"turn {status}")
                if not self.turn.errors or self.turn.errors[-1] != text:
                    self.turn.errors.append(text)
            self.turn.result = {
                "type": "turn.failed" if failed else "turn.completed",
                "turn": completed,
                "usage": self.turn.usage,
            }
            self.emit(
                EventKind.RESULT,
                text=(self.turn.errors[-1] if failed else (self.turn.texts or [""])[-1]),
                is_error=failed,
                raw=completed,
            )
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
        if completed is None and code == 0:
            # The CLI left without finishing the turn and said nothing about why.
            self.turn.errors.append("the Codex app-server exited during the turn")
            code = -1
            result = ProcessResult(
                exit_code=-1,
                stdout="",
                stdout_size=result.stdout_size,
                spill_path=None,
                stderr_tail=result.stderr_tail,
                stderr_size=result.stderr_size,
                pid=result.pid,
                duration=result.duration,
            )
        out = self.compose(result)
        out.metadata["warm"] = True
        out.metadata["rollout_saved"] = saved
        out.metadata["process_started"] = spawned
        if turn.turn_id is not None:
            out.metadata["turn_id"] = turn.turn_id
        return out

    def _missing(self, detail: str) -> TurnOutput:
        result = ProcessResult(
            exit_code=1,
            stdout="",
            stdout_size=0,
            spill_path=None,
            stderr_tail="",
            stderr_size=0,
            pid=self._proc.pid if self._proc is not None else 0,
            duration=0.0,
        )
        out = self.missing_session_output(result, detail)
        out.metadata["warm"] = True
        return out

    async def _deliver(self, prompt: str) -> _Turn:
        """Start the turn and wait until Codex reports it complete or its process is gone."""
        turn = _Turn(rollout_offset=self._rollout_size())
        self.turn = TurnState()
        self._current = turn
        self._handle._begin(self._interrupt)
        try:
            try:
                answer = await self._call(
                    "turn/start",
                    {"threadId": self.session_id, "input": [_text_input(prompt)]},
                )
            except TurnIOError:
                # The process is going: its reader ends the turn when its output closes.
                _LOGGER.info("the resident Codex process did not take the prompt")
                proc = self._proc
                if self._process_gone() and not turn.done.is_set():
                    turn.exit_code = proc.returncode if proc is not None else None
                    turn.done.set()
                await turn.done.wait()
                return turn
            except _RpcError as exc:
                turn.failure = TurnIOError(f"Codex refused the turn: {redact(exc.text)}")
                return turn
            started = answer.get("turn")
            if isinstance(started, dict) and isinstance(started.get("id"), str):
                turn.turn_id = started["id"]
            await turn.done.wait()
        finally:
            self._current = None
            self._handle._end()
        return turn

    def _process_gone(self) -> bool:
        return self._reader is None or self._reader.done()

    def _rollout_size(self) -> int:
        try:
            return self._rollout.stat().st_size if self._rollout is not None else 0
        except OSError:
            return 0

    async def _await_rollout(self, turn: _Turn) -> bool:
        """Wait (briefly) until Codex saved the finished turn to the thread's rollout.

        A process killed right after it reported the turn could lose the exchange, and
        the next process would resume without it; so a turn ends once it is on disk.
        """
        if turn.turn_id is None or self._rollout is None or turn.completed is None:
            return False
        needle = turn.turn_id.encode()
        deadline = time.monotonic() + _ROLLOUT_WAIT
        while True:
            with contextlib.suppress(OSError), self._rollout.open("rb") as fh:
                fh.seek(turn.rollout_offset)
                for line in fh.read().splitlines():
                    if b"task_complete" in line and needle in line:
                        return True
            if time.monotonic() >= deadline or not self.resident:
                _LOGGER.warning(
                    "Codex had not saved the turn to %s after %.0f s",
                    self._rollout,
                    _ROLLOUT_WAIT,
                    extra={"session_id": self.session_id},
                )
                return False
            await asyncio.sleep(_ROLLOUT_POLL)

    async def steer(self, text: str) -> bool:
        """Deliver ``text`` to the running turn (``turn/steer``).

        Returns:
            True once Codex accepted it into this turn; False when no turn is running
            or the CLI cannot steer, so the caller queues it as usual.
        """
        validate_prompt(text)
        turn = self._current
        if (
            not self.support.steer
            or turn is None
            or turn.turn_id is None
            or not self.resident
            or self._handle.requested
            or turn.done.is_set()
        ):
            return False
        try:
            await self._call(
                "turn/steer",
                {
                    "threadId": self.session_id,
                    "input": [_text_input(text)],
                    "expectedTurnId": turn.turn_id,
                },
            )
        except (TurnIOError, _RpcError) as exc:
            _LOGGER.info("steering message not taken up: %s", exc)
            return False
        _LOGGER.info("steering message taken up", extra={"session_id": self.session_id})
        return True

    # -- the process ---------------------------------------------------------------------
    async def _spawn(self) -> str | None:
        """Start the app-server and open the thread; the CLI's words if it lost the thread."""
        invocation = self.build_invocation("-")
        proc = await self._start(self.server_argv(invocation.argv[0]), invocation)
        resuming = self.started
        _LOGGER.info(
            "warm Codex app-server started pid=%s (%s)",
            proc.pid,
            "resuming" if resuming else "new thread",
            extra={"session_id": self.session_id},
        )
        self._watch_output(proc)
        self._watcher = asyncio.create_task(self._watch(proc), name=f"warm-watch-{proc.pid}")
        try:
            async with asyncio.timeout(_SETUP_TIMEOUT):
                return await self._open(resuming)
        except (TimeoutError, TurnIOError, _RpcError) as exc:
            stderr = bytes(self._spare_stderr)
            await self._kill("it did not open the thread")
            detail = exc.text if isinstance(exc, _RpcError) else str(exc) or "no answer"
            raise TurnIOError(
                f"the Codex app-server did not open the session: {redact(detail)}"
                + (f"; stderr: {tail(stderr, 512)}" if stderr.strip() else "")
            ) from exc

    async def _open(self, resuming: bool) -> str | None:
        await self._call(
            "initialize",
            {
                "clientInfo": {"name": "turnstile", "title": None, "version": "1"},
                "capabilities": {"experimentalApi": True, "requestAttestation": False},
            },
        )
        self._notify("initialized")
        if resuming:
            try:
                answer = await self._call(
                    "thread/resume",
                    {"threadId": self.session_id, "excludeTurns": True, **self.thread_params()},
                )
            except _RpcError as exc:
                if _MISSING in exc.text:
                    await self._close()
                    return exc.text
                raise
        else:
            answer = await self._call("thread/start", self.thread_params())
        thread = answer.get("thread")
        if not isinstance(thread, dict) or not isinstance(thread.get("id"), str):
            raise TurnIOError("the Codex app-server opened a thread without an id")
        thread_id = thread["id"]
        path = thread.get("path")
        self._rollout = Path(path) if isinstance(path, str) and path else None
        if not self.started:
            self._session_id = thread_id
            self.preempt.session_id = thread_id
            self.started = True
        self.emit(EventKind.SESSION, text=thread_id, raw=answer)
        return None

    async def _call(self, method: str, params: Mapping[str, Any]) -> dict[str, Any]:
        """Send one request and wait for its answer.

        Raises:
            _RpcError: the server answered with an error.
            TurnIOError: the process is not taking input, or went before it answered.
        """
        self._next_id += 1
        request_id = self._next_id
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._calls[request_id] = (method, future)
        try:
            self._write({"id": request_id, "method": method, "params": dict(params)})
            return await future
        finally:
            self._calls.pop(request_id, None)

    def _notify(self, method: str) -> None:
        self._write({"method": method})

    def _write(self, message: dict[str, Any]) -> None:
        if self._process_gone():
            raise TurnIOError("Codex's resident process is not taking input")
        self._send(message)

    def _exited(self, code: int) -> None:
        for method, future in self._calls.values():
            if not future.done():
                future.set_exception(
                    TurnIOError(
                        f"the Codex app-server exited (code {code}) before answering {method}"
                    )
                )

    async def _watch(self, proc: asyncio.subprocess.Process) -> None:
        """When our child exits, its group goes too.

        ``codex`` is a Node wrapper around the native app-server: killed on its own, it
        would leave the server running on our pipes, a process nobody counts. Its exit
        (seen through a pidfd: the pipes stay open) ends the session's process.
        """
        try:
            fd = os.pidfd_open(proc.pid)
        except OSError:
            return
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(fd, readable)
        try:
            await exited
        finally:
            loop.remove_reader(fd)
            os.close(fd)
        if not self._closing:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    def _line(self, raw: bytes) -> None:
        record = self._parser.parse(raw)
        if record is None:
            return
        if "id" in record and "method" not in record:
            self._answer(record)
            return
        method = record.get("method")
        if not isinstance(method, str):
            return
        if "id" in record:
            self._server_request(record["id"], method)
            return
        params = record.get("params")
        self._notification(method, params if isinstance(params, dict) else {})

    def _answer(self, record: dict[str, Any]) -> None:
        call = self._calls.get(record["id"]) if isinstance(record["id"], int) else None
        if call is None:
            return
        method, future = call
        if future.done():
            return
        error = record.get("error")
        if isinstance(error, dict):
            future.set_exception(_RpcError(method, error))
        else:
            result = record.get("result")
            future.set_result(result if isinstance(result, dict) else {})

    def _server_request(self, request_id: object, method: str) -> None:
        """Answer a request from the server: approvals are declined, as ``exec`` would.

        With the approval policy ``never`` Codex does not ask; a CLI that asks anyway gets
        a refusal, never a silent yes.
        """
        _LOGGER.info("Codex asked %s; declined", method, extra={"session_id": self.session_id})
        reply: dict[str, Any] = {"id": request_id}
        if method in ("item/commandExecution/requestApproval", "item/fileChange/requestApproval"):
            reply["result"] = {"decision": "decline"}
        elif method in ("execCommandApproval", "applyPatchApproval"):
            reply["result"] = {"decision": "abort"}
        else:
            reply["error"] = {"code": -32601, "message": f"turnstile does not answer {method}"}
        with contextlib.suppress(TurnIOError):
            self._write(reply)

    def _notification(self, method: str, params: dict[str, Any]) -> None:
        turn = self._current
        if turn is None:
            return
        if params.get("threadId") not in (None, self.session_id):
            return
        turn_id = params.get("turnId")
        if turn.turn_id is not None and isinstance(turn_id, str) and turn_id != turn.turn_id:
            return
        self.turn.events += 1
        if method in ("item/started", "item/completed"):
            item = params.get("item")
            if isinstance(item, dict):
                self._app_item(method == "item/completed", item, params)
        elif method == "thread/tokenUsage/updated":
            usage = params.get("tokenUsage")
            last = usage.get("last") if isinstance(usage, dict) else None
            if isinstance(last, dict):
                self.turn.usage = _snake_usage(last)
        elif method == "error":
            error = params.get("error")
            message = str(error.get("message") if isinstance(error, dict) else "error")
            if not params.get("willRetry"):
                self.turn.errors.append(message)
            self.emit(EventKind.ERROR, text=message, is_error=True, raw=params)
        elif method == "warning":
            self.emit(EventKind.ERROR, text=str(params.get("message", "")), raw=params)
        elif method == "turn/completed":
            done = params.get("turn")
            if not isinstance(done, dict):
                return
            if turn.turn_id is not None and done.get("id") != turn.turn_id:
                return
            turn.completed = done
            turn.done.set()

    def _app_item(self, done: bool, item: dict[str, Any], raw: dict[str, Any]) -> None:
        item_type = item.get("type")
        item_id = str(item.get("id", ""))
        if item_type == "agentMessage" and done:
            self.turn.model_turns += 1
            text = str(item.get("text", ""))
            if text:
                self.turn.texts.append(text)
                self.emit(EventKind.TEXT, text=text, raw=raw)
        elif isinstance(item_type, str) and item_type in _TOOL_ITEMS:
            tool = _TOOL_ITEMS[item_type]
            what = item.get("command") or item.get("tool")
            text = str(what or json.dumps(item.get("changes", "")))
            if not done:
                self.turn.tool_calls += 1
                self.emit(EventKind.TOOL_USE, text=text, tool=tool, tool_id=item_id, raw=raw)
            else:
                code = item.get("exitCode")
                failed = item.get("status") in ("failed", "declined") or code not in (0, None)
                self.emit(
                    EventKind.TOOL_RESULT,
                    text=str(item.get("aggregatedOutput") or ""),
                    tool=tool,
                    tool_id=item_id,
                    is_error=failed,
                    raw=raw,
                )

    async def _interrupt(self) -> None:
        """Stop the running turn: the CLI's interrupt, else the process group goes."""
        turn = self._current
        if turn is None or turn.done.is_set():
            return
        if not self.resident:
            await turn.done.wait()
            return
        if not self.support.interrupt or turn.turn_id is None:
            await self._kill("a stop without the app-server's interrupt")
            return
        try:
            async with asyncio.timeout(self.preempt.grace):
                await self._call(
                    "turn/interrupt", {"threadId": self.session_id, "turnId": turn.turn_id}
                )
                await turn.done.wait()
        except (TimeoutError, TurnIOError, _RpcError):
            await self._kill("the interrupt did not end the turn")
            return
        # "Stopped" means the turn's commands are gone too.
        await self._kill_tool_processes()

    def _tasks(self) -> tuple[asyncio.Task[None] | None, ...]:
        return (self._reader, self._stderr_reader, self._watcher)


def _text_input(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text, "text_elements": []}


def _snake_usage(breakdown: Mapping[str, Any]) -> dict[str, Any]:
    """The app-server's token counts in the keys ``codex exec`` reports them with."""
    names = {
        "inputTokens": "input_tokens",
        "cachedInputTokens": "cached_input_tokens",
        "outputTokens": "output_tokens",
        "reasoningOutputTokens": "reasoning_output_tokens",
        "totalTokens": "total_tokens",
    }
    return {snake: breakdown[camel] for camel, snake in names.items() if camel in breakdown}
