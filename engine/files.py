"""Files in and out of a run's folder: uploads from a chat, files handed back to it.

Everything here treats names and paths from a chat or an agent as hostile:

- :func:`sanitize_name` turns a sender's file name into one plain name (no folders, no
  leading dots, Unicode NFC, no control characters, bounded length).
- :func:`save_upload` writes bytes below ``root/uploads`` without ever following a
  symlink (each folder opened with ``O_NOFOLLOW`` relative to its parent, the file created
  with ``O_CREAT | O_EXCL``) and without overwriting (a ``-1``, ``-2`` … suffix); asked
  to, it takes a taken name that already holds the same bytes (a write done again).
- :func:`resolve_inside` resolves a path given by a person or an agent inside the run's
  folder: absolute paths, ``..`` and symlinks that leave the folder are refused.
- :func:`read_for_send` / :func:`zip_folder` produce what is sent to the chat, capped,
  and checked for secrets whatever the file's encoding (see :func:`read_for_send`).
- :func:`send_markers` finds ``TURNSTILE-SEND: path`` lines in an agent's output.

Long: one module holds every rule for a hostile name or path, in and out, so that the
bot, the workers and auto mode apply the same ones.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import unicodedata
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Final

from engine import safefile
from engine.errors import FileRefusedError, UnsafeFileError
from engine.git import GitRunner
from engine.secretscan import Unsendable, scan

__all__ = [
    "SEND_MARKER",
    "UNKNOWN_MIME",
    "LeftOut",
    "OutgoingFile",
    "SavedFile",
    "ZippedFolder",
    "clean_mime",
    "exclude_in_git",
    "human_size",
    "read_for_send",
    "resolve_inside",
    "sanitize_name",
    "save_upload",
    "send_markers",
    "sent_caption",
    "type_refused",
    "upload_prompt",
    "zip_folder",
]

SEND_MARKER: Final = "TURNSTILE-SEND:"
_MARKER_LINE = re.compile(
    r"^[ \t>*-]*`?TURNSTILE-SEND:[ \t]*(?P<path>[^`\r\n]+?)[ \t]*`?[ \t]*$", re.MULTILINE
)
# Names are cut to this many bytes (most file systems allow 255).
_NAME_BYTES: Final = 120
_MAX_SUFFIX: Final = 1000
_UNSAFE = re.compile(r'[\x00-\x1f\x7f/\\:*?"<>|]')
_MIME = re.compile(r"^[a-z0-9][a-z0-9!#$&^_.+-]{0,63}/[a-z0-9][a-z0-9!#$&^_.+-]{0,126}$")
UNKNOWN_MIME: Final = "application/octet-stream"


def human_size(size: int) -> str:
    """``1,234 bytes``, ``12.3 KB``, ``4.5 MB`` (1 MB = 1024 KB, as Telegram counts)."""
    if size < 10_000:
        return f"{size:,} bytes"
    if size < 10 * 1024 * 1024:
        return f"{size / 1024:.1f} KB"
    return f"{size / (1024 * 1024):.1f} MB"


def clean_mime(value: str | None) -> str:
    """A MIME type from a chat, lower-cased; anything malformed or missing is unknown."""
    mime = (value or "").strip().lower().split(";", 1)[0].strip()
    return mime if _MIME.fullmatch(mime) else UNKNOWN_MIME


def type_refused(name: str, mime: str, refused: tuple[str, ...]) -> str | None:
    """The entry of ``refused`` that matches the file (a MIME type, ``type/*`` or an
    extension such as ``.exe``), or None when the file is accepted."""
    lowered = name.lower()
    for entry in refused:
        rule = entry.strip().lower()
        if not rule:
            continue
        if rule.startswith("."):
            if lowered.endswith(rule):
                return entry
        elif rule.endswith("/*"):
            if mime.startswith(rule[:-1]):
                return entry
        elif mime == rule:
            return entry
    return None


def sanitize_name(name: str | None, *, fallback: str = "file") -> str:
    """One safe file name from what a sender called the file.

    Folders are dropped (``../x`` and ``a\\b`` keep only the last part), Unicode is
    normalized to NFC, invisible format characters (bidi overrides, zero widths) go,
    control and reserved characters (and lone surrogates) become ``_``, leading dots and
    spaces go (no hidden files, no ``..``), and the name is cut to 120 bytes keeping its
    extension. An empty result becomes ``fallback``.
    """
    # Invisible format characters go (a right-to-left override shows "evil\u202etxt.sh"
    # as "evilhs.txt"); a lone surrogate, which no file system or chat can carry, and the
    # other control characters become "_". Then NFC: what was kept apart may now combine.
    kept = (c for c in name or "" if unicodedata.category(c) != "Cf")
    text = "".join("_" if unicodedata.category(c) in ("Cs", "Cc") else c for c in kept)
    text = unicodedata.normalize("NFC", text)
    text = re.split(r"[/\\]", text)[-1]
    text = _UNSAFE.sub("_", text)
    # Until nothing changes: a dot can hide a space behind it (". \xa0x").
    while (trimmed := text.strip().lstrip(". ").rstrip(". ")) != text:
        text = trimmed
    if not text or set(text) <= {"_"}:
        text = fallback
    return _cut(text, _NAME_BYTES)


def _cut(name: str, limit: int) -> str:
    if len(name.encode()) <= limit:
        return name
    stem, dot, ext = name.rpartition(".")
    if not dot or len(ext.encode()) > 16:
        stem, ext = name, ""
    room = limit - (len(ext.encode()) + 1 if ext else 0)
    cut = stem.encode()[:room].decode("utf-8", errors="ignore").rstrip(". ")
    return f"{cut}.{ext}" if ext else cut


def _candidates(name: str) -> Iterator[str]:
    yield name
    stem, dot, ext = name.rpartition(".")
    if not stem:
        stem, dot, ext = name, "", ""
    for n in range(1, _MAX_SUFFIX):
        yield _cut(f"{stem}-{n}", _NAME_BYTES - len(dot + ext)) + dot + ext


@dataclass(frozen=True, slots=True)
class SavedFile:
    """An upload written into a run's folder."""

    path: Path
    relative: str
    size: int
    mime: str


def _open_dir(parent_fd: int, name: str, *, create: bool) -> int:
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(name, flags, dir_fd=parent_fd)
    except FileNotFoundError:
        if not create:
            raise
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=parent_fd)
        return os.open(name, flags, dir_fd=parent_fd)


def _upload_parts(uploads: str) -> list[str]:
    parts = PurePosixPath(uploads).parts
    if not parts or PurePosixPath(uploads).is_absolute() or any(p in ("..", ".") for p in parts):
        raise FileRefusedError(
            f"the uploads folder {uploads!r} must be a relative path inside the run's folder",
            reason="setting",
        )
    return list(parts)


def save_upload(
    root: Path, uploads: str, name: str, data: bytes, *, mime: str, again: bool = False
) -> SavedFile:
    """Write ``data`` as ``root/uploads/name`` (or ``name-1`` … when taken).

    No symlink is ever followed below ``root``: a planted ``uploads`` symlink is refused,
    a planted file symlink is skipped like any taken name. ``again``: a taken name whose
    plain file holds exactly ``data`` is the file (a write done again after a crash
    writes no second copy).

    Raises:
        FileRefusedError: the uploads folder is not a plain folder, or no free name.
        OSError: writing failed (the partial file is removed).
    """
    parts = _upload_parts(uploads)
    fds: list[int] = [os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
    try:
        for part in parts:
            try:
                fds.append(_open_dir(fds[-1], part, create=True))
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise FileRefusedError(
                        f"{'/'.join(parts)} in the run's folder is not a plain folder (a "
                        "symlink or a file); nothing was saved",
                        reason="symlink",
                    ) from exc
                raise
        folder = fds[-1]
        for candidate in _candidates(name):
            try:
                fd = os.open(
                    candidate,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o644,
                    dir_fd=folder,
                )
            except FileExistsError:
                if again and _holds(folder, candidate, data):
                    relative = "/".join([*parts, candidate])
                    return SavedFile(root / relative, relative, len(data), mime)
                continue
            try:
                view = memoryview(data)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(candidate, dir_fd=folder)
                raise
            os.close(fd)
            relative = "/".join([*parts, candidate])
            return SavedFile(root / relative, relative, len(data), mime)
        raise FileRefusedError(f"no free name for {name} in {'/'.join(parts)}", reason="taken")
    finally:
        for fd in reversed(fds):
            os.close(fd)


def _holds(folder: int, name: str, data: bytes) -> bool:
    """Whether ``name`` in ``folder`` is a plain file (not a symlink) holding ``data``."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            return False
        return fh.read(len(data) + 1) == data


def resolve_inside(root: Path, given: str) -> Path:
    """The real path of ``given`` (relative to ``root``), refused unless inside ``root``.

    Raises:
        FileRefusedError: empty, absolute, ``..``, a ``.git`` part, missing, or a symlink
            that leads out of ``root``.
    """
    text = given.strip()
    if not text or "\x00" in text:
        raise FileRefusedError("give a path inside the run's folder", reason="empty")
    path = PurePosixPath(text)
    if path.is_absolute() or text.startswith("~"):
        raise FileRefusedError(
            f"{text} is an absolute path; give a path inside the run's folder", reason="absolute"
        )
    if ".." in path.parts:
        raise FileRefusedError(f"{text} leaves the run's folder (..)", reason="parent")
    if ".git" in path.parts:
        raise FileRefusedError(f"{text} is inside git's own data; not sent", reason="git")
    base = root.resolve(strict=True)
    try:
        real = (base / path).resolve(strict=True)
    except FileNotFoundError:
        raise FileRefusedError(
            f"{text} does not exist in the run's folder", reason="missing"
        ) from None
    except (OSError, RuntimeError) as exc:
        raise FileRefusedError(f"{text} cannot be resolved: {exc}", reason="missing") from exc
    if real != base and not real.is_relative_to(base):
        raise FileRefusedError(
            f"{text} is a symlink that leads out of the run's folder; not sent", reason="symlink"
        )
    return real


def _open_inside(base: Path, real: Path, shown: str) -> tuple[int, os.stat_result]:
    """Open ``real`` (inside ``base``) through :mod:`engine.safefile`: no link followed on
    the way down, a pipe never waited on, only a regular file."""
    try:
        return safefile.open_regular(base, real.relative_to(base))
    except UnsafeFileError as exc:
        if exc.reason == safefile.Unsafe.NOT_REGULAR:
            raise FileRefusedError(
                f"{shown} is not a regular file; not sent", reason="special"
            ) from exc
        raise FileRefusedError(
            f"{shown} leads out of the run's folder; not sent", reason="symlink"
        ) from exc
    except OSError as exc:
        raise FileRefusedError(f"{shown} cannot be opened: {exc.strerror}", reason="open") from exc


@dataclass(frozen=True, slots=True)
class OutgoingFile:
    """A file to send: its name in the chat and its (possibly redacted) content.

    ``hidden`` counts the secrets replaced in it; ``encoding`` is the text encoding it was
    read (and written back) in, empty for a file that is not text.
    """

    name: str
    data: bytes
    hidden: int = 0
    encoding: str = ""

    @property
    def redacted(self) -> bool:
        """Whether anything in the file was hidden."""
        return self.hidden > 0


@dataclass(frozen=True, slots=True)
class LeftOut:
    """A file left out of a folder's zip: ``secret`` (it holds one that cannot be hidden
    in it) or ``unchecked`` (it could not be checked for secrets)."""

    name: str
    reason: str


@dataclass(frozen=True, slots=True)
class ZippedFolder:
    """What :func:`zip_folder` wrote: how many files, the zip's size, how many secrets
    were hidden in its files, and the files left out for what they may hold."""

    files: int
    size: int
    hidden: int = 0
    left_out: tuple[LeftOut, ...] = ()


def _member_name(name: str) -> str:
    """A name from inside an archive, safe to show (no control characters, bounded)."""
    shown = "".join(c if c.isprintable() else "_" for c in name)
    return shown if len(shown) <= 80 else shown[:79] + "…"


def _refusal(shown: str, exc: Unsendable) -> FileRefusedError:
    """What the chat is told about a file that is not sent."""
    if exc.reason == "unchecked":
        where = f" ({_member_name(exc.where)} in it)" if exc.where else ""
        return FileRefusedError(
            f"{shown} could not be checked for secrets{where}: {exc.why}",
            reason="unchecked",
        )
    if exc.where:
        return FileRefusedError(
            f"{shown} is an archive with what looks like a secret (a key, token or password) "
            f"in {_member_name(exc.where)}; an archive is sent as it is, so the secret "
            "cannot be hidden in it. Send the files unpacked instead: secrets in text files "
            "are hidden.",
            reason="secret",
        )
    return FileRefusedError(
        f"{shown} looks like it holds a secret (a key, token or password), and it is not "
        "a text file in which it could be hidden",
        reason="secret",
    )


def read_for_send(
    root: Path, given: str, *, max_bytes: int, redact: Callable[[str], str] | None = None
) -> OutgoingFile:
    """The content of one regular file inside ``root``, at most ``max_bytes``.

    With ``redact``, secrets never leave: text in any common encoding (UTF-8, also with
    stray bad bytes; UTF-16 and UTF-32 with or without a byte order mark; Latin-1 and
    other 8-bit text) is redacted and kept in its encoding; any other file is checked
    (its printable runs, each file in an archive) and refused if it holds a secret.

    Raises:
        FileRefusedError: outside the folder, not a regular file, empty or too large; a
            secret that cannot be hidden (reason ``secret``) or a file that could not be
            checked for them (``unchecked``).
    """
    real = resolve_inside(root, given)
    base = root.resolve()
    shown = given.strip()
    if real.is_dir():
        raise FileRefusedError(f"{shown} is a folder", reason="folder")
    fd, info = _open_inside(base, real, shown)
    try:
        if info.st_size > max_bytes:
            raise FileRefusedError(
                f"{shown} is {human_size(info.st_size)}; Telegram takes files up to "
                f"{human_size(max_bytes)} from a bot",
                reason="size",
            )
        if info.st_size == 0:
            raise FileRefusedError(f"{shown} is empty; nothing to send", reason="empty")
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise FileRefusedError(f"{shown} grew past {human_size(max_bytes)}", reason="size")
    if redact is None:
        return OutgoingFile(real.name, data)
    try:
        sent = scan(data, redact)
    except Unsendable as exc:
        raise _refusal(shown, exc) from None
    return OutgoingFile(real.name, sent.data, sent.hidden, sent.encoding)


def zip_folder(
    root: Path,
    given: str,
    *,
    dest: Path,
    max_bytes: int,
    max_files: int = 10_000,
    redact: Callable[[str], str] | None = None,
) -> ZippedFolder:
    """Zip the folder ``given`` (inside ``root``) into ``dest``.

    Symlinks and ``.git`` are left out (nothing outside the folder is ever read). With
    ``redact`` each file is checked as :func:`read_for_send` checks one: secrets in text
    are hidden, and a file holding one that cannot be hidden, or that cannot be checked,
    is left out (and named in the result). The zip is cut off, removed and refused once
    it would pass ``max_bytes`` or hold ``max_files``.

    Raises:
        FileRefusedError: outside the folder, not a folder, empty, nothing in it could be
            sent, or the zip is too large.
    """
    real = resolve_inside(root, given)
    base = root.resolve()
    shown = given.strip() or "."
    if not real.is_dir():
        raise FileRefusedError(f"{shown} is not a folder", reason="not-folder")
    count = hidden = 0
    left_out: list[LeftOut] = []
    try:
        with open(dest, "xb") as raw, zipfile.ZipFile(raw, "w", zipfile.ZIP_DEFLATED) as zf:
            for folder, dirs, files in os.walk(real, followlinks=False):
                dirs[:] = sorted(d for d in dirs if d != ".git")
                for name in sorted(files):
                    if count >= max_files:
                        raise FileRefusedError(
                            f"{shown} has too many files (the limit is {max_files:,}); ask "
                            "for a smaller folder",
                            reason="size",
                        )
                    path = Path(folder) / name
                    arcname = path.relative_to(real).as_posix()
                    if path.is_symlink():
                        continue  # links are left out, wherever they lead
                    try:
                        fd, _ = safefile.open_regular(base, path.relative_to(base))
                    except (UnsafeFileError, OSError):
                        continue  # a pipe, a device, a link swapped in, or gone: left out
                    try:
                        with os.fdopen(os.dup(fd), "rb") as fh:
                            data = fh.read(max_bytes + 1)
                    finally:
                        os.close(fd)
                    if len(data) > max_bytes:
                        raise _too_big(shown, max_bytes)
                    try:
                        sent = scan(data, redact) if redact else None
                    except Unsendable as exc:
                        left_out.append(LeftOut(arcname, exc.reason))
                        continue
                    if sent is not None:
                        data, hidden = sent.data, hidden + sent.hidden
                    zf.writestr(arcname, data)
                    count += 1
                    if raw.tell() > max_bytes:
                        raise _too_big(shown, max_bytes)
        size = dest.stat().st_size
        if count == 0 and left_out:
            raise FileRefusedError(
                f"nothing in {shown} could be sent; {_left_out(left_out)}", reason="secret"
            )
        if count == 0:
            raise FileRefusedError(f"{shown} holds no files to send", reason="empty")
        if size > max_bytes:
            raise FileRefusedError(
                f"{shown} zipped is {human_size(size)}, over {human_size(max_bytes)}",
                reason="size",
            )
    except BaseException:
        with contextlib.suppress(OSError):
            dest.unlink()
        raise
    return ZippedFolder(count, size, hidden, tuple(left_out))


def _too_big(shown: str, max_bytes: int) -> FileRefusedError:
    return FileRefusedError(
        f"{shown} zipped is over {human_size(max_bytes)}; ask for a smaller folder or single files",
        reason="size",
    )


def send_markers(text: str, *, limit: int = 10) -> list[str]:
    """Paths of the ``TURNSTILE-SEND: path`` lines in an agent's output (at most ``limit``,
    each once, in order)."""
    seen: list[str] = []
    for match in _MARKER_LINE.finditer(text):
        path = match.group("path").strip().strip("\"'")
        if path and path not in seen:
            seen.append(path)
        if len(seen) >= limit:
            break
    return seen


async def exclude_in_git(workdir: Path, folder: str, git: GitRunner | None = None) -> bool:
    """Add ``/folder/`` to the repository's ``info/exclude`` unless it is there, so uploads
    are not committed by accident; returns whether the file changed.

    Only a folder that is the top of a git work tree (a run's worktree) is touched; a plain
    folder, or one nested in some other repository, is left alone.

    Raises:
        GitError: git could not be started.
    """
    git = git or GitRunner()
    result = await git.run(
        ["rev-parse", "--show-toplevel", "--git-path", "info/exclude"], cwd=workdir, check=False
    )
    lines = result.lines
    if result.exit_code != 0 or len(lines) != 2:
        return False
    return _append_exclude(workdir, Path(lines[0]), Path(lines[1]), folder)


def _append_exclude(workdir: Path, top: Path, exclude_path: Path, folder: str) -> bool:
    if top.resolve() != workdir.resolve():
        return False
    exclude = exclude_path if exclude_path.is_absolute() else workdir / exclude_path
    pattern = "/" + PurePosixPath(folder).as_posix().strip("/") + "/"
    try:
        current = exclude.read_text(encoding="utf-8")
    except FileNotFoundError:
        current = ""
    if pattern in {line.strip() for line in current.splitlines()}:
        return False
    exclude.parent.mkdir(parents=True, exist_ok=True)
    with open(exclude, "a", encoding="utf-8") as fh:
        if current and not current.endswith("\n"):
            fh.write("\n")
        fh.write(f"# files sent from the chat (turnstile)\n{pattern}\n")
    return True


def upload_prompt(files: list[SavedFile], captions: list[str]) -> str:
    """The prompt for files that arrived: the caption(s), then which files and where."""
    lines = [f"- {f.relative} ({f.mime}, {human_size(f.size)})" for f in files]
    what = "a file" if len(files) == 1 else f"{len(files)} files"
    text = "\n".join(c for c in captions if c.strip())
    note = (
        f"[Sent from the chat with this message: {what}, saved in your working folder]"
        if text
        else f"[Sent from the chat without a message: {what}, saved in your working folder]"
    )
    hint = (
        f"(To hand a file back to the chat, put a line `{SEND_MARKER} path/to/file` in your "
        "answer.)"
    )
    return "\n".join(filter(None, [text, "" if text else None, note, *lines, hint]))


def sent_caption(shown: str, sent: OutgoingFile | ZippedFolder) -> str:
    """The caption of a file (or a folder's zip) sent to the chat as ``shown``: its size,
    how many secrets were hidden in it, and the files left out of a zip, at most
    Telegram's 1,024 characters."""
    if isinstance(sent, ZippedFolder):
        caption = f"📦 {shown} · {sent.files} file(s) zipped · {human_size(sent.size)}"
    else:
        caption = f"📎 {shown} · {human_size(len(sent.data))}"
    if sent.hidden:
        caption += f" · sent with {_count(sent.hidden, 'secret')} hidden"
    if isinstance(sent, ZippedFolder) and sent.left_out:
        caption += f" · {_left_out(sent.left_out)}"
    return caption if len(caption) <= 1024 else caption[:1023] + "…"


def _count(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def _left_out(files: Sequence[LeftOut], shown: int = 5) -> str:
    """Which files were left out of a zip and why, the first few of each by name."""
    why = {
        "secret": (
            "it holds what looks like a secret that cannot be hidden in it",
            "they hold what look like secrets that cannot be hidden in them",
        ),
        "unchecked": (
            "it could not be checked for secrets",
            "they could not be checked for secrets",
        ),
    }
    parts = []
    for reason, (one, many) in why.items():
        names = [_member_name(f.name) for f in files if f.reason == reason]
        if names:
            more = len(names) - shown
            listed = ", ".join(names[:shown]) + (f" and {more:,} more" if more > 0 else "")
            parts.append(f"left out, as {one if len(names) == 1 else many}: {listed}")
    return " · ".join(parts)
