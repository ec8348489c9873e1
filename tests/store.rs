//! Store integration tests, each run twice: against a real PostgreSQL (`DATABASE_URL`,
//! default `postgres://postgres@127.0.0.1:5432/test`; module `postgres`) and against a
//! fresh SQLite file (module `sqlite`). Every test works on its own random domain, so
//! tests run in parallel and leave other data alone.

use std::time::Duration;

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use presenced::protocol::jid::BareJid;
use presenced::protocol::sasl::scram::{self, ScramError, ScramHash, ScramServer};
use presenced::store::{notify, RosterChange, RosterItem, Store, StoreError, Subscription};
use sha1::Sha1;
use sha2::{Digest, Sha256};

/// Iterations for test accounts: RFC 7677's minimum, as a deployment would use.
const ITERATIONS: u32 = 4096;

#[path = "common/stores.rs"]
#[macro_use]
mod stores;
use stores::{exec, Db};

on_both_stores!(
    account_credentials_authenticate_through_scram_and_plain,
    a_server_secret_is_created_once_and_returned_unchanged_afterwards,
    duplicate_or_invalid_accounts_are_refused,
    set_password_replaces_credentials_and_delete_removes_them,
    roster_items_round_trip_with_every_field,
    roster_since_reports_only_changes_and_removals_as_tombstones,
    pruning_old_tombstones_makes_older_versions_unknown,
    recreated_account_does_not_accept_versions_of_the_old_one,
    schema_rejects_impossible_roster_states,
    a_stored_contact_that_is_no_jid_is_left_out_of_the_roster,
    subscription_change_updates_both_sides_atomically,
    operator_sql_keeps_versions_and_notifies,
    pending_subscriptions_are_kept_once_per_sender,
);

/// A domain no other test uses.
fn domain() -> String {
    format!("t{}.store.test", uuid::Uuid::new_v4().simple())
}

fn hmac(hash: ScramHash, key: &[u8], data: &[u8]) -> Vec<u8> {
    match hash {
        ScramHash::Sha1 => {
            let mut m = <Hmac<Sha1> as Mac>::new_from_slice(key).unwrap();
            m.update(data);
            m.finalize().into_bytes().to_vec()
        }
        ScramHash::Sha256 => {
            let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap();
            m.update(data);
            m.finalize().into_bytes().to_vec()
        }
    }
}

/// Logs in with SCRAM against the credentials the store returns, playing the client
/// side of RFC 5802 §3 here. Ok(true) means both sides authenticated each other.
async fn scram_login(
    store: &Store,
    hash: ScramHash,
    username: &str,
    domain: &str,
    password: &str,
) -> Result<bool, ScramError> {
    let client_first_bare = format!("n={username},r=clientnonce123");
    let mut server = ScramServer::new(hash).with_unknown_user_iterations(ITERATIONS);
    let first = server.client_first(format!("n,,{client_first_bare}").as_bytes())?;
    assert_eq!(first.username, username);
    let creds = store
        .scram_credentials(&first.username, domain, hash)
        .await
        .expect("credentials query");
    let server_first = String::from_utf8(server.server_first(creds.as_ref())).unwrap();

    let mut fields = server_first.split(',');
    let nonce = fields.next().unwrap().strip_prefix("r=").unwrap();
    let salt = BASE64
        .decode(fields.next().unwrap().strip_prefix("s=").unwrap())
        .unwrap();
    let iterations: u32 = fields
        .next()
        .unwrap()
        .strip_prefix("i=")
        .unwrap()
        .parse()
        .unwrap();
    let mut salted = vec![0u8; hash.output_len()];
    match hash {
        ScramHash::Sha1 => {
            pbkdf2::pbkdf2_hmac::<Sha1>(password.as_bytes(), &salt, iterations, &mut salted)
        }
        ScramHash::Sha256 => {
            pbkdf2::pbkdf2_hmac::<Sha256>(password.as_bytes(), &salt, iterations, &mut salted)
        }
    }
    let client_key = hmac(hash, &salted, b"Client Key");
    let stored_key = match hash {
        ScramHash::Sha1 => Sha1::digest(&client_key).to_vec(),
        ScramHash::Sha256 => Sha256::digest(&client_key).to_vec(),
    };
    let without_proof = format!("c=biws,r={nonce}");
    let auth_message = format!("{client_first_bare},{server_first},{without_proof}");
    let signature = hmac(hash, &stored_key, auth_message.as_bytes());
    let proof: Vec<u8> = client_key
        .iter()
        .zip(&signature)
        .map(|(a, b)| a ^ b)
        .collect();
    let server_final =
        server.client_final(format!("{without_proof},p={}", BASE64.encode(proof)).as_bytes())?;
    let server_key = hmac(hash, &salted, b"Server Key");
    let expected = format!(
        "v={}",
        BASE64.encode(hmac(hash, &server_key, auth_message.as_bytes()))
    );
    Ok(server_final == expected.as_bytes())
}

async fn account_credentials_authenticate_through_scram_and_plain(db: Db) {
    let store = db.open().await;
    let d = domain();
    store
        .create_account("alice", &d, "pencil", ITERATIONS)
        .await
        .unwrap();
    assert!(store.account_exists("alice", &d).await.unwrap());
    assert!(!store.account_exists("bob", &d).await.unwrap());

    for hash in ScramHash::ALL {
        assert_eq!(
            scram_login(&store, hash, "alice", &d, "pencil").await,
            Ok(true)
        );
        assert_eq!(
            scram_login(&store, hash, "alice", &d, "pencil2").await,
            Err(ScramError::InvalidProof)
        );
        // Unknown user: the exchange runs to the end and fails like a wrong password.
        assert_eq!(
            scram_login(&store, hash, "nobody", &d, "pencil").await,
            Err(ScramError::InvalidProof)
        );
        let creds = store
            .scram_credentials("alice", &d, hash)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(creds.iterations, ITERATIONS);
        assert_eq!(creds.salt.len(), scram::SALT_LEN);
        assert!(scram::verify_plain(hash, &creds, "pencil"));
        assert!(!scram::verify_plain(hash, &creds, "Pencil"));
    }
    // Each hash has its own salt.
    let s1 = store
        .scram_credentials("alice", &d, ScramHash::Sha1)
        .await
        .unwrap()
        .unwrap();
    let s256 = store
        .scram_credentials("alice", &d, ScramHash::Sha256)
        .await
        .unwrap()
        .unwrap();
    assert_ne!(s1.salt, s256.salt);
}

async fn a_server_secret_is_created_once_and_returned_unchanged_afterwards(db: Db) {
    let name = format!("test-{}", domain());
    let first = db.open().await.server_secret(&name).await.expect("secret");
    assert!(first.len() >= 32, "{} bytes", first.len());
    // Another connection pool, as after a restart or on another node.
    let again = db.open().await.server_secret(&name).await.expect("secret");
    assert_eq!(first, again);
    let other = db
        .open()
        .await
        .server_secret(&format!("{name}-other"))
        .await
        .expect("secret");
    assert_ne!(first, other, "each name has its own random secret");
}

async fn duplicate_or_invalid_accounts_are_refused(db: Db) {
    let store = db.open().await;
    let d = domain();
    store
        .create_account("alice", &d, "pw", ITERATIONS)
        .await
        .unwrap();
    assert!(matches!(
        store.create_account("alice", &d, "other", ITERATIONS).await,
        Err(StoreError::AccountExists)
    ));
    // The same username on another domain is another account.
    store
        .create_account("alice", &domain(), "pw", ITERATIONS)
        .await
        .unwrap();
    assert!(matches!(
        store.create_account("bob", &d, "", ITERATIONS).await,
        Err(StoreError::InvalidPassword)
    ));
    assert!(matches!(
        store
            .create_account("bob", &d, "bell\u{0007}", ITERATIONS)
            .await,
        Err(StoreError::InvalidPassword)
    ));
    assert!(matches!(
        store.create_account("bob", &d, "pw", 0).await,
        Err(StoreError::InvalidIterations)
    ));
    match store.create_account("bo@b", &d, "pw", ITERATIONS).await {
        Err(StoreError::Constraint(c)) => assert_eq!(c, "accounts_username_valid"),
        other => panic!("expected constraint error, got {other:?}"),
    }
    assert!(!store.account_exists("bob", &d).await.unwrap());
}

async fn set_password_replaces_credentials_and_delete_removes_them(db: Db) {
    let store = db.open().await;
    let d = domain();
    store
        .create_account("carol", &d, "old", ITERATIONS)
        .await
        .unwrap();
    let before = store
        .scram_credentials("carol", &d, ScramHash::Sha256)
        .await
        .unwrap()
        .unwrap();
    assert!(store
        .set_password("carol", &d, "new", ITERATIONS)
        .await
        .unwrap());
    let after = store
        .scram_credentials("carol", &d, ScramHash::Sha256)
        .await
        .unwrap()
        .unwrap();
    assert_ne!(before.salt, after.salt, "a new password gets a new salt");
    assert_eq!(
        scram_login(&store, ScramHash::Sha1, "carol", &d, "new").await,
        Ok(true)
    );
    assert_eq!(
        scram_login(&store, ScramHash::Sha1, "carol", &d, "old").await,
        Err(ScramError::InvalidProof)
    );
    assert!(!store
        .set_password("nobody", &d, "x", ITERATIONS)
        .await
        .unwrap());

    assert!(store
        .delete_account("carol", &d, std::slice::from_ref(&d))
        .await
        .unwrap()
        .is_some());
    assert!(store
        .delete_account("carol", &d, std::slice::from_ref(&d))
        .await
        .unwrap()
        .is_none());
    assert!(!store.account_exists("carol", &d).await.unwrap());
    assert!(store
        .scram_credentials("carol", &d, ScramHash::Sha256)
        .await
        .unwrap()
        .is_none());
}

fn bare(jid: &str) -> BareJid {
    BareJid::new(jid).expect("a bare JID")
}

fn item(contact: &str) -> RosterItem {
    RosterItem::new(bare(contact))
}

async fn roster_items_round_trip_with_every_field(db: Db) {
    let store = db.open().await;
    let d = domain();
    store
        .create_account("alice", &d, "pw", ITERATIONS)
        .await
        .unwrap();
    let owner = format!("alice@{d}");
    let mut bob = item("bob@remote.example");
    bob.name = Some("Bob".into());
    bob.groups = vec!["Friends".into(), "Work".into()];
    bob.subscription = Subscription::From;
    bob.pending_out = true;
    store.upsert_roster_item(&owner, &bob).await.unwrap();
    let mut carol = item("carol@remote.example");
    carol.subscription = Subscription::To;
    carol.pending_in = true;
    store.upsert_roster_item(&owner, &carol).await.unwrap();
    let mut dave = item("remote.example");
    dave.preapproved = true;
    store.upsert_roster_item(&owner, &dave).await.unwrap();

    assert_eq!(
        store
            .roster_item(&owner, "bob@remote.example")
            .await
            .unwrap(),
        Some(bob.clone())
    );
    assert_eq!(store.roster_count(&owner).await.unwrap(), 3);
    let (_, items) = store.roster(&owner).await.unwrap();
    assert_eq!(items, vec![bob.clone(), carol, dave]);

    // An upsert replaces every field, including clearing name and groups.
    let mut bob2 = item("bob@remote.example");
    bob2.subscription = Subscription::Both;
    store.upsert_roster_item(&owner, &bob2).await.unwrap();
    assert_eq!(
        store
            .roster_item(&owner, "bob@remote.example")
            .await
            .unwrap(),
        Some(bob2)
    );
    assert_eq!(
        store
            .roster_item(&owner, "nobody@remote.example")
            .await
            .unwrap(),
        None
    );
}

async fn roster_since_reports_only_changes_and_removals_as_tombstones(db: Db) {
    let store = db.open().await;
    let d = domain();
    store
        .create_account("alice", &d, "pw", ITERATIONS)
        .await
        .unwrap();
    let owner = format!("alice@{d}");

    let (v0, items) = store.roster(&owner).await.unwrap();
    assert!(items.is_empty());
    assert_eq!(
        store.roster_since(&owner, v0).await.unwrap(),
        Some((v0, vec![]))
    );

    let v1 = store
        .upsert_roster_item(&owner, &item("bob@x.example"))
        .await
        .unwrap();
    assert!(v1 > v0);
    let v2 = store
        .upsert_roster_item(&owner, &item("carol@x.example"))
        .await
        .unwrap();
    assert!(v2 > v1);
    assert_eq!(store.roster(&owner).await.unwrap().0, v2);

    assert_eq!(
        store.roster_since(&owner, v0).await.unwrap(),
        Some((
            v2,
            vec![
                RosterChange::Upsert(item("bob@x.example")),
                RosterChange::Upsert(item("carol@x.example"))
            ]
        ))
    );
    assert_eq!(
        store.roster_since(&owner, v1).await.unwrap(),
        Some((v2, vec![RosterChange::Upsert(item("carol@x.example"))]))
    );

    let v3 = store
        .remove_roster_item(&owner, "bob@x.example")
        .await
        .unwrap()
        .expect("bob was there");
    assert!(v3 > v2);
    assert_eq!(
        store.roster_since(&owner, v2).await.unwrap(),
        Some((v3, vec![RosterChange::Removed(bare("bob@x.example"))]))
    );
    // A client at the removal's own version already knows about it.
    assert_eq!(
        store.roster_since(&owner, v3).await.unwrap(),
        Some((v3, vec![]))
    );
    // From the start: bob's addition is gone, only his removal is reported.
    assert_eq!(
        store.roster_since(&owner, v0).await.unwrap(),
        Some((
            v3,
            vec![
                RosterChange::Upsert(item("carol@x.example")),
                RosterChange::Removed(bare("bob@x.example"))
            ]
        ))
    );

    // Removing an absent item changes nothing.
    assert_eq!(
        store
            .remove_roster_item(&owner, "bob@x.example")
            .await
            .unwrap(),
        None
    );
    assert_eq!(store.roster(&owner).await.unwrap().0, v3);

    // Re-adding replaces the tombstone.
    let v4 = store
        .upsert_roster_item(&owner, &item("bob@x.example"))
        .await
        .unwrap();
    assert_eq!(
        store.roster_since(&owner, v3).await.unwrap(),
        Some((v4, vec![RosterChange::Upsert(item("bob@x.example"))]))
    );

    // Versions this roster never had: the caller must send the full roster.
    assert_eq!(store.roster_since(&owner, v4 + 1).await.unwrap(), None);
    assert_eq!(store.roster_since(&owner, v0 - 1).await.unwrap(), None);
    assert_eq!(
        store.roster_since("nobody@x.example", v0).await.unwrap(),
        None
    );
}

async fn pruning_old_tombstones_makes_older_versions_unknown(db: Db) {
    let store = db.open().await;
    let d = domain();
    store
        .create_account("alice", &d, "pw", ITERATIONS)
        .await
        .unwrap();
    let owner = format!("alice@{d}");
    let v1 = store
        .upsert_roster_item(&owner, &item("bob@x.example"))
        .await
        .unwrap();
    store
        .upsert_roster_item(&owner, &item("carol@x.example"))
        .await
        .unwrap();
    let v3 = store
        .remove_roster_item(&owner, "bob@x.example")
        .await
        .unwrap()
        .unwrap();
    let v4 = store
        .remove_roster_item(&owner, "carol@x.example")
        .await
        .unwrap()
        .unwrap();
    // Age bob's tombstone only; other tests' tombstones are fresh and stay.
    exec(
        &store,
        "UPDATE roster_tombstones SET removed_at = now() - interval '30 days'
         WHERE owner = $1 AND contact = 'bob@x.example'",
        "UPDATE roster_tombstones
         SET removed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-30 days')
         WHERE owner = ?1 AND contact = 'bob@x.example'",
        &[&owner],
    )
    .await
    .unwrap();

    let pruned = store
        .prune_roster_tombstones(Duration::from_secs(7 * 24 * 3600))
        .await
        .unwrap();
    assert!(pruned >= 1);
    // A client from before bob's removal would miss it: it must get the full roster.
    assert_eq!(store.roster_since(&owner, v1).await.unwrap(), None);
    // From bob's removal on, carol's tombstone still tells the whole story.
    assert_eq!(
        store.roster_since(&owner, v3).await.unwrap(),
        Some((v4, vec![RosterChange::Removed(bare("carol@x.example"))]))
    );
}

async fn recreated_account_does_not_accept_versions_of_the_old_one(db: Db) {
    let store = db.open().await;
    let d = domain();
    let owner = format!("alice@{d}");
    store
        .create_account("alice", &d, "pw", ITERATIONS)
        .await
        .unwrap();
    let old = store
        .upsert_roster_item(&owner, &item("bob@x.example"))
        .await
        .unwrap();
    store
        .add_pending_subscription(&owner, "eve@x.example", "<presence type='subscribe'/>")
        .await
        .unwrap();

    assert!(store
        .delete_account("alice", &d, std::slice::from_ref(&d))
        .await
        .unwrap()
        .is_some());
    assert_eq!(store.roster(&owner).await.unwrap(), (0, vec![]));
    assert!(store
        .pending_subscriptions(&owner)
        .await
        .unwrap()
        .is_empty());

    store
        .create_account("alice", &d, "pw", ITERATIONS)
        .await
        .unwrap();
    assert_eq!(store.roster_since(&owner, old).await.unwrap(), None);
    assert!(store.roster(&owner).await.unwrap().1.is_empty());
}

async fn schema_rejects_impossible_roster_states(db: Db) {
    let store = db.open().await;
    let d = domain();
    store
        .create_account("alice", &d, "pw", ITERATIONS)
        .await
        .unwrap();
    let owner = format!("alice@{d}");
    let (v0, _) = store.roster(&owner).await.unwrap();

    // Raw SQL, as an operator might write it: the CHECK stops it.
    for (column, value, constraint) in [
        ("subscription", "bogus", "roster_subscription_valid"),
        ("ask", "unsubscribe", "roster_ask_valid"),
    ] {
        let err = exec(
            &store,
            &format!("INSERT INTO roster_items (owner, contact, {column}) VALUES ($1, 'bob@x.example', $2)"),
            &format!("INSERT INTO roster_items (owner, contact, {column}) VALUES (?1, 'bob@x.example', ?2)"),
            &[&owner, value],
        )
        .await
        .unwrap_err();
        match StoreError::from(err) {
            StoreError::Constraint(c) => assert_eq!(c, constraint),
            other => panic!("{column} = {value}: {other:?}"),
        }
    }
    // A contact that is no bare JID cannot be a typed item; the schema refuses it too.
    for contact in ["b@x.example/phone", "@x.example"] {
        let err = exec(
            &store,
            "INSERT INTO roster_items (owner, contact) VALUES ($1, $2)",
            "INSERT INTO roster_items (owner, contact) VALUES (?1, ?2)",
            &[&owner, contact],
        )
        .await
        .unwrap_err();
        match StoreError::from(err) {
            StoreError::Constraint(c) => assert_eq!(c, "roster_contact_is_bare_jid"),
            other => panic!("contact {contact}: {other:?}"),
        }
    }

    // Through the API, states outside RFC 6121 Appendix A are refused by name.
    let cases: Vec<(RosterItem, &str)> = vec![
        (
            RosterItem {
                subscription: Subscription::Both,
                pending_out: true,
                ..item("b@x.example")
            },
            "roster_ask_without_to",
        ),
        (
            RosterItem {
                subscription: Subscription::From,
                pending_in: true,
                ..item("b@x.example")
            },
            "roster_pending_in_without_from",
        ),
        (
            RosterItem {
                subscription: Subscription::From,
                preapproved: true,
                ..item("b@x.example")
            },
            "roster_preapproved_states",
        ),
        (
            RosterItem {
                groups: vec!["A".into(), "A".into()],
                ..item("b@x.example")
            },
            "roster_groups_valid",
        ),
        (
            RosterItem {
                groups: vec!["".into()],
                ..item("b@x.example")
            },
            "roster_groups_valid",
        ),
    ];
    for (bad, constraint) in cases {
        match store.upsert_roster_item(&owner, &bad).await {
            Err(StoreError::Constraint(c)) => assert_eq!(c, constraint, "{bad:?}"),
            other => panic!("{bad:?} gave {other:?}"),
        }
    }
    assert!(matches!(
        store
            .upsert_roster_item(&format!("nobody@{d}"), &item("b@x.example"))
            .await,
        Err(StoreError::NoSuchAccount)
    ));
    // Nothing was stored, and the version did not move for refused changes.
    assert_eq!(store.roster(&owner).await.unwrap(), (v0, vec![]));
}

/// A contact the schema admits but that is no JID (nodeprep refuses the space, RFC 7622
/// §3.3), written by raw SQL as an operator might: every roster read leaves the row out,
/// as the gate's inputs do, and the contacts that are JIDs are served as before.
async fn a_stored_contact_that_is_no_jid_is_left_out_of_the_roster(db: Db) {
    let store = db.open().await;
    let d = domain();
    store
        .create_account("alice", &d, "pw", ITERATIONS)
        .await
        .unwrap();
    let owner = format!("alice@{d}");
    let broken = format!("not a jid@{d}");
    let bob = format!("bob@{d}");
    let (before, _) = store.roster(&owner).await.unwrap();
    for contact in [&broken, &bob] {
        exec(
            &store,
            "INSERT INTO roster_items (owner, contact, subscription) VALUES ($1, $2, 'both')",
            "INSERT INTO roster_items (owner, contact, subscription) VALUES (?1, ?2, 'both')",
            &[&owner, contact],
        )
        .await
        .expect("the schema admits both");
    }
    let contacts = |items: &[RosterItem]| {
        items
            .iter()
            .map(|i| i.contact.to_string())
            .collect::<Vec<_>>()
    };
    let (version, items) = store.roster(&owner).await.unwrap();
    assert_eq!(contacts(&items), vec![bob.clone()], "roster");
    assert_eq!(store.roster_item(&owner, &broken).await.unwrap(), None);
    assert!(store.roster_item(&owner, &bob).await.unwrap().is_some());
    let (_, changes) = store
        .roster_since(&owner, before)
        .await
        .unwrap()
        .expect("diff");
    let changed: Vec<RosterItem> = changes
        .into_iter()
        .filter_map(|c| match c {
            RosterChange::Upsert(i) => Some(i),
            RosterChange::Removed(_) => None,
        })
        .collect();
    assert_eq!(contacts(&changed), vec![bob.clone()], "roster since before");

    // Its tombstone is left out of a diff as well.
    exec(
        &store,
        "DELETE FROM roster_items WHERE owner = $1 AND contact = $2",
        "DELETE FROM roster_items WHERE owner = ?1 AND contact = ?2",
        &[&owner, &broken],
    )
    .await
    .unwrap();
    let (_, changes) = store
        .roster_since(&owner, version)
        .await
        .unwrap()
        .expect("diff");
    assert!(changes.is_empty(), "{changes:?}");
}

async fn subscription_change_updates_both_sides_atomically(db: Db) {
    let store = db.open().await;
    let d = domain();
    store
        .create_account("alice", &d, "pw", ITERATIONS)
        .await
        .unwrap();
    store
        .create_account("bob", &d, "pw", ITERATIONS)
        .await
        .unwrap();
    let (alice, bob) = (format!("alice@{d}"), format!("bob@{d}"));
    let (va0, _) = store.roster(&alice).await.unwrap();

    // alice subscribes to bob: alice None+PendingOut, bob None+PendingIn.
    let changes = vec![
        (
            alice.clone(),
            RosterItem {
                pending_out: true,
                ..item(&bob)
            },
        ),
        (
            bob.clone(),
            RosterItem {
                pending_in: true,
                ..item(&alice)
            },
        ),
    ];
    let versions = store.apply_subscription_change(&changes).await.unwrap();
    assert_eq!(versions.len(), 2);
    assert_eq!(versions[0].0, alice);
    assert_eq!(versions[1].0, bob);
    assert_eq!(store.roster(&alice).await.unwrap().0, versions[0].1);
    assert_eq!(store.roster(&bob).await.unwrap().0, versions[1].1);
    assert_eq!(
        store.roster_since(&alice, va0).await.unwrap().unwrap().1,
        vec![RosterChange::Upsert(changes[0].1.clone())]
    );

    // If one side is refused, neither side changes.
    let bad = vec![
        (
            alice.clone(),
            RosterItem {
                subscription: Subscription::To,
                ..item(&bob)
            },
        ),
        (
            bob.clone(),
            RosterItem {
                subscription: Subscription::From,
                pending_in: true,
                ..item(&alice)
            },
        ),
    ];
    assert!(matches!(
        store.apply_subscription_change(&bad).await,
        Err(StoreError::Constraint(_))
    ));
    assert_eq!(
        store.roster_item(&alice, &bob).await.unwrap(),
        Some(changes[0].1.clone())
    );
    assert_eq!(store.roster(&alice).await.unwrap().0, versions[0].1);

    // Two changes for the same owner in one call report the later version.
    let twice = vec![
        (
            bob.clone(),
            RosterItem {
                subscription: Subscription::From,
                ..item(&alice)
            },
        ),
        (
            alice.clone(),
            RosterItem {
                subscription: Subscription::To,
                ..item(&bob)
            },
        ),
        (
            bob.clone(),
            RosterItem {
                subscription: Subscription::From,
                name: Some("A".into()),
                ..item(&alice)
            },
        ),
    ];
    let v = store.apply_subscription_change(&twice).await.unwrap();
    assert_eq!(
        v.iter().map(|(o, _)| o.as_str()).collect::<Vec<_>>(),
        [bob.as_str(), alice.as_str()]
    );
    assert_eq!(store.roster(&bob).await.unwrap().0, v[0].1);
    assert_eq!(
        store
            .roster_item(&bob, &alice)
            .await
            .unwrap()
            .unwrap()
            .name
            .as_deref(),
        Some("A")
    );
}

async fn operator_sql_keeps_versions_and_notifies(db: Db) {
    let store = db.open().await;
    let d = domain();
    store
        .create_account("alice", &d, "pw", ITERATIONS)
        .await
        .unwrap();
    store
        .create_account("bob", &d, "pw", ITERATIONS)
        .await
        .unwrap();
    let (alice, bob) = (format!("alice@{d}"), format!("bob@{d}"));
    let (va0, _) = store.roster(&alice).await.unwrap();

    let mut listener = notify::listen(&db.url(), &[notify::ROSTER_CHANNEL])
        .await
        .unwrap();

    stores::make_mutual(&store, &alice, &bob).await.unwrap();
    let both = |c: &str| RosterItem {
        subscription: Subscription::Both,
        ..item(c)
    };
    let (va1, changes) = store.roster_since(&alice, va0).await.unwrap().unwrap();
    assert_eq!(changes, vec![RosterChange::Upsert(both(&bob))]);
    assert_eq!(
        store.roster_item(&bob, &alice).await.unwrap(),
        Some(both(&alice))
    );

    // The change was announced for alice with her new version. Other tests notify on the
    // same channel, so skip theirs; the timeout only bounds a failure.
    let want = format!("{va1} {alice}");
    let seen = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let n = listener.recv().await.unwrap();
            if n.payload == want {
                break;
            }
        }
    })
    .await;
    assert!(seen.is_ok(), "no notification {want}");

    // A plain DELETE by an operator leaves a tombstone too.
    exec(
        &store,
        "DELETE FROM roster_items WHERE owner = $1",
        "DELETE FROM roster_items WHERE owner = ?1",
        &[&alice],
    )
    .await
    .unwrap();
    let (_, changes) = store.roster_since(&alice, va1).await.unwrap().unwrap();
    assert_eq!(changes, vec![RosterChange::Removed(bare(&bob))]);
}

async fn pending_subscriptions_are_kept_once_per_sender(db: Db) {
    let store = db.open().await;
    let d = domain();
    store
        .create_account("alice", &d, "pw", ITERATIONS)
        .await
        .unwrap();
    let owner = format!("alice@{d}");
    let first = "<presence from='bob@x.example' type='subscribe'><status>hi</status></presence>";
    let again = "<presence from='bob@x.example' type='subscribe'/>";
    let carol = "<presence from='carol@y.example' type='subscribe'/>";

    assert!(store
        .add_pending_subscription(&owner, "bob@x.example", first)
        .await
        .unwrap());
    assert!(!store
        .add_pending_subscription(&owner, "bob@x.example", again)
        .await
        .unwrap());
    assert!(store
        .add_pending_subscription(&owner, "carol@y.example", carol)
        .await
        .unwrap());
    // Kept as a subscribe with its status (the first request's, not the repeat's).
    let kept: Vec<(String, Option<String>, Option<String>)> = store
        .pending_subscriptions(&owner)
        .await
        .unwrap()
        .into_iter()
        .map(|(from, xml)| {
            let p = presenced::protocol::xml::parse_element(&xml).expect("stored stanza parses");
            let status = p
                .get_child("status", presenced::protocol::xml::NS_CLIENT)
                .map(|s| s.text_content());
            (from, p.get_attr("type").map(str::to_owned), status)
        })
        .collect();
    let subscribe = Some("subscribe".to_owned());
    assert_eq!(
        kept,
        vec![
            (
                "bob@x.example".to_owned(),
                subscribe.clone(),
                Some("hi".to_owned())
            ),
            ("carol@y.example".to_owned(), subscribe, None)
        ]
    );
    assert!(store
        .remove_pending_subscription(&owner, "bob@x.example")
        .await
        .unwrap());
    assert!(!store
        .remove_pending_subscription(&owner, "bob@x.example")
        .await
        .unwrap());
    assert_eq!(store.pending_subscriptions(&owner).await.unwrap().len(), 1);

    assert!(matches!(
        store
            .add_pending_subscription(&owner, "bob@x.example/res", again)
            .await,
        Err(StoreError::Constraint(_))
    ));
    assert!(matches!(
        store
            .add_pending_subscription(&format!("nobody@{d}"), "bob@x.example", again)
            .await,
        Err(StoreError::NoSuchAccount)
    ));
}
