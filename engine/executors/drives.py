"""Autopilot drives for a front end: started, stopped, woken and recovered wherever they run.

:func:`engine.executors.drive_executor` makes the one for ``TURNSTILE_EXECUTION``:
:class:`LocalDrives` drives each task in a task of this process under the run supervisor;
on the workers
(:class:`~engine.executors.drives_workers.WorkersDrives`) a drive is queued and followed
from the store, its gates announced through the sink as the workers open them. Either way
the drive's phases, turns and gates reach the front end through its
:class:`~engine.sink.RunSink` under the drive's run id (its task a field beside it), and what
the executor says beside them through :class:`~engine.executors.base.Notices`. A task's name
stays what people type (``/stop TASK``); the drive's run id is its key everywhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Protocol

from engine.errors import TurnstileError
from engine.executors.base import AgentFactory, Notices, same_place
from engine.gates import COMPLETE, HUMAN_INTERVENTION, DriveHandle, GateRefused, Gates
from engine.gates.records import TaskRecord
from engine.runs import Recovery, RunMode, RunSupervisor
from engine.runs.spec import ChatPlace, PlaceId
from engine.sink import RunSink, StatusUpdate
from engine.spend import Budget
from engine.store.runs import RunStatus
from engine.turn import AgentSession

__all__ = [
    "DriveExecutor",
    "DriveRefused",
    "DriveRequest",
    "DriveStarted",
    "LocalDrives",
]

_LOGGER = logging.getLogger(__name__)


class DriveRefused(TurnstileError):
    """A drive that cannot start; its text is said to the person who asked."""


@dataclass(frozen=True, slots=True)
class DriveRequest:
    """A drive asked for from a front end: ``project`` is where a new task is checked out
    from on the workers; ``summary`` describes a task created now; ``budget`` is what the
    drive's turns may spend (None: no cap)."""

    task: str
    place: ChatPlace
    project: str
    summary: str | None = None
    user_id: int | None = None
    budget: Budget | None = None


@dataclass(frozen=True, slots=True)
class DriveStarted:
    """A drive an executor took: the phase it starts at (``created``: the task is new),
    its run; on the workers, whether it was queued now or found there (``new``)."""

    task: str
    label: str | None = None
    created: bool = False
    run_id: str | None = None
    queued: bool = False
    new: bool = True


class DriveExecutor(Protocol):
    """Autopilot drives for a front end, wherever they execute."""

    async def start(self, request: DriveRequest) -> DriveStarted:
        """Start, resume or queue the drive of ``request.task``.

        Raises:
            DriveRefused: it cannot (already driven or complete, a bad name, no project, a
                budget its agent or its executor cannot keep to).
        """
        ...

    def state_of(self, task: str) -> str | None:
        """How the task is driven now, in words (``driving``, ``driving · warm``), else None."""
        ...

    async def stop(self, key: str, *, chat_id: PlaceId, by: str) -> bool:
        """Stop the drive ``key`` (a task's name or the drive's run id, here or on the
        workers) of the chat, stopped by the person named ``by``; False when
        the chat has none such."""
        ...

    async def stop_in(self, place: ChatPlace, *, by: str) -> list[str]:
        """Stop every drive of ``place``; their run ids."""
        ...

    async def wake(self, task: str) -> None:
        """A gate of ``task`` was decided: its drive goes on now."""
        ...

    async def recover(self, report: Recovery) -> None:
        """At start-up: resume (or follow again) the drives the recovery found."""
        ...

    async def shutdown(self, *, park: bool, preempt: asyncio.Event) -> None:
        """Start no new turn; without ``park`` let the running ones finish; park the drives."""
        ...

    async def park_all(self) -> None:
        """Park every drive now, pre-empting its turn."""
        ...


class LocalDrives:
    """Drives in this process, each in a task, their turns under the run supervisor."""

    def __init__(
        self,
        gates: Gates,
        *,
        supervisor: RunSupervisor,
        sink: RunSink,
        notices: Notices,
        agent_factory: AgentFactory,
    ) -> None:
        self.gates = gates
        self.supervisor = supervisor
        self.sink = sink
        self.notices = notices
        self.agent_factory = agent_factory
        self.drives: dict[str, DriveHandle] = {}
        self.places: dict[str, ChatPlace] = {}
        self.run_ids: dict[str, str] = {}  # a task → the run of its drive here
        self.watchers: dict[str, asyncio.Task[None]] = {}
        self._stopped_by: dict[str, str] = {}

    def _session(self, task: TaskRecord, session_id: str, resume: bool) -> AgentSession:
        """The agent session of a task's phase turns: the settings' default agent, in the
        task's folder."""
        settings = self.gates.settings
        agent: AgentSession = self.agent_factory(
            settings.default_agent,
            settings,
            cwd=task.workdir,
            session_id=session_id,
            resume=resume,
        )
        return agent

    async def start(self, request: DriveRequest) -> DriveStarted:
        name = request.task
        current = self.drives.get(name)
        if current is not None and not current.done:
            raise DriveRefused(f"Task {name} is already being driven. /status")
        if request.budget is not None:
            refused = request.budget.refusal_for(self.gates.settings.default_agent)
            if refused is not None:
                raise DriveRefused(f"Cannot keep to this budget: {refused}.")
        try:
            task = await self.gates.task(name)
            created = False
        except GateRefused:
            try:
                task = await self.gates.init_task(
                    name, summary=request.summary, started_by=request.user_id
                )
            except GateRefused as exc:
                raise DriveRefused(f"Cannot create task {name}: {exc}") from exc
            created = True
        if task.phase == COMPLETE:
            raise DriveRefused(f"Task {name} is already complete.")
        run_id = await self._run_for(name)
        handle = self._start(name, request.place, run_id, request.budget)
        await _opened(handle)
        return DriveStarted(name, task.label, created, run_id=run_id)

    async def _run_for(self, name: str) -> str:
        """The id of the run a drive of ``name`` starting now has: the parked (or crashed)
        one it resumes, else a new one's (known before the drive opens it, so everything
        said of the drive, its first words too, is said under it)."""
        last = await self.supervisor.runs.latest_task_run(RunMode.AUTOPILOT, name)
        if last is not None and last.status in (RunStatus.RUNNING, RunStatus.PARKED):
            return last.id
        return self.supervisor.reserve(RunMode.AUTOPILOT)

    def _start(
        self, name: str, place: ChatPlace, run_id: str, budget: Budget | None = None
    ) -> DriveHandle:
        self.places[name] = place
        self.run_ids[name] = run_id
        self.notices.follow(run_id, place, task=name)
        handle = self.gates.start_autopilot(
            name,
            self.sink,
            agent_factory=self._session,
            chat=(place.chat_id, place.thread_id),
            supervisor=self.supervisor,
            budget=budget,
            run_id=run_id,
        )
        self.drives[name] = handle
        self.watchers[name] = asyncio.create_task(self._watch(name, handle), name=f"ap-{name}")
        return handle

    async def _watch(self, name: str, handle: DriveHandle) -> None:
        try:
            outcome = await handle.wait()
            _LOGGER.info("autopilot drive ended %s", outcome.value, extra={"task": name})
        except asyncio.CancelledError:
            key = self._opened(name, handle)
            by = self._stopped_by.pop(name, None)
            if by is not None:
                # Its running phase's message says so (and loses its Stop button).
                await self.sink.update_status(
                    StatusUpdate(run_id=key, mode="autopilot", status="stopped", task=name)
                )
                await self.notices.notice(
                    key,
                    f"⏹ Autopilot for {name} stopped by {by}; the task keeps its phase. "
                    f"/autopilot {name} resumes it.",
                )
        except Exception as exc:
            key = self._opened(name, handle)
            _LOGGER.exception("autopilot drive failed", extra={"task": name})
            await self.notices.notice(key, f"⚠️ Autopilot for {name} failed: {str(exc)[:500]}")
        finally:
            if self.drives.get(name) is handle:
                self.drives.pop(name, None)

    def _opened(self, name: str, handle: DriveHandle) -> str:
        opened = handle.pilot.run_of(name) if handle.pilot is not None else None
        return opened or self.run_ids[name]

    def state_of(self, task: str) -> str | None:
        handle = self.drives.get(task)
        if handle is None or handle.done:
            return None
        # A warm session: its agent process stays between the drive's turns.
        return "driving · warm" if handle.pilot and handle.pilot.warm(task) else "driving"

    def _task_named(self, key: str) -> str:
        """The task ``key`` names: the run id of its drive, else ``key`` is its name."""
        for name, run_id in self.run_ids.items():
            handle = self.drives.get(name)
            opened = handle.pilot.run_of(name) if handle and handle.pilot else None
            if key in (run_id, opened):
                return name
        return key

    async def stop(self, key: str, *, chat_id: PlaceId, by: str) -> bool:
        name = self._task_named(key)
        handle = self.drives.get(name)
        place = self.places.get(name)
        if handle is None or handle.done or place is None or place.chat_id != chat_id:
            return False
        self._stopped_by[name] = by
        await handle.stop()
        watcher = self.watchers.get(name)
        if watcher is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        return True

    async def stop_in(self, place: ChatPlace, *, by: str) -> list[str]:
        stopped = []
        for name, at in list(self.places.items()):
            if same_place(at, place) and await self.stop(name, chat_id=place.chat_id, by=by):
                stopped.append(self.run_ids[name])
        return stopped

    async def wake(self, task: str) -> None:
        """(A drive here polls its gate: nothing to do.)"""

    async def recover(self, report: Recovery, *, elsewhere: frozenset[str] = frozenset()) -> None:
        """Resume the drives the supervisor's recovery lists (each once; a drive a terminal
        still runs is not in it), but those ``elsewhere`` (run ids driven on the workers)."""
        for run in report.drives:
            if run.task is None or run.chat_id is None or run.id in elsewhere:
                continue
            name = run.task
            current = self.drives.get(name)
            if current is not None and not current.done:
                continue
            try:
                task = await self.gates.task(name)
            except GateRefused:
                continue
            if task.phase in (COMPLETE, HUMAN_INTERVENTION):
                continue  # waiting for a person (or done): a person resumes it
            place = self.notices.place_of_task(name) or ChatPlace(run.chat_id, run.thread_id)
            self._start(name, place, run.id)
            _LOGGER.info("autopilot drive resumed at %s", task.label, extra={"task": name})

    async def shutdown(self, *, park: bool, preempt: asyncio.Event) -> None:
        # No new turn of a drive starts; without ``park`` the running ones finish.
        self.supervisor.park()
        if not park:
            await self.supervisor.wait_turns(preempt)
        for handle in list(self.drives.values()):
            await handle.stop(park=True)
        for watcher in list(self.watchers.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def park_all(self) -> None:
        self.supervisor.park()
        for handle in list(self.drives.values()):
            await handle.stop(park=True)


async def _opened(handle: DriveHandle) -> None:
    """Once the drive's run is recorded running (or the drive ended first: it could not
    start): what is said of the start, and any listing after it, finds the run."""
    if handle.pilot is None:
        return
    opened = asyncio.create_task(handle.pilot.opened.wait())
    try:
        await asyncio.wait({opened, handle.future}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        opened.cancel()
