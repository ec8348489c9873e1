//! Durable state in PostgreSQL: accounts (SCRAM credentials only), rosters with
//! XEP-0237 versions, and inbound subscription requests waiting for their user.
//!
//! One backend, so [`Store`] is a concrete type over a [`sqlx::PgPool`]; queries are
//! runtime-checked (`sqlx::query`), so building needs no database.
//!
//! The schema lives only in `migrations/*.sql` and is applied at run time by
//! [`Store::migrate`], so operators can add their own migration files without a rebuild.
//! The schema, not this code, keeps the invariants: CHECKs admit only the roster states
//! of RFC 6121 Appendix A, foreign keys tie everything to an account, and triggers bump
//! the roster version, write tombstones and `NOTIFY presenced_roster` on every roster
//! change, whoever makes it. This module therefore never bumps versions itself.
//!
//! Bare JIDs are passed as already-normalised strings (`alice@example.org`); accounts
//! are addressed by username and domain separately.

mod accounts;
pub mod audience_cache;
pub mod blocks;
pub mod gate_inputs;
pub mod last_seen;
pub mod notify;
mod pending;
mod privacy;
mod roster;

use std::path::Path;

use sqlx::error::ErrorKind;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

/// Handle on the PostgreSQL database; cheap to clone (the pool is shared).
#[derive(Clone, Debug)]
pub struct Store {
    /// Connection pool every query runs on.
    pool: PgPool,
    /// The privacy gate's broadcast inputs between presence changes (off until
    /// [`Store::set_audience_cache_ttl`]); shared by clones.
    audience: std::sync::Arc<audience_cache::AudienceCache>,
    /// What one account may store ([`Store::set_limits`]); shared by clones.
    limits: std::sync::Arc<std::sync::RwLock<StoreLimits>>,
}

/// The `[limits]` numbers the store enforces itself, so that every path that writes a
/// roster item, a waiting subscription request or a block-list entry shares one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreLimits {
    /// Items per roster: a write that would add one more fails with
    /// [`StoreError::RosterFull`].
    pub max_roster_items: i64,
    /// Groups served per item (items stored before the limit are served cut to it).
    pub max_roster_groups: usize,
    /// Characters served per group name.
    pub max_roster_group_length: usize,
    /// Characters served per item name.
    pub max_roster_name_length: usize,
    /// Waiting inbound subscription requests per user.
    pub max_pending_subscriptions: usize,
    /// Characters of status and nick a waiting request keeps.
    pub max_subscription_status_length: usize,
    /// Entries per block list: a block that would exceed it fails with
    /// [`StoreError::BlocklistFull`].
    pub max_blocklist_items: usize,
}

impl StoreLimits {
    /// The store's share of `[limits]`.
    pub fn from_config(l: &crate::config::LimitsConfig) -> StoreLimits {
        StoreLimits {
            max_roster_items: l.max_roster_items,
            max_roster_groups: l.max_roster_groups,
            max_roster_group_length: l.max_roster_group_length,
            max_roster_name_length: l.max_roster_name_length,
            max_pending_subscriptions: l.max_pending_subscriptions,
            max_subscription_status_length: l.max_subscription_status_length,
            max_blocklist_items: l.max_blocklist_items,
        }
    }
}

impl Default for StoreLimits {
    fn default() -> Self {
        StoreLimits::from_config(&crate::config::LimitsConfig::default())
    }
}

/// Where a PostgreSQL URL points, for logs and errors: `host:port/database` (or the
/// socket directory), without user or password.
pub fn database_target(url: &str) -> String {
    use std::str::FromStr;
    match sqlx::postgres::PgConnectOptions::from_str(url) {
        Ok(o) => format!(
            "{}:{}/{}",
            o.get_host(),
            o.get_port(),
            o.get_database().unwrap_or("")
        ),
        Err(_) => "(unparseable [database] url)".to_owned(),
    }
}

/// Why a store operation failed. Constraint-type failures are separate variants so the
/// caller can answer the client precisely (e.g. `bad-request` for a roster item the
/// schema refuses) instead of `internal-server-error`.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database could not be reached or a query failed.
    #[error("database error: {0}")]
    Database(#[source] sqlx::Error),
    /// Connecting to (or creating) the database failed; `target` says where it went.
    #[error("database {target}: {source}")]
    Connect {
        /// `host:port/database`, never the password.
        target: String,
        /// The cause.
        #[source]
        source: sqlx::Error,
    },
    /// Applying the migrations failed (bad file, or an applied one was edited).
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The migrations directory could not be read.
    #[error("migrations {dir}: {source}")]
    MigrationsDir {
        /// The directory.
        dir: String,
        /// The cause.
        #[source]
        source: sqlx::migrate::MigrateError,
    },
    /// create_account for a username that already exists on that domain.
    #[error("account already exists")]
    AccountExists,
    /// The roster owner or subscription target is not a local account.
    #[error("no such account")]
    NoSuchAccount,
    /// The password is empty or SASLprep (RFC 4013) rejects it, so SCRAM clients could
    /// not use it.
    #[error("password is empty or not allowed by SASLprep")]
    InvalidPassword,
    /// An iteration count of 0 was asked for.
    #[error("SCRAM iteration count must be at least 1")]
    InvalidIterations,
    /// The schema refused the data (named CHECK constraint): an impossible roster state,
    /// a full JID as contact, an invalid username...
    #[error("rejected by schema constraint {0}")]
    Constraint(String),
    /// A value read back is not one the schema allows; someone bypassed the constraints.
    #[error("corrupt stored value: {0}")]
    Corrupt(String),
    /// The write would add a roster item beyond [`StoreLimits::max_roster_items`].
    #[error("roster is full")]
    RosterFull,
    /// The write would add block-list entries beyond [`StoreLimits::max_blocklist_items`].
    #[error("block list is full")]
    BlocklistFull,
    /// The blocking task that derives credentials panicked or was cancelled.
    #[error("credential derivation task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        if let sqlx::Error::Database(db) = &e {
            match db.kind() {
                ErrorKind::CheckViolation => {
                    return StoreError::Constraint(db.constraint().unwrap_or("check").to_owned())
                }
                // Every foreign key in the schema points at an account.
                ErrorKind::ForeignKeyViolation => return StoreError::NoSuchAccount,
                _ => {}
            }
        }
        StoreError::Database(e)
    }
}

use crate::presence::subscription::SubState;
pub use crate::presence::subscription::Subscription;
pub use last_seen::LastSeen;

/// One roster item (RFC 6121 §2.1.2) plus the server-side flags of Appendix A.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RosterItem {
    /// Bare JID of the contact, normalised.
    pub contact: String,
    /// Handle the user gave the contact, if any.
    pub name: Option<String>,
    /// Groups the item is in; distinct and non-empty (the schema refuses others).
    pub groups: Vec<String>,
    /// Who sees whose presence.
    pub subscription: Subscription,
    /// The user asked to subscribe and awaits an answer (`ask="subscribe"`).
    pub pending_out: bool,
    /// The contact asked to subscribe and awaits the user's answer.
    pub pending_in: bool,
    /// RFC 6121 §3.4: the user approved a subscription the contact has not asked for yet.
    pub preapproved: bool,
}

impl RosterItem {
    /// An item in state None with no name or groups: what a roster set or an outbound
    /// subscribe starts from.
    pub fn new(contact: impl Into<String>) -> Self {
        RosterItem {
            contact: contact.into(),
            name: None,
            groups: Vec::new(),
            subscription: Subscription::None,
            pending_out: false,
            pending_in: false,
            preapproved: false,
        }
    }
}

impl RosterItem {
    /// The item's Appendix A state.
    pub fn sub_state(&self) -> SubState {
        SubState {
            subscription: self.subscription,
            pending_out: self.pending_out,
            pending_in: self.pending_in,
            preapproved: self.preapproved,
        }
    }

    /// Stores an Appendix A state in the item.
    pub fn set_sub_state(&mut self, s: SubState) {
        self.subscription = s.subscription;
        self.pending_out = s.pending_out;
        self.pending_in = s.pending_in;
        self.preapproved = s.preapproved;
    }
}

/// One entry of "what changed since version N" (XEP-0237 §2.4): the caller turns each
/// into a roster push.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RosterChange {
    /// The item was added or changed; this is its current state.
    Upsert(RosterItem),
    /// The item with this contact JID was removed (push with subscription="remove").
    Removed(String),
}

impl Store {
    /// Opens a pool of at most `max_connections` connections to `url`, creating the
    /// database first if the server has none of that name (a fresh machine has only the
    /// default databases; this saves operators a manual `createdb`).
    pub async fn connect(url: &str, max_connections: u32) -> Result<Store, StoreError> {
        use sqlx::migrate::MigrateDatabase;
        let failed = |source| StoreError::Connect {
            target: database_target(url),
            source,
        };
        if !sqlx::Postgres::database_exists(url).await.map_err(failed)? {
            tracing::warn!(database = %database_target(url), "database does not exist; creating it");
            if let Err(e) = sqlx::Postgres::create_database(url).await {
                // Another process may have created it meanwhile.
                if !sqlx::Postgres::database_exists(url).await.map_err(failed)? {
                    return Err(failed(e));
                }
            }
        }
        let pool = PgPoolOptions::new()
            .max_connections(max_connections.max(1))
            .connect(url)
            .await
            .map_err(failed)?;
        Ok(Store::from_pool(pool))
    }

    /// Wraps an existing pool (e.g. one shared with other components).
    pub fn from_pool(pool: PgPool) -> Store {
        Store {
            pool,
            audience: Default::default(),
            limits: Default::default(),
        }
    }

    /// Sets what one account may store (the defaults of `[limits]` until called).
    pub fn set_limits(&self, limits: StoreLimits) {
        if let Ok(mut l) = self.limits.write() {
            *l = limits;
        }
    }

    /// What one account may store.
    pub fn limits(&self) -> StoreLimits {
        self.limits.read().map(|l| *l).unwrap_or_default()
    }

    /// The pool, for components that need their own queries or LISTEN (the
    /// `presenced_roster` channel carries `<version> <owner>` for every roster change).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies the `*.sql` migrations found in `dir` that the database has not seen yet.
    /// sqlx holds an advisory lock meanwhile, so nodes starting together are safe.
    pub async fn migrate(&self, dir: &Path) -> Result<(), StoreError> {
        let mut migrator = sqlx::migrate::Migrator::new(dir).await.map_err(|source| {
            StoreError::MigrationsDir {
                dir: dir.display().to_string(),
                source,
            }
        })?;
        // A database migrated by a newer build (or holding an operator's retired file)
        // must not stop an older binary from starting: unknown applied versions are
        // tolerated, edited files are still refused by their checksums.
        migrator.set_ignore_missing(true);
        migrator.run(&self.pool).await?;
        Ok(())
    }
}
