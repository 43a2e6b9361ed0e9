"""What the board shows: the runs and tasks, a page at a time, and what waits for a person.

Read straight from the stores' tables, one page per query (ordered and limited in SQL), so
a board over 10,000 tasks reads 50 rows, not 10,000.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Final

from chatfront.auth import Role
from engine.humane import format_elapsed
from engine.humane import words as _words
from engine.spend import Spend
from engine.store.runs import SqliteRunStore
from webview.actions import may_decide_tool

if TYPE_CHECKING:
    from engine.store.backend import AnyDatabase

__all__ = [
    "PAGE",
    "Board",
    "BoardPage",
    "Filters",
    "RunRow",
    "StatusFilter",
    "TaskRow",
    "Waiting",
    "age",
]

#: Rows on one page of the board.
PAGE: Final = 50


class StatusFilter(StrEnum):
    """The status filters people pick from."""

    ALL = "all"
    ACTIVE = "active"  # running or waiting
    WAITING = "waiting"  # for a person
    ENDED = "ended"


_RUN_STATUS: Final[Mapping[StatusFilter, tuple[str, ...]]] = {
    StatusFilter.ACTIVE: ("running", "parked"),
    StatusFilter.WAITING: ("parked",),
    StatusFilter.ENDED: ("completed", "stopped", "error", "crashed"),
}
_ENDED_PHASES: Final = ("complete",)


@dataclass(frozen=True, slots=True)
class Filters:
    """What the board is narrowed to (from the page's query string)."""

    status: StatusFilter = StatusFilter.ALL
    mode: str | None = None
    text: str = ""
    page: int = 0

    @classmethod
    def parse(cls, query: Mapping[str, str]) -> Filters:
        try:
            status = StatusFilter(query.get("status") or "all")
        except ValueError:
            status = StatusFilter.ALL
        page = query.get("page", "0")
        mode = query.get("mode") or None
        return cls(
            status=status,
            mode=mode if mode in ("chat", "auto", "autopilot") else None,
            text=(query.get("q") or "").strip()[:100],
            page=int(page) if page.isascii() and page.isdigit() else 0,
        )


def age(seconds: float) -> str:
    """How long ago, in words: ``7s``, ``2m05s``, ``1h02m``, ``3 days``."""
    if seconds >= 2 * 86400:
        return f"{int(seconds // 86400)} days"
    return format_elapsed(seconds)


@dataclass(frozen=True, slots=True)
class RunRow:
    id: str
    mode: str
    agent: str
    status: str
    """In words."""
    raw_status: str
    phase: str | None
    task: str | None
    objective: str
    started_by: str
    age: str
    spend: str


@dataclass(frozen=True, slots=True)
class TaskRow:
    name: str
    phase: str
    """In words."""
    waits_for_approval: bool
    parent: str | None
    summary: str
    started_by: str
    age: str
    gate_sha256: str | None


@dataclass(frozen=True, slots=True)
class Waiting:
    """Something that waits for this person: a gate to decide, a tool call to allow."""

    kind: str  # "gate" or "tool"
    title: str
    detail: str
    href: str
    age: str


@dataclass(frozen=True, slots=True)
class BoardPage:
    rows: Sequence[RunRow] | Sequence[TaskRow]
    page: int
    more: bool


def words(state: str) -> str:
    """A state in words, without the chat's emoji (the board marks states itself)."""
    return _words(state, icon=False)


def _spent(spend: Spend | None) -> str:
    """A run's cost on the board: USD, else its tokens, else unknown."""
    if spend is None or not spend.known:
        return "unknown" if spend is not None else "–"
    if spend.cost_usd is not None:
        return spend.cost_text()
    return f"{spend.tokens or 0:,} tokens"


def _like(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


class Board:
    """The board's reads over one database.

    Args:
        names: how a person is called, by Telegram id (the chat's names).
        clock: the time source (ages).
    """

    def __init__(
        self,
        db: AnyDatabase,
        *,
        names: Any,
        clock: Any = time.time,
    ) -> None:
        self._db = db
        self._names = names
        self._clock = clock

    def _who(self, started_by: object) -> str:
        if started_by in (None, ""):
            return "a terminal"
        text = str(started_by)
        return self._names(int(text)) if text.lstrip("-").isdigit() else text

    async def runs(self, filters: Filters) -> BoardPage:
        where: list[str] = ["r.parent_id IS NULL"] if not filters.text else []
        params: list[Any] = []
        statuses = _RUN_STATUS.get(filters.status)
        if statuses:
            where.append(f"r.status IN ({', '.join('?' * len(statuses))})")
            params.extend(statuses)
        if filters.mode:
            where.append("r.mode = ?")
            params.append(filters.mode)
        if filters.text:
            where.append(
                "(r.id LIKE ? ESCAPE '\\' OR r.task LIKE ? ESCAPE '\\'"
                " OR r.objective LIKE ? ESCAPE '\\')"
            )
            params.extend([_like(filters.text)] * 3)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        rows = await self._db.fetchall(
            "SELECT r.id, r.mode, r.agent, r.status, r.phase, r.task, r.objective,"  # noqa: S608
            " r.created_at, r.updated_at, t.started_by AS task_starter FROM runs r"
            f" LEFT JOIN gate_tasks t ON t.name = r.task {clause}"
            " ORDER BY r.updated_at DESC, r.id LIMIT ? OFFSET ?",
            (*params, PAGE + 1, filters.page * PAGE),
        )
        more = len(rows) > PAGE
        rows = rows[:PAGE]
        starters = await self._chat_starters([r["id"] for r in rows if r["task_starter"] is None])
        spend = await SqliteRunStore(self._db).spend_of([r["id"] for r in rows])
        now = self._clock()
        out = [
            RunRow(
                id=r["id"],
                mode=r["mode"],
                agent=r["agent"],
                status=words(r["status"]),
                raw_status=r["status"],
                phase=words(r["phase"]) if r["phase"] else None,
                task=r["task"],
                objective=(r["objective"] or "")[:200],
                started_by=self._who(
                    r["task_starter"] if r["task_starter"] is not None else starters.get(r["id"])
                ),
                age=age(now - float(r["created_at"])),
                spend=_spent(spend.get(r["id"])),
            )
            for r in rows
        ]
        return BoardPage(out, filters.page, more)

    async def _chat_starters(self, run_ids: Sequence[str]) -> dict[str, int]:
        """Who wrote the first message of each chat run (its starter)."""
        if not run_ids or not await self._has("bot_prompts"):
            return {}
        marks = ", ".join("?" * len(run_ids))
        rows = await self._db.fetchall(
            f"SELECT run_id, user_id FROM bot_prompts WHERE run_id IN ({marks})"  # noqa: S608
            " AND user_id IS NOT NULL ORDER BY id DESC",
            tuple(run_ids),
        )
        return {r["run_id"]: int(r["user_id"]) for r in rows}

    async def tasks(self, filters: Filters) -> BoardPage:
        where: list[str] = []
        params: list[Any] = []
        if filters.status is StatusFilter.WAITING:
            where.append("(sub_state = 'awaiting_approval' OR phase = 'human_intervention')")
        elif filters.status is StatusFilter.ENDED:
            where.append(f"phase IN ({', '.join('?' * len(_ENDED_PHASES))})")
            params.extend(_ENDED_PHASES)
        elif filters.status is StatusFilter.ACTIVE:
            where.append(f"phase NOT IN ({', '.join('?' * len(_ENDED_PHASES))})")
            params.extend(_ENDED_PHASES)
        if filters.text:
            where.append("(name LIKE ? ESCAPE '\\' OR summary LIKE ? ESCAPE '\\')")
            params.extend([_like(filters.text)] * 2)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        rows = await self._db.fetchall(
            "SELECT name, phase, sub_state, parent, summary, started_by, gate_sha256,"  # noqa: S608
            f" created_at, updated_at FROM gate_tasks {clause}"
            " ORDER BY updated_at DESC, name LIMIT ? OFFSET ?",
            (*params, PAGE + 1, filters.page * PAGE),
        )
        now = self._clock()
        out = [
            TaskRow(
                name=r["name"],
                phase=words(f"{r['phase']}:{r['sub_state']}" if r["sub_state"] else r["phase"]),
                waits_for_approval=r["sub_state"] == "awaiting_approval",
                parent=r["parent"],
                summary=(r["summary"] or "")[:200],
                started_by=self._who(r["started_by"]),
                age=age(now - float(r["created_at"])),
                gate_sha256=r["gate_sha256"],
            )
            for r in rows[:PAGE]
        ]
        return BoardPage(out, filters.page, len(rows) > PAGE)

    async def waiting_for(
        self, user_id: int, roles: frozenset[Role], *, forbid_self: bool
    ) -> list[Waiting]:
        """What waits for ``user_id``: open gates (an approver's; not their own task's when
        self-approval is forbidden) and tool calls of runs they may decide, oldest first."""
        now = self._clock()
        out: list[Waiting] = []
        if roles & {Role.APPROVER, Role.ADMIN}:
            rows = await self._db.fetchall(
                "SELECT name, phase, started_by, gate_sha256, gate_opened_at FROM gate_tasks"
                " WHERE sub_state = 'awaiting_approval' AND gate_sha256 IS NOT NULL"
                " ORDER BY gate_opened_at LIMIT 100"
            )
            for r in rows:
                if forbid_self and str(r["started_by"]) == str(user_id):
                    continue
                out.append(
                    Waiting(
                        kind="gate",
                        title=f"Task {r['name']}: the {r['phase']} phase waits for approval",
                        detail=f"sha256 {r['gate_sha256'][:12]}",
                        href=f"/tasks/{r['name']}",
                        age=age(now - float(r["gate_opened_at"] or now)),
                    )
                )
        rows = await self._db.fetchall(
            "SELECT id, run_id, tool, starter_id, created_at FROM tool_requests"
            " WHERE state = 'pending' ORDER BY id LIMIT 100"
        )
        for r in rows:
            starter = int(r["starter_id"]) if r["starter_id"] is not None else None
            if may_decide_tool(roles, user_id, starter, forbid_self=forbid_self) is None:
                out.append(
                    Waiting(
                        kind="tool",
                        title=f"Run {r['run_id']} asks to use {r['tool']}",
                        detail=f"request {r['id']}",
                        href=f"/runs/{r['run_id']}",
                        age=age(now - float(r["created_at"])),
                    )
                )
        return out

    async def _has(self, table: str) -> bool:
        if self._db.dialect == "postgresql":
            row = await self._db.fetchone("SELECT to_regclass(?) IS NOT NULL AS found", (table,))
            return bool(row is not None and row["found"])
        row = await self._db.fetchone(
            "SELECT 1 AS found FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
        )
        return row is not None
