"""A person's stop, as a latch: whatever is running or about to run is pre-empted."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from engine.errors import TurnPreempted

__all__ = ["until_stopped"]

T = TypeVar("T")


async def until_stopped(
    work: Coroutine[Any, Any, T], stop: asyncio.Event, *, what: str, session_id: str | None = None
) -> T:
    """Run ``work`` to completion unless ``stop`` is (or becomes) set.

    On stop the work is cancelled (a process it runs gets SIGTERM, a grace period, then
    SIGKILL of its group) and :class:`~engine.errors.TurnPreempted` is raised. Unlike a
    pre-empt handle this is a latch: a stop that arrives before the process is spawned
    still stops it.
    """
    if stop.is_set():
        work.close()
        raise TurnPreempted(f"{what} stopped before it started", session_id=session_id)
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            # The clean-up (terminating the process group) must finish even if we are
            # being cancelled ourselves.
            with contextlib.suppress(asyncio.CancelledError, TurnPreempted):
                await asyncio.shield(task)
    if task.cancelled():
        raise TurnPreempted(f"{what} stopped by a person", session_id=session_id)
    return task.result()
