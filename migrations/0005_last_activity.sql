-- Last activity (XEP-0012): when each account was last online and the status text of its
-- last unavailable presence. Liveness (Redis) is the truth while a user is online; this
-- row is the durable answer once the user is gone. It is written once per session end,
-- in batches (one statement for many users, see Store::record_last_seen_batch), never per
-- heartbeat.
--
-- A batch may arrive late or out of order (two nodes flushing, a retried write), so the
-- writer only ever moves seen_at forward; nothing here enforces that because an operator
-- may legitimately correct a wrong time by hand.

CREATE TABLE last_activity (
    jid     text        PRIMARY KEY REFERENCES accounts (jid) ON DELETE CASCADE,
    seen_at timestamptz NOT NULL,
    -- Status text (<status/>) of the last unavailable presence, if it had one.
    status  text
);
