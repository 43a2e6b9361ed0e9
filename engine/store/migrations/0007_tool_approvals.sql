-- Tool approvals: one row per permission request an agent CLI made during a turn (the
-- MCP permission server writes it; a front end shows it and records the decision).
-- state: pending, allowed, denied, cancelled. The row is the audit trail of the decision.
CREATE TABLE tool_requests (
    id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL,
    tool TEXT NOT NULL,
    input_json TEXT NOT NULL,
    tool_use_id TEXT,
    starter_id BIGINT,
    state TEXT NOT NULL DEFAULT 'pending',
    scope TEXT,
    decided_by BIGINT,
    reason TEXT,
    posted_at DOUBLE PRECISION,
    created_at DOUBLE PRECISION NOT NULL,
    decided_at DOUBLE PRECISION
);
CREATE INDEX tool_requests_state ON tool_requests (state, posted_at);
CREATE INDEX tool_requests_run ON tool_requests (run_id, state);
-- "Allow for this session": remembered per run and tool, and for Bash per command prefix
-- (an empty prefix: the whole tool).
CREATE TABLE tool_grants (
    run_id TEXT NOT NULL,
    tool TEXT NOT NULL,
    prefix TEXT NOT NULL,
    granted_by BIGINT,
    request_id INTEGER,
    created_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (run_id, tool, prefix)
);
