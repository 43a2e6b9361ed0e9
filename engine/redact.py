"""Secret redaction for anything that leaves the engine: error texts, logs, chat output."""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["REDACTED", "Redactor", "redact", "tail"]

REDACTED = "[REDACTED]"

# Shapes of credentials commonly found in agent output, environment dumps and headers.
_PATTERNS: tuple[re.Pattern[str], ...] = (
    re.compile(r"\bsk-(?:ant-|proj-)?[A-Za-z0-9_\-]{8,}"),
    re.compile(r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{20,}"),
    re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20,}"),
    re.compile(r"\bxox[abprs]-[A-Za-z0-9\-]{10,}"),
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),
    re.compile(r"\b\d{6,12}:[A-Za-z0-9_\-]{30,}"),  # Telegram bot tokens
    re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/\-]+=*"),
    re.compile(r"(?i)(\b(?:api[_-]?key|token|secret|password|passwd)\s*[=:]\s*)(\"?)[^\s\"']{6,}"),
    re.compile(r"(?i)(://[^/\s:@]+:)[^@\s/]+(@)"),  # credentials inside URLs
)


class Redactor:
    """Replaces known secret shapes, plus any exact secrets it was given, with a marker."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets = tuple(sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True))

    def with_secrets(self, secrets: Iterable[str]) -> Redactor:
        """A redactor that also hides ``secrets``."""
        return Redactor((*self._secrets, *secrets))

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        for pattern in _PATTERNS:
            text = pattern.sub(_replacement, text)
        return text


def _replacement(match: re.Match[str]) -> str:
    groups = match.groups()
    if len(groups) == 2 and groups[1] == "@":
        return f"{groups[0]}{REDACTED}@"
    if len(groups) == 2:
        return f"{groups[0]}{groups[1]}{REDACTED}"
    return REDACTED


_DEFAULT = Redactor()


def redact(text: str) -> str:
    """Redact known secret shapes from ``text``."""
    return _DEFAULT(text)


def tail(data: bytes | str, limit: int = 2048) -> str:
    """The last ``limit`` bytes of ``data`` as text, redacted."""
    raw = data.encode("utf-8", errors="replace") if isinstance(data, str) else data
    if len(raw) > limit:
        raw = raw[-limit:]
    return redact(raw.decode("utf-8", errors="replace"))
