"""``turnstile status`` speaks plainly: help without internal references, refusals once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.gates_support import APPROVER, cli_env, gate_backend, make_settings, run_cli  # noqa: F401

pytestmark = [pytest.mark.usefixtures("isolated_env"), pytest.mark.timeout(120)]


@pytest.mark.parametrize("command", ["status", "auto", "autopilot"])
async def test_help_names_no_internal_documents(tmp_path: Path, command: str) -> None:
    rc, out, err = await run_cli(command, "--help", env=cli_env(make_settings(tmp_path)))
    assert rc == 0, err
    assert "seed" not in out.lower()


async def test_every_status_verb_has_help(tmp_path: Path) -> None:
    rc, out, _ = await run_cli("status", "--help", env=cli_env(make_settings(tmp_path)))
    assert rc == 0
    flat = " ".join(out.split())
    assert "--transition PHASE[:awaiting_approval] move the task to PHASE by hand" in flat


@pytest.mark.usefixtures("gate_backend")
async def test_a_refusal_is_said_once(tmp_path: Path) -> None:
    env = cli_env(make_settings(tmp_path))
    assert (await run_cli("status", "--task", "t", "--init", env=env))[0] == 0
    # approving a task with no open gate is refused: one line on stderr, nothing on stdout
    rc, out, err = await run_cli("status", "--task", "t", "--approve", "--by", "42", env=env)
    assert rc != 0
    assert out == ""
    assert err.count("refused") == 1, err
    # with --json: the JSON on stdout, no second copy on stderr
    rc, out, err = await run_cli(
        "status", "--task", "t", "--approve", "--by", "42", "--json", env=env
    )
    assert rc != 0
    assert json.loads(out)["reason"]
    assert "refused" not in err
    # a refused transition, both ways
    rc, out, err = await run_cli("status", "--task", "t", "--transition", "referee", env=env)
    assert rc != 0
    assert out == ""
    assert err.count("refused") == 1, err
    rc, out, err = await run_cli(
        "status", "--task", "t", "--transition", "referee", "--json", env=env
    )
    assert rc != 0
    assert json.loads(out)["refused"]
    assert err == ""


@pytest.mark.usefixtures("gate_backend")
async def test_show_through_the_facade(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    env = cli_env(settings)
    assert (await run_cli("status", "--task", "t", "--init", env=env))[0] == 0
    task_dir = settings.tasks_root / "t"
    (task_dir / "research.md").write_text("# research\n")
    rc, _, err = await run_cli(
        "status", "--task", "t", "--transition", "research:awaiting_approval", env=env
    )
    assert rc == 0, err
    rc, out, err = await run_cli("status", "--task", "t", "--json", env=env)
    assert rc == 0, err
    shown = json.loads(out)
    assert shown["history"][-1]["to"] == "research:awaiting_approval"
    assert "--approve" in shown["next_step"]
    rc, out, err = await run_cli("status", "--task", "t", env=env)
    assert rc == 0, err
    assert "approvals 0/1" in out
    assert (await run_cli("status", "--task", "t", "--approve", "--by", str(APPROVER), env=env))[
        0
    ] == 0


@pytest.mark.usefixtures("gate_backend")
async def test_list_and_audit_on_either_database(tmp_path: Path) -> None:
    env = cli_env(make_settings(tmp_path))
    for args in (["--task", "p"], ["--task", "p.a", "--parent", "p", "--wave", "1"]):
        rc, _, err = await run_cli("status", *args, "--init", env=env)
        assert rc == 0, err
    rc, out, err = await run_cli("status", "--list", env=env)
    assert rc == 0, err
    assert [line.split()[0] for line in out.splitlines() if line.strip()][:1] == ["p"]
    assert "p.a" in out
    rc, out, err = await run_cli("status", "--list", "--json", env=env)
    assert rc == 0, err
    assert "p.a" in out
    rc, out, err = await run_cli("status", "--audit", env=env)
    assert rc == 0, err
    assert "2 tasks, no findings" in out
