//! Liveness counters: what the design promises (writes proportional to changes, not beats)
//! made visible, in the logs and at /metrics (through the node's registry, `metrics`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use prometheus_client::encoding::DescriptorEncoder;

/// Monotonic counters (and one gauge) of one node.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Resource writes that reached Redis (refreshes and removals; one per resource).
    pub redis_writes: AtomicU64,
    /// Resource writes applied by the backend, Redis or in process (so the downsampling
    /// is visible, and testable, in both modes).
    pub liveness_writes: AtomicU64,
    /// Liveness runs without Redis ([`super::Backend::InProcess`]): the Redis gauge is
    /// then not exported, since "down" would be a false alarm.
    pub in_process: AtomicBool,
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
    /// Stale resources the sweeper handed to the node holding them, which heard them.
    pub handed_off: AtomicU64,
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

pub(crate) fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

impl Metrics {
    /// Adds these counters to a scrape of the node's registry (`metrics`).
    pub fn encode(&self, e: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (name, help, c) in [
            (
                "redis_writes",
                "Resource liveness writes to Redis.",
                &self.redis_writes,
            ),
            (
                "liveness_writes",
                "Resource liveness writes applied (Redis or in process).",
                &self.liveness_writes,
            ),
            (
                "redis_errors",
                "Failed or dropped Redis operations.",
                &self.redis_errors,
            ),
            (
                "pg_last_seen_writes",
                "Last-seen statements sent to PostgreSQL.",
                &self.pg_writes,
            ),
            (
                "pg_last_seen_rows",
                "Last-seen rows written to PostgreSQL.",
                &self.pg_rows,
            ),
            (
                "pg_last_seen_errors",
                "Failed last-seen flushes.",
                &self.pg_errors,
            ),
            (
                "heartbeats",
                "Inbound traffic events counted as heartbeats.",
                &self.heartbeats,
            ),
            (
                "pings_sent",
                "Keepalive pings sent to clients.",
                &self.pings_sent,
            ),
            ("sweeps", "Sweeper runs.", &self.sweeps),
            (
                "swept_resources",
                "Resources taken by the sweeper.",
                &self.swept,
            ),
            (
                "handed_off_resources",
                "Stale resources handed to the node holding them.",
                &self.handed_off,
            ),
            (
                "silent_deaths",
                "Sessions ended for silence.",
                &self.silent_deaths,
            ),
            (
                "grace_started",
                "Grace periods started.",
                &self.grace_started,
            ),
            (
                "grace_resumed",
                "Resources re-bound within their grace period.",
                &self.grace_resumed,
            ),
        ] {
            crate::metrics::counter(e, name, help, get(c))?;
        }
        if self.in_process.load(Ordering::Relaxed) {
            return Ok(());
        }
        crate::metrics::gauge(
            e,
            "redis_up",
            "Whether the last Redis command succeeded.",
            i64::from(self.redis_up.load(Ordering::Relaxed)),
        )
    }
}
