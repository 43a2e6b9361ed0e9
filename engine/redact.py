"""Secret redaction for anything that leaves the engine: error texts, logs, chat output.

Three layers: credential *shapes* (``sk-…``, ``ghp_…``, private key blocks, chat webhook
URLs, ``NAME_TOKEN=…``), the exact values a :class:`Redactor` is given (turnstile's own
secrets and every credential variable an agent is handed, see :func:`credential_values`),
and credentials inside URLs.

The shapes are our own table of regular expressions (:data:`SHAPES`), not a scanner
such as Yelp's ``detect-secrets``. That scanner was measured for this job and left out:
it reports a value, not where it is (a private key is reported as its ``BEGIN`` line, a
GitHub token as ``ghp``), so the places to hide would have to be searched again; its
keyword plugin misses ``DB_PASS=…`` and ``export NAME=…`` outside source files; it has
no Discord or Teams webhook shape; its settings are one process-wide object; and its
entropy plugins, where they fire, take git hashes and UUIDs for secrets. Its plugin list
served as the checklist of shapes instead. Every shape is cheap (no nested repetition,
bounded lengths): :func:`redact` runs on every message that leaves for a chat.

Rendered chat text also carries entities (offsets into the text): :meth:`Redactor.passes`
yields the edits one pass at a time so that a renderer can move its offsets with them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "REDACTED",
    "SHAPES",
    "Edit",
    "Redactor",
    "Shape",
    "apply_edits",
    "credential_values",
    "is_credential_name",
    "redact",
    "tail",
]

REDACTED = "[REDACTED]"

# Words that make a variable or key a credential wherever they stand in its name
# (GH_TOKEN, DB_PASSWORD, AWS_SECRET_ACCESS_KEY, apiKey, mytoken): "input_tokens" is not one.
_CREDENTIAL_WORD = (
    r"(?:api[_-]?key|apikey|access[_-]?key|private[_-]?key|auth[_-]?key|token|secret"
    r"|password|passwd|passphrase|credentials?)"
)
# Kinds of key that are not secrets: SORT_KEY=name, PUBLIC_KEY=ssh-ed25519 …
_PLAIN_KEYS = (
    "primary", "foreign", "public", "pub", "sort", "partition", "cache", "hash", "range",
    "object", "unique", "index", "dict", "map", "lookup", "translation", "i18n", "row",
    "hot", "short", "idempotency", "group", "shard", "routing", "dedup", "s3", "gpg_pub",
)  # fmt: skip
# Short words that make a credential only as a whole part after another one (DB_PASS,
# SMTP_PWD, STRIPE_KEY, dbPass, secretKey): not PWD (the shell's folder), not bypass.
_SHORT_WORD = (
    r"(?:(?<=[A-Za-z0-9][_.\-])"
    + "".join(rf"(?<!{w}.)" for w in _PLAIN_KEYS)
    + r"(?:pass|pwd|pw|key)"
    + r"|(?<=[a-z0-9])(?-i:Pass|Pwd|Key)"
    + "".join(rf"(?<!{w})" for w in _PLAIN_KEYS)
    + r")"
)
# The lookahead first: it turns most positions away at once (the lookbehinds are slow).
_WORD = rf"(?=[acpkstACPKST])(?:{_CREDENTIAL_WORD}|{_SHORT_WORD})"
# After the word only whole parts may follow (GH_TOKEN_FILE, not input_tokens); what
# comes before it (CODEX_, AWS_, my) is left as it is. Bounded: no quadratic matching.
_PARTS = r"(?:[_.\-][A-Za-z0-9]{1,24}){0,4}"
_NAME = re.compile(rf"(?i)^[A-Za-z0-9_.\-]*?{_WORD}{_PARTS}$")
# A credential's value: quoted (spaces allowed, to the closing quote) or one word.
_VALUE = r"""(?P<q>["'])?(?P<secret>(?(q)[^"'\n]{6,512}|[^\s"']{6,}))"""

# Markdown markup inside a key ("sk-ant-*abc*", "sk\\-ant") is part of the key in raw
# text (documents, plain messages): stopping at it would leave the rest visible. A key
# ends on a letter or digit, so that a closing "`" or "*" stays.
_MARKUP = r"*`\\~_"
_END = r"(?![A-Za-z0-9])"


def _after(prefix: int) -> str:
    """Placed after a prefix of ``prefix`` characters: it must not follow a letter or digit."""
    return rf"(?<![A-Za-z0-9][^\n]{{{prefix}}})"


@dataclass(frozen=True, slots=True)
class Shape:
    """One kind of secret: a name people understand and its pattern. Where the pattern
    has a ``secret`` group, only that group is hidden (``DB_PASS=`` stays)."""

    name: str
    source: str

    @property
    def pattern(self) -> re.Pattern[str]:
        """The compiled pattern (compiled on first use: a command that never redacts,
        a listing say, does not pay for the whole table at start-up)."""
        return _compiled(self.source)


@functools.cache
def _compiled(source: str) -> re.Pattern[str]:
    return re.compile(source)


def _shape(name: str, pattern: str) -> Shape:
    return Shape(name, pattern)


SHAPES: tuple[Shape, ...] = (
    _shape(
        "private key block",
        # PEM (RSA, EC, DSA, PKCS#8, encrypted), OpenSSH and PGP; a block cut short
        # (no END line) is hidden up to its last line of key text.
        # The body never holds five dashes: it cannot run on past another block's start.
        r"-----BEGIN[ A-Z0-9]{0,40}PRIVATE KEY(?: BLOCK)?-----"
        r"(?:(?:[^-]|-(?!----)){0,65536}-----END[ A-Z0-9]{0,40}PRIVATE KEY(?: BLOCK)?-----"
        r"|(?:[ \t]*\r?\n(?:[A-Za-z0-9+/=]+|[A-Za-z][A-Za-z\-]{1,30}:[^\r\n]*)?)*)",
    ),
    _shape(
        "PuTTY private key",
        r"(?i)Private-Lines:[ \t]*\d+[ \t]*\r?\n(?P<secret>(?:[A-Za-z0-9+/=]+[ \t]*\r?\n?)+)",
    ),
    # Each token shape starts with its literal prefix, which the regular expression
    # engine searches for quickly; the check that it starts a word comes after it.
    _shape("OpenAI or Anthropic key", rf"sk{_after(2)}\\?-[A-Za-z0-9\-{_MARKUP}]{{7,}}[A-Za-z0-9]"),
    _shape("Stripe secret key", rf"[sr]k_{_after(3)}(?:live|test)_[A-Za-z0-9]{{10,}}"),
    _shape(
        "GitHub token",
        rf"(?:gh[pousr]{_after(3)}\\?_|github_pat_{_after(11)})"
        rf"[A-Za-z0-9{_MARKUP}]{{19,}}[A-Za-z0-9]",
    ),
    _shape(
        "GitLab token",
        rf"(?:gl{_after(2)}(?:pat|dt|rt|ptt|oas|cbt|ffct|imt|agent|soat|ft|wt)-"
        rf"|GR1348941{_after(9)})[A-Za-z0-9_\-]{{20,}}",
    ),
    _shape(
        "Slack token",
        rf"(?:xox[abposr]|xapp){_after(4)}\\?-[A-Za-z0-9\-{_MARKUP}]{{9,}}[A-Za-z0-9]",
    ),
    _shape("AWS access key", rf"(?:AKIA|ASIA|ABIA|ACCA){_after(4)}[0-9A-Z]{{16}}{_END}"),
    _shape("Google API key", rf"AIza{_after(4)}[0-9A-Za-z_\-]{{35}}"),
    _shape("npm token", rf"npm_{_after(4)}[A-Za-z0-9]{{36}}{_END}"),
    _shape("PyPI token", rf"pypi-AgE{_after(8)}[A-Za-z0-9_\-]{{50,}}"),
    _shape("Hugging Face token", rf"hf_{_after(3)}[A-Za-z0-9]{{30,}}{_END}"),
    _shape("SendGrid key", rf"SG\.{_after(3)}[A-Za-z0-9_\-]{{16,32}}\.[A-Za-z0-9_\-]{{16,64}}"),
    _shape("Twilio key", rf"SK{_after(2)}[0-9a-f]{{32}}{_END}"),
    _shape(
        "Discord bot token",
        rf"[MNO]{_after(1)}[A-Za-z0-9_\-]{{23,27}}\.[A-Za-z0-9_\-]{{6}}\.[A-Za-z0-9_\-]{{27,40}}",
    ),
    # "bot123456:AAH…" in an API URL too: the digits need not start a word.
    _shape(
        "Telegram bot token",
        rf"\d(?<![0-9]\d)\d{{5,11}}:[A-Za-z0-9\-{_MARKUP}]{{29,}}[A-Za-z0-9_\-]",
    ),
    _shape(
        "JSON web token",
        rf"eyJ{_after(3)}[A-Za-z0-9_\-]{{8,}}\.eyJ[A-Za-z0-9_\-]{{8,}}\.[A-Za-z0-9_\-]*",
    ),
    # Chat webhooks: the URL is the credential; the service's host stays readable.
    _shape(
        "Slack webhook",
        r"(?i)hooks\.slack(?:-gov)?\.com/(?:services|workflows|triggers)/"
        r"(?P<secret>[A-Za-z0-9_/\-]{8,})",
    ),
    _shape(
        "Discord webhook",
        r"(?i)(?:discord|discordapp)\.com/api/(?:v\d+/)?webhooks/(?P<secret>\d+/[A-Za-z0-9_\-]+)",
    ),
    _shape(
        "Teams webhook",
        r"(?i)(?:\.webhook\.office\.com|outlook\.office(?:365)?\.com)/"
        r"(?P<secret>webhook[^\s\"'<>()\[\]]{8,})",
    ),
    _shape(
        "credential in a query string",
        r"(?i)[?&](?:sig|signature|token|access_token|refresh_token|id_token|api_key|apikey"
        r"|key|secret|client_secret|password|passwd|pwd|auth)=(?P<secret>[^&#\s\"'<>]{6,})",
    ),
    _shape("password in a URL", r"://[^/\s:@]+:(?P<secret>[^@\s/]+)@"),
    _shape(
        "Authorization header",
        # Proxy-Authorization too: the match starts at "authorization".
        r"[aA](?i:uthorization)(?<![A-Za-z0-9_].{13})[\"']?\s*[:=]\s*[\"']?"
        r"(?i:(?:bearer|basic|token|bot|digest|negotiate|ntlm|apikey)\s+)?"
        r"(?P<secret>[^\s\"',]{6,})",
    ),
    _shape(
        "bearer token",
        # Not the words of prose about them ("bearer tokens expire").
        r"[bB](?i:earer)(?<![A-Za-z0-9_].{6})\s+"
        r"(?!(?i:tokens?|auth\w*|headers?|scheme|credentials?)\b)[A-Za-z0-9._~+/\-]+=*",
    ),
    _shape(
        "user and password for curl",
        # Not a user and group id (docker run -u 1000:1000).
        r"-(?<![A-Za-z0-9\-]-)(?:u|-user)[ \t]+[^\s:\"']+:(?P<secret>(?![0-9]+\b)[^\s\"']{4,})",
    ),
    # set NAME value, setx, setenv (csh), ENV NAME value (Dockerfile), --password value.
    _shape(
        "credential set by a command",
        # The name must look like a variable (an upper-case letter or "_" in it): "set
        # token expiry to 1h" is prose.
        rf"(?i)(?=[se-])(?:(?<![A-Za-z0-9_\-])(?:set|setx|setenv|env)[ \t]+(?:-[A-Za-z]+[ \t]+)*"
        rf"(?=[A-Za-z0-9.\-]*(?-i:[A-Z_]))[A-Za-z0-9_.\-]*?"
        rf"|(?<![A-Za-z0-9\-])--[A-Za-z0-9\-]*?){_WORD}{_PARTS}[ \t]+{_VALUE}",
    ),
    # NAME=value, export NAME=value, NAME: value, "name": "value", name := value.
    _shape(
        "credential assignment",
        # Not a URL's user and password (scheme://db_pw:…@host), which the URL shape hides
        # (this one would take the host with it).
        rf"(?i){_WORD}{_PARTS}[\"']?\s*(?::=|=>|=|:(?![^\s@/\"']*@))\s*{_VALUE}",
    ),
)

# Values shorter than this are not redacted verbatim: "true" or "1" would blank out
# every occurrence of a common word in every message.
_MIN_VALUE = 8


def is_credential_name(name: str) -> bool:
    """Whether a variable (or key) called ``name`` holds a credential (``GH_TOKEN``: yes)."""
    return bool(_NAME.match(name))


def credential_values(env: Mapping[str, str]) -> tuple[str, ...]:
    """The values of the credential variables in ``env``, for a :class:`Redactor`."""
    return tuple(
        value.strip()
        for name, value in env.items()
        if is_credential_name(name) and len(value.strip()) >= _MIN_VALUE
    )


@dataclass(frozen=True, slots=True)
class Edit:
    """Replace ``text[start:end]`` (Python string indices) with ``replacement``."""

    start: int
    end: int
    replacement: str


def apply_edits(text: str, edits: Sequence[Edit]) -> str:
    """``text`` with ``edits`` (sorted, not overlapping) applied."""
    out: list[str] = []
    pos = 0
    for edit in edits:
        out.append(text[pos : edit.start])
        out.append(edit.replacement)
        pos = edit.end
    out.append(text[pos:])
    return "".join(out)


@functools.cache
def _patterns() -> tuple[re.Pattern[str], ...]:
    return tuple(shape.pattern for shape in SHAPES)


class Redactor:
    """Replaces known secret shapes, plus any exact secrets it was given, with a marker."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets = tuple(sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True))
        # Longest first, as in __call__: a secret that contains another is hidden whole.
        self._literal = (
            re.compile("|".join(re.escape(s) for s in self._secrets)) if self._secrets else None
        )

    def with_secrets(self, secrets: Iterable[str]) -> Redactor:
        """A redactor that also hides ``secrets``."""
        return Redactor((*self._secrets, *secrets))

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        for pattern in _patterns():
            text = pattern.sub(_replacement, text)
        return text

    def hide_exact(self, text: str) -> str:
        """``text`` with only the exact secrets replaced (no shapes)."""
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        return text

    def passes(self, text: str) -> Iterator[tuple[Edit, ...]]:
        """The edits that redact ``text``, one pass at a time.

        Each pass's offsets refer to the text as the earlier passes left it; applying
        every pass in order with :func:`apply_edits` gives the same text as calling the
        redactor. Passes that change nothing are skipped.
        """
        patterns = _patterns()
        steps = (self._literal, *patterns) if self._literal is not None else patterns
        for pattern in steps:
            edits = tuple(edit for m in pattern.finditer(text) if (edit := _edit(m)) is not None)
            if edits:
                yield edits
                text = apply_edits(text, edits)


def _edit(match: re.Match[str]) -> Edit | None:
    """The smallest edit that turns the match into its replacement (a kept ``NAME=`` is
    not part of it), or None when nothing changes."""
    old = match.group(0)
    new = _replacement(match)
    if old == new:
        return None
    head = 0
    while head < min(len(old), len(new)) and old[head] == new[head]:
        head += 1
    back = 0
    while back < min(len(old), len(new)) - head and old[-1 - back] == new[-1 - back]:
        back += 1
    start = match.start() + head
    return Edit(start, match.end() - back, new[head : len(new) - back])


def _replacement(match: re.Match[str]) -> str:
    if "secret" not in match.re.groupindex or match.group("secret") is None:
        return REDACTED
    whole, base = match.group(0), match.start()
    start, end = match.span("secret")
    return f"{whole[: start - base]}{REDACTED}{whole[end - base :]}"


_DEFAULT = Redactor()


def redact(text: str) -> str:
    """Redact known secret shapes from ``text``."""
    return _DEFAULT(text)


def tail(data: bytes | str, limit: int = 2048) -> str:
    """The last ``limit`` bytes of ``data`` as text, redacted."""
    raw = data.encode("utf-8", errors="replace") if isinstance(data, str) else data
    if len(raw) > limit:
        raw = raw[-limit:]
    return redact(raw.decode("utf-8", errors="replace"))
