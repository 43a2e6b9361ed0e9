"""Auto mode from the chat: /auto to completion with a steering message, end to end."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from engine.store.runs import RunStatus
from tests.automode_support import (
    ADJUST,
    CLARIFY,
    EVALUATE,
    EXECUTE,
    GIT_ENV,
    PLAN,
    commit_step,
    evaluation,
    git_workspace,
)
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

pytestmark = [pytest.mark.usefixtures("isolated_env", "bot_backend"), pytest.mark.timeout(90)]


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
        await api.wait_for_message(lambda m: "Steering the run needs the operator role" in m.text)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="also mention the README")
        await api.wait_for_message(lambda m: "Noted for run" in m.text)
        release.touch()
        await api.wait_for_message(lambda m: "Objective achieved" in m.text, timeout=40)
        record = await rt.runs.get_run(run_id)
        assert record.status is RunStatus.COMPLETED
        # the live status message exists once, under the /auto, and was edited in place
        status = [m for m in api.sent if m.text.startswith(f"🤖 Auto run {run_id}")]
        assert len(status) == 1
        # Its last edit (finished) may go out after the report: edits are coalesced.
        await api.wait_until(lambda: "✅ finished" in status[0].text)
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
        await api.wait_for_message(
            lambda m: (
                m.text
                == f"No run nosuchrun here. Running here: {run_id}. /status lists this chat's runs."
            )
        )
        # what to type is short on a phone: the end of the run's id
        assert f"/stop {run_id[-6:]} stops it." in started.text
        assert run_id not in started.text.split("\n", 1)[1]
        # the Stop button of the run's live message (a run is also named by its id's end)
        await api.wait_until(lambda: any("Stop" in b["text"] for b in started.buttons))
        stop = next(b for b in started.buttons if "Stop" in b["text"])
        assert stop["callback_data"] == f"sw:{run_id}"
        api.push_callback(
            chat_id=CHAT,
            user_id=OPERATOR,
            data=stop["callback_data"],
            message_id=started.message_id,
        )
        # Gone within the harness's 1 s grace period plus a generous margin for the bot's
        # round trips on a loaded machine (the agent would wait forever).
        await api.wait_until(lambda: not alive(agent_pid) and not alive(child_pid), timeout=20)
        await wait_for_run_status(rt, run_id, RunStatus.STOPPED)
        entries = await rt.store.audit_entries()
        assert any(e.user_id == STRANGER and e.action == "stop" for e in entries)


@pytest.mark.usefixtures("git_env")
async def test_auto_in_the_default_workspace_can_finish_and_says_why_a_claim_was_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No workspace made beforehand: the bot makes the chat's own, a git repository, and
    # the run works in a worktree of it.
    write_script(
        tmp_path,
        {
            "replies": [
                {"text": "Goal: result.txt committed."},
                {"text": "1. write result.txt\n2. commit it"},
                {"text": "wrote it", "files": {"result.txt": "draft\n"}},
                evaluation("COMPLETE", "Looks done to me."),
            ],
            "rules": [
                {"match": EXECUTE, **commit_step("result.txt")},
                {"match": EVALUATE, **evaluation("COMPLETE")},
                {"match": ADJUST, "text": "1. commit result.txt"},
            ],
        },
        monkeypatch,
    )
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto write result.txt")
        started = await api.wait_for_message(lambda m: m.text.startswith("🤖 Auto run "))
        run_id = started.text.split()[3]
        # The final report (the live message says "Objective achieved" too, once done).
        final = await api.wait_for_message(
            lambda m: "Objective achieved" in m.text and m.message_id != started.message_id,
            timeout=40,
        )
        assert (await rt.runs.get_run(run_id)).status is RunStatus.COMPLETED
        # The final report says why the claim was refused (a durable outcome: the live
        # message showed it too, but a throttled edit may skip any line in between).
        assert "Claims of completion not accepted:" in final.text
        assert (
            "Turn 4 claimed complete; not accepted. Evidence: no commit since the run "
            "started, tree dirty (1 uncommitted path(s): result.txt)"
        ) in final.text
        turns = await api.wait_for_message(lambda m: m.filename == f"turns-{run_id}.md")
        assert turns.document is not None
        assert b"Turn 4 claimed complete; not accepted" in turns.document
        # an auto run posts its live message, its final report and its turns: nothing else
        assert [m.message_id for m in api.sent] == [
            started.message_id,
            final.message_id,
            turns.message_id,
        ], [m.text[:50] for m in api.sent]
        workdir = Path((await rt.runs.get_run(run_id)).workdir or "")
    assert workdir.parent == (tmp_path / "ws" / "worktrees" / f"chat_{CHAT}").resolve()
    assert (tmp_path / "ws" / "chats" / f"chat_{CHAT}" / ".git").is_dir()
    log = subprocess.run(
        ["git", "-C", str(workdir), "log", "--format=%s"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert log == ["add result.txt", "turnstile: a new workspace"]


@pytest.mark.usefixtures("git_env")
async def test_auto_counts_every_agent_turn_the_same_way_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two Execute/Evaluate rounds after Clarify and Plan: six agent turns, four rounds,
    # and a limit of four rounds that stops the run there.
    write_script(
        tmp_path,
        {
            "rules": [
                {"match": CLARIFY, "text": "Goal: result.txt."},
                {"match": PLAN, "text": "1. write result.txt"},
                {"match": EXECUTE, "text": "working on it"},
                {"match": EVALUATE, **evaluation("IN PROGRESS")},
            ],
        },
        monkeypatch,
    )
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path, max_turns=4)):
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto write result.txt")
        started = await api.wait_for_message(lambda m: m.text.startswith("🤖 Auto run "))
        run_id = started.text.split()[3]
        final = await api.wait_for_message(
            lambda m: m.text.startswith(f"Auto run {run_id}:"), timeout=40
        )
        turns = await api.wait_for_message(lambda m: m.filename == f"turns-{run_id}.md")
        assert len(agent_log(tmp_path)) == 6
        # the live message: its last state counts the six turns in four rounds
        await api.wait_until(lambda: "turn 6 · round 4 of 4" in started.text)
        seen = [*started.history, started.text]
        assert not any("turn 3 of" in text or "turn 4 of" in text for text in seen)
        # the report and its document count the same turns
        assert final.text.startswith(f"Auto run {run_id}: stopped at its round limit")
        assert "Turns: 6, in round 4 of 4; last phase: Evaluate" in final.text
        assert turns.text == f"🤖 Auto run {run_id}: the output of its 6 turns"
        assert turns.document is not None
        document = turns.document.decode()
        for head in (
            "[turn 3 · round 3/4 · Execute, exit 0]",
            "[turn 4 · round 3/4 · Evaluate, exit 0]",
            "[turn 5 · round 4/4 · Execute, exit 0]",
            "[turn 6 · round 4/4 · Evaluate, exit 0]",
        ):
            assert head in document


async def test_auto_is_refused_up_front_where_completion_cannot_be_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A chat's own folder that exists with files and is no git repository (made by
    # hand): left alone, and /auto says why it cannot start there.
    folder = tmp_path / "ws" / "chats" / f"chat_{CHAT}"
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("mine\n")
    write_script(tmp_path, {}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto write result.txt")
        refused = await api.wait_for_message(lambda m: m.text.startswith("Cannot start"))
        assert "is not a git repository" in refused.text
        assert "no claim of completion could be accepted" in refused.text
        assert not await rt.runs.list_runs()
    assert not (folder / ".git").exists()
    assert agent_log(tmp_path) == []


@pytest.mark.usefixtures("git_env")
async def test_auto_takes_a_budget_and_refuses_a_bad_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    git_workspace(tmp_path / "ws" / "default")
    write_script(
        tmp_path,
        {
            "rules": [
                {"match": CLARIFY, "text": "Goal: nothing."},
                {"match": PLAN, "text": "1. nothing"},
                {"match": EXECUTE, "text": "done"},
                {"match": EVALUATE, "text": "ok\nAUTO-MODE STATUS: COMPLETE\n"},
            ]
        },
        monkeypatch,
    )
    # Nothing to commit: the claim of completion alone completes the run.
    settings = {"completion_threshold": 0.0}
    async with (
        FakeBotApi() as api,
        running_bot(api, bot_settings(api, tmp_path, **settings)) as rt,
    ):
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto --budget two do it")
        await api.wait_for_message(
            lambda m: (
                m.text == "Cannot start: --budget takes an amount in USD, like 2 or 0.50, not 'two'"
            )
        )
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto --budget=0 do it")
        await api.wait_for_message(lambda m: m.text.startswith("Cannot start: --budget: a budget"))
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto --budget $2.50 do nothing")
        started = await api.wait_for_message(lambda m: m.text.startswith("🤖 Auto run"))
        run_id = started.text.split()[3]
        await wait_for_run_status(rt, run_id, RunStatus.COMPLETED)
        record = await rt.runs.get_run(run_id)
    assert record.objective == "do nothing"
    assert record.state["config"]["budget_usd"] == 2.5
    # The fake agent reports no cost: the report says the spend is unknown, not $0.
    report = next(m for m in api.sent if m.text.startswith(f"Auto run {run_id}: completed"))
    assert "Spend: unknown (the agent reports neither cost nor tokens)" in report.text


@pytest.mark.usefixtures("git_env")
async def test_an_auto_run_paused_waits_before_its_next_turn_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    git_workspace(tmp_path / "ws" / "default")
    release = tmp_path / "release"
    write_script(
        tmp_path,
        {
            "rules": [
                {"match": CLARIFY, "text": "Goal: result.txt.", "wait_file": str(release)},
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
        api.names[OPERATOR] = "Olga"
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto write result.txt")
        started = await api.wait_for_message(lambda m: m.text.startswith("🤖 Auto run"))
        run_id = started.text.split()[3]
        await api.wait_until(lambda: any("Pause" in b["text"] for b in started.buttons))
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"/pause {run_id[-6:]}")
        await api.wait_for_message(
            lambda m: m.text.startswith(f"⏸ Run {run_id} pauses: it finishes the turn it is in")
        )
        await api.wait_until(lambda: "⏸ Paused by Olga" in started.text)
        assert [b["text"] for b in started.buttons] == ["⏹ Stop", "▶ Go on"]
        release.touch()  # the Clarify turn ends; Plan waits
        await api.wait_until(lambda: any(CLARIFY in e["prompt"] for e in agent_log(tmp_path)))
        await asyncio.sleep(2)
        assert not any(PLAN in e["prompt"] for e in agent_log(tmp_path))
        assert (await rt.runs.get_run(run_id)).status is RunStatus.RUNNING
        go_on = next(b for b in started.buttons if "Go on" in b["text"])
        api.push_callback(
            chat_id=CHAT,
            user_id=OPERATOR,
            data=go_on["callback_data"],
            message_id=started.message_id,
        )
        await api.wait_for_message(lambda m: "Objective achieved" in m.text, timeout=40)
        await api.wait_until(lambda: "✅ finished" in started.text)
    assert not started.buttons
    assert "⏸" not in started.text


@pytest.mark.usefixtures("git_env")
async def test_a_bare_stop_with_several_runs_asks_which_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    git_workspace(tmp_path / "ws" / "default")
    never = str(tmp_path / "never")
    write_script(
        tmp_path,
        {"rules": [{"match": CLARIFY, "wait_file": never}, {"match": "long", "wait_file": never}]},
        monkeypatch,
    )
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        api.names[OPERATOR] = "Olga"
        # a chat turn working, then an auto run (whose steering takes plain messages)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
        await api.wait_for_message(lambda m: "bound" in m.text)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="a long job")
        await api.wait_for_message(lambda m: m.text.startswith("⏳ working"))
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto never ends")
        started = await api.wait_for_message(lambda m: m.text.startswith("🤖 Auto run"))
        auto_id = started.text.split()[3]
        chat_id_ = next(r.id for r in await rt.runs.list_runs() if r.mode == "chat")
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/stop")
        ask = await api.wait_for_message(lambda m: "Which one should stop?" in m.text)
        assert ask.text == "2 runs are working here. Which one should stop?"
        labels = [b["text"] for b in ask.buttons]
        assert labels[-1] == "⏹ all of them"
        assert sorted(labels[:-1]) == sorted(
            [f"⏹ auto run never ends (…{auto_id[-6:]})", f"⏹ chat turn (…{chat_id_[-6:]})"]
        )
        # nothing stopped yet
        assert (await rt.runs.get_run(auto_id)).status is RunStatus.RUNNING
        auto_button = next(b for b in ask.buttons if auto_id[-6:] in b["text"])
        api.push_callback(
            chat_id=CHAT,
            user_id=OPERATOR,
            data=auto_button["callback_data"],
            message_id=ask.message_id,
        )
        await wait_for_run_status(rt, auto_id, RunStatus.STOPPED)
        await api.wait_until(lambda: ask.text == f"⏹ Olga stopped {auto_id}." and not ask.buttons)
        # the chat turn still works; with one run left, /stop stops it at once
        assert (await rt.runs.get_run(chat_id_)).status is RunStatus.RUNNING
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/stop")
        await api.wait_for_message(lambda m: m.text.startswith("⏹ stopped by Olga"))
    # one question, edited into what was stopped; no other message asked
    assert [m for m in api.sent if "Which one should stop?" in "".join([*m.history, m.text])] == [
        ask
    ]


async def test_a_run_that_reaches_its_round_limit_says_so_in_its_live_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(
        tmp_path,
        {
            "rules": [
                {"match": CLARIFY, "text": "Goal: result.txt."},
                {"match": PLAN, "text": "1. write result.txt"},
                {"match": EXECUTE, "text": "still working"},
                {"match": EVALUATE, **evaluation("IN PROGRESS")},
            ]
        },
        monkeypatch,
    )
    async with (
        FakeBotApi() as api,
        running_bot(api, bot_settings(api, tmp_path, max_turns=3)) as rt,
    ):
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto write result.txt")
        live = await api.wait_for_message(lambda m: m.text.startswith("🤖 Auto run "))
        run_id = live.text.split()[3]
        report = await api.wait_for_message(
            lambda m: m.text.startswith(f"Auto run {run_id}:"), timeout=40
        )
        assert report.text.startswith(f"Auto run {run_id}: stopped at its round limit")
        assert (await rt.runs.get_run(run_id)).status is RunStatus.STOPPED
        await api.wait_until(lambda: "⏹ stopped at its round limit" in live.text)
    assert live.text.splitlines()[1].startswith("⏹ stopped at its round limit · "), live.text
