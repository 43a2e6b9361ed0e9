"""A chat front end's side of chat sessions: a turn's progress message, its answer in the
outbox.

The chat mode itself is the engine's (:class:`engine.chats.sessions.ChatSessions`); this
module is what it asks of a chat front end (:class:`~engine.chats.sessions.ChatFront`): a progress
message under the message that asked, the answer and the files it hands over queued in
the transaction that finishes the turn, and notes said in the chat.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from chatfront.progress import TurnProgress
from chatfront.publish import Publisher
from chatfront.store import Binding, BotStore, OutboxItem
from engine.chats.records import PromptRow
from engine.chats.sessions import ChatRun, TurnView
from engine.turn import TurnOutput

__all__ = ["OutboxChatFront", "OutputFiles"]

# The outbox messages for files an agent's output asks to send (the front end's files
# feature).
OutputFiles = Callable[[Binding, TurnOutput, str], Awaitable[list[OutboxItem]]]


class OutboxChatFront:
    """:class:`~engine.chats.sessions.ChatFront` in chats: said through the outbox."""

    def __init__(self, store: BotStore, publisher: Publisher) -> None:
        self.store = store
        self.publisher = publisher
        #: Set by the front end's files feature: the files a turn's answer hands over.
        self.output_files: OutputFiles | None = None
        #: Set by the front end's pause feature: the runs paused now, and what their
        #: progress says of it.
        self.paused: dict[str, str] = {}

    def open_turn(self, run: ChatRun, prompt: PromptRow) -> TurnView:
        b = run.binding
        progress = TurnProgress(
            self.publisher,
            chat_id=b.chat_id,
            thread_id=b.thread_id,
            run_id=run.run_id,
            turn=run.turn,
            reply_to=None,
            paused=self.paused,
        )
        progress.open_soon(self._message_of(prompt.update_id))
        return progress

    async def _message_of(self, update_id: int | None) -> int | None:
        """The message an update carried (what the turn's progress and answer reply to)."""
        return None if update_id is None else await self.store.message_of_update(update_id)

    async def publish_turn(
        self, run: ChatRun, prompt_id: int, turn_id: int, out: TurnOutput, view: TurnView | None
    ) -> None:
        b = run.binding
        progress = view if isinstance(view, TurnProgress) else None
        if progress is not None:
            await progress.opened()  # the answer replies where the progress does
        items = await self.publisher.output_items(
            out,
            chat_id=b.chat_id,
            thread_id=b.thread_id,
            run_id=run.run_id,
            reply_to=progress.reply_to if progress is not None else None,
        )
        if self.output_files is not None:
            # Files the agent hands over (TURNSTILE-SEND lines) follow its answer (on the
            # workers: read on the worker's disk and stored in the database).
            items += await self.output_files(b, out, run.run_id)
        await self.store.commit_turn(
            prompt_id, turn_id, out, items, chat_id=b.chat_id, thread_id=b.thread_id
        )
        self.publisher.wake()

    async def say(self, binding: Binding, text: str, *, run_id: str) -> None:
        await self.publisher.say(binding.chat_id, text, thread_id=binding.thread_id, run_id=run_id)

    def name(self, user_id: int) -> str:
        return self.publisher.people.name(user_id)
