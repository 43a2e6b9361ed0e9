"""What a person may change from the web view, with exactly the chat's rules.

Approving is bound to the artifact's hash the page showed (a page opened before the
artifact changed cannot approve the new one), the gate rules refuse self-approval, and
every attempt, refused or not, is audited with origin ``web``. What the chat shows of a
decision made here (its gate message, its tool request message) and stopping a run are the
serving front end's: it passes them in as :class:`WebHooks`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

from chatfront.auth import Role
from engine.approvals.policy import Decision, Scope
from engine.errors import NotFoundError
from engine.gates.records import ApprovalOutcome, ApprovalResult
from engine.store.audit import SqliteAuditLog

if TYPE_CHECKING:
    from engine.approvals.store import SqliteApprovalStore, ToolRequest
    from engine.gates import Gates
    from engine.store.backend import AnyDatabase

__all__ = ["ORIGIN", "TOOL_CHOICES", "Outcome", "WebActions", "WebHooks", "may_decide_tool"]

#: The audit origin of what people do on the web view.
ORIGIN: Final = "web"

#: The tool-request buttons: (decision, scope) by the form's value.
TOOL_CHOICES: Final[dict[str, tuple[Decision, Scope | None]]] = {
    "once": (Decision.ALLOWED, Scope.ONCE),
    "session": (Decision.ALLOWED, Scope.SESSION),
    "deny": (Decision.DENIED, None),
}


class WebHooks(Protocol):
    """What the front end serving the web view does for it."""

    async def gate_decided(self, task: str, result: ApprovalResult, user_id: int) -> None:
        """A gate was decided on the web: wake its drive, change the chat's gate message."""
        ...

    async def tool_decided(self, request: ToolRequest) -> None:
        """A tool request was decided on the web: the chat's message says so; an allow for
        the session allows the run's other waiting calls it covers."""
        ...

    async def stop(self, run_id: str, user_id: int) -> bool:
        """Stop the run (True: it was running and is asked to stop)."""
        ...


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the page tells the person after a change."""

    ok: bool
    message: str


def may_decide_tool(
    roles: frozenset[Role], user_id: int, starter_id: int | None, *, forbid_self: bool
) -> str | None:
    """Why ``user_id`` may not decide a tool request of a run ``starter_id`` started (None:
    they may); the chat's rule."""
    is_starter = starter_id is not None and user_id == starter_id
    if is_starter and forbid_self:
        return "you started this run, and self-approval is forbidden here"
    if roles & {Role.APPROVER, Role.ADMIN}:
        return None
    if is_starter and Role.OPERATOR in roles:
        return None
    return "it needs the approver role (or to be the operator who started the run)"


class WebActions:
    """The changes a signed-in person asks for, each checked, done and audited."""

    def __init__(
        self,
        db: AnyDatabase,
        gates: Gates,
        approvals: SqliteApprovalStore,
        hooks: WebHooks,
        *,
        forbid_self_approval: bool,
    ) -> None:
        self._audit = SqliteAuditLog(db)
        self._gates = gates
        self._approvals = approvals
        self._hooks = hooks
        self._forbid_self = forbid_self_approval

    async def _record(
        self, event: str, outcome: str, user_id: int, *, task: str | None = None, detail: str = ""
    ) -> None:
        await self._audit.record(
            event, outcome, origin=ORIGIN, task=task, actor=str(user_id), detail=detail[:300]
        )

    async def approve(
        self, roles: frozenset[Role], user_id: int, task: str, sha256: str
    ) -> Outcome:
        if not roles & {Role.APPROVER, Role.ADMIN}:
            await self._record("approve", "refused", user_id, task=task, detail="not an approver")
            return Outcome(False, "Approving needs the approver role.")
        if len(sha256) < 8:
            return Outcome(False, "This page named no artifact: open the task again.")
        result = await self._gates.approve(task, by=user_id, expected_sha256=sha256)
        await self._record(
            "approve", result.outcome.value, user_id, task=task, detail=result.detail or ""
        )
        if result.outcome in (ApprovalOutcome.APPROVED, ApprovalOutcome.RECORDED):
            await self._hooks.gate_decided(task, result, user_id)
        return _said(result, task)

    async def reject(
        self, roles: frozenset[Role], user_id: int, task: str, sha256: str, reason: str
    ) -> Outcome:
        if not roles & {Role.APPROVER, Role.ADMIN}:
            await self._record("reject", "refused", user_id, task=task, detail="not an approver")
            return Outcome(False, "Rejecting needs the approver role.")
        reason = reason.strip()
        if not reason:
            return Outcome(False, "Say why you reject it: the agent revises with your reason.")
        gate = await self._gates.open_gate(task)
        shown = gate.gate_sha256 if gate is not None else None
        if len(sha256) < 8 or shown is None or not shown.startswith(sha256):
            # The page showed another artifact (or none waits): nothing of it is decided.
            await self._record("reject", "refused", user_id, task=task, detail="stale page")
            return Outcome(
                False,
                f"Task {task} no longer waits on the artifact this page showed: "
                "look at it again before deciding.",
            )
        result = await self._gates.reject(task, by=user_id, reason=reason)
        await self._record(
            "reject", result.outcome.value, user_id, task=task, detail=result.detail or ""
        )
        if result.outcome is ApprovalOutcome.REJECTED:
            await self._hooks.gate_decided(task, result, user_id)
        return _said(result, task)

    async def decide_tool(
        self, roles: frozenset[Role], user_id: int, request_id: int, choice: str
    ) -> Outcome:
        if choice not in TOOL_CHOICES:
            return Outcome(False, "Unknown choice.")
        try:
            request = await self._approvals.get(request_id)
        except NotFoundError:
            return Outcome(False, f"There is no tool request {request_id}.")
        refusal = may_decide_tool(roles, user_id, request.starter_id, forbid_self=self._forbid_self)
        if refusal is not None:
            await self._record(
                "tool_approval", "refused", user_id, detail=f"request {request_id}: {refusal}"
            )
            return Outcome(False, f"Not accepted: {refusal}.")
        decision, scope = TOOL_CHOICES[choice]
        result = await self._approvals.decide(request_id, decision, scope=scope, by=user_id)
        if not result.changed:
            return Outcome(False, "This request was decided already.")
        await self._record(
            "tool_approval",
            result.request.state.value,
            user_id,
            detail=f"request {request_id} of run {request.run_id}: {request.tool}",
        )
        await self._hooks.tool_decided(result.request)
        word = "allowed" if decision is Decision.ALLOWED else "denied"
        return Outcome(True, f"The {request.tool} call was {word}.")

    async def stop(self, roles: frozenset[Role], user_id: int, run_id: str) -> Outcome:
        if not roles & {Role.OPERATOR, Role.ADMIN}:
            await self._record("stop", "refused", user_id, detail=f"run {run_id}: no operator")
            return Outcome(False, "Stopping a run needs the operator role.")
        stopped = await self._hooks.stop(run_id, user_id)
        await self._record("stop", "stopped" if stopped else "not_running", user_id, detail=run_id)
        if not stopped:
            return Outcome(False, f"Run {run_id} is not running.")
        return Outcome(True, f"Run {run_id} is asked to stop.")


def _said(result: ApprovalResult, task: str) -> Outcome:
    match result.outcome:
        case ApprovalOutcome.APPROVED:
            return Outcome(True, f"Approved: task {task} goes on to its next phase.")
        case ApprovalOutcome.RECORDED:
            return Outcome(
                True, f"Approval recorded: {result.approvals} of {result.quorum} needed."
            )
        case ApprovalOutcome.ALREADY_APPROVED:
            return Outcome(True, "You approved this artifact already; nothing changed.")
        case ApprovalOutcome.REJECTED:
            return Outcome(True, f"Rejected: task {task} revises the phase with your reason.")
        case _:
            why = result.detail or (result.reason.value if result.reason else "refused")
            return Outcome(False, f"Not accepted: {why}")
