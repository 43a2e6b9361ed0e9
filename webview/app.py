"""The web view's HTTP side: aiohttp in the serving process's event loop.

Pages are rendered on the server (Jinja2, autoescaped) with one small script and no build
step; a run's page follows its events over Server-Sent Events. Every page but the sign-in
page needs a session cookie; every change is a POST carrying the session's CSRF token.

Long: the routes of every page (sign-in, board, run, task, metrics) and their guards sit
together, so what each one checks can be read in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import jinja2
from aiohttp import web

from chatfront.auth import Role
from engine.commands._events import what_happened
from engine.errors import NotFoundError
from engine.gates.refusals import GateRefused
from engine.humane import humane
from engine.spend import Spend
from engine.store.events import EventKind, EventLog, RunEvent
from engine.store.runs import SqliteRunStore, TurnState
from engine.workspace.store import SqliteWorkspaceStore
from webview.actions import WebActions
from webview.board import Board, Filters, words
from webview.diff import diff_css, run_diff
from webview.markdown import code_css, render_markdown
from webview.metrics import metrics_text, metrics_token_ok
from webview.signin import OneTimeLinks, Session, SessionKeys, SignInRefused, check_init_data
from webview.spendchart import spend_chart
from webview.timeline import legend, timeline_svg

if TYPE_CHECKING:
    from chatfront.auth import Authorizer
    from engine.approvals.store import SqliteApprovalStore
    from engine.gates import Gates
    from engine.settings import Settings
    from engine.store.backend import AnyDatabase

__all__ = ["COOKIE", "WebView", "make_app", "serving"]

_LOGGER = logging.getLogger(__name__)

COOKIE: Final = "turnstile_session"
_HERE: Final = Path(__file__).parent
_ENDED: Final = frozenset({"completed", "stopped", "error", "crashed"})
#: How often a run's page looks at the running turn's live output.
_OUTPUT_POLL: Final = 0.5


@dataclass(slots=True)
class WebView:
    """What the web view serves from: the serving front end's parts.

    Args:
        names: how the chat calls a person, by Telegram id.
        clock: the time source (link expiry, ages).
    """

    settings: Settings
    db: AnyDatabase
    gates: Gates
    approvals: SqliteApprovalStore
    authorizer: Authorizer
    actions: WebActions
    bot_token: str
    names: Callable[[int | None], str]
    clock: Callable[[], float] = time.time
    flashes: dict[str, str] = field(default_factory=dict)

    @property
    def keys(self) -> SessionKeys:
        return SessionKeys(self.bot_token, max_age=self.settings.web_session_hours * 3600)

    @property
    def links(self) -> OneTimeLinks:
        return OneTimeLinks(self.db, ttl=self.settings.web_link_minutes * 60, clock=self.clock)

    def roles(self, user_id: int) -> frozenset[Role]:
        return self.authorizer.roles(user_id)


_VIEW: Final = web.AppKey("view", WebView)
_PAGES: Final = web.AppKey("pages", jinja2.Environment)


def _said(view: WebView, event: RunEvent) -> str:
    """What the event says, in words, with people's names for their ids."""
    text = humane(what_happened(event))
    by = event.data.get("by")
    if isinstance(by, int | str) and str(by).lstrip("-").isdigit():
        text = text.replace(f" by {by}", f" by {view.names(int(by))}")
    return text


def _pages() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(_HERE / "templates"),
        autoescape=jinja2.select_autoescape(("html",), default=True),
        undefined=jinja2.StrictUndefined,
    )
    env.filters["clock"] = lambda at: time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))
    env.filters["words"] = words
    env.filters["hms"] = lambda at: time.strftime("%H:%M:%S", time.localtime(at))
    return env


def _secure(view: WebView) -> bool:
    return (view.settings.web_url or "").startswith("https://")


@web.middleware
async def _headers(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    response = await handler(request)
    # Telegram's web client shows a Mini App in a frame of its own site.
    response.headers.setdefault(
        "Content-Security-Policy",
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        "frame-ancestors 'self' https://web.telegram.org",
    )
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    # A sign-in link's token is in its URL: never sent on to another site.
    response.headers.setdefault("Referrer-Policy", "no-referrer")
    return response


def make_app(view: WebView) -> web.Application:
    """The web view's application (served by the caller's runner)."""
    app = web.Application(middlewares=[_headers])
    app[_VIEW] = view
    pages = _pages()
    pages.filters["person"] = lambda who: (
        view.names(int(who)) if str(who).lstrip("-").isdigit() else (who or "someone")
    )
    app[_PAGES] = pages
    app.add_routes(
        [
            web.get("/signin", _signin_page),
            web.post("/signin/telegram", _signin_telegram),
            web.get("/signin/link/{token}", _signin_link),
            web.post("/signout", _signout),
            web.get("/", _board),
            web.get("/runs/{run_id}", _run_page),
            web.get("/runs/{run_id}/events", _run_events),
            web.get("/runs/{run_id}/timeline", _run_timeline),
            web.post("/runs/{run_id}/stop", _run_stop),
            web.get("/tasks/{name}", _task_page),
            web.post("/tasks/{name}/approve", _task_approve),
            web.post("/tasks/{name}/reject", _task_reject),
            web.post("/tools/{request_id}", _tool_decide),
            web.get("/metrics", _metrics),
            web.get("/static/diff.css", _diff_css),
            web.static("/static", _HERE / "static", append_version=False),
        ]
    )
    return app


# -- pages and guards ------------------------------------------------------------------


def _render(request: web.Request, name: str, *, status: int = 200, **values: Any) -> web.Response:
    view = request.app[_VIEW]
    session: Session | None = values.pop("session", None)
    flash = view.flashes.pop(session.nonce, None) if session is not None else None
    body = (
        request.app[_PAGES]
        .get_template(name)
        .render(
            session=session,
            me=view.names(session.user_id) if session is not None else None,
            flash=flash,
            **values,
        )
    )
    return web.Response(text=body, status=status, content_type="text/html", charset="utf-8")


def _signin_required(request: web.Request, reason: str = "") -> web.Response:
    return _render(request, "signin.html", status=401 if not reason else 403, reason=reason)


def _session(request: web.Request) -> Session | None:
    view = request.app[_VIEW]
    session = view.keys.read(request.cookies.get(COOKIE))
    if session is None or not view.roles(session.user_id):
        return None  # signed out, forged, expired, or no longer anyone here
    return session


async def _form(request: web.Request, session: Session) -> dict[str, str] | None:
    """The POST's fields, once its CSRF token is the session's (None: it is not)."""
    form = await request.post()
    fields = {k: v for k, v in form.items() if isinstance(v, str)}
    if not request.app[_VIEW].keys.csrf_ok(session, fields.get("csrf")):
        _LOGGER.warning("web: a change without the session's token was refused")
        return None
    return fields


def _back(request: web.Request, session: Session, path: str, message: str) -> web.Response:
    request.app[_VIEW].flashes[session.nonce] = message
    raise web.HTTPSeeOther(path)


_Page = Callable[[web.Request, Session], Awaitable[web.StreamResponse]]
_Change = Callable[[web.Request, Session, dict[str, str]], Awaitable[web.StreamResponse]]


def _signed(handler: _Page) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A page for a signed-in person; anyone else gets the sign-in page."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        session = _session(request)
        if session is None:
            return _signin_required(request)
        return await handler(request, session)

    return guarded


def _change(handler: _Change) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A change a signed-in person asks for, from this site's own page (its CSRF token)."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        session = _session(request)
        if session is None:
            return _signin_required(request)
        form = await _form(request, session)
        if form is None:
            return _signin_required(request, "That request did not come from this page.")
        return await handler(request, session, form)

    return guarded


# -- signing in ------------------------------------------------------------------------


async def _signin_page(request: web.Request) -> web.Response:
    if _session(request) is not None:
        raise web.HTTPSeeOther("/")
    return _render(request, "signin.html", reason="")


def _signed_in(request: web.Request, user_id: int) -> web.Response:
    view = request.app[_VIEW]
    if not view.roles(user_id):
        _LOGGER.info("web: user %s signed in but has no role here", user_id)
        return _signin_required(request, f"You have no role here (your Telegram id: {user_id}).")
    cookie, _ = view.keys.new(user_id)
    response = web.HTTPSeeOther("/")
    secure = _secure(view)
    response.set_cookie(
        COOKIE,
        cookie,
        max_age=int(view.keys.max_age),
        httponly=True,
        secure=secure,
        # In Telegram's web client the Mini App is a frame of another site: a cookie there
        # goes only with SameSite=None, which browsers allow only over HTTPS.
        samesite="None" if secure else "Lax",
        path="/",
    )
    _LOGGER.info("web: user %s signed in", user_id)
    raise response


async def _signin_telegram(request: web.Request) -> web.Response:
    view = request.app[_VIEW]
    form = await request.post()
    raw = form.get("init_data")
    try:
        user = check_init_data(
            raw if isinstance(raw, str) else "", view.bot_token, now=view.clock()
        )
    except SignInRefused as exc:
        _LOGGER.warning("web: Mini App sign-in refused: %s", exc.reason)
        return _signin_required(request, exc.reason)
    return _signed_in(request, user.id)


async def _signin_link(request: web.Request) -> web.Response:
    try:
        user_id = await request.app[_VIEW].links.redeem(request.match_info["token"])
    except SignInRefused as exc:
        _LOGGER.warning("web: sign-in link refused: %s", exc.reason)
        return _signin_required(request, exc.reason)
    return _signed_in(request, user_id)


async def _signout(request: web.Request) -> web.Response:
    session = _session(request)
    if session is not None and await _form(request, session) is None:
        return _signin_required(request, "That request did not come from this page.")
    response = web.HTTPSeeOther("/signin")
    response.del_cookie(COOKIE, path="/")
    raise response


# -- the board -------------------------------------------------------------------------


@_signed
async def _board(request: web.Request, session: Session) -> web.Response:
    view = request.app[_VIEW]
    filters = Filters.parse(request.query)
    board = Board(view.db, names=view.names, clock=view.clock)
    tasks_view = request.query.get("view") == "tasks"
    roles = view.roles(session.user_id)
    page = await (board.tasks(filters) if tasks_view else board.runs(filters))
    waiting = await board.waiting_for(
        session.user_id, roles, forbid_self=view.settings.forbid_self_approval
    )
    return _render(
        request,
        "board.html",
        session=session,
        filters=filters,
        tasks_view=tasks_view,
        page=page,
        waiting=waiting,
        query={k: v for k, v in request.query.items() if k != "page"},
    )


# -- a run -----------------------------------------------------------------------------


async def _run_record(request: web.Request) -> Any:
    try:
        return await SqliteRunStore(request.app[_VIEW].db).get_run(request.match_info["run_id"])
    except NotFoundError:
        raise web.HTTPNotFound(text="There is no such run.") from None


async def _events_of(view: WebView, record: Any) -> list[RunEvent]:
    task = record.task if record.mode == "autopilot" else None
    return await EventLog(view.db).read(
        record.id, task=task, since=record.created_at if task else None, limit=5000
    )


async def _live_output(view: WebView, run_id: str, task: str | None = None) -> str:
    """What the chat shows of the run's running turn: its live progress message (a chat
    turn's or an auto run's status, or an autopilot phase's message)."""
    row = await view.db.fetchone(
        "SELECT body FROM bot_live WHERE ref LIKE ? OR ref = ? OR ref LIKE ?"
        " ORDER BY updated_at DESC LIMIT 1",
        (f"progress:{run_id}:%", f"status:{run_id}", f"phase:{task}:%" if task else ""),
    )
    return str(row["body"]) if row is not None else ""


@_signed
async def _run_page(request: web.Request, session: Session) -> web.Response:
    view = request.app[_VIEW]
    record = await _run_record(request)
    events = await _events_of(view, record)
    workspace = await SqliteWorkspaceStore(view.db).get(record.id)
    workdir = workspace.path if workspace is not None else record.workdir
    diff = await run_diff(Path(workdir), workspace.base if workspace else None) if workdir else None
    tools = [r for r in await view.approvals.history(record.id) if r.state.value == "pending"]
    turns = await SqliteRunStore(view.db).turns(record.id)
    spend = sum((t.spend for t in turns if t.state is TurnState.FINISHED), Spend())
    return _render(
        request,
        "run.html",
        session=session,
        run=record,
        ended=record.status.value in _ENDED,
        events=[(e, _said(view, e)) for e in events],
        cursor=events[-1].id if events else 0,
        timeline=timeline_svg(events, now=view.clock()),
        legend=legend(events),
        output=await _live_output(view, record.id, record.task),
        diff=diff,
        tools=tools,
        may_stop=bool(view.roles(session.user_id) & {Role.OPERATOR, Role.ADMIN}),
        spend=spend,
        spend_chart=spend_chart(turns),
    )


@_signed
async def _run_timeline(request: web.Request, session: Session) -> web.Response:
    view = request.app[_VIEW]
    record = await _run_record(request)
    svg = timeline_svg(await _events_of(view, record), now=view.clock())
    return web.Response(text=svg, content_type="image/svg+xml")


def _sse(name: str, data: object) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


@_signed
async def _run_events(request: web.Request, session: Session) -> web.StreamResponse:
    """The run's events from the page's cursor on, as Server-Sent Events, until the run
    ends or the page goes away; the running turn's live output when it changes."""
    view = request.app[_VIEW]
    record = await _run_record(request)
    after_text = request.query.get("after", "0")
    after = int(after_text) if after_text.isascii() and after_text.isdigit() else 0
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    task = record.task if record.mode == "autopilot" else None
    output = asyncio.create_task(
        _follow_output(view, record.id, record.task, response), name="web-output"
    )
    try:
        async for event in EventLog(view.db).follow(
            record.id,
            task=task,
            after=after,
            since=record.created_at if task else None,
            until=lambda e: e.run_id == record.id and e.kind == EventKind.RUN_ENDED,
        ):
            await response.write(
                _sse(
                    "event",
                    {
                        "id": event.id,
                        "kind": event.kind,
                        "at": time.strftime("%H:%M:%S", time.localtime(event.at)),
                        "text": _said(view, event),
                    },
                )
            )
        await response.write(_sse("ended", {}))
    except (ConnectionResetError, asyncio.CancelledError):
        pass  # the page went away
    finally:
        output.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await output
    return response


async def _follow_output(
    view: WebView, run_id: str, task: str | None, response: web.StreamResponse
) -> None:
    shown = await _live_output(view, run_id, task)
    while True:
        await asyncio.sleep(_OUTPUT_POLL)
        now = await _live_output(view, run_id, task)
        if now != shown:
            shown = now
            await response.write(_sse("output", {"text": now}))


@_change
async def _run_stop(request: web.Request, session: Session, form: dict[str, str]) -> web.Response:
    view = request.app[_VIEW]
    run_id = request.match_info["run_id"]
    said = await view.actions.stop(view.roles(session.user_id), session.user_id, run_id)
    return _back(request, session, f"/runs/{run_id}", said.message)


@_change
async def _tool_decide(
    request: web.Request, session: Session, form: dict[str, str]
) -> web.Response:
    view = request.app[_VIEW]
    raw = request.match_info["request_id"]
    if not (raw.isascii() and raw.isdigit()):
        raise web.HTTPNotFound(text="There is no such request.")
    said = await view.actions.decide_tool(
        view.roles(session.user_id), session.user_id, int(raw), form.get("choice", "")
    )
    back = form.get("back", "/")
    return _back(request, session, back if back.startswith("/runs/") else "/", said.message)


# -- a task ----------------------------------------------------------------------------


@_signed
async def _task_page(request: web.Request, session: Session) -> web.Response:
    view = request.app[_VIEW]
    name = request.match_info["name"]
    try:
        shown = await view.gates.show(name)
    except GateRefused:
        raise web.HTTPNotFound(text="There is no such task.") from None
    task = shown.task
    artifact_name, artifact_html = None, None
    if task.awaiting_approval and task.gate_sha256 is not None:
        with contextlib.suppress(GateRefused):
            artifact_name, stored = await view.gates.task_artifact(name)
            artifact_html = render_markdown(stored.content.decode("utf-8", "replace"))
    runs = await view.db.fetchall(
        "SELECT id, mode, status, created_at FROM runs WHERE task = ? ORDER BY created_at DESC"
        " LIMIT 20",
        (name,),
    )
    roles = view.roles(session.user_id)
    return _render(
        request,
        "task.html",
        session=session,
        shown=shown,
        task=task,
        artifact_name=artifact_name,
        artifact_html=artifact_html,
        runs=runs,
        may_decide=bool(roles & {Role.APPROVER, Role.ADMIN}),
    )


@_change
async def _task_approve(
    request: web.Request, session: Session, form: dict[str, str]
) -> web.Response:
    view = request.app[_VIEW]
    name = request.match_info["name"]
    said = await view.actions.approve(
        view.roles(session.user_id), session.user_id, name, form.get("sha256", "")
    )
    return _back(request, session, f"/tasks/{name}", said.message)


@_change
async def _task_reject(
    request: web.Request, session: Session, form: dict[str, str]
) -> web.Response:
    view = request.app[_VIEW]
    name = request.match_info["name"]
    said = await view.actions.reject(
        view.roles(session.user_id),
        session.user_id,
        name,
        form.get("sha256", ""),
        form.get("reason", ""),
    )
    return _back(request, session, f"/tasks/{name}", said.message)


# -- for whoever runs it ---------------------------------------------------------------


async def _metrics(request: web.Request) -> web.Response:
    view = request.app[_VIEW]
    token = view.settings.metrics_token
    if token is None or not metrics_token_ok(
        request.headers.get("Authorization"), token.get_secret_value()
    ):
        raise web.HTTPUnauthorized(text="metrics need their bearer token")
    body, content_type = await metrics_text(view.db)
    response = web.Response(body=body)
    response.headers["Content-Type"] = content_type
    return response


async def _diff_css(request: web.Request) -> web.Response:
    return web.Response(text=diff_css() + "\n" + code_css(), content_type="text/css")


@contextlib.asynccontextmanager
async def serving(view: WebView, host: str, port: int) -> AsyncIterator[web.AppRunner]:
    """The web view served on ``host:port`` for the block's time."""
    runner = web.AppRunner(make_app(view), access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        _LOGGER.info("web view on http://%s:%s", host, port)
        yield runner
    finally:
        await runner.cleanup()
