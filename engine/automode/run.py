"""Starting, resuming and stopping auto-mode runs: the composition of runner and channel.

The run's row, its session wrapper (turn slots, stop) and each of its turns go through the
:class:`~engine.runs.RunSupervisor`; what is here is auto mode's own part: validating the
spec, building runner and channel, and the owner's claim on resume.

Long: the owner's claim (the row compare-and-set plus the lock that holds across machines)
belongs with start and resume, which share validation and the composition of the run.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import shlex
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from engine.agents.base import ProcessAgent, without_settings
from engine.agents.factory import AGENT_NAMES, create_agent, probe_turn_mode
from engine.agents.warm import close_agent
from engine.approvals.policy import ApprovalPolicy
from engine.approvals.route import ApprovalRoute
from engine.automode.append import InstructionInbox
from engine.automode.budget import STOPPED_BY_BUDGET
from engine.automode.channel import STOPPED_BY_PERSON, AutoModeChannel
from engine.automode.git import Git
from engine.automode.prompts import PromptTemplates
from engine.automode.runner import AutoModeRunner
from engine.automode.state import (
    AutoModeState,
    AutoStatus,
    owner_alive,
    owner_token,
    write_state_file,
)
from engine.automode.summary import WorkSummaryGenerator
from engine.automode.verifier import CompletionVerifier
from engine.errors import ConfigError, TurnError, TurnPreempted
from engine.locks import Lock
from engine.logs import log_context
from engine.redact import Redactor
from engine.runs import AgentEnv, RunMode, RunSession, RunSpec, RunSupervisor
from engine.runs.stop import until_stopped
from engine.settings import Settings
from engine.sink import LogSink, RunSink, SendRules, recording
from engine.spend import Budget
from engine.store.backend import AnyDatabase
from engine.store.events import EventKind, add_event, events_written
from engine.store.leases import database_lock
from engine.store.runs import RunStatus, SqliteRunStore, TurnState, stored_state
from engine.turn import AgentSession, Ready
from engine.workspace.runs import push_run_branch

__all__ = [
    "MAX_OBJECTIVE_BYTES",
    "AutoResult",
    "AutoRun",
    "prepare_auto_run",
    "prepare_resume",
    "process_exit_code",
    "refuse_resume_settings",
    "resumable",
    "resume_auto_run",
    "start_auto_run",
]

_LOGGER = logging.getLogger(__name__)
# Where a run's tool calls ask a person, given its run id and its own policy (None: the
# front end's, TURNSTILE_TOOL_APPROVAL); None back: nobody is asked.
ApprovalFor = Callable[[str, ApprovalPolicy | None], ApprovalRoute | None]

MAX_OBJECTIVE_BYTES: Final = 16 * 1024
INTERRUPTED_ERROR: Final = "the process stopped while this turn ran"


@dataclass(frozen=True, slots=True)
class AutoResult:
    """How a run ended.

    Attributes:
        status: completed, stopped or error.
        exit_code: what the terminal command exits with (see :func:`process_exit_code`).
        abort: a reason iff a required turn failed (recorded as a crash).
        report: the final report (evidence and work summary).
    """

    run_id: str
    status: AutoStatus
    exit_code: int
    abort: str | None
    message: str | None
    report: str | None


def process_exit_code(code: int) -> int:
    """A turn's exit code as a process exit status (killed by signal N → 128+N)."""
    if code < 0:
        return min(128 - code, 255)
    return code if code <= 255 else 1


class AutoRun:
    """One auto-mode run: started with :meth:`start`, awaited through :attr:`task`.

    Attributes:
        runner: the execution half (replaceable before :meth:`start`, e.g. in tests).
        channel: the control-flow half; its state is readable at any time.
        failed: why its last turn could not run (the run crashed), if it could not.
    """

    def __init__(
        self,
        *,
        channel: AutoModeChannel,
        runner: AgentSession,
        inbox: InstructionInbox,
        stop: asyncio.Event,
        supervisor: RunSupervisor,
        owner_lock: Lock | None = None,
    ) -> None:
        self.channel = channel
        self.runner = runner
        self.inbox = inbox
        self.supervisor = supervisor
        self._stop = stop
        self._owner_lock = owner_lock
        self._task: asyncio.Task[AutoResult] | None = None
        self._session: RunSession | None = None
        self.failed: TurnError | None = None

    @property
    def run_id(self) -> str:
        return self.channel.state.run_id

    @property
    def session_id(self) -> str:
        return self.channel.state.session_id

    @property
    def log_dir(self) -> Path:
        return Path(self.channel.state.log_dir)

    @property
    def state(self) -> AutoModeState:
        return self.channel.state

    @property
    def task(self) -> asyncio.Task[AutoResult]:
        if self._task is None:
            raise RuntimeError("the run was not started")
        return self._task

    def start(self) -> asyncio.Task[AutoResult]:
        """Start driving the run in a named task (once)."""
        if self._task is None:
            if self.supervisor.attached(self.run_id):
                raise ConfigError(f"run {self.run_id} is already driven here")
            # Attached at once: a stop through the supervisor reaches the run even before
            # its first turn; detached when its task is over, however it ends.
            self._session = self.supervisor.attach(
                self.run_id, self.runner, stop=self._stop, on_stop=self.channel.request_stop
            )
            # The task copies the context: every line it logs carries the run id.
            with log_context(run_id=self.run_id):
                self._task = asyncio.create_task(self._drive(), name=f"auto-{self.run_id}")
            self._task.add_done_callback(lambda _: self.supervisor.detach(self.run_id))
        return self._task

    async def wait(self) -> AutoResult:
        return await self.start()

    def append_instruction(self, text: str) -> Path:
        """Drop a steering instruction for the next Execute turn (exclusive file, mode 0600).

        Raises:
            ConfigError: empty, over 50 KiB, NUL bytes, or 100 instructions already pending.
        """
        path = self.inbox.append(text)
        _LOGGER.info("appended instruction %s queued", path.name, extra={"run_id": self.run_id})
        return path

    async def stop(self) -> None:
        """Stop the run: pre-empt the running turn or verify command; the run ends stopped.

        Front ends stop a started run with ``supervisor.stop(run_id)``; this is the same.
        """
        if not self.supervisor.stop(self.run_id):
            # Not started (or already over): the latch waits for a start.
            self._stop.set()
            self.channel.request_stop()

    def result(self) -> AutoResult:
        s = self.channel.state
        return AutoResult(
            run_id=s.run_id,
            status=s.status,
            exit_code=process_exit_code(s.exit_code),
            abort=s.abort,
            message=s.message,
            report=self.channel.report,
        )

    async def close(self) -> None:
        """Let go of a run that will not be started (its owner lock, taken on resume)."""
        if self._task is None and self._owner_lock is not None:
            await self._owner_lock.release()

    async def _drive(self) -> AutoResult:
        lock = self._owner_lock
        if lock is not None and not lock.held and not await lock.try_acquire():
            raise ConfigError(await _driven_elsewhere(self.run_id, lock))
        try:
            while await self.step():
                pass
        finally:
            # A warm session's resident process ends with its run (not at idle eviction).
            await asyncio.shield(close_agent(self.runner))
            if lock is not None:
                await asyncio.shield(lock.release())
        if self.failed is not None:
            raise self.failed
        return self.result()

    async def step(self) -> bool:
        """Run the run's next turn (or end it, once it is over or stopped); whether it goes
        on. A started run loops over it; a worker runs one a job. A turn that could not run
        (or was cut off, but not by a person's stop) ends the run crashed (see :attr:`failed`).
        """
        channel = self.channel
        if self._stop.is_set():
            channel.request_stop()
        # Started here, turns go through the supervisor (turn slots, pauses).
        session = self._session if self._session is not None else self.runner
        try:
            with log_context(session_id=self.session_id):
                match await channel.next_prompt():
                    case Ready(prompt=prompt):
                        try:
                            out = await until_stopped(
                                session.run_turn(prompt),
                                self._stop,
                                what="the turn",
                                session_id=self.session_id,
                            )
                        except TurnError as exc:
                            if isinstance(exc, TurnPreempted) and self._stop.is_set():
                                await channel.record_preempted(STOPPED_BY_PERSON.lower())
                                return False
                            await channel.record_turn_error(str(exc))
                            self.failed = exc
                            return False
                        await channel.publish_output(out)
                    case _:
                        return False
        finally:
            await channel.flush()
        return self.state.status is AutoStatus.RUNNING


def _verifier_env(agent: ProcessAgent) -> dict[str, str]:
    """The verify command's environment: the agent's (it runs the agent's code)."""
    return without_settings({**agent.base_environment(), **agent.options.extra_env})


def _verify_argv(verify_cmd: str | None, workdir: Path) -> list[str] | None:
    if verify_cmd is None or not verify_cmd.strip():
        return None
    try:
        argv = shlex.split(verify_cmd)
    except ValueError as exc:
        raise ConfigError(f"--verify-cmd cannot be split: {exc}") from exc
    program = argv[0]
    if "/" in program:
        path = Path(program) if Path(program).is_absolute() else workdir / program
        found = path.exists()
    else:
        found = shutil.which(program) is not None
    if not found:
        raise ConfigError(f"verify command program {program!r} not found")
    return argv


def _validate(
    objective: str,
    tool: str,
    turns: int,
    workdir: Path,
    prompts_dir: Path | None,
    verify_cmd: str | None,
) -> tuple[Path, str | None]:
    if tool not in AGENT_NAMES:
        raise ConfigError(f"unknown agent {tool!r}: choose one of {', '.join(AGENT_NAMES)}")
    if turns < 1:
        raise ConfigError(f"--max-rounds must be at least 1, got {turns}")
    if not objective.strip():
        raise ConfigError("the objective (-p PROMPT) is empty")
    if "\x00" in objective:
        raise ConfigError("the objective contains a NUL byte")
    if len(objective.encode()) > MAX_OBJECTIVE_BYTES:
        raise ConfigError(f"the objective is longer than {MAX_OBJECTIVE_BYTES} bytes")
    if not workdir.is_dir():
        raise ConfigError(f"working directory {workdir} does not exist")
    workdir = workdir.resolve()
    PromptTemplates.load(prompts_dir)  # refuse a bad override now, not mid-run
    _verify_argv(verify_cmd, workdir)
    return workdir, str(prompts_dir.absolute()) if prompts_dir else None


def _build(
    settings: Settings,
    store: SqliteRunStore,
    state: AutoModeState,
    *,
    sink: RunSink | None,
    resume_session: bool,
    env: AgentEnv,
    stop_event: asyncio.Event | None,
    supervisor: RunSupervisor,
    approval_for: ApprovalFor | None = None,
    owner_lock: Lock | None = None,
) -> AutoRun:
    cfg = state.config
    workdir = Path(state.workdir)
    prompts_dir = cfg.get("prompts_dir")
    templates = PromptTemplates.load(Path(prompts_dir) if prompts_dir else None)
    agent = create_agent(
        state.tool,
        settings,
        cwd=workdir,
        session_id=state.session_id,
        agent_cmd=cfg.get("agent_cmd"),
        passthrough=tuple(cfg.get("passthrough", ())),
        extra_env=env.extra_env or None,
        config_dir=env.config_dir,
        resume=resume_session,
        turns_finished=resume_session,
        approval=(
            approval_for(state.run_id, _permissions(cfg)) if approval_for is not None else None
        ),
        # Counted with every other run's warm session (the bot's cap covers auto runs).
        warm_pool=supervisor.warm_pool,
    )
    log_dir = Path(state.log_dir)
    stop = stop_event if stop_event is not None else asyncio.Event()
    verifier = CompletionVerifier(
        workdir,
        base_commit=state.base_commit,
        verify_cmd=_verify_argv(cfg.get("verify_cmd"), workdir),
        threshold=float(cfg.get("threshold", settings.completion_threshold)),
        exclude=[log_dir],
        stop=stop,
        spill_dir=log_dir,
        walls=agent.options.walls,
        env=_verifier_env(agent),
    )
    inbox = InstructionInbox(log_dir)
    inbox.ensure()
    channel = AutoModeChannel(
        state,
        store=store,
        templates=templates,
        verifier=verifier,
        summary=WorkSummaryGenerator(
            workdir,
            base_commit=state.base_commit,
            push=functools.partial(push_run_branch, settings, store.db, state.run_id),
        ),
        inbox=inbox,
        uploads=settings.uploads_dir,
        sink=recording(
            sink if sink is not None else LogSink(),
            store.db,
            sends=SendRules(settings.send_max_bytes, Redactor(settings.secret_values())),
        ),
    )
    agent.preempt.on_spawn = channel.record_process
    return AutoRun(
        channel=channel,
        runner=AutoModeRunner(agent),
        inbox=inbox,
        stop=stop,
        supervisor=supervisor,
        owner_lock=owner_lock,
    )


def _permissions(config: Mapping[str, Any]) -> ApprovalPolicy | None:
    """The run's own tool approval policy (None: its front end's)."""
    given = config.get("permissions")
    return ApprovalPolicy(given) if given else None


def permissions_config(spec: RunSpec) -> dict[str, Any]:
    """The run's own policy, checked, for its state (resumes keep it).

    Raises:
        ConfigError: no such policy, or a preset for an agent that cannot ask turnstile.
    """
    if spec.permissions is None:
        return {}
    try:
        policy = ApprovalPolicy(spec.permissions)
    except ValueError:
        choices = ", ".join(p.value for p in ApprovalPolicy)
        raise ConfigError(
            f"there are no permissions {spec.permissions!r}: choose one of {choices}"
        ) from None
    if policy is not ApprovalPolicy.OFF and spec.agent != "claude":
        raise ConfigError(
            f"{spec.agent} cannot ask before its tool calls (only Claude Code can): "
            "run it without permissions, or use claude"
        )
    return {"permissions": policy.value}


def _budget_config(settings: Settings, spec: RunSpec) -> dict[str, Any]:
    """What the run may spend, kept with its state (a resume and a worker keep it too)."""
    budget = spec.budget
    refused = budget.refusal_for(spec.agent) if budget is not None else None
    if refused is not None:
        raise ConfigError(f"cannot keep to this budget: {refused}")
    if budget is None and settings.run_budget is not None:
        # The default applies where the agent reports a cost; elsewhere it cannot.
        default = Budget(usd=settings.run_budget)
        budget = default if default.refusal_for(spec.agent) is None else None
    config: dict[str, Any] = budget.to_config() if budget is not None else {}
    if settings.daily_budget is not None and spec.chat is not None:
        config.update(daily_budget=settings.daily_budget, chat_id=spec.chat.chat_id)
    return config


def _owner_lock(db: AnyDatabase, state: AutoModeState) -> Lock:
    """Held by the process that drives the run, for as long as it drives it: an ``flock``
    in the run's folder on SQLite, an advisory lock on PostgreSQL (another machine's pid
    says nothing here)."""
    return database_lock(db, f"run:{state.run_id}", Path(state.log_dir) / ".owner.lock")


async def _driven_elsewhere(run_id: str, lock: Lock) -> str:
    pid = await lock.holder()
    return (
        f"run {run_id} is still driven by process {pid}"
        if pid
        else f"run {run_id} is still driven by another process"
    )


async def prepare_auto_run(
    settings: Settings,
    db: AnyDatabase,
    spec: RunSpec,
    *,
    sink: RunSink | None = None,
    stop_event: asyncio.Event | None = None,
    supervisor: RunSupervisor | None = None,
    approval_for: ApprovalFor | None = None,
    placed: bool = False,
) -> AutoRun:
    """Validate everything, record the run, and return it ready to :meth:`AutoRun.start`.

    ``placed``: the run's row was written when it was placed on the workers (by
    ``spec.run_id``); this, its first step, fills it in instead of inserting one.

    Raises:
        ConfigError: bad input (turn cap, tool, workdir, objective, templates, verify command).
    """
    if spec.mode is not RunMode.AUTO:
        raise ConfigError(f"an auto run cannot be started from a {spec.mode.value} spec")
    objective, tool = spec.objective, spec.agent
    turns = settings.max_turns if spec.max_turns is None else spec.max_turns
    workdir, prompts = _validate(
        objective, tool, turns, spec.workdir, spec.prompts_dir, spec.verify_cmd
    )
    budget = _budget_config(settings, spec)
    permissions = permissions_config(spec)
    store = SqliteRunStore(db)
    supervisor = supervisor if supervisor is not None else RunSupervisor(store)
    run_id = spec.run_id or supervisor.reserve(RunMode.AUTO)
    log_dir = settings.runs_dir.resolve() / run_id
    log_dir.mkdir(parents=True, exist_ok=False, mode=0o700)
    now = time.time()
    state = AutoModeState(
        run_id=run_id,
        session_id=str(uuid.uuid4()),
        objective=objective,
        workdir=str(workdir),
        log_dir=str(log_dir),
        max_turns=turns,
        tool=tool,
        started_at=now,
        updated_at=now,
        base_commit=await Git(workdir).head(),
        config={
            # The effective template, so a resume runs the same command.
            "agent_cmd": spec.agent_cmd or (settings.agent_command if tool == "command" else None),
            "passthrough": list(spec.passthrough),
            "verify_cmd": spec.verify_cmd,
            "prompts_dir": prompts,
            "threshold": settings.completion_threshold,
            **budget,
            **permissions,
        },
        owner=owner_token(),
    )
    try:
        await probe_turn_mode(tool, settings)  # asked off the event loop, before the agent
        run = _build(
            settings,
            store,
            state,
            sink=sink,
            resume_session=False,
            env=spec.env,
            stop_event=stop_event,
            supervisor=supervisor,
            approval_for=approval_for,
            owner_lock=_owner_lock(db, state),
        )
    except BaseException:
        # Nothing was recorded: leave no empty log folder behind either.
        shutil.rmtree(log_dir, ignore_errors=True)
        raise
    if placed:
        await store.start_placed(
            run_id,
            session_id=state.session_id,
            workdir=str(workdir),
            log_dir=str(log_dir),
            phase=state.phase.value,
            state=state.to_json(),
        )
    else:
        await supervisor.open_run(
            RunMode.AUTO,
            run_id=run_id,
            agent=tool,
            session_id=state.session_id,
            objective=objective,
            workdir=str(workdir),
            log_dir=str(log_dir),
            chat=spec.chat,
            phase=state.phase.value,
            state=state.to_json(),
        )
    write_state_file(log_dir, state)
    # An agent running `git add -A` in a workdir that holds the runs folder never commits it.
    (log_dir / ".gitignore").write_text("*\n", encoding="utf-8")
    _LOGGER.info(
        "Auto run %s started: tool=%s workdir=%s max_turns=%d log=%s",
        run_id,
        tool,
        workdir,
        turns,
        log_dir,
        extra={"run_id": run_id},
    )
    return run


async def _claim(
    db: AnyDatabase, run_id: str, seen_owner: str | None, state: AutoModeState
) -> None:
    """Make this process the run's driver, compare-and-set on the owner it saw.

    The read and the write are one atomic step: SQLite's ``BEGIN IMMEDIATE`` serialises
    writers across processes; on PostgreSQL the row is locked (``FOR UPDATE``), so a second
    claimer waits and then reads the first one's owner.

    Raises:
        ConfigError: another process claimed the run in between.
    """
    async with db.transaction() as conn:
        cursor = await conn.execute(
            f"SELECT state_json, status FROM runs WHERE id = ?{db.for_update}",  # noqa: S608
            (run_id,),
        )
        row = await cursor.fetchone()
        current = json.loads(row[0]).get("owner") if row is not None else None
        if row is None or current != seen_owner:
            raise ConfigError(f"run {run_id} was just resumed by another process")
        await conn.execute(
            "UPDATE runs SET status = ?, state_json = ?, exit_code = NULL, abort_reason = NULL,"
            " finished_at = NULL, updated_at = ? WHERE id = ?",
            (RunStatus.RUNNING.value, stored_state(state.to_json()), state.updated_at, run_id),
        )
        resumed = {"from": row[1], "phase": state.phase.value}
        await add_event(conn, db, EventKind.RUN_RESUMED, run_id=run_id, data=resumed)
    events_written(db)


def resumable(state: AutoModeState) -> bool:
    """Not finished: still running (the process died), or stopped by a person or by its
    budget (which a resume with a larger one raises)."""
    if state.status is AutoStatus.RUNNING:
        return True
    return state.status is AutoStatus.STOPPED and (
        state.message == STOPPED_BY_PERSON or state.config.get("stopped_by") == STOPPED_BY_BUDGET
    )


def _rebudgeted(state: AutoModeState, budget: Budget | None) -> AutoModeState:
    """The state going on with ``budget`` (None: the one it had). A run its budget stopped
    goes on only with a larger one."""
    config = dict(state.config)
    if config.get("stopped_by") == STOPPED_BY_BUDGET:
        old = Budget.from_config(config)
        if budget is None or (old is not None and not _larger(budget, old)):
            had = f" of {old.text()}" if old is not None else ""
            raise ConfigError(
                f"run {state.run_id} was stopped by its budget{had}: resume it with a larger "
                "--budget"
            )
        config.pop("stopped_by")
    if budget is not None:
        config.update(budget.to_config())
        config.pop("budget_warned_run", None)
    return replace(state, config=config)


def _larger(new: Budget, old: Budget) -> bool:
    return (new.usd or 0) > (old.usd or 0) or (new.tokens or 0) > (old.tokens or 0)


def refuse_resume_settings(args: Any) -> None:
    """A resume goes on with the run's recorded settings: ConfigError names the settings
    ``args`` (``turnstile auto``'s) gives that a resume would ignore."""
    given = [
        flag
        for flag, value in (
            ("-p", args.prompt),
            ("--tool", args.tool),
            ("--agent-cmd", args.agent_cmd),
            ("--max-rounds", args.max_turns),
            ("--workdir", args.workdir),
            ("--verify-cmd", args.verify_cmd),
            ("--prompts", args.prompts),
            ("passthrough arguments", args.passthrough or None),
            ("--checkout-repo", args.checkout_repo),
            ("--permissions", getattr(args, "permissions", None)),
        )
        if value is not None
    ]
    if given:
        raise ConfigError(
            "--resume continues a run with its recorded settings; drop " + ", ".join(given)
        )


async def prepare_resume(
    settings: Settings,
    db: AnyDatabase,
    run_id: str,
    *,
    env: AgentEnv | None = None,
    sink: RunSink | None = None,
    stop_event: asyncio.Event | None = None,
    supervisor: RunSupervisor | None = None,
    approval_for: ApprovalFor | None = None,
    budget: Budget | None = None,
) -> AutoRun:
    """Reload a run from the store to continue from its recorded phase and turn (with
    ``budget``: under that budget from now on).

    Its turns still recorded as started were cut off: they are marked interrupted and
    run again (same sequence number, next attempt).

    Raises:
        NotFoundError: no such run.
        ConfigError: not an auto run, already finished, or still driven by a live process.
    """
    store = SqliteRunStore(db)
    supervisor = supervisor if supervisor is not None else RunSupervisor(store)
    record = await store.get_run(run_id)
    if record.mode != "auto":
        raise ConfigError(f"run {run_id} is a {record.mode} run, not an auto run")
    state = AutoModeState.of_run(record)
    if not resumable(state):
        raise ConfigError(f"run {run_id} has ended ({state.status.value}); it cannot be resumed")
    state = _rebudgeted(state, budget)
    me = owner_token()
    # The owner lock is the word on who drives the run; on SQLite (one machine) a live
    # pid:start-time owner also counts, for a process that drives it without the lock.
    local = db.dialect == "sqlite"
    if local and state.owner not in (None, me) and owner_alive(state.owner):
        raise ConfigError(
            f"run {run_id} is still driven by process {state.owner.split(':')[0]}"
            if state.owner
            else f"run {run_id} is still driven by another process"
        )
    lock = _owner_lock(db, state)
    if not await lock.try_acquire():
        raise ConfigError(await _driven_elsewhere(run_id, lock))
    try:
        seen_owner = state.owner
        state = replace(
            state,
            status=AutoStatus.RUNNING,
            exit_code=0,
            abort=None,
            message=None,
            finished_at=None,
            owner=me,
            updated_at=time.time(),
        )
        # Claim first: of two processes resuming at once, the loser touches nothing.
        await _claim(db, run_id, seen_owner, state)
        # What the cut-off turn left running dies before the turn runs again.
        for turn in await store.turns(run_id):
            if turn.state is TurnState.STARTED and turn.kill_remains():
                _LOGGER.info(
                    "killed what was left of turn %d of run %s",
                    turn.seq,
                    run_id,
                    extra={"run_id": run_id},
                )
        interrupted = await store.interrupt_run_turns(run_id, INTERRUPTED_ERROR)
        turns = await store.turns(run_id)
        resume_session = any(t.state is TurnState.FINISHED for t in turns)
        write_state_file(Path(state.log_dir), state)
        _LOGGER.info(
            "Resuming auto run %s at turn %d/%d, phase %s (step %d); %d interrupted turn(s) re-run",
            run_id,
            state.turn,
            state.max_turns,
            state.phase.value,
            state.step,
            interrupted,
            extra={"run_id": run_id},
        )
        await probe_turn_mode(state.tool, settings)
        return _build(
            settings,
            store,
            state,
            sink=sink,
            resume_session=resume_session,
            env=env if env is not None else AgentEnv(),
            stop_event=stop_event,
            supervisor=supervisor,
            approval_for=approval_for,
            owner_lock=lock,
        )
    except BaseException:
        await lock.release()
        raise


async def start_auto_run(
    settings: Settings,
    db: AnyDatabase,
    spec: RunSpec,
    *,
    sink: RunSink | None = None,
    stop_event: asyncio.Event | None = None,
    supervisor: RunSupervisor | None = None,
    approval_for: ApprovalFor | None = None,
) -> AutoRun:
    """Start a new auto run now; the caller awaits ``run.task`` (or ``run.wait()``)."""
    run = await prepare_auto_run(
        settings,
        db,
        spec,
        sink=sink,
        stop_event=stop_event,
        supervisor=supervisor,
        approval_for=approval_for,
    )
    run.start()
    return run


async def resume_auto_run(
    settings: Settings,
    db: AnyDatabase,
    run_id: str,
    *,
    env: AgentEnv | None = None,
    sink: RunSink | None = None,
    stop_event: asyncio.Event | None = None,
    supervisor: RunSupervisor | None = None,
    approval_for: ApprovalFor | None = None,
    budget: Budget | None = None,
) -> AutoRun:
    """Resume a run from its recorded phase and turn (with ``budget``: under that one);
    the caller awaits ``run.task``."""
    run = await prepare_resume(
        settings,
        db,
        run_id,
        env=env,
        sink=sink,
        stop_event=stop_event,
        supervisor=supervisor,
        approval_for=approval_for,
        budget=budget,
    )
    run.start()
    return run
