//! XEP-0357 push registrations (table `push_registrations`): which app server and node
//! each client installation of an account asked to be woken through, and the publish
//! options to send with each notification. What is sent, and when, is
//! [`crate::services::push`]'s.
//!
//! The rules, written once for both backends (the statements are the same text on both,
//! times being Unix seconds, so one macro body implements [`PushSql`] for each):
//! - Enabling the same app server and node again replaces the row's options and resource
//!   (a client re-enables on every login).
//! - An account keeps at most `max` registrations; one more drops the least recently
//!   enabled.
//! - Disabling without a node removes every node of that app server (XEP-0357 §6).

use super::{in_write, pg_or_sqlite, Store, StoreError};

/// One stored registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushRegistration {
    /// Row id.
    pub id: i64,
    /// The app server's JID (XEP-0357 `jid`).
    pub app_jid: String,
    /// The node on it (XEP-0357 `node`).
    pub node: String,
    /// The resource whose client enabled it.
    pub resource: String,
    /// The publish options as the client gave them (a serialized data form), or empty.
    pub options: String,
}

/// A registration to keep.
#[derive(Debug, Clone, Copy)]
pub struct Enable<'a> {
    /// The app server's JID.
    pub app_jid: &'a str,
    /// The node on it.
    pub node: &'a str,
    /// The resource whose client enables it.
    pub resource: &'a str,
    /// The publish options, serialized, or empty.
    pub options: &'a str,
    /// Now, Unix seconds.
    pub now: i64,
    /// Registrations the account keeps.
    pub max: i64,
}

/// The push statements of one backend's connection, inside the caller's transaction.
pub(super) trait PushSql {
    /// The id of account `username@domain`, or `None`.
    async fn account_id(&mut self, username: &str, domain: &str)
        -> Result<Option<i64>, StoreError>;
    /// Inserts or refreshes the registration, then drops the account's oldest beyond `max`.
    async fn upsert(&mut self, account: i64, e: &Enable<'_>) -> Result<(), StoreError>;
    /// Deletes the account's registrations at `app_jid`, of one node or all; how many.
    async fn delete(
        &mut self,
        account: i64,
        app_jid: &str,
        node: Option<&str>,
    ) -> Result<u64, StoreError>;
}

const ACCOUNT_ID: &str = "SELECT id FROM accounts WHERE username = $1 AND domain = $2";
const UPSERT: &str = "INSERT INTO push_registrations
     (account_id, app_jid, node, resource, options, enabled_at)
 VALUES ($1, $2, $3, $4, $5, $6)
 ON CONFLICT (account_id, app_jid, node) DO UPDATE
 SET resource = excluded.resource, options = excluded.options, enabled_at = excluded.enabled_at";
const PRUNE: &str = "DELETE FROM push_registrations
 WHERE account_id = $1 AND id NOT IN (
     SELECT id FROM push_registrations WHERE account_id = $1
     ORDER BY enabled_at DESC, id DESC LIMIT $2)";
const DELETE: &str = "DELETE FROM push_registrations
 WHERE account_id = $1 AND app_jid = $2 AND ($3 IS NULL OR node = $3)";
const REGISTRATIONS: &str = "SELECT p.id, p.app_jid, p.node, p.resource, p.options
 FROM push_registrations p JOIN accounts a ON a.id = p.account_id
 WHERE a.username = $1 AND a.domain = $2
 ORDER BY p.id";

/// One body of [`PushSql`] for each backend's connection: the statements are the same.
macro_rules! push_sql {
    ($conn:ty) => {
        impl PushSql for $conn {
            async fn account_id(
                &mut self,
                username: &str,
                domain: &str,
            ) -> Result<Option<i64>, StoreError> {
                Ok(sqlx::query_scalar(ACCOUNT_ID)
                    .bind(username)
                    .bind(domain)
                    .fetch_optional(&mut *self)
                    .await?)
            }

            async fn upsert(&mut self, account: i64, e: &Enable<'_>) -> Result<(), StoreError> {
                sqlx::query(UPSERT)
                    .bind(account)
                    .bind(e.app_jid)
                    .bind(e.node)
                    .bind(e.resource)
                    .bind(e.options)
                    .bind(e.now)
                    .execute(&mut *self)
                    .await?;
                sqlx::query(PRUNE)
                    .bind(account)
                    .bind(e.max.max(1))
                    .execute(&mut *self)
                    .await?;
                Ok(())
            }

            async fn delete(
                &mut self,
                account: i64,
                app_jid: &str,
                node: Option<&str>,
            ) -> Result<u64, StoreError> {
                Ok(sqlx::query(DELETE)
                    .bind(account)
                    .bind(app_jid)
                    .bind(node)
                    .execute(&mut *self)
                    .await?
                    .rows_affected())
            }
        }
    };
}

push_sql!(sqlx::PgConnection);
push_sql!(sqlx::SqliteConnection);

/// [`Store::enable_push`] inside the caller's transaction.
async fn enable<C: PushSql>(
    conn: &mut C,
    username: &str,
    domain: &str,
    e: &Enable<'_>,
) -> Result<bool, StoreError> {
    let Some(account) = conn.account_id(username, domain).await? else {
        return Ok(false);
    };
    conn.upsert(account, e).await?;
    Ok(true)
}

/// [`Store::disable_push`] inside the caller's transaction.
async fn disable<C: PushSql>(
    conn: &mut C,
    username: &str,
    domain: &str,
    target: (&str, Option<&str>),
) -> Result<u64, StoreError> {
    let Some(account) = conn.account_id(username, domain).await? else {
        return Ok(0);
    };
    conn.delete(account, target.0, target.1).await
}

type Row = (i64, String, String, String, String);

fn from_row((id, app_jid, node, resource, options): Row) -> PushRegistration {
    PushRegistration {
        id,
        app_jid,
        node,
        resource,
        options,
    }
}

impl Store {
    /// Keeps a registration of account `username@domain` under this module's rules; false
    /// without such an account.
    pub async fn enable_push(
        &self,
        username: &str,
        domain: &str,
        e: Enable<'_>,
    ) -> Result<bool, StoreError> {
        in_write!(self, "enable_push", enable(username, domain, &e))
    }

    /// Removes the account's registrations at `app_jid`, of `node` or every node; how many.
    pub async fn disable_push(
        &self,
        username: &str,
        domain: &str,
        app_jid: &str,
        node: Option<&str>,
    ) -> Result<u64, StoreError> {
        in_write!(
            self,
            "disable_push",
            disable(username, domain, (app_jid, node))
        )
    }

    /// The registrations of account `username@domain`, oldest first.
    pub async fn push_registrations(
        &self,
        username: &str,
        domain: &str,
    ) -> Result<Vec<PushRegistration>, StoreError> {
        let read = |rows: Vec<Row>| rows.into_iter().map(from_row).collect();
        let pool = pg_or_sqlite!(self, "push_registrations", |db| async {
            let rows = sqlx::query_as(REGISTRATIONS)
                .bind(username)
                .bind(domain)
                .fetch_all(db.reader())
                .await?;
            Ok(read(rows))
        });
        let rows = sqlx::query_as(REGISTRATIONS)
            .bind(username)
            .bind(domain)
            .fetch_all(pool)
            .await?;
        Ok(read(rows))
    }
}
