"""Autopilot and approval gates from a chat.

``/autopilot TASK [summary]`` starts or resumes the gated workflow (engine.gates). Each
approval gate becomes a document (the artifact) and a gate message: phase, artifact,
short hash, excerpt, and Approve / Reject buttons. People approve with the button,
``/approve [TASK]``, a reply "APPROVED" to the gate message or a plain "APPROVED" (when
privacy mode lets the bot see it); they reject with the button (the bot asks for a
reason) or ``/reject TASK REASON``. Every approval names the hash the person saw.

A Reject button press waits for the reason for ``TURNSTILE_REASON_REQUEST_SECONDS``, and
can be cancelled (``/cancel`` or the button on the question). A "reason" that is just an
approval word ("APPROVED") is a person who pressed Reject by mistake more often than a
reason: the bot asks before rejecting with it.

Long: the gate conversation is one flow (post the gate, approve, reject, ask for the
reason, confirm or cancel it) over the same gate messages; splitting it would pass its
private state between modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from telegram import Update
from telegram.error import TelegramError

from bot.context import BotContext
from bot.controls import InlineControls
from bot.feature import Feature
from bot.handlers import Dispatch
from bot.places import chat_of, telegram_chat
from bot.render import message_link
from bot.replies import MISPLACED, NOT_DELIVERED, misplaced_press, thread_of
from chatfront.auth import Action
from chatfront.notices import ChatNotices
from chatfront.progress import AUTOPILOT_STOP_DATA
from chatfront.sink import ChatPlace
from chatfront.store import Binding, GateRecord, OutboxItem, ReasonRequest
from chatfront.text import excerpt as render_excerpt
from engine.agents.factory import create_agent
from engine.errors import NotFoundError, UnsafeFileError
from engine.executors import drive_executor
from engine.executors.drives import DriveRefused, DriveRequest
from engine.gates import (
    ApprovalOutcome,
    ApprovalResult,
    GateRefused,
    Refusal,
)
from engine.gates.hashing import sha256_file_async
from engine.gates.policy import approver_refusal
from engine.gates.records import TaskRecord
from engine.humane import format_elapsed, words
from engine.runs import Recovery, RunMode
from engine.runs.spec import PlaceId
from engine.sink import GateRequest
from engine.store.events import EventKind, EventLog
from engine.workspace.manager import DEFAULT_PROJECT
from engine.workspace.runs import match_worktrees, worktree_summaries

__all__ = ["AutopilotExtension"]

_LOGGER = logging.getLogger(__name__)

_APPROVED: Final = re.compile(r"^\s*approved\s*[.!]*\s*$", re.IGNORECASE)
# A rejection "reason" that reads like an approval: asked about before it rejects anything.
_APPROVAL_WORD: Final = re.compile(
    r"^\s*(?:approved?|lgtm|ok(?:ay)?|yes|👍|✅)\s*[.!]*\s*$", re.IGNORECASE
)
# callback_data holds at most 64 bytes: "ry:" + gate id + ":" leaves this much for the reason.
_CONFIRM_REASON_BYTES: Final = 48
_TASK_NAME: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_MAX_DOCUMENT: Final = 20 * 1024 * 1024
_EXCERPT: Final = 700
_NOT_YET: Final = "⏳ This gate's message is still being delivered; press again."


class AutopilotExtension(Feature):
    """Starts and resumes drives, posts gates, takes approvals and rejections."""

    def __init__(
        self, ctx: BotContext, *, agent_factory: Callable[..., Any] = create_agent
    ) -> None:
        self.ctx = ctx
        self.sink = ctx.sink
        self.gates = ctx.gates
        self._agent_factory = agent_factory
        # Where each task's messages go (a sub-task's go to its parent's chat).
        self.places: dict[str, ChatPlace] = {}
        self.closing = False
        self._elsewhere: asyncio.Task[None] | None = None
        # Drives in this process or on the workers, as the settings say.
        self.executor = drive_executor(
            ctx.settings,
            ctx.db,
            ctx.gates,
            supervisor=ctx.supervisor,
            sink=ctx.sink,
            notices=ChatNotices(
                sink=ctx.sink, publisher=ctx.publisher, store=ctx.store, controls=InlineControls()
            ),
            agent_factory=self._agent_factory,
        )
        ctx.sink.post_gates_with(self.post_gate)
        ctx.sink.resolve_places_with(self.resolve)
        ctx.sink.describe_tasks_with(self.task_facts)

    def register(self, dispatch: Dispatch) -> None:
        dispatch.command(
            "autopilot", Action.START_RUN, self.cmd_autopilot, usage="Usage: /autopilot TASK"
        )
        dispatch.command("approve", Action.APPROVE, self.cmd_approve)
        dispatch.command(
            "reject", Action.REJECT, self.cmd_reject, usage="Usage: /reject TASK REASON"
        )
        # Anyone with a role may ask; only a pending Reject of theirs is cancelled.
        dispatch.command("cancel", Action.HELP, self.cmd_cancel)
        dispatch.text(self.on_text)
        dispatch.buttons(r"^ap(:|\Z)", Action.APPROVE, self.on_button)
        # rc: cancel a pending reason; ry: reject with a reason that read like an approval.
        dispatch.buttons(r"^(rj|rc|ry)(:|\Z)", Action.REJECT, self.on_button)
        # The Stop button of a drive's running phase (or wave): as /stop TASK.
        dispatch.buttons(rf"^{AUTOPILOT_STOP_DATA}", Action.STOP, self.on_stop_button)

    # -- where a task's messages go ----------------------------------------------------

    async def resolve(self, run_id: str) -> ChatPlace | None:
        """The chat of a drive's run: its task's (a sub-task goes to its parent's chat)."""
        try:
            run = await self.ctx.runs.get_run(run_id)
        except NotFoundError:
            return None
        if run.mode != RunMode.AUTOPILOT or run.task is None:
            return None
        return await self._place_of_task(run.task)

    async def _place_of_task(self, name: str) -> ChatPlace | None:
        """Where the messages of task ``name`` go (a sub-task: its parent's chat)."""
        seen: set[str] = set()
        while name and name not in seen:
            seen.add(name)
            place = self.places.get(name)
            if place is not None:
                return place
            try:
                task = await self.gates.task(name)
            except GateRefused:
                return None
            if task.parent is None:
                return None
            name = task.parent
        return None

    async def task_facts(self, name: str) -> list[str]:
        """What a completed task did, for its summary: its artifacts (name and short
        sha256), its turns and the time from its start."""
        task = await self.gates.task(name)
        artifacts = []
        for phase in self.gates.workflow.phases:
            try:
                digest = await sha256_file_async(task.folder / phase.artifact, root=task.folder)
            except UnsafeFileError:
                digest = None  # not a plain file of the task folder: not vouched for
            if digest is not None:
                artifacts.append(f"{phase.artifact} {digest[:12]}")
        runs = [
            r
            for r in await self.ctx.runs.list_runs()
            if r.mode == RunMode.AUTOPILOT and r.task == name
        ]
        turns = 0
        for run in runs:
            turns += len(await self.ctx.runs.turns(run.id))
        elapsed = format_elapsed(max(0.0, task.updated_at - task.created_at))
        lines = [f"{turns} turn{'s' if turns != 1 else ''} in {elapsed}."]
        if artifacts:
            lines.append("Artifacts: " + ", ".join(artifacts) + ".")
        return lines

    # -- /autopilot --------------------------------------------------------------------

    async def cmd_autopilot(self, update: Update, args: list[str]) -> None:
        chat = update.effective_chat
        user = update.effective_user
        message = update.effective_message
        assert chat is not None
        assert user is not None
        assert message is not None
        if self.closing:
            await self.ctx.replies.reply(update, "The bot is shutting down; try again in a minute.")
            return
        name = args[0]
        if not _TASK_NAME.fullmatch(name):
            await self.ctx.replies.reply(
                update,
                "Usage: /autopilot TASK [summary] — a task name is letters, digits, '.', '_' "
                "or '-' (at most 64).",
            )
            return
        text = message.text or ""
        parts = text.split(maxsplit=2)
        summary = parts[2].strip() if len(parts) > 2 else None
        thread = thread_of(message)
        # A new task's drive on the workers is checked out from the chat's project.
        binding = await self.ctx.store.binding(chat_of(chat), thread)
        project = binding.project if binding is not None else DEFAULT_PROJECT
        if thread is None and chat.is_forum and not await self._exists(name):
            thread = await self._topic(chat_of(chat), f"autopilot: {name}")
        place = ChatPlace(chat_of(chat), thread)
        request = DriveRequest(name, place, project, summary=summary, user_id=user.id)
        try:
            started = await self.executor.start(request)
        except DriveRefused as exc:
            await self.ctx.replies.reply(update, str(exc))
            return
        # (Its drive's run records the place: after a restart the task's is read there.)
        self.places[name] = place
        run_id = started.run_id
        await self.ctx.replies.audited(
            update, "autopilot", name if run_id is None else f"{name} {run_id}"
        )
        if started.queued:
            verb = "is queued on the workers" if started.new else "is already on the workers"
            await self.ctx.replies.reply(
                update,
                f"🛂 Autopilot for task {name} {verb} (run {run_id}). Gates come here with "
                f"Approve / Reject buttons. /stop {run_id} stops the drive (the task keeps its "
                "phase).",
            )
            return
        verb = "started" if started.created else f"resumed at {words(started.label or '')}"
        await self.ctx.publisher.say(
            chat_of(chat),
            f"🛂 Autopilot for task {name} {verb}. Gates come here with Approve / Reject "
            f"buttons. /stop {name} stops the drive (the task keeps its phase).",
            thread_id=thread,
            run_id=run_id,
        )

    async def _exists(self, name: str) -> bool:
        try:
            await self.gates.task(name)
        except GateRefused:
            return False
        return True

    async def _topic(self, chat_id: PlaceId, name: str) -> PlaceId | None:
        try:
            topic = await self.ctx.bot.create_forum_topic(
                chat_id=telegram_chat(chat_id), name=name[:128]
            )
        except TelegramError as exc:
            _LOGGER.warning("could not create a forum topic: %s", exc)
            return None
        return str(topic.message_thread_id)

    # -- gates -------------------------------------------------------------------------

    async def post_gate(self, request: GateRequest, place: ChatPlace) -> None:
        """Post (or, for a gate already shown, refresh) the gate message and the artifact."""
        existing = await self.ctx.store.open_gate_for(request.task, request.phase, request.sha256)
        if existing is not None:
            await self.ctx.store.touch_live(f"gate:{existing.gate_id}")
            self.ctx.publisher.wake()
            return
        # Any older gate of the task is over (approved elsewhere, artifact changed...).
        for old in await self.ctx.store.open_gates_of(request.task):
            if await self.ctx.store.close_gate(old.gate_id, "superseded", None):
                await self._decide_text(old, "⏭ Superseded: a newer gate follows.")
        gate_id = secrets.token_hex(4)
        await self.ctx.store.add_gate(
            gate_id,
            task=request.task,
            phase=request.phase,
            sha256=request.sha256,
            artifact_name=request.artifact_name,
            chat_id=place.chat_id,
            thread_id=place.thread_id,
            run_id=request.run_id,
        )
        publisher = self.ctx.publisher
        # From the database, by the hash the gate shows: the task folder may be on a
        # worker's disk, and the bot attaches exactly what people approve.
        content = await self._artifact_text(request, place)
        # The phase's message becomes its gate: one message for the phase's whole life.
        phase_ref = self.sink.phase_message(request.task, request.phase)
        if phase_ref is not None:
            # After a write to it already under way (one made from now on is called off).
            async with publisher.in_order(phase_ref):
                await self.ctx.store.rename_live(phase_ref, f"gate:{gate_id}")
        head, excerpt, tail = self._gate_text(request, gate_id)
        await publisher.live(
            f"gate:{gate_id}",
            head,
            chat_id=place.chat_id,
            thread_id=place.thread_id,
            markup=_buttons(gate_id),
            run_id=request.run_id,
            markdown=excerpt,
            tail=tail,
        )
        # After the gate (a wave's sub-task has no phase message before it: its gate is new).
        if content is not None:
            await publisher.document(
                place.chat_id,
                content,
                filename=request.artifact_name,
                caption=f"{request.task} · {words(request.phase)} · sha256 {request.short_hash}",
                thread_id=place.thread_id,
                run_id=request.run_id,
                ref=f"gatedoc:{gate_id}",
            )

    async def _artifact_text(self, request: GateRequest, place: ChatPlace) -> str | None:
        """The gate's stored artifact as text to attach; None (said in the chat) when the
        database does not hold it or it is too large to attach."""
        stored = await self.gates.artifact(request.sha256)
        problem = None
        if stored is None:
            problem = (
                f"{request.artifact_name} (sha256 {request.short_hash}) is not stored, so it "
                "is not attached, and it cannot be approved until it is"
            )
        elif stored.size > _MAX_DOCUMENT:
            problem = (
                f"{request.artifact_name} is too large to attach here "
                f"({stored.size // (1024 * 1024)} MiB); read it with "
                f"turnstile status --task {request.task} --artifact"
            )
        if problem is not None:
            await self.ctx.publisher.say(
                place.chat_id,
                f"{request.task} · {words(request.phase)}: {problem}.",
                thread_id=place.thread_id,
                run_id=request.run_id,
            )
            return None
        assert stored is not None
        return stored.content.decode("utf-8", errors="replace")

    @staticmethod
    def _gate_text(request: GateRequest, gate_id: str) -> tuple[str, str, str]:
        """The gate message: a plain head, the artifact's excerpt (Markdown), a plain tail."""
        text = request.excerpt.strip()
        if len(text) > _EXCERPT:
            text = render_excerpt(text, lines=12, chars=_EXCERPT)
        head = (
            f"🛂 Gate: task {request.task} · phase {words(request.phase)}\n"
            f"Waiting for approval of {request.artifact_name} · sha256 {request.short_hash}\n\n"
        )
        tail = (
            f"\n\nApprove: the button, /approve {request.task}, or reply APPROVED to this "
            f"message. Reject: the button or /reject {request.task} REASON."
        )
        return head, text or "(empty)", tail

    async def _decide_text(self, gate: GateRecord, decided: str) -> None:
        """The gate message's last line says what was decided; its buttons go."""
        live = await self.ctx.store.get_live(f"gate:{gate.gate_id}")
        if live is None:
            return
        head, _, _ = live.body.rpartition("\n")
        kept = len(head.encode("utf-16-le")) // 2
        await self.ctx.store.set_live(
            f"gate:{gate.gate_id}",
            chat_id=live.chat_id,
            thread_id=live.thread_id,
            body=f"{head}\n{decided}",
            entities=tuple(e for e in live.entities if e["offset"] + e["length"] <= kept),
            markup=None,
        )
        self.ctx.publisher.wake()

    # -- approving and rejecting -------------------------------------------------------

    async def _approve(self, update: Update, gate: GateRecord) -> None:
        user = update.effective_user
        chat = update.effective_chat
        assert user is not None
        assert chat is not None
        result = await self.gates.approve(
            gate.task,
            by=user.id,
            chat_id=chat_of(chat),
            update_id=update.update_id,
            expected_sha256=gate.sha256,
        )
        await self.executor.wake(gate.task)
        await self._report(update, gate, result, user.id, "approve")

    async def _reject(self, update: Update, gate: GateRecord, reason: str) -> None:
        user = update.effective_user
        chat = update.effective_chat
        assert user is not None
        assert chat is not None
        result = await self.gates.reject(
            gate.task, by=user.id, reason=reason, chat_id=chat_of(chat), update_id=update.update_id
        )
        await self.executor.wake(gate.task)
        await self._report(update, gate, result, user.id, "reject")

    async def _report(
        self, update: Update, gate: GateRecord, result: ApprovalResult, user_id: int, verb: str
    ) -> None:
        what = f"{gate.task} · {words(gate.phase)} (sha256 {gate.sha256[:12]})"
        name = self.ctx.publisher.people.name(user_id)
        outcome = result.outcome
        if outcome is ApprovalOutcome.APPROVED:
            if await self.ctx.store.close_gate(gate.gate_id, "approved", user_id):
                await self._decide_text(gate, f"✅ Approved by {name}; the next phase runs.")
            if update.callback_query is not None:
                return  # the button's gate message says it: no message more
            text = f"✅ Approved {what} by {name}."
        elif outcome is ApprovalOutcome.RECORDED:
            text = f"Approval of {what} recorded: {result.approvals} of {result.quorum} needed."
        elif outcome is ApprovalOutcome.ALREADY_APPROVED:
            text = f"You already approved {what}; nothing changed."
        elif outcome is ApprovalOutcome.REJECTED:
            if await self.ctx.store.close_gate(gate.gate_id, "rejected", user_id):
                await self._decide_text(gate, f"↩️ Rejected by {name}; the phase re-runs.")
            text = f"↩️ Rejected {what}; the {words(gate.phase)} phase re-runs with your reason."
        else:
            reason = result.reason.value if result.reason is not None else "refused"
            # Decided elsewhere (the CLI, another chat): this gate message is stale.
            if result.reason in (
                Refusal.NOT_AWAITING,
                Refusal.UNKNOWN_TASK,
            ) and await self.ctx.store.close_gate(gate.gate_id, "stale", None):
                await self._decide_text(gate, "⏹ No longer waiting for approval.")
            await self.ctx.store.audit(
                action=verb,
                outcome="refused",
                user_id=user_id,
                chat_id=gate.chat_id,
                update_id=update.update_id,
                reason=f"{reason}: {result.detail}"[:300],
            )
            text = f"⛔ Not accepted for {what}: {reason.replace('_', ' ')}. {result.detail}"
        await self.ctx.replies.reply(update, text.strip())

    async def decided_on_web(self, task: str, result: ApprovalResult, user_id: int) -> None:
        """A gate decided on the web view: its drive wakes, its gate message says so."""
        await self.executor.wake(task)
        if result.phase is None or result.sha256 is None:
            return
        gate = await self.ctx.store.open_gate_for(task, result.phase, result.sha256)
        if gate is None:
            return
        name = self.ctx.publisher.people.name(user_id)
        outcome = result.outcome
        if outcome is ApprovalOutcome.APPROVED:
            if await self.ctx.store.close_gate(gate.gate_id, "approved", user_id):
                await self._decide_text(
                    gate, f"✅ Approved by {name} on the web view; the next phase runs."
                )
        elif outcome is ApprovalOutcome.REJECTED:
            if await self.ctx.store.close_gate(gate.gate_id, "rejected", user_id):
                await self._decide_text(
                    gate, f"↩️ Rejected by {name} on the web view; the phase re-runs."
                )
        elif outcome is ApprovalOutcome.RECORDED:
            await self.ctx.publisher.say(
                gate.chat_id,
                f"Approval of {task} · {words(gate.phase)} by {name} on the web view recorded: "
                f"{result.approvals} of {result.quorum} needed.",
                thread_id=gate.thread_id,
            )

    async def _is_open(self, gate: GateRecord) -> bool:
        """Whether the gate this message shows still waits: asked of the gate store."""
        task = await self.gates.open_gate(gate.task)
        return task is not None and task.phase == gate.phase and task.gate_sha256 == gate.sha256

    async def _gate_for_task(self, update: Update, task: str | None) -> GateRecord | None:
        chat = update.effective_chat
        message = update.effective_message
        assert chat is not None
        if task is not None:
            record = await self.gates.open_gate(task)
            if record is None or record.gate_sha256 is None:
                await self.ctx.replies.reply(update, f"No open gate for task {task}.")
                return None
            gate = await self.ctx.store.open_gate_for(task, record.phase, record.gate_sha256)
            if gate is None:
                # Opened elsewhere (the terminal, another process): decided here all the
                # same; the record says which chat decided it.
                thread = thread_of(message)
                gate_id = secrets.token_hex(4)
                spec = self.gates.workflow.phase(record.phase)
                await self.ctx.store.add_gate(
                    gate_id,
                    task=task,
                    phase=record.phase,
                    sha256=record.gate_sha256,
                    artifact_name=spec.artifact,
                    chat_id=chat_of(chat),
                    thread_id=thread,
                    run_id=await self._drive_run(task),
                )
                gate = await self.ctx.store.gate(gate_id)
            return gate
        gates = [
            g
            for g in await self.ctx.store.open_gates(chat_id=chat_of(chat))
            if await self._is_open(g)
        ]
        if len(gates) == 1:
            return gates[0]
        if not gates:
            await self.ctx.replies.reply(update, "No gate is waiting for approval in this chat.")
        else:
            names = ", ".join(sorted({g.task for g in gates}))
            await self.ctx.replies.reply(
                update, f"Several gates are open ({names}): name the task."
            )
        return None

    async def cmd_approve(self, update: Update, args: list[str]) -> None:
        gate = await self._gate_for_task(update, args[0] if args else None)
        if gate is not None:
            await self._approve(update, gate)

    async def cmd_reject(self, update: Update, args: list[str]) -> None:
        message = update.effective_message
        assert message is not None
        parts = (message.text or "").split(maxsplit=2)
        if len(parts) < 3 or not parts[2].strip():
            await self.ctx.replies.reply(update, "Usage: /reject TASK REASON")
            return
        gate = await self._gate_for_task(update, parts[1])
        if gate is not None:
            await self._reject(update, gate, parts[2].strip())

    async def on_text(self, update: Update, text: str, thread: PlaceId | None) -> bool:
        chat = update.effective_chat
        user = update.effective_user
        message = update.effective_message
        assert chat is not None
        assert user is not None
        assert message is not None
        # A reason the bot asked for after a Reject button press.
        if await self._reason_given(update, text):
            return True
        if not _APPROVED.fullmatch(text):
            return False
        reply = message.reply_to_message
        gate: GateRecord | None = None
        if reply is not None:
            live = await self.ctx.store.live_by_message(chat_of(chat), reply.message_id)
            # A reply to the gate message or to the artifact's document.
            if live is not None and live.ref.startswith(("gate:", "gatedoc:")):
                gate = await self.ctx.store.gate(live.ref.partition(":")[2])
        if gate is None:
            open_here = [
                g
                for g in await self.ctx.store.open_gates(chat_id=chat_of(chat))
                if g.thread_id == thread and await self._is_open(g)
            ]
            if not open_here:
                return False
            if len(open_here) > 1:
                if await self.ctx.replies.authorize(update, Action.APPROVE):
                    await self.ctx.replies.reply(
                        update, "Several gates are open: reply APPROVED to the gate message."
                    )
                return True
            gate = open_here[0]
        if not await self.ctx.replies.authorize(update, Action.APPROVE):
            return True
        if not await self._is_open(gate):
            await self.ctx.replies.reply(
                update,
                f"That gate ({gate.task} · {words(gate.phase)}) no longer waits for approval.",
            )
            return True
        await self._approve(update, gate)
        return True

    async def on_button(self, update: Update, data: str) -> None:
        verb, _, rest = data.partition(":")
        query = update.callback_query
        chat = update.effective_chat
        user = update.effective_user
        assert query is not None
        assert chat is not None
        assert user is not None
        if verb in ("ap", "rj"):
            gate = await self.ctx.store.gate(rest)
            if gate is None:
                await self.ctx.replies.answer(update, "This gate is closed.")
                return
            misplaced = await misplaced_press(self.ctx.store, update, f"gate:{gate.gate_id}")
            if misplaced is not None:
                action = Action.APPROVE if verb == "ap" else Action.REJECT
                await self.ctx.store.audit(
                    action=action.value,
                    outcome="refused",
                    user_id=user.id,
                    chat_id=chat_of(chat),
                    update_id=update.update_id,
                    reason=f"gate {gate.gate_id} ({gate.task} · {words(gate.phase)}): {misplaced}",
                )
                _LOGGER.info("gate %s: press by %s refused (%s)", gate.gate_id, user.id, misplaced)
                await self.ctx.replies.answer(
                    update, _NOT_YET if misplaced == NOT_DELIVERED else MISPLACED
                )
                return
            if not await self._is_open(gate):
                await self.ctx.replies.answer(update, "This gate is closed.")
                return
            if verb == "ap":
                await self.ctx.replies.answer(update, "Approving…")
                await self._approve(update, gate)
            else:
                await self.ctx.replies.answer(update, "Reply with your reason")
                await self._ask_reason(update, gate)
            return
        if verb == "rc":
            await self.ctx.replies.answer(update)
            await self._cancel_reason(update, gate_id=rest)
            return
        if verb == "ry":
            gate_id, _, reason = rest.partition(":")
            await self.ctx.replies.answer(update)
            await self._confirmed_reason(update, gate_id, reason)
            return

    # -- reasons for a Reject button press ---------------------------------------------

    @property
    def _reason_ttl(self) -> float:
        return float(self.ctx.settings.reason_request_seconds)

    async def _ask_reason(self, update: Update, gate: GateRecord) -> None:
        chat = update.effective_chat
        user = update.effective_user
        assert chat is not None
        assert user is not None
        store = self.ctx.store
        previous = await store.reason_request(chat_of(chat), user.id)
        if previous is not None and previous.gate_id != gate.gate_id:
            await self._close_prompt(previous, "⏭ Replaced by a newer Reject.")
        ref = f"reason:{gate.gate_id}:{user.id}:{update.update_id}"
        await store.ask_reason(chat_of(chat), user.id, gate.gate_id, prompt_ref=ref)
        # A forced reply, selective to the person named in it: their app opens a reply to
        # this question, and a reply to the bot reaches it even in privacy mode (a plain
        # message in a group does not).
        name = user.first_name or str(user.id)
        body = self.ctx.redactor(
            f"{name}, why reject {gate.task} · {words(gate.phase)}? Reply to this message with the "
            "reason; it goes back to the agent as revision notes. Pressed Reject by mistake? "
            f"/cancel (after {_duration(self._reason_ttl)} without a reason, nothing is "
            "rejected)."
        )
        mention = {
            "type": "text_mention",
            "offset": 0,
            "length": _utf16(name),
            "user": {"id": user.id, "is_bot": False, "first_name": name},
        }
        message = update.effective_message
        await store.enqueue(
            [
                OutboxItem(
                    chat_id=chat_of(chat),
                    thread_id=thread_of(message),
                    body=body,
                    entities=(mention,) if body.startswith(name) else (),
                    markup={"force_reply": True, "selective": True},
                    reply_to=message.message_id if message is not None else None,
                    ref=ref,
                )
            ]
        )
        self.ctx.publisher.wake()

    async def _reason_given(self, update: Update, text: str) -> bool:
        """Handle ``text`` as the reason the bot waits for; False when it is not one."""
        chat = update.effective_chat
        user = update.effective_user
        assert chat is not None
        assert user is not None
        store = self.ctx.store
        asked = await store.reason_request(chat_of(chat), user.id, max_age=self._reason_ttl)
        if asked is None:
            return False
        if asked.expired:
            await self._close_prompt(asked, "⌛ No reason came in time; nothing was rejected.")
            return False
        gate = await store.gate(asked.gate_id)
        if gate is None or not await self._is_open(gate):
            await store.drop_reason_request(chat_of(chat), user.id, gate_id=asked.gate_id)
            await self._close_prompt(asked, "⏹ That gate is closed; nothing was rejected.")
            return False
        if not await self.ctx.replies.authorize(update, Action.REJECT):
            await store.drop_reason_request(chat_of(chat), user.id, gate_id=asked.gate_id)
            return True
        reason = text.strip()
        if _APPROVAL_WORD.fullmatch(reason):
            # Kept waiting: the buttons decide, or another message is the reason.
            await self.ctx.replies.reply(
                update,
                f"“{reason}” reads like an approval, not a reason. Reject {gate.task} · "
                f"{words(gate.phase)} with the reason “{reason}”? Cancel rejects nothing (then "
                "approve with the gate's button). Or send the real reason.",
                markup=_confirm_buttons(gate.gate_id, reason),
                ref=f"reasonok:{gate.gate_id}:{user.id}:{update.update_id}",
            )
            return True
        if await store.drop_reason_request(chat_of(chat), user.id, gate_id=asked.gate_id):
            await self._close_prompt(asked, "✍️ Reason received.")
            await self._reject(update, gate, reason)
        return True

    async def _confirmed_reason(self, update: Update, gate_id: str, reason: str) -> None:
        """The "reject with this reason" button under a reason that read like an approval."""
        chat = update.effective_chat
        user = update.effective_user
        assert chat is not None
        assert user is not None
        store = self.ctx.store
        asked = await store.reason_request(chat_of(chat), user.id, max_age=self._reason_ttl)
        if asked is None or asked.gate_id != gate_id or asked.expired:
            if asked is not None and asked.expired:
                await self._close_prompt(asked, "⌛ No reason came in time; nothing was rejected.")
            await self._retire_pressed(update, "⏹ Nothing is waiting for this any more.")
            await self.ctx.replies.reply(
                update, "Nothing is waiting for your reason any more; press Reject again."
            )
            return
        gate = await store.gate(gate_id)
        await store.drop_reason_request(chat_of(chat), user.id, gate_id=gate_id)
        await self._close_prompt(asked, "✍️ Reason received.")
        if gate is None or not await self._is_open(gate):
            await self._retire_pressed(update, "⏹ That gate is closed.")
            await self.ctx.replies.reply(update, "That gate is closed; nothing was rejected.")
            return
        await self._retire_pressed(update, f"❌ Rejecting with “{reason}”.")
        await self._reject(update, gate, reason)

    async def _cancel_reason(self, update: Update, *, gate_id: str | None = None) -> None:
        """``/cancel`` or the Cancel button: the pending Reject is dropped."""
        chat = update.effective_chat
        user = update.effective_user
        assert chat is not None
        assert user is not None
        store = self.ctx.store
        asked = await store.reason_request(chat_of(chat), user.id, max_age=self._reason_ttl)
        if asked is not None and asked.expired:
            await self._close_prompt(asked, "⌛ No reason came in time; nothing was rejected.")
            asked = None
        if asked is None or (gate_id is not None and asked.gate_id != gate_id):
            await self._retire_pressed(update, "⏹ Nothing to cancel any more.")
            await self.ctx.replies.reply(
                update, "Nothing to cancel: no Reject is waiting for your reason."
            )
            return
        await store.drop_reason_request(chat_of(chat), user.id, gate_id=asked.gate_id)
        await self._close_prompt(asked, "✖ Cancelled; nothing was rejected.")
        await self._retire_pressed(update, "✖ Cancelled; nothing was rejected.")
        await store.audit(
            action="reject",
            outcome="cancelled",
            user_id=user.id,
            chat_id=chat_of(chat),
            update_id=update.update_id,
            reason=f"gate {asked.gate_id}",
        )
        gate = await store.gate(asked.gate_id)
        what = f"{gate.task} · {words(gate.phase)}" if gate is not None else "the gate"
        still = (
            " still waits for approval" if gate is not None and await self._is_open(gate) else ""
        )
        await self.ctx.replies.reply(update, f"✖ Cancelled: nothing was rejected; {what}{still}.")

    async def cmd_cancel(self, update: Update, args: list[str]) -> None:
        await self._cancel_reason(update)

    async def _close_prompt(self, asked: ReasonRequest, note: str) -> None:
        """The question that asked for a reason loses its button and says why."""
        if asked.prompt_ref is not None:
            await self._retire(asked.prompt_ref, note)

    async def _retire_pressed(self, update: Update, note: str) -> None:
        """The message whose button was pressed (if any) loses its buttons."""
        query = update.callback_query
        chat = update.effective_chat
        user = update.effective_user
        if query is None or query.message is None or chat is None or user is None:
            return
        live = await self.ctx.store.live_by_message(chat_of(chat), query.message.message_id)
        # Refs are "reason…:GATE:USER:UPDATE": only the person asked retires the question.
        if live is not None and live.ref.split(":")[2:3] == [str(user.id)]:
            await self._retire(live.ref, note)

    async def _retire(self, ref: str, note: str) -> None:
        # Also when the question is not yet recorded delivered (its send in flight).
        if await self.ctx.store.retire_live(ref, note):
            self.ctx.publisher.wake()

    # -- /pending ----------------------------------------------------------------------

    async def pending_for(self, user_id: int, chat_id: PlaceId) -> list[str]:
        """The open gates ``user_id`` may approve (not their own task's when self-approval
        is refused, not one they approved already)."""
        if not self.ctx.authorizer.check(user_id, chat_id, Action.APPROVE).allowed:
            return []
        store = self.gates.store
        items = []
        for group in await self.gates.list_tasks():
            if not group.awaiting:
                break  # the groups with an open gate come first
            for entry in group.all():
                task = await self.gates.open_gate(entry.name) if entry.awaiting_approval else None
                if task is None or approver_refusal(store.policy, task, str(user_id)):
                    continue
                if str(user_id) in {a.approver for a in await store.gate_approvals(task)}:
                    continue
                assert task.gate_sha256 is not None
                gate = await self.ctx.store.open_gate_for(task.name, task.phase, task.gate_sha256)
                where = await self._gate_link(gate, chat_id)
                items.append(
                    f"🛂 {task.name} · {words(task.phase)}\n"
                    f"   /approve {task.name} or /reject {task.name} REASON{where}"
                )
        return items

    async def _gate_link(self, gate: GateRecord | None, chat_id: PlaceId) -> str:
        """Where the gate's message is, for a /pending line ("" when nowhere to point)."""
        if gate is None:
            return ""
        live = await self.ctx.store.get_live(f"gate:{gate.gate_id}")
        link = message_link(gate.chat_id, live.message_id if live is not None else None)
        if link is not None:
            return f"\n   the gate: {link}"
        return "" if gate.chat_id == chat_id else "\n   (its gate is in another chat)"

    # -- /stop, /status ----------------------------------------------------------------

    async def stop(self, run_id: str, *, chat_id: PlaceId, by: int) -> bool:
        by_name = self.ctx.publisher.people.name(by)
        return await self.executor.stop(run_id, chat_id=chat_id, by=by_name)

    async def stop_chat(self, chat_id: PlaceId, thread: PlaceId | None, *, by: int) -> list[str]:
        by_name = self.ctx.publisher.people.name(by)
        return await self.executor.stop_in(ChatPlace(chat_id, thread), by=by_name)

    async def on_stop_button(self, update: Update, data: str) -> None:
        """The Stop button of a running phase's message: the drive stops, as with /stop."""
        chat = update.effective_chat
        user = update.effective_user
        assert chat is not None
        assert user is not None
        task = data.removeprefix(AUTOPILOT_STOP_DATA)
        # Answered first (a stop waits for the turn to end, longer than a press may wait).
        await self.ctx.replies.answer(update, "Stopping…")
        if not await self.stop(task, chat_id=chat_of(chat), by=user.id):
            # (a message of a drive that ended while the bot was away): its button goes.
            message = update.effective_message
            live = (
                await self.ctx.store.live_by_message(chat_of(chat), message.message_id)
                if message is not None
                else None
            )
            if live is not None and live.ref.startswith(("phase:", "wave:")):
                await self._retire(live.ref, "⏹ Not running any more.")
            await self.ctx.replies.reply(update, f"The drive of {task} is not running any more.")
            return
        await self.ctx.replies.audited(update, "stop", task)

    async def status_lines(self, chat_id: PlaceId, thread: PlaceId | None) -> list[str]:
        lines = []
        for name, place in self.places.items():
            if place.chat_id != chat_id:
                continue
            try:
                task = await self.gates.task(name)
            except GateRefused:
                continue
            state = self.executor.state_of(name) or "idle"
            lines.append(f"🛂 autopilot {name} · {words(task.label)} · {state}")
            # A task checked out with --checkout-repo: its branch and disk usage.
            worktree = await worktree_summaries(
                self.ctx.settings, self.ctx.db, {name: str(task.workdir)}
            )
            if name in worktree:
                lines.append(f"   🌿 {worktree[name]}")
        return lines

    # -- start-up and shutdown ---------------------------------------------------------

    async def recover(self, report: Recovery) -> None:
        """Where each task's messages go, then the drives the executor resumes or follows
        again; gates are re-posted only when they changed (an open gate's message is
        refreshed instead). From then on, gates other processes open (a terminal's
        ``turnstile autopilot``) are posted too."""
        for task_name, chat_id, thread_id in await self.ctx.store.task_places():
            place = ChatPlace(chat_id, thread_id)
            self.places[task_name] = place
            self.sink.register_task(task_name, place)
        await self.executor.recover(report)
        self._elsewhere = self.ctx.spawn(self._gates_elsewhere(), "autopilot-gates-elsewhere")

    # -- gates another process opened --------------------------------------------------

    async def _gates_elsewhere(self) -> None:
        """Post the gates opened by drives this bot does not run (a terminal's, on a task
        of this chat or of a project a chat is bound to), as its own drives' are: the
        open ones first (opened while the bot was away), then each as it opens."""
        log = EventLog(self.ctx.db)
        while not self.closing:
            try:
                cursor = await log.last_id()
                for group in await self.gates.list_tasks():
                    if not group.awaiting:
                        break
                    for entry in group.all():
                        if entry.awaiting_approval:
                            await self._post_elsewhere(entry.name)
                # Closed with the loop, however it ends: a cancel while a gate is being
                # posted leaves the tail suspended, holding its LISTEN connection open.
                async with contextlib.aclosing(
                    log.tail((EventKind.GATE_OPENED,), after=cursor)
                ) as opened:
                    async for event in opened:
                        if event.task is not None:
                            await self._post_elsewhere(event.task)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the database away for a while: try again
                _LOGGER.warning("cannot follow the gates other processes open: %s", exc)
                await asyncio.sleep(2.0)

    async def _post_elsewhere(self, name: str) -> None:
        task = await self.gates.open_gate(name)
        if task is None or task.gate_sha256 is None:
            return
        # A wave's sub-task is driven by its parent's drive: the top task says who drives.
        top: TaskRecord | None = task
        seen = {task.name}
        while top is not None and top.parent is not None and top.parent not in seen:
            seen.add(top.parent)
            top = await self.gates.store.find(top.parent)
        if self.executor.state_of(name) or (top and self.executor.state_of(top.name)):
            return  # driven here (or followed on the workers): its drive posts its gates
        place = await self._place_of_task(name) or await self._bound_place(task)
        if place is None:
            return  # no chat knows the task: the terminal that drives it says it
        self.places.setdefault(name, place)
        spec = self.gates.workflow.phase(task.phase)
        request = GateRequest(
            task=name,
            phase=spec.name,
            artifact_name=spec.artifact,
            artifact_path=task.folder / spec.artifact,
            sha256=task.gate_sha256,
            excerpt=await self.gates.store.excerpt(task.gate_sha256, 1500),
            run_id=await self._drive_run(name),
        )
        _LOGGER.info("gate of %s opened elsewhere posted", spec.name, extra={"task": name})
        await self.post_gate(request, place)

    async def _drive_run(self, task: str) -> str | None:
        """The run of the latest drive of ``task`` (None: it was never driven)."""
        run = await self.ctx.runs.latest_task_run(RunMode.AUTOPILOT, task)
        return run.id if run is not None else None

    async def _bound_place(self, task: TaskRecord) -> ChatPlace | None:
        """The chat (or topic) bound most recently to the task's project: the project of
        its worktree, or the folder it works in."""
        found = await match_worktrees(self.ctx.db, {task.name: str(task.workdir)})
        project = found[task.name].project if task.name in found else None
        bindings = await self.ctx.store.bindings()
        # (Resolving the folders reads the disk.)
        chosen = await asyncio.to_thread(_bound_to, bindings, project, task.workdir)
        if chosen is None:
            return None
        return ChatPlace(chosen.chat_id, chosen.thread_id)

    async def shutdown(self, *, park: bool, preempt: asyncio.Event) -> None:
        self.closing = True
        follower = self._elsewhere
        if follower is not None:
            # A cancel a library swallows (a timeout firing as it lands, on 3.11) is sent
            # again: the follower never holds the bot's shutdown up.
            while not follower.done():
                follower.cancel()
                await asyncio.wait({follower}, timeout=0.5)
            with contextlib.suppress(asyncio.CancelledError):
                await follower
        await self.executor.shutdown(park=park, preempt=preempt)

    async def park_all(self) -> None:
        self.closing = True
        await self.executor.park_all()


def _bound_to(bindings: list[Binding], project: str | None, workdir: Path) -> Binding | None:
    """The latest of ``bindings`` (oldest first) to ``project`` or to a folder holding
    ``workdir``."""
    where = workdir.resolve()
    chosen = None
    for binding in bindings:
        folder = Path(binding.workdir).resolve() if binding.workdir else None
        if binding.project == project or (folder is not None and where.is_relative_to(folder)):
            chosen = binding
    return chosen


def _buttons(gate_id: str) -> dict[str, Any]:
    return {
        "inline_keyboard": [
            [
                {"text": "✅ Approve", "callback_data": f"ap:{gate_id}"},
                {"text": "❌ Reject", "callback_data": f"rj:{gate_id}"},
            ]
        ]
    }


def _utf16(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


def _confirm_buttons(gate_id: str, reason: str) -> dict[str, Any]:
    kept = reason.encode()[:_CONFIRM_REASON_BYTES].decode(errors="ignore")
    return {
        "inline_keyboard": [
            [
                {"text": "❌ Reject with this reason", "callback_data": f"ry:{gate_id}:{kept}"},
                {"text": "✖ Cancel", "callback_data": f"rc:{gate_id}"},
            ]
        ]
    }


def _duration(seconds: float) -> str:
    if seconds >= 120:
        return f"{seconds / 60:.0f} minutes"
    return f"{seconds:.0f} seconds" if seconds >= 2 else f"{seconds:g} seconds"
