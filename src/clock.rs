//! The one source of time for the node: liveness, the cluster directory, the session
//! registry and the SASL back-off read it.
//!
//! Two kinds of time are involved. Timers (ping ticks, the refresh tick, the grace period,
//! the sweeper's period) use `tokio::time`, which tests can pause and advance. Beat times,
//! Redis expiry scores, directory stamps, last-seen stamps and the time a session bound
//! are wall-clock milliseconds, because they are compared across nodes and with Redis;
//! they are read from a [`Clock`] so that a test can make wall time follow tokio's paused
//! clock and check the grace, TTL and sweep decisions without waiting for them. The SASL
//! back-off's table measures its windows and locks on [`Clock::instant`], which follows
//! tokio's clock in the same way.

use chrono::{DateTime, Utc};

/// Where liveness reads wall-clock time (ms since the Unix epoch).
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
