//! The state of one node, shared by every task: the composition root's *type*. Its fields
//! are types of the layers below (store, sessions, liveness, federation state, metrics),
//! so every transport can hold it without importing the server that builds it
//! ([`crate::app::server::start`]) or the transports that run on it. The parts a service
//! holds are behind `Arc`s (or cheap clones), so the composition root builds each
//! service from the parts it uses rather than from the whole state.

pub(crate) mod caps;
pub mod federation;
pub mod io;
pub mod live;
pub mod mailbox;
pub(crate) mod names;
pub mod outbox;
pub(crate) mod revealed;
pub mod session;
pub mod sessions;
pub(crate) mod stream_management;
pub mod visibility;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::config::CheckedConfig;
use crate::node::sessions::Sessions;
use crate::store::Store;

/// State shared by every task of the server.
pub struct Shared {
    /// The checked configuration, as the server started with it.
    pub config: CheckedConfig,
    /// What a reload changes: `[limits]` and the `[s2s]` routes and policies. Read these
    /// from here, never from `config`.
    pub live: Arc<live::Live>,
    /// PostgreSQL.
    pub store: Store,
    /// Sessions connected to this node (shared with the services that reach them).
    pub sessions: Arc<Sessions>,
    /// TLS for STARTTLS and direct TLS.
    pub tls: Arc<rustls::ServerConfig>,
    /// TLS of the s2s listeners: like `tls`, and asks for the peer's certificate
    /// (SASL EXTERNAL, XEP-0178).
    pub s2s_tls: Arc<rustls::ServerConfig>,
    /// Cancelled on shutdown; every session's token is a child.
    pub shutdown: CancellationToken,
    /// The tasks shutdown waits for: every listener's accept loop and every connection's
    /// task, so a session's end (its unavailable presence, its last seen) is not cut off.
    pub tasks: tokio_util::task::TaskTracker,
    /// The other nodes on the same database and Redis prefix: the session directory and
    /// this node's channel.
    pub cluster: crate::cluster::Cluster,
    /// Heartbeats, Redis liveness keys, the sweeper, grace periods, last seen, counters.
    pub liveness: Arc<crate::liveness::Liveness>,
    /// Serialises "write a roster change, then push it" per user against
    /// the roster NOTIFY listener, so a NOTIFY never overtakes the push this node is about to
    /// send (which would push twice and send presence for a change already handled).
    pub roster_locks: Arc<RosterLocks>,
    /// The per-subject presence locks (each session's own state is behind its handle).
    pub subject_locks: Arc<visibility::SubjectLocks>,
    /// Federation: outgoing links, dialback secret, remote presence state.
    pub s2s: Arc<federation::S2s>,
    /// Where stanzas leave for a session, another node or another domain (built from
    /// `sessions`, `cluster`, `s2s` and `config`).
    pub outbox: Arc<outbox::Outbox>,
    /// The Prometheus registry behind `/metrics` and the counters fed into it (shared with
    /// the router, which counts routed and refused stanzas).
    pub metrics: Arc<crate::metrics::Metrics>,
    /// Failed SASL password checks per account, across this node's streams.
    pub auth_backoff: crate::policy::auth_backoff::AuthBackoff,
    /// Key of the fake SCRAM salts of unknown users; kept in the store so the salts are
    /// the same after a restart and on every node, as a real account's are.
    pub fake_salt_secret: Vec<u8>,
    /// Key XEP-0484 FAST tokens are derived with (`[auth] fast_secret`, else one kept in
    /// the store): the same on every node, so a token works on each.
    pub fast_secret: Vec<u8>,
    /// Key of the stable XEP-0386 resources (kept in the store): the same on every node, so
    /// an installation that reconnects to another node binds the resource it had.
    pub resource_secret: Vec<u8>,
    /// XEP-0198 sessions of this node a new stream may resume, by resume id.
    pub resumable: crate::node::stream_management::Resumable,
    /// XEP-0115 capabilities of clients on this node (which PEP nodes each wants).
    pub caps: Arc<crate::node::caps::CapsCache>,
    /// XEP-0153 avatar hashes by bare JID, so an available presence costs no store read.
    pub avatar_hashes: Arc<crate::cluster::cache::Cache<Option<String>>>,
    /// XEP-0077 registrations left this hour, per source address and for this node.
    pub registrations: crate::policy::rate_limit::SourceBudget,
}

/// Striped async locks keyed by bare JID: bounded memory, no cleanup, and two users' locks
/// are always taken in stripe order so two changes between the same pair cannot deadlock.
pub struct RosterLocks {
    stripes: Vec<tokio::sync::Mutex<()>>,
}

impl Default for RosterLocks {
    fn default() -> Self {
        RosterLocks {
            stripes: (0..256).map(|_| tokio::sync::Mutex::new(())).collect(),
        }
    }
}

impl RosterLocks {
    fn index(&self, bare: &str) -> usize {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        (BuildHasherDefault::<DefaultHasher>::default().hash_one(bare) as usize)
            % self.stripes.len()
    }

    /// Locks the stripes of the given users (one or two), in order.
    pub async fn lock(&self, users: &[&str]) -> Vec<tokio::sync::MutexGuard<'_, ()>> {
        let mut idx: Vec<usize> = users.iter().map(|u| self.index(u)).collect();
        idx.sort_unstable();
        idx.dedup();
        let mut guards = Vec::with_capacity(idx.len());
        for i in idx {
            guards.push(self.stripes[i].lock().await);
        }
        guards
    }
}
