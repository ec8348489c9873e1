-- XEP-0484 FAST tokens, as in the PostgreSQL schema's migration 0014: no token is stored,
-- only the nonce a server secret derives it from (src/protocol/sasl/ht.rs).
CREATE TABLE fast_tokens (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    account_id INTEGER NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
    user_agent TEXT    NOT NULL CHECK (user_agent <> '' AND length(CAST(user_agent AS BLOB)) <= 256),
    mechanism  TEXT    NOT NULL CHECK (mechanism <> '' AND length(CAST(mechanism AS BLOB)) <= 64),
    nonce      BLOB    NOT NULL CHECK (length(nonce) = 32),
    issued_at  INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    last_count INTEGER NOT NULL DEFAULT 0
);

CREATE INDEX fast_tokens_client ON fast_tokens (account_id, user_agent);
