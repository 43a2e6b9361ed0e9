-- A chat's (or forum topic's) permission preset, set with /permissions: what its runs'
-- tool calls ask before they run (guarded, trusted, free). No row: the settings' policy.
CREATE TABLE bot_place_permissions (
    chat_id BIGINT NOT NULL,
    thread_id BIGINT NOT NULL DEFAULT 0,
    policy TEXT NOT NULL,
    set_by BIGINT,
    set_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (chat_id, thread_id)
);
