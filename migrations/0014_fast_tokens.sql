-- XEP-0484 FAST tokens: one row per token a client holds, at most two per client (the
-- one in use and the one that replaces it, until the client logs in with the new one).
--
-- No token is stored. `nonce` is random, and the token is an HMAC keyed with a server
-- secret over the nonce, the account, `user_agent` and `mechanism`
-- (src/protocol/sasl/ht.rs): the rows alone log nobody in. Times are Unix seconds, as in
-- the SQLite schema, so both run the same statements. The rows go with the account, and a
-- password change deletes them (src/store/fast.rs).
CREATE TABLE fast_tokens (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    account_id bigint NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
    -- XEP-0388 <user-agent id/>: the client installation the token is bound to.
    user_agent text   NOT NULL CHECK (user_agent <> '' AND octet_length(user_agent) <= 256),
    mechanism  text   NOT NULL CHECK (mechanism <> '' AND octet_length(mechanism) <= 64),
    nonce      bytea  NOT NULL CHECK (octet_length(nonce) = 32),
    issued_at  bigint NOT NULL,
    expires_at bigint NOT NULL,
    -- The highest XEP-0484 'count' a login with this token carried: a replay repeats one.
    last_count bigint NOT NULL DEFAULT 0
);

CREATE INDEX fast_tokens_client ON fast_tokens (account_id, user_agent);
