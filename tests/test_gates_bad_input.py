"""Bad input: decomposition blocks, sub-task names, a 1 GB artifact, CLI refusals and codes."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from engine.gates import AWAITING_APPROVAL, GateRefused, Refusal, parse_decomposition
from engine.gates.refusals import EXIT_AUDIT_FINDINGS, EXIT_VIOLATIONS
from tests.gates_support import (
    APPROVER,
    REPO,
    cli_env,
    gate_backend,  # noqa: F401 - the fixture
    make_settings,
    open_gates,
    run_cli,
)
from tests.support import wait_until


@pytest.mark.parametrize(
    ("text", "line", "problem"),
    [
        ("no block here\n", 1, "no ```subtasks block"),
        ("intro\n```subtasks\nwave 1: a\n", 2, "not closed"),
        ("```subtasks\nwave 1: a\nwave one: b\n```\n", 3, "expected 'wave N: name"),
        ("```subtasks\nwave 0: a\n```\n", 2, "start at 1"),
        ("```subtasks\nwave 1: a\n\nwave 2: a\n```\n", 4, "already declared on line 2"),
        ("```subtasks\n```\n\n```subtasks\n```\n", 4, "second"),
        ("```subtasks\nwave 1: ../escape\n```\n", 2, "'..'"),
        ("```subtasks\nwave 1: a/b\n```\n", 2, "path separator"),
        ("```subtasks\nwave 1: bell\x07name\n```\n", 2, "control characters"),
        ("```subtasks\nwave 1: x\x00\n```\n", 2, "control characters"),
        ("```subtasks\nwave 1: dot.name\n```\n", 2, "must be letters"),
        ("```subtasks\nwave 1: " + "a" * 65 + "\n```\n", 2, "at most 64"),
        # '--' joins a parent and a sub-task in workspace ids and branches (p--a--b).
        ("```subtasks\nwave 1: a--b\n```\n", 2, "contains '--'"),
    ],
)
def test_malformed_blocks_name_the_line(text: str, line: int, problem: str) -> None:
    with pytest.raises(GateRefused) as info:
        parse_decomposition(text)
    assert info.value.reason is Refusal.INVALID_ARTIFACT
    assert info.value.line == line
    assert problem in info.value.detail


def test_well_formed_block() -> None:
    decls = parse_decomposition(
        "# Plan\n\n```subtasks\n# comment\nwave 2: later - the end\n\nwave 1: first\n```\n"
    )
    assert [(d.name, d.wave, d.summary, d.line) for d in decls] == [
        ("later", 2, "the end", 5),
        ("first", 1, "", 7),
    ]
    assert parse_decomposition("```subtasks\n```\n") == ()


@pytest.mark.timeout(120)
def test_one_gigabyte_artifact_is_hashed_by_streaming(tmp_path: Path) -> None:
    """A sparse 1 GiB file hashed in a child process whose peak RSS must stay small."""
    big = tmp_path / "research.md"
    with big.open("wb") as fh:
        fh.truncate(1024**3)
    code = (
        "import resource, sys\n"
        "from pathlib import Path\n"
        "from engine.gates.hashing import sha256_file\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "digest = sha256_file(Path(sys.argv[1]))\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(digest, before, after)\n"
    )
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", code, str(big)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    digest, before_kib, after_kib = out[0], int(out[1]), int(out[2])
    # sha256 of 2**30 zero bytes.
    assert digest == "49bc20df15e412a64472421e13fe86ff1c5165e18b2afccf160d4dc19fe68a14"
    assert after_kib - before_kib < 16 * 1024  # grew by less than 16 MiB


@pytest.mark.timeout(240)
async def test_one_gigabyte_artifact_through_the_gate(tmp_path: Path) -> None:
    async with open_gates(make_settings(tmp_path)) as gates:
        task = await gates.init_task("big")
        with (task.folder / "research.md").open("wb") as fh:
            fh.truncate(1024**3)
        # Hashed by streaming, then refused: a gate keeps its artifact in the database,
        # which holds at most TURNSTILE_ARTIFACT_MAX_BYTES (16 MiB by default).
        with pytest.raises(GateRefused) as info:
            await gates.store.transition("big", f"research:{AWAITING_APPROVAL}")
        assert info.value.reason is Refusal.INVALID_ARTIFACT
        assert "1024.0 MiB, larger than the 16.0 MiB" in info.value.detail
        assert await gates.pending_gates() == []


async def _init(env: dict[str, str], *extra: str) -> None:
    rc, _, err = await run_cli("status", "--task", "t", "--init", *extra, env=env)
    assert rc == 0, err


@pytest.mark.usefixtures("gate_backend")
@pytest.mark.timeout(240)  # a dozen CLI processes: slow on a loaded machine
async def test_cli_refusals_have_distinct_codes(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, forbid_self_approval=True)
    env = cli_env(settings, {"TURNSTILE_FORBID_SELF_APPROVAL": "true"})
    folder = settings.tasks_root / "t"

    async def status(*args: str) -> tuple[int, str, str]:
        return await run_cli("status", *args, env=env)

    assert (await status("--task", "ghost"))[0] == Refusal.UNKNOWN_TASK.exit_code
    assert (await status("--task", "a/b", "--init"))[0] == Refusal.INVALID_NAME.exit_code
    await _init(env, "--by", str(APPROVER))
    assert (await status("--task", "t", "--init"))[0] == Refusal.TASK_EXISTS.exit_code
    assert (await status("--task", "t", "--transition", "deploy"))[0] == (
        Refusal.UNKNOWN_PHASE.exit_code
    )
    assert (await status("--task", "t", "--transition", "design"))[0] == (
        Refusal.ILLEGAL_TRANSITION.exit_code
    )
    gate = f"research:{AWAITING_APPROVAL}"
    assert (await status("--task", "t", "--transition", gate))[0] == (
        Refusal.MISSING_ARTIFACT.exit_code
    )
    (folder / "research.md").write_text("r")
    assert (await status("--task", "t", "--transition", "decomposition"))[0] == (
        Refusal.NOT_APPROVED.exit_code
    )
    (folder / "design.md").write_text("too early")
    rc, out, _ = await status("--task", "t", "--validate-folder", "--json")
    assert rc == EXIT_VIOLATIONS
    assert json.loads(out)["violations"][0]["kind"] == "out_of_order_artifact"
    assert (await status("--task", "t", "--transition", gate))[0] == (
        Refusal.FORBIDDEN_ARTIFACTS.exit_code
    )
    (folder / "design.md").unlink()
    assert (await status("--task", "t", "--approve", "--by", "43"))[0] == (
        Refusal.NOT_AWAITING.exit_code
    )
    assert (await status("--task", "t", "--transition", gate))[0] == 0
    assert (await status("--task", "t", "--approve", "--by", "5"))[0] == (
        Refusal.NOT_APPROVER.exit_code
    )
    assert (await status("--task", "t", "--approve", "--by", str(APPROVER)))[0] == (
        Refusal.SELF_APPROVAL.exit_code
    )
    rc, _, err = await status("--task", "t", "--approve", "--by", "43", "--sha256", "deadbeef")
    assert rc == Refusal.STALE_APPROVAL.exit_code
    assert "stale_approval" in err
    (folder / "research.md").write_text("changed after the gate opened")
    assert (await status("--task", "t", "--approve", "--by", "43"))[0] == (
        Refusal.STALE_APPROVAL.exit_code
    )
    rc, out, _ = await status("--task", "t", "--approve", "--by", "43", "--json")
    assert rc == 0
    assert json.loads(out)["outcome"] == "approved"
    rc, out, _ = await status("--task", "t", "--approve", "--by", "43")
    assert rc == 0
    assert "already_approved" in out
    assert (await status("--task", "t", "--transition", "decomposition"))[0] == 0
    (folder / ".state").write_text('{"task": "t", "phase": "complete"}')
    rc, out, _ = await status("--audit", "--json")
    assert rc == EXIT_AUDIT_FINDINGS
    assert {f["kind"] for f in json.loads(out)["findings"]} == {"state_mismatch"}
    rc, out, _ = await status("--list", "--json")
    assert rc == 0
    assert json.loads(out)[0]["task"]["phase"] == "decomposition"
    rc, out, _ = await status("--task", "t", "--json")
    shown = json.loads(out)
    assert shown["phase"] == "decomposition"
    assert [h["kind"] for h in shown["history"]] == [
        "init",
        "gate",
        "reopen",
        "approve",
        "transition",
    ]


@pytest.mark.usefixtures("gate_backend")
async def test_cli_reject_needs_reason_and_expiry_code(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    env = cli_env(settings, {"TURNSTILE_APPROVAL_EXPIRY_SECONDS": "0.01"})
    await _init(env)
    (settings.tasks_root / "t" / "research.md").write_text("r")
    rc, _, _ = await run_cli(
        "status", "--task", "t", "--transition", f"research:{AWAITING_APPROVAL}", env=env
    )
    assert rc == 0
    opened_by = time.time()  # the gate opened before the command returned
    rc, _, err = await run_cli("status", "--task", "t", "--reject", "--by", "42", env=env)
    assert rc == 2
    assert "--reason" in err
    # Past the 10 ms expiry on the wall clock the other process reads.
    await wait_until(lambda: time.time() > opened_by + 0.05, interval=0.005)
    rc, _, err = await run_cli("status", "--task", "t", "--approve", "--by", "42", env=env)
    assert rc == Refusal.EXPIRED.exit_code
    rc, out, _ = await run_cli(
        "status", "--task", "t", "--reject", "--by", "42", "--reason", "late, redo", env=env
    )
    assert rc == 0
    assert "rejected" in out


@pytest.mark.usefixtures("gate_backend")
async def test_sub_task_names_are_checked_when_created_directly(tmp_path: Path) -> None:
    async with open_gates(make_settings(tmp_path)) as gates:
        await gates.init_task("p")
        for name, problem in [
            ("p.a--b", "sub-task name 'a--b' contains '--'"),
            ("p.a.b", "sub-task name 'a.b' must be letters"),
            ("q.a", "must be 'p', '.', then its own name"),
        ]:
            with pytest.raises(GateRefused) as info:
                await gates.store.init_task(name, parent="p", wave=1)
            assert info.value.reason is Refusal.INVALID_NAME
            assert problem in str(info.value)
        assert (await gates.store.init_task("p.a-b", parent="p", wave=1)).parent == "p"


@pytest.mark.usefixtures("gate_backend")
async def test_oversized_decomposition_refused(tmp_path: Path) -> None:
    async with open_gates(make_settings(tmp_path)) as gates:
        task = await gates.init_task("t")
        (task.folder / "research.md").write_text("r")
        await gates.store.transition("t", f"research:{AWAITING_APPROVAL}")
        await gates.approve("t", by=APPROVER)
        await gates.store.transition("t", "decomposition")
        with (task.folder / "decomposition.md").open("wb") as fh:
            fh.write(b"```subtasks\n```\n")
            fh.truncate(2 * 1024 * 1024)
        with pytest.raises(GateRefused) as info:
            await gates.store.transition("t", f"decomposition:{AWAITING_APPROVAL}")
        assert info.value.reason is Refusal.INVALID_ARTIFACT
        assert "larger than" in info.value.detail


@pytest.mark.usefixtures("gate_backend")
async def test_a_phase_removed_from_the_workflow(tmp_path: Path) -> None:
    """An operator swaps the workflow while a task sits in a phase the new one lacks."""
    from engine.gates import HUMAN_INTERVENTION, FindingKind
    from tests.gates_support import EventSink

    settings = make_settings(tmp_path)
    async with open_gates(settings) as gates:
        task = await gates.init_task("t")
        (task.folder / "research.md").write_text("r")
        await gates.store.transition("t", f"research:{AWAITING_APPROVAL}")
    small = tmp_path / "wf.toml"
    small.write_text(
        '[phases.build]\npersona = "B"\napproval = false\nartifact = "b.md"\nprompt = "b"\n'
    )
    async with open_gates(make_settings(tmp_path, workflow_file=small)) as gates:
        result = await gates.approve("t", by=APPROVER)
        assert result.reason is Refusal.UNKNOWN_PHASE
        with pytest.raises(GateRefused) as info:
            await gates.store.transition("t", "build")
        assert info.value.reason is Refusal.UNKNOWN_PHASE
        report = await gates.audit()
        assert FindingKind.UNKNOWN_PHASE in {f.kind for f in report.findings}
        assert await gates.pending_gates() == []
        handle = gates.start_autopilot("t", EventSink(), tool="command")
        assert (await handle.wait()).value == HUMAN_INTERVENTION
        moved = await gates.store.transition("t", "build")
        assert moved.phase == "build"
