"""What the engine's executors say beside a run's reports, as messages of the run's chat
(any chat front end's: the buttons are its :class:`~chatfront.sink.Controls`)."""

from __future__ import annotations

import logging

from chatfront.publish import Publisher
from chatfront.sink import BotSink, Controls
from chatfront.store import BotStore
from chatfront.text import status_ended
from engine.runs import ChatPlace
from engine.spend import Budget

__all__ = ["ChatNotices"]

_LOGGER = logging.getLogger(__name__)


class ChatNotices:
    """:class:`engine.executors.Notices` in a chat: a message named ``live`` is the bot's
    live message of that name, edited when said again."""

    def __init__(
        self, *, sink: BotSink, publisher: Publisher, store: BotStore, controls: Controls
    ) -> None:
        self.sink = sink
        self.publisher = publisher
        self.store = store
        self.controls = controls

    def follow(
        self, key: str, place: ChatPlace, *, task: str | None = None, run_id: str | None = None
    ) -> None:
        self.sink.register(key, place, task=task, key=run_id)

    def place_of_task(self, task: str) -> ChatPlace | None:
        return self.sink.place_of_task(task)

    async def notice(
        self, key: str, text: str, *, live: str | None = None, markdown: bool = False
    ) -> None:
        place = await self.sink.place(key)
        if place is None:
            _LOGGER.info("%s", text, extra={"run_id": key})
            return
        publisher = self.publisher
        if live is None:
            await publisher.say(
                place.chat_id, text, thread_id=place.thread_id, run_id=key, markdown=markdown
            )
            return
        await publisher.live(
            live,
            "" if markdown else text,
            markdown=text if markdown else None,
            chat_id=place.chat_id,
            thread_id=place.thread_id,
            run_id=key,
        )

    async def offer_more_budget(self, run_id: str, budget: Budget, spent: str) -> None:
        place = await self.sink.place(run_id)
        if place is None:
            return
        more = budget.raised()
        await self.publisher.say(
            place.chat_id,
            f"💰 Auto run {run_id} stopped at its budget of {budget.text()} ({spent} spent). "
            f"An admin can let it go on under {more.text()}.",
            thread_id=place.thread_id,
            run_id=run_id,
            markup=self.controls.raise_budget(run_id, more.text()),
        )

    async def shown(self, live: str) -> str | None:
        known = await self.store.get_live(live)
        return known.body if known is not None else None

    async def told_ended(self, run_id: str) -> bool:
        body = await self.shown(f"status:{run_id}")
        return body is not None and status_ended(body)

    async def gate_shown(self, task: str, phase: str) -> bool:
        return any(g.phase == phase for g in await self.store.open_gates_of(task))
