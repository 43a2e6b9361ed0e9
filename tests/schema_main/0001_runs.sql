-- Runs (a chat session, an auto-mode run, an autopilot drive) and their turns.
CREATE TABLE runs (
    id TEXT PRIMARY KEY,
    mode TEXT NOT NULL,
    agent TEXT NOT NULL,
    session_id TEXT NOT NULL,
    status TEXT NOT NULL,
    phase TEXT,
    turn INTEGER NOT NULL DEFAULT 0,
    objective TEXT,
    workdir TEXT,
    log_dir TEXT,
    chat_id INTEGER,
    thread_id INTEGER,
    task TEXT,
    state_json TEXT NOT NULL DEFAULT '{}',
    exit_code INTEGER,
    abort_reason TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    finished_at REAL
);
CREATE INDEX runs_status ON runs (status);
CREATE INDEX runs_chat ON runs (chat_id, thread_id);
CREATE TABLE turns (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL REFERENCES runs (id),
    seq INTEGER NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 1,
    phase TEXT,
    prompt TEXT NOT NULL,
    output TEXT,
    output_spill TEXT,
    output_size INTEGER,
    exit_code INTEGER,
    state TEXT NOT NULL,
    error TEXT,
    started_at REAL NOT NULL,
    finished_at REAL,
    UNIQUE (run_id, seq, attempt)
);
CREATE INDEX turns_state ON turns (state);
