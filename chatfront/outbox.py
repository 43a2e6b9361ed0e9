"""The one sender that drains the persistent outbox into a messenger.

Messages are committed to the outbox first; this sender delivers them in order, one at a
time, through the front end's :class:`Transport` (the messenger's send and edit calls,
its refusals translated into the :class:`DeliveryError` tree below). Network errors and
timeouts are retried with backoff; a row is marked sent only after the messenger accepted
it, so a restart delivers what was left. Live messages (run status, gates, a turn's
progress) are edited in place, throttled per chat: at most one edit each
``edit_interval``, times the transport's pace for that chat (Telegram's groups go three
times slower: 20 messages a minute, sends counting against the same pause). An edit
that takes buttons away (a decided gate, a phase that ended) is urgent: it goes before
the messages queued to send and is not held back by that pace (people must not press a
decided gate's buttons); only a pause the messenger asked for (:class:`FloodWait`) holds
it. The messenger's answer sets the pace too: a flood pause in a chat
(:meth:`OutboxSender.slow_down`) spaces that chat's later edits at least that far apart,
twice as far as before, easing back by a quarter with each edit that goes through. An
edit is never dropped: a live message stays due until its latest body was sent.

Answers to people who may not use the front end ("not allowed") go through a second,
bounded lane in memory, sent only when nothing else is waiting: a flood of strangers can
never delay a real answer, and beyond the bound a refusal is not answered (the handler
audits that). They are courtesy replies to people without a right: not kept over a
restart.

A refusal the messenger will repeat (a chat that blocked or removed the bot, an unknown
chat) marks the row failed for good, with an audit entry. A :class:`CredentialsRefused`
is first checked with :meth:`Transport.credentials_work`: when the front end's own
credentials are refused (a revoked token), nothing is marked failed, the sender stops and
says so through ``on_token_refused`` (the front end then stops with that error). A
refusal that may pass (``passing``) is tried again with the back-off,
``refusal_retries`` times, before the row is failed for good.

When the messenger took a message but its answer cannot be read, the transport says so
(no message id): it is recorded delivered (a live message then goes on as a new one,
chatfront.store), never sent twice. A send that timed out or lost its connection is sent
again: most such failures come before the messenger has the message, and an answer that
never arrives is worse than one that arrives twice (docs/telegram.md). The database
being away a moment (an outage) pauses the sender with the same back-off.

::

    DeliveryError            the messenger did not take a send or an edit
    ├── Unreachable          network, timeouts: tried again after the back-off
    ├── FloodWait            the messenger asked to wait ``seconds``
    ├── ChatMoved            the chat has a new id (``new_chat``): its rows follow it
    ├── CredentialsRefused   maybe the front end's own credentials; ``passing`` if not
    └── Refused              this message is refused; ``passing``: it may pass later;
                             ``objected``: what to leave out when sending it again
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, Literal, Protocol

from chatfront.store import BotStore, LiveMessage, OutboxItem, OutboxRow
from engine.aio import raise_if_cancelled
from engine.errors import StoreUnreachableError
from engine.runs.spec import PlaceId

__all__ = [
    "ChatMoved",
    "CredentialsRefused",
    "DeliveryError",
    "FloodWait",
    "Objected",
    "OutboxSender",
    "Refused",
    "Transport",
    "Unreachable",
]

_LOGGER = logging.getLogger(__name__)
_MAX_BACKOFF: Final = 30.0
# The slowest a chat's edits get after flood pauses (seconds between two edits).
_MAX_EDIT_INTERVAL: Final = 60.0
# Each edit that goes through brings a slowed chat's pace this much back.
_EASE: Final = 0.75
# How often a passing refusal is tried again, with the sender's back-off, before the
# message is failed for good.
_REFUSAL_RETRIES: Final = 5


#: What a messenger may object to in a message, that it takes the message without.
Objected = Literal["formatting", "reply"]


class DeliveryError(Exception):
    """The messenger did not take a send or an edit (see the module's tree)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Unreachable(DeliveryError):
    """The messenger could not be reached, or did not answer in time: tried again."""


class FloodWait(DeliveryError):
    """The messenger asked to wait ``seconds`` before the next call."""

    def __init__(self, message: str, seconds: float) -> None:
        super().__init__(message)
        self.seconds = seconds


class ChatMoved(DeliveryError):
    """The chat has a new id: what waits for it goes to ``new_chat``."""

    def __init__(self, message: str, new_chat: PlaceId) -> None:
        super().__init__(message)
        self.new_chat = new_chat


class CredentialsRefused(DeliveryError):
    """A refusal that may mean the front end's own credentials are refused (Telegram's
    401/404); ``passing`` when, if they are not, it may pass on another try."""

    def __init__(self, message: str, *, passing: bool) -> None:
        super().__init__(message)
        self.passing = passing


class Refused(DeliveryError):
    """This message (or edit) is refused: for good, unless ``passing``. ``objected``
    names what the messenger objected to, that it may take the message without."""

    def __init__(
        self,
        message: str,
        *,
        passing: bool = False,
        objected: frozenset[Objected] = frozenset(),
    ) -> None:
        super().__init__(message)
        self.passing = passing
        self.objected = objected


class Transport(Protocol):
    """A messenger's calls, for the sender: each raises a :class:`DeliveryError`."""

    async def send(
        self, item: OutboxItem, *, formatted: bool = True, reply: bool = True
    ) -> int | None:
        """Send ``item`` (without its formatting, or not as a reply, when told); the new
        message's id, None when the messenger took it but its answer cannot be read."""
        ...

    async def edit(self, live: LiveMessage) -> bool:
        """Edit ``live``'s message to its body and buttons; False when it showed that
        already."""
        ...

    async def credentials_work(self) -> bool:
        """Whether the messenger still takes the front end's credentials."""
        ...

    def pace(self, chat_id: PlaceId) -> float:
        """How much slower than the edit interval edits go in ``chat_id`` (1: as fast)."""
        ...


class _RefusedForNow(Exception):
    """The messenger refused a send in a way that may pass: tried again after the
    back-off."""


def _drop_spool(item: OutboxItem) -> None:
    if item.kind == "file":
        with contextlib.suppress(OSError):
            Path(item.body).unlink()


class OutboxSender:
    """Delivers the outbox; call :meth:`wake` after queueing."""

    def __init__(
        self,
        transport: Transport,
        store: BotStore,
        *,
        edit_interval: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
        on_migrate: Callable[[PlaceId, PlaceId], Any] | None = None,
        on_token_refused: Callable[[str], Any] | None = None,
        first_backoff: float = 0.5,
        refusal_backlog: int = 20,
        refusal_retries: int = _REFUSAL_RETRIES,
    ) -> None:
        self._transport = transport
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
        self._last_in_chat: dict[PlaceId, float] = {}
        # Chats the messenger asked to slow down: their seconds between two edits.
        self._slowed: dict[PlaceId, float] = {}
        self._just_slowed: set[PlaceId] = set()  # the retried call itself does not ease
        # Until when the messenger asked a chat to wait (its last flood pause): even
        # urgent edits do.
        self._held: dict[PlaceId, float] = {}
        self._refusals: deque[OutboxItem] = deque()
        self._refusal_backlog = refusal_backlog
        self._refusal_retries = refusal_retries
        # Passing refusals so far, per outbox row (an int) or live message (its ref).
        self._refused: dict[int | str, int] = {}
        self.sent = 0
        self.failed = 0

    def interval(self, chat_id: PlaceId) -> float:
        """Seconds between two edits in ``chat_id``: the edit interval times the
        transport's pace there (a Telegram group: 3), or slower after flood pauses."""
        return max(self._base_interval(chat_id), self._slowed.get(chat_id, 0.0))

    def _base_interval(self, chat_id: PlaceId) -> float:
        return self._edit_interval * self._transport.pace(chat_id)

    def slow_down(self, chat_id: PlaceId, retry_after: float) -> None:
        """The messenger asked ``chat_id`` to wait ``retry_after`` seconds: its edits go
        at least that far apart, and twice as far apart as they did."""
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

    def _eased(self, chat_id: PlaceId) -> None:
        slowed = self._slowed.get(chat_id)
        if slowed is None or chat_id in self._just_slowed:
            self._just_slowed.discard(chat_id)
            return
        slowed *= _EASE
        if slowed <= self._base_interval(chat_id):
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
            except (Unreachable, _RefusedForNow) as exc:
                _LOGGER.warning("delivery failed (%s); retrying in %.1fs", exc, backoff)
                await self._pause(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF)
                continue
            except FloodWait as exc:
                _LOGGER.warning("flood limit: waiting %.1fs", exc.seconds)
                await self._pause(exc.seconds + 0.1)
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
            # the edit pace; only a flood pause the messenger asked for holds it back.
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
        except (Unreachable, FloodWait):
            raise
        except CredentialsRefused as exc:
            if await self._token_refused(exc):
                return
            _LOGGER.warning("a refusal to chat %s was not delivered: %s", item.chat_id, exc)
        except DeliveryError as exc:
            # A stranger who blocked the bot: nothing to keep (the refusal is audited).
            _LOGGER.info("a refusal to chat %s was not delivered: %s", item.chat_id, exc)

    async def _deliver(self, row: OutboxRow) -> None:
        # A "file" row's document is removed once the row is settled (sent, or given up in
        # _give_up); a row left pending keeps it for the next attempt.
        item = row.item
        await self._store.outbox_sending(row.id)
        try:
            message_id = await self._send(row)
        except OSError as exc:
            # The document of a spilled output is gone from disk: nothing can send it.
            await self._give_up(row, f"the file to send cannot be read ({exc.strerror})")
            return
        except ChatMoved as exc:
            new_chat = exc.new_chat
            _LOGGER.info("chat %s migrated to %s; following it", item.chat_id, new_chat)
            await self._store.outbox_not_sent(row.id)
            await self._store.migrate_chat(item.chat_id, new_chat)
            if self._on_migrate is not None:
                self._on_migrate(item.chat_id, new_chat)
            return
        except CredentialsRefused as exc:
            if await self._token_refused(exc):
                return
            if exc.passing:
                await self._refused_for_now(row, exc)
            await self._give_up(row, exc.message)
            return
        except Refused as exc:
            if exc.objected:
                await self._fallback(row, exc)
                return
            if exc.passing:
                await self._refused_for_now(row, exc)
            await self._give_up(row, exc.message)
            return
        except (Unreachable, FloodWait):
            # Retried later. A send that timed out may still have arrived: see the
            # module's docstring.
            await self._store.outbox_not_sent(row.id)
            raise
        await self._delivered(row, message_id)

    async def _delivered(self, row: OutboxRow, message_id: int | None) -> None:
        item = row.item
        self.sent += 1
        self._refused.pop(row.id, None)
        await self._store.outbox_sent(row, message_id)
        _drop_spool(item)
        self._last_in_chat[item.chat_id] = self._clock()

    async def _refused_for_now(self, row: OutboxRow, exc: DeliveryError) -> None:
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

    async def _fallback(self, row: OutboxRow, exc: Refused) -> None:
        """A refused message is sent once more without what the messenger objected to."""
        item = row.item
        try:
            if item.entities and "formatting" in exc.objected:
                # The renderer produced formatting the messenger refuses: send the same
                # text without it rather than dropping it.
                _LOGGER.warning("formatting refused for outbox %s: %s", row.id, exc.message)
                await self._delivered(row, await self._send(row, formatted=False))
                return
            if item.reply_to is not None and "reply" in exc.objected:
                await self._delivered(row, await self._send(row, reply=False))
                return
        except Refused as again:
            if again.passing:
                raise
            exc = again
        await self._give_up(row, exc.message)

    async def _give_up(self, row: OutboxRow, error: str) -> None:
        """A permanent refusal: the row is failed for good, logged and audited."""
        _LOGGER.error(
            "message %s to chat %s not delivered: the messenger refused it (%s)",
            row.id,
            row.item.chat_id,
            error,
        )
        self.failed += 1
        self._refused.pop(row.id, None)
        await self._store.outbox_failed(row, error)
        _drop_spool(row.item)

    async def _token_refused(self, exc: CredentialsRefused) -> bool:
        """Whether a :class:`CredentialsRefused` means the front end's credentials are
        refused (:meth:`Transport.credentials_work` says no too).

        Telegram answers 404 for an unknown method and 401/404 for a bad token: only a
        failing ``getMe`` tells a revoked token from one message it will not take. When
        the credentials are refused the sender stops; the row stays pending for new ones.
        """
        if await self._transport.credentials_work():
            return False
        self.token_refused = exc.message
        _LOGGER.error("the messenger refused the credentials (%s); delivery stops", exc.message)
        self.stop()
        if self._on_token_refused is not None:
            self._on_token_refused(exc.message)
        return True

    async def _send(
        self, row: OutboxRow, *, formatted: bool = True, reply: bool = True
    ) -> int | None:
        """Send ``row``: its message id, None when the messenger took it but its answer
        cannot be read (recorded delivered, never sent again)."""
        message_id = await self._transport.send(row.item, formatted=formatted, reply=reply)
        if message_id is None:
            _LOGGER.warning(
                "message %s to chat %s: the messenger took it but its answer could not be"
                " read; recorded as delivered, not sent again",
                row.id,
                row.item.chat_id,
            )
        return message_id

    async def _edit(self, live: LiveMessage) -> None:
        assert live.message_id is not None
        self._last_edit[live.ref] = self._last_in_chat[live.chat_id] = self._clock()
        passing: DeliveryError | None = None
        try:
            changed = await self._transport.edit(live)
        except CredentialsRefused as exc:
            if await self._token_refused(exc):
                return
            passing = exc if exc.passing else None
            _LOGGER.warning("edit of %s failed: %s", live.ref, exc)
        except Refused as exc:
            passing = exc if exc.passing else None
            _LOGGER.warning("edit of %s refused: %s", live.ref, exc.message)
        except (Unreachable, FloodWait):
            raise
        except DeliveryError as exc:  # (a moved chat: its rows follow it when sent)
            _LOGGER.warning("edit of %s: %s", live.ref, exc)
        else:
            if changed:
                self._eased(live.chat_id)
                self._refused.pop(live.ref, None)
        # The pause runs from the answer (a retried flood pause took its time).
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
