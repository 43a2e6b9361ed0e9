-- Workers (``turnstile worker`` processes) and where each run's turns go.
-- Owned by engine.workers (its own sequence, beside the engine's).

-- One row per worker name; ``status`` is alive, stopped (SIGTERM) or lost (no heartbeat).
CREATE TABLE workers (
    name TEXT PRIMARY KEY,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    capacity INTEGER NOT NULL,
    running INTEGER NOT NULL DEFAULT 0,
    queues TEXT NOT NULL,
    status TEXT NOT NULL,
    started_at REAL NOT NULL,
    heartbeat_at REAL NOT NULL
);

-- A run whose turns are jobs: what a worker needs to start it (``spec_json``), the
-- worker that holds its worktree (NULL: any worker may take it), the worker of its last
-- turn, and how it stands.
CREATE TABLE worker_runs (
    run_id TEXT PRIMARY KEY,
    spec_json TEXT NOT NULL,
    worker TEXT,
    last_worker TEXT,
    status TEXT NOT NULL,
    note TEXT,
    moves INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);

-- A person asked this run to stop (``turnstile stop``); whoever drives it polls this.
CREATE TABLE run_stops (
    run_id TEXT PRIMARY KEY,
    requested_at REAL NOT NULL,
    requested_by TEXT
);
