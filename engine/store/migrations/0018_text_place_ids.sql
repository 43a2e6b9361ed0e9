-- A place's ids (a chat's, a forum topic's) are text: another messenger's ids are not
-- numbers, and Telegram's are kept as their decimal text. PostgreSQL's BIGINT columns
-- become TEXT. SQLite keeps its INTEGER columns: non-numeric text stays text in them, and
-- the stores read a number (a Telegram id, stored before or now) back as its text.
-- only on postgresql
ALTER TABLE runs
    ALTER COLUMN chat_id TYPE TEXT USING chat_id::text,
    ALTER COLUMN thread_id TYPE TEXT USING thread_id::text;
-- only on postgresql
ALTER TABLE gate_approvals ALTER COLUMN chat_id TYPE TEXT USING chat_id::text;
-- only on postgresql
ALTER TABLE audit_log ALTER COLUMN chat_id TYPE TEXT USING chat_id::text;
