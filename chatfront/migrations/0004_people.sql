-- How people are called in chat texts ("approved by Ann"): first name or @username, from
-- their updates; never a numeric id when a name is known.
CREATE TABLE bot_people (
    user_id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    seen_at REAL NOT NULL
);
