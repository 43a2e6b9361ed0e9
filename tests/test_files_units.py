"""engine.files and engine.transcribe on their own: names, paths, zips, markers, the client."""

from __future__ import annotations

import importlib
import os
import socket
import unicodedata
import zipfile
from pathlib import Path

import pytest
from hypothesis import given as for_all
from hypothesis import strategies as st
from pydantic import SecretStr

from engine.errors import FileRefusedError, TranscriptionError
from engine.files import (
    clean_mime,
    exclude_in_git,
    human_size,
    read_for_send,
    resolve_inside,
    sanitize_name,
    save_upload,
    send_markers,
    type_refused,
    zip_folder,
)
from engine.redact import Redactor
from engine.settings import Settings
from engine.transcribe import HttpTranscriber, endpoint_url
from tests.automode_support import git_workspace
from tests.fakes.transcription_api import FakeTranscriptionApi


@pytest.mark.parametrize("package", ["engine.files", "engine.transcribe", "bot.files"])
def test_all_lists_real_names(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        assert hasattr(module, name), f"{package}.{name}"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("report.pdf", "report.pdf"),
        ("../x", "x"),
        ("../../etc/passwd", "passwd"),
        ("C:\\Users\\me\\notes.txt", "notes.txt"),
        (".bashrc", "bashrc"),
        ("...", "file"),
        ("..", "file"),
        ("", "file"),
        (None, "file"),
        ("   ", "file"),
        ("a\x00b\nc.txt", "a_b_c.txt"),
        ("cafe\u0301.txt", "caf\u00e9.txt"),
        ("trailing dots...", "trailing dots"),
        ('what?*:"<>|.txt', "what_______.txt"),
        # A right-to-left override showed "evil\u202etxt.sh" as "evilhs.txt".
        ("evil\u202etxt.sh", "eviltxt.sh"),
        ("in\u200bvisible\u2066.txt", "invisible.txt"),
        # A lone surrogate crashed the upload (the file and its caption were lost).
        ("\udcff.txt", "_.txt"),
        ("next\u0085line.txt", "next_line.txt"),
        # NFC after what goes: an accent kept apart by a zero-width joiner combines.
        ("e\u200d\u0301.txt", "\u00e9.txt"),
    ],
)
def test_sanitize_name(given: str | None, expected: str) -> None:
    assert sanitize_name(given) == expected


@for_all(st.text(max_size=400))
def test_any_sanitized_name_is_one_plain_visible_name(name: str) -> None:
    clean = sanitize_name(name)
    assert clean
    assert "/" not in clean
    assert "\\" not in clean
    assert "\x00" not in clean
    assert not clean.startswith((".", " "))
    assert clean not in (".", "..")
    assert len(clean.encode()) <= 120
    assert unicodedata.is_normalized("NFC", clean)
    assert sanitize_name(clean) == clean


@for_all(st.text(alphabet=st.characters(exclude_categories=()), max_size=200))
def test_a_sanitized_name_holds_nothing_invisible_and_can_be_written(name: str) -> None:
    clean = sanitize_name(name)
    assert not [c for c in clean if unicodedata.category(c) in ("Cf", "Cs", "Cc")]
    clean.encode("utf-8")  # what a file system and a chat take


def test_long_names_are_cut_keeping_the_extension() -> None:
    name = sanitize_name("é" * 200 + ".tar.gz")
    assert name.endswith(".gz")
    assert len(name.encode()) <= 120
    name.encode().decode("utf-8")  # never cut inside a character


def test_mime_and_refused_types() -> None:
    assert clean_mime("Image/PNG; charset=x") == "image/png"
    assert clean_mime("../../x y") == "application/octet-stream"
    assert clean_mime(None) == "application/octet-stream"
    refused = Settings(_env_file=None).upload_refused_types  # type: ignore[call-arg]
    assert type_refused("setup.EXE", "application/octet-stream", refused) == ".exe"
    assert type_refused("x", "application/x-msdownload", refused) == "application/x-msdownload"
    assert type_refused("shot.png", "image/png", refused) is None
    assert type_refused("v.mp4", "video/mp4", ("video/*",)) == "video/*"


def test_settings_split_refused_types_and_check_the_uploads_folder() -> None:
    settings = Settings(_env_file=None, upload_refused_types=".exe, video/*")  # type: ignore[call-arg]
    assert settings.upload_refused_types == (".exe", "video/*")
    for bad in ("../up", "/abs", "a/../b", "."):
        with pytest.raises(ValueError, match="inside the run's folder"):
            Settings(_env_file=None, uploads_dir=bad)  # type: ignore[call-arg]
    assert Settings(_env_file=None, uploads_dir="in/box/").uploads_dir == "in/box"  # type: ignore[call-arg]


def test_human_size() -> None:
    assert human_size(0) == "0 bytes"
    assert human_size(9_999) == "9,999 bytes"
    assert human_size(20 * 1024 * 1024) == "20.0 MB"
    assert human_size(64 * 1024) == "64.0 KB"


def test_save_upload_never_overwrites_and_never_follows_symlinks(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    first = save_upload(root, "uploads", "a.txt", b"1", mime="text/plain")
    second = save_upload(root, "uploads", "a.txt", b"2", mime="text/plain")
    third = save_upload(root, "uploads", "a", b"3", mime="text/plain")
    fourth = save_upload(root, "uploads", "a", b"4", mime="text/plain")
    assert [f.relative for f in (first, second, third, fourth)] == [
        "uploads/a.txt",
        "uploads/a-1.txt",
        "uploads/a",
        "uploads/a-1",
    ]
    assert (root / "uploads" / "a.txt").read_bytes() == b"1"
    # A nested uploads folder whose middle part is a symlink out of the folder.
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "in").symlink_to(outside)
    with pytest.raises(FileRefusedError) as caught:
        save_upload(root, "in/box", "b", b"x", mime="text/plain")
    assert caught.value.reason == "symlink"
    assert os.listdir(outside) == []
    # uploads/ as a plain file: refused the same way.
    (root / "flat").write_text("")
    with pytest.raises(FileRefusedError):
        save_upload(root, "flat", "b", b"x", mime="text/plain")


def test_resolve_inside(tmp_path: Path) -> None:
    root = tmp_path / "run"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "f").write_text("f")
    (tmp_path / "secret").write_text("s")
    (root / "out").symlink_to(tmp_path / "secret")
    (root / "in").symlink_to(root / "sub" / "f")
    (root / "loop").symlink_to(root / "loop")
    assert resolve_inside(root, "sub/f") == (root / "sub" / "f").resolve()
    assert resolve_inside(root, "in") == (root / "sub" / "f").resolve()
    assert resolve_inside(root, ".") == root.resolve()
    for given, reason in [
        ("", "empty"),
        ("/etc/passwd", "absolute"),
        ("~/x", "absolute"),
        ("sub/../../secret", "parent"),
        ("out", "symlink"),
        ("missing", "missing"),
        ("loop", "missing"),
        (".git/config", "git"),
    ]:
        with pytest.raises(FileRefusedError) as caught:
            resolve_inside(root, given)
        assert caught.value.reason == reason, given


def test_read_for_send_refuses_specials_empty_and_large(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    os.mkfifo(root / "fifo")
    (root / "empty").write_bytes(b"")
    (root / "big").write_bytes(b"x" * 2000)
    (root / "key.env").write_text("api_key=abcdefghijkl\n")
    for name, reason in [("fifo", "special"), ("empty", "empty"), ("big", "size")]:
        with pytest.raises(FileRefusedError) as caught:
            read_for_send(root, name, max_bytes=1000)
        assert caught.value.reason == reason
    out = read_for_send(root, "key.env", max_bytes=1000, redact=Redactor())
    assert out.redacted
    assert b"abcdefghijkl" not in out.data


def test_zip_folder_leaves_out_symlinks_and_git_and_is_capped(tmp_path: Path) -> None:
    root = tmp_path / "run"
    (root / "docs" / ".git").mkdir(parents=True)
    (root / "docs" / ".git" / "config").write_text("[remote]")
    (root / "docs" / "a.md").write_text("a")
    (root / "docs" / "deep").mkdir()
    (root / "docs" / "deep" / "b.md").write_text("b")
    (tmp_path / "secret").write_text("s")
    (root / "docs" / "leak").symlink_to(tmp_path / "secret")
    dest = tmp_path / "docs.zip"
    zipped = zip_folder(root, "docs", dest=dest, max_bytes=10_000)
    assert zipped.files == 2
    assert zipped.size == dest.stat().st_size
    with zipfile.ZipFile(dest) as zf:
        assert sorted(zf.namelist()) == ["a.md", "deep/b.md"]
    (root / "docs" / "noise.bin").write_bytes(os.urandom(20_000))
    with pytest.raises(FileRefusedError) as caught:
        zip_folder(root, "docs", dest=tmp_path / "big.zip", max_bytes=10_000)
    assert caught.value.reason == "size"
    assert not (tmp_path / "big.zip").exists()
    (root / "docs" / "noise.bin").unlink()
    assert zip_folder(root, "docs", dest=tmp_path / "two.zip", max_bytes=10_000, max_files=2)
    with pytest.raises(FileRefusedError, match="too many files"):
        zip_folder(root, "docs", dest=tmp_path / "many.zip", max_bytes=10_000, max_files=1)
    assert not (tmp_path / "many.zip").exists()
    (root / "void").mkdir()
    with pytest.raises(FileRefusedError):
        zip_folder(root, "void", dest=tmp_path / "void.zip", max_bytes=10_000)
    assert not (tmp_path / "void.zip").exists()


def test_send_markers() -> None:
    text = "\n".join(
        [
            "Done.",
            "TURNSTILE-SEND: out/report.html",
            "  `TURNSTILE-SEND: my notes.txt`  ",
            "- TURNSTILE-SEND: out/report.html",
            "This mentions TURNSTILE-SEND: inline.txt in a sentence.",
            "TURNSTILE-SEND:",
        ]
    )
    assert send_markers(text) == ["out/report.html", "my notes.txt"]
    many = "\n".join(f"TURNSTILE-SEND: f{i}" for i in range(30))
    assert len(send_markers(many, limit=10)) == 10


async def test_exclude_in_git_only_in_a_work_tree_top(tmp_path: Path) -> None:
    repo = git_workspace(tmp_path / "repo")
    assert await exclude_in_git(repo, "uploads")
    assert not await exclude_in_git(repo, "uploads")
    text = (repo / ".git" / "info" / "exclude").read_text()
    assert text.count("/uploads/") == 1
    nested = repo / "nested"
    nested.mkdir()
    assert not await exclude_in_git(nested, "uploads")
    plain = tmp_path / "plain"
    plain.mkdir()
    assert not await exclude_in_git(plain, "uploads")


def test_endpoint_url() -> None:
    assert endpoint_url("https://api.openai.com/v1") == (
        "https://api.openai.com/v1/audio/transcriptions"
    )
    assert endpoint_url("http://h:8000/") == "http://h:8000/v1/audio/transcriptions"
    assert endpoint_url("http://h/v1/audio/transcriptions") == "http://h/v1/audio/transcriptions"


async def test_transcriber_errors_are_typed_and_never_show_the_key() -> None:
    key = "sk-secret-transcription-key-123"
    async with FakeTranscriptionApi(transcript="  hi there \n") as stt:
        client = HttpTranscriber(url=stt.url, model="m", key=SecretStr(key))
        assert await client.transcribe(b"RIFF", filename="a.wav", mime="audio/wav") == "hi there"
        stt.status = 429
        with pytest.raises(TranscriptionError) as caught:
            await client.transcribe(b"RIFF", filename="a.wav", mime="audio/wav")
        assert caught.value.status == 429
        assert caught.value.retryable
        assert key not in str(caught.value)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = HttpTranscriber(url=f"http://127.0.0.1:{port}/v1", model="m", key=SecretStr(key))
    with pytest.raises(TranscriptionError) as caught:
        await client.transcribe(b"RIFF", filename="a.wav", mime="audio/wav")
    assert "cannot be reached" in str(caught.value)
    assert key not in str(caught.value)


def test_a_folder_swapped_for_a_link_after_the_check_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import engine.files

    root = tmp_path / "run"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "f").write_text("inside")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_text("secret")
    checked = engine.files.resolve_inside

    def check_then_swap(base: Path, given: str) -> Path:
        real = checked(base, given)
        # The agent wins the race: sub/ becomes a link out between check and open.
        (root / "sub").rename(root / "sub-old")
        (root / "sub").symlink_to(outside, target_is_directory=True)
        return real

    monkeypatch.setattr(engine.files, "resolve_inside", check_then_swap)
    with pytest.raises(FileRefusedError) as caught:
        read_for_send(root, "sub/f", max_bytes=1000)
    assert caught.value.reason == "symlink"
