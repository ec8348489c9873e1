-- Offline storage counted per sender and in bytes (XEP-0160 budgets): each kept message
-- records its sender's bare JID, its size as stored and whether the sender was one of the
-- owner's contacts when it was kept. The store's one insert checks `[limits]
-- max_offline_messages` / `max_offline_bytes` per owner and the per-sender shares against
-- these, and a contact's message displaces the oldest strangers' messages first.

ALTER TABLE offline_messages
    ADD COLUMN sender_bare  text,
    -- Octets of `stanza`.
    ADD COLUMN bytes        integer,
    -- Messages kept before this migration were kept under the old rules; they are treated
    -- as a contact's (never displaced).
    ADD COLUMN from_contact boolean NOT NULL DEFAULT true;

UPDATE offline_messages
   SET sender_bare = split_part(sender, '/', 1),
       bytes = octet_length(stanza);

ALTER TABLE offline_messages
    ALTER COLUMN sender_bare SET NOT NULL,
    ALTER COLUMN bytes SET NOT NULL,
    ALTER COLUMN from_contact DROP DEFAULT;
