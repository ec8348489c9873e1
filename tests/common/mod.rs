//! Shared harness for integration tests: a real server (in-process, real sockets, real TLS,
//! real PostgreSQL) on ephemeral loopback ports with a domain of its own, and a small raw
//! XMPP client that lets a test send exact bytes and wait for exact stanzas.
//!
//! Each test starts its own server with a unique domain, so tests share the database
//! without seeing each other's accounts. `PRESENCED_TEST_STORE=sqlite` runs the servers of
//! a test binary on one SQLite file of its own instead of PostgreSQL. The client pins the server's generated
//! certificate, so TLS is verified for real, not switched off.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use presenced::app::server::{self, Running};
use presenced::config::Config;
use presenced::protocol::xml::reader::{ReaderLimits, StreamEvent, StreamReader};
use presenced::protocol::xml::{Element, NS_CLIENT};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::TcpStream;

pub mod stores;

/// The database integration tests use: with `PRESENCED_TEST_STORE=sqlite` one SQLite file
/// per test process (under the temporary directory), else `DATABASE_URL` or the
/// machine's `test` database.
pub fn database_url() -> String {
    static SQLITE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    if std::env::var("PRESENCED_TEST_STORE").as_deref() == Ok("sqlite") {
        return SQLITE.get_or_init(|| stores::Db::sqlite().url()).clone();
    }
    stores::Db::postgres().url()
}

/// A number a test takes from the environment variable `var` (a sample count, a port, a
/// case count), else `default` when it is unset or not a number.
pub fn env_or<T: std::str::FromStr>(var: &str, default: T) -> T {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The Redis integration tests use (`REDIS_URL`, else the machine's default instance).
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// With `RUST_LOG` set, the servers' logs go to the test's captured output (shown for a
/// failing test, or for all with `--nocapture`); without it, tests log nothing.
pub fn capture_logs() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_default_env() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_test_writer()
                .try_init();
        }
    });
}

/// Liveness timings scaled down for tests: H = 0.4 s, T = 2 s, G = 0.6 s, sweeps every
/// 0.2 s, Redis refresh every 0.6 s, last-seen flush every 0.2 s.
pub fn fast_liveness(c: &mut Config) {
    c.liveness.heartbeat_interval = Duration::from_millis(400);
    c.liveness.ttl = Duration::from_secs(2);
    c.liveness.grace = Duration::from_millis(600);
    c.liveness.sweep_interval = Duration::from_millis(200);
    c.liveness.redis_refresh = Duration::from_millis(600);
    c.liveness.last_seen_flush = Duration::from_millis(200);
    c.liveness.beat_shards = 2;
}

/// No `[redis] url`: liveness runs in process (a single node without Redis).
pub fn without_redis(c: &mut Config) {
    c.redis.url = String::new();
}

/// The repository's root: this harness is also compiled into the load generator's package
/// (bench/generator), whose manifest directory is below it.
pub fn repo_root() -> PathBuf {
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .ancestors()
        .find(|d| d.join("migrations").is_dir())
        .unwrap_or(manifest)
        .to_path_buf()
}

/// Records that `test` returned without checking anything, and why. cargo counts such a
/// test as passed; tests/run.sh sets `PRESENCED_SKIP_LOG` to a file and prints every line
/// of it at the end of the run, so a skip is seen, never taken for a pass.
pub fn skip(test: &str, why: &str) {
    let line = format!("SKIPPED {test}: {why}");
    eprintln!("{line}");
    if let Some(path) = std::env::var_os("PRESENCED_SKIP_LOG") {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = writeln!(f, "{line}");
        }
    }
}

/// The `[database] migrations` directory of every test server: one that never exists, so a
/// test run applies only the built-in schema and never the operator's own `migrations.d`
/// (whose files, written for one store's dialect, would change or break the test database).
pub fn no_operator_migrations() -> PathBuf {
    std::env::temp_dir().join("presenced-tests-have-no-operator-migrations")
}

/// A loopback port free at the time of the call (for a server that must come back on the
/// same port, or a child process told its port up front).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A port free on `ip` in the range `PRESENCED_TEST_PORTS` names (`low-high`), else one the
/// system picks: both servers' routes must name the other's port before either starts.
///
/// The port is bound and released, and the server binds it later, so it must not be handed
/// out twice: tests run in parallel, and the system may pick a just-released port again
/// for another caller (one test's server then failed to start with "address in use"). The
/// ports handed out in this process are remembered and never returned again.
pub fn listen_port(ip: &str) -> u16 {
    static GIVEN: std::sync::Mutex<Vec<(String, u16)>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let mut fresh = |p: u16| {
        let new = !given.iter().any(|(i, q)| i == ip && *q == p)
            && std::net::TcpListener::bind((ip, p)).is_ok();
        if new {
            given.push((ip.to_owned(), p));
        }
        new
    };
    let range = std::env::var("PRESENCED_TEST_PORTS").ok().and_then(|r| {
        let (lo, hi) = r.split_once('-')?;
        Some((lo.parse::<u16>().ok()?, hi.parse::<u16>().ok()?))
    });
    let Some((lo, hi)) = range else {
        // The system's pick; a few more tries if it repeats one already given.
        return (0..64)
            .map(|_| {
                std::net::TcpListener::bind((ip, 0))
                    .and_then(|l| l.local_addr())
                    .map(|a| a.port())
                    .expect("free port")
            })
            .find(|p| fresh(*p))
            .expect("a port not handed out before");
    };
    let span = u32::from(hi - lo) + 1;
    let start = u32::from_str_radix(&unique()[..6], 16).unwrap() % span;
    (0..span)
        .map(|i| lo + ((start + i) % span) as u16)
        .find(|p| fresh(*p))
        .expect("a free port in PRESENCED_TEST_PORTS")
}

/// A federated test server's s2s settings: its listener on `ip:port`, the dialback
/// `secret`, a static route to `peer` at `peer_addr`, quick reconnects and a short grace
/// (a closed stream is announced after it; the default is 10 s).
pub fn s2s_config(
    c: &mut presenced::config::Config,
    ip: &str,
    port: u16,
    secret: &str,
    peer: &str,
    peer_addr: String,
) {
    c.s2s.bind = ip.parse().unwrap();
    c.s2s.port = port;
    c.s2s.secret = Some(secret.into());
    c.s2s
        .routes
        .insert(peer.to_owned(), peer_addr.parse().expect("route"));
    c.s2s.stale_grace = Duration::from_secs(1);
    c.s2s.reconnect_min_ms = Duration::from_millis(100);
    c.s2s.reconnect_max_ms = Duration::from_millis(400);
    c.s2s.connect_timeout = Duration::from_secs(5);
    // A closed stream is announced after the grace period (default 10 s); these
    // tests watch logouts cross the link, so they run with a short one.
    c.liveness.grace = Duration::from_millis(300);
}

/// A short random token for unique names.
pub fn unique() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..10].to_owned()
}

/// A server under test.
pub struct TestServer {
    /// The running server.
    pub running: Option<Running>,
    /// Its only domain.
    pub domain: String,
    /// STARTTLS address.
    pub addr: std::net::SocketAddr,
    /// Direct TLS address.
    pub direct_addr: std::net::SocketAddr,
    /// The PEM certificate clients pin.
    pub cert: PathBuf,
    /// The configuration it runs with.
    pub config: Config,
}

impl TestServer {
    /// Starts a server with a fresh domain; `tweak` adjusts the config first.
    pub async fn start(tweak: impl FnOnce(&mut Config)) -> TestServer {
        let domain = format!("t{}.example", unique());
        TestServer::start_with_domain(&domain, tweak).await
    }

    /// Starts a server for `domain` (federation tests pick both domains up front so each
    /// server's static routes can name the other). The s2s listener is on loopback, on a
    /// port the system picks unless `tweak` sets one, and DNS is off: every remote domain
    /// must have a static route, so no test ever queries the machine's resolver.
    pub async fn start_with_domain(domain: &str, tweak: impl FnOnce(&mut Config)) -> TestServer {
        capture_logs();
        let domain = domain.to_owned();
        let certs = std::env::temp_dir().join(format!("presenced-test-{domain}"));
        let mut config = Config {
            domains: vec![domain.clone()],
            ..Config::default()
        };
        config.c2s.bind = "127.0.0.1".parse().unwrap();
        config.c2s.port = 0;
        config.c2s.direct_tls_port = 0;
        config.tls.certs_dir = certs.clone();
        config.database.url = database_url();
        config.database.max_connections = 4;
        // Every server of a test process shares one SQLite file and one writer at a time;
        // on a loaded machine a start-up migration may wait longer than the default.
        config.database.sqlite_busy_timeout = Duration::from_secs(60);
        // The SQLite change log is polled; tests that wait for the roster listener (its
        // barrier) should not wait a quarter of a second each time.
        config.database.change_poll_interval = Duration::from_millis(25);
        // The schema is built in; no operator migrations.
        config.database.migrations = no_operator_migrations();
        // Tests hammer one address; the per-IP limit has its own test.
        config.limits.connections_per_ip_per_minute = 10_000;
        // Each server gets its own Redis key prefix and an ephemeral loopback HTTP port, so
        // parallel tests share Redis without seeing each other's keys.
        config.redis.url = redis_url();
        config.redis.key_prefix = format!("test:{domain}:");
        config.http.bind = "127.0.0.1".parse().unwrap();
        config.http.port = 0;
        config.http.tls = false;
        config.admin.port = 0;
        config.admin.socket = None;
        config.s2s.bind = "127.0.0.1".parse().unwrap();
        config.s2s.port = 0;
        config.s2s.direct_tls_port = 0;
        config.s2s.nameserver = presenced::config::Nameserver::Disabled;
        tweak(&mut config);
        // On SQLite every server of a test process shares one file, and several starting at
        // once can find it locked while another applies its schema (a test-only situation:
        // a deployment has one server per file). Such a start is retried, a bounded number
        // of times; any other error fails the test at once.
        let mut attempt = 0u64;
        let running = loop {
            let checked = config.clone().check().expect("test config is valid");
            match server::start(checked).await {
                Ok(r) => break r,
                Err(e) if attempt < 20 && format!("{e:?}").contains("database is locked") => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(50 * attempt)).await;
                }
                Err(e) => panic!("server starts: {e:?}"),
            }
        };
        let cert = certs.join(format!("selfsigned-{domain}.pem"));
        TestServer {
            addr: running.c2s_addr.expect("c2s listener"),
            direct_addr: running.direct_tls_addr.unwrap_or(running.c2s_addr.unwrap()),
            running: Some(running),
            domain,
            cert,
            config,
        }
    }

    /// `name@domain`.
    pub fn jid(&self, name: &str) -> String {
        format!("{name}@{}", self.domain)
    }

    /// Creates an account through the store, as `presenced user add` does.
    pub async fn add_user(&self, name: &str, password: &str) {
        let shared = &self.running.as_ref().unwrap().shared;
        shared
            .store
            .create_account(name, &self.domain, password, 4096)
            .await
            .expect("create account");
    }

    /// Address of the s2s (STARTTLS) listener.
    pub fn s2s_addr(&self) -> std::net::SocketAddr {
        self.running
            .as_ref()
            .unwrap()
            .s2s
            .addr
            .expect("s2s listener")
    }

    /// Address of the s2s direct TLS listener (XEP-0368), when `[s2s] direct_tls` is on.
    pub fn s2s_direct_addr(&self) -> std::net::SocketAddr {
        self.running
            .as_ref()
            .unwrap()
            .s2s
            .direct_tls_addr
            .expect("s2s direct TLS listener")
    }

    /// The server's shared state.
    pub fn shared(&self) -> &Arc<server::Shared> {
        &self.running.as_ref().unwrap().shared
    }

    /// The running server's services.
    pub fn services(&self) -> &Arc<presenced::services::Services> {
        &self.running.as_ref().unwrap().services
    }

    /// Logs in `name` (password "pw") with resource `res` over STARTTLS and SASL PLAIN.
    pub async fn login(&self, name: &str, res: &str) -> Client {
        Client::login(self, name, "pw", res).await
    }

    /// Adds `name` with password "pw".
    pub async fn user(&self, name: &str) {
        self.add_user(name, "pw").await
    }

    /// How many XEP-0160 messages the store keeps for `owner` (a bare JID).
    pub async fn offline_count(&self, owner: &str) -> i64 {
        let store = &self.shared().store;
        let counted = match store.sqlite_pool() {
            Some(file) => {
                sqlx::query_scalar("SELECT count(*) FROM offline_messages WHERE owner = ?1")
                    .bind(owner)
                    .fetch_one(file)
                    .await
            }
            None => {
                sqlx::query_scalar("SELECT count(*) FROM offline_messages WHERE owner = $1")
                    .bind(owner)
                    .fetch_one(store.pool())
                    .await
            }
        };
        counted.expect("count offline messages")
    }

    /// Makes two local users mutual contacts (subscription both), as an operator would.
    pub async fn make_mutual(&self, a: &str, b: &str) {
        stores::make_mutual(&self.shared().store, &self.jid(a), &self.jid(b))
            .await
            .expect("make mutual");
    }

    /// Runs an operator's SQL on the server's store, `pg` or `lite` by its dialect.
    pub async fn sql(&self, pg: &str, lite: &str, binds: &[&str]) -> Result<u64, sqlx::Error> {
        stores::exec(&self.shared().store, pg, lite, binds).await
    }

    /// Removes `a` and `b` from each other's rosters with the SQL function operators use.
    pub async fn unpair(&self, a: &str, b: &str) {
        self.sql(
            "SELECT presenced_roster_unpair($1, $2)",
            "INSERT INTO presenced_roster_unpair (a, b) VALUES (?1, ?2)",
            &[&self.jid(a), &self.jid(b)],
        )
        .await
        .expect("unpair");
    }

    /// The HTTP listener's address.
    pub fn http_addr(&self) -> std::net::SocketAddr {
        self.running
            .as_ref()
            .and_then(|r| r.http_addr)
            .expect("http listener")
    }

    /// The operators' listener (`/metrics`).
    pub fn admin_addr(&self) -> std::net::SocketAddr {
        self.running
            .as_ref()
            .and_then(|r| r.admin_addr)
            .expect("admin listener")
    }

    /// A Redis connection to the server's Redis.
    pub async fn redis(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.config.redis.url.as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .expect("redis")
    }

    /// `GET /metrics` on the admin listener: every sample as `name{labels}` → value
    /// (comments skipped).
    pub async fn scrape_metrics(&self) -> std::collections::HashMap<String, f64> {
        let text = self.admin_get("/metrics").await;
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        body.lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                Some((k.to_owned(), v.parse().ok()?))
            })
            .collect()
    }

    /// The whole response (status line, headers, body) to `GET path` with `Host: host` on
    /// the HTTP listener, read until the server closes.
    pub async fn http_get(&self, path: &str, host: &str) -> String {
        get(self.http_addr(), path, host).await
    }

    /// The whole response to `GET path` on the admin listener.
    pub async fn admin_get(&self, path: &str) -> String {
        get(self.admin_addr(), path, "localhost").await
    }

    /// A liveness counter by name, read from the server's /metrics-backing counters.
    pub fn metric(&self, f: impl Fn(&presenced::liveness::Metrics) -> u64) -> u64 {
        f(&self.shared().liveness.metrics)
    }

    /// Stops the server.
    pub async fn stop(mut self) {
        if let Some(r) = self.running.take() {
            r.shutdown().await;
        }
    }
}

/// rustls client config trusting only the test server's certificate.
pub fn tls_client(cert: &PathBuf) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(cert).expect("cert file") {
        roots.add(c.expect("cert")).expect("add root");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Arc::new(
        rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

/// Transport of the raw client.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Io for T {}

/// A raw XMPP client: writes what it is told, parses what arrives.
pub struct Client {
    reader: StreamReader<ReadHalf<Box<dyn Io>>>,
    writer: WriteHalf<Box<dyn Io>>,
    /// Stanzas received while waiting for something else, in order.
    pub backlog: Vec<Element>,
    /// The bound full JID, once bound.
    pub jid: String,
    /// The stream header the server last sent.
    pub header: Option<presenced::protocol::xml::reader::StreamHeader>,
    /// Stream features the server last sent.
    pub features: Option<Element>,
}

/// How long a positive expectation waits before failing.
pub const WAIT: Duration = Duration::from_secs(5);

fn limits() -> ReaderLimits {
    // What the server writes: a roster result may hold thousands of elements.
    ReaderLimits::trusted(1 << 20, 64)
}

/// What ended a read.
#[derive(Debug)]
pub enum Ended {
    /// A `<stream:error/>` with this condition.
    StreamError(String),
    /// `</stream:stream>` or EOF.
    Closed,
    /// Nothing within the wait.
    Timeout,
}

impl Client {
    /// A plain TCP connection to the STARTTLS port, nothing sent yet.
    pub async fn tcp(server: &TestServer) -> Client {
        let tcp = TcpStream::connect(server.addr).await.expect("connect");
        tcp.set_nodelay(true).unwrap();
        Client::over(Box::new(tcp))
    }

    fn over(io: Box<dyn Io>) -> Client {
        let (r, w) = tokio::io::split(io);
        Client {
            reader: StreamReader::new(r, limits()),
            writer: w,
            backlog: Vec::new(),
            jid: String::new(),
            header: None,
            features: None,
        }
    }

    /// Writes raw bytes. A write the connection refuses fails the test: a check that went on
    /// after its stanza was never sent would prove nothing. Tests that write into a stream
    /// the server may already have closed use [`Client::try_send_raw`].
    pub async fn send_raw(&mut self, s: &str) {
        if let Err(e) = self.try_send_raw(s).await {
            panic!("{}: write failed: {e}", self.jid);
        }
    }

    /// Writes raw bytes and says whether the connection took them.
    pub async fn try_send_raw(&mut self, s: &str) -> std::io::Result<()> {
        self.writer.write_all(s.as_bytes()).await?;
        self.writer.flush().await
    }

    /// Writes a stanza.
    pub async fn send(&mut self, el: &Element) {
        self.send_raw(&el.to_xml()).await
    }

    /// Sends a stream header for `domain` and reads the answer header and features.
    pub async fn open(&mut self, domain: &str) -> Result<Element, Ended> {
        self.send_raw(&format!(
            "<?xml version='1.0'?><stream:stream xmlns='jabber:client' \
             xmlns:stream='http://etherx.jabber.org/streams' to='{domain}' version='1.0'>"
        ))
        .await;
        self.read_header_and_features().await
    }

    async fn read_header_and_features(&mut self) -> Result<Element, Ended> {
        loop {
            match self.next_event(WAIT).await? {
                StreamEvent::Open(h) => self.header = Some(h),
                StreamEvent::Stanza(el) if el.name == "features" => {
                    self.features = Some(el.clone());
                    return Ok(el);
                }
                StreamEvent::Stanza(el) if el.name == "error" => {
                    return Err(Ended::StreamError(condition(&el)))
                }
                StreamEvent::Stanza(el) => self.backlog.push(el),
                StreamEvent::Whitespace => {}
                StreamEvent::Close => return Err(Ended::Closed),
            }
        }
    }

    async fn next_event(&mut self, wait: Duration) -> Result<StreamEvent, Ended> {
        match tokio::time::timeout(wait, self.reader.next()).await {
            Err(_) => Err(Ended::Timeout),
            Ok(Ok(ev)) => Ok(ev),
            Ok(Err(_)) => Err(Ended::Closed),
        }
    }

    /// STARTTLS (pinning the test certificate) and a new stream header.
    pub async fn starttls(self, server: &TestServer) -> Client {
        self.starttls_with(server, tls_client(&server.cert)).await.0
    }

    /// STARTTLS with the client configuration `tls` (whose session cache a test may keep
    /// across connections) and a new stream header; and how the handshake went.
    pub async fn starttls_with(
        mut self,
        server: &TestServer,
        tls: Arc<rustls::ClientConfig>,
    ) -> (Client, Option<rustls::HandshakeKind>) {
        self.send_raw("<starttls xmlns='urn:ietf:params:xml:ns:xmpp-tls'/>")
            .await;
        let proceed = self.next_stanza(WAIT).await.expect("proceed");
        assert_eq!(proceed.name, "proceed", "{proceed}");
        let Client { reader, writer, .. } = self;
        let io = reader.into_inner().unsplit(writer);
        let connector = tokio_rustls::TlsConnector::from(tls);
        let name = ServerName::try_from(server.domain.clone()).unwrap();
        let tls = connector.connect(name, io).await.expect("TLS handshake");
        let kind = tls.get_ref().1.handshake_kind();
        let mut c = Client::over(Box::new(tls));
        c.open(&server.domain).await.expect("stream after TLS");
        (c, kind)
    }

    /// STARTTLS as [`Client::starttls_with`], handing back also what `inspect` reads off the
    /// client's TLS connection (its version, its exporter) once the handshake is done.
    pub async fn starttls_inspect<T>(
        mut self,
        server: &TestServer,
        tls: Arc<rustls::ClientConfig>,
        inspect: impl FnOnce(&rustls::ClientConnection) -> T,
    ) -> (Client, T) {
        self.send_raw("<starttls xmlns='urn:ietf:params:xml:ns:xmpp-tls'/>")
            .await;
        let proceed = self.next_stanza(WAIT).await.expect("proceed");
        assert_eq!(proceed.name, "proceed", "{proceed}");
        let Client { reader, writer, .. } = self;
        let io = reader.into_inner().unsplit(writer);
        let connector = tokio_rustls::TlsConnector::from(tls);
        let name = ServerName::try_from(server.domain.clone()).unwrap();
        let tls = connector.connect(name, io).await.expect("TLS handshake");
        let seen = inspect(tls.get_ref().1);
        let mut c = Client::over(Box::new(tls));
        c.open(&server.domain).await.expect("stream after TLS");
        (c, seen)
    }

    /// A direct TLS (XEP-0368) connection with the stream opened.
    pub async fn direct_tls(server: &TestServer) -> Client {
        Client::direct_tls_with(server, tls_client(&server.cert))
            .await
            .0
    }

    /// A direct TLS connection made with the client configuration `tls`, with the stream
    /// opened (which also reads the session tickets sent after the handshake); and how the
    /// handshake went.
    pub async fn direct_tls_with(
        server: &TestServer,
        tls: Arc<rustls::ClientConfig>,
    ) -> (Client, Option<rustls::HandshakeKind>) {
        let tcp = TcpStream::connect(server.direct_addr)
            .await
            .expect("connect");
        let connector = tokio_rustls::TlsConnector::from(tls);
        let name = ServerName::try_from(server.domain.clone()).unwrap();
        let tls = connector.connect(name, tcp).await.expect("TLS handshake");
        let kind = tls.get_ref().1.handshake_kind();
        let mut c = Client::over(Box::new(tls));
        c.open(&server.domain).await.expect("stream");
        (c, kind)
    }

    /// SASL PLAIN; returns the name of the top-level answer (success or failure).
    pub async fn auth_plain(&mut self, user: &str, password: &str) -> Element {
        let msg = base64::engine::general_purpose::STANDARD.encode(format!("\0{user}\0{password}"));
        self.send_raw(&format!(
            "<auth xmlns='urn:ietf:params:xml:ns:xmpp-sasl' mechanism='PLAIN'>{msg}</auth>"
        ))
        .await;
        self.next_stanza(WAIT).await.expect("SASL answer")
    }

    /// Binds `resource` ("" lets the server choose); returns the bound JID or the error iq.
    pub async fn bind(&mut self, resource: &str) -> Result<String, Element> {
        let res = if resource.is_empty() {
            String::new()
        } else {
            format!("<resource>{resource}</resource>")
        };
        self.send_raw(&format!(
            "<iq type='set' id='bind1'><bind xmlns='urn:ietf:params:xml:ns:xmpp-bind'>{res}</bind></iq>"
        ))
        .await;
        let reply = self
            .expect(|e| e.name == "iq" && e.get_attr("id") == Some("bind1"))
            .await;
        if reply.get_attr("type") != Some("result") {
            return Err(reply);
        }
        let jid = reply
            .elements()
            .next()
            .and_then(|b| b.elements().next())
            .map(|j| j.text_content())
            .unwrap_or_default();
        self.jid = jid.clone();
        Ok(jid)
    }

    /// Connects and authenticates `name` (password "pw"), stopping before resource binding.
    pub async fn authenticated(server: &TestServer, name: &str) -> Client {
        let mut c = Client::tcp(server).await;
        c.open(&server.domain).await.expect("stream");
        let mut c = c.starttls(server).await;
        let ok = c.auth_plain(name, "pw").await;
        assert_eq!(ok.name, "success", "{ok}");
        c.restart_stream();
        c.open(&server.domain).await.expect("stream after SASL");
        c
    }

    /// Connects, STARTTLS, PLAIN, restart and bind.
    pub async fn login(server: &TestServer, user: &str, password: &str, resource: &str) -> Client {
        let mut c = Client::tcp(server).await;
        c.open(&server.domain).await.expect("stream");
        let mut c = c.starttls(server).await;
        let ok = c.auth_plain(user, password).await;
        assert_eq!(ok.name, "success", "login {user}: {ok}");
        c.reader = StreamReader::new(c.reader.into_inner(), limits());
        c.open(&server.domain).await.expect("stream after SASL");
        c.bind(resource).await.expect("bind");
        c
    }

    /// The next stanza within `wait` (backlog first).
    pub async fn next_stanza(&mut self, wait: Duration) -> Result<Element, Ended> {
        if !self.backlog.is_empty() {
            return Ok(self.backlog.remove(0));
        }
        self.read_stanza(wait).await
    }

    async fn read_stanza(&mut self, wait: Duration) -> Result<Element, Ended> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.next_event(left).await? {
                StreamEvent::Stanza(el)
                    if el.name == "error" && el.ns == presenced::protocol::xml::NS_STREAM =>
                {
                    return Err(Ended::StreamError(condition(&el)))
                }
                StreamEvent::Stanza(el) => return Ok(el),
                StreamEvent::Close => return Err(Ended::Closed),
                _ => {}
            }
        }
    }

    /// Waits up to [`WAIT`] for a stanza matching `pred`, keeping the others in the backlog.
    pub async fn expect(&mut self, pred: impl Fn(&Element) -> bool) -> Element {
        match self.try_expect(&pred, WAIT).await {
            Ok(e) => e,
            Err(e) => panic!(
                "{}: expected stanza not received ({e:?}); backlog: {}",
                self.jid,
                self.backlog
                    .iter()
                    .map(|e| e.to_xml())
                    .collect::<Vec<_>>()
                    .join("\n")
            ),
        }
    }

    /// Like [`Client::expect`] with an explicit bound; `Err` on timeout or stream end.
    pub async fn try_expect(
        &mut self,
        pred: &impl Fn(&Element) -> bool,
        wait: Duration,
    ) -> Result<Element, Ended> {
        if let Some(i) = self.backlog.iter().position(pred) {
            return Ok(self.backlog.remove(i));
        }
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let el = self.read_stanza(left).await?;
            if pred(&el) {
                return Ok(el);
            }
            self.backlog.push(el);
        }
    }

    /// Asserts that nothing matching `pred` arrives within `window` (a bound for a negative
    /// expectation, not a sleep: anything matching fails at once).
    pub async fn expect_none(&mut self, pred: impl Fn(&Element) -> bool, window: Duration) {
        match self.try_expect(&pred, window).await {
            Ok(e) => panic!("{}: unexpected stanza {e}", self.jid),
            Err(Ended::Timeout) => {}
            Err(e) => panic!("{}: stream ended while watching: {e:?}", self.jid),
        }
    }

    /// Reads until the stream ends, returning the stream error condition if one came.
    pub async fn expect_stream_end(&mut self) -> Ended {
        loop {
            match self.read_stanza(WAIT).await {
                Ok(el) => self.backlog.push(el),
                Err(e) => return e,
            }
        }
    }

    /// Sends an iq get/set and waits for its reply.
    pub async fn iq(&mut self, ty: &str, to: Option<&str>, payload: Element) -> Element {
        let id = unique();
        let mut iq = Element::new("iq", NS_CLIENT)
            .attr("type", ty)
            .attr("id", id.clone())
            .child(payload);
        if let Some(to) = to {
            iq.set_attr("to", to);
        }
        self.send(&iq).await;
        self.expect(|e| e.name == "iq" && e.get_attr("id") == Some(id.as_str()))
            .await
    }

    /// Sends `<presence/>` with optional type and `to`.
    pub async fn presence(&mut self, ty: Option<&str>, to: Option<&str>) {
        let mut p = Element::new("presence", NS_CLIENT);
        if let Some(t) = ty {
            p.set_attr("type", t);
        }
        if let Some(to) = to {
            p.set_attr("to", to);
        }
        self.send(&p).await
    }

    /// Reads for `window`, answering XEP-0199 pings from the server like a live client and
    /// keeping everything else in the backlog.
    pub async fn idle_answering_pings(&mut self, window: Duration) {
        let deadline = tokio::time::Instant::now() + window;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return;
            }
            match self.read_stanza(left).await {
                Ok(el) => match pong(&el) {
                    Some(r) => self.send(&r).await,
                    None => self.backlog.push(el),
                },
                Err(Ended::Timeout) => return,
                Err(e) => panic!("{}: stream ended while idling: {e:?}", self.jid),
            }
        }
    }

    /// Like [`Client::try_expect`], but answers the server's XEP-0199 pings meanwhile, as a
    /// live client does: for watchers that wait longer than the liveness TTL.
    pub async fn watch(
        &mut self,
        pred: &impl Fn(&Element) -> bool,
        wait: Duration,
    ) -> Result<Element, Ended> {
        if let Some(i) = self.backlog.iter().position(pred) {
            return Ok(self.backlog.remove(i));
        }
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let el = self.read_stanza(left).await?;
            if pred(&el) {
                return Ok(el);
            }
            match pong(&el) {
                Some(r) => self.send(&r).await,
                None => self.backlog.push(el),
            }
        }
    }

    /// Like [`Client::expect_none`], answering pings meanwhile.
    pub async fn watch_none(&mut self, pred: impl Fn(&Element) -> bool, window: Duration) {
        match self.watch(&pred, window).await {
            Ok(e) => panic!("{}: unexpected stanza {e}", self.jid),
            Err(Ended::Timeout) => {}
            Err(e) => panic!("{}: stream ended while watching: {e:?}", self.jid),
        }
    }

    /// Holds the session like a live client until its stream ends: answers the server's
    /// XEP-0199 pings and discards everything else. For tests that hold many sessions
    /// whose only part is to be alive.
    pub async fn keep_alive(mut self) {
        loop {
            match self.read_stanza(Duration::from_secs(3600)).await {
                Ok(el) => {
                    if let Some(r) = pong(&el) {
                        if self.try_send_raw(&r.to_xml()).await.is_err() {
                            return;
                        }
                    }
                }
                Err(Ended::Timeout) => {}
                Err(_) => return,
            }
        }
    }

    /// Closes the stream cleanly.
    pub async fn close(mut self) {
        self.send_raw("</stream:stream>").await;
        let _ = tokio::time::timeout(Duration::from_secs(2), self.reader.next()).await;
    }
}

/// A live client's answer to `el` if it is the server's XEP-0199 ping (§4.2: a result
/// with the same id).
fn pong(el: &Element) -> Option<Element> {
    if el.name != "iq"
        || el.get_attr("type") != Some("get")
        || el
            .get_child("ping", presenced::protocol::xml::NS_PING)
            .is_none()
    {
        return None;
    }
    let mut r = Element::new("iq", NS_CLIENT).attr("type", "result");
    if let Some(id) = el.get_attr("id") {
        r.set_attr("id", id);
    }
    if let Some(from) = el.get_attr("from") {
        r.set_attr("to", from);
    }
    Some(r)
}

/// The defined condition inside a `<stream:error/>` or stanza `<error/>`.
pub fn condition(el: &Element) -> String {
    el.elements()
        .find(|c| c.name != "text")
        .map(|c| c.name.clone())
        .unwrap_or_default()
}

/// The stanza error condition of an error stanza.
pub fn stanza_error(el: &Element) -> String {
    el.get_child("error", NS_CLIENT)
        .map(condition)
        .unwrap_or_default()
}

/// Whether `el` is a presence from `from` (prefix match on the JID) of `ty` (None = available).
pub fn is_presence(el: &Element, from: &str, ty: Option<&str>) -> bool {
    el.name == "presence"
        && el.get_attr("from").is_some_and(|f| f.starts_with(from))
        && el.get_attr("type") == ty
}

/// A presence of type `ty` addressed to `to`.
pub fn presence_to(ty: &str, to: &str) -> Element {
    Element::new("presence", NS_CLIENT)
        .attr("type", ty)
        .attr("to", to)
}

/// `asker` (bare JID `asker_bare`) asks `approver` for a subscription and is approved
/// (RFC 6121 §3.1), then sees the approver's presence. Both are online and available,
/// local or on different domains.
pub async fn subscribe_approved(
    asker: &mut Client,
    asker_bare: &str,
    approver: &mut Client,
    approver_bare: &str,
) {
    asker.send(&presence_to("subscribe", approver_bare)).await;
    approver
        .expect(|e| is_presence(e, asker_bare, Some("subscribe")))
        .await;
    approver.send(&presence_to("subscribed", asker_bare)).await;
    asker
        .expect(|e| is_presence(e, approver_bare, Some("subscribed")))
        .await;
    asker.expect(|e| is_presence(e, approver_bare, None)).await;
}

/// [`subscribe_approved`] in both directions, `a` asking first.
pub async fn subscribe_mutually(a: &mut Client, a_bare: &str, b: &mut Client, b_bare: &str) {
    subscribe_approved(a, a_bare, b, b_bare).await;
    subscribe_approved(b, b_bare, a, a_bare).await;
}

/// What a client script printed and how it exited.
#[derive(Debug)]
pub struct ScriptOutput {
    /// Exit code (`None`: killed by a signal).
    pub code: Option<i32>,
    /// The last line the script printed on standard output (its JSON report).
    pub report: String,
    /// Everything on standard error, for failure messages.
    pub stderr: String,
}

impl ScriptOutput {
    /// A top-level value of the script's one-line JSON report, as its JSON text with the
    /// quotes of a string removed (`"a"` → `a`, `true` → `true`). The scripts print flat
    /// objects with `json.dumps` defaults, which is all this needs to read.
    pub fn get(&self, key: &str) -> Option<String> {
        let needle = format!("\"{key}\": ");
        let start = self.report.find(&needle)? + needle.len();
        let rest = &self.report[start..];
        if let Some(s) = rest.strip_prefix('"') {
            let mut out = String::new();
            let mut chars = s.chars();
            while let Some(c) = chars.next() {
                match c {
                    '"' => return Some(out),
                    '\\' => out.push(chars.next()?),
                    c => out.push(c),
                }
            }
            None
        } else {
            let end = rest.find([',', '}']).unwrap_or(rest.len());
            Some(rest[..end].trim().to_owned())
        }
    }
}

/// Arguments of the two-user client scripts (scenario.py, silent.py): the server's STARTTLS
/// address, its domain and the certificate to verify, then `rest`.
pub fn client_script_args(ts: &TestServer, rest: &[&str]) -> Vec<String> {
    let mut args = vec![
        ts.addr.ip().to_string(),
        ts.addr.port().to_string(),
        ts.domain.clone(),
        ts.cert.display().to_string(),
    ];
    args.extend(rest.iter().map(|s| s.to_string()));
    args
}

/// Runs `tests/clients/<script>` with the system Python (`PYTHON` overrides `python3`),
/// killing it after `limit`. A script that overruns fails the test with its stderr.
pub async fn run_client_script(script: &str, args: &[String], limit: Duration) -> ScriptOutput {
    let path = repo_root().join("tests/clients").join(script);
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let child = tokio::process::Command::new(python)
        .arg(&path)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start python3 (slixmpp: pip install -r tests/requirements.txt)");
    let out = match tokio::time::timeout(limit, child.wait_with_output()).await {
        Ok(out) => out.expect("wait for client script"),
        Err(_) => panic!("{script} did not finish within {limit:?}"),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    ScriptOutput {
        code: out.status.code(),
        report: stdout.lines().last().unwrap_or("").to_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

impl Client {
    /// A plain TCP connection to the STARTTLS port from the local address `source` (any
    /// 127.0.0.0/8 address works on Linux loopback), so a test can play a second client IP.
    pub async fn tcp_from(server: &TestServer, source: std::net::IpAddr) -> Client {
        let sock = tokio::net::TcpSocket::new_v4().expect("socket");
        sock.bind(std::net::SocketAddr::new(source, 0))
            .expect("bind source address");
        let tcp = sock.connect(server.addr).await.expect("connect");
        tcp.set_nodelay(true).unwrap();
        Client::over(Box::new(tcp))
    }

    /// One SASL PLAIN attempt from the local address `source` on a fresh stream after
    /// STARTTLS; the server's answer (`<success/>` or `<failure/>`).
    pub async fn plain_from(
        server: &TestServer,
        source: &str,
        user: &str,
        password: &str,
    ) -> Element {
        let mut c = Client::tcp_from(server, source.parse().expect("an IP address")).await;
        c.open(&server.domain).await.expect("stream");
        let mut c = c.starttls(server).await;
        c.auth_plain(user, password).await
    }

    /// [`Client::login`] from the local address `source`.
    pub async fn login_from(
        server: &TestServer,
        source: std::net::IpAddr,
        user: &str,
        password: &str,
        resource: &str,
    ) -> Client {
        let mut c = Client::tcp_from(server, source).await;
        c.open(&server.domain).await.expect("stream");
        let mut c = c.starttls(server).await;
        let ok = c.auth_plain(user, password).await;
        assert_eq!(ok.name, "success", "login {user}: {ok}");
        c.restart_stream();
        c.open(&server.domain).await.expect("stream after SASL");
        c.bind(resource).await.expect("bind");
        c
    }

    /// Like [`Client::expect_stream_end`], but also records the server's stream header in
    /// [`Client::header`], so a test can check that an early stream error still came after
    /// a header (RFC 6120 §4.9.1.1).
    pub async fn expect_stream_end_recording_header(&mut self) -> Ended {
        loop {
            match self.next_event(WAIT).await {
                Ok(StreamEvent::Open(h)) => self.header = Some(h),
                Ok(StreamEvent::Stanza(el))
                    if el.name == "error" && el.ns == presenced::protocol::xml::NS_STREAM =>
                {
                    return Ended::StreamError(condition(&el))
                }
                Ok(StreamEvent::Stanza(el)) => self.backlog.push(el),
                Ok(StreamEvent::Whitespace) => {}
                Ok(StreamEvent::Close) => return Ended::Closed,
                Err(e) => return e,
            }
        }
    }

    /// Reads until the stream ends; `true` only when the server sent `</stream:stream>`
    /// (a clean close, RFC 6120 §4.4), `false` on a stream error, EOF or timeout.
    pub async fn got_closing_tag(&mut self) -> bool {
        loop {
            match self.next_event(WAIT).await {
                Ok(StreamEvent::Close) => return true,
                Ok(StreamEvent::Stanza(el))
                    if el.name == "error" && el.ns == presenced::protocol::xml::NS_STREAM =>
                {
                    return false
                }
                Ok(StreamEvent::Stanza(el)) => self.backlog.push(el),
                Ok(_) => {}
                Err(_) => return false,
            }
        }
    }

    /// Forgets the parser state after SASL success, as RFC 6120 §6.4.6 requires before the
    /// client sends the new stream header.
    pub fn restart_stream(&mut self) {
        let reader = std::mem::replace(
            &mut self.reader,
            StreamReader::new(
                tokio::io::split(Box::new(tokio::io::duplex(1).0) as Box<dyn Io>).0,
                limits(),
            ),
        );
        self.reader = StreamReader::new(reader.into_inner(), limits());
    }
}

/// The `type` attribute of the `<error/>` in an error stanza.
pub fn error_type(el: &Element) -> String {
    el.get_child("error", NS_CLIENT)
        .and_then(|e| e.get_attr("type"))
        .unwrap_or_default()
        .to_owned()
}

/// Asserts `reply` is an error stanza with `condition` and error `ty`.
pub fn assert_error(reply: &Element, condition: &str, ty: &str, what: &str) {
    assert_eq!(reply.get_attr("type"), Some("error"), "{what}: {reply}");
    assert_eq!(stanza_error(reply), condition, "{what}: {reply}");
    assert_eq!(error_type(reply), ty, "{what}: {reply}");
}

/// A ping to the server and its answer: whatever the server routed to this client before
/// handling the ping is in the backlog afterwards (one task per session, one FIFO queue).
pub async fn barrier(ts: &TestServer, c: &mut Client) {
    let r = c
        .iq(
            "get",
            Some(&ts.domain),
            Element::new("ping", "urn:xmpp:ping"),
        )
        .await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
}

/// The whole response to `GET path` with `Host: host` at `addr`, read until it closes.
pub async fn get(addr: std::net::SocketAddr, path: &str, host: &str) -> String {
    use tokio::io::AsyncReadExt;
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
        .await
        .expect("request");
    let mut text = String::new();
    tokio::time::timeout(WAIT, s.read_to_string(&mut text))
        .await
        .expect("answer within the wait")
        .expect("answer read");
    text
}

/// A `chat` message to `to` with `body` and a fresh id.
pub fn chat(to: &str, body: &str) -> Element {
    Element::new("message", NS_CLIENT)
        .attr("to", to)
        .attr("type", "chat")
        .attr("id", unique())
        .child(Element::new("body", NS_CLIENT).text(body))
}

/// Whether `e` is a message whose `<body/>` is `body`.
pub fn has_body(e: &Element, body: &str) -> bool {
    e.name == "message"
        && e.get_child("body", NS_CLIENT)
            .is_some_and(|b| b.text_content() == body)
}

/// An executable found on `PATH` (for the stock clients the tests drive).
pub fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

/// The features the server's disco#info lists (XEP-0030 §3.1), as `c` asks for them.
pub async fn server_features(ts: &TestServer, c: &mut Client) -> Vec<String> {
    disco_features(c, &ts.domain).await
}

/// The features `to`'s disco#info lists (XEP-0030 §3.1), as `c` asks for them.
pub async fn disco_features(c: &mut Client, to: &str) -> Vec<String> {
    let r = c
        .iq(
            "get",
            Some(to),
            Element::new("query", presenced::protocol::xml::NS_DISCO_INFO),
        )
        .await;
    r.get_child("query", presenced::protocol::xml::NS_DISCO_INFO)
        .expect("disco#info result")
        .elements()
        .filter(|f| f.name == "feature")
        .filter_map(|f| f.get_attr("var").map(str::to_owned))
        .collect()
}

/// Waits (at most 15 s) until a PostgreSQL backend waits for a lock that backend `holder`
/// holds: the server's statement has reached the point the test holds it at.
pub async fn until_a_backend_waits_on(pool: &sqlx::PgPool, holder: i32) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
        )
        .bind(holder)
        .fetch_one(pool)
        .await
        .expect("blocked backends");
        if waiting > 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no statement waited for the held lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `cond` holds, checking every 10 ms, and fails naming `what` if it does not
/// within `wait`: for state a test cannot await (a session detached, a counter reached).
pub async fn until(what: &str, wait: Duration, cond: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + wait;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {wait:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The `presenced` binary with a config file of its own for a test server's domain and
/// store: the operator's command line.
pub struct Cli {
    /// The binary: `env!("CARGO_BIN_EXE_presenced")` in the test that runs it (the bench
    /// harness shares this file and has no such binary).
    pub bin: &'static str,
    pub dir: std::path::PathBuf,
    pub config: std::path::PathBuf,
}

impl Cli {
    /// A config file for `ts`'s domain and database.
    pub fn for_server(bin: &'static str, ts: &TestServer) -> Cli {
        let dir = std::env::temp_dir().join(format!("presenced-cli-{}", unique()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("presenced.toml");
        // The schema is built in; no operator migrations.
        let migrations = no_operator_migrations();
        std::fs::write(
            &config,
            format!(
                "domains = [\"{}\"]\n[database]\nurl = \"{}\"\nmigrations = \"{}\"\n\
                 [tls]\ncerts_dir = \"{}\"\n",
                ts.domain,
                database_url(),
                migrations.display(),
                dir.display()
            ),
        )
        .unwrap();
        Cli { bin, dir, config }
    }

    /// A file holding `pw`, for `--password-file`.
    pub fn password_file(&self, pw: &str) -> String {
        let p = self.dir.join(format!("pw-{}", unique()));
        // A trailing newline, as `echo pw > file` writes: only the first line counts.
        std::fs::write(&p, format!("{pw}\n")).unwrap();
        p.display().to_string()
    }

    /// Runs `presenced --config <this> args…` and waits for it.
    pub async fn run(&self, args: &[&str]) -> std::process::Output {
        run_presenced(self.bin, &self.config, args).await
    }
}

/// Runs `presenced --config config args…`, with no terminal and the config's own store.
pub async fn run_presenced(
    bin: &str,
    config: &std::path::Path,
    args: &[&str],
) -> std::process::Output {
    let cmd = tokio::process::Command::new(bin)
        .arg("--config")
        .arg(config)
        .args(args)
        .stdin(std::process::Stdio::null())
        // Each config names its store; the environment must not override it.
        .env_remove("DATABASE_URL")
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(Duration::from_secs(30), cmd)
        .await
        .expect("presenced CLI finished in time")
        .expect("run presenced")
}

/// Sends an available presence with `<show>show</show>` and waits until the server handled
/// it: the broadcast is queued for every contact before the answer to the ping is.
pub async fn show(ts: &TestServer, c: &mut Client, show: &str) {
    c.send(&Element::new("presence", NS_CLIENT).child(Element::new("show", NS_CLIENT).text(show)))
        .await;
    barrier(ts, c).await;
}

/// The `<show/>` of a presence, if it has one.
pub fn show_of(e: &Element) -> Option<String> {
    e.get_child("show", NS_CLIENT).map(Element::text_content)
}

/// Waits (bounded) until `n` sessions of the server are detached (XEP-0198).
pub async fn detached(ts: &TestServer, n: usize) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while ts.shared().resumable.detached() != n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "detached sessions never reached {n}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
