"""Everything the bot says goes through here: redacted, rendered, committed to the outbox."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Final

from bot.outbox import OutboxSender
from bot.render import Rendered, plain, render_markdown
from bot.store import BotStore, OutboxItem
from engine.redact import Redactor
from engine.turn import TurnOutput

__all__ = ["MAX_OUTPUT_BYTES", "Publisher", "format_elapsed"]

# Telegram takes documents up to 50 MB from bots; a bigger output is cut (and says so).
MAX_OUTPUT_BYTES: Final = 20 * 1024 * 1024


def format_elapsed(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _bounded_text(out: TurnOutput) -> str:
    """The turn's output, at most ``MAX_OUTPUT_BYTES`` of it (a note says where the rest is)."""
    size = out.size if out.size is not None else len(out.text.encode())
    if out.spill_path is None or size <= MAX_OUTPUT_BYTES:
        return out.full_text()
    with open(out.spill_path, "rb") as fh:
        head = fh.read(MAX_OUTPUT_BYTES).decode("utf-8", errors="replace")
    return (
        f"{head}\n\n… output cut at {MAX_OUTPUT_BYTES:,} of {size:,} bytes; the whole of it "
        f"is on the bot's machine in {out.spill_path}"
    )


class Publisher:
    """Turns texts and outputs into outbox rows and wakes the sender."""

    def __init__(
        self,
        store: BotStore,
        sender: OutboxSender | None,
        *,
        redactor: Redactor,
        document_threshold: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.sender = sender
        self.redact = redactor
        self.document_threshold = document_threshold
        self.clock = clock

    def wake(self) -> None:
        if self.sender is not None:
            self.sender.wake()

    def items_for(
        self,
        rendered: list[Rendered],
        *,
        chat_id: int,
        thread_id: int | None,
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

    def output_items(
        self,
        out: TurnOutput,
        *,
        chat_id: int,
        thread_id: int | None,
        run_id: str | None,
        header: str = "",
        reply_to: int | None = None,
    ) -> list[OutboxItem]:
        """The messages for one turn's output (exit code noted when non-zero)."""
        text = _bounded_text(out)
        if out.exit_code not in (None, 0):
            header = f"{header}⚠️ the agent exited with code {out.exit_code}\n"
        rendered = render_markdown(
            text,
            redact=self.redact,
            document_threshold=self.document_threshold,
            header=header,
            filename=f"output-{run_id or 'run'}.md",
        )
        return self.items_for(
            rendered, chat_id=chat_id, thread_id=thread_id, run_id=run_id, reply_to=reply_to
        )

    async def say(
        self,
        chat_id: int,
        text: str,
        *,
        thread_id: int | None = None,
        markdown: bool = False,
        reply_to: int | None = None,
        run_id: str | None = None,
        markup: dict[str, Any] | None = None,
        ref: str | None = None,
    ) -> None:
        """Queue a message (redacted; Markdown rendered when asked) and wake the sender."""
        if markdown:
            rendered = render_markdown(
                text, redact=self.redact, document_threshold=self.document_threshold
            )
        else:
            rendered = [plain(self.redact(text))]
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
        self, chat_id: int, text: str, *, thread_id: int | None, reply_to: int | None
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
            body=plain(self.redact(text)).text,
            reply_to=reply_to,
        )
        return self.sender.offer_refusal(item)

    async def document(
        self,
        chat_id: int,
        content: str,
        *,
        filename: str,
        caption: str,
        thread_id: int | None = None,
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
                    caption=plain(self.redact(caption)).text[:1024],
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
        chat_id: int,
        thread_id: int | None,
        markup: dict[str, Any] | None = None,
        run_id: str | None = None,
    ) -> None:
        """Create or edit in place the live message ``ref`` (throttled by the sender)."""
        await self.store.set_live(
            ref,
            chat_id=chat_id,
            thread_id=thread_id,
            body=plain(self.redact(text)).text,
            markup=markup,
            run_id=run_id,
        )
        self.wake()
