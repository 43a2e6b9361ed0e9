-- When a message's send began: a row still pending with this set after a crash may or may
-- not have reached Telegram, so it is not sent again blindly (no duplicates).
ALTER TABLE bot_outbox ADD COLUMN sending_since REAL;
