//! `presenced copy-store`: a populated PostgreSQL database copied to an SQLite file and
//! from there to a second, empty PostgreSQL database holds exactly what it started with,
//! read back through the store. Each run uses databases of its own (created here and
//! dropped at the end), since a copy takes everything a database holds.

use std::time::Duration;

use chrono::{TimeZone, Utc};
use presenced::protocol::sasl::scram::ScramHash;
use presenced::services::presence::privacy::{PrivacySettings, Visibility};
use presenced::store::{LastSeen, RosterItem, Store, StoreError, Subscription};

#[path = "common/stores.rs"]
#[macro_use]
mod stores;

/// A database of its own on the test server: its URL and name.
fn fresh_pg_url() -> (String, String) {
    let name = format!("presenced_copy_{}", uuid::Uuid::new_v4().simple());
    (stores::postgres_url_for(&name), name)
}

async fn open(url: &str) -> Store {
    let store = Store::connect(url, 2).await.expect("connect");
    store
        .migrate(std::path::Path::new(""))
        .await
        .expect("schema");
    store
}

/// Everything a store holds about its accounts, through its API, in a comparable form.
async fn everything(store: &Store) -> Vec<String> {
    let mut out = Vec::new();
    for (name, value) in store.server_secrets().await.unwrap() {
        out.push(format!("secret {name} {value:?}"));
    }
    for (user, domain) in store.accounts().await.unwrap() {
        let jid = format!("{user}@{domain}");
        for hash in ScramHash::ALL {
            let c = store.scram_credentials(&user, &domain, hash).await.unwrap();
            out.push(format!("{jid} credentials {hash:?} {c:?}"));
        }
        let (_, items) = store.roster(&jid).await.unwrap();
        out.push(format!("{jid} roster {items:?}"));
        let pending = store.pending_subscriptions(&jid).await.unwrap();
        out.push(format!("{jid} pending {pending:?}"));
        out.push(format!(
            "{jid} blocks {:?}",
            store.blocklist(&jid).await.unwrap()
        ));
        let privacy = store.privacy_settings(&jid).await.unwrap();
        out.push(format!("{jid} privacy {privacy:?}"));
        out.push(format!(
            "{jid} seen {:?}",
            store.last_seen(&jid).await.unwrap()
        ));
        for (node, model) in store.pep_nodes(&jid).await.unwrap() {
            let items = store.pep_items(&jid, &node, &[], 100).await.unwrap();
            out.push(format!("{jid} pep {node} {model} {items:?}"));
        }
        out.push(format!(
            "{jid} vcard {:?}",
            store.vcard(&jid).await.unwrap()
        ));
        // Read without handing them out; the time compared to the microsecond, what
        // both stores keep.
        for (m, contact) in store.offline_messages(&jid).await.unwrap() {
            out.push(format!(
                "{jid} offline {} {} {contact} {}",
                m.sender,
                m.stanza,
                m.stored_at.timestamp_micros()
            ));
        }
    }
    out
}

async fn copy_store(from: &str, to: &str) {
    let example =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("presenced.example.toml");
    let cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_presenced"))
        .arg("--config")
        .arg(&example)
        .args(["copy-store", "--from", from, "--to", to])
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), cmd)
        .await
        .expect("copy-store finished in time")
        .expect("run presenced");
    assert!(
        out.status.success(),
        "copy-store {from} -> {to}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn copy_store_round_trips_a_populated_store_through_sqlite_and_back() {
    let (source_url, source_db) = fresh_pg_url();
    let (back_url, back_db) = fresh_pg_url();
    let lite = stores::Db::sqlite().url();
    let source = open(&source_url).await;
    let d = "copy.example";
    for u in ["alice", "bob", "carol"] {
        source.create_account(u, d, "pw", 1).await.unwrap();
    }
    let (alice, bob, carol) = (
        format!("alice@{d}"),
        format!("bob@{d}"),
        format!("carol@{d}"),
    );
    source.server_secret("scram_fake_salt").await.unwrap();
    source
        .upsert_roster_item(
            &alice,
            &RosterItem {
                name: Some("Bob ñ".into()),
                groups: vec!["Friends".into(), "Work".into()],
                subscription: Subscription::Both,
                ..RosterItem::new(jid::BareJid::new(&bob).unwrap())
            },
        )
        .await
        .unwrap();
    source
        .upsert_roster_item(
            &alice,
            &RosterItem {
                subscription: Subscription::None,
                pending_out: true,
                preapproved: true,
                ..RosterItem::new(jid::BareJid::new("dave@remote.example").unwrap())
            },
        )
        .await
        .unwrap();
    source
        .upsert_roster_item(
            &bob,
            &RosterItem {
                subscription: Subscription::To,
                pending_in: true,
                ..RosterItem::new(jid::BareJid::new(&alice).unwrap())
            },
        )
        .await
        .unwrap();
    for sender in ["zed@remote.example", "amy@remote.example"] {
        source
            .add_pending_subscription(
                &carol,
                sender,
                &format!(
                    "<presence from='{sender}' type='subscribe'><status>hi</status></presence>"
                ),
            )
            .await
            .unwrap();
    }
    source
        .block(
            &bob,
            &["spam.example".to_owned(), "eve@x.example/phone".to_owned()],
        )
        .await
        .unwrap();
    source
        .set_privacy_settings(
            &carol,
            &PrivacySettings {
                online: Visibility::ContactsExcept(
                    [jid::BareJid::new("boss@copy.example").unwrap()].into(),
                ),
                last_seen: Visibility::Nobody,
            },
        )
        .await
        .unwrap();
    let at = Utc
        .timestamp_opt(1_800_000_000, 123_456_000)
        .single()
        .unwrap();
    source
        .record_last_seen_batch(&[LastSeen {
            jid: jid::BareJid::new(&alice).unwrap(),
            at,
            status: Some("gone fishing".into()),
        }])
        .await
        .unwrap();
    // XEP-0163 items, in publication order, on two nodes with different access models.
    for (node, model, id) in [
        ("urn:xmpp:avatar:metadata", None, "a1"),
        ("urn:xmpp:avatar:metadata", None, "a2"),
        (
            "eu.siacs.conversations.axolotl.bundles:7",
            Some(presenced::store::pep::AccessModel::Open),
            "current",
        ),
    ] {
        let item = presenced::store::pep::PepItem {
            id: id.to_owned(),
            payload: format!("<x xmlns='urn:example'>{id} ñ</x>"),
        };
        source
            .pep_publish(&alice, node, model, &item)
            .await
            .unwrap();
    }
    // A XEP-0054 vCard (its photo is the avatar above).
    source
        .set_vcard(
            &bob,
            "<vCard xmlns='vcard-temp'><FN>Bob ñ</FN><NICKNAME>b</NICKNAME></vCard>",
        )
        .await
        .unwrap();
    // XEP-0160 messages kept for bob, from a contact and from a stranger.
    for (sender, contact, body) in [
        (format!("{alice}/phone"), true, "hi ñ"),
        ("x@remote.example".to_owned(), false, "who"),
    ] {
        let stanza = format!(
            "<message xmlns='jabber:client' from='{sender}' to='{bob}' type='chat'><body>{body}</body></message>"
        );
        assert!(source
            .store_offline_message(&bob, &sender, &stanza, contact)
            .await
            .unwrap());
    }
    let want = everything(&source).await;
    assert!(
        want.iter().any(|l| l.contains("<FN>Bob ñ</FN>")),
        "{want:?}"
    );
    assert_eq!(
        want.iter().filter(|l| l.contains(" offline ")).count(),
        2,
        "{want:?}"
    );
    assert!(want.len() > 20, "the source holds data: {want:?}");

    copy_store(&source_url, &lite).await;
    assert_eq!(
        everything(&open(&lite).await).await,
        want,
        "PostgreSQL -> SQLite"
    );
    copy_store(&lite, &back_url).await;
    let back = open(&back_url).await;
    assert_eq!(everything(&back).await, want, "SQLite -> PostgreSQL");

    // A destination that already holds the accounts is refused, not merged.
    let again = presenced::store::copy::copy(&open(&lite).await, &back).await;
    assert!(matches!(again, Err(StoreError::AccountExists)), "{again:?}");

    source.close().await;
    back.close().await;
    let admin = open(&stores::Db::postgres().url()).await;
    for db in [source_db, back_db] {
        sqlx::query(&format!("DROP DATABASE {db} WITH (FORCE)"))
            .execute(admin.pool())
            .await
            .unwrap();
    }
}
