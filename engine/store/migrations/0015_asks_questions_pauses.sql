-- What makes a tool request ask a person, in plain words (the preset's judgement; NULL:
-- the policy asks for every call).
ALTER TABLE tool_requests ADD COLUMN asks_because TEXT;
-- 1: a catastrophic call, which always asks and which no session grant covers.
ALTER TABLE tool_requests ADD COLUMN no_grant INTEGER NOT NULL DEFAULT 0;
-- A question the agent asks a person mid-turn (the permission server's "ask" tool): free
-- text, or one of up to four options. The turn waits until someone answers or it stops.
CREATE TABLE agent_questions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL,
    question TEXT NOT NULL,
    options_json TEXT NOT NULL DEFAULT '[]',
    state TEXT NOT NULL DEFAULT 'pending',
    answer TEXT,
    answered_by BIGINT,
    posted_at REAL,
    created_at REAL NOT NULL,
    answered_at REAL
);
CREATE INDEX agent_questions_state ON agent_questions (state, posted_at);
CREATE INDEX agent_questions_run ON agent_questions (run_id, state);
-- A run a person paused: it finishes the tool call it is in, then waits (holding its
-- slot) until resumed. No row: not paused.
CREATE TABLE run_pauses (
    run_id TEXT PRIMARY KEY,
    paused_by BIGINT,
    paused_at REAL NOT NULL
);
