"""Where the database is: a SQLite file (the default) or a PostgreSQL server URL.

``TURNSTILE_DATABASE`` holds either. A value that starts with ``postgresql://`` (or the
short ``postgres://``) is a server; anything else is a file path, exactly as before. A URL
may carry a password: :class:`PostgresURL` never shows it (``str``, ``repr``, logs and
error texts all get the redacted form), and only :meth:`PostgresURL.conninfo` gives the
real one, to the driver.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import SplitResult, unquote, urlsplit, urlunsplit

from engine.errors import ConfigError

if TYPE_CHECKING:
    from pydantic import GetCoreSchemaHandler
    from pydantic_core import core_schema

__all__ = ["SCHEMES", "PostgresURL", "is_postgres_url", "parse_database"]

SCHEMES = ("postgresql", "postgres")
_HIDDEN = "***"


def is_postgres_url(value: object) -> bool:
    """Whether ``value`` names a PostgreSQL server rather than a file."""
    return isinstance(value, PostgresURL) or (
        isinstance(value, str) and value.split("://", 1)[0].lower() in SCHEMES and "://" in value
    )


class PostgresURL:
    """A ``postgresql://`` URL whose password is never shown.

    Raises:
        ConfigError: (on construction) the URL cannot be read as a PostgreSQL URL.
    """

    __slots__ = ("_url", "database", "host", "port", "user")

    def __init__(self, url: str) -> None:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise ConfigError(
                f"TURNSTILE_DATABASE is not a valid PostgreSQL URL ({_bare(url)}): {exc}"
            ) from None
        if parts.scheme.lower() not in SCHEMES:
            raise ConfigError(f"TURNSTILE_DATABASE: {_bare(url)} is not a postgresql:// URL")
        database = unquote(parts.path.lstrip("/"))
        if not database:
            raise ConfigError(
                f"TURNSTILE_DATABASE: {_redact(parts)} names no database "
                "(postgresql://USER:PASSWORD@HOST:PORT/DATABASE)"
            )
        if "/" in database:
            raise ConfigError(f"TURNSTILE_DATABASE: {_redact(parts)} has more than a database name")
        self._url = url
        self.host = parts.hostname
        self.port = port
        self.user = unquote(parts.username) if parts.username else None
        self.database = database

    def conninfo(self) -> str:
        """The URL with its password, for the driver only."""
        return self._url

    def without_password(self) -> str:
        """The URL with its password taken out (libpq finds it in a password file)."""
        parts = urlsplit(self._url)
        if parts.password is None:
            return self._url
        user = parts.netloc.rpartition("@")[0].partition(":")[0]
        host = parts.netloc.rpartition("@")[2]
        return urlunsplit(parts._replace(netloc=f"{user}@{host}"))

    @property
    def username(self) -> str | None:
        parts = urlsplit(self._url)
        return unquote(parts.username) if parts.username else None

    @property
    def password(self) -> str | None:
        parts = urlsplit(self._url)
        return unquote(parts.password) if parts.password else None

    def __str__(self) -> str:
        return _redact(urlsplit(self._url))

    def __repr__(self) -> str:
        return f"PostgresURL({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PostgresURL) and other._url == self._url

    def __hash__(self) -> int:
        return hash(self._url)

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        # Imported here: a command that reads no settings model never loads pydantic.
        from pydantic_core import core_schema

        return core_schema.is_instance_schema(cls)


def _redact(parts: SplitResult) -> str:
    netloc = parts.netloc
    if parts.password is not None:
        user, _, host = netloc.rpartition("@")
        name = user.split(":", 1)[0]
        netloc = f"{name}:{_HIDDEN}@{host}"
    # A password may also ride in the query (?password=...): drop the whole query.
    query = "..." if parts.query else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def _bare(url: str) -> str:
    # An unparseable URL: show only its scheme, never what may be a password.
    return url.split("://", 1)[0] + "://" + _HIDDEN


def parse_database(value: object) -> Path | PostgresURL:
    """``TURNSTILE_DATABASE`` as a file path or a server URL."""
    if isinstance(value, PostgresURL | Path):
        return value
    if isinstance(value, str):
        return PostgresURL(value) if is_postgres_url(value) else Path(value)
    raise ConfigError(f"TURNSTILE_DATABASE: expected a path or a postgresql:// URL, not {value!r}")
