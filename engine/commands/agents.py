"""``turnstile agents``: the configured agents, whether each binary is found, its version."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Final

from engine.agents.command import parse_template
from engine.agents.factory import probe_agents, turn_mode
from engine.agents.registry import AGENT_NAMES, AGENTS, AgentSpec, ask_version
from engine.agents.stream import find_binary
from engine.errors import ConfigError
from engine.settings import Settings

__all__ = ["AgentStatus", "agent_statuses", "register"]

# A status command may give up on a hung ``--version``; turns never time out.
VERSION_TIMEOUT: Final = 30.0


@dataclass(frozen=True, slots=True)
class AgentStatus:
    """One configured agent as found on this machine."""

    name: str
    binary: str
    setting: str
    default: bool
    path: str | None
    version: str | None
    problem: str | None


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "agents", help="list the configured agents: binary found?, version"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.set_defaults(handler=handle)


async def handle(args: argparse.Namespace, settings: Settings) -> int:
    statuses = await agent_statuses(settings)
    if args.json:
        for status in statuses:
            print(json.dumps(asdict(status)))
    else:
        print(_table(statuses))
        await probe_agents(settings)  # the CLIs are asked off the event loop, then known
        print(turn_modes_text(settings))
    default = next(s for s in statuses if s.default)
    return 0 if default.path is not None else 1


async def agent_statuses(settings: Settings) -> list[AgentStatus]:
    """Every agent turnstile knows, the default one marked, versions asked concurrently."""
    path = os.environ.get("PATH")
    return list(await asyncio.gather(*(_probe(spec, settings, path) for spec in AGENTS.values())))


async def _probe(spec: AgentSpec, settings: Settings, path: str | None) -> AgentStatus:
    default = settings.default_agent == spec.name
    binary = spec.configured(settings)
    if spec.template:
        if not binary:
            return AgentStatus(spec.name, "", spec.env_var, default, None, None, "no template set")
        try:
            binary = parse_template(binary)[0]
        except ConfigError as exc:
            return AgentStatus(spec.name, "", spec.env_var, default, None, None, exc.message)
    found = find_binary(binary, path)
    if found is None:
        problem = "not found"
        if spec.npm_package is not None:
            problem += f"; install with `npm install -g {spec.npm_package}` or set {spec.env_var}"
        return AgentStatus(spec.name, binary, spec.env_var, default, None, None, problem)
    if spec.version_args is None:
        # Any program may be configured: it may not know --version, so none is asked.
        return AgentStatus(spec.name, binary, spec.env_var, default, found, None, None)
    version, trouble = await ask_version(found, spec.version_args, within=VERSION_TIMEOUT)
    return AgentStatus(spec.name, binary, spec.env_var, default, found, version, trouble)


def turn_modes_text(settings: Settings) -> str:
    """One line per agent: does it keep a resident process (warm) or start one per turn, why."""
    lines = ["turns (TURNSTILE_WARM_SESSIONS):"]
    for name in AGENT_NAMES:
        mode = turn_mode(name, settings)
        lines.append(f"  {name}: {mode.label} - {mode.reason}")
    return "\n".join(lines)


def _table(statuses: list[AgentStatus]) -> str:
    rows = [("", "agent", "found", "version / problem", "binary")]
    for s in statuses:
        detail = (s.version or "") if s.problem is None else s.problem
        rows.append(
            (
                "*" if s.default else "",
                s.name,
                "yes" if s.path else "no",
                detail,
                s.path or s.binary or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4])) + "  " + row[4]
        for row in rows
    ]
    lines.append("* default agent (TURNSTILE_DEFAULT_AGENT)")
    return "\n".join(line.rstrip() for line in lines)
