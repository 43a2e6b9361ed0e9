"""A fake OpenAI-compatible speech-to-text server (``POST /v1/audio/transcriptions``) on
127.0.0.1, for voice-note tests.

It records every request (model, file name, content type, the audio bytes, the
``Authorization`` header) and answers ``{"text": transcript}``; a status can be injected.

Usage::

    async with FakeTranscriptionApi(transcript="fix the login bug") as stt:
        settings = ...(transcription_url=stt.url)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiohttp import BodyPartReader, web

__all__ = ["FakeTranscriptionApi", "TranscriptionRequest"]


@dataclass
class TranscriptionRequest:
    model: str | None
    filename: str | None
    content_type: str | None
    audio: bytes
    authorization: str | None
    fields: dict[str, str]


class FakeTranscriptionApi:
    """The fake server. Use as an async context manager."""

    def __init__(self, *, transcript: str = "hello from a voice note") -> None:
        self.transcript = transcript
        self.requests: list[TranscriptionRequest] = []
        self.status: int | None = None
        self.received = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def __aenter__(self) -> FakeTranscriptionApi:
        app = web.Application(client_max_size=32 * 1024 * 1024)
        app.router.add_post("/v1/audio/transcriptions", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        self.port = getattr(server, "sockets", [])[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def url(self) -> str:
        """The API base, the way users configure hosted services."""
        return f"http://127.0.0.1:{self.port}/v1"

    async def _handle(self, request: web.Request) -> web.Response:
        fields: dict[str, str] = {}
        audio = b""
        filename = content_type = None
        reader = await request.multipart()
        async for part in reader:
            if not isinstance(part, BodyPartReader) or part.name is None:
                continue
            if part.name == "file":
                filename = part.filename
                content_type = part.headers.get("Content-Type")
                audio = await part.read()
            else:
                fields[part.name] = await part.text()
        self.requests.append(
            TranscriptionRequest(
                model=fields.get("model"),
                filename=filename,
                content_type=content_type,
                audio=bytes(audio),
                authorization=request.headers.get("Authorization"),
                fields=fields,
            )
        )
        self.received.set()
        if self.status is not None:
            # Some services echo what they were sent; the client must never show it.
            message = f"refused for {request.headers.get('Authorization')}"
            body: dict[str, Any] = {"error": {"message": message, "type": "server"}}
            return web.json_response(body, status=self.status)
        return web.json_response({"text": self.transcript})
