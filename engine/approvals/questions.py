"""Questions an agent asks a person mid-turn, and their answers.

The permission server offers the agent an ``ask`` tool beside ``approve``: a question, in
free text or with up to four options. It is recorded here, a front end posts it to the
run's chat, and the first answer of someone allowed to give one (a compare-and-set from
``pending``) becomes the tool's result. The turn waits however long that takes; stopping
the turn withdraws the question.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Final

from engine.errors import NotFoundError
from engine.store.events import EventKind, add_event, events_written

if TYPE_CHECKING:
    from engine.store.backend import AnyDatabase

__all__ = [
    "MAX_OPTIONS",
    "AgentQuestion",
    "QuestionState",
    "QuestionStore",
    "check_question",
]

#: The most options a question may offer (one button each).
MAX_OPTIONS: Final = 4
#: The longest option (a button's label must stay readable on a phone).
MAX_OPTION_CHARS: Final = 60
#: The longest question (a chat message holds 4,096 characters, with room for the rest).
MAX_QUESTION_CHARS: Final = 3000


class QuestionState(StrEnum):
    PENDING = "pending"
    ANSWERED = "answered"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class AgentQuestion:
    """One question of an agent's turn."""

    id: int
    run_id: str
    question: str
    options: tuple[str, ...]
    state: QuestionState
    answer: str | None
    answered_by: int | None
    posted_at: float | None
    created_at: float
    answered_at: float | None

    @classmethod
    def from_row(cls, row: Any) -> AgentQuestion:
        return cls(
            id=row["id"],
            run_id=row["run_id"],
            question=row["question"],
            options=tuple(json.loads(row["options_json"])),
            state=QuestionState(row["state"]),
            answer=row["answer"],
            answered_by=row["answered_by"],
            posted_at=row["posted_at"],
            created_at=row["created_at"],
            answered_at=row["answered_at"],
        )

    def tool_result(self) -> str:
        """What the agent reads back: the answer, or why there is none."""
        if self.state is QuestionState.ANSWERED:
            return f"The person answered: {self.answer}"
        return f"No answer: {self.answer or 'the question was withdrawn'}."


def check_question(question: str, options: Sequence[str] | None) -> tuple[str, tuple[str, ...]]:
    """The question and options as they are recorded; ValueError says what is wrong.

    The agent reads the error (a tool error), so it can ask again, better.
    """
    text = question.strip()
    if not text:
        raise ValueError("the question is empty")
    if len(text) > MAX_QUESTION_CHARS:
        raise ValueError(f"the question is longer than {MAX_QUESTION_CHARS} characters")
    chosen = tuple(o.strip() for o in options or ())
    if len(chosen) > MAX_OPTIONS:
        raise ValueError(f"at most {MAX_OPTIONS} options (one button each); got {len(chosen)}")
    if len(chosen) == 1:
        raise ValueError("one option is no choice: give two to four, or none for a free answer")
    for option in chosen:
        if not option:
            raise ValueError("an option is empty")
        if len(option) > MAX_OPTION_CHARS:
            raise ValueError(f"an option is longer than {MAX_OPTION_CHARS} characters")
    if len(set(chosen)) != len(chosen):
        raise ValueError("two options are the same")
    return text, chosen


class QuestionStore:
    """Agent questions on the shared database (SQLite or PostgreSQL)."""

    def __init__(self, db: AnyDatabase, *, clock: Callable[[], float] = time.time) -> None:
        self.db = db
        self._clock = clock

    async def ask(self, run_id: str, question: str, options: Sequence[str] = ()) -> AgentQuestion:
        now = self._clock()
        async with self.db.transaction() as conn:
            cursor = await conn.execute(
                "INSERT INTO agent_questions (run_id, question, options_json, created_at)"
                " VALUES (?, ?, ?, ?) RETURNING id",
                (run_id, question, json.dumps(list(options)), now),
            )
            row = await cursor.fetchone()
            assert row is not None
            question_id = int(row[0])
            data = {"question_id": question_id, "question": question, "options": list(options)}
            await add_event(
                conn, self.db, EventKind.QUESTION_ASKED, run_id=run_id, data=data, at=now
            )
        events_written(self.db)
        return await self.get(question_id)

    async def get(self, question_id: int) -> AgentQuestion:
        row = await self.db.fetchone("SELECT * FROM agent_questions WHERE id = ?", (question_id,))
        if row is None:
            raise NotFoundError(f"no question {question_id}")
        return AgentQuestion.from_row(row)

    async def unposted(self) -> list[AgentQuestion]:
        """Waiting questions no front end has shown yet, oldest first."""
        rows = await self.db.fetchall(
            "SELECT * FROM agent_questions WHERE state = 'pending' AND posted_at IS NULL"
            " ORDER BY id"
        )
        return [AgentQuestion.from_row(r) for r in rows]

    async def mark_posted(self, question_id: int) -> None:
        await self.db.execute(
            "UPDATE agent_questions SET posted_at = ? WHERE id = ?", (self._clock(), question_id)
        )

    async def pending(self, *, run_id: str | None = None) -> list[AgentQuestion]:
        if run_id is None:
            rows = await self.db.fetchall(
                "SELECT * FROM agent_questions WHERE state = 'pending' ORDER BY id"
            )
        else:
            rows = await self.db.fetchall(
                "SELECT * FROM agent_questions WHERE state = 'pending' AND run_id = ? ORDER BY id",
                (run_id,),
            )
        return [AgentQuestion.from_row(r) for r in rows]

    async def answer(
        self, question_id: int, answer: str, *, by: int | None
    ) -> tuple[bool, AgentQuestion]:
        """Answer a waiting question (compare-and-set); False: it was settled already."""
        return await self._settle(question_id, QuestionState.ANSWERED, answer, by)

    async def withdraw(self, question_id: int, reason: str) -> tuple[bool, AgentQuestion]:
        """Withdraw a waiting question (its turn stopped): the agent reads ``reason``."""
        return await self._settle(question_id, QuestionState.CANCELLED, reason, None)

    async def withdraw_pending(self, reason: str, *, run_ids: list[str]) -> list[AgentQuestion]:
        """Withdraw every waiting question of ``run_ids``; returns the ones withdrawn."""
        withdrawn = []
        for run_id in run_ids:
            for question in await self.pending(run_id=run_id):
                changed, settled = await self.withdraw(question.id, reason)
                if changed:
                    withdrawn.append(settled)
        return withdrawn

    async def _settle(
        self, question_id: int, state: QuestionState, answer: str, by: int | None
    ) -> tuple[bool, AgentQuestion]:
        now = self._clock()
        async with self.db.transaction() as conn:
            cursor = await conn.execute(
                "UPDATE agent_questions SET state = ?, answer = ?, answered_by = ?,"
                " answered_at = ? WHERE id = ? AND state = 'pending' RETURNING run_id",
                (state.value, answer, by, now, question_id),
            )
            row = await cursor.fetchone()
            if row is not None:
                data = {"question_id": question_id, "state": state.value, "by": by}
                if state is QuestionState.ANSWERED:
                    data["answer"] = answer
                else:
                    data["reason"] = answer
                await add_event(
                    conn,
                    self.db,
                    EventKind.QUESTION_ANSWERED,
                    run_id=str(row["run_id"]),
                    data=data,
                    at=now,
                )
        if row is not None:
            events_written(self.db)
        return row is not None, await self.get(question_id)

    async def history(self, run_id: str) -> list[AgentQuestion]:
        rows = await self.db.fetchall(
            "SELECT * FROM agent_questions WHERE run_id = ? ORDER BY id", (run_id,)
        )
        return [AgentQuestion.from_row(r) for r in rows]
