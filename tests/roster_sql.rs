//! Rosters managed by operators in SQL: the documented SQL functions keep both
//! sides consistent, and users online when the change lands get the roster push and the
//! presence a client-made change would have produced.

mod common;

use common::*;
use presenced::protocol::xml::NS_ROSTER;
use std::time::Duration;

fn roster_push_for<'a>(
    contact: &'a str,
    sub: &'a str,
) -> impl Fn(&presenced::protocol::xml::Element) -> bool + 'a {
    move |e| {
        e.name == "iq"
            && e.get_attr("type") == Some("set")
            && e.get_child("query", NS_ROSTER)
                .and_then(|q| q.get_child("item", NS_ROSTER))
                .is_some_and(|i| {
                    i.get_attr("jid") == Some(contact) && i.get_attr("subscription") == Some(sub)
                })
    }
}

/// Logs in, asks for the roster (so roster pushes follow, RFC 6121 §2.1.6) and sends
/// initial presence.
async fn online(ts: &TestServer, name: &str) -> Client {
    online_fetching_roster(ts, name, true).await
}

/// Logs in and sends initial presence without ever asking for the roster.
async fn online_without_roster(ts: &TestServer, name: &str) -> Client {
    online_fetching_roster(ts, name, false).await
}

async fn online_fetching_roster(ts: &TestServer, name: &str, fetch: bool) -> Client {
    let query = presenced::protocol::xml::Element::new("query", NS_ROSTER);
    online_with_roster_query(ts, name, fetch.then_some(query)).await
}

/// Logs in, sends `query` as a roster get if there is one, and sends initial presence.
async fn online_with_roster_query(
    ts: &TestServer,
    name: &str,
    query: Option<presenced::protocol::xml::Element>,
) -> Client {
    let mut c = ts.login(name, "r").await;
    if let Some(q) = query {
        let r = c.iq("get", None, q).await;
        assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    }
    c.presence(None, None).await;
    let me = ts.jid(name);
    c.expect(|e| is_presence(e, &me, None)).await;
    c
}

#[tokio::test]
async fn sql_make_mutual_pushes_roster_and_presence_to_online_users() {
    let ts = TestServer::start(|_| {}).await;
    for u in ["alice", "bob", "carol"] {
        ts.user(u).await;
    }
    let mut alice = online(&ts, "alice").await;
    let mut bob = online(&ts, "bob").await;
    let mut carol = online(&ts, "carol").await;
    let (a, b) = (ts.jid("alice"), ts.jid("bob"));
    ts.make_mutual("alice", "bob").await;
    // Each gets the contact's presence only after the roster push that names the contact
    // (RFC 6121 §2.1.6 and §3.1.5: push first): a client such as Profanity drops presence
    // from a JID its roster does not hold and shows the contact offline. A push read after
    // the presence is not yet in the backlog when the presence arrives.
    for (c, contact) in [(&mut alice, &b), (&mut bob, &a)] {
        c.expect(|e| is_presence(e, &format!("{contact}/r"), None))
            .await;
        assert!(
            c.backlog.iter().any(roster_push_for(contact, "both")),
            "{}: {contact}'s presence came before the roster push",
            c.jid
        );
    }
    // Carol is nobody's contact: she hears nothing of it.
    carol
        .expect_none(
            |e| {
                e.name == "presence"
                    && !e
                        .get_attr("from")
                        .unwrap_or("")
                        .starts_with(&ts.jid("carol"))
            },
            Duration::from_millis(500),
        )
        .await;

    // And the pair is now a real subscription: bob's logout reaches alice.
    bob.presence(Some("unavailable"), None).await;
    alice
        .expect(|e| is_presence(e, &format!("{b}/r"), Some("unavailable")))
        .await;

    ts.unpair("alice", "bob").await;
    alice.expect(roster_push_for(&b, "remove")).await;
    ts.stop().await;
}

#[tokio::test]
async fn operator_migration_file_takes_effect_on_presenced_migrate() {
    let ts = TestServer::start(|_| {}).await;
    for u in ["ann", "ben", "cid"] {
        ts.user(u).await;
    }
    let mut ann = online(&ts, "ann").await;
    let mut cid = online(&ts, "cid").await;
    // An operator's migrations directory as older deployments kept it: copies of the
    // shipped PostgreSQL files (which the built-in schema already applied) plus their own
    // team file.
    let dir = std::env::temp_dir().join(format!("presenced-ops-{}", unique()));
    std::fs::create_dir_all(&dir).unwrap();
    let postgres = ts.shared().store.dialect() == presenced::store::Dialect::Postgres;
    if postgres {
        let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
        for f in std::fs::read_dir(&shipped).unwrap() {
            let f = f.unwrap();
            if f.path().is_file() {
                std::fs::copy(f.path(), dir.join(f.file_name())).unwrap();
            }
        }
    }
    let version = 1_000_000_000u64 + (rand_u32() as u64);
    // The README's team file, in the store's dialect.
    let team = if postgres {
        "SELECT presenced_roster_make_mutual(a.jid, b.jid)"
    } else {
        "INSERT INTO presenced_roster_make_mutual (a, b) SELECT a.jid, b.jid"
    };
    std::fs::write(
        dir.join(format!("{version}_team.sql")),
        format!(
            "{team}
             FROM accounts a JOIN accounts b ON a.jid < b.jid
             WHERE a.domain = '{d}' AND b.domain = '{d}';",
            d = ts.domain
        ),
    )
    .unwrap();
    let config = dir.join("presenced.toml");
    std::fs::write(
        &config,
        format!(
            "domains = [\"{}\"]\n[database]\nurl = \"{}\"\nmigrations = \"{}\"\n",
            ts.domain,
            database_url(),
            dir.display()
        ),
    )
    .unwrap();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_presenced"))
        .arg("--config")
        .arg(&config)
        .arg("migrate")
        // The file names the test store; the environment must not override it.
        .env_remove("DATABASE_URL")
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Everyone sees everyone: ann gets pushes for ben and cid, and cid's presence.
    ann.expect(roster_push_for(&ts.jid("ben"), "both")).await;
    ann.expect(roster_push_for(&ts.jid("cid"), "both")).await;
    cid.expect(roster_push_for(&ts.jid("ann"), "both")).await;
    ann.expect(|e| is_presence(e, &format!("{}/r", ts.jid("cid")), None))
        .await;
    cid.expect(|e| is_presence(e, &format!("{}/r", ts.jid("ann")), None))
        .await;
    let _ = std::fs::remove_dir_all(&dir);
    ts.stop().await;
}

fn rand_u32() -> u32 {
    u32::from_str_radix(&unique()[..8], 16).unwrap_or(7)
}

#[tokio::test]
async fn sql_unpair_withdraws_presence_even_from_clients_that_never_fetched_the_roster() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let (a, b) = (ts.jid("alice"), ts.jid("bob"));
    ts.make_mutual("alice", "bob").await;
    // Neither client asks for its roster (RFC 6121 §2.1.6: no pushes for them).
    let mut alice = online_without_roster(&ts, "alice").await;
    let mut bob = online_without_roster(&ts, "bob").await;
    // Control: they see each other.
    alice
        .expect(|e| is_presence(e, &format!("{b}/r"), None))
        .await;
    bob.expect(|e| is_presence(e, &format!("{a}/r"), None))
        .await;
    ts.unpair("alice", "bob").await;
    // From the resource each was shown (RFC 6121 §3.2.2): alice's login probe of the then
    // offline bob was answered with an unavailable from his bare JID, which is still in her
    // backlog and must not count as the withdrawal.
    alice
        .expect(|e| is_presence(e, &format!("{b}/r"), Some("unavailable")))
        .await;
    bob.expect(|e| is_presence(e, &format!("{a}/r"), Some("unavailable")))
        .await;
    ts.stop().await;
}

#[tokio::test]
async fn a_change_of_the_pending_request_alone_is_stored_but_not_pushed() {
    let ts = TestServer::start(|_| {}).await;
    for u in ["alice", "bob", "carol"] {
        ts.user(u).await;
    }
    let (a, c) = (ts.jid("alice"), ts.jid("carol"));
    let mut alice = online_without_roster(&ts, "alice").await;
    let mut bob = online(&ts, "bob").await;
    // bob keeps alice on his roster without any subscription.
    let set = presenced::protocol::xml::Element::new("query", NS_ROSTER)
        .child(presenced::protocol::xml::Element::new("item", NS_ROSTER).attr("jid", a.clone()));
    let r = bob.iq("set", None, set).await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    bob.expect(roster_push_for(&a, "none")).await;
    // alice asks: bob's item only gains a pending inbound request, which a roster item
    // does not show (RFC 6121 §2.1.2.5 ask is outbound only): the request is delivered,
    // no push follows (RFC 6121 Appendix A.3.1).
    alice.send(&presence_to("subscribe", &ts.jid("bob"))).await;
    bob.expect(|e| is_presence(e, &a, Some("subscribe"))).await;
    // Barrier: a later change of bob's roster made elsewhere reaches bob by the same
    // notification path that would replay an unpushed version, after it.
    ts.make_mutual("bob", "carol").await;
    bob.expect(roster_push_for(&c, "both")).await;
    assert!(
        !bob.backlog.iter().any(|e| e.name == "iq"
            && e.get_child("query", NS_ROSTER)
                .and_then(|q| q.get_child("item", NS_ROSTER))
                .is_some_and(|i| i.get_attr("jid") == Some(a.as_str()))),
        "a pending-in-only change was pushed: {:#?}",
        bob.backlog
    );
    ts.stop().await;
}

/// Logs in, asks for the roster with a version (XEP-0237) when `versioned`, and sends
/// initial presence.
async fn online_versioned(ts: &TestServer, name: &str, versioned: bool) -> Client {
    let query = presenced::protocol::xml::Element::new("query", NS_ROSTER).attr("ver", "");
    online_with_roster_query(ts, name, versioned.then_some(query)).await
}

#[tokio::test]
async fn sql_unpair_sends_both_users_each_others_unavailable_whatever_roster_they_fetched() {
    let ts = TestServer::start(|_| {}).await;
    // Both versioned, and one versioned with one that never asked.
    for (n, (av, bv)) in [(true, true), (true, false)].into_iter().enumerate() {
        let (an, bn) = (format!("alice{n}"), format!("bob{n}"));
        ts.user(&an).await;
        ts.user(&bn).await;
        let (a, b) = (ts.jid(&an), ts.jid(&bn));
        ts.make_mutual(&an, &bn).await;
        let mut alice = online_versioned(&ts, &an, av).await;
        let mut bob = online_versioned(&ts, &bn, bv).await;
        alice
            .expect(|e| is_presence(e, &format!("{b}/r"), None))
            .await;
        bob.expect(|e| is_presence(e, &format!("{a}/r"), None))
            .await;
        ts.unpair(&an, &bn).await;
        alice
            .expect(|e| is_presence(e, &format!("{b}/r"), Some("unavailable")))
            .await;
        bob.expect(|e| is_presence(e, &format!("{a}/r"), Some("unavailable")))
            .await;
        if av {
            alice.expect(roster_push_for(&b, "remove")).await;
        }
        if bv {
            bob.expect(roster_push_for(&a, "remove")).await;
        }
    }
    ts.stop().await;
}

#[tokio::test]
async fn a_change_made_by_another_connection_to_the_sqlite_file_reaches_online_users() {
    // Whatever PRESENCED_TEST_STORE says: this is about the SQLite change log.
    let file = common::stores::Db::sqlite().url();
    let url = file.clone();
    let ts = TestServer::start(move |c| c.database.url = url).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let mut alice = online(&ts, "alice").await;
    let mut bob = online(&ts, "bob").await;
    let (a, b) = (ts.jid("alice"), ts.jid("bob"));
    // As the sqlite3 shell would: its own connection, no server code involved.
    use sqlx::Connection as _;
    let mut shell = sqlx::SqliteConnection::connect(&file).await.unwrap();
    let started = std::time::Instant::now();
    sqlx::query("INSERT INTO presenced_roster_make_mutual (a, b) VALUES (?1, ?2)")
        .bind(&a)
        .bind(&b)
        .execute(&mut shell)
        .await
        .unwrap();
    alice.expect(roster_push_for(&b, "both")).await;
    bob.expect(roster_push_for(&a, "both")).await;
    alice
        .expect(|e| is_presence(e, &format!("{b}/r"), None))
        .await;
    // The change log is read every change_poll_interval (0.25 s by default); the rest is
    // the push itself, on a machine shared with other builds.
    let took = started.elapsed();
    assert!(took < Duration::from_secs(2), "{took:?}");
    sqlx::query("INSERT INTO presenced_roster_unpair (a, b) VALUES (?1, ?2)")
        .bind(&a)
        .bind(&b)
        .execute(&mut shell)
        .await
        .unwrap();
    alice.expect(roster_push_for(&b, "remove")).await;
    bob.expect(|e| is_presence(e, &format!("{a}/r"), Some("unavailable")))
        .await;
    shell.close().await.unwrap();
    ts.stop().await;
}
