//! The client session: one task per connection that negotiates the stream (RFC 6120 §4–§7),
//! then reads stanzas and hands them to the router, while a writer task drains the session's
//! mailbox onto the socket.
//!
//! Negotiation is a typestate: a stream is [`Connected`], then [`Secured`] (TLS, RFC 6120
//! §5), then [`Authenticated`] (SASL, §6, and the restart that follows it; XEP-0388 SASL2
//! has no restart), then [`Bound`] (a resource, §7, or XEP-0386 Bind 2 inline in SASL2). Each step is a function that consumes one state and returns the next,
//! or the [`Halt`] that ends the stream: only `Secured` can authenticate, only
//! `Authenticated` can bind or resume (XEP-0198), only `Bound` reads stanzas, so no other
//! order can be written. XEP-0368 direct TLS and RFC 7395 WebSocket streams (whose TLS is
//! the HTTP layer's) start `Secured`. Anything out of order gets the stream error RFC 6120
//! names for it, written after our own stream header when none was sent yet (§4.9.1.1), and
//! is logged with the peer address.
//!
//! The parts: `negotiate` (stream headers, features, STARTTLS, how a negotiation ends),
//! `sasl`, `sasl2` (XEP-0388 and XEP-0386 framing), `fast` (XEP-0484 tokens: logging in
//! with one, issuing and rotating them), `register` (XEP-0077), `bind`, `resume`
//! (XEP-0198 detach and resume), `session` (the stanza loop), `writer` (the mailbox onto
//! the socket).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::time::Instant;

use crate::liveness::Transport;
use crate::node::Shared;
use crate::protocol::error::{StreamCondition, StreamError};
use crate::protocol::jid::{BareJid, FullJid};
use crate::protocol::xml::reader::ReaderLimits;
use crate::protocol::xml::{self as x, Element};
use crate::services::Services;
use crate::transport::stream::{Fail, XmlStream};

pub use crate::node::io::{BoxIo, Io};
pub use crate::protocol::error::iq_result;
/// A random identifier for stream ids and generated resources.
pub use crate::protocol::xml::new_id;

/// Runs one step of a negotiation on `$link` within its deadline. A failure returns, from
/// the transition running the step, the [`Halt`] that ends the stream on `$link`.
macro_rules! step {
    ($link:expr, $work:expr) => {{
        let done = $crate::transport::c2s::within($link.deadline, $work).await;
        match done {
            Ok(v) => v,
            Err(fail) => return Err($crate::transport::c2s::Halt::Open(Box::new($link), fail)),
        }
    }};
}

mod backoff;
mod bind;
mod binding;
mod fast;
mod negotiate;
mod register;
mod resume;
mod sasl;
mod sasl2;
mod session;
mod writer;

/// What every state of a negotiating stream carries.
struct Link {
    shared: Arc<Shared>,
    /// The node's services, lent to the router once a resource is bound.
    services: Arc<Services>,
    stream: XmlStream,
    /// Remote address, for every log line about this connection.
    peer: SocketAddr,
    /// Whether our stream header for the current stream was sent.
    header_sent: bool,
    /// The domain the client asked for in its first header.
    domain: Option<String>,
    /// What the connection runs over (handed to a session this stream resumes).
    transport: Transport,
    /// When negotiation must be over.
    deadline: Instant,
    /// XEP-0388 `<user-agent id/>` of a SASL2 authentication, kept in the session's state.
    user_agent: Option<Box<str>>,
    /// RFC 9266 `tls-exporter` of the TLS 1.3 connection this process terminated, taken when
    /// the handshake completed; `None` offers no `-PLUS` (see `binding`).
    channel_binding: Option<binding::TlsExporter>,
}

/// A stream whose transport is not encrypted: it can only start TLS (RFC 6120 §5.3.1).
struct Connected {
    link: Link,
}

/// A stream over TLS (STARTTLS, direct TLS, or the HTTPS a WebSocket runs over): it can
/// authenticate (RFC 6120 §6), or register an account (XEP-0077).
struct Secured {
    link: Link,
}

/// An authenticated account's restarted stream (or, after XEP-0388 SASL2, the same stream):
/// it can bind a resource (RFC 6120 §7) or resume a session (XEP-0198 §5).
struct Authenticated {
    link: Link,
    /// The account's localpart.
    user: String,
    /// A SASL2 authentication whose `<success/>` is still to be written, with what it asked
    /// for inline.
    sasl2: Option<Box<Sasl2>>,
}

/// A XEP-0388 authentication that succeeded: the request, and the mechanism's additional
/// data for its `<success/>`.
struct Sasl2 {
    request: sasl2::Request,
    additional: Option<Vec<u8>>,
    /// A XEP-0484 `<token/>` for the `<success/>` (XML), or empty.
    token: String,
}

/// A bound resource: the stream the session loop reads stanzas from.
struct Bound {
    link: Link,
    jid: FullJid,
    /// A XEP-0386 bind: the SASL2 `<success/>` the session writes first, with the features
    /// enabled inline.
    inline: Option<Box<Inline>>,
}

/// What a XEP-0386 bind enables with the resource, applied by the session as its stanza
/// forms would be, and the parts of the SASL2 `<success/>` around them.
struct Inline {
    additional: Option<Vec<u8>>,
    /// XML for `<success/>` before `<bound/>` (an inline resumption's `<failed/>`).
    before: String,
    bind: sasl2::Bind,
}

/// How a negotiation ended before a resource was bound.
enum Halt {
    /// The stream can still be written: end it as the `Fail` says.
    Open(Box<Link>, Fail),
    /// Nothing more can be written: a failed TLS handshake, or a session took the stream.
    Gone,
}

/// `work`, unless the negotiation's deadline passes first (RFC 6120 §4.9.3.4).
async fn within<T>(
    deadline: Instant,
    work: impl Future<Output = Result<T, Fail>>,
) -> Result<T, Fail> {
    tokio::time::timeout_at(deadline, work)
        .await
        .unwrap_or_else(|_| {
            Err(Fail::Stream(StreamError::new(
                StreamCondition::ConnectionTimeout,
                "Stream negotiation took too long",
            )))
        })
}

/// The reader's limits for the stream's state: before SASL success the stanza cost limit is
/// the small one (the stream restarts after authentication, RFC 6120 §6.4.6, and so gets a
/// new reader with the larger limit; after XEP-0388 SASL2 the same reader takes it).
fn limits(shared: &Shared, authenticated: bool) -> ReaderLimits {
    ReaderLimits::for_peer(&shared.live.get().limits, authenticated)
}

/// Serves one client TCP connection from accept to close.
pub async fn serve(
    shared: Arc<Shared>,
    services: Arc<Services>,
    io: BoxIo,
    peer: SocketAddr,
    direct_tls: bool,
) {
    let transport = Transport::tcp(&shared.liveness);
    serve_transport(shared, services, io, peer, direct_tls, transport).await
}

/// Serves one client connection over `transport` (TCP, or the byte stream an RFC 7395
/// WebSocket adapter presents) from accept to close.
pub async fn serve_transport(
    shared: Arc<Shared>,
    services: Arc<Services>,
    io: BoxIo,
    peer: SocketAddr,
    direct_tls: bool,
    transport: Transport,
) {
    // Negotiation (TLS handshake, SASL, its timers and error paths) is large and short-lived
    // state. Boxed, it is freed once the resource is bound; inline, it would size this
    // connection's task for the whole life of an idle session (BENCHMARKS.md, memory per session).
    let negotiated = Box::pin(negotiate(shared, services, io, peer, direct_tls, transport)).await;
    if let Some(bound) = negotiated {
        bound.run_session().await;
    }
}

/// Runs the connection up to a bound resource, within the negotiation time limit. `None` when
/// it ended before that (the stream error, if any, has been written).
async fn negotiate(
    shared: Arc<Shared>,
    services: Arc<Services>,
    io: BoxIo,
    peer: SocketAddr,
    direct_tls: bool,
    transport: Transport,
) -> Option<Bound> {
    let timeout = shared.live.get().limits.negotiation_timeout;
    let deadline = Instant::now() + timeout;
    let secure = direct_tls || transport.secure;
    let mut channel_binding = None;
    let io = if direct_tls {
        // XEP-0368: TLS starts before any XML.
        let acceptor = tokio_rustls::TlsAcceptor::from(shared.tls.clone());
        match tokio::time::timeout_at(deadline, acceptor.accept(io)).await {
            Ok(Ok(tls)) => {
                channel_binding = binding::TlsExporter::of(tls.get_ref().1);
                Box::new(tls) as BoxIo
            }
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
    let link = Link {
        stream: XmlStream::new(io, limits(&shared, false), x::NS_CLIENT),
        shared,
        services,
        peer,
        header_sent: false,
        domain: None,
        transport,
        deadline,
        user_agent: None,
        channel_binding,
    };
    let bound = async {
        let secured = if secure {
            Secured { link }
        } else {
            Connected { link }.starttls().await?
        };
        secured.authenticate().await?.bind().await
    };
    match bound.await {
        Ok(bound) => Some(bound),
        Err(Halt::Open(link, fail)) => {
            link.end(fail).await;
            None
        }
        Err(Halt::Gone) => None,
    }
}

impl Link {
    async fn write(&mut self, s: &str) -> Result<(), Fail> {
        Ok(self.stream.write(s).await?)
    }

    async fn write_el(&mut self, el: &Element) -> Result<(), Fail> {
        Ok(self.stream.write_element(el).await?)
    }

    /// The next top-level element of the current stream, skipping keepalives.
    async fn next_element(&mut self) -> Result<Element, Fail> {
        let el = self.stream.next_element().await?;
        tracing::trace!(peer = %self.peer, element = %el.name, "negotiation element");
        Ok(el)
    }

    /// The bare JID of `username` at the domain the stream was opened to.
    fn account(&self, username: &str) -> Option<BareJid> {
        let domain = self.domain.as_deref()?;
        crate::protocol::jid::bare(username, domain).ok()
    }
}
