"""Run ids: one format for every mode."""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Iterable
from enum import StrEnum
from typing import Final

__all__ = ["RUN_ID_PATTERN", "RunMode", "named_runs", "new_run_id", "short_id"]


class RunMode(StrEnum):
    """How a run is driven."""

    CHAT = "chat"
    AUTO = "auto"
    AUTOPILOT = "autopilot"


#: ``MODE-YYYYmmdd-HHMMSS-xxxxxx``: safe as a folder name, a git branch part and in a
#: Telegram button (well under 64 bytes).
RUN_ID_PATTERN: Final = re.compile(r"^(chat|auto|autopilot)-\d{8}-\d{6}-[0-9a-f]{6}$")


def new_run_id(mode: RunMode | str, *, clock: float | None = None) -> str:
    """A new run id for ``mode`` (local time, so people read it as they read a clock)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(clock))
    return f"{RunMode(mode).value}-{stamp}-{secrets.token_hex(3)}"


def short_id(run_id: str) -> str:
    """What people may type for ``run_id`` on a phone: its random end (``3fa9c2``).

    Commands that take a run accept the end of its id; an id of another shape is itself.
    """
    return run_id.rsplit("-", 1)[-1] if RUN_ID_PATTERN.match(run_id) else run_id


def named_runs(ids: Iterable[str], wanted: str) -> list[str]:
    """The run ids ``wanted`` names: itself when it is one of ``ids``, else those that end
    with it (a short handle such as ``4a37b``, the end of an id); more than one means the
    handle is ambiguous."""
    found = list(ids)
    if wanted in found:
        return [wanted]
    return [run_id for run_id in found if wanted and run_id.endswith(wanted)]
