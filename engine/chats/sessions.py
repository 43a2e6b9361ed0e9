"""The chat mode: a place (a chat, a forum topic) bound to one agent session, one turn a message.

Each bound place with work to do has one :class:`ChatRun`: a task running
:func:`engine.turn.run_session_loop` on the place's agent with a :class:`ChatChannel`
whose queue is the front end's (:class:`~engine.chats.records.ChatQueue`, kept in the
database). ``next_prompt`` takes the oldest queued message and records its turn as started
in the same transaction; the front end's :meth:`ChatFront.publish_turn` commits the answer,
what it sends and the message's completion in one transaction.

Where the turns run is the executor's (:mod:`engine.executors.chats`): the same runs,
channel, stops and parking drive an agent process here or a session on the workers.

Long: one class owns every run of the mode (binding, queueing, steering, stopping,
resuming, parking) and the run's life from start to end is one method, so the module
holds the whole mode in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final, Protocol

from engine.agents.stream import AgentEvent, EventKind, JsonStreamAgent
from engine.aio import raise_if_cancelled
from engine.approvals import ApprovalRoute
from engine.chats.records import Binding, ChatQueue, PromptRow
from engine.errors import (
    ChannelError,
    ConfigError,
    GitError,
    StoreUnreachableError,
    TurnError,
    TurnPreempted,
)
from engine.executors.chats import ChatAgent, ChatAgents
from engine.humane import format_elapsed
from engine.logs import log_context
from engine.process import TurnProcess
from engine.runs import ChatPlace, RunMode, RunSupervisor
from engine.runs.spec import PlaceId
from engine.settings import Settings
from engine.store.backend import AnyDatabase, wait_reachable
from engine.store.runs import RunStatus, SqliteRunStore, TurnState
from engine.turn import BaseChannel, Closed, Idle, NextPrompt, Ready, TurnOutput, run_session_loop
from engine.workspace import WorkspaceError, WorkspaceManager, WorkspaceStore
from engine.workspace.manager import DEFAULT_PROJECT
from engine.workspace.projects import Project

__all__ = ["ChatChannel", "ChatFront", "ChatRun", "ChatSessions", "SubmitResult", "TurnView"]

_LOGGER = logging.getLogger(__name__)

#: A place as the chat mode keys its runs: the chat and its topic (None: no topic).
PlaceKey = tuple[PlaceId, PlaceId | None]

_STATUS_DEBOUNCE: Final = 0.05


class TurnView(Protocol):
    """What a front end shows of one running turn (the bot: its progress message)."""

    def on_event(self, event: AgentEvent) -> bool:
        """Take in the agent's progress; True when it is worth showing now."""
        ...

    async def show(self) -> None: ...

    async def finish(self, final: str) -> None:
        """The turn ended: ``final`` says how (done, stopped, failed)."""
        ...


class ChatFront(Protocol):
    """What the chat mode asks of the front end its places belong to."""

    def open_turn(self, run: ChatRun, prompt: PromptRow) -> TurnView:
        """Start showing the turn that answers ``prompt`` (without holding it up)."""
        ...

    async def publish_turn(
        self, run: ChatRun, prompt_id: int, turn_id: int, out: TurnOutput, view: TurnView | None
    ) -> None:
        """The turn's answer and the files it hands over, queued to go out in the
        transaction that records the turn as finished and its message as done."""
        ...

    async def say(self, binding: Binding, text: str, *, run_id: str) -> None:
        """Tell the place something about its run."""
        ...

    def name(self, user_id: int) -> str:
        """How the place calls a person."""
        ...


@dataclass(frozen=True, slots=True)
class SubmitResult:
    queued: bool
    waiting: int
    busy: bool
    steered: bool = False


class ChatChannel(BaseChannel):
    """The chat's persistent queue as a :class:`~engine.turn.Channel`."""

    def __init__(self, run: ChatRun) -> None:
        super().__init__(f"chat:{run.binding.chat_id}:{run.binding.thread_id}")
        self._run = run
        self.closing = False

    async def next_prompt(self) -> NextPrompt:
        run = self._run
        if self.closing:
            return Closed()
        taken = await run.store.take_prompt(
            run.binding.chat_id, run.binding.thread_id, run.run_id, run.turn + 1
        )
        if taken is None:
            return Idle()
        prompt, turn_id = taken
        run.turn += 1
        run.current = (prompt.id, turn_id, prompt.update_id)
        run.turn_started = time.time()
        # What the front end shows of the turn (the bot: a progress message under the
        # message that asked), opened before the turn runs.
        run.progress = run.front.open_turn(run, prompt)
        run.status_wanted.set()
        return Ready(prompt.body)

    async def publish_output(self, out: TurnOutput) -> None:
        run = self._run
        assert run.current is not None
        prompt_id, turn_id, _ = run.current
        progress = run.progress
        # The answer (and the files it hands over) recorded with the turn, in one go.
        await run.front.publish_turn(run, prompt_id, turn_id, out, progress)
        run.turns_done += 1  # on record: the answer may be out before the lines below
        if out.stderr_tail and run.runs_dir is not None:
            # Beside the store's copy: the runs folder is where people look for a run's files.
            await asyncio.to_thread(_keep_stderr, run.runs_dir / run.run_id, run.turn, out)
        if progress is not None:
            code = out.exit_code
            await progress.finish("✅ done" if code in (None, 0) else f"⚠️ exited with code {code}")
        run.current = None
        run.turn_started = None
        run.last_event = None
        run.status_wanted.set()

    def close(self) -> None:
        self.closing = True
        self.notify_inbound()


@dataclass
class ChatRun:
    """One running loop of a bound chat."""

    binding: Binding
    run_id: str
    agent: ChatAgent
    store: ChatQueue
    runs: SqliteRunStore
    front: ChatFront
    started: float = field(default_factory=time.time)
    turn: int = 0
    turns_done: int = 0
    current: tuple[int, int, int | None] | None = None
    turn_started: float | None = None
    stop_by: int | None = None
    parking: bool = False
    task: asyncio.Task[None] | None = None
    status_wanted: asyncio.Event = field(default_factory=asyncio.Event)
    last_event: str | None = None
    runs_dir: Path | None = None
    progress: TurnView | None = None
    prestarting: asyncio.Task[None] | None = None
    channel: ChatChannel = field(init=False)

    async def record_process(self, process: TurnProcess) -> None:
        """Record the running turn's processes with it (a start-up after a crash kills them)."""
        if self.current is not None:
            await self.runs.record_turn_process(self.current[1], process)

    def __post_init__(self) -> None:
        self.channel = ChatChannel(self)

    @property
    def key(self) -> PlaceKey:
        return (self.binding.chat_id, self.binding.thread_id)

    @property
    def busy(self) -> bool:
        return self.current is not None

    def on_agent_event(self, event: AgentEvent) -> None:
        """The agent's progress (real CLIs): its tool calls and text show in the turn's
        progress message; the last tool call in /status."""
        if self.progress is not None and self.progress.on_event(event):
            self.status_wanted.set()
        if event.kind is EventKind.TOOL_USE:
            detail = " ".join(event.text.split())[:80]
            self.last_event = f"🔧 {event.tool or 'tool'}" + (f": {detail}" if detail else "")
            self.status_wanted.set()
        elif event.kind is EventKind.TOOL_RESULT and event.is_error:
            self.last_event = f"⚠️ {event.tool or 'tool'} failed"
            self.status_wanted.set()

    def status_text(self, final: str | None = None) -> str:
        b = self.binding
        head = f"💬 chat session {self.run_id} · {b.agent} · {b.project}"
        if getattr(self.agent, "resident", False):
            head += " · warm (agent process kept between turns)"
        if final is not None:
            elapsed = format_elapsed(time.time() - self.started)
            return f"{head}\n{final} · {elapsed}"
        if self.turn_started is not None:
            elapsed = format_elapsed(time.time() - self.turn_started)
            state = f"⏳ a turn is running · {elapsed}"
            if self.last_event:
                state += f"\n{self.last_event}"
        else:
            state = "✅ idle"
        return f"{head}\n{state}"

    async def show_status(self, final: str | None = None) -> None:
        """The running turn's progress message (finalized with ``final`` when the run ends;
        a chat session has no status message of its own: /status tells)."""
        if self.progress is None:
            return
        if final is not None:
            await self.progress.finish(final)
        elif self.busy:
            await self.progress.show()


class ChatSessions:
    """Owns every chat run: binding, queueing, stopping, resuming, parking."""

    def __init__(
        self,
        *,
        settings: Settings,
        store: ChatQueue,
        runs: SqliteRunStore,
        front: ChatFront,
        agents: ChatAgents,
        supervisor: RunSupervisor,
        workspaces: WorkspaceStore,
        status_tick: float = 1.0,
        db: AnyDatabase | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.workspaces = workspaces
        self.runs = runs
        self.front = front
        self.agents = agents
        self.supervisor = supervisor
        self.status_tick = status_tick
        # The database to wait for after an outage.
        self.db = db
        self.active: dict[PlaceKey, ChatRun] = {}
        # Where a new run's tool calls ask a person (set by the front end).
        self.approvals: Callable[[str, Binding], Awaitable[ApprovalRoute | None]] | None = None
        self._closing = False
        self._lock = asyncio.Lock()
        self._submitting: dict[PlaceKey, asyncio.Lock] = {}

    # -- binding -----------------------------------------------------------------------

    async def workdir_for(
        self,
        project: str,
        run_key: str,
        place: ChatPlace | None = None,
        *,
        branch: str | None = None,
        worktree: bool = True,
    ) -> Path:
        """Where a run works: a git worktree of its own for a configured project
        (``TURNSTILE_PROJECTS``, see docs/workspaces.md); for ``default`` in ``place``, a
        worktree of that chat's (or topic's) own workspace, or without ``worktree`` (a chat
        session) the workspace itself; else a folder under the workspaces root. A
        workspace or folder made now is a git repository with a first commit.

        Raises:
            ConfigError: a malformed project setting, a reserved name, or git failed.
        """
        manager = WorkspaceManager.from_settings(self.settings, store=self.workspaces)
        checkout: str | Project = project
        what = project
        if project not in {p.name for p in manager.projects}:
            if project != DEFAULT_PROJECT or place is None:
                try:
                    # A git repository from the start: what completion is judged on.
                    return await manager.plain_repository(project)
                except GitError as exc:
                    raise ConfigError(
                        f"cannot make the folder of {project} a git repository: {exc}"
                    ) from exc
            what = "this chat's own workspace"
            try:
                if not worktree:
                    return await manager.place_repository(place.chat_id, place.thread_id)
                checkout = await manager.place_project(place.chat_id, place.thread_id)
            except GitError as exc:
                raise ConfigError(f"cannot make {what} a git repository: {exc}") from exc
        try:
            workspace = await manager.provision(run_key, checkout, branch=branch)
        except (WorkspaceError, GitError) as exc:
            raise ConfigError(f"cannot check out {what}: {exc}") from exc
        return workspace.path

    async def bind(
        self,
        chat_id: PlaceId,
        thread_id: PlaceId | None,
        *,
        agent: str,
        project: str,
        user_id: int | None,
        model: str | None = None,
        branch: str | None = None,
    ) -> Binding:
        """Bind the chat to a new agent session (the old one, if any, is closed).

        Raises:
            ConfigError: the project cannot be used.
        """
        old = self.active.get((chat_id, thread_id))
        if old is not None and old.busy:
            # A handler never waits for a turn: the person decides (/stop or wait).
            raise ConfigError(
                f"a turn of run {old.run_id} is running here; /stop it or wait for it first"
            )
        session_id = str(uuid.uuid4())
        problem = self.agents.place_problem(project, branch)
        if problem is not None:
            raise ConfigError(problem)
        # Remote: no folder here, it is checked out on the worker of the first turn.
        workdir = ""
        if not self.agents.remote:
            workdir = str(
                await self.workdir_for(
                    project,
                    f"chat-{session_id[:8]}",
                    ChatPlace(chat_id, thread_id),
                    branch=branch,
                    worktree=False,
                )
            )
        if old is not None:
            old.channel.close()
            if old.task is not None:
                await asyncio.wait({old.task})
        return await self.store.bind(
            chat_id,
            thread_id,
            agent=agent,
            project=project,
            workdir=workdir,
            session_id=session_id,
            user_id=user_id,
            model=model,
        )

    async def set_model(
        self, chat_id: PlaceId, thread_id: PlaceId | None, model: str | None
    ) -> None:
        """The chat's model from its next turn on: an idle run ends (the next message
        starts one with the model, resuming the same session).

        Raises:
            ConfigError: a turn is running.
        """
        run = self.active.get((chat_id, thread_id))
        if run is not None and run.busy:
            raise ConfigError(
                f"a turn of run {run.run_id} is running here; /stop it or wait for it first"
            )
        await self.store.set_binding_model(chat_id, thread_id, model)
        if run is not None:
            run.channel.close()
            if run.task is not None:
                await asyncio.wait({run.task})

    # -- prompts -----------------------------------------------------------------------

    async def submit(
        self,
        chat_id: PlaceId,
        thread_id: PlaceId | None,
        *,
        update_id: int | None,
        user_id: int | None,
        text: str,
    ) -> SubmitResult:
        """Queue one message as the next turn; start the chat's run when needed.

        A message arriving while a warm session's turn runs goes to that turn instead
        (``steered``), when the agent takes it up and no earlier message of the session
        waits in the queue: messages are taken in the order they were sent.
        """
        # One message of a session at a time: the next one is decided only once this one
        # is queued, steered, or back in the queue because the turn ended first.
        async with self._submitting.setdefault((chat_id, thread_id), asyncio.Lock()):
            steered = await self._steer(chat_id, thread_id, update_id, user_id, text)
            if steered is not None:
                return steered
            queued, waiting = await self.store.queue_prompt(
                chat_id,
                thread_id,
                update_id=update_id,
                user_id=user_id,
                body=text,
                depth=self.settings.queue_depth,
            )
        run = self.active.get((chat_id, thread_id))
        busy = run is not None and run.busy
        if queued:
            await self.ensure_running(chat_id, thread_id)
        return SubmitResult(queued=queued, waiting=waiting, busy=busy)

    async def _steer(
        self,
        chat_id: PlaceId,
        thread_id: PlaceId | None,
        update_id: int | None,
        user_id: int | None,
        text: str,
    ) -> SubmitResult | None:
        run = self.active.get((chat_id, thread_id))
        steer = getattr(run.agent, "steer", None) if run is not None and run.busy else None
        if run is None or steer is None or not run.agent.preempt.active:
            return None
        if await self.store.queued_count(chat_id, thread_id):
            # An earlier message waits for the next turn (it came while this turn was
            # starting, or before a restart): this one queues behind it.
            return None
        prompt_id = await self.store.hold_for_steering(
            chat_id, thread_id, update_id=update_id, user_id=user_id, body=text
        )
        if prompt_id is None:
            return SubmitResult(queued=True, waiting=0, busy=True)
        delivered = bool(await steer(text))
        await self.store.steering_done(prompt_id, delivered=delivered)
        if not delivered:
            # The turn ended first: the message waits for the next turn as usual.
            run.channel.notify_inbound()
            return SubmitResult(queued=True, waiting=0, busy=run.busy)
        _LOGGER.info("message delivered to the running turn", extra={"run_id": run.run_id})
        return SubmitResult(queued=False, waiting=0, busy=True, steered=True)

    async def ensure_running(self, chat_id: PlaceId, thread_id: PlaceId | None) -> ChatRun | None:
        """Wake the chat's run, or start one for its binding."""
        async with self._lock:
            run = self.active.get((chat_id, thread_id))
            if run is not None:
                run.channel.notify_inbound()
                return run
            if self._closing:
                return None
            binding = await self.store.binding(chat_id, thread_id)
            if binding is None:
                return None
            return await self._start(binding)

    async def _start(self, binding: Binding) -> ChatRun:
        # Minted first: the approval route of its tool calls is keyed by it.
        run_id = self.supervisor.reserve(RunMode.CHAT)
        route = await self.approvals(run_id, binding) if self.approvals is not None else None
        settings = self.settings
        if binding.model is not None:
            settings = settings.model_copy(update={"agent_model": binding.model})

        async def say(text: str) -> None:
            await self.front.say(binding, text, run_id=run_id)

        agent = await self.agents.open(run_id, binding, settings, approval=route, say=say)
        await self.supervisor.open_run(
            RunMode.CHAT,
            run_id=run_id,
            agent=binding.agent,
            session_id=binding.session_id,
            workdir=binding.workdir or None,
            chat=ChatPlace(binding.chat_id, binding.thread_id),
        )
        await self.store.set_binding_run(binding.chat_id, binding.thread_id, run_id)
        run = ChatRun(
            binding=binding,
            run_id=run_id,
            agent=agent,
            store=self.store,
            runs=self.runs,
            front=self.front,
            runs_dir=self.settings.runs_dir,
        )
        if isinstance(agent, JsonStreamAgent):
            agent.on_event = run.on_agent_event
        agent.preempt.on_spawn = run.record_process
        self.active[run.key] = run
        # The task copies the context: every line it logs carries the run and chat ids.
        with log_context(run_id=run_id, chat_id=binding.chat_id):
            run.task = asyncio.create_task(self._drive(run), name=f"chat-run-{run_id}")
        _LOGGER.info("chat run started", extra={"run_id": run_id, "chat_id": binding.chat_id})
        return run

    async def _drive(self, run: ChatRun) -> None:
        status = RunStatus.COMPLETED
        final = "⏹ closed"
        ticker = asyncio.create_task(self._tick(run), name=f"chat-tick-{run.run_id}")
        # A resident process starts while the first prompt is taken and its progress posted.
        prestart = getattr(run.agent, "prestart", None)
        if prestart is not None:
            run.prestarting = asyncio.create_task(prestart(), name=f"prestart-{run.run_id}")
        try:
            await run_session_loop(self.supervisor.attach(run.run_id, run.agent), run.channel)
            if run.parking or self._closing:
                status, final = RunStatus.PARKED, "⏸ parked (the bot is restarting)"
        except TurnPreempted:
            status, final = await self._preempted(run)
        except asyncio.CancelledError:
            status, final = await self._preempted(run)
            if not (run.parking or run.stop_by is not None):
                raise
        except (TurnError, ChannelError) as exc:
            status, final = RunStatus.ERROR, "⚠️ failed"
            await self._failed(run, exc)
        except StoreUnreachableError as exc:
            # The database went away under the run (an outage): once it is back the turn
            # is said cut off (its answer could not be kept) and the run ends; messages
            # that wait go on in a new run.
            _LOGGER.warning("chat run cut off: %s", exc, extra={"run_id": run.run_id})
            if exc.retryable and self.db is not None:
                await wait_reachable(self.db)
            status, final = RunStatus.ERROR, "⚠️ cut off"
            with contextlib.suppress(Exception):
                await self._failed(
                    run,
                    StoreUnreachableError(
                        "the database went away while it ran, so its answer was lost; "
                        "send the message again to retry",
                        target=exc.target,
                    ),
                )
        except Exception as exc:
            # A store or library failure ends the run visibly, never silently; the next
            # message starts a new run (no automatic restart into the same failure).
            _LOGGER.exception("chat run crashed", extra={"run_id": run.run_id})
            status, final = RunStatus.CRASHED, "⚠️ crashed"
            with contextlib.suppress(Exception):
                await self._failed(run, exc)
        finally:
            self.supervisor.detach(run.run_id)
            if run.prestarting is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await run.prestarting
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await ticker
            self.active.pop(run.key, None)
            # A warm session's resident process ends with its run; a worker's lets go.
            with contextlib.suppress(Exception):
                await self.agents.close(run.agent, stopped=status is RunStatus.STOPPED)
            with contextlib.suppress(Exception):
                await self.runs.update_run(run.run_id, status=status, finished_at=time.time())
                await self.store.set_binding_run(run.binding.chat_id, run.binding.thread_id, None)
                await run.show_status(final)
            _LOGGER.info("chat run ended %s", status.value, extra={"run_id": run.run_id})
        # Messages accepted while the run failed still get their turn, in a new run.
        if (
            status is RunStatus.ERROR
            and not self._closing
            and await self.store.queued_count(*run.key)
        ):
            await self.ensure_running(*run.key)

    async def _preempted(self, run: ChatRun) -> tuple[RunStatus, str]:
        b = run.binding
        if run.current is not None:
            prompt_id, turn_id, _ = run.current
            if run.parking:
                await self.runs.fail_turn(turn_id, TurnState.INTERRUPTED, "parked by a shutdown")
                await self.store.end_prompt(prompt_id, "queued", requeue=True)
            else:
                await self.runs.fail_turn(turn_id, TurnState.INTERRUPTED, "stopped by a person")
                await self.store.end_prompt(prompt_id, "stopped")
        if run.parking:
            return RunStatus.PARKED, "⏸ parked (the bot is restarting)"
        dropped = await self.store.drop_queued(b.chat_id, b.thread_id)
        note = f"⏹ Run {run.run_id} stopped"
        if run.current is not None:
            note += f" during turn {run.turn}"
        if run.stop_by is not None:
            note += f" by {self.front.name(run.stop_by)}"
        note += "."
        if dropped:
            note += f" {dropped} queued message(s) were discarded; send them again if needed."
        # On record before it is said: a /status right after the note shows it stopped.
        await self.runs.update_run(run.run_id, status=RunStatus.STOPPED, finished_at=time.time())
        await self.front.say(b, note, run_id=run.run_id)
        run.current = None
        if run.stop_by is not None:
            return RunStatus.STOPPED, f"⏹ stopped by {self.front.name(run.stop_by)}"
        return RunStatus.STOPPED, "⏹ stopped"

    async def _failed(self, run: ChatRun, exc: Exception) -> None:
        b = run.binding
        if run.current is not None:
            prompt_id, turn_id, _ = run.current
            await self.runs.fail_turn(turn_id, TurnState.FAILED, str(exc)[:500])
            await self.store.end_prompt(prompt_id, "failed")
        run.current = None
        _LOGGER.warning("chat turn failed: %s", exc, extra={"run_id": run.run_id})
        await self.front.say(
            b, f"⚠️ Turn {run.turn} of run {run.run_id} failed: {exc}", run_id=run.run_id
        )

    async def _tick(self, run: ChatRun) -> None:
        """Writes the run's status when asked, and every ``status_tick`` while a turn runs."""
        while True:
            with contextlib.suppress(TimeoutError):
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that
                # lands as the event fires, and this task then never ends (shutdown hangs).
                async with asyncio.timeout(self.status_tick if run.busy else None):
                    await run.status_wanted.wait()
            # A short pause coalesces bursts and keeps this write off a turn's start-up.
            await asyncio.sleep(_STATUS_DEBOUNCE)
            run.status_wanted.clear()
            try:
                await run.show_status()
            except StoreUnreachableError as exc:  # an outage: the next tick writes it
                raise_if_cancelled()
                _LOGGER.warning("cannot show the run's status yet: %s", exc)

    def follow_migration(self, old_chat: PlaceId, new_chat: PlaceId) -> None:
        """Runs of a group that became a supergroup now answer in the new chat."""
        for key, run in list(self.active.items()):
            if key[0] == old_chat:
                run.binding = replace(run.binding, chat_id=new_chat)
                self.active.pop(key)
                self.active[(new_chat, key[1])] = run

    # -- stopping ----------------------------------------------------------------------

    def find(self, run_id: str) -> ChatRun | None:
        return next((r for r in self.active.values() if r.run_id == run_id), None)

    async def stop(self, run: ChatRun, by: int | None) -> None:
        """Pre-empt the run's turn at once and end the run ``stopped``."""
        run.stop_by = by
        if run.agent.preempt.active:
            await run.agent.preempt.stop()
        elif run.task is not None and not run.task.done():
            run.task.cancel()
        if run.task is not None:
            await asyncio.wait({run.task})

    # -- start-up and shutdown ---------------------------------------------------------

    async def resume(self) -> None:
        """Start a run for every bound chat that has queued messages (after a restart)."""
        for chat_id, thread_id in await self.store.chats_with_queued():
            await self.ensure_running(chat_id, thread_id)

    async def shutdown(self, *, park: bool) -> None:
        """Stop taking turns. ``park`` pre-empts running turns (re-queued for the next start);
        otherwise running turns finish first. Queued messages stay queued either way."""
        self._closing = True
        runs = list(self.active.values())
        for run in runs:
            run.channel.close()
        if park:
            await self.park_all()
        tasks = [r.task for r in runs if r.task is not None]
        if tasks:
            await asyncio.wait(tasks)

    async def park_all(self) -> None:
        for run in list(self.active.values()):
            run.parking = True
            if run.task is not None and not run.task.done():
                run.task.cancel()


def _keep_stderr(folder: Path, seq: int, out: TurnOutput) -> None:
    """Write the turn's stderr tail (already redacted) to ``folder/turn-SEQ.stderr.txt``."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / f"turn-{seq}.stderr.txt"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(out.stderr_tail)
