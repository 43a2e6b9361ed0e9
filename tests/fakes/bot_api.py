"""A fake Telegram Bot API server on 127.0.0.1 that python-telegram-bot talks to over HTTP.

It implements just enough of the Bot API for turnstile's bot: long-polled ``getUpdates``
with offsets, ``sendMessage``, ``editMessageText``, ``editMessageReplyMarkup``,
``sendDocument`` (multipart), ``answerCallbackQuery``, ``setMyCommands``,
``deleteWebhook``, ``setWebhook``, ``getMe`` (with a username), ``createForumTopic``,
``deleteMessage``, ``getFile`` and file downloads (``GET /file/bot<token>/<path>``, refused
over Telegram's 20 MB the way Telegram refuses them). Files, photos (albums with
``media_group_id``), voice notes and audio can be pushed as updates. Every call is
recorded; failures (429 with ``retry_after``, 5xx, and the permanent 400/401/403/404 with
Telegram's descriptions, or a description of the test's own) can be injected per method,
once or as a storm; :meth:`FakeBotApi.garble_answers` takes calls (a sent message is in the
chat) but answers 200 with a body that is not the Bot API's JSON;
:meth:`FakeBotApi.revoke_token` makes every call answer 401 the way Telegram does after a
token is revoked; :meth:`FakeBotApi.hold` parks calls until released (a slow Telegram,
deterministically); :meth:`FakeBotApi.hold_answers` handles calls at once (the message is
in the chat) but parks their answers until released (the moment between Telegram showing a
message and the bot learning it was delivered).

Usage::

    async with FakeBotApi() as api:
        settings = ...(telegram_base_url=api.base_url, telegram_base_file_url=api.file_url)
        api.push_message(chat_id=-100, user_id=42, text="/help")
        msg = await api.wait_for_message(lambda m: "help" in m.text)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import BodyPartReader, web

__all__ = ["ApiCall", "Failure", "FakeBotApi", "SentMessage"]

TOKEN = "123456789:AAFakeTokenForTestsOnly_abcdefghijklmn"
BOT_ID = 123456789
# What Telegram says with each injected status.
_DESCRIPTIONS = {
    400: "Bad Request: chat not found",
    401: "Unauthorized",
    403: "Forbidden: bot was blocked by the user",
    404: "Not Found",
    429: "Too Many Requests: retry later",
}


@dataclass
class ApiCall:
    """One request the bot made."""

    method: str
    params: dict[str, Any]
    at: float
    status: int = 200


@dataclass
class SentMessage:
    """A message as the fake holds it (its latest text after edits)."""

    chat_id: int
    message_id: int
    text: str
    entities: list[dict[str, Any]]
    thread_id: int | None = None
    reply_markup: dict[str, Any] | None = None
    reply_to: int | None = None
    document: bytes | None = None
    filename: str | None = None
    edits: int = 0
    history: list[str] = field(default_factory=list)

    @property
    def buttons(self) -> list[dict[str, Any]]:
        rows = (self.reply_markup or {}).get("inline_keyboard") or []
        return [b for row in rows for b in row]


@dataclass
class Failure:
    """An injected failure: ``count`` next calls of ``methods`` answer ``status``
    (with ``description``, or Telegram's usual one); with ``answer``, they are handled and
    then answered 200 with those bytes."""

    methods: frozenset[str]
    status: int
    count: int = 1
    retry_after: int | None = None
    every: int | None = None
    seen: int = 0
    description: str | None = None
    answer: bytes | None = None


class FakeBotApi:
    """The fake server. Use as an async context manager."""

    def __init__(self, *, token: str = TOKEN, username: str = "turnstile_test_bot") -> None:
        self.token = token
        self.username = username
        self.calls: list[ApiCall] = []
        self.messages: dict[tuple[int, int], SentMessage] = {}
        self.sent: list[SentMessage] = []
        self.failures: list[Failure] = []
        self.commands: list[dict[str, Any]] = []
        self.webhook: dict[str, Any] | None = None
        self.callback_answers: list[dict[str, Any]] = []
        #: setMessageReaction calls (chat_id, message_id, reaction).
        self.reactions: list[dict[str, Any]] = []
        # First names the fake gives its users (default "user<ID>").
        self.names: dict[int, str] = {}
        self._updates: list[dict[str, Any]] = []
        self._pushed: dict[int, dict[str, Any]] = {}
        self._update_ids = itertools.count(1)
        self._message_ids: dict[int, itertools.count[int]] = {}
        self._topic_ids = itertools.count(1000)
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.confirmed_offset = 0
        self._script: list[int] = []
        self._script_methods: frozenset[str] = frozenset()
        self._held: frozenset[str] = frozenset()
        self._held_answers: frozenset[str] = frozenset()
        self._release = asyncio.Event()
        self.parked_answers = 0
        self.parked = 0
        self.files: dict[str, tuple[str, bytes]] = {}
        self.downloads: list[str] = []
        self._file_ids = itertools.count(1)
        # Telegram's privacy mode for bots in groups: a plain message reaches the bot only
        # as a reply to one of its messages; the others are kept here, never delivered.
        self.privacy_mode = False
        self.hidden: list[dict[str, Any]] = []

    # -- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> FakeBotApi:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self, port: int = 0) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/bot{token}/{method}", self._handle)
        app.router.add_get("/bot{token}/{method}", self._handle)
        app.router.add_get("/file/bot{token}/{path:.+}", self._download)
        self._runner = web.AppRunner(app, shutdown_timeout=0.2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        server = site._server
        assert server is not None
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/bot"

    @property
    def file_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/file/bot"

    # -- injecting updates -------------------------------------------------------------

    def push_update(self, payload: dict[str, Any], update_id: int | None = None) -> int:
        """Queue one update (``payload`` holds one update field); returns its id."""
        uid = update_id if update_id is not None else next(self._update_ids)
        self._updates.append({"update_id": uid, **payload})
        self._pushed[uid] = self._updates[-1]
        self._notify()
        return uid

    def pushed(self, update_id: int) -> dict[str, Any]:
        """The update pushed with ``update_id`` (its message's id is what answers reply to)."""
        return self._pushed[update_id]

    def user(self, user_id: int, *, is_bot: bool = False) -> dict[str, Any]:
        return {
            "id": user_id,
            "is_bot": is_bot,
            "first_name": self.names.get(user_id, f"user{user_id}"),
        }

    def chat(
        self, chat_id: int, chat_type: str | None = None, forum: bool = False
    ) -> dict[str, Any]:
        kind = chat_type or ("private" if chat_id > 0 else "supergroup")
        chat: dict[str, Any] = {"id": chat_id, "type": kind}
        if kind != "private":
            chat["title"] = f"chat {chat_id}"
        if forum:
            chat["is_forum"] = True
        return chat

    def message_payload(
        self,
        *,
        chat_id: int,
        user_id: int,
        text: str,
        thread_id: int | None = None,
        reply_to: int | None = None,
        chat_type: str | None = None,
        is_bot: bool = False,
    ) -> dict[str, Any]:
        mid = next(self._message_ids.setdefault(chat_id, itertools.count(1)))
        msg: dict[str, Any] = {
            "message_id": mid,
            "date": int(time.time()),
            "chat": self.chat(chat_id, chat_type, forum=thread_id is not None),
            "from": self.user(user_id, is_bot=is_bot),
            "text": text,
        }
        if text.startswith("/"):
            cmd = text.split()[0]
            msg["entities"] = [{"type": "bot_command", "offset": 0, "length": len(cmd)}]
        if thread_id is not None:
            msg["message_thread_id"] = thread_id
            msg["is_topic_message"] = True
        if reply_to is not None:
            original = self.messages.get((chat_id, reply_to))
            msg["reply_to_message"] = {
                "message_id": reply_to,
                "date": int(time.time()),
                "chat": self.chat(chat_id, chat_type),
                "from": {"id": BOT_ID, "is_bot": True, "first_name": "bot"},
                "text": original.text if original else "",
            }
        return msg

    def push_message(self, *, chat_id: int, user_id: int, text: str, **kw: Any) -> int:
        """Queue a message update; returns the update id (0: privacy mode hid it)."""
        message = self.message_payload(chat_id=chat_id, user_id=user_id, text=text, **kw)
        if (
            self.privacy_mode
            and message["chat"]["type"] != "private"
            and not text.startswith("/")
            and "reply_to_message" not in message
        ):
            self.hidden.append(message)
            return 0
        return self.push_update({"message": message})

    # -- files -------------------------------------------------------------------------

    def add_file(self, data: bytes, *, folder: str = "documents") -> tuple[str, str]:
        """Hold ``data`` as a file the bot can fetch; returns (file_id, file_unique_id)."""
        n = next(self._file_ids)
        file_id = f"BQACAgfile{n:04d}"
        self.files[file_id] = (f"{folder}/file_{n}_{time.monotonic_ns()}", data)
        return file_id, f"uniq{n:04d}"

    def _media(
        self, *, chat_id: int, user_id: int, caption: str | None, **kw: Any
    ) -> dict[str, Any]:
        msg = self.message_payload(chat_id=chat_id, user_id=user_id, text="", **kw)
        msg.pop("text", None)
        msg.pop("entities", None)
        if caption is not None:
            msg["caption"] = caption
        return msg

    def push_document(
        self,
        *,
        chat_id: int,
        user_id: int,
        data: bytes,
        file_name: str | None = "file.bin",
        mime_type: str | None = "application/octet-stream",
        caption: str | None = None,
        media_group_id: str | None = None,
        size: int | bool | None = True,
        **kw: Any,
    ) -> int:
        """A document message; ``size`` True declares the real size, an int another one,
        None none at all."""
        file_id, unique = self.add_file(data)
        doc: dict[str, Any] = {"file_id": file_id, "file_unique_id": unique}
        if file_name is not None:
            doc["file_name"] = file_name
        if mime_type is not None:
            doc["mime_type"] = mime_type
        if size is True:
            doc["file_size"] = len(data)
        elif isinstance(size, int) and not isinstance(size, bool):
            doc["file_size"] = size
        msg = self._media(chat_id=chat_id, user_id=user_id, caption=caption, **kw)
        msg["document"] = doc
        if media_group_id is not None:
            msg["media_group_id"] = media_group_id
        return self.push_update({"message": msg})

    def push_photo(
        self,
        *,
        chat_id: int,
        user_id: int,
        data: bytes,
        caption: str | None = None,
        media_group_id: str | None = None,
        **kw: Any,
    ) -> int:
        """A photo message: a small thumbnail size and the full size (``data``)."""
        thumb_id, thumb_unique = self.add_file(b"thumbnail", folder="photos")
        file_id, unique = self.add_file(data, folder="photos")
        msg = self._media(chat_id=chat_id, user_id=user_id, caption=caption, **kw)
        msg["photo"] = [
            {
                "file_id": thumb_id,
                "file_unique_id": thumb_unique,
                "width": 90,
                "height": 60,
                "file_size": 9,
            },
            {
                "file_id": file_id,
                "file_unique_id": unique,
                "width": 1280,
                "height": 853,
                "file_size": len(data),
            },
        ]
        if media_group_id is not None:
            msg["media_group_id"] = media_group_id
        return self.push_update({"message": msg})

    def push_voice(
        self,
        *,
        chat_id: int,
        user_id: int,
        data: bytes,
        mime_type: str = "audio/ogg",
        audio: bool = False,
        caption: str | None = None,
        **kw: Any,
    ) -> int:
        """A voice note (or, with ``audio``, an audio file message)."""
        file_id, unique = self.add_file(data, folder="voice" if not audio else "music")
        item: dict[str, Any] = {
            "file_id": file_id,
            "file_unique_id": unique,
            "duration": 2,
            "mime_type": mime_type,
            "file_size": len(data),
        }
        msg = self._media(chat_id=chat_id, user_id=user_id, caption=caption, **kw)
        if audio:
            item["file_name"] = "recording.wav"
            msg["audio"] = item
        else:
            msg["voice"] = item
        return self.push_update({"message": msg})

    def _m_getFile(self, params: dict[str, Any]) -> dict[str, Any]:
        file_id = str(params.get("file_id", ""))
        if file_id not in self.files:
            raise _ApiError(400, "Bad Request: invalid file_id")
        path, data = self.files[file_id]
        if len(data) > 20 * 1024 * 1024:
            raise _ApiError(400, "Bad Request: file is too big")
        return {
            "file_id": file_id,
            "file_unique_id": "u" + file_id,
            "file_size": len(data),
            "file_path": path,
        }

    async def _download(self, request: web.Request) -> web.StreamResponse:
        if request.match_info["token"] != self.token:
            return self._error(401, "Unauthorized")
        path = request.match_info["path"]
        self.downloads.append(path)
        self._notify()
        for stored, data in self.files.values():
            if stored == path:
                return web.Response(body=data, content_type="application/octet-stream")
        return self._error(404, "Not Found")

    def push_callback(
        self, *, chat_id: int, user_id: int, data: str, message_id: int, query_id: str | None = None
    ) -> int:
        """Queue a button press on ``message_id``."""
        original = self.messages.get((chat_id, message_id))
        query: dict[str, Any] = {
            "id": query_id or f"cq{next(self._update_ids)}",
            "from": self.user(user_id),
            "chat_instance": f"ci{chat_id}",
            "data": data,
            "message": {
                "message_id": message_id,
                "date": int(time.time()),
                "chat": self.chat(chat_id),
                "from": {"id": BOT_ID, "is_bot": True, "first_name": "bot"},
                "text": original.text if original else "",
            },
        }
        if original and original.thread_id is not None:
            query["message"]["message_thread_id"] = original.thread_id
        return self.push_update({"callback_query": query})

    # -- injecting failures ------------------------------------------------------------

    def fail(
        self,
        methods: Iterable[str],
        status: int,
        *,
        count: int = 1,
        retry_after: int | None = None,
        every: int | None = None,
        description: str | None = None,
    ) -> Failure:
        """Answer ``status`` to the next ``count`` calls of ``methods`` (or every n-th call)."""
        failure = Failure(
            frozenset(methods), status, count, retry_after, every, description=description
        )
        self.failures.append(failure)
        return failure

    def garble_answers(
        self, methods: Iterable[str], *, count: int = 1, body: bytes = b"<html>Bad Gateway"
    ) -> Failure:
        """Handle the next ``count`` calls of ``methods`` (a sent message is in the chat)
        but answer each 200 with ``body``: an answer the bot cannot read."""
        failure = Failure(frozenset(methods), 200, count, answer=body)
        self.failures.append(failure)
        return failure

    def revoke_token(self) -> None:
        """Every later call answers 401 Unauthorized (the token was revoked in BotFather)."""
        self.token = f"{self.token.split(':', 1)[0]}:revoked"

    def hold(self, methods: Iterable[str]) -> None:
        """Park every call of ``methods`` (before it is answered) until :meth:`release`."""
        self._held = frozenset(methods)
        self._release.clear()

    def hold_answers(self, methods: Iterable[str]) -> None:
        """Handle every call of ``methods`` (a sent message is in the chat at once) but
        park its answer until :meth:`release`."""
        self._held_answers = frozenset(methods)
        self._release.clear()

    def release(self) -> None:
        self._held = frozenset()
        self._held_answers = frozenset()
        self._release.set()

    # -- waiting -----------------------------------------------------------------------

    def _notify(self) -> None:
        async def bump() -> None:
            async with self._changed:
                self._changed.notify_all()

        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(bump())

    async def wait_until(self, predicate: Callable[[], bool], timeout: float = 20.0) -> None:
        """Wait until ``predicate()`` holds (checked on every call the bot makes)."""

        async def loop() -> None:
            async with self._changed:
                await self._changed.wait_for(predicate)

        await asyncio.wait_for(loop(), timeout)

    async def wait_for_message(
        self, predicate: Callable[[SentMessage], bool], timeout: float = 20.0
    ) -> SentMessage:
        """The first sent message matching ``predicate``, waiting for it if needed."""
        found: list[SentMessage] = []

        def check() -> bool:
            for msg in self.sent:
                if predicate(msg):
                    found.append(msg)
                    return True
            return False

        await self.wait_until(check, timeout)
        return found[0]

    def texts(self, chat_id: int | None = None) -> list[str]:
        return [m.text for m in self.sent if chat_id is None or m.chat_id == chat_id]

    def calls_of(self, method: str) -> list[ApiCall]:
        return [c for c in self.calls if c.method == method]

    def pending_updates(self) -> int:
        return sum(1 for u in self._updates if u["update_id"] >= self.confirmed_offset)

    # -- the HTTP side -----------------------------------------------------------------

    async def _params(self, request: web.Request) -> dict[str, Any]:
        ctype = request.content_type
        params: dict[str, Any] = {}
        if ctype == "application/json":
            body = await request.read()
            if body:
                params = dict(json.loads(body))
            return params
        if ctype.startswith("multipart/"):
            reader = await request.multipart()
            async for part in reader:
                if not isinstance(part, BodyPartReader) or part.name is None:
                    continue
                if part.filename is not None:
                    params[part.name] = {"filename": part.filename, "data": await part.read()}
                else:
                    params[part.name] = await part.text()
        else:
            form = await request.post()
            params = {k: v for k, v in form.items() if isinstance(v, str)}
        for key, value in list(params.items()):
            if isinstance(value, str) and value[:1] in "[{" and key not in ("text", "caption"):
                with contextlib.suppress(ValueError):
                    params[key] = json.loads(value)
        return params

    async def _handle(self, request: web.Request) -> web.Response:
        if request.match_info["token"] != self.token:
            return self._error(401, "Unauthorized")
        method = request.match_info["method"]
        params = await self._params(request)
        if method in self._held:
            self.parked += 1
            self._notify()
            await self._release.wait()
        call = ApiCall(method, params, time.time())
        self.calls.append(call)
        if method == "getUpdates":
            self._notify()  # a long poll is parked: waiters may want to know it arrived
        failure = self._injected(method)
        if failure is not None and failure.answer is not None:
            garbled, failure = failure.answer, None
        else:
            garbled = None
        if failure is not None:
            call.status = failure.status
            self._notify()
            extra = (
                {"retry_after": failure.retry_after} if failure.retry_after is not None else None
            )
            text = failure.description or _DESCRIPTIONS.get(failure.status, "Bad Gateway")
            return self._error(failure.status, text, extra)
        handler = getattr(self, f"_m_{method}", None)
        if handler is None:
            return self._error(404, f"Not Found: method {method}")
        try:
            if method == "getUpdates":
                result = await handler(params)
            else:
                result = handler(params)
        except _ApiError as exc:
            call.status = exc.status
            self._notify()
            return self._error(exc.status, exc.description)
        self._notify()
        if method in self._held_answers:
            self.parked_answers += 1
            self._notify()
            await self._release.wait()
        if garbled is not None:
            return web.Response(body=garbled, status=200, content_type="application/json")
        return web.json_response({"ok": True, "result": result})

    def script(self, methods: Iterable[str], statuses: Iterable[int]) -> None:
        """The next calls of ``methods`` answer these statuses in turn (0: succeed;
        429 comes with ``retry_after`` 1, the least Telegram sends)."""
        self._script_methods = frozenset(methods)
        self._script = list(statuses)

    def _injected(self, method: str) -> Failure | None:
        if method in self._script_methods and self._script:
            status = self._script.pop(0)
            if status:
                return Failure(
                    frozenset({method}), status, retry_after=0 if status == 429 else None
                )
        for failure in self.failures:
            if method not in failure.methods:
                continue
            failure.seen += 1
            if failure.every is not None:
                if failure.seen % failure.every == 0:
                    return failure
                continue
            if failure.count > 0:
                failure.count -= 1
                return failure
        return None

    @staticmethod
    def _error(
        status: int, description: str, parameters: dict[str, Any] | None = None
    ) -> web.Response:
        body: dict[str, Any] = {"ok": False, "error_code": status, "description": description}
        if parameters:
            body["parameters"] = parameters
        return web.json_response(body, status=status)

    # -- methods -----------------------------------------------------------------------

    def _m_getMe(self, params: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": BOT_ID,
            "is_bot": True,
            "first_name": "turnstile",
            "username": self.username,
            "can_join_groups": True,
            "can_read_all_group_messages": False,
            "supports_inline_queries": False,
        }

    async def _m_getUpdates(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        offset = int(params.get("offset") or 0)
        timeout = float(params.get("timeout") or 0)
        limit = int(params.get("limit") or 100)
        if offset:
            self.confirmed_offset = max(self.confirmed_offset, offset)
            self._updates = [u for u in self._updates if u["update_id"] >= offset]

        def ready() -> bool:
            return any(u["update_id"] >= offset for u in self._updates)

        if not ready() and timeout > 0:
            with contextlib.suppress(TimeoutError):
                async with self._changed:
                    await asyncio.wait_for(self._changed.wait_for(ready), timeout)
        return [u for u in self._updates if u["update_id"] >= offset][:limit]

    def _chat_id(self, params: dict[str, Any]) -> int:
        try:
            return int(params["chat_id"])
        except (KeyError, ValueError):
            raise _ApiError(400, "Bad Request: chat not found") from None

    def _new_message(self, params: dict[str, Any], text: str) -> SentMessage:
        chat_id = self._chat_id(params)
        mid = next(self._message_ids.setdefault(chat_id, itertools.count(1)))
        thread = params.get("message_thread_id")
        reply = params.get("reply_parameters") or {}
        msg = SentMessage(
            chat_id=chat_id,
            message_id=mid,
            text=text,
            entities=list(params.get("entities") or params.get("caption_entities") or []),
            thread_id=int(thread) if thread is not None else None,
            reply_markup=params.get("reply_markup") or None,
            reply_to=int(reply["message_id"]) if isinstance(reply, dict) and reply else None,
        )
        self.messages[(chat_id, mid)] = msg
        self.sent.append(msg)
        return msg

    def _message_json(self, msg: SentMessage) -> dict[str, Any]:
        out: dict[str, Any] = {
            "message_id": msg.message_id,
            "date": int(time.time()),
            "chat": self.chat(msg.chat_id),
            "from": {"id": BOT_ID, "is_bot": True, "first_name": "turnstile"},
        }
        if msg.document is not None:
            out["document"] = {
                "file_id": f"f{msg.message_id}",
                "file_unique_id": f"u{msg.message_id}",
                "file_name": msg.filename,
                "file_size": len(msg.document),
            }
            if msg.text:
                out["caption"] = msg.text
        else:
            out["text"] = msg.text
        if msg.entities:
            out["caption_entities" if msg.document is not None else "entities"] = msg.entities
        if msg.thread_id is not None:
            out["message_thread_id"] = msg.thread_id
        # Telegram returns only inline keyboards with a message (a forced reply is not kept).
        if msg.reply_markup and "inline_keyboard" in msg.reply_markup:
            out["reply_markup"] = msg.reply_markup
        return out

    def _m_sendMessage(self, params: dict[str, Any]) -> dict[str, Any]:
        text = str(params.get("text", ""))
        if not text.strip():
            raise _ApiError(400, "Bad Request: message text is empty")
        if len(text.encode("utf-16-le")) // 2 > 4096:
            raise _ApiError(400, "Bad Request: message is too long")
        return self._message_json(self._new_message(params, text))

    def _m_sendDocument(self, params: dict[str, Any]) -> dict[str, Any]:
        doc = params.get("document")
        if not isinstance(doc, dict):
            raise _ApiError(400, "Bad Request: there is no document in the request")
        caption = str(params.get("caption", ""))
        if len(caption) > 1024:
            raise _ApiError(400, "Bad Request: message caption is too long")
        msg = self._new_message(params, caption)
        msg.document = doc["data"]
        msg.filename = doc["filename"]
        return self._message_json(msg)

    def _find(self, params: dict[str, Any]) -> SentMessage:
        key = (self._chat_id(params), int(params.get("message_id", 0)))
        msg = self.messages.get(key)
        if msg is None:
            raise _ApiError(400, "Bad Request: message to edit not found")
        return msg

    def _m_editMessageText(self, params: dict[str, Any]) -> dict[str, Any]:
        msg = self._find(params)
        text = str(params.get("text", ""))
        markup = params.get("reply_markup") or None
        entities = list(params.get("entities") or [])
        if text == msg.text and markup == msg.reply_markup and entities == msg.entities:
            raise _ApiError(
                400,
                "Bad Request: message is not modified: specified new message content and "
                "reply markup are exactly the same as a current content and reply markup "
                "of the message",
            )
        msg.history.append(msg.text)
        msg.text, msg.reply_markup, msg.entities = text, markup, entities
        msg.edits += 1
        return self._message_json(msg)

    def _m_editMessageReplyMarkup(self, params: dict[str, Any]) -> dict[str, Any]:
        msg = self._find(params)
        msg.reply_markup = params.get("reply_markup") or None
        msg.edits += 1
        return self._message_json(msg)

    def _m_deleteMessage(self, params: dict[str, Any]) -> bool:
        self._find(params)
        return True

    def _m_setMessageReaction(self, params: dict[str, Any]) -> bool:
        self.reactions.append(params)
        return True

    def _m_answerCallbackQuery(self, params: dict[str, Any]) -> bool:
        self.callback_answers.append(params)
        return True

    def _m_setMyCommands(self, params: dict[str, Any]) -> bool:
        self.commands = list(params.get("commands") or [])
        return True

    def _m_deleteWebhook(self, params: dict[str, Any]) -> bool:
        self.webhook = None
        return True

    def _m_setWebhook(self, params: dict[str, Any]) -> bool:
        self.webhook = params
        return True

    def _m_createForumTopic(self, params: dict[str, Any]) -> dict[str, Any]:
        self._chat_id(params)
        return {
            "message_thread_id": next(self._topic_ids),
            "name": str(params.get("name", "")),
            "icon_color": 7322096,
        }

    def _m_sendChatAction(self, params: dict[str, Any]) -> bool:
        return True


class _ApiError(Exception):
    def __init__(self, status: int, description: str) -> None:
        super().__init__(description)
        self.status = status
        self.description = description
