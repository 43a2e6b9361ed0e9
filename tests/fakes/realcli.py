"""Helpers for tests that run a real agent CLI against :mod:`tests.fakes.model_api`.

Every test gets its own workspace and config folder; every process the test starts
carries a unique marker variable in its environment, so the test can find the CLI and
all its descendants in ``/proc`` (even ones that left the process group) and check that
none is left after a pre-emption.
"""

from __future__ import annotations

import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from engine.sandbox import Walls, walls_for
from engine.settings import Settings
from tests.support import alive

__all__ = [
    "MARKER_VAR",
    "Sandbox",
    "alive",
    "cmdline",
    "group_alive",
    "marked_processes",
    "parent_of",
]

MARKER_VAR = "FAKE_TEST_MARKER"  # FAKE_*: passed on to the agents (TURNSTILE_AGENT_ENV)


@dataclass(frozen=True, slots=True)
class Sandbox:
    """A per-test workspace (the pinned cwd) and CLI config folder."""

    root: Path
    marker: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def workspace(self) -> Path:
        path = self.root / "workspace"
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def config(self) -> Path:
        path = self.root / "config"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` plus the marker."""
        return {**base, MARKER_VAR: self.marker}

    @property
    def control(self) -> Path:
        """Where this test's control plane would live (hidden from the agent)."""
        path = self.root / "control"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def walls(self, binary: str | None = None) -> Walls:
        """The sandbox the agent runs in, as turnstile makes it for a session here (with
        this interpreter shown: a stand-in CLI may be a Python script)."""
        settings = Settings(  # type: ignore[call-arg]
            _env_file=None,
            database=self.control / "turnstile.db",
            tasks_root=self.control / "tasks",
            workspaces=self.control / "ws",
            runs_dir=self.control / "runs",
            sandbox="on",
        )
        walls = walls_for(
            settings,
            cwd=self.workspace,
            home=self.config,
            binary=binary,
            program=(sys.executable,),
        )
        assert walls is not None
        return walls


def marked_processes(marker: str) -> list[int]:
    """Live (not zombie) processes whose environment carries ``marker``."""
    needle = f"{MARKER_VAR}={marker}".encode()
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\x00") and alive(int(entry)):
            found.append(int(entry))
    return found


def group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is in process group ``pgid``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def cmdline(pid: int) -> list[str]:
    """The argv of ``pid`` (empty when it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\x00") if part]


def parent_of(pid: int) -> int:
    """The parent pid of ``pid`` (0 when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def groups_of(pids: list[int]) -> dict[int, int]:
    """pid → process group of each pid still running (short-lived helpers may be gone)."""
    found: dict[int, int] = {}
    for pid in pids:
        try:
            found[pid] = os.getpgid(pid)
        except ProcessLookupError:
            continue
    return found
