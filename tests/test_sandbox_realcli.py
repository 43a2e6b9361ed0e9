"""The real agent CLIs in the sandbox: their shell tool finds no control plane.

Each pinned CLI (Claude Code, Copilot, Codex) runs a turn inside the walls turnstile
makes for it (``Sandbox.walls``), against the fake model API. Its shell tool tries to
read the database in the test's control folder, which is not there; it writes a file in
its worktree, which lands. (The hostile suite, tests/test_sandbox.py, tries the rest.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.agents.allowlist import ToolAllowlist
from tests.agent_clis import ensure_cli
from tests.agent_contract import PROFILES, Profile, make_agent
from tests.fakes.model_api import FakeModelAPI, Text
from tests.fakes.realcli import Sandbox

pytestmark = [pytest.mark.realcli, pytest.mark.timeout(300)]


@pytest.fixture(scope="module", params=PROFILES, ids=[p.name for p in PROFILES])
def profile(request: pytest.FixtureRequest) -> Profile:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def binary(profile: Profile) -> Path:
    return ensure_cli(profile.name)


async def test_the_shell_tool_of_a_real_cli_finds_no_control_plane(
    profile: Profile, binary: Path, model_api: FakeModelAPI, sandbox: Sandbox
) -> None:
    database = sandbox.control / "turnstile.db"
    database.write_bytes(b"SQLite format 3\x00 the store")
    # A relative path: Copilot's own check refuses absolute ones outside its folder (not
    # this one: the walls are what stops it).
    command = (
        "echo inside > inside.txt && echo wrote-inside; "
        "cat ../control/turnstile.db || echo no-database"
    )
    model_api.enqueue(profile.shell(command), Text("done"))
    # Every tool allowed: the CLI's own checks stand aside, the walls still hold.
    everything = ToolAllowlist.from_flags([], dangerous=True)
    agent = make_agent(profile, binary, model_api, sandbox, allowlist=everything)
    out = await agent.run_turn("look around")
    assert out.exit_code == 0, out.metadata
    assert out.text == "done"
    tool_result = model_api.model_requests[1].conversation()[-1]
    assert tool_result[0] == "tool_result"
    shown = tool_result[1]
    assert "the store" not in shown
    assert "no-database" in shown
    assert "wrote-inside" in shown
    assert (sandbox.workspace / "inside.txt").read_text() == "inside\n"
