"""A ``turnstile worker`` process: runs turn jobs, heartbeats, moves lost workers' runs.

Every worker also sweeps: a worker not heard from within ``TURNSTILE_WORKER_TIMEOUT``
(killed, its machine gone) is declared lost, and every run it held is released to the
shared queue, its cut-off turn retried as a new attempt on whichever worker is free.
procrastinate retries stalled jobs only when told to; this sweep is what tells it.

SIGTERM (or Ctrl-C) lets the running turns finish, then the worker says it stopped and
its runs move on; a second signal cuts the running turns off (their process groups are
killed; the turns are re-run elsewhere as new attempts).

The database may go away a while (a restart, a network cut). The worker carries on: the
queue's worker (procrastinate's, see ``_QueueWorker``) keeps fetching, listening and
heartbeating through it and picks up where it was once the server answers; and a worker
that was cut off itself declares nobody lost until it has been back for as long as it
gives the others (they were cut off too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import procrastinate
import psycopg
from procrastinate import exceptions as pexc
from procrastinate import worker as pworker
from procrastinate.job_context import AbortReason, JobContext

from engine.agents.factory import new_warm_pool, probe_agents
from engine.agents.registry import installed_agents
from engine.errors import ConfigError, TurnstileError
from engine.store.backend import open_database
from engine.store.runs import SqliteRunStore, TurnState
from engine.workers.autopilot import AUTOPILOT, DriveSteps, wake_parked
from engine.workers.chat import CHAT_MODE, ChatTurns
from engine.workers.control import on_signals
from engine.workers.host import AUTO_MODE, RunHost, sweep
from engine.workers.queue import (
    SHARED_QUEUE,
    TASK_NAME,
    agent_queue,
    ensure_queue_schema,
    make_app,
    require_postgres,
    worker_queue,
)
from engine.workers.store import PlacementStatus, WorkerStatus, WorkerStore
from engine.workers.turn import AutoTurns

if TYPE_CHECKING:
    from engine.settings import Settings
    from engine.store.postgres import PostgresDatabase

__all__ = ["Worker", "default_worker_name", "sweep", "worker_agents"]

_LOGGER = logging.getLogger(__name__)
_CONTEXT_KEY: Final = "turnstile"
_LIVE_PLACEMENTS: Final = (PlacementStatus.WAITING, PlacementStatus.RUNNING)
_RETRY: Final = 1.0  # seconds between attempts while the database is away


def worker_agents(settings: Settings) -> frozenset[str]:
    """The agents this worker can run: those whose CLI it has, and the command agent (a run
    of it brings its own command line)."""
    return frozenset((*installed_agents(settings), "command"))


def default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


async def _run_turn_job(context: JobContext, run_id: str) -> None:
    runner: RunHost = context.additional_context[_CONTEXT_KEY]
    await runner.job(
        run_id,
        queue=context.job.queue,
        user_abort=lambda: context.abort_reason() is AbortReason.USER_REQUEST,
    )


def register_task(app: procrastinate.App) -> None:
    app.task(name=TASK_NAME, pass_context=True)(_run_turn_job)


def _connection_lost(exc: BaseException) -> bool:
    """Whether a queue error means the database is out of reach (not a wrong query)."""
    return isinstance(exc, pexc.ConnectorException) and isinstance(
        exc.__cause__, psycopg.OperationalError
    )


class _QueueWorker(pworker.Worker):
    """procrastinate's worker, made to live through a database outage.

    As shipped (3.x) a lost database ends it or leaves it half alive: a failed job fetch
    (no connection within the pool's wait) stops the worker; the listener gives up for
    good when its reconnection is refused, and so does the heartbeat on its first failed
    update, unnoticed (the side-task monitor returns as soon as the periodic deferrer
    does, at once when no task is periodic); a job that ends while the server is away
    stays "doing" for ever, holding its run's lock. Here each of these waits and tries
    again; a fetch refused because another worker pruned this one's row (its heartbeat
    was silent) registers it anew.
    """

    def _start_side_tasks(self) -> list[asyncio.Task[Any]]:
        # No periodic deferrer: turnstile has no periodic task.
        tasks = [
            asyncio.create_task(self._update_heartbeat(), name="update_heartbeats"),
            asyncio.create_task(
                self._poll_jobs_to_abort(),  # type: ignore[no-untyped-call]
                name="poll_jobs_to_abort",
            ),
        ]
        if self.listen_notify:
            tasks.append(asyncio.create_task(self._listen(), name="listener"))
        return tasks

    async def _listen(self) -> None:
        failing = False
        while True:
            try:
                await self.app.job_manager.listen_for_jobs(
                    on_notification=self._handle_notification, queues=self.queues
                )
            except Exception as exc:
                if not _connection_lost(exc):
                    raise
                if not failing:
                    _LOGGER.warning("the queue's listener lost the database (will retry)")
                failing = True
            # Notifications may have been missed meanwhile: fetch again.
            self._new_job_event.set()
            await asyncio.sleep(_RETRY)

    async def _update_heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.update_heartbeat_interval)
            assert self.worker_id is not None
            try:
                await self.app.job_manager.update_heartbeat(self.worker_id)
            except Exception as exc:
                if not _connection_lost(exc):
                    raise

    async def _fetch_and_process_jobs(self) -> None:
        try:
            await super()._fetch_and_process_jobs()  # type: ignore[no-untyped-call]
        except pexc.ConnectorException as exc:
            if isinstance(exc.__cause__, psycopg.errors.ForeignKeyViolation):
                # Our row was pruned (silent too long): be a new queue worker.
                self.worker_id = await self.app.job_manager.register_worker()
                _LOGGER.warning("the queue had forgotten this worker; registered it again")
                self._new_job_event.set()
                return
            if not _connection_lost(exc):
                raise
            _LOGGER.warning("cannot fetch jobs: the database is away (will retry)")
            await asyncio.sleep(_RETRY)

    async def _process_job(self, context: JobContext) -> None:
        try:
            await super()._process_job(context)
        finally:
            # The job's end is recorded: the run's next turn (queued here, waiting on the
            # run's lock) can start. Fetch at once rather than at the next poll or after a
            # notification's round trip through the database.
            self._new_job_event.set()

    async def _persist_job_status(self, *args: Any, **kwargs: Any) -> None:
        while True:
            try:
                await super()._persist_job_status(*args, **kwargs)
                return
            except pexc.ConnectorException as exc:
                if not _connection_lost(exc):
                    raise
                _LOGGER.warning("cannot record a job's end: the database is away (will retry)")
                await asyncio.sleep(_RETRY)


class Worker:
    """One worker process (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        *,
        name: str | None = None,
        concurrency: int = 1,
        queues: Sequence[str] = (),
    ) -> None:
        if concurrency < 1:
            raise ConfigError(f"--concurrency must be at least 1, got {concurrency}")
        self.settings = settings
        self.url = require_postgres(settings.database)
        self.name = name or default_worker_name()
        self.concurrency = concurrency
        self.agents = worker_agents(settings)
        # The shared queue only for jobs queued before the agent queues existed (a worker
        # without the run's agent hands such a job to the agent's queue).
        self.queues = (
            *(agent_queue(a) for a in sorted(self.agents)),
            worker_queue(self.name),
            SHARED_QUEUE,
            *queues,
        )
        self._signals = 0
        self._stopping = asyncio.Event()
        self._cut_off = asyncio.Event()

    def _on_signal(self) -> None:
        self._signals += 1
        if self._signals == 1:
            _LOGGER.warning("stopping: the running turns finish first (again to cut them off)")
            self._stopping.set()
        else:
            self._cut_off.set()

    async def run(self) -> int:
        with on_signals(self._on_signal):
            return await self._run()

    async def _run(self) -> int:
        settings = self.settings
        async with open_database(settings) as db:
            pg: PostgresDatabase = db  # type: ignore[assignment]
            await ensure_queue_schema(pg)
            store = WorkerStore(pg)
            app = make_app(self.url, pool_size=self.concurrency + 2)
            register_task(app)
            async with app.open_async():
                await self._take_over_from_earlier(pg, app, store)
                await store.register(
                    self.name,
                    host=socket.gethostname(),
                    pid=os.getpid(),
                    capacity=self.concurrency,
                    queues=self.queues,
                )
                # Asked ahead, off the event loop: a first turn finds the answers known.
                await probe_agents(settings)
                runner = RunHost(
                    self.name,
                    settings,
                    pg,
                    app,
                    agents=self.agents,
                    drivers={
                        AUTO_MODE: AutoTurns(),
                        CHAT_MODE: ChatTurns(),
                        AUTOPILOT: DriveSteps(),
                    },
                    warm_pool=new_warm_pool(settings),
                )
                try:
                    await self._serve(pg, app, runner)
                finally:
                    with contextlib.suppress(TurnstileError):
                        await store.set_worker_status(self.name, WorkerStatus.STOPPED)
        _LOGGER.info("worker %s stopped", self.name)
        return 0

    async def _take_over_from_earlier(
        self, db: PostgresDatabase, app: procrastinate.App, store: WorkerStore
    ) -> None:
        """Clean up after an earlier worker of this name on this machine that died (its
        watchdog killed with it, say): kill what its cut-off turns left running here, and
        move its runs on as a lost worker's (their cut-off turns re-run as new attempts)."""
        host = socket.gethostname()
        earlier = next((w for w in await store.workers() if w.name == self.name), None)
        if earlier is None or earlier.host != host:
            return
        if earlier.status is WorkerStatus.ALIVE:
            if _pid_alive(earlier.pid):
                return  # register says so: a live worker has this name
            _LOGGER.warning(
                "worker %s (pid %d) died without stopping; taking over", self.name, earlier.pid
            )
            await store.set_worker_status(self.name, WorkerStatus.LOST)
        runs = SqliteRunStore(db)
        for placement in await store.placements():
            if placement.last_worker != self.name or placement.status not in _LIVE_PLACEMENTS:
                continue
            for turn in await runs.turns(placement.run_id):
                if turn.state is TurnState.STARTED and turn.kill_remains():
                    _LOGGER.info(
                        "killed what was left of turn %d of run %s",
                        turn.seq,
                        placement.run_id,
                        extra={"run_id": placement.run_id},
                    )
        await sweep(db, app, silent_after=self.settings.worker_timeout)

    async def _serve(self, db: PostgresDatabase, app: procrastinate.App, runner: RunHost) -> None:
        settings = self.settings
        queue_worker = _QueueWorker(
            app,
            queues=list(self.queues),
            name=self.name,
            concurrency=self.concurrency,
            wait=True,
            install_signal_handlers=False,
            additional_context={_CONTEXT_KEY: runner},
            update_heartbeat_interval=settings.worker_heartbeat,
            stalled_worker_timeout=settings.worker_timeout,
            fetch_job_polling_interval=min(2.0, settings.worker_heartbeat),
            abort_job_polling_interval=min(1.0, settings.worker_heartbeat),
            delete_jobs="successful",
        )
        serving = asyncio.create_task(
            queue_worker.run(),  # type: ignore[no-untyped-call]
            name=f"worker-{self.name}",
        )
        beat = asyncio.create_task(self._heartbeat(db, app, runner), name="worker-heartbeat")
        print(f"worker {self.name} ready (capacity {self.concurrency})", flush=True)
        try:
            stop_wait = asyncio.create_task(self._stopping.wait(), name="worker-stop-wait")
            await asyncio.wait({serving, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            stop_wait.cancel()
            if serving.done():
                serving.result()  # the queue's worker failed: say why
                return
            # procrastinate stops fetching and waits for the running jobs to end.
            serving.cancel()
            cut = asyncio.create_task(self._cut_when_asked(runner), name="worker-cut-off")
            with contextlib.suppress(asyncio.CancelledError):
                await serving
            cut.cancel()
            if runner.deferrals:
                await asyncio.gather(*runner.deferrals, return_exceptions=True)
        finally:
            await runner.forget_all()
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat

    async def _cut_when_asked(self, runner: RunHost) -> None:
        await self._cut_off.wait()
        _LOGGER.warning("cutting off %d running turn(s)", len(runner.running))
        for task in list(runner.running.values()):
            task.cancel()

    async def _heartbeat(
        self, db: PostgresDatabase, app: procrastinate.App, runner: RunHost
    ) -> None:
        store = WorkerStore(db)
        interval = self.settings.worker_heartbeat
        # One beat may not hang the next ones: a call into a database that went away (a
        # connection the pool still believed in, the queue's own pool) is cut off here.
        limit = max(3 * interval, 10.0)
        # Since when the beats have gone through in good time; -inf: from the start.
        steady_since = float("-inf")
        while True:
            try:
                async with asyncio.timeout(limit):
                    if not await self._beat(store, db, app, runner, steady_since=steady_since):
                        # A beat this slow (the database coming back) may have written a
                        # stale time: this worker was as cut off as the others were.
                        steady_since = time.monotonic()
            except TimeoutError:
                _LOGGER.warning("heartbeat failed: no answer within %.0f s (will retry)", limit)
                steady_since = time.monotonic()
            except (TurnstileError, OSError) as exc:
                _LOGGER.warning("heartbeat failed (will retry): %s", exc)
                steady_since = time.monotonic()
            except Exception as exc:  # the queue's own errors (database away)
                _LOGGER.warning("heartbeat failed (will retry): %s", _describe(exc))
                steady_since = time.monotonic()
            await asyncio.sleep(interval)

    async def _beat(
        self,
        store: WorkerStore,
        db: PostgresDatabase,
        app: procrastinate.App,
        runner: RunHost,
        *,
        steady_since: float,
    ) -> bool:
        """One beat, and a sweep when this worker is steady; whether the beat was in time."""
        began = time.monotonic()
        beaten = await store.heartbeat(self.name, running=len(runner.running))
        silent_after = self.settings.worker_timeout
        in_time = time.monotonic() - began < silent_after / 2
        if not beaten:
            _LOGGER.warning(
                "worker %s was declared lost while the database was away; its runs have moved on",
                self.name,
            )
            # Its runs were moved and their cut-off turns are re-run elsewhere: the turns
            # still running here must not go on beside them.
            for task in list(runner.running.values()):
                task.cancel()
            await store.revive(self.name)
        if runner.held:
            await runner.prune(p.run_id for p in await store.runs_of(self.name))
        # A resident process that died or was closed idle since the last turn.
        await runner.mark_warm()
        await wake_parked(runner)
        # Judge the others only once this worker has been back as long as it gives them:
        # after an outage of the database every worker's last beat is old.
        steady = in_time and time.monotonic() - steady_since >= silent_after
        if steady and not self._stopping.is_set():
            await sweep(db, app, silent_after=silent_after)
        return in_time


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]
