"""The chat's view of an auto run on the workers: real PostgreSQL, real ``turnstile worker``
processes, the real bot against the fake Bot API.

The bot follows the run from the store and the chat sees what a run of the bot's own process
shows, message for message: the run's live status message (its last line names the worker
running the turn), the final report and the turns document. ``/stop RUN`` answers at once
and that answer is edited when the run has stopped. A bot that restarts mid-run takes the
following up again without posting anything twice.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from bot.app import BotRuntime
from engine.automode.state import AutoModeState
from engine.runs.follow import Followed, Looked, RunEnded, RunFollower, TurnEnded, TurnStarted
from engine.store.runs import RunStatus, SqliteRunStore, TurnState
from engine.turn import TurnOutput
from engine.workers.store import QueuedRun, WorkerStore
from engine.workers.views import OnWorkers, look_on_workers
from tests.automode_support import (
    CLARIFY,
    EVALUATE,
    EXECUTE,
    PLAN,
    evaluation,
    git_workspace,
    write_script,
)
from tests.fakes.bot_api import FakeBotApi, SentMessage
from tests.fakes.bot_harness import CHAT, OPERATOR, bot_settings, running_bot
from tests.workers_support import HEARTBEAT, TIMEOUT, Cluster, wait_for
from tests.workers_support import cluster as cluster  # the fixture

pytestmark = [pytest.mark.usefixtures("isolated_env"), pytest.mark.timeout(120)]


async def _next(events: AsyncIterator[Followed[OnWorkers]]) -> Followed[OnWorkers]:
    return await asyncio.wait_for(anext(events), timeout=10)


async def test_the_follower_gives_each_turn_once_then_the_end(database: Any) -> None:
    """The store as a worker writes it, step by step: each event once, in order, read from
    the event log; where the run is (its placement, whether it waits for a worker) when that
    changes; a follower given the cursor its user kept gives no event again."""
    workers, runs = WorkerStore(database), SqliteRunStore(database)
    spec = QueuedRun(run_id="auto-f1", objective="o", tool="command", project="demo")
    await workers.place(spec)
    look = look_on_workers(database, "auto-f1", silent_after=2.0)
    follower = RunFollower(database, "auto-f1", look, poll=0.01)
    events = follower.events()
    first = await _next(events)
    assert isinstance(first, Looked)
    assert first.where.waiting == "waiting for a worker"
    await workers.take("auto-f1", "w1")
    state = AutoModeState("auto-f1", "s", "o", "/w", "/w/logs", max_turns=5, tool="command")
    # Its first step fills in the row placing wrote.
    await runs.start_placed("auto-f1", session_id="s", workdir="/w")
    await runs.update_run("auto-f1", state=state.to_json())
    await workers.register("w1", host="h", pid=1, capacity=1, queues=["turnstile.agent.command"])
    first_turn = await runs.start_turn("auto-f1", 1, "prompt", "clarify")
    started = await _next(events)
    while not isinstance(started, TurnStarted):  # (its start, its look, its row's changes)
        assert not isinstance(started, (TurnEnded, RunEnded))
        started = await _next(events)
    assert (started.seq, started.attempt, started.phase, started.where.worker) == (
        1,
        1,
        "clarify",
        "w1",
    )
    assert started.where.waiting is None  # (the worker is alive and holds it)
    await runs.finish_turn(first_turn, TurnOutput("Goal: x", exit_code=0))
    ended = await _next(events)
    while not isinstance(ended, TurnEnded):
        assert not isinstance(ended, (TurnStarted, RunEnded))
        ended = await _next(events)
    assert (ended.turn.seq, ended.turn.state, ended.turn.output) == (
        1,
        TurnState.FINISHED,
        "Goal: x",
    )
    await runs.update_run("auto-f1", status=RunStatus.COMPLETED)
    await workers.let_go("auto-f1", "")
    end = await _next(events)
    while not isinstance(end, RunEnded):
        assert not isinstance(end, (TurnStarted, TurnEnded))
        end = await _next(events)
    assert end.record.status is RunStatus.COMPLETED
    assert end.where.ended
    with pytest.raises(StopAsyncIteration):
        await _next(events)
    # Followed again from the cursor its user kept (a restarted bot): no event again.
    again = RunFollower(database, "auto-f1", look, after=follower.after, poll=0.01)
    assert [type(e) async for e in again.events()] == [Looked, RunEnded]


def _script(cluster: Cluster, *, wait_file: Path | None = None) -> None:
    execute: dict[str, Any] = {
        "text": "committed",
        "files": {"result.txt": "done\n"},
        "run": [
            ["git", "add", "result.txt"],
            ["git", "commit", "-q", "-m", "add result.txt"],
        ],
    }
    if wait_file is not None:
        execute.update(grandchild=True, wait_file=str(wait_file))
    write_script(
        cluster.tmp / "fake",
        rules=[
            {"match": CLARIFY, "text": "Goal: result.txt exists and is committed."},
            {"match": PLAN, "text": "1. write result.txt\n2. commit it"},
            {"match": EXECUTE, **execute},
            {"match": EVALUATE, **evaluation("COMPLETE")},
        ],
    )


def _execute_prompts(cluster: Cluster, run_id: str) -> list[str]:
    """The prompts of the run's Execute turns, in order (as the turns table has them)."""
    return [
        str(p)
        for (p,) in cluster.query(
            "SELECT prompt FROM turns WHERE run_id = %s AND phase = 'execute' ORDER BY seq",
            run_id,
        )
    ]


def _texts(message: SentMessage) -> list[str]:
    return [*message.history, message.text]


@asynccontextmanager
async def _bot(cluster: Cluster, api: FakeBotApi) -> AsyncIterator[BotRuntime]:
    root = cluster.tmp / "bot"
    root.mkdir(exist_ok=True)
    settings = bot_settings(
        api,
        root,
        database=cluster.url,
        execution="workers",
        projects=cluster.env["TURNSTILE_PROJECTS"],
        worker_heartbeat=float(HEARTBEAT),
        worker_timeout=float(TIMEOUT),
    )
    async with running_bot(api, settings) as runtime:
        yield runtime


def _start(cluster: Cluster) -> None:
    # The chat's project is "default": the bot and the worker know it by that name.
    cluster.env["TURNSTILE_PROJECTS"] = f"default={cluster.remote}#main"
    cluster.start_worker("w1")


async def _auto(api: FakeBotApi) -> tuple[str, SentMessage, int]:
    asked = api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto make result.txt")
    status = await api.wait_for_message(lambda m: "is queued on the workers" in _texts(m)[0])
    found = re.search(r"Auto run (\S+) is queued", _texts(status)[0])
    assert found is not None
    return found.group(1), status, api.pushed(asked)["message"]["message_id"]


async def _local_messages(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> int:
    """How many messages the same /auto of the same fake agent posts run by the bot itself."""
    root = cluster.tmp / "local"
    git_workspace(root / "ws" / "default")
    monkeypatch.setenv("FAKE_AGENT_SCRIPT", str(cluster.tmp / "fake" / "script.json"))
    monkeypatch.setenv("FAKE_AGENT_STATE", str(root / "agent-state"))
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, root)):
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto make result.txt")
        await api.wait_for_message(lambda m: m.text.startswith("Auto run "), timeout=60)
        await api.wait_for_message(lambda m: (m.filename or "").startswith("turns-"))
        return len(api.sent)


async def test_an_auto_run_on_a_worker_looks_in_the_chat_like_a_local_one(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    _script(cluster)
    await asyncio.to_thread(_start, cluster)
    async with FakeBotApi() as api, _bot(cluster, api):
        run_id, status, asked = await _auto(api)
        report = await api.wait_for_message(
            lambda m: m.text.startswith(f"Auto run {run_id}: completed"), timeout=60
        )
        turns = await api.wait_for_message(lambda m: m.filename == f"turns-{run_id}.md")
        # No message per turn: the running turn is the live status message's last line,
        # naming the worker (edits are throttled: fast turns may not each be seen).
        assert any(
            re.search(r"^(Clarify|Plan|Execute|Evaluate) running on worker w1$", t, re.M)
            for t in _texts(status)
        ), _texts(status)
        assert not any(m.text.startswith("⏳") for m in api.sent)
        # It names /stop and steering by message, as a local run's does.
        assert any(
            f"\nMessages here or /steer add instructions; /stop {run_id[-6:]} stops it." in t
            for t in _texts(status)
        ), _texts(status)
        # The run's one live status message, under the /auto, ended as a local run's does.
        assert status.reply_to == asked
        await api.wait_until(lambda: "✅ finished" in status.text)
        assert "Last turn:" in status.text
        # The final report and the turns document are the local run's (same renderers).
        assert "last phase: Evaluate" in report.text
        assert "Evidence (score" in report.text  # measured on the worker, in its worktree
        assert "Commits since start: 1" in report.text
        assert "Objective: make result.txt" in report.text
        assert turns.document is not None
        assert "[turn 1 · round 1/".encode() in turns.document
        assert b"Clarify, exit 0]" in turns.document
        assert b"Evaluate, exit 0]" in turns.document
        # The live message, the report and the document: nothing else, as a local run.
        assert len(api.sent) == 3, [_texts(m)[-1][:50] for m in api.sent]
    assert await _local_messages(cluster, monkeypatch) == 3


async def test_stop_run_answers_at_once_then_says_when_it_has_stopped(
    cluster: Cluster,
) -> None:
    _script(cluster, wait_file=cluster.tmp / "never")
    await asyncio.to_thread(_start, cluster)
    async with FakeBotApi() as api, _bot(cluster, api):
        run_id, status, _ = await _auto(api)
        await api.wait_until(lambda: "Execute running on worker w1" in status.text, timeout=60)
        before = len(api.sent)
        # named as its live message says: the end of its id
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"/stop {run_id[-6:]}")
        answer = await api.wait_for_message(lambda m: "Stopping run" in _texts(m)[0])
        assert _texts(answer)[0] == f"⏹ Stopping run {run_id} on worker w1…"
        # Said at once: the turn is still cut off on its worker then.
        await asyncio.to_thread(
            wait_for, "the run to stop", lambda: cluster.status(run_id) == "stopped", within=30
        )
        # The same answer says so once the run has actually stopped; then the report.
        await api.wait_until(lambda: answer.text == f"⏹ Run {run_id} stopped on worker w1.")
        report = await api.wait_for_message(
            lambda m: m.text.startswith(f"Auto run {run_id}: stopped"), timeout=30
        )
        assert "Stopped by a person" in report.text
        await api.wait_until(lambda: "⏹ stopped" in status.text)
        document = await api.wait_for_message(lambda m: m.filename == f"turns-{run_id}.md")
        rows = cluster.query(
            "SELECT state FROM turns WHERE run_id = %s AND phase = 'execute'", run_id
        )
        assert rows == [("interrupted",)]
        # The answer, the report and the document: no other message.
        assert api.sent[before:] == [answer, report, document], [
            _texts(m)[-1][:50] for m in api.sent[before:]
        ]


async def test_a_message_and_the_terminal_steer_an_auto_run_on_a_worker(
    cluster: Cluster,
) -> None:
    """Steering reaches a run on a worker as it reaches one here: a plain message in the
    chat and ``turnstile auto --append`` from a terminal go into its next Execute turn's
    prompt, once each, and are events of the run."""
    gate = cluster.tmp / "gate"
    write_script(
        cluster.tmp / "fake",
        replies=[
            {"text": "Goal: result.txt exists and is committed."},
            {"text": "1. write result.txt\n2. commit it"},
            {"text": "working on it", "wait_file": str(gate)},
            evaluation("IN PROGRESS"),
            {
                "text": "committed",
                "files": {"result.txt": "done\n"},
                "run": [["git", "add", "result.txt"], ["git", "commit", "-q", "-m", "result"]],
            },
            evaluation("COMPLETE"),
        ],
    )
    await asyncio.to_thread(_start, cluster)
    async with FakeBotApi() as api, _bot(cluster, api):
        run_id, status, _ = await _auto(api)
        assert "Messages here, or /steer TEXT, become instructions" in _texts(status)[0]
        await api.wait_until(lambda: "Execute running on worker w1" in status.text, timeout=60)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="Also add a CHANGELOG entry.")
        noted = await api.wait_for_message(lambda m: m.text.startswith("📝 Noted for run"))
        assert noted.text == f"📝 Noted for run {run_id}: it goes into the next Execute turn."
        appended = await asyncio.to_thread(
            cluster.cli, "auto", "--append", "Keep the README short.", "--session", run_id
        )
        assert appended.returncode == 0, appended.stderr
        assert appended.stdout.strip() == f"queued for the next Execute turn of {run_id}"
        gate.write_text("")
        await api.wait_for_message(
            lambda m: m.text.startswith(f"Auto run {run_id}: completed"), timeout=60
        )
    prompts = _execute_prompts(cluster, run_id)
    assert len(prompts) == 2
    assert "CHANGELOG" not in prompts[0]
    assert prompts[1].count("Also add a CHANGELOG entry.") == 1
    assert prompts[1].count("Keep the README short.") == 1
    assert prompts[1].index("CHANGELOG") < prompts[1].index("README")  # in the order sent
    events = [
        json.loads(line)
        for line in cluster.cli("runs", run_id, "--events", "--json").stdout.splitlines()
    ]
    steered = [(e["text"], e["by"]) for e in events if e["kind"] == "instruction"]
    assert steered == [
        ("Also add a CHANGELOG entry.", f"user{OPERATOR}"),
        ("Keep the README short.", None),
    ]
    # Once the run has ended it takes no more, and says why.
    late = await asyncio.to_thread(
        cluster.cli, "auto", "--append", "one more thing", "--session", run_id
    )
    assert late.returncode != 0
    assert "has ended" in late.stderr


async def test_a_bot_restart_mid_run_resumes_following_without_duplicates(
    cluster: Cluster,
) -> None:
    gate = cluster.tmp / "gate"
    _script(cluster, wait_file=gate)
    await asyncio.to_thread(_start, cluster)
    async with FakeBotApi() as api:
        async with _bot(cluster, api):
            run_id, status, _ = await _auto(api)
            await api.wait_until(
                lambda: (
                    "Execute running on worker w1" in status.text and "Last turn:" in status.text
                ),
                timeout=60,
            )
        # The bot is gone; the turn goes on on its worker and ends meanwhile.
        gate.write_text("")
        await asyncio.to_thread(
            wait_for,
            "the execute turn to end",
            lambda: cluster.query(
                "SELECT 1 FROM turns WHERE run_id = %s AND phase = 'execute' AND state <> %s",
                run_id,
                "started",
            ),
            within=30,
        )
        async with _bot(cluster, api):
            report = await api.wait_for_message(
                lambda m: m.text.startswith(f"Auto run {run_id}: completed"), timeout=60
            )
            await api.wait_for_message(lambda m: m.filename == f"turns-{run_id}.md")
            await api.wait_until(lambda: "✅ finished" in status.text)
            # The turns document holds every turn once, those before the restart too.
            document = next(m for m in api.sent if m.filename == f"turns-{run_id}.md")
            assert document.document is not None
            assert document.document.count(b"Clarify, exit 0]") == 1
            assert document.document.count(b"Evaluate, exit 0]") == 1
        async with _bot(cluster, api) as runtime:
            # A third start (its recovery done) finds the run ended and said: nothing more.
            assert await runtime.store.pending_outbox() == 0
        reports = [m for m in api.sent if m.text.startswith(f"Auto run {run_id}:")]
        assert reports == [report]
        statuses = [
            m for m in api.sent if m.filename is None and f"Auto run {run_id}" in _texts(m)[0]
        ]
        assert statuses == [status, report], [_texts(m) for m in statuses]
        assert len(api.sent) == 3, [_texts(m)[-1][:50] for m in api.sent]


async def test_a_bot_starting_while_a_turn_runs_on_a_worker_leaves_that_turn_alone(
    cluster: Cluster,
) -> None:
    """The bot's start-up recovery ends and kills the turns a crash of its own cut off; a
    turn recorded started by a worker (same database, same machine here) is not one: the
    restarted bot must neither mark it interrupted nor kill its agent, or the run (its turn
    "moved on" under its worker) never ends."""
    gate = cluster.tmp / "gate"
    _script(cluster, wait_file=gate)
    await asyncio.to_thread(_start, cluster)
    async with FakeBotApi() as api:
        async with _bot(cluster, api):
            run_id, status, _ = await _auto(api)
            await api.wait_until(lambda: "Execute running on worker w1" in status.text, timeout=60)
        # The Execute turn still runs on its worker (it waits for the gate) while the bot
        # starts again and recovers.
        async with _bot(cluster, api):
            rows = cluster.query(
                "SELECT state FROM turns WHERE run_id = %s AND phase = 'execute'", run_id
            )
            assert rows == [("started",)]
            gate.write_text("")
            report = await api.wait_for_message(
                lambda m: m.text.startswith(f"Auto run {run_id}: completed"), timeout=60
            )
            document = await api.wait_for_message(lambda m: m.filename == f"turns-{run_id}.md")
            await api.wait_until(lambda: "✅ finished" in status.text)
            assert document.document is not None
            assert document.document.count(b"Execute, exit 0]") == 1
        states = cluster.query("SELECT DISTINCT state FROM turns WHERE run_id = %s", run_id)
        assert states == [("finished",)]
        assert [m for m in api.sent if m.text.startswith(f"Auto run {run_id}:")] == [report]
        assert len(api.sent) == 3, [_texts(m)[-1][:50] for m in api.sent]


async def test_a_chat_with_no_project_is_told_the_same_on_the_workers_for_every_mode(
    cluster: Cluster,
) -> None:
    # A configured project, but none called "default": this chat's own workspace is on the
    # bot's disk, where no worker works. Chat, /auto and /autopilot say so alike.
    cluster.env["TURNSTILE_PROJECTS"] = f"demo={cluster.remote}#main"
    expected = (
        "on the workers a run needs a project of TURNSTILE_PROJECTS, and none is bound here "
        "(this chat's own workspace is on the bot's machine, where no worker works): "
        "/project NAME binds one"
    )
    async with FakeBotApi() as api, _bot(cluster, api):
        for command, answer in (
            ("/chat", "Cannot bind: "),
            ("/auto make result.txt", "Cannot start: "),
            ("/autopilot nodefault", "Cannot start: "),
        ):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text=command)
            refused = await api.wait_for_message(lambda m, a=answer: m.text.startswith(a))
            assert refused.text == answer + expected, command
    assert cluster.query("SELECT run_id FROM worker_runs") == []
    assert not (cluster.tmp / "bot" / "ws" / "chats").exists()


# -- files in and out of an auto run ---------------------------------------------------


def _files_script(cluster: Cluster, gate: Path) -> None:
    """Execute 1 waits for ``gate``, writes notes.md and hands it over; Execute 2 commits."""
    write_script(
        cluster.tmp / "fake",
        replies=[
            {"text": "Goal: notes.md is handed over, result.txt committed."},
            {"text": "1. write notes.md\n2. read what the chat sends"},
            {
                "text": "wrote the notes\nTURNSTILE-SEND: notes.md",
                "files": {"notes.md": "# notes\n"},
                "wait_file": str(gate),
            },
            evaluation("IN PROGRESS"),
            {
                "text": "committed",
                "files": {"result.txt": "done\n"},
                "run": [
                    ["git", "add", "result.txt", "notes.md"],
                    ["git", "commit", "-q", "-m", "result"],
                ],
            },
            evaluation("COMPLETE"),
        ],
    )


async def _files_run(
    api: FakeBotApi, run_id: str, gate: Path, *, before: int
) -> list[tuple[str | None, bytes | None, str]]:
    """Send a file while the run's first Execute turn runs, let the turn hand notes.md
    over, wait for the run's end: what the chat was sent from ``before`` on, the run's id
    said as RUN (its live message left out: its lines say where the run executes)."""
    api.push_document(
        chat_id=CHAT,
        user_id=OPERATOR,
        data=b"a,b\n1,2\n",
        file_name="data.csv",
        mime_type="text/csv",
        caption="use this data",
    )
    await api.wait_for_message(lambda m: m.text.startswith("📝 Noted for run"))
    gate.write_text("")
    notes = await api.wait_for_message(lambda m: m.filename == "notes.md", timeout=60)
    assert notes.document == b"# notes\n"
    await api.wait_for_message(
        lambda m: m.text.startswith(f"Auto run {run_id}: completed"), timeout=60
    )
    await api.wait_for_message(lambda m: m.filename == f"turns-{run_id}.md")
    return [
        (
            m.filename.replace(run_id, "RUN") if m.filename else None,
            m.document if m.filename == "notes.md" else None,
            _said(m, run_id),
        )
        for m in api.sent[before:]
        if m.filename is not None or not _texts(m)[0].startswith("🤖 Auto run")
    ]


def _said(message: SentMessage, run_id: str) -> str:
    """What a message says that does not depend on where the run executed: a report's and
    a document's first line, any other message whole."""
    text = message.text.replace(run_id, "RUN")
    if text.startswith("Auto run RUN:") or message.filename is not None:
        return text.splitlines()[0] if text else ""
    return text


async def test_a_file_reaches_an_auto_run_on_a_worker_and_one_it_hands_over_comes_back(
    cluster: Cluster,
) -> None:
    """A file sent while the run's first Execute turn runs on its worker is written into
    the run's worktree there and named in its next Execute prompt; a TURNSTILE-SEND line
    of that turn sends the worker's file to the chat."""
    gate = cluster.tmp / "files-gate"
    _files_script(cluster, gate)
    await asyncio.to_thread(_start, cluster)
    async with FakeBotApi() as api, _bot(cluster, api):
        run_id, _, _ = await _auto(api)
        await asyncio.to_thread(
            wait_for,
            "the first Execute turn",
            lambda: cluster.query(
                "SELECT 1 FROM turns WHERE run_id = %s AND phase = 'execute'", run_id
            ),
        )
        sent = await _files_run(api, run_id, gate, before=len(api.sent))
    noted = "📝 Noted for run RUN (a file): it goes into the next Execute turn."
    assert (None, None, noted) in sent
    assert ("notes.md", b"# notes\n", "📎 notes.md · 8 bytes") in sent
    prompts = _execute_prompts(cluster, run_id)
    assert len(prompts) == 2
    assert "data.csv" not in prompts[0]
    assert prompts[1].count("uploads/data.csv (text/csv") == 1
    assert "use this data" in prompts[1]
    # Written in the run's worktree on the worker, kept out of git.
    [(workdir,)] = cluster.query("SELECT workdir FROM runs WHERE id = %s", run_id)
    assert str(workdir).startswith(str(cluster.tmp / "w1"))
    assert (Path(workdir) / "uploads" / "data.csv").read_bytes() == b"a,b\n1,2\n"
    [(files,)] = cluster.query(
        "SELECT data_json FROM events WHERE run_id = %s AND kind = 'file_out'", run_id
    )
    assert [f["name"] for f in json.loads(files)["files"]] == ["notes.md"]


async def test_files_in_and_out_of_an_auto_run_say_the_same_here_and_on_a_worker(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parity: the same file sent and the same file handed over, a run on a worker and a
    run in the bot's process: the chat gets the same messages, in the same order."""
    gate = cluster.tmp / "files-gate"
    _files_script(cluster, gate)
    await asyncio.to_thread(_start, cluster)
    async with FakeBotApi() as api, _bot(cluster, api):
        run_id, _, _ = await _auto(api)
        await asyncio.to_thread(
            wait_for,
            "the first Execute turn",
            lambda: cluster.query(
                "SELECT 1 FROM turns WHERE run_id = %s AND phase = 'execute'", run_id
            ),
        )
        on_worker = await _files_run(api, run_id, gate, before=0)

    root = cluster.tmp / "local"
    git_workspace(root / "ws" / "default")
    gate = cluster.tmp / "local-gate"
    _files_script(cluster, gate)
    monkeypatch.setenv("FAKE_AGENT_SCRIPT", str(cluster.tmp / "fake" / "script.json"))
    monkeypatch.setenv("FAKE_AGENT_STATE", str(root / "agent-state"))
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, root)) as runtime:
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto make result.txt")
        started = await api.wait_for_message(lambda m: m.text.startswith("🤖 Auto run "))
        local_id = started.text.split()[3]
        async with asyncio.timeout(60):
            while not any(t.phase == "execute" for t in await runtime.runs.turns(local_id)):
                await asyncio.sleep(0.1)
        here = await _files_run(api, local_id, gate, before=0)
        workdir = Path((await runtime.runs.get_run(local_id)).workdir or "")
    assert (workdir / "uploads" / "data.csv").read_bytes() == b"a,b\n1,2\n"
    assert here == on_worker
    assert [said for _, _, said in here][:2] == [
        "📝 Noted for run RUN (a file): it goes into the next Execute turn.",
        "📎 notes.md · 8 bytes",
    ]
