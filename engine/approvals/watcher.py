"""The front end's side: find new tool requests (and agents' questions) in the store and
hand them to their handlers.

The permission server nudges a Unix datagram socket after each request, so a request
reaches the handler within milliseconds; a scan every ``scan_interval`` seconds finds
requests whose nudge went nowhere (the front end was restarting).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Awaitable, Callable
from typing import Self

from engine.aio import ClosedOnExit, raise_if_cancelled
from engine.approvals.questions import AgentQuestion, QuestionStore
from engine.approvals.store import ApprovalStore, ToolRequest
from engine.errors import StoreUnreachableError

__all__ = ["ApprovalWatcher"]

_LOGGER = logging.getLogger(__name__)

# Returns True when the request was shown (it is then marked posted), False when it is
# not this front end's (another front end shares the database).
Handler = Callable[[ToolRequest], Awaitable[bool]]
QuestionHandler = Callable[[AgentQuestion], Awaitable[bool]]


class _Nudges(asyncio.DatagramProtocol):
    def __init__(self, event: asyncio.Event) -> None:
        self._event = event

    def datagram_received(self, data: bytes, addr: object) -> None:
        self._event.set()


class ApprovalWatcher(ClosedOnExit):
    """Listens for nudges and runs ``handler`` on every new request; an async context manager."""

    def __init__(
        self, store: ApprovalStore, handler: Handler, *, scan_interval: float = 1.0
    ) -> None:
        self.store = store
        self.handler = handler
        #: Where agents' questions go (set by the front end that shows them).
        self.questions: tuple[QuestionStore, QuestionHandler] | None = None
        self._skipped_questions: set[int] = set()
        self.scan_interval = scan_interval
        self.wake_path: str | None = None
        self._folder: str | None = None
        self._transport: asyncio.DatagramTransport | None = None
        self._event = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._skipped: set[int] = set()

    async def __aenter__(self) -> Self:
        # A short path under the temp folder: Unix socket paths are limited to ~107 bytes.
        self._folder = tempfile.mkdtemp(prefix="turnstile-ap-")
        path = os.path.join(self._folder, "wake")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(path)
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            transport, _ = await loop.create_datagram_endpoint(
                lambda: _Nudges(self._event), sock=sock
            )
        except BaseException:
            sock.close()
            shutil.rmtree(self._folder, ignore_errors=True)
            raise
        self._transport = transport
        self.wake_path = path
        self._task = asyncio.create_task(self._run(), name="tool-approval-watcher")
        return self

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
        self.wake_path = None

    @property
    def folder(self) -> str | None:
        """The watcher's private folder (0700) while it is open."""
        return self._folder

    def poke(self) -> None:
        """Look now (e.g. after a run started)."""
        self._event.set()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.scan_interval):
                    await self._event.wait()
            self._event.clear()
            try:
                await self.scan()
            except StoreUnreachableError as exc:
                # The database is away a moment (an outage, a restart): the next scan tries.
                raise_if_cancelled()
                _LOGGER.warning("cannot read tool requests yet: %s", exc)
            except Exception:
                # The watcher must outlive a store hiccup: the next scan tries again.
                _LOGGER.exception("scanning tool requests failed")

    async def scan(self) -> int:
        """Hand every new request (and question) to its handler once; returns how many
        were shown."""
        shown = 0
        for request in await self.store.unposted():
            if request.id in self._skipped:
                continue
            if await self.handler(request):
                await self.store.mark_posted(request.id)
                shown += 1
            else:
                self._skipped.add(request.id)
        if self.questions is not None:
            questions, show = self.questions
            for question in await questions.unposted():
                if question.id in self._skipped_questions:
                    continue
                if await show(question):
                    await questions.mark_posted(question.id)
                    shown += 1
                else:
                    self._skipped_questions.add(question.id)
        return shown
