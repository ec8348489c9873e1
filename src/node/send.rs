//! Sending what was already decided: the transport of stanzas to local sessions (and, for
//! a presence or an error, to another server) once the caller's question (the privacy
//! gate, a block list, a session's own request) was answered. The decisions themselves,
//! and the deliveries that must ask them, are in `delivery`.
//!
//! Other nodes of the cluster ([`crate::cluster`]) are reached from here too: a stanza for
//! a local JID whose sessions are (also) on another node is sent there once per node, after
//! the decision was taken on this one.

use std::sync::Arc;

use crate::cluster::{Holder, Kind};
use crate::error::StanzaError;
use crate::jid::{FullJid, Jid};
use crate::sessions::SessionHandle;
use crate::stanza::{MessageType, PresenceType};
use crate::xml::{Element, NS_CLIENT};

use super::Shared;

/// Queues a stanza on the session bound to `full`, if there is one. The caller decided
/// that the stanza may reach it. On another node, it is sent there; `false` then means
/// "not here".
pub(crate) fn to_session(shared: &Shared, full: &FullJid, el: Element) -> bool {
    if let Some(s) = shared.sessions.get(full) {
        return s.send(el);
    }
    shared
        .cluster
        .forward(vec![full.to_string()], Arc::new(el.to_xml()), Kind::Deliver);
    false
}

/// Delivers `el` to every available resource of local user `bare` (RFC 6121 §4.2.3,
/// §3.1.3), on this node and on the others. Returns how many sessions here got it.
pub(crate) fn to_available(shared: &Shared, bare: &str, el: &Element) -> usize {
    let xml = std::cell::LazyCell::new(|| Arc::new(el.to_xml()));
    let n = xml_to_available(shared, bare, || xml.to_string());
    if shared.cluster.has_peers() {
        shared
            .cluster
            .forward(vec![bare.to_owned()], Arc::clone(&xml), Kind::Deliver);
    }
    n
}

/// Sends a presence broadcast, serialised once without `to` (`once`), to the available
/// resources of `recipients` (local bare JIDs) on other nodes: one message per node that
/// holds any of them, each copy addressed to its recipient there. Returns the recipients
/// that have sessions on another node. `initial`: the session's initial presence, whose
/// recipients are looked up in Redis rather than this node's copy of the directory
/// ([`crate::cluster::Cluster::forward_reaching`]).
pub(crate) async fn fan_out(
    shared: &Shared,
    once: &crate::xml::Addressed,
    recipients: Vec<String>,
    initial: bool,
) -> std::collections::HashSet<String> {
    if !shared.cluster.has_peers() || recipients.is_empty() {
        return Default::default();
    }
    let xml = Arc::new(once.unaddressed().to_owned());
    shared
        .cluster
        .forward_reaching(recipients, xml, Kind::Address, initial)
        .await
}

/// Delivers a serialised stanza to every available resource of local user `bare` on this
/// node: `xml` runs
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
    match crate::jid::parse(to).map(Jid::try_into_full) {
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
    let Some(to) = reply.get_attr("to").and_then(|t| crate::jid::parse(t).ok()) else {
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
            // RFC 6121 §8.5.2 over the user's resources on every node: the directory read
            // is awaited off the caller's path (a bounce is answered from sync code).
            let sessions = shared.sessions.of_user(&bare);
            if !shared.cluster.has_peers() {
                message_to_bare_everywhere(
                    &shared.cluster,
                    &sessions,
                    &[],
                    reply,
                    MessageType::Error,
                );
                return;
            }
            let cluster = shared.cluster.clone();
            tokio::spawn(async move {
                let remote = cluster
                    .holders(&[bare.as_str()])
                    .await
                    .remove(bare.as_str())
                    .unwrap_or_default();
                message_to_bare_everywhere(&cluster, &sessions, &remote, reply, MessageType::Error);
            });
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

/// RFC 6121 §8.5.2 over the resources of one user on every node: this node's `local`
/// sessions and other nodes' `remote` ones. `None` when no resource takes the message.
pub(crate) fn targets_everywhere<'a>(
    local: &'a [SessionHandle],
    remote: &'a [Holder],
    kind: MessageType,
) -> Option<(Vec<&'a SessionHandle>, Vec<&'a Holder>)> {
    let local_prio = local
        .iter()
        .map(|s| s.read(|p| p.available.then_some(p.priority)));
    let remote_prio = remote
        .iter()
        .map(|h| h.entry.available.then_some(h.entry.priority));
    let chosen: Vec<bool> = if kind == MessageType::Headline {
        // §8.5.2.1.1: headlines go to every non-negative resource.
        local_prio
            .chain(remote_prio)
            .map(|p| p.is_some_and(|p| p >= 0))
            .collect()
    } else {
        crate::sessions::highest_priority(local_prio.chain(remote_prio))
    };
    if !chosen.iter().any(|&c| c) {
        return None;
    }
    let (l, r) = chosen.split_at(local.len());
    let mut locals: Vec<&SessionHandle> = local
        .iter()
        .zip(l)
        .filter(|(_, &c)| c)
        .map(|(s, _)| s)
        .collect();
    let mut remotes: Vec<&Holder> = remote
        .iter()
        .zip(r)
        .filter(|(_, &c)| c)
        .map(|(h, _)| h)
        .collect();
    if kind == MessageType::Error {
        // Never answer an error; one resource takes it (§8.5.2.2.1), this node's first.
        if locals.is_empty() {
            remotes.truncate(1);
        } else {
            locals.truncate(1);
            remotes.clear();
        }
    }
    Some((locals, remotes))
}

/// RFC 6121 §8.5.2: delivers a message of type `kind` (not groupchat, which the caller
/// answers) to the resources of a local bare JID: `sessions` here, `remote` on other
/// nodes (sent there as one message per node, addressed to the bare JID as it came).
/// Returns what took it: this node's sessions and the full JIDs on other nodes (for
/// XEP-0280 copies to the others).
pub(crate) fn message_to_bare_everywhere(
    cluster: &crate::cluster::Cluster,
    sessions: &[SessionHandle],
    remote: &[Holder],
    el: Element,
    kind: MessageType,
) -> (Vec<u64>, Vec<String>) {
    // No target: the caller keeps a storable message for later (XEP-0160); otherwise
    // §8.5.2.2.1 lets the server ignore it silently. A non-existent account is answered by
    // the caller (§8.5.1).
    let Some((locals, remotes)) = targets_everywhere(sessions, remote, kind) else {
        return Default::default();
    };
    let mut per_node: std::collections::BTreeMap<&str, Vec<String>> = Default::default();
    for h in &remotes {
        per_node.entry(h.node()).or_default().push(h.jid.clone());
    }
    if !per_node.is_empty() {
        let xml = Arc::new(el.to_xml());
        for (node, to) in per_node {
            cluster.send(node, to, Arc::clone(&xml));
        }
    }
    let here = locals
        .into_iter()
        .map(|s| {
            s.send(el.clone());
            s.id
        })
        .collect();
    (here, remotes.into_iter().map(|h| h.jid.clone()).collect())
}

/// `<presence type='unavailable'/>` from `from` to `to`.
pub(crate) fn unavailable(from: &str, to: &str) -> Element {
    Element::new("presence", NS_CLIENT)
        .attr("type", PresenceType::Unavailable.name())
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
        if !s.is_available() || !s.forget(viewer) {
            continue;
        }
        presence_to(shared, viewer, unavailable(s.jid.as_str(), viewer));
    }
}

/// Returns a stanza that could not be sent to its local sender as an error (RFC 6120
/// §8.3.1). Presence is not bounced except subscription requests: a failed broadcast is
/// nothing the user can act on; a failed probe is remembered and repeated instead.
pub(crate) fn bounce_unroutable(shared: &Shared, el: &Element, err: StanzaError) {
    if el.name == "presence" {
        let ty = PresenceType::of(el);
        if ty == Some(PresenceType::Probe) {
            if let (Some(f), Some(t)) = (el.get_attr("from"), el.get_attr("to")) {
                shared
                    .s2s
                    .probe_failed(crate::jid::bare_of(f), crate::jid::bare_of(t));
            }
        }
        if ty != Some(PresenceType::Subscribe) {
            return;
        }
    }
    bounce(shared, el, err);
}
