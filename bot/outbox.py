"""The one sender that drains the persistent outbox into Telegram.

Messages are committed to the outbox first; this sender delivers them in order, one at a
time, through the bot's rate limiter (``AIORateLimiter`` with retries honours
``RetryAfter``). Network errors, timeouts and 5xx answers are retried with backoff; a
row is marked sent only after Telegram accepted it, so a restart delivers what was left.
Live messages (run status, gates) are edited in place, throttled per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from telegram import Bot, InlineKeyboardMarkup, Message, MessageEntity, ReplyParameters
from telegram.error import (
    BadRequest,
    ChatMigrated,
    Forbidden,
    InvalidToken,
    NetworkError,
    RetryAfter,
    TelegramError,
    TimedOut,
)

from bot.store import BotStore, LiveMessage, OutboxItem, OutboxRow

__all__ = ["OutboxSender", "retry_seconds"]

_LOGGER = logging.getLogger(__name__)
_MAX_BACKOFF: Final = 30.0


def _entities(raw: tuple[dict[str, Any], ...]) -> list[MessageEntity] | None:
    if not raw:
        return None
    return [e for e in (MessageEntity.de_json(d, None) for d in raw) if e is not None]


def _markup(raw: dict[str, Any] | None) -> InlineKeyboardMarkup | None:
    return InlineKeyboardMarkup.de_json(raw, None) if raw else None


def retry_seconds(exc: RetryAfter) -> float:
    """How long Telegram asked us to wait (read without PTB's deprecation warning)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        delay: Any = exc.retry_after
    return float(delay.total_seconds() if hasattr(delay, "total_seconds") else delay)


def _drop_spool(item: OutboxItem) -> None:
    if item.kind == "file":
        with contextlib.suppress(OSError):
            Path(item.body).unlink()


def _not_modified(exc: BadRequest) -> bool:
    return "message is not modified" in exc.message.lower()


class OutboxSender:
    """Delivers the outbox; call :meth:`wake` after queueing."""

    def __init__(
        self,
        bot: Bot,
        store: BotStore,
        *,
        edit_interval: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
        on_migrate: Callable[[int, int], Any] | None = None,
        first_backoff: float = 0.5,
    ) -> None:
        self._bot = bot
        self._store = store
        self._edit_interval = edit_interval
        self._clock = clock
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._stopping = False
        self._stopped = asyncio.Event()
        self._on_migrate = on_migrate
        self._first_backoff = first_backoff
        self._last_edit: dict[str, float] = {}
        self.sent = 0
        self.failed = 0

    def wake(self) -> None:
        self._idle.clear()
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._stopped.set()
        self._wake.set()

    async def wait_idle(self) -> None:
        """Return once nothing is left to deliver (pending rows and due edits)."""
        await self._idle.wait()

    async def run(self) -> None:
        """Deliver until :meth:`stop`; never returns early on a delivery error."""
        backoff = self._first_backoff
        while not self._stopping:
            # Cleared before looking, so a wake-up during the look is never lost.
            self._wake.clear()
            try:
                progressed, due_in = await self._step()
                backoff = self._first_backoff
            except (TimedOut, NetworkError) as exc:
                _LOGGER.warning("delivery failed (%s); retrying in %.1fs", exc, backoff)
                await self._pause(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF)
                continue
            except RetryAfter as exc:
                seconds = retry_seconds(exc)
                _LOGGER.warning("flood limit: waiting %.1fs", seconds)
                await self._pause(float(seconds) + 0.1)
                continue
            except Exception:
                # The one sender must outlive anything (a store hiccup, a library bug):
                # the row stays pending and is tried again.
                _LOGGER.exception("delivery step failed; retrying in %.1fs", backoff)
                await self._pause(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF)
                continue
            if progressed:
                continue
            if due_in is None:
                self._idle.set()
                await self._wake.wait()
            else:
                await self._sleep(due_in)

    async def _pause(self, seconds: float) -> None:
        """A back-off: only :meth:`stop` cuts it short (never a new message)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopped.wait(), timeout=seconds)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=seconds)

    async def drain(self, seconds: float) -> bool:
        """Deliver what is pending now, for at most ``seconds`` (shutdown)."""
        deadline = time.monotonic() + seconds
        while True:
            self.wake()
            try:
                await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return False
            if not await self._store.pending_outbox():
                return True

    async def _step(self) -> tuple[bool, float | None]:
        """Deliver one thing. Returns (did something, seconds until an edit is due)."""
        row = await self._store.next_outbox()
        if row is not None:
            await self._deliver(row)
            return True, None
        due_in: float | None = None
        now = self._clock()
        for live in await self._store.dirty_live():
            last = self._last_edit.get(live.ref)
            if last is not None and now - last < self._edit_interval:
                wait = self._edit_interval - (now - last)
                due_in = wait if due_in is None else min(due_in, wait)
                continue
            await self._edit(live)
            return True, None
        return False, due_in

    async def _deliver(self, row: OutboxRow) -> None:
        item = row.item
        try:
            message = await self._send(row)
        except ChatMigrated as exc:
            new_chat = int(exc.new_chat_id)
            _LOGGER.info("chat %s migrated to %s; following it", item.chat_id, new_chat)
            await self._store.migrate_chat(item.chat_id, new_chat)
            if self._on_migrate is not None:
                self._on_migrate(item.chat_id, new_chat)
            return
        except BadRequest as exc:
            fallback = await self._fallback(row, exc)
            if fallback is None:
                return
            message = fallback
        except (Forbidden, InvalidToken) as exc:
            _LOGGER.error("outbox %s cannot be delivered: %s", row.id, exc.message)
            self.failed += 1
            await self._store.outbox_failed(row, exc.message)
            _drop_spool(item)
            return
        except (NetworkError, RetryAfter):
            raise
        except TelegramError as exc:
            # Anything else Telegram refuses (an unknown endpoint...) would refuse again.
            _LOGGER.error("outbox %s refused: %s", row.id, exc.message)
            self.failed += 1
            await self._store.outbox_failed(row, exc.message)
            _drop_spool(item)
            return
        except FileNotFoundError:
            _LOGGER.error("outbox %s: the file to send is gone from the spool", row.id)
            self.failed += 1
            await self._store.outbox_failed(row, "the file to send is gone")
            return
        self.sent += 1
        await self._store.outbox_sent(row, message.message_id if message else None)
        _drop_spool(item)
        if item.ref is not None:
            self._last_edit[item.ref] = self._clock()

    async def _fallback(self, row: OutboxRow, exc: BadRequest) -> Message | None:
        """A refused message is sent once more without what Telegram objected to."""
        item = row.item
        text = exc.message.lower()
        try:
            if item.entities and "entit" in text:
                # The converter produced entities Telegram refuses: send the same text
                # without formatting rather than dropping it.
                _LOGGER.warning("entities refused for outbox %s: %s", row.id, exc.message)
                return await self._send(row, with_entities=False)
            if item.reply_to is not None and "repl" in text:
                return await self._send(row, reply=False)
        except BadRequest as again:
            exc = again
        _LOGGER.error("outbox %s refused by Telegram: %s", row.id, exc.message)
        self.failed += 1
        await self._store.outbox_failed(row, exc.message)
        _drop_spool(item)
        return None

    async def _send(
        self, row: OutboxRow, *, with_entities: bool = True, reply: bool = True
    ) -> Message:
        item = row.item
        entities = _entities(item.entities) if with_entities else None
        reply_params = (
            ReplyParameters(message_id=item.reply_to, allow_sending_without_reply=True)
            if reply and item.reply_to is not None
            else None
        )
        if item.kind in ("document", "file"):
            # A "file" row names a copy in the bot's spool folder (bot/files.py).
            data = (
                await asyncio.to_thread(Path(item.body).read_bytes)
                if item.kind == "file"
                else item.body.encode()
            )
            return await self._bot.send_document(
                chat_id=item.chat_id,
                document=data,
                filename=item.filename or "output.md",
                caption=item.caption,
                message_thread_id=item.thread_id,
                reply_parameters=reply_params,
                reply_markup=_markup(item.markup),
                disable_content_type_detection=True,
            )
        return await self._bot.send_message(
            chat_id=item.chat_id,
            text=item.body,
            entities=entities,
            message_thread_id=item.thread_id,
            reply_parameters=reply_params,
            reply_markup=_markup(item.markup),
            link_preview_options=None,
        )

    async def _edit(self, live: LiveMessage) -> None:
        assert live.message_id is not None
        self._last_edit[live.ref] = self._clock()
        try:
            await self._bot.edit_message_text(
                chat_id=live.chat_id,
                message_id=live.message_id,
                text=live.body,
                entities=_entities(live.entities),
                reply_markup=_markup(live.markup),
            )
        except BadRequest as exc:
            if not _not_modified(exc):
                _LOGGER.warning("edit of %s refused: %s", live.ref, exc.message)
        except (Forbidden, TelegramError) as exc:
            if isinstance(exc, NetworkError | RetryAfter):
                raise
            _LOGGER.warning("edit of %s failed: %s", live.ref, exc)
        await self._store.live_edited(live.ref, live.body, time.time())
