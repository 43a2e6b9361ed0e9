"""Chat sessions from a chat: ``/chat [agent] [project]``, then every plain message a turn.

The sessions themselves (queue, runs, parking) are the engine's chat mode
(:class:`engine.chats.sessions.ChatSessions`); this feature binds chats, queues their
messages, and stops and reports their runs.
"""

from __future__ import annotations

import logging
import re
import shlex
from typing import Any, Final

from telegram import Update

from bot.context import BotContext
from bot.feature import Feature
from bot.handlers import Dispatch
from bot.places import chat_of
from bot.replies import thread_of
from chatfront.auth import Action
from chatfront.progress import STOP_DATA
from chatfront.store import Binding, LiveMessage
from engine.agents.factory import AGENT_NAMES
from engine.agents.registry import agent_spec, installed_agents
from engine.chats.sessions import ChatRun
from engine.errors import ConfigError, NotFoundError
from engine.runs.spec import PlaceId
from engine.settings import Settings
from engine.workspace import WorkspaceManager
from engine.workspace.manager import DEFAULT_PROJECT, RESERVED_FOLDERS
from engine.workspace.runs import worktree_summaries

__all__ = ["ChatFeature"]

_LOGGER = logging.getLogger(__name__)


_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_BRANCH: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,99}")
_MODEL: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/\[\]-]{0,99}")
_CHAT_USAGE: Final = "Usage: /chat [agent] [project[@branch]]"
# How a person continues a session in a terminal, per agent CLI ({bin} {id}).
_RESUME: Final = {
    "claude": "{bin} --resume {id}",
    "copilot": "{bin} --resume={id}",
    "codex": "{bin} resume {id}",
}


def project_names(settings: Settings) -> list[str]:
    """What ``/chat`` and ``/project`` accept: ``default`` (the chat's own workspace), the
    configured projects (``TURNSTILE_PROJECTS``), and folders already under the workspaces
    root."""
    manager = WorkspaceManager.from_settings(settings)
    names = [DEFAULT_PROJECT, *(p.name for p in manager.projects)]
    if manager.root.is_dir():
        names += sorted(
            p.name
            for p in manager.root.iterdir()
            if p.is_dir() and p.name not in RESERVED_FOLDERS and not p.name.startswith(".")
        )
    return list(dict.fromkeys(names))


def configured_project(settings: Settings, project: str) -> bool:
    """Whether ``project`` is configured (a git worktree of its own, a branch to pick)."""
    return project in {p.name for p in WorkspaceManager.from_settings(settings).projects}


def project_words(settings: Settings, project: str, thread: PlaceId | None) -> str:
    """Where a chat's runs work, in words: ``project web``, or for ``default`` (unless a
    configured project has that name) ``this chat's own workspace`` (a topic's)."""
    if project == DEFAULT_PROJECT and not configured_project(settings, project):
        return f"this {'topic' if thread else 'chat'}'s own workspace"
    return f"project {project}"


# callback_data of the button under a cut-off chat turn: "rr:" + its run id + ":" + its
# turn (well under Telegram's 64 bytes); its notice is the live message rerun_ref names.
RERUN_DATA: Final = "rr:"


def rerun_ref(run_id: str, seq: int) -> str:
    """The live message telling a chat that turn ``seq`` of ``run_id`` was cut off."""
    return f"rerun:{run_id}:{seq}"


def rerun_markup(run_id: str, seq: int) -> dict[str, Any]:
    """The one button under that notice: run the cut-off turn's prompt again."""
    data = f"{RERUN_DATA}{run_id}:{seq}"
    return {"inline_keyboard": [[{"text": "🔁 Run it again", "callback_data": data}]]}


class ChatFeature(Feature):
    """Binds chats to agent sessions and turns their plain messages into turns."""

    def __init__(self, ctx: BotContext) -> None:
        self.ctx = ctx

    def register(self, dispatch: Dispatch) -> None:
        dispatch.command("chat", Action.CHAT, self.cmd_chat)
        dispatch.command("agent", Action.CHAT, self.cmd_agent, usage=self._usage("agent"))
        dispatch.command("model", Action.CHAT, self.cmd_model)
        dispatch.command("project", Action.CHAT, self.cmd_project, usage=self._usage("project"))
        dispatch.command("new", Action.CHAT, self.cmd_new)
        # The ⏹ Stop button of a turn's progress message (chatfront.progress).
        dispatch.buttons(rf"^{STOP_DATA}", Action.STOP, self.on_stop_button)
        dispatch.buttons(rf"^{RERUN_DATA}", Action.PROMPT, self.on_rerun_button)
        # Registered after the other features: a text none of them took is a turn.
        dispatch.text(self.on_text)

    # -- what may be chosen ------------------------------------------------------------

    def _installed(self) -> tuple[str, ...]:
        return installed_agents(self.ctx.settings)

    def _choices(self) -> str:
        installed = ", ".join(self._installed()) or "none"
        projects = ", ".join(project_names(self.ctx.settings))
        return f"Agents installed here: {installed}. Projects: {projects}."

    def _usage(self, what: str) -> str:
        if what == "agent":
            return "Usage: /agent NAME. " + self._choices()
        return "Usage: /project NAME[@branch]. " + self._choices()

    def _agent_problem(self, agent: str) -> str | None:
        if agent not in AGENT_NAMES:
            return f"There is no agent {agent!r}. {self._choices()}"
        # On the workers, a worker with the agent's CLI takes the turns.
        return self.ctx.chats.agents.agent_problem(agent)

    def _project_problem(self, project: str, branch: str | None) -> str | None:
        if not _NAME.fullmatch(project) or project not in project_names(self.ctx.settings):
            return (
                f"There is no project {project!r} here (an admin adds projects in "
                f"TURNSTILE_PROJECTS). {self._choices()}"
            )
        if branch is not None:
            if not _BRANCH.fullmatch(branch) or ".." in branch:
                return f"{branch!r} is not a branch name."
            if not configured_project(self.ctx.settings, project):
                return (
                    f"{project} is a plain folder, not a configured project: it has no "
                    "branches to choose from."
                )
        return None

    # -- commands ----------------------------------------------------------------------

    async def cmd_chat(self, update: Update, args: list[str]) -> None:
        agent: str = self.ctx.settings.default_agent
        rest = list(args)
        if rest and rest[0] in AGENT_NAMES:
            agent = rest.pop(0)
        target = rest.pop(0) if rest else DEFAULT_PROJECT
        if rest:
            await self.ctx.replies.reply(update, f"{_CHAT_USAGE}. {self._choices()}")
            return
        project, _, branch = target.partition("@")
        await self._bind(update, agent=agent, project=project, branch=branch or None)

    async def cmd_agent(self, update: Update, args: list[str]) -> None:
        binding = await self._binding(update)
        project = binding.project if binding is not None else DEFAULT_PROJECT
        if len(args) != 1:
            await self.ctx.replies.reply(update, self._usage("agent"))
            return
        # Another CLI cannot resume this session: a new one, and the model goes back to
        # the agent's default (a model name belongs to one CLI).
        await self._bind(update, agent=args[0], project=project, branch=None)

    async def cmd_project(self, update: Update, args: list[str]) -> None:
        binding = await self._binding(update)
        if len(args) != 1:
            await self.ctx.replies.reply(update, self._usage("project"))
            return
        project, _, branch = args[0].partition("@")
        await self._bind(
            update,
            agent=binding.agent if binding is not None else self.ctx.settings.default_agent,
            project=project,
            branch=branch or None,
            model=binding.model if binding is not None else None,
        )

    async def cmd_new(self, update: Update, args: list[str]) -> None:
        binding = await self._binding(update)
        if binding is None:
            await self.ctx.replies.reply(
                update, "This chat has no agent session yet: /chat starts one."
            )
            return
        await self._bind(
            update,
            agent=binding.agent,
            project=binding.project,
            branch=None,
            model=binding.model,
            fresh=True,
        )

    async def cmd_model(self, update: Update, args: list[str]) -> None:
        ctx = self.ctx
        chat = update.effective_chat
        assert chat is not None
        binding = await self._binding(update)
        if binding is None:
            await ctx.replies.reply(
                update, "This chat has no agent session yet: /chat starts one, then /model."
            )
            return
        if not args:
            current = binding.model or ctx.settings.agent_model or "the agent's default"
            await ctx.replies.reply(
                update,
                f"Model here: {current}. /model NAME sets one for this chat (kept across "
                "restarts); /model default goes back to the agent's default.",
            )
            return
        name = args[0]
        if len(args) != 1 or not _MODEL.fullmatch(name):
            await ctx.replies.reply(update, "Usage: /model NAME (letters, digits, . _ : / -)")
            return
        model = None if name == "default" else name
        try:
            await ctx.chats.set_model(chat_of(chat), binding.thread_id, model)
        except ConfigError as exc:
            await ctx.replies.reply(update, f"Not changed: {exc}")
            return
        await self.ctx.replies.audited(update, "model", name)
        await ctx.replies.reply(
            update,
            f"🧠 Model for this {binding.agent} session: {model or 'the agent default'}, "
            "from the next message on (the same session goes on).",
        )

    async def _binding(self, update: Update) -> Binding | None:
        chat = update.effective_chat
        assert chat is not None
        return await self.ctx.store.binding(chat_of(chat), thread_of(update.effective_message))

    async def _bind(
        self,
        update: Update,
        *,
        agent: str,
        project: str,
        branch: str | None,
        model: str | None = None,
        fresh: bool = False,
    ) -> None:
        ctx = self.ctx
        chat = update.effective_chat
        user = update.effective_user
        assert chat is not None
        assert user is not None
        problem = self._agent_problem(agent) or self._project_problem(project, branch)
        if problem is not None:
            await ctx.replies.reply(update, problem)
            return
        thread = thread_of(update.effective_message)
        try:
            binding = await ctx.chats.bind(
                chat_of(chat),
                thread,
                agent=agent,
                project=project,
                user_id=user.id,
                model=model,
                branch=branch,
            )
        except ConfigError as exc:
            await ctx.replies.reply(update, f"Cannot bind: {exc}")
            return
        where = project_words(ctx.settings, project, thread) + (
            f", branch {branch}" if branch else ""
        )
        await self.ctx.replies.audited(update, "chat", f"{agent} {where}")
        place = "topic" if thread else "chat"
        head = (
            f"🆕 A fresh {agent} session here ({where})"
            if fresh
            else f"🔗 This {place} is bound to a new {agent} session ({where})"
        )
        await ctx.replies.reply(
            update,
            f"{head}. Every message is now one turn; replies come back here.",
        )
        _LOGGER.info(
            "chat bound", extra={"chat_id": chat_of(chat), "session_id": binding.session_id}
        )

    async def on_text(self, update: Update, text: str, thread: PlaceId | None) -> bool:
        ctx = self.ctx
        message = update.message
        chat = update.effective_chat
        user = update.effective_user
        assert message is not None
        assert chat is not None
        assert user is not None
        active = ctx.chats.active.get((chat_of(chat), thread))
        binding = active.binding if active is not None else None
        if binding is None:
            binding = await ctx.store.binding(chat_of(chat), thread)
        if binding is None:
            # In a group with privacy mode off, not every message is for us: hint only in
            # a private chat or in answer to one of our messages.
            to_us = chat.type == "private" or (
                message.reply_to_message is not None
                and message.reply_to_message.from_user is not None
                and message.reply_to_message.from_user.id == ctx.bot.id
            )
            if to_us and ctx.replies.allowed(user.id, chat_of(chat), Action.PROMPT):
                await ctx.replies.reply(
                    update, "This chat is not bound to an agent session yet: send /chat first."
                )
            return True
        if not await ctx.replies.authorize(update, Action.PROMPT):
            return True
        try:
            result = await ctx.chats.submit(
                chat_of(chat), thread, update_id=update.update_id, user_id=user.id, text=text
            )
        except ConfigError as exc:
            # The message is queued; the agent could not start (no sandbox here, say): say
            # why, and the message runs once the agent can start.
            ctx.handled_in_transaction(update.update_id)
            await ctx.replies.reply(
                update, f"⛔ The agent could not start: {exc}. Your message waits in the queue."
            )
            return True
        ctx.handled_in_transaction(update.update_id)
        if result.steered:
            await ctx.replies.reply(update, "↪️ Sent to the running turn: the agent has it now.")
        elif not result.queued:
            await ctx.replies.reply(
                update,
                f"⚠️ Not queued: {result.waiting} message(s) are already waiting for this "
                f"session (limit {ctx.settings.queue_depth}). Send it again once the "
                "queue has room.",
            )
        elif result.busy or result.waiting:
            await ctx.replies.reply(
                update, f"⏳ Queued: {result.waiting + 1} message(s) wait for the running turn."
            )
        return True

    async def on_rerun_button(self, update: Update, data: str) -> None:
        """🔁 Run it again, under a turn a crash cut off: its prompt becomes the session's
        next turn, once; the button goes whatever happens."""
        ctx = self.ctx
        chat = update.effective_chat
        user = update.effective_user
        assert chat is not None
        assert user is not None
        run_id, _, seq = data.removeprefix(RERUN_DATA).rpartition(":")
        ref = rerun_ref(run_id, int(seq)) if seq.isdigit() else ""
        live = await ctx.store.get_live(ref) if ref else None
        if live is None or live.chat_id != chat_of(chat) or live.markup is None:
            await ctx.replies.answer(update, "This button was already used.")
            return
        try:
            run = await ctx.runs.get_run(run_id)
        except NotFoundError:
            run = None
        cut = [t for t in await ctx.runs.turns(run_id) if t.seq == int(seq)] if run else []
        thread = thread_of(update.effective_message)
        binding = await ctx.store.binding(chat_of(chat), thread)
        by = ctx.publisher.people.name(user.id)
        if run is None or not cut or binding is None or binding.session_id != run.session_id:
            # /new, /agent or /chat started another session here meanwhile (or none is
            # bound): that one never saw the turn, so nothing runs on its own.
            await self._settle_rerun(
                live,
                "🔁 Not run again: its session is gone (another one is bound here now). "
                "Send the prompt again to run it in this chat's session.",
            )
            await ctx.replies.answer(update, "Its session is gone: send the prompt again.")
            return
        await self._settle_rerun(live, f"🔁 Run again by {by}: the answer follows.")
        await ctx.replies.audited(update, "rerun", f"{run_id} turn {seq}")
        await ctx.replies.answer(update, "Running it again…")
        try:
            await ctx.chats.submit(
                chat_of(chat),
                thread,
                update_id=update.update_id,
                user_id=user.id,
                text=cut[-1].prompt,
            )
        except ConfigError as exc:
            await ctx.publisher.say(
                chat_of(chat),
                f"⛔ The agent could not start: {exc}. The turn waits in the queue.",
                thread_id=thread,
            )

    async def _settle_rerun(self, live: LiveMessage, said: str) -> None:
        """The notice keeps its text, says what the press did, and loses its button."""
        await self.ctx.store.set_live(
            live.ref,
            chat_id=live.chat_id,
            thread_id=live.thread_id,
            body=f"{live.body}\n{said}",
            entities=live.entities,
            markup=None,
        )
        self.ctx.publisher.wake()

    # -- stop and status ---------------------------------------------------------------

    async def on_stop_button(self, update: Update, data: str) -> None:
        chat = update.effective_chat
        user = update.effective_user
        assert chat is not None
        assert user is not None
        run = self.ctx.chats.find(data.removeprefix(STOP_DATA))
        if run is None or run.binding.chat_id != chat_of(chat) or not run.busy:
            await self.ctx.replies.answer(update, "Nothing is running there any more.")
            return
        await self.ctx.replies.answer(update, "Stopping…")
        await self.ctx.replies.audited(update, "stop", run.run_id)
        await self.ctx.chats.stop(run, user.id)

    async def stop(self, run_id: str, *, chat_id: PlaceId, by: int) -> bool:
        run = self.ctx.chats.find(run_id)
        # An idle session has nothing to stop: it stays bound and waits for the next message.
        if run is None or run.binding.chat_id != chat_id or not await self._working(run):
            return False
        await self.ctx.chats.stop(run, by)
        return True

    async def stop_chat(self, chat_id: PlaceId, thread: PlaceId | None, *, by: int) -> list[str]:
        run = self.ctx.chats.active.get((chat_id, thread))
        if run is None or not await self._working(run):
            return []
        await self.ctx.chats.stop(run, by)
        return [run.run_id]

    async def _working(self, run: ChatRun) -> bool:
        """A turn runs, or a message waits to become one (an idle session is not stopped)."""
        return run.busy or bool(await self.ctx.store.queued_count(*run.key))

    async def status_lines(self, chat_id: PlaceId, thread: PlaceId | None) -> list[str]:
        ctx = self.ctx
        binding = await ctx.store.binding(chat_id, thread)
        if binding is None:
            return []
        queued = await ctx.store.queued_count(chat_id, thread)
        run = ctx.chats.active.get((chat_id, thread))
        # The lines under the head: the running turn and its elapsed time (and the last
        # tool event), or idle.
        state = " · ".join(run.status_text().splitlines()[1:]) if run is not None else "idle"
        model = f" · model {binding.model}" if binding.model else ""
        warm = " · warm" if run is not None and getattr(run.agent, "resident", False) else ""
        lines = [
            f"💬 chat session · {binding.agent}{model}{warm} · {binding.project} · "
            f"{binding.turns} turn(s) · {state} · queue {queued}"
        ]
        if not binding.workdir:
            # On the workers: the worktree and the agent's session are on a worker's disk.
            worker = await ctx.chats.agents.where(binding)
            lines.append(
                f"   🖥 on the workers · last turn on worker {worker}"
                if worker
                else "   🖥 on the workers · no turn yet"
            )
            return lines
        session_id = run.agent.session_id if run is not None else binding.session_id
        resume = self._resume_command(binding, session_id)
        if resume is not None:
            lines.append(f"   ↪️ continue in a terminal: {resume}")
        # The session's worktree (a configured project): its branch and disk usage.
        worktree = await worktree_summaries(
            ctx.settings, ctx.db, {binding.session_id: binding.workdir}
        )
        if binding.session_id in worktree:
            lines.append(f"   🌿 {worktree[binding.session_id]}")
        return lines

    def _resume_command(self, binding: Binding, session_id: str) -> str | None:
        """``cd WORKDIR && CLI --resume ID``, once the session has a turn to resume."""
        shape = _RESUME.get(binding.agent)
        if shape is None or binding.turns == 0:
            return None
        binary = agent_spec(binding.agent).configured(self.ctx.settings) or binding.agent
        command = shape.format(bin=shlex.quote(binary), id=shlex.quote(session_id))
        return f"cd {shlex.quote(binding.workdir)} && {command}"
