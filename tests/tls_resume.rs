//! TLS 1.3 session resumption on the client listeners (RFC 8446 §4.6.1), over real sockets
//! and real TLS: a client that connected once resumes on its next connection (direct TLS,
//! STARTTLS and the HTTPS listener of WebSocket) and logs in as usual; a ticket issued by one node opens on another node on the
//! same database (the cluster case); a changed ticket secret makes the next connection a
//! full handshake, not an error. The ignored `handshake_cpu` measures what resumption saves.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use presenced::config::Config;
use rustls::client::Resumption;
use rustls::HandshakeKind;

/// A client configuration pinning `server`'s certificate whose session cache outlives
/// each connection, as a real client's does.
fn resuming_client(server: &TestServer) -> Arc<rustls::ClientConfig> {
    let mut config = (*tls_client(&server.cert)).clone();
    config.resumption = Resumption::in_memory_sessions(16);
    Arc::new(config)
}

/// SASL PLAIN as `name` (password "pw"), the restart, and binding.
async fn log_in(c: &mut Client, server: &TestServer, name: &str) {
    let ok = c.auth_plain(name, "pw").await;
    assert_eq!(ok.name, "success", "{ok}");
    c.restart_stream();
    c.open(&server.domain).await.expect("stream after SASL");
    c.bind("").await.expect("bind");
}

#[tokio::test]
async fn a_client_that_connected_once_resumes_and_logs_in() {
    let server = TestServer::start(|_| {}).await;
    server.add_user("alice", "pw").await;
    let tls = resuming_client(&server);

    let (mut first, kind) = Client::direct_tls_with(&server, tls.clone()).await;
    assert_eq!(kind, Some(HandshakeKind::Full));
    log_in(&mut first, &server, "alice").await;
    first.close().await;

    let (mut again, kind) = Client::direct_tls_with(&server, tls.clone()).await;
    assert_eq!(kind, Some(HandshakeKind::Resumed), "direct TLS resumes");
    log_in(&mut again, &server, "alice").await;
    again.close().await;

    let mut plain = Client::tcp(&server).await;
    plain.open(&server.domain).await.expect("stream");
    let (mut upgraded, kind) = plain.starttls_with(&server, tls.clone()).await;
    assert_eq!(kind, Some(HandshakeKind::Resumed), "STARTTLS resumes");
    log_in(&mut upgraded, &server, "alice").await;
    upgraded.close().await;
    server.stop().await;
}

#[tokio::test]
async fn the_https_listener_of_websocket_resumes_too() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let server = TestServer::start(|c| c.http.tls = true).await;
    let tls = resuming_client(&server);
    let connector = tokio_rustls::TlsConnector::from(tls);
    for expected in [HandshakeKind::Full, HandshakeKind::Resumed] {
        let tcp = tokio::net::TcpStream::connect(server.http_addr())
            .await
            .unwrap();
        let name = rustls_pki_types::ServerName::try_from(server.domain.clone()).unwrap();
        let mut https = connector.connect(name, tcp).await.expect("handshake");
        assert_eq!(https.get_ref().1.handshake_kind(), Some(expected));
        // Reading the answer also reads the tickets sent after the handshake.
        let request = format!(
            "GET /.well-known/host-meta HTTP/1.1\r\nHost: {}\r\n\r\n",
            server.domain
        );
        https.write_all(request.as_bytes()).await.unwrap();
        let mut answer = [0u8; 12];
        https.read_exact(&mut answer).await.expect("an answer");
        assert!(answer.starts_with(b"HTTP/1.1 200"), "{answer:?}");
    }
    server.stop().await;
}

/// Two nodes of one cluster: same domain, same database, same Redis key prefix.
async fn two_nodes() -> (TestServer, TestServer) {
    let domain = format!("r{}.example", unique());
    let node = |n: &'static str| {
        move |c: &mut Config| {
            fast_liveness(c);
            c.cluster.node_id = Some(format!("{n}-{}", unique()));
        }
    };
    let n1 = TestServer::start_with_domain(&domain, node("n1")).await;
    let n2 = TestServer::start_with_domain(&domain, node("n2")).await;
    (n1, n2)
}

#[tokio::test]
async fn a_ticket_from_one_node_opens_on_another() {
    let (n1, n2) = two_nodes().await;
    n1.add_user("bob", "pw").await;
    let tls = resuming_client(&n1);

    let (first, kind) = Client::direct_tls_with(&n1, tls.clone()).await;
    assert_eq!(kind, Some(HandshakeKind::Full));
    first.close().await;

    let (mut other, kind) = Client::direct_tls_with(&n2, tls.clone()).await;
    assert_eq!(
        kind,
        Some(HandshakeKind::Resumed),
        "node 2 opens node 1's ticket"
    );
    log_in(&mut other, &n2, "bob").await;
    other.close().await;
    n2.stop().await;
    n1.stop().await;
}

#[tokio::test]
async fn a_new_secret_refuses_old_tickets_with_a_full_handshake() {
    let server = TestServer::start(|_| {}).await;
    server.add_user("carol", "pw").await;
    let tls = resuming_client(&server);
    let (first, _) = Client::direct_tls_with(&server, tls.clone()).await;
    first.close().await;

    // A reload (SIGHUP) of a file with a new `[tls] ticket_secret`.
    let running = server.running.as_ref().unwrap();
    let mut changed = server.config.clone();
    changed.tls.ticket_secret = Some("a new secret for the whole cluster".into());
    let checked = changed.clone().check().expect("valid");
    let outcome = presenced::app::control::reload::apply(&server.config, &checked, running)
        .await
        .expect("reloads");
    assert!(
        outcome
            .reloaded
            .iter()
            .any(|r| r.starts_with("TLS session tickets")),
        "{outcome:?}"
    );

    let (mut refused, kind) = Client::direct_tls_with(&server, tls.clone()).await;
    assert_eq!(kind, Some(HandshakeKind::Full), "the old ticket is refused");
    log_in(&mut refused, &server, "carol").await;
    refused.close().await;

    // The full handshake brought a ticket under the new secret.
    let (resumed, kind) = Client::direct_tls_with(&server, tls.clone()).await;
    assert_eq!(kind, Some(HandshakeKind::Resumed));
    resumed.close().await;

    // With tickets off, TLS 1.3 resumes from the node's session cache.
    changed.tls.tickets = false;
    assert!(running.tickets.reload(&changed.tls));
    let (full, kind) = Client::direct_tls_with(&server, tls.clone()).await;
    assert_eq!(kind, Some(HandshakeKind::Full), "a ticket is not opened");
    full.close().await;
    let (cached, kind) = Client::direct_tls_with(&server, tls.clone()).await;
    assert_eq!(kind, Some(HandshakeKind::Resumed), "from the session cache");
    cached.close().await;
    server.stop().await;
}

/// CPU seconds (user + system) of the whole process, or of the calling thread.
fn cpu_seconds(who: libc::c_int) -> f64 {
    // SAFETY: getrusage only writes the struct it is given.
    let usage = unsafe {
        let mut usage = std::mem::zeroed::<libc::rusage>();
        assert_eq!(libc::getrusage(who, &mut usage), 0);
        usage
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// `count` direct TLS connections with `tls`, one after another, each opening the stream
/// (so the tickets sent after the handshake are read) and then dropped. Runs on a thread
/// of its own and returns that thread's CPU seconds and the resumed handshakes.
fn connect_many(
    addr: std::net::SocketAddr,
    domain: String,
    tls: Arc<rustls::ClientConfig>,
    count: usize,
) -> (f64, usize) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let before = cpu_seconds(libc::RUSAGE_THREAD);
    let resumed = runtime.block_on(async {
        let connector = tokio_rustls::TlsConnector::from(tls);
        let mut resumed = 0;
        for _ in 0..count {
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            tcp.set_nodelay(true).unwrap();
            let name = rustls_pki_types::ServerName::try_from(domain.clone()).unwrap();
            let mut tls = connector.connect(name, tcp).await.expect("handshake");
            if tls.get_ref().1.handshake_kind() == Some(HandshakeKind::Resumed) {
                resumed += 1;
            }
            tls.write_all(
                format!(
                    "<stream:stream xmlns='jabber:client' \
                     xmlns:stream='http://etherx.jabber.org/streams' to='{domain}' version='1.0'>"
                )
                .as_bytes(),
            )
            .await
            .unwrap();
            let mut seen = Vec::new();
            let mut buf = [0u8; 4096];
            while !String::from_utf8_lossy(&seen).contains("</stream:features>") {
                let n = tls.read(&mut buf).await.unwrap();
                assert!(n > 0, "closed before the features");
                seen.extend_from_slice(&buf[..n]);
            }
        }
        resumed
    });
    (cpu_seconds(libc::RUSAGE_THREAD) - before, resumed)
}

/// Server CPU per handshake, full against resumed: `count` connections each way
/// (`PRESENCED_HANDSHAKES`, default 2000), twice in turn, against an in-process server. The
/// server's share is the process's CPU less the client thread's. The server presents the
/// generated ECDSA P-256 certificate, or the PEM certificate and key named by
/// `PRESENCED_HANDSHAKE_CERT` and `PRESENCED_HANDSHAKE_KEY` (which must cover
/// `handshake.example`; an RSA key shows what a costlier signature adds). Run with
/// `cargo test --test tls_resume handshake_cpu -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, not a check"]
async fn handshake_cpu() {
    let count: usize = common::env_or("PRESENCED_HANDSHAKES", 2000);
    let identity = std::env::var("PRESENCED_HANDSHAKE_CERT")
        .ok()
        .zip(std::env::var("PRESENCED_HANDSHAKE_KEY").ok());
    let domain = match identity {
        Some(_) => "handshake.example".to_owned(),
        None => format!("h{}.example", unique()),
    };
    let mut server = TestServer::start_with_domain(&domain, |c| {
        c.limits.connections_per_ip_per_minute = 1_000_000;
        if let Some((cert, key)) = identity.clone() {
            c.tls.cert = Some(cert.into());
            c.tls.key = Some(key.into());
        }
    })
    .await;
    if let Some((cert, _)) = identity {
        server.cert = cert.into();
    }
    let mut full = (*tls_client(&server.cert)).clone();
    full.resumption = Resumption::disabled();
    let (full, resuming) = (Arc::new(full), resuming_client(&server));
    let modes = [
        ("full", full.clone()),
        ("resumed", resuming.clone()),
        ("full", full),
        ("resumed", resuming),
    ];
    for (mode, tls) in modes {
        let (addr, domain) = (server.direct_addr, server.domain.clone());
        let process_before = cpu_seconds(libc::RUSAGE_SELF);
        let started = std::time::Instant::now();
        let (client, resumed) = tokio::task::spawn_blocking(move || {
            std::thread::spawn(move || connect_many(addr, domain, tls, count))
                .join()
                .unwrap()
        })
        .await
        .unwrap();
        // Let the server finish the connections the client dropped.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let process = cpu_seconds(libc::RUSAGE_SELF) - process_before;
        let server_cpu = process - client;
        println!(
            "{mode}: {count} handshakes ({resumed} resumed) in {:.2} s wall; server CPU {:.3} s \
             ({:.0} µs each), client CPU {:.3} s",
            started.elapsed().as_secs_f64(),
            server_cpu,
            server_cpu / count as f64 * 1e6,
            client,
        );
    }
    server.stop().await;
}
