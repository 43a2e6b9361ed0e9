"""Help, ``/status``, ``/stop``, and the admins' ``/tasks`` and ``/audit``.

``/stop`` and ``/status`` ask every feature that owns runs (chat sessions, auto mode,
autopilot, tool approvals) for its part, in a fixed order.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Sequence
from typing import Any, Final

from telegram import Update

from bot.context import BotContext
from bot.feature import Feature
from bot.handlers import Dispatch
from bot.places import chat_of
from bot.replies import thread_of
from chatfront.auth import Action
from chatfront.commands import all_commands_text, help_text
from engine.agents.registry import installed_agents
from engine.gates.listing import TaskGroup
from engine.humane import words
from engine.runs.ids import named_runs
from engine.runs.spec import PlaceId
from engine.sandbox import sandbox_state
from engine.spend import Spend
from engine.store.runs import RunRecord, RunStatus

__all__ = ["AdminFeature"]

_PAGE: Final = 25

_APPROVAL_HELP: Final = {
    "off": "off here: only the allowed tools run",
    "unlisted": "on here for tools outside the allowed list",
    "all": "on here for every tool call",
    "guarded": "guarded here: every tool call that changes something asks",
    "trusted": "trusted here: only destructive or outward actions ask",
    "free": "free here: nothing asks but the catastrophic",
}


# The data of /help's "All commands" button.
_ALL: Final = "hp:all"

# A bare /stop with several runs working: which one (the button's data names the run).
_PICK: Final = "sp:"
_PICK_REF: Final = "stoppick:"
_MODES: Final = {"chat": "chat turn", "auto": "auto run", "autopilot": "autopilot"}


def _run_label(run: RunRecord) -> str:
    """A run as a stop button names it: its kind, its task or objective, its id's end."""
    what = run.task or (run.objective or "")[:24]
    return f"{_MODES.get(run.mode, run.mode)} {what} (…{run.id[-6:]})".replace("  ", " ")


class AdminFeature(Feature):
    """The commands about the bot and its runs rather than one kind of run."""

    def __init__(self, ctx: BotContext, owners: Sequence[Feature]) -> None:
        self.ctx = ctx
        # In the order /stop stops and /status lists: chat sessions first.
        self.owners = tuple(owners)

    def register(self, dispatch: Dispatch) -> None:
        dispatch.command(("help", "start"), Action.HELP, self.cmd_help)
        dispatch.buttons(rf"^{_ALL}\Z", Action.HELP, self.on_all_commands)
        dispatch.command("stop", Action.STOP, self.cmd_stop)
        dispatch.command("status", Action.STATUS, self.cmd_status)
        dispatch.command("pending", Action.STATUS, self.cmd_pending)
        dispatch.command("tasks", Action.TASKS, self.cmd_tasks)
        dispatch.command("audit", Action.AUDIT, self.cmd_audit)
        dispatch.buttons(r"^tk(:|\Z)", Action.TASKS, self.on_page)
        dispatch.buttons(rf"^{_PICK}[A-Za-z0-9_:.-]{{1,60}}\Z", Action.STOP, self.on_pick)

    async def cmd_help(self, update: Update, args: list[str]) -> None:
        user = update.effective_user
        assert user is not None
        roles = self.ctx.authorizer.roles(user.id)
        voice = self.ctx.settings.transcription_url is not None
        await self.ctx.replies.reply(
            update,
            help_text(roles, voice=voice),
            markup={"inline_keyboard": [[{"text": "All commands", "callback_data": _ALL}]]},
        )

    async def on_all_commands(self, update: Update, data: str) -> None:
        """The "All commands" button: every command with the role it needs, in a reply."""
        await self.ctx.replies.answer(update)
        settings = self.ctx.settings
        text = all_commands_text(
            agents=", ".join(installed_agents(settings)) or "none",
            tool_approval=_APPROVAL_HELP[settings.tool_approval],
            voice=settings.transcription_url is not None,
        )
        await self.ctx.replies.reply(update, text)

    async def cmd_stop(self, update: Update, args: list[str]) -> None:
        chat = update.effective_chat
        user = update.effective_user
        assert chat is not None
        assert user is not None
        thread = thread_of(update.effective_message)
        here = [
            r.id
            for r in await self.ctx.runs.list_runs(status=RunStatus.RUNNING)
            if r.chat_id == chat_of(chat)
        ]
        wanted = args[0] if args else None
        if wanted is not None:
            # a run may be named by the end of its id ("/stop 4a37b")
            named = named_runs(here, wanted)
            wanted = named[0] if len(named) == 1 else wanted
        if wanted is None:
            working = await self._working_here(chat_of(chat), thread)
            if len(working) > 1:  # which one? one button per run, and one for all
                await self._ask_which(update, working, thread)
                return
        stopped = await self._stop(chat_of(chat), thread, wanted, by=user.id)
        if not stopped and wanted is None:
            await self.ctx.replies.reply(update, "Nothing is running here.")
        elif not stopped and wanted in here:
            await self.ctx.replies.reply(update, f"Run {wanted} is idle: nothing to stop.")
        elif not stopped:
            listed = f" Running here: {', '.join(here)}." if here else " Nothing runs here."
            await self.ctx.replies.reply(
                update, f"No run {args[0]} here.{listed} /status lists this chat's runs."
            )

    async def _stop(
        self, chat_id: PlaceId, thread: PlaceId | None, run_id: str | None, *, by: int
    ) -> list[str]:
        """Stop ``run_id`` (None: every run of the place); returns what was stopped."""
        stopped: list[str] = []
        for owner in self.owners:
            if run_id is not None:
                if await owner.stop(run_id, chat_id=chat_id, by=by):
                    stopped.append(run_id)
            else:
                stopped.extend(await owner.stop_chat(chat_id, thread, by=by))
        return stopped

    async def _working_here(self, chat_id: PlaceId, thread: PlaceId | None) -> list[RunRecord]:
        """The runs of this chat or topic that a stop would stop (not an idle session)."""
        found = []
        for run in await self.ctx.runs.list_runs(status=RunStatus.RUNNING):
            if run.chat_id != chat_id or run.thread_id != thread or run.parent_id:
                continue
            if run.mode == "chat":
                chat_run = self.ctx.chats.find(run.id)
                queued = await self.ctx.store.queued_count(chat_id, thread)
                if chat_run is None or not (chat_run.busy or queued):
                    continue
            found.append(run)
        return found

    async def _ask_which(
        self, update: Update, runs: list[RunRecord], thread: PlaceId | None
    ) -> None:
        chat = update.effective_chat
        message = update.effective_message
        assert chat is not None
        rows = [
            [{"text": f"⏹ {_run_label(run)}", "callback_data": f"{_PICK}{run.id}"}] for run in runs
        ]
        rows.append([{"text": "⏹ all of them", "callback_data": f"{_PICK}all:{thread or ''}"}])
        await self.ctx.publisher.live(
            f"{_PICK_REF}{update.update_id}",
            f"{len(runs)} runs are working here. Which one should stop?",
            chat_id=chat_of(chat),
            thread_id=thread,
            markup={"inline_keyboard": rows},
            reply_to=message.message_id if message is not None else None,
        )

    async def on_pick(self, update: Update, data: str) -> None:
        chat = update.effective_chat
        user = update.effective_user
        message = update.effective_message
        assert chat is not None
        assert user is not None
        choice = data.removeprefix(_PICK)
        if choice.startswith("all:"):
            run_id = None
            topic = choice.removeprefix("all:")
            # ("all:0": a button from before topics were text, with 0 for no topic)
            thread = topic if topic not in ("", "0") else None
        else:
            run_id, thread = choice, thread_of(message)
        stopped = await self._stop(chat_of(chat), thread, run_id, by=user.id)
        await self.ctx.replies.audited(update, "stop", ", ".join(stopped) or "nothing left to stop")
        name = self.ctx.publisher.people.name(user.id)
        said = (
            f"⏹ {name} stopped {', '.join(stopped)}."
            if stopped
            else "Nothing of that runs any more."
        )
        await self.ctx.replies.answer(update, said[:190])
        live = (
            await self.ctx.store.live_by_message(chat_of(chat), message.message_id)
            if message is not None
            else None
        )
        if live is not None and live.ref.startswith(_PICK_REF):
            # one press settles the question: the buttons go, what was stopped stays
            await self.ctx.publisher.live(
                live.ref,
                said,
                chat_id=live.chat_id,
                thread_id=live.thread_id,
                markup=None,
            )

    async def cmd_status(self, update: Update, args: list[str]) -> None:
        chat = update.effective_chat
        assert chat is not None
        thread = thread_of(update.effective_message)
        lines: list[str] = []
        for owner in self.owners:
            lines.extend(await owner.status_lines(chat_of(chat), thread))
        if not lines:
            lines.append("No runs in this chat. /help")
        midnight = time.mktime((*time.localtime()[:3], 0, 0, 0, 0, 0, -1))
        today = await self.ctx.runs.spend_in_chat(chat_of(chat), since=midnight)
        if today.known:  # (an agent that reports nothing: nothing to say)
            lines.append(f"💰 Today in this chat: {today.said()}")
        walls = sandbox_state(self.ctx.settings)
        if not walls.confined and self.ctx.settings.sandbox == "off":
            lines.append(
                "⚠️ Agents run unconfined here: the sandbox is switched off, so an agent can "
                "read the bot's database and settings."
            )
        elif not walls.confined:
            lines.append(
                f"⚠️ Agents cannot start here: their sandbox is not available ({walls.detail})."
                " An admin can run turnstile doctor for the fix."
            )
        await self.ctx.replies.reply(update, "\n".join(lines))

    async def cmd_pending(self, update: Update, args: list[str]) -> None:
        """What waits for the person asking: gates, tool calls, the agents' questions."""
        chat = update.effective_chat
        user = update.effective_user
        assert chat is not None
        assert user is not None
        items: list[str] = []
        for owner in self.owners:
            items.extend(await owner.pending_for(user.id, chat_of(chat)))
        if not items:
            await self.ctx.replies.reply(update, "Nothing waits for you. /status")
            return
        head = "1 thing waits" if len(items) == 1 else f"{len(items)} things wait"
        await self.ctx.replies.reply(update, "\n\n".join([f"{head} for you:", *items]))

    # -- /tasks and /audit -------------------------------------------------------------

    async def cmd_tasks(self, update: Update, args: list[str]) -> None:
        message = update.effective_message
        chat = update.effective_chat
        assert chat is not None
        thread = thread_of(message)
        await self._show_tasks(chat_of(chat), thread, str(update.update_id), 0)

    async def on_page(self, update: Update, data: str) -> None:
        chat = update.effective_chat
        assert chat is not None
        ref, _, page = data.partition(":")[2].rpartition(":")
        await self.ctx.replies.answer(update)
        # isdigit() alone admits "²", which int() refuses.
        number = int(page) if page.isascii() and page.isdigit() else 0
        await self._show_tasks(chat_of(chat), None, ref, number)

    async def _show_tasks(
        self, chat_id: PlaceId, thread: PlaceId | None, ref: str, page: int
    ) -> None:
        ctx = self.ctx
        rows = [row for group in await ctx.gates.list_tasks() for row in _task_rows(group)]
        tasks = [t for t, _ in rows if t is not None]
        # A drive holds a running autopilot run (in the bot, a terminal or on a worker).
        driven = {
            r.task
            for r in await ctx.runs.list_runs(status=RunStatus.RUNNING)
            if r.mode == "autopilot" and r.task is not None
        }
        states = [_state_of(t, driven) for t in tasks]
        pages = max(1, (len(rows) + _PAGE - 1) // _PAGE)
        page = min(max(page, 0), pages - 1)
        shown = rows[page * _PAGE : (page + 1) * _PAGE]
        # What the shown tasks cost: asked for this page's tasks only.
        spend = await ctx.runs.spend_of_tasks([t.name for t, _ in shown if t is not None])
        now = time.time()
        lines: list[str] = []
        for task, indent in shown:
            if task is None:
                lines.append(indent)
                continue
            record = await ctx.gates.store.find(task.name)
            owner = (
                ctx.publisher.people.name(int(record.started_by))
                if record is not None and record.started_by and record.started_by.isdigit()
                else None
            )
            lines += _task_lines(
                task, indent, _state_of(task, driven), owner, now, spend.get(task.name)
            )
        if not tasks:
            text = "📋 No tasks yet. /autopilot TASK starts one."
        else:
            head = _summary(len(tasks), states)
            if pages > 1:
                head.append(f"page {page + 1} of {pages}")
            text = "\n".join([*head, "", *lines])
        buttons = []
        if page > 0:
            buttons.append({"text": "◀ previous", "callback_data": f"tk:{ref}:{page - 1}"})
        if page < pages - 1:
            buttons.append({"text": "next ▶", "callback_data": f"tk:{ref}:{page + 1}"})
        live_ref = f"tasks:{ref}"
        existing = await ctx.store.get_live(live_ref)
        await ctx.publisher.live(
            live_ref,
            text,
            chat_id=existing.chat_id if existing else chat_id,
            thread_id=existing.thread_id if existing else thread,
            markup={"inline_keyboard": [buttons]} if buttons else None,
        )

    async def cmd_audit(self, update: Update, args: list[str]) -> None:
        ctx = self.ctx
        report = await ctx.gates.audit()
        lines = [f"🔎 Audit of {report.tasks} task(s): {len(report.findings)} finding(s)"]
        lines.extend(f"- {f.task}: {f.kind.value}: {f.detail}" for f in report.findings[:40])
        entries = await ctx.store.audit_entries(limit=200)
        refusals = [e for e in entries if e.outcome == "refused"]
        undelivered = [e for e in entries if e.action == "deliver" and e.outcome == "failed"]
        if undelivered:
            lines.append(
                f"Undelivered messages (latest {min(len(undelivered), 10)} of {len(undelivered)}):"
            )
            lines.extend(f"- chat {e.chat_id}: {e.reason}" for e in undelivered[:10])
        if refusals:
            lines.append(f"Bot refusals (latest {min(len(refusals), 10)} of {len(refusals)}):")
            here = chat_of(update.effective_chat) if update.effective_chat else None
            for e in refusals[:10]:
                who = ctx.publisher.people.name(e.user_id)
                where = "here" if e.chat_id == here else f"in chat {e.chat_id}"
                reason = (e.reason or "").replace(f"{e.action} needs ", "needs the ", 1)
                if reason.startswith("needs the ") and "role" not in reason.split(";")[0]:
                    head, _, rest = reason.partition(";")
                    reason = f"{head} role" + (f";{rest}" if rest else "")
                doing = _DOINGS.get(e.action, e.action.replace("_", " "))
                lines.append(f"- {who} {where}: {doing}, refused: {reason}")
        await ctx.replies.reply(update, "\n".join(lines))


# What a refused action was, as the audit says it.
_DOINGS: Final = {
    "chat": "binding a chat session",
    "prompt": "prompting the agent",
    "start_run": "starting a run",
    "steer": "steering a run",
    "stop": "stopping a run",
    "status": "asking for the status",
    "approve": "approving",
    "reject": "rejecting",
    "tasks": "listing the tasks",
    "audit": "reading the audit",
    "budget": "raising a budget",
    "permissions": "setting the permissions",
    "answer": "answering the agent",
    "pause": "pausing a run",
    "help": "asking for help",
    "tool_approval": "deciding a tool call",
}

# A task's state on the board: its icon, and how the summary counts it.
_WAITING, _RUNNING, _IDLE, _PERSON, _DONE = "waiting", "running", "idle", "person", "done"
_ICONS: Final = {_WAITING: "🛂", _RUNNING: "⏳", _IDLE: "💤", _PERSON: "✋", _DONE: "✅"}
_COUNTED: Final = {
    _WAITING: "wait for approval",
    _RUNNING: "running",
    _IDLE: "idle",
    _PERSON: "need a person",
    _DONE: "done",
}
# A phone shows about this many characters a line.
_PHONE: Final = 35


def _state_of(task: Any, driven: set[str]) -> str:
    """Waiting for approval, running (a drive holds it), idle, needing a person, or done."""
    if task.sub_state == "awaiting_approval":
        return _WAITING
    if task.phase == "complete":
        return _DONE
    if task.phase == "human_intervention":
        return _PERSON
    return _RUNNING if task.name in driven else _IDLE


def _summary(count: int, states: list[str]) -> list[str]:
    """ "📋 12 tasks: 2 wait for approval, 1 running, 9 done", wrapped for a phone."""
    parts = [f"{states.count(s)} {said}" for s, said in _COUNTED.items() if s in states]
    text = f"📋 {count} task{'s' if count != 1 else ''}: " + ", ".join(parts)
    return textwrap.wrap(text, _PHONE)


def _age(seconds: float) -> str:
    """How long ago, in the fewest characters: ``40s``, ``5m``, ``3h``, ``2d``."""
    whole = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if whole >= size:
            return f"{whole // size}{unit}"
    return f"{whole}s"


def _task_lines(
    task: Any, indent: str, state: str, owner: str | None, now: float, spend: Spend | None
) -> list[str]:
    """Short lines a phone shows whole (two, mostly): the state's icon and the name, then
    the phase, who started it, how long since it last moved, and what it cost."""
    facts = [words(task.phase, icon=False)]
    if owner:
        facts.append(owner if len(owner) <= 10 else owner[:9] + "…")
    facts.append(_age(now - task.updated_at))
    if spend is not None and spend.cost_usd is not None:
        facts.append(spend.cost_text())
    if task.revision_notes:
        facts.append("notes")
    pad = " " * (len(indent) + 2)
    lines = [f"{indent}{_ICONS[state]} {task.name}", pad + facts[0]]
    for fact in facts[1:]:  # packed into as few lines as a phone shows whole
        if len(lines[-1]) + 3 + len(fact) <= _PHONE:
            lines[-1] += " · " + fact
        else:
            lines.append(pad + fact)
    return lines


def _task_rows(group: TaskGroup) -> list[tuple[Any, str]]:
    """A group's lines to be: (its task, the indent), or (None, the group's name)."""
    rows: list[tuple[Any, str]] = [
        (group.task, "") if group.task is not None else (None, group.name)
    ]
    for wave in sorted(group.waves):
        rows += [(t, "↳ ") for t in group.waves[wave]]
    return rows
