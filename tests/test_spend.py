"""What turns cost: read from each agent CLI's own report, kept with the turn, summed per
run, task and chat, and shown by ``turnstile runs``.

The three reports are the ones the pinned CLIs printed for one turn against the fake model
API (tests/test_agents_contract.py runs them); the store runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from engine.runs import ChatPlace, RunMode, RunSupervisor
from engine.spend import Budget, Spend
from engine.store.backend import AnyDatabase
from engine.store.events import EventLog
from engine.store.runs import SqliteRunStore, TurnState
from engine.turn import TurnOutput
from tests.support import clean_env

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parent.parent

#: ``usage`` and ``total_cost_usd`` as each CLI reported one turn (their adapters' metadata).
CLAUDE: dict[str, Any] = {
    "usage": {
        "input_tokens": 12,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 7,
        "server_tool_use": {"web_search_requests": 0, "web_fetch_requests": 0},
        "service_tier": "standard",
    },
    "cost_usd": 0.000235,
}
CODEX: dict[str, Any] = {
    "usage": {
        "input_tokens": 1200,
        "cached_input_tokens": 1000,
        "cache_write_input_tokens": 0,
        "output_tokens": 7,
        "reasoning_output_tokens": 0,
    },
    "cost_usd": None,
}
COPILOT: dict[str, Any] = {
    "usage": {
        "premiumRequests": 0,
        "totalApiDurationMs": 29,
        "sessionDurationMs": 228,
        "codeChanges": {"linesAdded": 0, "linesRemoved": 0, "filesModified": []},
    },
    "cost_usd": None,
}


def test_each_cli_report_is_read_its_own_way() -> None:
    claude = Spend.of_turn(CLAUDE)
    assert (claude.cost_usd, claude.input, claude.output) == (0.000235, 12, 7)
    assert (claude.cache_read, claude.cache_write, claude.unknown) == (0, 0, 0)
    # Codex counts cached input inside input_tokens: said apart, as Claude Code does.
    codex = Spend.of_turn(CODEX)
    assert (codex.cost_usd, codex.input, codex.cache_read, codex.output) == (None, 200, 1000, 7)
    assert codex.to_json() == {
        "cost_usd": None,
        "tokens": {"input": 200, "output": 7, "cache_read": 1000, "cache_write": 0},
    }
    # Copilot reports no tokens and no cost: unknown, never zero.
    copilot = Spend.of_turn(COPILOT)
    assert not copilot.known
    assert (copilot.turns, copilot.unknown) == (1, 1)
    assert copilot.to_json() == {"cost_usd": None, "tokens": None}
    assert copilot.line() == "Spend: unknown (the agent reports neither cost nor tokens)"
    # Nonsense is not a number.
    odd = Spend.of_turn({"usage": {"output_tokens": True, "input_tokens": "9"}, "cost_usd": -1})
    assert not odd.known


def test_sums_keep_what_is_unknown_apart() -> None:
    total = Spend.of_turn(CLAUDE) + Spend.of_turn(CLAUDE) + Spend.of_turn(COPILOT)
    assert total.cost_usd == pytest.approx(0.00047)
    assert (total.input, total.output, total.turns, total.unknown) == (24, 14, 3, 1)
    assert total.cost_text() == "≥ $0.0005"
    assert total.line() == (
        "Spend: ≥ $0.0005 · 38 tokens (24 in, 14 out) · 1 of 3 turns reported nothing"
    )
    tokens_only = Spend.of_turn(CODEX) + Spend.of_turn(CODEX)
    assert tokens_only.cost_text() == "unknown"
    assert tokens_only.line() == (
        "Spend: cost unknown · 2,414 tokens (400 in, 14 out, 2,000 from cache)"
    )


async def _run(db: AnyDatabase, *reports: dict[str, Any], chat: str | None = None) -> str:
    runs = SqliteRunStore(db)
    run_id = await RunSupervisor(runs).open_run(
        RunMode.AUTO,
        agent="claude",
        session_id="s",
        objective="spend",
        chat=ChatPlace(chat, None) if chat is not None else None,
    )
    for seq, report in enumerate(reports, 1):
        turn = await runs.start_turn(run_id, seq, "p", "execute")
        await runs.finish_turn(turn, TurnOutput(text="ok", exit_code=0, metadata=report))
    return run_id


async def test_the_store_keeps_each_turns_spend_and_sums_it(database: AnyDatabase) -> None:
    runs = SqliteRunStore(database)
    first = await _run(database, CLAUDE, COPILOT, CLAUDE, chat="-100")
    second = await _run(database, CODEX)
    await _run(database, CLAUDE, chat="-200")
    turns = await runs.turns(first)
    assert [t.spend.cost_usd for t in turns] == [0.000235, None, 0.000235]
    assert (turns[1].spend.turns, turns[1].spend.unknown) == (1, 1)
    # A turn still running has no spend yet and does not count.
    await runs.start_turn(first, 4, "p", "execute")
    spend = await runs.spend_of([first, second, "no-such-run"])
    assert set(spend) == {first, second}
    assert spend[first].cost_usd == pytest.approx(0.00047)
    assert (spend[first].turns, spend[first].unknown, spend[first].output) == (3, 1, 14)
    assert type(spend[first].output) is int  # (not PostgreSQL's Decimal: it goes to JSON)
    assert type(spend[first].cost_usd) is float
    assert (spend[second].cost_usd, spend[second].cache_read) == (None, 1000)
    today = await runs.spend_in_chat("-100", since=time.time() - 60)
    assert (today.cost_usd, today.turns) == (pytest.approx(0.00047), 3)
    assert not (await runs.spend_in_chat("-100", since=time.time() + 60)).known
    # The turn's event says what it cost too.
    ended = [e for e in await EventLog(database).read(first) if e.kind == "turn_ended"]
    assert ended[0].data["cost_usd"] == 0.000235
    assert ended[0].data["tokens"]["output"] == 7
    assert "cost_usd" not in ended[1].data


def test_turnstile_runs_shows_and_lists_the_spend(tmp_path: Path) -> None:
    import asyncio

    from engine.store.backend import open_database

    path = tmp_path / "t.db"

    async def fill() -> tuple[str, str]:
        async with open_database(path) as db:
            return await _run(db, CLAUDE, CLAUDE), await _run(db, COPILOT)

    known, unknown = asyncio.run(fill())

    def turnstile(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "engine.cli", *args],
            env={**clean_env(), "TURNSTILE_DATABASE": str(path), "PYTHONPATH": str(REPO)},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    listed = {r["id"]: r for r in map(json.loads, turnstile("runs", "--json").splitlines())}
    assert listed[known]["cost_usd"] == 0.00047
    assert listed[known]["tokens"] == {
        "input": 24,
        "output": 14,
        "cache_read": 0,
        "cache_write": 0,
    }
    assert (listed[unknown]["cost_usd"], listed[unknown]["tokens"]) == (None, None)
    table = turnstile("runs").splitlines()
    assert "COST" in table[0].split()
    assert "$0.0005" in next(line for line in table if line.startswith(known))
    assert "unknown" in next(line for line in table if line.startswith(unknown))
    one = json.loads(turnstile("runs", known, "--json"))
    assert one["cost_usd"] == 0.00047
    assert [t["cost_usd"] for t in one["turns"]] == [0.000235, 0.000235]
    assert "Spend: $0.0005 · 38 tokens (24 in, 14 out)" in turnstile("runs", known)
    assert TurnState.FINISHED.value in turnstile("runs", known)


async def test_a_chats_daily_budget_counts_its_other_runs_today(database: AnyDatabase) -> None:
    from engine.automode.budget import check_budget
    from engine.automode.state import AutoModeState, AutoStatus

    runs = SqliteRunStore(database)
    await _run(database, CLAUDE, CLAUDE, chat="-300")  # $0.00047 spent in the chat today
    await _run(database, CLAUDE, CLAUDE, chat="-301")  # another chat's: not counted
    now = time.time()
    state = AutoModeState(
        run_id="auto-x",
        session_id="s",
        objective="o",
        workdir="/w",
        log_dir="/l",
        max_turns=9,
        tool="claude",
        config={"daily_budget": 0.0009, "chat_id": -300},
    )
    turn = Spend.of_turn(CLAUDE)
    # $0.00047 + this turn's $0.000235 = 78 %: nothing to say.
    same, note = await check_budget(state, now, run=turn, this_turn=turn, store=runs)
    assert (same, note) == (state, None)
    # With a cap of $0.00086 it is 82 %: told once, and the state remembers it was.
    state = replace(state, config={**state.config, "daily_budget": 0.00086})
    warned, note = await check_budget(state, now, run=turn, this_turn=turn, store=runs)
    assert note is not None
    assert "this chat's budget for today ($0.0009)" in note
    assert warned.config["budget_warned_day"] is True
    again, note = await check_budget(warned, now, run=turn, this_turn=turn, store=runs)
    assert note is None
    assert again.status is AutoStatus.RUNNING
    # A second turn's worth more reaches it: the run stops, before its next turn.
    two = turn + turn
    stopped, _ = await check_budget(warned, now, run=two, this_turn=two, store=runs)
    assert stopped.status is AutoStatus.STOPPED
    assert stopped.message == "Stopped by this chat's budget for today: $0.0009 of $0.0009 spent"
    assert stopped.config["stopped_by"] == "budget"


def test_a_budget_of_nothing_is_refused(tmp_path: Path) -> None:
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="a budget is more than"):
        Budget.given(0, None)
    with pytest.raises(ConfigError, match="a token budget is more than 0"):
        Budget.given(None, -5)
    done = subprocess.run(
        [sys.executable, "-m", "engine.cli", "auto", "--budget", "-1", "-p", "x"],
        env={**clean_env(), "TURNSTILE_DATABASE": str(tmp_path / "t.db"), "PYTHONPATH": str(REPO)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "--budget: a budget is more than $0, not -1.0" in done.stderr


def test_a_budget_an_agent_cannot_be_held_to_is_refused(tmp_path: Path) -> None:
    # Codex reports tokens only, Copilot nothing: a budget in USD could never stop them.
    assert Budget(usd=1).refusal_for("claude") is None
    assert Budget(tokens=1000).refusal_for("codex") is None
    assert Budget(usd=1).refusal_for("codex") == (
        "codex reports tokens, not cost: give its budget in tokens (--budget-tokens)"
    )
    assert Budget(usd=1, tokens=5).refusal_for("copilot") == (
        "copilot reports neither cost nor tokens: a budget cannot stop its runs"
    )
    args = ["auto", "--tool", "codex", "--budget", "1", "--workdir", str(tmp_path), "-p", "x"]
    done = subprocess.run(
        [sys.executable, "-m", "engine.cli", *args],
        env={**clean_env(), "TURNSTILE_DATABASE": str(tmp_path / "t.db"), "PYTHONPATH": str(REPO)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "cannot keep to this budget: codex reports tokens, not cost" in done.stderr
    assert not (tmp_path / "runs").exists()  # refused before anything was made
