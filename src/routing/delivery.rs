//! Local delivery: the one way a stanza reaches sessions on this node, whatever produced it
//! (a local client over TCP or WebSocket, a remote server, the liveness sweeper, a roster
//! change made in SQL).
//!
//! Decisions are not made here but asked of the modules that own them: XEP-0191 blocks of
//! [`crate::services::blocking`] and the privacy gate of [`crate::services::presence::gate`]. What lives here is
//! where those questions are asked, so that no producer can skip them:
//!
//! - [`message`] and [`iq`]: a message or iq from anyone (local full JID or remote JID) to
//!   a local user, RFC 6121 §8.5 and RFC 6120 §10.5, with the recipient's block list and,
//!   for anything a client answers by itself, [`gate::may_reach_resource`];
//! - [`message_to_bare_everywhere`]: RFC 6121 §8.5.2 (which resources take a message to a
//!   bare JID, on every node);
//! - XEP-0280 carbon copies: the received copies inside [`message`], the sent copies of a
//!   client's own message in [`sent_copies`] (which messages, and their wrapper:
//!   [`crate::services::carbons`]);
//! - XEP-0160 offline messages: kept by [`message`] when no resource can take one, handed
//!   out by [`offline_messages`] (which messages: [`crate::services::offline`]);
//! - [`crate::node::outbox`]: the transport of stanzas whose admission the caller already
//!   decided (presence the gate admitted, roster pushes, answers to a session's own
//!   request), and of what is decided here;
//! - [`bounce`]: the error reply to a stanza's sender, local or remote;
//! - [`unavailable_from_shown`]: the unavailable of each resource a viewer was shown.
//!
//! Nothing here knows the transport's session type: callers pass [`Presence`] (the privacy
//! gate, and the parts of the node delivery reaches: store, sessions, cluster, outbox)
//! and JIDs.
//!
//! Other nodes of the cluster ([`crate::cluster`]): every transport function here also
//! reaches the recipient's sessions on other nodes, after the decision was taken here, on
//! the node that produced the stanza. [`message`] and [`iq`] read the directory to find a
//! full JID or the RFC 6121 §8.5.2 targets of a bare JID wherever they are; a presence
//! broadcast is sent once per node ([`outbox::Outbox::fan_out`]); [`from_node`] is where what
//! another node sent is handed to the sessions here, and decides nothing again, with two
//! exceptions that need what only the holding node knows: a request (or groupchat message)
//! to a full JID the directory does not admit the sender to, which may have revealed itself to
//! the sender by directed presence ([`Kind::Decide`], decided here by the same
//! [`gate::may_reach`]), and the record that another node showed a session's presence to a
//! viewer from the directory ([`Kind::Reveal`]), kept here so a later block withdraws it.
//! A message kept offline on one node while the user's session on another became available
//! is handed over by that node's own take of kept messages ([`Kind::Collect`]).
//! XEP-0280 copies reach resources on other nodes from the directory's carbons flag.

use crate::cluster::{Envelope, Holder, Kind};
use crate::node::outbox::{self, targets_everywhere, Elsewhere};
pub(crate) use crate::node::outbox::{message_to_bare_everywhere, unavailable};
use crate::node::sessions::SessionHandle;
use crate::protocol::error::{StanzaError, StreamCondition};
use crate::protocol::jid::{BareJid, FullJid, Jid};
use crate::protocol::stanza::{IqType, MessageType};
use crate::protocol::xml::Element;
use crate::services::blocking::{inbound_from_blocked, Verdict};
use crate::services::carbons::{self, Direction};
use crate::services::presence::gate;
use crate::services::presence::Presence;
use std::sync::Arc;

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

/// What another node sent this one ([`crate::cluster::listen`]): the sending node took
/// every decision, so this only hands the stanza to the sessions here. A full JID gets its
/// session, a bare JID its available sessions; a `kick` ends the session bound to that full
/// JID, which a newer session on another node took over (RFC 6120 §7.7.2.2). The two
/// exceptions, `reveal` and `decide`, need the session's own state and run as tasks.
pub(crate) fn from_node(presence: &Arc<Presence>, pep: &crate::services::pep::Pep, env: Envelope) {
    match env.kind {
        Kind::Notify => {
            crate::services::pep::from_node(pep, &env.to, &env.xml);
            return;
        }
        Kind::Reveal => {
            let presence = Arc::clone(presence);
            tokio::spawn(async move { revealed_elsewhere(&presence, env).await });
            return;
        }
        Kind::Decide => {
            let presence = Arc::clone(presence);
            tokio::spawn(async move { decide_here(&presence, env).await });
            return;
        }
        Kind::Collect => {
            let presence = Arc::clone(presence);
            tokio::spawn(async move {
                for to in &env.to {
                    match crate::protocol::jid::parse_bare(to) {
                        Ok(owner) => {
                            hand_kept_to_a_taker_here(&presence, &owner).await;
                        }
                        Err(_) => tracing::warn!(%to, "cluster: malformed collect dropped"),
                    }
                }
            });
            return;
        }
        Kind::Seen => {
            let at = env
                .xml
                .parse()
                .ok()
                .and_then(chrono::DateTime::from_timestamp_millis);
            if let Some(at) = at {
                for bare in &env.to {
                    let Ok(jid) = crate::protocol::jid::parse_bare(bare) else {
                        tracing::warn!(%bare, "cluster: malformed last seen dropped");
                        continue;
                    };
                    let seen = crate::store::LastSeen {
                        jid,
                        at,
                        status: None,
                    };
                    presence.liveness.last_seen.note_elsewhere(seen);
                }
            }
            return;
        }
        _ => {}
    }
    let addressed = (env.kind == Kind::Address)
        .then(|| crate::protocol::xml::Addressed::from_unaddressed(env.xml.to_string()));
    for to in &env.to {
        let Ok(jid) = crate::protocol::jid::parse(to) else {
            tracing::warn!(%to, "cluster: malformed recipient dropped");
            continue;
        };
        let bytes = match &addressed {
            Some(a) => Arc::new(a.to(to)),
            None => Arc::clone(&env.xml),
        };
        match (env.kind, jid.try_into_full()) {
            (Kind::Kick, Ok(full)) => {
                if let Some(s) = presence.sessions.get(&full) {
                    tracing::info!(jid = %full, "resource bound on another node; closing here");
                    s.close(crate::protocol::error::StreamError::new(
                        StreamCondition::Conflict,
                        "Replaced by a new session with the same resource",
                    ));
                }
            }
            (_, _) if env.kind != Kind::Deliver && env.kind != Kind::Address => {}
            (_, Ok(full)) => {
                if let Some(s) = presence.sessions.get(&full) {
                    outbox::to_handle(&s, bytes);
                }
            }
            (_, Err(bare)) => {
                presence.outbox.xml_to_available(bare.as_str(), || bytes);
            }
        }
    }
}

/// [`Kind::Reveal`]: another node showed the presence of sessions here (`env.to`) to the
/// viewer in `env.xml`, from the directory. Under the subject's lock, as a probe answer
/// here would be, the gate's audience (from its cache, as a broadcast reads it) is asked
/// again: a viewer still admitted is recorded as shown, so a later block or privacy change
/// withdraws it here; one no longer admitted (a change reconciled here before this record
/// arrived), or one the session's full record cannot take, gets the unavailable at once.
///
/// A session that is no longer available, or has ended, sends the viewer its unavailable
/// too: the directory row the other node read may predate the session's unavailable, whose
/// broadcast can have missed the viewer (this node's copy of the viewer's row, read before
/// the invalidation of the viewer's login arrived, showed it offline). This record comes
/// after that invalidation on the same channel, so no later broadcast misses it. Not when
/// the full JID is held again, here or on another node: that successor's presence is the
/// resource's now. A viewer the broadcast did reach gets a second unavailable for a
/// resource it already shows offline, which changes nothing for it.
async fn revealed_elsewhere(presence: &Presence, env: Envelope) {
    let viewer = env.xml.as_str();
    let Ok(viewer_jid) = crate::protocol::jid::parse(viewer) else {
        tracing::warn!("cluster: reveal with a malformed viewer dropped");
        return;
    };
    for to in &env.to {
        let Ok(full) = crate::protocol::jid::parse_full(to) else {
            continue;
        };
        let subject = full.to_bare();
        let _guard = presence.subject_locks.lock_subject(subject.as_str()).await;
        let Some(s) = presence.sessions.get(&full) else {
            let held_elsewhere = presence
                .cluster
                .holder_of(&full)
                .await
                .is_some_and(|h| h.entry.available);
            if !held_elsewhere {
                tracing::info!(jid = %full, viewer, "presence shown by another node after the session ended: unavailable sent");
                presence.outbox.presence_to(viewer, unavailable(to, viewer));
            }
            continue;
        };
        if s.was_revealed(viewer) {
            continue;
        }
        if !s.is_available() {
            tracing::info!(jid = %s.jid, viewer, "presence shown by another node after the session went unavailable: unavailable sent");
            presence.outbox.presence_to(viewer, unavailable(to, viewer));
            continue;
        }
        let admitted = !s.is_invisible() && {
            let inputs = gate::session_inputs(presence, &s, true).await;
            let admitted = gate::audience(&subject, &inputs).any(|c| **c == viewer_jid);
            admitted
        };
        if admitted && s.reveal(viewer, crate::policy::privacy::Relation::Subscriber) {
            continue;
        }
        tracing::info!(jid = %s.jid, viewer, admitted, "presence shown by another node withdrawn");
        presence
            .outbox
            .presence_to(viewer, unavailable(s.jid.as_str(), viewer));
    }
}

/// [`Kind::Decide`]: a request or groupchat message for a full JID bound here, from the
/// sender in its `from`, that the sending node could not admit from the directory. The
/// sending node asked the recipient's block list; here the gate decides with the session
/// itself ([`gate::may_reach`]: its directed presence, visibility, availability), and a
/// refusal is the `service-unavailable` of a resource that does not exist (RFC 6121
/// §8.5.3.2.1, RFC 6120 §10.5.4), as on one node.
async fn decide_here(presence: &Presence, env: Envelope) {
    let (Some(to), Some(el)) = (
        env.to
            .first()
            .and_then(|t| crate::protocol::jid::parse_full(t).ok()),
        crate::protocol::xml::parse_element(&env.xml),
    ) else {
        tracing::warn!("cluster: malformed decide message dropped");
        return;
    };
    // The sending node stamped the sender; one that is no JID reaches nobody.
    let Some(sender) = el
        .get_attr("from")
        .and_then(|f| crate::protocol::jid::parse(f).ok())
    else {
        return;
    };
    let session = presence.sessions.get(&to);
    if gate::may_reach(presence, &sender, &to, session.as_ref()).await {
        if let Some(s) = session {
            outbox::to_handle(&s, el);
            return;
        }
    }
    presence
        .outbox
        .bounce(&el, StanzaError::service_unavailable());
}

/// The sessions of local user `bare` on other nodes (empty without any).
async fn elsewhere(presence: &Presence, bare: &BareJid) -> Vec<Holder> {
    presence
        .cluster
        .holders(&[bare.as_str()])
        .await
        .remove(bare.as_str())
        .unwrap_or_default()
}

/// XEP-0191 §3.3 on the recipient's side: whether local user `recipient` blocks `sender`.
/// `Pass` routes on; a rejected stanza has been answered already. One question for every
/// producer (c2s, s2s), asked before anything reaches the recipient.
pub(crate) async fn admit_from(
    presence: &Presence,
    sender: &str,
    recipient: &str,
    el: &Element,
) -> Verdict {
    if gate::bare_of(sender) == gate::bare_of(recipient) {
        // A user's own resources: nobody else's block list is involved.
        return Verdict::Pass;
    }
    match inbound_from_blocked(&presence.store, sender, recipient, el).await {
        Verdict::Reject(reply) => {
            presence.outbox.answer(reply);
            Verdict::Drop
        }
        v => v,
    }
}

/// Whether `bare` is an account here. A store failure counts as "no" (and is logged) so a
/// database outage degrades to errors for offline users, never a stalled session.
pub(crate) async fn account_exists(presence: &Presence, bare: &BareJid) -> bool {
    let node = bare.node().map(|n| n.as_str()).unwrap_or("");
    match presence
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
/// resources ([`crate::services::carbons`], XEP-0280 §6); a chat or normal message no resource can
/// take is kept for the user's next login ([`store_offline`], XEP-0160).
pub(crate) async fn message(presence: &Presence, from: &Jid, to: Jid, mut el: Element) -> Outcome {
    let sender = from.as_str();
    if admit_from(presence, sender, to.as_str(), &el).await != Verdict::Pass {
        return Outcome::Dropped;
    }
    let kind = MessageType::of(&el);
    let own = gate::bare_of(sender) == gate::bare_of(to.as_str());
    if !own {
        // XEP-0280 §11: carbons come only from the user's own account; anyone else's
        // wrapper is a forgery, removed before anything is decided or kept.
        carbons::strip_wrappers(&mut el);
    }
    // XEP-0280: decided on the message as sent, before §8 removes <private/> from it; a
    // user's own resources talking to each other are all parties already.
    let copies = carbons::eligible(&el) && !own;
    carbons::strip_private(&mut el);
    let bare = match to.try_into_full() {
        Ok(full) => {
            let bare = full.to_bare();
            let session = presence.sessions.get(&full);
            // The user's sessions on other nodes: where the full JID may be bound, and
            // who else takes a copy. Read once; nothing without another node.
            let remote = if session.is_none() || (copies && kind != MessageType::Groupchat) {
                elsewhere(presence, &bare).await
            } else {
                Vec::new()
            };
            let there = remote.iter().find(|h| h.jid == full.as_str());
            match session {
                Some(s) if kind != MessageType::Groupchat => {
                    if copies {
                        carbon_copies(
                            presence,
                            Direction::Received,
                            (&[s.id], &[]),
                            &bare,
                            &el,
                            &remote,
                        )
                        .await;
                    }
                    outbox::to_handle(&s, el);
                    return Outcome::Delivered;
                }
                session if kind == MessageType::Groupchat => {
                    // Decided the same way whether the resource is online or not (timing), and
                    // for a resource on another node with what the directory says; what only
                    // that node knows (directed presence) is decided there.
                    if let Some(h) = there {
                        let xml = Arc::new(el.to_xml());
                        if gate::may_reach_holder(presence, from, h).await {
                            outbox::to_holder(&presence.cluster, h, xml);
                        } else {
                            outbox::decide_there(&presence.cluster, h, xml);
                        }
                        return Outcome::Delivered;
                    } else if gate::may_reach(presence, from, &full, session.as_ref()).await {
                        if let Some(s) = session {
                            outbox::to_handle(&s, el);
                            return Outcome::Delivered;
                        }
                    }
                    presence
                        .outbox
                        .bounce(&el, StanzaError::service_unavailable());
                    return Outcome::Bounced;
                }
                _ => match there {
                    // Bound on another node.
                    Some(h) => {
                        if copies {
                            carbon_copies(
                                presence,
                                Direction::Received,
                                (&[], &[h.jid.as_str()]),
                                &bare,
                                &el,
                                &remote,
                            )
                            .await;
                        }
                        outbox::to_holder(&presence.cluster, h, Arc::new(el.to_xml()));
                        return Outcome::Delivered;
                    }
                    // §8.5.3.2.1: a full JID with no session is treated as the bare JID.
                    None => bare,
                },
            }
        }
        Err(bare) => bare,
    };
    message_to_bare(presence, sender, bare, el, kind, copies).await
}

/// The rest of [`message`] for a message to local user `bare` (§8.5.2, or a full JID with
/// no session, §8.5.3.2.1): delivered to the resources that take it, with carbons, or kept
/// offline. `copies`: whether the message as sent was eligible for carbons.
async fn message_to_bare(
    presence: &Presence,
    sender: &str,
    bare: BareJid,
    el: Element,
    kind: MessageType,
    copies: bool,
) -> Outcome {
    if kind == MessageType::Groupchat {
        // §8.5.2.1.1: groupchat to a bare JID of a user is service-unavailable.
        presence
            .outbox
            .bounce(&el, StanzaError::service_unavailable());
        return Outcome::Bounced;
    }
    // One look at the registry (and, with other nodes, the directory) serves the
    // existence check and the delivery.
    let (sessions, remote) = resources_everywhere(presence, &bare).await;
    if kind.is_chat_or_normal() && targets_everywhere(&sessions, &remote, kind).is_none() {
        if !account_exists(presence, &bare).await {
            // RFC 6121 §8.5.1 lets the server silently ignore a message to an account that
            // does not exist; an error would tell anyone which accounts exist, since an
            // existing one answers strangers nothing (crate::services::offline, "What a sender is
            // told").
            tracing::debug!(to = %bare, %sender, "message to no account dropped");
            return Outcome::Dropped;
        }
        // No resource on any node takes it: kept for the next login (XEP-0160).
        return store_offline(presence, sender, &bare, el).await;
    }
    let original = copies.then(|| el.clone());
    let (here, there) = message_to_bare_everywhere(&presence.cluster, &sessions, &remote, el, kind);
    // XEP-0280 copies go to the user's other resources that enabled carbons, on any node.
    if let Some(original) = original.filter(|_| !here.is_empty() || !there.is_empty()) {
        let there: Vec<&str> = there.iter().map(String::as_str).collect();
        carbon_copies(
            presence,
            Direction::Received,
            (&here, &there),
            &bare,
            &original,
            &remote,
        )
        .await;
    }
    Outcome::Delivered
}

/// The sessions of local user `bare` on this node and those other nodes hold.
async fn resources_everywhere(
    presence: &Presence,
    bare: &BareJid,
) -> (Vec<SessionHandle>, Vec<crate::cluster::Holder>) {
    (
        presence.sessions.of_user(bare),
        elsewhere(presence, bare).await,
    )
}

/// XEP-0280: a copy of `msg` (wrapped as `direction` says) for each carbons-enabled
/// resource of local user `user` other than those in `skip` (this node's sessions, and full
/// JIDs on other nodes), which had the original: this node's sessions, and `remote`, the
/// user's sessions on other nodes, whose directory entries say whether they enabled
/// carbons. The caller decided that `msg` is [`carbons::eligible`].
async fn carbon_copies(
    presence: &Presence,
    direction: Direction,
    skip: (&[u64], &[&str]),
    user: &BareJid,
    msg: &Element,
    remote: &[Holder],
) {
    outbox::to_interested(
        &presence.sessions,
        &presence.cluster,
        user.as_str(),
        Elsewhere::Known(remote),
        |s| !skip.0.contains(&s.id) && carbons::enabled(s),
        |h| h.entry.carbons && !skip.1.contains(&h.jid.as_str()),
        |jid| carbons::wrap(direction, msg, user.as_str(), jid),
    )
    .await;
}

/// XEP-0280 §7: the copies of a message that session `from` (of local user `user`) sent
/// to `to`, for the user's other carbons-enabled resources on every node. The caller
/// routes the original; messages to the user's own account are not copied.
pub(crate) async fn sent_copies(
    presence: &Presence,
    from: &SessionHandle,
    to: Option<&str>,
    msg: &Element,
) {
    let user = from.jid.to_bare();
    let to_self = to.is_none_or(|t| gate::bare_of(t) == user.as_str());
    if !to_self && carbons::eligible(msg) {
        let remote = elsewhere(presence, &user).await;
        carbon_copies(
            presence,
            Direction::Sent,
            (&[from.id], &[]),
            &user,
            msg,
            &remote,
        )
        .await;
    }
}

/// XEP-0160: keeps a message for local user `owner`, who has no resource to take it, if
/// [`crate::services::offline::storable`] says so and it fits the owner's budget (the store's
/// [`crate::store::offline::make_room`]); the rest is dropped silently as RFC 6121
/// §8.5.2.2.1 allows. Every producer reaches it the same way: a local client, a remote
/// server and another cluster node's message through [`message`] on the node it arrived
/// at, a XEP-0198 session's unacknowledged messages through [`unacked`].
///
/// A message that is not kept for lack of room is answered `service-unavailable`
/// (§8.5.2.2.1) only to a sender the privacy gate lets see the owner's online status
/// ([`gate::may_see_online`]); anyone else, strangers first, is answered nothing, as a user
/// who is online answers nothing (the rule and why: [`crate::services::offline`]).
async fn store_offline(presence: &Presence, sender: &str, owner: &BareJid, el: Element) -> Outcome {
    let sender_bare = gate::bare_of(sender);
    let own = sender_bare == owner.as_str();
    let item = if own {
        None
    } else {
        match presence
            .store
            .roster_item(owner.as_str(), sender_bare)
            .await
        {
            Ok(item) => item.map(|i| i.subscription),
            Err(e) => {
                // Fails towards the stranger's smaller share and silence.
                tracing::warn!(user = %owner, error = %e, "roster unavailable for offline storage");
                None
            }
        }
    };
    let from_contact = crate::services::offline::is_contact(own, item);
    if !crate::services::offline::storable(&el, from_contact) {
        return Outcome::Dropped;
    }
    match presence
        .store
        .store_offline_message(owner.as_str(), sender, &el.to_xml(), from_contact)
        .await
    {
        Ok(true) => {
            // Finding no resource and storing are not one step with a resource becoming
            // one that takes messages, which records that and then takes what is kept
            // (the router, after initial presence). A message stored after that take
            // would wait for the next login while its recipient is online, so look again
            // now it is stored: a resource here that takes messages by now gets it from
            // the store (XEP-0160: kept messages go to the user once available; the store
            // hands each one out once, whichever take comes first).
            if !hand_kept_to_a_taker_here(presence, owner).await {
                // The same race with a session on another node: every node holding one of
                // the user's sessions (available or not, as the directory said a moment
                // ago) looks there. A session that became available after this lookup
                // saw the stored message in its own take.
                let mut nodes: Vec<String> = elsewhere(presence, owner)
                    .await
                    .iter()
                    .map(|h| h.node().to_owned())
                    .collect();
                nodes.sort_unstable();
                nodes.dedup();
                for node in nodes {
                    presence.cluster.collect_there(&node, owner.as_str());
                }
                // XEP-0357: nobody here took it; the user's sleeping clients are woken.
                if let Some(trigger) = crate::services::push::Trigger::of(&el) {
                    presence.push.kept_for(owner, &trigger).await;
                }
            }
            Outcome::Stored
        }
        Ok(false) => {
            let told = from_contact
                && match crate::protocol::jid::parse(sender) {
                    Ok(from) => {
                        gate::may_see_online(presence, &from, &owner.clone().into(), false).await
                    }
                    Err(_) => false,
                };
            tracing::info!(user = %owner, %sender, from_contact, told,
                "offline storage: no room for the sender's message; not kept");
            if !told {
                return Outcome::Dropped;
            }
            presence.outbox.bounce(
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

/// Hands `owner`'s kept messages to a session on this node that takes messages, if one
/// does; whether one did.
async fn hand_kept_to_a_taker_here(presence: &Presence, owner: &BareJid) -> bool {
    match presence
        .sessions
        .of_user(owner)
        .into_iter()
        .find(takes_messages)
    {
        Some(s) => {
            offline_messages(presence, &s).await;
            true
        }
        None => false,
    }
}

/// Whether a resource takes messages to its bare JID (RFC 6121 §8.5.2.1.1: available,
/// with a non-negative priority).
pub(crate) fn takes_messages(session: &SessionHandle) -> bool {
    session.read(|p| p.available && p.priority >= 0)
}

/// XEP-0160: hands the messages kept for `session`'s user to it, stamped with when they
/// were stored. The caller calls it when the session becomes a resource that takes
/// messages: initial presence with a non-negative priority, or a negative priority raised
/// (a negative one takes none, RFC 6121 §8.5.2.1.1). A message whose sender the user has blocked
/// since is dropped: the same question [`admit_from`] asks of every delivery.
pub(crate) async fn offline_messages(presence: &Presence, session: &SessionHandle) {
    let bare = session.jid.to_bare();
    let kept = match presence.store.take_offline_messages(bare.as_str()).await {
        Ok(kept) => kept,
        Err(e) => {
            tracing::warn!(user = %bare, error = %e, "offline messages unavailable");
            return;
        }
    };
    for m in kept {
        let Some(el) = crate::protocol::xml::parse_element(&m.stanza) else {
            tracing::warn!(user = %bare, "unparseable stored message");
            continue;
        };
        if admit_from(presence, m.sender.as_str(), bare.as_str(), &el).await != Verdict::Pass {
            continue;
        }
        let domain = bare.domain().as_str();
        // Paced to the session's mailbox budget: the user's kept messages may together be
        // more than it takes at once, and must not end the session they are handed to.
        outbox::to_handle_paced(
            session,
            crate::services::offline::stamped(el, domain, m.stored_at),
        )
        .await;
    }
}

/// A stanza a XEP-0198 session of local user `owner` was given and whose receipt its
/// client never acknowledged, after that session ended (its resumption window passed,
/// or it closed): handled as RFC 6121 §8.5.3.2.1 handles a stanza for a resource that is
/// gone, so nothing the server accepted is lost without a word.
///
/// - `chat` and `normal` messages are treated as sent to the bare JID: the user's
///   resources that take messages get it (§8.5.2.1.1, on any node), and with none it is
///   kept offline (XEP-0160) or, when it may not be kept, dropped as §8.5.2.2.1 allows;
///   no room in the offline store is answered as [`store_offline`] says.
/// - `groupchat` messages and iq requests (`get`, `set`) get `service-unavailable`
///   (§8.5.3.2.1, RFC 6120 §10.5.3.2 / §8.3.3.19).
/// - `headline` and `error` messages, iq results and errors, and presence are dropped
///   (§8.5.3.2.1; presence is re-sent by its producer's next broadcast or probe).
///
/// A message handed out of offline storage and not acknowledged goes back there, with its
/// original delay stamp ([`crate::services::offline::stamped`] keeps it).
pub(crate) async fn unacked(presence: &Presence, owner: &BareJid, el: Element) -> Outcome {
    match el.name.as_str() {
        "message" => match MessageType::of(&el) {
            kind @ (MessageType::Chat | MessageType::Normal) => {
                let sender = el.get_attr("from").unwrap_or_default().to_owned();
                let (sessions, remote) = resources_everywhere(presence, owner).await;
                if targets_everywhere(&sessions, &remote, kind).is_some() {
                    message_to_bare_everywhere(&presence.cluster, &sessions, &remote, el, kind);
                    return Outcome::Delivered;
                }
                store_offline(presence, &sender, owner, el).await
            }
            MessageType::Groupchat => {
                presence
                    .outbox
                    .bounce(&el, StanzaError::service_unavailable());
                Outcome::Bounced
            }
            MessageType::Headline | MessageType::Error => Outcome::Dropped,
        },
        "iq" if IqType::of(&el).is_some_and(IqType::is_request) => {
            presence
                .outbox
                .bounce(&el, StanzaError::service_unavailable());
            Outcome::Bounced
        }
        _ => Outcome::Dropped,
    }
}

/// An iq from `sender` (a local full JID or a remote JID; `from` stamped) to local full
/// JID `to`, after the recipient's block list (RFC 6120 §10.5.4). A request reaches the
/// resource only if the sender may know it is online ([`gate::may_reach_resource`]) or it
/// is the sender's own account; otherwise, and when there is no such session, the sender
/// gets the `service-unavailable` an offline resource gives. Results and errors reach the
/// session if there is one.
pub(crate) async fn iq(presence: &Presence, from: &Jid, to: &FullJid, el: Element) -> Outcome {
    let sender = from.as_str();
    if admit_from(presence, sender, to.as_str(), &el).await != Verdict::Pass {
        return Outcome::Dropped;
    }
    let is_request = IqType::of(&el).is_some_and(IqType::is_request);
    let own = gate::bare_of(sender) == to.to_bare().as_str();
    let session = presence.sessions.get(to);
    if session.is_none() {
        if let Some(h) = presence.cluster.holder_of(to).await {
            // Bound on another node: the same rules, with what the directory says; a
            // request it does not admit may still reach a resource that revealed itself to
            // the sender by directed presence, which only that node knows: it decides.
            let xml = Arc::new(el.to_xml());
            if !is_request || own || gate::may_reach_holder(presence, from, &h).await {
                outbox::to_holder(&presence.cluster, &h, xml);
            } else {
                outbox::decide_there(&presence.cluster, &h, xml);
            }
            // Handed to the node holding the resource (which answers a refusal).
            return Outcome::Delivered;
        }
    }
    match session {
        Some(s) if !is_request || own => {
            outbox::to_handle(&s, el);
            Outcome::Delivered
        }
        None if !is_request => Outcome::Dropped,
        None if own => {
            presence
                .outbox
                .bounce(&el, StanzaError::service_unavailable());
            Outcome::Bounced
        }
        // A request from anyone else takes the same decision whether the resource is online
        // or not, so neither the answer nor its timing tells them apart.
        session => {
            if gate::may_reach(presence, from, to, session.as_ref()).await {
                if let Some(s) = session {
                    outbox::to_handle(&s, el);
                    return Outcome::Delivered;
                }
            }
            presence
                .outbox
                .bounce(&el, StanzaError::service_unavailable());
            Outcome::Bounced
        }
    }
}
