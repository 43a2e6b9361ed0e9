-- A place's ids (a chat's, a forum topic's) are text: another messenger's ids are not
-- numbers, and Telegram's are kept as their decimal text. PostgreSQL's BIGINT columns
-- become TEXT. SQLite keeps its INTEGER columns: non-numeric text stays text in them, and
-- the stores read a number (a Telegram id, stored before or now) back as its text.
-- "No topic" was 0 where the topic is part of a key; it is '' now, as no topic id is.
-- only on postgresql
ALTER TABLE bot_outbox
    ALTER COLUMN chat_id TYPE TEXT USING chat_id::text,
    ALTER COLUMN thread_id TYPE TEXT USING thread_id::text;
-- only on postgresql
ALTER TABLE bot_live
    ALTER COLUMN chat_id TYPE TEXT USING chat_id::text,
    ALTER COLUMN thread_id TYPE TEXT USING thread_id::text;
-- only on postgresql
ALTER TABLE bot_bindings
    ALTER COLUMN thread_id DROP DEFAULT,
    ALTER COLUMN chat_id TYPE TEXT USING chat_id::text,
    ALTER COLUMN thread_id TYPE TEXT USING thread_id::text,
    ALTER COLUMN thread_id SET DEFAULT '';
-- only on postgresql
ALTER TABLE bot_prompts
    ALTER COLUMN thread_id DROP DEFAULT,
    ALTER COLUMN chat_id TYPE TEXT USING chat_id::text,
    ALTER COLUMN thread_id TYPE TEXT USING thread_id::text,
    ALTER COLUMN thread_id SET DEFAULT '';
-- only on postgresql
ALTER TABLE bot_place_permissions
    ALTER COLUMN thread_id DROP DEFAULT,
    ALTER COLUMN chat_id TYPE TEXT USING chat_id::text,
    ALTER COLUMN thread_id TYPE TEXT USING thread_id::text,
    ALTER COLUMN thread_id SET DEFAULT '';
-- only on postgresql
ALTER TABLE bot_gates
    ALTER COLUMN chat_id TYPE TEXT USING chat_id::text,
    ALTER COLUMN thread_id TYPE TEXT USING thread_id::text;
-- only on postgresql
ALTER TABLE bot_tasks
    ALTER COLUMN chat_id TYPE TEXT USING chat_id::text,
    ALTER COLUMN thread_id TYPE TEXT USING thread_id::text;
-- only on postgresql
ALTER TABLE bot_reason_requests ALTER COLUMN chat_id TYPE TEXT USING chat_id::text;
-- (A chat moving to a new id is Telegram's: its ids stay numbers, SQLite's key a rowid.)
-- only on postgresql
ALTER TABLE bot_chat_migrations ALTER COLUMN old_chat_id DROP IDENTITY IF EXISTS;
-- only on postgresql
ALTER TABLE bot_chat_migrations
    ALTER COLUMN old_chat_id TYPE TEXT USING old_chat_id::text,
    ALTER COLUMN new_chat_id TYPE TEXT USING new_chat_id::text;
UPDATE bot_bindings SET thread_id = '' WHERE thread_id = '0';
UPDATE bot_prompts SET thread_id = '' WHERE thread_id = '0';
UPDATE bot_place_permissions SET thread_id = '' WHERE thread_id = '0';
