-- Rosters (RFC 6121 §2) with XEP-0237 versioning.
--
-- Each owner has one version counter (roster_versions). Triggers, not application code,
-- bump it in the same transaction as every insert, update or delete of a roster item, so
-- plain SQL by an operator keeps versions and tombstones right too:
--   * insert/update of an item: version := bumped counter, any tombstone for it goes;
--   * delete of an item: counter bumped, a tombstone (owner, contact, version) is kept so
--     "changes since version N" can report the removal.
-- Every bump also sends NOTIFY presenced_roster with payload '<version> <owner>', so the
-- server can push roster changes made in SQL to online resources.
--
-- `floor` is the oldest version from which changes can still be computed: a client holding
-- a version below it (from a deleted and re-created account, or older than the
-- tombstones pruned by age, see Store::prune_roster_tombstones) gets the full roster.
-- Counters start at the current time in microseconds, so a re-created account never
-- reuses the versions of the old one.
--
-- The CHECKs admit exactly the subscription states of RFC 6121 Appendix A:
-- None, None+PendingOut, None+PendingIn, None+PendingOut+PendingIn, To, To+PendingIn,
-- From, From+PendingOut, Both; pre-approval (§3.4) only where it means something.

CREATE FUNCTION presenced_version_origin() RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint
$$;

-- Group names on one item: non-empty, distinct, no NULLs (RFC 6121 §2.1.2.2, §2.3.3).
CREATE FUNCTION presenced_groups_valid(g text[]) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN g IS NULL THEN false
        WHEN cardinality(g) = 0 THEN true
        WHEN array_ndims(g) <> 1 THEN false
        ELSE array_position(g, NULL) IS NULL
             AND array_position(g, '') IS NULL
             AND (SELECT count(DISTINCT x) FROM unnest(g) AS x) = cardinality(g)
    END
$$;

CREATE TABLE roster_versions (
    owner   text   PRIMARY KEY REFERENCES accounts (jid) ON DELETE CASCADE,
    version bigint NOT NULL,
    floor   bigint NOT NULL,
    CONSTRAINT roster_versions_floor CHECK (version >= floor)
);

CREATE TABLE roster_items (
    owner        text    NOT NULL REFERENCES accounts (jid) ON DELETE CASCADE,
    contact      text    NOT NULL,
    name         text,
    groups       text[]  NOT NULL DEFAULT '{}',
    subscription text    NOT NULL DEFAULT 'none',
    -- RFC 6121 §2.1.2.2: the only value of 'ask' is "subscribe" (Pending Out).
    ask          text,
    pending_in   boolean NOT NULL DEFAULT false,
    preapproved  boolean NOT NULL DEFAULT false,
    -- Set by trigger: the roster version of the last change to this item.
    version      bigint  NOT NULL DEFAULT 0,
    PRIMARY KEY (owner, contact),
    -- A bare JID: optional localpart, a domain, no resource.
    CONSTRAINT roster_contact_is_bare_jid CHECK (contact ~ '^([^@/]+@)?[^@/]+$'),
    CONSTRAINT roster_subscription_valid CHECK (subscription IN ('none', 'to', 'from', 'both')),
    CONSTRAINT roster_ask_valid CHECK (ask IS NULL OR ask = 'subscribe'),
    -- Pending Out exists only while we do not yet have a subscription to the contact.
    CONSTRAINT roster_ask_without_to CHECK (ask IS NULL OR subscription IN ('none', 'from')),
    -- Pending In exists only while the contact does not yet have a subscription to us.
    CONSTRAINT roster_pending_in_without_from CHECK (NOT pending_in OR subscription IN ('none', 'to')),
    -- RFC 6121 §3.4.2: pre-approval applies to None, None+PendingOut and To; with a
    -- pending request, "subscribed" is an approval instead.
    CONSTRAINT roster_preapproved_states CHECK (NOT preapproved OR (subscription IN ('none', 'to') AND NOT pending_in)),
    CONSTRAINT roster_groups_valid CHECK (presenced_groups_valid(groups))
);
CREATE INDEX roster_items_owner_version ON roster_items (owner, version);

CREATE TABLE roster_tombstones (
    owner      text        NOT NULL REFERENCES accounts (jid) ON DELETE CASCADE,
    contact    text        NOT NULL,
    version    bigint      NOT NULL,
    -- When the item was removed, so tombstones can be pruned by age.
    removed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (owner, contact)
);
CREATE INDEX roster_tombstones_removed_at ON roster_tombstones (removed_at);
CREATE INDEX roster_tombstones_owner_version ON roster_tombstones (owner, version);

-- Bumps the owner's counter (creating it if missing), announces it, returns the new version.
CREATE FUNCTION presenced_roster_bump(p_owner text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    origin bigint := presenced_version_origin();
    v      bigint;
BEGIN
    INSERT INTO roster_versions AS rv (owner, version, floor)
    VALUES (p_owner, origin + 1, origin)
    ON CONFLICT (owner) DO UPDATE SET version = rv.version + 1
    RETURNING rv.version INTO v;
    PERFORM pg_notify('presenced_roster', v::text || ' ' || p_owner);
    RETURN v;
END
$$;

CREATE FUNCTION presenced_roster_items_versioned() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND (NEW.owner <> OLD.owner OR NEW.contact <> OLD.contact) THEN
        RAISE EXCEPTION 'a roster item''s owner and contact cannot change: delete it and insert a new one'
            USING ERRCODE = 'check_violation', CONSTRAINT = 'roster_item_identity_fixed';
    END IF;
    NEW.version := presenced_roster_bump(NEW.owner);
    DELETE FROM roster_tombstones WHERE owner = NEW.owner AND contact = NEW.contact;
    RETURN NEW;
END
$$;

CREATE TRIGGER roster_items_versioned
    BEFORE INSERT OR UPDATE ON roster_items
    FOR EACH ROW EXECUTE FUNCTION presenced_roster_items_versioned();

CREATE FUNCTION presenced_roster_items_tombstone() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v bigint;
BEGIN
    -- Deleted together with its account: there is no roster left to version.
    IF NOT EXISTS (SELECT 1 FROM accounts WHERE jid = OLD.owner) THEN
        RETURN NULL;
    END IF;
    v := presenced_roster_bump(OLD.owner);
    INSERT INTO roster_tombstones (owner, contact, version)
    VALUES (OLD.owner, OLD.contact, v)
    ON CONFLICT (owner, contact) DO UPDATE
        SET version = EXCLUDED.version, removed_at = EXCLUDED.removed_at;
    RETURN NULL;
END
$$;

CREATE TRIGGER roster_items_tombstone
    AFTER DELETE ON roster_items
    FOR EACH ROW EXECUTE FUNCTION presenced_roster_items_tombstone();

-- Every account has a version counter from the start, so its first roster (empty) has a
-- version a client can cache.
CREATE FUNCTION presenced_account_roster_version() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    origin bigint := presenced_version_origin();
BEGIN
    INSERT INTO roster_versions (owner, version, floor)
    VALUES (NEW.jid, origin, origin)
    ON CONFLICT (owner) DO NOTHING;
    RETURN NULL;
END
$$;

CREATE TRIGGER accounts_roster_version
    AFTER INSERT ON accounts
    FOR EACH ROW EXECUTE FUNCTION presenced_account_roster_version();
