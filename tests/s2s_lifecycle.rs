//! Federation link lifecycle: idle close and reopen, reconnect back-off with
//! jitter, the bounded queue and its bounces (RFC 6120 §8.3.3.16/17), direct TLS server
//! streams (XEP-0368), and a silent client death seen across domains.
//!
//! Some tests federate two real instances on 127.0.0.2 / 127.0.0.3; the others point one
//! instance at a [`FakePeer`] on 127.0.0.1 that the test controls: a real socket and real
//! TLS, playing a remote server that accepts everything, refuses at once, or never answers,
//! and reporting what it saw with timestamps. Timings are scaled down; every bound is
//! explicit and derived from the configuration.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use presenced::config::Config;
use presenced::protocol::xml::reader::{ReaderLimits, StreamEvent, StreamReader};
use presenced::protocol::xml::{Element, NS_CLIENT, NS_PING, NS_STANZAS};
use presenced::transport::s2s::outbound::reconnect_delay;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

// ---------------------------------------------------------------------------------------
// A fake remote server.

/// What the fake remote server saw, in order, each with the instant it saw it.
#[derive(Debug)]
enum Seen {
    /// A TCP connection was accepted (connections are numbered from 1).
    Accepted(usize, Instant),
    /// A stanza arrived on an authenticated stream.
    Stanza(usize, Element, Instant),
    /// The stream ended; `clean` when the sender closed it with `</stream:stream>`.
    Ended(usize, bool, Instant),
}

/// How the fake remote server treats a connection.
#[derive(Clone, Copy)]
enum Behaviour {
    /// Plays a remote server: STARTTLS, accepts any dialback key, reads stanzas.
    Serve,
    /// Closes every connection at once (a server that is down behind a live port).
    CloseAtOnce,
    /// Accepts and never sends a byte (a hung server).
    Silent,
}

struct FakePeer {
    /// Where it listens.
    addr: SocketAddr,
    /// The domain it plays.
    domain: String,
    seen: mpsc::UnboundedReceiver<Seen>,
    task: tokio::task::JoinHandle<()>,
}

impl FakePeer {
    async fn start(behaviour: Behaviour) -> FakePeer {
        let domain = format!("fake{}.example", unique());
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().unwrap();
        let acceptor = tls_acceptor(&domain);
        let (tx, seen) = mpsc::unbounded_channel();
        let me = domain.clone();
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            let mut n = 0;
            while let Ok((tcp, _)) = listener.accept().await {
                n += 1;
                let _ = tx.send(Seen::Accepted(n, Instant::now()));
                match behaviour {
                    Behaviour::CloseAtOnce => drop(tcp),
                    Behaviour::Silent => held.push(tcp),
                    Behaviour::Serve => {
                        let (tx, acceptor, me) = (tx.clone(), acceptor.clone(), me.clone());
                        tokio::spawn(async move {
                            let clean = serve(tcp, n, &me, acceptor, &tx).await;
                            let _ = tx.send(Seen::Ended(n, clean, Instant::now()));
                        });
                    }
                }
            }
        });
        FakePeer {
            addr,
            domain,
            seen,
            task,
        }
    }

    /// The next thing seen, failing the test after `wait`.
    async fn next(&mut self, wait: Duration) -> Seen {
        match tokio::time::timeout(wait, self.seen.recv()).await {
            Ok(Some(s)) => s,
            other => panic!("fake peer saw nothing within {wait:?}: {other:?}"),
        }
    }

    /// Everything seen so far, without waiting.
    fn so_far(&mut self) -> Vec<Seen> {
        let mut out = Vec::new();
        while let Ok(s) = self.seen.try_recv() {
            out.push(s);
        }
        out
    }

    fn jid(&self, name: &str) -> String {
        format!("{name}@{}", self.domain)
    }
}

impl Drop for FakePeer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// TLS for the fake peer, with a self-signed certificate for its domain (the originating
/// server accepts an unverified certificate and authenticates with dialback).
fn tls_acceptor(domain: &str) -> tokio_rustls::TlsAcceptor {
    let dir = std::env::temp_dir().join(format!("presenced-test-{domain}"));
    let (cert, key) = presenced::transport::tls::ensure_self_signed(&dir, &[domain.to_owned()])
        .expect("certificate");
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&cert)
        .unwrap()
        .map(|c| c.unwrap())
        .collect();
    let key = PrivateKeyDer::from_pem_file(&key).expect("key");
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .expect("server TLS config");
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

fn fake_header(from: &str, to: &str) -> String {
    format!(
        "<?xml version='1.0'?><stream:stream xmlns='jabber:server' \
         xmlns:stream='http://etherx.jabber.org/streams' xmlns:db='jabber:server:dialback' \
         from='{from}' to='{to}' id='{}' version='1.0'>",
        unique()
    )
}

/// One connection of a serving fake peer; returns whether it ended with a clean close.
async fn serve(
    tcp: TcpStream,
    n: usize,
    me: &str,
    acceptor: tokio_rustls::TlsAcceptor,
    tx: &mpsc::UnboundedSender<Seen>,
) -> bool {
    let limits = ReaderLimits::default();
    let (r, mut w) = tokio::io::split(Box::new(tcp) as Box<dyn Io>);
    let mut reader = StreamReader::new(r, limits);
    let Some(peer) = read_header(&mut reader).await else {
        return false;
    };
    let _ = w
        .write_all(
            format!(
                "{}<stream:features><starttls xmlns='urn:ietf:params:xml:ns:xmpp-tls'>\
                 <required/></starttls></stream:features>",
                fake_header(me, &peer)
            )
            .as_bytes(),
        )
        .await;
    match reader.next().await {
        Ok(StreamEvent::Stanza(el)) if el.name == "starttls" => {}
        _ => return false,
    }
    let _ = w
        .write_all(b"<proceed xmlns='urn:ietf:params:xml:ns:xmpp-tls'/>")
        .await;
    let io = reader.into_inner().unsplit(w);
    let Ok(tls) = acceptor.accept(io).await else {
        return false;
    };
    let (r, mut w) = tokio::io::split(Box::new(tls) as Box<dyn Io>);
    let mut reader = StreamReader::new(r, limits);
    if read_header(&mut reader).await.is_none() {
        return false;
    }
    let _ = w
        .write_all(
            format!(
                "{}<stream:features><dialback xmlns='urn:xmpp:features:dialback'/>\
                 </stream:features>",
                fake_header(me, &peer)
            )
            .as_bytes(),
        )
        .await;
    match reader.next().await {
        Ok(StreamEvent::Stanza(el)) if el.name == "result" => {}
        _ => return false,
    }
    // As receiving server we may trust whatever we like: this peer trusts everyone.
    let _ = w
        .write_all(format!("<db:result from='{me}' to='{peer}' type='valid'/>").as_bytes())
        .await;
    let _ = w.flush().await;
    loop {
        match reader.next().await {
            Ok(StreamEvent::Stanza(el)) => {
                let _ = tx.send(Seen::Stanza(n, el, Instant::now()));
            }
            Ok(StreamEvent::Close) => {
                let _ = w.write_all(b"</stream:stream>").await;
                return true;
            }
            Ok(_) => {}
            Err(_) => return false,
        }
    }
}

/// Reads a stream header; returns its `from`.
async fn read_header(
    reader: &mut StreamReader<tokio::io::ReadHalf<Box<dyn Io>>>,
) -> Option<String> {
    match reader.next().await {
        Ok(StreamEvent::Open(h)) => Some(h.get_attr("from").unwrap_or_default().to_owned()),
        _ => None,
    }
}

/// A server whose only remote domain is routed to `peer`.
async fn server_towards(peer: &FakePeer, tweak: impl FnOnce(&mut Config)) -> TestServer {
    let (domain, route) = (peer.domain.clone(), peer.addr.to_string());
    TestServer::start(move |c| {
        c.s2s.routes.insert(domain, route.parse().expect("route"));
        tweak(c)
    })
    .await
}

fn message(id: &str, to: &str) -> Element {
    Element::new("message", NS_CLIENT)
        .attr("id", id)
        .attr("to", to)
        .attr("type", "chat")
        .child(Element::new("body", NS_CLIENT).text(format!("body of {id}")))
}

fn is_error(e: &Element) -> bool {
    e.name == "message" && e.get_attr("type") == Some("error")
}

/// Asserts the exact shape of a bounced message (RFC 6120 §8.3.1, §8.3.2): addresses
/// swapped, same id, type error, one `<error/>` of `ty` with the defined `condition` in
/// the stanzas namespace.
fn assert_bounce(err: &Element, sender: &str, recipient: &str, ty: &str, condition: &str) {
    assert_eq!(err.name, "message", "{err}");
    assert_eq!(err.get_attr("type"), Some("error"), "{err}");
    assert_eq!(err.get_attr("to"), Some(sender), "{err}");
    assert_eq!(err.get_attr("from"), Some(recipient), "{err}");
    let errors: Vec<&Element> = err.elements().filter(|e| e.name == "error").collect();
    assert_eq!(errors.len(), 1, "exactly one error element: {err}");
    let e = errors[0];
    assert_eq!(e.ns, NS_CLIENT, "{err}");
    assert_eq!(e.get_attr("type"), Some(ty), "{err}");
    let defined: Vec<&Element> = e.elements().filter(|c| c.name != "text").collect();
    assert_eq!(defined.len(), 1, "one defined condition: {err}");
    assert_eq!(defined[0].name, condition, "{err}");
    assert_eq!(defined[0].ns, NS_STANZAS, "{err}");
}

// ---------------------------------------------------------------------------------------
// 1. Idle close.

#[tokio::test]
async fn idle_outgoing_stream_is_closed_cleanly_and_the_next_stanza_opens_a_new_one() {
    let mut peer = FakePeer::start(Behaviour::Serve).await;
    let a = server_towards(&peer, |c| c.s2s.idle_timeout = Duration::from_secs(1)).await;
    let idle = a.config.s2s.idle_timeout.as_secs_f64();
    a.user("alice").await;
    let mut alice = a.login("alice", "r").await;
    let bob = peer.jid("bob");

    alice.send(&message("m1", &bob)).await;
    assert!(matches!(peer.next(WAIT).await, Seen::Accepted(1, _)));
    let Seen::Stanza(1, m1, _) = peer.next(WAIT).await else {
        panic!("m1 not delivered on the first connection")
    };
    assert_eq!(m1.get_attr("id"), Some("m1"));

    // Traffic before the timeout keeps the stream: the idle time counts from the last
    // stanza, not from the stream's start.
    tokio::time::sleep(secs(idle * 0.6)).await;
    alice.send(&message("m2", &bob)).await;
    let Seen::Stanza(1, m2, last) = peer.next(WAIT).await else {
        panic!("m2 not delivered on the same connection")
    };
    assert_eq!(m2.get_attr("id"), Some("m2"));

    // Then nothing: the stream is closed with </stream:stream> (RFC 6120 §4.4).
    let Seen::Ended(1, clean, closed) = peer.next(secs(idle + 3.0)).await else {
        panic!("first stream did not end")
    };
    assert!(clean, "idle stream ended without </stream:stream>");
    let quiet = closed.duration_since(last).as_secs_f64();
    eprintln!(
        "measured: idle stream closed {quiet:.3}s after its last stanza (idle_timeout {idle}s)"
    );
    // The sender's timer starts when it wrote m2, a little before we read it; closing
    // 0.4 s after m2 (idle counted from m1) would fail this.
    assert!(
        quiet >= idle - 0.2,
        "closed after {quiet:.3}s, before the idle timeout"
    );
    assert!(
        quiet <= idle + 1.5,
        "closed after {quiet:.3}s, long after the idle timeout"
    );

    // The link is forgotten, so the next stanza opens a new stream and is delivered.
    let deadline = Instant::now() + secs(2.0);
    while a.shared().s2s.outgoing_links() != 0 {
        assert!(Instant::now() < deadline, "idle link still registered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    alice.send(&message("m3", &bob)).await;
    assert!(matches!(peer.next(WAIT).await, Seen::Accepted(2, _)));
    let Seen::Stanza(2, m3, _) = peer.next(WAIT).await else {
        panic!("m3 not delivered on a new connection")
    };
    assert_eq!(m3.get_attr("id"), Some("m3"));
    alice
        .expect_none(is_error, Duration::from_millis(300))
        .await;
    a.stop().await;
}

// ---------------------------------------------------------------------------------------
// 2. Reconnect back-off with jitter.

#[tokio::test]
async fn reconnects_to_a_dead_peer_are_spaced_by_growing_jittered_delays_and_bounce_everything() {
    let mut peer = FakePeer::start(Behaviour::CloseAtOnce).await;
    let a = server_towards(&peer, |c| {
        c.s2s.reconnect_min_ms = Duration::from_millis(100);
        c.s2s.reconnect_max_ms = Duration::from_millis(800);
    })
    .await;
    let (min, max) = (a.config.s2s.reconnect_min_ms, a.config.s2s.reconnect_max_ms);
    a.user("alice").await;
    let mut alice = a.login("alice", "r").await;
    let bob = peer.jid("bob");

    // A steady trickle of stanzas keeps the link wanting to connect; each failed attempt
    // bounces what waited for it.
    let window = secs(5.0);
    let start = Instant::now();
    let (mut sent, mut bounced) = (0usize, 0usize);
    while start.elapsed() < window {
        sent += 1;
        alice.send(&message(&format!("m{sent}"), &bob)).await;
        while let Ok(e) = alice.try_expect(&is_error, Duration::from_millis(40)).await {
            assert_eq!(stanza_error(&e), "remote-server-not-found", "{e}");
            bounced += 1;
        }
    }
    // Nothing is lost: what was queued for the next attempt bounces after at most one more
    // delay (max) and the attempt itself.
    let deadline = Instant::now() + max + secs(3.0);
    while bounced < sent {
        let left = deadline.saturating_duration_since(Instant::now());
        match alice.try_expect(&is_error, left).await {
            Ok(_) => bounced += 1,
            Err(e) => panic!("{bounced} of {sent} stanzas bounced ({e:?})"),
        }
    }
    alice
        .expect_none(is_error, Duration::from_millis(300))
        .await;

    let accepts: Vec<Instant> = peer
        .so_far()
        .into_iter()
        .filter_map(|s| match s {
            Seen::Accepted(_, at) if at.duration_since(start) <= window => Some(at),
            _ => None,
        })
        .collect();
    let gaps: Vec<f64> = accepts
        .windows(2)
        .map(|w| w[1].duration_since(w[0]).as_secs_f64() * 1000.0)
        .collect();
    eprintln!(
        "measured: {sent} sent, {bounced} bounced, {} attempts in {window:?}, gaps (ms): {:?}",
        accepts.len(),
        gaps.iter().map(|g| g.round()).collect::<Vec<_>>()
    );
    // Each gap is the jittered delay after the n-th failure plus the failed attempt
    // itself (a loopback connect and a close): never shorter than the delay's lower
    // bound; longer than its upper bound only by this slack for a loaded machine.
    let slack_ms = 300.0;
    let bound = |n: u32, unit: f64| reconnect_delay(n, min, max, unit).as_secs_f64() * 1000.0;
    for (i, gap) in gaps.iter().enumerate() {
        let n = i as u32 + 1;
        assert!(
            *gap >= bound(n, 0.0) - 1.0,
            "gap {n} = {gap:.0} ms < {}",
            bound(n, 0.0)
        );
        assert!(
            *gap <= bound(n, 1.0) + slack_ms,
            "gap {n} = {gap:.0} ms > {} + {slack_ms}",
            bound(n, 1.0)
        );
    }
    // How many attempts fit in the window: the most when every delay is shortest, the
    // fewest when every delay is longest and slowed by the slack.
    let fits = |unit: f64, extra: f64| {
        let (mut t, mut n) = (0.0, 1u32);
        loop {
            t += bound(n, unit) + extra;
            if t > window.as_secs_f64() * 1000.0 {
                return n as usize;
            }
            n += 1;
        }
    };
    let (fewest, most) = (fits(1.0, slack_ms), fits(0.0, 0.0));
    assert!(
        (fewest..=most).contains(&accepts.len()),
        "{} attempts in {window:?}, expected {fewest}..={most}",
        accepts.len()
    );
    // The delays grow: the first is shorter than every one from the third on (whose lower
    // bound is twice the first's upper bound).
    assert!(gaps.len() >= 4, "too few attempts to see growth: {gaps:?}");
    assert!(gaps[2..].iter().all(|g| *g > gaps[0]), "{gaps:?}");
    // And they are jittered: without jitter every capped gap would be at least the cap
    // (800 ms). With delays drawn uniformly from [400, 800] ms, the chance that none lands
    // 20 ms below the cap (overhead included) is about 0.1% for the fewest the window
    // allows (three) and far less for the six or more measured on a loaded machine.
    let capped = &gaps[2..];
    let cap = bound(3, 1.0);
    let shortest = capped.iter().cloned().fold(f64::MAX, f64::min);
    assert!(
        capped.len() >= 3 && shortest < cap - 20.0,
        "capped delays show no jitter: {capped:?}"
    );
    a.stop().await;
}

// ---------------------------------------------------------------------------------------
// 3. Queue overflow and failure bounces.

#[tokio::test]
async fn stanzas_beyond_the_queue_bounce_at_once_and_queued_ones_after_the_connect_timeout() {
    let mut peer = FakePeer::start(Behaviour::Silent).await;
    let a = server_towards(&peer, |c| {
        c.s2s.queue_size = 4;
        c.s2s.connect_timeout = Duration::from_secs(1);
    })
    .await;
    let (queue, timeout) = (
        a.config.s2s.queue_size,
        a.config.s2s.connect_timeout.as_secs_f64(),
    );
    a.user("alice").await;
    let mut alice = a.login("alice", "r").await;
    let bob = peer.jid("bob");

    // A full queue's worth starts the link; once the link's task is connecting (the peer
    // accepted) and so has taken them from its channel, six more arrive. The bound holds
    // for all stanzas waiting, wherever they wait: the six are over it.
    let total = 10;
    let burst = |ids: std::ops::Range<usize>| -> String {
        ids.map(|i| message(&format!("m{i}"), &bob).to_xml())
            .collect()
    };
    let sent_at = Instant::now();
    alice.send_raw(&burst(0..queue)).await;
    assert!(matches!(peer.next(WAIT).await, Seen::Accepted(1, _)));
    alice.send_raw(&burst(queue..total)).await;

    let mut bounces = Vec::new();
    while bounces.len() < total {
        let e = alice
            .try_expect(&is_error, secs(timeout + 3.0))
            .await
            .unwrap_or_else(|e| panic!("{} of {total} bounced ({e:?})", bounces.len()));
        bounces.push((e, sent_at.elapsed().as_secs_f64()));
    }
    alice
        .expect_none(is_error, Duration::from_millis(300))
        .await;
    assert!(peer.so_far().is_empty(), "one connection attempt only");

    for (e, at) in &bounces {
        // RFC 6120 §8.3.3.17: resolved, but not reachable in time.
        assert_bounce(e, &alice.jid, &bob, "wait", "remote-server-timeout");
        let i: usize = e.get_attr("id").unwrap()[1..].parse().unwrap();
        if i < queue {
            assert!(
                *at >= timeout,
                "queued m{i} bounced after {at:.3}s, before the connect timeout"
            );
            assert!(*at <= timeout + 2.0, "queued m{i} bounced after {at:.3}s");
        } else {
            assert!(
                *at < timeout,
                "overflow m{i} bounced after {at:.3}s, not at once"
            );
        }
    }
    let mut ids: Vec<String> = bounces
        .iter()
        .map(|(e, _)| e.get_attr("id").unwrap().to_owned())
        .collect();
    ids.sort();
    let mut expected: Vec<String> = (0..total).map(|i| format!("m{i}")).collect();
    expected.sort();
    assert_eq!(
        ids, expected,
        "every stanza bounced exactly once, with its own id"
    );
    eprintln!(
        "measured: {total} sent, {} bounced; overflow within {:.3}s, queued after {:.3}..{:.3}s",
        bounces.len(),
        bounces
            .iter()
            .filter(|(_, at)| *at < timeout)
            .map(|(_, at)| *at)
            .fold(0.0, f64::max),
        bounces
            .iter()
            .filter(|(_, at)| *at >= timeout)
            .map(|(_, at)| *at)
            .fold(f64::MAX, f64::min),
        bounces.iter().map(|(_, at)| *at).fold(0.0, f64::max),
    );
    a.stop().await;
}

#[tokio::test]
async fn stanzas_to_a_domain_whose_port_refuses_bounce_remote_server_not_found() {
    // A port that was just free: connecting to it is refused.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let domain = format!("refusing{}.example", unique());
    let route = (domain.clone(), closed.to_string());
    let a = TestServer::start(move |c| {
        c.s2s
            .routes
            .insert(route.0, route.1.parse().expect("route"));
    })
    .await;
    a.user("alice").await;
    let mut alice = a.login("alice", "r").await;
    let bob = format!("bob@{domain}");
    let total = 3;
    for i in 0..total {
        alice.send(&message(&format!("r{i}"), &bob)).await;
    }
    let mut ids = Vec::new();
    for _ in 0..total {
        let e = alice.expect(is_error).await;
        // RFC 6120 §8.3.3.16.
        assert_bounce(&e, &alice.jid, &bob, "cancel", "remote-server-not-found");
        ids.push(e.get_attr("id").unwrap().to_owned());
    }
    ids.sort();
    assert_eq!(ids, ["r0", "r1", "r2"]);
    alice
        .expect_none(is_error, Duration::from_millis(300))
        .await;
    a.stop().await;
}

// ---------------------------------------------------------------------------------------
// Two real instances.

/// A free port on `ip` (bound and released; the server binds it right after).
fn free_port(ip: &str) -> u16 {
    std::net::TcpListener::bind((ip, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// Two federated servers: `a` on 127.0.0.2, `b` on 127.0.0.3, each routing to the other
/// over direct TLS (XEP-0368) when `direct_tls`, else over STARTTLS. `tweak_a` adjusts a.
async fn pair(direct_tls: bool, tweak_a: impl FnOnce(&mut Config)) -> (TestServer, TestServer) {
    let domains = [
        format!("a{}.example", unique()),
        format!("b{}.example", unique()),
    ];
    let ips = ["127.0.0.2", "127.0.0.3"];
    let ports = [free_port(ips[0]), free_port(ips[1])];
    let direct_ports = [free_port(ips[0]), free_port(ips[1])];
    let setup = |c: &mut Config, me: usize| {
        let other = 1 - me;
        c.s2s.bind = ips[me].parse().unwrap();
        c.s2s.port = ports[me];
        c.s2s.direct_tls = direct_tls;
        c.s2s.direct_tls_port = direct_ports[me];
        c.s2s.secret = Some(format!("secret-{me}"));
        let route = if direct_tls {
            format!("xmpps://{}:{}", ips[other], direct_ports[other])
        } else {
            format!("{}:{}", ips[other], ports[other])
        };
        c.s2s
            .routes
            .insert(domains[other].clone(), route.parse().expect("route"));
        c.s2s.reconnect_min_ms = Duration::from_millis(100);
        c.s2s.reconnect_max_ms = Duration::from_millis(400);
        c.s2s.connect_timeout = Duration::from_secs(5);
    };
    let a = TestServer::start_with_domain(&domains[0], |c| {
        setup(c, 0);
        tweak_a(c)
    })
    .await;
    let b = TestServer::start_with_domain(&domains[1], |c| setup(c, 1)).await;
    (a, b)
}

/// Logs `name` in with `res`, sends initial presence and waits for its echo.
async fn online(ts: &TestServer, name: &str, res: &str) -> Client {
    let mut c = ts.login(name, res).await;
    c.presence(None, None).await;
    let me = c.jid.clone();
    c.expect(|e| is_presence(e, &me, None)).await;
    c
}

/// alice@a and bob@b subscribe to each other across the link; both see the other online.
async fn mutual(a: &TestServer, b: &TestServer, alice: &mut Client, bob: &mut Client) {
    subscribe_mutually(alice, &a.jid("alice"), bob, &b.jid("bob")).await;
}

// ---------------------------------------------------------------------------------------
// 4. Direct TLS server streams (XEP-0368).

#[tokio::test]
async fn two_servers_federate_over_direct_tls_with_mutual_subscription_and_presence() {
    let (a, b) = pair(true, |_| {}).await;
    assert!(
        a.running.as_ref().unwrap().s2s.direct_tls_addr.is_some()
            && b.running.as_ref().unwrap().s2s.direct_tls_addr.is_some(),
        "both direct TLS s2s listeners are up"
    );
    a.user("alice").await;
    b.user("bob").await;
    let mut alice = online(&a, "alice", "home").await;
    let mut bob = online(&b, "bob", "work").await;
    // Every stream here (both originating streams and the dialback verifications) goes
    // to a direct TLS port: a STARTTLS exchange there would fail the TLS handshake.
    mutual(&a, &b, &mut alice, &mut bob).await;
    let (alice_jid, bob_jid) = (a.jid("alice"), b.jid("bob"));
    for (ts, who, peer) in [(&a, &alice_jid, &bob_jid), (&b, &bob_jid, &alice_jid)] {
        let item = ts.shared().store.roster_item(who, peer).await.unwrap();
        assert_eq!(item.map(|i| i.subscription.as_str()), Some("both"));
    }

    // Presence changes cross in both directions.
    bob.send(
        &Element::new("presence", NS_CLIENT).child(Element::new("show", NS_CLIENT).text("away")),
    )
    .await;
    let away = alice
        .expect(|e| is_presence(e, &bob_jid, None) && e.get_child("show", NS_CLIENT).is_some())
        .await;
    assert_eq!(away.get_attr("from"), Some(bob.jid.as_str()));
    alice.presence(Some("unavailable"), None).await;
    let gone = bob
        .expect(|e| is_presence(e, &alice_jid, Some("unavailable")))
        .await;
    assert_eq!(gone.get_attr("from"), Some(alice.jid.as_str()));
    a.stop().await;
    b.stop().await;
}

// ---------------------------------------------------------------------------------------
// 5. Silent death across domains.

#[tokio::test]
async fn silent_client_on_one_domain_is_seen_unavailable_on_the_other_within_the_liveness_bound() {
    let (a, b) = pair(false, fast_liveness).await;
    let l = a.config.liveness.clone();
    a.user("alice").await;
    b.user("bob").await;
    let mut bob = online(&b, "bob", "pc").await;
    {
        // Subscribe with a first session, closed cleanly afterwards.
        let mut setup = online(&a, "alice", "setup").await;
        mutual(&a, &b, &mut setup, &mut bob).await;
        setup.close().await;
    }
    let mut alice = online(&a, "alice", "phone").await;
    let phone = alice.jid.clone();
    bob.watch(&|e| is_presence(e, &phone, None), WAIT)
        .await
        .expect("bob sees alice's phone online");

    // alice's last beat: a ping answered. Then her socket stays open and silent: no
    // reads, no writes, no close; A's sweeper must notice and tell B.
    let silent_since = Instant::now();
    let r = alice.iq("get", None, Element::new("ping", NS_PING)).await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    // T − H ≤ detection ≤ T + one sweep (tests/liveness.rs), plus the s2s hop.
    let hop = 0.7;
    let got = bob
        .watch(
            &|e| is_presence(e, &phone, Some("unavailable")),
            l.ttl + l.sweep_interval + secs(hop + 1.0),
        )
        .await
        .expect("bob sees alice's silent phone go unavailable");
    let after = silent_since.elapsed().as_secs_f64();
    let (ttl, h, sweep) = (
        l.ttl.as_secs_f64(),
        l.heartbeat_interval.as_secs_f64(),
        l.sweep_interval.as_secs_f64(),
    );
    eprintln!("measured: remote contact saw the silent death {after:.3}s after the last beat");
    assert_eq!(got.get_attr("from"), Some(phone.as_str()));
    assert!(
        got.get_child("link-lost", presenced::transport::s2s::NS_STALE)
            .is_none(),
        "a real unavailable from A, not one B generated for a lost link: {got}"
    );
    assert!(after >= ttl - h, "seen after {after:.2}s, before T-H");
    assert!(
        after <= ttl + sweep + hop,
        "seen after {after:.2}s, later than T + one sweep + {hop}s"
    );
    drop(alice);
    a.stop().await;
    b.stop().await;
}
