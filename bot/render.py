"""Agent Markdown → Telegram messages: plain text plus entities, split, or a document.

Conversion goes through the maintained ``telegramify-markdown`` converter (no
hand-escaping, so no "can't parse entities"). Secrets are redacted from the raw text
before anything else looks at it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import telegramify_markdown as tgmd

__all__ = ["MAX_CAPTION", "MAX_MESSAGE", "Rendered", "plain", "render_markdown"]

MAX_MESSAGE: Final = 4096
MAX_CAPTION: Final = 1024
_HEAD_LINES: Final = 12
_HEAD_CHARS: Final = 600


@dataclass(frozen=True, slots=True)
class Rendered:
    """One message body: text and its entities (UTF-16 offsets), or a document."""

    text: str
    entities: tuple[dict[str, Any], ...] = ()
    document: str | None = None
    filename: str | None = None


def plain(text: str) -> Rendered:
    """A message sent as is (no Markdown), cut to the message limit."""
    return Rendered(text=_cut(text, MAX_MESSAGE))


def _utf16(text: str) -> int:
    return tgmd.utf16_len(text)


def _cut(text: str, limit: int) -> str:
    if _utf16(text) <= limit:
        return text
    out = text[: limit - 1]
    while _utf16(out) > limit - 1:
        out = out[:-1]
    return out + "…"


def _convert(markdown: str) -> tuple[str, list[tgmd.MessageEntity]]:
    try:
        text, entities = tgmd.convert(markdown)
    except Exception:
        return markdown, []
    if not text.strip() and markdown.strip():
        return markdown, []
    return text, entities


def render_markdown(
    markdown: str,
    *,
    redact: Callable[[str], str],
    document_threshold: int,
    header: str = "",
    filename: str = "output.md",
) -> list[Rendered]:
    """Messages for one agent output.

    Output longer than ``document_threshold`` characters becomes a document holding the
    whole (redacted) text, preceded by a short head; shorter output is converted to
    entities and split at ≤ 4096 UTF-16 units on line boundaries.
    """
    safe = redact(markdown)
    if not safe.strip():
        return [plain((header + "(no output)").strip())]
    if len(safe) > document_threshold:
        lines = safe.splitlines()
        head = "\n".join(lines[:_HEAD_LINES])[:_HEAD_CHARS]
        note = (
            f"{header}📄 {len(safe):,} characters, {len(lines):,} lines: the whole output "
            f"is in {filename}.\n\n{head}"
        )
        if len(head) < len(safe):
            note += "\n…"
        return [Rendered(text=_cut(note, MAX_CAPTION), document=safe, filename=filename)]
    text, entities = _convert(safe)
    if header:
        shift = _utf16(header)
        text = header + text
        entities = [e.copy_with(offset=e.offset + shift) for e in entities]
    chunks = tgmd.split_entities(text, entities, MAX_MESSAGE)
    return [
        Rendered(text=chunk, entities=tuple(e.to_dict() for e in ents)) for chunk, ents in chunks
    ] or [plain(header + "(no output)")]
