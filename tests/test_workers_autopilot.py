"""Autopilot drives on ``turnstile worker`` processes: real PostgreSQL, real workers, a
phase agent that writes each phase's artifact where the prompt says."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.automode_support import turnstile
from tests.workers_support import Cluster, wait_for
from tests.workers_support import cluster as cluster

pytestmark = pytest.mark.timeout(240)  # generous: worker suites share a loaded machine

APPROVER = "42"
BOT_APPROVER = 22  # tests.fakes.bot_harness.APPROVER

# A short workflow: two approval gates, then one automatic phase (where sub-tasks start).
WORKFLOW = textwrap.dedent(
    '''
    [workflow]
    name = "short"
    decomposition = "decomposition"
    subtask_start = "implement"

    [phases.research]
    persona = "Researcher"
    approval = true
    artifact = "research.md"
    forbidden = ["decomposition.md", "implementation.md"]
    code_edits = false
    allowed = ["Write your findings to {artifact_path}."]
    forbidden_actions = ["Editing code."]
    prompt = """
    Research task {task}.
    """

    [phases.decomposition]
    persona = "Architect"
    approval = true
    artifact = "decomposition.md"
    forbidden = ["implementation.md"]
    code_edits = false
    allowed = ["Split the task into sub-tasks in {artifact_path}."]
    forbidden_actions = ["Editing code."]
    prompt = """
    Split task {task}.
    """

    [phases.implement]
    persona = "Implementer"
    approval = false
    artifact = "implementation.md"
    forbidden = []
    code_edits = true
    allowed = ["Edit code; summarise in {artifact_path}."]
    forbidden_actions = ["Writing review artifacts."]
    prompt = """
    Implement task {task}.
    """
    '''
)

# The agent: finds its phase, task and artifact path in the prompt, writes the artifact
# (the decomposition from its configuration), and in implement commits a file of its own.
AGENT = textwrap.dedent(
    """
    import json, os, re, subprocess, sys, time
    from pathlib import Path

    prompt = sys.argv[sys.argv.index("--prompt") + 1]
    session = sys.argv[sys.argv.index("--session") + 1]
    conf = json.loads(Path(os.environ["FAKE_PILOT_AGENT_CONF"]).read_text())
    phase = re.search(r"^Phase: (\\w+) \\(", prompt, re.M).group(1)
    task = re.search(r"^You are the .* for task (\\S+)\\.$", prompt, re.M).group(1)
    artifact = Path(re.search(r"^Write the artifact to: (.+)$", prompt, re.M).group(1))
    entry = {"task": task, "phase": phase, "session": session, "pid": os.getpid(),
             "worker": os.environ.get("AGENT_WORKER_NAME"), "cwd": os.getcwd(),
             "started": time.time()}
    with open(conf["started"], "a") as fh:
        fh.write(json.dumps(entry) + "\\n")
    time.sleep(float(conf.get("sleep", {}).get(phase, 0)))
    once = conf.get("stall_once", {}).get(phase)
    if once and not os.path.exists(once):
        Path(once).write_text("")
        time.sleep(60)
    if phase == "decomposition":
        content = conf["decomposition"]
    else:
        content = f"# {phase} of {task}\\n"
    if phase == "implement":
        code = Path("src") / f"{task}.txt"
        code.parent.mkdir(exist_ok=True)
        code.write_text(f"made by {task}\\n")
        subprocess.run(["git", "add", str(code)], check=True)
        subprocess.run(["git", "commit", "-q", "-m", f"implement {task}"], check=True)
    artifact.parent.mkdir(parents=True, exist_ok=True)
    artifact.write_text(content)
    entry["finished"] = time.time()
    with open(conf["log"], "a") as fh:
        fh.write(json.dumps(entry) + "\\n")
    print(f"wrote {artifact}")
    """
)

NO_SPLIT = "# Decomposition\n\n```subtasks\n```\n"
THREE = (
    "# Decomposition\n\n```subtasks\nwave 1: a1 - one\nwave 1: a2 - two\nwave 1: a3 - three\n```\n"
)


def setup_pilot(cluster: Cluster, **conf: Any) -> str:
    """Configure the cluster for drives (call before starting workers); the agent command."""
    tmp = cluster.tmp
    (tmp / "workflow.toml").write_text(WORKFLOW)
    agent = tmp / "phase_agent.py"
    agent.write_text(AGENT)
    config = {
        "log": str(tmp / "phases.log"),
        "started": str(tmp / "started.log"),
        "decomposition": NO_SPLIT,
        **conf,
    }
    (tmp / "agent.json").write_text(json.dumps(config))
    cluster.env.update(
        {
            "TURNSTILE_WORKFLOW_FILE": str(tmp / "workflow.toml"),
            "TURNSTILE_APPROVERS": f"{APPROVER},{BOT_APPROVER}",
            "TURNSTILE_TASKS_ROOT": str(tmp / "tasks"),
            "FAKE_PILOT_AGENT_CONF": str(tmp / "agent.json"),
        }
    )
    return f"{sys.executable} {agent} --session {{session_id}} --prompt {{prompt}}"


def entries(cluster: Cluster, which: str = "phases.log") -> list[dict[str, Any]]:
    path = cluster.tmp / which
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def start_drive(cluster: Cluster, agent_cmd: str, task: str = "t1") -> str:
    done = cluster.cli(
        "autopilot",
        "--task",
        task,
        "--init",
        "--checkout-repo",
        "demo",
        "--summary",
        "build the thing",
        "--tool",
        "command",
        "--agent-cmd",
        agent_cmd,
        "--detach",
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def placement(cluster: Cluster, run_id: str) -> tuple[str, str | None, str | None]:
    """How the drive stands on the workers, the worker of its last step, its note."""
    found = cluster.placement(run_id)
    assert found is not None, f"no placement of {run_id}"
    return found.status.value, found.last_worker, found.note


def start_wave(cluster: Cluster, agent_cmd: str) -> str:
    """Drive task ``p`` through its two gates (both approved) to its wave; its run id."""
    run_id = start_drive(cluster, agent_cmd, task="p")
    wait_for("the research gate", lambda: parked_at(cluster, run_id, "p", "research"))
    approve(cluster, "p")
    wait_for("the decomposition gate", lambda: parked_at(cluster, run_id, "p", "decomposition"))
    approve(cluster, "p")
    return run_id


def label(cluster: Cluster, task: str) -> str:
    rows = cluster.query("SELECT phase, sub_state FROM gate_tasks WHERE name = %s", task)
    if not rows:
        return ""
    phase, sub = rows[0]
    return f"{phase}:{sub}" if sub else phase


def history(cluster: Cluster, task: str) -> list[tuple[Any, ...]]:
    """The task's moves with their reasons (printed when a test finds it elsewhere)."""
    return cluster.query(
        "SELECT to_phase, to_sub, actor, reason FROM gate_transitions WHERE task = %s"
        " ORDER BY version",
        task,
    )


def live_jobs(cluster: Cluster, run_id: str) -> list[tuple[Any, ...]]:
    return cluster.query(
        "SELECT id, status, queue_name FROM procrastinate_jobs"
        " WHERE lock = %s AND status IN ('todo', 'doing')",
        run_id,
    )


def parked_at(cluster: Cluster, run_id: str, task: str, gate: str) -> bool:
    status, _, _ = placement(cluster, run_id)
    return status == "parked" and label(cluster, task) == f"{gate}:awaiting_approval"


def approve(cluster: Cluster, task: str) -> None:
    done = cluster.cli("status", "--task", task, "--approve", "--by", APPROVER)
    assert done.returncode == 0, done.stdout + done.stderr


def branch_files(cluster: Cluster, run_id: str) -> set[str]:
    listed = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", f"refs/heads/turnstile/{run_id}"],
        cwd=cluster.remote,
        capture_output=True,
        text=True,
        check=True,
    )
    return set(listed.stdout.split())


def test_a_drive_parks_at_its_gate_and_an_approval_from_another_process_moves_it_on(
    cluster: Cluster,
) -> None:
    agent_cmd = setup_pilot(cluster)
    cluster.start_worker("w1", concurrency=1)
    run_id = start_drive(cluster, agent_cmd)

    wait_for("the drive parked at research", lambda: parked_at(cluster, run_id, "t1", "research"))
    # Parked: no job waits or runs for it, and the worker that holds it is recorded.
    assert live_jobs(cluster, run_id) == []
    _, worker, note = placement(cluster, run_id)
    assert worker == "w1"
    assert "approval" in str(note)
    # The artifact was committed and pushed on the run branch.
    assert ".turnstile/tasks/t1/research.md" in branch_files(cluster, run_id)
    assert [(e["phase"], e["worker"]) for e in entries(cluster)] == [("research", "w1")]

    # A rejection from another process re-runs the phase on the worker; it parks again.
    rejected = cluster.cli(
        "status", "--task", "t1", "--reject", "--by", APPROVER, "--reason", "say more"
    )
    assert rejected.returncode == 0, rejected.stdout + rejected.stderr
    wait_for("the research phase re-run", lambda: len(entries(cluster)) == 2)
    wait_for("the drive parked again", lambda: parked_at(cluster, run_id, "t1", "research"))
    approve(cluster, "t1")
    wait_for(
        "the drive parked at decomposition",
        lambda: parked_at(cluster, run_id, "t1", "decomposition"),
    )
    # A terminal follows the drive (found on the workers) to its end.
    follower = subprocess.Popen(
        turnstile("autopilot", "--task", "t1"),
        cwd=cluster.tmp,
        env=cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert follower.stdout is not None
        seen = ""
        while not seen.startswith("t1:"):  # following, before the approval
            seen = follower.stdout.readline()
            assert seen, "the follower ended early"
        approve(cluster, "t1")
        out, err = follower.communicate(timeout=60)
        out = seen + out
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert follower.returncode == 0, out + err
    assert "t1: decomposition:awaiting_approval on w1" in out
    assert out.rstrip().endswith("complete")
    assert label(cluster, "t1") == "complete"
    assert placement(cluster, run_id)[0] == "finished"
    log = entries(cluster)
    assert [e["phase"] for e in log] == ["research", "research", "decomposition", "implement"]
    assert {e["worker"] for e in log} == {"w1"}
    # One agent session for the whole drive, resumed step after step.
    assert len({e["session"] for e in log}) == 1
    assert cluster.status(run_id) == "completed"
    files = branch_files(cluster, run_id)
    assert {"src/t1.txt", ".turnstile/tasks/t1/implementation.md"} <= files


def test_a_wave_of_three_runs_on_three_workers_and_is_merged_back(cluster: Cluster) -> None:
    agent_cmd = setup_pilot(cluster, decomposition=THREE, sleep={"implement": 1.5})
    for name in ("w1", "w2", "w3"):
        cluster.start_worker(name, concurrency=1)
    run_id = start_wave(cluster, agent_cmd)
    wait_for("the drive's end", lambda: placement(cluster, run_id)[0] == "finished", within=90)
    assert label(cluster, "p") == "complete", history(cluster, "p")[-3:]
    log = entries(cluster)
    subs = [e for e in log if e["task"] in ("p.a1", "p.a2", "p.a3")]
    assert sorted(e["task"] for e in subs) == ["p.a1", "p.a2", "p.a3"]
    # Each sub-task ran on a worker of its own, at the same time as the others.
    assert len({e["worker"] for e in subs}) == 3
    assert max(e["started"] for e in subs) < min(e["finished"] for e in subs)
    # Its parent's implement turn came after the wave, with all three merged in.
    parent_impl = next(e for e in log if e["task"] == "p" and e["phase"] == "implement")
    assert parent_impl["started"] > max(e["finished"] for e in subs)
    files = branch_files(cluster, run_id)
    assert {"src/p.a1.txt", "src/p.a2.txt", "src/p.a3.txt", "src/p.txt"} <= files
    sub_runs = cluster.query(
        "SELECT task, status, parent_id FROM runs WHERE parent_id = %s ORDER BY task", run_id
    )
    assert [(t, s) for t, s, _ in sub_runs] == [
        ("p.a1", "completed"),
        ("p.a2", "completed"),
        ("p.a3", "completed"),
    ]


def test_a_wave_on_the_workers_keeps_to_the_wave_concurrency(cluster: Cluster) -> None:
    """TURNSTILE_WAVE_CONCURRENCY=1: three free workers, yet one sub-task at a time."""
    agent_cmd = setup_pilot(cluster, decomposition=THREE, sleep={"implement": 0.5})
    cluster.env["TURNSTILE_WAVE_CONCURRENCY"] = "1"
    for name in ("w1", "w2", "w3"):
        cluster.start_worker(name, concurrency=1)
    run_id = start_wave(cluster, agent_cmd)
    wait_for("the drive's end", lambda: placement(cluster, run_id)[0] == "finished", within=120)
    assert label(cluster, "p") == "complete", history(cluster, "p")[-3:]
    subs = sorted(
        (e for e in entries(cluster) if e["task"] in ("p.a1", "p.a2", "p.a3")),
        key=lambda e: e["started"],
    )
    # Every phase turn of one sub-task ends before the next sub-task's first one starts.
    spans = {}
    for entry in subs:
        first, last = spans.get(entry["task"], (entry["started"], entry["finished"]))
        spans[entry["task"]] = (min(first, entry["started"]), max(last, entry["finished"]))
    ordered = sorted(spans.values())
    assert len(ordered) == 3
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ordered)), ordered
    assert {"src/p.a1.txt", "src/p.a2.txt", "src/p.a3.txt"} <= branch_files(cluster, run_id)


def test_a_sub_task_that_is_complete_is_merged_only_once_its_branch_is_pushed(
    cluster: Cluster,
) -> None:
    """A sub-task is complete a moment before its drive pushes its branch. The other two
    sub-tasks end meanwhile and wake the parent: it must wait for that push, not fail to
    fetch the branch and hand the task to a person."""
    agent_cmd = setup_pilot(cluster, decomposition=THREE)
    # The remote holds back the first push that carries a2's work for a few seconds.
    held = cluster.tmp / "a2-push-held"
    hook = cluster.remote / "hooks" / "pre-receive"
    hook.write_text(
        "#!/bin/sh\n"
        "while read old new ref; do\n"
        f'  if [ ! -e {held} ] && git ls-tree -r --name-only "$new" | grep -qx src/p.a2.txt;'
        f" then touch {held}; sleep 4; fi\n"
        "done\n"
    )
    hook.chmod(0o755)
    for name in ("w1", "w2", "w3"):
        cluster.start_worker(name, concurrency=1)
    run_id = start_wave(cluster, agent_cmd)
    wait_for("the drive's end", lambda: placement(cluster, run_id)[0] == "finished", within=90)
    assert held.exists()  # the push was held back
    assert label(cluster, "p") == "complete", history(cluster, "p")[-3:]
    assert {"src/p.a1.txt", "src/p.a2.txt", "src/p.a3.txt"} <= branch_files(cluster, run_id)


def test_turnstile_stop_stops_a_drive_on_a_worker(cluster: Cluster) -> None:
    agent_cmd = setup_pilot(cluster, sleep={"research": 60})
    cluster.start_worker("w1", concurrency=1)
    run_id = start_drive(cluster, agent_cmd)
    started = wait_for("the research turn", lambda: entries(cluster, "started.log"))
    pid = started[0]["pid"]
    done = cluster.cli("stop", run_id)
    assert done.returncode == 0, done.stderr
    wait_for("the drive stopped", lambda: placement(cluster, run_id)[0] == "stopped", within=30)
    assert cluster.status(run_id) == "stopped"
    assert label(cluster, "t1") == "research"  # the phase is kept for a later drive
    wait_for("the agent gone", lambda: not _alive(pid), within=10)
    assert live_jobs(cluster, run_id) == []
    turns = cluster.query("SELECT state FROM turns WHERE run_id = %s", run_id)
    assert [t for (t,) in turns] == ["interrupted"]


def test_a_parked_drive_is_stopped_without_a_worker_turn(cluster: Cluster) -> None:
    agent_cmd = setup_pilot(cluster)
    cluster.start_worker("w1", concurrency=1)
    run_id = start_drive(cluster, agent_cmd)
    wait_for("the drive parked", lambda: parked_at(cluster, run_id, "t1", "research"))
    done = cluster.cli("stop", run_id)
    assert done.returncode == 0, done.stderr
    assert placement(cluster, run_id)[0] == "stopped"
    assert cluster.status(run_id) == "stopped"
    # Approving afterwards moves nothing: the drive is over.
    approve(cluster, "t1")
    follow = cluster.cli("autopilot", "--task", "t1", "--detach")
    assert follow.returncode == 0, follow.stderr
    assert follow.stdout.strip() != run_id  # a new drive, not the stopped one


def test_stopping_a_drive_stops_the_drives_of_its_wave(cluster: Cluster) -> None:
    agent_cmd = setup_pilot(cluster, decomposition=THREE, sleep={"implement": 60})
    cluster.start_worker("w1", concurrency=3)
    run_id = start_wave(cluster, agent_cmd)

    def three_started() -> list[dict[str, Any]] | None:
        found = [e for e in entries(cluster, "started.log") if e["phase"] == "implement"]
        return found if len(found) == 3 else None

    subs = wait_for("the wave's three turns", three_started)
    assert placement(cluster, run_id)[0] == "parked"  # waiting for its sub-tasks
    done = cluster.cli("stop", run_id)
    assert done.returncode == 0, done.stderr
    children = [r for (r,) in cluster.query("SELECT id FROM runs WHERE parent_id = %s", run_id)]
    assert len(children) == 3
    for child in (run_id, *children):
        wait_for(f"{child} stopped", lambda c=child: placement(cluster, c)[0] == "stopped")
    for entry in subs:
        wait_for("the sub-task's agent gone", lambda e=entry: not _alive(e["pid"]), within=10)
    assert cluster.status(run_id) == "stopped"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def test_a_dead_workers_drive_goes_on_on_another_worker(cluster: Cluster) -> None:
    agent_cmd = setup_pilot(cluster, stall_once={"research": str(cluster.tmp / "stalled")})
    first = cluster.start_worker("w1", concurrency=1)
    run_id = start_drive(cluster, agent_cmd)
    started = wait_for("the research turn on w1", lambda: entries(cluster, "started.log"))
    assert started[0]["worker"] == "w1"
    cluster.start_worker("w2", concurrency=1)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(timeout=10)

    wait_for("the drive parked on w2", lambda: parked_at(cluster, run_id, "t1", "research"))
    assert placement(cluster, run_id)[1] == "w2"
    log = entries(cluster)
    assert [(e["phase"], e["worker"]) for e in log] == [("research", "w2")]
    assert log[0]["session"] != started[0]["session"]  # a new session, told why
    assert log[0]["cwd"].startswith(str(cluster.tmp / "w2"))
    turns = cluster.query(
        "SELECT seq, attempt, state FROM turns WHERE run_id = %s ORDER BY id", run_id
    )
    assert turns == [(1, 1, "interrupted"), (1, 2, "finished")]
    wait_for("the cut-off agent gone", lambda: not _alive(started[0]["pid"]), within=10)
    assert ".turnstile/tasks/t1/research.md" in branch_files(cluster, run_id)


@pytest.mark.usefixtures("isolated_env")
async def test_autopilot_from_the_bot_runs_on_a_worker_and_its_gates_come_to_the_chat(
    cluster: Cluster,
) -> None:
    import asyncio

    from tests.fakes.bot_api import FakeBotApi
    from tests.fakes.bot_harness import APPROVER as BOT_APPROVER_ID
    from tests.fakes.bot_harness import CHAT, OPERATOR, bot_settings, running_bot

    assert BOT_APPROVER_ID == BOT_APPROVER
    agent_cmd = setup_pilot(cluster)
    # The chat's project is "default": the bot and the worker know it by that name.
    projects = f"default={cluster.remote}#main"
    cluster.env["TURNSTILE_PROJECTS"] = projects
    await asyncio.to_thread(cluster.start_worker, "w1", concurrency=1)
    bot_root = cluster.tmp / "bot"
    bot_root.mkdir()
    async with FakeBotApi() as api:
        settings = bot_settings(
            api,
            bot_root,
            database=cluster.url,
            execution="workers",
            projects=projects,
            agent_command=agent_cmd,
            workflow_file=cluster.tmp / "workflow.toml",
            worker_heartbeat=0.3,
            worker_timeout=2.0,
        )
        async with running_bot(api, settings):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/autopilot T1 build it")
            queued = await api.wait_for_message(lambda m: "is queued on the workers" in m.text)
            found = re.search(r"\(run (\S+)\)", queued.text)
            assert found is not None
            run_id = found.group(1)

            def gate_of(phase: str) -> Any:
                return lambda m: (
                    m.text.startswith("🛂 Gate: task T1") and f"phase {phase}" in m.text
                )

            gate = await api.wait_for_message(gate_of("research"), timeout=60)
            assert placement(cluster, run_id)[:2] == ("parked", "w1")
            approve = next(
                b["callback_data"] for b in gate.buttons if b["text"].endswith("Approve")
            )
            api.push_callback(
                chat_id=CHAT, user_id=BOT_APPROVER, data=approve, message_id=gate.message_id
            )
            # Approved in the chat: the drive goes on on the worker, to its next gate.
            await api.wait_for_message(gate_of("decomposition"), timeout=60)
            assert [(e["phase"], e["worker"]) for e in entries(cluster)] == [
                ("research", "w1"),
                ("decomposition", "w1"),
            ]
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"/stop {run_id}")
            await asyncio.to_thread(
                wait_for, "the drive stopped", lambda: placement(cluster, run_id)[0] == "stopped"
            )
