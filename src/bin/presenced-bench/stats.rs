//! Lock-free latency histograms and counters shared by all session tasks.
//!
//! Log-linear buckets (64 per power of two, about 1.6 % relative error) over microseconds:
//! recording is one atomic add, so thousands of session tasks can record without a lock,
//! and percentiles come out of the bucket counts at the end.

use std::sync::atomic::{AtomicU64, Ordering};

const SUB: u64 = 64;
const LINEAR: u64 = 2 * SUB;
const BUCKETS: usize = (LINEAR + (64 - 7) * SUB) as usize;

fn bucket_of(v: u64) -> usize {
    if v < LINEAR {
        return v as usize;
    }
    let e = 63 - u64::from(v.leading_zeros());
    let shift = e - 6;
    (LINEAR + (e - 7) * SUB + ((v >> shift) - SUB)) as usize
}

/// Smallest value that lands in bucket `i`.
fn lower_bound(i: usize) -> u64 {
    let i = i as u64;
    if i < LINEAR {
        return i;
    }
    let e = (i - LINEAR) / SUB + 7;
    let m = (i - LINEAR) % SUB + SUB;
    m << (e - 6)
}

/// A concurrent histogram of microsecond values.
pub struct Histogram {
    buckets: Vec<AtomicU64>,
    count: AtomicU64,
    max: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            max: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    /// Records one value.
    pub fn record(&self, micros: u64) {
        self.buckets[bucket_of(micros)].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        self.max.fetch_max(micros, Ordering::Relaxed);
    }

    /// Number of recorded values.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Largest recorded value (exact).
    pub fn max(&self) -> u64 {
        self.max.load(Ordering::Relaxed)
    }

    /// The value at quantile `q` (0..=1), as the lower bound of its bucket; None if empty.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        let total = self.count();
        if total == 0 {
            return None;
        }
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        for (i, b) in self.buckets.iter().enumerate() {
            seen += b.load(Ordering::Relaxed);
            if seen >= rank {
                return Some(lower_bound(i).min(self.max()));
            }
        }
        Some(self.max())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_value_falls_in_a_bucket_whose_bounds_contain_it_within_two_percent() {
        for v in (0..5000u64).chain((1..40).map(|s| (1u64 << s) + 12345 % (1 << s))) {
            let b = bucket_of(v);
            let lo = lower_bound(b);
            assert!(lo <= v, "v={v} lo={lo}");
            assert!(v - lo <= v / 50 + 1, "v={v} lo={lo}");
            assert!(b + 1 >= BUCKETS || lower_bound(b + 1) > v, "v={v}");
        }
        assert!(bucket_of(u64::MAX) < BUCKETS);
    }

    #[test]
    fn quantiles_of_one_to_a_thousand_are_close_to_the_exact_ranks() {
        let h = Histogram::default();
        for v in 1..=1000 {
            h.record(v);
        }
        let p50 = h.quantile(0.5).expect("non-empty");
        let p99 = h.quantile(0.99).expect("non-empty");
        assert!((490..=500).contains(&p50), "p50={p50}");
        assert!((975..=990).contains(&p99), "p99={p99}");
        assert_eq!(h.max(), 1000);
        assert_eq!(Histogram::default().quantile(0.5), None);
    }
}
