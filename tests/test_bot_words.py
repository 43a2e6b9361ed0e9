"""What people read: states in words, people by name, rendered excerpts, short task lines."""

from __future__ import annotations

from pathlib import Path

from bot.render import render_parts
from chatfront.people import People, display_name
from chatfront.sink import status_text
from chatfront.store import SqlBotStore
from chatfront.text import excerpt
from engine.humane import humane, words
from engine.redact import Redactor
from engine.sink import StatusUpdate
from engine.store.database import Database


def test_states_are_words() -> None:
    assert words("research:awaiting_approval") == "research, waiting for approval"
    assert words("human_intervention") == "✋ waiting for a person"
    assert words("test_design") == "test design"
    text = humane("[T1] left design:awaiting_approval; `x --transition human_intervention`")
    assert text == "[T1] left design, waiting for approval; `x --transition human_intervention`"


def test_status_has_one_turn_count_and_no_labels() -> None:
    update = StatusUpdate(
        run_id="auto-1",
        mode="auto",
        status="running",
        phase="execute",
        turn=4,
        round=3,
        max_turns=10,
        started_at=100.0,
        last_event="Execute running",
    )
    text = status_text(update, now=172.0)
    assert text == (
        "🤖 Auto run auto-1\n⏳ running · Execute · turn 4 · round 3 of 10 · 1m12s\nExecute running"
    )


def test_an_excerpt_is_rendered_not_raw() -> None:
    markdown = "# Research\n\nThe **cache** is `lru`.\n\n```py\nx = 1\n```\nmore\nlines\nhere\n"
    rendered = render_parts(
        [("🛂 head\n", False), (excerpt(markdown, lines=6), True), ("\ntail", False)],
        redact=Redactor([]),
    )
    assert "#" not in rendered.text
    assert "```" not in rendered.text
    assert rendered.text.startswith("🛂 head\n")
    assert rendered.text.endswith("\ntail")
    kinds = {e["type"] for e in rendered.entities}
    assert {"bold", "code", "pre"} <= kinds


async def test_people_are_remembered_by_name(tmp_path: Path) -> None:
    assert display_name("Ann  Lee", "ann") == "Ann Lee"
    assert display_name("", "ann") == "@ann"
    assert display_name(None, None) is None

    class User:
        id = 7
        first_name = "Ann"
        username = "ann"

    async with Database(tmp_path / "t.db") as db:
        store = SqlBotStore(db)
        people = People(store)
        assert people.name(7) == "user 7"
        await people.seen(User())
        assert people.name(7) == "Ann"
        again = People(store)  # a restart: read back from the database
        await again.load()
        assert again.name(7) == "Ann"
