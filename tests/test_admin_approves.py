"""An admin holds every role: it may approve a gate (the self-approval rule still applies)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.gates import Refusal
from tests.fakes.bot_api import FakeBotApi, SentMessage
from tests.fakes.bot_harness import (
    ADMIN,
    CHAT,
    approved,
    bot_settings,
    running_bot,
    write_script,
)
from tests.gates_support import make_settings, open_gates, phase_rules

pytestmark = [pytest.mark.usefixtures("isolated_env"), pytest.mark.timeout(120)]


async def _open_gate(gates, name: str, started_by: int | None = None):  # type: ignore[no-untyped-def]
    task = await gates.init_task(name, started_by=started_by)
    (task.folder / "research.md").write_text("# research\n")
    return await gates.transition(name, "research:awaiting_approval")


async def test_an_admin_approves_but_not_its_own_task(tmp_path: Path) -> None:
    admin = 7
    settings = make_settings(tmp_path, approvers=(), admins=(admin,), forbid_self_approval=True)
    async with open_gates(settings) as gates:
        await _open_gate(gates, "a")
        result = await gates.approve("a", by=admin)
        assert result.reason is None, result.detail
        assert result.outcome.value == "approved"

        await _open_gate(gates, "b", started_by=admin)
        mine = await gates.approve("b", by=admin)
        assert mine.reason is Refusal.SELF_APPROVAL
        # a stranger is still refused
        other = await gates.approve("a", by=99)
        assert other.reason is not None


def _gate(m: SentMessage) -> bool:
    return m.text.startswith("🛂 Gate:")


async def test_an_admin_approves_by_button_in_the_chat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {"rules": phase_rules()}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)):
        api.push_message(chat_id=CHAT, user_id=ADMIN, text="/autopilot T1 build it")
        gate = await api.wait_for_message(_gate, timeout=60)
        approve = next(b["callback_data"] for b in gate.buttons if b["text"].endswith("Approve"))
        api.push_callback(chat_id=CHAT, user_id=ADMIN, data=approve, message_id=gate.message_id)
        await api.wait_for_message(approved("T1", "research"))
