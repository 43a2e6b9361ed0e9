"""A run's diff for the web view: the changes (:mod:`engine.diff`), the patch highlighted."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

# No stubs for pygments yet (types-Pygments is not among the dev dependencies).
from pygments import highlight  # type: ignore[import-untyped]
from pygments.formatters import HtmlFormatter  # type: ignore[import-untyped]
from pygments.lexers import DiffLexer  # type: ignore[import-untyped]

from engine import diff as changes
from engine.diff import DiffFile
from engine.git import GitRunner

__all__ = ["DiffFile", "DiffView", "diff_css", "run_diff"]

_CLASS: Final = "diff"


@dataclass(frozen=True, slots=True)
class DiffView:
    """The workdir against ``base``; ``problem`` says why there is nothing to show."""

    base: str | None
    files: tuple[DiffFile, ...] = ()
    stat_text: str = ""
    patch_html: str = ""
    truncated: bool = False
    untracked: int = 0
    problem: str | None = None


def diff_css() -> str:
    """The patch's highlighting, scoped under ``.diff`` (pygments' own rules for bare
    ``pre`` and line numbers are left out: they would restyle the whole page)."""
    formatter = HtmlFormatter(cssclass=_CLASS)
    rules: list[str] = [*formatter.get_background_style_defs(f".{_CLASS}")]
    rules += formatter.get_token_style_defs(f".{_CLASS}")
    return "\n".join(rules) + "\n"


async def run_diff(
    workdir: Path, base: str | None, *, max_bytes: int = 400_000, git: GitRunner | None = None
) -> DiffView:
    """What changed in ``workdir`` since ``base`` (or HEAD), uncommitted changes included.

    Args:
        workdir: the run's working tree.
        base: the commit or ref the run started from; None: HEAD.
        max_bytes: the most of the patch shown; the rest is cut with a note.
        git: the runner (default: one that takes no optional locks).
    """
    found = await changes.run_diff(workdir, base, max_bytes=max_bytes, git=git)
    return DiffView(
        base=found.base,
        files=found.files,
        stat_text=found.stat_text,
        patch_html=_highlight(found),
        truncated=found.truncated,
        untracked=len(found.untracked),
        problem=found.problem,
    )


def _highlight(found: changes.RunDiff) -> str:
    """The patch as highlighted HTML, with a note where it was cut."""
    if not found.patch:
        return ""
    text = found.patch.decode("utf-8", errors="replace")
    html = str(highlight(text, DiffLexer(), HtmlFormatter(cssclass=_CLASS)))
    if found.truncated:
        left = found.patch_size - len(found.patch)
        html += f'<p class="diff-cut">The patch was cut here: {_size(left)} more are not shown.</p>'
    return html


def _size(count: int) -> str:
    if count < 1024:
        return f"{count} byte{'' if count == 1 else 's'}"
    if count < 1024 * 1024:
        return f"{count / 1024:.0f} KB"
    return f"{count / 1024 / 1024:.1f} MB"
