"""Files to and from a chat session on the workers, through the database.

The chat's worktree is on a worker's disk, so neither side can reach the other's files:

- A file sent to the chat: the bot stores its bytes (already bounded by the chat's upload
  limit) in the content-addressed ``gate_artifacts`` store and one row of
  ``worker_chat_uploads``; the queued message names the rows (:func:`upload_message`),
  the turn's row carries them (``uploads``), and the worker writes them into the chat's
  worktree with the local chat's safe-file rules before the turn runs
  (:func:`write_uploads`), then prompts the agent as a local chat does.
- A ``TURNSTILE-SEND:`` line in the agent's answer: the worker resolves and reads the file
  with the same containment rules and limit (:func:`collect_sends`), stores its bytes and
  records it, or why it was refused, in the turn's output (:data:`SENT_FILES`); the bot
  sends it to the chat as a local chat's file (:func:`sent_files`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from engine.chats.files import (
    SENT_FILES,
    ChatUpload,
    SentFile,
    split_upload_message,
    upload_message,
)
from engine.errors import FileRefusedError
from engine.files import (
    SavedFile,
    exclude_in_git,
    read_for_send,
    resolve_inside,
    sanitize_name,
    save_upload,
    send_markers,
    sent_caption,
    upload_prompt,
    zip_folder,
)
from engine.gates.artifacts import SqlArtifactStore
from engine.store.backend import AnyDatabase

__all__ = [
    "SENT_FILES",
    "ChatUpload",
    "SentFile",
    "collect_sends",
    "split_upload_message",
    "store_upload",
    "upload_message",
    "write_uploads",
]

_LOGGER = logging.getLogger(__name__)

_MARKERS_PER_TURN: Final = 10


async def store_upload(
    db: AnyDatabase,
    session_key: str,
    name: str,
    data: bytes,
    *,
    mime: str,
    clock: Callable[[], float] = time.time,
) -> ChatUpload:
    """Store a file sent to the chat (the caller has bounded its size); its row."""
    digest = await SqlArtifactStore(db, clock=clock).put(data)
    upload = ChatUpload(str(uuid.uuid4()), session_key, name, mime, len(data), digest)
    await db.execute(
        "INSERT INTO worker_chat_uploads (id, session_key, name, mime, size, sha256,"
        " created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (upload.id, session_key, name, mime, upload.size, digest, clock()),
    )
    return upload


async def write_uploads(
    db: AnyDatabase, workdir: Path, session_key: str, ids: Sequence[str], text: str, uploads: str
) -> str:
    """Write a turn's files into the worktree below ``uploads`` (the local chat's rules: no
    symlink followed, nothing overwritten) and return the turn's prompt, naming them as a
    local chat's prompt does. Only rows of this chat session are taken.

    Raises:
        FileRefusedError: a file is missing from the store, or the uploads folder is unsafe.
        OSError: writing failed.
    """
    store = SqlArtifactStore(db)
    saved: list[SavedFile] = []
    for upload_id in ids:
        row = await db.fetchone(
            "SELECT name, mime, sha256 FROM worker_chat_uploads WHERE id = ? AND session_key = ?",
            (upload_id, session_key),
        )
        content = await store.get(str(row["sha256"])) if row is not None else None
        if row is None or content is None:
            raise FileRefusedError(
                "a file sent with this message is no longer stored; send it again",
                reason="missing",
            )
        saved.append(
            await asyncio.to_thread(
                save_upload,
                workdir,
                uploads,
                sanitize_name(str(row["name"])),
                content.content,
                mime=str(row["mime"]),
            )
        )
        _LOGGER.info("upload written as %s (%d bytes)", saved[-1].relative, saved[-1].size)
    with contextlib.suppress(OSError, FileRefusedError):
        await exclude_in_git(workdir, uploads)
    return upload_prompt(saved, [text])


def _pack(
    workdir: Path, shown: str, max_bytes: int, redact: Callable[[str], str]
) -> tuple[str, bytes, str]:
    """(name, bytes, caption) of one file to send, a folder zipped (as a local chat)."""
    try:
        is_dir = resolve_inside(workdir, shown).is_dir()
    except FileRefusedError:
        is_dir = False
    try:
        if is_dir:
            name = sanitize_name(Path(shown.rstrip("/")).name or workdir.name) + ".zip"
            with tempfile.TemporaryDirectory(prefix="turnstile-send-") as tmp:
                dest = Path(tmp) / name
                zipped = zip_folder(workdir, shown, dest=dest, max_bytes=max_bytes, redact=redact)
                return name, dest.read_bytes(), sent_caption(shown, zipped)
        out = read_for_send(workdir, shown, max_bytes=max_bytes, redact=redact)
        return sanitize_name(out.name), out.data, sent_caption(shown, out)
    except OSError as exc:
        raise FileRefusedError(f"{shown} cannot be read: {exc.strerror}", reason="io") from exc


async def collect_sends(
    db: AnyDatabase,
    workdir: Path,
    text: str,
    *,
    max_bytes: int,
    redact: Callable[[str], str],
) -> list[SentFile]:
    """The files an agent's answer asks to send, read from the worktree (refused outside
    it, too large, empty ...) and stored for the bot. Never raises for one file."""
    store = SqlArtifactStore(db)
    sent: list[SentFile] = []
    for given in send_markers(text, limit=_MARKERS_PER_TURN):
        shown = given.strip()
        try:
            name, data, caption = await asyncio.to_thread(_pack, workdir, shown, max_bytes, redact)
        except FileRefusedError as exc:
            sent.append(SentFile(given=given, refused=str(exc)))
            continue
        digest = await store.put(data)
        sent.append(SentFile(given=given, name=name, sha256=digest, caption=caption))
    return sent
