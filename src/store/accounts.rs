//! Accounts and their SCRAM credentials (table `accounts`, `scram_credentials`).
//!
//! Passwords are turned into salted SCRAM credentials for every [`ScramHash`] at once,
//! with a fresh random salt each, on a blocking thread (PBKDF2 is deliberately slow),
//! and never stored.

use rand::RngCore;
use sqlx::Row;

use super::{pg_or_sqlite, RosterItem, Store, StoreError};
use crate::protocol::sasl::scram::{self, ScramHash, StoredCredentials, SALT_LEN};

/// What deleting an account removed that others must hear of: the server tells them as
/// if the user had removed each roster item (RFC 6121 §2.5.2).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeletedAccount {
    /// The account's own roster items as they were.
    pub items: Vec<RosterItem>,
    /// Who had a subscription request waiting for the account (RFC 6121 §3.1.3), with or
    /// without an item, in order.
    pub waiting: Vec<String>,
    /// The local users whose item for the account was removed, in order, with their
    /// roster version after the removal.
    pub removed_from: Vec<(String, i64)>,
    /// The local users a request of the account's was waiting for (gone with it), in
    /// order.
    pub withdrawn: Vec<String>,
}

/// Database value of the `hash` column for a SCRAM variant.
pub(super) fn hash_column(hash: ScramHash) -> &'static str {
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
        self.import_account(username, domain, &creds).await
    }

    /// Creates an account with credentials derived elsewhere (another store's, when
    /// copying); the errors of [`Store::create_account`].
    pub async fn import_account(
        &self,
        username: &str,
        domain: &str,
        creds: &[(ScramHash, StoredCredentials)],
    ) -> Result<(), StoreError> {
        let pool = pg_or_sqlite!(self, |db| db.create_account(username, domain, creds));
        let mut tx = pool.begin().await?;
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
        put_credentials(&mut tx, id, creds).await?;
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
        let pool = pg_or_sqlite!(self, |db| db.set_password(username, domain, &creds));
        let mut tx = pool.begin().await?;
        let id = lock_account(&mut tx, username, domain).await?;
        let Some(id) = id else {
            return Ok(false);
        };
        put_credentials(&mut tx, id, &creds).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Deletes an account and everything other local users hold of it, in one
    /// transaction, so nothing granted to it passes to a new account of the same name:
    /// the schema cascades to its own credentials, roster, versions, tombstones, waiting
    /// requests, last seen, block list, privacy settings, offline messages, PEP nodes and
    /// vCard; this removes the items for it in every other local roster (each leaves a
    /// tombstone and bumps its owner's version, so clients learn of it, XEP-0237) and the
    /// subscription requests it sent that wait for someone. Others' block lists and
    /// privacy exceptions that name it stay: they only ever withhold, and they are their
    /// owners' choices about an address.
    ///
    /// `local` are the domains the server serves: only their accounts' rosters and
    /// requests are changed here (a database may hold other servers' accounts, as test
    /// servers sharing one do); contacts elsewhere are told by the server.
    ///
    /// Returns what the server must tell others (RFC 6121 §2.5.2), or `None` if there was
    /// no such account.
    pub async fn delete_account(
        &self,
        username: &str,
        domain: &str,
        local: &[String],
    ) -> Result<Option<DeletedAccount>, StoreError> {
        let jid = format!("{username}@{domain}");
        // Drops the gate's cached inputs this write may alter (every entry naming the
        // account), on every way out.
        let _forget = self.forget_naming(jid.clone());
        let limits = self.limits();
        let pool = pg_or_sqlite!(self, |db| db
            .delete_account(username, domain, local, &limits));
        let mut tx = pool.begin().await?;
        let id = lock_account(&mut tx, username, domain).await?;
        let Some(id) = id else {
            return Ok(None);
        };
        let rows = sqlx::query(&format!(
            "SELECT {} FROM roster_items ri WHERE ri.owner = $1 ORDER BY ri.contact",
            super::roster::item_columns(&limits)
        ))
        .bind(&jid)
        .fetch_all(&mut *tx)
        .await?;
        let mut items = Vec::with_capacity(rows.len());
        for row in &rows {
            items.extend(super::roster::item_from_row(&jid, row, &limits)?);
        }
        let waiting: Vec<String> = sqlx::query_scalar(
            "SELECT sender FROM pending_subscriptions WHERE owner = $1 ORDER BY sender",
        )
        .bind(&jid)
        .fetch_all(&mut *tx)
        .await?;
        // The owners' version rows first, in one order: every roster writer of an owner
        // takes that row before its items, so this cannot deadlock with one.
        sqlx::query(
            "SELECT owner FROM roster_versions
             WHERE owner IN (SELECT owner FROM roster_items WHERE contact = $1)
               AND owner IN (SELECT jid FROM accounts WHERE domain = ANY($2))
             ORDER BY owner FOR UPDATE",
        )
        .bind(&jid)
        .bind(local)
        .execute(&mut *tx)
        .await?;
        let mut owners: Vec<String> = sqlx::query_scalar(
            "DELETE FROM roster_items
             WHERE contact = $1 AND owner <> $1
               AND owner IN (SELECT jid FROM accounts WHERE domain = ANY($2))
             RETURNING owner",
        )
        .bind(&jid)
        .bind(local)
        .fetch_all(&mut *tx)
        .await?;
        owners.sort();
        owners.dedup();
        let removed_from: Vec<(String, i64)> = sqlx::query_as(
            "SELECT owner, version FROM roster_versions WHERE owner = ANY($1) ORDER BY owner",
        )
        .bind(&owners)
        .fetch_all(&mut *tx)
        .await?;
        let mut withdrawn: Vec<String> = sqlx::query_scalar(
            "DELETE FROM pending_subscriptions
             WHERE sender = $1 AND owner IN (SELECT jid FROM accounts WHERE domain = ANY($2))
             RETURNING owner",
        )
        .bind(&jid)
        .bind(local)
        .fetch_all(&mut *tx)
        .await?;
        withdrawn.sort();
        sqlx::query("DELETE FROM accounts WHERE id = $1")
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

    /// Every account's bare JID, of one domain or all, in order.
    pub async fn list_accounts(&self, domain: Option<&str>) -> Result<Vec<String>, StoreError> {
        let pool = pg_or_sqlite!(self, |db| db.list_accounts(domain));
        let jids = sqlx::query_scalar(
            "SELECT jid FROM accounts WHERE $1::text IS NULL OR domain = $1 ORDER BY domain, username",
        )
        .bind(domain)
        .fetch_all(pool)
        .await?;
        Ok(jids)
    }

    /// Whether the account exists (e.g. to decide if an inbound stanza has a recipient).
    pub async fn account_exists(&self, username: &str, domain: &str) -> Result<bool, StoreError> {
        let pool = pg_or_sqlite!(self, |db| db.account_exists(username, domain));
        let exists: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM accounts WHERE username = $1 AND domain = $2)",
        )
        .bind(username)
        .bind(domain)
        .fetch_one(pool)
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
        let pool = pg_or_sqlite!(self, |db| db.scram_credentials(username, domain, hash));
        let row = sqlx::query(
            "SELECT c.salt, c.iterations, c.stored_key, c.server_key
             FROM scram_credentials c JOIN accounts a ON a.id = c.account_id
             WHERE a.username = $1 AND a.domain = $2 AND c.hash = $3",
        )
        .bind(username)
        .bind(domain)
        .bind(hash_column(hash))
        .fetch_optional(pool)
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

    /// Every account as (username, domain), ordered by domain and username.
    pub async fn accounts(&self) -> Result<Vec<(String, String)>, StoreError> {
        const SQL: &str = "SELECT username, domain FROM accounts ORDER BY domain, username";
        let pool = pg_or_sqlite!(self, |db| async {
            Ok(sqlx::query_as(SQL).fetch_all(db.reader()).await?)
        });
        Ok(sqlx::query_as(SQL).fetch_all(pool).await?)
    }

    /// Every server secret as (name, value).
    pub async fn server_secrets(&self) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        const SQL: &str = "SELECT name, value FROM server_secrets ORDER BY name";
        let pool = pg_or_sqlite!(self, |db| async {
            Ok(sqlx::query_as(SQL).fetch_all(db.reader()).await?)
        });
        Ok(sqlx::query_as(SQL).fetch_all(pool).await?)
    }

    /// Stores the secret `name` with `value` unless one of that name exists; returns the
    /// value kept.
    pub async fn import_server_secret(
        &self,
        name: &str,
        value: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        let pool = pg_or_sqlite!(self, |db| db.server_secret(name, value));
        put_secret(pool, name, value).await
    }

    /// The server secret called `name`, created (32 random bytes) the first time any node
    /// asks and the same afterwards for every node and restart.
    pub async fn server_secret(&self, name: &str) -> Result<Vec<u8>, StoreError> {
        let mut fresh = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut fresh);
        let pool = pg_or_sqlite!(self, |db| db.server_secret(name, &fresh));
        put_secret(pool, name, &fresh).await
    }
}

/// Inserts `value` as the secret `name` unless it exists; returns the value kept.
async fn put_secret(pool: &sqlx::PgPool, name: &str, value: &[u8]) -> Result<Vec<u8>, StoreError> {
    {
        sqlx::query(
            "INSERT INTO server_secrets (name, value) VALUES ($1, $2)
             ON CONFLICT (name) DO NOTHING",
        )
        .bind(name)
        .bind(value)
        .execute(pool)
        .await?;
        // A separate statement, so it sees a row another node inserted concurrently.
        let value: Vec<u8> = sqlx::query_scalar("SELECT value FROM server_secrets WHERE name = $1")
            .bind(name)
            .fetch_one(pool)
            .await?;
        Ok(value)
    }
}

/// The id of account `username@domain`, its row locked until the transaction ends (so a
/// password change and a deletion of one account take turns), or `None`.
async fn lock_account(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    username: &str,
    domain: &str,
) -> Result<Option<i64>, StoreError> {
    Ok(
        sqlx::query_scalar(
            "SELECT id FROM accounts WHERE username = $1 AND domain = $2 FOR UPDATE",
        )
        .bind(username)
        .bind(domain)
        .fetch_optional(&mut **tx)
        .await?,
    )
}
