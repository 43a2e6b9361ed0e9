"""The ``turnstile`` command: the composition root of the terminal front end.

Each sub-command lives in a module of :mod:`engine.commands` (found by discovery) or in
another package registered under the ``turnstile.commands`` entry-point group (the bot
registers itself that way, so the engine never imports it). A module exposes
``register(subparsers)``; the parser it adds sets ``handler`` to an
``async (args, settings) -> int`` function.

Start-up time counts for the short commands (``status --list``, ``runs``): a known
sub-command imports only its own module, and a parser may set ``listing`` to a predicate
of its arguments; when it holds, the handler gets
:class:`~engine.commands._settings.ListingSettings` (the database and logging settings
only, read without loading pydantic) instead of the whole :class:`Settings`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import logging
import pkgutil
import re
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

import engine.commands
from engine.errors import ConfigError, TurnstileError
from engine.logs import setup_logging

if TYPE_CHECKING:
    from engine.commands._settings import ListingSettings
    from engine.settings import Settings

__all__ = ["Handler", "build_parser", "main"]

_LOGGER = logging.getLogger(__name__)

Handler = Callable[[argparse.Namespace, "Settings"], Coroutine[Any, Any, int]]
EXIT_USAGE = 2
_DOC_CODE = re.compile(r"``(.+?)``", re.DOTALL)


class _Parser(argparse.ArgumentParser):
    """The parser of every command and sub-command: help for people, errors exit 2."""

    def format_help(self) -> str:
        # Descriptions come from docstrings, whose ``code`` spans are markup, not text.
        return _DOC_CODE.sub(r"`\1`", super().format_help())

    def error(self, message: str) -> Any:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"turnstile: error: {message}\n")


def _requested(argv: Sequence[str]) -> str | None:
    """The sub-command named on the command line, if any (skipping global options)."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--log-level":
            skip = True
        elif not arg.startswith("-"):
            return arg
        elif arg in ("-h", "--help"):
            return None
    return None


def _registrars(only: str | None = None) -> list[Callable[[Any], None]]:
    found: list[Callable[[Any], None]] = []
    modules = sorted(pkgutil.iter_modules(engine.commands.__path__), key=lambda m: m.name)
    if only is not None and any(m.name == only and not only.startswith("_") for m in modules):
        # Start-up time: a known engine command imports only its own module.
        return [importlib.import_module(f"engine.commands.{only}").register]
    for info in modules:
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"engine.commands.{info.name}")
        found.append(module.register)
    from importlib.metadata import entry_points  # start-up time: only for the full table

    for point in sorted(entry_points(group="turnstile.commands"), key=lambda p: p.name):
        found.append(point.load())
    return found


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="turnstile",
        description=(
            "Drive coding agents (Claude Code, Copilot CLI, Codex, any CLI) turn by turn "
            "from Telegram or this terminal, with human approval gates."
        ),
    )
    parser.add_argument(
        "--log-level",
        default=None,
        help="log records at this level on stderr (default TURNSTILE_LOG_LEVEL; "
        "`auto` and `chat` show only warnings unless this is given)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for register in _registrars(only):
        register(subparsers)
    return parser


def _settings(listing: bool) -> Settings | ListingSettings:
    if listing:
        from engine.commands._settings import read_listing_settings

        return read_listing_settings()
    from engine.settings import load_settings

    return load_settings()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    parser = build_parser(_requested(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    # A Handler; one whose parser sets ``listing`` also takes ListingSettings.
    handler: Callable[..., Coroutine[Any, Any, int]] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return EXIT_USAGE if args.command is None and argv not in (None, []) else 0
    predicate: Callable[[argparse.Namespace], bool] | None = getattr(args, "listing", None)
    listing = predicate is not None and predicate(args)
    try:
        settings = _settings(listing)
    except ConfigError as exc:
        print(f"turnstile: {exc}", file=sys.stderr)
        return EXIT_USAGE
    # The terminal views (auto, chat) are for a person: warnings only, in plain words,
    # unless log records were asked for.
    human = bool(getattr(args, "terminal_view", False)) and args.log_level is None
    setup_logging(
        level="WARNING" if human else args.log_level or settings.log_level,
        fmt="human" if human else settings.log_format,
        secrets=settings.secret_values(),
    )
    try:
        return asyncio.run(handler(args, settings))
    except ConfigError as exc:
        print(f"turnstile: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TurnstileError as exc:
        print(f"turnstile: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("turnstile: interrupted", file=sys.stderr)
        return 130
    finally:
        if listing:
            # The process ends now: the collector's full passes at exit over everything it
            # loaded (psycopg's types, the rows) would only delay the exit, by 20-60 ms.
            # Objects are still freed when their last reference goes.
            gc.freeze()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
