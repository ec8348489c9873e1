//! XEP-0357 push against the real server: a test app server (a client session of its own
//! account, answering the server's pubsub publishes as an app server does, or refusing
//! them) receives the notifications of a phone whose connection died (a detached
//! XEP-0198 session) or whose session is gone (offline storage, a waiting subscription
//! request); the summary says what `[push] summary` allows and no more; a registration
//! that keeps failing is removed; a flood wakes a phone a bounded number of times. The
//! presence timeline of a suspended phone: nothing inside T, unavailable with its last
//! seen at T while it hibernates, available again when it resumes. Over federation, the
//! app server sits on another server, or on another node of a cluster (tests/cluster.rs);
//! client state and interest lists hold across a hibernation; slixmpp plays an app server.

mod common;

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use presenced::config::{Config, PushSummary};
use presenced::protocol::jid::FullJid;
use presenced::protocol::xml::{parse_element, Element, NS_CLIENT};
use tokio::time::Instant;

const NS_SM: &str = "urn:xmpp:sm:3";
const NS_PUSH: &str = "urn:xmpp:push:0";
const NS_PUBSUB: &str = "http://jabber.org/protocol/pubsub";
const SECRET: &str = "eruio234vzxc2kla-91";

fn el(s: &str) -> Element {
    parse_element(s).expect("test XML")
}

/// The `<enable/>` a phone sends, with its secret as publish options (XEP-0357 §5).
fn enable_payload(app: &str, node: &str) -> Element {
    el(&format!(
        "<enable xmlns='{NS_PUSH}' jid='{app}' node='{node}'>\
           <x xmlns='jabber:x:data' type='submit'>\
             <field var='FORM_TYPE'><value>http://jabber.org/protocol/pubsub#publish-options</value></field>\
             <field var='secret'><value>{SECRET}</value></field>\
           </x>\
         </enable>"
    ))
}

/// Logs `name` in as `res` with resumable stream management, sends initial presence and
/// enables push to `app`'s `node`; the client and its resume id.
async fn push_phone(
    ts: &TestServer,
    name: &str,
    res: &str,
    app: &str,
    node: &str,
) -> (Client, String) {
    let mut c = ts.login(name, res).await;
    c.send_raw(&format!("<enable xmlns='{NS_SM}' resume='true'/>"))
        .await;
    let enabled = c.expect(|e| e.ns == NS_SM && e.name == "enabled").await;
    let id = enabled.get_attr("id").expect("resume id").to_owned();
    c.presence(None, None).await;
    let me = c.jid.clone();
    c.expect(|e| is_presence(e, &me, None)).await;
    let r = c.iq("set", None, enable_payload(app, node)).await;
    assert_eq!(r.get_attr("type"), Some("result"), "push enabled: {r}");
    (c, id)
}

/// The test app server: a session of its own account, available so it takes iq to its
/// full JID, run by a task that answers the server's pings (a live client, however long a
/// test waits) and each notification as [`Answer`] says, and hands the notifications to
/// the test.
struct AppServer {
    jid: String,
    answer: Arc<AtomicU8>,
    rx: tokio::sync::mpsc::UnboundedReceiver<Element>,
    _task: tokio::task::JoinHandle<()>,
}

impl AppServer {
    async fn start(ts: &TestServer) -> AppServer {
        ts.user("app").await;
        let c = online(ts, "app", "server").await;
        Self::run(c)
    }

    fn run(mut c: Client) -> AppServer {
        let jid = c.jid.clone();
        let answer = Arc::new(AtomicU8::new(Answer::Result as u8));
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mode = answer.clone();
        let task = tokio::spawn(async move {
            while let Ok(n) = c.watch(&is_publish, Duration::from_secs(3600)).await {
                let how = mode.load(Ordering::SeqCst);
                let refuse = how == Answer::Error as u8;
                let mut answer = Element::new("iq", NS_CLIENT)
                    .attr("type", if refuse { "error" } else { "result" })
                    .attr("to", n.get_attr("from").unwrap_or_default())
                    .attr("id", n.get_attr("id").unwrap_or_default());
                if refuse {
                    answer = answer.child(el(
                        "<error type='cancel'><item-not-found xmlns='urn:ietf:params:xml:ns:xmpp-stanzas'/></error>",
                    ));
                }
                if how != Answer::Nothing as u8 {
                    c.send(&answer).await;
                }
                if tx.send(n).is_err() {
                    return;
                }
            }
        });
        AppServer {
            jid,
            answer,
            rx,
            _task: task,
        }
    }

    /// The next notification (answered already).
    async fn next(&mut self) -> Element {
        tokio::time::timeout(WAIT, self.rx.recv())
            .await
            .expect("a notification reaches the app server in time")
            .expect("the app server runs")
    }

    /// No notification within `window`.
    async fn none(&mut self, window: Duration) {
        if let Ok(Some(n)) = tokio::time::timeout(window, self.rx.recv()).await {
            panic!("unexpected notification: {n}");
        }
    }

    fn answer(&self, how: Answer) {
        self.answer.store(how as u8, Ordering::SeqCst);
    }
}

/// How the test app server answers a notification.
#[derive(Clone, Copy)]
enum Answer {
    Result = 0,
    /// An error (item-not-found), as an app server that no longer knows the device.
    Error = 1,
    /// Not at all.
    Nothing = 2,
}

fn is_publish(e: &Element) -> bool {
    e.name == "iq"
        && e.get_attr("type") == Some("set")
        && e.get_child("pubsub", NS_PUBSUB).is_some()
}

/// The summary field `var` of a notification, if present.
fn field(n: &Element, var: &str) -> Option<String> {
    let form = n
        .get_child("pubsub", NS_PUBSUB)?
        .get_child("publish", NS_PUBSUB)?
        .get_child("item", NS_PUBSUB)?
        .get_child("notification", NS_PUSH)?
        .get_child("x", "jabber:x:data")?;
    let value = form
        .elements()
        .find(|f| f.get_attr("var") == Some(var))
        .and_then(|f| f.elements().next().map(Element::text_content));
    value
}

/// Sends `<resume/>` for `id` on a new authenticated stream of `name`.
async fn resumed(ts: &TestServer, name: &str, id: &str, jid: &str) -> Client {
    let mut again = Client::authenticated(ts, name).await;
    again
        .send_raw(&format!("<resume xmlns='{NS_SM}' previd='{id}' h='0'/>"))
        .await;
    let r = again
        .expect(|e| e.ns == NS_SM && (e.name == "resumed" || e.name == "failed"))
        .await;
    assert_eq!(r.name, "resumed", "{r}");
    again.jid = jid.to_owned();
    again
}

async fn online(ts: &TestServer, name: &str, res: &str) -> Client {
    let mut c = ts.login(name, res).await;
    c.presence(None, None).await;
    let me = c.jid.clone();
    c.expect(|e| is_presence(e, &me, None)).await;
    c
}

/// Waits (bounded) until `name` has no session left on the server.
async fn gone(ts: &TestServer, name: &str) {
    let bare = presenced::protocol::jid::parse_bare(&ts.jid(name)).unwrap();
    let deadline = Instant::now() + WAIT;
    while !ts.shared().sessions.of_user(&bare).is_empty() {
        assert!(Instant::now() < deadline, "{name} still has sessions");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn registrations(ts: &TestServer, name: &str) -> usize {
    ts.shared()
        .store
        .push_registrations(name, &ts.domain)
        .await
        .expect("registrations read")
        .len()
}

fn tweak(f: impl FnOnce(&mut Config)) -> impl FnOnce(&mut Config) {
    move |c: &mut Config| {
        fast_liveness(c);
        f(c)
    }
}

#[tokio::test]
async fn a_sleeping_phone_is_woken_through_its_app_server_and_the_summary_names_nobody() {
    let ts = TestServer::start(tweak(|_| {})).await;
    ts.user("alice").await;
    ts.user("bob").await;
    ts.make_mutual("alice", "bob").await;
    let mut app = AppServer::start(&ts).await;
    let mut bob = online(&ts, "bob", "desk").await;
    let (mut alice, id) = push_phone(&ts, "alice", "phone", &app.jid.clone(), "node-a").await;
    let alice_jid = alice.jid.clone();
    let alice_bare = ts.jid("alice");
    // XEP-0357 §4: the account advertises push.
    let info = alice
        .iq(
            "get",
            None,
            Element::new("query", "http://jabber.org/protocol/disco#info"),
        )
        .await;
    assert!(info.to_xml().contains(NS_PUSH), "push feature: {info}");
    assert_eq!(registrations(&ts, "alice").await, 1);

    // Connected: a message wakes nothing.
    bob.send(&chat(&alice_bare, "while awake")).await;
    alice.expect(|e| has_body(e, "while awake")).await;
    app.none(Duration::from_millis(500)).await;

    // The phone's connection dies (the OS suspended the app).
    drop(alice);
    detached(&ts, 1).await;
    bob.send(&chat(&alice_bare, "Wherefore art thou?")).await;
    let n = app.next().await;
    assert_eq!(n.get_attr("from"), Some(alice_bare.as_str()), "{n}");
    let xml = n.to_xml();
    assert!(
        xml.contains("node-a") && xml.contains(SECRET),
        "node and publish options: {xml}"
    );
    assert_eq!(field(&n, "message-count").as_deref(), Some("1"), "{xml}");
    // The default summary tells the third party neither who wrote nor what.
    assert!(
        !xml.contains("Wherefore") && !xml.contains(&bob.jid),
        "{xml}"
    );
    assert_eq!(field(&n, "last-message-sender"), None);

    // A chat state is not worth waking a phone for.
    bob.send(&el(&format!(
        "<message xmlns='jabber:client' to='{alice_bare}' type='chat'>\
           <composing xmlns='http://jabber.org/protocol/chatstates'/></message>"
    )))
    .await;
    barrier(&ts, &mut bob).await;
    app.none(Duration::from_millis(800)).await;

    // Woken, the phone resumes and gets what was kept for it.
    let mut again = resumed(&ts, "alice", &id, &alice_jid).await;
    again.expect(|e| has_body(e, "Wherefore art thou?")).await;
    assert_eq!(
        ts.services()
            .push
            .counters
            .errors
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

#[tokio::test]
async fn the_summary_names_sender_and_text_only_when_the_operator_allows() {
    let ts = TestServer::start(tweak(|c| c.push.summary = PushSummary::Body)).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let mut app = AppServer::start(&ts).await;
    let mut bob = online(&ts, "bob", "desk").await;
    let (alice, _) = push_phone(&ts, "alice", "phone", &app.jid.clone(), "n").await;
    drop(alice);
    detached(&ts, 1).await;
    bob.send(&chat(&ts.jid("alice"), "see you at nine")).await;
    let n = app.next().await;
    assert_eq!(
        field(&n, "last-message-body").as_deref(),
        Some("see you at nine")
    );
    assert_eq!(
        field(&n, "last-message-sender").as_deref(),
        Some(bob.jid.as_str())
    );
}

#[tokio::test]
async fn a_user_with_no_session_is_woken_for_kept_messages_and_subscription_requests() {
    let ts = TestServer::start(tweak(|_| {})).await;
    ts.user("alice").await;
    ts.user("bob").await;
    ts.user("carol").await;
    ts.make_mutual("alice", "bob").await;
    let mut app = AppServer::start(&ts).await;
    let (alice, _) = push_phone(&ts, "alice", "phone", &app.jid.clone(), "n").await;
    // A clean close: the session ends, the registration stays.
    alice.close().await;
    gone(&ts, "alice").await;
    assert_eq!(registrations(&ts, "alice").await, 1);

    let mut bob = online(&ts, "bob", "desk").await;
    bob.send(&chat(&ts.jid("alice"), "kept for later")).await;
    let n = app.next().await;
    assert_eq!(field(&n, "message-count").as_deref(), Some("1"), "{n}");
    assert_eq!(ts.offline_count(&ts.jid("alice")).await, 1);

    let mut carol = online(&ts, "carol", "desk").await;
    carol
        .presence(Some("subscribe"), Some(&ts.jid("alice")))
        .await;
    let n = app.next().await;
    assert_eq!(
        field(&n, "pending-subscription-count").as_deref(),
        Some("1"),
        "{n}"
    );
    assert!(!n.to_xml().contains("carol"), "{n}");
}

#[tokio::test]
async fn an_app_server_that_keeps_failing_loses_the_registration_and_disable_removes_it() {
    let ts = TestServer::start(tweak(|c| c.push.max_errors = 2)).await;
    ts.user("alice").await;
    ts.user("bob").await;
    // Contacts: a stranger's share of offline storage would stop keeping bob's messages
    // (and so notifying) before the end of this test.
    ts.make_mutual("alice", "bob").await;
    let mut app = AppServer::start(&ts).await;
    let app_jid = app.jid.clone();
    let (alice, _) = push_phone(&ts, "alice", "phone", &app_jid, "n").await;
    alice.close().await;
    gone(&ts, "alice").await;
    let mut bob = online(&ts, "bob", "desk").await;
    let alice_bare = ts.jid("alice");

    // A forged error from someone else counts for nothing.
    bob.send(&chat(&alice_bare, "one")).await;
    app.answer(Answer::Nothing);
    let n = app.next().await;
    let forged = el(&format!(
        "<iq xmlns='jabber:client' type='error' to='{alice_bare}' id='{}'>\
           <error type='cancel'><item-not-found xmlns='urn:ietf:params:xml:ns:xmpp-stanzas'/></error></iq>",
        n.get_attr("id").unwrap()
    ));
    ts.user("mallory").await;
    let mut mallory = online(&ts, "mallory", "x").await;
    mallory.send(&forged).await;
    barrier(&ts, &mut mallory).await;
    assert_eq!(
        ts.services()
            .push
            .counters
            .errors
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );

    app.answer(Answer::Error);
    bob.send(&chat(&alice_bare, "two")).await;
    app.next().await;
    bob.send(&chat(&alice_bare, "three")).await;
    app.next().await;
    let deadline = Instant::now() + WAIT;
    while registrations(&ts, "alice").await != 0 {
        assert!(
            Instant::now() < deadline,
            "registration still kept after two errors"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    bob.send(&chat(&alice_bare, "four")).await;
    app.none(Duration::from_millis(800)).await;

    // Enabled again, then disabled by the client: nothing more is sent.
    let mut alice = ts.login("alice", "phone").await;
    let r = alice.iq("set", None, enable_payload(&app_jid, "n")).await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    let r = alice
        .iq(
            "set",
            None,
            el(&format!("<disable xmlns='{NS_PUSH}' jid='{app_jid}'/>")),
        )
        .await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    assert_eq!(registrations(&ts, "alice").await, 0);
    // Malformed requests get the RFC 6120 errors.
    let r = alice
        .iq(
            "set",
            None,
            el(&format!("<enable xmlns='{NS_PUSH}' jid='{app_jid}'/>")),
        )
        .await;
    assert_eq!(stanza_error(&r), "bad-request", "no node: {r}");
    let r = alice
        .iq(
            "set",
            None,
            el(&format!("<enable xmlns='{NS_PUSH}' jid='a@@b' node='n'/>")),
        )
        .await;
    assert_eq!(stanza_error(&r), "jid-malformed", "{r}");
    alice.close().await;
    gone(&ts, "alice").await;
    bob.send(&chat(&alice_bare, "five")).await;
    app.none(Duration::from_millis(800)).await;

    // An account that blocks alice is no app server of hers, whatever she names.
    let mut alice = ts.login("alice", "phone").await;
    let r = alice.iq("set", None, enable_payload(&app_jid, "n")).await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    alice.close().await;
    gone(&ts, "alice").await;
    let app_bare = ts.jid("app");
    ts.shared()
        .store
        .block(&app_bare, std::slice::from_ref(&alice_bare))
        .await
        .expect("block");
    bob.send(&chat(&alice_bare, "six")).await;
    app.none(Duration::from_millis(800)).await;
    // Positive control: unblocked, the same registration notifies again.
    ts.shared()
        .store
        .unblock(&app_bare, std::slice::from_ref(&alice_bare))
        .await
        .expect("unblock");
    bob.send(&chat(&alice_bare, "seven")).await;
    app.next().await;
}

#[tokio::test]
async fn a_flood_wakes_a_phone_a_bounded_number_of_times() {
    let ts = TestServer::start(tweak(|c| {
        c.push.burst = 2;
        c.push.per_minute = 1;
    }))
    .await;
    ts.user("alice").await;
    ts.user("bob").await;
    let mut app = AppServer::start(&ts).await;
    let (alice, _) = push_phone(&ts, "alice", "phone", &app.jid.clone(), "n").await;
    alice.close().await;
    gone(&ts, "alice").await;
    ts.make_mutual("alice", "bob").await;
    let mut bob = online(&ts, "bob", "desk").await;
    for i in 0..6 {
        bob.send(&chat(&ts.jid("alice"), &format!("flood {i}")))
            .await;
    }
    barrier(&ts, &mut bob).await;
    app.next().await;
    app.next().await;
    // One more token takes a minute at this rate: nothing within the window.
    app.none(Duration::from_secs(1)).await;
    assert_eq!(
        ts.services()
            .push
            .counters
            .limited
            .load(std::sync::atomic::Ordering::Relaxed),
        4
    );
    assert_eq!(
        ts.offline_count(&ts.jid("alice")).await,
        6,
        "every message kept"
    );
}

/// The presence timeline of a suspended phone (T = 2 s here): nothing inside T, then
/// unavailable with its last seen while it hibernates past XEP-0198's own window, and
/// available again when it resumes.
#[tokio::test]
async fn a_suspended_phone_shows_unavailable_at_t_and_available_again_when_it_resumes() {
    let ts = TestServer::start(tweak(|c| {
        // XEP-0198's window alone would end the session at 1 s; push keeps it for 60.
        c.limits.sm_resume_timeout = Duration::from_secs(1);
        c.push.hibernation = Duration::from_secs(60);
    }))
    .await;
    ts.user("alice").await;
    ts.user("bob").await;
    ts.make_mutual("alice", "bob").await;
    let mut app = AppServer::start(&ts).await;
    let mut bob = online(&ts, "bob", "desk").await;
    let (alice, id) = push_phone(&ts, "alice", "phone", &app.jid.clone(), "n").await;
    let alice_jid = alice.jid.clone();
    let alice_bare = ts.jid("alice");
    bob.watch(&|e| is_presence(e, &alice_jid, None), WAIT)
        .await
        .expect("bob sees alice online");
    let full = FullJid::new(&alice_jid).unwrap();
    let lost = Instant::now();
    drop(alice);
    detached(&ts, 1).await;

    // Inside T: no flap.
    bob.watch_none(
        |e| is_presence(e, &alice_jid, Some("unavailable")),
        Duration::from_millis(1500),
    )
    .await;
    // At T (plus a bound): unavailable, and the session hibernates, still resumable.
    bob.watch(&|e| is_presence(e, &alice_jid, Some("unavailable")), WAIT)
        .await
        .expect("bob sees alice unavailable once she has been silent for T");
    assert!(
        lost.elapsed() >= Duration::from_millis(1900),
        "not before T"
    );
    let session = ts
        .shared()
        .sessions
        .get(&full)
        .expect("kept past XEP-0198's window");
    assert!(session.is_hibernated() && session.is_detached());
    let stats = ts.admin_get("/metrics").await;
    assert!(stats.contains("presenced_sessions_hibernated 1"), "{stats}");
    // The status page counts it as hibernated, not online.
    let status = ts.admin_get("/status.json").await;
    assert!(status.contains("\"hibernated\":1"), "{status}");
    assert!(
        status.contains("\"users\":2"),
        "bob and the app server only: {status}"
    );
    // Last seen: not "online now".
    let last = bob
        .iq(
            "get",
            Some(&alice_bare),
            Element::new("query", "jabber:iq:last"),
        )
        .await;
    let seconds = last
        .get_child("query", "jabber:iq:last")
        .and_then(|q| q.get_attr("seconds"))
        .map(|s| s.parse::<u64>().unwrap());
    assert!(
        seconds.is_some_and(|s| s >= 1),
        "last seen while hibernated: {last}"
    );

    // A message while it hibernates is kept for the session and wakes the phone.
    bob.send(&chat(&alice_bare, "are you there?")).await;
    app.next().await;

    // The phone wakes and resumes at 3 s, past XEP-0198's 1 s window.
    let mut again = resumed(&ts, "alice", &id, &alice_jid).await;
    again.expect(|e| has_body(e, "are you there?")).await;
    bob.watch(&|e| is_presence(e, &alice_jid, None), WAIT)
        .await
        .expect("bob sees alice available again");
    assert!(!ts.shared().sessions.get(&full).unwrap().is_hibernated());
}

#[tokio::test]
async fn a_phone_back_within_t_shows_its_contacts_nothing() {
    let ts = TestServer::start(tweak(|_| {})).await;
    ts.user("alice").await;
    ts.user("bob").await;
    ts.make_mutual("alice", "bob").await;
    let app = AppServer::start(&ts).await;
    let mut bob = online(&ts, "bob", "desk").await;
    let (alice, id) = push_phone(&ts, "alice", "phone", &app.jid.clone(), "n").await;
    let alice_jid = alice.jid.clone();
    bob.watch(&|e| is_presence(e, &alice_jid, None), WAIT)
        .await
        .expect("bob sees alice online");
    drop(alice);
    detached(&ts, 1).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let again = resumed(&ts, "alice", &id, &alice_jid).await;
    // The resumed client answers the server's pings, as a live one does.
    let _alive = tokio::spawn(again.keep_alive());
    // Longer than T: the hibernation the resume cancelled would have come by now.
    bob.watch_none(
        |e| is_presence(e, &alice_jid, Some("unavailable")),
        Duration::from_secs(3),
    )
    .await;
    let full = FullJid::new(&alice_jid).unwrap();
    assert!(!ts.shared().sessions.get(&full).unwrap().is_hibernated());
}

/// Over federation: the app server is a session on another server; the notification
/// crosses the s2s link, from the user's bare JID, and the answer comes back over it.
#[tokio::test]
async fn a_notification_reaches_an_app_server_on_another_server() {
    let a_domain = format!("a{}.example", unique());
    let b_domain = format!("b{}.example", unique());
    let a_port = listen_port("127.0.0.2");
    let b_port = listen_port("127.0.0.3");
    let (a_addr, b_addr) = (format!("127.0.0.2:{a_port}"), format!("127.0.0.3:{b_port}"));
    let a = TestServer::start_with_domain(&a_domain, |c| {
        s2s_config(c, "127.0.0.2", a_port, "secret-a", &b_domain, b_addr);
        c.push.max_errors = 1;
    })
    .await;
    let b = TestServer::start_with_domain(&b_domain, |c| {
        s2s_config(c, "127.0.0.3", b_port, "secret-b", &a_domain, a_addr);
    })
    .await;
    a.user("alice").await;
    a.user("bob").await;
    b.user("app").await;
    let mut app_client = online(&b, "app", "server").await;
    let app_jid = app_client.jid.clone();
    let (mut alice, _) = push_phone(&a, "alice", "phone", &app_jid, "remote-node").await;
    // An app server that is a user's resource takes iq requests only from those who may
    // see it online (the privacy gate): here, a mutual subscription across the link.
    subscribe_mutually(&mut alice, &a.jid("alice"), &mut app_client, &b.jid("app")).await;
    let mut app = AppServer::run(app_client);
    alice.close().await;
    gone(&a, "alice").await;
    let mut bob = online(&a, "bob", "desk").await;
    bob.send(&chat(&a.jid("alice"), "across")).await;
    let n = app.next().await;
    assert_eq!(n.get_attr("from"), Some(a.jid("alice").as_str()), "{n}");
    assert!(n.to_xml().contains("remote-node") && n.to_xml().contains(SECRET));
    assert_eq!(registrations(&a, "alice").await, 1);
    // With max_errors = 1 one error removes the registration. The app server's answers
    // cross the same link in order, so once the refusal below has arrived, the result
    // before it has too: no wait is needed to know it counted as no error.
    app.answer(Answer::Error);
    bob.send(&chat(&a.jid("alice"), "refused")).await;
    app.next().await;
    let deadline = Instant::now() + WAIT;
    while registrations(&a, "alice").await != 0 {
        assert!(Instant::now() < deadline, "the remote error never arrived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let errors = &a.services().push.counters.errors;
    assert_eq!(
        errors.load(Ordering::Relaxed),
        1,
        "the result counted as no error"
    );
}

/// The app server is slixmpp, a client this project did not write: it receives the
/// notification of a sleeping phone as its pubsub publish, with the node and the secret
/// the phone gave, the default summary (a count, no sender, no text), and answers it.
#[tokio::test]
async fn slixmpp_as_the_app_server_receives_and_answers_the_notification() {
    let ts = TestServer::start(tweak(|_| {})).await;
    ts.user("alice").await;
    ts.user("bob").await;
    ts.user("app").await;
    ts.make_mutual("alice", "bob").await;
    let args = client_script_args(&ts, &["app", "pw", "push", "20"]);
    let script = tokio::spawn(async move {
        run_client_script("push_app.py", &args, Duration::from_secs(60)).await
    });
    // The app server is online once its session is available.
    let app_full = FullJid::new(&format!("{}/push", ts.jid("app"))).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ts
        .shared()
        .sessions
        .get(&app_full)
        .is_some_and(|s| s.is_available())
    {
        assert!(
            Instant::now() < deadline,
            "slixmpp app server never came online"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (alice, _) = push_phone(&ts, "alice", "phone", app_full.as_str(), "slix-node").await;
    drop(alice);
    detached(&ts, 1).await;
    let mut bob = online(&ts, "bob", "desk").await;
    bob.send(&chat(&ts.jid("alice"), "secret text")).await;
    let out = script.await.expect("script task");
    assert_eq!(out.code, Some(0), "push_app.py failed: {out:?}");
    assert_eq!(
        out.get("from").as_deref(),
        Some(ts.jid("alice").as_str()),
        "{out:?}"
    );
    assert_eq!(out.get("node").as_deref(), Some("slix-node"), "{out:?}");
    assert_eq!(out.get("secret").as_deref(), Some(SECRET), "{out:?}");
    assert!(out.report.contains("\"message-count\": \"1\""), "{out:?}");
    assert!(
        !out.report.contains("secret text") && !out.report.contains("bob@"),
        "{out:?}"
    );
    // Its result was taken as success: no error counted.
    let push = &ts.services().push.counters;
    assert_eq!(push.sent.load(Ordering::Relaxed), 1);
    assert_eq!(push.errors.load(Ordering::Relaxed), 0);
}

/// XEP-0352 and the interest list go on through a hibernation: the phone went inactive
/// with an interest in bob before it slept; while it hibernates, bob's change is kept for
/// it and carol's only held (her latest), and after the resume carol's latest comes only
/// when the phone says it is active.
#[tokio::test]
async fn client_state_and_the_interest_list_hold_across_a_hibernation() {
    let ts = TestServer::start(tweak(|_| {})).await;
    for u in ["alice", "bob", "carol"] {
        ts.user(u).await;
    }
    ts.make_mutual("alice", "bob").await;
    ts.make_mutual("alice", "carol").await;
    let app = AppServer::start(&ts).await;
    let mut bob = online(&ts, "bob", "b").await;
    let mut carol = online(&ts, "carol", "c").await;
    let (mut alice, id) = push_phone(&ts, "alice", "phone", &app.jid.clone(), "n").await;
    let alice_jid = alice.jid.clone();
    let (bob_jid, carol_jid) = (bob.jid.clone(), carol.jid.clone());
    alice.expect(|e| is_presence(e, &bob_jid, None)).await;
    alice.expect(|e| is_presence(e, &carol_jid, None)).await;
    let items = format!("<item jid='{}'/>", ts.jid("bob"));
    let r = alice
        .iq(
            "set",
            None,
            el(&format!(
                "<interest xmlns='urn:presenced:interest:0'>{items}</interest>"
            )),
        )
        .await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    alice.send_raw("<inactive xmlns='urn:xmpp:csi:0'/>").await;
    barrier(&ts, &mut alice).await;
    drop(alice);
    detached(&ts, 1).await;
    // Bob and carol answer the server's pings while alice's phone sleeps for T.
    let full = FullJid::new(&alice_jid).unwrap();
    let deadline = Instant::now() + WAIT;
    while !ts
        .shared()
        .sessions
        .get(&full)
        .is_some_and(|s| s.is_hibernated())
    {
        assert!(Instant::now() < deadline, "alice never hibernated");
        for c in [&mut bob, &mut carol] {
            let _ = c.watch(&|_| false, Duration::from_millis(100)).await;
        }
    }
    bob.watch(&|e| is_presence(e, &alice_jid, Some("unavailable")), WAIT)
        .await
        .expect("bob sees alice leave when she hibernates");

    show(&ts, &mut carol, "dnd").await;
    show(&ts, &mut carol, "xa").await;
    show(&ts, &mut bob, "away").await;
    // h = 0: what came before the sleep comes again too; the changes since are what count.
    let mut again = resumed(&ts, "alice", &id, &alice_jid).await;
    let p = again
        .expect(|e| is_presence(e, &bob_jid, None) && show_of(e).is_some())
        .await;
    assert_eq!(
        show_of(&p).as_deref(),
        Some("away"),
        "bob's, named in the interest list: {p}"
    );
    barrier(&ts, &mut again).await;
    assert!(
        !again
            .backlog
            .iter()
            .any(|e| is_presence(e, &carol_jid, None) && show_of(e).is_some()),
        "carol's changes are held while inactive: {:?}",
        again.backlog
    );
    again.send_raw("<active xmlns='urn:xmpp:csi:0'/>").await;
    let p = again
        .expect(|e| is_presence(e, &carol_jid, None) && show_of(e).is_some())
        .await;
    assert_eq!(show_of(&p).as_deref(), Some("xa"), "only her latest: {p}");
    barrier(&ts, &mut again).await;
    assert!(
        !again
            .backlog
            .iter()
            .any(|e| show_of(e).as_deref() == Some("dnd")),
        "{:?}",
        again.backlog
    );
}
