-- Messages kept for a user with no available resource (XEP-0160, RFC 6121 §8.5.2.2.1),
-- delivered with a XEP-0203 delay stamp when a resource next takes messages and deleted
-- as they are handed out. How many one user may have waiting is `[limits]
-- max_offline_messages`, checked by the store's one insert; a message's size is bounded
-- by `max_stanza_size` before it gets here.

CREATE TABLE offline_messages (
    id        bigserial PRIMARY KEY,
    owner     text NOT NULL REFERENCES accounts (jid) ON DELETE CASCADE,
    -- The sender as stamped on the message (full or bare JID, local or remote), so the
    -- owner's block list can be asked again when the message is handed out.
    sender    text NOT NULL,
    -- The message as received, serialised for a client stream.
    stanza    text NOT NULL,
    stored_at timestamptz NOT NULL DEFAULT now()
);

-- Counting one owner's messages and handing them out oldest first.
CREATE INDEX offline_messages_owner ON offline_messages (owner, id);
