"""What is in a task folder: the phase's artifact, forbidden and out-of-order artifacts."""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from engine.gates.hashing import sha256_file
from engine.gates.state_file import compare_state
from engine.gates.workflow import COMPLETE, HUMAN_INTERVENTION, Workflow

__all__ = [
    "FolderFacts",
    "Violation",
    "ViolationKind",
    "inspect_folder",
    "list_artifacts",
    "validate_folder",
]


class ViolationKind(StrEnum):
    OUT_OF_ORDER = "out_of_order_artifact"
    FORBIDDEN = "forbidden_artifact"
    STATE_MISMATCH = "state_mismatch"
    FOLDER_MISSING = "folder_missing"
    UNKNOWN_PHASE = "unknown_phase"


@dataclass(frozen=True, slots=True)
class Violation:
    kind: ViolationKind
    detail: str

    def as_dict(self) -> dict[str, str]:
        return {"kind": self.kind.value, "detail": self.detail}


@dataclass(frozen=True, slots=True)
class FolderFacts:
    """The folder as the gate sees it for one phase.

    Attributes:
        artifact_sha256: hash of the phase's artifact, None when it is missing.
        forbidden: files matching the phase's forbidden globs.
        out_of_order: later phases' artifacts present (phase skipping), ``{file: phase}``.
    """

    artifact_sha256: str | None
    forbidden: tuple[str, ...]
    out_of_order: Mapping[str, str]

    @property
    def blocked(self) -> tuple[str, ...]:
        """Every file that must not be there, sorted."""
        return tuple(sorted(set(self.forbidden) | set(self.out_of_order)))


def list_artifacts(folder: Path) -> tuple[str, ...]:
    """Regular files at the top of ``folder``, dot-files excluded, sorted."""
    try:
        with os.scandir(folder) as entries:
            return tuple(
                sorted(
                    e.name
                    for e in entries
                    if not e.name.startswith(".") and e.is_file(follow_symlinks=False)
                )
            )
    except FileNotFoundError:
        return ()


def effective_phase(phase: str, return_phase: str | None) -> str:
    """The phase whose rules apply: a task waiting for a person keeps its last phase's."""
    if phase == HUMAN_INTERVENTION:
        return return_phase or phase
    return phase


def inspect_folder(
    folder: Path, workflow: Workflow, phase: str, *, hash_artifact: bool = True
) -> FolderFacts:
    """Facts about ``folder`` under ``phase``'s rules (hashing the artifact by streaming)."""
    files = list_artifacts(folder)
    if phase in (COMPLETE, HUMAN_INTERVENTION):
        return FolderFacts(artifact_sha256=None, forbidden=(), out_of_order={})
    spec = workflow.phase(phase)
    forbidden = tuple(f for f in files if any(fnmatch.fnmatchcase(f, g) for g in spec.forbidden))
    later = workflow.later_artifacts(phase)
    out_of_order = {f: later[f] for f in files if f in later}
    digest = sha256_file(folder / spec.artifact) if hash_artifact else None
    return FolderFacts(artifact_sha256=digest, forbidden=forbidden, out_of_order=out_of_order)


def validate_folder(
    folder: Path,
    workflow: Workflow,
    phase: str,
    return_phase: str | None,
    expected_state: Mapping[str, Any],
) -> list[Violation]:
    """Out-of-order artifacts, forbidden artifacts and a ``.state`` that disagrees."""
    if not folder.is_dir():
        return [Violation(ViolationKind.FOLDER_MISSING, f"task folder {folder} does not exist")]
    rules = effective_phase(phase, return_phase)
    found: list[Violation] = []
    if rules not in (COMPLETE, HUMAN_INTERVENTION) and not workflow.has(rules):
        found.append(
            Violation(ViolationKind.UNKNOWN_PHASE, f"phase {rules!r} is not in the workflow")
        )
    elif rules not in (COMPLETE, HUMAN_INTERVENTION):
        facts = inspect_folder(folder, workflow, rules, hash_artifact=False)
        for name, owner in sorted(facts.out_of_order.items()):
            found.append(
                Violation(
                    ViolationKind.OUT_OF_ORDER,
                    f"{name} belongs to the later phase {owner} (phase skipping) "
                    f"but the task is in {rules}",
                )
            )
        for name in facts.forbidden:
            if name not in facts.out_of_order:
                found.append(
                    Violation(ViolationKind.FORBIDDEN, f"{name} is forbidden in phase {rules}")
                )
    for problem in compare_state(folder, expected_state):
        found.append(Violation(ViolationKind.STATE_MISMATCH, problem))
    return found
