-- Workspaces: one git worktree on its own branch per run and per wave sub-task.
CREATE TABLE workspaces (
    id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    project TEXT NOT NULL,
    path TEXT NOT NULL,
    branch TEXT NOT NULL,
    base TEXT NOT NULL,
    base_ref TEXT NOT NULL,
    parent_id TEXT,
    created_at REAL NOT NULL,
    released_at REAL,
    removed_at REAL,
    rescue_branch TEXT
);
CREATE INDEX workspaces_run ON workspaces (run_id);
CREATE INDEX workspaces_removed ON workspaces (removed_at);
