"""Auto mode: Clarify → Plan → Execute/Evaluate(/Adjust), one turn a step.

Two halves (seed 000): :class:`AutoModeRunner` runs each prompt verbatim in the agent
session and carries the exit code back; :class:`AutoModeChannel` owns all control flow
(phase cursor, completion detection and verification, appended instructions, logs,
state, terminal exit code and abort). :meth:`AutoRun.step` runs one turn of the pair, here
or on a worker.

Embedding (the Telegram bot, scripts)::

    from engine.automode import start_auto_run, resume_auto_run
    from engine.runs import ChatPlace, RunSpec

    spec = RunSpec(                       # plain data: a job queue can carry it (to_json)
        objective="add retry with backoff to the HTTP client",
        agent="claude",                   # claude | copilot | codex | command
        workdir=Path("/srv/work/project"),
        max_turns=10, verify_cmd="pytest -q",
        chat=ChatPlace(chat.id, topic_id),   # optional, recorded on the run
    )
    run = await start_auto_run(
        settings, db,                     # engine.settings.Settings, an open engine.store.Database
        spec,
        sink=my_sink,                     # an engine.sink.RunSink (LogSink for a terminal)
    )
    run.run_id, run.log_dir               # known at once
    run.append_instruction("also update the CHANGELOG")   # lands in the next Execute prompt
    await run.stop()                      # pre-empts the running turn / verify command
    result = await run.task               # AutoResult: status, exit_code, abort, report

    run = await resume_auto_run(settings, db, run_id, sink=my_sink)   # after a restart

Pass ``supervisor=`` (an :class:`engine.runs.RunSupervisor`, whose turn slots are shared
with chat sessions and drives) to cap agent turns running at once across runs; its
``run_turn(run_id, prompt)`` runs every turn of the run.
Pass ``stop_event=`` (an ``asyncio.Event``) to share a stop latch: setting it pre-empts
the running turn or verify command, like ``run.stop()``. ``run.channel.request_stop()``
instead lets the running turn finish and then ends the run stopped.

``start_auto_run`` validates its input and records the run before returning (a
:class:`~engine.errors.ConfigError` for bad input); the task raises
:class:`~engine.errors.TurnExecError` only when the agent cannot be spawned or captured
(the run is then recorded as crashed and can be resumed). Every other outcome is an
:class:`AutoResult`: ``completed`` (exit 0), ``stopped`` (max turns: exit 0; by a person:
exit 130), ``error`` (Evaluate failed: its exit code; a required turn failed: its exit
code, ``abort`` set, the run recorded as crashed).

Steering without a run object (another process): :func:`append_to_run_folder` writes
into a run's ``append/`` folder given its log folder.
"""

from pathlib import Path

from engine.automode.append import (
    MAX_INSTRUCTION_BYTES,
    MAX_PENDING,
    Instruction,
    InstructionInbox,
    Intake,
    render_instructions,
    sanitize_instruction,
)
from engine.automode.channel import STOPPED_BY_PERSON, AutoModeChannel, AutoRunStore, run_status
from engine.automode.prompts import MARKER_PREFIX, PromptTemplates, marker_line
from engine.automode.run import (
    AutoResult,
    AutoRun,
    prepare_auto_run,
    prepare_resume,
    process_exit_code,
    resumable,
    resume_auto_run,
    start_auto_run,
)
from engine.automode.runner import AutoModeRunner
from engine.automode.state import (
    AutoModeState,
    AutoStatus,
    Outcome,
    Phase,
    Transition,
    Verdict,
    advance,
)
from engine.automode.summary import WorkSummary, WorkSummaryGenerator
from engine.automode.verifier import (
    CompletionSignalDetector,
    CompletionVerifier,
    Evidence,
    Verification,
)


def append_to_run_folder(log_dir: Path, text: str) -> Path:
    """Drop an instruction into the run whose log folder is ``log_dir`` (exclusive, 0600)."""
    return InstructionInbox(log_dir).append(text)


__all__ = [
    "MARKER_PREFIX",
    "MAX_INSTRUCTION_BYTES",
    "MAX_PENDING",
    "STOPPED_BY_PERSON",
    "AutoModeChannel",
    "AutoModeRunner",
    "AutoModeState",
    "AutoResult",
    "AutoRun",
    "AutoRunStore",
    "AutoStatus",
    "CompletionSignalDetector",
    "CompletionVerifier",
    "Evidence",
    "Instruction",
    "InstructionInbox",
    "Intake",
    "Outcome",
    "Phase",
    "PromptTemplates",
    "Transition",
    "Verdict",
    "Verification",
    "WorkSummary",
    "WorkSummaryGenerator",
    "advance",
    "append_to_run_folder",
    "marker_line",
    "prepare_auto_run",
    "prepare_resume",
    "process_exit_code",
    "render_instructions",
    "resumable",
    "resume_auto_run",
    "run_status",
    "sanitize_instruction",
    "start_auto_run",
]
