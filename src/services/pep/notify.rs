//! Who hears of a publish, and when (XEP-0163 §4.3, §6.2): the owner's own resources and
//! the contacts the access model admits ([`super::may_read`]'s people, found in one read
//! by [`crate::services::presence::gate::online_audience`]), and among their resources
//! only those whose XEP-0115 capabilities say `<node>+notify` (§4.4 filtered
//! notifications, [`crate::node::caps`]).
//!
//! Across the cluster the decision is taken here, on the publisher's node; each other
//! node holding a recipient's sessions gets the event once
//! ([`crate::cluster::Kind::Notify`]) and hands it to the sessions there that asked for
//! the node ([`from_node`]), as that is a fact only the session's own node knows.
//!
//! When a resource becomes available with capabilities (or the server learns what its
//! `ver` means), it gets the last item of each node it asked for: the user's own, and
//! every local contact's it may read (XEP-0163 §6.2; §4.3.1 for the owner's own
//! resources).

use std::sync::Arc;

use super::Pep;
use crate::cluster::Kind;
use crate::node::caps::{Asker, Caps, Lookup};
use crate::node::outbox;
use crate::node::session::Client;
use crate::node::sessions::SessionHandle;
use crate::protocol::jid::{BareJid, FullJid, Jid};
use crate::protocol::stanza::IqType;
use crate::protocol::xml::{Element, NS_CLIENT, NS_DISCO_INFO};
use crate::store::pep::AccessModel;

use super::{item_element, may_read, NS_PUBSUB_EVENT};

/// Whether the session asked for notifications of a node (`notify`: its `<node>+notify`
/// feature, built once per event rather than once per session).
fn wants(session: &SessionHandle, notify: &str) -> bool {
    session.read(|s| s.caps.as_ref().is_some_and(|f| f.contains(notify)))
}

/// `<message type='headline'>` carrying one `<event/>` child from `owner`.
fn event_message(owner: &str, event: Element) -> Element {
    Element::new("message", NS_CLIENT)
        .attr("from", owner)
        .attr("type", "headline")
        .attr("id", crate::protocol::xml::new_id())
        .child(Element::new("event", NS_PUBSUB_EVENT).child(event))
}

/// Hands `msg` (an event about `node`) to each available session of local user `bare`
/// on this node that asked for the node.
fn deliver_here(pep: &Pep, bare: &str, node: &str, msg: &Element) {
    let notify = format!("{node}+notify");
    outbox::to_each_here(
        &pep.sessions,
        bare,
        |s| s.is_available() && wants(s, &notify),
        |jid| {
            let mut m = msg.clone();
            m.set_attr("to", jid);
            m
        },
    );
}

/// Sends the event `event` about `owner`'s `node` (access model `access`) to everyone
/// the access model admits, wherever their sessions are.
pub(super) async fn notify(
    pep: &Pep,
    owner: &BareJid,
    node: &str,
    access: AccessModel,
    event: Element,
) {
    let mut recipients = vec![owner.to_string()];
    if access != AccessModel::Whitelist {
        // The presence audience: approved subscribers the gate admits (an `open` node
        // notifies the same people, XEP-0163 §4.1: PEP subscriptions come from presence
        // subscriptions).
        let audience = pep.presence.online_audience(owner).await;
        let mut local: Vec<String> = audience
            .into_iter()
            .map(|c| c.to_string())
            .filter(|c| pep.outbox.is_local(c))
            .collect();
        local.sort();
        recipients.extend(local);
    }
    let msg = event_message(owner.as_str(), event);
    for r in &recipients {
        deliver_here(pep, r, node, &msg);
    }
    outbox::to_other_nodes(
        &pep.cluster,
        recipients,
        Arc::new(msg.to_xml()),
        Kind::Notify,
    );
}

/// An event another node decided to send (see the module docs): delivered to the
/// sessions here of each recipient in `to` that asked for its node.
pub(crate) fn from_node(pep: &Pep, to: &[String], xml: &str) {
    let Some(msg) = crate::protocol::xml::parse_element(xml) else {
        tracing::warn!("cluster: unparseable PEP event dropped");
        return;
    };
    let node = msg
        .get_child("event", NS_PUBSUB_EVENT)
        .and_then(|e| e.elements().next())
        .and_then(|e| e.get_attr("node"))
        .map(str::to_owned);
    let Some(node) = node else {
        return;
    };
    for bare in to {
        deliver_here(pep, crate::protocol::jid::bare_of(bare), &node, &msg);
    }
}

/// After the session's own available presence `el` was broadcast: learns its client's
/// capabilities (asking its disco#info once per `ver`) and, on initial presence, sends
/// the last items it asked for. `initial`: the session was not available before.
pub(super) async fn on_presence(pep: &Pep, session: &Client, el: &Element, initial: bool) {
    let full = session.jid().as_str();
    let Some(caps) = Caps::of_presence(el) else {
        return;
    };
    match pep
        .caps
        .lookup(&Asker::new(session.jid(), session.handle.id), &caps)
    {
        Lookup::Known(features) => {
            session.handle.write(|s| s.caps = Some(features));
            if initial {
                send_last_items(pep, &session.handle).await;
            }
        }
        Lookup::Waiting => {}
        Lookup::Ask(id) => {
            // XEP-0115 §6.2: the server asks the client what its `ver` stands for.
            let query = Element::new("iq", NS_CLIENT)
                .attr("type", "get")
                .attr("id", id)
                .attr("from", session.jid().domain().as_str())
                .attr("to", full)
                .child(
                    Element::new("query", NS_DISCO_INFO)
                        .attr("node", format!("{}#{}", caps.node, caps.ver)),
                );
            session.deliver(query);
        }
    }
}

/// An iq result or error (`ty`) a client sent to the server: if it answers one of our caps
/// queries, the features are learnt (verified against the `ver`, XEP-0115 §5.4) and the
/// sessions that waited for them get their last items.
pub(super) async fn disco_answer(pep: &Pep, session: &Client, el: &Element, ty: IqType) {
    let Some(id) = el.get_attr("id") else {
        return;
    };
    let asker = Asker::new(session.jid(), session.handle.id);
    let Some(pending) = pep.caps.answered(id, &asker) else {
        return;
    };
    let query = el
        .get_child("query", NS_DISCO_INFO)
        .filter(|_| ty == IqType::Result);
    let Some(query) = query else {
        tracing::info!(jid = %session.jid(), "client did not answer its caps query");
        return;
    };
    let verified = crate::node::caps::verify(&pending.caps, query);
    if !verified {
        tracing::info!(jid = %session.jid(), ver = %pending.caps.ver,
            "disco#info does not match the caps ver; used for this session only");
    }
    let features = Arc::new(crate::node::caps::features_of(query));
    let described = pep.caps.learn(&pending, Arc::clone(&features), verified);
    for w in described {
        // The session that announced the `ver`, not a later one of the same JID.
        let Some(handle) = pep.sessions.get(&w.full).filter(|h| h.id == w.session) else {
            continue;
        };
        handle.write(|s| s.caps = Some(Arc::clone(&features)));
        if handle.is_available() {
            send_last_items(pep, &handle).await;
        }
    }
}

/// XEP-0163 §6.2 / §4.3.1: the last item of each node the session asked for, of its own
/// account and of each local contact whose node it may read.
async fn send_last_items(pep: &Pep, handle: &SessionHandle) {
    let Some(features) = handle.read(|s| s.caps.clone()) else {
        return;
    };
    if !features.iter().any(|f| f.ends_with("+notify")) {
        return;
    }
    let me = handle.jid.to_bare();
    let viewer = Jid::from(FullJid::clone(&handle.jid));
    let mut owners = vec![me.clone()];
    match pep.store.roster(me.as_str()).await {
        Ok((_, roster)) => owners.extend(
            roster
                .into_iter()
                .filter(|i| i.subscription.has_to())
                .filter(|i| pep.outbox.is_local(i.contact.as_str()))
                .map(|i| i.contact),
        ),
        Err(e) => tracing::warn!(user = %me, error = %e, "roster unavailable; no PEP items sent"),
    }
    let last = match pep.store.pep_last_items(&owners).await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(user = %me, error = %e, "PEP items unavailable; none sent");
            return;
        }
    };
    // One decision per owner and access model, asked only for nodes the session wants.
    let mut decided: std::collections::HashMap<(BareJid, AccessModel), bool> = Default::default();
    for (owner, node, access, item) in last {
        if !features.contains(&format!("{node}+notify")) {
            continue;
        }
        let key = (owner.clone(), access);
        let ok = match decided.get(&key) {
            Some(ok) => *ok,
            None => {
                let ok = may_read(pep, access, &viewer, &owner).await;
                decided.insert(key, ok);
                ok
            }
        };
        if !ok {
            continue;
        }
        let event = Element::new("items", NS_PUBSUB_EVENT)
            .attr("node", node)
            .child(item_element(NS_PUBSUB_EVENT, &item));
        let mut msg = event_message(owner.as_str(), event);
        msg.set_attr("to", handle.jid.to_string());
        outbox::to_handle(handle, msg);
    }
}
