"""Completion detection (the Evaluate marker line) and verification from evidence.

"Complete" is accepted only with evidence the engine measures in the workspace, never on
the agent's word: commits since the run started, a clean working tree, the verify
command's result when one is configured, and PR/CI state when ``gh`` and a remote are
available. Each piece is pass (1), partial (0.5), fail (0) or unknown; the score is the
weighted mean over the known pieces, accepted at or above the threshold. Nothing known
scores 0: with no evidence at all, nothing is accepted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from engine.automode.git import Git
from engine.automode.prompts import MARKER_PREFIX
from engine.automode.state import Verdict
from engine.errors import TurnExecError, TurnPreempted
from engine.process import ProcessSpec, run_process
from engine.redact import tail
from engine.runs.stop import until_stopped
from engine.sandbox import Walls

__all__ = [
    "DEFAULT_WEIGHTS",
    "CompletionSignalDetector",
    "CompletionVerifier",
    "Evidence",
    "Verification",
    "evidence_gap",
]

_LOGGER = logging.getLogger(__name__)

# Equal weights: with every piece known, any single failure keeps the score below 0.8.
DEFAULT_WEIGHTS: Final[Mapping[str, float]] = {
    "commits": 1.0,
    "clean_tree": 1.0,
    "verify_cmd": 1.0,
    "pr_ci": 1.0,
}
_MARKER = re.compile(rf"^\s*[*_`>]*\s*{re.escape(MARKER_PREFIX)}\s*(.*?)\s*[*_`]*\s*$", re.I)
_VERDICTS: Final = {v.value: v for v in Verdict}


class CompletionSignalDetector:
    """Reads the Evaluate turn's marker line.

    The last line starting with ``AUTO-MODE STATUS:`` decides; its value must be exactly
    one of the three verdicts (case and surrounding emphasis ignored). A missing or
    garbled marker counts as IN PROGRESS, never as COMPLETE.
    """

    def detect(self, text: str) -> tuple[Verdict, bool]:
        """The verdict, and whether a well-formed marker line was found."""
        value: str | None = None
        for line in text.splitlines():
            match = _MARKER.match(line)
            if match is not None:
                value = match.group(1)
        if value is None:
            return Verdict.IN_PROGRESS, False
        normalised = " ".join(value.upper().replace("_", " ").split()).rstrip(".")
        verdict = _VERDICTS.get(normalised)
        if verdict is None:
            return Verdict.IN_PROGRESS, False
        return verdict, True


@dataclass(frozen=True, slots=True)
class Evidence:
    """One measured fact: ``value`` 1 pass, 0.5 partial, 0 fail, None unknown."""

    name: str
    value: float | None
    detail: str
    weight: float = 1.0

    @property
    def label(self) -> str:
        if self.value is None:
            return "unknown"
        if self.value >= 1:
            return "pass"
        return "fail" if self.value <= 0 else "partial"

    def describe(self) -> str:
        """The fact in plain words: "clean tree: yes (clean)", "commits: no (0 since …)"."""
        said = {"pass": "yes", "fail": "no", "partial": "partly"}.get(self.label, self.label)
        return f"{_WORDS.get(self.name, self.name)}: {said} ({self.detail})"

    def shortfall(self) -> str | None:
        """What this piece says against completion, in plain words (None: nothing)."""
        if self.value is not None and self.value >= 1:
            return None
        if self.value is None:
            return f"{_WORDS.get(self.name, self.name)} unknown ({self.detail})"
        if self.name == "commits":
            return "no commit since the run started"
        if self.name == "clean_tree":
            return f"tree dirty ({self.detail})"
        if self.name == "verify_cmd":
            return f"the verify command failed ({self.detail})"
        return f"{_WORDS.get(self.name, self.name)}: {self.detail}"


_WORDS: Final[Mapping[str, str]] = {
    "commits": "commits",
    "clean_tree": "clean tree",
    "verify_cmd": "verify command",
    "pr_ci": "pull request and CI",
}


@dataclass(frozen=True, slots=True)
class Verification:
    claim: Verdict
    evidence: tuple[Evidence, ...]
    score: float
    threshold: float

    @property
    def accepted(self) -> bool:
        return self.claim is Verdict.COMPLETE and self.score >= self.threshold

    def describe(self) -> str:
        return "; ".join(e.describe() for e in self.evidence)

    def why_not(self) -> str:
        """Why a COMPLETE claim was not accepted, for people: what failed first, then
        what could not be measured."""
        failed = [e.shortfall() for e in self.evidence if e.value is not None]
        unknown = [e.shortfall() for e in self.evidence if e.value is None]
        said = [w for w in failed if w] or [w for w in unknown if w]
        return (
            f"evidence: {', '.join(said) or 'none'} "
            f"(score {self.score:.2f}, {self.threshold:.2f} needed)"
        )


async def evidence_gap(workdir: Path) -> str | None:
    """Why no commit and no clean tree can be measured in ``workdir`` (None: they can).

    Without them a claim of completion rests on the verify command alone, and with none
    configured it can never be accepted: front ends refuse or warn before a run starts.
    """
    # A folder that is not there is refused where the run is prepared.
    if not await asyncio.to_thread(workdir.is_dir) or await Git(workdir).is_repo():
        return None
    return (
        f"{workdir} is not a git repository, so no commit and no clean tree can show that "
        "the work is done"
    )


def score(evidence: Sequence[Evidence]) -> float:
    known = [e for e in evidence if e.value is not None]
    total = sum(e.weight for e in known)
    if total <= 0:
        return 0.0
    return sum(e.weight * (e.value or 0.0) for e in known) / total


class CompletionVerifier:
    """Measures completion evidence in a workspace.

    Args:
        workdir: the agent's working directory.
        base_commit: HEAD when the run started (None: the repository had no commit).
        verify_cmd: the operator's verify command as argv (None: not configured). It runs
            to completion; only ``stop`` (a person's stop, a latch) ends it early.
        threshold: the score needed to accept a COMPLETE claim.
        exclude: paths inside the workdir that are not the agent's work (the run's own
            log folder) and do not make the tree dirty.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        base_commit: str | None,
        verify_cmd: Sequence[str] | None = None,
        threshold: float = 0.8,
        exclude: Sequence[Path] = (),
        weights: Mapping[str, float] = DEFAULT_WEIGHTS,
        gh_bin: str = "gh",
        stop: asyncio.Event | None = None,
        spill_dir: Path | None = None,
        walls: Walls | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.workdir = workdir
        # The verify command runs code the agent wrote: inside the agent's walls, with the
        # agent's environment (never this process's settings).
        self.walls = walls
        self.env = env
        self.base_commit = base_commit
        self.verify_cmd = tuple(verify_cmd) if verify_cmd else None
        self.threshold = threshold
        self.exclude = list(exclude)
        self.weights = dict(weights)
        self.gh_bin = gh_bin
        self.stop_event = stop or asyncio.Event()
        self.spill_dir = spill_dir
        self._git = Git(workdir)

    async def verify(self, claim: Verdict, *, run_verify_cmd: bool = True) -> Verification:
        """Measure every piece of evidence and score it against ``claim``.

        ``run_verify_cmd=False`` (for a final report without a COMPLETE claim) leaves the
        verify command out: it may take long and nothing depends on it then.
        """
        evidence = await self.measure(run_verify_cmd=run_verify_cmd)
        return Verification(claim, evidence, score(evidence), self.threshold)

    async def measure(self, *, run_verify_cmd: bool = True) -> tuple[Evidence, ...]:
        is_repo = await self._git.is_repo()
        if run_verify_cmd or self.verify_cmd is None:
            verify = await self._verify_cmd()
        else:
            verify = self._ev("verify_cmd", None, "not run: no COMPLETE claim to check")
        return (
            await self._commits(is_repo),
            await self._clean_tree(is_repo),
            verify,
            await self._pr_ci(is_repo),
        )

    def _ev(self, name: str, value: float | None, detail: str) -> Evidence:
        return Evidence(name, value, detail, self.weights.get(name, 1.0))

    async def _commits(self, is_repo: bool) -> Evidence:
        if not is_repo:
            return self._ev("commits", None, "not a git repository")
        commits = await self._git.commits_since(self.base_commit)
        n = len(commits)
        return self._ev("commits", 1.0 if n else 0.0, f"{n} since the run started")

    async def _clean_tree(self, is_repo: bool) -> Evidence:
        if not is_repo:
            return self._ev("clean_tree", None, "not a git repository")
        dirty = await self._git.dirty_paths(self.exclude)
        if dirty is None:
            return self._ev("clean_tree", None, "git status failed")
        if not dirty:
            return self._ev("clean_tree", 1.0, "clean")
        shown = ", ".join(dirty[:5]) + (" …" if len(dirty) > 5 else "")
        return self._ev("clean_tree", 0.0, f"{len(dirty)} uncommitted path(s): {shown}")

    async def _verify_cmd(self) -> Evidence:
        if self.verify_cmd is None:
            return self._ev("verify_cmd", None, "no verify command configured")
        try:
            result = await until_stopped(
                run_process(
                    ProcessSpec(
                        argv=(
                            self.walls.wrap(self.verify_cmd, self.workdir)
                            if self.walls is not None
                            else self.verify_cmd
                        ),
                        cwd=self.workdir,
                        env=self.env,
                        sandboxed=self.walls is not None,
                    ),
                    spill_dir=self.spill_dir,
                ),
                self.stop_event,
                what="the verify command",
            )
        except TurnPreempted:
            return self._ev("verify_cmd", 0.0, "stopped by a person before it finished")
        except TurnExecError as exc:
            return self._ev("verify_cmd", 0.0, f"could not start: {exc}")
        last = tail(result.stdout, 300).strip().splitlines()[-3:]
        detail = f"exit {result.exit_code} after {result.duration:.1f}s"
        if last:
            detail += ": " + " | ".join(last)
        return self._ev("verify_cmd", 1.0 if result.exit_code == 0 else 0.0, detail)

    async def _pr_ci(self, is_repo: bool) -> Evidence:
        if not is_repo:
            return self._ev("pr_ci", None, "not a git repository")
        gh = shutil.which(self.gh_bin)
        if gh is None:
            return self._ev("pr_ci", None, "the GitHub CLI, gh, is not installed")
        if not await self._git.has_remote():
            return self._ev("pr_ci", None, "no git remote")
        try:
            result = await until_stopped(
                run_process(
                    ProcessSpec(
                        argv=[gh, "pr", "view", "--json", "state,url,statusCheckRollup"],
                        cwd=self.workdir,
                    ),
                    spill_dir=self.spill_dir,
                ),
                self.stop_event,
                what="gh",
            )
        except (TurnPreempted, TurnExecError) as exc:
            return self._ev("pr_ci", None, f"gh failed: {exc}")
        if result.exit_code != 0:
            return self._ev("pr_ci", None, "no pull request for this branch")
        try:
            data = json.loads(result.stdout)
        except json.JSONDecodeError:
            return self._ev("pr_ci", None, "unreadable gh output")
        return self._ev(*_judge_pr(data))


def _judge_pr(data: object) -> tuple[str, float | None, str]:
    if not isinstance(data, dict):
        return ("pr_ci", None, "unreadable gh output")
    state = str(data.get("state", "")).upper()
    url = str(data.get("url", ""))
    if state == "MERGED":
        return ("pr_ci", 1.0, f"merged {url}")
    if state == "CLOSED":
        return ("pr_ci", 0.0, f"closed without merge {url}")
    checks = data.get("statusCheckRollup") or []
    conclusions = []
    for check in checks if isinstance(checks, list) else []:
        if isinstance(check, dict):
            value = check.get("conclusion") or check.get("state") or check.get("status")
            conclusions.append(str(value or "").upper())
    failed = {"FAILURE", "ERROR", "CANCELLED", "TIMED_OUT", "ACTION_REQUIRED", "STARTUP_FAILURE"}
    passed = {"SUCCESS", "NEUTRAL", "SKIPPED"}
    if any(c in failed for c in conclusions):
        return ("pr_ci", 0.0, f"CI failing on {url}")
    if all(c in passed for c in conclusions):
        return ("pr_ci", 1.0, f"open {url}, {len(conclusions)} check(s) passed")
    return ("pr_ci", 0.5, f"open {url}, CI pending")
