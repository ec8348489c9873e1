//! Inbound subscription requests for users who were offline (RFC 6121 §3.1.3: the server
//! must deliver them when the user next becomes available), table
//! `pending_subscriptions`.

use super::{Store, StoreError};

impl Store {
    /// Keeps the request stanza from `from` (a bare JID) for `owner`. Returns false, and
    /// keeps the first one, if a request from `from` is already waiting.
    pub async fn add_pending_subscription(
        &self,
        owner: &str,
        from: &str,
        stanza_xml: &str,
    ) -> Result<bool, StoreError> {
        let result = sqlx::query(
            "INSERT INTO pending_subscriptions (owner, sender, stanza) VALUES ($1, $2, $3)
             ON CONFLICT (owner, sender) DO NOTHING",
        )
        .bind(owner)
        .bind(from)
        .bind(stanza_xml)
        .execute(&self.pool)
        .await?;
        Ok(result.rows_affected() == 1)
    }

    /// Requests waiting for `owner`, oldest first, as (from, stanza_xml).
    pub async fn pending_subscriptions(
        &self,
        owner: &str,
    ) -> Result<Vec<(String, String)>, StoreError> {
        let rows = sqlx::query_as(
            "SELECT sender, stanza FROM pending_subscriptions
             WHERE owner = $1 ORDER BY received_at, sender",
        )
        .bind(owner)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows)
    }

    /// Drops the request from `from` once the user answered it (subscribed/unsubscribed)
    /// or the contact cancelled it. Returns false if none was waiting.
    pub async fn remove_pending_subscription(
        &self,
        owner: &str,
        from: &str,
    ) -> Result<bool, StoreError> {
        let result =
            sqlx::query("DELETE FROM pending_subscriptions WHERE owner = $1 AND sender = $2")
                .bind(owner)
                .bind(from)
                .execute(&self.pool)
                .await?;
        Ok(result.rows_affected() > 0)
    }
}
