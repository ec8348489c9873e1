//! Accounts and their SCRAM credentials (table `accounts`, `scram_credentials`).
//!
//! Passwords are turned into salted SCRAM credentials for every [`ScramHash`] at once,
//! with a fresh random salt each, on a blocking thread (PBKDF2 is deliberately slow),
//! and never stored.

use rand::RngCore;
use sqlx::Row;

use super::{Store, StoreError};
use crate::sasl::scram::{self, ScramHash, StoredCredentials, SALT_LEN};

/// Database value of the `hash` column for a SCRAM variant.
fn hash_column(hash: ScramHash) -> &'static str {
    match hash {
        ScramHash::Sha1 => "sha1",
        ScramHash::Sha256 => "sha256",
    }
}

/// Checks the password and derives credentials for every hash off the async threads.
async fn derive_all(
    password: &str,
    iterations: u32,
) -> Result<Vec<(ScramHash, StoredCredentials)>, StoreError> {
    if !scram::password_is_preparable(password) {
        return Err(StoreError::InvalidPassword);
    }
    if iterations == 0 {
        return Err(StoreError::InvalidIterations);
    }
    let password = password.to_owned();
    let creds = tokio::task::spawn_blocking(move || {
        ScramHash::ALL
            .iter()
            .map(|&hash| {
                let mut salt = [0u8; SALT_LEN];
                rand::thread_rng().fill_bytes(&mut salt);
                (
                    hash,
                    scram::derive_credentials(hash, &password, &salt, iterations),
                )
            })
            .collect()
    })
    .await?;
    Ok(creds)
}

/// Inserts or replaces the credentials of one account inside a transaction.
async fn put_credentials(
    tx: &mut sqlx::PgConnection,
    account_id: i64,
    creds: &[(ScramHash, StoredCredentials)],
) -> Result<(), StoreError> {
    for (hash, c) in creds {
        let iterations = i32::try_from(c.iterations).map_err(|_| StoreError::InvalidIterations)?;
        sqlx::query(
            "INSERT INTO scram_credentials
                 (account_id, hash, salt, iterations, stored_key, server_key)
             VALUES ($1, $2, $3, $4, $5, $6)
             ON CONFLICT (account_id, hash) DO UPDATE
                 SET salt = EXCLUDED.salt, iterations = EXCLUDED.iterations,
                     stored_key = EXCLUDED.stored_key, server_key = EXCLUDED.server_key",
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

impl Store {
    /// Creates an account with SCRAM-SHA-1 and SCRAM-SHA-256 credentials for `password`.
    /// Fails with [`StoreError::AccountExists`] if the username is taken on that domain,
    /// and [`StoreError::Constraint`] if the username is not a valid localpart.
    pub async fn create_account(
        &self,
        username: &str,
        domain: &str,
        password: &str,
        iterations: u32,
    ) -> Result<(), StoreError> {
        let creds = derive_all(password, iterations).await?;
        let mut tx = self.pool.begin().await?;
        let inserted = sqlx::query(
            "INSERT INTO accounts (username, domain) VALUES ($1, $2)
             ON CONFLICT (username, domain) DO NOTHING
             RETURNING id",
        )
        .bind(username)
        .bind(domain)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = inserted else {
            return Err(StoreError::AccountExists);
        };
        let id: i64 = row.try_get("id")?;
        put_credentials(&mut tx, id, &creds).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Replaces the credentials of an account with ones for a new password (fresh
    /// salts). Returns false if there is no such account.
    pub async fn set_password(
        &self,
        username: &str,
        domain: &str,
        password: &str,
        iterations: u32,
    ) -> Result<bool, StoreError> {
        let creds = derive_all(password, iterations).await?;
        let mut tx = self.pool.begin().await?;
        let id: Option<i64> = sqlx::query_scalar(
            "SELECT id FROM accounts WHERE username = $1 AND domain = $2 FOR UPDATE",
        )
        .bind(username)
        .bind(domain)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(id) = id else {
            return Ok(false);
        };
        put_credentials(&mut tx, id, &creds).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Deletes an account; the schema cascades to its credentials, roster, roster
    /// version, tombstones and pending requests. Returns false if it did not exist.
    pub async fn delete_account(&self, username: &str, domain: &str) -> Result<bool, StoreError> {
        // Drops the gate's cached inputs this write may alter, on every way out.
        let _forget = self.forget_naming(format!("{username}@{domain}"));
        let result = sqlx::query("DELETE FROM accounts WHERE username = $1 AND domain = $2")
            .bind(username)
            .bind(domain)
            .execute(&self.pool)
            .await?;
        Ok(result.rows_affected() > 0)
    }

    /// Every account's bare JID, of one domain or all, in order.
    pub async fn list_accounts(&self, domain: Option<&str>) -> Result<Vec<String>, StoreError> {
        let jids = sqlx::query_scalar(
            "SELECT jid FROM accounts WHERE $1::text IS NULL OR domain = $1 ORDER BY domain, username",
        )
        .bind(domain)
        .fetch_all(&self.pool)
        .await?;
        Ok(jids)
    }

    /// Whether the account exists (e.g. to decide if an inbound stanza has a recipient).
    pub async fn account_exists(&self, username: &str, domain: &str) -> Result<bool, StoreError> {
        let exists: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM accounts WHERE username = $1 AND domain = $2)",
        )
        .bind(username)
        .bind(domain)
        .fetch_one(&self.pool)
        .await?;
        Ok(exists)
    }

    /// The stored SCRAM credentials for one hash, or None if the account (or that hash's
    /// credentials) does not exist: feed this to [`scram::ScramServer::server_first`].
    pub async fn scram_credentials(
        &self,
        username: &str,
        domain: &str,
        hash: ScramHash,
    ) -> Result<Option<StoredCredentials>, StoreError> {
        let row = sqlx::query(
            "SELECT c.salt, c.iterations, c.stored_key, c.server_key
             FROM scram_credentials c JOIN accounts a ON a.id = c.account_id
             WHERE a.username = $1 AND a.domain = $2 AND c.hash = $3",
        )
        .bind(username)
        .bind(domain)
        .bind(hash_column(hash))
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let iterations: i32 = row.try_get("iterations")?;
        Ok(Some(StoredCredentials {
            salt: row.try_get("salt")?,
            iterations: u32::try_from(iterations)
                .map_err(|_| StoreError::Corrupt(format!("iterations {iterations}")))?,
            stored_key: row.try_get("stored_key")?,
            server_key: row.try_get("server_key")?,
        }))
    }

    /// The server secret called `name`, created (32 random bytes) the first time any node
    /// asks and the same afterwards for every node and restart.
    pub async fn server_secret(&self, name: &str) -> Result<Vec<u8>, StoreError> {
        let mut fresh = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut fresh);
        sqlx::query(
            "INSERT INTO server_secrets (name, value) VALUES ($1, $2)
             ON CONFLICT (name) DO NOTHING",
        )
        .bind(name)
        .bind(&fresh[..])
        .execute(&self.pool)
        .await?;
        // A separate statement, so it sees a row another node inserted concurrently.
        let value: Vec<u8> = sqlx::query_scalar("SELECT value FROM server_secrets WHERE name = $1")
            .bind(name)
            .fetch_one(&self.pool)
            .await?;
        Ok(value)
    }
}
