//! The embedded store: the same tables as PostgreSQL in one SQLite file, for a server
//! that needs nothing installed. [`super::Store`] holds either backend; each public
//! method of the store runs its PostgreSQL query or the SQLite twin here, so callers
//! never see which one is in use. Only SQL is here: the rules around it (bounds, what is
//! kept, how rows become values) are the `store/` modules' own, run by both backends (see
//! [`super`]).
//!
//! The schema is `migrations/sqlite/`, compiled into the binary. Shape of the file:
//!
//! * WAL journal, `synchronous = FULL`: readers never wait for the writer, and a
//!   transaction that returned from its commit is on disk;
//! * one writer: every write goes through a pool of exactly one connection and starts
//!   with `BEGIN IMMEDIATE`, so a count checked before an insert (roster size, block
//!   list size, waiting requests) cannot change before the insert. This is what the
//!   PostgreSQL queries get from locking the owner's `roster_versions` row;
//! * reads use their own pool (`[database] sqlite_readers` connections) and see one
//!   snapshot per transaction;
//! * each connection's page cache is bounded (`[database] sqlite_cache_kib`): SQLite keeps
//!   up to 2 MiB per connection by default, which a server filled during its first logins
//!   and held for good, a fixed cost that showed as memory per session. A page not cached
//!   is read again from the operating system's cache of the file;
//! * foreign keys on for every connection (SQLite leaves them off by default);
//! * what PostgreSQL announces with NOTIFY, the triggers append to `presenced_changes`,
//!   which [`super::notify`] polls.
//!
//! Errors that concern the file itself (it cannot be created or opened, it is not a
//! database, another process holds its lock for longer than the busy timeout) come back
//! as [`StoreError::File`], naming it.

mod accounts;
mod lists;
mod offline;
mod pep;
mod roster;
mod vcard;

use std::path::{Path, PathBuf};
use std::time::Duration;

use chrono::{DateTime, NaiveDateTime, Utc};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqliteSynchronous};

use super::StoreError;

/// The two pools on one SQLite file.
#[derive(Clone, Debug)]
pub struct Pools {
    /// Reads; several connections, each transaction one snapshot.
    pub(super) read: SqlitePool,
    /// The single writer.
    pub(super) write: SqlitePool,
    /// The file, for error messages.
    pub(super) path: PathBuf,
    /// How long a statement waits for another process's lock (`[database]
    /// sqlite_busy_timeout`).
    busy_timeout: Duration,
}

pub use crate::config::sqlite_path as path_of;

/// How [`Pools::open`] sizes the pools (the `[database]` keys of the same names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sizes {
    /// Connections of the readers' pool.
    pub readers: u32,
    /// Page cache of each connection, KiB.
    pub cache_kib: u32,
    /// How long a statement waits for another process's lock.
    pub busy_timeout: Duration,
    /// How long a pooled connection may be idle and used without a check
    /// ([`super::pool_options`]).
    pub recheck_idle: Duration,
}

impl Sizes {
    /// The `[database]` settings.
    pub fn from_config(db: &crate::config::DatabaseConfig) -> Sizes {
        Sizes {
            readers: db.sqlite_readers,
            cache_kib: db.sqlite_cache_kib,
            busy_timeout: db.sqlite_busy_timeout,
            recheck_idle: db.recheck_idle_secs,
        }
    }
}

/// Creates the file at `path`, if there is none, readable and writable by this process's
/// user only: it holds every account's SCRAM StoredKey and ServerKey, and SQLite gives its
/// `-wal` and `-shm` files the database file's mode. An existing file readable by others
/// is left as the operator made it, with a warning. A failure here is left for the open
/// that follows to report, naming the file.
fn create_private(path: &Path) {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            if let Ok(meta) = std::fs::metadata(path) {
                let mode = meta.permissions().mode();
                if mode & 0o077 != 0 {
                    tracing::warn!(
                        file = %path.display(),
                        mode = format!("{:o}", mode & 0o777),
                        "the database file (SCRAM keys) is readable by other users; chmod 600 it"
                    );
                }
            }
        }
        Err(_) => {}
    }
}

/// Connection options shared by both pools.
fn options(path: &Path, sizes: Sizes) -> SqliteConnectOptions {
    SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .foreign_keys(true)
        .busy_timeout(sizes.busy_timeout)
        // A negative cache_size is a size in KiB, not a number of pages.
        .pragma("cache_size", format!("-{}", sizes.cache_kib.max(1)))
}

impl Pools {
    /// Opens (creating it if missing) the file at `path` with one writer and up to
    /// `sizes.readers` readers, and checks it is an SQLite database. A statement waits
    /// up to `sizes.busy_timeout` for another process's lock.
    pub async fn open(path: &Path, sizes: Sizes) -> Result<Pools, StoreError> {
        create_private(path);
        let busy_timeout = sizes.busy_timeout;
        let named =
            |e: sqlx::Error| file_error(path, busy_timeout, &e).unwrap_or(StoreError::Database(e));
        let write = connect(path, sizes, 1).await.map_err(named)?;
        // Opening succeeds on a file that is no database; the first read of the schema
        // is what finds out.
        sqlx::query("SELECT count(*) FROM sqlite_master")
            .execute(&write)
            .await
            .map_err(named)?;
        let read = connect(path, sizes, sizes.readers.max(1))
            .await
            .map_err(named)?;
        Ok(Pools {
            read,
            write,
            path: path.to_owned(),
            busy_timeout,
        })
    }

    /// The readers' pool.
    pub(super) fn reader(&self) -> &SqlitePool {
        &self.read
    }

    /// The writer's pool.
    pub(super) fn writer(&self) -> &SqlitePool {
        &self.write
    }

    /// Starts a write transaction holding the file's write lock from its first
    /// statement (see the module documentation).
    pub(super) async fn begin_write(
        &self,
    ) -> Result<sqlx::Transaction<'static, sqlx::Sqlite>, StoreError> {
        Ok(self.write.begin_with("BEGIN IMMEDIATE").await?)
    }

    /// `e` as [`StoreError::File`] when it is about the file rather than the data.
    pub(super) fn name_file(&self, e: StoreError) -> StoreError {
        match e {
            StoreError::Database(inner) => file_error(&self.path, self.busy_timeout, &inner)
                .unwrap_or(StoreError::Database(inner)),
            other => other,
        }
    }
}

/// SQLite result codes that mean the file, not the query, is the problem, with what to
/// tell the operator.
/// A pool of `max` connections to `path`. A connection's setup (WAL mode) on a file
/// others are setting up at the same moment can be refused as busy at once, without
/// SQLite's busy handler: such a refusal is retried until the busy timeout, as a lock held
/// by another process would be waited for.
async fn connect(path: &Path, sizes: Sizes, max: u32) -> Result<SqlitePool, sqlx::Error> {
    let deadline = tokio::time::Instant::now() + sizes.busy_timeout;
    loop {
        match super::pool_options::<sqlx::Sqlite>(max, sizes.recheck_idle)
            .connect_with(options(path, sizes))
            .await
        {
            Err(e) if is_busy(&e) && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            result => return result,
        }
    }
}

/// Whether `e` is SQLite's SQLITE_BUSY or SQLITE_LOCKED (the primary result code is the
/// low byte of the extended one).
fn is_busy(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db)
        if db.code().and_then(|c| c.parse::<i32>().ok()).is_some_and(|c| matches!(c & 0xff, 5 | 6)))
}

fn file_error(path: &Path, busy_timeout: Duration, e: &sqlx::Error) -> Option<StoreError> {
    let reason = match e {
        sqlx::Error::Database(db) => {
            // The primary result code is the low byte of the extended one.
            let code = db.code()?.parse::<i32>().ok()? & 0xff;
            match code {
                5 | 6 => format!(
                    "locked by another process for more than {:?} ({db})",
                    busy_timeout
                ),
                8 => format!("cannot be written: the file or its directory is read-only ({db})"),
                10 => format!("input/output error ({db})"),
                11 | 26 => format!("is not an SQLite database or is damaged ({db})"),
                13 => format!("the disk is full ({db})"),
                14 => format!(
                    "cannot be opened or created: does its directory exist and may this user \
                     write there? ({db})"
                ),
                _ => return None,
            }
        }
        sqlx::Error::Io(io) => format!("cannot be opened: {io}"),
        _ => return None,
    };
    Some(StoreError::File {
        path: path.to_owned(),
        reason,
    })
}

/// A list column's JSON text.
pub(super) fn json_list<S: AsRef<str>>(items: &[S]) -> String {
    let v: Vec<&str> = items.iter().map(AsRef::as_ref).collect();
    serde_json::to_string(&v).unwrap_or_else(|_| "[]".to_owned())
}

/// A list column read back; anything but an array of strings is corrupt.
pub(super) fn parse_list(text: &str, what: &str) -> Result<Vec<String>, StoreError> {
    serde_json::from_str(text).map_err(|_| StoreError::Corrupt(format!("{what} {text:?}")))
}

/// A time as the server writes it: fixed-width UTC with microseconds, so that text
/// comparison in SQL is time comparison.
pub(super) fn time_text(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()
}

/// A time read back: RFC 3339 as the server writes it, or `YYYY-MM-DD HH:MM:SS[.f]`
/// (SQLite's own `datetime()` form, what an operator may type) taken as UTC.
pub(super) fn parse_time(text: &str) -> Result<DateTime<Utc>, StoreError> {
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Ok(t.with_timezone(&Utc));
    }
    NaiveDateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f")
        .map(|t| t.and_utc())
        .map_err(|_| StoreError::Corrupt(format!("time {text:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_urls_name_their_file_and_others_none() {
        assert_eq!(
            path_of("sqlite://presenced.db"),
            Some("presenced.db".into())
        );
        assert_eq!(
            path_of("sqlite:///var/lib/p.db"),
            Some("/var/lib/p.db".into())
        );
        assert_eq!(path_of("sqlite:p.db?mode=rwc"), Some("p.db".into()));
        assert_eq!(path_of("postgres://u@h/db"), None);
    }

    #[test]
    fn stored_times_sort_as_text_and_read_back() {
        let a = DateTime::parse_from_rfc3339("2026-01-01T00:00:09.5Z").unwrap();
        let b = DateTime::parse_from_rfc3339("2026-01-01T00:00:10Z").unwrap();
        let (ta, tb) = (time_text(a.into()), time_text(b.into()));
        assert!(ta < tb, "{ta} {tb}");
        assert_eq!(parse_time(&ta).unwrap(), a);
        assert_eq!(
            parse_time("2026-01-01 00:00:10").unwrap(),
            DateTime::<Utc>::from(b)
        );
        assert!(parse_time("yesterday").is_err());
    }
}
