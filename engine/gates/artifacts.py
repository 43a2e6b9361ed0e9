"""Gate artifacts in the database, content-addressed (the SQL of table ``gate_artifacts``).

At a gate the driver stores the artifact's bytes under their SHA-256; the gate's
``gate_sha256`` and every approval name that row. Whoever shows the gate (the bot, ``turnstile
status --artifact``) reads it from here, not from the task folder, which on a setup with
workers is on another machine's disk. One row per distinct content, however many gates,
rounds or tasks show it. Contents are bounded (:data:`DEFAULT_MAX_BYTES`, the setting
``TURNSTILE_ARTIFACT_MAX_BYTES``): a bigger artifact is refused at its gate.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from engine.store.backend import AnyDatabase

__all__ = ["DEFAULT_MAX_BYTES", "ArtifactStore", "SqlArtifactStore", "StoredArtifact"]

#: The largest artifact a gate stores by default: 16 MiB (a document the bot can post).
DEFAULT_MAX_BYTES: Final = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class StoredArtifact:
    """One stored content: its hash, size and bytes."""

    sha256: str
    size: int
    content: bytes


class SqlArtifactStore:
    """Artifact contents keyed by their SHA-256, over a SQLite or PostgreSQL database
    (migration 0011).

    Args:
        db: an open database of either backend.
        clock: seconds since the epoch (a row's ``created_at``).
    """

    def __init__(self, db: AnyDatabase, *, clock: Callable[[], float] = time.time) -> None:
        self._db = db
        self._clock = clock

    async def put(self, content: bytes) -> str:
        """Store ``content`` (once: a second put of the same bytes writes nothing); its hash.

        The caller bounds the size (see :data:`DEFAULT_MAX_BYTES`)."""
        digest = hashlib.sha256(content).hexdigest()
        if await self.has(digest):
            return digest
        await self._db.execute(
            "INSERT INTO gate_artifacts (sha256, size, content, created_at) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (sha256) DO NOTHING",
            (digest, len(content), content, self._clock()),
        )
        return digest

    async def get(self, sha256: str) -> StoredArtifact | None:
        """The content stored under ``sha256`` (hex), or None."""
        row = await self._db.fetchone(
            "SELECT sha256, size, content FROM gate_artifacts WHERE sha256 = ?", (sha256,)
        )
        if row is None:
            return None
        return StoredArtifact(str(row[0]), int(row[1]), bytes(row[2]))

    async def head(self, sha256: str, limit: int) -> bytes | None:
        """The first ``limit`` bytes stored under ``sha256`` (an excerpt), or None."""
        # substr counts bytes of a BLOB (SQLite) and of a bytea (PostgreSQL) alike.
        row = await self._db.fetchone(
            "SELECT substr(content, 1, ?) FROM gate_artifacts WHERE sha256 = ?", (limit, sha256)
        )
        return None if row is None else bytes(row[0])

    async def has(self, sha256: str) -> bool:
        """Whether ``sha256`` is stored (without reading the content)."""
        row = await self._db.fetchone("SELECT 1 FROM gate_artifacts WHERE sha256 = ?", (sha256,))
        return row is not None


#: Artifact contents keyed by their SHA-256 (one implementation serves both databases).
ArtifactStore = SqlArtifactStore
