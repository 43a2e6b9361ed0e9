"""What a turn, a run or a chat cost: USD and tokens, as the agent CLIs report them.

Each CLI says it its own way: Claude Code's ``result`` has ``total_cost_usd`` and a
``usage`` with ``input_tokens``, ``output_tokens``, ``cache_read_input_tokens`` and
``cache_creation_input_tokens``; Codex reports tokens only (``input_tokens`` counting its
``cached_input_tokens``); Copilot CLI reports neither. What a CLI does not report is
unknown (None), never zero, and a sum says how many of its turns were unknown.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from engine.errors import ConfigError

__all__ = ["BUDGET_WARN_AT", "Budget", "Spend"]

#: What each agent CLI reports of a turn's spend (the command agent: whatever it prints).
_REPORTS: Final[Mapping[str, str]] = {"claude": "cost and tokens", "codex": "tokens"}

#: The share of a budget spent at which the people following the run are told, once.
BUDGET_WARN_AT = 0.8


def _count(usage: Mapping[str, Any], key: str) -> int | None:
    value = usage.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return max(0, int(value))


def _int(value: Any) -> int | None:
    return int(value) if value is not None else None


def _add(a: int | float | None, b: int | float | None) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    return a + b


@dataclass(frozen=True, slots=True)
class Spend:
    """USD and tokens of some turns; None where no turn reported it.

    Attributes:
        turns: the turns counted.
        unknown: of those, the turns whose agent reported neither cost nor tokens.
    """

    cost_usd: float | None = None
    input: int | None = None
    output: int | None = None
    cache_read: int | None = None
    cache_write: int | None = None
    turns: int = 0
    unknown: int = 0

    @classmethod
    def of_turn(cls, metadata: Mapping[str, object]) -> Spend:
        """One turn's spend from its adapter's metadata (``usage``, ``cost_usd``)."""
        cost = metadata.get("cost_usd")
        cost_usd = (
            float(cost)
            if isinstance(cost, int | float) and not isinstance(cost, bool) and cost >= 0
            else None
        )
        raw = metadata.get("usage")
        usage: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
        input_tokens = _count(usage, "input_tokens")
        cache_read = _count(usage, "cache_read_input_tokens")
        cache_write = _count(usage, "cache_creation_input_tokens")
        cached = _count(usage, "cached_input_tokens")
        if cached is not None:
            # Codex counts its cached input inside input_tokens: said apart, as Claude does.
            cache_read = cached
            if input_tokens is not None:
                input_tokens = max(0, input_tokens - cached)
            cache_write = _count(usage, "cache_write_input_tokens")
        spend = cls(
            cost_usd=cost_usd,
            input=input_tokens,
            output=_count(usage, "output_tokens"),
            cache_read=cache_read,
            cache_write=cache_write,
            turns=1,
        )
        return spend if spend.known else cls(turns=1, unknown=1)

    @classmethod
    def from_columns(cls, row: Any, *, turns: int = 1, unknown: int | None = None) -> Spend:
        """From the store's columns (``cost_usd``, ``tokens_input`` …); ``unknown`` counts
        the turns that reported nothing (default: this one row's turn, if it did not)."""
        # (PostgreSQL sums integers as numeric: Decimal on the way out.)
        cost = row["cost_usd"]
        spend = cls(
            cost_usd=float(cost) if cost is not None else None,
            input=_int(row["tokens_input"]),
            output=_int(row["tokens_output"]),
            cache_read=_int(row["tokens_cache_read"]),
            cache_write=_int(row["tokens_cache_write"]),
            turns=turns,
            unknown=unknown or 0,
        )
        if unknown is None and not spend.known:
            return cls(turns=turns, unknown=turns)
        return spend

    def columns(self) -> tuple[float | None, int | None, int | None, int | None, int | None]:
        """The store's columns, in the order of :meth:`from_columns`."""
        return (self.cost_usd, self.input, self.output, self.cache_read, self.cache_write)

    def __add__(self, other: Spend) -> Spend:
        return Spend(
            cost_usd=_add(self.cost_usd, other.cost_usd),
            input=_add(self.input, other.input),
            output=_add(self.output, other.output),
            cache_read=_add(self.cache_read, other.cache_read),
            cache_write=_add(self.cache_write, other.cache_write),
            turns=self.turns + other.turns,
            unknown=self.unknown + other.unknown,
        )

    @property
    def known(self) -> bool:
        """Whether any turn reported something."""
        return any(v is not None for v in self.columns())

    @property
    def tokens(self) -> int | None:
        """Every token counted, None when no turn reported any."""
        counts = [v for v in (self.input, self.output, self.cache_read, self.cache_write) if v]
        if all(v is None for v in (self.input, self.output, self.cache_read, self.cache_write)):
            return None
        return sum(counts)

    def to_json(self) -> dict[str, Any]:
        """``cost_usd`` (null: unknown) and ``tokens`` (null: none reported)."""
        tokens = None
        if self.tokens is not None:
            tokens = {
                "input": self.input,
                "output": self.output,
                "cache_read": self.cache_read,
                "cache_write": self.cache_write,
            }
        cost = round(self.cost_usd, 6) if self.cost_usd is not None else None
        return {"cost_usd": cost, "tokens": tokens}

    def cost_text(self) -> str:
        """``$0.0123`` (``≥`` when some turns reported none), ``unknown`` when none did."""
        if self.cost_usd is None:
            return "unknown"
        floor = "≥ " if self.unknown else ""
        digits = 4 if self.cost_usd < 1 else 2
        return f"{floor}${self.cost_usd:.{digits}f}"

    def line(self) -> str:
        """The spend in one line for people: cost, tokens, and what is not known."""
        return "Spend: " + self.said()

    def said(self) -> str:
        """:meth:`line` without its label (``$0.42 · 1,200 tokens (…)``)."""
        if not self.known:
            return "unknown (the agent reports neither cost nor tokens)"
        parts = []
        if self.cost_usd is not None:
            parts.append(self.cost_text())
        elif self.tokens is not None:
            parts.append("cost unknown")
        if self.tokens is not None:
            said = f"{self.tokens:,} tokens"
            details = [
                f"{value:,} {name}"
                for name, value in (
                    ("in", self.input),
                    ("out", self.output),
                    ("from cache", self.cache_read),
                    ("to cache", self.cache_write),
                )
                if value
            ]
            parts.append(f"{said} ({', '.join(details)})" if details else said)
        if self.unknown:
            parts.append(f"{self.unknown} of {self.turns} turns reported nothing")
        return " · ".join(parts)


@dataclass(frozen=True, slots=True)
class Budget:
    """How far a run may spend: USD, tokens, or both (None: no cap of that kind)."""

    usd: float | None = None
    tokens: int | None = None

    def __post_init__(self) -> None:
        if self.usd is not None and not self.usd > 0:
            raise ValueError(f"a budget is more than $0, not {self.usd}")
        if self.tokens is not None and not self.tokens > 0:
            raise ValueError(f"a token budget is more than 0 tokens, not {self.tokens}")

    @classmethod
    def given(cls, usd: float | None, tokens: int | None) -> Budget | None:
        """A budget from ``--budget USD`` / ``--budget-tokens N`` (None: neither given).

        Raises:
            ConfigError: a budget of nothing or less.
        """
        if usd is None and tokens is None:
            return None
        try:
            return cls(usd=usd, tokens=tokens)
        except ValueError as exc:
            raise ConfigError(f"--budget: {exc}") from exc

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Budget | None:
        """The budget a run's recorded configuration holds (None: none)."""
        usd, tokens = config.get("budget_usd"), config.get("budget_tokens")
        if usd is None and tokens is None:
            return None
        return cls(float(usd) if usd is not None else None, int(tokens) if tokens else None)

    def to_config(self) -> dict[str, Any]:
        return {"budget_usd": self.usd, "budget_tokens": self.tokens}

    def used(self, spend: Spend) -> float:
        """The share of the budget ``spend`` used (the larger of its USD and tokens)."""
        shares = [0.0]
        if self.usd is not None and spend.cost_usd is not None:
            shares.append(spend.cost_usd / self.usd)
        if self.tokens is not None and spend.tokens is not None:
            shares.append(spend.tokens / self.tokens)
        return max(shares)

    def refusal_for(self, agent: str) -> str | None:
        """Why this budget could never stop a run of ``agent`` (None: it can)."""
        if agent == "command":
            return None
        reports = _REPORTS.get(agent, "")
        if self.usd is not None and "cost" in reports:
            return None
        if self.tokens is not None and "tokens" in reports:
            return None
        if "tokens" in reports:
            return f"{agent} reports tokens, not cost: give its budget in tokens (--budget-tokens)"
        return f"{agent} reports neither cost nor tokens: a budget cannot stop its runs"

    def spent_text(self, spend: Spend) -> str:
        """What ``spend`` used of this budget, in its units."""
        if self.usd is not None and spend.cost_usd is not None:
            return spend.cost_text()
        return f"{spend.tokens or 0:,} tokens"

    def text(self) -> str:
        parts = []
        if self.usd is not None:
            parts.append(f"${self.usd:.{4 if self.usd < 1 else 2}f}")
        if self.tokens is not None:
            parts.append(f"{self.tokens:,} tokens")
        return " or ".join(parts)

    def raised(self) -> Budget:
        """Twice as much (what an admin's "raise and go on" gives)."""
        return Budget(
            self.usd * 2 if self.usd is not None else None,
            self.tokens * 2 if self.tokens is not None else None,
        )
