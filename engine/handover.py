"""Files an agent hands over (its ``TURNSTILE-SEND: path`` lines), read where it ran.

Wherever a turn runs (in a front end's process or on a worker), the files it asks to send
are read there, from its folder, with the containment rules and limit of
:mod:`engine.files` (a folder as a zip), and their bytes stored in the database
(``gate_artifacts``): a front end sends them from there, never from a folder it may not
see. Each is a :class:`~engine.chats.files.SentFile`: the stored file with its name and
caption, or why it was refused.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final

from engine.chats.files import SentFile
from engine.errors import FileRefusedError, StoreError
from engine.files import (
    read_for_send,
    resolve_inside,
    sanitize_name,
    send_markers,
    sent_caption,
    zip_folder,
)
from engine.gates.artifacts import SqlArtifactStore

if TYPE_CHECKING:
    from engine.store.backend import AnyDatabase

__all__ = ["MARKERS_PER_TURN", "collect_paths", "collect_sends"]

_LOGGER = logging.getLogger(__name__)

#: At most this many files are sent for one turn's markers.
MARKERS_PER_TURN: Final = 10


def _pack(
    workdir: Path, shown: str, max_bytes: int, redact: Callable[[str], str]
) -> tuple[str, bytes, str]:
    """(name, bytes, caption) of one file to send, a folder zipped."""
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


async def collect_paths(
    db: AnyDatabase,
    workdir: Path,
    paths: Sequence[str],
    *,
    max_bytes: int,
    redact: Callable[[str], str],
) -> list[SentFile]:
    """The files ``paths`` (relative to ``workdir``, untrusted) read (refused outside it,
    too large, empty, not storable ...) and stored for a front end, at most
    :data:`MARKERS_PER_TURN`. Never raises for one file."""
    store = SqlArtifactStore(db)
    sent: list[SentFile] = []
    for given in paths[:MARKERS_PER_TURN]:
        shown = given.strip()
        try:
            name, data, caption = await asyncio.to_thread(_pack, workdir, shown, max_bytes, redact)
        except FileRefusedError as exc:
            sent.append(SentFile(given=given, refused=str(exc)))
            continue
        try:
            digest = await store.put(data)
        except StoreError:
            # (Said to the people following the run like any refusal: never silently.)
            _LOGGER.warning("a handed-over file could not be stored", exc_info=True)
            refused = f"{shown} could not be stored (the database is away); ask for it again"
            sent.append(SentFile(given=given, refused=refused))
            continue
        sent.append(SentFile(given=given, name=name, sha256=digest, caption=caption))
    return sent


async def collect_sends(
    db: AnyDatabase,
    workdir: Path,
    text: str,
    *,
    max_bytes: int,
    redact: Callable[[str], str],
) -> list[SentFile]:
    """The files an agent's answer ``text`` asks to send (:func:`collect_paths`)."""
    paths = send_markers(text, limit=MARKERS_PER_TURN)
    return await collect_paths(db, workdir, paths, max_bytes=max_bytes, redact=redact)
