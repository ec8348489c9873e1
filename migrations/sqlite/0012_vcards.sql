-- XEP-0054 vcard-temp, as in the PostgreSQL schema's vcards: one vCard per account,
-- without its PHOTO (that is the account's XEP-0084 avatar). updated_at is
-- 'YYYY-MM-DDTHH:MM:SS.sssZ'.
CREATE TABLE vcards (
    owner      TEXT PRIMARY KEY REFERENCES accounts (jid) ON DELETE CASCADE,
    vcard      TEXT NOT NULL,
    updated_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);
