"""``turnstile chat``: one agent session driven from this terminal, a line per turn.

The terminal is one more :class:`~engine.turn.Channel`: each line read from stdin is a
turn of the same resumed session; its output is written to stdout. End of input closes
the channel after the running turn finishes; Ctrl-C pre-empts the running turn. With
``TURNSTILE_TOOL_APPROVAL`` on, the agent's tool requests are asked here: while one is
open, the next line typed answers it instead of becoming a turn.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import uuid
from collections import deque
from pathlib import Path
from typing import Any, TextIO

from engine.agents.factory import AGENT_NAMES, create_agent
from engine.approvals.policy import ApprovalPolicy
from engine.approvals.terminal import terminal_approvals, terminal_run_id
from engine.errors import TurnPreempted
from engine.settings import Settings
from engine.turn import BaseChannel, Closed, Idle, NextPrompt, Ready, TurnOutput, run_session_loop

__all__ = ["TerminalChannel", "register"]


class TerminalChannel(BaseChannel):
    """Prompts from lines pushed by a reader; outputs written to a text stream."""

    def __init__(self, out: TextIO) -> None:
        super().__init__("terminal")
        self._lines: deque[str] = deque()
        self._eof = False
        self._out = out
        self._answer: asyncio.Future[str | None] | None = None

    def push_line(self, line: str) -> None:
        if self._answer is not None and not self._answer.done():
            self._answer.set_result(line.rstrip("\n"))
            return
        if line.strip():
            self._lines.append(line.rstrip("\n"))
            self.notify_inbound()

    def end(self) -> None:
        self._eof = True
        if self._answer is not None and not self._answer.done():
            self._answer.set_result(None)
        self.notify_inbound()

    async def read_answer(self) -> str | None:
        """The next line typed (a tool request's answer); None at end of input."""
        if self._eof:
            return None
        self._answer = asyncio.get_running_loop().create_future()
        try:
            return await self._answer
        finally:
            self._answer = None

    async def next_prompt(self) -> NextPrompt:
        if self._lines:
            return Ready(self._lines.popleft())
        if self._eof:
            return Closed()
        return Idle()

    async def publish_output(self, out: TurnOutput) -> None:
        text = out.full_text()
        self._out.write(text if text.endswith("\n") else text + "\n")
        if out.exit_code not in (None, 0):
            self._out.write(f"[agent exited with code {out.exit_code}]\n")
        self._out.flush()


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "chat", help="talk to one agent session from this terminal, a line per turn"
    )
    parser.add_argument(
        "--tool", choices=AGENT_NAMES, default=None, help="agent (default: setting)"
    )
    parser.add_argument("--agent-cmd", default=None, help="argv template of the command agent")
    parser.add_argument("--workdir", type=Path, default=Path.cwd(), help="the session's cwd")
    parser.add_argument("--session", default=None, help="session id (default: a new one)")
    parser.set_defaults(handler=run_chat)


def _start_stdin_reader(channel: TerminalChannel, loop: asyncio.AbstractEventLoop) -> None:
    # A daemon thread: a blocked readline must never keep the process alive on exit.
    def read() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(channel.push_line, line)
        loop.call_soon_threadsafe(channel.end)

    threading.Thread(target=read, name="terminal-stdin", daemon=True).start()


async def run_chat(args: argparse.Namespace, settings: Settings) -> int:
    channel = TerminalChannel(sys.stdout)
    tool = args.tool or settings.default_agent
    policy = ApprovalPolicy(settings.tool_approval) if tool == "claude" else ApprovalPolicy.OFF
    ask = channel.read_answer if sys.stdin.isatty() else None
    async with terminal_approvals(settings.sqlite_database, policy, ask_line=ask) as route_for:
        agent = create_agent(
            tool,
            settings,
            cwd=args.workdir.resolve(),
            session_id=args.session or str(uuid.uuid4()),
            agent_cmd=args.agent_cmd,
            approval=route_for(terminal_run_id()) if route_for is not None else None,
        )
        _start_stdin_reader(channel, asyncio.get_running_loop())
        try:
            await run_session_loop(agent, channel)
        except TurnPreempted:
            print("turnstile: turn stopped", file=sys.stderr)
            return 130
    return 0
