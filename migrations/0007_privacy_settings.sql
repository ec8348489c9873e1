-- Presence and last-seen visibility settings (see src/presence/privacy.rs for what they
-- mean). One row per account that changed a default; no row means both signals are
-- visible to approved subscribers, which is plain RFC 6121.
--
-- Each signal has a mode and an exception list. The list is meaningful only for
-- 'contacts_except', and the schema refuses a list with any other mode, so a stored row
-- has exactly one reading. List entries are distinct bare JIDs.
--
-- Every change sends NOTIFY presenced_privacy with the owner's bare JID as payload, so
-- other nodes drop their cached copy.

-- True when every element is a bare JID ([localpart@]domain), none repeats, no NULLs.
CREATE FUNCTION presenced_bare_jid_list_valid(l text[]) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN l IS NULL THEN false
        WHEN cardinality(l) = 0 THEN true
        WHEN array_ndims(l) <> 1 THEN false
        ELSE array_position(l, NULL) IS NULL
             AND (SELECT bool_and(x ~ '^([^@/[:space:]]+@)?[^@/[:space:]]+$') FROM unnest(l) AS x)
             AND (SELECT count(DISTINCT x) FROM unnest(l) AS x) = cardinality(l)
    END
$$;

CREATE TABLE privacy_settings (
    owner            text   PRIMARY KEY REFERENCES accounts (jid) ON DELETE CASCADE,
    online           text   NOT NULL DEFAULT 'subscribers',
    last_seen        text   NOT NULL DEFAULT 'subscribers',
    online_except    text[] NOT NULL DEFAULT '{}',
    last_seen_except text[] NOT NULL DEFAULT '{}',
    CONSTRAINT privacy_online_valid
        CHECK (online IN ('subscribers', 'contacts_except', 'nobody')),
    CONSTRAINT privacy_last_seen_valid
        CHECK (last_seen IN ('subscribers', 'contacts_except', 'nobody')),
    CONSTRAINT privacy_online_except_only_with_mode
        CHECK (online = 'contacts_except' OR cardinality(online_except) = 0),
    CONSTRAINT privacy_last_seen_except_only_with_mode
        CHECK (last_seen = 'contacts_except' OR cardinality(last_seen_except) = 0),
    CONSTRAINT privacy_online_except_valid CHECK (presenced_bare_jid_list_valid(online_except)),
    CONSTRAINT privacy_last_seen_except_valid CHECK (presenced_bare_jid_list_valid(last_seen_except))
);

CREATE FUNCTION presenced_privacy_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        PERFORM pg_notify('presenced_privacy', OLD.owner);
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        PERFORM pg_notify('presenced_privacy', NEW.owner);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER privacy_settings_notify
    AFTER INSERT OR UPDATE OR DELETE ON privacy_settings
    FOR EACH ROW EXECUTE FUNCTION presenced_privacy_notify();
