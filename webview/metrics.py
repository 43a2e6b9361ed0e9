"""Prometheus metrics of the runs, read from the database at each scrape.

Each scrape (:func:`metrics_text`) reads the database once into a fresh registry: the
numbers are the database's, whichever process wrote them, and nothing is kept between
scrapes. The database counts the turn-duration histogram itself (a ``COUNT`` per bucket),
so a scrape over 100,000 turns reads one row of it, not 100,000.

Some metrics exist only where their tables do: the outbox backlog with the bot's tables,
the workers' metrics where execution on workers is set up (PostgreSQL with the job
queue's schema). Spend is what the agents reported: USD and tokens of the turns whose
agent reports them (Copilot CLI reports neither, so its turns count in neither).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from engine.approvals.policy import Decision
from engine.gates.workflow import AWAITING_APPROVAL
from engine.store.runs import TurnState

if TYPE_CHECKING:
    from engine.store.backend import AnyDatabase

__all__ = ["DURATION_BUCKETS", "metrics_text", "metrics_token_ok"]

#: Upper bounds (seconds) of the turn-duration buckets: a quick reply to an hour's work.
DURATION_BUCKETS: Final[tuple[float, ...]] = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

_REFUSED: Final = "refused"
_OUTBOX: Final = "bot_outbox"
_WORKERS: Final = "workers"
_JOBS: Final = "procrastinate_jobs"
_LIVE_JOBS: Final = ("todo", "doing")

_DURATION: Final = "finished_at - started_at"
_DURATION_SQL: Final = (
    f"SELECT COUNT(*), COALESCE(SUM({_DURATION}), 0), "  # noqa: S608 - no outside input
    + ", ".join([f"COUNT(CASE WHEN {_DURATION} <= ? THEN 1 END)"] * len(DURATION_BUCKETS))
    + " FROM turns WHERE state = ? AND finished_at IS NOT NULL"
)


@dataclass(frozen=True, slots=True)
class _Durations:
    count: int
    total: float
    # Turns at or under each bound of DURATION_BUCKETS (cumulative, as Prometheus wants).
    at_most: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Worker:
    name: str
    capacity: int
    running: int
    heartbeat_at: float
    waiting: int


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """What one scrape read."""

    runs: Mapping[tuple[str, str], int]
    turns: Mapping[tuple[str], int]
    durations: _Durations
    refusals: Mapping[tuple[str, str], int]
    gates_waiting: int
    tools_pending: int
    outbox_backlog: int | None
    workers: Sequence[_Worker] | None
    jobs: Mapping[tuple[str, str], int]
    spend: Mapping[tuple[str, str], float]


async def metrics_text(db: AnyDatabase) -> tuple[bytes, str]:
    """The metrics in Prometheus' text format: ``(body, content type)``."""
    registry = CollectorRegistry()
    registry.register(_SnapshotCollector(await _read(db)))
    return generate_latest(registry), CONTENT_TYPE_PLAIN_0_0_4


def metrics_token_ok(header: str | None, token: str) -> bool:
    """Whether ``header`` (``Authorization``) is ``Bearer TOKEN`` for ``token``.

    Compared in constant time; with no token configured nothing is let in.
    """
    if not token or header is None:
        return False
    scheme, _, given = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())


class _SnapshotCollector:
    """A :class:`prometheus_client.registry.Collector` over one snapshot."""

    def __init__(self, snapshot: _Snapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        shot = self._snapshot
        yield _gauge(
            "turnstile_runs", "Runs by mode and status.", ("mode", "status"), shot.runs.items()
        )
        yield _gauge("turnstile_turns", "Turns by state.", ("state",), shot.turns.items())
        bounds = [str(float(b)) for b in DURATION_BUCKETS]  # as Go prints them: "0.5", "60.0"
        durations = shot.durations
        yield HistogramMetricFamily(
            "turnstile_turn_duration_seconds",
            "How long finished turns took, from start to end, in seconds.",
            buckets=[*zip(bounds, durations.at_most, strict=True), ("+Inf", durations.count)],
            sum_value=durations.total,
        )
        yield _gauge(
            "turnstile_refusals",
            'Audit entries of a refusal (outcome "refused..."), by origin and action.',
            ("origin", "action"),
            shot.refusals.items(),
        )
        yield GaugeMetricFamily(
            "turnstile_gates_awaiting_approval",
            "Gated tasks waiting for people to approve their gate.",
            value=shot.gates_waiting,
        )
        yield GaugeMetricFamily(
            "turnstile_tool_requests_pending",
            "Tool calls of agents waiting for a person to allow or deny them.",
            value=shot.tools_pending,
        )
        yield _gauge(
            "turnstile_spend_usd",
            "What finished turns cost in USD, as their agents reported it, by mode and agent.",
            ("mode", "agent"),
            shot.spend.items(),
        )
        if shot.outbox_backlog is not None:
            yield GaugeMetricFamily(
                "turnstile_outbox_backlog",
                "Bot messages queued and not yet delivered.",
                value=shot.outbox_backlog,
            )
        if shot.workers is not None:
            yield from _worker_metrics(shot.workers, shot.jobs)


def _worker_metrics(
    workers: Sequence[_Worker], jobs: Mapping[tuple[str, str], int]
) -> Iterator[Metric]:
    columns: tuple[tuple[str, str, Callable[[_Worker], float]], ...] = (
        ("capacity", "Turns a live worker can run at once.", lambda w: w.capacity),
        ("busy_slots", "Turns a live worker is running now.", lambda w: w.running),
        (
            "queue_depth",
            "Turns waiting in a live worker's own queue (of the runs whose worktree it holds).",
            lambda w: w.waiting,
        ),
        (
            "heartbeat_timestamp_seconds",
            "When a live worker last said it was alive, in Unix time.",
            lambda w: w.heartbeat_at,
        ),
    )
    for name, help_text, value in columns:
        samples = [((w.name,), value(w)) for w in workers]
        yield _gauge(f"turnstile_worker_{name}", help_text, ("worker",), samples)
    yield _gauge(
        "turnstile_queue_jobs",
        "Jobs (turns) on the job queue, waiting (todo) or running (doing), by queue.",
        ("queue", "status"),
        jobs.items(),
    )


def _gauge(
    name: str,
    help_text: str,
    labels: Sequence[str],
    samples: Iterable[tuple[tuple[str, ...], float]],
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=labels)
    for key, value in sorted(samples):
        family.add_metric(key, value)
    return family


async def _read(db: AnyDatabase) -> _Snapshot:
    """Every number of a scrape, from ``db``."""
    present = await _tables(db, (_OUTBOX, _WORKERS, _JOBS))
    runs = await db.fetchall("SELECT mode, status, COUNT(*) FROM runs GROUP BY mode, status")
    turns = await db.fetchall("SELECT state, COUNT(*) FROM turns GROUP BY state")
    bounds = tuple(float(b) for b in DURATION_BUCKETS)
    timed = await db.fetchone(_DURATION_SQL, (*bounds, TurnState.FINISHED.value))
    refusals = await db.fetchall(
        "SELECT origin, event, COUNT(*) FROM audit_log WHERE substr(outcome, 1, ?) = ?"
        " GROUP BY origin, event",
        (len(_REFUSED), _REFUSED),
    )
    waiting = await db.fetchone(
        "SELECT COUNT(*) FROM gate_tasks WHERE sub_state = ?", (AWAITING_APPROVAL,)
    )
    pending = await db.fetchone(
        "SELECT COUNT(*) FROM tool_requests WHERE state = ?", (Decision.PENDING.value,)
    )
    spent = await db.fetchall(
        "SELECT r.mode, r.agent, SUM(t.cost_usd) FROM turns t JOIN runs r ON r.id = t.run_id"
        " WHERE t.cost_usd IS NOT NULL GROUP BY r.mode, r.agent"
    )
    backlog = None
    if _OUTBOX in present:
        # What the outbox sends next (chatfront.store.outbox): 'pending' rows.
        backlog = await db.fetchone("SELECT COUNT(*) FROM bot_outbox WHERE state = 'pending'")
    workers, jobs = await _read_workers(db) if {_WORKERS, _JOBS} <= present else (None, {})
    return _Snapshot(
        runs={(str(r[0]), str(r[1])): int(r[2]) for r in runs},
        turns={(str(r[0]),): int(r[1]) for r in turns},
        durations=_durations(timed),
        refusals={(str(r[0]), str(r[1])): int(r[2]) for r in refusals},
        gates_waiting=_count(waiting),
        tools_pending=_count(pending),
        outbox_backlog=_count(backlog) if _OUTBOX in present else None,
        workers=workers,
        jobs=jobs,
        spend={(str(r[0]), str(r[1])): float(r[2]) for r in spent},
    )


async def _read_workers(db: AnyDatabase) -> tuple[list[_Worker], dict[tuple[str, str], int]]:
    """The live workers, and the live jobs by queue and status."""
    # Only here: the job queue's module loads procrastinate, which SQLite never needs.
    from engine.workers.queue import worker_queue
    from engine.workers.store import WorkerStatus

    rows = await db.fetchall(
        "SELECT queue_name, status, COUNT(*) FROM procrastinate_jobs"
        " WHERE status IN (?, ?) GROUP BY queue_name, status",
        _LIVE_JOBS,
    )
    jobs = {(str(r[0]), str(r[1])): int(r[2]) for r in rows}
    alive = await db.fetchall(
        "SELECT name, capacity, running, heartbeat_at FROM workers WHERE status = ?",
        (WorkerStatus.ALIVE.value,),
    )
    workers = [
        _Worker(
            name=str(r[0]),
            capacity=int(r[1]),
            running=int(r[2]),
            heartbeat_at=float(r[3]),
            waiting=jobs.get((worker_queue(str(r[0])), "todo"), 0),
        )
        for r in alive
    ]
    return workers, jobs


async def _tables(db: AnyDatabase, names: Sequence[str]) -> set[str]:
    """Which of ``names`` are tables in ``db`` (on PostgreSQL: on its search path)."""
    if db.dialect == "sqlite":
        marks = ", ".join("?" * len(names))
        rows = await db.fetchall(
            f"SELECT name FROM sqlite_master WHERE type = 'table' AND name IN ({marks})",  # noqa: S608
            names,
        )
        return {str(r[0]) for r in rows}
    checks = ", ".join(["to_regclass(?) IS NOT NULL"] * len(names))
    found = await db.fetchone(f"SELECT {checks}", names)
    return {name for i, name in enumerate(names) if found is not None and found[i]}


def _durations(row: Any) -> _Durations:
    if row is None:
        return _Durations(0, 0.0, (0,) * len(DURATION_BUCKETS))
    bounds = range(2, 2 + len(DURATION_BUCKETS))
    return _Durations(int(row[0]), float(row[1]), tuple(int(row[i]) for i in bounds))


def _count(row: Any) -> int:
    return int(row[0]) if row is not None else 0
