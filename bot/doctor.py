"""The bot's part of ``turnstile doctor``: its settings and the Bot API.

Found by the engine's doctor through the ``turnstile.doctor`` entry point, so the engine
never knows Telegram. The offline checks (token shape, allowlists, people, webhook
settings) run first; the network checks (``getMe`` through the configured base URL; in
webhook mode also ``getWebhookInfo``) run last and only when the doctor is not
``--offline``. Nothing here imports ``telegram``: the doctor stays quick.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx

from engine.commands.doctor import Check, Status
from engine.redact import Redactor
from engine.settings import Settings

__all__ = [
    "TelegramChecks",
    "bot_api_url",
    "check_bot_api",
    "check_settings",
    "check_webhook_delivery",
]

# What the Bot API routes as a token (`/bot<id>:<secret>/<method>`): a numeric bot id, a
# colon, URL-safe characters. Anything else can never work; a secret of an unusual length
# may still (test servers, local Bot API servers), so only the network check judges it.
_TOKEN_SHAPE = re.compile(r"^\d+:[A-Za-z0-9_-]+$")
_USUAL_SECRET = range(30, 65)
_SECRET_SHAPE = re.compile(r"^[A-Za-z0-9_-]{1,256}$")
HTTP_TIMEOUT = 10.0
_FIX_ENV = "put it in .env (copy .env.example) or the service's environment"


class TelegramChecks:
    """The checks the bot adds to ``turnstile doctor`` (the ``turnstile.doctor`` entry point)."""

    def settings_checks(self, settings: Settings) -> list[Check]:
        return check_settings(settings)

    async def network_checks(
        self, settings: Settings, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> list[Check]:
        api = await check_bot_api(settings, transport=transport)
        checks = [api]
        if api.status is Status.OK and settings.webhook_url:
            checks.append(await check_webhook_delivery(settings, transport=transport))
        return checks


def _ok(name: str, detail: str) -> Check:
    return Check(name, Status.OK, detail)


def _warn(name: str, detail: str, fix: str | None = None) -> Check:
    return Check(name, Status.WARN, detail, fix)


def _fail(name: str, detail: str, fix: str) -> Check:
    return Check(name, Status.FAIL, detail, fix)


# --- settings ------------------------------------------------------------------------


def check_settings(settings: Settings) -> list[Check]:
    """Token shape, allowlists and webhook settings; nothing leaves the process."""
    checks: list[Check] = []
    token = settings.telegram_token.get_secret_value() if settings.telegram_token else ""
    if not token:
        where = "" if Path(".env").is_file() else f" (and there is no .env in {Path.cwd()})"
        checks.append(
            _fail(
                "bot token",
                "TURNSTILE_TELEGRAM_TOKEN is not set" + where,
                "create a bot with @BotFather (/newbot) and " + _FIX_ENV,
            )
        )
    elif not _TOKEN_SHAPE.match(token.strip()):
        checks.append(
            _fail(
                "bot token",
                "TURNSTILE_TELEGRAM_TOKEN does not look like a bot token "
                "(digits, a colon, then 35 or so letters)",
                "copy it again from @BotFather (/mybots -> API Token), without quotes or spaces",
            )
        )
    elif len(token.strip().partition(":")[2]) not in _USUAL_SECRET:
        checks.append(
            _warn(
                "bot token",
                "set, but shorter or longer than the tokens @BotFather issues "
                "(the bot api check tells whether it works)",
                "if the bot api check fails, copy it again from @BotFather",
            )
        )
    else:
        checks.append(_ok("bot token", "set, looks like a bot token"))

    if settings.allowed_chats:
        checks.append(_ok("allowed chats", f"{len(settings.allowed_chats)} chat(s)"))
    else:
        checks.append(
            _fail(
                "allowed chats",
                "TURNSTILE_ALLOWED_CHATS is empty: the bot ignores every chat",
                "add your group's id (negative, e.g. -1001234567890) or your own user id "
                "for a private chat, comma separated",
            )
        )
    people = set(settings.admins) | set(settings.operators)
    if people:
        checks.append(
            _ok(
                "people",
                f"{len(settings.admins)} admin(s), {len(settings.operators)} operator(s), "
                f"{len(settings.approvers)} approver(s)",
            )
        )
    else:
        checks.append(
            _fail(
                "people",
                "TURNSTILE_ADMINS and TURNSTILE_OPERATORS are empty: nobody may use the bot",
                "add your numeric user id to TURNSTILE_ADMINS (the bot's refusal message "
                "tells it, so does @userinfobot)",
            )
        )
    if people and not (set(settings.admins) | set(settings.approvers)):
        checks.append(
            _warn(
                "approvers",
                "no admin or approver: nobody can approve a gate",
                "add a user id to TURNSTILE_APPROVERS or TURNSTILE_ADMINS",
            )
        )
    checks.append(_check_webhook(settings))
    return checks


def _check_webhook(settings: Settings) -> Check:
    if not settings.webhook_url:
        if "api.telegram.org" not in settings.telegram_base_url:
            return _ok("mode", f"long polling via a custom Bot API server ({_host(settings)})")
        return _ok("mode", "long polling (no public URL needed)")
    url = httpx.URL(settings.webhook_url)
    secret = settings.webhook_secret.get_secret_value() if settings.webhook_secret else ""
    if url.scheme != "https":
        return _fail(
            "mode",
            "webhook: TURNSTILE_WEBHOOK_URL must be an https:// URL",
            "put a reverse proxy with a certificate in front (docs/deploy.md)",
        )
    if not secret:
        return _fail(
            "mode",
            "webhook: TURNSTILE_WEBHOOK_SECRET is not set",
            "set 1-256 characters of A-Z a-z 0-9 _ - (e.g. `openssl rand -hex 32`)",
        )
    if not _SECRET_SHAPE.match(secret):
        return _fail(
            "mode",
            "webhook: TURNSTILE_WEBHOOK_SECRET may hold only A-Z a-z 0-9 _ - (1-256 chars)",
            "generate one with `openssl rand -hex 32`",
        )
    return _ok(
        "mode",
        f"webhook at {url.host}{url.path}, listening on "
        f"{settings.webhook_listen}:{settings.webhook_port}",
    )


def _host(settings: Settings) -> str:
    try:
        return httpx.URL(settings.telegram_base_url).host or settings.telegram_base_url
    except httpx.InvalidURL:
        return "an invalid URL"


# --- Bot API -------------------------------------------------------------------------


def bot_api_url(settings: Settings, method: str) -> str:
    """The URL python-telegram-bot would call: ``{base}{token}/{method}``, or ``{token}``
    substituted when the base URL contains it."""
    token = settings.telegram_token.get_secret_value() if settings.telegram_token else ""
    base = settings.telegram_base_url
    if "{token}" in base:
        return base.replace("{token}", token) + f"/{method}"
    return f"{base}{token}/{method}"


async def check_bot_api(
    settings: Settings, *, transport: httpx.AsyncBaseTransport | None = None
) -> Check:
    """``getMe`` through the configured base URL: proves the token and the network path."""
    name = "bot api"
    token = settings.telegram_token.get_secret_value() if settings.telegram_token else ""
    if not token:
        return _fail(name, "skipped: no token", "set TURNSTILE_TELEGRAM_TOKEN first")
    redactor = Redactor([token])
    host = _host(settings)
    try:
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT, transport=transport) as client:
            response = await client.post(bot_api_url(settings, "getMe"))
    except httpx.InvalidURL:
        return _fail(
            name, "TURNSTILE_TELEGRAM_BASE_URL is not a valid URL", "fix it or remove the line"
        )
    except httpx.HTTPError as exc:
        reason = redactor(str(exc)) or type(exc).__name__
        return _fail(
            name,
            f"cannot reach {host}: {reason}",
            "check the network, HTTPS_PROXY and TURNSTILE_TELEGRAM_BASE_URL",
        )
    if response.status_code in (401, 404):
        return _fail(
            name,
            f"{host} rejected the token ({response.status_code})",
            "the token is wrong or was revoked: copy the current one from @BotFather "
            "(/mybots -> API Token)",
        )
    try:
        payload = response.json()
    except ValueError:
        payload = None
    if response.status_code != 200 or not isinstance(payload, dict) or not payload.get("ok"):
        description = payload.get("description") if isinstance(payload, dict) else None
        return _fail(
            name,
            f"{host} answered getMe with {response.status_code}"
            + (f": {redactor(str(description))}" if description else ""),
            "is TURNSTILE_TELEGRAM_BASE_URL a Bot API server (ending in /bot)?",
        )
    me = payload.get("result") or {}
    username = me.get("username") if isinstance(me, dict) else None
    if not username:
        return _fail(name, f"{host} getMe has no username", "is this a Bot API server?")
    return _ok(name, f"@{username} via {host}")


async def check_webhook_delivery(
    settings: Settings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    now: float | None = None,
) -> Check:
    """``getWebhookInfo``: what Telegram has registered and whether its deliveries fail."""
    name = "webhook"
    token = settings.telegram_token.get_secret_value() if settings.telegram_token else ""
    secret = settings.webhook_secret.get_secret_value() if settings.webhook_secret else ""
    redactor = Redactor([token, secret])
    try:
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT, transport=transport) as client:
            response = await client.post(bot_api_url(settings, "getWebhookInfo"))
        payload = response.json()
        info = payload["result"]
        if response.status_code != 200 or not isinstance(info, dict):
            raise ValueError(response.status_code)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        return _warn(name, f"could not read the webhook's state: {redactor(str(exc))}")
    registered = str(info.get("url") or "")
    pending = int(info.get("pending_update_count") or 0)
    if not registered:
        return _warn(name, "no webhook registered yet", "the bot registers it when it starts")
    if registered != settings.webhook_url:
        return _warn(
            name,
            f"Telegram delivers to {registered}, not TURNSTILE_WEBHOOK_URL",
            "the bot registers its own URL when it starts; is another deployment running?",
        )
    error = info.get("last_error_message")
    when = info.get("last_error_date")
    age = (now if now is not None else time.time()) - float(when) if when else None
    if error and age is not None and age < 3600:
        return _fail(
            name,
            f"Telegram's last delivery failed {age / 60:.0f} min ago: "
            f"{redactor(str(error))} ({pending} update(s) waiting)",
            "check that the proxy serves the URL's path with a valid certificate and "
            "forwards it to TURNSTILE_WEBHOOK_LISTEN:PORT (docs/deploy.md)",
        )
    return _ok(name, f"registered, {pending} update(s) waiting")
