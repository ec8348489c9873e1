//! Node-local privacy state of the sessions bound here (who was shown what, who is
//! invisible, who asked for block-list pushes) and the per-subject lock that serialises
//! presence decisions. The gate ([`crate::presence::gate`]) decides; this only remembers.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use crate::jid::bare_of;
use crate::policy::privacy::Relation;

/// Per-session privacy state other tasks need: invisibility (XEP-0186), whether the
/// session asked for the block list (XEP-0191 pushes), and who its presence reached.
#[derive(Debug, Default, Clone)]
struct Entry {
    /// The session's bound full JID.
    jid: String,
    /// XEP-0186 invisible: no broadcast, probes answered as unavailable.
    invisible: bool,
    /// While invisible, whether probes still go to remote contacts (XEP-0186 `probe`).
    probe_remote: bool,
    /// The session retrieved its block list, so it gets block/unblock pushes
    /// (XEP-0191 §3.3: pushes go to resources that requested the list).
    blocklist_interested: bool,
    /// Viewer JID (bare for a roster contact, as addressed for directed presence) → how
    /// the viewer came to see this resource.
    revealed: HashMap<String, Relation>,
}

/// Node-local registry of per-session privacy state, keyed by session id. Lives in
/// [`crate::node::Shared`]; a session's entry is removed when it ends.
#[derive(Debug, Default)]
pub struct Registry {
    /// Session id → its state.
    sessions: Mutex<HashMap<u64, Entry>>,
    /// Subject bare JID → the lock that serialises presence decisions and deliveries for it.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl Registry {
    fn with<R>(&self, f: impl FnOnce(&mut HashMap<u64, Entry>) -> R) -> R {
        let mut map = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut map)
    }

    /// Takes the lock for presence decisions and deliveries about `subject` (bare JID).
    /// The entry is removed again when the last holder or waiter lets go, so the map holds
    /// only subjects being worked on.
    pub async fn lock_subject(&self, subject: &str) -> SubjectGuard<'_> {
        let lock = {
            let mut map = self.locks.lock().unwrap_or_else(|e| e.into_inner());
            map.entry(subject.to_owned()).or_default().clone()
        };
        SubjectGuard {
            registry: self,
            subject: subject.to_owned(),
            guard: Some(lock.lock_owned().await),
        }
    }

    /// Whether session `id` is invisible (XEP-0186).
    pub fn is_invisible(&self, id: u64) -> bool {
        self.with(|m| m.get(&id).is_some_and(|e| e.invisible))
    }

    /// Marks session `id` (bound to `jid`) invisible or visible; `probe_remote` is the
    /// XEP-0186 `probe` choice for remote contacts while invisible.
    pub fn set_invisible(&self, id: u64, jid: &str, invisible: bool, probe_remote: bool) {
        self.with(|m| {
            let e = m.entry(id).or_default();
            e.jid = jid.to_owned();
            e.invisible = invisible;
            e.probe_remote = probe_remote;
        })
    }

    /// Whether invisible session `id` asked for probes to remote contacts.
    pub fn probes_remote(&self, id: u64) -> bool {
        self.with(|m| m.get(&id).is_some_and(|e| e.probe_remote))
    }

    /// Records that session `id` asked for its block list.
    pub fn set_blocklist_interested(&self, id: u64, jid: &str) {
        self.with(|m| {
            let e = m.entry(id).or_default();
            e.jid = jid.to_owned();
            e.blocklist_interested = true;
        })
    }

    /// Whether session `id` gets block-list pushes.
    pub fn blocklist_interested(&self, id: u64) -> bool {
        self.with(|m| m.get(&id).is_some_and(|e| e.blocklist_interested))
    }

    /// Records that session `id`'s available presence reached `viewer`.
    pub fn reveal(&self, id: u64, jid: &str, viewer: &str, relation: Relation) {
        self.with(|m| {
            let e = m.entry(id).or_default();
            e.jid = jid.to_owned();
            // A subscriber relation is not downgraded by a later directed presence.
            let slot = e.revealed.entry(viewer.to_owned()).or_insert(relation);
            if relation == Relation::Subscriber {
                *slot = relation;
            }
        })
    }

    /// Forgets that session `id` was shown to `viewer`; true if it had been.
    pub fn forget(&self, id: u64, viewer: &str) -> bool {
        self.with(|m| {
            m.get_mut(&id)
                .is_some_and(|e| e.revealed.remove(viewer).is_some())
        })
    }

    /// How session `id` came to be shown to `viewer`, if it was.
    pub fn revealed_relation(&self, id: u64, viewer: &str) -> Option<Relation> {
        self.with(|m| m.get(&id).and_then(|e| e.revealed.get(viewer).copied()))
    }

    /// Whether session `id`'s presence reached `viewer`.
    pub fn was_revealed(&self, id: u64, viewer: &str) -> bool {
        self.with(|m| m.get(&id).is_some_and(|e| e.revealed.contains_key(viewer)))
    }

    /// The viewers session `id` was shown to, and how (a copy).
    pub fn revealed(&self, id: u64) -> Vec<(String, Relation)> {
        self.with(|m| {
            m.get(&id)
                .map(|e| e.revealed.iter().map(|(k, v)| (k.clone(), *v)).collect())
                .unwrap_or_default()
        })
    }

    /// Takes (and clears) the set of viewers session `id` was shown to.
    pub fn take_revealed(&self, id: u64) -> HashMap<String, Relation> {
        self.with(|m| {
            m.get_mut(&id)
                .map(|e| std::mem::take(&mut e.revealed))
                .unwrap_or_default()
        })
    }

    /// Drops session `id` (it ended).
    pub fn remove(&self, id: u64) {
        self.with(|m| {
            m.remove(&id);
        })
    }

    /// Bare JIDs of users whose sessions have revealed presence to `viewer_bare` (or to
    /// one of its full JIDs).
    pub(crate) fn subjects_revealed_to(&self, viewer_bare: &str) -> HashSet<String> {
        self.with(|m| {
            m.values()
                .filter(|e| e.revealed.keys().any(|v| bare_of(v) == viewer_bare))
                .map(|e| bare_of(&e.jid).to_owned())
                .collect()
        })
    }

    /// Bare JIDs of every user with state here (for a resync after a lost LISTEN).
    pub(crate) fn all_subjects(&self) -> HashSet<String> {
        self.with(|m| m.values().map(|e| bare_of(&e.jid).to_owned()).collect())
    }
}

/// Held while deciding and delivering presence of one subject; see
/// [`Registry::lock_subject`].
pub struct SubjectGuard<'a> {
    registry: &'a Registry,
    subject: String,
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
        let r = Registry::default();
        let first = r.lock_subject("a@x").await;
        let waiter = async { r.lock_subject("a@x").await };
        let mut waiter = Box::pin(waiter);
        // The waiter cannot get in while the first guard lives.
        assert!(futures_poll_once(&mut waiter).await.is_none());
        drop(first);
        let second = waiter.await;
        assert_eq!(r.locks.lock().unwrap().len(), 1);
        drop(second);
        assert!(r.locks.lock().unwrap().is_empty());
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
