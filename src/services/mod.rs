//! The services of one node, each a struct holding its own dependencies, built once by the
//! composition root ([`crate::app::server::start`]) and lent by the c2s session task to the
//! router, which hands each handler the service it uses and the
//! [`crate::node::session::Client`] it acts for. A handler's signature therefore says
//! what it depends on, instead of reaching into the node state: the composition root gives
//! each service the parts of the node it uses (the store, the session registry, the
//! outbox, ...), never the node state itself. The other services ask presence (the
//! privacy gate) through its methods, delivery works on the parts presence holds, and
//! the router reads the rest from [`RouterParts`]. `tests/layers.rs` keeps every service
//! off `node::Shared`.

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
pub mod push;
pub(crate) mod roster;

use std::sync::Arc;

use crate::services::account_deletion::AccountDeletion;
use crate::services::blocking::Blocking;
use crate::services::lifecycle::last_seen::LastSeen;
use crate::services::lifecycle::Lifecycle;
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
    /// XEP-0357 push notifications (the same service presence holds for delivery).
    pub push: Arc<crate::services::push::Push>,
    /// What the router reads besides the services and delivery (which works on
    /// `presence`).
    pub routing: RouterParts,
}

/// What the router reads that no service lends it: the counters of routed and refused
/// stanzas, the limits a reload changes, and whether in-band registration is offered
/// (the server's disco#info).
pub struct RouterParts {
    /// The node's counters (`/metrics`).
    pub metrics: Arc<crate::metrics::Metrics>,
    /// `[limits]`, as last reloaded.
    pub live: Arc<crate::node::live::Live>,
    /// `[auth] allow_registration`.
    pub allow_registration: bool,
}
