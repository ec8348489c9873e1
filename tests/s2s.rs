//! Federation: two instances of the server, each with its own domain on its own
//! loopback address, joined by static routes, authenticating each other with dialback or,
//! given certificates from a test CA, with SASL EXTERNAL (XEP-0178).

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use presenced::protocol::xml::reader::{ReaderLimits, StreamEvent, StreamReader};
use presenced::protocol::xml::{Element, NS_CLIENT, NS_SASL};
use presenced::transport::s2s::dialback::Secret;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncWriteExt, ReadHalf, WriteHalf};

/// Two federated servers: `a` on 127.0.0.2, `b` on 127.0.0.3.
struct Pair {
    a: TestServer,
    b: TestServer,
    /// Everything needed to start `b` again on the same address (link restored).
    b_domain: String,
    b_port: u16,
    a_domain: String,
    a_port: u16,
}

const SECRET_A: &str = "dialback-secret-a";
const SECRET_B: &str = "dialback-secret-b";

async fn start_b(a_domain: &str, a_port: u16, b_domain: &str, b_port: u16) -> TestServer {
    let a_addr = format!("127.0.0.2:{a_port}");
    TestServer::start_with_domain(b_domain, |c| {
        s2s_config(c, "127.0.0.3", b_port, SECRET_B, a_domain, a_addr)
    })
    .await
}

async fn pair() -> Pair {
    pair_with(|_, _, _| {}).await
}

/// Two federated servers; `tweak(config, own domain, peer domain)` adjusts each config.
async fn pair_with(tweak: impl Fn(&mut presenced::config::Config, &str, &str)) -> Pair {
    let a_domain = format!("a{}.example", unique());
    let b_domain = format!("b{}.example", unique());
    let a_port = listen_port("127.0.0.2");
    let b_port = listen_port("127.0.0.3");
    let b_addr = format!("127.0.0.3:{b_port}");
    let a_addr = format!("127.0.0.2:{a_port}");
    let a = TestServer::start_with_domain(&a_domain, |c| {
        s2s_config(c, "127.0.0.2", a_port, SECRET_A, &b_domain, b_addr);
        tweak(c, &a_domain, &b_domain);
    })
    .await;
    let b = TestServer::start_with_domain(&b_domain, |c| {
        s2s_config(c, "127.0.0.3", b_port, SECRET_B, &a_domain, a_addr);
        tweak(c, &b_domain, &a_domain);
    })
    .await;
    Pair {
        a,
        b,
        b_domain,
        b_port,
        a_domain,
        a_port,
    }
}

/// `name` logged in on `server` with resource `res`, its initial presence echoed back: from
/// then on the resource takes messages to the bare JID (RFC 6121 §4.2.2, §8.5.2.1.1). A
/// message arriving earlier is kept offline instead (XEP-0160), which a test expecting it
/// live would wait for in vain and a test expecting it refused would pass for the wrong
/// reason.
async fn available(server: &TestServer, name: &str, res: &str) -> Client {
    let mut c = server.login(name, res).await;
    c.presence(None, None).await;
    let me = format!("{}/{res}", server.jid(name));
    c.expect(|e| is_presence(e, &me, None)).await;
    c
}

/// alice@a and bob@b, both online and available, subscribed to each other.
async fn mutual(p: &Pair) -> (Client, Client) {
    p.a.user("alice").await;
    p.b.user("bob").await;
    let alice_jid = p.a.jid("alice");
    let bob_jid = p.b.jid("bob");
    let mut alice = available(&p.a, "alice", "home").await;
    let mut bob = available(&p.b, "bob", "work").await;

    // alice asks, bob approves: alice sees bob; then the other way round.
    subscribe_mutually(&mut alice, &alice_jid, &mut bob, &bob_jid).await;
    (alice, bob)
}

#[tokio::test]
async fn mutual_subscription_across_domains_shows_presence_on_login_and_logout() {
    let p = pair().await;
    let (mut alice, bob) = mutual(&p).await;
    let bob_jid = p.b.jid("bob");
    let alice_jid = p.a.jid("alice");

    // Both rosters say both, as stored on each server.
    let a_item =
        p.a.shared()
            .store
            .roster_item(&alice_jid, &bob_jid)
            .await
            .unwrap();
    assert_eq!(a_item.map(|i| i.subscription.as_str()), Some("both"));
    let b_item =
        p.b.shared()
            .store
            .roster_item(&bob_jid, &alice_jid)
            .await
            .unwrap();
    assert_eq!(b_item.map(|i| i.subscription.as_str()), Some("both"));

    // Logout on b is seen on a.
    bob.close().await;
    alice
        .expect(|e| is_presence(e, &bob_jid, Some("unavailable")))
        .await;

    // Login on b is seen on a, and bob learns alice's presence by probing across.
    let mut bob = p.b.login("bob", "phone").await;
    bob.presence(None, None).await;
    let seen = alice.expect(|e| is_presence(e, &bob_jid, None)).await;
    assert_eq!(
        seen.get_attr("from"),
        Some(format!("{bob_jid}/phone").as_str())
    );
    let probed = bob.expect(|e| is_presence(e, &alice_jid, None)).await;
    assert_eq!(
        probed.get_attr("from"),
        Some(format!("{alice_jid}/home").as_str()),
        "the probe answer carries alice's full JID"
    );
    // A presence change crosses with its payload in the client namespace.
    bob.send(
        &Element::new("presence", NS_CLIENT)
            .child(Element::new("show", NS_CLIENT).text("away"))
            .child(Element::new("status", NS_CLIENT).text("lunch")),
    )
    .await;
    let away = alice
        .expect(|e| is_presence(e, &bob_jid, None) && e.get_child("show", NS_CLIENT).is_some())
        .await;
    assert_eq!(
        away.get_child("show", NS_CLIENT).map(|s| s.text_content()),
        Some("away".to_owned()),
        "{away}"
    );
    // Messages cross too, with the sender's full JID.
    let msg = Element::new("message", NS_CLIENT)
        .attr("to", alice_jid.clone())
        .attr("type", "chat")
        .child(Element::new("body", NS_CLIENT).text("hello across"));
    bob.send(&msg).await;
    let got = alice.expect(|e| e.name == "message").await;
    assert_eq!(
        got.get_attr("from"),
        Some(format!("{bob_jid}/phone").as_str())
    );
    p.a.stop().await;
    p.b.stop().await;
}

#[tokio::test]
async fn probe_from_a_non_subscriber_gets_no_answer() {
    let p = pair().await;
    p.a.user("carol").await;
    p.a.user("erin").await;
    p.b.user("dave").await;
    let carol_jid = p.a.jid("carol");
    let erin_jid = p.a.jid("erin");
    let dave_jid = p.b.jid("dave");
    let mut dave = p.b.login("dave", "r").await;
    dave.presence(None, None).await;
    dave.expect(|e| is_presence(e, &dave_jid, None)).await;
    // erin@a is an approved subscriber of dave: the witness that dave's presence does cross
    // the link from b to a, so carol's silence below means something.
    let mut erin = p.a.login("erin", "r").await;
    erin.presence(None, None).await;
    erin.expect(|e| is_presence(e, &erin_jid, None)).await;
    subscribe_approved(&mut erin, &erin_jid, &mut dave, &dave_jid).await;
    // carol asks; dave does not answer, so carol has only a pending request.
    let mut carol = p.a.login("carol", "r").await;
    carol.presence(None, None).await;
    carol.send(&presence_to("subscribe", &dave_jid)).await;
    dave.expect(|e| is_presence(e, &carol_jid, Some("subscribe")))
        .await;
    // RFC 6121 §4.3.2: an explicit probe from a non-subscriber is not answered with presence.
    carol.send(&presence_to("probe", &dave_jid)).await;
    // A new resource's login probes nobody carol is not subscribed to.
    let mut carol2 = p.a.login("carol", "r2").await;
    carol2.presence(None, None).await;
    // dave's presence change reaches the subscriber, not carol.
    let witness = Element::new("presence", NS_CLIENT)
        .child(Element::new("status", NS_CLIENT).text("witness"));
    dave.send(&witness).await;
    erin.expect(|e| {
        is_presence(e, &dave_jid, None)
            && e.get_child("status", NS_CLIENT)
                .is_some_and(|s| s.text_content() == "witness")
    })
    .await;
    // Barrier: a message dave sends after everything above crosses the same b→a stream, so
    // any presence to carol would already be in her backlog when it arrives.
    let barrier = Element::new("message", NS_CLIENT)
        .attr("to", carol_jid.clone())
        .attr("type", "chat")
        .child(Element::new("body", NS_CLIENT).text("barrier"));
    dave.send(&barrier).await;
    for c in [&mut carol, &mut carol2] {
        c.expect(|e| {
            e.name == "message" && e.get_attr("from").is_some_and(|f| f.starts_with(&dave_jid))
        })
        .await;
        c.expect_none(
            |e| is_presence(e, &dave_jid, None),
            Duration::from_millis(500),
        )
        .await;
    }
    p.a.stop().await;
    p.b.stop().await;
}

#[tokio::test]
async fn message_to_a_domain_without_route_bounces_remote_server_not_found() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("erin").await;
    let mut erin = ts.login("erin", "r").await;
    let msg = Element::new("message", NS_CLIENT)
        .attr("to", "nobody@unrouted.example")
        .attr("id", "m1")
        .child(Element::new("body", NS_CLIENT).text("x"));
    erin.send(&msg).await;
    let err = erin
        .expect(|e| e.name == "message" && e.get_attr("type") == Some("error"))
        .await;
    assert_eq!(stanza_error(&err), "remote-server-not-found");
    ts.stop().await;
}

/// A raw server-to-server client that plays the originating server by hand.
struct RawS2s {
    reader: StreamReader<ReadHalf<Box<dyn Io>>>,
    writer: WriteHalf<Box<dyn Io>>,
    stream_id: String,
    /// The last stream features received.
    features: Option<Element>,
}

impl RawS2s {
    /// Connects to `to_domain` at `addr` claiming to be `from_domain`, STARTTLS (pinning
    /// the target's certificate), and returns with the secured stream opened.
    async fn connect(addr: SocketAddr, target: &TestServer, from_domain: &str) -> RawS2s {
        RawS2s::connect_with_cert(addr, target, from_domain, None).await
    }

    /// Like [`RawS2s::connect`], presenting `identity` as the TLS client certificate.
    async fn connect_with_cert(
        addr: SocketAddr,
        target: &TestServer,
        from_domain: &str,
        identity: Option<Identity>,
    ) -> RawS2s {
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let mut raw = RawS2s::over(Box::new(tcp));
        raw.open(from_domain, &target.domain).await;
        raw.send("<starttls xmlns='urn:ietf:params:xml:ns:xmpp-tls'/>")
            .await;
        let proceed = raw.next_element().await.expect("proceed");
        assert_eq!(proceed.name, "proceed");
        let RawS2s { reader, writer, .. } = raw;
        let io = reader.into_inner().unsplit(writer);
        let tls_config = match identity {
            None => tls_client(&target.cert),
            Some((chain, key)) => tls_client_with_cert(&target.cert, chain, key),
        };
        let connector = tokio_rustls::TlsConnector::from(tls_config);
        let name = ServerName::try_from(target.domain.clone()).unwrap();
        let tls = connector.connect(name, io).await.expect("TLS");
        let mut raw = RawS2s::over(Box::new(tls));
        raw.open(from_domain, &target.domain).await;
        raw
    }

    /// Direct TLS (XEP-0368) to `addr`, presenting `identity`, then the stream header.
    async fn connect_direct(
        addr: SocketAddr,
        target: &TestServer,
        from_domain: &str,
        identity: Identity,
    ) -> RawS2s {
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let connector = tokio_rustls::TlsConnector::from(tls_client_with_cert(
            &target.cert,
            identity.0,
            identity.1,
        ));
        let name = ServerName::try_from(target.domain.clone()).unwrap();
        let tls = connector.connect(name, tcp).await.expect("TLS");
        let mut raw = RawS2s::over(Box::new(tls));
        raw.open(from_domain, &target.domain).await;
        raw
    }

    fn over(io: Box<dyn Io>) -> RawS2s {
        let (r, w) = tokio::io::split(io);
        RawS2s {
            reader: StreamReader::new(r, ReaderLimits::default()),
            writer: w,
            stream_id: String::new(),
            features: None,
        }
    }

    async fn send(&mut self, s: &str) {
        let _ = self.writer.write_all(s.as_bytes()).await;
        let _ = self.writer.flush().await;
    }

    async fn open(&mut self, from: &str, to: &str) {
        self.send(&format!(
            "<?xml version='1.0'?><stream:stream xmlns='jabber:server' \
             xmlns:stream='http://etherx.jabber.org/streams' xmlns:db='jabber:server:dialback' \
             from='{from}' to='{to}' version='1.0'>"
        ))
        .await;
        loop {
            match tokio::time::timeout(WAIT, self.reader.next()).await {
                Ok(Ok(StreamEvent::Open(h))) => {
                    self.stream_id = h.get_attr("id").unwrap_or_default().to_owned()
                }
                Ok(Ok(StreamEvent::Stanza(el))) if el.name == "features" => {
                    self.features = Some(el);
                    return;
                }
                Ok(Ok(_)) => {}
                other => panic!("no stream features: {other:?}"),
            }
        }
    }

    /// The next element, or the stream error condition / "closed".
    async fn next_element(&mut self) -> Result<Element, String> {
        loop {
            match tokio::time::timeout(WAIT, self.reader.next()).await {
                Ok(Ok(StreamEvent::Stanza(el))) if el.name == "error" => {
                    return Err(condition(&el))
                }
                Ok(Ok(StreamEvent::Stanza(el))) => return Ok(el),
                Ok(Ok(StreamEvent::Whitespace)) => {}
                Ok(Ok(_)) | Ok(Err(_)) => return Err("closed".into()),
                Err(_) => return Err("timeout".into()),
            }
        }
    }

    /// Sends `<auth mechanism='EXTERNAL'>` with `response` (`=` or base64 of an
    /// authorization identity, XEP-0178 §3) and returns the answer.
    async fn external(&mut self, response: &str) -> Element {
        self.send(&format!(
            "<auth xmlns='{NS_SASL}' mechanism='EXTERNAL'>{response}</auth>"
        ))
        .await;
        self.next_element().await.expect("answer to auth")
    }

    /// After `<success/>` the stream restarts (RFC 6120 §6.4.6) as `from` → `to`.
    async fn restart(mut self, from: &str, to: &str) -> RawS2s {
        self.reader = StreamReader::new(self.reader.into_inner(), ReaderLimits::default());
        self.open(from, to).await;
        self
    }

    /// Sends a dialback key for `from` → `to` and returns the result's type.
    async fn dialback(&mut self, from: &str, to: &str, key: &str) -> String {
        self.send(&format!(
            "<db:result from='{from}' to='{to}'>{key}</db:result>"
        ))
        .await;
        let r = self.next_element().await.expect("db:result answer");
        assert_eq!(r.name, "result", "{r}");
        r.get_attr("type").unwrap_or_default().to_owned()
    }
}

#[tokio::test]
async fn spoofed_from_domain_over_an_authenticated_stream_is_rejected() {
    let p = pair().await;
    p.a.user("alice").await;
    let alice_jid = p.a.jid("alice");
    let mut alice = available(&p.a, "alice", "r").await;

    // Authenticate as b for real: the key is b's (the test knows b's secret), a checks it
    // with b's authoritative server over its own connection.
    let mut raw = RawS2s::connect(p.a.s2s_addr(), &p.a, &p.b_domain).await;
    let key = Secret::new(SECRET_B).key(&p.a_domain, &p.b_domain, &raw.stream_id);
    assert_eq!(raw.dialback(&p.b_domain, &p.a_domain, &key).await, "valid");

    // A stanza from the authenticated domain is delivered...
    raw.send(&format!(
        "<message from='bob@{}/x' to='{alice_jid}' type='chat'><body>legit</body></message>",
        p.b_domain
    ))
    .await;
    let got = alice.expect(|e| e.name == "message").await;
    assert_eq!(
        got.get_attr("from"),
        Some(format!("bob@{}/x", p.b_domain).as_str())
    );

    // ...one from any other domain ends the stream with invalid-from (RFC 6120 §4.9.3.9).
    raw.send(&format!(
        "<message from='mallory@evil.example/x' to='{alice_jid}' type='chat'><body>spoof</body></message>"
    ))
    .await;
    assert_eq!(
        raw.next_element().await.err().as_deref(),
        Some("invalid-from")
    );
    // The spoofed stanza was handled before the stream error was written; anything it put
    // in alice's queue is in her backlog after this barrier.
    barrier(&p.a, &mut alice).await;
    alice
        .expect_none(|e| e.name == "message", Duration::from_millis(100))
        .await;
    p.a.stop().await;
    p.b.stop().await;
}

/// Server streams get the reader's rules too: before dialback the small stanza cost limit
/// (policy-violation), after it the larger one; a forbidden character (XML 1.0 §2.2) is
/// not-well-formed and is not relayed to the local user.
#[tokio::test]
async fn s2s_stanza_cost_limit_grows_with_dialback_and_forbidden_characters_are_not_well_formed() {
    let p = pair_with(|c, _, _| c.limits.max_stanza_nodes_unauthenticated = 200).await;
    p.a.user("alice").await;
    p.a.user("carol").await;
    let alice_jid = p.a.jid("alice");
    let mut alice = available(&p.a, "alice", "r").await;
    let mut carol = p.a.login("carol", "r").await;
    let many = |body: &str| {
        format!(
            "<message from='bob@{}/x' to='{alice_jid}' type='chat'><body>{body}</body>\
             <x xmlns='urn:example:x'>{}</x></message>",
            p.b_domain,
            "<a/>".repeat(1_000)
        )
    };

    // Unauthenticated: 1,000 elements end the stream before the stanza is even complete.
    let mut raw = RawS2s::connect(p.a.s2s_addr(), &p.a, &p.b_domain).await;
    let unfinished = many("early");
    raw.send(&unfinished[..unfinished.len() - "</x></message>".len()])
        .await;
    assert_eq!(
        raw.next_element().await.err().as_deref(),
        Some("policy-violation")
    );

    // After dialback the same stanza is delivered.
    let mut raw = RawS2s::connect(p.a.s2s_addr(), &p.a, &p.b_domain).await;
    let key = Secret::new(SECRET_B).key(&p.a_domain, &p.b_domain, &raw.stream_id);
    assert_eq!(raw.dialback(&p.b_domain, &p.a_domain, &key).await, "valid");
    raw.send(&many("late")).await;
    let got = alice.expect(|e| e.name == "message").await;
    assert_eq!(
        got.get_child("body", NS_CLIENT).map(|b| b.text_content()),
        Some("late".into())
    );

    // A control character: not-well-formed for the peer server, nothing for alice.
    raw.send(&format!(
        "<message from='bob@{}/x' to='{alice_jid}' type='chat'><body>a\u{1}b</body></message>",
        p.b_domain
    ))
    .await;
    assert_eq!(
        raw.next_element().await.err().as_deref(),
        Some("not-well-formed")
    );
    // Positive control and barrier: carol's message after that is alice's next message.
    carol
        .send(
            &Element::new("message", NS_CLIENT)
                .attr("to", alice_jid.as_str())
                .attr("type", "chat")
                .child(Element::new("body", NS_CLIENT).text("marker")),
        )
        .await;
    let got = alice.expect(|e| e.name == "message").await;
    assert_eq!(
        got.get_child("body", NS_CLIENT).map(|b| b.text_content()),
        Some("marker".into()),
        "{got}"
    );
    p.a.stop().await;
    p.b.stop().await;
}

#[tokio::test]
async fn dialback_key_that_does_not_verify_is_refused() {
    let p = pair().await;
    p.a.user("alice").await;
    let alice_jid = p.a.jid("alice");
    let mut alice = available(&p.a, "alice", "r").await;

    let mut raw = RawS2s::connect(p.a.s2s_addr(), &p.a, &p.b_domain).await;
    // A key made with the wrong secret: b's authoritative server says invalid.
    let forged = Secret::new("not-b's-secret").key(&p.a_domain, &p.b_domain, &raw.stream_id);
    assert_eq!(
        raw.dialback(&p.b_domain, &p.a_domain, &forged).await,
        "invalid"
    );
    raw.send(&format!(
        "<message from='bob@{}/x' to='{alice_jid}' type='chat'><body>forged</body></message>",
        p.b_domain
    ))
    .await;
    let end = raw.next_element().await;
    assert!(
        end.is_err(),
        "stream must end after an invalid key: {end:?}"
    );
    // The forged stanza was handled before the stream ended; barrier on alice's queue.
    barrier(&p.a, &mut alice).await;
    alice
        .expect_none(|e| e.name == "message", Duration::from_millis(100))
        .await;
    p.a.stop().await;
    p.b.stop().await;
}

#[tokio::test]
async fn cut_federation_link_marks_contacts_unavailable_and_restored_link_shows_them_again() {
    let p = pair().await;
    let (mut alice, _bob) = mutual(&p).await;
    let bob_jid = p.b.jid("bob");

    // b dies without closing anything: its streams just vanish.
    p.b.shared().s2s.sever();
    let Pair {
        a,
        b,
        b_domain,
        b_port,
        a_domain,
        a_port,
    } = p;
    b.stop().await;

    // After the grace period alice sees bob unavailable, generated by a and marked so.
    let stale = alice
        .expect(|e| is_presence(e, &bob_jid, Some("unavailable")))
        .await;
    assert!(
        stale
            .get_child("link-lost", presenced::transport::s2s::NS_STALE)
            .is_some(),
        "generated unavailable is marked: {stale}"
    );

    // b comes back on the same address; bob logs in again and alice sees him.
    let b = start_b(&a_domain, a_port, &b_domain, b_port).await;
    let mut bob = b.login("bob", "back").await;
    bob.presence(None, None).await;
    let back = alice.expect(|e| is_presence(e, &bob_jid, None)).await;
    assert_eq!(
        back.get_attr("from"),
        Some(format!("{bob_jid}/back").as_str())
    );
    a.stop().await;
    b.stop().await;
}

/// A certificate chain and its key.
type Identity = (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

/// rustls client config trusting `roots_pem`, presenting `chain` as client certificate.
fn tls_client_with_cert(
    roots_pem: &PathBuf,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(roots_pem).expect("roots file") {
        roots.add(c.expect("cert")).expect("add root");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Arc::new(
        rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .expect("client cert"),
    )
}

/// A throw-away certificate authority, generated per test, and the certificates it issues.
struct Pki {
    dir: PathBuf,
    ca: rcgen::Certificate,
    ca_key: rcgen::KeyPair,
    /// The CA certificate (PEM): `[s2s] ca_file`, and what test clients pin.
    ca_pem: PathBuf,
}

impl Pki {
    fn new() -> Pki {
        let dir = std::env::temp_dir().join(format!("presenced-pki-{}", unique()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "presenced test CA");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
        ];
        let ca = params.self_signed(&ca_key).unwrap();
        let ca_pem = dir.join("ca.pem");
        std::fs::write(&ca_pem, ca.pem()).unwrap();
        Pki {
            dir,
            ca,
            ca_key,
            ca_pem,
        }
    }

    /// A certificate for `names` signed by the CA, usable as TLS server and client.
    fn issue(&self, names: &[&str]) -> (rcgen::Certificate, rcgen::KeyPair) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params =
            rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        params.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params.signed_by(&key, &self.ca, &self.ca_key).unwrap();
        (cert, key)
    }

    /// [`Pki::issue`] as rustls types, for a raw client.
    fn identity(&self, names: &[&str]) -> Identity {
        let (cert, key) = self.issue(names);
        (
            vec![cert.der().clone()],
            PrivateKeyDer::from_pem_slice(key.serialize_pem().as_bytes()).unwrap(),
        )
    }

    /// Gives `c` (serving `domain`) a CA-issued certificate and trusts the CA for peers.
    fn install(&self, c: &mut presenced::config::Config, domain: &str) {
        let (cert, key) = self.issue(&[domain]);
        let cert_path = self.dir.join(format!("{domain}.pem"));
        let key_path = self.dir.join(format!("{domain}.key"));
        std::fs::write(&cert_path, cert.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        c.tls.cert = Some(cert_path);
        c.tls.key = Some(key_path);
        c.s2s.ca_file = Some(self.ca_pem.clone());
    }
}

#[tokio::test]
async fn sasl_external_authenticates_both_directions_and_dialback_is_not_used() {
    let pki = Pki::new();
    // Dialback stays allowed: EXTERNAL must win because it is preferred, not forced.
    let mut p = pair_with(|c, own, _| pki.install(c, own)).await;
    p.a.cert = pki.ca_pem.clone();
    p.b.cert = pki.ca_pem.clone();
    let (mut alice, mut bob) = mutual(&p).await;
    let msg = Element::new("message", NS_CLIENT)
        .attr("to", p.a.jid("alice"))
        .attr("type", "chat")
        .child(Element::new("body", NS_CLIENT).text("signed by a CA"));
    bob.send(&msg).await;
    alice.expect(|e| e.name == "message").await;
    for (name, s) in [("a", &p.a), ("b", &p.b)] {
        let n = s.shared().s2s.auth_counts();
        assert!(
            n.external_in >= 1 && n.external_out >= 1,
            "{name}: EXTERNAL used both ways: {n:?}"
        );
        assert_eq!(
            (n.dialback_in, n.dialback_out),
            (0, 0),
            "{name}: no dialback: {n:?}"
        );
    }
    // The same figures at /metrics, one sample per method and direction.
    let m = p.a.scrape_metrics().await;
    let n = p.a.shared().s2s.auth_counts();
    for (method, direction, v) in [
        ("external", "in", n.external_in),
        ("external", "out", n.external_out),
        ("dialback", "in", 0),
        ("dialback", "out", 0),
    ] {
        let k = format!(
            "presenced_s2s_authenticated_total{{method=\"{method}\",direction=\"{direction}\"}}"
        );
        assert_eq!(m.get(&k), Some(&(v as f64)), "{k} in {m:?}");
    }
    drop(bob);
    p.a.stop().await;
    p.b.stop().await;
}

#[tokio::test]
async fn require_verified_cert_refuses_a_peer_without_a_verifiable_cert_and_bounces_both_ways() {
    let pki = Pki::new();
    // a has a CA certificate and demands one from b; b keeps its self-signed development
    // certificate but trusts the CA (so b verifies a, a cannot verify b).
    let mut p = pair_with(|c, own, peer| {
        if own.starts_with('a') {
            pki.install(c, own);
            c.s2s.domains.insert(
                peer.to_owned(),
                presenced::config::S2sPolicy {
                    require_verified_cert: true,
                    ..Default::default()
                },
            );
        } else {
            c.s2s.ca_file = Some(pki.ca_pem.clone());
        }
    })
    .await;
    p.a.cert = pki.ca_pem.clone();
    p.a.user("alice").await;
    p.b.user("bob").await;
    let mut alice = available(&p.a, "alice", "r").await;
    let mut bob = p.b.login("bob", "r").await;

    // a → b: b's certificate does not verify, so a never gets past TLS.
    let to_bob = Element::new("message", NS_CLIENT)
        .attr("to", p.b.jid("bob"))
        .attr("id", "m1")
        .child(Element::new("body", NS_CLIENT).text("x"));
    alice.send(&to_bob).await;
    let err = alice
        .expect(|e| e.name == "message" && e.get_attr("type") == Some("error"))
        .await;
    assert_eq!(stanza_error(&err), "remote-server-not-found", "{err}");
    assert!(
        err.to_string().contains("certificate"),
        "refused for the certificate: {err}"
    );

    // b → a: a offers neither EXTERNAL (b's certificate proves nothing) nor dialback, and
    // refuses b's dialback key; b bounces.
    let to_alice = Element::new("message", NS_CLIENT)
        .attr("to", p.a.jid("alice"))
        .attr("id", "m2")
        .child(Element::new("body", NS_CLIENT).text("y"));
    bob.send(&to_alice).await;
    let err = bob
        .expect(|e| e.name == "message" && e.get_attr("type") == Some("error"))
        .await;
    assert_eq!(stanza_error(&err), "remote-server-not-found", "{err}");
    assert!(
        err.to_string().contains("dialback result error"),
        "refused at dialback: {err}"
    );
    // b has given up (the bounce above); whatever a routed to alice before is in her
    // backlog after this barrier.
    barrier(&p.a, &mut alice).await;
    alice
        .expect_none(
            |e| e.get_attr("type") != Some("error") && e.name == "message",
            Duration::from_millis(100),
        )
        .await;
    let n = p.a.shared().s2s.auth_counts();
    assert_eq!(
        n,
        presenced::transport::s2s::AuthCounts::default(),
        "a authenticated nothing: {n:?}"
    );
    p.a.stop().await;
    p.b.stop().await;
}

/// A pair where only a holds a certificate from `pki`'s CA (and `tweak_a` on top); test
/// clients of a pin that CA.
async fn pair_with_ca_cert_on_a(
    pki: &Pki,
    tweak_a: impl Fn(&mut presenced::config::Config),
) -> Pair {
    let mut p = pair_with(|c, own, _| {
        if own.starts_with('a') {
            pki.install(c, own);
            tweak_a(c);
        }
    })
    .await;
    p.a.cert = pki.ca_pem.clone();
    p
}

#[tokio::test]
async fn certificate_for_another_domain_is_not_accepted_for_external_and_dialback_still_works() {
    let pki = Pki::new();
    let p = pair_with_ca_cert_on_a(&pki, |_| {}).await;
    let (a_domain, b_domain) = (p.a_domain.clone(), p.b_domain.clone());

    // A CA-issued certificate, but for another name: no EXTERNAL offered, and asking for
    // it anyway fails with not-authorized (XEP-0178 §3).
    let wrong = pki.identity(&["wrong.example"]);
    let mut raw = RawS2s::connect_with_cert(p.a.s2s_addr(), &p.a, &b_domain, Some(wrong)).await;
    let features = raw.features.clone().expect("features");
    assert!(
        features.get_child("mechanisms", NS_SASL).is_none(),
        "EXTERNAL must not be offered: {features}"
    );
    let failure = raw.external("=").await;
    assert_eq!(failure.name, "failure", "{failure}");
    assert_eq!(condition(&failure), "not-authorized");
    // Dialback is allowed for b, so the same stream can still prove b that way.
    let key = Secret::new(SECRET_B).key(&a_domain, &b_domain, &raw.stream_id);
    assert_eq!(raw.dialback(&b_domain, &a_domain, &key).await, "valid");
    let n = p.a.shared().s2s.auth_counts();
    assert_eq!((n.external_in, n.dialback_in), (0, 1), "{n:?}");
    p.a.stop().await;
    p.b.stop().await;
}

#[tokio::test]
async fn external_with_a_proving_certificate_succeeds_only_for_its_own_authzid() {
    let pki = Pki::new();
    let p = pair_with_ca_cert_on_a(&pki, |_| {}).await;
    p.a.user("alice").await;
    let alice_jid = p.a.jid("alice");
    let mut alice = available(&p.a, "alice", "r").await;
    let b_domain = p.b_domain.clone();
    let good = pki.identity(&[&b_domain]);
    let mut raw = RawS2s::connect_with_cert(p.a.s2s_addr(), &p.a, &b_domain, Some(good)).await;
    let features = raw.features.clone().expect("features");
    let mechs = features
        .get_child("mechanisms", NS_SASL)
        .map(|m| m.elements().map(|e| e.text_content()).collect::<Vec<_>>());
    assert_eq!(mechs, Some(vec!["EXTERNAL".to_owned()]), "{features}");

    // Asking to be authorized as another domain: invalid-authzid (RFC 6120 §6.5.6).
    use base64::Engine;
    let other = base64::engine::general_purpose::STANDARD.encode("evil.example");
    let failure = raw.external(&other).await;
    assert_eq!(condition(&failure), "invalid-authzid", "{failure}");

    // Its own domain, base64-encoded (XEP-0178 §3 allows either form): success, restart.
    let own = base64::engine::general_purpose::STANDARD.encode(&b_domain);
    let success = raw.external(&own).await;
    assert_eq!(success.name, "success", "{success}");
    let a_domain = p.a_domain.clone();
    let mut raw = raw.restart(&b_domain, &a_domain).await;
    // The authenticated stream carries b's stanzas, with no dialback at all.
    raw.send(&format!(
        "<message from='bob@{b_domain}/x' to='{alice_jid}' type='chat'><body>by cert</body></message>"
    ))
    .await;
    let got = alice.expect(|e| e.name == "message").await;
    assert_eq!(
        got.get_attr("from"),
        Some(format!("bob@{b_domain}/x").as_str())
    );
    let n = p.a.shared().s2s.auth_counts();
    assert_eq!((n.external_in, n.dialback_in), (1, 0), "{n:?}");
    p.a.stop().await;
    p.b.stop().await;
}

#[tokio::test]
async fn external_works_over_the_direct_tls_listener_too() {
    let pki = Pki::new();
    let p = pair_with_ca_cert_on_a(&pki, |c| c.s2s.direct_tls = true).await;
    p.a.user("alice").await;
    let alice_jid = p.a.jid("alice");
    let mut alice = available(&p.a, "alice", "r").await;
    let (a_domain, b_domain) = (p.a_domain.clone(), p.b_domain.clone());
    let mut raw = RawS2s::connect_direct(
        p.a.s2s_direct_addr(),
        &p.a,
        &b_domain,
        pki.identity(&[&b_domain]),
    )
    .await;
    let features = raw.features.clone().expect("features");
    assert!(
        features.get_child("mechanisms", NS_SASL).is_some(),
        "{features}"
    );
    let success = raw.external("=").await;
    assert_eq!(success.name, "success", "{success}");
    let mut raw = raw.restart(&b_domain, &a_domain).await;
    raw.send(&format!(
        "<message from='bob@{b_domain}/x' to='{alice_jid}' type='chat'><body>direct</body></message>"
    ))
    .await;
    let got = alice.expect(|e| e.name == "message").await;
    assert_eq!(
        got.get_attr("from"),
        Some(format!("bob@{b_domain}/x").as_str())
    );
    assert_eq!(p.a.shared().s2s.auth_counts().external_in, 1);
    p.a.stop().await;
    p.b.stop().await;
}

// ---------------------------------------------------------------------------------------
// Privacy of stanzas arriving over federation: the same delivery rules as local ones.

const NS_INVISIBLE: &str = "urn:xmpp:invisible:0";

fn chat(to: &str, body: &str) -> Element {
    Element::new("message", NS_CLIENT)
        .attr("to", to)
        .attr("type", "chat")
        .attr("id", unique())
        .child(Element::new("body", NS_CLIENT).text(body))
}

fn disco_iq(to: &str, id: &str) -> Element {
    Element::new("iq", NS_CLIENT)
        .attr("to", to)
        .attr("type", "get")
        .attr("id", id)
        .child(Element::new(
            "query",
            "http://jabber.org/protocol/disco#info",
        ))
}

fn has_body(e: &Element, body: &str) -> bool {
    e.name == "message"
        && e.get_child("body", NS_CLIENT)
            .is_some_and(|b| b.text_content() == body)
}

/// carol@b, online, with no relation to anyone: her stanzas travel the same b→a stream as
/// bob's, after them, so one of hers arriving at alice proves bob's were processed.
async fn carol_on_b(p: &Pair) -> Client {
    p.b.user("carol").await;
    available(&p.b, "carol", "r").await
}

#[tokio::test]
async fn blocked_remote_user_can_neither_message_nor_iq_the_blocker() {
    let p = pair().await;
    let (mut alice, mut bob) = mutual(&p).await;
    let mut carol = carol_on_b(&p).await;
    let alice_jid = p.a.jid("alice");
    let alice_full = format!("{alice_jid}/home");
    let bob_jid = p.b.jid("bob");
    // Control: before the block, bob's message and iq reach alice.
    bob.send(&chat(&alice_jid, "before")).await;
    alice.expect(|e| has_body(e, "before")).await;
    bob.send(&disco_iq(&alice_full, "q0")).await;
    alice
        .expect(|e| e.name == "iq" && e.get_attr("id") == Some("q0"))
        .await;

    p.a.shared()
        .store
        .block(&alice_jid, std::slice::from_ref(&bob_jid))
        .await
        .unwrap();
    bob.send(&chat(&alice_jid, "to bare")).await;
    bob.send(&chat(&alice_full, "to full")).await;
    bob.send(&disco_iq(&alice_full, "q1")).await;
    // XEP-0191 §3.3: the iq is answered as by an offline resource.
    let err = bob
        .expect(|e| e.name == "iq" && e.get_attr("id") == Some("q1"))
        .await;
    assert_eq!(err.get_attr("type"), Some("error"), "{err}");
    assert_eq!(stanza_error(&err), "service-unavailable", "{err}");
    // Barrier: carol's message follows bob's stanzas on the same stream.
    carol.send(&chat(&alice_jid, "barrier")).await;
    alice.expect(|e| has_body(e, "barrier")).await;
    let leaked: Vec<_> = alice
        .backlog
        .iter()
        .filter(|e| e.get_attr("from").is_some_and(|f| f.starts_with(&bob_jid)))
        .filter(|e| e.name != "presence")
        .map(|e| e.to_xml())
        .collect();
    assert!(leaked.is_empty(), "blocked bob reached alice: {leaked:#?}");
    p.a.stop().await;
    p.b.stop().await;
}

#[tokio::test]
async fn remote_strangers_iq_to_a_full_jid_is_answered_as_offline() {
    let p = pair().await;
    let (mut alice, mut bob) = mutual(&p).await;
    let mut carol = carol_on_b(&p).await;
    let alice_jid = p.a.jid("alice");
    let alice_full = format!("{alice_jid}/home");
    // Control: a subscriber's iq reaches the resource it may see.
    bob.send(&disco_iq(&alice_full, "ok")).await;
    alice
        .expect(|e| e.name == "iq" && e.get_attr("id") == Some("ok"))
        .await;
    // carol has no subscription: the same answer as for a resource that does not exist.
    carol.send(&disco_iq(&alice_full, "s1")).await;
    let online = carol
        .expect(|e| e.name == "iq" && e.get_attr("id") == Some("s1"))
        .await;
    carol
        .send(&disco_iq(&format!("{alice_jid}/nosuch"), "s2"))
        .await;
    let offline = carol
        .expect(|e| e.name == "iq" && e.get_attr("id") == Some("s2"))
        .await;
    assert_eq!(stanza_error(&online), "service-unavailable", "{online}");
    assert_eq!(stanza_error(&offline), stanza_error(&online));
    // Barrier on the same stream, then nothing of carol's iq may have reached alice.
    carol.send(&chat(&alice_jid, "barrier")).await;
    alice.expect(|e| has_body(e, "barrier")).await;
    assert!(
        !alice.backlog.iter().any(|e| e.name == "iq"),
        "a stranger's iq reached alice: {:#?}",
        alice.backlog
    );
    p.a.stop().await;
    p.b.stop().await;
}

#[tokio::test]
async fn revoking_a_remote_subscriber_does_not_reveal_an_invisible_resource() {
    let p = pair().await;
    let (mut alice, mut bob) = mutual(&p).await;
    let alice_jid = p.a.jid("alice");
    let bob_jid = p.b.jid("bob");
    // A second resource of alice, invisible (XEP-0186) before its initial presence.
    let mut ghost = p.a.login("alice", "ghost").await;
    let r = ghost
        .iq("set", None, Element::new("invisible", NS_INVISIBLE))
        .await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    ghost.presence(None, None).await;
    ghost
        .expect(|e| is_presence(e, &format!("{alice_jid}/ghost"), None))
        .await;
    // alice revokes bob's subscription (RFC 6121 §3.2.2): her server withdraws the
    // presence bob was shown, from alice/home only, before the unsubscribed.
    alice.send(&presence_to("unsubscribed", &bob_jid)).await;
    bob.expect(|e| is_presence(e, &format!("{alice_jid}/home"), Some("unavailable")))
        .await;
    // Barrier: the unsubscribed follows the unavailable stanzas on the a→b stream.
    bob.expect(|e| is_presence(e, &alice_jid, Some("unsubscribed")))
        .await;
    assert!(
        !bob.backlog.iter().any(|e| e
            .get_attr("from")
            .is_some_and(|f| f == format!("{alice_jid}/ghost"))),
        "the invisible resource was revealed: {:#?}",
        bob.backlog
    );
    p.a.stop().await;
    p.b.stop().await;
}

/// Federation with a cluster: domain A is served by two nodes (on 127.0.0.2 and
/// 127.0.0.4, one database, one Redis prefix, one dialback secret); the remote server B
/// (127.0.0.3) knows only node 1's address, so every stream B opens lands there, while
/// node 2 opens its own streams to B. A user on node 2 and a federated contact on B see
/// each other's presence, probe answers and messages whichever node holds the link.
#[tokio::test]
async fn a_federated_contact_reaches_and_sees_a_user_on_either_node_of_a_cluster() {
    let a_domain = format!("a{}.example", unique());
    let b_domain = format!("b{}.example", unique());
    let (a1_port, a2_port, b_port) = (
        listen_port("127.0.0.2"),
        listen_port("127.0.0.4"),
        listen_port("127.0.0.3"),
    );
    let b_addr = format!("127.0.0.3:{b_port}");
    let node = |ip: &'static str, port: u16, id: &'static str| {
        let (b_domain, b_addr) = (b_domain.clone(), b_addr.clone());
        move |c: &mut presenced::config::Config| {
            s2s_config(c, ip, port, SECRET_A, &b_domain, b_addr);
            c.cluster.node_id = Some(format!("{id}-{}", unique()));
        }
    };
    let n1 = TestServer::start_with_domain(&a_domain, node("127.0.0.2", a1_port, "n1")).await;
    let n2 = TestServer::start_with_domain(&a_domain, node("127.0.0.4", a2_port, "n2")).await;
    let b = TestServer::start_with_domain(&b_domain, |c| {
        s2s_config(
            c,
            "127.0.0.3",
            b_port,
            SECRET_B,
            &a_domain,
            format!("127.0.0.2:{a1_port}"),
        )
    })
    .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while n1.shared().cluster.peers().is_empty() || n2.shared().cluster.peers().is_empty() {
        assert!(std::time::Instant::now() < deadline, "nodes did not meet");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    n1.user("alice").await;
    b.user("bob").await;
    let (alice_jid, bob_jid) = (n1.jid("alice"), b.jid("bob"));
    let alice_full = format!("{alice_jid}/two");
    // Alice is on node 2 only.
    let mut alice = n2.login("alice", "two").await;
    alice.presence(None, None).await;
    alice.expect(|e| is_presence(e, &alice_jid, None)).await;
    let mut bob = b.login("bob", "work").await;
    bob.presence(None, None).await;
    bob.expect(|e| is_presence(e, &bob_jid, None)).await;

    // Both ways of RFC 6121 §3.1: bob's request arrives at node 1 and reaches alice on
    // node 2; her approval and presence leave from node 2.
    subscribe_mutually(&mut bob, &bob_jid, &mut alice, &alice_jid).await;
    // Presence changes both ways.
    alice
        .send(
            &Element::new("presence", NS_CLIENT)
                .child(Element::new("status", NS_CLIENT).text("on node 2")),
        )
        .await;
    bob.expect(|e| is_presence(e, &alice_full, None) && e.to_xml().contains("on node 2"))
        .await;
    bob.send(
        &Element::new("presence", NS_CLIENT)
            .child(Element::new("status", NS_CLIENT).text("from b")),
    )
    .await;
    alice
        .expect(|e| is_presence(e, &bob_jid, None) && e.to_xml().contains("from b"))
        .await;
    // Messages and an iq from B to alice's full JID arrive at node 1 and reach node 2.
    bob.send(&chat(&alice_jid, "to bare")).await;
    alice.expect(|e| has_body(e, "to bare")).await;
    bob.send(&chat(&alice_full, "to full")).await;
    alice.expect(|e| has_body(e, "to full")).await;
    bob.send(&disco_iq(&alice_full, "fx1")).await;
    alice
        .expect(|e| e.name == "iq" && e.get_attr("id") == Some("fx1"))
        .await;
    // A new login of bob probes alice: node 1 answers from the directory.
    bob.close().await;
    alice
        .expect(|e| is_presence(e, &bob_jid, Some("unavailable")))
        .await;
    let mut bob = b.login("bob", "phone").await;
    bob.presence(None, None).await;
    let probed = bob
        .expect(|e| is_presence(e, &alice_full, None) && e.to_xml().contains("on node 2"))
        .await;
    assert_eq!(
        probed.get_attr("to").map(|t| t.starts_with(&bob_jid)),
        Some(true)
    );
    alice
        .expect(|e| is_presence(e, &format!("{bob_jid}/phone"), None))
        .await;
    // Alice moves to node 1: the same contact still sees her come and go.
    alice.presence(Some("unavailable"), None).await;
    bob.expect(|e| is_presence(e, &alice_full, Some("unavailable")))
        .await;
    let mut alice1 = n1.login("alice", "one").await;
    alice1.presence(None, None).await;
    bob.expect(|e| is_presence(e, &format!("{alice_jid}/one"), None))
        .await;
    b.stop().await;
    n1.stop().await;
    n2.stop().await;
}

/// RFC 7622 §3.2: a domainpart ending in the root dot is the same domain without it. A
/// remote server's `bob@b.example./x` is bob, matched against alice's roster item for
/// `bob@b.example` and shown to her without the dot; `alice@a.example.` is alice.
#[tokio::test]
async fn a_remote_from_with_a_root_dot_is_the_same_jid_without_it() {
    let p = pair().await;
    let (mut alice, _bob) = mutual(&p).await;
    let bob_jid = p.b.jid("bob");
    let alice_jid = p.a.jid("alice");

    let mut raw = RawS2s::connect(p.a.s2s_addr(), &p.a, &p.b_domain).await;
    let key = Secret::new(SECRET_B).key(&p.a_domain, &p.b_domain, &raw.stream_id);
    assert_eq!(raw.dialback(&p.b_domain, &p.a_domain, &key).await, "valid");

    // Presence to a bare JID reaches alice only because she is subscribed to the sender
    // (RFC 6121 §4.2.2): the dotted JID must match her item for bob@b.example.
    raw.send(&format!(
        "<presence from='{bob_jid}./dot' to='{alice_jid}'><status>dotted</status></presence>"
    ))
    .await;
    let seen = alice
        .expect(|e| e.name == "presence" && has_status(e, "dotted"))
        .await;
    assert_eq!(
        seen.get_attr("from"),
        Some(format!("{bob_jid}/dot").as_str())
    );

    raw.send(&format!(
        "<message from='{bob_jid}./dot' to='{alice_jid}.' type='chat'><body>dotted</body></message>"
    ))
    .await;
    let got = alice.expect(|e| has_body(e, "dotted")).await;
    assert_eq!(
        got.get_attr("from"),
        Some(format!("{bob_jid}/dot").as_str())
    );
    assert_eq!(got.get_attr("to"), Some(alice_jid.as_str()));
    p.a.stop().await;
    p.b.stop().await;
}

fn has_status(e: &Element, status: &str) -> bool {
    e.get_child("status", NS_CLIENT)
        .is_some_and(|s| s.text_content() == status)
}
