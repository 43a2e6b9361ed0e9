"""The bot's composition root: ``serve(settings)`` runs it until SIGTERM.

The python-telegram-bot ``Application`` is started inside our own event loop, without
its ``Updater``: our own poller (or webhook listener) records every update in the
database *before* it is confirmed to Telegram or handed to the handlers, so nothing is
lost to a crash. Updates are processed concurrently (``/stop`` is never stuck behind a
running handler) but in order per chat for plain messages.

Long: the composition root and the inbox's two doors (the poller and the webhook
listener) with the start-up recovery and the two-step shutdown they share; the features,
their handlers and the wrapping are elsewhere (bot/feature.py, bot/handlers.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Coroutine
from typing import TYPE_CHECKING, Any, Final, Self, TypeVar
from urllib.parse import urlsplit

from telegram import BotCommand, Update
from telegram.error import Conflict, InvalidToken, NetworkError, RetryAfter, TelegramError
from telegram.ext import AIORateLimiter, Application, ApplicationBuilder, BaseUpdateProcessor

from bot.admin import AdminFeature
from bot.agent_questions import AgentQuestionFeature
from bot.auto import AutoExtension
from bot.autopilot import AutopilotExtension
from bot.chatting import ChatFeature, rerun_markup, rerun_ref
from bot.context import BotContext
from bot.controls import InlineControls
from bot.feature import Feature
from bot.files import FileDesk
from bot.handlers import Dispatch
from bot.outbox import PacedRateLimiter, TelegramTransport, retry_seconds
from bot.pause import PauseFeature
from bot.places import chat_of, telegram_chat
from bot.render import TELEGRAM
from bot.replies import Replies
from bot.tool_approvals import ToolApprovalExtension
from bot.web import WebFeature
from chatfront.auth import Authorizer
from chatfront.chat import OutboxChatFront
from chatfront.commands import ALL_COMMANDS
from chatfront.outbox import OutboxSender
from chatfront.progress import PREFIX as PROGRESS
from chatfront.progress import settle_leftovers
from chatfront.publish import Publisher
from chatfront.sink import BotSink
from chatfront.store import InboundState, OutboxRow, SqlBotStore
from engine.agents.factory import create_agent, new_warm_pool, probe_agents
from engine.aio import ClosedOnExit, raise_if_cancelled
from engine.chats.sessions import ChatSessions
from engine.errors import ConfigError, StoreError, StoreUnreachableError
from engine.executors import chat_agents, recover_runs
from engine.executors.base import AgentFactory
from engine.gates import Gates
from engine.locks import InodeLock, Lock
from engine.redact import Redactor
from engine.runs import Recovery, RunMode, RunSupervisor
from engine.runs.spec import PlaceId
from engine.sandbox import sandbox_state
from engine.settings import Settings
from engine.store.backend import open_database
from engine.store.database import Database
from engine.store.location import PostgresURL
from engine.store.runs import SqliteRunStore
from engine.workspace.store import SqliteWorkspaceStore

if TYPE_CHECKING:
    from engine.store.advisory import AdvisoryLock

__all__ = ["BotRuntime", "Features", "serve"]

_LOGGER = logging.getLogger(__name__)

#: Telegram's command menu (setMyCommands): the commands every chat front end has.
_MENU: Final = [
    BotCommand(c.name, f"{c.args} — {c.text}" if c.args else c.text) for c in ALL_COMMANDS
]
_T = TypeVar("_T")
_POLL_TIMEOUT: Final = 25
_RATE_LIMIT_RETRIES: Final = 8
# Handled updates and delivered messages are kept this long (duplicates older than this
# cannot arrive: Telegram keeps undelivered updates for 24 hours).
_KEEP_SECONDS: Final = 7 * 24 * 3600


class ChatOrderedProcessor(BaseUpdateProcessor):
    """Concurrent update processing, in order per chat for everything but urgent updates.

    Button presses and ``/stop`` run at once; other updates of one chat wait for the
    previous one (handlers are short: they never await a whole run).
    """

    def __init__(self, runtime: BotRuntime, max_concurrent_updates: int = 256) -> None:
        super().__init__(max_concurrent_updates)
        self._runtime = runtime
        self._locks: dict[PlaceId, asyncio.Lock] = {}

    async def do_process_update(self, update: object, coroutine: Awaitable[Any]) -> None:
        if not isinstance(update, Update):
            await coroutine
            return
        chat = update.effective_chat
        if _urgent(update) or chat is None:
            await coroutine
        else:
            lock = self._locks.setdefault(chat_of(chat), asyncio.Lock())
            try:
                await lock.acquire()
            except BaseException:
                # Cancelled while waiting (shutdown): never started, replayed on next start.
                if inspect.iscoroutine(coroutine):
                    coroutine.close()
                raise
            try:
                await coroutine
            finally:
                lock.release()
        # Only an update whose handling ran to the end is marked handled.
        await self._runtime.finish_inbound(update.update_id)

    async def initialize(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None


def _urgent(update: Update) -> bool:
    if update.callback_query is not None:
        return True
    text = update.message.text if update.message is not None else None
    words = (text or "").split(maxsplit=1)
    return bool(words) and words[0].split("@")[0] == "/stop"


class Features:
    """The bot's features, in the order they start, stop and see plain texts."""

    def __init__(self, extensions: tuple[Feature, ...]) -> None:
        self.extensions = extensions

    async def recover(self, report: Recovery) -> None:
        for feature in self.extensions:
            await feature.recover(report)

    async def shutdown(self, *, park: bool, preempt: asyncio.Event) -> None:
        for feature in self.extensions:
            await feature.shutdown(park=park, preempt=preempt)

    async def park_all(self) -> None:
        for feature in self.extensions:
            await feature.park_all()


class BotRuntime(ClosedOnExit):
    """Everything the bot runs, wired once. Use as an async context manager."""

    def __init__(
        self,
        settings: Settings,
        *,
        agent_factory: AgentFactory = create_agent,
        edit_interval: float | None = None,
        rate_limiter: AIORateLimiter | None = None,
        lock_check_interval: float = 5.0,
    ) -> None:
        # PTB's documented opt-in: durations (RetryAfter.retry_after) as timedelta now,
        # instead of a deprecation warning on every flood-limit answer.
        os.environ.setdefault("PTB_TIMEDELTA", "true")
        if settings.telegram_token is None:
            raise ConfigError(
                "TURNSTILE_TELEGRAM_TOKEN is not set", setting="TURNSTILE_TELEGRAM_TOKEN"
            )
        self.settings = settings
        self.token = settings.telegram_token.get_secret_value()
        # Turnstile's own secrets and every credential the agents inherit: an agent that
        # prints its environment must not put a key in the chat.
        self.redactor = Redactor(settings.secret_values())
        # A SQLite file or a PostgreSQL server (TURNSTILE_DATABASE). SQLite runs WAL with
        # synchronous=NORMAL: every commit survives the process being killed; only an OS
        # crash or power loss can lose the last ones, and inbound updates are synced before
        # they are confirmed to Telegram (so those are replayed, not lost).
        self.db = open_database(settings, synchronous="NORMAL")
        self.store = SqlBotStore(self.db)
        self.runs = SqliteRunStore(self.db)
        self.authorizer = Authorizer.from_ids(
            admins=settings.admins,
            approvers=settings.approvers,
            operators=settings.operators,
            allowed_chats=(str(c) for c in settings.allowed_chats),
        )
        # Resident agent processes (warm sessions) are bounded across every chat and run.
        self.warm_pool = new_warm_pool(settings)
        if agent_factory is create_agent:
            agent_factory = functools.partial(create_agent, warm_pool=self.warm_pool)
        self._agent_factory = agent_factory
        # Telegram's limits: ~30 messages/s overall, 20/min per group; a 429 is retried.
        self._rate_limiter = rate_limiter or PacedRateLimiter(max_retries=_RATE_LIMIT_RETRIES)
        self._edit_interval = (
            edit_interval if edit_interval is not None else settings.status_edit_interval
        )
        self.app: Application[Any, Any, Any, Any, Any, Any] | None = None
        self.sender: OutboxSender | None = None
        self.publisher: Publisher | None = None
        self.chats: ChatSessions | None = None
        self.features: Features | None = None
        self.web: WebFeature | None = None
        self.gates: Gates | None = None
        # Every run of every feature: its row, its session wrapper, its turns, recovery.
        # The warm pool too: chat sessions, auto runs and drives share its cap.
        self.supervisor = RunSupervisor(
            self.runs,
            slots=asyncio.Semaphore(settings.max_concurrent_turns),
            warm_pool=self.warm_pool,
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self._poller: asyncio.Task[None] | None = None
        self._sender_task: asyncio.Task[None] | None = None
        self._webhook: Any = None
        self._shutdown = asyncio.Event()
        self._preempt = asyncio.Event()
        self._handled_in_tx: set[int] = set()
        self.stopping = False
        self.username = ""
        self._bot_lock: Lock | None = None
        self._lock_check_interval = lock_check_interval
        # Set when the bot must stop with an error (the token was refused): raised by
        # serve() once the bot has shut down.
        self.fatal: ConfigError | None = None
        # Set when shutting down found the database unreachable (bot.app shutdown).
        self._db_gone = False

    # -- lifecycle ---------------------------------------------------------------------

    async def _lock(self) -> None:
        """One bot per database: two would drive the same sessions and poll one token.

        On SQLite the lock is on the database file itself (its inode), so every other way
        to the same file (a symlink to it or to its folder, a hard link, a relative path)
        finds it taken. On PostgreSQL it is a session advisory lock in the database itself:
        it holds across machines.
        """
        where = self.settings.database
        lock: Lock
        if isinstance(where, PostgresURL):
            from engine.store.advisory import AdvisoryLock  # psycopg only when asked for

            advisory = AdvisoryLock(where, "turnstile bot")
            lock, who = advisory, advisory.holder_detail  # "pid 12 on host-a"
            keep: AdvisoryLock | None = advisory
        else:
            where = where.resolve()
            # Released in _close() after the database: see InodeLock.
            lock = InodeLock(where)
            who = functools.partial(_holder_pid, lock)
            keep = None
        if not await lock.try_acquire():
            holder = await who()
            raise ConfigError(
                f"another turnstile bot already runs on {where}"
                + (f" ({holder})" if holder else "")
                + "; stop it first",
                setting="TURNSTILE_DATABASE",
            )
        self._bot_lock = lock
        if keep is not None:
            # A session lock dies with its connection: watched, and taken again if lost.
            self.spawn(self._keep_lock(keep), "bot-lock-keeper")

    async def _keep_lock(self, lock: AdvisoryLock) -> None:
        holder = await lock.keep(self._lock_check_interval)
        if holder is None:
            return  # released: the bot is stopping
        if self.fatal is None:
            self.fatal = ConfigError(
                f"this bot lost its connection to {lock.url} for a while and {holder} "
                "took the one-bot lock meanwhile; this one stops",
                setting="TURNSTILE_DATABASE",
            )
            _LOGGER.error("%s", self.fatal)
        self.request_shutdown()

    async def _unlock(self) -> None:
        if self._bot_lock is not None:
            await self._bot_lock.release()
            self._bot_lock = None

    async def __aenter__(self) -> Self:
        await self._lock()
        try:
            await self.db.open()
            if isinstance(self.db, Database):
                # A read-only file opens fine and fails at the first write: say it now.
                await self.db.ensure_writable()
            builder = (
                ApplicationBuilder()
                .token(self.token)
                .base_url(self.settings.telegram_base_url)
                .base_file_url(self.settings.telegram_base_file_url)
                .updater(None)
                .rate_limiter(self._rate_limiter)
                .concurrent_updates(ChatOrderedProcessor(self))
                .connect_timeout(10)
                .read_timeout(30)
                .write_timeout(30)
                .get_updates_read_timeout(_POLL_TIMEOUT + 10)
            )
            self.app = builder.build()
            await self.app.initialize()
            self.username = self.app.bot.username
            self.sender = OutboxSender(
                TelegramTransport(self.app.bot),
                self.store,
                edit_interval=self._edit_interval,
                on_migrate=self._migrated,
                on_token_refused=self._token_refused,
                refusal_backlog=self.settings.refusal_backlog,
            )
            if isinstance(self._rate_limiter, PacedRateLimiter):
                # A 429 in a chat slows that chat's edits (chatfront.outbox).
                self._rate_limiter.on_retry_after = self.sender.slow_down
            self.publisher = Publisher(
                self.store,
                self.sender,
                renderer=TELEGRAM,
                redactor=self.redactor,
                document_threshold=self.settings.document_threshold,
                documents_dir=self.settings.runs_dir / "documents",
            )
            chat_front = OutboxChatFront(self.store, self.publisher)
            self.chats = ChatSessions(
                settings=self.settings,
                store=self.store,
                runs=self.runs,
                front=chat_front,
                agents=chat_agents(self.settings, self.db, agent_factory=self._agent_factory),
                supervisor=self.supervisor,
                workspaces=SqliteWorkspaceStore(self.db),
                db=self.db,
            )
            replies = Replies(self.publisher, self.authorizer, self.store)
            bot = self.app.bot

            async def react(chat_id: PlaceId, message_id: int) -> object:
                return await bot.set_message_reaction(
                    telegram_chat(chat_id), message_id, reaction="👎"
                )

            replies.react = react
            # One per process: in-process approvals wake a parked drive at once.
            self.gates = Gates(self.db, self.settings, poll_interval=1.0)
            ctx = BotContext(
                settings=self.settings,
                db=self.db,
                store=self.store,
                runs=self.runs,
                publisher=self.publisher,
                authorizer=self.authorizer,
                redactor=self.redactor,
                replies=replies,
                supervisor=self.supervisor,
                gates=self.gates,
                chats=self.chats,
                chat_front=chat_front,
                sink=BotSink(self.publisher, self.runs, InlineControls()),
                bot=self.app.bot,
                spawn=self.spawn,
                handled_in_transaction=self.handled_in_transaction,
            )
            self.features = Features(self._features(ctx))
            dispatch = Dispatch(
                self.app,
                settings=self.settings,
                authorizer=self.authorizer,
                store=self.store,
                replies=replies,
                follow_migration=self.follow_migration,
            )
            for feature in self.features.extensions:
                feature.register(dispatch)
            dispatch.finish()
            for new, old in (await self.store.migrated_from()).items():
                self.authorizer.follow_migration(old, new)
        except BaseException:
            await self.aclose()
            raise
        return self

    async def aclose(self) -> None:
        for bg in list(self._tasks):
            bg.cancel()
        pending: list[asyncio.Task[None] | None] = [self._poller, self._sender_task, *self._tasks]
        for task in pending:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self.chats is not None and self.chats.active:
            await self.chats.park_all()
            runs = [r.task for r in self.chats.active.values() if r.task is not None]
            if runs:
                await asyncio.wait(runs)
        with contextlib.suppress(Exception):
            await self.warm_pool.aclose()
        if self.web is not None:
            await self.web.close()
        if self._webhook is not None:
            with contextlib.suppress(Exception):
                await self._webhook.cleanup()
        if self.app is not None:
            with contextlib.suppress(Exception):
                if self.app.running:
                    await self.app.stop()
            with contextlib.suppress(Exception):
                await self.app.shutdown()
        await self.db.close()
        await self._unlock()

    def _features(self, ctx: BotContext) -> tuple[Feature, ...]:
        """Every feature, in order: start-up, shutdown, and who sees a plain text first."""
        # First: its start-up clean-up runs before other features resume runs.
        approvals = ToolApprovalExtension(ctx)
        questions = AgentQuestionFeature(ctx, approvals)
        pause = PauseFeature(ctx, approvals)
        # Approvals and reasons before steering; a text nobody took is a chat turn.
        autopilot = AutopilotExtension(ctx, agent_factory=self._agent_factory)
        auto = AutoExtension(ctx, approvals)
        files = FileDesk(ctx, auto)
        chat = ChatFeature(ctx)
        # Questions first (withdrawn saying why, before the turn ends), pauses last (the
        # pause goes once the run is stopped, not before: a waiting turn would go on).
        owners = (questions, chat, approvals, autopilot, auto, pause)
        admin = AdminFeature(ctx, owners=owners)
        self.web = WebFeature(
            ctx, token=self.token, autopilot=autopilot, approvals=approvals, owners=owners
        )
        return (approvals, questions, pause, autopilot, auto, files, chat, admin, self.web)

    @property
    def handlers(self) -> Features | None:
        """The features (the name tests and benchmarks reach them by)."""
        return self.features

    def spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        """A tracked background task (awaited on exit)."""

        async def wrapper() -> None:
            await coro

        task = asyncio.create_task(wrapper(), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def start(self) -> None:
        """Recover from the last run, then start delivering and taking updates."""
        assert self.app is not None
        assert self.sender is not None
        assert self.chats is not None
        # Before the sender starts: what was in flight at a crash is not sent again.
        uncertain = await self.store.outbox_uncertain()
        # What the agent CLIs support is asked ahead, so a first turn finds it known.
        self.spawn(self._probe_agents(), "agent-cli-probe")
        self._sender_task = asyncio.create_task(self.sender.run(), name="outbox-sender")
        await self._recover(uncertain)
        await self.app.start()
        with contextlib.suppress(TelegramError):
            await self.app.bot.set_my_commands(_MENU)
        if self.settings.webhook_url:
            await self._start_webhook()
        else:
            await self.app.bot.delete_webhook()
            self._poller = asyncio.create_task(self._poll(), name="telegram-poller")
        await self._replay_inbound()
        if self.web is not None:
            await self.web.start()
        walls = sandbox_state(self.settings)
        if walls.confined:
            _LOGGER.info("%s", walls.detail)
        elif self.settings.sandbox == "off":
            _LOGGER.warning("%s", walls.detail)
        else:
            _LOGGER.error("agents will not start: %s; %s", walls.detail, walls.fix)
        _LOGGER.info(
            "bot @%s running (%s)",
            self.username,
            "webhook" if self.settings.webhook_url else "polling",
        )

    async def _probe_agents(self) -> None:
        for tool, mode in (await probe_agents(self.settings)).items():
            _LOGGER.info("%s turns: %s (%s)", tool, mode.label, mode.reason)

    async def _recover(self, uncertain: list[OutboxRow]) -> None:
        """Report turns a crash cut off, close crashed runs, resume queues, refresh gates."""
        assert self.publisher is not None
        assert self.chats is not None
        assert self.features is not None
        pruned = await self.store.prune(time.time() - _KEEP_SECONDS)
        if pruned:
            _LOGGER.info("pruned %d delivered messages and handled updates", pruned)
        # The engine recovers every run (cut-off turns, chat runs, what resumes); the bot
        # only tells the chats and lets each feature resume what the report says.
        # A drive of a chat's task that a terminal took over and still runs is left alone.
        assert self.gates is not None
        report = await recover_runs(self.db, self.supervisor, drive_alive=self.gates.drive_alive)
        for cut in report.cut_off:
            turn, run = cut.turn, cut.run
            if run.chat_id is None:
                continue
            excerpt = turn.prompt if len(turn.prompt) <= 200 else turn.prompt[:200] + "…"
            text = (
                f"⚠️ Turn {turn.seq} of run {run.id} was cut off when the bot stopped "
                f"unexpectedly; its output is lost. Prompt was: {excerpt}"
            )
            if run.mode == RunMode.CHAT:
                # A chat turn is not run again by itself (an auto run's is): the button
                # asks for it, once.
                await self.publisher.live(
                    rerun_ref(run.id, turn.seq),
                    text,
                    chat_id=run.chat_id,
                    thread_id=run.thread_id,
                    markup=rerun_markup(run.id, turn.seq),
                    run_id=run.id,
                )
                continue
            await self.publisher.say(run.chat_id, text, thread_id=run.thread_id, run_id=run.id)
        for row in uncertain:
            # Its send began before the crash: it may have arrived. Sent again it could be
            # a duplicate, so the chat is told instead (the output is kept with the turn).
            item = row.item
            if item.ref is not None and item.ref.startswith(PROGRESS):
                continue  # a turn's progress: the note about the cut-off turn says it all
            what = "a file" if item.kind != "text" else "a message"
            began = item.caption if item.kind != "text" else item.body
            excerpt = " ".join((began or item.filename or "").split())[:120]
            where = f" of run {item.run_id}" if item.run_id else ""
            await self.publisher.say(
                item.chat_id,
                f"⚠️ The bot stopped while sending {what}{where} here, so it may be missing "
                f"(it began: «{excerpt}»). It is not sent again, so nothing arrives twice"
                + (f"; turnstile runs {item.run_id} keeps the output." if item.run_id else "."),
                thread_id=item.thread_id,
                run_id=item.run_id,
            )
        for prompt in await self.store.running_prompts():
            await self.store.end_prompt(prompt.id, "interrupted")
        await self.store.requeue_steering()
        await self.publisher.people.load()
        # Progress messages of turns cut off by the stop say so (never "running" forever).
        await settle_leftovers(self.store, self.publisher)
        await self.features.recover(report)
        await self.store.touch_live("gate:")
        await self.chats.resume()
        self.publisher.wake()

    async def _replay_inbound(self) -> None:
        """Updates recorded but never handled (a crash in between) are handled now."""
        assert self.app is not None
        for update_id, payload in await self.store.unhandled_inbound():
            update = Update.de_json(json.loads(payload), self.app.bot)
            if update is None:
                await self.store.mark_inbound(update_id, InboundState.IGNORED)
                continue
            await self.app.update_queue.put(update)

    async def finish_inbound(self, update_id: int) -> None:
        if update_id in self._handled_in_tx:
            self._handled_in_tx.discard(update_id)
            return
        with contextlib.suppress(Exception):
            await self.store.mark_inbound(update_id, InboundState.HANDLED)

    def handled_in_transaction(self, update_id: int) -> None:
        self._handled_in_tx.add(update_id)

    async def _accept(self, updates: list[Update]) -> None:
        """Record updates, then queue the ones never seen before for handling."""
        assert self.app is not None
        raw = [(u.update_id, json.dumps(u.to_dict())) for u in updates]
        fresh = await self.store.record_inbound(raw)
        for update in updates:
            if update.update_id in fresh:
                # A group becoming a supergroup is followed before anything after it is
                # handled: the next updates (handled concurrently) come from the new id.
                await self.follow_migration(update)
                await self.app.update_queue.put(update)

    def _token_refused(self, detail: str) -> None:
        """Telegram refused the token (revoked or wrong): stop, and exit with that error."""
        if self.fatal is None:
            self.fatal = _token_error(detail)
            _LOGGER.error("%s", self.fatal)
        self.request_shutdown()

    def _migrated(self, old: PlaceId, new: PlaceId) -> None:
        """The sender learnt of a migration from Telegram (the store already followed it)."""
        self.authorizer.follow_migration(old, new)
        if self.chats is not None:
            self.chats.follow_migration(old, new)

    async def follow_migration(self, update: Update) -> None:
        message = update.message
        chat = update.effective_chat
        if message is None or chat is None:
            return
        if message.migrate_to_chat_id is not None:
            old, new = chat_of(chat), str(message.migrate_to_chat_id)
        elif message.migrate_from_chat_id is not None:
            old, new = str(message.migrate_from_chat_id), chat_of(chat)
        else:
            return
        if self.authorizer.migrated.get(new) == old:
            return
        _LOGGER.info("chat %s became %s; following it", old, new)
        await self.store.migrate_chat(old, new)
        self.authorizer.follow_migration(old, new)
        if self.chats is not None:
            self.chats.follow_migration(old, new)

    async def _poll(self) -> None:
        assert self.app is not None
        bot = self.app.bot
        offset = await self.store.next_offset()
        backoff = 1.0
        while not self.stopping:
            try:
                updates = await bot.get_updates(
                    offset=offset or None, timeout=_POLL_TIMEOUT, allowed_updates=Update.ALL_TYPES
                )
                backoff = 1.0
            except InvalidToken as exc:
                self._token_refused(exc.message)
                return
            except Conflict:
                _LOGGER.error("another process polls this bot token (409 Conflict); retrying")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30)
                continue
            except RetryAfter as exc:
                await asyncio.sleep(retry_seconds(exc))
                continue
            except NetworkError as exc:
                _LOGGER.warning("getUpdates failed (%s); retrying in %.0fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30)
                continue
            except TelegramError as exc:
                _LOGGER.error("getUpdates refused (%s); retrying in %.0fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30)
                continue
            if not updates:
                continue
            # Recorded, then handled at once, while the WAL is synced: only then does the
            # next getUpdates confirm them to Telegram.
            try:
                await self._accept(list(updates))
                await self.store.sync()
            except StoreUnreachableError as exc:
                # The database is away (an outage, a restart): not recorded, so not confirmed
                # either; Telegram keeps them and hands them over again.
                raise_if_cancelled()
                _LOGGER.warning("cannot record updates yet (%s); retrying in %.0fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30)
                continue
            except Exception:
                # Not recorded: the offset stays, Telegram hands them over again.
                _LOGGER.exception("recording updates failed; retrying in %.0fs", backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30)
                continue
            offset = updates[-1].update_id + 1

    async def _confirm_offset(self) -> None:
        """A last getUpdates with timeout 0 confirms what was recorded."""
        assert self.app is not None
        offset = await self.store.next_offset()
        if offset:
            await self.store.sync()
            with contextlib.suppress(TelegramError):
                await self.app.bot.get_updates(offset=offset, timeout=0, limit=1)

    async def _start_webhook(self) -> None:
        from aiohttp import web

        assert self.app is not None
        url = self.settings.webhook_url or ""
        path = urlsplit(url).path or "/"
        secret = (
            self.settings.webhook_secret.get_secret_value()
            if self.settings.webhook_secret is not None
            else None
        )
        if not secret:
            raise ConfigError(
                "webhook mode needs TURNSTILE_WEBHOOK_SECRET (1-256 characters A-Z a-z 0-9 _ -)",
                setting="TURNSTILE_WEBHOOK_SECRET",
            )
        bot = self.app.bot

        async def receive(request: web.Request) -> web.Response:
            if request.headers.get("X-Telegram-Bot-Api-Secret-Token") != secret:
                _LOGGER.warning("webhook request without the right secret token refused")
                return web.Response(status=403)
            if self.stopping:
                return web.Response(status=503)
            try:
                data = await request.json()
                update = Update.de_json(data, bot)
            except (ValueError, TypeError, KeyError):
                return web.Response(status=400)
            if update is None:
                return web.Response(status=400)
            # 200 only once recorded and synced: Telegram retries anything else.
            await self._accept([update])
            await self.store.sync()
            return web.Response(status=200)

        app = web.Application(client_max_size=2 * 1024 * 1024)
        app.router.add_post(path, receive)
        runner = web.AppRunner(app, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, self.settings.webhook_listen, self.settings.webhook_port)
        await site.start()
        self._webhook = runner
        await bot.set_webhook(url=url, secret_token=secret, allowed_updates=Update.ALL_TYPES)

    # -- shutdown ----------------------------------------------------------------------

    def request_shutdown(self) -> None:
        """First call: graceful shutdown; second call: pre-empt running turns."""
        if self._shutdown.is_set():
            _LOGGER.warning("second shutdown request: pre-empting running turns")
            self._preempt.set()
            return
        _LOGGER.info("shutdown requested: no new updates; finishing or parking turns")
        self._shutdown.set()

    async def wait(self) -> None:
        await self._shutdown.wait()

    async def shutdown(self) -> int:
        """Stop taking updates, finish or park turns, flush the outbox. Returns the exit code.

        A database that cannot be reached meanwhile (an outage) does not hold it up: what
        was not recorded or sent is kept (Telegram hands unconfirmed updates over again;
        the outbox keeps what it did not deliver) and goes out at the next start.
        """
        assert self.chats is not None
        assert self.sender is not None
        assert self.app is not None
        self.stopping = True
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
            await self._unless_unreachable("confirming the updates", self._confirm_offset())
        if self._webhook is not None:
            await self._webhook.cleanup()
            self._webhook = None
        park = self.settings.shutdown_turns == "park"
        preempter = asyncio.create_task(self._preempt_on_second_signal(), name="preempt-watch")
        try:
            waits = [self.chats.shutdown(park=park)]
            if self.features is not None:
                waits.append(self.features.shutdown(park=park, preempt=self._preempt))
            for failed in await asyncio.gather(*waits, return_exceptions=True):
                if isinstance(failed, StoreError):
                    self._db_gone = True
                    _LOGGER.warning("stopping without the database: %s", failed)
                elif isinstance(failed, BaseException):
                    raise failed
        finally:
            preempter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await preempter
        if self.app.running:
            await self.app.stop()
        flushed = await self._unless_unreachable(
            "delivering the last messages",
            self.sender.drain(self.settings.shutdown_flush_seconds),
        )
        if not flushed:
            left = await self._unless_unreachable("counting them", self.store.pending_outbox())
            _LOGGER.warning(
                "%s message(s) still undelivered at shutdown; they go out on the next start",
                "some" if left is None else left,
            )
        self.sender.stop()
        if self._sender_task is not None:
            if self._db_gone:
                self._sender_task.cancel()  # (it may wait for a connection that never comes)
            with contextlib.suppress(asyncio.CancelledError):
                await self._sender_task
            self._sender_task = None
        return 0

    async def _unless_unreachable(self, what: str, step: Coroutine[Any, Any, _T]) -> _T | None:
        """``step``'s result, or None when the database could not be reached for it (once
        it could not, the later steps are left at once: each would wait for it again)."""
        if self._db_gone:
            step.close()
            return None
        try:
            return await step
        except StoreError as exc:
            self._db_gone = True
            _LOGGER.warning("stopping: %s was left (%s)", what, exc)
            return None

    async def _preempt_on_second_signal(self) -> None:
        assert self.chats is not None
        await self._preempt.wait()
        await self.chats.park_all()
        if self.features is not None:
            await self.features.park_all()


async def _holder_pid(lock: Lock) -> str | None:
    pid = await lock.holder()
    return f"pid {pid}" if pid else None


def _token_error(detail: str) -> ConfigError:
    return ConfigError(
        f"Telegram refused the bot token ({detail}): it was revoked or is wrong; put the "
        "current token from @BotFather in TURNSTILE_TELEGRAM_TOKEN and start the bot again "
        "(undelivered messages are kept and go out then)",
        setting="TURNSTILE_TELEGRAM_TOKEN",
    )


async def serve(settings: Settings) -> int:
    """Run the bot until SIGTERM or SIGINT; returns the process exit code.

    Raises:
        ConfigError: the settings are wrong, or Telegram refused the token (at start or
            while running: the bot shuts down first).
    """
    loop = asyncio.get_running_loop()
    try:
        async with BotRuntime(settings) as runtime:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, runtime.request_shutdown)
            try:
                await runtime.start()
                await runtime.wait()
                code = await runtime.shutdown()
            finally:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
            if runtime.fatal is not None:
                raise runtime.fatal
            return code
    except InvalidToken as exc:
        # Refused at start-up (getMe, deleteWebhook): nothing ran yet.
        raise _token_error(exc.message) from exc
