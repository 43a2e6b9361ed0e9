"""Resident agent processes: what Claude Code's and Codex's warm sessions share.

A warm session (:mod:`engine.agents.warm` for Claude Code, :mod:`engine.agents.warm_codex`
for Codex's app-server) keeps one CLI process for turn after turn. What does not depend on
the CLI's protocol is here:

- :class:`ResidentAgent`, the base of both: the turn lock and its clean-up, the process
  started in a session (process group) of its own with a marker every descendant
  inherits (the turn watchdog kills them all if this process dies), its stdout read one
  JSON line at a time (:func:`read_lines`) and its stderr tail kept, and closing: stdin
  closed, a grace period, then SIGKILL of the group and of every marked process.
- :class:`WarmPool`, which bounds how many processes stay resident and closes idle ones
  (an operator's memory policy), and :class:`WarmPreemptHandle`, ``/stop`` for a warm turn.

Long: the pool, the pre-empt handle and the base class are one mechanism (the base is what
the pool admits, evicts and closes, and what the handle interrupts).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from abc import abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Final, Generic, Protocol, Self, TypeVar, runtime_checkable

from engine.agents.base import AgentOptions, Invocation
from engine.agents.stream import (
    TURN_MARKER_VAR,
    EventCallback,
    EventKind,
    JsonLines,
    JsonStreamAgent,
)
from engine.errors import TurnExecError, TurnIOError
from engine.process import (
    STDERR_TAIL,
    PreemptHandle,
    _wait_group_gone,
    lifeline,
    record_spawn,
    validate_prompt,
)
from engine.reaper import TurnProcess, kill_marked, marked_pids, start_time, wait_gone
from engine.turn import TurnOutput

__all__ = [
    "ResidentAgent",
    "ResidentTurn",
    "WarmMember",
    "WarmPool",
    "WarmPreemptHandle",
    "read_lines",
    "report_process",
]

_LOGGER = logging.getLogger(__name__)

_KEEPER: Final = str(Path(__file__).resolve().parent.parent / "keeper.py")

_CHUNK: Final = 64 * 1024
_MAX_LINE: Final = 64 * 1024 * 1024
# How long a resident process that was asked to leave (stdin closed) gets to exit before
# its group is killed. It bounds clean-up of an idle process, not any turn.
_CLOSE_GRACE: Final = 5.0
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


def _exited(proc: asyncio.subprocess.Process) -> bool:
    """Whether ``proc`` (our child) has exited, reaped or not, without reaping it."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already: its return code is on its way
        return True


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
    await record_spawn(preempt, TurnProcess(pid=pid, start=start_time(pid), marker=marker))


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


@dataclass(slots=True)
class ResidentTurn:
    """What every warm turn in flight keeps (each CLI's turn adds its own fields)."""

    started: float = field(default_factory=time.monotonic)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    stderr: bytearray = field(default_factory=bytearray)
    exit_code: int | None = None
    failure: BaseException | None = None


TurnT = TypeVar("TurnT", bound=ResidentTurn)


class ResidentAgent(JsonStreamAgent, Generic[TurnT]):
    """A session whose CLI process stays resident between turns (see the module docstring).

    A subclass comes before its per-turn adapter (``class WarmX(ResidentAgent[Turn],
    XAgent)``) and gives the protocol: :meth:`_run` (one turn on the resident process,
    started by :meth:`_start` when there is none), :meth:`_line` (one stdout line) and
    :meth:`_interrupt` (``/stop``).

    Attributes:
        spawns: how many processes this session started (one unless one died or left).
        pool: the pool that bounds resident processes (a private one by default).
        last_used: the pool clock's time at the end of the last turn.
    """

    warm: ClassVar[bool] = True
    #: How logs name the resident process ("Claude Code process", "Codex app-server").
    process_label: ClassVar[str]

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
        self._current: TurnT | None = None
        self._transient = False
        # stderr while no turn runs (start-up), for an error that says why it failed.
        self._spare_stderr = bytearray()
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

    async def _drop_if_gone(self) -> None:
        """Between turns: let the resident process go if it had died (killed, evicted by
        the OS) though its output has not closed yet; a new one takes the turn.

        Our child may be dead while what it started still holds its output open for a
        moment, and might even read the next prompt before it goes: asked now, the
        prompt would die with it.
        """
        proc = self._proc
        if proc is None or not self.resident or not _exited(proc):
            return
        _LOGGER.info(
            "the resident %s process was gone before the turn; starting a new one",
            self.process_label,
            extra={"session_id": self.session_id},
        )
        await self._kill("gone before the turn")
        await self._await_readers()

    # -- what a subclass gives -----------------------------------------------------------
    @abstractmethod
    async def _run(self, prompt: str) -> TurnOutput:
        """One turn on the resident process (holding the turn lock)."""

    @abstractmethod
    def _line(self, raw: bytes) -> None:
        """One line of the resident process's stdout."""

    @abstractmethod
    async def _interrupt(self) -> None:
        """Stop the running turn (``/stop``)."""

    def _exited(self, code: int) -> None:
        """The process exited (before the turn in flight, if any, is ended)."""

    async def _release_process(self) -> None:
        """Release what lived as long as the process (called once it is gone, and again
        when it is closed: it must be idempotent)."""

    def _tasks(self) -> tuple[asyncio.Task[None] | None, ...]:
        """The tasks that live as long as the process (awaited when it is gone)."""
        return (self._reader, self._stderr_reader)

    # -- turns -------------------------------------------------------------------------
    async def run_turn(self, prompt: str) -> TurnOutput:
        validate_prompt(prompt)
        self.check_prompt(prompt)
        async with self._lock:
            self.turns_started += 1
            try:
                await self._drop_if_gone()
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

    async def _report(self) -> None:
        """Tell whoever records the turn that the resident process runs it."""
        if self._proc is not None:
            await report_process(self.preempt, self._proc.pid, self._marker)

    # -- the process ---------------------------------------------------------------------
    async def _start(self, argv: list[str], invocation: Invocation) -> asyncio.subprocess.Process:
        """Start the resident process (admitted to the pool first) and its readers.

        ``invocation``: the per-turn adapter's (environment with isolation, allowlist);
        the marker every descendant inherits is added to its environment.

        Raises:
            TurnExecError: the program could not be started.
        """
        admitted = await self.pool.admit(self)
        self._transient = not admitted
        marker = os.urandom(16).hex()
        env = {**self.environment(invocation), TURN_MARKER_VAR: marker}
        self._parser = JsonLines(self.cli_name)
        guard = lifeline()
        guard.begin(marker)
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._confined(argv),
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
                f"cannot start {argv[0]!r}: {exc.strerror or exc}", binary=argv[0]
            ) from exc
        guard.spawned(marker, proc.pid)
        self._proc = proc
        self._marker = marker
        self.spawns += 1
        return proc

    def _confined(self, argv: list[str]) -> list[str]:
        """``argv`` in the session's sandbox, under its keeper (:mod:`engine.keeper`): a
        sandbox dies with its parent, and the keeper lets a CLI that had just answered
        save that answer before it goes, should turnstile die."""
        confined = self.confine(argv)
        if self.options.walls is None:
            return confined
        return [sys.executable, "-I", "-S", _KEEPER, "--", *confined]

    def _watch_output(self, proc: asyncio.subprocess.Process) -> None:
        """Start reading the process's stdout and stderr."""
        self._reader = asyncio.create_task(self._read(proc), name=f"warm-stdout-{proc.pid}")
        self._stderr_reader = asyncio.create_task(
            self._read_stderr(proc), name=f"warm-stderr-{proc.pid}"
        )

    def _send(self, message: dict[str, Any]) -> None:
        """Write one JSON line to the process's stdin.

        Raises:
            TurnIOError: the process is not taking input.
        """
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdin.is_closing():
            raise TurnIOError(f"{self.cli_name}'s resident process is not taking input")
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
        self._exited(code)
        await self._release_process()
        turn = self._current
        if not self._closing:
            _LOGGER.info(
                "warm %s pid=%s exited with code %s%s",
                self.process_label,
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
        self._spare_stderr = bytearray()
        while chunk := await proc.stderr.read(_CHUNK):
            turn = self._current
            if turn is not None:
                turn.stderr_bytes += len(chunk)
            target = turn.stderr if turn is not None else self._spare_stderr
            target += chunk
            if len(target) > STDERR_TAIL:
                del target[: len(target) - STDERR_TAIL]

    async def _kill_tool_processes(self) -> None:
        """After an interrupt: "stopped" means the turn's tool processes are gone too (a
        tool command may live in a session of its own and take a moment to go)."""
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
                "killing warm %s pid=%s: %s",
                self.process_label,
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
        readers = {t for t in self._tasks() if t is not None}
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
            await self._release_process()

    async def aclose(self) -> None:
        """Stop the resident process (waits for a running turn to end first)."""
        async with self._lock:
            await asyncio.shield(self._close())

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
