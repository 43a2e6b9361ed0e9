"""Files to and from a chat session on the workers: a document sent to the chat reaches
the chat's worktree on the worker before the turn, and the agent's ``TURNSTILE-SEND:``
files come back to the chat, read on the worker with the same refusals as a local chat.

Real PostgreSQL, a real worker subprocess, the real bot (python-telegram-bot against the
fake Bot API on 127.0.0.1) and the fake agent CLI.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from tests.automode_support import agent_log, write_script
from tests.fakes.bot_harness import CHAT, OPERATOR
from tests.test_workers_chat import _bot  # the bot bound to a chat on the workers
from tests.workers_support import Cluster
from tests.workers_support import cluster as cluster

pytestmark = pytest.mark.timeout(120)

NOTES = b"line one of the notes\nline two\n"
# The agent proves it has the file: it copies it (in its working folder, at turn time).
_COPY = "import shutil; shutil.copy('uploads/notes.txt', 'out/copy.txt')"


def _script(cluster: Cluster) -> None:
    write_script(
        cluster.tmp / "fake",
        rules=[
            {
                "match": "send it back",
                "files": {"out/keep.txt": "kept"},
                "run": [[sys.executable, "-c", _COPY]],
                "text": "Here it is.\nTURNSTILE-SEND: out/copy.txt\n"
                "TURNSTILE-SEND: ../../secret.txt\nTURNSTILE-SEND: out/missing.txt",
            },
        ],
    )
    cluster.env["TURNSTILE_PROJECTS"] = f"default={cluster.remote}#main"


async def test_a_file_goes_to_the_worker_and_files_come_back(cluster: Cluster) -> None:
    _script(cluster)
    (cluster.tmp / "secret.txt").write_text("not for the chat")
    await asyncio.to_thread(cluster.start_worker, "w1")
    async with _bot(cluster) as api:
        api.push_document(
            chat_id=CHAT,
            user_id=OPERATOR,
            data=NOTES,
            file_name="notes.txt",
            mime_type="text/plain",
            caption="read my notes",
        )
        reply = await api.wait_for_message(lambda m: "echo: read my notes" in m.text, timeout=60)
        # Named in the prompt as a local chat names it.
        assert "saved in your working folder" in reply.text
        assert f"uploads/notes.txt (text/plain, {len(NOTES)} bytes)" in reply.text
        assert "TURNSTILE-SEND: path/to/file" in reply.text
        log = agent_log(cluster.tmp / "agent.log")
        assert log[0]["prompt"].startswith(
            "read my notes\n[Sent from the chat with this message: a file"
        )
        worktree = Path(log[0]["cwd"])
        assert worktree.is_relative_to(cluster.tmp / "w1" / "ws")
        assert (worktree / "uploads" / "notes.txt").read_bytes() == NOTES
        # Nothing was written on the bot's side.
        assert not list((cluster.tmp / "bot").rglob("notes.txt"))

        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="now send it back")
        doc = await api.wait_for_message(lambda m: m.document is not None, timeout=60)
        assert doc.document == NOTES
        assert doc.filename == "copy.txt"
        assert f"📎 out/copy.txt · {len(NOTES)} bytes" in doc.text
        refused = await api.wait_for_message(
            lambda m: "Not sent (TURNSTILE-SEND: ../../secret.txt)" in m.text, timeout=30
        )
        assert "leaves the run's folder" in refused.text
        missing = await api.wait_for_message(
            lambda m: "Not sent (TURNSTILE-SEND: out/missing.txt)" in m.text, timeout=30
        )
        assert "out/missing.txt" in missing.text
        assert not any(m.document == b"not for the chat" for m in api.sent)
        assert any(t.startswith("Here it is.") for t in api.texts(CHAT))


async def test_get_in_a_chat_on_the_workers_says_where_the_files_are(cluster: Cluster) -> None:
    _script(cluster)
    async with _bot(cluster) as api:
        api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/get README.md")
        said = await api.wait_for_message(lambda m: "/get" not in m.text and "worker" in m.text)
        assert "ask the agent to send them" in said.text
        assert not any(m.document is not None for m in api.sent)
