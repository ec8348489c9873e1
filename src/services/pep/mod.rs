//! XEP-0163 personal eventing: each account is a pubsub service on its bare JID, holding
//! the user's avatar (XEP-0084), nickname (XEP-0172), OMEMO device lists and bundles.
//!
//! The XEP-0060 subset served (XEP-0163 §3–§6):
//!
//! | request (`to` the own bare JID or none) | answer |
//! |---|---|
//! | `<publish node>` with one `<item>` | creates the node on first publish (§3), stores, notifies |
//! | `<publish-options>` | `pubsub#access_model` `presence` (default), `open`, `whitelist`; anything else, a different model than the existing node's, or `pubsub#max_items` above the limit: `precondition-not-met` (XEP-0060 §7.1.5) |
//! | `<items node [max_items]>`, `<item id>`s | newest `max_items`, or the named ones |
//! | `<retract node [notify]>` | deletes the item (a `<retract/>` event with `notify`) |
//! | `#owner <delete node>`, `<purge node>` | deletes the node / its items, with the event |
//! | disco#info / disco#items on the bare JID | identity `pubsub`/`pep`; the nodes the asker may read |
//!
//! A contact may ask for items (`to` the owner's bare JID): an `open` node answers anyone
//! not blocked; a `presence` node answers whoever may see the owner's presence, decided by
//! the privacy gate ([`crate::services::presence::gate::may_see_online`]: an approved subscriber
//! the owner's settings admit, no block either way); a `whitelist` node answers only the
//! owner. Notifications (`notify`) go to the same people.
//!
//! Bounds (`[limits]`): `max_pep_nodes`, `max_pep_items`, `max_pep_item_size`; checked
//! in the store's one publish (nodes, items) or here (bytes).

mod notify;
pub(crate) mod vcard;

pub(crate) use notify::from_node;

use std::sync::Arc;

use crate::cluster::cache::Cache;
use crate::cluster::Cluster;
use crate::node::caps::CapsCache;
use crate::node::live::Live;
use crate::node::outbox::Outbox;
use crate::node::session::Client;
use crate::node::sessions::Sessions;
use crate::protocol::error::{iq_result, StanzaError};
use crate::protocol::jid::{BareJid, Jid};
use crate::protocol::stanza::IqType;
use crate::protocol::xml::{Element, NS_DISCO_INFO, NS_DISCO_ITEMS};
use crate::services::presence::gate;
use crate::services::presence::Presence;
use crate::store::pep::{AccessModel, PepItem, Published};
use crate::store::Store;

/// XEP-0060 namespaces.
pub(crate) const NS_PUBSUB: &str = "http://jabber.org/protocol/pubsub";
/// Owner operations (delete, purge).
pub(crate) const NS_PUBSUB_OWNER: &str = "http://jabber.org/protocol/pubsub#owner";
/// Events sent to subscribers.
pub(crate) const NS_PUBSUB_EVENT: &str = "http://jabber.org/protocol/pubsub#event";
/// Application-specific error conditions (XEP-0060 §7, §6.5.9).
const NS_PUBSUB_ERRORS: &str = "http://jabber.org/protocol/pubsub#errors";
/// FORM_TYPE of publish-options (XEP-0060 §7.1.5).
const FORM_PUBLISH_OPTIONS: &str = "http://jabber.org/protocol/pubsub#publish-options";
const NS_DATA: &str = "jabber:x:data";

/// The XEP-0060 §10 features an account advertises.
const FEATURES: &[&str] = &[
    NS_PUBSUB,
    "http://jabber.org/protocol/pubsub#publish",
    "http://jabber.org/protocol/pubsub#publish-options",
    "http://jabber.org/protocol/pubsub#auto-create",
    "http://jabber.org/protocol/pubsub#auto-subscribe",
    "http://jabber.org/protocol/pubsub#filtered-notifications",
    "http://jabber.org/protocol/pubsub#retrieve-items",
    "http://jabber.org/protocol/pubsub#retract-items",
    "http://jabber.org/protocol/pubsub#delete-nodes",
    "http://jabber.org/protocol/pubsub#purge-nodes",
    "http://jabber.org/protocol/pubsub#persistent-items",
    "http://jabber.org/protocol/pubsub#last-published",
    "http://jabber.org/protocol/pubsub#access-open",
    "http://jabber.org/protocol/pubsub#access-presence",
    "http://jabber.org/protocol/pubsub#access-whitelist",
];

/// The personal eventing service of every account here, with the vCards built on it
/// (XEP-0054, XEP-0398) and the XEP-0115 capabilities that say who is notified. Its reads
/// and notifications pass the privacy gate, which reads the store, the sessions here and
/// the cluster directory, which it asks through presence.
pub struct Pep {
    store: Store,
    sessions: Arc<Sessions>,
    outbox: Arc<Outbox>,
    cluster: Cluster,
    /// XEP-0115: which PEP nodes each client here wants (the node's cache).
    caps: Arc<CapsCache>,
    /// XEP-0153 avatar hashes by bare JID (the node's cache).
    avatar_hashes: Arc<Cache<Option<String>>>,
    presence: Arc<Presence>,
    /// The reloadable settings: the `[limits]` PEP checks (`max_pep_items`,
    /// `max_pep_item_size`, `max_vcard_size`) are read per request, so a reload applies to
    /// the next one.
    live: Arc<Live>,
}

impl Pep {
    /// The service over these parts of the node.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        store: Store,
        sessions: Arc<Sessions>,
        outbox: Arc<Outbox>,
        cluster: Cluster,
        caps: Arc<CapsCache>,
        avatar_hashes: Arc<Cache<Option<String>>>,
        presence: Arc<Presence>,
        live: Arc<Live>,
    ) -> Self {
        Pep {
            store,
            sessions,
            outbox,
            cluster,
            caps,
            avatar_hashes,
            presence,
            live,
        }
    }

    /// See [`handle_iq`].
    pub(crate) async fn handle_iq(
        &self,
        client: &Client,
        el: &Element,
        ty: IqType,
        owner: &BareJid,
    ) -> Element {
        handle_iq(self, client, el, ty, owner).await
    }

    /// See [`vcard::handle_iq`].
    pub(crate) async fn vcard_iq(
        &self,
        client: &Client,
        el: &Element,
        ty: IqType,
        owner: &BareJid,
    ) -> Element {
        vcard::handle_iq(self, client, el, ty, owner).await
    }

    /// See [`notify::on_presence`].
    pub(crate) async fn on_presence(&self, client: &Client, el: &Element, initial: bool) {
        notify::on_presence(self, client, el, initial).await;
    }

    /// See [`notify::disco_answer`].
    pub(crate) async fn disco_answer(&self, client: &Client, el: &Element, ty: IqType) {
        notify::disco_answer(self, client, el, ty).await;
    }

    /// See [`vcard::stamp_presence`].
    pub(crate) async fn stamp_presence(&self, owner: &str, presence: &mut Element) {
        vcard::stamp_presence(self, owner, presence).await;
    }
}

/// May `viewer` (any JID) read, and be notified of, a node of local user `owner` with
/// this access model? Blocks count either way; `presence` is the privacy gate's decision.
pub(crate) async fn may_read(
    pep: &Pep,
    access: AccessModel,
    viewer: &Jid,
    owner: &BareJid,
) -> bool {
    if gate::bare_of(viewer.as_str()) == owner.as_str() {
        return true;
    }
    match access {
        AccessModel::Open => !pep.presence.blocked_either(viewer, owner).await,
        AccessModel::Presence => pep.presence.may_see_online(viewer, owner, false).await,
        AccessModel::Whitelist => false,
    }
}

/// An error reply carrying a XEP-0060 application condition next to the RFC 6120 one.
fn error(el: &Element, err: StanzaError, app: Option<(&str, &str)>) -> Element {
    let mut reply = err
        .reply_to(el)
        .unwrap_or_else(|| crate::protocol::error::reply_skeleton(el, "error"));
    if let Some((name, feature)) = app {
        let mut cond = Element::new(name, NS_PUBSUB_ERRORS);
        if !feature.is_empty() {
            cond.set_attr("feature", feature);
        }
        if let Some(e) = reply.get_child_mut("error", crate::protocol::xml::NS_CLIENT) {
            e.children.push(crate::protocol::xml::Node::Element(cond));
        }
    }
    reply
}

fn internal(el: &Element, e: crate::store::StoreError) -> Element {
    tracing::warn!(error = %e, "PEP store operation failed");
    error(el, StanzaError::internal_server_error(), None)
}

/// Whether an iq payload is one this module answers for an account: pubsub, or disco#items
/// of the account (the node list).
pub(crate) fn handles(payload: &Element) -> bool {
    payload.ns == NS_PUBSUB
        || payload.ns == NS_PUBSUB_OWNER
        || (payload.is("query", NS_DISCO_ITEMS) && payload.get_attr("node").is_none())
}

/// Adds the XEP-0163 §1 identity and the XEP-0060 features to an account's disco#info.
pub(crate) fn describe_account(query: Element) -> Element {
    let mut q = query.child(
        Element::new("identity", NS_DISCO_INFO)
            .attr("category", "pubsub")
            .attr("type", "pep"),
    );
    // XEP-0054 §4 and XEP-0398 §2: the account's vCard, converted from and to its avatar.
    for f in FEATURES
        .iter()
        .chain(&[vcard::NS_VCARD, vcard::FEATURE_CONVERSION])
    {
        q = q.child(Element::new("feature", NS_DISCO_INFO).attr("var", *f));
    }
    q
}

/// Answers a pubsub or node-list iq request `el` of type `ty` sent by `session` to the
/// account `owner` (its own, or another local user's).
async fn handle_iq(
    pep: &Pep,
    session: &Client,
    el: &Element,
    ty: IqType,
    owner: &BareJid,
) -> Element {
    let Some(payload) = el.elements().next() else {
        return error(el, StanzaError::bad_request(), None);
    };
    let requester = Jid::from(session.jid().clone());
    let own = gate::bare_of(requester.as_str()) == owner.as_str();
    let get = ty == IqType::Get;
    if payload.is("query", NS_DISCO_ITEMS) {
        return if get {
            node_list(pep, el, &requester, owner).await
        } else {
            error(el, StanzaError::bad_request(), None)
        };
    }
    let Some(op) = payload.elements().next() else {
        return error(el, StanzaError::bad_request(), None);
    };
    match (payload.ns.as_str(), op.name.as_str(), get) {
        (NS_PUBSUB, "items", true) => items(pep, el, op, &requester, owner).await,
        _ if !own => {
            // XEP-0163 §4: only the owner publishes to, or manages, their own service.
            error(el, StanzaError::forbidden(), None)
        }
        (NS_PUBSUB, "publish", false) => publish(pep, session, el, payload, op).await,
        (NS_PUBSUB, "retract", false) => retract(pep, el, op, owner).await,
        (NS_PUBSUB_OWNER, "delete", false) => drop_node(pep, el, op, owner, "delete").await,
        (NS_PUBSUB_OWNER, "purge", false) => drop_node(pep, el, op, owner, "purge").await,
        _ => error(
            el,
            StanzaError::feature_not_implemented(),
            Some(("unsupported", op.name.as_str())),
        ),
    }
}

/// disco#items of an account: the nodes `requester` may read (XEP-0060 §5.2).
async fn node_list(pep: &Pep, el: &Element, requester: &Jid, owner: &BareJid) -> Element {
    let nodes = match pep.store.pep_nodes(owner.as_str()).await {
        Ok(n) => n,
        Err(e) => return internal(el, e),
    };
    let mut q = Element::new("query", NS_DISCO_ITEMS);
    for (node, access) in nodes {
        if may_read(pep, access, requester, owner).await {
            q = q.child(
                Element::new("item", NS_DISCO_ITEMS)
                    .attr("jid", owner.as_str())
                    .attr("node", node),
            );
        }
    }
    iq_result(el).child(q)
}

/// The node `op` names and its access model, or the error reply (no `node`: XEP-0060
/// `nodeid-required`; no such node: `item-not-found`).
async fn existing_node<'a>(
    pep: &Pep,
    el: &Element,
    op: &'a Element,
    owner: &BareJid,
) -> Result<(&'a str, AccessModel), Element> {
    let Some(node) = op.get_attr("node").filter(|n| !n.is_empty()) else {
        return Err(error(
            el,
            StanzaError::bad_request(),
            Some(("nodeid-required", "")),
        ));
    };
    match pep.store.pep_node(owner.as_str(), node).await {
        Ok(Some(access)) => Ok((node, access)),
        Ok(None) => Err(error(el, StanzaError::item_not_found(), None)),
        Err(e) => Err(internal(el, e)),
    }
}

/// The error for a reader the access model refuses (XEP-0060 §6.5.9.4, §6.5.9.6).
fn refused(el: &Element, access: AccessModel) -> Element {
    match access {
        AccessModel::Presence => error(
            el,
            StanzaError::not_authorized(),
            Some(("presence-subscription-required", "")),
        ),
        _ => error(el, StanzaError::not_allowed(), Some(("closed-node", ""))),
    }
}

/// XEP-0060 §6.5: items of a node, newest `max_items` or the ones named.
async fn items(pep: &Pep, el: &Element, op: &Element, requester: &Jid, owner: &BareJid) -> Element {
    let (node, access) = match existing_node(pep, el, op, owner).await {
        Ok(n) => n,
        Err(reply) => return reply,
    };
    if !may_read(pep, access, requester, owner).await {
        return refused(el, access);
    }
    let ids: Vec<String> = op
        .elements()
        .filter(|i| i.is("item", NS_PUBSUB))
        .filter_map(|i| i.get_attr("id").map(str::to_owned))
        .collect();
    let max = match op.get_attr("max_items").map(str::parse::<usize>) {
        None => pep.live.get().limits.max_pep_items,
        Some(Ok(n)) => n,
        Some(Err(_)) => return error(el, StanzaError::bad_request(), None),
    };
    let mut found = match pep.store.pep_items(owner.as_str(), node, &ids, max).await {
        Ok(f) => f,
        Err(e) => return internal(el, e),
    };
    // Oldest of the selection first, as they were published.
    found.reverse();
    let mut list = Element::new("items", NS_PUBSUB).attr("node", node);
    for item in &found {
        list = list.child(item_element(NS_PUBSUB, item));
    }
    iq_result(el).child(Element::new("pubsub", NS_PUBSUB).child(list))
}

/// `<item id='…'>payload</item>` in namespace `ns`.
fn item_element(ns: &str, item: &PepItem) -> Element {
    let mut e = Element::new("item", ns).attr("id", item.id.clone());
    match crate::protocol::xml::parse_element(&item.payload) {
        Some(p) => e = e.child(p),
        None => tracing::warn!(id = %item.id, "unparseable stored PEP payload left out"),
    }
    e
}

/// The access model and `max_items` asked by `<publish-options>` (XEP-0060 §7.1.5), or
/// the reply refusing them.
fn publish_options(
    pep: &Pep,
    el: &Element,
    pubsub: &Element,
) -> Result<Option<AccessModel>, Element> {
    let precondition = || {
        error(
            el,
            StanzaError::conflict(),
            Some(("precondition-not-met", "")),
        )
    };
    let Some(form) = pubsub
        .get_child("publish-options", NS_PUBSUB)
        .and_then(|o| o.get_child("x", NS_DATA))
    else {
        return Ok(None);
    };
    let mut access = None;
    for field in form.elements().filter(|f| f.is("field", NS_DATA)) {
        let value = field
            .get_child("value", NS_DATA)
            .map(|v| v.text_content())
            .unwrap_or_default();
        let value = value.trim();
        match field.get_attr("var").unwrap_or("") {
            "FORM_TYPE" if value != FORM_PUBLISH_OPTIONS => return Err(precondition()),
            "pubsub#access_model" => match AccessModel::parse(value) {
                Some(a) => access = Some(a),
                None => return Err(precondition()),
            },
            "pubsub#max_items" => {
                let limit = pep.live.get().limits.max_pep_items;
                if value != "max" && value.parse::<usize>().map_or(true, |n| n > limit) {
                    return Err(precondition());
                }
            }
            "pubsub#persist_items" if !matches!(value, "1" | "true") => return Err(precondition()),
            // Other options (send_last_published_item, notify_retract…) have this
            // service's fixed behaviour, which is what clients ask for.
            _ => {}
        }
    }
    Ok(access)
}

/// XEP-0060 §7.1 with XEP-0163 §3 auto-create.
async fn publish(
    pep: &Pep,
    session: &Client,
    el: &Element,
    pubsub: &Element,
    op: &Element,
) -> Element {
    let owner = session.jid().to_bare();
    let Some(node) = op.get_attr("node").filter(|n| !n.is_empty()) else {
        return error(
            el,
            StanzaError::bad_request(),
            Some(("nodeid-required", "")),
        );
    };
    let mut items = op.elements().filter(|i| i.is("item", NS_PUBSUB));
    let (Some(item), None) = (items.next(), items.next()) else {
        // XEP-0060 §7.1.3.6: PEP nodes are persistent, one item per publish.
        return error(el, StanzaError::bad_request(), Some(("item-required", "")));
    };
    let mut payloads = item.elements();
    let (Some(payload), None) = (payloads.next(), payloads.next()) else {
        // §7.1.3.7: exactly one payload element.
        return error(
            el,
            StanzaError::bad_request(),
            Some(("invalid-payload", "")),
        );
    };
    let payload = payload.to_xml();
    if too_big(pep, owner.as_str(), node, &payload) {
        return error(
            el,
            StanzaError::not_acceptable(),
            Some(("payload-too-big", "")),
        );
    }
    let access = match publish_options(pep, el, pubsub) {
        Ok(a) => a,
        Err(reply) => return reply,
    };
    let stored = PepItem {
        id: item
            .get_attr("id")
            .filter(|i| !i.is_empty())
            .map(str::to_owned)
            .unwrap_or_else(crate::protocol::xml::new_id),
        payload,
    };
    match store_and_notify(pep, &owner, node, access, &stored).await {
        Ok(()) => {}
        Err(Refused::AccessModelDiffers) => {
            return error(
                el,
                StanzaError::conflict(),
                Some(("precondition-not-met", "")),
            )
        }
        Err(Refused::TooManyNodes) => {
            return error(
                el,
                StanzaError::not_allowed(),
                Some(("max-nodes-exceeded", "")),
            );
        }
        // RFC 6120 §8.3.3.18: the account's storage is spent; retrying after the owner
        // deletes something may succeed.
        Err(Refused::OverBudget) => return error(el, StanzaError::resource_constraint(), None),
        Err(Refused::Store(e)) => return internal(el, e),
    }
    iq_result(el).child(
        Element::new("pubsub", NS_PUBSUB).child(
            Element::new("publish", NS_PUBSUB)
                .attr("node", node)
                .child(Element::new("item", NS_PUBSUB).attr("id", stored.id)),
        ),
    )
}

/// Whether a payload (serialised) is over `max_pep_item_size` (XEP-0060 §7.1.3.4).
fn too_big(pep: &Pep, owner: &str, node: &str, payload: &str) -> bool {
    let limit = pep.live.get().limits.max_pep_item_size;
    let over = payload.len() > limit;
    if over {
        tracing::info!(user = %owner, node, bytes = payload.len(), limit, "PEP item too big");
    }
    over
}

/// Why a publish stored nothing.
pub(crate) enum Refused {
    /// The node exists with another access model than the one asked (XEP-0060 §7.1.5).
    AccessModelDiffers,
    /// The owner has `max_pep_nodes` nodes already.
    TooManyNodes,
    /// The owner's payloads would exceed `max_pep_bytes`.
    OverBudget,
    /// The store failed.
    Store(crate::store::StoreError),
}

/// Stores `item` on `owner`'s `node` (created on first publish with `access`, `presence`
/// when none is asked, XEP-0163 §3) and notifies everyone the node's access model admits:
/// the one publish path, for clients' publishes and the vCard conversion alike.
pub(crate) async fn store_and_notify(
    pep: &Pep,
    owner: &BareJid,
    node: &str,
    access: Option<AccessModel>,
    item: &PepItem,
) -> Result<(), Refused> {
    let result = pep
        .store
        .pep_publish(owner.as_str(), node, access, item)
        .await;
    vcard::metadata_written(pep, owner.as_str(), node);
    let access = match result {
        Ok(Published::Stored { access_model }) => access_model,
        Ok(Published::AccessModelDiffers) => return Err(Refused::AccessModelDiffers),
        Ok(Published::TooManyNodes) => {
            tracing::info!(user = %owner, node, "PEP node limit reached");
            return Err(Refused::TooManyNodes);
        }
        Ok(Published::OverBudget) => {
            tracing::info!(user = %owner, node, "PEP byte budget reached");
            return Err(Refused::OverBudget);
        }
        Err(e) => return Err(Refused::Store(e)),
    };
    let event = Element::new("items", NS_PUBSUB_EVENT)
        .attr("node", node)
        .child(item_element(NS_PUBSUB_EVENT, item));
    notify::notify(pep, owner, node, access, event).await;
    Ok(())
}

/// XEP-0060 §7.2: deletes an item; notifies with `<retract/>` when asked to.
async fn retract(pep: &Pep, el: &Element, op: &Element, owner: &BareJid) -> Element {
    let Some(id) = op
        .get_child("item", NS_PUBSUB)
        .and_then(|i| i.get_attr("id"))
    else {
        return error(el, StanzaError::bad_request(), Some(("item-required", "")));
    };
    let (node, access) = match existing_node(pep, el, op, owner).await {
        Ok(n) => n,
        Err(reply) => return reply,
    };
    let retracted = pep.store.pep_retract(owner.as_str(), node, id).await;
    vcard::metadata_written(pep, owner.as_str(), node);
    match retracted {
        Ok(true) => {}
        Ok(false) => return error(el, StanzaError::item_not_found(), None),
        Err(e) => return internal(el, e),
    }
    if matches!(op.get_attr("notify"), Some("1" | "true")) {
        let event = Element::new("items", NS_PUBSUB_EVENT)
            .attr("node", node)
            .child(Element::new("retract", NS_PUBSUB_EVENT).attr("id", id));
        notify::notify(pep, owner, node, access, event).await;
    }
    iq_result(el)
}

/// XEP-0060 §8.4 delete and §8.5 purge, each with its event to those notified.
async fn drop_node(pep: &Pep, el: &Element, op: &Element, owner: &BareJid, what: &str) -> Element {
    let (node, access) = match existing_node(pep, el, op, owner).await {
        Ok(n) => n,
        Err(reply) => return reply,
    };
    let done = if what == "delete" {
        pep.store.pep_delete_node(owner.as_str(), node).await
    } else {
        pep.store.pep_purge(owner.as_str(), node).await
    };
    vcard::metadata_written(pep, owner.as_str(), node);
    match done {
        Ok(true) => {}
        Ok(false) => return error(el, StanzaError::item_not_found(), None),
        Err(e) => return internal(el, e),
    }
    let event = Element::new(what, NS_PUBSUB_EVENT).attr("node", node);
    notify::notify(pep, owner, node, access, event).await;
    iq_result(el)
}
