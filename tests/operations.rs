//! The server as an operator runs it: the real binary as a child process, its signals,
//! its log and its command line.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

mod common;

const WAIT: Duration = Duration::from_secs(20);

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

fn unique() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..10].to_owned()
}

/// A directory holding a configuration for one domain, its certificate and key.
struct Setup {
    dir: PathBuf,
    domain: String,
}

impl Setup {
    fn new(extra: &str) -> Setup {
        let domain = format!("ops{}.example", unique());
        let dir = std::env::temp_dir().join(format!("presenced-ops-{domain}"));
        std::fs::create_dir_all(&dir).unwrap();
        let setup = Setup { dir, domain };
        setup.write_certificate();
        let migrations = Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
        let config = format!(
            r#"domains = ["{domain}"]
[c2s]
bind = "127.0.0.1"
port = 0
direct_tls_port = 0
[tls]
cert = "cert.pem"
key = "key.pem"
[database]
url = "{db}"
max_connections = 4
migrations = "{migrations}"
[http]
enabled = false
[s2s]
enabled = false
[admin]
port = 0
{extra}
"#,
            domain = setup.domain,
            db = database_url(),
            migrations = migrations.display(),
        );
        std::fs::write(setup.config(), config).unwrap();
        setup
    }

    fn config(&self) -> PathBuf {
        self.dir.join("presenced.toml")
    }

    /// Writes a new self-signed certificate for the domain; returns its DER.
    fn write_certificate(&self) -> Vec<u8> {
        let c = rcgen::generate_simple_self_signed(vec![self.domain.clone()]).unwrap();
        std::fs::write(self.dir.join("cert.pem"), c.cert.pem()).unwrap();
        std::fs::write(self.dir.join("key.pem"), c.key_pair.serialize_pem()).unwrap();
        c.cert.der().to_vec()
    }

    fn presented(&self) -> Vec<u8> {
        let pem = std::fs::read(self.dir.join("cert.pem")).unwrap();
        CertificateDer::from_pem_slice(&pem).unwrap().to_vec()
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_presenced"));
        cmd.arg("--config")
            .arg(self.config())
            .args(args)
            .env_remove("RUST_LOG")
            .env_remove("REDIS_URL")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        cmd
    }

    async fn run(&self, args: &[&str]) -> std::process::Output {
        tokio::time::timeout(WAIT, self.command(args).output())
            .await
            .expect("presenced finished in time")
            .expect("run presenced")
    }
}

use rustls_pki_types::pem::PemObject;

/// `presenced serve` as a child process, its standard error read line by line.
struct Server {
    child: Child,
    lines: mpsc::UnboundedReceiver<String>,
    log: Vec<String>,
    direct_tls: std::net::SocketAddr,
}

impl Server {
    async fn start(setup: &Setup) -> Server {
        let mut child = setup
            .command(&["serve"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn presenced");
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut r = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = r.next_line().await {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut s = Server {
            child,
            lines,
            log: Vec::new(),
            direct_tls: "0.0.0.0:0".parse().unwrap(),
        };
        let line = s
            .wait_line(|l| {
                l.contains("c2s listening")
                    && (l.contains("direct_tls=true") || l.contains("\"direct_tls\":true"))
            })
            .await;
        // `addr=A` in text, `"addr":"A"` in JSON.
        let addr = line
            .split("addr=")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .or_else(|| line.split("\"addr\":\"").nth(1)?.split('"').next())
            .expect("address in the listening line");
        s.direct_tls = addr.parse().expect("socket address");
        s
    }

    /// Waits for a log line matching `pred`; fails the test after WAIT.
    async fn wait_line(&mut self, pred: impl Fn(&str) -> bool) -> String {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            match tokio::time::timeout_at(deadline, self.lines.recv()).await {
                Ok(Some(line)) => {
                    self.log.push(line.clone());
                    if pred(&line) {
                        return line;
                    }
                }
                Ok(None) => panic!("server exited; log:\n{}", self.log.join("\n")),
                Err(_) => panic!("no such log line; log:\n{}", self.log.join("\n")),
            }
        }
    }

    fn signal(&self, sig: i32) {
        let pid = self.child.id().expect("running") as i32;
        assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
    }

    /// SIGTERM, then the exit status and the rest of the log.
    async fn terminate(mut self) -> (std::process::ExitStatus, Vec<String>) {
        self.signal(libc::SIGTERM);
        let status = tokio::time::timeout(WAIT, self.child.wait())
            .await
            .expect("exits after SIGTERM")
            .unwrap();
        while let Some(line) = self.lines.recv().await {
            self.log.push(line);
        }
        (status, self.log)
    }
}

/// A raw client over direct TLS (XEP-0368).
struct Conn {
    tls: tokio_rustls::client::TlsStream<TcpStream>,
    buf: String,
}

impl Conn {
    /// Connects, trusting any of `trusted`; returns the connection and the certificate the
    /// server presented.
    async fn connect(
        addr: std::net::SocketAddr,
        domain: &str,
        trusted: &[&[u8]],
    ) -> (Conn, Vec<u8>) {
        let mut roots = rustls::RootCertStore::empty();
        for der in trusted {
            roots.add(CertificateDer::from(der.to_vec())).unwrap();
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let tcp = TcpStream::connect(addr).await.unwrap();
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(ServerName::try_from(domain.to_owned()).unwrap(), tcp)
            .await
            .expect("TLS handshake");
        let presented = tls.get_ref().1.peer_certificates().unwrap()[0].to_vec();
        (
            Conn {
                tls,
                buf: String::new(),
            },
            presented,
        )
    }

    async fn send(&mut self, s: &str) {
        self.tls.write_all(s.as_bytes()).await.unwrap();
    }

    /// Reads until `needle` arrived; returns everything up to and including it.
    async fn until(&mut self, needle: &str) -> String {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            if let Some(i) = self.buf.find(needle) {
                let rest = self.buf.split_off(i + needle.len());
                return std::mem::replace(&mut self.buf, rest);
            }
            let mut chunk = [0u8; 4096];
            let n = tokio::time::timeout_at(deadline, self.tls.read(&mut chunk))
                .await
                .unwrap_or_else(|_| panic!("no `{needle}` in {:?}", self.buf))
                .unwrap_or(0);
            assert!(n > 0, "closed before `{needle}`; got {:?}", self.buf);
            self.buf.push_str(&String::from_utf8_lossy(&chunk[..n]));
        }
    }

    /// Reads until every one of `needles` arrived, in any order; returns all that was read.
    async fn until_all(&mut self, needles: &[&str]) -> String {
        let deadline = tokio::time::Instant::now() + WAIT;
        while !needles.iter().all(|n| self.buf.contains(n)) {
            let mut chunk = [0u8; 4096];
            let n = tokio::time::timeout_at(deadline, self.tls.read(&mut chunk))
                .await
                .unwrap_or_else(|_| panic!("not all of {needles:?} in {:?}", self.buf))
                .unwrap_or(0);
            assert!(n > 0, "closed before {needles:?}; got {:?}", self.buf);
            self.buf.push_str(&String::from_utf8_lossy(&chunk[..n]));
        }
        std::mem::take(&mut self.buf)
    }

    fn header(domain: &str) -> String {
        format!(
            "<?xml version='1.0'?><stream:stream to='{domain}' version='1.0' \
             xmlns='jabber:client' xmlns:stream='http://etherx.jabber.org/streams'>"
        )
    }

    /// Authenticates with PLAIN and binds `resource`.
    async fn login(&mut self, domain: &str, user: &str, password: &str, resource: &str) {
        self.send(&Self::header(domain)).await;
        self.until("</stream:features>").await;
        let token =
            base64::engine::general_purpose::STANDARD.encode(format!("\0{user}\0{password}"));
        self.send(&format!(
            "<auth xmlns='urn:ietf:params:xml:ns:xmpp-sasl' mechanism='PLAIN'>{token}</auth>"
        ))
        .await;
        self.until("<success").await;
        self.send(&Self::header(domain)).await;
        self.until("</stream:features>").await;
        self.send(&format!(
            "<iq type='set' id='b1'><bind xmlns='urn:ietf:params:xml:ns:xmpp-bind'>\
             <resource>{resource}</resource></bind></iq>"
        ))
        .await;
        self.until("</iq>").await;
    }

    /// An XEP-0199 ping to the server answered: the session is alive.
    async fn ping(&mut self, domain: &str, id: &str) {
        self.send(&format!(
            "<iq type='get' id='{id}' to='{domain}'><ping xmlns='urn:xmpp:ping'/></iq>"
        ))
        .await;
        let got = self.until(&format!("id='{id}'")).await;
        let got = got + &self.until(">").await;
        assert!(got.contains("type='result'"), "ping {id}: {got}");
    }
}

async fn add_user(setup: &Setup, name: &str, password: &str) {
    let pw = setup.dir.join(format!("{name}.pw"));
    std::fs::write(&pw, format!("{password}\n")).unwrap();
    let jid = format!("{name}@{}", setup.domain);
    let out = setup
        .run(&["user", "add", &jid, "--password-file", pw.to_str().unwrap()])
        .await;
    assert!(out.status.success(), "user add: {out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("already exists, skipping"),
        "PostgreSQL notices stay out of the log: {stderr}"
    );
}

/// A pipe whose reading end is already closed: every write to the other end fails with
/// EPIPE, as when `presenced … | head -c1` has exited.
fn closed_pipe() -> Stdio {
    use std::os::fd::FromRawFd;
    let mut fds = [0i32; 2];
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    unsafe { libc::close(fds[0]) };
    Stdio::from(unsafe { std::os::fd::OwnedFd::from_raw_fd(fds[1]) })
}

#[tokio::test]
async fn sighup_replaces_the_certificate_for_new_connections_and_keeps_sessions() {
    let setup = Setup::new("");
    add_user(&setup, "alice", "pw").await;
    let first = setup.presented();
    let mut server = Server::start(&setup).await;

    let (mut alice, seen) = Conn::connect(server.direct_tls, &setup.domain, &[&first]).await;
    assert_eq!(seen, first);
    alice.login(&setup.domain, "alice", "pw", "r").await;

    let second = setup.write_certificate();
    assert_ne!(first, second);
    // `presenced reload` finds the server by its --config in /proc and sends SIGHUP.
    let out = setup.run(&["reload"]).await;
    assert!(out.status.success(), "reload: {out:?}");
    server.wait_line(|l| l.contains("reload done")).await;
    assert!(server
        .log
        .iter()
        .any(|l| l.contains("reloaded TLS certificate")));

    let (_fresh, seen) = Conn::connect(server.direct_tls, &setup.domain, &[&first, &second]).await;
    assert_eq!(seen, second, "a new connection gets the new certificate");
    alice.ping(&setup.domain, "after-reload").await;

    // A key that does not belong to the certificate: the reload fails, nothing changes.
    let c = rcgen::generate_simple_self_signed(vec![setup.domain.clone()]).unwrap();
    std::fs::write(setup.dir.join("key.pem"), c.key_pair.serialize_pem()).unwrap();
    server.signal(libc::SIGHUP);
    server.wait_line(|l| l.contains("reload failed")).await;
    let (_fresh, seen) = Conn::connect(server.direct_tls, &setup.domain, &[&first, &second]).await;
    assert_eq!(seen, second, "a failed reload keeps the certificate in use");
    alice.ping(&setup.domain, "after-failed-reload").await;

    let (status, log) = server.terminate().await;
    assert!(status.success(), "exit after SIGTERM: {status:?}");
    assert!(log.iter().any(|l| l.contains("stopped")), "{log:?}");
    let shutdown = alice.until("</stream:stream>").await;
    assert!(shutdown.contains("system-shutdown"), "{shutdown}");
    assert!(
        log.iter().all(|l| !l.contains('\u{1b}')),
        "no colour codes in a piped log"
    );
}

#[tokio::test]
async fn sighup_names_changes_that_need_a_restart_and_other_signals_do_not_kill() {
    let setup = Setup::new("");
    let mut server = Server::start(&setup).await;
    let text = std::fs::read_to_string(setup.config()).unwrap();
    std::fs::write(
        setup.config(),
        format!("{text}[limits]\nmax_connections = 77\n[log]\nlevel = \"debug\"\n"),
    )
    .unwrap();
    server.signal(libc::SIGHUP);
    let line = server
        .wait_line(|l| l.contains("takes effect after a restart"))
        .await;
    assert!(line.contains("[limits] (listener admission"), "{line}");
    server.wait_line(|l| l.contains("reload done")).await;
    assert!(server
        .log
        .iter()
        .any(|l| l.contains("reloaded log filter `debug")));
    for sig in [libc::SIGUSR1, libc::SIGUSR2] {
        server.signal(sig);
        server.wait_line(|l| l.contains("signal ignored")).await;
    }
    let (status, _) = server.terminate().await;
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn a_closed_stdout_is_not_a_panic() {
    let setup = Setup::new("");
    for args in [&["check-config"][..], &["--help"], &["user", "--help"]] {
        let out = tokio::time::timeout(
            WAIT,
            setup
                .command(args)
                .stdout(closed_pipe())
                .stderr(Stdio::piped())
                .output(),
        )
        .await
        .unwrap()
        .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert_ne!(out.status.code(), Some(101), "{args:?}: {stderr}");
    }
    // And through a real `head -c1`, the way an operator does it.
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "set -o pipefail; '{}' --config '{}' check-config 2>&1 | head -c1 >/dev/null",
            env!("CARGO_BIN_EXE_presenced"),
            setup.config().display()
        ))
        .env_remove("RUST_LOG")
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

#[tokio::test]
async fn sigterm_with_a_closed_log_pipe_still_stops_gracefully_and_writes_last_seen() {
    let setup = Setup::new("");
    add_user(&setup, "bob", "pw").await;
    let mut server = Server::start(&setup).await;
    let (mut bob, _) = Conn::connect(server.direct_tls, &setup.domain, &[&setup.presented()]).await;
    bob.login(&setup.domain, "bob", "pw", "r").await;
    bob.ping(&setup.domain, "p").await;
    // Whatever read the log is gone.
    server.lines.close();
    while server.lines.recv().await.is_some() {}
    let child_stderr_reader_gone = tokio::time::Instant::now();
    server.signal(libc::SIGTERM);
    let status = tokio::time::timeout(WAIT, server.child.wait())
        .await
        .expect("exits after SIGTERM")
        .unwrap();
    assert!(
        status.success(),
        "{status:?} after {:?}",
        child_stderr_reader_gone.elapsed()
    );
    let seen = last_seen(&format!("bob@{}", setup.domain)).await;
    assert!(seen.is_some(), "last seen written at shutdown");
}

/// The last seen the store holds for `jid`.
async fn last_seen(jid: &str) -> Option<(chrono::DateTime<chrono::Utc>,)> {
    let pool = sqlx::PgPool::connect(&database_url()).await.unwrap();
    sqlx::query_as("SELECT seen_at FROM last_activity WHERE jid = $1")
        .bind(jid)
        .fetch_optional(&pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn connection_errors_name_their_target() {
    let setup = Setup::new("");
    let out = setup
        .command(&["user", "del", &format!("x@{}", setup.domain)])
        .env(
            "DATABASE_URL",
            "postgres://postgres:hunter2@127.0.0.1:1/nowhere",
        )
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("127.0.0.1:1/nowhere"), "{stderr}");
    assert!(
        !stderr.contains("hunter2"),
        "no password in errors: {stderr}"
    );
}

#[tokio::test]
async fn json_log_carries_one_banner_with_version_node_and_stores() {
    let setup = Setup::new("[log]\nformat = \"json\"\n");
    let mut server = Server::start(&setup).await;
    let banner = server.wait_line(|l| l.contains("presenced started")).await;
    assert!(banner.starts_with('{') && banner.ends_with('}'), "{banner}");
    for field in [
        "\"version\":\"",
        "\"node\":\"",
        "\"database\":\"",
        "\"liveness\":\"in-process\"",
    ] {
        assert!(banner.contains(field), "{field} in {banner}");
    }
    let (status, log) = server.terminate().await;
    assert!(status.success());
    assert_eq!(
        log.iter()
            .filter(|l| l.contains("presenced started"))
            .count(),
        1
    );
    assert!(
        log.iter().all(|l| l.starts_with('{')),
        "every line is JSON: {log:?}"
    );
}

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[tokio::test]
async fn check_config_on_a_good_setup_reaches_the_stores_and_shows_every_table() {
    let setup = Setup::new("");
    let out = setup
        .command(&["check-config", "--connect"])
        .env(
            "DATABASE_URL",
            database_url().replace("postgres@", "postgres:pw@"),
        )
        .env("REDIS_URL", "redis://127.0.0.1:6379")
        .output()
        .await
        .unwrap();
    let t = text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}");
    assert!(t.contains("key matches, names"), "{t}");
    assert!(t.contains("PostgreSQL 127.0.0.1:5432/"), "{t}");
    assert!(t.contains(": reached, version"), "{t}");
    assert!(t.contains("Redis 127.0.0.1:6379: reached, version"), "{t}");
    assert!(t.contains("postgres:***@"), "password elided: {t}");
    assert!(!t.contains(":pw@"), "{t}");
    for table in ["[c2s]", "[tls]", "[limits]", "[liveness]", "[s2s]", "[log]"] {
        assert!(t.contains(table), "{table}: {t}");
    }
    assert!(!t.contains("Config {"), "no debug dump: {t}");
}

#[tokio::test]
async fn check_config_fails_broken_files_and_unreachable_stores_with_their_names() {
    // A CA file that does not exist.
    let setup = Setup::new("");
    let text_cfg = std::fs::read_to_string(setup.config()).unwrap();
    let broken = text_cfg.replace("[s2s]\n", "[s2s]\nca_file = \"/nonexistent/ca.pem\"\n");
    std::fs::write(setup.config(), &broken).unwrap();
    let out = setup.run(&["check-config"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("FAIL  [s2s] ca_file /nonexistent/ca.pem"),
        "{}",
        text(&out)
    );
    std::fs::write(setup.config(), &text_cfg).unwrap();

    // A certificate for another name.
    let other = rcgen::generate_simple_self_signed(vec!["other.example".into()]).unwrap();
    std::fs::write(setup.dir.join("cert.pem"), other.cert.pem()).unwrap();
    std::fs::write(setup.dir.join("key.pem"), other.key_pair.serialize_pem()).unwrap();
    let out = setup.run(&["check-config"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains(&format!("does not name {}", setup.domain)),
        "{}",
        text(&out)
    );

    // A key that is not the certificate's.
    setup.write_certificate();
    std::fs::write(setup.dir.join("key.pem"), other.key_pair.serialize_pem()).unwrap();
    let out = setup.run(&["check-config"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("FAIL  [tls]"), "{}", text(&out));
    setup.write_certificate();
    assert_eq!(setup.run(&["check-config"]).await.status.code(), Some(0));

    // Unreachable stores: each named by where it was looked for.
    let out = setup
        .command(&["check-config", "--connect"])
        .env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/nowhere")
        .env("REDIS_URL", "redis://127.0.0.1:1")
        .output()
        .await
        .unwrap();
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(
        t.contains("FAIL  store: PostgreSQL at 127.0.0.1:1, database nowhere: NOT USABLE"),
        "{t}"
    );
    assert!(t.contains("FAIL  Redis 127.0.0.1:1"), "{t}");

    // A file that does not validate: 2, nothing else checked.
    std::fs::write(setup.config(), "domains = []\n").unwrap();
    let out = setup.run(&["check-config"]).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}

/// `check-config --connect` tries the operator's migrations that are not applied yet on
/// the configured store and rolls them back: a file in the other dialect (as after
/// `copy-store` from SQLite to PostgreSQL) fails the check, naming the file, where before
/// the check said ok and the next start stopped on it.
#[tokio::test]
async fn check_config_tries_the_operators_pending_migrations_on_the_store() {
    let setup = Setup::new("");
    let dir = setup.dir.join("migrations.d");
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = std::fs::read_to_string(setup.config()).unwrap();
    let line = cfg
        .lines()
        .find(|l| l.starts_with("migrations = "))
        .expect("the setup names a migrations directory")
        .to_owned();
    std::fs::write(
        setup.config(),
        cfg.replace(&line, &format!("migrations = \"{}\"", dir.display())),
    )
    .unwrap();
    let table = format!("t{}", unique());
    // PostgreSQL's dialect: runs, and is rolled back (the table is not there afterwards).
    std::fs::write(
        dir.join("1000_mine.sql"),
        format!("CREATE TABLE {table} (x bigint); SELECT 1::bigint;"),
    )
    .unwrap();
    let out = setup.run(&["check-config", "--connect"]).await;
    let t = text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}");
    assert!(
        t.contains("1 not applied yet; they run on this store"),
        "{t}"
    );
    let pool = sqlx::PgPool::connect(&database_url()).await.unwrap();
    let left: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(&table)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, None, "the trial was rolled back");
    // SQLite's dialect on PostgreSQL: the check fails and names the file.
    std::fs::write(
        dir.join("1001_lite.sql"),
        "INSERT INTO presenced_roster_make_mutual (a, b) VALUES ('a@x', 'b@x');",
    )
    .unwrap();
    let out = setup.run(&["check-config", "--connect"]).await;
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(
        t.contains("FAIL  [database] migrations:") && t.contains("migration 1001 (lite)"),
        "{t}"
    );
}

async fn make_mutual(a: &str, b: &str) {
    let pool = sqlx::PgPool::connect(&database_url()).await.unwrap();
    sqlx::query("SELECT presenced_roster_make_mutual($1, $2)")
        .bind(a)
        .bind(b)
        .execute(&pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn admin_commands_list_kick_and_delete_against_the_running_server() {
    // [liveness] grace short: a kicked session is announced like any closed one.
    let setup = Setup::new("[liveness]\ngrace = 0.2\n");
    let d = setup.domain.clone();
    add_user(&setup, "alice", "pw").await;
    add_user(&setup, "bob", "pw").await;
    make_mutual(&format!("alice@{d}"), &format!("bob@{d}")).await;
    let mut server = Server::start(&setup).await;
    server
        .wait_line(|l| l.contains("admin socket listening"))
        .await;
    let sock = setup.dir.join("presenced-admin.sock");
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&sock).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "admin socket is private");
    }
    let trusted = setup.presented();
    let (mut alice, _) = Conn::connect(server.direct_tls, &d, &[&trusted]).await;
    alice.login(&d, "alice", "pw", "a").await;
    alice.send("<presence/>").await;
    let (mut bob, _) = Conn::connect(server.direct_tls, &d, &[&trusted]).await;
    bob.login(&d, "bob", "pw", "b").await;
    bob.send("<presence/>").await;
    alice.until(&format!("from='bob@{d}/b'")).await;

    let out = setup.run(&["user", "list", "--domain", &d]).await;
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("alice@{d}\nbob@{d}\n")
    );

    let out = setup.run(&["session", "list", "--json"]).await;
    assert!(out.status.success(), "{}", text(&out));
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let bob_row = list
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["jid"] == format!("bob@{d}/b"))
        .unwrap_or_else(|| panic!("bob in {list}"));
    assert_eq!(bob_row["transport"], "tcp");
    assert_eq!(bob_row["ip"], "127.0.0.1");
    assert!(bob_row["since"].as_str().unwrap().ends_with('Z'));

    let out = setup
        .run(&[
            "session",
            "kick",
            &format!("bob@{d}/b"),
            "--reason",
            "maintenance",
        ])
        .await;
    assert!(out.status.success(), "{}", text(&out));
    let end = bob.until("</stream:stream>").await;
    assert!(
        end.contains("policy-violation") && end.contains("maintenance"),
        "{end}"
    );
    let gone = alice.until("type='unavailable'").await + &alice.until(">").await;
    assert!(gone.contains(&format!("from='bob@{d}/b'")), "{gone}");

    let out = setup.run(&["stats", "--json"]).await;
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(stats["sessions"], 1, "{stats}");
    assert_eq!(stats["users_online"], 1, "{stats}");
    // The binary runs on jemalloc and says what it holds: live bytes within the pages that
    // hold them, within its resident pages.
    let figure = |name: &str| {
        stats["allocator"][name]
            .as_u64()
            .unwrap_or_else(|| panic!("{name}: {stats}"))
    };
    let (allocated, active, resident) = (figure("allocated"), figure("active"), figure("resident"));
    assert!(allocated > 0, "{stats}");
    assert!(allocated <= active && active <= resident, "{stats}");
    assert!(figure("metadata") > 0, "{stats}");
    let out = setup.run(&["stats"]).await;
    assert!(
        text(&out).contains("allocator.allocated: "),
        "{}",
        text(&out)
    );

    // user del ends bob's new session before the account goes.
    let (mut bob, _) = Conn::connect(server.direct_tls, &d, &[&trusted]).await;
    bob.login(&d, "bob", "pw", "b2").await;
    let out = setup.run(&["user", "del", &format!("bob@{d}")]).await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("1 session(s) ended"), "{}", text(&out));
    let end = bob.until("</stream:stream>").await;
    assert!(end.contains("not-authorized"), "{end}");
    let out = setup.run(&["user", "list"]).await;
    assert!(!String::from_utf8_lossy(&out.stdout).contains(&format!("bob@{d}")));

    let out = setup
        .run(&["session", "kick", &format!("nobody@{d}")])
        .await;
    assert!(!out.status.success());
    assert!(text(&out).contains("no session of"), "{}", text(&out));

    // A password changed while the server runs ends the sessions that logged in with the
    // old one (RFC 6120 §4.9.3.16 reset); the new password logs in.
    let pw = setup.dir.join("alice-new.pw");
    std::fs::write(&pw, "new pw\n").unwrap();
    let out = setup
        .run(&[
            "user",
            "passwd",
            &format!("alice@{d}"),
            "--password-file",
            pw.to_str().unwrap(),
        ])
        .await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("ended 1 session(s)"), "{}", text(&out));
    let end = alice.until("</stream:stream>").await;
    assert!(end.contains("<reset") && end.contains("password"), "{end}");
    let (mut alice, _) = Conn::connect(server.direct_tls, &d, &[&trusted]).await;
    alice.login(&d, "alice", "new pw", "a2").await;

    let (status, _) = server.terminate().await;
    assert!(status.success());
    assert!(!sock.exists(), "the socket goes with the server");
    // Without a server, admin commands say so and name the socket.
    let out = setup.run(&["stats"]).await;
    assert!(!out.status.success());
    assert!(
        text(&out).contains("presenced-admin.sock"),
        "{}",
        text(&out)
    );
}

impl Server {
    /// The address a `… listening` line of the log (already read) names.
    fn listening(&self, what: &str) -> std::net::SocketAddr {
        let line = self
            .log
            .iter()
            .find(|l| l.contains(what))
            .unwrap_or_else(|| panic!("no `{what}` in the log:\n{}", self.log.join("\n")));
        line.split("addr=")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .expect("addr= in the line")
            .parse()
            .expect("socket address")
    }
}

/// One HTTP/1.1 GET over plain TCP; the status code and the body.
async fn http_get(addr: std::net::SocketAddr, path: &str, headers: &str) -> (u16, String) {
    http_get_host(addr, path, "localhost", headers).await
}

/// `GET path` with `Host: host`; the status and the body.
async fn http_get_host(
    addr: std::net::SocketAddr,
    path: &str,
    host: &str,
    headers: &str,
) -> (u16, String) {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n{headers}Connection: close\r\n\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(WAIT, tcp.read_to_end(&mut raw))
        .await
        .expect("answered in time")
        .unwrap();
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").expect("a response head");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status code");
    (status, body.to_owned())
}

async fn status_json(admin: std::net::SocketAddr, token: &str) -> serde_json::Value {
    let (status, body) = http_get(
        admin,
        "/status.json",
        &format!("Authorization: Bearer {token}\r\n"),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

const STATUS_TOKEN: &str = "t0ken-for-the-status-test";

/// A server with Redis (the machine's, under a key prefix of its own) and an admin token.
fn status_setup() -> Setup {
    let redis = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    Setup::new(&format!(
        "token = \"{STATUS_TOKEN}\"\nstatus_poll = 0.25\n[redis]\nurl = \"{redis}\"\n\
         key_prefix = \"ops-status-{}:\"\n",
        unique()
    ))
}

/// The admin listener without a token answers only Host names that cannot be an
/// attacker's (an IP address, localhost, a served domain, `[admin] hosts`), so a web page
/// whose name is pointed at 127.0.0.1 (DNS rebinding) reads no figure; and it holds at
/// most `[admin] max_connections` connections, closing more at once.
#[tokio::test]
async fn the_admin_listener_refuses_foreign_hosts_without_a_token_and_caps_its_connections() {
    let setup = Setup::new("hosts = [\"prometheus-target.example\"]\nmax_connections = 2\n");
    let server = Server::start(&setup).await;
    let admin = server.listening("admin http listening");
    for host in [
        format!("127.0.0.1:{}", admin.port()),
        "localhost".to_owned(),
        format!("{}:5281", setup.domain),
        "Prometheus-Target.example:9090".to_owned(),
    ] {
        let (status, body) = http_get_host(admin, "/metrics", &host, "").await;
        assert_eq!(status, 200, "{host}: {body}");
    }
    let (status, body) =
        http_get_host(admin, "/metrics", "rebound.attacker.example:5281", "").await;
    assert_eq!(status, 421, "{body}");
    assert!(!body.contains("presenced_"), "no figure: {body}");
    // Two idle connections take both places; a third is closed unanswered, and once one
    // goes a new one is answered. A connection just served can hold its place for a moment
    // after its client has read the end (its task ends after the socket closes), so the
    // second may be the one refused: then both go and the three are tried again.
    let deadline = tokio::time::Instant::now() + WAIT;
    let (idle1, idle2) = loop {
        let idle1 = TcpStream::connect(admin).await.unwrap();
        let mut idle2 = TcpStream::connect(admin).await.unwrap();
        let mut third = TcpStream::connect(admin).await.unwrap();
        let (mut second_read, mut third_read) = (Vec::new(), Vec::new());
        let (which, n) = tokio::time::timeout(WAIT, async {
            tokio::select! {
                n = third.read_to_end(&mut third_read) => ("third", n.unwrap_or(0)),
                n = idle2.read_to_end(&mut second_read) => ("second", n.unwrap_or(0)),
            }
        })
        .await
        .expect("one over the cap closed in time");
        assert_eq!(
            n,
            0,
            "closed without an answer: {:?}{:?}",
            String::from_utf8_lossy(&second_read),
            String::from_utf8_lossy(&third_read)
        );
        if which == "third" {
            break (idle1, idle2);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the places of served connections were never freed"
        );
    };
    drop((idle1, idle2));
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let mut tcp = TcpStream::connect(admin).await.unwrap();
        let _ = tcp
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .await;
        let mut raw = Vec::new();
        let _ = tokio::time::timeout(WAIT, tcp.read_to_end(&mut raw)).await;
        if raw.starts_with(b"HTTP/1.1 200") {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "no place freed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn status_json_counts_only_visible_sessions_and_reports_the_stores() {
    let setup = status_setup();
    let d = setup.domain.clone();
    add_user(&setup, "alice", "pw").await;
    add_user(&setup, "bob", "pw").await;
    let server = Server::start(&setup).await;
    let admin = server.listening("admin http listening");

    // Without the token (or with a wrong one) no figure is served, not even /metrics; nor
    // with the right one in the URL, which logs and histories keep.
    for (path, headers) in [
        ("/status.json", ""),
        ("/metrics", ""),
        ("/status.json", "Authorization: Bearer wrong\r\n"),
        ("/status.json?token=wrong", ""),
        (&format!("/status.json?token={STATUS_TOKEN}"), ""),
        (&format!("/metrics?token={STATUS_TOKEN}"), ""),
    ] {
        let (status, _) = http_get(admin, path, headers).await;
        assert_eq!(status, 401, "{path} {headers:?}");
    }
    // The page itself is the same static file for everyone; it takes the token after #.
    let (status, page) = http_get(admin, "/status", "").await;
    assert_eq!(status, 200);
    assert!(page.contains("<svg id=\"chart-online\""), "{page}");
    assert!(
        page.contains("location.hash"),
        "the page reads the token after #"
    );

    // Redis counts as up once a command succeeded; the node's first writes come soon
    // after start (bounded wait, polled).
    let deadline = tokio::time::Instant::now() + WAIT;
    let before = loop {
        let s = status_json(admin, STATUS_TOKEN).await;
        if s["redis"]["up"] == true || tokio::time::Instant::now() > deadline {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(before["online"]["users"], 0, "{before}");
    assert_eq!(before["database"]["up"], true, "{before}");
    assert_eq!(before["database"]["kind"], "postgresql", "{before}");
    assert_eq!(before["redis"]["kind"], "redis", "{before}");
    assert_eq!(before["redis"]["up"], true, "{before}");

    let trusted = setup.presented();
    let (mut alice, _) = Conn::connect(server.direct_tls, &d, &[&trusted]).await;
    alice.login(&d, "alice", "pw", "a").await;
    alice.send("<presence/>").await;
    let (mut bob, _) = Conn::connect(server.direct_tls, &d, &[&trusted]).await;
    bob.login(&d, "bob", "pw", "b").await;
    // XEP-0186: bob goes invisible before his first presence.
    bob.send("<iq type='set' id='inv'><invisible xmlns='urn:xmpp:invisible:0'/></iq>")
        .await;
    bob.until("id='inv'").await;
    bob.send("<presence/>").await;
    alice
        .send(&format!(
            "<message to='bob@{d}' id='m1' type='chat'><body>hi</body></message>"
        ))
        .await;
    bob.until("<body>hi</body>").await;

    let now = status_json(admin, STATUS_TOKEN).await;
    // Positive control: both logins are counted, alice's session is.
    assert_eq!(now["logins_total"]["tcp"], 2, "{now}");
    assert_eq!(now["online"]["tcp"], 1, "{now}");
    // bob is online but invisible: not a session, not a user.
    assert_eq!(now["online"]["users"], 1, "{now}");
    assert_eq!(now["online"]["websocket"], 0, "{now}");
    assert_eq!(now["messages_routed_total"], 1, "{now}");
    assert_eq!(now["poll_ms"], 250, "{now}");
    assert!(now["time_ms"].as_i64() > before["time_ms"].as_i64());
    assert!(
        !now.to_string().contains("bob@"),
        "no JID on the page: {now}"
    );

    // Every figure the Grafana dashboard plots is one /metrics exports.
    let (status, metrics) = http_get(
        admin,
        "/metrics",
        &format!("Authorization: Bearer {STATUS_TOKEN}\r\n"),
    )
    .await;
    assert_eq!(status, 200);
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("packaging/grafana/presenced-dashboard.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let mut checked = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            let names: Vec<&str> = expr
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("presenced_"))
                .collect();
            assert!(!names.is_empty(), "{expr} plots no presenced metric");
            for name in names {
                assert!(
                    metrics
                        .lines()
                        .any(|l| l.split([' ', '{']).next() == Some(name)),
                    "{expr}: {name} is not exported:\n{metrics}"
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 15, "{checked}");

    // What the allocator holds is for operators (the admin socket's `stats`), never here:
    // it grows with every session, invisible ones included.
    assert!(!metrics.contains("allocator"), "{metrics}");

    let (status, _) = server.terminate().await;
    assert!(status.success());
}

#[tokio::test]
async fn status_page_renders_live_charts_in_headless_chromium() {
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "chromium".into());
    let setup = status_setup();
    let d = setup.domain.clone();
    add_user(&setup, "alice", "pw").await;
    let server = Server::start(&setup).await;
    let admin = server.listening("admin http listening");
    let trusted = setup.presented();
    let (mut alice, _) = Conn::connect(server.direct_tls, &d, &[&trusted]).await;
    alice.login(&d, "alice", "pw", "a").await;
    alice.send("<presence/>").await;
    alice.ping(&d, "p").await;

    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("status-page.png");
    let _ = std::fs::remove_file(&shot);
    let dom = tokio::time::timeout(
        Duration::from_secs(60),
        Command::new(&chromium)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--window-size=1200,900",
                "--virtual-time-budget=5000",
                &format!("--screenshot={}", shot.display()),
                &format!("http://{admin}/status#token={STATUS_TOKEN}"),
            ])
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .expect("chromium finished within 60 s")
    .unwrap_or_else(|e| panic!("{chromium} (tests/run.sh installs it): {e}"));
    assert!(dom.status.success(), "{dom:?}");
    let png = std::fs::read(&shot).expect("a screenshot");
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");
    println!("status page screenshot: {}", shot.display());

    // The same page's DOM after its polls: the charts hold lines drawn from the figures.
    let dom = tokio::time::timeout(
        Duration::from_secs(60),
        Command::new(&chromium)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--virtual-time-budget=5000",
                "--dump-dom",
                &format!("http://{admin}/status#token={STATUS_TOKEN}"),
            ])
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .expect("chromium finished within 60 s")
    .expect("chromium runs");
    let html = String::from_utf8_lossy(&dom.stdout);
    for chart in ["online", "logins", "messages", "s2s", "stores"] {
        let at = html
            .find(&format!("id=\"chart-{chart}\""))
            .unwrap_or_else(|| panic!("chart {chart} in {html}"));
        let svg = &html[at..at + html[at..].find("</svg>").unwrap()];
        assert!(
            svg.contains("<polyline"),
            "chart {chart} has no line: {svg}"
        );
    }
    assert!(html.contains("<b>1</b> users"), "alice is counted: {html}");
    assert!(html.contains("class=\"up\""), "stores shown up: {html}");
    let (status, _) = server.terminate().await;
    assert!(status.success());
}

#[tokio::test]
async fn roster_commands_show_add_and_remove_with_live_pushes_and_presence() {
    let setup = Setup::new("");
    let d = setup.domain.clone();
    add_user(&setup, "alice", "pw").await;
    add_user(&setup, "bob", "pw").await;
    let mut server = Server::start(&setup).await;
    server
        .wait_line(|l| l.contains("admin socket listening"))
        .await;
    let trusted = setup.presented();
    let mut online = Vec::new();
    for user in ["alice", "bob"] {
        let (mut c, _) = Conn::connect(server.direct_tls, &d, &[&trusted]).await;
        c.login(&d, user, "pw", "r").await;
        c.send("<iq type='get' id='roster'><query xmlns='jabber:iq:roster'/></iq>")
            .await;
        c.until("id='roster'").await;
        c.until("</iq>").await;
        c.send("<presence/>").await;
        online.push(c);
    }
    let (mut alice, mut bob) = (online.remove(0), online.remove(0));
    let (a, b) = (format!("alice@{d}"), format!("bob@{d}"));

    let out = setup
        .run(&[
            "roster", "add", &a, &b, "--name", "Bobby", "--group", "Friends", "--group", "Work",
        ])
        .await;
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("{a} and {b} are mutual contacts\n")
    );
    // RFC 6121 §2.1.6 pushes to both, and each sees the other's presence. (The database's
    // announcement of the change may reach the server's listener before the command's own
    // replay does, so the order of one user's push and the other's presence is not fixed.)
    let got = alice
        .until_all(&[
            "subscription='both'",
            "<group>Work</group>",
            &format!("from='{b}/r'"),
        ])
        .await;
    let push = &got[got.find("<iq").expect("an iq")..];
    assert!(
        push.contains(&format!("jid='{b}'"))
            && push.contains("name='Bobby'")
            && push.contains("<group>Friends</group>"),
        "{got}"
    );
    let got = bob
        .until_all(&[
            &format!("jid='{a}'"),
            "subscription='both'",
            &format!("from='{a}/r'"),
        ])
        .await;
    assert!(!got.contains("name="), "bob's item has no name: {got}");

    let out = setup.run(&["roster", "show", &a, "--json"]).await;
    assert!(out.status.success(), "{}", text(&out));
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["items"][0]["contact"], b, "{shown}");
    assert_eq!(shown["items"][0]["subscription"], "both", "{shown}");
    assert_eq!(
        shown["items"][0]["groups"],
        serde_json::json!(["Friends", "Work"])
    );
    let out = setup.run(&["roster", "show", &a]).await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("{b}\tboth\tBobby\tFriends,Work\n")
    );

    let out = setup.run(&["roster", "remove", &b, &a, "--json"]).await;
    assert!(out.status.success(), "{}", text(&out));
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(answer["changed"], true, "{answer}");
    // The push, and the presence shown goes with the subscription (RFC 6121 §3.2.2).
    let got = alice
        .until_all(&["subscription='remove'", "type='unavailable'"])
        .await;
    assert!(got.contains(&format!("jid='{b}'")), "{got}");
    let unavailable = &got[got.find("<presence").expect("a presence")..];
    assert!(unavailable.contains(&format!("from='{b}/r'")), "{got}");
    let out = setup.run(&["roster", "show", &a, "--json"]).await;
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["items"], serde_json::json!([]), "{shown}");

    // Bad input is refused by name, and nothing changes.
    for (args, why) in [
        (
            vec!["roster", "add", &a, "nobody@elsewhere.example"],
            "no account nobody@elsewhere.example",
        ),
        (vec!["roster", "add", &a, &a], "cannot be its own contact"),
        (vec!["roster", "show", "not a jid@@"], "not a jid@@"),
    ] {
        let out = setup.run(&args).await;
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", text(&out));
        assert!(text(&out).contains(why), "{args:?}: {}", text(&out));
    }
    let (status, _) = server.terminate().await;
    assert!(status.success());
}

#[tokio::test]
async fn sighup_reloads_limits_for_new_connections_and_privacy_defaults_at_once() {
    let setup = Setup::new("");
    let d = setup.domain.clone();
    add_user(&setup, "alice", "pw").await;
    add_user(&setup, "bob", "pw").await;
    make_mutual(&format!("alice@{d}"), &format!("bob@{d}")).await;
    let mut server = Server::start(&setup).await;
    let trusted = setup.presented();
    let (mut bob, _) = Conn::connect(server.direct_tls, &d, &[&trusted]).await;
    bob.login(&d, "bob", "pw", "b").await;
    bob.send("<presence/>").await;
    let (mut alice, _) = Conn::connect(server.direct_tls, &d, &[&trusted]).await;
    alice.login(&d, "alice", "pw", "a").await;
    alice.send("<presence/>").await;
    // Positive controls: bob sees alice, and a 12000-byte stanza passes.
    bob.until(&format!("from='alice@{d}/a'")).await;
    // A ping whose id makes the stanza over 12000 bytes.
    let big = |tag: &str| format!("{tag}{}", "x".repeat(12000));
    alice.ping(&d, &big("before")).await;

    let text = std::fs::read_to_string(setup.config()).unwrap();
    std::fs::write(
        setup.config(),
        format!("{text}[limits]\nmax_stanza_size = 10000\n[privacy]\nonline = \"nobody\"\n"),
    )
    .unwrap();
    server.signal(libc::SIGHUP);
    server.wait_line(|l| l.contains("reload done")).await;
    for what in ["reloaded [limits]", "reloaded [privacy] defaults"] {
        assert!(
            server.log.iter().any(|l| l.contains(what)),
            "{what}: {}",
            server.log.join("\n")
        );
    }
    assert!(
        !server.log.iter().any(|l| l.contains("after a restart")),
        "nothing here needs a restart: {}",
        server.log.join("\n")
    );
    // The stricter default withdraws the presence bob was shown (alice never chose).
    let gone = bob.until("type='unavailable'").await + &bob.until(">").await;
    assert!(gone.contains(&format!("from='alice@{d}/a'")), "{gone}");

    // The established session keeps the limits it was admitted under...
    alice.ping(&d, &big("after-old")).await;
    // ...a new one gets the new limit: RFC 6120 §4.9.3.14 policy-violation.
    let (mut fresh, _) = Conn::connect(server.direct_tls, &d, &[&trusted]).await;
    fresh.login(&d, "alice", "pw", "new").await;
    fresh
        .send(&format!(
            "<iq type='get' id='{}' to='{d}'><ping xmlns='urn:xmpp:ping'/></iq>",
            big("after-new")
        ))
        .await;
    let end = fresh.until("</stream:stream>").await;
    assert!(end.contains("policy-violation"), "{end}");

    let (status, _) = server.terminate().await;
    assert!(status.success());
}

/// The first container engine whose daemon answers (`docker info` / `podman info`), or why
/// none does.
async fn container_engine() -> Result<&'static str, String> {
    let mut why = Vec::new();
    for engine in ["docker", "podman"] {
        match Command::new(engine)
            .arg("info")
            .stdin(Stdio::null())
            .output()
            .await
        {
            Ok(out) if out.status.success() => return Ok(engine),
            Ok(out) => why.push(format!(
                "{engine} info: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )),
            Err(e) => why.push(format!("{engine}: {e}")),
        }
    }
    Err(why.join("; "))
}

#[tokio::test]
async fn container_image_builds_and_serves_clients_with_the_embedded_default() {
    let engine = match container_engine().await {
        Ok(engine) => engine,
        Err(why) => {
            common::skip(
                "container_image_builds_and_serves_clients_with_the_embedded_default",
                &format!("no container engine answers ({why})"),
            );
            return;
        }
    };
    let tag = format!("presenced-test:{}", unique());
    let root = env!("CARGO_MANIFEST_DIR");
    // A release build inside the image: minutes, not seconds.
    let built = tokio::time::timeout(
        Duration::from_secs(3600),
        Command::new(engine)
            .args(["build", "-t", &tag, root])
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .expect("image built within an hour")
    .unwrap();
    assert!(built.status.success(), "{engine} build: {}", text(&built));
    let name = format!("presenced-test-{}", unique());
    let run = Command::new(engine)
        .args([
            "run",
            "-d",
            "--rm",
            "--name",
            &name,
            "-p",
            "127.0.0.1::5222",
            &tag,
        ])
        .output()
        .await
        .unwrap();
    assert!(run.status.success(), "{engine} run: {}", text(&run));
    let port = Command::new(engine)
        .args(["port", &name, "5222/tcp"])
        .output()
        .await
        .unwrap();
    let addr: std::net::SocketAddr = String::from_utf8_lossy(&port.stdout)
        .lines()
        .next()
        .and_then(|l| l.trim().parse().ok())
        .unwrap_or_else(|| panic!("{engine} port: {}", text(&port)));
    // The server in the container answers a stream header with its features (SQLite, no
    // Redis: nothing else was started).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let features = loop {
        if let Ok(mut tcp) = TcpStream::connect(addr).await {
            let _ = tcp.write_all(Conn::header("example.org").as_bytes()).await;
            let mut buf = vec![0u8; 4096];
            if let Ok(Ok(n)) =
                tokio::time::timeout(Duration::from_secs(5), tcp.read(&mut buf)).await
            {
                let got = String::from_utf8_lossy(&buf[..n]).into_owned();
                if got.contains("starttls") {
                    break got;
                }
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no stream features from the container"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let logs = Command::new(engine)
        .args(["logs", &name])
        .output()
        .await
        .unwrap();
    let _ = Command::new(engine).args(["kill", &name]).output().await;
    let _ = Command::new(engine)
        .args(["rmi", "-f", &tag])
        .output()
        .await;
    assert!(
        features.contains("urn:ietf:params:xml:ns:xmpp-tls"),
        "{features}"
    );
    assert!(
        text(&logs).contains("database=sqlite:/var/lib/presenced/presenced.db"),
        "{}",
        text(&logs)
    );
}

#[tokio::test]
async fn user_del_without_a_server_refuses_while_contacts_elsewhere_would_keep_their_subscription()
{
    // No [admin] socket: the command line deletes in the store itself.
    let setup = Setup::new("");
    let d = setup.domain.clone();
    add_user(&setup, "alice", "pw").await;
    add_user(&setup, "bob", "pw").await;
    let (alice, bob) = (format!("alice@{d}"), format!("bob@{d}"));
    make_mutual(&alice, &bob).await;
    let pool = sqlx::PgPool::connect(&database_url()).await.unwrap();
    let far = format!("carol@far{}.example", unique());
    sqlx::query("INSERT INTO roster_items (owner, contact, subscription) VALUES ($1, $2, 'both')")
        .bind(&alice)
        .bind(&far)
        .execute(&pool)
        .await
        .unwrap();
    let items_for_alice = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM roster_items WHERE contact = $1")
            .bind(&alice)
            .fetch_one(&pool)
            .await
            .unwrap()
    };

    // Only a running server can tell carol's server: refused, nothing deleted.
    let out = setup.run(&["user", "del", &alice]).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains(&far) && text(&out).contains("--local-only"),
        "{}",
        text(&out)
    );
    assert_eq!(items_for_alice().await, 1, "bob still has alice");

    // The operator's explicit choice: deleted, bob's item with it, carol named as not told.
    let out = setup.run(&["user", "del", &alice, "--local-only"]).await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains(&format!("not told (no server running): {far}")),
        "{}",
        text(&out)
    );
    assert_eq!(items_for_alice().await, 0, "no roster keeps alice");
    let out = setup.run(&["user", "del", &bob]).await;
    assert!(out.status.success(), "no contact elsewhere: {}", text(&out));
}

/// Logs `user` in over the WebSocket endpoint at `addr` (RFC 7395) and sends its initial
/// presence; returns the open connection.
async fn websocket_login(
    addr: std::net::SocketAddr,
    domain: &str,
    user: &str,
    password: &str,
) -> tokio_tungstenite::WebSocketStream<TcpStream> {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::Message;
    let mut req = format!("ws://{domain}/xmpp-websocket")
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("Sec-WebSocket-Protocol", "xmpp".parse().unwrap());
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut ws, _) = tokio_tungstenite::client_async(req, tcp)
        .await
        .expect("WebSocket handshake");
    let framing = "urn:ietf:params:xml:ns:xmpp-framing";
    let open = format!("<open xmlns='{framing}' to='{domain}' version='1.0'/>");
    let token = base64::engine::general_purpose::STANDARD.encode(format!("\0{user}\0{password}"));
    let steps = [
        (open.clone(), "</stream:features>"),
        (
            format!("<auth xmlns='urn:ietf:params:xml:ns:xmpp-sasl' mechanism='PLAIN'>{token}</auth>"),
            "<success",
        ),
        (open, "</stream:features>"),
        (
            "<iq xmlns='jabber:client' type='set' id='b1'><bind xmlns='urn:ietf:params:xml:ns:xmpp-bind'>\
             <resource>ws</resource></bind></iq>"
                .to_owned(),
            "id='b1'",
        ),
        (
            "<presence xmlns='jabber:client'/>".to_owned(),
            "<presence",
        ),
        (
            format!("<iq xmlns='jabber:client' type='get' id='p1' to='{domain}'><ping xmlns='urn:xmpp:ping'/></iq>"),
            "id='p1'",
        ),
    ];
    for (send, expect) in steps {
        ws.send(Message::Text(send.into())).await.unwrap();
        loop {
            let m = tokio::time::timeout(WAIT, ws.next())
                .await
                .unwrap_or_else(|_| panic!("no `{expect}`"))
                .unwrap_or_else(|| panic!("closed before `{expect}`"))
                .expect("frame");
            if matches!(&m, Message::Text(t) if t.contains(expect)) {
                break;
            }
        }
    }
    ws
}

/// Graceful stop waits for WebSocket sessions as for TCP ones: the session's end (its
/// unavailable presence, its last seen) is not cut off when the process exits.
#[tokio::test]
async fn sigterm_waits_for_websocket_sessions_to_end_and_writes_their_last_seen() {
    let setup = Setup::new("");
    let text = std::fs::read_to_string(setup.config()).unwrap();
    std::fs::write(
        setup.config(),
        text.replace(
            "[http]\nenabled = false",
            "[http]\nbind = \"127.0.0.1\"\nport = 0\ntls = false",
        ),
    )
    .unwrap();
    add_user(&setup, "carol", "pw").await;
    let server = Server::start(&setup).await;
    let line = server
        .log
        .iter()
        .find(|l| l.contains("http listening"))
        .expect("http listening line")
        .clone();
    let http: std::net::SocketAddr = line
        .split("addr=")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .expect("address")
        .parse()
        .unwrap();
    let _carol = websocket_login(http, &setup.domain, "carol", "pw").await;
    let (status, log) = server.terminate().await;
    assert!(status.success(), "exit after SIGTERM: {status:?}");
    assert!(log.iter().any(|l| l.contains("stopped")), "{log:?}");
    let seen = last_seen(&format!("carol@{}", setup.domain)).await;
    assert!(
        seen.is_some(),
        "last seen of the WebSocket session written at shutdown"
    );
}
