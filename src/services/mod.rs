//! The services of one node, each a struct holding its own dependencies, built once by the
//! composition root ([`crate::app::server::start`]) and lent by the c2s session task to the
//! router, which hands each handler the service it uses and the
//! [`crate::node::session::Client`] it acts for. A handler's signature therefore says
//! what it depends on, instead of reaching into the node state: [`Services::new`] gives
//! each service the parts of the node it uses (the store, the session registry, the
//! outbox, ...), never the node state itself. The other services ask presence (the
//! privacy gate) through its methods, and delivery works on the parts presence holds;
//! the router, which routes anywhere, still reads the node state for the rest
//! ([`Services::node`]). `tests/layers.rs` keeps every service but this module off
//! `node::Shared`.

pub mod account_deletion;
pub mod blocking;
pub(crate) mod carbons;
pub(crate) mod csi;
pub(crate) mod interest;
pub(crate) mod invisible;
pub mod lifecycle;
pub(crate) mod offline;
pub(crate) mod pep;
pub mod presence;
pub(crate) mod privacy_iq;
pub(crate) mod roster;

use std::sync::Arc;

use crate::node::Shared;
use crate::services::account_deletion::AccountDeletion;
use crate::services::blocking::Blocking;
use crate::services::lifecycle::last_seen::LastSeen;
use crate::services::lifecycle::{Lifecycle, LifecycleSettings};
use crate::services::pep::Pep;
use crate::services::presence::Presence;
use crate::services::privacy_iq::Privacy;
use crate::services::roster::Roster;

/// The node's services.
pub struct Services {
    /// Presence, as the other services ask it (RFC 6121 §3–§4, the privacy gate).
    pub presence: Arc<Presence>,
    /// RFC 6121 §2 roster management.
    pub roster: Roster,
    /// XEP-0191 block lists.
    pub blocking: Blocking,
    /// XEP-0012 last activity.
    pub last_seen: LastSeen,
    /// The visibility settings iq (who sees the user online, and last seen).
    pub privacy: Privacy,
    /// XEP-0163 personal eventing and the XEP-0054 vCards built on it.
    pub pep: Pep,
    /// The tasks around a session's life: liveness, the sweeper, a session's end.
    pub lifecycle: Arc<Lifecycle>,
    /// The one deletion of an account (XEP-0077 `<remove/>`, the admin socket).
    pub account_deletion: Arc<AccountDeletion>,
    /// The node state the router reads besides the services and delivery (which works on
    /// `presence`): the sender's block list, the metrics, the limits and the
    /// configuration (RFC 6120 §10).
    pub node: Arc<Shared>,
}

impl Services {
    /// Builds every service from the parts of the node state it uses.
    pub fn new(node: &Arc<Shared>) -> Self {
        let presence = Arc::new(Presence {
            store: node.store.clone(),
            sessions: node.sessions.clone(),
            outbox: node.outbox.clone(),
            liveness: node.liveness.clone(),
            cluster: node.cluster.clone(),
            subject_locks: node.subject_locks.clone(),
            roster_locks: node.roster_locks.clone(),
            s2s: node.s2s.clone(),
            caps: node.caps.clone(),
            domains: node.config.domains.clone(),
        });
        Services {
            roster: Roster::new(
                node.store.clone(),
                node.sessions.clone(),
                node.live.clone(),
                node.roster_locks.clone(),
                presence.clone(),
            ),
            blocking: Blocking::new(
                node.store.clone(),
                node.sessions.clone(),
                node.cluster.clone(),
                presence.clone(),
            ),
            last_seen: LastSeen::new(node.liveness.clone(), node.store.clone(), presence.clone()),
            privacy: Privacy::new(node.store.clone(), node.live.clone(), presence.clone()),
            pep: Pep::new(
                node.store.clone(),
                node.sessions.clone(),
                node.outbox.clone(),
                node.cluster.clone(),
                node.caps.clone(),
                node.avatar_hashes.clone(),
                presence.clone(),
                crate::services::pep::PepLimits {
                    max_pep_items: node.config.limits.max_pep_items,
                    max_pep_item_size: node.config.limits.max_pep_item_size,
                    max_vcard_size: node.config.limits.max_vcard_size,
                },
            ),
            lifecycle: Arc::new(Lifecycle::new(
                node.liveness.clone(),
                node.cluster.clone(),
                node.sessions.clone(),
                node.store.clone(),
                presence.clone(),
                node.shutdown.clone(),
                LifecycleSettings {
                    sweeper: node.config.liveness.sweeper,
                    metrics_log_interval: node.config.liveness.metrics_log_interval,
                    reconnect_max: node.config.redis.reconnect_max,
                },
            )),
            account_deletion: Arc::new(AccountDeletion::new(
                node.store.clone(),
                node.sessions.clone(),
                node.subject_locks.clone(),
                node.outbox.clone(),
                node.s2s.clone(),
                presence.clone(),
                node.config.domains.clone(),
                node.config.auth.allow_registration,
            )),
            presence,
            node: node.clone(),
        }
    }
}
