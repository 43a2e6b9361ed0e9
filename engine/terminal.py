"""What a person at a terminal sees while an agent works: a live status line and plain lines.

:class:`TerminalView` renders through a :class:`rich.console.Console` (stderr by default,
so stdout keeps only the results a script may capture). On a terminal it keeps one live
line at the bottom (a spinner, the turn, the phase, the elapsed time and the agent's last
line or tool) with finished turns and notices printed above it; when the stream is piped
it prints one plain line per change instead, with no control codes.

It is the terminal's :class:`~engine.sink.RunSink` for auto runs, and the progress display
of ``turnstile chat``. Agent progress arrives from :meth:`on_agent_event` (the JSON-stream
agents) or :meth:`on_output_line` (the command agent's stdout lines).

Anything that asks the person a question while the line is live (a tool approval) writes
it to :meth:`TerminalView.question_stream` and reads the answer through
:meth:`TerminalView.asking`: the live line is hidden from the first character of the
question until the answer is in, so the next refresh never overdraws the prompt.
:meth:`TerminalView.pause` does the same for a block of code.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Final, TextIO, cast

from rich.console import Console, RenderableType
from rich.live import Live
from rich.spinner import Spinner
from rich.text import Text

from engine.agents.stream import AgentEvent, EventKind
from engine.humane import format_elapsed, turn_count
from engine.redact import redact
from engine.sink import GateRequest, RunText, StatusUpdate

__all__ = ["AskLine", "TerminalView"]

# Reads one answer line from the person (None: no more input).
AskLine = Callable[[], Awaitable[str | None]]

_LINE_LIMIT: Final = 160


def _last_line(text: str) -> str:
    for line in reversed(text.splitlines()):
        if line.strip():
            return _short(line)
    return ""


def _short(line: str) -> str:
    line = redact(" ".join(line.split()))
    return line if len(line) <= _LINE_LIMIT else line[: _LINE_LIMIT - 1] + "…"


class TerminalView:
    """A run's progress for a person: a live line on a terminal, plain lines when piped.

    Use it as a context manager around the run: the live line exists only inside.

    Args:
        console: where to render (default: stderr).
        clock: monotonic seconds, for elapsed times.
    """

    def __init__(
        self,
        console: Console | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console = console or Console(stderr=True, highlight=False)
        self._clock = clock
        self._spinner = Spinner("dots")
        self._live: Live | None = None
        self._entered = False
        self._activity: str | None = None
        self._since: float | None = None
        self._last: str = ""
        self._turn: int = 0
        self._round: int = 0
        self._max_turns: int | None = None
        self._plain_key: tuple[object, ...] | None = None
        self._ended = False
        self._held = False
        self.report: str | None = None

    @property
    def showing(self) -> bool:
        """Whether the live line is on the screen now."""
        return self._live is not None

    @property
    def live(self) -> bool:
        """Whether the output is a terminal (a live line) rather than a pipe or file."""
        return self.console.is_terminal

    # -- lifetime ---------------------------------------------------------------------
    def __enter__(self) -> TerminalView:
        self._entered = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._entered = False
        self._stop_live()

    def _start_live(self) -> None:
        if self._live is not None or not self.live or not self._entered or self._held:
            return
        self._live = Live(
            console=self.console,
            get_renderable=self._render,
            refresh_per_second=8,
            transient=True,
            redirect_stdout=True,
            redirect_stderr=True,
        )
        self._live.start()

    def _stop_live(self) -> None:
        live, self._live = self._live, None
        if live is not None:
            live.stop()

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Hide the live line while the caller asks the person something."""
        self.hold()
        try:
            yield
        finally:
            self.release()

    def hold(self) -> None:
        """Hide the live line until :meth:`release` (a question is being asked)."""
        self._held = True
        self._stop_live()

    def release(self) -> None:
        """Show the live line again if something is still running."""
        self._held = False
        if self._activity is not None:
            self._start_live()

    def question_stream(self) -> TextIO:
        """A stream for a question asked mid-run: writing hides the live line first."""
        return cast(TextIO, _QuestionStream(self))

    def asking(self, ask: AskLine | None) -> AskLine | None:
        """``ask`` with the live line hidden until the answer is in (None stays None)."""
        if ask is None:
            return None
        inner = ask

        async def answer() -> str | None:
            self.hold()
            try:
                return await inner()
            finally:
                self.release()

        return answer

    # -- what is shown ------------------------------------------------------------------
    def _render(self) -> RenderableType:
        self._spinner.update(text=self.status_line())
        return self._spinner

    def status_line(self) -> Text:
        """The live line's text (without the spinner)."""
        parts = []
        if self._turn or self._round:
            parts.append(turn_count(self._turn, round_=self._round, limit=self._max_turns))
        if self._activity:
            parts.append(self._activity)
        if self._since is not None:
            parts.append(format_elapsed(self._clock() - self._since))
        line = Text(" · ".join(parts), style="bold")
        if self._last:
            line.append(" · ")
            line.append(self._last, style="dim")
        return line

    def say(self, text: str, *, style: str | None = None) -> None:
        """Print a line above the live line (or just a line, when piped)."""
        self.console.print(Text(text, style=style or ""), soft_wrap=True)

    def begin(
        self, activity: str, *, turn: int = 0, round_: int = 0, max_turns: int | None = None
    ) -> None:
        """Something started (a turn, a verify command): shown with its elapsed time.
        ``round_``: an auto run's round, which its ``max_turns`` counts."""
        self._activity = activity
        self._since = self._clock()
        self._last = ""
        self._turn = turn
        self._round = round_
        self._max_turns = max_turns
        if self.live:
            self._start_live()
        else:
            key = (turn, activity)
            if key != self._plain_key:
                self._plain_key = key
                where = ""
                if turn and max_turns:
                    where = f"{turn_count(turn, round_=round_, limit=max_turns)} · "
                self.say(f"{where}{activity} …")

    def end(self) -> float:
        """The activity finished; returns its elapsed seconds (the live line goes away)."""
        elapsed = self._clock() - self._since if self._since is not None else 0.0
        self._stop_live()
        self._activity = None
        self._since = None
        return elapsed

    # -- agent progress -------------------------------------------------------------------
    def on_agent_event(self, event: AgentEvent) -> None:
        """A JSON-stream agent's progress event: the tool being run or its last text."""
        if event.kind is EventKind.TOOL_USE:
            what = _short(event.text) if event.text else ""
            self._last = f"running {event.tool or 'a tool'}" + (f": {what}" if what else "")
        elif event.kind is EventKind.TEXT and event.text.strip():
            self._last = _last_line(event.text)
        elif event.kind is EventKind.ERROR and event.text:
            self._last = f"error: {_short(event.text)}"

    def on_output_line(self, line: str) -> None:
        """One stdout line of an agent without progress events (the command agent)."""
        if line.strip():
            self._last = _short(line)

    # -- RunSink ------------------------------------------------------------------------------
    async def publish_text(self, run_id: str, text: str) -> None:
        await self.publish_run_text(RunText(run_id, text))

    async def publish_run_text(self, said: RunText) -> None:
        if self._ended:
            # The final report: the command prints it on stdout once the run is over.
            self.report = said.text
            return
        done = said.turn
        if done is None:
            self.say(said.text)
            return
        elapsed = self.end() if self._activity is not None else 0.0
        code = done.exit_code
        mark, style = ("✓", "green") if code == 0 else ("✗", "red")
        line = (
            f"{mark} turn {done.turn} {done.phase} · round {done.round}/{done.max_turns} · "
            f"exit {code} · {format_elapsed(elapsed)}"
        )
        # Its last line: of the output, or of the error output when all the output is shown.
        shown = done.output if done.cut or not done.error else f"{done.output}\n{done.error}"
        last = _last_line(shown)
        self.say(line + (f" · {last}" if last else ""), style=style)

    async def update_status(self, update: StatusUpdate) -> None:
        if update.status != "running":
            self._ended = True
            self.end()
            return
        if update.running is not None:
            self.begin(
                update.running,
                turn=update.turn,
                round_=update.round,
                max_turns=update.max_turns,
            )

    async def request_gate(self, request: GateRequest) -> None:
        self.say(
            f"Task {request.task}: {request.phase} waits for approval of "
            f"{request.artifact_name} ({request.short_hash}); approve with "
            f"`turnstile status --task {request.task} --approve --by USER_ID`"
        )


class _QuestionStream:
    """Writes go to the view's console stream once the live line is hidden; a flush after
    a complete line shows it again (a prompt left open keeps it hidden for the answer)."""

    def __init__(self, view: TerminalView) -> None:
        self._view = view
        self._open = False

    def write(self, text: str) -> int:
        self._view.hold()
        if text:
            self._open = not text.endswith("\n")
        return self._view.console.file.write(text)

    def flush(self) -> None:
        self._view.console.file.flush()
        if not self._open:
            self._view.release()
