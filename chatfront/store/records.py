"""The bot store's records: what its methods take and give back."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from engine.chats.records import Binding, PromptRow
from engine.runs.spec import PlaceId, place_id

__all__ = [
    "AuditEntry",
    "Binding",
    "GateRecord",
    "InboundState",
    "LiveMessage",
    "OutboxItem",
    "OutboxRow",
    "PromptRow",
    "ReasonRequest",
    "StoredRow",
    "binding_from_row",
    "prompt_from_row",
    "topic_key",
]


def topic_key(thread_id: PlaceId | None) -> str:
    """A topic where it is part of a key (a binding's, a queue's, a place's permissions):
    ``""`` for none. (SQLite hands a numeric id in these INTEGER columns back as a number:
    rows are read back through :func:`~engine.runs.spec.place_id`.)"""
    return thread_id or ""


class StoredRow(Protocol):
    """A row as either database gives it: by column name."""

    def __getitem__(self, key: str, /) -> Any: ...


class InboundState(StrEnum):
    RECEIVED = "received"
    HANDLED = "handled"
    IGNORED = "ignored"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class OutboxItem:
    """One message to deliver (before it is queued)."""

    chat_id: PlaceId
    body: str
    thread_id: PlaceId | None = None
    kind: str = "text"
    entities: tuple[dict[str, Any], ...] = ()
    filename: str | None = None
    caption: str | None = None
    markup: dict[str, Any] | None = None
    reply_to: int | None = None
    run_id: str | None = None
    ref: str | None = None


@dataclass(frozen=True, slots=True)
class OutboxRow:
    id: int
    item: OutboxItem
    attempts: int

    @classmethod
    def from_row(cls, row: StoredRow) -> OutboxRow:
        return cls(
            id=row["id"],
            attempts=row["attempts"],
            item=OutboxItem(
                chat_id=str(row["chat_id"]),
                thread_id=place_id(row["thread_id"]),
                kind=row["kind"],
                body=row["body"],
                entities=tuple(json.loads(row["entities_json"] or "[]")),
                filename=row["filename"],
                caption=row["caption"],
                markup=json.loads(row["markup_json"]) if row["markup_json"] else None,
                reply_to=row["reply_to"],
                run_id=row["run_id"],
                ref=row["ref"],
            ),
        )


@dataclass(frozen=True, slots=True)
class LiveMessage:
    """A message edited in place (a run's status, a gate)."""

    ref: str
    chat_id: PlaceId
    thread_id: PlaceId | None
    message_id: int | None
    body: str
    entities: tuple[dict[str, Any], ...]
    markup: dict[str, Any] | None
    dirty: bool
    edited_at: float | None
    #: Its due edit takes buttons away (a decided gate): sent before queued messages.
    urgent: bool = False

    @classmethod
    def from_row(cls, row: StoredRow) -> LiveMessage:
        return cls(
            ref=row["ref"],
            chat_id=str(row["chat_id"]),
            thread_id=place_id(row["thread_id"]),
            message_id=row["message_id"],
            body=row["body"],
            entities=tuple(json.loads(row["entities_json"] or "[]")),
            markup=json.loads(row["markup_json"]) if row["markup_json"] else None,
            dirty=bool(row["dirty"]),
            edited_at=row["edited_at"],
            urgent=row["dirty"] == 2,  # chatfront.store.outbox.URGENT
        )


def binding_from_row(row: StoredRow) -> Binding:
    return Binding(
        chat_id=str(row["chat_id"]),
        thread_id=place_id(row["thread_id"]),
        agent=row["agent"],
        project=row["project"],
        workdir=row["workdir"],
        session_id=row["session_id"],
        turns=row["turns"],
        run_id=row["run_id"],
        bound_by=row["bound_by"],
        model=row["model"],
    )


@dataclass(frozen=True, slots=True)
class ReasonRequest:
    """The bot asked a person for a rejection reason (after a Reject button press)."""

    gate_id: str
    prompt_ref: str | None
    created_at: float
    expired: bool = False


@dataclass(frozen=True, slots=True)
class GateRecord:
    gate_id: str
    task: str
    phase: str
    sha256: str
    artifact_name: str
    chat_id: PlaceId
    thread_id: PlaceId | None
    run_id: str | None
    state: str

    @classmethod
    def from_row(cls, row: StoredRow) -> GateRecord:
        return cls(
            gate_id=row["gate_id"],
            task=row["task"],
            phase=row["phase"],
            sha256=row["sha256"],
            artifact_name=row["artifact_name"],
            chat_id=str(row["chat_id"]),
            thread_id=place_id(row["thread_id"]),
            run_id=row["run_id"],
            state=row["state"],
        )


@dataclass(frozen=True, slots=True)
class AuditEntry:
    at: float
    user_id: int | None
    chat_id: PlaceId | None
    update_id: int | None
    action: str
    outcome: str
    reason: str | None


def prompt_from_row(row: StoredRow) -> PromptRow:
    return PromptRow(
        id=row["id"],
        chat_id=str(row["chat_id"]),
        thread_id=place_id(row["thread_id"]),
        update_id=row["update_id"],
        user_id=row["user_id"],
        body=row["body"],
        state=row["state"],
        run_id=row["run_id"],
        turn_id=row["turn_id"],
    )
