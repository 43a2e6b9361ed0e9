"""Tool approvals in the terminal: ``turnstile chat`` and ``turnstile auto`` ask on the TTY.

The terminal front end watches the store for its own run's requests (another front end
may share the database) and asks the person at the keyboard. Without a terminal (stdin is
a pipe or a file) nobody can answer: the request is denied at once, the agent is told
why, and the terminal says which setting to change.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Final, TextIO

from engine.approvals.policy import ApprovalPolicy, Decision, Scope, describe_key, summarize
from engine.approvals.route import ApprovalRoute
from engine.approvals.store import SqliteApprovalStore, ToolRequest
from engine.approvals.watcher import ApprovalWatcher
from engine.store.backend import open_database
from engine.store.location import PostgresURL

__all__ = [
    "NO_TERMINAL",
    "TerminalApprover",
    "stdin_lines",
    "terminal_approvals",
]

# Reads one answer line from the person (None: no more input).
AskLine = Callable[[], Awaitable[str | None]]

NO_TERMINAL: Final = "nobody can answer: turnstile runs without a terminal (stdin is not a TTY)"
_ANSWERS: Final = {
    "y": (Decision.ALLOWED, Scope.ONCE),
    "yes": (Decision.ALLOWED, Scope.ONCE),
    "s": (Decision.ALLOWED, Scope.SESSION),
    "session": (Decision.ALLOWED, Scope.SESSION),
    "n": (Decision.DENIED, None),
    "no": (Decision.DENIED, None),
}


class TerminalApprover:
    """Decides one run's requests from the keyboard (or denies them without one)."""

    def __init__(
        self,
        store: SqliteApprovalStore,
        *,
        ask_line: AskLine | None,
        out: TextIO = sys.stderr,
    ) -> None:
        self.store = store
        self.run_ids: set[str] = set()
        self.ask_line = ask_line
        self.out = out

    async def handle(self, request: ToolRequest) -> bool:
        if request.run_id not in self.run_ids:
            return False
        self.out.write(f"\n🔐 The agent asks to use {request.tool}:\n")
        self.out.write(summarize(request.tool, request.input) + "\n")
        if self.ask_line is None:
            await self.store.decide(request.id, Decision.DENIED, reason=NO_TERMINAL)
            self.out.write(
                f"turnstile: denied — {NO_TERMINAL}. Run it in a terminal, allow the tool "
                "with TURNSTILE_ALLOWED_TOOLS, or set TURNSTILE_TOOL_APPROVAL=off.\n"
            )
            self.out.flush()
            return True
        scope_text = describe_key(request.tool, request.key)
        while True:
            self.out.write(f"Allow? [y] once · [s] for this session ({scope_text}) · [n] deny: ")
            self.out.flush()
            line = await self.ask_line()
            if line is None:
                decision, scope = Decision.DENIED, None
                reason: str | None = "the terminal closed before anyone answered"
                break
            choice = _ANSWERS.get(line.strip().lower())
            if choice is not None:
                decision, scope = choice
                reason = "a person said no at the terminal" if decision is Decision.DENIED else None
                break
        result = await self.store.decide(request.id, decision, scope=scope, reason=reason)
        state = result.request.state.value
        self.out.write(f"turnstile: {request.tool} {state}\n")
        self.out.flush()
        return True


def stdin_lines() -> AskLine | None:
    """Answers read from stdin when it is a terminal (None otherwise).

    A daemon thread reads the lines, so a question left open never keeps the process
    alive at exit.
    """
    if not sys.stdin.isatty():
        return None
    queue: asyncio.Queue[str | None] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    started = False

    def read() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(queue.put_nowait, line)
        loop.call_soon_threadsafe(queue.put_nowait, None)

    async def ask() -> str | None:
        nonlocal started
        if not started:
            started = True
            threading.Thread(target=read, name="approval-stdin", daemon=True).start()
        return await queue.get()

    return ask


# A run's route, given its id and its own policy (None: the terminal's); None: nobody asks.
RouteFor = Callable[[str, ApprovalPolicy | None], ApprovalRoute | None]


@asynccontextmanager
async def terminal_approvals(
    database: Path | PostgresURL,
    policy: ApprovalPolicy,
    *,
    ask_line: AskLine | None,
    out: TextIO = sys.stderr,
    own_policies: bool = False,
) -> AsyncIterator[RouteFor | None]:
    """Routes for a terminal's runs (by run id), with the approver listening while open.

    Yields None when the policy is off and ``own_policies`` is False (nothing can ask); a
    run's own policy (``--permissions``, or the one it was started with) beats ``policy``.
    """
    if policy is ApprovalPolicy.OFF and not own_policies:
        yield None
        return
    async with open_database(database, synchronous="NORMAL") as db:
        store = SqliteApprovalStore(db)
        approver = TerminalApprover(store, ask_line=ask_line, out=out)
        async with ApprovalWatcher(store, approver.handle) as watcher:

            def route_for(run_id: str, own: ApprovalPolicy | None = None) -> ApprovalRoute | None:
                chosen = own or policy
                if chosen is ApprovalPolicy.OFF:
                    return None
                approver.run_ids.add(run_id)
                return ApprovalRoute(
                    database=database,
                    run_id=run_id,
                    policy=chosen,
                    wake=watcher.wake_path,
                )

            try:
                yield route_for
            finally:
                # Nothing waits for these any more (the turns ended with the command).
                with contextlib.suppress(Exception):
                    await store.cancel_pending(
                        "the terminal session ended", run_ids=sorted(approver.run_ids)
                    )
