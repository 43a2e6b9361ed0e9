"""The keeper of a resident sandbox (engine/keeper.py): transparent while its parent lives,
a short grace for the agent to save its work when the parent dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine.keeper import GRACE

pytestmark = pytest.mark.timeout(60)

KEEPER = str(Path(__file__).resolve().parent.parent / "engine" / "keeper.py")


def keeper(*argv: str) -> list[str]:
    return [sys.executable, "-I", "-S", KEEPER, "--", *argv]


def test_it_ends_the_way_its_child_ends_and_passes_the_pipes_through() -> None:
    done = subprocess.run(
        keeper("sh", "-c", "read line; echo got $line; exit 3"),
        input=b"hello\n",
        capture_output=True,
        timeout=30,
    )
    assert (done.returncode, done.stdout) == (3, b"got hello\n")
    killed = subprocess.run(keeper("sh", "-c", "kill -TERM $$"), timeout=30)
    assert killed.returncode == -signal.SIGTERM
    assert subprocess.run(keeper(), timeout=30, capture_output=True).returncode != 0


def test_its_output_closes_when_the_child_ends_even_if_a_grandchild_holds_none() -> None:
    # The keeper keeps no copy of the pipes: the reader sees the end when the child ends.
    proc = subprocess.Popen(keeper("sh", "-c", "echo bye"), stdout=subprocess.PIPE)
    assert proc.stdout is not None
    with proc.stdout:
        assert proc.stdout.read() == b"bye\n"
    assert proc.wait(timeout=30) == 0


PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    keeper, child, ready = sys.argv[1], sys.argv[2], sys.argv[3]
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", keeper, "--", sys.executable, child],
        stdin=subprocess.PIPE,
    )
    print(proc.pid, flush=True)
    time.sleep(3600)
    """
)

SAVER = textwrap.dedent(
    """
    import pathlib, sys, time
    out = pathlib.Path(sys.argv[0]).with_suffix(".saved")
    pathlib.Path(sys.argv[0]).with_suffix(".ready").write_text("")
    sys.stdin.read()  # until turnstile is gone: its pipe closes
    time.sleep(0.5)  # saving takes a moment
    out.write_text("saved")
    """
)

STUBBORN = textwrap.dedent(
    """
    import pathlib, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pathlib.Path(sys.argv[0]).with_suffix(".ready").write_text("")
    sys.stdin.read()
    time.sleep(3600)  # does not leave by itself
    """
)


def _parent_with(tmp_path: Path, child_source: str) -> tuple[subprocess.Popen[str], int, Path]:
    child = tmp_path / "child.py"
    child.write_text(child_source)
    parent = tmp_path / "parent.py"
    parent.write_text(PARENT)
    proc = subprocess.Popen(
        [sys.executable, str(parent), KEEPER, str(child), str(tmp_path / "child.ready")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    kept = int(proc.stdout.readline())
    proc.stdout.close()
    deadline = time.monotonic() + 20
    while not child.with_suffix(".ready").exists():
        assert time.monotonic() < deadline, "the child did not start"
        time.sleep(0.02)
    return proc, kept, child


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def test_when_its_parent_is_killed_the_child_gets_time_to_save(tmp_path: Path) -> None:
    parent, kept, child = _parent_with(tmp_path, SAVER)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + GRACE + 10
    while not _gone(kept):
        assert time.monotonic() < deadline, "the keeper did not end"
        time.sleep(0.02)
    assert child.with_suffix(".saved").read_text() == "saved"


def test_a_child_that_does_not_leave_is_given_up_on_after_the_grace(tmp_path: Path) -> None:
    parent, kept, _ = _parent_with(tmp_path, STUBBORN)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    started = time.monotonic()
    while not _gone(kept):
        assert time.monotonic() < started + GRACE + 10, "the keeper did not end"
        time.sleep(0.05)
    # It waited for the child first (a sandbox around it then dies with the keeper).
    assert time.monotonic() - started >= GRACE - 0.5
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if str(tmp_path / "child.py").encode() in cmd:
                os.kill(int(pid), signal.SIGKILL)
