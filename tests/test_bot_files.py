"""Files, photos, albums and voice notes in; /get and TURNSTILE-SEND files out.

The real bot against the fake Bot API (getFile and file downloads over HTTP), the fake
agent through the command agent, a real SQLite file, a fake speech-to-text server.
"""

from __future__ import annotations

import asyncio
import io
import math
import os
import shutil
import signal
import struct
import subprocess
import time
import wave
import zipfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from bot.app import BotRuntime
from chatfront.store import AuditEntry, BotStore
from tests.automode_support import CLARIFY, EVALUATE, EXECUTE, GIT_ENV, PLAN, git_workspace
from tests.bot_process import bot_env, start_polling
from tests.fakes import bot_harness
from tests.fakes.bot_api import FakeBotApi, SentMessage
from tests.fakes.bot_harness import (
    CHAT,
    OPERATOR,
    STRANGER,
    agent_log,
    bot_settings,
    running_bot,
    write_script,
)
from tests.fakes.transcription_api import FakeTranscriptionApi
from tests.support import wait_until

pytestmark = pytest.mark.usefixtures("isolated_env", "bot_backend")

MB = 1024 * 1024


@asynccontextmanager
async def bound_chat(
    api: FakeBotApi, tmp_path: Path, command: str = "/chat", **overrides: Any
) -> AsyncIterator[tuple[BotRuntime, Path]]:
    """The running bot with the test chat bound to a session; yields (runtime, workdir)."""
    async with running_bot(api, bot_settings(api, tmp_path, **overrides)) as rt:
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text=command)
        await api.wait_for_message(lambda m: "bound to a new" in m.text)
        binding = await rt.store.binding(str(CHAT), None)
        assert binding is not None
        yield rt, Path(binding.workdir)


def prompts(tmp_path: Path) -> list[str]:
    return [str(e["prompt"]) for e in agent_log(tmp_path)]


async def answer(api: FakeBotApi, needle: str) -> SentMessage:
    return await api.wait_for_message(lambda m: needle in m.text)


async def refused(store: BotStore, user_id: int, action: str) -> list[AuditEntry]:
    """The audit log once it holds ``user_id``'s refusal of ``action``: a refusal is
    audited as it is answered, so the answer can be seen before the audit commits."""

    async def entries() -> list[AuditEntry] | None:
        found = await store.audit_entries()
        wanted = (user_id, action, "refused")
        return found if wanted in [(e.user_id, e.action, e.outcome) for e in found] else None

    return await wait_until(entries, what=f"the refusal of {action} audited")


def tree(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


async def test_an_upload_named_to_deceive_or_unwritable_keeps_its_file_and_caption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A right-to-left override made "evil\u202etxt.sh" show as "evilhs.txt"; a lone
    surrogate in a name crashed the handler and lost the file and its caption."""
    write_script(tmp_path, {}, monkeypatch)
    async with FakeBotApi() as api, bound_chat(api, tmp_path) as (_, workdir):
        for name, caption, saved in (
            ("evil\u202etxt.sh", "what is in it?", "eviltxt.sh"),
            ("\udcffnotes.txt", "and this one?", "_notes.txt"),
        ):
            api.push_document(
                chat_id=CHAT,
                user_id=OPERATOR,
                data=b"#!/bin/sh\n",
                file_name=name,
                mime_type="text/plain",
                caption=caption,
            )
            reply = await answer(api, f"echo: {caption}")
            assert (workdir / "uploads" / saved).read_bytes() == b"#!/bin/sh\n"
            assert f"uploads/{saved} (text/plain, 10 bytes)" in reply.text
            assert "\u202e" not in reply.text


async def test_a_document_lands_in_uploads_and_its_caption_is_the_prompt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    async with FakeBotApi() as api, bound_chat(api, tmp_path) as (_, workdir):
        content = b"line one\nline two\n"
        api.push_document(
            chat_id=CHAT,
            user_id=OPERATOR,
            data=content,
            file_name="crash log.txt",
            mime_type="text/plain",
            caption="why does it crash?",
        )
        reply = await answer(api, "echo: why does it crash?")
        assert (workdir / "uploads" / "crash log.txt").read_bytes() == content
        assert "uploads/crash log.txt (text/plain, 18 bytes)" in reply.text
        assert [c.method for c in api.calls if c.method == "getFile"] == ["getFile"]
        assert len(api.downloads) == 1
        # A photo without a caption: the largest size is fetched, the prompt says what came.
        api.push_photo(chat_id=CHAT, user_id=OPERATOR, data=b"\xff\xd8jpeg-bytes")
        reply = await answer(api, "without a message")
        saved = [p for p in (workdir / "uploads").iterdir() if p.name.startswith("photo-")]
        assert [p.read_bytes() for p in saved] == [b"\xff\xd8jpeg-bytes"]
        assert f"uploads/{saved[0].name} (image/jpeg, 12 bytes)" in reply.text
        assert "TURNSTILE-SEND: path/to/file" in reply.text
        # A video is a file like any other.
        file_id, unique = api.add_file(b"mp4-bytes", folder="videos")
        video = {"file_id": file_id, "file_unique_id": unique, "width": 1, "height": 1}
        video |= {"duration": 1, "file_name": "screen.mp4", "mime_type": "video/mp4"}
        msg = api.message_payload(chat_id=CHAT, user_id=OPERATOR, text="")
        del msg["text"]
        api.push_update({"message": msg | {"video": video, "caption": "the recording"}})
        reply = await answer(api, "echo: the recording")
        assert "uploads/screen.mp4 (video/mp4, 9 bytes)" in reply.text
    assert len(prompts(tmp_path)) == 3


async def test_an_album_of_photos_is_one_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    async with (
        FakeBotApi() as api,
        bound_chat(api, tmp_path, album_wait_seconds=0.5) as (_, workdir),
    ):
        for i in range(3):
            api.push_photo(
                chat_id=CHAT,
                user_id=OPERATOR,
                data=f"photo {i}".encode(),
                caption="the three screens of the bug" if i == 0 else None,
                media_group_id="album-1",
            )
        reply = await answer(api, "echo: the three screens of the bug")
        assert "3 files" in reply.text
        assert reply.text.count("uploads/photo-") == 3
        assert len(list((workdir / "uploads").iterdir())) == 3
        # The next message is a turn of its own.
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="and now?")
        await answer(api, "echo: and now?")
    assert len(prompts(tmp_path)) == 2


async def test_an_album_still_gathering_at_shutdown_is_queued_not_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    async with FakeBotApi() as api:
        # The album would wait an hour; shutting down hands it over at once.
        async with bound_chat(api, tmp_path, album_wait_seconds=3600) as (_rt, _):
            api.push_photo(
                chat_id=CHAT, user_id=OPERATOR, data=b"p0", caption="two", media_group_id="a2"
            )
            await api.wait_until(lambda: len(api.downloads) == 1)
            # The second part is still being fetched when the bot is told to stop (Telegram
            # answers its getFile a moment later): it joins the album all the same.
            api.hold(["getFile"])
            api.push_photo(
                chat_id=CHAT, user_id=OPERATOR, data=b"p1", caption="two", media_group_id="a2"
            )
            await api.wait_until(lambda: api.parked == 1)
            asyncio.get_running_loop().call_later(1.0, api.release)
        # Queued in the database, or already taken as a turn: either way it is there.
        async with running_bot(api, bot_settings(api, tmp_path)):
            await answer(api, "2 files")
    assert sum("2 files" in p for p in prompts(tmp_path)) == 1


async def test_bad_files_get_a_clear_answer_and_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    async with FakeBotApi() as api, bound_chat(api, tmp_path) as (_, workdir):
        uploads = workdir / "uploads"
        # 21 MB, declared: refused before anything is downloaded.
        big = b"x" * (21 * MB)
        api.push_document(chat_id=CHAT, user_id=OPERATOR, data=big, file_name="big.bin")
        refusal = await answer(api, "Not saved")
        assert "big.bin is 21.0 MB; the limit is 20.0 MB" in refusal.text
        assert api.downloads == []
        # 21 MB with no declared size: Telegram refuses getFile ("file is too big").
        api.push_document(chat_id=CHAT, user_id=OPERATOR, data=big, file_name="big2", size=None)
        refusal = await answer(api, "too big for Telegram")
        assert api.downloads == []
        # A zero-byte file.
        api.push_document(chat_id=CHAT, user_id=OPERATOR, data=b"", file_name="empty.txt")
        await answer(api, "empty.txt is empty")
        # A refused type.
        api.push_document(
            chat_id=CHAT,
            user_id=OPERATOR,
            data=b"MZ\x90\x00",
            file_name="setup.exe",
            mime_type="application/x-msdownload",
        )
        refusal = await answer(api, "a type this bot does not take")
        assert "TURNSTILE_UPLOAD_REFUSED_TYPES" in refusal.text
        assert not uploads.exists()
        assert prompts(tmp_path) == []
        # A name with path parts and a leading dot: one plain name inside uploads/.
        api.push_document(
            chat_id=CHAT, user_id=OPERATOR, data=b"dots", file_name="../../.bashrc", caption="a"
        )
        await answer(api, "echo: a")
        assert tree(uploads) == ["bashrc"]
        assert not (workdir.parent / ".bashrc").exists()
        assert not (workdir / ".bashrc").exists()
        # Unknown and malformed MIME types: taken, described as unknown binary data.
        api.push_document(
            chat_id=CHAT, user_id=OPERATOR, data=b"?", file_name="blob", mime_type=None
        )
        reply = await answer(api, "uploads/blob (")
        assert "uploads/blob (application/octet-stream, 1 bytes)" in reply.text
        api.push_document(
            chat_id=CHAT, user_id=OPERATOR, data=b"??", file_name="b2", mime_type="../../x y"
        )
        reply = await answer(api, "uploads/b2 (")
        assert "(application/octet-stream, 2 bytes)" in reply.text
        # Unicode names are NFC-normalized.
        api.push_document(
            chat_id=CHAT, user_id=OPERATOR, data=b"u", file_name="cafe\u0301.txt", caption="u"
        )
        await answer(api, "echo: u")
        assert "caf\u00e9.txt" in os.listdir(uploads)


async def test_planted_symlinks_are_never_written_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("precious")
    async with FakeBotApi() as api, bound_chat(api, tmp_path) as (_, workdir):
        uploads = workdir / "uploads"
        uploads.mkdir()
        # An agent planted uploads/x -> a file outside the run's folder.
        (uploads / "x").symlink_to(victim)
        api.push_document(chat_id=CHAT, user_id=OPERATOR, data=b"new", file_name="x", caption="1")
        reply = await answer(api, "echo: 1")
        assert victim.read_text() == "precious"
        assert (uploads / "x").is_symlink()
        assert (uploads / "x-1").read_bytes() == b"new"
        assert "uploads/x-1" in reply.text
        # A dangling symlink is a taken name too (O_EXCL never creates its target).
        (uploads / "y").symlink_to(outside / "created-through-link")
        api.push_document(chat_id=CHAT, user_id=OPERATOR, data=b"y", file_name="y", caption="2")
        await answer(api, "echo: 2")
        assert not (outside / "created-through-link").exists()
        # uploads/ itself replaced by a symlink to a folder outside: refused.
        shutil.rmtree(uploads)
        uploads.symlink_to(outside, target_is_directory=True)
        api.push_document(chat_id=CHAT, user_id=OPERATOR, data=b"z", file_name="z", caption="3")
        refusal = await answer(api, "not a plain folder")
        assert "nothing was saved" in refusal.text
        assert sorted(os.listdir(outside)) == ["victim.txt"]
    assert len(prompts(tmp_path)) == 2


async def test_uploads_are_kept_out_of_git_in_a_worktree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    repo = git_workspace(tmp_path / "origin")
    write_script(tmp_path, {}, monkeypatch)
    async with (
        FakeBotApi() as api,
        bound_chat(api, tmp_path, command="/chat command web", projects=f"web={repo}") as (
            _,
            workdir,
        ),
    ):
        api.push_document(
            chat_id=CHAT, user_id=OPERATOR, data=b"shot", file_name="s.png", caption="look"
        )
        await answer(api, "echo: look")
        assert (workdir / "uploads" / "s.png").exists()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all"],
            cwd=workdir,
            capture_output=True,
            text=True,
            check=True,
        )
        assert status.stdout == ""
        ignored = subprocess.run(
            ["git", "check-ignore", "-v", "uploads/s.png"],
            cwd=workdir,
            capture_output=True,
            text=True,
        )
        assert ignored.returncode == 0
        assert "info/exclude" in ignored.stdout
        # A second upload does not add the line again.
        api.push_document(
            chat_id=CHAT, user_id=OPERATOR, data=b"2", file_name="t.png", caption="again"
        )
        await answer(api, "echo: again")
        exclude = ignored.stdout.split(":", 1)[0]
        exclude_path = Path(exclude) if Path(exclude).is_absolute() else workdir / exclude
        assert exclude_path.read_text().count("/uploads/") == 1


async def test_files_from_strangers_and_unbound_chats_are_not_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    async with FakeBotApi() as api, running_bot(api, bot_settings(api, tmp_path)) as rt:
        api.push_document(chat_id=OPERATOR, user_id=OPERATOR, data=b"a", file_name="a.txt")
        # A private chat with the operator is not in the allowed chats: ignored.
        api.push_document(chat_id=CHAT, user_id=STRANGER, data=b"a", file_name="a.txt")
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
        await answer(api, "bound")
        api.push_document(chat_id=CHAT, user_id=STRANGER, data=b"a", file_name="a.txt")
        refusal = await answer(api, "needs the operator role")
        assert str(STRANGER) in refusal.text
        await refused(rt.store, STRANGER, "prompt")
    assert api.downloads == []
    assert prompts(tmp_path) == []


async def test_get_sends_a_file_and_a_folder_and_refuses_what_leaves_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    secret = tmp_path / "secret.txt"
    secret.write_text("do not send")
    async with FakeBotApi() as api:
        async with bound_chat(api, tmp_path, send_max_bytes=64 * 1024) as (rt, workdir):
            (workdir / "out").mkdir()
            (workdir / "out" / "report.html").write_text("<h1>done</h1>")
            (workdir / "out" / "data.bin").write_bytes(bytes(range(256)))
            (workdir / "out" / "escape").symlink_to(secret)
            (workdir / "link-out").symlink_to(secret)
            (workdir / "inside-link").symlink_to(workdir / "out" / "report.html")
            (workdir / "token.txt").write_text(f"token={api.token}\n")
            (workdir / "huge.bin").write_bytes(os.urandom(100 * 1024))

            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/get out/report.html")
            doc = await api.wait_for_message(lambda m: m.document is not None)
            assert doc.document == b"<h1>done</h1>"
            assert doc.filename == "report.html"
            assert doc.text.startswith("📎 out/report.html")
            assert doc.reply_to is not None

            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/get inside-link")
            await api.wait_until(lambda: sum(m.document is not None for m in api.sent) == 2)

            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/get out")
            zipped = await api.wait_for_message(lambda m: (m.filename or "").endswith(".zip"))
            assert zipped.filename == "out.zip"
            assert zipped.document is not None
            with zipfile.ZipFile(io.BytesIO(zipped.document)) as zf:
                assert sorted(zf.namelist()) == ["data.bin", "report.html"]
                assert zf.read("data.bin") == bytes(range(256))
            assert "2 file(s) zipped" in zipped.text

            for path, needle in [
                ("../secret.txt", "leaves the run's folder"),
                (str(secret), "absolute path"),
                ("link-out", "symlink that leads out"),
                ("nothing-here", "does not exist"),
                ("huge.bin", "up to 64.0 KB"),
                (".git/config", "git's own data"),
            ]:
                api.push_message(chat_id=CHAT, user_id=OPERATOR, text=f"/get {path}")
                refusal = await answer(api, needle)
                assert refusal.text.startswith("⚠️ Not sent:")

            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/get token.txt")
            redacted = await api.wait_for_message(lambda m: m.filename == "token.txt")
            assert redacted.document is not None
            assert api.token.encode() not in redacted.document
            assert b"[REDACTED]" in redacted.document
            assert "sent with 1 secret hidden" in redacted.text

            api.push_message(chat_id=CHAT, user_id=STRANGER, text="/get out/report.html")
            await answer(api, "/get needs the operator or approver role")
            entries = await refused(rt.store, STRANGER, "status")
            gets = [(e.user_id, e.reason) for e in entries if e.action == "get"]
            assert (OPERATOR, "out/report.html") in gets
        documents = [m for m in api.sent if m.document is not None]
        assert all(secret.read_bytes() not in (m.document or b"") for m in documents)
        assert len(documents) == 4
    # Spool copies are removed once delivered.
    assert list((tmp_path / "runs" / "outgoing").iterdir()) == []


async def test_an_agent_hands_a_file_to_the_chat_with_a_marker_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(
        tmp_path,
        {
            "rules": [
                {
                    "match": "report",
                    "files": {"out/report.html": "<p>the report</p>"},
                    "text": "Here it is.\nTURNSTILE-SEND: out/report.html\n"
                    "TURNSTILE-SEND: ../../secret.txt",
                }
            ]
        },
        monkeypatch,
    )
    (tmp_path / "secret.txt").write_text("no")
    async with FakeBotApi() as api, bound_chat(api, tmp_path):
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="make the report")
        doc = await api.wait_for_message(lambda m: m.document is not None)
        assert doc.document == b"<p>the report</p>"
        assert doc.filename == "report.html"
        not_sent = await answer(api, "Not sent (TURNSTILE-SEND: ../../secret.txt)")
        assert "leaves the run's folder" in not_sent.text
        texts = api.texts(CHAT)
        answer_at = next(i for i, t in enumerate(texts) if t.startswith("Here it is."))
        # The files follow the answer.
        assert api.sent.index(doc) > answer_at


def speech_wav(path: Path, text: str) -> Path:
    """A real spoken WAV from espeak-ng; without it, a tone written with ``wave``."""
    espeak = shutil.which("espeak-ng")
    if espeak is not None:
        subprocess.run([espeak, "-w", str(path), text], check=True, capture_output=True)
        return path
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        frames = b"".join(
            struct.pack("<h", int(8000 * math.sin(2 * math.pi * 440 * i / 16000)))
            for i in range(16000)
        )
        out.writeframes(frames)
    return path


async def test_a_voice_note_is_transcribed_shown_and_becomes_the_prompt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    audio = speech_wav(tmp_path / "note.wav", "please fix the login bug").read_bytes()
    with wave.open(io.BytesIO(audio)) as parsed:
        assert parsed.getnframes() > 0
    async with FakeTranscriptionApi(transcript="please fix the login bug") as stt:
        async with (
            FakeBotApi() as api,
            bound_chat(
                api,
                tmp_path,
                transcription_url=stt.url,
                transcription_key="voicekey-7f3a9c-plain",
                transcription_model="whisper-large-v3",
            ) as (_, workdir),
        ):
            api.push_voice(chat_id=CHAT, user_id=OPERATOR, data=audio, mime_type="audio/wav")
            shown = await answer(api, "🎙 please fix the login bug")
            assert shown.reply_to is not None
            await answer(api, "echo: please fix the login bug")
            # An audio message (a recording sent as music) is transcribed the same way.
            stt.transcript = "second note"
            api.push_voice(
                chat_id=CHAT, user_id=OPERATOR, data=audio, mime_type="audio/x-wav", audio=True
            )
            await answer(api, "echo: second note")
            # The service fails: said so, no turn.
            stt.status = 503
            api.push_voice(chat_id=CHAT, user_id=OPERATOR, data=audio)
            failed = await answer(api, "could not be transcribed")
            assert "HTTP 503" in failed.text
            assert "voicekey-7f3a9c" not in failed.text
            assert not (workdir / "uploads").exists()
        first = stt.requests[0]
        assert first.audio == audio
        assert first.model == "whisper-large-v3"
        assert first.authorization == "Bearer voicekey-7f3a9c-plain"
        assert first.content_type == "audio/wav"
        assert stt.requests[1].filename == "recording.wav"
    assert prompts(tmp_path) == ["please fix the login bug", "second note"]


async def test_a_voice_note_without_a_service_says_which_setting_enables_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    async with FakeBotApi() as api, bound_chat(api, tmp_path):
        api.push_voice(chat_id=CHAT, user_id=OPERATOR, data=b"OggS....")
        reply = await answer(api, "Voice notes are not transcribed")
        assert "TURNSTILE_TRANSCRIPTION_URL" in reply.text
        assert "\n" not in reply.text
    assert api.downloads == []
    assert prompts(tmp_path) == []


async def test_files_and_voice_notes_steer_a_running_auto_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    release = tmp_path / "release"
    write_script(
        tmp_path,
        {
            "rules": [
                {"match": CLARIFY, "text": "Goal: done.", "wait_file": str(release)},
                {"match": PLAN, "text": "1. read the uploads"},
                {
                    "match": EXECUTE,
                    "text": "read them\nTURNSTILE-SEND: sum.txt\nTURNSTILE-SEND: ../../x",
                    "files": {"sum.txt": "3\n"},
                    "run": [["git", "add", "sum.txt"], ["git", "commit", "-q", "-m", "sum"]],
                },
                {"match": EVALUATE, "text": "ok\nAUTO-MODE STATUS: COMPLETE\n"},
            ]
        },
        monkeypatch,
    )
    async with (
        FakeTranscriptionApi(transcript="also check the totals") as stt,
        FakeBotApi() as api,
    ):
        settings = bot_settings(api, tmp_path, transcription_url=stt.url)
        async with running_bot(api, settings) as rt:
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/auto sum the data")
            started = await api.wait_for_message(lambda m: m.text.startswith("🤖 Auto run "))
            run_id = started.text.split()[3]
            api.push_document(
                chat_id=CHAT,
                user_id=OPERATOR,
                data=b"a,b\n1,2\n",
                file_name="data.csv",
                mime_type="text/csv",
                caption="use this data",
            )
            await answer(api, f"Noted for run {run_id} (a file)")
            api.push_voice(chat_id=CHAT, user_id=OPERATOR, data=b"OggS-voice")
            await answer(api, "🎙 also check the totals")
            await answer(api, f"Noted for run {run_id} (voice note)")
            # From a forum topic, as a reply to the run's message: still that run.
            api.push_photo(
                chat_id=CHAT,
                user_id=OPERATOR,
                data=b"jpeg",
                caption="and this screen",
                thread_id=7,
                reply_to=started.message_id,
            )
            await api.wait_until(lambda: sum("Noted for run" in t for t in api.texts()) == 3)
            release.touch()
            # The Execute turn hands over a file: it follows the turn's output.
            doc = await api.wait_for_message(lambda m: m.filename == "sum.txt")
            assert doc.document == b"3\n"
            await answer(api, "Not sent (TURNSTILE-SEND: ../../x)")
            await answer(api, "Objective achieved")
            # The run's own worktree of the chat's workspace.
            workdir = Path((await rt.runs.get_run(run_id)).workdir or "")
    assert (workdir / "uploads" / "data.csv").read_bytes() == b"a,b\n1,2\n"
    executes = [p for p in prompts(tmp_path) if EXECUTE in p]
    assert len(executes) == 1
    for needle in ["use this data", "uploads/data.csv (text/csv", "also check the totals"]:
        assert needle in executes[0]
    assert "and this screen" in executes[0]
    status = subprocess.run(
        ["git", "status", "--porcelain"], cwd=workdir, capture_output=True, text=True, check=True
    )
    assert status.stdout == ""


async def test_a_file_not_yet_delivered_at_shutdown_goes_out_after_the_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    spool = tmp_path / "runs" / "outgoing"
    async with FakeBotApi() as api:
        # Telegram is down for documents while the first bot runs.
        api.fail(["sendDocument"], 502, count=10_000)
        async with bound_chat(api, tmp_path, shutdown_flush_seconds=0.5) as (_, workdir):
            (workdir / "notes.md").write_text("# notes\n")
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/get notes.md")
            await api.wait_until(lambda: len(api.calls_of("sendDocument")) >= 1)
        assert [p.name.endswith("-notes.md") for p in spool.iterdir()] == [True]
        api.failures.clear()
        async with running_bot(api, bot_settings(api, tmp_path)):
            doc = await api.wait_for_message(lambda m: m.filename == "notes.md")
            assert doc.document == b"# notes\n"
        assert sum(m.filename == "notes.md" for m in api.sent) == 1
    assert list(spool.iterdir()) == []


async def _bot_process(api: FakeBotApi, root: Path, **env_extra: str) -> asyncio.subprocess.Process:
    """The real ``turnstile bot`` as a process (to be killed with SIGKILL)."""
    fakes = {k: v for k, v in os.environ.items() if k.startswith("FAKE_")}
    env = bot_env(
        root,
        api,
        TURNSTILE_DATABASE=bot_harness.DATABASE or str(root / "turnstile.db"),
        TURNSTILE_ALLOWED_CHATS=str(OPERATOR),
        **fakes,
        **env_extra,
    )
    return await start_polling(api, root, env, timeout=30)


@pytest.mark.timeout(120)
async def test_an_album_cut_off_by_a_crash_is_not_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path, {}, monkeypatch)
    uploads = tmp_path / "ws" / "chats" / f"chat_{OPERATOR}" / "uploads"
    async with FakeBotApi() as api:
        bot = await _bot_process(api, tmp_path, TURNSTILE_ALBUM_WAIT_SECONDS="3600")
        try:
            # A private chat: the group flood limit is not under test here.
            api.push_message(chat_id=OPERATOR, user_id=OPERATOR, text="/chat")
            await answer(api, "bound")
            for i in range(2):
                api.push_photo(
                    chat_id=OPERATOR,
                    user_id=OPERATOR,
                    data=f"p{i}".encode(),
                    caption="both screens" if i == 0 else None,
                    media_group_id="album-crash",
                )
            await api.wait_until(lambda: len(api.downloads) == 2)
            deadline = time.monotonic() + 20
            while not (uploads.is_dir() and len(os.listdir(uploads)) == 2):
                assert time.monotonic() < deadline, "the album's files were not saved"
                await asyncio.sleep(0.02)
            bot.send_signal(signal.SIGKILL)
            await bot.wait()
        finally:
            if bot.returncode is None:
                bot.kill()
                await bot.wait()
        assert prompts(tmp_path) == []
        bot = await _bot_process(api, tmp_path, TURNSTILE_ALBUM_WAIT_SECONDS="0.2")
        try:
            reply = await answer(api, "echo: both screens")
            assert "2 files" in reply.text
            bot.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(bot.wait(), 30) == 0
        finally:
            if bot.returncode is None:
                bot.kill()
                await bot.wait()
    # The parts came again after the crash: their files are saved twice, the turn once.
    assert len(prompts(tmp_path)) == 1
    assert len(os.listdir(uploads)) == 4
