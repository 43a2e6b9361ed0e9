"""Files, photos and voice notes from the phone; files back with ``/get`` and agent markers.

- A document or photo in a chat bound to a session is downloaded into the run's folder
  under ``uploads/`` and becomes a turn: the caption is the prompt and the prompt says which
  file arrived. Sent to a running auto run (in its topic or as a reply to one of its
  messages), wherever it executes, it is stored in the database with a steering note that
  its next Execute turn takes in, writing the file there first
  (:mod:`engine.automode.uploads`). An album (photos sharing ``media_group_id``) is one turn.
- A voice note or audio message is transcribed (:mod:`engine.transcribe`), shown
  ("🎙 …") and becomes the prompt (or the steering note).
- ``/get PATH [RUN]`` sends a file (a folder as a zip) of the run's folder; a line
  ``TURNSTILE-SEND: path`` in an agent's output sends that file after the turn.
- ``/diff [RUN]`` says what the run changed against its start and sends the patch.
- Both read the run named (its id, or the end of it), else the one replied to, else this
  place's last run of any mode, finished ones too.

Outgoing files are checked, copied into a spool folder and queued in the outbox like
every other message (kind ``file``, :mod:`chatfront.outgoing`), so a restart still
delivers them.

Long: files in and out, and /diff, are one feature with one set of limits and one lookup
of the run they concern (chat session, auto run, or this chat's last or named run);
inbound parsing and outbound packing helpers already live in engine/files.py, the diff in
engine/diff.py, what is sent in chatfront/outgoing.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from telegram import Message, Update
from telegram.error import BadRequest, TelegramError

from bot.auto import AutoExtension
from bot.context import BotContext
from bot.feature import Feature
from bot.handlers import Dispatch
from bot.places import chat_of, thread_of
from chatfront.auth import Action
from chatfront.outgoing import OutgoingFiles
from chatfront.store import Binding, InboundState
from engine.automode.uploads import store_instruction_file
from engine.chats.files import ChatUpload, upload_message
from engine.diff import run_diff
from engine.errors import FileRefusedError, TranscriptionError, TurnstileError
from engine.files import (
    SEND_MARKER,
    SavedFile,
    clean_mime,
    exclude_in_git,
    human_size,
    sanitize_name,
    save_upload,
    type_refused,
    upload_prompt,
)
from engine.gates.artifacts import SqlArtifactStore
from engine.runs import RunMode, named_runs
from engine.runs.spec import ChatPlace, PlaceId
from engine.store.runs import InstructionFile, RunRecord
from engine.transcribe import HttpTranscriber, Transcriber
from engine.workspace.runs import match_worktrees

__all__ = ["FileDesk", "upload_prompt"]

_LOGGER = logging.getLogger(__name__)

# Telegram's own limit on what a bot may download through getFile.
_TELEGRAM_DOWNLOAD_LIMIT: Final = 20 * 1024 * 1024
# How long a shutdown waits for the files being downloaded to join their albums.
_PARTS_WAIT: Final = 30.0


@dataclass
class _Target:
    """Where a file or voice note goes: a chat session or a running auto run (its id:
    wherever it executes, its files go through the database, engine.automode.uploads)."""

    workdir: Path
    chat: Binding | None = None
    auto: str | None = None
    # A chat session on the workers: its folder is on a worker's disk, files go through
    # the database (engine.chats.files).
    remote: bool = False

    @property
    def action(self) -> Action:
        return Action.PROMPT if self.chat is not None else Action.STEER


@dataclass(frozen=True, slots=True)
class _RunFolder:
    """The run ``/get`` and ``/diff`` read: its folder, and the commit it started from."""

    run_id: str | None
    workdir: Path
    base: str | None = None
    # Its folder is on a worker's disk.
    remote: bool = False


@dataclass
class _Album:
    target: _Target
    chat_id: PlaceId
    thread: PlaceId | None
    update_id: int
    user_id: int
    reply_to: int
    files: list[SavedFile | ChatUpload | InstructionFile] = field(default_factory=list)
    captions: list[str] = field(default_factory=list)
    update_ids: list[int] = field(default_factory=list)
    timer: asyncio.Task[None] | None = None


@dataclass(frozen=True, slots=True)
class _Incoming:
    file_id: str
    name: str
    mime: str
    size: int | None


class FileDesk(Feature):
    """Files in and out of runs' folders, and voice notes, for the bot's handlers."""

    def __init__(
        self,
        ctx: BotContext,
        auto: AutoExtension,
        *,
        transcriber: Transcriber | None = None,
    ) -> None:
        self.ctx = ctx
        self.auto = auto
        settings = ctx.settings
        if transcriber is None and settings.transcription_url:
            transcriber = HttpTranscriber(
                url=settings.transcription_url,
                model=settings.transcription_model,
                key=settings.transcription_key,
                timeout=settings.transcription_timeout,
                language=settings.transcription_language,
            )
        self.transcriber = transcriber
        self.outgoing = OutgoingFiles(
            ctx.publisher,
            spool=settings.runs_dir / "outgoing",
            max_bytes=settings.send_max_bytes,
            artifacts=SqlArtifactStore(ctx.db),
            sent_files=lambda out: ctx.chats.agents.sent_files(out),
        )
        self._albums: dict[tuple[PlaceId, PlaceId | None, str], _Album] = {}
        self._excluded: set[Path] = set()
        self._closing = False
        self._handling = 0
        self._idle = asyncio.Event()
        self._idle.set()
        ctx.chat_front.output_files = self.outgoing.marker_items
        ctx.sink.send_files_with(self.outgoing.send_stored)

    def register(self, dispatch: Dispatch) -> None:
        dispatch.command("get", Action.STATUS, self.cmd_get)
        dispatch.command("diff", Action.STATUS, self.cmd_diff)
        dispatch.media(self.on_media)

    # -- where things go ---------------------------------------------------------------

    async def _target(self, message: Message, thread: PlaceId | None) -> _Target | None:
        chat_id = chat_of(message.chat)
        place = ChatPlace(chat_id, thread)
        steerable = self.auto.executor.steerable
        reply = message.reply_to_message
        if reply is not None:
            run_id = await self.ctx.store.run_of_message(chat_id, reply.message_id)
            if run_id is not None and run_id in await steerable(place, whole_chat=True):
                return _Target(Path(), auto=run_id)
        here = await steerable(place)
        if here:
            return _Target(Path(), auto=here[-1])
        active_chat = self.ctx.chats.active.get((chat_id, thread))
        binding = (
            active_chat.binding
            if active_chat is not None
            else await self.ctx.store.binding(chat_id, thread)
        )
        if binding is None:
            return None
        if not binding.workdir:
            # A chat on the workers has no folder on this machine.
            if not self.ctx.chats.agents.remote:
                return None
            return _Target(Path(), chat=binding, remote=True)
        return _Target(Path(binding.workdir), chat=binding)

    async def _not_bound(self, update: Update, message: Message, bot_id: int) -> None:
        user = update.effective_user
        to_us = message.chat.type == "private" or (
            message.reply_to_message is not None
            and message.reply_to_message.from_user is not None
            and message.reply_to_message.from_user.id == bot_id
        )
        if (
            to_us
            and user is not None
            and self.ctx.replies.allowed(user.id, chat_of(message.chat), Action.PROMPT)
        ):
            await self.ctx.replies.reply(
                update, "This chat is not bound to an agent session yet: send /chat first."
            )

    # -- inbound: files, photos, voice -------------------------------------------------

    async def on_media(self, update: Update) -> None:
        # Counted while it runs: a shutdown hands gathering albums over only once every
        # part being downloaded has joined its album (else an album would split in two).
        self._handling += 1
        self._idle.clear()
        try:
            await self._on_media(update)
        finally:
            self._handling -= 1
            if not self._handling:
                self._idle.set()

    async def _on_media(self, update: Update) -> None:
        message = update.message
        user = update.effective_user
        if message is None or user is None:
            return
        thread = thread_of(message)
        target = await self._target(message, thread)
        if target is None:
            await self._not_bound(update, message, self.ctx.bot.id)
            return
        if not await self.ctx.replies.authorize(update, target.action):
            return
        if message.voice is not None or message.audio is not None:
            await self._voice(update, message, target, thread)
            return
        incoming = self._describe(message)
        if incoming is None:
            return
        try:
            saved = await self._download_and_save(incoming, target)
        except FileRefusedError as exc:
            await self.ctx.replies.reply(update, f"⚠️ Not saved: {exc}")
            return
        caption = message.caption or ""
        group = message.media_group_id
        if group is not None:
            self._add_to_album(update, message, target, thread, saved, caption, str(group))
            return
        await self._deliver(update, target, thread, [saved], [caption], update.update_id)

    def _describe(self, message: Message) -> _Incoming | None:
        if message.document is not None:
            doc = message.document
            mime = clean_mime(doc.mime_type)
            return _Incoming(
                doc.file_id,
                sanitize_name(doc.file_name, fallback=f"file-{doc.file_unique_id}"),
                mime,
                doc.file_size,
            )
        if message.video is not None:
            video = message.video
            return _Incoming(
                video.file_id,
                sanitize_name(video.file_name, fallback=f"video-{video.file_unique_id}.mp4"),
                clean_mime(video.mime_type or "video/mp4"),
                video.file_size,
            )
        if message.video_note is not None:
            note = message.video_note
            return _Incoming(
                note.file_id,
                sanitize_name(f"video-{note.file_unique_id}.mp4"),
                "video/mp4",
                note.file_size,
            )
        if message.photo:
            # Telegram sends several sizes of a photo; the last is the largest.
            photo = max(message.photo, key=lambda p: p.width * p.height)
            return _Incoming(
                photo.file_id,
                sanitize_name(f"photo-{photo.file_unique_id}.jpg"),
                "image/jpeg",
                photo.file_size,
            )
        return None

    async def _download(self, file_id: str, declared: int | None, what: str) -> bytes:
        """The bytes of a chat file, refused when over the limit or empty.

        Raises:
            FileRefusedError: too large (declared or actual), empty, or Telegram refused.
        """
        limit = self.ctx.settings.upload_max_bytes
        if declared is not None and declared > limit:
            raise FileRefusedError(
                f"{what} is {human_size(declared)}; the limit is {human_size(limit)}"
                + (
                    " (Telegram lets bots download up to 20 MB)"
                    if limit >= _TELEGRAM_DOWNLOAD_LIMIT
                    else ""
                ),
                reason="size",
            )
        if declared == 0:
            raise FileRefusedError(f"{what} is empty; nothing to save", reason="empty")
        try:
            tg_file = await self.ctx.bot.get_file(file_id)
            if tg_file.file_size is not None and tg_file.file_size > limit:
                raise FileRefusedError(
                    f"{what} is {human_size(tg_file.file_size)}; the limit is {human_size(limit)}",
                    reason="size",
                )
            data = bytes(await tg_file.download_as_bytearray())
        except BadRequest as exc:
            if "too big" in exc.message.lower():
                raise FileRefusedError(
                    f"{what} is too big for Telegram to hand to a bot (over 20 MB)",
                    reason="size",
                ) from exc
            raise FileRefusedError(
                f"Telegram refused to hand over {what}: {exc.message}", reason="telegram"
            ) from exc
        except TelegramError as exc:
            raise FileRefusedError(
                f"downloading {what} failed ({exc.message}); send it again", reason="network"
            ) from exc
        if len(data) > limit:
            raise FileRefusedError(
                f"{what} is {human_size(len(data))}; the limit is {human_size(limit)}",
                reason="size",
            )
        if not data:
            raise FileRefusedError(f"{what} is empty; nothing to save", reason="empty")
        return data

    async def _download_and_save(
        self, incoming: _Incoming, target: _Target
    ) -> SavedFile | ChatUpload | InstructionFile:
        settings = self.ctx.settings
        refused = type_refused(incoming.name, incoming.mime, settings.upload_refused_types)
        if refused is not None:
            raise FileRefusedError(
                f"{incoming.name} ({incoming.mime}) is a type this bot does not take "
                f"({refused}, see TURNSTILE_UPLOAD_REFUSED_TYPES)",
                reason="type",
            )
        data = await self._download(incoming.file_id, incoming.size, incoming.name)
        if target.auto is not None:
            # Stored for the run's next Execute turn, which writes it into the run's folder
            # wherever the run executes (here or on a worker).
            stored = await store_instruction_file(
                self.ctx.db, incoming.name, data, mime=incoming.mime
            )
            _LOGGER.info("upload stored for run %s (%d bytes)", target.auto, stored.size)
            return stored
        if target.remote:
            # Stored for the worker that runs the turn; it writes the file where it goes.
            assert target.chat is not None
            upload = await self.ctx.chats.agents.store_upload(
                target.chat, incoming.name, data, mime=incoming.mime
            )
            _LOGGER.info("upload stored for the workers (%d bytes)", upload.size)
            return upload
        try:
            saved = await asyncio.to_thread(
                save_upload,
                target.workdir,
                settings.uploads_dir,
                incoming.name,
                data,
                mime=incoming.mime,
            )
        except OSError as exc:
            raise FileRefusedError(
                f"{incoming.name} could not be written: {exc.strerror}", reason="write"
            ) from exc
        _LOGGER.info("upload saved as %s (%d bytes)", saved.relative, saved.size)
        await self._exclude(target.workdir)
        return saved

    async def _exclude(self, workdir: Path) -> None:
        if workdir in self._excluded:
            return
        try:
            await exclude_in_git(workdir, self.ctx.settings.uploads_dir)
        except (TurnstileError, OSError) as exc:
            _LOGGER.warning("could not add the uploads folder to info/exclude: %s", exc)
            return
        self._excluded.add(workdir)

    def _add_to_album(
        self,
        update: Update,
        message: Message,
        target: _Target,
        thread: PlaceId | None,
        saved: SavedFile | ChatUpload | InstructionFile,
        caption: str,
        group: str,
    ) -> None:
        key = (chat_of(message.chat), thread, group)
        album = self._albums.get(key)
        if album is None:
            assert update.effective_user is not None
            album = _Album(
                target,
                chat_of(message.chat),
                thread,
                update.update_id,
                update.effective_user.id,
                message.message_id,
            )
            self._albums[key] = album
        album.files.append(saved)
        album.captions.append(caption)
        album.update_ids.append(update.update_id)
        # Not handled until the album's turn is queued: a crash before that replays the
        # parts on the next start (the files come again, the turn is not lost).
        self.ctx.handled_in_transaction(update.update_id)
        if album.timer is not None:
            album.timer.cancel()
        album.timer = asyncio.create_task(self._album_later(key), name=f"album-{group}")

    async def _album_later(self, key: tuple[PlaceId, PlaceId | None, str]) -> None:
        # Telegram delivers an album as separate messages in quick succession; the turn
        # starts once none has come for a moment.
        # Once the bot is shutting down, no more parts will come.
        await asyncio.sleep(0 if self._closing else self.ctx.settings.album_wait_seconds)
        await self._flush(key)

    async def _flush(self, key: tuple[PlaceId, PlaceId | None, str]) -> None:
        album = self._albums.pop(key, None)
        if album is None:
            return
        album.timer = None
        try:
            await self._deliver(
                None,
                album.target,
                album.thread,
                album.files,
                album.captions,
                album.update_id,
                user_id=album.user_id,
                chat_id=album.chat_id,
                reply_to=album.reply_to,
            )
        except Exception:
            _LOGGER.exception("an album could not be handed to its run")
            return
        for update_id in album.update_ids:
            await self.ctx.store.mark_inbound(update_id, InboundState.HANDLED)

    async def _deliver(
        self,
        update: Update | None,
        target: _Target,
        thread: PlaceId | None,
        files: list[SavedFile | ChatUpload | InstructionFile],
        captions: list[str],
        update_id: int,
        *,
        user_id: int | None = None,
        chat_id: PlaceId | None = None,
        reply_to: int | None = None,
    ) -> None:
        stored = [f for f in files if isinstance(f, ChatUpload)]
        for_run = [f for f in files if isinstance(f, InstructionFile)]
        if for_run:
            # The run names them once written (engine.automode.uploads): the captions here.
            text = "\n".join(c for c in captions if c.strip())
        elif stored:
            # The worker names the files in the prompt once written (engine.workers).
            text = upload_message(stored, captions)
        else:
            text = upload_prompt([f for f in files if isinstance(f, SavedFile)], captions)
        await self._hand_over(
            update,
            target,
            thread,
            text,
            update_id,
            user_id=user_id,
            chat_id=chat_id,
            reply_to=reply_to,
            what="a file" if len(files) == 1 else f"{len(files)} files",
            files=for_run,
        )

    async def _hand_over(
        self,
        update: Update | None,
        target: _Target,
        thread: PlaceId | None,
        text: str,
        update_id: int,
        *,
        what: str,
        user_id: int | None = None,
        chat_id: PlaceId | None = None,
        reply_to: int | None = None,
        files: Sequence[InstructionFile] = (),
    ) -> None:
        """Queue ``text`` as the chat session's next turn, or note it (with the ``files``
        it is the caption of) for the auto run."""
        if update is not None:
            assert update.effective_chat is not None
            assert update.effective_user is not None
            assert update.effective_message is not None
            chat_id = chat_of(update.effective_chat)
            user_id = update.effective_user.id
            reply_to = update.effective_message.message_id
        assert chat_id is not None

        async def say(line: str) -> None:
            await self.ctx.publisher.say(chat_id, line, thread_id=thread, reply_to=reply_to)

        if target.auto is not None:
            refused = await self.auto.steer(target.auto, text, by=user_id, files=files)
            if refused is not None:
                await say(refused)
                return
            await say(
                f"📝 Noted for run {target.auto} ({what}): it goes into the next Execute turn."
            )
            return
        result = await self.ctx.chats.submit(
            chat_id, thread, update_id=update_id, user_id=user_id, text=text
        )
        if update is not None:
            self.ctx.handled_in_transaction(update_id)
        if not result.queued:
            await say(
                f"⚠️ Not queued: {result.waiting} message(s) are already waiting for this "
                f"session (limit {self.ctx.settings.queue_depth})."
                + (
                    " Send it again once the queue has room."
                    if what == "voice note"
                    else " The file(s) are saved; send a message about them once the queue "
                    "has room."
                )
            )
        elif result.busy or result.waiting:
            await say(f"⏳ Queued: {result.waiting + 1} message(s) wait for the running turn.")

    async def _voice(
        self, update: Update, message: Message, target: _Target, thread: PlaceId | None
    ) -> None:
        if self.transcriber is None:
            await self.ctx.replies.reply(
                update,
                "🎙 Voice notes are not transcribed here: set TURNSTILE_TRANSCRIPTION_URL "
                "(a speech-to-text service) to enable them.",
            )
            return
        if message.voice is not None:
            file_id, size = message.voice.file_id, message.voice.file_size
            mime = clean_mime(message.voice.mime_type or "audio/ogg")
            name = "voice.ogg"
        else:
            assert message.audio is not None
            file_id, size = message.audio.file_id, message.audio.file_size
            mime = clean_mime(message.audio.mime_type)
            name = sanitize_name(message.audio.file_name, fallback="audio")
        try:
            audio = await self._download(file_id, size, "the voice note")
            transcript = await self.transcriber.transcribe(audio, filename=name, mime=mime)
        except FileRefusedError as exc:
            await self.ctx.replies.reply(update, f"⚠️ Not transcribed: {exc}")
            return
        except TranscriptionError as exc:
            await self.ctx.replies.reply(
                update, f"⚠️ The voice note could not be transcribed: {exc}"
            )
            return
        if not transcript.strip():
            await self.ctx.replies.reply(
                update, "🎙 Nothing recognisable was said; no turn started."
            )
            return
        limit = self.ctx.settings.max_inbound_chars
        if len(transcript) > limit:
            await self.ctx.replies.reply(
                update,
                f"🎙 The transcript is {len(transcript):,} characters; the limit is {limit:,}. "
                "Send a shorter voice note.",
            )
            return
        await self.ctx.replies.reply(update, f"🎙 {transcript}")
        caption = (message.caption or "").strip()
        text = f"{caption}\n\n{transcript}" if caption else transcript
        await self._hand_over(update, target, thread, text, update.update_id, what="voice note")

    # -- outbound: /get and markers ----------------------------------------------------

    async def cmd_get(self, update: Update, args: list[str]) -> None:
        message = update.effective_message
        assert message is not None
        parts = (message.text or "").split(maxsplit=1)
        given = parts[1].strip() if len(parts) > 1 else ""
        if not given:
            await self.ctx.replies.reply(
                update,
                "Usage: /get PATH [RUN] (a file or folder of this chat's last run, or of RUN)",
            )
            return
        thread = thread_of(message)
        # "/get FILE RUN": the last word names a run of this chat (its id or the end of it).
        path, _, last = given.rpartition(" ")
        named = (
            last if path.strip() and await self._chat_runs(chat_of(message.chat), last) else None
        )
        found = await self._run_folder(message, thread, named)
        if isinstance(found, str):
            await self.ctx.replies.reply(update, found)
            return
        if found.remote:
            await self.ctx.replies.reply(
                update,
                "This chat's files are on the worker that runs its turns, not here: ask the "
                f"agent to send them (a line {SEND_MARKER} path in its answer).",
            )
            return
        wanted = path.strip() if named is not None else given
        try:
            item = await self.outgoing.item(
                found.workdir,
                wanted,
                chat_id=chat_of(message.chat),
                thread=thread,
                reply_to=message.message_id,
            )
        except FileRefusedError as exc:
            await self.ctx.replies.reply(update, f"⚠️ Not sent: {exc}")
            return
        await self.ctx.replies.audited(update, "get", given[:200])
        await self.ctx.store.enqueue([item])
        self.ctx.publisher.wake()

    async def cmd_diff(self, update: Update, args: list[str]) -> None:
        """``/diff [RUN]``: what the run changed against its start, the summary and files
        in the message, the patch as a document."""
        message = update.effective_message
        assert message is not None
        thread = thread_of(message)
        found = await self._run_folder(message, thread, args[0] if args else None, what="diff")
        if isinstance(found, str):
            await self.ctx.replies.reply(update, found)
            return
        name = f"Run {found.run_id}" if found.run_id else "This chat's session"
        if found.remote:
            await self.ctx.replies.reply(
                update,
                f"{name} works on a worker: its folder is not here. Its branch is pushed "
                "after each turn (/status names it).",
            )
            return
        limit = self.ctx.settings.send_max_bytes
        changes = await run_diff(found.workdir, found.base, max_bytes=limit)
        if changes.problem is not None:
            await self.ctx.replies.reply(update, f"{name}: no changes to show. {changes.problem}")
            return
        against = (
            f"against its start ({changes.base[:12]})"
            if found.base is not None and changes.base is not None
            else "against its last commit (where it started is not recorded)"
        )
        if not changes.changed:
            await self.ctx.replies.reply(update, f"{name} changed nothing {against}.")
            return
        lines = changes.stat_lines()
        await self.ctx.replies.reply(
            update, f"🔀 {name}, {against}: {lines[0]}\n" + "\n".join(lines[1:])
        )
        await self.ctx.replies.audited(update, "diff", found.run_id or "")
        if not changes.patch:
            return  # only new files not yet added to git, or binary ones: no patch to send
        text = changes.patch.decode("utf-8", errors="replace")
        cut = f", cut at {human_size(limit)} of {human_size(changes.patch_size)}"
        await self.ctx.publisher.document(
            chat_of(message.chat),
            text,
            filename=f"diff-{found.run_id or 'session'}.patch",
            caption=f"🔀 The patch of {f'run {found.run_id}' if found.run_id else 'this session'}"
            + (cut if changes.truncated else ""),
            thread_id=thread,
            run_id=found.run_id,
        )

    async def _chat_runs(self, chat_id: PlaceId, wanted: str | None = None) -> list[RunRecord]:
        """This chat's runs, newest first (``wanted``: those it names, see ``named_runs``)."""
        runs = [r for r in await self.ctx.runs.list_runs() if r.chat_id == chat_id]
        if wanted is None:
            return runs
        names = set(named_runs((r.id for r in runs), wanted))
        return [r for r in runs if r.id in names]

    async def _run_folder(
        self, message: Message, thread: PlaceId | None, named: str | None, *, what: str = "get"
    ) -> _RunFolder | str:
        """The run ``/get`` and ``/diff`` read: the one named, the one replied to, a running
        auto run here, else this place's last run of any mode (a chat session's while it is
        the newest). A string says why there is none."""
        chat_id = chat_of(message.chat)
        if named is not None:
            runs = await self._chat_runs(chat_id, named)
            if len(runs) != 1:
                listed = ", ".join(r.id for r in (await self._chat_runs(chat_id))[:5])
                said = (
                    "Several runs of this chat end so" if runs else f"No run {named} in this chat"
                )
                return f"{said}. Its last runs: {listed or 'none'}."
            return await self._folder_of(runs[0])
        reply = message.reply_to_message
        if reply is not None:
            run_id = await self.ctx.store.run_of_message(chat_id, reply.message_id)
            replied = await self._chat_runs(chat_id, run_id) if run_id is not None else []
            if len(replied) == 1:
                return await self._folder_of(replied[0])
        here = self.auto.running_in(chat_id, thread)
        if here:
            return await self._folder_of(await self.ctx.runs.get_run(here[-1].run_id))
        runs = [
            r
            for r in await self._chat_runs(chat_id)
            if r.thread_id == thread and r.parent_id is None
        ]
        latest = runs[0] if runs else None
        active_chat = self.ctx.chats.active.get((chat_id, thread))
        binding = (
            active_chat.binding
            if active_chat is not None
            else await self.ctx.store.binding(chat_id, thread)
        )
        if binding is not None and (latest is None or latest.mode == RunMode.CHAT):
            if not binding.workdir:
                return _RunFolder(binding.run_id, Path(), remote=True)
            workdir = Path(binding.workdir)
            return _RunFolder(binding.run_id, workdir, await self._base(binding.run_id, workdir))
        if latest is None:
            usage = "/diff RUN" if what == "diff" else "/get PATH RUN"
            return (
                "No run here yet: start one with /auto OBJECTIVE or /chat, or name an "
                f"earlier one of this chat: {usage}."
            )
        return await self._folder_of(latest)

    async def _folder_of(self, run: RunRecord) -> _RunFolder | str:
        if not run.workdir:
            return _RunFolder(run.id, Path(), remote=True)
        workdir = Path(run.workdir)
        if not await asyncio.to_thread(workdir.is_dir):
            return (
                f"Run {run.id}'s folder is not on this machine any more (it ran on a worker, "
                "or its folder was cleaned up)."
            )
        base = run.state.get("base_commit") if run.mode == RunMode.AUTO else None
        return _RunFolder(run.id, workdir, base or await self._base(run.id, workdir))

    async def _base(self, run_id: str | None, workdir: Path) -> str | None:
        """Where the run's worktree was cut from (None: it works in no worktree of its own)."""
        found = await match_worktrees(self.ctx.db, {run_id or "": workdir})
        workspace = found.get(run_id or "")
        return workspace.base if workspace is not None else None

    # -- shutdown --------------------------------------------------------------------

    async def shutdown(self, *, park: bool, preempt: asyncio.Event) -> None:
        """Albums still gathering are handed to their runs now, with the parts still
        being downloaded (one whose download has not ended within a while becomes a turn
        of its own once it has)."""
        self._closing = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), _PARTS_WAIT)
        for key, album in list(self._albums.items()):
            if album.timer is not None:
                album.timer.cancel()
            await self._flush(key)
