"""Agent Markdown → Telegram messages: plain text plus entities, split, or a document.

Conversion goes through the maintained ``telegramify-markdown`` converter (no
hand-escaping, so no "can't parse entities"). Secrets are redacted from what is sent:
the final text (Markdown can split a key with emphasis or escapes, ``sk-ant-*x*``) and
the entities' URLs, with the entities' offsets moved along. A link whose text looks like
another URL than the one it opens is shown as its plain target.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

import telegramify_markdown as tgmd

from chatfront.render import Rendered
from engine.redact import Edit, Redactor
from engine.runs.spec import PlaceId

__all__ = [
    "MAX_CAPTION",
    "MAX_MESSAGE",
    "TELEGRAM",
    "TelegramRenderer",
    "caption",
    "message_link",
    "plain",
    "render_markdown",
    "render_parts",
]

MAX_MESSAGE: Final = 4096
MAX_CAPTION: Final = 1024
_HEAD_LINES: Final = 12
_HEAD_CHARS: Final = 600


def message_link(chat_id: PlaceId, message_id: int | None) -> str | None:
    """A link that opens a message of a supergroup (None: another kind of chat, or a
    message not yet delivered: Telegram has no link for those)."""
    digits = chat_id.removeprefix("-100")
    if message_id is None or digits == chat_id or not digits.isdigit():
        return None
    return f"https://t.me/c/{digits}/{message_id}"


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


@dataclass(frozen=True, slots=True)
class _Span:
    """Replace UTF-16 units ``start:end`` of a text with ``replacement``."""

    start: int
    end: int
    replacement: str


def _splice(
    text: str, entities: Sequence[tgmd.MessageEntity], spans: Sequence[_Span]
) -> tuple[str, list[tgmd.MessageEntity]]:
    """Apply sorted, disjoint ``spans`` to ``text`` and move the entities with them.

    An entity edge inside a replaced span moves to that span's edge (so the entity keeps
    covering the replacement); an entity left empty is dropped.
    """
    if not spans:
        return text, list(entities)
    data = text.encode("utf-16-le")
    pieces: list[bytes] = []
    pos = 0
    for span in spans:
        pieces.append(data[2 * pos : 2 * span.start])
        pieces.append(span.replacement.encode("utf-16-le"))
        pos = span.end
    pieces.append(data[2 * pos :])
    new_text = b"".join(pieces).decode("utf-16-le")

    def moved(point: int, *, is_end: bool) -> int:
        shift = 0
        for span in spans:
            if point <= span.start:
                break
            if point < span.end:
                return span.start + shift + (_utf16(span.replacement) if is_end else 0)
            shift += _utf16(span.replacement) - (span.end - span.start)
        return point + shift

    out = []
    for entity in entities:
        start = moved(entity.offset, is_end=False)
        end = moved(entity.offset + entity.length, is_end=True)
        if end > start:
            out.append(entity.copy_with(offset=start, length=end - start))
    return new_text, out


def _spans_of(text: str, edits: Sequence[Edit]) -> list[_Span]:
    """String-index edits of ``text`` as UTF-16 spans."""
    spans = []
    pos = 0
    units = 0
    for edit in edits:
        units += _utf16(text[pos : edit.start])
        width = _utf16(text[edit.start : edit.end])
        spans.append(_Span(units, units + width, edit.replacement))
        units += width
        pos = edit.end
    return spans


_SCHEME_URL: Final = re.compile(r"(?i)[a-z][a-z0-9+.\-]*://[^\s<>\"'`]+")
# A bare host name (any script: look-alike letters count), maybe with a port and a path.
_BARE_HOST: Final = re.compile(
    r"^(?:[^\W_](?:[\w\-]*[^\W_])?\.)+[^\W\d_]{2,63}\.?(?::\d{1,5})?(?P<rest>[/?#]\S*)?$"
)


def _parts(url: str) -> tuple[str, str, str, str, str, str] | None:
    try:
        parts = urlsplit(url.strip())
        port = str(parts.port or "")
    except ValueError:
        return None
    host = (parts.hostname or "").lower().removeprefix("www.")
    path = parts.path.rstrip("/")
    return parts.scheme.lower(), host, port, path, parts.query, parts.fragment


def _misleading(label: str, url: str) -> bool:
    """Whether a link shown as ``label`` looks like it goes somewhere else than ``url``."""
    label = label.strip()
    if label == url.strip():
        return False  # it shows exactly what it opens
    target = _parts(url)
    for found in _SCHEME_URL.findall(label):
        shown = _parts(found.rstrip(".,;:!?"))
        if shown is None or shown != target:
            return True
    bare = _BARE_HOST.match(label)
    if bare is None or "://" in label:
        return False
    shown = _parts("https://" + label)
    if shown is None or target is None:
        return True
    if bare.group("rest"):
        return shown[1:] != target[1:]  # host, port, path, query, fragment; any scheme
    return shown[1] != target[1]  # a bare host name promises the host only


_LINK_SCHEMES: Final = frozenset({"http", "https", "tg"})


def _sendable_link(url: str | None) -> bool:
    """Whether Telegram takes ``url`` as a link's target (an absolute http(s) or tg URL)."""
    if not url:
        return False
    try:
        parts = urlsplit(url.strip())
    except ValueError:
        return False
    return parts.scheme.lower() in _LINK_SCHEMES and bool(parts.netloc or parts.scheme == "tg")


def _plain_targets(
    text: str, entities: list[tgmd.MessageEntity]
) -> tuple[str, list[tgmd.MessageEntity]]:
    """Misleading links become their target, shown as it is (a ``url`` entity)."""
    data = text.encode("utf-16-le")
    spans: list[_Span] = []
    kept: list[tgmd.MessageEntity] = []
    end = 0
    for entity in sorted(entities, key=lambda e: e.offset):
        if entity.type == "text_link" and not _sendable_link(entity.url):
            # A relative link ("[README.md](README.md)") or an odd scheme: the Bot API
            # refuses the whole message for it. The label stays, as plain text.
            continue
        if entity.type == "text_link" and entity.url and entity.offset >= end:
            label = data[2 * entity.offset : 2 * (entity.offset + entity.length)]
            if _misleading(label.decode("utf-16-le", errors="replace"), entity.url):
                spans.append(_Span(entity.offset, entity.offset + entity.length, entity.url))
                end = entity.offset + entity.length
                kept.append(entity.copy_with(type="url", url=None))
                continue
        kept.append(entity)
    return _splice(text, kept, spans)


def _redact_rendered(
    text: str, entities: list[tgmd.MessageEntity], redactor: Redactor
) -> tuple[str, list[tgmd.MessageEntity]]:
    """Redact the final text (moving the entities) and every text an entity carries."""
    for edits in redactor.passes(text):
        text, entities = _splice(text, entities, _spans_of(text, edits))
    cleaned = []
    for entity in entities:
        changes: dict[str, str] = {}
        for name in ("url", "language", "custom_emoji_id"):
            value = getattr(entity, name)
            if isinstance(value, str) and redactor(value) != value:
                changes[name] = redactor(value)
        cleaned.append(entity.copy_with(**changes) if changes else entity)
    return text, cleaned


def render_markdown(
    markdown: str,
    *,
    redact: Redactor,
    document_threshold: int,
    header: str = "",
    filename: str = "output.md",
) -> list[Rendered]:
    """Messages for one agent output.

    Output longer than ``document_threshold`` characters becomes a document holding the
    whole (redacted) text, preceded by a short head; shorter output is converted to
    entities, redacted after conversion, and split at ≤ 4096 UTF-16 units on line
    boundaries.
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
    # Exact secrets first (emphasis inside one would hide it from the final text); the
    # shapes only after conversion: a shape matched in the Markdown can stop at a "*"
    # and leave the rest of the key in the message.
    text, entities = _convert(redact.hide_exact(markdown))
    text, entities = _plain_targets(text, entities)
    if header:
        shift = _utf16(header)
        text = header + text
        entities = [e.copy_with(offset=e.offset + shift) for e in entities]
    text, entities = _redact_rendered(text, entities, redact)
    if not text.strip():
        return [plain((header + "(no output)").strip())]
    chunks = tgmd.split_entities(text, entities, MAX_MESSAGE)
    return [
        Rendered(text=chunk, entities=tuple(e.to_dict() for e in ents)) for chunk, ents in chunks
    ] or [plain(header + "(no output)")]


def render_parts(parts: Sequence[tuple[str, bool]], *, redact: Redactor) -> Rendered:
    """One message from pieces, each plain text or Markdown (as entities), redacted, and
    cut to the message limit (a live message: a phase, a gate, a turn's progress)."""
    text = ""
    entities: list[tgmd.MessageEntity] = []
    for piece, markdown in parts:
        if markdown:
            converted, ents = _convert(redact.hide_exact(piece))
            converted, ents = _plain_targets(converted.rstrip("\n"), ents)
        else:
            converted, ents = piece, []
        shift = _utf16(text)
        entities += [e.copy_with(offset=e.offset + shift) for e in ents]
        text += converted
    text, entities = _redact_rendered(text, entities, redact)
    if _utf16(text) > MAX_MESSAGE:
        first, ents = tgmd.split_entities(text, entities, MAX_MESSAGE - 2)[0]
        text, entities = first.rstrip() + "\n…", list(ents)
    if not text.strip():
        text = "…"
    return Rendered(text=text, entities=tuple(e.to_dict() for e in entities))


def caption(text: str) -> str:
    """At most Telegram's caption limit (counted in UTF-16 units, as Telegram does)."""
    if _utf16(text) <= MAX_CAPTION:
        return text
    out = text[: MAX_CAPTION - 1]
    while _utf16(out) > MAX_CAPTION - 1:
        out = out[:-1]
    return out + "…"


class TelegramRenderer:
    """:class:`chatfront.render.Renderer` for Telegram: Markdown as entities, Telegram's
    limits."""

    def markdown(
        self,
        markdown: str,
        *,
        redact: Redactor,
        document_threshold: int,
        header: str = "",
        filename: str = "output.md",
    ) -> list[Rendered]:
        return render_markdown(
            markdown,
            redact=redact,
            document_threshold=document_threshold,
            header=header,
            filename=filename,
        )

    def plain(self, text: str) -> Rendered:
        return plain(text)

    def parts(self, parts: Sequence[tuple[str, bool]], *, redact: Redactor) -> Rendered:
        return render_parts(parts, redact=redact)

    def caption(self, text: str) -> str:
        return caption(text)


TELEGRAM: Final = TelegramRenderer()
