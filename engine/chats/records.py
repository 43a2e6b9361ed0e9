"""What the chat mode keeps of a place: its binding to a session and its queue of messages.

A front end stores them (the bot in its own tables); the chat mode reads and settles them
through :class:`ChatQueue`, which says nothing of how or where they are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.runs.spec import PlaceId

__all__ = ["Binding", "ChatQueue", "PromptRow"]


@dataclass(frozen=True, slots=True)
class Binding:
    """A chat (or forum topic) bound to one agent session."""

    chat_id: PlaceId
    #: Its topic (None: the chat itself).
    thread_id: PlaceId | None
    agent: str
    project: str
    #: Its folder here ("" when its turns run on the workers: the folder is on a worker).
    workdir: str
    session_id: str
    turns: int
    run_id: str | None
    #: Who bound it (the starter of its runs, for tool approvals).
    bound_by: int | None = None
    #: The model asked for (None: the agent's default).
    model: str | None = None


@dataclass(frozen=True, slots=True)
class PromptRow:
    """One message of a place's queue."""

    id: int
    chat_id: PlaceId
    #: Its topic (None: the chat itself).
    thread_id: PlaceId | None
    #: The front end's id of what brought the message (the bot: a Telegram update).
    update_id: int | None
    user_id: int | None
    body: str
    state: str
    run_id: str | None
    turn_id: int | None


class ChatQueue(Protocol):
    """A front end's bindings and message queues, as the chat mode uses them."""

    async def bind(
        self,
        chat_id: PlaceId,
        thread_id: PlaceId | None,
        *,
        agent: str,
        project: str,
        workdir: str,
        session_id: str,
        user_id: int | None,
        model: str | None = None,
    ) -> Binding: ...

    async def binding(self, chat_id: PlaceId, thread_id: PlaceId | None) -> Binding | None: ...

    async def set_binding_run(
        self, chat_id: PlaceId, thread_id: PlaceId | None, run_id: str | None
    ) -> None: ...

    async def set_binding_model(
        self, chat_id: PlaceId, thread_id: PlaceId | None, model: str | None
    ) -> None:
        """The place's model from its next run on (None: the agent's default)."""
        ...

    async def queue_prompt(
        self,
        chat_id: PlaceId,
        thread_id: PlaceId | None,
        *,
        update_id: int | None,
        user_id: int | None,
        body: str,
        depth: int,
    ) -> tuple[bool, int]:
        """Queue a message (refused beyond ``depth`` waiting); (queued, how many wait)."""
        ...

    async def hold_for_steering(
        self,
        chat_id: PlaceId,
        thread_id: PlaceId | None,
        *,
        update_id: int | None,
        user_id: int | None,
        body: str,
    ) -> int | None:
        """Keep a message on its way into the running turn (None: it was queued instead)."""
        ...

    async def steering_done(self, prompt_id: int, *, delivered: bool) -> None: ...

    async def queued_count(self, chat_id: PlaceId, thread_id: PlaceId | None) -> int: ...

    async def take_prompt(
        self, chat_id: PlaceId, thread_id: PlaceId | None, run_id: str, seq: int
    ) -> tuple[PromptRow, int] | None:
        """The oldest queued message, its turn ``seq`` of ``run_id`` started with it in one
        transaction: (the message, the turn's id); None when nothing waits."""
        ...

    async def end_prompt(self, prompt_id: int, state: str, *, requeue: bool = False) -> None: ...

    async def drop_queued(self, chat_id: PlaceId, thread_id: PlaceId | None) -> int: ...

    async def chats_with_queued(self) -> list[tuple[PlaceId, PlaceId | None]]: ...
