"""One bot per SQLite database is a lock on the file itself: a hard link to the database,
or a link to its folder, reaches the same file and finds the lock taken.

Two real ``turnstile bot`` processes against the fake Bot API; the second is refused with
one line naming the database, and the first keeps answering. (A symbolic link to the file
itself: tests/test_bot_lock.py. The lock on its own: tests/test_locks_inode.py.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.bot_process import CHAT, OPERATOR, bot_env, start_polling
from tests.fakes.bot_api import FakeBotApi

pytestmark = [pytest.mark.usefixtures("isolated_env"), pytest.mark.timeout(120)]


def _hard_link(root: Path, database: Path) -> Path:
    other = root / "elsewhere" / "hard.db"
    other.parent.mkdir()
    other.hardlink_to(database)
    return other


def _folder_link(root: Path, database: Path) -> Path:
    folder = root / "linked-folder"
    folder.symlink_to(database.parent, target_is_directory=True)
    return folder / database.name


@pytest.mark.parametrize("second_name", [_hard_link, _folder_link], ids=["hard-link", "folder"])
async def test_a_second_bot_on_another_name_of_the_database_is_refused(
    tmp_path: Path, second_name: Callable[[Path, Path], Path]
) -> None:
    database = tmp_path / "data" / "t.db"
    async with FakeBotApi() as api:
        first = await start_polling(
            api, tmp_path, bot_env(tmp_path, api, TURNSTILE_DATABASE=str(database)), timeout=30
        )
        try:
            other = second_name(tmp_path, database)
            assert os.path.samefile(other, database)
            second = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "engine.cli",
                "bot",
                cwd=tmp_path,
                env=bot_env(tmp_path, api, TURNSTILE_DATABASE=str(other)),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
            try:
                _, err = await asyncio.wait_for(second.communicate(), 30)
            finally:
                if second.returncode is None:
                    second.kill()
                    await second.wait()
            assert second.returncode == 2, err.decode()
            assert err.decode().strip().splitlines() == [
                f"turnstile: another turnstile bot already runs on {other.resolve()} "
                f"(pid {first.pid}); stop it first"
            ]
            # The first bot is untouched: still running, still answering.
            assert first.returncode is None
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/help")
            await api.wait_for_message(lambda m: "Your commands:" in m.text)
            first.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(first.wait(), 30) == 0
        finally:
            if first.returncode is None:
                first.kill()
                await first.wait()
    # Only the database's own files beside it: no lock file of another name.
    assert sorted(p.name for p in database.parent.iterdir()) == ["t.db"]
