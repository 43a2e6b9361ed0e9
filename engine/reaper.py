"""What is left of a turn: finding its processes and killing them, now or after a crash.

Every turn's environment carries a unique :data:`TURN_MARKER_VAR` value, and its process
group id is its leader's pid. Agent CLIs start tool commands in sessions of their own and
a tool may double-fork, so a turn's processes are "its group" plus "every process whose
environment holds the marker" (``/proc/PID/environ``; a process that replaced its whole
environment and left the group is out of reach).

Two things outlive a crash of the process that runs turns:

- :class:`Lifeline`, a small watchdog process (one per process that runs turns, started
  with the first turn). Turns are noted in a table in shared memory as they start and
  end; when a pipe whose only writer is the parent closes, the parent died (``kill -9``
  included) and the watchdog kills the turns the table says were in flight. Unlike a
  parent-death signal it costs nothing at the spawn itself (no ``preexec_fn``, no extra
  exec) and it reaches the whole turn, not only the leader.
- :func:`kill_remains`, the start-up reaper: the group id, the leader's start time and
  the marker are recorded with the turn, and on start-up a cut-off turn's remains are
  killed, the group only when its leader's start time still matches (a reused pid is
  never hit).

This module uses the standard library only: the watchdog runs it as a script
(``python -I -S reaper.py --watch FD``), without importing turnstile.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

__all__ = [
    "TURN_MARKER_VAR",
    "Lifeline",
    "TurnProcess",
    "kill_group",
    "kill_marked",
    "kill_remains",
    "marked_pids",
    "signal_marked",
    "start_time",
    "wait_gone",
]

_LOGGER = logging.getLogger(__name__)

TURN_MARKER_VAR: Final = "TURNSTILE_TURN_ID"
# A process caught mid-fork may leave a child the first scan missed.
_SCAN_ROUNDS: Final = 5
# After the parent died, how long the watchdog keeps looking for a turn's processes.
_LATE_EXEC_WATCH: Final = 1.0
_GIVE_UP: Final = 10.0
# The watchdog's table: one slot per turn in flight ("MARKER PGID S", newline-padded;
# S is 1 while the turn's process is saving what it just answered, see Lifeline.settling).
_SLOT: Final = 48
_FIRST_SLOTS: Final = 64
# How long a process that was saving its answer gets to finish and leave by itself (its
# input closed with our death) before the watchdog kills it.
_SETTLE_WAIT: Final = 3.0


@dataclass(frozen=True, slots=True)
class TurnProcess:
    """What identifies a running turn's processes, recorded so a restart can clean up.

    Attributes:
        pid: the leader's pid; also the process group id (each turn has its own session).
        start: the leader's start time (:func:`start_time`), so that a
            reused pid is never taken for the leader.
        marker: the turn's :data:`TURN_MARKER_VAR` value, inherited by its descendants.
    """

    pid: int
    start: str | None
    marker: str

    @property
    def pgid(self) -> int:
        return self.pid


@functools.cache
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return "unknown"


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    return stat.rsplit(b")", 1)[1].split()


def start_time(pid: int) -> str | None:
    """When ``pid`` started, as ``BOOT_ID/TICKS`` (None if there is no such process).

    Two processes that ever had the same pid on one machine never have the same value:
    the clock ticks since boot tell them apart, the boot id tells boots (and machines
    sharing a database) apart.
    """
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 20:
        return None
    return f"{_boot_id()}/{int(fields[19])}"


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an orphan may stay one a while)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in (b"Z", b"X")


def marked_pids(marker: str, *, var: str = TURN_MARKER_VAR) -> list[int]:
    """Every process of ours (other than this one) whose environment holds ``var=marker``.

    Reads ``/proc`` (Linux); elsewhere there is nothing to read and nothing is found.
    """
    needle = f"{var}={marker}".encode()
    found: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    me = os.getpid()
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                environ = fh.read()
        except OSError:
            continue
        if needle in environ.split(b"\x00") and _running(int(entry)):
            found.append(int(entry))
    return found


def signal_marked(marker: str, sig: int, *, var: str = TURN_MARKER_VAR) -> list[int]:
    """Send ``sig`` to every process whose environment holds ``var=marker``; the pids hit."""
    hit: list[int] = []
    for pid in marked_pids(marker, var=var):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
            hit.append(pid)
    return hit


def kill_marked(marker: str, *, var: str = TURN_MARKER_VAR) -> list[int]:
    """SIGKILL every process of the marked turn, scanning again while a scan finds any.

    Returns:
        The pids signalled.
    """
    killed: list[int] = []
    for _ in range(_SCAN_ROUNDS):
        hit = [pid for pid in signal_marked(marker, signal.SIGKILL, var=var) if pid not in killed]
        if not hit:
            break
        killed += hit
    return killed


def kill_group(pgid: int, start: str | None) -> bool:
    """SIGKILL process group ``pgid`` if its leader still is the process that started then.

    Returns:
        Whether the group was signalled.
    """
    if start is None or start_time(pgid) != start:
        # Gone, or the pid now belongs to another process: not ours to kill.
        return False
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def kill_remains(pgid: int | None, start: str | None, marker: str | None) -> list[int]:
    """Kill what is left of a cut-off turn: its group (start time checked), then its marker.

    Returns:
        The pids signalled (the group counts as its id).
    """
    killed: list[int] = []
    if pgid is not None and kill_group(pgid, start):
        killed.append(pgid)
    if marker:
        killed += [pid for pid in kill_marked(marker) if pid not in killed]
    return killed


async def wait_gone(pids: Iterable[int], within: float) -> bool:
    """Wait (bounded) until none of ``pids`` runs; whether they all went."""
    import asyncio  # here: the watchdog never needs it, and starts faster without it

    pending = list(pids)
    deadline = time.monotonic() + within
    while pending:
        pending = [pid for pid in pending if _running(pid)]
        if not pending:
            break
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.01)
    return True


class Lifeline:
    """The parent's end of the watchdog that kills in-flight turns if this process dies.

    ``begin(marker)`` before a turn's spawn (the marker alone already reaches the leader),
    ``spawned(marker, pgid)`` after it, ``end(marker)`` when the turn is over. Each turn
    in flight holds a slot of a small table in memory shared with the watchdog (a memfd
    both map), which the watchdog reads only once this process is gone: a turn costs no
    system call and wakes nobody. The watchdog learns of the death from a pipe whose
    only writer is this process. It is started on first use, again after a fork, and
    again if it died.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._owner = os.getpid()
        self._table: mmap.mmap | None = None
        self._fd: int | None = None
        self._pipe: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._slots: dict[str, int] = {}
        self._free: list[int] = []
        self._checked = 0.0
        self._warned = False

    @property
    def watchdog_pid(self) -> int | None:
        """The watchdog's pid while one runs."""
        if self._proc is None or self._proc.poll() is not None:
            return None
        return self._proc.pid

    def begin(self, marker: str) -> None:
        table = self._ensure()
        if table is None:
            return
        if not self._free:
            table = self._grow()
            if table is None:
                return
        entry = f"{marker} {0:010d} 0".encode()
        if len(entry) > _SLOT or not marker.isalnum():
            raise ValueError(f"a turn marker is up to {_SLOT - 13} letters and digits")
        slot = self._free.pop()
        self._slots[marker] = slot
        offset = slot * _SLOT
        table[offset : offset + _SLOT] = entry.ljust(_SLOT, b"\n")

    def spawned(self, marker: str, pgid: int) -> None:
        slot = self._slots.get(marker)
        if slot is not None and self._table is not None:
            offset = slot * _SLOT + len(marker) + 1
            self._table[offset : offset + 10] = f"{pgid:010d}".encode()

    def settling(self, marker: str, on: bool) -> None:
        """Whether the turn's process is saving what it answered (a resident CLI writes
        its transcript a moment after it prints the result). If this process dies
        meanwhile, the watchdog lets that process finish and leave by itself (its input
        closes with us) for a few seconds before it kills it: an answer already shown
        is not lost from the session the next start resumes."""
        slot = self._slots.get(marker)
        if slot is not None and self._table is not None:
            offset = slot * _SLOT + len(marker) + 12
            self._table[offset : offset + 1] = b"1" if on else b"0"

    def end(self, marker: str) -> None:
        slot = self._slots.pop(marker, None)
        if slot is not None and self._table is not None:
            self._table[slot * _SLOT] = 0
            self._free.append(slot)

    def close(self) -> None:
        """Stop the watchdog (it then kills the turns still in flight, if any)."""
        if self._pipe is not None:
            with contextlib.suppress(OSError):
                os.close(self._pipe)
            self._pipe = None
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
            self._proc = None
        if self._table is not None:
            self._table.close()
        if self._fd is not None:
            os.close(self._fd)
        self._reset()

    def _ensure(self) -> mmap.mmap | None:
        """The table, and a watchdog that runs (checked at most once a second)."""
        if os.getpid() != self._owner:
            # A forked child: the watchdog and the turns belong to the parent.
            self._reset()
        if self._table is None and self._grow() is None:
            return None
        now = time.monotonic()
        if self._proc is not None and now < self._checked + 1:
            return self._table
        self._checked = now
        if self._proc is not None and self._proc.poll() is None:
            return self._table
        if self._proc is not None:
            _LOGGER.warning("the turn watchdog exited (%s); starting a new one", self._proc.poll())
        self._start()
        return self._table

    def _grow(self) -> mmap.mmap | None:
        """Double the table (or make the first one); None if it cannot be made."""
        try:
            if self._fd is None:
                self._fd = _shared_fd()
            size = max(_FIRST_SLOTS, 2 * len(self._slots) + len(self._free)) * _SLOT
            old = self._table.size() if self._table is not None else 0
            os.ftruncate(self._fd, size)
            table = mmap.mmap(self._fd, size)
        except OSError as exc:
            self._warn(f"cannot make the turn watchdog's table ({exc})")
            return None
        if self._table is not None:
            self._table.close()
        self._table = table
        self._free.extend(range(size // _SLOT - 1, old // _SLOT - 1, -1))
        return table

    def _start(self) -> None:
        assert self._fd is not None
        if self._pipe is not None:
            with contextlib.suppress(OSError):
                os.close(self._pipe)
            self._pipe = None
        read_end, write_end = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    os.path.abspath(__file__),
                    "--watch",
                    str(read_end),
                    str(self._fd),
                ],
                pass_fds=(read_end, self._fd),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env={},
                # Its own session: Ctrl-C or a signal to our group does not reach it.
                start_new_session=True,
            )
        except OSError as exc:
            os.close(write_end)
            self._proc = None
            self._warn(f"cannot start the turn watchdog ({exc})")
            return
        finally:
            os.close(read_end)
        self._pipe = write_end

    def _warn(self, what: str) -> None:
        if not self._warned:
            self._warned = True
            _LOGGER.error(
                "%s: if this process is killed, its agents keep running until the next "
                "start-up kills them",
                what,
            )


def _shared_fd() -> int:
    """A file only we and the watchdog hold (in memory where Linux offers that)."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("turnstile-turns")
    fd, path = tempfile.mkstemp(prefix="turnstile-turns-")
    os.unlink(path)
    return fd


def _start_if_marked(pid: int, marker: str) -> str | None:
    """The start time of ``pid`` if it carries ``marker`` (so it is the turn's leader)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            environ = fh.read()
    except OSError:
        return None
    if f"{TURN_MARKER_VAR}={marker}".encode() not in environ.split(b"\x00"):
        return None
    return start_time(pid)


def _read_table(fd: int) -> dict[str, tuple[int | None, str | None, bool]]:
    """The turns in flight the table holds: marker -> (group, leader's start, settling)."""
    data = bytearray()
    while chunk := os.pread(fd, 1 << 20, len(data)):
        data += chunk
    live: dict[str, tuple[int | None, str | None, bool]] = {}
    for offset in range(0, len(data) - _SLOT + 1, _SLOT):
        words = bytes(data[offset : offset + _SLOT]).decode("ascii", errors="replace").split()
        if (
            len(words) != 3
            or not words[1].isdigit()
            or not words[0].isalnum()
            or words[2] not in ("0", "1")
        ):
            continue  # free, or cut mid-write: nothing of ours matches it
        pgid = int(words[1]) or None
        began = _start_if_marked(pgid, words[0]) if pgid else None
        live[words[0]] = (pgid, began, words[2] == "1")
    return live


def _let_settle(groups: list[tuple[int, str | None]]) -> None:
    """Wait (a few seconds at most) for the groups' leaders to leave by themselves."""
    deadline = time.monotonic() + _SETTLE_WAIT
    while time.monotonic() < deadline:
        if all(
            began is None or not _running(group) or start_time(group) != began
            for group, began in groups
        ):
            return
        time.sleep(0.02)


def _watch(pipe: int, table: int) -> None:
    """The watchdog: wait for the parent's death, then kill the turns it left in flight."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while os.read(pipe, 4096):  # nothing is ever written: this returns at end-of-file
        pass
    # The parent exited, or was killed, perhaps with turns in flight.
    live = _read_table(table)
    saving = [(g, began) for g, began, settling in live.values() if g is not None and settling]
    for group, began, settling in live.values():
        if group is not None and not settling:
            kill_group(group, began)
    if saving:
        _let_settle(saving)
        for group, began in saving:
            kill_group(group, began)
    # A leader caught between fork and exec does not show its marker yet: look again a while.
    deadline = time.monotonic() + _LATE_EXEC_WATCH
    give_up = deadline + _GIVE_UP
    while live and time.monotonic() < give_up:  # a process stuck in the kernel stays
        found = [kill_marked(marker) for marker in live]
        if not any(found) and time.monotonic() >= deadline:
            break
        time.sleep(0.05)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--watch":
        _watch(int(sys.argv[2]), int(sys.argv[3]))
