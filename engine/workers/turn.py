"""An auto run's turn on a worker: the auto mode's step driver.

The first turn prepares the run in a fresh checkout of the project; the host keeps the
prepared run (and its agent's warm process) between turns while this worker holds it. A run
taken over from a lost worker is reset to its pushed branch, its state pointed at this
worker's worktree and folders, and its new agent session told where it stands. Each turn
is the run's own step (:meth:`AutoRun.step`, the one a run in-process loops over); then the
run branch is pushed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

from engine.agents.factory import create_agent
from engine.agents.warm import close_agent
from engine.automode import AutoRun, prepare_auto_run, prepare_resume
from engine.automode.budget import STOPPED_BY_BUDGET
from engine.automode.runner import AutoModeRunner
from engine.automode.state import AutoModeState
from engine.errors import TurnstileError
from engine.runs import AgentEnv, RunSupervisor
from engine.store.runs import RunRecord, SqliteRunStore
from engine.workers.host import (
    Checkout,
    Next,
    PrimedSession,
    RunHost,
    record_stopped,
    stop_watch,
)
from engine.workers.store import Placement, WorkerStore
from engine.workspace.manager import run_branch

__all__ = ["AutoTurns", "moved_primer"]

_LOGGER = logging.getLogger(__name__)


def moved_primer(state: AutoModeState, worker: str) -> str:
    """What the agent is told first in the new session of a run that changed machines."""
    lines = [
        "Note before this turn: this run moved to another machine (worker "
        f"{worker}) because the one it ran on stopped answering. Your earlier conversation "
        "was kept on that machine and is gone, so this is a new session. The working tree "
        f"is the run branch {run_branch(state.run_id)} as it was pushed after the last "
        "finished turn; anything not committed by then is not in it.",
        f"The objective: {state.objective}",
        f"Where the run stands: turn {state.turn} of {state.max_turns}, "
        f"{state.phase.label} comes next.",
    ]
    if state.plan:
        lines.append(f"The plan so far:\n{state.plan[:4000]}")
    if state.evaluation:
        lines.append(f"The last evaluation:\n{state.evaluation[:2000]}")
    lines.append("Continue the run from there.")
    return "\n\n".join(lines) + "\n\n---\n\n"


@dataclass(slots=True)
class _Held:
    """A run prepared on this worker, kept between its turns while the worker holds it."""

    run: AutoRun
    checkout: Checkout
    moves: int

    @property
    def resident(self) -> bool:
        return _resident(self.run.runner)

    async def close(self) -> None:
        with contextlib.suppress(TurnstileError, OSError):
            await close_agent(self.run.runner)
        with contextlib.suppress(TurnstileError, OSError):
            await self.run.close()


class AutoTurns:
    """One turn of an auto run a step."""

    after_outage: Final = Next.CONTINUE

    async def step(
        self, host: RunHost, placement: Placement, *, moved: bool, stop: asyncio.Event
    ) -> Next:
        run_id = placement.run_id
        held = host.held.get(run_id)
        assert held is None or isinstance(held, _Held)
        try:
            if held is None:
                checkout = await host.checkout(run_id, placement.spec.project)
                record = await SqliteRunStore(host.db).get_run(run_id)
                if record.workdir is not None and moved:
                    await _adopt(host, checkout, record)
            else:
                checkout = held.checkout
            async with checkout.locked():
                if held is None:
                    run = await _prepare(host, placement, record, checkout, moved=moved, stop=stop)
                    held = _Held(run, checkout, placement.moves)
                    host.held[run_id] = held
                async with stop_watch(host.db, run_id, stop, on_stop=held.run.stop):
                    goes_on = await held.run.step() and not stop.is_set()
                await checkout.push()
            await host.mark_warm()
        except BaseException:
            # Whatever broke (or the worker going down): the next turn starts from the store.
            await asyncio.shield(host.forget(run_id, keep_stop=True))
            raise
        if goes_on:
            return Next.CONTINUE
        if held.run.channel.report:  # what the chat and the terminal show of its end
            await WorkerStore(host.db).set_report(run_id, held.run.channel.report)
        if stop.is_set():
            # (A stop that came as its last turn ended finds the run still running.)
            await record_stopped(SqliteRunStore(host.db), run_id)
        await host.end(run_id)
        return Next.DONE


async def _prepare(
    host: RunHost,
    placement: Placement,
    record: RunRecord,
    checkout: Checkout,
    *,
    moved: bool,
    stop: asyncio.Event,
) -> AutoRun:
    spec = placement.spec
    env = AgentEnv(extra_env=host.env)
    # Its warm session (if any) is counted in this worker's pool.
    supervisor = RunSupervisor(SqliteRunStore(host.db), warm_pool=host.warm_pool)
    if record.workdir is None:  # its first step: the row is as placing wrote it
        settings = host.settings
        if spec.daily_budget is not None:
            # The chat's cap is the control plane's, kept with the run from here on.
            settings = settings.model_copy(update={"daily_budget": spec.daily_budget})
        return await prepare_auto_run(
            settings,
            host.db,
            spec.spec_in(checkout.path, env),
            stop_event=stop,
            supervisor=supervisor,
            placed=True,
        )
    run = await prepare_resume(
        host.settings,
        host.db,
        spec.run_id,
        env=env,
        stop_event=stop,
        supervisor=supervisor,
        # Stopped by its budget and put back under a larger one (an admin raised it).
        budget=spec.budget if _stopped_by_budget(record) else None,
    )
    if moved:
        run.runner = PrimedSession(_fresh_runner(host, run), moved_primer(run.state, host.name))
    return run


def _fresh_runner(host: RunHost, run: AutoRun) -> AutoModeRunner:
    """A new agent session in the same worktree (the old one was on the lost disk)."""
    state = run.state
    agent = create_agent(
        state.tool,
        host.settings,
        cwd=Path(state.workdir),
        session_id=state.session_id,
        agent_cmd=state.config.get("agent_cmd"),
        passthrough=tuple(state.config.get("passthrough", ())),
        extra_env=host.env,
        warm_pool=host.warm_pool,
    )
    agent.preempt.on_spawn = run.channel.record_process
    return AutoModeRunner(agent)


async def _adopt(host: RunHost, checkout: Checkout, record: RunRecord) -> None:
    """Take over a moved run: its worktree at the pushed branch, its folders here."""
    run_id = record.id
    if not await checkout.adopt():
        _LOGGER.warning(
            "run %s had pushed no branch yet; it continues from the project's start", run_id
        )
    old = AutoModeState.from_json(record.state)
    # A worker restarted under the same name may still have the folder: keep it.
    log_dir = host.settings.runs_dir.resolve() / run_id
    log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    (log_dir / ".gitignore").write_text("*\n", encoding="utf-8")
    new = replace(
        old,
        workdir=str(checkout.path),
        log_dir=str(log_dir),
        session_id=str(uuid.uuid4()),
        owner=None,
    )
    await SqliteRunStore(host.db).update_run(
        run_id,
        workdir=new.workdir,
        log_dir=new.log_dir,
        session_id=new.session_id,
        state=new.to_json(),
    )
    _LOGGER.info("run %s taken over by worker %s", run_id, host.name)


def _stopped_by_budget(record: RunRecord) -> bool:
    config = AutoModeState.from_json(record.state).config
    return bool(config.get("stopped_by") == STOPPED_BY_BUDGET)


def _resident(session: object) -> bool:
    """Whether ``session`` (seen through its wrappers) has a resident agent process."""
    for _ in range(4):
        if getattr(session, "warm", False):
            return bool(getattr(session, "resident", False))
        session = getattr(session, "agent", None)
        if session is None:
            return False
    return False
