"""All settings, from the environment (prefix ``TURNSTILE_``) and a ``.env`` file."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import BeforeValidator, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from engine.errors import ConfigError
from engine.redact import credential_values
from engine.store.location import PostgresURL, parse_database

__all__ = ["SECRET_SETTINGS", "AgentName", "Settings", "load_settings"]

AgentName = Literal["claude", "copilot", "codex", "command"]
IdList = Annotated[tuple[int, ...], NoDecode]
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\*?")
# A SQLite file (the default) or a postgresql:// URL (its password never shown).
DatabaseTarget = Annotated[Path | PostgresURL, BeforeValidator(parse_database)]


class Settings(BaseSettings):
    """One settings object, built once by the composition root and passed down."""

    model_config = SettingsConfigDict(
        env_prefix="TURNSTILE_",
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        frozen=True,
        # ".env.example" leaves optional settings empty (NAME=): empty means "unset".
        env_ignore_empty=True,
    )

    # Telegram
    telegram_token: SecretStr | None = None
    telegram_base_url: str = "https://api.telegram.org/bot"
    telegram_base_file_url: str = "https://api.telegram.org/file/bot"
    webhook_url: str | None = None
    webhook_listen: str = "127.0.0.1"
    webhook_port: int = Field(default=8443, ge=1, le=65535)
    webhook_secret: SecretStr | None = None

    # The web view and Mini App (off unless a port is set)
    web_port: int | None = Field(default=None, ge=1, le=65535)
    web_listen: str = "127.0.0.1"
    # Its public base URL (HTTPS behind a reverse proxy for the Mini App)
    web_url: str | None = None
    web_link_minutes: float = Field(default=10.0, gt=0)
    web_session_hours: float = Field(default=12.0, gt=0)
    # Bearer token for /metrics (empty: /metrics answers nobody)
    metrics_token: SecretStr | None = None

    # Who may do what (numeric Telegram ids; empty admits nobody)
    allowed_chats: IdList = ()
    admins: IdList = ()
    approvers: IdList = ()
    operators: IdList = ()

    # Storage
    database: DatabaseTarget = Path("turnstile.db")
    tasks_root: Path = Path("tasks")
    workspaces: Path = Path("workspaces")
    # Projects: JSON or name=url#branch,... (URLs may hold credentials, hence secret)
    projects: SecretStr | None = None
    workspace_retention_hours: float = Field(default=72.0, ge=0)
    # Push a finished run's branch (turnstile/<run-id>) back to the repository its project
    # was checked out from (a configured project, or a path or URL given for the run)
    push_branches: bool = True
    runs_dir: Path = Path("runs")
    spill_limit: int = Field(default=1024 * 1024, ge=1024)

    # Where turns run: in this process, or as jobs on `turnstile worker` processes
    # (PostgreSQL only; engine/workers)
    execution: Literal["local", "workers"] = "local"
    # The repository run branches are pushed to after each turn (default: the project's own)
    runs_remote: str | None = None
    worker_heartbeat: float = Field(default=5.0, gt=0)
    worker_timeout: float = Field(default=30.0, gt=0)

    # Agents
    default_agent: AgentName = "claude"
    agent_command: str | None = None
    claude_bin: str = "claude"
    copilot_bin: str = "copilot"
    codex_bin: str = "codex"
    agent_model: str | None = None
    allowed_tools: Annotated[tuple[str, ...], NoDecode] = ()
    dangerous_tools: bool = False
    # Per-tool-call approval (engine.approvals.ApprovalPolicy): off, unlisted, all, or a
    # preset that judges each call: guarded, trusted, free
    tool_approval: Literal["off", "unlisted", "all", "guarded", "trusted", "free"] = "off"
    # The agent's walls (engine/sandbox.py, docs/security.md): every agent turn runs under
    # bubblewrap unless an operator turns it off; more paths to hide; its network.
    sandbox: Literal["on", "off"] = "on"
    sandbox_hide: Annotated[tuple[Path, ...], NoDecode] = ()
    sandbox_network: bool = True
    # Variables (names, or NAME* prefixes) agents get besides those their CLI needs.
    agent_env: Annotated[tuple[str, ...], NoDecode] = ()

    # Limits owned by channels (operator policy, never turn timeouts)
    max_concurrent_turns: int = Field(default=4, ge=1)
    queue_depth: int = Field(default=10, ge=0)
    # "Not allowed" answers waiting at once; beyond it a refusal is audited, not answered.
    refusal_backlog: int = Field(default=20, ge=0)
    max_inbound_chars: int = Field(default=16_000, ge=1)
    document_threshold: int = Field(default=12_000, ge=1)
    preempt_grace: float = Field(default=5.0, ge=0)
    wave_concurrency: int = Field(default=3, ge=1)
    # Warm sessions: keep one agent process per active session between turns (a memory
    # policy: "off", "on" or a comma list of agents; never a turn deadline)
    warm_sessions: Annotated[tuple[str, ...], NoDecode] = ()
    max_warm_sessions: int = Field(default=4, ge=1)
    warm_idle_minutes: float = Field(default=15.0, gt=0)
    # Bot: seconds between edits of live messages in a private chat (3x in a group), and
    # shutdown behaviour
    status_edit_interval: float = Field(default=1.0, ge=0)
    shutdown_turns: Literal["finish", "park"] = "finish"
    shutdown_flush_seconds: float = Field(default=30.0, ge=0)

    # Files and voice notes from and to chats (docs/telegram.md)
    uploads_dir: str = "uploads"
    upload_max_bytes: int = Field(default=20 * 1024 * 1024, ge=1)
    upload_refused_types: Annotated[tuple[str, ...], NoDecode] = (
        "application/x-msdownload",
        "application/x-dosexec",
        "application/vnd.microsoft.portable-executable",
        ".exe",
        ".dll",
        ".scr",
        ".msi",
        ".bat",
        ".cmd",
    )
    album_wait_seconds: float = Field(default=1.5, ge=0)
    send_max_bytes: int = Field(default=50 * 1024 * 1024, ge=1)
    transcription_url: str | None = None
    transcription_key: SecretStr | None = None
    transcription_model: str = "whisper-1"
    transcription_language: str | None = None
    transcription_timeout: float = Field(default=120.0, gt=0)

    # Gates
    approval_quorum: int = Field(default=1, ge=1)
    approval_expiry_seconds: float | None = None
    # Bot: how long a Reject button press waits for the reason (then nothing is rejected)
    reason_request_seconds: float = Field(default=300.0, gt=0)
    forbid_self_approval: bool = False
    workflow_file: Path | None = None
    # The largest artifact a gate stores in the database (bigger: refused at the gate)
    artifact_max_bytes: int = Field(default=16 * 1024 * 1024, ge=1)

    # Auto mode
    max_turns: int = Field(default=10, ge=1)
    # What a run may spend in USD unless it is given its own budget (empty: no cap)
    run_budget: float | None = Field(default=None, gt=0)
    # What the runs of one chat may spend in USD per day (empty: no cap)
    daily_budget: float | None = Field(default=None, gt=0)
    completion_threshold: float = Field(default=0.8, ge=0, le=1)
    auto_prompts_dir: Path | None = None

    # Logs
    log_format: Literal["text", "json"] = "text"
    log_level: str = "INFO"

    def secret_values(self, environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
        """Every value never to print, for a :class:`~engine.redact.Redactor`.

        The secret settings, the credential parts of the project URLs, and the values of
        the credential variables (``GH_TOKEN``, ``ANTHROPIC_API_KEY``...) in ``environ``
        (default: this process's environment, which the agents inherit).
        """
        # Imported here: reading settings must not load the workspace package (git, stores).
        from engine.workspace.projects import parse_projects

        values: list[str] = []
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, SecretStr) and value.get_secret_value():
                values.append(value.get_secret_value())
        if isinstance(self.database, PostgresURL) and self.database.password:
            values.append(self.database.password)
        if self.projects is not None:
            try:
                projects = parse_projects(self.projects.get_secret_value())
            except ConfigError:
                projects = ()  # reported where the projects are used; the whole text is above
            # A short part ("git", "user") would blank out a common word in every message.
            values.extend(s for p in projects for s in p.secrets() if len(s) >= 8)
        values.extend(credential_values(os.environ if environ is None else environ))
        return tuple(dict.fromkeys(values))

    @field_validator("allowed_chats", "admins", "approvers", "operators", mode="before")
    @classmethod
    def _split_ids(cls, value: object) -> object:
        if isinstance(value, str):
            parts = [p.strip() for p in value.replace(";", ",").split(",")]
            try:
                return tuple(int(p) for p in parts if p)
            except ValueError as exc:
                raise ValueError(f"expected numeric ids separated by commas: {value!r}") from exc
        if isinstance(value, int):
            return (value,)
        return value

    @field_validator("auto_prompts_dir", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        # An empty line copied from .env.example means "not set", not the current folder.
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("uploads_dir")
    @classmethod
    def _relative_folder(cls, value: str) -> str:
        parts = value.strip().strip("/").split("/")
        if value.strip().startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError("a folder name inside the run's folder, such as uploads")
        return "/".join(parts)

    @field_validator("sandbox_hide", mode="before")
    @classmethod
    def _split_paths(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(Path(p.strip()) for p in value.split(",") if p.strip())
        return value

    @field_validator("agent_env", mode="before")
    @classmethod
    def _split_names(cls, value: object) -> object:
        if isinstance(value, str):
            value = tuple(p.strip() for p in value.split(",") if p.strip())
        if isinstance(value, tuple):
            for name in value:
                if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
                    raise ValueError(f"expected variable names or NAME* prefixes; got {name!r}")
                if name.upper().startswith("TURNSTILE_"):
                    raise ValueError(f"turnstile's own settings never reach an agent: {name}")
        return value

    @field_validator("allowed_tools", "upload_refused_types", mode="before")
    @classmethod
    def _split_tools(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(p.strip() for p in value.split(",") if p.strip())
        return value

    @field_validator("warm_sessions", mode="before")
    @classmethod
    def _split_warm(cls, value: object) -> object:
        return _parse_warm(value)


_WARM_AGENTS = ("claude", "copilot", "codex", "command")


def _parse_warm(value: object) -> object:
    if not isinstance(value, str):
        return value
    parts = [p.strip().lower() for p in value.split(",") if p.strip()]
    if parts in ([], ["off"], ["false"], ["no"], ["0"]):
        return ()
    if parts in (["on"], ["true"], ["yes"], ["1"], ["all"]):
        return _WARM_AGENTS
    unknown = [p for p in parts if p not in _WARM_AGENTS]
    if unknown:
        raise ValueError(
            f"expected off, on or agent names ({', '.join(_WARM_AGENTS)}); got {', '.join(unknown)}"
        )
    return tuple(parts)


def _is_secret(annotation: object) -> bool:
    return annotation is SecretStr or SecretStr in get_args(annotation)


# The environment names of the secret settings (never passed on to an agent).
SECRET_SETTINGS: frozenset[str] = frozenset(
    "TURNSTILE_" + name.upper()
    for name, info in Settings.model_fields.items()
    if _is_secret(info.annotation)
)


def load_settings(**overrides: object) -> Settings:
    """Build settings from the environment, ``.env`` and ``overrides``.

    Raises:
        ConfigError: a setting is malformed; the message names it (never its value).
    """
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            name = "TURNSTILE_" + "_".join(str(p) for p in err["loc"]).upper()
            problems.append(f"{name}: {err['msg']}")
        raise ConfigError("invalid settings: " + "; ".join(problems)) from exc
