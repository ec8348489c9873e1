//! RFC 6121 presence with contacts on other servers: the local half of each exchange.
//!
//! Subscription stanzas are planned and applied as for local contacts ([`Exchange`], the
//! one planner over the *local* user's roster item); only the other side lives on another
//! server, which keeps its own roster and answers over federation. Everything that leaves goes through
//! [`crate::node::outbox::Outbox::route_remote`], which sends it over that domain's one stream.
//!
//! Inbound, from an authenticated server stream:
//!
//! - subscription stanzas move the local user's item through RFC 6121 Appendix A.3;
//! - probes are answered on the local user's behalf only to an approved subscriber (the
//!   user's item says `from`/`both`, RFC 6121 §4.3.2) who is not blocked; anyone else gets
//!   silence, so a probe reveals nothing, not even that the account exists;
//! - available/unavailable presence addressed to a bare JID reaches the user's available
//!   resources only if the user is subscribed to the sender (`to`/`both`); presence to a
//!   full JID is directed presence (RFC 6121 §4.6) and reaches that resource.

use super::Presence;
use crate::protocol::jid::bare_of;
use crate::protocol::jid::{BareJid, Jid};
use crate::protocol::stanza::PresenceType;
use crate::protocol::xml::Element;
use crate::store::StoreError;

use super::subscription::{Direction, SubKind};
use super::{presence, Exchange};
/// A presence stanza from an authenticated remote server (its `from` domain was checked
/// by the stream, which parsed its addresses). Dispatches by type.
pub async fn inbound(pres: &Presence, from: Jid, to: Jid, el: Element) {
    // A type RFC 6121 does not define is dropped: a server's stanza gets no error back.
    let Some(ty) = PresenceType::of(&el) else {
        return;
    };
    match ty {
        PresenceType::Available | PresenceType::Unavailable => {
            presence_update(pres, &from, &to, el, ty == PresenceType::Available).await
        }
        PresenceType::Probe => probe(pres, &from, &to).await,
        PresenceType::Subscribe
        | PresenceType::Subscribed
        | PresenceType::Unsubscribe
        | PresenceType::Unsubscribed => {
            let Some(kind) = SubKind::of(ty) else { return };
            let (Some(_), Some(_)) = (from.node(), to.node()) else {
                return;
            };
            let (contact, user) = (from.to_bare(), to.to_bare());
            let _locks = pres
                .roster_locks
                .lock(&[user.as_str(), contact.as_str()])
                .await;
            if let Err(e) = inbound_subscription(pres, &user, &contact, kind, el).await {
                tracing::warn!(%user, %contact, error = %e, "inbound remote subscription failed");
            }
        }
        PresenceType::Error => {
            if let Ok(full) = to.try_into_full() {
                pres.outbox.to_session(&full, el);
            }
        }
    }
}

/// RFC 6121 §3.1.3, §3.1.6, §3.2.3, §3.3.3 for a local user and a remote contact.
async fn inbound_subscription(
    pres: &Presence,
    user: &BareJid,
    contact: &BareJid,
    kind: SubKind,
    stanza: Element,
) -> Result<(), StoreError> {
    let user_node = user.node().map(|n| n.as_str()).unwrap_or("");
    if !pres
        .store
        .account_exists(user_node, user.domain().as_str())
        .await?
    {
        // RFC 6121 §8.5.1: subscription stanzas to a non-existent account are ignored.
        return Ok(());
    }
    if crate::services::presence::gate::blocked_either(pres, user, contact).await {
        // XEP-0191 §3.3: nothing from a blocked entity reaches the user.
        return Ok(());
    }
    let change = Exchange {
        user,
        contact,
        direction: Direction::In,
        kind,
        removal: false,
    };
    change.apply(pres, stanza).await
}

/// After `owner` unblocked `removed`, the remote contacts `owner` is subscribed to that
/// an item matched and that no block separates now are probed from the bare JID (RFC 6121
/// §4.3.1): what the block withdrew here their servers never knew to show again. Only
/// while the user has a visible available resource, since a probe says the user is
/// online (XEP-0186); otherwise the user's next initial presence probes them.
pub async fn probe_unblocked(pres: &Presence, owner_jid: &BareJid, removed: &[Jid]) {
    let owner = owner_jid.as_str();
    let shown = pres.sessions.shows_online_here(owner);
    if !shown || removed.is_empty() {
        return;
    }
    let Ok((_, roster)) = pres.store.roster(owner).await else {
        return;
    };
    for item in roster.iter().filter(|i| i.subscription.has_to()) {
        let contact = item.contact.as_str();
        if pres.serves(item.contact.domain().as_str())
            || !crate::store::blocks::match_candidates(contact)
                .iter()
                .any(|c| removed.iter().any(|r| r.as_str() == c))
            || super::gate::blocked_either(pres, owner_jid, &item.contact).await
        {
            continue;
        }
        let _ = pres
            .outbox
            .route_remote(presence(PresenceType::Probe, owner, contact));
    }
}

/// RFC 6121 §4.3.2: a remote server probes a local user for its user `prober`. Only an
/// approved subscriber who is not blocked gets an answer.
async fn probe(pres: &Presence, prober: &Jid, user: &Jid) {
    let Some(_) = user.node() else { return };
    // The same gate as local probes (approved subscription, blocks, settings,
    // invisibility); the answer goes back over federation.
    crate::services::presence::gate::probe_answer(pres, &prober.to_bare(), &user.to_bare(), |p| {
        // A remote prober's answers are built as elements (`Answer::into_element`).
        if let Some(p) = p.into_element() {
            let _ = pres.outbox.route_remote(p);
        }
    })
    .await;
}

/// Available or unavailable presence from a remote contact.
async fn presence_update(pres: &Presence, from: &Jid, to: &Jid, el: Element, is_available: bool) {
    if crate::services::presence::gate::blocked_either(pres, &to.to_bare(), &from.to_bare()).await {
        // XEP-0191 §3.3: a blocked entity's presence is not delivered.
        return;
    }
    if to.resource().is_some() {
        // Directed presence (RFC 6121 §4.6) to one resource.
        let Ok(full) = to.clone().try_into_full() else {
            return;
        };
        if pres.outbox.to_session(&full, el) {
            track(pres, from.as_str(), full.as_str(), is_available);
        }
        return;
    }
    let Some(_) = to.node() else { return };
    let user = to.as_str();
    let subscribed = match pres.store.roster_item(user, bare_of(from.as_str())).await {
        Ok(item) => item.is_some_and(|i| i.subscription.has_to()),
        Err(e) => {
            tracing::warn!(user, error = %e, "remote presence: roster unavailable");
            false
        }
    };
    if !subscribed {
        return;
    }
    if pres.outbox.to_available(user, &el) > 0 || !is_available {
        track(pres, from.as_str(), user, is_available);
    }
}

fn track(pres: &Presence, remote: &str, local: &str, is_available: bool) {
    if is_available {
        pres.s2s.saw_available(remote, local);
    } else {
        pres.s2s.saw_unavailable(remote, local);
    }
}
