//! The Redis connection for liveness, and the writer task that applies [`Op`]s.
//!
//! Redis may be down at start or vanish at any time. [`RedisLink::conn`] hands out a
//! multiplexed connection or `None` at once (never blocking a caller longer than the
//! connect timeout, and only when a reconnection attempt is due); a failed command calls
//! [`RedisLink::failed`], which drops the connection and doubles the backoff. The first
//! successful connect after a failure sets `repair`, and the writer then rewrites every
//! local resource, so a restarted (empty) Redis gets the liveness state back.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::AsyncConnectionConfig;
use tokio::time::Instant;

use super::{Metrics, Op};
use crate::config::RedisConfig;

/// Sets the resource key and adds it to the user's set; both expire at ARGV[2] (ms).
/// KEYS: resource key, resources set. ARGV: node id, expire-at ms, resource.
/// PEXPIREAT NX then GT: the set gets an expiry if it had none, and only ever a later one.
pub const REFRESH_USER: &str = r"
redis.call('SET', KEYS[1], ARGV[1], 'PXAT', ARGV[2])
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('PEXPIREAT', KEYS[2], ARGV[2], 'NX')
redis.call('PEXPIREAT', KEYS[2], ARGV[2], 'GT')
return 1
";

/// Records a beat (never moving it back) and keeps the ZSET's own expiry ahead of it.
/// KEYS: beats ZSET. ARGV: member (full JID), score (ms), expire-at ms.
pub const BEAT: &str = r"
redis.call('ZADD', KEYS[1], 'GT', ARGV[2], ARGV[1])
redis.call('PEXPIREAT', KEYS[1], ARGV[3], 'NX')
redis.call('PEXPIREAT', KEYS[1], ARGV[3], 'GT')
return 1
";

/// Deletes a resource key and takes it out of the user's set (SREM keeps the set's expiry).
/// KEYS: resource key, resources set. ARGV: resource.
pub const REMOVE_USER: &str = r"
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
return 1
";

/// Shared Redis connection with backoff.
pub struct RedisLink {
    client: Option<redis::Client>,
    state: tokio::sync::Mutex<LinkState>,
    timeout: Duration,
    reconnect_max: Duration,
    up: AtomicBool,
    /// Set on every (re)connect: the writer rewrites local state.
    repair: AtomicBool,
    metrics: Arc<Metrics>,
    /// `host:port` (or socket path) of the server, named in every log line about it.
    target: Box<str>,
}

struct LinkState {
    conn: Option<MultiplexedConnection>,
    next_attempt: Instant,
    backoff: Duration,
}

const BACKOFF_START: Duration = Duration::from_millis(100);

impl RedisLink {
    /// A link to `config.url`; nothing connects yet. A malformed URL leaves Redis off for
    /// good (logged), which degrades presence but keeps the server up.
    pub fn new(config: &RedisConfig, metrics: Arc<Metrics>) -> RedisLink {
        let client = match redis::Client::open(config.url.as_str()) {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::error!(error = %e, "invalid [redis] url; liveness runs without Redis");
                None
            }
        };
        let target = client
            .as_ref()
            .map_or_else(String::new, |c| c.get_connection_info().addr.to_string())
            .into_boxed_str();
        RedisLink {
            client,
            target,
            state: tokio::sync::Mutex::new(LinkState {
                conn: None,
                next_attempt: Instant::now(),
                backoff: BACKOFF_START,
            }),
            timeout: config.timeout,
            reconnect_max: config.reconnect_max,
            up: AtomicBool::new(false),
            repair: AtomicBool::new(false),
            metrics,
        }
    }

    /// The client, for connections of their own (pub/sub).
    pub fn client(&self) -> Option<&redis::Client> {
        self.client.as_ref()
    }

    /// Where the link points (`host:port`, or the socket path).
    pub fn target(&self) -> &str {
        &self.target
    }

    /// The per-command timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Whether the last command succeeded.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    /// A connection, or `None` when Redis is down and the next attempt is not due yet.
    pub async fn conn(&self) -> Option<MultiplexedConnection> {
        let client = self.client.as_ref()?;
        let mut st = self.state.lock().await;
        if let Some(c) = &st.conn {
            return Some(c.clone());
        }
        if Instant::now() < st.next_attempt {
            return None;
        }
        let cfg = AsyncConnectionConfig::new()
            .set_connection_timeout(self.timeout)
            .set_response_timeout(self.timeout);
        match tokio::time::timeout(
            self.timeout * 2,
            client.get_multiplexed_async_connection_with_config(&cfg),
        )
        .await
        {
            Ok(Ok(c)) => {
                if !self.up.swap(true, Ordering::Relaxed) {
                    tracing::info!(redis = %self.target, "Redis connected; repairing liveness state");
                }
                self.metrics.redis_up.store(true, Ordering::Relaxed);
                self.repair.store(true, Ordering::Relaxed);
                st.backoff = BACKOFF_START;
                st.conn = Some(c.clone());
                Some(c)
            }
            failed => {
                let why = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => "connect timed out".to_owned(),
                };
                tracing::warn!(redis = %self.target, error = %why, retry_in = ?st.backoff, "Redis unreachable");
                st.next_attempt = Instant::now() + st.backoff;
                st.backoff = (st.backoff * 2).min(self.reconnect_max);
                None
            }
        }
    }

    /// A command on the current connection failed: drop it and back off.
    pub async fn failed(&self, error: &(dyn std::fmt::Display + Sync)) {
        self.metrics.redis_errors.fetch_add(1, Ordering::Relaxed);
        self.metrics.redis_up.store(false, Ordering::Relaxed);
        if self.up.swap(false, Ordering::Relaxed) {
            tracing::warn!(redis = %self.target, %error, "Redis command failed; presence degrades until it returns");
        }
        let mut st = self.state.lock().await;
        st.conn = None;
        st.next_attempt = Instant::now() + st.backoff;
        st.backoff = (st.backoff * 2).min(self.reconnect_max);
    }

    pub(crate) fn take_repair(&self) -> bool {
        self.repair.swap(false, Ordering::Relaxed)
    }
}

/// Adds the Redis commands of one op to a pipeline.
pub(crate) fn add_op(pipe: &mut redis::Pipeline, l: &super::Liveness, op: &Op) {
    match op {
        Op::Refresh { jid, beat_ms } => {
            let bare = jid.to_bare().to_string();
            let (expire, beats_expire) = l.expiry_ms(*beat_ms);
            pipe.cmd("EVAL")
                .arg(REFRESH_USER)
                .arg(2)
                .arg(l.keys.resource(jid))
                .arg(l.keys.resources(&bare))
                .arg(&l.node_id)
                .arg(expire)
                .arg(jid.resource().as_str())
                .ignore();
            pipe.cmd("EVAL")
                .arg(BEAT)
                .arg(1)
                .arg(l.keys.beats_for(&bare))
                .arg(l.keys.member(&l.node_id, jid))
                .arg(*beat_ms)
                .arg(beats_expire)
                .ignore();
        }
        Op::Remove { jid } => {
            let bare = jid.to_bare().to_string();
            pipe.cmd("EVAL")
                .arg(REMOVE_USER)
                .arg(2)
                .arg(l.keys.resource(jid))
                .arg(l.keys.resources(&bare))
                .arg(jid.resource().as_str())
                .ignore();
            pipe.cmd("ZREM")
                .arg(l.keys.beats_for(&bare))
                .arg(l.keys.member(&l.node_id, jid))
                .ignore();
        }
    }
}
