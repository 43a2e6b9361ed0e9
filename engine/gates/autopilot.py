"""The autopilot driver: the seed's gate-check loop, in code.

For each phase: read the state from the store → validate the folder (violations: report,
move to human_intervention, stop) → render the phase prompt → run it on the task's one
resumed agent session → check the artifact and the folder (problems: one revision turn,
then human_intervention) → an approval phase moves to ``PHASE:awaiting_approval`` and
parks; otherwise transition to the next phase.

A parked driver notices approvals made by any front end: in-process callers wake it
through :meth:`TaskStore.add_listener`; other processes (``turnstile status --approve``)
are noticed by polling the task's version every ``poll_interval`` seconds (one indexed
row read). With ``wait_for_approval=False`` the driver returns ``PARKED`` instead and a
later drive resumes from the store.

A drive given a budget (:mod:`engine.gates.budget`) counts what its turns spent, its
sub-tasks' too; once a turn ends over it, the drive starts no other turn, phase or
sub-task and ends ``STOPPED_BY_BUDGET``, the task keeping its phase.

Long: one driver, a loop over its step (which the workers run one a job), with its
revision and sub-task waves; its phases share the drive's state and lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Final

from engine.agents.factory import create_agent, probe_turn_mode
from engine.agents.warm import close_agent
from engine.errors import ConfigError, TurnstileError
from engine.gates.audit import AuditReport, run_audit
from engine.gates.budget import DriveBudget
from engine.gates.folder import list_artifacts
from engine.gates.gitwatch import fingerprint
from engine.gates.prompts import render_phase_prompt, render_revision_prompt
from engine.gates.records import TaskRecord
from engine.gates.refusals import GateRefused, Refusal
from engine.gates.tasks import TaskStore
from engine.gates.workflow import (
    AWAITING_APPROVAL,
    COMPLETE,
    HUMAN_INTERVENTION,
    PhaseSpec,
)
from engine.gates.worktrees import WaveWorkspaces
from engine.humane import exit_note, words
from engine.locks import Lock
from engine.runs import ChatPlace, PlaceId, RunMode, RunSupervisor
from engine.settings import Settings
from engine.sink import GateRequest, RunSink, StatusUpdate, TextKind, publish, recording
from engine.spend import Budget
from engine.store.leases import database_lock
from engine.store.runs import RunStatus, RunStore, SqliteRunStore, TurnState
from engine.turn import AgentSession, TurnOutput

if TYPE_CHECKING:
    from engine.automode.summary import WorkSummaryGenerator

__all__ = [
    "AgentFactory",
    "Autopilot",
    "DriveHandle",
    "DriveOutcome",
    "drive_alive",
    "next_step",
    "turn_finished",
    "wave_started",
]

_LOGGER = logging.getLogger(__name__)
MAX_PUBLISH = 3500
EXCERPT = 1500

#: Builds the agent session of a task: ``(task, session_id, resume) -> AgentSession``.
AgentFactory = Callable[[TaskRecord, str, bool], AgentSession]


def turn_finished(
    task: str, phase: str, kind: str, output: str, exit_code: int | None, stderr_tail: str
) -> tuple[str, str]:
    """What a drive says of a turn of ``task`` that ended (``kind``: ``phase`` or
    ``revision``), wherever it ran: its message and its output (why it failed first, as a
    chat turn's)."""
    text = output.strip() or "(no output)"
    code = "" if exit_code in (0, None) else f" (exit code {exit_code})"
    failed = exit_note(exit_code, stderr_tail)
    text = f"{failed}\n\n{text}" if failed else text
    return f"[{task} · {words(phase)}] {kind} turn finished{code}:\n{text}", text


class DriveOutcome(StrEnum):
    COMPLETE = "complete"
    HUMAN_INTERVENTION = "human_intervention"
    PARKED = "parked"
    """Waiting at an approval gate and told not to wait (the process may exit)."""
    STOPPED_BY_BUDGET = "stopped_by_budget"
    """A turn ended over the drive's budget: no other one started (the task keeps its phase)."""


#: How a drive's run is recorded when the drive ends with this outcome.
_RUN_STATUS: Final = {
    DriveOutcome.COMPLETE: RunStatus.COMPLETED,
    DriveOutcome.HUMAN_INTERVENTION: RunStatus.PARKED,
    DriveOutcome.PARKED: RunStatus.PARKED,
    DriveOutcome.STOPPED_BY_BUDGET: RunStatus.STOPPED,
}


@dataclass
class DriveHandle:
    """A running drive: await :meth:`wait` for its outcome, :meth:`stop` to cancel it.

    Stopping cancels the in-flight agent turn (its process group is terminated); the task
    keeps its recorded phase and a later drive resumes it.
    """

    task: str
    future: asyncio.Task[DriveOutcome]
    pilot: Autopilot | None = None

    @property
    def done(self) -> bool:
        return self.future.done()

    async def wait(self) -> DriveOutcome:
        return await self.future

    async def stop(self, *, park: bool = False) -> None:
        """Cancel the drive; its run is recorded stopped, or parked (resumed on restart)."""
        if self.pilot is not None:
            self.pilot.cancelled_as = RunStatus.PARKED if park else RunStatus.STOPPED
        if not self.future.done():
            self.future.cancel()
        try:
            await self.future
        except asyncio.CancelledError:
            pass
        except Exception:
            _LOGGER.debug("drive of %s ended with an error while stopping", self.task)


def next_step(store: TaskStore, task: TaskRecord, approvals: int) -> str:
    """What a person does next in manual mode (pure text)."""
    wf = store.workflow
    cmd = f"turnstile status --task {task.name}"
    if task.phase == COMPLETE:
        return "the task is complete"
    if task.phase == HUMAN_INTERVENTION:
        back = task.return_phase or wf.first
        return f"resolve the problem, then `{cmd} --transition {back}` (or an earlier phase)"
    if not wf.has(task.phase):
        return f"the workflow has no phase {task.phase!r}: `{cmd} --transition human_intervention`"
    spec = wf.phase(task.phase)
    if task.awaiting_approval:
        if approvals >= store.policy.quorum:
            return f"approved: `{cmd} --transition {spec.next}`"
        return (
            f"review {spec.artifact} (sha256 {str(task.gate_sha256)[:12]}), then "
            f"`{cmd} --approve --by USER_ID` or `{cmd} --reject --by USER_ID --reason TEXT` "
            f"({approvals} of {store.policy.quorum} approvals)"
        )
    nxt = f"{task.phase}:{AWAITING_APPROVAL}" if spec.approval else spec.next
    notes = " (address the revision notes)" if task.revision_notes else ""
    return (
        f"run the {spec.name} phase as {spec.persona}: write {spec.artifact} in {task.folder}"
        f"{notes}; then `{cmd} --transition {nxt}`"
    )


class Autopilot:
    """Drives gated tasks through their phases.

    Args:
        store: the task store.
        settings: agent and wave settings.
        sink: where reports and gate requests go.
        tool: the agent (claude, copilot, codex, command).
        agent_cmd: the command agent's template.
        wait_for_approval: wait at gates (polling) instead of returning ``PARKED``.
        poll_interval: seconds between store polls while parked.
        agent_factory: builds a task's agent session (default: :func:`create_agent`).
        worktrees: git worktrees of tasks checked out from a project (hold while driving,
            one per wave sub-task, merge a wave back); None: tasks work where they are.
        runs: where each drive (and each sub-task's) is recorded as a run with its turns
            (default: the runs store of the task store's database).
        chat: the chat (id, topic) the drive reports to, recorded with its runs.
        supervisor: opens each run and runs its turns (turn slots, parking at shutdown;
            default: one of its own over ``runs``).
        budget: what the drive's turns may spend, its sub-tasks' included (None: no cap).
    """

    def __init__(
        self,
        store: TaskStore,
        settings: Settings,
        sink: RunSink,
        *,
        tool: str,
        agent_cmd: str | None = None,
        wait_for_approval: bool = True,
        poll_interval: float = 1.0,
        agent_factory: AgentFactory | None = None,
        worktrees: WaveWorkspaces | None = None,
        runs: RunStore | None = None,
        chat: tuple[PlaceId, PlaceId | None] | None = None,
        supervisor: RunSupervisor | None = None,
        budget: Budget | None = None,
        run_id: str | None = None,
    ) -> None:
        self.store = store
        # The id of the run of the task this drive is started for, when its caller chose it
        # (the parked run it resumes, or a new one's): its reports are known by it at once.
        self._reserved = run_id
        #: Set once the drive's own run is open (recorded running).
        self.opened = asyncio.Event()
        self.budget = DriveBudget(budget) if budget is not None else None
        self._root: str | None = None  # the task this drive was started for
        self.worktrees = worktrees
        self.runs: RunStore = runs if runs is not None else SqliteRunStore(store.db)
        self.supervisor = supervisor if supervisor is not None else RunSupervisor(self.runs)
        self.chat = chat
        self.cancelled_as = RunStatus.STOPPED
        self._run_ids: dict[str, str] = {}
        self._parent_runs: dict[str, str] = {}  # a wave's sub-task → its parent's run
        self._run_phases: dict[str, str] = {}  # the phase each run was last recorded in
        self.settings = settings
        self.sink = recording(sink, store.db, self._owner)
        self.tool = tool
        self.agent_cmd = agent_cmd
        self.wait_for_approval = wait_for_approval
        self.poll_interval = poll_interval
        self._factory = agent_factory or self._default_factory
        self._agents: dict[str, AgentSession] = {}
        self._events: dict[str, asyncio.Event] = {}
        self._announced: set[tuple[str, int, str]] = set()
        self.turns = 0

    # -- plumbing --------------------------------------------------------------------------

    def _default_factory(self, task: TaskRecord, session_id: str, resume: bool) -> AgentSession:
        return create_agent(
            self.tool,
            self.settings,
            cwd=task.workdir,
            session_id=session_id,
            agent_cmd=self.agent_cmd,
            resume=resume,
            warm_pool=self.supervisor.warm_pool,
        )

    def _on_change(self, name: str) -> None:
        event = self._events.get(name)
        if event is not None:
            event.set()

    def run_id(self, name: str) -> str:
        """The run the texts and status of task ``name`` are said under: its drive's run
        (a task with none open, as one the audit names: the run of this drive's task)."""
        run_id = self._run_ids.get(name) or self._run_ids.get(self._root or "")
        if run_id is None:
            raise RuntimeError(f"task {name}: no run of this drive is open")
        return run_id

    def run_of(self, name: str) -> str | None:
        """The run id of the drive of task ``name`` (None: none opened yet)."""
        return self._run_ids.get(name)

    def warm(self, name: str) -> bool:
        """Whether ``name``'s agent process stays resident between its turns now."""
        agent: object = self._agents.get(name)
        agent = getattr(agent, "agent", agent)  # through the run's session wrapper
        return bool(getattr(agent, "resident", False))

    async def _say(
        self,
        task: TaskRecord,
        text: str,
        kind: TextKind = TextKind.NOTE,
        body: str | None = None,
    ) -> None:
        """Say ``text`` of ``task`` (``body``: what it says under its head line, alone)."""
        await publish(
            self.sink,
            self.run_id(task.name),
            text[:MAX_PUBLISH],
            kind,
            task=task.name,
            body=body[:MAX_PUBLISH] if body is not None else None,
        )

    async def _status(self, task: TaskRecord, status: str, event: str | None = None) -> None:
        await self.sink.update_status(
            StatusUpdate(
                run_id=self.run_id(task.name),
                mode="autopilot",
                status=status,
                phase=task.label,
                turn=self.turns,
                task=task.name,
                last_event=event,
                parent=task.parent,
                wave=task.wave,
                parent_run=self._parent_runs.get(task.name),
            )
        )

    async def _agent(self, task: TaskRecord) -> AgentSession:
        agent = self._agents.get(task.name)
        if agent is not None:
            return agent
        record = await self.store.get_session(task.name)
        if record is None:
            session_id, started = str(uuid.uuid4()), False
        else:
            if record.agent != self.tool:
                raise ConfigError(
                    f"task {task.name} runs on a {record.agent} session; drive it with "
                    f"--tool {record.agent}"
                )
            session_id, started = record.session_id, record.started
        await probe_turn_mode(self.tool, self.settings)  # off the event loop, then known
        agent = self._factory(task, session_id, started)
        run_id = self._run_ids.get(task.name)
        if run_id is not None:
            # The session is the run's, recorded before the first turn runs: after a crash
            # it is resumed, and a later drive of the task opens its run with it.
            await self.runs.update_run(run_id, session_id=session_id)
            # Its turns go through the supervisor: slots, and no new turn once parked.
            agent = self.supervisor.attach(run_id, agent, parks=True)
        self._agents[task.name] = agent
        return agent

    async def _turn(self, task: TaskRecord, prompt: str, kind: str) -> TurnOutput:
        agent = await self._agent(task)
        await self.store.record_audit(
            "turn", "started", task=task.name, phase=task.phase, detail=kind
        )
        await self._status(task, "running", f"{kind} turn")
        self.turns += 1
        run_id = self._run_ids.get(task.name)
        if run_id is None:
            out = await agent.run_turn(prompt)
        else:
            out = await self._recorded_turn(run_id, task, agent, prompt, kind)
        await self.store.record_audit(
            "turn",
            "finished",
            task=task.name,
            phase=task.phase,
            detail=f"{kind}; exit {out.exit_code}",
        )
        said, text = turn_finished(
            task.name, task.phase, kind, out.text, out.exit_code, out.stderr_tail
        )
        await self._say(task, said, TextKind.TURN, body=text)
        if self.budget is not None:
            note = await self._count_spend(task, out)
            if note is not None:
                await self._say(task, f"[{self._root or task.name}] {note}")
            if self.budget.over:
                for event in self._events.values():
                    event.set()  # a sub-task waiting at its gate stops now, not once decided
        return out

    async def _count_spend(self, task: TaskRecord, out: TurnOutput) -> str | None:
        """Count the turn of ``task`` that ended in the drive's budget; what to tell people
        now (at 80 %, once), else None."""
        assert self.budget is not None
        return self.budget.add(out)

    @property
    def spent_budget(self) -> bool:
        """Whether a turn ended over the drive's budget: no other may start."""
        return self.budget is not None and self.budget.over

    async def _budget_stop(self, task: TaskRecord) -> DriveOutcome:
        """End the drive of ``task`` before another turn: its budget is spent. The task
        this drive was started for says so (a wave's sub-tasks only end)."""
        assert self.budget is not None
        await self._status(task, "stopped", "budget spent")
        if task.name == self._root:
            await self.store.record_audit(
                "budget",
                "stopped",
                task=task.name,
                phase=task.label,
                detail=self.budget.spent_text(),
            )
            await self._say(
                task,
                f"[{task.name}] {self.budget.stopped_text()}; it stopped after the turn that "
                f"reached it, and the task stays at {task.label}.",
                TextKind.PERSON,
            )
        return DriveOutcome.STOPPED_BY_BUDGET

    async def _recorded_turn(
        self, run_id: str, task: TaskRecord, agent: AgentSession, prompt: str, kind: str
    ) -> TurnOutput:
        record = await self.runs.get_run(run_id)
        seq = record.turn + 1
        turn_id = await self.runs.start_turn(run_id, seq, prompt, task.phase, kind=kind)
        try:
            out = await agent.run_turn(prompt)
        except asyncio.CancelledError:
            await asyncio.shield(
                self.runs.fail_turn(turn_id, TurnState.INTERRUPTED, "the drive was stopped")
            )
            raise
        except TurnstileError as exc:
            await self.runs.fail_turn(turn_id, TurnState.FAILED, str(exc)[:500])
            raise
        await self.runs.finish_turn(turn_id, out)
        await self.runs.update_run(run_id, turn=seq, phase=task.phase, exit_code=out.exit_code)
        return out

    def _owner(self, key: str) -> tuple[str | None, str | None]:
        """Whose a text said under ``key`` is: the drive's run and its task."""
        names = [name for name, run_id in self._run_ids.items() if run_id == key]
        return key, names[0] if names else None

    async def _follow_phase(self, task: TaskRecord) -> None:
        """The drive's run is in its task's phase from the step that starts there on (the
        same moment on the workers, where a step ends by recording it)."""
        run_id = self._run_ids.get(task.name)
        if run_id is None or self._run_phases.get(run_id) == task.phase:
            return
        await self.runs.update_run(run_id, phase=task.phase)
        self._run_phases[run_id] = task.phase

    async def _open_run(self, task: TaskRecord, parent: str | None = None) -> str:
        """This drive's run of ``task``: the one a crash or shutdown parked, else a new one.

        ``parent`` is the run of the drive that drives this one (a wave's sub-task).
        """
        last = await self.runs.latest_task_run(RunMode.AUTOPILOT, task.name)
        place = self.chat
        if place is None and last is not None:
            place = (last.chat_id, last.thread_id) if last.chat_id is not None else None
        chat_id, thread_id = place if place is not None else (None, None)
        reserved = self._reserved if task.name == self._root else None
        if reserved is not None and last is not None and last.id != reserved:
            last = None  # (not the run the caller resumes: a new one, by the id it chose)
        if last is not None and last.status in (RunStatus.RUNNING, RunStatus.PARKED):
            run_id = last.id
            await self.runs.update_run(
                run_id,
                status=RunStatus.RUNNING,
                phase=task.phase,
                workdir=str(task.workdir),
                chat_id=chat_id,
                thread_id=thread_id,
                finished_at=None,
                parent_id=parent,
            )
        else:
            session = await self.store.get_session(task.name)
            run_id = await self.supervisor.open_run(
                RunMode.AUTOPILOT,
                agent=self.tool,
                session_id=session.session_id if session is not None else "",
                # (An id of a run that ended meanwhile is not given again.)
                run_id=reserved if last is None or last.id != reserved else None,
                objective=task.summary,
                workdir=str(task.workdir),
                chat=ChatPlace(chat_id, thread_id) if chat_id is not None else None,
                task=task.name,
                phase=task.phase,
                parent=parent,
            )
        self._run_ids[task.name] = run_id
        self._run_phases[run_id] = task.phase
        return run_id

    async def _close_run(self, run_id: str, name: str, status: RunStatus) -> None:
        self.supervisor.detach(run_id)
        finished = time.time() if status is not RunStatus.PARKED else None
        try:
            phase = (await self.store.get(name)).phase
            await self.runs.update_run(run_id, status=status, phase=phase, finished_at=finished)
        except TurnstileError as exc:
            # The drive's own outcome (or error) matters more than this bookkeeping.
            _LOGGER.warning("could not record the end of run %s: %s", run_id, exc)

    async def _to_human(self, task: TaskRecord, reason: str) -> DriveOutcome:
        await self._say(task, f"[{task.name}] needs a person: {reason}", TextKind.PERSON)
        for attempt in range(3):
            try:
                task = await self.store.transition(
                    task.name, HUMAN_INTERVENTION, actor="autopilot", reason=reason
                )
                break
            except GateRefused as exc:
                if exc.reason is Refusal.ILLEGAL_TRANSITION:
                    break  # already there (or complete): nothing to do
                if exc.reason is not Refusal.CONFLICT or attempt == 2:
                    raise
        await self._status(task, "human_intervention", reason[:200])
        return DriveOutcome.HUMAN_INTERVENTION

    async def _audit(self, tasks: list[str] | None, reason: str) -> AuditReport:
        report = await run_audit(self.store, tasks=tasks, reason=reason)
        if report.findings:
            lines = [f"- {f.task}: {f.kind.value}: {f.detail}" for f in report.findings[:20]]
            name = tasks[0] if tasks else self._root or ""
            await publish(
                self.sink,
                self.run_id(name),
                f"audit ({reason}): {len(report.findings)} findings\n" + "\n".join(lines),
                task=name,
            )
        return report

    # -- the loop ----------------------------------------------------------------------------

    async def drive(
        self, name: str, *, audit_at_start: bool = True, parent_run: str | None = None
    ) -> DriveOutcome:
        """Drive ``name`` until it completes, needs a person, or parks at a gate.

        ``parent_run``: the run of the drive this one runs under (a wave's sub-task).
        """
        outcome = await self._drive(name, audit_at_start, parent_run, once=False)
        assert outcome is not None  # (only one step goes on)
        return outcome

    async def step(self, name: str, *, audit_at_start: bool = True) -> DriveOutcome | None:
        """One step of :meth:`drive` (see :meth:`_step`); None: the drive goes on."""
        return await self._drive(name, audit_at_start, None, once=True)

    async def _drive(
        self, name: str, audit_at_start: bool, parent_run: str | None, *, once: bool
    ) -> DriveOutcome | None:
        self._events.setdefault(name, asyncio.Event())
        if self._root is None:
            self._root = name
        if parent_run is not None:
            self._parent_runs[name] = parent_run
        remove = self.store.add_listener(self._on_change)
        try:
            task = await self.store.get(name)
            async with _drive_lock(self.store, task):
                run_id = await self._open_run(task, parent_run)
                if name == self._root:
                    self.opened.set()
                status = RunStatus.ERROR
                try:
                    outcome = await self._drive_locked(task, audit_at_start, once)
                    status = RunStatus.RUNNING if outcome is None else _RUN_STATUS[outcome]
                    return outcome
                except asyncio.CancelledError:
                    status = self.cancelled_as
                    raise
                finally:
                    await asyncio.shield(self._close_run(run_id, name, status))
                    # A warm session's resident process ends with its drive; a later
                    # drive resumes the recorded session in a new one.
                    agent = self._agents.pop(name, None)
                    if agent is not None:
                        await asyncio.shield(close_agent(agent))
        finally:
            remove()

    async def _drive_locked(
        self, task: TaskRecord, audit_at_start: bool, once: bool
    ) -> DriveOutcome | None:
        if audit_at_start:
            await self._audit(await self._family(task), f"autopilot start ({task.name})")
        await self._note_interrupted(task)
        held = self.worktrees.hold(task) if self.worktrees is not None else None
        async with held or contextlib.nullcontext():
            while (outcome := await self._step(task.name)) is None and not once:
                pass
            return outcome

    async def _family(self, task: TaskRecord) -> list[str]:
        """The task, its parent and its sub-tasks: what a drive of it can touch."""
        names = [task.name]
        if task.parent is not None:
            names.append(task.parent)
        names += [s.name for s in await self.store.subtasks(task.name)]
        return names

    async def _note_interrupted(self, task: TaskRecord) -> None:
        events = await self.store.audit_events(task.name, limit=50)
        turns = [e for e in events if e.event == "turn"]
        if turns and turns[-1].outcome == "started":
            await self._say(
                task,
                f"[{task.name}] resuming at {task.label}: the last {turns[-1].phase} turn was "
                "interrupted; the phase runs again on the same agent session",
            )
            await self.store.record_audit(
                "turn", "interrupted", task=task.name, phase=turns[-1].phase
            )

    async def _step(self, name: str) -> DriveOutcome | None:
        """One step of the drive: its end (complete, a person needed, its budget spent),
        a look at its sub-tasks' wave, one look at its gate (passed, or waited at), or one
        phase with its checks and revision turn; None: the drive goes on."""
        task = await self.store.get(name)
        await self._follow_phase(task)
        if task.phase == COMPLETE:
            await self._status(task, "complete")
            work = await self._work_of(task)
            await self._say(
                task,
                "\n".join([f"[{name}] complete", *work]),
                TextKind.FINAL,
                body="\n".join(work),
            )
            await self._audit([name], f"task {name} complete")
            return DriveOutcome.COMPLETE
        if task.phase == HUMAN_INTERVENTION:
            await self._status(task, "human_intervention")
            await self._say(
                task,
                f"[{name}] is waiting for a person (it left {task.return_phase}); "
                f"{next_step(self.store, task, 0)}",
                TextKind.PERSON,
            )
            return DriveOutcome.HUMAN_INTERVENTION
        if self.spent_budget:
            return await self._budget_stop(task)
        outcome = await self._waves(task)
        if outcome is not None:
            return outcome
        if task.awaiting_approval:
            return await self._gate(task)
        return await self._phase(task)

    async def _work_of(self, task: TaskRecord) -> list[str]:
        """What a complete task changed in its worktree (commits, files) and where its branch
        went; nothing for a task without a worktree of its own (a sub-task's is merged into
        its parent's). Never raises: the task is complete whatever git says."""
        if task.parent is not None:
            return []
        try:
            work = await self._work_summary(task)
            summary = await work.generate() if work is not None else None
        except TurnstileError as exc:
            _LOGGER.warning("could not read what task %s changed: %s", task.name, exc)
            return []
        return summary.render().splitlines() if summary is not None else []

    async def _work_summary(self, task: TaskRecord) -> WorkSummaryGenerator | None:
        """What reads the work of ``task`` in its worktree (from where its branch started)
        and pushes its branch; None: the task has no worktree of its own."""
        # Imported here: most drives have no worktree (as in engine.gates.worktrees).
        from engine.automode.summary import WorkSummaryGenerator
        from engine.workspace import SqliteWorkspaceStore, push_run_branch

        workspace = await SqliteWorkspaceStore(self.store.db).get(task.name)
        if workspace is None or workspace.removed_at is not None:
            return None
        return WorkSummaryGenerator(
            workspace.path,
            base_commit=workspace.base,
            push=functools.partial(push_run_branch, self.settings, self.store.db, task.name),
        )

    async def _phase(self, task: TaskRecord) -> DriveOutcome | None:
        task, violations = await self.store.validate(task.name)
        if task.phase in (COMPLETE, HUMAN_INTERVENTION) or task.awaiting_approval:
            return None  # changed meanwhile: the loop looks again
        if violations:
            text = "; ".join(v.detail for v in violations)
            await self.store.record_audit(
                "validate_folder", "violations", task=task.name, phase=task.phase, detail=text
            )
            return await self._to_human(task, f"folder validation failed: {text}")
        spec = self.store.workflow.phase(task.phase)
        before_files = set(await asyncio.to_thread(list_artifacts, task.folder))
        before_git = None
        if not spec.code_edits:
            before_git = await fingerprint(task.workdir, exclude=task.folder)
        prompt = render_phase_prompt(
            self.store.workflow,
            spec,
            task=task.name,
            folder=task.folder,
            workdir=task.workdir,
            summary=task.summary,
            prior=await self._prior(task),
            revision_notes=task.revision_notes,
            parent=task.parent,
        )
        out = await self._turn(task, prompt, "phase")
        problems = await self._check(task, spec, before_files, before_git)
        if problems:
            await self._say(
                task,
                f"[{task.name} · {spec.name}] problems: " + "; ".join(problems) + _why(out),
            )
            await self.store.record_audit(
                "phase_check",
                "problems",
                task=task.name,
                phase=task.phase,
                detail="; ".join(problems),
            )
            if self.spent_budget:
                return await self._budget_stop(task)  # (no revision turn past the budget)
            out = await self._turn(
                task, render_revision_prompt(spec, task.folder, problems), "revision"
            )
            problems = await self._check(task, spec, before_files, before_git)
            if problems:
                return await self._to_human(
                    task,
                    f"{spec.name} still has problems after a revision turn: "
                    + "; ".join(problems)
                    + _why(out),
                )
        target = f"{spec.name}:{AWAITING_APPROVAL}" if spec.approval else spec.next
        try:
            moved = await self.store.transition(
                task.name, target, actor="autopilot", expected_version=task.version
            )
        except GateRefused as exc:
            if exc.reason is Refusal.CONFLICT:
                await self._say(task, f"[{task.name}] changed by someone else; re-reading")
                return None
            return await self._to_human(task, f"transition to {target} refused: {exc.detail}")
        await self._say(
            task, f"[{task.name}] {words(spec.name)} done → {words(moved.label)}", TextKind.STEP
        )
        return None

    async def _prior(self, task: TaskRecord) -> list[tuple[str, Path]]:
        wf = self.store.workflow
        found: list[tuple[str, Path]] = []
        if task.parent is not None:
            parent = await self.store.find(task.parent)
            if parent is not None:
                for spec in wf.earlier_phases(wf.subtask_start):
                    path = parent.folder / spec.artifact
                    if path.is_file():
                        found.append((f"{spec.name} (parent {parent.name})", path))
        for spec in wf.earlier_phases(task.phase):
            path = task.folder / spec.artifact
            if path.is_file():
                found.append((spec.name, path))
        return found

    async def _check(
        self,
        task: TaskRecord,
        spec: PhaseSpec,
        before_files: set[str],
        before_git: str | None,
    ) -> list[str]:
        facts = await self.store.facts(task)
        problems: list[str] = []
        if facts.blocked:
            problems.append(f"forbidden artifacts present: {', '.join(facts.blocked)}")
        if facts.artifact_error:
            problems.append(facts.artifact_error)
        elif facts.artifact_sha256 is None:
            problems.append(f"{spec.artifact} was not written in {_folder_words(task)}")
        if before_git is not None:
            after = await fingerprint(task.workdir, exclude=task.folder)
            if after != before_git:
                problems.append(
                    f"code in the workspace changed during {spec.name}, which forbids code edits"
                )
        after_files = set(await asyncio.to_thread(list_artifacts, task.folder))
        unexpected = sorted(after_files - before_files - {spec.artifact} - set(facts.blocked))
        if unexpected or facts.blocked:
            listed = ", ".join([*unexpected, *facts.blocked])
            await self.store.record_audit(
                "unexpected_artifact", "seen", task=task.name, phase=spec.name, detail=listed
            )
            await self._say(task, f"[{task.name}] unexpected artifacts: {listed}; auditing")
            await self._audit([task.name], f"unexpected artifacts in {task.name}")
        return problems

    async def _gate(self, task: TaskRecord) -> DriveOutcome | None:
        task = await self.store.reopen_if_changed(task)
        if not self.store.workflow.has(task.phase):
            return await self._to_human(task, f"the workflow has no phase {task.phase!r}")
        spec = self.store.workflow.phase(task.phase)
        facts = await self.store.facts(task)
        if facts.artifact_sha256 is None:
            return await self._to_human(
                task, facts.artifact_error or f"{spec.artifact} disappeared at the gate"
            )
        missing = await self.store.ensure_artifact(task)
        if missing is not None:
            return await self._to_human(task, f"the {spec.name} gate cannot be shown: {missing}")
        if facts.approvals >= facts.quorum:
            try:
                moved = await self.store.transition(
                    task.name, spec.next, actor="autopilot", expected_version=task.version
                )
            except GateRefused as exc:
                if exc.reason in (Refusal.CONFLICT, Refusal.STALE_APPROVAL):
                    return None
                return await self._to_human(task, f"cannot pass the gate: {exc.detail}")
            await self._say(
                task,
                f"[{task.name}] {words(spec.name)} approved → {words(moved.label)}",
                TextKind.STEP,
            )
            return None
        expiry = self.store.policy.expiry_seconds
        if (
            expiry is not None
            and task.gate_opened_at is not None
            and self.store.clock() - task.gate_opened_at > expiry
        ):
            await self.store.record_audit(
                "gate", "expired", task=task.name, phase=task.phase, sha256=task.gate_sha256
            )
            return await self._to_human(task, f"the {spec.name} approval expired")
        key = (task.name, task.gate_round, str(task.gate_sha256))
        if key not in self._announced:
            self._announced.add(key)
            await self.sink.request_gate(await self._gate_request(task, spec))
            await self._status(task, "awaiting_approval", f"gate {spec.name}")
        if not self.wait_for_approval:
            return DriveOutcome.PARKED
        await self._wait_change(task)
        return None

    async def _gate_request(self, task: TaskRecord, spec: PhaseSpec) -> GateRequest:
        path = task.folder / spec.artifact
        excerpt = await self.store.excerpt(task.gate_sha256, EXCERPT)
        notes = (
            f"approve: turnstile status --task {task.name} --approve --by USER_ID",
            f"reject: turnstile status --task {task.name} --reject --by USER_ID --reason TEXT",
        )
        return GateRequest(
            task=task.name,
            phase=spec.name,
            artifact_name=spec.artifact,
            artifact_path=path,
            sha256=str(task.gate_sha256),
            excerpt=excerpt,
            run_id=self.run_id(task.name),
            notes=notes,
        )

    async def _wait_change(self, task: TaskRecord) -> None:
        event = self._events.setdefault(task.name, asyncio.Event())
        while True:
            event.clear()
            if self.spent_budget:
                return
            current = await self.store.find(task.name)
            if current is None or current.version != task.version:
                return
            expiry = self.store.policy.expiry_seconds
            if (
                expiry is not None
                and task.gate_opened_at is not None
                and self.store.clock() - task.gate_opened_at > expiry
            ):
                return
            digest_changed = await self.store.reopen_if_changed(current)
            if digest_changed.version != current.version:
                return
            try:
                await asyncio.wait_for(event.wait(), self.poll_interval)
            except TimeoutError:
                continue
            return

    # -- waves -------------------------------------------------------------------------------

    async def _waves(self, task: TaskRecord) -> DriveOutcome | None:
        wf = self.store.workflow
        if task.parent is not None or wf.decomposition is None:
            return None
        if not wf.has(task.phase) or wf.index(task.phase) <= wf.index(wf.decomposition):
            return None
        subs = await self.store.subtasks(task.name)
        if not subs or all(s.finished for s in subs):
            stuck = [s for s in subs if s.phase == HUMAN_INTERVENTION]
            if stuck and not await self._resumed_since(task, max(s.updated_at for s in stuck)):
                names = ", ".join(s.name for s in stuck)
                return await self._to_human(task, f"sub-tasks need a person: {names}")
            return None
        waves = sorted({s.wave or 1 for s in subs})
        limit = asyncio.Semaphore(self.settings.wave_concurrency)

        async def run(sub: str) -> DriveOutcome:
            async with limit:
                if self.spent_budget:
                    return DriveOutcome.STOPPED_BY_BUDGET  # not started: the budget is spent
                try:
                    return await self.drive(
                        sub, audit_at_start=False, parent_run=self._run_ids.get(task.name)
                    )
                except TurnstileError as exc:
                    # One sub-task failing (its agent would not start, ...) must not cancel
                    # its siblings: it is reported and waits for a person.
                    _LOGGER.warning("drive of %s failed: %s", sub, exc, extra={"task": sub})
                    return await self._to_human(await self.store.get(sub), f"drive failed: {exc}")

        for wave in waves:
            if self.spent_budget:
                return await self._budget_stop(task)
            members = [s for s in await self.store.subtasks(task.name) if (s.wave or 1) == wave]
            pending = [s for s in members if not s.finished]
            if not pending:
                continue
            await self._say(
                task, wave_started(task.name, wave, [s.name for s in pending], self.settings)
            )
            if self.worktrees is not None:
                for name, path in (await self.worktrees.before_wave(task, pending)).items():
                    await self.store.set_workdir(name, path)
            async with asyncio.TaskGroup() as group:
                runs = [group.create_task(run(s.name), name=f"autopilot-{s.name}") for s in pending]
            outcomes = [r.result() for r in runs]
            if DriveOutcome.STOPPED_BY_BUDGET in outcomes:
                return await self._budget_stop(task)
            if DriveOutcome.PARKED in outcomes:
                return DriveOutcome.PARKED
            if self.worktrees is not None:
                finished = [s for s in await self.store.subtasks(task.name) if s.wave == wave]
                try:
                    problems = await self.worktrees.after_wave(task, finished)
                except TurnstileError as exc:
                    return await self._to_human(task, f"merging wave {wave} failed: {exc}")
                if problems:
                    listed = "; ".join(f"{k}: {v}" for k, v in problems.items())
                    return await self._to_human(task, f"wave {wave} did not merge: {listed}")
                await self._say(task, f"[{task.name}] wave {wave} merged into the task's branch")
        return None

    async def _resumed_since(self, task: TaskRecord, since: float) -> bool:
        """Whether a person moved the parent out of human_intervention after ``since``
        (they looked at the stuck sub-tasks and chose to go on without them)."""
        history = await self.store.history(task.name)
        return any(h.from_phase == HUMAN_INTERVENTION and h.at >= since for h in history)


def wave_started(task: str, wave: int, names: Sequence[str], settings: Settings) -> str:
    """What a drive says as a wave of its sub-tasks starts, wherever they run."""
    return (
        f"[{task}] wave {wave}: driving {', '.join(names)} "
        f"(at most {settings.wave_concurrency} at once)"
    )


def _why(out: TurnOutput) -> str:
    """What a phase's problems add of its turn: how the agent exited, when it failed."""
    note = exit_note(out.exit_code, out.stderr_tail)
    return f"\n{note}" if note else ""


def _folder_words(task: TaskRecord) -> str:
    """The task folder as people and the agent read it: relative to the agent's working
    folder, never a machine's absolute path."""
    inside = task.folder != task.workdir and task.folder.is_relative_to(task.workdir)
    shown = task.folder.relative_to(task.workdir).as_posix() if inside else task.folder.name
    return f"the task folder {shown}/"


def _lock_of(store: TaskStore, task: TaskRecord) -> Lock:
    return database_lock(store.db, f"drive:{task.name}", task.folder / ".drive.lock", mode=0o644)


async def drive_alive(store: TaskStore, name: str) -> bool:
    """Whether a drive of task ``name`` is alive in some process (it holds the drive lock)."""
    task = await store.find(name)
    if task is None:
        return False
    lock = _lock_of(store, task)
    if await lock.try_acquire():
        await lock.release()
        return False
    return True


@contextlib.asynccontextmanager
async def _drive_lock(store: TaskStore, task: TaskRecord) -> AsyncIterator[None]:
    """One drive per task across processes (one turn per agent session in flight): an
    ``flock`` on the folder's ``.drive.lock`` on SQLite, an advisory lock on PostgreSQL
    (the drives may run on several machines); either is freed if its holder dies.

    Raises:
        GateRefused: ``concurrent_change`` when another drive holds it.
    """
    lock = _lock_of(store, task)
    if not await lock.try_acquire():
        holder = await lock.holder()
        raise GateRefused(
            Refusal.CONFLICT,
            f"task {task.name} is already being driven (pid {holder or '?'})",
            task=task.name,
        )
    try:
        yield
    finally:
        await lock.release()
