"""Files to and from a chat session on the workers, through the database.

The chat's worktree is on a worker's disk, so neither side can reach the other's files:

- A file sent to the chat: the bot stores its bytes (already bounded by the chat's upload
  limit) in the content-addressed ``gate_artifacts`` store and one row of
  ``worker_chat_uploads``; the queued message names the rows (:func:`upload_message`),
  the turn's row carries them (``uploads``), and the worker writes them into the chat's
  worktree with the local chat's safe-file rules before the turn runs
  (:func:`write_uploads`), then prompts the agent as a local chat does.
- A ``TURNSTILE-SEND:`` line in the agent's answer: the worker resolves and reads the file
  with the same containment rules and limit (:func:`collect_sends`, :mod:`engine.handover`,
  as an auto run's turn does wherever it runs), stores its bytes and
  records it, or why it was refused, in the turn's output (:data:`SENT_FILES`); the bot
  sends it to the chat as a local chat's file (:func:`sent_files`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from engine.chats.files import (
    SENT_FILES,
    ChatUpload,
    SentFile,
    split_upload_message,
    upload_message,
)
from engine.errors import FileRefusedError
from engine.files import SavedFile, exclude_in_git, sanitize_name, save_upload, upload_prompt
from engine.gates.artifacts import SqlArtifactStore
from engine.handover import collect_sends
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
