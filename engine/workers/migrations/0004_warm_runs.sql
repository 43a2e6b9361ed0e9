-- The runs whose agent process stays resident between turns on a worker (warm sessions):
-- the worker keeps this to what it has running, so ``turnstile runs`` and the bot's
-- ``/status`` on other machines can say a run is warm. A row counts only while its
-- worker is alive and still holds the run.
CREATE TABLE warm_runs (
    run_id TEXT PRIMARY KEY,
    worker TEXT NOT NULL,
    since REAL NOT NULL
);

CREATE INDEX warm_runs_worker ON warm_runs (worker);
