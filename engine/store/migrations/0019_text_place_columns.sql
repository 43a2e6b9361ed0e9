-- A place's ids are text on SQLite too: its columns are declared TEXT, so an id such as
-- '007' is kept as written instead of read back as the number 7 (PostgreSQL's became TEXT
-- in 0018). SQLite cannot change a column's type: each table is made again with TEXT
-- place columns, its rows copied (the numbers stored before become their text), the old
-- one dropped and the new one given its name and indexes. A topic of 0 (no topic, as code
-- before wrote it; read as none) becomes NULL, so it still reads as none. A table counting its ids
-- (AUTOINCREMENT) goes on counting from where it was, not from its highest row left.
-- A turn names its run by a foreign key, and a migration runs in a transaction, where
-- SQLite cannot stop checking them: a table something points at cannot be dropped with
-- rows pointing at it, so the turns are made again too, pointing at the new runs table
-- (renaming that table renames what points at it).
-- only on sqlite
CREATE TABLE runs_text (
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
    chat_id TEXT,
    thread_id TEXT,
    task TEXT,
    state_json TEXT NOT NULL DEFAULT '{}',
    exit_code INTEGER,
    abort_reason TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    finished_at REAL,
    parent_id TEXT
);
-- only on sqlite
INSERT INTO runs_text (id, mode, agent, session_id, status, phase, turn, objective, workdir,
    log_dir, chat_id, thread_id, task, state_json, exit_code, abort_reason, created_at,
    updated_at, finished_at, parent_id)
SELECT id, mode, agent, session_id, status, phase, turn, objective, workdir,
    log_dir, chat_id, NULLIF(thread_id, 0), task, state_json, exit_code, abort_reason,
    created_at, updated_at, finished_at, parent_id
FROM runs;
-- only on sqlite
CREATE TABLE turns_text (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL REFERENCES runs_text (id),
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
    proc_pgid INTEGER,
    proc_start TEXT,
    proc_marker TEXT,
    stderr_tail TEXT,
    cost_usd REAL,
    tokens_input INTEGER,
    tokens_output INTEGER,
    tokens_cache_read INTEGER,
    tokens_cache_write INTEGER,
    UNIQUE (run_id, seq, attempt)
);
-- only on sqlite
INSERT INTO sqlite_sequence (name, seq) SELECT 'turns_text', seq FROM sqlite_sequence
WHERE name = 'turns';
-- only on sqlite
INSERT INTO turns_text (id, run_id, seq, attempt, phase, prompt, output, output_spill,
    output_size, exit_code, state, error, started_at, finished_at, proc_pgid, proc_start,
    proc_marker, stderr_tail, cost_usd, tokens_input, tokens_output, tokens_cache_read,
    tokens_cache_write)
SELECT id, run_id, seq, attempt, phase, prompt, output, output_spill,
    output_size, exit_code, state, error, started_at, finished_at, proc_pgid, proc_start,
    proc_marker, stderr_tail, cost_usd, tokens_input, tokens_output, tokens_cache_read,
    tokens_cache_write
FROM turns;
-- only on sqlite
DROP TABLE turns;
-- only on sqlite
DROP TABLE runs;
-- only on sqlite
ALTER TABLE runs_text RENAME TO runs;
-- only on sqlite
ALTER TABLE turns_text RENAME TO turns;
-- only on sqlite
CREATE INDEX runs_status ON runs (status);
-- only on sqlite
CREATE INDEX runs_chat ON runs (chat_id, thread_id);
-- only on sqlite
CREATE INDEX turns_state ON turns (state);
-- only on sqlite
CREATE TABLE gate_approvals_text (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    task TEXT NOT NULL REFERENCES gate_tasks (name),
    phase TEXT NOT NULL,
    gate_round INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    approver TEXT NOT NULL,
    chat_id TEXT,
    update_id INTEGER,
    at REAL NOT NULL,
    UNIQUE (task, phase, gate_round, sha256, approver)
);
-- only on sqlite
INSERT INTO sqlite_sequence (name, seq) SELECT 'gate_approvals_text', seq FROM sqlite_sequence
WHERE name = 'gate_approvals';
-- only on sqlite
INSERT INTO gate_approvals_text (id, task, phase, gate_round, sha256, approver, chat_id,
    update_id, at)
SELECT id, task, phase, gate_round, sha256, approver, chat_id, update_id, at
FROM gate_approvals;
-- only on sqlite
DROP TABLE gate_approvals;
-- only on sqlite
ALTER TABLE gate_approvals_text RENAME TO gate_approvals;
-- only on sqlite
CREATE TABLE audit_log_text (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    task TEXT,
    phase TEXT,
    event TEXT NOT NULL,
    outcome TEXT NOT NULL,
    actor TEXT,
    chat_id TEXT,
    update_id INTEGER,
    sha256 TEXT,
    detail TEXT,
    origin TEXT NOT NULL DEFAULT 'gates'
);
-- only on sqlite
INSERT INTO sqlite_sequence (name, seq) SELECT 'audit_log_text', seq FROM sqlite_sequence
WHERE name = 'audit_log';
-- only on sqlite
INSERT INTO audit_log_text (id, at, task, phase, event, outcome, actor, chat_id, update_id,
    sha256, detail, origin)
SELECT id, at, task, phase, event, outcome, actor, chat_id, update_id, sha256, detail, origin
FROM audit_log;
-- only on sqlite
DROP TABLE audit_log;
-- only on sqlite
ALTER TABLE audit_log_text RENAME TO audit_log;
-- only on sqlite
CREATE INDEX audit_log_task ON audit_log (task, id);
-- only on sqlite
CREATE INDEX audit_log_origin ON audit_log (origin, id);
