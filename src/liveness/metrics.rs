//! Liveness counters: what the design promises (writes proportional to changes, not beats)
//! made visible, in the logs and at /metrics (Prometheus text format 0.0.4).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crate::server::Shared;

/// Monotonic counters (and one gauge) of one node.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Resource writes that reached Redis (refreshes and removals; one per resource).
    pub redis_writes: AtomicU64,
    /// Redis commands or queued writes that failed or were dropped.
    pub redis_errors: AtomicU64,
    /// Whether the last Redis command succeeded.
    pub redis_up: AtomicBool,
    /// Last-seen statements sent to PostgreSQL (one per flush).
    pub pg_writes: AtomicU64,
    /// Last-seen rows those statements carried.
    pub pg_rows: AtomicU64,
    /// Failed last-seen flushes.
    pub pg_errors: AtomicU64,
    /// Inbound traffic events counted as heartbeats.
    pub heartbeats: AtomicU64,
    /// Keepalive pings sent (XEP-0199 and WebSocket Ping).
    pub pings_sent: AtomicU64,
    /// Sweeper runs.
    pub sweeps: AtomicU64,
    /// Resources the sweeper took.
    pub swept: AtomicU64,
    /// Sessions ended as silent deaths.
    pub silent_deaths: AtomicU64,
    /// Grace periods started (clean close or dropped connection).
    pub grace_started: AtomicU64,
    /// Resources re-bound while their grace period ran.
    pub grace_resumed: AtomicU64,
    /// Ticks of the last-seen batcher, written or not. Not exported: it lets tests wait for
    /// real flushes instead of sleeping for a guess of how long they take.
    pub flush_rounds: AtomicU64,
}

fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

impl Metrics {
    /// Prometheus text exposition; `sessions` is the current number of bound sessions.
    pub fn render(&self, sessions: usize) -> String {
        let mut out = String::new();
        let mut counter = |name: &str, help: &str, v: u64| {
            let _ = write!(
                out,
                "# HELP presenced_{name} {help}\n# TYPE presenced_{name} counter\npresenced_{name} {v}\n"
            );
        };
        counter(
            "redis_writes_total",
            "Resource liveness writes to Redis.",
            get(&self.redis_writes),
        );
        counter(
            "redis_errors_total",
            "Failed or dropped Redis operations.",
            get(&self.redis_errors),
        );
        counter(
            "pg_last_seen_writes_total",
            "Last-seen statements sent to PostgreSQL.",
            get(&self.pg_writes),
        );
        counter(
            "pg_last_seen_rows_total",
            "Last-seen rows written to PostgreSQL.",
            get(&self.pg_rows),
        );
        counter(
            "pg_last_seen_errors_total",
            "Failed last-seen flushes.",
            get(&self.pg_errors),
        );
        counter(
            "heartbeats_total",
            "Inbound traffic events counted as heartbeats.",
            get(&self.heartbeats),
        );
        counter(
            "pings_sent_total",
            "Keepalive pings sent to clients.",
            get(&self.pings_sent),
        );
        counter("sweeps_total", "Sweeper runs.", get(&self.sweeps));
        counter(
            "swept_resources_total",
            "Resources taken by the sweeper.",
            get(&self.swept),
        );
        counter(
            "silent_deaths_total",
            "Sessions ended for silence.",
            get(&self.silent_deaths),
        );
        counter(
            "grace_started_total",
            "Grace periods started.",
            get(&self.grace_started),
        );
        counter(
            "grace_resumed_total",
            "Resources re-bound within their grace period.",
            get(&self.grace_resumed),
        );
        let up = u8::from(self.redis_up.load(Ordering::Relaxed));
        let _ = write!(
            out,
            "# HELP presenced_redis_up Whether the last Redis command succeeded.\n# TYPE presenced_redis_up gauge\npresenced_redis_up {up}\n\
             # HELP presenced_sessions Bound client sessions on this node.\n# TYPE presenced_sessions gauge\npresenced_sessions {sessions}\n"
        );
        out
    }
}

/// Logs the counters every `metrics_log_interval` (0 = never).
pub async fn log_loop(shared: Arc<Shared>) {
    let every = shared.config.liveness.metrics_log_interval;
    if every.is_zero() {
        return;
    }
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shared.shutdown.cancelled() => return,
        }
        let m = &shared.liveness.metrics;
        tracing::info!(
            redis_writes = get(&m.redis_writes),
            redis_errors = get(&m.redis_errors),
            pg_writes = get(&m.pg_writes),
            pg_rows = get(&m.pg_rows),
            heartbeats = get(&m.heartbeats),
            pings_sent = get(&m.pings_sent),
            sweeps = get(&m.sweeps),
            swept = get(&m.swept),
            sessions = shared.sessions.count(),
            "liveness counters"
        );
    }
}
