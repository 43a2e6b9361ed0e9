"""Redaction gaps an attack run found: credential names with a prefix, keys that Markdown
splits, entity URLs, credential values an agent inherits, turnstile's secret settings in
an agent's environment, and links that show one URL and open another."""

from __future__ import annotations

import io
import logging
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bot.render import render_markdown
from engine.agents.factory import create_agent
from engine.logs import setup_logging
from engine.redact import REDACTED, Redactor, redact
from engine.settings import Settings
from tests.fakes.bot_api import FakeBotApi
from tests.fakes.bot_harness import CHAT, OPERATOR, bot_settings, running_bot

pytestmark = pytest.mark.usefixtures("isolated_env")

KEY_BODY = "AbCdEfGh1234567890zyxwvuts"


def _utf16_slice(text: str, entity: dict[str, Any]) -> str:
    data = text.encode("utf-16-le")
    start = 2 * entity["offset"]
    return data[start : start + 2 * entity["length"]].decode("utf-16-le")


def _render(markdown: str, redactor: Redactor | None = None) -> tuple[str, list[dict[str, Any]]]:
    [msg] = render_markdown(markdown, redact=redactor or Redactor(), document_threshold=10_000)
    return msg.text, list(msg.entities)


@pytest.mark.parametrize(
    ("line", "name", "value"),
    [
        ("CODEX_API_KEY=cdx-4f9a8b7c6d5e", "CODEX_API_KEY", "cdx-4f9a8b7c6d5e"),
        ("GH_TOKEN=opaque0987654321", "GH_TOKEN", "opaque0987654321"),
        ("DB_PASSWORD=correct-horse-battery", "DB_PASSWORD", "correct-horse-battery"),
        (
            "AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCY",
            "AWS_SECRET_ACCESS_KEY",
            "wJalrXUtnFEMI/K7MDENG/bPxRfiCY",
        ),
        ("export OPENAI_API_KEY='q1w2e3r4t5y6'", "OPENAI_API_KEY", "q1w2e3r4t5y6"),
        ('config = {"client_secret": "zxcvbnm12345"}', "client_secret", "zxcvbnm12345"),
        ("ANTHROPIC_AUTH_TOKEN: tok-998877665544", "ANTHROPIC_AUTH_TOKEN", "tok-998877665544"),
    ],
)
def test_credential_names_with_a_prefix_are_redacted(line: str, name: str, value: str) -> None:
    out = redact(line)
    assert value not in out
    assert value[:6] not in out
    assert REDACTED in out
    assert name in out  # the reader still learns which variable was hidden


@pytest.mark.parametrize(
    "line",
    ["input_tokens: 123456789", "max_tokens=4096000", "tokenizer: wordpiece", "secretary: Jane Q."],
)
def test_words_that_merely_contain_a_credential_word_are_kept(line: str) -> None:
    assert redact(line) == line


@pytest.mark.parametrize(
    "markdown",
    [
        f"the key is sk-ant-api03-*{KEY_BODY}* and **bold** after",
        f"the key is sk\\-ant\\-api03\\-{KEY_BODY} and **bold** after",
        f"the key is sk-ant-api03-`{KEY_BODY}` and **bold** after",
    ],
)
def test_a_key_that_markdown_splits_is_redacted_in_the_sent_text(markdown: str) -> None:
    text, entities = _render(markdown)
    assert KEY_BODY not in text
    assert KEY_BODY[:8] not in text
    assert "sk-ant" not in text
    assert REDACTED in text
    # the entities still point at the right words after the text got shorter
    bold = [e for e in entities if e["type"] == "bold"]
    assert [_utf16_slice(text, e) for e in bold] == ["bold"]


@pytest.mark.parametrize(
    "markdown",
    [
        f"the key is sk-ant-api03-*{KEY_BODY}* ok",
        f"the key is sk\\-ant\\-api03\\-{KEY_BODY} ok",
        f"the key is ghp_*{KEY_BODY}1234* ok",
    ],
)
def test_a_split_key_is_hidden_in_raw_text_too(markdown: str) -> None:
    """Long outputs go out as the raw Markdown document; plain messages are raw too."""
    [doc] = render_markdown(markdown, redact=Redactor(), document_threshold=10)
    assert doc.document is not None
    assert KEY_BODY[:8] not in doc.document
    assert KEY_BODY[:8] not in doc.text
    assert KEY_BODY[:8] not in redact(markdown)


def test_entities_follow_redactions_before_them_in_utf16() -> None:
    markdown = f"🎉 **GH_TOKEN**=opaque0987654321 then sk-ant-api03-*{KEY_BODY}* 🎉 *tail*"
    text, entities = _render(markdown)
    assert "opaque" not in text
    assert KEY_BODY not in text
    shown = {e["type"]: _utf16_slice(text, e) for e in entities if e["type"] == "bold"}
    assert shown == {"bold": "GH_TOKEN"}
    italics = [_utf16_slice(text, e) for e in entities if e["type"] == "italic"]
    assert italics[-1] == "tail"


def test_entity_urls_and_code_languages_are_redacted() -> None:
    markdown = (
        f"[the report](https://reports.example/x?key=sk-ant-api03-{KEY_BODY})\n\n"
        f"```sk-proj-{KEY_BODY}\nprint(1)\n```\n"
        "[repo](https://deploy:Hunter2Hunter2@git.example/r.git)"
    )
    _, entities = _render(markdown)
    for entity in entities:
        for field in ("url", "language"):
            value = str(entity.get(field, ""))
            assert KEY_BODY not in value
            assert "Hunter2" not in value
    assert any(REDACTED in str(e.get("url", "")) for e in entities)


def test_exact_secrets_are_hidden_even_when_markdown_would_split_them() -> None:
    redactor = Redactor(["p*ss*phrase-42x"])
    text, _ = _render("the password p*ss*phrase-42x is set", redactor)
    assert "phrase-42x" not in text
    assert REDACTED in text


def test_redaction_passes_give_the_same_text_as_the_redactor() -> None:
    from engine.redact import apply_edits

    redactor = Redactor(["exact-secret-value"])
    text = (
        "a exact-secret-value b GH_TOKEN=opaque0987654321 c sk-ant-api03-abcdefghijkl "
        "d https://u:pw123456@h.example/x e 🎉 DB_PASSWORD: hunter22hunter"
    )
    current = text
    for edits in redactor.passes(text):
        current = apply_edits(current, edits)
    assert current == redactor(text)
    assert current.count(REDACTED) == 5


def test_settings_know_every_credential_an_agent_inherits() -> None:
    environ = {
        "MY_SERVICE_TOKEN": "opaque-no-shape-1",
        "CODEX_API_KEY": "also-no-shape-22",
        "PATH": "/usr/bin:/bin",
        "HOME": "/home/someone",
        "SHORT_TOKEN": "1",
    }
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None,
        telegram_token="123456:token-value-abcdef",
        projects="web=https://deployer:pr0ject-pass-9@git.example/web.git",
    )
    secrets = settings.secret_values(environ)
    assert "opaque-no-shape-1" in secrets
    assert "also-no-shape-22" in secrets
    assert "pr0ject-pass-9" in secrets
    assert "123456:token-value-abcdef" in secrets
    assert "/usr/bin:/bin" not in secrets
    assert "/home/someone" not in secrets
    assert "1" not in secrets
    redactor = Redactor(secrets)
    assert redactor("printed: opaque-no-shape-1 and pr0ject-pass-9") == (
        f"printed: {REDACTED} and {REDACTED}"
    )


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level, hook = root.handlers[:], root.level, sys.excepthook
    yield
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    sys.excepthook = hook


def test_the_debug_log_hides_inherited_credentials(restore_logging: None) -> None:
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    stream = io.StringIO()
    setup_logging(
        level="DEBUG",
        stream=stream,
        secrets=settings.secret_values({"MY_SERVICE_TOKEN": "opaque-no-shape-1"}),
        capture_uncaught=False,
    )
    log = logging.getLogger("turnstile.test")
    log.debug("agent said %s", "value opaque-no-shape-1")
    log.debug("agent said GH_TOKEN=ghx0987654321 AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMIK7MD")
    lines = stream.getvalue()
    assert "opaque-no-shape-1" not in lines
    assert "ghx0987654321" not in lines
    assert "wJalrXUtnFEMIK7MD" not in lines
    assert lines.count(REDACTED) == 3


@pytest.mark.parametrize("agent", ["command", "claude", "copilot", "codex"])
def test_secret_settings_never_reach_an_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, agent: str
) -> None:
    monkeypatch.setenv("TURNSTILE_PROJECTS", "web=https://deployer:pr0ject-pass-9@git.example/w")
    monkeypatch.setenv("TURNSTILE_TELEGRAM_TOKEN", "123456:token-value-abcdefabcdefabcdefabcdef")
    monkeypatch.setenv("TURNSTILE_SOMETHING_TOKEN", "opaque-no-shape-1")
    monkeypatch.setenv("TURNSTILE_DATABASE", "postgresql://bot:db-pass-1234@db.example/turnstile")
    monkeypatch.setenv("TURNSTILE_TASKS_ROOT", str(tmp_path / "tasks"))
    monkeypatch.setenv("GH_TOKEN", "an-agent-needs-this-1")
    fake_cli = tmp_path / "fake-cli"
    fake_cli.write_text("#!/bin/sh\n")
    fake_cli.chmod(0o755)
    bins = {f"{name}_bin": str(fake_cli) for name in ("claude", "copilot", "codex")}
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None, agent_command=f"{fake_cli} {{prompt}}", database=tmp_path / "t.db", **bins
    )
    session = create_agent(agent, settings, cwd=tmp_path)
    env = session.environment(session.build_invocation("hello"))
    for name in (
        "TURNSTILE_PROJECTS",
        "TURNSTILE_TELEGRAM_TOKEN",
        "TURNSTILE_SOMETHING_TOKEN",
        "TURNSTILE_DATABASE",  # a database URL with a password
        "TURNSTILE_TASKS_ROOT",  # not even turnstile's plain folders: no setting at all
    ):
        assert name not in env, name
    assert not [k for k in env if k.startswith("TURNSTILE_")]
    # what an agent may use: its own credentials
    assert env["GH_TOKEN"] == "an-agent-needs-this-1"


@pytest.mark.parametrize(
    ("markdown", "shown"),
    [
        ("see [https://a.example](https://b.example) now", "https://b.example"),
        ("see [a.example](https://b.example/login) now", "https://b.example/login"),
        (
            "see [github.com/acme/web](https://github.com/evil/web) now",
            "https://github.com/evil/web",
        ),
        (
            "see [https://a.example](https://a.example@b.example/) now",
            "https://a.example@b.example/",
        ),
        ("see [аpple.com](https://b.example) now", "https://b.example"),  # Cyrillic "а"
        ("see [go to https://a.example](https://b.example) now", "https://b.example"),
    ],
)
def test_a_link_that_shows_another_url_is_shown_as_its_target(markdown: str, shown: str) -> None:
    text, entities = _render(markdown + " **end**")
    assert text == f"see {shown} now end"
    links = [e for e in entities if e["type"] in ("text_link", "url")]
    assert len(links) == 1
    assert _utf16_slice(text, links[0]) == shown
    assert links[0].get("url", shown) == shown
    [bold] = [e for e in entities if e["type"] == "bold"]
    assert _utf16_slice(text, bold) == "end"


@pytest.mark.parametrize(
    "markdown",
    [
        "[the docs](https://b.example/docs)",
        "[https://b.example](https://b.example/)",
        "[b.example](https://b.example/docs)",
        "[www.b.example](https://b.example)",
    ],
)
def test_an_honest_link_keeps_its_text(markdown: str) -> None:
    label = markdown[1 : markdown.index("]")]
    text, entities = _render(markdown)
    assert text == label
    assert [e["type"] for e in entities] == ["text_link"]


AGENT = textwrap.dedent(
    """
    import os
    print(f"CODEX_API_KEY={os.environ['CODEX_API_KEY']}")
    print(f"GH_TOKEN={os.environ['GH_TOKEN']}")
    print(f"DB_PASSWORD={os.environ['DB_PASSWORD']}")
    print(f"AWS_SECRET_ACCESS_KEY={os.environ['AWS_SECRET_ACCESS_KEY']}")
    print()
    print(f"the other key: sk-ant-api03-*{os.environ['KEY_BODY']}*")
    print()
    print(f"opaque: {os.environ['MY_SERVICE_CREDENTIAL']}")
    print()
    print("projects: " + os.environ.get("TURNSTILE_PROJECTS", "absent"))
    print()
    print("login at [https://a.example](https://b.example) **now**")
    """
)


@pytest.mark.timeout(120)
async def test_an_agent_printing_its_credentials_reaches_the_chat_redacted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = {
        "CODEX_API_KEY": "cdx-4f9a8b7c6d5e",
        "GH_TOKEN": "opaque0987654321",
        "DB_PASSWORD": "correct-horse-battery",
        "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMIK7MDENGbPxRfiCY",
        "KEY_BODY": KEY_BODY,
        "MY_SERVICE_CREDENTIAL": "no-shape-at-all-77",
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    api_settings: dict[str, Any] = {
        "agent_command": f"{sys.executable} {script} {{prompt}}",
        # Passed on as an operator would for an agent that needs them (CODEX_* and GH_TOKEN
        # are an agent's anyway): what it prints of them is redacted on its way out.
        "agent_env": ("FAKE_*", "DB_PASSWORD", "AWS_*", "KEY_BODY", "MY_SERVICE_CREDENTIAL"),
    }
    async with FakeBotApi() as api:
        settings = bot_settings(api, tmp_path, **api_settings)
        async with running_bot(api, settings):
            # set once the bot runs: the agents it starts inherit it, if nothing stops them
            monkeypatch.setenv(
                "TURNSTILE_PROJECTS", "web=https://deployer:pr0ject-pass@g.example/w"
            )
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="/chat")
            await api.wait_for_message(lambda m: "bound to a new command session" in m.text)
            api.push_message(chat_id=CHAT, user_id=OPERATOR, text="show me your environment")
            reply = await api.wait_for_message(lambda m: "projects:" in m.text)
    for value in values.values():
        assert value not in reply.text
        assert value[:8] not in reply.text
    assert "CODEX_API_KEY=" in reply.text
    assert "projects: absent" in reply.text
    assert "pr0ject-pass" not in reply.text
    assert "login at https://b.example now" in reply.text
    link = next(e for e in reply.entities if e["type"] in ("url", "text_link"))
    assert _utf16_slice(reply.text, link) == "https://b.example"
    assert link.get("url", "https://b.example") == "https://b.example"
    bold = next(e for e in reply.entities if e["type"] == "bold")
    assert _utf16_slice(reply.text, bold) == "now"
    # every call the bot made to the Bot API: no value anywhere
    everything = repr([c.params for c in api.calls])
    for value in values.values():
        assert value not in everything


@pytest.mark.parametrize(
    "markdown",
    [
        "see [README.md](README.md) now",
        "see [the file](./docs/a.md) now",
        "see [mail](mailto:a@b.example) now",
        "see [run](javascript:alert(1)) now",
    ],
)
def test_a_link_telegram_would_refuse_is_plain_text(markdown: str) -> None:
    label = markdown[markdown.index("[") + 1 : markdown.index("]")]
    text, entities = _render(markdown)
    assert text == f"see {label} now"
    assert not [e for e in entities if e["type"] == "text_link"]
