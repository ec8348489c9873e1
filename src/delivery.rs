//! Local delivery: the one way a stanza reaches sessions on this node, whatever produced it
//! (a local client over TCP or WebSocket, a remote server, the liveness sweeper, a roster
//! change made in SQL).
//!
//! Decisions are not made here but asked of the modules that own them: XEP-0191 blocks of
//! [`crate::blocking`] and the privacy gate of [`crate::presence::gate`]. What lives here is
//! where those questions are asked, so that no producer can skip them:
//!
//! - [`message`] and [`iq`]: a message or iq from anyone (local full JID or remote JID) to
//!   a local user, RFC 6121 §8.5 and RFC 6120 §10.5, with the recipient's block list and,
//!   for anything a client answers by itself, [`gate::may_reach_resource`];
//! - [`message_to_bare`]: RFC 6121 §8.5.2 (which resources take a message to a bare JID);
//! - [`to_available`] / [`xml_to_available`] / [`to_session`] / [`to_local`]: the transport
//!   of stanzas whose admission the caller already decided (presence the gate admitted,
//!   roster pushes, answers to a session's own request);
//! - [`bounce`]: the error reply to a stanza's sender, local or remote;
//! - [`unavailable_from_shown`]: the unavailable of each resource a viewer was shown.
//!
//! Nothing here knows the transport's session type: callers pass [`Shared`] and JIDs.
//!
//! Other nodes of the cluster ([`crate::cluster`]): every transport function here also
//! reaches the recipient's sessions on other nodes, after the decision was taken here, on
//! the node that produced the stanza. [`message`] and [`iq`] read the directory to find a
//! full JID or the RFC 6121 §8.5.2 targets of a bare JID wherever they are; a presence
//! broadcast is sent once per node ([`fan_out`]); [`from_node`] is where what another node
//! sent is handed to the sessions here, and decides nothing again.

use std::sync::Arc;

use crate::blocking::{inbound_from_blocked, Verdict};
use crate::cluster::{Envelope, Holder, Kind};
use crate::error::StanzaError;
use crate::jid::{BareJid, FullJid, Jid};
use crate::presence::gate;
use crate::server::Shared;
use crate::sessions::SessionHandle;
use crate::xml::{Element, NS_CLIENT};

/// What became of a message or iq handed to [`message`] or [`iq`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// A session took it.
    Delivered,
    /// Nothing took it and nothing is answered (RFC 6121 §8.5.2.2.1, XEP-0191 §3.3).
    Dropped,
    /// The sender was answered with an error ([`bounce`]).
    Bounced,
}

/// Queues a stanza on the session bound to `full`, if there is one. The caller decided
/// that the stanza may reach it.
/// On another node, it is sent there; `false` then means "not here".
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
/// §3.1.3). Returns how many sessions got it.
/// Resources on other nodes get it too; the count is of this node's.
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
/// that have sessions on another node.
pub(crate) async fn fan_out(
    shared: &Shared,
    once: &crate::xml::Addressed,
    recipients: Vec<String>,
) -> std::collections::HashSet<String> {
    if !shared.cluster.has_peers() || recipients.is_empty() {
        return Default::default();
    }
    let xml = Arc::new(once.unaddressed().to_owned());
    shared
        .cluster
        .forward_reaching(recipients, xml, Kind::Address)
        .await
}

/// What another node sent this one ([`crate::cluster::listen`]): the sending node took
/// every decision, so this only hands the stanza to the sessions here. A full JID gets its
/// session, a bare JID its available sessions; a `kick` ends the session bound to that full
/// JID, which a newer session on another node took over (RFC 6120 §7.7.2.2).
pub(crate) fn from_node(shared: &Shared, env: Envelope) {
    let addressed = (env.kind == Kind::Address)
        .then(|| crate::xml::Addressed::from_unaddressed(env.xml.to_string()));
    for to in &env.to {
        let Ok(jid) = Jid::new(to) else {
            tracing::warn!(%to, "cluster: malformed recipient dropped");
            continue;
        };
        let bytes = match &addressed {
            Some(a) => Arc::new(a.to(to)),
            None => Arc::clone(&env.xml),
        };
        match (env.kind, jid.try_into_full()) {
            (Kind::Kick, Ok(full)) => {
                if let Some(s) = shared.sessions.get(&full) {
                    tracing::info!(jid = %full, "resource bound on another node; closing here");
                    s.close(crate::error::StreamError::new(
                        "conflict",
                        "Replaced by a new session with the same resource",
                    ));
                }
            }
            (Kind::Kick | Kind::Join, _) => {}
            (_, Ok(full)) => {
                if let Some(s) = shared.sessions.get(&full) {
                    s.send_xml(bytes);
                }
            }
            (_, Err(bare)) => {
                xml_to_available(shared, bare.as_str(), || bytes.to_string());
            }
        }
    }
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
fn is_local(shared: &Shared, jid: &str) -> bool {
    let bare = gate::bare_of(jid);
    bare.contains('@') && shared.config.serves(crate::presence::domain_of(bare))
}

/// Sends a presence the caller's decision admitted to `to`: locally as [`to_local`], to
/// another domain over federation.
pub(crate) fn presence_to(shared: &Shared, to: &str, el: Element) {
    if is_local(shared, to) {
        to_local(shared, to, el);
    } else {
        let _ = crate::s2s::route_remote(shared, el);
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
        let _ = crate::s2s::route_remote(shared, reply);
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

/// XEP-0191 §3.3 on the recipient's side: whether local user `recipient` blocks `sender`.
/// `Pass` routes on; a rejected stanza has been answered already. One question for every
/// producer (c2s, s2s), asked before anything reaches the recipient.
pub(crate) async fn admit_from(
    shared: &Shared,
    sender: &str,
    recipient: &str,
    el: &Element,
) -> Verdict {
    if gate::bare_of(sender) == gate::bare_of(recipient) {
        // A user's own resources: nobody else's block list is involved.
        return Verdict::Pass;
    }
    match inbound_from_blocked(shared, sender, recipient, el).await {
        Verdict::Reject(reply) => {
            answer(shared, reply);
            Verdict::Drop
        }
        v => v,
    }
}

/// Sends a reply built elsewhere (already addressed) back to its recipient.
fn answer(shared: &Shared, reply: Element) {
    match reply.get_attr("to").map(str::to_owned) {
        Some(to) if is_local(shared, &to) => to_local(shared, &to, reply),
        Some(_) => {
            let _ = crate::s2s::route_remote(shared, reply);
        }
        None => {}
    }
}

/// Whether `bare` is an account here. A store failure counts as "no" (and is logged) so a
/// database outage degrades to errors for offline users, never a stalled session.
pub(crate) async fn account_exists(shared: &Shared, bare: &BareJid) -> bool {
    let node = bare.node().map(|n| n.as_str()).unwrap_or("");
    match shared
        .store
        .account_exists(node, bare.domain().as_str())
        .await
    {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(error = %e, "account lookup failed");
            false
        }
    }
}

/// A message from `sender` (a local full JID or a remote JID; its `from` is stamped) to
/// local user JID `to` (RFC 6121 §8.5), after the recipient's block list.
///
/// A `groupchat` message to a full JID is delivered only where the sender may know the
/// resource is online ([`gate::may_reach_resource`]); everyone else gets the
/// `service-unavailable` of a resource that does not exist (§8.5.3.2.1), online or not,
/// so the answer never tells them apart.
pub(crate) async fn message(shared: &Shared, sender: &str, to: Jid, el: Element) -> Outcome {
    if admit_from(shared, sender, to.as_str(), &el).await != Verdict::Pass {
        return Outcome::Dropped;
    }
    let kind = el.get_attr("type").unwrap_or("normal").to_owned();
    let bare = match to.try_into_full() {
        Ok(full) => match shared.sessions.get(&full) {
            Some(s) if kind != "groupchat" => {
                s.send(el);
                return Outcome::Delivered;
            }
            session if kind == "groupchat" => {
                // Decided the same way whether the resource is online or not (timing), and
                // for a resource on another node with what the directory says.
                let elsewhere = match &session {
                    Some(_) => None,
                    None => shared.cluster.holder_of(&full).await,
                };
                if let Some(h) = elsewhere {
                    if gate::may_reach_holder(shared, sender, &h).await {
                        shared
                            .cluster
                            .send(h.node(), vec![h.jid.clone()], Arc::new(el.to_xml()));
                        return Outcome::Delivered;
                    }
                } else if gate::may_reach(shared, sender, full.as_str(), session.as_ref()).await {
                    if let Some(s) = session {
                        s.send(el);
                        return Outcome::Delivered;
                    }
                }
                bounce(shared, &el, StanzaError::service_unavailable());
                return Outcome::Bounced;
            }
            _ => match shared.cluster.holder_of(&full).await {
                // Bound on another node.
                Some(h) => {
                    shared
                        .cluster
                        .send(h.node(), vec![h.jid.clone()], Arc::new(el.to_xml()));
                    return Outcome::Delivered;
                }
                // §8.5.3.2.1: a full JID with no session is treated as the bare JID.
                None => full.to_bare(),
            },
        },
        Err(bare) => bare,
    };
    if kind == "groupchat" {
        // §8.5.2.1.1: groupchat to a bare JID of a user is service-unavailable.
        bounce(shared, &el, StanzaError::service_unavailable());
        return Outcome::Bounced;
    }
    // One look at the registry (and, with other nodes, the directory) serves the
    // existence check and the delivery.
    let sessions = shared.sessions.of_user(&bare);
    let remote = shared
        .cluster
        .holders(&[bare.as_str()])
        .await
        .remove(bare.as_str())
        .unwrap_or_default();
    if matches!(kind.as_str(), "normal" | "chat")
        && targets_everywhere(&sessions, &remote, &kind).is_none()
        && !account_exists(shared, &bare).await
    {
        // RFC 6121 §8.5.1: no such account.
        bounce(shared, &el, StanzaError::service_unavailable());
        return Outcome::Bounced;
    }
    message_to_bare_everywhere(shared, &sessions, &remote, el, &kind);
    Outcome::Delivered
}

/// RFC 6121 §8.5.2 over the resources of one user on every node: this node's `local`
/// sessions and other nodes' `remote` ones. `None` when no resource takes the message.
fn targets_everywhere<'a>(
    local: &'a [SessionHandle],
    remote: &'a [Holder],
    kind: &str,
) -> Option<(Vec<&'a SessionHandle>, Vec<&'a Holder>)> {
    let local_prio = local
        .iter()
        .map(|s| s.read(|p| p.available.then_some(p.priority)));
    let remote_prio = remote
        .iter()
        .map(|h| h.entry.available.then_some(h.entry.priority));
    let chosen = if kind == "headline" {
        // §8.5.2.1.1: headlines go to every non-negative resource.
        let all: Vec<bool> = local_prio
            .chain(remote_prio)
            .map(|p| p.is_some_and(|p| p >= 0))
            .collect();
        all
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
    if kind == "error" {
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
fn message_to_bare_everywhere(
    shared: &Shared,
    sessions: &[SessionHandle],
    remote: &[Holder],
    el: Element,
    kind: &str,
) {
    // No target: no offline storage. §8.5.2.2.1 lets the server ignore the message
    // silently, and it must: an error only when offline would tell anyone the user's
    // status. A non-existent account is answered by the caller (§8.5.1).
    let Some((locals, remotes)) = targets_everywhere(sessions, remote, kind) else {
        return;
    };
    let mut per_node: std::collections::BTreeMap<&str, Vec<String>> = Default::default();
    for h in remotes {
        per_node.entry(h.node()).or_default().push(h.jid.clone());
    }
    if !per_node.is_empty() {
        let xml = Arc::new(el.to_xml());
        for (node, to) in per_node {
            shared.cluster.send(node, to, Arc::clone(&xml));
        }
    }
    for s in locals {
        s.send(el.clone());
    }
}

/// [`message_to_bare_everywhere`] with this node's sessions only (an error reply to a
/// local user's bare JID, which needs no directory read).
pub(crate) fn message_to_bare(sessions: &[SessionHandle], el: Element, kind: &str) {
    if let Some((locals, _)) = targets_everywhere(sessions, &[], kind) {
        for s in locals {
            s.send(el.clone());
        }
    }
}

/// An iq from `sender` (a local full JID or a remote JID; `from` stamped) to local full
/// JID `to`, after the recipient's block list (RFC 6120 §10.5.4). A request reaches the
/// resource only if the sender may know it is online ([`gate::may_reach_resource`]) or it
/// is the sender's own account; otherwise, and when there is no such session, the sender
/// gets the `service-unavailable` an offline resource gives. Results and errors reach the
/// session if there is one.
pub(crate) async fn iq(shared: &Shared, sender: &str, to: &FullJid, el: Element) -> Outcome {
    if admit_from(shared, sender, to.as_str(), &el).await != Verdict::Pass {
        return Outcome::Dropped;
    }
    let is_request = matches!(el.get_attr("type"), Some("get" | "set"));
    let own = gate::bare_of(sender) == to.to_bare().as_str();
    let session = shared.sessions.get(to);
    if session.is_none() {
        if let Some(h) = shared.cluster.holder_of(to).await {
            // Bound on another node: the same rules, with what the directory says.
            if !is_request || own || gate::may_reach_holder(shared, sender, &h).await {
                shared
                    .cluster
                    .send(h.node(), vec![h.jid.clone()], Arc::new(el.to_xml()));
                return Outcome::Delivered;
            }
            bounce(shared, &el, StanzaError::service_unavailable());
            return Outcome::Bounced;
        }
    }
    match session {
        Some(s) if !is_request || own => {
            s.send(el);
            Outcome::Delivered
        }
        None if !is_request => Outcome::Dropped,
        None if own => {
            bounce(shared, &el, StanzaError::service_unavailable());
            Outcome::Bounced
        }
        // A request from anyone else takes the same decision whether the resource is online
        // or not, so neither the answer nor its timing tells them apart.
        session => {
            if gate::may_reach(shared, sender, to.as_str(), session.as_ref()).await {
                if let Some(s) = session {
                    s.send(el);
                    return Outcome::Delivered;
                }
            }
            bounce(shared, &el, StanzaError::service_unavailable());
            Outcome::Bounced
        }
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

/// The unavailable of resource `jid`, whose session died with its node (RFC 6121 §4.5.2),
/// to the user's other resources and to the local contacts that may see it now.
///
/// What the session had been shown to died with the node; the viewers the privacy gate
/// admits now ([`gate::online_audience`]: approved subscribers that no block, setting or
/// lost subscription excludes) stand in for it, so a blocked or hidden contact learns
/// nothing; contacts on other nodes of the cluster get it there. Remote contacts are told by their own server when the federation link breaks.
pub(crate) async fn unavailable_of_lost(shared: &Shared, jid: &FullJid) {
    let bare = jid.to_bare();
    // Its directory entry goes too, once its node is no longer live.
    shared.cluster.forget_if_dead(jid);
    {
        let _guard = shared.privacy.lock_subject(bare.as_str()).await;
        for contact in gate::online_audience(shared, jid.as_str()).await {
            if is_local(shared, &contact) {
                to_available(shared, &contact, &unavailable(jid.as_str(), &contact));
            }
        }
    }
    shared.sessions.for_each_of(bare.as_str(), |s| {
        if s.is_available() {
            s.send(unavailable(jid.as_str(), s.jid.as_str()));
        }
    });
}
