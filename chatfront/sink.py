"""A chat front end's :class:`engine.sink.RunSink`: a run's texts, live status and gates as
chat messages, whatever the messenger.

It reads only typed data from the engine (a text's run, task and kind, a turn's output on
its own: :class:`engine.sink.RunText`; a :class:`~engine.sink.StatusUpdate`), never takes
the engine's text apart. What is the messenger's it is handed: the publisher that queues
messages (:class:`Publisher`) and the buttons of a live message (:class:`Controls`).
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from chatfront.publish import Publisher
from chatfront.text import excerpt, last_line, status_ended, status_text
from engine.chats.files import SentFile
from engine.errors import NotFoundError
from engine.humane import humane, words
from engine.runs import ChatPlace
from engine.runs.ids import short_id
from engine.sink import GateRequest, RunText, StatusUpdate, TextKind, summary_ref
from engine.store.runs import SqliteRunStore

__all__ = [
    "BotSink",
    "ChatPlace",
    "Controls",
    "Publisher",
    "humane",
    "last_line",
    "status_ended",
    "status_text",
    "words",
]

_LOGGER = logging.getLogger(__name__)

_EXCERPT_LINES: Final = 4

#: A message's buttons, as the messenger takes them (None: none).
Markup = dict[str, Any] | None


class Controls(Protocol):
    """The buttons of the sink's live messages, in the messenger's own terms."""

    def stop_drive(self, task: str) -> Markup:
        """The Stop button of the drive of ``task`` (None: the messenger cannot say it;
        ``/stop TASK`` still stops it)."""
        ...

    def stop_auto(self, run_id: str, *, paused: bool) -> Markup:
        """Stop, and Pause or (``paused``) Go on, of auto run ``run_id``."""
        ...

    def raise_budget(self, run_id: str, more: str) -> Markup:
        """ "Raise to ``more`` and go on", of a run its budget stopped."""
        ...


def _is_auto(run_id: str) -> bool:
    return run_id.startswith(("auto-", "auto:"))


@dataclass
class _PhaseView:
    """One autopilot phase's message while the sink owns it (until it becomes a gate)."""

    task: str
    phase: str
    ref: str
    state: str = "running"
    event: str | None = None
    excerpt: str | None = None
    gated: bool = False


@dataclass
class _WaveView:
    """A wave of sub-tasks as one live message: each sub-task's phase and state."""

    parent: str
    wave: int
    ref: str
    # sub-task → (its phase, its state), in the order they first reported.
    rows: dict[str, tuple[str, str]] = field(default_factory=dict)
    ended: bool = False


# The state of a phase as its message (and a wave's row) says it.
_PHASE_STATES: Final = {
    "running": "⏳ running…",
    "done": "✅ done",
    "complete": "✅ done",
    "stopped": "⏹ stopped",
    "human_intervention": "✋ waiting for a person",
}


def _natural(name: str) -> tuple[tuple[int, int | str], ...]:
    """A sort key that puts ``a2`` before ``a10``."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name)
    )


# A wave's row says more of a sub-task's end than "done".
_ROW_STATES: Final = {**_PHASE_STATES, "complete": "✅ complete"}


# Posts a gate in its chat (bot.autopilot).
GateHandler = Callable[[GateRequest, ChatPlace], Awaitable[None]]
# Sends files of a run's folder to its chat: (place, run id, workdir, paths) (bot.files).
FilesHandler = Callable[[ChatPlace, str, list[SentFile]], Awaitable[None]]
# What a completed task did, for its summary: plain lines (artifacts, turns, time) (bot.autopilot).
TaskFacts = Callable[[str], Awaitable[list[str]]]
# The chat of a run the runs table does not place (an autopilot drive's sub-task); None:
# not known to this resolver.
PlaceResolver = Callable[[str], Awaitable["ChatPlace | None"]]


@dataclass
class _AutoView:
    """What an auto run's one live message shows, and its turns' outputs so far."""

    status: StatusUpdate | None = None
    last: str | None = None
    turns: list[str] = field(default_factory=list)
    # Claims of completion not accepted ("🔎 Turn 3 claimed complete; not accepted. …").
    verdicts: list[RunText] = field(default_factory=list)


class BotSink:
    """Routes each run's reports to the chat (and topic) it belongs to.

    Few messages: an autopilot phase is one message, edited from "running" (with a Stop
    button) to "done" (a gated phase's message becomes its gate); a wave of sub-tasks is
    one message, a line per sub-task (their gates are messages of their own); an auto
    run is one live message, then its
    final report with the turns' outputs as one document. Warnings and questions are
    messages of their own.
    """

    def __init__(self, publisher: Publisher, runs: SqliteRunStore, controls: Controls) -> None:
        self._publisher = publisher
        self._runs = runs
        self._controls = controls
        self._places: dict[str, ChatPlace] = {}
        self._tasks: dict[str, ChatPlace] = {}
        # A drive's task → its run (its waves' messages are the drive's).
        self._task_runs: dict[str, str] = {}
        self._on_gate: GateHandler | None = None
        self._on_files: FilesHandler | None = None
        self._resolvers: list[PlaceResolver] = []
        self._task_facts: TaskFacts | None = None
        self._phases: dict[str, _PhaseView] = {}
        # A drive's waves of sub-tasks: (parent task, wave) → its one live message.
        self._waves: dict[tuple[str, int], _WaveView] = {}
        # A sub-task → its parent and wave (its reports go to the wave's message).
        self._subtasks: dict[str, tuple[str, int]] = {}
        self._autos: dict[str, _AutoView] = {}
        #: Set by bot.pause: the runs paused now, and what their message says of it.
        self.paused: dict[str, str] = {}
        # Tasks driven on the workers: their messages' refs are made from the drive's run
        # and turn, so a follower that starts again after a restart edits the same ones.
        self._keys: dict[str, str] = {}

    # -- what features plug in ---------------------------------------------------------

    def post_gates_with(self, handler: GateHandler) -> None:
        """The one feature that posts gates.

        Raises:
            RuntimeError: another one already does.
        """
        if self._on_gate is not None:
            raise RuntimeError("gates are already posted by another feature")
        self._on_gate = handler

    def send_files_with(self, handler: FilesHandler) -> None:
        """The one feature that sends a run's files.

        Raises:
            RuntimeError: another one already does.
        """
        if self._on_files is not None:
            raise RuntimeError("files are already sent by another feature")
        self._on_files = handler

    def describe_tasks_with(self, facts: TaskFacts) -> None:
        """What a completed task's summary says it did (its artifacts, turns, time)."""
        self._task_facts = facts

    def resolve_places_with(self, resolver: PlaceResolver) -> None:
        """Asked, in order, for a run the sink has not placed yet (before the runs table)."""
        self._resolvers.append(resolver)

    # -- places ------------------------------------------------------------------------

    def register(
        self,
        run_id: str,
        place: ChatPlace,
        *,
        task: str | None = None,
        key: str | None = None,
    ) -> None:
        """The reports of ``run_id`` (of ``task``, when it drives one) go to ``place``;
        ``key``: the drive's run on the workers (its messages' refs are made from it)."""
        self._places[run_id] = place
        if task is not None:
            self._tasks[task] = place
            self._task_runs[task] = run_id
            if key is not None:
                self._keys[task] = key

    def register_task(self, task: str, place: ChatPlace) -> None:
        """The reports of ``task``'s drives go to ``place`` (known before a drive's run)."""
        self._tasks[task] = place

    def place_of_task(self, task: str) -> ChatPlace | None:
        return self._tasks.get(task)

    async def place(self, run_id: str) -> ChatPlace | None:
        place = self._places.get(run_id)
        if place is not None:
            return place
        for resolve in self._resolvers:
            place = await resolve(run_id)
            if place is not None:
                self._places[run_id] = place
                return place
        try:
            run = await self._runs.get_run(run_id)
        except NotFoundError:
            return None
        if run.chat_id is None:
            return None
        place = ChatPlace(run.chat_id, run.thread_id)
        self._places[run_id] = place
        return place

    async def publish_text(self, run_id: str, text: str) -> None:
        await self.publish_run_text(RunText(run_id, text))

    async def publish_run_text(self, said: RunText) -> None:
        run_id, text, kind = said.run_id, said.text, said.kind
        place = await self.place(run_id)
        if place is None:
            _LOGGER.info("%s", text, extra={"run_id": run_id})
            return
        if said.task is not None and kind not in (TextKind.NOTE, TextKind.PERSON):
            await self._autopilot_text(said, said.task, place)
            return
        if _is_auto(run_id) and kind is TextKind.TURN:
            view = self._autos.setdefault(run_id, _AutoView())
            view.turns.append(text)
            view.last = last_line(said.body if said.body is not None else text) or None
            await self._show_auto(run_id, place)
            return
        if _is_auto(run_id) and kind is TextKind.VERDICT:
            # Folded: the live message's last line while the run goes on, the final
            # report's list when it ends, and the turns document after its turn.
            view = self._autos.setdefault(run_id, _AutoView())
            view.verdicts.append(said)
            if view.turns:
                view.turns[-1] += f"\n\n{text}"
            await self._show_auto(run_id, place)
            return
        if _is_auto(run_id) and kind is TextKind.FINAL:
            verdicts = self._autos.get(run_id, _AutoView()).verdicts
            if verdicts:
                text += "\n\nClaims of completion not accepted:\n" + "\n".join(
                    f"- {v.claim.said() if v.claim is not None else v.text}" for v in verdicts
                )
        await self._publisher.say(
            place.chat_id, humane(text), thread_id=place.thread_id, markdown=True, run_id=run_id
        )
        if _is_auto(run_id) and kind is TextKind.FINAL:
            await self._turns_document(run_id, place)

    async def _turns_document(self, run_id: str, place: ChatPlace) -> None:
        view = self._autos.pop(run_id, None)
        if view is None or not view.turns:
            return
        name = run_id
        count = len(view.turns)
        await self._publisher.document(
            place.chat_id,
            "\n\n".join(view.turns) + "\n",
            filename=f"turns-{name}.md",
            caption=f"🤖 Auto run {name}: the output of its {count} turn{'s' * (count != 1)}",
            thread_id=place.thread_id,
            run_id=run_id,
        )

    # -- autopilot, one message per phase ----------------------------------------------

    def phase_message(self, task: str, phase: str) -> str | None:
        """The ref of the message showing ``task``'s ``phase``, handed over to its gate
        (the gate message is that same message); None when there is none to hand over."""
        view = self._phases.get(task)
        if view is None or view.gated or view.phase != phase:
            return None
        view.gated = True
        return view.ref

    async def _autopilot_text(self, said: RunText, task: str, place: ChatPlace) -> None:
        run_id, kind = said.run_id, said.kind
        if task in self._subtasks:
            # A wave's sub-task: its row in the wave's message says it (its turns' output
            # is in its artifacts, its end in the parent's summary).
            if kind in (TextKind.STEP, TextKind.FINAL):
                await self._wave_row(task, "complete" if kind is TextKind.FINAL else "done")
            return
        if kind is TextKind.FINAL:
            # Under its head line, what the drive found the task changed (its stat, branch).
            await self._task_summary(task, place, run_id, said.body or "")
            return
        view = self._phases.get(task)
        if view is None or view.gated:
            return  # a step after the gate: its message says it already
        if kind is TextKind.TURN:
            body = (said.body if said.body is not None else said.text).strip()
            view.excerpt = excerpt(body, lines=_EXCERPT_LINES, chars=400) if body else None
        elif kind is TextKind.STEP:
            view.state = "done"
        await self._show_phase(view, place, run_id)

    async def _show_phase(self, view: _PhaseView, place: ChatPlace, run_id: str) -> None:
        state = _PHASE_STATES.get(view.state, words(view.state))
        if view.state == "running" and view.event and view.event != "phase turn":
            state = f"⏳ running: {words(view.event)}…"
        head = f"🛂 {view.task} · {words(view.phase)}\n{state}"
        await self._publisher.live(
            view.ref,
            head + ("\n\n" if view.excerpt else ""),
            chat_id=place.chat_id,
            thread_id=place.thread_id,
            run_id=run_id,
            markdown=view.excerpt,
            # While it runs, its Stop button stops the drive (gone when the phase ends:
            # that edit goes out before any later message).
            markup=self._controls.stop_drive(view.task) if view.state == "running" else None,
            # Handed to its gate meanwhile: the gate is this message now.
            when=lambda: not view.gated,
        )

    # -- autopilot, one message per wave of sub-tasks -------------------------------------

    async def _wave_status(
        self, update: StatusUpdate, parent: str, wave: int, place: ChatPlace
    ) -> None:
        task = update.task or update.run_id
        self._subtasks[task] = (parent, wave)
        if update.parent_run is not None:
            self._task_runs.setdefault(parent, update.parent_run)
        self._tasks.setdefault(parent, place)  # (a sub-task reports to its parent's chat)
        phase = (update.phase or "").split(":", 1)[0]
        await self._wave_row(task, update.status, phase or None)

    async def _wave_row(self, task: str, state: str, phase: str | None = None) -> None:
        parent, wave = self._subtasks[task]
        view = self._waves.get((parent, wave))
        if view is None or view.ended:
            key = self._keys.get(parent)
            mark = key if key is not None else secrets.token_hex(3)
            view = _WaveView(parent, wave, f"wave:{parent}:{wave}:{mark}")
            self._waves[(parent, wave)] = view
        was_phase, was_state = view.rows.get(task, ("", ""))
        if state == "done" and was_state != "running":
            return  # a step after its gate or its end: the row says it already
        view.rows[task] = (phase or was_phase, state)
        await self._show_wave(view)

    async def _show_wave(self, view: _WaveView) -> None:
        place = self._tasks.get(view.parent)
        if place is None:
            return
        count = len(view.rows)
        lines = [
            f"🛂 {view.parent} · wave {view.wave}: {count} sub-task{'s' if count != 1 else ''}"
        ]
        # In the order of their names (a1, a2, …, a10), not of their first reports: the
        # sub-tasks start at once, and whichever reports first must not reorder the rows.
        for task, (phase, state) in sorted(view.rows.items(), key=lambda r: _natural(r[0])):
            said = _ROW_STATES.get(state, words(state))
            # Complete or waiting for a person: the state is all there is to say (the
            # phase would say the same words again).
            alone = state == "complete" or phase in ("", state)
            lines.append(f"{task} · {said}" if alone else f"{task} · {words(phase)} · {said}")
        going = not view.ended and any(
            s not in ("complete", "stopped") for _, s in view.rows.values()
        )
        await self._publisher.live(
            view.ref,
            "\n".join(lines),
            chat_id=place.chat_id,
            thread_id=place.thread_id,
            run_id=self._task_runs.get(view.parent),
            # Its Stop button stops the whole drive (the parent's, as /stop PARENT does).
            markup=self._controls.stop_drive(view.parent) if going else None,
        )

    async def _end_waves(self, parent: str, state: str) -> None:
        """The drive of ``parent`` stopped or moved on: its waves' messages end (their
        rows still running say ``state``; their Stop buttons go)."""
        for (owner, _), view in list(self._waves.items()):
            if owner != parent or view.ended:
                continue
            view.rows = {t: (p, state if s == "running" else s) for t, (p, s) in view.rows.items()}
            view.ended = True
            await self._show_wave(view)

    async def _autopilot_status(self, update: StatusUpdate, place: ChatPlace) -> None:
        task = update.task or update.run_id
        if update.parent is not None:
            await self._wave_status(update, update.parent, update.wave or 1, place)
            return
        self._task_runs[task] = update.run_id
        phase = (update.phase or "").split(":", 1)[0]
        if any(p == task for p, _ in self._waves) and update.status != "awaiting_approval":
            # The parent moves on (or stops): its waves are over.
            await self._end_waves(task, "stopped" if update.status != "running" else "done")
        view = self._phases.get(task)
        if update.status == "running":
            if view is None or view.gated or view.phase != phase or view.state != "running":
                key = self._keys.get(task)
                mark = f"{key}:{update.turn}" if key is not None else secrets.token_hex(3)
                view = _PhaseView(task, phase, f"phase:{task}:{phase}:{mark}")
                self._phases[task] = view
            view.event = update.last_event
        elif view is not None and not view.gated and update.status != "awaiting_approval":
            view.state = update.status
        else:
            return
        await self._show_phase(view, place, update.run_id)

    async def _task_summary(self, task: str, place: ChatPlace, run_id: str, work: str) -> None:
        view = self._phases.pop(task, None)
        if view is not None and not view.gated and view.state == "running":
            view.state = "done"
            await self._show_phase(view, place, run_id)
        people = self._publisher.people
        decided = [
            f"{phase.replace('_', ' ')} approved by {people.name(by)}"
            for phase, state, by in await self._publisher.store.decisions_of(task)
            if state == "approved"
        ]
        text = f"🏁 Task {task} is complete."
        if decided:
            text += " " + "; ".join(decided) + "."
        if self._task_facts is not None:
            try:
                facts = await self._task_facts(task)
            except Exception:  # the summary still goes out, without what could not be read
                _LOGGER.exception("could not describe task %s", task)
                facts = []
            text += "".join(f"\n{line}" for line in facts)
        if work.strip():
            text += f"\n{work.strip()}"
        head = None
        if view is not None and view.excerpt:
            # The last phase's output, rendered (never raw Markdown).
            head = view.excerpt
            text += f"\n\nLast phase ({view.phase.replace('_', ' ')}), its output:\n"
        key = self._keys.get(task)
        await self._publisher.live(
            summary_ref(task, key) if key is not None else f"summary:{task}:{secrets.token_hex(3)}",
            text,
            chat_id=place.chat_id,
            thread_id=place.thread_id,
            run_id=run_id,
            markdown=head,
        )

    # -- auto runs: one live message ---------------------------------------------------

    async def _show_auto(self, run_id: str, place: ChatPlace) -> None:
        view = self._autos.setdefault(run_id, _AutoView())
        if view.status is None:
            return
        text = status_text(view.status)
        if view.last:
            text += f"\nLast turn: {view.last}"
        if view.status.status == "running":
            text += (
                f"\nMessages here or /steer add instructions; /stop {short_id(run_id)} stops it."
            )
            if view.verdicts:
                text += f"\n{view.verdicts[-1].text}"
            if run_id in self.paused:
                text += f"\n{self.paused[run_id]}"
        running = view.status.status == "running"
        await self._publisher.live(
            f"status:{run_id}",
            text,
            chat_id=place.chat_id,
            thread_id=place.thread_id,
            run_id=run_id,
            markup=(
                self._controls.stop_auto(run_id, paused=run_id in self.paused) if running else None
            ),
        )

    async def refresh_auto(self, run_id: str) -> bool:
        """Show an auto run's live message again (it was paused or goes on); False: this
        bot shows no live message of that run."""
        place = await self.place(run_id)
        if place is None or run_id not in self._autos:
            return False
        await self._show_auto(run_id, place)
        return True

    async def send_stored(self, run_id: str, files: list[SentFile]) -> None:
        place = await self.place(run_id)
        if place is None or self._on_files is None:
            _LOGGER.info(
                "files %s of run %s have no chat to go to", [f.given for f in files], run_id
            )
            return
        await self._on_files(place, run_id, files)

    async def update_status(self, update: StatusUpdate) -> None:
        place = await self.place(update.run_id)
        if place is None:
            return
        if update.mode == "autopilot":
            await self._autopilot_status(update, place)
            return
        if update.mode == "auto":
            self._autos.setdefault(update.run_id, _AutoView()).status = update
            await self._show_auto(update.run_id, place)
            return
        await self._publisher.live(
            f"status:{update.run_id}",
            status_text(update),
            chat_id=place.chat_id,
            thread_id=place.thread_id,
            run_id=update.run_id,
        )

    async def request_gate(self, request: GateRequest) -> None:
        place = self._tasks.get(request.task)
        if place is None and request.run_id is not None:
            place = await self.place(request.run_id)
        if place is None or self._on_gate is None:
            _LOGGER.warning(
                "gate for task %s phase %s has no chat to go to", request.task, request.phase
            )
            return
        await self._on_gate(request, place)
