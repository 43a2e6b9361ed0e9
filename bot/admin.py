"""Help, ``/status``, ``/stop``, and the admins' ``/tasks`` and ``/audit``.

``/stop`` and ``/status`` ask every feature that owns runs (chat sessions, auto mode,
autopilot, tool approvals) for its part, in a fixed order.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Final

from telegram import BotCommand, Update

from bot.context import BotContext
from bot.feature import Feature
from bot.handlers import Dispatch
from bot.replies import thread_of
from chatfront.auth import Action
from engine.agents.registry import installed_agents
from engine.gates.listing import TaskGroup
from engine.humane import words
from engine.sandbox import sandbox_state
from engine.spend import Spend
from engine.store.runs import RunRecord, RunStatus

__all__ = ["COMMANDS", "HELP", "AdminFeature"]

_PAGE: Final = 25

COMMANDS: Final = [
    BotCommand("help", "what this bot does and who may do what"),
    BotCommand("chat", "[agent] [project[@branch]] — bind this chat or topic to an agent session"),
    BotCommand("agent", "NAME — a new session of another agent here"),
    BotCommand("model", "[NAME] — this chat's model (default: the agent's own)"),
    BotCommand("project", "NAME[@branch] — a new session on another project"),
    BotCommand("new", "a fresh session (same agent, project and model)"),
    BotCommand("auto", "[--budget USD] [--permissions P] OBJECTIVE — start an auto-mode run"),
    BotCommand("steer", "TEXT — an instruction for the running auto-mode run"),
    BotCommand("autopilot", "TASK — start or resume the gated workflow of a task"),
    BotCommand("approve", "[TASK] — approve the open gate"),
    BotCommand("reject", "TASK REASON — reject the open gate with a reason"),
    BotCommand("cancel", "drop the Reject that waits for your reason"),
    BotCommand("stop", "[RUN] — stop the running turn at once"),
    BotCommand("pause", "[RUN] — the run finishes what it is doing, then waits"),
    BotCommand("resume", "[RUN] — a paused run goes on"),
    BotCommand("status", "this chat's runs"),
    BotCommand("get", "PATH [RUN] — a file (a folder as a zip) of this chat's last run"),
    BotCommand("diff", "[RUN] — what this chat's last run changed, the patch as a document"),
    BotCommand("web", "the board of runs and tasks in a browser (in a private chat)"),
    BotCommand("permissions", "[guarded|trusted|free|default] — what tool calls ask here"),
    BotCommand("tasks", "every task's state (admin)"),
    BotCommand("audit", "the audit's findings (admin)"),
]

HELP: Final = "\n".join(
    [
        "turnstile drives coding agents turn by turn, with approval gates.",
        "",
        "Chat sessions",
        "/chat [agent] [project[@branch]] — bind this chat (or topic) to a new agent"
        " session; then every message is one turn. Agents installed here: {agents}."
        " Without a project, this chat (or topic) works in a workspace of its own, which"
        " no other chat sees; each /auto run gets a git worktree of it.",
        "/agent NAME · /project NAME[@branch] · /new — a new session with another agent,"
        " on another project, or just a fresh one. /model NAME — this chat's model, kept"
        " across restarts (/model default undoes it). /status shows how to continue the"
        " session from a terminal.",
        "",
        "Runs",
        "/auto [--budget USD] [--permissions P] OBJECTIVE — auto mode: clarify, plan,"
        " execute until verified done; with a budget it stops after the turn that spends"
        " it. Messages (or /steer TEXT) become instructions for the next execute turn.",
        "/autopilot TASK — the gated workflow; each approval gate posts the artifact with"
        " Approve / Reject buttons.",
        "/approve [TASK] · reply APPROVED to a gate message · /reject TASK REASON",
        "/cancel — drop a Reject button press whose reason you have not sent yet.",
        "/stop [RUN] — stop the running turn now; the run ends stopped.",
        "/pause [RUN] — the run finishes the tool call (or turn) it is in, then waits,"
        " keeping its place; /resume [RUN] or its ▶ Go on button lets it go on.",
        "/status — this chat's runs. /tasks, /audit — admins.",
        "/web — in a private chat: the board of every run and task, with their timelines,"
        " changes and gates, as a Mini App or in a browser.",
        "",
        "Files",
        "Send a file or photo (an album is one turn): it is saved in the run's folder under"
        " uploads/ and the caption is the prompt. Voice notes are transcribed into the"
        " prompt. /get PATH sends a file of the run's folder (a folder as a zip).",
        "/diff [RUN] — what the chat's last run (or RUN) changed; /get PATH RUN works too.",
        "",
        "Tool approvals — {tool_approval}. When on, a Claude Code session asks here"
        " before a tool call: Allow once, Allow for this session, or Deny; the turn"
        " waits. /permissions guarded (every change asks), trusted (only destructive or"
        " outward actions ask) or free (nothing asks, still sandboxed) sets it for this"
        " chat (admins). Deleting outside the project, a force push to the default branch,"
        " a script piped from the internet and reading secret files always ask. With"
        " approvals on, the agent may also ask you a question here: answer with a button"
        " or a reply (operators). Copilot CLI and Codex cannot ask: their allowed tools"
        " alone decide.",
        "",
        "Rights: operators chat, start, steer, pause, stop and answer the agent's"
        " questions; approvers approve and reject; admins"
        " everything. Your id: {user_id}.",
    ]
)

_APPROVAL_HELP: Final = {
    "off": "off here: only the allowed tools run",
    "unlisted": "on here for tools outside the allowed list",
    "all": "on here for every tool call",
    "guarded": "guarded here: every tool call that changes something asks",
    "trusted": "trusted here: only destructive or outward actions ask",
    "free": "free here: nothing asks but the catastrophic",
}


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
        dispatch.command("stop", Action.STOP, self.cmd_stop)
        dispatch.command("status", Action.STATUS, self.cmd_status)
        dispatch.command("tasks", Action.TASKS, self.cmd_tasks)
        dispatch.command("audit", Action.AUDIT, self.cmd_audit)
        dispatch.buttons(r"^tk(:|\Z)", Action.TASKS, self.on_page)
        dispatch.buttons(rf"^{_PICK}[A-Za-z0-9_:.-]{{1,60}}\Z", Action.STOP, self.on_pick)

    async def cmd_help(self, update: Update, args: list[str]) -> None:
        user = update.effective_user
        await self.ctx.replies.reply(
            update,
            HELP.format(
                agents=", ".join(installed_agents(self.ctx.settings)) or "none",
                user_id=user.id if user else "?",
                tool_approval=_APPROVAL_HELP[self.ctx.settings.tool_approval],
            ),
        )

    async def cmd_stop(self, update: Update, args: list[str]) -> None:
        chat = update.effective_chat
        user = update.effective_user
        assert chat is not None
        assert user is not None
        thread = thread_of(update.effective_message)
        here = [
            r.id
            for r in await self.ctx.runs.list_runs(status=RunStatus.RUNNING)
            if r.chat_id == chat.id
        ]
        wanted = args[0] if args else None
        if wanted is not None and wanted not in here:
            # a run may be named by the end of its id ("/stop 4a37b")
            ending = [run_id for run_id in here if run_id.endswith(wanted)]
            wanted = ending[0] if len(ending) == 1 else wanted
        if wanted is None:
            working = await self._working_here(chat.id, thread)
            if len(working) > 1:  # which one? one button per run, and one for all
                await self._ask_which(update, working, thread)
                return
        stopped = await self._stop(chat.id, thread, wanted, by=user.id)
        if not stopped and wanted is None:
            await self.ctx.replies.reply(update, "Nothing is running here.")
        elif not stopped and wanted in here:
            await self.ctx.replies.reply(update, f"Run {wanted} is idle: nothing to stop.")
        elif not stopped:
            listed = f" Running here: {', '.join(here)}." if here else " Nothing runs here."
            await self.ctx.replies.reply(
                update, f"No run {args[0]} here.{listed} /status lists this chat's runs."
            )

    async def _stop(self, chat_id: int, thread: int, run_id: str | None, *, by: int) -> list[str]:
        """Stop ``run_id`` (None: every run of the place); returns what was stopped."""
        stopped: list[str] = []
        for owner in self.owners:
            if run_id is not None:
                if await owner.stop(run_id, chat_id=chat_id, by=by):
                    stopped.append(run_id)
            else:
                stopped.extend(await owner.stop_chat(chat_id, thread, by=by))
        return stopped

    async def _working_here(self, chat_id: int, thread: int) -> list[RunRecord]:
        """The runs of this chat or topic that a stop would stop (not an idle session)."""
        found = []
        for run in await self.ctx.runs.list_runs(status=RunStatus.RUNNING):
            if run.chat_id != chat_id or (run.thread_id or 0) != thread or run.parent_id:
                continue
            if run.mode == "chat":
                chat_run = self.ctx.chats.find(run.id)
                queued = await self.ctx.store.queued_count(chat_id, thread)
                if chat_run is None or not (chat_run.busy or queued):
                    continue
            found.append(run)
        return found

    async def _ask_which(self, update: Update, runs: list[RunRecord], thread: int) -> None:
        chat = update.effective_chat
        message = update.effective_message
        assert chat is not None
        rows = [
            [{"text": f"⏹ {_run_label(run)}", "callback_data": f"{_PICK}{run.id}"}] for run in runs
        ]
        rows.append([{"text": "⏹ all of them", "callback_data": f"{_PICK}all:{thread}"}])
        await self.ctx.publisher.live(
            f"{_PICK_REF}{update.update_id}",
            f"{len(runs)} runs are working here. Which one should stop?",
            chat_id=chat.id,
            thread_id=thread or None,
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
            thread = int(choice.removeprefix("all:"))
        else:
            run_id, thread = choice, thread_of(message)
        stopped = await self._stop(chat.id, thread, run_id, by=user.id)
        await self.ctx.store.audit(
            action="stop",
            outcome="allowed",
            user_id=user.id,
            chat_id=chat.id,
            update_id=update.update_id,
            reason=", ".join(stopped) or "nothing left to stop",
        )
        name = self.ctx.publisher.people.name(user.id)
        said = (
            f"⏹ {name} stopped {', '.join(stopped)}."
            if stopped
            else "Nothing of that runs any more."
        )
        await self.ctx.replies.answer(update, said[:190])
        live = (
            await self.ctx.store.live_by_message(chat.id, message.message_id)
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
            lines.extend(await owner.status_lines(chat.id, thread))
        if not lines:
            lines.append("No runs in this chat. /help")
        midnight = time.mktime((*time.localtime()[:3], 0, 0, 0, 0, 0, -1))
        today = await self.ctx.runs.spend_in_chat(chat.id, since=midnight)
        if today.known:  # (an agent that reports nothing: nothing to say)
            lines.append(f"💰 Today in this chat: {today.line().removeprefix('Spend: ')}")
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

    # -- /tasks and /audit -------------------------------------------------------------

    async def cmd_tasks(self, update: Update, args: list[str]) -> None:
        message = update.effective_message
        chat = update.effective_chat
        assert chat is not None
        thread = message.message_thread_id if message and message.is_topic_message else None
        await self._show_tasks(chat.id, thread, str(update.update_id), 0)

    async def on_page(self, update: Update, data: str) -> None:
        chat = update.effective_chat
        assert chat is not None
        ref, _, page = data.partition(":")[2].rpartition(":")
        await self.ctx.replies.answer(update)
        # isdigit() alone admits "²", which int() refuses.
        number = int(page) if page.isascii() and page.isdigit() else 0
        await self._show_tasks(chat.id, None, ref, number)

    async def _show_tasks(self, chat_id: int, thread: int | None, ref: str, page: int) -> None:
        ctx = self.ctx
        rows = [row for group in await ctx.gates.list_tasks() for row in _task_rows(group)]
        pages = max(1, (len(rows) + _PAGE - 1) // _PAGE)
        page = min(max(page, 0), pages - 1)
        shown = rows[page * _PAGE : (page + 1) * _PAGE]
        # What the shown tasks cost: asked for this page's tasks only.
        spend = await ctx.runs.spend_of_tasks([t.name for t, _ in shown if t is not None])
        lines = [
            _task_line(t, indent, spend.get(t.name)) if t is not None else indent
            for t, indent in shown
        ]
        body = "\n".join(lines) or "No tasks yet. /autopilot TASK starts one."
        text = f"📋 Tasks, waiting for approval first · page {page + 1} of {pages}\n{body}"
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
            here = update.effective_chat.id if update.effective_chat else None
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

_TASK_ICONS: Final = {"complete": "✅", "human_intervention": "✋"}


def _task_line(task: Any, indent: str = "", spend: Spend | None = None) -> str:
    """One short line a phone shows well: icon, name, phase in words (no columns)."""
    if task.sub_state == "awaiting_approval":
        icon, state = "🛂", f"{task.phase.replace('_', ' ')}, waiting for approval"
    else:
        icon = _TASK_ICONS.get(task.phase, "⏳")
        state = words(task.phase).removeprefix(f"{icon} ")
    line = f"{indent}{icon} {task.name} · {state}"
    if task.revision_notes:
        line += " · has revision notes"
    if spend is not None and spend.cost_usd is not None:
        line += f" · {spend.cost_text()}"
    return line


def _task_rows(group: TaskGroup) -> list[tuple[Any, str]]:
    """A group's lines to be: (its task, the indent), or (None, the group's name)."""
    rows: list[tuple[Any, str]] = [
        (group.task, "") if group.task is not None else (None, group.name)
    ]
    for wave in sorted(group.waves):
        rows += [(t, "   ↳ ") for t in group.waves[wave]]
    return rows
