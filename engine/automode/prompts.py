"""Prompt templates of auto mode: clarify, plan, execute, evaluate, adjust.

Each phase's prompt is a Markdown template with ``{{name}}`` placeholders, sharing one
philosophy context (``philosophy.md``, embedded through ``{{philosophy}}``). The
templates ship in ``engine/automode/templates``; an operator may override any of them
by putting a file of the same name in a folder (``--prompts DIR`` or
``TURNSTILE_AUTO_PROMPTS_DIR``). Every template is checked when the run starts: an
unknown placeholder, or a missing required one, is refused then, never mid-run.

Substitution is a single pass: a value is never scanned for placeholders again, so
agent output or an appended instruction cannot inject one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Final

from engine.automode.state import Phase, Verdict
from engine.errors import ConfigError

__all__ = [
    "MARKER_PREFIX",
    "PLACEHOLDERS",
    "TEMPLATE_NAMES",
    "PromptTemplates",
    "marker_line",
    "render_markers",
]

MARKER_PREFIX: Final = "AUTO-MODE STATUS:"
_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_COMMON: Final = frozenset({"philosophy", "objective", "turn", "max_turns", "run_id", "workdir"})

# Which placeholders each template may use, and which it must use.
PLACEHOLDERS: Final[Mapping[str, frozenset[str]]] = {
    "philosophy": frozenset({"objective", "max_turns", "run_id", "workdir"}),
    "clarify": _COMMON,
    "plan": _COMMON | {"clarified"},
    "execute": _COMMON | {"clarified", "plan", "evaluation", "feedback", "instructions"},
    "evaluate": _COMMON | {"clarified", "plan", "execution", "markers"},
    "adjust": _COMMON | {"clarified", "plan", "execution", "evaluation"},
}
_REQUIRED: Final[Mapping[str, frozenset[str]]] = {
    # Without it the detector never sees a verdict.
    "evaluate": frozenset({"markers"}),
    # Without it appended instructions would be archived but never reach the agent.
    "execute": frozenset({"instructions"}),
}
TEMPLATE_NAMES: Final = tuple(PLACEHOLDERS)


def marker_line(verdict: Verdict) -> str:
    return f"{MARKER_PREFIX} {verdict.value}"


def render_markers() -> str:
    return "\n".join(marker_line(v) for v in Verdict)


def _placeholders(text: str) -> set[str]:
    return {m.group(1) for m in _PLACEHOLDER.finditer(text)}


def _substitute(text: str, values: Mapping[str, str]) -> str:
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


@dataclass(frozen=True, slots=True)
class PromptTemplates:
    """The six templates, validated.

    Attributes:
        texts: template name → template text.
        sources: template name → where it came from (``builtin`` or a file path).
    """

    texts: Mapping[str, str]
    sources: Mapping[str, str]

    @classmethod
    def builtin(cls) -> PromptTemplates:
        return cls.load(None)

    @classmethod
    def load(cls, folder: Path | None) -> PromptTemplates:
        """The built-in templates, with any ``<name>.md`` in ``folder`` taking precedence.

        Raises:
            ConfigError: the folder is missing, a file is unreadable, or a template uses
                an unknown placeholder or lacks a required one.
        """
        if folder is not None and not folder.is_dir():
            raise ConfigError(
                f"prompt template folder {folder} does not exist",
                setting="TURNSTILE_AUTO_PROMPTS_DIR",
            )
        builtin = resources.files("engine.automode") / "templates"
        texts: dict[str, str] = {}
        sources: dict[str, str] = {}
        for name in TEMPLATE_NAMES:
            override = folder / f"{name}.md" if folder is not None else None
            if override is not None and override.is_file():
                try:
                    texts[name] = override.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError) as exc:
                    raise ConfigError(
                        f"cannot read prompt template {override}: {exc}",
                        setting="TURNSTILE_AUTO_PROMPTS_DIR",
                    ) from exc
                sources[name] = str(override)
            else:
                texts[name] = (builtin / f"{name}.md").read_text(encoding="utf-8")
                sources[name] = "builtin"
        templates = cls(texts=texts, sources=sources)
        templates.validate()
        return templates

    def validate(self) -> None:
        """Refuse unknown and missing placeholders (at start, never mid-run)."""
        for name, text in self.texts.items():
            used = _placeholders(text)
            unknown = used - PLACEHOLDERS[name]
            if unknown:
                raise ConfigError(
                    f"prompt template {name} ({self.sources[name]}) uses unknown placeholder(s) "
                    f"{', '.join('{{' + u + '}}' for u in sorted(unknown))}; allowed: "
                    f"{', '.join('{{' + a + '}}' for a in sorted(PLACEHOLDERS[name]))}",
                    setting="TURNSTILE_AUTO_PROMPTS_DIR",
                )
            missing = _REQUIRED.get(name, frozenset()) - used
            if missing:
                raise ConfigError(
                    f"prompt template {name} ({self.sources[name]}) must use "
                    f"{', '.join('{{' + m + '}}' for m in sorted(missing))}",
                    setting="TURNSTILE_AUTO_PROMPTS_DIR",
                )

    def render(self, phase: Phase, values: Mapping[str, str]) -> str:
        """The prompt for ``phase``; ``values`` must hold every placeholder it may use."""
        context = {k: v for k, v in values.items() if k in PLACEHOLDERS["philosophy"]}
        context.setdefault("objective", "")
        philosophy = _substitute(self.texts["philosophy"], _defaults(context))
        full = _defaults({**values, "philosophy": philosophy.strip()})
        if phase is Phase.EVALUATE:
            full["markers"] = render_markers()
        return _substitute(self.texts[phase.value], full).strip() + "\n"


def _defaults(values: Mapping[str, str]) -> dict[str, str]:
    # Every allowed name resolves: a phase with nothing to say leaves it empty.
    names = set().union(*PLACEHOLDERS.values())
    return {name: str(values.get(name, "")) for name in names}
