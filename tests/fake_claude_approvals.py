"""A stand-in for Claude Code's ``-p --output-format stream-json`` mode that asks turnstile's
permission tool before it runs a command, the way the real CLI does.

A prompt holding ``run: COMMAND`` makes the "model" want ``Bash`` with ``COMMAND``. With a
``--mcp-config`` naming turnstile's server, the fake starts that server over stdio (its
command, args and env, as Claude Code does) and calls ``approve``; an allow runs the
command in the cwd, a deny is reported in the answer. Without the config, the command is
refused as Claude Code refuses a tool outside ``--allowedTools``. Any other prompt is
echoed. Each turn's argv is appended (one JSON line) to ``$FAKE_CLAUDE_LOG``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def option(argv: list[str], name: str) -> str | None:
    if name in argv:
        index = argv.index(name)
        return argv[index + 1] if index + 1 < len(argv) else None
    return None


async def ask(config: dict[str, Any], tool_input: dict[str, Any]) -> dict[str, Any]:
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    server = config["mcpServers"]["turnstile"]
    params = StdioServerParameters(
        command=server["command"],
        args=list(server["args"]),
        env={**os.environ, **server.get("env", {})},
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        result = await session.call_tool(
            "approve", {"tool_name": "Bash", "input": tool_input, "tool_use_id": "toolu_fake"}
        )
    answer: dict[str, Any] = json.loads(result.content[0].text)  # type: ignore[union-attr]
    return answer


def main() -> int:
    argv = sys.argv[1:]
    if "--help" in argv or "--version" in argv:
        print("fake claude 0.0 (-p, --output-format, --mcp-config, --permission-prompt-tool)")
        return 0
    log = os.environ.get("FAKE_CLAUDE_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as out:
            out.write(json.dumps({"argv": argv, "cwd": os.getcwd()}) + "\n")
    session = option(argv, "--session-id") or option(argv, "--resume") or "none"
    prompt = sys.stdin.read()
    emit({"type": "system", "subtype": "init", "session_id": session, "model": "fake"})
    marker = "run: "
    if marker not in prompt:
        text = f"echo: {prompt.strip()}"
    else:
        command = prompt.split(marker, 1)[1].strip().splitlines()[0]
        tool_input = {"command": command}
        emit(
            {
                "type": "assistant",
                "message": {
                    "content": [
                        {
                            "type": "tool_use",
                            "id": "toolu_fake",
                            "name": "Bash",
                            "input": tool_input,
                        }
                    ]
                },
            }
        )
        config = option(argv, "--mcp-config")
        if config is None:
            answer: dict[str, Any] = {"behavior": "deny", "message": "not on the allowed list"}
        else:
            answer = asyncio.run(ask(json.loads(config), tool_input))
        if answer.get("behavior") == "allow":
            done = subprocess.run(command, shell=True, check=False)
            text = f"ran {command} (exit {done.returncode})"
        else:
            text = f"refused: {answer.get('message')}"
    emit({"type": "assistant", "message": {"content": [{"type": "text", "text": text}]}})
    emit(
        {
            "type": "result",
            "subtype": "success",
            "is_error": False,
            "result": text,
            "num_turns": 1,
            "session_id": session,
        }
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
