"""Reading files an agent may have planted: artifacts, decomposition blocks, appended
instructions, ``.state`` mirrors.

An agent controls what sits in its folder, so every such read here is defensive:

- the path is resolved first and must stay inside ``root`` (a symbolic link may point
  elsewhere in the folder, never out of it);
- every component is then opened from ``root`` down with ``O_NOFOLLOW`` (a link swapped in
  after the check is refused, not followed), the last one with ``O_NONBLOCK`` as well, so
  opening a named pipe returns at once instead of waiting for a writer;
- what was opened must be a regular file, checked with ``fstat`` on the descriptor (not on
  the path, which may have changed meanwhile): pipes, devices, sockets and directories are
  refused, so nothing here can wait on a pipe or read ``/dev/zero`` forever;
- every read is capped.

``root`` itself is the caller's folder and is trusted as given. Missing files raise
:class:`FileNotFoundError` (or :class:`NotADirectoryError`), as ``open`` does; refusals
raise :class:`~engine.errors.UnsafeFileError`.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
from enum import StrEnum
from pathlib import Path

from engine.errors import UnsafeFileError

__all__ = [
    "CHUNK",
    "MAX_HASH_BYTES",
    "Unsafe",
    "open_regular",
    "read_bytes",
    "read_head",
    "sha256",
]

_LOGGER = logging.getLogger(__name__)

CHUNK = 1024 * 1024
#: Hashing stops here: an artifact is a document for a person (a file an agent keeps
#: growing must not keep a thread busy for ever).
MAX_HASH_BYTES = 2 * 1024**3

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class Unsafe(StrEnum):
    """Why a file was refused."""

    OUTSIDE = "outside_folder"
    """It resolves outside its folder (a symbolic link leading out)."""
    NOT_REGULAR = "not_regular_file"
    """A named pipe, device, socket or directory."""
    LINK = "unresolvable_link"
    """A symbolic link that loops, or that appeared while the file was being opened."""
    TOO_LARGE = "too_large"


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a plain file"


def _refuse(name: str, reason: Unsafe, message: str) -> UnsafeFileError:
    return UnsafeFileError(f"{name} {message}", path=name, reason=reason.value)


def open_regular(root: Path, relative: str | Path) -> tuple[int, os.stat_result]:
    """A descriptor of the regular file ``root/relative`` and its ``fstat``; the caller
    closes the descriptor.

    Raises:
        UnsafeFileError: it leads outside ``root``, a link changed under us, or it is not
            a regular file.
        FileNotFoundError: it does not exist.
        ValueError: ``relative`` is absolute or climbs out with ``..``.
    """
    name = os.fspath(relative)
    parts = Path(name).parts
    if not parts or Path(name).is_absolute() or ".." in parts:
        raise ValueError(f"{name!r} is not a path inside a folder")
    base = os.path.realpath(root)
    target = os.path.realpath(os.path.join(base, name))
    if target == base or os.path.commonpath([base, target]) != base:
        _LOGGER.warning("refused %s in %s: it resolves to %s", name, root, target)
        raise _refuse(name, Unsafe.OUTSIDE, "is a symbolic link to something outside its folder")
    inner = os.path.relpath(target, base).split(os.sep)
    dir_fd = os.open(base, _DIR_FLAGS)
    try:
        for part in inner[:-1]:
            next_fd = os.open(part, _DIR_FLAGS, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = next_fd
        fd = os.open(inner[-1], _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(
                name, Unsafe.LINK, "is a symbolic link that loops or changed while being read"
            ) from None
        raise
    finally:
        os.close(dir_fd)
    try:
        info = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        kind = _kind(info.st_mode)
        raise _refuse(name, Unsafe.NOT_REGULAR, f"is not a regular file (it is {kind})")
    return fd, info


def read_bytes(root: Path, relative: str | Path, *, limit: int) -> bytes:
    """The whole content of ``root/relative``.

    Raises:
        UnsafeFileError: refused, or longer than ``limit`` bytes (``too_large``).
        FileNotFoundError: it does not exist.
    """
    data = read_head(root, relative, limit + 1)
    if len(data) > limit:
        raise _refuse(os.fspath(relative), Unsafe.TOO_LARGE, f"is larger than {limit} bytes")
    return data


def read_head(root: Path, relative: str | Path, limit: int) -> bytes:
    """At most the first ``limit`` bytes of ``root/relative``.

    Raises:
        UnsafeFileError: refused.
        FileNotFoundError: it does not exist.
    """
    fd, _ = open_regular(root, relative)
    with os.fdopen(fd, "rb", buffering=0) as fh:
        chunks: list[bytes] = []
        left = limit
        while left > 0:
            chunk = fh.read(min(left, CHUNK))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    return b"".join(chunks)


def sha256(root: Path, relative: str | Path, *, limit: int = MAX_HASH_BYTES) -> str:
    """The hex SHA-256 of ``root/relative``, streamed in 1 MiB chunks (constant memory).

    Raises:
        UnsafeFileError: refused, or longer than ``limit`` bytes (``too_large``).
        FileNotFoundError: it does not exist.
    """
    fd, _ = open_regular(root, relative)
    digest = hashlib.sha256()
    total = 0
    with os.fdopen(fd, "rb", buffering=0) as fh:
        buffer = bytearray(CHUNK)
        view = memoryview(buffer)
        while True:
            n = fh.readinto(buffer)
            if not n:
                break
            total += n
            if total > limit:
                raise _refuse(
                    os.fspath(relative), Unsafe.TOO_LARGE, f"is larger than {limit} bytes"
                )
            digest.update(view[:n])
    return digest.hexdigest()
