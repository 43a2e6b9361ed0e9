"""The control-flow half of auto mode: a :class:`~engine.turn.Channel` owning the phase cursor.

``next_prompt`` renders the prompt for the phase the cursor points at (ingesting
appended instructions while rendering Execute) and records the turn as started; it
never returns ``Idle`` and returns ``Closed`` once the run is terminal. ``publish_output``
is where every decision happens: it reads the turn's exit code and text, detects and
verifies completion after Evaluate, advances the cursor through the pure transition
function, and commits the finished turn together with the new state in one store
transaction before anything is reported.

Long: the final report is written from the same state and verdicts these decisions keep.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final, Protocol

from engine.automode.append import InstructionInbox, Intake, render_instructions
from engine.automode.budget import check_budget
from engine.automode.prompts import PromptTemplates
from engine.automode.state import (
    MAX_TURNS_MESSAGE,
    AutoModeState,
    AutoStatus,
    Outcome,
    Phase,
    StateMirror,
    Verdict,
    advance,
    cap,
    progress_line,
    with_transition,
)
from engine.automode.summary import WorkSummary, WorkSummaryGenerator
from engine.automode.uploads import write_instruction_files
from engine.automode.verifier import CompletionSignalDetector, CompletionVerifier, Verification
from engine.errors import ChannelPublishError, TurnSuperseded
from engine.files import send_markers
from engine.humane import turn_count
from engine.reaper import TurnProcess
from engine.runs.spec import PlaceId
from engine.sink import (
    FileSink,
    NullSink,
    RefusedClaim,
    RunSink,
    RunText,
    StatusUpdate,
    TextKind,
    TurnDone,
    publish,
    publish_said,
)
from engine.spend import Spend
from engine.store.runs import InstructionFile, QueuedInstruction, RunStatus, TurnState
from engine.turn import BaseChannel, Closed, NextPrompt, Ready, TurnOutput

__all__ = [
    "STOPPED_BY_PERSON",
    "AutoModeChannel",
    "AutoRunStore",
    "final_report",
    "run_status",
    "turn_said",
]

_LOGGER = logging.getLogger(__name__)

STOPPED_BY_PERSON: Final = "Stopped by a person"
STOP_EXIT_CODE: Final = 130
# What a sink receives of one turn's output (the store and the transcript keep it all).
_PUBLISH_HEAD: Final = 3500
_TAIL_READ: Final = 64 * 1024


class AutoRunStore(Protocol):
    """The store operations auto mode needs (``SqliteRunStore`` provides them)."""

    async def start_turn(self, run_id: str, seq: int, prompt: str, phase: str | None) -> int: ...

    async def finish_turn_and_update_run(
        self, turn_id: int, out: TurnOutput, run_id: str, **fields: Any
    ) -> None: ...

    async def fail_turn(self, turn_id: int, state: TurnState, error: str) -> bool: ...

    async def record_turn_process(self, turn_id: int, process: TurnProcess) -> None: ...

    async def update_run(self, run_id: str, **fields: Any) -> Any: ...

    async def spend_of(self, run_ids: Collection[str]) -> dict[str, Spend]: ...

    async def spend_in_chat(self, chat_id: PlaceId, *, since: float) -> Spend: ...

    async def queued_instructions(
        self, run_id: str, *, before: int | None = None
    ) -> list[QueuedInstruction]: ...

    async def instruction_file(self, file: InstructionFile) -> bytes | None: ...


def run_status(state: AutoModeState) -> RunStatus:
    """The store's run status for a state: a required-turn abort is a crash."""
    if state.status is AutoStatus.ERROR and state.abort is not None:
        return RunStatus.CRASHED
    return RunStatus(state.status.value)


TURN_LIMIT_STATUS: Final = "turn_limit"


def live_status(state: AutoModeState, recorded: str | None = None) -> str:
    """The state a run's live message shows: a run stopped by its round limit says so;
    else ``recorded`` (the store's status, where one was read) or the state's own."""
    if state.status is AutoStatus.STOPPED and state.message == MAX_TURNS_MESSAGE:
        return TURN_LIMIT_STATUS
    return recorded if recorded is not None else run_status(state).value


@dataclass(slots=True)
class _InFlight:
    turn_id: int
    phase: Phase
    seq: int
    started: float


class AutoModeChannel(BaseChannel):
    """Drives Clarify → Plan → Execute/Evaluate(/Adjust) from recorded state.

    Args:
        state: where the run stands (fresh, or loaded from the store to resume).
        store: persistence of turns and the run's state.
        templates: validated prompt templates.
        verifier: measures completion evidence in the workspace.
        summary: summarises the work for the final report.
        inbox: the run's ``append/`` / ``appended/`` folders.
        uploads: the folder of its worktree that files sent to it are written into.
        sink: where reports go (the terminal's :class:`~engine.sink.LogSink`, the bot's own).
        clock: wall clock, for timestamps.
    """

    def __init__(
        self,
        state: AutoModeState,
        *,
        store: AutoRunStore,
        templates: PromptTemplates,
        verifier: CompletionVerifier,
        summary: WorkSummaryGenerator,
        inbox: InstructionInbox,
        uploads: str = "uploads",
        sink: RunSink | None = None,
        detector: CompletionSignalDetector | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(f"auto:{state.run_id}")
        self._state = state
        self._store = store
        self._templates = templates
        self._verifier = verifier
        self._summary = summary
        self._inbox = inbox
        self._uploads = uploads
        self._sink: RunSink = sink or NullSink()
        self._detector = detector or CompletionSignalDetector()
        self._clock = clock
        self._log_dir = Path(state.log_dir)
        self._mirror_writer = StateMirror(self._log_dir)
        self._in_flight: _InFlight | None = None
        self._stop_reason: str | None = None
        self.last_verification: Verification | None = None
        self.last_summary: WorkSummary | None = None
        # What the run's finished turns cost so far (read once, then kept up here).
        self.spend: Spend | None = None
        self.report: str | None = None
        self._extra = {"run_id": state.run_id}

    async def record_process(self, process: TurnProcess) -> None:
        """Record the running turn's processes with it (a start-up after a crash kills them)."""
        if self._in_flight is not None:
            await self._store.record_turn_process(self._in_flight.turn_id, process)

    # -- readable results ------------------------------------------------------------
    @property
    def state(self) -> AutoModeState:
        return self._state

    @property
    def closed(self) -> bool:
        return self._state.terminal

    def exit_code(self) -> int:
        """0 for completed / stopped at max turns; the failing phase's code otherwise."""
        return self._state.exit_code

    def abort(self) -> str | None:
        """A reason iff a required turn failed (the crash path); None otherwise."""
        return self._state.abort

    def request_stop(self, reason: str = STOPPED_BY_PERSON) -> None:
        """Close at the next poll (the caller pre-empts a running turn separately)."""
        self._stop_reason = reason
        self.notify_inbound()

    # -- Channel ---------------------------------------------------------------------
    async def next_prompt(self) -> NextPrompt:
        if self._state.terminal:
            return Closed()
        if self._stop_reason is not None:
            await self._close_stopped()
            return Closed()
        state = self._state
        phase = state.phase
        values = self._values()
        intake: Intake | None = None
        if phase is Phase.EXECUTE:
            # What people queued through the store (from a chat, a terminal, wherever the
            # run executes) joins what was dropped into the folder.
            for queued in await self._store.queued_instructions(state.run_id, before=state.step):
                await self._deliver(queued)
            intake = self._inbox.collect(state.step)
            values["instructions"] = render_instructions(intake.instructions)
        prompt = self._templates.render(phase, values)
        if intake is not None:
            self._inbox.archive(intake)
        turn_id = await self._store.start_turn(state.run_id, state.step, prompt, phase.value)
        self._in_flight = _InFlight(turn_id, phase, state.step, time.monotonic())
        _LOGGER.info(
            "Turn %d, round %d/%d: %s",
            state.step,
            state.turn,
            state.max_turns,
            _PHASE_LINES[phase],
            extra={**self._extra, "phase": phase.value},
        )
        if intake is not None:
            await self._report_intake(intake)
        await self._status(f"{phase.label} running")
        self._transcript(
            f"## Turn {state.step} · {phase.label} · round {state.turn}\n\n### Prompt\n"
        )
        self._transcript(prompt + "\n")
        return Ready(prompt)

    async def _deliver(self, queued: QueuedInstruction) -> None:
        """Drop one queued instruction into the inbox unless it had it; its files first."""
        text = queued.text
        if queued.files:
            if self._inbox.has(queued.name):
                return  # (its files were written when it was dropped)
            text, problems = await write_instruction_files(
                self._store, queued, Path(self._state.workdir), self._uploads
            )
            for problem in problems:
                await self._safe_publish(f"⚠️ A file sent to this run: {problem}")
        if self._inbox.deliver(queued.name, text):
            _LOGGER.info("instruction %s delivered", queued.name, extra=self._extra)

    async def publish_output(self, out: TurnOutput) -> None:
        flight = self._in_flight
        if flight is None:
            raise ChannelPublishError("publish_output without a turn in flight")
        state = self._state
        phase = flight.phase
        code = out.exit_code if out.exit_code is not None else 0
        text = _output_tail(out)
        stderr_size = out.metadata.get("stderr_size")
        _LOGGER.info(
            "%s exit code: %d (stdout %d chars%s)",
            phase.label,
            code,
            len(out.text) if out.size is None else out.size,
            f", stderr {stderr_size} bytes" if stderr_size is not None else "",
            extra={**self._extra, "phase": phase.value},
        )
        updates: dict[str, Any] = {}
        verdict: Verdict | None = None
        verified = False
        not_accepted: str | None = None
        if phase is Phase.CLARIFY:
            updates["clarified"] = cap(text)
        elif phase in (Phase.PLAN, Phase.ADJUST):
            updates["plan"] = cap(text)
        elif phase is Phase.EXECUTE:
            updates["execution"] = cap(text)
        elif phase is Phase.EVALUATE and code == 0:
            verdict, well_formed = self._detector.detect(text)
            updates["evaluation"] = cap(text)
            updates["verdicts"] = (*state.verdicts, verdict.value)
            updates["feedback"] = ""
            if not well_formed:
                _LOGGER.warning(
                    "Evaluation marker missing or garbled: counted as IN PROGRESS",
                    extra={**self._extra, "phase": phase.value},
                )
            _LOGGER.info("Evaluation: %s", verdict.value, extra=self._extra)
            if verdict is Verdict.COMPLETE:
                verification = await self._verifier.verify(verdict)
                self.last_verification = verification
                verified = verification.accepted
                _LOGGER.info(
                    "Completion score: %.2f (threshold %.2f): %s",
                    verification.score,
                    verification.threshold,
                    verification.describe(),
                    extra=self._extra,
                )
                if not verified:
                    _LOGGER.warning(
                        "Verification discrepancy: agent reported COMPLETE but evidence "
                        "score %.2f < %.2f; continuing",
                        verification.score,
                        verification.threshold,
                        extra=self._extra,
                    )
                    not_accepted = verification.why_not()
                    updates["feedback"] = (
                        "## Verification feedback\n\nThe last evaluation reported COMPLETE, "
                        "but the engine's evidence does not support it "
                        f"(score {verification.score:.2f} < {verification.threshold:.2f}): "
                        f"{verification.describe()}. Address this before reporting COMPLETE "
                        "again."
                    )
        transition = advance(state.turn, phase, state.max_turns, Outcome(code, verdict, verified))
        now = self._clock()
        new_state = with_transition(replace(state, **updates), transition, now)
        report: str | None = None
        this_turn = Spend.of_turn(out.metadata)
        self.spend = await self._spend_so_far() + this_turn
        new_state, budget_note = await check_budget(
            new_state, now, run=self.spend, this_turn=this_turn, store=self._store
        )
        if new_state.terminal:
            await self._final_evidence()
            self.last_summary = await self._summary.generate(new_state.evaluation)
            report = self._final_report(new_state)
        await self._store.finish_turn_and_update_run(
            flight.turn_id, out, state.run_id, **self._run_fields(new_state)
        )
        self._in_flight = None
        self._state = new_state
        self._mirror()
        self._transcript(f"### Output (exit {code})\n\n{out.text}\n\n")
        if out.stderr_tail:
            self._transcript(f"### Error output (its end)\n\n{out.stderr_tail}\n\n")
        # The agent hears it in its next prompt; the people watching hear it here.
        refused = None if not_accepted is None else RefusedClaim(flight.seq, not_accepted)
        if budget_note is not None:
            await self._safe_publish(budget_note)
        await self._announce(
            flight.seq, state.turn, phase, code, out, transition.message, report, refused
        )

    # -- stop / failure paths (called by the run driver) --------------------------------
    async def record_preempted(self, error: str) -> None:
        """A person pre-empted the running turn: record it interrupted, end the run stopped."""
        flight, self._in_flight = self._in_flight, None
        if flight is not None and not await self._store.fail_turn(
            flight.turn_id, TurnState.INTERRUPTED, error
        ):
            raise TurnSuperseded(f"turn {flight.turn_id} was recorded ended while it ran")
        await self._close_stopped()

    async def record_turn_error(self, error: str) -> None:
        """The agent could not be spawned or captured: the turn failed, the run crashed.

        The cursor is left where it was, so ``--resume`` re-runs the same turn.
        """
        flight, self._in_flight = self._in_flight, None
        if flight is not None and not await self._store.fail_turn(
            flight.turn_id, TurnState.FAILED, error
        ):
            # Its worker was declared lost and the run moved on: the run is not this
            # process's to end.
            raise TurnSuperseded(f"turn {flight.turn_id} was recorded ended while it ran")
        await self._store.update_run(
            self._state.run_id,
            status=RunStatus.CRASHED,
            abort_reason=error,
            exit_code=1,
            finished_at=self._clock(),
        )
        _LOGGER.error("Turn failed: %s", error, extra=self._extra)
        self.report = f"Auto run {self._state.run_id} failed: {error}"
        await self._safe_publish(self.report, TextKind.FINAL)

    async def _final_evidence(self) -> None:
        """The final report always lists evidence; measure it if no claim was checked."""
        if self.last_verification is None:
            self.last_verification = await self._verifier.verify(
                Verdict.IN_PROGRESS, run_verify_cmd=False
            )

    async def _close_stopped(self) -> None:
        await self._final_evidence()
        self.last_summary = await self._summary.generate(self._state.evaluation)
        now = self._clock()
        self._state = replace(
            self._state,
            status=AutoStatus.STOPPED,
            exit_code=STOP_EXIT_CODE,
            message=self._stop_reason or STOPPED_BY_PERSON,
            updated_at=now,
            finished_at=now,
        )
        await self._store.update_run(self._state.run_id, **self._run_fields(self._state))
        self._mirror()
        _LOGGER.warning("%s", self._state.message, extra=self._extra)
        await self._status(self._state.message or "stopped")
        self.spend = await self._spend_so_far()
        self.report = self._final_report(self._state)
        await self._safe_publish(self.report, TextKind.FINAL)

    # -- helpers ------------------------------------------------------------------------
    def _values(self) -> dict[str, str]:
        s = self._state
        return {
            "objective": s.objective,
            "turn": str(s.turn),
            "max_turns": str(s.max_turns),
            "run_id": s.run_id,
            "workdir": s.workdir,
            "clarified": s.clarified,
            "plan": s.plan,
            "execution": s.execution,
            "evaluation": s.evaluation or "(none yet)",
            "feedback": s.feedback,
            "instructions": "",
        }

    def _run_fields(self, state: AutoModeState) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "status": run_status(state),
            "phase": state.phase.value,
            "turn": state.turn,
            "state": state.to_json(),
        }
        if state.terminal:
            fields.update(
                exit_code=state.exit_code,
                abort_reason=state.abort,
                finished_at=state.finished_at,
            )
        return fields

    def _mirror(self) -> None:
        # Off the event loop and coalesced: the store already holds the state.
        self._mirror_writer.update(self._state)

    async def flush(self) -> None:
        """Wait until ``state.json`` holds the newest state (called when the run ends)."""
        await self._mirror_writer.flush()

    def _transcript(self, text: str) -> None:
        with (
            contextlib.suppress(OSError),
            open(self._log_dir / "transcript.md", "a", encoding="utf-8") as fh,
        ):
            fh.write(text)

    def _final_report(self, state: AutoModeState) -> str:
        return final_report(state, self.last_verification, self.last_summary, self.spend)

    async def _spend_so_far(self) -> Spend:
        if self.spend is None:
            run_id = self._state.run_id
            self.spend = (await self._store.spend_of([run_id])).get(run_id, Spend())
        return self.spend

    async def _announce(
        self,
        turn: int,
        round_: int,
        phase: Phase,
        code: int,
        out: TurnOutput,
        message: str | None,
        report: str | None,
        refused: RefusedClaim | None = None,
    ) -> None:
        state = self._state
        if message is not None:
            level = logging.INFO if state.status is AutoStatus.COMPLETED else logging.WARNING
            _LOGGER.log(level, "%s", message, extra=self._extra)
        if report is not None:
            self.report = report
            _LOGGER.info(
                "Work summary:\n%s", self.last_summary.render() if self.last_summary else ""
            )
        said = turn_said(
            state.run_id,
            turn=turn,
            round_=round_,
            max_turns=state.max_turns,
            phase=phase,
            code=code,
            text=out.text,
            size=out.size,
            stderr_tail=out.stderr_tail,
            log_dir=str(self._log_dir),
        )
        await self._sink_call(publish_said(self._sink, said))
        # Files the agent hands over (TURNSTILE-SEND lines) follow its output.
        paths = send_markers(out.text)
        if paths and isinstance(self._sink, FileSink):
            await self._sink_call(self._sink.send_files(state.run_id, Path(state.workdir), paths))
        if refused is not None:  # after the turn's output, before the final report
            goes_on = "" if state.terminal else " The run goes on."
            verdict = RunText(
                state.run_id, f"🔎 {refused.said()}{goes_on}", TextKind.VERDICT, claim=refused
            )
            await self._sink_call(publish_said(self._sink, verdict))
        if state.terminal:
            await self._status(state.message or state.status.value)
            await self._safe_publish(report or self._final_report(state), TextKind.FINAL)

    async def _report_intake(self, intake: Intake) -> None:
        for refusal in intake.refused:
            await self._safe_publish(
                f"Appended instruction {refusal.name} refused: {refusal.reason} "
                f"(archived as {refusal.archived_as})"
            )
        if intake.instructions:
            _LOGGER.info(
                "Embedding %d appended instruction(s) in the Execute prompt",
                len(intake.instructions),
                extra=self._extra,
            )
        if intake.deferred:
            _LOGGER.info(
                "%d appended instruction(s) wait for the next Execute turn", intake.deferred
            )

    async def _status(self, event: str) -> None:
        s = self._state
        await self._sink_call(
            self._sink.update_status(
                StatusUpdate(
                    run_id=s.run_id,
                    mode="auto",
                    status=live_status(s),
                    phase=s.phase.value,
                    # The agent turn running, else the last one that ran.
                    turn=s.step if self._in_flight is not None else s.step - 1,
                    round=s.turn,
                    max_turns=s.max_turns,
                    started_at=s.started_at,
                    last_event=event,
                    running=self._in_flight.phase.label if self._in_flight is not None else None,
                    spent=self.spend.cost_text()
                    if self.spend is not None and self.spend.cost_usd is not None
                    else None,
                )
            )
        )

    async def _safe_publish(self, text: str, kind: TextKind = TextKind.NOTE) -> None:
        await self._sink_call(publish(self._sink, self._state.run_id, text, kind))

    async def _sink_call(self, call: Any) -> None:
        # The state is committed before anything is reported: a failing sink loses a
        # message, never the run. It is logged, never swallowed silently.
        try:
            await call
        except Exception as exc:
            _LOGGER.exception("run sink failed: %s", exc, extra=self._extra)


def _ended_as(state: AutoModeState) -> str:
    """How the run ended, in words (only a failure has an exit code worth saying)."""
    if state.status is AutoStatus.ERROR:
        return "failed" + (f" (exit {state.exit_code})" if state.exit_code else "")
    limit = state.status is AutoStatus.STOPPED and state.message == MAX_TURNS_MESSAGE
    return "stopped at its round limit" if limit else state.status.value


def final_report(
    state: AutoModeState,
    verification: Verification | None = None,
    summary: WorkSummary | None = None,
    spend: Spend | None = None,
) -> str:
    """A run's final report; the evidence and work summary when they were measured, and
    what its turns cost."""
    lines = [
        f"Auto run {state.run_id}: {_ended_as(state)}",
        f"Objective: {_one_line(state.objective, 200)}",
        f"{progress_line(state)}; last phase: {state.phase.label}",
    ]
    if state.message:
        lines.append(state.message)
    if state.abort:
        lines.append(f"Aborted: {state.abort}")
    if verification is not None:
        v = verification
        checked = "" if v.claim is Verdict.COMPLETE else "; no COMPLETE claim was checked"
        lines.append(f"Evidence (score {v.score:.2f}, threshold {v.threshold:.2f}{checked}):")
        lines += [f"  - {e.describe()}" for e in v.evidence]
    if summary is not None:
        lines.append(summary.render())
    if spend is not None and spend.turns:
        lines.append(spend.line())
    lines.append(f"Log folder: {state.log_dir}")
    return "\n".join(lines)


def turn_said(
    run_id: str,
    *,
    turn: int,
    round_: int,
    max_turns: int,
    phase: Phase,
    code: int,
    text: str,
    size: int | None,
    stderr_tail: str | None,
    log_dir: str,
) -> RunText:
    """What a sink is told of one finished turn: its head line, then what it said (the
    output's head, the error output's end), as text and as data (:class:`TurnDone`).
    ``turn`` is the agent turn; ``round_`` the run's round, which ``max_turns`` counts."""
    error = stderr_tail.strip() if code != 0 and stderr_tail else None
    size = size if size is not None else len(text)
    done = TurnDone(turn, round_, max_turns, phase.label, code, text[:_PUBLISH_HEAD], size, error)
    more = f"\n… ({size} characters in all; see {log_dir}/transcript.md)" if done.cut else ""
    failed = f"\nIts error output ended with:\n{error}" if error is not None else ""
    body = f"{done.output}{more}{failed}"
    count = turn_count(turn, round_=round_, limit=max_turns)
    head = f"[{count} · {phase.label}, exit {code}]"
    return RunText(run_id, f"{head}\n{body}", TextKind.TURN, body=body, turn=done)


_PHASE_LINES: Final[Mapping[Phase, str]] = {
    Phase.CLARIFY: "Clarifying objective",
    Phase.PLAN: "Creating plan",
    Phase.EXECUTE: "Executing",
    Phase.EVALUATE: "Evaluating",
    Phase.ADJUST: "Adjusting plan",
}


def _one_line(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _output_tail(out: TurnOutput) -> str:
    """The end of the output (where the Evaluate marker sits), even when it was spilled."""
    if out.spill_path is None:
        return out.text
    try:
        with open(out.spill_path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - _TAIL_READ))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return out.text
