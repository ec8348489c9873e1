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

use crate::blocking::{inbound_from_blocked, Verdict};
use crate::error::StanzaError;
use crate::jid::{BareJid, FullJid, Jid};
use crate::node::send::{answer, is_local};
pub(crate) use crate::node::send::{bounce, message_to_bare, to_available, to_local, unavailable};
use crate::node::Shared;
use crate::presence::gate;
use crate::sessions::message_targets;
use crate::xml::Element;

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
    if matches!(kind.as_str(), "normal" | "chat")
        && message_targets(&sessions).is_empty()
        && !account_exists(shared, &bare).await
    {
        // RFC 6121 §8.5.1: no such account.
        bounce(shared, &el, StanzaError::service_unavailable());
        return Outcome::Bounced;
    }
    message_to_bare(&sessions, el, &kind);
    Outcome::Delivered
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
