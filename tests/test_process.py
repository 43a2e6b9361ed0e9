"""engine.process: argv only, concurrent draining, bounded memory, pre-emption."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import time
import uuid
from pathlib import Path

import pytest

from engine.agents import AgentOptions
from engine.errors import InvalidPromptError, TurnExecError, TurnIOError, TurnPreempted
from engine.process import (
    PreemptHandle,
    ProcessSpec,
    SerialTurnDriver,
    run_process,
    validate_prompt,
)
from engine.testing import ScriptedSession
from tests.conftest import FAKE_AGENT
from tests.fakes.realcli import MARKER_VAR, marked_processes
from tests.support import alive, wait_for_file, wait_until

PY = sys.executable


def script(tmp_path: Path, steps: list[dict[str, object]]) -> dict[str, str]:
    path = tmp_path / "script.json"
    path.write_text(json.dumps({"replies": steps}))
    return {**os.environ, "FAKE_AGENT_SCRIPT": str(path), "FAKE_AGENT_STATE": str(tmp_path / "st")}


def agent_spec(tmp_path: Path, steps: list[dict[str, object]], prompt: str = "p") -> ProcessSpec:
    return ProcessSpec(
        argv=[PY, str(FAKE_AGENT), "--prompt", prompt], cwd=tmp_path, env=script(tmp_path, steps)
    )


@pytest.mark.parametrize("prompt", ["", "   \n\t", "has\x00nul"])
def test_invalid_prompts_refused(prompt: str) -> None:
    with pytest.raises(InvalidPromptError):
        validate_prompt(prompt)


async def test_nul_in_argv_refused_before_spawn(tmp_path: Path) -> None:
    marker = tmp_path / "spawned"
    spec = ProcessSpec(argv=[PY, "-c", f"open({str(marker)!r}, 'w')", "a\x00b"])
    with pytest.raises(InvalidPromptError):
        await run_process(spec)
    assert not marker.exists()


async def test_prompt_is_one_argv_element_never_a_shell(tmp_path: Path) -> None:
    evil = "$(touch pwned); `touch pwned2` && rm -rf / ; 'quoted' \"dq\" \n-rf"
    spec = ProcessSpec(
        argv=[PY, "-c", "import sys, json; print(json.dumps(sys.argv[1:]))", evil], cwd=tmp_path
    )
    result = await run_process(spec)
    assert json.loads(result.stdout) == [evil]
    assert not (tmp_path / "pwned").exists()
    assert not (tmp_path / "pwned2").exists()


async def test_stdout_verbatim_and_exit_code_is_a_result(tmp_path: Path) -> None:
    result = await run_process(agent_spec(tmp_path, [{"text": "  line1\r\nline2\n\n", "exit": 3}]))
    assert result.stdout == "  line1\r\nline2\n\n"
    assert result.exit_code == 3
    out = result.to_turn_output()
    assert out.text == "  line1\r\nline2\n\n"
    assert out.exit_code == 3


async def test_non_utf8_output_never_crashes(tmp_path: Path) -> None:
    spec = ProcessSpec(argv=[PY, "-c", "import sys; sys.stdout.buffer.write(b'ok \\xff\\xfe end')"])
    result = await run_process(spec)
    assert result.stdout == "ok \ufffd\ufffd end"


@pytest.mark.timeout(120)
async def test_50mb_on_both_pipes_does_not_deadlock(tmp_path: Path) -> None:
    size = 50 * 1024 * 1024
    spec = agent_spec(tmp_path, [{"stdout_bytes": size, "stderr_bytes": size, "text": "END"}])
    result = await run_process(spec, spill_limit=1024 * 1024, spill_dir=tmp_path / "spill")
    assert result.exit_code == 0
    assert result.stdout_size == size + 3
    assert result.stderr_size == size
    # Memory stays bounded: only the head is held, the rest is in the spill file.
    assert len(result.stdout.encode()) <= 1024 * 1024
    assert result.spill_path is not None
    assert result.spill_path.stat().st_size == size + 3
    with result.spill_path.open("rb") as fh:
        fh.seek(-3, os.SEEK_END)
        assert fh.read() == b"END"
    assert len(result.stderr_tail) <= 2048


async def test_output_under_limit_is_not_spilled(tmp_path: Path) -> None:
    result = await run_process(
        agent_spec(tmp_path, [{"text": "small"}]), spill_limit=1024, spill_dir=tmp_path
    )
    assert result.spill_path is None
    assert result.stdout == "small"


async def test_spilled_turn_output_reads_whole_text(tmp_path: Path) -> None:
    result = await run_process(
        agent_spec(tmp_path, [{"stdout_bytes": 5000, "text": "tail"}]),
        spill_limit=1024,
        spill_dir=tmp_path,
    )
    out = result.to_turn_output()
    assert out.spilled
    assert len(out.full_text()) == 5004
    assert out.full_text().endswith("tail")
    assert out.size == 5004


async def test_stderr_tail_is_capped_and_redacted(tmp_path: Path) -> None:
    secret = "sk-ant-" + "A" * 40
    noise = "n" * 10_000
    result = await run_process(
        agent_spec(tmp_path, [{"stderr": f"{noise} token {secret} Bearer abc.def.ghi", "exit": 1}])
    )
    assert len(result.stderr_tail.encode()) <= 2048
    assert secret not in result.stderr_tail
    assert "abc.def.ghi" not in result.stderr_tail
    assert "[REDACTED]" in result.stderr_tail


async def test_missing_binary_is_exec_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(TurnExecError) as caught:
        await run_process(ProcessSpec(argv=["no-such-agent-binary-xyz", "-p", "x"]))
    assert caught.value.binary == "no-such-agent-binary-xyz"
    assert "no-such-agent-binary-xyz" in str(caught.value)


async def test_not_executable_is_exec_error(tmp_path: Path) -> None:
    binary = tmp_path / "agent"
    binary.write_text("#!/bin/sh\necho hi\n")
    binary.chmod(0o644)
    with pytest.raises(TurnExecError, match="not executable"):
        await run_process(ProcessSpec(argv=[str(binary)]))


async def test_stdin_prompt_delivered_whole(tmp_path: Path) -> None:
    prompt = "x" * (1024 * 1024) + "END"
    spec = ProcessSpec(
        argv=[PY, "-c", "import sys; d=sys.stdin.read(); print(len(d), d[-3:])"],
        stdin=prompt.encode(),
    )
    result = await run_process(spec)
    assert result.stdout.split() == [str(len(prompt)), "END"]


async def test_line_callback_sees_each_line_and_can_fail_the_turn(tmp_path: Path) -> None:
    seen: list[bytes] = []
    spec = ProcessSpec(argv=[PY, "-c", "print('a'); print('b'); print('c', end='')"])
    await run_process(spec, on_stdout_line=seen.append)
    assert seen == [b"a", b"b", b"c"]

    def reject(line: bytes) -> None:
        raise TurnIOError("bad line", line=1)

    with pytest.raises(TurnIOError, match="bad line"):
        await run_process(spec, on_stdout_line=reject)


async def _wait_pids(path: Path) -> tuple[int, int]:
    # 30 s: python starting on a loaded machine.
    parent, child = (await wait_for_file(path, timeout=30)).split()
    return int(parent), int(child)


@pytest.mark.parametrize("ignore_term", [False, True])
async def test_preempt_kills_agent_and_grandchild(tmp_path: Path, ignore_term: bool) -> None:
    pids = tmp_path / "pids"
    env = script(tmp_path, [{"grandchild": True, "sleep": 3600, "ignore_term": ignore_term}])
    env["FAKE_AGENT_PIDS"] = str(pids)
    handle = PreemptHandle(grace=0.3)
    spec = ProcessSpec(argv=[PY, str(FAKE_AGENT), "--prompt", "p"], env=env)
    turn = asyncio.create_task(run_process(spec, preempt=handle), name="turn")
    parent, grandchild = await _wait_pids(pids)
    # On a loaded machine the agent can write its pids before run_process has resumed
    # from the spawn and attached the handle.
    await wait_until(lambda: handle.active, timeout=10, what="the handle attached")
    started = time.monotonic()
    assert await handle.stop() is True
    with pytest.raises(TurnPreempted):
        await turn
    # Well under the agent's own 3600 s: the grace period, SIGKILL, and a margin for a
    # loaded machine.
    assert time.monotonic() - started < handle.grace + 10
    # stop() returns only once the whole group is gone, grandchild included.
    assert not alive(parent)
    assert not alive(grandchild)
    assert not Path(f"/proc/{parent}").exists()  # reaped: no zombie left by us
    assert not handle.active
    assert await handle.stop() is False


async def test_cancellation_kills_the_process_group(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    env = script(tmp_path, [{"grandchild": True, "sleep": 3600}])
    env["FAKE_AGENT_PIDS"] = str(pids)
    spec = ProcessSpec(argv=[PY, str(FAKE_AGENT), "--prompt", "p"], env=env)
    turn = asyncio.create_task(run_process(spec), name="turn")
    parent, grandchild = await _wait_pids(pids)
    turn.cancel()
    with pytest.raises(asyncio.CancelledError):
        await turn
    await wait_until(lambda: not alive(parent) and not alive(grandchild), timeout=10)
    assert not alive(parent)
    assert not alive(grandchild)


@pytest.mark.parametrize("delay", range(6))
async def test_cancelled_while_spawning_stops_the_whole_group(delay: int) -> None:
    # sh starts a child at once, so a cancel landing while asyncio still connects the
    # pipes finds a child holding them: asyncio alone would SIGKILL only sh and then wait
    # for those pipes forever, leaving the child running.
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER_VAR: marker}
    spec = ProcessSpec(argv=["sh", "-c", "sleep 300 & exec sleep 301"], env=env)
    turn = asyncio.create_task(run_process(spec), name="turn")
    for _ in range(delay):
        await asyncio.sleep(0)
    turn.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(turn, 30)
    assert marked_processes(marker) == []


async def test_no_wall_clock_timeout_on_a_turn(tmp_path: Path) -> None:
    # A turn lasting longer than any internal grace period still completes normally.
    result = await run_process(agent_spec(tmp_path, [{"sleep": 2.5, "text": "late"}]))
    assert result.stdout == "late"
    assert result.exit_code == 0


async def test_leftover_descendants_do_not_hang_the_turn(tmp_path: Path) -> None:
    # The agent exits but a background grandchild keeps stdout open.
    code = (
        "import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(3600)']); print('done')"
    )
    result = await run_process(ProcessSpec(argv=[PY, "-c", code]))
    assert result.stdout.strip() == "done"
    assert result.exit_code == 0


async def test_serial_driver_never_overlaps() -> None:
    session = ScriptedSession()
    session.gate = asyncio.Event()
    driver = SerialTurnDriver(session)
    calls = [asyncio.create_task(driver.run_turn(f"p{i}"), name=f"c{i}") for i in range(5)]
    for _ in range(20):
        await asyncio.sleep(0)
    assert session.in_flight == 1
    assert driver.busy
    session.gate.set()
    outs = await asyncio.gather(*calls)
    assert session.max_in_flight == 1
    assert [o.text for o in outs] == [f"echo: p{i}" for i in range(5)]
    assert driver.session_id == "scripted"


async def test_serial_driver_with_real_processes_records_no_overlap(
    tmp_path: Path, fake_agent_cmd: str
) -> None:
    from engine.agents import CommandAgent

    log = tmp_path / "log.jsonl"
    os.environ["FAKE_AGENT_LOG"] = str(log)
    try:
        steps = [{"sleep": 0.2, "text": "t{turn}"}] * 4
        (tmp_path / "script.json").write_text(json.dumps({"replies": steps}))
        os.environ["FAKE_AGENT_SCRIPT"] = str(tmp_path / "script.json")
        options = AgentOptions(binary=sys.executable, cwd=tmp_path, pass_env=("FAKE_*",))
        agent = CommandAgent(fake_agent_cmd, cwd=tmp_path, options=options, session_id="serial")
        driver = SerialTurnDriver(agent)
        await asyncio.gather(*(driver.run_turn(f"p{i}") for i in range(4)))
    finally:
        os.environ.pop("FAKE_AGENT_LOG", None)
        os.environ.pop("FAKE_AGENT_SCRIPT", None)
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(entries) == 4
    spans = sorted((e["started"], e["finished"]) for e in entries)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end
