"""Telegram's end of the outbox: the sender's :class:`~chatfront.outbox.Transport` and the
rate limiter.

The sender itself (order, pacing, the refusal lane, retries, live messages) is
:class:`chatfront.outbox.OutboxSender`; this module is what it calls in Telegram: a send
(a message, a document, a spilled output's file streamed from disk), an edit, ``getMe``,
and python-telegram-bot's errors translated into the sender's own
(:class:`~chatfront.outbox.DeliveryError`). Every call goes through the bot's rate
limiter (``AIORateLimiter`` with retries honours ``RetryAfter``);
:class:`PacedRateLimiter` also tells the sender of each 429, so that chat's edits slow
down.

When Telegram answered success but the answer cannot be read (not JSON, not a message),
the message is in the chat: :meth:`TelegramTransport.send` says so (no message id), and
the sender records it delivered, never sent twice (docs/telegram.md).
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Callable
from typing import Any, Final

from telegram import (
    Bot,
    ForceReply,
    InlineKeyboardMarkup,
    InputFile,
    Message,
    MessageEntity,
    ReplyParameters,
)
from telegram.error import (
    BadRequest,
    ChatMigrated,
    Forbidden,
    InvalidToken,
    NetworkError,
    RetryAfter,
    TelegramError,
)
from telegram.ext import AIORateLimiter

from bot.places import telegram_chat, telegram_topic
from chatfront.outbox import (
    ChatMoved,
    CredentialsRefused,
    DeliveryError,
    FloodWait,
    Objected,
    Refused,
    Unreachable,
)
from chatfront.store import LiveMessage, OutboxItem
from engine.errors import ConfigError
from engine.runs.spec import PlaceId

__all__ = ["PacedRateLimiter", "TelegramTransport", "retry_seconds"]

# Seconds to upload one document from disk (up to 45 MB on a slow uplink).
_UPLOAD_TIMEOUT: Final = 300.0
# What Telegram says in a 403 when the chat is gone for the bot (it will say it again).
_GONE: Final = ("blocked", "kicked", "not a member", "deactivated", "deleted", "can't")
# A group's 20 messages a minute are shared with new messages: its edits go 3 times slower.
_GROUP_PACE: Final = 3.0
_EDITS: Final = frozenset({"editMessageText", "editMessageReplyMarkup"})


def _entities(raw: tuple[dict[str, Any], ...]) -> list[MessageEntity] | None:
    if not raw:
        return None
    return [e for e in (MessageEntity.de_json(d, None) for d in raw) if e is not None]


def _markup(raw: dict[str, Any] | None) -> InlineKeyboardMarkup | ForceReply | None:
    """Buttons, or a forced reply (``{"force_reply": true, "selective": true}``)."""
    if raw and raw.get("force_reply"):
        return ForceReply(selective=bool(raw.get("selective")))
    return _buttons(raw)


def _buttons(raw: dict[str, Any] | None) -> InlineKeyboardMarkup | None:
    """Buttons only: an edit cannot carry a forced reply."""
    return InlineKeyboardMarkup.de_json(raw, None) if raw and "inline_keyboard" in raw else None


def retry_seconds(exc: RetryAfter) -> float:
    """How long Telegram asked us to wait (read without PTB's deprecation warning)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        delay: Any = exc.retry_after
    return float(delay.total_seconds() if hasattr(delay, "total_seconds") else delay)


class PacedRateLimiter(AIORateLimiter):
    """PTB's rate limiter (it retries a 429 after ``retry_after``) that also tells
    ``on_retry_after(chat_id, seconds)`` about each 429, so the outbox slows that chat."""

    on_retry_after: Callable[[PlaceId, float], None] | None = None

    async def process_request(
        self,
        callback: Callable[..., Any],
        args: Any,
        kwargs: dict[str, Any],
        endpoint: str,
        data: dict[str, Any],
        rate_limit_args: int | None,
    ) -> Any:
        chat_id = data.get("chat_id")

        async def noticed(*a: Any, **kw: Any) -> Any:
            try:
                return await callback(*a, **kw)
            except RetryAfter as exc:
                if self.on_retry_after is not None and isinstance(chat_id, int | str):
                    self.on_retry_after(str(chat_id), retry_seconds(exc))
                raise

        if endpoint in _EDITS:
            # Telegram's 20 a minute in a group counts messages sent; the outbox paces its
            # edits itself, and an urgent one (a decided gate) must not wait a minute
            # behind the messages just sent. The overall limit still holds.
            data = {k: v for k, v in data.items() if k != "chat_id"}
        return await super().process_request(noticed, args, kwargs, endpoint, data, rate_limit_args)


def _gone(exc: Forbidden) -> bool:
    """A 403 saying the chat is gone for the bot (blocked, removed): it will not pass."""
    return any(words in exc.message.lower() for words in _GONE)


def _unauthorized(exc: InvalidToken) -> bool:
    """A 401 (PTB raises InvalidToken for 404 too, which names the method it cannot find)."""
    return "unauthorized" in exc.message.lower()


def _objected(exc: BadRequest) -> frozenset[Objected]:
    """What a 400 objects to that the message can go without: its entities, its reply."""
    text = exc.message.lower()
    found: set[Objected] = set()
    if "entit" in text:
        found.add("formatting")
    if "repl" in text:
        found.add("reply")
    return frozenset(found)


def delivery_error(exc: TelegramError) -> DeliveryError:
    """PTB's error of a send or an edit as the sender's (BadRequest and TimedOut are
    NetworkErrors in PTB: the order matters)."""
    if isinstance(exc, ChatMigrated):
        return ChatMoved(exc.message, str(exc.new_chat_id))
    if isinstance(exc, RetryAfter):
        return FloodWait(exc.message, retry_seconds(exc))
    if isinstance(exc, BadRequest):
        return Refused(exc.message, objected=_objected(exc))
    if isinstance(exc, NetworkError):
        return Unreachable(exc.message)
    if isinstance(exc, InvalidToken):
        return CredentialsRefused(exc.message, passing=_unauthorized(exc))
    if isinstance(exc, Forbidden):
        return Refused(exc.message, passing=not _gone(exc))
    # Anything else Telegram refuses (an unknown endpoint...) would refuse again.
    return Refused(exc.message)


class TelegramTransport:
    """:class:`chatfront.outbox.Transport` through a python-telegram-bot ``Bot``."""

    def __init__(self, bot: Bot) -> None:
        self._bot = bot

    def pace(self, chat_id: PlaceId) -> float:
        try:
            group = telegram_chat(chat_id) < 0  # (a group's id is negative)
        except ConfigError:
            group = False
        return _GROUP_PACE if group else 1.0

    async def credentials_work(self) -> bool:
        try:
            await self._bot.get_me()
        except InvalidToken:
            return False
        return True

    async def send(
        self, item: OutboxItem, *, formatted: bool = True, reply: bool = True
    ) -> int | None:
        # PTB raises a TelegramError subclass for every refusal and network failure, a bare
        # one for a success answer not JSON, a reading error for one not a message: those
        # two are messages Telegram took.
        try:
            message = await self._call(item, formatted=formatted, reply=reply)
        except ConfigError as exc:  # not a Telegram chat: it never will be
            raise Refused(str(exc)) from exc
        except TelegramError as exc:
            if type(exc) is not TelegramError:
                raise delivery_error(exc) from exc
            return None
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        return message.message_id

    async def _call(self, item: OutboxItem, *, formatted: bool, reply: bool) -> Message:
        chat_id, thread_id = telegram_chat(item.chat_id), telegram_topic(item.thread_id)
        entities = _entities(item.entities) if formatted else None
        reply_params = (
            ReplyParameters(message_id=item.reply_to, allow_sending_without_reply=True)
            if reply and item.reply_to is not None
            else None
        )
        if item.kind == "file":
            # A spilled output's redacted document: streamed from disk, never read whole
            # (httpx rewinds it when the rate limiter sends it again).
            fh = await asyncio.to_thread(open, item.body, "rb")
            with fh:
                return await self._bot.send_document(
                    chat_id=chat_id,
                    document=InputFile(fh, filename=item.filename, read_file_handle=False),
                    caption=item.caption,
                    message_thread_id=thread_id,
                    reply_parameters=reply_params,
                    reply_markup=_markup(item.markup),
                    disable_content_type_detection=True,
                    write_timeout=_UPLOAD_TIMEOUT,
                )
        if item.kind == "document":
            data = item.body.encode("utf-8")
            return await self._bot.send_document(
                chat_id=chat_id,
                document=data,
                filename=item.filename or "output.md",
                caption=item.caption,
                message_thread_id=thread_id,
                reply_parameters=reply_params,
                reply_markup=_markup(item.markup),
                disable_content_type_detection=True,
            )
        return await self._bot.send_message(
            chat_id=chat_id,
            text=item.body,
            entities=entities,
            message_thread_id=thread_id,
            reply_parameters=reply_params,
            reply_markup=_markup(item.markup),
            link_preview_options=None,
        )

    async def edit(self, live: LiveMessage) -> bool:
        assert live.message_id is not None
        try:
            await self._bot.edit_message_text(
                chat_id=telegram_chat(live.chat_id),
                message_id=live.message_id,
                text=live.body,
                entities=_entities(live.entities),
                reply_markup=_buttons(live.markup),
            )
        except BadRequest as exc:
            if "message is not modified" in exc.message.lower():
                return False
            raise delivery_error(exc) from exc
        except TelegramError as exc:
            raise delivery_error(exc) from exc
        except ConfigError as exc:  # not a Telegram chat
            raise Refused(str(exc)) from exc
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            # A reading error: the edit went through, its answer could not be read.
            raise Refused(f"{type(exc).__name__}: {exc}"[:200]) from exc
        return True
