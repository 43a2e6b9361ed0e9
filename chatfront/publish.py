"""Everything a chat front end says goes through here: redacted, rendered in its
messenger's format (a :class:`~chatfront.render.Renderer`), committed to the outbox."""

from __future__ import annotations

import asyncio
import codecs
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from chatfront.people import People
from chatfront.render import Rendered, Renderer
from chatfront.store import BotStore, OutboxItem
from engine.humane import exit_note
from engine.redact import Redactor
from engine.runs.spec import PlaceId
from engine.turn import TurnOutput

__all__ = ["MAX_OUTPUT_BYTES", "Publisher", "Sender"]

# Telegram takes documents up to 50 MB from bots (the tightest limit of the messengers a
# front end may use); a bigger output is cut (and says so).
MAX_OUTPUT_BYTES: Final = 45 * 1024 * 1024
# A spilled output is redacted into its document this much at a time (memory stays flat).
_CHUNK: Final = 1024 * 1024
_HEAD_LINES: Final = 12
_HEAD_CHARS: Final = 600


@dataclass(frozen=True, slots=True)
class _Copied:
    size: int
    lines: int
    head: str


def _redacted_copy(
    source: Path, target: Path, redact: Callable[[str], str], *, total: int
) -> _Copied:
    """Stream ``source`` into ``target`` redacted, at most ``MAX_OUTPUT_BYTES`` of it.

    Redaction runs on whole lines (a secret never straddles two pieces); only a line longer
    than four chunks is cut, at its last space. Memory stays at a few chunks for any size.
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""
    size = lines = 0
    head: list[str] = []
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(source, "rb") as src, os.fdopen(fd, "wb") as dst:
        ends_line = True

        def emit(text: str) -> None:
            nonlocal size, lines, ends_line
            safe = redact(text)
            if len(head) < _HEAD_LINES:
                head.extend(safe.splitlines()[: _HEAD_LINES - len(head)])
            data = safe.encode("utf-8")
            dst.write(data)
            size += len(data)
            lines += text.count("\n")
            ends_line = text.endswith("\n")

        left = MAX_OUTPUT_BYTES
        while left > 0:
            chunk = src.read(min(_CHUNK, left))
            if not chunk:
                break
            left -= len(chunk)
            pending += decoder.decode(chunk)
            cut = pending.rfind("\n") + 1
            if not cut and len(pending) > 4 * _CHUNK:
                cut = pending.rfind(" ") + 1 or len(pending)
            if cut:
                emit(pending[:cut])
                pending = pending[cut:]
        pending += decoder.decode(b"", final=True)
        if pending:
            emit(pending)
        if not ends_line:
            lines += 1  # the last line has no newline
        if left <= 0 and total > MAX_OUTPUT_BYTES:
            emit(
                f"\n\n… output cut at {MAX_OUTPUT_BYTES:,} of {total:,} bytes; the whole of "
                f"it is on the bot's machine in {source}"
            )
    return _Copied(size=size, lines=lines, head="\n".join(head)[:_HEAD_CHARS])


class Sender(Protocol):
    """What the publisher asks of the front end's outbox sender."""

    def wake(self) -> None:
        """Rows were queued: deliver them."""
        ...

    def offer_refusal(self, item: OutboxItem) -> bool:
        """Queue a "not allowed" answer in the low-priority lane; False when it is full."""
        ...


class Publisher:
    """Turns texts and outputs into outbox rows and wakes the sender."""

    def __init__(
        self,
        store: BotStore,
        sender: Sender | None,
        *,
        renderer: Renderer,
        redactor: Redactor,
        document_threshold: int,
        documents_dir: Path | None = None,
        clock: Callable[[], float] = time.time,
        people: People | None = None,
    ) -> None:
        self.store = store
        # How people are called in what the bot says ("approved by Ann").
        self.people = people or People(store)
        self.sender = sender
        self.render = renderer
        self.redact = redactor
        self.document_threshold = document_threshold
        # Where the redacted documents of spilled outputs wait for their upload (by default
        # beside the spill file).
        self.documents_dir = documents_dir
        self.clock = clock
        # Writes to one live message, one at a time in call order: on PostgreSQL two in
        # flight at once may commit in either order, and a turn's "working" that landed
        # after its "done" stayed on screen.
        self._live_writes: dict[str, tuple[asyncio.Lock, list[None]]] = {}

    @asynccontextmanager
    async def in_order(self, ref: str) -> AsyncIterator[None]:
        """Hold the writes to live message ``ref`` while changing it otherwise (renaming
        it): a write already made lands first, one made meanwhile waits."""
        lock, waiting = self._live_writes.setdefault(ref, (asyncio.Lock(), []))
        waiting.append(None)
        try:
            async with lock:
                yield
        finally:
            waiting.pop()
            if not waiting:
                del self._live_writes[ref]

    def wake(self) -> None:
        if self.sender is not None:
            self.sender.wake()

    def items_for(
        self,
        rendered: list[Rendered],
        *,
        chat_id: PlaceId,
        thread_id: PlaceId | None,
        run_id: str | None = None,
        reply_to: int | None = None,
        markup: dict[str, Any] | None = None,
    ) -> list[OutboxItem]:
        items: list[OutboxItem] = []
        for i, part in enumerate(rendered):
            last = i == len(rendered) - 1
            if part.document is not None:
                items.append(
                    OutboxItem(
                        chat_id=chat_id,
                        thread_id=thread_id,
                        kind="document",
                        body=part.document,
                        filename=part.filename,
                        caption=part.text,
                        run_id=run_id,
                        reply_to=reply_to if i == 0 else None,
                        markup=markup if last else None,
                    )
                )
            else:
                items.append(
                    OutboxItem(
                        chat_id=chat_id,
                        thread_id=thread_id,
                        body=part.text,
                        entities=part.entities,
                        run_id=run_id,
                        reply_to=reply_to if i == 0 else None,
                        markup=markup if last else None,
                    )
                )
        return items

    async def output_items(
        self,
        out: TurnOutput,
        *,
        chat_id: PlaceId,
        thread_id: PlaceId | None,
        run_id: str | None,
        header: str = "",
        reply_to: int | None = None,
    ) -> list[OutboxItem]:
        """The messages for one turn's output (exit code noted when non-zero).

        An output spilled to a file (bigger than the in-memory cap) never enters memory
        whole: it is redacted into a document file, streamed, and the outbox row names
        the file; the sender uploads it from disk.
        """
        # Why it failed is usually on stderr: its end, redacted, before the output.
        note = exit_note(out.exit_code, self.redact(out.stderr_tail.strip()))
        if note:
            header = f"{header}{note}\n" + ("\n" if out.stderr_tail.strip() else "")
        filename = f"output-{run_id or 'run'}.md"
        text = out.text
        if out.spill_path is not None and (out.size or 0) <= self.document_threshold:
            # Spilled under a tiny in-memory cap, yet short enough for messages.
            text = await asyncio.to_thread(out.full_text)
        elif out.spill_path is not None:
            return [
                await self._file_item(
                    out.spill_path,
                    out.size,
                    chat_id=chat_id,
                    thread_id=thread_id,
                    run_id=run_id,
                    header=header,
                    reply_to=reply_to,
                    filename=filename,
                )
            ]
        rendered = self.render.markdown(
            text,
            redact=self.redact,
            document_threshold=self.document_threshold,
            header=header,
            filename=filename,
        )
        return self.items_for(
            rendered, chat_id=chat_id, thread_id=thread_id, run_id=run_id, reply_to=reply_to
        )

    async def _file_item(
        self,
        spill: Path,
        size: int | None,
        *,
        chat_id: PlaceId,
        thread_id: PlaceId | None,
        run_id: str | None,
        header: str,
        reply_to: int | None,
        filename: str,
    ) -> OutboxItem:
        folder = self.documents_dir or spill.parent
        await asyncio.to_thread(folder.mkdir, parents=True, exist_ok=True)
        target = folder / f"document-{uuid.uuid4().hex}.md"
        total = size if size is not None else (await asyncio.to_thread(spill.stat)).st_size
        try:
            copied = await asyncio.to_thread(
                _redacted_copy, spill, target, self.redact, total=total
            )
        except BaseException:
            # No half-written document left behind (a full disk, a cancelled turn).
            await asyncio.shield(asyncio.to_thread(target.unlink, missing_ok=True))
            raise
        note = (
            f"{header}📄 {copied.size:,} bytes, {copied.lines:,} lines: the whole output is "
            f"in {filename}.\n\n{copied.head}"
        )
        if copied.lines > _HEAD_LINES or len(copied.head) < copied.size:
            note += "\n…"
        return OutboxItem(
            chat_id=chat_id,
            thread_id=thread_id,
            kind="file",
            body=str(target),
            filename=filename,
            caption=self.render.caption(self.redact(note)),
            run_id=run_id,
            reply_to=reply_to,
        )

    async def say(
        self,
        chat_id: PlaceId,
        text: str,
        *,
        thread_id: PlaceId | None = None,
        markdown: bool = False,
        reply_to: int | None = None,
        run_id: str | None = None,
        markup: dict[str, Any] | None = None,
        ref: str | None = None,
    ) -> None:
        """Queue a message (redacted; Markdown rendered when asked) and wake the sender."""
        if markdown:
            rendered = self.render.markdown(
                text, redact=self.redact, document_threshold=self.document_threshold
            )
        else:
            rendered = [self.render.plain(self.redact(text))]
        items = self.items_for(
            rendered,
            chat_id=chat_id,
            thread_id=thread_id,
            run_id=run_id,
            reply_to=reply_to,
            markup=markup,
        )
        if ref is not None and items:
            last = items[-1]
            items[-1] = OutboxItem(
                chat_id=last.chat_id,
                thread_id=last.thread_id,
                kind=last.kind,
                body=last.body,
                entities=last.entities,
                filename=last.filename,
                caption=last.caption,
                markup=last.markup,
                reply_to=last.reply_to,
                run_id=last.run_id,
                ref=ref,
            )
        await self.store.enqueue(items)
        self.wake()

    def refusal(
        self, chat_id: PlaceId, text: str, *, thread_id: PlaceId | None, reply_to: int | None
    ) -> bool:
        """Offer a "not allowed" answer to the sender's low-priority lane.

        Returns:
            False when it is not sent: the lane is full (a flood of strangers) or there is
            no sender. The caller audits the refusal either way and says which.
        """
        if self.sender is None:
            return False
        item = OutboxItem(
            chat_id=chat_id,
            thread_id=thread_id,
            body=self.render.plain(self.redact(text)).text,
            reply_to=reply_to,
        )
        return self.sender.offer_refusal(item)

    async def document(
        self,
        chat_id: PlaceId,
        content: str,
        *,
        filename: str,
        caption: str,
        thread_id: PlaceId | None = None,
        run_id: str | None = None,
        ref: str | None = None,
    ) -> None:
        await self.store.enqueue(
            [
                OutboxItem(
                    chat_id=chat_id,
                    thread_id=thread_id,
                    kind="document",
                    body=self.redact(content),
                    filename=filename,
                    caption=self.render.caption(self.render.plain(self.redact(caption)).text),
                    run_id=run_id,
                    ref=ref,
                )
            ]
        )
        self.wake()

    async def live(
        self,
        ref: str,
        text: str,
        *,
        chat_id: PlaceId,
        thread_id: PlaceId | None,
        markup: dict[str, Any] | None = None,
        run_id: str | None = None,
        reply_to: int | None = None,
        markdown: str | None = None,
        tail: str = "",
        initial: bool = False,
        when: Callable[[], bool] | None = None,
    ) -> None:
        """Create or edit in place the live message ``ref`` (throttled by the sender).

        ``text`` is plain; ``markdown`` (an excerpt) follows it rendered as entities, then
        the plain ``tail``. ``reply_to`` places a new message under the one it answers.
        ``initial`` text is dropped when the message already has content (a newer one).
        ``when``, asked once the write's turn comes, can still call it off.
        """
        if markdown is None and not tail:
            rendered = self.render.plain(self.redact(text))
        else:
            rendered = self.render.parts(
                [(text, False), (markdown or "", True), (tail, False)], redact=self.redact
            )
        async with self.in_order(ref):
            if when is not None and not when():
                return  # (no longer wanted once its turn came)
            await self.store.set_live(
                ref,
                chat_id=chat_id,
                thread_id=thread_id,
                body=rendered.text,
                entities=rendered.entities,
                markup=markup,
                run_id=run_id,
                reply_to=reply_to,
                initial=initial,
            )
        self.wake()
