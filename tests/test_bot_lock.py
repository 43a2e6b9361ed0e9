"""One bot per database, however the database is named: two real ``turnstile bot``
processes, the second given a symlink to the first one's database file."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import pytest

from tests.fakes.bot_api import FakeBotApi
from tests.test_bot_restart import _env, _start

pytestmark = [pytest.mark.usefixtures("isolated_env"), pytest.mark.timeout(120)]


async def test_a_second_bot_through_a_symlinked_database_is_refused(tmp_path: Path) -> None:
    async with FakeBotApi() as api:
        first = await _start(api, tmp_path)
        try:
            link = tmp_path / "other" / "same.db"
            link.parent.mkdir()
            link.symlink_to(tmp_path / "bot.db")
            env = _env(api, tmp_path) | {"TURNSTILE_DATABASE": str(link)}
            second = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "engine.cli",
                "bot",
                cwd=tmp_path,
                env=env,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
            try:
                _, err = await asyncio.wait_for(second.communicate(), 30)
            finally:
                if second.returncode is None:
                    second.kill()
                    await second.wait()
            assert second.returncode == 2
            lines = err.decode().strip().splitlines()
            database = (tmp_path / "bot.db").resolve()
            assert lines == [
                f"turnstile: another turnstile bot already runs on {database} "
                f"(pid {first.pid}); stop it first"
            ]
            assert first.returncode is None  # the first bot is untouched
            first.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(first.wait(), 30) == 0
        finally:
            if first.returncode is None:
                first.kill()
                await first.wait()
