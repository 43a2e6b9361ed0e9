"""Files sent to an auto run (from a chat): stored in the database, written by the run.

Wherever the run executes (in the front end's process or on a worker), a file sent to it
takes one path: its bytes are stored (``gate_artifacts``, :func:`store_instruction_file`)
and named by the ``instruction`` event that carries its caption; the run's next Execute
turn writes it into the run's folder under ``uploads/`` with the safe-file rules of
:func:`engine.files.save_upload` (kept out of git) and drops the instruction, which names
it as the prompt of a chat's file does (:func:`write_instruction_files`). Written again
after a crash, a file that is already there with the same bytes is taken as it is: no
second copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from engine.errors import FileRefusedError, TurnstileError
from engine.files import SavedFile, exclude_in_git, sanitize_name, save_upload, upload_prompt
from engine.gates.artifacts import SqlArtifactStore
from engine.store.runs import InstructionFile, QueuedInstruction

if TYPE_CHECKING:
    from engine.store.backend import AnyDatabase

__all__ = ["FileBytes", "store_instruction_file", "write_instruction_files"]

_LOGGER = logging.getLogger(__name__)


class FileBytes(Protocol):
    """Where a run reads the stored bytes of the files sent to it (its store)."""

    async def instruction_file(self, file: InstructionFile) -> bytes | None: ...


async def store_instruction_file(
    db: AnyDatabase,
    name: str,
    data: bytes,
    *,
    mime: str,
    clock: Callable[[], float] = time.time,
) -> InstructionFile:
    """Store a file sent to an auto run (its size bounded by the caller), for the run's
    next Execute turn to write wherever it executes."""
    digest = await SqlArtifactStore(db, clock=clock).put(data)
    return InstructionFile(sanitize_name(name), mime, len(data), digest)


async def write_instruction_files(
    store: FileBytes, queued: QueuedInstruction, workdir: Path, uploads: str
) -> tuple[str, list[str]]:
    """Write the files of ``queued`` below ``workdir/uploads``: the instruction that names
    them (as a chat's prompt does), and why each file not written was not (the instruction
    then says so too). Never raises for one file."""
    saved: list[SavedFile] = []
    problems: list[str] = []
    for file in queued.files:
        try:
            content = await store.instruction_file(file)
            if content is None:
                raise FileRefusedError("it is no longer stored; send it again", reason="missing")
            saved.append(
                await asyncio.to_thread(
                    save_upload,
                    workdir,
                    uploads,
                    sanitize_name(file.name),
                    content,
                    mime=file.mime,
                    again=True,
                )
            )
            _LOGGER.info("upload written as %s (%d bytes)", saved[-1].relative, file.size)
        except FileRefusedError as exc:
            problems.append(f"{file.name} could not be saved: {exc}")
        except OSError as exc:
            problems.append(f"{file.name} could not be written: {exc.strerror}")
    if saved:
        with contextlib.suppress(OSError, TurnstileError):
            await exclude_in_git(workdir, uploads)
    text = upload_prompt(saved, [queued.text]) if saved else queued.text
    if problems:
        text = "\n".join([text, *(f"[Sent from the chat but not saved: {p}]" for p in problems)])
    return text, problems
