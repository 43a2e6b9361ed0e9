"""Agent questions: what may be asked, answered once, withdrawn when the turn ends
(on SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from engine.approvals import ApprovalPolicy, ApprovalRoute, QuestionState, QuestionStore
from engine.approvals.listener import ApprovalListener
from engine.approvals.questions import check_question
from engine.store.backend import AnyDatabase
from engine.store.database import Database
from engine.store.events import EventLog
from tests.test_tool_approvals import db  # the store on SQLite and on PostgreSQL

__all__ = ["db"]

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("question", "options", "problem"),
    [
        ("  ", None, "the question is empty"),
        ("x" * 3001, None, "longer than 3000"),
        ("Pick", ["a", "b", "c", "d", "e"], "at most 4 options"),
        ("Pick", ["only"], "one option is no choice"),
        ("Pick", ["a", " "], "an option is empty"),
        ("Pick", ["a", "a "], "two options are the same"),
        ("Pick", ["a", "b" * 61], "longer than 60"),
    ],
)
def test_a_question_the_chat_cannot_show_is_refused_saying_why(
    question: str, options: list[str] | None, problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        check_question(question, options)


def test_a_question_is_trimmed() -> None:
    assert check_question(" Which? ", [" a", "b "]) == ("Which?", ("a", "b"))
    assert check_question("Why?", None) == ("Why?", ())


async def test_a_question_is_answered_once_and_logged(db: AnyDatabase) -> None:
    store = QuestionStore(db)
    asked = await store.ask("r1", "Which one?", ("left", "right"))
    assert [q.id for q in await store.unposted()] == [asked.id]
    await store.mark_posted(asked.id)
    assert await store.unposted() == []
    first = await store.answer(asked.id, "left", by=7)
    second = await store.answer(asked.id, "right", by=8)
    assert first[0]
    assert not second[0]
    assert (second[1].state, second[1].answer, second[1].answered_by) == (
        QuestionState.ANSWERED,
        "left",
        7,
    )
    assert second[1].tool_result() == "The person answered: left"
    events = await EventLog(db).read("r1")
    assert [(e.kind, e.data.get("answer")) for e in events] == [
        ("question_asked", None),
        ("question_answered", "left"),
    ]


async def test_withdrawing_touches_only_the_named_runs(db: AnyDatabase) -> None:
    store = QuestionStore(db)
    mine = await store.ask("r1", "Go on?")
    other = await store.ask("r2", "Go on?")
    withdrawn = await store.withdraw_pending("the turn was stopped", run_ids=["r1"])
    assert [q.id for q in withdrawn] == [mine.id]
    assert withdrawn[0].tool_result() == "No answer: the turn was stopped."
    assert (await store.get(other.id)).state is QuestionState.PENDING
    # an answer after the withdrawal changes nothing
    assert not (await store.answer(mine.id, "yes", by=1))[0]


async def test_the_listener_waits_for_the_answer_and_withdraws_on_close(db: AnyDatabase) -> None:
    target = db.path if isinstance(db, Database) else db.url
    route = ApprovalRoute(database=target, run_id="r9", policy=ApprovalPolicy.ALL)
    store = QuestionStore(db)
    async with ApprovalListener(route) as listener:
        waiting = asyncio.create_task(listener._ask("Which port?", ()))
        while not await store.pending(run_id="r9"):
            await asyncio.sleep(0.02)
        [question] = await store.pending(run_id="r9")
        await asyncio.sleep(0.3)
        assert not waiting.done()  # no timeout: it waits for a person
        await store.answer(question.id, "8080", by=3)
        assert await asyncio.wait_for(waiting, 10) == "The person answered: 8080"
        # a second question is still waiting when the turn ends
        left = asyncio.create_task(listener._ask("Anything else?", ()))
        while len(await store.history("r9")) < 2:
            await asyncio.sleep(0.02)
        left.cancel()  # the turn's process is gone
        with contextlib.suppress(asyncio.CancelledError):
            await left
    history = await store.history("r9")
    assert [(q.state, q.answer) for q in history] == [
        (QuestionState.ANSWERED, "8080"),
        (QuestionState.CANCELLED, "the turn ended before an answer"),
    ]
