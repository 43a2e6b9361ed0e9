"""How the runs on the workers look to ``turnstile runs`` (no queue import: start-up time)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from engine.errors import ConfigError
from engine.store.backend import AnyDatabase
from engine.workers.store import Placement, WorkerRecord, WorkerStore

if TYPE_CHECKING:
    from engine.settings import Settings

__all__ = [
    "WAITING_FOR_WORKER",
    "OnWorkers",
    "WorkerView",
    "is_warm",
    "look_on_workers",
    "waiting_note",
    "worker_views",
]

WAITING_FOR_WORKER: Final = "waiting for a worker"


def waiting_note(placement: Placement, alive: Sequence[WorkerRecord]) -> str | None:
    """Why the run waits (no live worker holds it), or None while it is in a worker's hands.

    A run no worker holds yet waits for a worker with its agent's CLI; when live workers
    exist but none has it, that is said (they will never take it).
    """
    if placement.ended:
        return None
    if placement.worker is not None and placement.worker in {w.name for w in alive}:
        return None
    tool = placement.spec.tool
    if alive and not any(tool in w.agents for w in alive):
        return f"{WAITING_FOR_WORKER} with {tool} installed"
    return WAITING_FOR_WORKER


@dataclass(frozen=True, slots=True)
class OnWorkers:
    """A run on the workers as a follower looks at it (:class:`engine.runs.follow.Where`):
    its placement, and why it waits for a worker now (None: it does not)."""

    placement: Placement
    waiting: str | None

    @property
    def ended(self) -> bool:
        return self.placement.ended

    @property
    def worker(self) -> str | None:
        """The worker running it now, else the one that ran it last."""
        return self.placement.worker or self.placement.last_worker


def look_on_workers(
    db: AnyDatabase, run_id: str, *, silent_after: float
) -> Callable[[], Awaitable[OnWorkers]]:
    """The look of a follower of run ``run_id`` on the workers (raises ConfigError once
    it is not on them)."""
    workers = WorkerStore(db)

    async def look() -> OnWorkers:
        placement = await workers.placement(run_id)
        if placement is None:
            raise ConfigError(f"run {run_id} is not on the workers")
        now = time.time()
        alive = [w for w in await workers.workers() if w.alive(now, silent_after)]
        return OnWorkers(placement, waiting_note(placement, alive) or placement.note or None)

    return look


@dataclass(frozen=True, slots=True)
class WorkerView:
    """How ``turnstile runs`` shows a run on the workers."""

    worker: str | None
    waiting: str | None
    placement: Placement
    warm: bool = False


async def worker_views(settings: Settings, db: AnyDatabase) -> dict[str, WorkerView]:
    """The runs on the workers: their last worker, and whether they wait for one."""
    store = WorkerStore(db)
    placements = await store.placements()
    if not placements:
        return {}
    now = time.time()
    alive = [w for w in await store.workers() if w.alive(now, settings.worker_timeout)]
    warm = await store.warm_runs()
    views: dict[str, WorkerView] = {}
    for p in placements:
        waiting = waiting_note(p, alive)
        views[p.run_id] = WorkerView(
            worker=p.last_worker,
            waiting=waiting,
            placement=p,
            warm=is_warm(p, waiting, warm),
        )
    return views


def is_warm(placement: Placement, waiting: str | None, warm: Mapping[str, str]) -> bool:
    """Whether the run's agent process stays resident on the live worker that holds it
    (a lost or stopped worker's word no longer counts)."""
    return (
        not placement.ended
        and waiting is None
        and placement.worker is not None
        and warm.get(placement.run_id) == placement.worker
    )
