-- XEP-0054 vcard-temp: each account's own vCard, stored as the user set it without its
-- PHOTO. The photo lives in the account's XEP-0084 avatar nodes (pep_items), which a
-- vCard set publishes and a vCard get reads (XEP-0398), so the two never disagree. The
-- size is bounded by `[limits] max_vcard_size` before it is stored; deleting the account
-- deletes it.

CREATE TABLE vcards (
    owner      text PRIMARY KEY REFERENCES accounts (jid) ON DELETE CASCADE,
    -- The <vCard xmlns='vcard-temp'> element without PHOTO, serialised for a client stream.
    vcard      text NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
