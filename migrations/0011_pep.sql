-- XEP-0163 personal eventing: each account's own pubsub service on its bare JID.
-- A node is created by its first publish (XEP-0163 §3) with the access model of its
-- publish-options, `presence` by default; items are kept newest first up to `[limits]
-- max_pep_items` per node (the oldest rolls out, XEP-0060 §7.1.1) and `max_pep_nodes`
-- nodes per account, both checked by the store's one publish. Deleting the account
-- deletes both; a block deletes nothing.

CREATE TABLE pep_nodes (
    owner        text NOT NULL REFERENCES accounts (jid) ON DELETE CASCADE,
    node         text NOT NULL CHECK (node <> ''),
    access_model text NOT NULL DEFAULT 'presence'
                 CONSTRAINT pep_nodes_access_model CHECK (access_model IN ('open', 'presence', 'whitelist')),
    PRIMARY KEY (owner, node)
);

CREATE TABLE pep_items (
    owner        text NOT NULL,
    node         text NOT NULL,
    item_id      text NOT NULL,
    -- The item's payload element, serialised for a client stream.
    payload      text NOT NULL,
    -- Publication order within the node: a republished id becomes the newest.
    seq          bigint NOT NULL,
    published_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (owner, node, item_id),
    FOREIGN KEY (owner, node) REFERENCES pep_nodes (owner, node) ON DELETE CASCADE
);

CREATE INDEX pep_items_order ON pep_items (owner, node, seq);
