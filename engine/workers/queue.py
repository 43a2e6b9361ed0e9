"""The job queue under the workers: procrastinate on the shared PostgreSQL database.

One task, ``turnstile.run_turn`` (“run one turn of run R”, its only input the run id);
its jobs carry the run id as their ``lock`` (one turn of a run at a time, across every
worker) and as their ``queueing_lock`` (one waiting turn per run). A run not yet on any
worker waits in its agent's queue (``turnstile.agent.codex``), which only the workers
that have that agent's CLI listen on; once a worker holds its worktree, its turns go to
that worker's own queue.

procrastinate's schema is applied by its own applier (its SQL as shipped), when a worker
starts or a command first puts a run on the queue: idempotent, under an advisory lock so
two processes starting at once apply it once.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterable
from typing import Any, Final

import procrastinate
from procrastinate import exceptions as pexc
from procrastinate.schema import SchemaManager

from engine.errors import ConfigError
from engine.store.backend import AnyDatabase
from engine.store.location import PostgresURL
from engine.workers.store import AGENT_QUEUE_PREFIX

__all__ = [
    "AGENT_QUEUE_PREFIX",
    "SHARED_QUEUE",
    "TASK_NAME",
    "agent_queue",
    "ensure_queue_schema",
    "make_app",
    "require_postgres",
    "worker_queue",
]

_LOGGER = logging.getLogger(__name__)

SHARED_QUEUE: Final = "turnstile"
TASK_NAME: Final = "turnstile.run_turn"
_SCHEMA_LOCK: Final = 0x7475726E  # "turn": one key for "apply the queue's schema"
_LIVE: Final = ("todo", "doing")


def agent_queue(tool: str) -> str:
    """The queue of the runs of agent ``tool`` that no worker holds yet."""
    return f"{AGENT_QUEUE_PREFIX}{tool}"


def worker_queue(name: str) -> str:
    """The queue of the runs whose worktree this worker holds."""
    return f"{SHARED_QUEUE}.worker.{name}"


def require_postgres(database: object) -> PostgresURL:
    """The PostgreSQL URL the workers share, or a ConfigError in one line."""
    if not isinstance(database, PostgresURL):
        raise ConfigError(
            "TURNSTILE_EXECUTION=workers needs a PostgreSQL database "
            "(TURNSTILE_DATABASE=postgresql://…); this one is a SQLite file"
        )
    return database


def make_app(url: PostgresURL, *, pool_size: int = 4) -> procrastinate.App:
    """A procrastinate app on ``url`` (open it with ``async with app.open_async()``)."""
    connector = procrastinate.PsycopgConnector(
        conninfo=url.conninfo(), min_size=1, max_size=max(2, pool_size)
    )
    return procrastinate.App(connector=connector)


async def ensure_queue_schema(db: AnyDatabase) -> bool:
    """Apply procrastinate's schema unless the database has it; whether it was applied."""
    async with db.transaction() as conn:
        await conn.execute("SELECT pg_advisory_xact_lock(?)", (_SCHEMA_LOCK,))
        cursor = await conn.execute("SELECT to_regclass('procrastinate_jobs') IS NOT NULL")
        row = await cursor.fetchone()
        if row is not None and row[0]:
            return False
        await conn.execute_ddl(SchemaManager.get_schema())  # type: ignore[union-attr]
    _LOGGER.info("applied the job queue's schema")
    return True


async def defer_turn(app: procrastinate.App, run_id: str, *, queue: str) -> int | None:
    """Put the next turn of ``run_id`` on ``queue``; None if one is already waiting."""
    try:
        return await app.configure_task(
            TASK_NAME, queue=queue, lock=run_id, queueing_lock=run_id
        ).defer_async(run_id=run_id)
    except pexc.AlreadyEnqueued:
        return None


async def nudge(app: procrastinate.App, queue: str) -> None:
    """Wake the workers of ``queue`` as a new job would (procrastinate's notification)."""
    try:
        await app.connector.execute_query_async(
            "SELECT pg_notify(%(channel)s, %(payload)s)",
            channel=f"procrastinate_queue_v1#{queue}",
            payload='{"type": "job_inserted", "job_id": 0}',
        )
    except Exception as exc:  # a missed wake-up only waits for the next poll
        _LOGGER.warning("could not wake the workers of %s: %s", queue, exc)


async def live_jobs(app: procrastinate.App, run_id: str) -> list[Any]:
    """The run's jobs that wait or run."""
    jobs: Iterable[Any] = await app.job_manager.list_jobs_async(lock=run_id)
    return [j for j in jobs if j.status in _LIVE]


async def abort_jobs(app: procrastinate.App, run_id: str) -> tuple[int, int]:
    """Cancel the run's waiting turn and abort its running one: (cancelled, aborted)."""
    cancelled = aborted = 0
    for job in await live_jobs(app, run_id):
        if job.status == "todo":
            if await app.job_manager.cancel_job_by_id_async(job.id):
                cancelled += 1
        elif await app.job_manager.cancel_job_by_id_async(job.id, abort=True):
            aborted += 1
    return cancelled, aborted


async def move_to_shared(app: procrastinate.App, run_id: str, tool: str) -> str:
    """Give a lost worker's run to whichever worker with its agent is free: its running
    turn is retried (a new attempt) and its waiting turn re-queued on the agent's queue;
    what happened."""
    queue = agent_queue(tool)
    retried = False
    for job in await live_jobs(app, run_id):
        if job.status == "doing":
            await app.job_manager.retry_job_by_id_async(
                job.id, retry_at=datetime.datetime.now(datetime.UTC), queue=queue
            )
            retried = True
        else:
            await app.job_manager.cancel_job_by_id_async(job.id)
    if retried:
        return "retried"
    await defer_turn(app, run_id, queue=queue)
    return "requeued"
