-- Accounts and their SCRAM credentials.
--
-- Only salted SCRAM credentials are kept (RFC 5802 §3: salt, iteration count, StoredKey,
-- ServerKey), one row per hash, never a password. SASL PLAIN is checked against them.
-- `jid` is the account's bare JID, derived here so it can never disagree with
-- username/domain; the roster tables reference it, so deleting an account removes its
-- roster, tombstones and pending requests.
--
-- Operators may add their own migrations beside these files; number them from 1000 up so
-- they never collide with the server's own.

CREATE TABLE accounts (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    username   text        NOT NULL,
    domain     text        NOT NULL,
    jid        text        GENERATED ALWAYS AS (username || '@' || domain) STORED,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT accounts_username_domain_key UNIQUE (username, domain),
    CONSTRAINT accounts_jid_key UNIQUE (jid),
    -- RFC 7622 §3.3.1: characters a localpart may not contain.
    CONSTRAINT accounts_username_valid
        CHECK (username <> '' AND username !~ '["&''/:<>@[:space:]]' AND octet_length(username) <= 1023),
    CONSTRAINT accounts_domain_valid
        CHECK (domain <> '' AND domain !~ '[@/[:space:]]' AND octet_length(domain) <= 1023)
);

CREATE TABLE scram_credentials (
    account_id bigint  NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
    hash       text    NOT NULL,
    salt       bytea   NOT NULL,
    iterations integer NOT NULL,
    stored_key bytea   NOT NULL,
    server_key bytea   NOT NULL,
    PRIMARY KEY (account_id, hash),
    CONSTRAINT scram_hash_valid CHECK (hash IN ('sha1', 'sha256')),
    CONSTRAINT scram_iterations_positive CHECK (iterations > 0),
    CONSTRAINT scram_salt_not_empty CHECK (octet_length(salt) > 0),
    -- Keys are exactly one hash output long (SHA-1: 20 bytes, SHA-256: 32).
    CONSTRAINT scram_key_lengths CHECK (
        octet_length(stored_key) = CASE hash WHEN 'sha1' THEN 20 ELSE 32 END
        AND octet_length(server_key) = CASE hash WHEN 'sha1' THEN 20 ELSE 32 END
    )
);
