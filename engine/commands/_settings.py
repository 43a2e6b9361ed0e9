"""The few settings a listing reads, without building :class:`engine.settings.Settings`.

``turnstile status --list`` and ``turnstile runs`` need to know where the database is and
how to log. Building the whole settings model loads pydantic, which takes longer than all
the rest of such a command (``bench/bench_status.py``). :func:`read_listing_settings`
reads the same sources the model does, the same way: the environment (``TURNSTILE_*``, in
any case) over ``.env`` in the current folder (read by python-dotenv, as pydantic-settings
reads it), an empty value meaning unset. Settings a listing does not read are not checked.

A value it cannot take exactly as the model would is left to the model: then, and
whenever a command needs more (:meth:`ListingSettings.full`), the real settings are built,
and their error names the setting as it always did.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from engine.errors import ConfigError
from engine.store.location import PostgresURL, parse_database

if TYPE_CHECKING:
    from engine.settings import Settings
    from engine.store import MigrationSet

__all__ = [
    "SECRET_NAMES",
    "ListingSettings",
    "full_settings",
    "listing_migrations",
    "read_listing_settings",
]

_PREFIX = "turnstile_"
_ENV_FILE = ".env"
#: The settings held as secrets (``SecretStr``); a test holds this to the model's list.
SECRET_NAMES = (
    "telegram_token",
    "webhook_secret",
    "projects",
    "transcription_key",
    "metrics_token",
)
_READ = ("database", "log_level", "log_format", *SECRET_NAMES)


class ListingSettings:
    """What a listing reads of the settings; :meth:`full` builds all of them."""

    __slots__ = ("_full", "_secrets", "database", "log_format", "log_level")

    def __init__(
        self,
        database: Path | PostgresURL,
        *,
        log_level: str = "INFO",
        log_format: Literal["text", "json"] = "text",
        secrets: Mapping[str, str] | None = None,
    ) -> None:
        self.database = database
        self.log_level = log_level
        self.log_format: Literal["text", "json"] = log_format
        self._secrets = dict(secrets or {})
        self._full: Settings | None = None

    def full(self) -> Settings:
        """The whole settings, built (and checked) the first time they are asked for.

        Raises:
            ConfigError: a setting is malformed.
        """
        if self._full is None:
            self._full = _load()
        return self._full

    def secret_values(self, environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
        """Every value never to print, as :meth:`engine.settings.Settings.secret_values`."""
        from engine.redact import credential_values

        values = [v for v in self._secrets.values() if v]
        if isinstance(self.database, PostgresURL) and self.database.password:
            values.append(self.database.password)
        projects = self._secrets.get("projects")
        if projects:
            # Imported here, as the model does: only a configured project list needs it.
            from engine.workspace.projects import parse_projects

            try:
                parsed = parse_projects(projects)
            except ConfigError:
                parsed = ()
            values.extend(s for p in parsed for s in p.secrets() if len(s) >= 8)
        values.extend(credential_values(os.environ if environ is None else environ))
        return tuple(dict.fromkeys(values))


def full_settings(settings: Settings | ListingSettings) -> Settings:
    """``settings`` whole: as they are, or built from a listing's few."""
    return settings.full() if isinstance(settings, ListingSettings) else settings


def listing_migrations() -> tuple[MigrationSet, ...]:
    """The migrations a listing brings up to date: the engine's and its workers', not the
    front ends' (looking those up reads every installed package's entry points, start-up
    time a listing of the engine's own tables does without; a front end migrates its
    tables when it starts)."""
    from engine.store import MigrationSet, load_migrations
    from engine.store.database import ENGINE
    from engine.workers.migrations import migrations as workers

    return (MigrationSet(ENGINE, load_migrations()), workers())


def read_listing_settings(
    environ: Mapping[str, str] | None = None, *, cwd: Path | None = None
) -> Settings | ListingSettings:
    """The settings a listing reads; the whole settings when one of them needs the model.

    Raises:
        ConfigError: (from the model) a setting the listing reads is malformed.
    """
    raw = _raw_values(os.environ if environ is None else environ, cwd or Path.cwd())
    if raw is None:
        return _load()
    try:
        database = parse_database(raw.get("database", "turnstile.db"))
    except ConfigError:  # the model says it in its own words
        return _load()
    log_format = raw.get("log_format", "text")
    if log_format not in ("text", "json"):
        return _load()
    return ListingSettings(
        database,
        log_level=raw.get("log_level", "INFO"),
        log_format="json" if log_format == "json" else "text",
        secrets={k: v for k, v in raw.items() if k in SECRET_NAMES},
    )


def _load() -> Settings:
    from engine.settings import load_settings

    return load_settings()


def _raw_values(environ: Mapping[str, str], cwd: Path) -> dict[str, str] | None:
    """The raw values of :data:`_READ`, as the model's sources give them; None when one is
    there but is not plain text (a ``.env`` line without ``=``, a file it cannot read)."""
    found: dict[str, str] = {}
    env_file = cwd / _ENV_FILE
    if env_file.is_file() or env_file.is_fifo():
        from dotenv import dotenv_values

        try:
            file_values = dotenv_values(env_file, encoding="utf-8")
        except (OSError, ValueError):
            return None
        for key, value in _lowered(file_values).items():
            if value is None:
                return None
            found[key] = value
    # The environment wins over the file.
    found.update({k: v for k, v in _lowered(environ).items() if v is not None})
    return found


def _lowered(values: Mapping[str, str | None]) -> dict[str, str | None]:
    # Names in any case, empty values unset: as the model's sources read them.
    out: dict[str, str | None] = {}
    for key, value in values.items():
        name = key.lower()
        if name.startswith(_PREFIX) and name[len(_PREFIX) :] in _READ and value != "":
            out[name[len(_PREFIX) :]] = value
    return out
