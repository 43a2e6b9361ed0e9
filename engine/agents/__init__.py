"""Agent adapters: each implements :class:`engine.turn.AgentSession`."""

from engine.agents.allowlist import READ_ONLY_TOOLS, ToolAllowlist, build_turn_argv
from engine.agents.base import AgentOptions, Invocation, ProcessAgent
from engine.agents.command import CommandAgent, parse_template

__all__ = [
    "READ_ONLY_TOOLS",
    "AgentOptions",
    "CommandAgent",
    "Invocation",
    "ProcessAgent",
    "ToolAllowlist",
    "build_turn_argv",
    "parse_template",
]
