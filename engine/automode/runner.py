"""The execution half of auto mode: run one prompt verbatim, carry the exit code back."""

from __future__ import annotations

from engine.errors import TurnExecError, TurnIOError
from engine.turn import AgentSession, TurnOutput

__all__ = ["AutoModeRunner"]


class AutoModeRunner:
    """An :class:`~engine.turn.AgentSession` wrapping any agent session.

    Deliberately dumb: it runs the prompt it is given, unchanged, and returns the turn's
    output with its exit code. A process that ran and exited non-zero is a result, not
    an error: the channel decides what it means for the phase. Only a failure to spawn
    or to capture the process is an error (:class:`~engine.errors.TurnExecError`); a
    person pre-empting the turn stays :class:`~engine.errors.TurnPreempted`.
    """

    def __init__(self, agent: AgentSession) -> None:
        self.agent = agent
        self.turns = 0

    @property
    def session_id(self) -> str:
        return self.agent.session_id

    async def run_turn(self, prompt: str) -> TurnOutput:
        self.turns += 1
        try:
            return await self.agent.run_turn(prompt)
        except TurnIOError as exc:
            raise TurnExecError(f"capturing the agent's output failed: {exc}") from exc
