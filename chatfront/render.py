"""What a messenger's renderer gives the publisher: message bodies from text, in its format.

A chat front end says how its messenger formats text (:class:`Renderer`: Markdown into
message bodies, plain text, a caption, each cut to the messenger's limits); everything
else of what is said (redaction, outputs as documents, live messages) is
:class:`chatfront.publish.Publisher`'s, the same for every messenger. The bot's renderer
is ``bot.render.TELEGRAM`` (Telegram's entities).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine.redact import Redactor

__all__ = ["Rendered", "Renderer"]


@dataclass(frozen=True, slots=True)
class Rendered:
    """One message body: text and its formatting (the messenger's, kept as it gives it),
    or a document."""

    text: str
    entities: tuple[dict[str, Any], ...] = ()
    document: str | None = None
    filename: str | None = None


class Renderer(Protocol):
    """How one messenger formats what is said."""

    def markdown(
        self,
        markdown: str,
        *,
        redact: Redactor,
        document_threshold: int,
        header: str = "",
        filename: str = "output.md",
    ) -> list[Rendered]:
        """The messages of one Markdown text (an agent's output): split at the message
        limit, or one document holding the whole (redacted) text past
        ``document_threshold`` characters."""
        ...

    def plain(self, text: str) -> Rendered:
        """A message sent as is, cut to the message limit."""
        ...

    def parts(self, parts: Sequence[tuple[str, bool]], *, redact: Redactor) -> Rendered:
        """One message from pieces, each plain text (False) or Markdown (True), redacted
        and cut to the message limit (a live message)."""
        ...

    def caption(self, text: str) -> str:
        """``text`` cut to the messenger's caption limit."""
        ...
