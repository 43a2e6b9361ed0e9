"""The chat front end's own tables (owner ``bot``): numbered migrations (``NNNN_name.sql``)
beside this file.

Registered under the ``turnstile.migrations`` entry point, so the engine applies them with
its own without naming them. Until the bot had its own sequence, ``0001_bot`` was the
engine's migration 4; :data:`ADOPTED` says so, and a database from then is not migrated
twice.
"""

from __future__ import annotations

from engine.store import MigrationSet, load_migrations

__all__ = ["ADOPTED", "OWNER", "migrations"]

OWNER = "bot"
ADOPTED = ((1, 4),)


def migrations() -> MigrationSet:
    """The bot's migrations, in order."""
    return MigrationSet(OWNER, load_migrations("chatfront", "migrations"), adopted=ADOPTED)
