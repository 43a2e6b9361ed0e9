"""Layer rules as searches over the source: the engine knows no front end, and the bot
asks the engine for what the engine owns."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from chatfront.migrations import migrations as bot_migrations
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
    statements = [s for migration in bot_migrations().migrations for s in migration.statements]
    made = {name for s in statements for name in re.findall(r"CREATE TABLE (\w+)", s)}
    # (a table made again on SQLite is made under a passing name, then renamed)
    passing = {name for s in statements for name in re.findall(r"ALTER TABLE (\w+) RENAME", s)}
    tables = made - passing
    assert len(tables) == 13
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
    assert {"cache", "worktrees", "locks", "chats"} == RESERVED_FOLDERS
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


# -- the import graph and module sizes -----------------------------------------------

_PACKAGES = ("bot", "chatfront", "engine", "webview")
_MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(path): path
        for package in _PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
    }


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports anywhere in its source: at the top, inside
    functions, and under ``if TYPE_CHECKING:`` alike."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name``
            # imports mod.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            # ``import a.b.c`` of a module that is not ours stops at the nearest one that is.
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_what_chat_front_ends_share_knows_neither_telegram_nor_the_bot() -> None:
    # chatfront sits between the engine and a messenger's front end (bot/): imports go
    # bot -> chatfront -> engine, and the engine knows neither.
    modules = _modules()
    known = set(modules)
    for name, path in modules.items():
        text = path.read_text()
        found = _imports(name, path, known)
        if name.startswith("chatfront"):
            assert not [m for m in found if m.startswith("bot")], name
            assert not re.search(r"^\s*(from|import) telegram\b", text, re.M), name
        if name.startswith("webview"):
            # The web view is a front end of its own: no messenger, no bot.
            assert not [m for m in found if m.startswith("bot")], name
            assert not re.search(r"^\s*(from|import) telegram\b", text, re.M), name
        if name.startswith(("engine", "chatfront")):
            assert not [m for m in found if m.startswith("webview")], name
        if name.startswith("engine"):
            assert not [m for m in found if m.startswith("chatfront")], name


def test_no_import_cycle_in_bot_or_engine_not_even_for_type_checking() -> None:
    modules = _modules()
    known = set(modules)
    graph = {name: _imports(name, path, known) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one() -> None:
    # The check above must be able to fail: a two-module and a three-module loop.
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert _cycles(graph) == [["a", "b"], ["c", "d", "e"]]


def test_no_module_is_long_without_a_reason_at_its_top() -> None:
    # A module over the limit says why in its docstring, in a paragraph starting "Long:".
    offenders = []
    for name, path in _modules().items():
        text = path.read_text()
        if text.count("\n") <= _MAX_LINES:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if "\nLong:" not in f"\n{doc}":
            offenders.append(f"{name} ({text.count(chr(10))} lines)")
    assert offenders == []


def test_no_postgresql_driver_or_job_queue_is_loaded_unless_asked_for() -> None:
    """The embedded default (SQLite, turns in process) starts without psycopg and
    procrastinate: every command and the bot load them only when a URL or the workers
    ask for them (they cost the bot ~13 MiB of resident memory)."""
    import subprocess
    import sys

    probe = (
        "import sys, engine.cli, bot.app\n"
        "print(','.join(m for m in ('psycopg', 'procrastinate') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == ""


def test_the_web_view_is_loaded_only_when_it_is_on() -> None:
    """A bot without ``TURNSTILE_WEB_PORT`` starts without the web view and its libraries
    (pages, templates, metrics: they cost the bot's bounded memory for nothing)."""
    import subprocess
    import sys

    probe = (
        "import sys, engine.cli, bot.app\n"
        "print(','.join(m for m in ('webview', 'jinja2', 'prometheus_client', 'markdown_it')"
        " if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == ""
