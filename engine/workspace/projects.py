"""Projects: a name mapped to a git URL or a local repository path, plus its default branch.

The setting ``TURNSTILE_PROJECTS`` takes either JSON or a compact form::

    TURNSTILE_PROJECTS='{"web": "https://github.com/acme/web.git",
                         "api": {"url": "/srv/git/api", "branch": "develop"}}'
    TURNSTILE_PROJECTS='[{"name": "web", "url": "git@github.com:acme/web.git"}]'
    TURNSTILE_PROJECTS='web=https://github.com/acme/web.git#main,api=/srv/git/api'

A project without a branch uses the remote's default branch (its ``HEAD``).
Credentials inside a URL are kept for git but never shown: :attr:`Project.display_url`
and :meth:`Project.secrets` let every message be redacted.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from engine.errors import ConfigError
from engine.redact import REDACTED

__all__ = [
    "Project",
    "ProjectError",
    "check_unique",
    "is_repository_reference",
    "is_safe_name",
    "parse_projects",
    "redact_url",
    "repository_name",
    "repository_project",
    "validate_branch_name",
    "validate_name",
]

SETTING = "TURNSTILE_PROJECTS"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_BRANCH = re.compile(r"^[A-Za-z0-9._][A-Za-z0-9._/-]{0,199}$")
_SCP_LIKE = re.compile(r"^(?:[^@/\s]+@)?[^/:\s]+:(?!//)")
_HTTP_SCHEMES = frozenset({"http", "https", "ftp", "ftps"})


class ProjectError(ConfigError):
    """A project is unknown or badly configured; the message never shows credentials."""

    def __init__(self, message: str) -> None:
        super().__init__(message, setting=SETTING)


def is_safe_name(name: object) -> bool:
    """Whether ``name`` is safe as one folder name and one branch-name component."""
    return (
        isinstance(name, str)
        and bool(_NAME.match(name))
        and ".." not in name
        and not name.endswith(".lock")
    )


def validate_name(name: str, *, what: str = "project name") -> str:
    """Return ``name`` if it is safe as a folder and branch component.

    Raises:
        ProjectError: empty, too long, or holding ``/``, ``..``, spaces or other characters.
    """
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise ProjectError(
            f"invalid {what} {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with "
            "a letter or digit (no '/', '..' or spaces)",
        )
    if name.endswith(".lock"):
        raise ProjectError(f"invalid {what} {name!r}: it must not end with '.lock'")
    return name


def validate_branch_name(branch: str, *, project: str) -> str:
    """Return ``branch`` if it is a plausible git branch name.

    Raises:
        ProjectError: the name cannot be a branch.
    """
    if (
        not _BRANCH.match(branch)
        or ".." in branch
        or "//" in branch
        or branch.endswith(("/", ".", ".lock"))
        or "/." in branch
    ):
        raise ProjectError(f"project {project!r}: {branch!r} is not a valid branch name")
    return branch


def _is_local(url: str) -> bool:
    if url.startswith("file://"):
        return True
    if "://" in url:
        return False
    return not _SCP_LIKE.match(url)


def is_repository_reference(value: str) -> bool:
    """Whether ``value`` names a repository (a git URL or a path), not a project name."""
    return not is_safe_name(value) or "://" in value or bool(_SCP_LIKE.match(value))


def repository_name(url: str) -> str:
    """A project name for a repository: its last path component without ``.git``.

    ``https://host/acme/web.git`` → ``web``; ``/srv/git/api/`` → ``api``; characters that
    cannot be in a name become ``-``.
    """
    raw = url
    if "://" in raw:
        try:
            raw = urlsplit(raw).path
        except ValueError:
            raw = ""
    elif _SCP_LIKE.match(raw):
        raw = raw.split(":", 1)[1]
    last = raw.rstrip("/").rpartition("/")[2].removesuffix(".git")
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", last).strip("-.")[:64].rstrip("-.")
    name = re.sub(r"\.{2,}", ".", name).removesuffix(".lock")
    return name if is_safe_name(name) else "repo"


def repository_project(reference: str, *, cwd: Path | None = None) -> Project:
    """A project for a repository given by URL or path, named after the repository.

    A relative path is taken from ``cwd`` (default: the current folder).

    Raises:
        ProjectError: a path that is not a folder, or a URL that cannot be a project.
    """
    value = reference.strip()
    if "://" in value or _SCP_LIKE.match(value):
        return Project(name=repository_name(value), url=value)
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = (cwd or Path.cwd()) / path
    path = Path(os.path.normpath(path))
    if not path.is_dir():
        raise ProjectError(
            f"--checkout-repo {value!r}: {path} is not a folder (give a configured project "
            "name, a git URL, or the path of a git repository)"
        )
    path = path.resolve()
    return Project(name=repository_name(str(path)), url=str(path))


def redact_url(url: str) -> str:
    """``url`` with any credentials replaced by a marker (``https://[REDACTED]@host/x``)."""
    if "://" not in url or "@" not in url:
        return url
    try:
        parts = urlsplit(url)
    except ValueError:
        return REDACTED
    if "@" not in parts.netloc:
        return url
    userinfo, _, host = parts.netloc.rpartition("@")
    if parts.scheme.lower() in _HTTP_SCHEMES:
        shown = REDACTED
    else:
        user, colon, _ = userinfo.partition(":")
        shown = f"{user}:{REDACTED}" if colon else user
    return urlunsplit((parts.scheme, f"{shown}@{host}", parts.path, parts.query, parts.fragment))


def _url_secrets(url: str) -> tuple[str, ...]:
    if "://" not in url or "@" not in url:
        return ()
    try:
        parts = urlsplit(url)
    except ValueError:
        return (url,)
    userinfo = parts.netloc.rpartition("@")[0]
    if not userinfo:
        return ()
    user, _, password = userinfo.partition(":")
    found = [userinfo]
    if password:
        found.append(password)
    if parts.scheme.lower() in _HTTP_SCHEMES and user:
        found.append(user)
    return tuple(s for s in found if len(s) >= 4)


@dataclass(frozen=True, slots=True)
class Project:
    """A repository agents work on.

    Attributes:
        name: safe short name (letters, digits, ``.``, ``_``, ``-``).
        url: git URL or local path; may hold credentials, so never print it.
        branch: default branch runs start from; None means the remote's ``HEAD``.
    """

    name: str
    url: str = field(repr=False)
    branch: str | None = None

    def __post_init__(self) -> None:
        validate_name(self.name)
        if not self.url or not self.url.strip():
            raise ProjectError(f"project {self.name!r} has no URL or path")
        if "\x00" in self.url or "\n" in self.url:
            raise ProjectError(f"project {self.name!r}: the URL holds control characters")
        if self.url.startswith("-"):
            raise ProjectError(f"project {self.name!r}: the URL must not start with '-'")
        if self.branch is not None:
            validate_branch_name(self.branch, project=self.name)

    @property
    def display_url(self) -> str:
        """The URL with credentials redacted: safe for logs, errors and chats."""
        return redact_url(self.url)

    @property
    def is_local(self) -> bool:
        """Whether the URL is a path on this machine (or a ``file://`` URL)."""
        return _is_local(self.url)

    @property
    def local_path(self) -> Path | None:
        """The repository folder of a local project, else None."""
        if not self.is_local:
            return None
        raw = self.url[len("file://") :] if self.url.startswith("file://") else self.url
        return Path(raw).expanduser()

    def secrets(self) -> tuple[str, ...]:
        """The credential parts of the URL, for a :class:`~engine.redact.Redactor`."""
        return _url_secrets(self.url)


def _entry(name: object, value: object) -> Project:
    if not isinstance(name, str):
        raise ProjectError(f"{SETTING}: a project name must be a string")
    if isinstance(value, str):
        return Project(name=name, url=value)
    if isinstance(value, Mapping):
        url = value.get("url") or value.get("path")
        branch = value.get("branch")
        unknown = set(value) - {"url", "path", "branch", "name"}
        if unknown:
            raise ProjectError(f"{SETTING}: project {name!r} has unknown keys {sorted(unknown)}")
        if not isinstance(url, str):
            raise ProjectError(f"{SETTING}: project {name!r} needs a 'url' string")
        if branch is not None and not isinstance(branch, str):
            raise ProjectError(f"{SETTING}: project {name!r}: 'branch' must be a string")
        return Project(name=name, url=url, branch=branch or None)
    raise ProjectError(f"{SETTING}: project {name!r} must map to a URL or an object")


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    found: dict[str, object] = {}
    for key, value in pairs:
        if key in found:
            raise ProjectError(f"{SETTING}: {key!r} is given twice")
        found[key] = value
    return found


def _parse_json(text: str) -> list[Project]:
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        # The position only: the text may hold credentials.
        raise ProjectError(
            f"{SETTING} is not valid JSON (line {exc.lineno} column {exc.colno})"
        ) from None
    if isinstance(data, Mapping):
        return [_entry(k, v) for k, v in data.items()]
    if isinstance(data, list):
        found = []
        for item in data:
            if not isinstance(item, Mapping) or "name" not in item:
                raise ProjectError(f"{SETTING}: each list entry needs a 'name' and a 'url'")
            found.append(_entry(item["name"], item))
        return found
    raise ProjectError(f"{SETTING} must be a JSON object or list")


def _parse_compact(text: str) -> list[Project]:
    found = []
    for chunk in text.split(","):
        item = chunk.strip()
        if not item:
            continue
        name, eq, rest = item.partition("=")
        if not eq:
            raise ProjectError(
                f"{SETTING}: expected name=url[#branch] entries separated by commas, "
                f"got an entry without '=' ({redact_url(name.strip())[:40]!r})"
            )
        url, hash_, branch = rest.strip().rpartition("#") if "#" in rest else (rest, "", "")
        found.append(
            Project(name=name.strip(), url=url.strip(), branch=branch.strip() or None)
            if hash_
            else Project(name=name.strip(), url=rest.strip())
        )
    return found


def parse_projects(text: str | None) -> tuple[Project, ...]:
    """Parse the ``TURNSTILE_PROJECTS`` setting (JSON or ``name=url#branch,...``).

    Raises:
        ProjectError: malformed text, a bad name or URL, or a name given twice.
    """
    if text is None or not text.strip():
        return ()
    stripped = text.strip()
    found = _parse_json(stripped) if stripped[0] in "[{" else _parse_compact(stripped)
    return check_unique(found)


def check_unique(projects: Iterable[Project]) -> tuple[Project, ...]:
    """``projects`` as a tuple, refusing a name given twice.

    Raises:
        ProjectError: two projects share a name.
    """
    seen: set[str] = set()
    result = []
    for project in projects:
        if project.name in seen:
            raise ProjectError(f"{SETTING}: project {project.name!r} is defined twice")
        seen.add(project.name)
        result.append(project)
    return tuple(result)
