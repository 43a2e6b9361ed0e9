"""The agent's walls: a hostile agent reaches nothing of the control plane.

A real bot (in-process, against the fake Bot API) runs a chat turn of
``tests/hostile_agent.py`` in the sandbox, on SQLite and on PostgreSQL (a role that
must give its password, as in production). The agent knows every path and id; it tries
to read the database, ``.env``, a sibling run's file, to write outside its folders, to
signal and inspect the bot, to reach PostgreSQL's socket, to approve an open gate with
the ``turnstile`` CLI and to decide a tool request in the store. Every attempt fails, and
its real work (a file written and committed in its worktree) lands.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.approvals import Decision, SqliteApprovalStore
from engine.sandbox import Walls, control_plane_paths, walls_for
from engine.settings import Settings
from engine.store.location import PostgresURL
from tests.automode_support import GIT_ENV, git_workspace
from tests.conftest import REPO
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import APPROVER, CHAT, OPERATOR, bot_settings, running_bot
from tests.gates_support import cli_env, run_cli
from tests.pg_support import PASSWORD, PASSWORD_ROLE, PgCluster
from tests.support import make_settings, wait_until

HOSTILE = REPO / "tests" / "hostile_agent.py"
ATTACKS = {
    "read_database",
    "read_env_file",
    "read_sibling",
    "write_outside",
    "signal_bot",
    "list_bot_proc",
    "pg_socket",
    "approve_gate",
    "decide_tool",
    "settings_in_env",
}
_NAMES = itertools.count()

pytestmark = pytest.mark.usefixtures("isolated_env")


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Where the bot keeps its state: a SQLite file in the test's folder, or a PostgreSQL
    database whose role logs in with a password (nothing else gets in over TCP)."""
    if request.param == "sqlite":
        yield {"database": tmp_path / "state" / "turnstile.db", "socket": None}
        return
    cluster: PgCluster = request.getfixturevalue("pg_cluster")
    name = f"sbx_{os.getpid()}_{next(_NAMES)}"
    cluster.admin(f'CREATE DATABASE "{name}" OWNER "{PASSWORD_ROLE}" TEMPLATE template0')
    url = cluster.url(name, user=PASSWORD_ROLE, password=PASSWORD)
    socket = str(Path(cluster.folder) / f".s.PGSQL.{cluster.port}")
    yield {"database": url, "socket": socket}
    cluster.admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _report(workdir: Path) -> dict[str, dict[str, Any]]:
    report: dict[str, dict[str, Any]] = json.loads((workdir / "hostile-report.json").read_text())
    return report


@pytest.mark.timeout(180)
async def test_a_hostile_agent_in_a_chat_reaches_nothing_of_the_control_plane(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: dict[str, Any]
) -> None:
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    repo = git_workspace(tmp_path / "origin")
    # Beside the test (the host's /tmp: the sandbox has its own) and in the real home
    # (read-only inside), the write must reach neither.
    outside = [tmp_path / "outside.txt", Path.home() / f".hostile-was-here-{os.getpid()}"]
    sibling = tmp_path / "ws" / "worktrees" / "web" / "another-run" / "notes.txt"
    sibling.parent.mkdir(parents=True)
    sibling.write_text("another run's work\n")
    async with FakeBotApi() as api:
        # The bot's .env (the composition root reads it from its working folder).
        (tmp_path / ".env").write_text(f"TURNSTILE_TELEGRAM_TOKEN={api.token}\n")
        settings = bot_settings(
            api,
            tmp_path,
            database=backend["database"],
            projects=f"web={repo}",
            sandbox="on",
            agent_env=("FAKE_*",),
            agent_command=f"{sys.executable} {HOSTILE} {{prompt}}",
        )
        cli = cli_env(settings)
        assert (await run_cli("status", "--task", "g1", "--init", env=cli))[0] == 0
        (settings.tasks_root / "g1" / "research.md").write_text("# research\n")
        rc, _, err = await run_cli(
            "status", "--task", "g1", "--transition", "research:awaiting_approval", env=cli
        )
        assert rc == 0, err
        async with running_bot(api, settings) as rt:
            request = await SqliteApprovalStore(rt.db).open_request(
                "someone-else", "Bash", {"command": "rm -rf /srv"}
            )
            database = settings.database
            where = (
                database.without_password()
                if isinstance(database, PostgresURL)
                else str(database.resolve())
            )
            targets = {
                "database": where,
                "env_file": str(tmp_path / ".env"),
                "token": api.token,
                "sibling": str(sibling),
                "outside": [str(p) for p in outside],
                "bot_pid": os.getpid(),
                "pg_socket": backend["socket"],
                "task": "g1",
                "tasks_root": str(settings.tasks_root.resolve()),
                "approver": APPROVER,
                "request_id": request.id,
                "repo": str(REPO),
            }
            monkeypatch.setenv("FAKE_HOSTILE", json.dumps(targets))
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat command web")
            await api.wait_for_message(lambda m: "bound" in m.text)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="go")
            reply = await api.wait_for_message(lambda m: m.text.startswith("attempts:"), 120)
            assert reply.text == f"attempts: {len(ATTACKS)}; held: {len(ATTACKS)}; work committed"
            binding = await rt.store.binding(str(CHAT), None)
            assert binding is not None
            workdir = Path(binding.workdir)
            # Nothing was decided behind the people's backs.
            still = await SqliteApprovalStore(rt.db).get(request.id)
            assert still.state is Decision.PENDING
        rc, out, err = await run_cli("status", "--task", "g1", "--json", env=cli)
        assert rc == 0, err
        shown = json.loads(out)
        assert shown["history"][-1]["to"] == "research:awaiting_approval"
        assert shown["approvals"] == [] or not shown["approvals"], shown.get("approvals")
    report = _report(workdir)
    assert set(report) == ATTACKS
    # Writes are judged on the host (below): inside, /tmp is the sandbox's own.
    assert {n: r for n, r in report.items() if r["got_in"] and n != "write_outside"} == {}
    assert str(outside[1]) not in report["write_outside"]["detail"]  # read-only inside
    # What each wall answered (the agent's view).
    if backend["socket"] is None:
        assert "No such file" in report["read_database"]["detail"]
        assert (
            "No such file" in report["decide_tool"]["detail"]
            or "unable to open" in (report["decide_tool"]["detail"])
        )
    else:
        assert "No such file" in report["pg_socket"]["detail"]
        assert "password" in report["decide_tool"]["detail"]
    assert "No such file" in report["read_sibling"]["detail"]
    assert "No such process" in report["signal_bot"]["detail"]
    assert "No such file" in report["list_bot_proc"]["detail"]
    assert not any(p.exists() for p in outside)
    # The turn itself worked: its file is committed on the run's branch.
    log = subprocess.run(
        ["git", "log", "-1", "--format=%s", "--", "work.txt"],
        cwd=workdir,
        capture_output=True,
        text=True,
        check=True,
    )
    assert log.stdout.strip() == "hostile agent's work"
    assert (workdir / "work.txt").read_text() == "done\n"


# -- the walls themselves -------------------------------------------------------------


def _settings(tmp_path: Path, **overrides: Any) -> Settings:
    return make_settings(tmp_path / "ctl", sandbox="on", **overrides)


def test_the_control_plane_is_hidden_and_the_worktree_shown_again(tmp_path: Path) -> None:
    settings = _settings(tmp_path, sandbox_hide=(tmp_path / "keys",))
    worktree = settings.workspaces / "worktrees" / "web" / "r1"
    worktree.mkdir(parents=True)
    home = tmp_path / "home"
    home.mkdir()
    walls = walls_for(settings, cwd=worktree, home=home)
    assert isinstance(walls, Walls)
    hidden = control_plane_paths(settings)
    for path in (
        settings.database.resolve(),  # type: ignore[union-attr]
        settings.tasks_root.resolve(),
        settings.workspaces.resolve(),
        (tmp_path / "keys").resolve(),
    ):
        assert path in hidden
    argv = walls.wrap(["true"], worktree)
    # The worktree is bound back after the workspaces root is hidden.
    assert argv.index(str(settings.workspaces.resolve())) < argv.index(str(worktree.resolve()))
    assert ["--bind", str(worktree.resolve()), str(worktree.resolve())] == argv[
        argv.index(str(worktree.resolve())) - 1 : argv.index(str(worktree.resolve())) + 2
    ]
    assert "--unshare-pid" in argv
    assert "--die-with-parent" in argv
    assert "--unshare-net" not in argv
    assert argv[-2:] == ["--", "true"]
    if os.geteuid() == 0:
        assert argv[argv.index("--cap-drop") + 1] == "ALL"
    off = walls_for(_settings(tmp_path, sandbox_network=False), cwd=worktree)
    assert off is not None
    assert "--unshare-net" in off.wrap(["true"])


def test_with_the_sandbox_off_there_are_no_walls(tmp_path: Path) -> None:
    assert walls_for(make_settings(tmp_path, sandbox="off"), cwd=tmp_path) is None


def test_without_bwrap_agents_refuse_to_start_and_say_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.agents.factory import create_agent
    from engine.sandbox import SandboxUnavailable

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    settings = _settings(tmp_path, agent_command="echo {prompt}")
    with pytest.raises(
        SandboxUnavailable, match=r"bwrap\) is not installed.*TURNSTILE_SANDBOX=off"
    ):
        create_agent("command", settings, cwd=tmp_path)


async def test_a_turn_in_the_walls_writes_its_worktree_and_its_children_die_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real turn through the command agent: its own PID namespace, a private /tmp, the
    worktree writable, the rest read-only; a process it leaves behind dies with it."""
    from engine.agents.factory import create_agent

    settings = _settings(tmp_path, agent_command="sh -c {prompt}")
    worktree = tmp_path / "wt"
    worktree.mkdir()
    probe = tmp_path / "host-only"  # beside the worktree, in the host's /tmp
    probe.write_text("the host's /tmp\n")
    script = (
        f"echo mine > mine.txt; echo pid=$$; cat {probe} 2>/dev/null | wc -l; "
        f"touch {REPO}/.sandbox-probe 2>/dev/null || echo read-only; "
        "(sleep 600 &) ; echo left-a-sleeper"
    )
    agent = create_agent("command", settings, cwd=worktree)
    out = await agent.run_turn(script)
    assert out.exit_code == 0, out.metadata
    lines = out.text.split()
    assert "pid=2" in lines or "pid=1" in lines  # the first processes of its own namespace
    assert lines[1] == "0"  # its /tmp is its own: the host's files are not in it
    assert "read-only" in lines
    assert (worktree / "mine.txt").read_text() == "mine\n"
    assert not (REPO / ".sandbox-probe").exists()

    def sleepers() -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if cmd == b"sleep\x00600\x00":
                found.append(int(entry))
        return found

    await wait_until(lambda: not sleepers(), timeout=20, what="the sleeper dies with the turn")


# -- where the sandbox cannot be had --------------------------------------------------


async def test_without_user_namespaces_the_bot_refuses_agents_and_status_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bwrap that cannot make a namespace (a kernel or container that forbids them): the
    chat's turn is refused with the fix, /status says agents cannot start; with the sandbox
    turned off explicitly, /status says agents run unconfined."""
    fake = tmp_path / "bin" / "bwrap"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, sandbox="on")
        async with running_bot(api, settings):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
            await api.wait_for_message(lambda m: "bound" in m.text)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="hello")
            failed = await api.wait_for_message(lambda m: "could not start" in m.text)
            assert "sandbox" in failed.text
            assert "No permissions to create new namespace" in failed.text
            assert "TURNSTILE_SANDBOX=off" in failed.text
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
            status = await api.wait_for_message(lambda m: "Agents cannot start here" in m.text)
            assert "turnstile doctor" in status.text
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path / "off", sandbox="off")
        async with running_bot(api, settings):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
            await api.wait_for_message(lambda m: "Agents run unconfined here" in m.text)


async def test_the_verify_command_runs_in_the_agents_walls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Auto mode's verify command runs code the agent wrote (its tests): inside the
    agent's walls, with the agent's environment, never this process's settings."""
    from engine.agents.factory import create_agent
    from engine.automode import CompletionVerifier, Verdict
    from engine.automode.run import _verifier_env

    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TURNSTILE_DATABASE", "/somewhere/turnstile.db")
    settings = _settings(tmp_path, agent_command="sh -c {prompt}")
    settings.database.parent.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
    settings.database.write_text("the store")  # type: ignore[union-attr]
    repo = git_workspace(tmp_path / "wt")
    agent = create_agent("command", settings, cwd=repo)
    check = (
        f"cat {settings.database} || echo hidden; "
        "env | grep '^TURNSTILE_' | grep -vc '^TURNSTILE_TURN_ID=' || true; "
        "echo ok > verified.txt"
    )
    verifier = CompletionVerifier(
        repo,
        base_commit=None,
        verify_cmd=["sh", "-c", check],
        walls=agent.options.walls,
        env=_verifier_env(agent),
    )
    result = await verifier.verify(Verdict.COMPLETE)
    [evidence] = [e for e in result.evidence if e.name == "verify_cmd"]
    assert evidence.value == 1.0, evidence.detail
    assert "the store" not in evidence.detail
    assert "hidden | 0" in evidence.detail
    assert (repo / "verified.txt").read_text() == "ok\n"


async def test_the_agent_cannot_make_turnstiles_own_git_run_its_program(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """turnstile runs git in the worktree outside the walls (rescue commits, merges,
    pushes): a program named in the repository's config (a file-system monitor, a hook)
    would run there. Inside, the config, the hooks and the links to the repository are
    read-only, and a mount point cannot be moved out of the way."""
    from engine.agents.factory import create_agent
    from engine.git import GitRunner

    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    origin = git_workspace(tmp_path / "origin")
    worktree = tmp_path / "ctl" / "ws" / "worktrees" / "web" / "r1"
    worktree.parent.mkdir(parents=True)
    subprocess.run(
        ["git", "worktree", "add", "-q", "-b", "run", str(worktree)], cwd=origin, check=True
    )
    evil = tmp_path / "evil.sh"
    ran = tmp_path / "evil-ran"
    evil.write_text(f"#!/bin/sh\ntouch {ran}\n")
    evil.chmod(0o755)
    settings = _settings(tmp_path, agent_command="sh -c {prompt}")
    attacks = [
        f"git config core.fsmonitor {evil}",
        f"printf '[core]\\n\\tfsmonitor = {evil}\\n' >> {origin}/.git/config",
        f"mkdir -p {origin}/.git/hooks && cp {evil} {origin}/.git/hooks/post-checkout",
        "mv .git .git-moved",
        f"echo 'gitdir: {tmp_path}/fake' > .git",
        f"echo {tmp_path}/fake > $(sed 's/gitdir: //' .git)/commondir",
    ]
    script = "; ".join(f"{a} 2>/dev/null && echo 'got in: {a[:20]}'" for a in attacks)
    agent = create_agent("command", settings, cwd=worktree)
    out = await agent.run_turn(script + "; echo done")
    assert out.text.strip().splitlines() == ["done"], out.text
    git = GitRunner()
    await git.run(["status", "--porcelain"], cwd=worktree)
    await git.run(["checkout", "-q", "-b", "after"], cwd=worktree)
    assert not ran.exists()
    assert "fsmonitor" not in (origin / ".git" / "config").read_text()


async def test_a_stop_lets_the_agent_in_its_sandbox_save_before_it_ends(
    tmp_path: Path,
) -> None:
    """/stop asks the agent to end (SIGTERM), not the sandbox around it: an agent that
    saves its session on SIGTERM (Claude Code flushes its transcript) gets to; then
    nothing of the turn is left."""
    from engine.agents.factory import create_agent
    from engine.errors import TurnPreempted

    settings = _settings(tmp_path, agent_command="sh -c {prompt}")
    worktree = tmp_path / "wt"
    worktree.mkdir()
    script = (
        "trap 'sleep 1; echo saved > saved.txt; exit 0' TERM; "
        "echo started > started.txt; sleep 600 & wait"
    )
    agent = create_agent("command", settings, cwd=worktree)
    turn = asyncio.create_task(agent.run_turn(script))
    await wait_until(lambda: (worktree / "started.txt").exists(), what="the agent started")
    assert await agent.preempt.stop()
    with pytest.raises(TurnPreempted):
        await turn
    assert (worktree / "saved.txt").read_text() == "saved\n"


def test_doctor_reports_the_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.commands.doctor import Status, check_sandbox

    on = check_sandbox(_settings(tmp_path))
    assert (on.status, on.name) == (Status.OK, "agent sandbox")
    assert "bubblewrap sandbox" in on.detail
    off = check_sandbox(make_settings(tmp_path, sandbox="off"))
    assert off.status is Status.WARN
    assert "unconfined" in off.detail
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    missing = check_sandbox(_settings(tmp_path))
    assert missing.status is Status.FAIL
    assert "not installed" in missing.detail
    assert missing.fix is not None
    assert "apt-get install bubblewrap" in missing.fix


@pytest.mark.parametrize("network", [True, False])
async def test_the_network_is_the_agents_unless_turned_off(tmp_path: Path, network: bool) -> None:
    import socket

    from engine.agents.factory import create_agent

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        probe = (
            "import socket\ntry:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), 5)\n    print('reached')\n"
            "except OSError:\n    print('cut-off')\n"
        )
        agent_command = f"{sys.executable} -c {{prompt}}"
        settings = _settings(tmp_path, agent_command=agent_command, sandbox_network=network)
        worktree = tmp_path / "wt"
        worktree.mkdir(exist_ok=True)
        out = await create_agent("command", settings, cwd=worktree).run_turn(probe)
    assert out.text.strip() == ("reached" if network else "cut-off")
