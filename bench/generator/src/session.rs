//! One XMPP client session of the load generator: connect, STARTTLS, SASL SCRAM, bind,
//! roster, initial presence (RFC 6120 §5–7, RFC 6121 §2.2 and §4.2), then a loop that
//! sends presence changes on command and timestamps every presence it receives. With
//! `--login fast-resume` a session also keeps XEP-0198 stream management: it counts the
//! stanzas it handled, answers the server's `<r/>`, and a reconnect resumes it.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use presenced::transport::tls::HandshakeSignatures;
use rustls::client::danger::{ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use crate::scram::{SaltCache, ScramClient, ScramHash};
use crate::stats::Histogram;
use crate::xml::{escape, Element, Frame, Framer};

const NS_TLS: &str = "urn:ietf:params:xml:ns:xmpp-tls";
const NS_SASL: &str = "urn:ietf:params:xml:ns:xmpp-sasl";
const NS_SASL2: &str = "urn:xmpp:sasl:2";
const NS_BIND2: &str = "urn:xmpp:bind:0";
const NS_FAST: &str = "urn:xmpp:fast:0";
const NS_SM: &str = "urn:xmpp:sm:3";
/// The XEP-0484 mechanism the bench uses: HMAC-SHA-256 of the token, no channel binding.
const HT: &str = "HT-SHA-256-NONE";
/// The Bind 2 tag (XEP-0386 §3): the server binds `<tag>.<id>`.
const BIND2_TAG: &str = "bench";
/// Status text prefix that marks a timed presence change: `b1 <phase> <seq> <unix-ns>`.
pub const STATUS_TAG: &str = "b1";
/// Largest element the bench accepts from a server (rosters of a few thousand items fit).
const MAX_ELEMENT: usize = 4 << 20;

/// Nanoseconds since the Unix epoch; wall clock so that several generator processes on
/// the same machine can time each other's presences.
pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// Accepts any server certificate: BENCH-ONLY. The generator talks only to loopback test
/// servers with throw-away self-signed certificates (targets are checked to be loopback);
/// the TLS handshake itself, including the server's signature over it, is still performed
/// and verified so the server pays the real cost of TLS. Never copy this into a client that
/// talks to anything else.
#[derive(Debug)]
struct AcceptAnyCertificate(HandshakeSignatures);

impl ServerCertVerifier for AcceptAnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    presenced::verify_handshake_signatures_with!(0);
}

/// The bench's TLS client configuration (see [`AcceptAnyCertificate`]). Session resumption
/// is disabled so every login pays a full handshake, as a fleet of distinct clients would.
pub fn tls_config() -> Result<Arc<rustls::ClientConfig>, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("tls: {e}"))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AcceptAnyCertificate(HandshakeSignatures(
            provider,
        ))))
        .with_no_client_auth();
    cfg.resumption = rustls::client::Resumption::disabled();
    Ok(Arc::new(cfg))
}

/// How a client logs in (`--login`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LoginMode {
    /// RFC 6120 SASL with SCRAM, stream restart, bind by iq: every login the same.
    Sasl1,
    /// XEP-0388 SASL2 with the password (SCRAM) and XEP-0386 Bind 2 inline, on a full TLS
    /// handshake: every login the same (the password login of `fast`, without a token).
    Sasl2,
    /// The first login as `sasl2` asking for a XEP-0484 token; every later one with the
    /// token (HT-SHA-256-NONE, one round trip, no PBKDF2) over a TLS 1.3 connection that
    /// resumes the installation's previous session with a ticket (RFC 8446 §2.2).
    Fast,
    /// As `fast`, and the first login also enables XEP-0198 with resumption inside Bind 2;
    /// every later login carries `<resume previd h/>` in the same `<authenticate/>`
    /// (XEP-0198 §5 inline in XEP-0388), as Conversations and Monal reconnect. A resumed
    /// session sends no roster get and no initial presence (its state was kept); a refused
    /// resumption binds anew, with roster and presence, and is counted.
    FastResume,
}

impl LoginMode {
    /// Whether later logins use a FAST token over a resumed TLS session.
    pub fn uses_token(self) -> bool {
        matches!(self, LoginMode::Fast | LoginMode::FastResume)
    }
}

/// One client installation across its reconnects: its own TLS session store, its stable
/// XEP-0388 user-agent id, its FAST token with the count of its uses, and (`fast-resume`)
/// its XEP-0198 session.
pub struct Installation {
    tls: Arc<rustls::ClientConfig>,
    agent_id: String,
    token: Option<String>,
    /// XEP-0484 §4: `count` must rise on every use of a token, failed or not.
    count: u64,
    /// Whether its logins enable XEP-0198 resumption and resume (`fast-resume`).
    stream_management: bool,
    /// The resumable XEP-0198 session the server granted it last.
    sm: Option<SmSession>,
}

/// A resumable XEP-0198 session as its client knows it (§3–§5).
struct SmSession {
    /// `<enabled id/>`: what `<resume previd/>` names.
    id: String,
    /// Stanzas received and handled since `<enabled/>` (§4 `h`, modulo 2^32): shared with
    /// the connection that reads them, kept across its end for the resumption.
    handled: Arc<AtomicU32>,
    /// `<enabled max/>`: how long the server keeps it after a lost connection, s.
    max: Option<u64>,
}

impl Installation {
    /// User `i`'s installation on `base`'s TLS settings for `mode`. A mode with FAST
    /// tokens gives it a session store of its own, so its reconnect resumes its own session
    /// and no other client's; otherwise every handshake is full, as [`tls_config`]'s.
    pub fn new(base: &Arc<rustls::ClientConfig>, i: u32, mode: LoginMode) -> Installation {
        let tls = if mode.uses_token() {
            let mut cfg = (**base).clone();
            // TLS 1.3 tickets are single-use (RFC 8446 §C.4); the server sends a few per
            // connection, so a small store always holds a fresh one.
            cfg.resumption = rustls::client::Resumption::in_memory_sessions(4);
            Arc::new(cfg)
        } else {
            base.clone()
        };
        Installation {
            tls,
            agent_id: agent_id(i),
            token: None,
            count: 0,
            stream_management: mode == LoginMode::FastResume,
            sm: None,
        }
    }

    /// The XEP-0198 window the server granted this installation's session (`<enabled
    /// max/>`, s), if it has one.
    pub fn sm_window(&self) -> Option<u64> {
        self.sm.as_ref().and_then(|s| s.max)
    }
}

/// A stable id for user `i`'s installation in the form of a UUID (XEP-0388 §2.2.1 asks
/// for a stable, preferably UUID, id): the same on every run, so a server sees one
/// installation per user, as it would a fleet of phones.
fn agent_id(i: u32) -> String {
    use sha2::Digest;
    let h = sha2::Sha256::digest(format!("presenced-bench installation {i}"));
    let x: String = h[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-4{}-8{}-{}",
        &x[..8],
        &x[8..12],
        &x[13..16],
        &x[17..20],
        &x[20..32]
    )
}

fn hmac_sha256(key: &[u8], data: &[u8]) -> Vec<u8> {
    use hmac::Mac;
    let mut m = <hmac::Hmac<sha2::Sha256> as Mac>::new_from_slice(key)
        .expect("HMAC accepts keys of any length");
    m.update(data);
    m.finalize().into_bytes().to_vec()
}

/// Which SCRAM variant to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MechPref {
    /// SCRAM-SHA-256 when offered, else SCRAM-SHA-1.
    Auto,
    /// Only SCRAM-SHA-1.
    Sha1,
    /// Only SCRAM-SHA-256.
    Sha256,
}

/// Everything a session needs to reach and log in to the server under test.
#[derive(Clone)]
pub struct Target {
    /// Loopback address of the server's c2s listener (the one this session uses).
    pub addr: SocketAddr,
    /// Every c2s address of the server under test (the nodes of a cluster; `addr` is
    /// one of them): see [`Target::for_user`].
    pub addrs: Arc<Vec<SocketAddr>>,
    /// XMPP domain (stream `to`, TLS SNI, JID domain).
    pub domain: String,
    /// Client TLS configuration.
    pub tls: Arc<rustls::ClientConfig>,
    /// SCRAM variant preference.
    pub mech: MechPref,
    /// SaltedPassword cache (RFC 5802 §5.1).
    pub cache: Arc<SaltCache>,
    /// Local part prefix: user i is `<prefix><i>`.
    pub user_prefix: String,
    /// Password prefix: user i's password is `<prefix><i>`.
    pub password_prefix: String,
    /// Resource requested at bind.
    pub resource: String,
}

impl Target {
    /// The target of user `i` after `attempt` failed logins: address
    /// `(i + attempt) mod the number of addresses`, so consecutive users (ring neighbours,
    /// hence contacts) sit on different nodes and a failed login moves on to the next.
    pub fn for_user(&self, i: u32, attempt: usize) -> Target {
        let mut t = self.clone();
        if !self.addrs.is_empty() {
            t.addr = self.addrs[(i as usize + attempt) % self.addrs.len()];
        }
        t
    }

    /// Local part of user `i`.
    pub fn user(&self, i: u32) -> String {
        format!("{}{i}", self.user_prefix)
    }

    /// Password of user `i`.
    pub fn password(&self, i: u32) -> String {
        format!("{}{i}", self.password_prefix)
    }

    /// Bare JID of user `i`.
    pub fn bare(&self, i: u32) -> String {
        format!("{}{i}@{}", self.user_prefix, self.domain)
    }
}

/// A stream in either state: plain TCP before STARTTLS, TLS after.
pub struct Conn<S> {
    io: S,
    framer: Framer,
    rbuf: Vec<u8>,
    /// XEP-0198 §4: stanzas handled since `<enabled/>`, once stream management is on.
    sm: Option<Arc<AtomicU32>>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Conn<S> {
    fn new(io: S) -> Self {
        Conn {
            io,
            framer: Framer::new(MAX_ELEMENT),
            rbuf: vec![0u8; 4096],
            sm: None,
        }
    }

    /// The next frame already read, if one is complete. With stream management on, a
    /// stanza counts as handled as it is taken (XEP-0198 §4: every `<message/>`,
    /// `<presence/>` and `<iq/>` after `<enabled/>`, whatever the client then does with it).
    fn next_frame(&mut self) -> Result<Option<Frame>, String> {
        let f = self.framer.next_frame()?;
        if let (Some(Frame::Element(e)), Some(h)) = (&f, &self.sm) {
            if matches!(e.name.as_str(), "message" | "presence" | "iq") {
                h.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(f)
    }

    /// The answer to the server's `<r/>` (XEP-0198 §4), when `e` is one and stream
    /// management is on. The server asks again only once it has its answer, so every
    /// request is answered, during the login too: unanswered, its unacknowledged stanzas
    /// pile up until it closes the stream.
    fn ack_for(&self, e: &Element) -> Option<String> {
        let h = self.sm.as_ref().filter(|_| e.name == "r")?;
        Some(format!(
            "<a xmlns='{NS_SM}' h='{}'/>",
            h.load(Ordering::Relaxed)
        ))
    }

    async fn send(&mut self, s: &str) -> Result<(), String> {
        self.io
            .write_all(s.as_bytes())
            .await
            .map_err(|e| format!("write: {e}"))?;
        self.io.flush().await.map_err(|e| format!("flush: {e}"))
    }

    /// Reads until one frame is complete.
    async fn frame(&mut self) -> Result<Frame, String> {
        loop {
            if let Some(f) = self.next_frame()? {
                if let Frame::Element(e) = &f {
                    if let Some(a) = self.ack_for(e) {
                        self.send(&a).await?;
                        continue;
                    }
                }
                return Ok(f);
            }
            let n = self
                .io
                .read(&mut self.rbuf)
                .await
                .map_err(|e| format!("read: {e}"))?;
            if n == 0 {
                return Err("connection closed by server".into());
            }
            self.framer.feed(&self.rbuf[..n]);
        }
    }

    /// The next top-level element; a stream close or stream error is an error.
    async fn element(&mut self) -> Result<Element, String> {
        match self.frame().await? {
            Frame::Element(e) if e.name == "error" => {
                Err(format!("stream error: {}", describe(&e)))
            }
            Frame::Element(e) => Ok(e),
            Frame::StreamOpen(_) => Err("unexpected stream header".into()),
            Frame::StreamClose => Err("server closed the stream".into()),
        }
    }

    /// Opens (or restarts) the stream and returns the server's `<stream:features/>`.
    async fn open_stream(&mut self, domain: &str) -> Result<Element, String> {
        self.framer.reset();
        self.send(&format!(
            "<?xml version='1.0'?><stream:stream to='{}' version='1.0' xml:lang='en' \
             xmlns='jabber:client' xmlns:stream='http://etherx.jabber.org/streams'>",
            escape(domain)
        ))
        .await?;
        match self.frame().await? {
            Frame::StreamOpen(_) => {}
            other => return Err(format!("expected stream header, got {other:?}")),
        }
        let f = self.element().await?;
        if f.name != "features" {
            return Err(format!("expected stream features, got <{}>", f.name));
        }
        Ok(f)
    }
}

/// A short description of an error element: its first child's name.
fn describe(e: &Element) -> String {
    e.children
        .iter()
        .map(|c| c.name.as_str())
        .filter(|n| *n != "text")
        .collect::<Vec<_>>()
        .join(",")
}

/// Connects from `source` (an address in 127.0.0.0/8, so each source has its own
/// ephemeral port range), with TCP_NODELAY: small stanzas must not wait for Nagle.
async fn connect(target: &Target, source: IpAddr) -> Result<TcpStream, String> {
    let sock = TcpSocket::new_v4().map_err(|e| format!("socket: {e}"))?;
    sock.bind(SocketAddr::new(source, 0))
        .map_err(|e| format!("bind {source}: {e}"))?;
    let tcp = sock
        .connect(target.addr)
        .await
        .map_err(|e| format!("connect {} from {source}: {e}", target.addr))?;
    tcp.set_nodelay(true).map_err(|e| format!("nodelay: {e}"))?;
    Ok(tcp)
}

/// TCP + STARTTLS (RFC 6120 §5.4) + the first stream over TLS; returns its features.
async fn open_secure(
    target: &Target,
    source: IpAddr,
) -> Result<(Conn<TlsStream<TcpStream>>, Element), String> {
    open_secure_with(target, &target.tls, source).await
}

/// [`open_secure`] with the TLS configuration `tls` (an installation's own).
async fn open_secure_with(
    target: &Target,
    tls: &Arc<rustls::ClientConfig>,
    source: IpAddr,
) -> Result<(Conn<TlsStream<TcpStream>>, Element), String> {
    let tcp = connect(target, source).await?;
    let mut plain = Conn::new(tcp);
    let features = plain.open_stream(&target.domain).await?;
    if features.child("starttls").is_none() {
        return Err("server does not offer STARTTLS".into());
    }
    plain.send(&format!("<starttls xmlns='{NS_TLS}'/>")).await?;
    let answer = plain.element().await?;
    if answer.name != "proceed" {
        return Err(format!("STARTTLS refused: <{}>", answer.name));
    }
    // RFC 6120 §5.4.3.3: nothing may follow <proceed/> in clear text.
    if !plain.framer.is_empty() {
        return Err("data after <proceed/>".into());
    }
    let name = ServerName::try_from(target.domain.clone()).map_err(|e| format!("sni: {e}"))?;
    let tls = TlsConnector::from(tls.clone())
        .connect(name, plain.io)
        .await
        .map_err(|e| format!("tls handshake: {e}"))?;
    let mut conn = Conn::new(tls);
    let features = conn.open_stream(&target.domain).await?;
    Ok((conn, features))
}

fn choose_mechanism(features: &Element, pref: MechPref) -> Result<ScramHash, String> {
    let offered: Vec<&str> = features
        .child("mechanisms")
        .map(|m| m.children.iter().map(|c| c.text.trim()).collect())
        .unwrap_or_default();
    choose_among(&offered, pref)
}

fn choose_among(offered: &[&str], pref: MechPref) -> Result<ScramHash, String> {
    let has = |m: &str| offered.contains(&m);
    let pick = match pref {
        MechPref::Auto if has("SCRAM-SHA-256") => Some(ScramHash::Sha256),
        MechPref::Auto | MechPref::Sha1 if has("SCRAM-SHA-1") => Some(ScramHash::Sha1),
        MechPref::Sha256 if has("SCRAM-SHA-256") => Some(ScramHash::Sha256),
        _ => None,
    };
    pick.ok_or_else(|| format!("no usable SCRAM mechanism among {offered:?}"))
}

/// SASL SCRAM exchange (RFC 6120 §6.4).
async fn authenticate<S: AsyncRead + AsyncWrite + Unpin>(
    conn: &mut Conn<S>,
    target: &Target,
    features: &Element,
    user: &str,
    password: &str,
) -> Result<ScramHash, String> {
    let hash = choose_mechanism(features, target.mech)?;
    let mut scram = ScramClient::with_random_nonce(hash, user, password);
    conn.send(&format!(
        "<auth xmlns='{NS_SASL}' mechanism='{}'>{}</auth>",
        hash.mechanism(),
        B64.encode(scram.first())
    ))
    .await?;
    let mut answer = scram_round(conn, &mut scram, target, NS_SASL, "sasl").await?;
    if answer.name == "challenge" {
        // RFC 6120 §6.4.5 allows the server-final in a challenge; acknowledge it empty.
        let server_final = decode_b64_text(&answer)?;
        scram.verify(&server_final).map_err(|e| e.to_string())?;
        conn.send(&format!("<response xmlns='{NS_SASL}'/>")).await?;
        answer = conn.element().await?;
        if answer.name != "success" {
            return Err(format!("sasl: {} {}", answer.name, describe(&answer)));
        }
        return Ok(hash);
    }
    if answer.name != "success" {
        return Err(format!("sasl: {} {}", answer.name, describe(&answer)));
    }
    let server_final = decode_b64_text(&answer)?;
    scram.verify(&server_final).map_err(|e| e.to_string())?;
    Ok(hash)
}

/// SCRAM's middle round (RFC 5802 §3) in the framing of namespace `ns` (SASL or SASL2,
/// named `what` in errors): the server-first in a `<challenge/>`, the client-final in a
/// `<response/>`; the element that answers it.
async fn scram_round<S: AsyncRead + AsyncWrite + Unpin>(
    conn: &mut Conn<S>,
    scram: &mut ScramClient,
    target: &Target,
    ns: &str,
    what: &str,
) -> Result<Element, String> {
    let challenge = conn.element().await?;
    if challenge.name != "challenge" {
        return Err(format!(
            "{what}: {} {}",
            challenge.name,
            describe(&challenge)
        ));
    }
    let server_first = decode_b64_text(&challenge)?;
    let client_final = scram
        .respond(&server_first, &target.cache)
        .map_err(|e| e.to_string())?;
    conn.send(&format!(
        "<response xmlns='{ns}'>{}</response>",
        B64.encode(client_final)
    ))
    .await?;
    conn.element().await
}

fn decode_b64_text(e: &Element) -> Result<String, String> {
    let raw = B64
        .decode(e.text.trim())
        .map_err(|err| format!("sasl base64: {err}"))?;
    String::from_utf8(raw).map_err(|err| format!("sasl utf-8: {err}"))
}

/// Sends an IQ and waits for its answer, skipping anything else that arrives meanwhile.
async fn iq<S: AsyncRead + AsyncWrite + Unpin>(
    conn: &mut Conn<S>,
    id: &str,
    xml: &str,
) -> Result<Element, String> {
    conn.send(xml).await?;
    loop {
        let e = conn.element().await?;
        if e.name == "iq" && e.attr("id") == Some(id) {
            return match e.attr("type") {
                Some("result") => Ok(e),
                _ => Err(format!(
                    "iq {id} failed: {}",
                    e.child("error").map(describe).unwrap_or_default()
                )),
            };
        }
    }
}

/// What the roster fetched at login looked like.
#[derive(Debug, Clone, Copy, Default)]
pub struct RosterSummary {
    /// Items in the roster.
    pub items: u32,
    /// Items with subscription="both".
    pub both: u32,
}

/// A logged-in session before it starts its run loop.
pub struct LoggedIn {
    conn: Conn<TlsStream<TcpStream>>,
    /// The roster as fetched during login.
    pub roster: RosterSummary,
    /// What the login negotiated: `<TLS version> <cipher suite> <SASL mechanism>`, so a
    /// report shows that every server was measured with the same handshake.
    pub negotiated: String,
    /// The TLS handshake resumed an earlier session (RFC 8446 §2.2).
    pub resumed: bool,
    /// The login used a FAST token (XEP-0484).
    pub fast: bool,
    /// The login resumed the installation's XEP-0198 session (`<resumed/>` in the
    /// `<success/>`): no roster get, no initial presence, the session's state kept.
    pub sm_resumed: bool,
    /// The login asked to resume and the server refused (`<failed/>`): a new resource
    /// was bound instead, with roster get and initial presence.
    pub sm_failed: bool,
}

/// The whole login of user `i`: STARTTLS, SCRAM, bind, roster get, initial presence.
pub async fn login(target: &Target, i: u32, source: IpAddr) -> Result<LoggedIn, String> {
    login_with_presence(target, i, source, "<presence/>").await
}

/// [`login`] with `initial` as the initial presence (the storm mode marks a returning
/// session's presence with the storm it returns from).
pub async fn login_with_presence(
    target: &Target,
    i: u32,
    source: IpAddr,
    initial: &str,
) -> Result<LoggedIn, String> {
    let (mut conn, features) = open_secure(target, source).await?;
    let mech = authenticate(
        &mut conn,
        target,
        &features,
        &target.user(i),
        &target.password(i),
    )
    .await?;
    let negotiated = negotiated(conn.io.get_ref().1, mech.mechanism());
    // RFC 6120 §6.4.6: the stream restarts after SASL success.
    let features = conn.open_stream(&target.domain).await?;
    if features.child("bind").is_none() {
        return Err("server does not offer resource binding".into());
    }
    iq(
        &mut conn,
        "bind1",
        &format!(
            "<iq type='set' id='bind1'><bind xmlns='urn:ietf:params:xml:ns:xmpp-bind'>\
             <resource>{}</resource></bind></iq>",
            escape(&target.resource)
        ),
    )
    .await?;
    // RFC 3921 session establishment, only where a server still requires it.
    if let Some(s) = features.child("session") {
        if s.child("optional").is_none() {
            iq(
                &mut conn,
                "sess1",
                "<iq type='set' id='sess1'><session xmlns='urn:ietf:params:xml:ns:xmpp-session'/></iq>",
            )
            .await?;
        }
    }
    let roster = fetch_roster(&mut conn).await?;
    // RFC 6121 §4.2: initial presence after the roster, so probes go to known contacts.
    conn.send(initial).await?;
    Ok(LoggedIn {
        conn,
        roster,
        negotiated,
        resumed: false,
        fast: false,
        sm_resumed: false,
        sm_failed: false,
    })
}

/// User `i`'s login as `mode` says, from installation `inst` (which keeps what a later
/// login needs: its TLS sessions and its FAST token). [`LoginMode::Sasl1`] is [`login`].
pub async fn login_as(
    target: &Target,
    mode: LoginMode,
    i: u32,
    source: IpAddr,
    initial: &str,
    inst: &mut Installation,
) -> Result<LoggedIn, String> {
    match mode {
        LoginMode::Sasl1 => login_with_presence(target, i, source, initial).await,
        LoginMode::Sasl2 | LoginMode::Fast | LoginMode::FastResume => {
            let (mut conn, features) = open_secure_with(target, &inst.tls, source).await?;
            let tls = conn.io.get_ref().1;
            let resumed = tls.handshake_kind() == Some(rustls::HandshakeKind::Resumed);
            let auth = features
                .child("authentication")
                .ok_or("server does not offer SASL2 (XEP-0388)")?;
            // XEP-0198 §5 inline in XEP-0388: the session the installation left, with the
            // stanzas it handled, resumed in the same round trip as the authentication.
            let resume = inst
                .sm
                .as_ref()
                .filter(|_| inst.stream_management)
                .map(|s| {
                    format!(
                        "<resume xmlns='{NS_SM}' previd='{}' h='{}'/>",
                        escape(&s.id),
                        s.handled.load(Ordering::Relaxed)
                    )
                })
                .unwrap_or_default();
            let (mech, fast, success) = match (mode.uses_token(), inst.token.clone()) {
                (true, Some(token)) => {
                    let s = fast_login(&mut conn, target, auth, i, &token, inst, &resume).await?;
                    (HT.to_string(), true, s)
                }
                (want, _) => {
                    let (hash, s) =
                        sasl2_password_login(&mut conn, target, auth, i, inst, want, &resume)
                            .await?;
                    (hash.mechanism().to_string(), false, s)
                }
            };
            let negotiated = negotiated(conn.io.get_ref().1, &mech);
            let sm_failed = !resume.is_empty();
            match sasl2_outcome(&success, target, i, inst)? {
                Outcome::Resumed(handled) => {
                    // XEP-0198 §5: the session goes on as it was; what the server had not
                    // seen acknowledged comes again and is counted as it is read.
                    conn.sm = Some(handled);
                    return Ok(LoggedIn {
                        conn,
                        roster: RosterSummary::default(),
                        negotiated,
                        resumed,
                        fast,
                        sm_resumed: true,
                        sm_failed: false,
                    });
                }
                Outcome::Bound(handled) => conn.sm = handled,
            }
            // XEP-0388 §2.6: no stream restart after a SASL2 success; the resource is bound
            // (checked in the success), so the session's stanzas follow at once.
            let roster = fetch_roster(&mut conn).await?;
            conn.send(initial).await?;
            Ok(LoggedIn {
                conn,
                roster,
                negotiated,
                resumed,
                fast,
                sm_resumed: false,
                sm_failed,
            })
        }
    }
}

/// What a SASL2 `<success/>` gave the installation.
enum Outcome {
    /// XEP-0198 `<resumed/>` of its session, whose count goes on.
    Resumed(Arc<AtomicU32>),
    /// A resource bound (XEP-0386), with the count of its new XEP-0198 session if the
    /// installation enabled stream management.
    Bound(Option<Arc<AtomicU32>>),
}

/// Reads user `i`'s SASL2 `<success/>`: `<resumed/>` of the installation's XEP-0198
/// session (checked to name it, for a full JID of the user), or `<bound/>` (checked as
/// [`check_bound`]) and, when the installation asked for it, the `<enabled/>` inside it,
/// whose session a later login resumes.
fn sasl2_outcome(
    success: &Element,
    target: &Target,
    i: u32,
    inst: &mut Installation,
) -> Result<Outcome, String> {
    if let Some(r) = success.child("resumed") {
        let sm = inst
            .sm
            .as_ref()
            .ok_or("sasl2: <resumed/> without a <resume/> asked")?;
        if r.attr("previd") != Some(sm.id.as_str()) {
            return Err(format!(
                "sasl2: <resumed previd={:?}/> is not the session {:?}",
                r.attr("previd"),
                sm.id
            ));
        }
        check_full_jid(success, target, i)?;
        return Ok(Outcome::Resumed(sm.handled.clone()));
    }
    check_bound(success, target, i)?;
    if !inst.stream_management {
        return Ok(Outcome::Bound(None));
    }
    let enabled = success
        .child("bound")
        .and_then(|b| b.child("enabled"))
        .filter(|e| e.attr("resume") == Some("true"))
        .ok_or("sasl2: no resumable <enabled/> in <bound/> (XEP-0198 refused)")?;
    let id = enabled
        .attr("id")
        .ok_or("sasl2: <enabled resume='true'/> without an id")?;
    let handled = Arc::new(AtomicU32::new(0));
    inst.sm = Some(SmSession {
        id: id.to_string(),
        handled: handled.clone(),
        max: enabled.attr("max").and_then(|m| m.parse().ok()),
    });
    Ok(Outcome::Bound(Some(handled)))
}

/// `<user-agent/>` (XEP-0388 §2.2.1) and `<bind/>` (XEP-0386 §3), as every SASL2
/// `<authenticate/>` of the bench carries them; `fast-resume` enables XEP-0198 with
/// resumption inside the bind (XEP-0386 §3.2), after `resume` (XEP-0198 §5 inline, empty
/// when there is nothing to resume): the bind applies only if the resumption fails.
fn agent_and_bind(inst: &Installation, resume: &str) -> String {
    let enable = if inst.stream_management {
        format!("<enable xmlns='{NS_SM}' resume='true'/>")
    } else {
        String::new()
    };
    format!(
        "<user-agent id='{}'><software>presenced-bench</software></user-agent>\
         {resume}<bind xmlns='{NS_BIND2}'><tag>{BIND2_TAG}</tag>{enable}</bind>",
        escape(&inst.agent_id)
    )
}

/// SASL2 SCRAM with the password (XEP-0388 §2.3–2.6), asking for a FAST token when
/// `request_token` (XEP-0484 §3.2), with `resume` inline (see [`agent_and_bind`]).
/// Returns the SCRAM variant and the `<success/>`, its bind or resumption not yet read.
async fn sasl2_password_login<S: AsyncRead + AsyncWrite + Unpin>(
    conn: &mut Conn<S>,
    target: &Target,
    auth: &Element,
    i: u32,
    inst: &mut Installation,
    request_token: bool,
    resume: &str,
) -> Result<(ScramHash, Element), String> {
    let offered: Vec<&str> = auth
        .children
        .iter()
        .filter(|c| c.name == "mechanism")
        .map(|c| c.text.trim())
        .collect();
    let hash = choose_among(&offered, target.mech)?;
    if request_token && !offers_fast(auth) {
        return Err(format!("server does not offer {HT} in SASL2's <inline/>"));
    }
    let user = target.user(i);
    let mut scram = ScramClient::with_random_nonce(hash, &user, &target.password(i));
    let request = if request_token {
        format!("<request-token xmlns='{NS_FAST}' mechanism='{HT}'/>")
    } else {
        String::new()
    };
    conn.send(&format!(
        "<authenticate xmlns='{NS_SASL2}' mechanism='{}'><initial-response>{}</initial-response>\
         {}{request}</authenticate>",
        hash.mechanism(),
        B64.encode(scram.first()),
        agent_and_bind(inst, resume)
    ))
    .await?;
    let success = scram_round(conn, &mut scram, target, NS_SASL2, "sasl2").await?;
    if success.name != "success" {
        return Err(format!("sasl2: {} {}", success.name, describe(&success)));
    }
    // XEP-0388 §2.6: SCRAM's server-final comes in <additional-data/>.
    let server_final = success
        .child("additional-data")
        .ok_or("sasl2: no <additional-data/> (SCRAM server-final) in <success/>")?;
    scram
        .verify(&decode_b64_text(server_final)?)
        .map_err(|e| e.to_string())?;
    if request_token {
        let token = success
            .child("token")
            .and_then(|t| t.attr("token"))
            .ok_or("sasl2: <request-token/> answered without a <token/>")?;
        inst.token = Some(token.to_string());
    }
    Ok((hash, success))
}

/// XEP-0484 §3.3: the token logs in in one round trip. The initial response is the
/// username, NUL, and HMAC-SHA-256 keyed with the token over "Initiator" (channel binding
/// data empty for -NONE); the server proves it holds the token with the HMAC over
/// "Responder" in `<additional-data/>`, which is checked. A new `<token/>` (rotation) is
/// kept; a refused token is dropped, so the next attempt uses the password. `resume` goes
/// inline (see [`agent_and_bind`]); returns the `<success/>`, its bind or resumption not
/// yet read.
async fn fast_login<S: AsyncRead + AsyncWrite + Unpin>(
    conn: &mut Conn<S>,
    target: &Target,
    auth: &Element,
    i: u32,
    token: &str,
    inst: &mut Installation,
    resume: &str,
) -> Result<Element, String> {
    if !offers_fast(auth) {
        return Err(format!("server does not offer {HT} in SASL2's <inline/>"));
    }
    inst.count += 1;
    let mut initial = format!("{}\0", target.user(i)).into_bytes();
    initial.extend(hmac_sha256(token.as_bytes(), b"Initiator"));
    conn.send(&format!(
        "<authenticate xmlns='{NS_SASL2}' mechanism='{HT}'><initial-response>{}</initial-response>\
         {}<fast xmlns='{NS_FAST}' count='{}'/></authenticate>",
        B64.encode(initial),
        agent_and_bind(inst, resume),
        inst.count
    ))
    .await?;
    let answer = conn.element().await?;
    if answer.name != "success" {
        // XEP-0484 §3.3: a refused token (credentials-expired, not-authorized) is no use
        // again; the installation falls back to its password.
        if answer.name == "failure" {
            inst.token = None;
        }
        return Err(format!("fast: {} {}", answer.name, describe(&answer)));
    }
    let proof = answer
        .child("additional-data")
        .ok_or("fast: no <additional-data/> (the server's proof) in <success/>")?;
    let proof = B64
        .decode(proof.text.trim())
        .map_err(|e| format!("fast: base64: {e}"))?;
    if proof != hmac_sha256(token.as_bytes(), b"Responder") {
        return Err("fast: the server's proof does not match the token".into());
    }
    if let Some(t) = answer.child("token").and_then(|t| t.attr("token")) {
        inst.token = Some(t.to_string());
    }
    Ok(answer)
}

/// Whether SASL2's `<inline/>` offers [`HT`] (XEP-0484 §3.1).
fn offers_fast(auth: &Element) -> bool {
    auth.child("inline")
        .and_then(|i| i.child("fast"))
        .is_some_and(|f| f.children.iter().any(|m| m.text.trim() == HT))
}

/// The `<success/>` bound a resource for user `i` (XEP-0386 §3): `<bound/>` and the full
/// JID in `<authorization-identifier/>`.
fn check_bound(success: &Element, target: &Target, i: u32) -> Result<(), String> {
    if success.child("bound").is_none() {
        return Err("sasl2: no <bound/> in <success/> (Bind 2 refused)".into());
    }
    check_full_jid(success, target, i)
}

/// The `<success/>`'s `<authorization-identifier/>` is a full JID of user `i`.
fn check_full_jid(success: &Element, target: &Target, i: u32) -> Result<(), String> {
    let jid = success
        .child("authorization-identifier")
        .map(|a| a.text.trim())
        .unwrap_or_default();
    if !jid.starts_with(&format!("{}/", target.bare(i))) {
        return Err(format!(
            "sasl2: authorization-identifier {jid:?} is not a full JID of the user"
        ));
    }
    Ok(())
}

/// `<TLS version> <cipher suite> <SASL mechanism>` of one login, e.g.
/// `TLSv1_3 TLS13_AES_256_GCM_SHA384 SCRAM-SHA-1` (rustls' names).
fn negotiated(tls: &rustls::ClientConnection, mech: &str) -> String {
    let version = tls
        .protocol_version()
        .map(|v| format!("{v:?}"))
        .unwrap_or_else(|| "?".into());
    let suite = tls
        .negotiated_cipher_suite()
        .map(|s| format!("{:?}", s.suite()))
        .unwrap_or_else(|| "?".into());
    format!("{version} {suite} {mech}")
}

async fn fetch_roster<S: AsyncRead + AsyncWrite + Unpin>(
    conn: &mut Conn<S>,
) -> Result<RosterSummary, String> {
    let r = iq(
        conn,
        "roster1",
        "<iq type='get' id='roster1'><query xmlns='jabber:iq:roster'/></iq>",
    )
    .await?;
    let mut s = RosterSummary::default();
    if let Some(q) = r.child("query") {
        for item in q.children.iter().filter(|c| c.name == "item") {
            s.items += 1;
            if item.attr("subscription") == Some("both") {
                s.both += 1;
            }
        }
    }
    Ok(s)
}

/// In-band registration (XEP-0077) of user `i`; an existing account counts as success.
pub async fn register(target: &Target, i: u32, source: IpAddr) -> Result<bool, String> {
    let (mut conn, _features) = open_secure(target, source).await?;
    let res = iq(
        &mut conn,
        "reg1",
        &format!(
            "<iq type='set' id='reg1'><query xmlns='jabber:iq:register'>\
             <username>{}</username><password>{}</password></query></iq>",
            escape(&target.user(i)),
            escape(&target.password(i))
        ),
    )
    .await;
    let _ = conn.send("</stream:stream>").await;
    let _ = conn.io.shutdown().await;
    match res {
        Ok(_) => Ok(true),
        // XEP-0077 §3.1: <conflict/> means the username is taken, i.e. provisioned already.
        Err(e) if e.contains("conflict") => Ok(false),
        Err(e) => Err(e),
    }
}

/// Per-phase delivery statistics.
#[derive(Default)]
pub struct PhaseStats {
    /// Presence changes written to the server.
    pub sent: AtomicU64,
    /// Timed presences received at watchers.
    pub delivered: AtomicU64,
    /// Of those, presences a watcher had already had, or an older one than it had, from
    /// the same contact (a contact's changes carry rising sequence numbers): duplicates
    /// (XMPP keeps the order between two parties, RFC 6120 §10.1).
    pub repeated: AtomicU64,
    /// Send-to-receipt latency of each delivery, µs.
    pub latency: Histogram,
}

/// The phase of the fixed offered load (`--fixed-rate`).
pub const FIXED_PHASE: usize = 0;
/// The phase of the saturation run.
pub const SAT_PHASE: usize = 1;
/// The first phase of the latency ladder (`--fixed-rates`): rate i is phase
/// `LADDER_PHASE + i`, so each rate has its own counts and latency histogram.
pub const LADDER_PHASE: usize = 2;
/// Rates the latency ladder may hold at most.
pub const LADDER_MAX: usize = 6;
/// Phases with their own counters: fixed load, saturation, the ladder's rates.
pub const PHASES: usize = LADDER_PHASE + LADDER_MAX;

/// Counters shared by all sessions.
#[derive(Default)]
pub struct Shared {
    /// Per phase: [`FIXED_PHASE`], [`SAT_PHASE`], then the ladder's rates.
    pub phases: [PhaseStats; PHASES],
    /// Untimed available presences from contacts (initial presence and probe answers).
    pub initial_presences: AtomicU64,
    /// Sessions whose roster at login held all K contacts with subscription "both".
    pub rosters_complete: AtomicU64,
    /// Sessions that have seen every one of their contacts available.
    pub sessions_all_contacts_seen: AtomicU64,
    /// Stanzas received after login, of any kind.
    pub stanzas_in: AtomicU64,
    /// `now_ns()` of the last presence received (for "quiet" detection). Presence only:
    /// a server that pings silent clients (XEP-0199; presenced after 30 s) would otherwise
    /// never look quiet once its login storm outlasts that, and its load phases would start
    /// the whole settle cap later than a peer's.
    pub last_presence_ns: AtomicU64,
    /// Sessions that ended without being asked to.
    pub sessions_lost: AtomicU64,
    /// Subscription requests answered with `subscribed` (provisioning).
    pub subscriptions_approved: AtomicU64,
    /// Interest lists the server accepted (CSI runs).
    pub interest_results: AtomicU64,
    /// Interest lists the server refused (CSI runs).
    pub interest_errors: AtomicU64,
    /// Soak messages: written to the server, received (live or from offline storage),
    /// received with a XEP-0203 `<delay/>` (from offline storage), bounced with an error.
    pub messages: MessageCounts,
    /// Soak probes (timed presences of phase [`PROBE_PHASE`]): watchers reached per probe
    /// sequence number, so a fault run can tell when every watcher sees changes again.
    pub probe_hits: Mutex<std::collections::HashMap<u64, u32>>,
    /// First few distinct errors, for the report.
    pub errors: Mutex<Vec<String>>,
    /// Distinct `negotiated` strings of the logins (TLS version, cipher suite, SASL).
    pub negotiated: Mutex<Vec<String>>,
    /// Unavailable presences from contacts, per contact's bare JID: how many distinct
    /// watchers of this process got one and `now_ns()` of the first arrival at each
    /// watcher's latest (the timed run's kill phase).
    pub unavailable: Mutex<std::collections::HashMap<String, (u32, u64)>>,
    /// (contact's full JID, watcher) pairs counted in `unavailable`, and the unavailables
    /// received beyond the first per pair (a session announced twice to the same watcher).
    pub unavailable_pairs: Mutex<(HashSet<(String, String)>, u64)>,
    /// The reconnect storm's view of who sees whom again (Mode::Storm).
    pub storm: StormBoard,
}

/// The status of a returning session's initial presence in reconnect storm `epoch`.
pub fn storm_status(epoch: u64) -> String {
    format!("{STORM_TAG} {epoch}")
}

/// Marks the status of a storm's returning presence: `<STORM_TAG> <epoch>`.
pub const STORM_TAG: &str = "s1";

/// What the watchers of a reconnect storm have seen (storm.rs): per watcher (bare JID),
/// each contact (bare JID) whose presence of the current storm reached the watcher's
/// current connection, with when it arrived. A presence of an earlier epoch (a session
/// from before the storm, still known to the server) does not count, and an unavailable
/// from the contact's full JID takes the contact out again.
#[derive(Default)]
pub struct StormBoard {
    /// The storm under way (0: none yet); a returning session's initial presence names it.
    pub epoch: AtomicU64,
    /// watcher → contact → `now_ns()` of the arrival.
    pub seen: Mutex<HashMap<String, HashMap<String, u64>>>,
    /// Contacts an unavailable of whose (from a full JID) reached any watcher since the
    /// storm began: told gone, so a XEP-0198 resumption alone does not restore them.
    pub gone: Mutex<HashSet<String>>,
}

impl StormBoard {
    /// Storm `epoch` begins: what reached anyone in an earlier one counts no more.
    pub fn begin(&self, epoch: u64) {
        if let Ok(mut s) = self.seen.lock() {
            self.epoch.store(epoch, Ordering::Relaxed);
            s.clear();
        }
        if let Ok(mut g) = self.gone.lock() {
            g.clear();
        }
    }

    /// A new connection of `watcher`: nothing reached it yet.
    pub fn connected(&self, watcher: &str) {
        if let Ok(mut s) = self.seen.lock() {
            s.remove(watcher);
        }
    }

    /// Notes one presence `watcher` received (see the type's documentation).
    pub fn note(&self, watcher: &str, el: &Element, now: u64) {
        let from = el.attr("from").unwrap_or("");
        let contact = bare_of(from);
        if contact == watcher {
            return;
        }
        match el.attr("type") {
            None => {
                let status = el.child("status").map(|s| s.text.as_str()).unwrap_or("");
                let Ok(mut s) = self.seen.lock() else {
                    return;
                };
                // Read under the lock `begin` holds: nothing of an earlier storm slips in.
                let epoch = self.epoch.load(Ordering::Relaxed);
                if epoch != 0 && status == storm_status(epoch) {
                    s.entry(watcher.to_string())
                        .or_default()
                        .entry(contact.to_string())
                        .or_insert(now);
                }
            }
            // The end of a session (a full JID), not a probe's answer for an account with
            // no session (its bare JID, RFC 6121 §4.3.2).
            Some("unavailable") if contact != from => {
                if let Ok(mut s) = self.seen.lock() {
                    if let Some(m) = s.get_mut(watcher) {
                        m.remove(contact);
                    }
                }
                if let Ok(mut g) = self.gone.lock() {
                    g.insert(contact.to_string());
                }
            }
            Some(_) => {}
        }
    }

    /// When `contact`'s presence of the current storm reached `watcher`, if it did
    /// (storm.rs reads the whole map under one lock instead).
    #[cfg(test)]
    pub fn arrival(&self, watcher: &str, contact: &str) -> Option<u64> {
        let s = self.seen.lock().ok()?;
        s.get(watcher)?.get(contact).copied()
    }
}

impl Shared {
    /// Records what one login negotiated (each distinct combination once).
    pub fn note_negotiated(&self, n: &str) {
        if let Ok(mut v) = self.negotiated.lock() {
            if v.len() < 10 && !v.iter().any(|x| x == n) {
                v.push(n.to_string());
            }
        }
    }

    /// Keeps the first few error messages.
    pub fn note_error(&self, e: String) {
        if let Ok(mut v) = self.errors.lock() {
            if v.len() < 10 && !v.contains(&e) {
                v.push(e);
            }
        }
    }
}

/// What happened to the soak's chat messages, counted at the clients.
#[derive(Default)]
pub struct MessageCounts {
    /// Messages written to the server.
    pub sent: AtomicU64,
    /// Soak messages received, live or from offline storage.
    pub received: AtomicU64,
    /// Of `received`, those carrying a XEP-0203 `<delay/>` (kept offline, RFC 6121 §8.5.2.2).
    pub delayed: AtomicU64,
    /// Soak messages returned as `type='error'` (bounced, RFC 6120 §8.3).
    pub bounced: AtomicU64,
}

/// The phase number of soak probes: counted per sequence number in `Shared::probe_hits`.
pub const PROBE_PHASE: usize = 1;

/// Marks the body of a soak message: `<MESSAGE_TAG> <seq> <sent ns>`.
pub const MESSAGE_TAG: &str = "m1";

/// The XEP-0352 namespace (client state indication).
pub const NS_CSI: &str = "urn:xmpp:csi:0";
/// presenced's interest-list namespace (README, "Interest lists").
pub const NS_INTEREST: &str = "urn:presenced:interest:0";
/// The `<show/>` values a CSI run cycles through (RFC 6121 §4.7.2.1), so that the
/// nothing-lost check compares the show as well as the status.
const CSI_SHOWS: [&str; 4] = ["away", "xa", "dnd", "chat"];

/// What a session of a CSI run knows: for the nothing-lost check after `<active/>`.
#[derive(Debug, Clone, Default)]
pub struct CsiState {
    /// Available and unavailable presences received from others since login.
    pub presences_in: u64,
    /// The last (show, status) this session sent, if it sent a change.
    pub last_sent: Option<(String, String)>,
    /// The last (show, status) received per sender full JID; an unavailable presence is
    /// ("unavailable", "").
    pub last_from: HashMap<String, (String, String)>,
}

/// Commands from the driver to a running session.
#[derive(Debug)]
pub enum Command {
    /// Send one timed presence change in `phase` with sequence number `seq`.
    Presence { phase: u8, seq: u64 },
    /// Send a subscription request to each bare JID (provisioning).
    Subscribe(Vec<String>),
    /// Fetch the roster again and report the JIDs with subscription "both" (provisioning).
    Roster(tokio::sync::oneshot::Sender<Vec<String>>),
    /// Send one soak chat message to this bare JID with sequence number `seq`.
    Message { to: String, seq: u64 },
    /// Leave: `drop` ends the TCP connection without closing the stream (a lost connection);
    /// otherwise close the stream and read what the server still sends until it closes
    /// its side (RFC 6120 §4.4), at most 5 s, so nothing it delivered is left unread.
    Leave { drop: bool },
    /// Send XEP-0352 `<active/>` (true) or `<inactive/>` (false).
    ClientState(bool),
    /// Set an interest list naming these bare JIDs (presenced's `urn:presenced:interest:0`);
    /// the answer is counted in `Shared::interest_results` / `interest_errors`.
    Interest(Vec<String>),
    /// Report the CSI counters and the latest presence per sender (Mode::Csi).
    CsiReport(tokio::sync::oneshot::Sender<CsiState>),
    /// Close the stream and end.
    Close,
}

/// How a running session treats what it receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Timed run: measure presences.
    Measure,
    /// Provisioning: approve every subscription request.
    Provision,
    /// Soak and fault runs: measure, and count probes per sequence number.
    Soak,
    /// Client state indication runs: measure, cycle `<show/>`, count every presence
    /// received and keep the latest per sender (see [`CsiState`]).
    Csi,
    /// Reconnect storms: measure, and note each contact's returning presence on the
    /// [`StormBoard`].
    Storm,
}

/// Runs a logged-in session until `Close` or an error.
pub async fn run(
    logged: LoggedIn,
    own_bare: String,
    contacts: usize,
    mode: Mode,
    shared: Arc<Shared>,
    mut rx: mpsc::Receiver<Command>,
) {
    let mut conn = logged.conn;
    let mut seen: Option<HashSet<String>> = Some(HashSet::new());
    // The latest timed change's sequence number from each contact (duplicates counted).
    let mut last_seq: HashMap<String, u64> = HashMap::new();
    let mut pending_roster: Option<tokio::sync::oneshot::Sender<Vec<String>>> = None;
    let mut csi = CsiState::default();
    // A resumed XEP-0198 session is the same session: what reached it stays.
    if mode == Mode::Storm && !logged.sm_resumed {
        shared.storm.connected(&own_bare);
    }
    let result: Result<(), String> = async {
        loop {
            while let Some(frame) = conn.next_frame()? {
                let el = match frame {
                    Frame::Element(e) => e,
                    Frame::StreamClose => return Err("server closed the stream".into()),
                    Frame::StreamOpen(_) => return Err("unexpected stream header".into()),
                };
                if let Some(a) = conn.ack_for(&el) {
                    conn.send(&a).await?;
                    continue;
                }
                let now = now_ns();
                shared.stanzas_in.fetch_add(1, Ordering::Relaxed);
                match el.name.as_str() {
                    "presence" => {
                        shared.last_presence_ns.store(now, Ordering::Relaxed);
                        if mode == Mode::Csi {
                            note_csi_presence(&el, &own_bare, &mut csi);
                        }
                        if mode == Mode::Storm {
                            shared.storm.note(&own_bare, &el, now);
                        }
                        if let Some(reply) = on_presence(&el, &own_bare, contacts, mode, now, &shared, &mut seen, &mut last_seq) {
                            conn.send(&reply).await?;
                        }
                    }
                    "iq" => {
                        if el.attr("id") == Some("roster2") {
                            if let Some(tx) = pending_roster.take() {
                                let mut both = Vec::new();
                                if let Some(q) = el.child("query") {
                                    for item in q.children.iter().filter(|c| c.name == "item") {
                                        if item.attr("subscription") == Some("both") {
                                            both.extend(item.attr("jid").map(str::to_string));
                                        }
                                    }
                                }
                                let _ = tx.send(both);
                            }
                        } else if el.attr("id") == Some("interest1") {
                            let counter = if el.attr("type") == Some("result") {
                                &shared.interest_results
                            } else {
                                shared.note_error(format!(
                                    "interest list of {own_bare}: {}",
                                    el.child("error").map(describe).unwrap_or_default()
                                ));
                                &shared.interest_errors
                            };
                            counter.fetch_add(1, Ordering::Relaxed);
                        } else if let Some(reply) = on_iq(&el) {
                            conn.send(&reply).await?;
                        }
                    }
                    "message" => on_message(&el, &shared),
                    "error" => return Err(format!("stream error: {}", describe(&el))),
                    _ => {}
                }
            }
            tokio::select! {
                n = conn.io.read(&mut conn.rbuf) => {
                    let n = n.map_err(|e| format!("read: {e}"))?;
                    if n == 0 {
                        return Err("connection closed by server".into());
                    }
                    let (framer, rbuf) = (&mut conn.framer, &conn.rbuf);
                    framer.feed(&rbuf[..n]);
                }
                cmd = rx.recv() => match cmd {
                    Some(Command::Presence { phase, seq }) => {
                        let t = now_ns();
                        let show = if mode == Mode::Csi {
                            CSI_SHOWS[(seq % CSI_SHOWS.len() as u64) as usize]
                        } else {
                            "away"
                        };
                        let status = format!("{STATUS_TAG} {phase} {seq} {t}");
                        conn.send(&format!(
                            "<presence><show>{show}</show><status>{status}</status></presence>"
                        )).await?;
                        if mode == Mode::Csi {
                            csi.last_sent = Some((show.to_string(), status));
                        }
                        if let Some(p) = shared.phases.get(phase as usize) {
                            p.sent.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Some(Command::Subscribe(jids)) => {
                        let mut out = String::new();
                        for j in jids {
                            out.push_str(&format!("<presence to='{}' type='subscribe'/>", escape(&j)));
                        }
                        conn.send(&out).await?;
                    }
                    Some(Command::Roster(tx)) => {
                        pending_roster = Some(tx);
                        conn.send("<iq type='get' id='roster2'><query xmlns='jabber:iq:roster'/></iq>").await?;
                    }
                    Some(Command::Message { to, seq }) => {
                        let t = now_ns();
                        conn.send(&format!(
                            "<message to='{}' type='chat' id='m{seq}'><body>{MESSAGE_TAG} {seq} {t}</body></message>",
                            escape(&to)
                        )).await?;
                        shared.messages.sent.fetch_add(1, Ordering::Relaxed);
                    }
                    Some(Command::ClientState(active)) => {
                        let name = if active { "active" } else { "inactive" };
                        conn.send(&format!("<{name} xmlns='{NS_CSI}'/>")).await?;
                    }
                    Some(Command::Interest(jids)) => {
                        let mut items = String::new();
                        for j in jids {
                            items.push_str(&format!("<item jid='{}'/>", escape(&j)));
                        }
                        conn.send(&format!(
                            "<iq type='set' id='interest1'><interest xmlns='{NS_INTEREST}'>{items}</interest></iq>"
                        )).await?;
                    }
                    Some(Command::CsiReport(tx)) => {
                        let _ = tx.send(csi.clone());
                    }
                    Some(Command::Leave { drop: true }) => return Ok(()),
                    Some(Command::Leave { drop: false }) => {
                        conn.send("</stream:stream>").await?;
                        let until = tokio::time::Instant::now() + Duration::from_secs(5);
                        loop {
                            while let Some(frame) = conn.framer.next_frame()? {
                                match frame {
                                    Frame::Element(e) if e.name == "message" => on_message(&e, &shared),
                                    Frame::Element(_) => {}
                                    Frame::StreamClose | Frame::StreamOpen(_) => return Ok(()),
                                }
                            }
                            match tokio::time::timeout_at(until, conn.io.read(&mut conn.rbuf)).await {
                                Ok(Ok(n)) if n > 0 => {
                                    let (framer, rbuf) = (&mut conn.framer, &conn.rbuf);
                                    framer.feed(&rbuf[..n]);
                                }
                                _ => return Ok(()),
                            }
                        }
                    }
                    Some(Command::Close) | None => {
                        let _ = conn.send("</stream:stream>").await;
                        let _ = tokio::time::timeout(Duration::from_secs(2), conn.io.shutdown()).await;
                        return Ok(());
                    }
                }
            }
        }
    }
    .await;
    if let Err(e) = result {
        shared.sessions_lost.fetch_add(1, Ordering::Relaxed);
        shared.note_error(format!("session {own_bare}: {e}"));
    }
}

fn bare_of(jid: &str) -> &str {
    jid.split('/').next().unwrap_or(jid)
}

/// Counts an available or unavailable presence from someone else and keeps it as the
/// latest from its sender's full JID (a CSI run's nothing-lost check reads these).
fn note_csi_presence(el: &Element, own_bare: &str, csi: &mut CsiState) {
    let from = el.attr("from").unwrap_or("");
    if bare_of(from) == own_bare {
        return;
    }
    let latest = match el.attr("type") {
        None => (
            el.child("show")
                .map(|s| s.text.trim().to_string())
                .unwrap_or_default(),
            el.child("status")
                .map(|s| s.text.clone())
                .unwrap_or_default(),
        ),
        Some("unavailable") => ("unavailable".to_string(), String::new()),
        Some(_) => return,
    };
    csi.presences_in += 1;
    csi.last_from.insert(from.to_string(), latest);
}

/// Counts one received message if it is a soak message (or its bounce).
fn on_message(el: &Element, shared: &Shared) {
    let m = &shared.messages;
    // A bounce need not carry the original body (RFC 6120 §8.3.1): its id names it.
    if el.attr("type") == Some("error") {
        if el.attr("id").is_some_and(|i| i.starts_with('m')) {
            m.bounced.fetch_add(1, Ordering::Relaxed);
        }
        return;
    }
    let body = el.child("body").map(|b| b.text.as_str()).unwrap_or("");
    if body.starts_with(MESSAGE_TAG) {
        m.received.fetch_add(1, Ordering::Relaxed);
        if el.child("delay").is_some() {
            m.delayed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Handles one received presence; returns a stanza to send back, if any.
#[allow(clippy::too_many_arguments)]
fn on_presence(
    el: &Element,
    own_bare: &str,
    contacts: usize,
    mode: Mode,
    now: u64,
    shared: &Shared,
    seen: &mut Option<HashSet<String>>,
    last_seq: &mut HashMap<String, u64>,
) -> Option<String> {
    let from = el.attr("from").unwrap_or("");
    let from_bare = bare_of(from);
    match el.attr("type") {
        None => {}
        Some("subscribe") if mode == Mode::Provision => {
            // RFC 6121 §3.1.5: approving the request is a `subscribed` to the requester.
            shared
                .subscriptions_approved
                .fetch_add(1, Ordering::Relaxed);
            return Some(format!(
                "<presence to='{}' type='subscribed'/>",
                escape(from_bare)
            ));
        }
        // A probe's answer for a contact with no available resource is an unavailable from
        // its bare JID (RFC 6121 §4.3.2), sent at login: not the end of a session, and not
        // a first announcement that would make the contact's real one count as a repeat.
        Some("unavailable") if from_bare == from => return None,
        Some("unavailable") if from_bare != own_bare => {
            let first = shared.unavailable_pairs.lock().is_ok_and(|mut p| {
                let new = p.0.insert((from.to_string(), own_bare.to_string()));
                if !new {
                    p.1 += 1;
                }
                new
            });
            if first {
                if let Ok(mut u) = shared.unavailable.lock() {
                    let e = u.entry(from_bare.to_string()).or_default();
                    e.0 += 1;
                    e.1 = e.1.max(now);
                }
            }
            return None;
        }
        Some(_) => return None,
    }
    if from_bare == own_bare {
        return None; // the server's echo of our own broadcast (RFC 6121 §4.4.2)
    }
    let status = el.child("status").map(|s| s.text.as_str()).unwrap_or("");
    let mut parts = status.split(' ');
    if parts.next() == Some(STATUS_TAG) {
        let phase = parts.next().and_then(|p| p.parse::<usize>().ok());
        let seq = parts.next().and_then(|q| q.parse::<u64>().ok());
        let sent = parts.next().and_then(|t| t.parse::<u64>().ok());
        if let (Some(PROBE_PHASE), Some(seq), Mode::Soak) = (phase, seq, mode) {
            if let Ok(mut hits) = shared.probe_hits.lock() {
                *hits.entry(seq).or_default() += 1;
            }
        }
        if let (Some(phase), Some(sent)) = (phase, sent) {
            if let Some(p) = shared.phases.get(phase) {
                p.delivered.fetch_add(1, Ordering::Relaxed);
                p.latency.record(now.saturating_sub(sent) / 1000);
                if let Some(seq) = seq {
                    match last_seq.get_mut(from_bare) {
                        Some(last) if seq <= *last => {
                            p.repeated.fetch_add(1, Ordering::Relaxed);
                        }
                        Some(last) => *last = seq,
                        None => {
                            last_seq.insert(from_bare.to_owned(), seq);
                        }
                    }
                }
            }
        }
        return None;
    }
    shared.initial_presences.fetch_add(1, Ordering::Relaxed);
    if let Some(set) = seen {
        set.insert(from_bare.to_string());
        if set.len() >= contacts {
            shared
                .sessions_all_contacts_seen
                .fetch_add(1, Ordering::Relaxed);
            *seen = None;
        }
    }
    None
}

/// Answers IQs a client must answer: roster pushes (RFC 6121 §2.1.6), pings (XEP-0199),
/// and anything else with service-unavailable (RFC 6120 §8.4).
fn on_iq(el: &Element) -> Option<String> {
    let id = escape(el.attr("id").unwrap_or(""));
    let to = el
        .attr("from")
        .map(|f| format!(" to='{}'", escape(f)))
        .unwrap_or_default();
    match el.attr("type") {
        Some("get") | Some("set") => {
            let known = el
                .child("query")
                .is_some_and(|q| q.attr("xmlns") == Some("jabber:iq:roster"))
                || el.child("ping").is_some();
            if known {
                Some(format!("<iq type='result' id='{id}'{to}/>"))
            } else {
                Some(format!(
                    "<iq type='error' id='{id}'{to}><error type='cancel'>\
                     <service-unavailable xmlns='urn:ietf:params:xml:ns:xmpp-stanzas'/></error></iq>"
                ))
            }
        }
        _ => None,
    }
}

/// Source address number `i` of `count`, cycling through 127.0.0.2 ..= 127.0.0.(count+1)
/// (then on into 127.0.1.x): each source address has its own ephemeral port range.
/// 127.0.0.1 is left out on purpose: the servers listen there, and should a port variable
/// put a server's port inside Linux's ephemeral range, a client socket bound to 127.0.0.1
/// could take that port and keep it in TIME_WAIT, so the next server start could not listen.
pub fn source_addr(i: u32, count: u32) -> IpAddr {
    let n = 2 + i % count.max(1);
    IpAddr::from([127, (n >> 16) as u8, (n >> 8) as u8, n as u8])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn stanzas_count_as_handled_and_every_request_is_answered_with_the_count() {
        let (ours, mut server) = tokio::io::duplex(4096);
        let mut conn = Conn::new(ours);
        conn.framer.feed(b"<stream:stream version='1.0'>");
        assert!(matches!(conn.next_frame(), Ok(Some(Frame::StreamOpen(_)))));
        // Before <enabled/> nothing is counted.
        conn.framer.feed(b"<presence/>");
        conn.next_frame().expect("frame");
        let handled = Arc::new(AtomicU32::new(0));
        conn.sm = Some(handled.clone());
        conn.framer.feed(
            b"<presence/><iq type='get' id='p'/><r xmlns='urn:xmpp:sm:3'/>\
              <message><body>x</body></message><a xmlns='urn:xmpp:sm:3' h='0'/>",
        );
        // The request is answered as it is read, with the stanzas before it; nonzas (the
        // request, the server's own ack) are not counted.
        match conn.frame().await.expect("frame") {
            Frame::Element(e) => assert_eq!(e.name, "presence"),
            other => panic!("{other:?}"),
        }
        conn.frame().await.expect("iq");
        match conn.frame().await.expect("frame") {
            Frame::Element(e) => assert_eq!(e.name, "message"),
            other => panic!("{other:?}"),
        }
        conn.frame().await.expect("a");
        assert_eq!(handled.load(Ordering::Relaxed), 3);
        let mut sent = vec![0u8; 64];
        let n = server.read(&mut sent).await.expect("ack");
        assert_eq!(&sent[..n], b"<a xmlns='urn:xmpp:sm:3' h='2'/>");
    }

    #[test]
    fn source_addresses_stay_in_loopback_and_cycle() {
        assert_eq!(source_addr(0, 50), IpAddr::from([127, 0, 0, 2]));
        assert_eq!(source_addr(49, 50), IpAddr::from([127, 0, 0, 51]));
        assert_eq!(source_addr(50, 50), IpAddr::from([127, 0, 0, 2]));
        assert_eq!(source_addr(300, 1000), IpAddr::from([127, 0, 1, 46]));
        assert!((0..5000).all(|i| source_addr(i, 4000).is_loopback()));
        assert!((0..5000).all(|i| source_addr(i, 4000) != IpAddr::from([127, 0, 0, 1])));
    }

    #[test]
    fn a_change_received_again_or_out_of_order_is_counted_as_repeated() {
        let shared = Shared::default();
        let mut last = HashMap::new();
        let mut got = |from: &str, seq: u64| {
            let el = Element::parse(&format!(
                "<presence from='{from}/r'><status>{STATUS_TAG} 1 {seq} 5</status></presence>"
            ))
            .expect("valid");
            on_presence(
                &el,
                "u1@d",
                2,
                Mode::Measure,
                9,
                &shared,
                &mut None,
                &mut last,
            );
        };
        got("u2@d", 3);
        got("u3@d", 1); // another contact's own numbers
        got("u2@d", 3); // the same change again
        got("u2@d", 2); // an older one after a newer
        got("u2@d", 8);
        assert_eq!(shared.phases[1].delivered.load(Ordering::Relaxed), 5);
        assert_eq!(shared.phases[1].repeated.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn timed_presence_from_a_contact_is_recorded_with_its_latency() {
        let shared = Shared::default();
        let sent = 1_000_000_000u64;
        let el = Element::parse(&format!(
            "<presence from='u2@d/b'><status>{STATUS_TAG} 1 7 {sent}</status></presence>"
        ))
        .expect("valid");
        let mut seen = Some(HashSet::new());
        let r = on_presence(
            &el,
            "u1@d",
            2,
            Mode::Measure,
            sent + 2_500_000,
            &shared,
            &mut seen,
            &mut HashMap::new(),
        );
        assert!(r.is_none());
        assert_eq!(shared.phases[1].delivered.load(Ordering::Relaxed), 1);
        assert_eq!(shared.phases[1].latency.max(), 2500);
        assert_eq!(shared.phases[0].delivered.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn own_echo_is_ignored_and_contacts_are_counted_once_each() {
        let shared = Shared::default();
        let mut seen = Some(HashSet::new());
        for from in ["u1@d/b", "u2@d/b", "u2@d/c", "u3@d/b"] {
            let el = Element::parse(&format!("<presence from='{from}'/>")).expect("valid");
            on_presence(
                &el,
                "u1@d",
                2,
                Mode::Measure,
                0,
                &shared,
                &mut seen,
                &mut HashMap::new(),
            );
        }
        assert_eq!(shared.initial_presences.load(Ordering::Relaxed), 3);
        assert_eq!(shared.sessions_all_contacts_seen.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn csi_state_keeps_the_latest_presence_per_full_jid_and_counts_only_others() {
        let mut csi = CsiState::default();
        for xml in [
            "<presence from='u2@d/b'><show>away</show><status>b1 0 1 5</status></presence>",
            "<presence from='u2@d/b'><show>dnd</show><status>b1 0 7 9</status></presence>",
            "<presence from='u3@d/b' type='unavailable'/>",
            "<presence from='u1@d/b'><show>xa</show></presence>",
            "<presence from='u4@d' type='subscribe'/>",
        ] {
            note_csi_presence(&Element::parse(xml).expect("valid"), "u1@d", &mut csi);
        }
        assert_eq!(csi.presences_in, 3);
        assert_eq!(
            csi.last_from.get("u2@d/b"),
            Some(&("dnd".to_string(), "b1 0 7 9".to_string()))
        );
        assert_eq!(
            csi.last_from.get("u3@d/b"),
            Some(&("unavailable".to_string(), String::new()))
        );
        assert_eq!(csi.last_from.len(), 2);
    }

    #[test]
    fn a_probe_answer_before_a_session_end_is_neither_an_announcement_nor_a_repeat() {
        let shared = Shared::default();
        let mut seen = None;
        let mut got = |xml: &str, now: u64| {
            let el = Element::parse(xml).expect("valid");
            on_presence(
                &el,
                "u1@d",
                2,
                Mode::Measure,
                now,
                &shared,
                &mut seen,
                &mut HashMap::new(),
            );
        };
        // At login u3 was offline: its server answered the probe from its bare JID.
        got("<presence from='u3@d' type='unavailable'/>", 1);
        // Later its session ends (its node died): one announcement, then a repeat.
        got("<presence from='u3@d/b' type='unavailable'/>", 5);
        got("<presence from='u3@d/b' type='unavailable'/>", 7);
        assert_eq!(
            shared.unavailable.lock().unwrap().get("u3@d"),
            Some(&(1, 5))
        );
        assert_eq!(shared.unavailable_pairs.lock().unwrap().1, 1);
    }

    #[test]
    fn the_storm_board_counts_only_this_storms_presence_on_the_current_connection() {
        let board = StormBoard::default();
        let got = |xml: &str, now: u64| {
            board.note("u1@d", &Element::parse(xml).expect("valid"), now);
        };
        // Before any storm nothing counts; then storm 2: a presence of storm 1 (or none)
        // is from a session older than this storm.
        got(
            "<presence from='u2@d/b'><status>s1 2</status></presence>",
            1,
        );
        board.epoch.store(2, Ordering::Relaxed);
        got("<presence from='u2@d/b'/>", 2);
        got(
            "<presence from='u2@d/b'><status>s1 1</status></presence>",
            3,
        );
        assert_eq!(board.arrival("u1@d", "u2@d"), None);
        got(
            "<presence from='u2@d/b'><status>s1 2</status></presence>",
            4,
        );
        got(
            "<presence from='u2@d/b'><status>s1 2</status></presence>",
            5,
        );
        assert_eq!(board.arrival("u1@d", "u2@d"), Some(4));
        // A probe's answer from the bare JID leaves it; the session's end takes it back.
        got("<presence from='u2@d' type='unavailable'/>", 6);
        assert_eq!(board.arrival("u1@d", "u2@d"), Some(4));
        assert!(board.gone.lock().unwrap().is_empty());
        got("<presence from='u2@d/b' type='unavailable'/>", 7);
        assert_eq!(board.arrival("u1@d", "u2@d"), None);
        // An end told to a watcher: a XEP-0198 resumption alone no longer restores u2.
        assert!(board.gone.lock().unwrap().contains("u2@d"));
        got(
            "<presence from='u2@d/b'><status>s1 2</status></presence>",
            8,
        );
        // Its own echo is no contact's; a new connection of the watcher starts empty.
        got(
            "<presence from='u1@d/b'><status>s1 2</status></presence>",
            9,
        );
        assert_eq!(board.arrival("u1@d", "u1@d"), None);
        assert_eq!(board.arrival("u1@d", "u2@d"), Some(8));
        board.connected("u1@d");
        assert_eq!(board.arrival("u1@d", "u2@d"), None);
        // The next storm forgets what reached anyone in this one.
        got(
            "<presence from='u2@d/b'><status>s1 2</status></presence>",
            10,
        );
        board.begin(3);
        assert_eq!(board.arrival("u1@d", "u2@d"), None);
        assert!(board.gone.lock().unwrap().is_empty());
        got(
            "<presence from='u2@d/b'><status>s1 2</status></presence>",
            11,
        );
        assert_eq!(board.arrival("u1@d", "u2@d"), None);
    }

    #[test]
    fn subscription_requests_are_approved_only_while_provisioning() {
        let shared = Shared::default();
        let el = Element::parse("<presence from='u2@d' type='subscribe'/>").expect("valid");
        let mut seen = None;
        assert!(on_presence(
            &el,
            "u1@d",
            1,
            Mode::Measure,
            0,
            &shared,
            &mut seen,
            &mut HashMap::new()
        )
        .is_none());
        assert_eq!(
            on_presence(
                &el,
                "u1@d",
                1,
                Mode::Provision,
                0,
                &shared,
                &mut seen,
                &mut HashMap::new()
            )
            .as_deref(),
            Some("<presence to='u2@d' type='subscribed'/>")
        );
    }
}
