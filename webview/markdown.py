"""Markdown an agent or a person wrote (artifacts, results, notes) as HTML safe to show.

CommonMark plus tables and strikethrough. Raw HTML in the source is shown as text, links
go to http, https and mailto only, and fenced code is highlighted with pygments' CSS
classes (no inline styles, so a strict content security policy holds).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from html import escape
from typing import Final
from urllib.parse import urlsplit

from markdown_it import MarkdownIt
from markdown_it.renderer import RendererHTML
from markdown_it.token import Token
from markdown_it.utils import EnvType, OptionsDict

# No stubs for pygments yet (types-Pygments is not among the dev dependencies).
from pygments import highlight  # type: ignore[import-untyped]
from pygments.formatters import HtmlFormatter  # type: ignore[import-untyped]
from pygments.lexers import get_lexer_by_name  # type: ignore[import-untyped]
from pygments.util import ClassNotFound  # type: ignore[import-untyped]

__all__ = ["code_css", "render_markdown"]

_CLASS: Final = "highlight"
_SCHEMES: Final = frozenset({"http", "https", "mailto"})


def render_markdown(text: str) -> str:
    """``text`` (Markdown) as HTML: nothing in it runs in the page that shows it."""
    return str(_parser().render(text))


def code_css() -> str:
    """The code blocks' highlighting, scoped under ``.highlight``."""
    formatter = HtmlFormatter(cssclass=_CLASS)
    rules: list[str] = [*formatter.get_background_style_defs(f".{_CLASS}")]
    rules += formatter.get_token_style_defs(f".{_CLASS}")
    return "\n".join(rules) + "\n"


def _safe_link(url: str) -> bool:
    """Only links that open a page or a mail: no ``javascript:``, ``data:``, ``file:``, nor
    a relative link (it would point into the web view itself)."""
    try:
        scheme = urlsplit(url).scheme
    except ValueError:  # a malformed address, such as an unclosed IPv6 bracket
        return False
    return scheme.lower() in _SCHEMES


def _code(code: str, lang: str, _attrs: str) -> str:
    """A fenced block in a language pygments knows, highlighted; "" leaves any other to
    markdown-it, which escapes it into a plain ``<pre><code>``."""
    if not lang:
        return ""
    try:
        lexer = get_lexer_by_name(lang)
    except ClassNotFound:
        return ""
    spans = str(highlight(code, lexer, HtmlFormatter(nowrap=True)))
    # Starting with <pre, markdown-it takes the block as it is.
    return f'<pre class="{_CLASS}"><code class="language-{escape(lang)}">{spans}</code></pre>'


def _link_open(
    renderer: RendererHTML, tokens: Sequence[Token], idx: int, options: OptionsDict, env: EnvType
) -> str:
    # No Referer: the page's own address (a run's id, a sign-in) stays with us.
    tokens[idx].attrSet("rel", "nofollow noreferrer")
    return renderer.renderToken(tokens, idx, options, env)


@functools.cache
def _parser() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False, "highlight": _code})
    md.enable(["table", "strikethrough"])
    md.validateLink = _safe_link  # type: ignore[method-assign]
    md.add_render_rule("link_open", _link_open)
    return md
