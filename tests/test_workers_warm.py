"""Warm sessions on a worker: the real pinned Claude Code CLI, against the fake model API,
kept resident by a ``turnstile worker`` between the turns of an auto run.

The fake model API serves from this test's event loop, so the harness's blocking calls
(starting workers, ``turnstile`` commands) run in threads.

To hold a run between two turns, the test locks the run's placement row: a worker takes
the row (``SELECT … FOR UPDATE``) before each turn, so the next turn waits there while the
previous one has ended and its process stays resident.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest

from engine.agents.stream import TURN_MARKER_VAR
from engine.workers.store import QueuedRun, WorkerStatus, WorkerStore
from engine.workers.views import worker_views
from tests.agent_clis import ensure_cli
from tests.fakes.model_api import FakeModelAPI, Hold, Text
from tests.fakes.realcli import MARKER_VAR, Sandbox, alive
from tests.support import make_settings, wait_until
from tests.workers_support import Cluster, WorkerProc
from tests.workers_support import cluster as cluster  # the fixture

pytestmark = pytest.mark.timeout(240)
realcli = pytest.mark.realcli

T = TypeVar("T")
STARTED = "warm Claude Code process started"


@pytest.fixture(scope="session")
def claude_bin() -> Path:
    return ensure_cli("claude")


@pytest.fixture
def warm_cluster(
    cluster: Cluster, model_api: FakeModelAPI, claude_bin: Path, tmp_path: Path
) -> tuple[Cluster, Sandbox]:
    """The cluster with Claude Code pointed at the fake model API, warm sessions on."""
    sandbox = Sandbox(tmp_path / "claude")
    cluster.env.update(
        {
            **model_api.claude_env(sandbox.config),
            MARKER_VAR: sandbox.marker,
            "TURNSTILE_CLAUDE_BIN": str(claude_bin),
            "TURNSTILE_WARM_SESSIONS": "claude",
        }
    )
    return cluster, sandbox


async def blocking(call: Callable[..., T], *args: Any) -> T:
    return await asyncio.to_thread(call, *args)


async def start_auto(cluster: Cluster, *, turns: int) -> str:
    done = await blocking(
        lambda: cluster.cli(
            "auto",
            "--detach",
            "--checkout-repo",
            "demo",
            "--tool",
            "claude",
            "--max-turns",
            str(turns),
            "-p",
            "say what you are told",
        )
    )
    assert done.returncode == 0, done.stderr
    return str(done.stdout.strip())


def finished_turns(cluster: Cluster, run_id: str) -> list[tuple[int, int | None]]:
    """(seq, recorded process) of the run's finished turns, in order."""
    rows = cluster.query(
        "SELECT seq, proc_pgid FROM turns WHERE run_id = %s AND state = 'finished' ORDER BY seq",
        run_id,
    )
    return [(seq, pgid) for seq, pgid in rows]


def turn_process(cluster: Cluster, run_id: str, seq: int) -> int | None:
    rows = cluster.query(
        "SELECT proc_pgid FROM turns WHERE run_id = %s AND seq = %s ORDER BY attempt DESC",
        run_id,
        seq,
    )
    return rows[0][0] if rows and rows[0][0] else None


def placement_status(cluster: Cluster, run_id: str) -> str | None:
    found = cluster.placement(run_id)
    return found.status.value if found is not None else None


def warm_marks(cluster: Cluster) -> dict[str, str]:
    return dict(cluster.query("SELECT run_id, worker FROM warm_runs"))


def agent_processes(sandbox: Sandbox) -> list[int]:
    """Live processes started as a resident agent (or under one) with the test's marker."""
    found = []
    mine = f"{MARKER_VAR}={sandbox.marker}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\x00")
        except OSError:
            continue
        turn = any(e.startswith(f"{TURN_MARKER_VAR}=".encode()) for e in environ)
        if mine in environ and turn and alive(int(entry)):
            found.append(int(entry))
    return found


@contextmanager
def held_between_turns(cluster: Cluster, run_id: str) -> Iterator[None]:
    """Hold the run's placement row: its next turn waits until the block is left."""
    with psycopg.connect(cluster.url) as conn:
        conn.execute("SELECT 1 FROM worker_runs WHERE run_id = %s FOR UPDATE", (run_id,))
        yield
        conn.rollback()


async def runs_json(cluster: Cluster, run_id: str) -> dict[str, Any]:
    return (await blocking(cluster.runs))[run_id]


def said(api: FakeModelAPI, text: str) -> bool:
    """Whether the last model request carries ``text`` as an earlier assistant message."""
    return ("assistant", text) in api.model_requests[-1].conversation()


def starts(worker: WorkerProc) -> int:
    return worker.output.count(STARTED)


@realcli
async def test_three_turns_of_an_auto_run_on_a_worker_share_one_process(
    warm_cluster: tuple[Cluster, Sandbox], model_api: FakeModelAPI
) -> None:
    cluster, sandbox = warm_cluster
    second = Hold(text="1. Say the word.")
    model_api.enqueue(Text("Goal: say the word PELICAN-17."), second, Text("PELICAN-17"))
    worker = await blocking(cluster.start_worker, "w1")
    run_id = await start_auto(cluster, turns=3)

    await asyncio.wait_for(second.arrived.wait(), 120)
    # Turn 2 runs on the process turn 1 started, and the control plane sees it warm.
    assert turn_process(cluster, run_id, 2) == turn_process(cluster, run_id, 1)
    row = await runs_json(cluster, run_id)
    assert row["worker"] == "w1"
    assert row["warm"] is True
    assert warm_marks(cluster) == {run_id: "w1"}
    second.release.set()

    await wait_until(
        lambda: cluster.status(run_id) not in (None, "running"), timeout=120, what="run ends"
    )
    turns = finished_turns(cluster, run_id)
    assert len(turns) >= 3
    assert len({pgid for _, pgid in turns}) == 1
    assert starts(worker) == 1, worker.output
    # Context carried: the last model request holds the first turn's answer as the
    # agent's own earlier message (the session's history, not a prompt quoting it).
    assert said(model_api, "Goal: say the word PELICAN-17.")
    # The process went with the run, and so did its warm mark.
    [(_, pgid)] = turns[:1]
    assert pgid is not None
    await wait_until(lambda: not alive(pgid), timeout=30, what="resident process gone")
    await wait_until(
        lambda: agent_processes(sandbox) == [], timeout=30, what="no agent process left"
    )
    await wait_until(lambda: warm_marks(cluster) == {}, timeout=30, what="marked cold")
    assert (await runs_json(cluster, run_id))["warm"] is False


@realcli
async def test_a_budget_stops_a_run_on_a_worker_after_the_turn_that_spends_it(
    warm_cluster: tuple[Cluster, Sandbox], model_api: FakeModelAPI
) -> None:
    cluster, _ = warm_cluster
    model_api.enqueue(Text("Goal: count."), Text("1. count"), Text("one"), Text("two"))
    await blocking(cluster.start_worker, "w1")
    done = await blocking(
        lambda: cluster.cli(
            "auto",
            "--detach",
            "--checkout-repo",
            "demo",
            "--tool",
            "claude",
            "--max-turns",
            "6",
            # A turn costs about $0.0002 on the fake model's usage: the second spends it.
            "--budget",
            "0.0003",
            "-p",
            "count",
        )
    )
    assert done.returncode == 0, done.stderr
    run_id = done.stdout.strip()
    await wait_until(
        lambda: cluster.status(run_id) not in (None, "running"), timeout=120, what="run ends"
    )
    assert cluster.status(run_id) == "stopped"
    assert [seq for seq, _ in finished_turns(cluster, run_id)] == [1, 2]
    [(state,)] = cluster.query("SELECT state_json FROM runs WHERE id = %s", run_id)
    message = json.loads(state)["message"]
    assert message.startswith("Stopped by its budget: $0.000"), message
    assert message.endswith("of $0.0003 spent")
    row = await runs_json(cluster, run_id)
    assert row["cost_usd"] is not None
    assert row["cost_usd"] >= 0.0003


def saved_answer(root: Path, text: str) -> bool:
    """Whether a Claude Code transcript under ``root`` holds an answer saying ``text``."""
    for transcript in root.rglob("*.jsonl"):
        with contextlib.suppress(OSError):
            for line in transcript.read_text().splitlines():
                if '"type":"assistant"' in line and text in line:
                    return True
    return False


@realcli
async def test_a_killed_resident_process_is_resumed_and_a_stopping_worker_closes_it(
    warm_cluster: tuple[Cluster, Sandbox], model_api: FakeModelAPI
) -> None:
    cluster, sandbox = warm_cluster
    first = Hold(text="Goal: say the word HERON-23.")
    second = Hold(text="1. Say the word.")
    model_api.enqueue(first, second)
    worker = await blocking(cluster.start_worker, "w1")
    run_id = await start_auto(cluster, turns=4)

    await asyncio.wait_for(first.arrived.wait(), 120)
    with held_between_turns(cluster, run_id):
        first.release.set()
        await wait_until(
            lambda: finished_turns(cluster, run_id), timeout=60, what="turn 1 finished"
        )
        pid = turn_process(cluster, run_id, 1)
        assert pid is not None
        assert alive(pid)
        await wait_until(lambda: warm_marks(cluster) == {run_id: "w1"}, what="marked warm")
        # Between turns: once the CLI has saved turn 1 (its answer is out a moment before).
        await wait_until(
            lambda: saved_answer(cluster.tmp, "HERON-23"), timeout=30, what="turn 1 saved"
        )
        # Killed between turns: the worker's heartbeat records the run cold.
        os.kill(pid, signal.SIGKILL)
        await wait_until(lambda: not alive(pid), timeout=30, what="resident process killed")
        await wait_until(lambda: warm_marks(cluster) == {}, timeout=30, what="marked cold")
        assert (await runs_json(cluster, run_id))["warm"] is False

    # Turn 2 starts a new process that resumes the session: the model sees turn 1.
    await asyncio.wait_for(second.arrived.wait(), 120)
    new_pid = turn_process(cluster, run_id, 2)
    assert new_pid is not None
    assert new_pid != pid
    assert alive(new_pid)
    assert starts(worker) == 2, worker.output
    assert said(model_api, "Goal: say the word HERON-23.")

    # The worker is told to stop during turn 2: the turn finishes, the process is closed.
    worker.proc.send_signal(signal.SIGTERM)
    second.release.set()
    await blocking(worker.proc.wait, 60)
    assert [seq for seq, _ in finished_turns(cluster, run_id)] == [1, 2]
    assert not alive(new_pid)
    assert agent_processes(sandbox) == []
    assert warm_marks(cluster) == {}
    row = await runs_json(cluster, run_id)
    assert row["status"] == "waiting for a worker"  # it moves on to another worker
    assert row["warm"] is False


@realcli
async def test_a_killed_worker_leaves_no_resident_process(
    warm_cluster: tuple[Cluster, Sandbox], model_api: FakeModelAPI
) -> None:
    cluster, sandbox = warm_cluster
    first = Hold(text="Goal: nothing.")
    model_api.enqueue(first)
    worker = await blocking(cluster.start_worker, "w1")
    run_id = await start_auto(cluster, turns=3)
    await asyncio.wait_for(first.arrived.wait(), 120)
    with held_between_turns(cluster, run_id):
        first.release.set()
        await wait_until(
            lambda: finished_turns(cluster, run_id), timeout=60, what="turn 1 finished"
        )
        pid = turn_process(cluster, run_id, 1)
        assert pid is not None
        assert alive(pid)
        await wait_until(lambda: warm_marks(cluster) == {run_id: "w1"}, what="marked warm")
        worker.proc.kill()
        await blocking(worker.proc.wait, 30)
        # The turn watchdog outlives the worker and kills what it started.
        await wait_until(lambda: not alive(pid), timeout=30, what="resident process gone")
        # What held it (its keeper, the sandbox) goes with it, a moment later.
        await wait_until(
            lambda: agent_processes(sandbox) == [], timeout=30, what="no agent process left"
        )
        # Its word no longer counts once the worker is not heard from.
        await wait_until(lambda: not cluster.runs()[run_id]["warm"], timeout=30, what="shown cold")


async def test_a_warm_mark_counts_only_from_the_live_worker_that_holds_the_run(
    database: Any, tmp_path: Path
) -> None:
    settings = make_settings(tmp_path, worker_timeout=60.0)
    store = WorkerStore(database)
    for name in ("w1", "w2"):
        await store.register(name, host="h", pid=1, capacity=1, queues=())
    for run_id in ("a", "b"):
        await store.place(QueuedRun(run_id=run_id, objective="o", tool="claude", project="p"))
        await store.take(run_id, "w1")

    async def warm() -> dict[str, bool]:
        return {r: v.warm for r, v in (await worker_views(settings, database)).items()}

    assert await warm() == {"a": False, "b": False}
    await store.mark_warm("w1", ["a", "b"])
    assert await warm() == {"a": True, "b": True}
    # The set is replaced: b's process stopped.
    await store.mark_warm("w1", ["a"])
    assert await warm() == {"a": True, "b": False}
    assert await store.warm_runs() == {"a": "w1"}
    # Another worker's word about a run w1 holds does not count.
    await store.mark_warm("w2", ["b"])
    assert await warm() == {"a": True, "b": False}
    # An ended run, or a worker no longer alive, is not warm whatever was recorded.
    await store.let_go("a")
    assert await warm() == {"a": False, "b": False}
    a = QueuedRun(run_id="a", objective="o", tool="claude", project="p")
    assert await store.resubmit(a, holder="w1")
    await store.take("a", "w1")
    await store.set_worker_status("w1", WorkerStatus.LOST)
    assert await warm() == {"a": False, "b": False}
    await store.mark_warm("w1", [])
    assert await store.warm_runs() == {"b": "w2"}


@realcli
@pytest.mark.usefixtures("isolated_env")
async def test_status_in_the_chat_shows_a_run_on_a_worker_warm(
    warm_cluster: tuple[Cluster, Sandbox], model_api: FakeModelAPI
) -> None:
    from tests.fakes.bot_api import FakeBotApi
    from tests.fakes.bot_harness import CHAT, OPERATOR, bot_settings, running_bot
    from tests.workers_support import HEARTBEAT, TIMEOUT

    cluster, _ = warm_cluster
    projects = f"default={cluster.remote}#main"
    cluster.env["TURNSTILE_PROJECTS"] = projects
    cluster.env["TURNSTILE_MAX_TURNS"] = "2"  # the worker's: a run from the chat has no cap
    second = Hold(text="1. Say the word.")
    model_api.enqueue(Text("Goal: say the word."), second)
    await blocking(cluster.start_worker, "w1")
    bot_root = cluster.tmp / "bot"
    bot_root.mkdir()
    async with FakeBotApi() as api:
        settings = bot_settings(
            api,
            bot_root,
            database=cluster.url,
            execution="workers",
            projects=projects,
            default_agent="claude",
            worker_heartbeat=float(HEARTBEAT),
            worker_timeout=float(TIMEOUT),
        )
        async with running_bot(api, settings):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto say the word")
            queued = await api.wait_for_message(lambda m: "is queued on the workers" in m.text)
            run_id = queued.text.split("Auto run ", 1)[1].split()[0]
            # Turn 2 runs on the process turn 1 left resident on the worker.
            await asyncio.wait_for(second.arrived.wait(), 120)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
            line = f"🤖 auto {run_id} · running on worker w1 · "
            status = await api.wait_for_message(lambda m: line in m.text)
            [shown] = [t for t in status.text.splitlines() if line in t]
            assert shown.endswith(" · warm"), shown
            second.release.set()
            # The run has ended on the worker (its process closed) once its placement has.
            await wait_until(
                lambda: placement_status(cluster, run_id) in ("finished", "stopped"),
                timeout=120,
                what="run ends",
            )
            assert warm_marks(cluster) == {}
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
            await api.wait_for_message(lambda m: m.text.startswith("No runs in this chat. /help"))
