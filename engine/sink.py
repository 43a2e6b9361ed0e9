"""How runs report to a front end (the terminal, the Telegram bot) without knowing it.

Auto mode and the autopilot driver take a :class:`RunSink`; the terminal uses
:class:`LogSink`, the bot implements the protocol with chat messages.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

from engine.chats.files import SentFile
from engine.errors import StoreError
from engine.handover import collect_paths
from engine.store.events import EventKind, add_event, events_written

if TYPE_CHECKING:
    from engine.store.backend import AnyDatabase

__all__ = [
    "FileSink",
    "GateRequest",
    "KindSink",
    "LogSink",
    "NullSink",
    "RecordingSink",
    "RefusedClaim",
    "RunSink",
    "RunText",
    "SendRules",
    "StatusUpdate",
    "StoredFileSink",
    "TextKind",
    "TurnDone",
    "publish",
    "publish_said",
    "recording",
    "sent_files",
    "summary_ref",
]

_LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StatusUpdate:
    """A run's live status: what a status message shows, edited in place."""

    run_id: str
    mode: str
    status: str
    phase: str | None = None
    turn: int = 0
    max_turns: int | None = None
    started_at: float | None = None
    last_event: str | None = None
    task: str | None = None
    spent: str | None = None  # what the run cost so far, in words (None: nothing known)
    # An auto run's round (its max_turns counts rounds; ``turn`` is its agent turns so far).
    round: int = 0
    parent: str | None = None  # a wave's sub-task: the task it belongs to
    wave: int | None = None  # and the wave it is in
    parent_run: str | None = None  # and the run of the drive it belongs to
    # The phase of the agent turn running now, as a person reads it ("Execute"); None
    # between turns (an auto run's; ``turn`` is then the turn running).
    running: str | None = None


@dataclass(frozen=True, slots=True)
class GateRequest:
    """A phase waits for a person's approval of one artifact."""

    task: str
    phase: str
    artifact_name: str
    artifact_path: Path
    sha256: str
    excerpt: str
    run_id: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def short_hash(self) -> str:
        return self.sha256[:12]


class RunSink(Protocol):
    """Where a run's texts, status and gate requests go."""

    async def publish_text(self, run_id: str, text: str) -> None:
        """A message for the people following the run (turn output, warnings, results)."""
        ...

    async def update_status(self, update: StatusUpdate) -> None:
        """The run's live status changed."""
        ...

    async def request_gate(self, request: GateRequest) -> None:
        """A gate opened: show the artifact and ask for approval."""
        ...


@runtime_checkable
class FileSink(Protocol):
    """A sink that can hand files of the run's folder to the people following the run
    (the agent's ``TURNSTILE-SEND: path`` lines)."""

    async def send_files(self, run_id: str, workdir: Path, paths: list[str]) -> None:
        """Send ``paths`` (relative to ``workdir``, untrusted: checked by the sink)."""
        ...


@runtime_checkable
class StoredFileSink(Protocol):
    """A sink that hands over files a run's turn read and stored where it ran (in this
    process or on a worker: :mod:`engine.handover`)."""

    async def send_stored(self, run_id: str, files: list[SentFile]) -> None:
        """Send ``files`` (each stored, or why it was refused) to the people following."""
        ...


@dataclass(frozen=True, slots=True)
class SendRules:
    """How files a run hands over are read: the largest sent, and what hides secrets."""

    max_bytes: int
    redact: Callable[[str], str]


class TextKind(StrEnum):
    """What a published text is, so a front end may fold it instead of posting it."""

    NOTE = "note"  # people should see it now (a warning, a problem, a question)
    PERSON = "person"  # the run waits for a person, and why (a front end may say it itself)
    TURN = "turn"  # one turn's output
    STEP = "step"  # the run moved on (a phase done, a gate passed)
    VERDICT = "verdict"  # a claim of completion was checked and not accepted (why)
    FINAL = "final"  # the run's final report (a task complete, an auto run's result)


@dataclass(frozen=True, slots=True)
class TurnDone:
    """A finished agent turn of an auto run, as its head line says it, and what it said."""

    turn: int  # the agent turn
    round: int  # the run's round, which ``max_turns`` counts
    max_turns: int
    phase: str  # the phase, as a person reads it ("Execute")
    exit_code: int
    output: str  # the head of its output that is shown
    size: int  # the whole output's length (past ``output``'s: the transcript has the rest)
    error: str | None = None  # the end of its error output, when it failed

    @property
    def cut(self) -> bool:
        """Whether the output goes on past what is shown."""
        return self.size > len(self.output)


@dataclass(frozen=True, slots=True)
class RefusedClaim:
    """A claim of completion the engine checked and did not accept, and why."""

    turn: int  # the agent turn that claimed it
    why: str  # what the evidence lacks, in words ("evidence: no commit since ...")

    def said(self) -> str:
        """The claim and why it is not accepted, as one sentence of its own."""
        why = self.why[:1].upper() + self.why[1:]
        return f"Turn {self.turn} claimed complete; not accepted. {why}."


@dataclass(frozen=True, slots=True)
class RunText:
    """A text for the people following run ``run_id``, and what it is.

    ``task`` is the task the run drives (an autopilot drive or a wave's sub-task; None for
    a chat session or an auto run). ``body`` is what ``text`` says under its head line, on
    its own (a turn's output, what a complete task's drive found it changed); ``turn`` is
    what an auto run's turn text says of its turn, ``claim`` what a verdict text says of
    the claim it refuses: so a front end never takes ``text`` apart.
    """

    run_id: str
    text: str
    kind: TextKind = TextKind.NOTE
    task: str | None = None
    body: str | None = None
    turn: TurnDone | None = None
    claim: RefusedClaim | None = None


@runtime_checkable
class KindSink(Protocol):
    """A sink that wants to know what each text is (the bot folds turns into one message)."""

    async def publish_run_text(self, said: RunText) -> None:
        """Like :meth:`RunSink.publish_text`, with what the text is and whose."""
        ...


def summary_ref(task: str, key: str) -> str:
    """The ref of the completion summary of ``task``'s drive ``key`` (a run on the workers,
    followed again after a restart: its summary is posted once)."""
    return f"summary:{task}:{key}"


async def publish(
    sink: RunSink,
    run_id: str,
    text: str,
    kind: TextKind = TextKind.NOTE,
    *,
    task: str | None = None,
    body: str | None = None,
    turn: TurnDone | None = None,
    claim: RefusedClaim | None = None,
) -> None:
    """Publish ``text`` through ``sink``, with what it is (:class:`RunText`) when the sink
    takes that."""
    await publish_said(sink, RunText(run_id, text, kind, task, body, turn, claim))


async def publish_said(sink: RunSink, said: RunText) -> None:
    """Publish ``said`` through ``sink``: all of it when the sink takes a :class:`RunText`,
    else its text."""
    if _takes_kinds(type(sink)):
        await cast(KindSink, sink).publish_run_text(said)
    else:
        await sink.publish_text(said.run_id, said.text)


@functools.cache
def _takes_kinds(sink: type) -> bool:
    """Whether sinks of this class take a :class:`RunText` (a :class:`KindSink`): asked
    once per class (every text of every turn asks, and ``isinstance`` on a protocol walks
    its members each time)."""
    return callable(getattr(sink, "publish_run_text", None))


class NullSink:
    """Discards everything."""

    async def publish_text(self, run_id: str, text: str) -> None:
        return None

    async def update_status(self, update: StatusUpdate) -> None:
        return None

    async def request_gate(self, request: GateRequest) -> None:
        return None


class LogSink:
    """The terminal's sink: everything goes to the log."""

    async def send_stored(self, run_id: str, files: list[SentFile]) -> None:
        for file in files:
            if file.refused:
                _LOGGER.info(
                    "the agent hands over %s: not sent (%s)",
                    file.given,
                    file.refused,
                    extra={"run_id": run_id},
                )
            else:
                _LOGGER.info("the agent hands over %s", file.given, extra={"run_id": run_id})

    async def publish_text(self, run_id: str, text: str) -> None:
        _LOGGER.info("%s", text, extra={"run_id": run_id})

    async def update_status(self, update: StatusUpdate) -> None:
        _LOGGER.info(
            "status %s phase=%s turn=%s",
            update.status,
            update.phase,
            update.turn,
            extra={"run_id": update.run_id},
        )

    async def request_gate(self, request: GateRequest) -> None:
        _LOGGER.info(
            "gate open: task %s phase %s awaits approval of %s (sha256 %s); approve with "
            "`turnstile status --task %s --approve --by USER_ID`",
            request.task,
            request.phase,
            request.artifact_name,
            request.short_hash,
            request.task,
            extra={"task": request.task, "phase": request.phase},
        )


#: How much of a note's text (and of its body) the event log keeps: a chat message's worth.
_NOTE_CAP = 8000


class RecordingSink:
    """A sink that also writes what it is given to the run's event log, then passes it on.

    A turn's output is not copied (its turn-ended event points at the turn, which holds it);
    every other text is a note event with its kind, of the text's run and task, and what a
    front end needs to say it again as it was said: its text and its body (when it has one).
    """

    def __init__(
        self, inner: RunSink, db: AnyDatabase, owner: Callable[[str], Owner] | None = None
    ) -> None:
        self.inner = inner
        self._db = db
        self._owner = owner or _owner

    async def _record(
        self, key: str, kind: EventKind, data: dict[str, object], task: str | None = None
    ) -> None:
        run_id, owner_task = self._owner(key)
        task = task or owner_task
        try:
            async with self._db.transaction() as conn:
                await add_event(conn, self._db, kind, run_id=run_id, task=task, data=data)
        except StoreError as exc:  # the message still goes out; the log misses one note
            _LOGGER.warning("could not log a note of %s: %s", run_id, exc)
            return
        events_written(self._db)

    async def publish_run_text(self, said: RunText) -> None:
        if said.kind is not TextKind.TURN:
            data: dict[str, object] = {"note": said.kind.value, "text": said.text[:_NOTE_CAP]}
            if said.body is not None:
                data["body"] = said.body[:_NOTE_CAP]
            await self._record(said.run_id, EventKind.NOTE, data, said.task)
        await publish_said(self.inner, said)

    async def publish_text(self, run_id: str, text: str) -> None:
        await self.publish_run_text(RunText(run_id, text))

    async def update_status(self, update: StatusUpdate) -> None:
        await self.inner.update_status(update)

    async def request_gate(self, request: GateRequest) -> None:
        await self.inner.request_gate(request)


class RecordingFileSink(RecordingSink):
    """A :class:`RecordingSink` over a sink that hands files over.

    The files are read where the run executes and stored (:mod:`engine.handover`), the
    ``file_out`` event lists them (``paths`` as asked, ``files`` as stored or refused), and
    the inner sink hands them over from the store: so a front end following the run from
    the event log, wherever it runs, sends what one in the run's own process sends.
    """

    def __init__(
        self,
        inner: RunSink,
        db: AnyDatabase,
        owner: Callable[[str], Owner] | None = None,
        *,
        sends: SendRules,
    ) -> None:
        super().__init__(inner, db, owner)
        self._sends = sends

    async def send_files(self, run_id: str, workdir: Path, paths: list[str]) -> None:
        rules = self._sends
        files = await collect_paths(
            self._db, workdir, paths, max_bytes=rules.max_bytes, redact=rules.redact
        )
        data = {"paths": list(paths), "files": [f.to_json() for f in files]}
        await self._record(run_id, EventKind.FILE_OUT, data)
        # (recording() makes one only over a sink that takes stored files)
        await cast(StoredFileSink, self.inner).send_stored(run_id, files)


def sent_files(data: Mapping[str, Any]) -> list[SentFile]:
    """The files a ``file_out`` event says were stored (or refused)."""
    raw = data.get("files")
    return [SentFile.from_json(f) for f in raw] if isinstance(raw, list) else []


#: Whose a sink's key is: the run's id and the task's name (either may be None).
Owner = tuple[str | None, str | None]


def _owner(key: str) -> Owner:
    """A key is a run id: the run's (its task, when a text says it, is the text's)."""
    return key, None


def recording(
    sink: RunSink,
    db: AnyDatabase,
    owner: Callable[[str], Owner] | None = None,
    *,
    sends: SendRules | None = None,
) -> RunSink:
    """``sink``, its texts written to the event log too; ``owner`` tells whose each key
    is (by default: the run of that id). ``sends``: the run hands files over (read and
    stored under these rules, logged, then given to ``sink`` when it takes files)."""
    if isinstance(sink, RecordingSink):
        return sink
    if sends is not None and isinstance(sink, StoredFileSink):
        return RecordingFileSink(sink, db, owner, sends=sends)
    return RecordingSink(sink, db, owner)
