"""Per-tool-call approvals: an agent CLI asks, a person decides from a chat or a terminal.

``policy`` says what asks and how a request reads; ``store`` holds requests, decisions
and session grants; ``route`` wires a CLI to the permission server (``mcp_server``);
``watcher`` hands new requests to a front end.
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
from engine.approvals.route import PERMISSION_TOOL, ApprovalRoute, claude_approval_args
from engine.approvals.store import ApprovalStore, DecideResult, SqliteApprovalStore, ToolRequest
from engine.approvals.watcher import ApprovalWatcher

__all__ = [
    "PERMISSION_TOOL",
    "ApprovalPolicy",
    "ApprovalRoute",
    "ApprovalStore",
    "ApprovalWatcher",
    "DecideResult",
    "Decision",
    "Scope",
    "SqliteApprovalStore",
    "ToolRequest",
    "claude_approval_args",
    "command_prefix",
    "describe_key",
    "grant_key",
    "summarize",
]
