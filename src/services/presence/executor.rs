//! The one executor of subscription changes (RFC 6121 §3): whichever path a subscription
//! stanza takes — a local user to a local contact, a local user to a remote contact, a
//! remote contact to a local user, or the cancel and revoke of a roster removal — the
//! caller ([`super::Exchange`]) loads the state and asks the one planner
//! ([`super::subscription::plan`]); [`Plan::of`] gives the parties' addresses to what it
//! planned, and [`apply`] carries the plan out the same way for all of them.
//!
//! The order is RFC 6121's: the roster items and the pending request table, which follows
//! each side's inbound-request flag (§3.1.3), are written in one transaction; the roster
//! pushes go
//! next, "before locally delivering or remotely routing" the stanza (§3.1.2, §3.1.5,
//! §3.2.2), each to the interested resources of its owner only when the table says the
//! change is one a client can see (§2.1.6); then the stanzas and the presence the table
//! asked for, in the order the caller listed them.
//!
//! A roster changed in SQL or on another node arrives as an owner and a version, with no
//! stanza for the table to read; [`apply_external`] replays the changed items to each
//! session from the version it last saw and has the gate re-decide the presence.
//!
//! The caller holds the roster locks of both users ([`crate::node::RosterLocks`]) for the
//! whole load, decide and apply, so the roster listener never sees a change half pushed.

use super::Presence;
use crate::protocol::jid::BareJid;
use crate::protocol::xml::Element;
use crate::store::{PendingChange, RosterChange, RosterItem, StoreError};

use super::subscription::{Party, Planned, SideChange, Step, SubState};
use super::{presence, push_or_note, updated_item};

/// One owner's roster item moved through the table.
pub(crate) struct Side {
    /// The owner (a local user).
    pub owner: BareJid,
    /// The contact the item is about.
    pub contact: BareJid,
    /// The item as loaded (none when the owner has no item for the contact).
    pub item: Option<RosterItem>,
    /// The state loaded, pending inbound request included.
    pub old: SubState,
    /// The state the table gave.
    pub new: SubState,
    /// The table's push decision for this owner.
    pub push: bool,
    /// The subscription request to keep for the owner until answered (§3.1.3), when this
    /// change leaves one waiting.
    pub keep_request: Option<String>,
}

/// Something the table asked to send, in the order it is listed.
pub(crate) enum Effect {
    /// A stanza to a local user's available resources.
    ToAvailable { user: BareJid, stanza: Element },
    /// A stanza for another server. A failure is bounced to its local sender when
    /// `bounce` (the user's own stanza), dropped otherwise (an answer the server made).
    Route { stanza: Element, bounce: bool },
    /// The current presence of local `subject` to `viewer`, local or remote, through the
    /// gate (§3.1.5).
    CurrentPresence { subject: BareJid, viewer: BareJid },
    /// Unavailable from each resource of local `subject` that `viewer` was shown
    /// (§3.2.2, §3.3.3).
    UnavailableFromShown { subject: BareJid, viewer: BareJid },
    /// Remote `remote`'s presence is no longer shown to local `local` (§3.2.3).
    RemoteWithdrawn { remote: BareJid, local: BareJid },
}

/// What one subscription stanza does: the items to write and what to send.
#[derive(Default)]
pub(crate) struct Plan {
    pub sides: Vec<Side>,
    pub effects: Vec<Effect>,
}

/// The two parties of a planned change: the local user and the contact, each with the
/// roster item loaded for the other.
pub(crate) struct Parties {
    pub user: BareJid,
    pub user_item: Option<RosterItem>,
    pub contact: BareJid,
    pub contact_item: Option<RosterItem>,
    /// The contact is an account here (its stanzas are delivered, not routed).
    pub contact_here: bool,
}

impl Parties {
    fn jid(&self, party: Party) -> &BareJid {
        match party {
            Party::User => &self.user,
            Party::Contact => &self.contact,
        }
    }
}

impl Plan {
    /// What the planner decided, with the parties' addresses: where the contact lives
    /// decides only whether its stanzas are delivered here or routed. `stanza` is the one
    /// planned, stamped with both bare JIDs.
    pub(crate) fn of(planned: Planned, parties: Parties, stanza: &Element) -> Plan {
        let side = |owner: &BareJid, contact: &BareJid, item, c: SideChange| Side {
            owner: owner.clone(),
            contact: contact.clone(),
            item,
            old: c.old,
            new: c.new,
            push: c.push,
            keep_request: c.keep_request.then(|| stanza.to_xml()),
        };
        let mut plan = Plan::default();
        let p = &parties;
        plan.sides
            .push(side(&p.user, &p.contact, p.user_item.clone(), planned.user));
        if let Some(c) = planned.contact {
            plan.sides
                .push(side(&p.contact, &p.user, p.contact_item.clone(), c));
        }
        for step in planned.steps {
            plan.effects.push(match step {
                Step::Send {
                    from,
                    kind,
                    original,
                    bounce,
                } => {
                    let (sender, to) = (p.jid(from), p.jid(from.other()));
                    let stanza = if original {
                        stanza.clone()
                    } else {
                        presence(kind.presence_type(), sender.as_str(), to.as_str())
                    };
                    if from == Party::Contact || p.contact_here {
                        Effect::ToAvailable {
                            user: to.clone(),
                            stanza,
                        }
                    } else {
                        Effect::Route { stanza, bounce }
                    }
                }
                Step::CurrentPresence { subject } => Effect::CurrentPresence {
                    subject: p.jid(subject).clone(),
                    viewer: p.jid(subject.other()).clone(),
                },
                Step::UnavailableFromShown { subject } => Effect::UnavailableFromShown {
                    subject: p.jid(subject).clone(),
                    viewer: p.jid(subject.other()).clone(),
                },
                Step::ContactWithdrawn => Effect::RemoteWithdrawn {
                    remote: p.contact.clone(),
                    local: p.user.clone(),
                },
            });
        }
        plan
    }
}

/// Carries out `plan` (see the module documentation for the order). The caller holds the
/// roster locks of every owner in it.
pub(crate) async fn apply(pres: &Presence, plan: Plan) -> Result<(), StoreError> {
    let written: Vec<Option<RosterItem>> = plan
        .sides
        .iter()
        .map(|s| updated_item(s.item.clone(), &s.contact, s.new))
        .collect();
    let writes: Vec<(String, RosterItem)> = plan
        .sides
        .iter()
        .zip(&written)
        .filter_map(|(s, w)| w.clone().map(|i| (s.owner.to_string(), i)))
        .collect();
    // The pending table follows each side's inbound-request flag (§3.1.3), in the items'
    // transaction.
    let pending: Vec<PendingChange> = plan
        .sides
        .iter()
        .filter_map(|s| {
            let (owner, sender) = (s.owner.as_str(), s.contact.as_str());
            match &s.keep_request {
                Some(stanza) => Some(PendingChange::Keep {
                    owner,
                    sender,
                    stanza,
                }),
                None if s.old.pending_in && !s.new.pending_in => {
                    Some(PendingChange::Drop { owner, sender })
                }
                None => None,
            }
        })
        .collect();
    let versions = if writes.is_empty() && pending.is_empty() {
        Vec::new()
    } else {
        pres.store
            .write_subscription_change(&writes, &pending)
            .await?
    };
    for (owner, version) in &versions {
        let found = plan
            .sides
            .iter()
            .zip(&written)
            .find(|(s, w)| s.owner.as_str() == owner && w.is_some());
        if let Some((side, Some(item))) = found {
            push_or_note(pres, owner, *version, item, side.push);
        }
    }
    for effect in plan.effects {
        match effect {
            Effect::ToAvailable { user, stanza } => {
                let here = pres.outbox.to_available(user.as_str(), &stanza);
                if here == 0 {
                    wake_for_request(pres, &user, &stanza).await;
                }
            }
            Effect::Route { stanza, bounce } => {
                if let Err(e) = pres.outbox.route_remote(stanza.clone()) {
                    if bounce {
                        pres.outbox.bounce_unroutable(&stanza, e);
                    }
                }
            }
            Effect::CurrentPresence { subject, viewer } => {
                let local = pres.serves(viewer.domain().as_str());
                super::gate::current_presence(pres, &subject, &viewer, |p| {
                    if local {
                        pres.outbox.to_available(viewer.as_str(), &p);
                    } else {
                        let _ = pres.outbox.route_remote(p);
                    }
                })
                .await;
            }
            Effect::UnavailableFromShown { subject, viewer } => {
                pres.outbox
                    .unavailable_from_shown(subject.as_str(), viewer.as_str());
            }
            Effect::RemoteWithdrawn { remote, local } => {
                pres.s2s.saw_unavailable(remote.as_str(), local.as_str());
            }
        }
    }
    Ok(())
}

/// A roster change made outside this node (an operator's SQL, the `presenced_roster_*`
/// functions, another node), known only by its owner and version: there is no stanza for
/// the table to read. Each session of `owner` gets the pushes of exactly the changes since
/// the version it last saw (up to `version`, or the current one for `i64::MAX`), and the
/// gate re-decides the presence that follows; both under the owner's roster lock, like
/// every change [`apply`] makes, so a change this node made itself has delivered its
/// stanzas in RFC 6121 order (e.g. `subscribed` before the presence that follows it,
/// §3.1.5) before this looks, and then finds nothing to do.
///
/// One change of SQL often touches two rosters (`presenced_roster_make_mutual`), whose
/// announcements arrive one at a time. The owner's presence may now go to a local contact
/// whose own roster push for the owner is still waiting for its announcement, and a client
/// drops presence from a JID its roster lacks (RFC 6121 §2.1.6: the push comes first). So
/// the local contacts of the owner's changed items that have sessions here get their own
/// pending pushes before the owner's presence is re-decided; their announcements, handled
/// later, then find nothing to push.
pub(crate) async fn apply_external(pres: &Presence, owner: &str, version: i64) {
    let contacts = {
        let _lock = pres.roster_locks.lock(&[owner]).await;
        replay_pushes(pres, owner, version).await
    };
    let mut users = vec![owner];
    users.extend(contacts.iter().map(String::as_str));
    let _lock = pres.roster_locks.lock(&users).await;
    for contact in &contacts {
        replay_pushes(pres, contact, i64::MAX).await;
    }
    presence_after_external(pres, owner).await;
}

/// [`apply_external`] for a change that touched two users' rosters at once (an
/// operator's roster command): both users' sessions get their roster pushes before either
/// sees the presence that follows, as a client-made subscription orders them (the push,
/// RFC 6121 §3.1.5 and §2.1.6, then the presence).
pub(crate) async fn apply_external_pair(pres: &Presence, a: &str, b: &str) {
    let _lock = pres.roster_locks.lock(&[a, b]).await;
    for owner in [a, b] {
        replay_pushes(pres, owner, i64::MAX).await;
    }
    for owner in [a, b] {
        presence_after_external(pres, owner).await;
    }
}

/// Brings every session of `owner` up to `version` (or to the current version for
/// `i64::MAX`); returns the contacts of the changes pushed that are users with sessions on
/// this node. The caller holds the owner's roster lock.
async fn replay_pushes(pres: &Presence, owner: &str, version: i64) -> Vec<String> {
    let sessions = pres.sessions.of_user_str(owner);
    // The oldest version any session of the user has seen; presence effects are computed
    // once per user from there.
    let Some(seen) = sessions
        .iter()
        .filter_map(|s| s.read(|p| p.roster_ver))
        .min()
    else {
        return Vec::new();
    };
    if seen >= version {
        return Vec::new();
    }
    let (current, changes) = match pres.store.roster_since(owner, seen).await {
        Ok(Some(r)) => r,
        Ok(None) => return Vec::new(),
        Err(e) => {
            tracing::warn!(owner, error = %e, "roster sync failed");
            return Vec::new();
        }
    };
    if changes.is_empty() {
        return Vec::new();
    }
    tracing::info!(
        owner,
        changes = changes.len(),
        version = current,
        seen,
        notified = version,
        "pushing roster changes made outside this node"
    );
    tracing::debug!(owner, ?changes, "roster changes");
    for s in &sessions {
        let Some(ver) = s.read(|p| p.roster_ver) else {
            continue;
        };
        if ver >= current {
            continue;
        }
        for change in &changes {
            let item = match change {
                RosterChange::Upsert(i) => crate::services::roster::push::item_element(i),
                RosterChange::Removed(c) => Element::new("item", crate::protocol::xml::NS_ROSTER)
                    .attr("jid", c.as_str())
                    .attr("subscription", "remove"),
            };
            crate::services::roster::push::push_to(s, current, item);
        }
    }
    changes
        .iter()
        .map(|change| match change {
            RosterChange::Upsert(i) => i.contact.as_str(),
            RosterChange::Removed(c) => c.as_str(),
        })
        .filter(|c| *c != owner && !pres.sessions.of_user_str(c).is_empty())
        .map(str::to_owned)
        .collect()
}

/// The presence consequences of a roster change made outside this node: withdrawn from
/// each viewer that lost permission, from the resources it was shown, and granted to
/// those that gained it ([`super::gate::reconcile_user`]). They follow the stored rosters,
/// not the versions a client fetched: a client that never asked for its roster sees its
/// contacts' presence come and go all the same. The caller holds the owner's roster lock.
async fn presence_after_external(pres: &Presence, owner: &str) {
    if pres.sessions.of_user_str(owner).is_empty() {
        return;
    }
    // The owner of a stored roster; one that is no JID has no session.
    if let Ok(owner) = crate::protocol::jid::parse_bare(owner) {
        super::gate::reconcile_user(pres, &owner).await;
    }
}

/// XEP-0357: a subscription request for a local user with no available resource here or
/// on another node is kept (the pending table) for the next login; the user's sleeping
/// clients are woken for it.
async fn wake_for_request(pres: &Presence, owner: &BareJid, stanza: &Element) {
    let Some(trigger) = crate::services::push::Trigger::of(stanza) else {
        return;
    };
    if !pres.outbox.is_local(owner.as_str()) {
        return;
    }
    if pres.cluster.has_peers()
        && pres
            .cluster
            .holders(&[owner.as_str()])
            .await
            .get(owner.as_str())
            .is_some_and(|h| !h.is_empty())
    {
        return;
    }
    pres.push.kept_for(owner, &trigger).await;
}
