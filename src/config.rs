//! Typed TOML configuration. Every limit and timing the server enforces is a field here with
//! a default; `presenced.example.toml` at the top of the repository lists them all.
//!
//! `DATABASE_URL` and `REDIS_URL` in the environment override the file, so CI and containers
//! can point one config at another database without editing it.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

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
#[derive(Debug, Clone, Deserialize)]
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
    /// The HTTP(S) listener: RFC 7395 WebSocket, XEP-0156 host-meta, /metrics.
    pub http: HttpConfig,
    /// Federation with other servers.
    pub s2s: S2sConfig,
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
        }
    }
}

/// `[c2s]`: where clients connect.
#[derive(Debug, Clone, Deserialize)]
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

/// `[tls]`: certificates, one pair per domain or one pair for all.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// PEM certificate chain. Empty: a self-signed certificate is generated into `certs_dir`.
    pub cert: String,
    /// PEM private key matching `cert`.
    pub key: String,
    /// Where generated development certificates are written (never committed).
    pub certs_dir: PathBuf,
}

impl Default for TlsConfig {
    fn default() -> Self {
        TlsConfig {
            cert: String::new(),
            key: String::new(),
            certs_dir: PathBuf::from("certs"),
        }
    }
}

/// `[database]`: PostgreSQL, the durable store.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// Connection URL; `DATABASE_URL` overrides it.
    pub url: String,
    /// Pool size.
    pub max_connections: u32,
    /// Directory of SQL migrations applied at start and by `presenced migrate`.
    pub migrations: PathBuf,
    /// Longest time, s, the privacy gate's broadcast inputs (roster, settings, blocks) of a
    /// user who changes presence are reused without a database read; writes and change
    /// notifications drop them at once (`store::audience_cache`). 0 reads on every change.
    pub gate_cache_secs: f64,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        DatabaseConfig {
            url: "postgres://postgres@127.0.0.1:5432/presenced".into(),
            max_connections: 16,
            migrations: PathBuf::from("migrations"),
            gate_cache_secs: 30.0,
        }
    }
}

/// `[redis]`: liveness and routing state.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedisConfig {
    /// Connection URL; `REDIS_URL` overrides it.
    pub url: String,
    /// Prepended to every key this server writes, so several deployments (or test runs)
    /// can share one Redis without seeing each other's keys.
    pub key_prefix: String,
    /// Seconds one Redis command may take before it counts as a failure; presence then
    /// degrades instead of stalling a session.
    pub timeout: f64,
    /// Longest wait, in seconds, between reconnection attempts (the backoff doubles from
    /// 0.1 s up to this).
    pub reconnect_max: f64,
}

impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            url: "redis://127.0.0.1:6379".into(),
            key_prefix: String::new(),
            timeout: 1.0,
            reconnect_max: 5.0,
        }
    }
}

/// `[liveness]`: how silence is turned into "unavailable". Times are seconds and may be
/// fractional (tests scale them down). See the seeds and DESIGN.md "Liveness numbers".
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LivenessConfig {
    /// H: after this much inbound silence the server pings the client (XEP-0199 on TCP,
    /// a WebSocket Ping on RFC 7395); any inbound traffic counts as a heartbeat.
    pub heartbeat_interval: f64,
    /// T: a resource whose last heartbeat is older than this is dead.
    pub ttl: f64,
    /// G: after a clean close or a dropped connection, wait this long before telling
    /// contacts; a reconnect of the same resource within it tells them nothing.
    pub grace: f64,
    /// Whether this node runs the sweeper (any number of nodes may; each stale resource is
    /// still handled once).
    pub sweeper: bool,
    /// How often this node runs the sweeper.
    pub sweep_interval: f64,
    /// Resources taken per sweeper call (the script is called again while batches are full).
    pub sweep_batch: usize,
    /// At most one Redis write per resource per this many seconds (default T/3): beats are
    /// held locally and the latest one is written when this much time has passed.
    pub redis_refresh: f64,
    /// Last-seen entries are written to PostgreSQL in one statement at most this often.
    pub last_seen_flush: f64,
    /// Number of beat ZSETs (`presence:beats:<shard>`), so one key does not grow without
    /// bound and sweeps spread out.
    pub beat_shards: u32,
    /// Seconds between log lines with the liveness counters (0 = never).
    pub metrics_log_interval: f64,
}

impl Default for LivenessConfig {
    fn default() -> Self {
        LivenessConfig {
            heartbeat_interval: 30.0,
            ttl: 100.0,
            grace: 10.0,
            sweeper: true,
            sweep_interval: 5.0,
            sweep_batch: 500,
            redis_refresh: 33.0,
            last_seen_flush: 1.0,
            beat_shards: 16,
            metrics_log_interval: 60.0,
        }
    }
}

/// `[http]`: one HTTP(S) listener for RFC 7395 WebSocket, XEP-0156 discovery and metrics.
#[derive(Debug, Clone, Deserialize)]
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
    /// Public URL advertised in host-meta (XEP-0156); empty derives
    /// `wss://<domain>:<port><websocket_path>` from the request's Host.
    pub websocket_url: String,
    /// Serve Prometheus counters at /metrics.
    pub metrics: bool,
    /// Largest HTTP request head in bytes.
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
            websocket_url: String::new(),
            metrics: true,
            max_request_head: 8192,
        }
    }
}

/// `[auth]`: SASL and registration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// Offer SASL PLAIN (only ever after TLS, RFC 6120 §13.8).
    pub allow_plain: bool,
    /// PBKDF2 iterations for newly stored SCRAM credentials (RFC 7677 §4 recommends ≥ 4096).
    pub scram_iterations: u32,
    /// XEP-0077 in-band registration of new accounts (off by default: spam).
    pub allow_registration: bool,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            allow_plain: true,
            scram_iterations: 4096,
            allow_registration: false,
        }
    }
}

/// `[limits]`: what one client may cost. Each violation gets the RFC 6120 error named here.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Largest stanza in bytes (policy-violation, RFC 6120 §13.12).
    pub max_stanza_size: usize,
    /// Deepest element nesting in a stanza (policy-violation).
    pub max_depth: usize,
    /// Seconds from TCP accept to a bound resource (connection-timeout, RFC 6120 §4.9.3.4).
    pub negotiation_timeout: u64,
    /// New connections accepted per source IP per minute, counted over every client-facing
    /// listener together (c2s and HTTP/WebSocket); more are closed with policy-violation
    /// (HTTP: 429) before any negotiation.
    pub connections_per_ip_per_minute: u32,
    /// Simultaneous client connections, c2s and HTTP/WebSocket together; more get
    /// resource-constraint (HTTP: 503).
    pub max_connections: usize,
    /// Roster items per user; a roster set beyond it gets not-allowed.
    pub max_roster_items: i64,
    /// Stanzas queued for one session before it is treated as stalled and disconnected.
    pub session_queue: usize,
    /// Stanzas per second a client may send on average (policy-violation beyond the burst).
    pub stanzas_per_second: u32,
    /// How many stanzas above the average rate may arrive at once.
    pub stanza_burst: u32,
    /// Failed SASL attempts on one stream before it is closed (RFC 6120 §6.4.5).
    pub max_auth_failures: u32,
    /// Failed password checks for one account, over every stream, that lock it.
    pub auth_backoff_failures: u32,
    /// Milliseconds a failure counts towards the lock after the previous one.
    pub auth_backoff_window_ms: u64,
    /// Milliseconds of the first lock; each further failure doubles it.
    pub auth_backoff_base_ms: u64,
    /// Longest lock in milliseconds.
    pub auth_backoff_max_ms: u64,
    /// Accounts the back-off table tracks at once (per node).
    pub auth_backoff_max_entries: usize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_stanza_size: 256 * 1024,
            max_depth: 64,
            negotiation_timeout: 30,
            connections_per_ip_per_minute: 120,
            max_connections: 18_000,
            max_roster_items: 1000,
            session_queue: 1024,
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
#[derive(Debug, Clone, Deserialize)]
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
    /// private deployments and tests; see [`parse_route`].
    pub routes: BTreeMap<String, String>,
    /// DNS for SRV lookups: "" uses the system resolver configuration, "none" disables DNS
    /// (only static routes work), `ip:port` uses that one name server only.
    pub nameserver: String,
    /// Dialback secret (XEP-0185 key derivation). Empty: a random one per start, which
    /// is correct for a single node (keys only need to verify while the stream is set up).
    pub secret: String,
    /// PEM file of certificate authorities trusted for peers' certificates, inbound (SASL
    /// EXTERNAL) and outbound. Empty: only `allow_self_signed` domains' certificates
    /// verify; other peers authenticate with dialback, where policy allows it.
    pub ca_file: String,
    /// Default policy for domains without an entry in `domains`.
    pub default_policy: S2sPolicy,
    /// Per-domain policy overrides.
    pub domains: BTreeMap<String, S2sPolicy>,
    /// Seconds without a stanza after which an outgoing stream is closed.
    pub idle_timeout: u64,
    /// Stanzas held per (local, remote) domain pair and not yet written or bounced, mostly
    /// while its stream connects; more are bounced at once with remote-server-timeout
    /// (RFC 6120 §8.3.3.17).
    pub queue_size: usize,
    /// Seconds to connect and authenticate an outgoing stream before its queue is bounced
    /// with remote-server-timeout (RFC 6120 §8.3.3.17).
    pub connect_timeout: u64,
    /// Shortest reconnect delay after a failure, in milliseconds. The n-th failure in a
    /// row waits a random time in [min·2^(n-1), min·2^n], clamped to [min, max]
    /// (`s2s::outbound::reconnect_delay`).
    pub reconnect_min_ms: u64,
    /// Longest reconnect delay, in milliseconds.
    pub reconnect_max_ms: u64,
    /// Seconds a lost federation link may stay down before local users see that domain's
    /// contacts as unavailable.
    pub stale_grace: u64,
    /// Average stanzas per second one inbound server stream may send.
    pub stanzas_per_second: u32,
    /// Burst above the average rate.
    pub stanza_burst: u32,
    /// Simultaneous inbound server connections; more are refused.
    pub max_connections: usize,
}

/// How much a remote domain must prove before its stanzas are accepted.
#[derive(Debug, Clone, Deserialize)]
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
            nameserver: String::new(),
            secret: String::new(),
            ca_file: String::new(),
            default_policy: S2sPolicy::default(),
            domains: BTreeMap::new(),
            idle_timeout: 600,
            queue_size: 1000,
            connect_timeout: 30,
            reconnect_min_ms: 1000,
            reconnect_max_ms: 60_000,
            stale_grace: 60,
            stanzas_per_second: 500,
            stanza_burst: 2000,
            max_connections: 1000,
        }
    }
}

/// Where a static route leads: `host:port` is a STARTTLS s2s port, `xmpps://host:port` a
/// direct TLS one (XEP-0368, the static counterpart of an `_xmpps-server._tcp` SRV
/// record). An IPv6 host is written in brackets (`[::1]:5269`). `None` when malformed.
pub fn parse_route(route: &str) -> Option<(String, u16, bool)> {
    let (rest, direct_tls) = match route.strip_prefix("xmpps://") {
        Some(rest) => (rest, true),
        None => (route, false),
    };
    let (host, port) = rest.rsplit_once(':')?;
    let host = host.trim_matches(['[', ']']);
    if host.is_empty() || host.contains('/') {
        return None;
    }
    Some((host.to_owned(), port.parse().ok()?, direct_tls))
}

impl S2sConfig {
    /// The policy for `domain`.
    pub fn policy(&self, domain: &str) -> &S2sPolicy {
        self.domains.get(domain).unwrap_or(&self.default_policy)
    }
}

impl Config {
    /// Reads, parses, applies the environment overrides and validates.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let mut config = Config::parse(&text).map_err(|source| ConfigError::Parse {
            path: path.to_owned(),
            source,
        })?;
        config.apply_env(|k| std::env::var(k).ok());
        config.normalize_domains();
        // Relative paths in the file are relative to the file, so `--config` works from anywhere.
        if let Some(dir) = path.parent() {
            config.resolve_paths(dir);
        }
        config.validate()?;
        Ok(config)
    }

    /// Parses TOML text without validating.
    pub fn parse(text: &str) -> Result<Config, toml::de::Error> {
        toml::from_str(text)
    }

    /// Domains are compared with normalised JIDs everywhere, so they are normalised too
    /// (RFC 7622 §3.2: `Example.ORG` is `example.org`).
    pub fn normalize_domains(&mut self) {
        for d in &mut self.domains {
            if let Ok(j) = crate::jid::BareJid::new(d) {
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
        if !self.s2s.ca_file.is_empty() && Path::new(&self.s2s.ca_file).is_relative() {
            self.s2s.ca_file = dir.join(&self.s2s.ca_file).to_string_lossy().into_owned();
        }
        for s in [&mut self.tls.cert, &mut self.tls.key] {
            if !s.is_empty() && Path::new(s.as_str()).is_relative() {
                *s = dir.join(s.as_str()).to_string_lossy().into_owned();
            }
        }
    }

    /// Checks ranges and consistency.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(m.to_owned()));
        if self.domains.is_empty() {
            return bad("`domains` must name at least one domain");
        }
        for d in &self.domains {
            if crate::jid::BareJid::new(d)
                .map(|j| j.node().is_some())
                .unwrap_or(true)
            {
                return bad(&format!("`{d}` is not a valid domain"));
            }
        }
        if self.tls.cert.is_empty() != self.tls.key.is_empty() {
            return bad("[tls] cert and key must be given together");
        }
        let l = &self.limits;
        if l.max_stanza_size < 10_000 {
            // RFC 6120 §13.12: servers must accept stanzas of at least 10000 bytes.
            return bad("[limits] max_stanza_size must be at least 10000 (RFC 6120 §13.12)");
        }
        if l.max_depth < 4 || l.negotiation_timeout == 0 || l.session_queue == 0 {
            return bad("[limits] max_depth >= 4, negotiation_timeout > 0, session_queue > 0");
        }
        if l.stanzas_per_second == 0 || l.max_auth_failures == 0 || l.max_roster_items <= 0 {
            return bad("[limits] rates and counts must be positive");
        }
        if l.auth_backoff_failures == 0
            || l.auth_backoff_window_ms == 0
            || l.auth_backoff_base_ms == 0
            || l.auth_backoff_max_ms < l.auth_backoff_base_ms
            || l.auth_backoff_max_entries == 0
        {
            return bad("[limits] auth_backoff_*: positive, base_ms <= max_ms");
        }
        self.validate_liveness()?;
        let s = &self.s2s;
        if s.queue_size == 0 || s.connect_timeout == 0 || s.idle_timeout == 0 {
            return bad("[s2s] queue_size, connect_timeout and idle_timeout must be positive");
        }
        if s.reconnect_min_ms == 0 || s.reconnect_max_ms < s.reconnect_min_ms {
            return bad("[s2s] 0 < reconnect_min_ms <= reconnect_max_ms");
        }
        if s.stanzas_per_second == 0 || s.max_connections == 0 {
            return bad("[s2s] stanzas_per_second and max_connections must be positive");
        }
        for (domain, addr) in &s.routes {
            if parse_route(addr).is_none() {
                return bad(&format!(
                    "[s2s] route for {domain}: `{addr}` is not host:port or xmpps://host:port"
                ));
            }
        }
        if !s.nameserver.is_empty()
            && s.nameserver != "none"
            && s.nameserver.parse::<std::net::SocketAddr>().is_err()
        {
            return bad("[s2s] nameserver must be \"\", \"none\" or ip:port");
        }
        if self.auth.scram_iterations < 4096 {
            return bad("[auth] scram_iterations must be at least 4096 (RFC 7677 §4)");
        }
        let g = self.database.gate_cache_secs;
        if !(g.is_finite() && (0.0..=86_400.0).contains(&g)) {
            return bad("[database] gate_cache_secs must be between 0 and 86400");
        }
        Ok(())
    }

    /// `[liveness]`, `[redis]` and `[http]` ranges. T must exceed H plus the refresh
    /// delay plus 10% slack: a live client's next beat comes at most H after the previous
    /// one and reaches Redis at most `redis_refresh` later; the slack absorbs network delay
    /// and a late beat (the seeds measured far fewer false flips with slack).
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
            if !(v.is_finite() && v > 0.0) {
                return bad(format!(
                    "[liveness] {name} must be a positive number of seconds"
                ));
            }
        }
        if !(l.grace.is_finite() && l.grace >= 0.0 && l.metrics_log_interval.is_finite()) {
            return bad("[liveness] grace and metrics_log_interval must be >= 0".into());
        }
        let slack = l.ttl / 10.0;
        if l.ttl <= l.heartbeat_interval + l.redis_refresh + slack {
            return bad(format!(
                "[liveness] ttl ({}) must exceed heartbeat_interval + redis_refresh + 10% slack ({})",
                l.ttl,
                l.heartbeat_interval + l.redis_refresh + slack
            ));
        }
        if l.grace >= l.ttl {
            return bad("[liveness] grace must be shorter than ttl".into());
        }
        if l.sweep_batch == 0 || l.sweep_batch > 5000 || l.beat_shards == 0 {
            return bad("[liveness] sweep_batch must be 1..=5000 and beat_shards > 0".into());
        }
        let r = &self.redis;
        if !(r.timeout.is_finite()
            && r.timeout > 0.0
            && r.reconnect_max.is_finite()
            && r.reconnect_max >= 0.1)
        {
            return bad("[redis] timeout > 0 and reconnect_max >= 0.1 seconds".into());
        }
        if !self.http.websocket_path.starts_with('/') || self.http.max_request_head < 512 {
            return bad(
                "[http] websocket_path must start with '/', max_request_head >= 512".into(),
            );
        }
        Ok(())
    }

    /// Whether this server hosts `domain`.
    pub fn serves(&self, domain: &str) -> bool {
        self.domains.iter().any(|d| d == domain)
    }
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
        assert_eq!(c.c2s.port, d.c2s.port);
        assert_eq!(c.auth.scram_iterations, d.auth.scram_iterations);
        assert_eq!(c.liveness.ttl, d.liveness.ttl);
        assert_eq!(c.liveness.heartbeat_interval, d.liveness.heartbeat_interval);
        assert_eq!(c.liveness.redis_refresh, d.liveness.redis_refresh);
        assert_eq!(c.http.websocket_path, d.http.websocket_path);
        assert_eq!(c.redis.timeout, d.redis.timeout);
        assert_eq!(c.s2s.port, d.s2s.port);
        assert_eq!(c.s2s.queue_size, d.s2s.queue_size);
        assert_eq!(c.s2s.stale_grace, d.s2s.stale_grace);
        assert_eq!(c.s2s.idle_timeout, d.s2s.idle_timeout);
    }

    #[test]
    fn static_routes_name_a_starttls_or_a_direct_tls_port() {
        assert_eq!(
            parse_route("127.0.0.1:15269"),
            Some(("127.0.0.1".into(), 15269, false))
        );
        assert_eq!(
            parse_route("xmpps://127.0.0.1:5270"),
            Some(("127.0.0.1".into(), 5270, true))
        );
        assert_eq!(
            parse_route("xmpps://[::1]:5270"),
            Some(("::1".into(), 5270, true))
        );
        assert_eq!(
            parse_route("xmpp.other.example:5269"),
            Some(("xmpp.other.example".into(), 5269, false))
        );
        for bad in [
            "127.0.0.1",
            "tls://127.0.0.1:5270",
            ":5269",
            "host:port",
            "xmpps://",
        ] {
            assert_eq!(parse_route(bad), None, "{bad}");
        }
        let mut c = Config::default();
        c.s2s
            .routes
            .insert("x.example".into(), "xmpps:/127.0.0.1:1".into());
        assert!(
            c.validate().is_err(),
            "a malformed route is refused at start"
        );
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
    }

    #[test]
    fn ttl_not_above_heartbeat_plus_refresh_plus_slack_is_invalid() {
        let mut c = Config::default();
        c.liveness.heartbeat_interval = 30.0;
        c.liveness.redis_refresh = 33.0;
        c.liveness.ttl = 70.0; // 30 + 33 + 7 = 70: no room left
        assert!(c.validate().is_err());
        c.liveness.ttl = 71.0;
        assert!(c.validate().is_ok());
    }

    #[test]
    fn fractional_liveness_timings_parse() {
        let c = Config::parse(
            "[liveness]\nheartbeat_interval = 0.2\nttl = 1.5\ngrace = 0.3\nredis_refresh = 0.5",
        )
        .expect("parses");
        c.validate().expect("valid");
        assert_eq!(c.liveness.heartbeat_interval, 0.2);
    }

    #[test]
    fn tiny_stanza_limit_is_invalid() {
        let mut c = Config::default();
        c.limits.max_stanza_size = 100;
        assert!(c.validate().is_err());
    }

    #[test]
    fn gate_cache_age_must_be_a_finite_non_negative_number_of_seconds() {
        let mut c = Config::default();
        for ok in [0.0, 30.0, 86_400.0] {
            c.database.gate_cache_secs = ok;
            c.validate().expect("valid");
        }
        for bad in [-1.0, f64::NAN, f64::INFINITY, 86_401.0] {
            c.database.gate_cache_secs = bad;
            assert!(c.validate().is_err(), "{bad} accepted");
        }
    }
}
