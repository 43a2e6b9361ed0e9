"""``turnstile autopilot --task T``: drive a gated task through its phases from the terminal.

Exit codes: 0 the task completed (or ``--manual`` reported it); 3 parked at an approval gate
(``--no-wait``); 4 the task needs a person (human_intervention); 5 stopped by its budget
(``--budget``); 10-24 a refusal (see docs/gates.md); 2 bad input (a budget the agent cannot
be held to).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from engine.errors import ConfigError
from engine.humane import humane, words
from engine.settings import Settings
from engine.spend import Budget

if TYPE_CHECKING:  # start-up time: the drive's modules load only when a drive runs
    from engine.sink import GateRequest, RunText, StatusUpdate

__all__ = ["EXIT_BUDGET", "EXIT_HUMAN", "EXIT_PARKED", "drive_budget", "register"]

EXIT_PARKED = 3
EXIT_HUMAN = 4
EXIT_BUDGET = 5

# How a drive ended (its outcome's value), in words.
_ENDED = {
    "complete": "the task is complete",
    "human_intervention": "the task needs a person",
    "parked": "the drive stops here; the task waits for approval",
    "stopped_by_budget": "stopped by its budget",
}


class TerminalDriveSink:
    """What a drive says on the terminal, for a person: each phase as it starts and ends,
    what needs them (a gate: how to approve it here or from the chat), notes and files."""

    def __init__(self, out: TextIO = sys.stdout) -> None:
        self._out = out
        self._shown: dict[str, tuple[str, str | None, int]] = {}

    def _say(self, line: str) -> None:
        print(line, file=self._out, flush=True)

    async def publish_text(self, run_id: str, text: str) -> None:
        self._say(humane(text.strip()))

    async def publish_run_text(self, said: RunText) -> None:
        if said.kind == "turn":
            first = next((line for line in said.text.splitlines() if line.strip()), "")
            if first:
                self._say(f"   {first[:160]}")
            return
        self._say(humane(said.text.strip()))

    async def update_status(self, update: StatusUpdate) -> None:
        seen = (update.status, update.phase, update.turn)
        if self._shown.get(update.run_id) == seen:
            return
        self._shown[update.run_id] = seen
        state = words(update.status)
        # A phase that is the state itself (a task that is complete) is said once.
        phase = words(update.phase) if update.phase else ""
        phase = "" if phase in (state, update.status, words(update.status, icon=False)) else phase
        head = " · ".join(part for part in (update.task or "", phase) if part)
        self._say(f"{head}: {state}" if head else state)

    async def request_gate(self, request: GateRequest) -> None:
        self._say(
            f"🛂 {request.task} · {words(request.phase)} waits for approval of "
            f"{request.artifact_name} (sha256 {request.short_hash}). Approve it here with "
            f"`turnstile status --task {request.task} --approve --by YOUR_ID`, or in the "
            f"chat the project is bound to: the Approve button, or /approve {request.task}."
        )

    async def send_files(self, run_id: str, workdir: Path, paths: list[str]) -> None:
        for path in paths:
            self._say(f"📎 the agent hands over {path} (in {workdir})")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "autopilot",
        help="drive a gated task phase by phase (approval gates pause it)",
        description="Drives a task through its phases on one agent session, stopping at each "
        "gate that needs a person's approval. "
        "Approve gates with `turnstile status --task T --approve --by USER_ID` from any "
        "terminal; the driver notices within --poll seconds.",
    )
    parser.add_argument("--task", "-t", required=True, metavar="T")
    parser.add_argument("--tool", default=None, help="claude, copilot, codex or command")
    parser.add_argument("--agent-cmd", default=None, help="the command agent's argv template")
    parser.add_argument(
        "--manual", action="store_true", help="report the state and the next step; change nothing"
    )
    parser.add_argument(
        "--no-wait",
        action="store_true",
        help="exit (code 3) at an approval gate instead of waiting; run again to resume",
    )
    parser.add_argument("--poll", type=float, default=1.0, help="seconds between gate polls")
    parser.add_argument(
        "--budget",
        type=float,
        metavar="USD",
        help="stop the drive after the turn that spends this much, its sub-tasks' turns "
        "counted too (default: TURNSTILE_RUN_BUDGET, where the agent reports a cost)",
    )
    parser.add_argument(
        "--budget-tokens",
        type=int,
        metavar="N",
        help="the same in tokens, for an agent that reports tokens and no cost (Codex)",
    )
    parser.add_argument("--init", action="store_true", help="create the task if it is missing")
    parser.add_argument("--folder", type=Path, help="--init: task folder")
    parser.add_argument("--workdir", type=Path, help="--init: code workspace (agent cwd)")
    parser.add_argument("--summary", help="--init: one line describing the task")
    parser.add_argument("--by", help="--init: who starts the task (user id)")
    # Same flag as engine.workspace.runs.add_checkout_argument, declared here so that
    # building the parser does not import the workspace package.
    parser.add_argument(
        "--checkout-repo",
        metavar="PROJECT",
        default=None,
        help="--init: work in a fresh git worktree of this project (TURNSTILE_PROJECTS) on "
        "branch turnstile/<task>; see `turnstile projects`",
    )
    parser.add_argument(
        "--detach",
        action="store_true",
        help="with TURNSTILE_EXECUTION=workers: print the drive's run id and return",
    )
    # A person's view (warnings only, in plain words) unless --log-level asks for records.
    parser.set_defaults(handler=run_autopilot, terminal_view=True)


async def run_autopilot(args: argparse.Namespace, settings: Settings) -> int:
    from engine.executors import drive_elsewhere
    from engine.gates.autopilot import DriveOutcome, next_step
    from engine.gates.refusals import GateRefused
    from engine.gates.service import Gates
    from engine.sink import LogSink
    from engine.store.backend import open_database

    budget = drive_budget(args, settings)  # refused before anything is made
    if not args.manual:
        elsewhere = await drive_elsewhere(args, settings)
        if elsewhere is not None:
            return elsewhere
    try:
        async with open_database(settings) as db:
            # The gates store's SQL runs on both databases; its annotations name SQLite's.
            gates = Gates(db, settings, poll_interval=max(0.05, args.poll))
            if args.init and await gates.store.find(args.task) is None:
                await _init(args, settings, db, gates)
            task = await gates.task(args.task)
            if args.manual:
                approvals = await gates.store.gate_approvals(task)
                print(f"{task.name}: {task.label} (v{task.version})")
                print(f"next: {next_step(gates.store, task, len({a.approver for a in approvals}))}")
                return 0
            # A task checked out with --checkout-repo: the drive holds its worktree.
            handle = gates.start_autopilot(
                args.task,
                LogSink() if args.log_level else TerminalDriveSink(),
                tool=args.tool,
                agent_cmd=args.agent_cmd,
                wait_for_approval=not args.no_wait,
                budget=budget,
            )
            if budget is not None:
                print(
                    f"{args.task}: the drive may spend {budget.text()}; it stops after the "
                    "turn that reaches that",
                    flush=True,
                )
            try:
                outcome = await handle.wait()
            finally:
                await handle.stop()
            task = await gates.task(args.task)
    except GateRefused as exc:
        print(f"turnstile: refused: {exc.reason.value}: {exc.detail}", file=sys.stderr)
        return exc.reason.exit_code
    if outcome is DriveOutcome.STOPPED_BY_BUDGET:
        spent = handle.pilot.budget if handle.pilot is not None else None
        assert spent is not None
        more = "--budget-tokens MORE" if spent.budget.usd is None else "--budget MORE"
        print(
            f"{task.name}: {spent.stopped_text()}; the drive stopped after the turn that "
            f"reached it, and the task stays at {words(task.label)}. "
            f"`turnstile autopilot --task {task.name} {more}` goes on from there."
        )
        return EXIT_BUDGET
    print(f"{task.name}: {_ENDED[outcome.value]} ({words(task.label)})")
    if outcome is DriveOutcome.PARKED:
        return EXIT_PARKED
    if outcome is DriveOutcome.HUMAN_INTERVENTION:
        return EXIT_HUMAN
    return 0


def drive_budget(args: argparse.Namespace, settings: Settings) -> Budget | None:
    """The budget of the drive ``args`` asks for: ``--budget`` / ``--budget-tokens``, else
    TURNSTILE_RUN_BUDGET where the agent reports a cost and the drive runs here (on the
    workers a drive is held to the budget it is given, which travels with it).

    Raises:
        ConfigError: a budget the drive could not be held to (its agent reports no cost,
            or neither cost nor tokens; ``--manual``).
    """
    given = Budget.given(args.budget, args.budget_tokens)
    agent = args.tool or settings.default_agent
    if given is None:
        if settings.run_budget is None or args.manual or settings.execution == "workers":
            return None
        default = Budget(usd=settings.run_budget)
        return default if default.refusal_for(agent) is None else None
    if args.manual:
        raise ConfigError("--budget is for a drive; --manual only reports and spends nothing")
    refused = given.refusal_for(agent)
    if refused is not None:
        raise ConfigError(f"cannot keep to this budget: {refused}")
    return given


async def _init(args: argparse.Namespace, settings: Settings, db: Any, gates: Any) -> None:
    """Create the task; with ``--checkout-repo`` its workdir is a new worktree (run id =
    task name), removed again if the task cannot be created."""
    if args.checkout_repo is None:
        await gates.init_task(
            args.task,
            folder=args.folder,
            workdir=args.workdir,
            summary=args.summary,
            started_by=args.by,
        )
        return
    from engine.gates.names import check_task_name
    from engine.workspace.runs import checkout_for_run

    check_task_name(args.task)
    async with checkout_for_run(
        settings, db, args.checkout_repo, run_id=args.task, workdir=args.workdir
    ) as workspace:
        assert workspace is not None
        await gates.init_task(
            args.task,
            folder=args.folder,
            workdir=workspace.path,
            summary=args.summary,
            started_by=args.by,
        )
