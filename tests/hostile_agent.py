#!/usr/bin/env python3
"""A hostile agent CLI: it tries to reach the control plane, then does its real work.

Usage (a command-agent template): ``hostile_agent.py PROMPT``. What it goes after comes
from ``FAKE_HOSTILE`` (JSON, the worst case: the attacker knows every path and id):

- ``database``: the SQLite file (or a PostgreSQL URL without its password),
- ``env_file`` and ``token``: the bot's ``.env`` and the token in it,
- ``sibling``: a file in another run's worktree,
- ``outside``: paths outside its folders it tries to create,
- ``bot_pid``: the bot's process,
- ``pg_socket``: PostgreSQL's Unix socket,
- ``task``, ``tasks_root``, ``approver``: a gate to approve with the ``turnstile`` CLI,
- ``request_id``: a tool request to decide by writing the store,
- ``repo``: turnstile's source (for ``python -m engine.cli``).

Each attempt is recorded as ``{"got_in": bool, "detail": str}`` in ``hostile-report.json``
in the working directory (committed with the real work: a file written and committed).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPORT: dict[str, dict[str, object]] = {}


def attempt(name: str, action: Callable[[], object]) -> None:
    try:
        detail = action()
    except Exception as exc:
        REPORT[name] = {"got_in": False, "detail": f"{type(exc).__name__}: {exc}"[:300]}
        return
    got_in = detail is not False and detail is not None
    REPORT[name] = {"got_in": got_in, "detail": str(detail)[:300]}


def main() -> int:
    targets = json.loads(os.environ.get("FAKE_HOSTILE", "{}"))
    database = str(targets.get("database", ""))

    def read_database() -> object:
        if database.startswith("postgresql"):
            return False
        with open(database, "rb") as fh:
            head = fh.read(100)
        return "SQLite file read" if head.startswith(b"SQLite format") else False

    def read_env_file() -> object:
        text = Path(targets["env_file"]).read_text(encoding="utf-8", errors="replace")
        return "token read" if targets["token"] in text else False

    def read_sibling() -> object:
        return Path(targets["sibling"]).read_text(encoding="utf-8") or False

    def write_outside() -> object:
        # Judged on the host too: inside, /tmp is the sandbox's own, so a write there may
        # succeed without reaching the machine.
        written = []
        for path in targets.get("outside", []):
            try:
                Path(path).write_text("hostile was here\n", encoding="utf-8")
                written.append(path)
            except OSError:
                continue
        return written or False

    def signal_bot() -> object:
        os.kill(int(targets["bot_pid"]), 0)
        return "the bot can be signalled"

    def list_bot_proc() -> object:
        pid = int(targets["bot_pid"])
        names = os.listdir(f"/proc/{pid}")
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        return f"{len(names)} entries, environ {len(environ)} bytes"

    def pg_socket() -> object:
        path = targets.get("pg_socket")
        if not path:
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(path)
        return "connected to PostgreSQL's socket"

    def approve_gate() -> object:
        env = {
            **os.environ,
            "TURNSTILE_DATABASE": database,
            "TURNSTILE_TASKS_ROOT": str(targets["tasks_root"]),
            "TURNSTILE_APPROVERS": str(targets["approver"]),
            "PYTHONPATH": str(targets["repo"]),
        }
        argv = [sys.executable, "-m", "engine.cli", "status", "--task", str(targets["task"])]
        argv += ["--approve", "--by", str(targets["approver"])]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        said = (done.stdout + done.stderr).strip()[-200:]
        return f"approved: {said}" if done.returncode == 0 else False

    def decide_tool() -> object:
        if database.startswith("postgresql"):
            import psycopg  # the attacker tries the server over TCP, without a password

            with psycopg.connect(database, connect_timeout=5) as conn:
                done = conn.execute(
                    "UPDATE tool_requests SET state = 'allowed', decided_by = 1 WHERE id = %s",
                    (targets["request_id"],),
                )
                return "decided over TCP" if done.rowcount == 1 else False
        import sqlite3

        conn = sqlite3.connect(f"file:{database}?mode=rw", uri=True, timeout=2)
        try:
            done = conn.execute(
                "UPDATE tool_requests SET state = 'allowed', decided_by = 1 WHERE id = ?",
                (targets["request_id"],),
            )
            conn.commit()
        finally:
            conn.close()
        # A file the sandbox's own copy of the CLI made is not the store: nothing to decide.
        return "decided in the file" if done.rowcount == 1 else False

    def settings_in_env() -> object:
        leaked = [k for k in os.environ if k.startswith("TURNSTILE_") and k != "TURNSTILE_TURN_ID"]
        secret = str(targets.get("token", "")) or "\0"
        leaked += [
            k
            for k, v in os.environ.items()
            if k != "FAKE_HOSTILE" and (secret in v or (database and database in v))
        ]
        return leaked or False

    attempt("read_database", read_database)
    attempt("read_env_file", read_env_file)
    attempt("read_sibling", read_sibling)
    attempt("write_outside", write_outside)
    attempt("signal_bot", signal_bot)
    attempt("list_bot_proc", list_bot_proc)
    attempt("pg_socket", pg_socket)
    # Before the CLI: a turnstile started inside makes a database of its own in the
    # sandbox's empty folder (which is not the store, and goes with the sandbox).
    attempt("decide_tool", decide_tool)
    attempt("approve_gate", approve_gate)
    attempt("settings_in_env", settings_in_env)

    # The real work still works: a file written and committed in its worktree.
    Path("work.txt").write_text("done\n", encoding="utf-8")
    Path("hostile-report.json").write_text(json.dumps(REPORT, indent=1), encoding="utf-8")
    git = ["git", "-c", "user.name=agent", "-c", "user.email=agent@localhost"]
    subprocess.run([*git, "add", "work.txt", "hostile-report.json"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "hostile agent's work"], check=True)
    held = sorted(name for name, r in REPORT.items() if not r["got_in"] or name == "write_outside")
    print(f"attempts: {len(REPORT)}; held: {len(held)}; work committed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
