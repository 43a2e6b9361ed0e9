"""Files an agent hands over, read where it ran and stored for a front end: a real file
in a real folder, a real SQLite file (engine.handover)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.gates.artifacts import SqlArtifactStore
from engine.handover import MARKERS_PER_TURN, collect_paths, collect_sends
from engine.store.database import Database

pytestmark = pytest.mark.timeout(30)


def _same(text: str) -> str:
    return text


async def test_files_are_stored_and_refusals_say_why(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.md").write_text("all well\n")
    (tmp_path / "secret.txt").write_text("outside\n")
    db = Database(tmp_path / "t.db")
    await db.open()
    try:
        sent = await collect_sends(
            db,
            work,
            "done\nTURNSTILE-SEND: notes.md\nTURNSTILE-SEND: ../secret.txt\n",
            max_bytes=1000,
            redact=_same,
        )
        assert [(s.given, s.name) for s in sent] == [
            ("notes.md", "notes.md"),
            ("../secret.txt", ""),
        ]
        stored = await SqlArtifactStore(db).get(sent[0].sha256)
        assert stored is not None
        assert stored.content == b"all well\n"
        assert sent[1].refused  # outside the run's folder: refused, with the reason
        # At most so many a turn.
        many = await collect_paths(
            db, work, ["notes.md"] * (MARKERS_PER_TURN + 3), max_bytes=1000, redact=_same
        )
        assert len(many) == MARKERS_PER_TURN
    finally:
        await db.close()


async def test_a_file_the_database_cannot_take_is_refused_not_lost_silently(
    tmp_path: Path,
) -> None:
    (tmp_path / "notes.md").write_text("all well\n")
    db = Database(tmp_path / "t.db")
    await db.open()
    await db.close()  # the database away when the turn hands the file over
    [sent] = await collect_paths(db, tmp_path, ["notes.md"], max_bytes=1000, redact=_same)
    assert sent.name == ""
    assert sent.refused == "notes.md could not be stored (the database is away); ask for it again"
