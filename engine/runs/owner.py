"""Which process drives a run: a token ``pid:start-time``, and whether it still runs here.

Standard library only: ``turnstile runs`` asks it for every running run and must not load
auto mode to do so.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["owner_alive", "owner_token"]


def owner_token(pid: int | None = None) -> str:
    """This process, as ``pid:start-time`` (the start time guards against PID reuse)."""
    pid = os.getpid() if pid is None else pid
    start = _start_time(pid)
    return f"{pid}:{start}" if start is not None else str(pid)


def owner_alive(token: str | None) -> bool:
    """Whether the process named by ``token`` (from :func:`owner_token`) still runs here."""
    if not token:
        return False
    pid_text, _, start = token.partition(":")
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return not start or _start_time(pid) == start


def _start_time(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces; fields after it are plain.
    fields = raw[raw.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None
