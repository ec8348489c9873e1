-- XEP-0163 personal eventing, as in the PostgreSQL schema's pep_nodes and pep_items: a
-- node per (owner, node) with its access model, its items in publication order (`seq`).
-- The single writer serialises the node and item counts checked by the one publish.
-- published_at is 'YYYY-MM-DDTHH:MM:SS.sssZ'.
CREATE TABLE pep_nodes (
    owner        TEXT NOT NULL REFERENCES accounts (jid) ON DELETE CASCADE,
    node         TEXT NOT NULL CHECK (node <> ''),
    access_model TEXT NOT NULL DEFAULT 'presence'
                 CONSTRAINT pep_nodes_access_model CHECK (access_model IN ('open', 'presence', 'whitelist')),
    PRIMARY KEY (owner, node)
);

CREATE TABLE pep_items (
    owner        TEXT NOT NULL,
    node         TEXT NOT NULL,
    item_id      TEXT NOT NULL,
    payload      TEXT NOT NULL,
    seq          INTEGER NOT NULL,
    published_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (owner, node, item_id),
    FOREIGN KEY (owner, node) REFERENCES pep_nodes (owner, node) ON DELETE CASCADE
);

CREATE INDEX pep_items_order ON pep_items (owner, node, seq);
