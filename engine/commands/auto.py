"""``turnstile auto``: run an agent autonomously from the terminal.

::

    turnstile auto --tool {claude,copilot,codex,command} [--agent-cmd TEMPLATE]
                   [--max-rounds N] [--workdir DIR | --checkout-repo PROJECT]
                   [--verify-cmd CMD] [--prompts DIR] -p PROMPT [-- PASSTHROUGH...]
    turnstile auto --resume RUN_OR_SESSION_ID
    turnstile auto --append TEXT [--session RUN_OR_SESSION_ID]

The prompt may also come from ``-p``/``--prompt`` inside the passthrough, as in
``turnstile auto --tool claude -- -p "refactor the API module"``.

Exit status: 0 when the objective is verified complete or the turn cap is reached; the
Evaluate turn's code when it fails; a failed required turn's (Clarify, Plan, Adjust) code,
with the run recorded as crashed; 1 when the agent cannot be started; 2 for bad input;
130 when stopped with Ctrl-C, 143 with SIGTERM (the run stops cleanly: the turn or verify
command in flight is pre-empted and recorded as interrupted; the run can be resumed).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Any, Literal, overload

from engine.agents.command import CommandAgent
from engine.agents.factory import AGENT_NAMES
from engine.agents.stream import JsonStreamAgent
from engine.approvals.policy import ApprovalPolicy
from engine.approvals.terminal import RouteFor, stdin_lines, terminal_approvals
from engine.automode import (
    AutoRun,
    AutoStatus,
    prepare_auto_run,
    prepare_resume,
    resumable,
)
from engine.automode.append import steer_run
from engine.automode.run import refuse_resume_settings
from engine.automode.runner import AutoModeRunner
from engine.automode.state import AutoModeState, owner_alive
from engine.automode.verifier import evidence_gap
from engine.errors import ConfigError
from engine.humane import turn_count
from engine.runs import RunMode, RunSpec, RunSupervisor
from engine.settings import Settings
from engine.spend import Budget
from engine.store.backend import AnyDatabase, open_database
from engine.store.runs import RunRecord, RunStatus, SqliteRunStore
from engine.terminal import TerminalView
from engine.workspace.runs import (
    add_checkout_argument,
    checkout_for_run,
    hold_run_workspace,
)

__all__ = ["register", "resolve_workdir", "split_passthrough"]

_LOGGER = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "auto",
        help="run an agent autonomously: clarify, plan, then execute and evaluate until done",
        description=__doc__.split("::")[0].strip() if __doc__ else None,
    )
    parser.add_argument("--tool", choices=AGENT_NAMES, help="agent CLI (default: settings)")
    parser.add_argument(
        "--agent-cmd",
        metavar="TEMPLATE",
        help="argv template of the command agent: {prompt} {session_id} {cwd}",
    )
    parser.add_argument(
        "--max-rounds",
        "--max-turns",  # its older name, from before the limit was said in rounds
        dest="max_turns",
        type=int,
        metavar="N",
        help="round limit (default TURNSTILE_MAX_TURNS): Clarify and Plan are rounds 1 and "
        "2, then each Execute and Evaluate (with its Adjust) is one round; --max-turns is "
        "the same",
    )
    parser.add_argument(
        "--budget",
        type=float,
        metavar="USD",
        help="stop after the turn that spends this much (default: TURNSTILE_RUN_BUDGET)",
    )
    parser.add_argument(
        "--budget-tokens",
        type=int,
        metavar="N",
        help="the same in tokens, for an agent that reports tokens and no cost (Codex)",
    )
    parser.add_argument(
        "--permissions",
        choices=[p.value for p in ApprovalPolicy],
        help="what the agent's tool calls ask first: guarded (all that change something), "
        "trusted (only destructive or outward ones), free (only the catastrophic); "
        "default: TURNSTILE_TOOL_APPROVAL",
    )
    parser.add_argument("--workdir", type=Path, metavar="DIR", help="agent working directory")
    parser.add_argument(
        "--verify-cmd",
        metavar="CMD",
        help="command whose exit 0 is evidence of completion (argv, no shell), e.g. 'pytest -q'",
    )
    parser.add_argument("--prompts", type=Path, metavar="DIR", help="prompt template overrides")
    parser.add_argument("-p", "--prompt", help="the objective")
    parser.add_argument("--resume", metavar="RUN_ID", help="continue a run from its recorded turn")
    parser.add_argument(
        "--append", metavar="TEXT", help="steer a running run's next Execute turn ('-': stdin)"
    )
    parser.add_argument("--session", metavar="ID", help="with --append: the run (or session) id")
    parser.add_argument(
        "--detach",
        action="store_true",
        help="with TURNSTILE_EXECUTION=workers: print the run id and return",
    )
    parser.add_argument("passthrough", nargs="*", help="after --: extra agent CLI arguments")
    add_checkout_argument(parser)
    parser.set_defaults(handler=handle, terminal_view=True)


def resolve_workdir(args: argparse.Namespace, settings: Settings) -> Path:
    """The agent's working directory for a new run (one place, so a flag can change it)."""
    return args.workdir if args.workdir is not None else Path.cwd()


def split_passthrough(passthrough: list[str]) -> tuple[str | None, list[str]]:
    """Take ``-p PROMPT`` / ``--prompt PROMPT`` out of the passthrough arguments."""
    prompt: str | None = None
    rest: list[str] = []
    items = iter(passthrough)
    for item in items:
        if item in ("-p", "--prompt"):
            value = next(items, None)
            if value is None:
                raise ConfigError(f"{item} in the passthrough needs a value")
            if prompt is not None:
                raise ConfigError("the prompt was given twice")
            prompt = value
        elif item.startswith("--prompt="):
            if prompt is not None:
                raise ConfigError("the prompt was given twice")
            prompt = item.split("=", 1)[1]
        else:
            rest.append(item)
    return prompt, rest


async def handle(args: argparse.Namespace, settings: Settings) -> int:
    if args.append is not None:
        if args.prompt or args.resume or args.passthrough:
            raise ConfigError("--append cannot be combined with a prompt or --resume")
        return await _append(args, settings)
    if args.session is not None:
        raise ConfigError("--session only goes with --append")
    if args.resume is not None and settings.execution == "workers":
        # A run on the workers its budget stopped goes on there, under a larger budget.
        from engine.workers.auto import resume_on_workers

        return await resume_on_workers(args, settings, args.resume)
    from engine.executors import auto_elsewhere  # the workers' modules only when asked for

    elsewhere = await auto_elsewhere(args, settings, lambda: _objective(args))
    if elsewhere is not None:
        return elsewhere
    if args.detach:
        raise ConfigError("--detach needs TURNSTILE_EXECUTION=workers")
    # Tool requests are asked on this terminal (or denied without one), the live status
    # line hidden from the question until the answer.
    view = TerminalView()
    policy = ApprovalPolicy(settings.tool_approval)
    async with terminal_approvals(
        settings.database,
        policy,
        ask_line=view.asking(stdin_lines()),
        out=view.question_stream(),
        # A resumed run may have been started with permissions of its own.
        own_policies=args.permissions is not None or args.resume is not None,
    ) as route_for:
        return await _run(args, settings, route_for, view)


async def _run(
    args: argparse.Namespace, settings: Settings, route_for: RouteFor | None, view: TerminalView
) -> int:
    async with open_database(settings) as db:
        # The run's id, its row, its session wrapper and its stop come from the supervisor.
        supervisor = RunSupervisor(SqliteRunStore(db))
        if args.resume is not None:
            refuse_resume_settings(args)
            record = await _target_run(SqliteRunStore(db), args.resume, missing_ok=True)
            run_id = record.id if record is not None else args.resume
            async with hold_run_workspace(settings, db, run_id):
                run = await prepare_resume(
                    settings,
                    db,
                    run_id,
                    sink=view,
                    supervisor=supervisor,
                    approval_for=route_for,
                    budget=Budget.given(args.budget, args.budget_tokens),
                )
                return await _drive(run, view, supervisor, resumed=True, db=db)
        _objective(args)  # bad input is refused before anything is checked out
        if args.checkout_repo is None:
            run = await _new_run(
                args,
                settings,
                db,
                resolve_workdir(args, settings),
                view,
                supervisor=supervisor,
                approval_for=route_for,
            )
            return await _drive(run, view, supervisor, db=db)
        # A fresh worktree of the project, removed again if the run cannot be recorded;
        # its lock is held while the run is driven.
        run_id = supervisor.reserve(RunMode.AUTO)
        async with checkout_for_run(
            settings, db, args.checkout_repo, run_id=run_id, workdir=args.workdir
        ) as workspace:
            assert workspace is not None
            run = await _new_run(
                args,
                settings,
                db,
                workspace.path,
                view,
                supervisor=supervisor,
                run_id=run_id,
                project=args.checkout_repo,
                approval_for=route_for,
            )
        async with hold_run_workspace(settings, db, run_id):
            return await _drive(run, view, supervisor, db=db)


def _objective(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The objective and the agent passthrough arguments, or a ConfigError."""
    inner_prompt, passthrough = split_passthrough(list(args.passthrough))
    if args.prompt is not None and inner_prompt is not None:
        raise ConfigError("the prompt was given twice (-p and after --)")
    objective = args.prompt if args.prompt is not None else inner_prompt
    if objective is None:
        raise ConfigError("give the objective with -p PROMPT")
    if args.max_turns is not None and args.max_turns < 1:
        raise ConfigError(f"--max-rounds must be at least 1, got {args.max_turns}")
    Budget.given(args.budget, args.budget_tokens)  # a bad budget is said before it starts
    return objective, passthrough


async def _warn_unverifiable(args: argparse.Namespace, workdir: Path, view: TerminalView) -> None:
    """Said before the first turn: where no commit and no clean tree can be measured, the
    run would otherwise burn its turns on claims of completion nothing could confirm."""
    gap = await evidence_gap(workdir)
    if gap is None:
        return
    only = (
        "only the verify command can confirm it"
        if args.verify_cmd
        else "with no --verify-cmd no claim of completion can be accepted: run "
        "`git init` there and commit, or give --verify-cmd"
    )
    view.say(f"⚠️ {gap}; {only}.", style="yellow")


async def _new_run(
    args: argparse.Namespace,
    settings: Settings,
    db: AnyDatabase,
    workdir: Path,
    view: TerminalView,
    *,
    supervisor: RunSupervisor,
    run_id: str | None = None,
    project: str | None = None,
    approval_for: RouteFor | None = None,
) -> AutoRun:
    await _warn_unverifiable(args, workdir, view)
    objective, passthrough = _objective(args)
    spec = RunSpec(
        objective=objective,
        agent=args.tool or settings.default_agent,
        workdir=workdir,
        run_id=run_id,
        project=project,
        max_turns=args.max_turns,
        agent_cmd=args.agent_cmd,
        passthrough=tuple(passthrough),
        verify_cmd=args.verify_cmd,
        prompts_dir=args.prompts or settings.auto_prompts_dir,
        budget=Budget.given(args.budget, args.budget_tokens),
        permissions=args.permissions,
    )
    return await prepare_auto_run(
        settings, db, spec, sink=view, supervisor=supervisor, approval_for=approval_for
    )


def _watch_agent(run: AutoRun, view: TerminalView) -> None:
    """Feed the agent's progress (events, or stdout lines) to the live status line."""
    runner = run.runner
    agent = runner.agent if isinstance(runner, AutoModeRunner) else None
    if isinstance(agent, JsonStreamAgent):
        agent.on_event = view.on_agent_event
    elif isinstance(agent, CommandAgent):
        agent.on_line = view.on_output_line


def _header(run: AutoRun, view: TerminalView, *, resumed: bool) -> None:
    state = run.state
    verb = "Resuming" if resumed else "Auto run"
    count = turn_count(state.step - 1, round_=state.turn, limit=state.max_turns)
    where = f"{count}, " if resumed else ""
    view.say(f"{verb} {run.run_id} · {state.tool} · {where}in {state.workdir}", style="bold")
    view.say(f"Objective: {' '.join(state.objective.split())[:200]}")
    view.say(f"Log folder: {state.log_dir}", style="dim")
    if view.live:
        view.say("Ctrl-C stops the run (it can be resumed with --resume).", style="dim")


async def _drive(
    run: AutoRun,
    view: TerminalView,
    supervisor: RunSupervisor,
    *,
    resumed: bool = False,
    db: AnyDatabase | None = None,
) -> int:
    loop = asyncio.get_running_loop()
    _watch_agent(run, view)
    run.start()  # attached to the supervisor: a stop from now on reaches it
    watcher: asyncio.Task[None] | None = None
    if db is not None:
        # `turnstile stop RUN` from another terminal reaches this run through the store.
        from engine.workers.control import stop_when_asked

        watcher = asyncio.create_task(
            stop_when_asked(db, run.run_id, run.stop), name=f"stop-requests-{run.run_id}"
        )
        run.task.add_done_callback(lambda _: watcher.cancel() if watcher else None)
    received: int | None = None

    def on_signal(signum: int) -> None:
        nonlocal received
        if received is not None:
            return
        received = signum
        _LOGGER.info("%s: stopping run %s", signal.Signals(signum).name, run.run_id)
        view.say("Stopping the run: the running turn is pre-empted…", style="yellow")
        supervisor.stop(run.run_id)

    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - not on POSIX main thread
            pass
    _header(run, view, resumed=resumed)
    try:
        with view:
            result = await run.wait()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        if watcher is not None:
            await asyncio.gather(watcher, return_exceptions=True)
    code = result.exit_code
    if received is not None and result.status is AutoStatus.STOPPED and code == 130:
        code = 128 + received  # 130 for Ctrl-C, 143 for SIGTERM
    report = result.report or view.report or f"Auto run {result.run_id}: {result.status.value}"
    print(report, flush=True)
    if result.abort is not None:
        print(f"turnstile: run aborted: {result.abort}", file=sys.stderr)
    return code


async def _append(args: argparse.Namespace, settings: Settings) -> int:
    text = sys.stdin.read() if args.append == "-" else args.append
    async with open_database(settings) as db:
        store = SqliteRunStore(db)
        record = await _target_run(store, args.session)
        state = AutoModeState.of_run(record)
        if not resumable(state):
            raise ConfigError(f"run {record.id} has ended ({state.status.value})")
        # Through the store: the run takes it in at its next Execute turn wherever it runs.
        await steer_run(store, record.id, text, by=None)
    print(f"queued for the next Execute turn of {record.id}")
    return 0


@overload
async def _target_run(
    store: SqliteRunStore, wanted: str | None, *, missing_ok: Literal[False] = ...
) -> RunRecord: ...


@overload
async def _target_run(
    store: SqliteRunStore, wanted: str | None, *, missing_ok: bool
) -> RunRecord | None: ...


async def _target_run(
    store: SqliteRunStore, wanted: str | None, *, missing_ok: bool = False
) -> RunRecord | None:
    """The auto run named by its run id or session id, or the one live auto run."""
    runs = [r for r in await store.list_runs() if r.mode == "auto"]
    if wanted is not None:
        for record in runs:
            if wanted in (record.id, record.session_id):
                return record
        if missing_ok:
            return None
        raise ConfigError(f"no auto run or session {wanted!r}")
    live = [
        r
        for r in runs
        if r.status is RunStatus.RUNNING and owner_alive(AutoModeState.of_run(r).owner)
    ]
    if not live:
        raise ConfigError("no auto run is running here; name one with --session RUN_ID")
    if len(live) > 1:
        raise ConfigError(
            "several auto runs are running; name one with --session: "
            + ", ".join(r.id for r in live)
        )
    return live[0]
