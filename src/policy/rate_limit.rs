//! The token bucket behind every per-stream stanza rate limit (`[limits]` for clients,
//! `[s2s]` for servers): `rate` stanzas per second on average, `burst` at once. A stream
//! that runs dry is closed with the policy-violation stream error by its owner.
//!
//! [`SourceBudget`]: the same buckets kept per source address and one for the whole node,
//! for what must be rationed across connections (XEP-0077 registrations). A source is an
//! IPv4 address or an IPv6 /64 ([`source_of`]), since one IPv6 host commonly holds a
//! whole /64.
//!
//! A client's rule is [`ClientRate`], used for its stanzas (the c2s session) and, over
//! WebSocket, for its control frames (the RFC 7395 adapter), so both are bounded by the
//! same numbers and end the same way.
//!
//! Pure decisions: every call takes the time `now` from its caller, which reads the node's
//! clock ([`crate::clock::Clock::instant`]), so a test on paused time controls refills.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::Mutex;

use std::time::Instant;

use crate::config::LimitsConfig;
use crate::metrics::{DropReason, Metrics};
use crate::protocol::error::{StreamCondition, StreamError};

/// What a client may send per second: `[limits] stanzas_per_second` on average and
/// `stanza_burst` at once. Each stanza takes a token, and over WebSocket each Ping or Pong
/// frame too (from a bucket of its own, so neither uses up the other's allowance): a Ping
/// costs the server a Pong, and a frame costs a read like a small stanza.
#[derive(Debug)]
pub(crate) struct ClientRate(TokenBucket);

impl ClientRate {
    /// A full bucket with the client limits in force now.
    pub(crate) fn new(limits: &LimitsConfig) -> Self {
        ClientRate(TokenBucket::new(
            limits.stanzas_per_second,
            limits.stanza_burst,
        ))
    }

    /// Counts one stanza or control frame at `now`. Beyond the rate, the stream error that
    /// closes the stream: policy-violation (RFC 6120 §4.9.3.18, "a local service policy");
    /// the drop is counted in the metrics.
    pub(crate) fn take(&mut self, metrics: &Metrics, now: Instant) -> Result<(), StreamError> {
        if self.0.take(now) {
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
pub(crate) struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    /// When tokens were last counted; `None` while the bucket is as full as when made
    /// (a full bucket stays full however long it waits, so its age does not matter).
    last: Option<Instant>,
}

impl TokenBucket {
    /// A full bucket. A burst of 0 is treated as 1 so a stream can always send something.
    pub(crate) fn new(rate: u32, burst: u32) -> Self {
        let burst = burst.max(1) as f64;
        TokenBucket {
            rate: rate as f64,
            burst,
            tokens: burst,
            last: None,
        }
    }

    /// A full bucket refilling at `per_hour` tokens an hour, holding as many.
    pub(crate) fn per_hour(per_hour: u32) -> Self {
        let mut b = TokenBucket::new(0, per_hour);
        b.rate = per_hour as f64 / 3600.0;
        b
    }

    /// A full bucket of `burst` tokens refilling at `per_minute` a minute.
    pub(crate) fn per_minute(per_minute: u32, burst: u32) -> Self {
        let mut b = TokenBucket::new(0, burst);
        b.rate = per_minute as f64 / 60.0;
        b
    }

    /// Whether the bucket would be full at `now`: it then equals a fresh one and can be
    /// forgotten.
    pub(crate) fn is_full_at(&self, now: Instant) -> bool {
        let dt = self.last.map_or(0.0, |last| {
            now.saturating_duration_since(last).as_secs_f64()
        });
        self.tokens + dt * self.rate >= self.burst
    }

    /// Takes one token at `now`; false when the stream is over its rate.
    pub(crate) fn take(&mut self, now: Instant) -> bool {
        self.refill(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    fn refill(&mut self, now: Instant) {
        let dt = self.last.map_or(0.0, |last| {
            now.saturating_duration_since(last).as_secs_f64()
        });
        self.last = Some(now);
        self.tokens = (self.tokens + dt * self.rate).min(self.burst);
    }
}

/// The source a budget is kept for: an IPv4 address (an IPv4-mapped IPv6 address counts as
/// its IPv4 address), or the /64 of an IPv6 address.
pub(crate) fn source_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

/// Sources a [`SourceBudget`] tracks at once; past it, sources whose bucket has refilled
/// (which a fresh bucket would equal) are forgotten.
const MAX_SOURCES: usize = 100_000;

/// One hourly budget per source ([`source_of`]) and one for all sources together.
pub struct SourceBudget {
    per_source: u32,
    inner: Mutex<(HashMap<IpAddr, TokenBucket>, TokenBucket)>,
}

impl SourceBudget {
    /// `per_source` an hour from one source, `total` an hour from all.
    pub fn per_hour(per_source: u32, total: u32) -> Self {
        SourceBudget {
            per_source,
            inner: Mutex::new((HashMap::new(), TokenBucket::per_hour(total))),
        }
    }

    /// Takes one from `ip`'s source and one from the total at `now`, or neither: false
    /// when either is spent.
    pub fn take(&self, ip: IpAddr, now: Instant) -> bool {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (sources, total) = &mut *g;
        if sources.len() >= MAX_SOURCES {
            sources.retain(|_, b| {
                b.refill(now);
                b.tokens < b.burst
            });
        }
        let per_source = self.per_source;
        let source = sources
            .entry(source_of(ip))
            .or_insert_with(|| TokenBucket::per_hour(per_source));
        source.refill(now);
        total.refill(now);
        if source.tokens < 1.0 || total.tokens < 1.0 {
            return false;
        }
        source.tokens -= 1.0;
        total.tokens -= 1.0;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn burst_is_spent_then_refills_at_the_rate() {
        let t = Instant::now();
        let mut b = TokenBucket::new(10, 3);
        assert!(b.take(t) && b.take(t) && b.take(t));
        assert!(!b.take(t), "burst of 3 spent");
        assert!(!b.take(t + ms(99)), "no whole token before 1/rate seconds");
        assert!(b.take(t + ms(100)), "one token after 1/rate seconds");
        assert!(!b.take(t + ms(100)));
    }

    #[test]
    fn a_full_bucket_holds_its_burst_however_long_it_waited_before_its_first_take() {
        let t = Instant::now();
        let mut b = TokenBucket::new(10, 2);
        let later = t + Duration::from_secs(3600);
        assert!(b.take(later) && b.take(later));
        assert!(
            !b.take(later),
            "an hour idle is still a burst of 2, not more"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_rate_read_on_the_nodes_clock_refills_when_paused_time_advances() {
        let clock = crate::clock::Clock::tokio();
        let metrics = Metrics::new();
        let limits = LimitsConfig {
            stanzas_per_second: 4,
            stanza_burst: 1,
            ..LimitsConfig::default()
        };
        let mut rate = ClientRate::new(&limits);
        assert!(rate.take(&metrics, clock.instant()).is_ok());
        assert!(rate.take(&metrics, clock.instant()).is_err(), "burst spent");
        tokio::time::advance(ms(249)).await;
        assert!(
            rate.take(&metrics, clock.instant()).is_err(),
            "249 ms < 1/rate"
        );
        tokio::time::advance(ms(1)).await;
        assert!(
            rate.take(&metrics, clock.instant()).is_ok(),
            "refilled at 1/rate"
        );
    }

    #[test]
    fn an_ipv6_source_is_its_slash_64_and_a_mapped_ipv4_its_ipv4() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff:1:2:3".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(source_of(a), source_of(b));
        assert_ne!(source_of(a), source_of(c));
        let mapped: IpAddr = "::ffff:192.0.2.7".parse().unwrap();
        assert_eq!(source_of(mapped), "192.0.2.7".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn a_source_budget_refuses_past_either_share_and_refills_over_the_hour() {
        let t = Instant::now();
        let budget = SourceBudget::per_hour(2, 3);
        let (one, two): (IpAddr, IpAddr) =
            ("192.0.2.1".parse().unwrap(), "2001:db8::1".parse().unwrap());
        let same_64: IpAddr = "2001:db8::ffff".parse().unwrap();
        assert!(budget.take(one, t) && budget.take(one, t));
        assert!(!budget.take(one, t), "the source's share is spent");
        assert!(budget.take(two, t));
        assert!(!budget.take(same_64, t), "the node's total is spent");
        // A refused take costs nothing: the other /64 still has its second token once
        // the total refills (one token of the total per 20 minutes).
        let later = t + Duration::from_secs(1200);
        assert!(budget.take(same_64, later));
        assert!(
            !budget.take(one, later),
            "the total's one new token went to the /64"
        );
    }
}
