//! Deleting an account, the one way every path does it (the admin socket's `user del`,
//! XEP-0077 `<remove/>`; the command line without a server does the store's half through
//! the same [`crate::store::Store::delete_account`] and says what it could not send).
//!
//! Nothing granted to the account passes to a new account of the same name, and its
//! contacts learn of it as if the user had removed every roster item (RFC 6121 §2.5.2;
//! XEP-0077 §3.2 asks a server to cancel the subscriptions in the roster):
//!
//! 1. its sessions here end with the given stream error, and the deletion waits (bounded)
//!    until they are gone, so none writes for the account afterwards;
//! 2. every viewer those sessions were shown to, and every directed-presence recipient,
//!    gets their unavailable at once (§3.2.2: before the unsubscribed), not after the
//!    grace period a closed connection waits;
//! 3. one store transaction deletes the account, its own data (the schema's cascades),
//!    the items for it in every other local roster and the requests it left waiting;
//! 4. each local owner whose item went gets the roster push (`subscription='remove'`,
//!    §2.5.2) and the presence the gate re-decides, through the path of any roster change
//!    made outside a client ([`crate::services::presence::executor::apply_external`]); a local user
//!    a request of the account's was waiting for gets the `unsubscribe` that withdraws it
//!    (§3.1.3, §3.3); this node's sessions forget the account as a directed-presence
//!    recipient or viewer, so a new owner of the name is not told when they go offline;
//! 5. each remote contact gets `unsubscribe` and/or `unsubscribed` as the subscription
//!    table says for removing its item ([`remote_notices`]), so its server drops the
//!    subscription instead of showing the next owner of the name its user's presence.
//!
//! Other nodes of a cluster hear of the roster changes through the store's announcement
//! and push them to their own sessions the same way.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::node::federation::S2s;
use crate::node::outbox::Outbox;
use crate::node::session::Client;
use crate::node::sessions::{SessionHandle, Sessions};
use crate::node::visibility::SubjectLocks;
use crate::policy::subscription::{self, SubKind, SubState};
use crate::protocol::error::{iq_result, StanzaError, StreamCondition, StreamError};
use crate::protocol::jid::{bare_of, BareJid};
use crate::protocol::stanza::IqType;
use crate::protocol::xml::{Element, NS_REGISTER};
use crate::services::presence::Presence;
use crate::store::{RosterItem, Store, StoreError};

/// How long a deletion (or an operator ending sessions) waits for them to end before it
/// goes on anyway.
pub(crate) const SESSIONS_END_WITHIN: Duration = Duration::from_secs(5);

/// What a deletion did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deleted {
    /// Sessions here that were ended.
    pub sessions_ended: usize,
    /// Local users whose roster lost the account.
    pub local_contacts: usize,
    /// Remote contacts sent `unsubscribe`/`unsubscribed`.
    pub remote_contacts: usize,
}

/// The deletion of accounts, with what it reaches: the store, this node's sessions and
/// their presence locks, the outbox, the federation state (what remote servers were
/// shown), presence (the re-decision after a roster change made outside a client) and the
/// node's registration switch (the hosted domains are the outbox's).
pub struct AccountDeletion {
    store: Store,
    sessions: Arc<Sessions>,
    subject_locks: Arc<SubjectLocks>,
    outbox: Arc<Outbox>,
    s2s: Arc<S2s>,
    presence: Arc<Presence>,
    /// `[auth] allow_registration` as the server started with it.
    allow_registration: bool,
}

impl AccountDeletion {
    /// The service over these parts of the node.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        store: Store,
        sessions: Arc<Sessions>,
        subject_locks: Arc<SubjectLocks>,
        outbox: Arc<Outbox>,
        s2s: Arc<S2s>,
        presence: Arc<Presence>,
        allow_registration: bool,
    ) -> Self {
        AccountDeletion {
            store,
            sessions,
            subject_locks,
            outbox,
            s2s,
            presence,
            allow_registration,
        }
    }

    fn serves(&self, domain: &str) -> bool {
        self.outbox.serves(domain)
    }

    /// Deletes local account `account` (see the module documentation), ending its sessions here
    /// with `ended_by`. `None` if there was no such account.
    pub async fn delete(
        &self,
        account: &BareJid,
        ended_by: StreamError,
    ) -> Result<Option<Deleted>, StoreError> {
        let Some(node) = account.node() else {
            return Ok(None);
        };
        let sessions = self.sessions.of_user(account);
        let sessions_ended = self
            .sessions
            .close_and_wait(&sessions, &ended_by, SESSIONS_END_WITHIN)
            .await;
        self.withdraw_presence(account, &sessions).await;
        let deleted = self
            .store
            .delete_account(
                node.as_str(),
                account.domain().as_str(),
                self.outbox.domains(),
            )
            .await?;
        // A session bound while the row was still there (a login racing the deletion) has an
        // account no more.
        for s in self.sessions.of_user(account) {
            s.close(ended_by.clone());
        }
        let Some(deleted) = deleted else {
            return Ok(None);
        };
        tracing::info!(
            %account,
            sessions = sessions_ended,
            local_contacts = deleted.removed_from.len(),
            "account deleted"
        );
        let me = account.as_str();
        // Nothing this node's sessions remember of the old account reaches a new one.
        self.sessions.for_each(|s| {
            s.write(|p| {
                p.retain_directed(|to| bare_of(to) != me);
                for (viewer, _) in p.revealed() {
                    if bare_of(&viewer) == me {
                        p.forget(&viewer);
                    }
                }
            })
        });
        for (owner, version) in &deleted.removed_from {
            self.presence.apply_external(owner, *version).await;
        }
        for owner in &deleted.withdrawn {
            // RFC 6121 §3.1.3 / §3.3: the request the user saw is withdrawn.
            let p = crate::services::presence::presence(
                crate::protocol::stanza::PresenceType::Unsubscribe,
                me,
                owner,
            );
            self.outbox.to_available(owner, &p);
        }
        let notices = remote_notices(&deleted.items, &deleted.waiting, |domain| {
            self.serves(domain)
        });
        for (contact, kinds) in &notices {
            for kind in kinds {
                let p = crate::services::presence::presence(kind.presence_type(), me, contact);
                if let Err(e) = self.outbox.route_remote(p) {
                    tracing::info!(%account, contact, error = ?e, "account deleted: contact's server not told");
                }
            }
            // §3.2.3: whatever the contact's server showed the account is forgotten.
            self.s2s.saw_unavailable(contact, me);
        }
        Ok(Some(Deleted {
            sessions_ended,
            local_contacts: deleted.removed_from.len(),
            remote_contacts: notices.len(),
        }))
    }

    /// XEP-0077 in a bound session, where the account is known from the stream (§3.2: the
    /// request carries no `to` or the server's domain, and is about the session's account).
    /// A `get` says the account is registered (§3.1); a `set` holding only `<remove/>`
    /// deletes it: the result goes first, then the stream ends with `not-authorized` (§3.2)
    /// as every session of the account does, and the deletion ([`Self::delete`]) follows. Without
    /// `[auth] allow_registration` the server offers no in-band registration and says
    /// service-unavailable (§3.1), to this as to a registration. `None`: answered already.
    pub(crate) fn registration_iq(
        self: &Arc<Self>,
        session: &Client,
        iq: &Element,
        ty: IqType,
        query: &Element,
    ) -> Option<Element> {
        let refuse = |e: StanzaError| e.reply_to(iq);
        if !self.allow_registration {
            return refuse(StanzaError::service_unavailable());
        }
        let account = session.jid().to_bare();
        match ty {
            IqType::Get => {
                let user = account
                    .node()
                    .map(|n| n.as_str().to_owned())
                    .unwrap_or_default();
                Some(
                    iq_result(iq).child(
                        Element::new("query", NS_REGISTER)
                            .child(Element::new("registered", NS_REGISTER))
                            .child(Element::new("username", NS_REGISTER).text(user))
                            .child(Element::new("password", NS_REGISTER)),
                    ),
                )
            }
            IqType::Set if query.get_child("remove", NS_REGISTER).is_some() => {
                if query.elements().count() != 1 {
                    // §3.2: <remove/> must be the only child.
                    return refuse(StanzaError::bad_request());
                }
                tracing::info!(peer = %session.peer, %account, "account removal requested in-band");
                session.deliver(iq_result(iq));
                let ended_by = StreamError::new(
                    StreamCondition::NotAuthorized,
                    "the account was removed at its own request",
                );
                // Its own session too: the deletion waits for it to end, so it runs apart
                // from the session's task, which is what will end it.
                let this = self.clone();
                tokio::spawn(async move {
                    if let Err(e) = this.delete(&account, ended_by).await {
                        tracing::error!(%account, error = %e, "in-band account removal failed");
                    }
                });
                None
            }
            // §3.3 password changes and anything else: not offered in a session.
            _ => refuse(StanzaError::feature_not_implemented()),
        }
    }

    /// Step 2: every viewer the ended sessions were shown to, and every directed-presence
    /// recipient, gets their unavailable now, under the account's subject lock like every
    /// presence decision; the sessions keep nothing of it, so their own end, after the grace
    /// period, repeats none of it.
    async fn withdraw_presence(&self, account: &BareJid, sessions: &[SessionHandle]) {
        let _guard = self.subject_locks.lock_subject(account.as_str()).await;
        for s in sessions {
            let from = s.jid.to_string();
            let (revealed, directed) = s.write(|p| (p.take_revealed(), p.take_directed()));
            let mut told = std::collections::HashSet::new();
            for to in revealed.iter().map(|(v, _)| v.to_string()).chain(directed) {
                if told.insert(to.clone()) {
                    let p = crate::node::outbox::unavailable(&from, &to);
                    self.outbox.presence_to(&to, p);
                }
            }
        }
    }
}

/// What each remote contact of an account being deleted is sent, in order: the
/// subscription table's answer for removing its item (RFC 6121 §2.5.2: `unsubscribe` if the
/// user was subscribed or asking, `unsubscribed` if the contact was or asked), a request
/// that was waiting without an item counting as the contact asking. `items` and `waiting`
/// are the account's roster and the senders of its waiting requests; contacts on domains
/// `local` says are served here are left out (their rosters are changed in the store).
pub(crate) fn remote_notices(
    items: &[RosterItem],
    waiting: &[String],
    local: impl Fn(&str) -> bool,
) -> Vec<(String, Vec<SubKind>)> {
    let mut states: BTreeMap<String, SubState> = BTreeMap::new();
    for item in items {
        states.insert(item.contact.to_string(), item.sub_state());
    }
    for sender in waiting {
        states
            .entry(sender.clone())
            .or_insert(SubState::NONE)
            .pending_in = true;
    }
    states
        .into_iter()
        .filter(|(contact, _)| !local(crate::protocol::jid::domain_of(contact)))
        .map(|(contact, state)| (contact, subscription::roster_remove(state)))
        .filter(|(_, kinds)| !kinds.is_empty())
        .collect()
}

/// The remote contacts [`remote_notices`] would send something: whose servers keep a
/// subscription with the account unless told (the command line, which cannot tell them,
/// names them).
pub fn remote_contacts(
    items: &[RosterItem],
    waiting: &[String],
    local: impl Fn(&str) -> bool,
) -> Vec<String> {
    remote_notices(items, waiting, local)
        .into_iter()
        .map(|(contact, _)| contact)
        .collect()
}
