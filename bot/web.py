"""``/web``: the board in a browser or as a Telegram Mini App, served by the bot itself.

Off unless ``TURNSTILE_WEB_PORT`` is set. In a private chat ``/web`` answers with a button
that opens the Mini App and a one-time link for a desktop browser; in a group it says to
ask in private (a sign-in link is one person's). The web view decides gates and tool
requests with the chat's rules; this feature does what the chat shows of them and stops
runs the way ``/stop`` does.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING

from telegram import Update

from bot.context import BotContext
from bot.feature import Feature
from bot.handlers import Dispatch
from bot.places import chat_of
from chatfront.auth import Action
from engine.errors import NotFoundError

if TYPE_CHECKING:
    from bot.autopilot import AutopilotExtension
    from bot.tool_approvals import ToolApprovalExtension
    from engine.approvals.store import ToolRequest
    from engine.gates.records import ApprovalResult
    from webview.app import WebView

__all__ = ["WebFeature"]

_LOGGER = logging.getLogger(__name__)


class WebFeature(Feature):
    """Serves the web view and answers ``/web``.

    Args:
        owners: the features that own runs, asked in turn to stop one (as ``/stop`` does).
    """

    def __init__(
        self,
        ctx: BotContext,
        *,
        token: str,
        autopilot: AutopilotExtension,
        approvals: ToolApprovalExtension,
        owners: Sequence[Feature],
    ) -> None:
        self.ctx = ctx
        self.autopilot = autopilot
        self.approvals = approvals
        self.owners = tuple(owners)
        self._token = token
        self._view: WebView | None = None
        self._serving = AsyncExitStack()

    @property
    def view(self) -> WebView:
        """The web view (its pages, templates and libraries loaded only once it is on)."""
        if self._view is None:
            from engine.approvals.store import SqliteApprovalStore
            from webview.actions import WebActions
            from webview.app import WebView

            ctx = self.ctx
            store = SqliteApprovalStore(ctx.db)
            self._view = WebView(
                settings=ctx.settings,
                db=ctx.db,
                gates=ctx.gates,
                approvals=store,
                authorizer=ctx.authorizer,
                actions=WebActions(
                    ctx.db,
                    ctx.gates,
                    store,
                    _ChatHooks(self),
                    forbid_self_approval=ctx.settings.forbid_self_approval,
                ),
                bot_token=self._token,
                names=ctx.publisher.people.name,
            )
        return self._view

    @property
    def enabled(self) -> bool:
        return self.ctx.settings.web_port is not None

    def _base(self) -> str:
        settings = self.ctx.settings
        if settings.web_url:
            return settings.web_url.rstrip("/")
        return f"http://{settings.web_listen}:{settings.web_port}"

    def register(self, dispatch: Dispatch) -> None:
        dispatch.command("web", Action.HELP, self.cmd_web)

    async def start(self) -> None:
        """Start serving (when a port is set)."""
        settings = self.ctx.settings
        if settings.web_port is None:
            return
        from webview.app import serving

        await self._serving.enter_async_context(
            serving(self.view, settings.web_listen, settings.web_port)
        )

    async def shutdown(self, *, park: bool, preempt: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop serving (open pages lose their live updates)."""
        with contextlib.suppress(Exception):
            await self._serving.aclose()

    async def cmd_web(self, update: Update, args: list[str]) -> None:
        chat = update.effective_chat
        user = update.effective_user
        assert chat is not None
        assert user is not None
        if not self.enabled:
            await self.ctx.replies.reply(
                update,
                "The web view is off here. An admin turns it on with TURNSTILE_WEB_PORT "
                "(and TURNSTILE_WEB_URL, its public address).",
            )
            return
        if chat.type != "private":
            await self.ctx.replies.reply(
                update, "Send /web to me in a private chat: a sign-in link is yours alone."
            )
            return
        token = await self.view.links.issue(user.id)
        minutes = self.ctx.settings.web_link_minutes
        base = self._base()
        markup = None
        if base.startswith("https://"):
            # Telegram opens a Mini App only from an HTTPS address.
            markup = {
                "inline_keyboard": [
                    [{"text": "Open the board", "web_app": {"url": f"{base}/signin"}}]
                ]
            }
        await self.ctx.replies.reply(
            update,
            "🗂 The board of runs and tasks."
            + (" Tap the button to open it here, or open" if markup else " Open")
            + f" this link in a browser (it works once, for {minutes:g} minutes):\n"
            f"{base}/signin/link/{token}",
            markup=markup,
        )
        await self.ctx.store.audit(
            action="web_link",
            outcome="issued",
            user_id=user.id,
            chat_id=chat_of(chat),
            update_id=update.update_id,
        )


class _ChatHooks:
    """What the web view asks of the chat (:class:`webview.actions.WebHooks`)."""

    def __init__(self, feature: WebFeature) -> None:
        self._feature = feature

    async def gate_decided(self, task: str, result: ApprovalResult, user_id: int) -> None:
        await self._feature.autopilot.decided_on_web(task, result, user_id)

    async def tool_decided(self, request: ToolRequest) -> None:
        await self._feature.approvals.decided_elsewhere(request)

    async def stop(self, run_id: str, user_id: int) -> bool:
        """Stop a run of this bot's as ``/stop RUN`` does in its chat."""
        feature = self._feature
        try:
            run = await feature.ctx.runs.get_run(run_id)
        except NotFoundError:
            return False
        if run.chat_id is None:
            return False  # a terminal's run: `turnstile stop` stops it
        for owner in feature.owners:
            if await owner.stop(run_id, chat_id=run.chat_id, by=user_id):
                _LOGGER.info("run %s stopped from the web view by %s", run_id, user_id)
                return True
        return False
