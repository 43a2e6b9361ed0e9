"""``turnstile auto`` with ``TURNSTILE_EXECUTION=workers``: queue the run, then follow it.

The run is checked out on whichever worker takes its first turn, so it needs a project
(``--checkout-repo``), not a folder of this machine.
"""

from __future__ import annotations

import argparse
import sys

from engine.agents.factory import AGENT_NAMES
from engine.errors import ConfigError
from engine.settings import Settings
from engine.spend import Budget
from engine.workers.control import (
    follow_run,
    new_spec,
    project_reference,
    start_on_workers,
    stop_on_signals,
)
from engine.workers.queue import require_postgres

__all__ = ["run_on_workers"]


async def run_on_workers(
    args: argparse.Namespace, settings: Settings, objective: tuple[str, list[str]]
) -> int:
    require_postgres(settings.database)
    if args.resume is not None:
        raise ConfigError("--resume is for runs in this process; a run on the workers goes on")
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
