"""Streaming SHA-256 of artifacts: constant memory whatever the file size, read through
:mod:`engine.safefile` (no link out of the task folder, regular files only, capped)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from engine import safefile

__all__ = ["CHUNK", "sha256_file", "sha256_file_async"]

CHUNK = safefile.CHUNK


def sha256_file(path: Path, *, root: Path | None = None) -> str | None:
    """The hex SHA-256 of ``path`` read in 1 MiB chunks, or None when it does not exist.

    Args:
        root: the folder ``path`` must stay inside (default: its own folder).

    Raises:
        UnsafeFileError: ``path`` leads outside ``root``, is not a regular file, or is
            larger than :data:`engine.safefile.MAX_HASH_BYTES`.
    """
    base = root if root is not None else path.parent
    try:
        return safefile.sha256(base, path.relative_to(base))
    except (FileNotFoundError, NotADirectoryError):
        return None


async def sha256_file_async(path: Path, *, root: Path | None = None) -> str | None:
    """:func:`sha256_file` off the event loop (a big artifact must not stall other runs)."""
    return await asyncio.to_thread(sha256_file, path, root=root)
