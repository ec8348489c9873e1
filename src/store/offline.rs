//! Messages waiting for a user with no available resource (XEP-0160), table
//! `offline_messages` (the SQLite twin: `sqlite/offline.rs`).
//!
//! Two operations, each one transaction: [`Store::store_offline_message`] keeps a message
//! unless the owner already has `max_offline_messages` waiting, and
//! [`Store::take_offline_messages`] hands them all out, oldest first, and deletes them in
//! the same statement, so two resources coming online together never both get one.
//! Which messages are kept and how they are stamped on the way out is decided above the
//! store (`crate::offline`, `crate::delivery`).

use chrono::{DateTime, Utc};

use ::jid::Jid;

use super::{pg_or_sqlite, stored_jid, Store, StoreError};

/// A message handed out of offline storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OfflineMessage {
    /// The sender as stamped on the message: a full JID, or a bare or domain JID from
    /// another server.
    pub sender: Jid,
    /// The message as stored (client-stream XML).
    pub stanza: String,
    /// When it was stored: the XEP-0203 stamp of its delivery.
    pub stored_at: DateTime<Utc>,
}

impl Store {
    /// Keeps `stanza` from `sender` for `owner` (a bare JID). Returns false, keeping
    /// nothing, when `owner` already has [`StoreLimits::max_offline_messages`] waiting;
    /// [`StoreError::NoSuchAccount`] when `owner` is not an account.
    ///
    /// [`StoreLimits::max_offline_messages`]: super::StoreLimits::max_offline_messages
    pub async fn store_offline_message(
        &self,
        owner: &str,
        sender: &str,
        stanza: &str,
    ) -> Result<bool, StoreError> {
        let max = i64::try_from(self.limits().max_offline_messages).unwrap_or(i64::MAX);
        let pool = pg_or_sqlite!(self, |db| db
            .store_offline_message(owner, sender, stanza, max));
        let mut tx = pool.begin().await?;
        // Serialises writers for one owner so the count below cannot change before the
        // insert; an advisory lock, so nothing else about the account is held.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('offline:' || $1, 0))")
            .bind(owner)
            .execute(&mut *tx)
            .await?;
        let result = sqlx::query(
            "INSERT INTO offline_messages (owner, sender, stanza)
             SELECT $1, $2, $3
             WHERE (SELECT count(*) FROM offline_messages WHERE owner = $1) < $4",
        )
        .bind(owner)
        .bind(sender)
        .bind(stanza)
        .bind(max)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(result.rows_affected() == 1)
    }

    /// Every message waiting for `owner`, oldest first, deleted as they are returned.
    pub async fn take_offline_messages(
        &self,
        owner: &str,
    ) -> Result<Vec<OfflineMessage>, StoreError> {
        let pool = pg_or_sqlite!(self, |db| db.take_offline_messages(owner));
        let mut rows: Vec<(i64, String, String, DateTime<Utc>)> = sqlx::query_as(
            "DELETE FROM offline_messages WHERE owner = $1
             RETURNING id, sender, stanza, stored_at",
        )
        .bind(owner)
        .fetch_all(pool)
        .await?;
        // RETURNING has no order of its own.
        rows.sort_unstable_by_key(|r| r.0);
        Ok(rows
            .into_iter()
            .filter_map(|(_, sender, stanza, stored_at)| {
                Some(OfflineMessage {
                    sender: stored_jid("offline_messages", owner, &sender)?,
                    stanza,
                    stored_at,
                })
            })
            .collect())
    }
}
