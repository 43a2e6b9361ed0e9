"""An auto run's budget: after each turn it goes on, is told it nears its cap, or stops.

Checked after a turn ends, never in one: a run over its budget (``--budget``,
``TURNSTILE_RUN_BUDGET``) or whose chat is over today's (``TURNSTILE_DAILY_BUDGET``) stops
before its next turn, saying so; at 80 % of a cap the people following it are told, once
per cap. The caps live in the run's recorded configuration, so a resumed run and a run on
a worker keep them.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Protocol

from engine.automode.state import AutoModeState, AutoStatus
from engine.runs.spec import PlaceId
from engine.spend import BUDGET_WARN_AT, Budget, Spend

__all__ = ["STOPPED_BY_BUDGET", "check_budget"]

#: What a budget-stopped run records in its configuration (``stopped_by``).
STOPPED_BY_BUDGET = "budget"


class ChatSpend(Protocol):
    async def spend_in_chat(self, chat_id: PlaceId, *, since: float) -> Spend: ...


async def check_budget(
    state: AutoModeState, now: float, *, run: Spend, this_turn: Spend, store: ChatSpend
) -> tuple[AutoModeState, str | None]:
    """The run's state after its budgets were checked, and what to tell people (or None).

    Args:
        state: the state the turn that just ended leads to.
        run: what the run has spent, this turn included.
        this_turn: what this turn spent (not in the store yet).
    """
    if state.terminal:
        return state, None
    config = state.config
    caps: list[tuple[str, str, Budget, Spend]] = []
    budget = Budget.from_config(config)
    if budget is not None:
        caps.append(("run", "its budget", budget, run))
    daily, chat_id = config.get("daily_budget"), config.get("chat_id")
    if daily and chat_id is not None:
        midnight = time.mktime((*time.localtime(now)[:3], 0, 0, 0, 0, 0, -1))
        today = await store.spend_in_chat(str(chat_id), since=midnight) + this_turn
        caps.append(("day", "this chat's budget for today", Budget(usd=float(daily)), today))
    for _, what, limit, spent in caps:
        if limit.used(spent) >= 1:
            stopped = replace(
                state,
                status=AutoStatus.STOPPED,
                finished_at=now,
                message=f"Stopped by {what}: {limit.spent_text(spent)} of {limit.text()} spent",
                config={**config, "stopped_by": STOPPED_BY_BUDGET},
            )
            return stopped, None
    for key, what, limit, spent in caps:
        warned = f"budget_warned_{key}"
        if limit.used(spent) >= BUDGET_WARN_AT and not config.get(warned):
            note = (
                f"💰 Run {state.run_id} has spent {limit.spent_text(spent)} of {what} "
                f"({limit.text()}): it stops after the turn that reaches it."
            )
            return replace(state, config={**config, warned: True}), note
    return state, None
