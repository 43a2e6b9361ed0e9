"""Chat sessions end to end: the real bot, the fake Bot API over HTTP, the fake agent."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engine.store.runs import RunStatus, SqliteRunStore, TurnState
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
from tests.support import wait_until

pytestmark = pytest.mark.usefixtures("isolated_env", "bot_backend")


async def test_three_turn_chat_session_resumes_the_same_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(
        tmp_path, {"rules": [{"match": "", "text": "**turn {turn}**: {prompt}"}]}, monkeypatch
    )
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        assert [c["command"] for c in api.commands][:2] == ["help", "chat"]
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
        await api.wait_for_message(lambda m: "bound to a new command session" in m.text)
        for i in range(1, 4):
            asked = api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"question {i}")
            question = api.pushed(asked)["message"]["message_id"]
            reply = await api.wait_for_message(lambda m, i=i: f": question {i}" in m.text)
            assert reply.text == f"turn {i}: question {i}"
            assert reply.entities[0]["type"] == "bold"
            # the answer and the turn's progress message are replies to the question
            assert reply.reply_to == question
            progress = [m for m in api.sent if m.reply_to == question and m is not reply]
            assert len(progress) == 1
            assert progress[0].message_id < reply.message_id
            await api.wait_until(lambda p=progress[0]: p.text.startswith("✅ done"))
            assert progress[0].history[0].startswith("⏳ working")
            assert not progress[0].buttons
        log = agent_log(tmp_path)
        assert [e["prompt"] for e in log] == ["question 1", "question 2", "question 3"]
        assert len({e["session"] for e in log}) == 1
        binding = await rt.store.binding(str(CHAT), None)
        assert binding is not None
        assert binding.turns == 3
        runs = await SqliteRunStore(rt.db).list_runs()
        turns = await SqliteRunStore(rt.db).turns(runs[0].id)
        assert [t.state.value for t in turns] == ["finished"] * 3
    # no status message far up the chat: each turn has its own progress message
    assert not any(m.text.startswith("💬 chat session") for m in api.sent)


async def test_stop_preempts_a_long_turn_and_its_children(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pids = tmp_path / "pids"
    monkeypatch.setenv("FAKE_AGENT_PIDS", str(pids))
    write_script(
        tmp_path,
        {"rules": [{"match": "long", "grandchild": True, "ignore_term": True, "sleep": 3600}]},
        monkeypatch,
    )
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, preempt_grace=0.5)
        async with running_bot(api, settings) as rt:
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
            await api.wait_for_message(lambda m: "bound" in m.text)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="a long job")
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="queued behind it")
            await api.wait_for_message(lambda m: "Queued" in m.text)
            await wait_for_file(pids)
            agent_pid, child_pid = (int(p) for p in pids.read_text().split())
            assert alive(agent_pid)
            stopped_at = time.monotonic()
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/stop")
            note = await api.wait_for_message(lambda m: "stopped during turn 1" in m.text)
            elapsed = time.monotonic() - stopped_at
            assert "1 queued message(s) were discarded" in note.text
            assert not alive(agent_pid)
            assert not alive(child_pid)
            # Nowhere near the agent's 3600 s: the grace period, SIGKILL, and a margin for
            # the bot's round trips on a loaded machine.
            assert elapsed < settings.preempt_grace + 10
            runs = await rt.runs.list_runs()
            assert runs[0].status is RunStatus.STOPPED
            turns = await rt.runs.turns(runs[0].id)
            assert [t.state for t in turns] == [TurnState.INTERRUPTED]
            # the chat stays bound: the next message starts a new run of the same session
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="hello again")
            await api.wait_for_message(lambda m: m.text == "echo: hello again")


async def test_unauthorized_command_and_button_are_refused_and_audited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        api.push_message(chat_id=CHAT, user_id=STRANGER, text="/chat")
        refusal = await api.wait_for_message(lambda m: "/chat needs" in m.text)
        # the missing role is named, and the id an admin needs to grant it
        assert refusal.text.startswith("⛔ /chat needs the operator role.")
        assert str(STRANGER) in refusal.text
        # in a group, someone without a role gets one refusal a minute (the rest audited)
        assert "refusals are answered at most once a minute" in refusal.text
        api.push_message(chat_id=CHAT, user_id=STRANGER, text="/stop")
        api.push_message(chat_id=CHAT, user_id=STRANGER, text="/status")
        api.push_callback(chat_id=CHAT, user_id=STRANGER, data="ap:gate1", message_id=1)
        await api.wait_until(lambda: len(api.callback_answers) == 1)
        assert "Needs the approver role" in api.callback_answers[0].get("text", "")
        # a chat that is not allowed is ignored (audited, nothing said)
        api.push_message(chat_id=-555, user_id=OPERATOR, text="/chat")
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
        await api.wait_for_message(lambda m: "No runs in this chat" in m.text)

        async def later_audited() -> bool:  # /stop is handled beside the others
            done = {e.action for e in await rt.store.audit_entries() if e.user_id == STRANGER}
            return {"stop", "status"} <= done

        await wait_until(later_audited, what="the unanswered refusals audited")
        entries = await rt.store.audit_entries()
        refused = [(e.user_id, e.chat_id, e.action) for e in entries if e.outcome == "refused"]
        assert (STRANGER, str(CHAT), "chat") in refused
        assert (STRANGER, str(CHAT), "stop") in refused
        assert (STRANGER, str(CHAT), "approve") in refused
        # the later refusals in the minute are not answered, yet audited as such
        for action in ("stop", "status"):
            later = next(e for e in entries if e.user_id == STRANGER and e.action == action)
            assert "not answered" in (later.reason or "")
        assert (OPERATOR, "-555", "any") in refused
        assert await rt.store.binding(str(CHAT), None) is None
        assert not await rt.runs.list_runs()
    # one refusal a minute in the group, never a flood
    assert sum(t.startswith("⛔") for t in api.texts()) == 1
    assert not api.texts(-555)
    assert agent_log(tmp_path) == []


async def test_private_chat_not_allowed_tells_the_user_their_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)):
        api.push_message(chat_id=777, user_id=777, text="/start")
        reply = await api.wait_for_message(lambda m: m.chat_id == 777)
        assert "777" in reply.text
        assert "not allowed" in reply.text


async def test_queue_depth_is_never_exceeded_silently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = tmp_path / "release"
    write_script(
        tmp_path,
        {"rules": [{"match": "", "text": "done {prompt}", "wait_file": str(release)}]},
        monkeypatch,
    )
    settings_kw = {"queue_depth": 1}
    async with FakeBotApi() as api:
        async with running_bot(api, bot_settings(api, tmp_path, **settings_kw)):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
            await api.wait_for_message(lambda m: "bound" in m.text)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="one")
            await api.wait_for_message(lambda m: m.text.startswith("⏳ working"))
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="two")
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="three")
            refused = await api.wait_for_message(lambda m: "Not queued" in m.text)
            assert "limit 1" in refused.text
            release.touch()
            await api.wait_for_message(lambda m: m.text == "done two")
        assert "done three" not in api.texts()
        assert "done one" in api.texts()


async def test_an_agent_that_cannot_start_is_reported_not_hidden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    # There when the chat is bound (/chat takes installed agents only), gone at the turn.
    agent = tmp_path / "bin" / "agent"
    agent.parent.mkdir()
    agent.write_text("#!/bin/sh\n")
    agent.chmod(0o755)
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, agent_command=f"{agent} {{prompt}}")
        async with running_bot(api, settings) as rt:
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
            await api.wait_for_message(lambda m: "bound" in m.text)
            agent.unlink()
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="hello")
            # (its progress message says "⚠️ failed" too, maybe first)
            failed = await api.wait_for_message(lambda m: "cannot start" in m.text)
            assert "not found" in failed.text
            runs = await rt.runs.list_runs()
            # The message goes out before the run's status is written: wait for it.
            await wait_for_run_status(rt, runs[0].id, RunStatus.ERROR)
            turns = await rt.runs.turns(runs[0].id)
            assert [t.state for t in turns] == [TurnState.FAILED]


async def test_a_bare_stop_leaves_an_idle_session_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
        await api.wait_for_message(lambda m: "bound" in m.text)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="hello")
        await api.wait_for_message(lambda m: m.text == "echo: hello")
        [run] = await rt.runs.list_runs()
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/stop")
        await api.wait_for_message(lambda m: m.text == "Nothing is running here.")
        # named by the end of its id: the same run
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"/stop {run.id[-6:]}")
        await api.wait_for_message(lambda m: m.text == f"Run {run.id} is idle: nothing to stop.")
        # the idle session was not stopped: still running, and the next message is turn 2
        assert (await rt.runs.get_run(run.id)).status is RunStatus.RUNNING
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="again")
        await api.wait_for_message(lambda m: m.text == "echo: again")
        assert [r.id for r in await rt.runs.list_runs()] == [run.id]
    assert not any("stopped" in t for t in api.texts())


async def test_a_failing_turn_shows_and_keeps_the_end_of_its_error_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "sk-ant-api03-" + "x" * 40
    noise = "".join(f"progress line {i}\n" for i in range(200))
    reason = f"fatal: the config file ~/.agent/config.toml is missing (key {secret})"
    write_script(
        tmp_path,
        {"rules": [{"match": "", "text": "", "exit": 3, "stderr": noise + reason + "\n"}]},
        monkeypatch,
    )
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
        await api.wait_for_message(lambda m: "bound" in m.text)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="hello")
        failed = await api.wait_for_message(lambda m: "exited with code 3" in m.text)
        # the reason is in the chat, redacted, and only the end of stderr (≤ 1 KB)
        assert "config.toml is missing" in failed.text
        assert secret not in failed.text
        assert "progress line 0\n" not in failed.text
        said = failed.text.split("Its error output ended with:\n", 1)[1]
        assert len(said.encode()) <= 1024 + len("\n\n(no output)")
        [run] = await rt.runs.list_runs()
        [turn] = await rt.runs.turns(run.id)
        # kept with the turn: in the store and in the runs folder
        assert turn.exit_code == 3
        assert turn.stderr_tail is not None
        assert "config.toml is missing" in turn.stderr_tail
        assert secret not in turn.stderr_tail
        assert len(turn.stderr_tail.encode()) <= 1024
        kept = tmp_path / "runs" / run.id / "turn-1.stderr.txt"
        assert kept.read_text() == turn.stderr_tail


async def test_chat_takes_only_installed_agents_and_known_projects_and_says_the_choices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, claude_bin=str(tmp_path / "no" / "claude"))
        async with running_bot(api, settings) as rt:
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat foo")
            unknown = await api.wait_for_message(lambda m: "no project 'foo'" in m.text)
            assert "Agents installed here: command. Projects: default." in unknown.text
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat claude")
            missing = await api.wait_for_message(lambda m: "claude is not installed" in m.text)
            assert "npm install -g @anthropic-ai/claude-code" in missing.text
            assert "Agents installed here: command." in missing.text
            assert await rt.store.binding(str(CHAT), None) is None
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat command default@main")
            await api.wait_for_message(lambda m: "it has no branches" in m.text)
            assert await rt.store.binding(str(CHAT), None) is None
    assert not (tmp_path / "ws" / "foo").exists()
    assert agent_log(tmp_path) == []


async def test_agent_model_project_and_new_change_the_session_in_the_chat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from telegram.ext import AIORateLimiter

    from bot.app import BotRuntime
    from engine.agents.factory import create_agent

    write_script(tmp_path, {}, monkeypatch)
    # A stand-in "claude" that is installed (an executable file) but never run here.
    claude = tmp_path / "bin" / "claude"
    claude.parent.mkdir()
    claude.write_text("#!/bin/sh\nexit 1\n")
    claude.chmod(0o755)
    models: list[str | None] = []

    def factory(tool: str, settings: object, **kw: object) -> object:
        models.append(getattr(settings, "agent_model", None))
        return create_agent(tool, settings, **kw)  # type: ignore[arg-type]

    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, claude_bin=str(claude))
        limiter = AIORateLimiter(group_max_rate=10_000, max_retries=8)
        async with BotRuntime(settings, agent_factory=factory, rate_limiter=limiter) as rt:
            await rt.start()
            try:
                api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
                await api.wait_for_message(lambda m: "bound to a new command session" in m.text)
                api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/model")
                await api.wait_for_message(lambda m: "Model here: the agent's default" in m.text)
                api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/model big-model-1")
                await api.wait_for_message(lambda m: "🧠 Model for this command session" in m.text)
                first = await rt.store.binding(str(CHAT), None)
                assert first is not None
                assert first.model == "big-model-1"
                api.push_message(chat_id=CHAT, user_id=OPERATOR, text="one")
                await api.wait_for_message(lambda m: m.text == "echo: one")
                assert models == ["big-model-1"]
                # /new: a fresh session, same agent, project and model
                api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/new")
                await api.wait_for_message(lambda m: "🆕 A fresh command session here" in m.text)
                fresh = await rt.store.binding(str(CHAT), None)
                assert fresh is not None
                assert fresh.session_id != first.session_id
                assert fresh.model == "big-model-1"
                # /project: only what exists, with the choices
                api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/project nope")
                await api.wait_for_message(lambda m: "no project 'nope'" in m.text)
                # /agent: a new session of another installed agent (the model is reset)
                api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/agent codex")
                await api.wait_for_message(lambda m: "codex is not installed" in m.text)
                api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/agent claude")
                await api.wait_for_message(lambda m: "bound to a new claude session" in m.text)
                switched = await rt.store.binding(str(CHAT), None)
                assert switched is not None
                assert (switched.agent, switched.model) == ("claude", None)
                # /status: how to go on from a terminal, once the session has a turn
                await rt.db.execute("UPDATE bot_bindings SET turns = 1")
                api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
                status = await api.wait_for_message(lambda m: "continue in a terminal" in m.text)
                assert status.text.splitlines()[1] == (
                    f"   ↪️ continue in a terminal: cd {switched.workdir} && {claude} "
                    f"--resume {switched.session_id}"
                )
            finally:
                rt.request_shutdown()
                await rt.shutdown()


async def test_the_stop_button_of_a_turns_progress_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(
        tmp_path,
        {"rules": [{"match": "long", "wait_file": str(tmp_path / "never")}]},
        monkeypatch,
    )
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        api.names[OPERATOR] = "Olga"
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
        await api.wait_for_message(lambda m: "bound" in m.text)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="a long job")
        progress = await api.wait_for_message(lambda m: m.text.startswith("⏳ working"))
        # the elapsed time moves while the turn runs (edited in place)
        await api.wait_until(lambda: progress.edits >= 1)
        stop = next(b["callback_data"] for b in progress.buttons if "Stop" in b["text"])
        # a stranger's press is refused and changes nothing
        api.push_callback(chat_id=CHAT, user_id=STRANGER, data=stop, message_id=progress.message_id)
        await api.wait_until(lambda: len(api.callback_answers) == 1)
        assert progress.buttons
        api.push_callback(chat_id=CHAT, user_id=OPERATOR, data=stop, message_id=progress.message_id)
        await api.wait_until(lambda: progress.text.startswith("⏹ stopped by Olga"))
        assert not progress.buttons
        runs = await rt.runs.list_runs()
        assert runs[0].status is RunStatus.STOPPED
