"""Fake agent CLIs for the probe tests: each run is logged, ``--help`` is answered."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

__all__ = ["OLD_HELP", "WARM_HELP", "fake_cli", "runs_of"]

WARM_HELP = "Usage: claude [options]\\n  --input-format <f>  stream-json\\n  --replay-user-messages"
OLD_HELP = "Usage: claude [options]\\n  --print"


def fake_cli(
    path: Path, runs: Path, *, help_text: str = WARM_HELP, sleep: float = 0.0, hang: bool = False
) -> Path:
    """A CLI that appends one line per run to ``runs``, then answers ``--help``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = f"""\
        #!{sys.executable}
        import os, subprocess, sys, time
        child = subprocess.Popen(["sleep", "60"]) if {hang!r} else None
        with open({str(runs)!r}, "a") as fh:
            fh.write(f"{{os.getpid()}} {{child.pid if child else 0}} {{' '.join(sys.argv[1:])}}\\n")
        time.sleep({60.0 if hang else sleep!r})
        print("{help_text}")
        """
    path.write_text(textwrap.dedent(body))
    path.chmod(0o755)
    return path


def runs_of(runs: Path) -> list[list[str]]:
    return [line.split() for line in runs.read_text().splitlines()] if runs.exists() else []
