"""The kill -9 loop of issue 15. Run: .venv/bin/python bench/bench_kill_loop.py [ROUNDS]

Kills the real ``turnstile bot`` (fake Bot API, scripted fake agent) ROUNDS times (10 by
default) during multi-message turns, restarting it each time, and prints what became of
every message: answered, lost with notice, lost silently (target 0), duplicated (target
0), sent again because it was in flight at a kill, and agent processes that outlived a
kill (target none). The same loop runs as tests/test_kill_loop.py.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.test_kill_loop import kill_loop  # noqa: E402


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    with tempfile.TemporaryDirectory() as tmp:
        report = asyncio.run(kill_loop(Path(tmp), rounds=rounds))
    print(report.line())


if __name__ == "__main__":
    main()
