"""``turnstile agents``: the configured agents, whether each binary is found, its version."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Final

from engine.agents.claude import ClaudeAgent
from engine.agents.codex import CodexAgent
from engine.agents.command import parse_template
from engine.agents.copilot import CopilotAgent
from engine.agents.factory import AGENT_NAMES, turn_mode
from engine.agents.stream import JsonStreamAgent, find_binary
from engine.errors import ConfigError
from engine.settings import Settings

__all__ = ["AgentStatus", "agent_statuses", "register"]

# A status command may give up on a hung ``--version``; turns never time out.
VERSION_TIMEOUT: Final = 30.0

_ADAPTERS: Final[dict[str, type[JsonStreamAgent]]] = {
    "claude": ClaudeAgent,
    "copilot": CopilotAgent,
    "codex": CodexAgent,
}


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
        print(turn_modes_text(settings))
    default = next(s for s in statuses if s.default)
    return 0 if default.path is not None else 1


async def agent_statuses(settings: Settings) -> list[AgentStatus]:
    """Every agent turnstile knows, the default one marked, versions asked concurrently."""
    path = os.environ.get("PATH")
    jobs = []
    for name, cls in _ADAPTERS.items():
        binary = {
            "claude": settings.claude_bin,
            "copilot": settings.copilot_bin,
            "codex": settings.codex_bin,
        }[name]
        jobs.append(_probe(name, binary, cls.binary_setting, settings, path, cls.npm_package))
    jobs.append(_probe_command(settings, path))
    return list(await asyncio.gather(*jobs))


async def _probe(
    name: str,
    binary: str,
    setting: str,
    settings: Settings,
    path: str | None,
    package: str,
) -> AgentStatus:
    found = find_binary(binary, path)
    default = settings.default_agent == name
    problem: str | None
    if found is None:
        problem = f"not found; install with `npm install -g {package}` or set {setting}"
        return AgentStatus(name, binary, setting, default, None, None, problem)
    version, problem = await _version(found)
    return AgentStatus(name, binary, setting, default, found, version, problem)


async def _probe_command(settings: Settings, path: str | None) -> AgentStatus:
    setting = "TURNSTILE_AGENT_COMMAND"
    default = settings.default_agent == "command"
    if not settings.agent_command:
        return AgentStatus("command", "", setting, default, None, None, "no template set")
    try:
        words = parse_template(settings.agent_command)
    except ConfigError as exc:
        return AgentStatus("command", "", setting, default, None, None, exc.message)
    found = find_binary(words[0], path)
    problem = None if found else "not found"
    # Any program may be configured: it may not know --version, so none is asked.
    return AgentStatus("command", words[0], setting, default, found, None, problem)


async def _version(binary: str) -> tuple[str | None, str | None]:
    try:
        proc = await asyncio.create_subprocess_exec(
            binary,
            "--version",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        return None, f"cannot run: {exc.strerror or exc}"
    try:
        out, err = await asyncio.wait_for(proc.communicate(), VERSION_TIMEOUT)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        await proc.wait()
        return None, f"--version did not answer within {VERSION_TIMEOUT:.0f} s"
    text = (out or err).decode("utf-8", errors="replace").strip()
    first = text.splitlines()[0] if text else ""
    if proc.returncode != 0:
        return None, f"--version exited with code {proc.returncode}: {first}"
    return first or None, None


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
