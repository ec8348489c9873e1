-- Inbound subscription requests waiting for the user (RFC 6121 §3.1.3): kept as the full
-- stanza so it can be delivered as received on the next login. One per (owner, sender):
-- a repeated request is not stored twice.

CREATE TABLE pending_subscriptions (
    owner       text        NOT NULL REFERENCES accounts (jid) ON DELETE CASCADE,
    sender      text        NOT NULL,
    stanza      text        NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (owner, sender),
    CONSTRAINT pending_sender_is_bare_jid CHECK (sender ~ '^([^@/]+@)?[^@/]+$'),
    CONSTRAINT pending_stanza_not_empty CHECK (stanza <> '')
);
