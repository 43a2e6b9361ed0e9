"""What people are called: first name or @username, remembered from their updates."""

from __future__ import annotations

from chatfront.store.tables import Tables

__all__ = ["PeopleTables"]


class PeopleTables(Tables):
    """Names of the people the bot has seen, by Telegram user id."""

    async def remember_person(self, user_id: int, name: str) -> None:
        """Remember how a person is called (first name or @username, from their updates)."""
        await self.db.execute(
            "INSERT INTO bot_people (user_id, name, seen_at) VALUES (?, ?, ?)"
            " ON CONFLICT (user_id) DO UPDATE SET name = excluded.name, seen_at = excluded.seen_at"
            " WHERE bot_people.name <> excluded.name",
            (user_id, name, self._clock()),
        )

    async def people(self) -> dict[int, str]:
        rows = await self.db.fetchall("SELECT user_id, name FROM bot_people")
        return {int(r["user_id"]): str(r["name"]) for r in rows}
