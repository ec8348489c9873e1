//! Start, the listeners and shutdown.
//!
//! Shaped like mini-redis: a listener accepts ([`crate::transport::listener::Listener`]), each
//! connection gets one task (here [`crate::transport::c2s::serve`]), and a [`CancellationToken`] plus
//! a [`TaskTracker`] (`Shared::tasks`) end them all on shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::CheckedConfig;
use crate::node::io::BoxIo;
use crate::node::sessions::Sessions;
pub use crate::node::{RosterLocks, Shared};
use crate::protocol::error::{StreamCondition, StreamError};
use crate::store::Store;
use crate::transport::c2s;
use crate::transport::listener::{Answer, Handler, Listener};
pub use crate::transport::listener::{ListenerPolicy, Refusal, StartError};

/// A started server: its bound addresses and a handle to stop it.
pub struct Running {
    /// Address of the STARTTLS listener, if enabled.
    pub c2s_addr: Option<SocketAddr>,
    /// Address of the direct TLS listener, if enabled.
    pub direct_tls_addr: Option<SocketAddr>,
    /// Address of the HTTP(S) listener (WebSocket, host-meta), if enabled.
    pub http_addr: Option<SocketAddr>,
    /// Address of the operators' listener (`/metrics`), if enabled.
    pub admin_addr: Option<SocketAddr>,
    /// Addresses of the s2s listeners, if federation is enabled.
    pub s2s: crate::transport::s2s::inbound::Listening,
    /// Shared state (tests inspect sessions through it).
    pub shared: Arc<Shared>,
    /// The services the c2s sessions are lent.
    pub services: Arc<crate::services::Services>,
    /// The certificate every listener presents; a reload replaces it.
    pub certificates: Arc<crate::transport::tls::Certificates>,
    /// The client listeners' session ticketer; a reload takes new ticket settings.
    pub tickets: Arc<crate::transport::tls::tickets::Tickets>,
    tracker: TaskTracker,
}

impl Running {
    /// Stops accepting, closes every session with `system-shutdown` and waits for the tasks.
    pub async fn shutdown(self) {
        self.shared.sessions.close_all(StreamError::new(
            StreamCondition::SystemShutdown,
            "the server is shutting down",
        ));
        tokio::time::sleep(Duration::from_millis(100)).await;
        self.shared.shutdown.cancel();
        self.tracker.close();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.tracker.wait()).await;
    }
}

/// The store, migrated and set up with the config's limits and defaults.
async fn open_store(config: &CheckedConfig) -> Result<Store, StartError> {
    let store = Store::open(&config.database).await?;
    store.migrate(&config.database.migrations).await?;
    store.set_audience_cache_ttl(config.database.gate_cache_secs);
    store.set_limits(crate::store::StoreLimits::from_config(&config.limits));
    store.set_privacy_defaults(&config.privacy);
    Ok(store)
}

/// The keys logins derive from, the same on every node and after a restart (kept in the
/// store, created by the first node that asks): unknown users' fake SCRAM salts, XEP-0484
/// FAST tokens (`[auth] fast_secret` when set) and stable XEP-0386 resources.
async fn login_secrets(
    config: &CheckedConfig,
    store: &Store,
) -> Result<[Vec<u8>; 3], crate::store::StoreError> {
    let fast = match &config.auth.fast_secret {
        Some(s) => s.as_bytes().to_vec(),
        None => store.server_secret("fast_tokens").await?,
    };
    Ok([
        store.server_secret("scram_fake_salt").await?,
        fast,
        store.server_secret("bind2_resources").await?,
    ])
}

/// Connects the stores, applies migrations, binds the listeners and starts accepting.
pub async fn start(config: CheckedConfig) -> Result<Running, StartError> {
    let store = open_store(&config).await?;
    let liveness = Arc::new(crate::liveness::Liveness::new(&config));
    let certificates = crate::transport::tls::Certificates::load(&config)?;
    let tickets = Arc::new(crate::transport::tls::tickets::Tickets::new(
        &config.tls,
        store.server_secret("tls_session_tickets").await?,
        liveness.clock,
    ));
    let tls = crate::transport::tls::c2s_server_config(&certificates, Some(tickets.clone()))
        .map_err(crate::transport::tls::TlsError::from)?;
    let s2s_tls = crate::transport::tls::s2s_server_config_with(&certificates)
        .map_err(crate::transport::tls::TlsError::from)?;
    store.set_clock(liveness.clock);
    let cluster = crate::cluster::Cluster::new(&config, liveness.clock);
    let s2s = Arc::new(crate::transport::s2s::new_state(
        &config,
        crate::transport::tls::identity(&config)?,
    ));
    let [fake_salt_secret, fast_secret, resource_secret] = login_secrets(&config, &store).await?;
    let auth_backoff = crate::policy::auth_backoff::AuthBackoff::new(
        crate::policy::auth_backoff::BackoffPolicy::from_config(&config.limits),
    );
    let sessions = Arc::new(Sessions::new(
        crate::node::sessions::StateLimits {
            max_directed: config.limits.max_directed_presences,
            max_revealed: config.limits.max_revealed_per_session,
        },
        liveness.clock,
    ));
    let caps = Arc::new(crate::node::caps::CapsCache::new(
        config.limits.max_caps_entries,
        config.limits.max_caps_queries_per_session,
        config.limits.caps_query_timeout,
        liveness.clock,
    ));
    let avatar_hashes = Arc::new(crate::cluster::cache::Cache::new(
        config.limits.max_avatar_hash_entries,
        config.limits.avatar_hash_ttl,
    ));
    let registrations = crate::policy::rate_limit::SourceBudget::per_hour(
        config.auth.registrations_per_ip_per_hour,
        config.auth.registrations_per_hour,
    );
    let outbox = Arc::new(crate::node::outbox::Outbox::new(
        sessions.clone(),
        cluster.clone(),
        s2s.clone(),
        Arc::new(config.clone()),
    ));
    let shared = Arc::new(Shared {
        outbox,
        caps,
        avatar_hashes,
        registrations,
        live: Arc::new(crate::node::live::Live::new(&config)),
        config,
        store,
        sessions,
        tls,
        s2s_tls,
        shutdown: CancellationToken::new(),
        tasks: TaskTracker::new(),
        cluster,
        liveness,
        roster_locks: Default::default(),
        subject_locks: Default::default(),
        s2s,
        metrics: Arc::new(crate::metrics::Metrics::new()),
        auth_backoff,
        fake_salt_secret,
        fast_secret,
        resource_secret,
        resumable: Default::default(),
    });
    crate::transport::s2s::attach(&shared);
    let services = Arc::new(build_services(&shared));
    let (weak, push) = (Arc::downgrade(&shared), Arc::downgrade(&services.push));
    shared.metrics.attach(Box::new(move |encoder| {
        match (weak.upgrade(), push.upgrade()) {
            (Some(shared), Some(push)) => node_figures(&shared, &push, encoder),
            _ => Ok(()),
        }
    }));
    // Block-list and settings changes made anywhere withdraw presence already shown here.
    crate::services::presence::gate::spawn_listener(
        services.presence.clone(),
        &shared.config.database,
        shared.shutdown.clone(),
    )
    .await?;
    let tracker = shared.tasks.clone();
    // Know the other nodes before the first client binds (what arrives on this node's
    // channel is received with the liveness tasks).
    shared.cluster.heartbeat(false).await;
    shared.cluster.start(&tracker, shared.shutdown.clone());
    spawn_tasks(&shared, &services, &tracker);
    // One admission policy for every client-facing listener (s2s has its own limits).
    let limits = Arc::new(ListenerPolicy::new(&shared.config));
    let http_addr = crate::transport::http::start(&shared, &services, limits.clone()).await?;
    let admin_addr = crate::transport::http::start_admin(&shared).await?;
    let s2s = crate::transport::s2s::inbound::listen(&shared, &services.presence).await?;
    let (c2s_addr, direct_tls_addr) = c2s_listeners(&shared, &services, &limits).await?;
    banner(&shared);
    Ok(Running {
        c2s_addr,
        direct_tls_addr,
        http_addr,
        admin_addr,
        s2s,
        shared,
        services,
        certificates,
        tickets,
        tracker,
    })
}

/// Builds every service from the parts of the node state it uses (the services never see
/// the node state itself).
fn build_services(node: &Arc<Shared>) -> crate::services::Services {
    use crate::services::account_deletion::AccountDeletion;
    use crate::services::blocking::Blocking;
    use crate::services::lifecycle::last_seen::LastSeen;
    use crate::services::lifecycle::{Lifecycle, LifecycleSettings};
    use crate::services::pep::Pep;
    use crate::services::presence::Presence;
    use crate::services::privacy_iq::Privacy;
    use crate::services::roster::Roster;
    use crate::services::RouterParts;
    let push = Arc::new(crate::services::push::Push::new(
        node.store.clone(),
        node.outbox.clone(),
        node.sessions.clone(),
        node.liveness.clock,
        node.config.push.clone(),
    ));
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
        push: push.clone(),
    });
    crate::services::Services {
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
            node.live.clone(),
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
            node.config.auth.allow_registration,
        )),
        presence,
        push,
        routing: RouterParts {
            metrics: node.metrics.clone(),
            live: node.live.clone(),
            allow_registration: node.config.auth.allow_registration,
        },
    }
}

/// The node's background tasks, each given the parts of the node it uses: the roster
/// sync, the lifecycle tasks and the receiver of this node's cluster channel.
fn spawn_tasks(
    shared: &Arc<Shared>,
    services: &Arc<crate::services::Services>,
    tracker: &TaskTracker,
) {
    tracker.spawn(crate::services::roster::sync::run(
        shared.config.database.clone(),
        shared.store.clone(),
        shared.sessions.clone(),
        services.presence.clone(),
        shared.shutdown.clone(),
    ));
    crate::services::lifecycle::start(&services.lifecycle, tracker);
    // Stanzas other nodes of the cluster send this one, handed to the delivery module
    // (the layer above the services, so it is wired here).
    let receiver = services.clone();
    tracker.spawn(crate::cluster::listen(
        shared.cluster.clone(),
        shared.shutdown.clone(),
        shared.config.redis.reconnect_max,
        move |env| crate::routing::delivery::from_node(&receiver.presence, &receiver.pep, env),
    ));
}

/// The c2s listeners (plain with STARTTLS, and direct TLS when configured); their
/// addresses.
async fn c2s_listeners(
    shared: &Arc<Shared>,
    services: &Arc<crate::services::Services>,
    limits: &Arc<ListenerPolicy>,
) -> Result<(Option<SocketAddr>, Option<SocketAddr>), StartError> {
    let bind = shared.config.c2s.bind;
    let mut c2s_addr = None;
    let mut direct_tls_addr = None;
    for (port, direct) in [
        (shared.config.c2s.port, false),
        (shared.config.c2s.direct_tls_port, true),
    ] {
        if direct && !shared.config.c2s.direct_tls {
            continue;
        }
        let addr = SocketAddr::new(bind, port);
        let (listener, local) = crate::transport::listener::bind(addr).await?;
        tracing::info!(addr = %local, direct_tls = direct, "c2s listening");
        if direct {
            direct_tls_addr = Some(local);
        } else {
            c2s_addr = Some(local);
        }
        let c2s = C2s {
            shared: shared.clone(),
            services: services.clone(),
            direct_tls: direct,
        };
        Listener::new("c2s", listener, Some(limits.clone()), shared).spawn(c2s);
    }
    Ok((c2s_addr, direct_tls_addr))
}

/// The figures /metrics reads from the running node at scrape time (a weak reference in
/// the registry: the server owns its metrics, not the other way round).
fn node_figures(
    shared: &Shared,
    push: &crate::services::push::Push,
    encoder: &mut prometheus_client::encoding::DescriptorEncoder,
) -> Result<(), std::fmt::Error> {
    use prometheus_client::encoding::EncodeMetric;
    use prometheus_client::metrics::counter::ConstCounter;
    shared.liveness.metrics.encode(encoder)?;
    // One walk of the registry for every session figure. A hibernated session is detached
    // too; the visible count leaves it out (it shows offline).
    let counts = shared.sessions.visible_counts();
    // Invisible sessions (XEP-0186) are not counted: a count that rises when an invisible
    // user logs in would tell whoever reads it what the user's contacts may not learn.
    crate::metrics::gauge(
        encoder,
        "sessions",
        "Bound client sessions on this node, invisible ones not counted.",
        counts.sessions() as i64,
    )?;
    crate::metrics::gauge(
        encoder,
        "sessions_detached",
        "Sessions whose connection died, kept for their client to resume (XEP-0198).",
        (counts.detached + counts.hibernated) as i64,
    )?;
    crate::metrics::gauge(
        encoder,
        "sessions_hibernated",
        "Of those, hibernated: push enabled, silent for T, shown unavailable (XEP-0357).",
        counts.hibernated as i64,
    )?;
    push.encode(encoder)?;
    let n = shared.s2s.auth_counts();
    let counter = ConstCounter::new(0u64);
    let mut family = encoder.encode_descriptor(
        "s2s_authenticated",
        "Federation streams authenticated, by method and direction.",
        None,
        counter.metric_type(),
    )?;
    for (method, direction, v) in [
        ("external", "in", n.external_in),
        ("external", "out", n.external_out),
        ("dialback", "in", n.dialback_in),
        ("dialback", "out", n.dialback_out),
    ] {
        let labels = [("method", method), ("direction", direction)];
        ConstCounter::new(v).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// The one line that says what started: version, this node's id (`[cluster] node_id`,
/// by default `<host>-<c2s port>`), the stores and the liveness mode, so a log excerpt identifies the server without its configuration.
fn banner(shared: &Shared) {
    let liveness = match shared.liveness.redis() {
        Some(redis) => format!("redis {}", redis.describe()),
        None => shared.liveness.backend.name().to_owned(),
    };
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        node = %shared.config.cluster.node(),
        domains = %shared.config.domains.join(","),
        database = %crate::store::database_target(&shared.config.database.url),
        liveness = %liveness,
        "presenced started"
    );
}

/// The c2s listeners' connections: a client stream each ([`c2s::serve`]).
struct C2s {
    shared: Arc<Shared>,
    services: Arc<crate::services::Services>,
    /// Whether this is the direct TLS port (XEP-0368).
    direct_tls: bool,
}

impl Handler<tokio::net::TcpListener> for C2s {
    fn serve(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
    ) -> impl Future<Output = ()> + Send + 'static {
        let (shared, services) = (self.shared.clone(), self.services.clone());
        let direct_tls = self.direct_tls;
        async move {
            let direct = direct_tls || starts_with_tls(&stream).await;
            c2s::serve(shared, services, Box::new(stream) as BoxIo, peer, direct).await;
        }
    }

    fn refuse(&self, stream: TcpStream, _: SocketAddr, why: Refusal) -> Option<Answer> {
        // RFC 6120 §4.9.3.14 / §4.9.3.17.
        let (condition, text) = match why {
            Refusal::Rate => (
                StreamCondition::PolicyViolation,
                "too many connections from your address",
            ),
            Refusal::Full => (StreamCondition::ResourceConstraint, "the server is full"),
            Refusal::SourceFull => (
                StreamCondition::PolicyViolation,
                "too many connections open from your address",
            ),
        };
        let shared = self.shared.clone();
        Some(Box::pin(refuse(
            stream,
            shared,
            self.direct_tls,
            condition,
            text,
        )))
    }
}

/// Whether a connection to the STARTTLS port opened with a TLS handshake record instead of
/// XML. Clients such as slixmpp try XEP-0368 direct TLS first on whatever port they are
/// given; serving them TLS at once beats letting them wait for the negotiation timeout.
async fn starts_with_tls(stream: &TcpStream) -> bool {
    let mut first = [0u8; 1];
    // 0x16 is a TLS handshake record; XML starts with '<', '\u{feff}' or whitespace.
    matches!(
        tokio::time::timeout(Duration::from_secs(5), stream.peek(&mut first)).await,
        Ok(Ok(1)) if first[0] == 0x16
    )
}

/// Answers a refused connection with a stream error (RFC 6120 §4.9.1.1: header first). On the
/// direct-TLS port there is no plaintext XML to speak, so the connection is just closed.
async fn refuse(
    mut stream: TcpStream,
    shared: Arc<Shared>,
    direct_tls: bool,
    condition: StreamCondition,
    text: &str,
) {
    use tokio::io::AsyncWriteExt;
    if direct_tls {
        return;
    }
    let mut out = crate::protocol::xml::stream_header(
        &shared.config.domains[0],
        None,
        &c2s::new_id(),
        crate::protocol::xml::NS_CLIENT,
    );
    out.push_str(&StreamError::new(condition, text).to_xml());
    out.push_str("</stream:stream>");
    let _ = tokio::time::timeout(Duration::from_secs(2), stream.write_all(out.as_bytes())).await;
}
