"""What every executor offers a front end, and what a front end hands an executor."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from engine.runs.spec import ChatPlace, PlaceId
from engine.spend import Budget

if TYPE_CHECKING:
    from engine.agents.base import ProcessAgent
    from engine.automode import AutoRun
    from engine.automode.run import ApprovalFor
    from engine.runs import Recovery

__all__ = [
    "AgentFactory",
    "Approvals",
    "AutoExecutor",
    "AutoRequest",
    "Notices",
    "Started",
    "Workdirs",
    "same_place",
    "wait_all",
]

#: Makes an agent process as :func:`engine.agents.factory.create_agent` does (the bot's
#: tests hand in fakes): chat sessions and drives alike.
AgentFactory = Callable[..., "ProcessAgent"]
#: Where a run of a project works: ``(project, run id, place) -> folder`` (a worktree of
#: its own, of a configured project or of the place's own workspace for ``default``).
Workdirs = Callable[[str, str, ChatPlace], Awaitable[Path]]
#: The route of a run's tool calls for ``(agent, person who started it)``; None: none ask.
Approvals = Callable[[str, "int | None"], "ApprovalFor | None"]


class Notices(Protocol):
    """What an executor tells the people following a run, beside the run's own reports.

    A message may have a name (``live``): said again under the same name, it is the same
    message, written again in place; names are the executor's (``stopping:RUN``).
    """

    def follow(
        self, key: str, place: ChatPlace, *, task: str | None = None, run_id: str | None = None
    ) -> None:
        """The reports of run ``key`` go to ``place`` from now on; ``task``: the task it
        drives; ``run_id``: set for a drive on the workers (the names of its messages are
        made from it, so a follower started again after a restart edits the same ones)."""
        ...

    def place_of_task(self, task: str) -> ChatPlace | None:
        """Where the reports of ``task`` go, when known."""
        ...

    async def notice(
        self, key: str, text: str, *, live: str | None = None, markdown: bool = False
    ) -> None:
        """Say ``text`` where ``key`` is followed (``markdown``: the text is Markdown);
        with ``live``, as the message of that name."""
        ...

    async def offer_more_budget(self, run_id: str, budget: Budget, spent: str) -> None:
        """The run stopped at its ``budget`` (having spent ``spent``): offer whoever may
        raise it to let it go on."""
        ...

    async def shown(self, live: str) -> str | None:
        """What the message named ``live`` says now (None: it was never said)."""
        ...

    async def told_ended(self, run_id: str) -> bool:
        """Whether the people following the run were told it ended (after a restart)."""
        ...

    async def gate_shown(self, task: str, phase: str) -> bool:
        """Whether the open gate of ``task``'s ``phase`` is shown to people already."""
        ...


@dataclass(frozen=True, slots=True)
class AutoRequest:
    """A new auto run asked for from a front end: it reports to ``place``; on ``default``
    it works in a worktree of the own workspace of ``asked_in`` (None: of ``place``), the
    chat or topic it was asked for in (a forum's run may report to a topic of its own)."""

    objective: str
    project: str
    place: ChatPlace
    user_id: int | None = None
    budget: Budget | None = None  # None: the settings' TURNSTILE_RUN_BUDGET, if any
    permissions: str | None = None  # a preset (guarded, trusted, free); None: the settings'
    asked_in: ChatPlace | None = None


@dataclass(frozen=True, slots=True)
class Started:
    """A run an executor took: its id, and whether it waits in a queue for a worker."""

    run_id: str
    agent: str
    queued: bool = False


class AutoExecutor(Protocol):
    """Auto runs for a front end, wherever they execute."""

    async def start(self, request: AutoRequest) -> Started:
        """Start (or queue) the run.

        Raises:
            ConfigError: bad input, or the project cannot be checked out.
        """
        ...

    def running_in(self, place: ChatPlace) -> list[AutoRun]:
        """The runs of ``place`` driven in this process, oldest first (steered by text)."""
        ...

    async def steerable(self, place: ChatPlace, *, whole_chat: bool = False) -> list[str]:
        """The ids of the unfinished runs of ``place`` (``whole_chat``: of any topic of its
        chat), oldest first: what a message there steers (steering itself is the same
        wherever a run executes: :func:`engine.automode.append.steer_run`)."""
        ...

    async def stop(self, run_id: str, *, chat_id: PlaceId) -> bool:
        """Stop the chat's run ``run_id``; False when the chat has none such."""
        ...

    async def stop_in(self, place: ChatPlace) -> list[str]:
        """Stop every run of ``place``; their ids."""
        ...

    async def status_lines(self, chat_id: PlaceId) -> list[str]:
        """One line (or two) per unfinished run of the chat, for a status listing."""
        ...

    async def raise_budget(self, run_id: str, budget: Budget, *, chat_id: PlaceId) -> str:
        """Let the chat's run its budget stopped go on under ``budget``; what to tell the
        person who raised it.

        Raises:
            ConfigError: the run cannot go on (not stopped by its budget, not here, a
                budget not larger than the last).
        """
        ...

    async def recover(self, report: Recovery) -> None:
        """At start-up: resume (or follow again) the runs the recovery found."""
        ...

    async def shutdown(self, *, park: bool) -> None:
        """Stop starting turns; with ``park``, pre-empt the running ones."""
        ...

    async def park_all(self) -> None:
        """Pre-empt every running turn now."""
        ...


def same_place(a: ChatPlace, b: ChatPlace) -> bool:
    """Whether two places are the same chat and topic."""
    return a.chat_id == b.chat_id and a.thread_id == b.thread_id


async def wait_all(tasks: list[asyncio.Task[None]]) -> None:
    """Wait for ``tasks`` (none: return at once)."""
    if tasks:
        await asyncio.wait(tasks)
