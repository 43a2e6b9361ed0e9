"""Per-tool-call approvals: an agent CLI asks, a person decides from a chat or a terminal.

``policy`` says what asks and how a request reads; ``store`` holds requests, decisions
and session grants; ``route`` wires a CLI to the permission server (``mcp_server``);
``watcher`` hands new requests to a front end; ``questions`` holds what agents ask people.
"""

from engine.approvals.policy import (
    ApprovalPolicy,
    Decision,
    Scope,
    command_prefix,
    describe_key,
    grant_key,
    summarize,
)
from engine.approvals.questions import AgentQuestion, QuestionState, QuestionStore
from engine.approvals.route import ASK_TOOL, PERMISSION_TOOL, ApprovalRoute, claude_approval_args
from engine.approvals.store import ApprovalStore, DecideResult, SqliteApprovalStore, ToolRequest
from engine.approvals.watcher import ApprovalWatcher

__all__ = [
    "ASK_TOOL",
    "PERMISSION_TOOL",
    "AgentQuestion",
    "ApprovalPolicy",
    "ApprovalRoute",
    "ApprovalStore",
    "ApprovalWatcher",
    "DecideResult",
    "Decision",
    "QuestionState",
    "QuestionStore",
    "Scope",
    "SqliteApprovalStore",
    "ToolRequest",
    "claude_approval_args",
    "command_prefix",
    "describe_key",
    "grant_key",
    "summarize",
]
