"""The run supervisor: what every mode (chat session, auto run, autopilot drive and its
sub-tasks) starts, runs, stops and recovers its runs through.

- :meth:`RunSupervisor.open_run` mints the run's id (one format) and writes its ``runs`` row;
  :meth:`RunSupervisor.reserve` mints it beforehand when something must be named after it
  first (the run's worktree, its branch ``turnstile/<run-id>``). No front end mints ids.
- :meth:`RunSupervisor.attach` gives a run its one session wrapper, :class:`RunSession`:
  the turn slots (at most ``max_concurrent_turns`` at once across every run), a person's
  stop as a latch, and parking (no new turn starts once the front end shuts down).
- :meth:`RunSupervisor.run_turn` is "run one turn of run R": a run id and a prompt in
  (plain data), the turn's :class:`~engine.turn.TurnOutput` out. Every session wrapper's
  turn goes through it; it is the seam a worker queue sits behind (the job carries the
  run id and the prompt; the worker holds the agent session).
- :meth:`RunSupervisor.recover` is the one start-up recovery path: turns a crash cut off
  are marked interrupted (what they left running is killed), chat runs are closed, and
  the report says which auto runs and autopilot drives resume (the front end only
  announces and resumes them).

The front ends (bot features, terminal commands) only start, steer, stop and render runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import NotFoundError
from engine.runs.ids import RunMode, new_run_id
from engine.runs.owner import owner_alive, owner_token
from engine.runs.pause import Pauses
from engine.runs.spec import ChatPlace
from engine.runs.stop import until_stopped
from engine.store.runs import RunRecord, RunStatus, RunStore, TurnRecord
from engine.turn import AgentSession, TurnOutput

if TYPE_CHECKING:
    from engine.agents.warm import WarmPool

__all__ = ["CutOffTurn", "DriveProbe", "Recovery", "RunSession", "RunSupervisor"]

#: Whether a drive of the task (by name) is alive in some process: its drive lock is held.
DriveProbe = Callable[[str], Awaitable[bool]]

_LOGGER = logging.getLogger(__name__)


class RunSession:
    """A run's agent session as the loops see it; every turn goes through the supervisor."""

    def __init__(self, supervisor: RunSupervisor, run_id: str, agent: AgentSession) -> None:
        self._supervisor = supervisor
        self.run_id = run_id
        self.agent = agent

    @property
    def session_id(self) -> str:
        return self.agent.session_id

    async def run_turn(self, prompt: str) -> TurnOutput:
        return await self._supervisor.run_turn(self.run_id, prompt)


@dataclass(slots=True)
class _Attached:
    agent: AgentSession
    stop: asyncio.Event | None
    parks: bool
    on_stop: Callable[[], None] | None = None


@dataclass(frozen=True, slots=True)
class CutOffTurn:
    """A turn that was running when the process died, and its run."""

    turn: TurnRecord
    run: RunRecord


@dataclass(frozen=True, slots=True)
class Recovery:
    """What the start-up recovery did and what a front end resumes or announces.

    Attributes:
        cut_off: turns marked interrupted (the chat, if any, is told; the output is lost).
        closed_chats: chat runs closed (a crash ends them crashed, a shutdown completed);
            their queued messages start new runs.
        auto: auto runs with a chat that a crash cut off or a shutdown parked: to resume.
        drives: autopilot drives a chat started that a crash cut off or a shutdown parked,
            one per task (its newest run), none still alive in another process: to resume.
            A drive from a terminal is resumed there; a wave's sub-task resumes with its
            parent's drive.
    """

    cut_off: tuple[CutOffTurn, ...] = ()
    closed_chats: tuple[str, ...] = ()
    auto: tuple[RunRecord, ...] = ()
    drives: tuple[RunRecord, ...] = ()


class RunSupervisor:
    """Owns every run of this process: ids, rows, session wrappers, stop, park, recovery.

    Args:
        runs: the runs store.
        slots: caps the turns running at once across every run (None: no cap).
        warm_pool: where every run's warm session (a resident agent process) is counted,
            so ``TURNSTILE_MAX_WARM_SESSIONS`` bounds them all, whatever their mode (None:
            each warm session gets a pool of its own, as in a terminal's one run).
        pauses: where a person's pause of a run is found (None: the runs store's
            database's); a paused run's next turn waits in its slot until it may go on.
    """

    def __init__(
        self,
        runs: RunStore,
        *,
        slots: asyncio.Semaphore | None = None,
        warm_pool: WarmPool | None = None,
        pauses: Pauses | None = None,
    ) -> None:
        self.runs = runs
        self.slots = slots
        self.warm_pool = warm_pool
        db = getattr(runs, "db", None)
        self.pauses = pauses if pauses is not None or db is None else Pauses(db)
        self._attached: dict[str, _Attached] = {}
        self._parked = False
        self._in_flight = 0
        self._turn_done = asyncio.Event()

    # -- starting ----------------------------------------------------------------------

    def reserve(self, mode: RunMode | str) -> str:
        """A new run id of ``mode`` for a run whose row :meth:`open_run` writes later.

        For what is named after the run before it can be recorded (its worktree and
        branch, the approval route of its tool calls).
        """
        return new_run_id(mode)

    async def open_run(
        self,
        mode: RunMode,
        *,
        agent: str,
        session_id: str,
        run_id: str | None = None,
        chat: ChatPlace | None = None,
        objective: str | None = None,
        workdir: str | None = None,
        log_dir: str | None = None,
        task: str | None = None,
        phase: str | None = None,
        state: Mapping[str, Any] | None = None,
        parent: str | None = None,
    ) -> str:
        """Record a new run (status running) and return its id.

        ``run_id``: one :meth:`reserve` gave; None mints a new one.

        ``parent`` is the run that drives this one (a wave's sub-task: its parent's drive).
        """
        run_id = run_id or new_run_id(mode)
        await self.runs.create_run(
            run_id,
            mode=RunMode(mode).value,
            agent=agent,
            session_id=session_id,
            objective=objective,
            workdir=workdir,
            log_dir=log_dir,
            chat_id=chat.chat_id if chat is not None else None,
            thread_id=chat.thread_id if chat is not None else None,
            task=task,
            phase=phase,
            state=state,
            parent_id=parent,
        )
        return run_id

    def attach(
        self,
        run_id: str,
        agent: AgentSession,
        *,
        stop: asyncio.Event | None = None,
        parks: bool = False,
        on_stop: Callable[[], None] | None = None,
    ) -> RunSession:
        """Give ``run_id`` its session wrapper around ``agent``.

        Args:
            stop: a person's stop latch: once set, the running (or next) turn is
                pre-empted with :class:`~engine.errors.TurnPreempted`.
            on_stop: told when :meth:`stop` sets the latch (the run's loop ends at its
                next step, e.g. an auto run between turns).
            parks: after :meth:`park`, no new turn of this run starts (it waits until the
                run is cancelled; the phase runs again after a restart).
        """
        self._attached[run_id] = _Attached(agent, stop, parks, on_stop)
        return RunSession(self, run_id, agent)

    def attached(self, run_id: str) -> bool:
        """Whether a session of ``run_id`` is attached here (the run is driven here)."""
        return run_id in self._attached

    def detach(self, run_id: str) -> None:
        """The run ended: forget its session."""
        self._attached.pop(run_id, None)

    # -- the seam ----------------------------------------------------------------------

    async def run_turn(self, run_id: str, prompt: str) -> TurnOutput:
        """Run one turn of run ``run_id`` (waits for a turn slot; honours stop and park).

        Raises:
            NotFoundError: no session is attached to the run in this process.
            TurnPreempted: the run's stop latch was set.
            TurnError: the turn could not run.
        """
        attached = self._attached.get(run_id)
        if attached is None:
            raise NotFoundError(f"no session of run {run_id!r} runs here")
        if attached.parks and self._parked:
            # Parked: the run is cancelled by the shutdown; the phase re-runs on restart.
            await asyncio.Event().wait()
        if attached.stop is None:
            return await self._counted(attached, run_id, prompt)
        return await until_stopped(
            self._counted(attached, run_id, prompt),
            attached.stop,
            what="the turn",
            session_id=attached.agent.session_id,
        )

    async def _counted(self, attached: _Attached, run_id: str, prompt: str) -> TurnOutput:
        if attached.parks:
            self._in_flight += 1
        try:
            if self.slots is None:
                await self._unpaused(run_id)
                return await attached.agent.run_turn(prompt)
            async with self.slots:  # a paused run keeps its slot
                await self._unpaused(run_id)
                return await attached.agent.run_turn(prompt)
        finally:
            if attached.parks:
                self._in_flight -= 1
                self._turn_done.set()

    async def _unpaused(self, run_id: str) -> None:
        if self.pauses is None:
            return
        waited = await self.pauses.wait_while_paused(run_id)
        if waited:
            _LOGGER.info("run %s goes on after a pause of %.0f s", run_id, waited)

    # -- stopping ----------------------------------------------------------------------

    def stop(self, run_id: str) -> bool:
        """A person stops run ``run_id``: its running (or next) turn is pre-empted and its
        loop is told; False when no stoppable run of that id is attached here."""
        attached = self._attached.get(run_id)
        if attached is None or attached.stop is None:
            return False
        attached.stop.set()
        if attached.on_stop is not None:
            attached.on_stop()
        return True

    @property
    def parked(self) -> bool:
        return self._parked

    def park(self) -> None:
        """Start no new turn of a parking run (the front end is shutting down)."""
        self._parked = True

    async def wait_turns(self, preempt: asyncio.Event) -> None:
        """Wait until the parking runs' turns in flight finish, or ``preempt`` is set."""
        while self._in_flight and not preempt.is_set():
            self._turn_done.clear()
            waiter = asyncio.create_task(preempt.wait(), name="supervisor-preempt-wait")
            done = asyncio.create_task(self._turn_done.wait(), name="supervisor-turn-wait")
            try:
                await asyncio.wait({waiter, done}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                done.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.gather(waiter, done)

    # -- start-up ----------------------------------------------------------------------

    async def recover(
        self, *, drive_alive: DriveProbe | None = None, elsewhere: Collection[str] = ()
    ) -> Recovery:
        """The one start-up recovery path (call once, before any run starts).

        Turns still recorded as started were cut off: what they left running is killed and
        they are marked interrupted. Chat runs left running (a crash) end crashed, parked
        ones (a shutdown) completed. Auto runs and autopilot drives left running or parked
        with a chat are reported for the front end to resume.

        Args:
            drive_alive: tells a drive still alive in another process (a terminal took the
                task over): it is not reported. None: no drive is alive elsewhere.
            elsewhere: runs whose turns another process runs (on the workers): their
                started turns are not this process's, and are left alone.
        """
        # A run whose driving process still runs (a terminal's chat or auto run on this
        # machine) is that process's: neither its turn nor the run is touched.
        me = owner_token()
        running = await self.runs.list_runs(status=RunStatus.RUNNING)
        alive = {
            run.id
            for run in running
            if run.state.get("owner") not in (None, me) and owner_alive(run.state.get("owner"))
        }
        interrupted = await self.runs.mark_interrupted(leave={*elsewhere, *alive})
        # What a cut-off turn left running dies first (the watchdog of the process that
        # ran it normally did that already, unless it was killed too).
        for turn in interrupted:
            if turn.kill_remains():
                _LOGGER.info("killed what was left of turn %d of run %s", turn.seq, turn.run_id)
        cut_off = []
        for turn in interrupted:
            with contextlib.suppress(NotFoundError):
                cut_off.append(CutOffTurn(turn, await self.runs.get_run(turn.run_id)))
        closed: list[str] = []
        auto: list[RunRecord] = []
        drives: list[RunRecord] = []
        parked = await self.runs.list_runs(status=RunStatus.PARKED)
        for status, runs in ((RunStatus.RUNNING, running), (RunStatus.PARKED, parked)):
            for run in runs:
                if run.id in alive:
                    continue
                if run.mode == RunMode.CHAT.value:
                    # A chat session is not resumed: its queued messages start a new run.
                    ended = (
                        RunStatus.CRASHED if status is RunStatus.RUNNING else RunStatus.COMPLETED
                    )
                    await self.runs.update_run(run.id, status=ended, finished_at=time.time())
                    closed.append(run.id)
                elif run.mode == RunMode.AUTO.value and run.chat_id is not None:
                    # (An auto run from a terminal is resumed there: turnstile auto --resume.)
                    auto.append(run)
                elif await self._drive_to_resume(run, drive_alive):
                    drives.append(run)
        drives.sort(key=lambda r: r.created_at)
        return Recovery(
            cut_off=tuple(cut_off),
            closed_chats=tuple(closed),
            auto=tuple(auto),
            drives=tuple(drives),
        )

    async def _drive_to_resume(self, run: RunRecord, drive_alive: DriveProbe | None) -> bool:
        """Whether ``run`` is a chat's drive that the front end resumes."""
        if run.mode != RunMode.AUTOPILOT.value or run.task is None:
            return False
        if run.chat_id is None or run.parent_id is not None:
            # A terminal's drive (resumed there), or a sub-task (resumed by its parent's).
            return False
        latest = await self.runs.latest_task_run(RunMode.AUTOPILOT.value, run.task)
        if latest is None or latest.id != run.id:
            # A newer run of the task decides (it was stopped, finished or taken over):
            # one drive per task, never two.
            return False
        if drive_alive is not None and await drive_alive(run.task):
            _LOGGER.info("drive of task %s is alive elsewhere; not taken over", run.task)
            return False
        return True
