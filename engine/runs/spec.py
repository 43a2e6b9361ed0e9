"""What a run is started with: one frozen, serializable spec.

A :class:`RunSpec` holds only plain data (ids, strings, numbers, paths) so that it can
cross a process boundary (a job queue carries it as JSON: :meth:`RunSpec.to_json`,
:meth:`RunSpec.from_json`). What cannot cross (the database, the sink that reports to a
person, the approval route of tool calls, the turn slots) is handed over beside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from engine.errors import ConfigError
from engine.runs.ids import RunMode
from engine.spend import Budget

__all__ = ["AgentEnv", "ChatPlace", "PlaceId", "RunSpec", "place_id"]

PlaceId = str
"""A chat's or a topic's id as its front end names it: opaque text, never a number.

Telegram's chat and topic ids are their decimal text (``"-1001234"``, ``"7"``); another
messenger's ids (``"room-a"``) are kept as given. Only the Telegram front end turns them
back into numbers, where its API and its own rules need them.
"""


def place_id(value: object) -> PlaceId | None:
    """An id read from stored data (a number in a database written before, text now).

    ``None``, ``""`` and ``0`` are "none": the no-topic marks used before (a run's topic
    ``NULL``, a binding's ``0``).
    """
    if value is None or value == "" or value == 0:
        return None
    return str(value)


@dataclass(frozen=True, slots=True)
class ChatPlace:
    """Where in a chat a run reports: the chat and, in a forum, its topic (None: no topic)."""

    chat_id: PlaceId
    thread_id: PlaceId | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.chat_id, str) or not self.chat_id:
            raise ConfigError(f"a chat place needs a chat id as text, not {self.chat_id!r}")
        if self.thread_id is not None and not isinstance(self.thread_id, str):
            raise ConfigError(f"a topic id is text, not {self.thread_id!r}")
        if self.thread_id == "":
            object.__setattr__(self, "thread_id", None)

    @classmethod
    def stored(cls, chat_id: object, thread_id: object = None) -> ChatPlace:
        """The place from stored values (numbers in data written before, text now)."""
        chat = place_id(chat_id)
        if chat is None:
            raise ConfigError(f"not a chat id: {chat_id!r}")
        return cls(chat, place_id(thread_id))


@dataclass(frozen=True, slots=True)
class AgentEnv:
    """What the agent's process gets beside the settings (sandboxes, tests).

    Attributes:
        extra_env: variables added to the agent's environment.
        config_dir: the agent CLI's configuration folder, when not the user's own.
    """

    extra_env: Mapping[str, str] = field(default_factory=dict)
    config_dir: Path | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra_env", MappingProxyType(dict(self.extra_env)))

    def to_json(self) -> dict[str, Any]:
        return {
            "extra_env": dict(self.extra_env),
            "config_dir": str(self.config_dir) if self.config_dir is not None else None,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AgentEnv:
        config_dir = data.get("config_dir")
        return cls(
            extra_env={str(k): str(v) for k, v in (data.get("extra_env") or {}).items()},
            config_dir=Path(config_dir) if config_dir else None,
        )


@dataclass(frozen=True, slots=True)
class RunSpec:
    """Everything a new run is started with.

    Attributes:
        objective: what the agent is asked to achieve (the first prompt).
        agent: the agent's registry name (claude, copilot, codex, command).
        workdir: the agent's working directory (a worktree of ``project``, or any folder).
        mode: how the run is driven.
        run_id: the id to use (minted beforehand when it keys a worktree), else a new one.
        project: the configured project the worktree was checked out of, if any.
        chat: where a chat follows the run, if anywhere.
        max_turns: the turn cap (None: the settings' default).
        agent_cmd: the command agent's argv template.
        passthrough: extra arguments for the agent CLI.
        verify_cmd: a command whose exit 0 is evidence of completion (argv, no shell).
        prompts_dir: prompt template overrides.
        env: the agent process's extra environment and configuration folder.
        budget: how far the run may spend (None: the settings' default, if any).
        permissions: what its tool calls ask before they run (a tool approval policy or
            preset: guarded, trusted, free; None: the front end's default).
    """

    objective: str
    agent: str
    workdir: Path
    mode: RunMode = RunMode.AUTO
    run_id: str | None = None
    project: str | None = None
    chat: ChatPlace | None = None
    max_turns: int | None = None
    agent_cmd: str | None = None
    passthrough: tuple[str, ...] = ()
    verify_cmd: str | None = None
    prompts_dir: Path | None = None
    env: AgentEnv = field(default_factory=AgentEnv)
    budget: Budget | None = None
    permissions: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", RunMode(self.mode))
        object.__setattr__(self, "workdir", Path(self.workdir))
        object.__setattr__(self, "passthrough", tuple(self.passthrough))

    def to_json(self) -> dict[str, Any]:
        """The spec as JSON-ready data (what a job queue carries)."""
        return {
            "objective": self.objective,
            "agent": self.agent,
            "workdir": str(self.workdir),
            "mode": self.mode.value,
            "run_id": self.run_id,
            "project": self.project,
            "chat": (
                {"chat_id": self.chat.chat_id, "thread_id": self.chat.thread_id}
                if self.chat is not None
                else None
            ),
            "max_turns": self.max_turns,
            "agent_cmd": self.agent_cmd,
            "passthrough": list(self.passthrough),
            "verify_cmd": self.verify_cmd,
            "prompts_dir": str(self.prompts_dir) if self.prompts_dir is not None else None,
            "env": self.env.to_json(),
            "budget": self.budget.to_config() if self.budget is not None else None,
            "permissions": self.permissions,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunSpec:
        """The spec back from :meth:`to_json`'s data.

        Raises:
            ConfigError: a required field is missing or a value has the wrong kind.
        """
        try:
            chat = data.get("chat")
            prompts_dir = data.get("prompts_dir")
            max_turns = data.get("max_turns")
            return cls(
                objective=str(data["objective"]),
                agent=str(data["agent"]),
                workdir=Path(data["workdir"]),
                mode=RunMode(data.get("mode", RunMode.AUTO.value)),
                run_id=data.get("run_id"),
                project=data.get("project"),
                chat=ChatPlace.stored(chat["chat_id"], chat.get("thread_id")) if chat else None,
                max_turns=int(max_turns) if max_turns is not None else None,
                agent_cmd=data.get("agent_cmd"),
                passthrough=tuple(str(a) for a in data.get("passthrough", ())),
                verify_cmd=data.get("verify_cmd"),
                prompts_dir=Path(prompts_dir) if prompts_dir else None,
                env=AgentEnv.from_json(data.get("env") or {}),
                budget=Budget.from_config(data.get("budget") or {}),
                permissions=data.get("permissions"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not a run spec: {exc}") from exc
