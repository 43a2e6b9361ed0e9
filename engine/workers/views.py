"""How the runs on the workers look to ``turnstile runs`` (no queue import: start-up time)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from engine.store.backend import AnyDatabase
from engine.workers.store import Placement, WorkerStore

if TYPE_CHECKING:
    from engine.settings import Settings

__all__ = ["WAITING_FOR_WORKER", "WorkerView", "worker_views"]

WAITING_FOR_WORKER: Final = "waiting for a worker"


@dataclass(frozen=True, slots=True)
class WorkerView:
    """How ``turnstile runs`` shows a run on the workers."""

    worker: str | None
    waiting: str | None
    placement: Placement


async def worker_views(settings: Settings, db: AnyDatabase) -> dict[str, WorkerView]:
    """The runs on the workers: their last worker, and whether they wait for one."""
    store = WorkerStore(db)
    placements = await store.placements()
    if not placements:
        return {}
    now = time.time()
    alive = {w.name for w in await store.workers() if w.alive(now, settings.worker_timeout)}
    views: dict[str, WorkerView] = {}
    for p in placements:
        waiting = None
        if not p.ended and (p.worker is None or p.worker not in alive):
            waiting = WAITING_FOR_WORKER
        views[p.run_id] = WorkerView(worker=p.last_worker, waiting=waiting, placement=p)
    return views
