"""How far a tool call reaches, and which permission presets ask a person before it runs.

A pure judgement of one tool call: it reads, it writes in the project's folder, it is
destructive or reaches outward (deletes outside the folder, force-pushes, publishes,
uploads, runs as root, changes CI or deploy files), or it is catastrophic (``rm -rf``
outside the folder, a force push to the default branch, a script piped from the network,
reading a secrets file). A preset says from which level on a person is asked:
``guarded`` from writing on, ``trusted`` from destructive or outward on, ``free`` only at
catastrophic. Catastrophic always asks, under every policy that has a permission server,
and no "allow for this session" ever covers it.

The judgement errs towards asking: a command it cannot read (unbalanced quotes) writes;
a path it cannot place (``$HOME``, ``~``) is outside the folder; a tool it does not know
reaches outward.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import PurePosixPath
from typing import Any, Final

__all__ = ["Assessment", "Reach", "assess"]


class Reach(IntEnum):
    """How far a tool call goes, in the order presets compare them."""

    READS = 0
    WRITES = 1
    OUTWARD = 2
    CATASTROPHIC = 3


@dataclass(frozen=True, slots=True)
class Assessment:
    """One tool call's reach, why (plain words for the person asked), and whether it
    destroys something (a session grant on it covers exactly that call)."""

    reach: Reach
    why: str = ""
    destructive: bool = False


_READS: Final = Assessment(Reach.READS)
_WRITES: Final = Assessment(Reach.WRITES, "changes files")

_READING_TOOLS: Final = frozenset(
    {
        "Read",
        "Glob",
        "Grep",
        "LS",
        "NotebookRead",
        "TodoWrite",
        "TodoRead",
        "BashOutput",
        "KillShell",
        "KillBash",
        "WebSearch",
        "WebFetch",
        "ExitPlanMode",
        "Task",
        "ListMcpResourcesTool",
        "ReadMcpResourceTool",
    }
)
_WRITING_TOOLS: Final = frozenset({"Write", "Edit", "MultiEdit", "NotebookEdit"})
_PATH_KEYS: Final = ("file_path", "notebook_path", "path")

# Files whose contents are secrets: reading one asks, always.
_SECRET_NAMES: Final = frozenset(
    {
        ".env",
        ".netrc",
        ".pgpass",
        ".pypirc",
        ".npmrc",
        "id_rsa",
        "id_dsa",
        "id_ecdsa",
        "id_ed25519",
        "credentials",
        "credentials.json",
        "secrets.json",
        "secrets.yaml",
        "secrets.yml",
    }
)
_SECRET_SUFFIXES: Final = (".pem", ".key", ".p12", ".pfx", ".keystore", ".jks", ".asc", ".gpg")
_NOT_SECRET: Final = frozenset({".env.example", ".env.sample", ".env.template", ".env.dist"})
_SECRET_DIRS: Final = frozenset({".ssh", ".gnupg", ".aws", ".docker", ".kube"})

# CI and deploy files: changing one is outward (it runs elsewhere, with other powers).
_CI_DIRS: Final = (
    ".github/workflows",
    ".gitlab",
    ".circleci",
    ".buildkite",
    ".ci",
    ".woodpecker",
    "deploy",
    "deployment",
    "k8s",
    "helm",
    "terraform",
)
_CI_NAMES: Final = frozenset(
    {
        ".gitlab-ci.yml",
        ".travis.yml",
        "jenkinsfile",
        "azure-pipelines.yml",
        "bitbucket-pipelines.yml",
        "dockerfile",
        "docker-compose.yml",
        "docker-compose.yaml",
        "compose.yml",
        "compose.yaml",
        "procfile",
        "fly.toml",
        "vercel.json",
        "netlify.toml",
        "app.yaml",
        "codeowners",
    }
)

# Programs that only look: a simple command of one of these reads.
_LOOKING: Final = frozenset(
    {
        "cd",
        "pushd",
        "popd",
        "ls",
        "cat",
        "head",
        "tail",
        "less",
        "more",
        "wc",
        "grep",
        "egrep",
        "fgrep",
        "rg",
        "pwd",
        "echo",
        "printf",
        "which",
        "type",
        "file",
        "stat",
        "tree",
        "diff",
        "cmp",
        "du",
        "df",
        "date",
        "whoami",
        "id",
        "uname",
        "true",
        "false",
        "test",
        "[",
        "sort",
        "uniq",
        "cut",
        "basename",
        "dirname",
        "realpath",
        "readlink",
        "sha256sum",
        "md5sum",
    }
)
_LOOKING_GIT: Final = frozenset(
    {"status", "diff", "log", "show", "rev-parse", "ls-files", "blame", "describe", "shortlog"}
)
_ROOT: Final = frozenset({"sudo", "doas", "su", "pkexec", "run0"})
_WRAPPERS: Final = frozenset({"command", "exec", "nohup", "time", "nice", "env", "builtin"})
_SHELLS: Final = frozenset(
    {"sh", "bash", "zsh", "dash", "ksh", "fish", "python", "python3", "perl", "ruby", "node"}
)
_FETCHERS: Final = frozenset({"curl", "wget", "fetch"})
_UPLOADERS: Final = frozenset(
    {"scp", "sftp", "ssh", "nc", "ncat", "netcat", "socat", "telnet", "ftp"}
)
_CURL_SENDS: Final = ("-T", "--upload-file", "-d", "-F", "--form", "--json", "--data")
_SENDING_METHODS: Final = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_PUBLISHERS: Final = {
    "npm": {"publish"},
    "pnpm": {"publish"},
    "yarn": {"publish", "npm"},
    "cargo": {"publish"},
    "gem": {"push"},
    "poetry": {"publish"},
    "uv": {"publish"},
    "flit": {"publish"},
    "hatch": {"publish"},
    "twine": {"upload"},
    "docker": {"push"},
    "podman": {"push"},
    "dotnet": {"nuget"},
    "mvn": {"deploy"},
    "gradle": {"publish"},
}
_DISK_WRECKERS: Final = frozenset({"mkfs", "fdisk", "wipefs", "parted"})
_DEFAULT_BRANCHES: Final = frozenset({"main", "master", "trunk", "develop", "HEAD"})
# "curl … | sh", "sh <(curl …)", "bash -c "$(wget …)"": a script run straight from the network.
_PIPED_SCRIPT: Final = re.compile(
    r"\b(?:curl|wget|fetch)\b[^|;&]*\|\s*(?:sudo\s+(?:-\S+\s+)*)?(?:ba|z|da|k)?sh\b"
    r"|\b(?:curl|wget|fetch)\b[^|;&]*\|\s*(?:sudo\s+)?(?:python3?|perl|ruby|node)\b"
    r"|\b(?:ba|z|da|k)?sh\b\s+(?:-\S+\s+)*<\(\s*(?:curl|wget)\b"
    r"|\$\(\s*(?:curl|wget)\b"
    r"|`\s*(?:curl|wget)\b"
)


def assess(
    tool: str, tool_input: Mapping[str, Any], worktree: str | os.PathLike[str] | None = None
) -> Assessment:
    """How far the tool call ``tool(tool_input)`` reaches, run in ``worktree``.

    Without a worktree, relative paths count as inside it and absolute ones as outside.
    """
    root = _normal(str(worktree)) if worktree is not None else None
    if tool == "Bash":
        return _assess_command(str(tool_input.get("command", "")), root)
    paths = [str(tool_input[key]) for key in _PATH_KEYS if tool_input.get(key)]
    if tool in _WRITING_TOOLS:
        return max((_assess_write(path, root) for path in paths), default=_WRITES, key=_order)
    if tool in _READING_TOOLS or tool.startswith("mcp__turnstile__"):
        for key in ("pattern", "glob"):
            if tool in {"Glob", "Grep"} and tool_input.get(key):
                paths.append(str(tool_input[key]))
        for path in paths:
            if _is_secret(path):
                return Assessment(Reach.CATASTROPHIC, f"reads a secrets file ({_name(path)})")
        return _READS
    return Assessment(Reach.OUTWARD, f"uses {tool}, a tool turnstile cannot judge")


def _order(assessment: Assessment) -> tuple[int, bool]:
    return (int(assessment.reach), assessment.destructive)


def _worst(found: Iterator[Assessment]) -> Assessment:
    return max(found, default=_READS, key=_order)


def _normal(path: str) -> str:
    return os.path.normpath(path) if path else path


def _name(path: str) -> str:
    return PurePosixPath(path).name or path


def _is_secret(path: str) -> bool:
    pure = PurePosixPath(path.strip("\"'"))
    if any(part in _SECRET_DIRS for part in pure.parts[:-1]):
        return True
    name = pure.name.lower()
    if name in _NOT_SECRET:
        return False
    if name in _SECRET_NAMES or name.startswith(".env."):
        return True
    return name.endswith(_SECRET_SUFFIXES) and not name.endswith((".pub", ".pub.asc"))


def _is_ci(path: str, root: str | None) -> bool:
    relative = _relative(path, root)
    if relative is None:
        return False
    lowered = relative.lower()
    if PurePosixPath(lowered).name in _CI_NAMES:
        return True
    return any(lowered == d or lowered.startswith(d + "/") for d in _CI_DIRS)


def _relative(path: str, root: str | None) -> str | None:
    """``path`` inside the worktree (relative to it), or None when it is outside."""
    text = path.strip("\"'")
    if not text or text.startswith(("~", "$")) or "$" in text or "`" in text:
        return None
    if os.path.isabs(text):
        if root is None:
            return None
        full = os.path.normpath(text)
        if full == root:
            return "."
        if not full.startswith(root.rstrip("/") + "/"):
            return None
        return os.path.relpath(full, root)
    relative = os.path.normpath(text)
    if relative == ".." or relative.startswith("../"):
        return None
    return relative


def _assess_write(path: str, root: str | None) -> Assessment:
    if _relative(path, root) is None:
        return Assessment(Reach.OUTWARD, f"writes outside the project folder ({path})")
    if _is_ci(path, root):
        return Assessment(Reach.OUTWARD, f"changes a CI or deploy file ({_relative(path, root)})")
    return _WRITES


# -- shell commands ----------------------------------------------------------------------


def _assess_command(command: str, root: str | None) -> Assessment:
    text = command.strip()
    if not text:
        return _READS
    if _PIPED_SCRIPT.search(text):
        return Assessment(Reach.CATASTROPHIC, "runs a script straight from the network")
    try:
        lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
    except ValueError:
        return Assessment(Reach.WRITES, "runs a command turnstile cannot read")
    found: list[Assessment] = []
    words: list[str] = []
    redirect = False
    for token in tokens:
        if token and all(ch in "|&;()<>" for ch in token):
            if ">" in token:
                redirect = True
                continue
            if words:
                found.append(_assess_simple(words, root))
            words = []
            continue
        if redirect:
            redirect = False
            found.append(_assess_redirect(token, root))
            continue
        words.append(token)
    if words:
        found.append(_assess_simple(words, root))
    for token in tokens:
        if _is_secret(token) and not token.startswith("-"):
            found.append(Assessment(Reach.CATASTROPHIC, f"uses a secrets file ({_name(token)})"))
    return _worst(iter(found))


def _assess_redirect(target: str, root: str | None) -> Assessment:
    if target in {"/dev/null", "/dev/stdout", "/dev/stderr"} or target.startswith("&"):
        return _READS
    return _assess_write(target, root)


def _assess_simple(words: Sequence[str], root: str | None) -> Assessment:
    words = list(words)
    as_root = False
    while words:
        head = os.path.basename(words[0])
        if "=" in words[0] and not words[0].startswith("="):
            words.pop(0)  # VAR=value before the program
        elif head in _ROOT:
            as_root = True
            words.pop(0)
            while words and words[0].startswith("-"):
                words.pop(0)
        elif head in _WRAPPERS:
            words.pop(0)
            while words and words[0].startswith("-"):
                words.pop(0)
        else:
            break
    judged = _assess_program(words, root) if words else _READS
    if as_root:
        rooted = Assessment(Reach.OUTWARD, "runs as root (sudo)", judged.destructive)
        return max(judged, rooted, key=_order)
    return judged


def _assess_program(words: list[str], root: str | None) -> Assessment:
    program = os.path.basename(words[0])
    args = words[1:]
    if program.startswith("python") and len(args) > 1 and args[0] == "-m":
        return _assess_program(args[1:], root)  # python -m twine upload …
    if program in {"rm", "rmdir", "shred", "unlink"}:
        return _assess_delete(program, args, root)
    if program == "git":
        return _assess_git(args)
    if program in _DISK_WRECKERS or program.startswith("mkfs."):
        return Assessment(Reach.CATASTROPHIC, f"rewrites a disk ({program})", destructive=True)
    if program == "dd" and any(a.startswith("of=/dev/") for a in args):
        return Assessment(Reach.CATASTROPHIC, "writes straight to a device (dd)", destructive=True)
    if program in _PUBLISHERS and args and args[0] in _PUBLISHERS[program]:
        return Assessment(Reach.OUTWARD, f"publishes a package ({program} {args[0]})")
    if program in {"gh"} and len(args) >= 2 and args[0] == "release":
        return Assessment(Reach.OUTWARD, "publishes a release (gh release)")
    if program in _UPLOADERS:
        return Assessment(Reach.OUTWARD, f"sends data over the network ({program})")
    if program == "rsync" and any(":" in a and not a.startswith("-") for a in args):
        return Assessment(Reach.OUTWARD, "sends data over the network (rsync)")
    if program in _FETCHERS and _curl_sends(args):
        return Assessment(Reach.OUTWARD, f"sends data over the network ({program})")
    if program in _SHELLS and args and args[0] == "-c" and len(args) > 1:
        return _assess_command(args[1], root)
    if program in _LOOKING or program in _FETCHERS:
        return _READS
    if program == "find":
        if any(a in {"-delete", "-exec", "-execdir", "-ok"} for a in args):
            return Assessment(Reach.WRITES, "changes files (find)", destructive="-delete" in args)
        return _READS
    for arg in args:
        if not arg.startswith("-") and _is_ci(arg, root) and program in {"cp", "mv", "tee", "sed"}:
            return Assessment(Reach.OUTWARD, f"changes a CI or deploy file ({arg})")
    if program in {"cp", "mv", "tee", "touch", "mkdir", "ln", "install", "chmod", "chown"}:
        targets = [a for a in args if not a.startswith("-")]
        if program in {"cp", "mv", "ln", "install"}:
            targets = targets[-1:]
        for target in targets:
            if _relative(target, root) is None:
                return Assessment(Reach.OUTWARD, f"writes outside the project folder ({target})")
    return Assessment(Reach.WRITES, "runs a command")


def _curl_sends(args: Sequence[str]) -> bool:
    for i, arg in enumerate(args):
        if arg.startswith(_CURL_SENDS) or arg.startswith(("--post-data", "--post-file")):
            return True
        following = args[i + 1].upper() if i + 1 < len(args) else ""
        if arg in {"-X", "--request", "--method"} and following in _SENDING_METHODS:
            return True
        if arg.startswith("-X") and arg[2:].upper() in _SENDING_METHODS:
            return True
    return False


def _assess_delete(program: str, args: Sequence[str], root: str | None) -> Assessment:
    recursive = program == "rm" and any(
        a in {"--recursive", "-r", "-R"}
        or (a.startswith("-") and not a.startswith("--") and ("r" in a or "R" in a))
        for a in args
    )
    targets = [a for a in args if not a.startswith("-") or a == "-"]
    outside = [t for t in targets if _relative(t, root) is None or _relative(t, root) == "."]
    shown = " ".join([program, *args])
    if outside and recursive:
        return Assessment(
            Reach.CATASTROPHIC,
            f"deletes outside the project folder ({_cut(shown)})",
            destructive=True,
        )
    if outside:
        return Assessment(
            Reach.OUTWARD, f"deletes outside the project folder ({_cut(shown)})", destructive=True
        )
    return Assessment(Reach.WRITES, f"deletes files ({_cut(shown)})", destructive=True)


def _assess_git(args: Sequence[str]) -> Assessment:
    rest = list(args)
    while rest and rest[0].startswith("-"):  # git -C dir …, git -c k=v …
        option = rest.pop(0)
        if option in {"-C", "-c"} and rest:
            rest.pop(0)
    if not rest:
        return _READS
    sub, params = rest[0], rest[1:]
    if sub in _LOOKING_GIT or (sub == "branch" and not params):
        return _READS
    if sub == "push":
        return _assess_push(params)
    if sub in {"reset", "clean", "checkout", "restore"} and any(
        p in {"--hard", "-f", "-fd", "-fdx", "-xdf", "-df", "--force", "."} for p in params
    ):
        return Assessment(Reach.WRITES, f"throws work away (git {sub})", destructive=True)
    return Assessment(Reach.WRITES, f"changes the repository (git {sub})")


def _assess_push(params: Sequence[str]) -> Assessment:
    force = any(
        p in {"-f", "--force", "--mirror"} or p.startswith(("--force-with-lease", "--force-if"))
        for p in params
    )
    deletes = any(p in {"-d", "--delete"} for p in params)
    positional = [p for p in params if not p.startswith("-")]
    refspecs = positional[1:]
    force = force or any(r.startswith("+") for r in refspecs)
    targets = {r.lstrip("+").rsplit(":", 1)[-1].removeprefix("refs/heads/") for r in refspecs}
    to_default = not refspecs or bool(targets & _DEFAULT_BRANCHES)
    if (force or deletes) and to_default:
        where = "the default branch" if refspecs else "the current branch (maybe the default one)"
        return Assessment(Reach.CATASTROPHIC, f"force-pushes to {where}", destructive=True)
    if force or deletes:
        return Assessment(Reach.OUTWARD, "force-pushes over a remote branch", destructive=True)
    return Assessment(Reach.OUTWARD, "pushes to a remote repository")


def _cut(text: str, most: int = 80) -> str:
    return text if len(text) <= most else text[: most - 1] + "…"
