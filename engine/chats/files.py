"""What crosses between a chat whose folder is on a worker and its front end: files.

A file sent to such a chat is stored in the database and named in its queued message
(:func:`upload_message`); a file its turn hands over comes back in the turn's output
metadata under :data:`SENT_FILES`, one :class:`SentFile` each (``engine.workers.chatfiles``
does the storing and reading on the worker's side).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["SENT_FILES", "ChatUpload", "SentFile", "split_upload_message", "upload_message"]

#: The key of a turn's output metadata that lists the files the agent sent.
SENT_FILES: Final = "turnstile_sent_files"
# The first line of a queued message that brings files (ids of worker_chat_uploads rows).
_MARK: Final = "\x1e[files "


@dataclass(frozen=True, slots=True)
class ChatUpload:
    """A file sent to a chat session on the workers, as stored."""

    id: str
    session_key: str
    name: str
    mime: str
    size: int
    sha256: str


def upload_message(uploads: Sequence[ChatUpload], captions: Sequence[str]) -> str:
    """The queued message of files sent to the chat: which rows, then the caption(s)."""
    text = "\n".join(c for c in captions if c.strip())
    return f"{_MARK}{','.join(u.id for u in uploads)}]\n{text}"


def split_upload_message(message: str) -> tuple[list[str], str]:
    """The upload ids a queued message names (none: a plain message) and its text."""
    if not message.startswith(_MARK):
        return [], message
    head, _, text = message.partition("\n")
    ids = head.removeprefix(_MARK).removesuffix("]")
    return [i for i in ids.split(",") if i], text


@dataclass(frozen=True, slots=True)
class SentFile:
    """One ``TURNSTILE-SEND:`` line of a turn on a worker: the stored file, or why not."""

    given: str
    name: str = ""
    sha256: str = ""
    caption: str = ""
    refused: str = ""

    def to_json(self) -> dict[str, str]:
        return {
            "given": self.given,
            "name": self.name,
            "sha256": self.sha256,
            "caption": self.caption,
            "refused": self.refused,
        }

    @classmethod
    def from_json(cls, raw: Any) -> SentFile:
        fields = ("given", "name", "sha256", "caption", "refused")
        return cls(*(str(raw.get(k) or "") for k in fields))
