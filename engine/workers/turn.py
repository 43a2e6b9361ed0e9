"""“Run one turn of run R” on a worker: the body of the queue's one task.

A job brings only the run id. The worker takes the run (compare-and-set on its holder),
gets its worktree (a fresh checkout of the project the first time; the pushed run branch
when the run comes from a lost worker), runs exactly one agent turn through the auto-mode
channel (which commits the turn and the run's new state together), pushes the run branch,
and queues the next turn on its own queue while the run goes on.

Long: the first-turn, same-worker and moved-run paths share the take, the stop poll and
the push; they fold into the run supervisor's one-turn call once it exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Final

import procrastinate

from engine.agents.factory import create_agent
from engine.agents.warm import WarmPool, close_agent
from engine.automode import AutoRun, prepare_auto_run, prepare_resume
from engine.automode.budget import STOPPED_BY_BUDGET
from engine.automode.channel import STOPPED_BY_PERSON
from engine.automode.runner import AutoModeRunner
from engine.automode.state import AutoModeState, AutoStatus
from engine.errors import (
    NotFoundError,
    StoreUnreachableError,
    TurnError,
    TurnPreempted,
    TurnstileError,
    TurnSuperseded,
)
from engine.git import GitRunner
from engine.logs import log_context
from engine.runs import AgentEnv, RunSupervisor
from engine.runs.stop import until_stopped
from engine.settings import Settings
from engine.store.backend import wait_reachable
from engine.store.runs import RunRecord, SqliteRunStore
from engine.turn import Ready, TurnOutput
from engine.workers.chat import CHAT_MODE, run_chat_turn
from engine.workers.queue import SHARED_QUEUE, agent_queue, defer_turn, nudge, worker_queue
from engine.workers.store import Placement, PlacementStatus, WorkerStore
from engine.workspace.manager import WorkspaceManager, run_branch
from engine.workspace.store import SqliteWorkspaceStore, Workspace

if TYPE_CHECKING:
    from engine.store.postgres import PostgresDatabase

__all__ = ["MOVED_NOTE", "TurnRunner", "moved_primer", "run_branch"]

_LOGGER = logging.getLogger(__name__)

MOVED_NOTE: Final = "moved to another worker"
_STOP_POLL: Final = 0.25


def moved_primer(state: AutoModeState, worker: str) -> str:
    """What the agent is told first in the new session of a run that changed machines."""
    lines = [
        "Note before this turn: this run moved to another machine (worker "
        f"{worker}) because the one it ran on stopped answering. Your earlier conversation "
        "was kept on that machine and is gone, so this is a new session. The working tree "
        f"is the run branch {run_branch(state.run_id)} as it was pushed after the last "
        "finished turn; anything not committed by then is not in it.",
        f"The objective: {state.objective}",
        f"Where the run stands: turn {state.turn} of {state.max_turns}, "
        f"{state.phase.label} comes next.",
    ]
    if state.plan:
        lines.append(f"The plan so far:\n{state.plan[:4000]}")
    if state.evaluation:
        lines.append(f"The last evaluation:\n{state.evaluation[:2000]}")
    lines.append("Continue the run from there.")
    return "\n\n".join(lines) + "\n\n---\n\n"


class _PrimedSession:
    """The first prompt of a new session starts with the run's state in plain words."""

    def __init__(self, runner: AutoModeRunner, primer: str) -> None:
        self._runner = runner
        self._primer: str | None = primer

    @property
    def session_id(self) -> str:
        return self._runner.session_id

    @property
    def agent(self) -> AutoModeRunner:
        """The session it wraps (seen through when its resident process is closed)."""
        return self._runner

    async def run_turn(self, prompt: str) -> TurnOutput:
        primer, self._primer = self._primer, None
        return await self._runner.run_turn(primer + prompt if primer else prompt)


@dataclass(slots=True)
class _Held:
    """A run prepared on this worker, kept between its turns while the worker holds it."""

    run: AutoRun
    workspace: Workspace
    project_url: str
    moves: int
    pushed: str | None = None


#: One turn of a run of another mode on this worker: ``(runner, placement, moved=,
#: stop=) -> whether its next turn is to be queued here``.
ModeStep = Callable[..., Awaitable[bool]]


@dataclass(slots=True)
class TurnRunner:
    """Everything a worker's turn jobs share: its name, settings, database and queue.

    Attributes:
        agents: the agents whose CLI this worker has.
        running: the runs with a turn in flight here (their count is heartbeated).
        held: the runs prepared here, kept between turns (re-prepared only when a run is
            not here or has moved meanwhile).
        stops: each held run's stop event (the one its prepared run was given).
        warm_pool: bounds this worker's resident agent processes (warm sessions:
            ``TURNSTILE_MAX_WARM_SESSIONS`` per worker, idle ones closed after
            ``TURNSTILE_WARM_IDLE_MINUTES``); a held run's process stays between its turns.
        modes: the run modes whose turns another module drives (autopilot drives), by
            mode; auto runs are this class's own.
        marked_warm: the runs last recorded warm for this worker (see :meth:`mark_warm`).
    """

    name: str
    settings: Settings
    db: PostgresDatabase
    app: procrastinate.App
    agents: frozenset[str] = frozenset()
    running: dict[str, asyncio.Task[bool]] = field(default_factory=dict)
    held: dict[str, _Held] = field(default_factory=dict)
    stops: dict[str, asyncio.Event] = field(default_factory=dict)
    deferrals: set[asyncio.Task[None]] = field(default_factory=set)
    warm_pool: WarmPool | None = None
    marked_warm: frozenset[str] | None = None
    modes: Mapping[str, ModeStep] = field(default_factory=dict)

    @property
    def queue(self) -> str:
        return worker_queue(self.name)

    @property
    def env(self) -> Mapping[str, str]:
        return {"AGENT_WORKER_NAME": self.name}  # which worker runs it (not a setting)

    def _manager(self) -> WorkspaceManager:
        return WorkspaceManager.from_settings(self.settings, store=SqliteWorkspaceStore(self.db))

    async def job(
        self, run_id: str, *, user_abort: Callable[[], bool], queue: str | None = None
    ) -> None:
        """One turn of ``run_id``; cancelled (job aborted), a person's stop ends it cleanly."""
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
                # A person aborted the job: stop the turn the way `turnstile stop` does, so
                # the run is recorded stopped, not left half-way.
                stop.set()
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.shield(inner)
            else:
                # The worker is going down: the turn is cut off (its process group
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
        """Take the run and run its turn; whether its next turn is to be queued here."""
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
        with log_context(run_id=run_id):
            try:
                if stop_asked:
                    stop.set()
                if before.spec.mode == CHAT_MODE:
                    # A chat turn: the bot queues each one, so none is queued from here.
                    await run_chat_turn(
                        worker=self.name,
                        settings=self.settings,
                        db=self.db,
                        manager=self._manager(),
                        spec=before.spec,
                        stop=stop,
                        env=self.env,
                    )
                    return False
                step = self.modes.get(before.spec.mode)
                if step is not None:
                    moved = holder is None and before.moves > 0
                    return await step(self, before, moved=moved, stop=stop)
                return await self._drive(
                    before, moved=holder is None and before.moves > 0, stop=stop
                )
            except TurnSuperseded as exc:
                # This worker was declared lost while the turn ran and the run moved on: the
                # turn's result was not kept, and the run is its new holder's (no push, no
                # next turn from here).
                _LOGGER.warning("run %s moved on while its turn ran here: %s", run_id, exc)
                return False
            except StoreUnreachableError as exc:
                if not exc.retryable:
                    raise
                # The database went away during the turn (an outage, a restart): what the
                # turn did could not all be recorded. Once it is back, the run goes on from
                # what the store holds: a turn recorded started and never ended runs again.
                _LOGGER.warning(
                    "run %s: lost the database during its turn (%s); it goes on once the "
                    "database is back",
                    run_id,
                    exc,
                )
                await wait_reachable(self.db)
                return before.spec.mode != CHAT_MODE  # (a chat turn reports itself)
            except TurnstileError as exc:
                # Bad input or a broken checkout: the run cannot go on; say why where
                # `turnstile runs` and the following terminal read it.
                _LOGGER.error("run %s cannot go on: %s", run_id, exc)
                await workers.set_placement(run_id, status=PlacementStatus.FINISHED, note=str(exc))
                return False

    async def _drive(self, placement: Placement, *, moved: bool, stop: asyncio.Event) -> bool:
        run_id = placement.run_id
        workers = WorkerStore(self.db)
        held = self.held.get(run_id)
        if held is not None and (moved or held.moves != placement.moves):
            await self.forget(run_id, keep_stop=True)  # it went away and came back
            held = None
        manager = self._manager()
        record = None
        try:
            if held is None:
                project = manager.project_for(placement.spec.project)
                try:
                    record = await SqliteRunStore(self.db).get_run(run_id)
                except NotFoundError:
                    record = None
                workspace = await manager.provision(run_id, project)
                if record is not None and moved:
                    await self._adopt(workspace, project.url, record.state)
                project_url = project.url
            else:
                workspace, project_url = held.workspace, held.project_url
            async with manager.lock(workspace):
                if held is None:
                    run = await self._prepare(placement, record, workspace, moved=moved, stop=stop)
                    held = _Held(run, workspace, project_url, placement.moves)
                    self.held[run_id] = held
                poller = asyncio.create_task(
                    self._poll_stop(held.run, stop), name=f"stop-poll-{run_id}"
                )
                try:
                    goes_on = await self._turn(held.run, stop)
                finally:
                    poller.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await poller
                await self._push(held)
            await self.mark_warm()
        except BaseException:
            # Whatever broke (or the worker going down): the next turn starts from the store.
            await asyncio.shield(self.forget(run_id, keep_stop=True))
            raise
        if goes_on:
            if placement.note:  # taking it set it running; only a note is left to clear
                await workers.set_placement(run_id, status=PlacementStatus.RUNNING, note="")
            return True
        if held.run.channel.report:  # what the chat and the terminal show of its end
            await workers.set_report(run_id, held.run.channel.report)
        await self.forget(run_id)
        final = PlacementStatus.STOPPED if stop.is_set() else PlacementStatus.FINISHED
        await workers.set_placement(run_id, status=final, note="")
        await workers.clear_stop(run_id)
        return False

    async def forget(self, run_id: str, *, keep_stop: bool = False) -> None:
        """Let go of the run's prepared state here (its owner lock with it)."""
        held = self.held.pop(run_id, None)
        if not keep_stop:
            self.stops.pop(run_id, None)
        if held is not None:
            # A warm session's resident process ends when the run leaves this worker
            # (ended, stopped, moved, or the worker stops), not at idle eviction.
            with contextlib.suppress(TurnstileError, OSError):
                await close_agent(held.run.runner)
            with contextlib.suppress(TurnstileError, OSError):
                await held.run.close()
            await self.mark_warm()

    def warm_runs(self) -> frozenset[str]:
        """The runs held here whose agent process is resident now."""
        return frozenset(run_id for run_id, held in self.held.items() if _resident(held.run.runner))

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
        """Forget the runs held here between turns that no longer are this worker's (they
        ended, were stopped between turns, or moved on)."""
        keep = set(still_here) | set(self.running)
        for run_id in [r for r in self.held if r not in keep]:
            await self.forget(run_id)

    async def _prepare(
        self,
        placement: Placement,
        record: RunRecord | None,
        workspace: Workspace,
        *,
        moved: bool,
        stop: asyncio.Event,
    ) -> AutoRun:
        spec = placement.spec
        # Its warm session (if any) is counted in this worker's pool.
        supervisor = RunSupervisor(SqliteRunStore(self.db), warm_pool=self.warm_pool)
        if record is None:
            settings = self.settings
            if spec.daily_budget is not None:
                # The chat's cap is the control plane's, kept with the run from here on.
                settings = settings.model_copy(update={"daily_budget": spec.daily_budget})
            return await prepare_auto_run(
                settings,
                self.db,
                spec.spec_in(workspace.path, AgentEnv(extra_env=self.env)),
                stop_event=stop,
                supervisor=supervisor,
            )
        run = await prepare_resume(
            self.settings,
            self.db,
            spec.run_id,
            env=AgentEnv(extra_env=self.env),
            stop_event=stop,
            supervisor=supervisor,
            # Stopped by its budget and put back under a larger one (an admin raised it).
            budget=spec.budget if _stopped_by_budget(record) else None,
        )
        if moved:
            run.runner = _PrimedSession(self._fresh_runner(run), moved_primer(run.state, self.name))
        return run

    def _fresh_runner(self, run: AutoRun) -> AutoModeRunner:
        """A new agent session in the same worktree (the old one was on the lost disk)."""
        state = run.state
        agent = create_agent(
            state.tool,
            self.settings,
            cwd=Path(state.workdir),
            session_id=state.session_id,
            agent_cmd=state.config.get("agent_cmd"),
            passthrough=tuple(state.config.get("passthrough", ())),
            extra_env=self.env,
            warm_pool=self.warm_pool,
        )
        agent.preempt.on_spawn = run.channel.record_process
        return AutoModeRunner(agent)

    async def _queue_next(self, run_id: str) -> None:
        """Queue the run's next turn on this worker's queue, and wake the worker once this
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

    async def _adopt(self, workspace: Workspace, project_url: str, state: object) -> None:
        """Take over a moved run: its worktree at the pushed branch, its folders here."""
        run_id = workspace.run_id
        remote = self.settings.runs_remote or project_url
        git = GitRunner()
        fetched = await git.run(
            ["fetch", "--no-tags", remote, f"refs/heads/{run_branch(run_id)}"],
            cwd=workspace.path,
            check=False,
        )
        if fetched.exit_code == 0:
            await git.run(["reset", "--hard", "FETCH_HEAD"], cwd=workspace.path)
        else:
            _LOGGER.warning(
                "run %s had pushed no branch yet; it continues from the project's start",
                run_id,
            )
        runs = SqliteRunStore(self.db)
        record = await runs.get_run(run_id)
        old = AutoModeState.from_json(record.state)
        # A worker restarted under the same name may still have the folder: keep it.
        log_dir = self.settings.runs_dir.resolve() / run_id
        log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        (log_dir / ".gitignore").write_text("*\n", encoding="utf-8")
        new = replace(
            old,
            workdir=str(workspace.path),
            log_dir=str(log_dir),
            session_id=str(uuid.uuid4()),
            owner=None,
        )
        await runs.update_run(
            run_id,
            workdir=new.workdir,
            log_dir=new.log_dir,
            session_id=new.session_id,
            state=new.to_json(),
        )
        _LOGGER.info("run %s taken over by worker %s", run_id, self.name)

    async def _poll_stop(self, run: AutoRun, stop: asyncio.Event) -> None:
        workers = WorkerStore(self.db)
        while not stop.is_set():
            try:
                if await workers.stop_requested(run.run_id):
                    break
            except TurnstileError as exc:  # the database may be away a moment
                _LOGGER.warning("cannot read stop requests: %s", exc)
            await asyncio.sleep(_STOP_POLL)
        stop.set()
        await run.stop()

    async def _turn(self, run: AutoRun, stop: asyncio.Event) -> bool:
        """Run the run's next turn; whether the run goes on (not ended, stopped or crashed)."""
        channel = run.channel
        if stop.is_set():
            channel.request_stop()
        try:
            match await channel.next_prompt():
                case Ready(prompt=prompt):
                    try:
                        out = await until_stopped(
                            run.runner.run_turn(prompt),
                            stop,
                            what="the turn",
                            session_id=run.session_id,
                        )
                    except TurnPreempted as exc:
                        if stop.is_set():
                            await channel.record_preempted(STOPPED_BY_PERSON.lower())
                        else:
                            await channel.record_turn_error(str(exc))
                        return False
                    except TurnError as exc:
                        await channel.record_turn_error(str(exc))
                        return False
                    await channel.publish_output(out)
                    return run.state.status is AutoStatus.RUNNING and not stop.is_set()
                case _:
                    return False
        finally:
            await channel.flush()

    async def _push(self, held: _Held) -> None:
        """Push the run branch (never forced, no other branch) so another worker can go on;
        not again when the turn committed nothing since the last push."""
        workspace = held.workspace
        git = GitRunner()
        head = (await git.run(["rev-parse", "HEAD"], cwd=workspace.path)).stdout.strip()
        if head and head == held.pushed:
            return
        remote = self.settings.runs_remote or held.project_url
        branch = run_branch(workspace.run_id)
        await git.run(
            ["push", "--no-verify", remote, f"HEAD:refs/heads/{branch}"], cwd=workspace.path
        )
        held.pushed = head


def _stopped_by_budget(record: RunRecord) -> bool:
    config = AutoModeState.from_json(record.state).config
    return bool(config.get("stopped_by") == STOPPED_BY_BUDGET)


def _resident(session: object) -> bool:
    """Whether ``session`` (seen through its wrappers) has a resident agent process."""
    for _ in range(4):
        if getattr(session, "warm", False):
            return bool(getattr(session, "resident", False))
        session = getattr(session, "agent", None)
        if session is None:
            return False
    return False
