//! Typed TOML configuration. Every limit and timing the server enforces is a field here with
//! a default; `presenced.example.toml` at the top of the repository lists them all.
//!
//! `DATABASE_URL` and `REDIS_URL` in the environment override the file, so CI and containers
//! can point one config at another database without editing it.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The TOML did not parse or had unknown keys.
    #[error("{path}: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: toml::de::Error,
    },
    /// A value is out of range or inconsistent with another.
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The XMPP domains this server hosts (RFC 6120 §2.1). Streams to any other are refused
    /// with host-unknown.
    pub domains: Vec<String>,
    /// Client-to-server listeners.
    pub c2s: C2sConfig,
    /// Certificates.
    pub tls: TlsConfig,
    /// PostgreSQL.
    pub database: DatabaseConfig,
    /// Redis.
    pub redis: RedisConfig,
    /// Authentication and registration.
    pub auth: AuthConfig,
    /// Limits applied to every client.
    pub limits: LimitsConfig,
    /// Heartbeats, TTLs, the sweeper, the grace period and last-seen batching.
    pub liveness: LivenessConfig,
    /// The HTTP(S) listener: RFC 7395 WebSocket, XEP-0156 host-meta.
    pub http: HttpConfig,
    /// Federation with other servers.
    pub s2s: S2sConfig,
    /// What is logged and how.
    pub log: LogConfig,
    /// The operators' side: metrics listener and admin socket.
    pub admin: AdminConfig,
    /// This node's identity among the nodes sharing one database and one Redis key prefix.
    pub cluster: ClusterConfig,
    /// The privacy settings of users who never chose their own.
    pub privacy: PrivacyConfig,
    /// XEP-0357 push notifications for clients that sleep.
    pub push: PushConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            domains: vec!["localhost".into()],
            c2s: C2sConfig::default(),
            tls: TlsConfig::default(),
            database: DatabaseConfig::default(),
            redis: RedisConfig::default(),
            auth: AuthConfig::default(),
            limits: LimitsConfig::default(),
            liveness: LivenessConfig::default(),
            http: HttpConfig::default(),
            s2s: S2sConfig::default(),
            log: LogConfig::default(),
            admin: AdminConfig::default(),
            cluster: ClusterConfig::default(),
            privacy: PrivacyConfig::default(),
            push: PushConfig::default(),
        }
    }
}

/// `[privacy]`: who may see a user's online status and last seen while the user has not
/// chosen (the `urn:presenced:privacy:0` settings); a user's own choice always wins.
/// Reloaded on SIGHUP: presence already shown that the new default withholds is withdrawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrivacyConfig {
    /// Online status (presence broadcasts and probe answers).
    pub online: DefaultVisibility,
    /// Last seen (XEP-0012, the stamp on unavailable presence).
    pub last_seen: DefaultVisibility,
}

/// A default of `[privacy]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DefaultVisibility {
    /// Every approved subscriber (plain RFC 6121).
    #[default]
    Subscribers,
    /// No one but the user.
    Nobody,
}

/// `[push]`: XEP-0357 notifications to the app servers of clients that sleep (see
/// [`crate::services::push`] for when one is sent and what it says).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PushConfig {
    /// Whether clients may enable push at all (the `urn:xmpp:push:0` feature).
    pub enabled: bool,
    /// What a notification's summary form tells the app server, which is a third party.
    pub summary: PushSummary,
    /// How long a push-enabled session whose connection died stays resumable (XEP-0198),
    /// keeping and pushing what arrives for it. After T of silence it shows unavailable to
    /// its contacts meanwhile ("hibernated").
    #[serde(with = "secs")]
    pub hibernation: Duration,
    /// Registrations (app server and node) an account keeps; enabling one more replaces
    /// the oldest.
    pub max_registrations: u32,
    /// Bytes of a registration's publish options (the client's secret form) kept.
    pub max_options_bytes: usize,
    /// Notifications one registration may send at once ...
    pub burst: u32,
    /// ... and per minute after that: a flood of messages wakes a phone a few times, not
    /// once per message.
    pub per_minute: u32,
    /// Error answers in a row from the app server after which the registration is removed
    /// (XEP-0357 §9: the server may stop notifying a node that fails).
    pub max_errors: u32,
}

impl Default for PushConfig {
    fn default() -> Self {
        PushConfig {
            enabled: true,
            summary: PushSummary::Counts,
            hibernation: Duration::from_secs(72 * 3600),
            max_registrations: 8,
            max_options_bytes: 2048,
            burst: 5,
            per_minute: 6,
            max_errors: 3,
        }
    }
}

/// `[push] summary`: the fields of XEP-0357's `urn:xmpp:push:summary` form that are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PushSummary {
    /// No form: the app server learns only that something arrived.
    None,
    /// `message-count` and `pending-subscription-count` only: no sender, no text.
    #[default]
    Counts,
    /// The counts and `last-message-sender`.
    Sender,
    /// The counts, the sender and `last-message-body`.
    Body,
}

/// `[admin]`: what only operators reach.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Serve `/metrics` on `bind:port` (a listener of its own, never a client port).
    pub enabled: bool,
    /// Address of the metrics listener; loopback unless a scraper elsewhere needs it.
    pub bind: IpAddr,
    /// Port of the metrics listener (0: the system picks one, logged at start).
    pub port: u16,
    /// Unix socket of the admin commands (`user list`, `session …`, `stats`), created
    /// with mode 0600; empty: no admin socket.
    #[serde(with = "unset_if_empty")]
    pub socket: Option<PathBuf>,
    /// Token every request for figures (`/metrics`, `/status.json`) must carry, as
    /// `Authorization: Bearer TOKEN` (never in the URL, which logs and browser history
    /// keep); empty: none (loopback only).
    #[serde(with = "unset_if_empty")]
    pub token: Option<String>,
    /// Without a token: the Host names the admin listener answers besides IP addresses,
    /// `localhost` and the served domains. Any other is refused (421), so a web page whose
    /// name is made to point at 127.0.0.1 (DNS rebinding) cannot read the figures.
    pub hosts: Vec<String>,
    /// Connections to the admin listener open at once; more are closed at once.
    pub max_connections: usize,
    /// How often the status page polls `/status.json`, in seconds (fractions allowed).
    #[serde(with = "secs")]
    pub status_poll: Duration,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            enabled: true,
            bind: IpAddr::from([127, 0, 0, 1]),
            port: 5281,
            socket: Some(PathBuf::from("presenced-admin.sock")),
            token: None,
            hosts: Vec::new(),
            max_connections: 64,
            status_poll: Duration::from_secs(2),
        }
    }
}

/// `[cluster]`: nodes that share one PostgreSQL database and one Redis key prefix are one
/// cluster; nothing else is configured. Only the node's name can be chosen here.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// The node's name in Redis (its sessions' directory entries, its pub/sub channel, the
    /// beats it writes). Unset: `<host name>-<c2s port>`, stable across restarts, so a
    /// restarted node takes back what it held. Letters, digits, `.`, `_` and `-`, at most
    /// 64 characters; two running nodes must never share one.
    #[serde(with = "unset_if_empty")]
    pub node_id: Option<String>,
    /// Most recipients one cross-node message may carry; a broadcast to more recipients on
    /// one node is split into several messages.
    pub max_recipients_per_message: usize,
    /// Start nodes of a Redis Cluster (`redis://host:port`, `rediss://` for TLS; any subset of
    /// its nodes, the rest is discovered). Set, they replace `[redis] url` (which must then
    /// be empty): the same keys, scripts and node channels run on the cluster (README,
    /// "Redis Cluster").
    pub redis_nodes: Vec<String>,
    /// Users whose directory rows this node keeps a copy of (0: none, every lookup reads
    /// Redis). Other nodes' writes invalidate a copy through this node's channel.
    pub directory_cache_entries: usize,
    /// Longest a copy is used without reading Redis again: the bound on staleness should
    /// an invalidation be lost (a dropped subscription loses what was published meanwhile).
    #[serde(with = "secs")]
    pub directory_cache_ttl: Duration,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            node_id: None,
            max_recipients_per_message: 1000,
            redis_nodes: Vec::new(),
            directory_cache_entries: 100_000,
            directory_cache_ttl: Duration::from_secs(30),
        }
    }
}

/// `[log]`: the log on standard error.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// tracing filter directives, e.g. `"info"` or `"info,presenced::transport::s2s=debug"`.
    /// `RUST_LOG`, when set, replaces it. Reloaded on SIGHUP.
    pub level: String,
    /// `text` (one human-readable line per event) or `json` (one object per line).
    pub format: LogFormat,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            level: "info".into(),
            format: LogFormat::Text,
        }
    }
}

/// The shape of a log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable.
    Text,
    /// One JSON object per line.
    Json,
}

impl ClusterConfig {
    /// The default node id: the host name and the c2s port. An ephemeral port (0, tests)
    /// gets a random suffix instead, since several such nodes may share a host.
    fn derived_node_id(port: u16) -> String {
        let host = ["/proc/sys/kernel/hostname", "/etc/hostname"]
            .iter()
            .find_map(|p| std::fs::read_to_string(p).ok())
            .map(|h| h.trim().to_owned())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "localhost".to_owned());
        let host: String = host
            .chars()
            .map(|c| if valid_node_char(c) { c } else { '-' })
            .take(48)
            .collect();
        if port == 0 {
            format!("{host}-{:08x}", rand::random::<u32>())
        } else {
            format!("{host}-{port}")
        }
    }

    /// The node id (set by [`Config::check`] when the file leaves it unset).
    pub fn node(&self) -> &str {
        self.node_id.as_deref().unwrap_or("node")
    }
}

fn valid_node_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')
}

/// `[c2s]`: where clients connect.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct C2sConfig {
    /// Address both client listeners bind to.
    pub bind: IpAddr,
    /// STARTTLS port (RFC 6120 §5); 0 lets the system choose (tests).
    pub port: u16,
    /// Whether to listen for direct TLS (XEP-0368).
    pub direct_tls: bool,
    /// Direct TLS port; 0 lets the system choose (tests).
    pub direct_tls_port: u16,
}

impl Default for C2sConfig {
    fn default() -> Self {
        C2sConfig {
            bind: IpAddr::from([0, 0, 0, 0]),
            port: 5222,
            direct_tls: true,
            direct_tls_port: 5223,
        }
    }
}

/// `[tls]`: the certificate (one pair for all domains) and the client listeners' session
/// tickets (`crate::transport::tls::tickets`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// PEM certificate chain. Unset (`""` in the file): a self-signed certificate is
    /// generated into `certs_dir`.
    #[serde(with = "unset_if_empty")]
    pub cert: Option<PathBuf>,
    /// PEM private key matching `cert`.
    #[serde(with = "unset_if_empty")]
    pub key: Option<PathBuf>,
    /// Where generated development certificates are written (never committed).
    pub certs_dir: PathBuf,
    /// Stateless session tickets on the client listeners (RFC 8446 §4.6.1), which every
    /// node sharing `ticket_secret` (or the database) accepts. Off: resumption only on the
    /// node that made the session, from its in-memory cache.
    pub tickets: bool,
    /// Secret the ticket keys are derived from, the same on every node of a cluster, at
    /// least 16 bytes. Unset (`""`): one generated once and kept in the database.
    #[serde(with = "unset_if_empty")]
    pub ticket_secret: Option<String>,
    /// Seconds of one ticket key period: a ticket is accepted in the period it was issued
    /// in and the next, so for at most twice this; at least 60, at most 7 days (RFC 8446
    /// §4.6.1's ceiling on a ticket's lifetime).
    #[serde(with = "secs")]
    pub ticket_rotation: Duration,
}

impl Default for TlsConfig {
    fn default() -> Self {
        TlsConfig {
            cert: None,
            key: None,
            certs_dir: PathBuf::from("certs"),
            tickets: true,
            ticket_secret: None,
            ticket_rotation: Duration::from_secs(12 * 3600),
        }
    }
}

/// Shortest `[auth] fast_token_lifetime`.
const MIN_FAST_LIFETIME: Duration = Duration::from_secs(60);
/// Longest `[auth] fast_token_lifetime`: a year.
const MAX_FAST_LIFETIME: Duration = Duration::from_secs(365 * 86400);

impl Config {
    /// The `[auth]` FAST numbers: a secret long enough, a lifetime within bounds and a
    /// rotation inside it, at least one client per account.
    fn check_fast(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(m.to_owned()));
        let a = &self.auth;
        if a.fast_secret.as_ref().is_some_and(|s| s.len() < 16) {
            return bad("[auth] fast_secret must be at least 16 bytes (or \"\" for a stored one)");
        }
        if !(MIN_FAST_LIFETIME..=MAX_FAST_LIFETIME).contains(&a.fast_token_lifetime) {
            return bad("[auth] fast_token_lifetime must be between 60 seconds and 365 days");
        }
        if a.fast_token_rotation.is_zero() || a.fast_token_rotation >= a.fast_token_lifetime {
            return bad("[auth] fast_token_rotation must be above 0 and below fast_token_lifetime");
        }
        if a.max_fast_clients == 0 {
            return bad("[auth] max_fast_clients must be at least 1");
        }
        Ok(())
    }
}

/// Shortest `[tls] ticket_rotation`: shorter periods only cost full handshakes.
const MIN_TICKET_ROTATION: Duration = Duration::from_secs(60);
/// Longest `[tls] ticket_rotation`: a ticket's advertised lifetime is one period, and
/// RFC 8446 §4.6.1 caps that at 7 days.
const MAX_TICKET_ROTATION: Duration = Duration::from_secs(7 * 24 * 3600);

/// `[database]`: the durable store, PostgreSQL or an SQLite file.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// Connection URL; `DATABASE_URL` overrides it. `sqlite://path` is an SQLite file
    /// (created on first start; a relative path in the file is relative to the file),
    /// `postgres://...` a PostgreSQL database.
    pub url: String,
    /// PostgreSQL: pool size.
    pub max_connections: u32,
    /// SQLite: connections of the readers' pool (there is always exactly one writer).
    /// Each holds its own page cache and prepared statements, so this is a memory cost
    /// per connection; a read takes microseconds, so a few serve a node's logins.
    pub sqlite_readers: u32,
    /// SQLite: the page cache of each connection, in KiB (`PRAGMA cache_size`). A page
    /// not cached is read from the file (the operating system's cache) again.
    pub sqlite_cache_kib: u32,
    /// The operator's own SQL migrations (numbered from 1000), applied after the schema
    /// built into the binary, at start and by `presenced migrate`. May be absent.
    pub migrations: PathBuf,
    /// Longest time (seconds in the file) the privacy gate's broadcast inputs (roster,
    /// settings, blocks) of a user who changes presence are reused without a database read;
    /// writes and change notifications drop them at once (`store::audience_cache`). 0 reads
    /// on every change.
    #[serde(with = "secs")]
    pub gate_cache_secs: Duration,
    /// SQLite: how long a statement waits for another process's lock on the file (an
    /// operator's shell mid-transaction) before it fails with an error naming the file.
    #[serde(with = "secs")]
    pub sqlite_busy_timeout: Duration,
    /// SQLite: how often the server reads `presenced_changes`, the table through which
    /// changes made outside it (the sqlite3 shell, a migration) reach online users.
    #[serde(with = "secs")]
    pub change_poll_interval: Duration,
    /// A pooled connection idle for longer than this (seconds in the file) is checked with a
    /// round trip before a statement uses it; one used more recently is taken as it is
    /// (`store::pool_options`). 0 checks before every statement.
    #[serde(with = "secs")]
    pub recheck_idle_secs: Duration,
}

/// The file a `sqlite://path` (or `sqlite:path`) database URL names, or None for any
/// other URL. A query string (`?mode=...`) is not part of the path.
pub fn sqlite_path(url: &str) -> Option<PathBuf> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))?;
    let path = rest.split_once('?').map_or(rest, |(p, _)| p);
    Some(PathBuf::from(path))
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        DatabaseConfig {
            url: "postgres://postgres@127.0.0.1:5432/presenced".into(),
            max_connections: 16,
            sqlite_readers: 4,
            sqlite_cache_kib: 512,
            migrations: PathBuf::from("migrations.d"),
            gate_cache_secs: Duration::from_secs(30),
            sqlite_busy_timeout: Duration::from_secs(5),
            change_poll_interval: Duration::from_millis(250),
            recheck_idle_secs: Duration::from_secs(1),
        }
    }
}

/// `[redis]`: liveness and routing state.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedisConfig {
    /// Connection URL; `REDIS_URL` overrides it. Empty (the default) runs liveness in
    /// process: a single node without Redis.
    pub url: String,
    /// Prepended to every key this server writes, so several deployments (or test runs)
    /// can share one Redis without seeing each other's keys.
    pub key_prefix: String,
    /// How long one Redis command may take before it counts as a failure; presence then
    /// degrades instead of stalling a session.
    #[serde(with = "secs")]
    pub timeout: Duration,
    /// Longest wait between reconnection attempts (the backoff doubles from 0.1 s up to
    /// this).
    #[serde(with = "secs")]
    pub reconnect_max: Duration,
}

impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            url: String::new(),
            key_prefix: String::new(),
            timeout: Duration::from_secs(1),
            reconnect_max: Duration::from_secs(5),
        }
    }
}

/// `[liveness]`: how silence is turned into "unavailable". Times are written in seconds and
/// may be fractional (tests scale them down); see [`crate::liveness`] for how they relate.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LivenessConfig {
    /// H: after this much inbound silence the server pings the client (XEP-0199 on TCP,
    /// a WebSocket Ping on RFC 7395); any inbound traffic counts as a heartbeat.
    #[serde(with = "secs")]
    pub heartbeat_interval: Duration,
    /// T: a resource whose last heartbeat is older than this is dead.
    #[serde(with = "secs")]
    pub ttl: Duration,
    /// G: after a clean close or a dropped connection, wait this long before telling
    /// contacts; a reconnect of the same resource within it tells them nothing.
    #[serde(with = "secs")]
    pub grace: Duration,
    /// Whether this node runs the sweeper (any number of nodes may; each stale resource is
    /// still handled once).
    pub sweeper: bool,
    /// How often this node runs the sweeper.
    #[serde(with = "secs")]
    pub sweep_interval: Duration,
    /// Resources taken per sweeper call (the script is called again while batches are full).
    pub sweep_batch: usize,
    /// Stale resources of dead nodes the sweeper announces at once (each reads its audience
    /// and fans out to it): a node's death announces all of its sessions within the sweep
    /// that finds them stale, without one round trip after another per resource, and
    /// without more concurrent store reads than this.
    pub sweep_concurrency: usize,
    /// At most one Redis write per resource per this interval (default T/3): beats are held
    /// locally and the latest one is written when this much time has passed.
    #[serde(with = "secs")]
    pub redis_refresh: Duration,
    /// Last-seen entries are written to PostgreSQL in one statement at most this often.
    #[serde(with = "secs")]
    pub last_seen_flush: Duration,
    /// Number of beat ZSETs (`presence:beats:<shard>`), so one key does not grow without
    /// bound and sweeps spread out.
    pub beat_shards: u32,
    /// Interval between log lines with the liveness counters (0 = never).
    #[serde(with = "secs")]
    pub metrics_log_interval: Duration,
}

impl Default for LivenessConfig {
    fn default() -> Self {
        LivenessConfig {
            heartbeat_interval: Duration::from_secs(30),
            ttl: Duration::from_secs(100),
            grace: Duration::from_secs(10),
            sweeper: true,
            sweep_interval: Duration::from_secs(5),
            sweep_batch: 500,
            sweep_concurrency: 32,
            redis_refresh: Duration::from_secs(33),
            last_seen_flush: Duration::from_secs(1),
            beat_shards: 16,
            metrics_log_interval: Duration::from_secs(60),
        }
    }
}

/// `[http]`: one HTTP(S) listener for RFC 7395 WebSocket and XEP-0156 discovery.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Whether to listen at all.
    pub enabled: bool,
    /// Address to bind.
    pub bind: IpAddr,
    /// Port; 0 lets the system choose (tests).
    pub port: u16,
    /// Serve TLS with the `[tls]` certificates. Off only behind a TLS-terminating proxy
    /// (or on loopback in tests): XMPP over this listener is then treated as encrypted.
    pub tls: bool,
    /// Path of the RFC 7395 WebSocket endpoint.
    pub websocket_path: String,
    /// Public URL advertised in host-meta (XEP-0156); unset (`""`) derives
    /// `wss://<domain>:<port><websocket_path>` from the request's Host.
    #[serde(with = "unset_if_empty")]
    pub websocket_url: Option<String>,
    /// Largest HTTP request head in bytes (this listener and `[admin]`'s).
    pub max_request_head: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            enabled: true,
            bind: IpAddr::from([0, 0, 0, 0]),
            port: 5443,
            tls: true,
            websocket_path: "/xmpp-websocket".into(),
            websocket_url: None,
            max_request_head: 8192,
        }
    }
}

/// `[auth]`: SASL and registration.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// Offer SASL PLAIN (only ever after TLS, RFC 6120 §13.8).
    pub allow_plain: bool,
    /// PBKDF2 iterations for newly stored SCRAM credentials (RFC 7677 §4 recommends ≥ 4096).
    pub scram_iterations: u32,
    /// XEP-0077 in-band registration of new accounts, and a user's removal of its own
    /// account (`<remove/>`, XEP-0077 §3.2) in a session (off by default: spam).
    pub allow_registration: bool,
    /// In-band registrations one source address (an IPv6 /64) may make per hour, as a
    /// budget that refills evenly over the hour; beyond it resource-constraint (wait).
    pub registrations_per_ip_per_hour: u32,
    /// In-band registrations this node accepts per hour from everyone together; beyond it
    /// resource-constraint (wait).
    pub registrations_per_hour: u32,
    /// XEP-0484 FAST: a client that logs in over XEP-0388 SASL2 may ask for a token and log
    /// in with it next time in one round trip, without PBKDF2.
    pub fast: bool,
    /// Secret FAST tokens are derived from (with a random nonce per token, which is all
    /// the database keeps), the same on every node of a cluster, at least 16 bytes. Unset
    /// (`""`): one generated once and kept in the database, which then alone can make the
    /// tokens. Changing it revokes every token: clients log in with their password again.
    #[serde(with = "unset_if_empty")]
    pub fast_secret: Option<String>,
    /// Seconds a FAST token logs in for after it is issued.
    #[serde(with = "secs")]
    pub fast_token_lifetime: Duration,
    /// Seconds after which a login with a FAST token is given a new one (XEP-0484 "Token
    /// rotation"); the old one keeps working until the client uses the new one.
    #[serde(with = "secs")]
    pub fast_token_rotation: Duration,
    /// Client installations (XEP-0388 user-agent ids) an account keeps FAST tokens for;
    /// a token for one more drops the client that was issued one least recently.
    pub max_fast_clients: u32,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            allow_plain: true,
            scram_iterations: 4096,
            allow_registration: false,
            registrations_per_ip_per_hour: 5,
            registrations_per_hour: 100,
            fast: true,
            fast_secret: None,
            fast_token_lifetime: Duration::from_secs(21 * 86400),
            fast_token_rotation: Duration::from_secs(86400),
            max_fast_clients: 32,
        }
    }
}

/// `[limits]`: what one client may cost. Each violation gets the RFC 6120 error named here.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Largest stanza in bytes (policy-violation, RFC 6120 §13.12).
    pub max_stanza_size: usize,
    /// Deepest element nesting in a stanza (policy-violation).
    pub max_depth: usize,
    /// Elements plus attributes (namespace declarations included) in one stanza of an
    /// authenticated stream (policy-violation): memory grows with these, not with bytes.
    pub max_stanza_nodes: usize,
    /// The same before authentication (c2s before SASL success, s2s before dialback or
    /// SASL EXTERNAL), where negotiation needs only a few small elements.
    pub max_stanza_nodes_unauthenticated: usize,
    /// Attributes on one element, namespace declarations included (policy-violation).
    pub max_attributes: usize,
    /// Namespace declarations in scope at once, stream header included (policy-violation).
    pub max_namespace_declarations: usize,
    /// Time from TCP accept to a bound resource, in seconds (connection-timeout, RFC 6120
    /// §4.9.3.4).
    #[serde(with = "secs")]
    pub negotiation_timeout: Duration,
    /// Seconds one write to a client may wait for the client to read it (TCP, and over
    /// WebSocket every frame, the server's answers to its Pings included). A client that
    /// reads nothing for this long is disconnected as a dropped connection, freeing its
    /// place under `max_connections` and what was queued for it.
    #[serde(with = "secs")]
    pub write_timeout: Duration,
    /// New connections accepted per source IP per minute, counted over every client-facing
    /// listener together (c2s and HTTP/WebSocket); more are closed with policy-violation
    /// (HTTP: 429) before any negotiation.
    pub connections_per_ip_per_minute: u32,
    /// Simultaneous client connections, c2s and HTTP/WebSocket together; more get
    /// resource-constraint (HTTP: 503).
    pub max_connections: usize,
    /// Simultaneous client connections from one source address (an IPv6 /64), c2s and
    /// HTTP/WebSocket together; more get policy-violation (HTTP: 429). Generous: many
    /// users may share one carrier-grade NAT address.
    pub max_connections_per_ip: usize,
    /// Roster items per user. Every write that would create one more (roster set,
    /// outbound subscribe, approving a request) is refused with not-allowed.
    pub max_roster_items: i64,
    /// Groups one roster item may carry (not-acceptable beyond, as RFC 6121 §2.3.3 answers
    /// the other size limits of a roster set).
    pub max_roster_groups: usize,
    /// Characters in one group name (RFC 6121 §2.3.3: not-acceptable beyond).
    pub max_roster_group_length: usize,
    /// Characters in a roster item's name (RFC 6121 §2.3.3: not-acceptable beyond).
    pub max_roster_name_length: usize,
    /// Inbound subscription requests kept for one user until answered (RFC 6121 §3.1.3);
    /// one beyond it is not kept.
    pub max_pending_subscriptions: usize,
    /// Characters of the status (and XEP-0172 nick) a kept subscription request retains.
    pub max_subscription_status_length: usize,
    /// Resources bound at once to one account (resource-constraint beyond, RFC 6120
    /// §7.6.2.1 / §7.7.2.2).
    pub max_resources_per_account: usize,
    /// Entries in one block list (XEP-0191); a block beyond it gets not-acceptable.
    pub max_blocklist_items: usize,
    /// Targets of directed available presence one session tracks (RFC 6121 §4.6); directed
    /// presence to one more is refused with resource-constraint and not delivered.
    pub max_directed_presences: usize,
    /// Viewers one session records as shown its presence (roster contacts, directed
    /// presence and iq targets); a viewer beyond it is not shown the presence, since it
    /// could not be withdrawn later. At least `max_roster_items`, so a full roster fits.
    pub max_revealed_per_session: usize,
    /// Messages kept for one user who has no available resource (XEP-0160). A contact's
    /// message beyond it first displaces the oldest kept message of a stranger; with none
    /// left to displace it is refused (service-unavailable, RFC 6121 §8.5.2.2.1, to a
    /// contact the privacy gate lets see the user's online status; nothing to anyone
    /// else). A stranger's message beyond it is dropped silently.
    pub max_offline_messages: usize,
    /// Bytes of kept messages (serialised) for one user, counted like
    /// `max_offline_messages`: what does not fit is refused or dropped the same way.
    pub max_offline_bytes: usize,
    /// Messages one contact (a sender in the user's roster with subscription `to`, `from`
    /// or `both`) may have kept for one user; beyond it that contact's message is refused
    /// as for a full store, so one contact cannot fill the store for the others.
    pub max_offline_messages_per_sender: usize,
    /// Bytes one contact may have kept for one user, counted like
    /// `max_offline_messages_per_sender`.
    pub max_offline_bytes_per_sender: usize,
    /// Messages one stranger (any other sender, by bare JID) may have kept for one user;
    /// beyond it the stranger's message is dropped silently. 0 keeps no stranger's message.
    pub max_offline_messages_per_stranger: usize,
    /// Bytes one stranger may have kept for one user, counted like
    /// `max_offline_messages_per_stranger`; 0 keeps no stranger's message.
    pub max_offline_bytes_per_stranger: usize,
    /// XEP-0163 nodes one account may have; a publish that would create one more gets
    /// not-allowed with `<max-nodes-exceeded/>` (XEP-0060 §7.1.3).
    pub max_pep_nodes: usize,
    /// Items kept per XEP-0163 node: a publish beyond it deletes the oldest (XEP-0060
    /// §7.1.1); a larger `pubsub#max_items` in publish-options gets precondition-not-met.
    pub max_pep_items: usize,
    /// Bytes of one published item's payload, serialised; more gets not-acceptable with
    /// `<payload-too-big/>` (XEP-0060 §7.1.3.4).
    pub max_pep_item_size: usize,
    /// Bytes of XEP-0163 payloads one account keeps in all its nodes; a publish that would
    /// take it beyond gets resource-constraint (wait) and stores nothing.
    pub max_pep_bytes: usize,
    /// Bytes of one vcard-temp vCard a user stores (XEP-0054), serialised with its PHOTO;
    /// more gets not-acceptable and nothing is stored.
    pub max_vcard_size: usize,
    /// Users whose avatar hash (XEP-0153, put into every available presence) this node
    /// keeps in memory, so a presence costs no store read; beyond it an arbitrary one is
    /// forgotten and read again at its next presence.
    pub max_avatar_hash_entries: usize,
    /// Seconds a kept avatar hash is used. A change made on this node replaces it at once;
    /// one made on another cluster node shows in this node's presence within this time.
    #[serde(with = "secs")]
    pub avatar_hash_ttl: Duration,
    /// XEP-0115 entity capabilities remembered (the features of one `ver` each), oldest
    /// forgotten first; a forgotten `ver` is asked again at the client's next presence.
    pub max_caps_entries: usize,
    /// XEP-0115 disco#info queries one session may have outstanding; a further `ver` it
    /// announces is not asked about until one is answered (or times out).
    pub max_caps_queries_per_session: usize,
    /// Seconds a XEP-0115 disco#info query waits for its answer; then the next client
    /// announcing that `ver` is asked instead.
    #[serde(with = "secs")]
    pub caps_query_timeout: Duration,
    /// Presence stanzas held for one session while its client says it is inactive
    /// (XEP-0352), one per contact resource; one more flushes everything held.
    pub max_csi_held_presences: usize,
    /// Bytes of presence held for one inactive session (XEP-0352), all senders together;
    /// one more byte flushes everything held, as the count does.
    pub max_csi_held_bytes: usize,
    /// Bytes of held presence one sender may take of a session's
    /// `max_csi_held_bytes`: a sender is a bare JID of the session's own domain, or a whole
    /// remote domain (whose server names its JIDs at will). Beyond it the sender's oldest
    /// held presence is written at once (not dropped); a presence larger than this is
    /// never held.
    pub max_csi_held_bytes_per_sender: usize,
    /// Contacts one session may name in its interest list (`urn:presenced:interest:0`),
    /// whose presence passes at once while the client is inactive; more get not-acceptable.
    pub max_interest_items: usize,
    /// Seconds an interest list lasts without being set again; after that the session's
    /// presence is held as if it had none.
    #[serde(with = "secs")]
    pub interest_ttl: Duration,
    /// Seconds a XEP-0198 resumable session waits, bound and shown online, for its client
    /// to resume it after the connection died; then it ends as a disconnect does. A
    /// client's smaller `max` is taken. 0 turns resumption off (acks still work).
    #[serde(with = "secs")]
    pub sm_resume_timeout: Duration,
    /// Stanzas written to one XEP-0198 session and not yet acknowledged that the server
    /// keeps for redelivery; one more ends the stream with resource-constraint.
    pub sm_max_unacked: usize,
    /// Bytes of the stanzas written to one XEP-0198 session and not yet acknowledged (or
    /// kept while it is detached); one more ends the stream with resource-constraint, as
    /// `sm_max_unacked` does. At least twice `max_stanza_size`.
    pub sm_max_unacked_bytes: usize,
    /// Stanzas queued for one session before it is treated as stalled and disconnected.
    pub session_queue: usize,
    /// Bytes of the stanzas queued for one session and not yet taken by its writer; a
    /// stanza that would go beyond (unless the queue is empty) disconnects the session, as
    /// a full `session_queue` does. At least twice `max_stanza_size`.
    pub session_queue_bytes: usize,
    /// Stanzas per second a client may send on average (policy-violation beyond the burst).
    pub stanzas_per_second: u32,
    /// How many stanzas above the average rate may arrive at once.
    pub stanza_burst: u32,
    /// Failed SASL attempts on one stream before it is closed (RFC 6120 §6.4.5).
    pub max_auth_failures: u32,
    /// Failed password checks for one account from one source address (an IPv6 /64),
    /// over every stream, that lock the account for that source (not for others).
    pub auth_backoff_failures: u32,
    /// Milliseconds a failure counts towards the lock after the previous one.
    pub auth_backoff_window_ms: u64,
    /// Milliseconds of the first lock; each further failure doubles it.
    pub auth_backoff_base_ms: u64,
    /// Longest lock in milliseconds.
    pub auth_backoff_max_ms: u64,
    /// (Source, account) pairs the back-off table tracks at once (per node).
    pub auth_backoff_max_entries: usize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_stanza_size: 256 * 1024,
            max_depth: 64,
            max_stanza_nodes: 10_000,
            max_stanza_nodes_unauthenticated: 200,
            max_attributes: 64,
            max_namespace_declarations: 64,
            negotiation_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
            connections_per_ip_per_minute: 120,
            max_connections: 18_000,
            max_connections_per_ip: 1000,
            max_roster_items: 1000,
            max_roster_groups: 32,
            max_roster_group_length: 256,
            max_roster_name_length: 256,
            max_pending_subscriptions: 100,
            max_subscription_status_length: 256,
            max_resources_per_account: 16,
            max_blocklist_items: 1000,
            max_directed_presences: 1000,
            max_revealed_per_session: 5000,
            max_offline_messages: 100,
            max_offline_bytes: 1024 * 1024,
            max_offline_messages_per_sender: 50,
            max_offline_bytes_per_sender: 512 * 1024,
            max_offline_messages_per_stranger: 5,
            max_offline_bytes_per_stranger: 16 * 1024,
            max_pep_nodes: 64,
            max_pep_items: 32,
            max_pep_item_size: 128 * 1024,
            max_pep_bytes: 2 * 1024 * 1024,
            max_vcard_size: 128 * 1024,
            max_avatar_hash_entries: 100_000,
            avatar_hash_ttl: Duration::from_secs(30),
            max_caps_entries: 1000,
            max_caps_queries_per_session: 2,
            caps_query_timeout: Duration::from_secs(30),
            max_csi_held_presences: 500,
            max_csi_held_bytes: 1024 * 1024,
            max_csi_held_bytes_per_sender: 64 * 1024,
            max_interest_items: 500,
            interest_ttl: Duration::from_secs(300),
            sm_resume_timeout: Duration::from_secs(300),
            sm_max_unacked: 500,
            sm_max_unacked_bytes: 2 * 1024 * 1024,
            session_queue: 1024,
            session_queue_bytes: 2 * 1024 * 1024,
            stanzas_per_second: 50,
            stanza_burst: 200,
            max_auth_failures: 3,
            auth_backoff_failures: 5,
            auth_backoff_window_ms: 15 * 60 * 1000,
            auth_backoff_base_ms: 1000,
            auth_backoff_max_ms: 5 * 60 * 1000,
            auth_backoff_max_entries: 100_000,
        }
    }
}

/// `[s2s]`: federation (RFC 6120 server-to-server streams, XEP-0220 dialback, XEP-0178).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct S2sConfig {
    /// Whether to federate at all; off means every remote stanza bounces with
    /// remote-server-not-found and no s2s listener is opened.
    pub enabled: bool,
    /// Address the s2s listeners bind to.
    pub bind: IpAddr,
    /// `jabber:server` STARTTLS port (RFC 6120 §14.7: 5269); 0 lets the system choose.
    pub port: u16,
    /// Whether to listen for direct TLS server streams (XEP-0368).
    pub direct_tls: bool,
    /// Direct TLS s2s port; 0 lets the system choose.
    pub direct_tls_port: u16,
    /// Static routes: remote domain → `host:port` of its STARTTLS s2s port, or
    /// `xmpps://host:port` of its direct TLS s2s port (XEP-0368). Checked before DNS, for
    /// private deployments and tests; see [`Route`].
    pub routes: BTreeMap<String, Route>,
    /// DNS for SRV lookups: "" uses the system resolver configuration, "none" disables DNS
    /// (only static routes work), `ip:port` uses that one name server only.
    pub nameserver: Nameserver,
    /// Dialback secret (XEP-0185 key derivation). Unset (`""`): a random one per start,
    /// which is correct for a single node (keys only need to verify while the stream is
    /// set up).
    #[serde(with = "unset_if_empty")]
    pub secret: Option<String>,
    /// PEM file of certificate authorities trusted for peers' certificates, inbound (SASL
    /// EXTERNAL) and outbound. Unset (`""`): only `allow_self_signed` domains' certificates
    /// verify; other peers authenticate with dialback, where policy allows it.
    #[serde(with = "unset_if_empty")]
    pub ca_file: Option<PathBuf>,
    /// Default policy for domains without an entry in `domains`.
    pub default_policy: S2sPolicy,
    /// Per-domain policy overrides.
    pub domains: BTreeMap<String, S2sPolicy>,
    /// Time without a stanza after which an outgoing stream is closed (seconds).
    #[serde(with = "secs")]
    pub idle_timeout: Duration,
    /// Stanzas held per (local, remote) domain pair and not yet written or bounced, mostly
    /// while its stream connects; more are bounced at once with remote-server-timeout
    /// (RFC 6120 §8.3.3.17).
    pub queue_size: usize,
    /// Time to connect and authenticate an outgoing stream before its queue is bounced
    /// with remote-server-timeout (RFC 6120 §8.3.3.17), in seconds.
    #[serde(with = "secs")]
    pub connect_timeout: Duration,
    /// Shortest reconnect delay after a failure, in milliseconds. The n-th failure in a
    /// row waits a random time in [min·2^(n-1), min·2^n], clamped to [min, max]
    /// (`s2s::outbound::reconnect_delay`).
    #[serde(with = "millis")]
    pub reconnect_min_ms: Duration,
    /// Longest reconnect delay, in milliseconds.
    #[serde(with = "millis")]
    pub reconnect_max_ms: Duration,
    /// How long a lost federation link may stay down before local users see that domain's
    /// contacts as unavailable, in seconds.
    #[serde(with = "secs")]
    pub stale_grace: Duration,
    /// Average stanzas per second one inbound server stream may send.
    pub stanzas_per_second: u32,
    /// Burst above the average rate.
    pub stanza_burst: u32,
    /// Simultaneous inbound server connections; more are refused.
    pub max_connections: usize,
    /// Of those, open at once from one source IP (IPv6: one /64); more are refused. A
    /// number of its own, not `[limits] max_connections_per_ip`: one peer server holds
    /// several streams to us (one per pair of its domain and ours it authenticates, plus a
    /// short one for each dialback verify), and a hosting provider's server speaks for
    /// many domains from one address, so its budget has nothing in common with a client's.
    pub max_connections_per_ip: usize,
}

/// How much a remote domain must prove before its stanzas are accepted.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct S2sPolicy {
    /// Only SASL EXTERNAL with a verified certificate is accepted (XEP-0178); dialback is
    /// refused.
    pub require_verified_cert: bool,
    /// Dialback (XEP-0220) is allowed when the certificate does not verify.
    pub allow_dialback: bool,
    /// A self-signed certificate whose names cover the domain counts as verified (test
    /// domains only).
    pub allow_self_signed: bool,
}

impl Default for S2sPolicy {
    fn default() -> Self {
        S2sPolicy {
            require_verified_cert: false,
            allow_dialback: true,
            allow_self_signed: false,
        }
    }
}

impl Default for S2sConfig {
    fn default() -> Self {
        S2sConfig {
            enabled: true,
            bind: IpAddr::from([0, 0, 0, 0]),
            port: 5269,
            direct_tls: false,
            direct_tls_port: 5270,
            routes: BTreeMap::new(),
            nameserver: Nameserver::System,
            secret: None,
            ca_file: None,
            default_policy: S2sPolicy::default(),
            domains: BTreeMap::new(),
            idle_timeout: Duration::from_secs(600),
            queue_size: 1000,
            connect_timeout: Duration::from_secs(30),
            reconnect_min_ms: Duration::from_secs(1),
            reconnect_max_ms: Duration::from_secs(60),
            stale_grace: Duration::from_secs(60),
            stanzas_per_second: 500,
            stanza_burst: 2000,
            max_connections: 1000,
            max_connections_per_ip: 100,
        }
    }
}

/// Where a static route leads: `host:port` is a STARTTLS s2s port, `xmpps://host:port` a
/// direct TLS one (XEP-0368, the static counterpart of an `_xmpps-server._tcp` SRV
/// record). An IPv6 host is written in brackets (`[::1]:5269`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// Host name or address text (IPv6 without brackets).
    pub host: String,
    /// Port.
    pub port: u16,
    /// TLS from the first byte (XEP-0368) instead of STARTTLS.
    pub direct_tls: bool,
}

impl FromStr for Route {
    type Err = String;

    fn from_str(route: &str) -> Result<Route, String> {
        let malformed = || format!("[s2s] routes: `{route}` is not host:port or xmpps://host:port");
        let (rest, direct_tls) = match route.strip_prefix("xmpps://") {
            Some(rest) => (rest, true),
            None => (route, false),
        };
        let (host, port) = rest.rsplit_once(':').ok_or_else(malformed)?;
        let host = host.trim_matches(['[', ']']);
        if host.is_empty() || host.contains('/') {
            return Err(malformed());
        }
        Ok(Route {
            host: host.to_owned(),
            port: port.parse().map_err(|_| malformed())?,
            direct_tls,
        })
    }
}

impl std::fmt::Display for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scheme = if self.direct_tls { "xmpps://" } else { "" };
        if self.host.contains(':') {
            write!(f, "{scheme}[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{scheme}{}:{}", self.host, self.port)
        }
    }
}

impl Serialize for Route {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Route {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Route, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// `[s2s] nameserver`: where SRV and address lookups for federation go.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Nameserver {
    /// `""`: the system resolver configuration (`/etc/resolv.conf`).
    #[default]
    System,
    /// `"none"`: no DNS at all; only static routes work.
    Disabled,
    /// `"ip:port"`: that one name server only.
    Server(SocketAddr),
}

impl FromStr for Nameserver {
    type Err = String;

    fn from_str(s: &str) -> Result<Nameserver, String> {
        match s {
            "" => Ok(Nameserver::System),
            "none" => Ok(Nameserver::Disabled),
            addr => addr.parse().map(Nameserver::Server).map_err(|_| {
                format!("[s2s] nameserver must be \"\", \"none\" or ip:port, not `{addr}`")
            }),
        }
    }
}

impl Serialize for Nameserver {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Nameserver::System => s.serialize_str(""),
            Nameserver::Disabled => s.serialize_str("none"),
            Nameserver::Server(addr) => s.collect_str(addr),
        }
    }
}

impl<'de> Deserialize<'de> for Nameserver {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Nameserver, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// A duration written in the file as a number of `unit`s, integer or fractional: the file
/// format stays plain numbers (`ttl = 2.5`) while the program only ever sees [`Duration`].
/// Negative, infinite and NaN values are refused where they are read, so the parse error
/// points at the key.
fn duration_from<'de, D: serde::Deserializer<'de>>(d: D, unit: f64) -> Result<Duration, D::Error> {
    struct Number;
    impl serde::de::Visitor<'_> for Number {
        type Value = f64;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a non-negative number")
        }
        fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<f64, E> {
            Ok(v)
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<f64, E> {
            Ok(v as f64)
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<f64, E> {
            Ok(v as f64)
        }
    }
    let v = d.deserialize_any(Number)?;
    Duration::try_from_secs_f64(v * unit).map_err(|_| {
        serde::de::Error::custom(format!(
            "{v} is not a duration: a finite, non-negative number is required"
        ))
    })
}

/// Serde for a [`Duration`] written as seconds (fractions allowed).
mod secs {
    use std::time::Duration;

    pub(super) fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Duration, D::Error> {
        super::duration_from(d, 1.0)
    }

    pub(super) fn serialize<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }
}

/// Serde for an optional setting written as a string, `""` meaning unset (the file format
/// predates `Option`; the program never sees the empty string).
mod unset_if_empty {
    use serde::Deserialize;

    pub(super) fn deserialize<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
    where
        D: serde::Deserializer<'de>,
        T: From<String>,
    {
        let s = String::deserialize(d)?;
        Ok((!s.is_empty()).then(|| T::from(s)))
    }

    pub(super) fn serialize<S, T>(v: &Option<T>, s: S) -> Result<S::Ok, S::Error>
    where
        S: serde::Serializer,
        T: serde::Serialize,
    {
        match v {
            Some(t) => t.serialize(s),
            None => s.serialize_str(""),
        }
    }
}

/// Serde for a [`Duration`] written as milliseconds.
mod millis {
    use std::time::Duration;

    pub(super) fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Duration, D::Error> {
        super::duration_from(d, 1e-3)
    }

    pub(super) fn serialize<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64() * 1e3)
    }
}

impl S2sConfig {
    /// The policy for `domain`.
    pub fn policy(&self, domain: &str) -> &S2sPolicy {
        self.domains.get(domain).unwrap_or(&self.default_policy)
    }
}

/// A configuration that passed [`Config::check`]: the only kind the server starts with, so
/// every range and cross-key rule is checked once, before anything runs. It reads like the
/// [`Config`] it wraps.
#[derive(Debug, Clone)]
pub struct CheckedConfig(Config);

impl std::ops::Deref for CheckedConfig {
    type Target = Config;

    fn deref(&self) -> &Config {
        &self.0
    }
}

impl Config {
    /// Reads, parses, applies the environment overrides and checks.
    pub fn load(path: &Path) -> Result<CheckedConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let mut config = Config::parse(&text).map_err(|source| ConfigError::Parse {
            path: path.to_owned(),
            source,
        })?;
        config.normalize_domains();
        // Relative paths in the file are relative to the file, so `--config` works from
        // anywhere; those from the environment, applied after, to the working directory.
        if let Some(dir) = path.parent() {
            config.resolve_paths(dir);
        }
        config.apply_env(|k| std::env::var(k).ok());
        config.check()
    }

    /// Validates and seals: the checked configuration the server runs with.
    pub fn check(mut self) -> Result<CheckedConfig, ConfigError> {
        if self.cluster.node_id.is_none() {
            self.cluster.node_id = Some(ClusterConfig::derived_node_id(self.c2s.port));
        }
        self.validate()?;
        Ok(CheckedConfig(self))
    }

    /// Parses TOML text without validating.
    pub fn parse(text: &str) -> Result<Config, toml::de::Error> {
        toml::from_str(text)
    }

    /// Domains are compared with normalised JIDs everywhere, so they are normalised too
    /// (RFC 7622 §3.2: `Example.ORG` is `example.org`).
    pub fn normalize_domains(&mut self) {
        for d in &mut self.domains {
            if let Ok(j) = crate::protocol::jid::parse_bare(d) {
                if j.node().is_none() {
                    *d = j.domain().to_string();
                }
            }
        }
    }

    /// `DATABASE_URL` and `REDIS_URL` override the file.
    pub fn apply_env(&mut self, get: impl Fn(&str) -> Option<String>) {
        if let Some(url) = get("DATABASE_URL").filter(|u| !u.is_empty()) {
            self.database.url = url;
        }
        if let Some(url) = get("REDIS_URL").filter(|u| !u.is_empty()) {
            self.redis.url = url;
        }
    }

    fn resolve_paths(&mut self, dir: &Path) {
        let fix = |p: &mut PathBuf| {
            if p.is_relative() && !p.as_os_str().is_empty() {
                *p = dir.join(&*p);
            }
        };
        fix(&mut self.database.migrations);
        fix(&mut self.tls.certs_dir);
        if let Some(file) = sqlite_path(&self.database.url) {
            if file.is_relative() && !file.as_os_str().is_empty() {
                let query = self.database.url.split_once('?').map(|(_, q)| q.to_owned());
                self.database.url = format!("sqlite://{}", dir.join(file).display());
                if let Some(q) = query {
                    self.database.url = format!("{}?{q}", self.database.url);
                }
            }
        }
        for p in [
            &mut self.s2s.ca_file,
            &mut self.tls.cert,
            &mut self.tls.key,
            &mut self.admin.socket,
        ]
        .into_iter()
        .flatten()
        {
            fix(p);
        }
    }

    /// Checks ranges and consistency.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(m.to_owned()));
        if sqlite_path(&self.database.url).is_some_and(|p| p.as_os_str().is_empty()) {
            return bad("[database] url: sqlite:// needs a file, e.g. sqlite://presenced.db");
        }
        if self.domains.is_empty() {
            return bad("`domains` must name at least one domain");
        }
        if self.admin.status_poll < Duration::from_millis(100) {
            return bad("[admin] status_poll must be at least 0.1 seconds");
        }
        if self.push.enabled
            && (self.push.max_registrations == 0 || self.push.max_options_bytes == 0)
        {
            return bad("[push] max_registrations and max_options_bytes must be at least 1");
        }
        for d in &self.domains {
            if crate::protocol::jid::parse_bare(d)
                .map(|j| j.node().is_some())
                .unwrap_or(true)
            {
                return bad(&format!("`{d}` is not a valid domain"));
            }
        }
        if self.tls.cert.is_some() != self.tls.key.is_some() {
            return bad("[tls] cert and key must be given together");
        }
        if self
            .tls
            .ticket_secret
            .as_ref()
            .is_some_and(|s| s.len() < 16)
        {
            return bad("[tls] ticket_secret must be at least 16 bytes (or \"\" for a stored one)");
        }
        if !(MIN_TICKET_ROTATION..=MAX_TICKET_ROTATION).contains(&self.tls.ticket_rotation) {
            return bad("[tls] ticket_rotation must be between 60 seconds and 7 days (604800)");
        }
        self.check_fast()?;
        if self.admin.enabled && self.admin.port != 0 {
            let clients = [
                (self.c2s.bind, self.c2s.port),
                (self.c2s.bind, self.c2s.direct_tls_port),
                (self.http.bind, self.http.port),
            ];
            if clients.iter().any(|&(bind, port)| {
                port == self.admin.port
                    && (bind == self.admin.bind
                        || bind.is_unspecified()
                        || self.admin.bind.is_unspecified())
            }) {
                return bad("[admin] port must differ from the client ports ([c2s], [http])");
            }
        }
        if let Err(e) = tracing_subscriber::EnvFilter::try_new(&self.log.level) {
            return bad(&format!("[log] level `{}`: {e}", self.log.level));
        }
        self.validate_limits()?;
        self.validate_liveness()?;
        let s = &self.s2s;
        if s.queue_size == 0 || s.connect_timeout.is_zero() || s.idle_timeout.is_zero() {
            return bad("[s2s] queue_size, connect_timeout and idle_timeout must be positive");
        }
        if s.reconnect_min_ms.is_zero() || s.reconnect_max_ms < s.reconnect_min_ms {
            return bad("[s2s] 0 < reconnect_min_ms <= reconnect_max_ms");
        }
        if s.stanzas_per_second == 0 || s.max_connections == 0 || s.max_connections_per_ip == 0 {
            return bad(
                "[s2s] stanzas_per_second, max_connections and max_connections_per_ip must be positive",
            );
        }
        if self.auth.scram_iterations < 4096 {
            return bad("[auth] scram_iterations must be at least 4096 (RFC 7677 §4)");
        }
        let db = &self.database;
        if db.sqlite_busy_timeout < Duration::from_millis(1)
            || db.sqlite_busy_timeout > Duration::from_secs(600)
        {
            return bad("[database] sqlite_busy_timeout must be between 0.001 and 600 seconds");
        }
        if !(1..=256).contains(&db.sqlite_readers) {
            return bad("[database] sqlite_readers must be between 1 and 256");
        }
        if !(64..=1_048_576).contains(&db.sqlite_cache_kib) {
            return bad("[database] sqlite_cache_kib must be between 64 and 1048576");
        }
        // Changes made in SQL must reach online users within a second.
        if db.change_poll_interval < Duration::from_millis(10)
            || db.change_poll_interval > Duration::from_secs(1)
        {
            return bad("[database] change_poll_interval must be between 0.01 and 1 seconds");
        }
        if self.database.gate_cache_secs > Duration::from_secs(86_400) {
            return bad("[database] gate_cache_secs must be between 0 and 86400");
        }
        if self.database.recheck_idle_secs > Duration::from_secs(3_600) {
            return bad("[database] recheck_idle_secs must be between 0 and 3600");
        }
        Ok(())
    }

    /// `[limits]` ranges and consistency.
    fn validate_limits(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(m.to_owned()));
        let l = &self.limits;
        if l.max_stanza_size < 10_000 {
            // RFC 6120 §13.12: servers must accept stanzas of at least 10000 bytes.
            return bad("[limits] max_stanza_size must be at least 10000 (RFC 6120 §13.12)");
        }
        if l.max_depth < 4 || l.negotiation_timeout.is_zero() || l.session_queue == 0 {
            return bad("[limits] max_depth >= 4, negotiation_timeout > 0, session_queue > 0");
        }
        if l.write_timeout.is_zero() {
            return bad("[limits] write_timeout must be positive");
        }
        if l.avatar_hash_ttl.is_zero() {
            return bad("[limits] avatar_hash_ttl must be positive");
        }
        if l.interest_ttl.is_zero() {
            return bad("[limits] interest_ttl must be positive");
        }
        if l.max_offline_messages >= l.session_queue {
            // All of a user's kept messages are queued at once at login; a mailbox that
            // cannot take them ends the session and loses them.
            return bad("[limits] max_offline_messages must be less than session_queue");
        }
        if l.stanzas_per_second == 0 || l.max_auth_failures == 0 || l.max_roster_items <= 0 {
            return bad("[limits] rates and counts must be positive");
        }
        validate_counts(l)?;
        if l.session_queue_bytes < 2 * l.max_stanza_size
            || l.sm_max_unacked_bytes < 2 * l.max_stanza_size
        {
            // What the server writes can be a little larger than what it accepts (a delay
            // stamp, a carbons wrapper): any one stanza must fit with room to spare.
            return bad(
                "[limits] session_queue_bytes and sm_max_unacked_bytes must be at least twice max_stanza_size",
            );
        }
        if l.max_csi_held_bytes_per_sender == 0
            || l.max_csi_held_bytes_per_sender > l.max_csi_held_bytes
        {
            return bad(
                "[limits] max_csi_held_bytes_per_sender must be between 1 and max_csi_held_bytes",
            );
        }
        validate_offline_bytes(l)?;
        if (l.max_revealed_per_session as i64) < l.max_roster_items {
            // A broadcast to a full roster must be able to record every contact it reaches.
            return bad("[limits] max_revealed_per_session must be at least max_roster_items");
        }
        // Enough for negotiation (a SASL exchange, a registration form), a stream header's
        // attributes and namespace declarations, and a nested extension payload.
        if l.max_stanza_nodes_unauthenticated < 32
            || l.max_stanza_nodes < l.max_stanza_nodes_unauthenticated
        {
            return bad("[limits] 32 <= max_stanza_nodes_unauthenticated <= max_stanza_nodes");
        }
        if l.max_attributes < 16 || l.max_namespace_declarations < 8 {
            return bad("[limits] max_attributes >= 16, max_namespace_declarations >= 8");
        }
        if l.auth_backoff_failures == 0
            || l.auth_backoff_window_ms == 0
            || l.auth_backoff_base_ms == 0
            || l.auth_backoff_max_ms < l.auth_backoff_base_ms
            || l.auth_backoff_max_entries == 0
        {
            return bad("[limits] auth_backoff_*: positive, base_ms <= max_ms");
        }
        Ok(())
    }

    /// `[liveness]`, `[redis]` and `[http]` ranges. T must exceed H plus the refresh
    /// delay plus 10% slack: a live client's next beat comes at most H after the previous
    /// one and reaches Redis at most `redis_refresh` later; the slack absorbs network delay
    /// and a late beat, which would otherwise flip a live client to unavailable.
    fn validate_liveness(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        let l = &self.liveness;
        let positive = [
            ("heartbeat_interval", l.heartbeat_interval),
            ("ttl", l.ttl),
            ("sweep_interval", l.sweep_interval),
            ("redis_refresh", l.redis_refresh),
            ("last_seen_flush", l.last_seen_flush),
        ];
        for (name, v) in positive {
            if v.is_zero() {
                return bad(format!(
                    "[liveness] {name} must be a positive number of seconds"
                ));
            }
        }
        let slack = l.ttl / 10;
        let needed = l.heartbeat_interval + l.redis_refresh + slack;
        if l.ttl <= needed {
            return bad(format!(
                "[liveness] ttl ({}) must exceed heartbeat_interval + redis_refresh + 10% slack ({})",
                l.ttl.as_secs_f64(),
                needed.as_secs_f64()
            ));
        }
        if l.grace >= l.ttl {
            return bad("[liveness] grace must be shorter than ttl".into());
        }
        if l.sweep_batch == 0 || l.sweep_batch > 5000 || l.beat_shards == 0 {
            return bad("[liveness] sweep_batch must be 1..=5000 and beat_shards > 0".into());
        }
        if l.sweep_concurrency == 0 || l.sweep_concurrency > 1024 {
            return bad("[liveness] sweep_concurrency must be 1..=1024".into());
        }
        let r = &self.redis;
        if !r.url.is_empty() {
            if let Err(e) = redis::Client::open(r.url.as_str()) {
                return bad(format!("[redis] url is not a Redis URL: {e}"));
            }
            if !self.cluster.redis_nodes.is_empty() {
                return bad(
                    "[redis] url (or REDIS_URL) and [cluster] redis_nodes are both set: \
                     a single Redis or a Redis Cluster, not both"
                        .into(),
                );
            }
        }
        for node_url in &self.cluster.redis_nodes {
            if let Err(e) = redis::Client::open(node_url.as_str()) {
                return bad(format!(
                    "[cluster] redis_nodes: `{node_url}` is not a Redis URL: {e}"
                ));
            }
        }
        if r.timeout.is_zero() || r.reconnect_max < Duration::from_millis(100) {
            return bad("[redis] timeout > 0 and reconnect_max >= 0.1 seconds".into());
        }
        if let Some(id) = &self.cluster.node_id {
            if id.is_empty() || id.len() > 64 || !id.chars().all(valid_node_char) {
                return bad(format!(
                    "[cluster] node_id `{id}`: 1 to 64 letters, digits, '.', '_' or '-'"
                ));
            }
        }
        if self.cluster.max_recipients_per_message == 0 {
            return bad("[cluster] max_recipients_per_message must be positive".into());
        }
        if self.cluster.directory_cache_entries > 0 && self.cluster.directory_cache_ttl.is_zero() {
            return bad(
                "[cluster] directory_cache_ttl must be positive while the cache is on".into(),
            );
        }
        if !self.http.websocket_path.starts_with('/') || self.http.max_request_head < 512 {
            return bad(
                "[http] websocket_path must start with '/', max_request_head >= 512".into(),
            );
        }
        Ok(())
    }

    /// Whether liveness and the cluster run on Redis (a single one or a Redis Cluster).
    pub fn uses_redis(&self) -> bool {
        !self.redis.url.is_empty() || !self.cluster.redis_nodes.is_empty()
    }

    /// Whether this server hosts `domain`.
    pub fn serves(&self, domain: &str) -> bool {
        self.domains.iter().any(|d| d == domain)
    }
}

impl Default for crate::protocol::xml::reader::ReaderLimits {
    /// The limits of an authenticated peer under the default `[limits]`.
    fn default() -> Self {
        crate::protocol::xml::reader::ReaderLimits::for_peer(&LimitsConfig::default(), true)
    }
}

impl crate::protocol::xml::reader::ReaderLimits {
    /// The limits for a peer's stream, from `[limits]`. Before authentication a stream gets
    /// the much smaller stanza cost limit: negotiation needs a handful of small elements,
    /// and an unauthenticated peer must not be able to make the server hold megabytes.
    pub fn for_peer(l: &LimitsConfig, authenticated: bool) -> Self {
        crate::protocol::xml::reader::ReaderLimits {
            max_stanza_size: l.max_stanza_size,
            max_depth: l.max_depth,
            max_stanza_nodes: if authenticated {
                l.max_stanza_nodes
            } else {
                l.max_stanza_nodes_unauthenticated
            },
            max_attributes: l.max_attributes,
            max_namespace_declarations: l.max_namespace_declarations,
        }
    }
}

/// The `[limits]` counts the store compares with PostgreSQL integers.
fn validate_counts(l: &LimitsConfig) -> Result<(), ConfigError> {
    let bad = |m: &str| Err(ConfigError::Invalid(m.to_owned()));
    let counts = [
        ("max_roster_groups", l.max_roster_groups),
        ("max_roster_group_length", l.max_roster_group_length),
        ("max_roster_name_length", l.max_roster_name_length),
        ("max_pending_subscriptions", l.max_pending_subscriptions),
        (
            "max_subscription_status_length",
            l.max_subscription_status_length,
        ),
        ("max_resources_per_account", l.max_resources_per_account),
        ("max_blocklist_items", l.max_blocklist_items),
        ("max_directed_presences", l.max_directed_presences),
        ("max_revealed_per_session", l.max_revealed_per_session),
        ("max_offline_messages", l.max_offline_messages),
        (
            "max_offline_messages_per_sender",
            l.max_offline_messages_per_sender,
        ),
        ("max_pep_nodes", l.max_pep_nodes),
        ("max_pep_items", l.max_pep_items),
        ("max_pep_item_size", l.max_pep_item_size),
        ("max_pep_bytes", l.max_pep_bytes),
        ("max_vcard_size", l.max_vcard_size),
        ("max_avatar_hash_entries", l.max_avatar_hash_entries),
        ("max_caps_entries", l.max_caps_entries),
        ("max_connections_per_ip", l.max_connections_per_ip),
        (
            "max_caps_queries_per_session",
            l.max_caps_queries_per_session,
        ),
        ("max_csi_held_presences", l.max_csi_held_presences),
        ("max_interest_items", l.max_interest_items),
        ("sm_max_unacked", l.sm_max_unacked),
    ];
    for (name, v) in counts {
        // The store compares them with PostgreSQL integers.
        if v == 0 || v > i32::MAX as usize {
            return bad(&format!(
                "[limits] {name} must be between 1 and {}",
                i32::MAX
            ));
        }
    }
    Ok(())
}

/// The `[limits]` byte and message budgets of offline storage.
fn validate_offline_bytes(l: &LimitsConfig) -> Result<(), ConfigError> {
    let bad = |m: &str| Err(ConfigError::Invalid(m.to_owned()));
    let offline_bytes = [
        ("max_offline_bytes", l.max_offline_bytes, 1),
        (
            "max_offline_bytes_per_sender",
            l.max_offline_bytes_per_sender,
            1,
        ),
        (
            "max_offline_bytes_per_stranger",
            l.max_offline_bytes_per_stranger,
            0,
        ),
        (
            "max_offline_messages_per_stranger",
            l.max_offline_messages_per_stranger,
            0,
        ),
    ];
    for (name, v, min) in offline_bytes {
        // Compared with PostgreSQL bigint sums; a stranger's share may be 0 (none kept).
        if v < min || v > i64::MAX as usize {
            return bad(&format!(
                "[limits] {name} must be between {min} and {}",
                i64::MAX
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn example_config_parses_and_matches_defaults() {
        let text = include_str!("../presenced.example.toml");
        let c = Config::parse(text).expect("example config parses");
        c.validate().expect("example config is valid");
        let d = Config::default();
        assert_eq!(c.limits.max_stanza_size, d.limits.max_stanza_size);
        assert_eq!(c.limits.negotiation_timeout, d.limits.negotiation_timeout);
        assert_eq!(c.limits.max_stanza_nodes, d.limits.max_stanza_nodes);
        assert_eq!(
            c.limits.max_stanza_nodes_unauthenticated,
            d.limits.max_stanza_nodes_unauthenticated
        );
        assert_eq!(c.limits.max_attributes, d.limits.max_attributes);
        assert_eq!(
            c.limits.max_namespace_declarations,
            d.limits.max_namespace_declarations
        );
        assert_eq!(c.c2s.port, d.c2s.port);
        assert_eq!(
            (c.tls.tickets, &c.tls.ticket_secret, c.tls.ticket_rotation),
            (d.tls.tickets, &d.tls.ticket_secret, d.tls.ticket_rotation)
        );
        assert_eq!(c.auth.scram_iterations, d.auth.scram_iterations);
        assert_eq!(
            c.auth.registrations_per_ip_per_hour,
            d.auth.registrations_per_ip_per_hour
        );
        assert_eq!(c.auth.registrations_per_hour, d.auth.registrations_per_hour);
        assert_eq!(c.liveness.ttl, d.liveness.ttl);
        assert_eq!(c.liveness.heartbeat_interval, d.liveness.heartbeat_interval);
        assert_eq!(c.liveness.redis_refresh, d.liveness.redis_refresh);
        assert_eq!(c.http.websocket_path, d.http.websocket_path);
        assert_eq!(c.redis.timeout, d.redis.timeout);
        assert_eq!(c.s2s.port, d.s2s.port);
        assert_eq!(c.s2s.queue_size, d.s2s.queue_size);
        assert_eq!(c.s2s.stale_grace, d.s2s.stale_grace);
        assert_eq!(c.s2s.idle_timeout, d.s2s.idle_timeout);
        assert_eq!(c.s2s.connect_timeout, d.s2s.connect_timeout);
        assert_eq!(c.s2s.reconnect_min_ms, d.s2s.reconnect_min_ms);
        assert_eq!(c.s2s.reconnect_max_ms, d.s2s.reconnect_max_ms);
        assert_eq!(c.s2s.nameserver, d.s2s.nameserver);
        assert_eq!(c.liveness, d.liveness);
        assert_eq!(c.redis.reconnect_max, d.redis.reconnect_max);
        assert_eq!(c.database.gate_cache_secs, d.database.gate_cache_secs);
        assert_eq!(
            c.database.sqlite_busy_timeout,
            d.database.sqlite_busy_timeout
        );
        assert_eq!(
            c.database.change_poll_interval,
            d.database.change_poll_interval
        );
        assert_eq!(
            c.database.migrations.file_name(),
            d.database.migrations.file_name()
        );
        let (cl, dl) = (&c.limits, &d.limits);
        assert_eq!(cl.max_roster_items, dl.max_roster_items);
        assert_eq!(cl.max_roster_groups, dl.max_roster_groups);
        assert_eq!(cl.max_roster_group_length, dl.max_roster_group_length);
        assert_eq!(cl.max_roster_name_length, dl.max_roster_name_length);
        assert_eq!(cl.max_pending_subscriptions, dl.max_pending_subscriptions);
        assert_eq!(
            cl.max_subscription_status_length,
            dl.max_subscription_status_length
        );
        assert_eq!(cl.max_resources_per_account, dl.max_resources_per_account);
        assert_eq!(cl.max_blocklist_items, dl.max_blocklist_items);
        assert_eq!(cl.max_directed_presences, dl.max_directed_presences);
        assert_eq!(cl.max_revealed_per_session, dl.max_revealed_per_session);
        assert_eq!(cl.max_offline_messages, dl.max_offline_messages);
        assert_eq!(cl.max_offline_bytes, dl.max_offline_bytes);
        assert_eq!(
            cl.max_offline_messages_per_sender,
            dl.max_offline_messages_per_sender
        );
        assert_eq!(
            cl.max_offline_bytes_per_sender,
            dl.max_offline_bytes_per_sender
        );
        assert_eq!(
            cl.max_offline_messages_per_stranger,
            dl.max_offline_messages_per_stranger
        );
        assert_eq!(
            cl.max_offline_bytes_per_stranger,
            dl.max_offline_bytes_per_stranger
        );
        assert_eq!(cl.max_pep_nodes, dl.max_pep_nodes);
        assert_eq!(cl.max_pep_items, dl.max_pep_items);
        assert_eq!(cl.max_pep_bytes, dl.max_pep_bytes);
        assert_eq!(cl.max_pep_item_size, dl.max_pep_item_size);
        assert_eq!(cl.max_vcard_size, dl.max_vcard_size);
        assert_eq!(cl.max_avatar_hash_entries, dl.max_avatar_hash_entries);
        assert_eq!(cl.avatar_hash_ttl, dl.avatar_hash_ttl);
        assert_eq!(cl.max_caps_entries, dl.max_caps_entries);
        assert_eq!(cl.max_connections_per_ip, dl.max_connections_per_ip);
        assert_eq!(
            cl.max_caps_queries_per_session,
            dl.max_caps_queries_per_session
        );
        assert_eq!(cl.caps_query_timeout, dl.caps_query_timeout);
        assert_eq!(cl.max_csi_held_presences, dl.max_csi_held_presences);
        assert_eq!(cl.max_interest_items, dl.max_interest_items);
        assert_eq!(cl.interest_ttl, dl.interest_ttl);
        assert_eq!(cl.sm_resume_timeout, dl.sm_resume_timeout);
        assert_eq!(cl.sm_max_unacked, dl.sm_max_unacked);
        assert_eq!(cl.sm_max_unacked_bytes, dl.sm_max_unacked_bytes);
        assert_eq!(cl.session_queue_bytes, dl.session_queue_bytes);
        assert_eq!(cl.max_csi_held_bytes, dl.max_csi_held_bytes);
        assert_eq!(
            cl.max_csi_held_bytes_per_sender,
            dl.max_csi_held_bytes_per_sender
        );
    }

    #[test]
    fn per_account_limits_must_be_positive() {
        let mut c = Config::default();
        c.limits.max_roster_groups = 0;
        assert!(c.validate().is_err());
        let mut c = Config::default();
        c.limits.max_resources_per_account = 0;
        assert!(c.validate().is_err());
        let mut c = Config::default();
        c.limits.max_pending_subscriptions = usize::MAX;
        assert!(c.validate().is_err());
        let mut c = Config::default();
        c.limits.max_directed_presences = 0;
        assert!(c.validate().is_err());
        let mut c = Config::default();
        c.limits.max_revealed_per_session = c.limits.max_roster_items as usize - 1;
        assert!(c.validate().is_err());
        for zero in [
            |l: &mut LimitsConfig| l.max_offline_messages = 0,
            |l: &mut LimitsConfig| l.max_offline_bytes = 0,
            |l: &mut LimitsConfig| l.max_offline_messages_per_sender = 0,
            |l: &mut LimitsConfig| l.max_offline_bytes_per_sender = 0,
            |l: &mut LimitsConfig| l.max_csi_held_presences = 0,
            |l: &mut LimitsConfig| l.max_interest_items = 0,
            |l: &mut LimitsConfig| l.interest_ttl = Duration::ZERO,
            |l: &mut LimitsConfig| l.sm_max_unacked = 0,
        ] {
            let mut c = Config::default();
            zero(&mut c.limits);
            assert!(c.validate().is_err());
        }
        // Kept messages are queued together at login: they must fit the session's mailbox.
        let mut c = Config::default();
        c.limits.max_offline_messages = c.limits.session_queue;
        assert!(c.validate().is_err());
        c.limits.max_offline_messages = c.limits.session_queue - 1;
        assert!(c.validate().is_ok());
        // Byte budgets: any one stanza fits a session's queues; a sender's share fits the
        // session's holding.
        for bad in [
            |l: &mut LimitsConfig| l.session_queue_bytes = 2 * l.max_stanza_size - 1,
            |l: &mut LimitsConfig| l.sm_max_unacked_bytes = 2 * l.max_stanza_size - 1,
            |l: &mut LimitsConfig| l.max_csi_held_bytes_per_sender = 0,
            |l: &mut LimitsConfig| l.max_csi_held_bytes_per_sender = l.max_csi_held_bytes + 1,
        ] {
            let mut c = Config::default();
            bad(&mut c.limits);
            assert!(c.validate().is_err());
        }
    }

    #[test]
    fn static_routes_name_a_starttls_or_a_direct_tls_port() {
        let route = |host: &str, port, direct_tls| {
            Ok(Route {
                host: host.into(),
                port,
                direct_tls,
            })
        };
        assert_eq!("127.0.0.1:15269".parse(), route("127.0.0.1", 15269, false));
        assert_eq!(
            "xmpps://127.0.0.1:5270".parse(),
            route("127.0.0.1", 5270, true)
        );
        assert_eq!("xmpps://[::1]:5270".parse(), route("::1", 5270, true));
        assert_eq!(
            "xmpp.other.example:5269".parse(),
            route("xmpp.other.example", 5269, false)
        );
        for bad in [
            "127.0.0.1",
            "tls://127.0.0.1:5270",
            ":5269",
            "host:port",
            "xmpps://",
        ] {
            assert!(bad.parse::<Route>().is_err(), "{bad}");
        }
        let err = Config::parse("[s2s.routes]\n\"x.example\" = \"xmpps:/127.0.0.1:1\"")
            .expect_err("a malformed route is refused at start")
            .to_string();
        assert!(
            err.contains("[s2s] routes") && err.contains("xmpps:/127.0.0.1:1"),
            "{err}"
        );
    }

    #[test]
    fn nameserver_is_the_system_resolver_none_or_one_address() {
        let ns = |v: &str| {
            Config::parse(&format!("[s2s]\nnameserver = \"{v}\"")).map(|c| c.s2s.nameserver)
        };
        assert_eq!(ns("").unwrap(), Nameserver::System);
        assert_eq!(ns("none").unwrap(), Nameserver::Disabled);
        assert_eq!(
            ns("127.0.0.1:5300").unwrap(),
            Nameserver::Server("127.0.0.1:5300".parse().unwrap())
        );
        for bad in ["None", "127.0.0.1", "dns.example:53"] {
            let err = ns(bad).expect_err(bad).to_string();
            assert!(
                err.contains("[s2s] nameserver") && err.contains(bad),
                "{err}"
            );
        }
    }

    #[test]
    fn durations_are_seconds_or_milliseconds_and_never_negative() {
        let c = Config::parse(
            "[limits]\nnegotiation_timeout = 1.5\n[s2s]\nidle_timeout = 2\nreconnect_min_ms = 250\n[redis]\ntimeout = 0.25",
        )
        .expect("parses");
        assert_eq!(c.limits.negotiation_timeout, Duration::from_millis(1500));
        assert_eq!(c.s2s.idle_timeout, Duration::from_secs(2));
        assert_eq!(c.s2s.reconnect_min_ms, Duration::from_millis(250));
        assert_eq!(c.redis.timeout, Duration::from_millis(250));
        for (table, key, v) in [
            ("liveness", "ttl", "-1"),
            ("liveness", "grace", "-0.5"),
            ("liveness", "heartbeat_interval", "nan"),
            ("redis", "timeout", "inf"),
            ("s2s", "reconnect_max_ms", "-5"),
            ("database", "gate_cache_secs", "\"30\""),
        ] {
            let err = Config::parse(&format!("[{table}]\n{key} = {v}"))
                .expect_err(key)
                .to_string();
            // The error shows the offending line, so it names the key.
            assert!(err.contains(key), "{key}: {err}");
        }
        let mut c = Config::default();
        c.liveness.heartbeat_interval = Duration::ZERO;
        let err = c.validate().expect_err("zero H").to_string();
        assert!(err.contains("heartbeat_interval"), "{err}");
    }

    #[test]
    fn ticket_settings_have_defaults_and_bounds() {
        let c = Config::parse("[tls]\nticket_secret = \"\"").expect("parses");
        assert!(c.tls.tickets);
        assert_eq!(c.tls.ticket_secret, None);
        assert_eq!(c.tls.ticket_rotation, Duration::from_secs(43200));
        let c = Config::parse(
            "[tls]\ntickets = false\nticket_secret = \"0123456789abcdef\"\nticket_rotation = 3600",
        )
        .expect("parses");
        assert!(!c.tls.tickets);
        assert_eq!(c.tls.ticket_secret.as_deref(), Some("0123456789abcdef"));
        assert_eq!(c.tls.ticket_rotation, Duration::from_secs(3600));
        c.validate().expect("valid");
        for (secret, rotation, what) in [
            ("short", 3600, "ticket_secret"),
            ("0123456789abcdef", 59, "ticket_rotation"),
            ("0123456789abcdef", 604_801, "ticket_rotation"),
        ] {
            let mut c = Config::default();
            c.tls.ticket_secret = Some(secret.into());
            c.tls.ticket_rotation = Duration::from_secs(rotation);
            let err = c.validate().expect_err(what).to_string();
            assert!(err.contains(what), "{err}");
        }
    }

    #[test]
    fn fast_settings_have_defaults_and_bounds() {
        let c = Config::parse("[auth]\nfast_secret = \"\"").expect("parses");
        assert!(c.auth.fast);
        assert_eq!(c.auth.fast_secret, None);
        assert_eq!(c.auth.fast_token_lifetime, Duration::from_secs(21 * 86400));
        assert_eq!(c.auth.fast_token_rotation, Duration::from_secs(86400));
        assert_eq!(c.auth.max_fast_clients, 32);
        c.validate().expect("valid");
        let cases: [(&str, u64, u64, u32, &str); 5] = [
            ("short", 3600, 60, 1, "fast_secret"),
            ("0123456789abcdef", 59, 30, 1, "fast_token_lifetime"),
            (
                "0123456789abcdef",
                366 * 86400,
                60,
                1,
                "fast_token_lifetime",
            ),
            ("0123456789abcdef", 3600, 3600, 1, "fast_token_rotation"),
            ("0123456789abcdef", 3600, 60, 0, "max_fast_clients"),
        ];
        for (secret, lifetime, rotation, clients, what) in cases {
            let mut c = Config::default();
            c.auth.fast_secret = Some(secret.into());
            c.auth.fast_token_lifetime = Duration::from_secs(lifetime);
            c.auth.fast_token_rotation = Duration::from_secs(rotation);
            c.auth.max_fast_clients = clients;
            let err = c.validate().expect_err(what).to_string();
            assert!(err.contains(what), "{err}");
        }
    }

    #[test]
    fn empty_strings_mean_unset_and_relative_paths_follow_the_file() {
        let c =
            Config::parse("[tls]\ncert = \"\"\nkey = \"\"\n[s2s]\nsecret = \"\"\nca_file = \"\"")
                .expect("parses");
        assert_eq!((c.tls.cert, c.tls.key), (None, None));
        assert_eq!((c.s2s.secret, c.s2s.ca_file), (None, None));
        let mut c = Config::parse(
            "[tls]\ncert = \"c.pem\"\nkey = \"/k.pem\"\n[s2s]\nsecret = \"s\"\nca_file = \"ca.pem\"",
        )
        .expect("parses");
        c.resolve_paths(Path::new("/etc/presenced"));
        assert_eq!(c.tls.cert, Some(PathBuf::from("/etc/presenced/c.pem")));
        assert_eq!(c.tls.key, Some(PathBuf::from("/k.pem")));
        assert_eq!(c.s2s.ca_file, Some(PathBuf::from("/etc/presenced/ca.pem")));
        assert_eq!(c.s2s.secret.as_deref(), Some("s"));
        c.tls.key = None;
        assert!(c.validate().is_err(), "cert without key");
    }

    #[test]
    fn unknown_keys_are_refused() {
        assert!(Config::parse("[limits]\nmax_stanza_sise = 5").is_err());
    }

    #[test]
    fn environment_overrides_urls() {
        let mut c = Config::default();
        c.apply_env(|k| (k == "DATABASE_URL").then(|| "postgres://x/y".to_owned()));
        assert_eq!(c.database.url, "postgres://x/y");
        assert_eq!(c.redis.url, RedisConfig::default().url);
        // An empty REDIS_URL keeps the file's choice, like an absent one.
        c.apply_env(|k| (k == "REDIS_URL").then(String::new));
        assert_eq!(c.redis.url, "");
        c.apply_env(|k| (k == "REDIS_URL").then(|| "redis://127.0.0.1:1".to_owned()));
        assert_eq!(c.redis.url, "redis://127.0.0.1:1");
    }

    #[test]
    fn redis_url_is_optional_and_checked_when_given() {
        let c = Config::parse("[redis]\nkey_prefix = \"p:\"").expect("parses");
        assert_eq!(c.redis.url, "", "absent: liveness runs in process");
        c.validate().expect("valid without Redis");
        let c = Config::parse("[redis]\nurl = \"redis://127.0.0.1:6379/2\"").unwrap();
        c.validate().expect("a Redis URL is valid");
        let c = Config::parse("[redis]\nurl = \"http://127.0.0.1:6379\"").unwrap();
        let err = c.validate().expect_err("not a Redis URL").to_string();
        assert!(err.contains("[redis] url"), "{err}");
    }

    #[test]
    fn ttl_not_above_heartbeat_plus_refresh_plus_slack_is_invalid() {
        let mut c = Config::default();
        c.liveness.heartbeat_interval = Duration::from_secs(30);
        c.liveness.redis_refresh = Duration::from_secs(33);
        c.liveness.ttl = Duration::from_secs(70); // 30 + 33 + 7 = 70: no room left
        let err = c.validate().expect_err("no room").to_string();
        assert!(err.contains("[liveness] ttl (70)"), "{err}");
        c.liveness.ttl = Duration::from_secs(71);
        assert!(c.validate().is_ok());
    }

    #[test]
    fn fractional_liveness_timings_parse() {
        let c = Config::parse(
            "[liveness]\nheartbeat_interval = 0.2\nttl = 2.5\ngrace = 0.3\nredis_refresh = 0.5",
        )
        .expect("parses");
        c.validate().expect("valid");
        assert_eq!(c.liveness.heartbeat_interval, Duration::from_millis(200));
        assert_eq!(c.liveness.ttl, Duration::from_millis(2500));
    }

    #[test]
    fn stanza_cost_limits_are_validated() {
        let bad: [fn(&mut LimitsConfig); 4] = [
            |l| l.max_stanza_nodes_unauthenticated = 10,
            |l| l.max_stanza_nodes = l.max_stanza_nodes_unauthenticated - 1,
            |l| l.max_attributes = 8,
            |l| l.max_namespace_declarations = 2,
        ];
        for tweak in bad {
            let mut c = Config::default();
            tweak(&mut c.limits);
            assert!(c.validate().is_err(), "{:?}", c.limits);
        }
        let mut c = Config::default();
        c.limits.max_stanza_nodes_unauthenticated = 32;
        c.limits.max_stanza_nodes = 32;
        c.limits.max_attributes = 16;
        c.limits.max_namespace_declarations = 8;
        assert!(c.validate().is_ok());
    }

    #[test]
    fn tiny_stanza_limit_is_invalid() {
        let mut c = Config::default();
        c.limits.max_stanza_size = 100;
        assert!(c.validate().is_err());
    }

    #[test]
    fn sqlite_waits_and_change_polling_are_bounded() {
        let mut c = Config::default();
        c.validate().expect("defaults are valid");
        for (busy, poll, ok) in [
            (0.001, 0.01, true),
            (600.0, 1.0, true),
            (0.0, 0.25, false),
            (601.0, 0.25, false),
            (5.0, 0.0, false),
            (5.0, 1.5, false),
        ] {
            c.database.sqlite_busy_timeout = Duration::from_secs_f64(busy);
            c.database.change_poll_interval = Duration::from_secs_f64(poll);
            assert_eq!(c.validate().is_ok(), ok, "busy {busy} poll {poll}");
        }
        let c = Config::parse("[database]\nurl = \"sqlite://\"").unwrap();
        assert!(c.validate().is_err(), "sqlite:// without a file");
        let mut c = Config::default();
        for (readers, cache, ok) in [
            (1, 64, true),
            (256, 1_048_576, true),
            (0, 512, false),
            (257, 512, false),
            (4, 63, false),
            (4, 1_048_577, false),
        ] {
            c.database.sqlite_readers = readers;
            c.database.sqlite_cache_kib = cache;
            assert_eq!(c.validate().is_ok(), ok, "readers {readers} cache {cache}");
        }
    }

    #[test]
    fn a_relative_sqlite_file_is_relative_to_the_config_file() {
        let mut c = Config::parse("[database]\nurl = \"sqlite://data/p.db?mode=rwc\"").unwrap();
        c.resolve_paths(Path::new("/etc/presenced"));
        assert_eq!(c.database.url, "sqlite:///etc/presenced/data/p.db?mode=rwc");
        let mut c = Config::parse("[database]\nurl = \"sqlite:///var/p.db\"").unwrap();
        c.resolve_paths(Path::new("/etc/presenced"));
        assert_eq!(c.database.url, "sqlite:///var/p.db");
    }

    #[test]
    fn gate_cache_age_must_be_a_finite_non_negative_number_of_seconds() {
        let mut c = Config::default();
        for ok in [0, 30, 86_400] {
            c.database.gate_cache_secs = Duration::from_secs(ok);
            c.validate().expect("valid");
        }
        c.database.gate_cache_secs = Duration::from_secs(86_401);
        let err = c.validate().expect_err("a day and a second").to_string();
        assert!(err.contains("gate_cache_secs"), "{err}");
        for bad in ["-1", "nan", "inf"] {
            assert!(
                Config::parse(&format!("[database]\ngate_cache_secs = {bad}")).is_err(),
                "{bad} accepted"
            );
        }
    }
}

#[cfg(test)]
mod cluster_tests {
    use super::*;

    #[test]
    fn the_node_id_defaults_to_host_and_port_and_is_checked() {
        let mut c = Config::default();
        c.c2s.port = 5222;
        let checked = c.clone().check().expect("valid");
        let id = checked.cluster.node().to_owned();
        assert!(id.ends_with("-5222"), "{id}");
        assert_eq!(c.clone().check().unwrap().cluster.node(), id, "stable");
        for bad in ["has space", "", &"x".repeat(65), "a/b"] {
            let mut c = Config::default();
            c.cluster.node_id = Some(bad.to_owned());
            assert!(c.validate().is_err(), "{bad:?}");
        }
        let parsed = Config::parse("[cluster]\nnode_id = \"\"\n").unwrap();
        assert_eq!(parsed.cluster.node_id, None, "empty means derived");
        let mut c = Config::default();
        c.cluster.max_recipients_per_message = 0;
        assert!(c.validate().is_err());
    }
}
