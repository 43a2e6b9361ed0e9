"""turnstile's MCP permission server: ``python -m engine.approvals.mcp_server``.

The agent CLI starts it over stdio (see :mod:`engine.approvals.route`) and calls its one
tool, ``approve``, with the tool call it wants to make. The server records the request
in the store, nudges the front end, and waits for a person's decision, however long that
takes (the turn contract: no timeout; ``/stop`` ends the turn and this process with it).
The answer is what Claude Code expects from a permission prompt tool: one text block
holding ``{"behavior": "allow", "updatedInput": {...}}`` or
``{"behavior": "deny", "message": "..."}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import Mapping
from typing import Any, Final

from engine.approvals.policy import Decision
from engine.approvals.route import ENV_DATABASE, ENV_RUN, ENV_STARTER, ENV_WAKE, SERVER_NAME
from engine.approvals.store import SqliteApprovalStore, ToolRequest
from engine.errors import ConfigError
from engine.store.backend import AnyDatabase, open_database
from engine.store.location import parse_database

__all__ = ["PermissionBroker", "answer_for", "main", "nudge"]

_LOGGER = logging.getLogger(__name__)
# How often a waiting request re-reads its row. A person's press is far slower than this.
_POLL_SECONDS: Final = 0.1


def nudge(path: str | None, request_id: int) -> None:
    """Tell the front end listening on ``path`` that request ``request_id`` is new.

    Best effort by design: the front end also scans the store every second, so a front
    end that is not listening (restarting) still sees the request, only later.
    """
    if not path:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.sendto(str(request_id).encode(), path)
        except OSError as exc:
            _LOGGER.info(
                "front end at %s not listening (%s); it finds request %s later",
                path,
                exc,
                request_id,
            )


def answer_for(request: ToolRequest) -> dict[str, Any]:
    """The permission tool's answer for a decided request."""
    if request.state is Decision.ALLOWED:
        return {"behavior": "allow", "updatedInput": dict(request.input)}
    if request.state is Decision.DENIED and request.decided_by is not None:
        message = f"A person denied this {request.tool} call (user {request.decided_by})."
        if request.reason:
            message += f" {request.reason}"
        return {"behavior": "deny", "message": message}
    if request.state is Decision.DENIED:
        reason = request.reason or "a person said no"
        return {"behavior": "deny", "message": f"This {request.tool} call was denied: {reason}."}
    reason = request.reason or "the request was withdrawn"
    return {"behavior": "deny", "message": f"Not run: {reason}."}


class PermissionBroker:
    """Records one run's requests and waits for their decisions."""

    def __init__(
        self,
        store: SqliteApprovalStore,
        *,
        run_id: str,
        starter: int | None = None,
        wake: str | None = None,
        poll: float = _POLL_SECONDS,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.starter = starter
        self.wake = wake
        self.poll = poll

    async def ask(
        self, tool_name: str, tool_input: Mapping[str, Any], tool_use_id: str | None
    ) -> dict[str, Any]:
        request = await self.store.open_request(
            self.run_id,
            tool_name,
            tool_input,
            tool_use_id=tool_use_id,
            starter_id=self.starter,
        )
        _LOGGER.info("tool request %s: %s (%s)", request.id, tool_name, request.state.value)
        if request.state is Decision.PENDING:
            nudge(self.wake, request.id)
        while request.state is Decision.PENDING:
            await asyncio.sleep(self.poll)
            request = await self.store.get(request.id)
        return answer_for(request)


def _broker_from_env(db: AnyDatabase, env: Mapping[str, str]) -> PermissionBroker:
    run_id = env.get(ENV_RUN)
    if not run_id:
        raise ConfigError(f"{ENV_RUN} is not set: this server is started by turnstile")
    starter = env.get(ENV_STARTER)
    return PermissionBroker(
        SqliteApprovalStore(db),
        run_id=run_id,
        starter=int(starter) if starter else None,
        wake=env.get(ENV_WAKE) or None,
    )


async def serve(env: Mapping[str, str]) -> None:
    """Run the stdio MCP server until the CLI closes its end."""
    # Imported here: the SDK takes about a second to import, and nothing else needs it.
    from mcp.server.mcpserver import MCPServer

    database = env.get(ENV_DATABASE)
    if not database:
        raise ConfigError(f"{ENV_DATABASE} is not set: this server is started by turnstile")
    # A PostgreSQL URL comes without its password: libpq reads it from PGPASSFILE.
    async with open_database(parse_database(database), synchronous="NORMAL") as db:
        broker = _broker_from_env(db, env)
        server: MCPServer[Any] = MCPServer(
            SERVER_NAME, instructions="Asks a person before the agent runs a tool."
        )

        async def approve(
            tool_name: str, input: dict[str, Any], tool_use_id: str | None = None
        ) -> str:
            """Ask a person whether the agent may make this tool call."""
            return json.dumps(await broker.ask(tool_name, input, tool_use_id))

        # One text block, not structured output: Claude Code accepts nothing else.
        server.add_tool(approve, name="approve", structured_output=False)
        await server.run_stdio_async()


def main() -> None:
    logging.basicConfig(
        level=os.environ.get("TURNSTILE_LOG_LEVEL", "WARNING").upper(),
        format="turnstile-approvals %(levelname)s %(message)s",
    )
    asyncio.run(serve(os.environ))


if __name__ == "__main__":
    main()
