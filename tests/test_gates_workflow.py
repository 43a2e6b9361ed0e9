"""The workflow definition: shipped defaults, and every validation error names file and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.gates import HUMAN_INTERVENTION, WorkflowError, load_workflow
from engine.gates.service import workflow_from_settings
from tests.gates_support import make_settings

MINIMAL = """
[phases.one]
persona = "P"
approval = true
artifact = "one.md"
prompt = "do one"

[phases.two]
persona = "Q"
approval = false
artifact = "two.md"
prompt = "do two"
"""


def test_defaults_match_the_issue() -> None:
    wf = load_workflow()
    assert wf.names == (
        "research",
        "decomposition",
        "design",
        "test_design",
        "implement",
        "bug_find",
        "adversarial_bug_find",
        "doc_review",
        "referee",
    )
    assert wf.approval_phases() == ("research", "decomposition", "design", "test_design")
    artifacts = {p.name: p.artifact for p in wf.phases}
    assert artifacts["test_design"] == "test_plan.md"
    assert artifacts["implement"] == "implementation.md"
    assert [p.name for p in wf.phases if p.code_edits] == ["implement"]
    assert wf.phase("referee").next == "complete"
    assert wf.decomposition == "decomposition"
    assert wf.subtask_start == "design"
    for spec in wf.phases:
        assert spec.allowed, spec.name
        assert spec.forbidden_actions, spec.name


def test_operator_override_via_setting(tmp_path: Path) -> None:
    path = tmp_path / "wf.toml"
    path.write_text(MINIMAL)
    wf = workflow_from_settings(make_settings(tmp_path, workflow_file=path))
    assert wf.names == ("one", "two")
    assert wf.phase("one").next == "two"
    assert wf.phase("two").next == "complete"
    assert wf.source == str(path)


@pytest.mark.parametrize(
    ("edit", "key", "problem"),
    [
        (
            lambda t: t.replace('prompt = "do two"', 'prompt = "do two"\ncolour = "red"'),
            "phases.two.colour",
            "unknown key",
        ),
        (
            lambda t: t.replace('prompt = "do one"', 'prompt = "do one"\nnext = "nowhere"'),
            "phases.one.next",
            "unknown phase",
        ),
        (
            lambda t: t.replace('prompt = "do one"', 'prompt = "do one"\nnext = "complete"'),
            "phases.two",
            "unreachable",
        ),
        (
            lambda t: t.replace('prompt = "do two"', 'prompt = "do two"\nnext = "one"'),
            "phases.two.next",
            "later phase",
        ),
        (
            lambda t: t.replace('artifact = "two.md"', 'artifact = "one.md"'),
            "phases.two.artifact",
            "already",
        ),
        (
            lambda t: t.replace('artifact = "two.md"', 'artifact = "../x.md"'),
            "phases.two.artifact",
            "plain file name",
        ),
        (
            lambda t: t.replace("approval = false", 'approval = "no"'),
            "phases.two.approval",
            "expected bool",
        ),
        (lambda t: t.replace('persona = "Q"\n', ""), "phases.two.persona", "missing"),
        (lambda t: t.replace("[phases.two]", "[phases.complete]"), "phases.complete", "built-in"),
        (lambda t: t.replace("[phases.two]", "[phases.Two-2]"), "phases.Two-2", "lower-case"),
        (lambda t: t + "\n[extra]\nx = 1\n", "extra", "unknown table"),
        (
            lambda t: '[workflow]\nsubtask_start = "zz"\n' + t,
            "workflow.subtask_start",
            "unknown phase",
        ),
        (lambda t: t.replace("[phases.one]", "[phases.one"), "-", "not valid TOML"),
        (lambda t: "", "phases", "at least one"),
    ],
)
def test_invalid_definitions_name_file_and_key(
    tmp_path: Path, edit: object, key: str, problem: str
) -> None:
    path = tmp_path / "bad.toml"
    assert callable(edit)
    path.write_text(edit(MINIMAL))
    with pytest.raises(WorkflowError) as info:
        load_workflow(path)
    assert info.value.file == str(path)
    assert info.value.key == key
    assert problem in info.value.problem
    assert str(path) in str(info.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(WorkflowError, match="cannot read"):
        load_workflow(tmp_path / "absent.toml")


def test_human_intervention_is_builtin() -> None:
    wf = load_workflow()
    assert wf.is_state(HUMAN_INTERVENTION)
    assert not wf.has(HUMAN_INTERVENTION)
