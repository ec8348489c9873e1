//! Roster pushes (RFC 6121 §2.1.6) and the answer to a subscription change the store
//! refused: what roster management, presence subscriptions and the SQL roster listener
//! all send when a roster item changes, kept below all three so none imports another.

use crate::node::session::Client;
use crate::node::sessions::{SessionHandle, Sessions};
use crate::protocol::error::StanzaError;
use crate::protocol::xml::{escape_into, Element, NS_CLIENT, NS_ROSTER};
use crate::store::{RosterItem, StoreError};

/// The attributes of an item's `<item/>` (RFC 6121 §2.1.2), in the order they are
/// written: what [`item_element`] and [`write_item`] both put on it, so the roster result
/// and a push cannot come to differ.
fn item_attrs(item: &RosterItem) -> impl Iterator<Item = (&'static str, &str)> {
    [
        Some(("jid", item.contact.as_str())),
        Some(("subscription", item.subscription.as_str())),
        item.name.as_deref().map(|name| ("name", name)),
        item.sub_state().ask().map(|ask| ("ask", ask)),
        // RFC 6121 §3.4: approved='true' tells the client a pre-approval is in place.
        item.preapproved.then_some(("approved", "true")),
    ]
    .into_iter()
    .flatten()
}

/// `<item/>` for a roster push (RFC 6121 §2.1.6) or a versioned roster's change.
pub(crate) fn item_element(item: &RosterItem) -> Element {
    let mut e = Element::new("item", NS_ROSTER);
    for (name, value) in item_attrs(item) {
        e.set_attr(name, value);
    }
    for g in &item.groups {
        e = e.child(Element::new("group", NS_ROSTER).text(g.clone()));
    }
    e
}

/// Writes `item`'s `<item/>` as a child of a `<query xmlns='jabber:iq:roster'/>`: the
/// same element as [`item_element`], serialised in place. A roster result of K items
/// is written this way, into one string, rather than built as K elements of about
/// eight small allocations each that live only until the writer serialises them.
pub(crate) fn write_item(out: &mut String, item: &RosterItem) {
    out.push_str("<item");
    for (name, value) in item_attrs(item) {
        out.push(' ');
        out.push_str(name);
        out.push_str("='");
        escape_into(out, value);
        out.push('\'');
    }
    if item.groups.is_empty() {
        out.push_str("/>");
        return;
    }
    out.push('>');
    for g in &item.groups {
        out.push_str("<group>");
        escape_into(out, g);
        out.push_str("</group>");
    }
    out.push_str("</item>");
}

/// Sends a roster push (RFC 6121 §2.1.6) for `item` to every interested resource of `owner`.
pub(crate) fn push(sessions: &Sessions, owner: &str, version: i64, item: Element) {
    for s in sessions.of_user_str(owner) {
        if s.read(|p| p.interested) {
            push_to(&s, version, item.clone());
        }
    }
}

/// Sends one roster push to one session and records the version it now has.
pub(crate) fn push_to(session: &SessionHandle, version: i64, item: Element) {
    let iq = Element::new("iq", NS_CLIENT)
        .attr("type", "set")
        .attr("id", format!("push{}", crate::protocol::xml::new_id()))
        .attr("to", session.jid.to_string())
        .child(
            Element::new("query", NS_ROSTER)
                .attr("ver", version.to_string())
                .child(item),
        );
    note_version(session, version);
    crate::node::outbox::to_handle(session, iq);
}

/// Records that `session` has seen roster version `version`.
pub(crate) fn note_version(session: &SessionHandle, version: i64) {
    session.write(|p| p.roster_ver = Some(p.roster_ver.map_or(version, |v| v.max(version))));
}

/// Push for an item that changed.
pub(crate) fn push_item(sessions: &Sessions, owner: &str, version: i64, item: &RosterItem) {
    push(sessions, owner, version, item_element(item));
}

/// Push for an item that was removed (`subscription='remove'`, RFC 6121 §2.5.2).
pub(crate) fn push_removed(sessions: &Sessions, owner: &str, version: i64, contact: &str) {
    let item = Element::new("item", NS_ROSTER)
        .attr("jid", contact)
        .attr("subscription", "remove");
    push(sessions, owner, version, item);
}

/// The stanza error for a roster write the store refused; subscription paths that create
/// items answer a full roster with it too ([`subscription_refused`]).
pub(crate) fn store_failed(e: StoreError) -> StanzaError {
    match e {
        StoreError::Constraint(c) => StanzaError::bad_request().with_text(c),
        // The roster size limit is a policy of this server, the same for every way an item
        // is created; not-allowed (cancel) says retrying will not help.
        StoreError::RosterFull => StanzaError::not_allowed().with_text("roster is full"),
        other => {
            tracing::error!(error = %other, "roster store failure");
            StanzaError::internal_server_error()
        }
    }
}

/// A subscription stanza from the user that the store refused: logged, and a full roster
/// is answered to the user's session with a presence error from the contact (RFC 6120
/// §8.3: an error stanza in reply to the stanza that caused it), the same not-allowed a
/// roster set gets. `contact` is the bare JID the stanza was addressed to.
pub(crate) fn subscription_refused(session: &Client, contact: &str, kind: &str, e: &StoreError) {
    if !matches!(e, StoreError::RosterFull) {
        tracing::warn!(user = %session.jid(), %contact, kind, error = %e, "subscription change failed");
        return;
    }
    tracing::info!(
        peer = %session.peer, user = %session.jid(), %contact, kind,
        "subscription refused: roster is full"
    );
    let stanza = Element::new("presence", NS_CLIENT)
        .attr("type", kind)
        .attr("from", session.jid().to_string())
        .attr("to", contact);
    if let Some(reply) = store_failed(StoreError::RosterFull).reply_to(&stanza) {
        session.deliver(reply);
    }
}
