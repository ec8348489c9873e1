//! Back-off on failed SASL attempts, per source address and account.
//!
//! The per-stream retry limit (RFC 6120 §6.4.5) alone lets one client guess a password
//! as fast as it can reconnect. This table counts failed password checks per pair of
//! source (an IPv4 address or an IPv6 /64, [`crate::policy::rate_limit::source_of`]) and account
//! (the normalised bare JID that was tried, whether or not it exists, so the answer does
//! not tell which accounts exist). Once `failures` of them fall within `window` of each
//! other, the pair is locked for `base`, doubling with each further failure up to `max`;
//! while locked, attempts from that source are refused without running the password
//! check.
//!
//! The lock is the pair's, not the account's: a guesser that keeps an account locked
//! from its own address cannot lock the owner out, whose address has not failed. (Keyed
//! by account alone, 13 wrong passwords timed to each lock's end kept the owner out.) A
//! guesser with many addresses gets `failures` tries per address per lock; the per-address
//! connection budget (`[limits] connections_per_ip_per_minute`) bounds that further.
//! The table is per node and holds at most `max_entries` pairs, each under a keyed 64-bit
//! hash rather than the JID (up to 3 KB), so the bound is a few MB.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Thresholds and delays, from `[limits]`.
#[derive(Debug, Clone, Copy)]
pub struct BackoffPolicy {
    /// Failures within `window` that start the lock.
    pub failures: u32,
    /// How long a failure is remembered after the previous one.
    pub window: Duration,
    /// First lock; each further failure doubles it.
    pub base: Duration,
    /// Longest lock.
    pub max: Duration,
    /// Accounts tracked at once.
    pub max_entries: usize,
}

impl BackoffPolicy {
    /// The policy configured in `[limits]`.
    pub fn from_config(l: &crate::config::LimitsConfig) -> Self {
        BackoffPolicy {
            failures: l.auth_backoff_failures,
            window: Duration::from_millis(l.auth_backoff_window_ms),
            base: Duration::from_millis(l.auth_backoff_base_ms),
            max: Duration::from_millis(l.auth_backoff_max_ms),
            max_entries: l.auth_backoff_max_entries,
        }
    }

    /// The lock after `failures` failures within the window (none below the threshold).
    pub fn lock_for(&self, failures: u32) -> Option<Duration> {
        let over = failures.checked_sub(self.failures)?;
        let factor = 1u32.checked_shl(over.min(31)).unwrap_or(u32::MAX);
        Some(self.base.saturating_mul(factor).min(self.max))
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    failures: u32,
    last_failure: Instant,
    locked_until: Option<Instant>,
}

impl Entry {
    /// Whether the entry no longer affects anything and may be dropped.
    fn expired(&self, policy: &BackoffPolicy, now: Instant) -> bool {
        now.saturating_duration_since(self.last_failure) > policy.window
            && self.locked_until.is_none_or(|t| t <= now)
    }
}

/// The failure table; one per node, shared by every c2s stream.
#[derive(Debug)]
pub struct AuthBackoff {
    policy: BackoffPolicy,
    /// Random per process, so nobody can pick names that collide on purpose.
    hasher: RandomState,
    entries: Mutex<HashMap<u64, Entry>>,
}

impl AuthBackoff {
    pub fn new(policy: BackoffPolicy) -> Self {
        AuthBackoff {
            policy,
            hasher: RandomState::new(),
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// The thresholds and delays this table applies.
    pub fn policy(&self) -> &BackoffPolicy {
        &self.policy
    }

    fn key(&self, source: IpAddr, account: &str) -> u64 {
        self.hasher
            .hash_one((crate::policy::rate_limit::source_of(source), account))
    }

    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `account` is locked for `source` at `now`: if so the attempt must be refused
    /// without checking the password, and the remaining time is returned (for the log).
    pub fn locked(&self, source: IpAddr, account: &str, now: Instant) -> Option<Duration> {
        let until = self.table().get(&self.key(source, account))?.locked_until?;
        (until > now).then(|| until - now)
    }

    /// Records a failed password check for `account` from `source` at `now`; returns the
    /// lock it started, if any.
    pub fn failed(&self, source: IpAddr, account: &str, now: Instant) -> Option<Duration> {
        let policy = self.policy;
        let key = self.key(source, account);
        let mut table = self.table();
        if !table.contains_key(&key) && table.len() >= policy.max_entries {
            table.retain(|_, e| !e.expired(&policy, now));
            if table.len() >= policy.max_entries {
                // Still full of live entries (a spray of distinct names): forget an
                // eighth at once, unlocked ones and those idle longest first, so memory
                // stays bounded and the scan is paid once per many insertions.
                let mut ages: Vec<(bool, Instant, u64)> = table
                    .iter()
                    .map(|(k, e)| (e.locked_until.is_some_and(|t| t > now), e.last_failure, *k))
                    .collect();
                let drop = (policy.max_entries / 8).max(1).min(ages.len());
                ages.select_nth_unstable(drop - 1);
                for (_, _, k) in &ages[..drop] {
                    table.remove(k);
                }
            }
        }
        let entry = table.entry(key).or_insert(Entry {
            failures: 0,
            last_failure: now,
            locked_until: None,
        });
        if now.saturating_duration_since(entry.last_failure) > policy.window {
            entry.failures = 0;
        }
        entry.failures = entry.failures.saturating_add(1);
        entry.last_failure = now;
        let lock = policy.lock_for(entry.failures);
        if let Some(d) = lock {
            entry.locked_until = Some(now + d);
        }
        lock
    }

    /// A successful login forgets the failures of the account from that source.
    pub fn succeeded(&self, source: IpAddr, account: &str) {
        let key = self.key(source, account);
        self.table().remove(&key);
    }

    /// Accounts tracked now.
    pub fn len(&self) -> usize {
        self.table().len()
    }

    /// Whether no account is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(192, 0, 2, 1));

    fn policy() -> BackoffPolicy {
        BackoffPolicy {
            failures: 3,
            window: Duration::from_secs(60),
            base: Duration::from_secs(1),
            max: Duration::from_secs(5),
            max_entries: 4,
        }
    }

    #[test]
    fn locks_after_the_threshold_and_doubles_up_to_the_maximum() {
        let b = AuthBackoff::new(policy());
        let t0 = Instant::now();
        assert_eq!(b.failed(A, "a@x", t0), None);
        assert_eq!(b.failed(A, "a@x", t0), None);
        assert_eq!(b.locked(A, "a@x", t0), None);
        assert_eq!(b.failed(A, "a@x", t0), Some(Duration::from_secs(1)));
        assert_eq!(b.locked(A, "a@x", t0), Some(Duration::from_secs(1)));
        assert_eq!(
            b.locked(A, "b@x", t0),
            None,
            "other accounts are not affected"
        );
        let t1 = t0 + Duration::from_millis(1001);
        assert_eq!(b.locked(A, "a@x", t1), None, "the lock ends");
        assert_eq!(b.failed(A, "a@x", t1), Some(Duration::from_secs(2)));
        assert_eq!(b.failed(A, "a@x", t1), Some(Duration::from_secs(4)));
        assert_eq!(
            b.failed(A, "a@x", t1),
            Some(Duration::from_secs(5)),
            "bounded"
        );
        for _ in 0..40 {
            b.failed(A, "a@x", t1);
        }
        assert_eq!(b.locked(A, "a@x", t1), Some(Duration::from_secs(5)));
    }

    #[test]
    fn failures_further_apart_than_the_window_do_not_add_up() {
        let b = AuthBackoff::new(policy());
        let mut t = Instant::now();
        for _ in 0..10 {
            assert_eq!(b.failed(A, "a@x", t), None);
            t += Duration::from_secs(61);
        }
        // Within the window they do.
        b.failed(A, "a@x", t);
        b.failed(A, "a@x", t + Duration::from_secs(59));
        assert_eq!(
            b.failed(A, "a@x", t + Duration::from_secs(118)),
            Some(Duration::from_secs(1))
        );
    }

    #[test]
    fn success_forgets_the_failures() {
        let b = AuthBackoff::new(policy());
        let t = Instant::now();
        b.failed(A, "a@x", t);
        b.failed(A, "a@x", t);
        b.succeeded(A, "a@x");
        assert_eq!(b.failed(A, "a@x", t), None);
        assert_eq!(b.failed(A, "a@x", t), None);
        assert!(b.failed(A, "a@x", t).is_some());
    }

    #[test]
    fn memory_is_bounded_expired_entries_go_first_then_the_oldest() {
        let b = AuthBackoff::new(policy());
        let t0 = Instant::now();
        // A locked account, then three that expire.
        for _ in 0..3 {
            b.failed(A, "locked@x", t0 + Duration::from_secs(100));
        }
        for i in 0..3 {
            b.failed(A, &format!("old{i}@x"), t0);
        }
        assert_eq!(b.len(), 4);
        let t1 = t0 + Duration::from_secs(100);
        b.failed(A, "new@x", t1);
        assert_eq!(b.len(), 2, "expired entries dropped");
        assert!(b.locked(A, "locked@x", t1).is_some(), "live lock kept");
        for i in 0..10 {
            b.failed(A, &format!("spray{i}@x"), t1 + Duration::from_millis(i));
            assert!(b.len() <= 4);
        }
        assert!(
            b.locked(A, "locked@x", t1).is_some(),
            "locked accounts are the last to go"
        );
    }

    #[test]
    fn a_lock_is_the_failing_sources_and_an_ipv6_source_is_its_slash_64() {
        let b = AuthBackoff::new(policy());
        let t = Instant::now();
        let owner: IpAddr = "198.51.100.7".parse().unwrap();
        for _ in 0..3 {
            b.failed(A, "a@x", t);
        }
        assert!(b.locked(A, "a@x", t).is_some());
        assert_eq!(
            b.locked(owner, "a@x", t),
            None,
            "the owner's address has not failed"
        );
        // The owner's success forgets only the owner's own failures.
        b.succeeded(owner, "a@x");
        assert!(b.locked(A, "a@x", t).is_some());
        // Addresses of one /64 are one source.
        let (v6a, v6b): (IpAddr, IpAddr) = (
            "2001:db8::1".parse().unwrap(),
            "2001:db8::2:3".parse().unwrap(),
        );
        for _ in 0..3 {
            b.failed(v6a, "c@x", t);
        }
        assert!(b.locked(v6b, "c@x", t).is_some());
    }
}
