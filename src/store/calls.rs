//! How many times each store operation reached the database, per [`Store`] (shared by its
//! clones), so a test can hold a path to the reads it promises (`tests/login_reads.rs`:
//! what one login costs) over the real store, not a mock.
//!
//! Counted where every public method picks its backend ([`super::pg_or_sqlite`]), under
//! the name of the backend's method (the store method's own name, or the statement it
//! runs for a method that is a variant of another). One count is one statement or one
//! transaction: what a caller waits for once. A lock and a map update per call cost
//! nothing next to the round trip they count, so the counter is always on.

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::Store;

/// The counts of one store and its clones.
#[derive(Debug, Default)]
pub struct Calls {
    by_name: Mutex<BTreeMap<&'static str, u64>>,
}

impl Calls {
    /// Notes one call of `name`.
    pub(crate) fn count(&self, name: &'static str) {
        let mut map = self.by_name.lock().unwrap_or_else(|e| e.into_inner());
        *map.entry(name).or_default() += 1;
    }

    fn snapshot(&self) -> BTreeMap<&'static str, u64> {
        self.by_name
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Store {
    /// Every operation this store (or a clone) ran on the database so far, by name, with
    /// how many times ([`Calls`]).
    pub fn calls(&self) -> BTreeMap<&'static str, u64> {
        self.calls.snapshot()
    }

    /// The operations run since `before` (an earlier [`Store::calls`]), by name; names
    /// not run since are left out.
    pub fn calls_since(&self, before: &BTreeMap<&'static str, u64>) -> BTreeMap<&'static str, u64> {
        self.calls()
            .into_iter()
            .filter_map(|(name, n)| {
                let since = n - before.get(name).copied().unwrap_or(0);
                (since > 0).then_some((name, since))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_kept_by_name() {
        let c = Calls::default();
        c.count("roster");
        c.count("roster");
        c.count("audience_inputs");
        let s = c.snapshot();
        assert_eq!(s.get("roster"), Some(&2));
        assert_eq!(s.get("audience_inputs"), Some(&1));
    }
}
