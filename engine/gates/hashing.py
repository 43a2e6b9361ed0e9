"""Streaming SHA-256 of artifacts: constant memory whatever the file size."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

__all__ = ["CHUNK", "sha256_file", "sha256_file_async"]

CHUNK = 1024 * 1024


def sha256_file(path: Path) -> str | None:
    """The hex SHA-256 of ``path`` read in 1 MiB chunks, or None when it is not a file."""
    digest = hashlib.sha256()
    try:
        with path.open("rb") as fh:
            buffer = bytearray(CHUNK)
            view = memoryview(buffer)
            while True:
                n = fh.readinto(buffer)
                if not n:
                    break
                digest.update(view[:n])
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    return digest.hexdigest()


async def sha256_file_async(path: Path) -> str | None:
    """:func:`sha256_file` off the event loop (a big artifact must not stall other runs)."""
    return await asyncio.to_thread(sha256_file, path)
