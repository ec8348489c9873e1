//! The SASL back-off counted across the cluster. Every node keeps its own table
//! ([`crate::policy::auth_backoff::AuthBackoff`]); with Redis the failures of a (source, account)
//! pair are also counted there, so a guesser that spreads its attempts over the nodes of
//! a cluster gets the same number of tries as on one node, and a lock set by one node
//! holds on all of them. The rules (threshold, window, doubling) are the table's
//! ([`crate::policy::auth_backoff::BackoffPolicy`]); only the counting moves.
//!
//! Keys, under `[redis] key_prefix`, one hash tag per pair so both live in one slot:
//!
//! ```text
//! <prefix>auth:{<pair>}:fail   failures in a row, expiring `window` after the last
//! <prefix>auth:{<pair>}:lock   present while the pair is locked, expiring with the lock
//! ```
//!
//! `<pair>` is a keyed hash (HMAC-SHA-256 under the server secret every node shares, cut to
//! 128 bits) of the source and the account, so Redis holds no JID and nobody can choose
//! names that collide. A login costs one round trip (both keys read together); a failure
//! one or two more; a success after failures one more. When Redis does not answer the
//! node's own table still counts, as in a single node.

use std::net::IpAddr;
use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::node::Shared;
use crate::policy::auth_backoff::BackoffPolicy;

/// What Redis said of a pair before its password check.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Seen {
    /// Time left of a lock set by any node.
    pub locked: Option<Duration>,
    /// Whether failures are counted, so a success must clear them.
    pub failures: bool,
}

/// The hash-tagged key stem of the pair.
fn stem(shared: &Shared, source: IpAddr, account: &str) -> String {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&shared.fake_salt_secret)
        .expect("HMAC takes a key of any length");
    mac.update(b"sasl-backoff\0");
    mac.update(
        crate::policy::rate_limit::source_of(source)
            .to_string()
            .as_bytes(),
    );
    mac.update(b"\0");
    mac.update(account.as_bytes());
    let digest = mac.finalize().into_bytes();
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("{}auth:{{{hex}}}", shared.liveness.keys.prefix)
}

/// Runs `pipe` on the node's Redis, within its command timeout; `None` without Redis or
/// on any failure (which the link records, as for every other command).
async fn query<T: redis::FromRedisValue>(shared: &Shared, pipe: &redis::Pipeline) -> Option<T> {
    let link = shared.liveness.redis()?;
    let mut conn = link.conn().await?;
    match tokio::time::timeout(link.timeout(), pipe.query_async::<T>(&mut conn)).await {
        Ok(Ok(v)) => Some(v),
        Ok(Err(e)) => {
            link.failed(&e).await;
            None
        }
        Err(_) => {
            link.failed(&"SASL back-off command timed out").await;
            None
        }
    }
}

/// The pair's state in Redis (nothing without Redis).
pub(super) async fn seen(shared: &Shared, source: IpAddr, account: &str) -> Seen {
    let stem = stem(shared, source, account);
    let mut pipe = redis::pipe();
    pipe.cmd("PTTL")
        .arg(format!("{stem}:lock"))
        .cmd("EXISTS")
        .arg(format!("{stem}:fail"));
    match query::<(i64, bool)>(shared, &pipe).await {
        Some((pttl, failures)) => Seen {
            locked: u64::try_from(pttl)
                .ok()
                .filter(|ms| *ms > 0)
                .map(Duration::from_millis),
            failures,
        },
        None => Seen::default(),
    }
}

/// Counts a failure of the pair on every node; returns the lock it started, if any.
pub(super) async fn failed(
    shared: &Shared,
    policy: &BackoffPolicy,
    source: IpAddr,
    account: &str,
) -> Option<Duration> {
    let stem = stem(shared, source, account);
    let fail = format!("{stem}:fail");
    let window = u64::try_from(policy.window.as_millis()).unwrap_or(u64::MAX);
    let mut pipe = redis::pipe();
    pipe.cmd("INCR")
        .arg(&fail)
        .cmd("PEXPIRE")
        .arg(&fail)
        .arg(window)
        .ignore();
    let (count,): (u32,) = query(shared, &pipe).await?;
    let lock = policy.lock_for(count)?;
    let mut pipe = redis::pipe();
    pipe.cmd("SET")
        .arg(format!("{stem}:lock"))
        .arg(1)
        .arg("PX")
        .arg(u64::try_from(lock.as_millis()).unwrap_or(u64::MAX).max(1))
        .ignore();
    query::<()>(shared, &pipe).await;
    Some(lock)
}

/// A success forgets the pair's failures on every node.
pub(super) async fn succeeded(shared: &Shared, source: IpAddr, account: &str) {
    let mut pipe = redis::pipe();
    pipe.cmd("DEL")
        .arg(format!("{}:fail", stem(shared, source, account)))
        .ignore();
    query::<()>(shared, &pipe).await;
}
