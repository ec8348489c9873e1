//! Outgoing server streams: resolution, connection, STARTTLS, SASL EXTERNAL or dialback,
//! and the task that drains one domain pair's queue.
//!
//! Resolution order (RFC 6120 §3.2, XEP-0368): a static route from `[s2s] routes`; else DNS
//! SRV `_xmpps-server._tcp` (direct TLS) and `_xmpp-server._tcp` (STARTTLS) merged by
//! priority; else the domain's own addresses on port 5269 (§3.2.2 fallback). DNS goes
//! only to the configured resolver (`[s2s] nameserver`), never anywhere when it is "none".

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rustls::client::danger::{ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use crate::config::Nameserver;
use crate::node::io::BoxIo;
use crate::node::Shared;
use crate::protocol::error::{StanzaError, StreamCondition};
use crate::protocol::xml::reader::ReaderLimits;
use crate::protocol::xml::{Element, NS_SASL, NS_SERVER, NS_TLS};

use super::dialback::{self, NS_DIALBACK};
use super::header;
use super::AuthMethod;
use crate::transport::stream::{Fail, XmlStream};

/// Why an outgoing stream could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// No address found for the domain.
    #[error("cannot resolve {0}")]
    Resolve(String),
    /// Every address refused or failed.
    #[error("cannot connect to {0}")]
    Connect(String),
    /// The peer does not offer TLS, or the handshake failed.
    #[error("TLS with {0} failed: {1}")]
    Tls(String, String),
    /// The certificate did not verify and policy requires it.
    #[error("{0} presented no verified certificate and policy requires one")]
    Unverified(String),
    /// Dialback was refused or is not allowed.
    #[error("authentication with {0} failed: {1}")]
    Auth(String, String),
    /// The stream broke during negotiation.
    #[error("stream with {0} broke during negotiation: {1}")]
    Stream(String, String),
}

impl ConnectError {
    /// The stanza error queued stanzas are bounced with.
    pub fn stanza_error(&self) -> StanzaError {
        StanzaError::remote_server_not_found().with_text(self.to_string())
    }
}

/// A secured (TLS) stream to a remote server, before authentication.
pub struct Secured {
    /// The stream.
    pub stream: XmlStream,
    /// The id the peer gave the current stream (the dialback key covers it).
    pub stream_id: String,
    /// The peer's stream features after TLS.
    pub features: Element,
    /// Whether the peer's certificate verified for its domain.
    pub verified: bool,
}

/// Builds the resolver for `[s2s] nameserver`.
pub fn build_resolver(nameserver: &Nameserver) -> Option<hickory_resolver::TokioResolver> {
    use hickory_resolver::config::{NameServerConfig, ResolverConfig};
    use hickory_resolver::net::runtime::TokioRuntimeProvider;
    let builder = match *nameserver {
        Nameserver::Disabled => return None,
        Nameserver::System => match hickory_resolver::TokioResolver::builder_tokio() {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "no system DNS configuration; s2s uses static routes only");
                return None;
            }
        },
        Nameserver::Server(addr) => {
            let mut ns = NameServerConfig::udp_and_tcp(addr.ip());
            for c in &mut ns.connections {
                c.port = addr.port();
            }
            hickory_resolver::TokioResolver::builder_with_config(
                ResolverConfig::from_name_servers(vec![ns]),
                TokioRuntimeProvider::default(),
            )
        }
    };
    builder.build().ok()
}

/// One place to connect to: address and whether TLS starts at once (XEP-0368).
#[derive(Debug, Clone)]
pub struct Candidate {
    /// Host name (for SRV targets) or address text.
    pub host: String,
    /// Port.
    pub port: u16,
    /// Direct TLS.
    pub direct_tls: bool,
}

/// Where to connect for `domain`, in order.
pub async fn resolve(shared: &Shared, domain: &str) -> Vec<Candidate> {
    if let Some(route) = shared.live.get().s2s.routes.get(domain) {
        return vec![Candidate {
            host: route.host.clone(),
            port: route.port,
            direct_tls: route.direct_tls,
        }];
    }
    let Some(resolver) = &shared.s2s.resolver else {
        return Vec::new();
    };
    let mut found: Vec<(u16, u16, Candidate)> = Vec::new();
    for (service, direct_tls) in [("_xmpps-server._tcp", true), ("_xmpp-server._tcp", false)] {
        let name = format!("{service}.{domain}.");
        if let Ok(lookup) = resolver.srv_lookup(name.as_str()).await {
            for rec in lookup.answers() {
                if let hickory_resolver::proto::rr::RData::SRV(srv) = &rec.data {
                    let target = srv.target.to_utf8();
                    let target = target.trim_end_matches('.');
                    // RFC 2782: a target of "." means the service is not offered.
                    if target.is_empty() {
                        continue;
                    }
                    found.push((
                        srv.priority,
                        u16::MAX - srv.weight,
                        Candidate {
                            host: target.to_owned(),
                            port: srv.port,
                            direct_tls,
                        },
                    ));
                }
            }
        }
    }
    found.sort_by_key(|(p, w, _)| (*p, *w));
    let mut out: Vec<Candidate> = found.into_iter().map(|(_, _, c)| c).collect();
    if out.is_empty() {
        // RFC 6120 §3.2.2: no SRV records: the domain itself on the default port.
        out.push(Candidate {
            host: domain.to_owned(),
            port: 5269,
            direct_tls: false,
        });
    }
    out
}

async fn addresses(shared: &Shared, c: &Candidate) -> Vec<SocketAddr> {
    if let Ok(ip) = c.host.parse::<std::net::IpAddr>() {
        return vec![SocketAddr::new(ip, c.port)];
    }
    match &shared.s2s.resolver {
        Some(r) => match r.lookup_ip(c.host.as_str()).await {
            Ok(ips) => ips.iter().map(|ip| SocketAddr::new(ip, c.port)).collect(),
            Err(_) => Vec::new(),
        },
        // No DNS configured: a static route naming a host is looked up by the system
        // (e.g. /etc/hosts); the operator chose that name.
        None if shared
            .live
            .get()
            .s2s
            .routes
            .values()
            .any(|r| r.host == c.host) =>
        {
            tokio::net::lookup_host((c.host.as_str(), c.port))
                .await
                .map(|a| a.collect())
                .unwrap_or_default()
        }
        None => Vec::new(),
    }
}

/// Records whether the peer certificate verified; accepts it anyway unless required,
/// because dialback then proves the domain (XEP-0220 §2.1, XEP-0344).
#[derive(Debug)]
struct PeerVerifier {
    roots: Option<Arc<rustls::client::WebPkiServerVerifier>>,
    allow_self_signed: bool,
    required: bool,
    verified: Arc<AtomicBool>,
    signatures: crate::transport::tls::HandshakeSignatures,
}

impl ServerCertVerifier for PeerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let ok = super::cert::proves_name(
            self.roots.as_deref(),
            self.allow_self_signed,
            end_entity,
            intermediates,
            server_name,
            ocsp,
            now,
        );
        self.verified.store(ok, Ordering::SeqCst);
        if !ok && self.required {
            return Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::UnknownIssuer,
            ));
        }
        Ok(ServerCertVerified::assertion())
    }

    crate::verify_handshake_signatures_with!(signatures);
}

fn client_tls(
    shared: &Shared,
    remote: &str,
    direct: bool,
) -> Result<(Arc<rustls::ClientConfig>, Arc<AtomicBool>), String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let policy = shared.live.get().s2s.policy(remote).clone();
    let verified = Arc::new(AtomicBool::new(false));
    let verifier = PeerVerifier {
        roots: shared.s2s.roots.clone(),
        allow_self_signed: policy.allow_self_signed,
        required: policy.require_verified_cert,
        verified: verified.clone(),
        signatures: crate::transport::tls::HandshakeSignatures(provider.clone()),
    };
    // Our certificate goes out as the TLS client certificate, so the peer can offer SASL
    // EXTERNAL (XEP-0178 §2: the initiating server presents its certificate).
    let (chain, key) = shared.s2s.client_identity();
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_client_auth_cert(chain, key)
        .map_err(|e| e.to_string())?;
    if direct {
        // XEP-0368 §4: direct TLS to a server announces the ALPN protocol id.
        config.alpn_protocols = vec![b"xmpp-server".to_vec()];
    }
    Ok((Arc::new(config), verified))
}

/// Limits for what the receiving server sends back on a stream we opened. It carries only
/// negotiation (features, TLS, SASL, dialback results and verifies) and stream errors,
/// never stanzas (RFC 6120 §4.1: a stream is unidirectional), so the small pre-authentication
/// cost limit holds for its whole life.
fn limits(shared: &Shared) -> ReaderLimits {
    ReaderLimits::for_peer(&shared.live.get().limits, false)
}

/// Sends our header and reads the peer's header and features.
async fn open_stream(
    stream: &mut XmlStream,
    local: &str,
    remote: &str,
) -> Result<(String, Element), Fail> {
    stream
        .write(&header(Some(local), Some(remote), None))
        .await?;
    let h = stream.read_header().await?;
    let id = h.get_attr("id").unwrap_or_default().to_owned();
    let features = stream.next_element().await?;
    if !features.is("features", crate::protocol::xml::NS_STREAM) {
        return Err(Fail::Stream(crate::protocol::error::StreamError::new(
            StreamCondition::InvalidXml,
            "expected stream features",
        )));
    }
    Ok((id, features))
}

/// Connects to `remote` for `local` and secures the stream with TLS (STARTTLS or direct),
/// stopping before authentication. Used by the originating and the receiving server roles.
pub async fn open_secure(
    shared: &Shared,
    local: &str,
    remote: &str,
) -> Result<Secured, ConnectError> {
    let candidates = resolve(shared, remote).await;
    if candidates.is_empty() {
        return Err(ConnectError::Resolve(remote.to_owned()));
    }
    let broke = |e: Fail| ConnectError::Stream(remote.to_owned(), format!("{e:?}"));
    let name = ServerName::try_from(remote.to_owned())
        .map_err(|e| ConnectError::Tls(remote.to_owned(), e.to_string()))?;
    for c in candidates {
        for addr in addresses(shared, &c).await {
            let Ok(Ok(tcp)) =
                tokio::time::timeout(Duration::from_secs(10), TcpStream::connect(addr)).await
            else {
                continue;
            };
            let _ = tcp.set_nodelay(true);
            tracing::debug!(%remote, %addr, direct_tls = c.direct_tls, "s2s connected");
            let (tls, verified) = client_tls(shared, remote, c.direct_tls)
                .map_err(|e| ConnectError::Tls(remote.to_owned(), e))?;
            let connector = tokio_rustls::TlsConnector::from(tls);
            if c.direct_tls {
                let Ok(io) = connector.connect(name.clone(), tcp).await else {
                    continue;
                };
                let mut stream = XmlStream::new(Box::new(io) as BoxIo, limits(shared), NS_SERVER);
                let (stream_id, features) = open_stream(&mut stream, local, remote)
                    .await
                    .map_err(broke)?;
                return Ok(Secured {
                    stream,
                    stream_id,
                    features,
                    verified: verified.load(Ordering::SeqCst),
                });
            }
            let mut stream = XmlStream::new(Box::new(tcp) as BoxIo, limits(shared), NS_SERVER);
            let (_, features) = open_stream(&mut stream, local, remote)
                .await
                .map_err(broke)?;
            if features.get_child("starttls", NS_TLS).is_none() {
                // RFC 7590 §3.1: we do not federate in the clear.
                stream.close().await;
                return Err(ConnectError::Tls(
                    remote.to_owned(),
                    "STARTTLS not offered".into(),
                ));
            }
            stream
                .write(&format!("<starttls xmlns='{NS_TLS}'/>"))
                .await
                .map_err(|e| ConnectError::Tls(remote.to_owned(), e.to_string()))?;
            let answer = stream.next_element().await.map_err(broke)?;
            if !answer.is("proceed", NS_TLS) {
                return Err(ConnectError::Tls(
                    remote.to_owned(),
                    "STARTTLS refused".into(),
                ));
            }
            let io = stream.into_io();
            let tls_io = connector
                .connect(name.clone(), io)
                .await
                .map_err(|e| ConnectError::Tls(remote.to_owned(), e.to_string()))?;
            let mut stream = XmlStream::new(Box::new(tls_io) as BoxIo, limits(shared), NS_SERVER);
            let (stream_id, features) = open_stream(&mut stream, local, remote)
                .await
                .map_err(broke)?;
            return Ok(Secured {
                stream,
                stream_id,
                features,
                verified: verified.load(Ordering::SeqCst),
            });
        }
    }
    Err(ConnectError::Connect(remote.to_owned()))
}

/// Opens and authenticates an outgoing stream from `local` to `remote` (originating role):
/// TLS, then SASL EXTERNAL when the peer offers it (XEP-0178 §3), else dialback
/// (XEP-0220 §2.1) when policy allows it.
pub async fn connect(
    shared: &Shared,
    local: &str,
    remote: &str,
) -> Result<XmlStream, ConnectError> {
    let mut secured = open_secure(shared, local, remote).await?;
    let policy = shared.live.get().s2s.policy(remote).clone();
    if policy.require_verified_cert && !secured.verified {
        secured.stream.close().await;
        return Err(ConnectError::Unverified(remote.to_owned()));
    }
    let broke = |e: Fail| ConnectError::Stream(remote.to_owned(), format!("{e:?}"));
    let offers_external = secured
        .features
        .get_child("mechanisms", NS_SASL)
        .is_some_and(|m| m.elements().any(|e| e.text_content().trim() == "EXTERNAL"));
    let mut why_not_external = "the peer does not offer SASL EXTERNAL";
    if offers_external {
        // The peer offers EXTERNAL only when our certificate proved `local` to it: no
        // round trip to an authoritative server, no DNS on its side. Preferred.
        match external(&mut secured.stream).await.map_err(broke)? {
            Ok(()) => {
                // RFC 6120 §6.4.6: after <success/> both sides restart the stream.
                let mut stream = secured.stream.restart();
                open_stream(&mut stream, local, remote)
                    .await
                    .map_err(broke)?;
                shared.s2s.authenticated(AuthMethod::External, false);
                tracing::info!(%local, %remote, "outgoing s2s stream authenticated by SASL EXTERNAL");
                return Ok(stream);
            }
            Err(condition) => {
                tracing::warn!(%local, %remote, %condition, "SASL EXTERNAL refused by the peer");
                why_not_external = "SASL EXTERNAL failed";
            }
        }
    }
    if !policy.allow_dialback || policy.require_verified_cert {
        secured.stream.close().await;
        return Err(ConnectError::Auth(
            remote.to_owned(),
            format!("{why_not_external} and policy forbids dialback"),
        ));
    }
    let key = shared.s2s.secret.key(remote, local, &secured.stream_id);
    let result = dialback::element("result", local, remote, None, None, Some(&key));
    secured
        .stream
        .write(&result)
        .await
        .map_err(|e| ConnectError::Stream(remote.to_owned(), e.to_string()))?;
    loop {
        let el = secured.stream.next_element().await.map_err(broke)?;
        if el.is("result", NS_DIALBACK) {
            match el.get_attr("type") {
                Some("valid") => {
                    shared.s2s.authenticated(AuthMethod::Dialback, false);
                    tracing::info!(%local, %remote, "outgoing s2s stream authenticated by dialback");
                    return Ok(secured.stream);
                }
                other => {
                    secured.stream.close().await;
                    return Err(ConnectError::Auth(
                        remote.to_owned(),
                        format!("dialback result {}", other.unwrap_or("missing")),
                    ));
                }
            }
        }
        // Anything else before the result (e.g. a db:verify the peer multiplexes) is not
        // ours to answer on an outgoing stream; ignore it.
    }
}

/// Initiating side of SASL EXTERNAL (XEP-0178 §3). The initial response is `=`: the
/// authorization identity is the one our certificate and stream header already name
/// (RFC 6120 §6.3.8: do not send an authzid equal to the derived one). `Ok(Err(cond))` is
/// the peer's failure condition; the stream is still usable (for dialback).
async fn external(stream: &mut XmlStream) -> Result<Result<(), String>, Fail> {
    stream
        .write(&format!(
            "<auth xmlns='{NS_SASL}' mechanism='EXTERNAL'>=</auth>"
        ))
        .await?;
    loop {
        let el = stream.next_element().await?;
        if el.ns != NS_SASL {
            continue;
        }
        match el.name.as_str() {
            "success" => return Ok(Ok(())),
            // An empty challenge asks for the (empty) response again (RFC 6120 §6.4.3).
            "challenge" => {
                stream
                    .write(&format!("<response xmlns='{NS_SASL}'>=</response>"))
                    .await?;
            }
            _ => {
                let cond = el
                    .elements()
                    .find(|c| c.name != "text")
                    .map(|c| c.name.clone())
                    .unwrap_or_else(|| el.name.clone());
                return Ok(Err(cond));
            }
        }
    }
}

/// How an established outgoing stream ended.
enum End {
    /// No stanza for `idle_timeout`: closed on purpose.
    Idle,
    /// The peer closed the stream cleanly.
    Closed,
    /// The stream broke; these stanzas were not written.
    Lost(Vec<Element>),
    /// Server shutdown.
    Shutdown,
}

/// How long to wait before the next connection attempt after `failures` consecutive
/// failures (1 for the first), given `unit`, a random number in [0, 1].
///
/// The cap `d` doubles per failure from `2·min` up to `max`, and the wait is drawn from
/// [max(min, d/2), d]: never shorter than `min` nor longer than `max`, growing until the
/// cap, and jittered over half the cap so that many servers cut off by the same outage do
/// not all reconnect in lock-step when it ends. Pure, so its bounds are unit-tested.
pub fn reconnect_delay(failures: u32, min: Duration, max: Duration, unit: f64) -> Duration {
    let min_ms = min.as_millis() as f64;
    let max_ms = (max.as_millis() as f64).max(min_ms);
    let cap = (min_ms * 2f64.powi(failures.clamp(1, 32) as i32)).min(max_ms);
    let floor = (cap / 2.0).max(min_ms).min(cap);
    let ms = floor + (cap - floor) * unit.clamp(0.0, 1.0);
    Duration::from_millis(ms.round() as u64)
}

/// The task behind one (local, remote) link: connect on demand, drain, close when idle.
pub async fn run(
    shared: Arc<Shared>,
    key: (String, String),
    id: u64,
    mut rx: mpsc::Receiver<Element>,
    pending: Arc<AtomicUsize>,
) {
    let (local, remote) = key.clone();
    let cfg = shared.config.s2s.clone();
    let idle = cfg.idle_timeout;
    let (min_delay, max_delay) = (cfg.reconnect_min_ms, cfg.reconnect_max_ms);
    // Consecutive failed attempts; the wait before the next one grows with it.
    let mut failures: u32 = 0;
    let mut queue: Vec<Element> = Vec::new();
    let cut = shared.s2s.cut_token();
    loop {
        if queue.is_empty() && !shared.s2s.wants_link(&remote) {
            let next = tokio::select! {
                _ = shared.shutdown.cancelled() => None,
                _ = cut.cancelled() => None,
                r = tokio::time::timeout(idle, rx.recv()) => r.ok().flatten(),
            };
            match next {
                Some(el) => queue.push(el),
                None => break,
            }
        }
        while let Ok(el) = rx.try_recv() {
            queue.push(el);
        }
        let attempt = tokio::select! {
            _ = shared.shutdown.cancelled() => break,
            _ = cut.cancelled() => break,
            r = tokio::time::timeout(
                cfg.connect_timeout,
                connect(&shared, &local, &remote),
            ) => r,
        };
        match attempt {
            Ok(Ok(stream)) => {
                failures = 0;
                super::link_up(&shared, &remote);
                match drain(
                    &shared,
                    stream,
                    std::mem::take(&mut queue),
                    &mut rx,
                    &pending,
                    idle,
                )
                .await
                {
                    End::Idle | End::Shutdown => break,
                    End::Closed => continue,
                    End::Lost(unsent) => {
                        tracing::info!(%local, %remote, unsent = unsent.len(), "outgoing s2s stream lost");
                        queue = unsent;
                        super::link_lost(&shared, &local, &remote);
                    }
                }
            }
            Ok(Err(e)) => {
                tracing::info!(%local, %remote, error = %e, "s2s connection failed");
                fail_queue(&shared, &mut queue, &mut rx, &pending, e.stanza_error());
                super::link_lost(&shared, &local, &remote);
            }
            Err(_) => {
                tracing::info!(%local, %remote, "s2s connection timed out");
                fail_queue(
                    &shared,
                    &mut queue,
                    &mut rx,
                    &pending,
                    StanzaError::remote_server_timeout(),
                );
                super::link_lost(&shared, &local, &remote);
            }
        }
        failures = failures.saturating_add(1);
        let unit = rand::Rng::gen_range(&mut rand::thread_rng(), 0.0..=1.0);
        let delay = reconnect_delay(failures, min_delay, max_delay, unit);
        tokio::select! {
            _ = shared.shutdown.cancelled() => break,
            _ = cut.cancelled() => break,
            _ = tokio::time::sleep(delay) => {}
        }
    }
    shared.s2s.remove_link(&key, id);
    rx.close();
    while let Ok(el) = rx.try_recv() {
        queue.push(el);
    }
    pending.fetch_sub(queue.len(), Ordering::SeqCst);
    let stopping = shared.shutdown.is_cancelled() || shared.s2s.is_severed();
    for el in queue.drain(..) {
        // A stanza that slipped in while this link was closing for idleness goes to a new
        // link rather than back to its sender: the remote is fine, only this stream ended.
        let routed = if stopping {
            Err(StanzaError::remote_server_not_found())
        } else {
            shared.s2s.enqueue(&local, &remote, el.clone())
        };
        if let Err(e) = routed {
            shared.outbox.bounce_unroutable(&el, e);
        }
    }
}

/// Bounces every queued stanza, and whatever waits in the channel, with `err`.
fn fail_queue(
    shared: &Shared,
    queue: &mut Vec<Element>,
    rx: &mut mpsc::Receiver<Element>,
    pending: &AtomicUsize,
    err: StanzaError,
) {
    while let Ok(el) = rx.try_recv() {
        queue.push(el);
    }
    pending.fetch_sub(queue.len(), Ordering::SeqCst);
    for el in queue.drain(..) {
        shared.outbox.bounce_unroutable(&el, err.clone());
    }
}

/// Writes queued and arriving stanzas until idle, loss or shutdown. A separate task reads
/// the peer side only to notice a close or an error.
async fn drain(
    shared: &Shared,
    stream: XmlStream,
    first: Vec<Element>,
    rx: &mut mpsc::Receiver<Element>,
    pending: &AtomicUsize,
    idle: Duration,
) -> End {
    use tokio::io::AsyncWriteExt;
    let cut = shared.s2s.cut_token();
    let (mut reader, mut writer) = stream.split();
    let (ended_tx, mut ended) = tokio::sync::oneshot::channel::<bool>();
    let watcher = tokio::spawn(async move {
        let clean = loop {
            match reader.next().await {
                Ok(crate::protocol::xml::reader::StreamEvent::Close) => break true,
                Ok(crate::protocol::xml::reader::StreamEvent::Stanza(el)) => {
                    if el.is("error", crate::protocol::xml::NS_STREAM) {
                        break false;
                    }
                    tracing::debug!(element = %el.name, "ignoring element on an outgoing s2s stream");
                }
                Ok(_) => {}
                Err(_) => break false,
            }
        };
        let _ = ended_tx.send(clean);
    });
    let close = |mut w: tokio::io::WriteHalf<BoxIo>| async move {
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            let _ = w.write_all(b"</stream:stream>").await;
            let _ = w.flush().await;
            let _ = w.shutdown().await;
        })
        .await;
    };
    let mut batch = first;
    let end = loop {
        if !batch.is_empty() {
            let mut out = String::new();
            for el in &batch {
                el.write_to(&mut out, NS_SERVER, NS_SERVER);
            }
            let wrote = tokio::time::timeout(Duration::from_secs(30), async {
                writer.write_all(out.as_bytes()).await?;
                writer.flush().await
            })
            .await;
            if !matches!(wrote, Ok(Ok(()))) {
                break End::Lost(batch);
            }
            pending.fetch_sub(batch.len(), Ordering::SeqCst);
            batch.clear();
        }
        tokio::select! {
            _ = shared.shutdown.cancelled() => {
                close(writer).await;
                break End::Shutdown;
            }
            _ = cut.cancelled() => break End::Shutdown,
            clean = &mut ended => {
                if clean.unwrap_or(false) {
                    close(writer).await;
                    break End::Closed;
                }
                break End::Lost(Vec::new());
            }
            r = tokio::time::timeout(idle, rx.recv()) => match r {
                Ok(Some(el)) => {
                    batch.push(el);
                    while batch.len() < 256 {
                        match rx.try_recv() {
                            Ok(el) => batch.push(el),
                            Err(_) => break,
                        }
                    }
                }
                Ok(None) => {
                    close(writer).await;
                    break End::Shutdown;
                }
                Err(_) => {
                    // Idle: close; a later stanza opens a new stream.
                    close(writer).await;
                    break End::Idle;
                }
            },
        }
    };
    watcher.abort();
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_millis(800);

    #[test]
    fn reconnect_delay_grows_from_min_and_is_capped_at_max() {
        // (failures, lowest, highest) in milliseconds for min = 100, max = 800.
        let expected = [
            (1, 100, 200),
            (2, 200, 400),
            (3, 400, 800),
            (4, 400, 800),
            (40, 400, 800),
        ];
        for (n, lo, hi) in expected {
            assert_eq!(reconnect_delay(n, MIN, MAX, 0.0).as_millis(), lo, "n={n}");
            assert_eq!(reconnect_delay(n, MIN, MAX, 1.0).as_millis(), hi, "n={n}");
        }
        // Out-of-range inputs stay within [min, max].
        assert_eq!(reconnect_delay(0, MIN, MAX, -3.0), MIN);
        assert_eq!(reconnect_delay(u32::MAX, MIN, MAX, 7.0), MAX);
    }

    #[test]
    fn reconnect_delay_stays_within_min_and_max_when_they_are_close() {
        // max < 2·min: the first cap is max and the floor never drops below min.
        let (min, max) = (Duration::from_millis(100), Duration::from_millis(150));
        for n in 1..10 {
            for unit in [0.0, 0.3, 0.999, 1.0] {
                let d = reconnect_delay(n, min, max, unit);
                assert!(d >= min && d <= max, "n={n} unit={unit}: {d:?}");
            }
        }
        let equal = Duration::from_millis(250);
        assert_eq!(reconnect_delay(3, equal, equal, 0.5), equal);
    }

    #[test]
    fn reconnect_delay_jitter_spreads_over_half_the_cap() {
        use rand::Rng;
        let mut rng = rand::thread_rng();
        for n in 1..6u32 {
            let draws: Vec<u128> = (0..400)
                .map(|_| reconnect_delay(n, MIN, MAX, rng.gen_range(0.0..=1.0)).as_millis())
                .collect();
            let (lo, hi) = (
                reconnect_delay(n, MIN, MAX, 0.0).as_millis(),
                reconnect_delay(n, MIN, MAX, 1.0).as_millis(),
            );
            assert!(draws.iter().all(|d| (lo..=hi).contains(d)), "n={n}");
            // 400 uniform draws cover both quarters at the ends of the range; the chance
            // that none lands in a given quarter is 0.75^400, about 1e-50.
            let quarter = (hi - lo) / 4;
            assert!(
                draws.iter().any(|d| *d <= lo + quarter),
                "n={n}: no low draw"
            );
            assert!(
                draws.iter().any(|d| *d >= hi - quarter),
                "n={n}: no high draw"
            );
        }
    }
}
