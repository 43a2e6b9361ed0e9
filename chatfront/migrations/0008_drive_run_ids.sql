-- An autopilot drive's messages and gates were kept under the key "autopilot:TASK"; every
-- drive reports under its run id now. Each such row gets the run of its task's drive that
-- was opened last before the row was written (else the task's first drive; else none).
UPDATE bot_outbox SET run_id = COALESCE(
    (SELECT r.id FROM runs r
     WHERE r.mode = 'autopilot' AND r.task = substr(bot_outbox.run_id, 11)
       AND r.created_at <= bot_outbox.created_at
     ORDER BY r.created_at DESC, r.id DESC LIMIT 1),
    (SELECT r.id FROM runs r
     WHERE r.mode = 'autopilot' AND r.task = substr(bot_outbox.run_id, 11)
     ORDER BY r.created_at, r.id LIMIT 1)
)
WHERE run_id LIKE 'autopilot:%';
UPDATE bot_gates SET run_id = COALESCE(
    (SELECT r.id FROM runs r
     WHERE r.mode = 'autopilot' AND r.task = substr(bot_gates.run_id, 11)
       AND r.created_at <= bot_gates.created_at
     ORDER BY r.created_at DESC, r.id DESC LIMIT 1),
    (SELECT r.id FROM runs r
     WHERE r.mode = 'autopilot' AND r.task = substr(bot_gates.run_id, 11)
     ORDER BY r.created_at, r.id LIMIT 1)
)
WHERE run_id LIKE 'autopilot:%';
