-- A place's ids are text on SQLite too: its columns are declared TEXT, so an id such as
-- '007' is kept as written instead of read back as the number 7 (PostgreSQL's became TEXT
-- in 0009). SQLite cannot change a column's type: each table is made again with TEXT
-- place columns, its rows copied (the numbers stored before become their text), the old
-- one dropped and the new one given its name and indexes. A table counting its ids
-- (AUTOINCREMENT) goes on counting from where it was, not from its highest row left.
-- No topic is '' where the topic is part of a key (0009 made it so), and a topic of 0
-- elsewhere (no topic, as code before wrote it; read as none) becomes NULL.
-- only on sqlite
CREATE TABLE bot_outbox_text (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    chat_id TEXT NOT NULL,
    thread_id TEXT,
    kind TEXT NOT NULL,
    body TEXT NOT NULL,
    entities_json TEXT,
    filename TEXT,
    caption TEXT,
    markup_json TEXT,
    reply_to INTEGER,
    run_id TEXT,
    ref TEXT,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    message_id INTEGER,
    error TEXT,
    created_at REAL NOT NULL,
    sent_at REAL,
    sending_since REAL
);
-- only on sqlite
INSERT INTO sqlite_sequence (name, seq) SELECT 'bot_outbox_text', seq FROM sqlite_sequence
WHERE name = 'bot_outbox';
-- only on sqlite
INSERT INTO bot_outbox_text (id, chat_id, thread_id, kind, body, entities_json, filename,
    caption, markup_json, reply_to, run_id, ref, state, attempts, message_id, error,
    created_at, sent_at, sending_since)
SELECT id, chat_id, NULLIF(thread_id, 0), kind, body, entities_json, filename,
    caption, markup_json, reply_to, run_id, ref, state, attempts, message_id, error,
    created_at, sent_at, sending_since
FROM bot_outbox;
-- only on sqlite
DROP TABLE bot_outbox;
-- only on sqlite
ALTER TABLE bot_outbox_text RENAME TO bot_outbox;
-- only on sqlite
CREATE INDEX bot_outbox_state ON bot_outbox (state, id);
-- only on sqlite
CREATE TABLE bot_live_text (
    ref TEXT PRIMARY KEY,
    chat_id TEXT NOT NULL,
    thread_id TEXT,
    message_id INTEGER,
    body TEXT NOT NULL,
    entities_json TEXT,
    markup_json TEXT,
    dirty INTEGER NOT NULL DEFAULT 0,
    updated_at REAL NOT NULL,
    edited_at REAL
);
-- only on sqlite
INSERT INTO bot_live_text (ref, chat_id, thread_id, message_id, body, entities_json,
    markup_json, dirty, updated_at, edited_at)
SELECT ref, chat_id, NULLIF(thread_id, 0), message_id, body, entities_json,
    markup_json, dirty, updated_at, edited_at
FROM bot_live;
-- only on sqlite
DROP TABLE bot_live;
-- only on sqlite
ALTER TABLE bot_live_text RENAME TO bot_live;
-- only on sqlite
CREATE TABLE bot_bindings_text (
    chat_id TEXT NOT NULL,
    thread_id TEXT NOT NULL DEFAULT '',
    agent TEXT NOT NULL,
    project TEXT NOT NULL,
    workdir TEXT NOT NULL,
    session_id TEXT NOT NULL,
    turns INTEGER NOT NULL DEFAULT 0,
    run_id TEXT,
    bound_by INTEGER,
    created_at REAL NOT NULL,
    model TEXT,
    PRIMARY KEY (chat_id, thread_id)
);
-- only on sqlite
INSERT INTO bot_bindings_text (chat_id, thread_id, agent, project, workdir, session_id,
    turns, run_id, bound_by, created_at, model)
SELECT chat_id, thread_id, agent, project, workdir, session_id,
    turns, run_id, bound_by, created_at, model
FROM bot_bindings;
-- only on sqlite
DROP TABLE bot_bindings;
-- only on sqlite
ALTER TABLE bot_bindings_text RENAME TO bot_bindings;
-- only on sqlite
CREATE TABLE bot_prompts_text (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    chat_id TEXT NOT NULL,
    thread_id TEXT NOT NULL DEFAULT '',
    update_id INTEGER UNIQUE,
    user_id INTEGER,
    body TEXT NOT NULL,
    state TEXT NOT NULL,
    run_id TEXT,
    turn_id INTEGER,
    created_at REAL NOT NULL,
    finished_at REAL
);
-- only on sqlite
INSERT INTO sqlite_sequence (name, seq) SELECT 'bot_prompts_text', seq FROM sqlite_sequence
WHERE name = 'bot_prompts';
-- only on sqlite
INSERT INTO bot_prompts_text (id, chat_id, thread_id, update_id, user_id, body, state,
    run_id, turn_id, created_at, finished_at)
SELECT id, chat_id, thread_id, update_id, user_id, body, state,
    run_id, turn_id, created_at, finished_at
FROM bot_prompts;
-- only on sqlite
DROP TABLE bot_prompts;
-- only on sqlite
ALTER TABLE bot_prompts_text RENAME TO bot_prompts;
-- only on sqlite
CREATE INDEX bot_prompts_queue ON bot_prompts (chat_id, thread_id, state, id);
-- only on sqlite
CREATE TABLE bot_gates_text (
    gate_id TEXT PRIMARY KEY,
    task TEXT NOT NULL,
    phase TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    artifact_name TEXT NOT NULL,
    chat_id TEXT NOT NULL,
    thread_id TEXT,
    run_id TEXT,
    state TEXT NOT NULL,
    decided_by INTEGER,
    created_at REAL NOT NULL,
    decided_at REAL
);
-- only on sqlite
INSERT INTO bot_gates_text (gate_id, task, phase, sha256, artifact_name, chat_id, thread_id,
    run_id, state, decided_by, created_at, decided_at)
SELECT gate_id, task, phase, sha256, artifact_name, chat_id, NULLIF(thread_id, 0),
    run_id, state, decided_by, created_at, decided_at
FROM bot_gates;
-- only on sqlite
DROP TABLE bot_gates;
-- only on sqlite
ALTER TABLE bot_gates_text RENAME TO bot_gates;
-- only on sqlite
CREATE INDEX bot_gates_task ON bot_gates (task, state);
-- only on sqlite
CREATE TABLE bot_reason_requests_text (
    chat_id TEXT NOT NULL,
    user_id INTEGER NOT NULL,
    gate_id TEXT NOT NULL,
    prompt_message_ref TEXT,
    created_at REAL NOT NULL,
    PRIMARY KEY (chat_id, user_id)
);
-- only on sqlite
INSERT INTO bot_reason_requests_text (chat_id, user_id, gate_id, prompt_message_ref,
    created_at)
SELECT chat_id, user_id, gate_id, prompt_message_ref, created_at
FROM bot_reason_requests;
-- only on sqlite
DROP TABLE bot_reason_requests;
-- only on sqlite
ALTER TABLE bot_reason_requests_text RENAME TO bot_reason_requests;
-- only on sqlite
CREATE TABLE bot_chat_migrations_text (
    old_chat_id TEXT PRIMARY KEY,
    new_chat_id TEXT NOT NULL,
    migrated_at REAL NOT NULL
);
-- only on sqlite
INSERT INTO bot_chat_migrations_text (old_chat_id, new_chat_id, migrated_at)
SELECT old_chat_id, new_chat_id, migrated_at
FROM bot_chat_migrations;
-- only on sqlite
DROP TABLE bot_chat_migrations;
-- only on sqlite
ALTER TABLE bot_chat_migrations_text RENAME TO bot_chat_migrations;
-- only on sqlite
CREATE TABLE bot_tasks_text (
    task TEXT PRIMARY KEY,
    chat_id TEXT NOT NULL,
    thread_id TEXT,
    started_by INTEGER,
    active INTEGER NOT NULL DEFAULT 1,
    created_at REAL NOT NULL
);
-- only on sqlite
INSERT INTO bot_tasks_text (task, chat_id, thread_id, started_by, active, created_at)
SELECT task, chat_id, NULLIF(thread_id, 0), started_by, active, created_at
FROM bot_tasks;
-- only on sqlite
DROP TABLE bot_tasks;
-- only on sqlite
ALTER TABLE bot_tasks_text RENAME TO bot_tasks;
-- only on sqlite
CREATE TABLE bot_place_permissions_text (
    chat_id TEXT NOT NULL,
    thread_id TEXT NOT NULL DEFAULT '',
    policy TEXT NOT NULL,
    set_by INTEGER,
    set_at REAL NOT NULL,
    PRIMARY KEY (chat_id, thread_id)
);
-- only on sqlite
INSERT INTO bot_place_permissions_text (chat_id, thread_id, policy, set_by, set_at)
SELECT chat_id, thread_id, policy, set_by, set_at
FROM bot_place_permissions;
-- only on sqlite
DROP TABLE bot_place_permissions;
-- only on sqlite
ALTER TABLE bot_place_permissions_text RENAME TO bot_place_permissions;
