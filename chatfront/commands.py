"""The chat commands, one table: what each is called, needs and does, in one line.

``/help`` shows a person the commands their roles allow, one short line each, and an
"All commands" button shows every command with the role it needs; Telegram's command
menu (bot/app.py) is made from the same table. A new command is one line here.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Final

from chatfront.auth import Action, Role, allows, needed_roles

__all__ = ["ALL_COMMANDS", "Command", "all_commands_text", "help_text"]


@dataclass(frozen=True, slots=True)
class Command:
    """One command: ``name``, the right it needs (``action``), its arguments, what it does."""

    name: str
    action: Action
    text: str
    args: str = ""

    def line(self, *, short: bool = False) -> str:
        """``/name ARGS — text``; ``short`` leaves optional arguments (``[...]``) out."""
        shown = [a for a in self.args.split() if not (short and a.startswith("["))]
        args = "".join(f" {a}" for a in shown)
        return f"/{self.name}{args} — {self.text}"


#: Every command, in the order of the menu and of /help.
ALL_COMMANDS: Final = (
    Command("help", Action.HELP, "what you may do here"),
    Command("chat", Action.CHAT, "talk to agents", "[agent] [project]"),
    Command("agent", Action.CHAT, "switch agent", "NAME"),
    Command("model", Action.CHAT, "set the model", "[NAME]"),
    Command("project", Action.CHAT, "switch project", "NAME"),
    Command("new", Action.CHAT, "a fresh session"),
    Command("auto", Action.START_RUN, "work until done", "GOAL"),
    Command("steer", Action.STEER, "guide a run", "TEXT"),
    Command("autopilot", Action.START_RUN, "a gated task", "TASK"),
    Command("approve", Action.APPROVE, "approve a gate", "[TASK]"),
    Command("reject", Action.REJECT, "reject it, saying why", "TASK REASON"),
    Command("cancel", Action.REJECT, "drop your unsent Reject"),
    Command("pending", Action.STATUS, "what waits for you"),
    Command("status", Action.STATUS, "this chat's runs"),
    Command("stop", Action.STOP, "stop a run", "[RUN]"),
    Command("pause", Action.PAUSE, "hold a run", "[RUN]"),
    Command("resume", Action.PAUSE, "go on", "[RUN]"),
    Command("get", Action.STATUS, "a run's file", "PATH [RUN]"),
    Command("diff", Action.STATUS, "a run's changes", "[RUN]"),
    Command("web", Action.HELP, "runs in a browser"),
    Command("permissions", Action.PERMISSIONS, "what tool calls ask", "[PRESET]"),
    Command("tasks", Action.TASKS, "every task's state"),
    Command("audit", Action.AUDIT, "the audit's findings"),
)

_ROLE_WORDS: Final = {
    Role.ADMIN: "an admin",
    Role.APPROVER: "an approver",
    Role.OPERATOR: "an operator",
}


def help_text(roles: Collection[Role], *, voice: bool) -> str:
    """The short help of a person with ``roles``: their commands, one line each."""
    mine = [c for c in ALL_COMMANDS if c.name != "help" and allows(roles, c.action)]
    named = " and ".join(_ROLE_WORDS[r] for r in Role if r in roles)
    lines = [f"You are {named}. Your commands:", *(c.line(short=True) for c in mine)]
    if allows(roles, Action.PROMPT):
        lines.append("Files you send are prompts" + (", voice notes too." if voice else "."))
    return "\n".join(lines)


def all_commands_text(*, agents: str, tool_approval: str, voice: bool) -> str:
    """Every command with the role it needs, and what the bot has here."""
    lines = ["All commands (the role each needs; admins may do everything):"]
    lines += [f"{c.line()} ({needed_roles(c.action)})" for c in ALL_COMMANDS]
    lines += [
        "",
        f"Agents here: {agents}. Tool approvals: {tool_approval}; Copilot CLI and Codex"
        " cannot ask: their allowed tools alone decide.",
        "/auto takes --budget USD and --permissions P before the goal; /web answers in a"
        " private chat; /model default undoes /model. Reply APPROVED to a gate message to"
        " approve it.",
        "Files and photos you send are saved under uploads/ and the caption is the prompt"
        + ("; voice notes are transcribed." if voice else "."),
    ]
    return "\n".join(lines)
