//! XEP-0280 Message Carbons: which messages are copied to a user's other resources, and
//! what a copy looks like. Advertised in the server's disco#info.
//!
//! A resource turns carbons on or off for itself with an iq set of `<enable/>` or
//! `<disable/>` in `urn:xmpp:carbons:2` ([`handle_iq`]); the flag lives in the session's
//! [`SessionState`](crate::node::sessions::SessionState), where delivery reads it. The copies
//! themselves are sent by [`crate::routing::delivery`] (`sent_copies`, and the received copies inside
//! `delivery::message`), the one way anything reaches a session:
//!
//! - **received** (XEP-0280 §6): a message delivered to a user under RFC 6121 §8.5 is also
//!   sent, wrapped in `<received/>`, to every carbons-enabled resource of that user that did
//!   not get the original (a message to a full JID: all the others; to the bare JID: those
//!   outside the highest-priority set);
//! - **sent** (§7): a message a resource sends is wrapped in `<sent/>` and sent to every
//!   other carbons-enabled resource of the sender, whether or not the sender enabled
//!   carbons itself.
//!
//! Which messages are copied ([`eligible`], §5's suggested rules): type `chat`, and type
//! `normal` with a `<body/>`; never `groupchat`, `headline` or `error`, nothing from or about
//! a MUC (`muc#user` payload), nothing carrying `<private/>` (§8) or the XEP-0334
//! `<no-copy/>` hint, and never a message that already is a carbon. Messages between a
//! user's own resources are not copied: every resource of that user is already a party.
//! The receiving side removes `<private/>` before delivering the original (§8).
//!
//! This module imports only the model and the session registry's types, so every layer
//! above may use it.

use crate::node::sessions::SessionHandle;
use crate::protocol::error::{reply_skeleton, StanzaError};
use crate::protocol::stanza::{IqType, MessageType};
use crate::protocol::xml::{Element, NS_CLIENT};

/// The XEP-0280 namespace (version 2).
pub(crate) const NS_CARBONS: &str = "urn:xmpp:carbons:2";
/// XEP-0297 stanza forwarding, the wrapper of every copy.
pub(crate) const NS_FORWARD: &str = "urn:xmpp:forward:0";
/// XEP-0334 message processing hints.
pub(crate) const NS_HINTS: &str = "urn:xmpp:hints";
/// XEP-0045 user namespace: its presence in a message marks MUC traffic.
const NS_MUC_USER: &str = "http://jabber.org/protocol/muc#user";

/// Which side of a conversation a copy reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    /// A message one of the user's other resources sent (XEP-0280 §7).
    Sent,
    /// A message the user received on another resource (XEP-0280 §6).
    Received,
}

impl Direction {
    fn element(self) -> &'static str {
        match self {
            Direction::Sent => "sent",
            Direction::Received => "received",
        }
    }
}

/// XEP-0280 §5: whether `msg` is copied to carbons-enabled resources (see the module
/// documentation for the rules).
pub(crate) fn eligible(msg: &Element) -> bool {
    if msg.name != "message"
        || msg.get_child("private", NS_CARBONS).is_some()
        || msg.get_child("no-copy", NS_HINTS).is_some()
        || msg.get_child("sent", NS_CARBONS).is_some()
        || msg.get_child("received", NS_CARBONS).is_some()
        || msg.get_child("x", NS_MUC_USER).is_some()
    {
        return false;
    }
    match MessageType::of(msg) {
        MessageType::Chat => true,
        MessageType::Normal => msg.get_child("body", &msg.ns).is_some(),
        MessageType::Error | MessageType::Groupchat | MessageType::Headline => false,
    }
}

/// XEP-0280 §11: a `<sent/>` or `<received/>` wrapper in a message from anyone but the
/// recipient's own account is not a carbon; the receiving server removes it, so a client
/// that trusts its server's carbons cannot be shown a forged one.
pub(crate) fn strip_wrappers(msg: &mut Element) {
    msg.remove_children("sent", NS_CARBONS);
    msg.remove_children("received", NS_CARBONS);
}

/// XEP-0280 §8: the receiving server removes `<private/>` before delivering the original.
pub(crate) fn strip_private(msg: &mut Element) {
    msg.remove_children("private", NS_CARBONS);
}

/// The copy of `original` for resource `to` of user `user` (a bare JID): from the bare JID,
/// the original's type, the original inside `<sent|received><forwarded/>` (§6, §7).
pub(crate) fn wrap(direction: Direction, original: &Element, user: &str, to: &str) -> Element {
    let mut copy = Element::new("message", NS_CLIENT)
        .attr("from", user)
        .attr("to", to);
    if let Some(ty) = original.get_attr("type") {
        copy.set_attr("type", ty);
    }
    copy.child(
        Element::new(direction.element(), NS_CARBONS)
            .child(Element::new("forwarded", NS_FORWARD).child(original.clone())),
    )
}

/// Whether `session` asked for carbons.
pub(crate) fn enabled(session: &SessionHandle) -> bool {
    session.read(|p| p.carbons)
}

/// Handles an iq in [`NS_CARBONS`] a resource sent to its own account (XEP-0280 §3, §4):
/// `<enable/>` or `<disable/>` in a set switches carbons for that resource alone; repeating
/// either is answered with a result (§9.1). Anything else is `bad-request`.
pub(crate) fn handle_iq(
    session: &SessionHandle,
    iq: &Element,
    ty: IqType,
    payload: &Element,
) -> Element {
    let on = match (ty, payload.name.as_str()) {
        (IqType::Set, "enable") => true,
        (IqType::Set, "disable") => false,
        _ => {
            return StanzaError::bad_request()
                .reply_to(iq)
                .unwrap_or_else(|| reply_skeleton(iq, "result"))
        }
    };
    switch(session, on);
    reply_skeleton(iq, "result")
}

/// Switches carbons for `session` alone: by the iq, or inline in a XEP-0386 bind.
pub(crate) fn switch(session: &SessionHandle, on: bool) {
    session.write(|info| info.carbons = on);
    tracing::debug!(jid = %session.jid, on, "carbons switched");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::xml::parse_element;

    fn msg(xml: &str) -> Element {
        parse_element(xml).expect("test stanza parses")
    }

    #[test]
    fn eligibility_follows_the_suggested_rules() {
        let table = [
            ("<message type='chat'><body>x</body></message>", true),
            // A chat state alone is still a chat message (§9.2: intentionally copied).
            ("<message type='chat'><active xmlns='http://jabber.org/protocol/chatstates'/></message>", true),
            ("<message><body>x</body></message>", true),
            ("<message type='normal'><body>x</body></message>", true),
            ("<message type='normal'><subject>x</subject></message>", false),
            // RFC 6121 §5.2.2: a type the server does not know is normal.
            ("<message type='sms'><body>x</body></message>", true),
            ("<message type='groupchat'><body>x</body></message>", false),
            ("<message type='headline'><body>x</body></message>", false),
            ("<message type='error'><body>x</body></message>", false),
            ("<message type='chat'><body>x</body><private xmlns='urn:xmpp:carbons:2'/></message>", false),
            ("<message type='chat'><body>x</body><no-copy xmlns='urn:xmpp:hints'/></message>", false),
            ("<message type='chat'><body>x</body><x xmlns='http://jabber.org/protocol/muc#user'/></message>", false),
            ("<message type='chat'><received xmlns='urn:xmpp:carbons:2'/></message>", false),
            ("<message type='chat'><sent xmlns='urn:xmpp:carbons:2'/></message>", false),
        ];
        for (xml, want) in table {
            let m = msg(&xml.replace("<message", "<message xmlns='jabber:client'"));
            assert_eq!(eligible(&m), want, "{xml}");
        }
    }

    #[test]
    fn a_copy_wraps_the_original_and_comes_from_the_bare_jid() {
        let m = msg("<message xmlns='jabber:client' from='j@c/b' to='r@m/g' type='chat'><body>hi</body></message>");
        let c = wrap(Direction::Received, &m, "r@m", "r@m/home");
        assert_eq!(c.get_attr("from"), Some("r@m"));
        assert_eq!(c.get_attr("to"), Some("r@m/home"));
        assert_eq!(c.get_attr("type"), Some("chat"));
        let inner = c
            .get_child("received", NS_CARBONS)
            .and_then(|r| r.get_child("forwarded", NS_FORWARD))
            .and_then(|f| f.get_child("message", NS_CLIENT))
            .expect("forwarded original");
        assert_eq!(inner, &m);
        let s = wrap(Direction::Sent, &m, "j@c", "j@c/other");
        assert!(s.get_child("sent", NS_CARBONS).is_some());
    }

    #[test]
    fn private_is_removed_before_delivery() {
        let mut m = msg("<message xmlns='jabber:client' type='chat'><body>x</body><private xmlns='urn:xmpp:carbons:2'/></message>");
        strip_private(&mut m);
        assert!(m.get_child("private", NS_CARBONS).is_none());
        assert!(m.get_child("body", NS_CLIENT).is_some());
    }
}
