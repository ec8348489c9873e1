-- Offline storage counted per sender and in bytes, as in the PostgreSQL schema's
-- migration 0013: the sender's bare JID, the stanza's size in octets, and whether the
-- sender was a contact of the owner when it was kept (messages kept before count as a
-- contact's, never displaced).
ALTER TABLE offline_messages ADD COLUMN sender_bare TEXT NOT NULL DEFAULT '';
ALTER TABLE offline_messages ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE offline_messages ADD COLUMN from_contact INTEGER NOT NULL DEFAULT 1;

UPDATE offline_messages
   SET sender_bare = CASE WHEN instr(sender, '/') > 0
                          THEN substr(sender, 1, instr(sender, '/') - 1)
                          ELSE sender END,
       bytes = length(CAST(stanza AS BLOB));
