-- The processes of a running turn: its group id (the leader's pid), the leader's start
-- time and the marker its descendants inherit, so that a start-up after a crash can kill
-- what is left of it (and never a process that merely reuses the pid).
ALTER TABLE turns ADD COLUMN proc_pgid INTEGER;
ALTER TABLE turns ADD COLUMN proc_start TEXT;
ALTER TABLE turns ADD COLUMN proc_marker TEXT;
