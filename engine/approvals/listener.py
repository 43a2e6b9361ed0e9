"""The permission server, outside the agent's sandbox, on a Unix socket.

The agent CLI starts what its MCP config names — inside the sandbox, where the store is
not. So it starts a relay (:data:`RELAY`: a few lines of the standard library, run by the
base interpreter with ``-I -S``) that joins its stdin and stdout to this listener's socket;
the MCP server itself, with the store, stays in the front end's (or the worker's) process.
Over that socket the agent can only *ask*: the ``approve`` tool records a request and
waits for a person's decision, the ``ask`` tool records a question and waits for a
person's answer; no message it can send decides a request or answers a question.

One listener serves one agent process (a turn, or a resident process's life); its folder
(0700, under the temp folder: a socket path is limited to ~107 bytes) holds the socket
and the relay, and is shown read-only inside the sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

from engine.aio import ClosedOnExit
from engine.approvals.questions import QuestionState, QuestionStore, check_question
from engine.approvals.route import SERVER_NAME, ApprovalRoute
from engine.approvals.store import SqliteApprovalStore
from engine.store.backend import AnyDatabase, open_database

if TYPE_CHECKING:
    import anyio

__all__ = ["RELAY", "ApprovalListener"]

_LOGGER = logging.getLogger(__name__)
# How often a waiting question re-reads its row. A person's answer is far slower.
_POLL_SECONDS: Final = 0.1

# Joins stdin/stdout to the socket named by argv[1]; ends when either side ends.
RELAY: Final = """\
import os, socket, sys, threading
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
def up():
    try:
        while True:
            data = os.read(0, 65536)
            if not data:
                break
            s.sendall(data)
    finally:
        try:
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
threading.Thread(target=up, daemon=True).start()
while True:
    data = s.recv(65536)
    if not data:
        break
    view = memoryview(data)
    while view:
        view = view[os.write(1, view):]
"""


class _Lines:
    """An asyncio stream pair as the text files the MCP SDK's stdio transport reads."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    def __aiter__(self) -> AsyncIterator[str]:
        return self._lines()

    async def _lines(self) -> AsyncIterator[str]:
        while line := await self._reader.readline():
            yield line.decode("utf-8", errors="replace")

    async def write(self, text: str) -> None:
        self._writer.write(text.encode("utf-8"))

    async def flush(self) -> None:
        await self._writer.drain()


class ApprovalListener(ClosedOnExit):
    """The permission server of one agent process, while it lives (an async context)."""

    def __init__(
        self, route: ApprovalRoute, *, worktree: str | os.PathLike[str] | None = None
    ) -> None:
        self.route = route
        #: The agent's folder: what "outside the project folder" means to the presets.
        self.worktree = os.path.realpath(worktree) if worktree is not None else None
        self._folder: Path | None = None
        self._server: asyncio.Server | None = None
        self._db: AnyDatabase | None = None
        self._db_cm: Any = None
        self._db_lock = asyncio.Lock()
        self._connections: set[asyncio.Task[None]] = set()
        # Whether the agent asked a question: one left unanswered is withdrawn at the end
        # (one listener serves the run's one agent process).
        self._asked = False

    @property
    def folder(self) -> Path:
        """The listener's folder (socket and relay), shown read-only in the sandbox."""
        if self._folder is None:
            raise RuntimeError("the approval listener is not open")
        return self._folder

    @property
    def socket_path(self) -> Path:
        return self.folder / "s"

    async def __aenter__(self) -> ApprovalListener:
        self._folder = Path(tempfile.mkdtemp(prefix="turnstile-mcp-"))
        try:
            (self._folder / "relay.py").write_text(RELAY, encoding="utf-8")
            self._server = await asyncio.start_unix_server(self._accept, path=str(self.socket_path))
        except BaseException:
            await self.aclose()
            raise
        return self

    async def aclose(self) -> None:
        """Stop listening, end the connections, withdraw the questions nobody answered,
        close the store, remove the folder."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._asked and self._db is not None:
            # The turn ended (stopped, or its process died): nobody waits for the answer.
            self._asked = False
            try:
                await QuestionStore(self._db).withdraw_pending(
                    "the turn ended before an answer", run_ids=[self.route.run_id]
                )
            except Exception:  # the store is away: its front end finds them on restart
                _LOGGER.exception("withdrawing the questions of %s failed", self.route.run_id)
        if self._db_cm is not None:
            cm, self._db_cm, self._db = self._db_cm, None, None
            await cm.__aexit__(None, None, None)
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def mcp_config(self) -> dict[str, object]:
        """The CLI's ``--mcp-config``: the relay, run by the base interpreter."""
        # The base interpreter, not the venv's: inside the sandbox the venv's folder may be
        # hidden (it lives beside the database). -I -S: no site, no cwd on the path.
        python = getattr(sys, "_base_executable", None) or sys.executable
        server: dict[str, object] = {
            "type": "stdio",
            "command": python,
            "args": ["-I", "-S", str(self.folder / "relay.py"), str(self.socket_path)],
            "env": {},
        }
        return {"mcpServers": {SERVER_NAME: server}}

    def shown_paths(self) -> tuple[Path, ...]:
        """What the sandbox must show read-only for the relay to run and connect."""
        base = Path(os.path.realpath(sys.base_prefix))
        return (self.folder, base)

    async def _store(self) -> SqliteApprovalStore:
        async with self._db_lock:
            if self._db is None:
                cm = open_database(self.route.database, synchronous="NORMAL")
                self._db = await cm.__aenter__()
                self._db_cm = cm
            return SqliteApprovalStore(self._db)

    async def _ask(self, question: str, options: tuple[str, ...]) -> str:
        """Record the question, nudge the front end, wait for the answer (no timeout)."""
        from engine.approvals.mcp_server import nudge

        store = QuestionStore((await self._store()).db)
        self._asked = True  # before it is recorded: a stop may come at any await
        asked = await store.ask(self.route.run_id, question, options)
        _LOGGER.info("run %s asks question %s", self.route.run_id, asked.id)
        nudge(self.route.wake, asked.id)
        settled = asked
        while settled.state is QuestionState.PENDING:
            await asyncio.sleep(_POLL_SECONDS)
            settled = await store.get(asked.id)
        return settled.tool_result()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.create_task(self._serve(reader, writer), name="approval-connection")
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Imported here: the SDK takes about a second to import, and most turns never ask.
        from mcp.server.mcpserver import MCPServer
        from mcp.server.stdio import stdio_server

        from engine.approvals.mcp_server import PermissionBroker

        route = self.route
        server: MCPServer[Any] = MCPServer(
            SERVER_NAME,
            instructions=(
                "Asks a person before the agent runs a tool. The agent may ask the person "
                "following this run a question with the ask tool."
            ),
        )

        async def approve(
            tool_name: str, input: dict[str, Any], tool_use_id: str | None = None
        ) -> str:
            """Ask a person whether the agent may make this tool call."""
            broker = PermissionBroker(
                await self._store(),
                run_id=route.run_id,
                policy=route.policy,
                worktree=self.worktree,
                starter=route.starter,
                wake=route.wake,
            )
            return json.dumps(await broker.ask(tool_name, input, tool_use_id))

        async def ask(question: str, options: list[str] | None = None) -> str:
            """Ask the person following this run a question and wait for the answer.

            Give up to four short options to offer them as buttons, or none for an answer
            in their own words. Ask only what you cannot find out yourself: the run waits
            until someone answers.
            """
            text, chosen = check_question(question, options)
            return await self._ask(text, chosen)

        # One text block, not structured output: Claude Code accepts nothing else.
        server.add_tool(approve, name="approve", structured_output=False)
        server.add_tool(ask, name="ask", structured_output=False)
        lines = _Lines(reader, writer)
        files = cast("anyio.AsyncFile[str]", lines)
        try:
            async with stdio_server(stdin=files, stdout=files) as (read, write):
                low = server._lowlevel_server
                await low.run(read, write, low.create_initialization_options())
        except (ConnectionError, OSError) as exc:
            _LOGGER.info("permission relay of run %s went away: %s", route.run_id, exc)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()
