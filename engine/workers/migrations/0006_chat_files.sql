-- Files sent to a chat session on the workers (owned by engine.workers.chatfiles).
-- The bot stores a file's bytes in ``gate_artifacts`` (content-addressed) and a row here;
-- the chat turn that brings it names the rows in ``uploads`` (their ids, comma-separated),
-- and the worker writes them into the chat's worktree before the turn runs. Files the
-- agent sends back travel in the turn's output (their hashes, in ``gate_artifacts`` too).
CREATE TABLE worker_chat_uploads (
    id TEXT PRIMARY KEY,
    session_key TEXT NOT NULL,
    name TEXT NOT NULL,
    mime TEXT NOT NULL,
    size INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    created_at REAL NOT NULL
);

ALTER TABLE worker_chat_turns ADD COLUMN uploads TEXT;
