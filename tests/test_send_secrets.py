"""Secrets never leave through a file sent to the chat, whatever the file's encoding.

Real files in a temporary run folder through ``read_for_send`` and ``zip_folder``, and
the real bot against the fake Bot API for ``/get FILE``, ``/get FOLDER`` and a
``TURNSTILE-SEND:`` line: text in any common encoding is redacted and keeps its encoding,
a file that is not text is sent unchanged or refused when it holds a secret, and an
archive is checked file by file.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import io
import lzma
import os
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

from engine import files
from engine.errors import FileRefusedError
from engine.files import read_for_send, sent_caption, zip_folder
from engine.redact import REDACTED, Redactor
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import CHAT, OPERATOR, bot_settings, running_bot, write_script

pytestmark = pytest.mark.usefixtures("isolated_env")

API_KEY = "abcdef0123456789xyz"
PASSWORD = "hunter2hunter2"
TEXT = f"café = 1\nFOO_API_KEY={API_KEY}\nDB_PASS={PASSWORD}\nthe end\n"
CLEAN = f"café = 1\nFOO_API_KEY={REDACTED}\nDB_PASS={REDACTED}\nthe end\n"
STRAY = b"\xff\xfe stray bytes \x80\n"

# (name, the file's bytes, the bytes that must go out, the encoding it is read in)
ENCODINGS = [
    ("utf8.txt", TEXT.encode(), CLEAN.encode(), "utf-8"),
    ("utf8-stray.txt", TEXT.encode() + STRAY, CLEAN.encode() + STRAY, "utf-8"),
    ("utf8-bom.txt", codecs.BOM_UTF8 + TEXT.encode(), codecs.BOM_UTF8 + CLEAN.encode(), "utf-8"),
    (
        "utf16le-bom.txt",
        codecs.BOM_UTF16_LE + TEXT.encode("utf-16-le"),
        codecs.BOM_UTF16_LE + CLEAN.encode("utf-16-le"),
        "utf-16-le",
    ),
    (
        "utf16be-bom.txt",
        codecs.BOM_UTF16_BE + TEXT.encode("utf-16-be"),
        codecs.BOM_UTF16_BE + CLEAN.encode("utf-16-be"),
        "utf-16-be",
    ),
    ("utf16le.txt", TEXT.encode("utf-16-le"), CLEAN.encode("utf-16-le"), "utf-16-le"),
    ("utf16be.txt", TEXT.encode("utf-16-be"), CLEAN.encode("utf-16-be"), "utf-16-be"),
    (
        "utf32-bom.txt",
        codecs.BOM_UTF32_LE + TEXT.encode("utf-32-le"),
        codecs.BOM_UTF32_LE + CLEAN.encode("utf-32-le"),
        "utf-32-le",
    ),
    ("latin1.txt", TEXT.encode("latin-1"), CLEAN.encode("latin-1"), "utf-8"),
    (
        "cp1252.txt",
        (TEXT + "“quoted”\n").encode("cp1252"),
        (CLEAN + "“quoted”\n").encode("cp1252"),
        "utf-8",
    ),
]


def _leaks(data: bytes) -> list[str]:
    """The secrets found in ``data`` in any encoding a reader could open it in."""
    found = []
    for secret in (API_KEY, PASSWORD):
        for codec in ("utf-8", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"):
            if secret.encode(codec) in data:
                found.append(f"{secret} ({codec})")
    return found


@pytest.fixture
def run(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    root.mkdir()
    return root


@pytest.mark.parametrize(
    ("name", "raw", "expected", "encoding"),
    ENCODINGS,
    ids=[row[0] for row in ENCODINGS],
)
def test_a_text_file_in_any_common_encoding_is_redacted_and_keeps_its_encoding(
    run: Path, name: str, raw: bytes, expected: bytes, encoding: str
) -> None:
    assert _leaks(raw)  # the file really holds them in that encoding
    (run / name).write_bytes(raw)
    out = read_for_send(run, name, max_bytes=100_000, redact=Redactor())
    assert _leaks(out.data) == []
    # Only the secrets changed: every other byte (a BOM, a stray byte, é in Latin-1) stays.
    assert out.data == expected
    assert out.hidden == 2
    assert out.encoding == encoding
    assert sent_caption(name, out).endswith("· sent with 2 secrets hidden")


def test_a_text_file_without_secrets_goes_out_byte_for_byte(run: Path) -> None:
    raw = codecs.BOM_UTF16_LE + "plain notes, no keys\n".encode("utf-16-le")
    (run / "notes.txt").write_bytes(raw)
    out = read_for_send(run, "notes.txt", max_bytes=10_000, redact=Redactor())
    assert (out.data, out.hidden, out.redacted) == (raw, 0, False)
    assert "hidden" not in sent_caption("notes.txt", out)


def test_a_zipped_folder_checks_each_file_in_its_own_encoding(run: Path, tmp_path: Path) -> None:
    (run / "docs").mkdir()
    for name, raw, _, _ in ENCODINGS:
        (run / "docs" / name).write_bytes(raw)
    zipped = zip_folder(
        run, "docs", dest=tmp_path / "docs.zip", max_bytes=1_000_000, redact=Redactor()
    )
    with zipfile.ZipFile(tmp_path / "docs.zip") as zf:
        assert [_leaks(zf.read(name)) for name in zf.namelist()] == [[]] * len(ENCODINGS)
        for name, _, expected, _ in ENCODINGS:
            assert zf.read(name) == expected, name
    assert zipped.files == len(ENCODINGS)
    assert zipped.hidden == 2 * len(ENCODINGS)
    assert zipped.left_out == ()
    assert f"sent with {2 * len(ENCODINGS)} secrets hidden" in sent_caption("docs", zipped)


def _png(extra: bytes = b"") -> bytes:
    return b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + os.urandom(4000) + extra + os.urandom(100)


def _zip(members: dict[str, bytes], *, encrypted: bool = False) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    raw = bytearray(buf.getvalue())
    if encrypted:
        # zipfile writes no encrypted archives: mark the files so, as one with a password
        # is (the flag in each local header and in the central directory).
        for magic, at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
            start = raw.find(magic)
            while start != -1:
                raw[start + at] |= 0x1
                start = raw.find(magic, start + 4)
    return bytes(raw)


def _tar_gz(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


ENV_UTF16 = codecs.BOM_UTF16_LE + TEXT.encode("utf-16-le")

# (name, bytes, the reason it is refused, words the chat is told)
REFUSED = [
    (
        "key-in-binary.bin",
        b"\x00\x01\x02" * 100 + f"GH_TOKEN=ghp_{API_KEY}abcdefghijklmnop".encode() + b"\x00" * 9,
        "secret",
        "looks like it holds a secret",
    ),
    (
        "utf16-key-in-binary.bin",
        b"\x00\x01\x02" * 100 + b"AKIAIOSFODNN7EXAMPLE".decode().encode("utf-16-le") + b"\x03" * 9,
        "secret",
        "not a text file in which it could be hidden",
    ),
    ("image.png", _png(f"password={PASSWORD}".encode()), "secret", "looks like it holds a secret"),
    ("bundle.zip", _zip({"conf/.env": ENV_UTF16}), "secret", "in conf/.env"),
    ("report.docx", _zip({"word/document.xml": TEXT.encode()}), "secret", "word/document.xml"),
    ("backup.tar.gz", _tar_gz({"app/.env": TEXT.encode()}), "secret", "in app/.env"),
    ("log.gz", gzip.compress(TEXT.encode("utf-16")), "secret", "in its content"),
    ("log.bz2", bz2.compress(TEXT.encode()), "secret", "in its content"),
    ("log.xz", lzma.compress(TEXT.encode("latin-1")), "secret", "in its content"),
    (
        "nested.zip",
        _zip({"inner.zip": _zip({"deep/.env": ENV_UTF16})}),
        "secret",
        "inner.zip/deep/.env",
    ),
    ("locked.zip", _zip({"a.txt": b"x"}, encrypted=True), "unchecked", "it is encrypted"),
    ("data.7z", b"7z\xbc\xaf\x27\x1c" + os.urandom(200), "unchecked", "7z archive"),
    ("broken.zip", b"PK\x03\x04" + os.urandom(200), "unchecked", "cannot be read"),
]


@pytest.mark.parametrize(
    ("name", "raw", "reason", "told"), REFUSED, ids=[row[0] for row in REFUSED]
)
def test_what_cannot_be_cleaned_or_checked_is_refused(
    run: Path, name: str, raw: bytes, reason: str, told: str
) -> None:
    (run / name).write_bytes(raw)
    with pytest.raises(FileRefusedError) as caught:
        read_for_send(run, name, max_bytes=1_000_000, redact=Redactor())
    assert caught.value.reason == reason
    assert told in str(caught.value)
    assert str(caught.value).startswith(name)


def test_an_archive_that_unpacks_to_too_much_is_not_checked_and_not_sent(run: Path) -> None:
    (run / "bomb.zip").write_bytes(_zip({"zeros": bytes(65 * 1024 * 1024)}))
    with pytest.raises(FileRefusedError) as caught:
        read_for_send(run, "bomb.zip", max_bytes=1_000_000, redact=Redactor())
    assert caught.value.reason == "unchecked"
    assert "unpacks to more than 64 MB" in str(caught.value)


# Files that are not text and hold no secret: sent exactly as they are.
SENT_AS_THEY_ARE = [
    ("photo.png", _png()),
    ("noise.bin", os.urandom(20_000)),
    ("all-bytes.bin", bytes(range(256)) * 8),
    ("clean.zip", _zip({"README.md": b"# hello\n", "img.png": _png()})),
    ("clean.tar.gz", _tar_gz({"notes.txt": "no keys here\n".encode("utf-16")})),
    ("starts-like-bzip2.txt", b"BZh, said the note; no keys here\n"),
]


@pytest.mark.parametrize(("name", "raw"), SENT_AS_THEY_ARE, ids=[r[0] for r in SENT_AS_THEY_ARE])
def test_a_file_that_is_not_text_and_holds_no_secret_is_sent_unchanged(
    run: Path, name: str, raw: bytes
) -> None:
    (run / name).write_bytes(raw)
    out = read_for_send(run, name, max_bytes=1_000_000, redact=Redactor())
    assert out.data == raw
    assert out.hidden == 0


def test_a_zipped_folder_leaves_out_what_it_cannot_clean_and_says_so(
    run: Path, tmp_path: Path
) -> None:
    (run / "out").mkdir()
    (run / "out" / "notes16.txt").write_bytes(ENV_UTF16)
    (run / "out" / "photo.png").write_bytes(_png())
    for name, raw, _, _ in REFUSED[:2] + REFUSED[-2:-1]:
        (run / "out" / name).write_bytes(raw)
    dest = tmp_path / "out.zip"
    zipped = zip_folder(run, "out", dest=dest, max_bytes=1_000_000, redact=Redactor())
    with zipfile.ZipFile(dest) as zf:
        assert sorted(zf.namelist()) == ["notes16.txt", "photo.png"]
        assert zf.read("notes16.txt") == codecs.BOM_UTF16_LE + CLEAN.encode("utf-16-le")
    assert zipped.files == 2
    assert zipped.hidden == 2
    assert zipped.left_out == (
        files.LeftOut("data.7z", "unchecked"),
        files.LeftOut("key-in-binary.bin", "secret"),
        files.LeftOut("utf16-key-in-binary.bin", "secret"),
    )
    caption = sent_caption("out", zipped)
    assert "2 file(s) zipped" in caption
    assert "sent with 2 secrets hidden" in caption
    assert (
        "left out, as they hold what look like secrets that cannot be hidden in them: "
        "key-in-binary.bin, utf16-key-in-binary.bin" in caption
    )
    assert "left out, as it could not be checked for secrets: data.7z" in caption


def test_a_folder_of_nothing_sendable_is_refused(run: Path, tmp_path: Path) -> None:
    (run / "keys").mkdir()
    (run / "keys" / "id.bin").write_bytes(REFUSED[0][1])
    with pytest.raises(FileRefusedError) as caught:
        zip_folder(run, "keys", dest=tmp_path / "k.zip", max_bytes=100_000, redact=Redactor())
    assert caught.value.reason == "secret"
    assert "nothing in keys could be sent" in str(caught.value)
    assert not (tmp_path / "k.zip").exists()


def test_exact_secrets_an_agent_holds_are_hidden_in_every_encoding(run: Path) -> None:
    """A value with no known shape (an inherited credential) is found in UTF-16 too."""
    opaque = "no-shape-at-all-77"
    (run / "dump.txt").write_bytes(f"value: {opaque}\n".encode("utf-16"))
    (run / "dump.bin").write_bytes(b"\x00\x01" * 50 + opaque.encode("utf-16-le") + b"\x02" * 9)
    out = read_for_send(run, "dump.txt", max_bytes=10_000, redact=Redactor([opaque]))
    assert opaque.encode("utf-16-le") not in out.data
    assert out.hidden == 1
    with pytest.raises(FileRefusedError):
        read_for_send(run, "dump.bin", max_bytes=10_000, redact=Redactor([opaque]))


# -- through the bot ----------------------------------------------------------------------


@pytest.mark.timeout(120)
async def test_get_and_an_agents_marker_send_files_with_their_secrets_hidden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(
        tmp_path,
        {"rules": [{"match": "send", "text": "Here.\nTURNSTILE-SEND: marked16.txt\n"}]},
        monkeypatch,
    )
    overrides: dict[str, Any] = {"send_max_bytes": 1_000_000}
    async with (
        FakeBotApi() as api,
        running_bot(api, bot_settings(api, tmp_path, **overrides)) as rt,
    ):
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
        await api.wait_for_message(lambda m: "bound to a new" in m.text)
        binding = await rt.store.binding(str(CHAT), None)
        assert binding is not None
        workdir = Path(binding.workdir)
        (workdir / "keys16.txt").write_bytes(ENV_UTF16)
        (workdir / "marked16.txt").write_bytes(TEXT.encode("utf-16-be"))
        (workdir / "id.bin").write_bytes(REFUSED[0][1])
        (workdir / "out").mkdir()
        (workdir / "out" / "a16.txt").write_bytes(ENV_UTF16)
        (workdir / "out" / "id.bin").write_bytes(REFUSED[0][1])

        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/get keys16.txt")
        doc = await api.wait_for_message(lambda m: m.filename == "keys16.txt")
        assert doc.document == codecs.BOM_UTF16_LE + CLEAN.encode("utf-16-le")
        assert doc.text == f"📎 keys16.txt · {len(doc.document)} bytes · sent with 2 secrets hidden"

        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/get id.bin")
        refusal = await api.wait_for_message(lambda m: "id.bin looks like" in m.text)
        assert refusal.text == (
            "⚠️ Not sent: id.bin looks like it holds a secret (a key, token or password), "
            "and it is not a text file in which it could be hidden"
        )

        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/get out")
        zipped = await api.wait_for_message(lambda m: m.filename == "out.zip")
        assert zipped.document is not None
        with zipfile.ZipFile(io.BytesIO(zipped.document)) as zf:
            assert zf.namelist() == ["a16.txt"]
            assert zf.read("a16.txt") == codecs.BOM_UTF16_LE + CLEAN.encode("utf-16-le")
        assert "sent with 2 secrets hidden" in zipped.text
        assert "left out, as it holds what looks like a secret" in zipped.text
        assert zipped.text.endswith(": id.bin")

        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="send it")
        marked = await api.wait_for_message(lambda m: m.filename == "marked16.txt")
        assert marked.document == CLEAN.encode("utf-16-be")
        assert "sent with 2 secrets hidden" in marked.text

    for call in api.calls:
        assert _leaks(repr(call.params).encode()) == []
    for msg in api.sent:
        assert _leaks(msg.document or b"") == []
        if (msg.filename or "").endswith(".zip"):
            with zipfile.ZipFile(io.BytesIO(msg.document or b"")) as zf:
                assert [_leaks(zf.read(n)) for n in zf.namelist()] == [[]]
