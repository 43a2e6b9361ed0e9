-- The task listing's order (engine.gates.store.LIST_QUERY): each task with its sub-tasks,
-- by wave and name. With this index both databases read the rows in that order instead of
-- sorting 10,000 of them on every `status --list`.
CREATE INDEX gate_tasks_listing ON gate_tasks ((COALESCE(parent, name)), (parent IS NOT NULL), (COALESCE(wave, 1)), name);
