-- The turns of chat sessions on the workers (owned by engine.workers.chat).
-- The bot writes the message here and queues the run's turn (the job's input stays the
-- run id); the worker that runs it records who ran it, in which agent session, and what
-- came back. ``session_key`` names the chat session's worktree and branch on every worker.
CREATE TABLE worker_chat_turns (
    run_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    session_key TEXT NOT NULL,
    session_id TEXT NOT NULL,
    resumes INTEGER NOT NULL,
    model TEXT,
    prompt TEXT NOT NULL,
    status TEXT NOT NULL,
    worker TEXT,
    agent_session TEXT,
    output_json TEXT,
    error TEXT,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    PRIMARY KEY (run_id, seq)
);

CREATE INDEX worker_chat_turns_session ON worker_chat_turns (session_key, created_at);
