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
//! - XEP-0280 carbon copies: the received copies inside [`message`], the sent copies of a
//!   client's own message in [`sent_copies`] (which messages, and their wrapper:
//!   [`crate::carbons`]);
//! - XEP-0160 offline messages: kept by [`message`] when no resource can take one, handed
//!   out by [`offline_messages`] (which messages: [`crate::offline`]);
//! - [`to_available`] / [`xml_to_available`] / [`to_session`] / [`to_local`]: the transport
//!   of stanzas whose admission the caller already decided (presence the gate admitted,
//!   roster pushes, answers to a session's own request);
//! - [`bounce`]: the error reply to a stanza's sender, local or remote;
//! - [`unavailable_from_shown`]: the unavailable of each resource a viewer was shown.
//!
//! Nothing here knows the transport's session type: callers pass [`Shared`] and JIDs.

use std::sync::Arc;

use crate::blocking::{inbound_from_blocked, Verdict};
use crate::carbons::{self, Direction};
use crate::error::StanzaError;
use crate::jid::{BareJid, FullJid, Jid};
use crate::presence::gate;
use crate::server::Shared;
use crate::sessions::{message_targets, SessionHandle};
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
    /// No resource could take it; it is kept for the user's next login (XEP-0160).
    Stored,
}

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
///
/// A message a resource takes is copied to the recipient's other carbons-enabled
/// resources ([`crate::carbons`], XEP-0280 §6); a chat or normal message no resource can
/// take is kept for the user's next login ([`store_offline`], XEP-0160).
pub(crate) async fn message(shared: &Shared, sender: &str, to: Jid, mut el: Element) -> Outcome {
    if admit_from(shared, sender, to.as_str(), &el).await != Verdict::Pass {
        return Outcome::Dropped;
    }
    let kind = el.get_attr("type").unwrap_or("normal").to_owned();
    // XEP-0280: decided on the message as sent, before §8 removes <private/> from it; a
    // user's own resources talking to each other are all parties already.
    let copies = carbons::eligible(&el) && gate::bare_of(sender) != gate::bare_of(to.as_str());
    carbons::strip_private(&mut el);
    let bare = match to.try_into_full() {
        Ok(full) => match shared.sessions.get(&full) {
            Some(s) if kind != "groupchat" => {
                if copies {
                    carbon_copies(shared, Direction::Received, &[s.id], &full.to_bare(), &el);
                }
                s.send(el);
                return Outcome::Delivered;
            }
            session if kind == "groupchat" => {
                // Decided the same way whether the resource is online or not (timing).
                if gate::may_reach(shared, sender, full.as_str(), session.as_ref()).await {
                    if let Some(s) = session {
                        s.send(el);
                        return Outcome::Delivered;
                    }
                }
                bounce(shared, &el, StanzaError::service_unavailable());
                return Outcome::Bounced;
            }
            // §8.5.3.2.1: a full JID with no session is treated as the bare JID.
            _ => full.to_bare(),
        },
        Err(bare) => bare,
    };
    if kind == "groupchat" {
        // §8.5.2.1.1: groupchat to a bare JID of a user is service-unavailable.
        bounce(shared, &el, StanzaError::service_unavailable());
        return Outcome::Bounced;
    }
    // One look at the registry serves the existence check and the delivery.
    let sessions = shared.sessions.of_user(&bare);
    if matches!(kind.as_str(), "normal" | "chat") && message_targets(&sessions).is_empty() {
        if !account_exists(shared, &bare).await {
            // RFC 6121 §8.5.1: no such account.
            bounce(shared, &el, StanzaError::service_unavailable());
            return Outcome::Bounced;
        }
        return store_offline(shared, sender, &bare, el).await;
    }
    let original = copies.then(|| el.clone());
    let reached = message_to_bare(&sessions, el, &kind);
    if let Some(original) = original.filter(|_| !reached.is_empty()) {
        carbon_copies(shared, Direction::Received, &reached, &bare, &original);
    }
    Outcome::Delivered
}

/// XEP-0280: a copy of `msg` (wrapped as `direction` says) for each carbons-enabled
/// resource of local user `user` other than the sessions in `skip`, which had the
/// original. The caller decided that `msg` is [`carbons::eligible`].
fn carbon_copies(
    shared: &Shared,
    direction: Direction,
    skip: &[u64],
    user: &BareJid,
    msg: &Element,
) {
    shared.sessions.for_each_of(user.as_str(), |s| {
        if !skip.contains(&s.id) && carbons::enabled(s) {
            s.send(carbons::wrap(direction, msg, user.as_str(), s.jid.as_str()));
        }
    });
}

/// XEP-0280 §7: the copies of a message that session `from` (of local user `user`) sent
/// to `to`, for the user's other carbons-enabled resources. The caller routes the
/// original; messages to the user's own account are not copied.
pub(crate) fn sent_copies(shared: &Shared, from: &SessionHandle, to: Option<&str>, msg: &Element) {
    let user = from.jid.to_bare();
    let to_self = to.is_none_or(|t| gate::bare_of(t) == user.as_str());
    if !to_self && carbons::eligible(msg) {
        carbon_copies(shared, Direction::Sent, &[from.id], &user, msg);
    }
}

/// XEP-0160: keeps a message for local user `owner`, who has no resource to take it, if
/// [`crate::offline::storable`] says so; beyond `[limits] max_offline_messages` the sender
/// gets `service-unavailable` (RFC 6121 §8.5.2.2.1). The rest is dropped silently as
/// §8.5.2.2.1 allows.
async fn store_offline(shared: &Shared, sender: &str, owner: &BareJid, el: Element) -> Outcome {
    if !crate::offline::storable(&el) {
        return Outcome::Dropped;
    }
    match shared
        .store
        .store_offline_message(owner.as_str(), sender, &el.to_xml())
        .await
    {
        Ok(true) => Outcome::Stored,
        Ok(false) => {
            tracing::info!(user = %owner, %sender, "offline storage full; message refused");
            bounce(
                shared,
                &el,
                StanzaError::service_unavailable().with_text("offline storage is full"),
            );
            Outcome::Bounced
        }
        Err(e) => {
            // Without the database the message is lost, as it was before storage existed;
            // the sender is not told (that would say the recipient is offline).
            tracing::warn!(user = %owner, error = %e, "offline message not stored");
            Outcome::Dropped
        }
    }
}

/// XEP-0160: hands the messages kept for `session`'s user to it, stamped with when they
/// were stored, when it becomes a resource that takes messages: initial presence with a
/// non-negative priority, or a negative priority raised (a negative one takes no
/// messages, RFC 6121 §8.5.2.1.1). A message whose sender the user has blocked
/// since is dropped: the same question [`admit_from`] asks of every delivery.
pub(crate) async fn offline_messages(shared: &Shared, session: &SessionHandle) {
    if session.read(|p| p.priority < 0) {
        return;
    }
    let bare = session.jid.to_bare();
    let kept = match shared.store.take_offline_messages(bare.as_str()).await {
        Ok(kept) => kept,
        Err(e) => {
            tracing::warn!(user = %bare, error = %e, "offline messages unavailable");
            return;
        }
    };
    for m in kept {
        let Some(el) = crate::xml::parse_element(&m.stanza) else {
            tracing::warn!(user = %bare, "unparseable stored message");
            continue;
        };
        if admit_from(shared, &m.sender, bare.as_str(), &el).await != Verdict::Pass {
            continue;
        }
        let domain = bare.domain().as_str();
        session.send(crate::offline::stamped(el, domain, m.stored_at));
    }
}

/// RFC 6121 §8.5.2: delivers a message of type `kind` (not groupchat, which the caller
/// answers) to the resources of a local bare JID, `sessions`. Returns the sessions that
/// took it.
pub(crate) fn message_to_bare(sessions: &[SessionHandle], el: Element, kind: &str) -> Vec<u64> {
    if kind == "error" {
        // Never answer an error; with no resource to take it, it is dropped (§8.5.2.2.1).
        if let Some(s) = message_targets(sessions).first() {
            s.send(el);
            return vec![s.id];
        }
        return Vec::new();
    }
    let targets = message_targets(sessions);
    if targets.is_empty() {
        // Kept for later by the caller when storable (XEP-0160); otherwise §8.5.2.2.1 lets
        // the server ignore it silently. A non-existent account is answered by the caller
        // (§8.5.1).
        return Vec::new();
    }
    if kind == "headline" {
        // §8.5.2.1.1: headlines go to every non-negative resource.
        let mut reached = Vec::new();
        for s in sessions
            .iter()
            .filter(|s| s.read(|p| p.available && p.priority >= 0))
        {
            s.send(el.clone());
            reached.push(s.id);
        }
        return reached;
    }
    let reached = targets.iter().map(|s| s.id).collect();
    let n = targets.len();
    for (i, s) in targets.into_iter().enumerate() {
        if i + 1 == n {
            s.send(el);
            break;
        }
        s.send(el.clone());
    }
    reached
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
/// nothing. Remote contacts are told by their own server when the federation link breaks.
pub(crate) async fn unavailable_of_lost(shared: &Shared, jid: &FullJid) {
    let bare = jid.to_bare();
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
