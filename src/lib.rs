//! presenced: a federated XMPP server whose centre is presence.
//!
//! The crate is folders by layer; each imports only the layers below it (the ranks are
//! checked by `tests/layers.rs`; ARCHITECTURE.md draws them and the path of a stanza):
//!
//! ```text
//! app/        the composition root and the operator's side: server start and stop,
//!             signals and reload, check-config, the admin socket, logging
//! transport/  bytes to stanzas and back: the one listener, TLS, the XML stream, c2s, s2s,
//!             HTTP and WebSocket, the status page
//! routing/    where a stanza goes: the client stanza router, delivery to a local user
//! services/   what the server does with stanzas: presence, roster, PEP, blocking,
//!             privacy lists, carbons, offline messages, CSI, the session lifecycle
//! node/       the state of one node: session registry, the outbox, locks, federation
//!             queues, stream-management sessions, live settings
//! liveness/   heartbeats, Redis liveness keys, the clock, last-seen batching
//! cluster/    the other nodes: session directory, node channels, the Redis connection
//! store/      PostgreSQL or SQLite: accounts, rosters, lists, offline messages, PEP
//! policy/     pure decisions: the RFC 6121 subscription tables, the privacy rule, rates
//! config      the configuration file and its checks
//! metrics     the Prometheus registry
//! clock       wall time and instants for everything time-dependent; tests pause it
//! protocol/   XMPP itself: JIDs, XML, stanzas, conditions and errors, SASL
//! ```
//!
//! Modules are `pub(crate)` unless `main.rs`, the integration tests, the benchmark generator
//! or the fuzz crate name them, so that rustc reports code nothing calls; `unreachable_pub`
//! keeps an item of a crate-private module from claiming more.
#![deny(unreachable_pub)]

// First: the macro its `wire` module declares is used by the modules below.
#[macro_use]
pub mod protocol;

pub mod app;
pub mod clock;
pub mod cluster;
pub mod config;
pub mod liveness;
pub(crate) mod metrics;
pub mod node;
pub(crate) mod policy;
pub(crate) mod routing;
pub mod services;
pub mod store;
pub mod transport;
