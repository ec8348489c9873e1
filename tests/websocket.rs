//! XMPP over WebSocket (RFC 7395) with a real WebSocket client library (tokio-tungstenite),
//! against the real server, PostgreSQL and Redis, with scaled-down liveness timings.

mod common;

use std::time::{Duration, Instant};

use base64::Engine as _;
use common::*;
use futures_util::{SinkExt, StreamExt};
use presenced::xml::{parse_element, Element};
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
        let c = &mut self;
        let features = c.open(&ts.domain).await;
        // RFC 7395 §3.6: TLS is the WebSocket's; STARTTLS is not offered.
        assert!(features
            .get_child("starttls", presenced::xml::NS_TLS)
            .is_none());
        assert!(features
            .get_child("mechanisms", presenced::xml::NS_SASL)
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
            .get_child("bind", presenced::xml::NS_BIND)
            .is_some());
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
        m.get_child("body", presenced::xml::NS_CLIENT)
            .map(|b| b.text_content()),
        Some("hi".into())
    );
    // Stay alive across several heartbeat intervals (the library answers the server's Pings
    // while it reads); bob, answering his own pings, must see no unavailable meanwhile.
    let alive_for = Duration::from_secs_f64(l.ttl * 1.5);
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
            Duration::from_secs_f64(l.ttl + l.sweep_interval + 1.0),
        )
        .await
        .expect("dead WebSocket client announced");
    let after = silent.elapsed().as_secs_f64();
    eprintln!("measured: WebSocket client announced {after:.3}s after its last Pong");
    assert!(got.get_attr("from") == Some(alice.jid.as_str()));
    assert!(after >= l.ttl - l.heartbeat_interval, "{after}");
    assert!(after <= l.ttl + l.sweep_interval + 0.3, "{after}");
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
        Duration::from_secs_f64(l.grace + 2.0),
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

#[tokio::test]
async fn host_meta_advertises_the_websocket_endpoint() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
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
        let mut s = TcpStream::connect(ts.http_addr()).await.unwrap();
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: chat.example\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut body = String::new();
        tokio::time::timeout(WAIT, s.read_to_string(&mut body))
            .await
            .unwrap()
            .unwrap();
        assert!(body.starts_with("HTTP/1.1 200"), "{body}");
        assert!(body.contains(needle), "{body}");
        assert!(body.contains("ws://chat.example/xmpp-websocket"), "{body}");
    }
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
        got.get_child("body", presenced::xml::NS_CLIENT)
            .map(|b| b.text_content()),
        Some(marker),
        "{got}"
    );
}

/// Reads until the stream error and returns its condition; then `<close/>` must follow.
async fn stream_error_then_close(c: &mut Ws) -> String {
    let err = c
        .recv_until(|e| e.is("error", presenced::xml::NS_STREAM))
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
        got.get_child("body", presenced::xml::NS_CLIENT)
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
