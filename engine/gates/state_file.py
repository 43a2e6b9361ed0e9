"""The ``.state`` mirror: a JSON copy of a task's state in its folder, written atomically.

The store is the truth; ``.state`` is for people and agents to read. It is never trusted:
validation compares it with the store and reports any difference.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine import safefile
from engine.errors import UnsafeFileError

__all__ = ["STATE_FILE", "compare_state", "read_state", "write_atomic", "write_state"]

STATE_FILE = ".state"
#: A real ``.state`` is a few hundred bytes; anything this large was not written by us.
MAX_STATE_BYTES = 256 * 1024


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder, fsync, rename, fsync dir."""
    fd, tmp = tempfile.mkstemp(prefix=".state.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def render_state(snapshot: Mapping[str, Any]) -> bytes:
    return (json.dumps(dict(snapshot), indent=2, sort_keys=True) + "\n").encode("utf-8")


def write_state(folder: Path, snapshot: Mapping[str, Any]) -> None:
    write_atomic(folder / STATE_FILE, render_state(snapshot))


def read_state(folder: Path) -> dict[str, Any] | None:
    """The parsed ``.state``, or None when missing; ``{"__invalid__": why}`` when unreadable."""
    try:
        raw = safefile.read_bytes(folder, STATE_FILE, limit=MAX_STATE_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except UnsafeFileError as exc:
        return {"__invalid__": exc.message.removeprefix(f"{STATE_FILE} is ")}
    except OSError as exc:
        return {"__invalid__": f"unreadable: {exc}"}
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return {"__invalid__": f"not JSON: {exc}"}
    if not isinstance(data, dict):
        return {"__invalid__": "not a JSON object"}
    return data


def compare_state(folder: Path, expected: Mapping[str, Any]) -> list[str]:
    """Differences between the folder's ``.state`` and ``expected`` (empty when equal)."""
    found = read_state(folder)
    if found is None:
        return [".state is missing"]
    if "__invalid__" in found:
        return [f".state is {found['__invalid__']}"]
    # Round-trip through JSON so tuples and lists compare equal.
    want = json.loads(json.dumps(dict(expected)))
    problems = []
    for key in sorted(set(want) | set(found)):
        if key not in found:
            problems.append(f".state lacks {key!r}")
        elif key not in want:
            problems.append(f".state has unknown key {key!r}")
        elif found[key] != want[key]:
            problems.append(f".state {key}={found[key]!r} but the store says {want[key]!r}")
    return problems
