"""CompletionVerifier and WorkSummaryGenerator against real git repositories, a real verify
command and a stand-in ``gh`` executable (a script answering like ``gh pr view --json``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.automode import CompletionVerifier, Verdict, WorkSummaryGenerator
from engine.automode.git import Git
from engine.automode.verifier import evidence_gap
from tests.automode_support import GIT_ENV, git_workspace


@pytest.fixture(autouse=True)
def git_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout


def commit(repo: Path, name: str, content: str = "x\n") -> None:
    (repo / name).write_text(content)
    git(repo, "add", name)
    git(repo, "commit", "-q", "-m", f"add {name}")


def fake_gh(folder: Path, *, answer: dict[str, object] | None, code: int = 0) -> Path:
    """An executable standing in for ``gh``: prints ``answer`` as JSON, exits ``code``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "gh"
    payload = json.dumps(answer) if answer is not None else ""
    path.write_text(
        f"#!{sys.executable}\nimport sys\n"
        f"assert sys.argv[1:3] == ['pr', 'view'], sys.argv\n"
        f"print({payload!r})\nsys.exit({code})\n"
    )
    path.chmod(0o755)
    return path


async def test_commits_and_clean_tree_are_measured(tmp_path: Path) -> None:
    repo = git_workspace(tmp_path / "repo")
    base = await Git(repo).head()
    verifier = CompletionVerifier(repo, base_commit=base)
    before = await verifier.verify(Verdict.COMPLETE)
    assert [(e.name, e.label) for e in before.evidence] == [
        ("commits", "fail"),
        ("clean_tree", "pass"),
        ("verify_cmd", "unknown"),
        ("pr_ci", "unknown"),
    ]
    assert before.score == 0.5
    assert not before.accepted
    commit(repo, "a.txt")
    (repo / "scratch.txt").write_text("uncommitted")
    dirty = await verifier.verify(Verdict.COMPLETE)
    assert dirty.evidence[0].detail == "1 since the run started"
    assert dirty.evidence[1].label == "fail"
    assert "scratch.txt" in dirty.evidence[1].detail
    assert not dirty.accepted
    (repo / "scratch.txt").unlink()
    done = await verifier.verify(Verdict.COMPLETE)
    assert done.score == 1.0
    assert done.accepted
    # The agent's word alone is never enough, nor is evidence without the claim.
    assert not (await verifier.verify(Verdict.IN_PROGRESS)).accepted


async def test_excluded_log_folder_does_not_dirty_the_tree(tmp_path: Path) -> None:
    repo = git_workspace(tmp_path / "repo")
    logs = repo / "runs" / "auto-1"
    logs.mkdir(parents=True)
    (logs / "transcript.md").write_text("log")
    plain = CompletionVerifier(repo, base_commit=await Git(repo).head())
    assert (await plain.verify(Verdict.COMPLETE)).evidence[1].label == "fail"
    excluding = CompletionVerifier(repo, base_commit=await Git(repo).head(), exclude=[logs])
    assert (await excluding.verify(Verdict.COMPLETE)).evidence[1].label == "pass"


async def test_not_a_repository_measures_nothing_and_accepts_nothing(tmp_path: Path) -> None:
    verifier = CompletionVerifier(tmp_path, base_commit=None)
    result = await verifier.verify(Verdict.COMPLETE)
    assert all(e.value is None for e in result.evidence)
    assert result.score == 0.0
    assert not result.accepted


async def test_verify_command_result_is_evidence(tmp_path: Path) -> None:
    repo = git_workspace(tmp_path / "repo")
    base = await Git(repo).head()
    commit(repo, "a.txt")
    check = [
        sys.executable,
        "-c",
        "import pathlib, sys; sys.exit(0 if pathlib.Path('ok').exists() else 3)",
    ]
    verifier = CompletionVerifier(repo, base_commit=base, verify_cmd=check)
    failing = await verifier.verify(Verdict.COMPLETE)
    assert failing.evidence[2].label == "fail"
    assert failing.evidence[2].detail.startswith("exit 3 after")
    assert failing.score == pytest.approx(2 / 3)
    assert not failing.accepted
    commit(repo, "ok")
    passing = await verifier.verify(Verdict.COMPLETE)
    assert passing.evidence[2].label == "pass"
    assert passing.accepted
    skipped = await verifier.verify(Verdict.IN_PROGRESS, run_verify_cmd=False)
    assert skipped.evidence[2].value is None


@pytest.mark.parametrize(
    ("answer", "code", "label", "detail"),
    [
        ({"state": "MERGED", "url": "u", "statusCheckRollup": []}, 0, "pass", "merged u"),
        (
            {"state": "OPEN", "url": "u", "statusCheckRollup": [{"conclusion": "SUCCESS"}]},
            0,
            "pass",
            "open u, 1 check(s) passed",
        ),
        (
            {
                "state": "OPEN",
                "url": "u",
                "statusCheckRollup": [{"conclusion": "SUCCESS"}, {"conclusion": "FAILURE"}],
            },
            0,
            "fail",
            "CI failing on u",
        ),
        (
            {"state": "OPEN", "url": "u", "statusCheckRollup": [{"status": "IN_PROGRESS"}]},
            0,
            "partial",
            "open u, CI pending",
        ),
        ({"state": "CLOSED", "url": "u"}, 0, "fail", "closed without merge u"),
        (None, 1, "unknown", "no pull request for this branch"),
    ],
)
async def test_pr_and_ci_state_through_gh(
    tmp_path: Path, answer: dict[str, object] | None, code: int, label: str, detail: str
) -> None:
    repo = git_workspace(tmp_path / "repo")
    git(repo, "remote", "add", "origin", "https://example.invalid/repo.git")
    gh = fake_gh(tmp_path / "bin", answer=answer, code=code)
    verifier = CompletionVerifier(repo, base_commit=None, gh_bin=str(gh))
    evidence = (await verifier.verify(Verdict.COMPLETE)).evidence[3]
    assert (evidence.label, evidence.detail) == (label, detail)


async def test_gh_absent_or_no_remote_is_unknown_not_failure(tmp_path: Path) -> None:
    repo = git_workspace(tmp_path / "repo")
    gh = fake_gh(tmp_path / "bin", answer={"state": "MERGED", "url": "u"})
    no_remote = CompletionVerifier(repo, base_commit=None, gh_bin=str(gh))
    assert (await no_remote.verify(Verdict.COMPLETE)).evidence[3].detail == "no git remote"
    git(repo, "remote", "add", "origin", "https://example.invalid/repo.git")
    missing = CompletionVerifier(repo, base_commit=None, gh_bin=str(tmp_path / "nope" / "gh"))
    result = await missing.verify(Verdict.COMPLETE)
    assert (result.evidence[3].value, result.evidence[3].detail) == (
        None,
        "the GitHub CLI, gh, is not installed",
    )


async def test_work_summary_lists_commits_and_changes(tmp_path: Path) -> None:
    repo = git_workspace(tmp_path / "repo")
    base = await Git(repo).head()
    commit(repo, "a.txt", "1\n2\n")
    commit(repo, "b.txt", "3\n")
    summary = await WorkSummaryGenerator(repo, base_commit=base).generate("Looks done. " * 100)
    assert len(summary.commits) == 2
    assert summary.commits[0].endswith("add b.txt")
    assert (summary.files_changed, summary.insertions, summary.deletions) == (2, 3, 0)
    text = summary.render()
    assert "Commits since start: 2; files changed: 2 (+3 -0)" in text
    assert "add a.txt" in text
    assert len(summary.last_evaluation) <= 601


async def test_empty_repository_counts_everything_as_the_runs_work(tmp_path: Path) -> None:
    repo = tmp_path / "empty"
    subprocess.run(["git", "init", "-q", str(repo)], check=True, env={**os.environ, **GIT_ENV})
    base = await Git(repo).head()
    assert base is None
    verifier = CompletionVerifier(repo, base_commit=base)
    assert (await verifier.verify(Verdict.COMPLETE)).evidence[0].label == "fail"
    commit(repo, "first.txt")
    assert (await verifier.verify(Verdict.COMPLETE)).accepted
    summary = await WorkSummaryGenerator(repo, base_commit=base).generate()
    assert (len(summary.commits), summary.files_changed) == (1, 1)


async def test_not_a_repository_summary(tmp_path: Path) -> None:
    summary = await WorkSummaryGenerator(tmp_path, base_commit=None).generate("e")
    assert not summary.is_repo
    assert "not a git repository" in summary.render()


async def test_why_a_claim_was_not_accepted_reads_as_words(tmp_path: Path) -> None:
    repo = git_workspace(tmp_path / "ws")
    base = git(repo, "rev-parse", "HEAD").strip()
    (repo / "draft.txt").write_text("x\n")
    verifier = CompletionVerifier(repo, base_commit=base, gh_bin="no-such-gh")
    result = await verifier.verify(Verdict.COMPLETE)
    assert not result.accepted
    assert result.why_not() == (
        "evidence: no commit since the run started, tree dirty (1 uncommitted path(s): "
        "draft.txt) (score 0.00, 0.80 needed)"
    )
    # nothing measurable: what could not be measured is said instead
    plain = tmp_path / "plain"
    plain.mkdir()
    nothing = await CompletionVerifier(plain, base_commit=None).verify(Verdict.COMPLETE)
    assert nothing.why_not().startswith("evidence: commits unknown (not a git repository)")


async def test_evidence_gap_names_a_folder_that_is_no_repository(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    gap = await evidence_gap(plain)
    assert gap is not None
    assert "is not a git repository" in gap
    assert await evidence_gap(git_workspace(tmp_path / "ws")) is None
    # a folder that is not there is refused elsewhere (where the run is prepared)
    assert await evidence_gap(tmp_path / "missing") is None
