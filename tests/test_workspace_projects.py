"""Projects: the setting's two forms, bad input, credentials never shown, the CLI."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.cli import build_parser
from engine.errors import ConfigError
from engine.settings import load_settings
from engine.store.location import PostgresURL
from engine.workspace import (
    GitError,
    Project,
    ProjectError,
    WorkspaceManager,
    parse_projects,
    redact_url,
)
from engine.workspace.projects import is_repository_reference, is_safe_name, repository_name
from tests.test_workspace_git import git, git_test_env, make_remote

SECRET = "hunter2-s3cret-value"


@pytest.fixture
def git_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = git_test_env(tmp_path / "home")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@pytest.fixture
def remote(tmp_path: Path, git_env: dict[str, str]) -> Path:
    return make_remote(tmp_path)


def test_compact_form_with_and_without_branch() -> None:
    found = parse_projects("web=https://example.com/web.git#develop, api=/srv/git/api")
    assert found == (
        Project("web", "https://example.com/web.git", "develop"),
        Project("api", "/srv/git/api", None),
    )


@pytest.mark.parametrize(
    "text",
    [
        '{"web": "https://example.com/web.git", "api": {"url": "/srv/api", "branch": "main"}}',
        '[{"name": "web", "url": "https://example.com/web.git"},'
        ' {"name": "api", "url": "/srv/api", "branch": "main"}]',
    ],
)
def test_json_forms(text: str) -> None:
    found = parse_projects(text)
    assert [(p.name, p.branch) for p in found] == [("web", None), ("api", "main")]
    assert found[1].is_local
    assert not found[0].is_local


def test_empty_setting_means_no_projects() -> None:
    assert parse_projects(None) == ()
    assert parse_projects("  ") == ()


@pytest.mark.parametrize("name", ["a/b", "..", "../x", "a..b", "has space", "", "-x", "x.lock"])
def test_bad_project_names_are_refused(name: str) -> None:
    with pytest.raises(ProjectError, match="invalid project name"):
        parse_projects(f'{{"{name}": "/srv/git/x"}}')


@pytest.mark.parametrize(
    "text",
    [
        "web",  # no '='
        '{"web": 3}',
        '{"web": {"branch": "main"}}',
        '{"web": {"url": "/x", "colour": "red"}}',
        '{"web": "/x", "web": "/y"}',
        "web=/x,web=/y",
        "web=/x#bad..branch",
        "web=--upload-pack=evil",
        '{"web": ',
    ],
)
def test_malformed_settings_are_refused(text: str) -> None:
    with pytest.raises(ProjectError):
        parse_projects(text)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            f"https://bob:{SECRET}@git.example.com/x.git",
            "https://[REDACTED]@git.example.com/x.git",
        ),
        (f"https://{SECRET}@git.example.com/x.git", "https://[REDACTED]@git.example.com/x.git"),
        (f"ssh://git:{SECRET}@host/x.git", "ssh://git:[REDACTED]@host/x.git"),
        ("git@github.com:acme/x.git", "git@github.com:acme/x.git"),
        ("/srv/git/x", "/srv/git/x"),
    ],
)
def test_urls_are_shown_without_credentials(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    project = Project("x", url)
    assert project.display_url == shown
    assert SECRET not in repr(project)


def test_a_bad_url_in_the_setting_never_echoes_it() -> None:
    with pytest.raises(ProjectError) as info:
        parse_projects(f"https://bob:{SECRET}@host/x.git")
    assert SECRET not in str(info.value)
    with pytest.raises(ProjectError) as info:
        parse_projects(f'{{"web": "https://bob:{SECRET}@host/x.git"')
    assert SECRET not in str(info.value)


def test_settings_keep_projects_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNSTILE_PROJECTS", f"web=https://bob:{SECRET}@host/x.git#main")
    settings = load_settings()
    assert SECRET not in repr(settings)
    manager = WorkspaceManager.from_settings(settings)
    assert manager.resolve_project("web").branch == "main"


def test_unknown_and_malformed_project_names(tmp_path: Path) -> None:
    manager = WorkspaceManager(tmp_path, [Project("web", "/srv/web")])
    with pytest.raises(ProjectError, match=r"unknown project 'api' \(known: web\)"):
        manager.resolve_project("api")
    for bad in ("../web", "we b", "a/b"):
        with pytest.raises(ProjectError, match="invalid project name"):
            manager.resolve_project(bad)


@pytest.mark.parametrize("run_id", ["a/b", "..", "x y", "rescue", "a--b", ""])
async def test_bad_run_ids_are_refused(tmp_path: Path, run_id: str) -> None:
    manager = WorkspaceManager(tmp_path, [Project("web", "/srv/web")])
    with pytest.raises(ConfigError, match="invalid run id"):
        await manager.provision(run_id, "web")


async def test_credentials_in_a_failing_url_are_never_printed(
    tmp_path: Path, git_env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    # Port 1 on loopback refuses at once: git fails, naming the URL in its message.
    urls = {
        "pw": f"http://bob:{SECRET}@127.0.0.1:1/x.git",
        "tok": f"http://{SECRET}@127.0.0.1:1/x.git",
    }
    manager = WorkspaceManager(tmp_path / "ws", [Project(n, u) for n, u in urls.items()])
    caplog.set_level(logging.DEBUG)
    for name in urls:
        with pytest.raises(GitError) as info:
            await manager.provision(f"run-{name}", name)
        assert info.value.command == "clone"
        assert "127.0.0.1" in str(info.value)
        assert SECRET not in str(info.value)
        assert SECRET not in info.value.stderr
    assert "cloning project" in caplog.text
    assert SECRET not in caplog.text
    assert not list((tmp_path / "ws" / "cache").iterdir())


async def test_a_local_path_that_is_not_a_repository(
    tmp_path: Path, git_env: dict[str, str]
) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    inside = tmp_path / "repo" / "sub"
    inside.mkdir(parents=True)
    git("init", "-q", cwd=tmp_path / "repo")
    manager = WorkspaceManager(
        tmp_path / "ws",
        [
            Project("plain", str(plain)),
            Project("inside", str(inside)),
            Project("missing", str(tmp_path / "nowhere")),
        ],
    )
    with pytest.raises(ProjectError, match=r"'plain'.* is not a git repository"):
        await manager.provision("run1", "plain")
    with pytest.raises(ProjectError, match=r"'inside'.* is not a git repository"):
        await manager.provision("run2", "inside")
    with pytest.raises(ProjectError, match=r"'missing'.* is not a folder"):
        await manager.provision("run3", "missing")


async def test_a_default_branch_that_does_not_exist(tmp_path: Path, remote: Path) -> None:
    manager = WorkspaceManager(tmp_path / "ws", [Project("demo", str(remote), "release")])
    with pytest.raises(ProjectError, match=r"no branch 'release' \(branches: main\)"):
        await manager.provision("run1", "demo")
    assert not manager.worktree_path("demo", "run1").exists()
    # An explicit branch that exists works on the same project.
    ws = await manager.provision("run1", "demo", branch="main")
    assert ws.base_ref == "origin/main"


async def test_the_remote_default_branch_is_used_without_a_setting(
    tmp_path: Path, git_env: dict[str, str]
) -> None:
    bare = make_remote(tmp_path)
    git("symbolic-ref", "HEAD", "refs/heads/trunk", cwd=bare)
    git("branch", "trunk", "main", cwd=bare)
    manager = WorkspaceManager(tmp_path / "ws", [Project("demo", f"file://{bare}")])
    ws = await manager.provision("run1", "demo")
    assert ws.base_ref == "origin/trunk"


async def _run_cli(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return int(await args.handler(args, load_settings()))


async def test_cli_lists_projects_without_credentials(
    isolated_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(
        "TURNSTILE_PROJECTS", f"web=https://bob:{SECRET}@example.com/web.git#main,api=/srv/api"
    )
    assert await _run_cli(["projects"]) == 0
    out = capsys.readouterr().out
    assert "web   main" in out
    assert "https://[REDACTED]@example.com/web.git" in out
    assert "api   (remote default)" in out
    assert SECRET not in out


async def test_cli_worktrees_and_cleanup(
    isolated_env: Path,
    remote: Path,
    db_target: Path | PostgresURL,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from engine.store.backend import open_database
    from engine.workspace import SqliteWorkspaceStore

    # The store on a SQLite file and on a fresh PostgreSQL database in turn; the CLI below
    # finds it through the same setting.
    where = db_target.conninfo() if isinstance(db_target, PostgresURL) else str(db_target)
    monkeypatch.setenv("TURNSTILE_DATABASE", where)
    monkeypatch.setenv("TURNSTILE_PROJECTS", f"demo={remote}#main")
    settings = load_settings()
    assert settings.database == db_target
    async with open_database(settings) as db:
        manager = WorkspaceManager.from_settings(settings, store=SqliteWorkspaceStore(db))
        ws = await manager.provision("run1", "demo")
        (ws.path / "wip.txt").write_text("wip\n")
        await manager.release(ws)

    assert await _run_cli(["projects", "worktrees"]) == 0
    out = capsys.readouterr().out
    assert "run1" in out
    assert "turnstile/run1" in out
    assert "finished" in out
    assert "kB" in out

    assert await _run_cli(["projects", "cleanup", "--retention-hours", "0"]) == 0
    out = capsys.readouterr().out
    assert "removed run1 (uncommitted changes on turnstile/rescue/run1)" in out
    assert not ws.path.exists()


async def test_credentials_echoed_by_git_are_redacted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Real git anonymises URLs itself; this stand-in echoes its whole argv to stderr so
    # that our own redaction is what keeps the secret out.
    echo = tmp_path / "git-echo"
    echo.write_text('#!/bin/sh\necho "fatal: cannot clone: $*" >&2\nexit 128\n')
    echo.chmod(0o755)
    url = f"https://bob:{SECRET}@git.example.com/x.git"
    manager = WorkspaceManager(tmp_path / "ws", [Project("web", url)], git=str(echo))
    caplog.set_level(logging.DEBUG)
    with pytest.raises(GitError) as info:
        await manager.provision("run1", "web")
    assert "git.example.com/x.git" in str(info.value)
    assert SECRET not in str(info.value)
    assert SECRET not in caplog.text


_URL_SAFE = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~!$&'()*+;="


@given(
    user=st.text("abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=20),
    tail=st.text(_URL_SAFE, min_size=2, max_size=40),
    scheme=st.sampled_from(["https", "http", "ssh", "git+ssh"]),
)
def test_no_password_survives_redaction(user: str, tail: str, scheme: str) -> None:
    # "S3" appears nowhere else in the URL or in the marker, so finding it means a leak.
    secret = f"S3{tail}"
    url = f"{scheme}://{user}:{secret}@git.example.com/team/repo.git"
    project = Project("p", url)
    shown = "[REDACTED]" if scheme.startswith("http") else f"{user}:[REDACTED]"
    assert project.display_url == f"{scheme}://{shown}@git.example.com/team/repo.git"
    assert secret not in repr(project)
    assert secret not in WorkspaceManager(Path("/nonexistent"), [project]).redact(f"x {url} y")


def test_the_package_exports_what_it_lists() -> None:
    import engine.workspace as package

    assert sorted(package.__all__) == sorted(set(package.__all__))
    for name in package.__all__:
        assert getattr(package, name) is not None


@pytest.mark.parametrize(
    ("reference", "name"),
    [
        ("https://bob:pw@example.invalid/acme/web.git", "web"),
        ("git@github.com:acme/api.git", "api"),
        ("ssh://git@host:22/srv/tools/", "tools"),
        ("file:///srv/git/remote.git/", "remote"),
        ("/srv/git/my repo", "my-repo"),
        ("/srv/git/..weird..name.lock", "weird.name"),
        ("https://example.invalid/", "repo"),
    ],
)
def test_repository_names(reference: str, name: str) -> None:
    assert is_repository_reference(reference)
    assert repository_name(reference) == name


def test_a_plain_name_is_not_a_repository_reference() -> None:
    assert not is_repository_reference("demo")
    assert is_repository_reference("./demo")


@given(st.text(min_size=1, max_size=80))
def test_repository_name_is_always_safe(raw: str) -> None:
    assert is_safe_name(repository_name("/srv/" + raw))


async def test_project_for_registers_the_repository_and_redacts_its_credentials(
    tmp_path: Path, git_env: dict[str, str]
) -> None:
    remote = make_remote(tmp_path, name="gadgets")
    manager = WorkspaceManager(tmp_path / "ws", [Project("demo", str(remote))])
    assert manager.project_for("demo").name == "demo"
    assert manager.project_for(str(remote)).name == "demo"  # configured already
    with pytest.raises(ProjectError, match="unknown project 'nope'"):
        manager.project_for("nope")
    url = f"http://bob:{SECRET}@127.0.0.1:1/x/site.git"
    site = manager.project_for(url)
    assert site.name == "site"
    assert SECRET not in manager.redact(f"fatal: unable to access '{url}'")
    with pytest.raises(GitError) as failed:
        await manager.provision("run-1", site)
    assert SECRET not in str(failed.value)
