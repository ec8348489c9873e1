-- SQL functions for operators who manage rosters with their own migrations. They keep
-- both sides of a relationship consistent; the roster triggers bump versions, keep
-- tombstones and notify online users.

-- Makes two local accounts mutual contacts (subscription 'both' on each side), keeping
-- any existing name and groups. Usage:
--   SELECT presenced_roster_make_mutual('alice@example.org', 'bob@example.org');
CREATE FUNCTION presenced_roster_make_mutual(a text, b text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF a = b THEN
        RAISE EXCEPTION 'an account cannot be its own mutual contact' USING ERRCODE = 'check_violation';
    END IF;
    INSERT INTO roster_items AS ri (owner, contact, subscription)
    VALUES (a, b, 'both'), (b, a, 'both')
    ON CONFLICT (owner, contact) DO UPDATE
        SET subscription = 'both', ask = NULL, pending_in = false, preapproved = false;
    DELETE FROM pending_subscriptions
    WHERE (owner = a AND sender = b) OR (owner = b AND sender = a);
END
$$;

-- Removes two accounts from each other's rosters (both sides leave a tombstone).
CREATE FUNCTION presenced_roster_unpair(a text, b text) RETURNS void
LANGUAGE sql AS $$
    DELETE FROM roster_items WHERE (owner = a AND contact = b) OR (owner = b AND contact = a);
    DELETE FROM pending_subscriptions WHERE (owner = a AND sender = b) OR (owner = b AND sender = a);
$$;
