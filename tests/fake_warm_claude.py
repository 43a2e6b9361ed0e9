"""A resident stand-in for ``claude -p --input-format stream-json`` (warm sessions).

It speaks the part of the stream-json protocol :class:`engine.agents.warm.WarmClaudeAgent`
reads: every user message on stdin is echoed back (``isReplay``) when it is taken up, and
each turn ends with one ``result`` record. A message that arrives while a turn runs is
taken up by that turn (steering), as the real CLI does between tool calls.

A prompt holding ``hold:NAME`` keeps its turn running until the file NAME exists in
``$FAKE_WARM_GATES``. Every message taken up is appended to ``$FAKE_WARM_LOG`` (one JSON
object a line: the turn and the text), in the order the agent saw them. ``--help`` prints
the flags turnstile looks for before it keeps a session warm.
"""

from __future__ import annotations

import json
import os
import queue
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

_HELP = (
    "Usage: claude [options]\n"
    "  --input-format <format>  text or stream-json\n"
    "  --replay-user-messages\n"
)


def _send(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _read(inbox: queue.Queue[dict[str, Any] | None]) -> None:
    for line in sys.stdin:
        if line.strip():
            inbox.put(json.loads(line))
    inbox.put(None)


def _text(message: dict[str, Any]) -> str:
    content = message.get("message", {}).get("content", "")
    return content if isinstance(content, str) else json.dumps(content)


def main() -> int:
    if "--help" in sys.argv:
        sys.stdout.write(_HELP)
        return 0
    log = Path(os.environ["FAKE_WARM_LOG"])
    gates = Path(os.environ["FAKE_WARM_GATES"])
    inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
    threading.Thread(target=_read, args=(inbox,), daemon=True).start()
    turn = 0

    def take(message: dict[str, Any], texts: list[str]) -> None:
        text = _text(message)
        with log.open("a") as fh:
            fh.write(json.dumps({"turn": turn, "text": text}) + "\n")
        _send({**message, "isReplay": True})
        texts.append(text)

    while True:
        message = inbox.get()
        if message is None:
            return 0
        if message.get("type") != "user":
            continue
        turn += 1
        texts: list[str] = []
        take(message, texts)
        interrupted = False
        for name in re.findall(r"hold:(\S+)", texts[0]):
            while not (gates / name).exists() and not interrupted:
                try:
                    more = inbox.get(timeout=0.02)
                except queue.Empty:
                    continue
                if more is None:
                    return 0
                if more.get("type") == "user":
                    take(more, texts)
                elif more.get("type") == "control_request":
                    _send(
                        {
                            "type": "control_response",
                            "response": {"subtype": "success", "request_id": more["request_id"]},
                        }
                    )
                    interrupted = True
        # What came in while the turn wound up is still this turn's.
        while True:
            try:
                more = inbox.get_nowait()
            except queue.Empty:
                break
            if more is None:
                inbox.put(None)  # the input ended: seen again after this result
                break
            if more.get("type") == "user":
                take(more, texts)
        _send(
            {
                "type": "result",
                "subtype": "error_during_execution" if interrupted else "success",
                "is_error": interrupted,
                "result": "answer: " + " + ".join(t.split(" hold:")[0] for t in texts),
                "session_id": message.get("session_id"),
                "num_turns": 1,
                "duration_ms": int(time.monotonic() % 1000),
            }
        )


if __name__ == "__main__":
    sys.exit(main())
