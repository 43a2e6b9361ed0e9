"""Pausing a run: it finishes the tool call it is in, then waits until someone lets it go on.

A pause is a row of ``run_pauses`` (no row: not paused), so every process that runs the
run's turns (the bot, a terminal, a worker) sees it. Two places wait while it is there:

- the permission server, before it takes the agent's next tool call (the call it is in
  has run; the next one waits): this needs a CLI that asks turnstile before its tool calls
  (Claude Code with tool approvals or a preset);
- the supervisor, before the run's next turn starts, inside the turn slot: a paused run
  keeps its slot, so a paused run is not overtaken by one queued behind it.

Nothing times out: a stop ends the wait as it ends a turn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from engine.store.events import EventKind, add_event, events_written

if TYPE_CHECKING:
    from engine.store.backend import AnyDatabase

__all__ = ["Pauses", "RunPause"]

# How often a paused run looks whether it may go on. A person's press is far slower.
_POLL_SECONDS: Final = 0.25


@dataclass(frozen=True, slots=True)
class RunPause:
    run_id: str
    paused_by: int | None
    paused_at: float


class Pauses:
    """The pauses of one database."""

    def __init__(
        self,
        db: AnyDatabase,
        *,
        poll: float = _POLL_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.db = db
        self.poll = poll
        self._clock = clock

    async def pause(self, run_id: str, *, by: int | None) -> bool:
        """Pause ``run_id``; False when it was paused already."""
        now = self._clock()
        async with self.db.transaction() as conn:
            cursor = await conn.execute(
                "INSERT INTO run_pauses (run_id, paused_by, paused_at) VALUES (?, ?, ?)"
                " ON CONFLICT (run_id) DO NOTHING RETURNING run_id",
                (run_id, by, now),
            )
            paused = await cursor.fetchone() is not None
            if paused:
                await add_event(
                    conn, self.db, EventKind.PAUSED, run_id=run_id, data={"by": by}, at=now
                )
        if paused:
            events_written(self.db)
        return paused

    async def resume(self, run_id: str, *, by: int | None) -> bool:
        """Let ``run_id`` go on; False when it was not paused."""
        async with self.db.transaction() as conn:
            cursor = await conn.execute(
                "DELETE FROM run_pauses WHERE run_id = ? RETURNING run_id", (run_id,)
            )
            resumed = await cursor.fetchone() is not None
            if resumed:
                await add_event(
                    conn, self.db, EventKind.PAUSE_ENDED, run_id=run_id, data={"by": by}
                )
        if resumed:
            events_written(self.db)
        return resumed

    async def get(self, run_id: str) -> RunPause | None:
        row = await self.db.fetchone(
            "SELECT run_id, paused_by, paused_at FROM run_pauses WHERE run_id = ?", (run_id,)
        )
        return RunPause(row[0], row[1], row[2]) if row is not None else None

    async def of(self, run_ids: Collection[str] | None = None) -> dict[str, RunPause]:
        """The pauses of ``run_ids`` (None: every paused run)."""
        rows = await self.db.fetchall("SELECT run_id, paused_by, paused_at FROM run_pauses")
        found = {r[0]: RunPause(r[0], r[1], r[2]) for r in rows}
        return found if run_ids is None else {k: v for k, v in found.items() if k in run_ids}

    async def wait_while_paused(self, run_id: str) -> float:
        """Return once ``run_id`` is not paused; how long it waited (0: not paused)."""
        if await self.get(run_id) is None:
            return 0.0
        started = time.monotonic()
        paused = True
        while paused:
            await asyncio.sleep(self.poll)
            paused = await self.get(run_id) is not None
        return time.monotonic() - started
