//! The outbox: the one place a stanza leaves for a session's mailbox, for another node of
//! the cluster or for another domain. Everything here sends what was already decided (the
//! privacy gate, a block list, a session's own request, RFC 6121 §8.5.2's choice of
//! resources); the decisions themselves, and the deliveries that must ask them, are in
//! `delivery` and the services.
//!
//! What needs only a handle or the cluster is a free function; what finds its recipient by
//! address is a method of [`Outbox`], which holds exactly what that reads (the session
//! registry, the cluster, the federation state, the served domains), so a caller that
//! holds an `Outbox` needs nothing else of the node to send.
//!
//! - One session the caller holds: [`to_handle`] (an element or shared bytes; a session's
//!   reply to its own client too), [`to_handle_paced`] (a burst the session asked for),
//!   [`nonza`] (XEP-0198 elements, which are no stanzas but travel the same mailbox).
//! - A local JID, here and then on the other nodes: [`Outbox::to_session`],
//!   [`Outbox::to_available`], [`Outbox::to_local`], [`Outbox::presence_to`],
//!   [`Outbox::answer`], [`Outbox::bounce`], [`message_to_bare_everywhere`].
//! - Another domain: [`Outbox::route_remote`] (the federation state's queue for it).
//! - Each resource of one user that wants a stanza, here and then elsewhere:
//!   [`to_interested`] (block-list pushes, carbon copies); [`to_each_here`] for this node's
//!   resources alone (PEP events, whose other nodes choose their own sessions; a
//!   broadcast's own resources).
//! - A presence serialised once to many contacts: [`Outbox::xml_to_available`] here,
//!   [`Outbox::to_contacts`] here and then one message per other node
//!   ([`Outbox::fan_out`] for the other nodes alone).
//! - Another node only: [`to_holder`] (a full JID the directory placed there),
//!   [`decide_there`] (a request only that node can admit), [`to_other_nodes`].
//!
//! What every stanza to a client is subject to is applied once, after this: the mailbox's
//! count and byte budget (the handle's queueing), and in the session's writer the XEP-0352
//! holding and the XEP-0198 counting. What stays with the callers is what needs their
//! decision: whether a viewer may see a presence (the privacy gate), whether a resource
//! asked for a kind of stanza (the predicates passed to [`to_interested`] and
//! [`to_each_here`]), which viewers to record as shown (the revealed set, whose room only
//! the subject's broadcast knows, under its lock), and XEP-0280's wrapping of each copy.
//! A roster push records the version the session now has as it is queued
//! (`roster_push::push_to`), so it keeps its own loop over [`to_handle`].

use std::borrow::Cow;
use std::sync::Arc;

use crate::cluster::{Cluster, Holder, Kind};
use crate::node::sessions::{Outbound, SessionHandle, Sessions};
use crate::protocol::error::StanzaError;
use crate::protocol::jid::{FullJid, Jid};
use crate::protocol::stanza::{MessageType, PresenceType};
use crate::protocol::xml::{Addressed, Element, NS_CLIENT};

use crate::config::CheckedConfig;
use crate::node::federation::S2s;

/// What a session's mailbox takes as one stanza: an element, or its bytes serialised once
/// and shared by every session that gets the same copy ([`Outbound::Xml`]).
pub trait Payload {
    /// Queues it on `handle`'s mailbox; `false` if the session is gone or was ended for
    /// not keeping up.
    fn queue_on(self, handle: &SessionHandle) -> bool;
}

impl Payload for Element {
    fn queue_on(self, handle: &SessionHandle) -> bool {
        handle.send(self)
    }
}

impl Payload for Arc<String> {
    fn queue_on(self, handle: &SessionHandle) -> bool {
        handle.send_xml(self)
    }
}

impl Payload for String {
    fn queue_on(self, handle: &SessionHandle) -> bool {
        handle.send_xml(Arc::new(self))
    }
}

/// Queues a stanza on a session the caller holds: a reply to the session's own client, or
/// what the caller decided this resource gets.
pub(crate) fn to_handle(handle: &SessionHandle, stanza: impl Payload) -> bool {
    stanza.queue_on(handle)
}

/// [`to_handle`] for a burst the session asked for and whose size the server does not
/// choose (XEP-0160 kept messages): waits for room in its mailbox's byte budget rather than
/// ending the session ([`SessionHandle::send_paced`]).
pub(crate) async fn to_handle_paced(handle: &SessionHandle, el: Element) -> bool {
    handle.send_paced(el).await
}

/// Queues a XEP-0198 element ([`Outbound::SmEnabled`], [`Outbound::SmNonza`]) in order with
/// the stanzas around it: no stanza, but the same mailbox and budget.
pub(crate) fn nonza(handle: &SessionHandle, msg: Outbound) -> bool {
    handle.send_sm(msg)
}

/// Sends each session of local user `bare` on this node that `wants` it its own copy,
/// `build(full JID)`, under one read of the registry (no handle copies). Returns how many
/// took one.
pub(crate) fn to_each_here<P: Payload>(
    sessions: &Sessions,
    bare: &str,
    mut wants: impl FnMut(&SessionHandle) -> bool,
    build: impl Fn(&str) -> P,
) -> usize {
    let mut reached = 0;
    sessions.for_each_of(bare, |s| {
        if wants(s) {
            build(s.jid.as_str()).queue_on(s);
            reached += 1;
        }
    });
    reached
}

/// Where [`to_interested`] finds a user's sessions on other nodes.
pub(crate) enum Elsewhere<'a> {
    /// The caller read them from the directory already, for the same delivery.
    Known(&'a [Holder]),
    /// Read from the directory once the sessions here have their copies.
    Read,
}

/// Sends each resource of local user `bare` that asked for it its own copy,
/// `build(full JID)`: first this node's sessions that `here` accepts, then the sessions on
/// other nodes whose directory entries `there` accepts (each copy to its node). The copies
/// differ in their address, so each is serialised for itself.
pub(crate) async fn to_interested(
    sessions: &Sessions,
    cluster: &Cluster,
    bare: &str,
    elsewhere: Elsewhere<'_>,
    here: impl FnMut(&SessionHandle) -> bool,
    there: impl Fn(&Holder) -> bool,
    build: impl Fn(&str) -> Element,
) {
    to_each_here(sessions, bare, here, &build);
    let read;
    let remote = match elsewhere {
        Elsewhere::Known(remote) => remote,
        Elsewhere::Read => {
            // Boxed: the read's future is large, and the callers that pass the holders they
            // read (a message's delivery, in its session's task) need not carry it.
            read = Box::pin(cluster.holders(&[bare]))
                .await
                .remove(bare)
                .unwrap_or_default();
            &read
        }
    };
    for h in remote.iter().filter(|h| there(h)) {
        to_holder(cluster, h, Arc::new(build(&h.jid).to_xml()));
    }
}

/// Sends `xml` to one session on another node, the directory's holder `h` (the caller chose
/// it and decided that it may take the stanza).
pub(crate) fn to_holder(cluster: &Cluster, h: &Holder, xml: Arc<String>) {
    cluster.send(h.node(), vec![h.jid.clone()], xml);
}

/// Hands a request (or groupchat message) for holder `h` to its node, which decides with
/// the session itself whether it may reach it ([`Kind::Decide`]).
pub(crate) fn decide_there(cluster: &Cluster, h: &Holder, xml: Arc<String>) {
    cluster.decide_there(h.node(), h.jid.clone(), xml);
}

/// Sends `xml` to the sessions of `to` on the other nodes as `kind` says (see
/// [`Cluster::forward`]); nothing here.
pub(crate) fn to_other_nodes(cluster: &Cluster, to: Vec<String>, xml: Arc<String>, kind: Kind) {
    cluster.forward(to, xml, kind);
}

/// How [`Outbox::to_contacts`] reaches the other nodes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Reach {
    /// Send and go on (nobody records whom it reached).
    Send,
    /// Wait for the recipients the other nodes hold ([`Outbox::fan_out`]), to record them as
    /// shown. `initial`: as [`Outbox::fan_out`] says.
    Record { initial: bool },
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
        crate::node::sessions::highest_priority(local_prio.chain(remote_prio))
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
            to_handle(s, el.clone());
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

/// What the outbox's deliveries by address read, and nothing else: this node's session
/// registry, the other nodes (the session directory and their channels), the federation
/// state that queues a stanza for another domain, and the configuration the node started
/// with (which domains it serves, whether federation is on: neither changes on reload).
/// Built once by the composition root; a handler that holds the node state reaches it as
/// [`crate::node::Shared::outbox`].
pub struct Outbox {
    sessions: Arc<Sessions>,
    cluster: Cluster,
    s2s: Arc<S2s>,
    config: Arc<CheckedConfig>,
}

impl Outbox {
    /// Whether `domain` is one this server hosts: the one answer every service asks.
    pub(crate) fn serves(&self, domain: &str) -> bool {
        self.config.serves(domain)
    }

    /// The domains this server hosts.
    pub(crate) fn domains(&self) -> &[String] {
        &self.config.domains
    }

    /// The outbox of the node whose parts these are.
    pub fn new(
        sessions: Arc<Sessions>,
        cluster: Cluster,
        s2s: Arc<S2s>,
        config: Arc<CheckedConfig>,
    ) -> Self {
        Outbox {
            sessions,
            cluster,
            s2s,
            config,
        }
    }

    /// Sends a stanza whose `to` is on a domain this server does not host. `from` is already
    /// stamped with a local JID. `Err` is the stanza error to bounce to the sender now
    /// (RFC 6120 §8.3.3.16); later failures are bounced by the link's task.
    pub fn route_remote(&self, stanza: Element) -> Result<(), StanzaError> {
        self.s2s.route(&self.config, stanza)
    }

    /// Queues a stanza on the session bound to `full`, if there is one. The caller decided
    /// that the stanza may reach it. On another node, it is sent there; `false` then means
    /// "not here".
    pub(crate) fn to_session(&self, full: &FullJid, el: Element) -> bool {
        if let Some(s) = self.sessions.get(full) {
            return to_handle(&s, el);
        }
        to_other_nodes(
            &self.cluster,
            vec![full.to_string()],
            Arc::new(el.to_xml()),
            Kind::Deliver,
        );
        false
    }

    /// Delivers `el` to every available resource of local user `bare` (RFC 6121 §4.2.3,
    /// §3.1.3), on this node and on the others. Returns how many sessions here got it.
    pub(crate) fn to_available(&self, bare: &str, el: &Element) -> usize {
        let xml = std::cell::LazyCell::new(|| Arc::new(el.to_xml()));
        let n = self.xml_to_available(bare, || Arc::clone(&xml));
        if self.cluster.has_peers() {
            to_other_nodes(
                &self.cluster,
                vec![bare.to_owned()],
                Arc::clone(&xml),
                Kind::Deliver,
            );
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
        &self,
        once: &Addressed,
        recipients: Vec<String>,
        initial: bool,
    ) -> std::collections::HashSet<String> {
        if !self.cluster.has_peers() || recipients.is_empty() {
            return Default::default();
        }
        let xml = Arc::new(once.unaddressed().to_owned());
        self.cluster
            .forward_reaching(recipients, xml, Kind::Address, initial)
            .await
    }

    /// A presence serialised once without `to` (`once`) to the available resources of local
    /// users `recipients`, each copy addressed to its recipient: the sessions here, then one
    /// message per other node that holds any of them. `own`: the sender's bare JID, whose
    /// sessions only the other nodes are sent to here (the caller serves those on this node
    /// itself, the sender included). With [`Reach::Record`], returns the recipients reached:
    /// those with a session here that took it and those with sessions on another node.
    pub(crate) async fn to_contacts<'a, R: Into<Cow<'a, str>>>(
        &self,
        once: &Addressed,
        recipients: Vec<R>,
        own: Option<String>,
        reach: Reach,
    ) -> Vec<Cow<'a, str>> {
        let record = matches!(reach, Reach::Record { .. });
        // Without other nodes nothing goes elsewhere, and a recipient reached here moves
        // into `reached` instead of being copied (a login's broadcast names every contact,
        // borrowed from its privacy inputs).
        let peers = self.cluster.has_peers();
        let mut reached = Vec::new();
        let mut elsewhere: Vec<String> = Vec::new();
        if peers {
            elsewhere.reserve(recipients.len() + 1);
            elsewhere.extend(own);
        }
        for to in recipients {
            let to: Cow<'a, str> = to.into();
            let here = self.xml_to_available(&to, || once.to(&to)) > 0 && record;
            if peers {
                elsewhere.push(to.to_string());
            }
            if here {
                reached.push(to);
            }
        }
        match reach {
            Reach::Send => {
                let xml = Arc::new(once.unaddressed().to_owned());
                to_other_nodes(&self.cluster, elsewhere, xml, Kind::Address);
            }
            Reach::Record { initial } => {
                let other_nodes = self.fan_out(once, elsewhere, initial).await;
                reached.extend(other_nodes.into_iter().map(Cow::Owned));
            }
        }
        reached
    }

    /// Delivers a serialised stanza to every available resource of local user `bare` on this
    /// node: `xml` runs at most once, only if some resource is available, and its bytes are
    /// shared by all of them (the fan-out hot path: no handle copies, no element clone per
    /// resource, one read lock on the registry). Bytes already shared (`Arc<String>`) are
    /// queued as they are.
    pub(crate) fn xml_to_available<B: Into<Arc<String>>>(
        &self,
        bare: &str,
        xml: impl FnOnce() -> B,
    ) -> usize {
        let bytes = std::cell::LazyCell::new(|| -> Arc<String> { xml().into() });
        to_each_here(&self.sessions, bare, SessionHandle::is_available, |_| {
            Arc::clone(&bytes)
        })
    }

    /// Delivers `el` to a local JID: a full JID's session, or a bare JID's available
    /// resources.
    pub(crate) fn to_local(&self, to: &str, el: Element) {
        match crate::protocol::jid::parse(to).map(Jid::try_into_full) {
            Ok(Ok(full)) => {
                self.to_session(&full, el);
            }
            Ok(Err(bare)) => {
                self.to_available(bare.as_str(), &el);
            }
            Err(_) => {}
        }
    }

    /// Whether `jid` is an account on a domain this server hosts.
    pub(crate) fn is_local(&self, jid: &str) -> bool {
        let bare = crate::protocol::jid::bare_of(jid);
        bare.contains('@') && self.serves(crate::protocol::jid::domain_of(bare))
    }

    /// Sends a presence the caller's decision admitted to `to`: locally as [`Self::to_local`], to
    /// another domain over federation.
    pub(crate) fn presence_to(&self, to: &str, el: Element) {
        if self.is_local(to) {
            self.to_local(to, el);
        } else {
            let _ = self.route_remote(el);
        }
    }

    /// Answers `el` with `err` (RFC 6120 §8.3.1), wherever its sender is: a local session, a
    /// local user's resources, or a remote server. Nothing answers an error.
    pub(crate) fn bounce(&self, el: &Element, err: StanzaError) {
        let Some(reply) = err.reply_to(el) else {
            return;
        };
        let Some(to) = reply
            .get_attr("to")
            .and_then(|t| crate::protocol::jid::parse(t).ok())
        else {
            return;
        };
        if !self.serves(to.domain().as_str()) {
            let _ = self.route_remote(reply);
            return;
        }
        match (reply.name.as_str(), to.try_into_full()) {
            (_, Ok(full)) => {
                self.to_session(&full, reply);
            }
            ("presence", Err(bare)) => {
                self.to_available(bare.as_str(), &reply);
            }
            (_, Err(bare)) => {
                // RFC 6121 §8.5.2 over the user's resources on every node: the directory read
                // is awaited off the caller's path (a bounce is answered from sync code).
                let sessions = self.sessions.of_user(&bare);
                if !self.cluster.has_peers() {
                    message_to_bare_everywhere(
                        &self.cluster,
                        &sessions,
                        &[],
                        reply,
                        MessageType::Error,
                    );
                    return;
                }
                let cluster = self.cluster.clone();
                tokio::spawn(async move {
                    let remote = cluster
                        .holders(&[bare.as_str()])
                        .await
                        .remove(bare.as_str())
                        .unwrap_or_default();
                    message_to_bare_everywhere(
                        &cluster,
                        &sessions,
                        &remote,
                        reply,
                        MessageType::Error,
                    );
                });
            }
        }
    }

    /// Sends a reply built elsewhere (already addressed) back to its recipient.
    pub(crate) fn answer(&self, reply: Element) {
        match reply.get_attr("to").map(str::to_owned) {
            Some(to) if self.is_local(&to) => self.to_local(&to, reply),
            Some(_) => {
                let _ = self.route_remote(reply);
            }
            None => {}
        }
    }

    /// Sends `viewer` (local or remote, bare or full) an unavailable from each available
    /// resource of local user `subject` that it had been shown, and forgets that it was
    /// shown (RFC 6121 §3.2.2, §3.3.3, XEP-0191 §3.3). A resource the viewer was not shown (an
    /// invisible one, one hidden by the settings or a block) sends nothing: an unavailable
    /// from a full JID would itself reveal that the resource was online.
    pub(crate) fn unavailable_from_shown(&self, subject: &str, viewer: &str) {
        for s in self.sessions.of_user_str(subject) {
            if !s.is_available() || !s.forget(viewer) {
                continue;
            }
            self.presence_to(viewer, unavailable(s.jid.as_str(), viewer));
        }
    }

    /// Returns a stanza that could not be sent to its local sender as an error (RFC 6120
    /// §8.3.1). Presence is not bounced except subscription requests: a failed broadcast is
    /// nothing the user can act on; a failed probe is remembered and repeated instead.
    pub(crate) fn bounce_unroutable(&self, el: &Element, err: StanzaError) {
        if el.name == "presence" {
            let ty = PresenceType::of(el);
            if ty == Some(PresenceType::Probe) {
                if let (Some(f), Some(t)) = (el.get_attr("from"), el.get_attr("to")) {
                    self.s2s.probe_failed(
                        crate::protocol::jid::bare_of(f),
                        crate::protocol::jid::bare_of(t),
                    );
                }
            }
            if ty != Some(PresenceType::Subscribe) {
                return;
            }
        }
        self.bounce(el, err);
    }
}
