//! The per-subject lock that serialises presence decisions and deliveries about one user.
//! What each session was shown and whether it is invisible live in its own state
//! ([`crate::node::sessions::SessionState`]); the gate ([`crate::services::presence::gate`]) decides, under
//! this lock, and records there.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Subject bare JID → the lock that serialises presence decisions and deliveries for it.
/// Lives in [`crate::node::Shared`].
#[derive(Debug, Default)]
pub struct SubjectLocks {
    locks: Mutex<HashMap<Arc<str>, Arc<tokio::sync::Mutex<()>>>>,
}

impl SubjectLocks {
    /// Takes the lock for presence decisions and deliveries about `subject` (bare JID).
    /// The entry is removed again when the last holder or waiter lets go, so the map holds
    /// only subjects being worked on.
    ///
    /// The guard shares the map's key: a login takes one lock per contact it probes, so a
    /// subject already locked costs no allocation and a new one a single copy of its name.
    pub async fn lock_subject(&self, subject: &str) -> SubjectGuard<'_> {
        let (subject, lock) = {
            let mut map = self.locks.lock().unwrap_or_else(|e| e.into_inner());
            match map.get_key_value(subject) {
                Some((key, lock)) => (Arc::clone(key), Arc::clone(lock)),
                None => {
                    let key: Arc<str> = Arc::from(subject);
                    let lock = Arc::new(tokio::sync::Mutex::new(()));
                    map.insert(Arc::clone(&key), Arc::clone(&lock));
                    (key, lock)
                }
            }
        };
        SubjectGuard {
            registry: self,
            subject,
            guard: Some(lock.lock_owned().await),
        }
    }

    /// How many tasks hold or wait for `subject`'s lock (0: nobody is working on it). The
    /// tests use it to line up the interleavings a race needs; nothing in the server
    /// decides by it.
    pub fn holders_and_waiters(&self, subject: &str) -> usize {
        let map = self.locks.lock().unwrap_or_else(|e| e.into_inner());
        // Each holder or waiter owns one clone; the map holds the first.
        map.get(subject).map_or(0, |l| Arc::strong_count(l) - 1)
    }
}

/// Held while deciding and delivering presence of one subject; see
/// [`SubjectLocks::lock_subject`].
pub struct SubjectGuard<'a> {
    registry: &'a SubjectLocks,
    subject: Arc<str>,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Drop for SubjectGuard<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut map = self
            .registry
            .locks
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        // Clones are only made under this map lock, so a count of one means no task holds
        // or waits for it.
        if map
            .get(&self.subject)
            .is_some_and(|l| Arc::strong_count(l) == 1)
        {
            map.remove(&self.subject);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn subject_locks_are_dropped_when_nobody_holds_or_waits_for_them() {
        let r = SubjectLocks::default();
        let first = r.lock_subject("a@x").await;
        let waiter = async { r.lock_subject("a@x").await };
        let mut waiter = Box::pin(waiter);
        // The waiter cannot get in while the first guard lives.
        assert!(futures_poll_once(&mut waiter).await.is_none());
        assert_eq!(r.holders_and_waiters("a@x"), 2);
        drop(first);
        let second = waiter.await;
        assert_eq!(r.locks.lock().unwrap().len(), 1);
        assert_eq!(r.holders_and_waiters("a@x"), 1);
        drop(second);
        assert!(r.locks.lock().unwrap().is_empty());
        assert_eq!(r.holders_and_waiters("a@x"), 0);
    }

    /// Polls a future once without waiting.
    async fn futures_poll_once<F: std::future::Future + Unpin>(f: &mut F) -> Option<F::Output> {
        tokio::select! {
            biased;
            out = f => Some(out),
            _ = std::future::ready(()) => None,
        }
    }
}
