"""Reading a database a subprocess wrote, on either backend.

The target is what the ``db_target`` fixture (tests/pg_support.py) gives: a SQLite file, or
a fresh PostgreSQL database. :func:`setting` is its ``TURNSTILE_DATABASE`` value; :func:`rows`
and :func:`row` read it synchronously with ``?`` placeholders (for helpers outside an event
loop, as the subprocess tests are).
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row

from engine.store.location import PostgresURL

__all__ = ["Target", "row", "rows", "setting"]

Target = Path | PostgresURL


def setting(target: Target) -> str:
    """``TURNSTILE_DATABASE`` for ``target`` (a URL keeps its password: it goes to a child)."""
    return target.conninfo() if isinstance(target, PostgresURL) else str(target)


def rows(target: Target, sql: str, *params: object) -> list[tuple[Any, ...]]:
    """Every row ``sql`` finds, as tuples."""
    if isinstance(target, PostgresURL):
        with psycopg.connect(target.conninfo()) as pg:
            return [tuple(r) for r in pg.execute(sql.replace("?", "%s").encode(), params)]
    with contextlib.closing(sqlite3.connect(target)) as conn:
        return [tuple(r) for r in conn.execute(sql, params)]


def row(target: Target, sql: str, *params: object) -> dict[str, Any] | None:
    """The first row ``sql`` finds, by column name (None when there is none)."""
    if isinstance(target, PostgresURL):
        with psycopg.connect(target.conninfo(), row_factory=dict_row) as pg:
            return pg.execute(sql.replace("?", "%s").encode(), params).fetchone()
    with contextlib.closing(sqlite3.connect(target)) as conn:
        conn.row_factory = sqlite3.Row
        found = conn.execute(sql, params).fetchone()
        return dict(found) if found is not None else None
