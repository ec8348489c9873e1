-- XEP-0357 push registrations: the app server (`app_jid`) and node a client installation
-- of the account named when it enabled push, and the publish options (its secret form,
-- as XML) to send with every notification. They outlive the session that enabled them:
-- a phone whose session is gone is still woken for what is kept for it. The client's
-- disable removes a row, and so does an app server that answers errors
-- (src/services/push.rs); deleting the account cascades. Times are Unix seconds, as in
-- the SQLite schema, so both run the same statements (src/store/push.rs).
CREATE TABLE push_registrations (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    account_id bigint NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
    app_jid    text   NOT NULL CHECK (app_jid <> '' AND octet_length(app_jid) <= 3071),
    node       text   NOT NULL CHECK (node <> '' AND octet_length(node) <= 1024),
    -- The resource that enabled it, for operators and the session list.
    resource   text   NOT NULL,
    options    text   NOT NULL,
    enabled_at bigint NOT NULL,
    UNIQUE (account_id, app_jid, node)
);
