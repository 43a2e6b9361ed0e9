"""The workers' tables: numbered migrations (``NNNN_name.sql``) beside this file.

Registered under the ``turnstile.migrations`` entry point. A module of its own, light to
import: every command that opens the database looks the migrations up, and a listing
should not load the workers' store for it.
"""

from __future__ import annotations

from typing import Final

from engine.store import MigrationSet, load_migrations

__all__ = ["OWNER", "migrations"]

OWNER: Final = "workers"


def migrations() -> MigrationSet:
    """The workers' migrations, in order."""
    return MigrationSet(OWNER, load_migrations("engine.workers", "migrations"))
