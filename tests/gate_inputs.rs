//! The batched reads of the privacy gate (`Store::audience_inputs`, `Store::probe_inputs`)
//! on both stores (PostgreSQL at `DATABASE_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`, and a fresh SQLite file): for a world with
//! every subscription state, blocks in every XEP-0016 form and both directions, settings
//! and last seen, each batched field must equal what the single-decision reads
//! (`roster_item`, `is_blocked`, `privacy_settings`, `last_seen`) say. Each test uses its
//! own random domains.

use std::collections::BTreeSet;

use chrono::{TimeZone, Utc};
use presenced::protocol::jid::BareJid;
use presenced::services::presence::privacy::{PrivacySettings, Visibility};
use presenced::store::blocks::match_candidates;
use presenced::store::last_seen::LastSeen;
use presenced::store::{RosterItem, Store, Subscription};

#[path = "common/stores.rs"]
#[macro_use]
mod stores;
use stores::Db;

on_both_stores!(
    audience_inputs_equal_the_single_reads_for_every_contact,
    audience_inputs_of_a_user_without_roster_or_settings_are_empty_defaults,
    probe_inputs_equal_the_single_reads_for_every_subject_in_order,
    a_stored_contact_that_is_no_jid_is_left_out_of_the_audience,
    a_login_read_is_the_roster_and_the_audience_inputs_in_one,
);

fn domain(tag: &str) -> String {
    format!("t{}.{tag}.gate.test", uuid::Uuid::new_v4().simple())
}

async fn account(store: &Store, user: &str, d: &str) -> String {
    store
        .create_account(user, d, "pw", 1)
        .await
        .expect("create account");
    format!("{user}@{d}")
}

async fn item(store: &Store, owner: &str, contact: &str, sub: Subscription) {
    let mut i = RosterItem::new(BareJid::new(contact).expect("contact is a JID"));
    i.subscription = sub;
    store
        .upsert_roster_item(owner, &i)
        .await
        .expect("roster item");
}

/// Alice (the subject) and her contacts: every subscription state, a remote contact, and
/// blocks in each form and direction. Returns (alice, alice's full JID, contacts).
async fn world(store: &Store) -> (String, String, Vec<String>) {
    let d = domain("a");
    let other = domain("b");
    let remote = domain("remote");
    let alice = account(store, "alice", &d).await;
    let alice_full = format!("{alice}/phone");
    let bob = account(store, "bob", &d).await; // both; blocks alice's full JID
    let carol = account(store, "carol", &d).await; // from; alice blocks carol's bare JID
    let dave = account(store, "dave", &other).await; // to; alice blocks dave's domain
    let erin = account(store, "erin", &d).await; // none; blocks alice's domain/resource
    let frank = account(store, "frank", &d).await; // both; blocks alice's other resource
    let gina = account(store, "gina", &d).await; // both; blocks nobody; last seen known
    let remote_contact = format!("rita@{remote}");
    for (c, s) in [
        (&bob, Subscription::Both),
        (&carol, Subscription::From),
        (&dave, Subscription::To),
        (&erin, Subscription::None),
        (&frank, Subscription::Both),
        (&gina, Subscription::Both),
        (&remote_contact, Subscription::From),
    ] {
        item(store, &alice, c, s).await;
    }
    // The contacts' items for alice (what a probe from alice reads).
    for (c, s) in [
        (&bob, Subscription::Both),
        (&carol, Subscription::To),
        (&dave, Subscription::From),
        (&frank, Subscription::Both),
        (&gina, Subscription::Both),
    ] {
        item(store, c, &alice, s).await;
    }
    store
        .block(&bob, std::slice::from_ref(&alice_full))
        .await
        .unwrap();
    store
        .block(&alice, &[carol.clone(), other.clone()])
        .await
        .unwrap();
    store.block(&erin, &[format!("{d}/phone")]).await.unwrap();
    store
        .block(&frank, &[format!("{alice}/laptop")])
        .await
        .unwrap();
    let mut except = BTreeSet::new();
    except.insert(BareJid::new(&frank).unwrap());
    store
        .set_privacy_settings(
            &alice,
            &PrivacySettings {
                online: Visibility::ContactsExcept(except),
                last_seen: Visibility::Nobody,
            },
        )
        .await
        .unwrap();
    store
        .set_privacy_settings(
            &gina,
            &PrivacySettings {
                online: Visibility::Nobody,
                last_seen: Visibility::Subscribers,
            },
        )
        .await
        .unwrap();
    store
        .record_last_seen_batch(&[LastSeen {
            jid: BareJid::new(&gina).unwrap(),
            at: Utc.timestamp_opt(1_800_000_000, 0).single().unwrap(),
            status: None,
        }])
        .await
        .unwrap();
    let contacts = vec![bob, carol, dave, erin, frank, gina, remote_contact];
    (alice, alice_full, contacts)
}

async fn audience_inputs_equal_the_single_reads_for_every_contact(db: Db) {
    let store = db.open().await;
    let (alice, alice_full, contacts) = world(&store).await;
    let inputs = store
        .audience_inputs(&alice, &match_candidates(&alice_full))
        .await
        .expect("audience inputs");
    assert_eq!(
        inputs.settings,
        store.privacy_settings(&alice).await.unwrap()
    );
    let (_, roster) = store.roster(&alice).await.unwrap();
    assert_eq!(
        inputs
            .roster
            .iter()
            .map(|c| c.contact.as_str())
            .collect::<Vec<_>>(),
        roster
            .iter()
            .map(|i| i.contact.as_str())
            .collect::<Vec<_>>(),
        "the whole roster, in contact order"
    );
    let mut blocked_pairs = 0;
    for (c, i) in inputs.roster.iter().zip(&roster) {
        assert_eq!(c.subscription, i.subscription, "{}", c.contact);
        let by_contact = store
            .is_blocked(c.contact.as_str(), &alice_full)
            .await
            .unwrap();
        let by_alice = store.is_blocked(&alice, c.contact.as_str()).await.unwrap();
        assert_eq!(c.blocks_subject, by_contact, "{} blocks alice", c.contact);
        assert_eq!(c.blocked_by_subject, by_alice, "alice blocks {}", c.contact);
        blocked_pairs += usize::from(by_contact) + usize::from(by_alice);
    }
    // bob (full JID), erin (domain/resource), alice→carol (bare), alice→dave (domain).
    assert_eq!(blocked_pairs, 4, "the world has four matching blocks");
    assert_eq!(contacts.len(), roster.len());
}

/// `Store::login_roster` is the roster result (`Store::roster`) and the gate's inputs
/// (`Store::audience_inputs`) read as one, for a full world and for a user with nothing.
async fn a_login_read_is_the_roster_and_the_audience_inputs_in_one(db: Db) {
    let store = db.open().await;
    let (alice, alice_full, _) = world(&store).await;
    let lonely = account(&store, "lonely", &domain("lonely")).await;
    for (user, full) in [
        (alice.clone(), alice_full),
        (lonely.clone(), format!("{lonely}/r")),
    ] {
        let forms = match_candidates(&full);
        let before = store.calls();
        let login = store.login_roster(&user, &forms).await.expect("login read");
        let calls = store.calls_since(&before);
        assert_eq!(calls.into_iter().collect::<Vec<_>>(), [("login_roster", 1)]);
        let (version, items) = store.roster(&user).await.unwrap();
        assert_eq!(login.version, version, "{user}");
        assert_eq!(login.items, items, "{user}");
        assert_eq!(
            login.into_inputs(),
            store.audience_inputs(&user, &forms).await.unwrap(),
            "{user}"
        );
    }
    // A current version is answered from the version alone (XEP-0237 §2.3).
    let (version, _) = store.roster(&alice).await.unwrap();
    let before = store.calls();
    let since = store.roster_since(&alice, version).await.unwrap();
    assert_eq!(since, Some((version, Vec::new())));
    let calls = store.calls_since(&before);
    assert_eq!(
        calls.into_iter().collect::<Vec<_>>(),
        [("roster_version", 1)]
    );
}

async fn audience_inputs_of_a_user_without_roster_or_settings_are_empty_defaults(db: Db) {
    let store = db.open().await;
    let d = domain("lonely");
    let lonely = account(&store, "lonely", &d).await;
    let inputs = store
        .audience_inputs(&lonely, &match_candidates(&format!("{lonely}/r")))
        .await
        .expect("audience inputs");
    assert_eq!(inputs.settings, PrivacySettings::default());
    assert!(inputs.roster.is_empty());
}

async fn probe_inputs_equal_the_single_reads_for_every_subject_in_order(db: Db) {
    let store = db.open().await;
    let (alice, alice_full, mut subjects) = world(&store).await;
    subjects.push(format!("nobody@{}", domain("none")));
    let subjects: Vec<BareJid> = subjects.iter().map(|s| BareJid::new(s).unwrap()).collect();
    let rows = store
        .probe_inputs(
            &alice,
            &match_candidates(&alice_full),
            &subjects.iter().collect::<Vec<_>>(),
        )
        .await
        .expect("probe inputs");
    assert_eq!(rows.len(), subjects.len(), "one row per subject");
    // In the order asked: each row holds its own subject's inputs.
    for (subject, r) in subjects.iter().zip(&rows) {
        let s = subject.as_str();
        let item = store.roster_item(s, &alice).await.unwrap();
        assert_eq!(r.subscription, item.map(|i| i.subscription), "{s}'s item");
        assert_eq!(r.settings, store.privacy_settings(s).await.unwrap(), "{s}");
        assert_eq!(
            r.blocks_prober,
            store.is_blocked(s, &alice_full).await.unwrap(),
            "{s} blocks alice"
        );
        assert_eq!(
            r.blocked_by_prober,
            store.is_blocked(&alice, s).await.unwrap(),
            "alice blocks {s}"
        );
        assert_eq!(
            r.last_seen,
            store.last_seen(s).await.unwrap().map(|l| l.at),
            "{s} last seen"
        );
    }
    assert!(rows.iter().any(|r| r.last_seen.is_some()));
    assert!(rows
        .iter()
        .any(|r| r.settings != PrivacySettings::default()));
    assert!(store
        .probe_inputs(&alice, &[], &[])
        .await
        .unwrap()
        .is_empty());
}

/// A roster contact the schema admits but that is no JID (nodeprep refuses the space,
/// RFC 7622 §3.3) is left out of the gate's inputs: it is nobody's audience, and the
/// login does not probe it.
async fn a_stored_contact_that_is_no_jid_is_left_out_of_the_audience(db: Db) {
    let store = db.open().await;
    let d = domain("nojid");
    let alice = account(&store, "alice", &d).await;
    let bob = account(&store, "bob", &d).await;
    let broken = format!("not a jid@{d}");
    assert!(BareJid::new(&broken).is_err(), "{broken} must not parse");
    item(&store, &alice, &bob, Subscription::Both).await;
    // Written past the store's typed items, as an operator's SQL may.
    let written = match store.sqlite_pool() {
        None => sqlx::query(
            "INSERT INTO roster_items (owner, contact, subscription) VALUES ($1, $2, 'both')",
        )
        .bind(&alice)
        .bind(&broken)
        .execute(store.pool())
        .await
        .map(|r| r.rows_affected()),
        Some(pool) => sqlx::query(
            "INSERT INTO roster_items (owner, contact, subscription) VALUES (?1, ?2, 'both')",
        )
        .bind(&alice)
        .bind(&broken)
        .execute(pool)
        .await
        .map(|r| r.rows_affected()),
    };
    written.expect("the schema admits it");
    let inputs = store
        .audience_inputs(&alice, &match_candidates(&format!("{alice}/r")))
        .await
        .expect("audience inputs");
    assert_eq!(
        inputs
            .roster
            .iter()
            .map(|c| c.contact.to_string())
            .collect::<Vec<_>>(),
        vec![bob],
        "only the contact that is a JID"
    );
}
