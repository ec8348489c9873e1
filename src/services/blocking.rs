//! XEP-0191 blocking command: retrieve, block, unblock and unblock-all, with pushes, and
//! the rules for stanzas between a user and an entity on the user's block list.
//!
//! Lists live in PostgreSQL ([`crate::store::blocks`]); every check reads them fresh, so
//! a block applies to the very next stanza on every node. After each change the owner is
//! reconciled ([`crate::services::presence::gate::reconcile_user`]): a newly blocked contact that
//! had been shown the user online gets unavailable from each resource it was shown
//! (XEP-0191 §3.3) and nothing more; a contact that had not been shown the user online
//! gets nothing, so a block never reveals online status. Unblocking shows current
//! presence again to subscribers the privacy settings admit.
//!
//! Stanzas (§3.3), as implemented by [`outbound_to_blocked`] and [`inbound_from_blocked`]:
//!
//! | direction                         | message / iq request                         | presence | iq result/error, message error |
//! |-----------------------------------|----------------------------------------------|----------|--------------------------------|
//! | user → blocked entity             | `not-acceptable` + `<blocked xmlns='urn:xmpp:blocking:errors'/>` | dropped  | dropped                        |
//! | blocked entity → user             | message dropped; iq `service-unavailable`    | dropped  | dropped                        |
//!
//! Both answers to the blocked entity are what it gets when the user is offline, so they
//! say nothing about the user's status. (XEP-0191 §3.3 defers to XEP-0016, which lets a
//! server bounce a blocked message with `service-unavailable` "so the user appears
//! offline"; here an offline user's messages are dropped silently — see
//! the router — so dropping is what appearing offline means on this server.)

use std::sync::Arc;

use crate::cluster::Cluster;
use crate::node::session::Client;
use crate::node::sessions::Sessions;
use crate::protocol::error::{iq_result, StanzaError};
use crate::protocol::jid::Jid;
use crate::protocol::stanza::{IqType, MessageType};
use crate::protocol::xml::{Element, Node, NS_CLIENT};
use crate::services::presence::Presence;
use crate::store::{Store, StoreError};

/// The XEP-0191 namespace.
pub const NS_BLOCKING: &str = "urn:xmpp:blocking";
/// The XEP-0191 application error namespace (`<blocked/>`).
pub const NS_BLOCKING_ERRORS: &str = "urn:xmpp:blocking:errors";

/// The XEP-0191 service: the block lists in the store, the pushes to the owner's resources
/// here and on the other nodes, and the presence consequences of a change.
pub struct Blocking {
    store: Store,
    sessions: Arc<Sessions>,
    cluster: Cluster,
    presence: Arc<Presence>,
}

impl Blocking {
    /// The service over the node's store, session registry, cluster and presence.
    pub fn new(
        store: Store,
        sessions: Arc<Sessions>,
        cluster: Cluster,
        presence: Arc<Presence>,
    ) -> Self {
        Blocking {
            store,
            sessions,
            cluster,
            presence,
        }
    }

    /// Handles an `urn:xmpp:blocking` iq the user sent to their own account (XEP-0191 §3).
    /// Returns the reply, or `None` when it was already sent (a change answers first and
    /// pushes after).
    pub async fn handle(
        &self,
        session: &Client,
        iq: &Element,
        ty: IqType,
        payload: &Element,
    ) -> Option<Element> {
        match self.handle_inner(session, iq, ty, payload).await {
            Ok(reply) => reply,
            Err(e) => e.reply_to(iq),
        }
    }

    async fn handle_inner(
        &self,
        session: &Client,
        iq: &Element,
        ty: IqType,
        payload: &Element,
    ) -> Result<Option<Element>, StanzaError> {
        let owner_jid = session.jid().to_bare();
        let owner = owner_jid.to_string();
        match (ty, payload.name.as_str()) {
            (IqType::Get, "blocklist") => {
                // §3.2: a resource that retrieved the list gets the pushes.
                session.handle.write(|p| p.blocklist_interested = true);
                // Other nodes changing the list push to this resource too.
                self.presence.to_directory(&session.handle);
                let list = self.store.blocklist(&owner).await.map_err(failed)?;
                let mut el = Element::new("blocklist", NS_BLOCKING);
                for j in list {
                    el = el.child(Element::new("item", NS_BLOCKING).attr("jid", j.as_str()));
                }
                Ok(Some(iq_result(iq).child(el)))
            }
            (IqType::Set, "block") => {
                let jids = items(payload)?;
                if jids.is_empty() {
                    // §3.3: a block with no items is bad-request.
                    return Err(
                        StanzaError::bad_request().with_text("block needs at least one item")
                    );
                }
                let added = self.store.block(&owner, &jids).await.map_err(|e| {
                    if matches!(e, StoreError::BlocklistFull) {
                        tracing::info!(peer = %session.peer, user = %owner, "block refused: list is full");
                    }
                    failed(e)
                })?;
                // The result first, then withdrawal and the push (§3.3).
                session.deliver(iq_result(iq));
                self.presence.reconcile_user(&owner_jid).await;
                for j in &added {
                    withdraw_directed(session, j.as_str());
                }
                if !added.is_empty() {
                    self.push(&owner, "block", &added).await;
                }
                Ok(None)
            }
            (IqType::Set, "unblock") => {
                let jids = items(payload)?;
                let removed = if jids.is_empty() {
                    // §3.5: unblock without items unblocks everyone.
                    self.store.unblock_all(&owner).await.map_err(failed)?
                } else {
                    self.store.unblock(&owner, &jids).await.map_err(failed)?
                };
                session.deliver(iq_result(iq));
                self.presence.reconcile_user(&owner_jid).await;
                self.presence.probe_unblocked(&owner_jid, &removed).await;
                if !removed.is_empty() {
                    // An unblock-all push carries no items (§3.5).
                    let announce = if jids.is_empty() { Vec::new() } else { removed };
                    self.push(&owner, "unblock", &announce).await;
                }
                Ok(None)
            }
            _ => Err(StanzaError::bad_request()),
        }
    }

    /// Pushes `<block/>` or `<unblock/>` with `jids` to every resource of `owner` that
    /// retrieved its block list (XEP-0191 §3.3–§3.5), on this node and, from the directory
    /// entries that say so, on the others.
    async fn push(&self, owner: &str, what: &str, jids: &[Jid]) {
        let mut payload = Element::new(what, NS_BLOCKING);
        for j in jids {
            payload = payload.child(Element::new("item", NS_BLOCKING).attr("jid", j.as_str()));
        }
        let to = |jid: &str| {
            Element::new("iq", NS_CLIENT)
                .attr("type", "set")
                .attr("id", format!("block{}", crate::protocol::xml::new_id()))
                .attr("to", jid)
                .child(payload.clone())
        };
        crate::node::outbox::to_interested(
            &self.sessions,
            &self.cluster,
            owner,
            crate::node::outbox::Elsewhere::Read,
            |s| s.read(|p| p.blocklist_interested),
            |h| h.entry.blocklist,
            to,
        )
        .await;
    }
}

/// A directed-presence recipient that is now blocked leaves the session's list, so the
/// session's later unavailable does not reach it ("nothing more", §3.3).
fn withdraw_directed(session: &Client, blocked: &str) {
    let candidates = |to: &str| crate::store::blocks::match_candidates(to);
    session
        .handle
        .write(|p| p.retain_directed(|to| !candidates(to).iter().any(|c| c == blocked)));
}

/// The normalised JIDs of the `<item jid='…'/>` children (RFC 7622 normalisation).
fn items(payload: &Element) -> Result<Vec<String>, StanzaError> {
    let mut out = Vec::new();
    for item in payload.elements().filter(|e| e.is("item", NS_BLOCKING)) {
        let Some(j) = item.get_attr("jid") else {
            return Err(StanzaError::bad_request().with_text("item without jid"));
        };
        let jid = crate::protocol::jid::parse(j).map_err(|_| StanzaError::jid_malformed())?;
        let s = jid.to_string();
        if !out.contains(&s) {
            out.push(s);
        }
    }
    Ok(out)
}

fn failed(e: StoreError) -> StanzaError {
    match e {
        StoreError::Constraint(c) => StanzaError::jid_malformed().with_text(c),
        // XEP-0191 defines no error for a full list; not-acceptable (RFC 6120 §8.3.3.9) is
        // the request not meeting a criterion of this server, and nothing was added.
        StoreError::BlocklistFull => StanzaError::not_acceptable().with_text("block list is full"),
        other => {
            tracing::error!(error = %other, "block list store failure");
            StanzaError::internal_server_error()
        }
    }
}

/// What to do with a stanza between two parties when a block list is involved.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// No block applies; route normally.
    Pass,
    /// Drop without a word.
    Drop,
    /// Answer the sender with this error instead of routing.
    Reject(Element),
}

fn is_request(el: &Element) -> bool {
    match el.name.as_str() {
        "iq" => IqType::of(el).is_some_and(IqType::is_request),
        "message" => MessageType::of(el) != MessageType::Error,
        _ => false,
    }
}

/// The `not-acceptable` + `<blocked/>` error of XEP-0191 §3.3 for a stanza to an entity
/// the sender blocks.
pub fn blocked_error(el: &Element) -> Option<Element> {
    let mut reply = StanzaError::not_acceptable().reply_to(el)?;
    if let Some(err) = reply.get_child_mut("error", NS_CLIENT) {
        err.children
            .push(Node::Element(Element::new("blocked", NS_BLOCKING_ERRORS)));
    }
    Some(reply)
}

/// A stanza from local user `sender` (full JID) to `to`: blocked by the sender's own list?
/// Store failures let the stanza through (chat never stalls on the database) and are
/// logged.
pub async fn outbound_to_blocked(store: &Store, sender: &str, to: &str, el: &Element) -> Verdict {
    let owner = crate::protocol::jid::bare_of(sender);
    match store.is_blocked(owner, to).await {
        Ok(false) => Verdict::Pass,
        Ok(true) if is_request(el) => match blocked_error(el) {
            Some(r) => Verdict::Reject(r),
            None => Verdict::Drop,
        },
        Ok(true) => Verdict::Drop,
        Err(e) => {
            tracing::warn!(error = %e, "block list unavailable; routing anyway");
            Verdict::Pass
        }
    }
}

/// A stanza from `sender` (full JID) to local user `recipient`: does the recipient block
/// the sender? Messages are dropped, iq requests get `service-unavailable` (what an
/// offline or absent resource gives), everything else is dropped.
pub async fn inbound_from_blocked(
    store: &Store,
    sender: &str,
    recipient: &str,
    el: &Element,
) -> Verdict {
    let owner = crate::protocol::jid::bare_of(recipient);
    match store.is_blocked(owner, sender).await {
        Ok(false) => Verdict::Pass,
        Ok(true) if el.name == "iq" && is_request(el) => {
            match StanzaError::service_unavailable().reply_to(el) {
                Some(r) => Verdict::Reject(r),
                None => Verdict::Drop,
            }
        }
        Ok(true) => Verdict::Drop,
        Err(e) => {
            tracing::warn!(error = %e, "block list unavailable; routing anyway");
            Verdict::Pass
        }
    }
}
