//! Integration tests of last activity, block lists, privacy settings and the change
//! notifications: most run on both stores (modules `postgres` and `sqlite`, see
//! `common/stores.rs`), the LISTEN connection's failure handling on PostgreSQL
//! (`DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`) and the change
//! log's on SQLite. Every test works on its own random domain, so tests run in parallel
//! and leave other data alone; notifications from other tests are filtered out by owner.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use presenced::protocol::jid::{BareJid, Jid};
use presenced::services::presence::privacy::{PrivacySettings, Visibility};
use presenced::store::last_seen::LastSeen;
use presenced::store::notify::{
    self, parse_roster_notification, Notification, BLOCK_CHANNEL, PRIVACY_CHANNEL, ROSTER_CHANNEL,
};
use presenced::store::{Dialect, Store, StoreError};
use sqlx::Connection as _;
use tokio::sync::mpsc::Receiver;

/// SCRAM iterations for test accounts: credentials are not what these tests exercise, so
/// the cheapest allowed count keeps account creation fast.
const ITERATIONS: u32 = 1;

/// How long a notification may take to arrive before the test fails. Generous, because
/// the machine is shared; a passing test never waits for it.
const WAIT: Duration = Duration::from_secs(15);

fn url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// `url` with an application_name, so a test can find its own listener connection in
/// pg_stat_activity.
fn with_app_name(url: &str, name: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}application_name={name}")
}

async fn store() -> Store {
    let store = Store::connect(&url(), 4)
        .await
        .expect("connect to PostgreSQL");
    store
        .migrate(&Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations"))
        .await
        .expect("migrations apply");
    store
}

#[path = "common/stores.rs"]
#[macro_use]
mod stores;
use stores::{exec, Db};

on_both_stores!(
    last_seen_batch_is_one_write_and_newer_wins,
    last_seen_batch_skips_jids_that_are_not_accounts,
    block_unblock_and_unblock_all_round_trip,
    block_refuses_non_jids_and_unknown_owners,
    blocking_matches_jids_by_xep0016_rules,
    privacy_settings_round_trip_and_default_to_subscribers,
    schema_refuses_privacy_rows_with_two_readings,
    roster_change_made_in_sql_reaches_the_listener_with_its_owner_and_version,
    block_and_privacy_changes_notify_their_owner,
    operator_roster_add_is_mutual_with_name_groups_and_limits_and_remove_unpairs,
);

/// A domain no other test uses.
fn domain() -> String {
    format!("t{}.extra.test", uuid::Uuid::new_v4().simple())
}

/// Creates `user@d` and returns its bare JID.
async fn account(store: &Store, user: &str, d: &str) -> String {
    store
        .create_account(user, d, "pw", ITERATIONS)
        .await
        .expect("create account");
    format!("{user}@{d}")
}

/// A whole-second time (PostgreSQL keeps microseconds, chrono nanoseconds; whole
/// seconds compare equal after the round trip).
fn at(secs: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_800_000_000 + secs, 0)
        .single()
        .expect("valid timestamp")
}

fn seen(jid: &str, secs: i64, status: Option<&str>) -> LastSeen {
    LastSeen {
        jid: BareJid::new(jid).expect("a bare JID"),
        at: at(secs),
        status: status.map(str::to_owned),
    }
}

/// The transaction id that last wrote each row: rows written by one statement (run
/// outside an explicit transaction) share it.
async fn writer_xids(store: &Store, jids: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for jid in jids {
        let xid: String = sqlx::query_scalar("SELECT xmin::text FROM last_activity WHERE jid = $1")
            .bind(jid)
            .fetch_one(store.pool())
            .await
            .expect("row exists");
        out.push(xid);
    }
    out
}

async fn last_seen_batch_is_one_write_and_newer_wins(db: Db) {
    let store = db.open().await;
    let d = domain();
    let alice = account(&store, "alice", &d).await;
    let bob = account(&store, "bob", &d).await;
    let carol = account(&store, "carol", &d).await;

    // alice already has a newer time than the batch will bring.
    assert_eq!(
        store
            .record_last_seen_batch(&[seen(&alice, 100, Some("gone"))])
            .await
            .unwrap(),
        1
    );
    // PostgreSQL tells which transaction wrote a row; in SQLite one statement is one
    // transaction by construction.
    let pg = store.dialect() == Dialect::Postgres;
    let alice_xid_before = if pg {
        writer_xids(&store, &[&alice]).await
    } else {
        Vec::new()
    };

    let batch = [
        seen(&alice, 50, Some("stale")),
        seen(&bob, 10, Some("first")),
        // bob twice in one batch: the later entry wins, whatever the order.
        seen(&bob, 20, Some("second")),
        seen(&bob, 15, None),
        seen(&carol, 30, None),
    ];
    let changed = store.record_last_seen_batch(&batch).await.unwrap();
    assert_eq!(changed, 2, "bob and carol change, stale alice does not");

    assert_eq!(
        store.last_seen(&alice).await.unwrap(),
        Some(seen(&alice, 100, Some("gone")))
    );
    assert_eq!(
        store.last_seen(&bob).await.unwrap(),
        Some(seen(&bob, 20, Some("second")))
    );
    assert_eq!(
        store.last_seen(&carol).await.unwrap(),
        Some(seen(&carol, 30, None))
    );

    // One statement: bob's and carol's rows were written by the same transaction, and
    // alice's row was not rewritten by it.
    if pg {
        let xids = writer_xids(&store, &[&bob, &carol, &alice]).await;
        assert_eq!(xids[0], xids[1]);
        assert_eq!(vec![xids[2].clone()], alice_xid_before);
        assert_ne!(xids[0], xids[2]);
    }

    // A newer time moves the row forward and replaces the status, even with none.
    assert_eq!(
        store
            .record_last_seen_batch(&[seen(&alice, 200, None)])
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        store.last_seen(&alice).await.unwrap(),
        Some(seen(&alice, 200, None))
    );
    // The same time again is not newer.
    assert_eq!(
        store
            .record_last_seen_batch(&[seen(&alice, 200, Some("again"))])
            .await
            .unwrap(),
        0
    );
    assert_eq!(store.record_last_seen_batch(&[]).await.unwrap(), 0);
}

async fn last_seen_batch_skips_jids_that_are_not_accounts(db: Db) {
    let store = db.open().await;
    let d = domain();
    let alice = account(&store, "alice", &d).await;
    let ghost = format!("ghost@{d}");
    let remote = format!("alice@{}", domain());

    let changed = store
        .record_last_seen_batch(&[
            seen(&ghost, 1, None),
            seen(&alice, 2, Some("bye")),
            seen(&remote, 3, None),
        ])
        .await
        .unwrap();
    assert_eq!(changed, 1);
    assert_eq!(
        store.last_seen(&alice).await.unwrap(),
        Some(seen(&alice, 2, Some("bye")))
    );
    assert_eq!(store.last_seen(&ghost).await.unwrap(), None);
    assert_eq!(store.last_seen(&remote).await.unwrap(), None);

    // Deleting the account deletes its last activity.
    assert!(store
        .delete_account("alice", &d, std::slice::from_ref(&d))
        .await
        .unwrap()
        .is_some());
    assert_eq!(store.last_seen(&alice).await.unwrap(), None);
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_owned()).collect()
}

/// Block-list entries as the strings they are on the wire.
fn names(v: Vec<Jid>) -> Vec<String> {
    v.iter().map(|j| j.to_string()).collect()
}

async fn block_unblock_and_unblock_all_round_trip(db: Db) {
    let store = db.open().await;
    let d = domain();
    let alice = account(&store, "alice", &d).await;

    assert_eq!(
        names(store.blocklist(&alice).await.unwrap()),
        Vec::<String>::new()
    );
    let added = store
        .block(
            &alice,
            &strings(&["spam.example", "bob@b.example", "carol@c.example/laptop 2"]),
        )
        .await
        .unwrap();
    assert_eq!(
        names(added),
        strings(&["bob@b.example", "carol@c.example/laptop 2", "spam.example"])
    );
    // Only the new ones are reported (they are what the block push announces); a JID
    // repeated within one request counts once.
    let added = store
        .block(
            &alice,
            &strings(&["bob@b.example", "dave@d.example", "dave@d.example"]),
        )
        .await
        .unwrap();
    assert_eq!(names(added), strings(&["dave@d.example"]));
    assert_eq!(
        names(store.blocklist(&alice).await.unwrap()),
        strings(&[
            "bob@b.example",
            "carol@c.example/laptop 2",
            "dave@d.example",
            "spam.example"
        ])
    );

    let removed = store
        .unblock(&alice, &strings(&["bob@b.example", "never@b.example"]))
        .await
        .unwrap();
    assert_eq!(names(removed), strings(&["bob@b.example"]));
    assert_eq!(
        names(store.unblock(&alice, &[]).await.unwrap()),
        Vec::<String>::new()
    );
    assert_eq!(store.blocklist(&alice).await.unwrap().len(), 3);

    let removed = store.unblock_all(&alice).await.unwrap();
    assert_eq!(
        names(removed),
        strings(&["carol@c.example/laptop 2", "dave@d.example", "spam.example"])
    );
    assert_eq!(
        names(store.blocklist(&alice).await.unwrap()),
        Vec::<String>::new()
    );
    assert_eq!(
        names(store.unblock_all(&alice).await.unwrap()),
        Vec::<String>::new()
    );
}

async fn block_refuses_non_jids_and_unknown_owners(db: Db) {
    let store = db.open().await;
    let d = domain();
    let alice = account(&store, "alice", &d).await;
    for bad in [
        "",
        "a b@c.example",
        "a@b@c.example",
        "@c.example",
        "c.example/",
        " c.example",
    ] {
        let r = store.block(&alice, &strings(&["ok.example", bad])).await;
        assert!(
            matches!(r, Err(StoreError::Constraint(ref c)) if c == "blocklist_blocked_is_jid"),
            "{bad:?}: {r:?}"
        );
    }
    // A refused request changes nothing, not even its valid entries.
    assert_eq!(
        names(store.blocklist(&alice).await.unwrap()),
        Vec::<String>::new()
    );
    assert!(matches!(
        store
            .block(&format!("ghost@{d}"), &strings(&["x.example"]))
            .await,
        Err(StoreError::NoSuchAccount)
    ));
}

async fn blocking_matches_jids_by_xep0016_rules(db: Db) {
    let store = db.open().await;
    let d = domain();
    let alice = account(&store, "alice", &d).await;
    let other = account(&store, "other", &d).await;
    store
        .block(
            &alice,
            &strings(&[
                "evil.example",
                "bob@b.example",
                "carol@c.example/phone",
                "c.example/bot",
            ]),
        )
        .await
        .unwrap();

    let cases = [
        // A domain entry: the domain, its users, their resources, domain resources.
        ("evil.example", true),
        ("evil.example/r", true),
        ("mallory@evil.example", true),
        ("mallory@evil.example/x", true),
        ("sub.evil.example", false),
        ("mallory@sub.evil.example", false),
        // A bare entry: every resource of that user, nobody else on the domain.
        ("bob@b.example", true),
        ("bob@b.example/any", true),
        ("eve@b.example/any", false),
        ("b.example", false),
        // A full entry: that resource only.
        ("carol@c.example/phone", true),
        ("carol@c.example/laptop", false),
        ("carol@c.example", false),
        // A domain/resource entry: that resource at the domain.
        ("c.example/bot", true),
        ("dave@c.example/bot", true),
        ("c.example", false),
        ("c.example/human", false),
    ];
    for (jid, want) in cases {
        assert_eq!(store.is_blocked(&alice, jid).await.unwrap(), want, "{jid}");
        // Block lists are per owner.
        assert!(!store.is_blocked(&other, jid).await.unwrap(), "{jid}");
    }
}

async fn privacy_settings_round_trip_and_default_to_subscribers(db: Db) {
    let store = db.open().await;
    let d = domain();
    let alice = account(&store, "alice", &d).await;

    assert_eq!(
        store.privacy_settings(&alice).await.unwrap(),
        PrivacySettings::default()
    );
    let except: BTreeSet<_> = ["bob@b.example", "c.example"]
        .iter()
        .map(|j| presenced::protocol::jid::BareJid::new(j).unwrap())
        .collect();
    let settings = PrivacySettings {
        online: Visibility::ContactsExcept(except),
        last_seen: Visibility::Nobody,
    };
    store.set_privacy_settings(&alice, &settings).await.unwrap();
    assert_eq!(store.privacy_settings(&alice).await.unwrap(), settings);

    let swapped = PrivacySettings {
        online: Visibility::Nobody,
        last_seen: Visibility::ContactsExcept(BTreeSet::new()),
    };
    store.set_privacy_settings(&alice, &swapped).await.unwrap();
    assert_eq!(store.privacy_settings(&alice).await.unwrap(), swapped);

    store
        .set_privacy_settings(&alice, &PrivacySettings::default())
        .await
        .unwrap();
    assert_eq!(
        store.privacy_settings(&alice).await.unwrap(),
        PrivacySettings::default()
    );

    assert!(matches!(
        store
            .set_privacy_settings(&format!("ghost@{d}"), &settings)
            .await,
        Err(StoreError::NoSuchAccount)
    ));
}

async fn schema_refuses_privacy_rows_with_two_readings(db: Db) {
    let store = db.open().await;
    let d = domain();
    let alice = account(&store, "alice", &d).await;
    // The lists in each dialect's form: PostgreSQL arrays, SQLite JSON. SQLite checks an
    // exception list in one trigger for both lists, so it names that.
    let lite_list_check = "privacy_except_valid";
    let cases = [
        (
            "nobody",
            ("{bob@b.example}", r#"["bob@b.example"]"#),
            ("privacy_online_except_only_with_mode", None),
        ),
        ("everyone", ("{}", "[]"), ("privacy_online_valid", None)),
        (
            "contacts_except",
            ("{bob@b.example/res}", r#"["bob@b.example/res"]"#),
            ("privacy_online_except_valid", Some(lite_list_check)),
        ),
        (
            "contacts_except",
            (
                "{bob@b.example,bob@b.example}",
                r#"["bob@b.example","bob@b.example"]"#,
            ),
            ("privacy_online_except_valid", Some(lite_list_check)),
        ),
    ];
    for (mode, (pg_list, lite_list), (pg_constraint, lite_constraint)) in cases {
        let (except, constraint) = match store.dialect() {
            Dialect::Postgres => (pg_list, pg_constraint),
            Dialect::Sqlite => (lite_list, lite_constraint.unwrap_or(pg_constraint)),
        };
        let r = exec(
            &store,
            "INSERT INTO privacy_settings (owner, online, online_except) VALUES ($1, $2, $3::text[])",
            "INSERT INTO privacy_settings (owner, online, online_except) VALUES (?1, ?2, ?3)",
            &[&alice, mode, except],
        )
        .await
        .map_err(StoreError::from);
        assert!(
            matches!(r, Err(StoreError::Constraint(ref c)) if c == constraint),
            "{mode} {except}: {r:?}"
        );
    }
}

/// Next notification on `channel` whose payload satisfies `want`; others (other tests,
/// other channels) are skipped. Panics after [`WAIT`].
async fn next_matching(
    rx: &mut Receiver<Notification>,
    channel: &str,
    want: impl Fn(&str) -> bool,
) -> Notification {
    let found = tokio::time::timeout(WAIT, async {
        loop {
            let n = rx.recv().await.expect("listener task alive");
            if n.channel == channel && want(&n.payload) {
                return n;
            }
        }
    })
    .await;
    found.unwrap_or_else(|_| panic!("no notification on {channel} within {WAIT:?}"))
}

async fn roster_change_made_in_sql_reaches_the_listener_with_its_owner_and_version(db: Db) {
    let store = db.open().await;
    let d = domain();
    let alice = account(&store, "alice", &d).await;
    let bob = account(&store, "bob", &d).await;
    let mut rx = notify::listen(&db.url(), &[ROSTER_CHANNEL]).await.unwrap();

    // What an operator would run in a migration.
    stores::make_mutual(&store, &alice, &bob).await.unwrap();

    for owner in [&alice, &bob] {
        let (version, _) = store.roster(owner).await.unwrap();
        // The notification carrying the owner's current version arrives.
        let n = next_matching(&mut rx, ROSTER_CHANNEL, |p| {
            parse_roster_notification(p) == Some((version, owner.clone()))
        })
        .await;
        assert!(!n.is_resync());
    }
}

async fn block_and_privacy_changes_notify_their_owner(db: Db) {
    let store = db.open().await;
    let d = domain();
    let alice = account(&store, "alice", &d).await;
    let mut rx = notify::listen(&db.url(), &[BLOCK_CHANNEL, PRIVACY_CHANNEL])
        .await
        .unwrap();

    store.block(&alice, &strings(&["x.example"])).await.unwrap();
    next_matching(&mut rx, BLOCK_CHANNEL, |p| p == alice).await;
    store.unblock_all(&alice).await.unwrap();
    next_matching(&mut rx, BLOCK_CHANNEL, |p| p == alice).await;
    store
        .set_privacy_settings(
            &alice,
            &PrivacySettings {
                online: Visibility::Nobody,
                last_seen: Visibility::Subscribers,
            },
        )
        .await
        .unwrap();
    next_matching(&mut rx, PRIVACY_CHANNEL, |p| p == alice).await;
}

/// Backend pids of connections named `name`.
async fn backends(store: &Store, name: &str) -> Vec<i32> {
    sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE application_name = $1")
        .bind(name)
        .fetch_all(store.pool())
        .await
        .unwrap()
}

/// Ends backend `pid` as an administrator would (`pg_terminate_backend`); whether it was
/// signalled.
async fn terminate_backend(store: &Store, pid: i32) -> bool {
    sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(store.pool())
        .await
        .unwrap()
}

/// Polls until `backends(name)` satisfies `done`, failing after [`WAIT`].
async fn wait_for_backends(store: &Store, name: &str, done: impl Fn(&[i32]) -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if done(&backends(store, name).await) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "connections named {name} never reached the expected state"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn listener_survives_a_killed_connection_and_says_to_resync() {
    let store = store().await;
    let d = domain();
    let alice = account(&store, "alice", &d).await;
    let bob = account(&store, "bob", &d).await;
    let name = format!("presenced-test-{}", uuid::Uuid::new_v4().simple());
    let mut rx = notify::listen(&with_app_name(&url(), &name), &[ROSTER_CHANNEL])
        .await
        .unwrap();

    let pids = backends(&store, &name).await;
    assert_eq!(pids.len(), 1, "one listener connection");
    assert!(terminate_backend(&store, pids[0]).await);

    let marker = tokio::time::timeout(WAIT, async {
        loop {
            let n = rx.recv().await.expect("listener task alive");
            if n.is_resync() {
                return n;
            }
        }
    })
    .await
    .expect("resync marker after the connection was killed");
    assert!(marker.is_resync());
    let now = backends(&store, &name).await;
    assert_eq!(now.len(), 1, "reconnected with one connection");
    assert_ne!(now[0], pids[0]);

    // LISTEN is in place again when the marker arrives: a change made now is delivered.
    sqlx::query("SELECT presenced_roster_make_mutual($1, $2)")
        .bind(&alice)
        .bind(&bob)
        .execute(store.pool())
        .await
        .unwrap();
    let (version, _) = store.roster(&alice).await.unwrap();
    next_matching(&mut rx, ROSTER_CHANNEL, |p| {
        parse_roster_notification(p) == Some((version, alice.clone()))
    })
    .await;
}

#[tokio::test]
async fn dropping_the_receiver_closes_the_listener_connection() {
    let store = store().await;
    let name = format!("presenced-test-{}", uuid::Uuid::new_v4().simple());
    let rx = notify::listen(&with_app_name(&url(), &name), &[ROSTER_CHANNEL])
        .await
        .unwrap();
    assert_eq!(backends(&store, &name).await.len(), 1);
    drop(rx);
    wait_for_backends(&store, &name, |pids| pids.is_empty()).await;
}

/// Log lines the code under test writes, for waiting on an event that has no other
/// outside sign (a failed reconnect attempt).
#[derive(Clone, Default)]
struct CapturedLog(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for CapturedLog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .map_err(|_| std::io::Error::other("log lock poisoned"))?
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl CapturedLog {
    fn contains(&self, needle: &str) -> bool {
        let bytes = self.0.lock().expect("log lock").clone();
        String::from_utf8_lossy(&bytes).contains(needle)
    }
}

/// `url()` pointing at database `db` instead.
#[tokio::test]
async fn listener_retries_failed_reconnects_until_the_database_is_back() {
    // The default tokio test runtime runs the listener task on this thread, so a
    // thread-local subscriber sees its log lines.
    let log = CapturedLog::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    // A database of its own, because the test refuses all connections to it for a while.
    let store = store().await;
    let db = format!("presenced_listen_{}", uuid::Uuid::new_v4().simple());
    sqlx::query(&format!("CREATE DATABASE {db}"))
        .execute(store.pool())
        .await
        .unwrap();
    let name = format!("presenced-test-{}", uuid::Uuid::new_v4().simple());
    let options = notify::ListenOptions {
        backoff_min: Duration::from_millis(10),
        backoff_max: Duration::from_millis(100),
        ..notify::ListenOptions::default()
    };
    let mut rx = notify::listen_with(
        &with_app_name(&stores::postgres_url_for(&db), &name),
        &[ROSTER_CHANNEL],
        options,
    )
    .await
    .unwrap();

    sqlx::query(&format!("ALTER DATABASE {db} ALLOW_CONNECTIONS false"))
        .execute(store.pool())
        .await
        .unwrap();
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
    )
    .bind(&name)
    .execute(store.pool())
    .await
    .unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    while !log.contains("LISTEN reconnect failed") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no failed reconnect attempt logged"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    sqlx::query(&format!("ALTER DATABASE {db} ALLOW_CONNECTIONS true"))
        .execute(store.pool())
        .await
        .unwrap();

    let marker = tokio::time::timeout(WAIT, rx.recv())
        .await
        .expect("resync marker once the database accepts connections again")
        .expect("listener task alive");
    assert!(marker.is_resync(), "{marker:?}");
    let mut conn = sqlx::PgConnection::connect(&stores::postgres_url_for(&db))
        .await
        .unwrap();
    sqlx::query("SELECT pg_notify($1, '7 zed@z.example')")
        .bind(ROSTER_CHANNEL)
        .execute(&mut conn)
        .await
        .unwrap();
    let n = next_matching(&mut rx, ROSTER_CHANNEL, |_| true).await;
    assert_eq!(
        parse_roster_notification(&n.payload),
        Some((7, "zed@z.example".to_owned()))
    );

    drop(rx);
    drop(conn);
    sqlx::query(&format!("DROP DATABASE {db} WITH (FORCE)"))
        .execute(store.pool())
        .await
        .unwrap();
}

#[tokio::test]
async fn the_sqlite_poller_says_to_resync_when_changes_it_had_not_read_were_deleted() {
    let db = Db::sqlite();
    let store = db.open().await;
    let d = domain();
    let alice = account(&store, "alice", &d).await;
    let mut rx = notify::listen(&db.url(), &[BLOCK_CHANNEL]).await.unwrap();
    // In one transaction, so the poller sees it whole: a change it will never read (as if
    // pruned while it was behind), then one it can.
    let lite = store.sqlite_pool().expect("an SQLite store");
    let mut tx = lite.begin().await.unwrap();
    for q in [
        "INSERT INTO presenced_changes (channel, payload) VALUES ('presenced_block', 'lost@x')",
        "DELETE FROM presenced_changes WHERE payload = 'lost@x'",
        "INSERT INTO presenced_changes (channel, payload) VALUES ('presenced_block', ?1)",
    ] {
        sqlx::query(q).bind(&alice).execute(&mut *tx).await.unwrap();
    }
    tx.commit().await.unwrap();
    let first = tokio::time::timeout(WAIT, rx.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(first.is_resync(), "{first:?}");
    let next = tokio::time::timeout(WAIT, rx.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        next,
        Notification {
            channel: BLOCK_CHANNEL.to_owned(),
            payload: alice
        }
    );
}

async fn operator_roster_add_is_mutual_with_name_groups_and_limits_and_remove_unpairs(db: Db) {
    use presenced::store::Subscription;
    let store = db.open().await;
    let d = domain();
    let alice = account(&store, "alice", &d).await;
    let bob = account(&store, "bob", &d).await;
    let carol = account(&store, "carol", &d).await;
    // A request bob left waiting for alice goes with the pairing, as in the SQL operation.
    store
        .add_pending_subscription(&alice, &bob, "<presence type='subscribe'/>")
        .await
        .unwrap();
    let groups = vec!["Friends".to_owned(), "Work".to_owned()];
    store
        .roster_make_mutual(&alice, &bob, Some("Bobby"), &groups)
        .await
        .unwrap();
    let a = store.roster_item(&alice, &bob).await.unwrap().unwrap();
    assert_eq!(a.subscription, Subscription::Both);
    assert_eq!(a.name.as_deref(), Some("Bobby"));
    assert_eq!(a.groups, groups);
    let b = store.roster_item(&bob, &alice).await.unwrap().unwrap();
    assert_eq!(
        (b.subscription, b.name, b.groups),
        (Subscription::Both, None, vec![])
    );
    assert!(!store.has_pending_subscription(&alice, &bob).await.unwrap());
    // Again without name or groups: both are kept.
    store
        .roster_make_mutual(&alice, &bob, None, &[])
        .await
        .unwrap();
    let a = store.roster_item(&alice, &bob).await.unwrap().unwrap();
    assert_eq!((a.name.as_deref(), a.groups), (Some("Bobby"), groups));

    // A full roster takes no new item, on either side; nothing is half written.
    let mut limits = store.limits();
    limits.max_roster_items = 1;
    store.set_limits(limits);
    assert!(matches!(
        store.roster_make_mutual(&carol, &alice, None, &[]).await,
        Err(StoreError::RosterFull)
    ));
    assert!(store.roster_item(&carol, &alice).await.unwrap().is_none());
    // An existing pair is not a new item.
    store
        .roster_make_mutual(&bob, &alice, None, &[])
        .await
        .unwrap();

    assert!(store.roster_unpair(&alice, &bob).await.unwrap());
    assert!(store.roster_item(&alice, &bob).await.unwrap().is_none());
    assert!(store.roster_item(&bob, &alice).await.unwrap().is_none());
    assert!(!store.roster_unpair(&alice, &bob).await.unwrap());
}

/// Operators (and tests) tell presenced's PostgreSQL connections apart in
/// pg_stat_activity: the pool's are named `presenced`, the LISTEN connection
/// `presenced listener`, unless the URL names them itself.
#[tokio::test]
async fn the_stores_postgresql_connections_are_named_in_pg_stat_activity() {
    let admin = store().await;
    let db = format!("presenced_named_{}", uuid::Uuid::new_v4().simple());
    sqlx::query(&format!("CREATE DATABASE {db}"))
        .execute(admin.pool())
        .await
        .unwrap();
    let url = stores::postgres_url_for(&db);
    let store = Store::connect(&url, 2).await.expect("connect");
    let _rx = notify::listen(&url, &[ROSTER_CHANNEL]).await.unwrap();
    store.ping().await.expect("a pool connection");
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT application_name FROM pg_stat_activity WHERE datname = $1 \
         ORDER BY 1",
    )
    .bind(&db)
    .fetch_all(admin.pool())
    .await
    .unwrap();
    assert_eq!(
        names,
        [
            presenced::store::APPLICATION_NAME,
            notify::LISTENER_APPLICATION_NAME
        ]
    );
}

/// A store on `url()` whose one pooled connection is named `name`, with `recheck_idle`.
async fn named_store(name: &str, recheck_idle: Duration) -> Store {
    let config = presenced::config::DatabaseConfig {
        url: with_app_name(&url(), name),
        max_connections: 1,
        recheck_idle_secs: recheck_idle,
        ..Default::default()
    };
    Store::open(&config).await.unwrap()
}

/// Opens `name`'s one connection with a statement, kills its backend and waits until the
/// database no longer lists it; the killed backend's pid.
async fn kill_pooled_connection(observer: &Store, store: &Store, name: &str) -> i32 {
    store
        .ping()
        .await
        .expect("the first statement opens the connection");
    // Back in the pool, its check on return done. Killed during that check, the check
    // would find it dead and the pool would open another, whatever `recheck_idle` says.
    let deadline = tokio::time::Instant::now() + WAIT;
    while store.pool().num_idle() != 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the connection never went back idle"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let pids = backends(observer, name).await;
    assert_eq!(pids.len(), 1, "one pooled connection");
    assert!(terminate_backend(observer, pids[0]).await);
    wait_for_backends(observer, name, |now| now.is_empty()).await;
    pids[0]
}

#[tokio::test]
async fn a_pooled_connection_idle_past_the_recheck_is_checked_and_replaced_before_use() {
    let observer = store().await;
    let name = format!("presenced-test-{}", uuid::Uuid::new_v4().simple());
    let recheck = Duration::from_millis(100);
    let store = named_store(&name, recheck).await;
    let killed = kill_pooled_connection(&observer, &store, &name).await;
    // Idle for longer than the recheck bound whatever the kill took.
    tokio::time::sleep(recheck * 3).await;

    store
        .ping()
        .await
        .expect("the dead connection is found by the check and replaced, not used");
    let now = backends(&observer, &name).await;
    assert_eq!(now.len(), 1, "one connection again");
    assert_ne!(now[0], killed);
}

#[tokio::test]
async fn a_pooled_connection_used_within_the_recheck_is_taken_without_a_round_trip() {
    // The saving, seen through its one cost: a connection that died within the bound is
    // not checked before use, so the statement that takes it fails; the check on its
    // return closes it, and the next statement gets a new connection.
    let observer = store().await;
    let name = format!("presenced-test-{}", uuid::Uuid::new_v4().simple());
    let store = named_store(&name, Duration::from_secs(3_600)).await;
    let killed = kill_pooled_connection(&observer, &store, &name).await;

    assert!(
        store.ping().await.is_err(),
        "a connection idle for less than the bound is used as it is"
    );
    store
        .ping()
        .await
        .expect("the broken connection was closed on its return and replaced");
    let now = backends(&observer, &name).await;
    assert_eq!(now.len(), 1, "one connection again");
    assert_ne!(now[0], killed);
}
