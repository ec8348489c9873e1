//! Deleting an account: nothing of it carries over to a new account of the same name, and
//! its contacts are told as if the user had removed each roster item (RFC 6121 §2.5.2),
//! whichever way it is deleted (the admin socket's `user del`, XEP-0077 `<remove/>`).
//!
//! The server tests run on PostgreSQL, or on SQLite with `PRESENCED_TEST_STORE=sqlite`;
//! the store test runs on both.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::stores::Db;
use common::*;
use presenced::app::admin::Request;
use presenced::protocol::xml::{parse_element, Element, NS_CLIENT};

const NS_ROSTER: &str = "jabber:iq:roster";
const NS_PUBSUB: &str = "http://jabber.org/protocol/pubsub";
const NS_NICK: &str = "http://jabber.org/protocol/nick";

fn el(xml: &str) -> Element {
    parse_element(xml).unwrap_or_else(|| panic!("test XML parses: {xml}"))
}

/// An admin socket of its own for a test server.
fn admin_socket(c: &mut presenced::config::Config) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("presenced-acctdel-{}", unique()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("admin.sock");
    c.admin.socket = Some(path.clone());
    path
}

/// Opens the admin socket the config names, as the server's control loop does.
async fn open_admin(ts: &TestServer) {
    presenced::app::admin::start(ts.shared(), ts.services())
        .await
        .expect("admin socket")
        .expect("configured");
}

/// `presenced user del JID` against the running server.
async fn user_del(sock: &std::path::Path, jid: &str) -> serde_json::Value {
    presenced::app::admin::request(sock, &Request::UserDel { jid: jid.into() })
        .await
        .unwrap_or_else(|e| panic!("user del {jid}: {e}"))
}

/// `name` logged in with resource `res`, its roster fetched (an interested resource,
/// RFC 6121 §2.1.6) and its initial presence echoed back.
async fn online(ts: &TestServer, name: &str, res: &str) -> Client {
    let mut c = ts.login(name, res).await;
    let r = c.iq("get", None, Element::new("query", NS_ROSTER)).await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    c.presence(None, None).await;
    let me = format!("{}/{res}", ts.jid(name));
    c.expect(|e| is_presence(e, &me, None)).await;
    c
}

/// A roster push to `c` removing `contact`.
fn is_removal_push(e: &Element, contact: &str) -> bool {
    e.name == "iq"
        && e.get_attr("type") == Some("set")
        && e.get_child("query", NS_ROSTER)
            .and_then(|q| q.get_child("item", NS_ROSTER))
            .is_some_and(|i| {
                i.get_attr("jid") == Some(contact) && i.get_attr("subscription") == Some("remove")
            })
}

/// The XEP-0077 §3.2 request to cancel one's own registration.
fn remove_registration() -> Element {
    el("<query xmlns='jabber:iq:register'><remove/></query>")
}

#[tokio::test]
async fn a_recreated_account_inherits_no_subscription_presence_last_seen_or_pep() {
    let mut sock = PathBuf::new();
    let ts = TestServer::start(|c| sock = admin_socket(c)).await;
    open_admin(&ts).await;
    ts.user("alice").await;
    ts.user("bob").await;
    ts.make_mutual("alice", "bob").await;
    let (alice_jid, bob_jid) = (ts.jid("alice"), ts.jid("bob"));

    let mut bob = online(&ts, "bob", "phone").await;
    let r = bob
        .iq(
            "set",
            None,
            el(&format!(
                "<pubsub xmlns='{NS_PUBSUB}'><publish node='{NS_NICK}'><item id='n'>\
                 <nick xmlns='{NS_NICK}'>Bobby</nick></item></publish></pubsub>"
            )),
        )
        .await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    let mut alice = online(&ts, "alice", "home").await;
    alice.expect(|e| is_presence(e, &bob_jid, None)).await;

    user_del(&sock, &alice_jid).await;
    let end = alice.expect_stream_end().await;
    assert!(
        matches!(&end, Ended::StreamError(c) if c == "not-authorized"),
        "{end:?}"
    );

    // A stranger takes the freed name.
    ts.user("alice").await;
    let mut stranger = ts.login("alice", "new").await;
    stranger.presence(None, None).await;
    barrier(&ts, &mut stranger).await;
    // Bob's presence, nick and last activity are his contacts', and the stranger is none.
    let r = stranger
        .iq("get", Some(&bob_jid), el("<query xmlns='jabber:iq:last'/>"))
        .await;
    assert_eq!(r.get_attr("type"), Some("error"), "last activity: {r}");
    let r = stranger
        .iq(
            "get",
            Some(&bob_jid),
            el(&format!(
                "<pubsub xmlns='{NS_PUBSUB}'><items node='{NS_NICK}'/></pubsub>"
            )),
        )
        .await;
    assert_eq!(r.get_attr("type"), Some("error"), "bob's nick: {r}");
    let mut away = Element::new("presence", NS_CLIENT);
    away = away.child(Element::new("show", NS_CLIENT).text("away"));
    bob.send(&away).await;
    bob.expect(|e| is_presence(e, &format!("{bob_jid}/phone"), None))
        .await;
    // Bob's own echo is routed in the same pass as any copy to a subscriber.
    stranger
        .expect_none(
            |e| e.name == "presence" && e.get_attr("from").is_some_and(|f| f.starts_with(&bob_jid)),
            Duration::from_secs(1),
        )
        .await;

    let store = &ts.shared().store;
    assert_eq!(store.roster_item(&bob_jid, &alice_jid).await.unwrap(), None);
    assert!(store.roster(&alice_jid).await.unwrap().1.is_empty());
}

#[tokio::test]
async fn an_online_contact_gets_the_removal_pushed_and_the_unavailable_at_once() {
    let mut sock = PathBuf::new();
    // The default grace (10 s): the unavailable must not wait for it.
    let ts = TestServer::start(|c| {
        sock = admin_socket(c);
        c.liveness.grace = Duration::from_secs(10);
    })
    .await;
    open_admin(&ts).await;
    ts.user("alice").await;
    ts.user("bob").await;
    ts.user("carol").await;
    ts.make_mutual("alice", "bob").await;
    let (alice_jid, bob_jid, carol_jid) = (ts.jid("alice"), ts.jid("bob"), ts.jid("carol"));
    let mut bob = online(&ts, "bob", "phone").await;
    let mut carol = online(&ts, "carol", "pc").await;
    let mut alice = online(&ts, "alice", "home").await;
    bob.expect(|e| is_presence(e, &alice_jid, None)).await;
    // A request of alice's waits for carol.
    alice.send(&presence_to("subscribe", &carol_jid)).await;
    carol
        .expect(|e| is_presence(e, &alice_jid, Some("subscribe")))
        .await;

    user_del(&sock, &alice_jid).await;

    let bound = Duration::from_secs(3);
    bob.try_expect(&|e: &Element| is_removal_push(e, &alice_jid), bound)
        .await
        .expect("bob's roster push removing alice");
    bob.try_expect(
        &|e: &Element| is_presence(e, &format!("{alice_jid}/home"), Some("unavailable")),
        bound,
    )
    .await
    .expect("alice's unavailable, before the grace period is over");
    // Carol's waiting request is withdrawn (RFC 6121 §3.1.3: the unsubscribe that cancels
    // a pending request).
    carol
        .try_expect(
            &|e: &Element| is_presence(e, &alice_jid, Some("unsubscribe")),
            bound,
        )
        .await
        .expect("carol hears alice's request withdrawn");
    let store = &ts.shared().store;
    assert!(store
        .pending_subscriptions(&carol_jid)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        store.roster_item(&carol_jid, &alice_jid).await.unwrap(),
        None
    );
    assert_eq!(store.roster_item(&bob_jid, &alice_jid).await.unwrap(), None);
}

/// Two federated servers: `a` on 127.0.0.2 with an admin socket and XEP-0077 on, `b` on
/// 127.0.0.3.
async fn pair() -> (TestServer, TestServer, PathBuf) {
    let a_domain = format!("a{}.example", unique());
    let b_domain = format!("b{}.example", unique());
    let a_port = listen_port("127.0.0.2");
    let b_port = listen_port("127.0.0.3");
    let mut sock = PathBuf::new();
    let a = TestServer::start_with_domain(&a_domain, |c| {
        s2s_config(
            c,
            "127.0.0.2",
            a_port,
            "secret-a",
            &b_domain,
            format!("127.0.0.3:{b_port}"),
        );
        c.auth.allow_registration = true;
        sock = admin_socket(c);
    })
    .await;
    let b = TestServer::start_with_domain(&b_domain, |c| {
        s2s_config(
            c,
            "127.0.0.3",
            b_port,
            "secret-b",
            &a_domain,
            format!("127.0.0.2:{a_port}"),
        )
    })
    .await;
    open_admin(&a).await;
    (a, b, sock)
}

/// How a test deletes alice.
#[derive(Clone, Copy)]
enum Deletion {
    AdminSocket,
    InBand,
}

/// alice@a with a local contact (carol@a) and a remote one (bob@b), all mutual and online;
/// alice is deleted `how`: carol gets the removal pushed, bob's server gets the
/// unavailable, unsubscribe and unsubscribed, and bob's roster on b says none.
async fn remote_and_local_contacts_are_told(how: Deletion) {
    let (a, b, sock) = pair().await;
    a.user("alice").await;
    a.user("carol").await;
    b.user("bob").await;
    a.make_mutual("alice", "carol").await;
    let (alice_jid, bob_jid, carol_jid) = (a.jid("alice"), b.jid("bob"), a.jid("carol"));
    let mut carol = online(&a, "carol", "pc").await;
    let mut alice = online(&a, "alice", "home").await;
    let mut bob = online(&b, "bob", "work").await;
    subscribe_mutually(&mut alice, &alice_jid, &mut bob, &bob_jid).await;
    carol.expect(|e| is_presence(e, &alice_jid, None)).await;

    match how {
        Deletion::AdminSocket => {
            user_del(&sock, &alice_jid).await;
        }
        Deletion::InBand => {
            // XEP-0077 §3.2: the result, then the stream ends with not-authorized.
            let r = alice.iq("set", None, remove_registration()).await;
            assert_eq!(r.get_attr("type"), Some("result"), "{r}");
        }
    }
    let end = alice.expect_stream_end().await;
    assert!(
        matches!(&end, Ended::StreamError(c) if c == "not-authorized"),
        "{end:?}"
    );
    let home = format!("{alice_jid}/home");
    bob.expect(|e| is_presence(e, &home, Some("unavailable")))
        .await;
    bob.expect(|e| is_presence(e, &alice_jid, Some("unsubscribe")))
        .await;
    bob.expect(|e| is_presence(e, &alice_jid, Some("unsubscribed")))
        .await;
    carol.expect(|e| is_removal_push(e, &alice_jid)).await;
    carol
        .expect(|e| is_presence(e, &home, Some("unavailable")))
        .await;

    let on_b = b
        .shared()
        .store
        .roster_item(&bob_jid, &alice_jid)
        .await
        .unwrap()
        .expect("bob keeps the item; its subscription is gone");
    assert_eq!(on_b.subscription.as_str(), "none");
    assert!(!on_b.pending_out && !on_b.pending_in, "{on_b:?}");
    let store = &a.shared().store;
    assert!(!store.account_exists("alice", &a.domain).await.unwrap());
    assert_eq!(
        store.roster_item(&carol_jid, &alice_jid).await.unwrap(),
        None
    );
}

#[tokio::test]
async fn user_del_cancels_and_revokes_with_remote_contacts_and_pushes_to_local_ones() {
    remote_and_local_contacts_are_told(Deletion::AdminSocket).await;
}

#[tokio::test]
async fn in_band_removal_cancels_and_revokes_with_remote_contacts_and_pushes_to_local_ones() {
    remote_and_local_contacts_are_told(Deletion::InBand).await;
}

#[tokio::test]
async fn in_band_removal_is_refused_while_registration_is_off_or_with_other_fields() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    let mut alice = ts.login("alice", "home").await;
    let r = alice.iq("set", None, remove_registration()).await;
    assert_error(&r, "service-unavailable", "cancel", "registration is off");
    assert!(ts
        .shared()
        .store
        .account_exists("alice", &ts.domain)
        .await
        .unwrap());

    let ts = TestServer::start(|c| c.auth.allow_registration = true).await;
    ts.user("alice").await;
    let mut alice = ts.login("alice", "home").await;
    // XEP-0077 §3.2: <remove/> must be the only child.
    let r = alice
        .iq(
            "set",
            None,
            el("<query xmlns='jabber:iq:register'><remove/><username>alice</username></query>"),
        )
        .await;
    assert_error(&r, "bad-request", "modify", "remove with another field");
    assert!(ts
        .shared()
        .store
        .account_exists("alice", &ts.domain)
        .await
        .unwrap());
}

on_both_stores!(the_store_deletes_an_account_from_every_roster_and_waiting_request);

/// The store's half, on both backends: one transaction removes the account from every
/// local roster and every waiting request it sent, and reports what the server must tell.
async fn the_store_deletes_an_account_from_every_roster_and_waiting_request(db: Db) {
    let store = db.open().await;
    let d = format!("s{}.example", unique());
    for u in ["alice", "bob", "carol", "dave"] {
        store.create_account(u, &d, "pw", 4096).await.unwrap();
    }
    let j = |u: &str| format!("{u}@{d}");
    common::stores::make_mutual(&store, &j("alice"), &j("bob"))
        .await
        .unwrap();
    // alice asked carol (waiting, no item on carol's side); dave asked alice.
    store
        .add_pending_subscription(&j("carol"), &j("alice"), "<presence type='subscribe'/>")
        .await
        .unwrap();
    store
        .add_pending_subscription(&j("alice"), &j("dave"), "<presence type='subscribe'/>")
        .await
        .unwrap();
    store
        .add_pending_subscription(
            &j("alice"),
            "remote@far.example",
            "<presence type='subscribe'/>",
        )
        .await
        .unwrap();
    // An account of another server sharing the database: its server is told over
    // federation, and its roster is not this server's to change.
    let other = format!("o{}.example", unique());
    let zed = format!("zed@{other}");
    store
        .create_account("zed", &other, "pw", 4096)
        .await
        .unwrap();
    common::stores::make_mutual(&store, &j("alice"), &zed)
        .await
        .unwrap();
    let bob_before = store.roster(&j("bob")).await.unwrap().0;

    let gone = store
        .delete_account("alice", &d, std::slice::from_ref(&d))
        .await
        .unwrap()
        .expect("alice existed");
    assert_eq!(
        gone.items
            .iter()
            .map(|i| (i.contact.to_string(), i.subscription.as_str()))
            .collect::<Vec<_>>(),
        vec![(j("bob"), "both"), (zed.clone(), "both")]
    );
    assert!(store
        .roster_item(&zed, &j("alice"))
        .await
        .unwrap()
        .is_some());
    let mut waiting = gone.waiting.clone();
    waiting.sort();
    assert_eq!(waiting, vec![j("dave"), "remote@far.example".to_owned()]);
    let (bob_now, bob_items) = store.roster(&j("bob")).await.unwrap();
    assert!(bob_items.is_empty(), "{bob_items:?}");
    assert!(bob_now > bob_before);
    assert_eq!(gone.removed_from, vec![(j("bob"), bob_now)]);
    assert_eq!(gone.withdrawn, vec![j("carol")]);
    assert!(store
        .pending_subscriptions(&j("carol"))
        .await
        .unwrap()
        .is_empty());
    // XEP-0237: bob's client holding the older version learns of the removal.
    let (_, changes) = store
        .roster_since(&j("bob"), bob_before)
        .await
        .unwrap()
        .expect("a diff");
    assert!(
        matches!(changes.as_slice(), [presenced::store::RosterChange::Removed(c)] if c.as_str() == j("alice")),
        "{changes:?}"
    );
    assert!(store
        .delete_account("alice", &d, std::slice::from_ref(&d))
        .await
        .unwrap()
        .is_none());

    // A new alice starts with an empty roster and nobody has her.
    store.create_account("alice", &d, "pw", 4096).await.unwrap();
    assert!(store.roster(&j("alice")).await.unwrap().1.is_empty());
    assert!(store
        .pending_subscriptions(&j("alice"))
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        store.roster_item(&j("bob"), &j("alice")).await.unwrap(),
        None
    );
}
