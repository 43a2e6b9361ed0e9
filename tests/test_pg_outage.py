"""A PostgreSQL outage of 20 s under load: the bot and two workers ride it out.

A real server of the test's own, stopped for 20 s while two auto runs are mid-turn on two
real ``turnstile worker`` processes, driven by a real ``turnstile bot`` process against the
fake Bot API; the turns end while the server is down and people keep writing. Once it is
back: the bot is still the one bot (nobody "took over"), it answers every message sent
during the outage once, both runs end (their interrupted turns run again or are said), and
no run stays running with nobody driving it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.store.backend import open_database
from engine.store.location import PostgresURL
from tests.automode_support import (
    AGENT_CMD,
    CLARIFY,
    EVALUATE,
    EXECUTE,
    PLAN,
    evaluation,
    git_workspace,
    write_script,
)
from tests.bot_process import BotProcess, spawn
from tests.fakes.bot_api import FakeBotApi, SentMessage
from tests.pg_support import PgCluster, find_bindir
from tests.workers_support import Cluster, make_cluster

pytestmark = [pytest.mark.usefixtures("isolated_env"), pytest.mark.timeout(240)]

CHAT = -1001
TALK = -1002  # a second group, for a chat session
OPERATOR = 11
OUTAGE = 20.0


@pytest.fixture
def server() -> Iterator[PgCluster]:
    bindir = find_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL server binaries not found")
    # Its own folder outside tmp_path: the server runs as postgres when we are root.
    own = PgCluster(bindir, Path(tempfile.mkdtemp(prefix="turnstile-pg-outage-")))
    own.start()
    try:
        own.admin('CREATE DATABASE "t"')

        async def migrate() -> None:
            async with open_database(PostgresURL(own.url("t"))):
                pass

        asyncio.run(migrate())
        yield own
    finally:
        own.stop()
        shutil.rmtree(own.folder, ignore_errors=True)


def _texts(message: SentMessage) -> list[str]:
    return [*message.history, message.text]


async def _seen(api: FakeBotApi, bot: BotProcess, check: Any, timeout: float = 60) -> None:
    """Wait for ``check``; a timeout shows what the chat got and the bot's log."""
    try:
        await api.wait_until(check, timeout=timeout)
    except TimeoutError:
        chat = "\n---\n".join(_texts(m)[-1] for m in api.sent)
        raise AssertionError(f"chat:\n{chat}\n\nbot log:\n{bot.log[-6000:]}") from None


def _bot_env(found: Cluster, api: FakeBotApi) -> dict[str, str]:
    root = found.tmp / "bot"
    root.mkdir(exist_ok=True)
    env = dict(found.env)
    env.update(
        TURNSTILE_TELEGRAM_TOKEN=api.token,
        TURNSTILE_TELEGRAM_BASE_URL=api.base_url,
        TURNSTILE_TELEGRAM_BASE_FILE_URL=api.file_url,
        TURNSTILE_ALLOWED_CHATS=str(CHAT),
        TURNSTILE_OPERATORS=str(OPERATOR),
        TURNSTILE_DEFAULT_AGENT="command",
        TURNSTILE_AGENT_COMMAND=AGENT_CMD,
        TURNSTILE_WORKSPACES=str(root / "ws"),
        TURNSTILE_TASKS_ROOT=str(root / "tasks"),
        TURNSTILE_RUNS_DIR=str(root / "runs"),
        TURNSTILE_STATUS_EDIT_INTERVAL="0.05",
        TURNSTILE_SHUTDOWN_FLUSH_SECONDS="5",
        TURNSTILE_LOG_LEVEL="INFO",
    )
    return env


def _setup(tmp_path: Path, server: PgCluster, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    found = make_cluster(tmp_path, server.url("t"), monkeypatch)
    found.env["TURNSTILE_PROJECTS"] = f"default={found.remote}#main"
    # Heartbeats as in a small deployment: a worker is dead after 6 s of silence, so the
    # outage outlasts every worker's heartbeat.
    found.env["TURNSTILE_WORKER_HEARTBEAT"] = "1"
    found.env["TURNSTILE_WORKER_TIMEOUT"] = "6"
    write_script(
        tmp_path / "fake",
        rules=[
            {"match": CLARIFY, "text": "Goal: result.txt exists and is committed."},
            {"match": PLAN, "text": "1. write result.txt\n2. commit it"},
            {
                "match": EXECUTE,
                "text": "committed",
                "wait_file": str(tmp_path / "gate"),
                "files": {"result.txt": "done\n"},
                # (a second attempt finds it committed already: `|| true` as an agent would)
                "run": [
                    ["git", "add", "result.txt"],
                    ["sh", "-c", "git commit -q -m result || true"],
                ],
            },
            {"match": EVALUATE, **evaluation("COMPLETE")},
            # A chat turn that lasts until the gate opens.
            {"match": "slow question", "text": "slow answer", "wait_file": str(tmp_path / "gate")},
        ],
    )
    return found


async def _start_runs(
    api: FakeBotApi, bot: BotProcess, found: Cluster, count: int
) -> dict[str, SentMessage]:
    """``count`` auto runs from the chat, returned once each one's Execute turn runs."""
    statuses: dict[str, SentMessage] = {}
    for n in range(count):
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"/auto make result {n}")

        def queued(m: SentMessage) -> bool:
            return "is queued on the workers" in _texts(m)[0] and all(
                m is not s for s in statuses.values()
            )

        await _seen(api, bot, lambda: any(map(queued, api.sent)))
        status = next(filter(queued, api.sent))
        run = re.search(r"Auto run (\S+) is queued", _texts(status)[0])
        assert run is not None
        statuses[run.group(1)] = status
    for status in statuses.values():
        await _seen(api, bot, lambda s=status: "Execute running on worker" in s.text, 90)
    return statuses


async def _stop(bot: BotProcess) -> None:
    """SIGTERM, and its exit awaited; killed if it does not exit (nothing left running)."""
    try:
        if bot.proc.returncode is None:
            bot.signal()
        await bot.exit_code()
    finally:
        await bot.kill()


async def _polling(bot: BotProcess) -> None:
    try:
        await bot.wait_log("running (polling)", timeout=60)
    except TimeoutError:
        raise AssertionError(bot.log) from None


def _turns(found: Cluster, run_id: str) -> list[tuple[str, int, str]]:
    rows = found.query(
        "SELECT phase, attempt, state FROM turns WHERE run_id = %s ORDER BY id", run_id
    )
    return [(str(p), int(a), str(s)) for p, a, s in rows]


async def test_a_20_second_outage_under_load_loses_nothing(
    server: PgCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = _setup(tmp_path, server, monkeypatch)
    await asyncio.to_thread(found.start_worker, "w1", concurrency=1)
    await asyncio.to_thread(found.start_worker, "w2", concurrency=1)
    bot: BotProcess | None = None
    try:
        async with FakeBotApi() as api:
            env = _bot_env(found, api)
            bot = await spawn(found.tmp / "bot", env, "bot")
            await _polling(bot)
            statuses = await _start_runs(api, bot, found, 2)
            # Both Execute turns run, one on each worker.
            workers = {r: found.runs()[r]["worker"] for r in statuses}
            assert sorted(workers.values()) == ["w1", "w2"], workers

            began = time.monotonic()
            await asyncio.to_thread(server.stop)
            asked = [api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")]
            await asyncio.sleep(5)
            (tmp_path / "gate").write_text("")  # the turns end while the server is down
            asked.append(api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/help"))
            await asyncio.sleep(5)
            asked.append(api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status"))
            await asyncio.sleep(max(0.0, OUTAGE - (time.monotonic() - began)))
            await asyncio.to_thread(server.start_again)
            assert bot.proc.returncode is None, bot.log

            # Every run ends, and says so in the chat.
            for run_id in statuses:
                await _seen(
                    api,
                    bot,
                    lambda r=run_id: any(
                        m.text.startswith(f"Auto run {r}: completed") for m in api.sent
                    ),
                    120,
                )
            rows = found.query("SELECT id, status FROM runs ORDER BY id")
            assert dict(rows) == dict.fromkeys(statuses, "completed")
            for run_id in statuses:
                # The Execute turn the outage cut off is recorded so, and ran again.
                turns = _turns(found, run_id)
                assert ("execute", 1, "interrupted") in turns, turns
                assert ("execute", 2, "finished") in turns, turns
                assert all(state != "started" for _, _, state in turns), turns
            # Every message sent during the outage is answered, once.
            for update in asked:
                message_id = api.pushed(update)["message"]["message_id"]
                await _seen(
                    api, bot, lambda mid=message_id: any(m.reply_to == mid for m in api.sent)
                )
                answers = [m for m in api.sent if m.reply_to == message_id]
                assert len(answers) == 1, [_texts(m) for m in answers]
            assert bot.proc.returncode is None, bot.log
            assert "another turnstile bot" not in bot.log
            assert "Traceback" not in bot.log, bot.log
            # It holds the one-bot lock again: a second bot on the database is refused.
            second = await spawn(found.tmp / "bot", env, "bot")
            assert await second.exit_code(60) == 2, second.log
            assert "another turnstile bot already runs" in second.log, second.log
            for worker in found.workers.values():
                assert worker.proc.poll() is None, worker.output
    finally:
        if bot is not None:
            await _stop(bot)
            (tmp_path / "bot.log").write_text(bot.log)
        found.stop_all()
        for name, worker in found.workers.items():
            (tmp_path / f"{name}.log").write_text(worker.output)


async def test_a_bot_stopped_during_an_outage_exits_and_the_next_one_goes_on(
    server: PgCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM while the server is down: the bot exits (it does not hang waiting for the
    database), and a bot started once the server is back follows the run to its end."""
    found = _setup(tmp_path, server, monkeypatch)
    await asyncio.to_thread(found.start_worker, "w1", concurrency=1)
    bot: BotProcess | None = None
    try:
        async with FakeBotApi() as api:
            env = _bot_env(found, api)
            bot = await spawn(found.tmp / "bot", env, "bot")
            await _polling(bot)
            (run_id,) = await _start_runs(api, bot, found, 1)
            await asyncio.to_thread(server.stop)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")
            await asyncio.sleep(3)
            bot.signal()
            code = await bot.exit_code(60)
            assert "Traceback" not in bot.log, bot.log
            assert code in (0, 1), bot.log
            await asyncio.to_thread(server.start_again)
            (tmp_path / "gate").write_text("")
            again = await spawn(found.tmp / "bot", env, "bot")
            try:
                await _polling(again)
                await _seen(
                    api,
                    again,
                    lambda: any(
                        m.text.startswith(f"Auto run {run_id}: completed") for m in api.sent
                    ),
                    120,
                )
                # The /status sent during the outage is answered (by the second bot).
                assert any("Auto run" in m.text and m.reply_to for m in api.sent)
            finally:
                await _stop(again)
    finally:
        if bot is not None:
            await bot.kill()  # (exited already, unless the test failed)
        found.stop_all()


async def test_the_one_bot_lock_is_taken_again_after_an_outage_of_many_checks(
    server: PgCluster,
) -> None:
    """The server is away for many of the keeper's checks: it goes on trying and takes the
    lock again once the server is back (it claimed a takeover after one failed try)."""
    from engine.store.advisory import AdvisoryLock

    lock = AdvisoryLock(PostgresURL(server.url("t")), "turnstile bot", connect_timeout=2)
    assert await lock.try_acquire()
    keeper = asyncio.create_task(lock.keep(0.2))
    try:
        await asyncio.to_thread(server.stop)
        await asyncio.sleep(3)  # fifteen checks
        assert not keeper.done()
        await asyncio.to_thread(server.start_again)
        deadline = time.monotonic() + 20
        while not lock.held:
            assert not keeper.done(), keeper.result()
            assert time.monotonic() < deadline, "the lock was never taken again"
            await asyncio.sleep(0.05)
        # Held for real: another session cannot take it.
        other = AdvisoryLock(PostgresURL(server.url("t")), "turnstile bot")
        assert not await other.try_acquire()
        assert await other.holder_detail() is not None
    finally:
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper
        await lock.release()


async def test_an_outage_under_a_bot_that_runs_the_turns_itself_loses_nothing(
    server: PgCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same outage with the turns run in the bot's own process (no workers): an auto
    run in one chat, a chat session in another, each mid-turn. The auto run's cut-off turn
    runs again once the server is back and the run completes; the chat turn is said cut
    off (its answer could not be kept) and a message sent during the outage is answered in
    a new run; every message is answered, none is left running."""
    found = _setup(tmp_path, server, monkeypatch)
    found.env["TURNSTILE_EXECUTION"] = "local"
    bot: BotProcess | None = None
    try:
        async with FakeBotApi() as api:
            env = _bot_env(found, api)
            env["TURNSTILE_ALLOWED_CHATS"] = f"{CHAT},{TALK}"
            git_workspace(Path(env["TURNSTILE_WORKSPACES"]) / "default")
            bot = await spawn(found.tmp / "bot", env, "bot")
            await _polling(bot)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto make result.txt")
            await _seen(api, bot, lambda: any("Execute running" in m.text for m in api.sent), 90)
            status = next(m for m in api.sent if "Execute running" in m.text)
            run = re.search(r"Auto run (\S+)", _texts(status)[0])
            assert run is not None, _texts(status)
            auto = run.group(1)
            api.push_message(chat_id=TALK, user_id=OPERATOR, text="/chat")
            await _seen(api, bot, lambda: any("bound" in m.text for m in api.sent))
            api.push_message(chat_id=TALK, user_id=OPERATOR, text="a slow question")
            chats = "SELECT DISTINCT run_id FROM turns WHERE run_id LIKE 'chat-%%'"
            await _seen(api, bot, lambda: bool(found.query(chats)))
            ((cut_off,),) = found.query(chats)

            began = time.monotonic()
            await asyncio.to_thread(server.stop)
            asked = [api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/status")]
            await asyncio.sleep(3)
            (tmp_path / "gate").write_text("")  # the turns end while the server is down
            later = api.push_message(chat_id=TALK, user_id=OPERATOR, text="quick question")
            asked.append(api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/help"))
            await asyncio.sleep(max(0.0, OUTAGE - (time.monotonic() - began)))
            await asyncio.to_thread(server.start_again)

            await _seen(
                api,
                bot,
                lambda: any(m.text.startswith(f"Auto run {auto}: completed") for m in api.sent),
                120,
            )
            assert found.query("SELECT status FROM runs WHERE id = %s", auto) == [("completed",)]
            turns = _turns(found, auto)
            assert ("execute", 1, "interrupted") in turns, turns
            assert ("execute", 2, "finished") in turns, turns
            assert any("resumed at round 3, phase execute" in m.text for m in api.sent)

            await _seen(api, bot, lambda: any("answer was lost" in m.text for m in api.sent), 60)
            mid = api.pushed(later)["message"]["message_id"]
            await _seen(
                api,
                bot,
                lambda: any("quick question" in m.text and m.reply_to == mid for m in api.sent),
                60,
            )
            # The cut-off chat run ended (recorded so); the quick question had a run of its own.
            first = found.query("SELECT status FROM runs WHERE id = %s", cut_off)
            assert first == [("error",)], first
            for update in asked:
                message_id = api.pushed(update)["message"]["message_id"]
                await _seen(
                    api, bot, lambda mid=message_id: any(m.reply_to == mid for m in api.sent)
                )
            assert bot.proc.returncode is None, bot.log
            assert "Traceback" not in bot.log, bot.log
    finally:
        if bot is not None:
            await _stop(bot)
            (tmp_path / "bot.log").write_text(bot.log)
        found.stop_all()
