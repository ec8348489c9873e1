//! XEP-0198 stream management against the real server: the stream feature, `<enable/>`
//! and `<failed/>`, acks both ways, resumption after a dead connection (with a contact
//! watching for a presence flap), the end of the resumption window (unacknowledged
//! messages kept offline, iq answered with an error), refused resumptions (wrong id,
//! another account's id, another node of the cluster), the bounded queue, and slixmpp's
//! own xep_0198 plugin doing all of it as a stock client does.

mod common;

use std::time::Duration;

use common::*;
use presenced::config::Config;
use presenced::protocol::jid::FullJid;
use presenced::protocol::xml::{parse_element, Element, NS_CLIENT};
use tokio::time::Instant;

const NS_SM: &str = "urn:xmpp:sm:3";

fn el(s: &str) -> Element {
    parse_element(s).expect("test XML")
}

fn is_sm(e: &Element, name: &str) -> bool {
    e.ns == NS_SM && e.name == name
}

/// The stanza error condition inside a `<failed/>`.
fn failed_condition(e: &Element) -> String {
    e.elements()
        .next()
        .map(|c| c.name.clone())
        .unwrap_or_default()
}

/// Sends `<enable/>` and returns the `<enabled/>` answer.
async fn enable(c: &mut Client, resume: bool) -> Element {
    let resume = if resume { " resume='true'" } else { "" };
    c.send_raw(&format!("<enable xmlns='{NS_SM}'{resume}/>"))
        .await;
    c.expect(|e| is_sm(e, "enabled") || is_sm(e, "failed"))
        .await
}

/// Logs `name` in as `res`, enables resumable stream management, sends initial presence
/// and returns the client with its resume id.
async fn resumable_online(ts: &TestServer, name: &str, res: &str) -> (Client, String) {
    let mut c = ts.login(name, res).await;
    let enabled = enable(&mut c, true).await;
    assert!(is_sm(&enabled, "enabled"), "{enabled}");
    assert_eq!(enabled.get_attr("resume"), Some("true"), "{enabled}");
    let id = enabled.get_attr("id").expect("resume id").to_owned();
    c.presence(None, None).await;
    let me = c.jid.clone();
    c.expect(|e| is_presence(e, &me, None)).await;
    (c, id)
}

/// Sends `<resume/>` for `id` with the client's count `h` and returns the answer.
async fn resume(c: &mut Client, id: &str, h: u32) -> Element {
    c.send_raw(&format!("<resume xmlns='{NS_SM}' previd='{id}' h='{h}'/>"))
        .await;
    c.expect(|e| is_sm(e, "resumed") || is_sm(e, "failed"))
        .await
}

async fn online(ts: &TestServer, name: &str, res: &str) -> Client {
    let mut c = ts.login(name, res).await;
    c.presence(None, None).await;
    let me = c.jid.clone();
    c.expect(|e| is_presence(e, &me, None)).await;
    c
}

/// Waits (bounded) until `owner` has `n` offline messages.
async fn offline_reaches(ts: &TestServer, owner: &str, n: i64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = ts.offline_count(owner).await;
        if got == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{owner}: {got} offline messages, not {n}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn with_window(window: Duration) -> impl FnOnce(&mut Config) {
    move |c: &mut Config| {
        fast_liveness(c);
        c.limits.sm_resume_timeout = window;
    }
}

// ---------------------------------------------------------------------------------------
// Enabling and acks

#[tokio::test]
async fn enable_is_refused_before_bind_and_both_sides_count_after_it() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    let mut c = Client::authenticated(&ts, "alice").await;
    let features = c.features.clone().expect("features");
    assert!(
        features.get_child("sm", NS_SM).is_some(),
        "sm offered after authentication: {features}"
    );
    // XEP-0198 §3: not before a resource is bound.
    let early = enable(&mut c, true).await;
    assert_eq!(failed_condition(&early), "unexpected-request", "{early}");
    c.bind("r1").await.expect("bind after a refused enable");
    // <r/> before <enable/>: nothing is counted yet.
    c.send_raw(&format!("<r xmlns='{NS_SM}'/>")).await;
    let f = c.expect(|e| is_sm(e, "failed")).await;
    assert_eq!(failed_condition(&f), "unexpected-request", "{f}");

    let on = enable(&mut c, false).await;
    assert!(is_sm(&on, "enabled"), "{on}");
    assert_eq!(on.get_attr("id"), None, "no id without resumption: {on}");
    let twice = enable(&mut c, false).await;
    assert_eq!(failed_condition(&twice), "unexpected-request", "{twice}");

    // The server's count of the client's stanzas (§4): nonzas are not counted.
    c.send_raw(&format!("<r xmlns='{NS_SM}'/>")).await;
    let a = c.expect(|e| is_sm(e, "a")).await;
    assert_eq!(a.get_attr("h"), Some("0"), "{a}");
    barrier(&ts, &mut c).await;
    barrier(&ts, &mut c).await;
    c.send_raw(&format!("<r xmlns='{NS_SM}'/>")).await;
    let a = c.expect(|e| is_sm(e, "a")).await;
    assert_eq!(a.get_attr("h"), Some("2"), "{a}");

    // The server asks for the client's count after writing stanzas it keeps.
    let r = c.expect(|e| is_sm(e, "r")).await;
    assert!(is_sm(&r, "r"));
    // Two results were written since <enabled/>: h=2 is right; after a third, h=4 is
    // beyond the count (§4).
    acked(&ts, &mut c, 2).await;
    too_high(&mut c, 4).await;
}

/// A client may start its count when it sends `<enable/>` (earlier versions of the XEP,
/// and @xmpp/client in effect, which resets its count only after `<enabled/>` has been
/// handled): the stanzas the server wrote between the bind and `<enabled/>` then count
/// in its `h` and not in the server's. Such a count keeps the stream, as does the lower
/// count the client goes on with after its late reset; a count beyond those crossing
/// stanzas is still the §4 stream error.
#[tokio::test]
async fn a_count_that_includes_the_stanzas_crossing_enable_keeps_the_stream() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    let mut c = ts.login("alice", "r").await;
    // The ping's result is written before <enabled/>: both were asked in one write, and
    // the session answers in order.
    c.send_raw(&format!(
        "<iq type='get' id='crossing' to='{}'><ping xmlns='urn:xmpp:ping'/></iq>\
         <enable xmlns='{NS_SM}'/>",
        ts.domain
    ))
    .await;
    let first = c
        .expect(|e| e.get_attr("id") == Some("crossing") || is_sm(e, "enabled"))
        .await;
    assert_eq!(first.get_attr("id"), Some("crossing"), "{first}");
    let on = c.expect(|e| is_sm(e, "enabled")).await;
    assert!(is_sm(&on, "enabled"), "{on}");
    // Counted from <enable/>, the client has handled one stanza; the server wrote none
    // after <enabled/>.
    acked(&ts, &mut c, 1).await;
    // The late reset: the client counts from zero again, below the server's count.
    acked(&ts, &mut c, 0).await;
    // From here the client's numbering is the server's: two results written, and an h
    // one beyond them is refused as §4 says.
    too_high(&mut c, 4).await;
}

/// Acknowledges `h` stanzas and checks, with a ping, that the stream goes on.
async fn acked(ts: &TestServer, c: &mut Client, h: u32) {
    c.send_raw(&format!("<a xmlns='{NS_SM}' h='{h}'/>")).await;
    barrier(ts, c).await;
}

/// Acknowledges `h` stanzas, more than were sent: §4's stream error.
async fn too_high(c: &mut Client, h: u32) {
    ends_with(
        c,
        &format!("<a xmlns='{NS_SM}' h='{h}'/>"),
        "undefined-condition",
    )
    .await;
}

/// Sends `xml` and expects the stream to end with the stream error `condition`.
async fn ends_with(c: &mut Client, xml: &str, condition: &str) {
    c.send_raw(xml).await;
    match c.expect_stream_end().await {
        Ended::StreamError(cond) => assert_eq!(cond, condition, "after {xml}"),
        other => panic!("{xml} ends the stream with {condition}: {other:?}"),
    }
}

#[tokio::test]
async fn a_malformed_count_is_a_bad_format_stream_error() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    let mut c = ts.login("alice", "r").await;
    assert!(is_sm(&enable(&mut c, false).await, "enabled"));
    ends_with(
        &mut c,
        &format!("<a xmlns='{NS_SM}' h='-3'/>"),
        "bad-format",
    )
    .await;
}

// ---------------------------------------------------------------------------------------
// Resumption

#[tokio::test]
async fn a_killed_connection_resumes_with_the_unacked_messages_and_no_presence_flap() {
    let ts = TestServer::start(with_window(Duration::from_secs(30))).await;
    ts.user("alice").await;
    ts.user("bob").await;
    ts.make_mutual("alice", "bob").await;
    let mut bob = online(&ts, "bob", "desk").await;
    let (mut alice, id) = resumable_online(&ts, "alice", "phone").await;
    let alice_jid = alice.jid.clone();
    bob.watch(&|e| is_presence(e, &alice_jid, None), WAIT)
        .await
        .expect("bob sees alice online");
    let full = FullJid::new(&alice_jid).unwrap();
    let session_id = ts.shared().sessions.get(&full).expect("bound").id;
    let deaths = ts.metric(|m| m.silent_deaths.load(std::sync::atomic::Ordering::Relaxed));
    let graces = ts.metric(|m| m.grace_started.load(std::sync::atomic::Ordering::Relaxed));

    bob.send(&chat(&alice_jid, "before the tunnel")).await;
    alice.expect(|e| has_body(e, "before the tunnel")).await;
    // The connection dies without a closing tag and nothing is acknowledged.
    drop(alice);
    detached(&ts, 1).await;
    bob.send(&chat(&alice_jid, "in the tunnel")).await;
    barrier(&ts, &mut bob).await;
    // Longer than the liveness TTL (2 s here): a detached session keeps beating, so no
    // sweeper announces it. Bob answers pings meanwhile, as a live client does.
    bob.watch_none(
        |e| is_presence(e, &alice_jid, Some("unavailable")),
        Duration::from_secs(3),
    )
    .await;

    let mut again = Client::authenticated(&ts, "alice").await;
    let resumed = resume(&mut again, &id, 0).await;
    assert!(is_sm(&resumed, "resumed"), "{resumed}");
    assert_eq!(resumed.get_attr("previd"), Some(id.as_str()));
    // Alice's one stanza after <enable/> was her initial presence.
    assert_eq!(resumed.get_attr("h"), Some("1"), "{resumed}");
    again.jid = alice_jid.clone();
    // h=0: everything since <enabled/> comes again, in order, the queued message last.
    let first = again.expect(|e| has_body(e, "before the tunnel")).await;
    assert!(has_body(&first, "before the tunnel"));
    again.expect(|e| has_body(e, "in the tunnel")).await;
    assert_eq!(ts.shared().resumable.detached(), 0);
    assert_eq!(
        ts.shared().sessions.get(&full).map(|s| s.id),
        Some(session_id),
        "the same session goes on"
    );

    // Positive control, then the negative check over everything bob received meanwhile.
    again
        .send(&chat(&bob.jid.clone(), "out of the tunnel"))
        .await;
    bob.watch(&|e| has_body(e, "out of the tunnel"), WAIT)
        .await
        .expect("bob hears from the resumed session");
    assert!(
        !bob.backlog
            .iter()
            .any(|e| is_presence(e, &alice_jid, Some("unavailable"))),
        "no unavailable reached bob: {:?}",
        bob.backlog
    );
    let deaths_after = ts.metric(|m| m.silent_deaths.load(std::sync::atomic::Ordering::Relaxed));
    let graces_after = ts.metric(|m| m.grace_started.load(std::sync::atomic::Ordering::Relaxed));
    assert_eq!(
        (deaths_after, graces_after),
        (deaths, graces),
        "no session end"
    );
}

/// A detached session is still online for its contacts, but no client is there: the
/// operators' session list, `stats` and the status page mark it as detached, and stop
/// once it is resumed.
#[tokio::test]
async fn a_detached_session_is_marked_as_such_for_operators_until_it_is_resumed() {
    let ts = TestServer::start(with_window(Duration::from_secs(30))).await;
    ts.user("alice").await;
    let (alice, id) = resumable_online(&ts, "alice", "phone").await;
    let full = FullJid::new(&alice.jid).unwrap();
    let marked = |ts: &TestServer| {
        ts.shared()
            .sessions
            .get(&full)
            .is_some_and(|s| s.is_detached())
    };
    assert!(!marked(&ts), "attached");
    let online = |json: &str| -> serde_json::Value {
        serde_json::from_str::<serde_json::Value>(json.split("\r\n\r\n").nth(1).unwrap()).unwrap()
            ["online"]
            .clone()
    };
    assert_eq!(online(&ts.admin_get("/status.json").await)["detached"], 0);
    drop(alice);
    detached(&ts, 1).await;
    assert!(marked(&ts), "the session list marks it detached");
    let now = online(&ts.admin_get("/status.json").await);
    assert_eq!(
        (now["tcp"].clone(), now["detached"].clone()),
        (1.into(), 1.into()),
        "{now}"
    );
    let mut again = Client::authenticated(&ts, "alice").await;
    let resumed = resume(&mut again, &id, 0).await;
    assert!(is_sm(&resumed, "resumed"), "{resumed}");
    detached(&ts, 0).await;
    assert!(!marked(&ts), "resumed: attached again");
    assert_eq!(online(&ts.admin_get("/status.json").await)["detached"], 0);
    ts.stop().await;
}

#[tokio::test]
async fn a_resume_while_the_old_connection_looks_alive_takes_it_over() {
    let ts = TestServer::start(with_window(Duration::from_secs(30))).await;
    ts.user("alice").await;
    ts.user("bob").await;
    ts.make_mutual("alice", "bob").await;
    let mut bob = online(&ts, "bob", "desk").await;
    let (mut old, id) = resumable_online(&ts, "alice", "phone").await;
    let alice_jid = old.jid.clone();
    bob.send(&chat(&alice_jid, "one")).await;
    old.expect(|e| has_body(e, "one")).await;
    barrier(&ts, &mut old).await;
    // Count what the old stream received after <enabled/>: alice acknowledges all of it.
    // Her own presence, "one" and the barrier's result were taken from the stream by the
    // waits above; everything else is in the backlog.
    let mut h = 3u32;
    for e in &old.backlog {
        if matches!(e.name.as_str(), "message" | "presence" | "iq") && e.ns == NS_CLIENT {
            h += 1;
        }
    }
    let mut new = Client::authenticated(&ts, "alice").await;
    let resumed = resume(&mut new, &id, h).await;
    assert!(is_sm(&resumed, "resumed"), "{resumed}");
    // The old stream is dropped by the server.
    assert!(
        !matches!(old.expect_stream_end().await, Ended::Timeout),
        "the old connection is closed"
    );
    // Acknowledged stanzas are not sent again; new traffic flows on the new stream.
    new.jid = alice_jid.clone();
    bob.send(&chat(&alice_jid, "two")).await;
    let next = new.expect(|e| e.name == "message").await;
    assert!(has_body(&next, "two"), "only the new message: {next}");
}

#[tokio::test]
async fn an_expired_window_stores_the_unacked_message_offline_and_answers_the_iq() {
    let ts = TestServer::start(with_window(Duration::from_secs(1))).await;
    ts.user("alice").await;
    ts.user("bob").await;
    ts.make_mutual("alice", "bob").await;
    let mut bob = online(&ts, "bob", "desk").await;
    let (mut alice, id) = resumable_online(&ts, "alice", "phone").await;
    let alice_jid = alice.jid.clone();
    let alice_bare = ts.jid("alice");
    bob.watch(&|e| is_presence(e, &alice_jid, None), WAIT)
        .await
        .expect("bob sees alice online");
    bob.send(&chat(&alice_jid, "keep me")).await;
    alice.expect(|e| has_body(e, "keep me")).await;
    bob.send(&el(&format!(
        "<iq type='get' id='v1' to='{alice_jid}'><query xmlns='jabber:iq:version'/></iq>"
    )))
    .await;
    alice
        .expect(|e| e.name == "iq" && e.get_attr("id") == Some("v1"))
        .await;
    assert_eq!(ts.offline_count(&alice_bare).await, 0);
    drop(alice);
    detached(&ts, 1).await;

    // The window (1 s) ends: the request is answered for the resource that went away
    // (RFC 6120 §10.5.3.2 / §8.3.3.19), the message is kept (RFC 6121 §8.5.2.2.1,
    // XEP-0160), and contacts hear the normal unavailable (after the grace period).
    let err = bob
        .watch(&|e| e.name == "iq" && e.get_attr("id") == Some("v1"), WAIT)
        .await
        .expect("bob's request is answered");
    assert_eq!(err.get_attr("type"), Some("error"), "{err}");
    assert_eq!(stanza_error(&err), "service-unavailable", "{err}");
    offline_reaches(&ts, &alice_bare, 1).await;
    bob.watch(&|e| is_presence(e, &alice_jid, Some("unavailable")), WAIT)
        .await
        .expect("alice's session ends as a disconnect does");
    assert_eq!(ts.shared().resumable.detached(), 0);

    // Too late to resume: the client binds again on the same stream and gets the message.
    let mut back = Client::authenticated(&ts, "alice").await;
    let f = resume(&mut back, &id, 0).await;
    assert_eq!(failed_condition(&f), "item-not-found", "{f}");
    back.bind("phone")
        .await
        .expect("bind after a failed resume");
    back.presence(None, None).await;
    let kept = back.expect(|e| has_body(e, "keep me")).await;
    let delay = kept
        .get_child("delay", "urn:xmpp:delay")
        .expect("stamped when stored");
    assert_eq!(delay.get_attr("from"), Some(ts.domain.as_str()));
    offline_reaches(&ts, &alice_bare, 0).await;
}

#[tokio::test]
async fn an_offline_message_handed_out_and_not_acked_goes_back_to_storage() {
    let ts = TestServer::start(with_window(Duration::from_secs(1))).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let alice_bare = ts.jid("alice");
    let mut bob = online(&ts, "bob", "desk").await;
    bob.send(&chat(&alice_bare, "while you were out")).await;
    offline_reaches(&ts, &alice_bare, 1).await;
    // Handed out at initial presence to a resumable session that dies unacknowledged.
    let (mut alice, _id) = resumable_online(&ts, "alice", "phone").await;
    let first = alice.expect(|e| has_body(e, "while you were out")).await;
    let stamp = first
        .get_child("delay", "urn:xmpp:delay")
        .and_then(|d| d.get_attr("stamp"))
        .expect("stamp")
        .to_owned();
    assert_eq!(ts.offline_count(&alice_bare).await, 0, "handed out");
    drop(alice);
    offline_reaches(&ts, &alice_bare, 1).await;
    // Next login: the same message, with its first stamp and only that one.
    let mut again = online(&ts, "alice", "pc").await;
    let m = again.expect(|e| has_body(e, "while you were out")).await;
    let stamps: Vec<_> = m
        .elements()
        .filter(|c| c.is("delay", "urn:xmpp:delay"))
        .map(|d| d.get_attr("stamp").unwrap_or_default().to_owned())
        .collect();
    assert_eq!(stamps, [stamp]);
}

#[tokio::test]
async fn a_wrong_or_foreign_resume_id_fails_and_the_stream_can_still_bind() {
    let ts = TestServer::start(with_window(Duration::from_secs(30))).await;
    for u in ["alice", "mallory"] {
        ts.user(u).await;
    }
    let (mut alice, id) = resumable_online(&ts, "alice", "phone").await;
    assert_eq!(id.len(), 32, "128 random bits: {id}");

    // Another account holding alice's id learns nothing and resumes nothing.
    let mut mallory = Client::authenticated(&ts, "mallory").await;
    let f = resume(&mut mallory, &id, 0).await;
    assert_eq!(failed_condition(&f), "item-not-found", "{f}");
    mallory
        .bind("laptop")
        .await
        .expect("bind after a failed resume");

    // An id nobody was given.
    let mut guess = Client::authenticated(&ts, "alice").await;
    let f = resume(&mut guess, "00000000000000000000000000000000", 0).await;
    assert_eq!(failed_condition(&f), "item-not-found", "{f}");
    // The right id with a count beyond what was sent.
    let f = resume(&mut guess, &id, 1000).await;
    assert_eq!(failed_condition(&f), "undefined-condition", "{f}");
    guess.bind("other").await.expect("bind");
    // A bound stream resumes nothing.
    let f = resume(&mut guess, &id, 0).await;
    assert_eq!(failed_condition(&f), "unexpected-request", "{f}");
    // Alice's session was never touched.
    barrier(&ts, &mut alice).await;
}

#[tokio::test]
async fn a_resume_on_another_node_of_the_cluster_fails_so_the_client_rebinds() {
    let domain = format!("c{}.example", unique());
    let node = |name: &'static str| {
        TestServer::start_with_domain(&domain, move |c| {
            with_window(Duration::from_secs(30))(c);
            c.cluster.node_id = Some(format!("{name}-{}", unique()));
        })
    };
    let n1 = node("n1").await;
    let n2 = node("n2").await;
    let deadline = Instant::now() + WAIT;
    for n in [&n1, &n2] {
        while n.shared().cluster.peers().is_empty() {
            assert!(Instant::now() < deadline, "nodes did not see each other");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    n1.user("alice").await;
    let (alice, id) = resumable_online(&n1, "alice", "phone").await;
    drop(alice);
    detached(&n1, 1).await;
    let mut elsewhere = Client::authenticated(&n2, "alice").await;
    let f = resume(&mut elsewhere, &id, 0).await;
    assert_eq!(failed_condition(&f), "item-not-found", "{f}");
    elsewhere
        .bind("phone")
        .await
        .expect("rebind on the other node");
    // The new binding of the same resource ends the detached one on the first node.
    detached(&n1, 0).await;
}

// ---------------------------------------------------------------------------------------
// The bound

#[tokio::test]
async fn more_unacked_stanzas_than_the_bound_close_the_stream_and_nothing_is_lost() {
    let ts = TestServer::start(|c| c.limits.sm_max_unacked = 5).await;
    ts.user("alice").await;
    ts.user("bob").await;
    // A contact: more messages than a stranger's offline share are kept.
    ts.make_mutual("alice", "bob").await;
    let alice_bare = ts.jid("alice");
    let mut bob = online(&ts, "bob", "desk").await;
    // Bound, not available: messages to the full JID reach it, none to the bare JID.
    let mut alice = ts.login("alice", "phone").await;
    assert!(is_sm(&enable(&mut alice, false).await, "enabled"));
    let alice_jid = alice.jid.clone();
    for i in 0..10 {
        bob.send(&chat(&alice_jid, &format!("m{i}"))).await;
    }
    match alice.expect_stream_end().await {
        Ended::StreamError(cond) => assert_eq!(cond, "resource-constraint"),
        other => panic!("the sixth unacknowledged stanza ends the stream: {other:?}"),
    }
    // Every message the client never acknowledged is kept for the next login (those
    // the session had and those that arrived after it ended; their order across the
    // end is not promised).
    offline_reaches(&ts, &alice_bare, 10).await;
    let mut again = online(&ts, "alice", "pc").await;
    let mut bodies = Vec::new();
    for _ in 0..10 {
        let m = again.expect(|e| e.name == "message").await;
        bodies.push(
            m.get_child("body", NS_CLIENT)
                .map(|b| b.text_content())
                .unwrap_or_default(),
        );
    }
    bodies.sort();
    let want: Vec<String> = (0..10).map(|i| format!("m{i}")).collect();
    assert_eq!(bodies, want);
}

// ---------------------------------------------------------------------------------------
// slixmpp's xep_0198 plugin

#[tokio::test]
async fn slixmpp_acks_and_resumes_after_a_dropped_connection() {
    let ts = TestServer::start(with_window(Duration::from_secs(30))).await;
    for u in ["alice", "bob"] {
        ts.user(u).await;
    }
    ts.make_mutual("alice", "bob").await;
    let args = client_script_args(&ts, &["alice", "bob", "pw"]);
    let out = run_client_script("stream_management.py", &args, Duration::from_secs(60)).await;
    assert_eq!(out.code, Some(0), "stream_management.py failed: {out:?}");
    let expect = [
        ("sm_enabled", "true"),
        ("resumable", "true"),
        // The server acknowledged all seven messages alice sent.
        ("acked", "7"),
        ("bob_got", "7"),
        ("resumed", "true"),
        ("got_while_away", "while you were away"),
        ("bob_got_back", "back"),
        ("bob_saw_unavailable", "false"),
    ];
    for (key, want) in expect {
        assert_eq!(out.get(key).as_deref(), Some(want), "{key}: {out:?}");
    }
}
