-- The run that drives this one: a wave's sub-task runs under its parent task's drive (it
-- is resumed with its parent, never on its own).
ALTER TABLE runs ADD COLUMN parent_id TEXT;
