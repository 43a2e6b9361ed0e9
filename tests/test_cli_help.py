"""Every ``--help`` of the turnstile command reads as text: no docstring markup shows."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator

from engine.cli import build_parser


def _parsers(
    parser: argparse.ArgumentParser, name: str = "turnstile"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_no_help_shows_double_backticks() -> None:
    seen = dict(_parsers(build_parser()))
    assert {"turnstile auto", "turnstile worker", "turnstile projects cleanup"} <= set(seen)
    for name, parser in seen.items():
        text = parser.format_help()
        assert "``" not in text, (name, text)
    assert "`turnstile worker` runs agent turns" in seen["turnstile worker"].format_help()


def test_the_help_a_person_runs_has_none_either() -> None:
    for command in ("auto", "stop", "worker"):
        shown = subprocess.run(
            [sys.executable, "-m", "engine.cli", command, "--help"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        assert "``" not in shown, shown
        assert f"turnstile {command}" in shown
