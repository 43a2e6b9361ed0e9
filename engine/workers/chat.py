"""Chat sessions on the workers: one queued message, one turn job, one reply.

With ``TURNSTILE_EXECUTION=workers`` the bot's chat loop does not spawn the agent. Its
session is a :class:`WorkerChatSession`: each turn writes the message to
``worker_chat_turns``, queues "run one turn of run R" (the job's input stays the run id)
and waits for the row to end; the reply is then posted by the bot exactly as a local
turn's. The worker side is :class:`ChatTurns`, the chat mode's step driver: the chat's worktree
(the project checked out under the session's key, so every run of one chat session shares
it) and its agent session, resumed turn after turn on the worker that ran the last one.

A turn cut off by a dead worker is reported, never re-run (:class:`~engine.errors.TurnCutOff`);
the next message goes to another worker, in a new agent session told so in plain words
(the conversation was on the lost machine's disk), in the worktree pushed after the last
finished turn.

Tool approvals (``TURNSTILE_TOOL_APPROVAL`` on the bot): the run's spec names the policy
and the session's starter, and the worker wires its agent to turnstile's permission server
as the bot does for a local turn. The server runs on the worker's machine and writes the
request to the shared database (the password in a 0600 password file in a private folder
of this turn); the bot finds it there, posts it to the chat and records the decision, which
the server reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Final

from engine.approvals.policy import ApprovalPolicy
from engine.approvals.route import ApprovalRoute
from engine.errors import (
    ConfigError,
    FileRefusedError,
    StoreUnreachableError,
    TurnCutOff,
    TurnError,
    TurnPreempted,
    TurnstileError,
)
from engine.process import PreemptHandle
from engine.redact import Redactor
from engine.runs.stop import until_stopped
from engine.store.backend import AnyDatabase, wait_reachable
from engine.store.runs import SqliteRunStore
from engine.turn import AgentSession, TurnOutput
from engine.workers.chatfiles import (
    SENT_FILES,
    collect_sends,
    split_upload_message,
    write_uploads,
)
from engine.workers.chatturns import (
    CHAT_MODE,
    ChatTurn,
    ChatTurnStatus,
    ChatTurnStore,
    chat_session_key,
    output_from_json,
    output_to_json,
)
from engine.workers.host import Next, PrimedSession, RunHost, stop_watch
from engine.workers.store import Placement, QueuedRun, WorkerStore

if TYPE_CHECKING:
    from engine.settings import Settings

__all__ = [
    "CHAT_MODE",
    "ChatTurn",
    "ChatTurnStatus",
    "ChatTurnStore",
    "ChatTurns",
    "WorkerChatSession",
    "chat_session_key",
    "moved_chat_primer",
]

_LOGGER = logging.getLogger(__name__)

_POLL: Final = 0.25
_CHECK_WORKERS: Final = 1.0
# How long a stopped turn may take to say so, past the agent's grace.
_STOP_MARGIN: Final = 20.0
_PRIMER_TURNS: Final = 3


def moved_chat_primer(worker: str, branch: str, earlier: list[ChatTurn], gone: str | None) -> str:
    """What the agent is told first in the new session of a chat that changed machines."""
    where = f" (worker {gone})" if gone else ""
    lines = [
        "Note before this message: this chat session moved to another machine (worker "
        f"{worker}) because the one it ran on{where} is gone. Your earlier conversation was "
        "kept on that machine and is lost, so this is a new session. The working tree is "
        f"the branch {branch} as it was pushed after the last finished turn; anything not "
        "committed by then is not in it.",
    ]
    done = [t for t in earlier if t.status is ChatTurnStatus.DONE][:_PRIMER_TURNS]
    if done:
        lines.append("The last messages of the conversation, oldest first:")
        for turn in reversed(done):
            answer = output_from_json(turn.output_json).text if turn.output_json else ""
            lines.append(f"Person: {turn.prompt[:1500]}\nYou: {answer[:1500]}")
    lines.append("The person's new message follows.")
    return "\n\n".join(lines) + "\n\n---\n\n"


# -- the worker's side -------------------------------------------------------------------


class ChatTurns:
    """One queued message of a chat run a step; the run then waits for the next one (the
    bot queues each message)."""

    after_outage: Final = Next.PARK  # (a chat turn reports itself)

    async def step(
        self, host: RunHost, placement: Placement, *, moved: bool, stop: asyncio.Event
    ) -> Next:
        await _chat_turn(host, placement.spec, stop)
        return Next.PARK


async def _chat_turn(host: RunHost, spec: QueuedRun, stop: asyncio.Event) -> None:
    """Run the run's queued chat turn here and record how it ended (never raises for the
    turn itself: whatever happened is the row's status, read by the bot)."""
    worker, settings, db = host.name, host.settings, host.db
    turns = ChatTurnStore(db)
    turn = await turns.next_queued(spec.run_id)
    if turn is None:
        # A cut-off turn's job given to this worker by the sweep: reported, not re-run.
        _LOGGER.info("run %s has no chat turn waiting", spec.run_id)
        return
    try:
        with _approvals(settings, spec) as approval:
            await _run(host, spec, turn, stop, approval)
    except asyncio.CancelledError:
        # The worker is going down with the turn in flight: reported like a lost worker.
        await asyncio.shield(
            turns.finish(
                turn.run_id,
                turn.seq,
                ChatTurnStatus.INTERRUPTED,
                error=f"the worker {worker} running it was shut down",
            )
        )
        raise
    except StoreUnreachableError as exc:
        if not exc.retryable:
            raise
        # The database went away while the turn ran: its answer could not be kept. Once
        # the database is back the turn is reported cut off (the chat says so).
        _LOGGER.warning(
            "chat turn %d of run %s: lost the database (%s); reported once it is back",
            turn.seq,
            spec.run_id,
            exc,
        )
        await wait_reachable(db)
        for state in (ChatTurnStatus.RUNNING, ChatTurnStatus.QUEUED):
            await turns.finish(
                turn.run_id,
                turn.seq,
                ChatTurnStatus.INTERRUPTED,
                error="the database could not be reached while the turn ran",
                only_from=state,
            )
    except TurnstileError as exc:
        _LOGGER.error("chat turn %d of run %s failed: %s", turn.seq, spec.run_id, exc)
        # The checkout or the agent could not start; the row may still be queued.
        for state in (ChatTurnStatus.RUNNING, ChatTurnStatus.QUEUED):
            await turns.finish(
                turn.run_id, turn.seq, ChatTurnStatus.FAILED, error=str(exc)[:500], only_from=state
            )


async def _run(
    host: RunHost,
    spec: QueuedRun,
    turn: ChatTurn,
    stop: asyncio.Event,
    approval: ApprovalRoute | None = None,
) -> None:
    from engine.agents.factory import create_agent, probe_turn_mode

    worker, settings, db = host.name, host.settings, host.db
    turns = ChatTurnStore(db)
    workers = WorkerStore(db)
    if stop.is_set() or await workers.stop_requested(spec.run_id):
        await turns.finish(
            turn.run_id, turn.seq, ChatTurnStatus.STOPPED, only_from=ChatTurnStatus.QUEUED
        )
        await workers.clear_stop(spec.run_id)
        return
    checkout = await host.checkout(turn.session_key, spec.project)
    workspace = checkout.workspace
    async with checkout.locked():
        earlier = await turns.history(turn.session_key, before=turn.created_at)
        earlier = [t for t in earlier if (t.run_id, t.seq) != (turn.run_id, turn.seq)]
        last = earlier[0] if earlier else None
        primer = None
        if last is not None and last.worker == worker and last.agent_session is not None:
            session, resume = last.agent_session, True
            finished = any(
                t.agent_session == session and t.status is ChatTurnStatus.DONE for t in earlier
            )
        elif last is None and not turn.resumes:
            session, resume, finished = turn.session_id, False, False
        else:
            # The session's conversation is on another machine's disk (or the bot's).
            session, resume, finished = str(uuid.uuid4()), False, False
            await checkout.adopt()
            primer = moved_chat_primer(
                worker, checkout.branch, earlier, last.worker if last is not None else None
            )
        if not await turns.start(turn, worker, session):
            return  # stopped while it waited
        await SqliteRunStore(db).update_run(spec.run_id, workdir=str(workspace.path))
        run_settings = settings
        if turn.model is not None:
            run_settings = settings.model_copy(update={"agent_model": turn.model})
        await probe_turn_mode(spec.tool, run_settings)  # asked off the event loop
        agent: AgentSession = create_agent(
            spec.tool,
            run_settings,
            cwd=workspace.path,
            session_id=session,
            agent_cmd=spec.agent_cmd,
            passthrough=spec.passthrough,
            extra_env=host.env,
            resume=resume,
            turns_finished=finished,
            approval=approval,
        )
        if primer is not None:
            agent = PrimedSession(agent, primer)
        status, output, error = ChatTurnStatus.DONE, None, None
        async with stop_watch(db, spec.run_id, stop):
            try:
                prompt = turn.prompt
                if turn.uploads:
                    # The files sent with the message, where a local chat puts them.
                    prompt = await write_uploads(
                        db,
                        workspace.path,
                        turn.session_key,
                        turn.uploads,
                        prompt,
                        settings.uploads_dir,
                    )
                out = await until_stopped(
                    agent.run_turn(prompt), stop, what="the turn", session_id=session
                )
                # The files the answer hands back (TURNSTILE-SEND lines), stored for the bot.
                sent = await collect_sends(
                    db,
                    workspace.path,
                    out.text,
                    max_bytes=settings.send_max_bytes,
                    redact=Redactor(settings.secret_values()),
                )
                if sent:
                    out = replace(
                        out, metadata={**out.metadata, SENT_FILES: [f.to_json() for f in sent]}
                    )
                output = output_to_json(out)
            except TurnPreempted as exc:
                status, error = ChatTurnStatus.STOPPED, str(exc)
            except TurnError as exc:
                status, error = ChatTurnStatus.FAILED, str(exc)[:500]
            except (FileRefusedError, OSError) as exc:
                status, error = ChatTurnStatus.FAILED, f"the files sent could not be written: {exc}"
        # Pushed before the reply is recorded: the next worker finds what this turn did.
        # A refused push is logged: the reply still goes out (the next worker then starts
        # from the last push).
        await checkout.push(required=False)
    await turns.finish(turn.run_id, turn.seq, status, output_json=output, error=error)
    if status is ChatTurnStatus.STOPPED:
        await workers.clear_stop(spec.run_id)
    _LOGGER.info("chat turn %d of run %s: %s", turn.seq, spec.run_id, status.value)


@contextlib.contextmanager
def _approvals(settings: Settings, spec: QueuedRun) -> Iterator[ApprovalRoute | None]:
    """Where the turn's tool calls ask a person (None: nobody is asked): the worker's own
    permission server, outside the agent's sandbox, with the worker's store."""
    try:
        policy = ApprovalPolicy(spec.tool_approval or ApprovalPolicy.OFF)
    except ValueError as exc:
        raise ConfigError(f"unknown tool approval setting {spec.tool_approval!r}") from exc
    if policy is ApprovalPolicy.OFF or spec.tool != "claude":
        yield None
        return
    yield ApprovalRoute(
        database=settings.database,
        run_id=spec.run_id,
        policy=policy,
        starter=spec.approval_starter,
    )


# -- the control plane's side --------------------------------------------------------------


class WorkerChatSession:
    """A chat run's agent session on the workers, as the bot's chat loop drives it.

    ``run_turn`` queues the message for a worker and waits for its reply; cancelling it
    (``/stop``, a shutdown) stops the turn on its worker first. ``preempt`` is never
    active: no agent process runs in this process.

    Args:
        notify: tells the chat something (the turn waits for a worker, ...).
        approval: the bot's route for the run's tool calls (its policy and starter travel
            to the worker; the bot posts the requests as a local run's).
    """

    resident: Final = False

    def __init__(
        self,
        settings: Settings,
        db: AnyDatabase,
        *,
        run_id: str,
        tool: str,
        project: str,
        session_id: str,
        resumes: bool,
        model: str | None,
        notify: Callable[[str], Awaitable[None]],
        approval: ApprovalRoute | None = None,
    ) -> None:
        self.settings = settings
        self.db = db
        self.run_id = run_id
        self.spec = QueuedRun(
            run_id=run_id,
            objective="",
            tool=tool,
            project=project,
            agent_cmd=settings.agent_command if tool == "command" else None,
            mode=CHAT_MODE,
            # The worker wires the agent to the permission server with these.
            tool_approval=approval.policy.value if approval is not None else None,
            approval_starter=approval.starter if approval is not None else None,
        )
        self.session_key = chat_session_key(session_id)
        self._session_id = session_id
        self._resumes = resumes
        self._model = model
        self._notify = notify
        self._seq = 0
        self._placed = False
        self.preempt = PreemptHandle(session_id=session_id)

    @property
    def session_id(self) -> str:
        return self._session_id

    async def run_turn(self, prompt: str) -> TurnOutput:
        """One turn on a worker: the reply, as a local turn's.

        Raises:
            TurnCutOff: the worker running it stopped answering (not re-run).
            TurnError: the turn failed on its worker (``TurnPreempted``: stopped there).
        """
        self._seq += 1
        seq = self._seq
        turns = ChatTurnStore(self.db)
        uploads, prompt = split_upload_message(prompt)
        await turns.add(
            self.run_id,
            seq,
            session_key=self.session_key,
            session_id=self._session_id,
            resumes=self._resumes or seq > 1,
            model=self._model,
            prompt=prompt,
            uploads=tuple(uploads),
        )
        try:
            await self._queue()
            return await self._wait(seq)
        except asyncio.CancelledError:
            await asyncio.shield(self._stop(seq))
            raise

    async def _alive(self) -> list[str]:
        now = time.time()
        return [
            w.name
            for w in await WorkerStore(self.db).workers()
            if w.alive(now, self.settings.worker_timeout) and self.spec.tool in w.agents
        ]

    async def _queue(self) -> None:
        from engine.workers.queue import (
            agent_queue,
            defer_turn,
            ensure_queue_schema,
            make_app,
            require_postgres,
            worker_queue,
        )

        url = require_postgres(self.settings.database)
        workers = WorkerStore(self.db)
        if not self._placed:
            await ensure_queue_schema(self.db)
            await workers.place(self.spec)
            self._placed = True
        placement = await workers.placement(self.run_id)
        alive = await self._alive()
        holder = placement.worker if placement is not None else None
        if holder is None:
            holder = await ChatTurnStore(self.db).last_worker(self.session_key)
        # The worker that holds the session's worktree and agent session, while it lives.
        queue = worker_queue(holder) if holder in alive else agent_queue(self.spec.tool)
        app = make_app(url, pool_size=2)
        async with app.open_async():
            await defer_turn(app, self.run_id, queue=queue)

    async def _wait(self, seq: int) -> TurnOutput:
        turns = ChatTurnStore(self.db)
        told = False
        checked = 0.0
        while True:
            turn = await turns.get(self.run_id, seq)
            assert turn is not None  # (written by run_turn)
            if turn.ended:
                return self._result(turn)
            if time.monotonic() - checked >= _CHECK_WORKERS:
                checked = time.monotonic()
                alive = await self._alive()
                if turn.status is ChatTurnStatus.QUEUED and not alive and not told:
                    told = True
                    await self._notify(self._waiting_text())
                elif turn.status is ChatTurnStatus.RUNNING and turn.worker not in alive:
                    await self._sweep()
            await asyncio.sleep(_POLL)

    def _waiting_text(self) -> str:
        what = "worker" if self.spec.tool == "command" else f"worker with {self.spec.tool}"
        return (
            f"⏳ No {what} is running right now: your message waits for one and runs as "
            "soon as a worker starts."
        )

    def _result(self, turn: ChatTurn) -> TurnOutput:
        match turn.status:
            case ChatTurnStatus.DONE:
                assert turn.output_json is not None
                return output_from_json(turn.output_json)
            case ChatTurnStatus.INTERRUPTED:
                raise TurnCutOff(
                    f"{turn.error or 'the worker running it stopped answering'}; the turn was "
                    "not run again. Your next message continues on another worker, in a new "
                    "agent session (the earlier conversation was on that worker's disk)",
                    worker=turn.worker,
                )
            case ChatTurnStatus.STOPPED:
                raise TurnPreempted(turn.error or "the turn was stopped", session_id=None)
            case _:
                raise TurnError(turn.error or "the turn failed on its worker")

    async def _sweep(self) -> None:
        """The running turn's worker went silent: the sweep every live worker makes ends
        the turn interrupted and frees the run (there may be no live worker to make it)."""
        from engine.workers.host import sweep
        from engine.workers.queue import make_app, require_postgres

        app = make_app(require_postgres(self.settings.database), pool_size=2)
        async with app.open_async():
            await sweep(self.db, app, silent_after=self.settings.worker_timeout)

    async def _stop(self, seq: int) -> None:
        """Stop the turn on its worker (the stop flag and an abort, as ``turnstile stop``
        does) and wait until it says it ended; a turn still queued is ended here."""
        from engine.workers.queue import abort_jobs, make_app, require_postgres

        workers = WorkerStore(self.db)
        turns = ChatTurnStore(self.db)
        await workers.request_stop(self.run_id, by="chat")
        app = make_app(require_postgres(self.settings.database), pool_size=2)
        async with app.open_async():
            await abort_jobs(app, self.run_id)
        if await turns.finish(
            self.run_id, seq, ChatTurnStatus.STOPPED, only_from=ChatTurnStatus.QUEUED
        ):
            await workers.clear_stop(self.run_id)
            return
        deadline = time.monotonic() + self.settings.preempt_grace + _STOP_MARGIN
        while time.monotonic() < deadline:
            turn = await turns.get(self.run_id, seq)
            if turn is None or turn.ended:
                return
            await asyncio.sleep(_POLL)
        _LOGGER.warning("run %s: its worker did not confirm the stop in time", self.run_id)

    async def close(self, *, stopped: bool) -> None:
        """The chat run ended: the workers let it go (nothing more is queued); how it ended
        (``stopped`` or not) is its run's row's, which the chat mode writes."""
        del stopped
        if not self._placed:
            return
        workers = WorkerStore(self.db)
        await workers.let_go(self.run_id, "")
        await workers.clear_stop(self.run_id)
