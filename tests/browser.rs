//! Stock web clients this project did not write, against the real server (PostgreSQL,
//! Redis, TLS): converse.js from npm in headless Chromium over RFC 7395 WebSocket, driven
//! by `tests/browser/converse.mjs` (puppeteer-core); the contact is this harness's raw
//! client. The Node package is `tests/browser` (package-lock.json; `tests/run.sh` runs
//! `npm ci` there and installs Debian's `chromium` when missing). A missing Node, Chromium
//! or `node_modules` fails these tests: they never pass by not running.
//!
//! Screenshots and converse.js' whole console log (every stanza in and out) go to
//! `target/browser-screenshots/`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use common::*;
use presenced::protocol::xml::{NS_DELAY, NS_DISCO_INFO};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};

/// How long one client run may take before it fails (loaded CI machines included).
const CLIENT_LIMIT: Duration = Duration::from_secs(60);

/// The Node package of the browser tests.
fn package_dir() -> PathBuf {
    repo_root().join("tests/browser")
}

/// Where screenshots and logs go: `target/browser-screenshots/`.
fn out_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("target directory")
        .join("browser-screenshots")
}

/// Node, Chromium (`PRESENCED_CHROMIUM` overrides) and the installed package, or a failure
/// that says how to get them.
fn tools() -> (PathBuf, PathBuf) {
    let node = on_path("node").expect("node is not installed: tests/run.sh installs nodejs/npm");
    let chromium = std::env::var_os("PRESENCED_CHROMIUM")
        .map(PathBuf::from)
        .or_else(|| on_path("chromium"))
        .or_else(|| on_path("chromium-browser"))
        .expect("chromium is not installed: tests/run.sh installs Debian's chromium");
    assert!(
        package_dir().join("node_modules/puppeteer-core").is_dir()
            && package_dir()
                .join("node_modules/converse.js/dist/converse.min.js")
                .is_file(),
        "tests/browser/node_modules is missing: run `npm ci --ignore-scripts` in tests/browser \
         (tests/run.sh does)"
    );
    (node, chromium)
}

/// A Node driver script that reports `{"step": ...}` lines on its standard output and waits
/// for a line on its standard input where the test acts.
struct Driver {
    child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
    stderr: PathBuf,
    deadline: tokio::time::Instant,
}

impl Driver {
    async fn start(script: &str, config: &Value, env: &[(&str, &Path)]) -> Driver {
        let (node, _) = tools();
        std::fs::create_dir_all(out_dir()).unwrap();
        let stderr = out_dir().join(format!("{script}.stderr"));
        let mut cmd = tokio::process::Command::new(node);
        cmd.arg(package_dir().join(script))
            .arg(config.to_string())
            .current_dir(package_dir())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("start node");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        Driver {
            child,
            stdin,
            stdout,
            stderr,
            deadline: tokio::time::Instant::now() + CLIENT_LIMIT,
        }
    }

    /// Reads reports until `{"step": step}`; a `failed` report, an exit or the deadline
    /// fails the test with what the driver said.
    async fn step(&mut self, step: &str) -> Value {
        loop {
            let line = tokio::time::timeout_at(self.deadline, self.stdout.next_line()).await;
            let line = match line {
                Ok(Ok(Some(l))) => l,
                Ok(_) => panic!("driver exited before {step}: {}", self.stderr_text()),
                Err(_) => panic!(
                    "driver did not reach {step} in time: {}",
                    self.stderr_text()
                ),
            };
            let v: Value = serde_json::from_str(&line)
                .unwrap_or_else(|_| panic!("driver printed a line that is not JSON: {line}"));
            match v["step"].as_str() {
                Some(s) if s == step => return v,
                Some("failed") => self.failed(&v, &format!("before {step}")),
                _ => {}
            }
        }
    }

    /// Lets the driver go on past a point where it waits for the test.
    async fn proceed(&mut self) {
        self.stdin.write_all(b"go\n").await.expect("driver stdin");
        self.stdin.flush().await.unwrap();
    }

    /// Waits for the driver's exit, which must be a success.
    async fn finish(mut self) {
        let status = tokio::time::timeout_at(self.deadline, self.child.wait())
            .await
            .expect("driver exits in time")
            .unwrap();
        if !status.success() {
            // The driver says why in a `failed` report, which may follow the last step read.
            while let Ok(Some(line)) = self.stdout.next_line().await {
                let v: Value = serde_json::from_str(&line).unwrap_or_default();
                if v["step"] == "failed" {
                    self.failed(&v, &format!("at the end ({status})"));
                }
            }
            panic!("driver: {status}: {}", self.stderr_text());
        }
    }

    /// Fails the test with a driver's `failed` report.
    fn failed(&self, report: &Value, when: &str) -> ! {
        panic!(
            "driver failed {when}: {}\n(console log and screenshot in {})\n{}",
            report["error"].as_str().unwrap_or_default(),
            out_dir().display(),
            self.stderr_text()
        )
    }

    fn stderr_text(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
}

/// The errors a client received that the server must not give it: any message or presence
/// error, and any iq error answering a request in a namespace the server or the account
/// advertises (the namespace itself or a `ns#feature` of it, as XEP-0060 names its
/// features), except `item-not-found`, the answer for a node or item nobody created
/// (XEP-0060 §6.5.9.11). Requests in namespaces neither advertises may be
/// refused.
fn errors_for_advertised(report: &Value, advertised: &[String]) -> Vec<String> {
    let covered = |ns: &str| {
        advertised
            .iter()
            .any(|f| f == ns || f.strip_prefix(ns).is_some_and(|rest| rest.starts_with('#')))
    };
    report["stanza_errors"]
        .as_array()
        .expect("stanza_errors in report")
        .iter()
        .filter(|e| {
            e["stanza"] != "iq"
                || (e["request"]["ns"].as_str().is_some_and(covered)
                    && e["condition"] != "item-not-found")
        })
        .map(|e| e["xml"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// Whether the client's request `ns`/`ty` got a `result` (and no error).
fn answered(report: &Value, ns: &str, ty: &str) -> bool {
    let replies = report["iq_replies"]
        .as_array()
        .expect("iq_replies in report");
    let of = |t: &str| {
        replies
            .iter()
            .any(|r| r["type"] == t && r["request"]["ns"] == ns && r["request"]["type"] == ty)
    };
    of("result") && !of("error")
}

/// A 32×32 PNG (a red and blue checkerboard), the contact's avatar.
const AVATAR_PNG: &str = "iVBORw0KGgoAAAANSUhEUgAAACAAAAAgCAIAAAD8GO2jAAAAOUlEQVR42mO4YGCAFSkkXMCKSFXPMGrBqAVDwAJqGYRL/agFoxYMBQtGi4pRC0YtGK0PRi0YtQCIALLfAEzUfsoqAAAAAElFTkSuQmCC";

/// The raw client publishes `png` (base64) as its XEP-0084 avatar, data then metadata
/// (XEP-0084 §4.1, §4.2), and sends available presence again.
async fn publish_avatar(ts: &TestServer, c: &mut Client, png: &str) {
    use base64::Engine;
    use sha1::Digest;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(png)
        .unwrap();
    let id: String = sha1::Sha1::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let len = bytes.len();
    for (node, payload) in [
        (
            "urn:xmpp:avatar:data",
            format!("<data xmlns='urn:xmpp:avatar:data'>{png}</data>"),
        ),
        (
            "urn:xmpp:avatar:metadata",
            format!(
                "<metadata xmlns='urn:xmpp:avatar:metadata'><info id='{id}' bytes='{len}' \
                 type='image/png' width='32' height='32'/></metadata>"
            ),
        ),
    ] {
        let publish = presenced::protocol::xml::parse_element(&format!(
            "<pubsub xmlns='http://jabber.org/protocol/pubsub'><publish node='{node}'>\
             <item id='{id}'>{payload}</item></publish></pubsub>"
        ))
        .unwrap();
        let r = c.iq("set", None, publish).await;
        assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    }
    c.presence(None, None).await;
    barrier(ts, c).await;
}

/// A server (`tweak` adjusts its config) where alice and bob are mutual contacts, and bob
/// online and available on the raw client.
async fn with_contact_online(
    tweak: impl FnOnce(&mut presenced::config::Config),
) -> (TestServer, Client) {
    let ts = TestServer::start(tweak).await;
    ts.user("alice").await;
    ts.user("bob").await;
    ts.make_mutual("alice", "bob").await;
    let mut bob = ts.login("bob", "pc").await;
    bob.presence(None, None).await;
    (ts, bob)
}

/// converse.js logs in over WebSocket (wss with the development certificate), shows the
/// contact online with the avatar the contact published over PEP (XEP-0084; converse.js
/// reads it as a vCard, XEP-0153, through the server's XEP-0398 conversion) and the
/// message the contact sent while it was offline (with its XEP-0203 delay), enables carbons, blocks and unblocks through XEP-0191, goes inactive
/// (XEP-0352) and still gets a message at once, and the user's typed reply reaches the
/// contact; no request in a feature the server advertises gets an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn converse_js_logs_in_over_websocket_and_chats() {
    let (_, chromium) = tools();
    let (ts, mut bob) = with_contact_online(|c| c.http.tls = true).await;
    let (alice, bob_jid) = (ts.jid("alice"), ts.jid("bob"));
    // What the server and an account advertise (XEP-0030): converse.js asks both.
    let mut advertised = server_features(&ts, &mut bob).await;
    advertised.extend(disco_features(&mut bob, &bob_jid).await);
    publish_avatar(&ts, &mut bob, AVATAR_PNG).await;
    // Alice has never logged in: this one waits in offline storage (XEP-0160).
    let offline_body = format!("sent while you were away {}", unique());
    bob.send(&chat(&alice, &offline_body)).await;
    barrier(&ts, &mut bob).await;

    let live_body = format!("while you are idle {}", unique());
    let reply_body = format!("hello from converse.js {}", unique());
    let config = json!({
        "ws_url": format!("wss://127.0.0.1:{}{}", ts.http_addr().port(), ts.config.http.websocket_path),
        "jid": alice,
        "password": "pw",
        "contact": bob_jid,
        "offline_body": offline_body,
        "live_body": live_body,
        "reply_body": reply_body,
        "block_jid": ts.jid("mallory"),
        "avatar_base64": AVATAR_PNG,
        "out_dir": out_dir(),
        "chromium": chromium,
        "timeout_ms": CLIENT_LIMIT.as_millis() as u64 - 5000,
    });
    let mut converse = Driver::start("converse.mjs", &config, &[]).await;

    converse.step("logged-in").await;
    // converse.js' initial presence reaches the contact.
    bob.expect(|e| is_presence(e, &alice, None)).await;
    // The roster shows the contact's picture: the very bytes bob published.
    let avatar = converse.step("avatar-shown").await;
    assert_eq!(
        avatar["href"],
        format!("data:image/png;base64,{AVATAR_PNG}").as_str(),
        "{avatar}"
    );
    let shot = PathBuf::from(avatar["screenshot"].as_str().unwrap());
    assert!(
        std::fs::read(&shot).unwrap().starts_with(b"\x89PNG"),
        "{shot:?}"
    );
    let offline = converse.step("offline-shown").await;
    assert_eq!(
        offline["delayed"], true,
        "offline message without delay: {offline}"
    );

    converse.step("inactive").await;
    bob.send(&chat(&alice, &live_body)).await;
    converse.proceed().await;
    let live = converse.step("live-shown").await;
    assert_eq!(
        live["delayed"], false,
        "a live message came as delayed: {live}"
    );

    converse.step("replied").await;
    let reply = bob.expect(|e| has_body(e, &reply_body)).await;
    assert!(
        reply.get_attr("from").unwrap().starts_with(&alice),
        "{reply}"
    );
    assert!(reply.get_child("delay", NS_DELAY).is_none(), "{reply}");
    converse.proceed().await;

    let report = converse.step("report").await;
    converse.finish().await;
    let refused = errors_for_advertised(&report, &advertised);
    assert!(
        refused.is_empty(),
        "converse.js got errors for features the server advertises ({advertised:?}):\n{}\n(console log in {})",
        refused.join("\n"),
        out_dir().display()
    );
    for (ns, ty, what) in [
        ("jabber:iq:roster", "get", "roster"),
        ("urn:xmpp:carbons:2", "set", "carbons enable (XEP-0280)"),
        ("urn:xmpp:blocking", "get", "block list (XEP-0191)"),
        ("urn:xmpp:blocking", "set", "block and unblock (XEP-0191)"),
        (NS_DISCO_INFO, "get", "disco#info"),
        ("vcard-temp", "get", "vCards (XEP-0054)"),
    ] {
        assert!(
            answered(&report, ns, ty),
            "{what}: not answered with a result: {report}"
        );
    }
    let shot = PathBuf::from(report["screenshot"].as_str().unwrap());
    let png = std::fs::read(&shot).expect("screenshot");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "{shot:?}"
    );
    ts.stop().await;
}

/// Node's major version (`node --version` is `vMAJOR.MINOR.PATCH`).
fn node_major() -> u32 {
    let (node, _) = tools();
    let out = std::process::Command::new(node)
        .arg("--version")
        .output()
        .expect("node --version");
    let v = String::from_utf8_lossy(&out.stdout);
    v.trim()
        .trim_start_matches('v')
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or_else(|| panic!("node --version: {v}"))
}

/// Where @xmpp/client connects, by name: TCP with STARTTLS, and WebSocket on the test
/// server's HTTP listener, plain on loopback, which @xmpp/client counts as secure.
fn xmpp_client_services(ts: &TestServer) -> [(&'static str, String); 2] {
    [
        ("tcp", format!("xmpp://127.0.0.1:{}", ts.addr.port())),
        (
            "websocket",
            format!(
                "ws://127.0.0.1:{}{}",
                ts.http_addr().port(),
                ts.config.http.websocket_path
            ),
        ),
    ]
}

/// The environment @xmpp/client runs in: the test certificate trusted, and Node's
/// WebSocket (behind a flag in Node 20, built in from 22).
fn xmpp_client_env(ts: &TestServer) -> Vec<(&'static str, &Path)> {
    static FLAG: std::sync::LazyLock<PathBuf> =
        std::sync::LazyLock::new(|| PathBuf::from("--experimental-websocket"));
    let major = node_major();
    assert!(
        major >= 20,
        "@xmpp/client needs Node 20 or later, this is {major}"
    );
    let mut env: Vec<(&str, &Path)> = vec![("NODE_EXTRA_CA_CERTS", &ts.cert)];
    if major < 22 {
        env.push(("NODE_OPTIONS", FLAG.as_path()));
    }
    env
}

/// @xmpp/client logs in over TCP with STARTTLS (verifying the server's certificate for
/// its domain, trusted through `NODE_EXTRA_CA_CERTS` as the README says) and over
/// WebSocket, sends the contact a message and gets the answer, with no error stanza.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xmpp_client_logs_in_over_tcp_and_websocket_and_chats() {
    let (ts, mut bob) = with_contact_online(|_| {}).await;
    let (alice, bob_jid) = (ts.jid("alice"), ts.jid("bob"));

    for (resource, service) in xmpp_client_services(&ts) {
        let send_body = format!("hello from @xmpp/client over {resource} {}", unique());
        let expect_body = format!("answer over {resource} {}", unique());
        let config = json!({
            "service": service,
            "domain": ts.domain,
            "username": "alice",
            "password": "pw",
            "resource": resource,
            "contact": bob_jid,
            "send_body": send_body,
            "expect_body": expect_body,
            "timeout_ms": 20_000,
        });
        let mut xmpp = Driver::start("xmpp-client.mjs", &config, &xmpp_client_env(&ts)).await;
        eprintln!("@xmpp/client over {service}");
        let online = xmpp.step("online").await;
        // It authenticates with XEP-0388 SASL2 and binds with XEP-0386, whose resource is
        // the server's, starting with the client's tag (its configured resource).
        let full = online["jid"].as_str().unwrap_or_default().to_owned();
        assert!(
            full.starts_with(&format!("{alice}/{resource}.")),
            "{online}"
        );
        let got = bob.expect(|e| has_body(e, &send_body)).await;
        assert_eq!(got.get_attr("from"), Some(full.as_str()), "{got}");
        bob.send(&chat(&full, &expect_body)).await;
        let report = xmpp.step("report").await;
        assert_eq!(report["from"], bob.jid.as_str(), "{report}");
        assert_eq!(report["errors"], json!([]), "{resource}: {report}");
        xmpp.finish().await;
    }
    ts.stop().await;
}

/// XEP-0484 with a stock client: @xmpp/client logs in with its password over SASL2 and
/// keeps the token the server gives it; it then reconnects as the same installation with
/// a wrong password, so only the token can log it in, and is online again; the same token
/// from another installation is refused. Over TCP and WebSocket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xmpp_client_reconnects_with_a_fast_token_over_tcp_and_websocket() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    let alice = ts.jid("alice");
    for (resource, service) in xmpp_client_services(&ts) {
        let config = json!({
            "service": service,
            "domain": ts.domain,
            "username": "alice",
            "password": "pw",
            "resource": resource,
            "timeout_ms": 30_000,
        });
        let mut xmpp = Driver::start("xmpp-client-fast.mjs", &config, &xmpp_client_env(&ts)).await;
        eprintln!("@xmpp/client FAST over {service}");
        let token = xmpp.step("token").await;
        assert_eq!(token["mechanism"], "HT-SHA-256-NONE", "{token}");
        let fast = xmpp.step("fast").await;
        let full = fast["jid"].as_str().unwrap_or_default();
        assert!(full.starts_with(&format!("{alice}/{resource}.")), "{fast}");
        let refused = xmpp.step("refused").await;
        assert_eq!(refused["error"], "not-authorized", "{refused}");
        xmpp.finish().await;
    }
    ts.stop().await;
}
