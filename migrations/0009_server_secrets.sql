-- Secrets the server generates once and keeps across restarts and nodes, by name.
-- 'scram_fake_salt': the key of the HMAC that derives the SCRAM salt told to a user that
-- does not exist, so that salt is the same at every start and on every node, as a real
-- account's stored salt is (otherwise comparing two answers reveals the account is fake).
CREATE TABLE server_secrets (
    name  text PRIMARY KEY,
    value bytea NOT NULL CHECK (octet_length(value) >= 32)
);
