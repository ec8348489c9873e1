//! The client session: one task per connection that negotiates the stream (RFC 6120 §4–§7),
//! then reads stanzas and hands them to the router, while a writer task drains the session's
//! mailbox onto the socket.
//!
//! Negotiation runs as a chain of phases, each a function that can only be reached from the
//! one before: [`Conn::open`] (header) → STARTTLS (§5) → SASL (§6) → bind (§7) → the stanza
//! loop. Anything out of order gets the stream error RFC 6120 names for it, written after our
//! own stream header when none was sent yet (§4.9.1.1), and is logged with the peer address.

mod bind;
mod negotiate;
mod register;
mod resume;
mod sasl;
mod session;
mod writer;

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::time::Instant;

use crate::error::StreamError;
use crate::jid::{BareJid, FullJid};
use crate::liveness::Transport;
use crate::node::Shared;
use crate::xml::reader::{ReaderLimits, StreamEvent, StreamReader, XmlError};
use crate::xml::Element;

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
            let err = StreamError::new("connection-timeout", "Stream negotiation took too long");
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

    async fn next(&mut self) -> Result<StreamEvent, Fail> {
        Ok(self.reader.next().await?)
    }

    fn account(&self, username: &str) -> Option<BareJid> {
        let domain = self.domain.as_deref()?;
        crate::jid::bare(username, domain).ok()
    }
}

pub use crate::node::session::Session;

pub use crate::error::iq_result;

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
