//! XEP-0160 offline messages: which messages are kept for a user with no available
//! resource, under which budget, what a sender is told when one is not kept, and how they
//! look when handed out. Storage is `store::offline`; the path that keeps and hands them
//! out is [`crate::routing::delivery`] (`delivery::store_offline`, reached by `delivery::message`
//! from every producer — a local client, a remote server over s2s, a message that arrived
//! on another cluster node than the user's, a XEP-0198 session's unacknowledged stanzas —
//! stores; `delivery::offline_messages` delivers at the user's next initial presence), so
//! the recipient's block list is asked by the same function as for any delivery, on the
//! way in and again on the way out.
//!
//! **Contacts and strangers** ([`is_contact`]). A sender is a *contact* of the user when it
//! is the user's own account, or when the user's roster has an item for the sender's bare
//! JID with subscription `to`, `from` or `both`: the user approved the sender's
//! subscription or asked for the sender's presence, an act of the user's. Everyone else is
//! a *stranger*, including a sender whose item is `none` (a pending request, which the
//! stranger can create by itself, or a pre-approval).
//!
//! **Kept** ([`storable`], RFC 6121 §8.5.2.2.1 leaves the choice to the server): messages
//! of type `chat` or `normal` with a `<body/>`, and from a contact also a body-less XEP-0184
//! receipt or XEP-0333 chat marker (they tell the contact's client what happened to its own
//! messages), unless they carry the XEP-0334 `<no-store/>` hint. A body-less message is not
//! kept for its `<store/>` hint alone (XEP-0334 makes that a SHOULD): it cost the sender
//! nothing and filled the store of anyone it liked. Chat states (XEP-0085) and other
//! transient payloads are dropped; `groupchat`, `headline` and `error` messages are never
//! kept.
//!
//! **Budget** (`[limits]`, enforced by the store's one insert under a lock per owner): in
//! all `max_offline_messages` and `max_offline_bytes` per user; per contact
//! `max_offline_messages_per_sender` and `max_offline_bytes_per_sender`, so one contact
//! cannot fill the store for the others; per stranger (by bare JID)
//! `max_offline_messages_per_stranger` and `max_offline_bytes_per_stranger`. A contact's
//! message that does not fit the whole displaces the oldest strangers' messages first, so
//! strangers, however many, can neither push out nor block a contact's message.
//!
//! **What a sender is told** (`delivery::store_offline`). A stranger is never answered, whatever
//! becomes of its message: delivered to a visible or XEP-0186 invisible resource, kept,
//! dropped (no room in its share or in the store, nothing worth keeping) — and a message to
//! an account that does not exist is dropped without an answer too (RFC 6121 §8.5.1 allows
//! silently ignoring it, §8.5.2.2.1 and §8.5.3.2.1 allow it for an offline one). Silence is
//! the one answer that can be uniform: a resource that takes a message answers nothing, so
//! any error for any of the other cases (no account, offline, full) would tell a stranger
//! the account exists or that its user is not online, and the time of an answer that never
//! comes tells nothing either. A contact's message that does not fit its share or the
//! store is answered `service-unavailable` (§8.5.2.2.1) only when the privacy gate lets that
//! contact see the user's online status ([`crate::services::presence::gate::may_see_online`], the one
//! privacy decision); a contact the user hides from (the `online` setting, a block) is
//! treated as a stranger and told nothing, because the error only ever comes while the user
//! has no resource that takes messages. What stays: a contact the gate admits can fill its
//! share while the user is offline and later see, by the error no longer coming, that the
//! store was emptied by a login, which may have been an invisible one.
//!
//! A kept message goes out with a XEP-0203 `<delay/>` from the server's domain stamped with
//! when it was stored ([`stamped`]).

use crate::policy::subscription::Subscription;
use crate::protocol::stanza::MessageType;
use crate::protocol::xml::Element;

/// The disco#info feature of offline storage (XEP-0160 §4).
pub(crate) const FEATURE: &str = "msgoffline";

/// XEP-0334 message processing hints.
const NS_HINTS: &str = "urn:xmpp:hints";
/// XEP-0184 message delivery receipts.
const NS_RECEIPTS: &str = "urn:xmpp:receipts";
/// XEP-0333 chat markers.
const NS_MARKERS: &str = "urn:xmpp:chat-markers:0";

/// Whether a sender counts as a contact of the offline store's owner (see the module
/// documentation): `own` when the sender is the owner's own account, `item` the owner's
/// roster subscription with the sender's bare JID (`None`: no item).
pub(crate) fn is_contact(own: bool, item: Option<Subscription>) -> bool {
    own || item.is_some_and(|s| s.has_to() || s.has_from())
}

/// Whether `msg`, which no resource of its recipient could take, is kept for later;
/// `from_contact` says whether its sender is a contact ([`is_contact`]).
pub(crate) fn storable(msg: &Element, from_contact: bool) -> bool {
    if !MessageType::of(msg).is_chat_or_normal() || msg.get_child("no-store", NS_HINTS).is_some() {
        return false;
    }
    msg.elements().any(|c| {
        (c.name == "body" && c.ns == msg.ns)
            || (from_contact
                && (c.is("received", NS_RECEIPTS) || (c.ns == NS_MARKERS && c.name != "markable")))
    })
}

/// A stored message as handed out: stamped (XEP-0203 §3 via XEP-0160 §5) with when the
/// server `domain` stored it. A message stored a second time (handed out to a XEP-0198
/// session that ended before its client acknowledged it) keeps its first stamp: that is
/// when it was sent.
pub(crate) fn stamped(
    mut msg: Element,
    domain: &str,
    at: chrono::DateTime<chrono::Utc>,
) -> Element {
    let stamped_here = msg.elements().any(|c| {
        c.is("delay", crate::protocol::xml::NS_DELAY) && c.get_attr("from") == Some(domain)
    });
    if stamped_here {
        return msg;
    }
    msg.children.push(crate::protocol::xml::Node::Element(
        crate::protocol::xml::delay(domain, at).text("Offline Storage"),
    ));
    msg
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::xml::parse_element;

    #[test]
    fn chat_and_normal_with_a_body_are_kept_receipts_and_markers_only_from_contacts() {
        // (message, kept from a contact, kept from a stranger)
        let table = [
            ("<message type='chat'><body>x</body></message>", true, true),
            ("<message><body>x</body></message>", true, true),
            ("<message type='normal'><received xmlns='urn:xmpp:receipts' id='1'/></message>", true, false),
            ("<message type='chat'><displayed xmlns='urn:xmpp:chat-markers:0' id='1'/></message>", true, false),
            ("<message type='chat'><markable xmlns='urn:xmpp:chat-markers:0'/></message>", false, false),
            ("<message type='chat'><store xmlns='urn:xmpp:hints'/><x xmlns='e:x'/></message>", false, false),
            ("<message type='chat'><store xmlns='urn:xmpp:hints'/></message>", false, false),
            ("<message type='chat'><composing xmlns='http://jabber.org/protocol/chatstates'/></message>", false, false),
            ("<message type='chat'><body>x</body><no-store xmlns='urn:xmpp:hints'/></message>", false, false),
            ("<message type='groupchat'><body>x</body></message>", false, false),
            ("<message type='headline'><body>x</body></message>", false, false),
            ("<message type='error'><body>x</body></message>", false, false),
        ];
        for (xml, contact, stranger) in table {
            let m = parse_element(xml).expect("test stanza parses");
            assert_eq!(storable(&m, true), contact, "from a contact: {xml}");
            assert_eq!(storable(&m, false), stranger, "from a stranger: {xml}");
        }
    }

    #[test]
    fn contacts_are_the_owner_and_roster_items_with_a_subscription() {
        assert!(is_contact(true, None));
        assert!(!is_contact(false, None));
        assert!(!is_contact(false, Some(Subscription::None)));
        for s in [Subscription::To, Subscription::From, Subscription::Both] {
            assert!(is_contact(false, Some(s)), "{s:?}");
        }
    }

    #[test]
    fn a_stored_message_carries_the_server_delay() {
        use chrono::TimeZone;
        let at = chrono::Utc.with_ymd_and_hms(2026, 3, 4, 5, 6, 7).unwrap();
        let m = parse_element("<message type='chat'><body>x</body></message>").unwrap();
        let out = stamped(m, "example.org", at);
        let d = out
            .get_child("delay", crate::protocol::xml::NS_DELAY)
            .expect("delay");
        assert_eq!(d.get_attr("from"), Some("example.org"));
        assert_eq!(d.get_attr("stamp"), Some("2026-03-04T05:06:07Z"));
        // Stored again and handed out later: still the first stamp, and only one.
        let later = chrono::Utc.with_ymd_and_hms(2026, 3, 5, 0, 0, 0).unwrap();
        let again = stamped(out, "example.org", later);
        let delays: Vec<_> = again
            .elements()
            .filter(|c| c.is("delay", crate::protocol::xml::NS_DELAY))
            .collect();
        assert_eq!(delays.len(), 1);
        assert_eq!(delays[0].get_attr("stamp"), Some("2026-03-04T05:06:07Z"));
    }
}
