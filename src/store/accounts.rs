//! Accounts and their SCRAM credentials (table `accounts`, `scram_credentials`).
//!
//! Passwords are turned into salted SCRAM credentials for every [`ScramHash`] at once,
//! with a fresh random salt each, on a blocking thread (PBKDF2 is deliberately slow),
//! and never stored. Creating an account, replacing its credentials and deleting it are
//! written once ([`create`], [`set_credentials`], [`delete`]); each backend gives only its
//! statements ([`AccountSql`]).

use rand::RngCore;
use sqlx::Row;

use super::{pg_or_sqlite, RosterItem, Store, StoreError, StoreLimits};
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

/// The `iterations` column of credentials to store (the schemas' 32-bit integer); a count
/// beyond it is refused.
pub(super) fn iterations_column(iterations: u32) -> Result<i32, StoreError> {
    i32::try_from(iterations).map_err(|_| StoreError::InvalidIterations)
}

/// Stored credentials as read: the columns `salt`, `stored_key` and `server_key` of `row`,
/// and `iterations` as the caller read it (its column type being the dialect's). A count
/// no SCRAM exchange can carry is [`StoreError::Corrupt`].
pub(super) fn credentials_from_row<'r, R>(
    row: &'r R,
    iterations: i64,
) -> Result<StoredCredentials, StoreError>
where
    R: Row,
    for<'a> &'a str: sqlx::ColumnIndex<R>,
    Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    Ok(StoredCredentials {
        salt: row.try_get("salt")?,
        iterations: u32::try_from(iterations)
            .map_err(|_| StoreError::Corrupt(format!("iterations {iterations}")))?,
        stored_key: row.try_get("stored_key")?,
        server_key: row.try_get("server_key")?,
    })
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

/// The statements on accounts of one backend's connection, inside the caller's
/// transaction; the rules that use them are written once ([`create`], [`set_credentials`],
/// [`delete`]).
pub(super) trait AccountSql {
    /// Inserts account `username@domain`; its id, or `None` when it exists already.
    async fn insert_account(
        &mut self,
        username: &str,
        domain: &str,
    ) -> Result<Option<i64>, StoreError>;
    /// The id of account `username@domain`, its row held until the transaction ends (so a
    /// password change and a deletion of one account take turns), or `None`.
    async fn lock_account(
        &mut self,
        username: &str,
        domain: &str,
    ) -> Result<Option<i64>, StoreError>;
    /// Inserts or replaces the credentials of account `id`.
    async fn put_credentials(
        &mut self,
        id: i64,
        creds: &[(ScramHash, StoredCredentials)],
    ) -> Result<(), StoreError>;
    /// `jid`'s own roster items by contact, cut to `limits`.
    async fn own_items(
        &mut self,
        jid: &str,
        limits: &StoreLimits,
    ) -> Result<Vec<RosterItem>, StoreError>;
    /// Who has a request waiting for `jid`, by sender.
    async fn waiting_for(&mut self, jid: &str) -> Result<Vec<String>, StoreError>;
    /// Removes the items for `jid` from the rosters of other accounts of the `local`
    /// domains, their owners' writers held off first; the owners, in any order.
    async fn remove_from_others(
        &mut self,
        jid: &str,
        local: &[String],
    ) -> Result<Vec<String>, StoreError>;
    /// The roster version of each of `owners` (sorted), in their order.
    async fn versions(&mut self, owners: &[String]) -> Result<Vec<(String, i64)>, StoreError>;
    /// Drops the requests of `jid` waiting for accounts of the `local` domains; their
    /// owners, in any order.
    async fn withdraw(&mut self, jid: &str, local: &[String]) -> Result<Vec<String>, StoreError>;
    /// Deletes account `id`; the schema cascades to everything of its own.
    async fn delete_account(&mut self, id: i64) -> Result<(), StoreError>;
}

/// [`Store::import_account`] inside the caller's transaction.
pub(super) async fn create<C: AccountSql>(
    conn: &mut C,
    username: &str,
    domain: &str,
    creds: &[(ScramHash, StoredCredentials)],
) -> Result<(), StoreError> {
    let Some(id) = conn.insert_account(username, domain).await? else {
        return Err(StoreError::AccountExists);
    };
    conn.put_credentials(id, creds).await
}

/// [`Store::set_password`] inside the caller's transaction: whether the account exists.
/// The account's XEP-0484 tokens go with the old password: a client that was only given a
/// token logs in with the new password again.
pub(super) async fn set_credentials<C: AccountSql + super::fast::TokenSql>(
    conn: &mut C,
    username: &str,
    domain: &str,
    creds: &[(ScramHash, StoredCredentials)],
) -> Result<bool, StoreError> {
    let Some(id) = conn.lock_account(username, domain).await? else {
        return Ok(false);
    };
    conn.put_credentials(id, creds).await?;
    conn.revoke(id, None).await?;
    Ok(true)
}

/// [`Store::delete_account`] inside the caller's transaction; `None` (nothing written)
/// when there is no such account.
pub(super) async fn delete<C: AccountSql>(
    conn: &mut C,
    username: &str,
    domain: &str,
    local: &[String],
    limits: &StoreLimits,
) -> Result<Option<DeletedAccount>, StoreError> {
    let jid = format!("{username}@{domain}");
    let Some(id) = conn.lock_account(username, domain).await? else {
        return Ok(None);
    };
    let items = conn.own_items(&jid, limits).await?;
    let waiting = conn.waiting_for(&jid).await?;
    let mut owners = conn.remove_from_others(&jid, local).await?;
    owners.sort();
    owners.dedup();
    let removed_from = conn.versions(&owners).await?;
    let mut withdrawn = conn.withdraw(&jid, local).await?;
    withdrawn.sort();
    conn.delete_account(id).await?;
    Ok(Some(DeletedAccount {
        items,
        waiting,
        removed_from,
        withdrawn,
    }))
}

/// One account's credentials for one hash, inserted or replaced: the same statement on both
/// backends (sqlx binds `$N` on SQLite too).
pub(super) const UPSERT_CREDENTIALS: &str = "INSERT INTO scram_credentials
     (account_id, hash, salt, iterations, stored_key, server_key)
 VALUES ($1, $2, $3, $4, $5, $6)
 ON CONFLICT (account_id, hash) DO UPDATE
     SET salt = excluded.salt, iterations = excluded.iterations,
         stored_key = excluded.stored_key, server_key = excluded.server_key";

impl AccountSql for sqlx::PgConnection {
    async fn insert_account(
        &mut self,
        username: &str,
        domain: &str,
    ) -> Result<Option<i64>, StoreError> {
        Ok(sqlx::query_scalar(
            "INSERT INTO accounts (username, domain) VALUES ($1, $2)
             ON CONFLICT (username, domain) DO NOTHING
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
        Ok(sqlx::query_scalar(
            "SELECT id FROM accounts WHERE username = $1 AND domain = $2 FOR UPDATE",
        )
        .bind(username)
        .bind(domain)
        .fetch_optional(&mut *self)
        .await?)
    }

    async fn put_credentials(
        &mut self,
        id: i64,
        creds: &[(ScramHash, StoredCredentials)],
    ) -> Result<(), StoreError> {
        for (hash, c) in creds {
            let iterations = iterations_column(c.iterations)?;
            sqlx::query(UPSERT_CREDENTIALS)
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
            "SELECT {} FROM roster_items ri WHERE ri.owner = $1 ORDER BY ri.contact",
            super::roster::item_columns(limits)
        ))
        .bind(jid)
        .fetch_all(&mut *self)
        .await?;
        let mut items = Vec::with_capacity(rows.len());
        for row in &rows {
            items.extend(super::roster::item_from_row(jid, row, limits)?);
        }
        Ok(items)
    }

    async fn waiting_for(&mut self, jid: &str) -> Result<Vec<String>, StoreError> {
        Ok(sqlx::query_scalar(
            "SELECT sender FROM pending_subscriptions WHERE owner = $1 ORDER BY sender",
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
        // The owners' version rows first, in one order: every roster writer of an owner
        // takes that row before its items, so this cannot deadlock with one.
        sqlx::query(
            "SELECT owner FROM roster_versions
             WHERE owner IN (SELECT owner FROM roster_items WHERE contact = $1)
               AND owner IN (SELECT jid FROM accounts WHERE domain = ANY($2))
             ORDER BY owner FOR UPDATE",
        )
        .bind(jid)
        .bind(local)
        .execute(&mut *self)
        .await?;
        Ok(sqlx::query_scalar(
            "DELETE FROM roster_items
             WHERE contact = $1 AND owner <> $1
               AND owner IN (SELECT jid FROM accounts WHERE domain = ANY($2))
             RETURNING owner",
        )
        .bind(jid)
        .bind(local)
        .fetch_all(&mut *self)
        .await?)
    }

    async fn versions(&mut self, owners: &[String]) -> Result<Vec<(String, i64)>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT owner, version FROM roster_versions WHERE owner = ANY($1) ORDER BY owner",
        )
        .bind(owners)
        .fetch_all(&mut *self)
        .await?)
    }

    async fn withdraw(&mut self, jid: &str, local: &[String]) -> Result<Vec<String>, StoreError> {
        Ok(sqlx::query_scalar(
            "DELETE FROM pending_subscriptions
             WHERE sender = $1 AND owner IN (SELECT jid FROM accounts WHERE domain = ANY($2))
             RETURNING owner",
        )
        .bind(jid)
        .bind(local)
        .fetch_all(&mut *self)
        .await?)
    }

    async fn delete_account(&mut self, id: i64) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM accounts WHERE id = $1")
            .bind(id)
            .execute(&mut *self)
            .await?;
        Ok(())
    }
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
        create(&mut *tx, username, domain, creds).await?;
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
        let found = set_credentials(&mut *tx, username, domain, &creds).await?;
        if found {
            tx.commit().await?;
        }
        Ok(found)
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
        // Drops the gate's cached inputs this write may alter (every entry naming the
        // account), on every way out.
        let _forget = self.forget_naming(format!("{username}@{domain}"));
        let limits = self.limits();
        let pool = pg_or_sqlite!(self, |db| db
            .delete_account(username, domain, local, &limits));
        let mut tx = pool.begin().await?;
        let deleted = delete(&mut *tx, username, domain, local, &limits).await?;
        if deleted.is_some() {
            tx.commit().await?;
        }
        Ok(deleted)
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
        credentials_from_row(&row, iterations.into()).map(Some)
    }

    /// Every account as (username, domain), ordered by domain and username.
    pub async fn accounts(&self) -> Result<Vec<(String, String)>, StoreError> {
        const SQL: &str = "SELECT username, domain FROM accounts ORDER BY domain, username";
        let pool = pg_or_sqlite!(self, "accounts", |db| async {
            Ok(sqlx::query_as(SQL).fetch_all(db.reader()).await?)
        });
        Ok(sqlx::query_as(SQL).fetch_all(pool).await?)
    }

    /// Every server secret as (name, value).
    pub async fn server_secrets(&self) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        const SQL: &str = "SELECT name, value FROM server_secrets ORDER BY name";
        let pool = pg_or_sqlite!(self, "server_secrets", |db| async {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// An account `a@h` (id 7) that two local users hold (one twice, as the statements may
    /// return) and whose requests wait for two, answering in no order; what was asked.
    #[derive(Default)]
    struct Rows {
        asked: Vec<String>,
    }

    impl AccountSql for Rows {
        async fn insert_account(&mut self, u: &str, _d: &str) -> Result<Option<i64>, StoreError> {
            self.asked.push(format!("insert {u}"));
            Ok((u != "a").then_some(8))
        }

        async fn lock_account(&mut self, u: &str, _d: &str) -> Result<Option<i64>, StoreError> {
            self.asked.push(format!("lock {u}"));
            Ok((u == "a").then_some(7))
        }

        async fn put_credentials(
            &mut self,
            id: i64,
            _creds: &[(ScramHash, StoredCredentials)],
        ) -> Result<(), StoreError> {
            self.asked.push(format!("credentials {id}"));
            Ok(())
        }

        async fn own_items(
            &mut self,
            _jid: &str,
            _limits: &StoreLimits,
        ) -> Result<Vec<RosterItem>, StoreError> {
            Ok(Vec::new())
        }

        async fn waiting_for(&mut self, _jid: &str) -> Result<Vec<String>, StoreError> {
            Ok(vec!["w@x".to_owned()])
        }

        async fn remove_from_others(
            &mut self,
            _jid: &str,
            _local: &[String],
        ) -> Result<Vec<String>, StoreError> {
            Ok(["c@h", "b@h", "c@h"].map(str::to_owned).to_vec())
        }

        async fn versions(&mut self, owners: &[String]) -> Result<Vec<(String, i64)>, StoreError> {
            Ok(owners.iter().map(|o| (o.clone(), 1)).collect())
        }

        async fn withdraw(
            &mut self,
            _jid: &str,
            _local: &[String],
        ) -> Result<Vec<String>, StoreError> {
            Ok(["e@h", "d@h"].map(str::to_owned).to_vec())
        }

        async fn delete_account(&mut self, id: i64) -> Result<(), StoreError> {
            self.asked.push(format!("delete {id}"));
            Ok(())
        }
    }

    impl crate::store::fast::TokenSql for Rows {
        async fn account_id(&mut self, _u: &str, _d: &str) -> Result<Option<i64>, StoreError> {
            unreachable!("no token is issued here")
        }

        async fn insert_token(
            &mut self,
            _account: i64,
            _issue: &crate::store::fast::Issue<'_>,
            _nonce: &[u8],
        ) -> Result<i64, StoreError> {
            unreachable!("no token is issued here")
        }

        async fn prune(
            &mut self,
            _account: i64,
            _issue: &crate::store::fast::Issue<'_>,
            _newest: i64,
        ) -> Result<(), StoreError> {
            unreachable!("no token is issued here")
        }

        async fn revoke(&mut self, id: i64, client: Option<&str>) -> Result<u64, StoreError> {
            self.asked.push(format!("revoke {id} {client:?}"));
            Ok(1)
        }

        async fn retire_older(&mut self, _id: i64) -> Result<(), StoreError> {
            unreachable!("no token is used here")
        }

        async fn raise_count(&mut self, _id: i64, _count: i64) -> Result<bool, StoreError> {
            unreachable!("no token is used here")
        }
    }

    #[tokio::test]
    async fn a_deletion_reports_each_holder_once_in_order_and_no_account_changes_nothing() {
        let mut rows = Rows::default();
        let limits = StoreLimits::default();
        let deleted = delete(&mut rows, "a", "h", &[], &limits).await.unwrap();
        assert_eq!(
            deleted,
            Some(DeletedAccount {
                items: Vec::new(),
                waiting: vec!["w@x".to_owned()],
                removed_from: vec![("b@h".to_owned(), 1), ("c@h".to_owned(), 1)],
                withdrawn: vec!["d@h".to_owned(), "e@h".to_owned()],
            })
        );
        assert_eq!(rows.asked, ["lock a", "delete 7"]);
        let mut rows = Rows::default();
        assert_eq!(
            delete(&mut rows, "z", "h", &[], &limits).await.unwrap(),
            None
        );
        assert_eq!(rows.asked, ["lock z"]);
    }

    #[tokio::test]
    async fn credentials_are_written_only_for_a_new_or_an_existing_account_and_a_new_password_revokes_its_tokens(
    ) {
        let mut rows = Rows::default();
        assert!(matches!(
            create(&mut rows, "a", "h", &[]).await,
            Err(StoreError::AccountExists)
        ));
        create(&mut rows, "n", "h", &[]).await.unwrap();
        assert!(set_credentials(&mut rows, "a", "h", &[]).await.unwrap());
        assert!(!set_credentials(&mut rows, "z", "h", &[]).await.unwrap());
        assert_eq!(
            rows.asked,
            [
                "insert a",
                "insert n",
                "credentials 8",
                "lock a",
                "credentials 7",
                "revoke 7 None",
                "lock z"
            ]
        );
    }

    #[test]
    fn an_iteration_count_beyond_the_schemas_integer_is_refused() {
        assert_eq!(iterations_column(4096).unwrap(), 4096);
        assert_eq!(
            iterations_column(i32::MAX.unsigned_abs()).unwrap(),
            i32::MAX
        );
        assert!(matches!(
            iterations_column(u32::MAX),
            Err(StoreError::InvalidIterations)
        ));
    }
}
