"""The web view served for a test: a real server on 127.0.0.1 over a real SQLite file,
with a small chat front end of the test's own recording what the web view asked of it."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from chatfront.auth import Authorizer
from engine.approvals.store import SqliteApprovalStore, ToolRequest
from engine.gates import Gates
from engine.gates.records import ApprovalResult
from engine.gates.workflow import AWAITING_APPROVAL
from engine.settings import Settings
from engine.store.backend import AnyDatabase, open_database
from tests.gates_support import make_settings
from webview.actions import WebActions
from webview.app import WebView, serving

__all__ = [
    "APPROVER",
    "GATE",
    "OPERATOR",
    "OTHER_APPROVER",
    "STRANGER",
    "TOKEN",
    "ChatSide",
    "Served",
    "free_port",
    "gate_task",
    "served",
]

TOKEN = "123456:web-test-token"
APPROVER, OTHER_APPROVER, OPERATOR, STRANGER = 42, 43, 50, 99
GATE = f"research:{AWAITING_APPROVAL}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ChatSide:
    """What a chat front end was asked to do by the web view."""

    gates: list[tuple[str, str, int]] = field(default_factory=list)
    tools: list[ToolRequest] = field(default_factory=list)
    stops: list[tuple[str, int]] = field(default_factory=list)
    running: set[str] = field(default_factory=set)

    async def gate_decided(self, task: str, result: ApprovalResult, user_id: int) -> None:
        self.gates.append((task, result.outcome.value, user_id))

    async def tool_decided(self, request: ToolRequest) -> None:
        self.tools.append(request)

    async def stop(self, run_id: str, user_id: int) -> bool:
        self.stops.append((run_id, user_id))
        return run_id in self.running


@dataclass
class Served:
    url: str
    settings: Settings
    db: AnyDatabase
    gates: Gates
    view: WebView
    chat: ChatSide

    def client(self) -> aiohttp.ClientSession:
        # A cookie for 127.0.0.1 is kept only by a jar told to keep cookies for addresses.
        return aiohttp.ClientSession(self.url, cookie_jar=aiohttp.CookieJar(unsafe=True))

    async def signed_in(self, user_id: int) -> aiohttp.ClientSession:
        client = self.client()
        token = await self.view.links.issue(user_id)
        async with client.get(f"/signin/link/{token}", allow_redirects=False) as response:
            assert response.status == 303, await response.text()
        return client


@pytest.fixture
async def served(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Served]:
    settings = make_settings(
        tmp_path,
        **{
            "approvers": (APPROVER, OTHER_APPROVER),
            "operators": (OPERATOR,),
            "web_port": free_port(),
            "metrics_token": "scrape-me",
            **getattr(request, "param", {}),
        },
    )
    async with open_database(settings) as db:
        gates = Gates(db, settings)
        approvals = SqliteApprovalStore(db)
        chat = ChatSide()
        view = WebView(
            settings=settings,
            db=db,
            gates=gates,
            approvals=approvals,
            authorizer=Authorizer.from_ids(
                admins=settings.admins,
                approvers=settings.approvers,
                operators=settings.operators,
                allowed_chats=(),
            ),
            actions=WebActions(
                db, gates, approvals, chat, forbid_self_approval=settings.forbid_self_approval
            ),
            bot_token=TOKEN,
            names=lambda user_id: {APPROVER: "Ann", OPERATOR: "Olu"}.get(
                user_id or 0, f"user {user_id}"
            ),
        )
        assert settings.web_port is not None
        async with serving(view, "127.0.0.1", settings.web_port):
            yield Served(f"http://127.0.0.1:{settings.web_port}", settings, db, gates, view, chat)
        await gates.stop_all()


async def gate_task(gates: Gates, name: str = "t1", text: str = "# Research\n\nFindings.\n") -> str:
    """A task whose research gate waits for approval; its artifact's hash."""
    task = await gates.init_task(name, started_by=OPERATOR, summary="look around")
    (task.folder / "research.md").write_text(text)
    opened = await gates.store.transition(name, GATE)
    assert opened.gate_sha256 is not None
    return opened.gate_sha256
