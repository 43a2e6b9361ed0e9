"""The machine-readable sub-task block of ``decomposition.md``.

The block is a fenced code block whose info string is ``subtasks``; each line declares
one sub-task::

    ```subtasks
    # comments and blank lines are ignored
    wave 1: parser - split the input into tokens
    wave 1: storage - the table and its migration
    wave 2: api - the public functions, on top of both
    ```

``wave N`` (N >= 1) orders the sub-tasks: every sub-task of wave N finishes before
wave N+1 starts. The name (letters, digits, ``_``, ``-``; no ``/``, ``..`` or control
characters) becomes a folder. The summary after `` - `` is optional. An empty block
means the task is not split. Exactly one block is allowed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from engine import safefile
from engine.errors import UnsafeFileError
from engine.gates.names import subtask_problem
from engine.gates.refusals import GateRefused, Refusal

__all__ = ["MAX_SUBTASKS", "SubtaskDecl", "parse_decomposition", "read_decomposition"]

MAX_SUBTASKS = 100
_FENCE_OPEN = re.compile(r"^\s*```\s*subtasks\s*$")
_FENCE_CLOSE = re.compile(r"^\s*```\s*$")
_LINE = re.compile(r"^wave\s+(?P<wave>\d{1,4})\s*:\s*(?P<name>\S+)(?:\s+-\s+(?P<summary>.*))?$")
_MAX_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class SubtaskDecl:
    name: str
    wave: int
    summary: str
    line: int


def _fail(message: str, line: int) -> GateRefused:
    return GateRefused(
        Refusal.INVALID_ARTIFACT, f"decomposition block, line {line}: {message}", line=line
    )


def parse_decomposition(text: str) -> tuple[SubtaskDecl, ...]:
    """The sub-tasks declared in ``text`` (may be empty).

    Raises:
        GateRefused: ``invalid_artifact`` naming the problem and its line (1-based).
    """
    lines = text.splitlines()
    start = None
    decls: list[SubtaskDecl] = []
    seen: dict[str, int] = {}
    i = 0
    while i < len(lines):
        if _FENCE_OPEN.match(lines[i]):
            if start is not None:
                raise _fail("a second ```subtasks block (only one is allowed)", i + 1)
            start = i + 1
            i += 1
            closed = False
            while i < len(lines):
                raw = lines[i]
                if _FENCE_CLOSE.match(raw):
                    closed = True
                    break
                stripped = raw.strip()
                if stripped and not stripped.startswith("#"):
                    decls.append(_parse_line(stripped, i + 1, seen))
                i += 1
            if not closed:
                raise _fail("the ```subtasks block is not closed", start)
        i += 1
    if start is None:
        raise _fail("no ```subtasks block found (an empty block means no split)", 1)
    if len(decls) > MAX_SUBTASKS:
        raise _fail(f"more than {MAX_SUBTASKS} sub-tasks", start)
    return tuple(decls)


def _parse_line(line: str, number: int, seen: dict[str, int]) -> SubtaskDecl:
    match = _LINE.match(line)
    if match is None:
        raise _fail(f"expected 'wave N: name - summary', got {line[:80]!r}", number)
    wave = int(match.group("wave"))
    if wave < 1:
        raise _fail("wave numbers start at 1", number)
    name = match.group("name")
    problem = subtask_problem(name)
    if problem is not None:
        raise _fail(f"sub-task name {name[:80]!r} {problem}", number)
    if name in seen:
        raise _fail(f"sub-task {name!r} already declared on line {seen[name]}", number)
    seen[name] = number
    summary = (match.group("summary") or "").strip()
    return SubtaskDecl(name=name, wave=wave, summary=summary, line=number)


def read_decomposition(path: Path) -> tuple[SubtaskDecl, ...]:
    """Parse the block in the file at ``path``.

    Raises:
        GateRefused: ``missing_artifact`` or ``invalid_artifact``.
    """
    try:
        raw = safefile.read_bytes(path.parent, path.name, limit=_MAX_BYTES)
    except FileNotFoundError as exc:
        raise GateRefused(Refusal.MISSING_ARTIFACT, f"{path.name} does not exist") from exc
    except UnsafeFileError as exc:
        raise _fail(exc.message, 1) from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(f"{path.name} is not UTF-8", 1) from exc
    return parse_decomposition(text)
