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

pub(crate) mod executor;
pub mod gate;
pub mod remote;

/// The pure decisions presence asks; they live in `policy` so the store can use
/// their types without importing presence.
pub use crate::policy::{privacy, subscription};

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use crate::cluster::Cluster;
use crate::liveness::Liveness;
use crate::node::caps::CapsCache;
use crate::node::federation::S2s;
use crate::node::outbox;
use crate::node::outbox::Outbox;
use crate::node::session::Client;
use crate::node::session::Target;
use crate::node::sessions::Sessions;
use crate::node::visibility::SubjectLocks;
use crate::node::RosterLocks;
use crate::protocol::error::StanzaError;
use crate::protocol::jid::{BareJid, FullJid, Jid};
use crate::protocol::stanza::PresenceType;
use crate::protocol::xml::{Addressed, Element, NS_CLIENT};
use crate::store::gate_inputs::AudienceInputs;
use crate::store::RosterItem;
use crate::store::Store;

use subscription::{Change, ContactSide, Direction, SubKind, SubState};

/// The presence service: the router hands it a client's presence stanzas and XEP-0186
/// commands, the end of a session hands it the session, and the services that depend on
/// presence (blocking, roster, last seen, visibility settings) ask it what they need.
/// Presence reaches the store, the sessions here and on the other nodes, liveness and
/// federation, so it holds those parts of the node (built by the composition root);
/// delivery, which asks the privacy gate on every stanza, works on the same parts.
pub struct Presence {
    /// Rosters, block lists, visibility settings and the gate's cached inputs.
    pub(crate) store: Store,
    /// The sessions of this node.
    pub(crate) sessions: Arc<Sessions>,
    /// Where presence leaves for a session, another node or another domain.
    pub(crate) outbox: Arc<Outbox>,
    /// Last seen times, for the stamp on a probe's answer.
    pub(crate) liveness: Arc<Liveness>,
    /// The directory of sessions on the other nodes and their channels.
    pub(crate) cluster: Cluster,
    /// The per-subject presence locks.
    pub(crate) subject_locks: Arc<SubjectLocks>,
    /// Serialises a roster change and its push per user (with the roster NOTIFY listener).
    pub(crate) roster_locks: Arc<RosterLocks>,
    /// Federation: remote presence state (who was shown what over s2s).
    pub(crate) s2s: Arc<S2s>,
    /// XEP-0115 capabilities of clients on this node, forgotten with their session.
    pub(crate) caps: Arc<CapsCache>,
    /// XEP-0357: who is woken when delivery keeps something for a user.
    pub(crate) push: Arc<crate::services::push::Push>,
}

impl Presence {
    /// Whether `domain` is one this server hosts.
    pub(crate) fn serves(&self, domain: &str) -> bool {
        self.outbox.serves(domain)
    }

    /// See [`to_directory`].
    pub(crate) fn to_directory(&self, handle: &crate::node::sessions::SessionHandle) {
        to_directory(self, handle);
    }

    /// See [`unavailable_of_lost`].
    pub(crate) async fn unavailable_of_lost(
        &self,
        jid: &FullJid,
        last: Option<&crate::cluster::Entry>,
    ) {
        unavailable_of_lost(self, jid, last).await;
    }

    /// See [`show_again_to_other_nodes`].
    pub(crate) async fn show_again_to_other_nodes(&self) {
        show_again_to_other_nodes(self).await;
    }

    /// See [`gate::blocked_either`].
    pub(crate) async fn blocked_either(&self, a: &Jid, b: &Jid) -> bool {
        gate::blocked_either(self, a, b).await
    }

    /// See [`gate::may_see_online`].
    pub(crate) async fn may_see_online(&self, viewer: &Jid, subject: &Jid, directed: bool) -> bool {
        gate::may_see_online(self, viewer, subject, directed).await
    }

    /// See [`gate::online_audience`].
    pub(crate) async fn online_audience(
        &self,
        subject: &Jid,
    ) -> std::collections::HashSet<BareJid> {
        gate::online_audience(self, subject).await
    }

    /// See [`executor::apply_external`].
    pub(crate) async fn apply_external(&self, owner: &str, version: i64) {
        executor::apply_external(self, owner, version).await;
    }

    /// See [`gate::reconcile_user`].
    pub async fn reconcile_user(&self, user: &BareJid) {
        gate::reconcile_user(self, user).await;
    }

    /// See [`remote::probe_unblocked`].
    pub async fn probe_unblocked(&self, owner: &BareJid, removed: &[Jid]) {
        remote::probe_unblocked(self, owner, removed).await;
    }

    /// See [`gate::may_see_last_seen`].
    pub async fn may_see_last_seen(&self, viewer: &Jid, subject: &Jid) -> bool {
        gate::may_see_last_seen(self, viewer, subject).await
    }

    /// See [`gate::visible_to`].
    pub async fn visible_to(&self, viewer: &Jid, subject: &BareJid) -> bool {
        gate::visible_to(self, viewer, subject).await
    }

    /// RFC 6121 §2.5.2: the cancel and revoke of a roster removal by `client`. The caller
    /// holds the roster locks of `client`'s user and the item's contact.
    pub async fn roster_removed(&self, client: &Client, item: &RosterItem) {
        roster_removed(self, client, item).await;
    }

    /// Handles a presence stanza from `client`'s own client, of type `ty` as the router
    /// read it (`None`: a type RFC 6121 does not define), to `target`.
    pub async fn from_client(
        &self,
        client: &Client,
        el: Element,
        ty: Option<PresenceType>,
        target: Target,
    ) {
        from_client(self, client, el, ty, target).await;
    }

    /// `client`'s session ended: if it was available or sent directed presence, the
    /// unavailable its client did not send goes out (RFC 6121 §4.5.2, §4.6.3).
    pub async fn session_ended(&self, client: &Client) {
        session_ended(self, client).await;
    }

    /// XEP-0186 §3.1: `client`'s session becomes invisible. Every viewer this resource's
    /// presence reached (subscribers and directed recipients) gets unavailable from it;
    /// the directed set goes with it, so its later unavailable repeats nothing. `probe`:
    /// the command asked that remote contacts still be probed.
    pub async fn become_invisible(&self, client: &Client, probe: bool) {
        let me = client.jid().to_string();
        let _guard = self
            .subject_locks
            .lock_subject(crate::protocol::jid::bare_of(&me))
            .await;
        let revealed = client.handle.write(|p| {
            p.invisible = true;
            p.probe_remote = probe;
            p.take_directed();
            p.take_revealed()
        });
        to_directory(self, &client.handle);
        for (viewer, _) in revealed {
            let p = outbox::unavailable(&me, &viewer);
            self.outbox.presence_to(&viewer, p);
        }
    }

    /// A push-enabled session has been detached for T (XEP-0357 with XEP-0198): its
    /// client sleeps, so it is no longer "online". Its viewers get its unavailable as from
    /// an invisible session (XEP-0186 §3.1), and its last seen is the last time its client
    /// was heard (`at_ms`), as a session's end records it; the session itself stays, takes
    /// what arrives for it and wakes its client. An invisible session has nothing to hide.
    pub async fn hibernate(&self, client: &Client, at_ms: i64) {
        let hid = !client.handle.is_invisible();
        if hid {
            self.become_invisible(client, false).await;
        }
        client
            .handle
            .write(|p| p.hibernated = Some(crate::node::sessions::Hibernated { hid }));
        let bare = client.jid().to_bare();
        self.cluster.seen(bare.as_str(), at_ms);
        self.liveness.last_seen.push(crate::store::LastSeen {
            jid: bare,
            at: crate::clock::to_datetime(at_ms),
            status: None,
        });
    }

    /// A hibernated session was resumed: its presence goes again to everyone the gate
    /// admits, who all saw it leave. Nothing for a session that was not hibernated: its
    /// viewers never saw it go.
    pub async fn wake(&self, client: &Client) {
        let was = client.handle.write(|p| p.hibernated.take());
        if was.is_some_and(|h| h.hid) {
            self.become_visible(client).await;
        }
    }

    /// XEP-0186 §3.2: `client`'s session becomes visible again, and its last presence, if
    /// it sent one, is shown to everyone the privacy gate admits, as a broadcast would.
    pub async fn become_visible(&self, client: &Client) {
        client.handle.write(|p| {
            p.invisible = false;
            p.probe_remote = false;
        });
        to_directory(self, &client.handle);
        gate::reconcile_subject(self, &client.jid().to_bare()).await;
    }
}

pub(crate) fn presence(ty: PresenceType, from: &str, to: &str) -> Element {
    let mut p = Element::new("presence", NS_CLIENT)
        .attr("from", from)
        .attr("to", to);
    if let Some(t) = ty.as_attr() {
        p.set_attr("type", t);
    }
    p
}

/// Handles a presence stanza from the session's own client, of type `ty` as the router
/// read it (`None`: a type RFC 6121 does not define).
async fn from_client(
    pres: &Presence,
    session: &Client,
    el: Element,
    ty: Option<PresenceType>,
    target: Target,
) {
    let own_bare = session.jid().to_bare();
    let Some(ty) = ty else {
        if let Some(r) = StanzaError::bad_request().reply_to(&el) {
            session.deliver(r);
        }
        return;
    };
    match ty {
        PresenceType::Available | PresenceType::Unavailable => {
            let available = ty == PresenceType::Available;
            let is_available = available;
            match target {
                Target::OwnAccount => broadcast(pres, session, el, available).await,
                Target::LocalBare(b) if b == own_bare => {
                    broadcast(pres, session, el, available).await
                }
                Target::LocalDomain => {}
                Target::Remote(j) => {
                    if is_available {
                        if !track_directed(session, j.as_str(), &el) {
                            return;
                        }
                    } else {
                        session.handle.write(|p| p.remove_directed(j.as_str()));
                    }
                    let _ = pres.outbox.route_remote(el);
                }
                Target::LocalBare(_) | Target::LocalFull(_) => {
                    directed(pres, session, el, available).await
                }
            }
        }
        PresenceType::Subscribe
        | PresenceType::Subscribed
        | PresenceType::Unsubscribe
        | PresenceType::Unsubscribed => {
            let Some(kind) = SubKind::of(ty) else {
                return;
            };
            // RFC 6121 §3.1.2: subscriptions are between bare JIDs.
            let (contact, local) = match target {
                Target::LocalBare(b) => (b, true),
                Target::LocalFull(f) => (f.to_bare(), true),
                Target::Remote(j) => (j.to_bare(), false),
                Target::OwnAccount | Target::LocalDomain => return,
            };
            if contact == own_bare {
                return;
            }
            // XEP-0191 §3.5: presence (subscriptions included) to or from a blocked
            // local entity is dropped without an error, whether it is online or not.
            if local && gate::blocked_either(pres, &own_bare, &contact).await {
                return;
            }
            outbound_subscription(pres, session, &contact, kind, el).await;
        }
        // RFC 6121 §4.3: probes are normally the server's business; a client that sends one
        // gets the same answer (and the same subscription check) as the server's own probe.
        PresenceType::Probe => match target {
            Target::LocalBare(b) if b != own_bare => {
                let me = session.jid().clone();
                answer_probe(pres, &me, &b).await;
            }
            Target::LocalFull(f) => {
                let me = session.jid().clone();
                answer_probe(pres, &me, &f.to_bare()).await;
            }
            Target::Remote(_) => {
                let mut p = el;
                p.set_attr("from", own_bare.to_string());
                let _ = pres.outbox.route_remote(p);
            }
            _ => {}
        },
        PresenceType::Error => {
            if let Target::LocalFull(f) = target {
                pres.outbox.to_session(&f, el);
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

/// Broadcast of available (§4.2 initial, §4.4 update) or unavailable (§4.5) presence.
async fn broadcast(pres: &Presence, session: &Client, mut el: Element, is_available: bool) {
    el.remove_attr("to");
    el.set_attr("from", session.jid().to_string());
    let change = Transition {
        was_available: session.handle.is_available(),
        is_available,
        invisible: session.handle.is_invisible(),
    };
    if !is_available && !change.was_available && !session.handle.read(|p| p.has_directed()) {
        record(session, &el, None);
        return;
    }
    // Serialised once; each copy (contacts' and own resources', here and on other nodes,
    // and later probe answers) differs only in 'to'.
    let once = Arc::new(Addressed::new(&el));
    let (inputs, successor) = show_to_audience(pres, session, &el, &once, change).await;
    // The user's own resources, the sender included (§4.2.2); they have the successor's
    // presence for this full JID, if there is one.
    if !successor.is_available() {
        let me_id = session.handle.id;
        let bare = session.jid().to_bare();
        outbox::to_each_here(
            &pres.sessions,
            bare.as_str(),
            |s| s.id == me_id || s.is_available(),
            |jid| once.to(jid),
        );
    }
    if !is_available {
        unavailable_to_directed(pres, session, &el, &successor).await;
    } else if !change.was_available {
        initial_presence(pres, session, &inputs, change.invisible).await;
    }
}

/// What a broadcast changes: the session's availability before and after, and whether it
/// is invisible (XEP-0186).
#[derive(Debug, Clone, Copy)]
struct Transition {
    was_available: bool,
    is_available: bool,
    invisible: bool,
}

impl Transition {
    /// The session's initial presence (§4.2).
    fn initial(self) -> bool {
        self.is_available && !self.was_available
    }
}

/// Records presence `el` as the session's state: available with its priority and the
/// stanza as broadcast (`shown`, its serialisation), or unavailable.
fn record(session: &Client, el: &Element, shown: Option<&Arc<Addressed>>) {
    session.handle.write(|info| {
        info.available = shown.is_some();
        info.priority = if shown.is_some() { priority_of(el) } else { 0 };
        info.last = shown.cloned();
    })
}

/// Under the subject lock: records the new state, and sends `el` (serialised once in
/// `once`) to the contacts who may see it, here, on other nodes and on other servers,
/// recording who was shown an available presence. Returns the privacy inputs (whose roster
/// the initial presence probes) and the resource's successor, if it was taken over.
async fn show_to_audience(
    pres: &Presence,
    session: &Client,
    el: &Element,
    once: &Arc<Addressed>,
    change: Transition,
) -> (Arc<AudienceInputs>, Successor) {
    let me = session.jid();
    let bare = me.to_bare();
    let is_available = change.is_available;
    let _guard = pres.subject_locks.lock_subject(bare.as_str()).await;
    // Read under the lock, so a successor's broadcast is either done (and what it showed
    // recorded) or not begun.
    let successor = if is_available {
        Successor::None
    } else {
        Successor::of(pres, session).await
    };
    // The new state is recorded under the subject lock: a reconciliation holding the lock
    // must see the old state (and leave this resource to us) or the new one with its
    // broadcast done (and its viewers marked revealed), never the new state before the
    // broadcast, or it would send this presence a second time.
    record(session, el, is_available.then_some(once));
    if !successor.holds_resource() {
        to_directory(pres, &session.handle);
    }
    // The roster and the contacts who may see the user (RFC 6121 §4.2.2 / §4.4.2 /
    // §4.5.2), as the privacy gate says, in one read; an invisible session (XEP-0186)
    // shows itself to nobody.
    // A change of an already available resource keeps the inputs for the next one;
    // initial presence does not, so an idle session costs no cache memory.
    let keep = change.was_available && is_available;
    let inputs = gate::session_inputs(pres, &session.handle, keep).await;
    if change.initial() {
        // The roster get's read, if it kept one for this broadcast (RFC 6121 §2.2), is
        // used now; an idle session keeps nothing.
        pres.store
            .forget_audience_of(bare.as_str(), session.handle.id);
    }
    // Nothing to show (invisible, or unavailable after unavailable): no one is decided.
    let shown = !change.invisible && (is_available || change.was_available);
    let audience = shown
        .then(|| gate::audience(&bare, &inputs))
        .into_iter()
        .flatten();
    let (remote, local) = recipients(pres, session, audience, &successor, is_available);
    let mut reached = Vec::new();
    for contact in remote {
        // One stanza per remote contact; s2s sends them over that domain's one stream.
        let mut p = el.clone();
        p.set_attr("to", contact.as_ref());
        if pres.outbox.route_remote(p).is_ok() {
            reached.push(contact);
        }
    }
    // Local contacts' sessions here, then one message per other node that holds any of
    // them or the user's own sessions there (§4.2.2).
    let own = (!successor.is_available()).then(|| bare.to_string());
    let initial = outbox::Reach::Record {
        initial: change.initial(),
    };
    reached.extend(pres.outbox.to_contacts(once, local, own, initial).await);
    // Remember who saw this resource online, so a lost permission withdraws it from
    // exactly them (the subject lock makes this atomic with the delivery).
    if is_available {
        for contact in reached.iter().filter(|c| *c != bare.as_str()) {
            session
                .handle
                .reveal(contact, privacy::Relation::Subscriber);
        }
    }
    (inputs, successor)
}

/// The contacts a broadcast goes to, on other servers and on this one: the `audience` the
/// gate admits and, for an unavailable, everyone who was shown this resource online (even
/// if a change of permissions has not withdrawn it from them yet); minus those the
/// `successor` shows its own presence to, and those the session's bounded revealed set
/// could not record (they could not be withdrawn from later). Each leaves the session's
/// directed set: the broadcast reaches it now. The audience's JIDs stay borrowed from the
/// privacy inputs (a login's broadcast names every contact; a copy each was an allocation
/// per contact).
fn recipients<'a>(
    pres: &Presence,
    session: &Client,
    audience: impl Iterator<Item = &'a BareJid>,
    successor: &Successor,
    is_available: bool,
) -> (Vec<Cow<'a, str>>, Vec<Cow<'a, str>>) {
    // Each recipient, and whether the gate's audience holds it (rather than only the
    // resource's revealed set).
    let mut all: BTreeMap<Cow<'a, str>, bool> = audience
        .map(|c| (Cow::Borrowed(c.as_str()), true))
        .collect();
    if !is_available {
        for (viewer, rel) in session.handle.write(|p| p.take_revealed()) {
            if rel == privacy::Relation::Subscriber {
                all.entry(Cow::Owned(viewer.to_string())).or_insert(false);
            }
        }
    }
    let (mut remote, mut local) = (Vec::new(), Vec::new());
    // Viewers the session can still record as shown (recorded once the deliveries here and
    // on other nodes are known).
    let mut room = session.handle.read(|p| p.room());
    for (contact, in_audience) in all {
        session.handle.write(|p| p.remove_directed(&contact));
        if successor.shows(&contact, || in_audience) {
            // Its presence is the resource's now; this unavailable would undo it.
            continue;
        }
        if is_available && !session.handle.was_revealed(&contact) {
            if room == 0 {
                tracing::warn!(jid = %session.jid(), viewer = %contact, "revealed set full; presence not sent");
                continue;
            }
            room -= 1;
        }
        if pres.serves(domain_of(&contact)) {
            local.push(contact);
        } else {
            remote.push(contact);
        }
    }
    (remote, local)
}

/// §4.6.3: everyone who got directed presence gets the unavailable `el` too, except a
/// party blocked since (XEP-0191: it already got its unavailable, nothing more) and one
/// the successor sent its own directed presence.
async fn unavailable_to_directed(
    pres: &Presence,
    session: &Client,
    el: &Element,
    successor: &Successor,
) {
    let directed = session.handle.write(|p| p.take_directed());
    for to in directed {
        if successor.directed_to(&to) {
            continue;
        }
        // Recorded from a `to` that was checked; fails closed otherwise.
        let Ok(to_jid) = crate::protocol::jid::parse(&to) else {
            continue;
        };
        if gate::blocked_either(pres, &to_jid, session.jid()).await {
            continue;
        }
        let mut p = el.clone();
        p.set_attr("to", to.clone());
        pres.outbox.presence_to(&to, p);
    }
}

/// Initial presence: probes the contacts the user is subscribed to (§4.2.2, §4.3; the
/// local ones are answered together, from one read of the privacy inputs), shows the new
/// resource the user's other resources, and hands it the subscription requests that
/// waited (§3.1.3).
async fn initial_presence(
    pres: &Presence,
    session: &Client,
    inputs: &AudienceInputs,
    invisible: bool,
) {
    let me = session.jid();
    let bare = me.to_bare();
    let mut local = Vec::new();
    for item in inputs.roster.iter().filter(|i| i.subscription.has_to()) {
        if pres.serves(item.contact.domain().as_str()) {
            local.push(&item.contact);
        } else if !invisible || session.handle.read(|p| p.probe_remote) {
            // A probe tells the remote server the user is online; an invisible session
            // sends one only if it asked to (XEP-0186 `probe='true'`).
            // RFC 6121 §4.3.1: probes to remote contacts go from the user's bare JID.
            let probe = presence(PresenceType::Probe, bare.as_str(), item.contact.as_str());
            let _ = pres.outbox.route_remote(probe);
        }
    }
    // The user's settings come from the same read as the roster: they decide the
    // last-seen stamps of the answers (reciprocity).
    answer_probes(pres, me, local, &inputs.settings).await;
    own_resources_to_new(pres, session, &bare).await;
    pending_requests(pres, session, &bare).await;
}

/// The new resource learns the presence of the user's other resources, here and on other
/// nodes, invisible ones included (the directory keeps their presence; only other users'
/// probe answers leave it out).
async fn own_resources_to_new(pres: &Presence, session: &Client, bare: &BareJid) {
    let me = session.jid();
    for s in pres.sessions.of_user(bare) {
        if s.id == session.handle.id {
            continue;
        }
        // Local: the stored serialisation, re-addressed (no element parsed back).
        if let Some(last) = s.last_presence_to(me.as_str()) {
            session.deliver(last);
        }
    }
    let elsewhere = pres.cluster.holders(&[bare.as_str()]).await;
    for h in elsewhere.into_values().flatten() {
        let last = h.entry.presence.as_deref().filter(|_| h.entry.available);
        if let Some(mut last) = last.and_then(crate::protocol::xml::parse_element) {
            last.set_attr("to", me.to_string());
            session.deliver(last);
        }
    }
}

/// §3.1.3: subscription requests that waited for the user to come online.
async fn pending_requests(pres: &Presence, session: &Client, bare: &BareJid) {
    match pres.store.pending_subscriptions(bare.as_str()).await {
        Ok(pending) => {
            for (from, xml) in pending {
                // XEP-0191 §3.5: a request from an entity blocked since it was stored is
                // not delivered (it stays pending and reappears if unblocked).
                let Ok(from_jid) = crate::protocol::jid::parse(&from) else {
                    continue;
                };
                if gate::blocked_either(pres, &from_jid, bare).await {
                    continue;
                }
                match crate::protocol::xml::parse_element(&xml) {
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

/// Writes what the cluster directory says about this session (availability, priority,
/// visibility, and its last available presence, which other nodes show to the user's own
/// resources and, only while visible (XEP-0186), in probe answers; and whether it takes
/// XEP-0280 copies and XEP-0191 block-list pushes) from its current state: after every
/// broadcast, visibility change, carbons switch and block-list retrieval.
pub(crate) fn to_directory(pres: &Presence, handle: &crate::node::sessions::SessionHandle) {
    let (available, priority, shown, invisible, carbons, blocklist) = handle.read(|p| {
        let shown = p
            .last
            .as_ref()
            .filter(|_| p.available)
            .map(|l| l.unaddressed().to_owned());
        (
            p.available,
            p.priority,
            shown,
            p.invisible,
            p.carbons,
            p.blocklist_interested,
        )
    });
    let entry = crate::cluster::Entry {
        // Set by the cluster to this instance.
        instance: Default::default(),
        available,
        priority,
        visible: !invisible,
        carbons,
        blocklist,
        presence: shown,
    };
    pres.cluster.update(&handle.jid, entry);
}

/// After this node was cut off from Redis, the other nodes may have announced its users
/// unavailable (their sweepers found no beats): each visible, available session here shows
/// its current presence again, through the gate as a broadcast would, to its contacts on
/// the other nodes (one message per node and session). Contacts on this node never lost it.
pub async fn show_again_to_other_nodes(pres: &Presence) {
    for user in pres.sessions.users() {
        for s in pres.sessions.of_user_str(&user) {
            let Some(last) = s.read(|p| p.last.clone().filter(|_| p.available)) else {
                continue;
            };
            if s.is_invisible() {
                continue;
            }
            to_directory(pres, &s);
            let _guard = pres.subject_locks.lock_subject(&user).await;
            // Only viewers the session can record as shown (its bounded set) are sent it.
            let mut room = s.read(|p| p.room());
            let mut audience = Vec::new();
            for c in gate::session_audience(pres, &s).await {
                let c = c.into_inner();
                if !pres.serves(domain_of(&c)) {
                    continue;
                }
                if !s.was_revealed(&c) {
                    if room == 0 {
                        continue;
                    }
                    room -= 1;
                }
                audience.push(c);
            }
            for viewer in pres.outbox.fan_out(&last, audience, false).await {
                s.reveal(&viewer, privacy::Relation::Subscriber);
            }
        }
    }
}

pub use crate::protocol::jid::domain_of;

/// Answers, on the contact's behalf, a probe from `prober` for local contact `contact`
/// (RFC 6121 §4.3.2), through the privacy gate ([`gate::probe_answer`]).
async fn answer_probe(pres: &Presence, prober: &FullJid, contact: &BareJid) {
    let Some(prober_session) = pres.sessions.get(prober) else {
        return;
    };
    gate::probe_answer(pres, prober, contact, |p| {
        outbox::to_handle(&prober_session, p);
    })
    .await;
}

/// [`answer_probe`] for several local contacts at once (the probes of a login).
async fn answer_probes(
    pres: &Presence,
    prober: &FullJid,
    contacts: Vec<&BareJid>,
    settings: &privacy::PrivacySettings,
) {
    if contacts.is_empty() {
        return;
    }
    let Some(prober_session) = pres.sessions.get(prober) else {
        return;
    };
    gate::probe_answers(pres, prober, contacts, Some(settings), |p| {
        outbox::to_handle(&prober_session, p);
    })
    .await;
}

/// When a local user was last seen, if known: the last heartbeat of a silent death or the
/// close time of a clean one (see [`crate::liveness::last_seen`]).
pub async fn last_seen(pres: &Presence, bare: &str) -> Option<chrono::DateTime<chrono::Utc>> {
    crate::liveness::last_seen::when(&pres.liveness, &pres.store, bare)
        .await
        .map(|l| l.at)
}

/// Directed presence (RFC 6121 §4.6): delivered to the one recipient and remembered, so the
/// user's unavailable reaches it too.
async fn directed(pres: &Presence, session: &Client, mut el: Element, is_available: bool) {
    let Some(to) = el.get_attr("to").map(str::to_owned) else {
        return;
    };
    el.set_attr("from", session.jid().to_string());
    // XEP-0191 §3.5: directed presence to or from a blocked entity is dropped silently.
    let Ok(to_jid) = crate::protocol::jid::parse(&to) else {
        return;
    };
    if gate::blocked_either(pres, &to_jid, session.jid()).await {
        return;
    }
    if is_available {
        // An invisible session may still send directed presence (XEP-0186 §3.1); it
        // gets the matching unavailable later, like any other.
        let (available, invisible) = session.handle.read(|p| (p.available, p.invisible));
        if (available || invisible) && !track_directed(session, &to, &el) {
            return;
        }
        if !session
            .handle
            .reveal(&to, privacy::Relation::DirectedPresence)
        {
            session.handle.write(|p| p.remove_directed(&to));
            refuse_directed(session, &el, "revealed set full");
            return;
        }
    } else {
        session.handle.write(|p| {
            p.remove_directed(&to);
            p.forget(&to);
        });
    }
    pres.outbox.to_local(&to, el);
}

/// Tracks `to` as a directed-presence recipient of the session, or refuses the presence
/// when the session's set is full (`max_directed_presences`): a target that cannot be
/// tracked would never get the unavailable RFC 6121 §4.6.3 promises it, so it is not sent
/// the available either, and the client gets `resource-constraint` (RFC 6120 §8.3.3.18).
fn track_directed(session: &Client, to: &str, el: &Element) -> bool {
    if session.handle.write(|p| p.add_directed(to)) {
        return true;
    }
    refuse_directed(session, el, "directed presence set full");
    false
}

fn refuse_directed(session: &Client, el: &Element, why: &str) {
    tracing::warn!(peer = %session.peer, jid = %session.jid(), to = ?el.get_attr("to"), "{why}; directed presence refused");
    if let Some(reply) = StanzaError::resource_constraint().reply_to(el) {
        session.deliver(reply);
    }
}

/// Loads one side's item and Appendix A state; the pending inbound request lives in the
/// pending table when no roster item exists (RFC 6121 §3.1.3: a request creates no item).
pub(crate) async fn load_side(
    pres: &Presence,
    owner: &str,
    contact: &str,
) -> Result<(Option<RosterItem>, SubState), crate::store::StoreError> {
    let item = pres.store.roster_item(owner, contact).await?;
    let mut state = item.as_ref().map(|i| i.sub_state()).unwrap_or_default();
    if !state.pending_in {
        state.pending_in = pres.store.has_pending_subscription(owner, contact).await?;
    }
    Ok((item, state.normalized()))
}

/// What must be written for one side after a transition: the item, or nothing when the
/// item does not exist and the new state is a bare pending inbound request, which is kept in
/// the pending table instead: RFC 6121 §3.1.3, a request creates no roster item, so every
/// stored item is part of the roster the user sees.
pub(crate) fn updated_item(
    owner_item: Option<RosterItem>,
    contact: &BareJid,
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
            let mut i = RosterItem::new(contact.clone());
            i.set_sub_state(state);
            // A pending inbound request without an item is kept in the pending table.
            item = Some(i);
        }
    }
    item
}

/// A subscription stanza from the session's user to `contact`, local or remote (RFC 6121
/// §3.1.2, §3.2.2, §3.3.2, §3.4), under both users' roster locks.
async fn outbound_subscription(
    pres: &Presence,
    session: &Client,
    contact: &BareJid,
    kind: SubKind,
    stanza: Element,
) {
    let user = session.jid().to_bare();
    let _locks = pres
        .roster_locks
        .lock(&[user.as_str(), contact.as_str()])
        .await;
    let change = Exchange {
        user: &user,
        contact,
        direction: Direction::Out,
        kind,
        removal: false,
    };
    if let Err(e) = change.apply(pres, stanza).await {
        crate::services::roster::push::subscription_refused(
            session,
            contact.as_str(),
            kind.as_str(),
            &e,
        );
    }
}

/// One subscription stanza between a local user and a contact, local or remote, whichever
/// way it travels: both sides' states are loaded, [`subscription::plan`] decides, and
/// [`executor::apply`] writes and sends. The caller holds both users' roster locks.
pub(crate) struct Exchange<'a> {
    /// The local user.
    pub user: &'a BareJid,
    /// The contact, here or on another server (`Direction::In` only from another server).
    pub contact: &'a BareJid,
    pub direction: Direction,
    pub kind: SubKind,
    /// Sent on the user's behalf while the item is removed (RFC 6121 §2.5.2).
    pub removal: bool,
}

impl Exchange<'_> {
    /// Plans and applies the change for `stanza`.
    pub(crate) async fn apply(
        &self,
        pres: &Presence,
        mut stanza: Element,
    ) -> Result<(), crate::store::StoreError> {
        let (user, contact) = (self.user, self.contact);
        let (user_item, user_state) = load_side(pres, user.as_str(), contact.as_str()).await?;
        let contact_here = pres.serves(contact.domain().as_str());
        let contact_node = contact.node().map(|n| n.as_str()).unwrap_or("");
        let (contact_item, side) = if !contact_here {
            (None, ContactSide::Remote)
        } else if pres
            .store
            .account_exists(contact_node, contact.domain().as_str())
            .await?
        {
            let (item, state) = load_side(pres, contact.as_str(), user.as_str()).await?;
            (item, ContactSide::Local(state))
        } else {
            // RFC 6121 §8.5.1: nothing reaches an account that does not exist; the
            // user's own side still moves.
            (None, ContactSide::Absent)
        };
        // RFC 6121 §3.1.2: subscription stanzas travel between bare JIDs.
        let (from, to) = match self.direction {
            Direction::Out => (user, contact),
            Direction::In => (contact, user),
        };
        stanza.set_attr("from", from.as_str());
        stanza.set_attr("to", to.as_str());
        let planned = subscription::plan(Change {
            direction: self.direction,
            kind: self.kind,
            user: user_state,
            contact: side,
            removal: self.removal,
        });
        let parties = executor::Parties {
            user: user.clone(),
            user_item,
            contact: contact.clone(),
            contact_item,
            contact_here,
        };
        executor::apply(pres, executor::Plan::of(planned, parties, &stanza)).await
    }
}

/// Pushes a written roster item to its owner's interested resources when `push` (the
/// subscription table's decision: the change is one a client can see, RFC 6121 §2.1.6);
/// otherwise the sessions still count as having seen this version, or the roster
/// listener would replay it as a change made elsewhere.
pub(crate) fn push_or_note(
    pres: &Presence,
    owner: &str,
    version: i64,
    item: &RosterItem,
    push: bool,
) {
    if push {
        crate::services::roster::push::push_item(&pres.sessions, owner, version, item);
        return;
    }
    for s in pres.sessions.of_user_str(owner) {
        if s.read(|p| p.roster_ver).is_some() {
            crate::services::roster::push::note_version(&s, version);
        }
    }
}

/// RFC 6121 §2.5.2: removing a roster item cancels and revokes subscriptions first, as the
/// server's own stanzas on the user's behalf, to a local or remote contact alike. The
/// caller holds both users' roster locks.
async fn roster_removed(pres: &Presence, session: &Client, item: &RosterItem) {
    let user = session.jid().to_bare();
    let contact = &item.contact;
    for kind in subscription::roster_remove(item.sub_state()) {
        let change = Exchange {
            user: &user,
            contact,
            direction: Direction::Out,
            kind,
            removal: true,
        };
        let stanza = presence(kind.presence_type(), user.as_str(), contact.as_str());
        if let Err(e) = change.apply(pres, stanza).await {
            crate::services::roster::push::subscription_refused(
                session,
                contact.as_str(),
                kind.as_str(),
                &e,
            );
        }
    }
}

/// Called when a session ends: an available session's contacts get unavailable
/// (RFC 6121 §4.5.2: the server does this when the client did not).
async fn session_ended(pres: &Presence, session: &Client) {
    let (available, directed) = session.handle.read(|p| (p.available, p.has_directed()));
    if available || directed {
        let p = Element::new("presence", NS_CLIENT).attr("type", PresenceType::Unavailable.name());
        broadcast(pres, session, p, false).await;
    }
    // Nothing the session remembers about others outlives it, even while a copy of its
    // handle is still held somewhere; what the node keeps for it is keyed by its id, so a
    // new session of the same resource keeps its own.
    session.handle.write(|p| p.clear());
    pres.caps.forget_session(session.handle.id);
    pres.store
        .forget_audience_of(session.jid().to_bare().as_str(), session.handle.id);
}

/// Who holds a session's full JID when that session's unavailable goes out, if not the
/// session itself: a new session of the same resource (a reconnect within the grace
/// period, or a bind that replaced it, RFC 6120 §7.7.2.2). Its presence is the resource's
/// now, so the old session's unavailable reaches only those the successor has not shown
/// itself to: the user's own resources and the viewers it reached would otherwise be told
/// that a resource which is online is offline. Read under the subject's lock, where the
/// successor's broadcast is either done and recorded or not begun.
enum Successor {
    /// Nobody else: the unavailable goes to everyone it concerns.
    None,
    /// A session on this node: exactly the viewers it recorded as shown.
    Here(crate::node::sessions::SessionHandle),
    /// A session on another node (the directory): the node broadcast it to the audience
    /// the gate admits, if it is available and visible.
    Elsewhere { available: bool, shown: bool },
}

impl Successor {
    async fn of(pres: &Presence, session: &Client) -> Successor {
        let me = session.jid();
        match pres.sessions.get(me) {
            Some(s) if s.id != session.handle.id => return Successor::Here(s),
            // Still the registered session: the client's own unavailable.
            Some(_) => return Successor::None,
            None => {}
        }
        match pres.cluster.holder_of(me).await {
            Some(h) => Successor::Elsewhere {
                available: h.entry.available,
                shown: h.entry.available && h.entry.visible,
            },
            None => Successor::None,
        }
    }

    /// Whether another session holds the resource (and with it the directory entry).
    fn holds_resource(&self) -> bool {
        !matches!(self, Successor::None)
    }

    /// Whether the successor is available: the user's own resources have its presence.
    fn is_available(&self) -> bool {
        match self {
            Successor::None => false,
            Successor::Here(s) => s.is_available(),
            Successor::Elsewhere { available, .. } => *available,
        }
    }

    /// Whether the successor's presence reached `viewer` (`in_audience`: whether the gate
    /// admits it now, which is whom a broadcast on another node reached).
    fn shows(&self, viewer: &str, in_audience: impl FnOnce() -> bool) -> bool {
        match self {
            Successor::None => false,
            Successor::Here(s) => s.is_available() && s.was_revealed(viewer),
            Successor::Elsewhere { shown, .. } => *shown && in_audience(),
        }
    }

    /// Whether the successor sent `to` directed presence of its own (known only here).
    fn directed_to(&self, to: &str) -> bool {
        match self {
            Successor::Here(s) => s.read(|p| p.is_directed(to)),
            _ => false,
        }
    }
}

/// The unavailable of resource `jid`, whose session died with its node (RFC 6121 §4.5.2),
/// to the user's other resources and to the local contacts that may see it now.
///
/// What the session had been shown to died with the node; the viewers the privacy gate
/// admits now ([`gate::online_audience`]: approved subscribers that no block, setting or
/// lost subscription excludes) stand in for it, so a blocked or hidden contact learns
/// nothing; contacts on other nodes of the cluster get it there. Remote contacts are told by their own server when the federation link breaks.
///
/// A resource its directory entry says was invisible (XEP-0186) or never available had
/// been shown to no contact, so none is told: an unavailable from its full JID would say
/// it had been online. (Without an entry to read, the gate's audience is told as before.)
///
/// `last` is that entry, read by the caller for a whole batch of lost resources in one
/// pipeline ([`crate::cluster::Cluster::last_entry_read`]).
pub(crate) async fn unavailable_of_lost(
    pres: &Presence,
    jid: &FullJid,
    last: Option<&crate::cluster::Entry>,
) {
    let bare = jid.to_bare();
    let shown = last.is_none_or(|e| e.available && e.visible);
    // Its directory entry goes too, once its node is no longer live.
    pres.cluster.forget_if_dead(jid);
    // One stanza, addressed to each recipient: here per session, elsewhere one message per
    // node holding any of them (not one per recipient).
    let once = crate::protocol::xml::Addressed::new(&crate::node::outbox::unavailable(
        jid.as_str(),
        bare.as_str(),
    ));
    let _guard = pres.subject_locks.lock_subject(bare.as_str()).await;
    let mut recipients: Vec<String> = if shown {
        gate::online_audience(pres, jid)
            .await
            .into_iter()
            .map(BareJid::into_inner)
            .filter(|contact| pres.outbox.is_local(contact))
            .collect()
    } else {
        Vec::new()
    };
    // The user's own available resources, on this node and the others (RFC 6121 §4.5.2).
    recipients.push(bare.to_string());
    pres.outbox
        .to_contacts(&once, recipients, None, crate::node::outbox::Reach::Send)
        .await;
}
