"""What an installed agent CLI supports: asked once per binary and version, kept on disk.

A probe runs the CLI with a question it answers without a model (``claude --help``,
``codex app-server generate-json-schema``) and reads from the output what it supports.
The answer is kept per binary file: its real path, size and modification time, plus the
version its npm package declares when it sits in one (a launcher script keeps its size
and date across releases). Answers are kept in memory and in a JSON file that every
process of the machine shares, so a CLI is asked once per version, not once per process.

Asking runs a process (hundreds of milliseconds for Claude Code), so it never blocks an
event loop: async code awaits :func:`ask_async` (the process runs with a timeout and is
killed when nobody waits for it any more); :func:`ask` is for sync callers, and inside a
running event loop it answers only from what is known, starting the probe in a thread of
its own otherwise.

The file is rewritten atomically under a lock, so two processes writing at once keep
both answers. A file that cannot be read or parsed is ignored (the CLIs are asked again
and the file is rewritten); one that cannot be written leaves the answers in memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import signal
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Generic, TypeVar

from engine.agents.stream import find_binary
from engine.gates.state_file import write_atomic

__all__ = ["BinaryKey", "Finished", "Probe", "ask", "ask_async", "binary_key", "known"]

_LOGGER = logging.getLogger(__name__)

A = TypeVar("A")

_FORMAT: Final = 1
# A real cache file holds a few answers; anything larger was not written by us.
_MAX_FILE_BYTES: Final = 1024 * 1024
_MAX_MANIFEST_BYTES: Final = 256 * 1024
# How many folders up from the program an npm package's manifest is looked for
# (``<package>/bin/<program>`` is the usual layout).
_MANIFEST_LEVELS: Final = 3


@dataclass(frozen=True, slots=True)
class BinaryKey:
    """Which binary an answer is about: a new file, size, date or version is a new binary."""

    path: str
    size: int
    mtime_ns: int
    version: str | None


@dataclass(frozen=True, slots=True)
class Finished:
    """What a probe's process left: exit status, output, and the private folder it ran
    with (where it may have written files)."""

    returncode: int
    stdout: bytes
    stderr: bytes
    folder: Path


def _inherit(folder: Path) -> Mapping[str, str]:
    return os.environ


@dataclass(frozen=True, slots=True)
class Probe(Generic[A]):
    """One question asked of a CLI: how to run it, and how to read its answer.

    Attributes:
        name: the question, part of the cache key (bump it when ``read`` changes).
        label: the command as people know it, for reasons (```claude --help```).
        answer_type: the answer's dataclass (its fields are ``bool`` and ``str``), for
            reading it back from the file.
        args: the arguments after the program, given the private folder.
        read: the answer, from the finished process (run in a thread: it may read files).
        failed: the "not supported" answer carrying a reason, when the CLI could not be
            asked (not found, not startable, no answer in time); those are never kept.
        env: the process's environment, given the private folder.
        timeout: seconds the CLI gets to answer before it is killed.
    """

    name: str
    label: str
    answer_type: type[A]
    args: Callable[[Path], Sequence[str]]
    read: Callable[[Finished], A]
    failed: Callable[[str], A]
    env: Callable[[Path], Mapping[str, str]] = field(default=_inherit)
    timeout: float = 60.0


def binary_key(program: str) -> BinaryKey:
    """The key of the binary ``program`` runs (symbolic links followed).

    Raises:
        OSError: it cannot be read.
    """
    real = os.path.realpath(program)
    info = os.stat(real)
    return BinaryKey(real, info.st_size, info.st_mtime_ns, _package_version(real))


def _package_version(real: str) -> str | None:
    """``name@version`` of the npm package holding the program, if it is in one."""
    folder = os.path.dirname(real)
    for _ in range(_MANIFEST_LEVELS):
        try:
            with open(os.path.join(folder, "package.json"), "rb") as fh:
                data = json.loads(fh.read(_MAX_MANIFEST_BYTES))
        except FileNotFoundError:
            folder = os.path.dirname(folder)
            continue
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict):
            return None
        name, version = data.get("name"), data.get("version")
        if isinstance(name, str) and isinstance(version, str):
            return f"{name}@{version}"
        return None
    return None


# -- what is known: memory, then the file ------------------------------------------------

# Process-wide on purpose: an answer is about a file on this machine, whoever asks.
_MEMORY: dict[tuple[str, BinaryKey], object] = {}


def _entry_name(probe: Probe[Any], key: BinaryKey) -> str:
    return f"{probe.name} {key.path}"


def _read_file(cache: Path) -> dict[str, Any]:
    """The file's answers by entry name; nothing when it is missing or not ours."""
    try:
        with open(cache, "rb") as fh:
            raw = fh.read(_MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        _LOGGER.warning("cannot read %s (%s): the agent CLIs are asked again", cache, exc)
        return {}
    try:
        data = json.loads(raw) if len(raw) <= _MAX_FILE_BYTES else None
    except ValueError:
        data = None
    answers = data.get("answers") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("format") != _FORMAT or not isinstance(answers, dict):
        _LOGGER.warning("%s is not a file turnstile wrote: the agent CLIs are asked again", cache)
        return {}
    return answers


def _load(probe: Probe[A], key: BinaryKey, entry: object) -> A | None:
    """The answer an entry of the file holds, if it is about this very binary."""
    if not isinstance(entry, dict):
        return None
    if (entry.get("size"), entry.get("mtime_ns"), entry.get("version")) != (
        key.size,
        key.mtime_ns,
        key.version,
    ):
        return None
    data = entry.get("answer")
    if not isinstance(data, dict):
        return None
    fields = dataclasses.fields(probe.answer_type)  # type: ignore[arg-type]
    # Field types are spelled as annotations: only plain bool and str fields are stored.
    if set(data) != {f.name for f in fields} or any(
        type(data[f.name]).__name__ != (f.type if isinstance(f.type, str) else f.type.__name__)
        for f in fields
    ):
        return None
    return probe.answer_type(**data)


def known(probe: Probe[A], key: BinaryKey, cache: Path | None) -> A | None:
    """The answer already known about ``key``: in memory, else in the file ``cache``."""
    remembered = _MEMORY.get((probe.name, key))
    if remembered is not None:
        return remembered  # type: ignore[return-value]
    if cache is None:
        return None
    answer = _load(probe, key, _read_file(cache).get(_entry_name(probe, key)))
    if answer is not None:
        _MEMORY[(probe.name, key)] = answer
    return answer


def _keep(probe: Probe[A], key: BinaryKey, answer: A, cache: Path | None) -> None:
    """Remember ``answer``, and add it to the file (under its lock: no answer is lost)."""
    _MEMORY[(probe.name, key)] = answer
    if cache is None:
        return
    entry = {
        "size": key.size,
        "mtime_ns": key.mtime_ns,
        "version": key.version,
        "answer": dataclasses.asdict(answer),  # type: ignore[call-overload]
    }
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{cache}.lock", "ab") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            answers = _read_file(cache)
            answers[_entry_name(probe, key)] = entry
            data = {"format": _FORMAT, "answers": answers}
            write_atomic(cache, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode())
    except OSError as exc:
        _LOGGER.warning("cannot write %s (%s): the answer is kept in memory only", cache, exc)


# -- asking ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Flight:
    """A probe running on a loop, and how many callers wait for it."""

    task: asyncio.Task[Any]
    waiters: int = 0


_FLIGHTS: dict[tuple[str, BinaryKey], _Flight] = {}


async def _stop(proc: asyncio.subprocess.Process) -> None:
    # Its whole group: a CLI is often a launcher with the real program as its child.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    await proc.wait()


async def _run(probe: Probe[A], program: str) -> tuple[A, bool]:
    """The CLI's answer, and whether it is worth keeping (it came from the CLI)."""
    with tempfile.TemporaryDirectory(prefix="turnstile-probe-") as tmp:
        folder = Path(tmp)
        try:
            proc = await asyncio.create_subprocess_exec(
                program,
                *probe.args(folder),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=dict(probe.env(folder)),
                start_new_session=True,
            )
        except OSError as exc:
            reason = f"{probe.label} could not be started: {exc.strerror or exc}"
            return probe.failed(reason), False
        try:
            async with asyncio.timeout(probe.timeout):
                out, err = await proc.communicate()
        except TimeoutError:
            await _stop(proc)
            reason = f"{probe.label} did not answer within {probe.timeout:g} s"
            _LOGGER.warning("%s: %s", program, reason)
            return probe.failed(reason), False
        except asyncio.CancelledError:
            await asyncio.shield(_stop(proc))
            raise
        done = Finished(proc.returncode if proc.returncode is not None else -1, out, err, folder)
        return await asyncio.to_thread(probe.read, done), True


async def _probe(probe: Probe[A], program: str, key: BinaryKey, cache: Path | None) -> A:
    answer, keep = await _run(probe, program)
    if keep:
        await asyncio.to_thread(_keep, probe, key, answer, cache)
    return answer


def _flight(probe: Probe[A], program: str, key: BinaryKey, cache: Path | None) -> _Flight:
    """The probe of ``key`` running on this loop, started if there is none."""
    loop = asyncio.get_running_loop()
    slot = (probe.name, key)
    flight = _FLIGHTS.get(slot)
    if (
        flight is not None
        and flight.task.get_loop() is loop
        and not flight.task.done()
        and not flight.task.cancelling()
    ):
        return flight
    task = loop.create_task(_probe(probe, program, key, cache), name=f"probe {probe.label}")
    new = _Flight(task)
    _FLIGHTS[slot] = new

    def forget(_: asyncio.Task[Any]) -> None:
        if _FLIGHTS.get(slot) is new:
            del _FLIGHTS[slot]

    task.add_done_callback(forget)
    return new


def _locate(probe: Probe[A], binary: str, path: str | None) -> tuple[str, BinaryKey] | A:
    program = find_binary(binary, path if path is not None else os.environ.get("PATH"))
    if program is None:
        return probe.failed(f"{binary!r} was not found")
    try:
        return program, binary_key(program)
    except OSError as exc:
        return probe.failed(f"{binary!r} cannot be read: {exc.strerror}")


async def ask_async(
    probe: Probe[A], binary: str, *, path: str | None = None, cache: Path | None = None
) -> A:
    """``probe``'s answer about ``binary`` (looked up on ``path``, default ``$PATH``).

    Known answers come back at once; otherwise the CLI is run once however many callers
    ask together, and killed when the last of them is cancelled.
    """
    located = _locate(probe, binary, path)
    if not isinstance(located, tuple):
        return located
    program, key = located
    answer = known(probe, key, cache)
    if answer is not None:
        return answer
    running = _BACKGROUND.get((probe.name, key))
    if running is not None:
        result: A = await asyncio.wrap_future(running)
        return result
    flight = _flight(probe, program, key, cache)
    flight.waiters += 1
    try:
        shared: A = await asyncio.shield(flight.task)
        return shared
    finally:
        flight.waiters -= 1
        if flight.waiters == 0 and not flight.task.done():
            # Nobody waits for the answer any more: the CLI is stopped, not left running.
            flight.task.cancel()
            await asyncio.wait([flight.task])


def ask(probe: Probe[A], binary: str, *, path: str | None = None, cache: Path | None = None) -> A:
    """``probe``'s answer about ``binary``, for sync callers.

    Outside an event loop it runs the CLI when the answer is not known. Inside one it
    never waits for the CLI: an unknown answer is "not supported, being asked", and the
    probe starts in a thread of its own (its own loop: the caller's loop ending does not
    cut it off), which :func:`ask_async` and later callers then wait for.
    """
    located = _locate(probe, binary, path)
    if not isinstance(located, tuple):
        return located
    program, key = located
    answer = known(probe, key, cache)
    if answer is not None:
        return answer
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        running = _BACKGROUND.get((probe.name, key))
        if running is not None:
            result: A = running.result()
            return result
        return asyncio.run(ask_async(probe, binary, path=path, cache=cache))
    _in_background(probe, program, key, cache)
    return probe.failed(
        f"{probe.label} is still being asked what it supports; until it answers, "
        "new sessions run one process per turn"
    )


_BACKGROUND: dict[tuple[str, BinaryKey], concurrent.futures.Future[Any]] = {}
_BACKGROUND_LOCK: Final = threading.Lock()


def _in_background(probe: Probe[A], program: str, key: BinaryKey, cache: Path | None) -> None:
    slot = (probe.name, key)
    with _BACKGROUND_LOCK:
        if slot in _BACKGROUND:
            return
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # nobody can cancel it: it ends on its own
        _BACKGROUND[slot] = future

    def run() -> None:
        try:
            future.set_result(asyncio.run(_probe(probe, program, key, cache)))
        except BaseException as exc:  # handed to whoever waits for the answer
            future.set_exception(exc)
        finally:
            with _BACKGROUND_LOCK:
                del _BACKGROUND[slot]

    # A daemon: a process that exits does not wait for a CLI's answer it no longer needs.
    threading.Thread(target=run, name=f"probe {probe.label}", daemon=True).start()
