"""The drawing in engine/errors.py is the whole error tree of the project, and true."""

from __future__ import annotations

import importlib
import pkgutil
import re

import pytest

import bot
import chatfront
import engine
from engine import errors
from engine.errors import TurnstileError


def _project_errors() -> dict[str, type[BaseException]]:
    for package in (engine, chatfront, bot):
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            importlib.import_module(info.name)
    found: dict[str, type[BaseException]] = {}
    todo: list[type[BaseException]] = [TurnstileError]
    while todo:
        cls = todo.pop()
        if cls.__module__.split(".")[0] in {"engine", "chatfront", "bot"}:
            found[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return found


def _drawn() -> dict[str, str | None]:
    """Each class in the drawing and the class it is drawn under."""
    assert errors.__doc__ is not None
    drawing = errors.__doc__.split("```")[1]
    parents: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []
    for line in drawing.splitlines():
        match = re.match(r"^([│ ├└─]*)([A-Z]\w+)\b", line)
        if match is None:
            continue
        depth = len(match.group(1)) // 4
        name = match.group(2)
        stack = stack[:depth]
        parents[name] = stack[-1][1] if stack else None
        stack.append((depth, name))
    return parents


def test_every_error_class_is_drawn_under_its_parent() -> None:
    classes = _project_errors()
    drawn = _drawn()
    assert set(drawn) == set(classes)
    assert drawn.pop("TurnstileError") is None
    for name, parent in drawn.items():
        assert classes[name].__bases__[0].__name__ == parent, name


@pytest.mark.parametrize("name", sorted(errors.__all__))
def test_every_class_here_is_exported(name: str) -> None:
    assert issubclass(getattr(errors, name), TurnstileError)
