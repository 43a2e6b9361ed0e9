"""Auto mode from the chat: /auto to completion with a steering message, end to end."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.store.runs import RunStatus
from tests.automode_support import CLARIFY, EVALUATE, EXECUTE, GIT_ENV, PLAN, git_workspace
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import (
    CHAT,
    OPERATOR,
    STRANGER,
    agent_log,
    alive,
    bot_settings,
    running_bot,
    wait_for_file,
    wait_for_run_status,
    write_script,
)

pytestmark = [pytest.mark.usefixtures("isolated_env"), pytest.mark.timeout(90)]


@pytest.fixture
def git_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)


@pytest.mark.usefixtures("git_env")
async def test_auto_run_to_completion_with_steering(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    git_workspace(tmp_path / "ws" / "default")
    release = tmp_path / "release"
    write_script(
        tmp_path,
        {
            "rules": [
                {
                    "match": CLARIFY,
                    "text": "Goal: result.txt committed.",
                    "wait_file": str(release),
                },
                {"match": PLAN, "text": "1. write result.txt"},
                {
                    "match": EXECUTE,
                    "text": "committed",
                    "files": {"result.txt": "done\n"},
                    "run": [
                        ["git", "add", "result.txt"],
                        ["git", "commit", "-q", "-m", "add result"],
                    ],
                },
                {"match": EVALUATE, "text": "ok\nAUTO-MODE STATUS: COMPLETE\n"},
            ]
        },
        monkeypatch,
    )
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        asked = api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto write result.txt")
        started = await api.wait_for_message(lambda m: m.text.startswith("🤖 Auto run"))
        run_id = started.text.split()[3]
        # a stranger cannot steer; an operator can, by plain message
        api.push_message(chat_id=CHAT, user_id=STRANGER, text="delete everything")
        await api.wait_for_message(lambda m: "Not allowed" in m.text)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="also mention the README")
        await api.wait_for_message(lambda m: "Noted for run" in m.text)
        release.touch()
        await api.wait_for_message(lambda m: "Objective achieved" in m.text, timeout=40)
        record = await rt.runs.get_run(run_id)
        assert record.status is RunStatus.COMPLETED
        # the live status message exists once, under the /auto, and was edited in place
        status = [m for m in api.sent if m.text.startswith(f"🤖 Auto run {run_id}")]
        assert len(status) == 1
        assert status[0].edits >= 1
        assert status[0].reply_to == api.pushed(asked)["message"]["message_id"]
        # one live message, the answers to people, the report and the turns as a document:
        # no message per turn
        turns = await api.wait_for_message(lambda m: m.filename == f"turns-{run_id}.md")
        assert turns.document is not None
        assert b"Clarify, exit 0]" in turns.document
        assert b"Evaluate, exit 0]" in turns.document
        assert not any(m.text.startswith("[turn ") for m in api.sent)
        # the live message, the stranger's refusal, "noted", the report, the turns
        assert len(api.sent) == 5, [m.text[:40] for m in api.sent]
    prompts = [e["prompt"] for e in agent_log(tmp_path)]
    executes = [p for p in prompts if EXECUTE in p]
    assert len(executes) == 1
    assert "also mention the README" in executes[0]
    assert not any("delete everything" in p for p in prompts)
    assert not any("also mention the README" in p for p in prompts if EXECUTE not in p)


@pytest.mark.usefixtures("git_env")
async def test_stop_by_run_id_preempts_an_auto_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    git_workspace(tmp_path / "ws" / "default")
    pids = tmp_path / "pids"
    monkeypatch.setenv("FAKE_AGENT_PIDS", str(pids))
    write_script(
        tmp_path,
        {"rules": [{"match": CLARIFY, "grandchild": True, "wait_file": str(tmp_path / "never")}]},
        monkeypatch,
    )
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto never ends")
        started = await api.wait_for_message(lambda m: m.text.startswith("🤖 Auto run"))
        run_id = started.text.split()[3]
        agent_pid, child_pid = (int(p) for p in (await wait_for_file(pids)).split())
        api.push_message(chat_id=CHAT, user_id=STRANGER, text=f"/stop {run_id}")
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/stop nosuchrun")
        await api.wait_for_message(lambda m: m.text == "No run nosuchrun here.")
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"/stop {run_id}")
        # Gone within the harness's 1 s grace period plus a generous margin for the bot's
        # round trips on a loaded machine (the agent would wait forever).
        await api.wait_until(lambda: not alive(agent_pid) and not alive(child_pid), timeout=20)
        await wait_for_run_status(rt, run_id, RunStatus.STOPPED)
        entries = await rt.store.audit_entries()
        assert any(e.user_id == STRANGER and e.action == "stop" for e in entries)
