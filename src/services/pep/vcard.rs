//! XEP-0054 vcard-temp backed by the account's XEP-0084 avatar nodes, as XEP-0398
//! describes: clients that show avatars only through vCards (converse.js among them) and
//! clients that publish them over PEP see the same picture.
//!
//! | request | answer |
//! |---|---|
//! | `<vCard/>` get, own account | the stored vCard, its PHOTO the PEP avatar (if the image hashes to its id); an empty `<vCard/>` when there is neither (XEP-0054 §3.1) |
//! | `<vCard/>` get, another local user | the same for a viewer [`super::may_read`] admits (stored vCard: the `presence` access model; PHOTO: the avatar nodes' own models); `service-unavailable` when there is nothing this viewer may see (XEP-0054 §3.3) |
//! | `<vCard/>` set, own account | stored without PHOTO (at most `max_vcard_size` bytes, else `not-acceptable`); a PHOTO's BINVAL is published as `urn:xmpp:avatar:data` and `urn:xmpp:avatar:metadata` items (XEP-0398 §3.2), a vCard without one publishes the empty metadata that disables the avatar (XEP-0084 §4.5) |
//! | `<vCard/>` set, another user | `forbidden` (XEP-0054 §3.2) |
//!
//! The photo is never stored twice: the vCard row holds everything but a BINVAL PHOTO,
//! and a get builds the PHOTO from the avatar nodes, so a XEP-0084 publish, retract or
//! delete shows in the vCard at once.
//!
//! Who may read: a viewer the owner blocks (the router's XEP-0191 answer), a stranger, a
//! contact whose presence the owner hides, and anyone asking about an account that does
//! not exist all get the one answer a user with no vCard and no avatar gives:
//! `service-unavailable` (XEP-0054 §3.3), so no answer tells them apart. (A viewer who
//! blocks the owner is told so by its own block list first, XEP-0191 §3.6.)
//!
//! The user's available presence (broadcast or directed) carries the avatar's XEP-0153
//! hash (`<x xmlns='vcard-temp:x:update'><photo>sha1</photo></x>`, XEP-0398 §4) when the
//! user has avatar metadata, so vCard clients fetch the picture when it changes.

use base64::Engine as _;
use sha1::{Digest, Sha1};

use super::Pep;
use crate::node::session::Client;
use crate::protocol::error::{iq_result, StanzaError};
use crate::protocol::jid::{BareJid, Jid};
use crate::protocol::stanza::IqType;
use crate::protocol::xml::{Element, Node};
use crate::services::presence::gate;
use crate::store::pep::{AccessModel, PepItem};
use crate::store::StoreError;

use super::{may_read, store_and_notify, Refused};

/// XEP-0054.
pub(crate) const NS_VCARD: &str = "vcard-temp";
/// XEP-0153's element in presence.
pub(crate) const NS_VCARD_UPDATE: &str = "vcard-temp:x:update";
/// XEP-0398 §3: the server converts between vCard PHOTO and the PEP avatar.
pub(crate) const FEATURE_CONVERSION: &str = "urn:xmpp:pep-vcard-conversion:0";
/// XEP-0084 data node (and the payload's namespace).
pub(crate) const NODE_DATA: &str = "urn:xmpp:avatar:data";
/// XEP-0084 metadata node (and the payload's namespace).
pub(crate) const NODE_METADATA: &str = "urn:xmpp:avatar:metadata";

/// Whether an iq payload is a vcard-temp request.
pub(crate) fn handles(payload: &Element) -> bool {
    payload.is("vCard", NS_VCARD)
}

/// Answers a vcard-temp iq request `el` of type `ty` sent by `session` to the account
/// `owner` (its own, or another local user's).
pub(super) async fn handle_iq(
    pep: &Pep,
    session: &Client,
    el: &Element,
    ty: IqType,
    owner: &BareJid,
) -> Element {
    let requester = Jid::from(session.jid().clone());
    let own = gate::bare_of(requester.as_str()) == owner.as_str();
    let Some(card) = el.elements().next() else {
        return reply_error(el, StanzaError::bad_request());
    };
    match ty {
        IqType::Get => match view(pep, &requester, owner).await {
            Ok(Some(card)) => iq_result(el).child(card),
            // XEP-0054 §3.1: the own account's empty vCard.
            Ok(None) if own => iq_result(el).child(Element::new("vCard", NS_VCARD)),
            // §3.3: no vCard; the same whatever hid it.
            Ok(None) => reply_error(el, StanzaError::service_unavailable()),
            Err(e) => internal(el, e),
        },
        // XEP-0054 §3.2: only the user sets their own vCard.
        IqType::Set if own => set(pep, el, card, owner).await,
        _ => reply_error(el, StanzaError::forbidden()),
    }
}

fn reply_error(el: &Element, err: StanzaError) -> Element {
    err.reply_to(el)
        .unwrap_or_else(|| crate::protocol::error::reply_skeleton(el, "error"))
}

fn internal(el: &Element, e: StoreError) -> Element {
    tracing::warn!(error = %e, "vCard store operation failed");
    reply_error(el, StanzaError::internal_server_error())
}

/// The avatar a viewer may see, as XEP-0084 holds it.
struct Avatar {
    mime: String,
    base64: String,
}

/// May `viewer` read nodes of these access models? One gate question per model.
struct Reader<'a> {
    pep: &'a Pep,
    viewer: &'a Jid,
    owner: &'a BareJid,
    known: Vec<(AccessModel, bool)>,
}

impl Reader<'_> {
    async fn may(&mut self, access: AccessModel) -> bool {
        if let Some((_, b)) = self.known.iter().find(|(a, _)| *a == access) {
            return *b;
        }
        let b = may_read(self.pep, access, self.viewer, self.owner).await;
        self.known.push((access, b));
        b
    }
}

/// The vCard `viewer` is shown of local user `owner`: the stored one if the viewer may
/// read a `presence` node of the owner, with the PEP avatar as PHOTO if the viewer may
/// read both avatar nodes; `None` when neither is there for this viewer.
pub(crate) async fn view(
    pep: &Pep,
    viewer: &Jid,
    owner: &BareJid,
) -> Result<Option<Element>, StoreError> {
    let mut reader = Reader {
        pep,
        viewer,
        owner,
        known: Vec::new(),
    };
    let mut card = None;
    if reader.may(AccessModel::Presence).await {
        if let Some(stored) = pep.store.vcard(owner.as_str()).await? {
            match crate::protocol::xml::parse_element(&stored) {
                Some(c) if handles(&c) => card = Some(c),
                _ => tracing::warn!(user = %owner, "unparseable stored vCard left out"),
            }
        }
    }
    if let Some(avatar) = avatar(pep, &mut reader).await? {
        let card = card.get_or_insert_with(|| Element::new("vCard", NS_VCARD));
        card.remove_children("PHOTO", NS_VCARD);
        card.children.push(Node::Element(
            Element::new("PHOTO", NS_VCARD)
                .child(Element::new("TYPE", NS_VCARD).text(avatar.mime))
                .child(Element::new("BINVAL", NS_VCARD).text(avatar.base64)),
        ));
    }
    Ok(card)
}

/// The newest item of `owner`'s `node` (of those with `ids`, when given), parsed, with
/// the node's access model. A node without items costs one read.
async fn newest(
    pep: &Pep,
    owner: &str,
    node: &str,
    ids: &[String],
) -> Result<Option<(AccessModel, Element)>, StoreError> {
    let items = pep.store.pep_items(owner, node, ids, 1).await?;
    let Some(payload) = items
        .into_iter()
        .next()
        .and_then(|i| crate::protocol::xml::parse_element(&i.payload))
    else {
        return Ok(None);
    };
    Ok(pep
        .store
        .pep_node(owner, node)
        .await?
        .map(|access| (access, payload)))
}

/// The `<info/>` of a metadata payload whose image is in the data node (XEP-0398 §3.1:
/// the one without a `url`): its id (the SHA-1 of the image) and type.
fn info_of(metadata: &Element) -> Option<(String, String)> {
    metadata
        .elements()
        .filter(|i| i.is("info", NODE_METADATA) && i.get_attr("url").is_none())
        .find_map(|i| {
            Some((
                i.get_attr("id")?.to_owned(),
                i.get_attr("type").unwrap_or("image/png").to_owned(),
            ))
        })
}

/// The avatar the reader's viewer may see: the newest metadata's image from the data node.
async fn avatar(pep: &Pep, reader: &mut Reader<'_>) -> Result<Option<Avatar>, StoreError> {
    let owner = reader.owner.as_str();
    let Some((access, metadata)) = newest(pep, owner, NODE_METADATA, &[]).await? else {
        return Ok(None);
    };
    if !reader.may(access).await {
        return Ok(None);
    }
    let Some((id, mime)) = info_of(&metadata) else {
        return Ok(None);
    };
    let Some((access, data)) = newest(pep, owner, NODE_DATA, std::slice::from_ref(&id)).await?
    else {
        return Ok(None);
    };
    if !reader.may(access).await || !data.is("data", NODE_DATA) {
        return Ok(None);
    }
    let base64: String = data
        .text_content()
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    // XEP-0398 §3.1: the image must hash to its id, the hash vCard clients compare with
    // the one in presence; an image that does not is not shown.
    let image = base64::engine::general_purpose::STANDARD
        .decode(&base64)
        .unwrap_or_default();
    if image.is_empty() || sha1_hex(&image) != id {
        tracing::info!(user = %owner, id, "avatar data does not hash to its id; not shown");
        return Ok(None);
    }
    Ok(Some(Avatar { mime, base64 }))
}

/// The SHA-1 of `bytes` in lower-case hex (XEP-0084 §4.2 item ids, XEP-0153 hashes).
fn sha1_hex(bytes: &[u8]) -> String {
    Sha1::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The XEP-0153 hash the owner's presence carries: `Some(id)` of the current avatar,
/// `Some("")` when the metadata says there is none (XEP-0084 §4.5), `None` when the user
/// never published metadata or keeps it to themselves (`whitelist`).
///
/// Kept in [`Pep::avatar_hashes`] so that a presence costs no store read; every write to
/// the metadata node on this node drops the kept value ([`metadata_written`]).
pub(crate) async fn photo_hash(pep: &Pep, owner: &str) -> Result<Option<String>, StoreError> {
    let noted = match pep.avatar_hashes.get(owner) {
        Ok(kept) => return Ok(kept),
        Err(noted) => noted,
    };
    let hash = match newest(pep, owner, NODE_METADATA, &[]).await? {
        None => None,
        Some((AccessModel::Whitelist, _)) => None,
        Some((_, metadata)) => Some(info_of(&metadata).map(|(id, _)| id).unwrap_or_default()),
    };
    pep.avatar_hashes.put(owner, noted, hash.clone());
    Ok(hash)
}

/// Called after every store write to one of `owner`'s PEP nodes (publish, retract, purge,
/// delete): a write to the avatar metadata node makes the kept hash stale.
pub(crate) fn metadata_written(pep: &Pep, owner: &str, node: &str) {
    if node == NODE_METADATA {
        pep.avatar_hashes.invalidate(owner);
    }
}

/// XEP-0398 §4: puts the avatar's hash into an available presence of the user when the
/// user has avatar metadata, unless the client said it has no avatar to show (an empty
/// `<photo/>`, which is left alone); an `<x/>` without `<photo/>` or with another hash is
/// overwritten.
pub(super) async fn stamp_presence(pep: &Pep, owner: &str, presence: &mut Element) {
    let client_photo = presence
        .get_child("x", NS_VCARD_UPDATE)
        .and_then(|x| x.get_child("photo", NS_VCARD_UPDATE))
        .map(|p| p.text_content());
    if client_photo.is_some_and(|p| p.trim().is_empty()) {
        return;
    }
    let hash = match photo_hash(pep, owner).await {
        Ok(Some(h)) => h,
        Ok(None) => return,
        Err(e) => {
            tracing::warn!(error = %e, user = %owner, "avatar hash unavailable for presence");
            return;
        }
    };
    presence.remove_children("x", NS_VCARD_UPDATE);
    let mut photo = Element::new("photo", NS_VCARD_UPDATE);
    if !hash.is_empty() {
        photo = photo.text(hash);
    }
    presence.children.push(Node::Element(
        Element::new("x", NS_VCARD_UPDATE).child(photo),
    ));
}

/// A MIME type for an image whose vCard gave none, from its first bytes.
fn sniff(image: &[u8]) -> &'static str {
    match image {
        [0x89, b'P', b'N', b'G', ..] => "image/png",
        [0xFF, 0xD8, ..] => "image/jpeg",
        [b'G', b'I', b'F', b'8', ..] => "image/gif",
        [b'R', b'I', b'F', b'F', _, _, _, _, b'W', b'E', b'B', b'P', ..] => "image/webp",
        _ => "application/octet-stream",
    }
}

/// XEP-0054 §3.2 set with XEP-0398 §3.2: the PHOTO becomes the PEP avatar, the rest is
/// stored.
async fn set(pep: &Pep, el: &Element, card: &Element, owner_jid: &BareJid) -> Element {
    let owner = owner_jid.as_str();
    if !handles(card) {
        return reply_error(el, StanzaError::bad_request());
    }
    let limit = pep.live.get().limits.max_vcard_size;
    let size = card.to_xml().len();
    if size > limit {
        tracing::info!(user = %owner, bytes = size, limit, "vCard too big");
        return reply_error(el, StanzaError::not_acceptable());
    }
    let photo = card.get_child("PHOTO", NS_VCARD);
    let binval: String = photo
        .and_then(|p| p.get_child("BINVAL", NS_VCARD))
        .map(|b| b.text_content())
        .unwrap_or_default()
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    let mut stored = card.clone();
    if photo.is_some_and(|p| p.get_child("BINVAL", NS_VCARD).is_some()) {
        // The picture is the avatar's (a PHOTO with only an EXTVAL is kept as it is).
        stored.remove_children("PHOTO", NS_VCARD);
    }
    if !binval.is_empty() {
        let Ok(image) = base64::engine::general_purpose::STANDARD.decode(&binval) else {
            return reply_error(el, StanzaError::bad_request());
        };
        let mime = photo
            .and_then(|p| p.get_child("TYPE", NS_VCARD))
            .map(|t| t.text_content().trim().to_owned())
            .filter(|t| !t.is_empty())
            .unwrap_or_else(|| sniff(&image).to_owned());
        let id = sha1_hex(&image);
        let data = PepItem {
            id: id.clone(),
            payload: Element::new("data", NODE_DATA).text(binval).to_xml(),
        };
        if super::too_big(pep, owner, NODE_DATA, &data.payload) {
            return reply_error(el, StanzaError::not_acceptable());
        }
        let metadata = PepItem {
            id: id.clone(),
            payload: Element::new("metadata", NODE_METADATA)
                .child(
                    Element::new("info", NODE_METADATA)
                        .attr("bytes", image.len().to_string())
                        .attr("id", id)
                        .attr("type", mime),
                )
                .to_xml(),
        };
        // XEP-0084 §4.1: the data first, so a client told of the metadata finds it.
        for (node, item) in [(NODE_DATA, &data), (NODE_METADATA, &metadata)] {
            if let Err(r) = store_and_notify(pep, owner_jid, node, None, item).await {
                return refused(el, r);
            }
        }
    } else {
        match photo_hash(pep, owner).await {
            Ok(Some(h)) if !h.is_empty() => {
                // XEP-0084 §4.5: a vCard without a picture disables the avatar.
                let none = PepItem {
                    id: "current".to_owned(),
                    payload: Element::new("metadata", NODE_METADATA).to_xml(),
                };
                if let Err(r) = store_and_notify(pep, owner_jid, NODE_METADATA, None, &none).await {
                    return refused(el, r);
                }
            }
            Ok(_) => {}
            Err(e) => return internal(el, e),
        }
    }
    match pep.store.set_vcard(owner, &stored.to_xml()).await {
        Ok(()) => iq_result(el),
        Err(e) => internal(el, e),
    }
}

/// The answer to a vCard set whose avatar could not be published.
fn refused(el: &Element, r: Refused) -> Element {
    match r {
        Refused::Store(e) => internal(el, e),
        // The avatar nodes' own limits and models (XEP-0060 §7.1.3): the vCard is not
        // stored either.
        Refused::TooManyNodes => reply_error(el, StanzaError::not_allowed()),
        Refused::OverBudget => reply_error(el, StanzaError::resource_constraint()),
        Refused::AccessModelDiffers => reply_error(el, StanzaError::conflict()),
    }
}
