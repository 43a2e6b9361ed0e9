"""A fake model API on 127.0.0.1 that the real agent CLIs talk to.

It speaks just enough of two wire protocols, both streamed as server-sent events:

- the Anthropic Messages API (``POST /v1/messages``), used by Claude Code and by the
  Copilot CLI in bring-your-own-key mode;
- the OpenAI Responses API (``POST /v1/responses``), used by Codex.

Replies are scripted, one per model request, in the order they were enqueued. A reply
is rendered in whichever protocol the request used, so the same script can drive any CLI
(tool names differ per CLI, see :class:`ToolCall`). Every request is recorded.

Usage::

    async with FakeModelAPI() as api:
        api.enqueue(Text("hello"))
        env = api.claude_env(config_dir)          # or copilot_env / codex_env
        ...run the CLI...
        assert "my prompt" in api.model_requests[0].all_text()

Replies:

- :class:`Text` — an assistant message with that text (``stop_reason: end_turn``).
- :class:`ToolCall` — one tool call (``stop_reason: tool_use`` / a ``function_call`` item);
  the CLI runs the tool and sends another request carrying the tool result, so enqueue the
  reply to that request too (usually a :class:`Text`).
- :class:`Status` — an HTTP error status with an API-shaped error body (400 by default).
- :class:`Hold` — starts the stream, then holds the response open until ``release`` is set
  or the server stops; ``arrived`` is set when the request came in (for pre-emption tests).

When the queue is empty the server answers with :attr:`FakeModelAPI.fallback` (a
``Text`` by default) and counts it in :attr:`FakeModelAPI.unscripted`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import uuid
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

from aiohttp import web

__all__ = [
    "FakeModelAPI",
    "Hold",
    "RecordedRequest",
    "Reply",
    "Status",
    "Text",
    "ToolCall",
]

API_KEY = "sk-test-fake-model-api"


@dataclass(frozen=True, slots=True)
class Text:
    """An assistant message."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call, then the turn waits for the tool result.

    Attributes:
        name: the tool as the CLI names it (Claude: ``Write``, ``Bash``; Copilot:
            ``create``, ``bash``; Codex: ``exec_command``).
        arguments: the tool's input object.
        text: optional text sent before the call.
    """

    name: str
    arguments: Mapping[str, Any]
    text: str | None = None
    call_id: str = field(default_factory=lambda: f"toolu_{uuid.uuid4().hex[:20]}")


@dataclass(frozen=True, slots=True)
class Status:
    """An HTTP error answer, shaped like the API's error body."""

    status: int = 400
    message: str = "scripted error from the fake model API"


@dataclass(eq=False, slots=True)
class Hold:
    """Open the stream, then keep the response open until released (or the server stops)."""

    text: str = "released"
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    closed_by_client: asyncio.Event = field(default_factory=asyncio.Event)


Reply: TypeAlias = Text | ToolCall | Status | Hold


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """One request the fake server received."""

    method: str
    path: str
    query: Mapping[str, str]
    headers: Mapping[str, str]
    body: bytes
    reply: Reply | None

    @property
    def json(self) -> Any:
        """The body parsed as JSON (None when it is not JSON)."""
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    @property
    def is_model_call(self) -> bool:
        return self.method == "POST" and self.path in ("/v1/messages", "/v1/responses")

    def strings(self) -> Iterator[str]:
        """Every string value in the JSON body, depth first."""
        stack: list[Any] = [self.json]
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                yield item
            elif isinstance(item, Mapping):
                stack.extend(reversed(list(item.values())))
            elif isinstance(item, list):
                stack.extend(reversed(item))

    def all_text(self) -> str:
        """All string values of the body joined by newlines (for ``in`` assertions)."""
        return "\n".join(self.strings())

    def conversation(self) -> list[tuple[str, str]]:
        """``(role, text)`` pairs of the conversation sent, system prompts left out.

        Understands Anthropic ``messages`` and OpenAI Responses ``input`` items; tool calls
        and results show as ``tool_use`` / ``tool_result`` roles with their JSON.
        """
        body = self.json or {}
        out: list[tuple[str, str]] = []
        if isinstance(body.get("messages"), list):
            for message in body["messages"]:
                role = message.get("role", "?")
                if role == "system":
                    continue
                content = message.get("content")
                if isinstance(content, str):
                    out.append((role, content))
                    continue
                for block in content or []:
                    kind = block.get("type")
                    if kind == "text":
                        out.append((role, block.get("text", "")))
                    elif kind in ("tool_use", "tool_result"):
                        out.append((kind, json.dumps(block)))
        elif isinstance(body.get("input"), list):
            for item in body["input"]:
                kind = item.get("type", "message")
                if kind == "message":
                    role = item.get("role", "?")
                    if role in ("system", "developer"):
                        continue
                    content = item.get("content")
                    if isinstance(content, str):
                        out.append((role, content))
                        continue
                    for part in content or []:
                        if isinstance(part.get("text"), str):
                            out.append((role, part["text"]))
                elif kind == "function_call":
                    out.append(("tool_use", json.dumps(item)))
                elif kind == "function_call_output":
                    out.append(("tool_result", json.dumps(item)))
        return out


class FakeModelAPI:
    """A scripted model API server on 127.0.0.1; an async context manager.

    Attributes:
        requests: every request received, in order (including ``HEAD /`` probes).
        fallback: the reply used when nothing is enqueued.
        unscripted: how many model requests were answered with the fallback.
    """

    def __init__(self, *, fallback: Reply | None = None, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = 0
        self.requests: list[RecordedRequest] = []
        self.fallback: Reply = fallback or Text("(no scripted reply)")
        self.unscripted = 0
        self._queue: deque[Reply] = deque()
        self._runner: web.AppRunner | None = None
        self._holds: list[Hold] = []
        self._stopping = asyncio.Event()
        self.model_request_seen = asyncio.Condition()

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> FakeModelAPI:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, 0))
            self.port = sock.getsockname()[1]
            site = web.SockSite(runner, sock)
            await site.start()
        except BaseException:
            sock.close()
            await runner.cleanup()
            raise
        self._runner = runner
        return self

    async def stop(self) -> None:
        self._stopping.set()
        for hold in self._holds:
            hold.release.set()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def __aenter__(self) -> FakeModelAPI:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        """Base URL without a trailing slash, e.g. ``http://127.0.0.1:40123``."""
        return f"http://{self.host}:{self.port}"

    # -- script ----------------------------------------------------------------------
    def enqueue(self, *replies: Reply) -> None:
        """Append replies; each answers one model request, in order."""
        self._queue.extend(replies)

    @property
    def pending(self) -> int:
        """Replies enqueued but not used yet."""
        return len(self._queue)

    @property
    def model_requests(self) -> list[RecordedRequest]:
        """The model calls (``POST /v1/messages`` and ``POST /v1/responses``) only."""
        return [r for r in self.requests if r.is_model_call]

    async def wait_for_model_requests(self, count: int) -> None:
        """Return once ``count`` model requests have arrived."""
        async with self.model_request_seen:
            await self.model_request_seen.wait_for(lambda: len(self.model_requests) >= count)

    # -- environments for the three CLIs -----------------------------------------------
    def claude_env(self, config_dir: Path) -> dict[str, str]:
        """Variables that point Claude Code at this server, with its own config dir."""
        return {
            "ANTHROPIC_BASE_URL": self.url,
            "ANTHROPIC_API_KEY": API_KEY,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CONFIG_DIR": str(config_dir),
        }

    def copilot_env(self, home: Path) -> dict[str, str]:
        """Variables for the Copilot CLI in offline bring-your-own-key mode."""
        return {
            "COPILOT_OFFLINE": "true",
            "COPILOT_PROVIDER_TYPE": "anthropic",
            "COPILOT_PROVIDER_BASE_URL": self.url,
            "COPILOT_PROVIDER_API_KEY": API_KEY,
            "COPILOT_MODEL": "claude-sonnet-4.5",
            "COPILOT_AUTO_UPDATE": "false",
            "COPILOT_HOME": str(home),
        }

    def codex_env(self, home: Path) -> dict[str, str]:
        """Variables for Codex, writing ``home/.codex/config.toml`` with this server."""
        codex_dir = home / ".codex"
        codex_dir.mkdir(parents=True, exist_ok=True)
        (codex_dir / "config.toml").write_text(
            'model_provider = "fake"\n'
            'model = "gpt-fake"\n'
            "[analytics]\nenabled = false\n"
            "[model_providers.fake]\n"
            'name = "fake"\n'
            f'base_url = "{self.url}/v1"\n'
            'env_key = "FAKE_API_KEY"\n'
            'wire_api = "responses"\n'
            "request_max_retries = 0\n"
            "stream_max_retries = 0\n",
            encoding="utf-8",
        )
        return {"HOME": str(home), "CODEX_HOME": str(codex_dir), "FAKE_API_KEY": API_KEY}

    # -- serving ---------------------------------------------------------------------
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        path = request.path
        is_model = request.method == "POST" and path in ("/v1/messages", "/v1/responses")
        reply: Reply | None = None
        if is_model:
            if self._queue:
                reply = self._queue.popleft()
            else:
                reply = self.fallback
                self.unscripted += 1
        self.requests.append(
            RecordedRequest(
                method=request.method,
                path=path,
                query=dict(request.query),
                headers=dict(request.headers),
                body=body,
                reply=reply,
            )
        )
        if is_model:
            async with self.model_request_seen:
                self.model_request_seen.notify_all()
        if reply is None:
            if request.method in ("HEAD", "GET") and path in ("/", ""):
                return web.Response(status=200, text="fake model api")
            if path.endswith("/models"):
                return web.json_response({"object": "list", "data": [], "models": []})
            return web.json_response({"error": {"message": f"no route {path}"}}, status=404)
        anthropic = path == "/v1/messages"
        model = _requested_model(body)
        if isinstance(reply, Status):
            return _error_response(reply, anthropic=anthropic)
        response = web.StreamResponse(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
        )
        await response.prepare(request)
        events = _anthropic_events if anthropic else _responses_events
        if isinstance(reply, Hold):
            self._holds.append(reply)
            head, tail = events(Text(reply.text), model, split=True)
            await _send(response, head)
            reply.arrived.set()
            await self._hold(request, reply)
            if self._stopping.is_set() or reply.closed_by_client.is_set():
                return response
            await _send(response, tail)
        else:
            await _send(response, events(reply, model, split=False)[0])
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response

    async def _hold(self, request: web.Request, hold: Hold) -> None:
        """Wait for release, server stop, or the client going away."""
        transport = request.transport

        async def client_gone() -> None:
            while transport is not None and not transport.is_closing():
                await asyncio.sleep(0.05)
            hold.closed_by_client.set()

        watcher = asyncio.create_task(client_gone(), name="fake-model-api-hold-watch")
        waiter = asyncio.create_task(hold.release.wait(), name="fake-model-api-hold")
        try:
            await asyncio.wait({watcher, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (watcher, waiter):
                task.cancel()
            await asyncio.gather(watcher, waiter, return_exceptions=True)


Event: TypeAlias = tuple[str, dict[str, Any]]


def _requested_model(body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return "fake-model"
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) and model else "fake-model"


async def _send(response: web.StreamResponse, events: list[Event]) -> None:
    for name, data in events:
        chunk = f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
        with contextlib.suppress(ConnectionResetError):
            await response.write(chunk)


def _error_response(reply: Status, *, anthropic: bool) -> web.Response:
    if anthropic:
        body: dict[str, Any] = {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": reply.message},
        }
    else:
        body = {
            "error": {
                "type": "invalid_request_error",
                "message": reply.message,
                "code": "invalid_request",
                "param": None,
            }
        }
    return web.json_response(body, status=reply.status)


def _anthropic_events(reply: Reply, model: str, *, split: bool) -> tuple[list[Event], list[Event]]:
    """Anthropic Messages stream events; ``split`` cuts after ``message_start``."""
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    start: Event = (
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 12, "output_tokens": 1},
            },
        },
    )
    body: list[Event] = []
    index = 0
    stop_reason = "end_turn"
    text = reply.text if isinstance(reply, Text | ToolCall | Hold) else None
    if text:
        body += _anthropic_block(index, {"type": "text", "text": ""}, "text_delta", "text", text)
        index += 1
    if isinstance(reply, ToolCall):
        block = {"type": "tool_use", "id": reply.call_id, "name": reply.name, "input": {}}
        body += _anthropic_block(
            index, block, "input_json_delta", "partial_json", json.dumps(reply.arguments)
        )
        stop_reason = "tool_use"
    body += [
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                "usage": {"output_tokens": 7},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    if split:
        return [start, ("ping", {"type": "ping"})], body
    return [start, *body], []


def _anthropic_block(
    index: int, block: dict[str, Any], delta_type: str, key: str, value: str
) -> list[Event]:
    return [
        (
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": block},
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": delta_type, key: value},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": index}),
    ]


def _responses_events(reply: Reply, model: str, *, split: bool) -> tuple[list[Event], list[Event]]:
    """OpenAI Responses stream events; ``split`` cuts after ``response.created``."""
    response_id = f"resp_{uuid.uuid4().hex[:24]}"
    seq = iter(range(1_000_000))

    def event(name: str, **data: Any) -> Event:
        return (name, {"type": name, "sequence_number": next(seq), **data})

    created = event(
        "response.created",
        response={"id": response_id, "object": "response", "status": "in_progress", "model": model},
    )
    body: list[Event] = []
    output_index = 0
    text = reply.text if isinstance(reply, Text | ToolCall | Hold) else None
    if text:
        item_id = f"msg_{uuid.uuid4().hex[:24]}"
        added = {
            "id": item_id,
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        done = {
            "id": item_id,
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
        body += [
            event("response.output_item.added", output_index=output_index, item=added),
            event(
                "response.output_text.delta",
                item_id=item_id,
                output_index=output_index,
                content_index=0,
                delta=text,
            ),
            event("response.output_item.done", output_index=output_index, item=done),
        ]
        output_index += 1
    if isinstance(reply, ToolCall):
        item = {
            "id": f"fc_{uuid.uuid4().hex[:24]}",
            "type": "function_call",
            "status": "completed",
            "call_id": reply.call_id,
            "name": reply.name,
            "arguments": json.dumps(reply.arguments),
        }
        body += [
            event("response.output_item.added", output_index=output_index, item=item),
            event("response.output_item.done", output_index=output_index, item=item),
        ]
    body.append(
        event(
            "response.completed",
            response={
                "id": response_id,
                "object": "response",
                "status": "completed",
                "model": model,
                "usage": {
                    "input_tokens": 12,
                    "input_tokens_details": {"cached_tokens": 0},
                    "output_tokens": 7,
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": 19,
                },
            },
        )
    )
    if split:
        return [created], body
    return [created, *body], []
