"""``status --list`` reads its rows in the listing's order from an index, on both databases.

Without the index each listing sorts every task (10,000 of them in ~20-30 ms on
PostgreSQL's server, the same again in SQLite) before the first row comes back.
"""

from __future__ import annotations

import time
from typing import Any

from engine.gates.listing import render_rows
from engine.gates.store import LIST_QUERY, SqlGateStore

_INSERT = (
    "INSERT INTO gate_tasks (name, folder, workdir, phase, sub_state, version, parent, wave, "
    "gate_round, created_at, updated_at) VALUES (?, '/f', '/w', ?, ?, 1, ?, ?, 0, ?, ?)"
)


async def _insert(db: Any, rows: list[tuple[Any, ...]]) -> None:
    now = time.time()
    async with db.transaction() as conn:
        for name, parent, wave, phase, sub in rows:
            await conn.execute(_INSERT, (name, phase, sub, parent, wave, now, now))


async def _plan(db: Any) -> str:
    if db.dialect == "sqlite":
        rows = await db.fetchall("EXPLAIN QUERY PLAN " + LIST_QUERY)
        return "\n".join(str(row[3]) for row in rows)
    rows = await db.fetchall("EXPLAIN " + LIST_QUERY)
    return "\n".join(str(row[0]) for row in rows)


async def test_the_listing_is_read_in_index_order(database: Any) -> None:
    rows: list[tuple[Any, ...]] = []
    for p in range(200):  # 2,000 tasks: 200 with 9 sub-tasks each, in 3 waves
        rows.append((f"t{p:03d}", None, None, "design", None))
        rows += [(f"t{p:03d}.s{s}", f"t{p:03d}", s // 3 + 1, "design", None) for s in range(9)]
    await _insert(database, rows)
    # What autovacuum does on its own on a live PostgreSQL database (SQLite needs none).
    await database.execute("ANALYZE gate_tasks")
    plan = await _plan(database)
    assert "gate_tasks_listing" in plan, plan
    assert "Sort" not in plan, plan
    assert "TEMP B-TREE" not in plan, plan


async def test_the_indexed_listing_is_the_listing(database: Any) -> None:
    """Rows added in any order come back grouped: each task, then its sub-tasks by wave."""
    rows: list[tuple[Any, ...]] = [
        ("b.sub2", "b", 2, "design", "awaiting_approval"),
        ("a", None, None, "research", None),
        ("b.sub1", "b", 1, "implement", None),
        ("b", None, None, "design", None),
        ("a.x", "a", None, "complete", None),
        ("orphan.s", "orphan", 3, "design", None),
        ("b.sub0", "b", 2, "test_design", None),
    ]
    await _insert(database, rows)
    listed = await SqlGateStore(database).listing_rows()
    assert [r[0] for r in listed] == ["a", "a.x", "b", "b.sub1", "b.sub0", "b.sub2", "orphan.s"]
    assert render_rows(listed).splitlines() == [
        "b".ljust(40) + " " + "design".ljust(36) + " v1",
        "  wave 1:",
        "    " + "b.sub1".ljust(40) + " " + "implement".ljust(36) + " v1",
        "  wave 2:",
        "    " + "b.sub0".ljust(40) + " " + "test_design".ljust(36) + " v1",
        "    " + "b.sub2".ljust(40) + " " + "design:awaiting_approval".ljust(36) + " v1",
        "a".ljust(40) + " " + "research".ljust(36) + " v1",
        "  wave 1:",
        "    " + "a.x".ljust(40) + " " + "complete".ljust(36) + " v1",
        "orphan (parent not found)",
        "  wave 3:",
        "    " + "orphan.s".ljust(40) + " " + "design".ljust(36) + " v1",
    ]
