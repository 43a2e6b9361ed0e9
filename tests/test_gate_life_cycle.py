"""One gate life cycle: the gate store says whether a gate waits; any front end decides it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.gates import Gates
from engine.store import SqliteAuditLog
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import APPROVER, CHAT, OPERATOR, bot_settings, running_bot
from tests.fakes.bot_harness import write_script as write_bot_script
from tests.gates_support import cli_env, phase_rules, run_cli

pytestmark = [pytest.mark.usefixtures("isolated_env", "bot_backend"), pytest.mark.timeout(120)]


async def test_a_gate_opened_from_the_terminal_is_approved_from_the_chat(
    tmp_path: Path,
) -> None:
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path)
        env = cli_env(settings)
        async with running_bot(api, settings) as rt:
            assert (await run_cli("status", "--task", "t8", "--init", env=env))[0] == 0
            (settings.tasks_root / "t8" / "research.md").write_text("# research\n\nfindings\n")
            rc, _, err = await run_cli(
                "status", "--task", "t8", "--transition", "research:awaiting_approval", env=env
            )
            assert rc == 0, err

            # an operator may not; an approver may, though no gate message was ever posted
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/approve t8")
            api.push_message(chat_id=CHAT, user_id=APPROVER, text="/approve t8")
            approved = await api.wait_for_message(lambda m: m.text.startswith("✅ Approved t8"))
            assert "research" in approved.text
            view = await Gates(rt.db, rt.settings).show("t8")
            assert view.approvers == 1
            assert [a.approver for a in view.approvals] == [str(APPROVER)]
            # one audit log: the chat's refusal and the gate's approval, in order
            entries = await SqliteAuditLog(rt.db).entries()
            refused = next(e for e in entries if e.origin == "bot" and e.actor == str(OPERATOR))
            approved = next(
                e
                for e in entries
                if e.origin == "gates" and e.event == "approve" and e.actor == str(APPROVER)
            )
            assert refused.outcome == "refused"
            assert refused.id < approved.id

            # approved: a second /approve says so instead of approving twice
            api.push_message(chat_id=CHAT, user_id=APPROVER, text="/approve t8")
            await api.wait_for_message(lambda m: "already approved" in m.text)

            # moved on from the terminal: the chat asks the gate store, not its own records
            rc, _, err = await run_cli(
                "status", "--task", "t8", "--transition", "decomposition", env=env
            )
            assert rc == 0, err
            api.push_message(chat_id=CHAT, user_id=APPROVER, text="/approve t8")
            await api.wait_for_message(lambda m: m.text == "No open gate for task t8.")
            api.push_message(chat_id=CHAT, user_id=APPROVER, text="/approve")
            await api.wait_for_message(
                lambda m: m.text == "No gate is waiting for approval in this chat."
            )


async def test_a_reply_approved_to_a_gate_decided_elsewhere_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_bot_script(tmp_path, {"rules": phase_rules()}, monkeypatch)
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, approval_quorum=2, approvers=(APPROVER, 77))
        async with running_bot(api, settings) as rt:
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot T5")
            gate = await api.wait_for_message(lambda m: m.text.startswith("🛂 Gate:"), timeout=60)
            # rejected from the terminal while the chat still shows the gate
            result = await Gates(rt.db, rt.settings).reject("T5", by=77, reason="redo it")
            assert result.ok
            api.push_message(
                chat_id=CHAT, user_id=APPROVER, text="APPROVED", reply_to=gate.message_id
            )
            await api.wait_for_message(lambda m: "no longer waits for approval" in m.text)
            view = await Gates(rt.db, rt.settings).show("T5")
            assert view.approvers == 0
