"""``turnstile chat``: one agent session driven from this terminal, a line per turn.

The terminal is one more :class:`~engine.turn.Channel`: each line read from stdin is a
turn of the same resumed session; its output is written to stdout. On a terminal the
command shows a banner, a prompt, and a live line while a turn runs (elapsed time, the
tool being run or the agent's last line). Ctrl-C stops the running turn and the prompt
returns; Ctrl-C at the prompt (or a second one while a turn is being stopped) quits, as
does end of input (after the running turn finishes). The session is a run like any other
(mode ``chat``, no chat place): ``turnstile runs`` lists it and its turns, and its event
log is what ``turnstile runs RUN --events`` shows. With ``TURNSTILE_TOOL_APPROVAL`` on,
the agent's tool requests are asked here: while one is open, the next line typed answers
it instead of becoming a turn (the live line is hidden meanwhile).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any, TextIO

from engine.agents.base import ProcessAgent
from engine.agents.command import CommandAgent
from engine.agents.factory import AGENT_NAMES, create_agent, probe_turn_mode
from engine.agents.stream import JsonStreamAgent
from engine.approvals.policy import ApprovalPolicy
from engine.approvals.terminal import terminal_approvals
from engine.errors import ConfigError, StoreError, TurnError, TurnPreempted
from engine.humane import exit_note, format_elapsed
from engine.runs.ids import RunMode
from engine.runs.owner import owner_token
from engine.runs.supervisor import RunSupervisor
from engine.settings import Settings
from engine.store.backend import open_database
from engine.store.runs import RunStatus, SqliteRunStore, TurnState
from engine.terminal import TerminalView
from engine.turn import BaseChannel, Closed, Idle, NextPrompt, Ready, TurnOutput

__all__ = ["TerminalChannel", "register"]

EXIT_INTERRUPTED = 130


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

    @property
    def pending(self) -> bool:
        """Whether a line is waiting to be run (no prompt is shown then)."""
        return bool(self._lines)

    async def next_prompt(self) -> NextPrompt:
        if self._lines:
            return Ready(self._lines.popleft())
        if self._eof:
            return Closed()
        return Idle()

    async def publish_output(self, out: TurnOutput) -> None:
        text = out.full_text()
        self._out.write(text if text.endswith("\n") else text + "\n")
        note = exit_note(out.exit_code, out.stderr_tail)
        if note:
            self._out.write(note + "\n")
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
    parser.add_argument(
        "--permissions",
        choices=[p.value for p in ApprovalPolicy],
        help="what Claude Code's tool calls ask first: guarded (all that change something), "
        "trusted (only destructive or outward ones), free (only the catastrophic); "
        "default: TURNSTILE_TOOL_APPROVAL",
    )
    parser.set_defaults(handler=run_chat, terminal_view=True)


def _start_stdin_reader(channel: TerminalChannel, loop: asyncio.AbstractEventLoop) -> None:
    # A daemon thread: a blocked readline must never keep the process alive on exit.
    def read() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(channel.push_line, line)
        loop.call_soon_threadsafe(channel.end)

    threading.Thread(target=read, name="terminal-stdin", daemon=True).start()


def _watch(agent: ProcessAgent, view: TerminalView) -> None:
    if isinstance(agent, JsonStreamAgent):
        agent.on_event = view.on_agent_event
    elif isinstance(agent, CommandAgent):
        agent.on_line = view.on_output_line


class _Record:
    """The terminal session's run in the store: its turns, and how it ended.

    A store that fails mid-session is said once; the conversation goes on unrecorded.
    """

    def __init__(self, runs: SqliteRunStore, run_id: str, view: TerminalView) -> None:
        self.runs = runs
        self.run_id = run_id
        self.view = view
        self.seq = 0
        self._broken = False

    async def _safely(self, write: Any) -> Any:
        if self._broken:
            write.close()
            return None
        try:
            return await write
        except StoreError as exc:
            self._broken = True
            self.view.say(f"The database failed ({exc}); this session is no longer recorded.")
            return None

    async def started(self, prompt: str) -> int | None:
        self.seq += 1
        turn: int | None = await self._safely(
            self.runs.start_turn(self.run_id, self.seq, prompt, None)
        )
        return turn

    async def finished(self, turn_id: int | None, out: TurnOutput) -> None:
        if turn_id is not None:
            await self._safely(
                self.runs.finish_turn_and_update_run(turn_id, out, self.run_id, turn=self.seq)
            )

    async def cut_off(self, turn_id: int | None, state: TurnState, error: str) -> None:
        if turn_id is not None:
            await self._safely(self.runs.fail_turn(turn_id, state, error))

    async def ended(self, status: RunStatus, exit_code: int) -> None:
        await self._safely(
            self.runs.update_run(
                self.run_id, status=status, exit_code=exit_code, finished_at=time.time()
            )
        )


class _ChatLoop:
    """The session loop of ``turnstile chat``: like :func:`~engine.turn.run_session_loop`,
    except that a turn a person stopped ends that turn, not the session."""

    def __init__(
        self,
        agent: ProcessAgent,
        channel: TerminalChannel,
        view: TerminalView,
        tool: str,
        record: _Record,
    ) -> None:
        self.record = record
        self.agent = agent
        self.channel = channel
        self.view = view
        self.tool = tool
        self.interactive = view.live and sys.stdin.isatty()
        self.quit = asyncio.Event()
        self._turn: asyncio.Task[TurnOutput] | None = None
        self._stopping = False
        self._stoppers: set[asyncio.Task[bool]] = set()

    def on_interrupt(self) -> None:
        """Ctrl-C: stop the running turn; at the prompt, or a second time, quit."""
        turn = self._turn
        if turn is None or turn.done() or self._stopping:
            self.quit.set()
            return
        self._stopping = True
        self.view.say("Stopping the turn… (Ctrl-C again quits)", style="yellow")
        if self.agent.preempt.active:
            task = asyncio.create_task(self.agent.preempt.stop(), name="chat-stop-turn")
            self._stoppers.add(task)
            task.add_done_callback(self._stoppers.discard)
        else:  # not spawned yet: nothing to pre-empt but the turn itself
            turn.cancel()

    def _prompt(self) -> None:
        if self.interactive and not self.channel.pending:
            self.view.console.print("[bold cyan]›[/] ", end="")

    async def run(self) -> None:
        prompted = False
        while True:
            if not prompted:
                self._prompt()
                prompted = True
            match await self.channel.next_prompt():
                case Ready(prompt=prompt):
                    prompted = False
                    await self._one_turn(prompt)
                case Idle():
                    await self.channel.wait_for_inbound()
                case Closed():
                    if self.interactive:
                        self.view.console.print()
                    return

    async def _one_turn(self, prompt: str) -> None:
        turn_id = await self.record.started(prompt)
        self.view.begin(f"{self.tool} is working")
        self._stopping = False
        self._turn = asyncio.create_task(self.agent.run_turn(prompt), name="chat-turn")
        try:
            out = await self._turn
        except (TurnPreempted, asyncio.CancelledError) as exc:
            stopped = "stopped by a person"
            await asyncio.shield(self.record.cut_off(turn_id, TurnState.INTERRUPTED, stopped))
            current = asyncio.current_task()
            if isinstance(exc, asyncio.CancelledError) and (
                current is None or current.cancelling()
            ):
                raise  # the whole chat is quitting, not just this turn
            elapsed = self.view.end()
            self.view.say(f"Turn stopped after {format_elapsed(elapsed)}.", style="yellow")
            return
        except TurnError as exc:
            await self.record.cut_off(turn_id, TurnState.FAILED, str(exc))
            raise
        finally:
            self._turn = None
        elapsed = self.view.end()
        await self.record.finished(turn_id, out)
        await self.channel.publish_output(out)
        if self.interactive:
            code = out.exit_code if out.exit_code is not None else 0
            self.view.say(f"(exit {code} · {format_elapsed(elapsed)})", style="dim")


def _banner(view: TerminalView, tool: str, session: str, cwd: Path, run_id: str) -> None:
    view.say(f"turnstile chat · {tool} · session {session} · run {run_id}", style="bold")
    view.say(f"Folder: {cwd}", style="dim")
    view.say(
        "Type a message and press Enter. Ctrl-C stops a running turn; "
        "Ctrl-C at the prompt or Ctrl-D quits.",
        style="dim",
    )


async def run_chat(args: argparse.Namespace, settings: Settings) -> int:
    tool = args.tool or settings.default_agent
    cwd = args.workdir.resolve()
    session = args.session or str(uuid.uuid4())
    view = TerminalView()
    channel = TerminalChannel(sys.stdout)
    if args.permissions not in (None, "off") and tool != "claude":
        raise ConfigError(f"{tool} cannot ask before its tool calls (only Claude Code can)")
    chosen = args.permissions or settings.tool_approval
    policy = ApprovalPolicy(chosen) if tool == "claude" else ApprovalPolicy.OFF
    ask = view.asking(channel.read_answer) if sys.stdin.isatty() else None
    async with (
        open_database(settings) as db,
        terminal_approvals(
            settings.database, policy, ask_line=ask, out=view.question_stream()
        ) as route_for,
    ):
        runs = SqliteRunStore(db)
        run_id = await RunSupervisor(runs).open_run(
            RunMode.CHAT,
            agent=tool,
            session_id=session,
            workdir=str(cwd),
            state={"owner": owner_token()},
        )
        record = _Record(runs, run_id, view)
        code = 1
        try:
            await probe_turn_mode(tool, settings)  # asked off the event loop, then known
            agent = create_agent(
                tool,
                settings,
                cwd=cwd,
                session_id=session,
                agent_cmd=args.agent_cmd,
                approval=route_for(run_id, None) if route_for is not None else None,
            )
            code = await _converse(agent, channel, view, tool, session, cwd, record)
            return code
        finally:
            # Left by the person (end of input, Ctrl-C at the prompt), or by an error.
            ended = RunStatus.COMPLETED if code in (0, EXIT_INTERRUPTED) else RunStatus.ERROR
            await asyncio.shield(record.ended(ended, code))


async def _converse(
    agent: ProcessAgent,
    channel: TerminalChannel,
    view: TerminalView,
    tool: str,
    session: str,
    cwd: Path,
    record: _Record,
) -> int:
    _watch(agent, view)
    chat = _ChatLoop(agent, channel, view, tool, record)
    if chat.interactive:
        _banner(view, tool, session, cwd, record.run_id)
    loop = asyncio.get_running_loop()
    _start_stdin_reader(channel, loop)
    loop.add_signal_handler(signal.SIGINT, chat.on_interrupt)
    driver = asyncio.create_task(chat.run(), name="chat-loop")
    quitting = asyncio.create_task(chat.quit.wait(), name="chat-quit")
    try:
        with view:
            await asyncio.wait({driver, quitting}, return_when=asyncio.FIRST_COMPLETED)
            if not driver.done():
                if chat.interactive:
                    view.console.print()
                driver.cancel()  # a turn still running is pre-empted by the cancellation
                await asyncio.gather(driver, return_exceptions=True)
                return EXIT_INTERRUPTED
            driver.result()
            return 0
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        quitting.cancel()
        if chat._stoppers:
            await asyncio.gather(*chat._stoppers, return_exceptions=True)
