"""How an agent CLI reaches turnstile's permission server: the route and the CLI's flags.

Claude Code starts what its MCP config names (``--mcp-config``) and calls its ``approve``
tool for every tool call its rules do not settle (``--permission-prompt-tool``). What it
starts is a relay to an :class:`~engine.approvals.listener.ApprovalListener` in the front
end's (or the worker's) own process: the store never enters the agent's sandbox, and the
CLI's argv (readable by every user in ``/proc/PID/cmdline``) names no database.

Measured on Claude Code 2.1.197: in ``-p`` mode MCP servers connect in the background
unless ``MCP_CONNECTION_NONBLOCKING`` is off, and a tool call made before the server is up
fails as "permission prompt tool not found", so the connection is made blocking (with a
generous connect timeout). A tool call times out after ``MCP_TOOL_TIMEOUT`` ms; the CLI
caps it at 2^31-1 ms (24.8 days), which turnstile sets, so a request waits for a person,
not for a clock.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from engine.approvals.policy import ApprovalPolicy
from engine.store.location import PostgresURL

__all__ = [
    "ASK_TOOL",
    "PERMISSION_TOOL",
    "SERVER_NAME",
    "ApprovalRoute",
    "claude_approval_args",
]

SERVER_NAME: Final = "turnstile"
PERMISSION_TOOL: Final = f"mcp__{SERVER_NAME}__approve"
#: The tool the agent asks a person a question with (the same server's ``ask``).
ASK_TOOL: Final = f"mcp__{SERVER_NAME}__ask"
# The longest tool call Claude Code allows (a signed 32-bit millisecond timer).
_NO_TIMEOUT_MS: Final = "2147483647"
_CONNECT_TIMEOUT_MS: Final = "120000"
# Rules that make Claude Code ask (the permission tool) where it would not.
_ASK_EVERY_TOOL: Final = (
    "Bash",
    "Read",
    "Glob",
    "Grep",
    "LS",
    "NotebookRead",
    "WebFetch",
    "WebSearch",
    "Write",
    "Edit",
    "MultiEdit",
    "NotebookEdit",
)
_ASK_SECRETS: Final = (
    "Read(**/.env)",
    "Read(**/.env.*)",
    "Read(**/*.pem)",
    "Read(**/*.key)",
    "Read(**/id_rsa*)",
    "Read(**/id_ed25519*)",
    "Read(**/.ssh/**)",
    "Read(**/.netrc)",
    "Bash(cat .env:*)",
)


@dataclass(frozen=True, slots=True)
class ApprovalRoute:
    """Where one run's permission requests go.

    Attributes:
        database: the store's SQLite file or PostgreSQL server (the listener opens it).
        run_id: the run the requests belong to.
        policy: ``unlisted`` or ``all`` (``off`` has no route).
        starter: the user who started the run (may decide unless self-approval is forbidden).
        wake: a Unix datagram socket the front end listens on, nudged after each request.
    """

    database: Path | PostgresURL
    run_id: str
    policy: ApprovalPolicy
    starter: int | None = None
    wake: str | None = None


def claude_approval_args(
    mcp_config: Mapping[str, object], policy: ApprovalPolicy = ApprovalPolicy.UNLISTED
) -> tuple[list[str], dict[str, str]]:
    """Claude Code flags and environment that send permission prompts to the server that
    ``mcp_config`` names (an :class:`~engine.approvals.listener.ApprovalListener`'s).

    Claude Code runs what it deems read-only itself (``Read``, ``cat``, ``head``: measured
    on 2.1.197, even ``cat .env``) unless a rule says "ask". Under ``all`` and the presets
    every tool asks by rule, so every call reaches the server, which judges it; under
    ``unlisted`` the reads of secret files ask by rule. The agent's ``ask`` tool (a
    question for a person) is allowed by rule: asking whether it may ask would ask twice.
    """
    rules = list(_ASK_EVERY_TOOL if policy is ApprovalPolicy.ALL or policy.is_preset else ())
    rules += _ASK_SECRETS
    argv = [
        "--settings",
        json.dumps({"permissions": {"ask": rules, "allow": [ASK_TOOL]}}),
        "--mcp-config",
        json.dumps(mcp_config),
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
