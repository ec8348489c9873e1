//! presenced: a federated XMPP server whose centre is presence.
//!
//! # Layout
//!
//! ```text
//! socket ─▶ tls (rustls) ─▶ xml::reader (quick-xml, incremental, bounded)
//!        ─▶ c2s negotiation (STARTTLS → SASL → bind) ─▶ stanza checks
//!        ─▶ router ─┬▶ local handlers (roster, presence, disco, ping)
//!                   └▶ delivery (blocks, privacy gate) ─▶ sessions (bounded mpsc to the
//!                      task that owns the socket)
//! ```
//!
//! Stanzas from other servers, the liveness sweeper's announcements and the presence
//! consequences of roster changes made in SQL reach sessions through the same `delivery`
//! module.
//!
//! Pure decision code (the RFC 6121 subscription table in [`policy::subscription`],
//! SCRAM in [`sasl::scram`]) is kept apart from I/O so it can be tested on tables.

//! Modules are `pub(crate)` unless `main.rs`, the integration tests, the benchmark generator
//! or the fuzz crate name them, so that rustc reports code nothing calls.

// First: the macro it declares is used by the modules below.
#[macro_use]
mod wire;

pub mod account_deletion;
pub mod admin;
pub mod blocking;
pub mod c2s;
pub(crate) mod caps;
pub(crate) mod carbons;
pub mod cluster;
pub(crate) mod conditions;
pub mod config;
pub mod control;
pub(crate) mod csi;
pub(crate) mod delivery;
pub(crate) mod error;
pub(crate) mod http;
pub(crate) mod interest;
pub(crate) mod invisible;
pub mod jid;
pub mod liveness;
pub mod liveness_tasks;
pub mod logging;
pub(crate) mod metrics;
pub(crate) mod names;
pub(crate) mod node;
pub(crate) mod offline;
pub(crate) mod pep;
pub(crate) mod policy;
pub mod presence;
pub(crate) mod privacy_iq;
pub(crate) mod pubsub;
pub(crate) mod rate_limit;
pub mod redis_conn;
pub(crate) mod roster;
pub(crate) mod roster_push;
pub(crate) mod roster_sync;
pub(crate) mod router;
pub mod s2s;
pub mod sasl;
pub mod server;
pub mod services;
pub mod sessions;
pub(crate) mod stanza;
pub(crate) mod status;
pub mod store;
pub(crate) mod stream;
pub(crate) mod stream_management;
pub mod tls;
pub(crate) mod websocket;
pub mod xml;
