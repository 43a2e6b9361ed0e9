"""Crash-then-resume, generated: whatever the verdicts and wherever the process dies (before a
turn runs, or after it ran and before it was recorded), resuming from the store finishes
every agent turn exactly once, in order, and ends in the state an uninterrupted run ends in.
On a SQLite file and on a fresh PostgreSQL database (tests/pg_support.py) in turn."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.automode import AutoRun, AutoStatus, Phase, prepare_auto_run, prepare_resume
from engine.runs import RunSpec
from engine.settings import load_settings
from engine.store.backend import open_database
from engine.store.location import PostgresURL
from engine.store.runs import SqliteRunStore, TurnState
from engine.turn import Closed, Ready, TurnOutput
from tests.automode_support import AGENT_CMD, GIT_ENV, git_workspace
from tests.pg_support import PgCluster

VERDICTS = ["IN PROGRESS", "NEEDS ADJUSTMENT", "COMPLETE"]


class PhaseAgent:
    """Answers by phase; an Evaluate answer depends only on the agent turn's sequence number,
    so a turn re-run after a crash answers the same."""

    session_id = "crash-test"

    def __init__(self, run: AutoRun, verdicts: list[str]) -> None:
        self.run = run
        self.verdicts = verdicts
        self.calls = 0

    async def run_turn(self, prompt: str) -> TurnOutput:
        self.calls += 1
        state = self.run.channel.state
        if state.phase is Phase.EVALUATE:
            verdict = self.verdicts[state.step % len(self.verdicts)]
            return TurnOutput(f"checked\nAUTO-MODE STATUS: {verdict}\n", exit_code=0)
        if state.phase is Phase.EXECUTE:
            # Real work: a commit (a re-run after a crash adds another; evidence holds).
            proc = await asyncio.create_subprocess_exec(
                "git",
                "-C",
                state.workdir,
                "commit",
                "-q",
                "--allow-empty",
                "-m",
                f"step {state.step}",
            )
            assert await proc.wait() == 0
        return TurnOutput(f"{state.phase.value} done", exit_code=0)


async def drive(
    root: Path, verdicts: list[str], crashes: dict[int, str], pg: str | None = None
) -> tuple[object, ...]:
    """One run to its end; ``pg``: on that PostgreSQL database, else on a SQLite file."""
    workspace = root / "ws"
    if not workspace.exists():
        git_workspace(workspace)
    name = "crash" if crashes else "clean"
    target = PostgresURL(pg) if pg is not None else root / f"{name}.db"
    cfg = load_settings(database=target, runs_dir=root / f"runs-{name}")
    async with open_database(cfg.database) as db:
        spec = RunSpec(
            objective="o", agent="command", workdir=workspace, agent_cmd=AGENT_CMD, max_turns=6
        )
        run = await prepare_auto_run(cfg, db, spec)
        crashed = Counter[int]()
        while True:
            agent = PhaseAgent(run, verdicts)
            step = run.channel.state.step
            ready = await run.channel.next_prompt()
            if isinstance(ready, Closed):
                break
            assert isinstance(ready, Ready)
            kind = crashes.get(step)
            if kind == "before_run" and not crashed[step]:
                crashed[step] += 1
                await run.channel.flush()
                await run.close()  # a dead process holds no lock: the kernel dropped it
                run = await prepare_resume(cfg, db, run.run_id)
                continue
            out = await agent.run_turn(ready.prompt)
            if kind == "after_run" and not crashed[step]:
                crashed[step] += 1
                await run.channel.flush()
                await run.close()  # a dead process holds no lock: the kernel dropped it
                run = await prepare_resume(cfg, db, run.run_id)
                continue
            await run.channel.publish_output(out)
        await run.channel.flush()
        await run.close()  # the owner lock a resume took (its own connection on PostgreSQL)
        turns = await SqliteRunStore(db).turns(run.run_id)
        record = await SqliteRunStore(db).get_run(run.run_id)
    finished = [t.seq for t in turns if t.state is TurnState.FINISHED]
    assert finished == list(range(1, len(finished) + 1))  # each once, in order
    for t in turns:
        if t.state is not TurnState.FINISHED:
            assert t.state is TurnState.INTERRUPTED
            assert crashed[t.seq] == 1
    attempts = Counter(t.seq for t in turns)
    assert all(attempts[seq] == 1 + crashed[seq] for seq in attempts)
    state = run.channel.state
    assert state.terminal
    assert record.status.value == state.status.value
    return (
        state.status,
        state.turn,
        state.phase,
        state.verdicts,
        [(t.seq, t.phase, t.output) for t in turns if t.state is TurnState.FINISHED],
    )


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    verdicts=st.lists(st.sampled_from(VERDICTS), min_size=1, max_size=6),
    crashes=st.dictionaries(
        st.integers(1, 14), st.sampled_from(["before_run", "after_run"]), max_size=4
    ),
)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_crash_then_resume_counts_every_turn_once(
    backend: str,
    verdicts: list[str],
    crashes: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    cluster: PgCluster | None = None
    urls: list[str | None] = [None, None]
    if backend == "postgresql":
        # A database per example (fixtures live across examples), dropped after it.
        cluster = request.getfixturevalue("pg_cluster")
        urls = [cluster.new_database(), cluster.new_database()]
    with tempfile.TemporaryDirectory(prefix="crash-") as tmp:
        root = Path(tmp)
        cwd = os.getcwd()
        try:
            os.chdir(root)
            clean = asyncio.run(drive(root, verdicts, {}, urls[0]))
            resumed = asyncio.run(drive(root, verdicts, crashes, urls[1]))
        finally:
            os.chdir(cwd)
            if cluster is not None:
                for url in urls:
                    assert url is not None
                    cluster.drop_database(url)
    assert resumed == clean
    expected = AutoStatus.COMPLETED if "COMPLETE" in verdicts else AutoStatus.STOPPED
    if expected is AutoStatus.COMPLETED and clean[0] is AutoStatus.STOPPED:
        # COMPLETE may only fall on turns the cap cut off.
        assert clean[1] == 6
    else:
        assert clean[0] is expected
