//! The set of viewers one session's available presence reached, and how each came to see
//! it ([`crate::node::sessions::SessionState`]): what a permission change withdraws the
//! presence from, and what the session's unavailable goes to (RFC 6121 §4.5.2).
//!
//! Every idle session holds one, with an entry per contact it was shown to, so at K = 300
//! it is the largest thing a session owns. Each entry is one `u32`: the viewer's id in the
//! node's [`crate::node::names::Names`] (below 2^30) shifted left by two, the relation in
//! the two low bits, so that ordering entries orders ids. The entries are a vector sorted
//! that way: 4 bytes per viewer, looked up by binary search, grown by an eighth at a time
//! so that its spare room stays under an eighth. A hash map from id to relation held the
//! same entries in 8-byte slots, a power of two of them kept at most seven-eighths full,
//! plus a control byte per slot: 4.6 kB for 300 viewers against 1.2 kB here. What delivery
//! does per stanza (was the recipient shown this resource? record it again for a
//! broadcast) is a binary search, a handful of comparisons at these sizes. Adding a new
//! viewer or removing one moves the entries after it, once per viewer per session:
//! building a set of 300 moves about 180 kB in all; at the bound, `[limits]
//! max_revealed_per_session` (5,000 by default), about 50 MB, a few milliseconds once for
//! a user with that many contacts online.

use crate::node::names::{NameId, NAME_ID_BITS};
use crate::policy::privacy::Relation;

/// Bits of an entry below the id.
const RELATION_BITS: u32 = u32::BITS - NAME_ID_BITS;

fn pack(id: NameId, relation: Relation) -> u32 {
    debug_assert!(
        id >> NAME_ID_BITS == 0,
        "name ids fit in {NAME_ID_BITS} bits"
    );
    let code = match relation {
        Relation::Subscriber => 0,
        Relation::DirectedPresence => 1,
        Relation::Other => 2,
    };
    id << RELATION_BITS | code
}

fn id_of(entry: u32) -> NameId {
    entry >> RELATION_BITS
}

fn relation_of(entry: u32) -> Relation {
    match entry & ((1 << RELATION_BITS) - 1) {
        0 => Relation::Subscriber,
        1 => Relation::DirectedPresence,
        _ => Relation::Other,
    }
}

/// See the module documentation.
#[derive(Debug, Default)]
pub(crate) struct RevealedSet {
    /// Packed (`pack`), sorted, each id once.
    entries: Vec<u32>,
}

impl RevealedSet {
    /// How many viewers are recorded.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Entries the set has room for before it must grow.
    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.entries.capacity()
    }

    fn position(&self, id: NameId) -> Result<usize, usize> {
        self.entries.binary_search_by_key(&id, |e| id_of(*e))
    }

    /// Whether `id` is recorded.
    pub(crate) fn contains(&self, id: NameId) -> bool {
        self.position(id).is_ok()
    }

    /// How `id` came to see the presence, if it did.
    pub(crate) fn get(&self, id: NameId) -> Option<Relation> {
        self.position(id)
            .ok()
            .map(|at| relation_of(self.entries[at]))
    }

    /// Records `id` with `relation`, replacing what was recorded for it.
    pub(crate) fn insert(&mut self, id: NameId, relation: Relation) {
        match self.position(id) {
            Ok(at) => self.entries[at] = pack(id, relation),
            Err(at) => {
                if self.entries.len() == self.entries.capacity() {
                    // An eighth more, not the doubling `Vec` would do: the set is built
                    // once per login and then kept for the whole session.
                    self.entries.reserve_exact((self.entries.len() / 8).max(4));
                }
                self.entries.insert(at, pack(id, relation));
            }
        }
    }

    /// Forgets `id`; what was recorded for it, if anything.
    pub(crate) fn remove(&mut self, id: NameId) -> Option<Relation> {
        let at = self.position(id).ok()?;
        let relation = relation_of(self.entries.remove(at));
        // Give back room that many removals left (a block list, a roster emptied).
        if self.entries.capacity() > 2 * self.entries.len() + 8 {
            self.entries
                .shrink_to(self.entries.len() + self.entries.len() / 8);
        }
        Some(relation)
    }

    /// The recorded viewers and their relations, by id.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (NameId, Relation)> + '_ {
        self.entries.iter().map(|e| (id_of(*e), relation_of(*e)))
    }

    /// The recorded ids.
    pub(crate) fn ids(&self) -> impl Iterator<Item = NameId> + '_ {
        self.entries.iter().map(|e| id_of(*e))
    }

    /// The recorded ids, emptying the set.
    pub(crate) fn into_ids(self) -> impl Iterator<Item = NameId> {
        self.entries.into_iter().map(id_of)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_found_replaced_and_removed_by_id() {
        let mut set = RevealedSet::default();
        for id in [7, 3, 11, 5] {
            set.insert(id, Relation::DirectedPresence);
        }
        set.insert(3, Relation::Subscriber);
        assert_eq!(set.len(), 4);
        assert_eq!(set.get(3), Some(Relation::Subscriber));
        assert_eq!(set.get(7), Some(Relation::DirectedPresence));
        assert_eq!(set.get(4), None);
        assert!(set.contains(11) && !set.contains(12));
        set.insert(5, Relation::Other);
        assert_eq!(set.get(5), Some(Relation::Other));
        assert_eq!(set.remove(7), Some(Relation::DirectedPresence));
        assert_eq!(set.remove(7), None);
        assert_eq!(set.ids().collect::<Vec<_>>(), vec![3, 5, 11]);
        assert_eq!(set.into_ids().collect::<Vec<_>>(), vec![3, 5, 11]);
    }

    #[test]
    fn spare_room_stays_under_an_eighth_as_the_set_grows() {
        let mut set = RevealedSet::default();
        // Ids in the order a login's probe answers might bring them: not sorted.
        for n in 0..300u32 {
            set.insert(
                n.wrapping_mul(2_654_435_761) % 100_000,
                Relation::Subscriber,
            );
            assert!(
                set.capacity() <= set.len() + set.len() / 8 + 4,
                "{} entries in room for {}",
                set.len(),
                set.capacity()
            );
        }
        assert_eq!(set.len(), 300);
        // 4 bytes per viewer: 300 viewers in under 1.4 kB.
        assert!(set.capacity() * std::mem::size_of::<u32>() < 1_400);
        let ids: Vec<_> = set.ids().collect();
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "kept sorted");
    }

    #[test]
    fn the_largest_ids_keep_their_relation_and_order() {
        let mut set = RevealedSet::default();
        let top = (1 << NAME_ID_BITS) - 1;
        set.insert(top, Relation::Other);
        set.insert(top - 1, Relation::DirectedPresence);
        set.insert(0, Relation::Subscriber);
        assert_eq!(
            set.iter().collect::<Vec<_>>(),
            vec![
                (0, Relation::Subscriber),
                (top - 1, Relation::DirectedPresence),
                (top, Relation::Other)
            ]
        );
    }

    #[test]
    fn removals_give_back_room() {
        let mut set = RevealedSet::default();
        for id in 0..300 {
            set.insert(id, Relation::Subscriber);
        }
        for id in 0..290 {
            set.remove(id);
        }
        assert_eq!(set.len(), 10);
        assert!(
            set.capacity() <= 2 * set.len() + 8,
            "room for {}",
            set.capacity()
        );
        assert_eq!(set.get(295), Some(Relation::Subscriber));
    }
}
