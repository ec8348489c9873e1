//! The one privacy decision: may viewer V learn subject S's online status or last seen?
//!
//! Every path that could reveal either signal calls [`may_see`] (or one of its two
//! wrappers) with the same inputs: presence broadcast, probe answers (RFC 6121 §4.3.2),
//! XEP-0012 last-activity answers, and the presence a roster push or directed presence
//! triggers. Nothing is filtered in the client, and nothing here does I/O: the caller reads
//! both parties' settings, the subject's roster item for the viewer and both block lists
//! (XEP-0191), then asks.
//!
//! Rules, in the order they are applied:
//!
//! 1. Everyone sees their own signals (their other resources need them).
//! 2. A block in either direction hides both signals (XEP-0191 §3.1: a blocked entity gets
//!    no presence; a user who blocked S does not want S's presence either).
//! 3. Only an approved subscriber (the subject's item says `from` or `both`, RFC 6121
//!    §4.2.2) can pass a setting; strangers never see anything. The one exception is online
//!    status for an entity the subject sent directed presence to (RFC 6121 §4.6): that was
//!    the subject's own act at that moment, not something the server does on its own.
//! 4. The subject's setting for the signal: [`Visibility::Subscribers`],
//!    [`Visibility::ContactsExcept`] (subscribers minus a list) or [`Visibility::Nobody`].
//! 5. Reciprocity, for last seen only: a viewer who hides their own last seen from S, by
//!    choosing `Nobody` or by naming S in their `ContactsExcept` list, cannot see S's.
//!    Hiding from *all* non-subscribers is the protocol default and does not count, so a
//!    one-way subscription still shows last seen to the subscriber.
//!
//! The size of a `ContactsExcept` list is bounded where settings are written (a config
//! limit), not here.

use std::collections::BTreeSet;

use ::jid::BareJid;

use super::subscription::SubState;

/// Who may see one signal (online status or last seen) of its owner.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Visibility {
    /// Every contact with an approved subscription (`from`/`both` in the owner's roster),
    /// which is what plain RFC 6121 gives. The default.
    #[default]
    Subscribers,
    /// Approved subscribers except these bare JIDs.
    ContactsExcept(BTreeSet<BareJid>),
    /// No one but the owner.
    Nobody,
}

impl Visibility {
    /// Whether this setting shows the signal to `viewer`, given that the viewer is an
    /// approved subscriber. Non-subscribers are turned away before this is asked.
    fn admits_subscriber(&self, viewer: &BareJid) -> bool {
        match self {
            Visibility::Subscribers => true,
            Visibility::ContactsExcept(except) => !except.contains(viewer),
            Visibility::Nobody => false,
        }
    }
}

/// A user's two privacy settings; online status and last seen are chosen separately.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PrivacySettings {
    /// Who sees whether the user is online now (presence broadcast and probe answers).
    pub online: Visibility,
    /// Who sees when the user was last online (XEP-0012, and the last-seen stamp on
    /// unavailable presence).
    pub last_seen: Visibility,
}

/// The two signals the settings govern.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// Available/unavailable presence.
    Online,
    /// The time of the last session end.
    LastSeen,
}

/// How the subject's roster sees the viewer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Relation {
    /// The subject approved the viewer's subscription (`from` or `both`).
    Subscriber,
    /// Not a subscriber, but the subject sent the viewer directed presence in the current
    /// session (RFC 6121 §4.6).
    DirectedPresence,
    /// Anyone else, including a contact whose request is still pending.
    Other,
}

impl Relation {
    /// The relation read from the subject's roster item for the viewer (`None` when there
    /// is no item); directed presence is tracked by the session and not derivable here.
    pub fn from_item(subject_item_for_viewer: Option<SubState>) -> Self {
        match subject_item_for_viewer {
            Some(item) if item.contact_sees_user() => Relation::Subscriber,
            _ => Relation::Other,
        }
    }
}

/// Blocks between the two parties (XEP-0191), one flag per direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Blocks {
    /// The subject's block list contains the viewer.
    pub by_subject: bool,
    /// The viewer's block list contains the subject.
    pub by_viewer: bool,
}

impl Blocks {
    fn any(self) -> bool {
        self.by_subject || self.by_viewer
    }
}

/// One side of the question: a user and that user's settings.
#[derive(Debug, Clone, Copy)]
pub struct Party<'a> {
    /// The user's bare JID, as normalised at the edge.
    pub jid: &'a BareJid,
    /// The user's settings ([`PrivacySettings::default`] for a remote user, whose server
    /// applies its own rules to what it sends us).
    pub settings: &'a PrivacySettings,
}

/// The privacy decision: may `viewer` learn `signal` of `subject`? See the module
/// documentation for the rules and their order.
pub fn may_see(
    signal: Signal,
    viewer: Party<'_>,
    subject: Party<'_>,
    relation: Relation,
    blocks: Blocks,
) -> bool {
    if viewer.jid == subject.jid {
        return true;
    }
    if blocks.any() {
        return false;
    }
    match signal {
        Signal::Online => match relation {
            Relation::Subscriber => subject.settings.online.admits_subscriber(viewer.jid),
            Relation::DirectedPresence => true,
            Relation::Other => false,
        },
        Signal::LastSeen => {
            relation == Relation::Subscriber
                && subject.settings.last_seen.admits_subscriber(viewer.jid)
                && !hides_last_seen_from(viewer.settings, subject.jid)
        }
    }
}

/// [`may_see`] for online status.
pub fn may_see_online(
    viewer: Party<'_>,
    subject: Party<'_>,
    relation: Relation,
    blocks: Blocks,
) -> bool {
    may_see(Signal::Online, viewer, subject, relation, blocks)
}

/// [`may_see`] for last seen, with reciprocity.
pub fn may_see_last_seen(
    viewer: Party<'_>,
    subject: Party<'_>,
    relation: Relation,
    blocks: Blocks,
) -> bool {
    may_see(Signal::LastSeen, viewer, subject, relation, blocks)
}

/// Reciprocity: the viewer's own last-seen setting explicitly hides it from `other`.
fn hides_last_seen_from(viewer_settings: &PrivacySettings, other: &BareJid) -> bool {
    match &viewer_settings.last_seen {
        Visibility::Subscribers => false,
        Visibility::ContactsExcept(except) => except.contains(other),
        Visibility::Nobody => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::subscription::Subscription;

    fn jid(s: &str) -> BareJid {
        crate::protocol::jid::parse_bare(s).expect("test JID is valid")
    }

    fn except(names: &[&str]) -> Visibility {
        Visibility::ContactsExcept(names.iter().map(|n| jid(n)).collect())
    }

    /// Short names for the table.
    #[derive(Clone, Copy)]
    enum V {
        Subs,
        /// ContactsExcept naming the other party of the row.
        ExceptThem,
        /// ContactsExcept naming a third party only.
        ExceptCarol,
        Nobody,
    }

    fn vis(v: V, them: &str) -> Visibility {
        match v {
            V::Subs => Visibility::Subscribers,
            V::ExceptThem => except(&[them]),
            V::ExceptCarol => except(&["carol@a.example"]),
            V::Nobody => Visibility::Nobody,
        }
    }

    const SUB: Relation = Relation::Subscriber;
    const DIR: Relation = Relation::DirectedPresence;
    const OTH: Relation = Relation::Other;
    const NB: Blocks = Blocks {
        by_subject: false,
        by_viewer: false,
    };
    const BS: Blocks = Blocks {
        by_subject: true,
        by_viewer: false,
    };
    const BV: Blocks = Blocks {
        by_subject: false,
        by_viewer: true,
    };

    #[test]
    fn decisions_follow_the_rule_table() {
        // Subject alice, viewer bob. (alice online, alice last seen, bob last seen,
        // relation, blocks, bob sees online, bob sees last seen)
        #[rustfmt::skip]
        let table = [
            // plain RFC 6121: subscribers see, strangers do not
            (V::Subs,        V::Subs,        V::Subs,        SUB, NB, true,  true ),
            (V::Subs,        V::Subs,        V::Subs,        OTH, NB, false, false),
            // subject's settings
            (V::Nobody,      V::Subs,        V::Subs,        SUB, NB, false, true ),
            (V::Subs,        V::Nobody,      V::Subs,        SUB, NB, true,  false),
            (V::ExceptThem,  V::Subs,        V::Subs,        SUB, NB, false, true ),
            (V::ExceptCarol, V::ExceptCarol, V::Subs,        SUB, NB, true,  true ),
            (V::Subs,        V::ExceptThem,  V::Subs,        SUB, NB, true,  false),
            // a setting never lets a non-subscriber in
            (V::ExceptCarol, V::ExceptCarol, V::Subs,        OTH, NB, false, false),
            // reciprocity: hiding your own last seen hides others' from you, online unaffected
            (V::Subs,        V::Subs,        V::Nobody,      SUB, NB, true,  false),
            (V::Subs,        V::Subs,        V::ExceptThem,  SUB, NB, true,  false),
            (V::Subs,        V::Subs,        V::ExceptCarol, SUB, NB, true,  true ),
            // blocks in either direction hide everything
            (V::Subs,        V::Subs,        V::Subs,        SUB, BS, false, false),
            (V::Subs,        V::Subs,        V::Subs,        SUB, BV, false, false),
            // directed presence shows online (the subject's own act), never last seen
            (V::Nobody,      V::Subs,        V::Subs,        DIR, NB, true,  false),
            (V::Subs,        V::Subs,        V::Subs,        DIR, BS, false, false),
        ];
        let alice = jid("alice@a.example");
        let bob = jid("bob@b.example");
        for (i, (a_on, a_ls, b_ls, rel, blocks, want_on, want_ls)) in table.into_iter().enumerate()
        {
            let a_settings = PrivacySettings {
                online: vis(a_on, "bob@b.example"),
                last_seen: vis(a_ls, "bob@b.example"),
            };
            let b_settings = PrivacySettings {
                online: Visibility::Subscribers,
                last_seen: vis(b_ls, "alice@a.example"),
            };
            let viewer = Party {
                jid: &bob,
                settings: &b_settings,
            };
            let subject = Party {
                jid: &alice,
                settings: &a_settings,
            };
            assert_eq!(
                may_see_online(viewer, subject, rel, blocks),
                want_on,
                "row {i}: online"
            );
            assert_eq!(
                may_see_last_seen(viewer, subject, rel, blocks),
                want_ls,
                "row {i}: last seen"
            );
        }
    }

    #[test]
    fn own_signals_are_always_visible_even_when_hidden_from_everyone() {
        let alice = jid("alice@a.example");
        let hidden = PrivacySettings {
            online: Visibility::Nobody,
            last_seen: Visibility::Nobody,
        };
        let me = Party {
            jid: &alice,
            settings: &hidden,
        };
        for signal in [Signal::Online, Signal::LastSeen] {
            assert!(may_see(signal, me, me, Relation::Other, NB));
        }
    }

    #[test]
    fn relation_comes_from_the_subjects_from_half_only() {
        let cases = [
            (None, Relation::Other),
            (Some(SubState::new(Subscription::None)), Relation::Other),
            (Some(SubState::new(Subscription::To)), Relation::Other),
            (
                Some(SubState::new(Subscription::From)),
                Relation::Subscriber,
            ),
            (
                Some(SubState::new(Subscription::Both)),
                Relation::Subscriber,
            ),
            (
                Some(SubState {
                    pending_in: true,
                    ..SubState::NONE
                }),
                Relation::Other,
            ),
        ];
        for (item, want) in cases {
            assert_eq!(Relation::from_item(item), want, "{item:?}");
        }
    }

    #[test]
    fn except_list_compares_normalised_bare_jids() {
        // Localparts and domains are case-folded at the edge (RFC 7622), so a list written
        // as "Bob@B.Example" still hides from bob@b.example.
        let alice = jid("alice@a.example");
        let bob = jid("bob@b.example");
        let a = PrivacySettings {
            online: except(&["Bob@B.Example"]),
            last_seen: Visibility::Subscribers,
        };
        let b = PrivacySettings::default();
        let viewer = Party {
            jid: &bob,
            settings: &b,
        };
        let subject = Party {
            jid: &alice,
            settings: &a,
        };
        assert!(!may_see_online(viewer, subject, SUB, NB));
    }
}
