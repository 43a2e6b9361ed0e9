"""Units without the network: rendering, authorization, the bot's store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bot.render import MAX_CAPTION, MAX_MESSAGE, TELEGRAM, render_markdown
from chatfront import publish
from chatfront.auth import Action, Authorizer
from chatfront.store import InboundState, OutboxItem, SqlBotStore
from engine.redact import Redactor
from engine.store.database import Database
from engine.testing import FakeClock
from engine.turn import TurnOutput


def _u16(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


def test_markdown_becomes_entities_not_escapes() -> None:
    [msg] = render_markdown(
        "**bold** and `code` and [a link](https://example.com) 👋🏽 _it_",
        redact=Redactor(),
        document_threshold=10_000,
    )
    assert msg.text == "bold and code and a link 👋🏽 it"
    kinds = {e["type"] for e in msg.entities}
    assert {"bold", "code", "text_link", "italic"} <= kinds
    italic = next(e for e in msg.entities if e["type"] == "italic")
    # offsets are UTF-16 units: the waving hand with its skin tone counts 4
    assert italic == {"type": "italic", "offset": 30, "length": 2}
    assert _u16(msg.text[: msg.text.rindex("it")]) == 30


def test_malformed_markdown_is_never_lost() -> None:
    text = "unclosed **bold and `code and [link( and _under_score_s"
    [msg] = render_markdown(text, redact=Redactor(), document_threshold=10_000)
    assert msg.text == text


@pytest.mark.parametrize("size", [4096, 4097, 9000, 50_000])
def test_long_output_splits_on_lines_within_the_limit(size: int) -> None:
    lines, n = [], 0
    while sum(len(x) + 1 for x in lines) < size:
        n += 1
        lines.append(f"line {n}: " + "é" * (n % 50 + 1))
    text = "\n".join(lines)
    parts = render_markdown(text, redact=Redactor(), document_threshold=10**9)
    assert all(_u16(p.text) <= MAX_MESSAGE for p in parts)
    assert "".join(p.text for p in parts) == text
    assert all(p.text.endswith("\n") for p in parts[:-1])


def test_huge_single_line_is_hard_split() -> None:
    text = "x" * 10_000
    parts = render_markdown(text, redact=Redactor(), document_threshold=10**9)
    assert [len(p.text) for p in parts] == [4096, 4096, 1808]


def test_big_output_is_one_document_with_a_short_head() -> None:
    text = "\n".join(f"row {i}" for i in range(5000))
    [doc] = render_markdown(text, redact=Redactor(), document_threshold=1000, filename="o.md")
    assert doc.document == text
    assert doc.filename == "o.md"
    assert _u16(doc.text) <= MAX_CAPTION
    assert doc.text.count("\n") < 20


def test_secrets_redacted_everywhere() -> None:
    token = "123456789:AAFakeTokenForTestsOnly_abcdefghijklmn"
    redactor = Redactor([token, "hunter2hunter2"])
    for threshold in (10**9, 10):
        parts = render_markdown(
            f"token {token} pw hunter2hunter2 key ghp_abcdefghijklmnopqrstuvwxyz123456",
            redact=redactor,
            document_threshold=threshold,
        )
        blob = "".join(p.text + (p.document or "") for p in parts)
        assert token not in blob
        assert "hunter2hunter2" not in blob
        assert "ghp_abcdefghijklmnopqrstuvwxyz123456" not in blob


def test_empty_output_says_so() -> None:
    [msg] = render_markdown("  \n ", redact=Redactor(), document_threshold=100)
    assert msg.text == "(no output)"


def test_authorization_is_deny_by_default_and_per_action() -> None:
    nobody = Authorizer.from_ids(admins=(), approvers=(), operators=(), allowed_chats=())
    assert not nobody.check(1, "1", Action.HELP).allowed
    auth = Authorizer.from_ids(admins=(1,), approvers=(2,), operators=(3,), allowed_chats=("-5",))
    assert not auth.check(1, "-6", Action.HELP).allowed  # chat not allowed, even for an admin
    assert auth.check(1, "-5", Action.AUDIT).allowed
    assert auth.check(2, "-5", Action.APPROVE).allowed
    assert not auth.check(2, "-5", Action.PROMPT).allowed
    assert auth.check(3, "-5", Action.STOP).allowed
    assert not auth.check(3, "-5", Action.APPROVE).allowed
    assert not auth.check(3, "-5", Action.TASKS).allowed
    assert not auth.check(4, "-5", Action.HELP).allowed
    auth.follow_migration("-5", "-1005")
    assert auth.check(3, "-1005", Action.PROMPT).allowed


async def test_store_dedupes_prunes_and_keeps_the_offset(database: Any) -> None:
    clock = FakeClock()
    store = SqlBotStore(database, clock=clock)  # either backend (tests/pg_support.py)
    assert await store.record_inbound([(5, "{}"), (6, "{}"), (5, "{}")]) == {5, 6}
    assert await store.record_inbound([(6, "{}"), (7, "{}")]) == {7}
    await store.sync()
    for uid in (5, 6, 7):
        await store.mark_inbound(uid, InboundState.HANDLED)
    await store.enqueue([OutboxItem(chat_id="1", body="a"), OutboxItem(chat_id="1", body="b")])
    row = await store.next_outbox()
    assert row is not None
    await store.outbox_sent(row, 10)
    clock.advance(100)
    assert await store.prune(clock() - 50) == 3  # updates 5 and 6, message "a"
    assert await store.next_offset() == 8
    assert await store.pending_outbox() == 1
    assert await store.unhandled_inbound() == []


async def test_queue_depth_and_duplicate_updates(database: Any) -> None:
    store = SqlBotStore(database)
    assert await store.queue_prompt("1", None, update_id=1, user_id=2, body="a", depth=2) == (
        True,
        0,
    )
    assert await store.queue_prompt("1", None, update_id=1, user_id=2, body="a", depth=2) == (
        True,
        1,
    )
    assert await store.queue_prompt("1", None, update_id=2, user_id=2, body="b", depth=2) == (
        True,
        1,
    )
    assert await store.queue_prompt("1", None, update_id=3, user_id=2, body="c", depth=2) == (
        False,
        2,
    )
    assert await store.queued_count("1", None) == 2


async def test_huge_spilled_output_is_cut_and_says_where_the_rest_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publish, "MAX_OUTPUT_BYTES", 100_000)
    spill = tmp_path / "turn.out"
    spill.write_bytes(b"y" * 300_000)
    out = TurnOutput(text="y" * 1000, exit_code=0, spill_path=spill, size=300_000)
    async with Database(tmp_path / "bot.db") as db:
        pub = publish.Publisher(
            SqlBotStore(db),
            None,
            renderer=TELEGRAM,
            redactor=Redactor(),
            document_threshold=1000,
            documents_dir=tmp_path / "documents",
        )
        [item] = await pub.output_items(out, chat_id="1", thread_id=None, run_id="r1")
    # Streamed from the spill file into a document file the sender uploads from disk.
    assert item.kind == "file"
    body = Path(item.body).read_text()
    assert Path(item.body).parent == tmp_path / "documents"
    assert body.startswith("y" * 100_000 + "\n")
    assert "cut at 100,000 of 300,000 bytes" in body
    assert str(spill) in body


async def test_spilled_output_is_redacted_on_whole_lines_into_its_document(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reads of 40 bytes: most lines (and secrets) straddle two of them.
    monkeypatch.setattr(publish, "_CHUNK", 40)
    secret = "s3cr3t-value-of-the-bot"
    lines = [f"line {i} {secret} end" for i in range(200)] + ["é" * 50]
    spill = tmp_path / "turn.out"
    spill.write_text("\n".join(lines))
    out = TurnOutput(text="head", exit_code=0, spill_path=spill, size=spill.stat().st_size)
    async with Database(tmp_path / "bot.db") as db:
        pub = publish.Publisher(
            SqlBotStore(db),
            None,
            renderer=TELEGRAM,
            redactor=Redactor([secret]),
            document_threshold=1000,
            documents_dir=tmp_path / "documents",
        )
        [item] = await pub.output_items(out, chat_id="1", thread_id=None, run_id="r1")
    body = Path(item.body).read_text()
    assert secret not in body
    assert body.splitlines()[0].startswith("line 0 ")
    assert body.endswith("é" * 50)
    assert len(body.splitlines()) == 201
    assert item.caption is not None
    assert "201 lines" in item.caption
    assert secret not in item.caption


async def test_a_wave_row_says_waiting_for_a_person_once(tmp_path: Path) -> None:
    # A sub-task sent to a person: its row says so once, not as its phase and again as
    # its state ("p.c · ✋ waiting for a person · ✋ waiting for a person").
    from bot.controls import InlineControls
    from chatfront.sink import BotSink
    from engine.runs import ChatPlace
    from engine.sink import StatusUpdate
    from engine.store.runs import SqliteRunStore

    async with Database(tmp_path / "bot.db") as db:
        store = SqlBotStore(db)
        pub = publish.Publisher(
            store, None, renderer=TELEGRAM, redactor=Redactor(), document_threshold=1000
        )
        sink = BotSink(pub, SqliteRunStore(db), InlineControls())
        place = ChatPlace("-1001", None)
        sink.register("run-p", place, task="p")
        for run, task, phase, state in (
            ("run-a", "p.a", "implement", "running"),
            ("run-c", "p.c", "human_intervention", "human_intervention"),
            ("run-a", "p.a", "complete", "complete"),
        ):
            sink.register(run, place)
            await sink.update_status(
                StatusUpdate(
                    run_id=run,
                    mode="autopilot",
                    status=state,
                    phase=phase,
                    task=task,
                    parent="p",
                    wave=1,
                    parent_run="run-p",
                )
            )
        [wave] = await db.fetchall("SELECT body FROM bot_outbox WHERE ref LIKE 'wave:p:1:%'")
    assert str(wave["body"]).splitlines() == [
        "🛂 p · wave 1: 2 sub-tasks",
        "p.a · ✅ complete",
        "p.c · ✋ waiting for a person",
    ]
