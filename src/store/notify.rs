//! LISTEN/NOTIFY consumer: changes made in the database by anyone (another node, an
//! operator's SQL) reach this node as [`Notification`]s on a channel.
//!
//! On SQLite, which has no LISTEN/NOTIFY, the same triggers append `(channel, payload)`
//! rows to the table `presenced_changes`, and [`listen_with`] polls it every
//! [`ListenOptions::poll_interval`] instead: a change made with the sqlite3 shell while
//! the server runs arrives as the same notification. The poller starts after the newest
//! row present, deletes rows older than [`ListenOptions::keep_changes`], and sends the
//! resync marker after a failed poll or when rows it had not read yet were deleted.
//!
//! The schema's triggers send:
//!
//! | channel              | payload              | sent on                          |
//! |----------------------|----------------------|----------------------------------|
//! | `presenced_roster`   | `<version> <owner>`  | every roster item change         |
//! | `presenced_block`    | `<owner>`            | every block list change          |
//! | `presenced_privacy`  | `<owner>`            | every privacy settings change    |
//!
//! PostgreSQL does not keep notifications for a listener that is not connected. When the
//! connection is lost the listener reconnects (with backoff) and then delivers a
//! [`Notification::resync`] marker: anything may have changed while it was away, so the
//! consumer rechecks what it caches (e.g. compares each online user's roster version with
//! the database). The marker comes after LISTEN is in place again, so a change made after
//! the recheck starts is never missed.

use std::time::Duration;

use sqlx::postgres::PgListener;
use tokio::sync::mpsc;

use super::StoreError;

/// Channel of roster changes; payload `<version> <owner>` ([`parse_roster_notification`]).
pub const ROSTER_CHANNEL: &str = "presenced_roster";
/// Channel of block list changes; payload is the owner's bare JID.
pub const BLOCK_CHANNEL: &str = "presenced_block";
/// Channel of privacy settings changes; payload is the owner's bare JID.
pub const PRIVACY_CHANNEL: &str = "presenced_privacy";

/// One notification from the database, or the resync marker after a reconnect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The channel it was sent on; empty for the resync marker (PostgreSQL channel
    /// names are never empty).
    pub channel: String,
    /// The payload as sent by `pg_notify`.
    pub payload: String,
}

impl Notification {
    /// The marker sent after the listener reconnected: notifications may have been lost
    /// while it was disconnected.
    pub fn resync() -> Notification {
        Notification {
            channel: String::new(),
            payload: String::new(),
        }
    }

    /// Whether this is the [`Notification::resync`] marker.
    pub fn is_resync(&self) -> bool {
        self.channel.is_empty()
    }
}

/// Tuning of [`listen_with`]; every number has a default.
#[derive(Debug, Clone)]
pub struct ListenOptions {
    /// Notifications buffered for a slow consumer; when full, the listener waits (and
    /// PostgreSQL queues for it, up to its own limit).
    pub queue: usize,
    /// First wait after a failed reconnect.
    pub backoff_min: Duration,
    /// Longest wait between reconnect attempts (the wait doubles up to this).
    pub backoff_max: Duration,
    /// SQLite: how often `presenced_changes` is read.
    pub poll_interval: Duration,
    /// SQLite: how long the poller waits for another process's lock.
    pub busy_timeout: Duration,
    /// SQLite: the page cache of each of the poller's connections, KiB.
    pub cache_kib: u32,
    /// SQLite: how long a row of `presenced_changes` is kept for a slow reader.
    pub keep_changes: Duration,
}

impl Default for ListenOptions {
    fn default() -> Self {
        ListenOptions {
            queue: 1024,
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(10),
            poll_interval: Duration::from_millis(250),
            busy_timeout: Duration::from_secs(5),
            cache_kib: crate::config::DatabaseConfig::default().sqlite_cache_kib,
            keep_changes: Duration::from_secs(600),
        }
    }
}

impl ListenOptions {
    /// The defaults with the `[database]` settings that concern listening.
    pub fn from_config(db: &crate::config::DatabaseConfig) -> ListenOptions {
        ListenOptions {
            poll_interval: db.change_poll_interval,
            busy_timeout: db.sqlite_busy_timeout,
            cache_kib: db.sqlite_cache_kib,
            ..ListenOptions::default()
        }
    }
}

/// Listens on `channels` with [`ListenOptions::default`]. See [`listen_with`].
pub async fn listen(
    url: &str,
    channels: &[&str],
) -> Result<mpsc::Receiver<Notification>, StoreError> {
    listen_with(url, channels, ListenOptions::default()).await
}

/// Connects a dedicated listener connection to `url`, LISTENs on `channels` and returns
/// the receiving end. The first connection's failure is returned here; later failures
/// are retried forever with backoff, each recovery followed by a
/// [`Notification::resync`]. Dropping the receiver ends the task and closes the
/// connection.
pub async fn listen_with(
    url: &str,
    channels: &[&str],
    options: ListenOptions,
) -> Result<mpsc::Receiver<Notification>, StoreError> {
    let channels: Vec<String> = channels.iter().map(|c| (*c).to_owned()).collect();
    if let Some(path) = super::sqlite::path_of(url) {
        return poll::start(&path, channels, options).await;
    }
    let listener = connect(url, &channels).await?;
    let (tx, rx) = mpsc::channel(options.queue.max(1));
    tokio::spawn(run(listener, url.to_owned(), channels, options, tx));
    Ok(rx)
}

/// Parses a `presenced_roster` payload into (new roster version, owner bare JID).
pub fn parse_roster_notification(payload: &str) -> Option<(i64, String)> {
    let (version, owner) = payload.split_once(' ')?;
    let version = version.parse().ok()?;
    if owner.is_empty() || owner.contains(char::is_whitespace) {
        return None;
    }
    Some((version, owner.to_owned()))
}

/// The `application_name` of the LISTEN connection.
pub const LISTENER_APPLICATION_NAME: &str = "presenced listener";

async fn connect(url: &str, channels: &[String]) -> Result<PgListener, StoreError> {
    // What `PgListener::connect` does (a pool of one, without timeouts: the pool only
    // reconnects), with the connection named.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .max_lifetime(None)
        .idle_timeout(None)
        .connect_with(super::pg_options(url, LISTENER_APPLICATION_NAME)?)
        .await?;
    let mut listener = PgListener::connect_with(&pool).await?;
    listener
        .listen_all(channels.iter().map(String::as_str))
        .await?;
    Ok(listener)
}

/// The listener task: forwards notifications until the receiver is dropped.
async fn run(
    mut listener: PgListener,
    url: String,
    channels: Vec<String>,
    options: ListenOptions,
    tx: mpsc::Sender<Notification>,
) {
    loop {
        let received = tokio::select! {
            _ = tx.closed() => return,
            r = listener.try_recv() => r,
        };
        let forward = match received {
            Ok(Some(n)) => Notification {
                channel: n.channel().to_owned(),
                payload: n.payload().to_owned(),
            },
            // sqlx lost the connection and has already reconnected and re-LISTENed.
            Ok(None) => Notification::resync(),
            Err(e) => {
                tracing::warn!(error = %e, "LISTEN connection failed; reconnecting");
                drop(listener);
                match reconnect(&url, &channels, &options, &tx).await {
                    Some(l) => listener = l,
                    None => return,
                }
                Notification::resync()
            }
        };
        if tx.send(forward).await.is_err() {
            return;
        }
    }
}

/// Opens a fresh listener, waiting with doubling backoff between attempts; `None` when
/// the receiver went away meanwhile.
async fn reconnect(
    url: &str,
    channels: &[String],
    options: &ListenOptions,
    tx: &mpsc::Sender<Notification>,
) -> Option<PgListener> {
    let mut wait = options.backoff_min;
    loop {
        tokio::select! {
            _ = tx.closed() => return None,
            _ = tokio::time::sleep(wait) => {}
        }
        let attempt = tokio::select! {
            _ = tx.closed() => return None,
            r = connect(url, channels) => r,
        };
        match attempt {
            Ok(l) => return Some(l),
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?wait, "LISTEN reconnect failed");
                wait = (wait * 2).min(options.backoff_max.max(options.backoff_min));
            }
        }
    }
}

/// The SQLite side: polling `presenced_changes`.
mod poll {
    use std::path::Path;

    use tokio::sync::mpsc;

    use super::{ListenOptions, Notification};
    use crate::store::sqlite::{Pools, Sizes};
    use crate::store::StoreError;

    /// Opens the file, notes the newest change and spawns the poller.
    pub(super) async fn start(
        path: &Path,
        channels: Vec<String>,
        options: ListenOptions,
    ) -> Result<mpsc::Receiver<Notification>, StoreError> {
        let sizes = Sizes {
            readers: 1,
            cache_kib: options.cache_kib,
            busy_timeout: options.busy_timeout,
            recheck_idle: crate::config::DatabaseConfig::default().recheck_idle_secs,
        };
        let db = Pools::open(path, sizes).await?;
        let last = newest(&db).await.map_err(|e| db.name_file(e))?;
        let (tx, rx) = mpsc::channel(options.queue.max(1));
        tokio::spawn(run(db, last, channels, options, tx));
        Ok(rx)
    }

    async fn newest(db: &Pools) -> Result<i64, StoreError> {
        Ok(
            sqlx::query_scalar("SELECT coalesce(max(id), 0) FROM presenced_changes")
                .fetch_one(db.reader())
                .await?,
        )
    }

    /// Rows after `last` on `channels`, oldest first, and whether rows after `last` had
    /// already been deleted (so some were missed).
    async fn read(
        db: &Pools,
        last: i64,
        channels: &str,
    ) -> Result<(Vec<(i64, String, String)>, bool), StoreError> {
        let mut tx = db.reader().begin().await?;
        let rows: Vec<(i64, String, String)> = sqlx::query_as(
            "SELECT id, channel, payload FROM presenced_changes
             WHERE id > ?1 AND channel IN (SELECT value FROM json_each(?2)) ORDER BY id",
        )
        .bind(last)
        .bind(channels)
        .fetch_all(&mut *tx)
        .await?;
        // AUTOINCREMENT ids have no gaps but those of rolled-back transactions; a gap
        // right after `last` that reaches past the oldest row kept means pruned rows.
        let oldest: Option<i64> = sqlx::query_scalar("SELECT min(id) FROM presenced_changes")
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok((rows, oldest.is_some_and(|o| o > last + 1)))
    }

    async fn prune(db: &Pools, keep: std::time::Duration) -> Result<(), StoreError> {
        sqlx::query(
            "DELETE FROM presenced_changes
             WHERE at < strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?1)",
        )
        .bind(format!("-{:.3} seconds", keep.as_secs_f64()))
        .execute(db.writer())
        .await?;
        Ok(())
    }

    async fn run(
        db: Pools,
        mut last: i64,
        channels: Vec<String>,
        options: ListenOptions,
        tx: mpsc::Sender<Notification>,
    ) {
        let channels_json = crate::store::sqlite::json_list(&channels);
        let mut tick = tokio::time::interval(
            options
                .poll_interval
                .max(std::time::Duration::from_millis(1)),
        );
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        let mut last_prune = tokio::time::Instant::now();
        loop {
            tokio::select! {
                _ = tx.closed() => return,
                _ = tick.tick() => {}
            }
            let (rows, missed) = match read(&db, last, &channels_json).await {
                Ok(r) => r,
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %db.name_file(e), "reading presenced_changes failed; retrying");
                    }
                    failing = true;
                    continue;
                }
            };
            if failing || missed {
                // Changes may have gone unseen: the consumer rechecks everything.
                failing = false;
                if tx.send(Notification::resync()).await.is_err() {
                    return;
                }
            }
            for (id, channel, payload) in rows {
                last = id;
                if tx.send(Notification { channel, payload }).await.is_err() {
                    return;
                }
            }
            if last_prune.elapsed() >= options.keep_changes / 10 {
                last_prune = tokio::time::Instant::now();
                if let Err(e) = prune(&db, options.keep_changes).await {
                    tracing::warn!(error = %db.name_file(e), "pruning presenced_changes failed");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roster_payloads_parse_into_version_and_owner() {
        assert_eq!(
            parse_roster_notification("1732950000000001 alice@example.org"),
            Some((1732950000000001, "alice@example.org".to_owned()))
        );
        for bad in [
            "",
            "alice@example.org",
            "12",
            "12 ",
            "x12 alice@example.org",
            "12 alice@example.org extra",
        ] {
            assert_eq!(parse_roster_notification(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_resync_marker_is_no_real_channel() {
        assert!(Notification::resync().is_resync());
        let real = Notification {
            channel: ROSTER_CHANNEL.to_owned(),
            payload: "1 a@b".to_owned(),
        };
        assert!(!real.is_resync());
    }
}
