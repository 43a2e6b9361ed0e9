"""Button data no button of the bot carries (an oversized or negative number, another
script's digits, garbage), pressed through the fake Bot API: answered plainly, nothing
decided, no traceback in the log."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import ADMIN, CHAT, bot_settings, running_bot

pytestmark = [pytest.mark.usefixtures("isolated_env"), pytest.mark.timeout(60)]


def _failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith(("bot", "engine"))
        and (r.exc_info or "handler failed" in r.getMessage())
    ]


@pytest.mark.parametrize(
    ("data", "answer"),
    [
        ("tq:99999999999999999999999999:o", "That button is no longer valid."),
        ("tq:-1:o", "That button is no longer valid."),
        ("tq:٣:o", "That button is no longer valid."),
        ("tq:12:x", "That button is no longer valid."),
        ("zz:\x00garbage", "That button is no longer valid."),
        ("ap:99999999999999999999999999", "This gate is closed."),
        ("tk:x:²", None),
    ],
)
async def test_button_data_of_no_button_is_answered_plainly(
    tmp_path: Path, data: str, answer: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        assert rt.sender is not None
        api.push_callback(chat_id=CHAT, user_id=ADMIN, data=data, message_id=5, query_id="q1")
        await api.wait_until(lambda: bool(api.callback_answers))
        await rt.sender.wait_idle()
    [answered] = api.callback_answers
    assert answered["callback_query_id"] == "q1"
    assert answered.get("text") == answer
    assert not [m for m in api.sent if "Something went wrong" in m.text]
    assert not _failures(caplog)
