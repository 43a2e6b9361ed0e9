"""The bot store on both databases: a SQLite file and a real PostgreSQL (tests/pg_support.py).

Round trips with supergroup ids and exact times; the writes that used to be SQLite's
``INSERT OR REPLACE`` keep what they must keep; the read-then-write transactions
(queueing, taking, live messages, reason requests) hold under two processes at once,
where PostgreSQL's READ COMMITTED transactions do not serialise by themselves.
"""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path
from typing import Any

import pytest

from bot.render import TELEGRAM
from chatfront.publish import Publisher
from chatfront.store import OutboxItem, SqlBotStore
from engine.redact import Redactor
from engine.store import SqliteRunStore
from engine.turn import TurnOutput
from tests.support import race_two

REPO = Path(__file__).resolve().parent.parent
SUPERGROUP = "-1001234567890123"  # a place id: a Telegram id as text, beyond a 4-byte INTEGER
EPOCH = 1764560000.123456  # float4 would read back 1.76456e+09

pytestmark = pytest.mark.timeout(180)


async def test_supergroup_ids_and_exact_times_round_trip(database: Any) -> None:
    store = SqlBotStore(database, clock=lambda: EPOCH)
    binding = await store.bind(
        SUPERGROUP, "7", agent="claude", project="p", workdir="/w", session_id="s", user_id=42
    )
    assert (binding.chat_id, binding.thread_id, binding.bound_by) == (SUPERGROUP, "7", 42)
    assert await store.queue_prompt(
        SUPERGROUP, "7", update_id=900_000_000_001, user_id=42, body="hi", depth=5
    ) == (True, 0)
    await store.enqueue([OutboxItem(chat_id=SUPERGROUP, thread_id="7", body="out", run_id="r1")])
    row = await store.next_outbox()
    assert row is not None
    assert row.item.chat_id == SUPERGROUP
    await store.outbox_sent(row, 5_000_000_000)
    assert await store.run_of_message(SUPERGROUP, 5_000_000_000) == "r1"
    await store.ask_reason(SUPERGROUP, 42, "g1")
    request = await store.reason_request(SUPERGROUP, 42)
    assert request is not None
    assert request.created_at == EPOCH  # DOUBLE PRECISION: not a second lost
    # A group that became a supergroup: everything follows it, the old id is remembered.
    await store.migrate_chat("-5", SUPERGROUP)
    await store.migrate_chat("-5", SUPERGROUP)  # followed twice (two updates say so)
    assert await store.migrated_from() == {SUPERGROUP: "-5"}
    # Binding again replaces the binding whole: a new session, no turns, no run.
    await store.set_binding_run(SUPERGROUP, "7", "r1")
    again = await store.bind(
        SUPERGROUP, "7", agent="codex", project="q", workdir="/v", session_id="t", user_id=43
    )
    assert (again.agent, again.session_id, again.turns, again.run_id, again.bound_by) == (
        "codex",
        "t",
        0,
        None,
        43,
    )
    assert len(await store.bindings()) == 1


async def test_a_gate_added_again_keeps_its_decision(database: Any) -> None:
    """Regression: ``INSERT OR REPLACE`` reopened a decided gate and forgot who decided."""
    store = SqlBotStore(database, clock=lambda: EPOCH)
    place = {"task": "T", "phase": "research", "sha256": "a" * 64, "artifact_name": "r.md"}
    await store.add_gate(
        "g1", **place, chat_id="-5", thread_id=None, run_id="autopilot-20250101-120000-0f3a9c"
    )
    assert await store.close_gate("g1", "approved", 42)
    await store.add_gate(
        "g1", **place, chat_id=SUPERGROUP, thread_id="3", run_id="autopilot-20250101-120000-0f3a9c"
    )
    gate = await store.gate("g1")
    assert gate is not None
    assert (gate.state, gate.chat_id, gate.thread_id) == ("approved", SUPERGROUP, "3")
    row = await database.fetchone(
        "SELECT decided_by, decided_at FROM bot_gates WHERE gate_id = ?", ("g1",)
    )
    assert (row["decided_by"], row["decided_at"]) == (42, EPOCH)
    assert await store.open_gates() == []
    # An open gate added again stays open (it does not supersede itself).
    await store.add_gate("g2", **place, chat_id="-5", thread_id=None, run_id=None)
    await store.add_gate("g2", **place, chat_id="-5", thread_id=None, run_id=None)
    assert [g.gate_id for g in await store.open_gates()] == ["g2"]
    await store.add_gate("g3", **place, chat_id="-5", thread_id=None, run_id=None)
    assert [g.gate_id for g in await store.open_gates()] == ["g3"]  # g2 superseded


async def test_a_reason_asked_again_keeps_the_message_that_asked(database: Any) -> None:
    """Regression: ``INSERT OR REPLACE`` reset ``prompt_message_ref`` to NULL."""
    now = [1000.0]
    store = SqlBotStore(database, clock=lambda: now[0])
    await store.ask_reason("-5", 42, "g1", prompt_ref="reason:g1:42:7")
    now[0] += 10
    await store.ask_reason("-5", 42, "g1")  # renewed: still the message that asked
    request = await store.reason_request("-5", 42)
    assert request is not None
    assert (request.gate_id, request.prompt_ref, request.created_at) == (
        "g1",
        "reason:g1:42:7",
        1010.0,
    )
    await store.ask_reason("-5", 42, "g2")  # another gate: not that message any more
    request = await store.reason_request("-5", 42)
    assert request is not None
    assert (request.gate_id, request.prompt_ref) == ("g2", None)


async def test_touching_live_messages_matches_a_prefix_exactly(database: Any) -> None:
    store = SqlBotStore(database)
    for ref in ("gate:a1", "Gate:a2", "gatex:a3", "gate%b", "run:1"):
        await store.enqueue([OutboxItem(chat_id="1", body=ref, ref=ref)])
        row = await store.next_outbox()
        assert row is not None
        await store.outbox_sent(row, len(ref))
    assert await store.dirty_live() == []
    # Case matters on both (LIKE ignores it on SQLite only), and _ or % are no wildcards.
    assert await store.touch_live("gate:") == 1
    assert await store.touch_live("gate_") == 0
    assert await store.touch_live("gate%") == 1
    assert sorted(m.ref for m in await store.dirty_live()) == ["gate%b", "gate:a1"]


async def test_a_prompt_taken_becomes_a_turn_and_a_steering_replay_is_ignored(
    database: Any,
) -> None:
    store = SqlBotStore(database)
    runs = SqliteRunStore(database)
    await runs.create_run("r1", mode="chat", agent="claude", session_id="s", chat_id=SUPERGROUP)
    await store.bind(
        SUPERGROUP, None, agent="claude", project="p", workdir="/w", session_id="s", user_id=1
    )
    await store.queue_prompt(SUPERGROUP, None, update_id=1, user_id=1, body="one", depth=5)
    await store.queue_prompt(SUPERGROUP, None, update_id=2, user_id=1, body="two", depth=5)
    taken = await store.take_prompt(SUPERGROUP, None, "r1", 1)
    assert taken is not None
    prompt, turn_id = taken
    assert prompt.body == "one"
    steer = await store.hold_for_steering(SUPERGROUP, None, update_id=3, user_id=1, body="faster")
    assert steer is not None
    assert await store.hold_for_steering(SUPERGROUP, None, update_id=3, user_id=1, body="x") is None
    await store.commit_turn(
        prompt.id,
        turn_id,
        TurnOutput(text="done", exit_code=0),
        [OutboxItem(chat_id=SUPERGROUP, body="done", run_id="r1")],
        chat_id=SUPERGROUP,
        thread_id=None,
    )
    await store.steering_done(steer, delivered=False)  # waits for the next turn
    assert await store.queued_count(SUPERGROUP, None) == 2
    second = await store.take_prompt(SUPERGROUP, None, "r1", 2)
    assert second is not None
    assert second[0].body == "two"
    turns = await runs.turns("r1")
    assert [(t.seq, t.attempt, t.output) for t in turns] == [(1, 1, "done"), (2, 1, None)]
    binding = await store.binding(SUPERGROUP, None)
    assert binding is not None
    assert binding.turns == 1


# --- two processes at once -------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    from chatfront.store import SqlBotStore
    from engine.store.backend import open_database

    async def main(mode, target, count, name):
        async with open_database(target) as db:
            store = SqlBotStore(db)
            print("ready", flush=True)
            sys.stdin.readline()  # the parent says go once both are ready
            if mode == "queue_take":
                # Queue one, take one, in turns: both processes on the same chat queue.
                taken = []
                for i in range(count):
                    await store.queue_prompt("-100", None, update_id=None, user_id=1,
                                             body=f"{name}-{i}", depth=10_000)
                    got = await store.take_prompt("-100", None, "r1", i)
                    if got is not None:
                        taken.append(got[0].id)
                while (got := await store.take_prompt("-100", None, "r1", count)) is not None:
                    taken.append(got[0].id)
                print(json.dumps({"taken": taken}))
            elif mode == "depth":
                queued = 0
                for i in range(count):
                    ok, _ = await store.queue_prompt("-100", None, update_id=None, user_id=1,
                                                     body=f"{name}-{i}", depth=7)
                    queued += ok
                print(json.dumps({"queued": queued}))
            elif mode == "live":
                for i in range(count):
                    await store.set_live(f"status:{i}", chat_id="-100", thread_id=None,
                                         body=f"{name} {i}")
                print(json.dumps({"ok": True}))

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
    """
)


async def _race(tmp_path: Path, mode: str, target: str, count: int) -> list[dict[str, Any]]:
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    return await race_two(script, mode, target, str(count), cwd=REPO)


def _target(database: Any) -> str:
    return str(database.path) if database.dialect == "sqlite" else database.url.conninfo()


async def test_two_processes_queueing_and_taking_take_every_prompt_once(
    database: Any, tmp_path: Path
) -> None:
    await SqliteRunStore(database).create_run("r1", mode="chat", agent="a", session_id="s")
    count = 40
    results = await _race(tmp_path, "queue_take", _target(database), count)
    taken = [i for r in results for i in r["taken"]]
    rows = await database.fetchall("SELECT id, state, turn_id FROM bot_prompts")
    assert len(rows) == 2 * count
    assert sorted(taken) == sorted(r["id"] for r in rows)  # every prompt taken exactly once
    assert {r["state"] for r in rows} == {"running"}
    turns = await database.fetchall("SELECT id FROM turns WHERE run_id = ?", ("r1",))
    assert sorted(t["id"] for t in turns) == sorted(r["turn_id"] for r in rows)


async def test_two_processes_queueing_never_pass_the_depth(database: Any, tmp_path: Path) -> None:
    results = await _race(tmp_path, "depth", _target(database), 20)
    assert sum(r["queued"] for r in results) == 7
    assert await SqlBotStore(database).queued_count("-100", None) == 7


async def test_two_processes_setting_a_live_message_queue_it_once(
    database: Any, tmp_path: Path
) -> None:
    count = 30
    await _race(tmp_path, "live", _target(database), count)
    rows = await database.fetchall("SELECT ref FROM bot_outbox")
    assert sorted(r["ref"] for r in rows) == sorted(f"status:{i}" for i in range(count))


async def test_a_live_message_s_first_words_never_replace_newer_ones(database: Any) -> None:
    """A run's first status can be set before the words that announce it (the run started
    turning first): the announcement is then dropped, but its reply-to is kept."""
    store = SqlBotStore(database, clock=lambda: EPOCH)
    place: dict[str, Any] = {"chat_id": "-5", "thread_id": None, "run_id": "r1"}
    await store.set_live("status:r1", body="Auto run r1 · turn 1", **place)
    await store.set_live(
        "status:r1", body="Auto run r1 started", reply_to=77, initial=True, **place
    )
    row = await store.next_outbox()
    assert row is not None
    assert (row.item.body, row.item.reply_to) == ("Auto run r1 · turn 1", 77)
    # Sent, then announced late: the message keeps what it shows.
    await store.outbox_sent(row, 900)
    await store.set_live("status:r1", body="Auto run r1 started", initial=True, **place)
    live = await store.get_live("status:r1")
    assert live is not None
    assert live.body == "Auto run r1 · turn 1"
    # Announced first (the usual order), the words go out, and later updates edit them.
    await store.set_live(
        "status:r2",
        body="Auto run r2 started",
        reply_to=78,
        initial=True,
        **{**place, "run_id": "r2"},
    )
    await store.set_live("status:r2", body="Auto run r2 · turn 1", **{**place, "run_id": "r2"})
    row = await store.next_outbox()
    assert row is not None
    assert (row.item.body, row.item.reply_to) == ("Auto run r2 · turn 1", 78)


class _SlowFirstWrite(SqlBotStore):
    """The first live write takes a while to commit (a slow PostgreSQL connection)."""

    def __init__(self, database: Any) -> None:
        super().__init__(database)
        self.slow = True
        self.writing = asyncio.Event()

    async def set_live(self, ref: str, **kw: Any) -> None:
        if self.slow:
            self.slow = False
            self.writing.set()
            await asyncio.sleep(0.3)
        await super().set_live(ref, **kw)


async def test_a_live_message_shows_its_last_words_when_writes_overlap(database: Any) -> None:
    """A turn's "working" still being written when its "done" is said: "done" stays."""
    store = _SlowFirstWrite(database)
    publisher = Publisher(
        store, None, renderer=TELEGRAM, redactor=Redactor(), document_threshold=100_000
    )
    place: dict[str, Any] = {"chat_id": "-5", "thread_id": None, "run_id": "r1"}
    working = asyncio.create_task(publisher.live("progress:r1:1", "⏳ working", **place))
    await store.writing.wait()
    await publisher.live("progress:r1:1", "✅ done", **place)
    await working
    row = await store.next_outbox()
    assert row is not None
    assert row.item.body == "✅ done"
