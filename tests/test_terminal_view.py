"""The terminal view's lines, fed the events a run and an agent produce."""

from __future__ import annotations

import asyncio
import io

from rich.console import Console

from engine.agents.stream import AgentEvent, EventKind
from engine.automode.channel import turn_said
from engine.automode.state import Phase
from engine.humane import format_elapsed
from engine.sink import RunText, StatusUpdate
from engine.terminal import TerminalView


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def piped() -> tuple[TerminalView, io.StringIO, Clock]:
    out = io.StringIO()
    clock = Clock()
    view = TerminalView(Console(file=out, force_terminal=False, width=40), clock=clock)
    return view, out, clock


def status(
    turn: int, event: str, state: str = "running", running: str | None = None
) -> StatusUpdate:
    return StatusUpdate(
        run_id="r",
        mode="auto",
        status=state,
        turn=turn,
        round=turn,
        max_turns=10,
        last_event=event,
        running=running,
    )


def test_elapsed_reads_as_words() -> None:
    assert [format_elapsed(s) for s in (0, 7.9, 65, 3725)] == ["0s", "7s", "1m05s", "1h02m"]


async def test_piped_lines_per_turn_and_no_report_twice() -> None:
    view, out, clock = piped()
    with view:
        await view.update_status(status(1, "Clarify running", running="Clarify"))
        await view.update_status(
            status(1, "Clarify running", running="Clarify")
        )  # no change: no line
        clock.now += 12
        long_line = "x" * 300
        await view.publish_run_text(
            turn_said(
                "r",
                turn=1,
                round_=1,
                max_turns=10,
                phase=Phase.CLARIFY,
                code=0,
                text=f"first\n{long_line}\n",
                size=None,
                stderr_tail=None,
                log_dir="logs",
            )
        )
        await view.publish_text("r", "Appended instruction a.md refused: too big")
        await view.update_status(status(1, "Objective achieved", "completed"))
        await view.publish_text("r", "Auto run r: completed\nEvidence ...")
    lines = out.getvalue().splitlines()
    assert lines[0] == "turn 1 · round 1/10 · Clarify …"
    assert lines[1].startswith("✓ turn 1 Clarify · round 1/10 · exit 0 · 12s · xxx")
    assert lines[1].endswith("…")  # long lines are cut, never wrapped
    assert len(lines[1]) < 220
    assert lines[2] == "Appended instruction a.md refused: too big"
    assert len(lines) == 3
    assert view.report == "Auto run r: completed\nEvidence ..."
    assert "\x1b[" not in out.getvalue()


async def test_a_failed_turn_ends_with_its_error_output_unless_its_output_was_cut() -> None:
    view, out, _ = piped()

    def failed(text: str) -> RunText:
        return turn_said(
            "r",
            turn=2,
            round_=1,
            max_turns=10,
            phase=Phase.PLAN,
            code=3,
            text=text,
            size=None,
            stderr_tail="Traceback\nboom\n",
            log_dir="logs",
        )

    with view:
        await view.publish_run_text(failed("planned"))
        await view.publish_run_text(failed("y" * 5000 + "\nlast of all"))
    lines = out.getvalue().splitlines()
    assert lines[0] == "✗ turn 2 Plan · round 1/10 · exit 3 · 0s · boom"
    assert lines[1].startswith("✗ turn 2 Plan · round 1/10 · exit 3 · 0s · yyy")


def test_agent_progress_shows_the_tool_or_the_last_text_redacted() -> None:
    view, _, clock = piped()
    view.begin("Execute", turn=4, round_=3, max_turns=10)
    clock.now += 3
    view.on_agent_event(AgentEvent(EventKind.TOOL_USE, "s", text="ls -la", tool="Bash"))
    assert view.status_line().plain == "turn 4 · round 3/10 · Execute · 3s · running Bash: ls -la"
    view.on_agent_event(AgentEvent(EventKind.TEXT, "s", text="Reading.\nNow editing x.py"))
    assert view.status_line().plain.endswith("· Now editing x.py")
    view.on_output_line("token ghp_abcdefghijklmnopqrstuvwxyz0123456789AB here")
    assert "ghp_abcdefghijklmnopqrstuvwxyz0123456789AB" not in view.status_line().plain
    view.on_agent_event(AgentEvent(EventKind.RESULT, "s", text="ignored"))
    assert "ignored" not in view.status_line().plain


async def test_a_question_hides_the_live_line_until_it_is_answered() -> None:
    out = io.StringIO()
    view = TerminalView(Console(file=out, force_terminal=True, width=80))
    answered = asyncio.Event()

    async def read() -> str | None:
        assert not view.showing  # hidden while the person types
        await answered.wait()
        return "y"

    with view:
        view.begin("Execute", turn=4, round_=3, max_turns=10)
        assert view.showing
        stream = view.question_stream()
        stream.write("\n🔐 The agent asks to use Bash:\n$ ls\n")
        assert not view.showing
        stream.write("Allow? [y] once · [n] deny: ")
        stream.flush()  # an open prompt keeps the line hidden
        assert not view.showing
        ask = view.asking(read)
        assert ask is not None
        answered.set()
        assert await ask() == "y"
        stream.write("turnstile: Bash allowed\n")
        stream.flush()
        assert view.showing  # back for the rest of the turn
        view.end()
        assert not view.showing
    assert "Allow? [y] once · [n] deny: " in out.getvalue()
    assert view.asking(None) is None
