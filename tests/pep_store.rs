//! The XEP-0163 tables on both stores (modules `postgres` and `sqlite`, see
//! `common/stores.rs`): auto-created nodes and their access model, the node and item
//! bounds of the one publish, reads, retract, purge, delete, and the rows going with the
//! account; and the XEP-0054 vCard table beside them. Every test works on its own random
//! domain.

use presenced::protocol::jid::BareJid;
use presenced::store::pep::{AccessModel, PepItem, Published};
use presenced::store::{Store, StoreError, StoreLimits};

#[path = "common/stores.rs"]
#[macro_use]
mod stores;
use stores::{exec, Db};

on_both_stores!(
    a_publish_creates_the_node_keeps_the_newest_items_and_bounds_the_nodes,
    reads_retract_purge_delete_and_the_account_take_its_data,
    a_vcard_is_stored_replaced_and_goes_with_the_account,
);

async fn account(store: &Store) -> String {
    let domain = format!("pep{}.example", uuid::Uuid::new_v4().simple());
    store
        .create_account("alice", &domain, "pw", 1)
        .await
        .expect("account");
    format!("alice@{domain}")
}

fn item(id: &str) -> PepItem {
    PepItem {
        id: id.to_owned(),
        payload: format!("<x xmlns='urn:example'>{id}</x>"),
    }
}

fn stored(access_model: AccessModel) -> Published {
    Published::Stored { access_model }
}

async fn ids(store: &Store, owner: &str, node: &str, want: &[&str], max: usize) -> Vec<String> {
    let want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
    store
        .pep_items(owner, node, &want, max)
        .await
        .expect("items")
        .into_iter()
        .map(|i| i.id)
        .collect()
}

async fn a_publish_creates_the_node_keeps_the_newest_items_and_bounds_the_nodes(db: Db) {
    let store = db.open().await;
    store.set_limits(StoreLimits {
        max_pep_nodes: 2,
        max_pep_items: 2,
        ..StoreLimits::default()
    });
    let owner = account(&store).await;
    assert_eq!(store.pep_node(&owner, "n1").await.unwrap(), None);
    for id in ["a", "b", "c"] {
        let r = store
            .pep_publish(&owner, "n1", None, &item(id))
            .await
            .unwrap();
        assert_eq!(r, stored(AccessModel::Presence));
    }
    assert_eq!(ids(&store, &owner, "n1", &[], 10).await, ["c", "b"]);
    // The same id again replaces it and makes it the newest.
    store
        .pep_publish(&owner, "n1", None, &item("b"))
        .await
        .unwrap();
    assert_eq!(ids(&store, &owner, "n1", &[], 10).await, ["b", "c"]);
    assert_eq!(ids(&store, &owner, "n1", &[], 1).await, ["b"]);
    // An existing node keeps its model: asking another stores nothing.
    let r = store
        .pep_publish(&owner, "n1", Some(AccessModel::Open), &item("d"))
        .await
        .unwrap();
    assert_eq!(r, Published::AccessModelDiffers);
    assert_eq!(
        ids(&store, &owner, "n1", &["d"], 10).await,
        Vec::<String>::new()
    );
    let r = store
        .pep_publish(&owner, "n2", Some(AccessModel::Open), &item("a"))
        .await
        .unwrap();
    assert_eq!(r, stored(AccessModel::Open));
    let r = store
        .pep_publish(&owner, "n3", None, &item("a"))
        .await
        .unwrap();
    assert_eq!(r, Published::TooManyNodes);
    assert_eq!(store.pep_node(&owner, "n3").await.unwrap(), None);
    let r = store.pep_delete_node(&owner, "n2").await.unwrap();
    assert!(r);
    // The schema refuses a model the service does not have, written past the typed API.
    let err = exec(
        &store,
        "INSERT INTO pep_nodes (owner, node, access_model) VALUES ($1, 'n9', 'roster')",
        "INSERT INTO pep_nodes (owner, node, access_model) VALUES (?1, 'n9', 'roster')",
        &[&owner],
    )
    .await
    .unwrap_err();
    assert!(
        matches!(StoreError::from(err), StoreError::Constraint(ref c) if c == "pep_nodes_access_model"),
        "an access model outside XEP-0060 §4.5's served ones"
    );
}

async fn reads_retract_purge_delete_and_the_account_take_its_data(db: Db) {
    let store = db.open().await;
    let owner = account(&store).await;
    store
        .pep_publish(&owner, "nick", None, &item("n1"))
        .await
        .unwrap();
    store
        .pep_publish(&owner, "nick", None, &item("n2"))
        .await
        .unwrap();
    store
        .pep_publish(&owner, "bundle", Some(AccessModel::Open), &item("current"))
        .await
        .unwrap();
    assert_eq!(ids(&store, &owner, "nick", &["n1"], 10).await, ["n1"]);
    // Several owners in one read; one with no nodes adds nothing.
    let other = account(&store).await;
    store
        .pep_publish(&other, "nick", None, &item("o1"))
        .await
        .unwrap();
    let nobody = account(&store).await;
    let owners = [&owner, &other, &nobody].map(|o| BareJid::new(o).unwrap());
    let last = store.pep_last_items(&owners).await.unwrap();
    let mut last: Vec<(String, String, String, String)> = last
        .into_iter()
        .map(|(o, n, m, i)| (o.to_string(), n, m.to_string(), i.id))
        .collect();
    let row = |o: &str, n: &str, m: &str, i: &str| {
        (o.to_owned(), n.to_owned(), m.to_owned(), i.to_owned())
    };
    let mut want = vec![
        row(&owner, "bundle", "open", "current"),
        row(&owner, "nick", "presence", "n2"),
        row(&other, "nick", "presence", "o1"),
    ];
    want.sort();
    last.sort();
    assert_eq!(last, want);
    assert_eq!(
        store.pep_items(&owner, "nick", &[], 1).await.unwrap()[0].payload,
        "<x xmlns='urn:example'>n2</x>"
    );
    assert!(store.pep_retract(&owner, "nick", "n2").await.unwrap());
    assert!(!store.pep_retract(&owner, "nick", "n2").await.unwrap());
    assert_eq!(ids(&store, &owner, "nick", &[], 10).await, ["n1"]);
    assert!(store.pep_purge(&owner, "nick").await.unwrap());
    assert!(ids(&store, &owner, "nick", &[], 10).await.is_empty());
    assert_eq!(
        store.pep_node(&owner, "nick").await.unwrap(),
        Some(AccessModel::Presence)
    );
    assert!(!store.pep_purge(&owner, "nothing").await.unwrap());
    assert!(store.pep_delete_node(&owner, "nick").await.unwrap());
    assert!(!store.pep_delete_node(&owner, "nick").await.unwrap());
    assert_eq!(
        store.pep_nodes(&owner).await.unwrap(),
        [("bundle".to_owned(), AccessModel::Open)]
    );
    let (user, domain) = owner.split_once('@').unwrap();
    assert!(store
        .delete_account(user, domain, &[domain.to_owned()])
        .await
        .unwrap()
        .is_some());
    assert!(store.pep_nodes(&owner).await.unwrap().is_empty());
    assert!(store
        .pep_last_items(&[BareJid::new(&owner).unwrap()])
        .await
        .unwrap()
        .is_empty());
}

async fn a_vcard_is_stored_replaced_and_goes_with_the_account(db: Db) {
    let store = db.open().await;
    let owner = account(&store).await;
    let other = account(&store).await;
    assert_eq!(store.vcard(&owner).await.unwrap(), None);
    let first = "<vCard xmlns='vcard-temp'><FN>Alice ñ</FN></vCard>";
    store.set_vcard(&owner, first).await.unwrap();
    assert_eq!(store.vcard(&owner).await.unwrap().as_deref(), Some(first));
    let second = "<vCard xmlns='vcard-temp'><NICKNAME>al</NICKNAME></vCard>";
    store.set_vcard(&owner, second).await.unwrap();
    assert_eq!(store.vcard(&owner).await.unwrap().as_deref(), Some(second));
    // One row per account: the other account has none.
    assert_eq!(store.vcard(&other).await.unwrap(), None);
    // A vCard belongs to an account: none is stored for a JID that has none.
    assert!(store
        .set_vcard("nobody@nowhere.example", first)
        .await
        .is_err());
    let (user, domain) = owner.split_once('@').unwrap();
    assert!(store
        .delete_account(user, domain, &[domain.to_owned()])
        .await
        .unwrap()
        .is_some());
    assert_eq!(store.vcard(&owner).await.unwrap(), None);
}
