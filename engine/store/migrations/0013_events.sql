-- One event log for every run (engine.events): each change of a run, a turn or a task's
-- gate is a row here, written in the transaction that makes the change. ``id`` is the
-- cursor a follower reads on from; ``task`` ties a task's gate events to the drives of it.
CREATE TABLE events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT,
    task TEXT,
    kind TEXT NOT NULL,
    at REAL NOT NULL,
    data_json TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX events_run ON events (run_id, id);
CREATE INDEX events_task ON events (task, id) WHERE task IS NOT NULL;
