//! The one source of time for the node's decisions that depend on time. One [`Clock`] is
//! made per node (`Liveness::clock`, the system's in production) and handed to every reader:
//!
//! - wall-clock milliseconds ([`Clock::now_ms`], [`Clock::now`]): liveness beats, Redis
//!   expiry scores, sweep cutoffs and last-seen stamps (`crate::liveness`,
//!   `crate::services::lifecycle`), the cluster directory's heartbeat and entry stamps
//!   (`crate::cluster`), the time a session bound (`crate::node::sessions`), and the
//!   period whose key seals and opens TLS session tickets (`crate::transport::tls::tickets`,
//!   via `app::server`). These are compared across nodes and with Redis, so they are wall
//!   time;
//! - monotonic instants ([`Clock::instant`]), for durations measured on this node: the
//!   SASL back-off's windows and locks (`crate::policy::auth_backoff`, from its caller), the
//!   stanza and registration token buckets (`crate::policy::rate_limit`, from their
//!   callers), the age of an outstanding entity-capabilities query (`crate::node::caps`),
//!   the age of a cached privacy-gate input (`crate::store::audience_cache`, via
//!   `Store::set_clock`) and the Redis link's reconnect back-off
//!   (`crate::liveness::redis_link`).
//!
//! A [`Clock::tokio`] makes both kinds follow tokio's clock, so a test on paused time checks
//! the grace, TTL, sweep, back-off, refill and expiry decisions without waiting for them.
//!
//! Timers are the other kind of time: ping ticks, the refresh tick, the grace period, the
//! sweeper's period, and the deadlines that only bound a wait (stream negotiation and
//! WebSocket close deadlines, the delivery pacing wait in `crate::node::sessions`, the CSI
//! and interest-list expiry in `crate::services`, the SQLite busy retry, the notification
//! listener's prune period in `crate::store::notify`). They use `tokio::time` directly,
//! which already follows a paused test clock. The admin socket's uptime and
//! `Store::ping`'s timing measure real elapsed time for an operator and read the system's
//! monotonic clock. The per-address connection rate (`crate::transport::listener`) and the
//! cluster's avatar-hash copies (`crate::cluster::cache`) also read it directly.

use chrono::{DateTime, Utc};

/// The node's clock: wall-clock time (ms since the Unix epoch) and monotonic instants.
#[derive(Debug, Clone, Copy)]
pub struct Clock(Source);

#[derive(Debug, Clone, Copy)]
enum Source {
    /// The system clock: what every node uses, since beats written by one node are judged
    /// by another (keep node clocks synced; skew shifts detection by the same amount).
    System,
    /// The wall time at `start` plus tokio time elapsed since: moves only when tokio's
    /// clock does, so a paused test runtime controls it with `tokio::time::advance`.
    Tokio {
        epoch_ms: i64,
        start: tokio::time::Instant,
    },
}

impl Clock {
    /// The system clock.
    pub fn system() -> Clock {
        Clock(Source::System)
    }

    /// A clock that starts at the current system time and then follows tokio's clock (for
    /// tests on paused time). Must be created inside a runtime.
    pub fn tokio() -> Clock {
        Clock(Source::Tokio {
            epoch_ms: Utc::now().timestamp_millis(),
            start: tokio::time::Instant::now(),
        })
    }

    /// Milliseconds since the Unix epoch: the unit of beat scores, Redis expiry times and
    /// last-seen times.
    pub fn now_ms(&self) -> i64 {
        match self.0 {
            Source::System => Utc::now().timestamp_millis(),
            Source::Tokio { epoch_ms, start } => {
                epoch_ms + start.elapsed().as_millis().min(i64::MAX as u128) as i64
            }
        }
    }

    /// A monotonic instant, for durations measured on this node: the system's, or tokio's
    /// (paused in tests) for a clock that follows it.
    pub fn instant(&self) -> std::time::Instant {
        match self.0 {
            Source::System => std::time::Instant::now(),
            Source::Tokio { .. } => tokio::time::Instant::now().into_std(),
        }
    }

    /// The current time as a timestamp.
    pub fn now(&self) -> DateTime<Utc> {
        match self.0 {
            Source::System => Utc::now(),
            Source::Tokio { .. } => to_datetime(self.now_ms()),
        }
    }
}

impl Default for Clock {
    fn default() -> Self {
        Clock::system()
    }
}

/// A millisecond time as a timestamp (the epoch for a value out of range, which no clock
/// here produces).
pub fn to_datetime(ms: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(ms).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_tokio_clock_moves_with_paused_time_only() {
        let clock = Clock::tokio();
        let t0 = clock.now_ms();
        assert!((t0 - Utc::now().timestamp_millis()).abs() < 1000);
        assert_eq!(clock.now_ms(), t0, "paused: no time passes by itself");
        tokio::time::advance(Duration::from_millis(2500)).await;
        assert_eq!(clock.now_ms(), t0 + 2500);
        assert_eq!(clock.now().timestamp_millis(), t0 + 2500);
        let i0 = clock.instant();
        tokio::time::advance(Duration::from_secs(90)).await;
        assert_eq!(clock.instant() - i0, Duration::from_secs(90));
    }

    #[test]
    fn the_system_clock_is_the_wall_clock() {
        let c = Clock::system();
        assert!((c.now_ms() - Utc::now().timestamp_millis()).abs() < 1000);
    }
}
