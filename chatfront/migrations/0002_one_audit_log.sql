-- The bot's audit entries join the system's one audit log (engine migration 6 made it).
INSERT INTO audit_log (at, event, outcome, actor, chat_id, update_id, detail, origin)
SELECT at, action, outcome, CAST(user_id AS TEXT), chat_id, update_id, reason, 'bot'
FROM bot_audit ORDER BY id;
DROP TABLE bot_audit;
