"""Autopilot from the chat: every gate, approved by button, reply, /approve and "APPROVED",
and a rejection by button whose reason re-runs the phase."""

from __future__ import annotations

import asyncio
import hashlib
import re
from pathlib import Path

import pytest

from bot.autopilot import AutopilotExtension
from engine.gates import COMPLETE, Gates
from engine.humane import words
from engine.store.backend import open_database
from engine.store.runs import RunStatus, SqliteRunStore
from tests.fakes.bot_api import FakeBotApi, SentMessage
from tests.fakes.bot_harness import (
    APPROVER,
    CHAT,
    OPERATOR,
    agent_log,
    approved,
    bot_settings,
    running_bot,
    write_script,
)
from tests.gates_support import EventSink, phase_rules
from tests.support import wait_until

pytestmark = [pytest.mark.usefixtures("isolated_env", "bot_backend"), pytest.mark.timeout(120)]


def _gate(phase: str, nth: int = 0):  # type: ignore[no-untyped-def]
    def match(m: SentMessage) -> bool:
        return m.text.startswith("🛂 Gate:") and f"phase {words(phase)}" in m.text

    return match


async def _gate_message(api: FakeBotApi, phase: str, count: int = 1) -> SentMessage:
    await api.wait_until(lambda: sum(_gate(phase)(m) for m in api.sent) >= count, timeout=30)
    return [m for m in api.sent if _gate(phase)(m)][count - 1]


async def test_autopilot_through_every_gate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rules = phase_rules()
    # the last phase answers in Markdown: the task's summary shows its head rendered
    rules[-1]["text"] = "## Verdict\n\n**Ship it**: every phase holds.\n"
    write_script(tmp_path, {"rules": rules}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        api.names[APPROVER] = "Approver"
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot T1 build the widget")
        started = await api.wait_for_message(lambda m: "Autopilot for task T1 started" in m.text)

        # research: the artifact arrives as a document, then the gate with buttons
        gate = await _gate_message(api, "research")
        assert "research.md" in gate.text
        # the excerpt is rendered (entities), no raw Markdown; no internal state names
        await api.wait_until(lambda: bool(gate.entities))
        assert "# research" not in gate.text
        assert "awaiting_approval" not in gate.text
        assert "sha256 " in gate.text
        # The artifact's document is queued after the gate message: it may still be on its way.
        await api.wait_until(lambda: any(m.filename == "research.md" for m in api.sent))
        docs = [m for m in api.sent if m.filename == "research.md"]
        assert len(docs) == 1
        assert docs[0].document is not None
        # one message for the phase: it showed the phase running, then became its gate;
        # the artifact follows it as a document, and nothing else was posted for the phase
        assert any("⏳ running" in old for old in gate.history)
        assert docs[0].message_id > gate.message_id
        research = [m for m in api.sent if m.message_id > started.message_id]
        assert [m.message_id for m in research] == [gate.message_id, docs[0].message_id]
        approve = next(b["callback_data"] for b in gate.buttons if b["text"].endswith("Approve"))
        # an operator is not an approver: refused and audited, the gate stays open
        api.push_callback(chat_id=CHAT, user_id=OPERATOR, data=approve, message_id=gate.message_id)
        await api.wait_until(lambda: len(api.callback_answers) == 1)
        assert "Needs the approver role" in api.callback_answers[0]["text"]
        # 1. approved by the button
        before = len(api.sent)
        api.push_callback(chat_id=CHAT, user_id=APPROVER, data=approve, message_id=gate.message_id)
        await api.wait_for_message(approved("T1", "research"))
        # approved by name, in the gate message itself: the approval added no message
        assert "✅ Approved by Approver" in gate.text
        assert not gate.buttons
        assert not any(m.text.startswith("✅ Approved") for m in api.sent[before:])

        # 2. decomposition: approved by replying APPROVED to the gate message
        gate = await _gate_message(api, "decomposition")
        api.push_message(chat_id=CHAT, user_id=APPROVER, text="APPROVED", reply_to=gate.message_id)
        await api.wait_for_message(approved("T1", "decomposition"))

        # 3. design: approved with /approve TASK
        await _gate_message(api, "design")
        api.push_message(chat_id=CHAT, user_id=APPROVER, text="/approve T1")
        await api.wait_for_message(approved("T1", "design"))

        # 4. test_design: rejected by the button, the bot asks for a reason
        gate = await _gate_message(api, "test_design")
        reject = next(b["callback_data"] for b in gate.buttons if b["text"].endswith("Reject"))
        api.push_callback(chat_id=CHAT, user_id=APPROVER, data=reject, message_id=gate.message_id)
        await api.wait_for_message(lambda m: ", why reject T1 · test design" in m.text)
        api.push_message(chat_id=CHAT, user_id=APPROVER, text="cover the timeout path too")
        await api.wait_for_message(lambda m: m.text.startswith("↩️ Rejected T1 · test design"))
        # the phase re-ran with the reason; its new gate is approved by a plain APPROVED
        await _gate_message(api, "test_design", count=2)
        api.push_message(chat_id=CHAT, user_id=APPROVER, text="approved")
        await api.wait_for_message(approved("T1", "test_design"))

        done = await api.wait_for_message(lambda m: "Task T1 is complete" in m.text, timeout=60)
        assert "research approved by Approver" in done.text
        gates = Gates(rt.db, rt.settings)
        task = await gates.task("T1")
        assert task.phase == COMPLETE
        # what was done: every artifact with its short hash, the turns and the time
        for artifact in ("research.md", "test_plan.md", "referee.md"):
            digest = hashlib.sha256((task.folder / artifact).read_bytes()).hexdigest()
            assert f"{artifact} {digest[:12]}" in done.text
        turns = len(agent_log(tmp_path))
        assert re.search(rf"\n{turns} turns in \d+(m\d+)?s\.\n", done.text), done.text
        # and the last phase's output head, rendered: no raw Markdown marks
        assert done.text.endswith(
            "Last phase (referee), its output:\n✏ Verdict\n\nShip it: every phase holds."
        ), done.text
        assert {e["type"] for e in done.entities} >= {"bold"}
        # the decided gate messages lost their buttons
        await api.wait_until(lambda: all(not m.buttons for m in api.sent if _gate("")(m)))

    prompts = [e["prompt"] for e in agent_log(tmp_path)]
    test_design = [p for p in prompts if "Phase: test_design (" in p]
    assert len(test_design) == 2
    assert "cover the timeout path too" not in test_design[0]
    assert "cover the timeout path too" in test_design[1]
    assert sum("Phase: research (" in p for p in prompts) == 1


async def test_gates_survive_a_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_script(tmp_path, {"rules": phase_rules()}, monkeypatch)
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path)
        async with running_bot(api, settings):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot T2")
            gate = await _gate_message(api, "research")
        edits_before = len(api.calls_of("editMessageText"))
        async with running_bot(api, settings):
            # the open gate is refreshed in place, not posted again; unchanged, Telegram
            # answers "message is not modified", which counts as success
            await api.wait_until(
                lambda: any(
                    int(c.params.get("message_id", 0)) == gate.message_id
                    for c in api.calls_of("editMessageText")[edits_before:]
                )
            )
            refresh = next(
                c
                for c in api.calls_of("editMessageText")[edits_before:]
                if int(c.params.get("message_id", 0)) == gate.message_id
            )
            assert refresh.status == 400
            approve = next(
                b["callback_data"] for b in gate.buttons if b["text"].endswith("Approve")
            )
            api.push_callback(
                chat_id=CHAT, user_id=APPROVER, data=approve, message_id=gate.message_id
            )
            await api.wait_for_message(approved("T2", "research"))
            await _gate_message(api, "decomposition")
            # with two gates open, a plain APPROVED is ambiguous; a reply is not, and a
            # reply to the artifact's document counts as a reply to its gate
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot T3")
            await api.wait_until(lambda: any("task T3" in m.text for m in api.sent if _gate("")(m)))
            api.push_message(chat_id=CHAT, user_id=APPROVER, text="APPROVED")
            await api.wait_for_message(lambda m: m.text.startswith("Several gates are open"))
            doc = next(m for m in api.sent if m.filename == "decomposition.md")
            api.push_message(
                chat_id=CHAT, user_id=APPROVER, text="Approved.", reply_to=doc.message_id
            )
            await api.wait_for_message(approved("T2", "decomposition"))
            assert not any(m.text.startswith("✅ Approved T3") for m in api.sent)
        t2_research = [m for m in api.sent if _gate("research")(m) and "task T2 " in m.text]
        assert len(t2_research) == 1
        assert sum(m.filename == "research.md" for m in api.sent) == 2  # T2 and T3


async def test_a_gate_approved_elsewhere_goes_stale_in_the_chat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {"rules": phase_rules()}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot T4")
        gate = await _gate_message(api, "research")
        sha = gate.text.split("sha256 ")[1].split()[0]
        # approved from the terminal (another Gates, as another process would)
        result = await Gates(rt.db, rt.settings).approve("T4", by=APPROVER, expected_sha256=sha)
        assert result.ok
        await _gate_message(api, "decomposition")
        await api.wait_until(lambda: "Superseded" in gate.text)
        assert not gate.buttons
        # a press on the old button (a client that still shows it) changes nothing
        row = await rt.db.fetchone(
            "SELECT gate_id, state FROM bot_gates WHERE task = 'T4' AND phase = 'research'"
        )
        assert row is not None
        assert row["state"] == "superseded"
        api.push_callback(
            chat_id=CHAT, user_id=APPROVER, data=f"ap:{row['gate_id']}", message_id=gate.message_id
        )
        await api.wait_until(
            lambda: any(a.get("text") == "This gate is closed." for a in api.callback_answers)
        )
    assert not any(m.text.startswith("✅ Approved T4") for m in api.sent)


async def _press(api: FakeBotApi, *, chat_id: int, data: str, message_id: int) -> str:
    """An approver's press; the bot's answer to it."""
    answered = len(api.callback_answers)
    api.push_callback(chat_id=chat_id, user_id=APPROVER, data=data, message_id=message_id)
    await api.wait_until(lambda: len(api.callback_answers) > answered)
    return str(api.callback_answers[-1].get("text", ""))


async def test_gate_buttons_count_only_on_the_gate_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other_chat = -1002
    write_script(tmp_path, {"rules": phase_rules()}, monkeypatch)
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, allowed_chats=(CHAT, other_chat))
        async with running_bot(api, settings) as rt:
            # a message of the bot in another allowed chat, for a forged press to be on
            api.push_message(chat_id=other_chat, user_id=OPERATOR, text="/help")
            elsewhere = await api.wait_for_message(lambda m: m.chat_id == other_chat)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot T7")
            started = await api.wait_for_message(
                lambda m: "Autopilot for task T7 started" in m.text
            )
            gate = await _gate_message(api, "research")
            approve, reject = (b["callback_data"] for b in gate.buttons)
            gate_id = approve.split(":")[1]

            async def delivered() -> bool:
                live = await rt.store.get_live(f"gate:{gate_id}")
                return live is not None and live.message_id == gate.message_id

            await wait_until(delivered)
            forged = [
                (other_chat, elsewhere.message_id),  # another allowed chat
                (other_chat, gate.message_id),  # the gate's message id, in another chat
                (CHAT, started.message_id),  # another message in the gate's chat
            ]
            for data in (approve, reject):
                for chat, message in forged:
                    answer = await _press(api, chat_id=chat, data=data, message_id=message)
                    assert answer == "⛔ This button does not belong to this message."
            # nothing was decided, no reason was asked for, the gate still waits
            assert not any("why reject" in m.text for m in api.sent)
            assert "Waiting for approval" in gate.text
            assert gate.buttons
            assert (await Gates(rt.db, rt.settings).open_gate("T7")) is not None
            refused = [
                (e.action, e.chat_id)
                for e in reversed(await rt.store.audit_entries())
                if e.outcome == "refused" and f"gate {gate_id}" in (e.reason or "")
            ]
            assert refused == [("approve", str(c)) for c, _ in forged] + [
                ("reject", str(c)) for c, _ in forged
            ]
            # the press on the gate's own message still approves it
            await _press(api, chat_id=CHAT, data=approve, message_id=gate.message_id)
            await api.wait_for_message(approved("T7", "research"))


async def test_stop_task_stops_the_drive_and_autopilot_resumes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = tmp_path / "release"
    rules = phase_rules()
    rules[0] = {**rules[0], "wait_file": str(release)}  # research waits
    write_script(tmp_path, {"rules": rules}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot T5")
        await api.wait_for_message(lambda m: "Autopilot for task T5 started" in m.text)
        await api.wait_until(lambda: any("running" in m.text for m in api.sent if "T5" in m.text))
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/stop T5")
        await api.wait_for_message(lambda m: m.text.startswith("⏹ Autopilot for T5 stopped"))
        assert (await Gates(rt.db, rt.settings).task("T5")).phase == "research"
        release.touch()
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot T5")
        await api.wait_for_message(lambda m: "Autopilot for task T5 resumed at research" in m.text)
        await _gate_message(api, "research")


async def test_stop_takes_the_drive_s_run_id_as_on_the_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = tmp_path / "release"
    rules = phase_rules()
    rules[0] = {**rules[0], "wait_file": str(release)}  # research waits
    write_script(tmp_path, {"rules": rules}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot T8")
        await api.wait_for_message(lambda m: "Autopilot for task T8 started" in m.text)
        await api.wait_until(lambda: any("running" in m.text for m in api.sent if "T8" in m.text))
        [run] = [r for r in await rt.runs.list_runs() if r.task == "T8"]
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"/stop {run.id}")
        await api.wait_for_message(lambda m: m.text.startswith("⏹ Autopilot for T8 stopped"))
        assert (await rt.runs.get_run(run.id)).status is RunStatus.STOPPED
        release.touch()


async def test_a_drive_a_terminal_took_over_is_not_resumed_by_the_bot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {"rules": phase_rules()}, monkeypatch)
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path)
        async with running_bot(api, settings):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot T6")
            await _gate_message(api, "research")
        # The bot is gone with T6 parked at its gate; a terminal drives T6 on (it holds the
        # drive lock and continues the chat's run).
        async with open_database(settings) as db:
            terminal = Gates(db, settings, poll_interval=0.05)
            sink = EventSink()
            handle = terminal.start_autopilot("T6", sink)
            await asyncio.wait_for(sink.queue.get(), 30)  # at the research gate again
            run = await SqliteRunStore(db).latest_task_run("autopilot", "T6")
            assert run is not None
            assert run.status is RunStatus.RUNNING
            assert run.chat_id == str(CHAT)
            try:
                async with running_bot(api, settings) as rt:
                    assert rt.features is not None
                    pilot = next(
                        f for f in rt.features.extensions if isinstance(f, AutopilotExtension)
                    )
                    # Recovered without taking the drive over (it would be refused anyway).
                    assert pilot.executor.state_of("T6") is None
                    assert not handle.done
            finally:
                await handle.stop()
    assert not any("Autopilot for T6 failed" in m.text for m in api.sent)


async def test_a_failing_phase_says_the_exit_code_and_the_error_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing = {"match": "", "text": "half done", "exit": 3, "stderr": "fatal: API said 401\n"}
    write_script(tmp_path, {"rules": [failing]}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)):
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot hf1 fix the login")
        problems = await api.wait_for_message(lambda m: "[hf1 · research] problems:" in m.text)
        assert problems.text == (
            "[hf1 · research] problems: research.md was not written in the task folder hf1/\n"
            "⚠️ the agent exited with code 3\n"
            "Its error output ended with:\n"
            "fatal: API said 401"
        )
        person = await api.wait_for_message(lambda m: "after a revision turn" in m.text)
        assert "exited with code 3" in person.text
        assert "fatal: API said 401" in person.text
        # the phase's own message says it too, ahead of the output
        phase = next(m for m in api.sent if m.text.startswith("🛂 hf1 · research"))
        # (its edits are paced: they may still follow the messages after it)
        await api.wait_until(
            lambda: any("exited with code 3" in old for old in [phase.text, *phase.history])
        )
        assert not any(str(tmp_path) in m.text for m in api.sent)
