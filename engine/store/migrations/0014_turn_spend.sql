-- What a turn cost, as its agent CLI reported it: USD and tokens. NULL is "not reported"
-- (Copilot gives no counts; a turn cut off gives none), never zero.
ALTER TABLE turns ADD COLUMN cost_usd REAL;
ALTER TABLE turns ADD COLUMN tokens_input INTEGER;
ALTER TABLE turns ADD COLUMN tokens_output INTEGER;
ALTER TABLE turns ADD COLUMN tokens_cache_read INTEGER;
ALTER TABLE turns ADD COLUMN tokens_cache_write INTEGER;
