//! LISTEN/NOTIFY consumer: changes made in the database by anyone (another node, an
//! operator's SQL) reach this node as [`Notification`]s on a channel.
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
}

impl Default for ListenOptions {
    fn default() -> Self {
        ListenOptions {
            queue: 1024,
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(10),
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

async fn connect(url: &str, channels: &[String]) -> Result<PgListener, StoreError> {
    let mut listener = PgListener::connect(url).await?;
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
