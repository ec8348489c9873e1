//! What one login costs the store, counted by the store itself (`Store::calls`) while a real
//! client logs in over a real socket (STARTTLS, SASL PLAIN, bind, roster get, initial
//! presence), on PostgreSQL and on a fresh SQLite file.
//!
//! The user's roster rows are read once per login (RFC 6121 §2.2: the client asks for the
//! roster, then sends initial presence): that read answers the roster get and is the
//! privacy gate's input for the initial broadcast and for choosing whom to probe. The
//! probes' own read is the contacts' side (their items for the user, their settings and
//! blocks), which the gate decides on. A versioned roster get (XEP-0237 §2.3, RFC 6121
//! §2.6.3) whose version is current reads the version and nothing else.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::stores::Db;
use common::*;
use presenced::protocol::xml::{Element, NS_CLIENT, NS_ROSTER};
use presenced::store::Store;

on_both_stores!(
    a_login_reads_the_users_roster_once_for_the_result_the_broadcast_and_the_probes,
    a_versioned_login_with_no_changes_reads_only_the_version_besides_the_broadcast,
);

/// The store's operations that read the user's own roster rows.
const ROSTER_READS: [&str; 4] = ["roster", "login_roster", "audience_inputs", "roster_since"];

/// A server on `db`'s store; on SQLite without Redis, as the embedded mode runs.
async fn server(db: &Db) -> TestServer {
    let url = db.url();
    let sqlite = matches!(db, Db::Sqlite(_));
    TestServer::start(move |c| {
        c.database.url = url;
        if sqlite {
            without_redis(c);
        }
    })
    .await
}

/// Alice with bob (both, online), carol (alice subscribed to her, offline) and dave (he is
/// subscribed to alice); bob is logged in and available.
async fn world(ts: &TestServer) -> Client {
    for u in ["alice", "bob", "carol", "dave"] {
        ts.user(u).await;
    }
    ts.make_mutual("alice", "bob").await;
    ts.sql(
        "SELECT presenced_roster_make_mutual($1, $2)",
        "INSERT INTO presenced_roster_make_mutual (a, b) VALUES (?1, ?2)",
        &[&ts.jid("alice"), &ts.jid("carol")],
    )
    .await
    .expect("alice and carol");
    ts.sql(
        "UPDATE roster_items SET subscription = 'to' WHERE owner = $1 AND contact = $2",
        "UPDATE roster_items SET subscription = 'to' WHERE owner = ?1 AND contact = ?2",
        &[&ts.jid("alice"), &ts.jid("carol")],
    )
    .await
    .expect("alice only subscribed to carol");
    ts.sql(
        "UPDATE roster_items SET subscription = 'from' WHERE owner = $1 AND contact = $2",
        "UPDATE roster_items SET subscription = 'from' WHERE owner = ?1 AND contact = ?2",
        &[&ts.jid("carol"), &ts.jid("alice")],
    )
    .await
    .expect("carol's side");
    ts.make_mutual("alice", "dave").await;
    ts.sql(
        "UPDATE roster_items SET subscription = 'from' WHERE owner = $1 AND contact = $2",
        "UPDATE roster_items SET subscription = 'from' WHERE owner = ?1 AND contact = ?2",
        &[&ts.jid("alice"), &ts.jid("dave")],
    )
    .await
    .expect("dave subscribed to alice");
    let mut bob = ts.login("bob", "pc").await;
    bob.presence(None, None).await;
    barrier(ts, &mut bob).await;
    bob
}

/// Waits until the store has run nothing for a while (the change notifications of the
/// set-up and their consequences are over), then returns its counts.
async fn settled(store: &Store) -> BTreeMap<&'static str, u64> {
    let mut before = store.calls();
    loop {
        tokio::time::sleep(Duration::from_millis(400)).await;
        let now = store.calls();
        if now == before {
            return now;
        }
        before = now;
    }
}

/// Logs alice in, asks for the roster (with `ver`, if given) and sends initial presence;
/// returns once the server has handled all of it (its answer to a ping sent last), with
/// what it sent meanwhile.
async fn login(ts: &TestServer, ver: Option<&str>) -> (Client, Vec<Element>) {
    let mut c = ts.login("alice", "phone").await;
    let mut q = Element::new("query", NS_ROSTER);
    if let Some(v) = ver {
        q = q.attr("ver", v);
    }
    let roster = Element::new("iq", NS_CLIENT)
        .attr("type", "get")
        .attr("id", "roster1")
        .child(q);
    c.send(&roster).await;
    c.presence(None, None).await;
    c.send(
        &Element::new("iq", NS_CLIENT)
            .attr("type", "get")
            .attr("id", "ping1")
            .attr("to", ts.domain.as_str())
            .child(Element::new("ping", "urn:xmpp:ping")),
    )
    .await;
    let mut seen = Vec::new();
    loop {
        let el = c
            .next_stanza(Duration::from_secs(10))
            .await
            .expect("stanza");
        if el.get_attr("id") == Some("ping1") {
            return (c, seen);
        }
        seen.push(el);
    }
}

fn roster_reads(calls: &BTreeMap<&'static str, u64>) -> u64 {
    ROSTER_READS
        .iter()
        .map(|n| calls.get(n).copied().unwrap_or(0))
        .sum()
}

async fn a_login_reads_the_users_roster_once_for_the_result_the_broadcast_and_the_probes(db: Db) {
    let ts = server(&db).await;
    let store = ts.shared().store.clone();
    let mut bob = world(&ts).await;
    let before = settled(&store).await;
    let (c, seen) = login(&ts, None).await;
    let calls = store.calls_since(&before);
    eprintln!("{:?} login: {calls:?}", store.dialect());

    // What the login had to do, from that one read: the whole roster in the result…
    let result = seen
        .iter()
        .find(|e| e.get_attr("id") == Some("roster1"))
        .expect("roster result");
    let q = result.get_child("query", NS_ROSTER).expect("query");
    let mut items: Vec<String> = q
        .elements()
        .map(|i| i.get_attr("jid").unwrap_or_default().to_owned())
        .collect();
    items.sort();
    assert_eq!(
        items,
        [ts.jid("bob"), ts.jid("carol"), ts.jid("dave")],
        "{result}"
    );
    // …the probes' answers (bob online, carol offline; dave is not probed)…
    let from = |e: &Element, who: &str| {
        e.name == "presence" && e.get_attr("from").is_some_and(|f| f.starts_with(who))
    };
    assert!(
        seen.iter().any(|e| from(e, &ts.jid("bob"))),
        "bob's presence: {seen:?}"
    );
    assert!(
        seen.iter()
            .any(|e| from(e, &ts.jid("carol")) && e.get_attr("type") == Some("unavailable")),
        "carol as offline: {seen:?}"
    );
    assert!(!seen.iter().any(|e| from(e, &ts.jid("dave"))), "{seen:?}");
    // …and the broadcast to bob, a subscriber.
    bob.expect(|e| e.name == "presence" && from(e, &ts.jid("alice")))
        .await;

    assert_eq!(
        roster_reads(&calls),
        1,
        "one read of alice's roster: {calls:?}"
    );
    // Everything the login read: her credentials; her roster, settings and blocks (one
    // statement); the contacts' side of the probes (their items for her, settings, blocks
    // and last seen, one statement for all of them); the subscription requests and
    // messages that waited for her (RFC 6121 §3.1.3, XEP-0160); and the last PEP items
    // of the nodes she may read (XEP-0163). Her own settings, which decide the last-seen
    // stamp of carol's unavailable, came with her roster.
    let expected: BTreeMap<&str, u64> = [
        "scram_credentials",
        "login_roster",
        "probe_inputs",
        "pending_subscriptions",
        "take_offline_messages",
        "pep_items",
    ]
    .into_iter()
    .map(|n| (n, 1))
    .collect();
    assert_eq!(calls, expected);
    c.close().await;
    ts.stop().await;
}

async fn a_versioned_login_with_no_changes_reads_only_the_version_besides_the_broadcast(db: Db) {
    let ts = server(&db).await;
    let store = ts.shared().store.clone();
    let _bob = world(&ts).await;
    let (version, _) = store.roster(&ts.jid("alice")).await.expect("roster");
    let before = settled(&store).await;
    let (c, seen) = login(&ts, Some(&version.to_string())).await;
    let calls = store.calls_since(&before);
    eprintln!("{:?} versioned login: {calls:?}", store.dialect());

    // XEP-0237 §2.3: an empty result and no pushes.
    let result = seen
        .iter()
        .find(|e| e.get_attr("id") == Some("roster1"))
        .expect("roster result");
    assert_eq!(result.get_attr("type"), Some("result"), "{result}");
    assert!(result.get_child("query", NS_ROSTER).is_none(), "{result}");
    assert!(
        !seen
            .iter()
            .any(|e| e.name == "iq" && e.get_attr("type") == Some("set")),
        "no pushes: {seen:?}"
    );

    assert_eq!(calls.get("roster_version"), Some(&1), "{calls:?}");
    assert_eq!(
        calls.get("roster_since"),
        None,
        "no items, no tombstones: {calls:?}"
    );
    // The broadcast's read is the login's one read of the roster rows.
    assert_eq!(roster_reads(&calls), 1, "{calls:?}");
    assert_eq!(calls.get("audience_inputs"), Some(&1), "{calls:?}");
    assert_eq!(calls.get("privacy_settings"), None, "{calls:?}");
    c.close().await;
    ts.stop().await;
}
