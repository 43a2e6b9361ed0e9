"""What a run changed, seen from the chat: /get and /diff on finished runs, the stat and the
branch in the final report, the branch pushed back to the project's repository.

The real bot against the fake Bot API, the fake agent through the command agent (its
Execute turn writes and commits ``report.txt`` holding the name of its folder), a real
SQLite file and real git repositories in ``tmp_path``.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from engine.workspace import Project, WorkspaceManager
from tests.automode_support import CLARIFY, EVALUATE, EXECUTE, GIT_ENV, PLAN, git_workspace
from tests.fakes.bot_api import FakeBotApi, SentMessage
from tests.fakes.bot_harness import CHAT, OPERATOR, bot_settings, running_bot, write_script
from tests.test_workspace_git import git, git_test_env, make_remote

pytestmark = pytest.mark.usefixtures("isolated_env", "bot_backend")

_AUTO_RUN = re.compile(r"🤖 Auto run (auto-\d{8}-\d{6}-[0-9a-f]{6})\b")
_RULES: list[dict[str, Any]] = [
    {"match": CLARIFY, "text": "Goal: report.txt is committed."},
    {"match": PLAN, "text": "1. write report.txt\n2. commit it"},
    {
        "match": EXECUTE,
        "text": "wrote it",
        # Each run's report names its own folder: the run's worktree is named after it.
        "run": [
            ["sh", "-c", 'basename "$PWD" > report.txt'],
            ["git", "add", "report.txt"],
            ["git", "commit", "-q", "-m", "add the report"],
        ],
    },
    {"match": EVALUATE, "text": "done\nAUTO-MODE STATUS: COMPLETE\n"},
]


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    write_script(tmp_path, {"rules": _RULES}, monkeypatch)


def branches(repo: Path) -> list[str]:
    listed = subprocess.run(
        ["git", "branch", "--format=%(refname:short)"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    )
    return listed.stdout.split()


def _run_ids(api: FakeBotApi) -> list[str]:
    return [m[1] for m in (_AUTO_RUN.match(t) for t in api.texts()) if m is not None]


async def finished_auto(api: FakeBotApi, objective: str) -> tuple[str, SentMessage]:
    """Start ``/auto objective`` and wait for its final report: (run id, report)."""
    # A run's live message is edited in place: a new run is one with an id not seen yet.
    seen = set(_run_ids(api))
    api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"/auto {objective}")
    await api.wait_until(lambda: bool(set(_run_ids(api)) - seen))
    (run_id,) = set(_run_ids(api)) - seen
    report = await api.wait_for_message(lambda m: m.text.startswith(f"Auto run {run_id}: "))
    return run_id, report


async def test_diff_with_no_run_here_says_what_to_do(tmp_path: Path) -> None:
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)):
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/diff")
        nothing = await api.wait_for_message(lambda m: m.text.startswith("No run here yet"))
    assert nothing.text == (
        "No run here yet: start one with /auto OBJECTIVE or /chat, or name an earlier one "
        "of this chat: /diff RUN."
    )


@pytest.mark.usefixtures("agent")
async def test_get_and_diff_read_a_finished_auto_run_in_a_chat_without_a_session(
    tmp_path: Path,
) -> None:
    """A new user's first steps: /auto in a group never bound to a session, then /get and
    /diff. Before, /get answered "No run here to take files from: send /chat first"."""
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)):
        run_id, report = await finished_auto(api, "write the report")
        assert "Changed since the start: 1 file changed, 1 insertion(+)" in report.text
        assert "report.txt | +1 -0" in report.text
        # The run worked in a worktree of the chat's own workspace: its branch is pushed
        # back there, where the chat's later sessions see it.
        own = tmp_path / "ws" / "chats" / f"chat_{CHAT}"
        assert f"Branch: turnstile/{run_id}, pushed to {own.resolve()}" in report.text
        branches = subprocess.run(
            ["git", "-C", str(own), "branch", "--format=%(refname:short)"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert f"turnstile/{run_id}" in branches

        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/get report.txt")
        doc = await api.wait_for_message(lambda m: m.filename == "report.txt")
        assert doc.document == f"{run_id}\n".encode()  # its own worktree, named after it

        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/diff")
        stat = await api.wait_for_message(lambda m: m.text.startswith("🔀 Run "))
        assert stat.text.splitlines()[0].startswith(f"🔀 Run {run_id}, against its start (")
        assert stat.text.splitlines()[0].endswith("): 1 file changed, 1 insertion(+)")
        assert "report.txt | +1 -0" in stat.text
        patch = await api.wait_for_message(lambda m: (m.filename or "").endswith(".patch"))
        assert patch.filename == f"diff-{run_id}.patch"
        assert patch.document is not None
        assert b"+++ b/report.txt" in patch.document
        assert f"+{run_id}".encode() in patch.document


@pytest.mark.usefixtures("agent")
async def test_a_project_run_pushes_its_branch_back_and_get_names_an_earlier_run(
    tmp_path: Path,
) -> None:
    origin = git_workspace(tmp_path / "origin")
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, projects=f"web={origin}")
        async with running_bot(api, settings):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/project web")
            await api.wait_for_message(lambda m: "project web" in m.text)
            first, report = await finished_auto(api, "write the first report")
            assert f"Branch: turnstile/{first}, pushed to {origin}" in report.text
            assert "Changed since the start: 1 file changed, 1 insertion(+)" in report.text
            assert f"turnstile/{first}" in branches(origin)
            # The repository's own checkout is left alone.
            assert not (origin / "report.txt").exists()

            second, _ = await finished_auto(api, "write the second report")
            assert f"turnstile/{second}" in branches(origin)

            # The chat's last run, then an earlier one named by the end of its id.
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/get report.txt")
            latest = await api.wait_for_message(lambda m: m.filename == "report.txt")
            assert latest.document == f"{second}\n".encode()
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"/get report.txt {first[-6:]}")
            await api.wait_until(lambda: sum(m.filename == "report.txt" for m in api.sent) == 2)
            earlier = [m for m in api.sent if m.filename == "report.txt"][-1]
            assert earlier.document == f"{first}\n".encode()

            api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"/diff {first}")
            stat = await api.wait_for_message(lambda m: m.text.startswith(f"🔀 Run {first}"))
            assert "1 file changed, 1 insertion(+)" in stat.text

            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/get report.txt nosuchrun")
            refused = await api.wait_for_message(lambda m: "Not sent" in m.text)
            assert "report.txt nosuchrun does not exist" in refused.text


@pytest.mark.usefixtures("agent")
async def test_pushing_branches_back_can_be_turned_off(tmp_path: Path) -> None:
    origin = git_workspace(tmp_path / "origin")
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, projects=f"web={origin}", push_branches=False)
        async with running_bot(api, settings):
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/project web")
            await api.wait_for_message(lambda m: "project web" in m.text)
            run_id, report = await finished_auto(api, "write the report")
    assert f"Branch: turnstile/{run_id}, kept in turnstile's clone" in report.text
    assert "TURNSTILE_PUSH_BRANCHES" in report.text
    assert branches(origin) == ["main"]


async def test_a_push_git_refuses_is_said_and_nothing_is_forced(tmp_path: Path) -> None:
    """The project's repository already has the run's branch elsewhere: the push is refused
    (never forced), and the result says so in words instead of raising."""
    env = git_test_env(tmp_path / "home")
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        remote = make_remote(tmp_path)
        manager = WorkspaceManager(tmp_path / "ws", [Project(name="demo", url=str(remote))])
        workspace = await manager.provision("auto-20261203-120000-abcdef", "demo")
        (workspace.path / "x.txt").write_text("mine\n")
        git("add", "x.txt", cwd=workspace.path)
        git("commit", "-q", "-m", "mine", cwd=workspace.path)
        # Somebody else's commit on a branch of the same name, in the project's repository.
        other = tmp_path / "other"
        git("clone", "-q", str(remote), str(other), cwd=tmp_path)
        git("checkout", "-q", "-b", workspace.branch, cwd=other)
        (other / "y.txt").write_text("theirs\n")
        git("add", "y.txt", cwd=other)
        git("commit", "-q", "-m", "theirs", cwd=other)
        git("push", "-q", "origin", workspace.branch, cwd=other)

        pushed = await manager.push_back(workspace)

        assert pushed.problem is not None
        assert pushed.line().startswith(
            f"Branch: {workspace.branch}, not pushed: git push to {remote}: "
        )
        assert pushed.line().endswith(
            "the repository has a branch of that name with other commits already (nothing "
            "was forced)"
        )
        assert git("log", "-1", "--format=%s", workspace.branch, cwd=remote) == "theirs"

        gone = tmp_path / "remote-moved.git"
        remote.rename(gone)
        missing = await manager.push_back(workspace)
        assert missing.problem is not None
        assert f"git push to {remote}: " in missing.line()
