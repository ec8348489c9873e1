//! What stock clients expect beyond RFC 6121, against the real server, PostgreSQL and TLS:
//! XEP-0280 message carbons, XEP-0160 offline messages (with XEP-0203 delay stamps) and
//! XEP-0352 client state indication. The same features driven by slixmpp's own plugins
//! are in `slixmpp_plugins_*` at the end.

mod common;

use std::time::Duration;

use common::*;
use presenced::protocol::xml::{parse_element, Element, NS_CLIENT};

const NS_CARBONS: &str = "urn:xmpp:carbons:2";
const NS_FORWARD: &str = "urn:xmpp:forward:0";
const NS_DELAY: &str = "urn:xmpp:delay";
const NS_BLOCKING: &str = "urn:xmpp:blocking";
const NS_CHATSTATES: &str = "http://jabber.org/protocol/chatstates";

/// How long a negative expectation watches.
const QUIET: Duration = Duration::from_millis(400);

fn el(xml: &str) -> Element {
    parse_element(xml).unwrap_or_else(|| panic!("test XML parses: {xml}"))
}

/// Logs in and sends initial presence (with `priority` if given), waiting for the echo.
async fn online(ts: &TestServer, name: &str, res: &str, priority: Option<i8>) -> Client {
    let mut c = ts.login(name, res).await;
    send_presence(&mut c, priority).await;
    let me = format!("{}/{res}", ts.jid(name));
    c.expect(|e| is_presence(e, &me, None)).await;
    c
}

async fn send_presence(c: &mut Client, priority: Option<i8>) {
    let mut p = Element::new("presence", NS_CLIENT);
    if let Some(prio) = priority {
        p = p.child(Element::new("priority", NS_CLIENT).text(prio.to_string()));
    }
    c.send(&p).await;
}

/// A chat message to `to` with `body` and extra child XML.
fn chat(to: &str, body: &str, extra: &str) -> Element {
    el(&format!(
        "<message xmlns='jabber:client' type='chat' to='{to}'><body>{body}</body>{extra}</message>"
    ))
}

fn body_of(e: &Element) -> String {
    e.get_child("body", NS_CLIENT)
        .map(Element::text_content)
        .unwrap_or_default()
}

/// The message a carbon copy of `kind` (`sent` / `received`) carries, if `e` is one.
fn carbon<'a>(e: &'a Element, kind: &str) -> Option<&'a Element> {
    e.get_child(kind, NS_CARBONS)?
        .get_child("forwarded", NS_FORWARD)?
        .get_child("message", NS_CLIENT)
}

fn is_carbon(e: &Element) -> bool {
    e.name == "message"
        && (e.get_child("sent", NS_CARBONS).is_some()
            || e.get_child("received", NS_CARBONS).is_some())
}

fn is_body(e: &Element, body: &str) -> bool {
    e.name == "message" && body_of(e) == body
}

async fn carbons(c: &mut Client, on: bool) {
    let what = if on { "enable" } else { "disable" };
    let r = c.iq("set", None, Element::new(what, NS_CARBONS)).await;
    assert_eq!(r.get_attr("type"), Some("result"), "{what}: {r}");
}

// ---------------------------------------------------------------------------------------
// XEP-0280 message carbons

/// Mutual contacts alice (resources phone and pc) and bob (desk), all online.
async fn alice_twice_and_bob(ts: &TestServer) -> (Client, Client, Client) {
    for u in ["alice", "bob"] {
        ts.user(u).await;
    }
    ts.make_mutual("alice", "bob").await;
    let phone = online(ts, "alice", "phone", None).await;
    let pc = online(ts, "alice", "pc", None).await;
    let bob = online(ts, "bob", "desk", None).await;
    (phone, pc, bob)
}

/// XEP-0280 §11: only the user's own account sends carbons. A `<sent/>` or `<received/>`
/// wrapper from anyone else (here bob, to both of alice's resources, full and bare JID) is
/// removed before delivery, so no client can be fooled into showing bob's forgery as a
/// message alice sent or received; the rest of the message arrives.
#[tokio::test]
async fn carbons_wrappers_from_anyone_but_the_users_own_account_are_removed() {
    let ts = TestServer::start(|_| {}).await;
    let (mut phone, mut pc, mut bob) = alice_twice_and_bob(&ts).await;
    carbons(&mut pc, true).await;
    let alice = ts.jid("alice");
    let forged = |to: &str, body: &str| {
        el(&format!(
            "<message xmlns='jabber:client' to='{to}' type='chat'><body>{body}</body>\
             <received xmlns='{NS_CARBONS}'><forwarded xmlns='urn:xmpp:forward:0'>\
             <message xmlns='jabber:client' from='{alice}/phone' to='carol@{d}' type='chat'>\
             <body>I never wrote this</body></message></forwarded></received>\
             <sent xmlns='{NS_CARBONS}'><forwarded xmlns='urn:xmpp:forward:0'>\
             <message xmlns='jabber:client' from='{alice}/pc' to='carol@{d}' type='chat'>\
             <body>nor this</body></message></forwarded></sent></message>",
            d = ts.domain
        ))
    };
    bob.send(&forged(&format!("{alice}/phone"), "to the phone"))
        .await;
    bob.send(&forged(&alice, "to alice")).await;
    for (c, body) in [(&mut phone, "to the phone"), (&mut pc, "to alice")] {
        let got = c.expect(|e| is_body(e, body)).await;
        assert!(!is_carbon(&got), "the wrapper was removed: {got}");
    }
    ts.stop().await;
}

#[tokio::test]
async fn carbons_copy_received_and_sent_messages_to_enabled_resources_only() {
    let ts = TestServer::start(|_| {}).await;
    let (mut phone, mut pc, mut bob) = alice_twice_and_bob(&ts).await;
    let alice = ts.jid("alice");
    let bob_bare = ts.jid("bob");
    assert!(server_features(&ts, &mut pc)
        .await
        .iter()
        .any(|f| f == NS_CARBONS));
    carbons(&mut pc, true).await;
    // Enabling twice is answered with a result again (XEP-0280 §9.1).
    carbons(&mut pc, true).await;

    // Received (§6): bob writes to the phone; the pc gets a copy from alice's bare JID.
    let phone_jid = format!("{alice}/phone");
    bob.send(&chat(&phone_jid, "to the phone", "")).await;
    let orig = phone.expect(|e| is_body(e, "to the phone")).await;
    assert!(!is_carbon(&orig), "{orig}");
    let copy = pc.expect(is_carbon).await;
    assert_eq!(copy.get_attr("from"), Some(alice.as_str()), "{copy}");
    assert_eq!(copy.get_attr("to"), Some(format!("{alice}/pc").as_str()));
    assert_eq!(copy.get_attr("type"), Some("chat"));
    let inner = carbon(&copy, "received").expect("a received copy");
    assert_eq!(body_of(inner), "to the phone");
    assert_eq!(inner.get_attr("to"), Some(phone_jid.as_str()));
    assert_eq!(
        inner.get_attr("from"),
        Some(format!("{bob_bare}/desk").as_str())
    );

    // Sent (§7): the phone (carbons off) writes; the pc gets a sent copy, bob the original.
    phone.send(&chat(&bob_bare, "from the phone", "")).await;
    bob.expect(|e| is_body(e, "from the phone")).await;
    let copy = pc.expect(is_carbon).await;
    let inner = carbon(&copy, "sent").expect("a sent copy");
    assert_eq!(body_of(inner), "from the phone");
    assert_eq!(inner.get_attr("from"), Some(phone_jid.as_str()));

    // The pc writes; the phone has carbons off and sees nothing, the pc no copy of itself.
    pc.send(&chat(&bob_bare, "from the pc", "")).await;
    bob.expect(|e| is_body(e, "from the pc")).await;
    barrier(&ts, &mut pc).await;
    barrier(&ts, &mut phone).await;
    phone.expect_none(is_carbon, QUIET).await;
    pc.expect_none(is_carbon, Duration::ZERO).await;

    // A bare-JID message under RFC 6121 §8.5.2.1.1 reaches both (equal priority): no copy.
    bob.send(&chat(&alice, "to both", "")).await;
    phone.expect(|e| is_body(e, "to both")).await;
    pc.expect(|e| is_body(e, "to both")).await;
    // With the phone at a higher priority only it takes the original; the pc a copy.
    send_presence(&mut phone, Some(5)).await;
    pc.expect(|e| is_presence(e, &phone_jid, None)).await;
    bob.expect(|e| is_presence(e, &phone_jid, None)).await;
    bob.send(&chat(&alice, "to the best", "")).await;
    phone.expect(|e| is_body(e, "to the best")).await;
    let copy = pc.expect(is_carbon).await;
    assert_eq!(
        carbon(&copy, "received").map(body_of).as_deref(),
        Some("to the best")
    );
    pc.expect_none(|e| is_body(e, "to the best"), QUIET).await;

    // Disabled, the pc gets nothing more.
    carbons(&mut pc, false).await;
    bob.send(&chat(&phone_jid, "after disable", "")).await;
    phone.expect(|e| is_body(e, "after disable")).await;
    barrier(&ts, &mut pc).await;
    pc.expect_none(is_carbon, QUIET).await;
}

#[tokio::test]
async fn private_no_copy_and_bodyless_normal_messages_are_not_copied() {
    let ts = TestServer::start(|_| {}).await;
    let (mut phone, mut pc, mut bob) = alice_twice_and_bob(&ts).await;
    let alice = ts.jid("alice");
    let bob_bare = ts.jid("bob");
    carbons(&mut pc, true).await;
    carbons(&mut phone, true).await;
    let private = format!("<private xmlns='{NS_CARBONS}'/>");
    let no_copy = "<no-copy xmlns='urn:xmpp:hints'/>";

    // Sent with <private/> (§8): no copy, and the recipient gets it without <private/>.
    phone.send(&chat(&bob_bare, "secret out", &private)).await;
    let got = bob.expect(|e| is_body(e, "secret out")).await;
    assert!(got.get_child("private", NS_CARBONS).is_none(), "{got}");
    phone.send(&chat(&bob_bare, "hint out", no_copy)).await;
    bob.expect(|e| is_body(e, "hint out")).await;
    // Received with <private/> or <no-copy/>: only the addressed resource has it.
    let phone_jid = format!("{alice}/phone");
    bob.send(&chat(&phone_jid, "secret in", &private)).await;
    let got = phone.expect(|e| is_body(e, "secret in")).await;
    assert!(got.get_child("private", NS_CARBONS).is_none(), "{got}");
    bob.send(&chat(&phone_jid, "hint in", no_copy)).await;
    phone.expect(|e| is_body(e, "hint in")).await;
    // A normal message without a body (here a chat state) is not copied; with one it is.
    bob.send(&el(&format!(
        "<message xmlns='jabber:client' to='{phone_jid}'><active xmlns='{NS_CHATSTATES}'/></message>"
    )))
    .await;
    phone
        .expect(|e| e.get_child("active", NS_CHATSTATES).is_some())
        .await;
    // Something that is copied, so the pc's queue is known to be past everything above.
    bob.send(&chat(&phone_jid, "marker", "")).await;
    let copy = pc.expect(is_carbon).await;
    assert_eq!(
        carbon(&copy, "received").map(body_of).as_deref(),
        Some("marker"),
        "the first copy the pc sees is the one after the private, hinted and bodyless messages"
    );
    barrier(&ts, &mut bob).await;
    bob.expect_none(is_carbon, Duration::ZERO).await;
}

// ---------------------------------------------------------------------------------------
// XEP-0160 offline messages

#[tokio::test]
async fn a_message_to_an_offline_user_is_kept_and_delivered_with_a_delay_at_next_login() {
    let ts = TestServer::start(|_| {}).await;
    for u in ["alice", "bob"] {
        ts.user(u).await;
    }
    ts.make_mutual("alice", "bob").await;
    let alice = ts.jid("alice");
    let mut bob = online(&ts, "bob", "desk", None).await;
    let features = server_features(&ts, &mut bob).await;
    assert!(features.iter().any(|f| f == "msgoffline"), "{features:?}");

    let before = chrono::Utc::now() - chrono::Duration::seconds(1);
    bob.send(&chat(&alice, "while you were out", "")).await;
    // A full JID of a resource that is not there is the bare JID (RFC 6121 §8.5.3.2.1).
    bob.send(&el(&format!(
        "<message xmlns='jabber:client' to='{alice}/gone'><body>second</body></message>"
    )))
    .await;
    // Not kept: a chat state alone, groupchat (answered service-unavailable), headline.
    bob.send(&el(&format!(
        "<message xmlns='jabber:client' type='chat' to='{alice}'><composing xmlns='{NS_CHATSTATES}'/></message>"
    )))
    .await;
    let gc = el(&format!(
        "<message xmlns='jabber:client' type='groupchat' id='gc1' to='{alice}'><body>room</body></message>"
    ));
    bob.send(&gc).await;
    let err = bob
        .expect(|e| e.name == "message" && e.get_attr("id") == Some("gc1"))
        .await;
    assert_error(
        &err,
        "service-unavailable",
        "cancel",
        "groupchat to a bare JID",
    );
    bob.send(&el(&format!(
        "<message xmlns='jabber:client' type='headline' to='{alice}'><body>news</body></message>"
    )))
    .await;
    barrier(&ts, &mut bob).await;
    // Nothing kept was answered with an error.
    bob.expect_none(|e| e.get_attr("type") == Some("error"), QUIET)
        .await;
    assert_eq!(ts.offline_count(&alice).await, 2);

    // Binding alone delivers nothing; the initial presence does, oldest first, stamped.
    let mut a = ts.login("alice", "phone").await;
    barrier(&ts, &mut a).await;
    a.expect_none(|e| e.name == "message", Duration::ZERO).await;
    send_presence(&mut a, None).await;
    let first = a.expect(|e| e.name == "message").await;
    let second = a.expect(|e| e.name == "message").await;
    assert_eq!(body_of(&first), "while you were out");
    assert_eq!(body_of(&second), "second");
    assert_eq!(
        first.get_attr("from"),
        Some(format!("{}/desk", ts.jid("bob")).as_str())
    );
    for m in [&first, &second] {
        let delay = m.get_child("delay", NS_DELAY).expect("XEP-0203 delay");
        assert_eq!(delay.get_attr("from"), Some(ts.domain.as_str()), "{m}");
        let stamp = chrono::DateTime::parse_from_rfc3339(delay.get_attr("stamp").unwrap())
            .expect("XEP-0082 stamp");
        assert!(stamp >= before && stamp <= chrono::Utc::now(), "{m}");
    }
    barrier(&ts, &mut a).await;
    a.expect_none(|e| e.name == "message", Duration::ZERO).await;
    assert_eq!(ts.offline_count(&alice).await, 0);

    // Handed out once: a second resource coming online gets nothing more.
    let mut b = online(&ts, "alice", "pc", None).await;
    barrier(&ts, &mut b).await;
    b.expect_none(|e| e.name == "message", Duration::ZERO).await;
}

#[tokio::test]
async fn kept_messages_wait_for_a_resource_that_takes_messages() {
    let ts = TestServer::start(|_| {}).await;
    for u in ["alice", "bob"] {
        ts.user(u).await;
    }
    let alice = ts.jid("alice");
    let mut bob = online(&ts, "bob", "desk", None).await;
    // Alice's only resource has a negative priority: it takes no messages (RFC 6121
    // §8.5.2.1.1), so the message is kept and not handed to it.
    let mut a = online(&ts, "alice", "phone", Some(-1)).await;
    bob.send(&chat(&alice, "kept", "")).await;
    barrier(&ts, &mut bob).await;
    assert_eq!(ts.offline_count(&alice).await, 1);
    barrier(&ts, &mut a).await;
    a.expect_none(|e| e.name == "message", Duration::ZERO).await;
    // Raising the priority makes it one that does.
    send_presence(&mut a, Some(1)).await;
    let m = a.expect(|e| e.name == "message").await;
    assert_eq!(body_of(&m), "kept");
    assert!(m.get_child("delay", NS_DELAY).is_some(), "{m}");
    assert_eq!(ts.offline_count(&alice).await, 0);
}

/// A message that finds no resource is stored; initial presence marks the resource as
/// taking messages and then takes what is stored. When the store's insert commits after
/// that take, the message must still reach the now available resource, not wait for the
/// next login. The insert is held at a chosen point by a row lock on the recipient's
/// account (its foreign key check waits for it), which only PostgreSQL lets a test take.
#[tokio::test]
async fn a_message_stored_while_its_recipient_becomes_available_is_still_delivered() {
    let ts = TestServer::start(|_| {}).await;
    if ts.shared().store.sqlite_pool().is_some() {
        // SQLite has no row locks to hold the insert with.
        return;
    }
    let pool = ts.shared().store.pool().clone();
    for u in ["alice", "bob"] {
        ts.user(u).await;
    }
    let alice = ts.jid("alice");
    let mut bob = online(&ts, "bob", "desk", None).await;
    // Alice is bound but has sent no presence yet: she takes no messages.
    let mut a = ts.login("alice", "phone").await;

    let mut hold = pool.begin().await.expect("transaction");
    sqlx::query("SELECT 1 FROM accounts WHERE jid = $1 FOR UPDATE")
        .bind(&alice)
        .execute(&mut *hold)
        .await
        .expect("lock alice's account row");
    let holder: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *hold)
        .await
        .expect("backend pid");
    bob.send(&chat(&alice, "racing", "")).await;
    // The server found no resource and is storing: its insert waits for the row lock.
    until_a_backend_waits_on(&pool, holder).await;
    // Now alice becomes available; the barrier proves her presence, and the take of
    // stored messages that follows it, were handled (one task per session).
    send_presence(&mut a, None).await;
    let me = format!("{alice}/phone");
    a.expect(|e| is_presence(e, &me, None)).await;
    barrier(&ts, &mut a).await;
    hold.rollback().await.expect("release the lock");

    let m = a.expect(|e| e.name == "message").await;
    assert_eq!(body_of(&m), "racing");
    assert_eq!(ts.offline_count(&alice).await, 0);
}

#[tokio::test]
async fn a_full_offline_store_answers_service_unavailable_and_keeps_nothing_more() {
    let ts = TestServer::start(|c| c.limits.max_offline_messages = 2).await;
    for u in ["alice", "bob"] {
        ts.user(u).await;
    }
    // A contact who may see alice's presence is told; a stranger never is (tests/offline.rs).
    ts.make_mutual("alice", "bob").await;
    let alice = ts.jid("alice");
    let mut bob = online(&ts, "bob", "desk", None).await;
    for i in 0..3 {
        let m = el(&format!(
            "<message xmlns='jabber:client' type='chat' id='m{i}' to='{alice}'><body>n{i}</body></message>"
        ));
        bob.send(&m).await;
    }
    let err = bob
        .expect(|e| e.name == "message" && e.get_attr("type") == Some("error"))
        .await;
    assert_eq!(err.get_attr("id"), Some("m2"), "{err}");
    assert_error(
        &err,
        "service-unavailable",
        "cancel",
        "third message, quota 2",
    );
    barrier(&ts, &mut bob).await;
    bob.expect_none(|e| e.get_attr("type") == Some("error"), Duration::ZERO)
        .await;
    assert_eq!(ts.offline_count(&alice).await, 2);
    let mut a = online(&ts, "alice", "phone", None).await;
    for want in ["n0", "n1"] {
        let m = a.expect(|e| e.name == "message").await;
        assert_eq!(body_of(&m), want);
    }
}

#[tokio::test]
async fn messages_from_a_blocked_sender_are_never_kept_nor_handed_out() {
    let ts = TestServer::start(|_| {}).await;
    for u in ["alice", "bob", "mallory"] {
        ts.user(u).await;
    }
    let alice = ts.jid("alice");
    let mallory = ts.jid("mallory");
    // Alice blocks mallory, then goes offline.
    let mut a = online(&ts, "alice", "phone", None).await;
    let r = a
        .iq(
            "set",
            None,
            el(&format!(
                "<block xmlns='{NS_BLOCKING}'><item jid='{mallory}'/></block>"
            )),
        )
        .await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    a.close().await;
    let mut m = online(&ts, "mallory", "x", None).await;
    let mut bob = online(&ts, "bob", "desk", None).await;
    // Alice's session is gone once the registry no longer lists it.
    let shared = ts.shared().clone();
    let alice_bare = presenced::protocol::jid::BareJid::new(&alice).unwrap();
    for _ in 0..200 {
        if shared.sessions.of_user(&alice_bare).is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(shared.sessions.of_user(&alice_bare).is_empty());
    m.send(&chat(&alice, "from mallory", "")).await;
    barrier(&ts, &mut m).await;
    // XEP-0191 §3.3: dropped, no error that would tell mallory anything.
    m.expect_none(|e| e.name == "message", QUIET).await;
    assert_eq!(ts.offline_count(&alice).await, 0);

    // Kept before a block, not handed out after it.
    bob.send(&chat(&alice, "from bob", "")).await;
    barrier(&ts, &mut bob).await;
    assert_eq!(ts.offline_count(&alice).await, 1);
    // Alice binds (no presence yet, so nothing is handed out), blocks bob, then comes online.
    let mut a = ts.login("alice", "pc").await;
    let r = a
        .iq(
            "set",
            None,
            el(&format!(
                "<block xmlns='{NS_BLOCKING}'><item jid='{}'/></block>",
                ts.jid("bob")
            )),
        )
        .await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    send_presence(&mut a, None).await;
    a.expect(|e| is_presence(e, &format!("{alice}/pc"), None))
        .await;
    barrier(&ts, &mut a).await;
    a.expect_none(|e| e.name == "message", QUIET).await;
    assert_eq!(ts.offline_count(&alice).await, 0);
}

// ---------------------------------------------------------------------------------------
// XEP-0352 client state indication

const NS_CSI: &str = "urn:xmpp:csi:0";

/// alice (resource phone) with her mutual contacts bob (b) and carol (c), all online, once
/// alice has seen both and her backlog is empty.
async fn alice_with_bob_and_carol(ts: &TestServer) -> (Client, Client, Client) {
    ts.make_mutual("alice", "bob").await;
    ts.make_mutual("alice", "carol").await;
    let mut alice = online(ts, "alice", "phone", None).await;
    let bob = online(ts, "bob", "b", None).await;
    let carol = online(ts, "carol", "c", None).await;
    for (u, r) in [("bob", "b"), ("carol", "c")] {
        let jid = format!("{}/{r}", ts.jid(u));
        alice.expect(|e| is_presence(e, &jid, None)).await;
    }
    barrier(ts, &mut alice).await;
    alice.backlog.clear();
    (alice, bob, carol)
}

#[tokio::test]
async fn an_inactive_client_gets_only_the_latest_presence_per_contact_and_messages_at_once() {
    let ts = TestServer::start(|_| {}).await;
    for u in ["alice", "bob", "carol"] {
        ts.user(u).await;
    }
    let (mut alice, mut bob, mut carol) = alice_with_bob_and_carol(&ts).await;
    let features = alice.features.clone().expect("stream features after SASL");
    assert!(features.get_child("csi", NS_CSI).is_some(), "{features}");
    let bob_jid = format!("{}/b", ts.jid("bob"));
    let carol_jid = format!("{}/c", ts.jid("carol"));

    alice
        .send_raw(&format!("<inactive xmlns='{NS_CSI}'/>"))
        .await;
    show(&ts, &mut bob, "away").await;
    show(&ts, &mut carol, "dnd").await;
    show(&ts, &mut bob, "xa").await;
    // The ping's answer (an iq) passes; the presence queued before it is held.
    barrier(&ts, &mut alice).await;
    alice
        .expect_none(|e| e.name == "presence", Duration::ZERO)
        .await;

    // A message flushes what is held first, in the order of the latest updates (carol's,
    // then bob's second; his first is gone), then the message.
    carol.send(&chat(&ts.jid("alice"), "wake up", "")).await;
    let first = alice.next_stanza(WAIT).await.expect("held presence");
    let second = alice.next_stanza(WAIT).await.expect("held presence");
    let third = alice.next_stanza(WAIT).await.expect("the message");
    assert!(is_presence(&first, &carol_jid, None), "{first}");
    assert_eq!(show_of(&first).as_deref(), Some("dnd"));
    assert!(is_presence(&second, &bob_jid, None), "{second}");
    assert_eq!(
        show_of(&second).as_deref(),
        Some("xa"),
        "only the latest: {second}"
    );
    assert!(is_body(&third, "wake up"), "{third}");

    // Still inactive: held again until the client says it is active.
    show(&ts, &mut bob, "chat").await;
    barrier(&ts, &mut alice).await;
    alice
        .expect_none(|e| e.name == "presence", Duration::ZERO)
        .await;
    alice.send_raw(&format!("<active xmlns='{NS_CSI}'/>")).await;
    let p = alice.expect(|e| is_presence(e, &bob_jid, None)).await;
    assert_eq!(show_of(&p).as_deref(), Some("chat"));
    // Active again: presence comes as it happens.
    show(&ts, &mut carol, "away").await;
    let p = alice.expect(|e| is_presence(e, &carol_jid, None)).await;
    assert_eq!(show_of(&p).as_deref(), Some("away"));
}

#[tokio::test]
async fn an_inactive_client_holds_at_most_the_configured_number_of_presences() {
    let ts = TestServer::start(|c| c.limits.max_csi_held_presences = 2).await;
    let names = ["alice", "u0", "u1", "u2"];
    for u in names {
        ts.user(u).await;
    }
    for u in &names[1..] {
        ts.make_mutual("alice", u).await;
    }
    let mut alice = online(&ts, "alice", "phone", None).await;
    let mut others = Vec::new();
    for u in &names[1..] {
        let c = online(&ts, u, "r", None).await;
        alice
            .expect(|e| is_presence(e, &format!("{}/r", ts.jid(u)), None))
            .await;
        others.push(c);
    }
    barrier(&ts, &mut alice).await;
    alice.backlog.clear();
    alice
        .send_raw(&format!("<inactive xmlns='{NS_CSI}'/>"))
        .await;
    for c in others.iter_mut().take(2) {
        show(&ts, c, "away").await;
    }
    barrier(&ts, &mut alice).await;
    alice
        .expect_none(|e| e.name == "presence", Duration::ZERO)
        .await;
    // The third contact's change is one more than the limit: all three are written.
    show(&ts, &mut others[2], "away").await;
    for u in &names[1..] {
        let p = alice
            .expect(|e| is_presence(e, &format!("{}/r", ts.jid(u)), None))
            .await;
        assert_eq!(show_of(&p).as_deref(), Some("away"), "{p}");
    }
}

const NS_INTEREST: &str = "urn:presenced:interest:0";

fn interest(jids: &[String]) -> Element {
    let items: String = jids.iter().map(|j| format!("<item jid='{j}'/>")).collect();
    el(&format!(
        "<interest xmlns='{NS_INTEREST}'>{items}</interest>"
    ))
}

#[tokio::test]
async fn an_interest_list_lets_named_contacts_presence_through_while_inactive() {
    let ts = TestServer::start(|c| c.limits.max_interest_items = 2).await;
    for u in ["alice", "bob", "carol"] {
        ts.user(u).await;
    }
    let (mut alice, mut bob, mut carol) = alice_with_bob_and_carol(&ts).await;
    assert!(server_features(&ts, &mut alice)
        .await
        .iter()
        .any(|f| f == NS_INTEREST));
    let bob_jid = format!("{}/b", ts.jid("bob"));
    let carol_jid = format!("{}/c", ts.jid("carol"));

    // Errors: too many items, a full JID, a malformed JID, a get.
    let three = [ts.jid("bob"), ts.jid("carol"), ts.jid("dave")];
    let r = alice.iq("set", None, interest(&three)).await;
    assert_error(&r, "not-acceptable", "modify", "three items, limit two");
    let r = alice
        .iq("set", None, interest(std::slice::from_ref(&bob_jid)))
        .await;
    assert_error(&r, "bad-request", "modify", "a full JID");
    let r = alice.iq("set", None, interest(&["@@".to_owned()])).await;
    assert_error(&r, "jid-malformed", "modify", "a malformed JID");
    let r = alice.iq("get", None, interest(&[])).await;
    assert_error(&r, "bad-request", "modify", "a get");

    // Inactive, interested in bob: his change comes at once, carol's is held.
    let r = alice.iq("set", None, interest(&[ts.jid("bob")])).await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    alice
        .send_raw(&format!("<inactive xmlns='{NS_CSI}'/>"))
        .await;
    show(&ts, &mut carol, "dnd").await;
    show(&ts, &mut bob, "away").await;
    let p = alice.expect(|e| e.name == "presence").await;
    assert!(
        is_presence(&p, &bob_jid, None),
        "bob's, not carol's held one: {p}"
    );
    assert_eq!(show_of(&p).as_deref(), Some("away"));
    barrier(&ts, &mut alice).await;
    alice
        .expect_none(|e| e.name == "presence", Duration::ZERO)
        .await;

    // An empty list clears it: bob's next change is held too, and both come on <active/>.
    let r = alice.iq("set", None, interest(&[])).await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    show(&ts, &mut bob, "xa").await;
    barrier(&ts, &mut alice).await;
    alice
        .expect_none(|e| e.name == "presence", Duration::ZERO)
        .await;
    alice.send_raw(&format!("<active xmlns='{NS_CSI}'/>")).await;
    let p = alice.expect(|e| e.name == "presence").await;
    assert!(is_presence(&p, &carol_jid, None), "{p}");
    let p = alice.expect(|e| e.name == "presence").await;
    assert!(is_presence(&p, &bob_jid, None), "{p}");
    assert_eq!(show_of(&p).as_deref(), Some("xa"));
}

// ---------------------------------------------------------------------------------------
// The same features driven by slixmpp's own plugins (xep_0280, xep_0352, xep_0203).

#[tokio::test]
async fn slixmpp_plugins_see_carbons_csi_and_offline_delay() {
    let ts = TestServer::start(|_| {}).await;
    for u in ["alice", "bob", "carol"] {
        ts.user(u).await;
    }
    ts.make_mutual("alice", "bob").await;
    let args = client_script_args(&ts, &["alice", "bob", "carol", "pw"]);
    let out = run_client_script("extensions.py", &args, Duration::from_secs(60)).await;
    assert_eq!(out.code, Some(0), "extensions.py failed: {out:?}");
    let alice = ts.jid("alice");
    let expect = [
        ("carbons_advertised", "true".to_owned()),
        ("msgoffline_advertised", "true".to_owned()),
        ("phone_got", "to the phone".to_owned()),
        ("received_body", "to the phone".to_owned()),
        ("received_to", format!("{alice}/phone")),
        ("sent_body", "from the phone".to_owned()),
        ("sent_from", format!("{alice}/phone")),
        ("csi_offered", "true".to_owned()),
        // Without XEP-0352 the phone would have seen "away,xa".
        ("csi_shows_before_message", "xa".to_owned()),
        ("csi_message", "wake up".to_owned()),
        ("offline_body", "while you were out".to_owned()),
        ("offline_delay_from", ts.domain.clone()),
        ("offline_delay_stamped", "true".to_owned()),
    ];
    for (key, want) in expect {
        assert_eq!(
            out.get(key).as_deref(),
            Some(want.as_str()),
            "{key}: {out:?}"
        );
    }
}
