//! XMPP over WebSocket (RFC 7395), adapted to the byte stream c2s already speaks.
//!
//! Framing is tokio-tungstenite's; this module only translates. Inbound, each text message is
//! one element (RFC 7395 §3.3.3): `<open/>` becomes a stream header, `<close/>` becomes
//! `</stream:stream>`, anything else is passed on as the stanza it is; a message that is not
//! exactly one element closes the stream with the error the stream reader would give. Outbound, the bytes
//! c2s writes are parsed back into elements with the server's own stream reader, and each is
//! sent as one message: the stream header as `<open/>` (§3.3.2), `</stream:stream>` as
//! `<close/>` (§3.6), stream-level elements with their `stream:` prefix declared (§3.3.3).
//! So negotiation (SASL, bind), routing and presence are the same code for TCP and
//! WebSocket; STARTTLS is not offered because TLS is the WebSocket's (wss, §3.6 / §3.7).
//!
//! Liveness: the adapter sends a WebSocket Ping after H of inbound silence; Pong, Ping and
//! every message count as heartbeats ([`crate::liveness::Beat`]).
//!
//! Closing: after `<close/>` the adapter sends the WebSocket Close and keeps the connection
//! until the client's Close comes back (bounded), as RFC 6455 §7.1.1 has the server close
//! the TCP connection only once the closing handshake is done.
//!
//! What a client can make the adapter hold: its Pings and Pongs take tokens from a bucket of
//! the client stanza rate ([`crate::policy::rate_limit::ClientRate`]; beyond it policy-violation and
//! the close, as for a stanza flood). tungstenite answers each Ping itself; the Pongs a
//! client does not read wait in its write buffer, bounded here to one outbound message and
//! 64 KiB, past which only the newest Pong is kept (RFC 6455 §5.5.3). Every write, those
//! Pongs included (the writer flushes them when a Ping came), waits at most `[limits]
//! write_timeout`, as on TCP: a client that reads nothing is dropped and its place under
//! `max_connections` is free. Once c2s has written the end of its stream, the connection
//! lasts at most two seconds more, so the negotiation timeout ends a client that keeps
//! sending frames and reads nothing.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadHalf};
use tokio::sync::{mpsc, Notify};
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::http::{HeaderValue, StatusCode};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;

use crate::liveness::{Transport, TransportKind};
use crate::node::io::BoxIo;
use crate::node::Shared;
use crate::protocol::xml::reader::{
    parse_chunks, ReaderLimits, StreamEvent, StreamReader, XmlError,
};
use crate::protocol::xml::{self as x, escape, Element};

/// RFC 7395 §3.3.1 framing namespace.
pub(crate) const NS_FRAMING: &str = "urn:ietf:params:xml:ns:xmpp-framing";
/// The WebSocket subprotocol (RFC 7395 §3.1).
pub(crate) const SUBPROTOCOL: &str = "xmpp";

/// Whether the client offered the `xmpp` subprotocol.
fn offers_xmpp(req: &Request) -> bool {
    req.headers()
        .get_all("Sec-WebSocket-Protocol")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|p| p.trim().eq_ignore_ascii_case(SUBPROTOCOL))
}

/// The handshake callback: RFC 7395 §3.1 requires the `xmpp` subprotocol; without it no
/// XMPP session is established. (The error type is tungstenite's.)
#[allow(clippy::result_large_err)]
fn negotiate_subprotocol(req: &Request, mut resp: Response) -> Result<Response, ErrorResponse> {
    if !offers_xmpp(req) {
        let mut err = ErrorResponse::new(Some("the xmpp subprotocol is required".into()));
        *err.status_mut() = StatusCode::BAD_REQUEST;
        return Err(err);
    }
    resp.headers_mut().insert(
        "Sec-WebSocket-Protocol",
        HeaderValue::from_static(SUBPROTOCOL),
    );
    Ok(resp)
}

/// The largest message the adapter sends: what its parser of the c2s output accepts as one
/// element (a roster result may be large).
fn outbound_max(limits: &crate::config::LimitsConfig) -> usize {
    limits.max_stanza_size.saturating_mul(4)
}

/// Room in tungstenite's write buffer beyond one outbound message: the frame header, the
/// declarations [`outbound_element`] adds, and the Pongs a client that pings does not read.
const WRITE_ROOM: usize = 64 * 1024;

/// The WebSocket settings for a connection under `limits`.
///
/// tungstenite answers every Ping itself, and each read it does while the socket cannot
/// take more appends that Pong to its write buffer, which by default has no bound: a
/// client that pings and never reads made the server hold 127 bytes per Ping. The bound
/// here is one outbound message and [`WRITE_ROOM`]; past it tungstenite keeps only the
/// newest Pong, which RFC 6455 §5.5.3 allows ("a response to the most recent Ping"), and
/// a message that does not fit ends the connection as a failed write does.
fn ws_config(limits: &crate::config::LimitsConfig) -> WebSocketConfig {
    let max = limits.max_stanza_size;
    WebSocketConfig::default()
        .max_message_size(Some(max))
        .max_frame_size(Some(max))
        // Frames go to the socket as they are made: the c2s writer already batches.
        .write_buffer_size(0)
        .max_write_buffer_size(outbound_max(limits).saturating_add(WRITE_ROOM))
}

/// Completes the WebSocket handshake on `io` (whose HTTP request head may already have been
/// read and is replayed by the caller) and serves XMPP on it until it closes.
pub(crate) async fn serve<S>(
    shared: Arc<Shared>,
    services: Arc<crate::services::Services>,
    io: S,
    peer: SocketAddr,
    secure: bool,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let limits = shared.live.get().limits.clone();
    let Some(ws) = handshake(io, &limits, peer).await else {
        return;
    };
    let (sink, stream) = ws.split();
    // Taken away as soon as the connection is of no more use, so the socket closes then.
    let mut stream = Some(stream);
    let mut a = Adapter::start(&shared, services, sink, peer, secure, &limits);
    // Once the c2s side has written the end of its stream (the parser has seen it, or its
    // end of the pipe is gone), that end has this long to reach the client; then the
    // connection goes, whatever the client still sends. (Not the c2s task's end: a stream
    // that resumes a XEP-0198 session hands the pipe to that session's task and ends.)
    let mut parser_over = false;
    let mut wind_down: Option<tokio::time::Instant> = None;

    // Socket → c2s, and pings.
    let h = shared.liveness.timings.heartbeat;
    // Checked four times per H so that a Ping goes out within H/4 of H of silence.
    let mut ping = tokio::time::interval(h / 4);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ping.reset();
    let mut last_ping = tokio::time::Instant::now();
    // Control frames take tokens like stanzas; see `ClientRate`.
    let mut control_rate = crate::policy::rate_limit::ClientRate::new(&limits);
    // Whether the client's side of the WebSocket has ended (its Close, an error or EOF).
    let mut peer_done = false;
    // Whether the client did not take the end of its stream within the wind-down.
    let mut stalled = false;
    while let Some(reading) = stream.as_mut() {
        let msg = tokio::select! {
            _ = a.done.cancelled() => break,
            _ = &mut a.parser, if !parser_over => {
                parser_over = true;
                wind_down = Some(tokio::time::Instant::now() + CLOSE_HANDSHAKE_WAIT);
                continue;
            }
            _ = tokio::time::sleep_until(wind_down.unwrap_or_else(tokio::time::Instant::now)), if wind_down.is_some() => {
                tracing::info!(%peer, "WebSocket client did not take the end of its stream; dropping the connection");
                stalled = true;
                break;
            }
            _ = ping.tick() => {
                if a.beat.silent_for(h)
                    && last_ping.elapsed() >= h
                    && a.out_tx.try_send(Message::Ping(Vec::new().into())).is_ok()
                {
                    last_ping = tokio::time::Instant::now();
                    shared.liveness.metrics.pings_sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                continue;
            }
            m = reading.next() => m,
        };
        let text = match msg {
            Some(Ok(Message::Text(t))) => t.to_string(),
            Some(Ok(m @ (Message::Ping(_) | Message::Pong(_)))) => {
                if a.control_frame(&shared, &mut control_rate, &m, peer).await {
                    continue;
                }
                break;
            }
            Some(Ok(Message::Binary(_))) => {
                // RFC 7395 §3.2: XMPP messages are text; binary is not XMPP.
                tracing::info!(%peer, "binary WebSocket message; closing");
                break;
            }
            Some(Ok(Message::Frame(_))) => continue,
            Some(Ok(Message::Close(_))) | Some(Err(_)) | None => {
                peer_done = true;
                break;
            }
        };
        if !a.relay(&shared, &text, &limits, peer).await {
            break;
        }
    }
    // A client whose side ended, or that reads nothing (the writer could not write), has no
    // use for the socket any more: it goes now, not after the session (a XEP-0198 session
    // may wait minutes for its client to resume it elsewhere).
    if peer_done || stalled || a.write_failed.load(Ordering::Acquire) {
        stream = None;
    }
    if stalled {
        a.writer.abort();
    }
    // EOF to c2s: a WebSocket that closed without <close/> is a dropped connection.
    let _ = a.to_c2s.shutdown().await;
    drop(a.to_c2s);
    let _ = a.session.await;
    if !parser_over {
        wait_or_abort(&mut a.parser).await;
    }
    drop(a.out_tx);
    wait_or_abort(&mut a.writer).await;
    if let Some(stream) = stream {
        await_client_close(stream).await;
    }
}

/// The WebSocket handshake (RFC 6455 §4.2, with the `xmpp` subprotocol of RFC 7395 §3.1),
/// within the negotiation time limit; `None` when it failed or timed out.
async fn handshake<S>(
    io: S,
    limits: &crate::config::LimitsConfig,
    peer: SocketAddr,
) -> Option<tokio_tungstenite::WebSocketStream<S>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    match tokio::time::timeout(
        limits.negotiation_timeout,
        tokio_tungstenite::accept_hdr_async_with_config(
            io,
            negotiate_subprotocol,
            Some(ws_config(limits)),
        ),
    )
    .await
    {
        Ok(Ok(ws)) => Some(ws),
        Ok(Err(e)) => {
            tracing::info!(%peer, error = %e, "WebSocket handshake failed");
            None
        }
        Err(_) => {
            tracing::info!(%peer, "WebSocket handshake timed out");
            None
        }
    }
}

/// Waits for an adapter task for the close handshake's time at most, then stops it.
async fn wait_or_abort(task: &mut tokio::task::JoinHandle<()>) {
    if tokio::time::timeout(CLOSE_HANDSHAKE_WAIT, &mut *task)
        .await
        .is_err()
    {
        task.abort();
    }
}

/// The tasks and channels between a WebSocket and the XMPP session served over it: the
/// session writes to and reads from one end of a pipe, as over TCP; messages read from the
/// socket go into the other end (`to_c2s`), and what the session writes is parsed into
/// messages (`parser`) that `writer` sends.
struct Adapter {
    to_c2s: tokio::io::WriteHalf<tokio::io::DuplexStream>,
    /// The connection's liveness, kept by its traffic and its Pongs.
    beat: Arc<crate::liveness::Beat>,
    /// Ends the parser and the writer.
    done: CancellationToken,
    /// Messages for the writer.
    out_tx: mpsc::Sender<Message>,
    /// Whether the session has opened its stream (a stream error must open one first).
    opened: Arc<AtomicBool>,
    parser: tokio::task::JoinHandle<()>,
    /// A Pong tungstenite queued is for the writer to send.
    pong_due: Arc<Notify>,
    /// Whether the writer could not write (the client reads nothing).
    write_failed: Arc<AtomicBool>,
    writer: tokio::task::JoinHandle<()>,
    session: tokio::task::JoinHandle<()>,
}

impl Adapter {
    /// Spawns the parser of the session's output, the writer of messages to `sink`, and the
    /// XMPP session itself.
    fn start<W>(
        shared: &Arc<Shared>,
        services: Arc<crate::services::Services>,
        sink: W,
        peer: SocketAddr,
        secure: bool,
        limits: &crate::config::LimitsConfig,
    ) -> Self
    where
        W: futures_util::Sink<Message> + Unpin + Send + 'static,
    {
        let (c2s_side, adapter_side) = tokio::io::duplex(64 * 1024);
        let (from_c2s, to_c2s) = tokio::io::split(adapter_side);
        let beat = shared.liveness.beat();
        let transport = Transport {
            kind: TransportKind::WebSocket,
            beat: beat.clone(),
            secure,
        };
        let done = CancellationToken::new();
        let (out_tx, out_rx) = mpsc::channel::<Message>(64);

        // c2s output → messages. This parses what the server itself wrote (a roster result may
        // hold thousands of elements), so only size and depth are bounded.
        let reader_limits =
            ReaderLimits::trusted(outbound_max(limits), limits.max_depth.saturating_add(4));
        let opened = Arc::new(AtomicBool::new(false));
        let parser = tokio::spawn(outbound(
            from_c2s,
            reader_limits,
            out_tx.clone(),
            done.clone(),
            opened.clone(),
        ));
        // Messages → socket.
        let pong_due = Arc::new(Notify::new());
        let write_failed = Arc::new(AtomicBool::new(false));
        let writer = tokio::spawn(write_messages(
            sink,
            out_rx,
            pong_due.clone(),
            limits.write_timeout,
            write_failed.clone(),
            done.clone(),
            peer,
        ));
        // The XMPP session on the c2s side of the pipe.
        let session = tokio::spawn(crate::transport::c2s::serve_transport(
            shared.clone(),
            services,
            Box::new(c2s_side) as BoxIo,
            peer,
            false,
            transport,
        ));
        Adapter {
            to_c2s,
            beat,
            done,
            out_tx,
            opened,
            parser,
            pong_due,
            write_failed,
            writer,
            session,
        }
    }

    /// A Ping or Pong from the client: within the stanza rate, traffic (and for a Ping, a
    /// Pong due); beyond it, a stream error. Whether the connection goes on.
    async fn control_frame(
        &self,
        shared: &Shared,
        control_rate: &mut crate::policy::rate_limit::ClientRate,
        m: &Message,
        peer: SocketAddr,
    ) -> bool {
        if let Err(err) = control_rate.take(&shared.metrics, shared.liveness.clock.instant()) {
            tracing::info!(%peer, "WebSocket control frames beyond the stanza rate; closing");
            fail(shared, &self.out_tx, &self.opened, err).await;
            return false;
        }
        self.beat.touch();
        if matches!(m, Message::Ping(_)) {
            // tungstenite has queued the Pong (RFC 6455 §5.5.2); the writer sends it
            // within the write timeout, or the connection goes.
            self.pong_due.notify_one();
        }
        true
    }

    /// Passes the XMPP of a text message to the session. Whether the connection goes on.
    async fn relay(
        &mut self,
        shared: &Shared,
        text: &str,
        limits: &crate::config::LimitsConfig,
        peer: SocketAddr,
    ) -> bool {
        // The larger (authenticated) cost limit: c2s parses the result again with the limit
        // for the stream's state, so this only bounds what one message may cost here.
        let bytes = match inbound(text, ReaderLimits::for_peer(limits, true)) {
            Ok(bytes) => bytes,
            Err(e) => {
                tracing::info!(%peer, error = %e, "closing WebSocket stream with error");
                if let Some(err) = crate::protocol::error::StreamError::of_xml(&e) {
                    fail(shared, &self.out_tx, &self.opened, err).await;
                }
                return false;
            }
        };
        self.to_c2s.write_all(bytes.as_bytes()).await.is_ok()
    }
}

/// RFC 6455 §5.5.1 / §7.1.1: having sent our Close, wait for the client's before the TCP
/// connection goes. Dropping it at once resets the connection under a Close already on
/// its way, which browsers and Node report as an error rather than a clean close.
async fn await_client_close<S>(mut stream: S)
where
    S: futures_util::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    let _ = tokio::time::timeout(CLOSE_HANDSHAKE_WAIT, async {
        while let Some(m) = stream.next().await {
            if matches!(m, Ok(Message::Close(_)) | Err(_)) {
                break;
            }
        }
    })
    .await;
}

/// Sends the adapter's messages, and the Pongs tungstenite queued when `pong_due` is
/// notified. Each write waits at most `write_timeout` (`[limits]`, as a TCP client's
/// writer does): a client that reads nothing for that long is dropped, which frees its
/// place under `max_connections`. A write that failed or timed out sets `failed`.
async fn write_messages<S>(
    mut sink: S,
    mut rx: mpsc::Receiver<Message>,
    pong_due: Arc<Notify>,
    write_timeout: std::time::Duration,
    failed: Arc<AtomicBool>,
    done: CancellationToken,
    peer: SocketAddr,
) where
    S: futures_util::Sink<Message> + Unpin,
{
    let clean = loop {
        let next = tokio::select! {
            biased;
            m = rx.recv() => match m {
                Some(m) => Some(m),
                None => break true,
            },
            // A flush sends what tungstenite queued: the Pong (only the newest waits).
            _ = pong_due.notified() => None,
        };
        let closing = matches!(next, Some(Message::Close(_)));
        let wrote = tokio::time::timeout(write_timeout, async {
            match next {
                Some(m) => sink.send(m).await,
                None => sink.flush().await,
            }
        })
        .await;
        match wrote {
            Ok(Ok(())) if closing => break true,
            Ok(Ok(())) => {}
            Ok(Err(_)) => break false,
            Err(_) => {
                tracing::info!(%peer, timeout = ?write_timeout, "WebSocket client read nothing within the write timeout; dropping the connection");
                break false;
            }
        }
    };
    if clean {
        let _ = tokio::time::timeout(CLOSE_HANDSHAKE_WAIT, sink.close()).await;
    } else {
        failed.store(true, Ordering::Release);
    }
    done.cancel();
}

/// How long each step of a closing connection may take before it is cut short: the parser
/// and the writer finishing (the writer flushes our Close), then the client answering that
/// Close before the connection is dropped anyway.
const CLOSE_HANDSHAKE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Closes the stream with `err` from the adapter itself (a message it could not translate,
/// control frames beyond the rate): our `<open/>` first if c2s has not answered one yet
/// (RFC 6120 §4.9.1.1), the stream error, `<close/>` (RFC 7395 §3.6) and the WebSocket
/// close. The c2s side then sees its input end.
async fn fail(
    shared: &Shared,
    out: &mpsc::Sender<Message>,
    opened: &AtomicBool,
    err: crate::protocol::error::StreamError,
) {
    let mut msgs = Vec::new();
    if !opened.load(Ordering::Acquire) {
        msgs.push(format!(
            "<open xmlns='{NS_FRAMING}' from='{}' id='{}' version='1.0'/>",
            escape(&shared.config.domains[0]),
            crate::protocol::xml::new_id()
        ));
    }
    let el = x::parse_element(&err.to_xml()).unwrap_or_else(|| Element::new("error", x::NS_STREAM));
    msgs.push(outbound_element(&el));
    msgs.push(format!("<close xmlns='{NS_FRAMING}'/>"));
    for m in msgs {
        if out.send(Message::Text(m.into())).await.is_err() {
            return;
        }
    }
    let _ = out.send(Message::Close(None)).await;
}

/// Translates one inbound message into the bytes of a classic stream.
///
/// RFC 7395 §3.3.3: every message holds exactly one complete element. A message with two
/// (or none, or half of one) is not a well-formed document of its own (XML 1.0 §2.1: one
/// root element), so it is refused as `not-well-formed` rather than split or dropped;
/// other faults get the condition the stream reader gives them on TCP.
pub(crate) fn inbound(text: &str, limits: ReaderLimits) -> Result<String, XmlError> {
    let wrapped = format!(
        "<stream:stream xmlns='{}' xmlns:stream='{}'>{text}</stream:stream>",
        x::NS_CLIENT,
        x::NS_STREAM
    );
    let (events, err) = parse_chunks(&[wrapped.as_bytes()], limits, false);
    if let Some(e) = err {
        return Err(e);
    }
    let mut elements = events.into_iter().filter_map(|e| match e {
        StreamEvent::Stanza(el) => Some(el),
        _ => None,
    });
    let el = match (elements.next(), elements.next()) {
        (Some(el), None) => el,
        // Whitespace alone: a keepalive, as between stanzas on TCP.
        (None, _) if text.chars().all(|c| matches!(c, ' ' | '\t' | '\r' | '\n')) => {
            return Ok(text.to_owned())
        }
        (None, _) => return Err(XmlError::NotWellFormed("no element in the message".into())),
        (Some(_), Some(_)) => {
            return Err(XmlError::NotWellFormed(
                "more than one element in one WebSocket message (RFC 7395 §3.3.3)".into(),
            ))
        }
    };
    Ok(match el {
        el if el.is("open", NS_FRAMING) => {
            // RFC 7395 §3.3.2: <open/> takes the place of the stream header.
            let mut h = format!(
                "<?xml version='1.0'?><stream:stream xmlns='{}' xmlns:stream='{}'",
                x::NS_CLIENT,
                x::NS_STREAM
            );
            for a in ["to", "from", "version", "xml:lang", "id"] {
                if let Some(v) = el.get_attr(a) {
                    h.push_str(&format!(" {a}='{}'", escape(v)));
                }
            }
            h.push('>');
            h
        }
        // RFC 7395 §3.6: <close/> ends the stream.
        el if el.is("close", NS_FRAMING) => "</stream:stream>".to_owned(),
        el => el.to_xml(),
    })
}

/// Serialises one element the server wrote as a self-contained WebSocket message.
pub(crate) fn outbound_element(el: &Element) -> String {
    let mut out = String::new();
    if el.ns == x::NS_STREAM {
        // stream:features / stream:error keep their prefix, declared in the message.
        out.push_str("<stream:");
        out.push_str(&el.name);
        out.push_str(" xmlns:stream='");
        out.push_str(x::NS_STREAM);
        out.push_str("'>");
        for child in el.elements() {
            child.write_to(&mut out, "", x::NS_CLIENT);
        }
        out.push_str("</stream:");
        out.push_str(&el.name);
        out.push('>');
    } else {
        // RFC 7395 §3.3.3: every stanza carries its namespace.
        el.write_to(&mut out, "", x::NS_CLIENT);
    }
    out
}

/// Parses what c2s writes and queues one message per element.
async fn outbound(
    from_c2s: ReadHalf<tokio::io::DuplexStream>,
    limits: ReaderLimits,
    tx: mpsc::Sender<Message>,
    done: CancellationToken,
    opened: Arc<AtomicBool>,
) {
    let mut reader = StreamReader::new(from_c2s, limits);
    loop {
        let ev = tokio::select! {
            _ = done.cancelled() => return,
            ev = reader.next() => ev,
        };
        let text = match ev {
            Ok(StreamEvent::Open(h)) => {
                let mut o = format!("<open xmlns='{NS_FRAMING}'");
                for a in ["from", "to", "id", "version", "xml:lang"] {
                    if let Some(v) = h.get_attr(a) {
                        o.push_str(&format!(" {a}='{}'", escape(v)));
                    }
                }
                o.push_str("/>");
                opened.store(true, Ordering::Release);
                o
            }
            Ok(StreamEvent::Stanza(el)) => {
                let restart = el.is("success", x::NS_SASL);
                let text = outbound_element(&el);
                if tx.send(Message::Text(text.into())).await.is_err() {
                    return;
                }
                if restart {
                    // RFC 6120 §6.4.6: after SASL success the server sends a new stream
                    // header; a new parser reads it. c2s writes that header only after the
                    // client's new <open/>, so nothing is buffered past <success/>.
                    reader = StreamReader::new(reader.into_inner(), limits);
                }
                continue;
            }
            Ok(StreamEvent::Whitespace) => continue,
            Ok(StreamEvent::Close) | Err(_) => {
                let _ = tx
                    .send(Message::Text(
                        format!("<close xmlns='{NS_FRAMING}'/>").into(),
                    ))
                    .await;
                let _ = tx.send(Message::Close(None)).await;
                return;
            }
        };
        if tx.send(Message::Text(text.into())).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_becomes_a_stream_header_and_close_its_end() {
        let h = inbound(
            "<open xmlns='urn:ietf:params:xml:ns:xmpp-framing' to='example.org' version='1.0'/>",
            ReaderLimits::default(),
        )
        .unwrap();
        assert!(h.starts_with("<?xml version='1.0'?><stream:stream xmlns='jabber:client'"));
        assert!(h.contains(" to='example.org'") && h.contains(" version='1.0'"));
        assert_eq!(
            inbound(
                "<close xmlns='urn:ietf:params:xml:ns:xmpp-framing'/>",
                ReaderLimits::default()
            )
            .unwrap(),
            "</stream:stream>"
        );
    }

    #[test]
    fn stanzas_pass_through_and_go_out_with_their_namespace() {
        let m = "<message xmlns='jabber:client' to='a@b'><body>hi</body></message>";
        assert_eq!(
            inbound(m, ReaderLimits::default()).unwrap(),
            "<message to='a@b'><body>hi</body></message>"
        );
        let el = x::parse_element(m).unwrap();
        assert_eq!(
            outbound_element(&el),
            "<message xmlns='jabber:client' to='a@b'><body>hi</body></message>"
        );
    }

    #[test]
    fn stream_features_keep_the_prefix_declared() {
        let f = Element::new("features", x::NS_STREAM).child(Element::new("bind", x::NS_BIND));
        assert_eq!(
            outbound_element(&f),
            "<stream:features xmlns:stream='http://etherx.jabber.org/streams'><bind xmlns='urn:ietf:params:xml:ns:xmpp-bind'/></stream:features>"
        );
    }
}
