"""What turnstile's MCP permission server does with a request (the server itself is
:class:`~engine.approvals.listener.ApprovalListener`).

The agent CLI calls its one tool, ``approve``, with the tool call it wants to make. The
broker records the request in the store, nudges the front end, and waits for a person's
decision, however long that takes (the turn contract: no timeout; ``/stop`` ends the turn
and the connection with it).
The answer is what Claude Code expects from a permission prompt tool: one text block
holding ``{"behavior": "allow", "updatedInput": {...}}`` or
``{"behavior": "deny", "message": "..."}``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Mapping
from typing import Any, Final

from engine.approvals.policy import ApprovalPolicy, Decision
from engine.approvals.presets import Reach, assess
from engine.approvals.route import ASK_TOOL
from engine.approvals.store import SqliteApprovalStore, ToolRequest
from engine.runs.pause import Pauses

__all__ = ["PermissionBroker", "answer_for", "nudge"]

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
    if request.state is Decision.DENIED and request.decided_by is not None and request.no_grant:
        message = f"A person denied this {request.tool} call: it {request.why}."
        if request.reason:
            message += f" {request.reason}"
        return {"behavior": "deny", "message": message}
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
    """Records one run's requests and waits for their decisions.

    ``policy``: a preset lets the calls it does not ask about run (recorded, nobody asked);
    every other policy asks for each call that reaches it. A catastrophic call always asks
    and no session grant covers it. ``worktree``: the agent's folder (what "outside the
    project folder" means).
    """

    def __init__(
        self,
        store: SqliteApprovalStore,
        *,
        run_id: str,
        policy: ApprovalPolicy = ApprovalPolicy.ALL,
        worktree: str | None = None,
        starter: int | None = None,
        wake: str | None = None,
        poll: float = _POLL_SECONDS,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.policy = policy
        self.worktree = worktree
        self.starter = starter
        self.wake = wake
        self.poll = poll

    async def ask(
        self, tool_name: str, tool_input: Mapping[str, Any], tool_use_id: str | None
    ) -> dict[str, Any]:
        if tool_name == ASK_TOOL:  # a question for a person is no call to approve
            return {"behavior": "allow", "updatedInput": dict(tool_input)}
        # A paused run finished the call it was in: this next one waits until it may go on.
        await Pauses(self.store.db).wait_while_paused(self.run_id)
        judged = assess(tool_name, tool_input, self.worktree)
        preset = None
        if self.policy.is_preset and not self.policy.asks(judged):
            preset = f"the {self.policy.value} preset lets it run"
        request = await self.store.open_request(
            self.run_id,
            tool_name,
            tool_input,
            tool_use_id=tool_use_id,
            starter_id=self.starter,
            why=judged.why or None,
            no_grant=judged.reach is Reach.CATASTROPHIC,
            allowed_by_preset=preset,
        )
        _LOGGER.info("tool request %s: %s (%s)", request.id, tool_name, request.state.value)
        if request.state is Decision.PENDING:
            nudge(self.wake, request.id)
        while request.state is Decision.PENDING:
            await asyncio.sleep(self.poll)
            request = await self.store.get(request.id)
        return answer_for(request)
