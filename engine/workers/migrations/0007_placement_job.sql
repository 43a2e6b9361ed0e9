-- runs.status is the one status of a run on the workers too: worker_runs keeps only what is
-- about its placement. ``job`` says whether a step job of the run is queued (no worker has
-- taken it yet: before its first step, after a move or a raised budget) or taken (a worker
-- holds it and runs its steps); NULL: no job, either parked (a worker holds it: a drive at
-- its gate or waiting for its wave) or let go (no worker holds it: the workers are done).
-- The placement's own copy of the run's status goes; where it disagreed with the run's
-- (a run that could not go on was left running in ``runs``), the run's is set from it.
-- (0006 is the chat sessions' files.)
ALTER TABLE worker_runs ADD COLUMN job TEXT;
UPDATE worker_runs SET job = CASE status
    WHEN 'waiting' THEN 'queued' WHEN 'running' THEN 'taken' ELSE NULL END;
UPDATE runs SET status = 'error', finished_at = (
    SELECT w.updated_at FROM worker_runs w WHERE w.run_id = runs.id
)
WHERE status = 'running'
    AND id IN (SELECT run_id FROM worker_runs WHERE status = 'finished');
UPDATE runs SET status = 'stopped', exit_code = 130, finished_at = (
    SELECT w.updated_at FROM worker_runs w WHERE w.run_id = runs.id
)
WHERE status IN ('running', 'parked')
    AND id IN (SELECT run_id FROM worker_runs WHERE status = 'stopped');
UPDATE worker_runs SET worker = NULL WHERE status IN ('finished', 'stopped');
ALTER TABLE worker_runs DROP COLUMN status;
