-- Subscription requests stored before the server cut them to what RFC 6121 §3.1.3 needs
-- (type, one short status, the XEP-0172 nick) could hold statuses of any size, re-sent at
-- every login. One longer than any request the server now keeps with its default limits
-- keeps only the request itself: the sender and the owner are columns, and the stanza's
-- addresses are set again when it is delivered.
UPDATE pending_subscriptions
SET stanza = '<presence xmlns=''jabber:client'' type=''subscribe''/>'
WHERE length(stanza) > 4096;
