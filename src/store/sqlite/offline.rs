//! SQLite twin of `store/offline.rs` (XEP-0160 messages kept for a user).

use super::{parse_time, Pools};
use crate::store::offline::{keep_if_room, Held, OfflineQuota, OfflineSql};
use crate::store::{stored_jid, OfflineMessage, StoreError};

/// The statements of keeping one message (`store/offline.rs` holds the rule).
impl OfflineSql for sqlx::SqliteConnection {
    async fn lock_owner(&mut self, _owner: &str) -> Result<(), StoreError> {
        // One writer: the caller's write transaction holds the file's write lock already.
        Ok(())
    }

    async fn held(&mut self, owner: &str, sender_bare: &str) -> Result<Held, StoreError> {
        let (items, bytes, sender_items, sender_bytes): (i64, i64, i64, i64) = sqlx::query_as(
            "SELECT count(*), coalesce(sum(bytes), 0),
                    coalesce(sum(CASE WHEN sender_bare = ?2 THEN 1 ELSE 0 END), 0),
                    coalesce(sum(CASE WHEN sender_bare = ?2 THEN bytes ELSE 0 END), 0)
             FROM offline_messages WHERE owner = ?1",
        )
        .bind(owner)
        .bind(sender_bare)
        .fetch_one(&mut *self)
        .await?;
        Ok(Held {
            items,
            bytes,
            sender_items,
            sender_bytes,
        })
    }

    async fn strangers(&mut self, owner: &str) -> Result<Vec<(i64, i64)>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT id, bytes FROM offline_messages
             WHERE owner = ?1 AND NOT from_contact ORDER BY id",
        )
        .bind(owner)
        .fetch_all(&mut *self)
        .await?)
    }

    async fn evict(&mut self, ids: &[i64]) -> Result<(), StoreError> {
        for id in ids {
            sqlx::query("DELETE FROM offline_messages WHERE id = ?1")
                .bind(id)
                .execute(&mut *self)
                .await?;
        }
        Ok(())
    }

    async fn insert(
        &mut self,
        owner: &str,
        sender: &str,
        stanza: &str,
        size: i64,
        from_contact: bool,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO offline_messages (owner, sender, sender_bare, stanza, bytes, from_contact)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        )
        .bind(owner)
        .bind(sender)
        .bind(crate::protocol::jid::bare_of(sender))
        .bind(stanza)
        .bind(size)
        .bind(from_contact)
        .execute(&mut *self)
        .await?;
        Ok(())
    }
}

impl Pools {
    pub(in crate::store) async fn store_offline_message(
        &self,
        owner: &str,
        sender: &str,
        stanza: &str,
        from_contact: bool,
        quota: &OfflineQuota,
    ) -> Result<bool, StoreError> {
        let mut tx = self.begin_write().await?;
        let kept = keep_if_room(&mut *tx, quota, owner, sender, stanza, from_contact).await?;
        if kept {
            tx.commit().await?;
        }
        Ok(kept)
    }

    pub(in crate::store) async fn offline_messages(
        &self,
        owner: &str,
    ) -> Result<Vec<(OfflineMessage, bool)>, StoreError> {
        let rows: Vec<(String, String, String, bool)> = sqlx::query_as(
            "SELECT sender, stanza, stored_at, from_contact FROM offline_messages
             WHERE owner = ?1 ORDER BY id",
        )
        .bind(owner)
        .fetch_all(&self.read)
        .await?;
        let mut kept = Vec::with_capacity(rows.len());
        for (sender, stanza, at, contact) in rows {
            if let Some(sender) = stored_jid("offline_messages", owner, &sender) {
                let message = OfflineMessage {
                    sender,
                    stanza,
                    stored_at: parse_time(&at)?,
                };
                kept.push((message, contact));
            }
        }
        Ok(kept)
    }

    pub(in crate::store) async fn import_offline_message(
        &self,
        owner: &str,
        message: &OfflineMessage,
        from_contact: bool,
    ) -> Result<(), StoreError> {
        let sender = message.sender.as_str();
        sqlx::query(
            "INSERT INTO offline_messages
                 (owner, sender, sender_bare, stanza, bytes, from_contact, stored_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        )
        .bind(owner)
        .bind(sender)
        .bind(crate::protocol::jid::bare_of(sender))
        .bind(&message.stanza)
        .bind(i64::try_from(message.stanza.len()).unwrap_or(i64::MAX))
        .bind(from_contact)
        .bind(super::time_text(message.stored_at))
        .execute(&self.write)
        .await?;
        Ok(())
    }

    pub(in crate::store) async fn take_offline_messages(
        &self,
        owner: &str,
    ) -> Result<Vec<OfflineMessage>, StoreError> {
        let mut rows: Vec<(i64, String, String, String)> = sqlx::query_as(
            "DELETE FROM offline_messages WHERE owner = ?1
             RETURNING id, sender, stanza, stored_at",
        )
        .bind(owner)
        .fetch_all(&self.write)
        .await?;
        rows.sort_unstable_by_key(|r| r.0);
        let mut kept = Vec::with_capacity(rows.len());
        for (_, sender, stanza, at) in rows {
            if let Some(sender) = stored_jid("offline_messages", owner, &sender) {
                kept.push(OfflineMessage {
                    sender,
                    stanza,
                    stored_at: parse_time(&at)?,
                });
            }
        }
        Ok(kept)
    }
}
