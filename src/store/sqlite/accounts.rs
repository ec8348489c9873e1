//! Accounts, SCRAM credentials and server secrets on SQLite (twin of `store/accounts.rs`).

use sqlx::Row;

use super::roster::{item_from_row, ITEM_COLUMNS};
use super::Pools;
use crate::protocol::sasl::scram::{ScramHash, StoredCredentials};
use crate::store::accounts::hash_column;
use crate::store::{DeletedAccount, StoreError, StoreLimits};

/// Inserts or replaces the credentials of one account inside a write transaction.
async fn put_credentials(
    tx: &mut sqlx::SqliteConnection,
    account_id: i64,
    creds: &[(ScramHash, StoredCredentials)],
) -> Result<(), StoreError> {
    for (hash, c) in creds {
        let iterations = i32::try_from(c.iterations).map_err(|_| StoreError::InvalidIterations)?;
        sqlx::query(
            "INSERT INTO scram_credentials
                 (account_id, hash, salt, iterations, stored_key, server_key)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)
             ON CONFLICT (account_id, hash) DO UPDATE
                 SET salt = excluded.salt, iterations = excluded.iterations,
                     stored_key = excluded.stored_key, server_key = excluded.server_key",
        )
        .bind(account_id)
        .bind(hash_column(*hash))
        .bind(&c.salt)
        .bind(iterations)
        .bind(&c.stored_key)
        .bind(&c.server_key)
        .execute(&mut *tx)
        .await?;
    }
    Ok(())
}

impl Pools {
    pub(in crate::store) async fn create_account(
        &self,
        username: &str,
        domain: &str,
        creds: &[(ScramHash, StoredCredentials)],
    ) -> Result<(), StoreError> {
        let mut tx = self.begin_write().await?;
        let id: Option<i64> = sqlx::query_scalar(
            "INSERT INTO accounts (username, domain) VALUES (?1, ?2)
             ON CONFLICT DO NOTHING
             RETURNING id",
        )
        .bind(username)
        .bind(domain)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(id) = id else {
            return Err(StoreError::AccountExists);
        };
        put_credentials(&mut tx, id, creds).await?;
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
        let id = account_id(&mut tx, username, domain).await?;
        let Some(id) = id else {
            return Ok(false);
        };
        put_credentials(&mut tx, id, creds).await?;
        tx.commit().await?;
        Ok(true)
    }

    pub(in crate::store) async fn delete_account(
        &self,
        username: &str,
        domain: &str,
        local: &[String],
        limits: &StoreLimits,
    ) -> Result<Option<DeletedAccount>, StoreError> {
        let jid = format!("{username}@{domain}");
        let local = serde_json::to_string(local)
            .map_err(|e| StoreError::Corrupt(format!("domains: {e}")))?;
        // The write lock from the start: no roster writer runs until this commits.
        let mut tx = self.begin_write().await?;
        let id = account_id(&mut tx, username, domain).await?;
        let Some(id) = id else {
            return Ok(None);
        };
        let rows = sqlx::query(&format!(
            "SELECT {ITEM_COLUMNS} FROM roster_items ri WHERE ri.owner = ?1 ORDER BY ri.contact"
        ))
        .bind(&jid)
        .fetch_all(&mut *tx)
        .await?;
        let mut items = Vec::with_capacity(rows.len());
        for row in &rows {
            items.extend(item_from_row(&jid, row, limits)?);
        }
        let waiting: Vec<String> = sqlx::query_scalar(
            "SELECT sender FROM pending_subscriptions WHERE owner = ?1 ORDER BY sender",
        )
        .bind(&jid)
        .fetch_all(&mut *tx)
        .await?;
        let mut owners: Vec<String> = sqlx::query_scalar(
            "DELETE FROM roster_items
             WHERE contact = ?1 AND owner <> ?1
               AND owner IN (SELECT jid FROM accounts
                             WHERE domain IN (SELECT value FROM json_each(?2)))
             RETURNING owner",
        )
        .bind(&jid)
        .bind(&local)
        .fetch_all(&mut *tx)
        .await?;
        owners.sort();
        owners.dedup();
        let mut removed_from = Vec::with_capacity(owners.len());
        for owner in owners {
            let version: i64 =
                sqlx::query_scalar("SELECT version FROM roster_versions WHERE owner = ?1")
                    .bind(&owner)
                    .fetch_one(&mut *tx)
                    .await?;
            removed_from.push((owner, version));
        }
        let mut withdrawn: Vec<String> = sqlx::query_scalar(
            "DELETE FROM pending_subscriptions
             WHERE sender = ?1
               AND owner IN (SELECT jid FROM accounts
                             WHERE domain IN (SELECT value FROM json_each(?2)))
             RETURNING owner",
        )
        .bind(&jid)
        .bind(&local)
        .fetch_all(&mut *tx)
        .await?;
        withdrawn.sort();
        sqlx::query("DELETE FROM accounts WHERE id = ?1")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Some(DeletedAccount {
            items,
            waiting,
            removed_from,
            withdrawn,
        }))
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
        Ok(Some(StoredCredentials {
            salt: row.try_get("salt")?,
            iterations: u32::try_from(iterations)
                .map_err(|_| StoreError::Corrupt(format!("iterations {iterations}")))?,
            stored_key: row.try_get("stored_key")?,
            server_key: row.try_get("server_key")?,
        }))
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

/// The id of account `username@domain`, or `None`; the caller's write transaction holds the
/// file's write lock, so the row cannot change before it commits.
async fn account_id(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    username: &str,
    domain: &str,
) -> Result<Option<i64>, StoreError> {
    Ok(
        sqlx::query_scalar("SELECT id FROM accounts WHERE username = ?1 AND domain = ?2")
            .bind(username)
            .bind(domain)
            .fetch_optional(&mut **tx)
            .await?,
    )
}
