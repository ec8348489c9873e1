//! The client session: one task per connection that negotiates the stream (RFC 6120 §4–§7),
//! then reads stanzas and hands them to the router, while a writer task drains the session's
//! mailbox onto the socket.
//!
//! Negotiation runs as a chain of phases, each a function that can only be reached from the
//! one before: [`Conn::open`] (header) → STARTTLS (§5) → SASL (§6) → bind (§7) → the stanza
//! loop. Anything out of order gets the stream error RFC 6120 names for it, written after our
//! own stream header when none was sent yet (§4.9.1.1), and is logged with the peer address.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use tokio::io::{AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::StreamCondition;
use crate::error::{StanzaError, StreamError};
use crate::jid::{BareJid, FullJid, Jid};
use crate::liveness::{Transport, TransportKind};
use crate::node::Shared;
use crate::router;
use crate::sasl::scram::{self, ScramHash, ScramServer};
use crate::sessions::Outbound;
use crate::stream_management as sm;
use crate::xml::reader::{ReaderLimits, StreamEvent, StreamReader, XmlError};
use crate::xml::{self as x, Element};

pub use crate::tls::{BoxIo, Io};

/// How a negotiation step ended early.
enum Fail {
    /// Send this stream error and close.
    Stream(StreamError),
    /// The peer went away or closed the stream; nothing more to write.
    Gone,
}

impl From<XmlError> for Fail {
    fn from(e: XmlError) -> Self {
        StreamError::of_xml(&e).map_or(Fail::Gone, Fail::Stream)
    }
}

impl From<std::io::Error> for Fail {
    fn from(_: std::io::Error) -> Self {
        Fail::Gone
    }
}

/// Boxed: the reader is a few hundred bytes and is moved from the negotiation into the
/// session loop's read future; inline, each async frame it passes through would reserve
/// room for it (async-fn arguments are stored next to the locals they are moved into).
type Reader = Box<StreamReader<ReadHalf<BoxIo>>>;

/// A reader with the limits for the stream's state: before SASL success the stanza cost
/// limit is the small one (the stream restarts after authentication, RFC 6120 §6.4.6, and
/// so gets a new reader with the larger limit).
fn new_reader(io: ReadHalf<BoxIo>, shared: &Shared, authenticated: bool) -> Reader {
    Box::new(StreamReader::new(
        io,
        ReaderLimits::for_peer(&shared.live.get().limits, authenticated),
    ))
}

/// A connection during negotiation.
struct Conn {
    shared: Arc<Shared>,
    reader: Reader,
    writer: WriteHalf<BoxIo>,
    /// Remote address, for every log line about this connection.
    peer: SocketAddr,
    /// Whether TLS is established (STARTTLS or direct TLS).
    secure: bool,
    /// Whether our stream header for the current stream was sent.
    header_sent: bool,
    /// The domain the client asked for in its first header.
    domain: Option<String>,
    /// The authenticated account's localpart.
    user: Option<String>,
    /// What the connection runs over (handed to a session this stream resumes).
    transport: Transport,
}

/// Serves one client TCP connection from accept to close.
pub async fn serve(shared: Arc<Shared>, io: BoxIo, peer: SocketAddr, direct_tls: bool) {
    let transport = Transport::tcp(&shared.liveness);
    serve_transport(shared, io, peer, direct_tls, transport).await
}

/// Serves one client connection over `transport` (TCP, or the byte stream an RFC 7395
/// WebSocket adapter presents) from accept to close.
pub async fn serve_transport(
    shared: Arc<Shared>,
    io: BoxIo,
    peer: SocketAddr,
    direct_tls: bool,
    transport: Transport,
) {
    // Negotiation (TLS handshake, SASL, its timers and error paths) is large and short-lived
    // state. Boxed, it is freed once the resource is bound; inline, it would size this
    // connection's task for the whole life of an idle session (BENCHMARKS.md, memory per session).
    let negotiated = Box::pin(negotiate(shared, io, peer, direct_tls, &transport)).await;
    if let Some((conn, bound)) = negotiated {
        conn.run_session(bound, transport).await;
    }
}

/// Runs the connection up to a bound resource, within the negotiation time limit. `None` when
/// it ended before that (the stream error, if any, has been written).
async fn negotiate(
    shared: Arc<Shared>,
    io: BoxIo,
    peer: SocketAddr,
    direct_tls: bool,
    transport: &Transport,
) -> Option<(Conn, FullJid)> {
    let timeout = shared.live.get().limits.negotiation_timeout;
    let deadline = Instant::now() + timeout;
    let io = if direct_tls {
        // XEP-0368: TLS starts before any XML.
        let acceptor = tokio_rustls::TlsAcceptor::from(shared.tls.clone());
        match tokio::time::timeout_at(deadline, acceptor.accept(io)).await {
            Ok(Ok(tls)) => Box::new(tls) as BoxIo,
            Ok(Err(e)) => {
                tracing::info!(%peer, error = %e, "direct TLS handshake failed");
                return None;
            }
            Err(_) => {
                tracing::info!(%peer, "direct TLS handshake timed out");
                return None;
            }
        }
    } else {
        io
    };
    let (r, w) = tokio::io::split(io);
    let mut conn = Conn {
        reader: new_reader(r, &shared, false),
        shared,
        writer: w,
        peer,
        secure: direct_tls || transport.secure,
        header_sent: false,
        domain: None,
        user: None,
        transport: transport.clone(),
    };
    match tokio::time::timeout_at(deadline, conn.negotiate()).await {
        Ok(Ok(jid)) => Some((conn, jid)),
        Ok(Err(Fail::Stream(err))) => {
            conn.fail(err).await;
            None
        }
        Ok(Err(Fail::Gone)) => None,
        Err(_) => {
            // RFC 6120 §4.9.3.4: negotiation took longer than the configured time.
            let err = StreamError::new(
                StreamCondition::ConnectionTimeout,
                "Stream negotiation took too long",
            );
            conn.fail(err).await;
            None
        }
    }
}

impl Conn {
    async fn write(&mut self, s: &str) -> Result<(), Fail> {
        self.writer.write_all(s.as_bytes()).await?;
        self.writer.flush().await?;
        Ok(())
    }

    async fn write_el(&mut self, el: &Element) -> Result<(), Fail> {
        let s = el.to_xml();
        self.write(&s).await
    }

    /// Writes `err` (after our header if none was sent, RFC 6120 §4.9.1.1) and closes.
    async fn fail(&mut self, err: StreamError) {
        tracing::info!(peer = %self.peer, user = ?self.user, error = %err, "closing stream with error");
        let mut out = String::new();
        if !self.header_sent {
            let from = self
                .domain
                .clone()
                .unwrap_or_else(|| self.shared.config.domains[0].clone());
            out.push_str(&x::stream_header(&from, None, &new_id(), x::NS_CLIENT));
        }
        out.push_str(&err.to_xml());
        out.push_str("</stream:stream>");
        let _ = self.write(&out).await;
        let _ = self.writer.shutdown().await;
    }

    async fn next(&mut self) -> Result<StreamEvent, Fail> {
        Ok(self.reader.next().await?)
    }

    /// The next top-level element of the current stream, skipping keepalives.
    async fn next_element(&mut self) -> Result<Element, Fail> {
        loop {
            match self.next().await? {
                StreamEvent::Stanza(el) => {
                    tracing::trace!(peer = %self.peer, element = %el.name, "negotiation element");
                    return Ok(el);
                }
                StreamEvent::Whitespace => continue,
                StreamEvent::Close => {
                    let _ = self.write("</stream:stream>").await;
                    return Err(Fail::Gone);
                }
                StreamEvent::Open(_) => {
                    return Err(Fail::Stream(StreamError::new(
                        StreamCondition::NotWellFormed,
                        "second stream header",
                    )))
                }
            }
        }
    }

    /// Reads and checks the initiating stream header, answers with ours and the features
    /// (RFC 6120 §4.7, §4.8).
    async fn open(&mut self) -> Result<(), Fail> {
        self.header_sent = false;
        let header = match self.next().await? {
            StreamEvent::Open(h) => {
                tracing::trace!(peer = %self.peer, secure = self.secure, "stream header");
                h
            }
            _ => return Err(Fail::Gone),
        };
        if header.name != "stream" || header.ns != x::NS_STREAM {
            // RFC 6120 §4.8.1: the stream element must be qualified by the streams namespace.
            return Err(Fail::Stream(StreamError::new(
                StreamCondition::InvalidNamespace,
                "the stream element must be in http://etherx.jabber.org/streams",
            )));
        }
        // RFC 7622 §3.2: the domain is compared after normalisation (case-folded), so
        // 'to' is prepared like any JID before it is looked up.
        let to = header.get_attr("to").map(|t| {
            crate::jid::BareJid::new(t)
                .ok()
                .filter(|j| j.node().is_none())
                .map(|j| j.domain().as_str().to_owned())
                .unwrap_or_else(|| t.to_owned())
        });
        match (&to, &self.domain) {
            (Some(to), _) if !self.shared.config.serves(to) => {
                // RFC 6120 §4.9.3.6.
                return Err(Fail::Stream(StreamError::new(
                    StreamCondition::HostUnknown,
                    format!("this server does not serve {to}"),
                )));
            }
            (None, _) => {
                return Err(Fail::Stream(StreamError::new(
                    StreamCondition::HostUnknown,
                    "the stream header has no 'to' address",
                )));
            }
            (Some(to), Some(prev)) if to != prev => {
                return Err(Fail::Stream(StreamError::new(
                    StreamCondition::HostUnknown,
                    "the domain changed across a stream restart",
                )));
            }
            _ => {}
        }
        self.domain = to;
        if header.default_ns.as_deref() != Some(x::NS_CLIENT) {
            // RFC 6120 §4.8.2 / §4.9.3.10.
            return Err(Fail::Stream(StreamError::new(
                StreamCondition::InvalidNamespace,
                "the content namespace of a client stream must be jabber:client",
            )));
        }
        let version = header.get_attr("version").unwrap_or("0.9");
        let major = version
            .split('.')
            .next()
            .and_then(|m| m.parse::<u32>().ok());
        if major != Some(1) {
            // RFC 6120 §4.7.5 / §4.9.3.25: we speak 1.x only.
            return Err(Fail::Stream(StreamError::new(
                StreamCondition::UnsupportedVersion,
                "version 1.0 is required",
            )));
        }
        let domain = self.domain.clone().unwrap_or_default();
        let head = x::stream_header(&domain, header.get_attr("from"), &new_id(), x::NS_CLIENT);
        self.write(&head).await?;
        self.header_sent = true;
        let features = self.features();
        self.write(&features).await
    }

    fn features(&self) -> String {
        let mut f = Element::new("features", x::NS_STREAM);
        if !self.secure {
            // RFC 6120 §5.3.1: TLS is mandatory-to-negotiate here, so only STARTTLS is offered.
            f = f.child(
                Element::new("starttls", x::NS_TLS).child(Element::new("required", x::NS_TLS)),
            );
        } else if self.user.is_none() {
            let mut mechs = Element::new("mechanisms", x::NS_SASL);
            for m in ["SCRAM-SHA-256", "SCRAM-SHA-1"] {
                mechs = mechs.child(Element::new("mechanism", x::NS_SASL).text(m));
            }
            if self.shared.config.auth.allow_plain {
                mechs = mechs.child(Element::new("mechanism", x::NS_SASL).text("PLAIN"));
            }
            f = f.child(mechs);
            if self.shared.config.auth.allow_registration {
                f = f.child(Element::new("register", x::NS_REGISTER_FEATURE));
            }
        } else {
            f = f
                .child(Element::new("bind", x::NS_BIND))
                .child(
                    Element::new("session", x::NS_SESSION)
                        .child(Element::new("optional", x::NS_SESSION)),
                )
                .child(Element::new("ver", x::NS_ROSTER_VER))
                .child(Element::new("sub", x::NS_PREAPPROVAL))
                // XEP-0352 §4: client state indication is offered after authentication.
                .child(Element::new("csi", crate::csi::NS_CSI))
                // XEP-0198 §2: stream management, once the client is authenticated.
                .child(Element::new("sm", sm::NS_SM));
        }
        let mut out = String::new();
        // Written with the stream prefix, which is what every client expects.
        out.push_str("<stream:features>");
        for child in f.elements() {
            child.write_to(&mut out, x::NS_CLIENT, x::NS_CLIENT);
        }
        out.push_str("</stream:features>");
        out
    }

    /// Runs every phase up to a bound resource.
    async fn negotiate(&mut self) -> Result<FullJid, Fail> {
        self.open().await?;
        if !self.secure {
            self.starttls().await?;
            self.open().await?;
        }
        self.authenticate().await?;
        self.restart();
        self.open().await?;
        self.bind().await
    }

    /// A fresh parser for a restarted stream (RFC 6120 §4.3.3).
    fn restart(&mut self) {
        let authenticated = self.user.is_some();
        let empty = new_reader(empty_half(), &self.shared, authenticated);
        let reader = std::mem::replace(&mut self.reader, empty);
        self.reader = new_reader((*reader).into_inner(), &self.shared, authenticated);
    }

    /// RFC 6120 §5.4: wait for `<starttls/>`, answer `<proceed/>`, handshake.
    async fn starttls(&mut self) -> Result<(), Fail> {
        loop {
            let el = self.next_element().await?;
            if el.is("starttls", x::NS_TLS) {
                break;
            }
            if el.is("auth", x::NS_SASL) {
                // RFC 6120 §6.5.4: no authentication in the clear.
                let f = Element::new("failure", x::NS_SASL)
                    .child(Element::new("encryption-required", x::NS_SASL));
                self.write_el(&f).await?;
                continue;
            }
            return Err(Fail::Stream(StreamError::new(
                StreamCondition::PolicyViolation,
                "STARTTLS is required before anything else (RFC 6120 §5.3.1)",
            )));
        }
        self.write_el(&Element::new("proceed", x::NS_TLS)).await?;
        let empty = new_reader(empty_half(), &self.shared, false);
        let reader = std::mem::replace(&mut self.reader, empty);
        let writer = std::mem::replace(&mut self.writer, tokio::io::split(empty_io()).1);
        let plain = (*reader).into_inner().unsplit(writer);
        let acceptor = tokio_rustls::TlsAcceptor::from(self.shared.tls.clone());
        let tls = match acceptor.accept(plain).await {
            Ok(tls) => tls,
            Err(e) => {
                // RFC 6120 §5.4.3.2: on handshake failure the TCP connection is just closed.
                tracing::info!(peer = %self.peer, error = %e, "STARTTLS handshake failed");
                return Err(Fail::Gone);
            }
        };
        let (r, w) = tokio::io::split(Box::new(tls) as BoxIo);
        self.reader = new_reader(r, &self.shared, false);
        self.writer = w;
        self.secure = true;
        Ok(())
    }

    async fn sasl_failure(&mut self, condition: &str, failures: &mut u32) -> Result<(), Fail> {
        let f = Element::new("failure", x::NS_SASL).child(Element::new(condition, x::NS_SASL));
        self.write_el(&f).await?;
        *failures += 1;
        self.shared.metrics.auth_failure();
        tracing::info!(peer = %self.peer, condition, failures = *failures, "SASL failure");
        if *failures >= self.shared.live.get().limits.max_auth_failures {
            // RFC 6120 §6.4.5: after the configured number of retries, end the stream.
            return Err(Fail::Stream(StreamError::new(
                StreamCondition::PolicyViolation,
                "too many failed authentication attempts",
            )));
        }
        Ok(())
    }

    /// RFC 6120 §6: SASL with SCRAM-SHA-256, SCRAM-SHA-1, or PLAIN; also XEP-0077 registration.
    async fn authenticate(&mut self) -> Result<(), Fail> {
        let mut failures = 0u32;
        loop {
            let el = self.next_element().await?;
            if el.is("iq", x::NS_CLIENT) {
                if let Some(q) = el.get_child("query", x::NS_REGISTER) {
                    let q = q.clone();
                    self.register(&el, &q).await?;
                    continue;
                }
            }
            if !el.is("auth", x::NS_SASL) {
                // RFC 6120 §4.9.3.12: stanzas before authentication.
                return Err(Fail::Stream(StreamError::new(
                    StreamCondition::NotAuthorized,
                    "authenticate first",
                )));
            }
            let mech = el.get_attr("mechanism").unwrap_or("").to_owned();
            let initial = match decode_b64(&el.text_content()) {
                Some(v) => v,
                None => {
                    self.sasl_failure("incorrect-encoding", &mut failures)
                        .await?;
                    continue;
                }
            };
            let outcome = match mech.as_str() {
                "SCRAM-SHA-256" => self.scram(ScramHash::Sha256, initial).await?,
                "SCRAM-SHA-1" => self.scram(ScramHash::Sha1, initial).await?,
                "PLAIN" if self.shared.config.auth.allow_plain && self.secure => {
                    self.plain(&initial).await?
                }
                _ => Err("invalid-mechanism"),
            };
            match outcome {
                Ok(user) => {
                    tracing::info!(peer = %self.peer, %user, mech, "authenticated");
                    self.user = Some(user);
                    return Ok(());
                }
                Err(condition) => self.sasl_failure(condition, &mut failures).await?,
            }
        }
    }

    fn account(&self, username: &str) -> Option<BareJid> {
        let domain = self.domain.as_deref()?;
        crate::jid::bare(username, domain).ok()
    }

    /// Per-account back-off, the same for every mechanism: true if `jid` is locked after
    /// repeated failures, and the attempt must be refused without a password check.
    /// The refusal is RFC 6120 §6.5.10 not-authorized ("some generic authentication
    /// failure ... the receiving entity does not wish to disclose specific information
    /// about the cause"): §6.5.12 temporary-auth-failure is for an error within the
    /// server, and would tell a guesser which answers to ignore.
    fn auth_locked(&self, jid: &BareJid) -> bool {
        let Some(left) = self
            .shared
            .auth_backoff
            .locked(jid.as_str(), std::time::Instant::now())
        else {
            return false;
        };
        tracing::info!(peer = %self.peer, %jid, ?left, "SASL refused: account locked after failures");
        true
    }

    /// Records the outcome of a password check for `jid` in the back-off table.
    fn auth_checked(&self, jid: &BareJid, ok: bool) {
        let backoff = &self.shared.auth_backoff;
        if ok {
            backoff.succeeded(jid.as_str());
        } else if let Some(lock) = backoff.failed(jid.as_str(), std::time::Instant::now()) {
            tracing::warn!(peer = %self.peer, %jid, ?lock, "SASL failures lock the account");
        }
    }

    /// SCRAM exchange (RFC 5802 §5). Returns the localpart or a SASL failure condition.
    async fn scram(
        &mut self,
        hash: ScramHash,
        mut initial: Vec<u8>,
    ) -> Result<Result<String, &'static str>, Fail> {
        // Unknown users get a salt and iteration count as an account would, so the answer
        // does not reveal whether the user exists (RFC 5802 §9 leaves this to the server).
        let mut server = ScramServer::new(hash)
            .with_unknown_user_iterations(self.shared.config.auth.scram_iterations)
            .with_fake_salt_secret(&self.shared.fake_salt_secret);
        if initial.is_empty() {
            // RFC 6120 §6.4.2: no initial response, so ask for it with an empty challenge.
            self.write_el(&Element::new("challenge", x::NS_SASL))
                .await?;
            initial = match self.sasl_response().await? {
                Some(r) => r,
                None => return Ok(Err("aborted")),
            };
        }
        let first = match server.client_first(&initial) {
            Ok(f) => f,
            Err(e) => return Ok(Err(e.condition())),
        };
        let account = self.account(&first.username);
        if let Some(jid) = &account {
            if self.auth_locked(jid) {
                return Ok(Err("not-authorized"));
            }
            server.set_fake_salt_name(jid.as_str());
        }
        let creds = match &account {
            Some(jid) => self
                .shared
                .store
                .scram_credentials(
                    crate::jid::node_str(&Jid::from(jid.clone())),
                    jid.domain().as_str(),
                    hash,
                )
                .await
                .map_err(|e| {
                    tracing::error!(peer = %self.peer, error = %e, "credential lookup failed");
                    Fail::Stream(StreamError::new(
                        StreamCondition::InternalServerError,
                        "storage unavailable",
                    ))
                })?,
            None => None,
        };
        if let (Some(authz), Some(jid)) = (&first.authzid, &account) {
            if authz != jid.as_str() {
                return Ok(Err("invalid-authzid"));
            }
        }
        let challenge = server.server_first(creds.as_ref());
        self.write_el(&Element::new("challenge", x::NS_SASL).text(B64.encode(challenge)))
            .await?;
        let Some(response) = self.sasl_response().await? else {
            return Ok(Err("aborted"));
        };
        let verdict = server.client_final(&response);
        if let Some(jid) = &account {
            self.auth_checked(jid, verdict.is_ok() && creds.is_some());
        }
        match verdict {
            Ok(server_final) if creds.is_some() => {
                self.write_el(&Element::new("success", x::NS_SASL).text(B64.encode(server_final)))
                    .await?;
                Ok(Ok(account
                    .map(|j| crate::jid::node_str(&Jid::from(j)).to_owned())
                    .unwrap_or_default()))
            }
            Ok(_) => Ok(Err("not-authorized")),
            Err(e) => Ok(Err(e.condition())),
        }
    }

    /// Reads `<response/>`; `None` for `<abort/>` (RFC 6120 §6.4.4).
    async fn sasl_response(&mut self) -> Result<Option<Vec<u8>>, Fail> {
        let el = self.next_element().await?;
        if el.is("abort", x::NS_SASL) {
            return Ok(None);
        }
        if !el.is("response", x::NS_SASL) {
            return Err(Fail::Stream(StreamError::new(
                StreamCondition::NotAuthorized,
                "expected a SASL response",
            )));
        }
        decode_b64(&el.text_content()).map(Some).ok_or_else(|| {
            Fail::Stream(StreamError::new(
                StreamCondition::BadFormat,
                "SASL response is not base64",
            ))
        })
    }

    /// SASL PLAIN (RFC 4616), checked against the stored SCRAM-SHA-256 credentials.
    async fn plain(&mut self, msg: &[u8]) -> Result<Result<String, &'static str>, Fail> {
        let mut parts = msg.split(|b| *b == 0);
        let (Some(authz), Some(authc), Some(pass), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Ok(Err("malformed-request"));
        };
        let (Ok(authz), Ok(authc), Ok(pass)) = (
            std::str::from_utf8(authz),
            std::str::from_utf8(authc),
            std::str::from_utf8(pass),
        ) else {
            return Ok(Err("malformed-request"));
        };
        let Some(jid) = self.account(authc) else {
            return Ok(Err("not-authorized"));
        };
        if !authz.is_empty() && authz != jid.as_str() {
            return Ok(Err("invalid-authzid"));
        }
        if self.auth_locked(&jid) {
            return Ok(Err("not-authorized"));
        }
        let local = crate::jid::node_str(&Jid::from(jid.clone())).to_owned();
        let creds = self
            .shared
            .store
            .scram_credentials(&local, jid.domain().as_str(), ScramHash::Sha256)
            .await
            .map_err(|_| {
                Fail::Stream(StreamError::new(
                    StreamCondition::InternalServerError,
                    "storage",
                ))
            })?;
        // An unknown user is checked against made-up credentials with the configured
        // iterations, so both cost the same PBKDF2 work and the time taken does not tell
        // whether the account exists.
        let (creds, exists) = match creds {
            Some(c) => (c, true),
            None => (
                scram::fake_credentials(
                    ScramHash::Sha256,
                    jid.as_str(),
                    &self.shared.fake_salt_secret,
                    self.shared.config.auth.scram_iterations,
                ),
                false,
            ),
        };
        let pass = pass.to_owned();
        // PBKDF2 is CPU-heavy: keep it off the async workers.
        let matched = tokio::task::spawn_blocking(move || {
            scram::verify_plain(ScramHash::Sha256, &creds, &pass)
        })
        .await
        .unwrap_or(false);
        let ok = matched && exists;
        self.auth_checked(&jid, ok);
        if !ok {
            return Ok(Err("not-authorized"));
        }
        self.write_el(&Element::new("success", x::NS_SASL)).await?;
        Ok(Ok(local))
    }

    /// XEP-0077 in-band registration before authentication (off unless configured).
    async fn register(&mut self, iq: &Element, query: &Element) -> Result<(), Fail> {
        let reply = if !self.shared.config.auth.allow_registration {
            StanzaError::service_unavailable().reply_to(iq)
        } else {
            match iq.get_attr("type") {
                Some("get") => Some(
                    iq_result(iq).child(
                        Element::new("query", x::NS_REGISTER)
                            .child(
                                Element::new("instructions", x::NS_REGISTER)
                                    .text("Choose a username and password."),
                            )
                            .child(Element::new("username", x::NS_REGISTER))
                            .child(Element::new("password", x::NS_REGISTER)),
                    ),
                ),
                Some("set") => Some(self.register_set(iq, query).await),
                _ => StanzaError::bad_request().reply_to(iq),
            }
        };
        if let Some(r) = reply {
            self.write_el(&r).await?;
        }
        Ok(())
    }

    async fn register_set(&mut self, iq: &Element, query: &Element) -> Element {
        let field = |n: &str| query.get_child(n, x::NS_REGISTER).map(|e| e.text_content());
        let (Some(user), Some(pass)) = (field("username"), field("password")) else {
            return StanzaError::not_acceptable()
                .reply_to(iq)
                .unwrap_or_else(|| iq_result(iq));
        };
        let Some(jid) = self.account(&user).filter(|_| !pass.is_empty()) else {
            return StanzaError::not_acceptable()
                .reply_to(iq)
                .unwrap_or_else(|| iq_result(iq));
        };
        let local = crate::jid::node_str(&Jid::from(jid.clone())).to_owned();
        let iterations = self.shared.config.auth.scram_iterations;
        match self
            .shared
            .store
            .create_account(&local, jid.domain().as_str(), &pass, iterations)
            .await
        {
            Ok(()) => {
                tracing::info!(peer = %self.peer, %jid, "registered account in-band");
                iq_result(iq)
            }
            Err(crate::store::StoreError::AccountExists) => StanzaError::conflict()
                .reply_to(iq)
                .unwrap_or_else(|| iq_result(iq)),
            Err(e) => {
                tracing::error!(peer = %self.peer, error = %e, "registration failed");
                StanzaError::internal_server_error()
                    .reply_to(iq)
                    .unwrap_or_else(|| iq_result(iq))
            }
        }
    }

    /// XEP-0198 §5: hands this stream to the session `previd` of the authenticated account,
    /// which answers `<resumed/>` on it. `Ok(false)` when there is no such session here
    /// (`<failed/>` was written and the client may bind instead): expired, never issued,
    /// another account's, or held by another node of the cluster, which this node cannot
    /// resume, so the client binds a new resource.
    async fn resume(&mut self, previd: &str, h: u32) -> Result<bool, Fail> {
        let Some(account) = self.user.clone().and_then(|u| self.account(&u)) else {
            return Err(Fail::Gone);
        };
        let tx = match self.shared.resumable.find(previd, account.as_str(), h) {
            Ok(tx) => tx,
            Err(refused) => {
                tracing::info!(peer = %self.peer, %account, ?refused, "stream resumption refused");
                let condition = match refused {
                    sm::Refused::NotFound => "item-not-found",
                    // §4: the client claims more than was sent.
                    sm::Refused::TooHigh(_) => "undefined-condition",
                };
                self.write(&sm::failed(condition, None)).await?;
                return Ok(false);
            }
        };
        let empty = new_reader(empty_half(), &self.shared, true);
        let reader = std::mem::replace(&mut self.reader, empty);
        let writer = std::mem::replace(&mut self.writer, tokio::io::split(empty_io()).1);
        let (taken, was_taken) = tokio::sync::oneshot::channel();
        let handoff = Box::new(sm::Handoff {
            h,
            reader,
            writer,
            peer: self.peer,
            transport: self.transport.clone(),
            taken,
        });
        if let Err(back) = tx.send(handoff).await {
            // The session ended meanwhile.
            let sm::Handoff { reader, writer, .. } = *back.0;
            self.reader = reader;
            self.writer = writer;
            self.write(&sm::failed("item-not-found", None)).await?;
            return Ok(false);
        }
        // Either the session took the stream (and answers on it), or it ended with the
        // stream unanswered; then the connection closes and the client starts afresh.
        was_taken.await.map_err(|_| Fail::Gone)?;
        Ok(true)
    }

    /// Whether binding `jid` would exceed `max_resources_per_account`. Taking over a
    /// resource already bound (RFC 6120 §7.7.2.1: the older session is replaced) adds none.
    /// Resources bound on other nodes of the cluster count too (the directory). Two binds
    /// of the same account at the same instant may both pass; the overshoot is bounded by
    /// the connections negotiating at once.
    async fn resources_exhausted(shared: &Shared, jid: &FullJid) -> bool {
        let bare = jid.to_bare();
        let mut bound: Vec<String> = shared
            .sessions
            .of_user(&bare)
            .into_iter()
            .map(|s| s.jid.to_string())
            .collect();
        let max = shared.live.get().limits.max_resources_per_account;
        if bound.len() < max {
            // Only read the directory when this node's sessions alone leave room.
            let elsewhere = shared.cluster.holders(&[bare.as_str()]).await;
            bound.extend(elsewhere.into_values().flatten().map(|h| h.jid));
            bound.sort();
            bound.dedup();
        }
        bound.len() >= max && !bound.iter().any(|b| b == jid.as_str())
    }

    /// RFC 6120 §7: resource binding. Also answers the legacy session iq (RFC 3921 §3).
    async fn bind(&mut self) -> Result<FullJid, Fail> {
        loop {
            let el = self.next_element().await?;
            match sm::Nonza::parse(&el) {
                Some(Ok(sm::Nonza::Resume { previd, h })) => {
                    if self.resume(&previd, h).await? {
                        // The session took this stream over; this task has nothing left.
                        return Err(Fail::Gone);
                    }
                    continue;
                }
                Some(Ok(sm::Nonza::Enable { .. })) => {
                    // XEP-0198 §3: stream management is enabled after resource binding.
                    self.write(&sm::failed("unexpected-request", None)).await?;
                    continue;
                }
                Some(Err(sm::Malformed(why))) => {
                    return Err(Fail::Stream(StreamError::new(
                        StreamCondition::BadFormat,
                        why,
                    )));
                }
                Some(Ok(sm::Nonza::Request | sm::Nonza::Ack { .. })) | None => {}
            }
            let is_set = el.is("iq", x::NS_CLIENT) && el.get_attr("type") == Some("set");
            let Some(bind) = el.get_child("bind", x::NS_BIND).filter(|_| is_set) else {
                if is_set && el.get_child("session", x::NS_SESSION).is_some() {
                    self.write_el(&iq_result(&el)).await?;
                    continue;
                }
                // RFC 6120 §7.1: no stanzas before a resource is bound.
                return Err(Fail::Stream(StreamError::new(
                    StreamCondition::NotAuthorized,
                    "bind a resource first",
                )));
            };
            let requested = bind
                .get_child("resource", x::NS_BIND)
                .map(|r| r.text_content())
                .filter(|r| !r.is_empty());
            let resource = requested.unwrap_or_else(new_id);
            let domain = self.domain.clone().unwrap_or_default();
            let user = self.user.clone().unwrap_or_default();
            let jid = FullJid::new(&format!("{user}@{domain}/{resource}"));
            let shared = self.shared.clone();
            let exhausted = match &jid {
                Ok(j) => Self::resources_exhausted(&shared, j).await,
                Err(_) => false,
            };
            match jid {
                Ok(jid) if exhausted => {
                    // RFC 6120 §7.6.2.1 (server-generated resource) and §7.7.2.2 (client-
                    // submitted): the account has reached its limit of connected resources.
                    // The stream stays open; the client may bind once one has gone.
                    tracing::info!(peer = %self.peer, %jid, "bind refused: too many resources");
                    if let Some(r) = StanzaError::resource_constraint()
                        .with_text("too many resources bound to this account")
                        .reply_to(&el)
                    {
                        self.write_el(&r).await?;
                    }
                }
                Ok(jid) => {
                    let reply = iq_result(&el).child(
                        Element::new("bind", x::NS_BIND)
                            .child(Element::new("jid", x::NS_BIND).text(jid.to_string())),
                    );
                    self.write_el(&reply).await?;
                    return Ok(jid);
                }
                Err(_) => {
                    // RFC 6120 §7.7.2.1: a resource that cannot be prepared is bad-request.
                    if let Some(r) = StanzaError::bad_request()
                        .with_text("resource cannot be prepared")
                        .reply_to(&el)
                    {
                        self.write_el(&r).await?;
                    }
                }
            }
        }
    }

    /// The bound session: register, spawn the writer, then read and handle stanzas until the
    /// stream ends, pinging the client when it is silent and keeping its liveness in Redis
    /// (see [`crate::liveness`]).
    ///
    /// Reading happens in this task: [`StreamReader::next`] is not cancel-safe, so its
    /// future is kept pinned across `select!` iterations and only replaced once it has
    /// produced an event; a timer or token firing never drops a half-read stanza. One task
    /// fewer and no event channel per session is what an idle session saves (BENCHMARKS.md).
    ///
    /// XEP-0198: once the client enabled resumption, a connection that dies (the socket
    /// fails; not a `</stream:stream>`, not a stream error) detaches the session instead of
    /// ending it: it stays registered, available and in the directory, this task keeps its
    /// liveness beating and keeps what arrives for it, and a new stream that resumes it
    /// ([`Conn::resume`]) is attached in place of the old one. The window ends it as a
    /// disconnect ends a session.
    async fn run_session(self, jid: FullJid, transport: Transport) {
        let Conn {
            shared,
            reader,
            writer,
            mut peer,
            ..
        } = self;
        let mut transport = transport;
        let origin = crate::sessions::Origin::now(
            match transport.kind {
                TransportKind::Tcp => "tcp",
                TransportKind::WebSocket => "websocket",
            },
            Some(peer),
        );
        let reg = shared.sessions.register_from(
            jid.clone(),
            shared.live.get().limits.session_queue,
            &shared.shutdown,
            origin,
        );
        if reg.replaced.is_some() {
            tracing::info!(%peer, %jid, "resource conflict: older session replaced");
        }
        let handle = reg.handle;
        // The resource is this node's cluster-wide now: a session of the same full JID on
        // another node is ended there, as a local one was just above.
        shared.cluster.claim(&jid);
        tracing::info!(%peer, %jid, kind = ?transport.kind, "session bound");
        match transport.kind {
            TransportKind::Tcp => shared.metrics.login_tcp(),
            TransportKind::WebSocket => shared.metrics.login_websocket(),
        }
        let csi = crate::csi::Filter::new(shared.live.get().limits.max_csi_held_presences);
        let mut stop = CancellationToken::new();
        let mut writer_task = Some(tokio::spawn(write_loop(Writing {
            writer,
            rx: reg.rx,
            kill: handle.kill.clone(),
            stop: stop.clone(),
            csi,
            out: None,
            prelude: String::new(),
        })));
        let mut live = shared
            .liveness
            .bind(&jid, handle.id, transport.beat.clone());
        let mut session = Session::new(shared.clone(), handle.clone(), peer);
        let mut bucket = crate::rate_limit::TokenBucket::new(
            shared.live.get().limits.stanzas_per_second,
            shared.live.get().limits.stanza_burst,
        );
        let timings = shared.liveness.timings;
        // Checked four times per H so that a ping goes out within H/4 of H of silence.
        let mut ping_tick = tokio::time::interval(timings.heartbeat / 4);
        let mut last_ping = tokio::time::Instant::now();
        ping_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ping_tick.reset();
        let mut refresh_tick = tokio::time::interval(timings.refresh);
        refresh_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        refresh_tick.reset();
        let mut read = std::pin::pin!(next_event(Some(reader)));
        // XEP-0198 on the reading side: the client's stanzas handled since <enable/> (None:
        // not enabled), what was written and not acknowledged, the resumption this session
        // offers, and the detached state.
        let mut handled: Option<u32> = None;
        let mut out: Option<sm::SharedOutgoing> = None;
        let mut resumable: Option<Resumption> = None;
        let mut detached: Option<Detached> = None;
        // What the writer left in the mailbox when it ended.
        let mut leftover: Option<mpsc::Receiver<Outbound>> = None;
        let end = loop {
            let ev = tokio::select! {
                _ = handle.kill.cancelled() => break None,
                _ = live.end.cancelled(), if detached.is_none() => {
                    // The sweeper found no beat for T: the client is gone without a word.
                    break Some(StreamError::new(StreamCondition::ConnectionTimeout, "no traffic within the liveness timeout"));
                }
                _ = ping_tick.tick() => {
                    if detached.is_some() {
                        // Nobody is connected, and the server vouches for the session until
                        // its window ends: no sweeper, here or on another node, announces it.
                        live.beat.touch();
                        continue;
                    }
                    if !Arc::ptr_eq(&transport.beat, &live.beat)
                        && transport.beat.last_ms() > live.beat.last_ms()
                    {
                        // A resumed stream's transport counts its own keepalives (WebSocket
                        // Pongs); the session's liveness follows them.
                        live.beat.touch();
                    }
                    // XEP-0199 §4.1 server-to-client ping after H of inbound silence; the
                    // answer (result or error, either will do) is traffic, hence a beat.
                    // RFC 7395 streams are pinged with WebSocket Ping frames by the adapter.
                    if transport.kind == TransportKind::Tcp
                        && live.silent_for(timings.heartbeat)
                        && last_ping.elapsed() >= timings.heartbeat
                    {
                        last_ping = tokio::time::Instant::now();
                        let ping = Element::new("iq", x::NS_CLIENT)
                            .attr("type", "get")
                            .attr("id", format!("lv-{}", new_id()))
                            .attr("from", jid.domain().as_str())
                            .attr("to", jid.as_str())
                            .child(Element::new("ping", x::NS_PING));
                        handle.send(ping);
                        shared.liveness.metrics.pings_sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    continue;
                }
                _ = refresh_tick.tick() => {
                    live.refresh(&shared.liveness);
                    if detached.is_none() && live.locally_dead(&shared.liveness) {
                        // No sweeper acted (Redis unreachable): end it here.
                        live.mark_dead();
                        break Some(StreamError::new(StreamCondition::ConnectionTimeout, "no traffic within the liveness timeout"));
                    }
                    continue;
                }
                (reader, ev) = read.as_mut() => {
                    // Any inbound traffic is a heartbeat.
                    if ev.is_ok() {
                        transport.beat.touch();
                        if !Arc::ptr_eq(&transport.beat, &live.beat) {
                            live.beat.touch();
                        }
                    }
                    // Start the next read before handling this event, so the completed future
                    // is never polled again; after a close or an error nothing follows and
                    // the reader is dropped.
                    let more = matches!(ev, Ok(StreamEvent::Stanza(_)) | Ok(StreamEvent::Whitespace));
                    read.set(next_event(more.then_some(reader)));
                    ev
                }
                done = wait_writer(&mut writer_task) => {
                    // The writer ended by itself: it wrote the end of the stream, or the
                    // socket failed under it.
                    match done {
                        Some(w) if w.end == WriterEnd::Failed && resumable.is_some() => {
                            read.set(next_event(None));
                            detached = Some(Detached::new(&shared, w, &resumable, &peer, &jid));
                            continue;
                        }
                        Some(w) => leftover = Some(w.rx),
                        None => {}
                    }
                    break None;
                }
                handoff = next_handoff(&mut resumable) => {
                    // XEP-0198 §5: a new stream of the same account resumes this session.
                    let (rx, csi) = match detached.take() {
                        Some(Detached { rx, csi, .. }) => (rx, csi),
                        None => {
                            // The old connection still looked alive here; the client knows
                            // better. It is dropped for the new one.
                            read.set(next_event(None));
                            stop.cancel();
                            match wait_writer(&mut writer_task).await {
                                Some(w) => (w.rx, w.csi),
                                None => break None,
                            }
                        }
                    };
                    let sm::Handoff { h, reader, writer, peer: from, transport: over, taken } = *handoff;
                    let Some(kept) = out.clone() else { break None };
                    let (prelude, resent) = {
                        let mut o = sm::lock(&kept);
                        // The registry checked h against the count; an h the count has
                        // passed since acknowledges nothing more.
                        let _ = o.ack(h);
                        let id = resumable.as_ref().map(|r| r.id.as_str()).unwrap_or_default();
                        let mut prelude = sm::resumed(id, handled.unwrap_or(0));
                        for s in o.unacked() {
                            prelude.push_str(s);
                        }
                        (prelude, o.unacked_len())
                    };
                    stop = CancellationToken::new();
                    writer_task = Some(tokio::spawn(write_loop(Writing {
                        writer,
                        rx,
                        kill: handle.kill.clone(),
                        stop: stop.clone(),
                        csi,
                        out: Some(kept),
                        prelude,
                    })));
                    read.set(next_event(Some(reader)));
                    peer = from;
                    session.peer = from;
                    transport = over;
                    live.beat.touch();
                    last_ping = tokio::time::Instant::now();
                    let _ = taken.send(());
                    tracing::info!(%peer, %jid, resent, "stream resumed (XEP-0198)");
                    continue;
                }
                event = next_detached(&mut detached) => {
                    let Some(item) = event else {
                        tracing::info!(%jid, "resumption window over; ending the session");
                        break None;
                    };
                    match item {
                        // Replaced by a new bind of the resource, kicked, or shut down.
                        Outbound::Close(_) | Outbound::End | Outbound::Finish => break None,
                        Outbound::SmEnabled(_) | Outbound::SmNonza(_) => {}
                        item => {
                            let Some(d) = detached.as_mut() else { continue };
                            let mut overflow = false;
                            let Some(kept) = out.as_ref() else { break None };
                            d.csi.pass(item, |o| {
                                if let Some(s) = serialized(o) {
                                    overflow |= sm::lock(kept).push(s).is_err();
                                }
                            });
                            if overflow {
                                tracing::info!(%jid, "too many unacknowledged stanzas for a detached session; ending it");
                                break None;
                            }
                        }
                    }
                    continue;
                }
            };
            match ev {
                Ok(StreamEvent::Stanza(el)) => {
                    if !bucket.take() {
                        shared
                            .metrics
                            .dropped(crate::metrics::DropReason::StanzaRate);
                        break Some(StreamError::new(
                            StreamCondition::PolicyViolation,
                            "too many stanzas per second",
                        ));
                    }
                    if let Some(nonza) = sm::Nonza::parse(&el) {
                        let answer = stream_management(
                            &shared,
                            &handle,
                            &mut out,
                            &mut handled,
                            &mut resumable,
                            nonza,
                        );
                        if let Err(err) = answer {
                            break Some(err);
                        }
                        continue;
                    }
                    // XEP-0198 §4: only stanzas are counted, not nonzas such as XEP-0352's.
                    let stanza = el.ns == x::NS_CLIENT
                        && matches!(el.name.as_str(), "message" | "presence" | "iq");
                    // Boxed: routing a stanza can be a deep future (store queries, fan-out);
                    // boxing keeps that state out of this long-lived future while idle.
                    // Nothing is read while it runs: the client is not silent meanwhile.
                    let busy = transport.beat.busy();
                    let outcome = Box::pin(handle_stanza(&mut session, el)).await;
                    drop(busy);
                    if let Err(err) = outcome {
                        break Some(err);
                    }
                    if let Some(h) = handled.as_mut().filter(|_| stanza) {
                        *h = h.wrapping_add(1);
                    }
                }
                Ok(StreamEvent::Whitespace) => {}
                Ok(StreamEvent::Close) => {
                    // RFC 6120 §4.4: answer the closing tag with ours.
                    let _ = handle.try_end();
                    break None;
                }
                Ok(StreamEvent::Open(_)) => {
                    break Some(StreamError::new(
                        StreamCondition::NotWellFormed,
                        "second stream header",
                    ));
                }
                Err(e) => match StreamError::of_xml(&e) {
                    Some(err) => break Some(err),
                    // The connection died without a closing tag: XEP-0198 §5 lets the
                    // client resume, if it asked to be able to.
                    None if resumable.is_some() => {
                        stop.cancel();
                        match wait_writer(&mut writer_task).await {
                            Some(w) => {
                                detached = Some(Detached::new(&shared, w, &resumable, &peer, &jid))
                            }
                            None => break None,
                        }
                    }
                    None => break None,
                },
            }
        };
        if live.end.is_cancelled() {
            live.mark_dead();
        }
        // Stop reading; the reader (and with it the read half of the socket) goes now.
        read.set(next_event(None));
        // No new stream can take this session over any more.
        if let Some(r) = resumable.take() {
            shared.resumable.remove(&r.id);
        }
        if let Some(err) = end {
            tracing::info!(%peer, %jid, error = %err, "closing session with stream error");
            handle.close(err);
        }
        shared.sessions.unregister(&handle);
        if shared.sessions.get(&jid).is_none() {
            // Not taken over by a newer session here (that one holds the entry now).
            shared.cluster.release(&jid);
        }
        // Let the writer flush what is queued (bounded by the mailbox), then stop it. A
        // silent peer is not waited for: its contacts must hear about it now.
        let flush = if live.dead_at().is_some() {
            Duration::from_millis(200)
        } else {
            Duration::from_secs(5)
        };
        let mut rest = leftover.or(detached.map(|Detached { rx, .. }| rx));
        if writer_task.is_some() {
            let _ = tokio::time::timeout(flush, async {
                handle.finish();
                if let Some(w) = wait_writer(&mut writer_task).await {
                    rest = Some(w.rx);
                }
            })
            .await;
        }
        handle.kill.cancel();
        tracing::info!(%peer, %jid, "session ended");
        if let Some(kept) = &out {
            // XEP-0198: what the client did not acknowledge is not lost with the session.
            Box::pin(return_unacked(&shared, &jid, kept, rest)).await;
        }
        // Unavailable now (silent death) or after the grace period (close or drop).
        Box::pin(crate::liveness_tasks::session_over(session, live)).await;
    }
}

/// A resumable XEP-0198 session's id (in [`Shared::resumable`]) and the channel a resuming
/// stream is handed over on.
struct Resumption {
    id: String,
    rx: mpsc::Receiver<Box<sm::Handoff>>,
    window: Duration,
}

/// A session whose connection died and that waits for its client to resume it: the
/// mailbox this task now drains into the unacknowledged stanzas, the client-state filter
/// they pass, and when the window ends.
struct Detached {
    rx: mpsc::Receiver<Outbound>,
    csi: crate::csi::Filter,
    /// Boxed: the timer is large and only a detached session needs one.
    until: std::pin::Pin<Box<tokio::time::Sleep>>,
    _counted: sm::DetachedCount,
}

impl Detached {
    fn new(
        shared: &Shared,
        w: WriterOut,
        r: &Option<Resumption>,
        peer: &SocketAddr,
        jid: &FullJid,
    ) -> Detached {
        let window = r.as_ref().map_or(Duration::ZERO, |r| r.window);
        tracing::info!(%peer, %jid, ?window, "connection lost; session kept for resumption (XEP-0198)");
        Detached {
            rx: w.rx,
            csi: w.csi,
            until: Box::pin(tokio::time::sleep(window)),
            _counted: shared.resumable.count_detached(),
        }
    }
}

/// Handles a XEP-0198 element of a bound session's client; `Err` ends the stream.
fn stream_management(
    shared: &Shared,
    handle: &crate::sessions::SessionHandle,
    out: &mut Option<sm::SharedOutgoing>,
    handled: &mut Option<u32>,
    resumable: &mut Option<Resumption>,
    nonza: Result<sm::Nonza, sm::Malformed>,
) -> Result<(), StreamError> {
    let failed = |condition| Outbound::SmNonza(Arc::new(sm::failed(condition, None)));
    match nonza {
        // RFC 6120 §4.9.3.1: XML the server cannot process.
        Err(sm::Malformed(why)) => return Err(StreamError::new(StreamCondition::BadFormat, why)),
        Ok(sm::Nonza::Enable { .. }) if handled.is_some() => {
            // §3: enabled once per stream.
            handle.send_sm(failed("unexpected-request"));
        }
        Ok(sm::Nonza::Enable { resume, max }) => {
            *handled = Some(0);
            let kept: sm::SharedOutgoing = Arc::new(std::sync::Mutex::new(sm::Outgoing::new(
                shared.live.get().limits.sm_max_unacked,
            )));
            *out = Some(kept.clone());
            let configured = shared.live.get().limits.sm_resume_timeout;
            // §3: the client's `max` is its preference; the shorter window wins.
            let window = match max.filter(|&m| m > 0) {
                Some(m) => configured.min(Duration::from_secs(m)),
                None => configured,
            };
            let xml = if resume && !window.is_zero() {
                let (tx, rx) = mpsc::channel(1);
                let account = handle.jid.to_bare();
                let id = shared
                    .resumable
                    .register(account.as_str(), tx, kept.clone());
                let xml = sm::enabled(Some((&id, window.as_secs().max(1))));
                *resumable = Some(Resumption { id, rx, window });
                xml
            } else {
                sm::enabled(None)
            };
            tracing::debug!(jid = %handle.jid, resume, ?window, "stream management enabled");
            handle.send_sm(Outbound::SmEnabled(Box::new(sm::Enabled {
                xml,
                out: kept,
            })));
        }
        // §5: a bound stream resumes nothing.
        Ok(sm::Nonza::Resume { .. }) => {
            handle.send_sm(failed("unexpected-request"));
        }
        Ok(sm::Nonza::Request) => match handled {
            Some(h) => {
                handle.send_sm(Outbound::SmNonza(Arc::new(sm::ack(*h))));
            }
            None => {
                handle.send_sm(failed("unexpected-request"));
            }
        },
        Ok(sm::Nonza::Ack { h }) => {
            let Some(kept) = out.as_ref() else {
                handle.send_sm(failed("unexpected-request"));
                return Ok(());
            };
            if let Err(too) = sm::lock(kept).ack(h) {
                // §4: more acknowledged than was sent.
                return Err(StreamError::new(
                    StreamCondition::UndefinedCondition,
                    format!(
                        "handled-count-too-high: h={} send-count={}",
                        too.h, too.sent
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// The stanzas a XEP-0198 session's client never acknowledged (written, or still in the
/// mailbox), after the session ended: each is handled as RFC 6121 §8 handles a stanza for
/// a resource that went away ([`crate::delivery::unacked`]).
async fn return_unacked(
    shared: &Shared,
    jid: &FullJid,
    out: &sm::SharedOutgoing,
    rest: Option<mpsc::Receiver<Outbound>>,
) {
    let mut items: Vec<Arc<String>> = sm::lock(out).take_unacked().into();
    if let Some(mut rx) = rest {
        while let Ok(item) = rx.try_recv() {
            items.extend(serialized(item));
        }
    }
    let owner = jid.to_bare();
    let mut handled = 0usize;
    for xml in items {
        // Presence is dropped (§8.5.3.2.1); only messages and iq are read back.
        if !(xml.starts_with("<message") || xml.starts_with("<iq")) {
            continue;
        }
        let Some(el) = x::parse_element(&xml) else {
            continue;
        };
        crate::delivery::unacked(shared, &owner, el).await;
        handled += 1;
    }
    if handled > 0 {
        tracing::info!(%jid, handled, "unacknowledged stanzas of an ended session re-routed");
    }
}

/// The stanza an outbound item writes, as the bytes kept for XEP-0198; `None` for what is
/// not a stanza.
fn serialized(item: Outbound) -> Option<Arc<String>> {
    match item {
        Outbound::Stanza(el) => {
            let mut s = String::new();
            el.write_to(&mut s, x::NS_CLIENT, x::NS_CLIENT);
            Some(Arc::new(s))
        }
        Outbound::Xml(xml) => Some(xml),
        _ => None,
    }
}

/// Waits for the writer task, if there is one, and clears it; never completes without one.
async fn wait_writer(task: &mut Option<tokio::task::JoinHandle<WriterOut>>) -> Option<WriterOut> {
    let Some(t) = task.as_mut() else {
        return std::future::pending().await;
    };
    let done = t.await;
    *task = None;
    done.ok()
}

/// The next stream handed over to resume this session; never completes without resumption.
async fn next_handoff(r: &mut Option<Resumption>) -> Box<sm::Handoff> {
    match r.as_mut() {
        Some(r) => match r.rx.recv().await {
            Some(h) => h,
            None => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}

/// While detached: the next item of the mailbox, or `None` when the window is over; never
/// completes while attached.
async fn next_detached(d: &mut Option<Detached>) -> Option<Outbound> {
    let Some(d) = d.as_mut() else {
        return std::future::pending().await;
    };
    tokio::select! {
        m = d.rx.recv() => m,
        _ = d.until.as_mut() => None,
    }
}

/// The next event of a bound session's stream, with the reader handed back so the session
/// loop can start the next read. Owning the reader (rather than borrowing it) is what lets
/// the loop keep this future pinned across `select!` iterations. Without a reader (the
/// stream ended) it never completes.
async fn next_event(reader: Option<Reader>) -> (Reader, Result<StreamEvent, XmlError>) {
    let Some(mut reader) = reader else {
        return std::future::pending().await;
    };
    let ev = reader.next().await;
    (reader, ev)
}

/// How a writer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WriterEnd {
    /// It wrote the end of the stream (or was told to finish).
    Closed,
    /// The socket failed or stalled: the connection is gone.
    Failed,
    /// The session stopped it (detached, resumed elsewhere, killed).
    Stopped,
}

/// What a writer task is given.
struct Writing {
    writer: WriteHalf<BoxIo>,
    rx: mpsc::Receiver<Outbound>,
    /// The session's end.
    kill: CancellationToken,
    /// This writer's end (a detach or a resume).
    stop: CancellationToken,
    csi: crate::csi::Filter,
    /// The XEP-0198 counters, once `<enabled/>` was written.
    out: Option<sm::SharedOutgoing>,
    /// Written before anything from the mailbox (a resumption's `<resumed/>` and the
    /// stanzas it sends again).
    prelude: String,
}

/// What a writer hands back: the mailbox and filter, for the session to go on with.
struct WriterOut {
    rx: mpsc::Receiver<Outbound>,
    csi: crate::csi::Filter,
    end: WriterEnd,
}

/// Drains a session's mailbox onto the socket, batching what is already queued into one
/// write so a burst of presence costs one TLS record and one syscall, not one per stanza.
///
/// Stanzas pass the session's XEP-0352 filter ([`crate::csi::Filter`]) on the way, which
/// holds presence while the client says it is inactive. Once XEP-0198 is enabled every
/// stanza written is kept until the client acknowledges it ([`sm::Outgoing`]), and a batch
/// that leaves some unacknowledged ends with `<r/>` unless one is outstanding; more than
/// `[limits] sm_max_unacked` ends the stream with `resource-constraint` (RFC 6120
/// §4.9.3.17: the server cannot keep more for this client).
async fn write_loop(w: Writing) -> WriterOut {
    let Writing {
        mut writer,
        mut rx,
        kill,
        stop,
        mut csi,
        mut out,
        prelude,
    } = w;
    let mut buf = prelude;
    let mut end = WriterEnd::Closed;
    loop {
        let mut closing = false;
        if buf.is_empty() {
            let first = tokio::select! {
                biased;
                m = rx.recv() => m,
                _ = kill.cancelled() => None,
                _ = stop.cancelled() => None,
            };
            let Some(first) = first else {
                end = WriterEnd::Stopped;
                break;
            };
            let mut next = Some(first);
            let mut overflow = false;
            while let Some(msg) = next.take() {
                match msg {
                    item @ (Outbound::Stanza(_)
                    | Outbound::Xml(_)
                    | Outbound::ClientState(_)
                    | Outbound::Interest(_)) => csi.pass(item, |item| match (&out, item) {
                        (None, Outbound::Stanza(el)) => {
                            el.write_to(&mut buf, x::NS_CLIENT, x::NS_CLIENT)
                        }
                        (None, Outbound::Xml(xml)) => buf.push_str(&xml),
                        (Some(kept), item) => {
                            if let Some(s) = serialized(item) {
                                buf.push_str(&s);
                                overflow |= sm::lock(kept).push(s).is_err();
                            }
                        }
                        _ => {}
                    }),
                    Outbound::SmEnabled(enabled) => {
                        let sm::Enabled { xml, out: kept } = *enabled;
                        buf.push_str(&xml);
                        // §4: the count starts with the first stanza after <enabled/>.
                        sm::lock(&kept).enable();
                        out = Some(kept);
                    }
                    Outbound::SmNonza(xml) => buf.push_str(&xml),
                    Outbound::Close(err) => {
                        buf.push_str(&err.to_xml());
                        buf.push_str("</stream:stream>");
                        closing = true;
                    }
                    Outbound::End => {
                        buf.push_str("</stream:stream>");
                        closing = true;
                    }
                    Outbound::Finish => closing = true,
                }
                if closing || overflow || buf.len() > 64 * 1024 {
                    break;
                }
                next = rx.try_recv().ok();
            }
            if overflow {
                let err = StreamError::new(
                    StreamCondition::ResourceConstraint,
                    "too many stanzas not acknowledged (XEP-0198)",
                );
                buf.push_str(&err.to_xml());
                buf.push_str("</stream:stream>");
                closing = true;
            } else if !closing && out.as_ref().is_some_and(|o| sm::lock(o).should_request()) {
                buf.push_str(sm::REQUEST);
            }
        }
        if !buf.is_empty() {
            let wrote = tokio::select! {
                r = tokio::time::timeout(Duration::from_secs(30), async {
                    writer.write_all(buf.as_bytes()).await?;
                    writer.flush().await
                }) => r,
                _ = stop.cancelled() => {
                    end = WriterEnd::Stopped;
                    break;
                }
            };
            if !matches!(wrote, Ok(Ok(()))) {
                end = WriterEnd::Failed;
                break;
            }
            // Free the batch buffer after each write: most sessions write rarely, and a
            // buffer kept at the size of the last burst is held by every idle session.
            buf = String::new();
        }
        if closing {
            break;
        }
    }
    if end == WriterEnd::Closed {
        let _ = tokio::time::timeout(Duration::from_secs(2), writer.shutdown()).await;
    }
    WriterOut { rx, csi, end }
}

pub use crate::node::session::Session;

/// Checks and stamps one stanza from the client (RFC 6120 §8.1.2.1), then routes it.
async fn handle_stanza(session: &mut Session, mut el: Element) -> Result<(), StreamError> {
    if let Some(active) = crate::csi::nonza(&el) {
        // XEP-0352 §5: a nonza, not a stanza; it is never answered.
        tracing::debug!(peer = %session.peer, jid = %session.jid(), active, "client state");
        session.handle.set_client_state(active);
        return Ok(());
    }
    if el.ns != x::NS_CLIENT || !matches!(el.name.as_str(), "message" | "presence" | "iq") {
        // RFC 6120 §4.9.3.22.
        return Err(StreamError::new(
            StreamCondition::UnsupportedStanzaType,
            format!("<{}/> in {} is not a stanza", el.name, el.ns),
        ));
    }
    if let Some(from) = el.get_attr("from") {
        // RFC 6120 §8.1.2.1: a from that is not this session's JID is an invalid-from.
        let ok = Jid::new(from).is_ok_and(|j| {
            j.as_str() == session.jid().as_str() || j.as_str() == session.jid().to_bare().as_str()
        });
        if !ok {
            return Err(StreamError::new(
                StreamCondition::InvalidFrom,
                "the from address is not this session's",
            ));
        }
    }
    el.set_attr("from", session.jid().to_string());
    router::from_client(session, el).await;
    Ok(())
}

pub use crate::error::iq_result;

fn decode_b64(text: &str) -> Option<Vec<u8>> {
    let t = text.trim();
    // RFC 6120 §6.4.2: "=" is an empty initial response.
    if t.is_empty() || t == "=" {
        return Some(Vec::new());
    }
    B64.decode(t).ok()
}

/// A random identifier for stream ids and generated resources.
pub use crate::xml::new_id;

fn empty_io() -> BoxIo {
    Box::new(empty::EmptyDuplex)
}

fn empty_half() -> ReadHalf<BoxIo> {
    tokio::io::split(empty_io()).0
}

mod empty {
    use std::io;
    use std::pin::Pin;
    use std::task::{Context, Poll};
    use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

    /// A placeholder transport used only while the real one is moved out for STARTTLS.
    pub struct EmptyDuplex;

    impl AsyncRead for EmptyDuplex {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            _: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    impl AsyncWrite for EmptyDuplex {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            b: &[u8],
        ) -> Poll<io::Result<usize>> {
            Poll::Ready(Ok(b.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }
}
