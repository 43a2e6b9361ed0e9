"""Gate artifacts in the database, content-addressed: stored once per content, bounded in
size, posted and shown from the database (the task folder may be on another machine), and
re-checked against the approved hash before a drive moves past the gate."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from bot.autopilot import AutopilotExtension
from chatfront.sink import ChatPlace
from engine.gates import (
    AWAITING_APPROVAL,
    ApprovalOutcome,
    DriveOutcome,
    GateRefused,
    Gates,
    Refusal,
)
from engine.gates.artifacts import SqlArtifactStore
from engine.sink import GateRequest
from engine.store.backend import AnyDatabase
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import CHAT, bot_settings, running_bot
from tests.gates_support import (
    AGENT_CMD,
    APPROVER,
    EventSink,
    agent_env,
    cli_env,
    gate_backend,  # noqa: F401 - the fixture
    make_settings,
    open_gates,
    phase_rules,
    run_cli,
    write_script,
)

GATE = f"research:{AWAITING_APPROVAL}"


async def _rows(db: AnyDatabase) -> list[tuple[str, int]]:
    return [
        (str(r[0]), int(r[1]))
        for r in await db.fetchall("SELECT sha256, size FROM gate_artifacts ORDER BY sha256")
    ]


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.usefixtures("gate_backend")
async def test_two_gates_with_the_same_content_share_one_row(tmp_path: Path) -> None:
    async with open_gates(make_settings(tmp_path)) as gates:
        body = "# Research\n\nthe same findings\n"
        for name in ("a", "b"):
            task = await gates.init_task(name)
            (task.folder / "research.md").write_text(body)
            opened = await gates.store.transition(name, GATE)
            assert opened.gate_sha256 == _sha(body)
        assert await _rows(gates.store.db) == [(_sha(body), len(body.encode()))]
        # A second round of the same content (rejected, then the gate again): still one row.
        rejected = await gates.reject("a", by=APPROVER, reason="look again")
        assert rejected.outcome is ApprovalOutcome.REJECTED
        again = await gates.store.transition("a", GATE)
        assert again.gate_round == 2
        assert len(await _rows(gates.store.db)) == 1
        # Approvals bind to that row's hash; other content is a row of its own.
        result = await gates.approve("a", by=APPROVER, expected_sha256=_sha(body)[:12])
        assert result.outcome is ApprovalOutcome.APPROVED
        assert result.sha256 == _sha(body)
        task = await gates.init_task("c")
        (task.folder / "research.md").write_text("other findings\n")
        await gates.store.transition("c", GATE)
        assert [s for s, _ in await _rows(gates.store.db)] == sorted(
            [_sha(body), _sha("other findings\n")]
        )
        store = SqlArtifactStore(gates.store.db)
        stored = await store.get(_sha(body))
        assert stored is not None
        assert stored.content == body.encode()
        assert await store.head(_sha(body), 10) == body.encode()[:10]
        assert await store.head(_sha("never stored"), 10) is None


@pytest.mark.usefixtures("gate_backend")
async def test_an_artifact_too_large_keeps_its_gate_shut(tmp_path: Path) -> None:
    async with open_gates(make_settings(tmp_path, artifact_max_bytes=1000)) as gates:
        task = await gates.init_task("t")
        (task.folder / "research.md").write_bytes(b"x" * 1001)
        with pytest.raises(GateRefused) as info:
            await gates.store.transition("t", GATE)
        assert info.value.reason is Refusal.INVALID_ARTIFACT
        assert "larger than" in info.value.detail
        assert "TURNSTILE_ARTIFACT_MAX_BYTES=1000" in info.value.detail
        assert (await gates.task("t")).sub_state is None
        assert await _rows(gates.store.db) == []
        # At the bound it opens.
        (task.folder / "research.md").write_bytes(b"x" * 1000)
        assert (await gates.store.transition("t", GATE)).awaiting_approval


@pytest.mark.usefixtures("gate_backend")
async def test_the_autopilot_hands_a_too_large_artifact_to_a_person(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in agent_env(tmp_path, write_script(tmp_path, {"rules": phase_rules()})).items():
        monkeypatch.setenv(key, value)
    async with open_gates(make_settings(tmp_path, artifact_max_bytes=8)) as gates:
        await gates.init_task("t")
        sink = EventSink()
        handle = gates.start_autopilot("t", sink, tool="command", agent_cmd=AGENT_CMD)
        assert await handle.wait() is DriveOutcome.HUMAN_INTERVENTION
        assert sink.gates == []
        said = "\n".join(sink.texts)
        assert "larger than the 8 bytes a gate keeps for review" in said
        assert "revision" in said or "still has problems" in said
        assert await _rows(gates.store.db) == []


@pytest.mark.usefixtures("gate_backend")
async def test_approved_then_edited_is_refused_and_asked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in agent_env(tmp_path, write_script(tmp_path, {"rules": phase_rules()})).items():
        monkeypatch.setenv(key, value)
    async with open_gates(make_settings(tmp_path)) as gates:
        await gates.init_task("t")
        first = EventSink()
        handle = gates.start_autopilot(
            "t", first, tool="command", agent_cmd=AGENT_CMD, wait_for_approval=False
        )
        assert await handle.wait() is DriveOutcome.PARKED
        [asked] = first.gates
        task = await gates.task("t")
        assert asked.sha256 == task.gate_sha256
        assert (await gates.approve("t", by=APPROVER)).outcome is ApprovalOutcome.APPROVED
        # Edited after the approval: moving past the gate is refused, the gate re-opens.
        artifact = task.folder / "research.md"
        artifact.write_text(artifact.read_text() + "\nedited after approval\n")
        with pytest.raises(GateRefused) as info:
            await gates.store.transition("t", "decomposition")
        assert info.value.reason is Refusal.STALE_APPROVAL
        reopened = await gates.task("t")
        assert reopened.awaiting_approval
        assert reopened.gate_sha256 == _sha(artifact.read_text())
        assert reopened.gate_round == task.gate_round + 1
        assert await gates.store.gate_approvals(reopened) == []
        stored = await gates.artifact(str(reopened.gate_sha256))
        assert stored is not None
        assert stored.content == artifact.read_bytes()
        # Approved again, edited again: the drive re-checks before it passes and asks again.
        assert (await gates.approve("t", by=APPROVER)).outcome is ApprovalOutcome.APPROVED
        artifact.write_text("edited once more\n")
        second = EventSink()
        handle = gates.start_autopilot(
            "t", second, tool="command", agent_cmd=AGENT_CMD, wait_for_approval=False
        )
        assert await handle.wait() is DriveOutcome.PARKED
        [asked_again] = second.gates
        assert asked_again.sha256 == _sha("edited once more\n")
        assert asked_again.excerpt == "edited once more\n"
        latest = await gates.task("t")
        assert latest.phase == "research"
        assert latest.gate_sha256 == _sha("edited once more\n")
        assert await gates.store.gate_approvals(latest) == []


@pytest.mark.usefixtures("gate_backend")
@pytest.mark.timeout(120)
async def test_approved_and_shown_without_the_task_folder(tmp_path: Path) -> None:
    """The approver's machine has no task folder (it is on a worker): the approval binds to
    the stored hash and ``turnstile status --artifact`` prints the stored content."""
    settings = make_settings(tmp_path)
    body = "# Research\n\nwritten on a worker\n"
    async with open_gates(settings) as gates:
        task = await gates.init_task("t")
        (task.folder / "research.md").write_text(body)
        await gates.store.transition("t", GATE)
        away = tmp_path / "on-the-worker"
        task.folder.rename(away)
        env = cli_env(settings)
        rc, out, err = await run_cli("status", "--task", "t", env=env)
        assert rc == 0, err
        assert f"artifact  {len(body)} bytes: turnstile status --task t --artifact" in out
        rc, out, err = await run_cli("status", "--task", "t", "--artifact", env=env)
        assert rc == 0, err
        assert out == body
        rc, out, err = await run_cli("status", "--task", "t", "--artifact", "--json", env=env)
        assert rc == 0, err
        shown = json.loads(out)
        assert (shown["artifact"], shown["sha256"], shown["content"]) == (
            "research.md",
            _sha(body),
            body,
        )
        result = await gates.approve("t", by=APPROVER, expected_sha256=_sha(body))
        assert result.outcome is ApprovalOutcome.APPROVED, result.detail
        # On the worker the file is checked against the approved hash, and it passes.
        shutil.copy(away / "research.md", task.folder / "research.md")
        assert (await gates.store.transition("t", "decomposition")).phase == "decomposition"
        rc, out, err = await run_cli(
            "status", "--task", "t", "--artifact", "--sha256", _sha(body)[:10], env=env
        )
        assert rc == 0, err
        assert out == body
        rc, _, err = await run_cli("status", "--task", "t", "--artifact", env=env)
        assert rc == Refusal.NOT_AWAITING.exit_code
        assert "no gate is open" in err


@pytest.mark.usefixtures("gate_backend")
async def test_a_gate_opened_before_artifacts_were_stored(tmp_path: Path) -> None:
    """A gate whose content is not in the database (opened by an older version): the
    approval stores it from the folder when the file still has the gate's hash."""
    async with open_gates(make_settings(tmp_path)) as gates:
        task = await gates.init_task("t")
        (task.folder / "research.md").write_text("older\n")
        await gates.store.transition("t", GATE)
        await gates.store.db.execute("DELETE FROM gate_artifacts")
        result = await gates.approve("t", by=APPROVER)
        assert result.outcome is ApprovalOutcome.APPROVED
        assert await _rows(gates.store.db) == [(_sha("older\n"), 6)]
        # Without the folder and without the row nothing can be approved.
        other = await gates.init_task("u")
        (other.folder / "research.md").write_text("gone\n")
        await gates.store.transition("u", GATE)
        await gates.store.db.execute(
            "DELETE FROM gate_artifacts WHERE sha256 = ?", (_sha("gone\n"),)
        )
        shutil.rmtree(other.folder)
        refused = await gates.approve("u", by=APPROVER)
        assert refused.reason is Refusal.MISSING_ARTIFACT
        assert "not in the database" in str(refused.detail)


@pytest.mark.timeout(90)
@pytest.mark.usefixtures("isolated_env", "bot_backend")
async def test_the_bot_posts_the_artifact_from_the_database(tmp_path: Path) -> None:
    """The gate was opened on another machine: the file is not on the bot's disk, and the
    document the bot posts is the stored content."""
    body = "# Research\n\nfindings from a worker\n"
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path)
        async with running_bot(api, settings) as rt:
            gates = Gates(rt.db, rt.settings)
            task = await gates.init_task("W1")
            (task.folder / "research.md").write_text(body)
            opened = await gates.store.transition("W1", GATE)
            shutil.rmtree(task.folder)
            assert rt.features is not None
            pilot = next(f for f in rt.features.extensions if isinstance(f, AutopilotExtension))
            request = GateRequest(
                task="W1",
                phase="research",
                artifact_name="research.md",
                artifact_path=task.folder / "research.md",
                sha256=str(opened.gate_sha256),
                excerpt=await gates.store.excerpt(opened.gate_sha256, 1500),
                run_id="autopilot-20250101-120000-a1b2c3",
            )
            await pilot.post_gate(request, ChatPlace(str(CHAT), None))
            doc = await api.wait_for_message(lambda m: m.filename == "research.md", timeout=30)
            assert doc.document == body.encode()
            gate = await api.wait_for_message(lambda m: m.text.startswith("🛂 Gate:"), timeout=30)
            assert "findings from a worker" in gate.text
            assert _sha(body)[:12] in gate.text
            # A gate whose content is not stored: nothing is attached, and the chat says so.
            missing = GateRequest(
                task="W1",
                phase="research",
                artifact_name="research.md",
                artifact_path=task.folder / "research.md",
                sha256=_sha("never stored"),
                excerpt="",
                run_id="autopilot-20250101-120000-a1b2c3",
            )
            await pilot.post_gate(missing, ChatPlace(str(CHAT), None))
            await api.wait_for_message(lambda m: "is not stored" in m.text, timeout=30)
            assert len([m for m in api.sent if m.filename == "research.md"]) == 1


def test_blob_columns_are_bytea_on_postgresql() -> None:
    from engine.store.dialect import postgres_ddl

    ddl = "CREATE TABLE a (content BLOB NOT NULL, note TEXT DEFAULT 'BLOB') -- a BLOB"
    assert postgres_ddl(ddl) == (
        "CREATE TABLE a (content BYTEA NOT NULL, note TEXT DEFAULT 'BLOB') -- a BLOB"
    )
