"""Logging set-up: human-readable by default, JSON by setting, secrets redacted."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Literal

from engine.redact import Redactor

__all__ = ["RedactingFilter", "setup_logging"]

# Attributes callers attach with ``extra=`` that belong in every line where present.
CONTEXT_KEYS = ("run_id", "session_id", "task", "phase", "chat_id")


class RedactingFilter(logging.Filter):
    """Redacts the rendered message, so secrets never reach a handler."""

    def __init__(self, redactor: Redactor) -> None:
        super().__init__()
        self._redactor = redactor

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        record.msg = self._redactor(message)
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._redactor(logging.Formatter().formatException(record.exc_info))
        return True


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        context = " ".join(
            f"{k}={value}" for k in CONTEXT_KEYS if (value := getattr(record, k, None)) is not None
        )
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        line = f"{stamp} {record.levelname:<7} {record.name}: {record.getMessage()}"
        if context:
            line += f" [{context}]"
        if record.exc_text:
            line += "\n" + record.exc_text
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, object] = {
            "ts": record.created,
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in CONTEXT_KEYS:
            value = getattr(record, key, None)
            if value is not None:
                payload[key] = value
        if record.exc_text:
            payload["exc"] = record.exc_text
        return json.dumps(payload, ensure_ascii=False)


def setup_logging(
    *,
    level: str = "INFO",
    fmt: Literal["text", "json"] = "text",
    secrets: tuple[str, ...] = (),
    stream: object = None,
) -> None:
    """Configure the root logger once, from the composition root."""
    handler = logging.StreamHandler(stream or sys.stderr)  # type: ignore[arg-type]
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    handler.addFilter(RedactingFilter(Redactor(secrets)))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpcore", "aiosqlite"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
