-- Every placement has its run's row. A run placed before placing wrote the row got it at
-- its first step; one that ended before any step (stopped while queued, or it could not
-- start) never had one, so nothing could say how it ended and a follower of it waited.
-- Each placement without a row gets the one placing writes now (insert_run_in), from its
-- spec: mode, agent, objective, chat place, task, parent, and a drive the agent session
-- of its task's newest drive. Status: running while the workers still have it (queued or
-- held: its first step goes on from there); ended, stopped, with the stop's exit status
-- when a person stopped it, or in error with its note as the reason when it could not
-- start. (A topic of 0 or '' was "no topic", as the spec is read.)
-- only on sqlite
INSERT INTO runs (id, mode, agent, session_id, status, phase, turn, objective, workdir,
    log_dir, chat_id, thread_id, task, state_json, exit_code, abort_reason, created_at,
    updated_at, finished_at, parent_id)
SELECT p.run_id, p.mode, p.agent,
    CASE WHEN p.task IS NULL THEN '' ELSE COALESCE(
        (SELECT r.session_id FROM runs r WHERE r.mode = p.mode AND r.task = p.task
         ORDER BY r.created_at DESC, r.id DESC LIMIT 1), '') END,
    CASE WHEN NOT p.ended THEN 'running'
        WHEN p.note = 'Stopped by a person' OR COALESCE(p.note, '') = '' THEN 'stopped'
        ELSE 'error' END,
    NULL, 0, p.objective, NULL, NULL, p.chat_id, p.thread_id, p.task, '{}',
    CASE WHEN p.ended AND p.note = 'Stopped by a person' THEN 130 END,
    CASE WHEN p.ended AND p.note <> 'Stopped by a person' AND p.note <> ''
        THEN substr(p.note, 1, 500) END,
    p.created_at,
    CASE WHEN p.ended THEN p.updated_at ELSE p.created_at END,
    CASE WHEN p.ended THEN p.updated_at END,
    p.parent_run
FROM (
    SELECT w.run_id, w.note, w.created_at, w.updated_at,
        COALESCE(NULLIF(w.spec_json ->> 'mode', ''), 'auto') AS mode,
        COALESCE(w.spec_json ->> 'tool', '') AS agent,
        w.spec_json ->> 'objective' AS objective,
        NULLIF(w.spec_json ->> 'chat_id', '') AS chat_id,
        NULLIF(NULLIF(w.spec_json ->> 'thread_id', 0), '') AS thread_id,
        w.spec_json ->> 'task' AS task,
        w.spec_json ->> 'parent_run' AS parent_run,
        (w.worker IS NULL AND w.job IS NULL) AS ended
    FROM worker_runs w
    WHERE NOT EXISTS (SELECT 1 FROM runs r WHERE r.id = w.run_id)
) AS p;
-- only on postgresql
INSERT INTO runs (id, mode, agent, session_id, status, phase, turn, objective, workdir,
    log_dir, chat_id, thread_id, task, state_json, exit_code, abort_reason, created_at,
    updated_at, finished_at, parent_id)
SELECT p.run_id, p.mode, p.agent,
    CASE WHEN p.task IS NULL THEN '' ELSE COALESCE(
        (SELECT r.session_id FROM runs r WHERE r.mode = p.mode AND r.task = p.task
         ORDER BY r.created_at DESC, r.id DESC LIMIT 1), '') END,
    CASE WHEN NOT p.ended THEN 'running'
        WHEN p.note = 'Stopped by a person' OR COALESCE(p.note, '') = '' THEN 'stopped'
        ELSE 'error' END,
    NULL, 0, p.objective, NULL, NULL, p.chat_id, p.thread_id, p.task, '{}',
    CASE WHEN p.ended AND p.note = 'Stopped by a person' THEN 130 END,
    CASE WHEN p.ended AND p.note <> 'Stopped by a person' AND p.note <> ''
        THEN substr(p.note, 1, 500) END,
    p.created_at,
    CASE WHEN p.ended THEN p.updated_at ELSE p.created_at END,
    CASE WHEN p.ended THEN p.updated_at END,
    p.parent_run
FROM (
    SELECT w.run_id, w.note, w.created_at, w.updated_at,
        COALESCE(NULLIF(CAST(w.spec_json AS json) ->> 'mode', ''), 'auto') AS mode,
        COALESCE(CAST(w.spec_json AS json) ->> 'tool', '') AS agent,
        CAST(w.spec_json AS json) ->> 'objective' AS objective,
        NULLIF(CAST(w.spec_json AS json) ->> 'chat_id', '') AS chat_id,
        NULLIF(NULLIF(CAST(w.spec_json AS json) ->> 'thread_id', '0'), '') AS thread_id,
        CAST(w.spec_json AS json) ->> 'task' AS task,
        CAST(w.spec_json AS json) ->> 'parent_run' AS parent_run,
        (w.worker IS NULL AND w.job IS NULL) AS ended
    FROM worker_runs w
    WHERE NOT EXISTS (SELECT 1 FROM runs r WHERE r.id = w.run_id)
) AS p;
