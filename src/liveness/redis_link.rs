//! The Redis connection for liveness, and the commands the writer task sends for [`Op`]s.
//!
//! Redis (one server or a Redis Cluster, [`crate::cluster::redis_conn`]) may be down at start or
//! vanish at any time. [`RedisLink::conn`] hands out a multiplexed connection or `None` at
//! once (never blocking a caller longer than the connect timeout, and only when a
//! reconnection attempt is due); a failed command calls [`RedisLink::failed`], which drops
//! the connection and backs off (doubling, jittered; measured on the node's
//! [`Clock::instant`], so a test on paused time controls when the next attempt is due). The first successful connect after a
//! failure sets `repair`, and the writer then rewrites every local resource, so a restarted
//! (empty) Redis gets the liveness state back.
//!
//! Cost at rest: a refresh is two write commands, `SET <res> <node> PXAT beat+T` (the key
//! and its expiry in one command) and `ZADD <beats> GT beat <member>` (never moves a beat
//! back). The beat ZSET's own expiry is not written per refresh: the writer moves each
//! shard's expiry to now + 3T at most once per T ([`ShardExpiry`]), a cost per node that
//! does not grow with the number of resources. A removal is `DEL` plus `ZREM`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Clock, Metrics, Op};
use crate::cluster::redis_conn::{backoff, Conn, SlotPipe, Target};
use crate::config::Config;

/// Shared Redis connection with backoff.
pub struct RedisLink {
    target: Option<Target>,
    state: tokio::sync::Mutex<LinkState>,
    timeout: Duration,
    reconnect_max: Duration,
    up: AtomicBool,
    /// Set on every (re)connect: the writer rewrites local state.
    repair: AtomicBool,
    metrics: Arc<Metrics>,
    /// `host:port` (or socket path) of the server, or the cluster's start nodes, named in every
    /// log line about it.
    described: Box<str>,
    /// Where the back-off reads the time (the node's one clock).
    clock: Clock,
}

struct LinkState {
    conn: Option<Conn>,
    next_attempt: Instant,
    /// Failed attempts since the last success (the back-off's exponent).
    failures: u32,
}

impl RedisLink {
    /// A link to the config's Redis (`[redis] url` or `[cluster] redis_nodes`); nothing
    /// connects yet. A malformed URL leaves Redis off for good (logged), which degrades
    /// presence but keeps the server up. The back-off is measured on `clock`.
    pub fn new(config: &Config, metrics: Arc<Metrics>, clock: Clock) -> RedisLink {
        let target = match Target::from_config(config) {
            Ok(t) => t,
            Err(e) => {
                tracing::error!(error = %e, "invalid Redis URL; liveness runs without Redis");
                None
            }
        };
        let described = target
            .as_ref()
            .map_or_else(String::new, Target::describe)
            .into_boxed_str();
        RedisLink {
            target,
            described,
            state: tokio::sync::Mutex::new(LinkState {
                conn: None,
                next_attempt: clock.instant(),
                failures: 0,
            }),
            timeout: config.redis.timeout,
            reconnect_max: config.redis.reconnect_max,
            up: AtomicBool::new(false),
            repair: AtomicBool::new(false),
            metrics,
            clock,
        }
    }

    /// The Redis, for connections of their own (pub/sub) and the publish command.
    pub fn target(&self) -> Option<&Target> {
        self.target.as_ref()
    }

    /// Where the link points (`host:port`, the socket path, or the cluster's start nodes).
    pub fn describe(&self) -> &str {
        &self.described
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
    pub async fn conn(&self) -> Option<Conn> {
        let target = self.target.as_ref()?;
        let mut st = self.state.lock().await;
        if let Some(c) = &st.conn {
            return Some(c.clone());
        }
        if self.clock.instant() < st.next_attempt {
            return None;
        }
        match target.connect(self.timeout).await {
            Ok(c) => {
                if !self.up.swap(true, Ordering::Relaxed) {
                    tracing::info!(redis = %self.described, "Redis connected; repairing liveness state");
                }
                self.metrics.redis_up.store(true, Ordering::Relaxed);
                self.repair.store(true, Ordering::Relaxed);
                st.failures = 0;
                st.conn = Some(c.clone());
                Some(c)
            }
            Err(e) => {
                let wait = backoff(st.failures, self.reconnect_max);
                tracing::warn!(redis = %self.described, error = %e, retry_in = ?wait, "Redis unreachable");
                st.next_attempt = self.clock.instant() + wait;
                st.failures = st.failures.saturating_add(1);
                None
            }
        }
    }

    /// A command on the current connection failed: drop it and back off.
    pub async fn failed(&self, error: &(dyn std::fmt::Display + Sync)) {
        self.metrics.redis_errors.fetch_add(1, Ordering::Relaxed);
        self.metrics.redis_up.store(false, Ordering::Relaxed);
        if self.up.swap(false, Ordering::Relaxed) {
            tracing::warn!(redis = %self.described, %error, "Redis command failed; presence degrades until it returns");
        }
        let mut st = self.state.lock().await;
        st.conn = None;
        st.next_attempt = self.clock.instant() + backoff(st.failures, self.reconnect_max);
        st.failures = st.failures.saturating_add(1);
    }

    pub(crate) fn take_repair(&self) -> bool {
        self.repair.swap(false, Ordering::Relaxed)
    }
}

/// Adds the Redis commands of one op to a batch: two write commands each.
pub(crate) fn add_op(pipe: &mut SlotPipe, l: &super::Liveness, op: &Op) {
    match op {
        Op::Refresh { jid, beat_ms } => {
            let bare = jid.to_bare().to_string();
            let (expire, _) = l.expiry_ms(*beat_ms);
            let key = l.keys.resource(jid);
            let mut set = redis::cmd("SET");
            set.arg(&key).arg(&l.node_id).arg("PXAT").arg(expire);
            pipe.add(&key, set);
            let beats = l.keys.beats_for(&bare);
            let mut zadd = redis::cmd("ZADD");
            zadd.arg(&beats)
                .arg("GT")
                .arg(*beat_ms)
                .arg(l.keys.member(&l.node_id, jid));
            pipe.add(&beats, zadd);
        }
        Op::Remove { jid } => {
            let bare = jid.to_bare().to_string();
            let key = l.keys.resource(jid);
            let mut del = redis::cmd("DEL");
            del.arg(&key);
            pipe.add(&key, del);
            let beats = l.keys.beats_for(&bare);
            let mut zrem = redis::cmd("ZREM");
            zrem.arg(&beats).arg(l.keys.member(&l.node_id, jid));
            pipe.add(&beats, zrem);
        }
    }
}

/// When this node last moved each beat ZSET's expiry. The ZSETs are shared by every node
/// and hold every resource of their shard, so their expiry need not follow each beat: a
/// node that writes beats to a shard moves the shard's expiry to now + 3T at most once per
/// T (after the beats, in the same batch), which keeps it at least 2T ahead of every beat
/// this node wrote. A ZSET emptied by a sweep is deleted by Redis; the next beat creates it
/// again, and its expiry comes with this node's next due extension (within T).
#[derive(Debug, Default)]
pub(crate) struct ShardExpiry {
    last: std::collections::HashMap<u32, i64>,
}

impl ShardExpiry {
    /// Adds `PEXPIREAT` for every shard the ops refreshed whose extension is due.
    pub(crate) fn add_due(&mut self, pipe: &mut SlotPipe, l: &super::Liveness, ops: &[Op]) {
        let now = l.clock.now_ms();
        let ttl = l.timings.ttl.as_millis() as i64;
        for op in ops {
            let Op::Refresh { jid, beat_ms } = op else {
                continue;
            };
            let shard = super::keys::shard_of(jid.to_bare().as_str(), l.keys.shards);
            let due = self.last.get(&shard).is_none_or(|&at| now - at >= ttl);
            if due {
                self.last.insert(shard, now);
                let key = l.keys.beats(shard);
                let mut ex = redis::cmd("PEXPIREAT");
                ex.arg(&key).arg(l.expiry_ms(*beat_ms).1);
                pipe.add(&key, ex);
            }
        }
    }

    /// Every shard is due again (after a reconnect: Redis may have lost everything).
    pub(crate) fn reset(&mut self) {
        self.last.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Failed connection attempts so far (the back-off's exponent).
    async fn attempts(link: &RedisLink) -> u32 {
        link.state.lock().await.failures
    }

    /// A Redis that is never there: a Unix socket path that does not exist, so every
    /// attempt fails at once without the network.
    #[tokio::test(start_paused = true)]
    async fn an_unreachable_redis_is_tried_again_only_once_its_back_off_delay_has_passed() {
        let mut config = Config::default();
        config.redis.url = "redis+unix:///nonexistent/presenced-redis-link-test.sock".into();
        let link = RedisLink::new(&config, Arc::new(Metrics::default()), Clock::tokio());
        assert!(link.conn().await.is_none());
        assert_eq!(attempts(&link).await, 1);
        // The first delay is 100 ms jittered down to 50-100 ms; time is measured from the
        // failure, which is now (each advance below is relative to it).
        tokio::time::advance(Duration::from_millis(49)).await;
        assert!(link.conn().await.is_none());
        assert_eq!(
            attempts(&link).await,
            1,
            "no attempt before the shortest delay"
        );
        tokio::time::advance(Duration::from_millis(51)).await;
        assert!(link.conn().await.is_none());
        assert_eq!(
            attempts(&link).await,
            2,
            "tried again after the longest delay"
        );
        // The delay doubles: 100-200 ms after the second failure.
        tokio::time::advance(Duration::from_millis(99)).await;
        assert!(link.conn().await.is_none());
        assert_eq!(
            attempts(&link).await,
            2,
            "no attempt before the doubled delay"
        );
        tokio::time::advance(Duration::from_millis(101)).await;
        assert!(link.conn().await.is_none());
        assert_eq!(attempts(&link).await, 3);
        assert!(!link.is_up());
    }
}
