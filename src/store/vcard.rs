//! XEP-0054 vcard-temp: each account's own vCard, table `vcards` (the SQLite twin:
//! `sqlite/vcard.rs`). The vCard is kept without its PHOTO, which is the account's
//! XEP-0084 avatar in its PEP nodes (`crate::services::pep::vcard`, XEP-0398). Who may read it is
//! decided above the store; the row goes with the account (`ON DELETE CASCADE`).

use super::{pg_or_sqlite, Store, StoreError};

impl Store {
    /// `owner`'s stored vCard (serialised), `None` when the user never set one.
    pub async fn vcard(&self, owner: &str) -> Result<Option<String>, StoreError> {
        let pool = pg_or_sqlite!(self, |db| db.vcard(owner));
        Ok(
            sqlx::query_scalar("SELECT vcard FROM vcards WHERE owner = $1")
                .bind(owner)
                .fetch_optional(pool)
                .await?,
        )
    }

    /// Stores `vcard` (serialised, its size already checked) as `owner`'s, replacing the
    /// one before.
    pub async fn set_vcard(&self, owner: &str, vcard: &str) -> Result<(), StoreError> {
        let pool = pg_or_sqlite!(self, |db| db.set_vcard(owner, vcard));
        sqlx::query(
            "INSERT INTO vcards (owner, vcard) VALUES ($1, $2)
             ON CONFLICT (owner) DO UPDATE SET vcard = excluded.vcard, updated_at = now()",
        )
        .bind(owner)
        .bind(vcard)
        .execute(pool)
        .await?;
        Ok(())
    }
}
