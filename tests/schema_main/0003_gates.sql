-- Gated tasks (seed 003): phase state with a compare-and-set version, an append-only
-- transition history, approvals bound to artifact hashes, and an append-only audit log.
CREATE TABLE gate_tasks (
    name TEXT PRIMARY KEY,
    folder TEXT NOT NULL,
    workdir TEXT NOT NULL,
    phase TEXT NOT NULL,
    sub_state TEXT,
    version INTEGER NOT NULL,
    parent TEXT,
    wave INTEGER,
    summary TEXT,
    started_by TEXT,
    gate_round INTEGER NOT NULL DEFAULT 0,
    gate_sha256 TEXT,
    gate_opened_at REAL,
    return_phase TEXT,
    revision_notes TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX gate_tasks_parent ON gate_tasks (parent, wave, name);
CREATE TABLE gate_transitions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    task TEXT NOT NULL REFERENCES gate_tasks (name),
    version INTEGER NOT NULL,
    kind TEXT NOT NULL,
    from_phase TEXT,
    from_sub TEXT,
    to_phase TEXT NOT NULL,
    to_sub TEXT,
    actor TEXT,
    reason TEXT,
    sha256 TEXT,
    git_fingerprint TEXT,
    at REAL NOT NULL,
    UNIQUE (task, version)
);
CREATE TABLE gate_approvals (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    task TEXT NOT NULL REFERENCES gate_tasks (name),
    phase TEXT NOT NULL,
    gate_round INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    approver TEXT NOT NULL,
    chat_id INTEGER,
    update_id INTEGER,
    at REAL NOT NULL,
    UNIQUE (task, phase, gate_round, sha256, approver)
);
CREATE TABLE gate_audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    task TEXT,
    phase TEXT,
    event TEXT NOT NULL,
    outcome TEXT NOT NULL,
    actor TEXT,
    chat_id INTEGER,
    update_id INTEGER,
    sha256 TEXT,
    detail TEXT
);
CREATE INDEX gate_audit_task ON gate_audit (task, id);
CREATE TABLE gate_sessions (
    task TEXT PRIMARY KEY REFERENCES gate_tasks (name),
    agent TEXT NOT NULL,
    session_id TEXT NOT NULL,
    started INTEGER NOT NULL DEFAULT 0,
    updated_at REAL NOT NULL
);
