//! The token bucket behind every per-stream stanza rate limit (`[limits]` for clients,
//! `[s2s]` for servers): `rate` stanzas per second on average, `burst` at once. A stream
//! that runs dry is closed with the policy-violation stream error by its owner.
//!
//! A client's rule is [`ClientRate`], used for its stanzas (the c2s session) and, over
//! WebSocket, for its control frames (the RFC 7395 adapter), so both are bounded by the
//! same numbers and end the same way.

use tokio::time::Instant;

use crate::config::LimitsConfig;
use crate::error::{StreamCondition, StreamError};
use crate::metrics::{DropReason, Metrics};

/// What a client may send per second: `[limits] stanzas_per_second` on average and
/// `stanza_burst` at once. Each stanza takes a token, and over WebSocket each Ping or Pong
/// frame too (from a bucket of its own, so neither uses up the other's allowance): a Ping
/// costs the server a Pong, and a frame costs a read like a small stanza.
#[derive(Debug)]
pub struct ClientRate(TokenBucket);

impl ClientRate {
    /// A full bucket with the client limits in force now.
    pub fn new(limits: &LimitsConfig) -> Self {
        ClientRate(TokenBucket::new(
            limits.stanzas_per_second,
            limits.stanza_burst,
        ))
    }

    /// Counts one stanza or control frame. Beyond the rate, the stream error that closes
    /// the stream: policy-violation (RFC 6120 §4.9.3.18, "a local service policy"); the
    /// drop is counted in the metrics.
    pub fn take(&mut self, metrics: &Metrics) -> Result<(), StreamError> {
        if self.0.take() {
            return Ok(());
        }
        metrics.dropped(DropReason::StanzaRate);
        Err(StreamError::new(
            StreamCondition::PolicyViolation,
            "too many stanzas per second",
        ))
    }
}

/// Tokens refill continuously at `rate` per second up to `burst`; each stanza takes one.
#[derive(Debug)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket. A burst of 0 is treated as 1 so a stream can always send something.
    pub fn new(rate: u32, burst: u32) -> Self {
        let burst = burst.max(1) as f64;
        TokenBucket {
            rate: rate as f64,
            burst,
            tokens: burst,
            last: Instant::now(),
        }
    }

    /// Takes one token; false when the stream is over its rate.
    pub fn take(&mut self) -> bool {
        let now = Instant::now();
        let dt = now.duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + dt * self.rate).min(self.burst);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn burst_is_spent_then_refills_at_the_rate() {
        let mut b = TokenBucket::new(10, 3);
        assert!(b.take() && b.take() && b.take());
        assert!(!b.take(), "burst of 3 spent");
        tokio::time::advance(Duration::from_millis(100)).await;
        assert!(b.take(), "one token after 1/rate seconds");
        assert!(!b.take());
    }
}
