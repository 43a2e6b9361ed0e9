"""Signing in the Telegram way: a Mini App's ``initData``, a one-time link, a session cookie.

- A Mini App opened from the bot gets ``initData`` from Telegram, signed with a key only
  Telegram and the bot share: ``secret = HMAC-SHA-256(key "WebAppData", bot token)`` and
  ``hash = HMAC-SHA-256(secret, the other fields as sorted "key=value" lines)``, in hex.
  It is accepted while its ``auth_date`` is fresh.
- A desktop browser signs in with a link ``/web`` hands out in a private chat: used once,
  it expires in minutes; only a hash of its token is stored.
- Either way the browser then holds a signed session cookie naming the person; every
  change it asks for carries a CSRF token derived from that session.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final
from urllib.parse import parse_qsl

from itsdangerous import BadSignature, URLSafeTimedSerializer

if TYPE_CHECKING:
    from engine.store.backend import AnyDatabase

__all__ = [
    "INIT_DATA_MAX_AGE",
    "OneTimeLinks",
    "Session",
    "SessionKeys",
    "SignInRefused",
    "TelegramUser",
    "check_init_data",
    "sign_init_data",
]

#: How old a Mini App's ``initData`` may be (Telegram makes it as the app opens).
INIT_DATA_MAX_AGE: Final = 3600.0
# A clock a little ahead of ours is not a forgery.
_SKEW: Final = 60.0


class SignInRefused(Exception):
    """The sign-in data is forged, stale, used or malformed; ``reason`` says which, in
    words for the sign-in page."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class TelegramUser:
    """Who signed in, as Telegram says."""

    id: int
    first_name: str = ""
    username: str | None = None


def _secret(bot_token: str) -> bytes:
    return hmac.new(b"WebAppData", bot_token.encode(), hashlib.sha256).digest()


def _check_string(fields: dict[str, str]) -> bytes:
    return "\n".join(f"{k}={v}" for k, v in sorted(fields.items()) if k != "hash").encode()


def sign_init_data(fields: dict[str, str], bot_token: str) -> str:
    """``fields`` signed the way Telegram signs a Mini App's ``initData`` (a query string).

    What the bot's own tests and fakes use to stand in for Telegram.
    """
    from urllib.parse import urlencode

    digest = hmac.new(_secret(bot_token), _check_string(fields), hashlib.sha256).hexdigest()
    return urlencode({**fields, "hash": digest})


def check_init_data(
    raw: str,
    bot_token: str,
    *,
    now: float | None = None,
    max_age: float = INIT_DATA_MAX_AGE,
) -> TelegramUser:
    """The person a Mini App's ``initData`` names, once its signature and age check out.

    Raises:
        SignInRefused: malformed, not signed with this bot's token, or too old.
    """
    try:
        pairs = parse_qsl(raw, keep_blank_values=True, strict_parsing=True)
    except ValueError as exc:
        raise SignInRefused("the sign-in data from Telegram is malformed") from exc
    fields = dict(pairs)
    if len(fields) != len(pairs):
        raise SignInRefused("the sign-in data from Telegram repeats a field")
    given = fields.get("hash", "")
    want = hmac.new(_secret(bot_token), _check_string(fields), hashlib.sha256).hexdigest()
    if not given or not hmac.compare_digest(given.lower(), want):
        raise SignInRefused("the sign-in data is not signed by Telegram for this bot")
    try:
        signed_at = float(fields["auth_date"])
        user = json.loads(fields["user"])
        user_id = int(user["id"])
    except (KeyError, ValueError, TypeError) as exc:
        raise SignInRefused("the sign-in data names no person or no time") from exc
    now = time.time() if now is None else now
    if signed_at > now + _SKEW or now - signed_at > max_age:
        raise SignInRefused("the sign-in data from Telegram is too old: open the app again")
    return TelegramUser(
        id=user_id,
        first_name=str(user.get("first_name") or ""),
        username=str(user["username"]) if user.get("username") else None,
    )


class OneTimeLinks:
    """Sign-in links for a desktop browser: single use, expiring; only hashes stored."""

    def __init__(
        self, db: AnyDatabase, *, ttl: float, clock: Callable[[], float] = time.time
    ) -> None:
        self._db = db
        self._ttl = ttl
        self._clock = clock

    @staticmethod
    def _hash(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    async def issue(self, user_id: int) -> str:
        """A new link token for ``user_id`` (what goes into the link)."""
        token = secrets.token_urlsafe(32)
        now = self._clock()
        await self._db.execute(
            "INSERT INTO web_links (token_hash, user_id, created_at, expires_at)"
            " VALUES (?, ?, ?, ?)",
            (self._hash(token), user_id, now, now + self._ttl),
        )
        return token

    async def redeem(self, token: str) -> int:
        """The person the link is for; it cannot be used again.

        Raises:
            SignInRefused: unknown, used already or expired.
        """
        now = self._clock()
        async with self._db.transaction() as conn:
            cursor = await conn.execute(
                "UPDATE web_links SET used_at = ? WHERE token_hash = ? AND used_at IS NULL"
                " AND expires_at > ? RETURNING user_id",
                (now, self._hash(token), now),
            )
            row = await cursor.fetchone()
            # Links a day past their end are of no use to anyone: let them go.
            await conn.execute("DELETE FROM web_links WHERE expires_at < ?", (now - 86400.0,))
        if row is None:
            raise SignInRefused("this sign-in link was used already or has expired: ask /web again")
        return int(row["user_id"])


@dataclass(frozen=True, slots=True)
class Session:
    """A signed-in browser: the person, and the token its changes must carry."""

    user_id: int
    nonce: str
    csrf: str


class SessionKeys:
    """Signs and reads session cookies and derives their CSRF tokens.

    The key is derived from the bot token: a new token signs everyone out.
    """

    def __init__(self, bot_token: str, *, max_age: float) -> None:
        self._key = hmac.new(b"turnstile web session", bot_token.encode(), hashlib.sha256).digest()
        self._cookies = URLSafeTimedSerializer(self._key, salt="session")
        self._max_age = max_age

    @property
    def max_age(self) -> float:
        return self._max_age

    def _csrf(self, nonce: str) -> str:
        return hmac.new(self._key, f"csrf:{nonce}".encode(), hashlib.sha256).hexdigest()

    def new(self, user_id: int) -> tuple[str, Session]:
        """A new session for ``user_id``: (the cookie's value, the session)."""
        nonce = secrets.token_urlsafe(16)
        cookie = self._cookies.dumps({"u": user_id, "n": nonce})
        return cookie, Session(user_id, nonce, self._csrf(nonce))

    def read(self, cookie: str | None) -> Session | None:
        """The session a cookie holds; None when missing, forged or expired."""
        if not cookie:
            return None
        try:
            data = self._cookies.loads(cookie, max_age=int(self._max_age))
            user_id, nonce = int(data["u"]), str(data["n"])
        except (BadSignature, KeyError, TypeError, ValueError):
            return None
        return Session(user_id, nonce, self._csrf(nonce))

    def csrf_ok(self, session: Session, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given, session.csrf)
