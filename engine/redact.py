"""Secret redaction for anything that leaves the engine: error texts, logs, chat output.

Three layers: credential *shapes* (``sk-…``, ``ghp_…``, ``NAME_TOKEN=…``), the exact
values a :class:`Redactor` is given (turnstile's own secrets and every credential variable
an agent is handed, see :func:`credential_values`), and credentials inside URLs.

Rendered chat text also carries entities (offsets into the text): :meth:`Redactor.passes`
yields the edits one pass at a time so that a renderer can move its offsets with them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "REDACTED",
    "Edit",
    "Redactor",
    "apply_edits",
    "credential_values",
    "is_credential_name",
    "redact",
    "tail",
]

REDACTED = "[REDACTED]"

# Words that make a variable or key a credential when they are one of its parts
# (GH_TOKEN, DB_PASSWORD, AWS_SECRET_ACCESS_KEY, apiKey): "input_tokens" is not one.
_CREDENTIAL_WORD = (
    r"(?:api[_-]?key|apikey|access[_-]?key|private[_-]?key|auth[_-]?key|token|secret"
    r"|password|passwd|passphrase|credentials?)"
)
# After the word only whole parts may follow (GH_TOKEN_FILE, not input_tokens); what
# comes before it (CODEX_, AWS_, my) is left as it is. Bounded: no quadratic matching.
_PARTS = r"(?:[_.\-][A-Za-z0-9]{1,24}){0,4}"
_NAME = re.compile(rf"(?i)^[A-Za-z0-9_.\-]*?{_CREDENTIAL_WORD}{_PARTS}$")

# Markdown markup inside a key ("sk-ant-*abc*", "sk\\-ant") is part of the key in raw
# text (documents, plain messages): stopping at it would leave the rest visible. A key
# ends on a letter or digit, so that a closing "`" or "*" stays.
_MARKUP = r"*`\\~_"
# Shapes of credentials commonly found in agent output, environment dumps and headers.
_PATTERNS: tuple[re.Pattern[str], ...] = (
    re.compile(rf"(?<![A-Za-z0-9])sk\\?-[A-Za-z0-9\-{_MARKUP}]{{7,}}[A-Za-z0-9]"),
    re.compile(
        rf"(?<![A-Za-z0-9])(?:ghp|gho|ghu|ghs|ghr)\\?_[A-Za-z0-9{_MARKUP}]{{19,}}[A-Za-z0-9]"
    ),
    re.compile(rf"(?<![A-Za-z0-9])github_pat_[A-Za-z0-9{_MARKUP}]{{19,}}[A-Za-z0-9]"),
    re.compile(rf"(?<![A-Za-z0-9])xox[abprs]\\?-[A-Za-z0-9\-{_MARKUP}]{{9,}}[A-Za-z0-9]"),
    re.compile(r"(?<![A-Za-z0-9])AKIA[0-9A-Z]{16}\b"),
    re.compile(rf"\b\d{{6,12}}:[A-Za-z0-9\-{_MARKUP}]{{29,}}[A-Za-z0-9_\-]"),  # bot tokens
    re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/\-]+=*"),
    # NAME=value, NAME: value, "name": "value" where NAME is a credential name.
    re.compile(rf"(?i)({_CREDENTIAL_WORD}{_PARTS}[\"']?\s*[=:]\s*)([\"']?)[^\s\"']{{6,}}"),
    re.compile(r"(?i)(://[^/\s:@]+:)[^@\s/]+(@)"),  # credentials inside URLs
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
        for pattern in _PATTERNS:
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
        steps = (self._literal, *_PATTERNS) if self._literal is not None else _PATTERNS
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
    groups = match.groups()
    if len(groups) == 2 and groups[1] == "@":
        return f"{groups[0]}{REDACTED}@"
    if len(groups) == 2:
        return f"{groups[0]}{groups[1]}{REDACTED}"
    return REDACTED


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
