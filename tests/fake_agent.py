#!/usr/bin/env python3
"""A scripted fake agent CLI for fast tests (spawned through ``sys.executable``).

Usage: ``fake_agent.py [--session ID] [--prompt TEXT | (prompt on stdin)]``.

Behaviour comes from a JSON script named by ``FAKE_AGENT_SCRIPT`` (no script: reply
``echo: PROMPT``). The script is ``{"replies": [STEP, ...], "rules": [STEP, ...]}``:
``replies`` are used in order, one per turn, counted per session in
``FAKE_AGENT_STATE`` (default: beside the script); when they run out, the first rule whose
``match`` is a substring of the prompt is used; else the echo. A STEP may hold:

- ``text``: printed to stdout (``{prompt}``, ``{session}`` and ``{turn}`` substituted);
- ``exit``: exit code (default 0);
- ``progress``: printed to stdout (flushed) at once, before any wait: a line in flight;
- ``sleep``: seconds to sleep before answering (``wait_file``: wait until a file exists);
- ``stdout_bytes`` / ``stderr_bytes``: extra bytes written to stdout / stderr;
- ``stderr``: text written to stderr;
- ``grandchild``: spawn a sleeping grandchild (its pid written to ``FAKE_AGENT_PIDS``);
- ``escapee``: spawn a sleeping process in a session of its own (out of the turn's
  process group, like a tool's daemon; its pid written to ``FAKE_AGENT_PIDS``);
- ``files``: ``{relative path: content}`` written in the cwd;
- ``run``: a list of argv lists run in the cwd (e.g. ``git commit``);
- ``ignore_term``: ignore SIGTERM (to test the grace period and SIGKILL).

Every turn is appended to ``FAKE_AGENT_LOG`` (JSON lines: session, turn, prompt, pid,
started, finished) when that variable is set.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _next_turn(state_dir: Path, session: str) -> int:
    state_dir.mkdir(parents=True, exist_ok=True)
    counter = state_dir / f"{session or 'default'}.turns"
    with open(counter, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        raw = fh.read().strip()
        turn = int(raw) + 1 if raw else 1
        fh.seek(0)
        fh.truncate()
        fh.write(str(turn))
    return turn


def _pick(script: dict[str, object], turn: int, prompt: str) -> dict[str, object] | None:
    replies = script.get("replies") or []
    assert isinstance(replies, list)
    if turn <= len(replies):
        step = replies[turn - 1]
        assert isinstance(step, dict)
        return step
    for rule in script.get("rules") or []:  # type: ignore[union-attr]
        if isinstance(rule, dict) and str(rule.get("match", "")) in prompt:
            return rule
    return None


def _log(entry: dict[str, object]) -> None:
    path = os.environ.get("FAKE_AGENT_LOG")
    if not path:
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.write(json.dumps(entry) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--session", default="")
    parser.add_argument("--prompt", default=None)
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args()
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    started = time.time()
    script_path = os.environ.get("FAKE_AGENT_SCRIPT")
    script: dict[str, object] = {}
    state_dir = Path(os.environ.get("FAKE_AGENT_STATE", ".fake-agent-state"))
    if script_path:
        script = json.loads(Path(script_path).read_text())
        state_dir = Path(os.environ.get("FAKE_AGENT_STATE", Path(script_path).parent / "state"))
    turn = _next_turn(state_dir, args.session)
    step = _pick(script, turn, prompt) or {"text": "echo: {prompt}"}

    if step.get("ignore_term"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if step.get("grandchild"):
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(3600)"],
            stdin=subprocess.DEVNULL,
        )
        pids = os.environ.get("FAKE_AGENT_PIDS")
        if pids:
            with open(pids, "a") as fh:
                fh.write(f"{os.getpid()} {child.pid}\n")
    if step.get("escapee"):
        escapee = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(3600)"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        pids = os.environ.get("FAKE_AGENT_PIDS")
        if pids:
            with open(pids, "a") as fh:
                fh.write(f"{escapee.pid}\n")
    if step.get("progress"):
        sys.stdout.write(str(step["progress"]))
        sys.stdout.flush()
    wait_file = step.get("wait_file")
    if wait_file:
        while not Path(str(wait_file)).exists():
            time.sleep(0.02)
    if step.get("sleep"):
        time.sleep(float(step["sleep"]))  # type: ignore[arg-type]
    for rel, content in dict(step.get("files") or {}).items():  # type: ignore[call-overload]
        target = Path(rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(str(content))
    for argv in step.get("run") or []:  # type: ignore[union-attr]
        subprocess.run(argv, check=True, capture_output=True)

    out = sys.stdout.buffer
    err = sys.stderr.buffer
    if step.get("stderr"):
        err.write(str(step["stderr"]).encode())
    big_err = int(step.get("stderr_bytes", 0))  # type: ignore[call-overload]
    big_out = int(step.get("stdout_bytes", 0))  # type: ignore[call-overload]
    block = b"x" * 65535 + b"\n"
    # Interleave so a reader that drains only one pipe deadlocks.
    while big_err > 0 or big_out > 0:
        if big_err > 0:
            n = min(big_err, len(block))
            err.write(block[:n])
            big_err -= n
        if big_out > 0:
            n = min(big_out, len(block))
            out.write(block[:n])
            big_out -= n
    text = str(step.get("text", ""))
    text = text.replace("{prompt}", prompt).replace("{session}", args.session)
    text = text.replace("{turn}", str(turn))
    out.write(text.encode("utf-8"))
    out.flush()
    err.flush()
    _log(
        {
            "session": args.session,
            "turn": turn,
            "prompt": prompt,
            "pid": os.getpid(),
            "cwd": os.getcwd(),
            "started": started,
            "finished": time.time(),
        }
    )
    return int(step.get("exit", 0))  # type: ignore[call-overload]


if __name__ == "__main__":
    sys.exit(main())
