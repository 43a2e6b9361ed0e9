"""The ``command`` agent: any CLI, configured by an argv template."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path

from engine.agents.base import AgentOptions, Invocation, ProcessAgent
from engine.errors import ConfigError
from engine.process import PreemptHandle

__all__ = ["PLACEHOLDERS", "CommandAgent", "parse_template"]

PLACEHOLDERS = ("{prompt}", "{session_id}", "{cwd}")


def parse_template(template: str) -> list[str]:
    """Split an argv template the way a shell would, without ever running a shell.

    Placeholders ``{prompt}``, ``{session_id}`` and ``{cwd}`` must stand alone as one
    word; each becomes exactly one argv element. Without ``{prompt}`` the prompt is
    written to the program's stdin.

    Raises:
        ConfigError: empty template, unbalanced quotes, or a placeholder inside a word.
    """
    try:
        words = shlex.split(template, posix=True)
    except ValueError as exc:
        raise ConfigError(
            f"agent command template cannot be split: {exc}", setting="TURNSTILE_AGENT_COMMAND"
        ) from exc
    if not words:
        raise ConfigError("agent command template is empty", setting="TURNSTILE_AGENT_COMMAND")
    for word in words:
        for placeholder in PLACEHOLDERS:
            if placeholder in word and word != placeholder:
                raise ConfigError(
                    f"placeholder {placeholder} must be a whole word in the agent command "
                    f"template, found {word!r}",
                    setting="TURNSTILE_AGENT_COMMAND",
                )
    if words[0] in PLACEHOLDERS:
        raise ConfigError(
            "the agent command template must start with a program, not a placeholder",
            setting="TURNSTILE_AGENT_COMMAND",
        )
    return words


class CommandAgent(ProcessAgent):
    """Runs any agent CLI from an argv template, one process per turn.

    Attributes:
        on_line: called with each stdout line (decoded) while a turn runs: the only
            progress an arbitrary CLI gives. It must not raise.
    """

    on_line: Callable[[str], None] | None = None

    def __init__(
        self,
        template: str,
        *,
        cwd: Path,
        options: AgentOptions | None = None,
        session_id: str | None = None,
        preempt: PreemptHandle | None = None,
    ) -> None:
        self.template = parse_template(template)
        base = options or AgentOptions(binary=self.template[0], cwd=cwd)
        super().__init__(base, session_id=session_id, preempt=preempt)

    def on_stdout_line(self, line: bytes) -> None:
        if self.on_line is not None:
            self.on_line(line.decode("utf-8", errors="replace").rstrip("\r\n"))

    def build_invocation(self, prompt: str) -> Invocation:
        values = {
            "{prompt}": prompt,
            "{session_id}": self.session_id,
            "{cwd}": str(self.options.cwd),
        }
        argv = [values.get(word, word) for word in self.template]
        argv += list(self.options.passthrough)
        stdin = None if "{prompt}" in self.template else prompt.encode("utf-8")
        return Invocation(argv=argv, stdin=stdin)
