"""The web view's renderings: a run's timeline, its diff and Markdown, all safe to show."""

from __future__ import annotations

import subprocess
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from engine.store.events import EventKind, RunEvent
from webview.diff import diff_css, run_diff
from webview.markdown import code_css, render_markdown
from webview.timeline import PHASE_COLOURS, legend, phase_colour, timeline_svg

SVG = "{http://www.w3.org/2000/svg}"
T0 = 1_700_000_000.0


class Log:
    """A scripted run's event log: ids in order, times in seconds after T0."""

    def __init__(self) -> None:
        self.events: list[RunEvent] = []

    def add(self, kind: EventKind, after: float, task: str | None = None, **data: Any) -> None:
        self.events.append(
            RunEvent(
                id=len(self.events) + 1,
                kind=kind.value,
                at=T0 + after,
                run_id=None if task else "run-1",
                task=task,
                data=data,
            )
        )

    def turn(
        self, turn_id: int, start: float, end: float | None, phase: str | None, **ended: Any
    ) -> None:
        seq: dict[str, Any] = {"turn_id": turn_id, "seq": turn_id, "attempt": 1}
        self.add(EventKind.TURN_STARTED, start, phase=phase, **seq)
        if end is not None:
            self.add(EventKind.TURN_ENDED, end, **seq, **({"state": "finished"} | ended))


def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    return root


def by_class(root: ET.Element, tag: str, word: str) -> list[ET.Element]:
    return [e for e in root.iter(f"{SVG}{tag}") if word in (e.get("class") or "").split()]


def title(element: ET.Element) -> str:
    found = element.find(f"{SVG}title")
    assert found is not None
    assert found.text is not None
    return found.text


def right_edge(rect: ET.Element) -> float:
    return float(rect.get("x", "0")) + float(rect.get("width", "0"))


def autopilot_run() -> Log:
    log = Log()
    log.add(EventKind.RUN_STARTED, 0, mode="autopilot", agent="claude")
    log.turn(1, 0, 120, "research")
    log.add(EventKind.GATE_OPENED, 121, task="t1", phase="research", sha256="ab" * 32, round=1)
    log.add(EventKind.PARKED, 121, phase="research")
    log.add(EventKind.GATE_DECIDED, 400, task="t1", decision="approved", phase="research",
            by="ann", approvers=1, quorum=1)  # fmt: skip
    log.add(EventKind.PHASE, 401, phase="design")
    log.turn(2, 401, 500, "design", state="failed", error="the agent crashed")
    log.turn(3, 501, None, "design")
    log.add(EventKind.TOOL_REQUESTED, 510, request_id=7, tool="Bash", input='{"command": "ls"}')
    log.add(EventKind.TOOL_DECIDED, 530, request_id=7, decision="denied", scope=None, by=5)
    return log


def test_timeline_draws_turns_waits_and_marks() -> None:
    log = autopilot_run()
    root = parse(timeline_svg(log.events, now=T0 + 600, width=800))

    assert root.get("role") == "img"
    assert root.get("viewBox") == "0 0 800 124"
    assert "3 turns" in (root.get("aria-label") or "")
    assert "still going" in (root.get("aria-label") or "")
    turns = by_class(root, "rect", "turn")
    assert len(turns) == 3
    research, design = phase_colour("research"), phase_colour("design")
    assert [t.get("fill") for t in turns] == [research, design, design]
    failed = by_class(root, "rect", "failed")
    assert len(failed) == 1
    assert "the agent crashed" in title(failed[0])
    # The turn still running reaches now: the right end of the plot (800 - 16).
    (running,) = by_class(root, "rect", "open")
    assert right_edge(running) == pytest.approx(784, abs=0.2)
    (wait,) = by_class(root, "rect", "wait")
    assert "waiting in research" in title(wait)
    # Parked at 121 until the run moved on to design at 401 (the approval came at 400).
    assert float(wait.get("width", "0")) == pytest.approx((401 - 121) / 600 * 720, abs=0.2)
    assert len(by_class(root, "polygon", "gate")) == 2
    assert "waits for approval of its research" in title(by_class(root, "polygon", "opened")[0])
    assert "approved by ann" in title(by_class(root, "polygon", "approved")[0])
    assert "Bash" in title(by_class(root, "circle", "requested")[0])
    (denied,) = by_class(root, "circle", "denied")
    assert "denied" in title(denied)
    assert "(Bash)" in title(denied)
    ticks = [t.text for t in by_class(root, "text", "tick")]
    assert ticks == ["0", "2m", "4m", "6m", "8m", "10m"]  # nine at most in 720 units
    every_mark = [*turns, wait, *root.iter(f"{SVG}polygon"), *root.iter(f"{SVG}circle")]
    assert all(title(mark) for mark in every_mark)
    assert legend(log.events) == [
        ("research", PHASE_COLOURS["research"]),
        ("design", PHASE_COLOURS["design"]),
    ]


def test_timeline_of_an_ended_run_stops_at_its_end() -> None:
    log = Log()
    log.add(EventKind.RUN_STARTED, 0, mode="chat", agent="claude")
    log.turn(1, 0, 30, None)
    log.add(EventKind.PARKED, 30, phase="design:awaiting_approval")
    log.add(EventKind.RUN_ENDED, 90, status="stopped", exit_code=None, reason="stopped by ann")
    root = parse(timeline_svg(log.events, now=T0 + 10_000, width=960))

    (turn,) = by_class(root, "rect", "turn")
    assert turn.get("fill") == PHASE_COLOURS["chat"]
    (end,) = by_class(root, "g", "end")
    assert "stopped" in (end.get("class") or "")
    assert "ended: stopped" in title(end)
    assert "stopped by ann" in title(end)
    (line,) = end.iter(f"{SVG}line")
    assert float(line.get("x1", "0")) == pytest.approx(944)  # the end is the axis' end
    (wait,) = by_class(root, "rect", "wait")
    assert right_edge(wait) == pytest.approx(944, abs=0.2)
    assert "waiting in design, waiting for approval" in title(wait)  # no internal labels
    assert "ended" in (root.get("aria-label") or "")
    assert legend(log.events) == [("chat", PHASE_COLOURS["chat"])]


def test_timeline_turn_open_when_the_run_ended_is_marked_cut_off() -> None:
    log = Log()
    log.add(EventKind.RUN_STARTED, 0, mode="auto", agent="codex")
    log.turn(1, 0, None, "execute")
    log.add(EventKind.RUN_ENDED, 50, status="crashed")
    root = parse(timeline_svg(log.events, now=T0 + 500))

    (turn,) = by_class(root, "rect", "turn")
    assert "failed" in (turn.get("class") or "")
    assert "its end is unknown" in title(turn)


def test_timeline_escapes_what_events_say() -> None:
    hostile = '"><script>alert(1)</script><rect onload="x'
    log = Log()
    log.add(EventKind.RUN_STARTED, 0, mode="auto", agent="claude")
    log.turn(1, 0, 10, hostile)
    log.add(EventKind.TOOL_REQUESTED, 5, request_id=1, tool=hostile + "\x1b\x00", input=hostile)
    log.add(EventKind.TOOL_DECIDED, 6, request_id=1, decision=hostile, by=hostile)
    log.add(EventKind.RUN_ENDED, 10, status=hostile)
    svg = timeline_svg(log.events, now=T0 + 20)

    root = parse(svg)  # control characters dropped, or this would not parse
    assert "<script" not in svg
    assert not list(root.iter(f"{SVG}script"))
    assert all(not name.startswith("on") for e in root.iter() for name in e.attrib)
    assert len(by_class(root, "rect", "turn")) == 1
    assert hostile in title(by_class(root, "circle", "requested")[0])
    # A class made of the event's words holds only safe ones.
    classes = "".join(e.get("class", "") for e in root.iter())
    assert set(classes) <= set("abcdefghijklmnopqrstuvwxyz0123456789- ")
    assert legend(log.events) == [(hostile, phase_colour(hostile))]


def test_timeline_with_nothing_yet() -> None:
    svg = timeline_svg([], now=T0)
    root = parse(svg)
    assert "Nothing has happened yet" in svg
    assert root.get("aria-label")
    assert legend([]) == []


def test_phase_colours_are_stable_and_from_the_palette() -> None:
    assert phase_colour(None) == phase_colour("chat") == PHASE_COLOURS["chat"]
    assert phase_colour("some_new_phase") == phase_colour("some_new_phase")
    assert phase_colour("some_new_phase").startswith("#")


# -- diff ----------------------------------------------------------------------------


def git(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository with one commit, then: a file changed, one added, a binary one
    added (both to the index) and one left untracked."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "app.py").write_text("one\ntwo\nthree\n")
    (repo / ".gitignore").write_text("*.log\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "first")
    (repo / "app.py").write_text("one\n2 <b>two</b>\nthree\nfour\n")
    (repo / "new.txt").write_text("a\nb\nc\n")
    (repo / "blob.bin").write_bytes(bytes(range(256)) * 4)
    git(repo, "add", "new.txt", "blob.bin")
    (repo / "scratch.txt").write_text("not added\n")
    (repo / "ignored.log").write_text("ignored\n")
    return repo


async def test_diff_against_head(repo: Path) -> None:
    diff = await run_diff(repo, None)

    assert diff.problem is None
    assert diff.base == "HEAD"
    files = {f.path: f for f in diff.files}
    assert set(files) == {"app.py", "new.txt", "blob.bin"}
    assert (files["app.py"].added, files["app.py"].removed) == (2, 1)
    assert (files["new.txt"].added, files["new.txt"].removed) == (3, 0)
    assert files["blob.bin"].binary
    assert not files["app.py"].binary
    assert diff.stat_text == "3 files changed, 5 insertions(+), 1 deletion(-)"
    assert diff.untracked == 1  # scratch.txt; ignored.log is ignored
    assert not diff.truncated
    assert diff.patch_html.startswith('<div class="diff">')
    assert '<span class="gi">+2 &lt;b&gt;two&lt;/b&gt;</span>' in diff.patch_html
    assert '<span class="gd">-two</span>' in diff.patch_html
    assert "style=" not in diff.patch_html


async def test_diff_against_a_base_counts_commits_and_the_working_tree(repo: Path) -> None:
    base = git(repo, "rev-parse", "HEAD")
    git(repo, "commit", "-qam", "second")
    (repo / "new.txt").write_text("a\nb\n")  # uncommitted, on top of the commit

    diff = await run_diff(repo, base)
    files = {f.path: f for f in diff.files}
    assert diff.base == base
    assert (files["new.txt"].added, files["new.txt"].removed) == (2, 0)
    assert (files["app.py"].added, files["app.py"].removed) == (2, 1)
    assert (await run_diff(repo, None)).stat_text == "1 file changed, 1 deletion(-)"


async def test_diff_of_a_rename(repo: Path) -> None:
    git(repo, "commit", "-qam", "second")
    git(repo, "mv", "new.txt", "moved.txt")
    diff = await run_diff(repo, None)
    (moved,) = diff.files
    assert (moved.path, moved.old_path) == ("moved.txt", "new.txt")
    assert (moved.added, moved.removed, moved.binary) == (0, 0, False)
    assert diff.stat_text == "1 file changed, 0 insertions(+), 0 deletions(-)"


async def test_diff_cut_at_max_bytes(repo: Path) -> None:
    (repo / "big.txt").write_text("".join(f"line {i}\n" for i in range(5000)))
    git(repo, "add", "big.txt")
    diff = await run_diff(repo, None, max_bytes=2000)

    assert diff.truncated
    assert "The patch was cut here" in diff.patch_html
    assert "+line 4999" not in diff.patch_html
    assert len(diff.patch_html) < 20_000
    big = next(f for f in diff.files if f.path == "big.txt")
    assert big.added == 5000  # the figures are whole, only the patch is cut


async def test_diff_of_nothing(repo: Path) -> None:
    git(repo, "commit", "-qam", "second")
    diff = await run_diff(repo, None)
    assert diff.problem is None
    assert diff.files == ()
    assert diff.stat_text == "no changes"
    assert diff.patch_html == ""


async def test_diff_problems(tmp_path: Path, repo: Path) -> None:
    gone = await run_diff(tmp_path / "nowhere", None)
    assert gone.problem is not None
    assert "is gone" in gone.problem
    assert gone.base is None
    assert gone.files == ()

    plain = tmp_path / "plain"
    plain.mkdir()
    not_repo = await run_diff(plain, None)
    assert not_repo.problem is not None
    assert "not a git repository" in not_repo.problem

    unknown = await run_diff(repo, "no-such-branch")
    assert unknown.problem == "The commit no-such-branch is not known here."
    assert unknown.base is None
    # A base that looks like an option is a name git does not know, never an option.
    sneaky = await run_diff(repo, f"--output={tmp_path / 'written'}")
    assert sneaky.problem is not None
    assert not (tmp_path / "written").exists()

    empty = tmp_path / "empty"
    empty.mkdir()
    git(empty, "init", "-q")
    assert (await run_diff(empty, None)).problem == "The repository has no commits yet."


def test_diff_css_is_scoped() -> None:
    rules = [line for line in diff_css().splitlines() if line.strip()]
    assert rules
    assert all(line.startswith(".diff") for line in rules)
    assert any(line.startswith(".diff .gi") for line in rules)


# -- markdown ------------------------------------------------------------------------


class Tags(HTMLParser):
    """The elements an HTML text makes, as a browser would read them."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found.append((tag, dict(attrs)))

    @classmethod
    def of(cls, html: str) -> list[tuple[str, dict[str, str | None]]]:
        parser = cls()
        parser.feed(html)
        parser.close()
        return parser.found


@pytest.mark.parametrize(
    "source",
    [
        "<script>alert(1)</script>",
        "hello <script>alert(1)</script> there",
        '<img src="x" onerror="alert(1)">',
        "[x](javascript:alert(1))",
        "[x](JaVaScRiPt:alert(1))",
        "[x](java\tscript:alert(1))",
        "<javascript:alert(1)>",
        "![x](data:image/png;base64,AAAA)",
        "[x](data:text/html,<script>alert(1)</script>)",
        '[x](https://ok.example/" onmouseover="alert(1))',
    ],
)
def test_markdown_is_inert(source: str) -> None:
    tags = Tags.of(render_markdown(source))
    assert not {"script", "img", "iframe", "object"} & {tag for tag, _ in tags}
    for _, attrs in tags:
        assert not [name for name in attrs if name.startswith("on")]
        href = attrs.get("href")
        assert href is None or urlsplit(href).scheme in ("http", "https", "mailto")


def test_markdown_links() -> None:
    html = render_markdown(
        "[a](https://example.com/x?y=1) [m](mailto:a@example.com) [r](docs/x.md)"
    )
    assert '<a href="https://example.com/x?y=1" rel="nofollow noreferrer">a</a>' in html
    assert '<a href="mailto:a@example.com" rel="nofollow noreferrer">m</a>' in html
    assert "docs/x.md" in html
    assert 'href="docs' not in html


def test_markdown_table_and_emphasis() -> None:
    html = render_markdown("| phase | turns |\n|---|--:|\n| plan | **3** |\n\n~~gone~~")
    assert "<table>" in html
    assert "<th>phase</th>" in html
    assert '<td style="text-align:right"><strong>3</strong></td>' in html
    assert "<s>gone</s>" in html


def test_markdown_code_fences() -> None:
    html = render_markdown('```python\ndef f():\n    return "<b>"\n```\n')
    assert html.startswith('<pre class="highlight"><code class="language-python">')
    assert '<span class="k">def</span>' in html
    assert "&lt;b&gt;" in html
    assert "<b>" not in html
    assert "style=" not in html

    plain = render_markdown("```no-such-language\n<i>x</i>\n```\n")
    assert plain.startswith('<pre><code class="language-no-such-language">&lt;i&gt;x')
    hostile = render_markdown('```"><script>\n1\n```\n')
    assert [tag for tag, _ in Tags.of(hostile)] == ["pre", "code"]
    assert code_css().startswith(".highlight")
