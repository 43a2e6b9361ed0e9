"""The folder side of a task: its lock, its ``.state`` mirror, the artifact hash cache and
reading the decomposition it declares.

The store is the truth; the folder is where agents and people work. Writers hold the
folder's lock (``.state.lock`` on SQLite, an advisory lock on PostgreSQL so that it holds
across machines) exclusively from before their transaction until the
mirror is rewritten; readers that compare ``.state`` with the store hold it shared, so
nobody ever sees a committed change whose mirror is not written yet.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine import safefile
from engine.errors import UnsafeFileError
from engine.gates.decomposition import SubtaskDecl, parse_decomposition
from engine.gates.hashing import sha256_file_async
from engine.gates.records import ApprovalRecord, TaskRecord
from engine.gates.refusals import GateRefused, Refusal
from engine.gates.state_file import write_state
from engine.locks import FileLock, Lock, hold
from engine.store.leases import database_lock

if TYPE_CHECKING:
    from engine.store.backend import AnyDatabase

__all__ = ["MAX_DECLS_BYTES", "TaskFolders", "parse_decls", "read_decls", "snapshot"]

#: The largest decomposition whose sub-task block is read.
MAX_DECLS_BYTES = 1024 * 1024


def snapshot(task: TaskRecord, approvals: Sequence[ApprovalRecord]) -> dict[str, Any]:
    """What ``.state`` must hold for ``task`` and its open gate's ``approvals``."""
    return {
        "task": task.name,
        "phase": task.phase,
        "sub_state": task.sub_state,
        "version": task.version,
        "parent": task.parent,
        "wave": task.wave,
        "gate_sha256": task.gate_sha256,
        "approvals": [{"approver": a.approver, "sha256": a.sha256, "at": a.at} for a in approvals],
        "updated": task.updated_at,
    }


def read_decls(task: TaskRecord, artifact: str, expected_sha256: str) -> tuple[SubtaskDecl, ...]:
    """Parse the decomposition ``artifact`` of ``task``, checking it is the content with
    that hash (blocking: call it in a thread).

    Raises:
        GateRefused: missing, unsafe, changed, not UTF-8, or not a valid block.
    """
    path = task.folder / artifact
    try:
        raw = safefile.read_bytes(task.folder, artifact, limit=MAX_DECLS_BYTES)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise GateRefused(
            Refusal.MISSING_ARTIFACT, f"{path.name} disappeared while it was read", task=task.name
        ) from exc
    except UnsafeFileError as exc:
        raise GateRefused(Refusal.INVALID_ARTIFACT, exc.message, task=task.name, line=1) from exc
    if hashlib.sha256(raw).hexdigest() != expected_sha256:
        raise GateRefused(
            Refusal.STALE_APPROVAL, f"{path.name} changed while it was read", task=task.name
        )
    return parse_decls(task, path.name, raw)


def parse_decls(task: TaskRecord, artifact: str, raw: bytes) -> tuple[SubtaskDecl, ...]:
    """Parse the decomposition block in ``raw`` (the content of ``artifact``, as the gate
    stored it).

    Raises:
        GateRefused: too large, not UTF-8, or not a valid block.
    """
    if len(raw) > MAX_DECLS_BYTES:
        raise GateRefused(
            Refusal.INVALID_ARTIFACT,
            f"{artifact} is larger than {MAX_DECLS_BYTES} bytes",
            task=task.name,
            line=1,
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise GateRefused(
            Refusal.INVALID_ARTIFACT, f"{artifact} is not UTF-8", task=task.name, line=1
        ) from exc
    return parse_decomposition(text)


class TaskFolders:
    """Folder locks and the artifact hash cache of one process (share one instance).

    Args:
        db: the gates' database: on PostgreSQL a folder's lock is an advisory lock in it
            (keyed by the folder's path), which excludes writers on every machine; without
            one (or on SQLite) it is an ``flock`` on ``.state.lock``.
    """

    def __init__(self, db: AnyDatabase | None = None) -> None:
        self._db = db
        self._locks: dict[Path, asyncio.Lock] = {}
        self._hashes: dict[Path, tuple[tuple[int, int, int, int], str]] = {}

    @asynccontextmanager
    async def lock(self, folder: Path, *, exclusive: bool = True) -> AsyncIterator[None]:
        """Hold the task folder's lock across processes (on PostgreSQL, across machines).

        One coroutine per folder per process waits on the file lock (an asyncio lock in
        front); the wait itself never blocks a thread (:func:`engine.locks.hold`).

        Raises:
            LockError: the lock file cannot be used (an agent replaced it by a link, ...).
        """
        local = self._locks.setdefault(folder, asyncio.Lock())
        async with local:
            if not exclusive and not await asyncio.to_thread(folder.is_dir):
                yield  # a reader must not create a missing folder (it is a finding)
                return
            await asyncio.to_thread(folder.mkdir, parents=True, exist_ok=True)
            path = folder / ".state.lock"
            lock: Lock
            if self._db is None:
                lock = FileLock(path, shared=not exclusive, make_parent=False, mode=0o644)
            else:
                lock = database_lock(
                    self._db,
                    f"task folder {folder}",
                    path,
                    mode=0o644,
                    shared=not exclusive,
                    make_parent=False,
                    brief=True,
                )
            async with hold(lock):
                yield

    async def write_mirror(self, task: TaskRecord, approvals: Sequence[ApprovalRecord]) -> None:
        """Rewrite ``task``'s ``.state`` atomically (hold :meth:`lock`)."""
        await asyncio.to_thread(write_state, task.folder, snapshot(task, approvals))

    async def cached_hash(self, path: Path, folder: Path) -> str | None:
        """The artifact's hash, re-read only when its size, mtime or inode changed (a parked
        driver polls this; a 1 GB artifact must not be re-hashed every second).

        Raises:
            UnsafeFileError: the artifact may not be read (see :mod:`engine.gates.hashing`).
        """
        try:
            st = await asyncio.to_thread(path.stat)
        except FileNotFoundError:
            return None
        except OSError:
            # A link that loops and the like: hashing says why it is refused.
            return await sha256_file_async(path, root=folder)
        key = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
        cached = self._hashes.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        digest = await sha256_file_async(path, root=folder)
        if digest is not None:
            self._hashes[path] = (key, digest)
        return digest
