"""Who may do what: deny by default, numeric user ids per role, allowed chats."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from engine.runs.spec import PlaceId

__all__ = ["Action", "Authorizer", "Decision", "Role", "allows", "needed_roles"]


class Role(StrEnum):
    OPERATOR = "operator"
    APPROVER = "approver"
    ADMIN = "admin"


class Action(StrEnum):
    """Rights are per action: prompting, steering, approving and administering are separate."""

    CHAT = "chat"
    PROMPT = "prompt"
    START_RUN = "start_run"
    STEER = "steer"
    STOP = "stop"
    STATUS = "status"
    APPROVE = "approve"
    REJECT = "reject"
    TASKS = "tasks"
    AUDIT = "audit"
    BUDGET = "budget"  # raise a run's budget so it goes on
    PERMISSIONS = "permissions"  # set what a place's tool calls ask first
    ANSWER = "answer"  # answer a question the agent asks
    PAUSE = "pause"  # pause a run at its next action, and let it go on
    HELP = "help"


_NEEDS: Mapping[Action, frozenset[Role]] = {
    Action.CHAT: frozenset({Role.OPERATOR}),
    Action.PROMPT: frozenset({Role.OPERATOR}),
    Action.START_RUN: frozenset({Role.OPERATOR}),
    Action.STEER: frozenset({Role.OPERATOR}),
    Action.STOP: frozenset({Role.OPERATOR}),
    Action.STATUS: frozenset({Role.OPERATOR, Role.APPROVER}),
    Action.APPROVE: frozenset({Role.APPROVER}),
    Action.REJECT: frozenset({Role.APPROVER}),
    Action.TASKS: frozenset(),
    Action.AUDIT: frozenset(),
    Action.BUDGET: frozenset(),
    Action.PERMISSIONS: frozenset(),
    Action.ANSWER: frozenset({Role.OPERATOR}),
    Action.PAUSE: frozenset({Role.OPERATOR}),
    Action.HELP: frozenset({Role.OPERATOR, Role.APPROVER}),
}


def needed_roles(action: Action) -> str:
    """The roles that grant ``action``, in words ("operator or approver"; "admin")."""
    needed = [role.value for role in Role if role in _NEEDS[action]]
    return " or ".join(needed) if needed else Role.ADMIN.value


def allows(roles: Collection[Role], action: Action) -> bool:
    """Whether someone with ``roles`` may do ``action`` (admins may do everything)."""
    return Role.ADMIN in roles or any(role in _NEEDS[action] for role in roles)


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    reason: str


@dataclass(frozen=True)
class Authorizer:
    """Role membership from settings; an empty list admits nobody. Admins may do everything."""

    admins: frozenset[int] = frozenset()
    approvers: frozenset[int] = frozenset()
    operators: frozenset[int] = frozenset()
    allowed_chats: frozenset[PlaceId] = frozenset()
    migrated: dict[PlaceId, PlaceId] = field(default_factory=dict)

    @classmethod
    def from_ids(
        cls,
        *,
        admins: Iterable[int],
        approvers: Iterable[int],
        operators: Iterable[int],
        allowed_chats: Iterable[PlaceId],
    ) -> Authorizer:
        return cls(
            frozenset(admins), frozenset(approvers), frozenset(operators), frozenset(allowed_chats)
        )

    def roles(self, user_id: int) -> frozenset[Role]:
        found = set()
        if user_id in self.admins:
            found.add(Role.ADMIN)
        if user_id in self.approvers:
            found.add(Role.APPROVER)
        if user_id in self.operators:
            found.add(Role.OPERATOR)
        return frozenset(found)

    def chat_allowed(self, chat_id: PlaceId) -> bool:
        """A listed chat, or a supergroup a listed group became."""
        if chat_id in self.allowed_chats:
            return True
        old = self.migrated.get(chat_id)
        return old is not None and old in self.allowed_chats

    def follow_migration(self, old_chat: PlaceId, new_chat: PlaceId) -> None:
        self.migrated[new_chat] = old_chat

    def check(self, user_id: int | None, chat_id: PlaceId, action: Action) -> Decision:
        if not self.chat_allowed(chat_id):
            return Decision(False, "chat not allowed")
        if user_id is None:
            return Decision(False, "no user")
        roles = self.roles(user_id)
        if Role.ADMIN in roles:
            return Decision(True, "admin")
        needed = _NEEDS[action]
        if roles & needed:
            return Decision(True, ",".join(sorted(r.value for r in roles & needed)))
        return Decision(False, f"{action.value} needs {needed_roles(action)}")
