"""Codex's own sandbox runs the model's shell commands, and keeps them in bounds.

Codex (0.171.0) runs each command as ``bwrap ... -- codex-linux-sandbox ...``. With a
system bubblewrap on PATH that lacks ``--argv0`` (Debian 12's 0.8.0) it finds that helper
through aliases it will not make when ``CODEX_HOME`` is under ``/tmp``, as every test's
is; then each command fails with ``bwrap: execvp codex-linux-sandbox: No such file or
directory``, told only to the model, and the turn succeeds having run nothing
(:func:`engine.agents.codex.codex_tmpdir_redirect`). These cases hold whatever bubblewrap
the machine has (a system one, old or new, or none: Codex's bundled copy), in both turn
modes (``codex exec`` and the resident ``codex app-server``), and inside an outer
bubblewrap sandbox like the one turnstile puts around every agent turn.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from engine.agents.allowlist import ToolAllowlist
from engine.agents.base import AgentOptions, Invocation
from engine.agents.codex import CodexAgent, TmpdirRedirect, codex_tmpdir_redirect
from engine.agents.warm import WarmPool
from engine.agents.warm_codex import WarmCodexAgent, codex_warm_support
from engine.turn import TurnOutput
from tests.agent_clis import REPO, ensure_cli
from tests.fakes.model_api import FakeModelAPI, Text, ToolCall
from tests.fakes.realcli import Sandbox

SHELL = ToolAllowlist.from_flags(["bash"])
READ_ONLY = ToolAllowlist.read_only_default()
# How a command that never got into Codex's sandbox reads to the model: bubblewrap's own
# error ("bwrap: execvp codex-linux-sandbox: ...", "bwrap: setting up uid map: ...").
HELPER_FAILURE = "bwrap:"


# -- where Codex's TMPDIR goes -----------------------------------------------------------


def test_a_codex_home_in_the_temp_dir_moves_codex_tmpdir_into_it(tmp_path: Path) -> None:
    home = tmp_path / "cfg" / ".codex"
    home.mkdir(parents=True)
    redirect = codex_tmpdir_redirect({"CODEX_HOME": str(home), "TMPDIR": str(tmp_path)})
    assert redirect == TmpdirRedirect(codex=str(home.resolve() / "tmp"), tools=str(tmp_path))
    # No TMPDIR: Codex's temp dir is /tmp.
    redirect = codex_tmpdir_redirect({"CODEX_HOME": "/tmp/s1/cfg/.codex"})
    assert redirect == TmpdirRedirect(codex="/tmp/s1/cfg/.codex/tmp", tools="/tmp")


def test_a_codex_home_outside_the_temp_dir_needs_nothing() -> None:
    assert codex_tmpdir_redirect({"CODEX_HOME": "/var/lib/turnstile/cfg/.codex"}) is None
    assert codex_tmpdir_redirect({"HOME": "/home/someone"}) is None
    assert codex_tmpdir_redirect({"CODEX_HOME": "/tmpfoo/.codex"}) is None  # not below /tmp
    # Codex's temp dir is $TMPDIR when set: /tmp is then just another folder.
    assert codex_tmpdir_redirect({"CODEX_HOME": "/tmp/x/.codex", "TMPDIR": "/scratch"}) is None
    assert codex_tmpdir_redirect({}) is None


def test_the_temp_dir_is_tmpdir_when_set_and_home_falls_back_to_home() -> None:
    redirect = codex_tmpdir_redirect({"CODEX_HOME": "/scratch/s1/.codex", "TMPDIR": "/scratch"})
    assert redirect == TmpdirRedirect(codex="/scratch/s1/.codex/tmp", tools="/scratch")
    redirect = codex_tmpdir_redirect({"HOME": "/tmp/h"})
    assert redirect == TmpdirRedirect(codex="/tmp/h/.codex/tmp", tools="/tmp")


def test_the_redirect_goes_to_the_codex_process_and_the_commands_keep_theirs(
    tmp_path: Path,
) -> None:
    config = tmp_path / "config"
    (config / ".codex").mkdir(parents=True)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    agent = CodexAgent(
        AgentOptions(
            binary="codex",
            cwd=workspace,
            config_dir=config,
            extra_env={"TMPDIR": str(tmp_path)},
            allowlist=SHELL,
        )
    )
    codex_tmp = str((config / ".codex").resolve() / "tmp")
    assert agent.codex_config_args() == [
        "-c",
        f"shell_environment_policy.set.TMPDIR={json.dumps(str(tmp_path))}",
    ]
    assert agent.codex_config_args()[1] in agent.turn_argv("codex")
    env = agent.environment(Invocation(argv=[]))
    assert env["TMPDIR"] == codex_tmp
    assert Path(codex_tmp).is_dir()
    warm = WarmCodexAgent(agent.options)
    assert agent.codex_config_args()[1] in warm.server_argv("codex")
    elsewhere = CodexAgent(
        AgentOptions(
            binary="codex",
            cwd=workspace,
            config_dir=config,
            extra_env={"TMPDIR": "/nonexistent-temp"},
            allowlist=SHELL,
        )
    )
    assert elsewhere.codex_config_args() == []
    assert elsewhere.environment(Invocation(argv=[]))["TMPDIR"] == "/nonexistent-temp"


# -- the real CLI ----------------------------------------------------------------------

MODES = ("exec", "app-server")


@pytest.fixture(scope="session")
def codex_bin() -> Path:
    return ensure_cli("codex")


@pytest.fixture
def outside() -> Iterator[Path]:
    """A folder outside the workspace and the temp dirs Codex lets commands write."""
    base = Path("/var/tmp")
    if not base.is_dir():
        base = REPO / ".cache"
        base.mkdir(exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="turnstile-codex-outside-", dir=base))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
async def pool() -> AsyncIterator[WarmPool]:
    async with WarmPool(max_sessions=2) as warm:
        yield warm


def _options(
    binary: Path, api: FakeModelAPI, sandbox: Sandbox, allowlist: ToolAllowlist
) -> AgentOptions:
    return AgentOptions(
        binary=str(binary),
        cwd=sandbox.workspace,
        config_dir=sandbox.config,
        extra_env=sandbox.env(api.codex_env(sandbox.config)),
        allowlist=allowlist,
    )


async def _run(
    mode: str,
    options: AgentOptions,
    api: FakeModelAPI,
    pool: WarmPool,
    command: str,
    codex_bin: Path,
) -> tuple[TurnOutput, str]:
    """One turn whose model runs ``command``; the turn and the command's output as the
    model got it back."""
    api.enqueue(ToolCall("exec_command", {"cmd": command}), Text("done"))
    if mode == "exec":
        out = await CodexAgent(options).run_turn("run it")
    else:
        support = codex_warm_support(str(codex_bin))
        out = await WarmCodexAgent(options, pool=pool, support=support).run_turn("run it")
    assert out.exit_code == 0, out.text
    assert out.text == "done"
    role, item = api.model_requests[1].conversation()[-1]
    assert role == "tool_result"
    output = json.loads(item)["output"]
    assert isinstance(output, str)
    return out, output


def _command(outside: Path) -> str:
    return (
        "echo TMPDIR=$TMPDIR; mktemp >/dev/null && echo tmp-ok;"
        f" printf ok > made.txt; printf no > {outside}/escaped.txt; true"
    )


@pytest.mark.realcli
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", MODES)
async def test_workspace_write_writes_the_workspace_and_nothing_outside(
    mode: str,
    codex_bin: Path,
    model_api: FakeModelAPI,
    sandbox: Sandbox,
    pool: WarmPool,
    outside: Path,
) -> None:
    options = _options(codex_bin, model_api, sandbox, SHELL)
    out, output = await _run(mode, options, model_api, pool, _command(outside), codex_bin)
    assert HELPER_FAILURE not in output, output
    assert (sandbox.workspace / "made.txt").read_text() == "ok", output
    assert not (outside / "escaped.txt").exists()
    assert "Read-only file system" in output
    # The commands keep a temp dir of their own, writable, not Codex's own in its home.
    assert "tmp-ok" in output, output
    [line] = [ln for ln in output.splitlines() if ln.startswith("TMPDIR=")]
    assert not Path(line.removeprefix("TMPDIR=")).is_relative_to(sandbox.config)
    assert out.metadata["tool_calls"] == 1


@pytest.mark.realcli
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", MODES)
async def test_read_only_writes_nothing(
    mode: str,
    codex_bin: Path,
    model_api: FakeModelAPI,
    sandbox: Sandbox,
    pool: WarmPool,
    outside: Path,
) -> None:
    options = _options(codex_bin, model_api, sandbox, READ_ONLY)
    _, output = await _run(mode, options, model_api, pool, _command(outside), codex_bin)
    # The command ran (in the sandbox) and was refused, not lost on its way there.
    assert HELPER_FAILURE not in output, output
    assert "TMPDIR=" in output
    assert "Read-only file system" in output
    assert not (sandbox.workspace / "made.txt").exists()
    assert not (outside / "escaped.txt").exists()


def _bubblewrap(codex_bin: Path) -> str:
    """The system's bubblewrap, else the copy Codex's package bundles."""
    system = shutil.which("bwrap")
    if system is not None:
        return system
    [bundled, *_] = sorted(
        (codex_bin.parent.parent / "@openai").glob("codex-linux-*/vendor/*/codex-resources/bwrap")
    )
    return str(bundled)


# The outer sandboxes: as the agent's walls (the system read-only, a private /tmp, the
# worktree and the CLI's home writable), the second one also the way root can drop every
# capability and still let Codex nest its own: a user namespace with a non-zero uid. As
# uid 0 without CAP_SETFCAP (--cap-drop ALL, no user namespace) Codex's bubblewrap cannot
# map uid 0 into its user namespace (Linux 5.12 and later) and every command fails with
# "bwrap: setting up uid map: Operation not permitted".
OUTERS = {
    "plain": "--unshare-pid",
    "userns-no-caps": "--unshare-pid --unshare-ipc --unshare-uts --unshare-cgroup-try"
    " --unshare-user --uid 1000 --gid 1000 --cap-drop ALL",
}


@pytest.mark.realcli
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("allowlist", [SHELL, READ_ONLY], ids=["workspace-write", "read-only"])
@pytest.mark.parametrize("outer", list(OUTERS))
async def test_codex_sandbox_nests_inside_an_outer_bubblewrap_sandbox(
    outer: str,
    mode: str,
    allowlist: ToolAllowlist,
    codex_bin: Path,
    model_api: FakeModelAPI,
    sandbox: Sandbox,
    pool: WarmPool,
    outside: Path,
) -> None:
    workspace, config = sandbox.workspace, sandbox.config
    walls = sandbox.root / "walls"
    walls.mkdir()
    wrapper = walls / "codex"
    # The CLI's install is shown again (it may lie under the host's /tmp, which the outer
    # sandbox replaces with its own).
    install = codex_bin.parent.parent
    wrapper.write_text(
        "#!/bin/sh\n"
        f"exec {_bubblewrap(codex_bin)} --ro-bind / / --dev /dev --proc /proc --tmpfs /tmp"
        f" --ro-bind {install} {install}"
        f" --bind {workspace} {workspace} --bind {config} {config} {OUTERS[outer]}"
        f' --die-with-parent --chdir {workspace} -- {codex_bin} "$@"\n'
    )
    wrapper.chmod(0o755)
    options = _options(wrapper, model_api, sandbox, allowlist)
    _, output = await _run(mode, options, model_api, pool, _command(outside), codex_bin)
    assert HELPER_FAILURE not in output, output
    assert not (outside / "escaped.txt").exists()
    made = workspace / "made.txt"
    if allowlist is SHELL:
        assert made.read_text() == "ok", output
        assert "tmp-ok" in output, output
    else:
        assert not made.exists()
        assert "Read-only file system" in output
    assert os.path.isdir(config / ".codex" / "sessions")
