"""What each turn of a run cost, as a small bar chart (inline SVG, no script).

Bars are the turns' cost in USD where the agent reported one, else their tokens; a turn
whose agent reported nothing has no bar and says so in its hover text.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Final

from engine.spend import Spend
from engine.store.runs import TurnRecord, TurnState

__all__ = ["spend_chart"]

_HEIGHT: Final = 90
_BAR: Final = 14
_GAP: Final = 4


def spend_chart(turns: Sequence[TurnRecord]) -> str:
    """The chart of the finished turns' spend ('' when none reported any)."""
    done = [t for t in turns if t.state is TurnState.FINISHED]
    by_cost = any(t.spend.cost_usd is not None for t in done)
    values: list[float | None] = [(t.spend.cost_usd if by_cost else t.spend.tokens) for t in done]
    known = [v for v in values if v is not None]
    if not known:
        return ""
    top = max(known) or 1.0
    width = max(1, len(done)) * (_BAR + _GAP) + _GAP
    total = sum((t.spend for t in done), Spend())
    what = "cost in USD" if by_cost else "tokens"
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {_HEIGHT + 16}" '
        f'role="img" aria-label="{escape(total.line())}: {what} per turn" class="spend">',
        f"<title>{escape(total.line())}</title>",
    ]
    for i, (turn, value) in enumerate(zip(done, values, strict=True)):
        x = _GAP + i * (_BAR + _GAP)
        label = f"turn {turn.seq}" + (f" ({turn.phase})" if turn.phase else "")
        if value is None:
            said = f"{label}: the agent reported nothing"
            parts.append(
                f'<rect x="{x}" y="{_HEIGHT - 2}" width="{_BAR}" height="2" fill="#98a2b3">'
                f"<title>{escape(said)}</title></rect>"
            )
            continue
        height = max(2.0, _HEIGHT * value / top)
        said = f"{label}: " + (turn.spend.cost_text() if by_cost else f"{int(value):,} tokens")
        parts.append(
            f'<rect x="{x}" y="{_HEIGHT - height:.1f}" width="{_BAR}" height="{height:.1f}" '
            f'rx="2" fill="#2563eb"><title>{escape(said)}</title></rect>'
        )
    parts.append(
        f'<text x="{_GAP}" y="{_HEIGHT + 13}" font-size="10" fill="#667085">'
        f"{escape(what)} per turn · most {escape(_most(top, by_cost))}</text>"
    )
    parts.append("</svg>")
    return "".join(parts)


def _most(top: float, by_cost: bool) -> str:
    return f"${top:.4f}" if by_cost else f"{int(top):,}"
