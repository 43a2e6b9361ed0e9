"""The keeper of a resident agent's sandbox: it lets the agent save its last answer when
turnstile dies.

A sandboxed agent runs as ``bwrap --die-with-parent … CLI``: if bubblewrap's parent dies,
everything in the sandbox is killed at once. For an agent that runs one process per turn
that is right. A resident CLI, though, saves a turn to its transcript a moment after it
prints the result, and turnstile shows the answer as soon as it has the result: killed in
between, the answer would be shown but missing from the session a restart resumes.

So a resident sandbox's parent is this small process rather than turnstile itself
(``python -I -S keeper.py -- bwrap …``; standard library only). It starts bubblewrap with
its own stdin and stdout (turnstile's pipes), then only waits:

- bubblewrap ends: the keeper ends the same way (its exit code, or the same signal), so
  for turnstile the keeper *is* the resident process;
- the keeper is killed: bubblewrap and the sandbox die with it, as before;
- turnstile dies (the kernel tells the keeper with a signal): the agent's input has just
  closed, so it saves what it has and leaves by itself; the keeper waits for that a few
  seconds at most, then ends, and the sandbox dies with it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from typing import Final, NoReturn

_PR_SET_PDEATHSIG: Final = 1
# How long an agent whose turnstile died gets to save its work and leave.
GRACE: Final = 3.0


class _ParentGone(Exception):
    pass


def _parent_gone(signum: int, frame: object) -> None:
    raise _ParentGone


def _exit_like(status: int) -> NoReturn:
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 1)


def main(argv: list[str]) -> NoReturn:
    parent = os.getppid()
    signal.signal(signal.SIGUSR1, _parent_gone)
    try:
        told = ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGUSR1) == 0
    except (OSError, AttributeError):
        told = False
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        try:
            os.execvp(argv[0], argv)  # noqa: S606 (argv is the sandbox command, as given)
        finally:
            os._exit(127)
    # The pipes belong to the child now: holding them would keep them open after it ends.
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)
    try:
        while True:
            if os.getppid() != parent:
                raise _ParentGone  # it died before the kernel was asked to tell us
            # Told by the kernel: block until the child ends (the signal interrupts it);
            # otherwise look now and then.
            done, status = os.waitpid(pid, 0 if told else os.WNOHANG)
            if done:
                _exit_like(status)
            time.sleep(0.2)
    except _ParentGone:
        pass
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    deadline = time.monotonic() + GRACE
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            _exit_like(status)
        time.sleep(0.02)
    os._exit(1)  # the sandbox dies with us (bubblewrap's --die-with-parent)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "--":
        sys.exit("usage: keeper.py -- PROGRAM [ARGS...]")
    main(sys.argv[2:])
