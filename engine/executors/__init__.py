"""Where a run executes: in this process or on ``turnstile worker`` processes, chosen once.

A front end (the bot, a command) asks an executor to start, steer, stop, list and recover
runs; it never asks where they execute. :func:`auto_executor` (auto runs),
:func:`drive_executor` (autopilot drives) and :func:`chat_agents` (chat sessions) make the
one for the settings' ``TURNSTILE_EXECUTION``:

- ``local``: :class:`~engine.executors.local.LocalAuto` drives each run in a task of this
  process, under the run supervisor (its turn slots are shared with every other run).
- ``workers``: :class:`~engine.executors.workers.WorkersAuto` queues new runs on the
  workers and follows them from the store; runs that were started in this process before
  (recorded here, parked or cut off) are still resumed and stopped here.

Either way a run reports through the front end's :class:`~engine.sink.RunSink` (its live
status, turns, report) and every change is in the event log. What an executor says beside a
run's own reports (a run resumed, a stop under way on a worker) goes through
:class:`Notices`, whose messages a front end may keep and edit by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.errors import ConfigError
from engine.executors.base import (
    Approvals,
    AutoExecutor,
    AutoRequest,
    Notices,
    Started,
    Workdirs,
)

if TYPE_CHECKING:
    import argparse
    from collections.abc import Awaitable, Callable

    from engine.executors.base import AgentFactory
    from engine.executors.chats import ChatAgents
    from engine.executors.drives import DriveExecutor
    from engine.gates import Gates
    from engine.runs import Recovery, RunSupervisor
    from engine.settings import Settings
    from engine.sink import RunSink
    from engine.store.backend import AnyDatabase
    from engine.store.runs import SqliteRunStore

__all__ = [
    "Approvals",
    "AutoExecutor",
    "AutoRequest",
    "Notices",
    "Started",
    "Workdirs",
    "auto_elsewhere",
    "auto_executor",
    "chat_agents",
    "drive_elsewhere",
    "drive_executor",
    "gate_decided",
    "recover_runs",
    "worker_of",
]


def auto_executor(
    settings: Settings,
    db: AnyDatabase,
    *,
    runs: SqliteRunStore,
    supervisor: RunSupervisor,
    sink: RunSink,
    notices: Notices,
    workdirs: Workdirs,
    approvals: Approvals,
) -> AutoExecutor:
    """The executor of auto runs for ``settings.execution``."""
    from engine.executors.local import LocalAuto

    local = LocalAuto(
        settings,
        db,
        runs=runs,
        supervisor=supervisor,
        sink=sink,
        notices=notices,
        workdirs=workdirs,
        approvals=approvals,
    )
    if settings.execution != "workers":
        return local
    from engine.executors.workers import WorkersAuto  # the workers' modules only when asked

    return WorkersAuto(settings, db, local=local, sink=sink, notices=notices)


async def recover_runs(
    db: AnyDatabase,
    supervisor: RunSupervisor,
    *,
    drive_alive: Callable[[str], Awaitable[bool]],
) -> Recovery:
    """The one recovery at a front end's start (:meth:`RunSupervisor.recover`): the turns
    of runs placed on the workers are theirs (a lost worker's are cut off by the worker that
    takes the run over), so a start here neither ends nor kills them."""
    from engine.workers.store import WorkerStore

    on_workers = [p.run_id for p in await WorkerStore(db).placements() if not p.ended]
    return await supervisor.recover(drive_alive=drive_alive, elsewhere=on_workers)


def drive_executor(
    settings: Settings,
    db: AnyDatabase,
    gates: Gates,
    *,
    supervisor: RunSupervisor,
    sink: RunSink,
    notices: Notices,
    agent_factory: AgentFactory,
) -> DriveExecutor:
    """The executor of drives for ``settings.execution``."""
    from engine.executors.drives import LocalDrives

    local = LocalDrives(
        gates, supervisor=supervisor, sink=sink, notices=notices, agent_factory=agent_factory
    )
    if settings.execution != "workers":
        return local
    from engine.executors.drives_workers import WorkersDrives  # the workers' modules only then

    return WorkersDrives(settings, db, gates, local=local, sink=sink, notices=notices)


def chat_agents(settings: Settings, db: AnyDatabase, *, agent_factory: AgentFactory) -> ChatAgents:
    """Where chat turns run for ``settings.execution`` (:mod:`engine.executors.chats`)."""
    from engine.executors.chats import LocalChatAgents, WorkersChatAgents

    if settings.execution == "workers":
        return WorkersChatAgents(settings, db)
    return LocalChatAgents(settings, agent_factory)


async def worker_of(settings: Settings, db: AnyDatabase, run_id: str) -> str | None:
    """The worker that runs (or last ran) the turns of ``run_id``; None: it runs here."""
    if settings.execution != "workers":
        return None
    from engine.workers.store import WorkerStore

    placement = await WorkerStore(db).placement(run_id)
    if placement is None:
        return None
    return placement.worker or placement.last_worker


# -- the terminal's commands ----------------------------------------------------------


async def auto_elsewhere(
    args: argparse.Namespace,
    settings: Settings,
    objective: Callable[[], tuple[str, list[str]]],
) -> int | None:
    """``turnstile auto`` where the settings run it when that is not this process: queued
    on the workers and followed there (its exit code); None: it runs here. ``objective``
    reads the run's objective from the arguments (only a new run has one)."""
    if settings.execution != "workers":
        return None
    if getattr(args, "permissions", None) not in (None, "off"):
        raise ConfigError(
            "--permissions needs the run's tool calls to ask a person, and auto runs on the "
            "workers do not ask; drop it, or run it here (TURNSTILE_EXECUTION=local)"
        )
    from engine.workers.auto import run_on_workers

    return await run_on_workers(args, settings, objective())


async def drive_elsewhere(args: argparse.Namespace, settings: Settings) -> int | None:
    """``turnstile autopilot`` on the workers when the settings say so (its exit code);
    None: the drive runs here."""
    if settings.execution != "workers":
        return None
    from engine.workers.drives import drive_on_workers

    return await drive_on_workers(args, settings)


async def gate_decided(settings: Settings, db: AnyDatabase, task: str) -> None:
    """A gate of ``task`` was decided: its drive goes on at once wherever it is parked (a
    drive here is woken by the gates service itself)."""
    if settings.execution != "workers":
        return
    from engine.workers.drives import wake_drive

    await wake_drive(settings, db, task)
