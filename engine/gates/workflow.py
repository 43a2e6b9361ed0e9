"""The workflow definition: phases, approvals, artifacts and prompts, loaded from TOML.

The shipped defaults live in ``engine/gates/workflow.toml``; an operator points
``TURNSTILE_WORKFLOW_FILE`` at another file to override them. A definition is validated
when it is loaded: every error names the file and the key.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from engine.errors import ConfigError

__all__ = [
    "AWAITING_APPROVAL",
    "COMPLETE",
    "HUMAN_INTERVENTION",
    "PhaseSpec",
    "Workflow",
    "WorkflowError",
    "load_workflow",
]

COMPLETE = "complete"
HUMAN_INTERVENTION = "human_intervention"
AWAITING_APPROVAL = "awaiting_approval"
RESERVED = (COMPLETE, HUMAN_INTERVENTION)

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
_PHASE_KEYS = {
    "persona": str,
    "approval": bool,
    "artifact": str,
    "forbidden": list,
    "code_edits": bool,
    "next": str,
    "allowed": list,
    "forbidden_actions": list,
    "prompt": str,
}
_REQUIRED = ("persona", "approval", "artifact", "prompt")


class WorkflowError(ConfigError):
    """The workflow file is invalid; ``file`` and ``key`` say where."""

    def __init__(self, file: str, key: str, problem: str) -> None:
        super().__init__(f"{file}: {key}: {problem}", setting="TURNSTILE_WORKFLOW_FILE")
        self.file = file
        self.key = key
        self.problem = problem


@dataclass(frozen=True, slots=True)
class PhaseSpec:
    """One phase of the workflow."""

    name: str
    persona: str
    approval: bool
    artifact: str
    forbidden: tuple[str, ...]
    code_edits: bool
    next: str
    allowed: tuple[str, ...]
    forbidden_actions: tuple[str, ...]
    prompt: str


@dataclass(frozen=True, slots=True)
class Workflow:
    """Phases in order, plus the built-in ``complete`` and ``human_intervention`` states."""

    name: str
    source: str
    phases: tuple[PhaseSpec, ...]
    subtask_start: str
    decomposition: str | None = None

    @property
    def first(self) -> str:
        return self.phases[0].name

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.phases)

    def has(self, name: str) -> bool:
        return name in self.names

    def is_state(self, name: str) -> bool:
        """A phase or one of the built-in states."""
        return name in self.names or name in RESERVED

    def phase(self, name: str) -> PhaseSpec:
        for spec in self.phases:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def index(self, name: str) -> int:
        """Position in the order; ``complete`` sorts after every phase."""
        if name == COMPLETE:
            return len(self.phases)
        return self.names.index(name)

    def later_artifacts(self, name: str) -> dict[str, str]:
        """Artifacts of the phases after ``name``: ``{artifact: phase}``."""
        if name == COMPLETE:
            return {}
        start = self.index(name) + 1
        return {p.artifact: p.name for p in self.phases[start:]}

    def earlier_phases(self, name: str) -> tuple[PhaseSpec, ...]:
        """Phases strictly before ``name`` in the order."""
        return self.phases[: self.index(name)]

    def approval_phases(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.phases if p.approval)


def _phase_key(name: str, key: str) -> str:
    return f"phases.{name}.{key}"


def _strings(file: str, key: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise WorkflowError(file, key, "expected a list of strings")
    return tuple(value)


def _parse_phase(file: str, name: str, raw: object, default_next: str) -> PhaseSpec:
    if not _NAME.match(name):
        raise WorkflowError(
            file, f"phases.{name}", "phase names are lower-case letters, digits and _"
        )
    if name in RESERVED:
        raise WorkflowError(file, f"phases.{name}", f"{name!r} is a built-in state")
    if not isinstance(raw, Mapping):
        raise WorkflowError(file, f"phases.{name}", "expected a table")
    for key, value in raw.items():
        expected = _PHASE_KEYS.get(key)
        if expected is None:
            raise WorkflowError(
                file,
                _phase_key(name, key),
                f"unknown key (known: {', '.join(sorted(_PHASE_KEYS))})",
            )
        if not isinstance(value, expected):
            raise WorkflowError(file, _phase_key(name, key), f"expected {expected.__name__}")
    for key in _REQUIRED:
        if key not in raw:
            raise WorkflowError(file, _phase_key(name, key), "missing")
    artifact = str(raw["artifact"])
    if not artifact or "/" in artifact or "\\" in artifact or artifact.startswith("."):
        raise WorkflowError(file, _phase_key(name, "artifact"), "must be a plain file name")
    return PhaseSpec(
        name=name,
        persona=str(raw["persona"]),
        approval=bool(raw["approval"]),
        artifact=artifact,
        forbidden=_strings(file, _phase_key(name, "forbidden"), raw.get("forbidden", [])),
        code_edits=bool(raw.get("code_edits", False)),
        next=str(raw.get("next", default_next)),
        allowed=_strings(file, _phase_key(name, "allowed"), raw.get("allowed", [])),
        forbidden_actions=_strings(
            file, _phase_key(name, "forbidden_actions"), raw.get("forbidden_actions", [])
        ),
        prompt=str(raw["prompt"]).strip(),
    )


def parse_workflow(data: Mapping[str, Any], *, file: str) -> Workflow:
    """Build and validate a workflow from parsed TOML.

    Raises:
        WorkflowError: the first problem found, with the file and the key.
    """
    for key in data:
        if key not in ("workflow", "phases"):
            raise WorkflowError(file, key, "unknown table (expected [workflow] and [phases.*])")
    meta = data.get("workflow", {})
    if not isinstance(meta, Mapping):
        raise WorkflowError(file, "workflow", "expected a table")
    for key in meta:
        if key not in ("name", "subtask_start", "decomposition"):
            raise WorkflowError(file, f"workflow.{key}", "unknown key")
    raw_phases = data.get("phases")
    if not isinstance(raw_phases, Mapping) or not raw_phases:
        raise WorkflowError(file, "phases", "at least one [phases.NAME] table is needed")
    names = list(raw_phases)
    specs: list[PhaseSpec] = []
    for i, name in enumerate(names):
        default_next = names[i + 1] if i + 1 < len(names) else COMPLETE
        specs.append(_parse_phase(file, name, raw_phases[name], default_next))
    known = set(names)
    artifacts: dict[str, str] = {}
    for spec in specs:
        if spec.next not in known and spec.next != COMPLETE:
            raise WorkflowError(file, _phase_key(spec.name, "next"), f"unknown phase {spec.next!r}")
        if spec.next == spec.name:
            raise WorkflowError(file, _phase_key(spec.name, "next"), "a phase cannot follow itself")
        if names.index(spec.name) >= (names.index(spec.next) if spec.next in known else len(names)):
            raise WorkflowError(
                file, _phase_key(spec.name, "next"), "must name a later phase (or complete)"
            )
        if spec.artifact in artifacts:
            raise WorkflowError(
                file,
                _phase_key(spec.name, "artifact"),
                f"{spec.artifact!r} is already the artifact of {artifacts[spec.artifact]!r}",
            )
        artifacts[spec.artifact] = spec.name
    # Reachability from the first phase along ``next``; every phase must be on the path,
    # and the path must end in ``complete`` (no phase without a way out).
    reached: list[str] = []
    current = names[0]
    while current != COMPLETE:
        reached.append(current)
        current = next(s.next for s in specs if s.name == current)
    for name in names:
        if name not in reached:
            raise WorkflowError(file, f"phases.{name}", "unreachable from the first phase")
    subtask_start = meta.get("subtask_start", names[0])
    if not isinstance(subtask_start, str) or subtask_start not in known:
        raise WorkflowError(file, "workflow.subtask_start", f"unknown phase {subtask_start!r}")
    decomposition = meta.get("decomposition")
    if decomposition is not None and (
        not isinstance(decomposition, str) or decomposition not in known
    ):
        raise WorkflowError(file, "workflow.decomposition", f"unknown phase {decomposition!r}")
    if decomposition is not None and names.index(subtask_start) <= names.index(decomposition):
        raise WorkflowError(
            file, "workflow.subtask_start", "must be a phase after workflow.decomposition"
        )
    name = meta.get("name", "workflow")
    return Workflow(
        name=str(name),
        source=file,
        phases=tuple(specs),
        subtask_start=subtask_start,
        decomposition=decomposition,
    )


def load_workflow(path: Path | None = None) -> Workflow:
    """Load the operator's workflow file, or the shipped defaults when ``path`` is None.

    Raises:
        WorkflowError: unreadable, not TOML, or invalid; the message names file and key.
    """
    if path is None:
        text = resources.files("engine.gates").joinpath("workflow.toml").read_text("utf-8")
        file = "engine/gates/workflow.toml"
    else:
        file = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise WorkflowError(file, "-", f"cannot read: {exc}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise WorkflowError(file, "-", f"not valid TOML: {exc}") from exc
    return parse_workflow(data, file=file)


def render_list(items: Sequence[str], **values: str) -> list[str]:
    return [_fill(item, values) for item in items]


def _fill(template: str, values: Mapping[str, str]) -> str:
    # Plain replacement, not str.format: prompt text may hold braces of its own.
    out = template
    for key, value in values.items():
        out = out.replace("{" + key + "}", value)
    return out


def fill(template: str, **values: str) -> str:
    """Replace ``{name}`` placeholders without interpreting any other braces."""
    return _fill(template, values)
