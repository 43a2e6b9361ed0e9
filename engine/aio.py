"""Small asyncio helpers the engine's and the bot's long-running loops share."""

from __future__ import annotations

import asyncio
from typing import Self

__all__ = ["ClosedOnExit", "OpenedAndClosed", "raise_if_cancelled"]


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


class ClosedOnExit:
    """``async with`` it: however the block ends, :meth:`aclose` is awaited."""

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class OpenedAndClosed:
    """``async with`` it: :meth:`open` is awaited first, :meth:`close` however it ends."""

    async def open(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
