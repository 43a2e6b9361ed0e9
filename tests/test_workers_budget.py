"""Budgets on the workers: the real pinned Claude Code CLI (it reports what each turn cost)
against the fake model API, a throwaway PostgreSQL, a real ``turnstile worker``, and the
control plane's executor (:class:`~engine.executors.workers.WorkersAuto`) in this test.

A run its budget stopped is offered to an admin; raising it puts the run back on its
worker, which resumes it at its next turn (same worktree, same agent session) under the new
budget, followed on from there: the turns shown before are not shown again. The chat's cap
for the day (``TURNSTILE_DAILY_BUDGET``, the control plane's) holds on the worker too and
counts the chat's other runs.

A turn costs about $0.0002 on the fake model's usage (12 tokens in, 7 out).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from engine.automode.state import AutoModeState
from engine.executors.base import AutoRequest
from engine.executors.local import LocalAuto
from engine.executors.workers import WorkersAuto
from engine.runs import ChatPlace, Recovery, RunSupervisor
from engine.sink import GateRequest, RunText, StatusUpdate, TextKind
from engine.spend import Budget
from engine.store.backend import open_database
from engine.store.runs import RunStatus, SqliteRunStore
from engine.workers.store import QueuedRun, WorkerStore
from tests.agent_clis import ensure_cli
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import ADMIN, OPERATOR, bot_settings, running_bot
from tests.fakes.bot_harness import CHAT as BOT_CHAT
from tests.fakes.model_api import FakeModelAPI, Text
from tests.fakes.realcli import MARKER_VAR, Sandbox
from tests.support import make_settings, wait_until
from tests.workers_support import HEARTBEAT, TIMEOUT, Cluster
from tests.workers_support import cluster as cluster  # the fixture

pytestmark = pytest.mark.timeout(240)
realcli = pytest.mark.realcli

T = TypeVar("T")
CHAT = -1001
PLACE = ChatPlace(str(CHAT), None)


@dataclass
class Chat:
    """The people following the runs, as the executor tells them (the bot's notices and
    sink, recorded): what was said, the live status, the offers to raise a budget."""

    texts: list[tuple[str, TextKind, str]] = field(default_factory=list)
    statuses: dict[str, StatusUpdate] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    offers: list[tuple[str, Budget, str]] = field(default_factory=list)

    # -- the sink --
    async def publish_text(self, run_id: str, text: str) -> None:
        self.texts.append((run_id, TextKind.NOTE, text))

    async def publish_run_text(self, said: RunText) -> None:
        self.texts.append((said.run_id, said.kind, said.text))

    async def update_status(self, update: StatusUpdate) -> None:
        self.statuses[update.run_id] = update

    async def request_gate(self, request: GateRequest) -> None:
        raise AssertionError("an auto run opens no gate")

    # -- the notices --
    def follow(
        self, key: str, place: ChatPlace, *, task: str | None = None, run_id: str | None = None
    ) -> None:
        assert place == PLACE

    def place_of_task(self, task: str) -> ChatPlace | None:
        return None

    async def notice(
        self, key: str, text: str, *, live: str | None = None, markdown: bool = False
    ) -> None:
        self.notes[live or f"{key}:{len(self.notes)}"] = text

    async def offer_more_budget(self, run_id: str, budget: Budget, spent: str) -> None:
        self.offers.append((run_id, budget, spent))

    async def shown(self, live: str) -> str | None:
        return self.notes.get(live)

    async def told_ended(self, run_id: str) -> bool:
        status = self.statuses.get(run_id)
        return status is not None and status.status != RunStatus.RUNNING.value

    async def gate_shown(self, task: str, phase: str) -> bool:
        return False

    def of(self, run_id: str, kind: TextKind) -> list[str]:
        return [text for rid, k, text in self.texts if rid == run_id and k is kind]


@pytest.fixture(scope="session")
def claude_bin() -> Path:
    return ensure_cli("claude")


@pytest.fixture
def claude_cluster(
    cluster: Cluster, model_api: FakeModelAPI, claude_bin: Path, tmp_path: Path
) -> Cluster:
    """The cluster with Claude Code pointed at the fake model API (its workers' agent)."""
    sandbox = Sandbox(tmp_path / "claude")
    cluster.env.update(
        {
            **model_api.claude_env(sandbox.config),
            MARKER_VAR: sandbox.marker,
            "TURNSTILE_CLAUDE_BIN": str(claude_bin),
        }
    )
    return cluster


async def blocking(call: Callable[..., T], *args: Any) -> T:
    return await asyncio.to_thread(call, *args)


@asynccontextmanager
async def control_plane(
    cluster: Cluster, **overrides: Any
) -> AsyncIterator[tuple[WorkersAuto, Chat]]:
    """The bot's auto executor on the workers, its chat recorded."""
    settings = make_settings(
        cluster.tmp / "control",
        database=cluster.url,
        execution="workers",
        projects=cluster.env["TURNSTILE_PROJECTS"],
        default_agent="claude",
        worker_heartbeat=float(HEARTBEAT),
        worker_timeout=float(TIMEOUT),
        **overrides,
    )
    chat = Chat()

    async def no_workdir(project: str, run_id: str, place: object) -> Path:
        raise AssertionError("a run on the workers has no folder here")

    async with open_database(settings) as db:
        runs = SqliteRunStore(db)
        local = LocalAuto(
            settings,
            db,
            runs=runs,
            supervisor=RunSupervisor(runs),
            sink=chat,
            notices=chat,
            workdirs=no_workdir,
            approvals=lambda agent, user: None,
        )
        auto = WorkersAuto(settings, db, local=local, sink=chat, notices=chat)
        try:
            yield auto, chat
        finally:
            await auto.shutdown(park=False)


def turns_of(cluster: Cluster, run_id: str) -> list[tuple[int, int, str]]:
    """(seq, attempt, state) of every recorded turn of the run, in order."""
    rows = cluster.query(
        "SELECT seq, attempt, state FROM turns WHERE run_id = %s ORDER BY seq, attempt", run_id
    )
    return [(seq, attempt, state) for seq, attempt, state in rows]


def state_of(cluster: Cluster, run_id: str) -> dict[str, Any]:
    [(state,)] = cluster.query("SELECT state_json FROM runs WHERE id = %s", run_id)
    return dict(json.loads(state))


def placement_of(cluster: Cluster, run_id: str) -> tuple[str, str | None, int]:
    """How the run stands on the workers, the worker of its last turn, its moves."""
    found = cluster.placement(run_id)
    assert found is not None
    return found.status.value, found.last_worker, found.moves


@realcli
async def test_a_raised_budget_resumes_the_run_on_its_worker_at_its_next_turn(
    claude_cluster: Cluster, model_api: FakeModelAPI
) -> None:
    cluster = claude_cluster
    model_api.enqueue(Text("Goal: count."), Text("1. count"), Text("one"), Text("two"))
    await blocking(cluster.start_worker, "w1")
    async with control_plane(cluster) as (auto, chat):
        started = await auto.start(AutoRequest("count", "demo", PLACE, budget=Budget(usd=0.0003)))
        run_id = started.run_id
        assert started.queued
        await wait_until(lambda: chat.offers, timeout=120, what="the offer to raise the budget")

        # Stopped after the turn that spent its budget (the second), and said so.
        assert cluster.status(run_id) == "stopped"
        assert [(s, a) for s, a, _ in turns_of(cluster, run_id)] == [(1, 1), (2, 1)]
        message = state_of(cluster, run_id)["message"]
        assert message.startswith("Stopped by its budget: $0.000"), message
        assert message.endswith("of $0.0003 spent")
        [report] = chat.of(run_id, TextKind.FINAL)
        assert message in report
        [(offered, budget, spent)] = chat.offers
        assert (offered, budget) == (run_id, Budget(usd=0.0003))
        assert spent.startswith("$0.000")
        assert chat.statuses[run_id].status == "stopped"
        assert placement_of(cluster, run_id)[:2] == ("finished", "w1")

        # Another chat cannot raise it; a budget no larger than the last is refused.
        with pytest.raises(Exception, match="not this chat's"):
            await auto.raise_budget(run_id, budget.raised(), chat_id=str(CHAT - 1))
        with pytest.raises(Exception, match=r"budget of \$0\.0003: it goes on only under"):
            await auto.raise_budget(run_id, budget, chat_id=str(CHAT))

        said = await auto.raise_budget(run_id, budget.raised(), chat_id=str(CHAT))
        assert said == (
            f"▶️ Auto run {run_id} goes on under a budget of $0.0006, at round 3, phase "
            "execute, on worker w1."
        )
        # At once: the live status is the running run's again.
        assert chat.statuses[run_id].status == "running"
        # Once at a time: a second raise while it goes on is refused.
        with pytest.raises(Exception, match="was not stopped by its budget"):
            await auto.raise_budget(run_id, budget.raised().raised(), chat_id=str(CHAT))

        await wait_until(lambda: len(chat.offers) == 2, timeout=120, what="the run to stop again")

    # It went on at its next turn, on the same worker (nothing moved), and stopped again
    # after the turn that spent the new budget.
    turns = turns_of(cluster, run_id)
    assert [s for s, _, _ in turns] == list(range(1, len(turns) + 1)), turns
    assert {(a, state) for _, a, state in turns} == {(1, "finished")}
    assert len(turns) >= 3
    assert placement_of(cluster, run_id) == ("finished", "w1", 0)
    assert cluster.status(run_id) == "stopped"
    state = state_of(cluster, run_id)
    assert "status" not in state  # the run's one status is its column's
    assert state["config"]["budget_usd"] == 0.0006
    assert state["config"]["stopped_by"] == "budget"
    assert state["message"].startswith("Stopped by its budget: $0.000"), state["message"]
    assert state["message"].endswith("of $0.0006 spent")
    # The same agent session: the resumed turn's request carries the first turns' answers.
    conversation = model_api.model_requests[-1].conversation()
    assert ("assistant", "Goal: count.") in conversation
    assert ("assistant", "1. count") in conversation
    # Followed on from there: each turn shown once, a report per stop, a second offer.
    assert len(chat.of(run_id, TextKind.TURN)) == len(turns)
    first, second = chat.of(run_id, TextKind.FINAL)
    assert "of $0.0003 spent" in first
    assert "of $0.0006 spent" in second
    assert chat.offers[1][:2] == (run_id, Budget(usd=0.0006))
    assert chat.statuses[run_id].status == "stopped"


@realcli
async def test_the_chats_daily_budget_holds_on_the_workers(
    claude_cluster: Cluster, model_api: FakeModelAPI
) -> None:
    """The cap is the control plane's setting (the worker has none): it travels with the
    run, and the chat's spend today counts the turns of its runs on the workers."""
    cluster = claude_cluster
    model_api.enqueue(Text("Goal: count."), Text("1. count"), Text("Goal: again."))
    await blocking(cluster.start_worker, "w1")
    async with control_plane(cluster, daily_budget=0.0003) as (auto, chat):
        first = (await auto.start(AutoRequest("count", "demo", PLACE))).run_id
        await wait_until(
            lambda: chat.of(first, TextKind.FINAL), timeout=120, what="the first run to stop"
        )
        assert [s for s, _, _ in turns_of(cluster, first)] == [1, 2]
        message = state_of(cluster, first)["message"]
        assert message.startswith("Stopped by this chat's budget for today: $0.000"), message
        assert message.endswith("of $0.0003 spent")
        assert cluster.query("SELECT chat_id FROM runs WHERE id = %s", first) == [(str(CHAT),)]
        # The chat's second run today stops after its first turn: the day's is spent.
        second = (await auto.start(AutoRequest("again", "demo", PLACE))).run_id
        await wait_until(
            lambda: chat.of(second, TextKind.FINAL), timeout=120, what="the second run to stop"
        )
        assert [s for s, _, _ in turns_of(cluster, second)] == [1]
        assert state_of(cluster, second)["message"].startswith(
            "Stopped by this chat's budget for today"
        )
        # No budget of its own to raise: nothing is offered.
        assert chat.offers == []


async def test_a_front_end_restart_leaves_a_run_on_the_workers_to_them(
    database: Any, tmp_path: Path
) -> None:
    """A run on the workers records its chat (for the chat's spend today); the start-up
    recovery reports it with the chat's auto runs, and the bot must not resume it here."""
    runs, workers = SqliteRunStore(database), WorkerStore(database)
    spec = QueuedRun(
        run_id="auto-r1", objective="o", tool="claude", project="demo", chat_id=str(CHAT)
    )
    await workers.place(spec)
    await workers.take("auto-r1", "w1")
    state = AutoModeState("auto-r1", "s", "o", "/w", "/w/logs", max_turns=5, tool="claude")
    # Its first step fills in the row placing wrote (with its chat).
    await runs.start_placed("auto-r1", session_id="s", workdir="/w", state=state.to_json())
    record = await runs.get_run("auto-r1")
    settings = make_settings(tmp_path, execution="workers")
    chat = Chat()

    async def no_workdir(project: str, run_id: str, place: object) -> Path:
        raise AssertionError("no folder here")

    local = LocalAuto(
        settings,
        database,
        runs=runs,
        supervisor=RunSupervisor(runs),
        sink=chat,
        notices=chat,
        workdirs=no_workdir,
        approvals=lambda agent, user: None,
    )
    auto = WorkersAuto(settings, database, local=local, sink=chat, notices=chat)
    try:
        await auto.recover(Recovery(auto=(record,)))
        assert chat.notes == {}  # neither "resumed" nor "could not be resumed"
        assert local.active == {}
        assert "auto-r1" in auto.followed
    finally:
        await auto.shutdown(park=False)
    assert (await runs.get_run("auto-r1")).status is RunStatus.RUNNING


@realcli
@pytest.mark.usefixtures("isolated_env")
async def test_an_admin_presses_raise_in_the_chat_and_the_run_goes_on_on_its_worker(
    claude_cluster: Cluster, model_api: FakeModelAPI, claude_bin: Path
) -> None:
    """The whole way through the real bot (fake Bot API): the offer under the report, an
    operator's press refused, an admin's resuming the run on its worker."""
    cluster = claude_cluster
    model_api.enqueue(Text("Goal: count."), Text("1. count"), Text("one"), Text("two"))
    # The chat's project is "default": the bot and the worker know it by that name.
    cluster.env["TURNSTILE_PROJECTS"] = f"default={cluster.remote}#main"
    await blocking(cluster.start_worker, "w1")
    root = cluster.tmp / "bot"
    root.mkdir()
    async with FakeBotApi() as api:
        settings = bot_settings(
            api,
            root,
            database=cluster.url,
            execution="workers",
            projects=cluster.env["TURNSTILE_PROJECTS"],
            worker_heartbeat=float(HEARTBEAT),
            worker_timeout=float(TIMEOUT),
            default_agent="claude",
            claude_bin=str(claude_bin),
        )
        async with running_bot(api, settings) as rt:
            api.push_message(chat_id=BOT_CHAT, user_id=OPERATOR, text="/auto --budget 0.0003 n")
            status = await api.wait_for_message(
                lambda m: "is queued on the workers" in [*m.history, m.text][0]
            )
            found = re.search(r"Auto run (\S+) is queued", [*status.history, status.text][0])
            assert found is not None
            run_id = found.group(1)
            offer = await api.wait_for_message(
                lambda m: m.text.startswith(f"💰 Auto run {run_id} stopped at its budget"),
                timeout=120,
            )
            assert "of $0.0003" in offer.text
            [button] = offer.buttons
            assert button["text"] == "⬆️ Raise to $0.0006 and go on"
            report = next(m for m in api.sent if m.text.startswith(f"Auto run {run_id}: stopped"))
            assert "of $0.0003 spent" in report.text
            # Only an admin raises it.
            answered = len(api.callback_answers)
            api.push_callback(
                chat_id=BOT_CHAT,
                user_id=OPERATOR,
                data=button["callback_data"],
                message_id=offer.message_id,
            )
            await api.wait_until(lambda: len(api.callback_answers) > answered)
            assert (await rt.runs.get_run(run_id)).status is RunStatus.STOPPED
            api.push_callback(
                chat_id=BOT_CHAT,
                user_id=ADMIN,
                data=button["callback_data"],
                message_id=offer.message_id,
            )
            await api.wait_for_message(
                lambda m: (
                    m.text.startswith(f"▶️ Auto run {run_id} goes on under a budget of $0.0006")
                    and "on worker w1" in m.text
                    and "(raised by" in m.text
                )
            )
            again = await api.wait_for_message(
                lambda m: (
                    m.text.startswith(f"Auto run {run_id}: stopped") and "$0.0006 spent" in m.text
                ),
                timeout=120,
            )
            await api.wait_for_message(
                lambda m: m.text.startswith(
                    f"💰 Auto run {run_id} stopped at its budget of $0.0006"
                )
            )
            record = await rt.runs.get_run(run_id)
    assert record.state["config"]["budget_usd"] == 0.0006
    assert record.chat_id == str(BOT_CHAT)
    assert [s for s, _, _ in turns_of(cluster, run_id)] == [1, 2, 3]
    assert again.message_id != report.message_id


@realcli
async def test_turnstile_auto_resume_with_a_larger_budget_goes_on_on_the_worker(
    claude_cluster: Cluster, model_api: FakeModelAPI
) -> None:
    """From a terminal: ``turnstile auto --resume RUN --budget MORE`` puts the run its
    budget stopped back on its worker, which resumes it at its next turn; the terminal
    follows it from there (the turns shown before are not shown again)."""
    cluster = claude_cluster
    model_api.enqueue(Text("Goal: count."), Text("1. count"), Text("one"), Text("two"))
    await blocking(cluster.start_worker, "w1")
    started = await blocking(
        cluster.cli,
        "auto",
        "--detach",
        "--checkout-repo",
        "demo",
        "--tool",
        "claude",
        "--budget",
        "0.0003",
        "-p",
        "count",
    )
    assert started.returncode == 0, started.stderr
    run_id = started.stdout.strip()
    await wait_until(
        lambda: placement_of(cluster, run_id)[0] == "finished", timeout=120, what="the stop"
    )
    assert state_of(cluster, run_id)["config"]["stopped_by"] == "budget"
    assert [s for s, _, _ in turns_of(cluster, run_id)] == [1, 2]

    # Without a budget, or with one no larger, it stays stopped.
    bare = await blocking(cluster.cli, "auto", "--resume", run_id)
    assert bare.returncode == 2, bare.stdout + bare.stderr
    assert "give --budget USD or --budget-tokens N" in bare.stderr
    same = await blocking(cluster.cli, "auto", "--resume", run_id, "--budget", "0.0003")
    assert same.returncode == 2, same.stdout + same.stderr
    assert "it goes on only under a larger one" in same.stderr
    assert placement_of(cluster, run_id)[0] == "finished"

    resumed = await blocking(cluster.cli, "auto", "--resume", run_id, "--budget", "0.0006")
    out = resumed.stdout
    assert f"Auto run {run_id} goes on under a budget of $0.0006, at round 3" in out, (
        out + resumed.stderr
    )
    assert "on worker w1" in out
    assert "Traceback" not in resumed.stderr
    # Followed from its next turn to its stop at the new budget: turns 1 and 2 not again.
    assert "turn 1 " not in out
    assert "turn 2 " not in out
    assert "turn 3 " in out
    assert "of $0.0006 spent" in out
    turns = turns_of(cluster, run_id)
    assert [s for s, _, _ in turns] == list(range(1, len(turns) + 1))
    assert {(a, state) for _, a, state in turns} == {(1, "finished")}
    assert placement_of(cluster, run_id) == ("finished", "w1", 0)
    state = state_of(cluster, run_id)
    assert state["config"]["budget_usd"] == 0.0006
    assert state["config"]["stopped_by"] == "budget"
