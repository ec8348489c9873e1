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
//! | other domain            | federation (`s2s::route_remote`)     | federation                   |
//!
//! Presence goes to [`crate::presence`], which applies RFC 6121 §3–§4.
//!
//! Privacy (issue 6) changes three rows, so that nothing a viewer can provoke tells a
//! user's online state apart from offline:
//!
//! * a chat or normal message to an existing account with no resource to take it is
//!   dropped silently (RFC 6121 §8.5.2.2.1 allows it) instead of `service-unavailable`,
//!   because an error only when offline is an online detector (an invisible session, or a
//!   hidden one, still takes messages);
//! * an iq request to an online full JID is delivered only if the sender may see that
//!   resource online (privacy gate, not invisible) or the resource revealed itself to the
//!   sender (directed presence, or an iq request it sent there); otherwise it gets the
//!   `service-unavailable` an offline resource gives;
//! * XEP-0191 blocks apply first ([`crate::blocking`]), and chat states, receipts and
//!   chat markers are stripped from messages of a sender the recipient may not see
//!   online ([`crate::presence::gate::filter_signals`]).

use crate::c2s::{iq_result, Session};
use crate::error::StanzaError;
use crate::jid::{BareJid, Jid};
use crate::sessions::message_targets;
use crate::xml::{self as x, Element};

/// Where a `to` address points, as seen from this server.
#[derive(Debug)]
pub enum Target {
    /// No `to`: the sender's own account (RFC 6120 §10.3).
    OwnAccount,
    /// A domain this server hosts.
    LocalDomain,
    /// An account (existing or not) on a local domain.
    LocalBare(BareJid),
    /// A resource of an account on a local domain.
    LocalFull(crate::jid::FullJid),
    /// Another domain.
    Remote(Jid),
}

/// Classifies a `to` attribute. `Err` means jid-malformed (RFC 6120 §8.3.3.8).
pub fn classify(shared: &crate::server::Shared, to: Option<&str>) -> Result<Target, StanzaError> {
    let Some(to) = to else {
        return Ok(Target::OwnAccount);
    };
    let jid = crate::jid::parse(to).map_err(|_| StanzaError::jid_malformed())?;
    if !shared.config.serves(jid.domain().as_str()) {
        return Ok(Target::Remote(jid));
    }
    if jid.node().is_none() {
        return Ok(Target::LocalDomain);
    }
    match jid.try_into_full() {
        Ok(full) => Ok(Target::LocalFull(full)),
        Err(bare) => Ok(Target::LocalBare(bare)),
    }
}

/// Hands a stanza for another domain to federation; bounces it if that fails.
pub fn remote(session: &Session, el: Element) {
    let copy = el.clone();
    if let Err(e) = crate::s2s::route_remote(&session.shared, el) {
        bounce(session, &copy, e);
    }
}

fn bounce(session: &Session, el: &Element, err: StanzaError) {
    if let Some(reply) = err.reply_to(el) {
        session.deliver(reply);
    }
}

/// Routes one stanza whose `from` has been stamped by the session.
pub async fn from_client(session: &mut Session, el: Element) {
    let target = match classify(&session.shared, el.get_attr("to")) {
        Ok(t) => t,
        Err(e) => return bounce(session, &el, e),
    };
    match el.name.as_str() {
        "presence" => crate::presence::from_client(session, el, target).await,
        "iq" => iq(session, el, target).await,
        _ => message(session, el, target).await,
    }
}

/// Whether `bare` is an account here. A store failure counts as "no" (and is logged) so a
/// database outage degrades to errors for offline users, never a stalled session.
pub async fn account_exists(session: &Session, bare: &BareJid) -> bool {
    let node = bare.node().map(|n| n.as_str()).unwrap_or("");
    match session
        .shared
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

/// XEP-0191 §3.5 and the privacy gate for a message or iq to `target`. Returns the
/// stanza to route (possibly with presence-revealing signals removed), or `None` when it
/// was answered or dropped here.
async fn privacy_checks(session: &Session, el: Element, target: &Target) -> Option<Element> {
    use crate::blocking::{inbound_from_blocked, outbound_to_blocked, Verdict};
    use crate::metrics::DropReason;
    let shared = &session.shared;
    let me = session.jid().as_str();
    let own = session.jid().to_bare();
    let recipient = match target {
        Target::LocalBare(b) if *b != own => Some(b.to_string()),
        Target::LocalFull(f) if f.to_bare() != own => Some(f.to_string()),
        Target::Remote(j) => Some(j.to_string()),
        _ => None,
    };
    let Some(recipient) = recipient else {
        // Own account, own resources, the server: no other party's privacy is involved.
        return Some(el);
    };
    // The sender's own block list first (XEP-0191 §3.6: the sender is told), then the
    // recipient's (§3.5: answered as if the recipient were absent). Only the first is
    // counted: the figure is public, and a count of the second would tell a sender that
    // the recipient blocks it, which the answer itself hides.
    let verdict = match outbound_to_blocked(shared, me, &recipient, &el).await {
        Verdict::Pass if !matches!(target, Target::Remote(_)) => {
            inbound_from_blocked(shared, me, &recipient, &el).await
        }
        Verdict::Pass => Verdict::Pass,
        v => {
            shared.metrics.dropped(DropReason::BlockedBySender);
            v
        }
    };
    match verdict {
        Verdict::Pass => {}
        Verdict::Drop => return None,
        Verdict::Reject(reply) => {
            session.deliver(reply);
            return None;
        }
    }
    if el.name == "message" {
        let directed = shared.privacy.was_revealed(session.handle.id, &recipient)
            || shared.privacy.was_revealed(
                session.handle.id,
                crate::presence::gate::bare_of(&recipient),
            );
        return crate::presence::gate::filter_signals(
            shared,
            session.handle.id,
            me,
            &recipient,
            directed,
            el,
        )
        .await;
    }
    Some(el)
}

async fn message(session: &mut Session, el: Element, target: Target) {
    let kind = el.get_attr("type").unwrap_or("normal").to_owned();
    if !matches!(target, Target::LocalDomain) {
        // Counted before the recipient's block list and sessions are looked at: the figure
        // is public and must not tell a sender whether it is blocked or the recipient online.
        session.shared.metrics.message_routed();
    }
    let Some(el) = privacy_checks(session, el, &target).await else {
        return;
    };
    match target {
        Target::Remote(_) => remote(session, el),
        Target::LocalDomain => {
            // Messages to the server itself have no handler; RFC 6120 §10.3.1 lets us drop
            // them, but an error tells the client why nothing happened.
            bounce(session, &el, StanzaError::service_unavailable())
        }
        Target::LocalFull(full) => match session.shared.sessions.get(&full) {
            Some(s) => {
                s.send(el);
            }
            // RFC 6121 §8.5.3.2.1: a full JID with no session is treated as the bare JID.
            None => to_bare(session, el, &full.to_bare(), &kind).await,
        },
        Target::LocalBare(bare) => to_bare(session, el, &bare, &kind).await,
        Target::OwnAccount => {
            let own = session.jid().to_bare();
            to_bare(session, el, &own, &kind).await
        }
    }
}

/// RFC 6121 §8.5.2: a message to a bare JID.
async fn to_bare(session: &mut Session, el: Element, bare: &BareJid, kind: &str) {
    if matches!(kind, "normal" | "chat")
        && message_targets(&session.shared.sessions.of_user(bare)).is_empty()
        && !account_exists(session, bare).await
    {
        // RFC 6121 §8.5.1: no such account.
        return bounce(session, &el, StanzaError::service_unavailable());
    }
    let copy = el.clone();
    if let Some(err) = deliver_to_bare(&session.shared, el, bare, kind) {
        bounce(session, &copy, err);
    }
}

/// RFC 6121 §8.5.2: delivers a message to a local bare JID, wherever it came from (a local
/// session or a remote server). Returns the error to bounce to the sender, if any.
pub fn deliver_to_bare(
    shared: &crate::server::Shared,
    el: Element,
    bare: &BareJid,
    kind: &str,
) -> Option<StanzaError> {
    if kind == "error" {
        // Never answer an error; with no resource to take it, it is dropped (§8.5.2.2.1).
        if let Some(s) = message_targets(&shared.sessions.of_user(bare)).first() {
            s.send(el);
        }
        return None;
    }
    if kind == "groupchat" {
        // §8.5.2.1.1: groupchat to a bare JID of a user is service-unavailable.
        return Some(StanzaError::service_unavailable());
    }
    let sessions = shared.sessions.of_user(bare);
    let targets = message_targets(&sessions);
    if targets.is_empty() {
        // No offline storage. §8.5.2.2.1 lets the server ignore the message silently, and
        // it must: an error only when offline would tell anyone the user's status (issue
        // 6). A caller that can tell a non-existent account answers §8.5.1 itself.
        return None;
    }
    if kind == "headline" {
        // §8.5.2.1.1: headlines go to every non-negative resource.
        for s in sessions
            .iter()
            .filter(|s| s.read(|p| p.available && p.priority >= 0))
        {
            s.send(el.clone());
        }
        return None;
    }
    let n = targets.len();
    for (i, s) in targets.into_iter().enumerate() {
        if i + 1 == n {
            s.send(el);
            break;
        }
        s.send(el.clone());
    }
    None
}

async fn iq(session: &mut Session, el: Element, target: Target) {
    // Owned: the stanza moves into the privacy checks below.
    let ty = el.get_attr("type").unwrap_or("").to_owned();
    let ty = ty.as_str();
    if el.get_attr("id").is_none() || !matches!(ty, "get" | "set" | "result" | "error") {
        // RFC 6120 §8.2.3: id and a known type are required.
        return bounce(session, &el, StanzaError::bad_request());
    }
    let is_request = matches!(ty, "get" | "set");
    if is_request && el.elements().count() != 1 {
        // RFC 6120 §8.2.3 item 6: a request has exactly one payload.
        return bounce(session, &el, StanzaError::bad_request());
    }
    let own = session.jid().to_bare();
    let Some(el) = privacy_checks(session, el, &target).await else {
        return;
    };
    match target {
        Target::Remote(_) => remote(session, el),
        Target::LocalFull(full) => match session.shared.sessions.get(&full) {
            Some(s) if !is_request || full.to_bare() == own => {
                s.send(el);
            }
            Some(s) => {
                // Issue 6: a request reaches a resource only if the sender may know it is
                // online; otherwise the answer is the one an offline resource gives.
                if crate::presence::gate::may_reach_resource(
                    &session.shared,
                    session.jid().as_str(),
                    &s,
                )
                .await
                {
                    // The requester disclosed itself to this resource by its own act.
                    session.shared.privacy.reveal(
                        session.handle.id,
                        session.jid().as_str(),
                        full.as_str(),
                        crate::presence::privacy::Relation::DirectedPresence,
                    );
                    s.send(el);
                } else {
                    bounce(session, &el, StanzaError::service_unavailable());
                }
            }
            None if is_request => bounce(session, &el, StanzaError::service_unavailable()),
            None => {}
        },
        _ if !is_request => {
            // Results and errors for the server (roster push acknowledgements, ping
            // answers) need no further handling.
        }
        Target::OwnAccount => own_account_iq(session, el).await,
        Target::LocalBare(bare) if bare.as_str() == session.jid().to_bare().as_str() => {
            own_account_iq(session, el).await
        }
        Target::LocalBare(bare)
            if ty == "get"
                && el
                    .elements()
                    .next()
                    .is_some_and(|p| p.is("query", crate::liveness::last_seen::NS_LAST)) =>
        {
            // XEP-0012 last activity of a contact.
            let reply = crate::liveness::last_seen::handle_iq(session, &el, &bare).await;
            session.deliver(reply);
        }
        Target::LocalBare(bare) => {
            let exists = account_exists(session, &bare).await;
            let reply = account_iq(&el, exists);
            session.deliver(reply);
        }
        Target::LocalDomain => {
            let reply = server_iq(session, &el);
            session.deliver(reply);
        }
    }
}

/// An iq the user sent to their own account (no `to`, or their bare JID).
async fn own_account_iq(session: &mut Session, el: Element) {
    let Some(payload) = el.elements().next().cloned() else {
        return;
    };
    let reply = if payload.is("query", x::NS_ROSTER) {
        crate::roster::handle(session, &el, &payload).await
    } else if payload.is("session", x::NS_SESSION) {
        // RFC 3921 §3 session establishment: a no-op kept for old clients.
        Some(iq_result(&el))
    } else if payload.is("ping", x::NS_PING) {
        Some(iq_result(&el))
    } else if payload.ns == crate::blocking::NS_BLOCKING {
        crate::blocking::handle(session, &el, &payload).await
    } else if payload.ns == crate::privacy_iq::NS_PRIVACY {
        Some(crate::privacy_iq::handle(session, &el, &payload).await)
    } else if payload.ns == crate::invisible::NS_INVISIBLE {
        Some(crate::invisible::handle(session, &el, &payload).await)
    } else {
        Some(account_iq(&el, true))
    };
    if let Some(r) = reply {
        session.deliver(r);
    }
}

/// Iq handled by the server on behalf of an account (RFC 6120 §10.5.3.1): disco only.
fn account_iq(el: &Element, exists: bool) -> Element {
    let payload = el.elements().next();
    let get = el.get_attr("type") == Some("get");
    if exists && get {
        if let Some(p) = payload {
            if p.is("query", x::NS_DISCO_INFO) && p.get_attr("node").is_none() {
                // XEP-0030 §3.1: an account's identity; XEP-0030 §4: no items are listed,
                // so disco#items never reveals which resources are online.
                let q = Element::new("query", x::NS_DISCO_INFO)
                    .child(
                        Element::new("identity", x::NS_DISCO_INFO)
                            .attr("category", "account")
                            .attr("type", "registered"),
                    )
                    .child(feature(x::NS_DISCO_INFO))
                    .child(feature(crate::liveness::last_seen::NS_LAST));
                return iq_result(el).child(q);
            }
            if p.is("query", x::NS_DISCO_ITEMS) && p.get_attr("node").is_none() {
                return iq_result(el).child(Element::new("query", x::NS_DISCO_ITEMS));
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
fn server_iq(session: &Session, el: &Element) -> Element {
    let payload = el.elements().next();
    let get = el.get_attr("type") == Some("get");
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
                // Issue 6: XEP-0191, XEP-0186 and this server's visibility settings.
                crate::blocking::NS_BLOCKING,
                crate::invisible::NS_INVISIBLE,
                crate::privacy_iq::NS_PRIVACY,
                // XEP-0012 §6: clients look for last activity in disco before asking.
                crate::liveness::last_seen::NS_LAST,
            ];
            if session.shared.config.auth.allow_registration {
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
