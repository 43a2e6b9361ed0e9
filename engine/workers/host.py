"""The host of every step a worker runs: "run one step of run R", for every mode alike.

A job brings only the run id. The host takes the run (the compare-and-set on its holder),
hands a job meant for another worker or agent on, and runs one step of the run's mode: a
:class:`StepDriver` (an auto run's turn, a chat message's turn, an autopilot drive's phase
step). The step says what comes next: continue (its next step is queued on this worker's
queue), park (it waits for a person, its sub-tasks or the chat's next message) or done.

What every driver needs from its worker is here once: the run's checkout (:class:`Checkout`:
a fresh worktree the first time, reset to the pushed branch when the run comes from a lost
worker, pushed back after the step), the poll for stop requests while the step runs
(:func:`stop_watch`), the first prompt of a moved run's new session (:class:`PrimedSession`),
what a driver keeps of a run between its steps (:class:`Kept`, a warm agent process) and
the sweep that moves a dead worker's runs on (:func:`sweep`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Final, Protocol

import procrastinate

from engine.agents.warm import WarmPool
from engine.automode.channel import STOP_EXIT_CODE
from engine.errors import StoreUnreachableError, TurnstileError, TurnSuperseded
from engine.git import GitRunner
from engine.logs import log_context
from engine.store.backend import AnyDatabase, wait_reachable
from engine.store.runs import RunStatus, SqliteRunStore
from engine.turn import AgentSession, TurnOutput
from engine.workers.chatturns import CHAT_MODE, ChatTurnStore
from engine.workers.queue import (
    SHARED_QUEUE,
    agent_queue,
    defer_turn,
    move_to_shared,
    nudge,
    worker_queue,
)
from engine.workers.store import Placement, WorkerStatus, WorkerStore
from engine.workspace.manager import WorkspaceManager, run_branch
from engine.workspace.store import SqliteWorkspaceStore, Workspace

if TYPE_CHECKING:
    from engine.settings import Settings
    from engine.store.postgres import PostgresDatabase

__all__ = [
    "AUTO_MODE",
    "Checkout",
    "Kept",
    "Next",
    "PrimedSession",
    "RunHost",
    "StepDriver",
    "fetch_reset",
    "record_stopped",
    "stop_watch",
    "sweep",
]

_LOGGER = logging.getLogger(__name__)

AUTO_MODE: Final = "auto"
_STOP_POLL: Final = 0.25


class Next(StrEnum):
    """What comes after a step."""

    CONTINUE = "continue"  # its next step is queued here
    PARK = "park"  # it waits: for a person, its sub-tasks, the chat's next message
    DONE = "done"  # the run has ended (its placement says how)


class StepDriver(Protocol):
    """One mode's step on a worker."""

    @property
    def after_outage(self) -> Next:
        """What follows a step cut short by the database going away (once it is back)."""
        ...

    async def step(
        self, host: RunHost, placement: Placement, *, moved: bool, stop: asyncio.Event
    ) -> Next:
        """Run one step of the run ``placement`` (taken by this worker); ``moved``: it comes
        from a lost worker; ``stop``: set when a person stops it."""
        ...


class Kept(Protocol):
    """What a driver keeps of a run between its steps here (its agent's warm process)."""

    @property
    def moves(self) -> int:
        """The placement's moves when it was kept: a run that moved meanwhile is stale."""
        ...

    @property
    def resident(self) -> bool:
        """Whether its agent process is running now."""
        ...

    async def close(self) -> None: ...


class PrimedSession:
    """The first prompt of a new session starts with ``primer``: where the run stands, in
    plain words (its earlier conversation was on another machine's disk)."""

    def __init__(self, agent: AgentSession, primer: str) -> None:
        self._agent = agent
        self._primer: str | None = primer

    @property
    def session_id(self) -> str:
        return self._agent.session_id

    @property
    def agent(self) -> AgentSession:
        """The session it wraps (seen through when its resident process is closed)."""
        return self._agent

    async def run_turn(self, prompt: str) -> TurnOutput:
        primer, self._primer = self._primer, None
        return await self._agent.run_turn(primer + prompt if primer else prompt)


async def fetch_reset(cwd: Path, remote: str, branch: str) -> bool:
    """The worktree at ``cwd`` reset to ``branch`` as pushed to ``remote``; False (and the
    worktree left as it was) when no such branch was pushed."""
    git = GitRunner()
    fetched = await git.run(
        ["fetch", "--no-tags", remote, f"refs/heads/{branch}"], cwd=cwd, check=False
    )
    if fetched.exit_code != 0:
        return False
    await git.run(["reset", "--hard", "FETCH_HEAD"], cwd=cwd)
    return True


@dataclass(slots=True)
class Checkout:
    """A run's worktree on this worker and the branch it pushes to the runs remote."""

    manager: WorkspaceManager
    workspace: Workspace
    remote: str
    branch: str
    pushed: str | None = None

    @property
    def path(self) -> Path:
        return Path(self.workspace.path)

    def locked(self) -> contextlib.AbstractAsyncContextManager[Workspace]:
        """The worktree's lock, held while a step works in it."""
        return self.manager.lock(self.workspace)

    async def adopt(self, branch: str | None = None) -> bool:
        """Reset to the pushed ``branch`` (this run's own by default): a run taken over from
        another worker, or a sub-task cut from its parent's; whether it was there."""
        return await fetch_reset(self.path, self.remote, branch or self.branch)

    async def push(self, *, required: bool = True) -> None:
        """Push the branch (never forced, no other branch) so another worker can go on; not
        again when nothing was committed since this checkout's last push. ``required``: a
        refused push fails the step (else it is logged; the next worker starts from the
        last push)."""
        git = GitRunner()
        head = (await git.run(["rev-parse", "HEAD"], cwd=self.path)).stdout.strip()
        if head and head == self.pushed:
            return
        done = await git.run(
            ["push", "--no-verify", self.remote, f"HEAD:refs/heads/{self.branch}"],
            cwd=self.path,
            check=required,
        )
        if done.exit_code != 0:
            _LOGGER.warning("could not push %s: %s", self.branch, done.stderr.strip()[:300])
            return
        self.pushed = head


async def _poll_stop(
    db: AnyDatabase,
    run_id: str,
    stop: asyncio.Event,
    on_stop: Callable[[], Awaitable[None]] | None,
) -> None:
    workers = WorkerStore(db)
    while not stop.is_set():
        try:
            if await workers.stop_requested(run_id):
                break
        except TurnstileError as exc:  # the database may be away a moment
            _LOGGER.warning("cannot read stop requests: %s", exc)
        await asyncio.sleep(_STOP_POLL)
    stop.set()
    if on_stop is not None:
        await on_stop()


@contextlib.asynccontextmanager
async def stop_watch(
    db: AnyDatabase,
    run_id: str,
    stop: asyncio.Event,
    *,
    on_stop: Callable[[], Awaitable[None]] | None = None,
) -> AsyncIterator[None]:
    """While in it, a stop asked for ``run_id`` (``turnstile stop``, ``/stop``) sets
    ``stop``; ``on_stop`` runs once it is set, however it was."""
    poller = asyncio.create_task(_poll_stop(db, run_id, stop, on_stop), name=f"stop-{run_id}")
    try:
        yield
    finally:
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller


async def sweep(db: AnyDatabase, app: procrastinate.App, *, silent_after: float) -> list[str]:
    """Declare silent workers lost and move the runs of every gone worker; the runs moved.

    Every live worker sweeps on its heartbeat, and so does the bot when a chat turn's
    worker went silent (there may be no live worker left to do it)."""
    store = WorkerStore(db)
    for name in await store.declare_lost(silent_after):
        _LOGGER.warning("worker %s stopped answering; its runs move to other workers", name)
    moved: list[str] = []
    for worker in await store.workers():
        if worker.status is WorkerStatus.ALIVE:
            continue
        for placement in await store.runs_of(worker.name):
            note = f"worker {worker.name} is gone; waiting for another worker"
            if not await store.release(placement.run_id, worker.name, note):
                continue  # another sweeper was first
            if placement.spec.mode == CHAT_MODE:
                # A cut-off chat turn is reported in the chat, not re-run.
                await ChatTurnStore(db).interrupt(placement.run_id, worker.name)
            how = await move_to_shared(app, placement.run_id, placement.spec.tool)
            _LOGGER.info(
                "run %s of worker %s %s on its agent's queue",
                placement.run_id,
                worker.name,
                how,
                extra={"run_id": placement.run_id},
            )
            moved.append(placement.run_id)
    return moved


async def _record_error(runs: SqliteRunStore, run_id: str, why: str) -> None:
    """A run that cannot go on has ended in error."""
    record = await runs.get_run(run_id)
    if record.status in (RunStatus.RUNNING, RunStatus.PARKED):
        await runs.update_run(
            run_id, status=RunStatus.ERROR, abort_reason=why[:500], finished_at=time.time()
        )


async def record_stopped(runs: SqliteRunStore, run_id: str) -> None:
    """A person's stop ended the run: its row says so (stopped, with the stop's exit
    status, which tells it from a budget's stop)."""
    record = await runs.get_run(run_id)
    if record.status in (RunStatus.RUNNING, RunStatus.PARKED) or (
        record.status is RunStatus.STOPPED and record.exit_code is None
    ):
        await runs.update_run(
            run_id,
            status=RunStatus.STOPPED,
            exit_code=STOP_EXIT_CODE,
            finished_at=record.finished_at or time.time(),
        )


@dataclass(slots=True)
class RunHost:
    """Everything a worker's step jobs share: its name, settings, database and queue.

    Attributes:
        agents: the agents whose CLI this worker has.
        drivers: each mode's step driver, by mode (``auto`` for a mode not listed).
        running: the runs with a step in flight here (their count is heartbeated).
        held: what the drivers keep here of runs between their steps (re-made only when
            a run is not here or has moved meanwhile).
        stops: each run's stop event here (the one its kept state was given).
        warm_pool: bounds this worker's resident agent processes (warm sessions:
            ``TURNSTILE_MAX_WARM_SESSIONS`` per worker, idle ones closed after
            ``TURNSTILE_WARM_IDLE_MINUTES``); a held run's process stays between its turns.
        marked_warm: the runs last recorded warm for this worker (see :meth:`mark_warm`).
    """

    name: str
    settings: Settings
    db: PostgresDatabase
    app: procrastinate.App
    agents: frozenset[str] = frozenset()
    drivers: Mapping[str, StepDriver] = field(default_factory=dict)
    running: dict[str, asyncio.Task[bool]] = field(default_factory=dict)
    held: dict[str, Kept] = field(default_factory=dict)
    stops: dict[str, asyncio.Event] = field(default_factory=dict)
    deferrals: set[asyncio.Task[None]] = field(default_factory=set)
    warm_pool: WarmPool | None = None
    marked_warm: frozenset[str] | None = None

    @property
    def queue(self) -> str:
        return worker_queue(self.name)

    @property
    def env(self) -> Mapping[str, str]:
        return {"AGENT_WORKER_NAME": self.name}  # which worker runs it (not a setting)

    def manager(self) -> WorkspaceManager:
        return WorkspaceManager.from_settings(self.settings, store=SqliteWorkspaceStore(self.db))

    async def checkout(self, key: str, project: str) -> Checkout:
        """The worktree of ``key`` (a run, or a chat session) on the project, made if needed,
        and its branch on the runs remote (the project's repository if none is set)."""
        manager = self.manager()
        found = manager.project_for(project)
        workspace = await manager.provision(key, found)
        remote = self.settings.runs_remote or found.url
        return Checkout(manager, workspace, remote, run_branch(key))

    async def job(
        self, run_id: str, *, user_abort: Callable[[], bool], queue: str | None = None
    ) -> None:
        """One step of ``run_id``; cancelled (job aborted), a person's stop ends it cleanly."""
        stop = self.stops.setdefault(run_id, asyncio.Event())
        inner: asyncio.Task[bool] = asyncio.create_task(
            self._one(run_id, stop, shared=queue == SHARED_QUEUE), name=f"turn-{run_id}"
        )
        self.running[run_id] = inner
        inner.add_done_callback(lambda _: self.running.pop(run_id, None))
        try:
            goes_on = await asyncio.shield(inner)
        except asyncio.CancelledError:
            if user_abort():
                # A person aborted the job: stop the step the way `turnstile stop` does, so
                # the run is recorded stopped, not left half-way.
                stop.set()
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.shield(inner)
            else:
                # The worker is going down: the step is cut off (its process group
                # killed); the run continues elsewhere as a new attempt.
                inner.cancel()
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.shield(inner)
            raise
        if goes_on:
            await self._queue_next(run_id)
        elif run_id not in self.held:
            self.stops.pop(run_id, None)

    async def _one(self, run_id: str, stop: asyncio.Event, *, shared: bool = False) -> bool:
        """Take the run and run its step; whether its next step is to be queued here."""
        workers = WorkerStore(self.db)
        placement = await workers.placement(run_id) if shared else None
        if placement is not None and placement.worker is None:
            tool = placement.spec.tool
            if tool not in self.agents:
                # A job from the shared queue, and this worker lacks the agent's CLI: hand
                # it to the queue only workers with that CLI listen on.
                _LOGGER.info("run %s needs %s, which this worker lacks; handed on", run_id, tool)
                await defer_turn(self.app, run_id, queue=agent_queue(tool))
                return False
        before, holder, stop_asked = await workers.take_and_check(run_id, self.name)
        if before is None:
            _LOGGER.warning("a turn job for run %s, which is not on the workers", run_id)
            return False
        if before.ended:
            await self.forget(run_id)
            return False
        if holder is not None and holder != self.name:
            # Not ours: its worktree is on that worker (a job queued on the shared queue
            # while the run was being placed). Hand it over.
            await defer_turn(self.app, run_id, queue=worker_queue(holder))
            return False
        moved = holder is None and before.moves > 0
        kept = self.held.get(run_id)
        if kept is not None and (moved or kept.moves != before.moves):
            await self.forget(run_id, keep_stop=True)  # it went away and came back
        driver = self.drivers.get(before.spec.mode) or self.drivers[AUTO_MODE]
        with log_context(run_id=run_id):
            try:
                if stop_asked:
                    stop.set()
                after = await driver.step(self, before, moved=moved, stop=stop)
            except TurnSuperseded as exc:
                # This worker was declared lost while the step ran and the run moved on:
                # the step's result was not kept, and the run is its new holder's (no
                # push, no next step from here).
                _LOGGER.warning("run %s moved on while its turn ran here: %s", run_id, exc)
                return False
            except StoreUnreachableError as exc:
                if not exc.retryable:
                    raise
                # The database went away during the step: what it did could not all be
                # recorded. Once it is back, the run goes on from what the store holds: a
                # turn recorded started and never ended runs again.
                _LOGGER.warning(
                    "run %s: lost the database during its turn (%s); it goes on once the "
                    "database is back",
                    run_id,
                    exc,
                )
                await wait_reachable(self.db)
                return driver.after_outage is Next.CONTINUE
            except TurnstileError as exc:
                # Bad input or a broken checkout: the run cannot go on; say why where
                # `turnstile runs` and the following terminal read it.
                _LOGGER.error("run %s cannot go on: %s", run_id, exc)
                await self.forget(run_id)
                await _record_error(SqliteRunStore(self.db), run_id, str(exc))
                await workers.let_go(run_id, str(exc))
                return False
        if after is Next.CONTINUE and before.note:
            # Taking it set it running; only a note (parked, waiting) is left to clear.
            await workers.set_note(run_id, "")
        return after is Next.CONTINUE

    async def end(self, run_id: str, note: str = "") -> None:
        """The run has ended here (its row says how): let go of it, drop its stop request."""
        await self.forget(run_id)
        workers = WorkerStore(self.db)
        await workers.let_go(run_id, note)
        await workers.clear_stop(run_id)

    async def forget(self, run_id: str, *, keep_stop: bool = False) -> None:
        """Let go of what is kept of the run here (its owner lock with it)."""
        kept = self.held.pop(run_id, None)
        if not keep_stop:
            self.stops.pop(run_id, None)
        if kept is not None:
            # A warm session's resident process ends when the run leaves this worker
            # (ended, stopped, moved, or the worker stops), not at idle eviction.
            with contextlib.suppress(TurnstileError, OSError):
                await kept.close()
            await self.mark_warm()

    def warm_runs(self) -> frozenset[str]:
        """The runs held here whose agent process is resident now."""
        return frozenset(run_id for run_id, kept in self.held.items() if kept.resident)

    async def mark_warm(self) -> None:
        """Record in the database which of this worker's runs are warm (their resident
        process is running), so ``turnstile runs`` and ``/status`` on other machines show
        it; written only when it changed. Called after each turn, when a run is let go,
        and with each heartbeat (a process that died or was closed idle meanwhile)."""
        warm = self.warm_runs()
        if warm == self.marked_warm:
            return
        try:
            await WorkerStore(self.db).mark_warm(self.name, warm)
        except TurnstileError as exc:  # the database may be away a moment: the next beat
            _LOGGER.warning("cannot record which runs are warm (will retry): %s", exc)
            return
        self.marked_warm = warm

    async def forget_all(self) -> None:
        for run_id in list(self.held):
            await self.forget(run_id)
        if self.warm_pool is not None:
            await self.warm_pool.aclose()

    async def prune(self, still_here: Iterable[str]) -> None:
        """Forget the runs held here between steps that no longer are this worker's (they
        ended, were stopped between steps, or moved on)."""
        keep = set(still_here) | set(self.running)
        for run_id in [r for r in self.held if r not in keep]:
            await self.forget(run_id)

    async def _queue_next(self, run_id: str) -> None:
        """Queue the run's next step on this worker's queue, and wake the worker once this
        job has ended.

        The new job waits while this one holds the run's lock; procrastinate fetches again
        on a new job's notification or at its next poll, not when a lock is freed. So once
        this job's end is recorded (its task done), the worker's queue is nudged.
        """
        await defer_turn(self.app, run_id, queue=self.queue)
        job_task = asyncio.current_task()

        def later(_: object) -> None:
            task = asyncio.get_running_loop().create_task(
                nudge(self.app, self.queue), name=f"nudge-{run_id}"
            )
            self.deferrals.add(task)
            task.add_done_callback(self.deferrals.discard)

        if job_task is not None:
            job_task.add_done_callback(later)
