"""Hostile files in a task folder (issue 15, items 1 and 2) and sub-task name squatting
(item 7), against real pipes, links and the real gates store on a SQLite file.

Scenarios that hung the engine before (a reader waiting on a named pipe, hashing
``/dev/zero``) run in a child process or a child bot, so a regression fails within a
bound instead of hanging the test session.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from engine.automode.append import InstructionInbox
from engine.gates import AWAITING_APPROVAL, HUMAN_INTERVENTION, ApprovalOutcome, Refusal
from engine.gates.refusals import GateRefused
from tests.bot_process import bot_env
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import (
    APPROVER as BOT_APPROVER,
)
from tests.fakes.bot_harness import (
    CHAT,
    OPERATOR,
    bot_settings,
    running_bot,
    write_script,
)
from tests.gates_support import (
    AGENT_CMD,
    APPROVER,
    REPO,
    EventSink,
    agent_env,
    make_settings,
    open_gates,
    phase_rules,
)
from tests.gates_support import write_script as write_gates_script

pytestmark = pytest.mark.timeout(180)

SECRET = "s3cr3t-0f-the-h0st"
PIPES = [f"pipe{i}" for i in range(1, 7)]


def _plant(path: Path, kind: str) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "devzero":
        path.symlink_to("/dev/zero")
    else:
        raise ValueError(kind)


# -- item 1: the engine is not frozen by pipes or /dev/zero ------------------------------


async def _child_artifacts(root: Path, kind: str) -> None:
    """Six tasks whose artifacts (and one ``.state``) are pipes or links to /dev/zero."""
    result: dict[str, Any] = {}
    started = time.monotonic()
    async with open_gates(make_settings(root, approvers=(APPROVER,))) as gates:
        for name in PIPES:
            task = await gates.init_task(name)
            _plant(task.folder / "research.md", kind)
        first = await gates.task(PIPES[0])
        (first.folder / ".state").unlink()
        _plant(first.folder / ".state", kind)

        async def attempt(name: str) -> list[str]:
            try:
                await gates.store.transition(name, f"research:{AWAITING_APPROVAL}")
            except GateRefused as exc:
                return [exc.reason.value, exc.detail]
            return ["opened", ""]

        result["refusals"] = await asyncio.gather(*(attempt(n) for n in PIPES))
        _, violations = await gates.store.validate(PIPES[0])
        result["violations"] = [v.detail for v in violations]
        # The engine still answers: an ordinary task reaches its gate.
        plain = await gates.init_task("plain")
        (plain.folder / "research.md").write_text("# research\n")
        moved = await gates.store.transition("plain", f"research:{AWAITING_APPROVAL}")
        result["plain"] = moved.label
        events = await gates.store.audit_events(limit=200)
        result["audit"] = [[e.task, e.event, e.outcome] for e in events]
    result["seconds"] = time.monotonic() - started
    print(json.dumps(result), flush=True)


def _run_child(*args: str, timeout: float = 60.0, memory: int | None = None) -> dict[str, Any]:
    """Run a scenario of this module in a child process; it must exit within ``timeout``
    (its event loop's shutdown waits for every worker thread, so a blocked read fails it)."""

    env = dict(os.environ)
    if memory is not None:
        env["HOSTILE_MEMORY_LIMIT"] = str(memory)
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tests.test_hostile_files", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{args[0]} did not finish within {timeout} s (frozen)") from None
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["wall"] = time.monotonic() - started
    return out


@pytest.mark.parametrize("kind", ["fifo", "devzero"])
def test_pipe_and_dev_zero_artifacts_are_refused_without_freezing(
    tmp_path: Path, kind: str
) -> None:
    out = _run_child("artifacts", str(tmp_path), kind)
    assert len(out["refusals"]) == 6
    for reason, detail in out["refusals"]:
        assert reason == Refusal.INVALID_ARTIFACT.value
        assert detail.startswith("research.md ")
        if kind == "fifo":
            assert "not a regular file (it is a named pipe)" in detail
        else:
            assert "outside its folder" in detail
    assert any(".state" in v for v in out["violations"])
    assert out["plain"] == f"research:{AWAITING_APPROVAL}"
    unsafe = [a for a in out["audit"] if a[1] == "unsafe_artifact"]
    assert {a[0] for a in unsafe} == set(PIPES)
    assert out["wall"] < 45  # generous: it takes about two seconds


def _bot_env(root: Path, api: FakeBotApi) -> dict[str, str]:
    return bot_env(
        root,
        api,
        # A private chat: Telegram's 20-a-minute group limit would make this take minutes.
        TURNSTILE_ALLOWED_CHATS=str(OPERATOR),
        TURNSTILE_APPROVERS=str(BOT_APPROVER),
        TURNSTILE_PREEMPT_GRACE="1",
    )


@contextlib.asynccontextmanager
async def _bot_process(root: Path, api: FakeBotApi) -> AsyncIterator[asyncio.subprocess.Process]:
    """``turnstile bot`` as a child (killed on the way out whatever happened)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "engine.cli",
        "bot",
        cwd=root,
        env=_bot_env(root, api),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.timeout(240)
async def test_six_pipe_artifacts_do_not_freeze_the_bot(tmp_path: Path) -> None:
    """The attack run's freeze: six agents leave ``research.md`` as a named pipe. Each is
    refused with a message, a seventh task still reaches its gate, SIGTERM exits soon."""
    mkfifo = "import os; os.path.lexists('research.md') or os.mkfifo('research.md')"
    script = {
        "rules": [
            {"match": "tasks/pipe", "run": [[sys.executable, "-c", mkfifo]], "text": "done"},
            *phase_rules(),
        ]
    }
    (tmp_path / "agent-script.json").write_text(json.dumps(script))
    async with FakeBotApi() as api, _bot_process(tmp_path, api) as proc:
        for name in PIPES:
            api.push_message(chat_id=OPERATOR, user_id=OPERATOR, text=f"/autopilot {name}")

        def stuck(name: str) -> bool:
            return any(f"[{name}] needs a person" in t for t in api.texts())

        await api.wait_until(lambda: all(stuck(n) for n in PIPES), timeout=90)
        for name in PIPES:
            said = next(t for t in api.texts() if f"[{name}] needs a person" in t)
            assert "research.md is not a regular file (it is a named pipe)" in said
        api.push_message(chat_id=OPERATOR, user_id=OPERATOR, text="/autopilot seventh")
        await api.wait_until(
            lambda: any(t.startswith("🛂 Gate:") and "seventh" in t for t in api.texts()),
            timeout=60,
        )
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 45)
        elapsed = time.monotonic() - started
        print(f"SIGTERM to exit with six pipe artifacts: {elapsed:.2f} s")
        assert code == 0
        assert elapsed < 30  # generous: it takes a second or two


# -- item 2: a link out of the task folder is refused, never published -------------------


@pytest.mark.usefixtures("isolated_env")
async def test_a_link_out_of_the_folder_never_reaches_the_chat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text(f"{SECRET}\n")
    link = (
        f"import os; os.path.lexists('research.md') or os.symlink({str(secret)!r}, 'research.md')"
    )
    rules = [
        {"match": "Phase: research (", "run": [[sys.executable, "-c", link]], "text": "wrote it"},
        *phase_rules(),
    ]
    write_script(tmp_path, {"rules": rules}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot leak")

        def seen() -> bool:
            return any(
                "[leak] needs a person" in t or t.startswith("🛂 Gate:") for t in api.texts()
            )

        await api.wait_until(seen, timeout=60)
        texts = api.texts()
        assert not any(t.startswith("🛂 Gate:") for t in texts), "a gate opened on the link"
        problem = next(t for t in texts if "[leak · research] problems:" in t)
        assert "research.md is a symbolic link to something outside its folder" in problem
        assert any("[leak] needs a person" in t for t in texts)
        for message in api.sent:
            assert SECRET not in message.text
            assert message.document is None or SECRET.encode() not in message.document
        from engine.gates import Gates

        gates = Gates(rt.db, rt.settings)
        # "needs a person" is said just before the transition commits.
        async with asyncio.timeout(20):
            while (task := await gates.task("leak")).phase != HUMAN_INTERVENTION:
                await asyncio.sleep(0.02)
        assert task.gate_sha256 is None
        events = await gates.store.audit_events("leak")
        unsafe = [e for e in events if e.event == "unsafe_artifact"]
        assert unsafe
        assert unsafe[0].outcome == "refused:outside_folder"
        assert SECRET not in (unsafe[0].detail or "")


async def test_a_link_swapped_in_under_an_open_gate(tmp_path: Path) -> None:
    """Through the store: a link out is refused at the gate, and if it replaces the artifact
    after the gate opened, approvals are refused and nothing of it is excerpted."""
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    async with open_gates(make_settings(tmp_path)) as gates:
        task = await gates.init_task("t")
        artifact = task.folder / "research.md"
        artifact.symlink_to(secret)
        with pytest.raises(GateRefused) as info:
            await gates.store.transition("t", f"research:{AWAITING_APPROVAL}")
        assert info.value.reason is Refusal.INVALID_ARTIFACT
        assert "outside its folder" in info.value.detail
        assert (await gates.task("t")).sub_state is None

        artifact.unlink()
        artifact.write_text("# honest research\n")
        opened = await gates.store.transition("t", f"research:{AWAITING_APPROVAL}")
        artifact.unlink()
        artifact.symlink_to(secret)
        result = await gates.approve("t", by=APPROVER)
        assert result.outcome is ApprovalOutcome.REFUSED
        assert result.reason is Refusal.INVALID_ARTIFACT
        assert "outside its folder" in result.detail
        assert await gates.store.approvals("t") == []
        assert (await gates.store.reopen_if_changed(opened)).gate_sha256 == opened.gate_sha256
        requests = await gates.pending_gates()
        assert [r.task for r in requests] == ["t"]
        assert SECRET not in requests[0].excerpt
        outcomes = [e.outcome for e in await gates.store.audit_events("t")]
        assert outcomes.count("refused:outside_folder") == 2


async def test_a_state_mirror_linked_out_is_reported_not_read(tmp_path: Path) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"task": "t", "note": SECRET}))
    async with open_gates(make_settings(tmp_path)) as gates:
        task = await gates.init_task("t")
        (task.folder / ".state").unlink()
        (task.folder / ".state").symlink_to(secret)
        _, violations = await gates.store.validate("t")
        details = [v.detail for v in violations]
        assert details == [".state is a symbolic link to something outside its folder"]


def test_a_claimed_instruction_linked_out_is_not_embedded(tmp_path: Path) -> None:
    """Files under ``appended/`` are re-read when a turn re-runs after a crash: a link put
    there must not carry an outside file into the prompt."""
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    inbox = InstructionInbox(tmp_path / "run")
    inbox.ensure()
    (inbox.appended_dir / "000004-1-aaaa.md").symlink_to(secret)
    inbox.append("the real instruction")
    intake = inbox.collect(4)
    texts = [i.text for i in intake.instructions]
    assert texts == ["the real instruction"]


async def _child_fingerprint(root: Path) -> None:
    from engine.gates.gitwatch import fingerprint

    work = root / "work"
    work.mkdir()
    for argv in (["init", "-q"], ["config", "user.email", "t@example.com"]):
        subprocess.run(["git", "-C", str(work), *argv], check=True)
    (work / "zero").symlink_to("/dev/zero")
    (work / "leak").symlink_to(root / "secret.txt")
    (root / "secret.txt").write_text(SECRET)
    before = await fingerprint(work)
    (root / "secret.txt").write_text(SECRET + " changed")
    after = await fingerprint(work)
    print(json.dumps({"before": before, "after": after}), flush=True)


def test_code_fingerprint_does_not_read_links_out_of_the_workdir(tmp_path: Path) -> None:
    """An untracked link to /dev/zero in the code workspace used to be read to the end (it
    has none): memory without bound. The child runs under a 2 GiB address-space limit."""
    out = _run_child("fingerprint", str(tmp_path), memory=2 * 1024**3)
    assert out["before"] is not None
    assert out["before"] == out["after"]  # the outside file's content is not part of it


# -- item 7: a sub-task name already taken ---------------------------------------------------

SPLIT = "# Decomposition\n\n```subtasks\nwave 1: x - the first\nwave 1: y - the second\n```\n"


async def _to_decomposition(gates: Any, name: str) -> Path:
    task = await gates.init_task(name)
    (task.folder / "research.md").write_text("# research\n")
    await gates.store.transition(name, f"research:{AWAITING_APPROVAL}")
    assert (await gates.approve(name, by=APPROVER)).ok
    await gates.store.transition(name, "decomposition")
    folder: Path = task.folder
    return folder


async def test_a_squatted_sub_task_name_is_refused_by_the_decomposition_check(
    tmp_path: Path,
) -> None:
    async with open_gates(make_settings(tmp_path)) as gates:
        squatter = await gates.init_task("c1.x")  # `/autopilot c1.x` before c1 splits
        folder = await _to_decomposition(gates, "c1")
        (folder / "decomposition.md").write_text(SPLIT)
        with pytest.raises(GateRefused) as info:
            await gates.store.transition("c1", f"decomposition:{AWAITING_APPROVAL}")
        assert info.value.reason is Refusal.INVALID_ARTIFACT
        assert "line 4" in info.value.detail
        assert "'x'" in info.value.detail
        assert "existing task 'c1.x'" in info.value.detail
        assert await gates.store.subtasks("c1") == []
        assert await gates.task("c1.x") == squatter


async def test_a_name_taken_after_the_gate_opened_refuses_the_approval(tmp_path: Path) -> None:
    async with open_gates(make_settings(tmp_path)) as gates:
        folder = await _to_decomposition(gates, "c1")
        (folder / "decomposition.md").write_text(SPLIT)
        await gates.store.transition("c1", f"decomposition:{AWAITING_APPROVAL}")
        await gates.init_task("c1.x")
        before = len(await gates.store.approvals("c1"))
        result = await gates.approve("c1", by=APPROVER)
        assert result.outcome is ApprovalOutcome.REFUSED
        assert result.reason is Refusal.INVALID_ARTIFACT
        assert "existing task 'c1.x'" in result.detail
        assert await gates.store.subtasks("c1") == []
        assert len(await gates.store.approvals("c1")) == before  # nothing half-recorded
        assert (await gates.task("c1.x")).parent is None


async def test_a_started_sub_task_of_the_same_parent_is_not_adopted(tmp_path: Path) -> None:
    async with open_gates(make_settings(tmp_path)) as gates:
        folder = await _to_decomposition(gates, "c1")
        sub = await gates.init_task("c1.x", parent="c1", wave=1)
        (sub.folder / "design.md").write_text("# design\n")
        await gates.store.transition("c1.x", f"design:{AWAITING_APPROVAL}")
        (folder / "decomposition.md").write_text(SPLIT)
        with pytest.raises(GateRefused) as info:
            await gates.store.transition("c1", f"decomposition:{AWAITING_APPROVAL}")
        assert "existing sub-task 'c1.x'" in info.value.detail
        assert f"design:{AWAITING_APPROVAL}" in info.value.detail


async def test_an_untouched_sub_task_of_the_same_parent_is_adopted(tmp_path: Path) -> None:
    """The one case that is not a clash: ``c1.x`` already is what the block declares."""
    async with open_gates(make_settings(tmp_path)) as gates:
        folder = await _to_decomposition(gates, "c1")
        await gates.init_task("c1.x", parent="c1", wave=1)
        (folder / "decomposition.md").write_text(SPLIT)
        await gates.store.transition("c1", f"decomposition:{AWAITING_APPROVAL}")
        result = await gates.approve("c1", by=APPROVER)
        assert result.outcome is ApprovalOutcome.APPROVED
        assert result.subtasks_created == ("c1.y",)
        assert [s.name for s in await gates.store.subtasks("c1")] == ["c1.x", "c1.y"]


async def test_the_autopilot_names_the_clash_and_opens_no_gate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = write_gates_script(tmp_path, {"rules": phase_rules(SPLIT)})
    for key, value in agent_env(tmp_path, script).items():
        monkeypatch.setenv(key, value)
    sink = EventSink()
    async with open_gates(make_settings(tmp_path), poll_interval=0.05) as gates:
        await gates.init_task("c1.x")
        await gates.init_task("c1")
        handle = gates.start_autopilot("c1", sink, tool="command", agent_cmd=AGENT_CMD)
        request = await asyncio.wait_for(sink.queue.get(), 30)
        assert request.phase == "research"
        assert (await gates.approve("c1", by=APPROVER)).ok
        outcome = await asyncio.wait_for(handle.wait(), 60)
        assert outcome.value == HUMAN_INTERVENTION
        assert [g.phase for g in sink.gates] == ["research"]
        problems = [t for t in sink.texts if "[c1 · decomposition] problems:" in t]
        assert problems
        assert "existing task 'c1.x'" in problems[0]
        assert await gates.store.subtasks("c1") == []


if __name__ == "__main__":
    if "HOSTILE_MEMORY_LIMIT" in os.environ:
        cap = int(os.environ["HOSTILE_MEMORY_LIMIT"])
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    scenario, root = sys.argv[1], Path(sys.argv[2])
    if scenario == "artifacts":
        asyncio.run(_child_artifacts(root, sys.argv[3]))
    elif scenario == "fingerprint":
        asyncio.run(_child_fingerprint(root))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
