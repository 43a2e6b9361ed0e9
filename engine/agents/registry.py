"""Every agent turnstile knows, described once: the factory, ``turnstile agents`` and
``turnstile doctor`` iterate :data:`AGENTS` instead of keeping maps of their own.

Per agent: its adapter class (imported only when asked for, so that a broken or absent
adapter never blocks the others), the setting that names its binary, the npm package it
is installed from, the environment variables that carry its credentials, and the command
that prints its version.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import shutil
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from engine.agents.base import ProcessAgent
from engine.errors import ConfigError
from engine.settings import Settings

__all__ = [
    "AGENTS",
    "AGENT_NAMES",
    "AgentSpec",
    "Credentials",
    "agent_spec",
    "ask_version",
    "installed_agents",
]


@dataclass(frozen=True, slots=True)
class Credentials:
    """Where an agent CLI finds its key.

    Attributes:
        variables: environment variables that carry a key or token (or switch to one).
        files: (variable naming the CLI's config folder, file in it) of a saved login.
        default_dir: that config folder under HOME when the variable is unset.
        fix: how a person gives the CLI a key.
    """

    variables: tuple[str, ...]
    files: tuple[tuple[str, str], ...]
    default_dir: str
    fix: str


@dataclass(frozen=True, slots=True)
class AgentSpec:
    """One agent.

    Attributes:
        name: what people type (``/chat claude``, ``--tool codex``).
        adapter: ``module:Class`` of its adapter.
        setting: the :class:`~engine.settings.Settings` field naming its binary (for the
            command agent: its command template).
        npm_package: where the CLI comes from, if it is an npm package.
        credentials: where the CLI finds a key; None when turnstile cannot know.
        version_args: the arguments that make the binary print its version; None when an
            arbitrary program may not know any.
        template: the setting is a command template whose first word is the binary.
    """

    name: str
    adapter: str
    setting: str
    npm_package: str | None = None
    credentials: Credentials | None = None
    version_args: tuple[str, ...] | None = ("--version",)
    template: bool = False

    @property
    def env_var(self) -> str:
        """The environment variable (or ``.env`` key) of :attr:`setting`."""
        return f"TURNSTILE_{self.setting.upper()}"

    def configured(self, settings: Settings) -> str:
        """The binary (or template) the settings name for this agent ("" when unset)."""
        value = getattr(settings, self.setting)
        return value if isinstance(value, str) else ""

    def install_hint(self) -> str:
        """How to install the CLI, for "not found" messages."""
        if self.npm_package is None:
            return f"install it or use its full path in {self.env_var}"
        return f"`npm install -g {self.npm_package}` or set {self.env_var} to its path"

    def installed(self, settings: Settings, *, path: str | None = None) -> bool:
        """Whether the binary the settings name (a template's first word) can be run."""
        configured = self.configured(settings)
        binary = configured.split()[0] if configured.split() else ""
        return bool(binary) and shutil.which(binary, path=path) is not None

    def load(self) -> type[ProcessAgent]:
        """The adapter class (imported now)."""
        module, _, name = self.adapter.partition(":")
        cls: type[ProcessAgent] = getattr(importlib.import_module(module), name)
        return cls


AGENTS: Final[Mapping[str, AgentSpec]] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            AgentSpec(
                "claude",
                "engine.agents.claude:ClaudeAgent",
                "claude_bin",
                "@anthropic-ai/claude-code",
                Credentials(
                    (
                        "ANTHROPIC_API_KEY",
                        "CLAUDE_CODE_OAUTH_TOKEN",
                        "ANTHROPIC_AUTH_TOKEN",
                        "CLAUDE_CODE_USE_BEDROCK",
                        "CLAUDE_CODE_USE_VERTEX",
                    ),
                    (("CLAUDE_CONFIG_DIR", ".credentials.json"),),
                    ".claude",
                    "export ANTHROPIC_API_KEY (or CLAUDE_CODE_OAUTH_TOKEN from "
                    "`claude setup-token`)",
                ),
            ),
            AgentSpec(
                "copilot",
                "engine.agents.copilot:CopilotAgent",
                "copilot_bin",
                "@github/copilot",
                Credentials(
                    (
                        "COPILOT_GITHUB_TOKEN",
                        "GH_TOKEN",
                        "GITHUB_TOKEN",
                        "COPILOT_PROVIDER_API_KEY",
                    ),
                    (("COPILOT_HOME", "config.json"),),
                    ".copilot",
                    "export COPILOT_GITHUB_TOKEN (a token of an account with Copilot)",
                ),
            ),
            AgentSpec(
                "codex",
                "engine.agents.codex:CodexAgent",
                "codex_bin",
                "@openai/codex",
                Credentials(
                    ("CODEX_API_KEY", "OPENAI_API_KEY"),
                    (("CODEX_HOME", "auth.json"),),
                    ".codex",
                    "export CODEX_API_KEY, or run `codex login` as the user turnstile runs as",
                ),
            ),
            AgentSpec(
                "command",
                "engine.agents.command:CommandAgent",
                "agent_command",
                version_args=None,
                template=True,
            ),
        )
    }
)

AGENT_NAMES: Final = tuple(AGENTS)


def installed_agents(settings: Settings, *, path: str | None = None) -> tuple[str, ...]:
    """The agents whose binary is there to run, in :data:`AGENTS` order."""
    return tuple(name for name, spec in AGENTS.items() if spec.installed(settings, path=path))


def agent_spec(name: str) -> AgentSpec:
    """The agent called ``name``.

    Raises:
        ConfigError: no agent has that name.
    """
    spec = AGENTS.get(name)
    if spec is None:
        raise ConfigError(f"unknown agent {name!r}: choose one of {', '.join(AGENT_NAMES)}")
    return spec


async def ask_version(
    binary: str, args: Sequence[str], *, within: float
) -> tuple[str | None, str | None]:
    """``binary ARGS``'s first output line, and the problem that prevented it, if any.

    Not an agent turn: a version command that hangs (a login prompt, a lock) is the
    finding, so it is given ``within`` seconds and then killed with its process group.
    """
    try:
        proc = await asyncio.create_subprocess_exec(
            binary,
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        return None, f"cannot run: {exc.strerror or type(exc).__name__}"
    shown = " ".join(args)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), within)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        return None, f"{shown} did not answer within {within:.0f} s"
    text = (out or err).decode("utf-8", errors="replace").strip()
    first = text.splitlines()[0][:120] if text else ""
    if proc.returncode != 0:
        return None, f"{shown} exited with code {proc.returncode}" + (f": {first}" if first else "")
    return first or None, None
