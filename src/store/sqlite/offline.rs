//! SQLite twin of `store/offline.rs` (XEP-0160 messages kept for a user).

use super::{parse_time, Pools};
use crate::store::{stored_jid, OfflineMessage, StoreError};

impl Pools {
    pub(in crate::store) async fn store_offline_message(
        &self,
        owner: &str,
        sender: &str,
        stanza: &str,
        max: i64,
    ) -> Result<bool, StoreError> {
        // One writer: nothing can insert between the count and the insert.
        let mut tx = self.begin_write().await?;
        let result = sqlx::query(
            "INSERT INTO offline_messages (owner, sender, stanza)
             SELECT ?1, ?2, ?3
             WHERE (SELECT count(*) FROM offline_messages WHERE owner = ?1) < ?4",
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
