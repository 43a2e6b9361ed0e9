"""Auto runs driven in this process: each in a task, its turns under the run supervisor.

A run a shutdown stopped is recorded parked, and the next start's recovery resumes it
(:meth:`LocalAuto.recover`); a run the database cut off mid-turn is resumed here once the
database is back, its cut-off turn run again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from engine.automode import (
    STOPPED_BY_PERSON,
    AutoRun,
    AutoStatus,
    resume_auto_run,
    start_auto_run,
)
from engine.automode.budget import STOPPED_BY_BUDGET
from engine.errors import ConfigError, StoreUnreachableError, TurnstileError
from engine.executors.base import (
    Approvals,
    AutoRequest,
    Notices,
    Started,
    Workdirs,
    same_place,
    wait_all,
)
from engine.humane import format_elapsed, turn_count
from engine.runs import Recovery, RunMode, RunSpec, RunSupervisor
from engine.runs.spec import ChatPlace, PlaceId
from engine.settings import Settings
from engine.sink import RunSink
from engine.spend import Budget, Spend
from engine.store.backend import AnyDatabase, wait_reachable
from engine.store.runs import RunStatus, SqliteRunStore
from engine.workspace.runs import worktree_summaries

__all__ = ["LocalAuto"]

_LOGGER = logging.getLogger(__name__)


@dataclass
class _Active:
    run: AutoRun
    place: ChatPlace
    watcher: asyncio.Task[None] | None = None
    parking: bool = False


class LocalAuto:
    """Starts, stops, parks and resumes auto runs in this process."""

    def __init__(
        self,
        settings: Settings,
        db: AnyDatabase,
        *,
        runs: SqliteRunStore,
        supervisor: RunSupervisor,
        sink: RunSink,
        notices: Notices,
        workdirs: Workdirs,
        approvals: Approvals,
    ) -> None:
        self.settings = settings
        self.db = db
        self.runs = runs
        self.supervisor = supervisor
        self.sink = sink
        self.notices = notices
        self.workdirs = workdirs
        self.approvals = approvals
        self.active: dict[str, _Active] = {}
        self._closing = False
        # Runs the database cut off, each resumed once it is back (_revive).
        self._revivals: set[asyncio.Task[None]] = set()

    # -- starting ----------------------------------------------------------------------

    async def start(self, request: AutoRequest) -> Started:
        # The run's id keys its worktree: its branch is turnstile/<run id>.
        run_id = self.supervisor.reserve(RunMode.AUTO)
        agent = self.settings.default_agent
        workdir = await self.workdirs(request.project, run_id, request.asked_in or request.place)
        spec = RunSpec(
            objective=request.objective,
            agent=agent,
            workdir=workdir,
            run_id=run_id,
            project=request.project,
            chat=request.place,
            budget=request.budget,
            permissions=request.permissions,
        )
        run = await start_auto_run(
            self.settings,
            self.db,
            spec,
            sink=self.sink,
            supervisor=self.supervisor,
            approval_for=self.approvals(agent, request.user_id),
        )
        self._track(run, request.place)
        return Started(run.run_id, agent)

    # -- what runs here ----------------------------------------------------------------

    def running_in(self, place: ChatPlace) -> list[AutoRun]:
        return [a.run for a in self.active.values() if same_place(a.place, place)]

    def running_in_chat(self, chat_id: PlaceId) -> list[AutoRun]:
        return [a.run for a in self.active.values() if a.place.chat_id == chat_id]

    async def steerable(self, place: ChatPlace, *, whole_chat: bool = False) -> list[str]:
        runs = self.running_in_chat(place.chat_id) if whole_chat else self.running_in(place)
        return [run.run_id for run in runs]

    # -- stopping ----------------------------------------------------------------------

    async def stop(self, run_id: str, *, chat_id: PlaceId) -> bool:
        active = self.active.get(run_id)
        if active is None or active.place.chat_id != chat_id:
            return False
        await self._stop(active)
        return True

    async def stop_in(self, place: ChatPlace) -> list[str]:
        stopped = []
        for active in [a for a in self.active.values() if same_place(a.place, place)]:
            await self._stop(active)
            stopped.append(active.run.run_id)
        return stopped

    async def _stop(self, active: _Active) -> None:
        # Through the supervisor, like every run's stop (the running turn is pre-empted).
        if not self.supervisor.stop(active.run.run_id):
            await active.run.stop()  # (not attached yet: the run's latch waits for it)

    async def status_lines(self, chat_id: PlaceId) -> list[str]:
        runs = self.running_in_chat(chat_id)
        here = [run.state for run in runs]
        # A warm session: its agent process stays between the run's turns.
        warm = {
            run.run_id
            for run in runs
            if getattr(getattr(run.runner, "agent", None), "resident", False)
        }
        # The worktree of a run on a configured project: its branch and disk usage.
        worktrees = await worktree_summaries(
            self.settings, self.db, {s.run_id: s.workdir for s in here}
        )
        lines = []
        for s in here:
            elapsed = int(time.time() - s.started_at)
            lines.append(
                f"🤖 auto {s.run_id} · {s.status.value} · {s.phase.label} · "
                f"{turn_count(s.step - 1, round_=s.turn, limit=s.max_turns, of=' of ')} · "
                f"{format_elapsed(elapsed)}" + (" · warm" if s.run_id in warm else "")
            )
            if s.run_id in worktrees:
                lines.append(f"   🌿 {worktrees[s.run_id]}")
        return lines

    # -- running -----------------------------------------------------------------------

    def _track(self, run: AutoRun, place: ChatPlace) -> None:
        self.notices.follow(run.run_id, place)
        active = _Active(run, place)
        self.active[run.run_id] = active
        active.watcher = asyncio.create_task(self._watch(active), name=f"auto-watch-{run.run_id}")

    async def _watch(self, active: _Active) -> None:
        run = active.run
        finished = False
        try:
            result = await run.task
            # Only a run our shutdown stopped is parked; one that ended on its own is not.
            finished = not (
                result.status is AutoStatus.STOPPED and result.message == STOPPED_BY_PERSON
            )
            _LOGGER.info("auto run ended %s", result.status.value, extra={"run_id": run.run_id})
            budget = Budget.from_config(run.state.config)
            if run.state.config.get("stopped_by") == STOPPED_BY_BUDGET and budget is not None:
                spent = budget.spent_text(run.channel.spend or Spend())
                await self.notices.offer_more_budget(run.run_id, budget, spent)
        except StoreUnreachableError as exc:
            if not exc.retryable or self._closing:
                # Recorded running: the next start's recovery resumes it.
                _LOGGER.warning("auto run cut off: %s", exc, extra={"run_id": run.run_id})
                return
            # The database went away under the run (an outage, a restart): what its turn did
            # was not all recorded. Once the database is back the run resumes from what the
            # store holds, its cut-off turn run again; nothing to say meanwhile.
            _LOGGER.warning(
                "auto run cut off by the database (%s); resumed once it is back",
                exc,
                extra={"run_id": run.run_id},
            )
            revival = asyncio.create_task(self._revive(active), name=f"revive-{run.run_id}")
            self._revivals.add(revival)
            revival.add_done_callback(self._revivals.discard)
        except TurnstileError as exc:
            await self.notices.notice(run.run_id, f"⚠️ Auto run {run.run_id} failed: {exc}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            _LOGGER.exception("auto run crashed", extra={"run_id": run.run_id})
            await self.notices.notice(
                run.run_id, f"⚠️ Auto run {run.run_id} crashed: {type(exc).__name__}"
            )
        finally:
            self.active.pop(run.run_id, None)
            if active.parking and not finished:
                with contextlib.suppress(TurnstileError):
                    await self.runs.update_run(run.run_id, status=RunStatus.PARKED)

    async def _revive(self, active: _Active) -> None:
        await wait_reachable(self.db)
        if self._closing:
            return  # resumed by the next start's recovery (it is still recorded running)
        await self._resume(
            active.run.run_id,
            active.place,
            active.run.state.tool,
            why=": the database was away for a while",
            failed="was cut off when the database went away and could not be resumed",
        )

    async def _resume(
        self, run_id: str, place: ChatPlace, tool: str | None, *, why: str = "", failed: str
    ) -> None:
        """Resume ``run_id`` from its recorded phase and turn here, and say so (or why not)."""
        try:
            run = await self._resumed(run_id, place, tool)
        except TurnstileError as exc:
            _LOGGER.warning("auto run not resumed: %s", exc, extra={"run_id": run_id})
            await self.notices.notice(run_id, f"⚠️ Auto run {run_id} {failed}: {exc}")
            return
        await self.notices.notice(
            run_id,
            f"▶️ Auto run {run_id} resumed at round {run.state.turn}, phase "
            f"{run.state.phase.value}{why}.",
        )

    async def _resumed(
        self, run_id: str, place: ChatPlace, tool: str | None, *, budget: Budget | None = None
    ) -> AutoRun:
        """The run resumed here (``budget``: under that one), followed in ``place``."""
        run = await resume_auto_run(
            self.settings,
            self.db,
            run_id,
            sink=self.sink,
            supervisor=self.supervisor,
            approval_for=self.approvals(tool or self.settings.default_agent, None),
            budget=budget,
        )
        self._track(run, place)
        return run

    async def raise_budget(self, run_id: str, budget: Budget, *, chat_id: PlaceId) -> str:
        record = await self.runs.get_run(run_id)
        if record.chat_id != chat_id:
            raise ConfigError(f"run {run_id} is not this chat's")
        if record.state.get("config", {}).get("stopped_by") != STOPPED_BY_BUDGET:
            raise ConfigError(f"run {run_id} was not stopped by its budget")
        place = ChatPlace(chat_id, record.thread_id)
        self.notices.follow(run_id, place)
        run = await self._resumed(run_id, place, record.agent, budget=budget)
        return (
            f"▶️ Auto run {run_id} goes on under a budget of {budget.text()}, at round "
            f"{run.state.turn}, phase {run.state.phase.value}."
        )

    # -- start-up and shutdown ---------------------------------------------------------

    async def recover(self, report: Recovery) -> None:
        """Resume the auto runs the supervisor's recovery found parked or cut off."""
        for record in report.auto:
            assert record.chat_id is not None  # (the report holds the runs a chat follows)
            place = ChatPlace(record.chat_id, record.thread_id)
            self.notices.follow(record.id, place)
            await self._resume(record.id, place, record.agent, failed="could not be resumed")

    async def shutdown(self, *, park: bool) -> None:
        self._closing = True
        for revival in list(self._revivals):
            revival.cancel()
        actives = list(self.active.values())
        for active in actives:
            active.parking = True
            if park:
                await active.run.stop()
            else:
                # The running turn finishes; the run closes at its next poll.
                active.run.channel.request_stop()
        await wait_all([a.watcher for a in actives if a.watcher is not None])

    async def park_all(self) -> None:
        for active in list(self.active.values()):
            active.parking = True
            await active.run.stop()
