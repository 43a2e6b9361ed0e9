"""Small asyncio helpers the engine's and the bot's long-running loops share."""

from __future__ import annotations

import asyncio

__all__ = ["raise_if_cancelled"]


def raise_if_cancelled() -> None:
    """Raise :class:`asyncio.CancelledError` when the running task was asked to stop.

    On Python 3.11 a cancellation that reaches an ``asyncio.wait_for`` just as its inner
    wait ends is lost (the database driver's pool waits that way), and comes out as the
    error the wait turned into. A retry loop that catches that error calls this before
    it tries again, so that a task asked to stop stops instead of retrying for ever.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
