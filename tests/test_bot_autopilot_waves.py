"""An autopilot drive seen from the chat: a wave of sub-tasks is one live message, gates
keep their own; a decided gate loses its buttons ahead of queued messages; nothing says
"running" after the task is complete; a running phase has a Stop button; phases are said
in words."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from chatfront.store import OutboxItem
from tests.fakes.bot_api import FakeBotApi, SentMessage
from tests.fakes.bot_harness import (
    APPROVER,
    CHAT,
    OPERATOR,
    bot_settings,
    running_bot,
    write_script,
)
from tests.gates_support import phase_rules

pytestmark = [pytest.mark.usefixtures("isolated_env"), pytest.mark.timeout(120)]

_WAVE = "# Split\n\n```subtasks\nwave 1: a - first\nwave 1: b\nwave 1: c - last\n```\n"
# Internal names people must never read (phases, states).
_INTERNAL = re.compile(r"test_design|bug_find|doc_review|human_intervention|awaiting_approval")


def _rules(decomposition: str) -> list[dict[str, Any]]:
    """The phases' artifacts, with contents that do not name their phase (what the agent
    writes is its own; only what the bot says is checked)."""
    rules = phase_rules(decomposition)
    for rule in rules:
        rule["files"] = {
            name: (content if "subtasks" in content else "# Notes\n\nturn {turn}\n")
            for name, content in rule["files"].items()
        }
    return rules


def _bursts(calls: list[Any]) -> list[Any]:
    """The sends of the test's queued messages among ``calls``."""
    return [
        c
        for c in calls
        if c.method == "sendMessage" and str(c.params.get("text")).startswith("burst")
    ]


async def _until(check: Callable[[], Awaitable[bool]], within: float = 30.0) -> None:
    """Poll ``check`` (a look at the store) until it is true; fail at the deadline."""
    deadline = asyncio.get_running_loop().time() + within
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def _open_gates(api: FakeBotApi) -> list[SentMessage]:
    return [m for m in api.sent if m.text.startswith("🛂 Gate:") and m.buttons]


async def _approve_all(api: FakeBotApi) -> None:
    """Press Approve on every gate that shows its buttons (again after a while: a press
    on a gate whose delivery is not recorded yet is refused with "press again")."""
    pressed: dict[int, float] = {}
    loop = asyncio.get_running_loop()
    while True:
        for gate in _open_gates(api):
            if loop.time() - pressed.get(gate.message_id, -10.0) < 2.0:
                continue
            pressed[gate.message_id] = loop.time()
            data = next(b["callback_data"] for b in gate.buttons if b["text"].endswith("Approve"))
            api.push_callback(chat_id=CHAT, user_id=APPROVER, data=data, message_id=gate.message_id)
        await asyncio.sleep(0.05)


def _said(api: FakeBotApi) -> list[tuple[str, int, str]]:
    """Every text the bot put in the chat, in order: (method, message id, text)."""
    out = []
    sends = iter(api.sent)
    for call in api.calls:
        if call.status != 200:
            continue
        if call.method in ("sendMessage", "sendDocument"):
            msg = next(sends)
            text = call.params.get("text") or call.params.get("caption") or ""
            out.append((call.method, msg.message_id, str(text)))
        elif call.method == "editMessageText":
            out.append((call.method, int(call.params["message_id"]), str(call.params["text"])))
    return out


async def _drive(api: FakeBotApi, tmp_path: Path, name: str) -> list[tuple[str, int, str]]:
    """/autopilot NAME with every gate approved by its button, until the task is complete
    (and a beat for the last edits): everything the bot said, in order."""
    async with running_bot(api, bot_settings(api, tmp_path)):
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"/autopilot {name} do it")
        helper = asyncio.create_task(_approve_all(api), name="approver")
        try:
            await api.wait_for_message(lambda m: f"🏁 Task {name} is complete" in m.text, 90)
        finally:
            helper.cancel()
        await asyncio.sleep(0.5)
    return _said(api)


async def test_a_wave_drive_posts_one_live_message_for_its_wave(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {"rules": _rules(_WAVE)}, monkeypatch)
    async with FakeBotApi() as api:
        await _drive(api, tmp_path, "p")
    # One message for the wave, edited as its sub-tasks move, and it ends saying each one
    # is complete; no message per sub-task phase, nor a summary per sub-task.
    waves = [m for m in api.sent if m.text.startswith("🛂 p · wave 1")]
    assert len(waves) == 1, [m.text for m in api.sent]
    [wave] = waves
    # Edited in place as the sub-tasks moved (how many edits a throttled message gets, and
    # which states it shows on the way, depend on the machine's pace: not counted).
    assert wave.edits >= 1
    assert wave.history[0] != wave.text
    assert wave.text.splitlines()[1:] == [
        "p.a · ✅ complete",
        "p.b · ✅ complete",
        "p.c · ✅ complete",
    ]
    assert not wave.buttons
    assert not [m.text for m in api.sent if re.match(r"🛂 p\.[abc] · ", m.text)]
    assert not [m.text for m in api.sent if m.text.startswith("🏁 Task p.")]
    # The sub-tasks' gates are still messages of their own, each with its artifact.
    for sub in ("p.a", "p.b", "p.c"):
        for phase in ("design", "test design"):
            head = f"🛂 Gate: task {sub} · phase {phase}\n"
            assert len([m for m in api.sent if m.text.startswith(head)]) == 1, (sub, phase)
    # Bounded: the answer, 4 + 6 gates, 2 wave notes, the wave, 5 phases, the summary
    # (before: a message per sub-task phase and a summary per sub-task, 37 in all).
    assert len(api.calls_of("sendMessage")) <= 20, len(api.calls_of("sendMessage"))
    assert len(api.calls_of("sendDocument")) == 10


async def test_nothing_says_running_once_a_wave_drive_is_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {"rules": _rules(_WAVE)}, monkeypatch)
    async with FakeBotApi() as api:
        said = await _drive(api, tmp_path, "p")
    # The summary comes last: no message says "running" when it is sent, nor after.
    last = max(i for i, (_, _, text) in enumerate(said) if text.startswith("🏁 Task p "))
    shown: dict[int, str] = {}
    for _, message_id, text in said[:last]:
        shown[message_id] = text
    assert not [t for t in shown.values() if "running" in t], shown
    assert not [t for _, _, t in said[last:] if "running" in t]


async def test_phases_are_said_in_words_in_every_message_of_a_drive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {"rules": _rules("# Split\n\n```subtasks\n```\n")}, monkeypatch)
    async with FakeBotApi() as api:
        said = await _drive(api, tmp_path, "w")
    # Every message, caption and edit, file names aside: no internal name of a phase.
    leaked = [t for _, _, t in said if _INTERNAL.search(re.sub(r"\S+\.md\b", "", t))]
    assert not leaked, leaked
    assert any("phase test design" in t for _, _, t in said)
    assert any(t.startswith("🛂 w · adversarial bug find\n") for _, _, t in said)


async def test_a_decided_gate_loses_its_buttons_before_queued_messages_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {"rules": _rules("# Split\n\n```subtasks\n```\n")}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot q")
        gate = await api.wait_for_message(lambda m: m.text.startswith("🛂 Gate: task q"), 30)
        await api.wait_until(lambda: bool(gate.buttons))
        approve = next(b["callback_data"] for b in gate.buttons if b["text"].endswith("Approve"))
        # A loaded outbox: many messages queued to this chat before the press.
        await rt.store.enqueue(
            [OutboxItem(chat_id=str(CHAT), thread_id=None, body=f"burst {i}") for i in range(600)]
        )
        rt.publisher.wake()
        await api.wait_until(lambda: any(m.text == "burst 5" for m in api.sent))
        # Telegram slow at that moment: the sends in flight wait (deterministically, however
        # loaded the machine is) while the approval is pressed and recorded.
        api.hold(["sendMessage"])
        await api.wait_until(lambda: api.parked >= 1)
        # (One send at a time: with one parked, none is under way.)
        sent = len(_bursts(api.calls))
        api.push_callback(chat_id=CHAT, user_id=APPROVER, data=approve, message_id=gate.message_id)

        async def decided() -> bool:
            live = await rt.store.live_by_message(str(CHAT), gate.message_id)
            return live is not None and "✅ Approved by" in live.body and live.urgent

        await _until(decided)
        in_flight = api.parked
        api.release()
        await api.wait_until(lambda: "✅ Approved by" in gate.text, timeout=30)
        [edit] = [
            c
            for c in api.calls
            if c.method == "editMessageText" and "✅ Approved by" in str(c.params.get("text"))
        ]
        await api.wait_until(lambda: any(m.text == "burst 599" for m in api.sent), timeout=60)
        await api.wait_for_message(lambda m: "decomposition" in m.text, 30)
        calls = list(api.calls)
    # Its buttons went first: only the sends already in flight when it was decided went
    # before it; every other queued message went after it.
    assert "reply_markup" not in edit.params or "inline_keyboard" not in str(
        edit.params["reply_markup"]
    )
    before = _bursts(calls[: calls.index(edit)])
    assert len(before) <= sent + in_flight, (len(before), sent, in_flight)
    assert len(_bursts(calls)) - len(before) >= 500 - sent
    # And the message queued after the decision (the next phase's) went after it too.
    nxt = [c for c in api.calls_of("sendMessage") if "decomposition" in str(c.params["text"])]
    assert nxt[0].at > edit.at


async def test_a_running_phase_has_a_stop_button_that_stops_the_drive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = tmp_path / "release"
    rules = _rules("# Split\n\n```subtasks\n```\n")
    rules[0] = {**rules[0], "wait_file": str(release)}  # research waits
    write_script(tmp_path, {"rules": rules}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)):
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot s")
        phase = await api.wait_for_message(lambda m: m.text.startswith("🛂 s · research"), 30)
        await api.wait_until(lambda: bool(phase.buttons))
        assert [b["text"] for b in phase.buttons] == ["⏹ Stop"]
        data = phase.buttons[0]["callback_data"]
        # An approver may not stop a drive: refused, it goes on.
        api.push_callback(chat_id=CHAT, user_id=APPROVER, data=data, message_id=phase.message_id)
        await api.wait_until(lambda: len(api.callback_answers) == 1)
        assert "operator" in api.callback_answers[0]["text"]
        assert phase.buttons
        # An operator stops it, as /stop s does; the phase's message says so, button gone.
        api.push_callback(chat_id=CHAT, user_id=OPERATOR, data=data, message_id=phase.message_id)
        await api.wait_for_message(lambda m: m.text.startswith("⏹ Autopilot for s stopped by"))
        await api.wait_until(lambda: "⏹ stopped" in phase.text and not phase.buttons)
        release.touch()
        # Resumed: the phase runs again, with its Stop button; when it ends (its gate), the
        # button is gone.
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot s")
        gate = await api.wait_for_message(lambda m: m.text.startswith("🛂 Gate: task s"), 30)
        await api.wait_until(
            lambda: [b["text"] for b in gate.buttons] == ["✅ Approve", "❌ Reject"]
        )
