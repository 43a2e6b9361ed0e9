"""A run's history as an inline SVG: turns as bars on a time axis, waits shaded, gates,
tool requests and the run's end as marks. Drawn from the event log alone."""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from html import escape
from typing import Any, Final

from engine.commands._events import what_happened
from engine.humane import format_elapsed, humane, words
from engine.store.events import EventKind, RunEvent

__all__ = ["PHASE_COLOURS", "legend", "phase_colour", "timeline_svg"]

#: The colour of each phase of the built-in modes (and of chat turns, which have none).
#: Automode's and the gated workflow's phases never share a run, so they may share colours;
#: red is kept out of the palette because it marks failed turns.
PHASE_COLOURS: Final[Mapping[str, str]] = {
    "chat": "#4e79a7",
    "clarify": "#76b7b2",
    "plan": "#59a14f",
    "execute": "#f28e2b",
    "evaluate": "#b07aa1",
    "adjust": "#edc948",
    "research": "#76b7b2",
    "decomposition": "#9c755f",
    "design": "#59a14f",
    "test_design": "#8cd17d",
    "implement": "#f28e2b",
    "bug_find": "#ff9da7",
    "adversarial_bug_find": "#b07aa1",
    "doc_review": "#edc948",
    "referee": "#bab0ac",
}
_PALETTE: Final = ("#4e79a7", "#f28e2b", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
                   "#ff9da7", "#9c755f", "#bab0ac", "#86bcb6")  # fmt: skip
_CHAT: Final = "chat"
_FAILED: Final = "#c5221f"
_GREY: Final = "#5f6368"
_INK: Final = "#3c4043"
_DECIDED: Final = {"approved": "#188038", "rejected": _FAILED, "approval counted": "#81c995"}
_TOOL: Final = {"allowed": "#188038", "denied": _FAILED, "cancelled": "#9aa0a6"}
_ENDED: Final = {"completed": "#188038", "stopped": _GREY}
# Where a wait ends: the run moved on, or ended.
_WAKES: Final = frozenset(
    {EventKind.PHASE, EventKind.TURN_STARTED, EventKind.RUN_RESUMED, EventKind.RUN_ENDED}
)
_LIFE: Final = frozenset({EventKind.RUN_STARTED, EventKind.RUN_RESUMED, EventKind.RUN_ENDED})
# Tick spacings that read well: 1 s up to a week.
_STEPS: Final = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800,
                 21600, 43200, 86400, 172800, 604800)  # fmt: skip
# Characters XML 1.0 does not allow: one in an event's text would break the whole page.
_NOT_XML: Final = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")

# The layout, in viewBox units.
_LEFT, _RIGHT, _HEIGHT = 64, 16, 124
_GATES_Y, _TOOLS_Y, _TURN_TOP, _TURN_H, _AXIS_Y = 22, 46, 62, 22, 96


def phase_colour(name: str | None) -> str:
    """The colour of a phase's turns (None: a chat turn); stable for any name."""
    key = name or _CHAT
    if key in PHASE_COLOURS:
        return PHASE_COLOURS[key]
    # crc32, not hash(): the colour must not change from one process to the next.
    return _PALETTE[zlib.crc32(key.encode()) % len(_PALETTE)]


def _label(phase: str | None) -> str:
    return words(phase) if phase else _CHAT


def legend(events: Sequence[RunEvent]) -> list[tuple[str, str]]:
    """``(label, colour)`` of each phase the run's turns ran in, in the order first seen."""
    phases = dict.fromkeys(e.data.get("phase") for e in events if e.kind == EventKind.TURN_STARTED)
    return [(_label(phase), phase_colour(phase)) for phase in phases]


@dataclass(frozen=True, slots=True)
class _Bar:
    start: float
    end: float
    phase: str | None
    state: str  # "finished", "failed" (failed or cut off) or "open"
    title: str


@dataclass(frozen=True, slots=True)
class _Span:
    start: float
    end: float
    title: str


@dataclass(frozen=True, slots=True)
class _Mark:
    at: float
    what: str  # the SVG class: "gate opened", "tool denied", "end stopped", ...
    colour: str
    title: str


@dataclass(frozen=True, slots=True)
class _Story:
    start: float
    end: float
    running: bool
    bars: tuple[_Bar, ...]
    waits: tuple[_Span, ...]
    marks: tuple[_Mark, ...]


def _say(event: RunEvent) -> str:
    """The log's own line for the event (``turnstile runs --events``), phase labels in words."""
    return humane(what_happened(event))


def _turn_key(data: Mapping[str, Any]) -> object:
    return data.get("turn_id", (data.get("seq"), data.get("attempt")))


def _read(events: Sequence[RunEvent], now: float) -> _Story:
    """What the events say happened, in seconds of the epoch (pure: no drawing here)."""
    ordered = sorted(events, key=lambda e: e.id)
    lives = [e for e in ordered if e.kind in _LIFE]
    running = not lives or not lives[-1].ends_run
    start = min(e.at for e in ordered)
    last = max(e.at for e in ordered)
    end = max(now, last) if running else last
    bars: list[_Bar] = []
    waits: list[_Span] = []
    marks: list[_Mark] = []
    open_turns: dict[object, RunEvent] = {}
    tools: dict[object, str] = {}
    parked: RunEvent | None = None

    def wait_until(at: float) -> None:
        nonlocal parked
        if parked is not None:
            took = format_elapsed(at - parked.at)
            waits.append(_Span(parked.at, at, f"{_say(parked)} ({took})"))
            parked = None

    for event in ordered:
        data = event.data
        if event.kind in _WAKES:
            wait_until(event.at)
        if event.kind == EventKind.TURN_STARTED:
            open_turns[_turn_key(data)] = event
        elif event.kind == EventKind.TURN_ENDED:
            began = open_turns.pop(_turn_key(data), None)
            if began is not None:  # a turn whose start is not in the log is left out
                state = "finished" if data.get("state") == "finished" else "failed"
                took = format_elapsed(event.at - began.at)
                title = f"{_say(began)}\n{_say(event)}\ntook {took}"
                bars.append(_Bar(began.at, event.at, began.data.get("phase"), state, title))
        elif event.kind == EventKind.PARKED:
            parked = parked or event
        elif event.kind == EventKind.GATE_OPENED:
            marks.append(_Mark(event.at, "gate opened", "#ffffff", _say(event)))
        elif event.kind == EventKind.GATE_DECIDED:
            decision = str(data.get("decision") or data.get("outcome") or "")
            colour = _DECIDED.get(decision, "#81c995")
            what = "gate rejected" if decision == "rejected" else "gate approved"
            marks.append(_Mark(event.at, what, colour, _say(event)))
        elif event.kind == EventKind.TOOL_REQUESTED:
            tools[data.get("request_id")] = str(data.get("tool"))
            # Allowed at once by an earlier grant: no decision of its own follows.
            colour = _TOOL.get(str(data.get("decision")), _GREY)
            marks.append(_Mark(event.at, "tool requested", colour, _say(event)))
        elif event.kind == EventKind.TOOL_DECIDED:
            decision = str(data.get("decision"))
            tool = tools.get(data.get("request_id"))
            title = _say(event) + (f" ({tool})" if tool else "")
            colour = _TOOL.get(decision, "#9aa0a6")
            marks.append(_Mark(event.at, f"tool {_css(decision)}", colour, title))
        elif event.kind == EventKind.RUN_ENDED:
            status = str(data.get("status"))
            colour = _ENDED.get(status, _FAILED)
            marks.append(_Mark(event.at, f"end {_css(status)}", colour, _say(event)))
        elif event.kind == EventKind.RUN_RESUMED:
            marks.append(_Mark(event.at, "resumed", "#1a73e8", _say(event)))
    wait_until(end)
    for began in open_turns.values():
        # Still going; or, once the run is over, cut off without its end in the log.
        state, said = ("open", "still running") if running else ("failed", "its end is unknown")
        title = f"{_say(began)}\n{said}, {format_elapsed(end - began.at)} so far"
        bars.append(_Bar(began.at, end, began.data.get("phase"), state, title))
    bars.sort(key=lambda bar: bar.start)
    return _Story(start, end, running, tuple(bars), tuple(waits), tuple(marks))


def _css(word: str) -> str:
    """A word fit for a class attribute (the event's own words are not trusted)."""
    return re.sub(r"[^a-z0-9-]+", "-", word.lower()).strip("-") or "other"


def _text(value: object) -> str:
    """``value`` as text safe in an SVG element or attribute."""
    return escape(_NOT_XML.sub("", str(value)), quote=True)


def _el(tag: str, attrs: Mapping[str, object], *inner: str, title: str | None = None) -> str:
    """One element, every attribute escaped; ``inner`` is markup (text in it escaped by
    the caller), ``title`` its hover text."""
    said = "".join(
        f' {name.rstrip("_").replace("_", "-")}="{_text(_num(value))}"'
        for name, value in attrs.items()
    )
    body = (f"<title>{_text(title)}</title>" if title is not None else "") + "".join(inner)
    return f"<{tag}{said}>{body}</{tag}>" if body else f"<{tag}{said}/>"


def _num(value: object) -> object:
    return f"{value:.1f}".removesuffix(".0") if isinstance(value, float) else value


def _tick(seconds: float) -> str:
    """``0``, ``45s``, ``2m``, ``1m30s``, ``3h``: the round part of a tick is left out."""
    if seconds <= 0:
        return "0"
    said = format_elapsed(seconds)
    return said.removesuffix("00s").removesuffix("00m")


def _svg(width: int, height: int, label: str, *body: str) -> str:
    attrs = {
        "xmlns": "http://www.w3.org/2000/svg",
        "class_": "timeline",
        "viewBox": f"0 0 {width} {height}",
        "width": "100%",
        "preserveAspectRatio": "xMinYMin meet",
        "role": "img",
        "aria_label": label,
        "font_family": "sans-serif",
        "font_size": 11,
    }
    return _el("svg", attrs, *body, title=label)


def timeline_svg(events: Sequence[RunEvent], *, now: float, width: int = 960) -> str:
    """One run's history as a self-contained ``<svg>`` element.

    Args:
        events: the run's events (any order; drawn by id).
        now: the time a run still going is drawn up to.
        width: the width of the view box; the drawing scales to its container.
    """
    if not events:
        said = "Nothing has happened yet."
        note = {"x": width / 2, "y": 24, "text_anchor": "middle", "fill": _GREY}
        return _svg(width, 40, f"Timeline of the run: {said}", _el("text", note, _text(said)))
    story = _read(events, now)
    span = max(story.end - story.start, 1.0)
    plot = max(width - _LEFT - _RIGHT, 1)

    def x(at: float) -> float:
        return _LEFT + (at - story.start) / span * plot

    out: list[str] = []
    for wait in story.waits:
        box = {"x": x(wait.start), "y": 8, "width": x(wait.end) - x(wait.start)}
        shade = {"height": _AXIS_Y - 8, "fill": "#9aa0a6", "fill_opacity": "0.25"}
        out.append(_el("rect", {"class_": "wait", **box, **shade}, title=wait.title))
    out.extend(_axis(span, plot, x, story.start))
    for name, y in (("Gates", _GATES_Y), ("Tools", _TOOLS_Y), ("Turns", _TURN_TOP + _TURN_H / 2)):
        out.append(_el("text", {"x": 4, "y": y + 4, "fill": _INK}, _text(name)))
    out.extend(_draw_bar(bar, x(bar.start), x(bar.end)) for bar in story.bars)
    out.extend(_draw_mark(mark, x(mark.at)) for mark in story.marks)
    turns = len(story.bars)
    label = (
        f"Timeline of the run: {turns} turn{'s' if turns != 1 else ''} over "
        f"{format_elapsed(story.end - story.start)}, "
        + ("still going" if story.running else "ended")
    )
    return _svg(width, _HEIGHT, label, *out)


def _axis(span: float, plot: int, x: Callable[[float], float], start: float) -> list[str]:
    """The axis line and its ticks, as few as read well in ``plot`` units."""
    most = max(2, plot // 80)
    step = next((s for s in _STEPS if span / s <= most), _STEPS[-1])
    axis = {"x1": _LEFT, "y1": _AXIS_Y, "x2": _LEFT + plot, "y2": _AXIS_Y, "stroke": _GREY}
    out = [_el("line", axis)]
    for tick in range(0, int(span) + 1, step):
        at = x(start + tick)
        line = {"x1": at, "y1": 8, "x2": at, "y2": _AXIS_Y + 4, "stroke": "#dadce0"}
        out.append(_el("line", {"class_": "tick", **line}))
        place = {"x": at, "y": _AXIS_Y + 16, "text_anchor": "middle", "fill": _GREY}
        out.append(_el("text", {"class_": "tick", **place}, _text(_tick(tick))))
    return out


def _draw_bar(bar: _Bar, left: float, right: float) -> str:
    attrs: dict[str, object] = {
        "class_": f"turn {bar.state}",
        "x": left,
        "y": _TURN_TOP,
        "width": max(right - left, 2.0),  # a turn of a second in a day-long run still shows
        "height": _TURN_H,
        "rx": 2,
        "fill": phase_colour(bar.phase),
    }
    if bar.state == "failed":
        attrs.update(stroke=_FAILED, stroke_width=2, stroke_dasharray="4 2")
    return _el("rect", attrs, title=bar.title)


def _draw_mark(mark: _Mark, at: float) -> str:
    look = {"class_": mark.what, "fill": mark.colour}
    if mark.what.startswith("gate"):
        y = _GATES_Y
        points = f"{at:.1f},{y - 7} {at + 6:.1f},{y} {at:.1f},{y + 7} {at - 6:.1f},{y}"
        return _el("polygon", {**look, "points": points, "stroke": _INK}, title=mark.title)
    if mark.what.startswith("tool"):
        dot = {"cx": at, "cy": _TOOLS_Y, "r": 5 if mark.what == "tool requested" else 3.5}
        return _el("circle", {**look, **dot, "stroke": "#ffffff"}, title=mark.title)
    # The run's end and its resumptions: a line across every lane, a flag on top.
    line = {"x1": at, "y1": 6, "x2": at, "y2": _AXIS_Y, "stroke": mark.colour, "stroke_width": 2}
    flag = {"x": at - 4, "y": 2, "width": 8, "height": 8, "fill": mark.colour}
    return _el("g", {"class_": mark.what}, _el("line", line), _el("rect", flag), title=mark.title)
