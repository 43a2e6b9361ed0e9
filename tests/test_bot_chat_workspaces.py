"""Chats with no project each have their own workspace; each /auto run a worktree of it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from bot.app import BotRuntime
from engine.store.runs import RunStatus
from tests.automode_support import CLARIFY, EVALUATE, EXECUTE, GIT_ENV, PLAN, commit_step
from tests.fakes.bot_api import FakeBotApi, SentMessage
from tests.fakes.bot_harness import (
    OPERATOR,
    agent_log,
    bot_settings,
    running_bot,
    wait_for_run_status,
    write_script,
)

pytestmark = [pytest.mark.usefixtures("isolated_env", "bot_backend"), pytest.mark.timeout(90)]

GROUP_A = -1001
GROUP_B = -1002

# A chat turn that leaves files uncommitted, as a person's session in a group does; then
# auto runs that commit their result and claim completion.
_RULES: list[dict[str, Any]] = [
    {
        "match": "leave notes",
        "text": "noted",
        "files": {"approved.txt": "yes\n", "report.txt": "draft\n"},
    },
    {"match": "look around", "text": "looked"},
    {"match": CLARIFY, "text": "Goal: result.txt committed."},
    {"match": PLAN, "text": "1. write result.txt and commit it"},
    {"match": EXECUTE, **commit_step("result.txt")},
    {"match": EVALUATE, "text": "ok\nAUTO-MODE STATUS: COMPLETE\n"},
]


@pytest.fixture
def git_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)


def _in(chat: int, thread: int | None = None) -> Any:
    def match(m: SentMessage) -> bool:
        return m.chat_id == chat and (thread is None or m.thread_id == thread)

    return match


async def _chat_turn(
    api: FakeBotApi, chat: int, thread: int | None = None, *, notes: bool = True
) -> None:
    """A chat session here, and one turn (that leaves files uncommitted with ``notes``)."""
    here = _in(chat, thread)
    api.push_message(chat_id=chat, user_id=OPERATOR, text="/chat", thread_id=thread)
    bound = await api.wait_for_message(lambda m: here(m) and "bound to a new" in m.text)
    place = "topic" if thread else "chat"
    assert bound.text.startswith(
        f"🔗 This {place} is bound to a new command session (this {place}'s own workspace). "
    ), bound.text
    text, answer = ("leave notes", "noted") if notes else ("look around", "looked")
    api.push_message(chat_id=chat, user_id=OPERATOR, text=text, thread_id=thread)
    await api.wait_for_message(lambda m: here(m) and m.text == answer, timeout=30)


async def _auto(
    api: FakeBotApi, rt: BotRuntime, chat: int, thread: int | None = None
) -> tuple[str, SentMessage]:
    """An /auto run here to its end: its id and its final report."""
    here = _in(chat, thread)
    api.push_message(chat_id=chat, user_id=OPERATOR, text="/auto make result.txt", thread_id=thread)
    started = await api.wait_for_message(lambda m: here(m) and m.text.startswith("🤖 Auto run "))
    run_id = started.text.split()[3]
    place = "topic" if thread else "chat"
    # (Not shown when the run's own status is written first.)
    for text in [*started.history, started.text]:
        if text.startswith(f"🤖 Auto run {run_id} started ("):
            assert text.startswith(
                f"🤖 Auto run {run_id} started (command, this {place}'s own workspace).\n"
            ), text
    report = await api.wait_for_message(
        lambda m: here(m) and m.text.startswith(f"Auto run {run_id}: "), timeout=40
    )
    return run_id, report


async def _workdir(rt: BotRuntime, run_id: str) -> Path:
    run = await rt.runs.get_run(run_id)
    assert run is not None
    return Path(run.workdir or "")


def _git(folder: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(folder), *args], capture_output=True, text=True, check=True
    )
    return done.stdout


@pytest.mark.usefixtures("git_env")
async def test_two_groups_each_have_their_own_workspace_and_their_runs_a_worktree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {"rules": _RULES}, monkeypatch)
    async with (
        FakeBotApi() as api,
        running_bot(api, bot_settings(api, tmp_path, allowed_chats=(GROUP_A, GROUP_B))) as rt,
    ):
        # Group A: a chat session that leaves two files uncommitted, and a file sent to it.
        await _chat_turn(api, GROUP_A)
        api.push_document(
            chat_id=GROUP_A,
            user_id=OPERATOR,
            data=b"a,b\n1,2\n",
            file_name="private.csv",
            mime_type="text/csv",
            caption="keep this",
        )
        await api.wait_for_message(lambda m: m.chat_id == GROUP_A and "keep this" in m.text)
        binding_a = await rt.store.binding(str(GROUP_A), None)
        assert binding_a is not None
        session_a = Path(binding_a.workdir)
        assert (session_a / "uploads" / "private.csv").read_bytes() == b"a,b\n1,2\n"
        # Group B: an auto run is not judged on group A's uncommitted files.
        run_b, report_b = await _auto(api, rt, GROUP_B)
        assert report_b.text.startswith(f"Auto run {run_b}: completed"), report_b.text
        assert "not accepted" not in report_b.text
        assert "uncommitted" not in report_b.text
        await wait_for_run_status(rt, run_b, RunStatus.COMPLETED)
        # Group B's chat session, and an auto run in group A.
        await _chat_turn(api, GROUP_B, notes=False)
        binding_b = await rt.store.binding(str(GROUP_B), None)
        assert binding_b is not None
        session_b = Path(binding_b.workdir)
        run_a, report_a = await _auto(api, rt, GROUP_A)
        assert report_a.text.startswith(f"Auto run {run_a}: completed"), report_a.text
        workdir_a = await _workdir(rt, run_a)
        workdir_b = await _workdir(rt, run_b)
    # Four places: each chat's own workspace, and a worktree of it for each run.
    root = (tmp_path / "ws").resolve()
    assert session_a == root / "chats" / f"chat_{GROUP_A}"
    assert session_b == root / "chats" / f"chat_{GROUP_B}"
    assert workdir_a == root / "worktrees" / f"chat_{GROUP_A}" / run_a
    assert workdir_b == root / "worktrees" / f"chat_{GROUP_B}" / run_b
    # Nothing of group A's is in group B's folders: not its notes, not its upload.
    for folder in (session_b, workdir_b):
        assert not (folder / "approved.txt").exists()
        assert not (folder / "uploads").exists()
    assert (session_a / "approved.txt").exists()
    # The agent worked where it was told: each turn's cwd is one of these folders.
    cwds = {Path(entry["cwd"]).resolve() for entry in agent_log(tmp_path)}
    assert cwds == {session_a, session_b, workdir_a, workdir_b}
    # Each run's commit is on its own branch, cut from its chat's workspace.
    assert _git(workdir_b, "log", "--format=%s").splitlines() == [
        "add result.txt",
        "turnstile: a new workspace",
    ]
    assert _git(workdir_b, "status", "--porcelain") == ""


@pytest.mark.usefixtures("git_env")
async def test_two_topics_of_a_forum_each_have_their_own_workspace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {"rules": _RULES}, monkeypatch)
    async with (
        FakeBotApi() as api,
        running_bot(api, bot_settings(api, tmp_path, allowed_chats=(GROUP_A,))) as rt,
    ):
        await _chat_turn(api, GROUP_A, 7)
        run_9, report_9 = await _auto(api, rt, GROUP_A, 9)
        # Topic 7's session left files uncommitted: topic 9's run is not judged on them.
        assert report_9.text.startswith(f"Auto run {run_9}: completed"), report_9.text
        run_7, report_7 = await _auto(api, rt, GROUP_A, 7)
        assert report_7.text.startswith(f"Auto run {run_7}: completed"), report_7.text
        binding_7 = await rt.store.binding(str(GROUP_A), "7")
        assert binding_7 is not None
        workdir_7 = await _workdir(rt, run_7)
        workdir_9 = await _workdir(rt, run_9)
        # Asked in the forum's general topic: it reports in a topic of its own, and works
        # in a worktree of the general topic's workspace (where it was asked).
        payload = api.message_payload(
            chat_id=GROUP_A, user_id=OPERATOR, text="/auto make result.txt"
        )
        payload["chat"]["is_forum"] = True
        api.push_update({"message": payload})
        started = await api.wait_for_message(
            lambda m: (
                m.chat_id == GROUP_A
                and m.text.startswith("🤖 Auto run ")
                and m.thread_id not in (7, 9)
            )
        )
        assert started.thread_id is not None
        run_general = started.text.split()[3]
        for text in [*started.history, started.text]:
            if " started (" in text:
                assert "started (command, this chat's own workspace)" in text, text
        await wait_for_run_status(rt, run_general, RunStatus.COMPLETED, timeout=40)
        workdir_general = await _workdir(rt, run_general)
    root = (tmp_path / "ws").resolve()
    assert workdir_general == root / "worktrees" / f"chat_{GROUP_A}" / run_general
    assert Path(binding_7.workdir) == root / "chats" / f"chat_{GROUP_A}_topic_7"
    assert workdir_7 == root / "worktrees" / f"chat_{GROUP_A}_topic_7" / run_7
    assert workdir_9 == root / "worktrees" / f"chat_{GROUP_A}_topic_9" / run_9
    assert not (workdir_9 / "approved.txt").exists()
