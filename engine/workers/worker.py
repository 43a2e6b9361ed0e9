"""A ``turnstile worker`` process: runs turn jobs, heartbeats, moves lost workers' runs.

Every worker also sweeps: a worker not heard from within ``TURNSTILE_WORKER_TIMEOUT``
(killed, its machine gone) is declared lost, and every run it held is released to the
shared queue, its cut-off turn retried as a new attempt on whichever worker is free.
procrastinate retries stalled jobs only when told to; this sweep is what tells it.

SIGTERM (or Ctrl-C) lets the running turns finish, then the worker says it stopped and
its runs move on; a second signal cuts the running turns off (their process groups are
killed; the turns are re-run elsewhere as new attempts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

import procrastinate
from procrastinate.job_context import AbortReason, JobContext

from engine.agents.factory import new_warm_pool
from engine.agents.registry import installed_agents
from engine.errors import ConfigError, TurnstileError
from engine.store.backend import open_database
from engine.workers.autopilot import wake_parked
from engine.workers.chat import CHAT_MODE
from engine.workers.chatturns import ChatTurnStore
from engine.workers.queue import (
    SHARED_QUEUE,
    TASK_NAME,
    agent_queue,
    ensure_queue_schema,
    make_app,
    move_to_shared,
    require_postgres,
    worker_queue,
)
from engine.workers.store import PlacementStatus, WorkerStatus, WorkerStore
from engine.workers.turn import TurnRunner

if TYPE_CHECKING:
    from engine.settings import Settings
    from engine.store.postgres import PostgresDatabase

__all__ = ["Worker", "default_worker_name", "sweep", "worker_agents"]

_LOGGER = logging.getLogger(__name__)
_CONTEXT_KEY: Final = "turnstile"


def worker_agents(settings: Settings) -> frozenset[str]:
    """The agents this worker can run: those whose CLI it has, and the command agent (a run
    of it brings its own command line)."""
    return frozenset((*installed_agents(settings), "command"))


def default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


async def _run_turn_job(context: JobContext, run_id: str) -> None:
    runner: TurnRunner = context.additional_context[_CONTEXT_KEY]
    await runner.job(
        run_id,
        queue=context.job.queue,
        user_abort=lambda: context.abort_reason() is AbortReason.USER_REQUEST,
    )


def register_task(app: procrastinate.App) -> None:
    app.task(name=TASK_NAME, pass_context=True)(_run_turn_job)


async def sweep(db: PostgresDatabase, app: procrastinate.App, *, silent_after: float) -> list[str]:
    """Declare silent workers lost and move the runs of every gone worker; the runs moved."""
    store = WorkerStore(db)
    for name in await store.declare_lost(silent_after):
        _LOGGER.warning("worker %s stopped answering; its runs move to other workers", name)
    moved: list[str] = []
    for worker in await store.workers():
        if worker.status is WorkerStatus.ALIVE:
            continue
        for placement in await store.runs_of(worker.name):
            if not await store.release(placement.run_id, worker.name):
                continue  # another sweeper was first
            if placement.spec.mode == CHAT_MODE:
                # A cut-off chat turn is reported in the chat, not re-run.
                await ChatTurnStore(db).interrupt(placement.run_id, worker.name)
            how = await move_to_shared(app, placement.run_id, placement.spec.tool)
            await store.set_placement(
                placement.run_id,
                status=PlacementStatus.WAITING,
                note=f"worker {worker.name} is gone; waiting for another worker",
            )
            _LOGGER.info(
                "run %s of worker %s %s on its agent's queue",
                placement.run_id,
                worker.name,
                how,
                extra={"run_id": placement.run_id},
            )
            moved.append(placement.run_id)
    return moved


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
        loop = asyncio.get_running_loop()
        installed = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal)
                installed.append(sig)
        try:
            return await self._run()
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    async def _run(self) -> int:
        settings = self.settings
        async with open_database(settings) as db:
            pg: PostgresDatabase = db  # type: ignore[assignment]
            await ensure_queue_schema(pg)
            store = WorkerStore(pg)
            await store.register(
                self.name,
                host=socket.gethostname(),
                pid=os.getpid(),
                capacity=self.concurrency,
                queues=self.queues,
            )
            app = make_app(self.url, pool_size=self.concurrency + 2)
            register_task(app)
            runner = TurnRunner(
                self.name, settings, pg, app, agents=self.agents, warm_pool=new_warm_pool(settings)
            )
            try:
                async with app.open_async():
                    await self._serve(pg, app, runner)
            finally:
                with contextlib.suppress(TurnstileError):
                    await store.set_worker_status(self.name, WorkerStatus.STOPPED)
        _LOGGER.info("worker %s stopped", self.name)
        return 0

    async def _serve(
        self, db: PostgresDatabase, app: procrastinate.App, runner: TurnRunner
    ) -> None:
        settings = self.settings
        serving = asyncio.create_task(
            app.run_worker_async(
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
            ),
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

    async def _cut_when_asked(self, runner: TurnRunner) -> None:
        await self._cut_off.wait()
        _LOGGER.warning("cutting off %d running turn(s)", len(runner.running))
        for task in list(runner.running.values()):
            task.cancel()

    async def _heartbeat(
        self, db: PostgresDatabase, app: procrastinate.App, runner: TurnRunner
    ) -> None:
        store = WorkerStore(db)
        interval = self.settings.worker_heartbeat
        # One beat may not hang the next ones: a call into a database that went away (a
        # connection the pool still believed in, the queue's own pool) is cut off here.
        limit = max(3 * interval, 10.0)
        while True:
            try:
                async with asyncio.timeout(limit):
                    await self._beat(store, db, app, runner)
            except TimeoutError:
                _LOGGER.warning("heartbeat failed: no answer within %.0f s (will retry)", limit)
            except (TurnstileError, OSError) as exc:
                _LOGGER.warning("heartbeat failed (will retry): %s", exc)
            except Exception as exc:  # the queue's own errors (database away)
                _LOGGER.warning("heartbeat failed (will retry): %s", _describe(exc))
            await asyncio.sleep(interval)

    async def _beat(
        self, store: WorkerStore, db: PostgresDatabase, app: procrastinate.App, runner: TurnRunner
    ) -> None:
        if not await store.heartbeat(self.name, running=len(runner.running)):
            _LOGGER.warning(
                "worker %s was declared lost while the database was away; its runs have moved on",
                self.name,
            )
            await store.revive(self.name)
        if runner.held:
            await runner.prune(p.run_id for p in await store.runs_of(self.name))
        # A resident process that died or was closed idle since the last turn.
        await runner.mark_warm()
        await wake_parked(runner)
        if not self._stopping.is_set():
            await sweep(db, app, silent_after=self.settings.worker_timeout)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]
