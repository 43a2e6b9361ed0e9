"""What an agent CLI supports is kept on disk per binary and version: another process
finds it, a changed binary or a bad file is asked again (engine.agents.probe).

Each question is asked through the factory's ``turn_mode`` by a new Python process (its
memory is empty), about a fake CLI that logs every run (tests/probe_clis.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.agents.factory import turn_mode
from tests.conftest import REPO
from tests.probe_clis import OLD_HELP, fake_cli, runs_of
from tests.support import make_settings

pytestmark = pytest.mark.timeout(120)

_ASK = """\
import json, sys
from pathlib import Path
from engine.agents.factory import turn_mode
from engine.settings import Settings
settings = Settings(
    _env_file=None, claude_bin=sys.argv[1], runs_dir=Path(sys.argv[2]), warm_sessions="claude"
)
mode = turn_mode("claude", settings)
print(json.dumps({"warm": mode.warm, "reason": mode.reason}))
"""


def asked(cli: Path, state: Path) -> subprocess.Popen[str]:
    """A new process asking whether ``cli`` can be warm (its state folder ``state``)."""
    return subprocess.Popen(
        [sys.executable, "-c", _ASK, str(cli), str(state)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )


def ask_in_another_process(cli: Path, state: Path) -> dict[str, object]:
    proc = asked(cli, state)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    answer: dict[str, object] = json.loads(out)
    return answer


def test_a_second_process_finds_the_answer_on_disk(tmp_path: Path) -> None:
    runs, state = tmp_path / "runs.log", tmp_path / "state"
    cli = fake_cli(tmp_path / "bin" / "claude", runs)
    first = ask_in_another_process(cli, state)
    second = ask_in_another_process(cli, state)
    assert first == second
    assert first["warm"] is True
    assert [run[2:] for run in runs_of(runs)] == [["--help"]]  # asked once for both
    [entry] = json.loads((state / "cli-probes.json").read_text())["answers"].values()
    assert entry["answer"] == {"supported": True, "reason": first["reason"]}


def test_a_changed_binary_is_asked_again(tmp_path: Path) -> None:
    runs, state = tmp_path / "runs.log", tmp_path / "state"
    cli = fake_cli(tmp_path / "bin" / "claude", runs)
    assert ask_in_another_process(cli, state)["warm"] is True
    # An upgrade: another file (size and date) behind the same name.
    fake_cli(cli, runs, help_text=OLD_HELP)
    stat = cli.stat()
    os.utime(cli, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    answer = ask_in_another_process(cli, state)
    assert answer["warm"] is False
    assert "--input-format" in str(answer["reason"])
    assert len(runs_of(runs)) == 2
    assert ask_in_another_process(cli, state) == answer
    assert len(runs_of(runs)) == 2


def test_a_new_package_version_is_asked_again_even_with_the_same_launcher(
    tmp_path: Path,
) -> None:
    # npm packs files with fixed dates: a launcher script can keep its size and date
    # across releases, so the version in the package's manifest is part of the key.
    runs, state = tmp_path / "runs.log", tmp_path / "state"
    package = tmp_path / "node_modules" / "fake-claude"
    cli = fake_cli(package / "bin" / "claude", runs)
    manifest = package / "package.json"
    manifest.write_text(json.dumps({"name": "fake-claude", "version": "1.0.0"}))
    assert ask_in_another_process(cli, state)["warm"] is True
    before = cli.stat()
    manifest.write_text(json.dumps({"name": "fake-claude", "version": "1.0.1"}))
    assert (cli.stat().st_size, cli.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert ask_in_another_process(cli, state)["warm"] is True
    assert len(runs_of(runs)) == 2
    [entry] = json.loads((state / "cli-probes.json").read_text())["answers"].values()
    assert entry["version"] == "fake-claude@1.0.1"


@pytest.mark.parametrize(
    "garbage",
    [b"{not json", b"\xff\xfe\x00", b'{"format": 1, "answers": []}', b'{"format": 99}'],
)
def test_a_corrupt_cache_file_is_asked_again_and_rewritten(tmp_path: Path, garbage: bytes) -> None:
    runs, state = tmp_path / "runs.log", tmp_path / "state"
    cli = fake_cli(tmp_path / "bin" / "claude", runs)
    assert ask_in_another_process(cli, state)["warm"] is True
    (state / "cli-probes.json").write_bytes(garbage)
    assert ask_in_another_process(cli, state)["warm"] is True
    assert len(runs_of(runs)) == 2
    assert json.loads((state / "cli-probes.json").read_text())["format"] == 1
    assert ask_in_another_process(cli, state)["warm"] is True
    assert len(runs_of(runs)) == 2


def test_an_answer_of_the_wrong_shape_in_the_file_is_not_believed(tmp_path: Path) -> None:
    runs, state = tmp_path / "runs.log", tmp_path / "state"
    cli = fake_cli(tmp_path / "bin" / "claude", runs, help_text=OLD_HELP)
    assert ask_in_another_process(cli, state)["warm"] is False
    saved = json.loads((state / "cli-probes.json").read_text())
    [entry] = saved["answers"].values()
    entry["answer"]["supported"] = "yes"  # truthy, but not an answer turnstile wrote
    (state / "cli-probes.json").write_text(json.dumps(saved))
    assert ask_in_another_process(cli, state)["warm"] is False
    assert len(runs_of(runs)) == 2


def test_two_processes_writing_at_once_keep_both_answers(tmp_path: Path) -> None:
    runs, state = tmp_path / "runs.log", tmp_path / "state"
    clis = [fake_cli(tmp_path / f"bin{i}" / "claude", runs, sleep=0.2) for i in range(4)]
    procs = [asked(cli, state) for cli in clis]
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        assert json.loads(out)["warm"] is True
    assert len(runs_of(runs)) == 4
    assert len(json.loads((state / "cli-probes.json").read_text())["answers"]) == 4
    for cli in clis:  # this process has never asked: the answers come from the file
        settings = make_settings(
            tmp_path, claude_bin=str(cli), warm_sessions="claude", runs_dir=state
        )
        assert turn_mode("claude", settings).warm
    assert len(runs_of(runs)) == 4
