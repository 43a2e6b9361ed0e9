"""One agent turn as a subprocess.

The prompt reaches the process only as argv elements (or stdin), never through a shell.
stdout and stderr are drained concurrently while the process runs; stdout is returned
verbatim (UTF-8 with replacement) and spilled to a file beyond a configurable size, so
the engine never holds an unbounded output. There is no wall-clock timeout: a turn ends
when the process exits, or when a person pre-empts it through a :class:`PreemptHandle`.

The process is watched from the event loop itself: its exit through a pidfd, its pipes
by reader callbacks that hand each chunk straight on. asyncio's subprocess transport
would add a thread per child (Python 3.11's child watcher), a stream and a task per
pipe, and an await inside the spawn where a cancel could land half-way.

Long: spawn, draining, spilling and the pre-emption path (the group, the marked
descendants, the grace, the cut-off of pipes still held) are one contract that shares the
turn's state; split apart, each part would need the others'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Final

from engine.errors import (
    InvalidPromptError,
    StoreError,
    TurnExecError,
    TurnIOError,
    TurnPreempted,
)
from engine.reaper import (
    TURN_MARKER_VAR,
    Lifeline,
    TurnProcess,
    kill_marked,
    marked_pids,
    signal_marked,
    start_time,
    wait_gone,
)
from engine.redact import tail
from engine.turn import AgentSession, TurnOutput

__all__ = [
    "DEFAULT_SPILL_LIMIT",
    "TURN_MARKER_VAR",
    "PreemptHandle",
    "ProcessResult",
    "ProcessSpec",
    "SerialTurnDriver",
    "TurnProcess",
    "default_spill_dir",
    "lifeline",
    "record_spawn",
    "run_process",
    "validate_prompt",
]

_LOGGER = logging.getLogger(__name__)

DEFAULT_SPILL_LIMIT: Final = 1024 * 1024
STDERR_TAIL: Final = 2048
# How much of stderr's end a turn keeps and shows (why it failed).
STDERR_SHOWN: Final = 1024
_CHUNK: Final = 64 * 1024
# After the agent exits, descendants that still hold its pipes get this long before the
# group is killed. It bounds clean-up, not the turn: the turn already ended.
_DRAIN_GRACE: Final = 2.0
_MAX_LINE: Final = 64 * 1024 * 1024
# SIGKILL is asynchronous: a stop waits up to this long for the group's other processes
# (not only the reaped leader) to finish dying, so "stopped" means they are gone.
_GROUP_GONE_WAIT: Final = 10.0
# Once the leader is gone and every process of the turn we can find is killed, the pipes
# get this long to reach end-of-file; then we stop reading (whoever still holds them is
# out of reach: it left the group and replaced its environment).
_EOF_WAIT: Final = 0.5

LineCallback = Callable[[bytes], None]

_LIFELINE: Lifeline | None = None


def lifeline() -> Lifeline:
    """This process's turn watchdog (see :mod:`engine.reaper`), made on first use.

    One per process by nature: it watches this process's own death.
    """
    global _LIFELINE
    if _LIFELINE is None:
        _LIFELINE = Lifeline()
    return _LIFELINE


SpawnCallback = Callable[[TurnProcess], Awaitable[None]]


def default_spill_dir() -> Path:
    """Where spilled outputs go unless a session says otherwise."""
    return Path(tempfile.gettempdir()) / "turnstile-spill"


def validate_prompt(prompt: str) -> None:
    """Refuse a prompt that must never reach a process.

    Raises:
        InvalidPromptError: the prompt is empty, only whitespace, or holds a NUL byte.
    """
    if not prompt or not prompt.strip():
        raise InvalidPromptError("the prompt is empty")
    if "\x00" in prompt:
        raise InvalidPromptError("the prompt contains a NUL byte")


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """How to start one turn's process.

    Attributes:
        argv: program and arguments; each element reaches the program unchanged.
        cwd: working directory (pinned per session by the adapters).
        env: the complete environment, or None to inherit ours.
        stdin: bytes written to the process's stdin, or None for no stdin.
        sandboxed: argv starts the agent in its sandbox (engine.sandbox): a stop asks the
            agent to end, not the sandbox around it, which would take the agent with it
            before it can save its session.
    """

    argv: Sequence[str]
    cwd: Path | None = None
    env: Mapping[str, str] | None = None
    stdin: bytes | None = None
    sandboxed: bool = False


@dataclass(frozen=True, slots=True)
class ProcessResult:
    """What a finished process left behind."""

    exit_code: int
    stdout: str
    stdout_size: int
    spill_path: Path | None
    stderr_tail: str
    stderr_size: int
    pid: int
    duration: float
    extra: dict[str, object] = field(default_factory=dict)

    def to_turn_output(self) -> TurnOutput:
        """The turn output: stdout verbatim with the exit code (and stderr's redacted end)."""
        metadata: dict[str, object] = {"stderr_size": self.stderr_size}
        if self.stderr_tail.strip():
            metadata["stderr_tail"] = tail(self.stderr_tail, STDERR_SHOWN)
        return TurnOutput(
            text=self.stdout,
            exit_code=self.exit_code,
            spill_path=self.spill_path,
            size=self.stdout_size,
            metadata=metadata,
        )


class PreemptHandle:
    """Stops the turn in flight for one session, bound to the owned child, not a PID number.

    ``stop()`` sends SIGTERM to the child's process group and to every process carrying
    the turn's marker, waits up to ``grace`` seconds for the child to exit, then SIGKILLs
    them all; the running turn raises :class:`TurnPreempted` without waiting for pipes a
    stray process may still hold.

    Attributes:
        on_spawn: awaited with the :class:`TurnProcess` of each turn once it runs (to
            record it with the turn, so that a restart after a crash can kill what is left).
    """

    def __init__(self, *, grace: float = 5.0, session_id: str | None = None) -> None:
        self.grace = grace
        self.session_id = session_id
        self.on_spawn: SpawnCallback | None = None
        self._proc: _Child | None = None
        self._turn: _Turn | None = None
        self._requested = False
        self._gone = asyncio.Event()
        self._gone.set()

    @property
    def active(self) -> bool:
        """Whether a turn's process is running now."""
        return self._proc is not None

    @property
    def requested(self) -> bool:
        """Whether the turn in flight was asked to stop."""
        return self._requested

    def _attach(self, proc: _Child) -> None:
        if self._proc is not None:
            raise RuntimeError("a turn is already in flight on this pre-empt handle")
        self._proc = proc
        self._requested = False
        self._gone.clear()

    def _detach(self) -> None:
        self._proc = None
        self._turn = None
        self._gone.set()

    async def stop(self) -> bool:
        """Pre-empt the running turn and wait until its processes are gone.

        Returns:
            True if a turn was running, False if there was nothing to stop.
        """
        turn = self._turn
        if self._proc is None or turn is None:
            return False
        if not self._requested:
            self._requested = True
            _LOGGER.info(
                "pre-empting pid=%s", turn.child.pid, extra={"session_id": self.session_id}
            )
            await asyncio.shield(turn.terminate(self.grace))
        await self._gone.wait()
        return True


class _Turn:
    """The processes of one running turn: the leader, its group, its marked descendants."""

    def __init__(self, child: _Child, marker: str, *, sandboxed: bool = False) -> None:
        self.child = child
        self.exited = child.exited
        self.marker = marker
        self.sandboxed = sandboxed

    def kill(self) -> None:
        """SIGKILL the group and every process that carries the marker, wherever it went."""
        _signal_group(self.child.pid, signal.SIGKILL)
        killed = kill_marked(self.marker)
        if killed:
            _LOGGER.info("killed %d process(es) of pid=%s's turn", len(killed), self.child.pid)

    async def terminate(self, grace: float) -> None:
        """SIGTERM everything, wait ``grace`` for the leader, SIGKILL everything, wait.

        In a sandbox, everything but the sandbox's own processes (the leader and the
        first process of its PID namespace): the sandbox ends when the agent does.
        """
        if self.sandboxed:
            own = {self.child.pid, *_children(self.child.pid)}
            for pid in marked_pids(self.marker):
                if pid not in own:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGTERM)
        else:
            _signal_group(self.child.pid, signal.SIGTERM)
            signal_marked(self.marker, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            # The exit itself, not the pipes' end: a descendant may hold them open.
            await asyncio.wait_for(self.exited.wait(), timeout=grace)
        # Descendants may ignore SIGTERM or outlive the leader: they are killed either way.
        self.kill()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.exited.wait(), timeout=_GROUP_GONE_WAIT)
        await self.wait_gone()

    async def wait_gone(self) -> None:
        """Wait (bounded) until nothing of the turn runs any more."""
        await _wait_group_gone(self.child.pid)
        if not await wait_gone(marked_pids(self.marker), _GROUP_GONE_WAIT):
            _LOGGER.warning("processes of pid=%s's turn still run after SIGKILL", self.child.pid)


async def _wait_group_gone(pgid: int) -> None:
    """Wait until no running (non-zombie) process is left in process group ``pgid``."""
    deadline = time.monotonic() + _GROUP_GONE_WAIT
    while _group_running(pgid):
        if time.monotonic() >= deadline:
            _LOGGER.warning("processes of group %s are still running after SIGKILL", pgid)
            return
        await asyncio.sleep(0.01)


def _stats() -> Iterator[tuple[int, list[bytes]]]:
    """Each process's pid and the fields of its ``/proc/PID/stat`` after the name (state,
    parent, group, ...); nothing where /proc is unavailable."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        yield int(entry), stat.rsplit(b")", 1)[1].split()


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    return [child for child, fields in _stats() if len(fields) > 1 and int(fields[1]) == pid]


def _group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (False where /proc is unavailable)."""
    return any(
        len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X")
        for _, fields in _stats()
    )


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class _PipeReader:
    """Reads one of the child's pipes from the event loop, handing each chunk on, to EOF.

    Attributes:
        done: resolved once the pipe is closed (end-of-file, failure, or given up).
        failure: what ended the reading early (a read error, or the consumer refusing a
            chunk); None after a plain end-of-file.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        pipe: IO[bytes],
        consume: Callable[[bytes], None],
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        self._loop = loop
        self._pipe = pipe
        self._fd = pipe.fileno()
        self._consume: Callable[[bytes], None] | None = consume
        self._on_failure = on_failure
        self.done: asyncio.Future[None] = loop.create_future()
        self.failure: Exception | None = None
        os.set_blocking(self._fd, False)
        loop.add_reader(self._fd, self._readable)

    def _readable(self) -> None:
        try:
            chunk = os.read(self._fd, _CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._fail(exc)
            return
        if not chunk or self._consume is None:
            self.close()
            return
        try:
            self._consume(chunk)
        except Exception as exc:  # raised by the turn once the process is gone
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        self.failure = exc
        if self._on_failure is not None:
            self._on_failure()
        self.close()

    def close(self) -> None:
        """Stop reading and close our end (a no-op once closed)."""
        if self._pipe.closed:
            return
        self._loop.remove_reader(self._fd)
        self._pipe.close()
        # Dropped now, not when the cycle collector runs: the consumer may hold the
        # turn's whole output, and the failure callback the turn (which holds us).
        self._consume = None
        self._on_failure = None
        if not self.done.done():
            self.done.set_result(None)


class _PipeWriter:
    """Writes bytes to the child's stdin from the event loop, then closes it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pipe: IO[bytes], data: bytes) -> None:
        self._loop = loop
        self._pipe = pipe
        self._fd = pipe.fileno()
        self._data = memoryview(data)
        self._waiting = False
        os.set_blocking(self._fd, False)
        self._writable()

    def _writable(self) -> None:
        try:
            while self._data:
                written = os.write(self._fd, self._data)
                self._data = self._data[written:]
        except (BlockingIOError, InterruptedError):
            if not self._waiting:
                self._waiting = True
                self._loop.add_writer(self._fd, self._writable)
            return
        except (BrokenPipeError, ConnectionResetError):
            pass  # it stopped reading its stdin: its choice, the turn goes on
        except OSError as exc:
            _LOGGER.warning("writing a turn's stdin failed: %s", exc)
        self.close()

    def close(self) -> None:
        if self._pipe.closed:
            return
        if self._waiting:
            self._loop.remove_writer(self._fd)
        self._data = memoryview(b"")
        self._pipe.close()


class _Child:
    """One spawned process, watched from the event loop: its exit, its pipes.

    The exit is seen through a pidfd (where the kernel offers none, a thread waits), and
    the process is reaped there, by us alone: its pid cannot be reused while it runs.
    """

    def __init__(self, popen: subprocess.Popen[bytes], loop: asyncio.AbstractEventLoop) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.exited = asyncio.Event()
        self.readers: list[_PipeReader] = []
        self._loop = loop
        self._writer: _PipeWriter | None = None
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # not Linux, or a kernel before 5.3
            name = f"wait-{self.pid}"
            threading.Thread(target=self._wait_in_thread, name=name, daemon=True).start()
        else:
            loop.add_reader(self._pidfd, self._on_exit)

    @property
    def returncode(self) -> int | None:
        """The exit status once reaped (negative: the signal that ended it)."""
        return self.popen.returncode

    def _on_exit(self) -> None:
        if self.popen.poll() is None:
            return
        assert self._pidfd is not None
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = None
        self.exited.set()

    def _wait_in_thread(self) -> None:
        self.popen.wait()
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self._loop.call_soon_threadsafe(self.exited.set)

    def read(
        self,
        pipe: IO[bytes] | None,
        consume: Callable[[bytes], None],
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        assert pipe is not None
        self.readers.append(_PipeReader(self._loop, pipe, consume, on_failure))

    def write(self, pipe: IO[bytes] | None, data: bytes) -> None:
        assert pipe is not None
        self._writer = _PipeWriter(self._loop, pipe, data)

    def pending(self) -> list[_PipeReader]:
        """The pipes not at end-of-file yet."""
        return [reader for reader in self.readers if not reader.done.done()]

    def failure(self) -> Exception | None:
        """What ended the reading of a pipe early, if anything did."""
        return next((r.failure for r in self.readers if r.failure is not None), None)

    def close(self) -> None:
        """Our ends of the pipes closed; a leader still running is killed.

        Its exit is still watched: it is reaped when it goes, whoever waits.
        """
        for reader in self.readers:
            reader.close()
        if self._writer is not None:
            self._writer.close()
        for pipe in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if pipe is not None:
                pipe.close()  # one a failed start-up left without its reader or writer
        if self.popen.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signal.SIGKILL)


async def record_spawn(preempt: PreemptHandle, process: TurnProcess) -> None:
    """Tell whoever records the turn (``PreemptHandle.on_spawn``) which process runs it.

    The turn runs on whatever happens here: only a clean-up after a crash would miss the
    process. The database away a moment (an outage) is said as such, not as a fault.
    """
    if preempt.on_spawn is None:
        return
    try:
        await preempt.on_spawn(process)
    except StoreError as exc:
        _LOGGER.warning("could not record pid=%s of the turn: %s", process.pid, exc)
    except Exception:
        _LOGGER.exception("recording pid=%s of the turn failed", process.pid)


async def _wait_readers(readers: list[_PipeReader], within: float) -> list[_PipeReader]:
    """Wait up to ``within`` seconds for ``readers`` to reach end-of-file; those that did not."""
    await asyncio.wait([reader.done for reader in readers], timeout=within)
    return [reader for reader in readers if not reader.done.done()]


class _StdoutSink:
    """Keeps stdout up to ``limit`` bytes in memory and spills the whole of it beyond."""

    def __init__(self, limit: int, spill_dir: Path | None, on_line: LineCallback | None) -> None:
        self._limit = limit
        self._spill_dir = spill_dir
        self._on_line = on_line
        self._head = bytearray()
        self._partial = bytearray()
        self.size = 0
        self.spill_path: Path | None = None
        self._spill: int | None = None
        self.lines = 0

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self._spill is None and len(self._head) + len(chunk) <= self._limit:
            self._head += chunk
        else:
            if self._spill is None:
                self._open_spill()
                if self._head:
                    self._write(bytes(self._head))
                room = self._limit - len(self._head)
                self._head += chunk[: max(room, 0)]
            self._write(chunk)
        if self._on_line is not None:
            self._split_lines(chunk)

    def _split_lines(self, chunk: bytes) -> None:
        assert self._on_line is not None
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                self._partial += chunk[start:]
                if len(self._partial) > _MAX_LINE:
                    raise TurnIOError(
                        f"stdout line {self.lines + 1} exceeds {_MAX_LINE} bytes",
                        line=self.lines + 1,
                    )
                return
            self._partial += chunk[start:nl]
            self.lines += 1
            line = bytes(self._partial)
            self._partial.clear()
            self._on_line(line)
            start = nl + 1

    def finish(self) -> None:
        if self._on_line is not None and self._partial:
            self.lines += 1
            line = bytes(self._partial)
            self._partial.clear()
            self._on_line(line)
        if self._spill is not None:
            os.close(self._spill)
            self._spill = None

    def _open_spill(self) -> None:
        directory = self._spill_dir or default_spill_dir()
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"turn-{uuid.uuid4().hex}.out"
        self._spill = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self.spill_path = path

    def _write(self, data: bytes) -> None:
        assert self._spill is not None
        view = memoryview(data)
        while view:
            written = os.write(self._spill, view)
            view = view[written:]

    def text(self) -> str:
        return self._head.decode("utf-8", errors="replace")


async def run_process(
    spec: ProcessSpec,
    *,
    preempt: PreemptHandle | None = None,
    spill_limit: int = DEFAULT_SPILL_LIMIT,
    spill_dir: Path | None = None,
    on_stdout_line: LineCallback | None = None,
) -> ProcessResult:
    """Run one process to natural completion.

    The process gets a fresh :data:`TURN_MARKER_VAR` value in its environment, and the
    process-wide :func:`lifeline` kills what is left of the turn if this process dies.

    Raises:
        InvalidPromptError: an argv element holds a NUL byte.
        TurnExecError: the program could not be spawned.
        TurnIOError: its output could not be captured.
        TurnPreempted: ``preempt.stop()`` was called while it ran.
    """
    if not spec.argv:
        raise TurnExecError("no program to run")
    if any("\x00" in arg for arg in spec.argv):
        raise InvalidPromptError("an argument contains a NUL byte")
    # Every descendant inherits the marker, so the turn's processes can be found even
    # after they leave its process group (agent CLIs start tools in sessions of their own).
    marker = os.urandom(16).hex()
    env: dict[str, str] | dict[bytes, bytes]
    if spec.env is not None:
        env = {**spec.env, TURN_MARKER_VAR: marker}
    else:
        env = _inherited_env()
        env[TURN_MARKER_VAR.encode()] = marker.encode()
    guard = lifeline()
    guard.begin(marker)
    try:
        return await _run(spec, env, marker, preempt, spill_limit, spill_dir, on_stdout_line)
    finally:
        guard.end(marker)


def _inherited_env() -> dict[bytes, bytes]:
    """A copy of our environment, as bytes (what the spawn needs, without re-encoding)."""
    data = getattr(os.environ, "_data", None)  # CPython's own bytes store: a C-speed copy
    if isinstance(data, dict):
        return dict(data)
    return dict(os.environb)


def _spawn(spec: ProcessSpec, env: dict[str, str] | dict[bytes, bytes]) -> subprocess.Popen[bytes]:
    """Start the process, synchronously as asyncio's own spawn does.

    Nothing can cancel it half-way, so a started process always has a turn that stops
    its whole group. A new session rather than a ``preexec_fn``: CPython keeps its fast
    vfork path.
    """
    return subprocess.Popen(
        spec.argv,
        stdin=subprocess.PIPE if spec.stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
        cwd=spec.cwd,
        env=env,
        start_new_session=True,
    )


async def _run(
    spec: ProcessSpec,
    env: dict[str, str] | dict[bytes, bytes],
    marker: str,
    preempt: PreemptHandle | None,
    spill_limit: int,
    spill_dir: Path | None,
    on_stdout_line: LineCallback | None,
) -> ProcessResult:
    program = spec.argv[0]
    started = time.monotonic()
    loop = asyncio.get_running_loop()
    grace = preempt.grace if preempt is not None else 2.0
    try:
        popen = _spawn(spec, env)
    except FileNotFoundError as exc:
        missing_cwd = spec.cwd is not None and not os.path.isdir(spec.cwd)  # noqa: ASYNC240
        where = f" (working directory {spec.cwd} does not exist)" if missing_cwd else ""
        raise TurnExecError(f"cannot start {program!r}: not found{where}", binary=program) from exc
    except PermissionError as exc:
        raise TurnExecError(f"cannot start {program!r}: not executable", binary=program) from exc
    except OSError as exc:
        raise TurnExecError(f"cannot start {program!r}: {exc.strerror}", binary=program) from exc

    child = _Child(popen, loop)
    turn = _Turn(child, marker, sandboxed=spec.sandboxed)
    info: TurnProcess | None = None
    if preempt is not None and preempt.on_spawn is not None:
        # Read right after the spawn: the leader cannot have been reaped yet (we reap it).
        info = TurnProcess(pid=child.pid, start=start_time(child.pid), marker=marker)
    lifeline().spawned(marker, child.pid)
    sink = _StdoutSink(spill_limit, spill_dir, on_stdout_line)
    stderr_tail = bytearray()
    stderr_size = 0

    def take_stderr(chunk: bytes) -> None:
        nonlocal stderr_size
        stderr_size += len(chunk)
        stderr_tail.extend(chunk)
        if len(stderr_tail) > STDERR_TAIL:
            del stderr_tail[: len(stderr_tail) - STDERR_TAIL]

    try:
        # Output we cannot take (a line callback refused it) ends the turn at once.
        child.read(popen.stdout, sink.feed, on_failure=turn.kill)
        child.read(popen.stderr, take_stderr)
        if spec.stdin is not None:
            child.write(popen.stdin, spec.stdin)
        if preempt is not None:
            preempt._turn = turn
            preempt._attach(child)
        if preempt is not None and info is not None:
            await record_spawn(preempt, info)
        # The exit itself, not the pipes' end, which a descendant holding stdout can
        # delay forever.
        await child.exited.wait()
        # Usually the pipes are already at EOF: wait (bounded) only when they are not.
        pending = child.pending()
        stopping = preempt is not None and preempt.requested
        if pending and not stopping:
            pending = await _wait_readers(pending, _DRAIN_GRACE)
            if pending:
                _LOGGER.warning(
                    "pid=%s exited but descendants hold its output open; killing them",
                    child.pid,
                )
        if pending:
            # A stopped turn does not wait for pipes: the leader is gone, so is the rest.
            turn.kill()
            pending = await _wait_readers(pending, _EOF_WAIT)
        if pending:
            _LOGGER.warning(
                "pid=%s: a process out of reach holds the turn's output; no longer reading it",
                child.pid,
            )
            child.close()  # our ends of the pipes: what is left unread stays unread
        if preempt is not None and preempt.requested:
            raise TurnPreempted(session_id=preempt.session_id)
        failure = child.failure()
        if failure is not None:
            raise failure
    except asyncio.CancelledError:
        await asyncio.shield(turn.terminate(grace))
        raise
    except OSError as exc:
        await asyncio.shield(turn.terminate(0.5))
        raise TurnIOError(f"capturing {program!r} failed: {exc.strerror or exc}") from exc
    finally:
        # Pipes a stray process still holds are closed (a no-op when they reached EOF).
        child.close()
        sink.finish()
        if preempt is not None:
            preempt._detach()
    code = child.returncode if child.returncode is not None else -1
    return ProcessResult(
        exit_code=code,
        stdout=sink.text(),
        stdout_size=sink.size,
        spill_path=sink.spill_path,
        stderr_tail=tail(bytes(stderr_tail), STDERR_TAIL) if stderr_tail else "",
        stderr_size=stderr_size,
        pid=child.pid,
        duration=time.monotonic() - started,
    )


class SerialTurnDriver:
    """Serialises turns of one session: at most one in flight, whoever calls."""

    def __init__(self, session: AgentSession) -> None:
        self._session = session
        self._lock = asyncio.Lock()

    @property
    def session_id(self) -> str:
        return self._session.session_id

    @property
    def busy(self) -> bool:
        """Whether a turn is in flight."""
        return self._lock.locked()

    async def run_turn(self, prompt: str) -> TurnOutput:
        async with self._lock:
            return await self._session.run_turn(prompt)
