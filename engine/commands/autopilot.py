"""``turnstile autopilot --task T``: drive a gated task through its phases from the terminal.

Exit codes: 0 the task completed (or ``--manual`` reported it); 3 parked at an approval gate
(``--no-wait``); 4 the task needs a person (human_intervention); 10-24 a refusal (see
docs/gates.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from engine.settings import Settings

__all__ = ["EXIT_HUMAN", "EXIT_PARKED", "register"]

EXIT_PARKED = 3
EXIT_HUMAN = 4


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "autopilot",
        help="drive a gated task phase by phase (approval gates pause it)",
        description="Runs the gate-check loop of seed 003 on one agent session per task. "
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
    parser.add_argument("--init", action="store_true", help="create the task if it is missing")
    parser.add_argument("--folder", type=Path, help="--init: task folder")
    parser.add_argument("--workdir", type=Path, help="--init: code workspace (agent cwd)")
    parser.add_argument("--summary", help="--init: one line describing the task")
    parser.add_argument("--by", help="--init: who starts the task (user id)")
    parser.set_defaults(handler=run_autopilot)


async def run_autopilot(args: argparse.Namespace, settings: Settings) -> int:
    from engine.gates.autopilot import DriveOutcome, next_step
    from engine.gates.refusals import GateRefused
    from engine.gates.service import Gates
    from engine.sink import LogSink
    from engine.store.database import Database

    try:
        async with Database(settings.database) as db:
            gates = Gates(db, settings, poll_interval=max(0.05, args.poll))
            if args.init and await gates.store.find(args.task) is None:
                await gates.init_task(
                    args.task,
                    folder=args.folder,
                    workdir=args.workdir,
                    summary=args.summary,
                    started_by=args.by,
                )
            task = await gates.task(args.task)
            if args.manual:
                approvals = await gates.store.gate_approvals(task)
                print(f"{task.name}: {task.label} (v{task.version})")
                print(f"next: {next_step(gates.store, task, len({a.approver for a in approvals}))}")
                return 0
            handle = gates.start_autopilot(
                args.task,
                LogSink(),
                tool=args.tool,
                agent_cmd=args.agent_cmd,
                wait_for_approval=not args.no_wait,
            )
            try:
                outcome = await handle.wait()
            finally:
                await handle.stop()
            task = await gates.task(args.task)
    except GateRefused as exc:
        print(f"turnstile: refused: {exc.reason.value}: {exc.detail}", file=sys.stderr)
        return exc.reason.exit_code
    print(f"{task.name}: {outcome.value} at {task.label}")
    if outcome is DriveOutcome.PARKED:
        return EXIT_PARKED
    if outcome is DriveOutcome.HUMAN_INTERVENTION:
        return EXIT_HUMAN
    return 0
