//! Outgoing server streams: resolution, connection, STARTTLS, SASL EXTERNAL or dialback,
//! and the task that drains one domain pair's queue.
//!
//! Resolution order (RFC 6120 §3.2, XEP-0368): a static route from `[s2s] routes`; else DNS
//! SRV `_xmpps-server._tcp` (direct TLS) and `_xmpp-server._tcp` (STARTTLS) merged by
//! priority; else the domain's own addresses on port 5269 (§3.2.2 fallback). DNS goes
//! only to the configured resolver (`[s2s] nameserver`), never anywhere when it is "none".

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use crate::c2s::BoxIo;
use crate::error::StanzaError;
use crate::server::Shared;
use crate::xml::reader::ReaderLimits;
use crate::xml::{Element, NS_SASL, NS_TLS};

use super::dialback::{self, NS_DIALBACK};
use super::stream::{header, Fail, S2sStream};
use super::AuthMethod;

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
    pub stream: S2sStream,
    /// The id the peer gave the current stream (the dialback key covers it).
    pub stream_id: String,
    /// The peer's stream features after TLS.
    pub features: Element,
    /// Whether the peer's certificate verified for its domain.
    pub verified: bool,
}

/// Builds the resolver for `[s2s] nameserver`.
pub fn build_resolver(nameserver: &str) -> Option<hickory_resolver::TokioResolver> {
    use hickory_resolver::config::{NameServerConfig, ResolverConfig};
    use hickory_resolver::net::runtime::TokioRuntimeProvider;
    if nameserver == "none" {
        return None;
    }
    let builder = if nameserver.is_empty() {
        match hickory_resolver::TokioResolver::builder_tokio() {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "no system DNS configuration; s2s uses static routes only");
                return None;
            }
        }
    } else {
        let addr: SocketAddr = nameserver.parse().ok()?;
        let mut ns = NameServerConfig::udp_and_tcp(addr.ip());
        for c in &mut ns.connections {
            c.port = addr.port();
        }
        hickory_resolver::TokioResolver::builder_with_config(
            ResolverConfig::from_name_servers(vec![ns]),
            TokioRuntimeProvider::default(),
        )
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
    if let Some(route) = shared.config.s2s.routes.get(domain) {
        if let Some((host, port)) = route.rsplit_once(':') {
            if let Ok(port) = port.parse() {
                return vec![Candidate {
                    host: host.trim_matches(['[', ']']).to_owned(),
                    port,
                    direct_tls: false,
                }];
            }
        }
        return Vec::new();
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
            .config
            .s2s
            .routes
            .values()
            .any(|r| r.starts_with(&c.host)) =>
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
    provider: Arc<rustls::crypto::CryptoProvider>,
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
        let by_roots = self.roots.as_ref().is_some_and(|v| {
            v.verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
                .is_ok()
        });
        let by_name = self.allow_self_signed && super::cert::names_domain(end_entity, server_name);
        let ok = by_roots || by_name;
        self.verified.store(ok, Ordering::SeqCst);
        if !ok && self.required {
            return Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::UnknownIssuer,
            ));
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

fn client_tls(
    shared: &Shared,
    remote: &str,
    direct: bool,
) -> Result<(Arc<rustls::ClientConfig>, Arc<AtomicBool>), String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let policy = shared.config.s2s.policy(remote);
    let verified = Arc::new(AtomicBool::new(false));
    let verifier = PeerVerifier {
        roots: shared.s2s.roots.clone(),
        allow_self_signed: policy.allow_self_signed,
        required: policy.require_verified_cert,
        verified: verified.clone(),
        provider: provider.clone(),
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

fn limits(shared: &Shared) -> ReaderLimits {
    ReaderLimits {
        max_stanza_size: shared.config.limits.max_stanza_size,
        max_depth: shared.config.limits.max_depth,
    }
}

/// Sends our header and reads the peer's header and features.
async fn open_stream(
    stream: &mut S2sStream,
    local: &str,
    remote: &str,
) -> Result<(String, Element), Fail> {
    stream
        .write(&header(Some(local), Some(remote), None))
        .await?;
    let h = stream.read_header().await?;
    let id = h.get_attr("id").unwrap_or_default().to_owned();
    let features = stream.next_element().await?;
    if !features.is("features", crate::xml::NS_STREAM) {
        return Err(Fail::Stream(crate::error::StreamError::new(
            "invalid-xml",
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
                let mut stream = S2sStream::new(Box::new(io) as BoxIo, limits(shared));
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
            let mut stream = S2sStream::new(Box::new(tcp) as BoxIo, limits(shared));
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
            let mut stream = S2sStream::new(Box::new(tls_io) as BoxIo, limits(shared));
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
) -> Result<S2sStream, ConnectError> {
    let mut secured = open_secure(shared, local, remote).await?;
    let policy = shared.config.s2s.policy(remote).clone();
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
async fn external(stream: &mut S2sStream) -> Result<Result<(), String>, Fail> {
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

/// A random delay in [d/2, d] so many servers do not reconnect in lock-step.
fn jitter(d: Duration) -> Duration {
    use rand::Rng;
    let ms = d.as_millis() as u64;
    Duration::from_millis(rand::thread_rng().gen_range(ms / 2..=ms.max(1)))
}

/// The task behind one (local, remote) link: connect on demand, drain, close when idle.
pub async fn run(
    shared: Arc<Shared>,
    key: (String, String),
    id: u64,
    mut rx: mpsc::Receiver<Element>,
) {
    let (local, remote) = key.clone();
    let cfg = shared.config.s2s.clone();
    let idle = Duration::from_secs(cfg.idle_timeout);
    let mut backoff = Duration::from_millis(cfg.reconnect_min_ms);
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
                Duration::from_secs(cfg.connect_timeout),
                connect(&shared, &local, &remote),
            ) => r,
        };
        match attempt {
            Ok(Ok(stream)) => {
                backoff = Duration::from_millis(cfg.reconnect_min_ms);
                shared.s2s.link_up(&remote);
                match drain(&shared, stream, std::mem::take(&mut queue), &mut rx, idle).await {
                    End::Idle | End::Shutdown => break,
                    End::Closed => continue,
                    End::Lost(unsent) => {
                        tracing::info!(%local, %remote, unsent = unsent.len(), "outgoing s2s stream lost");
                        queue = unsent;
                        shared.s2s.link_lost(&local, &remote);
                    }
                }
            }
            Ok(Err(e)) => {
                tracing::info!(%local, %remote, error = %e, "s2s connection failed");
                fail_queue(&shared, &mut queue, &mut rx, e.stanza_error());
                shared.s2s.link_lost(&local, &remote);
            }
            Err(_) => {
                tracing::info!(%local, %remote, "s2s connection timed out");
                fail_queue(&shared, &mut queue, &mut rx, super::remote_server_timeout());
                shared.s2s.link_lost(&local, &remote);
            }
        }
        tokio::select! {
            _ = shared.shutdown.cancelled() => break,
            _ = cut.cancelled() => break,
            _ = tokio::time::sleep(jitter(backoff)) => {}
        }
        backoff = (backoff * 2).min(Duration::from_millis(cfg.reconnect_max_ms));
    }
    shared.s2s.remove_link(&key, id);
    // Whatever arrived after we decided to stop goes back with an error.
    rx.close();
    fail_queue(
        &shared,
        &mut queue,
        &mut rx,
        StanzaError::remote_server_not_found(),
    );
}

fn fail_queue(
    shared: &Shared,
    queue: &mut Vec<Element>,
    rx: &mut mpsc::Receiver<Element>,
    err: StanzaError,
) {
    while let Ok(el) = rx.try_recv() {
        queue.push(el);
    }
    for el in queue.drain(..) {
        super::bounce(shared, &el, err.clone());
    }
}

/// Writes queued and arriving stanzas until idle, loss or shutdown. A separate task reads
/// the peer side only to notice a close or an error.
async fn drain(
    shared: &Shared,
    stream: S2sStream,
    first: Vec<Element>,
    rx: &mut mpsc::Receiver<Element>,
    idle: Duration,
) -> End {
    use tokio::io::AsyncWriteExt;
    let cut = shared.s2s.cut_token();
    let (mut reader, mut writer) = stream.split();
    let (ended_tx, mut ended) = tokio::sync::oneshot::channel::<bool>();
    let watcher = tokio::spawn(async move {
        let clean = loop {
            match reader.next().await {
                Ok(crate::xml::reader::StreamEvent::Close) => break true,
                Ok(crate::xml::reader::StreamEvent::Stanza(el)) => {
                    if el.is("error", crate::xml::NS_STREAM) {
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
                el.write_to(&mut out, crate::xml::NS_SERVER, crate::xml::NS_SERVER);
            }
            let wrote = tokio::time::timeout(Duration::from_secs(30), async {
                writer.write_all(out.as_bytes()).await?;
                writer.flush().await
            })
            .await;
            if !matches!(wrote, Ok(Ok(()))) {
                break End::Lost(batch);
            }
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
