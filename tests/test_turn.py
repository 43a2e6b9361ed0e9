"""The driver loop's guarantees (seed 001): each has a test that fails if it breaks."""

from __future__ import annotations

import asyncio

import pytest

from engine import turn
from engine.testing import QueueChannel, RecordingChannel, ScriptedSession
from engine.turn import (
    BaseChannel,
    ChannelId,
    ChannelPublishError,
    ChannelRecvError,
    Closed,
    Idle,
    NextPrompt,
    Ready,
    TurnExecError,
    TurnOutput,
    run_session_loop,
)
from tests.support import wait_until


def test_public_names_match_all() -> None:
    expected = {
        "AgentSession", "Channel", "BaseChannel", "ChannelId", "NextPrompt", "Ready", "Idle",
        "Closed", "TurnOutput", "TurnError", "TurnExecError", "TurnIOError", "TurnPreempted",
        "ChannelError", "ChannelRecvError", "ChannelPublishError",
        "run_session_loop",
    }  # fmt: skip
    assert expected <= set(turn.__all__)
    for name in turn.__all__:
        assert hasattr(turn, name), name


def test_turn_output_contract() -> None:
    out = TurnOutput.from_text("  verbatim\n\ttext ")
    assert out.text == "  verbatim\n\ttext "
    assert out.exit_code is None
    coded = out.with_exit_code(3)
    assert coded.exit_code == 3
    assert out.exit_code is None  # immutable: a new value was returned
    assert coded.with_exit_code(0).with_exit_code(7).exit_code == 7  # last write wins
    assert coded.text == out.text
    with pytest.raises(AttributeError):
        out.text = "x"  # type: ignore[misc]


def test_next_prompt_is_matchable() -> None:
    def kind(value: NextPrompt) -> str:
        match value:
            case Ready(prompt=p):
                return f"ready:{p}"
            case Idle():
                return "idle"
            case Closed():
                return "closed"
        return "?"  # pragma: no cover

    assert [kind(Ready("a")), kind(Idle()), kind(Closed())] == ["ready:a", "idle", "closed"]


def test_channel_id_renders_stable_string() -> None:
    assert str(ChannelId("chat:42")) == "chat:42"
    assert ChannelId("a") == ChannelId("a")


async def test_prompts_run_in_order_and_publish_follows_each_run() -> None:
    session = ScriptedSession(session_id="s-1")
    channel = RecordingChannel(["hello", "world"])
    await run_session_loop(session, channel)
    assert session.prompts == ["hello", "world"]
    assert [o.text for o in channel.published] == ["echo: hello", "echo: world"]
    # Each turn is run and published before the next prompt is requested.
    assert channel.events == [
        ("next", 1),
        ("publish", "echo: hello"),
        ("next", 2),
        ("publish", "echo: world"),
        ("next", 3),
    ]


async def test_same_session_reused_every_turn() -> None:
    ids: list[str] = []

    class Recording(ScriptedSession):
        async def run_turn(self, prompt: str) -> TurnOutput:
            ids.append(self.session_id)
            return await super().run_turn(prompt)

    session = Recording(session_id="pinned")
    await run_session_loop(session, RecordingChannel(["a", "b", "c"]))
    assert ids == ["pinned", "pinned", "pinned"]


async def test_publish_happens_after_turn_completes() -> None:
    finished = asyncio.Event()
    order: list[str] = []

    class Slow(ScriptedSession):
        async def run_turn(self, prompt: str) -> TurnOutput:
            await asyncio.sleep(0)
            order.append("run-done")
            finished.set()
            return TurnOutput.from_text(prompt)

    class Checking(RecordingChannel):
        async def publish_output(self, out: TurnOutput) -> None:
            assert finished.is_set()
            order.append("publish")
            await super().publish_output(out)

    await run_session_loop(Slow(), Checking(["x"]))
    assert order == ["run-done", "publish"]


async def test_idle_waits_without_spinning_and_wakes_at_once() -> None:
    session = ScriptedSession()
    channel = QueueChannel()
    loop_task = asyncio.create_task(run_session_loop(session, channel), name="loop")
    # Let the loop reach its idle wait, then give it plenty of chances to spin.
    for _ in range(200):
        await asyncio.sleep(0)
    assert channel.polls == 1
    assert channel.idle_polls == 1
    channel.push("wake")
    await asyncio.wait_for(channel.published_event.wait(), timeout=5)
    assert session.prompts == ["wake"]
    # Back to idle after the turn: exactly one more idle poll, still no spinning.
    for _ in range(200):
        await asyncio.sleep(0)
    assert channel.idle_polls == 2
    channel.close()
    await asyncio.wait_for(loop_task, timeout=5)
    assert channel.polls == 4


async def test_idle_wait_has_no_timeout() -> None:
    channel = QueueChannel()
    loop_task = asyncio.create_task(run_session_loop(ScriptedSession(), channel), name="loop")
    await wait_until(lambda: channel.idle_polls == 1, timeout=5, interval=0)
    # Waiting for the loop to end, which it must not: an idle wait with a timeout would
    # end it or poll again within this span.
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.shield(loop_task), 0.3)
    assert not loop_task.done()
    assert channel.polls == 1
    channel.close()
    await asyncio.wait_for(loop_task, timeout=5)


async def test_closed_returns_cleanly_without_running_anything() -> None:
    session = ScriptedSession()
    channel = RecordingChannel([])
    await run_session_loop(session, channel)
    assert session.prompts == []
    assert channel.published == []
    assert channel.polls == 1


async def test_turn_error_propagates_and_nothing_runs_after() -> None:
    error = TurnExecError("spawn failed", binary="agent")
    session = ScriptedSession(["first", error, "never"])
    channel = RecordingChannel(["a", "b", "c"])
    with pytest.raises(TurnExecError) as caught:
        await run_session_loop(session, channel)
    assert caught.value is error
    assert session.prompts == ["a", "b"]
    assert [o.text for o in channel.published] == ["first"]
    assert channel.polls == 2


async def test_publish_error_propagates_and_nothing_runs_after() -> None:
    error = ChannelPublishError("chat unreachable")
    session = ScriptedSession()
    channel = RecordingChannel(["a", "b"], publish_error=error)
    with pytest.raises(ChannelPublishError) as caught:
        await run_session_loop(session, channel)
    assert caught.value is error
    assert session.prompts == ["a"]
    assert channel.polls == 1


async def test_recv_error_propagates() -> None:
    class Broken(BaseChannel):
        async def next_prompt(self) -> NextPrompt:
            raise ChannelRecvError("queue gone")

    session = ScriptedSession()
    with pytest.raises(ChannelRecvError, match="queue gone"):
        await run_session_loop(session, Broken("broken"))
    assert session.prompts == []


async def test_base_channel_publish_is_a_noop() -> None:
    class OneShot(BaseChannel):
        def __init__(self) -> None:
            super().__init__("one")
            self.sent = False

        async def next_prompt(self) -> NextPrompt:
            if self.sent:
                return Closed()
            self.sent = True
            return Ready("p")

    session = ScriptedSession()
    await run_session_loop(session, OneShot())
    assert session.prompts == ["p"]
