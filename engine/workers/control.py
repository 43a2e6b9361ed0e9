"""The control plane's side of the workers: start a run on them, follow it, stop any run.

Nothing here runs a turn or reads a worker's disk: a run is a row and a job; what it did
is read back from the store (its turns, its state), wherever it ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import logging
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final, TextIO

from engine.automode.budget import STOPPED_BY_BUDGET
from engine.automode.channel import STOP_EXIT_CODE, STOPPED_BY_PERSON
from engine.automode.run import process_exit_code
from engine.automode.state import AutoModeState, AutoStatus, progress_line
from engine.errors import ConfigError, TurnstileError
from engine.runs import RunMode, new_run_id
from engine.runs.follow import Looked, RunEnded, RunFollower, TurnEnded, run_or_none
from engine.runs.spec import ChatPlace, PlaceId
from engine.spend import Budget
from engine.store.backend import AnyDatabase, open_database
from engine.store.location import PostgresURL
from engine.store.runs import RunRecord, RunStatus, SqliteRunStore
from engine.workers.queue import (
    abort_jobs,
    agent_queue,
    defer_turn,
    ensure_queue_schema,
    live_jobs,
    make_app,
    require_postgres,
    worker_queue,
)
from engine.workers.store import Placement, PlacementStatus, QueuedRun, WorkerStore
from engine.workers.views import look_on_workers, waiting_note
from engine.workspace.manager import DEFAULT_PROJECT, WorkspaceManager
from engine.workspace.projects import is_repository_reference

if TYPE_CHECKING:
    from engine.settings import Settings

__all__ = [
    "NO_PROJECT_ON_WORKERS",
    "Resubmitted",
    "chat_placements",
    "follow_run",
    "on_signals",
    "project_reference",
    "raise_budget_on_workers",
    "start_on_workers",
    "stop_on_signals",
    "stop_placed",
    "stop_run",
    "stop_run_in",
    "stop_when_asked",
    "worker_status",
    "workers_project_problem",
]

_LOGGER = logging.getLogger(__name__)
_POLL: Final = 0.25


#: Why a chat with no project runs nothing on the workers: the same words for a chat
#: session, an auto run and an autopilot drive.
NO_PROJECT_ON_WORKERS: Final = (
    "on the workers a run needs a project of TURNSTILE_PROJECTS, and none is bound here "
    "(this chat's own workspace is on the bot's machine, where no worker works): "
    "/project NAME binds one"
)


def workers_project_problem(settings: Settings, project: str) -> str | None:
    """Why a run of a chat on ``project`` cannot go to the workers (None: it can, as far
    as its workspace goes): ``default`` that no configured project is called is the
    chat's own workspace, on this machine's disk."""
    configured = {p.name for p in WorkspaceManager.from_settings(settings).projects}
    if project == DEFAULT_PROJECT and project not in configured:
        return NO_PROJECT_ON_WORKERS
    return None


def project_reference(settings: Settings, reference: str) -> str:
    """What a worker is told the project is: a configured name, else its URL or full path.

    Raises:
        ProjectError: an unknown name or a path that is not a repository.
    """
    project = WorkspaceManager.from_settings(settings).project_for(reference)
    return reference if not is_repository_reference(reference) else project.url


async def start_on_workers(settings: Settings, spec: QueuedRun) -> None:
    """Record ``spec`` and queue its first turn on its agent's queue (any worker with that
    agent's CLI takes it)."""
    url = require_postgres(settings.database)
    async with open_database(settings) as db:
        await ensure_queue_schema(db)
        await WorkerStore(db).place(spec)
        app = make_app(url, pool_size=2)
        async with app.open_async():
            await defer_turn(app, spec.run_id, queue=agent_queue(spec.tool))


@dataclass(frozen=True, slots=True)
class Resubmitted:
    """A run put back on the workers: its state as it stopped, and the worker it waits
    for (None: any worker with its agent, which takes it over from its pushed branch)."""

    state: AutoModeState
    worker: str | None


async def raise_budget_on_workers(
    settings: Settings, db: AnyDatabase, run_id: str, budget: Budget
) -> Resubmitted:
    """Let a run on the workers that its budget stopped go on under ``budget``: the budget
    is written into its placement and its next turn queued, on the worker that holds its
    worktree and agent session while that worker is alive (else on its agent's queue).
    The worker resumes it from its recorded turn under the new budget.

    Raises:
        ConfigError: not a run on the workers, not stopped by its budget, still running,
            or ``budget`` not larger than the one that stopped it.
    """
    url = require_postgres(settings.database)
    workers = WorkerStore(db)
    placement = await workers.placement(run_id)
    if placement is None or placement.spec.mode != "auto":
        raise ConfigError(f"run {run_id} is not an auto run on the workers")
    record = await SqliteRunStore(db).get_run(run_id)
    state = AutoModeState.of_run(record)
    if state.config.get("stopped_by") != STOPPED_BY_BUDGET or not placement.ended:
        raise ConfigError(f"run {run_id} was not stopped by its budget")
    old = Budget.from_config(state.config)
    if old is not None and not (
        (budget.usd or 0) > (old.usd or 0) or (budget.tokens or 0) > (old.tokens or 0)
    ):
        raise ConfigError(
            f"run {run_id} was stopped by its budget of {old.text()}: it goes on only under "
            "a larger one"
        )
    holder = placement.last_worker  # (the worker that holds its worktree, if alive)
    now = time.time()
    alive = {w.name for w in await workers.workers() if w.alive(now, settings.worker_timeout)}
    if holder not in alive:
        holder = None  # its worktree went with it: another worker takes the pushed branch
    spec = replace(placement.spec, budget_usd=budget.usd, budget_tokens=budget.tokens)
    if not await workers.resubmit(spec, holder=holder):
        raise ConfigError(f"run {run_id} was just put back on the workers")
    app = make_app(url, pool_size=2)
    async with app.open_async():
        queue = worker_queue(holder) if holder is not None else agent_queue(spec.tool)
        await defer_turn(app, run_id, queue=queue)
    return Resubmitted(state, holder)


def new_spec(
    *,
    objective: str,
    tool: str,
    project: str,
    agent_cmd: str | None,
    passthrough: tuple[str, ...],
    max_turns: int | None,
    verify_cmd: str | None,
    budget: Budget | None = None,
    daily_budget: float | None = None,
) -> QueuedRun:
    return QueuedRun(
        budget_usd=budget.usd if budget is not None else None,
        budget_tokens=budget.tokens if budget is not None else None,
        daily_budget=daily_budget,
        run_id=new_run_id(RunMode.AUTO),
        objective=objective,
        tool=tool,
        project=project,
        agent_cmd=agent_cmd,
        passthrough=passthrough,
        max_turns=max_turns,
        verify_cmd=verify_cmd,
    )


async def worker_status(
    store: WorkerStore, placement: Placement, *, silent_after: float, now: float | None = None
) -> str | None:
    """Why the run waits for a worker while no live worker holds it (see
    :func:`~engine.workers.views.waiting_note`), else None."""
    now = time.time() if now is None else now
    return waiting_note(placement, [w for w in await store.workers() if w.alive(now, silent_after)])


@contextlib.contextmanager
def on_signals(handler: Callable[[], object]) -> Iterator[None]:
    """``handler`` runs on Ctrl-C or SIGTERM while the block runs; the loop's handlers are
    put back after."""
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, handler)
            installed.append(sig)
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[asyncio.Event]:
    """An event set by Ctrl-C or SIGTERM while the block runs (a terminal following a run
    on the workers stops it then)."""
    stop = asyncio.Event()
    with on_signals(stop.set):
        yield stop


async def chat_placements(
    db: AnyDatabase, chat_id: PlaceId, *, drives: bool, place: ChatPlace | None = None
) -> list[Placement]:
    """The unfinished runs on the workers started from this chat (or only from ``place``,
    the chat and its topic): its auto runs, or (``drives``) its autopilot drives, a wave's
    sub-tasks left out (they are stopped with their drive)."""
    found = []
    for placement in await WorkerStore(db).placements():
        spec = placement.spec
        if placement.ended or spec.chat_id != chat_id:
            continue
        if spec.mode != ("autopilot" if drives else "auto"):  # (a chat session's too)
            continue
        if drives and spec.parent_run is not None:
            continue
        if place is not None and (spec.chat_id, spec.thread_id) != (
            place.chat_id,
            place.thread_id,
        ):
            continue
        found.append(placement)
    return found


async def stop_placed(settings: Settings, db: AnyDatabase, run_id: str) -> bool:
    """:func:`stop_run_in` for a run a chat lists; False when it had ended meanwhile."""
    try:
        done = await stop_run_in(settings, db, run_id)
    except ConfigError as exc:  # it ended meanwhile
        _LOGGER.info("nothing to stop: %s", exc, extra={"run_id": run_id})
        return False
    _LOGGER.info("%s", done, extra={"run_id": run_id})
    return True


async def follow_run(
    settings: Settings,
    run_id: str,
    out: TextIO,
    *,
    stop_requested: asyncio.Event | None = None,
    after: int = 0,
) -> int:
    """Print the run's progress until it ends; its exit status (as ``turnstile auto``'s).
    ``after``: the cursor of the last event already printed (a run that goes on).

    Nothing times out: with no worker alive the run waits, and this says so.
    """
    async with open_database(settings) as db:
        look = look_on_workers(db, run_id, silent_after=settings.worker_timeout)
        follower = RunFollower(db, run_id, look, after=after, poll=_POLL)
        note: str | None = None
        async with (
            stop_once_asked(settings, db, run_id, stop_requested, out, "the run"),
            contextlib.aclosing(follower.events()) as events,
        ):
            async for event in events:
                match event:
                    case Looked(where=where) if where.waiting != note:
                        note = where.waiting
                        if note:
                            print(f"… {note}", file=out, flush=True)
                    case TurnEnded(turn=turn):
                        took = (turn.finished_at or turn.started_at) - turn.started_at
                        code = "-" if turn.exit_code is None else str(turn.exit_code)
                        print(
                            f"turn {turn.seq}"
                            + (f" (attempt {turn.attempt})" if turn.attempt > 1 else "")
                            + f" {turn.phase or '-'}: {turn.state.value}, exit {code}, "
                            f"{took:.1f}s" + (f" · {turn.error}" if turn.error else ""),
                            file=out,
                            flush=True,
                        )
                    case RunEnded(record=record, where=where):
                        return _final(run_id, record, where.placement, out)
    raise ConfigError(f"run {run_id} is not on the workers")  # (the follower ends only so)


@contextlib.asynccontextmanager
async def stop_once_asked(
    settings: Settings,
    db: AnyDatabase,
    run_id: str,
    asked: asyncio.Event | None,
    out: TextIO,
    what: str,
) -> AsyncIterator[None]:
    """While the block runs: once ``asked`` is set, say so and stop ``what`` (run
    ``run_id``); its follower says how it ended."""

    async def stop() -> None:
        assert asked is not None
        await asked.wait()
        print(f"Stopping {what}: the running turn is pre-empted…", file=out, flush=True)
        with contextlib.suppress(ConfigError):  # it ended meanwhile: the follower says how
            await _stop(settings, db, run_id)

    if asked is None:
        yield
        return
    stopper = asyncio.create_task(stop(), name=f"stop-when-asked-{run_id}")
    try:
        yield
    finally:
        stopper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stopper


def _final(run_id: str, record: RunRecord, placement: Placement, out: TextIO) -> int:
    if record.workdir is None:  # it ended before its first step (a stop, or why it could not)
        print(f"Auto run {run_id}: did not start: {placement.note or 'stopped'}", file=out)
        return process_exit_code(record.exit_code or 1)
    if placement.report:  # the worker's, as `turnstile auto` prints a local run's
        print(placement.report, file=out, flush=True)
        return process_exit_code(record.exit_code or 0)
    state = AutoModeState.of_run(record)
    line = f"Auto run {run_id}: {record.status.value}"
    if record.exit_code:
        line += f" (exit {record.exit_code})"
    print(line, file=out)
    print(f"{progress_line(state)}; last phase: {state.phase.label}", file=out)
    if state.message:
        print(state.message, file=out)
    if record.abort_reason:
        print(f"Aborted: {record.abort_reason}", file=out)
    if placement.note:
        print(placement.note, file=out)
    out.flush()
    return process_exit_code(record.exit_code or 0)


async def stop_run(settings: Settings, run_id: str) -> str:
    """Ask the run to stop wherever it runs; what was done, in one line.

    Raises:
        ConfigError: no such run, or it has ended.
    """
    async with open_database(settings) as db:
        return await _stop(settings, db, run_id)


async def stop_run_in(settings: Settings, db: AnyDatabase, run_id: str) -> str:
    """:func:`stop_run` on an open database (the bot's)."""
    return await _stop(settings, db, run_id)


async def _stop(settings: Settings, db: AnyDatabase, run_id: str) -> str:
    workers = WorkerStore(db)
    runs = SqliteRunStore(db)
    placement = await workers.placement(run_id)
    record = await run_or_none(runs, run_id)
    if record is None:
        raise ConfigError(f"no run {run_id!r}")
    # A drive parked on the workers (at a gate, or for its sub-tasks) can still be stopped.
    parked = placement is not None and placement.status is PlacementStatus.PARKED
    if record.status is not RunStatus.RUNNING and not parked:
        raise ConfigError(f"run {run_id} has ended; there is nothing to stop")
    if placement is not None and placement.spec.mode == "autopilot":
        # A drive's wave goes with it: its sub-tasks' drives are stopped too.
        for child in await workers.placements():
            if child.spec.parent_run == run_id and not child.ended:
                with contextlib.suppress(ConfigError):
                    await _stop(settings, db, child.run_id)
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    await workers.request_stop(run_id, by=who)
    if placement is None or not isinstance(settings.database, PostgresURL):
        # Driven by a process (`turnstile auto`), which polls the request.
        return f"asked run {run_id} to stop"
    app = make_app(settings.database, pool_size=2)
    async with app.open_async():
        _, aborted = await abort_jobs(app, run_id)
        running = [j for j in await live_jobs(app, run_id) if j.status == "doing"]
    if aborted or running:
        return f"asked the worker running run {run_id} to stop its turn"
    # Between turns: nothing runs, so the run is ended here.
    await _end_stopped(workers, runs, record, run_id)
    return f"stopped run {run_id} (no turn was running)"


async def _end_stopped(
    workers: WorkerStore, runs: SqliteRunStore, record: RunRecord, run_id: str
) -> None:
    # (A run stopped before its first step has no state to stop: its row says it stopped.)
    if record.mode == RunMode.AUTOPILOT.value or record.workdir is None:
        await runs.update_run(
            run_id,
            status=RunStatus.STOPPED,
            exit_code=STOP_EXIT_CODE,
            finished_at=time.time(),
        )
    else:
        now = time.time()
        state = replace(
            AutoModeState.of_run(record),
            status=AutoStatus.STOPPED,
            exit_code=STOP_EXIT_CODE,
            message=STOPPED_BY_PERSON,
            updated_at=now,
            finished_at=now,
        )
        await runs.update_run(
            run_id,
            status=RunStatus.STOPPED,
            exit_code=STOP_EXIT_CODE,
            finished_at=now,
            state=state.to_json(),
        )
    await workers.let_go(run_id, STOPPED_BY_PERSON)
    await workers.clear_stop(run_id)


async def wait_stopped(settings: Settings, run_id: str, *, within: float) -> bool:
    """Whether the run stopped running within ``timeout`` seconds."""
    deadline = time.monotonic() + within
    async with open_database(settings) as db:
        runs = SqliteRunStore(db)
        while True:
            record = await run_or_none(runs, run_id)
            if record is not None and record.status is not RunStatus.RUNNING:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_POLL)


async def stop_when_asked(
    db: AnyDatabase, run_id: str, stop: Callable[[], Awaitable[None]], *, poll: float = 0.5
) -> None:
    """For a run driven in this process: call ``stop`` once ``turnstile stop`` asks."""
    store = WorkerStore(db)
    while True:
        with contextlib.suppress(TurnstileError):
            if await store.stop_requested(run_id):
                await stop()
                await store.clear_stop(run_id)
                return
        await asyncio.sleep(poll)
