"""Speech to text through an OpenAI-compatible ``/v1/audio/transcriptions`` endpoint.

Hosted services (OpenAI, Groq, ...) and local servers (faster-whisper-server, whisper.cpp's
server, LocalAI, ...) speak the same API: a multipart POST with the audio as ``file`` and
``model``, answered with ``{"text": "..."}``. The URL may name the endpoint itself or the
API's base (``https://api.openai.com/v1``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Final, Protocol

import httpx
from pydantic import SecretStr

from engine.errors import TranscriptionError
from engine.redact import Redactor

__all__ = ["HttpTranscriber", "Transcriber", "endpoint_url"]

_LOGGER = logging.getLogger(__name__)
_PATH: Final = "/audio/transcriptions"
_BODY_EXCERPT: Final = 300


class Transcriber(Protocol):
    async def transcribe(self, audio: bytes, *, filename: str, mime: str) -> str:
        """The text spoken in ``audio``.

        Raises:
            TranscriptionError: the service refused or could not be reached.
        """
        ...


def endpoint_url(url: str) -> str:
    """The transcription endpoint for a configured URL (endpoint or API base)."""
    base = url.rstrip("/")
    if base.endswith(_PATH):
        return base
    if base.endswith("/v1"):
        return base + _PATH
    return base + "/v1" + _PATH


@dataclass
class HttpTranscriber:
    """Posts audio to the endpoint with httpx; one client per call (voice notes are rare)."""

    url: str
    model: str
    key: SecretStr | None = None
    timeout: float = 120.0
    language: str | None = None
    transport: httpx.AsyncBaseTransport | None = None

    async def transcribe(self, audio: bytes, *, filename: str, mime: str) -> str:
        headers = {"Accept": "application/json"}
        secrets = []
        if self.key is not None and self.key.get_secret_value():
            secret = self.key.get_secret_value()
            headers["Authorization"] = f"Bearer {secret}"
            secrets.append(secret)
        redact = Redactor(secrets)
        data: dict[str, Any] = {"model": self.model, "response_format": "json"}
        if self.language:
            data["language"] = self.language
        target = endpoint_url(self.url)
        try:
            async with httpx.AsyncClient(
                timeout=self.timeout, transport=self.transport, trust_env=True
            ) as client:
                response = await client.post(
                    target,
                    headers=headers,
                    data=data,
                    files={"file": (filename, audio, mime)},
                )
        except httpx.TimeoutException as exc:
            raise TranscriptionError(
                f"the speech-to-text service did not answer within {self.timeout:.0f}s",
                retryable=True,
            ) from exc
        except httpx.HTTPError as exc:
            raise TranscriptionError(
                f"the speech-to-text service cannot be reached: {redact(str(exc))[:200]}",
                retryable=True,
            ) from exc
        if response.status_code >= 400:
            excerpt = redact(response.text[:_BODY_EXCERPT]).strip()
            raise TranscriptionError(
                f"the speech-to-text service answered HTTP {response.status_code}"
                + (f": {excerpt}" if excerpt else ""),
                status=response.status_code,
                retryable=response.status_code >= 500 or response.status_code == 429,
            )
        try:
            payload = response.json()
            text = payload.get("text") if isinstance(payload, dict) else None
        except ValueError:
            # response_format=json is asked for; a server that answers plain text anyway
            # is taken at its word.
            text = response.text
        if not isinstance(text, str):
            raise TranscriptionError(
                "the speech-to-text service answered without a transcript",
                status=response.status_code,
            )
        _LOGGER.info("voice note transcribed (%d bytes of audio)", len(audio))
        return text.strip()
