-- A drive's agent session lives on its run (runs.session_id), as every other run's does:
-- each task's session moves onto the task's newest autopilot run, and gate_sessions goes.
-- A session not started yet (a drive moved off a lost worker) is none: an empty session
-- id, which the next turn replaces with a new session. (A task with no autopilot run has
-- no drive to resume: its next drive starts a new session.)
UPDATE runs SET session_id = (
    SELECT CASE WHEN s.started <> 0 THEN s.session_id ELSE '' END
    FROM gate_sessions s WHERE s.task = runs.task
)
WHERE mode = 'autopilot'
    AND task IN (SELECT task FROM gate_sessions)
    AND id = (
        SELECT n.id FROM runs n WHERE n.mode = 'autopilot' AND n.task = runs.task
        ORDER BY n.created_at DESC, n.id DESC LIMIT 1
    );
DROP TABLE gate_sessions;
