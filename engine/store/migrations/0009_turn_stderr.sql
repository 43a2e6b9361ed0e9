-- The end of what a turn's agent printed on stderr (redacted, at most 1 KB): why a turn
-- failed, kept with the turn.
ALTER TABLE turns ADD COLUMN stderr_tail TEXT;
