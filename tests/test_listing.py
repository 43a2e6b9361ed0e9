"""The task listing streamed from the query's rows says exactly what the grouped one says."""

from __future__ import annotations

import asyncio
import random
import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.gates.listing import ListEntry, group_tasks, render_groups, render_rows
from engine.gates.store import LIST_QUERY
from engine.store.database import Database

_NAMES = st.text(alphabet="abc.-_Z9é", min_size=1, max_size=6)
_TASK = st.tuples(
    _NAMES,
    st.sampled_from(["research", "design", "implement", "complete"]),
    st.sampled_from([None, "awaiting_approval"]),
    st.integers(1, 9),
    st.one_of(st.none(), _NAMES),
    st.one_of(st.none(), st.integers(1, 3)),
    st.one_of(st.none(), st.just("ab" * 32)),
    st.one_of(st.none(), st.text(max_size=50)),
)


@pytest.fixture(scope="module")
def db_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("listing") / "t.db"

    async def migrate() -> None:
        async with Database(path):
            pass

    asyncio.run(migrate())
    return path


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(tasks=st.lists(_TASK, max_size=25, unique_by=lambda t: t[0]), seed=st.integers(0, 1000))
def test_streamed_listing_equals_the_grouped_one(
    db_path: Path, tasks: list[tuple[object, ...]], seed: int
) -> None:
    with sqlite3.connect(db_path) as conn:
        conn.execute("DELETE FROM gate_tasks")
        conn.executemany(
            "INSERT INTO gate_tasks (name, folder, workdir, phase, sub_state, version, parent,"
            " wave, gate_sha256, revision_notes, gate_round, created_at, updated_at)"
            " VALUES (?, '/f', '/w', ?, ?, ?, ?, ?, ?, ?, 0, 1.0, 2.0)",
            tasks,
        )
        rows = conn.execute(LIST_QUERY).fetchall()
    shuffled = [ListEntry._make(r) for r in rows]
    random.Random(seed).shuffle(shuffled)
    assert render_rows(rows) == render_groups(group_tasks(shuffled))


def test_no_tasks() -> None:
    assert render_rows([]) == "no tasks"


def test_names_sort_as_people_count(db_path: Path) -> None:
    """feature-2 comes before feature-10, in the terminal's listing and the grouped one."""
    tasks = [
        ("feature-10", None, None),
        ("feature-2", None, None),
        ("feature-1", None, None),
        ("feature-2.s10", "feature-2", 1),
        ("feature-2.s9", "feature-2", 1),
    ]
    with sqlite3.connect(db_path) as conn:
        conn.execute("DELETE FROM gate_tasks")
        conn.executemany(
            "INSERT INTO gate_tasks (name, folder, workdir, phase, version, parent, wave,"
            " gate_round, created_at, updated_at) VALUES (?, '/f', '/w', 'research', 1, ?, ?,"
            " 0, 1.0, 2.0)",
            tasks,
        )
        rows = conn.execute(LIST_QUERY).fetchall()
    names = [line.split()[0] for line in render_rows(rows).splitlines() if "wave" not in line]
    assert names == ["feature-1", "feature-2", "feature-2.s9", "feature-2.s10", "feature-10"]
    groups = group_tasks(ListEntry._make(r) for r in rows)
    assert [g.name for g in groups] == ["feature-1", "feature-2", "feature-10"]
    assert [t.name for t in groups[1].all()] == ["feature-2", "feature-2.s9", "feature-2.s10"]
