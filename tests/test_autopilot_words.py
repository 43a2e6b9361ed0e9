"""The terminal's autopilot view says phases in words, as the chat does ("test design",
never "test_design"), from the first phase to the task's end."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.gates_support import (
    APPROVER,
    agent_env,
    cli_env,
    make_settings,
    phase_rules,
    run_cli,
    write_script,
)

# Internal names people must never read (phases, states); file names aside.
_INTERNAL = re.compile(r"test_design|bug_find|doc_review|human_intervention|awaiting_approval")


@pytest.mark.timeout(120)
async def test_the_terminal_autopilot_view_says_every_phase_in_words(tmp_path: Path) -> None:
    rules = phase_rules()
    for rule in rules:  # (what the agent writes is its own: only what turnstile says counts)
        rule["text"] = "wrote it"
    settings = make_settings(tmp_path)
    env = cli_env(settings, agent_env(tmp_path, write_script(tmp_path, {"rules": rules})))
    drive = ("autopilot", "--task", "k", "--tool", "command", "--no-wait")
    rc, out, err = await run_cli(*drive, "--init", env=env)
    said = [out]
    for _ in range(4):  # research, decomposition, design, test design: each parks at its gate
        assert rc == 3, (out, err)
        rc, _, err = await run_cli(
            "status", "--task", "k", "--approve", "--by", str(APPROVER), env=env
        )
        assert rc == 0, err
        rc, out, err = await run_cli(*drive, env=env)
        said.append(out)
    assert rc == 0, (out, err)
    text = "\n".join(said)
    assert "k · test design waits for approval of test_plan.md" in text
    assert "k · adversarial bug find: ⏳ running" in text, text
    assert "the task is complete" in text
    # its end said once, not "k · ✅ complete: ✅ complete"
    assert "k: ✅ complete" in text.splitlines(), text
    leaked = [
        line for line in text.splitlines() if _INTERNAL.search(re.sub(r"\S+\.md\b", "", line))
    ]
    assert not leaked, leaked
