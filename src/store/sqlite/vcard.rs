//! SQLite twin of `store/vcard.rs` (XEP-0054 vCards).

use super::Pools;
use crate::store::StoreError;

impl Pools {
    pub(in crate::store) async fn vcard(&self, owner: &str) -> Result<Option<String>, StoreError> {
        Ok(
            sqlx::query_scalar("SELECT vcard FROM vcards WHERE owner = ?1")
                .bind(owner)
                .fetch_optional(&self.read)
                .await?,
        )
    }

    pub(in crate::store) async fn set_vcard(
        &self,
        owner: &str,
        vcard: &str,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO vcards (owner, vcard) VALUES (?1, ?2)
             ON CONFLICT (owner) DO UPDATE SET vcard = excluded.vcard,
                 updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')",
        )
        .bind(owner)
        .bind(vcard)
        .execute(&self.write)
        .await?;
        Ok(())
    }
}
