-- The web view's one-time sign-in links (webview.signin): only a hash of each token is kept.
CREATE TABLE web_links (
    token_hash TEXT PRIMARY KEY,
    user_id INTEGER NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    used_at REAL
);
