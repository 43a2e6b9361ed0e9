"""The agent's walls: every agent turn runs under bubblewrap (``bwrap``).

Inside, the filesystem is read-only; the session's own folders (its worktree, the git
folder that worktree commits into, the CLI's per-run home) are writable; ``/tmp`` is a
private, empty one; the control plane — the database file and its folder, ``.env``, the
tasks root, the workspaces root, the runs folder, PostgreSQL's socket folders and every
path in ``TURNSTILE_SANDBOX_HIDE`` — is not there at all (an empty folder, or an empty
file, mounted over it). The agent gets its own PID namespace: it cannot see or signal the
bot, and everything it starts dies with the turn. Network stays on unless
``TURNSTILE_SANDBOX_NETWORK=false`` (the model API needs it). As root, every capability
is dropped, so the agent cannot undo the mounts.

Running agents unconfined is an operator's explicit choice (``TURNSTILE_SANDBOX=off``),
shown by ``turnstile doctor`` and ``/status``. Where ``bwrap`` is missing or cannot make
a sandbox (no user namespaces), :func:`walls_for` raises :class:`SandboxUnavailable` with
the fix, so no agent starts unconfined by accident. See ``docs/security.md``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Final
from urllib.parse import parse_qs, urlsplit

from engine.errors import ConfigError
from engine.store.location import PostgresURL

if TYPE_CHECKING:
    from engine.settings import Settings

__all__ = [
    "SandboxState",
    "SandboxUnavailable",
    "Walls",
    "agent_home",
    "control_plane_paths",
    "probe_sandbox",
    "sandbox_state",
    "walls_for",
]

_LOGGER = logging.getLogger(__name__)

# The uid an agent has inside when turnstile runs as root (mapped to root outside).
_SANDBOX_UID: Final = 1000
# Inside the walls /tmp is the sandbox's own, empty and private (a tmpfs).
_TMP: Final = "/tmp"  # noqa: S108

# Where PostgreSQL puts its Unix sockets on Debian and most distributions.
_PG_SOCKET_DIRS: Final = ("/var/run/postgresql", "/run/postgresql")
_FIX: Final = (
    "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install "
    "bubblewrap) and allow user namespaces (for the kernel, systemd and containers see "
    "docs/deploy.md, the agent sandbox in production), or set TURNSTILE_SANDBOX=off to run "
    "agents unconfined"
)


class SandboxUnavailable(ConfigError):
    """The agent sandbox is on but cannot be made here (``TURNSTILE_SANDBOX=off`` opts out)."""


@dataclass(frozen=True, slots=True)
class Walls:
    """What one agent session sees: the mounts of its sandbox.

    Attributes:
        bwrap: the bubblewrap program.
        hidden: control-plane paths that are not there inside (folders and files).
        writable: the session's own folders, writable inside (its cwd first).
        readable: paths shown read-only even inside a hidden folder (the CLI's install).
        network: whether the agent shares the machine's network.
        locked: paths inside the writable ones that stay read-only (git's control files:
            what turnstile's own git, outside the walls, reads and could be made to run).
    """

    bwrap: str
    hidden: tuple[Path, ...]
    writable: tuple[Path, ...]
    readable: tuple[Path, ...] = ()
    network: bool = True
    locked: tuple[Path, ...] = ()

    def adding(self, *, writable: Iterable[Path] = (), readable: Iterable[Path] = ()) -> Walls:
        """These walls with more paths shown (a turn's own sockets, say)."""
        return replace(
            self,
            writable=(*self.writable, *writable),
            readable=(*self.readable, *readable),
        )

    def wrap(self, argv: Sequence[str], cwd: Path | None = None) -> list[str]:
        """``argv`` run inside these walls, in ``cwd`` (each element still one argument)."""
        args = [
            self.bwrap,
            "--ro-bind", "/", "/",
            "--dev", "/dev",
            "--proc", "/proc",
            "--tmpfs", _TMP,
        ]  # fmt: skip
        shown = [*self.readable, *self.writable]
        hidden = [p for p in self.hidden if p != Path("/")]
        args += _hide(hidden)
        for path in self.readable:
            if path.exists():
                args += ["--ro-bind", str(path), str(path)]
        for path in self.writable:
            if path.exists():
                args += ["--bind", str(path), str(path)]
        for path in self.locked:
            if path.exists():
                # A mount point cannot be renamed or removed, so neither can be swapped.
                args += ["--ro-bind", str(path), str(path)]
        # A control-plane path inside a folder shown again (a database in the worktree)
        # stays hidden: later mounts win.
        args += _hide([h for h in hidden if any(_inside(h, s) and h != s for s in shown)])
        args += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if not self.network:
            args.append("--unshare-net")
        if _is_root():
            # Root keeps its capabilities in a sandbox unless told: without them it cannot
            # unmount what hides the control plane. In a user namespace of its own, as an
            # ordinary uid (files it writes are still the host's root's), so a CLI's own
            # bubblewrap (Codex's) can still map its uid; an unprivileged bwrap does this
            # by itself.
            args += ["--unshare-user", "--uid", str(_SANDBOX_UID), "--gid", str(_SANDBOX_UID)]
            args += ["--cap-drop", "ALL"]
        args.append("--die-with-parent")
        if cwd is not None:
            args += ["--chdir", str(cwd)]
        args.append("--")
        args += list(argv)
        return args


def _hide(paths: Iterable[Path]) -> list[str]:
    args: list[str] = []
    for path in paths:
        if path.is_dir():
            args += ["--tmpfs", str(path)]
        elif path.exists():
            args += ["--ro-bind", "/dev/null", str(path)]
    return args


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _resolved(path: Path) -> Path:
    return Path(os.path.realpath(path.expanduser()))


def control_plane_paths(settings: Settings) -> tuple[Path, ...]:
    """What an agent must never see: the database (and its folder), ``.env``, turnstile's
    roots, PostgreSQL's sockets and ``TURNSTILE_SANDBOX_HIDE``."""
    found: list[Path] = []
    database = settings.database
    if isinstance(database, PostgresURL):
        found += _pg_socket_dirs(database)
    else:
        db = _resolved(database)
        found += [db, Path(f"{db}-wal"), Path(f"{db}-shm"), Path(f"{db}-journal"), db.parent]
    found.append(_resolved(Path(".env")))
    found += [_resolved(settings.tasks_root), _resolved(settings.workspaces)]
    found.append(_resolved(settings.runs_dir))
    found += [_resolved(Path(p)) for p in _PG_SOCKET_DIRS]
    found += [_resolved(p) for p in settings.sandbox_hide]
    return tuple(dict.fromkeys(found))


def _pg_socket_dirs(url: PostgresURL) -> list[Path]:
    hosts = [url.host or ""]
    hosts += parse_qs(urlsplit(url.conninfo()).query).get("host", [])
    return [_resolved(Path(h)) for h in hosts if h.startswith("/")]


def agent_home(settings: Settings, cwd: Path) -> Path:
    """The per-run home of the agent CLI working in ``cwd`` (its config and sessions).

    Made on first use and seeded with the CLIs' sign-in files from the real home (a
    ``claude login``, ``codex login`` keeps working); the agent may read them anyway,
    since its CLI needs them.
    """
    key = hashlib.sha256(str(_resolved(cwd)).encode()).hexdigest()[:24]
    home = _resolved(settings.runs_dir) / "agent-homes" / key
    if not home.is_dir():
        home.mkdir(parents=True, mode=0o700)
        _seed(home)
    return home


# The sign-in files of each CLI, relative to the real home and to the per-run home.
_SIGN_IN: Final = (
    (".claude/.credentials.json", ".credentials.json"),
    (".codex/auth.json", ".codex/auth.json"),
    (".codex/config.toml", ".codex/config.toml"),
    (".copilot/config.json", "config.json"),
)


def _seed(home: Path) -> None:
    real = Path.home()
    for source, target in _SIGN_IN:
        src = real / source
        if src.is_file():
            dst = home / target
            dst.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            shutil.copyfile(src, dst)
            dst.chmod(0o600)


def _git_dirs(cwd: Path) -> tuple[list[Path], list[Path]]:
    """The git folders a repository or worktree in ``cwd`` writes (objects, refs, index),
    and its control files, which stay read-only: the config (a program it names runs when
    turnstile's own git, outside the walls, works in the tree), the hooks, and the links
    that say which folder is the repository."""
    dot = cwd / ".git"
    if dot.is_dir():
        # The folder itself is bound too: a mount point cannot be renamed out of the way.
        return [_resolved(dot)], [_resolved(dot / name) for name in ("config", "hooks")]
    if not dot.is_file():
        return [], []
    try:
        line = dot.read_text(encoding="utf-8").strip()
    except OSError:
        return [], []
    if not line.startswith("gitdir:"):
        return [], []
    gitdir = Path(line.removeprefix("gitdir:").strip())
    if not gitdir.is_absolute():
        gitdir = cwd / gitdir
    gitdir = _resolved(gitdir)
    writable = [gitdir]
    locked = [_resolved(dot), gitdir / "commondir", gitdir / "gitdir", gitdir / "config.worktree"]
    try:
        shared = Path((gitdir / "commondir").read_text(encoding="utf-8").strip())
    except OSError:
        return writable, locked
    common = _resolved(shared if shared.is_absolute() else gitdir / shared)
    writable.append(common)
    locked += [common / "config", common / "hooks"]
    return writable, locked


def _program_paths(binary: str, program: Sequence[str]) -> list[Path]:
    """What the agent's program needs to be seen: the CLI's install (a node package's
    ``node_modules``, else its folder), the folder it was found in (a link to it), the
    virtual environment an interpreter belongs to, and the files its command names."""
    found: list[Path] = []
    located = shutil.which(binary)
    words = [Path(w) for w in program if w.startswith("/") and Path(w).is_file()]
    if located is not None:
        link = Path(os.path.abspath(located))
        found.append(link.parent)
        real = _resolved(link)
        roots = [parent for parent in real.parents if parent.name == "node_modules"]
        found.append(roots[0] if roots else real.parent)
        words.append(link)
    # The operator's command (the template's fixed words, never a prompt): its script,
    # and the virtual environment an interpreter there belongs to.
    for word in words:
        found.append(Path(os.path.abspath(word)))
        if (word.parent.parent / "pyvenv.cfg").is_file():
            found.append(Path(os.path.abspath(word.parent.parent)))
    return found


@functools.cache
def probe_sandbox(bwrap: str) -> str | None:
    """Why ``bwrap`` cannot make an agent's sandbox here (None: it can).

    Tried once per process: a real sandbox like an agent's runs ``true``.
    """
    walls = Walls(bwrap=bwrap, hidden=(), writable=())
    try:
        done = subprocess.run(
            walls.wrap(["true"]), capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{bwrap} could not run: {exc}"
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        return f"{bwrap} cannot make a sandbox here: {said[-1] if said else done.returncode}"
    return None


@dataclass(frozen=True, slots=True)
class SandboxState:
    """Whether agents run confined here, in words (``fix``: how to confine them)."""

    confined: bool
    detail: str
    fix: str | None = None


def sandbox_state(settings: Settings) -> SandboxState:
    """Whether agents run confined here, and a sentence that says so (or why not)."""
    if settings.sandbox == "off":
        return SandboxState(
            False,
            "agents run unconfined (TURNSTILE_SANDBOX=off): an agent can read the database "
            "and .env and act as the bot",
            "install bubblewrap and remove TURNSTILE_SANDBOX=off",
        )
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return SandboxState(False, "bubblewrap (bwrap) is not installed", _FIX)
    problem = probe_sandbox(bwrap)
    if problem is not None:
        return SandboxState(False, problem, _FIX)
    network = "with network" if settings.sandbox_network else "without network"
    return SandboxState(True, f"agents run in a bubblewrap sandbox ({bwrap}, {network})")


def walls_for(
    settings: Settings,
    *,
    cwd: Path,
    home: Path | None = None,
    binary: str | None = None,
    program: Sequence[str] = (),
) -> Walls | None:
    """The walls of an agent session working in ``cwd`` (None: the sandbox is off).

    ``binary`` is the agent's program and ``program`` the fixed words of its command: those
    of them inside a hidden folder or the host's ``/tmp`` are shown read-only (what they
    hold of the control plane stays hidden).

    Raises:
        SandboxUnavailable: the sandbox is on, and bwrap is missing or cannot make one.
    """
    if settings.sandbox == "off":
        return None
    state = sandbox_state(settings)
    if not state.confined:
        raise SandboxUnavailable(
            f"agents run in a sandbox, and it cannot be made here ({state.detail}); {state.fix}"
        )
    bwrap = shutil.which("bwrap")
    assert bwrap is not None
    hidden = control_plane_paths(settings)
    git_writable, git_locked = _git_dirs(cwd)
    writable = [_resolved(cwd), *git_writable]
    if home is not None:
        writable.append(_resolved(home))
    readable: list[Path] = []
    # (A control-plane path inside one of them is hidden again: Walls.wrap.)
    for path in _program_paths(binary, program) if binary else []:
        if any(_inside(path, h) for h in (*hidden, Path(_TMP))):
            readable.append(path)
    # One mount for a folder and what is in it (a link inside is shown with it).
    readable = [p for p in readable if not any(p != q and _inside(p, q) for q in readable)]
    return Walls(
        bwrap=bwrap,
        hidden=hidden,
        writable=tuple(dict.fromkeys(writable)),
        readable=tuple(dict.fromkeys(readable)),
        network=settings.sandbox_network,
        locked=tuple(git_locked),
    )
