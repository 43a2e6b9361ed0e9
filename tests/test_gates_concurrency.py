"""Two processes racing: one transition (exactly one wins), two approvers (the quorum is
reached exactly once); through the task store and the CLI, and on the gate store alone."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.gates import AWAITING_APPROVAL, Refusal
from tests.gates_support import (
    REPO,
    cli_env,
    database_setting,
    gate_backend,  # noqa: F401 - the fixture
    make_settings,
    open_gates,
    run_cli,
)
from tests.support import wait_until


async def _spawn(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.gates_support",
        *args,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
@pytest.mark.parametrize("round_", range(3))
async def test_compare_and_set_across_processes(
    tmp_path: Path, round_: int, backend: str, request: pytest.FixtureRequest
) -> None:
    if backend == "postgresql":
        settings = make_settings(tmp_path, database=request.getfixturevalue("pg_url"))
    else:
        settings = make_settings(tmp_path)
    async with open_gates(settings) as gates:
        task = await gates.init_task("t")
        (task.folder / "research.md").write_text("r")
    go = tmp_path / "go"
    target = f"research:{AWAITING_APPROVAL}"
    procs = []
    for i in range(2):
        procs.append(
            await _spawn(
                "race",
                str(settings.database) if backend == "sqlite" else settings.database.conninfo(),
                str(settings.tasks_root),
                "t",
                target,
                str(tmp_path / f"ready{i}"),
                str(go),
            )
        )
    # Another process's files.
    await wait_until(lambda: all((tmp_path / f"ready{i}").exists() for i in range(2)))
    # Both read version 1 before either writes.
    assert {(tmp_path / f"ready{i}").read_text() for i in range(2)} == {"1"}
    go.write_text("go")
    results = [await p.communicate() for p in procs]
    codes = sorted(p.returncode for p in procs)
    outs = sorted(out.decode().strip() for out, _ in results)
    assert codes == [0, Refusal.CONFLICT.exit_code], results
    assert outs == ["concurrent_change", "won"]
    async with open_gates(settings) as gates:
        history = await gates.store.history("t")
        assert [h.version for h in history] == [1, 2]
        assert (await gates.task("t")).version == 2


@pytest.mark.usefixtures("gate_backend")
async def test_two_cli_transitions_one_wins(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    async with open_gates(settings) as gates:
        task = await gates.init_task("t")
        (task.folder / "research.md").write_text("r")
    env = cli_env(settings)
    target = f"research:{AWAITING_APPROVAL}"
    results = await asyncio.gather(
        run_cli("status", "--task", "t", "--transition", target, env=env),
        run_cli("status", "--task", "t", "--transition", target, env=env),
    )
    codes = sorted(rc for rc, _, _ in results)
    # The loser either lost the compare-and-set or found the gate already open.
    assert codes[0] == 0
    assert codes[1] in (Refusal.CONFLICT.exit_code, Refusal.ILLEGAL_TRANSITION.exit_code)
    async with open_gates(settings) as gates:
        assert [h.kind for h in await gates.store.history("t")] == ["init", "gate"]


_APPROVER = """
import asyncio, json, sys
from pathlib import Path
from engine.gates import Gates
from engine.store.backend import open_database
from tests.gates_support import make_settings

async def main(url, root, approver, count):
    settings = make_settings(Path(root), database=url, approval_quorum=2)
    async with open_database(settings) as db:
        gates = Gates(db, settings)
        print("ready", flush=True)
        sys.stdin.readline()
        outcomes = []
        for i in range(count):
            try:
                outcomes.append((await gates.approve(f"t{i}", by=approver)).outcome.value)
            except Exception as exc:
                outcomes.append(type(exc).__name__)
        await gates.stop_all()
        print(json.dumps(outcomes))

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
"""


async def test_two_approvers_at_once_reach_the_quorum_once_on_postgres(
    tmp_path: Path, pg_url: str
) -> None:
    # On one machine the task folder's file lock already serialises the two; the row lock
    # (FOR UPDATE in the approval) is what holds across machines. This runs the PostgreSQL
    # path end to end; it cannot tell the row lock from the file lock (the store-level races
    # below can: without FOR UPDATE, two approvers on PostgreSQL each count only themselves).
    count = 30
    settings = make_settings(tmp_path, database=pg_url, approval_quorum=2)
    async with open_gates(settings) as gates:
        for i in range(count):
            task = await gates.init_task(f"t{i}")
            (task.folder / "research.md").write_text("r")
            await gates.store.transition(f"t{i}", f"research:{AWAITING_APPROVAL}")
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _APPROVER,  # -c: the repository (cwd) is on sys.path
            pg_url,
            str(tmp_path),
            str(approver),
            str(count),
            cwd=REPO,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for approver in (42, 43)
    ]
    for proc in procs:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line == b"ready\n", await proc.stderr.read() if proc.stderr else b""
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
    outputs = [await asyncio.wait_for(p.communicate(), 120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    first, second = (json.loads(out.decode().strip().splitlines()[-1]) for out, _ in outputs)
    assert [sorted(pair) for pair in zip(first, second, strict=True)] == [
        ["approved", "recorded"]
    ] * count


# -- the gate store alone: no folder lock in front of the SQL --------------------------------

_STORE_RACER = """
import asyncio, json, sys, time
from engine.gates import SqlGateStore
from engine.gates.refusals import GateRefused
from engine.gates.store import ApprovalRequest, Change, HistoryEntry
from engine.store.backend import open_database

async def main(mode, where, approver, count):
    async with open_database(where) as db:
        store = SqlGateStore(db)
        tasks = [await store.find(f"t{i}") for i in range(count)]
        print("ready", flush=True)
        sys.stdin.readline()
        out = []
        for task in tasks:
            try:
                if mode == "commit":
                    sets = {"sub_state": "awaiting_approval", "gate_round": task.gate_round + 1}
                    await store.commit(Change(task, sets, HistoryEntry("gate"), time.time()))
                    out.append("won")
                else:
                    request = ApprovalRequest(task, approver, task.gate_sha256, 2, time.time())
                    tally = await store.record_approval(request)
                    out.append([tally.fresh, tally.approvers])
            except GateRefused as exc:
                out.append(exc.reason.value)
        print(json.dumps(out), flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
"""


async def _store_race(where: str, mode: str, approvers: tuple[str, str], count: int) -> list[Any]:
    """Two processes, each with its own gate store, doing ``mode`` to t0..t{count-1} at once."""
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _STORE_RACER,
            mode,
            where,
            approver,
            str(count),
            cwd=REPO,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for approver in approvers
    ]
    for proc in procs:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert line == b"ready\n", await proc.stderr.read() if proc.stderr else b""
    for proc in procs:  # both have read every task before either writes
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
    outputs = [await asyncio.wait_for(p.communicate(), 120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    first, second = (json.loads(out.decode().strip().splitlines()[-1]) for out, _ in outputs)
    return list(zip(first, second, strict=True))


async def _gated_tasks(settings: Any, count: int, *, open_gate: bool) -> None:
    async with open_gates(settings) as gates:
        for i in range(count):
            task = await gates.init_task(f"t{i}")
            (task.folder / "research.md").write_text("r")
            if open_gate:
                await gates.store.transition(f"t{i}", f"research:{AWAITING_APPROVAL}")


@pytest.mark.usefixtures("gate_backend")
async def test_two_processes_committing_one_change_in_the_store_exactly_one_wins(
    tmp_path: Path,
) -> None:
    count = 30
    settings = make_settings(tmp_path)
    await _gated_tasks(settings, count, open_gate=False)
    pairs = await _store_race(database_setting(settings), "commit", ("a", "b"), count)
    assert [sorted(pair) for pair in pairs] == [["concurrent_change", "won"]] * count
    async with open_gates(settings) as gates:
        for i in range(count):
            assert [h.version for h in await gates.store.history(f"t{i}")] == [1, 2]


@pytest.mark.usefixtures("gate_backend")
@pytest.mark.parametrize(
    ("approvers", "outcome"),
    [
        # Two people: whoever comes second counts both and reaches the quorum of 2.
        (("42", "43"), [[True, 1], [True, 2]]),
        # One person twice: recorded once, the second finds it there.
        (("42", "42"), [[False, 1], [True, 1]]),
    ],
)
async def test_two_approvers_racing_in_the_store_get_exactly_the_right_outcome(
    tmp_path: Path, approvers: tuple[str, str], outcome: list[list[Any]]
) -> None:
    count = 30
    settings = make_settings(tmp_path)
    await _gated_tasks(settings, count, open_gate=True)
    pairs = await _store_race(database_setting(settings), "approve", approvers, count)
    assert [sorted(pair) for pair in pairs] == [outcome] * count
    async with open_gates(settings) as gates:
        for i in range(count):
            history = await gates.store.history(f"t{i}")
            fresh = 2 if approvers[0] != approvers[1] else 1
            assert [h.kind for h in history] == ["init", "gate"] + ["approve"] * fresh
            assert [h.version for h in history] == list(range(1, 3 + fresh))
