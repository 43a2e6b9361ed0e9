-- The final report of a run on the workers, as the worker wrote it (the evidence and work
-- summary it measured in its worktree), for the control plane to show as a local run's.
-- (0002 is the chat sessions' turns, 0004 the warm runs.)
ALTER TABLE worker_runs ADD COLUMN report TEXT;
