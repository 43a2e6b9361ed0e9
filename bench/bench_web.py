#!/usr/bin/env python3
"""Benchmark: the web view's board over 10,000 tasks, and an event's way to an open page.

Targets: the board's first byte <= 200 ms (the tasks view and the runs view, signed in,
over HTTP on 127.0.0.1); an event written -> shown on a run's page <= 500 ms at the median.

- First byte: from the request sent to the first byte of the body, ``--rounds`` times each
  after one unmeasured warm-up.
- Event -> page: a run's page opened in a real Chromium (Playwright, Debian's browser)
  follows its events; each round writes one event (a turn started) and waits for it in the
  page's list. Written by the serving process itself (as the bot writes its runs' events),
  and by another connection to the file (as a terminal or a worker does, noticed at the
  log's next poll). Without Chromium the same is measured from a Server-Sent Events client.

Run: ``.venv/bin/python bench/bench_web.py [--tasks 10000] [--rounds 30]``.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_status import populate, populate_runs  # noqa: E402
from chatfront.auth import Authorizer  # noqa: E402
from engine.approvals.store import SqliteApprovalStore  # noqa: E402
from engine.gates import Gates  # noqa: E402
from engine.settings import Settings  # noqa: E402
from engine.store.backend import open_database  # noqa: E402
from engine.store.runs import SqliteRunStore  # noqa: E402
from webview.actions import WebActions  # noqa: E402
from webview.app import WebView, serving  # noqa: E402

FIRST_BYTE_TARGET_MS = 200
EVENT_TARGET_MS = 500
TOKEN = "1:bench"
USER = 7


class _NoChat:
    async def gate_decided(self, *args: Any) -> None: ...
    async def tool_decided(self, *args: Any) -> None: ...
    async def stop(self, *args: Any) -> bool:
        return False


def _ms(values: list[float]) -> str:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]
    return f"p50 {statistics.median(values) * 1000:7.1f} ms   p95 {p95 * 1000:7.1f} ms"


async def first_bytes(url: str, cookie: str, path: str, rounds: int) -> list[float]:
    import aiohttp

    out = []
    async with aiohttp.ClientSession(cookies={"turnstile_session": cookie}) as client:
        for i in range(rounds + 1):
            start = time.perf_counter()
            async with client.get(url + path) as response:
                await response.content.readany()
                took = time.perf_counter() - start
                assert response.status == 200, response.status
                await response.read()
            if i:
                out.append(took)
    return out


async def events_in_browser(
    url: str, cookie: str, run_id: str, write: Any, rounds: int
) -> list[float] | None:
    chromium = shutil.which("chromium")
    if chromium is None:
        return None
    from playwright.async_api import async_playwright

    out = []
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        context = await browser.new_context()
        await context.add_cookies(
            [{"name": "turnstile_session", "value": cookie, "url": url + "/"}]
        )
        page = await context.new_page()
        await page.goto(f"{url}/runs/{run_id}")
        await page.wait_for_selector("#events")
        await asyncio.sleep(0.5)  # the page's event stream connects
        for seq in range(rounds):
            count = await page.locator("#events li").count()
            start = time.perf_counter()
            await write(seq)
            await page.wait_for_function(
                "(n) => document.querySelectorAll('#events li').length > n",
                arg=count,
                polling="raf",
            )
            out.append(time.perf_counter() - start)
        await browser.close()
    return out


async def events_over_sse(
    url: str, cookie: str, run_id: str, write: Any, rounds: int
) -> list[float]:
    import aiohttp

    out = []
    async with (
        aiohttp.ClientSession(cookies={"turnstile_session": cookie}) as client,
        client.get(f"{url}/runs/{run_id}/events", params={"after": "999999999"}) as stream,
    ):
        for seq in range(rounds):
            start = time.perf_counter()
            await write(seq)
            while not (await stream.content.readline()).startswith(b"data:"):
                pass
            out.append(time.perf_counter() - start)
    return out


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-web-") as tmp:
        root = Path(tmp)
        path = root / "web.db"
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        settings = Settings(
            _env_file=None,  # type: ignore[call-arg]
            database=path,
            approvers=(USER,),
            tasks_root=root / "tasks",
            runs_dir=root / "runs",
        )
        async with open_database(path) as db:
            await populate(db, root, args.tasks)
            await populate_runs(db, 200)
            gates = Gates(db, settings)
            approvals = SqliteApprovalStore(db)
            view = WebView(
                settings=settings,
                db=db,
                gates=gates,
                approvals=approvals,
                authorizer=Authorizer.from_ids(
                    admins=(), approvers=(USER,), operators=(), allowed_chats=()
                ),
                actions=WebActions(db, gates, approvals, _NoChat(), forbid_self_approval=False),
                bot_token=TOKEN,
                names=lambda user_id: f"user {user_id}",
            )
            cookie, _ = view.keys.new(USER)
            url = f"http://127.0.0.1:{port}"
            runs = SqliteRunStore(db)
            run_id = "auto-bench-0000"  # recorded running: its page follows it
            async with serving(view, "127.0.0.1", port), open_database(path) as other:
                elsewhere = SqliteRunStore(other)
                print(
                    f"board over {args.tasks:,} tasks and 200 runs (SQLite), {args.rounds} rounds"
                )
                for label, page in (("tasks view", "/?view=tasks"), ("runs view", "/")):
                    times = await first_bytes(url, cookie, page, args.rounds)
                    ok = statistics.median(times) * 1000 <= FIRST_BYTE_TARGET_MS
                    print(
                        f"  first byte, {label:<10} {_ms(times)}   target <= "
                        f"{FIRST_BYTE_TARGET_MS} ms: {'met' if ok else 'MISSED'}"
                    )
                seqs = iter(range(100, 100_000))

                async def here(_: int) -> None:
                    await runs.start_turn(run_id, next(seqs), "p", "execute")

                async def there(_: int) -> None:
                    await elsewhere.start_turn(run_id, next(seqs), "p", "execute")

                for label, write in (("written here", here), ("written elsewhere", there)):
                    shown = await events_in_browser(url, cookie, run_id, write, args.rounds)
                    how = "in Chromium"
                    if shown is None:
                        shown = await events_over_sse(url, cookie, run_id, write, args.rounds)
                        how = "over SSE (no Chromium here)"
                    ok = statistics.median(shown) * 1000 <= EVENT_TARGET_MS
                    print(
                        f"  event -> page, {label:<17} {_ms(shown)}   {how}; target p50 <= "
                        f"{EVENT_TARGET_MS} ms: {'met' if ok else 'MISSED'}"
                    )
            await gates.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
