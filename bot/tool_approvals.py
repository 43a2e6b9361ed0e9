"""Tool approvals in the chat: one message per request, Allow once · for this session · Deny.

With ``TURNSTILE_TOOL_APPROVAL`` on, a chat session's Claude Code asks turnstile's
permission server before a tool call its allowlist does not cover; the request lands in
the store, this extension posts it to the run's chat, and the press decides it. Who may
decide: approvers (and admins), and the operator who bound the session unless
``TURNSTILE_FORBID_SELF_APPROVAL``. A press counts only on the request's own message
(not before it is delivered). Every decision and every refused press is audited.

``/stop`` ends the turn (the permission server dies with the CLI) and the request's
buttons go. A bot shutdown while a request waits parks that turn: it runs again after the
restart and asks again; a request left over from a crash is reported, not answerable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Final

from telegram import Update

from bot.context import BotContext
from bot.feature import Feature
from bot.handlers import Dispatch
from bot.places import chat_of
from bot.render import message_link
from bot.replies import MISPLACED, NOT_DELIVERED, misplaced_press, thread_of
from chatfront.auth import Action
from chatfront.progress import TurnProgress
from chatfront.store import Binding
from engine.approvals import (
    ApprovalPolicy,
    ApprovalRoute,
    ApprovalWatcher,
    Decision,
    Scope,
    SqliteApprovalStore,
    ToolRequest,
    describe_key,
    summarize,
)
from engine.automode.run import ApprovalFor
from engine.errors import ConfigError, NotFoundError
from engine.executors import worker_of
from engine.runs import Recovery
from engine.runs.spec import PlaceId
from engine.store.runs import RunRecord

__all__ = ["ToolApprovalExtension", "request_text", "turn_progress"]

_LOGGER = logging.getLogger(__name__)

PREFIX: Final = "tq"
_PRESETS: Final = {p.value for p in ApprovalPolicy if p.is_preset}
_CHOICES: Final = {"o": (Decision.ALLOWED, Scope.ONCE), "s": (Decision.ALLOWED, Scope.SESSION)}
_CHOICES_DENY: Final = {"d": (Decision.DENIED, None)}
RESTARTED: Final = "the bot restarted while it waited"
STOPPED: Final = "the turn was stopped"
PARKED: Final = RESTARTED + "; the turn runs again and asks again"
SHUTTING_DOWN: Final = "the bot is shutting down; the agent was told no"
NOT_YET: Final = "⏳ This request's message is still being delivered; press again."


def _ref(request_id: int) -> str:
    return f"tool:{request_id}"


def turn_progress(ctx: BotContext, run_id: str) -> TurnProgress | None:
    """The progress message of a chat run's running turn (None: not a chat turn here)."""
    chat_run = ctx.chats.find(run_id)
    progress = chat_run.progress if chat_run is not None else None
    return progress if isinstance(progress, TurnProgress) and not progress.finished else None


def _buttons(request: ToolRequest) -> dict[str, Any]:
    once = {"text": "✅ Allow once", "callback_data": f"{PREFIX}:{request.id}:o"}
    deny = {"text": "⛔ Deny", "callback_data": f"{PREFIX}:{request.id}:d"}
    if request.no_grant:  # no grant covers a catastrophic call: once, or no
        return {"inline_keyboard": [[once, deny]]}
    session = {"text": "♾ Allow for this session", "callback_data": f"{PREFIX}:{request.id}:s"}
    return {"inline_keyboard": [[once, session], [deny]]}


def request_text(
    request: ToolRequest, outcome: str | None = None, *, worker: str | None = None
) -> str:
    """The request as people read it; ``outcome`` replaces the footer once decided.

    ``worker``: the worker whose turn asks (a chat session on the workers).
    """
    where = f" (on worker {worker})" if worker else ""
    mark = "🚨" if request.no_grant else "🔐"
    lines = [
        f"{mark} Run {request.run_id}{where} asks to use {request.tool}:",
        summarize(request.tool, request.input),
        "",
    ]
    if request.why:
        lines[-1:] = [f"It asks because this call {request.why}.", ""]
    if outcome is None and request.no_grant:
        lines.append("Allow it once, or deny. Nothing allows a call like this for the session.")
    elif outcome is None:
        lines.append(
            "Allow once, allow for this session "
            f"({describe_key(request.tool, request.key)}), or deny. The turn waits."
        )
    else:
        lines.append(outcome)
    return "\n".join(lines)


def outcome_text(request: ToolRequest, name: Callable[[int | None], str]) -> str:
    """How the request was settled, naming who decided (``name``: a person's name)."""
    who = f" by {name(request.decided_by)}" if request.decided_by is not None else ""
    if request.state is Decision.ALLOWED and request.scope is Scope.SESSION:
        return f"✅ Allowed for this session{who}: {describe_key(request.tool, request.key)}."
    if request.state is Decision.ALLOWED:
        return f"✅ Allowed once{who}."
    if request.state is Decision.DENIED:
        return f"⛔ Denied{who}; the agent was told."
    return f"⏹ Not decided: {request.reason or 'withdrawn'}."


class ToolApprovalExtension(Feature):
    """Posts tool requests of the bot's runs and takes the decisions."""

    def __init__(self, ctx: BotContext) -> None:
        self.ctx = ctx
        self.policy = ApprovalPolicy(ctx.settings.tool_approval)
        self.store = SqliteApprovalStore(ctx.db)
        self.watcher = ApprovalWatcher(self.store, self._show)
        self._started = asyncio.Event()
        self._failed: Exception | None = None
        self._closing = False
        ctx.chats.approvals = self.route

    def _name(self, user_id: int | None) -> str:
        return self.ctx.publisher.people.name(user_id)

    def register(self, dispatch: Dispatch) -> None:
        # Who may decide is the request's business (approvers, or its starter): see _refusal.
        # An id of at most 18 ASCII digits fits every database's integer; anything else
        # (an oversized or negative number, another script's digits) is no button of ours.
        dispatch.buttons(rf"^{PREFIX}:[0-9]{{1,18}}:[osd]\Z", None, self.on_button)
        dispatch.command("permissions", Action.STATUS, self.cmd_permissions)

    async def cmd_permissions(self, update: Update, args: list[str]) -> None:
        """``/permissions``: what this place's tool calls ask; an admin sets a preset."""
        chat = update.effective_chat
        user = update.effective_user
        assert chat is not None
        assert user is not None
        thread = thread_of(update.effective_message)
        current = await self.policy_in(chat_of(chat), thread)
        if not args:
            await self.ctx.replies.reply(
                update,
                f"Permissions here: {current.label}. An admin sets them with /permissions "
                "guarded, trusted or free (/permissions default: the bot's setting, "
                f"{self.policy.label}). Only Claude Code sessions ask.",
            )
            return
        wanted = args[0].lower()
        if len(args) != 1 or wanted not in {*_PRESETS, "default"}:
            await self.ctx.replies.reply(
                update, "Usage: /permissions guarded | trusted | free | default"
            )
            return
        if not self.ctx.authorizer.check(user.id, chat_of(chat), Action.PERMISSIONS).allowed:
            await self.ctx.store.audit(
                action="permissions",
                outcome="refused",
                user_id=user.id,
                chat_id=chat_of(chat),
                update_id=update.update_id,
                reason=f"{wanted} needs admin",
            )
            await self.ctx.replies.reply(
                update, f"Only an admin changes what asks here. Permissions: {current.label}."
            )
            return
        chosen = None if wanted == "default" else wanted
        await self.ctx.store.set_place_permissions(chat_of(chat), thread, chosen, by=user.id)
        await self.ctx.replies.audited(update, "permissions", wanted)
        now = await self.policy_in(chat_of(chat), thread)
        await self.ctx.replies.reply(
            update,
            f"🔐 Permissions here: {now.label}. They apply to runs started from now on "
            "(/new starts a fresh chat session with them).",
        )

    # -- wiring runs -------------------------------------------------------------------

    async def policy_in(self, chat_id: PlaceId, thread_id: PlaceId | None) -> ApprovalPolicy:
        """The policy of a place's runs: its /permissions, else the settings'."""
        chosen = await self.ctx.store.place_permissions(chat_id, thread_id)
        return ApprovalPolicy(chosen) if chosen else self.policy

    async def route(self, run_id: str, binding: Binding) -> ApprovalRoute | None:
        """Where a new chat run's permission requests go (None: the policy is off)."""
        if binding.agent != "claude":
            return None
        policy = await self.policy_in(binding.chat_id, binding.thread_id)
        if policy is ApprovalPolicy.OFF:
            return None
        await self._started.wait()
        if self._failed is not None:
            raise ConfigError(f"tool approvals cannot start here: {self._failed}")
        bound = await self.ctx.store.binding(binding.chat_id, binding.thread_id)
        starter = bound.bound_by if bound is not None else None
        return ApprovalRoute(
            database=self.ctx.settings.database,
            run_id=run_id,
            policy=policy,
            starter=starter,
            wake=self.watcher.wake_path,
        )

    def routes_for(self, tool: str, starter: int | None) -> ApprovalFor | None:
        """Routes for the runs of another front end (auto mode), by run id and the run's
        own policy (set when it started: /auto --permissions, or the chat's)."""
        if tool != "claude":
            return None

        def route_for(run_id: str, own: ApprovalPolicy | None = None) -> ApprovalRoute | None:
            policy = own or self.policy
            if policy is ApprovalPolicy.OFF:
                return None
            return ApprovalRoute(
                database=self.ctx.settings.database,
                run_id=run_id,
                policy=policy,
                starter=starter,
                wake=self.watcher.wake_path,
            )

        return route_for

    async def _hold_watcher(self) -> None:
        try:
            async with self.watcher:
                self._started.set()
                await self.watcher.scan()
                await asyncio.Event().wait()
        except Exception as exc:
            # No silent fallback: runs that would ask refuse to start, saying why.
            _LOGGER.exception("tool approvals stopped")
            self._failed = exc
            self._started.set()
            raise

    # -- showing -----------------------------------------------------------------------

    async def _run_of(self, request: ToolRequest) -> RunRecord | None:
        try:
            run = await self.ctx.runs.get_run(request.run_id)
        except NotFoundError:
            return None
        return run if run.chat_id is not None else None

    async def _show(self, request: ToolRequest) -> bool:
        run = await self._run_of(request)
        if run is None or run.chat_id is None:
            return False  # not a bot run: a terminal front end shares the database
        if self._closing:
            await self._close_waiting([request.run_id])
            return True
        progress = turn_progress(self.ctx, run.id)
        await self.ctx.publisher.live(
            _ref(request.id),
            request_text(request, worker=await self._worker_of(run.id)),
            chat_id=run.chat_id,
            thread_id=run.thread_id,
            markup=_buttons(request),
            run_id=run.id,
            # under the message that started the turn, as its progress and answer are
            reply_to=progress.reply_to if progress is not None else None,
        )
        if progress is not None:
            await progress.wait_for_person(f"🔐 to allow {request.tool} (the request below)")
        _LOGGER.info("tool request %s of run %s posted", request.id, run.id)
        return True

    async def _worker_of(self, run_id: str) -> str | None:
        """The worker running the run's turns (None: the bot runs them itself)."""
        return await worker_of(self.ctx.settings, self.ctx.db, run_id)

    async def _refresh(self, request: ToolRequest) -> None:
        progress = turn_progress(self.ctx, request.run_id)
        if progress is not None and not await self.store.pending(run_id=request.run_id):
            await progress.wait_for_person(None)
        live = await self.ctx.store.get_live(_ref(request.id))
        if live is None:
            return
        await self.ctx.publisher.live(
            _ref(request.id),
            request_text(
                request,
                outcome_text(request, self._name),
                worker=await self._worker_of(request.run_id),
            ),
            chat_id=live.chat_id,
            thread_id=live.thread_id,
            markup=None,
            run_id=request.run_id,
        )

    # -- deciding ----------------------------------------------------------------------

    async def on_button(self, update: Update, data: str) -> None:
        parts = data.split(":")
        choice = {**_CHOICES, **_CHOICES_DENY}[parts[2]]
        user = update.effective_user
        chat = update.effective_chat
        assert user is not None
        assert chat is not None
        try:
            request = await self.store.get(int(parts[1]))
        except NotFoundError:
            await self.ctx.replies.answer(update, "This request is unknown.")
            return
        misplaced = await misplaced_press(self.ctx.store, update, _ref(request.id))
        refusal = misplaced or self._refusal(user.id, chat_of(chat), request)
        if refusal is not None:
            await self.ctx.store.audit(
                action="tool_approval",
                outcome="refused",
                user_id=user.id,
                chat_id=chat_of(chat),
                update_id=update.update_id,
                reason=f"request {request.id} ({request.tool}): {refusal}",
            )
            _LOGGER.info("tool request %s: press by %s refused (%s)", request.id, user.id, refusal)
            if misplaced is not None:
                answer = NOT_YET if misplaced == NOT_DELIVERED else MISPLACED
            else:
                answer = f"⛔ {refusal[0].upper()}{refusal[1:]}. Your id: {user.id}"
            await self.ctx.replies.answer(update, answer)
            return
        decision, scope = choice
        result = await self.store.decide(request.id, decision, scope=scope, by=user.id)
        if not result.changed:
            await self.ctx.replies.answer(
                update, f"Already decided: {outcome_text(result.request, self._name)}"
            )
            await self._refresh(result.request)
            return
        decided = result.request
        await self.ctx.store.audit(
            action="tool_approval",
            outcome=decided.state.value,
            user_id=user.id,
            chat_id=chat_of(chat),
            update_id=update.update_id,
            reason=(
                f"request {decided.id} of run {decided.run_id}: {decided.tool} "
                f"{summarize(decided.tool, decided.input).splitlines()[0]}"
                + (f" ({scope.value})" if scope is not None else "")
            )[:300],
        )
        await self.ctx.replies.answer(update, outcome_text(decided, self._name))
        await self._refresh(decided)
        if scope is Scope.SESSION:
            await self._apply_grant(decided)

    async def decided_elsewhere(self, decided: ToolRequest) -> None:
        """A request decided on the web view: its message says so; an allow for the
        session allows the run's other waiting calls it covers."""
        await self._refresh(decided)
        if decided.scope is Scope.SESSION:
            await self._apply_grant(decided)

    def _refusal(self, user_id: int, chat_id: PlaceId, request: ToolRequest) -> str | None:
        """Why ``user_id`` may not decide ``request`` (None: they may)."""
        auth = self.ctx.authorizer
        is_starter = request.starter_id is not None and user_id == request.starter_id
        if is_starter and self.ctx.settings.forbid_self_approval:
            return "you started this run, and self-approval is forbidden here"
        if auth.check(user_id, chat_id, Action.APPROVE).allowed:
            return None
        if is_starter and auth.check(user_id, chat_id, Action.PROMPT).allowed:
            return None
        return "needs the approver role (or to be the operator who started the run)"

    async def _apply_grant(self, granted: ToolRequest) -> None:
        """Other waiting calls of the run the new grant covers are allowed with it."""
        for other in await self.store.pending(run_id=granted.run_id):
            if other.tool == granted.tool and other.key == granted.key:
                result = await self.store.decide(
                    other.id,
                    Decision.ALLOWED,
                    scope=Scope.GRANT,
                    by=granted.decided_by,
                    reason="allowed for this session",
                )
                if result.changed:
                    await self._refresh(result.request)

    # -- cancelling --------------------------------------------------------------------

    async def _cancel(self, run_ids: list[str] | None, reason: str) -> None:
        for request in await self.store.cancel_pending(reason, run_ids=run_ids):
            _LOGGER.info("tool request %s cancelled: %s", request.id, reason)
            await self._refresh(request)

    async def _runs_waiting(self, chat_id: PlaceId, thread: PlaceId | None) -> list[str]:
        found: dict[str, None] = {}
        for request in await self.store.pending():
            run = await self._run_of(request)
            if run is None or run.chat_id != chat_id:
                continue
            if thread is None or run.thread_id == thread:
                found.setdefault(run.id, None)
        return list(found)

    async def stop(self, run_id: str, *, chat_id: PlaceId, by: int) -> bool:
        if run_id in await self._runs_waiting(chat_id, None):
            await self._cancel([run_id], f"{STOPPED} by {self._name(by)}")
        return False  # the run itself belongs to the chat sessions or another extension

    async def stop_chat(self, chat_id: PlaceId, thread: PlaceId | None, *, by: int) -> list[str]:
        waiting = await self._runs_waiting(chat_id, thread)
        if waiting:
            await self._cancel(waiting, f"{STOPPED} by {self._name(by)}")
        return []

    async def pending_for(self, user_id: int, chat_id: PlaceId) -> list[str]:
        """The tool calls waiting for a decision that ``user_id`` may take."""
        items = []
        for request in await self.store.pending():
            run = await self._run_of(request)
            if run is None or run.chat_id is None:
                continue
            if self._refusal(user_id, run.chat_id, request) is not None:
                continue
            live = await self.ctx.store.get_live(_ref(request.id))
            link = message_link(run.chat_id, live.message_id if live is not None else None)
            where = f": {link}" if link else (" here" if run.chat_id == chat_id else "")
            first = summarize(request.tool, request.input).splitlines()[0][:60]
            items.append(
                f"🔐 run {run.id} asks to use {request.tool}: {first}\n"
                f"   Allow or Deny on its message{where}"
            )
        return items

    async def status_lines(self, chat_id: PlaceId, thread: PlaceId | None) -> list[str]:
        lines = []
        for request in await self.store.pending():
            run = await self._run_of(request)
            if run is not None and run.chat_id == chat_id:
                first = summarize(request.tool, request.input).splitlines()[0][:80]
                lines.append(f"🔐 run {run.id} waits for a decision: {request.tool} {first}")
        return lines

    # -- start-up and shutdown ---------------------------------------------------------

    async def recover(self, report: Recovery) -> None:
        """Requests of bot runs left from before the restart are reported, then listen."""
        leftover = [r.run_id for r in await self.store.pending() if await self._run_of(r)]
        if leftover:
            await self._cancel(sorted(set(leftover)), RESTARTED + "; the turn was cut off")
        self.ctx.spawn(self._hold_watcher(), "tool-approvals")

    async def park_run(self, run_id: str) -> bool:
        """Park a chat run's turn (it runs again after the restart); False: not a chat run."""
        chats = self.ctx.chats
        run = chats.find(run_id)
        if run is None or run.task is None or run.task.done():
            return False
        run.parking = True
        run.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({run.task})
        return True

    async def _close_waiting(self, run_ids: list[str]) -> None:
        for run_id in run_ids:
            if await self.park_run(run_id):
                await self._cancel([run_id], PARKED)
            else:
                # Another front end's run (auto mode) finishes its turn, told "no".
                await self._cancel([run_id], SHUTTING_DOWN)

    async def shutdown(self, *, park: bool, preempt: asyncio.Event) -> None:
        """A turn waiting for a person cannot finish while the bot is down: park it."""
        self._closing = True
        waiting = sorted({r.run_id for r in await self.store.pending() if await self._run_of(r)})
        await self._close_waiting(waiting)
