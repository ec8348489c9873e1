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

use crate::error::{StanzaError, StreamCondition, StreamError};
use crate::jid::Jid;
use crate::node::listen::{Handler, Listener, ListenerPolicy, StartError};
use crate::node::Shared;
use crate::stanza::IqType;
use crate::tls::BoxIo;
use crate::xml::new_id;
use crate::xml::reader::ReaderLimits;
use crate::xml::{Element, NS_CLIENT, NS_SASL, NS_SERVER, NS_STREAM, NS_TLS};
use rustls::pki_types::CertificateDer;

use super::dialback::{self, NS_DIALBACK, NS_DIALBACK_FEATURE};
use super::header;
use super::AuthMethod;
use crate::stream::{Fail, XmlStream};

/// Addresses the s2s listeners bound.
#[derive(Debug, Clone, Copy, Default)]
pub struct Listening {
    /// STARTTLS s2s port.
    pub addr: Option<SocketAddr>,
    /// Direct TLS s2s port.
    pub direct_tls_addr: Option<SocketAddr>,
}

/// Binds the s2s listeners and starts accepting.
pub async fn listen(shared: &Arc<Shared>) -> Result<Listening, StartError> {
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
        let (listener, local) = crate::node::listen::bind(addr).await?;
        tracing::info!(addr = %local, direct_tls = direct, "s2s listening");
        if direct {
            out.direct_tls_addr = Some(local);
        } else {
            out.addr = Some(local);
        }
        let handler = Inbound {
            shared: shared.clone(),
            direct_tls: direct,
        };
        Listener::new("s2s", listener, Some(policy.clone()), shared).spawn(handler);
    }
    Ok(out)
}

/// The s2s listeners' connections: an inbound server stream each ([`serve`]).
struct Inbound {
    shared: Arc<Shared>,
    /// Whether this is the direct TLS port (XEP-0368).
    direct_tls: bool,
}

impl Handler<TcpListener> for Inbound {
    fn serve(
        &self,
        tcp: TcpStream,
        peer: SocketAddr,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        serve(self.shared.clone(), tcp, peer, self.direct_tls)
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
pub async fn serve(shared: Arc<Shared>, tcp: TcpStream, peer: SocketAddr, direct_tls: bool) {
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
    run(shared, n, peer, deadline).await;
}

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

/// Reads and answers the peer's header (RFC 6120 §4.7); STARTTLS if not yet secure; then
/// SASL EXTERNAL if the peer's certificate proves the domain it claims (XEP-0178).
async fn negotiate(
    shared: &Arc<Shared>,
    mut stream: XmlStream,
    mut secure: bool,
    mut certs: PeerCerts,
    peer: SocketAddr,
) -> Result<Negotiated, Refusal> {
    let mut external: Option<String> = None;
    let mut failures = 0u32;
    loop {
        let h = match stream.read_header().await {
            Ok(h) => h,
            Err(Fail::Stream(e)) => return Err(Some((stream, e))),
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
            return Err(Some((stream, e)));
        }
        if h.default_ns.as_deref() != Some(NS_SERVER) {
            // RFC 6120 §4.8.2 / §4.9.3.10.
            let e = StreamError::new(
                StreamCondition::InvalidNamespace,
                "a server stream's content namespace is jabber:server",
            );
            return Err(Some((stream, e)));
        }
        if !shared.config.serves(&to) {
            // RFC 6120 §4.9.3.6.
            let e = StreamError::new(
                StreamCondition::HostUnknown,
                format!("this server does not serve '{to}'"),
            );
            return Err(Some((stream, e)));
        }
        // The domain the peer claims: a bare domain that is not ours (RFC 6120 §4.7.1).
        let from = h
            .get_attr("from")
            .filter(|f| Jid::new(f).is_ok_and(|j| j.node().is_none() && j.resource().is_none()))
            .filter(|f| !shared.config.serves(f))
            .map(str::to_owned);
        let policy = match &from {
            Some(f) => shared.live.get().s2s.policy(f).clone(),
            None => shared.live.get().s2s.default_policy.clone(),
        };
        // XEP-0178 §3: EXTERNAL only when the certificate proves the header's domain, and
        // only once per stream.
        let offer_external = secure
            && external.is_none()
            && from.as_deref().is_some_and(|f| {
                super::cert::proves_domain(
                    shared.s2s.roots.as_deref(),
                    policy.allow_self_signed,
                    &certs,
                    f,
                )
            });
        let mut features = String::from("<stream:features>");
        if !secure {
            // RFC 7590: federation only over TLS.
            features.push_str(&format!(
                "<starttls xmlns='{NS_TLS}'><required/></starttls>"
            ));
        } else {
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
        }
        features.push_str("</stream:features>");
        if stream.write(&features).await.is_err() {
            return Err(None);
        }
        if secure {
            if !offer_external {
                return Ok(Negotiated {
                    stream,
                    local_domain: to,
                    stream_id: id,
                    external,
                    pending: None,
                });
            }
            // Wait for <auth/>; anything else (a db:result from a peer that prefers
            // dialback, a stanza) is handed on unread.
            loop {
                let el = match stream.next_element().await {
                    Ok(el) => el,
                    Err(Fail::Stream(e)) => return Err(Some((stream, e))),
                    Err(_) => return Err(None),
                };
                if !el.is("auth", NS_SASL) {
                    return Ok(Negotiated {
                        stream,
                        local_domain: to,
                        stream_id: id,
                        external: None,
                        pending: Some(el),
                    });
                }
                let mechanism = el.get_attr("mechanism").unwrap_or_default().to_owned();
                let mut response = el.text_content();
                if response.is_empty() {
                    // No initial response: an empty challenge asks for it (RFC 6120 §6.4.3).
                    if stream
                        .write(&format!("<challenge xmlns='{NS_SASL}'/>"))
                        .await
                        .is_err()
                    {
                        return Err(None);
                    }
                    match stream.next_element().await {
                        Ok(r) if r.is("response", NS_SASL) => response = r.text_content(),
                        Ok(r) if r.is("abort", NS_SASL) => {
                            // RFC 6120 §6.4.5.
                            let f = format!("<failure xmlns='{NS_SASL}'><aborted/></failure>");
                            if stream.write(&f).await.is_err() {
                                return Err(None);
                            }
                            continue;
                        }
                        Ok(_) => {
                            let e = StreamError::new(
                                StreamCondition::PolicyViolation,
                                "expected a SASL response",
                            );
                            return Err(Some((stream, e)));
                        }
                        Err(Fail::Stream(e)) => return Err(Some((stream, e))),
                        Err(_) => return Err(None),
                    }
                }
                match super::cert::decide_external(
                    &mechanism,
                    offer_external,
                    from.as_deref(),
                    &response,
                ) {
                    Ok(domain) => {
                        if stream
                            .write(&format!("<success xmlns='{NS_SASL}'/>"))
                            .await
                            .is_err()
                        {
                            return Err(None);
                        }
                        tracing::info!(%peer, remote = %domain, local = %to, "inbound s2s stream authenticated by SASL EXTERNAL");
                        external = Some(domain);
                        // RFC 6120 §6.4.6: a new stream on the same TLS layer; the
                        // certificate stays the one already checked.
                        stream = stream.restart();
                        certs.clear();
                        break;
                    }
                    Err(condition) => {
                        tracing::warn!(%peer, claimed = ?from, %mechanism, %condition, "SASL EXTERNAL refused");
                        let f = format!("<failure xmlns='{NS_SASL}'><{condition}/></failure>");
                        if stream.write(&f).await.is_err() {
                            return Err(None);
                        }
                        failures += 1;
                        if failures >= shared.live.get().limits.max_auth_failures {
                            let e = StreamError::new(
                                StreamCondition::PolicyViolation,
                                "too many failed authentication attempts",
                            );
                            return Err(Some((stream, e)));
                        }
                    }
                }
            }
            continue;
        }
        let el = match stream.next_element().await {
            Ok(el) => el,
            Err(Fail::Stream(e)) => return Err(Some((stream, e))),
            Err(_) => return Err(None),
        };
        if !el.is("starttls", NS_TLS) {
            let e = StreamError::new(
                StreamCondition::PolicyViolation,
                "STARTTLS is required (RFC 7590)",
            );
            return Err(Some((stream, e)));
        }
        if stream
            .write(&format!("<proceed xmlns='{NS_TLS}'/>"))
            .await
            .is_err()
        {
            return Err(None);
        }
        let limits = ReaderLimits::for_peer(&shared.live.get().limits, false);
        let acceptor = tokio_rustls::TlsAcceptor::from(shared.s2s_tls.clone());
        match acceptor.accept(stream.into_io()).await {
            Ok(tls) => {
                certs = peer_certs(tls.get_ref().1);
                stream = XmlStream::new(Box::new(tls), limits, NS_SERVER);
                secure = true;
            }
            Err(e) => {
                tracing::info!(%peer, error = %e, "s2s STARTTLS handshake failed");
                return Err(None);
            }
        }
    }
}

/// What the writer task is asked to do.
enum Out {
    Raw(String),
    Error(StreamError),
}

async fn run(shared: Arc<Shared>, n: Negotiated, peer: SocketAddr, deadline: tokio::time::Instant) {
    let Negotiated {
        stream,
        local_domain,
        stream_id,
        external,
        mut pending,
    } = n;
    let (mut reader, mut writer) = stream.split();
    // Dialback authenticates without a stream restart, in a task of its own: the stanza
    // cost limit is raised through this, read by the reader at every stanza start.
    let node_limit = Arc::new(AtomicUsize::new(
        ReaderLimits::for_peer(&shared.live.get().limits, external.is_some()).max_stanza_nodes,
    ));
    reader.share_node_limit(node_limit.clone());
    let (out_tx, mut out_rx) = mpsc::channel::<Out>(64);
    let writer_task = tokio::spawn(async move {
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
    });
    let authed: Authenticated = Arc::default();
    if let Some(remote) = external {
        if let Ok(mut a) = authed.lock() {
            a.insert((remote.clone(), local_domain.clone()));
        }
        shared.s2s.authenticated(AuthMethod::External, true);
        super::link_up(&shared, &remote);
    }
    let mut bucket = crate::rate_limit::TokenBucket::new(
        shared.config.s2s.stanzas_per_second,
        shared.config.s2s.stanza_burst,
    );
    let cut = shared.s2s.cut_token();
    let mut clean = false;
    let mut sasl_refusals = 0u32;
    let error: Option<StreamError> = loop {
        let unauthenticated = authed.lock().map(|a| a.is_empty()).unwrap_or(true);
        let ev = if let Some(el) = pending.take() {
            Ok(crate::xml::reader::StreamEvent::Stanza(el))
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
            Ok(crate::xml::reader::StreamEvent::Stanza(el)) => el,
            Ok(crate::xml::reader::StreamEvent::Whitespace) => continue,
            Ok(crate::xml::reader::StreamEvent::Close) => {
                clean = true;
                let _ = out_tx.send(Out::Raw("</stream:stream>".into())).await;
                break None;
            }
            Ok(crate::xml::reader::StreamEvent::Open(_)) => {
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
            // SASL was not offered on this stream (the certificate proves nothing, or the
            // stream already authenticated): refuse, but keep the stream so the peer can
            // fall back to dialback (XEP-0178 §3, RFC 6120 §6.5.10).
            tracing::warn!(%peer, mechanism = ?el.get_attr("mechanism"), "SASL attempted where it was not offered; not-authorized");
            let f = format!("<failure xmlns='{NS_SASL}'><not-authorized/></failure>");
            let _ = out_tx.send(Out::Raw(f)).await;
            sasl_refusals += 1;
            if sasl_refusals >= shared.live.get().limits.max_auth_failures {
                break Some(StreamError::new(
                    StreamCondition::PolicyViolation,
                    "too many failed authentication attempts",
                ));
            }
            continue;
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
        if !bucket.take() {
            break Some(StreamError::new(
                StreamCondition::PolicyViolation,
                "too many stanzas per second",
            ));
        }
        if let Err(e) = check_origin(&shared, &el, &authed) {
            break Some(e);
        }
        super::deliver_inbound(&shared, el).await;
    };
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
            super::link_lost(&shared, local, remote);
        }
    }
    drop(out_tx);
    if cut.is_cancelled() {
        writer_task.abort();
    } else {
        let _ = tokio::time::timeout(Duration::from_secs(5), writer_task).await;
    }
    tracing::info!(%peer, %local_domain, "inbound s2s stream ended");
}

/// RFC 6120 §4.9.3.7 / §4.9.3.6 / §4.9.3.9, in that order.
fn check_origin(shared: &Shared, el: &Element, authed: &Authenticated) -> Result<(), StreamError> {
    let (Some(from), Some(to)) = (el.get_attr("from"), el.get_attr("to")) else {
        return Err(StreamError::new(
            StreamCondition::ImproperAddressing,
            "stanzas between servers need both 'from' and 'to'",
        ));
    };
    let (Ok(from), Ok(to)) = (Jid::new(from), Jid::new(to)) else {
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
    Ok(())
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
            crate::xml::escape(&to),
            crate::xml::escape(&from)
        )
    };
    if !shared.config.serves(&to) {
        // XEP-0220 §2.4.3: item-not-found for a domain we do not host.
        let _ = out.send(Out::Raw(error_result("item-not-found"))).await;
        return Ok(());
    }
    if Jid::new(&from).map(|j| j.node().is_some()).unwrap_or(true) || shared.config.serves(&from) {
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
/// one is ([`crate::delivery::message`]: the recipient's block list and the privacy gate
/// apply); an error goes back over federation.
pub(crate) async fn message(shared: &Shared, el: Element) {
    let (Some(from), Some(to)) = (
        el.get_attr("from").and_then(|f| Jid::new(f).ok()),
        el.get_attr("to").and_then(|t| Jid::new(t).ok()),
    ) else {
        return;
    };
    if to.node().is_none() {
        // No handler for messages to the server itself (RFC 6120 §10.3.1).
        crate::delivery::bounce(shared, &el, StanzaError::service_unavailable());
        return;
    }
    crate::delivery::message(shared, &from, to, el).await;
}

/// An iq from a remote server (RFC 6120 §10.5): to a local full JID it goes through
/// [`crate::delivery::iq`] (block list, privacy gate, the offline answer otherwise); the
/// server answers ping (XEP-0199) to a bare JID itself; every other request gets
/// service-unavailable so the requester is never left waiting.
pub(crate) async fn iq(shared: &Shared, el: Element) {
    let ty = IqType::of(&el);
    let is_request = ty.is_some_and(IqType::is_request);
    let (Some(from), Some(to)) = (
        el.get_attr("from").and_then(|f| Jid::new(f).ok()),
        el.get_attr("to").and_then(|t| Jid::new(t).ok()),
    ) else {
        return;
    };
    let to = match to.try_into_full() {
        Ok(full) => {
            crate::delivery::iq(shared, &from, &full, el).await;
            return;
        }
        Err(bare) => bare,
    };
    if !is_request {
        return;
    }
    if to.node().is_some()
        && crate::delivery::admit_from(shared, from.as_str(), to.as_str(), &el).await
            != crate::blocking::Verdict::Pass
    {
        return;
    }
    let ping = el
        .elements()
        .next()
        .is_some_and(|p| p.is("ping", crate::xml::NS_PING))
        && ty == Some(IqType::Get);
    let reply = if ping {
        crate::error::iq_result(&el)
    } else {
        match StanzaError::service_unavailable().reply_to(&el) {
            Some(r) => r,
            None => return,
        }
    };
    let _ = super::route_remote(shared, reply);
}
