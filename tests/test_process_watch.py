"""engine.process watches its child from the event loop: exit, pipes, stdin, clean-up.

The turn's process is no longer an asyncio subprocess transport: its exit is seen through
a pidfd (a thread where there is none), its pipes are read by loop callbacks. These tests
pin down what that path must keep doing: reap the leader, close every descriptor, kill the
whole group (grandchild included) when the caller gives up, and stop a turn whose output
is refused at once.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from engine.errors import TurnIOError, TurnPreempted
from engine.process import PreemptHandle, ProcessSpec, run_process
from tests.conftest import FAKE_AGENT
from tests.support import alive, wait_for_file

PY = sys.executable


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _sleeper_spec(tmp_path: Path, pids: Path, **step: object) -> ProcessSpec:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"replies": [{"grandchild": True, "sleep": 3600, **step}]}))
    env = {
        **os.environ,
        "FAKE_AGENT_SCRIPT": str(script),
        "FAKE_AGENT_STATE": str(tmp_path / "st"),
        "FAKE_AGENT_PIDS": str(pids),
    }
    return ProcessSpec(argv=[PY, str(FAKE_AGENT), "--prompt", "p"], cwd=tmp_path, env=env)


async def _pids(path: Path) -> tuple[int, int]:
    parent, child = (await wait_for_file(path, timeout=30)).split()
    return int(parent), int(child)


async def test_a_callers_timeout_kills_the_whole_group_grandchild_included(
    tmp_path: Path,
) -> None:
    pids = tmp_path / "pids"
    turn = asyncio.create_task(run_process(_sleeper_spec(tmp_path, pids)), name="turn")
    parent, grandchild = await _pids(pids)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(turn, timeout=0.1)
    assert turn.cancelled()
    # Gone before the cancellation came back, not merely signalled.
    assert not alive(parent)
    assert not alive(grandchild)
    assert not Path(f"/proc/{parent}").exists()  # reaped by us: no zombie left


async def test_a_stopped_turn_ignoring_sigterm_leaves_no_descriptor_open(tmp_path: Path) -> None:
    await run_process(ProcessSpec(argv=[PY, "-c", "pass"]))  # the watchdog starts once
    before = _open_fds()
    pids = tmp_path / "pids"
    handle = PreemptHandle(grace=0.2)
    spec = _sleeper_spec(tmp_path, pids, ignore_term=True)
    turn = asyncio.create_task(run_process(spec, preempt=handle), name="turn")
    parent, grandchild = await _pids(pids)
    assert await handle.stop() is True
    with pytest.raises(TurnPreempted):
        await turn
    assert not alive(parent)
    assert not alive(grandchild)
    assert _open_fds() == before


async def test_finished_turns_reap_the_leader_and_close_every_descriptor(tmp_path: Path) -> None:
    await run_process(ProcessSpec(argv=[PY, "-c", "pass"]))
    before = _open_fds()
    results = [
        await run_process(ProcessSpec(argv=[PY, "-c", "print('hi')"], stdin=b"unread")),
        await run_process(ProcessSpec(argv=[PY, "-c", "import sys; sys.exit(7)"])),
    ]
    with pytest.raises(TurnIOError):
        await run_process(ProcessSpec(argv=[PY, "-c", "print('x')"]), on_stdout_line=_refuse)
    assert [r.exit_code for r in results] == [0, 7]
    assert results[0].stdout == "hi\n"
    for result in results:
        assert not Path(f"/proc/{result.pid}").exists()
    assert _open_fds() == before


def _refuse(line: bytes) -> None:
    raise TurnIOError(f"refused {line!r}", line=1)


async def test_refused_output_ends_a_long_turn_at_once(tmp_path: Path) -> None:
    code = "import time; print('bad', flush=True); time.sleep(3600)"
    with pytest.raises(TurnIOError, match="refused"):
        # Well under the sleep: the refusal kills the process, it does not wait for it.
        await asyncio.wait_for(
            run_process(ProcessSpec(argv=[PY, "-c", code]), on_stdout_line=_refuse), 30
        )


async def test_stdin_the_process_never_reads_does_not_hold_the_turn() -> None:
    # Far more than a pipe holds: the writer waits for room that never comes, then the
    # process exits and the rest is dropped.
    spec = ProcessSpec(argv=[PY, "-c", "print('ignored stdin')"], stdin=b"x" * (4 << 20))
    result = await asyncio.wait_for(run_process(spec), 30)
    assert result.exit_code == 0
    assert result.stdout == "ignored stdin\n"


async def test_a_process_ended_by_a_signal_reports_it_as_a_negative_exit_code() -> None:
    code = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    result = await run_process(ProcessSpec(argv=[PY, "-c", code]))
    assert result.exit_code == -signal.SIGTERM


async def test_no_thread_waits_for_a_turn_where_the_kernel_has_pidfds(tmp_path: Path) -> None:
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        pytest.skip("no pidfd on this system")
    ready = tmp_path / "ready"
    code = f"import pathlib, time; pathlib.Path({str(ready)!r}).write_text('1'); time.sleep(0.5)"
    before = {t.ident for t in threading.enumerate()}
    turn = asyncio.create_task(run_process(ProcessSpec(argv=[PY, "-c", code])), name="turn")
    await wait_for_file(ready, timeout=30)
    during = [t.name for t in threading.enumerate() if t.ident not in before]
    assert (await turn).exit_code == 0
    assert during == []


async def test_without_pidfds_a_thread_sees_the_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_pidfd(pid: int, flags: int = 0) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    result = await run_process(ProcessSpec(argv=[PY, "-c", "print('out'); raise SystemExit(3)"]))
    assert (result.exit_code, result.stdout) == (3, "out\n")
    pids = tmp_path / "pids"
    turn = asyncio.create_task(run_process(_sleeper_spec(tmp_path, pids)), name="turn")
    parent, grandchild = await _pids(pids)
    turn.cancel()
    with pytest.raises(asyncio.CancelledError):
        await turn
    assert not alive(parent)
    assert not alive(grandchild)


async def test_a_finished_turn_leaves_no_cycle_holding_its_output() -> None:
    # Freed when the turn returns, not when the cycle collector next runs: 50 turns at
    # once would otherwise hold every turn's whole output a while longer.
    spec = ProcessSpec(argv=[PY, "-c", "print('x' * 100_000)"], stdin=b"unread")
    await run_process(spec)
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            assert (await run_process(spec)).stdout_size == 100_001
        assert gc.collect() == 0
    finally:
        gc.enable()
