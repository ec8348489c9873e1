//! XEP-0160 offline messages: which messages are kept for a user with no available
//! resource, and how they look when handed out. Storage is `store::offline`; the path that
//! keeps and hands them out is [`crate::delivery`] (`delivery::message` stores,
//! `delivery::offline_messages` delivers at the user's next initial presence), so the
//! recipient's block list is asked by the same function as for any delivery, on the way
//! in and again on the way out.
//!
//! Kept ([`storable`], RFC 6121 §8.5.2.2.1 leaves the choice to the server): messages of
//! type `chat` or `normal` that a person or a client needs later — a `<body/>`, a
//! XEP-0184 receipt or a XEP-0333 chat marker, or anything carrying the XEP-0334 `<store/>`
//! hint — unless they carry `<no-store/>`. Chat states alone (XEP-0085) and other
//! transient payloads are dropped as before; `groupchat`, `headline` and `error` messages
//! are never kept. A kept message goes out with a XEP-0203 `<delay/>` from the server's
//! domain stamped with when it was stored ([`stamped`]).

use crate::stanza::MessageType;
use crate::xml::Element;

/// The disco#info feature of offline storage (XEP-0160 §4).
pub const FEATURE: &str = "msgoffline";

/// XEP-0334 message processing hints.
const NS_HINTS: &str = "urn:xmpp:hints";
/// XEP-0184 message delivery receipts.
const NS_RECEIPTS: &str = "urn:xmpp:receipts";
/// XEP-0333 chat markers.
const NS_MARKERS: &str = "urn:xmpp:chat-markers:0";

/// Whether `msg`, which no resource of its recipient could take, is kept for later.
pub fn storable(msg: &Element) -> bool {
    if !MessageType::of(msg).is_chat_or_normal() || msg.get_child("no-store", NS_HINTS).is_some() {
        return false;
    }
    msg.elements().any(|c| {
        (c.name == "body" && c.ns == msg.ns)
            || c.is("store", NS_HINTS)
            || c.is("received", NS_RECEIPTS)
            || (c.ns == NS_MARKERS && c.name != "markable")
    })
}

/// A stored message as handed out: stamped (XEP-0203 §3 via XEP-0160 §5) with when the
/// server `domain` stored it. A message stored a second time (handed out to a XEP-0198
/// session that ended before its client acknowledged it) keeps its first stamp: that is
/// when it was sent.
pub fn stamped(mut msg: Element, domain: &str, at: chrono::DateTime<chrono::Utc>) -> Element {
    let stamped_here = msg
        .elements()
        .any(|c| c.is("delay", crate::xml::NS_DELAY) && c.get_attr("from") == Some(domain));
    if stamped_here {
        return msg;
    }
    msg.children.push(crate::xml::Node::Element(
        crate::xml::delay(domain, at).text("Offline Storage"),
    ));
    msg
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::xml::parse_element;

    #[test]
    fn chat_and_normal_with_content_are_kept_the_rest_is_not() {
        let table = [
            ("<message type='chat'><body>x</body></message>", true),
            ("<message><body>x</body></message>", true),
            ("<message type='normal'><received xmlns='urn:xmpp:receipts' id='1'/></message>", true),
            ("<message type='chat'><displayed xmlns='urn:xmpp:chat-markers:0' id='1'/></message>", true),
            ("<message type='chat'><store xmlns='urn:xmpp:hints'/><x xmlns='e:x'/></message>", true),
            ("<message type='chat'><composing xmlns='http://jabber.org/protocol/chatstates'/></message>", false),
            ("<message type='chat'><body>x</body><no-store xmlns='urn:xmpp:hints'/></message>", false),
            ("<message type='groupchat'><body>x</body></message>", false),
            ("<message type='headline'><body>x</body></message>", false),
            ("<message type='error'><body>x</body></message>", false),
        ];
        for (xml, want) in table {
            let m = parse_element(xml).expect("test stanza parses");
            assert_eq!(storable(&m), want, "{xml}");
        }
    }

    #[test]
    fn a_stored_message_carries_the_server_delay() {
        use chrono::TimeZone;
        let at = chrono::Utc.with_ymd_and_hms(2026, 3, 4, 5, 6, 7).unwrap();
        let m = parse_element("<message type='chat'><body>x</body></message>").unwrap();
        let out = stamped(m, "example.org", at);
        let d = out.get_child("delay", crate::xml::NS_DELAY).expect("delay");
        assert_eq!(d.get_attr("from"), Some("example.org"));
        assert_eq!(d.get_attr("stamp"), Some("2026-03-04T05:06:07Z"));
        // Stored again and handed out later: still the first stamp, and only one.
        let later = chrono::Utc.with_ymd_and_hms(2026, 3, 5, 0, 0, 0).unwrap();
        let again = stamped(out, "example.org", later);
        let delays: Vec<_> = again
            .elements()
            .filter(|c| c.is("delay", crate::xml::NS_DELAY))
            .collect();
        assert_eq!(delays.len(), 1);
        assert_eq!(delays[0].get_attr("stamp"), Some("2026-03-04T05:06:07Z"));
    }
}
