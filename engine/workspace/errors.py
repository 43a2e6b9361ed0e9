"""The workspace manager's own errors (git failures are :class:`engine.errors.GitError`)."""

from __future__ import annotations

from engine.errors import TurnstileError

__all__ = ["WorkspaceBusyError", "WorkspaceError", "WorkspaceStateError"]


class WorkspaceError(TurnstileError):
    """A workspace (clone cache, worktree, branch) operation failed."""


class WorkspaceBusyError(WorkspaceError):
    """The worktree is in use by another run (in this process or another)."""

    retryable = True


class WorkspaceStateError(WorkspaceError):
    """The worktree is not in the state the operation needs."""
