"""Bad days for the bot (issue 15, item 8): floods of strangers, a read-only database,
a revoked token, permanent delivery failures and a huge agent output.

The bot is the real one: in-process against the fake Bot API (``running_bot``) where only
its behaviour matters, or as a child process (``python -m engine.cli bot``) where its exit
code, its last words on stderr or its memory are what is tested.

What the store keeps on a bad day (the undelivered answer, the audit of refusals and lost
messages) is checked on both databases (``db_target``, ``bot_backend``); a read-only file,
a token refused before anything is stored and the 30 MB output are SQLite only.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from engine.store import Database, open_database
from tests.bot_process import CHAT, OPERATOR, bot_env, spawn
from tests.db_support import Target, setting
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import ADMIN as H_ADMIN
from tests.fakes.bot_harness import bot_settings, running_bot
from tests.support import wait_until


def _doctor(root: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", "doctor", "--offline"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
async def api() -> AsyncIterator[FakeBotApi]:
    async with FakeBotApi() as fake:
        yield fake


# --- a read-only database --------------------------------------------------------------


def _writable(path: Path) -> bool:
    try:
        with open(path, "r+b"):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def _read_only(path: Path) -> Iterator[None]:
    """Make ``path`` refuse writes for real: a file mode for a user, the immutable flag for
    root (root writes through any file mode)."""
    mode = path.stat().st_mode
    path.chmod(0o444)
    immutable = False
    try:
        if _writable(path):
            chattr = shutil.which("chattr")
            if chattr is None:
                pytest.skip("root writes through file modes and chattr is not installed")
            done = subprocess.run([chattr, "+i", str(path)], capture_output=True, check=False)
            immutable = done.returncode == 0
            if not immutable or _writable(path):
                pytest.skip("cannot make a file read-only for root on this filesystem")
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        path.chmod(mode)


async def test_read_only_database_fails_doctor_and_stops_the_bot_in_one_line(
    tmp_path: Path, api: FakeBotApi
) -> None:
    db_path = tmp_path / "turnstile.db"
    async with Database(db_path):
        pass
    env = bot_env(tmp_path, api)
    with _read_only(db_path):
        doctor = _doctor(tmp_path, env)
        [line] = [x for x in doctor.stdout.splitlines() if x[6:22].strip() == "database"]
        assert line.startswith("FAIL"), doctor.stdout
        assert "not written" in line
        assert doctor.returncode == 1

        bot = await spawn(tmp_path, env, "bot")
        try:
            code = await bot.exit_code(timeout=30)
        finally:
            await bot.kill()
    assert code != 0
    assert "Traceback" not in bot.log, bot.log
    last = bot.lines[-1]
    assert last.startswith("turnstile: "), bot.log
    assert str(db_path) in last
    assert "cannot be written" in last
    # Nothing was attempted against Telegram with a database that cannot record it.
    assert not api.calls_of("getUpdates")
    # Writable again: the doctor is content.
    assert "ok    database " in _doctor(tmp_path, env).stdout


# --- the Bot API refuses: a revoked token, permanent failures ---------------------------


async def test_revoked_token_stops_the_bot_in_one_line_and_keeps_the_message(
    tmp_path: Path, api: FakeBotApi, db_target: Target
) -> None:
    env = bot_env(tmp_path, api, TURNSTILE_DATABASE=setting(db_target))
    bot = await spawn(tmp_path, env, "bot")
    try:
        await bot.wait_log("running (polling)")
        await api.wait_until(lambda: bool(api.calls_of("getUpdates")))
        api.revoke_token()
        # The long poll in flight hands this over; the answer meets the revoked token.
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/help")
        code = await bot.exit_code(timeout=30)
    finally:
        await bot.kill()
    assert code != 0
    assert "Traceback" not in bot.log, bot.log
    last = bot.lines[-1]
    assert last.startswith("turnstile: Telegram refused the bot token"), bot.log
    assert "TURNSTILE_TELEGRAM_TOKEN" in last
    assert api.token not in bot.log
    # The answer is not failed for good: a new token delivers it.
    async with open_database(db_target) as db:
        rows = await db.fetchall("SELECT state, body FROM bot_outbox")
    assert [r["state"] for r in rows] == ["pending"]
    assert "Your commands:" in rows[0]["body"]


async def test_token_refused_at_start_is_one_line(tmp_path: Path, api: FakeBotApi) -> None:
    env = bot_env(tmp_path, api)
    api.revoke_token()
    bot = await spawn(tmp_path, env, "bot")
    try:
        code = await bot.exit_code(timeout=30)
    finally:
        await bot.kill()
    assert code != 0
    assert "Traceback" not in bot.log, bot.log
    assert bot.lines[-1].startswith("turnstile: Telegram refused the bot token"), bot.log


@pytest.mark.usefixtures("isolated_env")
@pytest.mark.parametrize(
    ("status", "said", "bot_backend"),
    [
        (403, "bot was blocked", "sqlite"),
        (403, "bot was blocked", "postgresql"),
        (404, "Not Found", "sqlite"),
        (400, "Chat not found", "sqlite"),
    ],
    indirect=["bot_backend"],
)
async def test_permanent_refusal_is_logged_audited_and_shown_in_audit(
    tmp_path: Path, status: int, said: str, bot_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with FakeBotApi() as fake, running_bot(fake, bot_settings(fake, tmp_path)) as rt:
        fake.fail(["sendMessage"], status, count=1)
        fake.push_message(chat_id=CHAT, user_id=OPERATOR, text="/help")
        await fake.wait_until(lambda: any(c.status == status for c in fake.calls))
        assert rt.sender is not None
        await rt.sender.wait_idle()
        # Still running: the next answer arrives, and /audit names the lost one.
        fake.push_message(chat_id=CHAT, user_id=H_ADMIN, text="/audit")
        report = await fake.wait_for_message(lambda m: "Undelivered" in m.text)
        entries = await rt.store.audit_entries()
    [failed] = [e for e in entries if e.action == "deliver"]
    assert failed.outcome == "failed"
    assert failed.chat_id == str(CHAT)
    assert failed.reason is not None
    assert said in failed.reason
    assert said in report.text
    assert any("not delivered" in r.getMessage() and said in r.getMessage() for r in caplog.records)
    assert not [m for m in fake.sent if "Your commands:" in m.text]


# --- a flood of strangers ---------------------------------------------------------------


@pytest.mark.usefixtures("isolated_env", "bot_backend")
async def test_a_flood_of_strangers_never_delays_a_real_answer(tmp_path: Path) -> None:
    strangers, backlog = 150, 10
    async with FakeBotApi() as fake:
        settings = bot_settings(fake, tmp_path, refusal_backlog=backlog)
        async with running_bot(fake, settings) as rt:
            # Telegram slow: every answer waits until everything has arrived and been handled.
            fake.hold(["sendMessage"])
            for i in range(strangers):
                uid = 5000 + i
                if i % 2:
                    fake.push_message(chat_id=uid, user_id=uid, text="hello")  # a private chat
                else:
                    fake.push_message(chat_id=CHAT, user_id=uid, text="/help")  # no role
            fake.push_message(chat_id=CHAT, user_id=OPERATOR, text="/help")

            async def all_handled() -> bool:
                refused = await rt.db.fetchone(
                    "SELECT COUNT(*) FROM audit_log WHERE origin = 'bot' AND outcome = 'refused'"
                )
                return bool(refused and refused[0] == strangers) and (
                    await rt.store.pending_outbox() == 1
                )

            await wait_until(all_handled, timeout=60, what="every update handled")
            fake.release()
            answer = await fake.wait_for_message(lambda m: "Your commands:" in m.text)
            assert rt.sender is not None
            await rt.sender.wait_idle()
            entries = await rt.store.audit_entries(limit=1000)
    refusals = [m for m in fake.sent if m.text.startswith("⛔")]
    # Only the one refusal already in flight when Telegram slowed down went first.
    assert fake.sent.index(answer) <= 1
    # The lane is bounded; every refusal beyond it is in the audit, marked unanswered.
    assert len(refusals) == backlog
    unanswered = [
        e for e in entries if e.outcome == "refused" and "not answered" in (e.reason or "")
    ]
    assert len(unanswered) == strangers - backlog
    assert {m.chat_id for m in refusals} <= {CHAT, *range(5000, 5000 + strangers)}


# --- a huge output ----------------------------------------------------------------------

_LINE = "{:08d} the quick brown fox jumps over the lazy dog, again and again\n"
_HUGE_LINES = 30 * 1024 * 1024 // len(_LINE.format(0))

_PRINTER = f"""
import sys
out = sys.stdout
for i in range({_HUGE_LINES}):
    out.write({_LINE!r}.format(i))
out.flush()
"""


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/PID/status")


@pytest.mark.timeout(180)  # 30 MB through a real bot: over 60 s on a loaded 2-core machine
async def test_a_30_mb_output_is_streamed_whole_to_the_document(
    tmp_path: Path, api: FakeBotApi
) -> None:
    printer = tmp_path / "printer.py"
    printer.write_text(_PRINTER)
    expected = hashlib.sha256()
    size = 0
    for i in range(_HUGE_LINES):
        line = _LINE.format(i).encode()
        expected.update(line)
        size += len(line)
    # TMPDIR: the spill file stays in this test's folder.
    env = bot_env(
        tmp_path,
        api,
        TURNSTILE_AGENT_COMMAND=f"{sys.executable} {printer} {{prompt}}",
        TMPDIR=str(tmp_path),
    )
    bot = await spawn(tmp_path, env, "bot")
    try:
        await bot.wait_log("running (polling)")
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
        await api.wait_for_message(lambda m: "bound" in m.text)
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="print it all")
        doc = await api.wait_for_message(lambda m: m.document is not None, timeout=180)
        peak = _peak_rss_kib(bot.proc.pid)
        bot.proc.send_signal(signal.SIGTERM)
        assert await bot.exit_code() == 0, bot.log
    finally:
        await bot.kill()
    assert doc.document is not None
    assert len(doc.document) == size
    assert hashlib.sha256(doc.document).hexdigest() == expected.hexdigest()
    assert "the whole output" in doc.text
    # The redacted copy is gone once delivered; the spill file stays with the turn.
    assert not list((tmp_path / "runs" / "documents").iterdir())
    assert len(list((tmp_path / "turnstile-spill").iterdir())) == 1
    # The bound: the bot's memory does not grow with the output.
    assert peak <= 100 * 1024, f"the bot peaked at {peak / 1024:.0f} MiB"
