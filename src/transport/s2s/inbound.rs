//! Incoming server streams: the s2s listener, STARTTLS, SASL EXTERNAL, dialback as
//! receiving and as authoritative server, and the origin checks every inbound stanza passes.
//!
//! A stream starts knowing nothing about its peer. If the TLS client certificate proves the
//! domain in the post-TLS stream header, EXTERNAL is offered and, once it succeeds, that
//! (remote domain, local domain) pair is authenticated (XEP-0178). Each `<db:result/>` the
//! peer sends asks to add one more pair, if policy allows dialback for that domain; it is
//! added only after the remote domain's authoritative server, reached by resolving that
//! name, confirmed the key (XEP-0220 §2.2). Stanzas are then accepted only for pairs in the set:
//!
//! - no `from` or `to`: `improper-addressing` (RFC 6120 §4.9.3.7);
//! - `to` a domain we do not serve: `host-unknown` (§4.9.3.6);
//! - `from` a domain this stream did not authenticate for that `to`: `invalid-from`
//!   (§4.9.3.9) — a peer cannot speak for domains it did not prove.
//!
//! Reading runs in this task; writing goes through a small writer task so that dialback
//! checks, which take a round trip to another server, answer when they finish without the
//! reader ever being cancelled mid-element.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::node::io::BoxIo;
use crate::node::Shared;
use crate::protocol::error::{StanzaError, StreamCondition, StreamError};
use crate::protocol::jid::Jid;
use crate::protocol::stanza::IqType;
use crate::protocol::xml::new_id;
use crate::protocol::xml::reader::ReaderLimits;
use crate::protocol::xml::{Element, NS_CLIENT, NS_SASL, NS_SERVER, NS_STREAM, NS_TLS};
use crate::services::presence::Presence;
use crate::transport::listener::{Handler, Listener, ListenerPolicy, StartError};
use rustls::pki_types::CertificateDer;

use super::dialback::{self, NS_DIALBACK, NS_DIALBACK_FEATURE};
use super::header;
use super::AuthMethod;
use crate::transport::stream::{Fail, XmlStream};

/// Addresses the s2s listeners bound.
#[derive(Debug, Clone, Copy, Default)]
pub struct Listening {
    /// STARTTLS s2s port.
    pub addr: Option<SocketAddr>,
    /// Direct TLS s2s port.
    pub direct_tls_addr: Option<SocketAddr>,
}

/// Binds the s2s listeners and starts accepting.
pub async fn listen(
    shared: &Arc<Shared>,
    presence: &Arc<Presence>,
) -> Result<Listening, StartError> {
    let mut out = Listening::default();
    let cfg = &shared.config.s2s;
    if !cfg.enabled {
        return Ok(out);
    }
    // One policy for both ports, as the client listeners share theirs.
    let policy = Arc::new(ListenerPolicy::s2s(&shared.config));
    for (port, direct) in [(cfg.port, false), (cfg.direct_tls_port, true)] {
        if direct && !cfg.direct_tls {
            continue;
        }
        let addr = SocketAddr::new(cfg.bind, port);
        let (listener, local) = crate::transport::listener::bind(addr).await?;
        tracing::info!(addr = %local, direct_tls = direct, "s2s listening");
        if direct {
            out.direct_tls_addr = Some(local);
        } else {
            out.addr = Some(local);
        }
        let handler = Inbound {
            shared: shared.clone(),
            presence: presence.clone(),
            direct_tls: direct,
        };
        Listener::new("s2s", listener, Some(policy.clone()), shared).spawn(handler);
    }
    Ok(out)
}

/// The s2s listeners' connections: an inbound server stream each ([`serve`]).
struct Inbound {
    shared: Arc<Shared>,
    /// Presence, and the privacy gate the stanzas the streams carry go through.
    presence: Arc<Presence>,
    /// Whether this is the direct TLS port (XEP-0368).
    direct_tls: bool,
}

impl Handler<TcpListener> for Inbound {
    fn serve(
        &self,
        tcp: TcpStream,
        peer: SocketAddr,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        serve(
            self.shared.clone(),
            self.presence.clone(),
            tcp,
            peer,
            self.direct_tls,
        )
    }

    /// While federation is severed, inbound connections are closed as they come.
    fn accepts(&self) -> bool {
        !self.shared.s2s.is_severed()
    }
}

/// Pairs (remote domain, local domain) this stream may carry stanzas for.
type Authenticated = Arc<Mutex<HashSet<(String, String)>>>;

/// Certificates the peer presented in the TLS handshake (end entity first).
type PeerCerts = Vec<CertificateDer<'static>>;

fn peer_certs(conn: &rustls::ServerConnection) -> PeerCerts {
    conn.peer_certificates()
        .map(|c| c.iter().map(|c| c.clone().into_owned()).collect())
        .unwrap_or_default()
}

/// Serves one inbound server connection.
pub async fn serve(
    shared: Arc<Shared>,
    presence: Arc<Presence>,
    tcp: TcpStream,
    peer: SocketAddr,
    direct_tls: bool,
) {
    let limits = ReaderLimits::for_peer(&shared.live.get().limits, false);
    let deadline = tokio::time::Instant::now() + shared.live.get().limits.negotiation_timeout;
    let mut certs = PeerCerts::new();
    let io: BoxIo = if direct_tls {
        let acceptor = tokio_rustls::TlsAcceptor::from(shared.s2s_tls.clone());
        match tokio::time::timeout_at(deadline, acceptor.accept(tcp)).await {
            Ok(Ok(tls)) => {
                certs = peer_certs(tls.get_ref().1);
                Box::new(tls)
            }
            _ => {
                tracing::info!(%peer, "s2s direct TLS handshake failed");
                return;
            }
        }
    } else {
        Box::new(tcp)
    };
    let stream = XmlStream::new(io, limits, NS_SERVER);
    let cut = shared.s2s.cut_token();
    let negotiated = tokio::select! {
        r = tokio::time::timeout_at(deadline, negotiate(&shared, stream, direct_tls, certs, peer)) => r,
        _ = cut.cancelled() => return,
    };
    let n = match negotiated {
        Ok(Ok(x)) => x,
        Ok(Err(None)) => return,
        Ok(Err(Some((mut stream, err)))) => {
            tracing::info!(%peer, error = %err, "s2s stream refused");
            stream.fail(&err).await;
            return;
        }
        Err(_) => {
            tracing::info!(%peer, "s2s negotiation timed out");
            return;
        }
    };
    run(shared, presence, n, peer, deadline).await;
}

/// How a negotiation ended early: with the stream error to send on the stream, or with
/// nothing more to write (the peer went away, a TLS handshake failed).
type Refusal = Option<(XmlStream, StreamError)>;

/// A secured inbound stream, ready for stanzas or dialback.
struct Negotiated {
    stream: XmlStream,
    /// The local domain the stream was opened to.
    local_domain: String,
    /// Our stream id (dialback keys cover it).
    stream_id: String,
    /// The remote domain SASL EXTERNAL authenticated, if it did.
    external: Option<String>,
    /// An element read while waiting for a possible `<auth/>`, not yet handled.
    pending: Option<Element>,
}

// Negotiation is a typestate, as c2s's is: a stream is `Connected` (plain TCP), then
// `Secured` (TLS: STARTTLS or XEP-0368 direct TLS), then, when its certificate proves the
// domain its header claims, `Offered` SASL EXTERNAL (XEP-0178), then `External` (the
// restarted stream of a domain EXTERNAL authenticated), and finally `Negotiated`. Each
// step consumes one state and returns the next, or the `Refusal` that ends the stream:
// only `Secured` can be offered EXTERNAL, only `Offered` can authenticate.

/// A stream over plain TCP: it can only start TLS (RFC 7590: federation only over TLS).
struct Connected {
    stream: XmlStream,
}

/// A stream over TLS, its peer's certificates at hand, its header not read yet.
struct Secured {
    stream: XmlStream,
    certs: PeerCerts,
}

/// A secured stream whose certificate proves the domain its header claims: EXTERNAL is
/// offered, and the next element may be `<auth/>`.
struct Offered {
    stream: XmlStream,
    header: Opened,
    /// The domain the header claims and the certificate proves.
    claimed: String,
    /// Failed attempts so far.
    failures: u32,
}

/// A stream SASL EXTERNAL authenticated for `remote`, restarted (RFC 6120 §6.4.6): the
/// new stream's header is still to be read.
struct External {
    stream: XmlStream,
    remote: String,
}

/// Where a secured stream goes after its header: to EXTERNAL, or straight on.
enum AfterHeader {
    Offered(Offered),
    Negotiated(Negotiated),
}

/// Where an offer of EXTERNAL goes: authenticated, or on without SASL (the peer prefers
/// dialback, or sends stanzas under a pair it authenticates otherwise).
enum AfterOffer {
    External(External),
    Negotiated(Negotiated),
}

/// Negotiates an inbound stream (RFC 6120 §4.3): STARTTLS unless TLS is direct, then SASL
/// EXTERNAL if the peer's certificate proves the domain it claims (XEP-0178).
async fn negotiate(
    shared: &Arc<Shared>,
    stream: XmlStream,
    direct_tls: bool,
    certs: PeerCerts,
    peer: SocketAddr,
) -> Result<Negotiated, Refusal> {
    let secured = if direct_tls {
        Secured { stream, certs }
    } else {
        Connected { stream }.starttls(shared, peer).await?
    };
    let offered = match secured.open(shared).await? {
        AfterHeader::Offered(offered) => offered,
        AfterHeader::Negotiated(n) => return Ok(n),
    };
    match offered.authenticate(shared, peer).await? {
        AfterOffer::External(external) => external.open(shared).await,
        AfterOffer::Negotiated(n) => Ok(n),
    }
}

/// A stream header read, answered and found acceptable.
struct Opened {
    /// The local domain it is opened to.
    to: String,
    /// Our stream id.
    id: String,
    /// The domain the peer claims: a bare domain that is not ours (RFC 6120 §4.7.1).
    from: Option<String>,
    /// The policy for that domain (the default one without a claim).
    policy: crate::config::S2sPolicy,
}

/// Reads and answers the peer's header (RFC 6120 §4.7). `Err(None)`: the peer went away.
async fn read_header(
    shared: &Shared,
    stream: &mut XmlStream,
) -> Result<Opened, Option<StreamError>> {
    let h = match stream.read_header().await {
        Ok(h) => h,
        Err(Fail::Stream(e)) => return Err(Some(e)),
        Err(_) => return Err(None),
    };
    let to = h.get_attr("to").unwrap_or_default().to_owned();
    let id = new_id();
    let our_from = if shared.config.serves(&to) {
        to.clone()
    } else {
        shared.config.domains[0].clone()
    };
    let head = header(Some(&our_from), h.get_attr("from"), Some(&id));
    if stream.write(&head).await.is_err() {
        return Err(None);
    }
    if h.name != "stream" || h.ns != NS_STREAM {
        let e = StreamError::new(StreamCondition::InvalidNamespace, "not a stream element");
        return Err(Some(e));
    }
    if h.default_ns.as_deref() != Some(NS_SERVER) {
        // RFC 6120 §4.8.2 / §4.9.3.10.
        return Err(Some(StreamError::new(
            StreamCondition::InvalidNamespace,
            "a server stream's content namespace is jabber:server",
        )));
    }
    if !shared.config.serves(&to) {
        // RFC 6120 §4.9.3.6.
        return Err(Some(StreamError::new(
            StreamCondition::HostUnknown,
            format!("this server does not serve '{to}'"),
        )));
    }
    // As parsed (RFC 7622 §3.2), so it names the domain its stanzas' `from` will.
    let from = h
        .get_attr("from")
        .and_then(|f| crate::protocol::jid::parse_bare(f).ok())
        .filter(|j| j.node().is_none())
        .map(|j| j.domain().to_string())
        .filter(|f| !shared.config.serves(f));
    let policy = match &from {
        Some(f) => shared.live.get().s2s.policy(f).clone(),
        None => shared.live.get().s2s.default_policy.clone(),
    };
    Ok(Opened {
        to,
        id,
        from,
        policy,
    })
}

/// The header read on `stream`, or the refusal that ends it.
async fn opened(shared: &Shared, mut stream: XmlStream) -> Result<(XmlStream, Opened), Refusal> {
    match read_header(shared, &mut stream).await {
        Ok(h) => Ok((stream, h)),
        Err(e) => Err(e.map(|e| (stream, e))),
    }
}

/// Writes `s`; a write that fails ends the stream with nothing more to say.
async fn send(stream: &mut XmlStream, s: &str) -> Result<(), Refusal> {
    stream.write(s).await.map_err(|_| None)
}

/// The next element, or the refusal that ends the stream.
async fn next(mut stream: XmlStream) -> Result<(XmlStream, Element), Refusal> {
    match stream.next_element().await {
        Ok(el) => Ok((stream, el)),
        Err(Fail::Stream(e)) => Err(Some((stream, e))),
        Err(_) => Err(None),
    }
}

/// The features of a secured stream: EXTERNAL when offered, dialback where policy allows.
fn secured_features(offer_external: bool, policy: &crate::config::S2sPolicy) -> String {
    let mut features = String::from("<stream:features>");
    if offer_external {
        features.push_str(&format!(
            "<mechanisms xmlns='{NS_SASL}'><mechanism>EXTERNAL</mechanism></mechanisms>"
        ));
    }
    if policy.allow_dialback && !policy.require_verified_cert {
        features.push_str(&format!(
            "<dialback xmlns='{NS_DIALBACK_FEATURE}'><errors/></dialback>"
        ));
    }
    features.push_str("</stream:features>");
    features
}

impl Negotiated {
    fn new(stream: XmlStream, header: Opened, external: Option<String>) -> Self {
        Negotiated {
            stream,
            local_domain: header.to,
            stream_id: header.id,
            external,
            pending: None,
        }
    }
}

impl Connected {
    /// Answers the header with STARTTLS as the only feature, and takes the TLS handshake
    /// that must follow (RFC 6120 §5.4).
    async fn starttls(self, shared: &Arc<Shared>, peer: SocketAddr) -> Result<Secured, Refusal> {
        let (mut stream, _) = opened(shared, self.stream).await?;
        let features = format!(
            "<stream:features><starttls xmlns='{NS_TLS}'><required/></starttls></stream:features>"
        );
        send(&mut stream, &features).await?;
        let (mut stream, el) = next(stream).await?;
        if !el.is("starttls", NS_TLS) {
            let e = StreamError::new(
                StreamCondition::PolicyViolation,
                "STARTTLS is required (RFC 7590)",
            );
            return Err(Some((stream, e)));
        }
        send(&mut stream, &format!("<proceed xmlns='{NS_TLS}'/>")).await?;
        let limits = ReaderLimits::for_peer(&shared.live.get().limits, false);
        let acceptor = tokio_rustls::TlsAcceptor::from(shared.s2s_tls.clone());
        match acceptor.accept(stream.into_io()).await {
            Ok(tls) => Ok(Secured {
                certs: peer_certs(tls.get_ref().1),
                stream: XmlStream::new(Box::new(tls), limits, NS_SERVER),
            }),
            Err(e) => {
                tracing::info!(%peer, error = %e, "s2s STARTTLS handshake failed");
                Err(None)
            }
        }
    }
}

impl Secured {
    /// Answers the header; offers EXTERNAL only when the certificate proves the domain the
    /// header claims (XEP-0178 §3).
    async fn open(self, shared: &Shared) -> Result<AfterHeader, Refusal> {
        let (mut stream, header) = opened(shared, self.stream).await?;
        let claimed = header.from.clone().filter(|f| {
            super::cert::proves_domain(
                shared.s2s.roots.as_deref(),
                header.policy.allow_self_signed,
                &self.certs,
                f,
            )
        });
        send(
            &mut stream,
            &secured_features(claimed.is_some(), &header.policy),
        )
        .await?;
        Ok(match claimed {
            Some(claimed) => AfterHeader::Offered(Offered {
                stream,
                header,
                claimed,
                failures: 0,
            }),
            None => AfterHeader::Negotiated(Negotiated::new(stream, header, None)),
        })
    }
}

impl Offered {
    /// Waits for `<auth/>`; anything else (a db:result from a peer that prefers dialback,
    /// a stanza) is handed on unread. Failed attempts may be retried, up to `[limits]
    /// max_auth_failures`.
    async fn authenticate(
        mut self,
        shared: &Shared,
        peer: SocketAddr,
    ) -> Result<AfterOffer, Refusal> {
        loop {
            let (stream, el) = next(self.stream).await?;
            self.stream = stream;
            if !el.is("auth", NS_SASL) {
                let mut n = Negotiated::new(self.stream, self.header, None);
                n.pending = Some(el);
                return Ok(AfterOffer::Negotiated(n));
            }
            let mechanism = el.get_attr("mechanism").unwrap_or_default().to_owned();
            let mut response = el.text_content();
            if response.is_empty() {
                let (offered, answer) = self.challenge().await?;
                self = offered;
                match answer {
                    Some(r) => response = r,
                    None => continue,
                }
            }
            let from = self.header.from.as_deref();
            match super::cert::decide_external(&mechanism, true, Some(&self.claimed), &response) {
                Ok(domain) => {
                    send(&mut self.stream, &format!("<success xmlns='{NS_SASL}'/>")).await?;
                    let local = &self.header.to;
                    tracing::info!(%peer, remote = %domain, %local, "inbound s2s stream authenticated by SASL EXTERNAL");
                    // RFC 6120 §6.4.6: a new stream on the same TLS layer; the certificate
                    // stays the one already checked.
                    return Ok(AfterOffer::External(External {
                        stream: self.stream.restart(),
                        remote: domain,
                    }));
                }
                Err(condition) => {
                    tracing::warn!(%peer, claimed = ?from, %mechanism, %condition, "SASL EXTERNAL refused");
                    let f = format!("<failure xmlns='{NS_SASL}'><{condition}/></failure>");
                    send(&mut self.stream, &f).await?;
                    self.failures += 1;
                    if self.failures >= shared.live.get().limits.max_auth_failures {
                        let e = StreamError::new(
                            StreamCondition::PolicyViolation,
                            "too many failed authentication attempts",
                        );
                        return Err(Some((self.stream, e)));
                    }
                }
            }
        }
    }

    /// An `<auth/>` without an initial response: an empty challenge asks for it (RFC 6120
    /// §6.4.3). `None`: the peer aborted (§6.4.5) and may try again.
    async fn challenge(mut self) -> Result<(Self, Option<String>), Refusal> {
        send(&mut self.stream, &format!("<challenge xmlns='{NS_SASL}'/>")).await?;
        let (stream, r) = next(self.stream).await?;
        self.stream = stream;
        if r.is("response", NS_SASL) {
            return Ok((self, Some(r.text_content())));
        }
        if r.is("abort", NS_SASL) {
            let f = format!("<failure xmlns='{NS_SASL}'><aborted/></failure>");
            send(&mut self.stream, &f).await?;
            return Ok((self, None));
        }
        let e = StreamError::new(StreamCondition::PolicyViolation, "expected a SASL response");
        Err(Some((self.stream, e)))
    }
}

impl External {
    /// Answers the restarted stream's header: EXTERNAL is not offered again (once per
    /// stream), dialback where policy allows, for further domain pairs.
    async fn open(self, shared: &Shared) -> Result<Negotiated, Refusal> {
        let (mut stream, header) = opened(shared, self.stream).await?;
        send(&mut stream, &secured_features(false, &header.policy)).await?;
        Ok(Negotiated::new(stream, header, Some(self.remote)))
    }
}

/// SASL was not offered on this stream (the certificate proves nothing, or the stream
/// already authenticated): refuse, but keep the stream so the peer can fall back to
/// dialback (XEP-0178 §3, RFC 6120 §6.5.10). The stream error once the refusals reach
/// `[limits] max_auth_failures`.
async fn refuse_sasl(
    shared: &Shared,
    el: &Element,
    peer: SocketAddr,
    out_tx: &mpsc::Sender<Out>,
    refusals: &mut u32,
) -> Option<StreamError> {
    tracing::warn!(%peer, mechanism = ?el.get_attr("mechanism"), "SASL attempted where it was not offered; not-authorized");
    let f = format!("<failure xmlns='{NS_SASL}'><not-authorized/></failure>");
    let _ = out_tx.send(Out::Raw(f)).await;
    *refusals += 1;
    (*refusals >= shared.live.get().limits.max_auth_failures).then(|| {
        StreamError::new(
            StreamCondition::PolicyViolation,
            "too many failed authentication attempts",
        )
    })
}

/// What the writer task is asked to do.
enum Out {
    Raw(String),
    Error(StreamError),
}

async fn run(
    shared: Arc<Shared>,
    presence: Arc<Presence>,
    n: Negotiated,
    peer: SocketAddr,
    deadline: tokio::time::Instant,
) {
    let Negotiated {
        stream,
        local_domain,
        stream_id,
        external,
        mut pending,
    } = n;
    let (mut reader, writer) = stream.split();
    // Dialback authenticates without a stream restart, in a task of its own: the stanza
    // cost limit is raised through this, read by the reader at every stanza start.
    let node_limit = Arc::new(AtomicUsize::new(
        ReaderLimits::for_peer(&shared.live.get().limits, external.is_some()).max_stanza_nodes,
    ));
    reader.share_node_limit(node_limit.clone());
    let (out_tx, out_rx) = mpsc::channel::<Out>(64);
    let writer_task = tokio::spawn(write(writer, out_rx));
    let authed = authenticated(&shared, external, &local_domain);
    let mut bucket = crate::policy::rate_limit::TokenBucket::new(
        shared.config.s2s.stanzas_per_second,
        shared.config.s2s.stanza_burst,
    );
    let cut = shared.s2s.cut_token();
    let mut clean = false;
    let mut sasl_refusals = 0u32;
    let error: Option<StreamError> = loop {
        let unauthenticated = authed.lock().map(|a| a.is_empty()).unwrap_or(true);
        let ev = if let Some(el) = pending.take() {
            Ok(crate::protocol::xml::reader::StreamEvent::Stanza(el))
        } else {
            tokio::select! {
            ev = reader.next() => ev,
            _ = cut.cancelled() => break None,
            _ = shared.shutdown.cancelled() => break None,
            // Until something is authenticated, the negotiation deadline applies
            // (RFC 6120 §4.9.3.4 connection-timeout).
            _ = tokio::time::sleep_until(deadline), if unauthenticated => {
                break Some(StreamError::new(StreamCondition::ConnectionTimeout, "no authentication in time"));
            }
            }
        };
        let el = match ev {
            Ok(crate::protocol::xml::reader::StreamEvent::Stanza(el)) => el,
            Ok(crate::protocol::xml::reader::StreamEvent::Whitespace) => continue,
            Ok(crate::protocol::xml::reader::StreamEvent::Close) => {
                clean = true;
                let _ = out_tx.send(Out::Raw("</stream:stream>".into())).await;
                break None;
            }
            Ok(crate::protocol::xml::reader::StreamEvent::Open(_)) => {
                break Some(StreamError::new(
                    StreamCondition::NotWellFormed,
                    "second stream header",
                ))
            }
            Err(e) => break StreamError::of_xml(&e),
        };
        if el.is("result", NS_DIALBACK) {
            let auth = (&authed, &node_limit);
            if let Err(e) = on_result(&shared, &el, &stream_id, auth, &out_tx, peer).await {
                break Some(e);
            }
            continue;
        }
        if el.is("verify", NS_DIALBACK) {
            on_verify(&shared, &el, &out_tx).await;
            continue;
        }
        if el.is("auth", NS_SASL) {
            match refuse_sasl(&shared, &el, peer, &out_tx, &mut sasl_refusals).await {
                Some(e) => break Some(e),
                None => continue,
            }
        }
        if el.is("error", NS_STREAM) {
            tracing::info!(%peer, error = %el, "peer ended its s2s stream with an error");
            break None;
        }
        if el.ns != NS_CLIENT || !matches!(el.name.as_str(), "message" | "presence" | "iq") {
            // RFC 6120 §4.9.3.22.
            break Some(StreamError::new(
                StreamCondition::UnsupportedStanzaType,
                format!("<{}/> is not a stanza", el.name),
            ));
        }
        if !bucket.take(shared.liveness.clock.instant()) {
            break Some(StreamError::new(
                StreamCondition::PolicyViolation,
                "too many stanzas per second",
            ));
        }
        let mut el = el;
        let (from, to) = match check_origin(&shared, &mut el, &authed) {
            Ok(addresses) => addresses,
            Err(e) => break Some(e),
        };
        super::deliver_inbound(&presence, from, to, el).await;
    };
    let ending = Ending {
        error,
        clean,
        out_tx,
        writer_task,
    };
    end(&shared, peer, ending, &authed, &cut).await;
    tracing::info!(%peer, %local_domain, "inbound s2s stream ended");
}

/// The pairs a new stream starts with: the one SASL EXTERNAL authenticated, if it did.
fn authenticated(shared: &Arc<Shared>, external: Option<String>, local: &str) -> Authenticated {
    let authed: Authenticated = Arc::default();
    if let Some(remote) = external {
        if let Ok(mut a) = authed.lock() {
            a.insert((remote.clone(), local.to_owned()));
        }
        shared.s2s.authenticated(AuthMethod::External, true);
        super::link_up(shared, &remote);
    }
    authed
}

/// Writes what the stream's tasks send, each write within 30 s; a stream error is the last.
async fn write(mut writer: tokio::io::WriteHalf<BoxIo>, mut out_rx: mpsc::Receiver<Out>) {
    while let Some(m) = out_rx.recv().await {
        let (s, last) = match m {
            Out::Raw(s) => (s, false),
            Out::Error(e) => (format!("{}</stream:stream>", e.to_xml()), true),
        };
        let ok = tokio::time::timeout(Duration::from_secs(30), async {
            writer.write_all(s.as_bytes()).await?;
            writer.flush().await
        })
        .await;
        if !matches!(ok, Ok(Ok(()))) || last {
            break;
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(2), writer.shutdown()).await;
}

/// How a stream's reading ended, and its writer.
struct Ending {
    /// The stream error to send, if any.
    error: Option<StreamError>,
    /// Whether the peer closed its stream.
    clean: bool,
    out_tx: mpsc::Sender<Out>,
    writer_task: tokio::task::JoinHandle<()>,
}

/// Sends the stream error, if any; a stream that died (EOF without `</stream:stream>`)
/// loses its links; the writer gets 5 s to finish unless federation was cut.
async fn end(
    shared: &Arc<Shared>,
    peer: SocketAddr,
    ending: Ending,
    authed: &Authenticated,
    cut: &tokio_util::sync::CancellationToken,
) {
    let Ending {
        error,
        clean,
        out_tx,
        writer_task,
    } = ending;
    let remotes: Vec<(String, String)> = authed
        .lock()
        .map(|a| a.iter().cloned().collect())
        .unwrap_or_default();
    if let Some(err) = error {
        tracing::info!(%peer, error = %err, "closing inbound s2s stream");
        let _ = out_tx.send(Out::Error(err)).await;
    } else if !clean && !cut.is_cancelled() && !shared.shutdown.is_cancelled() {
        // EOF without </stream:stream>: the peer or the network died.
        for (remote, local) in &remotes {
            super::link_lost(shared, local, remote);
        }
    }
    drop(out_tx);
    if cut.is_cancelled() {
        writer_task.abort();
    } else {
        let _ = tokio::time::timeout(Duration::from_secs(5), writer_task).await;
    }
}

/// RFC 6120 §4.9.3.7 / §4.9.3.6 / §4.9.3.9, in that order. The stanza leaves with its
/// addresses as parsed (RFC 7622: `bob@b.example.` is `bob@b.example`), so everything
/// after this edge sees one spelling of each JID.
fn check_origin(
    shared: &Shared,
    el: &mut Element,
    authed: &Authenticated,
) -> Result<(Jid, Jid), StreamError> {
    let (Some(from), Some(to)) = (el.get_attr("from"), el.get_attr("to")) else {
        return Err(StreamError::new(
            StreamCondition::ImproperAddressing,
            "stanzas between servers need both 'from' and 'to'",
        ));
    };
    let (Ok(from), Ok(to)) = (
        crate::protocol::jid::parse(from),
        crate::protocol::jid::parse(to),
    ) else {
        return Err(StreamError::new(
            StreamCondition::ImproperAddressing,
            "malformed address",
        ));
    };
    let to_domain = to.domain().as_str();
    if !shared.config.serves(to_domain) {
        return Err(StreamError::new(
            StreamCondition::HostUnknown,
            format!("this server does not serve '{to_domain}'"),
        ));
    }
    let pair = (from.domain().to_string(), to_domain.to_owned());
    if !authed.lock().map(|a| a.contains(&pair)).unwrap_or(false) {
        return Err(StreamError::new(
            StreamCondition::InvalidFrom,
            format!("this stream is not authenticated for '{}'", pair.0),
        ));
    }
    el.set_attr("from", from.as_str());
    el.set_attr("to", to.as_str());
    Ok((from, to))
}

/// Receiving-server role: a `<db:result>` with a key (XEP-0220 §2.1.2). The check runs in
/// its own task and answers on this stream when done.
async fn on_result(
    shared: &Arc<Shared>,
    el: &Element,
    stream_id: &str,
    (authed, node_limit): (&Authenticated, &Arc<AtomicUsize>),
    out: &mpsc::Sender<Out>,
    peer: SocketAddr,
) -> Result<(), StreamError> {
    let (Some(from), Some(to)) = (el.get_attr("from"), el.get_attr("to")) else {
        return Err(StreamError::new(
            StreamCondition::ImproperAddressing,
            "db:result needs from and to",
        ));
    };
    let (from, to) = (from.to_owned(), to.to_owned());
    let error_result = |cond: &str| {
        format!(
            "<db:result from='{}' to='{}' type='error'><error type='cancel'><{cond} xmlns='urn:ietf:params:xml:ns:xmpp-stanzas'/></error></db:result>",
            crate::protocol::xml::escape(&to),
            crate::protocol::xml::escape(&from)
        )
    };
    if !shared.config.serves(&to) {
        // XEP-0220 §2.4.3: item-not-found for a domain we do not host.
        let _ = out.send(Out::Raw(error_result("item-not-found"))).await;
        return Ok(());
    }
    if crate::protocol::jid::parse(&from)
        .map(|j| j.node().is_some())
        .unwrap_or(true)
        || shared.config.serves(&from)
    {
        let _ = out
            .send(Out::Raw(error_result("improper-addressing")))
            .await;
        return Ok(());
    }
    let policy = shared.live.get().s2s.policy(&from).clone();
    if !policy.allow_dialback || policy.require_verified_cert {
        // Policy demands a verified certificate (SASL EXTERNAL) for this domain, or
        // forbids dialback: refuse the key unchecked (XEP-0220 §2.4.3 policy-violation).
        tracing::warn!(%peer, remote = %from, local = %to, "dialback refused by policy");
        let _ = out.send(Out::Raw(error_result("policy-violation"))).await;
        return Ok(());
    }
    let key = el.text_content();
    let (shared, authed, node_limit, out, stream_id) = (
        shared.clone(),
        authed.clone(),
        node_limit.clone(),
        out.clone(),
        stream_id.to_owned(),
    );
    tokio::spawn(async move {
        let valid = dialback::verify_with_authoritative(
            shared.clone(),
            to.clone(),
            from.clone(),
            stream_id,
            key,
        )
        .await;
        let ty = if valid { "valid" } else { "invalid" };
        if valid {
            if let Ok(mut a) = authed.lock() {
                a.insert((from.clone(), to.clone()));
            }
            // Before the peer learns it may send stanzas.
            let limits = ReaderLimits::for_peer(&shared.live.get().limits, true);
            node_limit.store(limits.max_stanza_nodes, Ordering::Release);
        }
        let reply = dialback::element("result", &to, &from, None, Some(ty), None);
        let _ = out.send(Out::Raw(reply)).await;
        if valid {
            tracing::info!(remote = %from, local = %to, "inbound s2s stream authenticated by dialback");
            shared.s2s.authenticated(AuthMethod::Dialback, true);
            super::link_up(&shared, &from);
        } else {
            tracing::warn!(remote = %from, local = %to, "dialback key did not verify; closing");
            // XEP-0220 §2.4: an invalid key ends the attempt; the stream cannot be trusted.
            let _ = out
                .send(Out::Error(StreamError::new(
                    StreamCondition::NotAuthorized,
                    "dialback key did not verify",
                )))
                .await;
        }
    });
    Ok(())
}

/// Authoritative-server role: a `<db:verify>` asks whether we issued a key (XEP-0220 §2.2).
/// `from` is the receiving server, `to` is us as originating server.
async fn on_verify(shared: &Shared, el: &Element, out: &mpsc::Sender<Out>) {
    let (Some(from), Some(to), Some(id)) =
        (el.get_attr("from"), el.get_attr("to"), el.get_attr("id"))
    else {
        return;
    };
    let valid =
        shared.config.serves(to) && shared.s2s.secret.verify(from, to, id, &el.text_content());
    let ty = if valid { "valid" } else { "invalid" };
    tracing::info!(receiving = %from, originating = %to, valid, "answered dialback verify");
    let reply = dialback::element("verify", to, from, Some(id), Some(ty), None);
    let _ = out.send(Out::Raw(reply)).await;
}

/// A message from a remote server to a local user (RFC 6121 §8.5), delivered as a local
/// one is ([`crate::routing::delivery::message`]: the recipient's block list and the privacy gate
/// apply); an error goes back over federation.
pub(crate) async fn message(presence: &Presence, from: Jid, to: Jid, el: Element) {
    if to.node().is_none() {
        // No handler for messages to the server itself (RFC 6120 §10.3.1).
        presence
            .outbox
            .bounce(&el, StanzaError::service_unavailable());
        return;
    }
    crate::routing::delivery::message(presence, &from, to, el).await;
}

/// An iq from a remote server (RFC 6120 §10.5): to a local full JID it goes through
/// [`crate::routing::delivery::iq`] (block list, privacy gate, the offline answer otherwise); the
/// server answers ping (XEP-0199) to a bare JID itself; every other request gets
/// service-unavailable so the requester is never left waiting.
pub(crate) async fn iq(presence: &Presence, from: Jid, to: Jid, el: Element) {
    let ty = IqType::of(&el);
    let is_request = ty.is_some_and(IqType::is_request);
    let to = match to.try_into_full() {
        Ok(full) => {
            crate::routing::delivery::iq(presence, &from, &full, el).await;
            return;
        }
        Err(bare) => bare,
    };
    if !is_request {
        // A remote app server's answer to a XEP-0357 notification from the account.
        if to.node().is_some() {
            presence.push.answer(&el);
        }
        return;
    }
    if to.node().is_some()
        && crate::routing::delivery::admit_from(presence, from.as_str(), to.as_str(), &el).await
            != crate::services::blocking::Verdict::Pass
    {
        return;
    }
    let ping = el
        .elements()
        .next()
        .is_some_and(|p| p.is("ping", crate::protocol::xml::NS_PING))
        && ty == Some(IqType::Get);
    let reply = if ping {
        crate::protocol::error::iq_result(&el)
    } else {
        match StanzaError::service_unavailable().reply_to(&el) {
            Some(r) => r,
            None => return,
        }
    };
    let _ = presence.outbox.route_remote(reply);
}
