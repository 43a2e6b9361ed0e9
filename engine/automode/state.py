"""Auto-mode state: the phase cursor, the pure transition function, and its persistence.

The transition function :func:`advance` is pure data in, data out; the channel does
the I/O around it (store, state file, logs, sink). The state is persisted twice:
in the store (the source of truth: the run's row, the cursor in ``runs.state_json``) and
as ``state.json`` in the run's log folder, written atomically after every committed
transition (a mirror for people and tools reading the folder).

The run's status is ``runs.status``, its only one: the stored cursor carries none (the
store drops it), and a state loaded from the store takes its status from the column
(:meth:`AutoModeState.of_run`, :func:`status_of_run`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, Final

# Re-exported: they moved where `turnstile runs` reaches them without loading auto mode.
from engine.runs.owner import owner_alive, owner_token
from engine.store.runs import RunRecord, RunStatus

__all__ = [
    "STATE_FILE",
    "AutoModeState",
    "AutoStatus",
    "Outcome",
    "Phase",
    "StateMirror",
    "Transition",
    "Verdict",
    "advance",
    "owner_alive",
    "owner_token",
    "progress_line",
    "read_state_file",
    "rounds_of",
    "status_of_run",
    "write_state_file",
]

_LOGGER = logging.getLogger(__name__)

STATE_FILE: Final = "state.json"
# Prior outputs carried into later prompts are capped so that a prompt always fits in
# one argv element (Linux caps a single argument at 128 KiB).
CARRY_LIMIT: Final = 12 * 1024


class Phase(StrEnum):
    """Where the cursor points: the phase whose prompt is rendered next."""

    CLARIFY = "clarify"
    PLAN = "plan"
    EXECUTE = "execute"
    EVALUATE = "evaluate"
    ADJUST = "adjust"

    @property
    def label(self) -> str:
        return self.value.capitalize()

    @property
    def required(self) -> bool:
        """A required turn exiting non-zero aborts the run (the crash path)."""
        return self in _REQUIRED


_REQUIRED: Final = frozenset({Phase.CLARIFY, Phase.PLAN, Phase.ADJUST})


class AutoStatus(StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    STOPPED = "stopped"
    ERROR = "error"


class Verdict(StrEnum):
    """What an Evaluate turn's marker line said (garbled or missing counts as in progress)."""

    COMPLETE = "COMPLETE"
    IN_PROGRESS = "IN PROGRESS"
    NEEDS_ADJUSTMENT = "NEEDS ADJUSTMENT"


@dataclass(frozen=True, slots=True)
class AutoModeState:
    """Everything needed to continue a run after a crash.

    Attributes:
        turn: the auto-mode turn (Clarify is 1, Plan 2, each Execute/Evaluate/Adjust
            round one more).
        phase: the phase the cursor points at (after a terminal transition: the last one run).
        step: the sequence number of the next agent turn (one per agent process).
        status: running until a terminal transition.
        base_commit: HEAD of the workdir when the run started (None: no commits or no git).
        clarified / plan / execution / evaluation / feedback: prior outputs (capped) that
            later prompts embed.
        config: how the run was started (tool, agent command, passthrough, verify command).
        owner: which process drives the run now (pid and start time).
    """

    run_id: str
    session_id: str
    objective: str
    workdir: str
    log_dir: str
    max_turns: int
    tool: str
    turn: int = 1
    phase: Phase = Phase.CLARIFY
    step: int = 1
    status: AutoStatus = AutoStatus.RUNNING
    started_at: float = 0.0
    updated_at: float = 0.0
    finished_at: float | None = None
    base_commit: str | None = None
    clarified: str = ""
    plan: str = ""
    execution: str = ""
    evaluation: str = ""
    feedback: str = ""
    verdicts: tuple[str, ...] = ()
    exit_code: int = 0
    abort: str | None = None
    message: str | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    owner: str | None = None

    @property
    def terminal(self) -> bool:
        return self.status is not AutoStatus.RUNNING

    def to_json(self) -> dict[str, Any]:
        # Shallow on purpose (asdict deep-copies everything, a measurable cost per turn).
        data = {name: getattr(self, name) for name in _FIELDS}
        data["phase"] = self.phase.value
        data["status"] = self.status.value
        data["verdicts"] = list(self.verdicts)
        data["config"] = dict(self.config)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AutoModeState:
        known = set(cls.__dataclass_fields__)
        values = {k: v for k, v in data.items() if k in known}
        values["phase"] = Phase(values.get("phase", Phase.CLARIFY.value))
        values["status"] = AutoStatus(values.get("status", AutoStatus.RUNNING.value))
        values["verdicts"] = tuple(values.get("verdicts", ()))
        values["config"] = dict(values.get("config", {}))
        return cls(**values)

    @classmethod
    def of_run(cls, record: RunRecord) -> AutoModeState:
        """The state of the auto run ``record``: its cursor, and its status from the run's
        status (whatever status an older row's cursor still carries is not read)."""
        state = cls.from_json(record.state)
        return replace(state, status=status_of_run(record.status, abort=state.abort))


_FIELDS: Final = tuple(AutoModeState.__dataclass_fields__)


def status_of_run(status: RunStatus, *, abort: str | None) -> AutoStatus:
    """Where an auto run stands, from its store status (``channel.run_status`` the other
    way round). Parked (at a shutdown) is still running; crashed is an abort of a required
    turn when the cursor says so (``abort``), else a turn that failed: the cursor stays
    where it was and a resume runs that turn again, so the run has not ended."""
    match status:
        case RunStatus.COMPLETED:
            return AutoStatus.COMPLETED
        case RunStatus.STOPPED:
            return AutoStatus.STOPPED
        case RunStatus.ERROR:
            return AutoStatus.ERROR
        case RunStatus.CRASHED if abort is not None:
            return AutoStatus.ERROR
        case _:
            return AutoStatus.RUNNING


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the phase that just ran produced, as the transition function sees it."""

    exit_code: int
    verdict: Verdict | None = None
    verified: bool = False


@dataclass(frozen=True, slots=True)
class Transition:
    """The cursor's next position, or a terminal status.

    Attributes:
        turn / phase: where the cursor goes (unchanged on a terminal transition).
        status: RUNNING, or the terminal status.
        exit_code: the run's exit code when terminal.
        abort: a reason iff a required turn failed (the crash path).
        message: the terminal log line, or a warning for a non-terminal step.
    """

    turn: int
    phase: Phase
    status: AutoStatus = AutoStatus.RUNNING
    exit_code: int = 0
    abort: str | None = None
    message: str | None = None


MAX_TURNS_MESSAGE: Final = "Reached the round limit without verified completion"
ACHIEVED_MESSAGE: Final = "Objective achieved"


def _next_round(turn: int, phase: Phase, max_turns: int) -> Transition:
    if turn + 1 > max_turns:
        return Transition(turn, phase, AutoStatus.STOPPED, 0, None, MAX_TURNS_MESSAGE)
    return Transition(turn + 1, Phase.EXECUTE)


def advance(turn: int, phase: Phase, max_turns: int, outcome: Outcome) -> Transition:
    """The state machine: where the cursor goes after ``phase`` of ``turn`` produced ``outcome``.

    Clarify (turn 1) → Plan (turn 2) → for turns 3..=max_turns: Execute → Evaluate →
    (complete and verified: completed | needs adjustment: Adjust → next turn | else next
    turn). A required turn (Clarify, Plan, Adjust) exiting non-zero ends the run with
    status error and an abort reason; Evaluate exiting non-zero ends it with status
    error and no abort; Execute exiting non-zero only warns.
    """
    code = outcome.exit_code
    if phase.required and code != 0:
        reason = f"{phase.label} step failed with exit code {code}"
        return Transition(turn, phase, AutoStatus.ERROR, code, reason, reason)
    if phase is Phase.CLARIFY:
        return Transition(2, Phase.PLAN)
    if phase is Phase.PLAN:
        if max_turns < 3:
            return Transition(turn, phase, AutoStatus.STOPPED, 0, None, MAX_TURNS_MESSAGE)
        return Transition(3, Phase.EXECUTE)
    if phase is Phase.EXECUTE:
        warning = f"Execute step exited with code {code}; continuing" if code != 0 else None
        return Transition(turn, Phase.EVALUATE, message=warning)
    if phase is Phase.EVALUATE:
        if code != 0:
            message = f"Evaluate step failed with exit code {code}"
            return Transition(turn, phase, AutoStatus.ERROR, code, None, message)
        if outcome.verdict is Verdict.COMPLETE and outcome.verified:
            return Transition(turn, phase, AutoStatus.COMPLETED, 0, None, ACHIEVED_MESSAGE)
        if outcome.verdict is Verdict.NEEDS_ADJUSTMENT:
            return Transition(turn, Phase.ADJUST)
        return _next_round(turn, phase, max_turns)
    # ADJUST, exit 0
    return _next_round(turn, phase, max_turns)


def cap(text: str, limit: int = CARRY_LIMIT) -> str:
    """Keep the tail of ``text`` within ``limit`` UTF-8 bytes (the end of an output matters most).

    Prompts travel as one argv element, which Linux caps at 128 KiB: the objective
    (16 KiB), three carried outputs (12 KiB each), the appended instructions (48 KiB,
    or one of at most 50 KiB) and the templates stay below it.
    """
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    kept = data[-limit:].decode("utf-8", errors="ignore")
    return f"[… {len(data) - limit} earlier bytes omitted …]\n" + kept


def write_state_file(folder: Path, state: AutoModeState, *, durable: bool = True) -> None:
    """Write ``state.json`` atomically (temp file, optionally fsync, rename)."""
    _write_json(folder, json.dumps(state.to_json(), indent=2, sort_keys=True), durable=durable)


def _write_json(folder: Path, data: str, *, durable: bool) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".state-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, folder / STATE_FILE)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_state_file(folder: Path) -> AutoModeState:
    return AutoModeState.from_json(json.loads((folder / STATE_FILE).read_text(encoding="utf-8")))


def rounds_of(turns: Iterable[tuple[int, str | None]]) -> dict[int, int]:
    """The round of each agent turn (by its seq), from the phases its turns ran: Clarify
    is round 1, Plan 2, each Execute starts the next round, and an Evaluate or Adjust is
    in the round of the Execute before it (as :func:`advance` moves the cursor)."""
    rounds: dict[int, int] = {}
    current = 0
    for seq, phase in sorted(set(turns), key=lambda t: t[0]):
        if seq in rounds:
            continue  # a cut-off turn run again: the same turn
        if phase == Phase.CLARIFY:
            current = 1
        elif phase == Phase.PLAN:
            current = 2
        elif phase == Phase.EXECUTE:
            current = max(current, 2) + 1
        rounds[seq] = current
    return rounds


def progress_line(state: AutoModeState) -> str:
    """How far a run went, as its report says it: the agent turns that ran (each one a
    turn, as everywhere) and the round its turn limit counts."""
    return f"Turns: {state.step - 1}, in round {state.turn} of {state.max_turns}"


def with_transition(state: AutoModeState, tr: Transition, now: float) -> AutoModeState:
    """The state after ``tr`` was decided for the agent turn ``state.step``."""
    return replace(
        state,
        turn=tr.turn,
        phase=tr.phase,
        status=tr.status,
        step=state.step + 1,
        updated_at=now,
        finished_at=now if tr.status is not AutoStatus.RUNNING else None,
        exit_code=tr.exit_code,
        abort=tr.abort,
        message=tr.message if tr.status is not AutoStatus.RUNNING else state.message,
    )


class StateMirror:
    """Keeps ``state.json`` in step with the store, off the event loop.

    The store is the source of truth; the file is a mirror for people and tools reading
    the folder. Each update is written atomically in a worker thread; updates arriving
    while a write is in flight coalesce into one write of the latest state, so the file
    always ends up holding the newest committed state. :meth:`flush` waits for that.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._latest: str | None = None
        self._task: asyncio.Task[None] | None = None
        self.error: OSError | None = None

    def update(self, state: AutoModeState) -> None:
        self._latest = json.dumps(state.to_json(), indent=2, sort_keys=True)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain(), name=f"state-mirror-{state.run_id}")

    async def _drain(self) -> None:
        while self._latest is not None:
            data, self._latest = self._latest, None
            try:
                await asyncio.to_thread(_write_json, self.folder, data, durable=False)
            except OSError as exc:
                self.error = exc
                _LOGGER.error("cannot write %s/%s: %s", self.folder, STATE_FILE, exc)

    async def flush(self) -> None:
        """Wait until the newest state is on disk."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)
