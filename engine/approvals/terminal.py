"""Tool approvals in the terminal: ``turnstile chat`` and ``turnstile auto`` ask on the TTY.

The terminal front end watches the store for its own run's requests (another front end
may share the database) and asks the person at the keyboard. Without a terminal (stdin is
a pipe or a file) nobody can answer: the request is denied at once, the agent is told
why, and the terminal says which setting to change.
"""

from __future__ import annotations

import contextlib
import secrets
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Final, TextIO

from engine.approvals.policy import ApprovalPolicy, Decision, Scope, describe_key, summarize
from engine.approvals.route import ApprovalRoute
from engine.approvals.store import SqliteApprovalStore, ToolRequest
from engine.approvals.watcher import ApprovalWatcher
from engine.store.database import Database

__all__ = ["NO_TERMINAL", "TerminalApprover", "terminal_approvals"]

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
        run_id: str,
        *,
        ask_line: AskLine | None,
        out: TextIO = sys.stderr,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.ask_line = ask_line
        self.out = out

    async def handle(self, request: ToolRequest) -> bool:
        if request.run_id != self.run_id:
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


@asynccontextmanager
async def terminal_approvals(
    database: Path,
    policy: ApprovalPolicy,
    *,
    ask_line: AskLine | None,
    run_id: str | None = None,
    out: TextIO = sys.stderr,
) -> AsyncIterator[ApprovalRoute | None]:
    """A route for a terminal run's agent, with the approver listening while it is open.

    Yields None when the policy is off (nothing asks).
    """
    if policy is ApprovalPolicy.OFF:
        yield None
        return
    run = run_id or "t" + secrets.token_hex(4)
    async with Database(database, synchronous="NORMAL") as db:
        store = SqliteApprovalStore(db)
        approver = TerminalApprover(store, run, ask_line=ask_line, out=out)
        async with ApprovalWatcher(store, approver.handle) as watcher:
            try:
                yield ApprovalRoute(
                    database=database, run_id=run, policy=policy, wake=watcher.wake_path
                )
            finally:
                # Nothing waits for these any more (the turn ended with the command).
                with contextlib.suppress(Exception):
                    await store.cancel_pending("the terminal session ended", run_ids=[run])
