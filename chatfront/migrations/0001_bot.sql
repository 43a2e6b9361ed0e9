-- The Telegram bot: inbound updates, the outbound queue, live messages, chat bindings,
-- the per-chat prompt queue, gate messages and the bot's audit of refusals.
CREATE TABLE bot_inbound (
    update_id INTEGER PRIMARY KEY,
    payload TEXT NOT NULL,
    state TEXT NOT NULL,
    received_at REAL NOT NULL,
    handled_at REAL
);
CREATE INDEX bot_inbound_state ON bot_inbound (state);
CREATE TABLE bot_outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    chat_id INTEGER NOT NULL,
    thread_id INTEGER,
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
    sent_at REAL
);
CREATE INDEX bot_outbox_state ON bot_outbox (state, id);
CREATE TABLE bot_live (
    ref TEXT PRIMARY KEY,
    chat_id INTEGER NOT NULL,
    thread_id INTEGER,
    message_id INTEGER,
    body TEXT NOT NULL,
    entities_json TEXT,
    markup_json TEXT,
    dirty INTEGER NOT NULL DEFAULT 0,
    updated_at REAL NOT NULL,
    edited_at REAL
);
CREATE TABLE bot_bindings (
    chat_id INTEGER NOT NULL,
    thread_id INTEGER NOT NULL DEFAULT 0,
    agent TEXT NOT NULL,
    project TEXT NOT NULL,
    workdir TEXT NOT NULL,
    session_id TEXT NOT NULL,
    turns INTEGER NOT NULL DEFAULT 0,
    run_id TEXT,
    bound_by INTEGER,
    created_at REAL NOT NULL,
    PRIMARY KEY (chat_id, thread_id)
);
CREATE TABLE bot_prompts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    chat_id INTEGER NOT NULL,
    thread_id INTEGER NOT NULL DEFAULT 0,
    update_id INTEGER UNIQUE,
    user_id INTEGER,
    body TEXT NOT NULL,
    state TEXT NOT NULL,
    run_id TEXT,
    turn_id INTEGER,
    created_at REAL NOT NULL,
    finished_at REAL
);
CREATE INDEX bot_prompts_queue ON bot_prompts (chat_id, thread_id, state, id);
CREATE TABLE bot_gates (
    gate_id TEXT PRIMARY KEY,
    task TEXT NOT NULL,
    phase TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    artifact_name TEXT NOT NULL,
    chat_id INTEGER NOT NULL,
    thread_id INTEGER,
    run_id TEXT,
    state TEXT NOT NULL,
    decided_by INTEGER,
    created_at REAL NOT NULL,
    decided_at REAL
);
CREATE INDEX bot_gates_task ON bot_gates (task, state);
CREATE TABLE bot_reason_requests (
    chat_id INTEGER NOT NULL,
    user_id INTEGER NOT NULL,
    gate_id TEXT NOT NULL,
    prompt_message_ref TEXT,
    created_at REAL NOT NULL,
    PRIMARY KEY (chat_id, user_id)
);
CREATE TABLE bot_chat_migrations (
    old_chat_id INTEGER PRIMARY KEY,
    new_chat_id INTEGER NOT NULL,
    migrated_at REAL NOT NULL
);
CREATE TABLE bot_audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    user_id INTEGER,
    chat_id INTEGER,
    update_id INTEGER,
    action TEXT NOT NULL,
    outcome TEXT NOT NULL,
    reason TEXT
);
CREATE INDEX bot_audit_at ON bot_audit (at);
CREATE TABLE bot_tasks (
    task TEXT PRIMARY KEY,
    chat_id INTEGER NOT NULL,
    thread_id INTEGER,
    started_by INTEGER,
    active INTEGER NOT NULL DEFAULT 1,
    created_at REAL NOT NULL
);
