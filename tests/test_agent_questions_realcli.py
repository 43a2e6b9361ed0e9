"""The agent asks a person: the real bot, the real Claude Code CLI calling the permission
server's ``ask`` tool, the fake model scripting the call.

The question is posted to the run's chat (its options as buttons), an operator answers
(a button, or a reply in their own words), and the answer reaches the model as the tool's
result; someone without the operator role cannot answer; ``/stop`` withdraws it. A run
paused mid-call finishes that call and waits before its next one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.approvals import QuestionState, QuestionStore
from engine.store.events import EventLog
from tests.fakes.bot_api import FakeBotApi, SentMessage
from tests.fakes.bot_harness import APPROVER, CHAT, OPERATOR, running_bot
from tests.fakes.model_api import FakeModelAPI, Text, ToolCall
from tests.fakes.realcli import Sandbox
from tests.test_tool_approvals_realcli import (  # the same bot, CLI and model fixtures
    claude_bin,
    model,
    press,
    sandbox,
    settings_for,
    workdir,
)

__all__ = ["claude_bin", "model", "sandbox"]

pytestmark = [
    pytest.mark.realcli,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("isolated_env"),
]

ASK = "mcp__turnstile__ask"


def asked(msg: SentMessage) -> bool:
    return msg.text.startswith("❓ Run ") and "The run waits." in msg.text


def tool_texts(model: FakeModelAPI) -> list[str]:
    return [
        text
        for request in model.model_requests
        for role, text in request.conversation()
        if role == "tool_result"
    ]


async def bind(api: FakeBotApi) -> None:
    api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
    await api.wait_for_message(lambda m: "bound to a new claude session" in m.text)


async def test_an_operator_answers_with_a_button_and_the_model_reads_it(
    tmp_path: Path, claude_bin: Path, model: FakeModelAPI, sandbox: Sandbox
) -> None:
    question = {
        "question": "Which database should the service use?",
        "options": ["SQLite", "PostgreSQL"],
    }
    model.enqueue(ToolCall(ASK, question), Text("going with it"))
    async with (
        FakeBotApi() as api,
        running_bot(api, settings_for(api, tmp_path, claude_bin, tool_approval="trusted")) as rt,
    ):
        await bind(api)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="set up the service")
        msg = await api.wait_for_message(asked, timeout=60)
        assert "Which database should the service use?" in msg.text
        assert [b["text"] for b in msg.buttons] == ["SQLite", "PostgreSQL"]
        # an approver is no operator: the press is refused and the question still waits
        press(api, msg, "SQLite", APPROVER)
        await api.wait_until(
            lambda: any(
                "Needs the operator role" in a.get("text", "") for a in api.callback_answers
            )
        )
        run_id = (await rt.runs.list_runs())[0].id
        store = QuestionStore(rt.db)
        assert [q.state for q in await store.history(run_id)] == [QuestionState.PENDING]
        press(api, msg, "PostgreSQL", OPERATOR)
        await api.wait_for_message(lambda m: m.text == "going with it", timeout=60)
        history = await store.history(run_id)
        events = [e.kind for e in await EventLog(rt.db).read(run_id)]
    assert "answered: PostgreSQL" in msg.text
    assert not msg.buttons
    assert [(q.state, q.answer, q.answered_by) for q in history] == [
        (QuestionState.ANSWERED, "PostgreSQL", OPERATOR)
    ]
    assert "question_asked" in events
    assert "question_answered" in events
    # the answer is the tool's result the model read; nothing else asked a person
    assert any("The person answered: PostgreSQL" in t for t in tool_texts(model))
    assert not [m for m in api.sent if "asks to use" in m.text]


async def test_a_reply_in_own_words_answers_a_free_question(
    tmp_path: Path, claude_bin: Path, model: FakeModelAPI, sandbox: Sandbox
) -> None:
    model.enqueue(ToolCall(ASK, {"question": "Which port is free on the server?"}), Text("noted"))
    async with (
        FakeBotApi() as api,
        # the default policy (an allowlist, the rest asks) offers the tool as well
        running_bot(api, settings_for(api, tmp_path, claude_bin)) as rt,
    ):
        await bind(api)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="deploy it")
        msg = await api.wait_for_message(asked, timeout=60)
        assert "Reply to this message with your answer" in msg.text
        assert not msg.buttons
        api.push_message(
            chat_id=CHAT, user_id=OPERATOR, text="8080, the rest are taken", reply_to=msg.message_id
        )
        await api.wait_for_message(lambda m: m.text == "noted", timeout=60)
        run_id = (await rt.runs.list_runs())[0].id
        history = await QuestionStore(rt.db).history(run_id)
    assert [(q.state, q.answer) for q in history] == [
        (QuestionState.ANSWERED, "8080, the rest are taken")
    ]
    assert any("The person answered: 8080, the rest are taken" in t for t in tool_texts(model))
    assert "answered: 8080, the rest are taken" in msg.text


async def test_stop_withdraws_a_waiting_question(
    tmp_path: Path, claude_bin: Path, model: FakeModelAPI, sandbox: Sandbox
) -> None:
    model.enqueue(ToolCall(ASK, {"question": "Go on?", "options": ["yes", "no"]}), Text("never"))
    async with (
        FakeBotApi() as api,
        running_bot(api, settings_for(api, tmp_path, claude_bin, tool_approval="free")) as rt,
    ):
        await bind(api)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="work")
        msg = await api.wait_for_message(asked, timeout=60)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
        status = await api.wait_for_message(lambda m: "waits for an answer: Go on?" in m.text)
        assert "❓" in status.text
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/stop")
        await api.wait_for_message(lambda m: m is msg and "Not answered" in m.text, timeout=30)
        run_id = (await rt.runs.list_runs())[0].id
        history = await QuestionStore(rt.db).history(run_id)
    assert "Not answered: the turn was stopped." in msg.text
    assert not msg.buttons
    assert [(q.state, q.answer) for q in history] == [
        (QuestionState.CANCELLED, "the turn was stopped")
    ]
    assert not [m for m in api.sent if m.text == "never"]


async def test_a_paused_run_finishes_its_tool_call_and_waits_before_the_next(
    tmp_path: Path, claude_bin: Path, model: FakeModelAPI, sandbox: Sandbox
) -> None:
    first, second = workdir(tmp_path) / "first.txt", workdir(tmp_path) / "second.txt"
    slow = ToolCall("Bash", {"command": f"sleep 2 && touch {first}", "description": "slow"})
    quick = ToolCall("Bash", {"command": f"touch {second}", "description": "quick"})
    model.enqueue(slow, quick, Text("both made"))
    async with (
        FakeBotApi() as api,
        running_bot(api, settings_for(api, tmp_path, claude_bin, tool_approval="free")) as rt,
    ):
        api.names[OPERATOR] = "Olga"
        await bind(api)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="make two files")
        progress = await api.wait_for_message(
            lambda m: m.text.startswith("⏳ working") and "sleep 2" in m.text, timeout=60
        )
        pause = next(b for b in progress.buttons if "Pause" in b["text"])
        api.push_callback(
            chat_id=CHAT,
            user_id=OPERATOR,
            data=pause["callback_data"],
            message_id=progress.message_id,
        )
        await api.wait_until(
            lambda: "Paused by Olga: it finishes the tool call it is in" in progress.text
        )
        # the call it was in runs to its end; the next one waits
        await api.wait_until(first.exists, timeout=30)
        await asyncio.sleep(2)
        assert not second.exists()
        go_on = next(b for b in progress.buttons if "Go on" in b["text"])
        api.push_callback(
            chat_id=CHAT,
            user_id=OPERATOR,
            data=go_on["callback_data"],
            message_id=progress.message_id,
        )
        await api.wait_for_message(lambda m: m.text == "both made", timeout=60)
        run_id = (await rt.runs.list_runs())[0].id
        events = [e.kind for e in await EventLog(rt.db).read(run_id)]
    assert second.exists()
    # the second call reached the permission server only after the pause ended
    assert events.index("pause_ended") < max(
        i for i, kind in enumerate(events) if kind == "tool_requested"
    )
    assert events.index("paused") > min(
        i for i, kind in enumerate(events) if kind == "tool_requested"
    )


async def test_the_turns_progress_says_it_waits_for_a_person_and_the_request_replies_to_the_prompt(
    tmp_path: Path, claude_bin: Path, model: FakeModelAPI, sandbox: Sandbox
) -> None:
    touch = ToolCall("Bash", {"command": "touch made.txt", "description": "make it"})
    model.enqueue(touch, Text("made"))
    async with (
        FakeBotApi() as api,
        running_bot(api, settings_for(api, tmp_path, claude_bin, tool_approval="all")),
    ):
        api.names[APPROVER] = "Ann"
        await bind(api)
        prompt = api.push_message(chat_id=CHAT, user_id=OPERATOR, text="make the file")
        ask = await api.wait_for_message(lambda m: "asks to use Bash" in m.text, timeout=60)
        progress = next(m for m in api.sent if m.text.startswith("⏳"))
        await api.wait_until(lambda: progress.text.startswith("⏳ waits for a person"))
        assert "🔐 to allow Bash (the request below)" in progress.text
        # the request is a reply to the message that started the turn, as the progress is
        assert ask.reply_to == api.pushed(prompt)["message"]["message_id"] == progress.reply_to
        press(api, ask, "Allow once", APPROVER)
        await api.wait_until(lambda: "✅ Allowed once by Ann." in ask.text)
        await api.wait_for_message(lambda m: m.text == "made", timeout=60)
    assert "waits for a person" not in progress.text
    assert "✅ done" in progress.text
