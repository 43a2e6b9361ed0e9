"""Autopilot drives on the workers, the control plane's side: queue a drive, follow it,
wake a parked drive once its gate is decided, and the gates the bot posts.

The worker's side (one job per phase step, waves) is :mod:`engine.workers.autopilot`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, TextIO

from engine.automode.channel import STOP_EXIT_CODE
from engine.errors import ConfigError
from engine.gates.records import TaskRecord
from engine.gates.workflow import COMPLETE
from engine.runs import PlaceId, RunMode, new_run_id
from engine.runs.follow import Looked, RunEnded, RunFollower
from engine.sink import GateRequest
from engine.spend import Budget
from engine.store.backend import AnyDatabase, open_database
from engine.store.runs import RunRecord
from engine.workers.control import stop_on_signals, stop_once_asked
from engine.workers.store import Placement, PlacementStatus, QueuedRun, WorkerStore
from engine.workers.views import look_on_workers

if TYPE_CHECKING:
    from engine.settings import Settings
from engine.workers.autopilot import (
    AUTOPILOT,
    EXIT_BUDGET,
    EXIT_HUMAN,
    EXIT_PARKED,
    budget_stopped,
    drive_ready,
    drives_by_task,
    wake_parked_drive,
)

__all__ = [
    "QueuedDrive",
    "drive_on_workers",
    "follow_drive",
    "gate_requests",
    "new_drive_spec",
    "queue_drive",
    "wake_drive",
]

_LOGGER = logging.getLogger(__name__)
_POLL: Final = 0.25


def new_drive_spec(
    *,
    task: str,
    summary: str,
    tool: str,
    project: str,
    agent_cmd: str | None,
    chat: tuple[PlaceId, PlaceId | None] | None = None,
    budget: Budget | None = None,
) -> QueuedRun:
    """A drive of ``task`` to put on the workers (``budget``: what its turns may spend,
    its sub-tasks' counted too)."""
    return QueuedRun(
        run_id=new_run_id(RunMode.AUTOPILOT),
        objective=summary,
        tool=tool,
        project=project,
        agent_cmd=agent_cmd,
        chat_id=chat[0] if chat is not None else None,
        thread_id=chat[1] if chat is not None else None,
        mode=AUTOPILOT,
        task=task,
        budget_usd=budget.usd if budget is not None else None,
        budget_tokens=budget.tokens if budget is not None else None,
    )


async def wake_drive(settings: Settings, db: AnyDatabase, task_name: str) -> bool:
    """After a gate of ``task_name`` was decided: queue the next step of its drive parked
    on the workers at once (its worker's heartbeat would, a beat later); whether one was
    queued."""
    from engine.gates.service import Gates
    from engine.workers.queue import make_app, require_postgres

    workers = WorkerStore(db)
    placement = (await drives_by_task(workers)).get(task_name)
    if placement is None or placement.status is not PlacementStatus.PARKED:
        return False
    if not await drive_ready(Gates(db, settings).store, workers, placement):
        return False
    app = make_app(require_postgres(settings.database), pool_size=2)
    async with app.open_async():
        await wake_parked_drive(app, workers, placement.run_id)
    return True


async def follow_drive(
    settings: Settings,
    run_id: str,
    task_name: str,
    out: TextIO = sys.stdout,
    *,
    wait_for_approval: bool = True,
    stop_requested: asyncio.Event | None = None,
) -> int:
    """Print the drive's progress until it ends (or parks, without ``wait_for_approval``);
    its exit status as ``turnstile autopilot``'s."""
    from engine.gates.service import Gates

    async with open_database(settings) as db:
        store = Gates(db, settings).store
        look = look_on_workers(db, run_id, silent_after=settings.worker_timeout)
        placed = await look()
        follower = RunFollower(
            db, run_id, look, task=task_name, since=placed.placement.created_at, poll=_POLL
        )
        last: tuple[str | None, str | None] = (None, None)
        async with (
            stop_once_asked(settings, db, run_id, stop_requested, out, "the drive"),
            contextlib.aclosing(follower.events()) as events,
        ):
            async for event in events:
                if isinstance(event, Looked):
                    placed = event.where
                task = await store.find(task_name)
                label = task.label if task is not None else None
                placement, note = placed.placement, placed.waiting
                if (label, note) != last:
                    where = f" on {placement.worker}" if placement.worker else ""
                    print(
                        f"{task_name}: {label or 'not started'}{where}"
                        + (f" · {note}" if note else ""),
                        file=out,
                        flush=True,
                    )
                    last = (label, note)
                if isinstance(event, RunEnded):
                    return _ended(task_name, event.record, placement, task, out)
                if placement.status is PlacementStatus.PARKED and not wait_for_approval:
                    print(f"{task_name}: parked at {label}", file=out, flush=True)
                    return EXIT_PARKED
    raise ConfigError(f"run {run_id} is not on the workers")  # (the follower ends only so)


def _ended(
    task_name: str,
    record: RunRecord,
    placement: Placement,
    task: TaskRecord | None,
    out: TextIO,
) -> int:
    if budget_stopped(placement, record):
        more = "--budget-tokens MORE" if placement.spec.budget_usd is None else "--budget MORE"
        label = task.label if task is not None else None
        print(
            f"{task_name}: {placement.note}; the drive stopped after the turn that "
            f"reached it, and the task stays at {label}. "
            f"`turnstile autopilot --task {task_name} {more}` goes on from there.",
            file=out,
            flush=True,
        )
        return EXIT_BUDGET
    return _exit_code(placement, task)


def _exit_code(placement: Placement, task: TaskRecord | None) -> int:
    if placement.status is PlacementStatus.STOPPED:
        return STOP_EXIT_CODE
    if task is not None and task.phase == COMPLETE:
        return 0
    return EXIT_HUMAN


@dataclass(frozen=True, slots=True)
class QueuedDrive:
    """What :func:`queue_drive` did: the drive on the workers, and whether it is new."""

    spec: QueuedRun
    new: bool


async def queue_drive(
    settings: Settings,
    db: AnyDatabase,
    task_name: str,
    *,
    init: bool,
    summary: str | None = None,
    project: str | None = None,
    tool: str | None = None,
    agent_cmd: str | None = None,
    chat: tuple[PlaceId, PlaceId | None] | None = None,
    budget: Budget | None = None,
) -> QueuedDrive | None:
    """Put a drive of ``task_name`` on the workers, or find the one there; None when the
    task is complete. ``budget`` travels with a new drive (one there keeps its own).

    ``project`` (a configured name, or a URL or path every worker reaches) is needed for a
    task the workers have not driven yet; ``init`` creates the task on its first step.

    Raises:
        ConfigError: an unknown agent, no such task (without ``init``), no project, a
            task that was not started on the workers, or a budget for a drive already
            there under another.
        GateRefused: an invalid task name.
    """
    from engine.agents.factory import AGENT_NAMES
    from engine.gates.names import check_task_name
    from engine.gates.service import Gates
    from engine.workers.control import (
        project_reference,
        start_on_workers,
        workers_project_problem,
    )
    from engine.workers.queue import require_postgres

    require_postgres(settings.database)
    check_task_name(task_name)
    task = await Gates(db, settings).store.find(task_name)
    current = (await drives_by_task(WorkerStore(db))).get(task_name)
    # A task goes on with the agent of its last drive unless told otherwise.
    tool = tool or (current.spec.tool if current is not None else settings.default_agent)
    if tool not in AGENT_NAMES:
        raise ConfigError(f"unknown agent {tool!r}: choose one of {', '.join(AGENT_NAMES)}")
    if task is not None and task.phase == COMPLETE:
        return None
    if current is not None and not current.ended:
        if budget is not None and budget != current.spec.budget:
            held = current.spec.budget
            raise ConfigError(
                f"task {task_name} is being driven on the workers (run {current.run_id}) "
                + (f"under a budget of {held.text()}" if held is not None else "without a budget")
                + "; a drive's budget is given when it starts: follow it without --budget, "
                "or stop it and drive it again under the new one"
            )
        return QueuedDrive(current.spec, new=False)  # already on the workers
    if task is None and not init:
        raise ConfigError(f"no task {task_name!r}: give --init --checkout-repo PROJECT")
    if current is not None:
        where = current.spec.project
    elif task is None and project is not None:
        problem = workers_project_problem(settings, project) if chat is not None else None
        if problem is not None:
            raise ConfigError(problem)
        where = project_reference(settings, project)
    elif task is None:
        raise ConfigError("on the workers a new task needs a project: give --checkout-repo")
    else:
        raise ConfigError(
            f"task {task_name} was not started on the workers; drive it without "
            "TURNSTILE_EXECUTION=workers"
        )
    same_tool = current is not None and tool == current.spec.tool
    spec = new_drive_spec(
        task=task_name,
        summary=summary or (task.summary if task is not None else None) or task_name,
        tool=tool,
        project=where,
        agent_cmd=agent_cmd
        or (current.spec.agent_cmd if current is not None and same_tool else None)
        or (settings.agent_command if tool == "command" else None),
        chat=chat,
        budget=budget,
    )
    await start_on_workers(settings, spec)
    return QueuedDrive(spec, new=True)


async def gate_requests(
    settings: Settings, db: AnyDatabase, *, chat_only: bool = True
) -> list[tuple[GateRequest, QueuedRun]]:
    """The open gates of the drives parked on the workers (of those started from a chat,
    by default), as the in-process drive announces them, each with its drive (whose chat
    a wave's sub-task shares with its parent): the excerpt from the artifact's content in
    the database (the worker stored it when the gate opened)."""
    from engine.gates.service import Gates

    store = Gates(db, settings).store
    found: list[tuple[GateRequest, QueuedRun]] = []
    for placement in (await drives_by_task(WorkerStore(db))).values():
        if placement.status is not PlacementStatus.PARKED or placement.spec.task is None:
            continue
        if chat_only and placement.spec.chat_id is None:
            continue
        task = await store.find(placement.spec.task)
        if task is None or not task.awaiting_approval or task.gate_sha256 is None:
            continue
        approvers = {a.approver for a in await store.gate_approvals(task)}
        if len(approvers) >= store.policy.quorum:
            continue  # approved: the drive passes the gate at its next step (not a new gate)
        spec = store.workflow.phase(task.phase)
        request = GateRequest(
            task=task.name,
            phase=spec.name,
            artifact_name=spec.artifact,
            artifact_path=task.folder / spec.artifact,
            sha256=task.gate_sha256,
            excerpt=await store.excerpt(task.gate_sha256, 1500),
            run_id=placement.run_id,
        )
        found.append((request, placement.spec))
    return found


async def drive_on_workers(args: argparse.Namespace, settings: Settings) -> int:
    """``turnstile autopilot`` with ``TURNSTILE_EXECUTION=workers``: put the drive on the
    workers (or find the one there), then follow it unless ``--detach``. ``--budget`` /
    ``--budget-tokens`` travel with a new drive (checked against its agent before)."""
    if args.folder is not None or args.workdir is not None:
        raise ConfigError(
            "on the workers a task works in a worktree of its project (--checkout-repo); "
            "--folder and --workdir are for drives in this process"
        )
    budget = Budget.given(args.budget, args.budget_tokens)
    async with open_database(settings) as db:
        queued = await queue_drive(
            settings,
            db,
            args.task,
            init=args.init,
            summary=args.summary,
            project=args.checkout_repo,
            tool=args.tool,
            agent_cmd=args.agent_cmd,
            budget=budget,
        )
    if queued is None:
        print(f"{args.task}: complete", flush=True)
        return 0
    spec = queued.spec
    if args.detach:
        print(spec.run_id, flush=True)
        return 0
    print(f"Autopilot {args.task} · run {spec.run_id} · {spec.tool} · on the workers", flush=True)
    if spec.budget is not None:
        print(
            f"{args.task}: the drive may spend {spec.budget.text()}; it stops after the turn "
            "that reaches that",
            flush=True,
        )
    print("Ctrl-C stops the drive.", flush=True)
    with stop_on_signals() as stop:
        return await follow_drive(
            settings,
            spec.run_id,
            args.task,
            sys.stdout,
            wait_for_approval=not args.no_wait,
            stop_requested=stop,
        )
