//! Profanity (the console client from Debian) against the real server: it runs in a tmux
//! session of its own and the test types into it exactly what the README tells a user to
//! type, then reads its screen (`tmux capture-pane`, polled with a deadline). The contact
//! and a second resource of the user are this harness's raw client.
//!
//! A missing `profanity` or `tmux` fails the test (tests/run.sh installs both when root).

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

/// How long one screen may take to show what the test waits for.
const SCREEN_WAIT: Duration = Duration::from_secs(20);

/// One program in a private tmux server (its own socket), killed with that server.
struct Tmux {
    socket: PathBuf,
}

impl Tmux {
    /// Starts `cmd` in a detached 200×150 session (tall enough for the whole console), with `HOME` and the XDG directories in
    /// `home` so it reads no configuration of the machine's.
    fn start(home: &Path, cmd: &str) -> Tmux {
        let tmux = on_path("tmux").expect("tmux is not installed: tests/run.sh installs it");
        let socket = home.join("tmux.sock");
        let env = format!(
            "env HOME={h} XDG_CONFIG_HOME={h}/config XDG_DATA_HOME={h}/data LANG=C.UTF-8 {cmd}",
            h = home.display()
        );
        let status = std::process::Command::new(tmux)
            .arg("-S")
            .arg(&socket)
            .args([
                "-f",
                "/dev/null",
                "new-session",
                "-d",
                "-s",
                "t",
                "-x",
                "200",
                "-y",
                "150",
            ])
            .arg(env)
            .status()
            .expect("run tmux");
        assert!(status.success(), "tmux new-session: {status}");
        Tmux { socket }
    }

    fn tmux(&self, args: &[&str]) -> String {
        let out = std::process::Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("run tmux");
        assert!(
            out.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Types `line` literally and presses Enter.
    fn type_line(&self, line: &str) {
        self.tmux(&["send-keys", "-t", "t", "-l", line]);
        self.tmux(&["send-keys", "-t", "t", "Enter"]);
    }

    /// The screen as text, wrapped lines joined.
    fn screen(&self) -> String {
        self.tmux(&["capture-pane", "-p", "-J", "-t", "t"])
    }

    /// Polls the screen until `pred` holds, failing with the screen after [`SCREEN_WAIT`].
    async fn wait_for(&self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let deadline = tokio::time::Instant::now() + SCREEN_WAIT;
        loop {
            let screen = self.screen();
            if pred(&screen) {
                return screen;
            }
            if tokio::time::Instant::now() > deadline {
                panic!("Profanity's screen never showed {what}:\n{screen}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = std::process::Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .arg("kill-server")
            .status();
    }
}

/// The lines of a screen that report a server's error.
fn error_lines(screen: &str) -> Vec<&str> {
    screen
        .lines()
        .filter(|l| {
            let l = l.to_ascii_lowercase();
            l.contains("service-unavailable")
                || l.contains("feature-not-implemented")
                || l.contains("server error")
        })
        .collect()
}

/// Profanity connects with the README's command and accepts the development certificate
/// with `/tls always`, subscribes with the README's commands (`/roster add`,
/// `/sub request`, `/sub allow`), enables carbons (it does by default: a message the user's other
/// resource sends shows in its window), sends and receives a message, and neither its
/// chat window nor its console shows a server error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn profanity_logs_in_with_carbons_and_chats_without_server_errors() {
    let profanity = on_path("profanity")
        .expect("profanity is not installed: tests/run.sh installs Debian's profanity");
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let (alice, bob_jid) = (ts.jid("alice"), ts.jid("bob"));
    let mut bob = ts.login("bob", "pc").await;
    bob.presence(None, None).await;

    let home = std::env::temp_dir().join(format!("presenced-profanity-{}", unique()));
    std::fs::create_dir_all(&home).unwrap();
    let term = Tmux::start(&home, &profanity.display().to_string());
    term.wait_for("its start screen", |s| s.contains("Profanity"))
        .await;

    // The README's instructions, word for word but for the test's domain and port.
    term.type_line(&format!(
        "/connect {alice} server 127.0.0.1 port {} tls force",
        ts.addr.port()
    ));
    term.wait_for("the password prompt", |s| s.contains("Enter password"))
        .await;
    term.type_line("pw");
    term.wait_for("the untrusted certificate's question", |s| {
        s.contains("/tls always")
    })
    .await;
    term.type_line("/tls always");
    term.wait_for("the login", |s| s.contains("logged in successfully"))
        .await;

    // The README's subscription steps: alice asks, bob (the raw client) approves and asks
    // back, alice allows.
    term.type_line(&format!("/roster add {bob_jid}"));
    term.type_line(&format!("/sub request {bob_jid}"));
    bob.expect(|e| is_presence(e, &alice, Some("subscribe")))
        .await;
    bob.send(&presence_to("subscribed", &alice)).await;
    bob.send(&presence_to("subscribe", &alice)).await;
    let asked = format!("Received authorization request from {bob_jid}");
    term.wait_for("bob's subscription request", |s| s.contains(&asked))
        .await;
    term.type_line(&format!("/sub allow {bob_jid}"));
    bob.expect(|e| is_presence(e, &alice, Some("subscribed")))
        .await;
    bob.expect(|e| is_presence(e, &alice, None)).await;

    let sent = format!("hello from profanity {}", unique());
    term.type_line(&format!("/msg {bob_jid} {sent}"));
    let got = bob.expect(|e| has_body(e, &sent)).await;
    assert!(got.get_attr("from").unwrap().starts_with(&alice), "{got}");

    let reply = format!("reply to profanity {}", unique());
    bob.send(&chat(&alice, &reply)).await;
    term.wait_for("the contact's reply", |s| s.contains(&reply))
        .await;

    // XEP-0280: what the user sends from another resource shows in Profanity's window only
    // if Profanity enabled carbons.
    let mut desk = ts.login("alice", "desk").await;
    desk.presence(None, None).await;
    let from_desk = format!("sent from the desk {}", unique());
    desk.send(&chat(&bob_jid, &from_desk)).await;
    bob.expect(|e| has_body(e, &from_desk)).await;
    let chat_screen = term
        .wait_for("the carbon copy of the desk's message", |s| {
            s.contains(&from_desk)
        })
        .await;

    // Every answer to what Profanity asked at login came before the carbon above.
    term.type_line("/win 1");
    let console = term
        .wait_for("the console window", |s| {
            s.contains("logged in successfully")
        })
        .await;
    eprintln!("chat window:\n{chat_screen}\nconsole:\n{console}");
    for screen in [&chat_screen, &console] {
        let errors = error_lines(screen);
        assert!(
            errors.is_empty(),
            "Profanity shows server errors {errors:?}:\n{screen}"
        );
    }
    term.type_line("/quit");
    drop(term);
    let _ = std::fs::remove_dir_all(&home);
    ts.stop().await;
}
