//! This node's copy of directory rows: a presence change looks up every contact on the
//! subject's domain, and without a copy that is one `HGETALL` per contact per change, the
//! first thing to saturate Redis (CAPACITY.md).
//!
//! What is kept is the user's hash as Redis returned it (every row, including other
//! instances' and dead ones'), so the readers' filters (this instance's own rows, instances
//! that are not live) apply at each lookup and a node joining or dying changes the answer
//! at once, without touching the copy.
//!
//! Kept right by invalidation: every node that writes a user's rows tells every other live
//! node, on its channel, after the write (`invalidate`, one message per node per batch of
//! writes), and the receiver drops its copy. A lookup that was already in flight when an
//! invalidation arrived must not store what it read (it may predate the write): each
//! lookup notes the generation of the user's stripe before it reads and stores only if no
//! invalidation of that stripe came meanwhile. A copy older than the TTL is read again, which
//! bounds the damage of an invalidation lost with a dropped subscription; every Redis
//! failure empties the copy (this node may have missed anything).
//!
//! Bounded: at most `entries` users; when full, an arbitrary copy makes room.

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One user's hash: resource → encoded entry.
pub type Rows = Arc<Vec<(String, String)>>;

const STRIPES: usize = 1024;

/// The generation a lookup noted before reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Generation(u64, u64);

struct State<V> {
    copies: HashMap<String, (Instant, V)>,
    stripes: Vec<u64>,
    /// Bumped by [`Cache::clear`]: every stripe's generation changes at once.
    epoch: u64,
}

/// The bounded copy. Cheap operations under one mutex; nothing awaits while holding it.
/// `V` is what is kept per user: directory rows here; other per-user values read from a
/// store on a hot path (the avatar hash of XEP-0153 presence) use the same discipline.
pub struct Cache<V = Rows> {
    state: Mutex<State<V>>,
    entries: usize,
    ttl: Duration,
    /// Lookups answered from the copy.
    pub hits: AtomicU64,
    /// Lookups that read Redis.
    pub misses: AtomicU64,
}

fn stripe(bare: &str) -> usize {
    (BuildHasherDefault::<DefaultHasher>::default().hash_one(bare) as usize) % STRIPES
}

impl<V: Clone> Cache<V> {
    /// A copy of at most `entries` users (0: nothing is ever kept), each used for `ttl`.
    pub fn new(entries: usize, ttl: Duration) -> Cache<V> {
        Cache {
            state: Mutex::new(State {
                copies: HashMap::new(),
                stripes: vec![0; STRIPES],
                epoch: 0,
            }),
            entries,
            ttl,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<V>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The rows of `bare` if a fresh copy is kept; otherwise the generation to hand to
    /// [`Self::put`] with what is read instead.
    pub fn get(&self, bare: &str) -> Result<V, Generation> {
        let st = self.lock();
        if let Some((at, rows)) = st.copies.get(bare) {
            if at.elapsed() < self.ttl {
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(rows.clone());
            }
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        Err(Generation(st.epoch, st.stripes[stripe(bare)]))
    }

    /// The generation to hand to [`Self::put`] with rows read from Redis without asking
    /// for a copy first (a read that must not be answered from one).
    pub fn generation(&self, bare: &str) -> Generation {
        let st = self.lock();
        Generation(st.epoch, st.stripes[stripe(bare)])
    }

    /// Keeps `rows`, read for `bare` after [`Self::get`] returned `noted`, unless an
    /// invalidation of its stripe (or a clear) came since.
    pub fn put(&self, bare: &str, noted: Generation, rows: V) {
        if self.entries == 0 {
            return;
        }
        let mut st = self.lock();
        if Generation(st.epoch, st.stripes[stripe(bare)]) != noted {
            return;
        }
        if st.copies.len() >= self.entries && !st.copies.contains_key(bare) {
            if let Some(k) = st.copies.keys().next().cloned() {
                st.copies.remove(&k);
            }
        }
        st.copies.insert(bare.to_owned(), (Instant::now(), rows));
    }

    /// Another node wrote `bare`'s rows: drop the copy, and keep any lookup in flight from
    /// storing what it read.
    pub fn invalidate(&self, bare: &str) {
        let mut st = self.lock();
        let i = stripe(bare);
        st.stripes[i] = st.stripes[i].wrapping_add(1);
        st.copies.remove(bare);
    }

    /// Forgets everything (this node may have missed invalidations).
    pub fn clear(&self) {
        let mut st = self.lock();
        st.epoch = st.epoch.wrapping_add(1);
        st.copies.clear();
    }

    /// Users copied now.
    pub fn len(&self) -> usize {
        self.lock().copies.len()
    }

    /// Whether nothing is copied.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(v: &str) -> Rows {
        Arc::new(vec![("r".to_owned(), v.to_owned())])
    }

    #[test]
    fn a_copy_is_served_until_invalidated_and_a_read_in_flight_is_not_stored() {
        let c = Cache::new(10, Duration::from_secs(60));
        let g = c.get("a@x").unwrap_err();
        c.put("a@x", g, rows("1"));
        assert_eq!(c.get("a@x").unwrap(), rows("1"));
        // A lookup starts, then another node's write is announced before its answer.
        c.invalidate("a@x");
        let g = c.get("a@x").unwrap_err();
        c.invalidate("a@x");
        c.put("a@x", g, rows("stale"));
        assert!(
            c.get("a@x").is_err(),
            "a read older than the invalidation was kept"
        );
        // A clear has the same effect on every lookup in flight.
        let g = c.get("b@x").unwrap_err();
        c.clear();
        c.put("b@x", g, rows("stale"));
        assert!(c.is_empty());
    }

    #[test]
    fn the_copy_is_bounded_and_expires() {
        let c = Cache::new(2, Duration::from_secs(60));
        for u in ["a@x", "b@x", "c@x"] {
            let g = c.get(u).unwrap_err();
            c.put(u, g, rows(u));
        }
        assert_eq!(c.len(), 2);
        assert!(c.get("c@x").is_ok());
        let off = Cache::new(0, Duration::from_secs(60));
        let g = off.get("a@x").unwrap_err();
        off.put("a@x", g, rows("1"));
        assert!(off.is_empty());
        let short = Cache::new(2, Duration::ZERO);
        let g = short.get("a@x").unwrap_err();
        short.put("a@x", g, rows("1"));
        assert!(short.get("a@x").is_err(), "an expired copy was served");
    }
}
