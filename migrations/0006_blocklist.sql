-- Block lists (XEP-0191). Each row is one JID the owner blocks: a full JID, a bare JID,
-- a domain or a domain/resource, matched by the rules of XEP-0016 §2.1 (see
-- Store::is_blocked). Values are normalised JIDs as the server stores them everywhere.
--
-- Every change sends NOTIFY presenced_block with the owner's bare JID as payload, so
-- other nodes drop their cached copy of that list, also when an operator edits it in SQL.

CREATE TABLE blocklist (
    owner   text NOT NULL REFERENCES accounts (jid) ON DELETE CASCADE,
    blocked text NOT NULL,
    PRIMARY KEY (owner, blocked),
    -- [localpart@]domain[/resource]. Localpart and domain contain no '@', '/' or
    -- whitespace; a resource may contain anything but must not be empty (RFC 7622 §3.4:
    -- a resourcepart is an OpaqueString, so "laptop 2" is a valid resource).
    CONSTRAINT blocklist_blocked_is_jid
        CHECK (blocked ~ '^([^@/[:space:]]+@)?[^@/[:space:]]+(/.+)?$'),
    -- RFC 7622 §3: each part is at most 1023 octets.
    CONSTRAINT blocklist_blocked_length CHECK (octet_length(blocked) <= 3071 + 2)
);

CREATE FUNCTION presenced_blocklist_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- PostgreSQL folds identical notifications within one transaction, so a change of
    -- many rows announces each owner once.
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        PERFORM pg_notify('presenced_block', OLD.owner);
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        PERFORM pg_notify('presenced_block', NEW.owner);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER blocklist_notify
    AFTER INSERT OR UPDATE OR DELETE ON blocklist
    FOR EACH ROW EXECUTE FUNCTION presenced_blocklist_notify();
