"""Files of a run's folder sent into a chat: checked, redacted, spooled, queued.

A file a person asks for (``/get``) or an agent of a chat session here hands over (a
``TURNSTILE-SEND:`` line in its answer) is checked against the run's folder (inside it,
not too large, readable: :mod:`engine.files`), redacted, copied into a spool folder and
described as an outbox message of kind ``file``, so a restart still delivers it; a folder
is sent as a zip. A chat turn on a worker, and an auto run's turn wherever it runs, read
and checked their files where they ran and stored them in the database
(:mod:`engine.handover`): they are spooled from there, with the same captions and
refusals. What cannot be sent is said instead ("⚠️ Not sent …").
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Final

from chatfront.publish import Publisher
from chatfront.store import Binding, OutboxItem
from engine.chats.files import SentFile
from engine.errors import FileRefusedError
from engine.files import (
    SEND_MARKER,
    read_for_send,
    resolve_inside,
    sanitize_name,
    send_markers,
    sent_caption,
    zip_folder,
)
from engine.gates.artifacts import SqlArtifactStore
from engine.runs import ChatPlace
from engine.runs.spec import PlaceId
from engine.turn import TurnOutput

__all__ = ["OutgoingFiles"]

_LOGGER = logging.getLogger(__name__)

# At most this many files are sent for one turn's (or report's) markers.
_MARKERS_PER_TURN: Final = 10


class OutgoingFiles:
    """The outbox messages of files to send from runs' folders.

    Args:
        publisher: what they are queued and redacted through (its renderer cuts captions).
        spool: the folder their copies wait in until they are sent.
        max_bytes: the biggest file (or zip) sent.
        artifacts: where a worker's turn stored the files it sent.
        sent_files: the files a turn on a worker sent (its executor reads them from the
            turn's output).
    """

    def __init__(
        self,
        publisher: Publisher,
        *,
        spool: Path,
        max_bytes: int,
        artifacts: SqlArtifactStore,
        sent_files: Callable[[TurnOutput], list[SentFile]],
    ) -> None:
        self.publisher = publisher
        self.spool = spool
        self.max_bytes = max_bytes
        self.artifacts = artifacts
        self.sent_files = sent_files

    async def item(
        self,
        workdir: Path,
        given: str,
        *,
        chat_id: PlaceId,
        thread: PlaceId | None,
        reply_to: int | None = None,
        run_id: str | None = None,
    ) -> OutboxItem:
        """Check, copy into the spool and describe one file (a folder: a zip) to send.

        Raises:
            FileRefusedError: the path is refused, too large, empty or unreadable.
        """
        limit = self.max_bytes
        redact = self.publisher.redact
        await asyncio.to_thread(self.spool.mkdir, parents=True, exist_ok=True)
        tag = secrets.token_hex(6)
        shown = given.strip()
        try:
            if await asyncio.to_thread(_is_dir, workdir, shown):
                name = sanitize_name(Path(shown.rstrip("/")).name or workdir.name) + ".zip"
                dest = self.spool / f"{tag}-{name}"
                zipped = await asyncio.to_thread(
                    zip_folder, workdir, shown, dest=dest, max_bytes=limit, redact=redact
                )
                caption = sent_caption(shown, zipped)
            else:
                out = await asyncio.to_thread(
                    read_for_send, workdir, shown, max_bytes=limit, redact=redact
                )
                name = sanitize_name(out.name)
                dest = self.spool / f"{tag}-{name}"
                await asyncio.to_thread(dest.write_bytes, out.data)
                caption = sent_caption(shown, out)
        except OSError as exc:
            raise FileRefusedError(f"{shown} cannot be read: {exc.strerror}", reason="io") from exc
        return OutboxItem(
            chat_id=chat_id,
            thread_id=thread,
            kind="file",
            body=str(dest),
            filename=name,
            caption=self.publisher.render.caption(caption),
            reply_to=reply_to,
            run_id=run_id,
        )

    async def marker_items(
        self, binding: Binding, out: TurnOutput, run_id: str
    ) -> list[OutboxItem]:
        """The files a chat turn's ``TURNSTILE-SEND:`` lines ask for (or why each is not
        sent), committed with the turn's output. Never raises."""
        if not binding.workdir:
            return await self._sent_from_worker(binding, out, run_id)
        paths = send_markers(out.text, limit=_MARKERS_PER_TURN)
        return await self._marked(
            Path(binding.workdir), paths, binding.chat_id, binding.thread_id, run_id
        )

    async def _sent_from_worker(
        self, binding: Binding, out: TurnOutput, run_id: str
    ) -> list[OutboxItem]:
        """The files a chat turn on a worker sent (read and checked there, stored in the
        database), as a local chat's: the same captions and refusals."""
        return await self._stored(self.sent_files(out), binding.chat_id, binding.thread_id, run_id)

    async def send_stored(self, place: ChatPlace, run_id: str, files: list[SentFile]) -> None:
        """An auto run's ``TURNSTILE-SEND:`` files, read and stored where its turn ran (in
        this process or on a worker), through the run sink."""
        items = await self._stored(files, place.chat_id, place.thread_id, run_id)
        if items:
            await self.publisher.store.enqueue(items)
            self.publisher.wake()

    async def _stored(
        self,
        sent_files: list[SentFile],
        chat_id: PlaceId,
        thread: PlaceId | None,
        run_id: str,
    ) -> list[OutboxItem]:
        """Files a turn read and stored, spooled from the database (or why each is not
        sent), as a file read here is: the same captions and refusals."""
        store = self.artifacts
        items: list[OutboxItem] = []
        for sent in sent_files[:_MARKERS_PER_TURN]:
            try:
                if sent.refused:
                    raise FileRefusedError(sent.refused, reason="worker")
                content = await store.get(sent.sha256)
                if content is None:
                    raise FileRefusedError(
                        f"{sent.given} is no longer stored; ask for it again", reason="missing"
                    )
                await asyncio.to_thread(self.spool.mkdir, parents=True, exist_ok=True)
                name = sanitize_name(sent.name)
                dest = self.spool / f"{secrets.token_hex(6)}-{name}"
                await asyncio.to_thread(dest.write_bytes, content.content)
            except FileRefusedError as exc:
                items.append(
                    OutboxItem(
                        chat_id=chat_id,
                        thread_id=thread,
                        body=self.publisher.redact(
                            f"⚠️ Not sent ({SEND_MARKER} {sent.given}): {exc}"
                        ),
                        run_id=run_id,
                    )
                )
                continue
            except Exception:
                # The turn's output goes out whatever happens to its files.
                _LOGGER.exception("preparing %s from the store failed", sent.given)
                continue
            items.append(
                OutboxItem(
                    chat_id=chat_id,
                    thread_id=thread,
                    kind="file",
                    body=str(dest),
                    filename=name,
                    caption=self.publisher.render.caption(sent.caption),
                    run_id=run_id,
                )
            )
        return items

    async def _marked(
        self, workdir: Path, paths: list[str], chat_id: PlaceId, thread: PlaceId | None, run_id: str
    ) -> list[OutboxItem]:
        items: list[OutboxItem] = []
        for given in paths:
            try:
                items.append(
                    await self.item(workdir, given, chat_id=chat_id, thread=thread, run_id=run_id)
                )
            except FileRefusedError as exc:
                items.append(
                    OutboxItem(
                        chat_id=chat_id,
                        thread_id=thread,
                        body=self.publisher.redact(f"⚠️ Not sent ({SEND_MARKER} {given}): {exc}"),
                        run_id=run_id,
                    )
                )
            except Exception:
                # The turn's output goes out whatever happens to its files.
                _LOGGER.exception("preparing %s for the chat failed", given)
        return items


def _is_dir(root: Path, given: str) -> bool:
    try:
        return resolve_inside(root, given).is_dir()
    except FileRefusedError:
        return False
