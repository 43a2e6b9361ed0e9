-- The model a chat asked for with /model (NULL: the agent's default, TURNSTILE_AGENT_MODEL).
ALTER TABLE bot_bindings ADD COLUMN model TEXT;
