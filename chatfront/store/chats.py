"""Following a group that became a supergroup, and the bot's part of the audit log."""

from __future__ import annotations

from chatfront.store.records import AuditEntry, topic_key
from chatfront.store.tables import AUDIT_ORIGIN, Tables
from engine.runs.spec import PlaceId

__all__ = ["BotAuditTables", "ChatMoveTables"]


class ChatMoveTables(Tables):
    """Chat ids that changed (a group became a supergroup)."""

    async def migrate_chat(self, old_chat: PlaceId, new_chat: PlaceId) -> None:
        """Follow a group that became a supergroup: bindings, queues and outbox move."""
        now = self._clock()
        async with self.db.transaction() as conn:
            await conn.execute(
                "INSERT INTO bot_chat_migrations (old_chat_id, new_chat_id, migrated_at)"
                " VALUES (?, ?, ?) ON CONFLICT (old_chat_id) DO UPDATE"
                " SET new_chat_id = excluded.new_chat_id, migrated_at = excluded.migrated_at",
                (old_chat, new_chat, now),
            )
            tables = ("bot_bindings", "bot_prompts", "bot_gates")
            for table in (*tables, "bot_place_permissions"):
                await conn.execute(
                    f"UPDATE {table} SET chat_id = ? WHERE chat_id = ?",  # noqa: S608
                    (new_chat, old_chat),
                )
            await conn.execute(
                "UPDATE runs SET chat_id = ? WHERE chat_id = ?", (new_chat, old_chat)
            )
            await conn.execute(
                "UPDATE bot_outbox SET chat_id = ? WHERE chat_id = ? AND state = 'pending'",
                (new_chat, old_chat),
            )
            await conn.execute(
                "UPDATE bot_live SET chat_id = ? WHERE chat_id = ?", (new_chat, old_chat)
            )

    async def migrated_from(self) -> dict[PlaceId, PlaceId]:
        """new chat id → old chat id, for every followed migration."""
        rows = await self.db.fetchall("SELECT old_chat_id, new_chat_id FROM bot_chat_migrations")
        return {str(r["new_chat_id"]): str(r["old_chat_id"]) for r in rows}


class PlacePermissionTables(Tables):
    """A place's permission preset (/permissions), beside the settings' policy."""

    async def place_permissions(self, chat_id: PlaceId, thread_id: PlaceId | None) -> str | None:
        row = await self.db.fetchone(
            "SELECT policy FROM bot_place_permissions WHERE chat_id = ? AND thread_id = ?",
            (chat_id, topic_key(thread_id)),
        )
        return str(row["policy"]) if row is not None else None

    async def set_place_permissions(
        self, chat_id: PlaceId, thread_id: PlaceId | None, policy: str | None, *, by: int | None
    ) -> None:
        """Set the place's preset (None: back to the settings' policy)."""
        if policy is None:
            await self.db.execute(
                "DELETE FROM bot_place_permissions WHERE chat_id = ? AND thread_id = ?",
                (chat_id, topic_key(thread_id)),
            )
            return
        await self.db.execute(
            "INSERT INTO bot_place_permissions (chat_id, thread_id, policy, set_by, set_at)"
            " VALUES (?, ?, ?, ?, ?) ON CONFLICT (chat_id, thread_id) DO UPDATE"
            " SET policy = excluded.policy, set_by = excluded.set_by, set_at = excluded.set_at",
            (chat_id, topic_key(thread_id), policy, by, self._clock()),
        )


class BotAuditTables(Tables):
    """Who asked the bot for what, and whether it was allowed."""

    async def audit(
        self,
        *,
        action: str,
        outcome: str,
        user_id: int | None,
        chat_id: PlaceId | None,
        update_id: int | None,
        reason: str | None = None,
    ) -> None:
        await self._audit.record(
            action,
            outcome,
            origin=AUDIT_ORIGIN,
            actor=str(user_id) if user_id is not None else None,
            chat_id=chat_id,
            update_id=update_id,
            detail=reason,
        )

    async def audit_entries(self, *, limit: int = 50) -> list[AuditEntry]:
        """The bot's latest audit entries, newest first."""
        found = await self._audit.entries(origin=AUDIT_ORIGIN, limit=limit)
        return [
            AuditEntry(
                at=e.at,
                user_id=int(e.actor)
                if e.actor is not None and e.actor.lstrip("-").isdigit()
                else None,
                chat_id=e.chat_id,
                update_id=e.update_id,
                action=e.event,
                outcome=e.outcome,
                reason=e.detail,
            )
            for e in reversed(found)
        ]
