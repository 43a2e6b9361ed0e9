"""What a file holds, checked for secrets before it leaves for a chat.

Text in any common encoding is redacted and written back in that same encoding: UTF-8
(a stray bad byte kept as it was), UTF-16 and UTF-32 (with or without a byte order
mark), and any other 8-bit text such as Latin-1, read as UTF-8 whose other bytes pass
through untouched (secrets are ASCII; the bytes around them are not changed). A file
that is not text is never changed: its printable runs (ASCII and UTF-16, as ``strings``
finds them) are checked, and :class:`Unsendable` is raised if one holds a secret.
Archives (zip and the formats built on it, tar, gzip, bzip2, xz) are opened, within
bounds, and each file in them checked the same way; an archive is never changed, so a
secret in one, or one that cannot be opened, is :class:`Unsendable` too.

Not looked into: compressed data inside other formats (a PDF's pages, a PNG's
compressed text chunks), and text in encodings that are not ASCII-compatible other than
UTF-16 and UTF-32 (EBCDIC, UTF-7).
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import io
import lzma
import re
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final

from engine.redact import REDACTED

__all__ = ["Scanned", "Unsendable", "scan"]


@dataclass(frozen=True, slots=True)
class Scanned:
    """What may be sent: the bytes, how many secrets were hidden in them, and the text
    encoding they were read and written in (empty for a file that is not text)."""

    data: bytes
    hidden: int = 0
    encoding: str = ""


_UNPACK_BYTES: Final = 64 * 1024 * 1024
_UNPACK_FILES: Final = 10_000
_UNPACK_DEPTH: Final = 3
_BOMS: Final = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),  # before UTF-16's: it starts with the same bytes
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)
# Control characters text does not hold (tab, line ends, form feed, backspace and escape
# it may); a file with more than one in fifty of them is not text.
_CONTROL_BYTES: Final = bytes(
    b for b in [*range(0x20), 0x7F] if b not in (0x08, 0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x1B)
)
_CONTROL_CHARS: Final = re.compile("[" + re.escape(_CONTROL_BYTES.decode("ascii")) + "]")
_SAMPLE: Final = 8192
# Formats that look like text at their start but are not to be edited.
_NOT_TEXT: Final = (b"%PDF-", b"\x89PNG", b"GIF8", b"\xff\xd8\xff", b"SQLite format 3")
_PRINTABLE: Final = rb"[\t\n\r\x20-\x7e]"
_RUNS: Final = re.compile(
    rb"(?P<ascii>" + _PRINTABLE + rb"{4,})"
    rb"|(?P<le16>(?:" + _PRINTABLE + rb"\x00){4,})"
    rb"|(?P<be16>(?:\x00" + _PRINTABLE + rb"){4,})"
)
_RUN_CODECS: Final = {"ascii": "ascii", "le16": "utf-16-le", "be16": "utf-16-be"}
_ARCHIVES: Final = (
    (b"PK\x03\x04", "zip"),
    (b"PK\x05\x06", "zip"),
    (b"\x1f\x8b", "gzip"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"7z\xbc\xaf\x27\x1c", "7z"),
    (b"Rar!\x1a\x07", "rar"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
)


class Unsendable(Exception):
    """A file (or one inside an archive, ``where``) that must not leave: it holds a
    secret that cannot be hidden in it (``secret``), or could not be checked (``unchecked``,
    ``why`` says what stopped the check)."""

    def __init__(self, reason: str, *, where: str = "", why: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.where = where
        self.why = why


class _Budget:
    """What unpacking archives may still take, for one file sent."""

    def __init__(self) -> None:
        self.bytes = _UNPACK_BYTES
        self.files = _UNPACK_FILES

    def take(self, size: int) -> None:
        self.files -= 1
        self.bytes -= size
        if self.files < 0:
            raise Unsendable("unchecked", why=f"it holds more than {_UNPACK_FILES:,} files")
        if self.bytes < 0:
            raise Unsendable(
                "unchecked", why=f"it unpacks to more than {_UNPACK_BYTES // (1024 * 1024)} MB"
            )


def scan(data: bytes, redact: Callable[[str], str]) -> Scanned:
    """``data`` as it may leave: text redacted in its own encoding, anything else as it is.

    Raises:
        Unsendable: a secret that cannot be hidden, or a file that cannot be checked.
    """
    return _scan(data, redact, depth=0, budget=_Budget())


def _scan(data: bytes, redact: Callable[[str], str], *, depth: int, budget: _Budget) -> Scanned:
    kind = _archive_kind(data)
    if kind is None:
        form = _text_form(data)
        cleaned = _clean_text(data, form, redact) if form is not None else None
        if cleaned is not None:
            return cleaned
        if zipfile.is_zipfile(io.BytesIO(data)):
            kind = "zip"  # one behind something else (a self-extracting program, an image)
    if kind is not None:
        _check_archive(kind, data, redact, depth, budget)
    elif _holds_secret(_printable_runs(data), redact):
        raise Unsendable("secret")
    return Scanned(data)


def _text_form(data: bytes) -> tuple[bytes, str, str] | None:
    """(byte order mark, codec, error handler) when ``data`` reads as text, else None."""
    for bom, codec in _BOMS:
        if data.startswith(bom):
            return bom, codec, "surrogateescape" if codec == "utf-8" else "surrogatepass"
    if data.startswith(_NOT_TEXT):
        return None
    sample = data[:_SAMPLE]
    if b"\x00" in data:
        wide = _wide_codec(data, sample)
        return (b"", wide, "surrogatepass") if wide else None
    controls = len(sample) - len(sample.translate(None, _CONTROL_BYTES))
    return (b"", "utf-8", "surrogateescape") if controls * 50 <= len(sample) else None


def _wide_codec(data: bytes, sample: bytes) -> str | None:
    """UTF-16 or UTF-32 without a byte order mark, told by where its zero bytes fall
    (mostly-ASCII text: every second, or three of every four bytes)."""
    if len(data) % 4 == 0:
        lanes = [sample[i::4].count(0) for i in range(4)]
        quarter = len(sample) // 4 or 1
        if min(lanes[1:]) * 20 >= quarter * 19 and lanes[0] * 20 < quarter:
            return "utf-32-le"
        if min(lanes[:3]) * 20 >= quarter * 19 and lanes[3] * 20 < quarter:
            return "utf-32-be"
    if len(data) % 2:
        return None
    half = len(sample) // 2 or 1
    even, odd = sample[0::2].count(0), sample[1::2].count(0)
    if odd * 5 >= half and even * 20 <= odd:
        return "utf-16-le"
    if even * 5 >= half and odd * 20 <= even:
        return "utf-16-be"
    return None


def _clean_text(
    data: bytes, form: tuple[bytes, str, str], redact: Callable[[str], str]
) -> Scanned | None:
    """The text redacted and encoded as it came, or None when it does not decode as text
    after all (then it is checked as a file that is not text)."""
    bom, codec, errors = form
    try:
        text = data[len(bom) :].decode(codec, errors)
    except UnicodeDecodeError:
        return None
    head = text[:_SAMPLE]
    if len(_CONTROL_CHARS.findall(head)) * 50 > len(head):
        return None  # zero bytes in the right places, but not text
    clean = redact(text)
    if clean == text:
        return Scanned(data, 0, codec)
    hidden = max(1, clean.count(REDACTED) - text.count(REDACTED))
    return Scanned(bom + clean.encode(codec, errors), hidden, codec)


def _printable_runs(data: bytes) -> str:
    """The printable runs of ``data`` (ASCII and UTF-16), one a line."""
    return "\n".join(
        m.group().decode(_RUN_CODECS[m.lastgroup or "ascii"]) for m in _RUNS.finditer(data)
    )


def _holds_secret(text: str, redact: Callable[[str], str]) -> bool:
    return bool(text) and redact(text) != text


def _archive_kind(data: bytes) -> str | None:
    for magic, kind in _ARCHIVES:
        if data.startswith(magic):
            return kind
    if data[257:262] == b"ustar":
        return "tar"
    if data.startswith(b"BZh") and data[4:10] == b"1AY&SY":
        return "bzip2"
    return None


def _check_archive(
    kind: str, data: bytes, redact: Callable[[str], str], depth: int, budget: _Budget
) -> None:
    """Check every file in an archive; raise for the first that must not leave."""
    if kind in ("7z", "rar", "zstd"):
        raise Unsendable("unchecked", why=f"it is a {kind} archive, which cannot be opened here")
    if depth >= _UNPACK_DEPTH:
        raise Unsendable("unchecked", why=f"it holds archives more than {_UNPACK_DEPTH} deep")
    for where, content in _unpacked(kind, data, budget):
        try:
            hidden = _scan(content, redact, depth=depth + 1, budget=budget).hidden
        except Unsendable as exc:
            place = _inside(where, exc.where)
            if exc.reason == "secret":
                place = place or "its content"
            raise Unsendable(exc.reason, where=place, why=exc.why) from None
        if hidden:
            # An archive is sent as it is: a secret in it cannot be hidden.
            raise Unsendable("secret", where=where or "its content")


def _inside(outer: str, inner: str) -> str:
    return f"{outer}/{inner}" if outer and inner else outer or inner


def _unpacked(kind: str, data: bytes, budget: _Budget) -> Iterator[tuple[str, bytes]]:
    """(name, content) of each file in the archive, within ``budget``."""
    try:
        if kind == "zip":
            yield from _zip_members(data, budget)
        elif kind == "tar":
            yield from _tar_members(data, budget)
        else:
            with _decompressor(kind, io.BytesIO(data)) as fh:
                content = fh.read(budget.bytes + 1)
            budget.take(len(content))
            yield "", content
    except (
        OSError,
        EOFError,
        ValueError,
        RuntimeError,
        NotImplementedError,
        zipfile.BadZipFile,
        tarfile.TarError,
        zlib.error,
        lzma.LZMAError,
    ) as exc:
        raise Unsendable("unchecked", why=f"the {kind} archive cannot be read: {exc}") from exc


def _decompressor(kind: str, raw: io.BytesIO) -> io.BufferedIOBase:
    if kind == "gzip":
        return gzip.GzipFile(fileobj=raw)
    if kind == "bzip2":
        return bz2.BZ2File(raw)
    return lzma.LZMAFile(raw)


def _zip_members(data: bytes, budget: _Budget) -> Iterator[tuple[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        for info in zf.infolist():
            if info.is_dir():
                continue
            if info.flag_bits & 0x1:
                raise Unsendable("unchecked", where=info.filename, why="it is encrypted")
            with zf.open(info) as fh:
                content = fh.read(budget.bytes + 1)
            budget.take(len(content))
            yield info.filename, content


def _tar_members(data: bytes, budget: _Budget) -> Iterator[tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
        for member in tf:
            if not member.isfile():
                continue
            fh = tf.extractfile(member)
            content = fh.read(budget.bytes + 1) if fh is not None else b""
            budget.take(len(content))
            yield member.name, content
