//! Rosters managed by operators in SQL (issue 3): the documented SQL functions keep both
//! sides consistent, and users online when the change lands get the roster push and the
//! presence a client-made change would have produced.

mod common;

use common::*;
use presenced::xml::NS_ROSTER;
use std::time::Duration;

fn roster_push_for<'a>(
    contact: &'a str,
    sub: &'a str,
) -> impl Fn(&presenced::xml::Element) -> bool + 'a {
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

async fn online(ts: &TestServer, name: &str) -> Client {
    let mut c = ts.login(name, "r").await;
    c.iq(
        "get",
        None,
        presenced::xml::Element::new("query", NS_ROSTER),
    )
    .await;
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
    sqlx::query("SELECT presenced_roster_make_mutual($1, $2)")
        .bind(&a)
        .bind(&b)
        .execute(ts.shared().store.pool())
        .await
        .unwrap();
    alice.expect(roster_push_for(&b, "both")).await;
    bob.expect(roster_push_for(&a, "both")).await;
    alice
        .expect(|e| is_presence(e, &format!("{b}/r"), None))
        .await;
    bob.expect(|e| is_presence(e, &format!("{a}/r"), None))
        .await;
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

    sqlx::query("SELECT presenced_roster_unpair($1, $2)")
        .bind(&a)
        .bind(&b)
        .execute(ts.shared().store.pool())
        .await
        .unwrap();
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
    // An operator's migrations directory: the shipped files plus their own team file.
    let dir = std::env::temp_dir().join(format!("presenced-ops-{}", unique()));
    std::fs::create_dir_all(&dir).unwrap();
    let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
    for f in std::fs::read_dir(&shipped).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), dir.join(f.file_name())).unwrap();
    }
    let version = 1_000_000_000u64 + (rand_u32() as u64);
    std::fs::write(
        dir.join(format!("{version}_team.sql")),
        format!(
            "SELECT presenced_roster_make_mutual(a.jid, b.jid)
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
