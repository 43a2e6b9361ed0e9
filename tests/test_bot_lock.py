"""One bot per database, however the database is named: two real ``turnstile bot``
processes, the second given a symlink to the first one's database file."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from bot.app import BotRuntime
from engine.store.location import PostgresURL
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import bot_settings, running_bot
from tests.pg_support import PgCluster
from tests.support import wait_until
from tests.test_bot_restart import _env, _start

pytestmark = [pytest.mark.usefixtures("isolated_env"), pytest.mark.timeout(120)]


async def test_a_second_bot_through_a_symlinked_database_is_refused(tmp_path: Path) -> None:
    async with FakeBotApi() as api:
        first = await _start(api, tmp_path, tmp_path / "bot.db")
        try:
            link = tmp_path / "other" / "same.db"
            link.parent.mkdir()
            link.symlink_to(tmp_path / "bot.db")
            env = _env(api, tmp_path, tmp_path / "bot.db") | {"TURNSTILE_DATABASE": str(link)}
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


async def test_a_second_bot_on_one_postgresql_database_is_refused(
    tmp_path: Path, pg_url: str
) -> None:
    # A password in the URL (the server trusts loopback and ignores it): never shown.
    url = pg_url.replace("postgres@", "postgres:hunter2-secret@", 1)
    async with FakeBotApi() as api:
        env = _env(api, tmp_path, tmp_path / "bot.db") | {"TURNSTILE_DATABASE": url}
        with open(tmp_path / "first.log", "wb") as log:
            first = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "engine.cli",
                "bot",
                cwd=tmp_path,
                env=env,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=log,
            )
        try:
            await api.wait_until(lambda: bool(api.calls_of("deleteWebhook")), timeout=30)
            elsewhere = tmp_path / "elsewhere"
            elsewhere.mkdir()
            second = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "engine.cli",
                "bot",
                cwd=elsewhere,  # another folder: no file in common with the first
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
            shown = url.replace("hunter2-secret", "***")
            assert lines == [
                f"turnstile: another turnstile bot already runs on {shown} "
                f"(pid {first.pid} on {socket.gethostname()}); stop it first"
            ]
            assert first.returncode is None  # the first bot is untouched
            first.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(first.wait(), 30) == 0
            # Gone with its session: the next bot takes the lock.
            third = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "engine.cli",
                "bot",
                cwd=tmp_path,
                env=env,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
            calls = len(api.calls_of("deleteWebhook"))
            try:
                await api.wait_until(lambda: len(api.calls_of("deleteWebhook")) > calls, timeout=30)
                third.send_signal(signal.SIGTERM)
                _, err = await asyncio.wait_for(third.communicate(), 30)
                assert third.returncode == 0, err.decode()
            finally:
                if third.returncode is None:
                    third.kill()
                    await third.wait()
        finally:
            if first.returncode is None:
                first.kill()
                await first.wait()


async def test_tool_approvals_run_on_postgresql(tmp_path: Path, pg_url: str) -> None:
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, database=pg_url, tool_approval="all")
        async with running_bot(api, settings) as rt:
            assert rt.db.dialect == "postgresql"
            ext = next(
                e for e in rt.handlers.extensions if type(e).__name__ == "ToolApprovalExtension"
            )
            await ext._started.wait()
            assert ext._failed is None
            route = ext.routes_for("claude", None)
            assert route is not None
            # The permission server (in the bot's process) opens the server, never a file.
            target = route("r1").database
            assert isinstance(target, PostgresURL)
            assert target.conninfo() == pg_url


async def test_an_advisory_lock_excludes_a_second_holder_until_released(pg_url: str) -> None:
    from engine.store.advisory import AdvisoryLock
    from engine.store.location import PostgresURL

    url = PostgresURL(pg_url)
    first, second = AdvisoryLock(url, "turnstile bot"), AdvisoryLock(url, "turnstile bot")
    other = AdvisoryLock(url, "something else")
    assert await first.try_acquire()
    assert first.held
    assert not await second.try_acquire()
    assert not second.held
    assert await other.try_acquire()  # another name, another lock
    assert await second.holder() == os.getpid()
    assert await second.holder_detail() == f"pid {os.getpid()} on {socket.gethostname()}"
    await first.release()
    await first.release()  # twice: nothing happens
    assert await second.holder() is None
    await asyncio.wait_for(second.acquire(), 10)
    assert second.held
    await second.release()
    await other.release()


async def test_a_lost_bot_lock_is_taken_again_or_the_bot_stops(
    tmp_path: Path, pg_url: str, pg_cluster: PgCluster
) -> None:
    import psycopg

    from engine.store.dialect import advisory_key
    from engine.store.location import PostgresURL

    name = PostgresURL(pg_url).database

    def holders() -> list[int]:
        with psycopg.connect(pg_cluster.url(), autocommit=True) as conn:
            rows = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = %s"
                " AND application_name LIKE 'turnstile pid %%'",
                (name,),
            ).fetchall()
        return [int(r[0]) for r in rows]

    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, database=pg_url)
        async with BotRuntime(settings, lock_check_interval=0.5) as rt:
            await rt.start()
            [first] = holders()
            # The server cuts the lock's connection: the bot takes the lock again.
            pg_cluster.admin(f"SELECT pg_terminate_backend({first})")
            again = await wait_until(lambda: [p for p in holders() if p != first], timeout=20)
            assert len(again) == 1
            # Cut again, and another process takes it first: the bot stops, saying why.
            async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as other:
                pg_cluster.admin(f"SELECT pg_terminate_backend({again[0]})")

                async def took() -> bool:
                    cursor = await other.execute(
                        "SELECT pg_try_advisory_lock(%s)", (advisory_key("turnstile bot"),)
                    )
                    row = await cursor.fetchone()
                    return bool(row and row[0])

                await wait_until(took, timeout=10, interval=0.001)
                await asyncio.wait_for(rt.wait(), 20)
                assert rt.fatal is not None
                # (Seen holding it: a session that is no turnstile process says so.)
                assert "and another database session took the one-bot lock meanwhile" in str(
                    rt.fatal
                )
                await rt.shutdown()
