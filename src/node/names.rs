//! One node-wide table of the JIDs that many sessions remember, so that each session holds
//! a 4-byte id per remembered JID instead of its own copy of the string.
//!
//! A session remembers every viewer its presence reached ([`crate::node::sessions::SessionState`]):
//! with K contacts, K entries per session, and the same bare JIDs in the sets of all of
//! those contacts' sessions. As strings that was about 90 bytes per entry (the string, its
//! heap block and a hash-map slot of 32 bytes), the largest part of an idle session's
//! memory at K = 300 (BENCHMARKS-ARCHIVE.md, "Memory and login cost per contact (K = 300)"). Here
//! each distinct JID is stored once, with a count of the entries that name it; an id is
//! taken by [`Names::acquire`] and given back by [`Names::release`], and at zero the
//! string is dropped and the id reused, so the table holds only what some session
//! remembers (no growth from JIDs seen once).
//!
//! The table does not normalise: it stores the strings it is given, which the callers
//! normalised where they entered the server (crate::protocol::jid).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// A string's id while at least one holder has acquired it.
pub(crate) type NameId = u32;

/// Ids are below 2^30, so that a holder can keep two bits of its own beside one in a `u32`
/// (`node::revealed`). A billion distinct names held at once is far past what a node's
/// memory holds (each is a string of its own here).
pub(crate) const NAME_ID_BITS: u32 = 30;

#[derive(Debug, Default)]
struct Table {
    ids: HashMap<Arc<str>, NameId>,
    /// By id: the string and how many holders acquired it; `None` while the id is free.
    slots: Vec<Option<(Arc<str>, u32)>>,
    /// Ids whose slot is free, reused before the table grows.
    free: Vec<NameId>,
}

/// See the module documentation. Cheap operations under one mutex; nothing awaits while
/// holding it.
#[derive(Debug, Default)]
pub(crate) struct Names {
    table: Mutex<Table>,
}

impl Names {
    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The id of `name`, if some holder has acquired it.
    pub(crate) fn find(&self, name: &str) -> Option<NameId> {
        self.lock().ids.get(name).copied()
    }

    /// The id of `name`, counting one more holder (inserting it if it is new).
    pub(crate) fn acquire(&self, name: &str) -> NameId {
        let mut t = self.lock();
        if let Some(&id) = t.ids.get(name) {
            if let Some((_, refs)) = &mut t.slots[id as usize] {
                *refs += 1;
            }
            return id;
        }
        let name: Arc<str> = Arc::from(name);
        let id = match t.free.pop() {
            Some(id) => {
                t.slots[id as usize] = Some((Arc::clone(&name), 1));
                id
            }
            None => {
                let id = NameId::try_from(t.slots.len())
                    .ok()
                    .filter(|id| id >> NAME_ID_BITS == 0)
                    .expect("fewer than 2^30 names");
                t.slots.push(Some((Arc::clone(&name), 1)));
                id
            }
        };
        t.ids.insert(name, id);
        id
    }

    /// Gives back one holder's id; the last one frees the string and the id.
    pub(crate) fn release(&self, id: NameId) {
        let mut t = self.lock();
        Self::release_locked(&mut t, id);
    }

    /// [`Self::release`] for many ids under one lock.
    pub(crate) fn release_all(&self, ids: impl IntoIterator<Item = NameId>) {
        let mut t = self.lock();
        for id in ids {
            Self::release_locked(&mut t, id);
        }
    }

    fn release_locked(t: &mut Table, id: NameId) {
        let Some(slot) = t.slots.get_mut(id as usize) else {
            return;
        };
        let Some((_, refs)) = slot else { return };
        *refs -= 1;
        if *refs == 0 {
            if let Some((name, _)) = slot.take() {
                t.ids.remove(&*name);
                t.free.push(id);
            }
        }
    }

    /// The string of an acquired id.
    #[cfg(test)]
    pub(crate) fn name(&self, id: NameId) -> Option<Arc<str>> {
        self.lock()
            .slots
            .get(id as usize)?
            .as_ref()
            .map(|(n, _)| Arc::clone(n))
    }

    /// The strings of many ids under one lock, in order (an id not acquired is skipped).
    pub(crate) fn names<T>(
        &self,
        ids: impl IntoIterator<Item = (NameId, T)>,
    ) -> Vec<(Arc<str>, T)> {
        let t = self.lock();
        ids.into_iter()
            .filter_map(|(id, v)| {
                let (n, _) = t.slots.get(id as usize)?.as_ref()?;
                Some((Arc::clone(n), v))
            })
            .collect()
    }

    /// Whether the string of any of `ids` satisfies `pred`, under one lock and without a
    /// copy (an id not acquired is skipped).
    pub(crate) fn any(
        &self,
        ids: impl IntoIterator<Item = NameId>,
        pred: impl Fn(&str) -> bool,
    ) -> bool {
        let t = self.lock();
        ids.into_iter().any(|id| {
            t.slots
                .get(id as usize)
                .and_then(Option::as_ref)
                .is_some_and(|(n, _)| pred(n))
        })
    }

    /// Distinct strings held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().ids.len()
    }

    /// Whether no string is held.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_string_per_name_until_its_last_holder_releases_it() {
        let names = Names::default();
        let a = names.acquire("a@x");
        let b = names.acquire("b@x");
        assert_ne!(a, b);
        assert_eq!(names.acquire("a@x"), a, "the same string, the same id");
        assert_eq!(names.len(), 2);
        names.release(a);
        assert_eq!(names.find("a@x"), Some(a), "one holder left");
        assert_eq!(names.name(a).as_deref(), Some("a@x"));
        names.release(a);
        assert_eq!(names.find("a@x"), None, "the last holder freed it");
        assert_eq!(names.name(a), None);
        assert_eq!(names.len(), 1);
        // The freed id is reused for the next new string, not the table grown.
        assert_eq!(names.acquire("c@x"), a);
        assert_eq!(names.name(a).as_deref(), Some("c@x"));
        names.release_all([a, b]);
        assert!(names.is_empty());
    }
}
