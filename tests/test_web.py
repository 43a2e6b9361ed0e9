"""The web view over HTTP: sign-in, the board, a run's page and its live events, gate and
tool decisions with the chat's rules, and the metrics.

A real server on 127.0.0.1 over a real SQLite file, talked to by a real HTTP client with
a cookie jar; what the chat would show of a decision is recorded by a small front end of
the test's own (tests/web_support.py); the bot's in tests/test_web_browser.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest

from engine.approvals.store import SqliteApprovalStore
from engine.runs import RunMode, RunSupervisor
from engine.store.audit import SqliteAuditLog
from engine.store.backend import AnyDatabase
from engine.store.runs import SqliteRunStore
from engine.turn import TurnOutput
from tests.web_support import (
    APPROVER,
    GATE,
    OPERATOR,
    OTHER_APPROVER,
    STRANGER,
    TOKEN,
    Served,
    gate_task,
    served,
)
from webview.app import COOKIE
from webview.signin import SignInRefused, check_init_data, sign_init_data

pytestmark = pytest.mark.timeout(60)
_FIXTURES = (served,)


def _csrf(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found is not None, page
    return found.group(1)


# -- signing in ------------------------------------------------------------------------


def test_init_data_is_checked_the_way_telegram_documents() -> None:
    now = time.time()
    fields = {"auth_date": str(int(now)), "user": json.dumps({"id": APPROVER, "first_name": "Ann"})}
    signed = sign_init_data(fields, TOKEN)
    user = check_init_data(signed, TOKEN, now=now)
    assert (user.id, user.first_name) == (APPROVER, "Ann")
    # The known vector: HMAC-SHA-256 of the sorted lines under the key from "WebAppData".
    import hashlib
    import hmac

    secret = hmac.new(b"WebAppData", TOKEN.encode(), hashlib.sha256).digest()
    lines = "\n".join(f"{k}={v}" for k, v in sorted(fields.items())).encode()
    assert f"hash={hmac.new(secret, lines, hashlib.sha256).hexdigest()}" in signed
    with pytest.raises(SignInRefused, match="not signed"):
        check_init_data(signed, "123456:another-bot", now=now)
    forged = signed.replace("%22id%22%3A+42", "%22id%22%3A+43")
    assert forged != signed
    with pytest.raises(SignInRefused, match="not signed"):
        check_init_data(forged, TOKEN, now=now)
    with pytest.raises(SignInRefused, match="too old"):
        check_init_data(signed, TOKEN, now=now + 7200)
    with pytest.raises(SignInRefused, match="too old"):
        check_init_data(signed, TOKEN, now=now - 600)  # signed in the future
    with pytest.raises(SignInRefused, match="malformed"):
        check_init_data("%%%", TOKEN, now=now)
    with pytest.raises(SignInRefused):
        check_init_data(sign_init_data({"auth_date": str(int(now))}, TOKEN), TOKEN, now=now)


async def test_a_link_signs_in_once(served: Served) -> None:
    token = await served.view.links.issue(APPROVER)
    async with served.client() as client:
        async with client.get("/", allow_redirects=False) as response:
            assert response.status == 401
            assert "Sign in" in await response.text()
        async with client.get(f"/signin/link/{token}", allow_redirects=False) as response:
            assert response.status == 303
            cookie = response.cookies[COOKIE]
            assert cookie["httponly"]
            assert cookie["samesite"] == "Lax"
        async with client.get("/") as response:
            assert response.status == 200
            assert "Ann" in await response.text()
    async with served.client() as replay, replay.get(f"/signin/link/{token}") as response:
        assert response.status == 403
        assert "used already or has expired" in await response.text()
        assert COOKIE not in response.cookies


async def test_an_expired_link_and_a_forged_cookie_get_the_signin_page(served: Served) -> None:
    links = served.view.links
    token = await links.issue(APPROVER)
    await served.db.execute("UPDATE web_links SET expires_at = ?", (time.time() - 1,))
    async with served.client() as client:
        async with client.get(f"/signin/link/{token}") as response:
            assert response.status == 403
        client.cookie_jar.update_cookies({COOKIE: "eyJ1Ijo0Mn0.forged.signature"})
        async with client.get("/") as response:
            assert response.status == 401
            assert "Sign in" in await response.text()
    # A person without a role signs in to nothing.
    stranger = await links.issue(STRANGER)
    async with served.client() as client, client.get(f"/signin/link/{stranger}") as response:
        assert response.status == 403
        assert "no role here" in await response.text()


async def test_a_mini_app_signs_in_with_init_data(served: Served) -> None:
    fields = {"auth_date": str(int(time.time())), "user": json.dumps({"id": OPERATOR})}
    async with served.client() as client:
        async with client.post(
            "/signin/telegram",
            data={"init_data": sign_init_data(fields, TOKEN)},
            allow_redirects=False,
        ) as response:
            assert response.status == 303
        async with client.get("/") as response:
            assert "Olu" in await response.text()
    stale = {**fields, "auth_date": str(int(time.time()) - 7200)}
    async with served.client() as client:
        for data in (sign_init_data(stale, TOKEN), sign_init_data(fields, "1:other")):
            async with client.post("/signin/telegram", data={"init_data": data}) as response:
                assert response.status == 403
        async with client.get("/") as response:
            assert response.status == 401


# -- the board -------------------------------------------------------------------------


async def test_the_board_lists_runs_and_tasks_and_what_waits_for_me(served: Served) -> None:
    runs = SqliteRunStore(served.db)
    supervisor = RunSupervisor(runs)
    await supervisor.open_run(RunMode.AUTO, agent="command", session_id="s", objective="fix it")
    await gate_task(served.gates)
    operator = await served.signed_in(OPERATOR)
    approver = await served.signed_in(APPROVER)
    async with approver, operator:
        async with approver.get("/") as response:
            page = await response.text()
        assert "fix it" in page
        assert "Task t1: the research phase waits for approval" in page
        async with operator.get("/") as response:
            assert "Nothing waits for you" in await response.text()
        async with approver.get("/", params={"view": "tasks"}) as response:
            page = await response.text()
        assert 'href="/tasks/t1"' in page
        assert "waiting for approval" in page
        assert "awaiting_approval" not in page
        async with approver.get("/", params={"view": "tasks", "q": "nothing-like-it"}) as r:
            assert "No tasks." in await r.text()


async def test_the_board_pages_through_many_tasks(served: Served) -> None:
    now = time.time()
    async with served.db.transaction() as conn:
        await conn.executemany(
            "INSERT INTO gate_tasks (name, folder, workdir, phase, version, created_at,"
            " updated_at) VALUES (?, ?, ?, 'research', 1, ?, ?)",
            [(f"bulk{i:04d}", "/f", "/w", now - i, now - i) for i in range(120)],
        )
    async with await served.signed_in(APPROVER) as client:
        async with client.get("/", params={"view": "tasks"}) as response:
            first = await response.text()
        async with client.get("/", params={"view": "tasks", "page": "2"}) as response:
            last = await response.text()
    assert "bulk0000" in first
    assert "bulk0049" in first
    assert "bulk0050" not in first
    assert "older ▶" in first
    assert "bulk0100" in last
    assert "bulk0119" in last
    assert "older ▶" not in last


# -- deciding a gate -------------------------------------------------------------------


async def test_approving_from_the_page_is_bound_to_the_hash_it_showed(served: Served) -> None:
    sha = await gate_task(served.gates)
    async with await served.signed_in(APPROVER) as client:
        async with client.get("/tasks/t1") as response:
            page = await response.text()
        assert sha in page
        assert "<h1>Research</h1>" in page
        csrf = _csrf(page)
        # After the page was opened another approver rejected it and the agent revised
        # it: a new gate on a new artifact, with a new hash.
        rejected = await served.gates.reject("t1", by=OTHER_APPROVER, reason="deeper")
        assert rejected.ok
        task = await served.gates.task("t1")
        (task.folder / "research.md").write_text("# Research\n\nOther findings.\n")
        await served.gates.store.transition("t1", GATE)
        async with client.post("/tasks/t1/approve", data={"csrf": csrf, "sha256": sha}) as response:
            said = await response.text()
        assert "Not accepted" in said
        assert (await served.gates.open_gate("t1")) is not None  # still waits
        # Without the session's token nothing is decided either.
        fresh = (await served.gates.task("t1")).gate_sha256
        assert fresh is not None
        assert fresh != sha
        async with client.post("/tasks/t1/approve", data={"sha256": fresh}) as response:
            assert response.status == 403
        assert served.chat.gates == []
        async with client.post(
            "/tasks/t1/approve", data={"csrf": csrf, "sha256": fresh}
        ) as response:
            said = await response.text()
        assert "Approved: task t1 goes on" in said
    assert served.chat.gates == [("t1", "approved", APPROVER)]
    assert (await served.gates.show("t1")).approvers == 1  # its drive passes the gate
    audit = await SqliteAuditLog(served.db).entries(origin="web")
    assert [(e.event, e.outcome, e.actor) for e in audit] == [
        ("approve", "refused", str(APPROVER)),
        ("approve", "approved", str(APPROVER)),
    ]


async def test_rejecting_needs_a_reason_and_an_approver(served: Served) -> None:
    sha = await gate_task(served.gates)
    async with await served.signed_in(OPERATOR) as operator:
        async with operator.get("/tasks/t1") as response:
            page = await response.text()
        assert 'id="approve"' not in page  # an operator sees no decision buttons
        csrf = _csrf(page)
        async with operator.post(
            "/tasks/t1/reject", data={"csrf": csrf, "sha256": sha, "reason": "no"}
        ) as response:
            assert "needs the approver role" in await response.text()
    async with await served.signed_in(APPROVER) as client:
        async with client.get("/tasks/t1") as response:
            csrf = _csrf(await response.text())
        async with client.post(
            "/tasks/t1/reject", data={"csrf": csrf, "sha256": sha, "reason": "  "}
        ) as response:
            assert "Say why you reject it" in await response.text()
        async with client.post(
            "/tasks/t1/reject", data={"csrf": csrf, "sha256": sha, "reason": "cite sources"}
        ) as response:
            assert "revises the phase with your reason" in await response.text()
    assert served.chat.gates == [("t1", "rejected", APPROVER)]
    assert (await served.gates.task("t1")).revision_notes == "cite sources"


@pytest.mark.parametrize("served", [{"forbid_self_approval": True}], indirect=True)
async def test_self_approval_is_refused_as_in_the_chat(served: Served) -> None:
    task = await served.gates.init_task("mine", started_by=APPROVER)
    (task.folder / "research.md").write_text("# Mine\n")
    sha = (await served.gates.store.transition("mine", GATE)).gate_sha256
    assert sha is not None
    async with await served.signed_in(APPROVER) as client:
        async with client.get("/") as response:
            assert "Task mine" not in await response.text()  # not waiting for its starter
        async with client.get("/tasks/mine") as response:
            csrf = _csrf(await response.text())
        async with client.post(
            "/tasks/mine/approve", data={"csrf": csrf, "sha256": sha}
        ) as response:
            assert "Not accepted" in await response.text()
    assert (await served.gates.open_gate("mine")) is not None


# -- a run -----------------------------------------------------------------------------


async def _run_with_a_turn(db: AnyDatabase) -> str:
    runs = SqliteRunStore(db)
    run_id = await RunSupervisor(runs).open_run(
        RunMode.AUTO, agent="command", session_id="s", objective="the objective <b>"
    )
    turn = await runs.start_turn(run_id, 1, "clarify it", "clarify")
    await runs.finish_turn(turn, TurnOutput(text="done", exit_code=0))
    return run_id


async def test_a_run_page_shows_its_timeline_and_follows_new_events(served: Served) -> None:
    run_id = await _run_with_a_turn(served.db)
    async with await served.signed_in(OPERATOR) as client:
        async with client.get(f"/runs/{run_id}") as response:
            page = await response.text()
        assert "<svg" in page
        assert "the objective &lt;b&gt;" in page
        assert "turn 1 finished" in page
        cursor = re.search(r'data-cursor="(\d+)"', page)
        assert cursor is not None
        async with client.get(
            f"/runs/{run_id}/events", params={"after": cursor.group(1)}
        ) as stream:
            assert stream.headers["Content-Type"].startswith("text/event-stream")
            runs = SqliteRunStore(served.db)
            written = time.monotonic()
            await runs.start_turn(run_id, 2, "plan it", "plan")
            line = b""
            while b"turn 2 started" not in line:
                line = await asyncio.wait_for(stream.content.readline(), 5)
            assert time.monotonic() - written < 5
            assert json.loads(line.decode().removeprefix("data: "))["kind"] == "turn_started"
        async with client.get(f"/runs/{run_id}/timeline") as response:
            assert response.headers["Content-Type"].startswith("image/svg+xml")


async def test_a_stop_and_a_tool_decision_from_the_page(served: Served) -> None:
    run_id = await _run_with_a_turn(served.db)
    served.chat.running.add(run_id)
    approvals = SqliteApprovalStore(served.db)
    request = await approvals.open_request(
        run_id, "Bash", {"command": "rm -rf build"}, starter_id=OPERATOR
    )
    async with await served.signed_in(APPROVER) as approver:
        async with approver.get(f"/runs/{run_id}") as response:
            page = await response.text()
        assert "rm -rf build" in page
        assert 'id="tool-' in page
        assert "Stop this run" not in page  # an approver does not stop runs
        csrf = _csrf(page)
        async with approver.post(f"/runs/{run_id}/stop", data={"csrf": csrf}) as response:
            assert "needs the operator role" in await response.text()
        async with approver.post(
            f"/tools/{request.id}",
            data={"csrf": csrf, "choice": "once", "back": f"/runs/{run_id}"},
        ) as response:
            assert "The Bash call was allowed" in await response.text()
        async with approver.post(
            f"/tools/{request.id}", data={"csrf": csrf, "choice": "deny"}
        ) as response:
            assert "decided already" in await response.text()
    assert [r.id for r in served.chat.tools] == [request.id]
    assert (await approvals.get(request.id)).decided_by == APPROVER
    async with await served.signed_in(OPERATOR) as operator:
        async with operator.get(f"/runs/{run_id}") as response:
            csrf = _csrf(await response.text())
        async with operator.post(f"/runs/{run_id}/stop", data={"csrf": csrf}) as response:
            assert f"Run {run_id} is asked to stop" in await response.text()
    assert served.chat.stops == [(run_id, OPERATOR)]


async def test_metrics_need_their_token(served: Served) -> None:
    await _run_with_a_turn(served.db)
    async with served.client() as client:
        async with client.get("/metrics") as response:
            assert response.status == 401
        async with client.get("/metrics", headers={"Authorization": "Bearer wrong"}) as response:
            assert response.status == 401
        async with client.get(
            "/metrics", headers={"Authorization": "Bearer scrape-me"}
        ) as response:
            body = await response.text()
    assert 'turnstile_runs{mode="auto",status="running"} 1.0' in body


async def test_a_run_page_shows_the_running_turns_output_as_it_changes(served: Served) -> None:
    run_id = await _run_with_a_turn(served.db)

    async def progress(text: str) -> None:
        await served.db.execute(
            "INSERT INTO bot_live (ref, chat_id, body, updated_at) VALUES (?, 1, ?, ?)"
            " ON CONFLICT (ref) DO UPDATE SET body = excluded.body,"
            " updated_at = excluded.updated_at",
            (f"progress:{run_id}:2", text, time.time()),
        )

    await progress("⏳ reading the tests")
    async with await served.signed_in(OPERATOR) as client:
        async with client.get(f"/runs/{run_id}") as response:
            assert "⏳ reading the tests" in await response.text()
        async with client.get(f"/runs/{run_id}/events", params={"after": "99999"}) as stream:
            await progress("⏳ running pytest")
            line = b""
            while not line.startswith(b"data:"):
                line = await asyncio.wait_for(stream.content.readline(), 5)
    assert json.loads(line.decode().removeprefix("data: ")) == {"text": "⏳ running pytest"}


async def test_the_board_and_a_run_page_show_what_it_cost(served: Served) -> None:
    runs = SqliteRunStore(served.db)
    run_id = await RunSupervisor(runs).open_run(
        RunMode.AUTO, agent="claude", session_id="s", objective="priced"
    )
    for seq, cost in ((1, 0.0125), (2, None), (3, 0.0250)):
        turn = await runs.start_turn(run_id, seq, "p", "execute")
        usage = {"input_tokens": 100, "output_tokens": 10} if cost is not None else None
        await runs.finish_turn(
            turn, TurnOutput(text="ok", exit_code=0, metadata={"cost_usd": cost, "usage": usage})
        )
    async with await served.signed_in(OPERATOR) as client:
        async with client.get("/") as response:
            board = await response.text()
        async with client.get(f"/runs/{run_id}") as response:
            page = await response.text()
    row = board[board.index("priced") :].split("</tr>")[0]
    assert "≥ $0.0375" in row  # one turn of three reported nothing
    assert "Spend: ≥ $0.0375 · 220 tokens (200 in, 20 out) · 1 of 3 turns reported nothing" in page
    chart = page[page.index('class="spend"') :].split("</svg>")[0]
    assert chart.count("<rect") == 3
    assert "turn 2 (execute): the agent reported nothing" in chart
