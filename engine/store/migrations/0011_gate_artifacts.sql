-- Gate artifacts, content-addressed: one row per distinct content, keyed by its SHA-256
-- (hex), however many gates and approvals show it. A gate's gate_sha256 names its row, so
-- the bot posts the artifact from here, not from a task folder on another machine's disk.
CREATE TABLE gate_artifacts (
    sha256 TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    content BLOB NOT NULL,
    created_at REAL NOT NULL
);
