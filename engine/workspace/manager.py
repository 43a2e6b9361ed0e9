"""The workspace manager: clone cache, a worktree per run, sub-task waves, cleanup.

Long: clone cache, worktrees, waves and cleanup share the per-repository locks and the
workspace rows; the git runner and the store are already separate modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Final

from engine.errors import ConfigError, GitError
from engine.git import GitRunner
from engine.locks import FileLock, hold
from engine.redact import Redactor
from engine.runs.spec import PlaceId
from engine.workspace.errors import WorkspaceBusyError, WorkspaceError, WorkspaceStateError
from engine.workspace.projects import (
    Project,
    ProjectError,
    check_unique,
    is_repository_reference,
    is_safe_name,
    redact_url,
    repository_project,
)
from engine.workspace.store import MemoryWorkspaceStore, Workspace, WorkspaceStore

if TYPE_CHECKING:
    from engine.settings import Settings

__all__ = [
    "BRANCH_PREFIX",
    "DEFAULT_PROJECT",
    "RESCUE_PREFIX",
    "RESERVED_FOLDERS",
    "BranchPush",
    "CleanupReport",
    "MergeOutcome",
    "MergeReport",
    "SubtaskMerge",
    "WorkspaceManager",
    "WorkspaceStatus",
    "disk_usage",
    "format_size",
    "place_workspace_name",
    "run_branch",
    "subtask_workspace_id",
]

_LOGGER = logging.getLogger(__name__)

BRANCH_PREFIX: Final = "turnstile/"


def run_branch(run_id: str) -> str:
    """The branch of run ``run_id`` (its worktree's, and the one pushed to the runs remote)."""
    return f"{BRANCH_PREFIX}{run_id}"


RESCUE_PREFIX: Final = "turnstile/rescue/"
# The layout under the workspaces root (see the package docstring): the only place the
# folder names are spelled. Front ends ask RESERVED_FOLDERS before using a name of theirs.
CACHE_DIR: Final = "cache"
WORKTREES_DIR: Final = "worktrees"
LOCKS_DIR: Final = "locks"
# Each chat's (and forum topic's) own workspace: under a folder of the manager's, so no
# chat can name another chat's workspace as a project.
CHATS_DIR: Final = "chats"
RESERVED_FOLDERS: Final = frozenset({CACHE_DIR, WORKTREES_DIR, LOCKS_DIR, CHATS_DIR})
#: The project of a chat that has none bound: that chat's (or topic's) own workspace.
DEFAULT_PROJECT: Final = "default"
_SUB_SEP: Final = "--"
_MAX_COMMITS: Final = 500
_FETCH_REFSPEC: Final = "+refs/heads/*:refs/remotes/origin/*"
_ID: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_DEFAULT_IDENTITY: Final = ("-c", "user.name=turnstile", "-c", "user.email=turnstile@localhost")


class MergeOutcome(StrEnum):
    MERGED = "merged"
    UP_TO_DATE = "up_to_date"
    CONFLICT = "conflict"
    BUSY = "busy"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class SubtaskMerge:
    """How one sub-task's branch went into its parent's branch.

    Attributes:
        workspace: the sub-task's workspace id.
        name: the sub-task name.
        branch: the sub-task's branch.
        outcome: merged, already contained (up_to_date), conflict, busy or failed.
        commit: the parent's head after the merge, when merged.
        conflicts: files with conflicts, when the outcome is ``conflict``.
        uncommitted: the sub-task worktree had uncommitted changes (they were not merged).
        detail: a redacted explanation when the outcome is ``failed`` or ``busy``.
    """

    workspace: str
    name: str
    branch: str
    outcome: MergeOutcome
    commit: str | None = None
    conflicts: tuple[str, ...] = ()
    uncommitted: bool = False
    detail: str = ""


@dataclass(frozen=True, slots=True)
class MergeReport:
    """The result of merging a wave's sub-task branches back into the parent branch."""

    parent: str
    branch: str
    results: tuple[SubtaskMerge, ...]
    head: str

    @property
    def merged(self) -> tuple[SubtaskMerge, ...]:
        return tuple(
            r for r in self.results if r.outcome in (MergeOutcome.MERGED, MergeOutcome.UP_TO_DATE)
        )

    @property
    def conflicted(self) -> tuple[SubtaskMerge, ...]:
        return tuple(r for r in self.results if r.outcome is MergeOutcome.CONFLICT)

    @property
    def not_merged(self) -> tuple[SubtaskMerge, ...]:
        """Sub-tasks that need a person: conflicts, busy worktrees, failures."""
        return tuple(r for r in self.results if r not in self.merged)


@dataclass(frozen=True, slots=True)
class CleanupReport:
    """What :meth:`WorkspaceManager.cleanup` did.

    Attributes:
        removed: ids of workspaces whose folders were removed.
        rescued: workspace id → rescue branch holding its uncommitted changes.
        busy: ids skipped because a run still holds them.
        kept: ids not finished long enough ago (or not finished).
        errors: workspace id → redacted error; those folders were left in place.
    """

    removed: tuple[str, ...] = ()
    rescued: dict[str, str] = dataclasses.field(default_factory=dict)
    busy: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    errors: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BranchPush:
    """Where a run's branch went: pushed back to ``to``, kept here, or why not pushed."""

    branch: str
    #: The repository it went to (shown: no credentials); None when not pushed.
    to: str | None = None
    #: Why it was not pushed (None: pushed, or turned off).
    problem: str | None = None

    def line(self) -> str:
        """``Branch: turnstile/r1, pushed to /srv/git/web`` (or why it was not)."""
        if self.to is not None and self.problem is None:
            return f"Branch: {self.branch}, pushed to {self.to}"
        if self.problem is not None:
            return f"Branch: {self.branch}, not pushed: {self.problem}"
        return (
            f"Branch: {self.branch}, kept in turnstile's clone (pushing branches back is "
            "turned off: TURNSTILE_PUSH_BRANCHES)"
        )


@dataclass(frozen=True, slots=True)
class WorkspaceStatus:
    """What the completion verifier and the audit read from a worktree.

    Attributes:
        head: the commit checked out.
        branch: the branch checked out (None when detached).
        dirty: uncommitted changes (tracked or untracked, ignored files aside).
        changed: the paths with uncommitted changes.
        commits: ``sha subject`` of each commit since the workspace's base, newest first
            (at most 500).
    """

    head: str
    branch: str | None
    dirty: bool
    changed: tuple[str, ...]
    commits: tuple[str, ...]


def disk_usage(path: Path) -> int:
    """Bytes allocated on disk under ``path`` (symlinks not followed, hard links once)."""
    total = 0
    seen: set[tuple[int, int]] = set()
    stack = [path]
    while stack:
        folder = stack.pop()
        try:
            entries = os.scandir(folder)
        except OSError:
            continue
        with entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(Path(entry.path))
                except OSError:
                    continue
                if st.st_nlink > 1:
                    key = (st.st_dev, st.st_ino)
                    if key in seen:
                        continue
                    seen.add(key)
                total += st.st_blocks * 512
    return total


def _parent_of(workspace_id: str) -> str | None:
    return workspace_id.rsplit(_SUB_SEP, 1)[0] if _SUB_SEP in workspace_id else None


async def _is_dir(path: Path) -> bool:
    return await asyncio.to_thread(path.is_dir)


def _same_source(a: Project, b: Project) -> bool:
    """Whether two projects point at the same repository (same URL, or same folder)."""
    if a.url == b.url:
        return True
    pa, pb = a.local_path, b.local_path
    if pa is None or pb is None:
        return False
    try:
        return pa.resolve() == pb.resolve()
    except OSError:
        return False


def format_size(size: int) -> str:
    """Bytes as a short human figure (``44.2 MB``)."""
    value = float(size)
    for unit in ("B", "kB", "MB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"


def _check_id(value: str, what: str) -> str:
    if (
        not isinstance(value, str)
        or not _ID.match(value)
        or ".." in value
        or value.endswith(".lock")
        or _SUB_SEP in value
        or value == "rescue"
    ):
        raise ConfigError(
            f"invalid {what} {value!r}: use 1-128 letters, digits, '.', '_' or '-', starting "
            "with a letter or digit (no '/', '..', '--' or spaces)"
        )
    return value


def place_workspace_name(chat_id: PlaceId, thread_id: PlaceId | None = None) -> str:
    """The name of a chat's own workspace (folder, clone and worktrees): ``chat_-1001234``,
    or ``chat_-1001234_topic_7`` for a forum topic; the sign stays, so no two chats share
    one. The only place that spells it.

    An id of letters and digits (single hyphens between them) or a signed number (Telegram's)
    is kept as it is; any other id (spaces, slashes, dots, underscores, a long one) is
    written as ``.`` and a digest of it, so no id reaches outside the folder of chats and no
    two places share one name.
    """
    topic = f"_topic_{_place_piece(thread_id)}" if thread_id else ""
    return f"chat_{_place_piece(chat_id)}{topic}"


_PLAIN_PLACE: Final = re.compile(r"-?[0-9]{1,40}|[A-Za-z0-9]{1,40}(?:-[A-Za-z0-9]{1,40}){0,4}")


def _place_piece(value: PlaceId) -> str:
    if _PLAIN_PLACE.fullmatch(value) and len(value) <= 48:
        return value
    return "." + hashlib.blake2b(value.encode(), digest_size=12).hexdigest()


def subtask_workspace_id(parent_id: str, name: str) -> str:
    """The id of sub-task ``name``'s workspace under the workspace ``parent_id``:
    ``PARENT--NAME`` (its branch is ``turnstile/PARENT--NAME``). A sub-task of a sub-task
    nests the same way (``run--a--b``). The only place that joins them.

    Raises:
        ConfigError: ``name`` is not a valid id (``/``, ``..``, ``--``, spaces, ...).
    """
    return f"{parent_id}{_SUB_SEP}{_check_id(name, 'sub-task name')}"


class WorkspaceManager:
    """Gives each run (and each sub-task of a wave) its own git worktree and branch.

    Args:
        root: folder holding ``cache/`` (one bare clone per project), ``worktrees/`` and
            ``locks/``; usually ``settings.workspaces``.
        projects: the configured projects.
        store: where workspaces are recorded (default: in memory).
        git: the git binary.
        retention: seconds a finished run's worktree is kept before :meth:`cleanup`.
        clock: wall clock, for records and retention.
    """

    def __init__(
        self,
        root: Path,
        projects: Iterable[Project],
        *,
        store: WorkspaceStore | None = None,
        git: str = "git",
        retention: float = 72 * 3600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = Path(root).expanduser().resolve()
        found = check_unique(projects)
        self._projects = {p.name: p for p in found}
        secrets = [s for p in found for s in p.secrets()]
        self.redact = Redactor(secrets)
        self._git = GitRunner(binary=git, redactor=self.redact)
        self._store: WorkspaceStore = store if store is not None else MemoryWorkspaceStore()
        self.retention = retention
        self._clock = clock
        self._held: dict[str, FileLock] = {}
        self._identity: tuple[str, ...] | None = None
        # Repositories given by URL or path rather than configured (see project_for).
        self._unconfigured: set[str] = set()

    @classmethod
    def from_settings(
        cls, settings: Settings, *, store: WorkspaceStore | None = None
    ) -> WorkspaceManager:
        """A manager for ``settings.workspaces`` and ``settings.projects``.

        Raises:
            ProjectError: ``TURNSTILE_PROJECTS`` is malformed.
        """
        from engine.workspace.projects import parse_projects

        raw = settings.projects.get_secret_value() if settings.projects is not None else None
        return cls(
            settings.workspaces,
            parse_projects(raw),
            store=store,
            retention=settings.workspace_retention_hours * 3600.0,
        )

    # ----------------------------------------------------------------- projects

    @property
    def projects(self) -> tuple[Project, ...]:
        return tuple(self._projects.values())

    def resolve_project(self, name: str) -> Project:
        """The project called ``name``.

        Raises:
            ProjectError: the name is malformed or no project has it.
        """
        if not is_safe_name(name):
            raise ProjectError(
                f"invalid project name {name!r}: use letters, digits, '.', '_' or '-' "
                "(no '/', '..' or spaces)"
            )
        try:
            return self._projects[name]
        except KeyError:
            known = ", ".join(sorted(self._projects)) or "none configured; set TURNSTILE_PROJECTS"
            raise ProjectError(f"unknown project {name!r} (known: {known})") from None

    def project_for(self, reference: str, *, cwd: Path | None = None) -> Project:
        """The project ``reference`` names: a configured project's name, or a repository
        given by git URL or path, registered with this manager under the repository's name
        (its credentials join the redactor, so git errors never show them).

        A repository that a configured project already points at is that project.

        Raises:
            ProjectError: an unknown name; a path that is not a folder; a repository whose
                name a configured project (or an earlier, different repository) holds.
        """
        if not is_repository_reference(reference):
            if reference in self._projects:
                return self._projects[reference]
            known = ", ".join(sorted(self._projects)) or "none configured"
            raise ProjectError(
                f"unknown project {reference!r} (known: {known}); a repository that is not "
                "configured can be given by its git URL or path (e.g. ./" + reference + ")"
            )
        project = repository_project(reference, cwd=cwd)
        for configured in self._projects.values():
            if _same_source(configured, project):
                return configured
        taken = self._projects.get(project.name)
        if taken is not None:
            raise ProjectError(
                f"{project.display_url} would be named {project.name!r}, but project "
                f"{project.name!r} is {taken.display_url}: use --checkout-repo "
                f"{project.name} for that one, or configure this repository under another "
                "name in TURNSTILE_PROJECTS"
            )
        self._projects[project.name] = project
        self._unconfigured.add(project.name)
        self.redact = self.redact.with_secrets(project.secrets())
        self._git.redactor = self.redact
        return project

    def cache_path(self, project: str) -> Path:
        """The bare clone of ``project``."""
        return self.root / CACHE_DIR / f"{project}.git"

    def plain_folder(self, name: str) -> Path:
        """The folder ``name`` under the root, for a run on no configured project.

        Raises:
            ConfigError: ``name`` is one of the manager's own folders.
        """
        if name in RESERVED_FOLDERS:
            raise ConfigError(f"{name!r} is reserved for the workspace manager")
        return (self.root / name).resolve()

    async def plain_repository(self, name: str) -> Path:
        """:meth:`plain_folder`, made a git repository with a first commit when it is new.

        Completion is judged on commits and a clean tree: in a folder that is not a
        repository no claim of completion could ever be accepted. A folder that already
        holds files and is no repository is left as it is (the front end says why a run
        there cannot be verified).

        Raises:
            ConfigError: ``name`` is reserved.
            GitError: git failed.
        """
        return await self._repository(self.plain_folder(name))

    def place_folder(self, chat_id: PlaceId, thread_id: PlaceId | None = None) -> Path:
        """The folder of the chat's (or forum topic's) own workspace."""
        return self.root / CHATS_DIR / place_workspace_name(chat_id, thread_id)

    async def place_repository(self, chat_id: PlaceId, thread_id: PlaceId | None = None) -> Path:
        """The chat's (or topic's) own workspace, a git repository made on first use (as
        :meth:`plain_repository` makes one): where its chat sessions work."""
        return await self._repository(self.place_folder(chat_id, thread_id))

    async def place_project(self, chat_id: PlaceId, thread_id: PlaceId | None = None) -> Project:
        """The chat's own workspace as a project: each run on it gets a worktree of its own
        (:meth:`provision`), cut from the workspace's branch, as on a configured project.

        Raises:
            ProjectError: a configured project has the workspace's name.
            GitError: git failed.
        """
        path = await self.place_repository(chat_id, thread_id)
        name = place_workspace_name(chat_id, thread_id)
        if name in self._projects and name not in self._unconfigured:
            raise ProjectError(
                f"the project {name!r} in TURNSTILE_PROJECTS has the name of this chat's own "
                "workspace; rename that project"
            )
        return Project(name=name, url=str(path))

    async def _repository(self, path: Path) -> Path:
        await asyncio.to_thread(path.mkdir, parents=True, exist_ok=True)
        if (path / ".git").exists() or await asyncio.to_thread(_has_entries, path):
            return path
        await self._git.run(["init", "--quiet", str(path)])
        if await self._identity_args(path):
            # No identity anywhere: the agent's own commits would fail too.
            for key, value in (("user.name", "turnstile"), ("user.email", "turnstile@localhost")):
                await self._git.run(["config", key, value], cwd=path)
        await self._git.run(
            ["commit", "--quiet", "--allow-empty", "-m", "turnstile: a new workspace"], cwd=path
        )
        _LOGGER.info("workspace folder %s made a git repository", path)
        return path

    def worktree_path(self, project: str, workspace_id: str) -> Path:
        return self.root / WORKTREES_DIR / project / workspace_id

    def _lock_path(self, kind: str, key: str) -> Path:
        return self.root / LOCKS_DIR / f"{key}.{kind}.lock"

    # -------------------------------------------------------------- provisioning

    async def provision(
        self, run_id: str, project: str | Project, *, branch: str | None = None
    ) -> Workspace:
        """The run's worktree on ``turnstile/<run_id>``, made if needed.

        The first run of a project clones it into the cache; later runs fetch. The branch
        is cut from ``branch`` (default: the project's default branch). Calling it again
        for the same run (after a crash, say) returns the same worktree untouched.

        Raises:
            ConfigError: bad run id; ``ProjectError`` for an unknown project, a local path
                that is not a repository, or a branch the remote does not have.
            GitError: git failed (``DiskFullError`` when the disk is full).
        """
        _check_id(run_id, "run id")
        proj = self.resolve_project(project) if isinstance(project, str) else project
        return await self._provision(run_id, run_id, proj, parent=None, branch=branch)

    async def provision_subtask(self, parent: Workspace, name: str) -> Workspace:
        """A sub-task's worktree on ``<parent branch>--<name>``, cut from the parent's branch.

        Only the parent's commits are in it, not its uncommitted changes.
        """
        workspace_id = subtask_workspace_id(parent.id, name)
        proj = self._projects.get(parent.project)
        if proj is None and await _is_dir(self.cache_path(parent.project)):
            # A repository given by URL or path when the run started: only its clone is
            # needed, since a sub-task branches off the parent's branch in it.
            proj = Project(name=parent.project, url=str(self.cache_path(parent.project)))
        if proj is None:
            proj = self.resolve_project(parent.project)
        return await self._provision(workspace_id, parent.run_id, proj, parent=parent, branch=None)

    @contextlib.asynccontextmanager
    async def checkout(
        self, run_id: str, project: str | Project, *, branch: str | None = None
    ) -> AsyncIterator[Workspace]:
        """Provision the run's worktree and hold its lock while the body runs."""
        workspace = await self.provision(run_id, project, branch=branch)
        async with self.lock(workspace):
            yield workspace

    @contextlib.asynccontextmanager
    async def lock(self, workspace: Workspace) -> AsyncIterator[Workspace]:
        """Hold ``workspace`` exclusively: another holder, here or in any process, is refused.

        Raises:
            WorkspaceBusyError: somebody holds it already.
        """
        if workspace.id in self._held:
            raise WorkspaceBusyError(
                f"workspace {workspace.id} is already in use in this process",
            )
        async with self._guard(workspace):
            yield workspace

    @contextlib.asynccontextmanager
    async def _guard(self, workspace: Workspace) -> AsyncIterator[None]:
        """Hold the lock unless this manager already does (the caller is its holder)."""
        if workspace.id in self._held:
            yield
            return
        lock = FileLock(self._lock_path("use", workspace.id))
        if not await lock.try_acquire():
            holder = await lock.holder()
            raise WorkspaceBusyError(
                f"workspace {workspace.id} is in use by another run"
                + (f" (pid {holder})" if holder else ""),
            )
        self._held[workspace.id] = lock
        try:
            yield
        finally:
            del self._held[workspace.id]
            await lock.release()

    async def _provision(
        self,
        workspace_id: str,
        run_id: str,
        project: Project,
        *,
        parent: Workspace | None,
        branch: str | None,
    ) -> Workspace:
        branch_name = f"{BRANCH_PREFIX}{workspace_id}"
        path = self.worktree_path(project.name, workspace_id)
        cache = self.cache_path(project.name)
        async with hold(FileLock(self._lock_path("provision", workspace_id))):
            record = await self._store.get(workspace_id)
            if record is not None and record.project != project.name:
                raise WorkspaceStateError(
                    f"{workspace_id} already has a workspace on project {record.project!r}",
                )
            if path.exists():
                found = await self._existing(record, path, cache, workspace_id)
                if found is not None:
                    return found
            async with hold(FileLock(self._lock_path("cache", project.name))):
                if parent is None:
                    await self._ensure_cache(project, cache)
                    base_ref, base = await self._resolve_base(project, cache, branch)
                else:
                    base_ref = parent.branch
                    base = await self._rev(cache, f"refs/heads/{parent.branch}")
                exists = await self._ref_exists(cache, f"refs/heads/{branch_name}")
                if exists:
                    # Resuming a run whose folder was removed: its branch carries its work.
                    await self._git.run(["worktree", "prune"], cwd=cache)
                    if record is not None:
                        base_ref, base = record.base_ref, record.base
                await self._add_worktree(cache, path, branch_name, base, new=not exists)
            workspace = Workspace(
                id=workspace_id,
                run_id=run_id,
                project=project.name,
                path=path,
                branch=branch_name,
                base=base,
                base_ref=base_ref,
                parent_id=parent.id if parent is not None else None,
                created_at=record.created_at if record is not None else self._clock(),
            )
            await self._store.save(workspace)
        _LOGGER.info(
            "workspace %s ready on %s (%s from %s)",
            workspace_id,
            project.name,
            branch_name,
            base_ref,
            extra={"run_id": run_id},
        )
        return workspace

    async def _existing(
        self, record: Workspace | None, path: Path, cache: Path, workspace_id: str
    ) -> Workspace | None:
        """The workspace already at ``path``, or None after clearing a half-made one."""
        if await self._is_worktree_of(path, cache):
            if record is not None and record.removed_at is None:
                return record
            # Made by a process that died before recording it: adopt it as it is.
            head = await self._rev(path, "HEAD")
            adopted = Workspace(
                id=workspace_id,
                run_id=record.run_id if record else workspace_id.split(_SUB_SEP)[0],
                project=record.project if record else path.parent.name,
                path=path,
                branch=f"{BRANCH_PREFIX}{workspace_id}",
                base=record.base if record else head,
                base_ref=record.base_ref if record else "HEAD",
                parent_id=record.parent_id if record else _parent_of(workspace_id),
                created_at=record.created_at if record else self._clock(),
            )
            await self._store.save(adopted)
            return adopted
        if record is not None and record.removed_at is None:
            raise WorkspaceStateError(
                f"{path} should be the worktree of {workspace_id} but git does not know it; "
                "nothing was changed, inspect it by hand",
            )
        _LOGGER.warning("removing a half-made worktree of %s left by a crash", workspace_id)
        async with hold(FileLock(self._lock_path("cache", path.parent.name))):
            await self._discard(cache, path)
        return None

    async def _is_worktree_of(self, path: Path, cache: Path) -> bool:
        if not await _is_dir(path):
            return False
        result = await self._git.run(
            ["rev-parse", "--path-format=absolute", "--git-common-dir", "--show-toplevel"],
            cwd=path,
            check=False,
            # Never mistake an enclosing repository for this worktree.
            env={"GIT_CEILING_DIRECTORIES": str(path.parent)},
        )
        lines = result.lines
        if result.exit_code != 0 or len(lines) != 2:
            return False
        return Path(lines[0]) == cache and Path(lines[1]) == path

    async def _discard(self, cache: Path, path: Path) -> None:
        has_cache = await _is_dir(cache)
        if has_cache:
            await self._git.run(
                ["worktree", "remove", "--force", "--force", str(path)], cwd=cache, check=False
            )
        await asyncio.to_thread(shutil.rmtree, path, True)
        if has_cache:
            await self._git.run(["worktree", "prune"], cwd=cache, check=False)

    async def _ensure_cache(self, project: Project, cache: Path) -> None:
        """Clone ``project`` into the cache, or fetch if it is there (cache lock held)."""
        local = project.local_path
        if await _is_dir(cache) and project.name in self._unconfigured:
            await self._check_same_repository(project, cache)
        if await _is_dir(cache):
            # The URL from the settings, not the one stored at clone time: a rotated token
            # or a moved repository takes effect on the next run.
            source = project.url if local is None else str(await asyncio.to_thread(local.resolve))
            await self._git.run(
                ["fetch", "--prune", "--quiet", "--", source, _FETCH_REFSPEC], cwd=cache
            )
            return
        cache.parent.mkdir(parents=True, exist_ok=True)
        for stale in cache.parent.glob(f".{project.name}.partial-*"):
            await asyncio.to_thread(shutil.rmtree, stale, True)
        source = project.url
        if local is not None:
            source = str(await self._check_local_repo(project, local))
        partial = cache.parent / f".{project.name}.partial-{uuid.uuid4().hex[:8]}"
        _LOGGER.info("cloning project %s from %s", project.name, project.display_url)
        try:
            await self._git.run(["clone", "--bare", "--quiet", "--", source, str(partial)])
            await self._git.run(["config", "remote.origin.fetch", _FETCH_REFSPEC], cwd=partial)
            # Background gc would outlive the command that triggered it.
            await self._git.run(["config", "gc.autoDetach", "false"], cwd=partial)
            await self._git.run(["fetch", "--quiet", "origin"], cwd=partial)
            partial.rename(cache)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(shutil.rmtree, partial, True))
            raise

    async def _check_same_repository(self, project: Project, cache: Path) -> None:
        """A repository given by URL or path must be the one its name was cloned from."""
        local = project.local_path
        source = project.url if local is None else str(await asyncio.to_thread(local.resolve))
        found = await self._git.run(
            ["config", "--get", "remote.origin.url"], cwd=cache, check=False
        )
        if found.stdout.strip() != source:
            raise ProjectError(
                f"another repository was checked out as {project.name!r} before "
                f"({self.redact(redact_url(found.stdout.strip()))}); configure "
                f"{project.display_url} under another name in TURNSTILE_PROJECTS"
            )

    async def _check_local_repo(self, project: Project, local: Path) -> Path:
        path = await asyncio.to_thread(local.resolve)
        if not await _is_dir(path):
            raise ProjectError(
                f"project {project.name!r}: {self.redact(str(local))} is not a folder",
            )
        result = await self._git.run(
            ["rev-parse", "--git-dir"],
            cwd=path,
            check=False,
            env={"GIT_CEILING_DIRECTORIES": str(path.parent)},
        )
        if result.exit_code != 0:
            raise ProjectError(
                f"project {project.name!r}: {self.redact(str(local))} is not a git repository",
            )
        return path

    async def _resolve_base(
        self, project: Project, cache: Path, branch: str | None
    ) -> tuple[str, str]:
        name = branch or project.branch
        if name is None:
            head = await self._git.run(["symbolic-ref", "--quiet", "--short", "HEAD"], cwd=cache)
            name = head.stdout.strip()
        found = await self._git.run(
            ["rev-parse", "--verify", "--quiet", f"refs/remotes/origin/{name}^{{commit}}"],
            cwd=cache,
            check=False,
        )
        if found.exit_code != 0:
            listing = await self._git.run(
                ["for-each-ref", "--format=%(refname:lstrip=3)", "refs/remotes/origin"], cwd=cache
            )
            names = [n for n in listing.lines if n != "HEAD"]
            have = ", ".join(names[:20]) if names else "the repository has no branches"
            raise ProjectError(
                f"project {project.name!r} has no branch {name!r} (branches: {have})",
            )
        return f"origin/{name}", found.stdout.strip()

    async def _add_worktree(
        self, cache: Path, path: Path, branch: str, base: str, *, new: bool
    ) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        args = ["worktree", "add", "--quiet"]
        args += ["--no-track", "-b", branch, str(path), base] if new else [str(path), branch]
        try:
            await self._git.run(args, cwd=cache)
        except BaseException:
            await asyncio.shield(self._undo_add(cache, path, branch if new else None))
            raise

    async def _undo_add(self, cache: Path, path: Path, new_branch: str | None) -> None:
        await self._discard(cache, path)
        if new_branch is not None:
            await self._git.run(
                ["update-ref", "-d", f"refs/heads/{new_branch}"], cwd=cache, check=False
            )

    async def _rev(self, cwd: Path, rev: str) -> str:
        result = await self._git.run(
            ["rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=cwd, check=False
        )
        if result.exit_code != 0:
            raise WorkspaceStateError(f"{rev} does not name a commit")
        return result.stdout.strip()

    async def _ref_exists(self, cwd: Path, ref: str) -> bool:
        result = await self._git.run(
            ["rev-parse", "--verify", "--quiet", ref], cwd=cwd, check=False
        )
        return result.exit_code == 0

    async def identity_args(self, cwd: Path) -> tuple[str, ...]:
        """``-c user.*`` for a commit turnstile makes itself in ``cwd`` (none where git has
        an identity of its own)."""
        return await self._identity_args(cwd)

    async def _identity_args(self, cwd: Path) -> tuple[str, ...]:
        """``-c user.*`` defaults, only where git has no identity of its own."""
        if self._identity is None:
            if os.environ.get("GIT_COMMITTER_EMAIL") and os.environ.get("GIT_AUTHOR_EMAIL"):
                self._identity = ()
            else:
                found = await self._git.run(["config", "--get", "user.email"], cwd=cwd, check=False)
                self._identity = () if found.exit_code == 0 else _DEFAULT_IDENTITY
        return self._identity

    # ------------------------------------------------------------------ reading

    async def get(self, workspace_id: str) -> Workspace | None:
        """The recorded workspace ``workspace_id`` (a run id or a sub-task id)."""
        return await self._store.get(workspace_id)

    async def workspaces(
        self, run_id: str | None = None, *, include_removed: bool = False
    ) -> list[Workspace]:
        """Recorded workspaces, of one run (with its sub-tasks) or all."""
        return await self._store.list(run_id=run_id, include_removed=include_removed)

    async def usage(self, run_id: str) -> int:
        """Bytes on disk used by the run's worktrees (its own and its sub-tasks')."""
        total = 0
        for workspace in await self._store.list(run_id=run_id):
            total += await asyncio.to_thread(disk_usage, workspace.path)
        return total

    async def summary(self, run_id: str) -> str | None:
        """One line for ``/status`` and ``turnstile runs``: branch and disk usage, or None.

        For example ``turnstile/r1 · 44.2 MB`` or ``turnstile/r1 +3 sub-tasks · 120.5 MB``.
        """
        found = await self._store.list(run_id=run_id)
        if not found:
            return None
        main = next((w for w in found if w.id == run_id), found[0])
        subs = len(found) - 1
        total = await self.usage(run_id)
        extra = f" +{subs} sub-task{'s' if subs != 1 else ''}" if subs else ""
        return f"{main.branch}{extra} · {format_size(total)}"

    async def status(self, workspace: Workspace) -> WorkspaceStatus:
        """Head, cleanliness and commits since the base, read from the worktree itself."""
        path = workspace.path
        head = await self._rev(path, "HEAD")
        branch = await self._git.run(
            ["symbolic-ref", "--quiet", "--short", "HEAD"], cwd=path, check=False
        )
        changed = await self._changed(path)
        log = await self._git.run(
            ["log", f"--max-count={_MAX_COMMITS}", "--format=%H %s", f"{workspace.base}..HEAD"],
            cwd=path,
        )
        return WorkspaceStatus(
            head=head,
            branch=branch.stdout.strip() or None,
            dirty=bool(changed),
            changed=changed,
            commits=tuple(log.lines),
        )

    async def _changed(self, path: Path) -> tuple[str, ...]:
        result = await self._git.run(
            ["status", "--porcelain=v1", "-z", "--untracked-files=all"], cwd=path
        )
        entries = result.stdout.split("\0")
        names: list[str] = []
        skip = False
        for entry in entries:
            if skip:
                skip = False
                continue
            if len(entry) < 4:
                continue
            names.append(entry[3:])
            # A rename or copy is followed by its source path.
            skip = entry[0] in "RC"
        return tuple(names)

    async def push_back(self, workspace: Workspace) -> BranchPush:
        """Push the workspace's branch to the repository its project was cloned from.

        Never forced: a branch there that went elsewhere is left as it is and the push
        is reported failed. Never raises for a failed push: the result says why.
        """
        cache = self.cache_path(workspace.project)
        project = self._projects.get(workspace.project)
        try:
            if project is not None and project.local_path is not None:
                source = str(await asyncio.to_thread(project.local_path.resolve))
            elif project is not None:
                source = project.url
            else:
                # A repository given by path or URL for the run: the clone knows where from.
                found = await self._git.run(
                    ["config", "--get", "remote.origin.url"], cwd=cache, check=False
                )
                source = found.stdout.strip()
            if not source:
                return BranchPush(workspace.branch, problem="its repository is not known")
            shown = self.redact(redact_url(source))
            ref = f"refs/heads/{workspace.branch}"
            pushed = await self._git.run(
                ["push", "--no-verify", "--quiet", "--", source, f"{ref}:{ref}"],
                cwd=cache,
                check=False,
            )
        except GitError as exc:
            return BranchPush(workspace.branch, problem=self.redact(exc.message))
        if not pushed.ok:
            why = self.redact(_push_refusal(pushed.stderr))
            _LOGGER.warning(
                "branch %s not pushed to %s: %s",
                workspace.branch,
                shown,
                why,
                extra={"run_id": workspace.run_id},
            )
            return BranchPush(workspace.branch, to=shown, problem=f"git push to {shown}: {why}")
        _LOGGER.info(
            "branch %s pushed to %s", workspace.branch, shown, extra={"run_id": workspace.run_id}
        )
        return BranchPush(workspace.branch, to=shown)

    # ------------------------------------------------------------------ waves

    async def merge_wave(
        self, parent: Workspace, subtasks: Sequence[Workspace], *, message: str | None = None
    ) -> MergeReport:
        """Merge finished sub-task branches into the parent branch, one by one.

        Each is a ``--no-ff`` merge made in the parent's worktree (never forced, never
        rebased). A conflict is aborted and reported with its files; the others still
        merge. A sub-task whose worktree is still held by a run is reported ``busy``.

        Raises:
            WorkspaceBusyError: the parent is held by another run.
            WorkspaceStateError: the parent has uncommitted changes, or a sub-task does
                not belong to it.
        """
        for sub in subtasks:
            if sub.parent_id != parent.id:
                raise WorkspaceStateError(f"{sub.id} is not a sub-task of {parent.id}")
        results: list[SubtaskMerge] = []
        async with self._guard(parent):
            on = await self._git.run(
                ["symbolic-ref", "--quiet", "--short", "HEAD"], cwd=parent.path, check=False
            )
            if on.stdout.strip() != parent.branch:
                raise WorkspaceStateError(
                    f"the worktree of {parent.id} is not on {parent.branch}; refusing to merge",
                )
            if await self._changed(parent.path):
                raise WorkspaceStateError(
                    f"the worktree of {parent.id} has uncommitted changes; commit them before "
                    "merging the wave",
                )
            identity = await self._identity_args(parent.path)
            for sub in subtasks:
                results.append(await self._merge_one(parent, sub, identity, message))
            head = await self._rev(parent.path, "HEAD")
        report = MergeReport(
            parent=parent.id, branch=parent.branch, results=tuple(results), head=head
        )
        for result in report.results:
            _LOGGER.info(
                "wave merge %s -> %s: %s%s",
                result.branch,
                parent.branch,
                result.outcome.value,
                f" ({', '.join(result.conflicts)})" if result.conflicts else "",
                extra={"run_id": parent.run_id},
            )
        return report

    async def merge_pushed(
        self, cwd: Path, remote: str, branch: str, *, message: str
    ) -> str | None:
        """Merge ``branch`` as pushed to ``remote`` into the branch checked out at ``cwd``:
        a wave's sub-task that ran on another machine (``--no-ff``, never forced). None once
        merged; else what went wrong, the merge undone."""
        fetched = await self._git.run(
            ["fetch", "--no-tags", remote, f"refs/heads/{branch}"], cwd=cwd, check=False
        )
        if fetched.exit_code != 0:
            return f"its branch {branch} could not be fetched"
        identity = await self._identity_args(cwd)
        merged = await self._git.run(
            [*identity, "merge", "--no-ff", "--no-edit", "-m", message, "FETCH_HEAD"],
            cwd=cwd,
            check=False,
        )
        if merged.exit_code == 0:
            return None
        await self._git.run(["merge", "--abort"], cwd=cwd, check=False)
        return f"merging {branch} conflicted"

    async def _merge_one(
        self,
        parent: Workspace,
        sub: Workspace,
        identity: tuple[str, ...],
        message: str | None,
    ) -> SubtaskMerge:
        def result(outcome: MergeOutcome, **kw: object) -> SubtaskMerge:
            return SubtaskMerge(sub.id, sub.name, sub.branch, outcome, **kw)  # type: ignore[arg-type]

        try:
            async with self._guard(sub):
                uncommitted = sub.path.is_dir() and bool(await self._changed(sub.path))
                tip = await self._rev(parent.path, f"refs/heads/{sub.branch}")
                contained = await self._git.run(
                    ["merge-base", "--is-ancestor", tip, "HEAD"], cwd=parent.path, check=False
                )
                if contained.exit_code == 0:
                    await self.release(sub)
                    return result(MergeOutcome.UP_TO_DATE, uncommitted=uncommitted)
                text = message or f"turnstile: merge sub-task {sub.name} into {parent.branch}"
                merged = await self._git.run(
                    [*identity, "merge", "--no-ff", "--no-edit", "-m", text, sub.branch],
                    cwd=parent.path,
                    check=False,
                )
                if merged.exit_code == 0:
                    await self.release(sub)
                    head = await self._rev(parent.path, "HEAD")
                    return result(MergeOutcome.MERGED, commit=head, uncommitted=uncommitted)
                conflicts = await self._git.run(
                    ["diff", "--name-only", "-z", "--diff-filter=U"], cwd=parent.path, check=False
                )
                files = tuple(sorted(n for n in conflicts.stdout.split("\0") if n))
                await self._abort_merge(parent)
                if files:
                    return result(MergeOutcome.CONFLICT, conflicts=files, uncommitted=uncommitted)
                detail = self._git.error("merge", merged).message
                return result(MergeOutcome.FAILED, detail=detail, uncommitted=uncommitted)
        except WorkspaceBusyError as exc:
            return result(MergeOutcome.BUSY, detail=exc.message)
        except WorkspaceStateError as exc:
            return result(MergeOutcome.FAILED, detail=exc.message)

    async def _abort_merge(self, parent: Workspace) -> None:
        await self._git.run(["merge", "--abort"], cwd=parent.path, check=False)
        left = await self._git.run(
            ["rev-parse", "--verify", "--quiet", "MERGE_HEAD"], cwd=parent.path, check=False
        )
        if left.exit_code == 0 or await self._changed(parent.path):
            raise WorkspaceStateError(
                f"could not undo a conflicting merge in the worktree of {parent.id}",
            )

    # ---------------------------------------------------------------- cleanup

    async def release(self, workspace: Workspace) -> Workspace:
        """Mark ``workspace`` finished: :meth:`cleanup` may remove it after the retention."""
        current = await self._store.get(workspace.id) or workspace
        if current.released_at is not None:
            return current
        updated = dataclasses.replace(current, released_at=self._clock())
        await self._store.save(updated)
        return updated

    async def cleanup(
        self, retention: float | None = None, *, now: float | None = None
    ) -> CleanupReport:
        """Remove worktrees finished more than ``retention`` seconds ago.

        A workspace is finished when it was released (:meth:`release`, or merged back) or
        when its run has a ``finished_at`` in the runs table. Uncommitted changes are first
        committed to ``turnstile/rescue/<id>``; branches are kept. Held worktrees are skipped.
        """
        keep_for = self.retention if retention is None else retention
        moment = self._clock() if now is None else now
        active = await self._store.list()
        finished = await self._store.run_finished_at({w.run_id for w in active})
        removed: list[str] = []
        rescued: dict[str, str] = {}
        busy: list[str] = []
        kept: list[str] = []
        errors: dict[str, str] = {}
        for workspace in active:
            done_at = workspace.released_at or finished.get(workspace.run_id)
            if done_at is None or moment - done_at < keep_for:
                kept.append(workspace.id)
                continue
            try:
                gone = await self.remove(workspace)
            except WorkspaceBusyError:
                busy.append(workspace.id)
                continue
            except (WorkspaceError, GitError) as exc:
                errors[workspace.id] = self.redact(exc.message)
                continue
            removed.append(workspace.id)
            if gone.rescue_branch is not None:
                rescued[workspace.id] = gone.rescue_branch
        return CleanupReport(
            removed=tuple(removed),
            rescued=rescued,
            busy=tuple(busy),
            kept=tuple(kept),
            errors=errors,
        )

    async def remove(self, workspace: Workspace) -> Workspace:
        """Remove the worktree folder now (its branch stays), rescuing uncommitted changes.

        Raises:
            WorkspaceBusyError: a run holds it.
            WorkspaceStateError: the folder is not the worktree git knows (left in place).
            GitError: rescuing failed; nothing was removed.
        """
        cache = self.cache_path(workspace.project)
        async with self._guard(workspace):
            rescue: str | None = None
            if workspace.path.exists():
                if not await self._is_worktree_of(workspace.path, cache):
                    raise WorkspaceStateError(
                        f"{workspace.path} is not a worktree of {workspace.project}; left in place",
                    )
                if await self._changed(workspace.path):
                    rescue = await self._rescue(workspace)
                async with hold(FileLock(self._lock_path("cache", workspace.project))):
                    # Twice: a worktree an agent locked (`git worktree lock`) goes too; its
                    # changes are on the rescue branch by now.
                    await self._git.run(
                        ["worktree", "remove", "--force", "--force", str(workspace.path)],
                        cwd=cache,
                    )
            elif cache.is_dir():
                async with hold(FileLock(self._lock_path("cache", workspace.project))):
                    await self._git.run(["worktree", "prune"], cwd=cache)
            current = await self._store.get(workspace.id) or workspace
            updated = dataclasses.replace(
                current, removed_at=self._clock(), rescue_branch=rescue or current.rescue_branch
            )
            await self._store.save(updated)
        _LOGGER.info(
            "removed worktree of %s%s",
            workspace.id,
            f" (uncommitted changes kept on {rescue})" if rescue else "",
            extra={"run_id": workspace.run_id},
        )
        return updated

    async def _rescue(self, workspace: Workspace) -> str:
        """Commit everything uncommitted (not ignored) onto a new rescue branch."""
        path = workspace.path
        found = await self._git.run(
            ["rev-parse", "--path-format=absolute", "--git-path", "turnstile-rescue.index"],
            cwd=path,
        )
        index = Path(found.stdout.strip())
        # A private index: the worktree's own index (maybe mid-merge) stays as it was.
        env = {"GIT_INDEX_FILE": str(index)}
        try:
            await self._git.run(["read-tree", "HEAD"], cwd=path, env=env)
            await self._git.run(["add", "-A", "--", "."], cwd=path, env=env)
            tree = await self._git.run(["write-tree"], cwd=path, env=env)
        finally:
            await asyncio.to_thread(index.unlink, True)
        head = await self._rev(path, "HEAD")
        identity = await self._identity_args(path)
        commit = await self._git.run(
            [
                *identity,
                "commit-tree",
                tree.stdout.strip(),
                "-p",
                head,
                "-m",
                f"turnstile: rescue uncommitted changes of {workspace.id}",
            ],
            cwd=path,
        )
        sha = commit.stdout.strip()
        name = f"{RESCUE_PREFIX}{workspace.id}"
        attempt = 1
        while await self._ref_exists(path, f"refs/heads/{name}"):
            attempt += 1
            name = f"{RESCUE_PREFIX}{workspace.id}-{attempt}"
        # Create-only (old value empty): an existing rescue branch is never overwritten.
        await self._git.run(["update-ref", f"refs/heads/{name}", sha, ""], cwd=path)
        return name


def _push_refusal(stderr: str) -> str:
    """Why git refused a push, in words (its first error line otherwise)."""
    if "[rejected]" in stderr or "non-fast-forward" in stderr:
        return (
            "the repository has a branch of that name with other commits already (nothing "
            "was forced)"
        )
    for line in stderr.splitlines():
        for prefix in ("fatal: ", "error: "):
            if line.startswith(prefix):
                return line.removeprefix(prefix).strip()
    return "git failed"


def _has_entries(path: Path) -> bool:
    with os.scandir(path) as entries:
        return next(entries, None) is not None
