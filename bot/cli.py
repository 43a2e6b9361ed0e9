"""``turnstile bot``: registered through the ``turnstile.commands`` entry point."""

from __future__ import annotations

import argparse
from typing import Any

from engine.errors import ConfigError
from engine.settings import Settings

__all__ = ["register"]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("bot", help="run the Telegram bot (long polling or webhook)")
    parser.set_defaults(handler=run_bot)


async def run_bot(args: argparse.Namespace, settings: Settings) -> int:
    if settings.telegram_token is None or not settings.telegram_token.get_secret_value():
        raise ConfigError(
            "TURNSTILE_TELEGRAM_TOKEN is not set: put the token BotFather gave you in .env "
            "(see .env.example)",
            setting="TURNSTILE_TELEGRAM_TOKEN",
        )
    from bot.app import serve  # imports telegram only when the bot runs

    code: int = await serve(settings)
    return code
