"""How the bot calls people in what it says: a first name or @username, never a bare id.

Names come from the people's own updates (every update carries its sender); the bot keeps
the latest one per user id in its database, so a restart still says "approved by Ann".
"""

from __future__ import annotations

from typing import Protocol

from chatfront.store import BotStore

__all__ = ["People", "display_name"]


class _User(Protocol):
    @property
    def id(self) -> int: ...

    @property
    def first_name(self) -> str: ...

    @property
    def username(self) -> str | None: ...


def display_name(first_name: str | None, username: str | None) -> str | None:
    """A person's name for chat texts: the first name, else @username; None when neither."""
    first = " ".join((first_name or "").split())[:64]
    if first:
        return first
    return f"@{username}" if username else None


class People:
    """The names of the people the bot has seen (cached; written when one changes)."""

    def __init__(self, store: BotStore) -> None:
        self._store = store
        self._names: dict[int, str] = {}

    async def load(self) -> None:
        self._names.update(await self._store.people())

    async def seen(self, user: _User) -> None:
        name = display_name(user.first_name, user.username)
        if name is None or self._names.get(user.id) == name:
            return
        self._names[user.id] = name
        await self._store.remember_person(user.id, name)

    def name(self, user_id: int | None) -> str:
        """``user_id``'s name; someone the bot never saw is "user ID" (all it knows)."""
        if user_id is None:
            return "someone"
        return self._names.get(user_id) or f"user {user_id}"
