"""Least-privilege tool allowlists for the driven agent."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["READ_ONLY_TOOLS", "ToolAllowlist", "build_turn_argv"]

READ_ONLY_TOOLS: tuple[str, ...] = ("view", "grep", "glob")


@dataclass(frozen=True, slots=True)
class ToolAllowlist:
    """The tools an agent may run.

    No explicit tools means the read-only investigation tools. "Dangerous" is an explicit
    opt-in to every *tool*; it never opens every path or URL.
    """

    tools: tuple[str, ...] = READ_ONLY_TOOLS
    dangerous: bool = False

    @classmethod
    def read_only_default(cls) -> ToolAllowlist:
        return cls(tools=READ_ONLY_TOOLS, dangerous=False)

    @classmethod
    def from_flags(cls, flags: Iterable[str], dangerous: bool = False) -> ToolAllowlist:
        """Exactly the listed tools, in order (duplicates dropped); none → read-only."""
        seen: dict[str, None] = {}
        for flag in flags:
            name = flag.strip()
            if name:
                seen.setdefault(name, None)
        if dangerous:
            return cls(tools=tuple(seen), dangerous=True)
        if not seen:
            return cls.read_only_default()
        return cls(tools=tuple(seen), dangerous=False)

    def to_copilot_args(self) -> list[str]:
        """Copilot flags: ``--allow-tool X`` each; dangerous: ``--allow-all-tools``.

        Never ``--allow-all``, which would also open every path and URL.
        """
        if self.dangerous:
            return ["--allow-all-tools"]
        args: list[str] = []
        for tool in self.tools:
            args += ["--allow-tool", tool]
        return args

    def describe(self) -> str:
        """A one-line, human-readable account for logs and chat."""
        if self.dangerous:
            return "all tools (dangerous opt-in; paths and URLs stay restricted)"
        if self.tools == READ_ONLY_TOOLS:
            return "read-only: " + ", ".join(self.tools)
        return "tools: " + ", ".join(self.tools)


def build_turn_argv(session_id: str, prompt: str, allowlist: ToolAllowlist) -> list[str]:
    """Copilot's resume argv for one turn (the program itself is supplied by the runner).

    The prompt is exactly one argv element, verbatim, right after ``-p``.
    """
    argv: Sequence[str] = ["--session-id", session_id, "--no-color", "-s", "-p", prompt]
    return [*argv, *allowlist.to_copilot_args()]
