"""Issue 15 item 4: a turn's agent dies with the process that runs it, even on ``kill -9``.

A real parent process runs a ``command`` agent turn; the agent keeps writing a file and
leaves children (one in its group, one in a session of its own). The parent is killed
with SIGKILL: the turn's processes must be gone soon after, not keep writing. And on
start-up, what a cut-off turn left behind is killed from what its record says, never a
process that merely reuses its pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import sys
import textwrap
import time
import uuid
from pathlib import Path

from engine.reaper import kill_remains, start_time
from tests.fakes.realcli import MARKER_VAR, alive, marked_processes

REPO = Path(__file__).resolve().parent.parent

# The agent: a child in its group, a child in a session of its own, and itself, all
# appending to files until killed.
AGENT = textwrap.dedent(
    """
    import os, subprocess, sys, time

    folder = sys.argv[1]
    writer = (
        "import os, sys, time\\n"
        "path = sys.argv[1]\\n"
        "while True:\\n"
        "    with open(path, 'a') as fh: fh.write('x')\\n"
        "    time.sleep(0.02)\\n"
    )
    subprocess.Popen([sys.executable, "-c", writer, os.path.join(folder, "grouped")])
    subprocess.Popen(
        [sys.executable, "-c", writer, os.path.join(folder, "sessioned")],
        start_new_session=True,
    )
    open(os.path.join(folder, "started"), "w").close()
    exec(writer.replace("sys.argv[1]", repr(os.path.join(folder, "agent"))))
    """
)

# The parent: runs one turn of that agent through engine.process and waits forever.
PARENT = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from engine.agents import AgentOptions, CommandAgent

    folder = Path(sys.argv[1])
    template = f"{sys.executable} {folder / 'agent.py'} {folder} {{prompt}}"
    options = AgentOptions(binary=sys.executable, cwd=folder, pass_env=("FAKE_*",))
    asyncio.run(CommandAgent(template, cwd=folder, options=options).run_turn("go"))
    """
)


async def _until(predicate: object, within: float, what: str) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


def _sizes(folder: Path) -> dict[str, int]:
    names = ("agent", "grouped", "sessioned")
    return {n: (folder / n).stat().st_size if (folder / n).exists() else 0 for n in names}


async def test_sigkill_of_the_parent_kills_the_whole_turn(tmp_path: Path) -> None:
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "parent.py").write_text(PARENT)
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER_VAR: marker, "PYTHONPATH": str(REPO)}
    parent = await asyncio.create_subprocess_exec(
        sys.executable, str(tmp_path / "parent.py"), str(tmp_path), env=env
    )
    try:
        await _until(
            lambda: all(_sizes(tmp_path).values()), 30, "the agent and its children never wrote"
        )
        assert len(marked_processes(marker)) >= 4  # parent, agent and its two children
        parent.send_signal(signal.SIGKILL)
        await parent.wait()
        # Killed within moments (not kept writing 8 s later), all three writers.
        await _until(lambda: marked_processes(marker) == [], 10, "the turn outlived its parent")
        before = _sizes(tmp_path)
        await asyncio.sleep(0.3)  # nothing may write any more: a span, not a hand-off
        assert _sizes(tmp_path) == before
    finally:
        if parent.returncode is None:
            parent.kill()
            await parent.wait()
        for pid in marked_processes(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def _sleeper(tmp_path: Path, marker: str | None = None) -> asyncio.subprocess.Process:
    env = dict(os.environ)
    if marker is not None:
        env["TURNSTILE_TURN_ID"] = marker
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; time.sleep(60)", env=env, start_new_session=True
    )


async def test_startup_reaper_kills_the_recorded_group_only_if_its_start_time_matches(
    tmp_path: Path,
) -> None:
    proc = await _sleeper(tmp_path)
    try:
        recorded = start_time(proc.pid)
        assert recorded is not None
        boot, ticks = recorded.rsplit("/", 1)
        # Another process that got the same pid later: a different start time.
        assert kill_remains(proc.pid, f"{boot}/{int(ticks) + 1}", None) == []
        assert kill_remains(proc.pid, f"another-boot/{ticks}", None) == []
        assert kill_remains(proc.pid, None, None) == []
        assert alive(proc.pid)
        assert kill_remains(proc.pid, recorded, None) == [proc.pid]
        assert await asyncio.wait_for(proc.wait(), 10) == -signal.SIGKILL
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_startup_reaper_kills_marked_processes_whatever_their_group(
    tmp_path: Path,
) -> None:
    marker = uuid.uuid4().hex
    marked = await _sleeper(tmp_path, marker)
    other = await _sleeper(tmp_path, uuid.uuid4().hex)
    try:
        assert kill_remains(None, None, marker) == [marked.pid]
        assert await asyncio.wait_for(marked.wait(), 10) == -signal.SIGKILL
        assert alive(other.pid)
    finally:
        for proc in (marked, other):
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_the_watchdog_is_restarted_if_it_dies(tmp_path: Path) -> None:
    from engine.process import ProcessSpec, lifeline, run_process

    for _ in range(2):
        await run_process(ProcessSpec(argv=["/bin/true"]))
        pid = lifeline().watchdog_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await _until(lambda p=pid: not alive(p), 10, "the watchdog did not die")
        # A later turn notices (it looks at most once a second) and starts a new one.
        deadline = time.monotonic() + 10
        while lifeline().watchdog_pid in (None, pid):
            assert time.monotonic() < deadline, "no new watchdog"
            await run_process(ProcessSpec(argv=["/bin/true"]))
        assert alive(lifeline().watchdog_pid or 0)


def watchdog_of(pid: int) -> int | None:
    """The turn watchdog a process started (its child running ``reaper.py --watch``)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"--watch" in argv:
            return int(entry)
    return None


async def test_auto_resume_kills_what_the_cut_off_turn_left(tmp_path: Path) -> None:
    # The CLI and its watchdog both die at once (nothing killed the agent then); the
    # resume kills the cut-off turn's agent and its child from the turn's record.
    from tests.automode_support import (
        AGENT_CMD,
        cli_env,
        git_workspace,
        happy_rules,
        turnstile,
        write_script,
    )

    ws = git_workspace(tmp_path / "ws")
    rules = happy_rules(execute={"grandchild": True, "wait_file": str(tmp_path / "never")})
    script = write_script(tmp_path / "fake", rules=rules)
    marker = uuid.uuid4().hex
    env = {**cli_env(tmp_path, script), MARKER_VAR: marker}
    # --log-level INFO: the test follows the run through its log records on stderr.
    args = ["--log-level", "INFO", "auto", "--tool", "command", "--agent-cmd", AGENT_CMD]
    args += ["--workdir", str(ws), "-p", "x"]
    cli = await asyncio.create_subprocess_exec(
        *turnstile(*args), cwd=tmp_path, env=env, stderr=asyncio.subprocess.PIPE
    )
    resumed: asyncio.subprocess.Process | None = None
    try:
        assert cli.stderr is not None
        lines: list[str] = []
        while not any("Turn 3, round 3/10: Executing" in line for line in lines):
            raw = await asyncio.wait_for(cli.stderr.readline(), 60)
            assert raw, "".join(lines)
            lines.append(raw.decode())
        run_id = next(ln for ln in lines if "Auto run " in ln).split("Auto run ", 1)[1].split()[0]
        # The execute turn's agent and its grandchild run (the CLI's own pid is marked too).
        await _until(lambda: len(marked_processes(marker)) >= 3, 30, "the agent never ran")
        orphans = [pid for pid in marked_processes(marker) if pid != cli.pid]
        watchdog = watchdog_of(cli.pid)
        assert watchdog is not None
        os.kill(watchdog, signal.SIGKILL)
        cli.kill()
        await cli.wait()
        assert all(alive(pid) for pid in orphans)  # nobody killed them yet
        with contextlib.closing(sqlite3.connect(tmp_path / "turnstile.db")) as conn:
            pgid, start, turn_marker = conn.execute(
                "SELECT proc_pgid, proc_start, proc_marker FROM turns"
                " WHERE run_id = ? AND state = 'started'",
                (run_id,),
            ).fetchone()
        assert pgid in orphans  # the agent leads its group
        assert start == start_time(pgid)
        assert len(turn_marker) == 32
        resumed = await asyncio.create_subprocess_exec(
            *turnstile("--log-level", "INFO", "auto", "--resume", run_id),
            cwd=tmp_path,
            env=env,
            stderr=asyncio.subprocess.PIPE,
        )
        assert resumed.stderr is not None
        while True:
            raw = await asyncio.wait_for(resumed.stderr.readline(), 60)
            assert raw, "the resume never said it resumed"
            if b"Resuming auto run" in raw:
                break
        await _until(
            lambda: not any(alive(pid) for pid in orphans), 10, "the cut-off turn survived"
        )
    finally:
        for proc in (cli, resumed):
            if proc is not None and proc.returncode is None:
                proc.kill()
                await proc.wait()
        for pid in marked_processes(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_the_watchdog_table_holds_every_turn_in_flight() -> None:
    # More turns at once than the first table holds: it grows, and what the watchdog
    # would read at a death is exactly the turns still in flight.
    from engine.reaper import Lifeline, _read_table

    guard = Lifeline()
    try:
        markers = [uuid.uuid4().hex for _ in range(150)]
        for i, marker in enumerate(markers):
            guard.begin(marker)
            guard.spawned(marker, 4_000_000 + i)  # no such process: no start time
        for marker in markers[::2]:
            guard.end(marker)
        assert guard._fd is not None
        live = _read_table(guard._fd)
        assert set(live) == set(markers[1::2])
        assert live[markers[1]] == (4_000_001, None, False)
        guard.settling(markers[1], True)
        assert _read_table(guard._fd)[markers[1]] == (4_000_001, None, True)
        guard.settling(markers[1], False)
        assert _read_table(guard._fd)[markers[1]] == (4_000_001, None, False)
    finally:
        guard.close()


async def test_bot_start_up_kills_what_the_cut_off_turn_left(tmp_path: Path) -> None:
    # The bot and its watchdog both die at once; the next start kills the cut-off turn's
    # agent and its child from the turn's record, then reports the turn.
    import json

    from tests.fakes.bot_api import FakeBotApi
    from tests.test_kill_loop import CHAT, OPERATOR, _env, _start

    marker = uuid.uuid4().hex
    async with FakeBotApi() as api:
        env = _env(api, tmp_path, marker)
        rules = [{"match": "", "grandchild": True, "wait_file": str(tmp_path / "never")}]
        Path(env["FAKE_AGENT_SCRIPT"]).write_text(json.dumps({"rules": rules}))
        bot = await _start(api, tmp_path, env)
        try:
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
            await api.wait_for_message(lambda m: "bound" in m.text, timeout=60)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="hold on")
            pids = tmp_path / "pids"
            await _until(lambda: pids.exists() and pids.read_text().strip(), 30, "no agent")
            orphans = [int(p) for p in pids.read_text().split()]
            watchdog = watchdog_of(bot.pid)
            assert watchdog is not None
            os.kill(watchdog, signal.SIGKILL)
            bot.kill()
            await bot.wait()
            assert all(alive(pid) for pid in orphans)  # nobody killed them yet
            bot = await _start(api, tmp_path, env)
            await api.wait_for_message(lambda m: "was cut off" in m.text, timeout=60)
            assert not any(alive(pid) for pid in orphans)
            bot.send_signal(signal.SIGTERM)
            await asyncio.wait_for(bot.wait(), 60)
        finally:
            if bot.returncode is None:
                bot.kill()
                await bot.wait()
            for pid in marked_processes(marker):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
