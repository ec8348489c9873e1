//! Durable state: accounts (SCRAM credentials only), rosters with XEP-0237 versions,
//! inbound subscription requests waiting for their user, block lists, privacy settings,
//! last seen and server secrets.
//!
//! Two backends behind one [`Store`], chosen by the URL's scheme: PostgreSQL
//! (`postgres://`, the reference, for several nodes) and SQLite (`sqlite://path`, one
//! file created on first start, for a server that needs nothing installed; see
//! [`sqlite`]). Each method runs the query of the backend in use; callers never know
//! which. Queries are runtime-checked (`sqlx::query`), so building needs no database.
//!
//! The two backends differ only in SQL. Every rule that is not SQL (a bound checked, what
//! is kept, what a refusal logs, how rows become values) is written once, in the module of
//! `store/` that owns it, and both backends run it: a pure function both call
//! (`roster::diffable`, `offline::make_room`, `pep::settle`), or, where a rule interleaves
//! with statements in one transaction, a function generic over a small trait of that
//! module (`accounts::AccountSql`, `blocks::BlockSql`, `roster::DiffSql`,
//! `roster::ItemSql`, `pending::PendingSql`, `pep::PepSql`, `offline::OfflineSql`,
//! `roster_admin::AdminSql`) whose two implementations, on `PgConnection` beside it and on
//! `SqliteConnection` in [`sqlite`], hold the statements and nothing else. Where the
//! statement text itself is the same it is one string for both (sqlx binds SQLite's `$N`
//! parameters by their number, as PostgreSQL does).
//!
//! The schemas (`migrations/*.sql` for PostgreSQL, `migrations/sqlite/*.sql` for SQLite)
//! are compiled into the binary and applied by [`Store::migrate`], followed by the
//! operator's own migration directory, so operators can add files without a rebuild.
//! The schema, not this code, keeps the invariants: CHECKs admit only the roster states
//! of RFC 6121 Appendix A, foreign keys tie everything to an account, and triggers bump
//! the roster version, write tombstones and announce every roster change (PostgreSQL
//! `NOTIFY presenced_roster`, SQLite a row in `presenced_changes`), whoever makes it.
//! This module therefore never bumps versions itself.
//!
//! Bare JIDs are passed as already-normalised strings (`alice@example.org`); accounts
//! are addressed by username and domain separately. JIDs read back in a row (a roster
//! contact, a tombstone, a block-list entry, a last-seen account, an offline message's
//! sender) are parsed once, where the row is read (`stored_jid`), so callers hold the
//! types of [`crate::protocol::jid`] and never parse again.

mod accounts;
pub mod audience_cache;
pub mod blocks;
pub mod calls;
pub mod copy;
pub mod fast;
pub mod gate_inputs;
pub mod last_seen;
pub mod notify;
pub mod offline;
mod pending;
pub mod pep;
mod privacy;
pub mod push;
mod roster;
mod roster_admin;
pub mod sqlite;
mod vcard;

use std::path::{Path, PathBuf};

use ::jid::BareJid;
use sqlx::error::ErrorKind;
use sqlx::PgPool;

/// Handle on the database; cheap to clone (the pools are shared).
#[derive(Clone, Debug)]
pub struct Store {
    /// The database every query runs on.
    backend: Backend,
    /// The privacy gate's broadcast inputs between presence changes (off until
    /// [`Store::set_audience_cache_ttl`]); shared by clones.
    audience: std::sync::Arc<audience_cache::AudienceCache>,
    /// What one account may store ([`Store::set_limits`]); shared by clones.
    limits: std::sync::Arc<std::sync::RwLock<StoreLimits>>,
    /// The settings of a user with no `privacy_settings` row ([`Store::set_privacy_defaults`]);
    /// shared by clones.
    privacy_defaults: std::sync::Arc<std::sync::RwLock<crate::policy::privacy::PrivacySettings>>,
    /// How often each operation reached the database ([`calls`]); shared by clones.
    calls: std::sync::Arc<calls::Calls>,
}

/// Which store `url` names and whether it can be used, without creating or changing
/// anything (for `presenced check-config`): the description ("PostgreSQL at
/// host:port, database d" or "SQLite file path") and Ok with what was found, or Err
/// with why it cannot be reached.
pub async fn probe(url: &str) -> (String, Result<String, String>) {
    use sqlx::migrate::MigrateDatabase;
    use std::str::FromStr;
    if let Some(path) = sqlite::path_of(url) {
        let what = format!("SQLite file {}", path.display());
        if !path.exists() {
            let dir = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
                _ => PathBuf::from("."),
            };
            let found = match std::fs::metadata(&dir) {
                Ok(m) if m.is_dir() && !m.permissions().readonly() => {
                    Ok("not there yet; created on first start".to_owned())
                }
                Ok(m) if m.is_dir() => Err(format!("directory {} is read-only", dir.display())),
                Ok(_) => Err(format!("{} is not a directory", dir.display())),
                Err(e) => Err(format!("directory {}: {e}", dir.display())),
            };
            return (what, found);
        }
        let options = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(&path)
            .read_only(true);
        let found = async {
            use sqlx::Connection;
            let mut conn = sqlx::SqliteConnection::connect_with(&options).await?;
            sqlx::query("SELECT count(*) FROM sqlite_master")
                .execute(&mut conn)
                .await?;
            conn.close().await
        }
        .await;
        let found = found
            .map(|()| "exists and is an SQLite database".to_owned())
            .map_err(|e| e.to_string());
        return (what, found);
    }
    let what = match sqlx::postgres::PgConnectOptions::from_str(url) {
        Ok(o) => format!(
            "PostgreSQL at {}:{}, database {}",
            o.get_host(),
            o.get_port(),
            o.get_database().unwrap_or("(default)")
        ),
        Err(e) => return (format!("PostgreSQL URL {url:?}"), Err(e.to_string())),
    };
    let exists = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        sqlx::Postgres::database_exists(url),
    )
    .await;
    let found = match exists {
        Ok(Ok(true)) => Ok("reachable; the database exists".to_owned()),
        Ok(Ok(false)) => Ok("reachable; the database is created on first start".to_owned()),
        Ok(Err(e)) => Err(format!("cannot reach it: {e}")),
        Err(_) => Err("cannot reach it: no answer within 5 s".to_owned()),
    };
    (what, found)
}

/// Operators' migration files are numbered from here; the server's own use the numbers
/// below.
pub const OPERATOR_MIGRATIONS_FROM: i64 = 1000;

/// Which database a [`Store`] runs on.
#[derive(Clone, Debug)]
enum Backend {
    Postgres(PgPool),
    Sqlite(sqlite::Pools),
}

/// The two SQL dialects, for code that must write SQL of its own (tests, `copy-store`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// PostgreSQL.
    Postgres,
    /// SQLite.
    Sqlite,
}

/// The PostgreSQL pool of `$store`, or the value of running `$call` on its SQLite pools
/// (bound to `$db`), with errors about the file itself naming it. Counts the call
/// ([`calls`]) under `$name`, or under the name of the backend's method `$call` calls.
macro_rules! pg_or_sqlite {
    ($store:expr, $name:literal, |$db:ident| $call:expr) => {{
        $store.calls.count($name);
        match &$store.backend {
            $crate::store::Backend::Postgres(pool) => pool,
            $crate::store::Backend::Sqlite($db) => {
                return $call.await.map_err(|e| $db.name_file(e));
            }
        }
    }};
    ($store:expr, |$db:ident| $recv:ident . $method:ident ( $($args:tt)* )) => {{
        $store.calls.count(stringify!($method));
        match &$store.backend {
            $crate::store::Backend::Postgres(pool) => pool,
            $crate::store::Backend::Sqlite($db) => {
                return $recv.$method($($args)*).await.map_err(|e| $db.name_file(e));
            }
        }
    }};
}
pub(crate) use pg_or_sqlite;

/// The options of every pool the store opens, on both backends: at most `max`
/// connections, and a connection taken from the pool is checked with a round trip only
/// when it has been idle for longer than `recheck_idle`.
///
/// sqlx already checks each connection as it goes back to the pool (a ping after every
/// use, not configurable), so one used within `recheck_idle` answered moments ago. Its
/// default, a second ping before every use, made every statement three round trips; in a
/// resumed reconnect's profile the pings were about a tenth of the server's CPU. What this
/// gives up: a connection that broke while idle for less than `recheck_idle` (the
/// database restarted that moment) fails the one statement that takes it, which returns
/// the store's error as any failed statement does, and the failed check on its return
/// closes it. `recheck_idle` zero checks before every use, as sqlx does by default.
pub(crate) fn pool_options<DB: sqlx::Database>(
    max: u32,
    recheck_idle: std::time::Duration,
) -> sqlx::pool::PoolOptions<DB> {
    sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(max)
        .test_before_acquire(false)
        .before_acquire(move |conn, meta| {
            Box::pin(async move {
                if checked_before_use(meta.idle_for, recheck_idle) {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
}

/// Whether [`pool_options`]' pools check a connection idle for `idle_for` before a
/// statement uses it.
fn checked_before_use(idle_for: std::time::Duration, recheck_idle: std::time::Duration) -> bool {
    recheck_idle.is_zero() || idle_for > recheck_idle
}

/// Runs `$rule(&mut *tx, args…)` in a write transaction of the store's backend and commits,
/// counted under `$name` as every store operation is ([`pg_or_sqlite!`]).
macro_rules! in_write {
    ($store:expr, $name:literal, $rule:ident ( $($arg:expr),* )) => {{
        let pool = $crate::store::pg_or_sqlite!($store, $name, |db| async {
            let mut tx = db.begin_write().await?;
            let out = $rule(&mut *tx, $($arg),*).await?;
            tx.commit().await?;
            Ok(out)
        });
        let mut tx = pool.begin().await?;
        let out = $rule(&mut *tx, $($arg),*).await?;
        tx.commit().await?;
        Ok(out)
    }};
}
pub(crate) use in_write;

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
    /// What one user's XEP-0160 store may hold, in all and per sender
    /// ([`Store::store_offline_message`] applies it).
    pub offline: offline::OfflineQuota,
    /// XEP-0163 nodes per account: a publish that would create one more is refused
    /// ([`pep::Published::TooManyNodes`]).
    pub max_pep_nodes: usize,
    /// Items kept per XEP-0163 node; a publish beyond it deletes the oldest.
    pub max_pep_items: usize,
    /// Bytes of XEP-0163 payloads per account: a publish that would go beyond is refused
    /// ([`pep::Published::OverBudget`]).
    pub max_pep_bytes: usize,
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
            offline: offline::OfflineQuota {
                messages: l.max_offline_messages,
                bytes: l.max_offline_bytes,
                contact_messages: l.max_offline_messages_per_sender,
                contact_bytes: l.max_offline_bytes_per_sender,
                stranger_messages: l.max_offline_messages_per_stranger,
                stranger_bytes: l.max_offline_bytes_per_stranger,
            },
            max_pep_nodes: l.max_pep_nodes,
            max_pep_items: l.max_pep_items,
            max_pep_bytes: l.max_pep_bytes,
        }
    }
}

impl Default for StoreLimits {
    fn default() -> Self {
        StoreLimits::from_config(&crate::config::LimitsConfig::default())
    }
}

/// The `application_name` of the store's PostgreSQL connections, so an operator (and a
/// test) can tell presenced's connections from others in `pg_stat_activity`.
pub const APPLICATION_NAME: &str = "presenced";

/// Connection options of a PostgreSQL URL, named `name` in `pg_stat_activity` unless the
/// URL names the connections itself (`?application_name=…` wins).
pub(crate) fn pg_options(
    url: &str,
    name: &str,
) -> Result<sqlx::postgres::PgConnectOptions, sqlx::Error> {
    use std::str::FromStr;
    let options = sqlx::postgres::PgConnectOptions::from_str(url)?;
    Ok(match options.get_application_name() {
        Some(_) => options,
        None => options.application_name(name),
    })
}

/// Where a database URL points, for logs and errors: `host:port/database` (or the
/// socket directory) without user or password, or `sqlite:` and the file.
pub fn database_target(url: &str) -> String {
    use std::str::FromStr;
    if let Some(path) = sqlite::path_of(url) {
        return format!("sqlite:{}", path.display());
    }
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
    /// The SQLite file cannot be used: not creatable or writable, not a database or
    /// damaged, locked by another process beyond the busy timeout.
    #[error("SQLite file {}: {reason}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
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
            // SQLite names the constraint only in its message; the schema's triggers that
            // stand in for CHECKs raise the same message (migrations/sqlite).
            let sqlite_check = db.message().strip_prefix("CHECK constraint failed: ");
            match db.kind() {
                ErrorKind::CheckViolation => {
                    let name = db.constraint().or(sqlite_check).unwrap_or("check");
                    return StoreError::Constraint(name.to_owned());
                }
                // Every foreign key in the schema points at an account.
                ErrorKind::ForeignKeyViolation => return StoreError::NoSuchAccount,
                _ => {}
            }
            if let Some(name) = sqlite_check {
                return StoreError::Constraint(name.to_owned());
            }
        }
        StoreError::Database(e)
    }
}

/// A JID column of a row as read, parsed once here so callers hold the type. The schemas
/// check only a JID's shape, so a value written by other means may be no JID (RFC 7622
/// preparation refuses it): that is `None`, with a warning naming the row (`table`,
/// `owner`) and the value, and the caller leaves the row out, as the privacy gate's inputs
/// do ([`gate_inputs`]): a row that names nobody reaches nobody.
pub(crate) fn stored_jid<J>(table: &str, owner: &str, value: &str) -> Option<J>
where
    J: std::str::FromStr<Err = ::jid::Error>,
{
    match value.parse() {
        Ok(j) => Some(j),
        Err(e) => {
            tracing::warn!(table, owner, value, error = %e, "stored JID does not parse; row left out");
            None
        }
    }
}

use crate::policy::subscription::SubState;
pub use crate::policy::subscription::Subscription;
pub use accounts::DeletedAccount;
pub use last_seen::LastSeen;
pub use offline::OfflineMessage;
pub use pending::PendingChange;

/// One roster item (RFC 6121 §2.1.2) plus the server-side flags of Appendix A.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RosterItem {
    /// Bare JID of the contact.
    pub contact: BareJid,
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
    pub fn new(contact: BareJid) -> Self {
        RosterItem {
            contact,
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
    Removed(BareJid),
}

impl Store {
    /// Opens the database `url` names with at most `max_connections` connections (SQLite:
    /// readers, beside its one writer):
    /// `sqlite://path` opens (or creates) that file, anything else is PostgreSQL, whose
    /// database is created first if the server has none of that name (a fresh machine
    /// has only the default databases; this saves operators a manual `createdb`).
    pub async fn connect(url: &str, max_connections: u32) -> Result<Store, StoreError> {
        let defaults = crate::config::DatabaseConfig::default();
        Store::open(&crate::config::DatabaseConfig {
            url: url.to_owned(),
            max_connections,
            sqlite_readers: max_connections,
            ..defaults
        })
        .await
    }

    /// [`Store::connect`] with every `[database]` setting that concerns the connection.
    pub async fn open(config: &crate::config::DatabaseConfig) -> Result<Store, StoreError> {
        let (url, max_connections) = (config.url.as_str(), config.max_connections);
        if let Some(path) = sqlite::path_of(url) {
            let pools = sqlite::Pools::open(&path, sqlite::Sizes::from_config(config)).await?;
            return Ok(Store::with_backend(Backend::Sqlite(pools)));
        }
        use sqlx::migrate::MigrateDatabase;
        let failed = |source| StoreError::Connect {
            target: database_target(url),
            source,
        };
        if !sqlx::Postgres::database_exists(url).await.map_err(failed)? {
            // Expected on a first start and for copy-store's destination: not a warning.
            tracing::info!(database = %database_target(url), "database does not exist yet; creating it");
            if let Err(e) = sqlx::Postgres::create_database(url).await {
                // Another process may have created it meanwhile.
                if !sqlx::Postgres::database_exists(url).await.map_err(failed)? {
                    return Err(failed(e));
                }
            }
        }
        let options = pg_options(url, APPLICATION_NAME).map_err(failed)?;
        let pool = pool_options::<sqlx::Postgres>(max_connections.max(1), config.recheck_idle_secs)
            .connect_with(options)
            .await
            .map_err(failed)?;
        Ok(Store::from_pool(pool))
    }

    /// Wraps an existing PostgreSQL pool (e.g. one shared with other components).
    pub fn from_pool(pool: PgPool) -> Store {
        Store::with_backend(Backend::Postgres(pool))
    }

    fn with_backend(backend: Backend) -> Store {
        Store {
            backend,
            audience: Default::default(),
            limits: Default::default(),
            privacy_defaults: Default::default(),
            calls: Default::default(),
        }
    }

    /// Which SQL dialect this store speaks.
    pub fn dialect(&self) -> Dialect {
        match self.backend {
            Backend::Postgres(_) => Dialect::Postgres,
            Backend::Sqlite(_) => Dialect::Sqlite,
        }
    }

    /// Whether the database answers now: one `SELECT 1` on a reader's connection, timed.
    pub async fn ping(&self) -> Result<std::time::Duration, StoreError> {
        let started = std::time::Instant::now();
        match &self.backend {
            Backend::Postgres(pool) => {
                sqlx::query("SELECT 1").execute(pool).await?;
            }
            Backend::Sqlite(db) => {
                sqlx::query("SELECT 1").execute(db.reader()).await?;
            }
        }
        Ok(started.elapsed())
    }

    /// Closes every connection; later queries fail (as when the database goes away).
    pub async fn close(&self) {
        match &self.backend {
            Backend::Postgres(pool) => pool.close().await,
            Backend::Sqlite(db) => {
                db.write.close().await;
                db.read.close().await;
            }
        }
    }

    /// Sets what one account may store (the defaults of `[limits]` until called).
    pub fn set_limits(&self, limits: StoreLimits) {
        if let Ok(mut l) = self.limits.write() {
            *l = limits;
        }
    }

    /// Sets the privacy settings of users who never chose (`[privacy]`; everyone's
    /// subscribers until called). The caller drops the gate's cached inputs and has the
    /// gate re-decide what online users were shown.
    pub fn set_privacy_defaults(&self, defaults: &crate::config::PrivacyConfig) {
        use crate::config::DefaultVisibility;
        use crate::policy::privacy::Visibility;
        let visibility = |d: DefaultVisibility| match d {
            DefaultVisibility::Subscribers => Visibility::Subscribers,
            DefaultVisibility::Nobody => Visibility::Nobody,
        };
        if let Ok(mut p) = self.privacy_defaults.write() {
            p.online = visibility(defaults.online);
            p.last_seen = visibility(defaults.last_seen);
        }
    }

    /// The settings of a user with no row of their own.
    pub fn privacy_defaults(&self) -> crate::policy::privacy::PrivacySettings {
        self.privacy_defaults
            .read()
            .map(|p| p.clone())
            .unwrap_or_default()
    }

    /// What one account may store.
    pub fn limits(&self) -> StoreLimits {
        self.limits.read().map(|l| *l).unwrap_or_default()
    }

    /// The PostgreSQL pool, for components that need their own queries or LISTEN (the
    /// `presenced_roster` channel carries `<version> <owner>` for every roster change).
    ///
    /// # Panics
    /// On an SQLite store: PostgreSQL SQL has no meaning there ([`Store::sqlite_pool`]).
    pub fn pool(&self) -> &PgPool {
        match &self.backend {
            Backend::Postgres(pool) => pool,
            Backend::Sqlite(db) => panic!(
                "Store::pool is the PostgreSQL pool; this store is the SQLite file {}",
                db.path.display()
            ),
        }
    }

    /// The SQLite writer (the one connection that may write), for SQL of one's own;
    /// None on PostgreSQL.
    pub fn sqlite_pool(&self) -> Option<&sqlx::SqlitePool> {
        match &self.backend {
            Backend::Sqlite(db) => Some(&db.write),
            Backend::Postgres(_) => None,
        }
    }

    /// The SQLite readers' pool, for reads of one's own; None on PostgreSQL.
    pub fn sqlite_readers(&self) -> Option<&sqlx::SqlitePool> {
        match &self.backend {
            Backend::Sqlite(db) => Some(&db.read),
            Backend::Postgres(_) => None,
        }
    }

    /// Applies the schema compiled into the binary (`migrations/` or
    /// `migrations/sqlite/`, by dialect), then the operator's `*.sql` files in `dir`
    /// (absent is fine), each only once. On PostgreSQL sqlx holds an advisory lock
    /// meanwhile, so nodes starting together are safe.
    ///
    /// The operator's files are numbered from 1000 up. One below 1000 that is a copy of
    /// the built-in schema (a `dir` pointing at the repository's `migrations/`, the old
    /// default) is skipped; any other is refused, since it would take a number the
    /// server's own schema may need.
    pub async fn migrate(&self, dir: &Path) -> Result<(), StoreError> {
        let mut builtin = match self.dialect() {
            Dialect::Postgres => sqlx::migrate!("./migrations"),
            Dialect::Sqlite => sqlx::migrate!("./migrations/sqlite"),
        };
        // A database migrated by a newer build (or holding an operator's retired file)
        // must not stop an older binary from starting: unknown applied versions are
        // tolerated, edited files are still refused by their checksums.
        builtin.set_ignore_missing(true);
        let own = if dir.is_dir() {
            refuse_writable_by_others(dir)?;
            let mut own = sqlx::migrate::Migrator::new(dir).await.map_err(|source| {
                StoreError::MigrationsDir {
                    dir: dir.display().to_string(),
                    source,
                }
            })?;
            let mut kept = Vec::new();
            for m in own.migrations.iter() {
                if m.version >= OPERATOR_MIGRATIONS_FROM {
                    kept.push(m.clone());
                } else if !builtin
                    .migrations
                    .iter()
                    .any(|b| b.version == m.version && b.checksum == m.checksum)
                {
                    return Err(StoreError::Migrate(sqlx::migrate::MigrateError::Source(
                        format!(
                            "{}: migration {} ({}) is numbered below {OPERATOR_MIGRATIONS_FROM}; \
                             the server's own schema uses those numbers",
                            dir.display(),
                            m.version,
                            m.description
                        )
                        .into(),
                    )));
                }
            }
            own.migrations = kept.into();
            own.set_ignore_missing(true);
            Some(own)
        } else {
            None
        };
        match &self.backend {
            Backend::Postgres(pool) => {
                builtin.run(pool).await?;
                if let Some(own) = own {
                    own.run(pool).await?;
                }
            }
            Backend::Sqlite(db) => {
                // sqlx takes no lock on SQLite: two servers starting on a new file would
                // both find nothing applied. The write lock, held from the first statement
                // to the end, makes the second wait and then find everything applied
                // (each migration runs in a savepoint inside it).
                let run = async {
                    let mut tx = db.begin_write().await?;
                    builtin.run(&mut *tx).await?;
                    if let Some(own) = own {
                        own.run(&mut *tx).await?;
                    }
                    tx.commit().await?;
                    Ok::<(), StoreError>(())
                };
                run.await.map_err(|e| match e {
                    StoreError::Migrate(sqlx::migrate::MigrateError::Execute(inner)) => {
                        db.name_file(StoreError::Database(inner))
                    }
                    other => db.name_file(other),
                })?;
            }
        }
        Ok(())
    }
}

/// What [`trial_operator_migrations`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trial {
    /// The store has no schema yet: the operator's files are tried at its first start.
    NoSchemaYet,
    /// This many files are not applied yet, and all of them run on the store as it is.
    Runs(usize),
}

/// Runs the operator's migrations in `dir` that `url`'s store has not applied yet, in
/// order, inside one transaction that is then rolled back: whether the next start or
/// `migrate` would apply them, without changing anything. A file written for the other
/// dialect (SQLite's `INSERT INTO presenced_roster_make_mutual` on PostgreSQL, a
/// PostgreSQL function on SQLite) fails here with the store's own error, naming the file.
pub async fn trial_operator_migrations(url: &str, dir: &Path) -> Result<Trial, String> {
    if !dir.is_dir() {
        return Ok(Trial::Runs(0));
    }
    let migrator = sqlx::migrate::Migrator::new(dir)
        .await
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    // Connecting must not create the file or the database a check only looks at.
    let exists = match sqlite::path_of(url) {
        Some(path) => path.exists(),
        None => {
            use sqlx::migrate::MigrateDatabase;
            sqlx::Postgres::database_exists(url).await.unwrap_or(false)
        }
    };
    if !exists {
        return Ok(Trial::NoSchemaYet);
    }
    let store = Store::connect(url, 1).await.map_err(|e| e.to_string())?;
    let applied_sql = "SELECT version FROM _sqlx_migrations WHERE success";
    let applied: Result<Vec<i64>, sqlx::Error> = match &store.backend {
        Backend::Postgres(p) => sqlx::query_scalar(applied_sql).fetch_all(p).await,
        Backend::Sqlite(db) => sqlx::query_scalar(applied_sql).fetch_all(db.writer()).await,
    };
    let Ok(applied) = applied else {
        return Ok(Trial::NoSchemaYet);
    };
    let pending: Vec<_> = migrator
        .iter()
        .filter(|m| m.version >= OPERATOR_MIGRATIONS_FROM && !applied.contains(&m.version))
        .collect();
    let fail = |m: &sqlx::migrate::Migration, e: sqlx::Error| {
        format!(
            "{}: migration {} ({}) would fail on this store: {e}",
            dir.display(),
            m.version,
            m.description
        )
    };
    // The same statements on either pool, in one transaction that is rolled back.
    macro_rules! try_and_roll_back {
        ($pool:expr) => {{
            let mut tx = $pool.begin().await.map_err(|e| e.to_string())?;
            for m in &pending {
                sqlx::raw_sql(&m.sql)
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| fail(m, e))?;
            }
            tx.rollback().await.map_err(|e| e.to_string())?;
        }};
    }
    match &store.backend {
        Backend::Postgres(p) => try_and_roll_back!(p),
        Backend::Sqlite(db) => try_and_roll_back!(db.writer()),
    }
    store.close().await;
    Ok(Trial::Runs(pending.len()))
}

/// Refuses an operator's migrations directory, or a `.sql` file in it, that a user other
/// than its owner may write (group or others' write bit), as sshd refuses such key files:
/// whoever can write there runs SQL as the server, and `presenced migrate` is often run
/// as root.
pub(crate) fn refuse_writable_by_others(dir: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::PermissionsExt;
    let refuse = |path: &Path, mode: u32| {
        Err(StoreError::Migrate(sqlx::migrate::MigrateError::Source(
            format!(
                "{}: mode {:o} is writable by other users; the operator's migrations must \
                 be writable by their owner only (chmod go-w)",
                path.display(),
                mode & 0o777
            )
            .into(),
        )))
    };
    let writable = |m: &std::fs::Metadata| m.permissions().mode() & 0o022 != 0;
    let unreadable = |e: std::io::Error| StoreError::MigrationsDir {
        dir: dir.display().to_string(),
        source: sqlx::migrate::MigrateError::Source(Box::new(e)),
    };
    let meta = std::fs::metadata(dir).map_err(unreadable)?;
    if writable(&meta) {
        return refuse(dir, meta.permissions().mode());
    }
    let entries = std::fs::read_dir(dir).map_err(unreadable)?;
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|x| x == "sql") {
            if let Ok(meta) = std::fs::metadata(&path) {
                if writable(&meta) {
                    return refuse(&path, meta.permissions().mode());
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::checked_before_use;
    use std::time::Duration;

    #[test]
    fn a_pooled_connection_is_checked_only_once_idle_past_the_bound_or_always_with_zero() {
        let second = Duration::from_secs(1);
        let ms = Duration::from_millis;
        assert!(
            !checked_before_use(ms(0), second),
            "just returned: taken as it is"
        );
        assert!(!checked_before_use(ms(999), second));
        assert!(!checked_before_use(second, second), "at the bound: not yet");
        assert!(checked_before_use(ms(1_001), second), "past it: checked");
        assert!(checked_before_use(Duration::from_secs(3_600), second));
        assert!(
            checked_before_use(ms(0), Duration::ZERO),
            "zero checks every use"
        );
    }
}
