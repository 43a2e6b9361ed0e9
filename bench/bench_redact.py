"""What redaction costs: every message that leaves for a chat goes through it.
Run: .venv/bin/python bench/bench_redact.py

Reported: the time to redact a typical agent answer (prose, a commit hash, a UUID, a code
block; about 600 characters, nothing to hide) with two exact secrets configured, p50 and
p90 over rounds of 200 (target: p50 ≤ 1 ms), and the time for each hostile input (long
runs of near-matches meant to make a pattern backtrack; target: each ≤ 1 s).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.redact import Redactor, redact  # noqa: E402

TYPICAL = (
    "I changed `engine/files.py` so that `read_for_send` checks every encoding; the tests "
    "in tests/test_redact_shapes.py pass (42 passed in 1.3s). Commit "
    "3f786850e387550fdab836ed7e6dc881de23001b, request 123e4567-e89b-12d3-a456-426614174000 "
    "took 12ms.\n\n```python\ndef f(x):\n    return x + 1\n```\n"
) * 2

HOSTILE = {
    "BEGIN lines": "-----BEGIN RSA PRIVATE KEY-----\n" * 3_000,
    "an unended key block": "-----BEGIN RSA PRIVATE KEY-----\n" + "a b c;" * 16_000,
    "token= repeated": "token=" * 20_000,
    "credential names": "DB_TOKEN_A_B_C_D = " * 5_000,
    "set NAME repeated": "set A_TOKEN " * 8_000,
    "URL userinfo starts": "://a:" * 20_000,
    "an unended quote": 'password="' + "x" * 100_000,
    "PuTTY lines": "Private-Lines: 4\n" + "QUFB\n" * 20_000,
    "aKey repeated": "aKey" * 25_000,
    "a_ repeated": "a_" * 50_000,
    "bot token starts": "1234567:" * 12_000,
}


def main() -> None:
    redactor = Redactor(["exact-secret-value-1", "another-secret-22"])
    redactor(TYPICAL)
    rounds = []
    for _ in range(25):
        started = time.perf_counter()
        for _ in range(200):
            redactor(TYPICAL)
        rounds.append((time.perf_counter() - started) / 200 * 1000)
    rounds.sort()
    p50, p90 = statistics.median(rounds), rounds[int(len(rounds) * 0.9)]
    print(f"typical message ({len(TYPICAL)} chars): p50 {p50:.3f} ms, p90 {p90:.3f} ms")
    print(f"  target p50 <= 1 ms: {'met' if p50 <= 1 else 'MISSED'}")
    worst = 0.0
    for name, text in HOSTILE.items():
        started = time.perf_counter()
        redact(text)
        took = time.perf_counter() - started
        worst = max(worst, took)
        print(f"hostile: {name:<22} {len(text):>7} chars  {took * 1000:8.1f} ms")
    print(f"  target each <= 1 s: {'met' if worst <= 1 else 'MISSED'} (worst {worst:.3f} s)")


if __name__ == "__main__":
    main()
