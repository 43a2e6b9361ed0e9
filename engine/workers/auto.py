"""``turnstile auto`` with ``TURNSTILE_EXECUTION=workers``: queue the run, then follow it.

The run is checked out on whichever worker takes its first turn, so it needs a project
(``--checkout-repo``), not a folder of this machine. ``--resume RUN --budget MORE`` lets a
run its budget stopped go on on the workers under a larger one (its worker resumes it at
its next turn), followed from there.
"""

from __future__ import annotations

import argparse
import sys

from engine.agents.factory import AGENT_NAMES
from engine.automode.run import refuse_resume_settings
from engine.errors import ConfigError
from engine.settings import Settings
from engine.spend import Budget
from engine.store.backend import open_database
from engine.store.events import EventLog
from engine.workers.control import (
    follow_run,
    new_spec,
    project_reference,
    raise_budget_on_workers,
    start_on_workers,
    stop_on_signals,
)
from engine.workers.queue import require_postgres

__all__ = ["resume_on_workers", "run_on_workers"]


async def run_on_workers(
    args: argparse.Namespace, settings: Settings, objective: tuple[str, list[str]]
) -> int:
    require_postgres(settings.database)
    if args.resume is not None:
        return await resume_on_workers(args, settings, args.resume)
    if args.workdir is not None:
        raise ConfigError("on the workers a run needs a project (--checkout-repo), not --workdir")
    if args.checkout_repo is None:
        raise ConfigError("on the workers a run needs a project: give --checkout-repo PROJECT")
    if args.prompts is not None:
        raise ConfigError("--prompts is not supported on the workers yet")
    tool = args.tool or settings.default_agent
    if tool not in AGENT_NAMES:
        raise ConfigError(f"unknown agent {tool!r}: choose one of {', '.join(AGENT_NAMES)}")
    text, passthrough = objective
    if not text.strip():
        raise ConfigError("the objective (-p PROMPT) is empty")
    spec = new_spec(
        objective=text,
        tool=tool,
        project=project_reference(settings, args.checkout_repo),
        agent_cmd=args.agent_cmd or (settings.agent_command if tool == "command" else None),
        passthrough=tuple(passthrough),
        max_turns=args.max_turns,
        verify_cmd=args.verify_cmd,
        budget=Budget.given(args.budget, args.budget_tokens),
    )
    await start_on_workers(settings, spec)
    if args.detach:
        print(spec.run_id, flush=True)
        return 0
    print(f"Auto run {spec.run_id} · {tool} · on the workers", flush=True)
    print("Ctrl-C stops the run.", flush=True)
    with stop_on_signals() as stop:
        return await follow_run(settings, spec.run_id, sys.stdout, stop_requested=stop)


async def resume_on_workers(args: argparse.Namespace, settings: Settings, run_id: str) -> int:
    """``turnstile auto --resume RUN --budget MORE`` for a run on the workers its budget
    stopped: the larger budget is written into its placement and its next turn queued on
    the worker holding its worktree and session (another one from its pushed branch if
    that one is gone); then it is followed unless ``--detach``.

    Raises:
        ConfigError: no budget given, other settings given, or a run that cannot go on
            so (see :func:`~engine.workers.control.raise_budget_on_workers`).
    """
    require_postgres(settings.database)
    refuse_resume_settings(args)
    budget = Budget.given(args.budget, args.budget_tokens)
    if budget is None:
        raise ConfigError(
            f"a run on the workers goes on by itself; `--resume {run_id}` lets one its "
            "budget stopped go on under a larger one: give --budget USD or --budget-tokens N"
        )
    async with open_database(settings) as db:
        after = await EventLog(db).last_id()  # (what it did so far was printed)
        resumed = await raise_budget_on_workers(settings, db, run_id, budget)
    state = resumed.state
    where = f"worker {resumed.worker}" if resumed.worker else "another worker"
    print(
        f"Auto run {run_id} goes on under a budget of {budget.text()}, at round {state.turn}, "
        f"phase {state.phase.value}, on {where}",
        flush=True,
    )
    if args.detach:
        print(run_id, flush=True)
        return 0
    print("Ctrl-C stops the run.", flush=True)
    with stop_on_signals() as stop:
        return await follow_run(settings, run_id, sys.stdout, stop_requested=stop, after=after)
