//! RFC 6121 §3 and Appendix A: the subscription state machine as pure functions.
//!
//! A roster item describes the relation between its owner (the *user*) and one *contact*.
//! Every subscription stanza the user sends ([`outbound`]) or receives from the contact
//! ([`inbound`]) moves that item through the nine states of RFC 6121 Appendix A.1, plus the
//! pre-approval flag of §3.4. The functions here only decide: they return the new state and
//! what the router must do (forward, deliver, push, auto-reply, send presence). Storage and
//! sending belong to the caller, so the whole machine is tested against literal tables.
//!
//! Decisions where the RFC leaves room, written down here so the next engineer finds them:
//!
//! - A roster push is due when what a client can see of the item changes: `subscription`,
//!   `ask` and `approved` (RFC 6121 §2.1.2). A pending *inbound* request is not part of the
//!   item's XML, so a change of [`SubState::pending_in`] alone is stored but not pushed;
//!   this also keeps an inbound request from creating a roster item (§3.1.3).
//! - Impossible combinations (a pending request in a direction that is already subscribed,
//!   a pre-approval next to an existing or pending `from`) are dropped on entry and exit
//!   ([`SubState::normalized`]), so a bad row in storage cannot spread.
//! - An inbound `subscribe` that the server auto-answers also asks for the user's current
//!   presence to be sent to the contact: the contact's side now shows `to`, and without it
//!   would see the user offline until the user's next change.

use thiserror::Error;

use crate::protocol::stanza::PresenceType;

/// A roster attribute value that is not one RFC 6121 defines.
///
/// Exists so that parsing an attribute from the wire fails with a value the caller can map
/// to a stanza error (RFC 6120 §8.3.3.1 bad-request) instead of panicking or guessing.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{attribute} has no value {value:?} in RFC 6121")]
pub struct UnknownValue {
    /// Which attribute was being parsed (`subscription` or presence `type`).
    pub attribute: &'static str,
    /// The rejected text, for the log line.
    pub value: String,
}

/// The `subscription` attribute of a roster item (RFC 6121 §2.1.2.5).
///
/// It records only approved subscriptions; requests in flight live in the pending flags of
/// [`SubState`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Subscription {
    /// Neither side receives the other's presence.
    #[default]
    None,
    /// The user receives the contact's presence.
    To,
    /// The contact receives the user's presence.
    From,
    /// Both directions.
    Both,
}

impl Subscription {
    /// The attribute value as written in a roster item.
    pub fn as_str(self) -> &'static str {
        match self {
            Subscription::None => "none",
            Subscription::To => "to",
            Subscription::From => "from",
            Subscription::Both => "both",
        }
    }

    /// Parses a roster `subscription` attribute. `remove` is not a state (it is a request
    /// in a roster set, RFC 6121 §2.5) and is rejected here.
    pub fn parse(value: &str) -> Result<Self, UnknownValue> {
        match value {
            "none" => Ok(Subscription::None),
            "to" => Ok(Subscription::To),
            "from" => Ok(Subscription::From),
            "both" => Ok(Subscription::Both),
            other => Err(UnknownValue {
                attribute: "subscription",
                value: other.to_owned(),
            }),
        }
    }

    /// True for `to` and `both`: the user is subscribed to the contact.
    pub fn has_to(self) -> bool {
        matches!(self, Subscription::To | Subscription::Both)
    }

    /// True for `from` and `both`: the contact is subscribed to the user.
    pub fn has_from(self) -> bool {
        matches!(self, Subscription::From | Subscription::Both)
    }

    fn from_halves(to: bool, from: bool) -> Self {
        match (to, from) {
            (false, false) => Subscription::None,
            (true, false) => Subscription::To,
            (false, true) => Subscription::From,
            (true, true) => Subscription::Both,
        }
    }
}

/// The full state of one roster item: one of the nine states of RFC 6121 Appendix A.1,
/// plus the pre-approval of §3.4.
///
/// The four fields map one to one onto storage columns; the nine RFC states are the
/// combinations [`SubState::is_defined`] accepts. `SubState::default()` is "None", which is
/// also the state of a contact that has no roster item at all (Appendix A.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SubState {
    /// Approved subscriptions in either direction.
    pub subscription: Subscription,
    /// The user asked for the contact's presence and has no answer yet ("Pending Out",
    /// shown to clients as `ask='subscribe'`).
    pub pending_out: bool,
    /// The contact asked for the user's presence and the user has not answered ("Pending
    /// In"). Stored durably so the request can be delivered at the next login (§3.1.3), but
    /// never shown in the roster item.
    pub pending_in: bool,
    /// The user approved a request the contact has not made yet (§3.4); the next inbound
    /// `subscribe` is answered by the server. Shown as `approved='true'`.
    pub preapproved: bool,
}

impl SubState {
    /// The "None" state: no subscriptions, nothing pending, nothing pre-approved.
    pub const NONE: SubState = SubState {
        subscription: Subscription::None,
        pending_out: false,
        pending_in: false,
        preapproved: false,
    };

    /// A state with the given subscription and no pending requests or pre-approval.
    pub const fn new(subscription: Subscription) -> Self {
        SubState {
            subscription,
            pending_out: false,
            pending_in: false,
            preapproved: false,
        }
    }

    /// The roster item's `ask` attribute (RFC 6121 §2.1.2.2): `subscribe` while the user's
    /// request is unanswered, absent otherwise.
    pub fn ask(&self) -> Option<&'static str> {
        self.pending_out.then_some("subscribe")
    }

    /// The contact receives the user's presence broadcasts and probe answers (RFC 6121
    /// §4.2.2, §4.3.2): subscription `from` or `both`.
    pub fn contact_sees_user(&self) -> bool {
        self.subscription.has_from()
    }

    /// The user receives the contact's presence, so the user's server probes the contact
    /// at login (RFC 6121 §4.3.1): subscription `to` or `both`.
    pub fn user_sees_contact(&self) -> bool {
        self.subscription.has_to()
    }

    /// True when the state is one of the nine of RFC 6121 Appendix A.1 and pre-approval is
    /// only set where §3.4.1 can set it (no `from`, no pending inbound request).
    pub fn is_defined(&self) -> bool {
        *self == self.normalized()
    }

    /// Drops flags that contradict the subscription: no pending request in a direction
    /// that is already approved (Appendix A.1 has no "To + Pending Out" or "From + Pending
    /// In"), and no pre-approval once the contact is subscribed or has asked (§3.4.1).
    pub fn normalized(self) -> Self {
        let to = self.subscription.has_to();
        let from = self.subscription.has_from();
        let pending_in = self.pending_in && !from;
        SubState {
            subscription: self.subscription,
            pending_out: self.pending_out && !to,
            pending_in,
            preapproved: self.preapproved && !from && !pending_in,
        }
    }

    /// The name RFC 6121 Appendix A.1 gives this state (pre-approval is not part of the
    /// name), for log lines and test failures.
    pub fn rfc_name(&self) -> &'static str {
        let s = self.normalized();
        match (s.subscription, s.pending_out, s.pending_in) {
            (Subscription::None, false, false) => "None",
            (Subscription::None, true, false) => "None + Pending Out",
            (Subscription::None, false, true) => "None + Pending In",
            (Subscription::None, true, true) => "None + Pending Out+In",
            (Subscription::To, _, false) => "To",
            (Subscription::To, _, true) => "To + Pending In",
            (Subscription::From, false, _) => "From",
            (Subscription::From, true, _) => "From + Pending Out",
            (Subscription::Both, _, _) => "Both",
        }
    }

    /// What a roster push carries: subscription, ask, approved. Compared before and after
    /// a transition to decide whether a push is due.
    fn visible(&self) -> (Subscription, bool, bool) {
        (self.subscription, self.pending_out, self.preapproved)
    }

    fn set_to(&mut self, to: bool) {
        self.subscription = Subscription::from_halves(to, self.subscription.has_from());
    }

    fn set_from(&mut self, from: bool) {
        self.subscription = Subscription::from_halves(self.subscription.has_to(), from);
    }
}

/// The four subscription-related presence types (RFC 6121 §3, RFC 6120 §8.2.2 `type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SubKind {
    /// Ask for the other side's presence (§3.1).
    Subscribe,
    /// Approve the other side's request, or pre-approve one (§3.1.5, §3.4).
    Subscribed,
    /// Stop receiving the other side's presence (§3.3).
    Unsubscribe,
    /// Refuse a request or revoke an approval (§3.2).
    Unsubscribed,
}

impl SubKind {
    /// Every kind, for callers and tests that walk all of them.
    pub const ALL: [SubKind; 4] = [
        SubKind::Subscribe,
        SubKind::Subscribed,
        SubKind::Unsubscribe,
        SubKind::Unsubscribed,
    ];

    /// The kind a presence type is; `None` for the types that are not subscription stanzas
    /// (available, unavailable, probe, error).
    pub fn of(ty: PresenceType) -> Option<Self> {
        match ty {
            PresenceType::Subscribe => Some(SubKind::Subscribe),
            PresenceType::Subscribed => Some(SubKind::Subscribed),
            PresenceType::Unsubscribe => Some(SubKind::Unsubscribe),
            PresenceType::Unsubscribed => Some(SubKind::Unsubscribed),
            PresenceType::Available
            | PresenceType::Unavailable
            | PresenceType::Probe
            | PresenceType::Error => None,
        }
    }

    /// The presence type of this kind's stanza.
    pub fn presence_type(self) -> PresenceType {
        match self {
            SubKind::Subscribe => PresenceType::Subscribe,
            SubKind::Subscribed => PresenceType::Subscribed,
            SubKind::Unsubscribe => PresenceType::Unsubscribe,
            SubKind::Unsubscribed => PresenceType::Unsubscribed,
        }
    }

    /// The presence `type` attribute value.
    pub fn as_str(self) -> &'static str {
        self.presence_type().name()
    }

    /// Parses a presence `type` attribute. Other presence types (available, unavailable,
    /// probe, error) are not subscription stanzas and are rejected, so the caller routes
    /// them elsewhere.
    pub fn parse(value: &str) -> Result<Self, UnknownValue> {
        PresenceType::parse(Some(value))
            .and_then(SubKind::of)
            .ok_or_else(|| UnknownValue {
                attribute: "presence type",
                value: value.to_owned(),
            })
    }
}

/// What to do when the user sends a subscription stanza to the contact (RFC 6121
/// Appendix A.2), as decided by [`outbound`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outbound {
    /// The item's state afterwards; store it if it differs from the old one.
    pub state: SubState,
    /// Forward the stanza (stamped with the user's bare JID) to the contact: the ROUTE?
    /// column of Appendix A.2. False for ignored stanzas and for a pre-approval, which
    /// §3.4.1 forbids routing.
    pub route: bool,
    /// Send a roster push with the new state to the user's interested resources
    /// (RFC 6121 §2.1.6), because subscription, ask or approved changed. This includes
    /// the push of an item that did not exist before.
    pub push: bool,
    /// Send the user's current presence from each available resource to the contact, after
    /// routing the approval (§3.1.5: the contact now has `from`).
    pub send_presence: bool,
    /// Send unavailable presence from each of the user's available resources to the
    /// contact *before* routing the `unsubscribed` (§3.2.2: the contact loses `from`).
    pub send_unavailable: bool,
}

/// What to do when the contact's subscription stanza reaches the user's server (RFC 6121
/// Appendix A.3), as decided by [`inbound`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Inbound {
    /// The item's state afterwards; store it if it differs from the old one (including a
    /// change of `pending_in` alone: the request must survive until the user answers).
    pub state: SubState,
    /// Deliver the stanza to the user's interested resources, or keep it for the next
    /// login if none is available (§3.1.3): the DELIVER? column of Appendix A.3.
    pub deliver: bool,
    /// Send a roster push with the new state to the user's interested resources.
    pub push: bool,
    /// A stanza the server sends to the contact on the user's behalf, from the user's bare
    /// JID, without asking the user: `subscribed` when the contact is already approved
    /// (§3.1.3) or was pre-approved (§3.4).
    pub auto_reply: Option<SubKind>,
    /// Send the user's current presence from each available resource to the contact
    /// (after the auto-reply): the contact has `from` and should not see the user offline.
    pub send_presence: bool,
    /// Send unavailable presence from each of the user's available resources to the
    /// contact (§3.3.3: the contact unsubscribed from the user's presence).
    pub send_unavailable: bool,
}

/// The user sends `kind` to the contact; `state` is the user's roster item for the contact
/// (`SubState::NONE` if there is none). RFC 6121 Appendix A.2, with §3.4 pre-approval.
pub fn outbound(state: SubState, kind: SubKind) -> Outbound {
    let old = state.normalized();
    let mut new = old;
    let mut route = false;
    let mut send_presence = false;
    let mut send_unavailable = false;
    match kind {
        // A.2.1 / §3.1.2: always routed, so a lost request can be repeated; only a user
        // who is not subscribed yet gets the pending flag.
        SubKind::Subscribe => {
            route = true;
            if !old.subscription.has_to() {
                new.pending_out = true;
            }
        }
        // A.2.2 / §3.3.2: always routed; drops `to` and any request of ours.
        SubKind::Unsubscribe => {
            route = true;
            new.pending_out = false;
            new.set_to(false);
        }
        SubKind::Subscribed => {
            if old.subscription.has_from() {
                // §3.4.1 rule 1: already approved, silently ignore.
            } else if old.pending_in {
                // A.2.3 / §3.1.5: a normal approval of the contact's request.
                route = true;
                new.pending_in = false;
                new.set_from(true);
                send_presence = true;
            } else {
                // §3.4.1 rules 3 and 4: no request yet, so this is a pre-approval; it is
                // noted and pushed but MUST NOT be routed.
                new.preapproved = true;
            }
        }
        SubKind::Unsubscribed => {
            if old.subscription.has_from() {
                // A.2.4 / §3.2.2: revoke; unavailable goes out while the contact can still
                // accept it.
                route = true;
                send_unavailable = true;
                new.set_from(false);
            } else if old.pending_in {
                // A.2.4 / §3.2.2: deny the contact's request.
                route = true;
                new.pending_in = false;
            }
            // §3.4: `unsubscribed` also cancels a pre-approval (not routed on its own).
            new.preapproved = false;
        }
    }
    let new = new.normalized();
    Outbound {
        state: new,
        route,
        push: old.visible() != new.visible(),
        send_presence,
        send_unavailable,
    }
}

/// The contact's `kind` reaches the user's server; `state` is the user's roster item for
/// the contact (`SubState::NONE` if there is none). RFC 6121 Appendix A.3, with §3.4
/// pre-approval.
pub fn inbound(state: SubState, kind: SubKind) -> Inbound {
    let old = state.normalized();
    let mut new = old;
    let mut deliver = false;
    let mut auto_reply = None;
    let mut send_presence = false;
    let mut send_unavailable = false;
    match kind {
        SubKind::Subscribe => {
            if old.subscription.has_from() {
                // A.3.1 rows marked "*" / §3.1.3 rule 2: already approved; answer for the
                // user, do not bother the user.
                auto_reply = Some(SubKind::Subscribed);
                send_presence = true;
            } else if old.preapproved {
                // §3.4: the user approved in advance; approve now without delivering.
                new.set_from(true);
                auto_reply = Some(SubKind::Subscribed);
                send_presence = true;
            } else if old.pending_in {
                // A.3.1: a repeated request is neither delivered nor stored again
                // (§3.1.3: keep only one).
            } else {
                // A.3.1 / §3.1.3 rule 4: deliver (or keep for the next login).
                deliver = true;
                new.pending_in = true;
            }
        }
        SubKind::Subscribed => {
            // A.3.3 / §3.1.6: only an answer to a request of ours counts; an unsolicited
            // `subscribed` changes nothing and is not delivered.
            if old.pending_out && !old.subscription.has_to() {
                deliver = true;
                new.pending_out = false;
                new.set_to(true);
            }
        }
        SubKind::Unsubscribe => {
            if old.subscription.has_from() {
                // A.3.2 / §3.3.3: the contact stops watching the user.
                deliver = true;
                new.set_from(false);
                send_unavailable = true;
            } else if old.pending_in {
                // A.3.2: the contact withdraws its request.
                deliver = true;
                new.pending_in = false;
            }
        }
        SubKind::Unsubscribed => {
            // A.3.4 / §3.2.3: the contact revoked the user's subscription or refused the
            // user's request.
            if old.subscription.has_to() || old.pending_out {
                deliver = true;
                new.pending_out = false;
                new.set_to(false);
            }
        }
    }
    let new = new.normalized();
    Inbound {
        state: new,
        deliver,
        push: old.visible() != new.visible(),
        auto_reply,
        send_presence,
        send_unavailable,
    }
}

/// What the server sends to the contact on the user's behalf when the user removes the
/// roster item (RFC 6121 §2.5.2): `unsubscribe` if the user is subscribed or asking,
/// `unsubscribed` if the contact is subscribed or asking, in that order.
///
/// The item is gone afterwards, so these are routed directly (not through [`outbound`]).
/// When the list holds `unsubscribed` and `state.contact_sees_user()`, the router sends
/// unavailable presence to the contact first, as for [`Outbound::send_unavailable`].
pub fn roster_remove(state: SubState) -> Vec<SubKind> {
    let s = state.normalized();
    let mut kinds = Vec::with_capacity(2);
    if s.subscription.has_to() || s.pending_out {
        kinds.push(SubKind::Unsubscribe);
    }
    if s.subscription.has_from() || s.pending_in {
        kinds.push(SubKind::Unsubscribed);
    }
    kinds
}

/// Which of the two parties of a subscription change a planned step concerns: the *user*
/// (a local account, whose item the change starts from) or the *contact*.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Party {
    /// The local user.
    User,
    /// The contact, local or on another server.
    Contact,
}

impl Party {
    /// The other party.
    pub fn other(self) -> Party {
        match self {
            Party::User => Party::Contact,
            Party::Contact => Party::User,
        }
    }
}

/// Which way the stanza travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// The user sends it to the contact (Appendix A.2 on the user's item, then A.3 on the
    /// contact's when the contact is a local account).
    Out,
    /// The contact's stanza reaches the user's server from another server (A.3 on the
    /// user's item).
    In,
}

/// The contact's side as far as this server knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContactSide {
    /// A local account; its item for the user (`SubState::NONE` if it has none).
    Local(SubState),
    /// A local address without an account: RFC 6121 §8.5.1, nothing reaches it and the
    /// user's own item still moves.
    Absent,
    /// An account on another server, which keeps its own roster and answers over
    /// federation.
    Remote,
}

/// One subscription stanza to plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    /// Which way it travels (`In` only from a remote contact).
    pub direction: Direction,
    /// The stanza's kind.
    pub kind: SubKind,
    /// The user's item for the contact, pending inbound request included.
    pub user: SubState,
    /// The contact's side.
    pub contact: ContactSide,
    /// The server sends it on the user's behalf while removing the item (RFC 6121 §2.5.2):
    /// the user's intermediate state is not pushed (the removal is), and the stanza is the
    /// server's, so a routing failure is not bounced to the user.
    pub removal: bool,
}

/// What one side's item does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SideChange {
    /// The state loaded.
    pub old: SubState,
    /// The state to store.
    pub new: SubState,
    /// Push the change to the owner's interested resources (RFC 6121 §2.1.6).
    pub push: bool,
    /// Keep the inbound request for the owner until answered (§3.1.3).
    pub keep_request: bool,
}

/// Something to send, in the order planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// A subscription stanza of `kind` from `from` to the other party: the one being
    /// planned when `original` (its status and extensions kept), else the answer the
    /// server writes on `from`'s behalf. `bounce`: a routing failure goes back to the
    /// user, whose own stanza it is.
    Send {
        from: Party,
        kind: SubKind,
        original: bool,
        bounce: bool,
    },
    /// The current presence of `subject` to the other party (§3.1.5).
    CurrentPresence { subject: Party },
    /// Unavailable from each resource of `subject` the other party was shown (§3.2.2,
    /// §3.3.3).
    UnavailableFromShown { subject: Party },
    /// The remote contact's presence is no longer shown to the user (§3.2.3).
    ContactWithdrawn,
}

/// The plan of one subscription stanza: both items and what to send, in RFC 6121 order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    /// The user's item.
    pub user: SideChange,
    /// The contact's item, when the contact is a local account the stanza reached.
    pub contact: Option<SideChange>,
    /// What to send, in order.
    pub steps: Vec<Step>,
}

/// Plans one subscription stanza between a local user and a contact, local or remote, in
/// the spirit of one function for every path: the user's row of Appendix A.2 (outbound)
/// or A.3 (inbound), and where the stanza reaches a local contact's server, that side's
/// row of A.3 and the automatic answer travelling back through the user's A.3.
pub fn plan(change: Change) -> Planned {
    let mut p = Planned {
        user: SideChange {
            old: change.user,
            new: change.user,
            push: false,
            keep_request: false,
        },
        contact: None,
        steps: Vec::new(),
    };
    match change.direction {
        Direction::Out => {
            let out = outbound(change.user, change.kind);
            p.user.new = out.state;
            p.user.push = out.push;
            let reaches = change.contact != ContactSide::Absent;
            if out.send_unavailable && reaches {
                // §3.2.2: before the unsubscribed, while the contact still accepts it.
                p.steps.push(Step::UnavailableFromShown {
                    subject: Party::User,
                });
            }
            if out.route {
                match change.contact {
                    ContactSide::Local(state) => {
                        p.contact = Some(p.arrive(Party::Contact, state, change.kind, true));
                    }
                    ContactSide::Remote => p.steps.push(Step::Send {
                        from: Party::User,
                        kind: change.kind,
                        original: true,
                        bounce: !change.removal,
                    }),
                    ContactSide::Absent => {}
                }
            }
            if out.send_presence && reaches {
                // §3.1.5: the new subscriber gets the user's current presence.
                p.steps.push(Step::CurrentPresence {
                    subject: Party::User,
                });
            }
        }
        Direction::In => p.user = p.arrive(Party::User, change.user, change.kind, false),
    }
    if change.removal {
        p.user.push = false;
    }
    p
}

impl Planned {
    /// The other party's `kind` reaches `to`, whose item is in `state` (Appendix A.3);
    /// `sender_here`: the sender's item is on this server too, so an automatic answer
    /// moves it through A.3 as well, and is delivered only where that row delivers.
    fn arrive(
        &mut self,
        to: Party,
        state: SubState,
        kind: SubKind,
        sender_here: bool,
    ) -> SideChange {
        let inb = inbound(state, kind);
        let from = to.other();
        if inb.deliver {
            self.steps.push(Step::Send {
                from,
                kind,
                original: true,
                bounce: false,
            });
        }
        if let Some(reply) = inb.auto_reply {
            // The server answers on `to`'s behalf (already approved, or pre-approved).
            let deliver = if sender_here {
                let back = inbound(self.user.new, reply);
                self.user.new = back.state;
                self.user.push |= back.push;
                back.deliver
            } else {
                true
            };
            if deliver {
                self.steps.push(Step::Send {
                    from: to,
                    kind: reply,
                    original: false,
                    bounce: false,
                });
            }
        }
        if inb.send_presence {
            // §3.1.5 / §4.3.2: the new subscriber gets the current presence.
            self.steps.push(Step::CurrentPresence { subject: to });
        }
        if inb.send_unavailable {
            // §3.3.3: only from the resources the sender was shown.
            self.steps.push(Step::UnavailableFromShown { subject: to });
        }
        if kind == SubKind::Unsubscribed && inb.deliver && !sender_here {
            // §3.2.3: the user no longer sees the remote contact.
            self.steps.push(Step::ContactWithdrawn);
        }
        SideChange {
            old: state,
            new: inb.state,
            push: inb.push,
            // §3.1.3: kept until the owner answers, and shown again at each login.
            keep_request: inb.state.pending_in && kind == SubKind::Subscribe,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::SubKind::{Subscribe, Subscribed, Unsubscribe, Unsubscribed};
    use super::*;

    const fn st(subscription: Subscription, out: bool, inn: bool, pre: bool) -> SubState {
        SubState {
            subscription,
            pending_out: out,
            pending_in: inn,
            preapproved: pre,
        }
    }

    // The nine states of Appendix A.1 ...
    const N: SubState = st(Subscription::None, false, false, false);
    const N_PO: SubState = st(Subscription::None, true, false, false);
    const N_PI: SubState = st(Subscription::None, false, true, false);
    const N_POI: SubState = st(Subscription::None, true, true, false);
    const T: SubState = st(Subscription::To, false, false, false);
    const T_PI: SubState = st(Subscription::To, false, true, false);
    const F: SubState = st(Subscription::From, false, false, false);
    const F_PO: SubState = st(Subscription::From, true, false, false);
    const B: SubState = st(Subscription::Both, false, false, false);
    // ... and the three where §3.4.1 rule 3 can add a pre-approval.
    const N_A: SubState = st(Subscription::None, false, false, true);
    const N_PO_A: SubState = st(Subscription::None, true, false, true);
    const T_A: SubState = st(Subscription::To, false, false, true);

    const ALL_STATES: [SubState; 12] =
        [N, N_PO, N_PI, N_POI, T, T_PI, F, F_PO, B, N_A, N_PO_A, T_A];

    const Y: bool = true;
    const O: bool = false;

    /// Side effects beyond forward/push, one column in the tables.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Fx {
        /// Nothing else.
        No,
        /// Send the user's current presence to the contact.
        Pres,
        /// Send unavailable from the user's resources to the contact.
        Unav,
        /// Auto-reply `subscribed`, then send current presence.
        Ack,
    }

    // (existing state, user sends, new state, ROUTE?, push, effects)
    #[rustfmt::skip]
    const OUTBOUND: [(SubState, SubKind, SubState, bool, bool, Fx); 48] = [
        // A.2.1 subscribe
        (N,      Subscribe,    N_PO,   Y, Y, Fx::No),
        (N_PO,   Subscribe,    N_PO,   Y, O, Fx::No),
        (N_PI,   Subscribe,    N_POI,  Y, Y, Fx::No),
        (N_POI,  Subscribe,    N_POI,  Y, O, Fx::No),
        (T,      Subscribe,    T,      Y, O, Fx::No),
        (T_PI,   Subscribe,    T_PI,   Y, O, Fx::No),
        (F,      Subscribe,    F_PO,   Y, Y, Fx::No),
        (F_PO,   Subscribe,    F_PO,   Y, O, Fx::No),
        (B,      Subscribe,    B,      Y, O, Fx::No),
        (N_A,    Subscribe,    N_PO_A, Y, Y, Fx::No),
        (N_PO_A, Subscribe,    N_PO_A, Y, O, Fx::No),
        (T_A,    Subscribe,    T_A,    Y, O, Fx::No),
        // A.2.2 unsubscribe
        (N,      Unsubscribe,  N,      Y, O, Fx::No),
        (N_PO,   Unsubscribe,  N,      Y, Y, Fx::No),
        (N_PI,   Unsubscribe,  N_PI,   Y, O, Fx::No),
        (N_POI,  Unsubscribe,  N_PI,   Y, Y, Fx::No),
        (T,      Unsubscribe,  N,      Y, Y, Fx::No),
        (T_PI,   Unsubscribe,  N_PI,   Y, Y, Fx::No),
        (F,      Unsubscribe,  F,      Y, O, Fx::No),
        (F_PO,   Unsubscribe,  F,      Y, Y, Fx::No),
        (B,      Unsubscribe,  F,      Y, Y, Fx::No),
        (N_A,    Unsubscribe,  N_A,    Y, O, Fx::No),
        (N_PO_A, Unsubscribe,  N_A,    Y, Y, Fx::No),
        (T_A,    Unsubscribe,  N_A,    Y, Y, Fx::No),
        // A.2.3 subscribed; rows without a pending request are §3.4 pre-approvals
        (N,      Subscribed,   N_A,    O, Y, Fx::No),
        (N_PO,   Subscribed,   N_PO_A, O, Y, Fx::No),
        (N_PI,   Subscribed,   F,      Y, Y, Fx::Pres),
        (N_POI,  Subscribed,   F_PO,   Y, Y, Fx::Pres),
        (T,      Subscribed,   T_A,    O, Y, Fx::No),
        (T_PI,   Subscribed,   B,      Y, Y, Fx::Pres),
        (F,      Subscribed,   F,      O, O, Fx::No),
        (F_PO,   Subscribed,   F_PO,   O, O, Fx::No),
        (B,      Subscribed,   B,      O, O, Fx::No),
        (N_A,    Subscribed,   N_A,    O, O, Fx::No),
        (N_PO_A, Subscribed,   N_PO_A, O, O, Fx::No),
        (T_A,    Subscribed,   T_A,    O, O, Fx::No),
        // A.2.4 unsubscribed; it also cancels a pre-approval (§3.4)
        (N,      Unsubscribed, N,      O, O, Fx::No),
        (N_PO,   Unsubscribed, N_PO,   O, O, Fx::No),
        (N_PI,   Unsubscribed, N,      Y, O, Fx::No),
        (N_POI,  Unsubscribed, N_PO,   Y, O, Fx::No),
        (T,      Unsubscribed, T,      O, O, Fx::No),
        (T_PI,   Unsubscribed, T,      Y, O, Fx::No),
        (F,      Unsubscribed, N,      Y, Y, Fx::Unav),
        (F_PO,   Unsubscribed, N_PO,   Y, Y, Fx::Unav),
        (B,      Unsubscribed, T,      Y, Y, Fx::Unav),
        (N_A,    Unsubscribed, N,      O, Y, Fx::No),
        (N_PO_A, Unsubscribed, N_PO,   O, Y, Fx::No),
        (T_A,    Unsubscribed, T,      O, Y, Fx::No),
    ];

    // (existing state, contact sends, new state, DELIVER?, push, effects)
    #[rustfmt::skip]
    const INBOUND: [(SubState, SubKind, SubState, bool, bool, Fx); 48] = [
        // A.3.1 subscribe; pre-approved rows are auto-approved (§3.4)
        (N,      Subscribe,    N_PI,   Y, O, Fx::No),
        (N_PO,   Subscribe,    N_POI,  Y, O, Fx::No),
        (N_PI,   Subscribe,    N_PI,   O, O, Fx::No),
        (N_POI,  Subscribe,    N_POI,  O, O, Fx::No),
        (T,      Subscribe,    T_PI,   Y, O, Fx::No),
        (T_PI,   Subscribe,    T_PI,   O, O, Fx::No),
        (F,      Subscribe,    F,      O, O, Fx::Ack),
        (F_PO,   Subscribe,    F_PO,   O, O, Fx::Ack),
        (B,      Subscribe,    B,      O, O, Fx::Ack),
        (N_A,    Subscribe,    F,      O, Y, Fx::Ack),
        (N_PO_A, Subscribe,    F_PO,   O, Y, Fx::Ack),
        (T_A,    Subscribe,    B,      O, Y, Fx::Ack),
        // A.3.2 unsubscribe
        (N,      Unsubscribe,  N,      O, O, Fx::No),
        (N_PO,   Unsubscribe,  N_PO,   O, O, Fx::No),
        (N_PI,   Unsubscribe,  N,      Y, O, Fx::No),
        (N_POI,  Unsubscribe,  N_PO,   Y, O, Fx::No),
        (T,      Unsubscribe,  T,      O, O, Fx::No),
        (T_PI,   Unsubscribe,  T,      Y, O, Fx::No),
        (F,      Unsubscribe,  N,      Y, Y, Fx::Unav),
        (F_PO,   Unsubscribe,  N_PO,   Y, Y, Fx::Unav),
        (B,      Unsubscribe,  T,      Y, Y, Fx::Unav),
        (N_A,    Unsubscribe,  N_A,    O, O, Fx::No),
        (N_PO_A, Unsubscribe,  N_PO_A, O, O, Fx::No),
        (T_A,    Unsubscribe,  T_A,    O, O, Fx::No),
        // A.3.3 subscribed
        (N,      Subscribed,   N,      O, O, Fx::No),
        (N_PO,   Subscribed,   T,      Y, Y, Fx::No),
        (N_PI,   Subscribed,   N_PI,   O, O, Fx::No),
        (N_POI,  Subscribed,   T_PI,   Y, Y, Fx::No),
        (T,      Subscribed,   T,      O, O, Fx::No),
        (T_PI,   Subscribed,   T_PI,   O, O, Fx::No),
        (F,      Subscribed,   F,      O, O, Fx::No),
        (F_PO,   Subscribed,   B,      Y, Y, Fx::No),
        (B,      Subscribed,   B,      O, O, Fx::No),
        (N_A,    Subscribed,   N_A,    O, O, Fx::No),
        (N_PO_A, Subscribed,   T_A,    Y, Y, Fx::No),
        (T_A,    Subscribed,   T_A,    O, O, Fx::No),
        // A.3.4 unsubscribed
        (N,      Unsubscribed, N,      O, O, Fx::No),
        (N_PO,   Unsubscribed, N,      Y, Y, Fx::No),
        (N_PI,   Unsubscribed, N_PI,   O, O, Fx::No),
        (N_POI,  Unsubscribed, N_PI,   Y, Y, Fx::No),
        (T,      Unsubscribed, N,      Y, Y, Fx::No),
        (T_PI,   Unsubscribed, N_PI,   Y, Y, Fx::No),
        (F,      Unsubscribed, F,      O, O, Fx::No),
        (F_PO,   Unsubscribed, F,      Y, Y, Fx::No),
        (B,      Unsubscribed, F,      Y, Y, Fx::No),
        (N_A,    Unsubscribed, N_A,    O, O, Fx::No),
        (N_PO_A, Unsubscribed, N_A,    Y, Y, Fx::No),
        (T_A,    Unsubscribed, N_A,    Y, Y, Fx::No),
    ];

    fn outbound_fx(o: &Outbound) -> Fx {
        match (o.send_presence, o.send_unavailable) {
            (false, false) => Fx::No,
            (true, false) => Fx::Pres,
            (false, true) => Fx::Unav,
            (true, true) => panic!("presence and unavailable at once: {o:?}"),
        }
    }

    fn inbound_fx(i: &Inbound) -> Fx {
        match (i.auto_reply, i.send_presence, i.send_unavailable) {
            (None, false, false) => Fx::No,
            (None, true, false) => Fx::Pres,
            (None, false, true) => Fx::Unav,
            (Some(SubKind::Subscribed), true, false) => Fx::Ack,
            _ => panic!("effect combination no table row allows: {i:?}"),
        }
    }

    fn label(s: SubState) -> String {
        format!(
            "{}{}",
            s.rfc_name(),
            if s.preapproved { " + Pre-approved" } else { "" }
        )
    }

    #[test]
    fn outbound_follows_appendix_a2_for_every_state_and_kind() {
        let mut failures = Vec::new();
        for (old, kind, new, route, push, fx) in OUTBOUND {
            let got = outbound(old, kind);
            let want = Outbound {
                state: new,
                route,
                push,
                send_presence: fx == Fx::Pres,
                send_unavailable: fx == Fx::Unav,
            };
            if got != want {
                failures.push(format!(
                    "out {:?} in {}: got {} {:?}, want {} {:?}",
                    kind,
                    label(old),
                    label(got.state),
                    (got.route, got.push, outbound_fx(&got)),
                    label(new),
                    (route, push, fx),
                ));
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    #[test]
    fn inbound_follows_appendix_a3_for_every_state_and_kind() {
        let mut failures = Vec::new();
        for (old, kind, new, deliver, push, fx) in INBOUND {
            let got = inbound(old, kind);
            let want = Inbound {
                state: new,
                deliver,
                push,
                auto_reply: (fx == Fx::Ack).then_some(SubKind::Subscribed),
                send_presence: fx == Fx::Pres || fx == Fx::Ack,
                send_unavailable: fx == Fx::Unav,
            };
            if got != want {
                failures.push(format!(
                    "in {:?} in {}: got {} {:?}, want {} {:?}",
                    kind,
                    label(old),
                    label(got.state),
                    (got.deliver, got.push, inbound_fx(&got)),
                    label(new),
                    (deliver, push, fx),
                ));
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    #[test]
    fn tables_cover_every_state_kind_pair_exactly_once() {
        for table in [&OUTBOUND, &INBOUND] {
            for s in ALL_STATES {
                for k in SubKind::ALL {
                    let n = table.iter().filter(|r| r.0 == s && r.1 == k).count();
                    assert_eq!(n, 1, "{} x {:?} appears {n} times", label(s), k);
                }
            }
        }
    }

    #[test]
    fn every_transition_lands_in_a_defined_state() {
        for s in ALL_STATES {
            assert!(s.is_defined(), "{} should be defined", label(s));
            for k in SubKind::ALL {
                assert!(outbound(s, k).state.is_defined());
                assert!(inbound(s, k).state.is_defined());
            }
        }
    }

    #[test]
    fn impossible_stored_flags_are_dropped_before_deciding() {
        // "Both + Pending Out + Pending In + Pre-approved" is not an RFC state; it must act
        // like plain "Both" rather than, say, auto-approving twice.
        let junk = st(Subscription::Both, true, true, true);
        assert!(!junk.is_defined());
        assert_eq!(junk.normalized(), B);
        for k in SubKind::ALL {
            assert_eq!(outbound(junk, k), outbound(B, k));
            assert_eq!(inbound(junk, k), inbound(B, k));
        }
        // A pending inbound request outranks a stale pre-approval: the user still decides.
        assert_eq!(st(Subscription::None, false, true, true).normalized(), N_PI);
    }

    #[test]
    fn unsolicited_inbound_subscribed_is_dropped_in_every_state_without_ask() {
        for s in ALL_STATES.into_iter().filter(|s| !s.pending_out) {
            let r = inbound(s, Subscribed);
            assert_eq!(r.state, s, "{}", label(s));
            assert!(!r.deliver && !r.push, "{}", label(s));
        }
    }

    #[test]
    fn roster_remove_cancels_each_direction_that_exists_or_is_pending() {
        #[rustfmt::skip]
        let table: [(SubState, &[SubKind]); 12] = [
            (N,      &[]),
            (N_PO,   &[Unsubscribe]),
            (N_PI,   &[Unsubscribed]),
            (N_POI,  &[Unsubscribe, Unsubscribed]),
            (T,      &[Unsubscribe]),
            (T_PI,   &[Unsubscribe, Unsubscribed]),
            (F,      &[Unsubscribed]),
            (F_PO,   &[Unsubscribe, Unsubscribed]),
            (B,      &[Unsubscribe, Unsubscribed]),
            (N_A,    &[]),
            (N_PO_A, &[Unsubscribe]),
            (T_A,    &[Unsubscribe]),
        ];
        for (s, want) in table {
            assert_eq!(roster_remove(s), want, "{}", label(s));
        }
    }

    #[test]
    fn ask_is_subscribe_exactly_while_our_request_is_pending() {
        for s in ALL_STATES {
            assert_eq!(s.ask(), s.pending_out.then_some("subscribe"));
        }
        assert_eq!(N_PO.ask(), Some("subscribe"));
        assert_eq!(T.ask(), None);
    }

    #[test]
    fn visibility_predicates_follow_the_subscription_halves() {
        let cases = [
            (N, false, false),
            (T, false, true),
            (F, true, false),
            (B, true, true),
            (N_POI, false, false),
        ];
        for (s, contact_sees, user_sees) in cases {
            assert_eq!(s.contact_sees_user(), contact_sees, "{}", label(s));
            assert_eq!(s.user_sees_contact(), user_sees, "{}", label(s));
        }
    }

    #[test]
    fn attribute_values_round_trip_and_unknown_values_are_rejected() {
        for s in [
            Subscription::None,
            Subscription::To,
            Subscription::From,
            Subscription::Both,
        ] {
            assert_eq!(Subscription::parse(s.as_str()), Ok(s));
        }
        for k in SubKind::ALL {
            assert_eq!(SubKind::parse(k.as_str()), Ok(k));
        }
        assert!(Subscription::parse("remove").is_err());
        assert!(Subscription::parse("Both").is_err());
        assert!(SubKind::parse("probe").is_err());
        assert!(SubKind::parse("").is_err());
    }

    #[test]
    fn rfc_names_cover_the_nine_states() {
        let names: Vec<_> = ALL_STATES[..9].iter().map(|s| s.rfc_name()).collect();
        assert_eq!(
            names,
            [
                "None",
                "None + Pending Out",
                "None + Pending In",
                "None + Pending Out+In",
                "To",
                "To + Pending In",
                "From",
                "From + Pending Out",
                "Both"
            ]
        );
    }

    /// The Appendix A.2 row of `(state, kind)`.
    fn out_row(s: SubState, k: SubKind) -> (SubState, bool, bool, Fx) {
        let r = OUTBOUND.iter().find(|r| r.0 == s && r.1 == k).unwrap();
        (r.2, r.3, r.4, r.5)
    }

    /// The Appendix A.3 row of `(state, kind)`.
    fn in_row(s: SubState, k: SubKind) -> (SubState, bool, bool, Fx) {
        let r = INBOUND.iter().find(|r| r.0 == s && r.1 == k).unwrap();
        (r.2, r.3, r.4, r.5)
    }

    fn change(direction: Direction, kind: SubKind, user: SubState, contact: ContactSide) -> Change {
        Change {
            direction,
            kind,
            user,
            contact,
            removal: false,
        }
    }

    /// The steps of an A.3 row arriving at `to`, as the planner lists them; `reply` says
    /// whether the automatic answer is sent.
    fn arrival_steps(
        to: Party,
        kind: SubKind,
        row: (SubState, bool, bool, Fx),
        reply: bool,
    ) -> Vec<Step> {
        let (_, deliver, _, fx) = row;
        let mut steps = Vec::new();
        if deliver {
            steps.push(Step::Send {
                from: to.other(),
                kind,
                original: true,
                bounce: false,
            });
        }
        if fx == Fx::Ack && reply {
            steps.push(Step::Send {
                from: to,
                kind: Subscribed,
                original: false,
                bounce: false,
            });
        }
        if fx == Fx::Ack || fx == Fx::Pres {
            steps.push(Step::CurrentPresence { subject: to });
        }
        if fx == Fx::Unav {
            steps.push(Step::UnavailableFromShown { subject: to });
        }
        steps
    }

    /// A plan that moves only the user's item (no request kept) and sends `steps`.
    fn user_only(old: SubState, new: SubState, push: bool, steps: Vec<Step>) -> Planned {
        Planned {
            user: SideChange {
                old,
                new,
                push,
                keep_request: false,
            },
            contact: None,
            steps,
        }
    }

    #[test]
    fn plan_to_a_remote_contact_is_the_appendix_a2_row() {
        for (old, kind, new, route, push, fx) in OUTBOUND {
            let got = plan(change(Direction::Out, kind, old, ContactSide::Remote));
            let mut steps = Vec::new();
            if fx == Fx::Unav {
                steps.push(Step::UnavailableFromShown {
                    subject: Party::User,
                });
            }
            if route {
                steps.push(Step::Send {
                    from: Party::User,
                    kind,
                    original: true,
                    bounce: true,
                });
            }
            if fx == Fx::Pres {
                steps.push(Step::CurrentPresence {
                    subject: Party::User,
                });
            }
            assert_eq!(
                got,
                user_only(old, new, push, steps),
                "out {kind:?} in {}",
                label(old)
            );
        }
    }

    #[test]
    fn plan_from_a_remote_contact_is_the_appendix_a3_row() {
        for (old, kind, new, deliver, push, fx) in INBOUND {
            let got = plan(change(Direction::In, kind, old, ContactSide::Remote));
            let mut steps = arrival_steps(Party::User, kind, (new, deliver, push, fx), true);
            if kind == Unsubscribed && deliver {
                steps.push(Step::ContactWithdrawn);
            }
            let want = Planned {
                user: SideChange {
                    old,
                    new,
                    push,
                    keep_request: new.pending_in && kind == Subscribe,
                },
                contact: None,
                steps,
            };
            assert_eq!(got, want, "in {kind:?} in {}", label(old));
        }
    }

    #[test]
    fn plan_between_local_users_is_the_a2_row_then_the_contacts_a3_row_and_its_answer() {
        for user in ALL_STATES {
            for contact in ALL_STATES {
                for kind in SubKind::ALL {
                    let got = plan(change(
                        Direction::Out,
                        kind,
                        user,
                        ContactSide::Local(contact),
                    ));
                    let (mut u_new, route, mut u_push, u_fx) = out_row(user, kind);
                    let mut steps = Vec::new();
                    if u_fx == Fx::Unav {
                        steps.push(Step::UnavailableFromShown {
                            subject: Party::User,
                        });
                    }
                    let mut c_side = None;
                    if route {
                        let c_row = in_row(contact, kind);
                        let mut reply = false;
                        if c_row.3 == Fx::Ack {
                            // The answer reaches the user's item through its own A.3 row.
                            let back = in_row(u_new, Subscribed);
                            u_new = back.0;
                            u_push |= back.2;
                            reply = back.1;
                        }
                        steps.extend(arrival_steps(Party::Contact, kind, c_row, reply));
                        c_side = Some(SideChange {
                            old: contact,
                            new: c_row.0,
                            push: c_row.2,
                            keep_request: c_row.0.pending_in && kind == Subscribe,
                        });
                    }
                    if u_fx == Fx::Pres {
                        steps.push(Step::CurrentPresence {
                            subject: Party::User,
                        });
                    }
                    let want = Planned {
                        user: SideChange {
                            old: user,
                            new: u_new,
                            push: u_push,
                            keep_request: false,
                        },
                        contact: c_side,
                        steps,
                    };
                    assert_eq!(
                        got,
                        want,
                        "{kind:?} from {} to {}",
                        label(user),
                        label(contact)
                    );
                }
            }
        }
    }

    #[test]
    fn plan_to_a_local_address_without_account_moves_only_the_users_item() {
        for (old, kind, new, _, push, _) in OUTBOUND {
            let got = plan(change(Direction::Out, kind, old, ContactSide::Absent));
            let want = user_only(old, new, push, Vec::new());
            assert_eq!(got, want, "out {kind:?} in {}", label(old));
        }
    }

    #[test]
    fn plan_of_a_removal_pushes_nothing_of_the_user_and_bounces_nothing() {
        for s in ALL_STATES {
            for kind in roster_remove(s) {
                for contact in [
                    ContactSide::Remote,
                    ContactSide::Local(N),
                    ContactSide::Absent,
                ] {
                    let mut c = change(Direction::Out, kind, s, contact);
                    let plain = plan(c);
                    c.removal = true;
                    let got = plan(c);
                    assert!(!got.user.push, "{kind:?} in {}", label(s));
                    assert_eq!(got.user.new, plain.user.new);
                    assert_eq!(got.contact, plain.contact);
                    let no_bounce: Vec<Step> = plain
                        .steps
                        .iter()
                        .map(|st| match *st {
                            Step::Send {
                                from,
                                kind,
                                original,
                                ..
                            } => Step::Send {
                                from,
                                kind,
                                original,
                                bounce: false,
                            },
                            other => other,
                        })
                        .collect();
                    assert_eq!(got.steps, no_bounce, "{kind:?} in {}", label(s));
                }
            }
        }
    }

    mod model {
        //! Three local users exchanging subscription stanzas through one server, with every
        //! stanza delivered at once; the two rosters of each pair must stay consistent.
        use super::super::*;
        use proptest::prelude::*;
        use std::collections::HashMap;

        const USERS: u8 = 3;

        #[derive(Debug, Clone, Copy)]
        enum Action {
            /// Client of user `.0` sends `.2` to user `.1`.
            Send(u8, u8, SubKind),
            /// User `.0` removes `.1` from the roster.
            Remove(u8, u8),
        }

        #[derive(Default)]
        struct Server {
            rosters: HashMap<(u8, u8), SubState>,
        }

        impl Server {
            fn item(&self, owner: u8, contact: u8) -> SubState {
                self.rosters
                    .get(&(owner, contact))
                    .copied()
                    .unwrap_or_default()
            }

            fn apply(&mut self, action: Action) {
                match action {
                    Action::Send(from, to, kind) => {
                        let out = outbound(self.item(from, to), kind);
                        self.rosters.insert((from, to), out.state);
                        if out.route {
                            self.arrive(from, to, kind);
                        }
                    }
                    Action::Remove(owner, contact) => {
                        let kinds = roster_remove(self.item(owner, contact));
                        self.rosters.remove(&(owner, contact));
                        for kind in kinds {
                            self.arrive(owner, contact, kind);
                        }
                    }
                }
            }

            /// `kind` from `from` reaches `to`'s server; auto-replies travel back the same way.
            fn arrive(&mut self, from: u8, to: u8, kind: SubKind) {
                let r = inbound(self.item(to, from), kind);
                self.rosters.insert((to, from), r.state);
                if let Some(reply) = r.auto_reply {
                    self.arrive(to, from, reply);
                }
            }

            fn check(&self) -> Result<(), TestCaseError> {
                for a in 0..USERS {
                    for b in (0..USERS).filter(|&b| b != a) {
                        let ab = self.item(a, b);
                        let ba = self.item(b, a);
                        prop_assert!(ab.is_defined(), "{a}->{b} undefined: {ab:?}");
                        prop_assert_eq!(
                            ab.user_sees_contact(),
                            ba.contact_sees_user(),
                            "{}->{} is {:?} but {}->{} is {:?}",
                            a,
                            b,
                            ab,
                            b,
                            a,
                            ba
                        );
                        // Every stanza is handled at once, so an unanswered request of a
                        // is exactly one that b is holding.
                        prop_assert_eq!(
                            ab.pending_out,
                            ba.pending_in,
                            "{}->{} is {:?} but {}->{} is {:?}",
                            a,
                            b,
                            ab,
                            b,
                            a,
                            ba
                        );
                    }
                }
                Ok(())
            }
        }

        #[test]
        fn request_and_approval_in_both_directions_end_in_both() {
            let mut s = Server::default();
            s.apply(Action::Send(0, 1, SubKind::Subscribe));
            s.apply(Action::Send(1, 0, SubKind::Subscribed));
            assert_eq!(s.item(0, 1), SubState::new(Subscription::To));
            assert_eq!(s.item(1, 0), SubState::new(Subscription::From));
            s.apply(Action::Send(1, 0, SubKind::Subscribe));
            s.apply(Action::Send(0, 1, SubKind::Subscribed));
            assert_eq!(s.item(0, 1), SubState::new(Subscription::Both));
            assert_eq!(s.item(1, 0), SubState::new(Subscription::Both));
            s.check().map_err(|e| e.to_string()).expect("consistent");
        }

        #[test]
        fn pre_approval_makes_the_later_request_mutual_without_asking() {
            let mut s = Server::default();
            s.apply(Action::Send(1, 0, SubKind::Subscribed));
            assert!(s.item(1, 0).preapproved);
            s.apply(Action::Send(0, 1, SubKind::Subscribe));
            assert_eq!(s.item(0, 1), SubState::new(Subscription::To));
            assert_eq!(s.item(1, 0), SubState::new(Subscription::From));
        }

        #[test]
        fn removing_an_item_tears_down_both_directions_on_the_other_side() {
            let mut s = Server::default();
            for (a, b) in [(0, 1), (1, 0)] {
                s.apply(Action::Send(a, b, SubKind::Subscribe));
                s.apply(Action::Send(b, a, SubKind::Subscribed));
            }
            s.apply(Action::Remove(0, 1));
            assert_eq!(s.item(1, 0), SubState::NONE);
        }

        fn kind() -> impl Strategy<Value = SubKind> {
            prop::sample::select(SubKind::ALL.to_vec())
        }

        fn action() -> impl Strategy<Value = Action> {
            let pair = (0..USERS, 1..USERS).prop_map(|(a, d)| (a, (a + d) % USERS));
            prop_oneof![
                4 => (pair.clone(), kind()).prop_map(|((a, b), k)| Action::Send(a, b, k)),
                1 => pair.prop_map(|(a, b)| Action::Remove(a, b)),
            ]
        }

        proptest! {
            #[test]
            fn both_rosters_of_every_pair_agree_after_each_step(
                actions in prop::collection::vec(action(), 1..60)
            ) {
                let mut server = Server::default();
                for action in actions {
                    server.apply(action);
                    server.check()?;
                }
            }
        }
    }
}
