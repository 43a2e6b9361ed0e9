"""An autopilot drive's budget: what its phases' turns spent, and whether it may go on.

A drive given a budget (``turnstile autopilot --budget USD`` / ``--budget-tokens N``)
counts what each of its agent turns reported, its sub-tasks' (a wave's) included, from
the moment it starts. It is checked after a turn ends, never in one: at 80 % the people
following the drive are told once; a drive over its budget starts no other turn, phase or
sub-task, and says so (see :class:`engine.gates.autopilot.Autopilot`).
"""

from __future__ import annotations

from engine.spend import BUDGET_WARN_AT, Budget, Spend
from engine.turn import TurnOutput

__all__ = ["DriveBudget"]


class DriveBudget:
    """What a drive may spend and what its turns have spent so far.

    Attributes:
        budget: the cap (USD, tokens, or both).
        spent: what the drive's turns reported, summed.
    """

    def __init__(self, budget: Budget, *, spent: Spend | None = None) -> None:
        self.budget = budget
        self.spent = spent if spent is not None else Spend()
        # A drive that goes on past 80 % (a step on the workers) was told already.
        self._warned = self.budget.used(self.spent) >= BUDGET_WARN_AT

    @property
    def over(self) -> bool:
        """Whether the turns so far spent the whole budget (no other turn may start)."""
        return self.budget.used(self.spent) >= 1

    def add(self, out: TurnOutput) -> str | None:
        """Count one ended turn; what to tell people now (at 80 %, once), else None."""
        return self.reached(self.spent + Spend.of_turn(out.metadata))

    def reached(self, spent: Spend) -> str | None:
        """The drive has spent ``spent`` in all (read from the store: a step on the
        workers, its sibling sub-tasks' turns counted too); what to tell people now."""
        self.spent = spent
        if self._warned or self.over or self.budget.used(self.spent) < BUDGET_WARN_AT:
            return None
        self._warned = True
        return (
            f"💰 This drive has spent {self.spent_text()} of its budget "
            f"({self.budget.text()}): it stops after the turn that reaches it."
        )

    def spent_text(self) -> str:
        """What was spent, in the budget's own units."""
        return self.budget.spent_text(self.spent)

    def stopped_text(self) -> str:
        """The sentence a drive its budget stopped ends with."""
        return f"Stopped by its budget: {self.spent_text()} of {self.budget.text()} spent"
