//! Accounts, SCRAM credentials and server secrets on SQLite (twin of `store/accounts.rs`).

use sqlx::Row;

use super::roster::{item_from_row, ITEM_COLUMNS};
use super::Pools;
use crate::protocol::sasl::scram::{ScramHash, StoredCredentials};
use crate::store::accounts::{
    create, credentials_from_row, delete, hash_column, iterations_column, set_credentials,
    AccountSql,
};
use crate::store::{DeletedAccount, RosterItem, StoreError, StoreLimits};

/// The statements on accounts (`store/accounts.rs` holds the rules). The caller's write
/// transaction holds the file's write lock, so no row read can change before it commits.
impl AccountSql for sqlx::SqliteConnection {
    async fn insert_account(
        &mut self,
        username: &str,
        domain: &str,
    ) -> Result<Option<i64>, StoreError> {
        Ok(sqlx::query_scalar(
            "INSERT INTO accounts (username, domain) VALUES (?1, ?2)
             ON CONFLICT DO NOTHING
             RETURNING id",
        )
        .bind(username)
        .bind(domain)
        .fetch_optional(&mut *self)
        .await?)
    }

    async fn lock_account(
        &mut self,
        username: &str,
        domain: &str,
    ) -> Result<Option<i64>, StoreError> {
        Ok(
            sqlx::query_scalar("SELECT id FROM accounts WHERE username = ?1 AND domain = ?2")
                .bind(username)
                .bind(domain)
                .fetch_optional(&mut *self)
                .await?,
        )
    }

    async fn put_credentials(
        &mut self,
        id: i64,
        creds: &[(ScramHash, StoredCredentials)],
    ) -> Result<(), StoreError> {
        for (hash, c) in creds {
            let iterations = iterations_column(c.iterations)?;
            sqlx::query(crate::store::accounts::UPSERT_CREDENTIALS)
                .bind(id)
                .bind(hash_column(*hash))
                .bind(&c.salt)
                .bind(iterations)
                .bind(&c.stored_key)
                .bind(&c.server_key)
                .execute(&mut *self)
                .await?;
        }
        Ok(())
    }

    async fn own_items(
        &mut self,
        jid: &str,
        limits: &StoreLimits,
    ) -> Result<Vec<RosterItem>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {ITEM_COLUMNS} FROM roster_items ri WHERE ri.owner = ?1 ORDER BY ri.contact"
        ))
        .bind(jid)
        .fetch_all(&mut *self)
        .await?;
        let mut items = Vec::with_capacity(rows.len());
        for row in &rows {
            items.extend(item_from_row(jid, row, limits)?);
        }
        Ok(items)
    }

    async fn waiting_for(&mut self, jid: &str) -> Result<Vec<String>, StoreError> {
        Ok(sqlx::query_scalar(
            "SELECT sender FROM pending_subscriptions WHERE owner = ?1 ORDER BY sender",
        )
        .bind(jid)
        .fetch_all(&mut *self)
        .await?)
    }

    async fn remove_from_others(
        &mut self,
        jid: &str,
        local: &[String],
    ) -> Result<Vec<String>, StoreError> {
        Ok(sqlx::query_scalar(
            "DELETE FROM roster_items
             WHERE contact = ?1 AND owner <> ?1
               AND owner IN (SELECT jid FROM accounts
                             WHERE domain IN (SELECT value FROM json_each(?2)))
             RETURNING owner",
        )
        .bind(jid)
        .bind(domains(local)?)
        .fetch_all(&mut *self)
        .await?)
    }

    async fn versions(&mut self, owners: &[String]) -> Result<Vec<(String, i64)>, StoreError> {
        let mut versions = Vec::with_capacity(owners.len());
        for owner in owners {
            let version: i64 =
                sqlx::query_scalar("SELECT version FROM roster_versions WHERE owner = ?1")
                    .bind(owner)
                    .fetch_one(&mut *self)
                    .await?;
            versions.push((owner.clone(), version));
        }
        Ok(versions)
    }

    async fn withdraw(&mut self, jid: &str, local: &[String]) -> Result<Vec<String>, StoreError> {
        Ok(sqlx::query_scalar(
            "DELETE FROM pending_subscriptions
             WHERE sender = ?1
               AND owner IN (SELECT jid FROM accounts
                             WHERE domain IN (SELECT value FROM json_each(?2)))
             RETURNING owner",
        )
        .bind(jid)
        .bind(domains(local)?)
        .fetch_all(&mut *self)
        .await?)
    }

    async fn delete_account(&mut self, id: i64) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM accounts WHERE id = ?1")
            .bind(id)
            .execute(&mut *self)
            .await?;
        Ok(())
    }
}

/// The local domains as the JSON list `json_each` expands.
fn domains(local: &[String]) -> Result<String, StoreError> {
    serde_json::to_string(local).map_err(|e| StoreError::Corrupt(format!("domains: {e}")))
}

impl Pools {
    pub(in crate::store) async fn create_account(
        &self,
        username: &str,
        domain: &str,
        creds: &[(ScramHash, StoredCredentials)],
    ) -> Result<(), StoreError> {
        let mut tx = self.begin_write().await?;
        create(&mut *tx, username, domain, creds).await?;
        tx.commit().await?;
        Ok(())
    }

    pub(in crate::store) async fn set_password(
        &self,
        username: &str,
        domain: &str,
        creds: &[(ScramHash, StoredCredentials)],
    ) -> Result<bool, StoreError> {
        let mut tx = self.begin_write().await?;
        let found = set_credentials(&mut *tx, username, domain, creds).await?;
        if found {
            tx.commit().await?;
        }
        Ok(found)
    }

    pub(in crate::store) async fn delete_account(
        &self,
        username: &str,
        domain: &str,
        local: &[String],
        limits: &StoreLimits,
    ) -> Result<Option<DeletedAccount>, StoreError> {
        // The write lock from the start: no roster writer runs until this commits.
        let mut tx = self.begin_write().await?;
        let deleted = delete(&mut *tx, username, domain, local, limits).await?;
        if deleted.is_some() {
            tx.commit().await?;
        }
        Ok(deleted)
    }

    pub(in crate::store) async fn list_accounts(
        &self,
        domain: Option<&str>,
    ) -> Result<Vec<String>, StoreError> {
        let jids = sqlx::query_scalar(
            "SELECT username || '@' || domain FROM accounts \
             WHERE ?1 IS NULL OR domain = ?1 ORDER BY domain, username",
        )
        .bind(domain)
        .fetch_all(&self.read)
        .await?;
        Ok(jids)
    }

    pub(in crate::store) async fn account_exists(
        &self,
        username: &str,
        domain: &str,
    ) -> Result<bool, StoreError> {
        let exists: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM accounts WHERE username = ?1 AND domain = ?2)",
        )
        .bind(username)
        .bind(domain)
        .fetch_one(&self.read)
        .await?;
        Ok(exists)
    }

    pub(in crate::store) async fn scram_credentials(
        &self,
        username: &str,
        domain: &str,
        hash: ScramHash,
    ) -> Result<Option<StoredCredentials>, StoreError> {
        let row = sqlx::query(
            "SELECT c.salt, c.iterations, c.stored_key, c.server_key
             FROM scram_credentials c JOIN accounts a ON a.id = c.account_id
             WHERE a.username = ?1 AND a.domain = ?2 AND c.hash = ?3",
        )
        .bind(username)
        .bind(domain)
        .bind(hash_column(hash))
        .fetch_optional(&self.read)
        .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let iterations: i64 = row.try_get("iterations")?;
        credentials_from_row(&row, iterations).map(Some)
    }

    pub(in crate::store) async fn server_secret(
        &self,
        name: &str,
        fresh: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        sqlx::query(
            "INSERT INTO server_secrets (name, value) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
        )
        .bind(name)
        .bind(fresh)
        .execute(&self.write)
        .await?;
        let value: Vec<u8> = sqlx::query_scalar("SELECT value FROM server_secrets WHERE name = ?1")
            .bind(name)
            .fetch_one(&self.read)
            .await?;
        Ok(value)
    }
}
