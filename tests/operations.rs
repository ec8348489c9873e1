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
        format!("{text}[limits]\nmax_stanza_size = 20000\n[log]\nlevel = \"debug\"\n"),
    )
    .unwrap();
    server.signal(libc::SIGHUP);
    let line = server
        .wait_line(|l| l.contains("takes effect after a restart"))
        .await;
    assert!(line.contains("[limits]"), "{line}");
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
    let pool = sqlx::PgPool::connect(&database_url()).await.unwrap();
    let seen: Option<(chrono::DateTime<chrono::Utc>,)> =
        sqlx::query_as("SELECT seen_at FROM last_activity WHERE jid = $1")
            .bind(format!("bob@{}", setup.domain))
            .fetch_optional(&pool)
            .await
            .unwrap();
    assert!(seen.is_some(), "last seen written at shutdown");
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
