"""Tool requests and session grants: the store the permission server and front ends share.

The MCP permission server (a child of the agent CLI) writes a request and waits for its
decision; a front end (the bot, the terminal) shows it and records who decided. Every
decision is a compare-and-set from ``pending``, so two presses (or a press racing a
``/stop``) decide once. The rows are the audit trail: who, when, which scope, why.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.approvals.policy import Decision, Scope, grant_key
from engine.errors import NotFoundError
from engine.store.events import EventKind, add_event, events_written

if TYPE_CHECKING:
    from engine.store.backend import AnyDatabase

__all__ = ["ApprovalStore", "DecideResult", "SqliteApprovalStore", "ToolRequest"]


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """One permission request of an agent's tool call."""

    id: int
    run_id: str
    tool: str
    input: Mapping[str, Any]
    tool_use_id: str | None
    starter_id: int | None
    state: Decision
    scope: Scope | None
    decided_by: int | None
    reason: str | None
    posted_at: float | None
    created_at: float
    decided_at: float | None
    #: What makes it ask, in plain words (None: the policy asks for every call).
    why: str | None = None
    #: A catastrophic call: it always asks, and "allow for this session" is not offered.
    no_grant: bool = False

    @classmethod
    def from_row(cls, row: Any) -> ToolRequest:
        return cls(
            id=row["id"],
            run_id=row["run_id"],
            tool=row["tool"],
            input=json.loads(row["input_json"]),
            tool_use_id=row["tool_use_id"],
            starter_id=row["starter_id"],
            state=Decision(row["state"]),
            scope=Scope(row["scope"]) if row["scope"] else None,
            decided_by=row["decided_by"],
            reason=row["reason"],
            why=row["asks_because"],
            no_grant=bool(row["no_grant"]),
            posted_at=row["posted_at"],
            created_at=row["created_at"],
            decided_at=row["decided_at"],
        )

    @property
    def key(self) -> str:
        return grant_key(self.tool, self.input)


@dataclass(frozen=True, slots=True)
class DecideResult:
    """``changed`` is False when the request was decided already (``request`` says how)."""

    changed: bool
    request: ToolRequest


def _head(tool_input: Mapping[str, Any], most: int = 500) -> str:
    """What the log keeps of a tool's input (the whole of it is the request's)."""
    text = json.dumps(dict(tool_input), ensure_ascii=False, default=str)
    return text if len(text) <= most else text[: most - 1] + "…"


class SqliteApprovalStore:
    """Tool requests and their decisions, on the shared database (SQLite or PostgreSQL)."""

    def __init__(self, db: AnyDatabase, *, clock: Callable[[], float] = time.time) -> None:
        self.db = db
        self._clock = clock

    async def open_request(
        self,
        run_id: str,
        tool: str,
        tool_input: Mapping[str, Any],
        *,
        tool_use_id: str | None = None,
        starter_id: int | None = None,
        why: str | None = None,
        no_grant: bool = False,
        allowed_by_preset: str | None = None,
    ) -> ToolRequest:
        """Record a request; one a session grant covers is allowed at once (and says so).

        ``why``: what makes it ask, in plain words. ``no_grant``: no session grant covers
        it (a catastrophic call). ``allowed_by_preset``: the run's preset lets it run
        without asking; it is recorded allowed, saying so (the audit of a ``free`` run).
        """
        key = grant_key(tool, tool_input)
        now = self._clock()
        text = json.dumps(dict(tool_input))
        async with self.db.transaction() as conn:
            grant = None
            if allowed_by_preset is None and not no_grant:
                cursor = await conn.execute(
                    "SELECT granted_by FROM tool_grants"
                    " WHERE run_id = ? AND tool = ? AND prefix = ?",
                    (run_id, tool, key),
                )
                grant = await cursor.fetchone()
            if allowed_by_preset is not None:
                decided: tuple[str, int | None, str] | None = ("preset", None, allowed_by_preset)
            elif grant is not None:
                decided = ("grant", grant["granted_by"], "allowed for this session earlier")
            else:
                decided = None
            if decided is None:
                cursor = await conn.execute(
                    "INSERT INTO tool_requests (run_id, tool, input_json, tool_use_id,"
                    " starter_id, state, asks_because, no_grant, created_at)"
                    " VALUES (?, ?, ?, ?, ?, 'pending', ?, ?, ?) RETURNING id",
                    (run_id, tool, text, tool_use_id, starter_id, why, int(no_grant), now),
                )
            else:
                scope, by, reason = decided
                cursor = await conn.execute(
                    "INSERT INTO tool_requests (run_id, tool, input_json, tool_use_id,"
                    " starter_id, state, scope, decided_by, reason, asks_because, created_at,"
                    " decided_at) VALUES (?, ?, ?, ?, ?, 'allowed', ?, ?, ?, ?, ?, ?)"
                    " RETURNING id",
                    (run_id, tool, text, tool_use_id, starter_id, scope, by, reason, why, now, now),
                )
            row = await cursor.fetchone()
            assert row is not None
            request_id = int(row[0])
            asked: dict[str, Any] = {
                "request_id": request_id,
                "tool": tool,
                "input": _head(tool_input),
            }
            if why:
                asked["why"] = why
            if decided is not None:
                asked.update(decision="allowed", scope=decided[0], by=decided[1])
            await add_event(
                conn, self.db, EventKind.TOOL_REQUESTED, run_id=run_id, data=asked, at=now
            )
        events_written(self.db)
        return await self.get(request_id)

    async def get(self, request_id: int) -> ToolRequest:
        row = await self.db.fetchone("SELECT * FROM tool_requests WHERE id = ?", (request_id,))
        if row is None:
            raise NotFoundError(f"no tool request {request_id}")
        return ToolRequest.from_row(row)

    async def unposted(self) -> list[ToolRequest]:
        """Pending requests no front end has shown yet, oldest first."""
        rows = await self.db.fetchall(
            "SELECT * FROM tool_requests WHERE state = 'pending' AND posted_at IS NULL ORDER BY id"
        )
        return [ToolRequest.from_row(r) for r in rows]

    async def mark_posted(self, request_id: int) -> None:
        await self.db.execute(
            "UPDATE tool_requests SET posted_at = ? WHERE id = ?", (self._clock(), request_id)
        )

    async def pending(self, *, run_id: str | None = None) -> list[ToolRequest]:
        if run_id is None:
            rows = await self.db.fetchall(
                "SELECT * FROM tool_requests WHERE state = 'pending' ORDER BY id"
            )
        else:
            rows = await self.db.fetchall(
                "SELECT * FROM tool_requests WHERE state = 'pending' AND run_id = ? ORDER BY id",
                (run_id,),
            )
        return [ToolRequest.from_row(r) for r in rows]

    async def decide(
        self,
        request_id: int,
        decision: Decision,
        *,
        scope: Scope | None = None,
        by: int | None = None,
        reason: str | None = None,
    ) -> DecideResult:
        """Decide a pending request (compare-and-set); an allow for the session adds a grant."""
        if decision is Decision.PENDING:
            raise ValueError("a decision cannot be 'pending'")
        now = self._clock()
        async with self.db.transaction() as conn:
            cursor = await conn.execute(
                "UPDATE tool_requests SET state = ?, scope = ?, decided_by = ?, reason = ?,"
                " decided_at = ? WHERE id = ? AND state = 'pending'"
                " RETURNING run_id, tool, input_json, no_grant",
                (decision.value, scope.value if scope else None, by, reason, now, request_id),
            )
            row = await cursor.fetchone()
            changed = row is not None
            if row is not None and row["no_grant"] and scope is Scope.SESSION:
                scope = Scope.ONCE  # no grant covers a catastrophic call: this one only
                await conn.execute(
                    "UPDATE tool_requests SET scope = 'once' WHERE id = ?", (request_id,)
                )
            if row is not None and decision is Decision.ALLOWED and scope is Scope.SESSION:
                key = grant_key(row["tool"], json.loads(row["input_json"]))
                await conn.execute(
                    "INSERT INTO tool_grants (run_id, tool, prefix, granted_by, request_id,"
                    " created_at) VALUES (?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT (run_id, tool, prefix) DO NOTHING",
                    (row["run_id"], row["tool"], key, by, request_id, now),
                )
            if row is not None:  # last: its event takes the log's lock, held to the commit
                await self._decided(conn, row["run_id"], request_id, decision, scope, by, reason)
        if changed:
            events_written(self.db)
        return DecideResult(changed, await self.get(request_id))

    async def _decided(
        self,
        conn: Any,
        run_id: str,
        request_id: int,
        decision: Decision,
        scope: Scope | None,
        by: int | None,
        reason: str | None,
    ) -> None:
        data = {
            "request_id": request_id,
            "decision": decision.value,
            "scope": scope.value if scope else None,
            "by": by,
            "reason": reason,
        }
        await add_event(conn, self.db, EventKind.TOOL_DECIDED, run_id=run_id, data=data)

    async def cancel_pending(
        self, reason: str, *, run_ids: list[str] | None = None
    ) -> list[ToolRequest]:
        """Cancel pending requests (of ``run_ids``, or all); returns the ones cancelled."""
        if run_ids is not None and not run_ids:
            return []
        now = self._clock()
        ids: list[int] = []
        cancelled: list[tuple[int, str]] = []
        async with self.db.transaction() as conn:
            for run_id in run_ids if run_ids is not None else [None]:
                # No "? IS NULL": PostgreSQL cannot tell the type of a lone NULL parameter.
                only_run = " AND run_id = ?" if run_id is not None else ""
                sql = (
                    "UPDATE tool_requests SET state = 'cancelled', reason = ?, decided_at = ?"  # noqa: S608
                    f" WHERE state = 'pending'{only_run} RETURNING id, run_id"
                )
                cursor = await conn.execute(
                    sql, (reason, now) if run_id is None else (reason, now, run_id)
                )
                cancelled += [(int(r[0]), str(r[1])) for r in await cursor.fetchall()]
            # Last: their events take the log's lock, held to the commit.
            for request_id, of_run in cancelled:
                ids.append(request_id)
                await self._decided(
                    conn, of_run, request_id, Decision.CANCELLED, None, None, reason
                )
        if ids:
            events_written(self.db)
        return [await self.get(i) for i in ids]

    async def history(self, run_id: str) -> list[ToolRequest]:
        rows = await self.db.fetchall(
            "SELECT * FROM tool_requests WHERE run_id = ? ORDER BY id", (run_id,)
        )
        return [ToolRequest.from_row(r) for r in rows]


#: The store of tool requests (one implementation serves both databases).
ApprovalStore = SqliteApprovalStore
