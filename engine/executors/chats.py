"""Where a chat's turns run: an agent process here, or a session on ``turnstile worker``.

The chat mode (:mod:`engine.chats`) drives a :class:`ChatAgent` turn after turn; the
:class:`ChatAgents` made by :func:`engine.executors.chat_agents` for the settings'
``TURNSTILE_EXECUTION`` says what that agent is:

- ``local``: the agent CLI in this process's sandbox, in the place's folder here.
- ``workers``: a :class:`~engine.workers.chat.WorkerChatSession` whose turns are jobs; the
  place's folder and the agent's session live on the worker that runs them, so files sent
  to the place are stored in the database for it, and the files its turns hand over come
  back the same way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from engine.agents.factory import probe_turn_mode
from engine.agents.registry import agent_spec, installed_agents
from engine.agents.warm import close_agent
from engine.approvals import ApprovalRoute
from engine.chats.files import SENT_FILES, ChatUpload, SentFile
from engine.chats.records import Binding
from engine.errors import ConfigError
from engine.executors.base import AgentFactory
from engine.process import PreemptHandle
from engine.settings import Settings
from engine.store.backend import AnyDatabase
from engine.turn import TurnOutput
from engine.workspace import WorkspaceManager

__all__ = ["ChatAgent", "ChatAgents", "LocalChatAgents", "WorkersChatAgents"]

Say = Callable[[str], Awaitable[None]]


class ChatAgent(Protocol):
    """What a chat run drives: an agent process here (:class:`ProcessAgent`), or a session
    on the workers (nothing runs here: its ``preempt`` is never active, and cancelling its
    turn stops the turn on its worker)."""

    @property
    def session_id(self) -> str: ...

    @property
    def preempt(self) -> PreemptHandle: ...

    async def run_turn(self, prompt: str) -> TurnOutput: ...


class ChatAgents(Protocol):
    """Where a chat's turns run, and what follows from it."""

    #: Whether the place's folder is elsewhere (on a worker's disk), not on this machine.
    remote: bool

    def agent_problem(self, agent: str) -> str | None:
        """Why ``agent`` cannot take a chat's turns (None: it can)."""
        ...

    def place_problem(self, project: str, branch: str | None) -> str | None:
        """Why a chat cannot work on ``project`` (at ``branch``) (None: it can)."""
        ...

    async def open(
        self,
        run_id: str,
        binding: Binding,
        settings: Settings,
        *,
        approval: ApprovalRoute | None,
        say: Say,
    ) -> ChatAgent:
        """The agent of a new run of ``binding`` (``say`` tells the place something)."""
        ...

    async def close(self, agent: ChatAgent, *, stopped: bool) -> None:
        """The run of ``agent`` ended (a resident process ends; a worker's session lets go)."""
        ...

    async def where(self, binding: Binding) -> str | None:
        """Where the session's last turn ran, when not here (a worker's name); None: here,
        or no turn yet."""
        ...

    async def store_upload(
        self, binding: Binding, name: str, data: bytes, *, mime: str
    ) -> ChatUpload:
        """Keep a file sent to a remote place for the worker of its next turn."""
        ...

    def sent_files(self, out: TurnOutput) -> list[SentFile]:
        """The files a remote turn handed over (read there, stored in the database)."""
        ...


class LocalChatAgents:
    """Turns run by an agent CLI in this process."""

    remote = False

    def __init__(self, settings: Settings, agent_factory: AgentFactory) -> None:
        self._settings = settings
        self._factory = agent_factory

    def agent_problem(self, agent: str) -> str | None:
        installed = installed_agents(self._settings)
        if agent in installed:
            return None
        return (
            f"{agent} is not installed on this machine ({agent_spec(agent).install_hint()})."
            f" Agents installed here: {', '.join(installed) or 'none'}."
        )

    def place_problem(self, project: str, branch: str | None) -> str | None:
        return None

    async def open(
        self,
        run_id: str,
        binding: Binding,
        settings: Settings,
        *,
        approval: ApprovalRoute | None,
        say: Say,
    ) -> ChatAgent:
        extra: dict[str, Any] = {} if approval is None else {"approval": approval}
        # Known ahead (a front end's start-up) or asked now, off the event loop.
        await probe_turn_mode(binding.agent, settings)
        return self._factory(
            binding.agent,
            settings,
            cwd=Path(binding.workdir),
            session_id=binding.session_id,
            resume=binding.turns > 0,
            turns_finished=binding.turns > 0,
            **extra,
        )

    async def close(self, agent: ChatAgent, *, stopped: bool) -> None:
        await close_agent(agent)

    async def where(self, binding: Binding) -> str | None:
        return None

    async def store_upload(
        self, binding: Binding, name: str, data: bytes, *, mime: str
    ) -> ChatUpload:
        raise ConfigError("a chat run here keeps files in its own folder")

    def sent_files(self, out: TurnOutput) -> list[SentFile]:
        return []


class WorkersChatAgents:
    """Turns run as jobs on ``turnstile worker`` processes."""

    remote = True

    def __init__(self, settings: Settings, db: AnyDatabase) -> None:
        self._settings = settings
        self._db = db

    def agent_problem(self, agent: str) -> str | None:
        return None  # a worker with the agent's CLI takes the turns

    def place_problem(self, project: str, branch: str | None) -> str | None:
        # Here, not at the top: the queue's driver loads only when the workers are used.
        from engine.workers.control import workers_project_problem

        # The words an auto run or a drive of this chat is refused with, too.
        problem = workers_project_problem(self._settings, project)
        if problem is not None:
            return problem
        manager = WorkspaceManager.from_settings(self._settings)
        if project not in {p.name for p in manager.projects}:
            return (
                f"on the workers a chat needs a configured project (TURNSTILE_PROJECTS); "
                f"{project} is not one"
            )
        if branch is not None:
            return "on the workers a chat starts from the project's default branch"
        return None

    async def open(
        self,
        run_id: str,
        binding: Binding,
        settings: Settings,
        *,
        approval: ApprovalRoute | None,
        say: Say,
    ) -> ChatAgent:
        from engine.workers.chat import WorkerChatSession

        return WorkerChatSession(
            settings,
            self._db,
            run_id=run_id,
            tool=binding.agent,
            project=binding.project,
            session_id=binding.session_id,
            resumes=binding.turns > 0,
            model=binding.model,
            notify=say,
            approval=approval,
        )

    async def close(self, agent: ChatAgent, *, stopped: bool) -> None:
        from engine.workers.chat import WorkerChatSession

        if isinstance(agent, WorkerChatSession):
            await agent.close(stopped=stopped)

    async def where(self, binding: Binding) -> str | None:
        from engine.workers.chatturns import ChatTurnStore, chat_session_key

        return await ChatTurnStore(self._db).last_worker(chat_session_key(binding.session_id))

    async def store_upload(
        self, binding: Binding, name: str, data: bytes, *, mime: str
    ) -> ChatUpload:
        from engine.workers.chatfiles import store_upload
        from engine.workers.chatturns import chat_session_key

        return await store_upload(
            self._db, chat_session_key(binding.session_id), name, data, mime=mime
        )

    def sent_files(self, out: TurnOutput) -> list[SentFile]:
        raw = out.metadata.get(SENT_FILES)
        return [SentFile.from_json(e) for e in raw] if isinstance(raw, list) else []
