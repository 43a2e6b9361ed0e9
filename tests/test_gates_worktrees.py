"""Autopilot with git worktrees: a wave's sub-tasks each get one, merged back after the wave."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from engine.errors import ConfigError
from engine.gates import DriveOutcome
from engine.gates.worktrees import TaskWorktrees, workspace_id
from engine.workspace import subtask_workspace_id
from engine.workspace.runs import checkout_for_run
from tests.gates_support import (
    AGENT_CMD,
    APPROVER,
    DECOMPOSITION_EMPTY,
    EventSink,
    agent_env,
    make_settings,
    open_gates,
    write_script,
)
from tests.test_workspace_git import git, git_test_env, make_remote

pytestmark = pytest.mark.timeout(120)

ARTIFACTS = {
    "design": "design.md",
    "test_design": "test_plan.md",
    "implement": "implementation.md",
    "bug_find": "bugs.md",
    "adversarial_bug_find": "adversarial_bugs.md",
    "doc_review": "doc_review.md",
    "referee": "referee.md",
}


def _rules(tasks: Path, code: dict[str, tuple[str, str]]) -> list[dict[str, Any]]:
    """Rules keyed on the task and phase; ``code[sub] = (file, content)`` is committed in the
    sub-task's worktree during implement."""
    parent = tasks / "p"
    block = "```subtasks\n" + "".join(f"wave 1: {s}\n" for s in code) + "```\n"
    rules: list[dict[str, Any]] = [
        {"match": "for task p.\nPhase: research (", "files": {str(parent / "research.md"): "r"}},
        {
            "match": "for task p.\nPhase: decomposition (",
            "files": {str(parent / "decomposition.md"): block},
        },
        {"match": "for task p.\nPhase: design (", "files": {str(parent / "design.md"): "d"}},
    ]
    for sub, (name, content) in code.items():
        folder = parent / "subtasks" / sub
        for phase, artifact in ARTIFACTS.items():
            rule: dict[str, Any] = {
                "match": f"for task p.{sub}.\nPhase: {phase} (",
                "files": {str(folder / artifact): f"{phase} of {sub}"},
            }
            if phase == "implement":
                rule["files"][name] = content
                rule["run"] = [["git", "add", name], ["git", "commit", "-q", "-m", f"{sub}"]]
            rules.append(rule)
    return rules


async def _drive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: dict[str, tuple[str, str]]
) -> tuple[DriveOutcome, Any, list[str]]:
    for key, value in git_test_env(tmp_path / "home").items():
        monkeypatch.setenv(key, value)
    remote = make_remote(tmp_path)
    tasks = tmp_path / "tasks"
    script = write_script(tmp_path, {"rules": _rules(tasks, code)})
    for key, value in agent_env(tmp_path, script).items():
        monkeypatch.setenv(key, value)
    settings = make_settings(
        tmp_path, workspaces=tmp_path / "ws", projects=f"demo={remote}#main", tasks_root=tasks
    )
    sink = EventSink()
    async with open_gates(settings, poll_interval=0.05) as gates:
        async with checkout_for_run(settings, gates.store.db, "demo", run_id="p") as ws:
            assert ws is not None
            await gates.init_task("p", folder=tasks / "p", workdir=ws.path)
        handle = gates.start_autopilot("p", sink, tool="command", agent_cmd=AGENT_CMD)
        parent_design = asyncio.Event()

        async def approver() -> None:
            while True:
                request = await sink.queue.get()
                if request.task == "p" and request.phase == "design":
                    parent_design.set()  # the waves are done: stop here
                    continue
                assert (await gates.approve(request.task, by=APPROVER)).ok

        helper = asyncio.create_task(approver(), name="approver")
        done = asyncio.create_task(handle.wait(), name="drive")
        waiter = asyncio.create_task(parent_design.wait(), name="design-gate")
        await asyncio.wait({done, waiter}, timeout=100, return_when=asyncio.FIRST_COMPLETED)
        helper.cancel()
        outcome = done.result() if done.done() else DriveOutcome.PARKED
        if not done.done():
            await handle.stop()
        waiter.cancel()
        subs = [(s.name, str(s.workdir)) for s in await gates.store.subtasks("p")]
        return outcome, ws, [*sink.texts, *map(str, subs)]


async def test_wave_subtasks_work_in_their_own_worktrees_and_merge_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = {"a1": ("a1.txt", "from a1\n"), "a2": ("a2.txt", "from a2\n")}
    outcome, ws, texts = await _drive(tmp_path, monkeypatch, code)
    assert outcome is DriveOutcome.PARKED, "\n".join(texts)  # stopped at the parent's design gate
    for sub in ("a1", "a2"):
        worktree = tmp_path / "ws" / "worktrees" / "demo" / f"p--{sub}"
        assert git("log", "-1", "--format=%s", f"turnstile/p--{sub}", cwd=ws.path) == sub
        assert any(str(worktree) in t for t in texts)
    # Both sub-task branches were merged into the parent's branch, in its worktree.
    assert (ws.path / "a1.txt").read_text() == "from a1\n"
    assert (ws.path / "a2.txt").read_text() == "from a2\n"
    assert any("wave 1 merged" in t for t in texts)


async def test_a_merge_conflict_sends_the_parent_to_a_person(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = {"a1": ("shared.txt", "one\n"), "a2": ("shared.txt", "two\n")}
    outcome, _ws, texts = await _drive(tmp_path, monkeypatch, code)
    assert outcome is DriveOutcome.HUMAN_INTERVENTION, "\n".join(texts)
    assert any("did not merge" in t and "shared.txt" in t for t in texts)


async def test_a_nested_wave_maps_workspace_ids_down_the_task_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sub-task b of sub-task a of task p (task p.a.b) works in p--a--b, cut from p--a's
    branch; holding it, and merging it back into p--a, find that same worktree."""
    for key, value in git_test_env(tmp_path / "home").items():
        monkeypatch.setenv(key, value)
    remote = make_remote(tmp_path)
    settings = make_settings(tmp_path, workspaces=tmp_path / "ws", projects=f"demo={remote}#main")
    async with open_gates(settings) as gates:
        db = gates.store.db
        async with checkout_for_run(settings, db, "demo", run_id="p") as ws:
            assert ws is not None
            top = await gates.init_task("p", workdir=ws.path)
        mid = await gates.store.init_task("p.a", parent="p", wave=1)
        leaf = await gates.store.init_task("p.a.b", parent="p.a", wave=1)
        worktrees = TaskWorktrees(settings, db)
        assert await worktrees.before_wave(top, [mid]) == {"p.a": ws.path.parent / "p--a"}
        inner = await worktrees.before_wave(mid, [leaf])
        assert inner == {"p.a.b": ws.path.parent / "p--a--b"}
        assert await worktrees.workspace_id(leaf) == "p--a--b"
        leaf_path = inner["p.a.b"]
        assert git("symbolic-ref", "--short", "HEAD", cwd=leaf_path) == "turnstile/p--a--b"
        async with worktrees.hold(leaf) as held:
            assert held is not None
            assert held.path == leaf_path
        (leaf_path / "leaf.txt").write_text("from b\n")
        git("add", "leaf.txt", cwd=leaf_path)
        git("commit", "-q", "-m", "b", cwd=leaf_path)
        done = dataclasses.replace(leaf, phase="complete")
        assert await worktrees.after_wave(mid, [done]) == {}
    # Merged into p.a's branch, in p.a's worktree; p itself is untouched until its wave ends.
    assert (ws.path.parent / "p--a" / "leaf.txt").read_text() == "from b\n"
    assert not (ws.path / "leaf.txt").exists()


def test_one_function_joins_workspace_ids() -> None:
    assert workspace_id("p") == "p"
    assert workspace_id("p", ["a", "b"]) == subtask_workspace_id("p--a", "b") == "p--a--b"
    for bad in ("a--b", "a/b", "..", ""):
        with pytest.raises(ConfigError, match="invalid sub-task name"):
            workspace_id("p", [bad])


async def test_a_complete_task_says_what_it_changed_and_pushes_its_branch_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drive's last words carry the task's changes and where its branch went."""
    for key, value in git_test_env(tmp_path / "home").items():
        monkeypatch.setenv(key, value)
    remote = make_remote(tmp_path)
    tasks = tmp_path / "tasks"
    folder = tasks / "p"
    rules: list[dict[str, Any]] = [
        {"match": f"for task p.\nPhase: {phase} (", "files": {str(folder / artifact): phase}}
        for phase, artifact in {
            "research": "research.md",
            "decomposition": "decomposition.md",
            **ARTIFACTS,
        }.items()
    ]
    rules[1]["files"][str(folder / "decomposition.md")] = DECOMPOSITION_EMPTY
    implement = next(r for r in rules if "implement (" in r["match"])
    implement["files"]["feature.txt"] = "new\nfeature\n"
    implement["run"] = [["git", "add", "feature.txt"], ["git", "commit", "-q", "-m", "feature"]]
    script = write_script(tmp_path, {"rules": rules})
    for key, value in agent_env(tmp_path, script).items():
        monkeypatch.setenv(key, value)
    settings = make_settings(
        tmp_path, workspaces=tmp_path / "ws", projects=f"demo={remote}#main", tasks_root=tasks
    )
    sink = EventSink()
    async with open_gates(settings, poll_interval=0.05) as gates:
        async with checkout_for_run(settings, gates.store.db, "demo", run_id="p") as ws:
            assert ws is not None
            await gates.init_task("p", folder=folder, workdir=ws.path)
        handle = gates.start_autopilot("p", sink, tool="command", agent_cmd=AGENT_CMD)

        async def approver() -> None:
            while True:
                request = await sink.queue.get()
                assert (await gates.approve(request.task, by=APPROVER)).ok

        helper = asyncio.create_task(approver(), name="approver")
        try:
            outcome = await asyncio.wait_for(handle.wait(), 100)
        finally:
            helper.cancel()
    assert outcome is DriveOutcome.COMPLETE, "\n".join(sink.texts)
    final = next(t for t in sink.texts if t.startswith("[p] complete"))
    assert "Changed since the start: 1 file changed, 2 insertions(+)" in final
    assert "feature.txt | +2 -0" in final
    assert f"Branch: turnstile/p, pushed to {remote}" in final
    assert git("log", "-1", "--format=%s", "turnstile/p", cwd=remote) == "feature"
