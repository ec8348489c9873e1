//! XEP-0388 SASL2 and XEP-0386 Bind 2 against the real server, element by element: the
//! feature beside SASL1 (after TLS only), SCRAM-SHA-256 with its server-final in
//! `<additional-data/>` and no stream restart, failures with the RFC 6120 condition and the
//! back-off they count towards, a bind inline with XEP-0198, XEP-0280 and XEP-0352 enabled
//! in the same round trip, and a XEP-0198 resumption inline.

mod common;

use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use common::*;
use hmac::{Hmac, Mac};
use presenced::protocol::jid::FullJid;
use presenced::protocol::xml::{Element, NS_CLIENT};
use sha2::{Digest, Sha256};

const NS_SASL2: &str = "urn:xmpp:sasl:2";
const NS_SASL: &str = "urn:ietf:params:xml:ns:xmpp-sasl";
const NS_BIND2: &str = "urn:xmpp:bind:0";
const NS_SM: &str = "urn:xmpp:sm:3";

/// A TLS stream, opened, before authentication.
async fn secured(ts: &TestServer) -> Client {
    let mut c = Client::tcp(ts).await;
    c.open(&ts.domain).await.expect("stream");
    c.starttls(ts).await
}

fn plain(user: &str, password: &str) -> String {
    B64.encode(format!("\0{user}\0{password}"))
}

/// The installation most tests log in as (XEP-0388 `<user-agent id/>`).
const AGENT: &str = "d4565fa7-4d72-4749-b3d3-740edbf87770";

/// Sends a SASL2 PLAIN `<authenticate/>` with `inner` inline and returns the answer.
async fn authenticate_plain(c: &mut Client, user: &str, password: &str, inner: &str) -> Element {
    authenticate_plain_as(c, AGENT, user, password, inner).await
}

/// [`authenticate_plain`] from installation `agent`.
async fn authenticate_plain_as(
    c: &mut Client,
    agent: &str,
    user: &str,
    password: &str,
    inner: &str,
) -> Element {
    c.send_raw(&format!(
        "<authenticate xmlns='{NS_SASL2}' mechanism='PLAIN'>\
         <initial-response>{}</initial-response>\
         <user-agent id='{agent}'><software>test</software></user-agent>\
         {inner}</authenticate>",
        plain(user, password)
    ))
    .await;
    c.next_stanza(WAIT).await.expect("SASL2 answer")
}

fn child<'a>(el: &'a Element, name: &str, ns: &str) -> &'a Element {
    el.get_child(name, ns)
        .unwrap_or_else(|| panic!("no <{name} xmlns='{ns}'/> in {el}"))
}

fn authzid(success: &Element) -> String {
    child(success, "authorization-identifier", NS_SASL2).text_content()
}

type HmacSha256 = Hmac<Sha256>;

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    let mut m = HmacSha256::new_from_slice(key).unwrap();
    m.update(data);
    m.finalize().into_bytes().to_vec()
}

/// RFC 5802 §3 on the client's side: the client-final for `server_first`, and the server
/// signature the server-final must carry.
fn scram_final(password: &str, client_first_bare: &str, server_first: &str) -> (String, Vec<u8>) {
    let attr = |k: &str| {
        server_first
            .split(',')
            .find_map(|p| p.strip_prefix(&format!("{k}=")))
            .unwrap()
            .to_owned()
    };
    let (nonce, salt, iterations) = (attr("r"), B64.decode(attr("s")).unwrap(), attr("i"));
    let mut salted = [0u8; 32];
    pbkdf2::pbkdf2_hmac::<Sha256>(
        password.as_bytes(),
        &salt,
        iterations.parse().unwrap(),
        &mut salted,
    );
    let client_key = hmac(&salted, b"Client Key");
    let stored_key = Sha256::digest(&client_key);
    let without_proof = format!("c=biws,r={nonce}");
    let auth_message = format!("{client_first_bare},{server_first},{without_proof}");
    let signature = hmac(&stored_key, auth_message.as_bytes());
    let proof: Vec<u8> = client_key
        .iter()
        .zip(&signature)
        .map(|(a, b)| a ^ b)
        .collect();
    let server_key = hmac(&salted, b"Server Key");
    let server_signature = hmac(&server_key, auth_message.as_bytes());
    (
        format!("{without_proof},p={}", B64.encode(proof)),
        server_signature,
    )
}

/// A SCRAM-SHA-256 exchange in SASL2 framing; the final answer and the server signature
/// expected in it.
async fn scram_sha_256(
    c: &mut Client,
    user: &str,
    password: &str,
    inner: &str,
) -> (Element, Vec<u8>) {
    let bare = format!("n={user},r=fyko+d2lbbFgONRv9qkxdawL");
    c.send_raw(&format!(
        "<authenticate xmlns='{NS_SASL2}' mechanism='SCRAM-SHA-256'>\
         <initial-response>{}</initial-response>{inner}</authenticate>",
        B64.encode(format!("n,,{bare}"))
    ))
    .await;
    let challenge = c.next_stanza(WAIT).await.expect("challenge");
    assert!(challenge.is("challenge", NS_SASL2), "{challenge}");
    let server_first = String::from_utf8(B64.decode(challenge.text_content()).unwrap()).unwrap();
    let (client_final, signature) = scram_final(password, &bare, &server_first);
    c.send_raw(&format!(
        "<response xmlns='{NS_SASL2}'>{}</response>",
        B64.encode(client_final)
    ))
    .await;
    (c.next_stanza(WAIT).await.expect("SASL2 outcome"), signature)
}

/// XEP-0388 "Discovering Support": offered after TLS beside SASL1, with the same
/// mechanisms and what may come inline; never before TLS.
#[tokio::test]
async fn sasl2_is_offered_beside_sasl1_after_tls_only() {
    let ts = TestServer::start(|_| {}).await;
    let mut c = Client::tcp(&ts).await;
    let before = c.open(&ts.domain).await.expect("stream");
    assert!(
        before.get_child("authentication", NS_SASL2).is_none(),
        "{before}"
    );
    let c = c.starttls(&ts).await;
    let features = c.features.clone().expect("features");
    let sasl1: Vec<String> = child(&features, "mechanisms", NS_SASL)
        .elements()
        .map(|m| m.text_content())
        .collect();
    let auth = child(&features, "authentication", NS_SASL2);
    let sasl2: Vec<String> = auth
        .elements()
        .filter(|m| m.name == "mechanism")
        .map(|m| m.text_content())
        .collect();
    assert_eq!(sasl1, sasl2);
    assert!(sasl2.contains(&"SCRAM-SHA-256".to_owned()), "{features}");
    let inline = child(auth, "inline", NS_SASL2);
    child(inline, "sm", NS_SM);
    let bind = child(child(inline, "bind", NS_BIND2), "inline", NS_BIND2);
    let vars: Vec<&str> = bind.elements().filter_map(|f| f.get_attr("var")).collect();
    assert_eq!(vars, [NS_SM, "urn:xmpp:carbons:2", "urn:xmpp:csi:0"]);
    ts.stop().await;
}

/// XEP-0388 "Success": SCRAM-SHA-256 in SASL2 framing; the server-final comes in
/// `<additional-data/>`, the identifier is the bare JID without a bind, and the stream goes
/// on without a restart: the client binds by iq on it.
#[tokio::test]
async fn scram_sha_256_succeeds_without_a_restart() {
    let ts = TestServer::start(|_| {}).await;
    ts.add_user("alice", "wonder land").await;
    let mut c = secured(&ts).await;
    let (success, signature) = scram_sha_256(&mut c, "alice", "wonder land", "").await;
    assert!(success.is("success", NS_SASL2), "{success}");
    let data = B64
        .decode(child(&success, "additional-data", NS_SASL2).text_content())
        .unwrap();
    assert_eq!(data, format!("v={}", B64.encode(signature)).into_bytes());
    assert_eq!(authzid(&success), ts.jid("alice"));
    // No stream header follows: the same stream carries the bind.
    let jid = c.bind("desk").await.expect("bind");
    assert_eq!(jid, format!("{}/desk", ts.jid("alice")));
    let pong = c
        .iq("get", None, Element::new("ping", "urn:xmpp:ping"))
        .await;
    assert_eq!(pong.get_attr("type"), Some("result"), "{pong}");
    ts.stop().await;
}

/// XEP-0388 "Failure": a wrong password is a `<failure/>` with the RFC 6120 §6.5
/// condition; the failures count towards the same back-off as SASL1's, which then refuses
/// even the right password from this address.
#[tokio::test]
async fn wrong_passwords_fail_and_lock_the_account_as_sasl1_does() {
    let ts = TestServer::start(|c| {
        c.limits.max_auth_failures = 10;
        c.limits.auth_backoff_failures = 2;
        c.limits.auth_backoff_window_ms = 60_000;
        c.limits.auth_backoff_base_ms = 10_000;
        c.limits.auth_backoff_max_ms = 20_000;
    })
    .await;
    ts.add_user("alice", "right").await;
    let mut c = secured(&ts).await;
    let (failure, _) = scram_sha_256(&mut c, "alice", "wrong", "").await;
    assert!(failure.is("failure", NS_SASL2), "{failure}");
    assert!(
        failure.get_child("not-authorized", NS_SASL).is_some(),
        "{failure}"
    );
    let failure = authenticate_plain(&mut c, "alice", "wrong", "").await;
    assert!(failure.is("failure", NS_SASL2), "{failure}");
    assert_eq!(condition(&failure), "not-authorized");
    // Two failures: locked, the right password refused the same way.
    let locked = authenticate_plain(&mut c, "alice", "right", "").await;
    assert!(locked.is("failure", NS_SASL2), "{locked}");
    assert_eq!(condition(&locked), "not-authorized");
    // SASL1 on another stream is locked too: one back-off for both framings.
    let mut c1 = secured(&ts).await;
    let answer = c1.auth_plain("alice", "right").await;
    assert!(answer.is("failure", NS_SASL), "{answer}");
    // An unknown mechanism is invalid-mechanism.
    c.send_raw(&format!(
        "<authenticate xmlns='{NS_SASL2}' mechanism='X-NONE'/>"
    ))
    .await;
    let failure = c.next_stanza(WAIT).await.expect("failure");
    assert!(
        failure.get_child("invalid-mechanism", NS_SASL).is_some(),
        "{failure}"
    );
    ts.stop().await;
}

/// XEP-0386: a bind inline: the resource starts with the tag, the identifier is the
/// full JID, `<bound/>` carries XEP-0198's `<enabled/>`; carbons (XEP-0280) and the
/// inactive state (XEP-0352) are in force from the first stanza.
#[tokio::test]
async fn bind2_enables_sm_carbons_and_csi_inline() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    ts.user("bob").await;
    ts.make_mutual("alice", "bob").await;
    let mut c = secured(&ts).await;
    let success = authenticate_plain(
        &mut c,
        "alice",
        "pw",
        &format!(
            "<bind xmlns='{NS_BIND2}'><tag>Phone</tag>\
             <enable xmlns='{NS_SM}' resume='true'/>\
             <enable xmlns='urn:xmpp:carbons:2'/>\
             <inactive xmlns='urn:xmpp:csi:0'/></bind>"
        ),
    )
    .await;
    assert!(success.is("success", NS_SASL2), "{success}");
    let jid = authzid(&success);
    assert!(
        jid.starts_with(&format!("{}/Phone.", ts.jid("alice"))),
        "{success}"
    );
    let bound = child(&success, "bound", NS_BIND2);
    let enabled = child(bound, "enabled", NS_SM);
    assert_eq!(enabled.get_attr("resume"), Some("true"), "{enabled}");
    assert!(enabled.get_attr("id").is_some(), "{enabled}");
    c.jid = jid.clone();
    // XEP-0388 "Initiation": the installation's id is kept with the session.
    let session = ts
        .shared()
        .sessions
        .get(&FullJid::new(&jid).unwrap())
        .expect("bound session");
    assert_eq!(
        session.read(|p| p.user_agent.clone()).as_deref(),
        Some(AGENT)
    );

    // XEP-0198: counting started with the stream going on (the client's own presence
    // comes back later: XEP-0352 holds it while inactive).
    c.presence(None, None).await;
    c.send_raw(&format!("<r xmlns='{NS_SM}'/>")).await;
    let a = c.expect(|e| e.name == "a" && e.ns == NS_SM).await;
    assert_eq!(a.get_attr("h"), Some("1"), "{a}");

    // XEP-0352: inactive, so bob's presence is held...
    let mut bob = ts.login("bob", "home").await;
    bob.presence(None, None).await;
    let bob_bare = ts.jid("bob");
    c.expect_none(
        |e| is_presence(e, &bob_bare, None),
        Duration::from_millis(500),
    )
    .await;
    // XEP-0280: ...while messages pass, carbons among them.
    let mut desk = ts.login("alice", "desk").await;
    desk.send_raw(&format!(
        "<message type='chat' to='{bob_bare}' id='m1'><body>hi</body></message>"
    ))
    .await;
    let carbon = c
        .expect(|e| e.name == "message" && e.get_child("sent", "urn:xmpp:carbons:2").is_some())
        .await;
    assert_eq!(carbon.get_attr("to"), Some(jid.as_str()), "{carbon}");
    // Active again: the held presence arrives.
    c.send_raw("<active xmlns='urn:xmpp:csi:0'/>").await;
    c.expect(|e| is_presence(e, &bob_bare, None)).await;
    ts.stop().await;
}

/// XEP-0198 §5 inline in XEP-0388: a new connection authenticates and resumes in one round
/// trip; the `<success/>` names the session's full JID and carries `<resumed/>`, and what
/// the client had not acknowledged comes again. A resumption that fails is a `<failed/>`
/// in the `<success/>`, and a bind in the same request still binds.
#[tokio::test]
async fn sm_resumes_inline_in_sasl2() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let mut c = secured(&ts).await;
    let bind = format!(
        "<bind xmlns='{NS_BIND2}'><tag>Phone</tag><enable xmlns='{NS_SM}' resume='true'/></bind>"
    );
    let success = authenticate_plain(&mut c, "alice", "pw", &bind).await;
    let jid = authzid(&success);
    let id = child(child(&success, "bound", NS_BIND2), "enabled", NS_SM)
        .get_attr("id")
        .expect("resume id")
        .to_owned();
    c.jid = jid.clone();
    let mut bob = ts.login("bob", "home").await;
    bob.send_raw(&format!(
        "<message type='chat' to='{jid}' id='m1'><body>while away</body></message>"
    ))
    .await;
    c.expect(|e| e.name == "message" && e.get_attr("id") == Some("m1"))
        .await;
    drop(c);
    until("detached", WAIT, || ts.shared().resumable.detached() == 1).await;

    let mut c = secured(&ts).await;
    let success = authenticate_plain(
        &mut c,
        "alice",
        "pw",
        &format!("<resume xmlns='{NS_SM}' previd='{id}' h='0'/>{bind}"),
    )
    .await;
    assert!(success.is("success", NS_SASL2), "{success}");
    assert_eq!(authzid(&success), jid);
    let resumed = child(&success, "resumed", NS_SM);
    assert_eq!(resumed.get_attr("previd"), Some(id.as_str()), "{resumed}");
    assert!(success.get_child("bound", NS_BIND2).is_none(), "{success}");
    let again = c
        .expect(|e| e.name == "message" && e.get_attr("id") == Some("m1"))
        .await;
    assert_eq!(again.ns, NS_CLIENT);
    c.send_raw(&format!("<a xmlns='{NS_SM}' h='1'/>")).await;
    c.close().await;

    // An unknown id: <failed/>, and the bind in the same request binds.
    let mut c = secured(&ts).await;
    let success = authenticate_plain(
        &mut c,
        "alice",
        "pw",
        &format!("<resume xmlns='{NS_SM}' previd='nope' h='0'/>{bind}"),
    )
    .await;
    assert!(success.is("success", NS_SASL2), "{success}");
    let failed = child(&success, "failed", NS_SM);
    assert!(
        failed
            .get_child("item-not-found", "urn:ietf:params:xml:ns:xmpp-stanzas")
            .is_some(),
        "{failed}"
    );
    child(&success, "bound", NS_BIND2);
    assert!(authzid(&success).starts_with(&format!("{}/Phone.", ts.jid("alice"))));
    bob.close().await;
    ts.stop().await;
}

/// XEP-0386 "Resource identifier generation": an installation (its `<user-agent id/>`)
/// gets the same resource on every login, which shows nothing of the id and differs for
/// another installation, account or tag. So a phone that lost its connection and logs in
/// again within the grace period takes its session's place and its contacts see no
/// unavailable; one that logs in while its old connection still stands replaces it
/// (`conflict`, RFC 6120 §7.7.2.2).
#[tokio::test]
async fn an_installation_keeps_its_resource_and_a_reconnect_within_grace_shows_no_flap() {
    let ts = TestServer::start(common::fast_liveness).await;
    let g = ts.config.liveness.grace;
    ts.user("alice").await;
    ts.user("bob").await;
    ts.make_mutual("alice", "bob").await;
    let bind = format!("<bind xmlns='{NS_BIND2}'><tag>Phone</tag></bind>");
    let login = |agent: &'static str, user: &'static str, bind: String| {
        let ts = &ts;
        async move {
            let mut c = secured(ts).await;
            let success = authenticate_plain_as(&mut c, agent, user, "pw", &bind).await;
            assert!(success.is("success", NS_SASL2), "{success}");
            c.jid = authzid(&success);
            c
        }
    };
    let mut phone = login(AGENT, "alice", bind.clone()).await;
    let jid = phone.jid.clone();
    assert!(
        jid.starts_with(&format!("{}/Phone.", ts.jid("alice"))),
        "{jid}"
    );
    assert!(!jid.contains(AGENT), "{jid}");
    phone.presence(None, None).await;
    let mut bob = ts.login("bob", "pc").await;
    bob.presence(None, None).await;
    bob.expect(|e| is_presence(e, &jid, None)).await;

    // Another installation, another account, another tag: other resources.
    let suffix = |j: &str| j.rsplit('.').next().unwrap().to_owned();
    let laptop = login("another-installation", "alice", bind.clone()).await;
    assert_ne!(laptop.jid, jid);
    let bobs = login(AGENT, "bob", bind.clone()).await;
    assert_ne!(suffix(&bobs.jid), suffix(&jid));
    let tagged = login(
        AGENT,
        "alice",
        format!("<bind xmlns='{NS_BIND2}'><tag>Other</tag></bind>"),
    )
    .await;
    assert_ne!(suffix(&tagged.jid), suffix(&jid));
    for c in [laptop, bobs, tagged] {
        c.close().await;
    }

    // The connection drops; once the server has seen it, the phone is back.
    let started = ts.metric(|m| m.grace_started.load(std::sync::atomic::Ordering::Relaxed));
    drop(phone);
    until("the drop seen", WAIT, || {
        ts.metric(|m| m.grace_started.load(std::sync::atomic::Ordering::Relaxed)) > started
    })
    .await;
    let mut phone = login(AGENT, "alice", bind.clone()).await;
    assert_eq!(phone.jid, jid, "the same resource again");
    phone.presence(None, None).await;
    // Nothing unavailable within G and a generous margin.
    bob.watch_none(
        |e| is_presence(e, &jid, Some("unavailable")),
        g + Duration::from_secs(1),
    )
    .await;

    // Logging in again while the old connection stands: the old one ends with conflict.
    let again = login(AGENT, "alice", bind).await;
    assert_eq!(again.jid, jid);
    match phone.expect_stream_end().await {
        Ended::StreamError(cond) => assert_eq!(cond, "conflict"),
        other => panic!("expected conflict, got {other:?}"),
    }
    again.close().await;
    bob.close().await;
    ts.stop().await;
}
