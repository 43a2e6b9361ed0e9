"""Task lists grouped by parent and wave, tasks awaiting approval first (pure functions).

Names sort as people count: ``feature-2`` before ``feature-10`` (:func:`natural_key`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple, Protocol

__all__ = [
    "ListEntry",
    "Listable",
    "TaskGroup",
    "group_tasks",
    "natural_key",
    "render_groups",
    "render_groups_json",
    "render_rows",
]

#: The rows come from :meth:`engine.gates.store.GateStore.listing_rows` (its
#: :data:`~engine.gates.store.LIST_QUERY`), in listing order: each group (a task and its
#: sub-tasks) together, the task first, then its sub-tasks by wave and name.
#: :func:`render_rows` streams that order into text without building a row object (it
#: re-sorts only the groups, and a wave's sub-tasks, by :func:`natural_key`);
#: :func:`group_tasks` takes rows in any order.

_DIGITS: Final = re.compile(r"([0-9]+)")
_split_digits = _DIGITS.split


def natural_key(name: str) -> list[str | int]:
    """``name``'s sort key with its runs of digits as numbers: ``feature-2`` comes before
    ``feature-10`` (text parts and numbers alternate, so any two keys compare)."""
    parts: list[str | int] = list(_split_digits(name))
    if len(parts) > 1:
        parts[1::2] = [int(p) for p in parts[1::2]]
    return parts


class Listable(Protocol):
    """What a listing shows of a task (:class:`ListEntry` and ``Listable`` both fit)."""

    @property
    def name(self) -> str: ...
    @property
    def phase(self) -> str: ...
    @property
    def sub_state(self) -> str | None: ...
    @property
    def version(self) -> int: ...
    @property
    def parent(self) -> str | None: ...
    @property
    def wave(self) -> int | None: ...
    @property
    def gate_sha256(self) -> str | None: ...
    @property
    def revision_notes(self) -> str | None: ...
    @property
    def updated_at(self) -> float: ...
    @property
    def label(self) -> str: ...
    @property
    def awaiting_approval(self) -> bool: ...


class ListEntry(NamedTuple):
    """One row of :data:`~engine.gates.store.LIST_QUERY`."""

    name: str
    phase: str
    sub_state: str | None
    version: int
    parent: str | None
    wave: int | None
    gate_sha256: str | None
    revision_notes: str | None
    updated_at: float

    @property
    def label(self) -> str:
        return f"{self.phase}:{self.sub_state}" if self.sub_state else self.phase

    @property
    def awaiting_approval(self) -> bool:
        return self.sub_state == "awaiting_approval"


@dataclass(slots=True)
class TaskGroup:
    """A top-level task and its sub-tasks by wave (``waves`` is sorted by wave number)."""

    task: Listable | None
    waves: dict[int, list[Listable]] = field(default_factory=dict)
    gate_open: bool = False
    """Whether the task or one of its sub-tasks awaits approval."""

    @property
    def name(self) -> str:
        if self.task is not None:
            return self.task.name
        return next(iter(self.waves.values()))[0].parent or "?"

    @property
    def awaiting(self) -> bool:
        return self.gate_open

    def all(self) -> list[Listable]:
        out = [self.task] if self.task is not None else []
        for wave in sorted(self.waves):
            out += self.waves[wave]
        return out


def _by_name(task: Listable) -> tuple[list[str | int], str]:
    # The name itself breaks a tie ("a01" and "a1" count alike).
    return natural_key(task.name), task.name


def _group_key(name: str) -> tuple[list[str | int], str]:
    return natural_key(name), name


_AWAITING = "awaiting_approval"


def group_tasks(records: Iterable[Listable]) -> list[TaskGroup]:
    """Group tasks under their parents and waves; groups awaiting approval come first."""
    groups: dict[str, TaskGroup] = {}
    get = groups.get
    for rec in records:
        parent = rec.parent
        if parent is None:
            group = get(rec.name)
            if group is None:
                group = groups[rec.name] = TaskGroup(rec)
            else:
                group.task = rec
        else:
            group = get(parent)
            if group is None:
                group = groups[parent] = TaskGroup(None)
            waves = group.waves
            wave = rec.wave or 1
            members = waves.get(wave)
            if members is None:
                waves[wave] = [rec]
            else:
                members.append(rec)
        if rec.sub_state == _AWAITING:
            group.gate_open = True
    for group in groups.values():
        waves = group.waves
        if len(waves) > 1 or any(len(m) > 1 for m in waves.values()):
            group.waves = {w: sorted(waves[w], key=_by_name) for w in sorted(waves)}
    # Gated groups first, each part in name order (dicts keep insertion order).
    names = sorted(groups, key=_group_key)
    gated = [groups[n] for n in names if groups[n].gate_open]
    return gated + [groups[n] for n in names if not groups[n].gate_open]


def _format(
    indent: str,
    name: str,
    phase: str,
    sub: str | None,
    version: int,
    sha: str | None,
    notes: str | None,
) -> str:
    label = f"{phase}:{sub}" if sub else phase
    extra = f"  notes: {notes[:40]!r}" if notes else ""
    gate = f"  gate {sha[:12]}" if sha and sub == _AWAITING else ""
    return f"{indent}{name:<40} {label:<36} v{version}{gate}{extra}"


def _line(task: Listable, indent: str) -> str:
    return _format(
        indent,
        task.name,
        task.phase,
        task.sub_state,
        task.version,
        task.gate_sha256,
        task.revision_notes,
    )


def render_groups(groups: list[TaskGroup]) -> str:
    if not groups:
        return "no tasks"
    lines: list[str] = []
    add = lines.append
    for group in groups:
        if group.task is not None:
            add(_line(group.task, ""))
        else:
            add(f"{group.name} (parent not found)")
        for wave, members in group.waves.items():
            add(f"  wave {wave}:")
            for task in members:
                add(_line(task, "    "))
    return "\n".join(lines)


def _extras(sub: str | None, sha: str | None, notes: str | None) -> str:
    """What :func:`_format` appends after the version: the open gate's hash, the notes."""
    gate = f"  gate {sha[:12]}" if sha and sub == _AWAITING else ""
    return gate + (f"  notes: {notes[:40]!r}" if notes else "")


#: :func:`_format`'s line without extras, for a task and for a sub-task (``%`` formatting
#: is the quickest of Python's ways here: a 10,000-task listing formats in a few ms).
_TOP_LINE: Final = "%-40s %-36s v%s"
_SUB_LINE: Final = "    " + _TOP_LINE


def render_rows(rows: Iterable[tuple[Any, ...]]) -> str:
    """:func:`render_groups` of :func:`group_tasks`, straight from the listing rows.

    One pass over the rows in the query's order, no object per row and no call per row
    for the common line but its sort key: the listing of 10,000 tasks is a hot path
    (``status --list``, the admin board). The output is the same text.
    """
    gated: list[tuple[str, list[str]]] = []
    rest: list[tuple[str, list[str]]] = []
    lines: list[str] = []
    add = lines.append
    # A wave's sub-tasks, kept until the wave ends: the query sorts them as text.
    members: list[tuple[str, str]] = []
    current: str | None = None
    wave_seen: int | None = None
    gate_open = False
    for name, phase, sub, version, parent, wave, sha, notes, _updated in rows:
        key = parent or name
        if key != current:
            if members:
                lines.extend(line for _, line in sorted(members, key=_member_key))
                members = []
            if current is not None:
                (gated if gate_open else rest).append((current, lines))
            current, lines, wave_seen, gate_open = key, [], None, False
            add = lines.append
            if parent is not None:
                add(f"{parent} (parent not found)")
        if sub:
            label = f"{phase}:{sub}"
            if sub == _AWAITING:
                gate_open = True
        else:
            label = phase
        if parent is None:
            line = _TOP_LINE % (name, label, version)
        else:
            number = wave or 1
            if number != wave_seen:
                if members:
                    lines.extend(line for _, line in sorted(members, key=_member_key))
                    members = []
                add(f"  wave {number}:")
                wave_seen = number
            line = _SUB_LINE % (name, label, version)
        if sha or notes:
            line += _extras(sub, sha, notes)
        if parent is None:
            add(line)
        else:
            members.append((name, line))
    if current is None:
        return "no tasks"
    if members:
        lines.extend(line for _, line in sorted(members, key=_member_key))
    (gated if gate_open else rest).append((current, lines))
    gated.sort(key=_part_key)
    rest.sort(key=_part_key)
    return "\n".join([line for _, group in gated + rest for line in group])


def _member_key(member: tuple[str, str]) -> tuple[list[str | int], str]:
    return natural_key(member[0]), member[0]


def _part_key(part: tuple[str, list[str]]) -> tuple[list[str | int], str]:
    return natural_key(part[0]), part[0]


def _task_json(task: Listable) -> dict[str, Any]:
    return {
        "task": task.name,
        "phase": task.phase,
        "sub_state": task.sub_state,
        "version": task.version,
        "parent": task.parent,
        "wave": task.wave,
        "gate_sha256": task.gate_sha256,
        "updated": task.updated_at,
    }


def render_groups_json(groups: list[TaskGroup]) -> str:
    out = []
    for group in groups:
        out.append(
            {
                "task": _task_json(group.task) if group.task else {"task": group.name},
                "waves": [
                    {"wave": w, "tasks": [_task_json(t) for t in ts]}
                    for w, ts in group.waves.items()
                ],
            }
        )
    return json.dumps(out, indent=1)
