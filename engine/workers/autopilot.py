"""Autopilot drives on the workers: one job per phase step, waves as their own job chains.

A drive on the workers is a placement of mode ``autopilot`` naming its task. Each job runs
one step of the drive (a phase's agent turn and its checks, or passing an approved gate)
in the worktree this worker holds for the drive, then commits the task's folder, pushes
the run branch and, while the drive goes on, queues its next step on this worker's queue.
A step that reaches an approval gate parks the drive: no job waits. The worker holding a
parked drive looks at its gate on every heartbeat and queues the next step once the gate
is approved or rejected, whichever front end recorded it.

A wave's sub-tasks are placements of their own, queued on their agent's queue so that
whichever workers are free take them; each one's worktree is cut from the parent's pushed
branch and its own branch is pushed to the runs remote. The drive parks until the wave is
done (the last sub-task to end wakes it), then its worker fetches the sub-tasks' branches
and merges them into the drive's branch (``--no-ff``), as the in-process drive does with
local worktrees.

A drive given a budget carries it in its placement, and so do its sub-tasks'. Each step
counts what the drive has spent so far (its own turns and its sub-tasks', read from the
store) after its turn, as the in-process drive does after each of its turns: at 80 % the
drive says so once; once over, no other step starts. Sub-tasks in a step end it first
(their spend counts), those at their gate stop at once, and the drive ends saying what was
spent of what.

The task's folder lives in the drive's worktree (``.turnstile/tasks/NAME`` for a task
created on the workers) and is committed after every step, so another worker can go on
from the pushed branch: each step points the task's recorded folder and workdir at this
worker's worktree first.

Long: one step driver with its wave handling (cut, wake, merge back) and its budget (a
wave's sub-tasks count in it and end with it); both work in the step's worktree and commit
and push it the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final

from engine.agents.factory import create_agent
from engine.automode.channel import STOP_EXIT_CODE, STOPPED_BY_PERSON
from engine.automode.summary import WorkSummaryGenerator
from engine.errors import ConfigError, TurnstileError
from engine.gates.autopilot import Autopilot, DriveOutcome, wave_started
from engine.gates.budget import DriveBudget
from engine.gates.records import TaskRecord
from engine.gates.state_file import STATE_FILE
from engine.gates.store import SqlGateStore
from engine.gates.tasks import TaskStore
from engine.gates.workflow import COMPLETE, HUMAN_INTERVENTION
from engine.gates.worktrees import short_name
from engine.git import GitRunner
from engine.runs import RunMode, new_run_id
from engine.sink import LogSink, TextKind, publish
from engine.spend import Spend
from engine.store.runs import RunRecord, RunStatus, SqliteRunStore, TurnState
from engine.turn import AgentSession, TurnOutput
from engine.workers.host import (
    Checkout,
    Next,
    PrimedSession,
    RunHost,
    record_stopped,
    stop_watch,
)
from engine.workers.queue import agent_queue, defer_turn, worker_queue
from engine.workers.store import Placement, PlacementStatus, QueuedRun, WorkerStore
from engine.workspace.manager import BranchPush, run_branch
from engine.workspace.projects import redact_url

if TYPE_CHECKING:
    import procrastinate

    from engine.settings import Settings

__all__ = [
    "AUTOPILOT",
    "EXIT_BUDGET",
    "EXIT_HUMAN",
    "EXIT_PARKED",
    "TASKS_DIR",
    "DriveSteps",
    "budget_stopped",
    "drive_ready",
    "drive_spend",
    "drives_by_task",
    "wake_parked",
    "wake_parked_drive",
]

_LOGGER = logging.getLogger(__name__)


AUTOPILOT: Final = "autopilot"
#: Where a task created on the workers keeps its folder, inside the drive's worktree.
TASKS_DIR: Final = Path(".turnstile") / "tasks"
_MERGED: Final = "wave_merged"

EXIT_PARKED: Final = 3
EXIT_HUMAN: Final = 4
EXIT_BUDGET: Final = 5


# -- the worker's side ---------------------------------------------------------------------


class _StepPilot(Autopilot):
    """The in-process driver, run one step a job (:meth:`Autopilot.step`); a wave's
    sub-tasks are queued as drives of their own."""

    def __init__(
        self,
        store: TaskStore,
        settings: Settings,
        *,
        placement: Placement,
        app: procrastinate.App,
        workers: WorkerStore,
        checkout: Checkout,
        env: Mapping[str, str],
        primer: str | None = None,
    ) -> None:
        spec = placement.spec
        super().__init__(
            store,
            settings,
            LogSink(),
            tool=spec.tool,
            agent_cmd=spec.agent_cmd,
            wait_for_approval=False,
            agent_factory=self._make_agent,
            chat=(spec.chat_id, spec.thread_id) if spec.chat_id is not None else None,
            budget=spec.budget,
        )
        self.placement = placement
        # The drive whose budget this step counts in (a sub-task's is its parent's).
        self.budget_run = spec.parent_run or placement.run_id
        self.spends = SqliteRunStore(store.db)
        self.app = app
        self.workers = workers
        self.checkout = checkout
        self.env = env
        self.waiting_for: list[str] = []
        self.primer = primer

    def _make_agent(self, task: TaskRecord, session_id: str, resume: bool) -> AgentSession:
        agent = create_agent(
            self.tool,
            self.settings,
            cwd=task.workdir,
            session_id=session_id,
            agent_cmd=self.agent_cmd,
            resume=resume,
            extra_env=self.env,
        )
        if self.primer is None:
            return agent
        return PrimedSession(agent, self.primer)

    def run_id(self, name: str) -> str:
        return self.placement.run_id if name == self.placement.spec.task else super().run_id(name)

    async def _open_run(self, task: TaskRecord, parent: str | None = None) -> str:
        # The drive's run has the placement's id; placing it wrote its row (with its
        # task's agent session), which its first step fills in.
        run_id = self.placement.run_id
        record = await self.runs.get_run(run_id)
        if record.workdir is None:
            await self.runs.start_placed(
                run_id, workdir=str(task.workdir), phase=task.phase, objective=task.summary
            )
        else:
            await self.runs.update_run(
                run_id,
                status=RunStatus.RUNNING,
                phase=task.phase,
                workdir=str(task.workdir),
                finished_at=None,
            )
        self._run_ids[task.name] = run_id
        self._run_phases[run_id] = task.phase
        return run_id

    async def _close_run(self, run_id: str, name: str, status: RunStatus) -> None:
        if self.waiting_for:
            status = RunStatus.RUNNING  # the drive goes on once its sub-tasks end
        await super()._close_run(run_id, name, status)

    async def count_from_store(self) -> None:
        """What the drive spent before this step (its earlier steps, its sub-tasks)."""
        if self.budget is not None:
            spent = await drive_spend(self.workers, self.spends, self.budget_run)
            self.budget = DriveBudget(self.budget.budget, spent=spent)

    async def _count_spend(self, task: TaskRecord, out: TurnOutput) -> str | None:
        # The store has this turn now, and the other sub-tasks' turns that ended meanwhile.
        assert self.budget is not None
        note = self.budget.reached(await drive_spend(self.workers, self.spends, self.budget_run))
        if note is not None and self.placement.spec.parent_run is not None:
            # Said for the whole drive, under its run: where the drive's followers read.
            await publish(
                self.sink, self.budget_run, f"[{task.parent or task.name}] {note}", TextKind.NOTE
            )
            return None
        return note

    async def _budget_stop(self, task: TaskRecord) -> DriveOutcome:
        if self.placement.spec.parent_run is not None:
            await self._status(task, "stopped", "budget spent")
            return DriveOutcome.STOPPED_BY_BUDGET  # (its parent's drive says it)
        # Its sub-tasks in a step end it first (their spend counts: the last one wakes this
        # drive); one waiting at its gate stops now, its gate left open.
        busy = []
        for child in await self.workers.placements():
            if child.spec.parent_run != self.placement.run_id or child.ended:
                continue
            if child.status is PlacementStatus.PARKED:
                await _record_budget_stopped(self.spends, child.run_id)
                await self.workers.let_go(child.run_id, "stopped: the drive's budget is spent")
            else:
                busy.append(child.spec.task or child.run_id)
        if busy:
            self.waiting_for = busy
            return DriveOutcome.PARKED
        return await super()._budget_stop(task)

    async def _work_summary(self, task: TaskRecord) -> WorkSummaryGenerator | None:
        # The drive's worktree here, from where its branch started (the project's commit
        # it was cut from: a worktree made again after a move is cut from a newer one).
        checkout = self.checkout
        base = checkout.workspace.base
        found = await GitRunner().run(["merge-base", "HEAD", base], cwd=checkout.path, check=False)
        return WorkSummaryGenerator(
            checkout.path,
            base_commit=found.stdout.strip() if found.ok else base,
            push=functools.partial(self._push_branch, task),
        )

    async def _push_branch(self, task: TaskRecord) -> BranchPush:
        """The drive's branch, pushed to the runs remote with the task's folder (as the step
        pushes it at its end)."""
        checkout = self.checkout
        shown = checkout.manager.redact(redact_url(checkout.remote))
        try:
            await _commit(checkout, await self.store.get(task.name))
            await checkout.push()
        except TurnstileError as exc:
            return BranchPush(checkout.branch, to=shown, problem=checkout.manager.redact(str(exc)))
        return BranchPush(checkout.branch, to=shown)

    async def _waves(self, task: TaskRecord) -> DriveOutcome | None:
        wf = self.store.workflow
        if task.parent is not None or wf.decomposition is None:
            return None
        if not wf.has(task.phase) or wf.index(task.phase) <= wf.index(wf.decomposition):
            return None
        # The drives first: a sub-task's drive ends after its last move is recorded and
        # its branch pushed, so a drive read as ended has its task read as finished below.
        drives = await drives_by_task(self.workers)
        subs = await self.store.subtasks(task.name)
        if not subs:
            return None
        merged = {
            str(e.detail)
            for e in await self.store.audit_events(task.name, limit=5000)
            if e.event == _MERGED
        }
        for wave in sorted({s.wave or 1 for s in subs}):
            members = [s for s in subs if (s.wave or 1) == wave]
            # Finished is not enough: until its drive ends, its branch may not be pushed.
            pending = [
                s
                for s in members
                if not s.finished or (s.name in drives and not drives[s.name].ended)
            ]
            if pending:
                return await self._queue_wave(task, wave, pending, drives)
            if str(wave) in merged:
                continue
            problems = await self._merge_wave(task, members, drives)
            if problems:
                listed = "; ".join(f"{k}: {v}" for k, v in problems.items())
                return await self._to_human(task, f"wave {wave} did not merge: {listed}")
            await self.store.record_audit(_MERGED, "merged", task=task.name, detail=str(wave))
            await self._say(task, f"[{task.name}] wave {wave} merged into the task's branch")
        stuck = [s for s in subs if s.phase == HUMAN_INTERVENTION]
        if stuck and not await self._resumed_since(task, max(s.updated_at for s in stuck)):
            names = ", ".join(s.name for s in stuck)
            return await self._to_human(task, f"sub-tasks need a person: {names}")
        return None

    async def _queue_wave(
        self,
        task: TaskRecord,
        wave: int,
        pending: list[TaskRecord],
        drives: Mapping[str, Placement],
    ) -> DriveOutcome:
        ended = [(s, drives[s.name]) for s in pending if s.name in drives and drives[s.name].ended]
        if ended:
            listed = "; ".join(f"{s.name}: {p.note or p.status.value}" for s, p in ended)
            return await self._to_human(task, f"sub-tasks of wave {wave} did not finish: {listed}")
        # At most TURNSTILE_WAVE_CONCURRENCY at once, as in-process: the next ones are
        # queued as those running end (each end wakes this drive).
        running = sum(1 for s in pending if s.name in drives)
        room = max(0, self.settings.wave_concurrency - running)
        fresh = [s for s in pending if s.name not in drives][:room]
        parent = self.placement
        specs = []
        for sub in fresh:
            spec = QueuedRun(
                run_id=new_run_id(RunMode.AUTOPILOT),
                objective=sub.summary or sub.name,
                tool=parent.spec.tool,
                project=parent.spec.project,
                agent_cmd=parent.spec.agent_cmd,
                chat_id=parent.spec.chat_id,
                thread_id=parent.spec.thread_id,
                mode=AUTOPILOT,
                task=sub.name,
                base_run=parent.run_id,
                parent_run=parent.run_id,
                budget_usd=parent.spec.budget_usd,
                budget_tokens=parent.spec.budget_tokens,
            )
            await self.workers.place(spec)
            specs.append(spec)
        if fresh and running == 0:
            # Said once, as the wave starts, in the words of a drive in one process; before
            # any of its sub-tasks can start (their jobs are queued next), so that what
            # follows the drive reads it before their first turns.
            names = [s.name for s in pending]
            await self._say(task, wave_started(task.name, wave, names, self.settings))
        for spec in specs:
            # Any free worker with the agent takes it: the wave runs in parallel.
            await defer_turn(self.app, spec.run_id, queue=agent_queue(spec.tool))
        self.waiting_for = [s.name for s in pending]
        return DriveOutcome.PARKED

    async def _merge_wave(
        self, task: TaskRecord, members: list[TaskRecord], drives: Mapping[str, Placement]
    ) -> dict[str, str]:
        problems: dict[str, str] = {}
        checkout = self.checkout
        for sub in members:
            if sub.phase != COMPLETE or sub.name not in drives:
                continue
            branch = run_branch(drives[sub.name].run_id)
            problem = await checkout.manager.merge_pushed(
                checkout.path,
                checkout.remote,
                branch,
                message=f"turnstile: merge sub-task {short_name(sub)} into {checkout.branch}",
            )
            if problem is not None:
                problems[sub.name] = problem
        return problems


def moved_primer(task: TaskRecord, run_id: str, worker: str) -> str:
    """What the agent is told first in the new session of a drive that changed machines."""
    return (
        "Note before this turn: this drive moved to another machine (worker "
        f"{worker}) because the one it ran on stopped answering. Your earlier conversation "
        "was kept on that machine and is gone, so this is a new session. The working tree "
        f"is the branch {run_branch(run_id)} as it was pushed after the last finished "
        "step; anything not committed by then is not in it, and the task's earlier "
        f"artifacts are in {task.folder}. Task {task.name} is at {task.label}"
        + (f"; its summary: {task.summary}" if task.summary else "")
        + ".\n\n---\n\n"
    )


async def _interrupt_cut_off(runs: SqliteRunStore, run_id: str) -> None:
    """The turns a lost worker was running are on record as interrupted."""
    for turn in await runs.turns(run_id):
        if turn.state is TurnState.STARTED:
            await runs.fail_turn(
                turn.id, TurnState.INTERRUPTED, "the worker running it stopped answering"
            )


async def drives_by_task(workers: WorkerStore) -> dict[str, Placement]:
    """The latest drive on the workers of each task."""
    out: dict[str, Placement] = {}
    for placement in sorted(await workers.placements(), key=lambda p: p.created_at):
        if placement.spec.mode == AUTOPILOT and placement.spec.task is not None:
            out[placement.spec.task] = placement
    return out


async def drive_spend(workers: WorkerStore, runs: SqliteRunStore, run_id: str) -> Spend:
    """What the drive ``run_id`` on the workers has spent so far: its own turns and its
    sub-tasks' (a drive counts afresh from its start: each drive is a run of its own)."""
    ids = [run_id] + [p.run_id for p in await workers.placements() if p.spec.parent_run == run_id]
    spent = Spend()
    for spend in (await runs.spend_of(ids)).values():
        spent += spend
    return spent


def budget_stopped(placement: Placement, record: RunRecord | None) -> bool:
    """Whether the drive's budget ended it: its run stopped with no stop's exit status (a
    person's stop has it); the placement's note says what was spent."""
    return (
        placement.ended
        and record is not None
        and record.status is RunStatus.STOPPED
        and record.exit_code != STOP_EXIT_CODE
    )


async def _locate(store: TaskStore, spec: QueuedRun, worktree: Path) -> TaskRecord:
    """The drive's task, pointed at its folder in this worker's worktree (created here on
    the drive's first step when the workers started it)."""
    assert spec.task is not None
    task = await store.find(spec.task)
    if task is None:
        return await store.init_task(
            spec.task,
            folder=worktree / TASKS_DIR / spec.task,
            workdir=worktree,
            summary=spec.objective,
        )
    folder = (
        worktree / task.folder.relative_to(task.workdir)
        if task.folder.is_relative_to(task.workdir)
        else worktree / TASKS_DIR / task.name
    )
    moved = (folder, worktree) != (task.folder, task.workdir)
    if moved:
        gate_store = store.gate_store
        assert isinstance(gate_store, SqlGateStore)
        await gate_store.set_location(task.name, folder, worktree)
        folder.mkdir(parents=True, exist_ok=True)
    task = await store.get(spec.task)
    if moved or not (folder / STATE_FILE).exists():
        # The mirror as the store has it (the branch may predate the last transition).
        await store.folders.write_mirror(task, await store.gate_approvals(task))
    return task


async def _commit(checkout: Checkout, task: TaskRecord) -> None:
    """Commit the task's folder (its artifacts and ``.state``) on the run branch."""
    worktree = checkout.path
    if not task.folder.is_relative_to(worktree):
        return
    git = GitRunner()
    await git.run(["add", "-A", "--", str(task.folder.relative_to(worktree))], cwd=worktree)
    staged = await git.run(["diff", "--cached", "--quiet"], cwd=worktree, check=False)
    if staged.exit_code != 0:
        identity = await checkout.manager.identity_args(worktree)
        message = f"turnstile: {task.name} at {task.label}"
        await git.run([*identity, "commit", "--no-verify", "-q", "-m", message], cwd=worktree)


class DriveSteps:
    """One phase step of an autopilot drive a step (a phase's agent turn and its checks,
    or passing an approved gate); a drive at its gate or waiting for its wave parks."""

    after_outage: Final = Next.CONTINUE

    async def step(
        self, host: RunHost, placement: Placement, *, moved: bool, stop: asyncio.Event
    ) -> Next:
        spec = placement.spec
        run_id = placement.run_id
        workers = WorkerStore(host.db)
        if spec.task is None:
            raise ConfigError(f"run {run_id} is an autopilot drive without a task")
        if stop.is_set():
            await _end(host, placement, STOPPED_BY_PERSON, stopped=True)
            return Next.DONE
        from engine.gates.service import Gates

        gates = Gates(host.db, host.settings)
        runs = SqliteRunStore(host.db)
        checkout = await host.checkout(run_id, spec.project)
        first = (await runs.get_run(run_id)).workdir is None  # its row as placing wrote it
        async with checkout.locked():
            if first and spec.base_run is not None:
                if not await checkout.adopt(run_branch(spec.base_run)):
                    raise ConfigError(f"the branch of run {spec.base_run} could not be fetched")
            elif moved:
                await checkout.adopt()
                # The agent's conversation was on the lost worker's disk: a new session.
                await gates.store.save_session(spec.task, spec.tool, str(uuid.uuid4()), False)
                await _interrupt_cut_off(runs, run_id)
            task = await _locate(gates.store, spec, checkout.path)
            pilot = _StepPilot(
                gates.store,
                host.settings,
                placement=placement,
                app=host.app,
                workers=workers,
                checkout=checkout,
                env=host.env,
                primer=moved_primer(task, run_id, host.name) if moved else None,
            )
            await pilot.count_from_store()
            async with stop_watch(host.db, run_id, stop):
                outcome, stopped = await _drive_one(pilot, spec.task, run_id, stop, first)
            task = await gates.store.get(spec.task)
            await _commit(checkout, task)
            await checkout.push()
        if stopped:
            await _end(host, placement, STOPPED_BY_PERSON, stopped=True)
            return Next.DONE
        if outcome is DriveOutcome.STOPPED_BY_BUDGET:
            assert pilot.budget is not None
            # (Its run is recorded stopped: see budget_stopped.)
            await _end(host, placement, pilot.budget.stopped_text())
            return Next.DONE
        if outcome is None:
            return Next.CONTINUE
        if outcome is DriveOutcome.PARKED:
            note = (
                f"waiting for its sub-tasks: {', '.join(pilot.waiting_for)}"
                if pilot.waiting_for
                else f"waiting for approval at {task.label}"
            )
            await workers.park(run_id, note)
            if pilot.waiting_for:
                # A sub-task that ended while this step ran found the drive not parked yet
                # and woke nobody: look again now that it is.
                parked = await workers.placement(run_id)
                if parked is not None and await drive_ready(gates.store, workers, parked):
                    await wake_parked_drive(host.app, workers, run_id)
            return Next.PARK
        note = "complete" if outcome is DriveOutcome.COMPLETE else f"needs a person at {task.label}"
        await _end(host, placement, note)
        return Next.DONE


async def _drive_one(
    pilot: _StepPilot,
    name: str,
    run_id: str,
    stop: asyncio.Event,
    first: bool,
) -> tuple[DriveOutcome | None, bool]:
    """Run one step; (its outcome, None while the drive goes on; whether a person
    stopped it)."""
    drive = asyncio.create_task(pilot.step(name, audit_at_start=first), name=f"step-{run_id}")
    stopped = asyncio.create_task(stop.wait(), name=f"stopped-{run_id}")
    try:
        await asyncio.wait({drive, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if drive.done():
            return drive.result(), False
        pilot.cancelled_as = RunStatus.STOPPED
        drive.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await drive
        return None, True
    except asyncio.CancelledError:
        # The worker is going down: the step is cut off and re-run elsewhere.
        pilot.cancelled_as = RunStatus.RUNNING
        drive.cancel()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.shield(drive)
        raise
    finally:
        stopped.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stopped


async def _end(host: RunHost, placement: Placement, note: str, *, stopped: bool = False) -> None:
    """The drive has ended here (``stopped``: by a person); a wave's sub-task wakes its
    parent's drive."""
    run_id = placement.run_id
    if stopped:
        await record_stopped(SqliteRunStore(host.db), run_id)
    await host.end(run_id, note)
    parent = placement.spec.parent_run
    if parent is not None:
        await wake_parked_drive(host.app, WorkerStore(host.db), parent)


async def _record_budget_stopped(runs: SqliteRunStore, run_id: str) -> None:
    """A sub-task at its gate ends with its drive's budget: stopped, as the drive it is in
    (no exit status: a person did not stop it)."""
    record = await runs.get_run(run_id)
    if record.status in (RunStatus.RUNNING, RunStatus.PARKED):
        await runs.update_run(run_id, status=RunStatus.STOPPED, finished_at=time.time())


async def wake_parked_drive(app: procrastinate.App, workers: WorkerStore, run_id: str) -> None:
    placement = await workers.placement(run_id)
    if placement is None or placement.status is not PlacementStatus.PARKED:
        return  # still in its step (its holder's heartbeat wakes it once parked) or ended
    queue = (
        worker_queue(placement.worker)
        if placement.worker is not None
        else agent_queue(placement.spec.tool)
    )
    await defer_turn(app, run_id, queue=queue)


async def drive_ready(store: TaskStore, workers: WorkerStore, placement: Placement) -> bool:
    """Whether a parked drive can take its next step: its gate was decided, or the wave it
    waits for is done."""
    if placement.spec.task is None:
        return False
    task = await store.find(placement.spec.task)
    if task is None:
        return False
    if task.awaiting_approval:
        approvers = {a.approver for a in await store.gate_approvals(task)}
        return len(approvers) >= store.policy.quorum
    # A sub-task is done when its drive has ended (its branch pushed), not when its
    # task is finished: the push comes after the last move.
    drives = await drives_by_task(workers)
    return not any(
        s.name in drives and not drives[s.name].ended for s in await store.subtasks(task.name)
    )


async def wake_parked(runner: RunHost) -> int:
    """Queue the next step of each drive parked here that can go on; how many."""
    workers = WorkerStore(runner.db)
    parked = [
        p
        for p in await workers.runs_of(runner.name)
        if p.status is PlacementStatus.PARKED and p.spec.mode == AUTOPILOT
    ]
    if not parked:
        return 0
    from engine.gates.service import Gates

    store = Gates(runner.db, runner.settings).store
    woken = 0
    for placement in parked:
        if not await drive_ready(store, workers, placement):
            continue
        if await defer_turn(runner.app, placement.run_id, queue=runner.queue) is not None:
            woken += 1
            _LOGGER.info("drive %s goes on", placement.run_id)
    return woken
