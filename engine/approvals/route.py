"""How an agent CLI reaches turnstile's permission server: the MCP config and its flags.

Claude Code starts the server itself (``--mcp-config``) and calls its ``approve`` tool
for every tool call its rules do not settle (``--permission-prompt-tool``). Measured on
Claude Code 2.1.197: in ``-p`` mode MCP servers connect in the background unless
``MCP_CONNECTION_NONBLOCKING`` is off, and a tool call made before the server is up
fails as "permission prompt tool not found", so the connection is made blocking (with a
generous connect timeout: the server imports the MCP SDK, about a second). A tool call
times out after ``MCP_TOOL_TIMEOUT`` ms; the CLI caps it at 2^31-1 ms (24.8 days), which
turnstile sets, so a request waits for a person, not for a clock.

On PostgreSQL the server gets the database URL without its password: the MCP config is
an argument of the CLI, readable by every user in ``/proc/PID/cmdline``. The password goes
in a libpq password file (``PGPASSFILE``, mode 0600) in the front end's private folder
(0700), which only the front end's user can read, and is gone when the front end stops.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from engine.approvals.policy import ApprovalPolicy
from engine.store.location import PostgresURL

__all__ = [
    "PERMISSION_TOOL",
    "SERVER_NAME",
    "ApprovalRoute",
    "claude_approval_args",
    "write_passfile",
]

SERVER_NAME: Final = "turnstile"
PERMISSION_TOOL: Final = f"mcp__{SERVER_NAME}__approve"
# The longest tool call Claude Code allows (a signed 32-bit millisecond timer).
_NO_TIMEOUT_MS: Final = "2147483647"
_CONNECT_TIMEOUT_MS: Final = "120000"

ENV_DATABASE: Final = "TURNSTILE_APPROVAL_DATABASE"
ENV_RUN: Final = "TURNSTILE_APPROVAL_RUN"
ENV_STARTER: Final = "TURNSTILE_APPROVAL_STARTER"
ENV_WAKE: Final = "TURNSTILE_APPROVAL_WAKE"


@dataclass(frozen=True, slots=True)
class ApprovalRoute:
    """Where one run's permission requests go.

    Attributes:
        database: the store's SQLite file or PostgreSQL server (the server opens it itself).
        run_id: the run the requests belong to.
        policy: ``unlisted`` or ``all`` (``off`` has no route).
        starter: the user who started the run (may decide unless self-approval is forbidden).
        wake: a Unix datagram socket the front end listens on, nudged after each request.
        python: the interpreter that runs the server.
        passfile: the password file of a PostgreSQL server (:func:`write_passfile`).
    """

    database: Path | PostgresURL
    run_id: str
    policy: ApprovalPolicy
    starter: int | None = None
    wake: str | None = None
    python: str = sys.executable
    passfile: str | None = None

    def server_env(self) -> dict[str, str]:
        if isinstance(self.database, PostgresURL):
            where = self.database.without_password()
        else:
            where = str(self.database.resolve())
        env = {ENV_DATABASE: where, ENV_RUN: self.run_id}
        if self.passfile is not None:
            env["PGPASSFILE"] = self.passfile
        if self.starter is not None:
            env[ENV_STARTER] = str(self.starter)
        if self.wake:
            env[ENV_WAKE] = self.wake
        return env

    def mcp_config(self) -> dict[str, object]:
        # -P: the agent's cwd (a repository, maybe holding an ``engine`` folder) never
        # shadows turnstile's own modules.
        server = {
            "type": "stdio",
            "command": self.python,
            "args": ["-P", "-m", "engine.approvals.mcp_server"],
            "env": self.server_env(),
        }
        return {"mcpServers": {SERVER_NAME: server}}


def claude_approval_args(route: ApprovalRoute) -> tuple[list[str], dict[str, str]]:
    """Claude Code flags and environment that send permission prompts along ``route``."""
    argv = [
        "--mcp-config",
        json.dumps(route.mcp_config()),
        "--permission-prompt-tool",
        PERMISSION_TOOL,
        # The model never calls the permission tool itself (measured: the CLI still uses
        # it for permission prompts).
        f"--disallowedTools={PERMISSION_TOOL}",
    ]
    env = {
        "MCP_CONNECTION_NONBLOCKING": "0",
        "MCP_CONNECT_TIMEOUT_MS": _CONNECT_TIMEOUT_MS,
        "MCP_TIMEOUT": _CONNECT_TIMEOUT_MS,
        "MCP_TOOL_TIMEOUT": _NO_TIMEOUT_MS,
    }
    return argv, env


def write_passfile(database: Path | PostgresURL, folder: str) -> str | None:
    """Write the password of ``database`` into a libpq password file in ``folder``.

    Returns its path, or None when there is no password to pass (a SQLite file, a URL
    without one). ``folder`` must be private to this user (the watcher's, 0700).
    """
    if not isinstance(database, PostgresURL) or database.password is None:
        return None

    def escape(value: str) -> str:
        return value.replace("\\", "\\\\").replace(":", "\\:")

    user = escape(database.username or "*")
    path = os.path.join(folder, "pgpass")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(f"*:*:*:{user}:{escape(database.password)}\n")
    return path
