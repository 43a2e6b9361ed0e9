"""A Reject button press waits for a reason: it expires, can be cancelled (/cancel or the
button), and a "reason" that is just an approval word asks before rejecting anything.

The attack run's case: Reject pressed by mistake, then "APPROVED" typed, and the gate was
rejected with the reason "APPROVED"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from chatfront.store import OutboxItem, SqlBotStore
from engine.gates import Gates
from engine.store import open_database
from tests.fakes.bot_api import FakeBotApi, SentMessage
from tests.fakes.bot_harness import (
    ADMIN,
    APPROVER,
    CHAT,
    OPERATOR,
    agent_log,
    approved,
    bot_settings,
    running_bot,
    write_script,
)
from tests.gates_support import phase_rules
from tests.support import wait_until

pytestmark = [pytest.mark.usefixtures("isolated_env"), pytest.mark.timeout(120)]


def _button(message: SentMessage, ending: str) -> str:
    return next(b["callback_data"] for b in message.buttons if b["text"].endswith(ending))


async def _research_gate(api: FakeBotApi, task: str) -> SentMessage:
    api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"/autopilot {task}")
    return await api.wait_for_message(
        lambda m: m.text.startswith("🛂 Gate:") and f"task {task} · phase research" in m.text,
        timeout=30,
    )


async def _press_reject(api: FakeBotApi, gate: SentMessage) -> SentMessage:
    seen = {m.message_id for m in api.sent if ", why reject" in m.text}
    api.push_callback(
        chat_id=CHAT, user_id=APPROVER, data=_button(gate, "Reject"), message_id=gate.message_id
    )
    return await api.wait_for_message(
        lambda m: ", why reject" in m.text and m.message_id not in seen
    )


async def _delivered(rt: Any, message: SentMessage) -> None:
    """Until the bot has recorded the question as delivered (the fake Bot API shows it a
    moment before the bot's own bookkeeping: a /cancel in that moment is another test)."""
    await wait_until(
        lambda: rt.store.live_by_message(str(CHAT), message.message_id),
        what="the question recorded",
    )


def _rejections(api: FakeBotApi) -> list[str]:
    return [m.text for m in api.sent if m.text.startswith("↩️ Rejected")]


async def _still_awaiting(rt: Any, task: str) -> bool:
    record = await Gates(rt.db, rt.settings).task(task)
    return bool(record.awaiting_approval) and record.phase == "research"


@pytest.mark.usefixtures("bot_backend")
async def test_an_approval_word_after_reject_asks_instead_of_rejecting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {"rules": phase_rules()}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        gate = await _research_gate(api, "T1")
        prompt = await _press_reject(api, gate)
        api.push_message(chat_id=CHAT, user_id=APPROVER, text="APPROVED")
        confirm = await api.wait_for_message(
            lambda m: "reads like an approval" in m.text or m.text.startswith("↩️ Rejected")
        )
        assert _rejections(api) == []
        assert [b["text"] for b in confirm.buttons] == ["❌ Reject with this reason", "✖ Cancel"]
        assert await _still_awaiting(rt, "T1")
        # the question is a forced reply for the presser, and offers a way out
        assert prompt.reply_markup == {"force_reply": True, "selective": True}
        assert "/cancel" in prompt.text

        # Cancel: nothing rejected, the confirmation loses its buttons
        api.push_callback(
            chat_id=CHAT,
            user_id=APPROVER,
            data=_button(confirm, "Cancel"),
            message_id=confirm.message_id,
        )
        await api.wait_for_message(lambda m: m.text.startswith("✖ Cancelled: nothing was rejected"))
        await api.wait_until(
            lambda: not next(m for m in api.sent if m.message_id == confirm.message_id).buttons
        )
        await api.wait_until(
            lambda: next(m for m in api.sent if m.message_id == prompt.message_id).edits > 0
        )
        # the request is gone: "APPROVED" now approves, as the person meant
        api.push_message(chat_id=CHAT, user_id=APPROVER, text="APPROVED")
        await api.wait_for_message(approved("T1", "research"))
        assert _rejections(api) == []
        audit = await rt.store.audit_entries(limit=50)
        assert any(e.action == "reject" and e.outcome == "cancelled" for e in audit)
    assert not any("APPROVED" in e["prompt"] for e in agent_log(tmp_path))


@pytest.mark.usefixtures("bot_backend")
async def test_confirming_rejects_with_the_approval_word_as_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {"rules": phase_rules()}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)):
        gate = await _research_gate(api, "T2")
        await _press_reject(api, gate)
        api.push_message(chat_id=CHAT, user_id=APPROVER, text="Approved!")
        confirm = await api.wait_for_message(lambda m: "reads like an approval" in m.text)
        # someone else with the right cannot confirm this person's rejection
        api.push_callback(
            chat_id=CHAT,
            user_id=ADMIN,
            data=_button(confirm, "Reject with this reason"),
            message_id=confirm.message_id,
        )
        await api.wait_for_message(lambda m: m.text.startswith("Nothing is waiting for your"))
        assert next(m for m in api.sent if m.message_id == confirm.message_id).buttons
        assert _rejections(api) == []
        api.push_callback(
            chat_id=CHAT,
            user_id=APPROVER,
            data=_button(confirm, "Reject with this reason"),
            message_id=confirm.message_id,
        )
        await api.wait_for_message(lambda m: m.text.startswith("↩️ Rejected T2 · research"))
        await api.wait_for_message(
            lambda m: (
                m.text.startswith("🛂 Gate:")
                and "task T2 · phase research" in m.text
                and m.message_id != gate.message_id
            ),
            timeout=30,
        )
        assert len(_rejections(api)) == 1
    reruns = [e["prompt"] for e in agent_log(tmp_path) if "Phase: research (" in e["prompt"]]
    assert len(reruns) == 2
    assert "Approved!" in reruns[1]


async def test_in_privacy_mode_the_reason_arrives_as_a_forced_reply(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {"rules": phase_rules()}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        gate = await _research_gate(api, "TP")
        api.privacy_mode = True
        prompt = await _press_reject(api, gate)
        # Telegram opens a reply to the question on the presser's phone only: a forced
        # reply, selective, naming them
        assert prompt.reply_markup == {"force_reply": True, "selective": True}
        [mention] = prompt.entities
        assert mention["type"] == "text_mention"
        assert mention["user"]["id"] == APPROVER
        assert prompt.text.startswith(f"user{APPROVER}, why reject TP · research?")
        # a plain message never reaches a bot in privacy mode; the reply does
        api.push_message(chat_id=CHAT, user_id=APPROVER, text="lost in the group")
        assert api.hidden
        api.push_message(
            chat_id=CHAT,
            user_id=APPROVER,
            text="the sources are missing",
            reply_to=prompt.message_id,
        )
        await api.wait_for_message(lambda m: m.text.startswith("↩️ Rejected TP"))
        await api.wait_until(
            lambda: "Reason received" in api.messages[(CHAT, prompt.message_id)].text
        )
        await api.wait_until(
            lambda: any("the sources are missing" in e["prompt"] for e in agent_log(tmp_path)),
            timeout=30,
        )
        # rejected by the presser (the agent is already at work on the next round, so the
        # gate may be open again: what counts is the decision on record)
        assert ("research", "rejected", APPROVER) in await rt.store.decisions_of("TP")


@pytest.mark.usefixtures("bot_backend")
async def test_cancel_command_drops_the_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {"rules": phase_rules()}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        gate = await _research_gate(api, "T3")
        prompt = await _press_reject(api, gate)
        await _delivered(rt, prompt)
        api.push_message(chat_id=CHAT, user_id=APPROVER, text="/cancel")
        await api.wait_for_message(lambda m: m.text.startswith("✖ Cancelled: nothing was rejected"))
        await api.wait_until(
            lambda: next(m for m in api.sent if m.message_id == prompt.message_id).edits > 0
        )
        assert await _still_awaiting(rt, "T3")
        # nothing left to cancel, said plainly
        api.push_message(chat_id=CHAT, user_id=APPROVER, text="/cancel")
        await api.wait_for_message(lambda m: m.text.startswith("Nothing to cancel"))
        # a second press is cancelled the same way
        prompt = await _press_reject(api, gate)
        api.push_message(chat_id=CHAT, user_id=APPROVER, text="/cancel")
        await api.wait_until(
            lambda: sum(m.text.startswith("✖ Cancelled: nothing") for m in api.sent) == 2
        )
        api.push_message(chat_id=CHAT, user_id=APPROVER, text="approved")
        await api.wait_for_message(approved("T3", "research"))
        assert _rejections(api) == []


@pytest.mark.usefixtures("bot_backend")
async def test_cancel_before_the_question_is_recorded_delivered_still_marks_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {"rules": phase_rules()}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        gate = await _research_gate(api, "T5")
        # The question reaches the chat, but Telegram's answer (its message id) is late:
        # the bot has not recorded it delivered when /cancel comes in.
        api.hold_answers(["sendMessage"])
        prompt = await _press_reject(api, gate)
        assert await rt.store.live_by_message(str(CHAT), prompt.message_id) is None

        async def cancelled() -> bool:
            entries = await rt.store.audit_entries(limit=50)
            return any(e.action == "reject" and e.outcome == "cancelled" for e in entries)

        api.push_message(chat_id=CHAT, user_id=APPROVER, text="/cancel")
        await wait_until(cancelled, what="the /cancel handled")
        assert await rt.store.live_by_message(str(CHAT), prompt.message_id) is None
        api.release()
        await api.wait_for_message(lambda m: m.text.startswith("✖ Cancelled: nothing was rejected"))
        await api.wait_until(
            lambda: (
                "✖ Cancelled; nothing was rejected." in api.messages[(CHAT, prompt.message_id)].text
            )
        )
        shown = api.messages[(CHAT, prompt.message_id)].text
        assert shown.count("Cancelled; nothing was rejected") == 1
        assert shown.startswith(prompt.text.split("\n")[0])
        assert await _still_awaiting(rt, "T5")
        assert await rt.store.reason_request(str(CHAT), APPROVER) is None


@pytest.mark.usefixtures("bot_backend")
async def test_a_reason_request_expires(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_script(tmp_path, {"rules": phase_rules()}, monkeypatch)
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, reason_request_seconds=90)
        async with running_bot(api, settings) as rt:
            gate = await _research_gate(api, "T4")
            prompt = await _press_reject(api, gate)
            # 91 seconds pass: the request is aged in the database instead of waited for
            await rt.db.execute(
                "UPDATE bot_reason_requests SET created_at = created_at - 91 WHERE user_id = ?",
                (APPROVER,),
            )
            api.push_message(chat_id=CHAT, user_id=APPROVER, text="APPROVED")
            await api.wait_for_message(approved("T4", "research"))
            assert _rejections(api) == []
            assert not any("reads like an approval" in m.text for m in api.sent)
            # the question says it lapsed
            await api.wait_until(
                lambda: (
                    "nothing was rejected"
                    in next(m for m in api.sent if m.message_id == prompt.message_id).text
                )
            )
            assert await rt.store.reason_request(str(CHAT), APPROVER) is None
            assert "after 90 seconds without a reason" in prompt.text


def _target(database: Any) -> Any:
    return database.path if database.dialect == "sqlite" else database.url


async def test_the_store_expires_requests_by_its_clock(database: Any) -> None:
    now = [1000.0]
    store = SqlBotStore(database, clock=lambda: now[0])
    await store.ask_reason(str(CHAT), APPROVER, "g1", prompt_ref="reason:g1:22:7")
    pending = await store.reason_request(str(CHAT), APPROVER, max_age=60)
    assert pending is not None
    assert (pending.gate_id, pending.prompt_ref, pending.expired) == (
        "g1",
        "reason:g1:22:7",
        False,
    )
    now[0] += 61
    lapsed = await store.reason_request(str(CHAT), APPROVER, max_age=60)
    assert lapsed is not None
    assert lapsed.expired
    assert await store.reason_request(str(CHAT), APPROVER, max_age=60) is None
    # dropping names the gate: a request for another gate stays
    await store.ask_reason(str(CHAT), APPROVER, "g4")
    assert not await store.drop_reason_request(str(CHAT), APPROVER, gate_id="g1")
    assert await store.drop_reason_request(str(CHAT), APPROVER, gate_id="g4")
    await store.ask_reason(str(CHAT), APPROVER, "g5")
    # a restart keeps a pending request
    async with open_database(_target(database)) as db:
        store = SqlBotStore(db, clock=lambda: now[0])
        pending = await store.reason_request(str(CHAT), APPROVER, max_age=60)
        assert pending is not None
        assert pending.gate_id == "g5"


async def test_retiring_a_question_reaches_it_queued_in_flight_or_delivered(database: Any) -> None:
    store = SqlBotStore(database)
    force = {"force_reply": True, "selective": True}
    for n in (1, 2):
        await store.enqueue(
            [OutboxItem(chat_id=str(CHAT), body=f"why {n}?", markup=force, ref=f"q{n}")]
        )
    # q1: retired while its send is in flight (read by the sender, not yet recorded).
    in_flight = await store.next_outbox()
    assert in_flight is not None
    assert in_flight.item.ref == "q1"
    await store.outbox_sending(in_flight.id)
    assert await store.retire_live("q1", "✖ Cancelled.")
    await store.outbox_sent(in_flight, 501)
    live = await store.get_live("q1")
    assert live is not None
    assert (live.body, live.markup, live.message_id) == ("why 1?\n✖ Cancelled.", None, 501)
    assert [m.ref for m in await store.dirty_live()] == ["q1"]  # it will be edited
    assert not await store.retire_live("q1", "✖ Cancelled.")  # once only
    # q2: retired before its send began: it goes out already retired, with no edit due.
    assert await store.retire_live("q2", "⌛ Lapsed.")
    queued = await store.next_outbox()
    assert queued is not None
    assert (queued.item.body, queued.item.markup) == ("why 2?\n⌛ Lapsed.", None)
    await store.outbox_sent(queued, 502)
    assert [m.ref for m in await store.dirty_live()] == ["q1"]
    # Delivered first, then retired: an edit.
    await store.live_edited("q1", "why 1?\n✖ Cancelled.", 0.0)
    await store.enqueue([OutboxItem(chat_id=str(CHAT), body="why 3?", markup=force, ref="q3")])
    third = await store.next_outbox()
    assert third is not None
    await store.outbox_sent(third, 503)
    assert await store.retire_live("q3", "✍️ Reason received.")
    live = await store.get_live("q3")
    assert live is not None
    assert (live.body, live.markup) == ("why 3?\n✍️ Reason received.", None)
    assert [m.ref for m in await store.dirty_live()] == ["q3"]
    assert not await store.retire_live("nothing", "x")
