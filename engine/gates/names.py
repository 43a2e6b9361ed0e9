"""Task and sub-task names: they become folder names, so they are checked strictly."""

from __future__ import annotations

import re

from engine.gates.refusals import GateRefused, Refusal

__all__ = ["check_subtask_name", "check_task_name", "subtask_problem"]

_TASK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SUB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def _describe(name: str) -> str | None:
    if not name:
        return "is empty"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "contains control characters"
    if ".." in name:
        return "contains '..'"
    if "/" in name or "\\" in name:
        return "contains a path separator"
    return None


def check_task_name(name: str) -> str:
    """Return ``name`` if it is a valid task name.

    Raises:
        GateRefused: ``invalid_name`` with the reason.
    """
    problem = _describe(name)
    if problem is None and not _TASK.match(name):
        problem = "must be letters, digits, '.', '_' or '-' (at most 128), starting alnum"
    if problem is not None:
        raise GateRefused(Refusal.INVALID_NAME, f"task name {name!r} {problem}")
    return name


def subtask_problem(name: str) -> str | None:
    """Why ``name`` is not a valid sub-task name, or None."""
    problem = _describe(name)
    if problem is None and not _SUB.match(name):
        problem = "must be letters, digits, '_' or '-' (at most 64), starting alnum"
    if problem is None and "--" in name:
        # '--' joins a parent's and a sub-task's names in workspace ids and branches.
        problem = "contains '--'"
    return problem


def check_subtask_name(name: str) -> str:
    problem = subtask_problem(name)
    if problem is not None:
        raise GateRefused(Refusal.INVALID_NAME, f"sub-task name {name!r} {problem}")
    return name
