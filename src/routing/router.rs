//! Routing of stanzas from a local client (RFC 6120 §10, RFC 6121 §8): to a server handler,
//! to a local session, or (later) to a remote domain.
//!
//! | `to`                    | message (RFC 6121 §8.5)              | iq (RFC 6120 §10.5)          |
//! |-------------------------|--------------------------------------|------------------------------|
//! | none / own bare JID     | own resources (as bare JID)          | handled for the account      |
//! | this domain             | dropped                              | server handlers              |
//! | local bare JID          | highest non-negative priority        | handled for that account     |
//! | local full JID, online  | that session                         | that session                 |
//! | local full JID, offline | as bare JID (chat/normal)            | service-unavailable          |
//! | unknown local user      | service-unavailable                  | service-unavailable          |
//! | other domain            | federation (`Outbox::route_remote`) | federation                   |
//!
//! Presence goes to [`crate::services::presence`], which applies RFC 6121 §3–§4.
//!
//! Privacy (README, "Privacy") changes three rows, so that nothing a viewer can provoke tells a
//! user's online state apart from offline:
//!
//! * a chat or normal message to an existing account with no resource to take it is kept
//!   for the user's next login (XEP-0160, [`crate::services::offline`]) or, with nothing worth
//!   keeping, dropped silently (RFC 6121 §8.5.2.2.1 allows both), never answered with
//!   `service-unavailable` while the store has room, because an error only when offline
//!   is an online detector (an invisible session, or a hidden one, still takes messages);
//! * an iq request to an online full JID is delivered only if the sender may see that
//!   resource online (privacy gate, not invisible) or the resource revealed itself to the
//!   sender (directed presence, or an iq request it sent there); otherwise it gets the
//!   `service-unavailable` an offline resource gives;
//! * XEP-0191 blocks apply first ([`crate::services::blocking`]), and chat states, receipts and
//!   chat markers are stripped from messages of a sender the recipient may not see
//!   online ([`crate::services::presence::gate::filter_signals`]).

use crate::node::session::Client;
use crate::protocol::error::{iq_result, StanzaError};
use crate::protocol::jid::{BareJid, Jid};
use crate::protocol::stanza::{IqType, PresenceType};
use crate::protocol::xml::{self as x, Element};
use crate::services::presence::Presence;
use crate::services::Services;

pub(crate) use crate::node::session::{classify, Target};

/// Hands a stanza for another domain to federation; bounces it if that fails.
pub(crate) fn remote(presence: &Presence, el: Element) {
    let copy = el.clone();
    if let Err(e) = presence.outbox.route_remote(el) {
        bounce(presence, &copy, e);
    }
}

/// The one bounce ([`crate::node::outbox::Outbox::bounce`]): the session's stanzas carry
/// its full JID as `from`, so the reply comes back to it.
fn bounce(presence: &Presence, el: &Element, err: StanzaError) {
    presence.outbox.bounce(el, err);
}

/// Routes one stanza whose `from` has been stamped by the session.
pub(crate) async fn from_client(services: &Services, session: &Client, el: Element) {
    let presence = &services.presence;
    let target = match classify(|d| presence.serves(d), el.get_attr("to")) {
        Ok(t) => t,
        Err(e) => return bounce(presence, &el, e),
    };
    match el.name.as_str() {
        "presence" => {
            let mut el = el;
            let ty = PresenceType::of(&el);
            let available = ty == Some(PresenceType::Available);
            if available {
                // XEP-0398 §4: the avatar's hash for vCard clients, in every available
                // presence of the user (broadcast and directed).
                let owner = session.jid().to_bare().to_string();
                services.pep.stamp_presence(&owner, &mut el).await;
            }
            let took_messages = crate::routing::delivery::takes_messages(&session.handle);
            // XEP-0115 capabilities of the client's own available presence (XEP-0163 §4.4).
            let was_available = session.handle.is_available();
            let caps = (available && is_own(session, &target)).then(|| el.clone());
            services.presence.from_client(session, el, ty, target).await;
            if let Some(p) = caps.filter(|_| session.handle.is_available()) {
                services.pep.on_presence(session, &p, !was_available).await;
            }
            if !took_messages && crate::routing::delivery::takes_messages(&session.handle) {
                // XEP-0160: what was kept for the user goes to a resource once it takes
                // messages (initial presence, or a negative priority raised), after
                // everything the presence itself brought (probe answers, waiting
                // subscription requests).
                crate::routing::delivery::offline_messages(&services.presence, &session.handle)
                    .await;
            }
        }
        "iq" => iq(services, session, el, target).await,
        _ => message(services, session, el, target).await,
    }
}

/// Whether `target` is the session's own account (a presence there is a broadcast).
fn is_own(session: &Client, target: &Target) -> bool {
    match target {
        Target::OwnAccount => true,
        Target::LocalBare(b) => *b == session.jid().to_bare(),
        _ => false,
    }
}

/// Whether `bare` is an account here (see [`crate::routing::delivery::account_exists`]).
pub(crate) async fn account_exists(presence: &Presence, bare: &BareJid) -> bool {
    crate::routing::delivery::account_exists(presence, bare).await
}

/// XEP-0191 §3.5 on the sender's side, and the side-channel filter, for a message or iq
/// to `target`. Returns the stanza to route (possibly with presence-revealing signals
/// removed), or `None` when it was answered or dropped here. The recipient's side (its
/// block list, the privacy gate) is [`crate::routing::delivery`]'s, as for stanzas from anywhere.
async fn privacy_checks(
    services: &Services,
    session: &Client,
    el: Element,
    target: &Target,
) -> Option<Element> {
    use crate::metrics::DropReason;
    use crate::services::blocking::{outbound_to_blocked, Verdict};
    let me = session.jid().as_str();
    let own = session.jid().to_bare();
    let recipient = match target {
        Target::LocalBare(b) if *b != own => Some(Jid::from(b.clone())),
        Target::LocalFull(f) if f.to_bare() != own => Some(Jid::from(f.clone())),
        Target::Remote(j) => Some(j.clone()),
        _ => None,
    };
    let Some(recipient) = recipient else {
        // Own account, own resources, the server: no other party's privacy is involved.
        return Some(el);
    };
    // The sender's own block list (XEP-0191 §3.6: the sender is told, so the public
    // figure may count it). The recipient's list is delivery's and is not counted: it is
    // answered as if the recipient were absent, and a count would say otherwise.
    let verdict = outbound_to_blocked(&services.presence.store, me, recipient.as_str(), &el).await;
    if !matches!(verdict, Verdict::Pass) {
        services
            .routing
            .metrics
            .dropped(DropReason::BlockedBySender);
    }
    match verdict {
        Verdict::Pass => {}
        Verdict::Drop => return None,
        Verdict::Reject(reply) => {
            session.deliver(reply);
            return None;
        }
    }
    if el.name == "message" {
        let directed = session.handle.was_revealed(recipient.as_str())
            || session
                .handle
                .was_revealed(crate::protocol::jid::bare_of(recipient.as_str()));
        return crate::services::presence::gate::filter_signals(
            &services.presence,
            &session.handle,
            session.jid(),
            &recipient,
            directed,
            el,
        )
        .await;
    }
    Some(el)
}

async fn message(services: &Services, session: &Client, el: Element, target: Target) {
    let presence = &services.presence;
    if !matches!(target, Target::LocalDomain) {
        // Counted before the recipient's block list and sessions are looked at: the figure
        // is public and must not tell a sender whether it is blocked or the recipient online.
        services.routing.metrics.message_routed();
    }
    let Some(el) = privacy_checks(services, session, el, &target).await else {
        return;
    };
    if !matches!(target, Target::LocalDomain) {
        // XEP-0280 §7: the user's other resources see what this one sent.
        crate::routing::delivery::sent_copies(presence, &session.handle, el.get_attr("to"), &el)
            .await;
    }
    let to = match target {
        Target::Remote(_) => return remote(presence, el),
        Target::LocalDomain => {
            // Messages to the server itself have no handler; RFC 6120 §10.3.1 lets us drop
            // them, but an error tells the client why nothing happened.
            return bounce(presence, &el, StanzaError::service_unavailable());
        }
        Target::LocalFull(full) => Jid::from(full),
        Target::LocalBare(bare) => Jid::from(bare),
        Target::OwnAccount => Jid::from(session.jid().to_bare()),
    };
    crate::routing::delivery::message(presence, session.jid(), to, el).await;
}

/// An iq to a local resource, through delivery's checks.
async fn iq_to_resource(
    presence: &Presence,
    session: &Client,
    el: Element,
    full: &crate::protocol::jid::FullJid,
    is_request: bool,
) {
    let to_other = full.to_bare() != session.jid().to_bare();
    let outcome = crate::routing::delivery::iq(presence, session.jid(), full, el).await;
    if is_request && to_other && outcome == crate::routing::delivery::Outcome::Delivered {
        // The requester disclosed itself to this resource by its own act. With the
        // session's set full it is not recorded, and the resource's own requests back take
        // the gate's decision like anyone's (fails closed).
        session.handle.reveal(
            full.as_str(),
            crate::policy::privacy::Relation::DirectedPresence,
        );
    }
}

async fn iq(services: &Services, session: &Client, el: Element, target: Target) {
    let presence = &services.presence;
    // Owned: the stanza moves into the privacy checks below.
    let (Some(ty), Some(_)) = (IqType::of(&el), el.get_attr("id")) else {
        // RFC 6120 §8.2.3: id and a known type are required.
        return bounce(presence, &el, StanzaError::bad_request());
    };
    let is_request = ty.is_request();
    if is_request && el.elements().count() != 1 {
        // RFC 6120 §8.2.3 item 6: a request has exactly one payload.
        return bounce(presence, &el, StanzaError::bad_request());
    }
    let Some(el) = privacy_checks(services, session, el, &target).await else {
        return;
    };
    match target {
        Target::Remote(_) => remote(presence, el),
        Target::LocalFull(full) => {
            iq_to_resource(&services.presence, session, el, &full, is_request).await
        }
        Target::LocalDomain if !is_request => {
            // Answers to the server's own queries (XEP-0115 disco#info of a client's caps).
            services.pep.disco_answer(session, &el, ty).await;
        }
        Target::LocalBare(_) | Target::OwnAccount if !is_request => {
            // An app server's answer to a XEP-0357 notification sent from the account;
            // anything else needs no further handling.
            services.push.answer(&el);
        }
        _ if !is_request => {
            // Results and errors for the server (roster push acknowledgements, ping
            // answers) need no further handling.
        }
        Target::OwnAccount => own_account_iq(services, session, el, ty).await,
        Target::LocalBare(bare) if bare.as_str() == session.jid().to_bare().as_str() => {
            own_account_iq(services, session, el, ty).await
        }
        Target::LocalBare(bare)
            if crate::routing::delivery::admit_from(
                &services.presence,
                session.jid().as_str(),
                bare.as_str(),
                &el,
            )
            .await
                != crate::services::blocking::Verdict::Pass => {}
        Target::LocalBare(bare)
            if ty == IqType::Get
                && el
                    .elements()
                    .next()
                    .is_some_and(|p| p.is("query", crate::liveness::last_seen::NS_LAST)) =>
        {
            // XEP-0012 last activity of a contact.
            let reply = services.last_seen.handle_iq(session, &el, &bare).await;
            session.deliver(reply);
        }
        Target::LocalBare(bare)
            if el
                .elements()
                .next()
                .is_some_and(crate::services::pep::vcard::handles) =>
        {
            // XEP-0054 §3.3: another local user's vCard, answered by the server. A viewer
            // the user blocks was answered above with the same error as "no vCard".
            let reply = if account_exists(&services.presence, &bare).await {
                services.pep.vcard_iq(session, &el, ty, &bare).await
            } else {
                account_iq(&el, ty, false)
            };
            session.deliver(reply);
        }
        Target::LocalBare(bare)
            if el
                .elements()
                .next()
                .is_some_and(crate::services::pep::handles) =>
        {
            // XEP-0163: another local user's personal eventing service.
            let reply = if account_exists(&services.presence, &bare).await {
                services.pep.handle_iq(session, &el, ty, &bare).await
            } else {
                account_iq(&el, ty, false)
            };
            session.deliver(reply);
        }
        Target::LocalBare(bare) => {
            let exists = account_exists(&services.presence, &bare).await;
            let reply = account_iq(&el, ty, exists);
            session.deliver(reply);
        }
        Target::LocalDomain
            if el
                .elements()
                .next()
                .is_some_and(|p| p.is("query", x::NS_REGISTER)) =>
        {
            // XEP-0077 with the server's domain as `to`: the session's own account.
            let query = el.elements().next().cloned();
            if let Some(reply) = query.and_then(|q| {
                services
                    .account_deletion
                    .registration_iq(session, &el, ty, &q)
            }) {
                session.deliver(reply);
            }
        }
        Target::LocalDomain => {
            let reply = server_iq(services.routing.allow_registration, &el, ty);
            session.deliver(reply);
        }
    }
}

/// An iq request the user sent to their own account (no `to`, or their bare JID).
async fn own_account_iq(services: &Services, session: &Client, el: Element, ty: IqType) {
    let Some(payload) = el.elements().next().cloned() else {
        return;
    };
    let reply = if payload.is("query", x::NS_ROSTER) {
        services.roster.handle(session, &el, ty, &payload).await
    } else if payload.is("query", x::NS_REGISTER) {
        services
            .account_deletion
            .registration_iq(session, &el, ty, &payload)
    } else if payload.is("session", x::NS_SESSION) {
        // RFC 3921 §3 session establishment: a no-op kept for old clients.
        Some(iq_result(&el))
    } else if payload.is("ping", x::NS_PING) {
        Some(iq_result(&el))
    } else if payload.ns == crate::services::blocking::NS_BLOCKING {
        services.blocking.handle(session, &el, ty, &payload).await
    } else if payload.ns == crate::services::privacy_iq::NS_PRIVACY {
        Some(services.privacy.handle(session, &el, ty, &payload).await)
    } else if payload.ns == crate::services::carbons::NS_CARBONS {
        let reply = crate::services::carbons::handle_iq(&session.handle, &el, ty, &payload);
        // Other nodes send this resource its copies when the directory says so.
        services.presence.to_directory(&session.handle);
        Some(reply)
    } else if payload.ns == crate::services::interest::NS_INTEREST {
        let limits = &services.routing.live.get().limits;
        Some(crate::services::interest::handle_iq(
            &session.handle,
            &el,
            ty,
            &payload,
            limits.max_interest_items,
            limits.interest_ttl,
        ))
    } else if crate::services::pep::handles(&payload) {
        let owner = session.jid().to_bare();
        Some(services.pep.handle_iq(session, &el, ty, &owner).await)
    } else if crate::services::pep::vcard::handles(&payload) {
        let owner = session.jid().to_bare();
        Some(services.pep.vcard_iq(session, &el, ty, &owner).await)
    } else if payload.ns == crate::services::push::NS_PUSH {
        Some(services.push.handle_iq(session, &el, ty, &payload).await)
    } else if payload.ns == crate::services::invisible::NS_INVISIBLE {
        Some(
            crate::services::invisible::handle(&services.presence, session, &el, ty, &payload)
                .await,
        )
    } else {
        Some(account_iq(&el, ty, true))
    };
    if let Some(r) = reply {
        session.deliver(r);
    }
}

/// Iq handled by the server on behalf of an account (RFC 6120 §10.5.3.1): disco only.
fn account_iq(el: &Element, ty: IqType, exists: bool) -> Element {
    let payload = el.elements().next();
    let get = ty == IqType::Get;
    if exists && get {
        if let Some(p) = payload {
            if p.is("query", x::NS_DISCO_INFO) && p.get_attr("node").is_none() {
                // XEP-0030 §3.1: an account's identity. Its disco#items lists PEP nodes
                // (crate::services::pep), never resources, so it never reveals which are online.
                let q = Element::new("query", x::NS_DISCO_INFO)
                    .child(
                        Element::new("identity", x::NS_DISCO_INFO)
                            .attr("category", "account")
                            .attr("type", "registered"),
                    )
                    .child(feature(x::NS_DISCO_INFO))
                    .child(feature(crate::liveness::last_seen::NS_LAST))
                    // XEP-0357 §4: clients look for push on their own account.
                    .child(feature(crate::services::push::NS_PUSH));
                // XEP-0163 §1: every account is a PEP service.
                return iq_result(el).child(crate::services::pep::describe_account(q));
            }
        }
    }
    StanzaError::service_unavailable()
        .reply_to(el)
        .unwrap_or_else(|| iq_result(el))
}

fn feature(var: &str) -> Element {
    Element::new("feature", x::NS_DISCO_INFO).attr("var", var)
}

/// Iq addressed to the server itself: disco (XEP-0030), ping (XEP-0199).
fn server_iq(allow_registration: bool, el: &Element, ty: IqType) -> Element {
    let payload = el.elements().next();
    let get = ty == IqType::Get;
    let reply = match payload {
        Some(p) if get && p.is("ping", x::NS_PING) => Some(iq_result(el)),
        Some(p) if get && p.is("query", x::NS_DISCO_INFO) && p.get_attr("node").is_none() => {
            let mut q = Element::new("query", x::NS_DISCO_INFO).child(
                Element::new("identity", x::NS_DISCO_INFO)
                    .attr("category", "server")
                    .attr("type", "im")
                    .attr("name", "presenced"),
            );
            let mut features = vec![
                x::NS_DISCO_INFO,
                x::NS_DISCO_ITEMS,
                x::NS_PING,
                x::NS_ROSTER,
                x::NS_ROSTER_VER,
                x::NS_PREAPPROVAL,
                // XEP-0191, XEP-0186 and this server's visibility settings.
                crate::services::blocking::NS_BLOCKING,
                crate::services::invisible::NS_INVISIBLE,
                crate::services::privacy_iq::NS_PRIVACY,
                // XEP-0280 §2: clients look for carbons here before enabling them.
                crate::services::carbons::NS_CARBONS,
                // This server's interest lists for inactive clients.
                crate::services::interest::NS_INTEREST,
                // XEP-0160 §4: offline storage is announced as 'msgoffline'.
                crate::services::offline::FEATURE,
                // XEP-0012 §6: clients look for last activity in disco before asking.
                crate::liveness::last_seen::NS_LAST,
                // XEP-0054 §4: accounts' vCards (built on their avatars, XEP-0398).
                crate::services::pep::vcard::NS_VCARD,
            ];
            if allow_registration {
                features.push(x::NS_REGISTER);
            }
            for f in features {
                q = q.child(feature(f));
            }
            Some(iq_result(el).child(q))
        }
        Some(p) if get && p.is("query", x::NS_DISCO_ITEMS) && p.get_attr("node").is_none() => {
            Some(iq_result(el).child(Element::new("query", x::NS_DISCO_ITEMS)))
        }
        _ => None,
    };
    reply.unwrap_or_else(|| {
        StanzaError::service_unavailable()
            .reply_to(el)
            .unwrap_or_else(|| iq_result(el))
    })
}
