"""Layer rules as searches over the source: the engine knows no front end, and the bot
asks the engine for what the engine owns."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bot.migrations import migrations as bot_migrations
from engine.errors import ConfigError
from engine.workspace import RESERVED_FOLDERS, WorkspaceManager
from tests.conftest import REPO


def _sources(package: str, suffixes: set[str]) -> dict[Path, str]:
    return {
        path: path.read_text()
        for path in sorted((REPO / package).rglob("*"))
        if path.suffix in suffixes
    }


def test_the_engine_doctor_does_not_know_telegram() -> None:
    source = (REPO / "engine" / "commands" / "doctor.py").read_text()
    for word in ("getMe", "getWebhookInfo", "TELEGRAM", "BotFather", "bot.doctor"):
        assert word not in source


def test_the_engine_names_no_bot_table() -> None:
    tables = {
        name
        for migration in bot_migrations().migrations
        for statement in migration.statements
        for name in re.findall(r"CREATE TABLE (\w+)", statement)
    }
    assert len(tables) == 10
    pattern = re.compile(r"\b(" + "|".join(sorted(tables)) + r")\b")
    offenders = [
        str(path.relative_to(REPO))
        for path, text in _sources("engine", {".py", ".sql"}).items()
        if pattern.search(text)
    ]
    assert offenders == []


def test_the_bot_never_spells_the_workspace_layout() -> None:
    # Nor builds a path under the workspaces root itself: it asks the manager.
    assert [
        path for path, text in _sources("bot", {".py"}).items() if "settings.workspaces" in text
    ] == []
    assert {"cache", "worktrees", "locks"} == RESERVED_FOLDERS
    names = "|".join(sorted(RESERVED_FOLDERS))
    quoted = re.compile(rf"""["']({names})["'/]|/ ?["']({names})""")
    offenders = [
        f"{path.relative_to(REPO)}: {match.group(0)}"
        for path, text in _sources("bot", {".py"}).items()
        for match in quoted.finditer(text)
    ]
    assert offenders == []


def test_the_manager_gives_plain_folders_and_refuses_its_own(tmp_path: Path) -> None:
    manager = WorkspaceManager(tmp_path / "ws", ())
    assert manager.plain_folder("notes") == (tmp_path / "ws" / "notes").resolve()
    for name in RESERVED_FOLDERS:
        with pytest.raises(ConfigError, match="reserved for the workspace manager"):
            manager.plain_folder(name)
