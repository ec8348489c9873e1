//! XMPP over WebSocket (RFC 7395) with a real WebSocket client library (tokio-tungstenite),
//! against the real server, PostgreSQL and Redis, with scaled-down liveness timings.

mod common;

use std::time::{Duration, Instant};

use base64::Engine as _;
use common::*;
use futures_util::{SinkExt, StreamExt};
use presenced::protocol::xml::{parse_element, Element};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

const FRAMING: &str = "urn:ietf:params:xml:ns:xmpp-framing";

struct Ws {
    ws: WebSocketStream<Box<dyn Io>>,
    jid: String,
}

impl Ws {
    async fn connect(ts: &TestServer) -> Ws {
        let tcp = TcpStream::connect(ts.http_addr()).await.unwrap();
        Ws::handshake(ts, "ws", Box::new(tcp)).await
    }

    /// wss: TLS with the server's certificate (pinned, verified), then the handshake.
    async fn connect_tls(ts: &TestServer) -> Ws {
        let tcp = TcpStream::connect(ts.http_addr()).await.unwrap();
        let connector = tokio_rustls::TlsConnector::from(tls_client(&ts.cert));
        let name = rustls_pki_types::ServerName::try_from(ts.domain.clone()).unwrap();
        let tls = connector.connect(name, tcp).await.expect("TLS handshake");
        Ws::handshake(ts, "wss", Box::new(tls)).await
    }

    async fn handshake(ts: &TestServer, scheme: &str, io: Box<dyn Io>) -> Ws {
        let url = format!("{scheme}://{}{}", ts.domain, ts.config.http.websocket_path);
        let mut req = url.into_client_request().unwrap();
        req.headers_mut()
            .insert("Sec-WebSocket-Protocol", HeaderValue::from_static("xmpp"));
        let (ws, resp) = tokio_tungstenite::client_async(req, io)
            .await
            .expect("WebSocket handshake");
        // RFC 7395 §3.1: the server must confirm the xmpp subprotocol.
        assert_eq!(
            resp.headers()
                .get("Sec-WebSocket-Protocol")
                .and_then(|v| v.to_str().ok()),
            Some("xmpp")
        );
        Ws {
            ws,
            jid: String::new(),
        }
    }

    async fn send(&mut self, text: &str) {
        self.ws.send(Message::Text(text.into())).await.unwrap();
    }

    /// The next text message as an element (control frames are handled by the library).
    async fn recv(&mut self) -> Element {
        loop {
            let m = tokio::time::timeout(WAIT, self.ws.next())
                .await
                .expect("message within the wait")
                .expect("stream open")
                .expect("frame");
            if let Message::Text(t) = m {
                return parse_element(&t).unwrap_or_else(|| panic!("not one element: {t}"));
            }
        }
    }

    async fn recv_until(&mut self, pred: impl Fn(&Element) -> bool) -> Element {
        loop {
            let el = self.recv().await;
            if pred(&el) {
                return el;
            }
        }
    }

    async fn open(&mut self, domain: &str) -> Element {
        self.send(&format!(
            "<open xmlns='{FRAMING}' to='{domain}' version='1.0'/>"
        ))
        .await;
        let open = self.recv().await;
        assert!(open.is("open", FRAMING), "{open}");
        assert_eq!(open.get_attr("version"), Some("1.0"));
        let features = self.recv().await;
        assert_eq!(features.name, "features", "{features}");
        features
    }

    async fn login(ts: &TestServer, user: &str, resource: &str) -> Ws {
        let c = Ws::connect(ts).await;
        c.login_on(ts, user, resource).await
    }

    async fn login_on(mut self, ts: &TestServer, user: &str, resource: &str) -> Ws {
        self.authenticate(ts, user).await;
        let c = &mut self;
        c.send(&format!(
            "<iq xmlns='jabber:client' type='set' id='b1'><bind xmlns='urn:ietf:params:xml:ns:xmpp-bind'><resource>{resource}</resource></bind></iq>"
        ))
        .await;
        let bound = c.recv_until(|e| e.get_attr("id") == Some("b1")).await;
        assert_eq!(bound.get_attr("type"), Some("result"), "{bound}");
        c.jid = bound
            .elements()
            .next()
            .and_then(|b| b.elements().next())
            .map(|j| j.text_content())
            .unwrap();
        self
    }

    /// Opens the stream, authenticates `user` (PLAIN) and opens the restarted stream, up to
    /// the features that offer bind.
    async fn authenticate(&mut self, ts: &TestServer, user: &str) {
        let c = self;
        let features = c.open(&ts.domain).await;
        // RFC 7395 §3.6: TLS is the WebSocket's; STARTTLS is not offered.
        assert!(features
            .get_child("starttls", presenced::protocol::xml::NS_TLS)
            .is_none());
        assert!(features
            .get_child("mechanisms", presenced::protocol::xml::NS_SASL)
            .is_some());
        let creds = base64::engine::general_purpose::STANDARD.encode(format!("\0{user}\0pw"));
        c.send(&format!(
            "<auth xmlns='urn:ietf:params:xml:ns:xmpp-sasl' mechanism='PLAIN'>{creds}</auth>"
        ))
        .await;
        let ok = c.recv().await;
        assert_eq!(ok.name, "success", "{ok}");
        let features = c.open(&ts.domain).await;
        assert!(features
            .get_child("bind", presenced::protocol::xml::NS_BIND)
            .is_some());
    }
}

#[tokio::test]
async fn websocket_client_logs_in_exchanges_presence_and_is_found_dead_when_it_stops_answering_pings(
) {
    let ts = TestServer::start(fast_liveness).await;
    let l = ts.config.liveness.clone();
    ts.user("alice").await;
    ts.user("bob").await;
    ts.make_mutual("alice", "bob").await;
    let mut bob = ts.login("bob", "pc").await;
    bob.presence(None, None).await;
    let mut alice = Ws::login(&ts, "alice", "browser").await;
    assert_eq!(alice.jid, format!("{}/browser", ts.jid("alice")));
    alice.send("<presence xmlns='jabber:client'/>").await;
    // Alice gets bob's presence (probe answer) over the WebSocket...
    let p = alice
        .recv_until(|e| {
            e.name == "presence"
                && e.get_attr("from")
                    .is_some_and(|f| f.starts_with(&ts.jid("bob")))
        })
        .await;
    assert_eq!(p.get_attr("type"), None);
    // ...and bob gets hers.
    bob.watch(&|e| is_presence(e, &alice.jid, None), WAIT)
        .await
        .expect("bob sees the WebSocket client online");
    // A message from bob arrives over the WebSocket.
    bob.send(
        &parse_element(&format!(
            "<message to='{}' type='chat'><body>hi</body></message>",
            alice.jid
        ))
        .unwrap(),
    )
    .await;
    let m = alice.recv_until(|e| e.name == "message").await;
    assert_eq!(
        m.get_child("body", presenced::protocol::xml::NS_CLIENT)
            .map(|b| b.text_content()),
        Some("hi".into())
    );
    // Stay alive across several heartbeat intervals (the library answers the server's Pings
    // while it reads); bob, answering his own pings, must see no unavailable meanwhile.
    let alive_for = l.ttl.mul_f64(1.5);
    let live_until = Instant::now() + alive_for;
    // Reading ends right after a server Ping, whose Pong is then flushed: that Pong is the
    // client's last beat.
    let keep_reading = async {
        loop {
            let m = tokio::time::timeout(Duration::from_millis(100), alice.ws.next()).await;
            if matches!(m, Ok(Some(Ok(Message::Ping(_))))) && Instant::now() >= live_until {
                alice.ws.flush().await.unwrap();
                return Instant::now();
            }
        }
    };
    let jid = alice.jid.clone();
    let (silent, ()) = tokio::join!(
        keep_reading,
        bob.watch_none(|e| is_presence(e, &jid, Some("unavailable")), alive_for)
    );
    // Now alice stops reading: no Pong answers the server's Pings any more.
    let got = bob
        .watch(
            &|e| is_presence(e, &alice.jid, Some("unavailable")),
            l.ttl + l.sweep_interval + Duration::from_secs(1),
        )
        .await
        .expect("dead WebSocket client announced");
    let after = silent.elapsed();
    eprintln!("measured: WebSocket client announced {after:.3?} after its last Pong");
    assert!(got.get_attr("from") == Some(alice.jid.as_str()));
    assert!(after >= l.ttl - l.heartbeat_interval, "{after:?}");
    assert!(
        after <= l.ttl + l.sweep_interval + Duration::from_millis(300),
        "{after:?}"
    );
    drop(alice);
    ts.stop().await;
}

#[tokio::test]
async fn user_stays_available_while_either_websocket_or_tcp_resource_lives() {
    let ts = TestServer::start(fast_liveness).await;
    let l = ts.config.liveness.clone();
    ts.user("alice").await;
    ts.user("bob").await;
    ts.make_mutual("alice", "bob").await;
    let mut bob = ts.login("bob", "pc").await;
    bob.presence(None, None).await;
    let mut web = Ws::login(&ts, "alice", "web").await;
    web.send("<presence xmlns='jabber:client'/>").await;
    let mut tcp = ts.login("alice", "desktop").await;
    tcp.presence(None, None).await;
    bob.watch(&|e| is_presence(e, &web.jid, None), WAIT)
        .await
        .unwrap();
    bob.watch(&|e| is_presence(e, &tcp.jid, None), WAIT)
        .await
        .unwrap();
    // The WebSocket closes cleanly (RFC 7395 <close/>); the TCP resource keeps the user on.
    web.send(&format!("<close xmlns='{FRAMING}'/>")).await;
    let close = web.recv_until(|e| e.name == "close").await;
    assert!(close.is("close", FRAMING), "{close}");
    bob.watch(
        &|e| is_presence(e, &web.jid, Some("unavailable")),
        l.grace + Duration::from_secs(2),
    )
    .await
    .expect("the closed WebSocket resource goes unavailable after G");
    // The TCP resource is still there: bob's new session is told it is available.
    let mut bob2 = ts.login("bob", "tablet").await;
    bob2.presence(None, None).await;
    bob2.expect(|e| is_presence(e, &tcp.jid, None)).await;
    tcp.close().await;
    ts.stop().await;
}

/// RFC 6455 §5.5.1 / §7.1.1: the server that sends the WebSocket Close (after answering the
/// client's `<close/>`, RFC 7395 §3.6) waits for the client's Close before it drops the TCP
/// connection. Dropping it at once resets the connection under a client whose Close is on
/// its way, which a browser's WebSocket reports as an error instead of a clean close.
#[tokio::test]
async fn the_websocket_close_handshake_completes_before_the_server_drops_the_connection() {
    use tokio::io::AsyncReadExt;
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    let mut web = Ws::login(&ts, "alice", "web").await;
    web.send(&format!("<close xmlns='{FRAMING}'/>")).await;
    web.recv_until(|e| e.name == "close").await;
    // The server's Close frame. tungstenite queues its reply and sends it only when the
    // stream is next polled, so until then the client has not answered.
    let frame = tokio::time::timeout(WAIT, web.ws.next())
        .await
        .expect("the server's Close within the wait")
        .expect("stream open")
        .expect("frame");
    assert!(matches!(frame, Message::Close(_)), "{frame:?}");
    // The server must still hold the connection: a read of the socket underneath neither
    // ends nor fails while the client's Close is outstanding.
    let mut byte = [0u8; 1];
    let early =
        tokio::time::timeout(Duration::from_millis(500), web.ws.get_mut().read(&mut byte)).await;
    assert!(
        early.is_err(),
        "the server dropped the connection before the client's Close: {early:?}"
    );
    // The client's Close goes out; then the server closes the TCP connection.
    assert!(
        tokio::time::timeout(WAIT, web.ws.next())
            .await
            .expect("the handshake ends within the wait")
            .is_none(),
        "nothing after the Close handshake"
    );
    let end = tokio::time::timeout(WAIT, web.ws.get_mut().read(&mut byte))
        .await
        .expect("the server closes the connection after the handshake");
    assert_eq!(
        end.ok(),
        Some(0),
        "the server closes the connection cleanly"
    );
    ts.stop().await;
}

/// XEP-0198 over RFC 7395: a WebSocket that drops without `<close/>` leaves a resumable
/// session detached, and a new WebSocket resumes it with what was sent meanwhile; the
/// contact watching sees no unavailable.
#[tokio::test]
async fn a_dropped_websocket_session_is_resumed_over_a_new_websocket() {
    let ts = TestServer::start(fast_liveness).await;
    ts.user("alice").await;
    ts.user("bob").await;
    ts.make_mutual("alice", "bob").await;
    let mut bob = ts.login("bob", "pc").await;
    bob.presence(None, None).await;
    let mut web = Ws::login(&ts, "alice", "web").await;
    web.send("<enable xmlns='urn:xmpp:sm:3' resume='true'/>")
        .await;
    let enabled = web.recv_until(|e| e.name == "enabled").await;
    let id = enabled.get_attr("id").expect("resume id").to_owned();
    web.send("<presence xmlns='jabber:client'/>").await;
    let alice = web.jid.clone();
    bob.watch(&|e| is_presence(e, &alice, None), WAIT)
        .await
        .expect("bob sees alice online");
    // The socket goes away without a WebSocket close or <close/>.
    drop(web);
    let deadline = Instant::now() + WAIT;
    while ts.shared().resumable.detached() != 1 {
        assert!(Instant::now() < deadline, "never detached");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    bob.send(&chat(&alice, "meanwhile")).await;
    barrier(&ts, &mut bob).await;
    // A detached session is neither a closed one (announced after G) nor a silent one
    // (announced after T and a sweep): watch past the later of the two, with a second to
    // spare, before resuming. Bob answers pings meanwhile, as a live client does.
    let l = &ts.config.liveness;
    let quiet = l.grace.max(l.ttl + l.sweep_interval) + Duration::from_secs(1);
    bob.watch_none(|e| is_presence(e, &alice, Some("unavailable")), quiet)
        .await;

    let mut again = Ws::connect(&ts).await;
    again.authenticate(&ts, "alice").await;
    again
        .send(&format!(
            "<resume xmlns='urn:xmpp:sm:3' previd='{id}' h='0'/>"
        ))
        .await;
    let resumed = again
        .recv_until(|e| e.name == "resumed" || e.name == "failed")
        .await;
    assert_eq!(resumed.name, "resumed", "{resumed}");
    let got = again.recv_until(|e| e.name == "message").await;
    assert_eq!(
        got.get_child("body", presenced::protocol::xml::NS_CLIENT)
            .map(|b| b.text_content())
            .as_deref(),
        Some("meanwhile")
    );
    // Positive control over the resumed socket, then the negative check on what bob got.
    again
        .send(&format!(
            "<message xmlns='jabber:client' type='chat' to='{}'><body>back</body></message>",
            bob.jid
        ))
        .await;
    bob.watch(&|e| has_body(e, "back"), WAIT)
        .await
        .expect("bob hears from the resumed WebSocket");
    assert!(
        !bob.backlog
            .iter()
            .any(|e| is_presence(e, &alice, Some("unavailable"))),
        "no unavailable: {:?}",
        bob.backlog
    );
}

#[tokio::test]
async fn host_meta_advertises_the_websocket_endpoint() {
    let ts = TestServer::start(fast_liveness).await;
    for (path, needle) in [
        (
            "/.well-known/host-meta",
            "rel='urn:xmpp:alt-connections:websocket'",
        ),
        (
            "/.well-known/host-meta.json",
            "\"rel\":\"urn:xmpp:alt-connections:websocket\"",
        ),
    ] {
        // A Host naming a served domain (with the port the client used) is kept; any other
        // Host is not echoed into the document, which a shared cache could hand to others
        // as the place to send their passwords: the first served domain stands in, at the
        // port the listener took (a client that came by IP address, as a new operator
        // does, is told the port it used, never an attacker's).
        let served = format!("{}:5443", ts.domain.to_uppercase());
        let port = ts.http_addr().port();
        let listener = format!("ws://{}:{port}/xmpp-websocket", ts.domain);
        let by_ip = format!("127.0.0.1:{port}");
        for (host, advertised) in [
            (served.as_str(), format!("ws://{served}/xmpp-websocket")),
            (by_ip.as_str(), listener.clone()),
            ("evil.example", listener.clone()),
            ("evil.example:5443", listener.clone()),
        ] {
            let body = ts.http_get(path, host).await;
            assert!(body.starts_with("HTTP/1.1 200"), "{body}");
            assert!(body.contains(needle), "{body}");
            assert!(body.contains(&advertised), "Host {host}: {body}");
            assert!(!body.contains("evil"), "Host {host} echoed: {body}");
        }
    }
    ts.stop().await;
}

/// A browser or curl pointed at the WebSocket URL without the upgrade is told what the
/// URL is for (RFC 9110 §15.5.22 426 Upgrade Required, naming the protocol to upgrade to),
/// not that it does not exist.
#[tokio::test]
async fn a_plain_get_on_the_websocket_path_is_told_to_upgrade() {
    let ts = TestServer::start(|_| {}).await;
    let reply = ts
        .http_get(&ts.config.http.websocket_path, &ts.domain)
        .await;
    assert!(
        reply.starts_with("HTTP/1.1 426 Upgrade Required"),
        "{reply}"
    );
    assert!(reply.contains("\r\nUpgrade: websocket\r\n"), "{reply}");
    assert!(reply.contains("RFC 7395"), "{reply}");
    ts.stop().await;
}

#[tokio::test]
async fn websocket_over_tls_uses_the_server_certificate_and_refuses_a_missing_subprotocol() {
    let ts = TestServer::start(|c| {
        fast_liveness(c);
        c.http.tls = true;
    })
    .await;
    ts.user("alice").await;
    let mut alice = Ws::connect_tls(&ts)
        .await
        .login_on(&ts, "alice", "web")
        .await;
    alice.send("<presence xmlns='jabber:client'/>").await;
    let own = alice.recv_until(|e| e.name == "presence").await;
    assert_eq!(own.get_attr("from"), Some(alice.jid.as_str()));
    // RFC 7395 §3.1: no xmpp subprotocol, no XMPP session.
    let tcp = TcpStream::connect(ts.http_addr()).await.unwrap();
    let connector = tokio_rustls::TlsConnector::from(tls_client(&ts.cert));
    let name = rustls_pki_types::ServerName::try_from(ts.domain.clone()).unwrap();
    let tls = connector.connect(name, tcp).await.unwrap();
    let req = format!("wss://{}{}", ts.domain, ts.config.http.websocket_path)
        .into_client_request()
        .unwrap();
    assert!(tokio_tungstenite::client_async(req, tls).await.is_err());
    ts.stop().await;
}

// ---------------------------------------------------------------------------------------
// One admission policy for every client-facing listener.

/// A TCP connection to the HTTP listener from the local address `source`.
async fn http_tcp_from(ts: &TestServer, source: std::net::IpAddr) -> TcpStream {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind(std::net::SocketAddr::new(source, 0)).unwrap();
    sock.connect(ts.http_addr()).await.unwrap()
}

/// A WebSocket handshake from `source`: the open connection, or the HTTP status that
/// refused it.
async fn ws_from(ts: &TestServer, source: std::net::IpAddr) -> Result<Ws, u16> {
    let tcp = http_tcp_from(ts, source).await;
    let url = format!("ws://{}{}", ts.domain, ts.config.http.websocket_path);
    let mut req = url.into_client_request().unwrap();
    req.headers_mut()
        .insert("Sec-WebSocket-Protocol", HeaderValue::from_static("xmpp"));
    let io: Box<dyn Io> = Box::new(tcp);
    match tokio::time::timeout(WAIT, tokio_tungstenite::client_async(req, io))
        .await
        .expect("handshake answered within the wait")
    {
        Ok((ws, _)) => Ok(Ws {
            ws,
            jid: String::new(),
        }),
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => Err(resp.status().as_u16()),
        Err(e) => panic!("handshake failed without an HTTP status: {e}"),
    }
}

#[tokio::test]
async fn websocket_and_tcp_connections_share_one_per_ip_budget() {
    let ts = TestServer::start(|c| c.limits.connections_per_ip_per_minute = 2).await;
    let (one, two) = (
        std::net::IpAddr::from([127, 0, 0, 1]),
        std::net::IpAddr::from([127, 0, 0, 2]),
    );
    // From one address: two TCP streams use the budget, so a WebSocket is refused (RFC 6585
    // §4) ...
    let mut tcp = Vec::new();
    for n in 1..=2 {
        let mut c = Client::tcp_from(&ts, one).await;
        c.open(&ts.domain)
            .await
            .unwrap_or_else(|e| panic!("TCP connection {n} within the budget refused: {e:?}"));
        tcp.push(c);
    }
    assert_eq!(ws_from(&ts, one).await.err(), Some(429));
    // ... and from another: two WebSockets use it, so a TCP stream gets policy-violation
    // (RFC 6120 §4.9.3.14). The first WebSocket there is the positive control: the refusal
    // above is per address, not global.
    let mut ws = Vec::new();
    for n in 1..=2 {
        let mut w = ws_from(&ts, two)
            .await
            .unwrap_or_else(|s| panic!("WebSocket {n} within the budget refused: {s}"));
        w.open(&ts.domain).await;
        ws.push(w);
    }
    let mut third = Client::tcp_from(&ts, two).await;
    match third.open(&ts.domain).await {
        Err(Ended::StreamError(cond)) => assert_eq!(cond, "policy-violation"),
        other => panic!("expected policy-violation, got {other:?}"),
    }
    ts.stop().await;
}

#[tokio::test]
async fn websocket_and_tcp_connections_share_one_connection_cap() {
    let ts = TestServer::start(|c| c.limits.max_connections = 2).await;
    let mut tcp = Client::tcp(&ts).await;
    tcp.open(&ts.domain)
        .await
        .expect("first connection admitted");
    let mut web = Ws::connect(&ts).await;
    web.open(&ts.domain).await;
    // Two open connections over two transports fill the cap for both.
    let mut over = Client::tcp(&ts).await;
    match over.open(&ts.domain).await {
        Err(Ended::StreamError(cond)) => assert_eq!(cond, "resource-constraint"),
        other => panic!("expected resource-constraint, got {other:?}"),
    }
    let local = std::net::IpAddr::from([127, 0, 0, 1]);
    assert_eq!(ws_from(&ts, local).await.err(), Some(503));
    // A closed WebSocket gives its place back, to a TCP stream as well: the server notices
    // the close on its own time, so the new connection is retried until admitted.
    web.send(&format!("<close xmlns='{FRAMING}'/>")).await;
    web.recv_until(|e| e.name == "close").await;
    drop(web);
    let deadline = Instant::now() + WAIT;
    loop {
        let mut c = Client::tcp(&ts).await;
        match c.open(&ts.domain).await {
            Ok(_) => break,
            Err(Ended::StreamError(cond)) if cond == "resource-constraint" => {
                assert!(Instant::now() < deadline, "the place was never given back");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("unexpected refusal: {e:?}"),
        }
    }
    ts.stop().await;
}

// ---------------------------------------------------------------------------------------
// The HTTP request head.

#[tokio::test]
async fn a_request_head_trickled_byte_by_byte_is_cut_off_at_the_negotiation_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Every single read comes well within the timeout; only the whole head is late.
    let timeout = Duration::from_secs(1);
    let ts = TestServer::start(|c| c.limits.negotiation_timeout = timeout).await;
    // Positive control: the same head sent at once is answered.
    let head = b"GET /.well-known/host-meta HTTP/1.1\r\nHost: chat.example\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    let mut quick = TcpStream::connect(ts.http_addr()).await.unwrap();
    quick.write_all(head).await.unwrap();
    let mut answer = String::new();
    tokio::time::timeout(WAIT, quick.read_to_string(&mut answer))
        .await
        .unwrap()
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // The slow client: one byte every 200 ms, the whole head would take 20 s.
    let mut slow = TcpStream::connect(ts.http_addr()).await.unwrap();
    let started = Instant::now();
    let (mut rd, mut wr) = slow.split();
    let trickle = async {
        for b in head {
            if wr.write_all(&[*b]).await.is_err() {
                // Closed by the server: the answer is read on the other branch.
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    let mut answer = String::new();
    let bound = timeout + Duration::from_secs(2);
    tokio::select! {
        r = tokio::time::timeout(bound, rd.read_to_string(&mut answer)) => {
            r.expect("the connection ends within the bound").ok();
        }
        _ = trickle => panic!("the whole head was accepted byte by byte"),
    }
    let took = started.elapsed();
    eprintln!("measured: trickled head cut off after {took:?}");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
    assert!(took >= timeout, "{took:?}");
    ts.stop().await;
}

// ---------------------------------------------------------------------------------------
// Metrics.

#[tokio::test]
async fn metrics_count_logins_by_transport_auth_failures_messages_and_policy_drops() {
    let ts = TestServer::start(|c| {
        c.limits.stanzas_per_second = 1;
        c.limits.stanza_burst = 20;
    })
    .await;
    for u in ["alice", "bob", "carol", "dave"] {
        ts.user(u).await;
    }
    let before = ts.scrape_metrics().await;
    let value = |m: &std::collections::HashMap<String, f64>, k: &str| {
        *m.get(k).unwrap_or_else(|| panic!("{k} missing in {m:?}"))
    };
    // Every counter is exported from the start.
    for k in [
        "presenced_logins_total{transport=\"tcp\"}",
        "presenced_logins_total{transport=\"websocket\"}",
        "presenced_auth_failures_total",
        "presenced_messages_routed_total",
        "presenced_stanzas_dropped_total{reason=\"blocked_by_sender\"}",
        "presenced_stanzas_dropped_total{reason=\"stanza_rate\"}",
    ] {
        assert_eq!(value(&before, k), 0.0, "{k}");
    }
    // One failed SASL attempt.
    let mut c = Client::tcp(&ts).await;
    c.open(&ts.domain).await.expect("stream");
    let mut c = c.starttls(&ts).await;
    let answer = c.auth_plain("alice", "not the password").await;
    assert_eq!(answer.name, "failure", "{answer}");
    // Two TCP logins and one WebSocket login.
    let mut alice = ts.login("alice", "pc").await;
    let mut dave = ts.login("dave", "pc").await;
    let mut bob = Ws::login(&ts, "bob", "web").await;
    // A message routed (and received: the positive control for the counts below).
    alice
        .send(
            &parse_element(&format!(
                "<message to='{}' type='chat'><body>hi</body></message>",
                bob.jid
            ))
            .unwrap(),
        )
        .await;
    bob.recv_until(|e| e.name == "message").await;
    // Alice blocks carol; her message to carol is refused with XEP-0191's <blocked/>.
    let r = alice
        .iq(
            "set",
            None,
            parse_element(&format!(
                "<block xmlns='urn:xmpp:blocking'><item jid='{}'/></block>",
                ts.jid("carol")
            ))
            .unwrap(),
        )
        .await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    alice
        .send(
            &parse_element(&format!(
                "<message to='{}' type='chat' id='m2'><body>x</body></message>",
                ts.jid("carol")
            ))
            .unwrap(),
        )
        .await;
    let refused = alice
        .expect(|e| e.name == "message" && e.get_attr("id") == Some("m2"))
        .await;
    assert_eq!(refused.get_attr("type"), Some("error"), "{refused}");
    // Dave floods past his burst: the stanza over it is dropped and the stream closed.
    for n in 0..40 {
        dave.send_raw(&format!("<presence xmlns='jabber:client' id='f{n}'/>"))
            .await;
    }
    match dave.expect_stream_end().await {
        Ended::StreamError(cond) => assert_eq!(cond, "policy-violation"),
        other => panic!("expected policy-violation, got {other:?}"),
    }
    let after = ts.scrape_metrics().await;
    for (k, want) in [
        ("presenced_logins_total{transport=\"tcp\"}", 2.0),
        ("presenced_logins_total{transport=\"websocket\"}", 1.0),
        ("presenced_auth_failures_total", 1.0),
        // The message to bob and the one to carol: counted whatever happened next.
        ("presenced_messages_routed_total", 2.0),
        (
            "presenced_stanzas_dropped_total{reason=\"blocked_by_sender\"}",
            1.0,
        ),
        (
            "presenced_stanzas_dropped_total{reason=\"stanza_rate\"}",
            1.0,
        ),
    ] {
        assert_eq!(value(&after, k), want, "{k}");
    }
    // The figures read at scrape time are in the same registry.
    assert!(after.contains_key("presenced_sessions"));
    assert!(after.contains_key("presenced_heartbeats_total"));
    assert!(after
        .contains_key("presenced_s2s_authenticated_total{method=\"external\",direction=\"in\"}"));
    alice.close().await;
    ts.stop().await;
}

/// The first message `bob` gets must be a marker `carol` sends now: whatever was sent to bob
/// before (and would have been routed before it) did not reach him, and his stream is up.
async fn next_message_is_a_fresh_marker(carol: &mut Client, bob: &mut Client) {
    let marker = format!("marker-{}", unique());
    carol
        .send(
            &parse_element(&format!(
                "<message to='{}' type='chat'><body>{marker}</body></message>",
                bob.jid
            ))
            .unwrap(),
        )
        .await;
    let got = bob.expect(|e| e.name == "message").await;
    assert_eq!(
        got.get_child("body", presenced::protocol::xml::NS_CLIENT)
            .map(|b| b.text_content()),
        Some(marker),
        "{got}"
    );
}

/// Reads until the stream error and returns its condition; then `<close/>` must follow.
async fn stream_error_then_close(c: &mut Ws) -> String {
    let err = c
        .recv_until(|e| e.is("error", presenced::protocol::xml::NS_STREAM))
        .await;
    let close = c.recv().await;
    assert!(close.is("close", FRAMING), "{close}");
    condition(&err)
}

/// RFC 7395 §3.3.3: one element per message. Two in one message are a stream error for the
/// sender (not-well-formed: the message is not a document with one root), and neither is
/// delivered — before, the first was delivered and the second silently dropped.
#[tokio::test]
async fn two_elements_in_one_websocket_message_get_a_stream_error_and_neither_is_delivered() {
    let ts = TestServer::start(|_| {}).await;
    for u in ["alice", "bob", "carol"] {
        ts.user(u).await;
    }
    let mut bob = ts.login("bob", "pc").await;
    bob.presence(None, None).await;
    let mut carol = ts.login("carol", "pc").await;
    let mut alice = Ws::login(&ts, "alice", "web").await;
    // Positive control: one message per WebSocket message is delivered.
    let bob_jid = bob.jid.clone();
    let one = |b: &str| {
        format!(
            "<message xmlns='jabber:client' to='{bob_jid}' type='chat'><body>{b}</body></message>"
        )
    };
    alice.send(&one("single")).await;
    let got = bob.expect(|e| e.name == "message").await;
    assert_eq!(
        got.get_child("body", presenced::protocol::xml::NS_CLIENT)
            .map(|b| b.text_content()),
        Some("single".into())
    );
    alice
        .send(&format!("{}{}", one("first"), one("second")))
        .await;
    assert_eq!(stream_error_then_close(&mut alice).await, "not-well-formed");
    next_message_is_a_fresh_marker(&mut carol, &mut bob).await;
    ts.stop().await;
}

/// The reader's rules hold on WebSocket too: a forbidden character is not-well-formed and
/// is not relayed; many elements before authentication get policy-violation.
#[tokio::test]
async fn websocket_forbidden_character_and_costly_stanza_before_authentication_end_the_stream() {
    let ts = TestServer::start(|c| c.limits.max_stanza_nodes_unauthenticated = 200).await;
    for u in ["alice", "bob", "carol"] {
        ts.user(u).await;
    }
    let mut bob = ts.login("bob", "pc").await;
    bob.presence(None, None).await;
    let mut carol = ts.login("carol", "pc").await;
    let mut alice = Ws::login(&ts, "alice", "web").await;
    alice
        .send(&format!(
            "<message xmlns='jabber:client' to='{}' type='chat'><body>a\u{1}b</body></message>",
            bob.jid
        ))
        .await;
    assert_eq!(stream_error_then_close(&mut alice).await, "not-well-formed");
    next_message_is_a_fresh_marker(&mut carol, &mut bob).await;

    let mut mallory = Ws::connect(&ts).await;
    mallory.open(&ts.domain).await;
    mallory
        .send(&format!(
            "<iq xmlns='jabber:client' type='get' id='x'><query xmlns='urn:example:q'>{}</query></iq>",
            "<a/>".repeat(1_000)
        ))
        .await;
    assert_eq!(
        stream_error_then_close(&mut mallory).await,
        "policy-violation"
    );
    ts.stop().await;
}

/// A graceful stop waits for WebSocket connections as for TCP ones: when it returns, a
/// WebSocket session has ended and its connection is closed, even for a client that does
/// not answer the end of its stream.
#[tokio::test]
async fn shutdown_waits_for_websocket_connections_to_end() {
    use tokio::io::AsyncReadExt;
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    let mut web = Ws::login(&ts, "alice", "web").await;
    web.send("<presence xmlns='jabber:client'/>").await;
    web.recv_until(|e| e.name == "presence").await;
    ts.stop().await;
    // Read the raw socket (the library would answer the server's Close): what the server
    // sent is all there, then the end of the connection.
    let io = web.ws.get_mut();
    let closed = tokio::time::timeout(Duration::from_millis(500), async {
        let mut buf = [0u8; 4096];
        while matches!(io.read(&mut buf).await, Ok(n) if n > 0) {}
    })
    .await;
    assert!(
        closed.is_ok(),
        "the WebSocket connection was still open after the graceful stop"
    );
}
