"""The web view in a real browser: Debian's Chromium, driven by Playwright.

With the bot (a real python-telegram-bot against the fake Bot API): ``/web`` in a private
chat hands out a one-time link, the link signs in, the board lists the drive and its gate,
approving on the page changes the chat's gate message, and the drive's next events reach
the open run page live. Without the bot: a Mini App's ``initData`` in the URL fragment
signs in (and a forged one does not), a replayed link is refused, and a page opened before
the artifact changed cannot approve the new one.

Screenshots at a phone's size (390×844) and a desktop's go to ``TURNSTILE_SCREENSHOTS``
(CI keeps them) or the test's folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import Browser, Page, async_playwright

from engine.store.runs import SqliteRunStore
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import APPROVER, CHAT, OPERATOR, bot_settings, running_bot
from tests.gates_support import phase_rules
from tests.web_support import (
    APPROVER as WEB_APPROVER,
)
from tests.web_support import (
    GATE,
    OTHER_APPROVER,
    TOKEN,
    Served,
    free_port,
    gate_task,
    served,
)
from webview.signin import sign_init_data

pytestmark = pytest.mark.timeout(120)
_FIXTURES = (served,)

PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 860}


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        reason = "these tests need Debian's chromium (apt-get install chromium; .ci/run does)"
        # Under CI (``CI`` set) a missing browser fails, as a missing PostgreSQL does.
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return found


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's own sandbox refuses to start.
        launched = await p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        try:
            yield launched
        finally:
            await launched.close()


def _shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("TURNSTILE_SCREENSHOTS") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


async def _page(browser: Browser, size: dict[str, int]) -> Page:
    context = await browser.new_context(viewport=size)  # type: ignore[arg-type]
    page = await context.new_page()
    page.set_default_timeout(15_000)
    return page


# -- with the bot ----------------------------------------------------------------------


async def test_from_the_chat_to_the_board_and_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, browser: Browser
) -> None:
    script = tmp_path / "agent-script.json"
    script.write_text(json.dumps({"rules": phase_rules()}))
    for key, value in {
        "FAKE_AGENT_SCRIPT": str(script),
        "FAKE_AGENT_STATE": str(tmp_path / "agent-state"),
        "FAKE_AGENT_LOG": str(tmp_path / "agent-log.jsonl"),
    }.items():
        monkeypatch.setenv(key, value)
    port = free_port()
    shots = _shots(tmp_path)
    async with FakeBotApi() as api:
        api.names[APPROVER] = "Ann"
        api.names[OPERATOR] = "Olu"
        settings = bot_settings(
            api,
            tmp_path,
            allowed_chats=(CHAT, APPROVER),  # the group, and the approver's private chat
            web_port=port,
            web_url=f"http://127.0.0.1:{port}",
        )
        async with running_bot(api, settings) as rt:
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot T1 build it")
            gate = await api.wait_for_message(
                lambda m: (
                    m.chat_id == CHAT and m.text.startswith("🛂 Gate: task T1 · phase research")
                )
            )
            # /web in a group says to ask in private; in private it gives the link.
            api.push_message(chat_id=CHAT, user_id=APPROVER, text="/web")
            await api.wait_for_message(lambda m: "in a private chat" in m.text)
            api.push_message(chat_id=APPROVER, user_id=APPROVER, text="/web")
            answer = await api.wait_for_message(
                lambda m: m.chat_id == APPROVER and "/signin/link/" in m.text
            )
            link = re.search(r"http://\S+/signin/link/\S+", answer.text)
            assert link is not None

            page = await _page(browser, PHONE)
            await page.goto(link.group(0))
            await page.wait_for_selector("text=Waiting for you")
            assert await page.locator("header .me").inner_text() == "Ann"
            await page.wait_for_selector("text=Task T1: the research phase waits for approval")
            await page.screenshot(path=str(shots / "board-phone.png"), full_page=True)
            runs = await page.locator("#runs tbody tr").all_inner_texts()
            assert any("T1" in row and "autopilot" in row for row in runs), runs

            # The drive's page, open while the gate is decided elsewhere on the web.
            run = await SqliteRunStore(rt.db).latest_task_run("autopilot", "T1")
            assert run is not None
            watcher = await _page(browser, DESKTOP)
            await watcher.goto(link.group(0).replace("/signin/link/", "/signin/link/x"))
            assert "used already or has expired" in await watcher.content()  # a wrong token
            await watcher.context.add_cookies(await page.context.cookies())
            await watcher.goto(f"http://127.0.0.1:{port}/runs/{run.id}")
            await watcher.wait_for_selector("#timeline svg")
            before = await watcher.locator("#events li").count()
            await watcher.screenshot(path=str(shots / "run-desktop.png"), full_page=True)

            await page.click("text=Task T1: the research phase waits for approval")
            await page.wait_for_selector("article.artifact h1")
            assert gate.text.split("sha256 ")[1][:12] in await page.inner_text("#gate")
            await page.screenshot(path=str(shots / "gate-phone.png"), full_page=True)
            approved_at = time.monotonic()
            await page.click("#approve button")
            await page.wait_for_selector("text=Approved: task T1 goes on")

            # The chat's gate message says who approved it, and where.
            await api.wait_until(lambda: "Approved by Ann on the web view" in gate.text)
            assert not gate.buttons
            # The drive goes on: its next events reach the open run page by themselves.
            await watcher.wait_for_function(
                f"document.querySelectorAll('#events li').length > {before}"
            )
            assert time.monotonic() - approved_at < 15
            await watcher.wait_for_selector("#events li.fresh")
            await watcher.screenshot(path=str(shots / "run-live-desktop.png"), full_page=True)
            board = await _page(browser, DESKTOP)
            await board.context.add_cookies(await page.context.cookies())
            await board.goto(f"http://127.0.0.1:{port}/?view=tasks")
            await board.wait_for_selector("#tasks")
            await board.screenshot(path=str(shots / "tasks-desktop.png"), full_page=True)
    audit = await _web_audit(settings.database)
    assert ("approve", "approved") in audit


async def _web_audit(database: Any) -> list[tuple[str, str]]:
    from engine.store.audit import SqliteAuditLog
    from engine.store.backend import open_database

    async with open_database(database) as db:
        return [(e.event, e.outcome) for e in await SqliteAuditLog(db).entries(origin="web")]


# -- the web view alone ----------------------------------------------------------------


async def test_a_mini_app_signs_in_from_the_fragment_and_a_forgery_does_not(
    served: Served, browser: Browser, tmp_path: Path
) -> None:
    page = await _page(browser, PHONE)
    fields = {
        "auth_date": str(int(time.time())),
        "user": json.dumps({"id": WEB_APPROVER, "first_name": "Ann"}),
        "query_id": "AAE",
    }
    forged = sign_init_data(fields, "999:not-this-bot")
    await page.goto(f"{served.url}/signin#tgWebAppData={_quote(forged)}&tgWebAppVersion=8.0")
    await page.wait_for_selector("text=not signed by Telegram for this bot")
    assert await page.locator("text=Waiting for you").count() == 0
    await page.screenshot(path=str(_shots(tmp_path) / "signin-refused-phone.png"))
    genuine = sign_init_data(fields, TOKEN)
    await page.goto(f"{served.url}/signin#tgWebAppData={_quote(genuine)}&tgWebAppVersion=8.0")
    await page.wait_for_selector("text=Waiting for you")
    assert page.url == f"{served.url}/"
    # A link is good once: the second browser that opens it gets the sign-in page.
    token = await served.view.links.issue(WEB_APPROVER)
    first = await _page(browser, DESKTOP)
    await first.goto(f"{served.url}/signin/link/{token}")
    await first.wait_for_selector("text=Waiting for you")
    second = await _page(browser, DESKTOP)
    await second.goto(f"{served.url}/signin/link/{token}")
    await second.wait_for_selector("text=used already or has expired")
    await second.goto(f"{served.url}/")
    await second.wait_for_selector("h1:text('Sign in')")


async def test_a_page_opened_before_the_artifact_changed_cannot_approve(
    served: Served, browser: Browser
) -> None:
    sha = await gate_task(served.gates)
    token = await served.view.links.issue(WEB_APPROVER)
    page = await _page(browser, DESKTOP)
    await page.goto(f"{served.url}/signin/link/{token}")
    await page.goto(f"{served.url}/tasks/t1")
    assert sha[:12] in await page.inner_text("#gate")
    # Meanwhile: rejected by another approver, revised, a new gate on new content.
    assert (await served.gates.reject("t1", by=OTHER_APPROVER, reason="more")).ok
    task = await served.gates.task("t1")
    (task.folder / "research.md").write_text("# Research\n\nrevised\n")
    await served.gates.store.transition("t1", GATE)
    await page.click("#approve button")
    await page.wait_for_selector("text=Not accepted")
    gate = await served.gates.open_gate("t1")
    assert gate is not None
    assert gate.gate_sha256 != sha
    assert (await served.gates.show("t1")).approvers == 0
    # Read again, the page shows the new artifact, and approving it works.
    assert "revised" in await page.inner_text("article.artifact")
    await page.click("#approve button")
    await page.wait_for_selector("text=Approved: task t1 goes on")


def _quote(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="")


# -- /web itself -----------------------------------------------------------------------


async def test_web_opens_the_mini_app_from_an_https_address(tmp_path: Path) -> None:
    async with FakeBotApi() as api:
        settings = bot_settings(
            api,
            tmp_path,
            allowed_chats=(CHAT, APPROVER),
            web_port=free_port(),
            web_url="https://board.example.org/",
        )
        async with running_bot(api, settings):
            api.push_message(chat_id=APPROVER, user_id=APPROVER, text="/web")
            answer = await api.wait_for_message(lambda m: "/signin/link/" in m.text)
    assert "https://board.example.org/signin/link/" in answer.text
    assert answer.reply_markup == {
        "inline_keyboard": [
            [{"text": "Open the board", "web_app": {"url": "https://board.example.org/signin"}}]
        ]
    }


async def test_web_says_so_when_the_web_view_is_off(tmp_path: Path) -> None:
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, allowed_chats=(CHAT, APPROVER))
        async with running_bot(api, settings) as rt:
            api.push_message(chat_id=APPROVER, user_id=APPROVER, text="/web")
            await api.wait_for_message(lambda m: "The web view is off here" in m.text)
            assert (await rt.db.fetchone("SELECT COUNT(*) AS n FROM web_links"))["n"] == 0
