"""The web view's Prometheus metrics: what the database holds, in the text format.

Rows go in through the engine's own stores where they have one (runs and turns, the audit
log, tool requests, workers, the job queue) and as plain rows otherwise; the output is
read back with prometheus_client's own parser. Each database test runs on a SQLite file
and on a fresh PostgreSQL database.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.approvals.policy import Decision
from engine.approvals.store import SqliteApprovalStore
from engine.gates.workflow import AWAITING_APPROVAL
from engine.store.audit import SqliteAuditLog
from engine.store.backend import open_database
from engine.store.database import ENGINE, Database, MigrationSet, load_migrations
from engine.store.location import PostgresURL
from engine.store.runs import RunStatus, SqliteRunStore, TurnState
from engine.testing import FakeClock
from engine.turn import TurnOutput
from webview.metrics import DURATION_BUCKETS, metrics_text, metrics_token_ok

pytestmark = pytest.mark.timeout(60)

Families = dict[str, Any]
_WORKER_FAMILIES = {
    "turnstile_worker_capacity",
    "turnstile_worker_busy_slots",
    "turnstile_worker_queue_depth",
    "turnstile_worker_heartbeat_timestamp_seconds",
    "turnstile_queue_jobs",
}


async def scrape(db: Any) -> Families:
    body, content_type = await metrics_text(db)
    assert content_type.startswith("text/plain; version=0.0.4")
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def gauge(families: Families, name: str, *labels: str) -> dict[tuple[str, ...], float]:
    """The samples of gauge ``name``, by the values of ``labels``."""
    family = families[name]
    assert family.type == "gauge"
    assert family.documentation  # every metric says what it is
    return {tuple(s.labels[k] for k in labels): s.value for s in family.samples}


def histogram(families: Families, name: str) -> tuple[dict[str, float], float, float]:
    """A histogram's cumulative buckets (by ``le``), count and sum."""
    family = families[name]
    assert family.type == "histogram"
    by_name = {s.name: s for s in family.samples if not s.name.endswith("_bucket")}
    buckets = {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}
    return buckets, by_name[f"{name}_count"].value, by_name[f"{name}_sum"].value


async def test_the_metrics_are_what_the_database_holds(database: Any) -> None:
    clock = FakeClock()
    runs = SqliteRunStore(database, clock=clock)
    await runs.create_run("chat-1", mode="chat", agent="claude", session_id="s1")
    await runs.create_run("auto-1", mode="auto", agent="codex", session_id="s2")
    await runs.create_run("auto-2", mode="auto", agent="codex", session_id="s3")
    await runs.update_run("auto-1", status=RunStatus.COMPLETED)
    await runs.update_run("auto-2", status=RunStatus.COMPLETED)

    async def turn(seq: int, seconds: float) -> None:
        turn_id = await runs.start_turn("auto-1", seq, "go on", None)
        clock.advance(seconds)
        await runs.finish_turn(turn_id, TurnOutput(text="done", exit_code=0))

    await turn(1, 0.25)  # the first bucket
    await turn(2, 45.0)  # under a minute
    await turn(3, 4000.0)  # past the last bound: only in +Inf
    failed = await runs.start_turn("chat-1", 1, "hello", None)
    clock.advance(7.0)
    assert await runs.fail_turn(failed, TurnState.FAILED, "the agent crashed")
    await runs.start_turn("chat-1", 2, "again", None)  # still running

    audit = SqliteAuditLog(database)
    await audit.record("start", "refused", origin="bot", actor="42")
    await audit.record("start", "refused", origin="bot", actor="43")
    await audit.record("gate_artifact", "refused:too_large", origin="gates", task="t1")
    await audit.record("start", "allowed", origin="bot", actor="1")
    await audit.record("approve", "accepted", origin="gates", task="t1")

    approvals = SqliteApprovalStore(database)
    await approvals.open_request("chat-1", "Bash", {"command": "ls"})
    await approvals.open_request("chat-1", "Edit", {"file_path": "a.py"})
    decided = await approvals.open_request("auto-1", "Bash", {"command": "rm -rf /"})
    await approvals.decide(decided.id, Decision.DENIED, by=7, reason="no")

    for name, sub_state in (("t1", AWAITING_APPROVAL), ("t2", None), ("t3", AWAITING_APPROVAL)):
        await database.execute(
            "INSERT INTO gate_tasks (name, folder, workdir, phase, sub_state, version,"
            " created_at, updated_at) VALUES (?, ?, ?, ?, ?, 1, 0, 0)",
            (name, f"/tasks/{name}", "/work", "plan", sub_state),
        )
    for state in ("pending", "pending", "pending", "sent", "failed", "uncertain"):
        await database.execute(
            "INSERT INTO bot_outbox (chat_id, kind, body, state, created_at)"
            " VALUES (?, 'text', 'hi', ?, 0)",
            (-100, state),
        )

    families = await scrape(database)

    assert gauge(families, "turnstile_runs", "mode", "status") == {
        ("auto", "completed"): 2,
        ("chat", "running"): 1,
    }
    assert gauge(families, "turnstile_turns", "state") == {
        ("finished",): 3,
        ("failed",): 1,
        ("started",): 1,
    }
    buckets, count, total = histogram(families, "turnstile_turn_duration_seconds")
    assert list(buckets) == [*(str(float(b)) for b in DURATION_BUCKETS), "+Inf"]
    expected = {b: sum(1 for s in (0.25, 45.0, 4000.0) if s <= b) for b in DURATION_BUCKETS}
    assert {float(le): n for le, n in buckets.items() if le != "+Inf"} == expected
    assert (buckets["0.5"], buckets["30.0"], buckets["60.0"], buckets["3600.0"]) == (1, 1, 2, 2)
    assert buckets["+Inf"] == count == 3  # the failed and the running turn are not in it
    assert total == pytest.approx(4045.25, abs=1e-3)

    assert gauge(families, "turnstile_refusals", "origin", "action") == {
        ("bot", "start"): 2,
        ("gates", "gate_artifact"): 1,
    }
    assert gauge(families, "turnstile_tool_requests_pending") == {(): 2}
    assert gauge(families, "turnstile_gates_awaiting_approval") == {(): 2}
    assert gauge(families, "turnstile_outbox_backlog") == {(): 3}
    # No job queue here: the workers' metrics are absent, not zero.
    assert not _WORKER_FAMILIES & set(families)


async def test_an_empty_database_gives_zeros(database: Any) -> None:
    families = await scrape(database)
    assert gauge(families, "turnstile_runs", "mode", "status") == {}
    buckets, count, total = histogram(families, "turnstile_turn_duration_seconds")
    assert (set(buckets.values()), count, total) == ({0}, 0, 0)
    assert gauge(families, "turnstile_outbox_backlog") == {(): 0}
    assert gauge(families, "turnstile_tool_requests_pending") == {(): 0}


async def test_a_database_without_the_bot_s_tables_has_no_outbox_metric(tmp_path: Path) -> None:
    engine_only = [MigrationSet(ENGINE, load_migrations())]
    async with Database(tmp_path / "engine.db", migrations=engine_only) as db:
        families = await scrape(db)
    assert "turnstile_outbox_backlog" not in families
    assert not _WORKER_FAMILIES & set(families)
    assert gauge(families, "turnstile_gates_awaiting_approval") == {(): 0}


async def test_each_scrape_is_read_afresh(tmp_path: Path) -> None:
    async with open_database(tmp_path / "t.db") as db:
        runs = SqliteRunStore(db)
        await runs.create_run("r1", mode="chat", agent="claude", session_id="s")
        first = await scrape(db)
        await runs.create_run("r2", mode="chat", agent="claude", session_id="s")
        second = await scrape(db)
    assert gauge(first, "turnstile_runs", "mode", "status") == {("chat", "running"): 1}
    assert gauge(second, "turnstile_runs", "mode", "status") == {("chat", "running"): 2}


async def test_the_workers_metrics_with_the_job_queue(pg_url: str) -> None:
    from engine.workers.queue import (
        agent_queue,
        defer_turn,
        ensure_queue_schema,
        make_app,
        worker_queue,
    )
    from engine.workers.store import WorkerStatus, WorkerStore

    url = PostgresURL(pg_url)
    async with open_database(url) as db:
        before = await scrape(db)  # the workers' tables, but no job queue yet
        assert not _WORKER_FAMILIES & set(before)
        assert await ensure_queue_schema(db)

        workers = WorkerStore(db, clock=lambda: 1_700_000_000.0)
        await workers.register(
            "w1", host="h1", pid=10, capacity=3, queues=[worker_queue("w1"), agent_queue("codex")]
        )
        assert await workers.heartbeat("w1", running=2)
        await workers.register("w2", host="h2", pid=11, capacity=1, queues=[worker_queue("w2")])
        await workers.set_worker_status("w2", WorkerStatus.LOST)

        app = make_app(url, pool_size=2)
        async with app.open_async():
            for run_id in ("run-a", "run-b", "run-c"):
                assert await defer_turn(app, run_id, queue=worker_queue("w1")) is not None
            assert await defer_turn(app, "run-d", queue=agent_queue("codex")) is not None
        await db.execute(
            "UPDATE procrastinate_jobs SET status = 'doing' WHERE lock = ?", ("run-b",)
        )
        await db.execute(
            "UPDATE procrastinate_jobs SET status = 'succeeded' WHERE lock = ?", ("run-c",)
        )

        families = await scrape(db)

    assert gauge(families, "turnstile_worker_capacity", "worker") == {("w1",): 3}
    assert gauge(families, "turnstile_worker_busy_slots", "worker") == {("w1",): 2}
    assert gauge(families, "turnstile_worker_queue_depth", "worker") == {("w1",): 1}
    heartbeat = gauge(families, "turnstile_worker_heartbeat_timestamp_seconds", "worker")
    assert heartbeat == {("w1",): 1_700_000_000.0}
    assert gauge(families, "turnstile_queue_jobs", "queue", "status") == {
        (worker_queue("w1"), "todo"): 1,
        (worker_queue("w1"), "doing"): 1,
        (agent_queue("codex"), "todo"): 1,
    }


@pytest.mark.parametrize(
    ("header", "token", "ok"),
    [
        ("Bearer s3cret", "s3cret", True),
        ("bearer s3cret", "s3cret", True),
        ("  Bearer   s3cret  ", "s3cret", True),
        ("Bearer s3cret", "other", False),
        ("Bearer s3cre", "s3cret", False),
        ("Basic s3cret", "s3cret", False),
        ("s3cret", "s3cret", False),
        ("Bearer ", "s3cret", False),
        ("", "s3cret", False),
        (None, "s3cret", False),
        ("Bearer ", "", False),
        ("Bearer", "", False),
        (None, "", False),
        ("Bearer pässwörd", "pässwörd", True),
    ],
)
def test_the_metrics_token(header: str | None, token: str, ok: bool) -> None:
    assert metrics_token_ok(header, token) is ok
