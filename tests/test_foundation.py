"""Settings, the CLI entry point, redaction, the store core and the layering rule."""

from __future__ import annotations

import ast
import asyncio
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import ConfigError, NotFoundError
from engine.redact import REDACTED, Redactor, redact, tail
from engine.settings import load_settings
from engine.store import Database, RunStatus, SqliteRunStore, TurnState
from engine.turn import TurnOutput
from tests.conftest import REPO
from tests.support import clean_env as _clean_env

TURNSTILE = [sys.executable, "-m", "engine.cli"]


def test_settings_parse_id_lists(isolated_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNSTILE_ADMINS", "1, 2,3")
    monkeypatch.setenv("TURNSTILE_ALLOWED_CHATS", "-100123")
    settings = load_settings()
    assert settings.admins == (1, 2, 3)
    assert settings.allowed_chats == (-100123,)
    assert settings.operators == ()  # empty admits nobody


def test_settings_errors_name_the_setting(
    isolated_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TURNSTILE_APPROVERS", "alice")
    with pytest.raises(ConfigError, match="TURNSTILE_APPROVERS"):
        load_settings()


def test_settings_read_dotenv(isolated_env: Path) -> None:
    (isolated_env / ".env").write_text("TURNSTILE_MAX_TURNS=7\nTURNSTILE_OPERATORS=5\n")
    settings = load_settings()
    assert settings.max_turns == 7
    assert settings.operators == (5,)


def test_secret_token_not_in_repr(isolated_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = "123456789:AAAbbbcccdddeeefffggghhhiiijjjkkklll"
    monkeypatch.setenv("TURNSTILE_TELEGRAM_TOKEN", token)
    settings = load_settings()
    assert token not in repr(settings)
    assert settings.telegram_token is not None
    assert settings.telegram_token.get_secret_value() == token


def test_env_example_documents_every_setting() -> None:
    from engine.settings import Settings

    text = (REPO / ".env.example").read_text()
    lines = text.splitlines()
    for name in Settings.model_fields:
        key = f"TURNSTILE_{name.upper()}="
        index = next((i for i, line in enumerate(lines) if line.startswith(key)), None)
        assert index is not None, f"{key} missing from .env.example"
        assert lines[index - 1].startswith("#"), f"{key} has no comment"


def run_cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TURNSTILE, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=60
    )


def clean_env() -> dict[str, str]:
    env = _clean_env()
    env["PYTHONPATH"] = str(REPO)
    return env


def test_cli_help_lists_commands(tmp_path: Path) -> None:
    result = run_cli("--help", env=clean_env(), cwd=tmp_path)
    assert result.returncode == 0
    assert "bot" in result.stdout


def test_bot_without_token_stops_with_one_clear_line(tmp_path: Path) -> None:
    result = run_cli("bot", env=clean_env(), cwd=tmp_path)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "TURNSTILE_TELEGRAM_TOKEN" in lines[0]


def test_cli_unknown_command_is_usage_error(tmp_path: Path) -> None:
    result = run_cli("frobnicate", env=clean_env(), cwd=tmp_path)
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


def test_redaction_shapes() -> None:
    text = (
        "sk-ant-api03-abcdefghijklmnop ghp_abcdefghijklmnopqrstuvwxyz0123 "
        "Authorization: Bearer eyJhbGciOi.xyz 123456789:AAbbccddeeffgghhiijjkkllmmnnoopp "
        "https://bob:hunter2@example.com/repo.git password=swordfish"
    )
    out = redact(text)
    for secret in ("abcdefghijklmnop", "ghp_", "eyJhbGciOi", "AAbbcc", "hunter2", "swordfish"):
        assert secret not in out
    assert out.count(REDACTED) >= 6
    assert "https://bob:[REDACTED]@example.com" in out


def test_redactor_hides_exact_secrets_and_tail_caps() -> None:
    redactor = Redactor(["plain-secret-value"])
    assert redactor("a plain-secret-value b") == f"a {REDACTED} b"
    assert len(tail("x" * 5000).encode()) == 2048


async def test_store_migrates_and_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "db" / "t.db"
    async with Database(path) as db:
        assert await db.schema_version() == db.latest_version
        runs = SqliteRunStore(db)
        await runs.create_run("r1", mode="chat", agent="command", session_id="s1", chat_id=5)
        turn_id = await runs.start_turn("r1", 1, "prompt", "execute")
    # A crash: the process ends with the turn started and never finished.
    async with Database(path) as db:
        runs = SqliteRunStore(db)
        interrupted = await runs.mark_interrupted()
        assert [t.id for t in interrupted] == [turn_id]
        assert interrupted[0].state is TurnState.INTERRUPTED
        again = await runs.start_turn("r1", 1, "prompt", "execute")
        await runs.finish_turn(again, TurnOutput.from_text("done").with_exit_code(0))
        turns = await runs.turns("r1")
        assert [(t.seq, t.attempt, t.state) for t in turns] == [
            (1, 1, TurnState.INTERRUPTED),
            (1, 2, TurnState.FINISHED),
        ]
        assert await runs.mark_interrupted() == []
        run = await runs.update_run("r1", status=RunStatus.COMPLETED, turn=1, state={"k": 1})
        assert run.status is RunStatus.COMPLETED
        assert run.state == {"k": 1}
        with pytest.raises(NotFoundError):
            await runs.get_run("nope")
        with pytest.raises(ValueError, match="unknown run fields"):
            await runs.update_run("r1", bogus=1)


async def test_store_rolls_back_failed_transactions(tmp_path: Path) -> None:
    async with Database(tmp_path / "t.db") as db:
        runs = SqliteRunStore(db)
        await runs.create_run("r1", mode="auto", agent="command", session_id="s")
        with pytest.raises(RuntimeError):  # noqa: PT012 - the block is the transaction
            async with db.transaction() as conn:
                await conn.execute("UPDATE runs SET phase = 'x' WHERE id = 'r1'")
                raise RuntimeError("boom")
        assert (await runs.get_run("r1")).phase is None


async def test_concurrent_writers_in_one_process_are_serialised(tmp_path: Path) -> None:
    async with Database(tmp_path / "t.db") as db:
        runs = SqliteRunStore(db)
        await asyncio.gather(
            *(runs.create_run(f"r{i}", mode="chat", agent="c", session_id="s") for i in range(50))
        )
        assert len(await runs.list_runs()) == 50


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_engine_never_imports_telegram_or_bot() -> None:
    offenders = [
        str(path.relative_to(REPO))
        for path in (REPO / "engine").rglob("*.py")
        if {"telegram", "bot", "chatfront"} & _imports(path)
    ]
    assert offenders == []


@pytest.mark.parametrize("package", ["engine.turn", "engine.agents", "engine.store"])
def test_all_lists_real_names(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        assert hasattr(module, name), f"{package}.{name}"


def test_terminal_chat_runs_turns_of_one_session(tmp_path: Path, fake_agent_cmd: str) -> None:
    env = clean_env()
    env["TURNSTILE_AGENT_COMMAND"] = fake_agent_cmd
    env["FAKE_AGENT_LOG"] = str(tmp_path / "log.jsonl")
    env["FAKE_AGENT_STATE"] = str(tmp_path / "state")
    result = subprocess.run(
        [*TURNSTILE, "chat", "--tool", "command", "--session", "term-1"],
        input="first\n\n  \nsecond\n",
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["echo: first", "echo: second"]
    log = [line for line in (tmp_path / "log.jsonl").read_text().splitlines() if line]
    assert len(log) == 2
    assert all('"session": "term-1"' in line for line in log)
