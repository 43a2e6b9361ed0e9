"""engine.safefile against real files, pipes, devices and links in tmp_path."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import safefile
from engine.errors import UnsafeFileError

pytestmark = pytest.mark.timeout(60)


def _bounded(call: Callable[[], object], seconds: float = 10.0) -> object:
    """Run ``call`` in a daemon thread; fail (instead of hanging) if it does not return."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the test thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    path = tmp_path / "task"
    path.mkdir()
    return path


def _reason(call: Callable[[], object]) -> str:
    with pytest.raises(UnsafeFileError) as info:
        _bounded(call)
    return info.value.reason


def test_a_plain_file_is_read_and_hashed(folder: Path) -> None:
    (folder / "research.md").write_bytes(b"# research\n")
    assert safefile.read_bytes(folder, "research.md", limit=100) == b"# research\n"
    assert safefile.read_head(folder, "research.md", 4) == b"# re"
    assert safefile.sha256(folder, "research.md") == hashlib.sha256(b"# research\n").hexdigest()


def test_a_named_pipe_is_refused_at_once(folder: Path) -> None:
    os.mkfifo(folder / "research.md")
    for call in (
        lambda: safefile.sha256(folder, "research.md"),
        lambda: safefile.read_bytes(folder, "research.md", limit=10),
        lambda: safefile.read_head(folder, "research.md", 10),
    ):
        assert _reason(call) == safefile.Unsafe.NOT_REGULAR


def test_a_link_to_dev_zero_is_refused(folder: Path) -> None:
    (folder / "research.md").symlink_to("/dev/zero")
    assert _reason(lambda: safefile.sha256(folder, "research.md")) == safefile.Unsafe.OUTSIDE


def test_a_device_reached_inside_the_folder_is_refused(folder: Path) -> None:
    # A folder may legitimately link to a file of its own; what it reaches must be a file.
    os.mkfifo(folder / "pipe")
    (folder / "research.md").symlink_to("pipe")
    assert _reason(lambda: safefile.sha256(folder, "research.md")) == safefile.Unsafe.NOT_REGULAR


def test_a_link_out_of_the_folder_is_refused(folder: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cr3t")
    (folder / "research.md").symlink_to(secret)
    with pytest.raises(UnsafeFileError) as info:
        safefile.read_bytes(folder, "research.md", limit=100)
    assert info.value.reason == safefile.Unsafe.OUTSIDE
    assert "outside" in info.value.message
    assert "s3cr3t" not in info.value.message


def test_a_relative_link_climbing_out_is_refused(folder: Path, tmp_path: Path) -> None:
    (tmp_path / "secret.txt").write_text("s3cr3t")
    (folder / "research.md").symlink_to("../secret.txt")
    assert _reason(lambda: safefile.sha256(folder, "research.md")) == safefile.Unsafe.OUTSIDE


def test_a_linked_subfolder_leading_out_is_refused(folder: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "a.md").write_text("s3cr3t")
    (folder / "sub").symlink_to(outside)
    assert _reason(lambda: safefile.read_head(folder, "sub/a.md", 10)) == safefile.Unsafe.OUTSIDE


def test_a_link_inside_the_folder_is_followed(folder: Path) -> None:
    (folder / "notes").mkdir()
    (folder / "notes" / "r.md").write_text("inside")
    (folder / "research.md").symlink_to("notes/r.md")
    assert safefile.read_bytes(folder, "research.md", limit=100) == b"inside"


def test_a_link_loop_is_refused(folder: Path) -> None:
    (folder / "a").symlink_to("b")
    (folder / "b").symlink_to("a")
    reason = _reason(lambda: safefile.sha256(folder, "a"))
    assert reason in (safefile.Unsafe.LINK, safefile.Unsafe.OUTSIDE)


def test_a_folder_is_not_a_file(folder: Path) -> None:
    (folder / "research.md").mkdir()
    assert _reason(lambda: safefile.sha256(folder, "research.md")) == safefile.Unsafe.NOT_REGULAR


def test_reads_are_capped(folder: Path) -> None:
    with (folder / "big.md").open("wb") as fh:
        fh.truncate(10 * 1024 * 1024)
    assert _reason(lambda: safefile.read_bytes(folder, "big.md", limit=1024)) == (
        safefile.Unsafe.TOO_LARGE
    )
    assert len(safefile.read_head(folder, "big.md", 1024)) == 1024
    assert _reason(lambda: safefile.sha256(folder, "big.md", limit=1024 * 1024)) == (
        safefile.Unsafe.TOO_LARGE
    )


def test_missing_files_raise_file_not_found(folder: Path) -> None:
    with pytest.raises(FileNotFoundError):
        safefile.sha256(folder, "research.md")
    with pytest.raises(FileNotFoundError):
        safefile.read_bytes(folder / "gone", "research.md", limit=1)


def test_paths_must_stay_relative(folder: Path) -> None:
    for bad in ("/etc/passwd", "../x", ""):
        with pytest.raises(ValueError, match="inside a folder"):
            safefile.read_head(folder, bad, 1)
