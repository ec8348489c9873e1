//! Sending what was already decided: the transport of stanzas to local sessions (and, for
//! a presence or an error, to another server) once the caller's question (the privacy
//! gate, a block list, a session's own request) was answered. The decisions themselves,
//! and the deliveries that must ask them, are in `delivery`.

use std::sync::Arc;

use crate::error::StanzaError;
use crate::jid::{FullJid, Jid};
use crate::sessions::{message_targets, SessionHandle};
use crate::xml::{Element, NS_CLIENT};

use super::Shared;

/// Queues a stanza on the session bound to `full`, if there is one. The caller decided
/// that the stanza may reach it.
pub(crate) fn to_session(shared: &Shared, full: &FullJid, el: Element) -> bool {
    shared.sessions.get(full).is_some_and(|s| s.send(el))
}

/// Delivers `el` to every available resource of local user `bare` (RFC 6121 §4.2.3,
/// §3.1.3). Returns how many sessions got it.
pub(crate) fn to_available(shared: &Shared, bare: &str, el: &Element) -> usize {
    xml_to_available(shared, bare, || el.to_xml())
}

/// Delivers a serialised stanza to every available resource of local user `bare`: `xml` runs
/// at most once, only if some resource is available, and its bytes are shared by all of
/// them (the fan-out hot path: no handle copies, no element clone per resource, one read
/// lock on the registry).
pub(crate) fn xml_to_available(shared: &Shared, bare: &str, xml: impl FnOnce() -> String) -> usize {
    let bytes = std::cell::LazyCell::new(|| Arc::new(xml()));
    let mut reached = 0;
    shared.sessions.for_each_of(bare, |s| {
        if s.is_available() {
            s.send_xml(Arc::clone(&bytes));
            reached += 1;
        }
    });
    reached
}

/// Delivers `el` to a local JID: a full JID's session, or a bare JID's available
/// resources.
pub(crate) fn to_local(shared: &Shared, to: &str, el: Element) {
    match Jid::new(to).map(Jid::try_into_full) {
        Ok(Ok(full)) => {
            to_session(shared, &full, el);
        }
        Ok(Err(bare)) => {
            to_available(shared, bare.as_str(), &el);
        }
        Err(_) => {}
    }
}

/// Whether `jid` is an account on a domain this server hosts.
pub(crate) fn is_local(shared: &Shared, jid: &str) -> bool {
    let bare = crate::jid::bare_of(jid);
    bare.contains('@') && shared.config.serves(crate::jid::domain_of(bare))
}

/// Sends a presence the caller's decision admitted to `to`: locally as [`to_local`], to
/// another domain over federation.
pub(crate) fn presence_to(shared: &Shared, to: &str, el: Element) {
    if is_local(shared, to) {
        to_local(shared, to, el);
    } else {
        let _ = crate::node::route_remote(shared, el);
    }
}

/// Answers `el` with `err` (RFC 6120 §8.3.1), wherever its sender is: a local session, a
/// local user's resources, or a remote server. Nothing answers an error.
pub(crate) fn bounce(shared: &Shared, el: &Element, err: StanzaError) {
    let Some(reply) = err.reply_to(el) else {
        return;
    };
    let Some(to) = reply.get_attr("to").and_then(|t| Jid::new(t).ok()) else {
        return;
    };
    if !shared.config.serves(to.domain().as_str()) {
        let _ = crate::node::route_remote(shared, reply);
        return;
    }
    match (reply.name.as_str(), to.try_into_full()) {
        (_, Ok(full)) => {
            to_session(shared, &full, reply);
        }
        ("presence", Err(bare)) => {
            to_available(shared, bare.as_str(), &reply);
        }
        (_, Err(bare)) => {
            message_to_bare(&shared.sessions.of_user(&bare), reply, "error");
        }
    }
}

/// Sends a reply built elsewhere (already addressed) back to its recipient.
pub(crate) fn answer(shared: &Shared, reply: Element) {
    match reply.get_attr("to").map(str::to_owned) {
        Some(to) if is_local(shared, &to) => to_local(shared, &to, reply),
        Some(_) => {
            let _ = crate::node::route_remote(shared, reply);
        }
        None => {}
    }
}

/// RFC 6121 §8.5.2: delivers a message of type `kind` (not groupchat, which the caller
/// answers) to the resources of a local bare JID, `sessions`.
pub(crate) fn message_to_bare(sessions: &[SessionHandle], el: Element, kind: &str) {
    if kind == "error" {
        // Never answer an error; with no resource to take it, it is dropped (§8.5.2.2.1).
        if let Some(s) = message_targets(sessions).first() {
            s.send(el);
        }
        return;
    }
    let targets = message_targets(sessions);
    if targets.is_empty() {
        // No offline storage. §8.5.2.2.1 lets the server ignore the message silently, and
        // it must: an error only when offline would tell anyone the user's status. A
        // non-existent account is answered by the caller (§8.5.1).
        return;
    }
    if kind == "headline" {
        // §8.5.2.1.1: headlines go to every non-negative resource.
        for s in sessions
            .iter()
            .filter(|s| s.read(|p| p.available && p.priority >= 0))
        {
            s.send(el.clone());
        }
        return;
    }
    let n = targets.len();
    for (i, s) in targets.into_iter().enumerate() {
        if i + 1 == n {
            s.send(el);
            break;
        }
        s.send(el.clone());
    }
}

/// `<presence type='unavailable'/>` from `from` to `to`.
pub(crate) fn unavailable(from: &str, to: &str) -> Element {
    Element::new("presence", NS_CLIENT)
        .attr("type", "unavailable")
        .attr("from", from)
        .attr("to", to)
}

/// Sends `viewer` (local or remote, bare or full) an unavailable from each available
/// resource of local user `subject` that it had been shown, and forgets that it was
/// shown (RFC 6121 §3.2.2, §3.3.3, XEP-0191 §3.3). A resource the viewer was not shown (an
/// invisible one, one hidden by the settings or a block) sends nothing: an unavailable
/// from a full JID would itself reveal that the resource was online.
pub(crate) fn unavailable_from_shown(shared: &Shared, subject: &str, viewer: &str) {
    for s in shared.sessions.of_user_str(subject) {
        if !s.is_available() || !shared.privacy.forget(s.id, viewer) {
            continue;
        }
        presence_to(shared, viewer, unavailable(s.jid.as_str(), viewer));
    }
}

/// Returns a stanza that could not be sent to its local sender as an error (RFC 6120
/// §8.3.1). Presence is not bounced except subscription requests: a failed broadcast is
/// nothing the user can act on; a failed probe is remembered and repeated instead.
pub(crate) fn bounce_unroutable(shared: &Shared, el: &Element, err: StanzaError) {
    let ty = el.get_attr("type");
    if el.name == "presence" {
        if ty == Some("probe") {
            if let (Some(f), Some(t)) = (el.get_attr("from"), el.get_attr("to")) {
                shared
                    .s2s
                    .probe_failed(crate::jid::bare_of(f), crate::jid::bare_of(t));
            }
        }
        if ty != Some("subscribe") {
            return;
        }
    }
    bounce(shared, el, err);
}
