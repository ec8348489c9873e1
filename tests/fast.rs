//! XEP-0484 FAST against the real server: a token asked for with the password, then a
//! login with it in one round trip (HT-SHA-256-NONE, the server's proof in
//! `<additional-data/>`), and every way a token stops working: another token, client or
//! account, a replayed count, expiry (credentials-expired), `invalidate`, rotation, a
//! password change, `presenced user revoke` and the account's deletion.

mod common;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use common::*;
use hmac::{Hmac, Mac};
use presenced::protocol::xml::Element;
use sha2::Sha256;

const NS_SASL2: &str = "urn:xmpp:sasl:2";
const NS_SASL: &str = "urn:ietf:params:xml:ns:xmpp-sasl";
const NS_BIND2: &str = "urn:xmpp:bind:0";
const NS_FAST: &str = "urn:xmpp:fast:0";
const HT: &str = "HT-SHA-256-NONE";
/// The client installation most tests log in as (XEP-0388 `<user-agent id/>`).
const PHONE: &str = "9d7d2ab5-6bf6-4f1b-a2c5-3c9cfb6b8e0e";

/// Limits that let a test fail many logins without locking the account.
fn lenient(c: &mut presenced::config::Config) {
    c.limits.auth_backoff_failures = 1000;
}

async fn secured(ts: &TestServer) -> Client {
    let mut c = Client::tcp(ts).await;
    c.open(&ts.domain).await.expect("stream");
    c.starttls(ts).await
}

fn user_agent(id: &str) -> String {
    format!("<user-agent id='{id}'><software>fast-test</software></user-agent>")
}

/// A password login over SASL2 asking for a token; the `<success/>`.
async fn password_login(c: &mut Client, user: &str, password: &str, agent: &str) -> Element {
    c.send_raw(&format!(
        "<authenticate xmlns='{NS_SASL2}' mechanism='PLAIN'>\
         <initial-response>{}</initial-response>{}\
         <request-token xmlns='{NS_FAST}' mechanism='{HT}'/></authenticate>",
        B64.encode(format!("\0{user}\0{password}")),
        user_agent(agent)
    ))
    .await;
    c.next_stanza(WAIT).await.expect("SASL2 answer")
}

/// The token a `<success/>` carries.
fn issued(success: &Element) -> String {
    assert!(success.is("success", NS_SASL2), "{success}");
    let t = success
        .get_child("token", NS_FAST)
        .unwrap_or_else(|| panic!("no token in {success}"));
    t.get_attr("token").expect("token attribute").to_owned()
}

fn hmac(key: &str, data: &[u8]) -> Vec<u8> {
    let mut m = Hmac::<Sha256>::new_from_slice(key.as_bytes()).unwrap();
    m.update(data);
    m.finalize().into_bytes().to_vec()
}

/// A FAST login with `token` as `user` from client `agent`; `fast` is the `<fast/>`
/// element's attributes, `inner` more of the request. The answer.
async fn token_login(
    c: &mut Client,
    user: &str,
    token: &str,
    agent: Option<&str>,
    fast: &str,
    inner: &str,
) -> Element {
    let mut initial = format!("{user}\0").into_bytes();
    initial.extend(hmac(token, b"Initiator"));
    c.send_raw(&format!(
        "<authenticate xmlns='{NS_SASL2}' mechanism='{HT}'>\
         <initial-response>{}</initial-response>{}<fast xmlns='{NS_FAST}' {fast}/>{inner}\
         </authenticate>",
        B64.encode(initial),
        agent.map(user_agent).unwrap_or_default()
    ))
    .await;
    c.next_stanza(WAIT).await.expect("SASL2 answer")
}

/// A token for `user` on client `agent`, asked for with the password.
async fn token_for(ts: &TestServer, user: &str, agent: &str) -> String {
    let mut c = secured(ts).await;
    let success = password_login(&mut c, user, "pw", agent).await;
    let token = issued(&success);
    c.close().await;
    token
}

/// Logs in with `token` on a new stream; the answer.
async fn try_token(ts: &TestServer, user: &str, token: &str, count: u32) -> Element {
    let mut c = secured(ts).await;
    token_login(
        &mut c,
        user,
        token,
        Some(PHONE),
        &format!("count='{count}'"),
        "",
    )
    .await
}

fn assert_failure(answer: &Element, cond: &str) {
    assert!(answer.is("failure", NS_SASL2), "{answer}");
    assert!(answer.get_child(cond, NS_SASL).is_some(), "{answer}");
}

/// XEP-0484: the mechanism is offered inside SASL2's `<inline/>` only, never as a SASL
/// mechanism of its own; a token asked for with the password comes in the `<success/>`
/// with its expiry, and logs in on the next stream in one round trip, bind included, with
/// the server's proof of the token in `<additional-data/>`.
#[tokio::test]
async fn a_token_asked_for_with_the_password_logs_in_in_one_round_trip() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    let c = secured(&ts).await;
    let features = c.features.clone().expect("features");
    let auth = features
        .get_child("authentication", NS_SASL2)
        .expect("SASL2");
    let fast = auth
        .get_child("inline", NS_SASL2)
        .and_then(|i| i.get_child("fast", NS_FAST))
        .unwrap_or_else(|| panic!("no FAST offer in {features}"));
    let offered: Vec<String> = fast.elements().map(|m| m.text_content()).collect();
    assert_eq!(offered, [HT]);
    let mechanisms =
        |parent: &Element| -> Vec<String> { parent.elements().map(|m| m.text_content()).collect() };
    let sasl1 = features.get_child("mechanisms", NS_SASL).unwrap();
    assert!(!mechanisms(sasl1).contains(&HT.to_owned()), "{features}");
    drop(c);

    let mut c = secured(&ts).await;
    let success = password_login(&mut c, "alice", "pw", PHONE).await;
    let token = issued(&success);
    let expiry = success
        .get_child("token", NS_FAST)
        .unwrap()
        .get_attr("expiry")
        .unwrap();
    let expiry = chrono::DateTime::parse_from_rfc3339(expiry).expect("XEP-0082 date-time");
    let days = (expiry.with_timezone(&chrono::Utc) - chrono::Utc::now()).num_hours() as f64 / 24.0;
    assert!(
        (20.9..=21.0).contains(&days),
        "default lifetime 21 days, got {days}"
    );
    c.close().await;

    let mut c = secured(&ts).await;
    let success = token_login(
        &mut c,
        "alice",
        &token,
        Some(PHONE),
        "count='1'",
        &format!("<bind xmlns='{NS_BIND2}'><tag>Phone</tag></bind>"),
    )
    .await;
    assert!(success.is("success", NS_SASL2), "{success}");
    let proof = B64
        .decode(
            success
                .get_child("additional-data", NS_SASL2)
                .unwrap()
                .text_content(),
        )
        .unwrap();
    assert_eq!(
        proof,
        hmac(&token, b"Responder"),
        "the server proves the token"
    );
    // A fresh token is not replaced: no new one unasked.
    assert!(success.get_child("token", NS_FAST).is_none(), "{success}");
    let jid = success
        .get_child("authorization-identifier", NS_SASL2)
        .unwrap()
        .text_content();
    assert!(
        jid.starts_with(&format!("{}/Phone.", ts.jid("alice"))),
        "{jid}"
    );
    success.get_child("bound", NS_BIND2).expect("bound");
    c.jid = jid;
    let pong = c
        .iq("get", None, Element::new("ping", "urn:xmpp:ping"))
        .await;
    assert_eq!(pong.get_attr("type"), Some("result"), "{pong}");
    c.close().await;
    ts.stop().await;
}

/// XEP-0484 "Token binding": a token logs in only the account and the client installation
/// it was issued to; a wrong token, another user-agent id, none, or another account's
/// name all fail as a wrong password does, and a token is no SASL1 mechanism.
#[tokio::test]
async fn a_token_logs_in_only_its_account_and_client() {
    let ts = TestServer::start(lenient).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let token = token_for(&ts, "alice", PHONE).await;
    let bobs = token_for(&ts, "bob", PHONE).await;

    let wrong = format!("{token}x");
    let cases: [(&str, &str, Option<&str>); 4] = [
        ("alice", &wrong, Some(PHONE)),
        ("alice", &token, Some("another-installation")),
        ("alice", &token, None),
        ("bob", &token, Some(PHONE)),
    ];
    for (user, token, agent) in cases {
        let mut c = secured(&ts).await;
        let answer = token_login(&mut c, user, token, agent, "count='1'", "").await;
        assert_failure(&answer, "not-authorized");
    }
    // Bob's own token still logs him in: the failures above cost nobody their token.
    let answer = try_token(&ts, "bob", &bobs, 1).await;
    assert!(answer.is("success", NS_SASL2), "{answer}");

    let mut c = secured(&ts).await;
    let mut initial = b"alice\0".to_vec();
    initial.extend(hmac(&token, b"Initiator"));
    c.send_raw(&format!(
        "<auth xmlns='{NS_SASL}' mechanism='{HT}'>{}</auth>",
        B64.encode(initial)
    ))
    .await;
    let answer = c.next_stanza(WAIT).await.expect("SASL1 answer");
    assert!(answer.is("failure", NS_SASL), "{answer}");
    assert!(
        answer.get_child("invalid-mechanism", NS_SASL).is_some(),
        "{answer}"
    );
    ts.stop().await;
}

/// XEP-0484 "count": each login with a token carries a higher count; a login that repeats
/// one (a replayed authentication) fails, the next higher count works.
#[tokio::test]
async fn a_replayed_count_is_refused() {
    let ts = TestServer::start(lenient).await;
    ts.user("alice").await;
    let token = token_for(&ts, "alice", PHONE).await;
    assert!(try_token(&ts, "alice", &token, 5)
        .await
        .is("success", NS_SASL2));
    assert_failure(&try_token(&ts, "alice", &token, 5).await, "not-authorized");
    assert_failure(&try_token(&ts, "alice", &token, 4).await, "not-authorized");
    assert!(try_token(&ts, "alice", &token, 6)
        .await
        .is("success", NS_SASL2));
    ts.stop().await;
}

/// RFC 6120 §6.5.2: a token past its expiry fails with credentials-expired, which tells the
/// client to log in with its password (and ask for a new token).
#[tokio::test]
async fn an_expired_token_fails_with_credentials_expired() {
    let ts = TestServer::start(lenient).await;
    ts.user("alice").await;
    let token = token_for(&ts, "alice", PHONE).await;
    let expire = "UPDATE fast_tokens SET expires_at = 1 WHERE account_id IN \
                  (SELECT id FROM accounts WHERE domain = $1)";
    assert_eq!(ts.sql(expire, expire, &[&ts.domain]).await.unwrap(), 1);
    assert_failure(
        &try_token(&ts, "alice", &token, 1).await,
        "credentials-expired",
    );
    // The password still logs in and brings a new token that works.
    let fresh = token_for(&ts, "alice", PHONE).await;
    assert!(try_token(&ts, "alice", &fresh, 1)
        .await
        .is("success", NS_SASL2));
    ts.stop().await;
}

/// XEP-0484 "Token rotation": a login with a token older than the rotation period brings a
/// new one; the old one keeps working until the client logs in with the new one, then
/// stops. `<fast invalidate='true'/>` (logging out) ends the token it logs in with.
#[tokio::test]
async fn tokens_rotate_and_invalidate() {
    let ts = TestServer::start(lenient).await;
    ts.user("alice").await;
    let old = token_for(&ts, "alice", PHONE).await;
    let age = "UPDATE fast_tokens SET issued_at = issued_at - 2 * 86400 WHERE account_id IN \
               (SELECT id FROM accounts WHERE domain = $1)";
    assert_eq!(ts.sql(age, age, &[&ts.domain]).await.unwrap(), 1);
    let missed = issued(&try_token(&ts, "alice", &old, 1).await);
    assert_ne!(missed, old);
    // The client may have missed that <success/>: the old token still works, and brings
    // a new one in place of the missed one (a client holds at most two)...
    let new = issued(&try_token(&ts, "alice", &old, 2).await);
    assert_ne!(new, missed);
    assert_failure(&try_token(&ts, "alice", &missed, 1).await, "not-authorized");
    // ...until the new one is used.
    let success = try_token(&ts, "alice", &new, 1).await;
    assert!(success.is("success", NS_SASL2), "{success}");
    assert!(success.get_child("token", NS_FAST).is_none(), "{success}");
    assert_failure(&try_token(&ts, "alice", &old, 3).await, "not-authorized");

    let mut c = secured(&ts).await;
    let success = token_login(
        &mut c,
        "alice",
        &new,
        Some(PHONE),
        "count='2' invalidate='true'",
        "",
    )
    .await;
    assert!(success.is("success", NS_SASL2), "{success}");
    assert!(success.get_child("token", NS_FAST).is_none(), "{success}");
    c.close().await;
    assert_failure(&try_token(&ts, "alice", &new, 3).await, "not-authorized");
    ts.stop().await;
}

/// A new password ends every token of the account; `presenced user revoke` ends one
/// client's or all; deleting the account ends them too, so a new account of the same name
/// is not logged in by the old one's tokens.
#[tokio::test]
async fn password_changes_the_revoke_command_and_deletion_end_tokens() {
    let ts = TestServer::start(lenient).await;
    ts.user("alice").await;
    let token = token_for(&ts, "alice", PHONE).await;
    ts.shared()
        .store
        .set_password("alice", &ts.domain, "pw", 4096)
        .await
        .unwrap();
    assert_failure(&try_token(&ts, "alice", &token, 1).await, "not-authorized");

    let cli = Cli::for_server(env!("CARGO_BIN_EXE_presenced"), &ts);
    let jid = ts.jid("alice");
    let token = token_for(&ts, "alice", PHONE).await;
    let out = cli
        .run(&["user", "revoke", &jid, "--client", "another-installation"])
        .await;
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("revoked 0"),
        "{out:?}"
    );
    assert!(try_token(&ts, "alice", &token, 1)
        .await
        .is("success", NS_SASL2));
    let out = cli.run(&["user", "revoke", &jid, "--client", PHONE]).await;
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("revoked 1"),
        "{out:?}"
    );
    assert_failure(&try_token(&ts, "alice", &token, 2).await, "not-authorized");
    let out = cli.run(&["user", "revoke", &ts.jid("nobody")]).await;
    assert!(!out.status.success(), "{out:?}");

    let token = token_for(&ts, "alice", PHONE).await;
    ts.shared()
        .store
        .delete_account("alice", &ts.domain, std::slice::from_ref(&ts.domain))
        .await
        .unwrap();
    ts.user("alice").await;
    assert_failure(&try_token(&ts, "alice", &token, 1).await, "not-authorized");
    ts.stop().await;
}

/// `[auth] fast = false`: no FAST offer, no token in a `<success/>`, and the mechanism is
/// refused.
#[tokio::test]
async fn fast_can_be_switched_off() {
    let ts = TestServer::start(|c| c.auth.fast = false).await;
    ts.user("alice").await;
    let mut c = secured(&ts).await;
    let features = c.features.clone().unwrap();
    let inline = features
        .get_child("authentication", NS_SASL2)
        .and_then(|a| a.get_child("inline", NS_SASL2))
        .unwrap();
    assert!(inline.get_child("fast", NS_FAST).is_none(), "{features}");
    let success = password_login(&mut c, "alice", "pw", PHONE).await;
    assert!(success.is("success", NS_SASL2), "{success}");
    assert!(success.get_child("token", NS_FAST).is_none(), "{success}");
    c.close().await;
    let answer = try_token(&ts, "alice", "anything", 1).await;
    assert_failure(&answer, "invalid-mechanism");
    ts.stop().await;
}
