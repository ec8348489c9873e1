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

impl std::fmt::Debug for Histogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Histogram(count={}, max={})", self.count(), self.max())
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

    /// Adds every value recorded in `other` (histograms of several generator processes
    /// merge exactly: the buckets are the same everywhere).
    pub fn merge(&self, other: &Histogram) {
        for (a, b) in self.buckets.iter().zip(&other.buckets) {
            let v = b.load(Ordering::Relaxed);
            if v > 0 {
                a.fetch_add(v, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(other.count(), Ordering::Relaxed);
        self.max.fetch_max(other.max(), Ordering::Relaxed);
    }

    /// Compact text form for the worker pipe: `max;bucket:count,bucket:count,...` (only
    /// non-empty buckets, so an idle histogram is a few bytes).
    pub fn encode(&self) -> String {
        let mut out = format!("{};", self.max());
        let mut first = true;
        for (i, b) in self.buckets.iter().enumerate() {
            let v = b.load(Ordering::Relaxed);
            if v > 0 {
                if !first {
                    out.push(',');
                }
                first = false;
                out.push_str(&format!("{i}:{v}"));
            }
        }
        out
    }

    /// Parses [`Histogram::encode`]'s output.
    pub fn decode(s: &str) -> Result<Histogram, String> {
        let bad = || format!("bad histogram {s:?}");
        let (max, rest) = s.split_once(';').ok_or_else(bad)?;
        let h = Histogram::default();
        h.max
            .store(max.parse().map_err(|_| bad())?, Ordering::Relaxed);
        for pair in rest.split(',').filter(|p| !p.is_empty()) {
            let (i, v) = pair.split_once(':').ok_or_else(bad)?;
            let i: usize = i.parse().map_err(|_| bad())?;
            let v: u64 = v.parse().map_err(|_| bad())?;
            h.buckets
                .get(i)
                .ok_or_else(bad)?
                .store(v, Ordering::Relaxed);
            h.count.fetch_add(v, Ordering::Relaxed);
        }
        Ok(h)
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

    #[test]
    fn histograms_merged_from_two_processes_give_the_quantiles_of_all_values() {
        let (a, b, all) = (
            Histogram::default(),
            Histogram::default(),
            Histogram::default(),
        );
        for v in 1..=1000 {
            if v % 3 == 0 { &a } else { &b }.record(v * 7);
            all.record(v * 7);
        }
        let merged = Histogram::default();
        for part in [&a, &b] {
            merged.merge(&Histogram::decode(&part.encode()).expect("round trip"));
        }
        assert_eq!(merged.count(), 1000);
        assert_eq!(merged.max(), 7000);
        for q in [0.5, 0.9, 0.99, 1.0] {
            assert_eq!(merged.quantile(q), all.quantile(q), "q={q}");
        }
        assert!(Histogram::decode("12;5:x").is_err());
        assert!(Histogram::decode("1;999999:1").is_err());
        assert_eq!(Histogram::decode("0;").expect("empty").count(), 0);
    }
}
