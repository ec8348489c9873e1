-- The whole schema of the embedded store (SQLite), the twin of the PostgreSQL files one
-- directory up: same tables, same columns, same invariants, written for SQLite.
--
-- Differences from PostgreSQL, and why:
--   * lists (roster groups, privacy exceptions) are JSON arrays in TEXT columns;
--   * times are UTC text 'YYYY-MM-DDTHH:MM:SS.sssZ', which sorts as it compares;
--   * a CHECK may not read other rows or expand a JSON list, so the checks that must
--     (group names distinct, exception lists of bare JIDs) are BEFORE triggers that
--     abort with the constraint's name, the same name PostgreSQL reports;
--   * there is no LISTEN/NOTIFY: the triggers that would notify append to
--     presenced_changes instead, which the server polls (src/store/notify.rs);
--   * the operators' roster operations are views: INSERT INTO presenced_roster_make_mutual
--     (a, b) and INSERT INTO presenced_roster_unpair (a, b) do what the PostgreSQL
--     functions of the same names do.
-- Foreign keys are enforced by the server's connections (PRAGMA foreign_keys = ON); an
-- operator's sqlite3 shell must turn them on too, or deleting an account leaves its rows.
--
-- Operators may add their own migrations in the configured directory; number them from
-- 1000 up so they never collide with the server's own.

-- Accounts and their SCRAM credentials (RFC 5802 §3: salt, iteration count, StoredKey,
-- ServerKey), one row per hash, never a password.
CREATE TABLE accounts (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    username   TEXT NOT NULL,
    domain     TEXT NOT NULL,
    jid        TEXT NOT NULL GENERATED ALWAYS AS (username || '@' || domain) STORED,
    created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    CONSTRAINT accounts_username_domain_key UNIQUE (username, domain),
    CONSTRAINT accounts_jid_key UNIQUE (jid),
    -- RFC 7622 §3.3.1: characters a localpart may not contain.
    CONSTRAINT accounts_username_valid CHECK (
        username <> '' AND length(CAST(username AS BLOB)) <= 1023
        AND username NOT GLOB '*["&''/:<>@ ]*'
        AND username NOT GLOB ('*[' || char(9, 10, 11, 12, 13) || ']*')),
    CONSTRAINT accounts_domain_valid CHECK (
        domain <> '' AND length(CAST(domain AS BLOB)) <= 1023
        AND domain NOT GLOB '*[@/ ]*'
        AND domain NOT GLOB ('*[' || char(9, 10, 11, 12, 13) || ']*'))
);

CREATE TABLE scram_credentials (
    account_id INTEGER NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
    hash       TEXT    NOT NULL,
    salt       BLOB    NOT NULL,
    iterations INTEGER NOT NULL,
    stored_key BLOB    NOT NULL,
    server_key BLOB    NOT NULL,
    PRIMARY KEY (account_id, hash),
    CONSTRAINT scram_hash_valid CHECK (hash IN ('sha1', 'sha256')),
    CONSTRAINT scram_iterations_positive CHECK (iterations > 0),
    CONSTRAINT scram_salt_not_empty CHECK (length(salt) > 0),
    -- Keys are exactly one hash output long (SHA-1: 20 bytes, SHA-256: 32).
    CONSTRAINT scram_key_lengths CHECK (
        length(stored_key) = CASE hash WHEN 'sha1' THEN 20 ELSE 32 END
        AND length(server_key) = CASE hash WHEN 'sha1' THEN 20 ELSE 32 END)
);

-- What happened that other parts of the server must hear about, in order: the SQLite
-- stand-in for PostgreSQL's NOTIFY. `channel` and `payload` are those of the PostgreSQL
-- notification (presenced_roster '<version> <owner>', presenced_block and
-- presenced_privacy '<owner>'). The server reads new rows at least once a second and
-- deletes rows older than ten minutes.
CREATE TABLE presenced_changes (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    channel TEXT NOT NULL,
    payload TEXT NOT NULL,
    at      TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

-- Rosters (RFC 6121 §2) with XEP-0237 versioning, kept by triggers as in PostgreSQL:
--   * insert/update of an item: version := bumped counter, any tombstone for it goes;
--   * delete of an item: counter bumped, a tombstone (owner, contact, version) is kept.
-- `floor` is the oldest version changes can be computed from. Counters start at the
-- current time in microseconds, so a re-created account never reuses old versions.
-- The CHECKs admit exactly the subscription states of RFC 6121 Appendix A.
CREATE TABLE roster_versions (
    owner   TEXT    PRIMARY KEY REFERENCES accounts (jid) ON DELETE CASCADE,
    version INTEGER NOT NULL,
    floor   INTEGER NOT NULL,
    CONSTRAINT roster_versions_floor CHECK (version >= floor)
);

CREATE TABLE roster_items (
    owner        TEXT    NOT NULL REFERENCES accounts (jid) ON DELETE CASCADE,
    contact      TEXT    NOT NULL,
    name         TEXT,
    -- JSON array of distinct non-empty group names (RFC 6121 §2.1.2.2, §2.3.3).
    groups       TEXT    NOT NULL DEFAULT '[]',
    subscription TEXT    NOT NULL DEFAULT 'none',
    -- RFC 6121 §2.1.2.2: the only value of 'ask' is "subscribe" (Pending Out).
    ask          TEXT,
    pending_in   INTEGER NOT NULL DEFAULT 0,
    preapproved  INTEGER NOT NULL DEFAULT 0,
    -- Set by trigger: the roster version of the last change to this item.
    version      INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (owner, contact),
    -- A bare JID: optional localpart, a domain, no resource.
    CONSTRAINT roster_contact_is_bare_jid CHECK (
        contact <> '' AND contact NOT GLOB '*/*' AND contact NOT GLOB '*@*@*'
        AND contact NOT GLOB '@*' AND contact NOT GLOB '*@'),
    CONSTRAINT roster_subscription_valid CHECK (subscription IN ('none', 'to', 'from', 'both')),
    CONSTRAINT roster_ask_valid CHECK (ask IS NULL OR ask = 'subscribe'),
    CONSTRAINT roster_flags_boolean CHECK (pending_in IN (0, 1) AND preapproved IN (0, 1)),
    -- Pending Out exists only while we do not yet have a subscription to the contact.
    CONSTRAINT roster_ask_without_to CHECK (ask IS NULL OR subscription IN ('none', 'from')),
    -- Pending In exists only while the contact does not yet have a subscription to us.
    CONSTRAINT roster_pending_in_without_from CHECK (NOT pending_in OR subscription IN ('none', 'to')),
    -- RFC 6121 §3.4.2: pre-approval applies to None, None+PendingOut and To.
    CONSTRAINT roster_preapproved_states CHECK (NOT preapproved OR (subscription IN ('none', 'to') AND NOT pending_in)),
    CONSTRAINT roster_groups_array CHECK (json_valid(groups) AND json_type(groups) = 'array')
);
CREATE INDEX roster_items_owner_version ON roster_items (owner, version);

CREATE TABLE roster_tombstones (
    owner      TEXT    NOT NULL REFERENCES accounts (jid) ON DELETE CASCADE,
    contact    TEXT    NOT NULL,
    version    INTEGER NOT NULL,
    -- When the item was removed, so tombstones can be pruned by age.
    removed_at TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (owner, contact)
);
CREATE INDEX roster_tombstones_removed_at ON roster_tombstones (removed_at);
CREATE INDEX roster_tombstones_owner_version ON roster_tombstones (owner, version);

-- Every account has a version counter from the start (its empty roster has a version).
CREATE TRIGGER accounts_roster_version AFTER INSERT ON accounts
BEGIN
    INSERT INTO roster_versions (owner, version, floor)
    VALUES (NEW.jid,
            CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER),
            CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER))
    ON CONFLICT (owner) DO NOTHING;
END;

-- Group names on one item: strings, non-empty, distinct (RFC 6121 §2.1.2.2, §2.3.3).
CREATE TRIGGER roster_items_groups_insert BEFORE INSERT ON roster_items
WHEN json_valid(NEW.groups) AND (
    EXISTS (SELECT 1 FROM json_each(NEW.groups) WHERE type <> 'text' OR value = '')
    OR (SELECT count(DISTINCT value) FROM json_each(NEW.groups))
       <> (SELECT count(*) FROM json_each(NEW.groups)))
BEGIN
    SELECT RAISE(ABORT, 'CHECK constraint failed: roster_groups_valid');
END;

CREATE TRIGGER roster_items_groups_update BEFORE UPDATE OF groups ON roster_items
WHEN json_valid(NEW.groups) AND (
    EXISTS (SELECT 1 FROM json_each(NEW.groups) WHERE type <> 'text' OR value = '')
    OR (SELECT count(DISTINCT value) FROM json_each(NEW.groups))
       <> (SELECT count(*) FROM json_each(NEW.groups)))
BEGIN
    SELECT RAISE(ABORT, 'CHECK constraint failed: roster_groups_valid');
END;

CREATE TRIGGER roster_items_identity_fixed BEFORE UPDATE OF owner, contact ON roster_items
WHEN NEW.owner IS NOT OLD.owner OR NEW.contact IS NOT OLD.contact
BEGIN
    SELECT RAISE(ABORT, 'CHECK constraint failed: roster_item_identity_fixed');
END;

-- The version bump of an insert or a change. `UPDATE OF` lists every column but
-- `version`, so the trigger's own write of the version does not fire it again.
CREATE TRIGGER roster_items_versioned_insert AFTER INSERT ON roster_items
BEGIN
    INSERT INTO roster_versions (owner, version, floor)
    VALUES (NEW.owner,
            CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER) + 1,
            CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER))
    ON CONFLICT (owner) DO UPDATE SET version = version + 1;
    UPDATE roster_items
    SET version = (SELECT version FROM roster_versions WHERE owner = NEW.owner)
    WHERE owner = NEW.owner AND contact = NEW.contact;
    DELETE FROM roster_tombstones WHERE owner = NEW.owner AND contact = NEW.contact;
    INSERT INTO presenced_changes (channel, payload)
    SELECT 'presenced_roster', version || ' ' || owner FROM roster_versions WHERE owner = NEW.owner;
END;

CREATE TRIGGER roster_items_versioned_update
AFTER UPDATE OF name, groups, subscription, ask, pending_in, preapproved ON roster_items
BEGIN
    UPDATE roster_versions SET version = version + 1 WHERE owner = NEW.owner;
    UPDATE roster_items
    SET version = (SELECT version FROM roster_versions WHERE owner = NEW.owner)
    WHERE owner = NEW.owner AND contact = NEW.contact;
    DELETE FROM roster_tombstones WHERE owner = NEW.owner AND contact = NEW.contact;
    INSERT INTO presenced_changes (channel, payload)
    SELECT 'presenced_roster', version || ' ' || owner FROM roster_versions WHERE owner = NEW.owner;
END;

-- A deletion leaves a tombstone, unless the account itself is going (no roster left).
CREATE TRIGGER roster_items_tombstone AFTER DELETE ON roster_items
WHEN EXISTS (SELECT 1 FROM accounts WHERE jid = OLD.owner)
BEGIN
    UPDATE roster_versions SET version = version + 1 WHERE owner = OLD.owner;
    INSERT INTO roster_tombstones (owner, contact, version)
    SELECT OLD.owner, OLD.contact, version FROM roster_versions WHERE owner = OLD.owner
    ON CONFLICT (owner, contact) DO UPDATE
        SET version = excluded.version, removed_at = excluded.removed_at;
    INSERT INTO presenced_changes (channel, payload)
    SELECT 'presenced_roster', version || ' ' || owner FROM roster_versions WHERE owner = OLD.owner;
END;

-- Inbound subscription requests waiting for the user (RFC 6121 §3.1.3), one per sender.
CREATE TABLE pending_subscriptions (
    owner       TEXT NOT NULL REFERENCES accounts (jid) ON DELETE CASCADE,
    sender      TEXT NOT NULL,
    stanza      TEXT NOT NULL,
    received_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (owner, sender),
    CONSTRAINT pending_sender_is_bare_jid CHECK (
        sender <> '' AND sender NOT GLOB '*/*' AND sender NOT GLOB '*@*@*'
        AND sender NOT GLOB '@*' AND sender NOT GLOB '*@'),
    CONSTRAINT pending_stanza_not_empty CHECK (stanza <> '')
);

-- Operators' roster operations. Reading presenced_roster_make_mutual lists the mutual
-- pairs; inserting (a, b) makes two local accounts mutual contacts (subscription 'both'
-- on each side), keeping any name and groups:
--   INSERT INTO presenced_roster_make_mutual (a, b) VALUES ('alice@example.org', 'bob@example.org');
CREATE VIEW presenced_roster_make_mutual (a, b) AS
    SELECT owner, contact FROM roster_items WHERE subscription = 'both';

CREATE TRIGGER presenced_roster_make_mutual INSTEAD OF INSERT ON presenced_roster_make_mutual
BEGIN
    SELECT RAISE(ABORT, 'CHECK constraint failed: an account cannot be its own mutual contact')
    WHERE NEW.a = NEW.b;
    INSERT INTO roster_items (owner, contact, subscription)
    VALUES (NEW.a, NEW.b, 'both'), (NEW.b, NEW.a, 'both')
    ON CONFLICT (owner, contact) DO UPDATE
        SET subscription = 'both', ask = NULL, pending_in = 0, preapproved = 0;
    DELETE FROM pending_subscriptions
    WHERE (owner = NEW.a AND sender = NEW.b) OR (owner = NEW.b AND sender = NEW.a);
END;

-- Inserting (a, b) removes two accounts from each other's rosters (both sides leave a
-- tombstone) and drops their waiting requests. Reading it returns nothing.
CREATE VIEW presenced_roster_unpair (a, b) AS SELECT NULL, NULL WHERE 0;

CREATE TRIGGER presenced_roster_unpair INSTEAD OF INSERT ON presenced_roster_unpair
BEGIN
    DELETE FROM roster_items
    WHERE (owner = NEW.a AND contact = NEW.b) OR (owner = NEW.b AND contact = NEW.a);
    DELETE FROM pending_subscriptions
    WHERE (owner = NEW.a AND sender = NEW.b) OR (owner = NEW.b AND sender = NEW.a);
END;

-- Last activity (XEP-0012): when each account was last online and the status of its last
-- unavailable presence. The server writes seen_at as 'YYYY-MM-DDTHH:MM:SS.ssssssZ'.
CREATE TABLE last_activity (
    jid     TEXT PRIMARY KEY REFERENCES accounts (jid) ON DELETE CASCADE,
    seen_at TEXT NOT NULL,
    status  TEXT
);

-- Block lists (XEP-0191): [localpart@]domain[/resource], matched by XEP-0016 §2.1.
CREATE TABLE blocklist (
    owner   TEXT NOT NULL REFERENCES accounts (jid) ON DELETE CASCADE,
    blocked TEXT NOT NULL,
    PRIMARY KEY (owner, blocked),
    CONSTRAINT blocklist_blocked_is_jid CHECK (
        blocked <> '' AND blocked NOT GLOB '/*' AND blocked NOT GLOB '*/'
        AND blocked NOT GLOB '@*'
        AND substr(blocked, 1, instr(blocked || '/', '/') - 1) NOT GLOB '*@*@*'
        AND substr(blocked, 1, instr(blocked || '/', '/') - 1) NOT GLOB '*@'
        AND substr(blocked, 1, instr(blocked || '/', '/') - 1)
            NOT GLOB ('*[ ' || char(9, 10, 11, 12, 13) || ']*')),
    -- RFC 7622 §3: each part is at most 1023 octets.
    CONSTRAINT blocklist_blocked_length CHECK (length(CAST(blocked AS BLOB)) <= 3071 + 2)
);

CREATE TRIGGER blocklist_changed_insert AFTER INSERT ON blocklist
BEGIN
    INSERT INTO presenced_changes (channel, payload) VALUES ('presenced_block', NEW.owner);
END;
CREATE TRIGGER blocklist_changed_update AFTER UPDATE ON blocklist
BEGIN
    INSERT INTO presenced_changes (channel, payload) VALUES ('presenced_block', OLD.owner);
    INSERT INTO presenced_changes (channel, payload) SELECT 'presenced_block', NEW.owner
    WHERE NEW.owner <> OLD.owner;
END;
CREATE TRIGGER blocklist_changed_delete AFTER DELETE ON blocklist
BEGIN
    INSERT INTO presenced_changes (channel, payload) VALUES ('presenced_block', OLD.owner);
END;

-- Presence and last-seen visibility settings (src/presence/privacy.rs). One row per
-- account that changed a default. The exception lists are JSON arrays of distinct bare
-- JIDs, meaningful only with mode 'contacts_except'.
CREATE TABLE privacy_settings (
    owner            TEXT PRIMARY KEY REFERENCES accounts (jid) ON DELETE CASCADE,
    online           TEXT NOT NULL DEFAULT 'subscribers',
    last_seen        TEXT NOT NULL DEFAULT 'subscribers',
    online_except    TEXT NOT NULL DEFAULT '[]',
    last_seen_except TEXT NOT NULL DEFAULT '[]',
    CONSTRAINT privacy_online_valid
        CHECK (online IN ('subscribers', 'contacts_except', 'nobody')),
    CONSTRAINT privacy_last_seen_valid
        CHECK (last_seen IN ('subscribers', 'contacts_except', 'nobody')),
    CONSTRAINT privacy_online_except_only_with_mode
        CHECK (online = 'contacts_except' OR online_except = '[]'),
    CONSTRAINT privacy_last_seen_except_only_with_mode
        CHECK (last_seen = 'contacts_except' OR last_seen_except = '[]'),
    CONSTRAINT privacy_online_except_valid
        CHECK (json_valid(online_except) AND json_type(online_except) = 'array'),
    CONSTRAINT privacy_last_seen_except_valid
        CHECK (json_valid(last_seen_except) AND json_type(last_seen_except) = 'array')
);

CREATE TRIGGER privacy_settings_lists_insert BEFORE INSERT ON privacy_settings
WHEN (json_valid(NEW.online_except) AND (
        EXISTS (SELECT 1 FROM json_each(NEW.online_except)
                WHERE type <> 'text' OR value = '' OR value GLOB '*/*' OR value GLOB '*@*@*'
                   OR value GLOB '@*' OR value GLOB '*@' OR value GLOB '*[ ]*')
        OR (SELECT count(DISTINCT value) FROM json_each(NEW.online_except))
           <> (SELECT count(*) FROM json_each(NEW.online_except))))
  OR (json_valid(NEW.last_seen_except) AND (
        EXISTS (SELECT 1 FROM json_each(NEW.last_seen_except)
                WHERE type <> 'text' OR value = '' OR value GLOB '*/*' OR value GLOB '*@*@*'
                   OR value GLOB '@*' OR value GLOB '*@' OR value GLOB '*[ ]*')
        OR (SELECT count(DISTINCT value) FROM json_each(NEW.last_seen_except))
           <> (SELECT count(*) FROM json_each(NEW.last_seen_except))))
BEGIN
    SELECT RAISE(ABORT, 'CHECK constraint failed: privacy_except_valid');
END;

CREATE TRIGGER privacy_settings_lists_update BEFORE UPDATE ON privacy_settings
WHEN (json_valid(NEW.online_except) AND (
        EXISTS (SELECT 1 FROM json_each(NEW.online_except)
                WHERE type <> 'text' OR value = '' OR value GLOB '*/*' OR value GLOB '*@*@*'
                   OR value GLOB '@*' OR value GLOB '*@' OR value GLOB '*[ ]*')
        OR (SELECT count(DISTINCT value) FROM json_each(NEW.online_except))
           <> (SELECT count(*) FROM json_each(NEW.online_except))))
  OR (json_valid(NEW.last_seen_except) AND (
        EXISTS (SELECT 1 FROM json_each(NEW.last_seen_except)
                WHERE type <> 'text' OR value = '' OR value GLOB '*/*' OR value GLOB '*@*@*'
                   OR value GLOB '@*' OR value GLOB '*@' OR value GLOB '*[ ]*')
        OR (SELECT count(DISTINCT value) FROM json_each(NEW.last_seen_except))
           <> (SELECT count(*) FROM json_each(NEW.last_seen_except))))
BEGIN
    SELECT RAISE(ABORT, 'CHECK constraint failed: privacy_except_valid');
END;

CREATE TRIGGER privacy_settings_changed_insert AFTER INSERT ON privacy_settings
BEGIN
    INSERT INTO presenced_changes (channel, payload) VALUES ('presenced_privacy', NEW.owner);
END;
CREATE TRIGGER privacy_settings_changed_update AFTER UPDATE ON privacy_settings
BEGIN
    INSERT INTO presenced_changes (channel, payload) VALUES ('presenced_privacy', OLD.owner);
    INSERT INTO presenced_changes (channel, payload) SELECT 'presenced_privacy', NEW.owner
    WHERE NEW.owner <> OLD.owner;
END;
CREATE TRIGGER privacy_settings_changed_delete AFTER DELETE ON privacy_settings
BEGIN
    INSERT INTO presenced_changes (channel, payload) VALUES ('presenced_privacy', OLD.owner);
END;

-- Secrets the server generates once and keeps across restarts (by name); see the
-- PostgreSQL twin for 'scram_fake_salt'.
CREATE TABLE server_secrets (
    name  TEXT PRIMARY KEY,
    value BLOB NOT NULL CHECK (length(value) >= 32)
);
