//! XEP-0484 FAST tokens (table `fast_tokens`): the rows a login with a token is checked
//! against, and the rules that keep them few. No token is stored, only the nonce the server
//! secret derives it from ([`crate::protocol::sasl::ht::token`]).
//!
//! The rules, written once for both backends (the statements are the same text on both,
//! times being Unix seconds, so one macro body implements [`TokenSql`] for each):
//! - A client (account and user-agent id) holds at most two tokens: the one it logs in with
//!   and the one issued to replace it (XEP-0484 "Token rotation"), until it logs in with
//!   the new one, which retires the older ([`Store::fast_token_used`]). A client that asks
//!   for a token with its password has lost the old ones: they go.
//! - An account keeps tokens for at most `max_clients` user agents; issuing one more drops
//!   the client that logged in least recently. Expired rows go when the account is issued
//!   a token.
//! - A password change deletes every token of the account in its transaction
//!   (`accounts::set_credentials`); deleting the account cascades; an operator revokes a
//!   client's or every token ([`Store::revoke_fast_tokens`]).

use rand::RngCore;

use super::{in_write, pg_or_sqlite, Store, StoreError};
use crate::protocol::sasl::ht::NONCE_LEN;

/// One stored token, as read for a login.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FastToken {
    /// Row id: later tokens of a client have larger ids.
    pub id: i64,
    /// The mechanism the token was issued for (XEP-0484: only usable with it).
    pub mechanism: String,
    /// What the token is derived from.
    pub nonce: Vec<u8>,
    /// When it was issued, Unix seconds.
    pub issued_at: i64,
    /// When it stops logging in, Unix seconds.
    pub expires_at: i64,
    /// The highest XEP-0484 `count` a login with it carried.
    pub last_count: i64,
}

/// A token to issue.
#[derive(Debug, Clone, Copy)]
pub struct Issue<'a> {
    /// The client's XEP-0388 `<user-agent id/>`.
    pub user_agent: &'a str,
    /// The mechanism the client asked the token for.
    pub mechanism: &'a str,
    /// Now, Unix seconds.
    pub now: i64,
    /// Seconds the token logs in for.
    pub lifetime: i64,
    /// The client's token to keep beside the new one (the one it just logged in with); `None`
    /// drops every other token of the client.
    pub keep: Option<i64>,
    /// User agents an account keeps tokens for.
    pub max_clients: i64,
}

/// The token statements of one backend's connection, inside the caller's transaction.
pub(super) trait TokenSql {
    /// The id of account `username@domain`, or `None`.
    async fn account_id(&mut self, username: &str, domain: &str)
        -> Result<Option<i64>, StoreError>;
    /// Inserts a token row; its id.
    async fn insert_token(
        &mut self,
        account: i64,
        issue: &Issue<'_>,
        nonce: &[u8],
    ) -> Result<i64, StoreError>;
    /// Deletes the client's tokens but `keep` (and the `newest`), and the account's expired
    /// ones, then the user agents beyond the `max_clients` most recently issued.
    async fn prune(
        &mut self,
        account: i64,
        issue: &Issue<'_>,
        newest: i64,
    ) -> Result<(), StoreError>;
    /// Deletes the account's tokens, of one client or all; how many.
    async fn revoke(&mut self, account: i64, user_agent: Option<&str>) -> Result<u64, StoreError>;
    /// Deletes the tokens of token `id`'s client issued before it.
    async fn retire_older(&mut self, id: i64) -> Result<(), StoreError>;
    /// Sets token `id`'s count to `count` if that is higher; whether it was.
    async fn raise_count(&mut self, id: i64, count: i64) -> Result<bool, StoreError>;
}

/// Statements of [`TokenSql`], one text for both dialects.
const ACCOUNT_ID: &str = "SELECT id FROM accounts WHERE username = $1 AND domain = $2";
const INSERT: &str = "INSERT INTO fast_tokens
     (account_id, user_agent, mechanism, nonce, issued_at, expires_at)
 VALUES ($1, $2, $3, $4, $5, $6) RETURNING id";
const PRUNE_CLIENT: &str = "DELETE FROM fast_tokens
 WHERE account_id = $1 AND user_agent = $2 AND id <> $3 AND id <> $4";
const PRUNE_EXPIRED: &str = "DELETE FROM fast_tokens WHERE account_id = $1 AND expires_at <= $2";
const PRUNE_CLIENTS: &str = "DELETE FROM fast_tokens
 WHERE account_id = $1 AND user_agent NOT IN (
     SELECT user_agent FROM fast_tokens WHERE account_id = $1
     GROUP BY user_agent ORDER BY max(id) DESC LIMIT $2)";
const REVOKE: &str = "DELETE FROM fast_tokens
 WHERE account_id = $1 AND ($2 IS NULL OR user_agent = $2)";
const TOKENS: &str = "SELECT t.id, t.mechanism, t.nonce, t.issued_at, t.expires_at, t.last_count
 FROM fast_tokens t JOIN accounts a ON a.id = t.account_id
 WHERE a.username = $1 AND a.domain = $2 AND t.user_agent = $3
 ORDER BY t.id DESC";
const RETIRE_OLDER: &str = "DELETE FROM fast_tokens
 WHERE account_id = (SELECT account_id FROM fast_tokens WHERE id = $1)
   AND user_agent = (SELECT user_agent FROM fast_tokens WHERE id = $1)
   AND id < $1";
const COUNT: &str =
    "UPDATE fast_tokens SET last_count = $2 WHERE id = $1 AND last_count < $2 RETURNING id";

/// One body of [`TokenSql`] for each backend's connection: the statements are the same.
macro_rules! token_sql {
    ($conn:ty) => {
        impl TokenSql for $conn {
            async fn account_id(
                &mut self,
                username: &str,
                domain: &str,
            ) -> Result<Option<i64>, StoreError> {
                Ok(sqlx::query_scalar(ACCOUNT_ID)
                    .bind(username)
                    .bind(domain)
                    .fetch_optional(&mut *self)
                    .await?)
            }

            async fn insert_token(
                &mut self,
                account: i64,
                issue: &Issue<'_>,
                nonce: &[u8],
            ) -> Result<i64, StoreError> {
                Ok(sqlx::query_scalar(INSERT)
                    .bind(account)
                    .bind(issue.user_agent)
                    .bind(issue.mechanism)
                    .bind(nonce)
                    .bind(issue.now)
                    .bind(issue.now.saturating_add(issue.lifetime))
                    .fetch_one(&mut *self)
                    .await?)
            }

            async fn prune(
                &mut self,
                account: i64,
                issue: &Issue<'_>,
                newest: i64,
            ) -> Result<(), StoreError> {
                sqlx::query(PRUNE_CLIENT)
                    .bind(account)
                    .bind(issue.user_agent)
                    .bind(newest)
                    .bind(issue.keep.unwrap_or(newest))
                    .execute(&mut *self)
                    .await?;
                sqlx::query(PRUNE_EXPIRED)
                    .bind(account)
                    .bind(issue.now)
                    .execute(&mut *self)
                    .await?;
                sqlx::query(PRUNE_CLIENTS)
                    .bind(account)
                    .bind(issue.max_clients.max(1))
                    .execute(&mut *self)
                    .await?;
                Ok(())
            }

            async fn revoke(
                &mut self,
                account: i64,
                user_agent: Option<&str>,
            ) -> Result<u64, StoreError> {
                Ok(sqlx::query(REVOKE)
                    .bind(account)
                    .bind(user_agent)
                    .execute(&mut *self)
                    .await?
                    .rows_affected())
            }

            async fn retire_older(&mut self, id: i64) -> Result<(), StoreError> {
                sqlx::query(RETIRE_OLDER)
                    .bind(id)
                    .execute(&mut *self)
                    .await?;
                Ok(())
            }

            async fn raise_count(&mut self, id: i64, count: i64) -> Result<bool, StoreError> {
                let raised: Option<i64> = sqlx::query_scalar(COUNT)
                    .bind(id)
                    .bind(count)
                    .fetch_optional(&mut *self)
                    .await?;
                Ok(raised.is_some())
            }
        }
    };
}

token_sql!(sqlx::PgConnection);
token_sql!(sqlx::SqliteConnection);

/// [`Store::issue_fast_token`] inside the caller's transaction.
async fn issue<C: TokenSql>(
    conn: &mut C,
    username: &str,
    domain: &str,
    issue: &Issue<'_>,
) -> Result<Option<FastToken>, StoreError> {
    let Some(account) = conn.account_id(username, domain).await? else {
        return Ok(None);
    };
    let mut nonce = vec![0u8; NONCE_LEN];
    rand::thread_rng().fill_bytes(&mut nonce);
    let id = conn.insert_token(account, issue, &nonce).await?;
    conn.prune(account, issue, id).await?;
    Ok(Some(FastToken {
        id,
        mechanism: issue.mechanism.to_owned(),
        nonce,
        issued_at: issue.now,
        expires_at: issue.now.saturating_add(issue.lifetime),
        last_count: 0,
    }))
}

/// [`Store::revoke_fast_tokens`] inside the caller's transaction; `None` without such an
/// account.
pub(super) async fn revoke<C: TokenSql>(
    conn: &mut C,
    username: &str,
    domain: &str,
    user_agent: Option<&str>,
) -> Result<Option<u64>, StoreError> {
    let Some(account) = conn.account_id(username, domain).await? else {
        return Ok(None);
    };
    conn.revoke(account, user_agent).await.map(Some)
}

/// The rows of a [`TOKENS`] read.
type TokenRow = (i64, String, Vec<u8>, i64, i64, i64);

fn from_row(row: TokenRow) -> FastToken {
    let (id, mechanism, nonce, issued_at, expires_at, last_count) = row;
    FastToken {
        id,
        mechanism,
        nonce,
        issued_at,
        expires_at,
        last_count,
    }
}

impl Store {
    /// Issues a token to a client of account `username@domain` (`None` without such an
    /// account), under the rules of this module.
    pub async fn issue_fast_token(
        &self,
        username: &str,
        domain: &str,
        req: Issue<'_>,
    ) -> Result<Option<FastToken>, StoreError> {
        in_write!(self, "issue_fast_token", issue(username, domain, &req))
    }

    /// The tokens of a client, newest first, expired ones included (a login with one is
    /// told its credentials expired).
    pub async fn fast_tokens(
        &self,
        username: &str,
        domain: &str,
        user_agent: &str,
    ) -> Result<Vec<FastToken>, StoreError> {
        let read = |rows: Vec<TokenRow>| rows.into_iter().map(from_row).collect();
        let pool = pg_or_sqlite!(self, "fast_tokens", |db| async {
            let rows = sqlx::query_as(TOKENS)
                .bind(username)
                .bind(domain)
                .bind(user_agent)
                .fetch_all(db.reader())
                .await?;
            Ok(read(rows))
        });
        let rows = sqlx::query_as(TOKENS)
            .bind(username)
            .bind(domain)
            .bind(user_agent)
            .fetch_all(pool)
            .await?;
        Ok(read(rows))
    }

    /// A login with token `id` succeeded: the client holds it, so its older tokens go
    /// (`older`: the caller saw some in its read). With a XEP-0484 `count`, false (nothing
    /// changed) unless it is above every count the token carried before: a replayed
    /// authentication repeats one. With neither, nothing is written: the usual FAST login
    /// costs the store one read. A count alone is one statement, atomic by itself (two
    /// logins with the same count cannot both raise it), so it takes no transaction: the
    /// usual login of a client that sends `count` costs a read and that statement.
    pub async fn fast_token_used(
        &self,
        id: i64,
        count: Option<i64>,
        older: bool,
    ) -> Result<bool, StoreError> {
        match (count, older) {
            (None, false) => Ok(true),
            (Some(count), false) => {
                let pool = pg_or_sqlite!(self, "fast_token_used", |db| async {
                    db.writer().acquire().await?.raise_count(id, count).await
                });
                pool.acquire().await?.raise_count(id, count).await
            }
            _ => in_write!(self, "fast_token_used", used(id, count, older)),
        }
    }

    /// Deletes the tokens of account `username@domain`, of one client or all; how many, or
    /// `None` without such an account.
    pub async fn revoke_fast_tokens(
        &self,
        username: &str,
        domain: &str,
        user_agent: Option<&str>,
    ) -> Result<Option<u64>, StoreError> {
        in_write!(
            self,
            "revoke_fast_tokens",
            revoke(username, domain, user_agent)
        )
    }
}

/// [`Store::fast_token_used`] inside the caller's transaction.
async fn used<C: TokenSql>(
    conn: &mut C,
    id: i64,
    count: Option<i64>,
    older: bool,
) -> Result<bool, StoreError> {
    if let Some(count) = count {
        if !conn.raise_count(id, count).await? {
            return Ok(false);
        }
    }
    if older {
        conn.retire_older(id).await?;
    }
    Ok(true)
}
