//! RFC 6121 presence: broadcast (§4.2, §4.4, §4.5), probes (§4.3), directed presence (§4.6)
//! and subscription handling (§3), for local users.
//!
//! Decisions come from pure code: [`subscription`] says what a subscription stanza does to
//! both roster items, [`privacy`] says who may see what. This module loads state, asks them,
//! stores the result in one transaction, and sends what they said to send.
//!
//! Who receives a user's presence: contacts whose item says `from` or `both` (the contact's
//! own item says `to`/`both` — checked again on the contact's side when answering probes,
//! so a stale or one-sided row never leaks presence), the user's own available resources,
//! and anyone the user sent directed presence to. Nobody else.

pub mod privacy;
pub mod remote;
pub mod subscription;

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::c2s::Session;
use crate::error::StanzaError;
use crate::jid::{BareJid, FullJid};
use crate::router::Target;
use crate::server::Shared;
use crate::sessions::SessionHandle;
use crate::store::RosterItem;
use crate::xml::{Element, NS_CLIENT, NS_DELAY};

use subscription::{SubKind, SubState};

/// Presence bookkeeping owned by one session task.
#[derive(Debug, Default)]
pub struct SessionPresence {
    /// JIDs this session sent directed available presence to and that must get its
    /// unavailable (RFC 6121 §4.6.3).
    pub directed: BTreeSet<String>,
}

pub(crate) fn presence(ty: Option<&str>, from: &str, to: &str) -> Element {
    let mut p = Element::new("presence", NS_CLIENT)
        .attr("from", from)
        .attr("to", to);
    if let Some(t) = ty {
        p.set_attr("type", t);
    }
    p
}

/// Available sessions of a local user (those that sent initial presence, RFC 6121 §4.2).
pub(crate) fn available(shared: &Shared, bare: &str) -> Vec<SessionHandle> {
    shared
        .sessions
        .of_user_str(bare)
        .into_iter()
        .filter(|s| s.presence().available)
        .collect()
}

/// Delivers `el` to every available resource of local user `bare` (RFC 6121 §4.2.3, §3.1.3).
/// Returns how many sessions got it.
pub(crate) fn deliver_to_available(shared: &Shared, bare: &str, el: &Element) -> usize {
    let targets = available(shared, bare);
    for s in &targets {
        s.send(el.clone());
    }
    targets.len()
}

/// Handles a presence stanza from the session's own client.
pub async fn from_client(session: &mut Session, el: Element, target: Target) {
    let ty = el.get_attr("type").map(str::to_owned);
    let own_bare = session.jid().to_bare();
    match ty.as_deref() {
        None | Some("unavailable") => {
            let available = ty.is_none();
            let is_available = available;
            match target {
                Target::OwnAccount => broadcast(session, el, available).await,
                Target::LocalBare(b) if b == own_bare => broadcast(session, el, available).await,
                Target::LocalDomain(_) => {}
                Target::Remote(j) => {
                    if is_available {
                        session.presence.directed.insert(j.to_string());
                    } else {
                        session.presence.directed.remove(j.as_str());
                    }
                    let _ = crate::s2s::route_remote(&session.shared, el);
                }
                Target::LocalBare(_) | Target::LocalFull(_) => {
                    directed(session, el, available).await
                }
            }
        }
        Some(kind @ ("subscribe" | "subscribed" | "unsubscribe" | "unsubscribed")) => {
            let Ok(kind) = SubKind::parse(kind) else {
                return;
            };
            let contact = match target {
                Target::LocalBare(b) => b,
                // RFC 6121 §3.1.2: subscriptions are between bare JIDs.
                Target::LocalFull(f) => f.to_bare(),
                Target::Remote(j) => {
                    // The same state machine, with the contact's side on its own server.
                    remote::outbound_subscription(session, &j.to_bare(), kind, el).await;
                    return;
                }
                Target::OwnAccount | Target::LocalDomain(_) => return,
            };
            if contact == own_bare {
                return;
            }
            outbound_subscription(session, &contact, kind, el, true).await;
        }
        // RFC 6121 §4.3: probes are the server's business; a client's is ignored.
        Some("probe") => {}
        Some("error") => {
            if let Target::LocalFull(f) = target {
                if let Some(s) = session.shared.sessions.get(&f) {
                    s.send(el);
                }
            }
        }
        Some(_) => {
            if let Some(r) = StanzaError::bad_request().reply_to(&el) {
                session.deliver(r);
            }
        }
    }
}

/// The priority of an available presence (RFC 6121 §4.7.2.3); out of range or absent is 0.
fn priority_of(el: &Element) -> i8 {
    el.get_child("priority", NS_CLIENT)
        .and_then(|p| p.text_content().trim().parse::<i8>().ok())
        .unwrap_or(0)
}

async fn roster_of(shared: &Shared, bare: &str) -> Vec<RosterItem> {
    match shared.store.roster(bare).await {
        Ok((_, items)) => items,
        Err(e) => {
            // RFC-conformant degradation: with no roster we tell nobody, never everybody.
            tracing::warn!(user = bare, error = %e, "roster unavailable; presence not broadcast");
            Vec::new()
        }
    }
}

/// Broadcast of available (§4.2 initial, §4.4 update) or unavailable (§4.5) presence.
async fn broadcast(session: &mut Session, mut el: Element, is_available: bool) {
    let shared = session.shared.clone();
    let me = session.jid().clone();
    let bare = me.to_bare();
    el.remove_attr("to");
    el.set_attr("from", me.to_string());
    let was_available = session.handle.presence().available;
    if let Ok(mut info) = session.handle.info.lock() {
        info.available = is_available;
        info.priority = if is_available { priority_of(&el) } else { 0 };
        info.last = is_available.then(|| el.clone());
    }
    if !is_available && !was_available && session.presence.directed.is_empty() {
        return;
    }
    let roster = roster_of(&shared, bare.as_str()).await;
    // Contacts who may see the user (RFC 6121 §4.2.2 / §4.4.2 / §4.5.2).
    for item in roster.iter().filter(|i| i.subscription.has_from()) {
        if !shared.config.serves(domain_of(&item.contact)) {
            // One stanza per remote contact; s2s sends them over that domain's one stream.
            let mut p = el.clone();
            p.set_attr("to", item.contact.clone());
            let _ = crate::s2s::route_remote(&shared, p);
            continue;
        }
        let mut p = el.clone();
        p.set_attr("to", item.contact.clone());
        deliver_to_available(&shared, &item.contact, &p);
        session.presence.directed.remove(&item.contact);
    }
    // The user's own resources, the sender included (§4.2.2).
    for s in shared.sessions.of_user(&bare) {
        if s.presence().available || s.id == session.handle.id {
            let mut p = el.clone();
            p.set_attr("to", s.jid.to_string());
            s.send(p);
        }
    }
    if !is_available {
        // §4.6.3: everyone who got directed presence gets the unavailable too.
        for to in std::mem::take(&mut session.presence.directed) {
            let mut p = el.clone();
            p.set_attr("to", to.clone());
            if shared.config.serves(domain_of(bare_of(&to))) {
                deliver_directed(&shared, &to, p);
            } else {
                let _ = crate::s2s::route_remote(&shared, p);
            }
        }
        return;
    }
    if was_available {
        return;
    }
    // Initial presence: probe the contacts the user is subscribed to (§4.2.2, §4.3).
    for item in roster.iter().filter(|i| i.subscription.has_to()) {
        if shared.config.serves(domain_of(&item.contact)) {
            answer_probe(&shared, &me, &item.contact).await;
        } else {
            // RFC 6121 §4.3.1: probes to remote contacts go from the user's bare JID.
            let probe = presence(Some("probe"), bare.as_str(), &item.contact);
            let _ = crate::s2s::route_remote(&shared, probe);
        }
    }
    // The new resource learns the presence of the user's other resources.
    for s in shared.sessions.of_user(&bare) {
        if s.id == session.handle.id {
            continue;
        }
        if let Some(mut last) = s.presence().last {
            last.set_attr("to", me.to_string());
            session.deliver(last);
        }
    }
    // §3.1.3: subscription requests that waited for the user to come online.
    match shared.store.pending_subscriptions(bare.as_str()).await {
        Ok(pending) => {
            for (from, xml) in pending {
                match crate::xml::parse_element(&xml) {
                    Some(mut p) => {
                        p.set_attr("to", bare.to_string());
                        p.set_attr("from", from);
                        session.deliver(p);
                    }
                    None => tracing::warn!(user = %bare, "unparseable stored subscription request"),
                }
            }
        }
        Err(e) => tracing::warn!(user = %bare, error = %e, "pending subscriptions unavailable"),
    }
}

fn bare_of(jid: &str) -> &str {
    jid.split_once('/').map(|(b, _)| b).unwrap_or(jid)
}

fn domain_of(bare: &str) -> &str {
    bare.rsplit_once('@').map(|(_, d)| d).unwrap_or(bare)
}

/// Answers, on the contact's behalf, a probe from `prober` for local contact `contact`
/// (RFC 6121 §4.3.2). Only a prober with an approved subscription (the contact's item says
/// `from`/`both`) gets anything at all — no unavailable, no error (the Openfire OF-820 leak).
async fn answer_probe(shared: &Shared, prober: &FullJid, contact: &str) {
    let prober_bare = prober.to_bare();
    let item = match shared
        .store
        .roster_item(contact, prober_bare.as_str())
        .await
    {
        Ok(i) => i,
        Err(e) => {
            tracing::warn!(contact, error = %e, "probe: roster unavailable");
            return;
        }
    };
    if !item.is_some_and(|i| i.subscription.has_from()) {
        return;
    }
    let Some(prober_session) = shared.sessions.get(prober) else {
        return;
    };
    let online = available(shared, contact);
    if online.is_empty() {
        prober_session.send(unavailable_with_last_seen(shared, contact, prober).await);
        return;
    }
    for s in online {
        if let Some(mut last) = s.presence().last {
            last.set_attr("to", prober.to_string());
            prober_session.send(last);
        }
    }
}

/// `<presence type='unavailable'/>` from a bare JID, stamped with when it was last seen
/// (XEP-0203 delay) if the store knows.
async fn unavailable_with_last_seen(shared: &Shared, contact: &str, to: &FullJid) -> Element {
    let mut p = presence(Some("unavailable"), contact, to.as_str());
    if let Some(at) = crate::presence::last_seen(shared, contact).await {
        p = p.child(
            Element::new("delay", NS_DELAY)
                .attr("from", domain_of(contact))
                .attr(
                    "stamp",
                    at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                ),
        );
    }
    p
}

/// When a local user was last seen, if known.
pub async fn last_seen(_shared: &Shared, _bare: &str) -> Option<chrono::DateTime<chrono::Utc>> {
    None
}

fn deliver_directed(shared: &Shared, to: &str, el: Element) {
    match crate::jid::Jid::new(to) {
        Ok(j) if j.resource().is_some() => {
            if let Ok(full) = j.try_into_full() {
                if let Some(s) = shared.sessions.get(&full) {
                    s.send(el);
                }
            }
        }
        Ok(j) => {
            deliver_to_available(shared, j.as_str(), &el);
        }
        Err(_) => {}
    }
}

/// Directed presence (RFC 6121 §4.6): delivered to the one recipient and remembered, so the
/// user's unavailable reaches it too.
async fn directed(session: &mut Session, mut el: Element, is_available: bool) {
    let Some(to) = el.get_attr("to").map(str::to_owned) else {
        return;
    };
    el.set_attr("from", session.jid().to_string());
    if is_available {
        if session.handle.presence().available {
            session.presence.directed.insert(to.clone());
        }
    } else {
        session.presence.directed.remove(&to);
    }
    deliver_directed(&session.shared, &to, el);
}

/// Loads one side's item and Appendix A state; the pending inbound request lives in the
/// pending table when no roster item exists (RFC 6121 §3.1.3: a request creates no item).
pub(crate) async fn load_side(
    shared: &Shared,
    owner: &str,
    contact: &str,
) -> Result<(Option<RosterItem>, SubState), crate::store::StoreError> {
    let item = shared.store.roster_item(owner, contact).await?;
    let mut state = item.as_ref().map(|i| i.sub_state()).unwrap_or_default();
    if !state.pending_in {
        let pending = shared.store.pending_subscriptions(owner).await?;
        state.pending_in = pending.iter().any(|(from, _)| from == contact);
    }
    Ok((item, state.normalized()))
}

/// What must be written for one side after a transition: the item, or nothing when the
/// item does not exist and the new state would be invisible.
pub(crate) fn updated_item(
    owner_item: Option<RosterItem>,
    contact: &str,
    state: SubState,
) -> Option<RosterItem> {
    let mut item = owner_item.clone();
    let invisible = state.subscription == subscription::Subscription::None
        && !state.pending_out
        && !state.preapproved;
    match &mut item {
        Some(i) => {
            if i.sub_state() == state {
                return None;
            }
            i.set_sub_state(state);
        }
        None if invisible => return None,
        None => {
            let mut i = RosterItem::new(contact);
            i.set_sub_state(state);
            // A pending inbound request without an item is kept in the pending table.
            item = Some(i);
        }
    }
    item
}

/// An outbound subscription stanza from the session's user to local `contact`
/// (RFC 6121 §3.1.2, §3.2.2, §3.3.2, §3.4), and its inbound processing on the contact's
/// side (§3.1.3, §3.2.3, §3.3.3), stored in one transaction.
pub async fn outbound_subscription(
    session: &mut Session,
    contact: &BareJid,
    kind: SubKind,
    stanza: Element,
    push_user: bool,
) {
    let shared = session.shared.clone();
    if let Err(e) =
        apply_subscription(&shared, session.jid(), contact, kind, stanza, push_user).await
    {
        tracing::warn!(user = %session.jid(), %contact, error = %e, "subscription change failed");
    }
}

async fn apply_subscription(
    shared: &Arc<Shared>,
    user_full: &FullJid,
    contact: &BareJid,
    kind: SubKind,
    mut stanza: Element,
    push_user: bool,
) -> Result<(), crate::store::StoreError> {
    let user = user_full.to_bare();
    let (u_item, u_state) = load_side(shared, user.as_str(), contact.as_str()).await?;
    let out = subscription::outbound(u_state, kind);
    let contact_node = contact.node().map(|n| n.as_str()).unwrap_or("");
    let contact_exists = shared
        .store
        .account_exists(contact_node, contact.domain().as_str())
        .await?;
    // RFC 6121 §3.1.2: stamp bare JIDs on both ends.
    stanza.set_attr("from", user.to_string());
    stanza.set_attr("to", contact.to_string());

    let mut writes: Vec<(String, RosterItem)> = Vec::new();
    let mut u_final = out.state;
    let mut c_effects = None;
    if out.route && contact_exists {
        let (c_item, c_state) = load_side(shared, contact.as_str(), user.as_str()).await?;
        let inb = subscription::inbound(c_state, kind);
        if let Some(reply) = inb.auto_reply {
            // The contact's server answers on the contact's behalf (e.g. pre-approval).
            let back = subscription::inbound(u_final, reply);
            u_final = back.state;
            c_effects = Some((c_item, c_state, inb, Some((reply, back))));
        } else {
            c_effects = Some((c_item, c_state, inb, None));
        }
    } else if out.route && kind == SubKind::Subscribe {
        // §3.1.3: no such contact: the user gets an unsubscribed on the contact's behalf.
        let back = subscription::inbound(u_final, SubKind::Unsubscribed);
        u_final = back.state;
    }
    let u_write = updated_item(u_item.clone(), contact.as_str(), u_final);
    if let Some(i) = &u_write {
        writes.push((user.to_string(), i.clone()));
    }
    let c_write = c_effects
        .as_ref()
        .and_then(|(c_item, _, inb, _)| updated_item(c_item.clone(), user.as_str(), inb.state));
    if let Some(i) = &c_write {
        writes.push((contact.to_string(), i.clone()));
    }
    let versions = if writes.is_empty() {
        Vec::new()
    } else {
        shared.store.apply_subscription_change(&writes).await?
    };
    // The pending table follows the inbound-request flag of each side.
    if u_state.pending_in && !u_final.pending_in {
        shared
            .store
            .remove_pending_subscription(user.as_str(), contact.as_str())
            .await?;
    }
    if let Some((_, c_state, inb, _)) = &c_effects {
        if inb.state.pending_in && kind == SubKind::Subscribe {
            shared
                .store
                .add_pending_subscription(contact.as_str(), user.as_str(), &stanza.to_xml())
                .await?;
        } else if c_state.pending_in && !inb.state.pending_in {
            shared
                .store
                .remove_pending_subscription(contact.as_str(), user.as_str())
                .await?;
        }
    }

    // Side effects, in the order RFC 6121 gives them.
    if out.send_unavailable && contact_exists {
        // §3.2.2: unavailable from each of the user's resources before the unsubscribed.
        for s in available(shared, user.as_str()) {
            let p = presence(Some("unavailable"), s.jid.as_str(), contact.as_str());
            deliver_to_available(shared, contact.as_str(), &p);
        }
    }
    if let Some((_, _, inb, auto)) = &c_effects {
        if inb.deliver {
            deliver_to_available(shared, contact.as_str(), &stanza);
        }
        if let Some((reply, back)) = auto {
            if back.deliver {
                let p = presence(Some(reply.as_str()), contact.as_str(), user.as_str());
                deliver_to_available(shared, user.as_str(), &p);
            }
        }
        if inb.send_presence {
            // §3.1.5 / §4.3.2: the contact's current presence goes to the new subscriber.
            send_current_presence(shared, contact.as_str(), user.as_str());
        }
        if inb.send_unavailable {
            // §3.3.3: the user no longer sees the contact.
            for s in available(shared, contact.as_str()) {
                let p = presence(Some("unavailable"), s.jid.as_str(), user.as_str());
                deliver_to_available(shared, user.as_str(), &p);
            }
        }
    } else if out.route && kind == SubKind::Subscribe && !contact_exists {
        let p = presence(Some("unsubscribed"), contact.as_str(), user.as_str());
        deliver_to_available(shared, user.as_str(), &p);
    }
    if out.send_presence && contact_exists {
        // §3.1.5: after approving, the contact gets the user's current presence.
        send_current_presence(shared, user.as_str(), contact.as_str());
    }
    // Roster pushes (RFC 6121 §2.1.6) with the versions the transaction produced.
    for (owner, version) in &versions {
        let item = if owner == user.as_str() {
            &u_write
        } else {
            &c_write
        };
        if let Some(item) = item {
            if owner == user.as_str() && !push_user {
                continue;
            }
            if crate::roster::is_visible(item) {
                crate::roster::push_item(shared, owner, *version, item);
            }
        }
    }
    Ok(())
}

/// Sends the current presence of every available resource of `from_user` to the available
/// resources of `to_user` (both local).
fn send_current_presence(shared: &Shared, from_user: &str, to_user: &str) {
    for s in available(shared, from_user) {
        if let Some(mut last) = s.presence().last {
            last.set_attr("to", to_user);
            deliver_to_available(shared, to_user, &last);
        }
    }
}

/// RFC 6121 §2.5.2: removing a roster item cancels and revokes subscriptions first.
pub async fn roster_removed(session: &mut Session, item: &RosterItem) {
    let Ok(contact) = BareJid::new(&item.contact) else {
        return;
    };
    if !session.shared.config.serves(contact.domain().as_str()) {
        remote::roster_removed(session, &contact, item.sub_state());
        return;
    }
    for kind in subscription::roster_remove(item.sub_state()) {
        let stanza = presence(
            Some(kind.as_str()),
            session.jid().as_str(),
            contact.as_str(),
        );
        outbound_subscription(session, &contact, kind, stanza, false).await;
    }
}

/// Called when a session ends: an available session's contacts get unavailable
/// (RFC 6121 §4.5.2: the server does this when the client did not).
pub async fn session_ended(session: &mut Session) {
    let available = session.handle.presence().available;
    if available || !session.presence.directed.is_empty() {
        let p = Element::new("presence", NS_CLIENT).attr("type", "unavailable");
        broadcast(session, p, false).await;
    }
}
