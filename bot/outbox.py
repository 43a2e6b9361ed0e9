"""The one sender that drains the persistent outbox into Telegram.

Messages are committed to the outbox first; this sender delivers them in order, one at a
time, through the bot's rate limiter (``AIORateLimiter`` with retries honours
``RetryAfter``). Network errors, timeouts and 5xx answers are retried with backoff; a
row is marked sent only after Telegram accepted it, so a restart delivers what was left.
Live messages (run status, gates, a turn's progress) are edited in place, throttled per
chat: at most one edit each ``edit_interval`` in a private chat, three times slower in a
group (Telegram allows a group 20 messages a minute; sends count against the same pause).
An edit that takes buttons away (a decided gate, a phase that ended) is urgent: it goes
before the messages queued to send and is not held back by that pace (people must not
press a decided gate's buttons); only a pause Telegram asked for (a 429) holds it.
Telegram's answer sets the pace too: a 429 in a chat (seen by :class:`PacedRateLimiter`,
which still retries the call) spaces that chat's later edits at least ``retry_after``
apart, twice as far as before, easing back by a quarter with each edit that goes through.
An edit is never dropped: a live message stays due until its latest body was sent.

Answers to people who may not use the bot ("not allowed") go through a second, bounded
lane in memory, sent only when nothing else is waiting: a flood of strangers can never
delay a real answer, and beyond the bound a refusal is not answered (the handler audits
that). They are courtesy replies to people without a right: not kept over a restart.

A refusal Telegram will repeat (a chat that blocked or removed the bot, an unknown chat)
marks the row failed for good, with an audit entry. A 401/404 is first checked with
``getMe``: when the token itself is refused (revoked in BotFather), nothing is marked
failed, the sender stops and says so through ``on_token_refused`` (the bot then stops with
that error). Another 401, or a 403 not saying the chat is gone, may pass: the row is tried
again with the back-off, ``refusal_retries`` times, before it is failed for good.

When Telegram answered success but the answer cannot be read (not JSON, not a message),
the message is in the chat: it is recorded delivered, with no message id (a live message
then goes on as a new one, chatfront.store), never sent twice. A send that timed out or lost its
connection is sent again: most such failures come before Telegram has the message, and an
answer that never arrives is worse than one that arrives twice (docs/telegram.md).
The database being away a moment (an outage) pauses the sender with the same back-off.

Long: the one sender is one loop with its refusals, pacing and live-message edits; split
up, each part would need the others' state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import warnings
from collections import deque
from collections.abc import Callable
from pathlib import Path
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
    TimedOut,
)
from telegram.ext import AIORateLimiter

from chatfront.store import BotStore, LiveMessage, OutboxItem, OutboxRow
from engine.aio import raise_if_cancelled
from engine.errors import StoreUnreachableError

__all__ = ["OutboxSender", "PacedRateLimiter", "retry_seconds"]

_LOGGER = logging.getLogger(__name__)
_MAX_BACKOFF: Final = 30.0
# The slowest a chat's edits get after 429s (seconds between two edits).
_MAX_EDIT_INTERVAL: Final = 60.0
# Each edit that goes through brings a slowed chat's pace this much back.
_EASE: Final = 0.75
# Seconds to upload one document from disk (up to 45 MB on a slow uplink).
_UPLOAD_TIMEOUT: Final = 300.0
# How often a passing refusal (a 401 with a valid token, a 403 not saying the chat is gone)
# is tried again, with the sender's back-off, before the message is failed for good.
_REFUSAL_RETRIES: Final = 5
# What Telegram says in a 403 when the chat is gone for the bot (it will say it again).
_GONE: Final = ("blocked", "kicked", "not a member", "deactivated", "deleted", "can't")


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

    on_retry_after: Callable[[int, float], None] | None = None

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
                if self.on_retry_after is not None and isinstance(chat_id, int):
                    self.on_retry_after(chat_id, retry_seconds(exc))
                raise

        if endpoint in _EDITS:
            # Telegram's 20 a minute in a group counts messages sent; the outbox paces its
            # edits itself, and an urgent one (a decided gate) must not wait a minute
            # behind the messages just sent. The overall limit still holds.
            data = {k: v for k, v in data.items() if k != "chat_id"}
        return await super().process_request(noticed, args, kwargs, endpoint, data, rate_limit_args)


_EDITS: Final = frozenset({"editMessageText", "editMessageReplyMarkup"})


def _drop_spool(item: OutboxItem) -> None:
    if item.kind == "file":
        with contextlib.suppress(OSError):
            Path(item.body).unlink()


def _not_modified(exc: BadRequest) -> bool:
    return "message is not modified" in exc.message.lower()


def _gone(exc: Forbidden) -> bool:
    """A 403 saying the chat is gone for the bot (blocked, removed): it will not pass."""
    return any(words in exc.message.lower() for words in _GONE)


def _unauthorized(exc: InvalidToken) -> bool:
    """A 401 (PTB raises InvalidToken for 404 too, which names the method it cannot find)."""
    return "unauthorized" in exc.message.lower()


class _RefusedForNow(Exception):
    """Telegram refused a send in a way that may pass: tried again after the back-off."""


class _Unreadable:
    """The answer of a send Telegram took could not be read: delivered, id unknown."""


_UNREADABLE: Final = _Unreadable()


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
        on_token_refused: Callable[[str], Any] | None = None,
        first_backoff: float = 0.5,
        refusal_backlog: int = 20,
        refusal_retries: int = _REFUSAL_RETRIES,
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
        self._on_token_refused = on_token_refused
        self.token_refused: str | None = None
        self._first_backoff = first_backoff
        self._last_edit: dict[str, float] = {}
        self._last_in_chat: dict[int, float] = {}
        # Chats Telegram asked to slow down: their seconds between two edits.
        self._slowed: dict[int, float] = {}
        self._just_slowed: set[int] = set()  # the retried call itself does not ease
        # Until when Telegram asked a chat to wait (its last 429): even urgent edits do.
        self._held: dict[int, float] = {}
        self._refusals: deque[OutboxItem] = deque()
        self._refusal_backlog = refusal_backlog
        self._refusal_retries = refusal_retries
        # Passing refusals so far, per outbox row (an int) or live message (its ref).
        self._refused: dict[int | str, int] = {}
        self.sent = 0
        self.failed = 0

    def interval(self, chat_id: int) -> float:
        """Seconds between two edits in ``chat_id``: a group (negative id) gets a third of
        a private chat's pace, its 20 messages a minute shared with new messages."""
        base = self._edit_interval * (3 if chat_id < 0 else 1)
        return max(base, self._slowed.get(chat_id, 0.0))

    def slow_down(self, chat_id: int, retry_after: float) -> None:
        """Telegram answered 429 in ``chat_id``: its edits go at least ``retry_after``
        apart, and twice as far apart as they did."""
        interval = max(2 * self.interval(chat_id), retry_after)
        self._slowed[chat_id] = min(interval, _MAX_EDIT_INTERVAL)
        self._just_slowed.add(chat_id)
        _LOGGER.info("chat %s: edits slowed to one each %.1fs", chat_id, self._slowed[chat_id])
        # No edit of that chat before ``retry_after`` from now.
        self._held[chat_id] = max(self._held.get(chat_id, 0.0), self._clock() + retry_after)
        self._last_in_chat[chat_id] = max(
            self._last_in_chat.get(chat_id, 0.0),
            self._clock() + retry_after - self.interval(chat_id),
        )

    def _eased(self, chat_id: int) -> None:
        slowed = self._slowed.get(chat_id)
        if slowed is None or chat_id in self._just_slowed:
            self._just_slowed.discard(chat_id)
            return
        slowed *= _EASE
        if slowed <= self._edit_interval * (3 if chat_id < 0 else 1):
            del self._slowed[chat_id]
        else:
            self._slowed[chat_id] = slowed

    def wake(self) -> None:
        self._idle.clear()
        self._wake.set()

    def offer_refusal(self, item: OutboxItem) -> bool:
        """Queue a "not allowed" answer in the low-priority lane; False when it is full."""
        if len(self._refusals) >= self._refusal_backlog or self._stopping:
            return False
        self._refusals.append(item)
        self.wake()
        return True

    @property
    def waiting_refusals(self) -> int:
        return len(self._refusals)

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
            except (TimedOut, NetworkError, _RefusedForNow) as exc:
                _LOGGER.warning("delivery failed (%s); retrying in %.1fs", exc, backoff)
                await self._pause(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF)
                continue
            except RetryAfter as exc:
                seconds = retry_seconds(exc)
                _LOGGER.warning("flood limit: waiting %.1fs", seconds)
                await self._pause(float(seconds) + 0.1)
                continue
            except StoreUnreachableError as exc:  # an outage: the rows wait in the database
                raise_if_cancelled()
                _LOGGER.warning("cannot read the outbox (%s); retrying in %.1fs", exc, backoff)
                await self._pause(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF)
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
            if self.token_refused is not None:
                return False
            self.wake()
            try:
                await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return False
            if not await self._store.pending_outbox():
                return True

    async def _step(self) -> tuple[bool, float | None]:
        """Deliver one thing. Returns (did something, seconds until an edit is due)."""
        due_in: float | None = None
        now = self._clock()
        dirty = await self._store.dirty_live()
        for live in dirty:
            if not live.urgent:
                break  # (urgent ones come first)
            # Buttons taken away (a gate decided): ahead of the queued messages and of
            # the edit pace; only a flood pause Telegram asked for holds it back.
            wait = self._held.get(live.chat_id, 0.0) - now
            if wait > 0:
                due_in = wait if due_in is None else min(due_in, wait)
                continue
            await self._edit(live)
            return True, None
        row = await self._store.next_outbox()
        if row is not None:
            await self._deliver(row)
            return True, None
        for live in dirty:
            interval = self.interval(live.chat_id)
            last = max(
                self._last_edit.get(live.ref, -interval),
                self._last_in_chat.get(live.chat_id, -interval),
            )
            if now - last < interval:
                wait = interval - (now - last)
                due_in = wait if due_in is None else min(due_in, wait)
                continue
            await self._edit(live)
            return True, None
        if self._refusals:
            await self._deliver_refusal(self._refusals[0])
            self._refusals.popleft()
            return True, None
        return False, due_in

    async def _deliver_refusal(self, item: OutboxItem) -> None:
        """One answer of the refusal lane; a network error or flood limit leaves it first."""
        try:
            await self._send(OutboxRow(id=0, item=item, attempts=0))
        except (NetworkError, RetryAfter):
            raise
        except InvalidToken as exc:
            if await self._token_refused(exc):
                return
            _LOGGER.warning("a refusal to chat %s was not delivered: %s", item.chat_id, exc)
        except TelegramError as exc:
            # A stranger who blocked the bot: nothing to keep (the refusal is audited).
            _LOGGER.info("a refusal to chat %s was not delivered: %s", item.chat_id, exc)

    async def _deliver(self, row: OutboxRow) -> None:
        # A "file" row's document is removed once the row is settled (sent, or given up in
        # _give_up); a row left pending keeps it for the next attempt.
        item = row.item
        await self._store.outbox_sending(row.id)
        try:
            message = await self._send(row)
        except OSError as exc:
            # The document of a spilled output is gone from disk: nothing can send it.
            await self._give_up(row, f"the file to send cannot be read ({exc.strerror})")
            return
        except ChatMigrated as exc:
            new_chat = int(exc.new_chat_id)
            _LOGGER.info("chat %s migrated to %s; following it", item.chat_id, new_chat)
            await self._store.outbox_not_sent(row.id)
            await self._store.migrate_chat(item.chat_id, new_chat)
            if self._on_migrate is not None:
                self._on_migrate(item.chat_id, new_chat)
            return
        except BadRequest as exc:
            await self._fallback(row, exc)
            return
        except InvalidToken as exc:
            if await self._token_refused(exc):
                return
            if _unauthorized(exc):
                await self._refused_for_now(row, exc)
            await self._give_up(row, exc.message)
            return
        except Forbidden as exc:
            if not _gone(exc):
                await self._refused_for_now(row, exc)
            await self._give_up(row, exc.message)
            return
        except (NetworkError, RetryAfter):
            # Retried later (BadRequest, a NetworkError too, was handled above). A send that
            # timed out may still have arrived: see the module's docstring.
            await self._store.outbox_not_sent(row.id)
            raise
        except TelegramError as exc:
            # Anything else Telegram refuses (an unknown endpoint...) would refuse again.
            await self._give_up(row, exc.message)
            return
        await self._delivered(row, message)

    async def _delivered(self, row: OutboxRow, message: Message | _Unreadable) -> None:
        item = row.item
        self.sent += 1
        self._refused.pop(row.id, None)
        message_id = message.message_id if isinstance(message, Message) else None
        await self._store.outbox_sent(row, message_id)
        _drop_spool(item)
        self._last_in_chat[item.chat_id] = self._clock()

    async def _refused_for_now(self, row: OutboxRow, exc: TelegramError) -> None:
        """A refusal that may pass: raises to try the row again after the back-off, until
        it was refused ``refusal_retries`` times (then returns: the caller gives up)."""
        attempt = self._again(row.id)
        if attempt is None:
            return
        await self._store.outbox_not_sent(row.id)
        raise _RefusedForNow(
            f"message {row.id} to chat {row.item.chat_id} refused ({exc.message}),"
            f" attempt {attempt} of {self._refusal_retries + 1}"
        ) from exc

    def _again(self, key: int | str) -> int | None:
        """Count one more passing refusal of ``key``: its attempt, None when spent."""
        seen = self._refused.get(key, 0) + 1
        if seen > self._refusal_retries:
            self._refused.pop(key, None)
            return None
        self._refused[key] = seen
        return seen

    async def _fallback(self, row: OutboxRow, exc: BadRequest) -> None:
        """A refused message is sent once more without what Telegram objected to."""
        item = row.item
        text = exc.message.lower()
        try:
            if item.entities and "entit" in text:
                # The converter produced entities Telegram refuses: send the same text
                # without formatting rather than dropping it.
                _LOGGER.warning("entities refused for outbox %s: %s", row.id, exc.message)
                await self._delivered(row, await self._send(row, with_entities=False))
                return
            if item.reply_to is not None and "repl" in text:
                await self._delivered(row, await self._send(row, reply=False))
                return
        except BadRequest as again:
            exc = again
        await self._give_up(row, exc.message)

    async def _give_up(self, row: OutboxRow, error: str) -> None:
        """A permanent refusal: the row is failed for good, logged and audited."""
        _LOGGER.error(
            "message %s to chat %s not delivered: Telegram refused it (%s)",
            row.id,
            row.item.chat_id,
            error,
        )
        self.failed += 1
        self._refused.pop(row.id, None)
        await self._store.outbox_failed(row, error)
        _drop_spool(row.item)

    async def _token_refused(self, exc: InvalidToken) -> bool:
        """Whether a 401/404 means the token itself is refused (``getMe`` fails too).

        Telegram answers 404 for an unknown method and 401/404 for a bad token: only a
        failing ``getMe`` tells a revoked token from one message it will not take. When
        the token is refused the sender stops; the row stays pending for a new token.
        """
        try:
            await self._bot.get_me()
        except InvalidToken:
            pass
        else:
            return False
        self.token_refused = exc.message
        _LOGGER.error("Telegram refused the bot token (%s); delivery stops", exc.message)
        self.stop()
        if self._on_token_refused is not None:
            self._on_token_refused(exc.message)
        return True

    async def _send(
        self, row: OutboxRow, *, with_entities: bool = True, reply: bool = True
    ) -> Message | _Unreadable:
        """Send ``row``; :data:`_UNREADABLE` when Telegram took it but its answer cannot be
        read (PTB raises a TelegramError subclass for every refusal and network failure, a
        bare one for a success answer not JSON, a reading error for one not a message)."""
        try:
            return await self._call(row, with_entities=with_entities, reply=reply)
        except TelegramError as exc:
            if type(exc) is not TelegramError:
                raise
            detail: BaseException = exc
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            detail = exc
        _LOGGER.warning(
            "message %s to chat %s: Telegram took it but its answer could not be read (%s);"
            " recorded as delivered, not sent again",
            row.id,
            row.item.chat_id,
            f"{type(detail).__name__}: {detail}"[:200],
        )
        return _UNREADABLE

    async def _call(self, row: OutboxRow, *, with_entities: bool, reply: bool) -> Message:
        item = row.item
        entities = _entities(item.entities) if with_entities else None
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
                    chat_id=item.chat_id,
                    document=InputFile(fh, filename=item.filename, read_file_handle=False),
                    caption=item.caption,
                    message_thread_id=item.thread_id,
                    reply_parameters=reply_params,
                    reply_markup=_markup(item.markup),
                    disable_content_type_detection=True,
                    write_timeout=_UPLOAD_TIMEOUT,
                )
        if item.kind == "document":
            data = item.body.encode("utf-8")
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
        self._last_edit[live.ref] = self._last_in_chat[live.chat_id] = self._clock()
        passing: TelegramError | None = None
        try:
            await self._bot.edit_message_text(
                chat_id=live.chat_id,
                message_id=live.message_id,
                text=live.body,
                entities=_entities(live.entities),
                reply_markup=_buttons(live.markup),
            )
        except BadRequest as exc:
            if not _not_modified(exc):
                _LOGGER.warning("edit of %s refused: %s", live.ref, exc.message)
        except InvalidToken as exc:
            if await self._token_refused(exc):
                return
            passing = exc if _unauthorized(exc) else None
            _LOGGER.warning("edit of %s failed: %s", live.ref, exc)
        except Forbidden as exc:
            passing = None if _gone(exc) else exc
            _LOGGER.warning("edit of %s failed: %s", live.ref, exc)
        except (NetworkError, RetryAfter):
            raise
        except (TelegramError, KeyError, TypeError, ValueError, AttributeError) as exc:
            # A bare TelegramError or a reading error: the edit went through, its answer
            # could not be read (see _send). Any other refusal would come again.
            _LOGGER.warning("edit of %s: %s", live.ref, exc)
        else:
            self._eased(live.chat_id)
            self._refused.pop(live.ref, None)
        # The pause runs from the answer (a retried 429 took its retry_after).
        self._last_edit[live.ref] = self._last_in_chat[live.chat_id] = self._clock()
        if passing is not None:
            attempt = self._again(live.ref)
            if attempt is not None:
                # Left due: the same edit is tried again after the back-off.
                raise _RefusedForNow(
                    f"edit of {live.ref} refused ({passing.message}),"
                    f" attempt {attempt} of {self._refusal_retries + 1}"
                ) from passing
        await self._store.live_edited(live.ref, live.body, time.time(), urgent=live.urgent)
