//! A fleet of idle client sessions for the memory tests: the server runs in the test's
//! process, the clients in a child process (the same test binary, started with `--exact
//! client_fleet --ignored`), so whatever the test counts of its own process is the
//! server's alone. Every session does what the benchmark's do: STARTTLS, SASL, bind, roster
//! get and initial presence, then sits idle.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::{Client, TestServer};
use presenced::protocol::xml::{Element, NS_ROSTER};

fn roster_get() -> Element {
    Element::new("query", NS_ROSTER)
}

/// Logs in `name`, fetches the roster and sends initial presence, then waits for the
/// server's echo of that presence (RFC 6121 §4.2.2), so the server has finished with it.
async fn login_idle(server: &TestServer, name: &str) -> Client {
    let mut c = Client::login(server, name, "pw", "idle").await;
    let roster = c.iq("get", None, roster_get()).await;
    assert_eq!(roster.get_attr("type"), Some("result"), "{roster}");
    c.presence(None, None).await;
    let jid = c.jid.clone();
    c.expect(|e| e.name == "presence" && e.get_attr("from") == Some(jid.as_str()))
        .await;
    c
}

/// The client half, run in a child process: each test binary that uses [`Fleet`] has an
/// ignored test named `client_fleet` that calls this. For each batch of
/// `PERFMEM_BATCHES` (`prefix:count,…`, users `<prefix><i>` numbered on from the batches
/// before), logs in its sessions, says `BATCH`, and waits for a line; holds every session
/// open until its standard input closes.
pub async fn client_fleet() {
    let Ok(addr) = std::env::var("PERFMEM_ADDR") else {
        return;
    };
    let domain = std::env::var("PERFMEM_DOMAIN").unwrap();
    let server = TestServer {
        running: None,
        domain,
        addr: addr.parse().unwrap(),
        direct_addr: addr.parse().unwrap(),
        cert: std::env::var("PERFMEM_CERT").unwrap().into(),
        config: Default::default(),
    };
    let mut held = Vec::new();
    let mut stdin = tokio::io::BufReader::new(tokio::io::stdin());
    let mut line = String::new();
    let mut from = 0;
    for batch in std::env::var("PERFMEM_BATCHES").unwrap().split(',') {
        let (prefix, count) = batch.split_once(':').unwrap();
        let to = from + count.parse::<usize>().unwrap();
        for i in from..to {
            held.push(login_idle(&server, &format!("{prefix}{i}")).await);
        }
        from = to;
        println!("BATCH");
        std::io::stdout().flush().unwrap();
        line.clear();
        tokio::io::AsyncBufReadExt::read_line(&mut stdin, &mut line)
            .await
            .unwrap();
    }
    drop(held);
}

/// The server side of [`client_fleet`]: a server with the users of `batches`
/// (`(prefix, count)`, numbered on) and the client process, batch by batch; after each, the
/// test reads its own counts once the server holds what the batch logged in (a condition,
/// polled; not a sleep).
pub struct Fleet {
    pub server: TestServer,
    child: std::process::Child,
    to_child: std::process::ChildStdin,
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
}

impl Fleet {
    pub async fn start(batches: &[(&str, usize)]) -> Fleet {
        let server = TestServer::start(|c| {
            // Long liveness timings: nothing is pinged or refreshed while we count.
            c.liveness.heartbeat_interval = Duration::from_secs(600);
            c.liveness.ttl = Duration::from_secs(1800);
            c.liveness.redis_refresh = Duration::from_secs(600);
        })
        .await;
        let mut i = 0;
        for (prefix, count) in batches {
            for _ in 0..*count {
                server.user(&format!("{prefix}{i}")).await;
                i += 1;
            }
        }
        let spec: Vec<String> = batches.iter().map(|(p, n)| format!("{p}:{n}")).collect();
        let exe = std::env::current_exe().unwrap();
        let mut child = Command::new(exe)
            .args(["--exact", "client_fleet", "--ignored", "--nocapture", "-q"])
            .env("PERFMEM_ADDR", server.addr.to_string())
            .env("PERFMEM_DOMAIN", &server.domain)
            .env("PERFMEM_CERT", &server.cert)
            .env("PERFMEM_BATCHES", spec.join(","))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("client process");
        let to_child = child.stdin.take().unwrap();
        let (tx, lines) = tokio::sync::mpsc::unbounded_channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        Fleet {
            server,
            child,
            to_child,
            lines,
        }
    }

    /// Makes users `<prefix><first>` to `<prefix><first + count - 1>` a ring of mutual
    /// contacts: each the contact of the `contacts / 2` users after it and the `contacts / 2`
    /// before it, so each has `contacts` (even, below `count`).
    pub async fn ring(&self, prefix: &str, first: usize, count: usize, contacts: usize) {
        for i in 0..count {
            for step in 1..=contacts / 2 {
                let j = (i + step) % count;
                self.server
                    .make_mutual(
                        &format!("{prefix}{}", first + i),
                        &format!("{prefix}{}", first + j),
                    )
                    .await;
            }
        }
    }

    /// Waits for the client to finish its next batch and the server to hold `sessions`
    /// sessions and `tracked` entries in their viewer sets.
    pub async fn batch_done(&mut self, sessions: usize, tracked: usize) {
        said(&mut self.lines, "BATCH").await;
        sessions_reach(&self.server, sessions, tracked).await;
    }

    pub fn next_batch(&mut self) {
        writeln!(self.to_child, "go").unwrap();
    }

    pub async fn stop(self) {
        drop(self.to_child);
        let mut child = self.child;
        let _ = child.wait();
        self.server.stop().await;
    }
}

/// Waits for the client process to print `word`.
async fn said(rx: &mut tokio::sync::mpsc::UnboundedReceiver<String>, word: &str) {
    loop {
        match tokio::time::timeout(Duration::from_secs(120), rx.recv()).await {
            Ok(Some(l)) if l.trim() == word => return,
            Ok(Some(_)) => continue,
            other => panic!("client process ended before {word}: {other:?}"),
        }
    }
}

/// Waits until the server counts `n` sessions and `tracked` entries in their viewer sets
/// (a condition, not a sleep).
async fn sessions_reach(server: &TestServer, n: usize, tracked: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let shared = server.shared();
    while shared.sessions.count() != n || shared.sessions.tracked() != tracked {
        assert!(
            tokio::time::Instant::now() < deadline,
            "server has {} sessions and {} viewer entries, expected {n} and {tracked}",
            shared.sessions.count(),
            shared.sessions.tracked()
        );
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
