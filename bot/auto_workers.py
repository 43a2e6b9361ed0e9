"""Auto runs on the workers, from a chat: queueing, following from the store, /status, /stop.

The chat sees such a run as it sees a run of the bot's own process (bot.auto): one live
status message under the ``/auto`` (its last line names the worker running the turn), the
final report and the turns as one document. ``/stop RUN`` answers at once ("Stopping run …
on worker w1") and that reply is edited when the run has actually stopped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Final

from telegram import Update

from bot.context import BotContext
from bot.publish import format_elapsed
from bot.sink import ChatPlace, words
from engine.aio import raise_if_cancelled
from engine.automode.channel import final_report, turn_text
from engine.automode.state import AutoModeState, Phase
from engine.errors import ConfigError, TurnstileError
from engine.sink import StatusUpdate, TextKind
from engine.store.runs import RunStatus, TurnState
from engine.workers.follow import RunEnded, RunFollower, TurnEnded, TurnStarted
from engine.workers.store import Placement, WorkerStore

__all__ = ["WORKER_STOP", "WorkerRuns"]

_LOGGER = logging.getLogger(__name__)

# The Stop button's data on the turn messages an earlier version of the bot posted.
WORKER_STOP: Final = "sw:"
# How often a follower reads the store; how long it waits when the database is away.
_FOLLOW_POLL: Final = 1.0
_RETRY: Final = 2.0


@dataclass
class _Followed:
    """A run on the workers this bot follows for its chat."""

    run_id: str
    place: ChatPlace
    task: asyncio.Task[None] | None = None
    end: RunEnded | None = None


def _stopping_ref(run_id: str) -> str:
    """The live message answering ``/stop RUN``, edited when the run has stopped."""
    return f"stopping:{run_id}"


class WorkerRuns:
    """The chat's auto runs on the workers (TURNSTILE_EXECUTION=workers)."""

    def __init__(self, ctx: BotContext) -> None:
        self.ctx = ctx
        self.sink = ctx.sink
        self.followed: dict[str, _Followed] = {}

    async def start(self, update: Update, objective: str, project: str, place: ChatPlace) -> None:
        """``/auto`` with TURNSTILE_EXECUTION=workers: queue the run as ``turnstile auto
        --checkout-repo PROJECT`` does; /status and /stop reach it from this chat."""
        from engine.workers.control import new_spec, project_reference, start_on_workers

        settings = self.ctx.settings
        tool = settings.default_agent
        try:
            spec = new_spec(
                objective=objective,
                tool=tool,
                project=project_reference(settings, project),
                agent_cmd=settings.agent_command if tool == "command" else None,
                passthrough=(),
                max_turns=None,
                verify_cmd=None,
            )
            spec = replace(spec, chat_id=place.chat_id, thread_id=place.thread_id)
            await start_on_workers(settings, spec)
        except ConfigError as exc:
            await self.ctx.replies.reply(update, f"Cannot start: {exc}")
            return
        user = update.effective_user
        await self.ctx.store.audit(
            action="auto",
            outcome="allowed",
            user_id=user.id if user else None,
            chat_id=place.chat_id,
            update_id=update.update_id,
            reason=spec.run_id,
        )
        message = update.effective_message
        # The run's one live message, under the /auto, as for a run in this process.
        await self.ctx.publisher.live(
            f"status:{spec.run_id}",
            f"🤖 Auto run {spec.run_id} is queued on the workers ({tool}, project {project})."
            f"\n/status shows it; /stop {spec.run_id} stops it.",
            chat_id=place.chat_id,
            thread_id=place.thread_id,
            run_id=spec.run_id,
            reply_to=message.message_id if message is not None else None,
        )
        self._follow(spec.run_id, place)

    async def in_chat(self, chat_id: int, thread: int | None = None) -> list[Placement]:
        """The unfinished runs on the workers started from this chat (and topic)."""
        if self.ctx.settings.execution != "workers":
            return []
        found = []
        for placement in await WorkerStore(self.ctx.db).placements():
            spec = placement.spec
            if placement.ended or spec.chat_id != chat_id:
                continue
            if thread is not None and (spec.thread_id or 0) != thread:
                continue
            found.append(placement)
        return found

    # -- stopping ------------------------------------------------------------------------

    async def stop(self, run_id: str, *, chat_id: int) -> bool:
        """Stop the chat's run ``run_id`` on its worker; False when it has none such."""
        for placement in await self.in_chat(chat_id):
            if placement.run_id == run_id:
                return await self._stop(placement)
        return False

    async def stop_chat(self, chat_id: int, thread: int) -> list[str]:
        return [p.run_id for p in await self.in_chat(chat_id, thread) if await self._stop(p)]

    async def _stop(self, placement: Placement) -> bool:
        from engine.workers.control import stop_run_in

        run_id = placement.run_id
        try:
            done = await stop_run_in(self.ctx.settings, self.ctx.db, run_id)
        except ConfigError as exc:  # it ended meanwhile
            _LOGGER.info("nothing to stop: %s", exc, extra={"run_id": run_id})
            return False
        _LOGGER.info("%s", done, extra={"run_id": run_id})
        spec = placement.spec
        assert spec.chat_id is not None
        if spec.mode != "auto":
            return True  # an autopilot drive: its own messages say it stopped (bot.autopilot)
        followed = self.followed.get(run_id)
        place = followed.place if followed is not None else ChatPlace(spec.chat_id, spec.thread_id)
        where = f" on worker {placement.worker}" if placement.worker else ""
        # Said at once; edited when the follower sees the run end (the same message).
        await self.ctx.publisher.live(
            _stopping_ref(run_id),
            f"⏹ Stopping run {run_id}{where}…",
            chat_id=place.chat_id,
            thread_id=place.thread_id,
            run_id=run_id,
        )
        if followed is not None and followed.end is not None:
            await self._confirm_stop(followed, followed.end)
        return True

    async def _confirm_stop(self, followed: _Followed, event: RunEnded) -> None:
        ref = _stopping_ref(followed.run_id)
        known = await self.ctx.store.get_live(ref)
        if known is None or not known.body.startswith("⏹ Stopping"):
            return  # no stop was asked from the chat, or it was confirmed already
        record, placement = event.record, event.placement
        worker = placement.last_worker or placement.worker
        where = f" on worker {worker}" if worker else ""
        if record is None or record.status is RunStatus.STOPPED:
            text = f"⏹ Run {followed.run_id} stopped{where}."
        else:
            text = (
                f"Run {followed.run_id} ended{where} before the stop reached it: "
                f"{words(record.status.value)}."
            )
        await self.ctx.publisher.live(
            ref,
            text,
            chat_id=known.chat_id,
            thread_id=known.thread_id,
            run_id=followed.run_id,
        )

    async def on_stop_button(self, update: Update, data: str) -> None:
        chat = update.effective_chat
        user = update.effective_user
        assert chat is not None
        assert user is not None
        run_id = data.removeprefix(WORKER_STOP)
        placements = [p for p in await self.in_chat(chat.id) if p.run_id == run_id]
        if not placements:
            await self.ctx.replies.answer(update, "Nothing is running there any more.")
            return
        await self.ctx.replies.answer(update, "Stopping…")
        await self.ctx.store.audit(
            action="stop",
            outcome="allowed",
            user_id=user.id,
            chat_id=chat.id,
            update_id=update.update_id,
            reason=run_id,
        )
        await self._stop(placements[0])

    # -- /status -------------------------------------------------------------------------

    async def status_lines(self, chat_id: int) -> list[str]:
        placements = await self.in_chat(chat_id)
        if not placements:
            return []
        from engine.workers.control import worker_status
        from engine.workers.views import is_warm

        store = WorkerStore(self.ctx.db)
        # Recorded by the worker: its agent process stays between the run's turns there.
        warm = await store.warm_runs()
        lines = []
        for p in placements:
            waiting = await worker_status(store, p, silent_after=self.ctx.settings.worker_timeout)
            where = waiting or f"running on worker {p.worker}"
            elapsed = int(time.time() - p.created_at)
            lines.append(
                f"🤖 auto {p.run_id} · {where} · {format_elapsed(elapsed)}"
                + (" · warm" if is_warm(p, waiting, warm) else "")
            )
        return lines

    # -- following from the store ----------------------------------------------------------

    def _follow(self, run_id: str, place: ChatPlace) -> None:
        if run_id in self.followed:
            return
        self.sink.register(run_id, place, steered=False)  # (no steering reaches a worker)
        followed = _Followed(run_id, place)
        self.followed[run_id] = followed
        followed.task = asyncio.create_task(self._follow_run(followed), name=f"follow-{run_id}")

    async def _follow_run(self, followed: _Followed) -> None:
        """The run's turns and end as the chat shows a run of this process: its live status
        message (naming the worker), its final report and turns document, through the sink."""
        run_id = followed.run_id
        follower = RunFollower(
            self.ctx.db,
            run_id,
            silent_after=self.ctx.settings.worker_timeout,
            poll=_FOLLOW_POLL,
        )
        try:
            while True:
                try:
                    # The follower keeps the turns it has given: a retry gives no turn twice.
                    async for event in follower.events():
                        match event:
                            case TurnStarted():
                                await self._turn_started(followed, event)
                            case TurnEnded():
                                await self._turn_ended(followed, event)
                            case RunEnded():
                                await self._run_ended(followed, event)
                    return
                except TurnstileError as exc:
                    # The database may be away a moment; the run goes on on its worker.
                    raise_if_cancelled()
                    _LOGGER.warning("following paused: %s", exc, extra={"run_id": run_id})
                    await asyncio.sleep(_RETRY)
        except asyncio.CancelledError:
            raise
        except Exception:
            _LOGGER.exception("could not follow the run", extra={"run_id": run_id})
        finally:
            self.followed.pop(run_id, None)

    async def _status(
        self, followed: _Followed, state: AutoModeState, phase: str | None, turn: int, event: str
    ) -> None:
        await self.sink.update_status(
            StatusUpdate(
                run_id=followed.run_id,
                mode="auto",
                status=RunStatus.RUNNING.value,
                phase=phase,
                turn=turn,
                max_turns=state.max_turns,
                started_at=state.started_at,
                last_event=event,
            )
        )

    async def _turn_started(self, followed: _Followed, event: TurnStarted) -> None:
        label = Phase(event.phase).label if event.phase else "Turn"
        where = f" on worker {event.worker}" if event.worker else ""
        assert event.state is not None  # (an auto run's)
        await self._status(followed, event.state, event.phase, event.seq, f"{label} running{where}")

    async def _turn_ended(self, followed: _Followed, event: TurnEnded) -> None:
        turn, state = event.turn, event.state
        assert state is not None  # (an auto run's)
        phase = Phase(turn.phase) if turn.phase else state.phase
        if turn.state is TurnState.FINISHED and turn.exit_code is not None:
            # Folded by the sink into the live message and the final turns document.
            await self.sink.publish_kind(
                followed.run_id,
                turn_text(
                    turn=turn.seq,
                    max_turns=state.max_turns,
                    phase=phase,
                    code=turn.exit_code,
                    text=turn.output or "",
                    size=turn.output_size,
                    stderr_tail=turn.stderr_tail,
                    log_dir=state.log_dir,
                ),
                TextKind.TURN,
            )
            return
        where = f" on worker {event.worker}" if event.worker else ""
        why = f": {turn.error}" if turn.error else ""
        if turn.state is TurnState.INTERRUPTED:
            said = f"⏹ {phase.label} cut off{where}{why}"
        else:
            said = f"⚠️ {phase.label} failed{where}{why}"
        # In the live message's last line until the next turn starts or the run ends.
        await self._status(followed, state, phase.value, turn.seq, said)

    async def _run_ended(self, followed: _Followed, event: RunEnded) -> None:
        followed.end = event
        place, run_id = followed.place, followed.run_id
        state = event.state
        status = f"status:{run_id}"
        known = await self.ctx.store.get_live(status)
        if known is not None and ended_text(known.body):
            await self._confirm_stop(followed, event)  # (its reply, if a restart cut it)
            return  # said before a restart
        if state is None or event.record is None:
            note = event.placement.note or "stopped"
            await self.ctx.publisher.live(
                status,
                f"🤖 Auto run {run_id} did not start: {note}",
                chat_id=place.chat_id,
                thread_id=place.thread_id,
                run_id=run_id,
            )
            await self._confirm_stop(followed, event)
            return
        await self.sink.update_status(
            StatusUpdate(
                run_id=run_id,
                mode="auto",
                status=event.record.status.value,
                phase=state.phase.value,
                turn=state.turn,
                max_turns=state.max_turns,
                started_at=state.started_at,
                last_event=state.message or event.record.status.value,
            )
        )
        await self._confirm_stop(followed, event)
        # The worker's report (with the evidence and work summary it measured), else what
        # the store says of the run.
        report = event.placement.report or final_report(state)
        await self.sink.publish_kind(run_id, report, TextKind.FINAL)

    # -- start-up and shutdown -------------------------------------------------------------

    async def resume(self) -> None:
        """After a restart: follow the chats' runs still going on the workers again."""
        for placement in await self._placements_followed():
            spec = placement.spec
            assert spec.chat_id is not None
            self._follow(placement.run_id, ChatPlace(spec.chat_id, spec.thread_id))

    async def _placements_followed(self) -> list[Placement]:
        if self.ctx.settings.execution != "workers":
            return []
        found = []
        for placement in await WorkerStore(self.ctx.db).placements():
            if placement.spec.chat_id is None or placement.spec.mode != "auto":
                continue  # (a drive's is bot.autopilot_workers)
            if placement.ended:
                # Ended while no bot followed it: followed once more if its chat was not
                # told yet (its live message still shows it running).
                live = await self.ctx.store.get_live(f"status:{placement.run_id}")
                if live is None or ended_text(live.body):
                    continue
            found.append(placement)
        return found

    async def close(self) -> None:
        """Stop following (followers only read: the runs go on on their workers, and are
        followed again at the next start)."""
        following = [f.task for f in self.followed.values() if f.task is not None]
        for task in following:
            task.cancel()
        if following:
            await asyncio.wait(following)


def ended_text(body: str) -> bool:
    """Whether a run's live status message says it ended (its second line, the state)."""
    lines = body.splitlines()
    if len(lines) < 2:
        return False
    ended = [words(s) for s in ("completed", "stopped", "error", "crashed")]
    return any(lines[1].startswith(w) for w in ended)
