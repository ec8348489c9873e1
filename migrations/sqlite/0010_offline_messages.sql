-- Messages kept for a user with no available resource (XEP-0160), as in the PostgreSQL
-- schema's offline_messages: counted against `[limits] max_offline_messages` by the one
-- insert (the single writer serialises it), handed out oldest first and deleted in one
-- statement. stored_at is 'YYYY-MM-DDTHH:MM:SS.sssZ'.
CREATE TABLE offline_messages (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    owner     TEXT NOT NULL REFERENCES accounts (jid) ON DELETE CASCADE,
    sender    TEXT NOT NULL,
    stanza    TEXT NOT NULL,
    stored_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

CREATE INDEX offline_messages_owner ON offline_messages (owner, id);
