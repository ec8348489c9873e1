-- XEP-0357 push registrations, as in the PostgreSQL schema's migration 0015.
CREATE TABLE push_registrations (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    account_id INTEGER NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
    app_jid    TEXT    NOT NULL CHECK (app_jid <> '' AND length(CAST(app_jid AS BLOB)) <= 3071),
    node       TEXT    NOT NULL CHECK (node <> '' AND length(CAST(node AS BLOB)) <= 1024),
    resource   TEXT    NOT NULL,
    options    TEXT    NOT NULL,
    enabled_at INTEGER NOT NULL,
    UNIQUE (account_id, app_jid, node)
);
