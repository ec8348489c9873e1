//! What a WebSocket client (RFC 7395) can make the server hold with control frames and by not
//! reading: Pings beyond the stanza rate, the Pongs they ask for, and writes that never
//! complete. The server runs in this process; the clients write hand-made frames over plain
//! TCP (loopback), so they buffer nothing themselves, and a counting global allocator
//! measures the heap the server holds meanwhile.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

use base64::Engine as _;
use common::*;
use futures_util::SinkExt;
use presenced::protocol::xml::{parse_element, Element};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;

/// Counts bytes currently allocated by the whole process, and the most at any moment since
/// the last [`reset_peak`].
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

fn grow(size: usize) {
    let now = LIVE.fetch_add(size as isize, Ordering::Relaxed) + size as isize;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            grow(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            grow(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
            grow(new_size);
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The heap now; the peak starts again from here.
fn reset_peak() -> isize {
    let now = LIVE.load(Ordering::Relaxed);
    PEAK.store(now, Ordering::Relaxed);
    now
}

fn peak() -> isize {
    PEAK.load(Ordering::Relaxed)
}

/// The tests of this file measure the heap of the whole process, so they run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const FRAMING: &str = "urn:ietf:params:xml:ns:xmpp-framing";
const MIB: isize = 1024 * 1024;

/// One client frame (RFC 6455 §5.2): final, masked as a client must (§5.3). The mask key is
/// zero, which leaves the payload as it is, so a flood can be built once and sent many times.
fn frame(opcode: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0x80 | opcode];
    match payload.len() {
        n if n < 126 => f.push(0x80 | n as u8),
        n if n <= u16::MAX as usize => {
            f.push(0x80 | 126);
            f.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            f.push(0x80 | 127);
            f.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    f.extend_from_slice(&[0, 0, 0, 0]);
    f.extend_from_slice(payload);
    f
}

const TEXT: u8 = 1;
const CLOSE: u8 = 8;
const PING: u8 = 9;

/// A WebSocket client that writes raw frames and reads only when the test says so.
struct Raw {
    tcp: TcpStream,
    /// Bytes read and not yet parsed into frames.
    buf: Vec<u8>,
}

impl Raw {
    /// The upgrade (RFC 6455 §4.1) with the xmpp subprotocol (RFC 7395 §3.1).
    async fn connect(ts: &TestServer) -> Raw {
        Raw::connect_with(ts, None).await
    }

    /// The same over a socket whose receive buffer is `rcvbuf` bytes (the system's default
    /// otherwise), so that a client that does not read stalls the server's writes soon.
    async fn connect_with(ts: &TestServer, rcvbuf: Option<u32>) -> Raw {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        if let Some(size) = rcvbuf {
            sock.set_recv_buffer_size(size).unwrap();
        }
        let mut tcp = sock.connect(ts.http_addr()).await.unwrap();
        let key = base64::engine::general_purpose::STANDARD.encode([7u8; 16]);
        let head = format!(
            "GET {} HTTP/1.1\r\nHost: {}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: xmpp\r\n\r\n",
            ts.config.http.websocket_path, ts.domain
        );
        tcp.write_all(head.as_bytes()).await.unwrap();
        let mut buf = Vec::new();
        let end = tokio::time::timeout(WAIT, async {
            loop {
                if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    return i + 4;
                }
                let mut chunk = [0u8; 1024];
                let n = tcp.read(&mut chunk).await.unwrap();
                assert!(n > 0, "closed during the handshake");
                buf.extend_from_slice(&chunk[..n]);
            }
        })
        .await
        .expect("handshake answered within the wait");
        let answer = String::from_utf8_lossy(&buf[..end]).to_string();
        assert!(answer.starts_with("HTTP/1.1 101"), "{answer}");
        Raw {
            tcp,
            buf: buf[end..].to_vec(),
        }
    }

    async fn send_text(&mut self, text: &str) {
        self.tcp
            .write_all(&frame(TEXT, text.as_bytes()))
            .await
            .unwrap();
    }

    /// The next frame from the server (unmasked, §5.1): opcode and payload; `None` at the
    /// end of the connection (EOF or reset).
    async fn next_frame(&mut self) -> Option<(u8, Vec<u8>)> {
        loop {
            if let Some((len, at)) = self.frame_len() {
                if self.buf.len() >= at + len {
                    let op = self.buf[0] & 0x0f;
                    let payload = self.buf[at..at + len].to_vec();
                    self.buf.drain(..at + len);
                    return Some((op, payload));
                }
            }
            let mut chunk = vec![0u8; 64 * 1024];
            match self.tcp.read(&mut chunk).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// The payload length of the frame at the start of the buffer and where it starts.
    fn frame_len(&self) -> Option<(usize, usize)> {
        let b = &self.buf;
        if b.len() < 2 {
            return None;
        }
        match b[1] & 0x7f {
            126 if b.len() >= 4 => Some((u16::from_be_bytes([b[2], b[3]]) as usize, 4)),
            127 if b.len() >= 10 => Some((
                u64::from_be_bytes(b[2..10].try_into().unwrap()) as usize,
                10,
            )),
            126 | 127 => None,
            n => Some((n as usize, 2)),
        }
    }

    /// Reads to the end of the connection, within `wait`: the text messages in order, and
    /// whether a Close frame came.
    async fn read_to_end(&mut self, wait: Duration) -> (Vec<String>, bool) {
        let mut texts = Vec::new();
        let mut closed = false;
        tokio::time::timeout(wait, async {
            while let Some((op, payload)) = self.next_frame().await {
                match op {
                    TEXT => texts.push(String::from_utf8_lossy(&payload).into_owned()),
                    CLOSE => {
                        closed = true;
                        // Our Close back (RFC 6455 §5.5.1), so the server can finish.
                        let _ = self.tcp.write_all(&frame(CLOSE, &[])).await;
                    }
                    _ => {}
                }
            }
        })
        .await
        .expect("the server ends the connection within the wait");
        (texts, closed)
    }
}

/// The stream error condition among `texts`, if any.
fn stream_error(texts: &[String]) -> Option<String> {
    texts
        .iter()
        .filter_map(|t| parse_element(t))
        .find(|e| e.is("error", presenced::protocol::xml::NS_STREAM))
        .and_then(|e| e.elements().next().map(|c| c.name.clone()))
}

/// Sends `count` Pings of 125 bytes each (the most a control frame carries, RFC 6455 §5.5)
/// and reads nothing. Stops early when the server has closed the connection. Returns how
/// many were written.
async fn ping_flood(c: &mut Raw, count: usize) -> usize {
    const BATCH: usize = 1000;
    let one = frame(PING, &[b'p'; 125]);
    let batch: Vec<u8> = one
        .iter()
        .copied()
        .cycle()
        .take(one.len() * BATCH)
        .collect();
    let mut sent = 0;
    while sent < count {
        if c.tcp.write_all(&batch).await.is_err() {
            break;
        }
        sent += BATCH;
    }
    sent
}

/// Before authentication a client sends a million Pings and reads none of the Pongs. Before,
/// every Ping was answered into tungstenite's write buffer, which had no bound: the heap grew
/// by the Pongs' size (127 bytes each) until the client went away, past the negotiation
/// timeout. Now Pings take tokens from the stanza rate limiter (`stanzas_per_second`,
/// `stanza_burst`): past the burst the stream gets policy-violation (RFC 6120 §4.9.3.18) and
/// is closed, and the heap held meanwhile stays small.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ping_flood_before_authentication_is_closed_with_policy_violation_and_memory_stays_bounded(
) {
    let _one = SERIAL.lock().await;
    let ts = TestServer::start(|c| {
        // The limiter's defaults, said here because the test depends on them.
        c.limits.stanzas_per_second = 50;
        c.limits.stanza_burst = 200;
    })
    .await;
    let mut c = Raw::connect(&ts).await;
    c.send_text(&format!(
        "<open xmlns='{FRAMING}' to='{}' version='1.0'/>",
        ts.domain
    ))
    .await;
    let before = reset_peak();
    let started = Instant::now();
    let sent = ping_flood(&mut c, 1_000_000).await;
    let grown = peak() - before;
    eprintln!(
        "measured: {sent} Pings written in {:?}; the heap grew by at most {} KiB",
        started.elapsed(),
        grown / 1024
    );
    // Without the limit a million Pongs are 127 MB; 8 MiB leaves room for the server's own
    // work during the test and nothing near the Pongs.
    assert!(grown < 8 * MIB, "the heap grew by {grown} bytes");
    let (texts, closed) = c.read_to_end(WAIT).await;
    assert_eq!(
        stream_error(&texts).as_deref(),
        Some("policy-violation"),
        "{texts:?}"
    );
    assert!(
        texts.last().is_some_and(|t| t.contains("<close")),
        "{texts:?}"
    );
    assert!(closed, "the WebSocket Close follows <close/>");
    ts.stop().await;
}

/// Within the rate (set very high here) a client that sends Pings and never reads its Pongs
/// makes the server hold no more than its WebSocket write buffer (the largest outbound
/// message and a little room; tungstenite keeps only the newest Pong beyond it, as RFC 6455
/// §5.5.3 allows), and the Pongs it does not read end the connection at the write timeout,
/// as any write does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pongs_a_client_never_reads_are_bounded_and_end_the_connection_at_the_write_timeout() {
    let _one = SERIAL.lock().await;
    let write_timeout = Duration::from_secs(1);
    let ts = TestServer::start(|c| {
        c.limits.stanzas_per_second = 100_000_000;
        c.limits.stanza_burst = 100_000_000;
        c.limits.write_timeout = write_timeout;
        c.limits.negotiation_timeout = Duration::from_secs(60);
    })
    .await;
    let mut c = Raw::connect(&ts).await;
    c.send_text(&format!(
        "<open xmlns='{FRAMING}' to='{}' version='1.0'/>",
        ts.domain
    ))
    .await;
    let before = reset_peak();
    let started = Instant::now();
    // 500,000 Pongs are 63 MB: more than the loopback socket buffers hold by far.
    let sent = ping_flood(&mut c, 500_000).await;
    // The client still reads nothing (reading would let the server's writes complete); a
    // Ping every 50 ms tells when the server has dropped the connection.
    let one = frame(PING, &[b'p'; 125]);
    let bound = write_timeout + Duration::from_secs(5);
    let ended = loop {
        if c.tcp.write_all(&one).await.is_err() {
            break started.elapsed();
        }
        assert!(
            started.elapsed() < bound,
            "the connection was still open {bound:?} after the flood began"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let grown = peak() - before;
    eprintln!(
        "measured: {sent} Pings written, the connection dropped {ended:?} after the flood began (write timeout {write_timeout:?}); the heap grew by at most {} KiB",
        grown / 1024
    );
    // The budget: the write buffer is the largest outbound message (4 × max_stanza_size,
    // 1 MiB) and 64 KiB, its allocation up to twice that; 4 MiB leaves room for the rest of
    // the server's work.
    assert!(grown < 4 * MIB, "the heap grew by {grown} bytes");
    assert!(
        ended >= write_timeout,
        "dropped before the write timeout: {ended:?}"
    );
    ts.stop().await;
}

/// A logged-in WebSocket client over a TCP socket with a small receive buffer, driven by
/// tokio-tungstenite.
async fn ws_login(
    ts: &TestServer,
    user: &str,
) -> (tokio_tungstenite::WebSocketStream<TcpStream>, String) {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let tcp = sock.connect(ts.http_addr()).await.unwrap();
    let url = format!("ws://{}{}", ts.domain, ts.config.http.websocket_path);
    let mut req = url.into_client_request().unwrap();
    req.headers_mut()
        .insert("Sec-WebSocket-Protocol", HeaderValue::from_static("xmpp"));
    let (mut ws, _) = tokio::time::timeout(WAIT, tokio_tungstenite::client_async(req, tcp))
        .await
        .expect("handshake within the wait")
        .expect("admitted");
    async fn recv(ws: &mut tokio_tungstenite::WebSocketStream<TcpStream>) -> Element {
        use futures_util::StreamExt;
        loop {
            let m = tokio::time::timeout(WAIT, ws.next())
                .await
                .expect("message within the wait")
                .expect("open")
                .expect("frame");
            if let Message::Text(t) = m {
                return parse_element(&t).unwrap();
            }
        }
    }
    let open = format!("<open xmlns='{FRAMING}' to='{}' version='1.0'/>", ts.domain);
    ws.send(Message::Text(open.clone().into())).await.unwrap();
    recv(&mut ws).await;
    recv(&mut ws).await;
    let creds = base64::engine::general_purpose::STANDARD.encode(format!("\0{user}\0pw"));
    ws.send(Message::Text(
        format!("<auth xmlns='urn:ietf:params:xml:ns:xmpp-sasl' mechanism='PLAIN'>{creds}</auth>")
            .into(),
    ))
    .await
    .unwrap();
    assert_eq!(recv(&mut ws).await.name, "success");
    ws.send(Message::Text(open.into())).await.unwrap();
    recv(&mut ws).await;
    recv(&mut ws).await;
    ws.send(Message::Text(
        "<iq xmlns='jabber:client' type='set' id='b1'><bind xmlns='urn:ietf:params:xml:ns:xmpp-bind'/></iq>"
            .into(),
    ))
    .await
    .unwrap();
    let bound = recv(&mut ws).await;
    assert_eq!(bound.get_attr("type"), Some("result"), "{bound}");
    let jid = bound
        .elements()
        .next()
        .and_then(|b| b.elements().next())
        .map(|j| j.text_content())
        .unwrap();
    (ws, jid)
}

/// Clients that stop reading while the server has much to send them. Before, the WebSocket
/// writer waited for the socket with no bound, so such connections held every place of
/// `max_connections` until the clients went away. Now each write waits at most `[limits]
/// write_timeout`, as on TCP: the connection is dropped and its place taken by a new client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_clients_that_stop_reading_are_dropped_at_the_write_timeout_and_free_their_places(
) {
    let _one = SERIAL.lock().await;
    let write_timeout = Duration::from_secs(5);
    let slots = 3;
    let ts = TestServer::start(|c| {
        c.limits.max_connections = slots;
        c.limits.write_timeout = write_timeout;
    })
    .await;
    let mut stalled = Vec::new();
    for n in 0..slots {
        let user = format!("stall{n}");
        ts.user(&user).await;
        stalled.push(ws_login(&ts, &user).await);
    }
    // From here on the clients read nothing. Each sends itself 60 messages of 100 kB at
    // once: 6 MB the server must write to it, more than the socket buffers take.
    let stopped_reading = Instant::now();
    let body = "a".repeat(100_000);
    futures_util::future::join_all(stalled.iter_mut().map(|(ws, jid)| {
        let body = &body;
        async move {
            for i in 0..60 {
                ws.send(Message::Text(
                    format!("<message xmlns='jabber:client' to='{jid}' id='m{i}' type='chat'><body>{body}</body></message>")
                        .into(),
                ))
                .await
                .unwrap();
            }
        }
    }))
    .await;
    eprintln!(
        "measured: the clients sent their messages in {:?}",
        stopped_reading.elapsed()
    );
    // Positive control: the places are all taken.
    let refused = try_ws(&ts).await;
    assert_eq!(
        refused,
        Err(503),
        "every place is taken by a stalled client"
    );
    // The write timeout, the time to fill the buffers before it starts, and the teardown.
    let bound = write_timeout + Duration::from_secs(8);
    loop {
        match try_ws(&ts).await {
            Ok(()) => break,
            Err(503) => {
                assert!(
                    stopped_reading.elapsed() < bound,
                    "no place was freed within {bound:?} of the clients' stopping to read"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) => panic!("refused with {s}"),
        }
    }
    eprintln!(
        "measured: a new client admitted {:?} after the stalled clients stopped reading (write timeout {write_timeout:?})",
        stopped_reading.elapsed()
    );
    drop(stalled);
    ts.stop().await;
}

/// A WebSocket handshake: `Ok` when admitted, else the HTTP status that refused it.
async fn try_ws(ts: &TestServer) -> Result<(), u16> {
    let tcp = TcpStream::connect(ts.http_addr()).await.unwrap();
    let url = format!("ws://{}{}", ts.domain, ts.config.http.websocket_path);
    let mut req = url.into_client_request().unwrap();
    req.headers_mut()
        .insert("Sec-WebSocket-Protocol", HeaderValue::from_static("xmpp"));
    match tokio::time::timeout(WAIT, tokio_tungstenite::client_async(req, tcp))
        .await
        .expect("handshake answered within the wait")
    {
        Ok(_) => Ok(()),
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => Err(resp.status().as_u16()),
        Err(e) => panic!("handshake failed without an HTTP status: {e}"),
    }
}

/// Before authentication a client keeps sending Pings (within the rate) and reads nothing.
/// The negotiation timeout ends it: the c2s side gives up at the deadline, and the end it
/// wrote has a short time to reach the client, which does not take it, so the connection
/// goes. Before, the writer waited for the socket for ever and the reader went on taking
/// Pings, so the connection stayed as long as the client kept sending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_negotiation_timeout_ends_a_websocket_that_keeps_pinging_and_never_reads() {
    let _one = SERIAL.lock().await;
    let negotiation = Duration::from_secs(1);
    let ts = TestServer::start(|c| {
        c.limits.negotiation_timeout = negotiation;
        // Neither the rate nor the write timeout may be what ends it.
        c.limits.stanzas_per_second = 100_000_000;
        c.limits.stanza_burst = 100_000_000;
        c.limits.write_timeout = Duration::from_secs(120);
    })
    .await;
    let mut c = Raw::connect_with(&ts, Some(4096)).await;
    c.send_text(&format!(
        "<open xmlns='{FRAMING}' to='{}' version='1.0'/>",
        ts.domain
    ))
    .await;
    let started = Instant::now();
    // 500 Pings every 10 ms: 6 MB/s of Pongs, so the socket buffers are full well before
    // the deadline and the end of the stream cannot be written.
    let one = frame(PING, &[b'p'; 125]);
    let batch: Vec<u8> = one.iter().copied().cycle().take(one.len() * 500).collect();
    let bound = negotiation + Duration::from_secs(6);
    let ended = loop {
        if c.tcp.write_all(&batch).await.is_err() {
            break started.elapsed();
        }
        assert!(
            started.elapsed() < bound,
            "the connection was still taking Pings {bound:?} after the stream opened"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    eprintln!("measured: the connection ended {ended:?} after the stream opened (negotiation timeout {negotiation:?})");
    assert!(ended >= negotiation, "ended before the deadline: {ended:?}");
    ts.stop().await;
}
