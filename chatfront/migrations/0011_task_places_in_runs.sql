-- The chat an autopilot task reports to is read from its drives' runs (each records the
-- place it reports to), not kept a second time in bot_tasks. A task whose drives recorded
-- no place gives its newest drive the one bot_tasks kept; then bot_tasks goes. (A task no
-- drive ever ran for has nothing to report: its row goes with the table.)
UPDATE runs SET
    chat_id = (SELECT b.chat_id FROM bot_tasks b WHERE b.task = runs.task),
    thread_id = (SELECT b.thread_id FROM bot_tasks b WHERE b.task = runs.task)
WHERE mode = 'autopilot' AND parent_id IS NULL AND chat_id IS NULL
  AND task IN (SELECT task FROM bot_tasks)
  AND NOT EXISTS (
    SELECT 1 FROM runs placed
    WHERE placed.mode = 'autopilot' AND placed.task = runs.task
      AND placed.parent_id IS NULL AND placed.chat_id IS NOT NULL)
  AND id = (
    SELECT newest.id FROM runs newest
    WHERE newest.mode = 'autopilot' AND newest.task = runs.task AND newest.parent_id IS NULL
    ORDER BY newest.created_at DESC, newest.id DESC LIMIT 1);
DROP TABLE bot_tasks;
