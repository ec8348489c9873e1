//! Client-to-server core against the real server, PostgreSQL and TLS.
//!
//! Every test starts its own server on its own domain, so they run in parallel. Tests that
//! feed the server bad input end with [`assert_still_serving`]: two fresh users on the same
//! server log in and exchange a message, proving the violation cost only its sender.
//!
//! Negative expectations ("resource X got nothing") are proven with a barrier, not a wait:
//! the sender follows up with a marker stanza to the same recipient, and since one session
//! routes in order, the marker arriving first proves nothing else was queued before it.

mod common;

use std::net::IpAddr;
use std::time::{Duration, Instant};

use common::*;
use presenced::protocol::xml::{self as x, Element, NS_CLIENT, NS_ROSTER};

/// How long a slixmpp script may take before the test fails.
const SCRIPT_LIMIT: Duration = Duration::from_secs(40);

fn body(el: &Element) -> String {
    el.get_child("body", NS_CLIENT)
        .map(|b| b.text_content())
        .unwrap_or_default()
}

fn is_message(el: &Element) -> bool {
    el.name == "message"
}

/// Two fresh users log in from `source` and exchange a message: the server still serves.
async fn assert_still_serving_from(ts: &TestServer, source: IpAddr) {
    let (a, b) = (format!("ok{}", unique()), format!("ok{}", unique()));
    ts.user(&a).await;
    ts.user(&b).await;
    let mut ca = Client::login_from(ts, source, &a, "pw", "r").await;
    let mut cb = Client::login_from(ts, source, &b, "pw", "r").await;
    ca.send(&chat(&cb.jid, "still serving")).await;
    let got = cb.expect(is_message).await;
    assert_eq!(body(&got), "still serving");
    assert_eq!(got.get_attr("from"), Some(ca.jid.as_str()));
    ca.close().await;
    cb.close().await;
}

async fn assert_still_serving(ts: &TestServer) {
    assert_still_serving_from(ts, IpAddr::from([127, 0, 0, 1])).await
}

/// Sends `marker` from `from` to `to`'s full JID and asserts it is the next message `to`
/// receives: nothing was routed to `to` before it.
async fn assert_no_message_before_marker(from: &mut Client, to: &mut Client) {
    let marker = format!("marker-{}", unique());
    from.send(&chat(&to.jid, &marker)).await;
    let next = to.expect(is_message).await;
    assert_eq!(
        body(&next),
        marker,
        "{} got an unexpected message first",
        to.jid
    );
}

/// Sends a ping to the server and returns every stanza that arrived before its answer.
async fn stanzas_until_ping_reply(c: &mut Client, domain: &str) -> Vec<Element> {
    let id = unique();
    let ping = Element::new("iq", NS_CLIENT)
        .attr("type", "get")
        .attr("id", id.clone())
        .attr("to", domain)
        .child(Element::new("ping", x::NS_PING));
    c.send(&ping).await;
    let mut before = std::mem::take(&mut c.backlog);
    loop {
        let el = c.next_stanza(WAIT).await.expect("stanza before ping reply");
        if el.name == "iq" && el.get_attr("id") == Some(id.as_str()) {
            assert_eq!(el.get_attr("type"), Some("result"), "{el}");
            return before;
        }
        before.push(el);
    }
}

// ---------------------------------------------------------------------------------------
// Login with a client library this project did not write (slixmpp).

async fn slixmpp_login(
    ts: &TestServer,
    user: &str,
    password: &str,
    mechanism: &str,
    direct_tls: bool,
) -> ScriptOutput {
    let addr = if direct_tls { ts.direct_addr } else { ts.addr };
    let mut args = vec![
        addr.ip().to_string(),
        addr.port().to_string(),
        ts.domain.clone(),
        user.to_owned(),
        password.to_owned(),
        mechanism.to_owned(),
        ts.cert.display().to_string(),
    ];
    if direct_tls {
        args.push("direct_tls".into());
    }
    run_client_script("login.py", &args, SCRIPT_LIMIT).await
}

fn assert_slixmpp_logged_in(out: &ScriptOutput, ts: &TestServer, user: &str, mech: &str) {
    assert_eq!(out.code, Some(0), "slixmpp failed: {out:?}");
    assert_eq!(out.get("mechanism").as_deref(), Some(mech), "{out:?}");
    let jid = out.get("jid").unwrap_or_default();
    let prefix = format!("{}/", ts.jid(user));
    assert!(jid.starts_with(&prefix), "bound JID {jid} is not {prefix}*");
    // RFC 6120 §7.6: no resource asked for, so the server generated a non-empty one.
    assert!(
        jid.len() > prefix.len(),
        "empty generated resource in {jid}"
    );
    assert_eq!(out.get("own_presence_echoed").as_deref(), Some("true"));
    assert!(
        out.get("roster_ver").is_some_and(|v| !v.is_empty()),
        "{out:?}"
    );
}

#[tokio::test]
async fn slixmpp_logs_in_with_scram_sha_256_over_starttls() {
    let ts = TestServer::start(|_| {}).await;
    ts.add_user("alice", "wonder land").await;
    let out = slixmpp_login(&ts, "alice", "wonder land", "SCRAM-SHA-256", false).await;
    assert_slixmpp_logged_in(&out, &ts, "alice", "SCRAM-SHA-256");
    assert_eq!(out.get("starttls_negotiated").as_deref(), Some("true"));
    ts.stop().await;
}

#[tokio::test]
async fn slixmpp_logs_in_with_scram_sha_1_over_starttls() {
    let ts = TestServer::start(|_| {}).await;
    ts.add_user("alice", "s3cret!").await;
    let out = slixmpp_login(&ts, "alice", "s3cret!", "SCRAM-SHA-1", false).await;
    assert_slixmpp_logged_in(&out, &ts, "alice", "SCRAM-SHA-1");
    assert_eq!(out.get("starttls_negotiated").as_deref(), Some("true"));
    ts.stop().await;
}

#[tokio::test]
async fn slixmpp_logs_in_over_direct_tls_on_the_xep_0368_port() {
    let ts = TestServer::start(|_| {}).await;
    ts.add_user("alice", "direct").await;
    let out = slixmpp_login(&ts, "alice", "direct", "SCRAM-SHA-256", true).await;
    assert_slixmpp_logged_in(&out, &ts, "alice", "SCRAM-SHA-256");
    assert_eq!(out.get("tls").as_deref(), Some("direct"));
    // Direct TLS: the stream never offered or negotiated STARTTLS.
    assert_eq!(out.get("starttls_negotiated").as_deref(), Some("false"));
    ts.stop().await;
}

#[tokio::test]
async fn slixmpp_with_wrong_password_or_unknown_user_gets_not_authorized() {
    let ts = TestServer::start(|_| {}).await;
    ts.add_user("alice", "right").await;
    let out = slixmpp_login(&ts, "alice", "wrong", "SCRAM-SHA-256", false).await;
    assert_eq!(out.code, Some(1), "{out:?}");
    assert_eq!(out.get("error").as_deref(), Some("failed_auth"), "{out:?}");
    assert_eq!(out.get("condition").as_deref(), Some("not-authorized"));
    // An unknown account fails the same way (RFC 6120 §6.5.10), revealing nothing more.
    let out = slixmpp_login(&ts, "nobody", "right", "SCRAM-SHA-256", false).await;
    assert_eq!(out.get("error").as_deref(), Some("failed_auth"), "{out:?}");
    assert_eq!(out.get("condition").as_deref(), Some("not-authorized"));
    ts.stop().await;
}

#[tokio::test]
async fn slixmpp_users_add_each_other_subscribe_with_auto_authorize_and_chat() {
    let ts = TestServer::start(|_| {}).await;
    ts.add_user("alice", "pa").await;
    ts.add_user("bob", "pb").await;
    let args = client_script_args(&ts, &["alice", "pa", "bob", "pb"]);
    let out = run_client_script("scenario.py", &args, SCRIPT_LIMIT).await;
    assert_eq!(out.code, Some(0), "scenario failed: {out:?}");
    assert_eq!(out.get("alice_sub").as_deref(), Some("both"));
    assert_eq!(out.get("bob_sub").as_deref(), Some("both"));
    assert_eq!(out.get("alice_item_name").as_deref(), Some("Bob"));
    assert_eq!(out.get("alice_item_groups").as_deref(), Some("Friends"));
    assert_eq!(out.get("bob_got").as_deref(), Some("hello bob"));
    assert_eq!(out.get("bob_got_from"), out.get("alice_full"));
    assert_eq!(out.get("alice_got").as_deref(), Some("hello alice"));
    assert_eq!(out.get("alice_got_from"), out.get("bob_full"));
    // The subscription is durable: it is in PostgreSQL, not only in the clients.
    let (_, items) = ts
        .shared()
        .store
        .roster(&ts.jid("alice"))
        .await
        .expect("roster");
    let bob = items
        .iter()
        .find(|i| i.contact.as_str() == ts.jid("bob"))
        .expect("bob on alice's stored roster");
    assert_eq!(bob.subscription.as_str(), "both");
    ts.stop().await;
}

// ---------------------------------------------------------------------------------------
// SASL and TLS negotiation (RFC 6120 §5, §6).

#[tokio::test]
async fn wrong_password_gets_not_authorized_and_too_many_end_the_stream_with_policy_violation() {
    let ts = TestServer::start(|c| c.limits.max_auth_failures = 2).await;
    ts.user("alice").await;
    let mut c = Client::tcp(&ts).await;
    c.open(&ts.domain).await.expect("stream");
    let mut c = c.starttls(&ts).await;
    for attempt in 1..=2 {
        let answer = c.auth_plain("alice", "not the password").await;
        // RFC 6120 §6.5.10.
        assert!(
            answer.is("failure", x::NS_SASL),
            "attempt {attempt}: {answer}"
        );
        assert_eq!(condition(&answer), "not-authorized", "attempt {attempt}");
    }
    // RFC 6120 §6.4.5: the configured number of retries is used up; the stream ends.
    match c.expect_stream_end().await {
        Ended::StreamError(cond) => assert_eq!(cond, "policy-violation"),
        other => panic!("expected policy-violation, got {other:?}"),
    }
    // The right password still works on a new connection.
    let alice = ts.login("alice", "r").await;
    alice.close().await;
    assert_still_serving(&ts).await;
    ts.stop().await;
}

/// One PLAIN attempt on a fresh STARTTLS stream: the SASL answer and how long it took.
async fn timed_plain(ts: &TestServer, user: &str, password: &str) -> (Element, Duration) {
    let mut c = Client::tcp(ts).await;
    c.open(&ts.domain).await.expect("stream");
    let mut c = c.starttls(ts).await;
    let started = Instant::now();
    let answer = c.auth_plain(user, password).await;
    (answer, started.elapsed())
}

#[tokio::test]
async fn repeated_failures_lock_the_account_without_a_password_check_until_the_delay_ends() {
    // Scaled down: 3 failures lock for 1.5 s (bounded at 3 s); a failure is remembered 10 s.
    let ts = TestServer::start(|c| {
        c.limits.auth_backoff_failures = 3;
        c.limits.auth_backoff_window_ms = 10_000;
        c.limits.auth_backoff_base_ms = 1_500;
        c.limits.auth_backoff_max_ms = 3_000;
    })
    .await;
    // A slow credential makes a password check measurable next to a refusal without one.
    ts.running
        .as_ref()
        .unwrap()
        .shared
        .store
        .create_account("alice", &ts.domain, "right", 50_000)
        .await
        .expect("create alice");
    ts.user("bob").await;

    // Each attempt on its own stream: the per-stream retry limit plays no part.
    let mut checked = Duration::MAX;
    for attempt in 1..=3 {
        let (answer, took) = timed_plain(&ts, "alice", "wrong").await;
        assert_eq!(condition(&answer), "not-authorized", "attempt {attempt}");
        checked = checked.min(took);
    }
    let locked_at = Instant::now();
    // RFC 6120 §6.5.10: refused as not-authorized, and without the PBKDF2 work.
    let (answer, refused) = timed_plain(&ts, "alice", "wrong").await;
    assert_eq!(condition(&answer), "not-authorized", "{answer}");
    assert!(
        refused * 4 < checked,
        "a locked attempt took {refused:?}, a checked one at least {checked:?}"
    );
    // The right password is refused too while the lock lasts.
    let (answer, _) = timed_plain(&ts, "alice", "right").await;
    assert_eq!(condition(&answer), "not-authorized", "{answer}");
    // SCRAM is refused at client-first, before any challenge; bob still gets one.
    for (user, locked) in [("alice", true), ("bob", false)] {
        let answer = scram_first(&ts, user).await;
        let want = if locked { "failure" } else { "challenge" };
        assert!(answer.is(want, x::NS_SASL), "{user}: {answer}");
    }
    assert!(
        locked_at.elapsed() < Duration::from_millis(1_500),
        "the checks above must run inside the lock; the machine is too slow for this test"
    );
    // Other accounts are not affected.
    let (answer, _) = timed_plain(&ts, "bob", "pw").await;
    assert!(answer.is("success", x::NS_SASL), "{answer}");

    // Once the lock (1.5 s, at most 3 s) is over, the right password works.
    tokio::time::sleep(Duration::from_millis(1_600).saturating_sub(locked_at.elapsed())).await;
    let (answer, _) = timed_plain(&ts, "alice", "right").await;
    assert!(answer.is("success", x::NS_SASL), "{answer}");
    assert_still_serving(&ts).await;
    ts.stop().await;
}

/// The back-off lock is the failing address's, not the account's: a guesser that keeps
/// alice locked from its address cannot lock her out of one that has not failed.
#[tokio::test]
async fn failures_from_one_address_do_not_lock_the_owner_out_of_another() {
    // A lock (10 s) far longer than the few logins below take.
    let ts = TestServer::start(|c| {
        c.limits.auth_backoff_failures = 3;
        c.limits.auth_backoff_window_ms = 60_000;
        c.limits.auth_backoff_base_ms = 10_000;
        c.limits.auth_backoff_max_ms = 20_000;
    })
    .await;
    ts.user("alice").await;
    let (guesser, owner) = ("127.0.0.3", "127.0.0.4");
    for attempt in 1..=3 {
        let answer = Client::plain_from(&ts, guesser, "alice", "wrong").await;
        assert_eq!(condition(&answer), "not-authorized", "attempt {attempt}");
    }
    let answer = Client::plain_from(&ts, guesser, "alice", "pw").await;
    assert_eq!(
        condition(&answer),
        "not-authorized",
        "locked from the guesser's address"
    );
    let answer = Client::plain_from(&ts, owner, "alice", "pw").await;
    assert!(
        answer.is("success", x::NS_SASL),
        "the owner's address: {answer}"
    );
    // The owner's success did not lift the guesser's lock.
    let answer = Client::plain_from(&ts, guesser, "alice", "pw").await;
    assert_eq!(
        condition(&answer),
        "not-authorized",
        "still locked for the guesser"
    );
    assert_still_serving(&ts).await;
    ts.stop().await;
}

/// Median time of a failed PLAIN attempt for an existing account (wrong password) and
/// for an unknown one, interleaved on one stream so load drifts affect both alike.
async fn plain_failure_medians(ts: &TestServer, samples: usize) -> (Duration, Duration) {
    let mut c = Client::tcp(ts).await;
    c.open(&ts.domain).await.expect("stream");
    let mut c = c.starttls(ts).await;
    let (mut existing, mut unknown) = (Vec::new(), Vec::new());
    for _ in 0..samples {
        for (user, into) in [("alice", &mut existing), ("nobody", &mut unknown)] {
            let started = Instant::now();
            let answer = c.auth_plain(user, "wrong").await;
            into.push(started.elapsed());
            assert_eq!(condition(&answer), "not-authorized", "{answer}");
        }
    }
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    (median(&mut existing), median(&mut unknown))
}

#[tokio::test]
async fn plain_costs_an_unknown_user_the_same_password_check_as_an_existing_one() {
    // 100 pairs by default keep the suite quick; PLAIN_TIMING_SAMPLES=200 (or more) for a
    // measurement to report.
    let samples: usize = common::env_or("PLAIN_TIMING_SAMPLES", 100);
    let ts = TestServer::start(|c| {
        c.limits.max_auth_failures = 2 * samples as u32 + 1;
        c.limits.auth_backoff_failures = 2 * samples as u32 + 1;
    })
    .await;
    ts.user("alice").await;
    let (existing, unknown) = plain_failure_medians(&ts, samples).await;
    println!("PLAIN failure, median of {samples}: existing {existing:?}, unknown {unknown:?}");
    // Before, the unknown user skipped PBKDF2 and took about half as long; now the same
    // derivation runs, so the medians agree within the noise of a shared machine.
    let ratio = unknown.as_secs_f64() / existing.as_secs_f64();
    assert!(
        (0.8..1.25).contains(&ratio),
        "existing {existing:?}, unknown {unknown:?}: ratio {ratio:.2}"
    );
    ts.stop().await;
}

/// The server's answer to a SCRAM-SHA-256 client-first for `user` on a fresh stream.
async fn scram_first(ts: &TestServer, user: &str) -> Element {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut c = Client::tcp(ts).await;
    c.open(&ts.domain).await.expect("stream");
    let mut c = c.starttls(ts).await;
    let first = b64.encode(format!("n,,n={user},r=clientnonce"));
    c.send_raw(&format!(
        "<auth xmlns='urn:ietf:params:xml:ns:xmpp-sasl' mechanism='SCRAM-SHA-256'>{first}</auth>"
    ))
    .await;
    c.next_stanza(WAIT).await.expect("SASL answer")
}

/// The salt and iteration count a SCRAM-SHA-256 server-first gives `user`.
async fn scram_salt(ts: &TestServer, user: &str) -> (String, String) {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    let challenge = scram_first(ts, user).await;
    assert!(challenge.is("challenge", x::NS_SASL), "{challenge}");
    let text = String::from_utf8(b64.decode(challenge.text_content()).unwrap()).unwrap();
    let field = |k: &str| {
        text.split(',')
            .find_map(|a| a.strip_prefix(k))
            .unwrap_or_else(|| panic!("{k} in {text}"))
            .to_owned()
    };
    (field("s="), field("i="))
}

#[tokio::test]
async fn unknown_users_get_a_scram_salt_stable_across_restarts_and_the_configured_iterations() {
    let domain = format!("t{}.example", unique());
    let iterations = |c: &mut presenced::config::Config| c.auth.scram_iterations = 4321;
    let ts = TestServer::start_with_domain(&domain, iterations).await;
    ts.user("alice").await;
    let ghost = scram_salt(&ts, "ghost").await;
    let other = scram_salt(&ts, "other").await;
    // Spellings of one JID share a real account's salt, so they share a fake one too.
    assert_eq!(
        scram_salt(&ts, "Alice").await,
        scram_salt(&ts, "alice").await
    );
    assert_eq!(scram_salt(&ts, "GHOST").await, ghost);
    ts.stop().await;
    let ts = TestServer::start_with_domain(&domain, iterations).await;
    let again = scram_salt(&ts, "ghost").await;
    assert_eq!(
        ghost, again,
        "same unknown user, same answer after a restart"
    );
    assert_ne!(ghost.0, other.0, "different users, different salts");
    assert_eq!(ghost.1, "4321", "unknown users get scram_iterations");
    assert_eq!(other.1, "4321");
    ts.stop().await;
}

#[tokio::test]
async fn before_tls_only_required_starttls_is_offered_and_auth_gets_encryption_required() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    let mut c = Client::tcp(&ts).await;
    let features = c.open(&ts.domain).await.expect("stream");
    // RFC 6120 §5.3.1 / §13.8: nothing but STARTTLS, marked required; no SASL in the clear.
    let offered: Vec<(String, String)> = features
        .elements()
        .map(|f| (f.name.clone(), f.ns.clone()))
        .collect();
    assert_eq!(offered, vec![("starttls".to_owned(), x::NS_TLS.to_owned())]);
    let starttls = features.elements().next().unwrap();
    assert!(
        starttls.get_child("required", x::NS_TLS).is_some(),
        "{features}"
    );
    assert!(!features.to_xml().contains("PLAIN"), "{features}");

    // RFC 6120 §6.4 / §6.5.4: authentication before TLS is refused.
    let answer = c.auth_plain("alice", "pw").await;
    assert!(answer.is("failure", x::NS_SASL), "{answer}");
    assert_eq!(condition(&answer), "encryption-required");

    // The same stream may still upgrade, and then SASL (with PLAIN) is offered.
    let c = c.starttls(&ts).await;
    let features = c.features.clone().expect("features after TLS");
    let mechs: Vec<String> = features
        .get_child("mechanisms", x::NS_SASL)
        .expect("mechanisms after TLS")
        .elements()
        .map(|m| m.text_content())
        .collect();
    for m in ["SCRAM-SHA-256", "SCRAM-SHA-1", "PLAIN"] {
        assert!(mechs.iter().any(|x| x == m), "{m} not offered: {mechs:?}");
    }
    ts.stop().await;
}

#[tokio::test]
async fn stanza_before_authentication_gets_not_authorized() {
    let ts = TestServer::start(|_| {}).await;
    let mut c = Client::tcp(&ts).await;
    c.open(&ts.domain).await.expect("stream");
    let mut c = c.starttls(&ts).await;
    c.send(&chat(&ts.jid("someone"), "let me in")).await;
    // RFC 6120 §4.9.3.12: stanzas before the stream is authenticated.
    assert_stream_error(c.expect_stream_end().await, "not-authorized");
    assert_still_serving(&ts).await;
    ts.stop().await;
}

#[tokio::test]
async fn whitespace_keepalive_is_ignored_and_closing_tag_is_answered_with_ours() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    let mut c = ts.login("alice", "r").await;
    // RFC 6120 §4.6.1: whitespace between stanzas keeps the stream alive and means nothing.
    c.send_raw(" \n \t ").await;
    let pong = c
        .iq("get", Some(&ts.domain), Element::new("ping", x::NS_PING))
        .await;
    assert_eq!(pong.get_attr("type"), Some("result"), "{pong}");
    // RFC 3921 §3 legacy session establishment still answers result for old clients.
    let session = c
        .iq("set", None, Element::new("session", x::NS_SESSION))
        .await;
    assert_eq!(session.get_attr("type"), Some("result"), "{session}");
    // RFC 6120 §4.4: our closing tag is answered with the server's, without an error.
    c.send_raw("</stream:stream>").await;
    assert!(
        c.got_closing_tag().await,
        "no </stream:stream> from the server"
    );
    ts.stop().await;
}

// ---------------------------------------------------------------------------------------
// Resource binding (RFC 6120 §7).

#[tokio::test]
async fn second_bind_of_same_full_jid_ends_the_older_session_with_conflict() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let mut first = ts.login("alice", "desk").await;
    let mut second = ts.login("alice", "desk").await;
    assert_eq!(second.jid, format!("{}/desk", ts.jid("alice")));
    // RFC 6120 §7.7.2.2: the server may terminate the existing session with <conflict/>.
    match first.expect_stream_end().await {
        Ended::StreamError(cond) => assert_eq!(cond, "conflict"),
        other => panic!("expected conflict, got {other:?}"),
    }
    // The new session owns the full JID.
    let mut bob = ts.login("bob", "pc").await;
    bob.send(&chat(&second.jid, "to the new desk")).await;
    let got = second.expect(is_message).await;
    assert_eq!(body(&got), "to the new desk");
    ts.stop().await;
}

#[tokio::test]
async fn bind_without_resource_gets_a_unique_server_generated_resource() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let mut one = ts.login("alice", "").await;
    let mut two = ts.login("alice", "").await;
    let prefix = format!("{}/", ts.jid("alice"));
    for c in [&one, &two] {
        // RFC 6120 §7.6: the server generates a resource when none is provided.
        assert!(
            c.jid.starts_with(&prefix) && c.jid.len() > prefix.len(),
            "{}",
            c.jid
        );
    }
    assert_ne!(one.jid, two.jid, "generated resources must differ");
    // Both sessions stay connected and addressable.
    let mut bob = ts.login("bob", "pc").await;
    bob.send(&chat(&one.jid, "one")).await;
    bob.send(&chat(&two.jid, "two")).await;
    assert_eq!(body(&one.expect(is_message).await), "one");
    assert_eq!(body(&two.expect(is_message).await), "two");
    ts.stop().await;
}

// ---------------------------------------------------------------------------------------
// Roster management (RFC 6121 §2) and versioning (XEP-0237, RFC 6121 §2.6).

fn item(jid: &str) -> Element {
    Element::new("item", NS_ROSTER).attr("jid", jid)
}

fn group(name: &str) -> Element {
    Element::new("group", NS_ROSTER).text(name)
}

async fn roster_set(c: &mut Client, items: Vec<Element>) -> Element {
    let mut q = Element::new("query", NS_ROSTER);
    for i in items {
        q = q.child(i);
    }
    c.iq("set", None, q).await
}

async fn roster_get(c: &mut Client, ver: Option<&str>) -> Element {
    let mut q = Element::new("query", NS_ROSTER);
    if let Some(v) = ver {
        q = q.attr("ver", v);
    }
    c.iq("get", None, q).await
}

fn is_roster_push(el: &Element) -> bool {
    el.name == "iq"
        && el.get_attr("type") == Some("set")
        && el.get_child("query", NS_ROSTER).is_some()
}

/// The single item of a roster push.
fn pushed_item(push: &Element) -> Element {
    let q = push.get_child("query", NS_ROSTER).expect("roster query");
    let items: Vec<&Element> = q.elements().collect();
    assert_eq!(
        items.len(),
        1,
        "a roster push carries exactly one item: {push}"
    );
    items[0].clone()
}

fn push_ver(push: &Element) -> String {
    push.get_child("query", NS_ROSTER)
        .and_then(|q| q.get_attr("ver"))
        .expect("versioned push")
        .to_owned()
}

fn groups_of(item: &Element) -> Vec<String> {
    item.elements()
        .filter(|g| g.is("group", NS_ROSTER))
        .map(|g| g.text_content())
        .collect()
}

/// Waits for the push about `contact` on `c` and returns its item.
async fn expect_push(c: &mut Client, contact: &str) -> (Element, Element) {
    let contact = contact.to_owned();
    let push = c
        .expect(move |e| is_roster_push(e) && pushed_item(e).get_attr("jid") == Some(&contact))
        .await;
    // RFC 6121 §2.1.6: a push is addressed to the resource's full JID.
    assert_eq!(push.get_attr("to"), Some(c.jid.as_str()), "{push}");
    let it = pushed_item(&push);
    (push, it)
}

#[tokio::test]
async fn roster_add_update_remove_are_pushed_to_every_interested_resource() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    let bob = ts.jid("bob");
    let mut phone = ts.login("alice", "phone").await;
    let mut laptop = ts.login("alice", "laptop").await;
    let mut idle = ts.login("alice", "idle").await; // never asks for the roster
    for c in [&mut phone, &mut laptop] {
        let r = roster_get(c, None).await;
        assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    }

    // Add (RFC 6121 §2.3.2): result to the sender, push to both interested resources.
    let add = item(&bob).attr("name", "Bob").child(group("Friends"));
    let r = roster_set(&mut phone, vec![add]).await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    for c in [&mut phone, &mut laptop] {
        let (_, it) = expect_push(c, &bob).await;
        assert_eq!(it.get_attr("name"), Some("Bob"));
        assert_eq!(it.get_attr("subscription"), Some("none"));
        assert_eq!(groups_of(&it), vec!["Friends".to_owned()]);
    }

    // Update (RFC 6121 §2.4.2) from the other resource.
    let upd = item(&bob)
        .attr("name", "Robert")
        .child(group("Work"))
        .child(group("Chess"));
    let r = roster_set(&mut laptop, vec![upd]).await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    for c in [&mut phone, &mut laptop] {
        let (_, it) = expect_push(c, &bob).await;
        assert_eq!(it.get_attr("name"), Some("Robert"));
        let mut g = groups_of(&it);
        g.sort();
        assert_eq!(g, vec!["Chess".to_owned(), "Work".to_owned()]);
    }

    // Remove (RFC 6121 §2.5.2): pushed with subscription='remove'.
    let r = roster_set(&mut phone, vec![item(&bob).attr("subscription", "remove")]).await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    for c in [&mut phone, &mut laptop] {
        let (_, it) = expect_push(c, &bob).await;
        assert_eq!(it.get_attr("subscription"), Some("remove"));
    }
    let r = roster_get(&mut phone, None).await;
    let q = r.get_child("query", NS_ROSTER).expect("query");
    assert_eq!(q.elements().count(), 0, "removed item still listed: {r}");

    // RFC 6121 §2.1.6: only interested resources get pushes. Everything above was routed
    // before this ping's answer, so none of it may be queued for the idle resource.
    let before = stanzas_until_ping_reply(&mut idle, &ts.domain).await;
    assert!(
        before.iter().all(|e| !is_roster_push(e)),
        "a resource that never requested the roster got a push: {before:?}"
    );
    ts.stop().await;
}

#[tokio::test]
async fn roster_set_violations_get_the_rfc_6121_stanza_errors_and_store_nothing() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    let mut c = ts.login("alice", "r").await;
    let bob = ts.jid("bob");
    let carol = ts.jid("carol");
    let cases: Vec<(&str, Vec<Element>, &str, &str)> = vec![
        // RFC 6121 §2.3.3: more than one item.
        (
            "two items",
            vec![item(&bob), item(&carol)],
            "bad-request",
            "modify",
        ),
        // RFC 6121 §2.3.3: duplicate group names.
        (
            "duplicate group",
            vec![item(&bob).child(group("A")).child(group("A"))],
            "bad-request",
            "modify",
        ),
        // RFC 6121 §2.3.3: a group of zero length.
        (
            "empty group",
            vec![item(&bob).child(group(""))],
            "not-acceptable",
            "modify",
        ),
        // RFC 6121 §2.1.2.2: 'ask' is the server's to set, never the client's.
        (
            "ask attribute",
            vec![item(&bob).attr("ask", "subscribe")],
            "bad-request",
            "modify",
        ),
        // RFC 6120 §8.3.3.8: an address that is not a valid JID.
        (
            "malformed jid",
            vec![item("@no-localpart.example")],
            "jid-malformed",
            "modify",
        ),
        // RFC 6121 §2.5.3: removing an item that is not in the roster.
        (
            "remove absent item",
            vec![item(&carol).attr("subscription", "remove")],
            "item-not-found",
            "cancel",
        ),
    ];
    for (what, items, cond, ty) in cases {
        let reply = roster_set(&mut c, items).await;
        assert_error(&reply, cond, ty, what);
    }
    let r = roster_get(&mut c, None).await;
    let q = r.get_child("query", NS_ROSTER).expect("query");
    assert_eq!(q.elements().count(), 0, "a refused set left an item: {r}");
    ts.stop().await;
}

#[tokio::test]
async fn roster_set_ignores_subscription_values_other_than_remove() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    let mut c = ts.login("alice", "r").await;
    roster_get(&mut c, None).await;
    let bob = ts.jid("bob");
    // RFC 6121 §2.1.2.5: "in a roster set the server MUST ignore all values of the
    // 'subscription' attribute other than 'remove'" (slixmpp sends subscription='none').
    let reply = roster_set(&mut c, vec![item(&bob).attr("subscription", "both")]).await;
    assert_eq!(reply.get_attr("type"), Some("result"), "{reply}");
    let (_, it) = expect_push(&mut c, &bob).await;
    assert_eq!(
        it.get_attr("subscription"),
        Some("none"),
        "client set state: {it}"
    );
    let (_, items) = ts.shared().store.roster(&ts.jid("alice")).await.unwrap();
    assert_eq!(items.len(), 1);
    assert_eq!(items[0].subscription.as_str(), "none");
    ts.stop().await;
}

#[tokio::test]
async fn roster_set_beyond_max_roster_items_is_not_allowed_but_updates_still_work() {
    let ts = TestServer::start(|c| c.limits.max_roster_items = 3).await;
    ts.user("alice").await;
    let mut c = ts.login("alice", "r").await;
    for n in ["b1", "b2", "b3"] {
        let r = roster_set(&mut c, vec![item(&ts.jid(n))]).await;
        assert_eq!(r.get_attr("type"), Some("result"), "{n}: {r}");
    }
    let r = roster_set(&mut c, vec![item(&ts.jid("b4"))]).await;
    assert_error(&r, "not-allowed", "cancel", "fourth item over a limit of 3");
    // Changing an existing item does not grow the roster.
    let r = roster_set(&mut c, vec![item(&ts.jid("b2")).attr("name", "Two")]).await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    let r = roster_get(&mut c, None).await;
    let jids: Vec<String> = r
        .get_child("query", NS_ROSTER)
        .unwrap()
        .elements()
        .filter_map(|i| i.get_attr("jid").map(str::to_owned))
        .collect();
    assert_eq!(jids.len(), 3, "{jids:?}");
    assert!(!jids.contains(&ts.jid("b4")));
    ts.stop().await;
}

#[tokio::test]
async fn roster_get_with_versions_returns_only_the_changes() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    let mut c = ts.login("alice", "r").await;
    let (bob, carol, dave, erin) = (
        ts.jid("bob"),
        ts.jid("carol"),
        ts.jid("dave"),
        ts.jid("erin"),
    );
    roster_get(&mut c, None).await;
    for j in [&bob, &carol, &dave] {
        let r = roster_set(&mut c, vec![item(j)]).await;
        assert_eq!(r.get_attr("type"), Some("result"));
        expect_push(&mut c, j).await;
    }
    let full = roster_get(&mut c, None).await;
    let old_ver = full
        .get_child("query", NS_ROSTER)
        .and_then(|q| q.get_attr("ver"))
        .expect("RFC 6121 §2.6.3: roster result carries ver")
        .to_owned();

    // Current version: an empty result and no pushes (RFC 6121 §2.6.3).
    let r = roster_get(&mut c, Some(&old_ver)).await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    assert_eq!(r.elements().count(), 0, "expected an empty result: {r}");
    let extra = stanzas_until_ping_reply(&mut c, &ts.domain).await;
    assert!(
        extra.is_empty(),
        "pushes for an up-to-date roster: {extra:?}"
    );

    // Three changes: an update, a removal, an addition.
    roster_set(&mut c, vec![item(&carol).attr("name", "Caroline")]).await;
    roster_set(&mut c, vec![item(&dave).attr("subscription", "remove")]).await;
    roster_set(&mut c, vec![item(&erin)]).await;
    let _ = stanzas_until_ping_reply(&mut c, &ts.domain).await; // the live pushes
    let now = roster_get(&mut c, None).await;
    let new_ver = now
        .get_child("query", NS_ROSTER)
        .and_then(|q| q.get_attr("ver"))
        .unwrap()
        .to_owned();
    assert_ne!(new_ver, old_ver);

    // Older version: an empty result, then one push per change and nothing else.
    let r = roster_get(&mut c, Some(&old_ver)).await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    assert_eq!(r.elements().count(), 0, "expected an empty result: {r}");
    let pushes = stanzas_until_ping_reply(&mut c, &ts.domain).await;
    assert!(pushes.iter().all(is_roster_push), "{pushes:?}");
    let mut seen: Vec<(String, Option<String>, Option<String>)> = pushes
        .iter()
        .map(|p| {
            let it = pushed_item(p);
            (
                it.get_attr("jid").unwrap_or_default().to_owned(),
                it.get_attr("subscription").map(str::to_owned),
                it.get_attr("name").map(str::to_owned),
            )
        })
        .collect();
    seen.sort();
    let mut want = vec![
        (carol.clone(), Some("none".into()), Some("Caroline".into())),
        (dave.clone(), Some("remove".into()), None),
        (erin.clone(), Some("none".into()), None),
    ];
    want.sort();
    assert_eq!(seen, want, "pushes must be exactly the three changes");
    // XEP-0237 §4: the final push carries the version the client ends up at.
    let last = pushes.last().unwrap();
    assert_eq!(push_ver(last), new_ver);

    // Unknown versions (ahead of the server, or not ours): the full roster.
    for unknown in ["999999999", "not-a-version"] {
        let r = roster_get(&mut c, Some(unknown)).await;
        let q = r
            .get_child("query", NS_ROSTER)
            .unwrap_or_else(|| panic!("ver={unknown}: full roster expected: {r}"));
        assert_eq!(q.get_attr("ver"), Some(new_ver.as_str()));
        let mut jids: Vec<String> = q
            .elements()
            .filter_map(|i| i.get_attr("jid").map(str::to_owned))
            .collect();
        jids.sort();
        let mut want = vec![bob.clone(), carol.clone(), erin.clone()];
        want.sort();
        assert_eq!(jids, want, "ver={unknown}");
    }
    ts.stop().await;
}

#[tokio::test]
async fn versioned_roster_get_agrees_with_the_full_roster_about_pending_requests() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let mut alice = ts.login("alice", "a").await;
    let mut bob = ts.login("bob", "b").await;
    roster_set(&mut alice, vec![item(&ts.jid("carol"))]).await;
    let full = roster_get(&mut alice, None).await;
    let ver = full
        .get_child("query", NS_ROSTER)
        .and_then(|q| q.get_attr("ver"))
        .unwrap()
        .to_owned();
    // Bob asks to subscribe; alice is offline for presence (never sent any), so the
    // request is kept for later (RFC 6121 §3.1.3) and is not a roster item of hers.
    bob.presence(Some("subscribe"), Some(&ts.jid("alice")))
        .await;
    let _ = stanzas_until_ping_reply(&mut bob, &ts.domain).await;
    let full = roster_get(&mut alice, None).await;
    let listed: Vec<String> = full
        .get_child("query", NS_ROSTER)
        .unwrap()
        .elements()
        .filter_map(|i| i.get_attr("jid").map(str::to_owned))
        .collect();
    let _ = stanzas_until_ping_reply(&mut alice, &ts.domain).await;
    // Whatever the full roster shows, the diff from an older version must show the same.
    let r = roster_get(&mut alice, Some(&ver)).await;
    let mut pushed = Vec::new();
    if let Some(q) = r.get_child("query", NS_ROSTER) {
        pushed.extend(
            q.elements()
                .filter_map(|i| i.get_attr("jid").map(str::to_owned)),
        );
    }
    for p in stanzas_until_ping_reply(&mut alice, &ts.domain).await {
        if is_roster_push(&p) {
            pushed.push(
                pushed_item(&p)
                    .get_attr("jid")
                    .unwrap_or_default()
                    .to_owned(),
            );
        }
    }
    for j in &pushed {
        assert!(
            listed.contains(j),
            "versioned get pushed {j}, full roster lists {listed:?}"
        );
    }
    ts.stop().await;
}

// ---------------------------------------------------------------------------------------
// Routing (RFC 6120 §10, RFC 6121 §8) and server iq handlers.

async fn go_online(c: &mut Client, priority: i8) {
    let p = Element::new("presence", NS_CLIENT)
        .child(Element::new("priority", NS_CLIENT).text(priority.to_string()));
    c.send(&p).await;
    // RFC 6121 §4.2.2: the server echoes initial presence to the sender, so after this the
    // priority is in effect.
    let me = c.jid.clone();
    c.expect(move |e| e.name == "presence" && e.get_attr("from") == Some(me.as_str()))
        .await;
}

#[tokio::test]
async fn message_between_two_users_is_delivered_with_stamped_from() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let mut alice = ts.login("alice", "phone").await;
    let mut bob = ts.login("bob", "pc").await;
    bob.presence(None, None).await;
    bob.expect(|e| is_presence(e, &ts.jid("bob"), None)).await;
    alice.send(&chat(&ts.jid("bob"), "hi bob")).await;
    let got = bob.expect(is_message).await;
    // RFC 6120 §8.1.2.1: the server stamps the sender's full JID.
    assert_eq!(got.get_attr("from"), Some(alice.jid.as_str()));
    assert_eq!(body(&got), "hi bob");
    ts.stop().await;
}

#[tokio::test]
async fn message_to_a_full_jid_reaches_only_that_resource() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let mut alice = ts.login("alice", "a").await;
    let mut bob_one = ts.login("bob", "one").await;
    let mut bob_two = ts.login("bob", "two").await;
    go_online(&mut bob_one, 0).await;
    go_online(&mut bob_two, 0).await;
    alice.send(&chat(&bob_two.jid, "for two")).await;
    let got = bob_two.expect(is_message).await;
    assert_eq!(body(&got), "for two");
    assert_eq!(got.get_attr("to"), Some(bob_two.jid.as_str()));
    assert_no_message_before_marker(&mut alice, &mut bob_one).await;
    ts.stop().await;
}

#[tokio::test]
async fn message_to_a_bare_jid_goes_to_the_highest_non_negative_priority() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let mut alice = ts.login("alice", "a").await;
    let mut high = ts.login("bob", "high").await;
    let mut low = ts.login("bob", "low").await;
    let mut negative = ts.login("bob", "negative").await;
    go_online(&mut high, 5).await;
    go_online(&mut low, 1).await;
    go_online(&mut negative, -1).await;
    alice.send(&chat(&ts.jid("bob"), "to bare")).await;
    // RFC 6121 §8.5.2.1.1: chat to a bare JID goes to the highest-priority resource.
    let got = high.expect(is_message).await;
    assert_eq!(body(&got), "to bare");
    assert_no_message_before_marker(&mut alice, &mut low).await;
    // RFC 6121 §8.5.2.1.1: never to a resource with negative priority.
    assert_no_message_before_marker(&mut alice, &mut negative).await;
    ts.stop().await;
}

#[tokio::test]
async fn message_to_a_bare_jid_with_only_negative_priority_resources_is_not_delivered_nor_answered()
{
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let mut alice = ts.login("alice", "a").await;
    let mut negative = ts.login("bob", "negative").await;
    go_online(&mut negative, -1).await;
    alice.send(&chat(&ts.jid("bob"), "anyone?")).await;
    // RFC 6121 §8.5.2.2.1: treated as having no available resource, so the message is kept
    // for bob's next login (XEP-0160) and the sender is not answered: an error only for "no
    // resource takes it" would tell the sender bob is offline (README, "Privacy").
    let before = stanzas_until_ping_reply(&mut alice, &ts.domain).await;
    assert!(before.is_empty(), "sender was answered: {before:?}");
    assert_no_message_before_marker(&mut alice, &mut negative).await;
    ts.stop().await;
}

#[tokio::test]
async fn message_to_unknown_user_and_to_offline_user_are_both_unanswered() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    ts.user("offline").await;
    let mut alice = ts.login("alice", "a").await;
    // RFC 6121 §8.5.1 (no such account) lets the server ignore the message, and
    // §8.5.2.2.1 / §8.5.3.2.1 (an existing account with no resource to take it: kept for
    // later, XEP-0160) let it answer nothing: the same silence, so the reply tells neither
    // whether the account exists nor whether the user is online (src/services/offline.rs).
    for to in [
        ts.jid("nobody"),
        format!("{}/gone", ts.jid("nobody")),
        ts.jid("offline"),
        format!("{}/gone", ts.jid("offline")),
    ] {
        alice.send(&chat(&to, "hello?")).await;
        let before = stanzas_until_ping_reply(&mut alice, &ts.domain).await;
        assert!(before.is_empty(), "{to}: sender was answered: {before:?}");
    }
    ts.stop().await;
}

#[tokio::test]
async fn iq_to_unknown_namespace_or_offline_full_jid_is_service_unavailable() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let mut alice = ts.login("alice", "a").await;
    let unknown = || Element::new("query", "urn:example:not-implemented");
    // RFC 6120 §8.4: an iq for a namespace nobody handles.
    let r = alice.iq("get", Some(&ts.domain), unknown()).await;
    assert_error(
        &r,
        "service-unavailable",
        "cancel",
        "server, unknown namespace",
    );
    let r = alice.iq("get", Some(&ts.jid("bob")), unknown()).await;
    assert_error(
        &r,
        "service-unavailable",
        "cancel",
        "account, unknown namespace",
    );
    let r = alice.iq("get", None, unknown()).await;
    assert_error(
        &r,
        "service-unavailable",
        "cancel",
        "own account, unknown namespace",
    );
    // RFC 6121 §8.5.3.2.2: iq to a full JID with no such resource.
    let ping = || Element::new("ping", x::NS_PING);
    let offline = format!("{}/nowhere", ts.jid("bob"));
    let r = alice.iq("get", Some(&offline), ping()).await;
    assert_error(&r, "service-unavailable", "cancel", "offline full JID");
    ts.stop().await;
}

#[tokio::test]
async fn malformed_addresses_and_malformed_iqs_get_stanza_errors_not_stream_errors() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    let mut alice = ts.login("alice", "a").await;
    let d = ts.domain.clone();
    let cases = [
        // RFC 6120 §8.3.3.8: a 'to' that is not a JID.
        (
            "message to a malformed JID",
            "message",
            "<message id='m1' to='@bad@jid' type='chat'><body>x</body></message>".to_owned(),
            "m1",
            "jid-malformed",
            "modify",
        ),
        // RFC 6120 §8.2.3: a get/set carries exactly one payload.
        (
            "iq get with two payloads",
            "iq",
            format!(
                "<iq id='i1' type='get' to='{d}'><ping xmlns='urn:xmpp:ping'/>\
                 <query xmlns='http://jabber.org/protocol/disco#info'/></iq>"
            ),
            "i1",
            "bad-request",
            "modify",
        ),
        // RFC 6120 §8.2.3: the type must be get, set, result or error.
        (
            "iq of unknown type",
            "iq",
            format!("<iq id='i2' type='fetch' to='{d}'><ping xmlns='urn:xmpp:ping'/></iq>"),
            "i2",
            "bad-request",
            "modify",
        ),
    ];
    for (what, kind, raw, id, cond, ty) in cases {
        alice.send_raw(&raw).await;
        let reply = alice
            .expect(|e| e.name == kind && e.get_attr("id") == Some(id))
            .await;
        assert_error(&reply, cond, ty, what);
    }
    // RFC 6120 §8.3.1: an error is never answered with an error, even when undeliverable.
    alice
        .send_raw(&format!(
            "<message id='e1' type='error' to='{}'><error type='cancel'>\
             <item-not-found xmlns='urn:ietf:params:xml:ns:xmpp-stanzas'/></error></message>",
            ts.jid("nobody")
        ))
        .await;
    let before = stanzas_until_ping_reply(&mut alice, &ts.domain).await;
    assert!(before.is_empty(), "an error was answered: {before:?}");
    ts.stop().await;
}

#[tokio::test]
async fn iq_to_an_online_full_jid_is_delivered_and_the_answer_routed_back() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let mut alice = ts.login("alice", "a").await;
    let mut bob = ts.login("bob", "b").await;
    // Bob reveals this resource to alice (directed presence, RFC 6121 §4.6); without that,
    // an iq to his full JID gets what an offline resource gets (README, "Privacy").
    bob.presence(None, Some(&alice.jid)).await;
    alice.expect(|e| is_presence(e, &bob.jid, None)).await;
    let q = Element::new("iq", NS_CLIENT)
        .attr("type", "get")
        .attr("id", "v1")
        .attr("to", bob.jid.clone())
        .child(Element::new("query", "jabber:iq:version"));
    alice.send(&q).await;
    let got = bob.expect(|e| e.name == "iq").await;
    assert_eq!(got.get_attr("from"), Some(alice.jid.as_str()));
    let answer = Element::new("iq", NS_CLIENT)
        .attr("type", "result")
        .attr("id", "v1")
        .attr("to", alice.jid.clone());
    bob.send(&answer).await;
    let back = alice
        .expect(|e| e.name == "iq" && e.get_attr("id") == Some("v1"))
        .await;
    assert_eq!(back.get_attr("type"), Some("result"));
    assert_eq!(back.get_attr("from"), Some(bob.jid.as_str()));
    ts.stop().await;
}

#[tokio::test]
async fn ping_to_the_server_gets_a_result() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    let mut alice = ts.login("alice", "a").await;
    let r = alice
        .iq("get", Some(&ts.domain), Element::new("ping", x::NS_PING))
        .await;
    // XEP-0199 §4.2: an empty result from the server.
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    assert_eq!(r.get_attr("from"), Some(ts.domain.as_str()));
    assert_eq!(r.elements().count(), 0, "{r}");
    ts.stop().await;
}

#[tokio::test]
async fn disco_info_on_the_server_lists_its_identity_and_features() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    let mut alice = ts.login("alice", "a").await;
    let r = alice
        .iq(
            "get",
            Some(&ts.domain),
            Element::new("query", x::NS_DISCO_INFO),
        )
        .await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    let q = r.get_child("query", x::NS_DISCO_INFO).expect("query");
    // XEP-0030 §3.1: an identity of category server, type im.
    let id = q.get_child("identity", x::NS_DISCO_INFO).expect("identity");
    assert_eq!(id.get_attr("category"), Some("server"));
    assert_eq!(id.get_attr("type"), Some("im"));
    let features: Vec<&str> = q
        .elements()
        .filter(|f| f.is("feature", x::NS_DISCO_INFO))
        .filter_map(|f| f.get_attr("var"))
        .collect();
    for f in [x::NS_DISCO_INFO, x::NS_DISCO_ITEMS, x::NS_PING] {
        assert!(features.contains(&f), "{f} missing from {features:?}");
    }
    ts.stop().await;
}

#[tokio::test]
async fn disco_items_on_an_account_lists_nothing_even_with_resources_online() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let mut alice = ts.login("alice", "a").await;
    let mut bob = ts.login("bob", "b").await;
    go_online(&mut bob, 0).await;
    let r = alice
        .iq(
            "get",
            Some(&ts.jid("bob")),
            Element::new("query", x::NS_DISCO_ITEMS),
        )
        .await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    let q = r.get_child("query", x::NS_DISCO_ITEMS).expect("query");
    assert_eq!(q.elements().count(), 0, "account items leak resources: {r}");
    ts.stop().await;
}

#[tokio::test]
async fn addresses_are_compared_after_rfc_7622_normalisation() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    ts.user("bob").await;
    // RFC 7622 §3.2: domainparts are case-insensitive, so the stream header may shout.
    let mut c = Client::tcp(&ts).await;
    c.open(&ts.domain.to_uppercase())
        .await
        .expect("upper-case domain in the stream header is the same domain");
    drop(c);
    let mut alice = ts.login("alice", "a").await;
    let mut bob = ts.login("bob", "b").await;
    go_online(&mut bob, 0).await;
    // RFC 7622 §3.3: localparts are case-mapped too.
    alice
        .send(&chat(
            &format!("BoB@{}", ts.domain.to_uppercase()),
            "normalised",
        ))
        .await;
    assert_eq!(body(&bob.expect(is_message).await), "normalised");
    // One roster item per contact, however it is spelled.
    roster_get(&mut alice, None).await;
    roster_set(&mut alice, vec![item(&ts.jid("BOB"))]).await;
    roster_set(&mut alice, vec![item(&ts.jid("bob")).attr("name", "Bob")]).await;
    let r = roster_get(&mut alice, None).await;
    let items: Vec<&Element> = r
        .get_child("query", NS_ROSTER)
        .unwrap()
        .elements()
        .collect();
    assert_eq!(items.len(), 1, "{r}");
    assert_eq!(items[0].get_attr("jid"), Some(ts.jid("bob").as_str()));
    assert_eq!(items[0].get_attr("name"), Some("Bob"));
    ts.stop().await;
}

// ---------------------------------------------------------------------------------------
// Bad input (RFC 6120 §4.9.3, §11): the exact stream error, and nobody else suffers.

const HEADER_PREFIX: &str = "<?xml version='1.0'?>";

fn header(domain: &str, stream_ns: &str, content_ns: &str) -> String {
    format!(
        "<stream:stream xmlns='{content_ns}' xmlns:stream='{stream_ns}' to='{domain}' \
         version='1.0'>"
    )
}

/// Sends `bytes` on a fresh TCP connection and returns how the stream ended.
async fn raw_exchange(ts: &TestServer, bytes: &str) -> (Client, Ended) {
    let mut c = Client::tcp(ts).await;
    c.send_raw(bytes).await;
    let end = c.expect_stream_end_recording_header().await;
    (c, end)
}

fn assert_stream_error(end: Ended, want: &str) {
    match end {
        Ended::StreamError(cond) => assert_eq!(cond, want),
        other => panic!("expected stream error {want}, got {other:?}"),
    }
}

/// Logs in a client, sends it `bytes` raw, and returns how its stream ended.
async fn bound_client_sends(ts: &TestServer, bytes: &str) -> Ended {
    let name = format!("bad{}", unique());
    ts.user(&name).await;
    let mut c = ts.login(&name, "r").await;
    c.send_raw(bytes).await;
    c.expect_stream_end().await
}

#[tokio::test]
async fn not_well_formed_xml_gets_not_well_formed_and_others_are_served() {
    let ts = TestServer::start(|_| {}).await;
    // RFC 6120 §4.9.3.13.
    let end = bound_client_sends(&ts, "<message><body></message>").await;
    assert_stream_error(end, "not-well-formed");
    assert_still_serving(&ts).await;
    ts.stop().await;
}

#[tokio::test]
async fn dtd_before_the_stream_gets_restricted_xml_after_a_header() {
    let ts = TestServer::start(|_| {}).await;
    let bytes = format!(
        "{HEADER_PREFIX}<!DOCTYPE stream:stream [<!ENTITY boom 'boom'>]>{}",
        header(&ts.domain, x::NS_STREAM, NS_CLIENT)
    );
    let (c, end) = raw_exchange(&ts, &bytes).await;
    // RFC 6120 §11.1 / §4.9.3.18.
    assert_stream_error(end, "restricted-xml");
    // RFC 6120 §4.9.1.1: an error before our header still comes after a stream header.
    assert!(c.header.is_some(), "stream error without a stream header");
    assert_still_serving(&ts).await;
    ts.stop().await;
}

#[tokio::test]
async fn comment_in_a_bound_stream_gets_restricted_xml() {
    let ts = TestServer::start(|_| {}).await;
    let end = bound_client_sends(&ts, "<!-- a comment -->").await;
    // RFC 6120 §11.1: comments are not allowed.
    assert_stream_error(end, "restricted-xml");
    assert_still_serving(&ts).await;
    ts.stop().await;
}

#[tokio::test]
async fn processing_instruction_in_a_bound_stream_gets_restricted_xml() {
    let ts = TestServer::start(|_| {}).await;
    let end = bound_client_sends(&ts, "<?evil instruction?>").await;
    // RFC 6120 §11.1: processing instructions are not allowed.
    assert_stream_error(end, "restricted-xml");
    assert_still_serving(&ts).await;
    ts.stop().await;
}

#[tokio::test]
async fn oversize_stanza_gets_policy_violation() {
    let ts = TestServer::start(|c| c.limits.max_stanza_size = 10_000).await;
    let big = format!(
        "<message to='{}'><body>{}</body></message>",
        ts.jid("x"),
        "a".repeat(20_000)
    );
    let end = bound_client_sends(&ts, &big).await;
    // RFC 6120 §13.12 item 4 / §4.9.3.14: a stanza over the configured limit.
    assert_stream_error(end, "policy-violation");
    assert_still_serving(&ts).await;
    ts.stop().await;
}

#[tokio::test]
async fn oversize_data_before_authentication_gets_policy_violation() {
    let ts = TestServer::start(|c| c.limits.max_stanza_size = 10_000).await;
    let mut c = Client::tcp(&ts).await;
    c.open(&ts.domain).await.expect("stream");
    let mut c = c.starttls(&ts).await;
    let big = format!(
        "<auth xmlns='urn:ietf:params:xml:ns:xmpp-sasl' mechanism='PLAIN'>{}</auth>",
        "A".repeat(20_000)
    );
    c.send_raw(&big).await;
    // The size bound holds before authentication too (RFC 6120 §4.9.3.14).
    assert_stream_error(c.expect_stream_end().await, "policy-violation");
    assert_still_serving(&ts).await;
    ts.stop().await;
}

/// XML 1.0 §2.2 / RFC 6120 §11: a character outside the Char production (here U+0001, raw
/// and as a character reference) is not-well-formed for the sender. It is never relayed: a
/// recipient's parser would fail on it and disconnect the recipient.
#[tokio::test]
async fn forbidden_character_in_a_message_gets_not_well_formed_and_reaches_nobody() {
    let ts = TestServer::start(|_| {}).await;
    for (i, bad) in ["a\u{1}b", "a&#1;b"].into_iter().enumerate() {
        let (mallory, bob, carol) = (
            format!("mallory{i}{}", unique()),
            format!("bob{i}{}", unique()),
            format!("carol{i}{}", unique()),
        );
        for u in [&mallory, &bob, &carol] {
            ts.user(u).await;
        }
        let mut bob = ts.login(&bob, "r").await;
        go_online(&mut bob, 0).await;
        let mut mallory = ts.login(&mallory, "r").await;
        let mut carol = ts.login(&carol, "r").await;
        mallory
            .send_raw(&format!(
                "<message to='{}' type='chat'><body>{bad}</body></message>",
                bob.jid
            ))
            .await;
        assert_stream_error(mallory.expect_stream_end().await, "not-well-formed");
        // Positive control and barrier: carol's message, sent after mallory's stream ended,
        // is the first message bob gets, and bob's stream is still up to get it.
        assert_no_message_before_marker(&mut carol, &mut bob).await;
    }
    assert_still_serving(&ts).await;
    ts.stop().await;
}

/// The memory attack: an unfinished stanza of many empty elements, well under the byte
/// limit. Before authentication the small element count ends it with policy-violation
/// (RFC 6120 §4.9.3.14), after authentication the larger one; a stanza under the larger
/// limit is served after authentication.
#[tokio::test]
async fn many_elements_in_one_stanza_get_policy_violation_with_a_smaller_limit_before_authentication(
) {
    let ts = TestServer::start(|c| {
        c.limits.max_stanza_nodes_unauthenticated = 200;
        c.limits.max_stanza_nodes = 5_000;
    })
    .await;
    // Before TLS, and after STARTTLS before SASL: 1,000 elements, 4 KB.
    let unfinished = format!("<iq type='get' id='x'>{}", "<a/>".repeat(1_000));
    let (_, end) = raw_exchange(
        &ts,
        &format!(
            "{}{unfinished}",
            header(&ts.domain, x::NS_STREAM, NS_CLIENT)
        ),
    )
    .await;
    assert_stream_error(end, "policy-violation");
    let mut c = Client::tcp(&ts).await;
    c.open(&ts.domain).await.expect("stream");
    let mut c = c.starttls(&ts).await;
    c.send_raw(&unfinished).await;
    assert_stream_error(c.expect_stream_end().await, "policy-violation");

    // After authentication the same 1,000 elements are a stanza like any other...
    let (alice, bob) = (format!("alice{}", unique()), format!("bob{}", unique()));
    ts.user(&alice).await;
    ts.user(&bob).await;
    let mut bob = ts.login(&bob, "r").await;
    go_online(&mut bob, 0).await;
    let mut alice = ts.login(&alice, "r").await;
    alice
        .send_raw(&format!(
            "<message to='{}' type='chat'><body>many</body><x xmlns='urn:example:x'>{}</x></message>",
            bob.jid,
            "<a/>".repeat(1_000)
        ))
        .await;
    let got = bob.expect(is_message).await;
    assert_eq!(body(&got), "many");
    assert_eq!(
        got.get_child("x", "urn:example:x")
            .map(|x| x.elements().count()),
        Some(1_000)
    );
    // ...and 6,000 exceed the authenticated limit.
    alice
        .send_raw(&format!(
            "<message to='{}'>{}",
            bob.jid,
            "<a/>".repeat(6_000)
        ))
        .await;
    assert_stream_error(alice.expect_stream_end().await, "policy-violation");
    assert_still_serving(&ts).await;
    ts.stop().await;
}

/// Attributes are counted per element (each is compared with its siblings for duplicates)
/// and namespace declarations in scope (each prefix lookup walks them): 22,000 attributes
/// or 15,000 declarations on a stream header, or 22,000 attributes on a stanza, end the
/// stream with policy-violation before any of it is stored.
#[tokio::test]
async fn too_many_attributes_or_namespace_declarations_get_policy_violation() {
    let ts = TestServer::start(|_| {}).await;
    let attrs: String = (0..22_000).map(|i| format!(" a{i}=''")).collect();
    let decls: String = (0..15_000).map(|i| format!(" xmlns:n{i}='u'")).collect();
    for extra in [&attrs, &decls] {
        // Under the byte limit: only the new counts can refuse it.
        assert!(extra.len() < ts.config.limits.max_stanza_size - 200);
        let started = Instant::now();
        let (_, end) = raw_exchange(
            &ts,
            &format!(
                "<stream:stream xmlns='jabber:client' xmlns:stream='{}' to='{}' version='1.0'{extra}>",
                x::NS_STREAM,
                ts.domain
            ),
        )
        .await;
        assert_stream_error(end, "policy-violation");
        eprintln!("stream header refused in {:?}", started.elapsed());
    }
    let end = bound_client_sends(&ts, &format!("<message{attrs}/>")).await;
    assert_stream_error(end, "policy-violation");
    assert_still_serving(&ts).await;
    ts.stop().await;
}

#[tokio::test]
async fn nesting_deeper_than_max_depth_gets_policy_violation() {
    let ts = TestServer::start(|c| c.limits.max_depth = 16).await;
    let deep = format!(
        "<message to='{}'>{}{}</message>",
        ts.jid("x"),
        "<x xmlns='urn:example:deep'>".repeat(40),
        "</x>".repeat(40)
    );
    let end = bound_client_sends(&ts, &deep).await;
    // RFC 6120 §4.9.3.14: a configured limit on the stanza's structure.
    assert_stream_error(end, "policy-violation");
    assert_still_serving(&ts).await;
    ts.stop().await;
}

#[tokio::test]
async fn entity_reference_beyond_the_predefined_five_gets_restricted_xml() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let mut alice = ts.login("alice", "a").await;
    let mut bob = ts.login("bob", "b").await;
    // The five predefined entities and character references are ordinary XML.
    alice
        .send_raw(&format!(
            "<message to='{}'><body>&lt;&amp;&gt;&quot;&apos;&#65;</body></message>",
            bob.jid
        ))
        .await;
    assert_eq!(body(&bob.expect(is_message).await), "<&>\"'A");
    alice
        .send_raw(&format!(
            "<message to='{}'><body>&boom;</body></message>",
            bob.jid
        ))
        .await;
    // RFC 6120 §4.9.3.18 lists "XML entity reference" among the restricted features.
    assert_stream_error(alice.expect_stream_end().await, "restricted-xml");
    assert_still_serving(&ts).await;
    ts.stop().await;
}

#[tokio::test]
async fn dtd_inside_a_bound_stream_gets_restricted_xml() {
    let ts = TestServer::start(|_| {}).await;
    let end = bound_client_sends(&ts, "<!DOCTYPE x [<!ENTITY a 'b'>]>").await;
    // RFC 6120 §11.1: no DTD anywhere in the stream.
    assert_stream_error(end, "restricted-xml");
    assert_still_serving(&ts).await;
    ts.stop().await;
}

#[tokio::test]
async fn wrong_stream_namespace_gets_invalid_namespace() {
    let ts = TestServer::start(|_| {}).await;
    let bytes = format!(
        "{HEADER_PREFIX}{}",
        header(&ts.domain, "urn:example:not-streams", NS_CLIENT)
    );
    let (c, end) = raw_exchange(&ts, &bytes).await;
    // RFC 6120 §4.8.1 / §4.9.3.10.
    assert_stream_error(end, "invalid-namespace");
    assert!(
        c.header.is_some(),
        "RFC 6120 §4.9.1.1: header before the error"
    );
    assert_still_serving(&ts).await;
    ts.stop().await;
}

#[tokio::test]
async fn server_content_namespace_on_a_client_stream_gets_invalid_namespace() {
    let ts = TestServer::start(|_| {}).await;
    let bytes = format!(
        "{HEADER_PREFIX}{}",
        header(&ts.domain, x::NS_STREAM, x::NS_SERVER)
    );
    let (c, end) = raw_exchange(&ts, &bytes).await;
    // RFC 6120 §4.8.2 / §4.9.3.10.
    assert_stream_error(end, "invalid-namespace");
    assert!(
        c.header.is_some(),
        "RFC 6120 §4.9.1.1: header before the error"
    );
    assert_still_serving(&ts).await;
    ts.stop().await;
}

#[tokio::test]
async fn stream_to_an_unserved_domain_gets_host_unknown() {
    let ts = TestServer::start(|_| {}).await;
    let mut c = Client::tcp(&ts).await;
    // RFC 6120 §4.9.3.6.
    match c.open("nope.example").await {
        Err(Ended::StreamError(cond)) => assert_eq!(cond, "host-unknown"),
        other => panic!("expected host-unknown, got {other:?}"),
    }
    assert!(
        c.header.is_some(),
        "RFC 6120 §4.9.1.1: header before the error"
    );
    assert_still_serving(&ts).await;
    ts.stop().await;
}

#[tokio::test]
async fn slow_negotiation_gets_connection_timeout_within_the_configured_time() {
    let ts = TestServer::start(|c| c.limits.negotiation_timeout = Duration::from_secs(1)).await;
    ts.user("steady").await;
    let mut steady = ts.login("steady", "r").await;
    let started = Instant::now();
    let mut c = Client::tcp(&ts).await;
    c.open(&ts.domain).await.expect("stream");
    // Send nothing more: no STARTTLS, no auth.
    let end = c.expect_stream_end().await;
    let took = started.elapsed();
    // RFC 6120 §4.9.3.4.
    assert_stream_error(end, "connection-timeout");
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(3),
        "timeout after {took:?}, configured 1 s"
    );
    // The bound only covers negotiation: a session bound before it is still served.
    let pong = steady
        .iq("get", Some(&ts.domain), Element::new("ping", x::NS_PING))
        .await;
    assert_eq!(pong.get_attr("type"), Some("result"), "{pong}");
    assert_still_serving(&ts).await;
    ts.stop().await;
}

#[tokio::test]
async fn stanza_flood_gets_policy_violation() {
    let ts = TestServer::start(|c| {
        c.limits.stanzas_per_second = 2;
        c.limits.stanza_burst = 5;
    })
    .await;
    let flood: String = (0..40)
        .map(|i| {
            format!(
                "<iq type='get' id='f{i}' to='{}'><ping xmlns='urn:xmpp:ping'/></iq>",
                ts.domain
            )
        })
        .collect();
    let end = bound_client_sends(&ts, &flood).await;
    // RFC 6120 §4.9.3.14: the configured rate was exceeded.
    assert_stream_error(end, "policy-violation");
    assert_still_serving(&ts).await;
    ts.stop().await;
}

#[tokio::test]
async fn stanza_with_someone_elses_from_gets_invalid_from() {
    let ts = TestServer::start(|_| {}).await;
    let spoof = format!(
        "<message from='{}/x' to='{}'><body>hi</body></message>",
        ts.jid("mallory"),
        ts.jid("victim")
    );
    let end = bound_client_sends(&ts, &spoof).await;
    // RFC 6120 §4.9.3.9 / §8.1.2.1.
    assert_stream_error(end, "invalid-from");
    assert_still_serving(&ts).await;
    ts.stop().await;
}

#[tokio::test]
async fn unknown_top_level_element_after_bind_gets_unsupported_stanza_type() {
    let ts = TestServer::start(|_| {}).await;
    let end = bound_client_sends(&ts, "<foo/>").await;
    // RFC 6120 §4.9.3.22.
    assert_stream_error(end, "unsupported-stanza-type");
    assert_still_serving(&ts).await;
    ts.stop().await;
}

#[tokio::test]
async fn connections_over_the_per_ip_rate_get_policy_violation() {
    let ts = TestServer::start(|c| c.limits.connections_per_ip_per_minute = 3).await;
    let mut open = Vec::new();
    for n in 1..=3 {
        let mut c = Client::tcp(&ts).await;
        c.open(&ts.domain)
            .await
            .unwrap_or_else(|e| panic!("connection {n} within the limit refused: {e:?}"));
        open.push(c);
    }
    let mut fourth = Client::tcp(&ts).await;
    // RFC 6120 §4.9.3.14: the configured per-address rate.
    match fourth.open(&ts.domain).await {
        Err(Ended::StreamError(cond)) => assert_eq!(cond, "policy-violation"),
        other => panic!("expected policy-violation, got {other:?}"),
    }
    // Another address is not affected (127.0.0.2 is loopback too).
    assert_still_serving_from(&ts, IpAddr::from([127, 0, 0, 2])).await;
    ts.stop().await;
}

// ---------------------------------------------------------------------------------------
// The operator command line.

/// `user add` with neither a terminal nor `--password-file` (a script, a container's `exec`
/// without `-t`) says what to pass instead of the terminal library's "No such device or
/// address", and creates nothing.
#[tokio::test]
async fn cli_user_add_without_a_terminal_points_to_password_file() {
    let ts = TestServer::start(|_| {}).await;
    let cli = Cli::for_server(env!("CARGO_BIN_EXE_presenced"), &ts);
    let jid = ts.jid("dora");
    // run_presenced gives the child a null standard input: not a terminal.
    let out = cli.run(&["user", "add", &jid]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "no password, no account: {out:?}");
    assert!(
        stderr.contains("--password-file"),
        "the error names --password-file: {stderr}"
    );
    // Nothing was created: the same add with a password file succeeds.
    let pw = cli.password_file("pw");
    let out = cli
        .run(&["user", "add", &jid, "--password-file", &pw])
        .await;
    assert!(out.status.success(), "the account did not exist: {out:?}");
}

/// One SASL PLAIN attempt on a fresh connection; returns the answer's name.
async fn plain_attempt(ts: &TestServer, user: &str, pw: &str) -> String {
    let mut c = Client::tcp(ts).await;
    c.open(&ts.domain).await.expect("stream");
    let mut c = c.starttls(ts).await;
    let answer = c.auth_plain(user, pw).await;
    answer.name.clone()
}

#[tokio::test]
async fn cli_user_add_passwd_del_control_who_can_log_in() {
    let ts = TestServer::start(|_| {}).await;
    let cli = Cli::for_server(env!("CARGO_BIN_EXE_presenced"), &ts);
    let jid = ts.jid("carol");

    let out = cli
        .run(&[
            "user",
            "add",
            &jid,
            "--password-file",
            &cli.password_file("first pw"),
        ])
        .await;
    assert!(out.status.success(), "user add: {out:?}");
    let c = Client::login(&ts, "carol", "first pw", "r").await;
    c.close().await;

    let again = cli
        .run(&[
            "user",
            "add",
            &jid,
            "--password-file",
            &cli.password_file("x"),
        ])
        .await;
    assert!(
        !again.status.success(),
        "adding an existing account must fail"
    );

    let out = cli
        .run(&[
            "user",
            "passwd",
            &jid,
            "--password-file",
            &cli.password_file("second pw"),
        ])
        .await;
    assert!(out.status.success(), "user passwd: {out:?}");
    assert_eq!(plain_attempt(&ts, "carol", "first pw").await, "failure");
    assert_eq!(plain_attempt(&ts, "carol", "second pw").await, "success");

    let out = cli.run(&["user", "del", &jid]).await;
    assert!(out.status.success(), "user del: {out:?}");
    assert_eq!(plain_attempt(&ts, "carol", "second pw").await, "failure");
    let out = cli.run(&["user", "del", &jid]).await;
    assert!(
        !out.status.success(),
        "deleting a missing account must fail"
    );

    let foreign = cli
        .run(&[
            "user",
            "add",
            "dave@not-served.example",
            "--password-file",
            &cli.password_file("x"),
        ])
        .await;
    assert!(
        !foreign.status.success(),
        "a domain the config does not serve"
    );
    let _ = std::fs::remove_dir_all(&cli.dir);
    ts.stop().await;
}

#[tokio::test]
async fn cli_check_config_accepts_the_example_and_rejects_a_broken_file() {
    let example =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("presenced.example.toml");
    let out = run_presenced(env!("CARGO_BIN_EXE_presenced"), &example, &["check-config"]).await;
    assert!(out.status.success(), "example config: {out:?}");
    // The example runs embedded; check-config names the file (relative to the config)
    // and does not create it.
    let check = |config: &std::path::Path| {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_presenced"))
            .arg("--config")
            .arg(config)
            .arg("check-config")
            .env_remove("DATABASE_URL")
            .output()
    };
    let out = check(&example).await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("presenced.db");
    assert!(
        stdout.contains(&format!("store: SQLite file {}", file.display())),
        "{stdout}"
    );

    // A store it cannot reach is named with its address.
    let dir = std::env::temp_dir().join(format!("presenced-cli-{}", unique()));
    std::fs::create_dir_all(&dir).unwrap();
    let unreachable = [
        (
            "postgres://postgres@127.0.0.1:1/nothing",
            "PostgreSQL at 127.0.0.1:1, database nothing: NOT USABLE",
        ),
        (
            "sqlite:///nonexistent-dir/p.db",
            "SQLite file /nonexistent-dir/p.db: NOT USABLE",
        ),
    ];
    for (url, says) in unreachable {
        let f = dir.join("store.toml");
        std::fs::write(
            &f,
            format!("domains = [\"a.example\"]\n[database]\nurl = \"{url}\"\n"),
        )
        .unwrap();
        let out = check(&f).await.unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains(says), "{url}: {stdout}");
    }
    let _ = std::fs::remove_dir_all(&dir);

    let dir = std::env::temp_dir().join(format!("presenced-cli-{}", unique()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases = [
        (
            "unknown key",
            "domains = [\"a.example\"]\n[limits]\nmax_stanzas = 3\n",
        ),
        ("not TOML", "domains = [\"a.example\"\n"),
        (
            "wrong type",
            "domains = [\"a.example\"]\n[c2s]\nport = \"high\"\n",
        ),
    ];
    for (what, text) in cases {
        let f = dir.join("broken.toml");
        std::fs::write(&f, text).unwrap();
        let out = run_presenced(env!("CARGO_BIN_EXE_presenced"), &f, &["check-config"]).await;
        assert!(!out.status.success(), "{what} accepted: {out:?}");
        assert!(!out.stderr.is_empty(), "{what}: no message on stderr");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
