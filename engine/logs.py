"""Logging set-up: human-readable by default, JSON by setting, secrets redacted.

Context ids (run, session, task, phase, chat) reach a line in two ways: per call with
``extra={"run_id": ...}``, or for a whole block of work with :func:`log_context`, which
every line logged inside it (in the same task, and in tasks created inside it) carries.

Redaction happens once, in a filter on the handler, after the message is rendered: the
known secrets passed to :func:`setup_logging` and every credential shape
:class:`engine.redact.Redactor` knows are replaced in the message, the traceback and the
context values. Uncaught exceptions are routed through logging so they are redacted too.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType, TracebackType
from typing import Literal, TextIO

from engine.redact import Redactor

__all__ = [
    "CONTEXT_KEYS",
    "ContextFilter",
    "RedactingFilter",
    "current_context",
    "log_context",
    "setup_logging",
]

# Attributes callers attach with ``extra=`` that belong in every line where present.
CONTEXT_KEYS = ("run_id", "session_id", "task", "phase", "chat_id")

_CONTEXT: contextvars.ContextVar[Mapping[str, object]] = contextvars.ContextVar(
    "turnstile_log_context", default=MappingProxyType({})
)
_NOISY = ("httpx", "httpcore", "aiosqlite", "apscheduler")


@contextmanager
def log_context(**keys: object) -> Iterator[None]:
    """Attach context ids (``run_id=``, ``task=``, ...) to every line logged inside.

    Nested blocks add to (and may override) the outer ones; ``None`` values are dropped.

    Raises:
        ValueError: a key is not one of :data:`CONTEXT_KEYS`.
    """
    unknown = sorted(set(keys) - set(CONTEXT_KEYS))
    if unknown:
        raise ValueError(f"unknown log context keys {unknown}: use {', '.join(CONTEXT_KEYS)}")
    merged = {**_CONTEXT.get(), **{k: v for k, v in keys.items() if v is not None}}
    token = _CONTEXT.set(MappingProxyType(merged))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def current_context() -> Mapping[str, object]:
    """The context ids set by the enclosing :func:`log_context` blocks."""
    return dict(_CONTEXT.get())


class ContextFilter(logging.Filter):
    """Copies the :func:`log_context` ids onto a record, unless ``extra=`` set them."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _CONTEXT.get().items():
            if getattr(record, key, None) is None:
                setattr(record, key, value)
        return True


class RedactingFilter(logging.Filter):
    """Redacts the rendered message, traceback and context, so secrets never reach a handler."""

    def __init__(self, redactor: Redactor) -> None:
        super().__init__()
        self._redactor = redactor

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):
            # A malformed %-format must not lose the line (nor leak its arguments raw).
            message = f"{record.msg!s} {record.args!r}"
        record.msg = self._redactor(message)
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self._redactor(record.exc_text)
        if record.stack_info:
            record.stack_info = self._redactor(record.stack_info)
        for key in CONTEXT_KEYS:
            value = getattr(record, key, None)
            if isinstance(value, str):
                setattr(record, key, self._redactor(value))
        return True


def _context_of(record: logging.LogRecord) -> dict[str, object]:
    return {k: v for k in CONTEXT_KEYS if (v := getattr(record, k, None)) is not None}


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        millis = int(record.msecs)
        line = f"{stamp}.{millis:03d} {record.levelname:<7} {record.name}: {record.getMessage()}"
        context = " ".join(f"{k}={v}" for k, v in _context_of(record).items())
        if context:
            line += f" [{context}]"
        if record.exc_text:
            line += "\n" + record.exc_text
        if record.stack_info:
            line += "\n" + record.stack_info
        return line


class _HumanFormatter(logging.Formatter):
    """A terminal's view of a record: ``turnstile: warning: message``, no stamp or module."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"turnstile: {record.levelname.lower()}: {record.getMessage()}"
        if record.exc_text:
            line += "\n" + record.exc_text
        return line


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time, so a live terminal display that
    redirects it (rich's ``Live``) prints log lines above its status line."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, object] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        payload.update(_context_of(record))
        if record.exc_text:
            payload["exc"] = record.exc_text
        if record.stack_info:
            payload["stack"] = record.stack_info
        return json.dumps(payload, ensure_ascii=False, default=str)


def setup_logging(
    *,
    level: str = "INFO",
    fmt: Literal["text", "json", "human"] = "text",
    secrets: tuple[str, ...] = (),
    stream: TextIO | None = None,
    capture_uncaught: bool = True,
) -> logging.Handler:
    """Configure the root logger once, from the composition root; returns its handler.

    Args:
        secrets: exact values (the bot token, the webhook secret) never to print.
        fmt: ``text`` (stamp, level, module, context), ``json``, or ``human`` (what a
            person at a terminal reads: level and message only).
        stream: where lines go (default stderr: journald and ``docker logs`` collect it).
        capture_uncaught: route uncaught exceptions (main thread and others) through
            logging, so their tracebacks are redacted as well.
    """
    handler: logging.Handler = logging.StreamHandler(stream or _CurrentStderr())
    formatters = {"json": _JsonFormatter, "human": _HumanFormatter, "text": _TextFormatter}
    handler.setFormatter(formatters[fmt]())
    handler.addFilter(ContextFilter())
    handler.addFilter(RedactingFilter(Redactor(secrets)))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in _NOISY:
        # httpx logs every request URL at INFO, and Bot API URLs contain the token.
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.captureWarnings(True)
    if capture_uncaught:
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_thread_uncaught
    return handler


_UNCAUGHT = logging.getLogger("turnstile.uncaught")


def _log_uncaught(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)
        return
    _UNCAUGHT.critical("uncaught exception", exc_info=(exc_type, exc, tb))


def _log_thread_uncaught(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit or args.exc_value is None:
        return
    _UNCAUGHT.critical(
        "uncaught exception in thread %s",
        args.thread.name if args.thread else "?",
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )
