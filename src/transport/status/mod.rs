//! The operators' status page on the `[admin]` listener: `GET /status` is one HTML page
//! (its script and styles are in the binary, nothing is fetched from elsewhere) that polls
//! `GET /status.json` every `[admin] status_poll` and draws small live charts: online users
//! and sessions by transport, logins and messages per second (differences of the counters
//! between two polls), federation links, and whether Redis and the database answer.
//!
//! The page shows no figure finer than `/metrics` does: sessions and users are counted only
//! when visible (XEP-0186 invisible sessions never, [`crate::node::sessions::Sessions::visible_counts`]),
//! and no JID appears. Per-user detail is for the admin socket (`presenced session list`),
//! which only the server's own user can open.

use std::time::Duration;

use serde::Serialize;

use crate::node::sessions::VisibleCounts;
use crate::node::Shared;

/// The page, with its script and styles inline.
pub(crate) const PAGE: &str = include_str!("page.html");

/// Longest wait for the database's answer to the health query.
const DB_PING_TIMEOUT: Duration = Duration::from_secs(2);

/// What `/status.json` answers.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Snapshot {
    /// This node's id (`[cluster] node_id`).
    pub node: String,
    /// Server version.
    pub version: &'static str,
    /// When the snapshot was taken, milliseconds since the Unix epoch.
    pub time_ms: i64,
    /// How often the page polls, in milliseconds.
    pub poll_ms: u64,
    /// Visible users and sessions on this node, by transport.
    pub online: VisibleCounts,
    /// Sessions bound since start, by transport (the page charts their rate).
    pub logins_total: Transports,
    /// Failed SASL attempts since start.
    pub auth_failures_total: u64,
    /// Messages taken for routing since start (deliveries; the page charts their rate).
    pub messages_routed_total: u64,
    /// Federation.
    pub s2s: S2s,
    /// Liveness store.
    pub redis: Health,
    /// Durable store.
    pub database: Health,
}

/// A counter per transport.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Transports {
    /// TCP (STARTTLS and direct TLS).
    pub tcp: u64,
    /// WebSocket (RFC 7395).
    pub websocket: u64,
}

/// Federation figures.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct S2s {
    /// Live outgoing links (one per local/remote domain pair).
    pub outgoing_links: usize,
    /// Streams authenticated since start, both directions, both methods.
    pub authenticated_total: u64,
}

/// Whether a store answers.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Health {
    /// `redis`, `in-process`, `postgresql` or `sqlite`.
    pub kind: &'static str,
    /// Where it is (`host:port/db`, a file), never a password.
    pub target: String,
    /// Whether the last command (Redis) or a query made now (database) succeeded; always
    /// true for in-process liveness, which has nothing to lose.
    pub up: bool,
    /// How long the health query took, in milliseconds (database only).
    pub latency_ms: Option<f64>,
    /// Why it is down.
    pub error: Option<String>,
}

/// Reads the figures now; the database is asked once, bounded by [`DB_PING_TIMEOUT`].
pub(crate) async fn snapshot(shared: &Shared) -> Snapshot {
    let (tcp, websocket) = shared.metrics.logins();
    let auth = shared.s2s.auth_counts();
    let redis = match shared.liveness.redis() {
        Some(link) => Health {
            kind: "redis",
            target: link.describe().to_owned(),
            up: link.is_up(),
            latency_ms: None,
            error: (!link.is_up())
                .then(|| "not answering (the last command failed, or none succeeded yet)".into()),
        },
        None => Health {
            kind: "in-process",
            target: "this process".into(),
            up: true,
            latency_ms: None,
            error: None,
        },
    };
    let kind = match shared.store.dialect() {
        crate::store::Dialect::Postgres => "postgresql",
        crate::store::Dialect::Sqlite => "sqlite",
    };
    let target = crate::store::database_target(&shared.config.database.url);
    let database = match tokio::time::timeout(DB_PING_TIMEOUT, shared.store.ping()).await {
        Ok(Ok(took)) => Health {
            kind,
            target,
            up: true,
            latency_ms: Some(took.as_secs_f64() * 1000.0),
            error: None,
        },
        Ok(Err(e)) => Health {
            kind,
            target,
            up: false,
            latency_ms: None,
            error: Some(e.to_string()),
        },
        Err(_) => Health {
            kind,
            target,
            up: false,
            latency_ms: None,
            error: Some(format!("no answer within {} s", DB_PING_TIMEOUT.as_secs())),
        },
    };
    Snapshot {
        node: shared.config.cluster.node().to_owned(),
        version: env!("CARGO_PKG_VERSION"),
        time_ms: chrono::Utc::now().timestamp_millis(),
        poll_ms: u64::try_from(shared.config.admin.status_poll.as_millis()).unwrap_or(2000),
        online: shared.sessions.visible_counts(),
        logins_total: Transports { tcp, websocket },
        auth_failures_total: shared.metrics.auth_failures_total(),
        messages_routed_total: shared.metrics.messages_routed_total(),
        s2s: S2s {
            outgoing_links: shared.s2s.outgoing_links(),
            authenticated_total: auth.external_in
                + auth.external_out
                + auth.dialback_in
                + auth.dialback_out,
        },
        redis,
        database,
    }
}

#[cfg(test)]
mod tests {
    use super::PAGE;

    #[test]
    fn the_page_fetches_nothing_from_elsewhere() {
        assert!(PAGE.contains("status.json"));
        for outside in ["http://", "https://", "//cdn", "<link", "src="] {
            assert!(!PAGE.contains(outside), "the page names {outside}");
        }
    }
}
