//! What one account may store and hold, against the real server and PostgreSQL: roster
//! item size (RFC 6121 §2.3.3), roster size on every path that creates an item, stored
//! inbound subscription requests (RFC 6121 §3.1.3), resources per account (RFC 6120
//! §7.6.2.1 / §7.7.2.2), block-list size (XEP-0191) and trailing-dot JIDs (RFC 7622 §3.2).

mod common;

use common::*;
use presenced::protocol::xml::{parse_element, Element, NS_CLIENT};

const NS_ROSTER: &str = "jabber:iq:roster";
const NS_BLOCKING: &str = "urn:xmpp:blocking";
const NS_NICK: &str = "http://jabber.org/protocol/nick";

fn bare(jid: &str) -> presenced::protocol::jid::BareJid {
    presenced::protocol::jid::BareJid::new(jid).expect("a bare JID")
}

fn el(xml: &str) -> Element {
    parse_element(xml).unwrap_or_else(|| panic!("test XML parses: {xml}"))
}

fn assert_result(reply: &Element, what: &str) {
    assert_eq!(reply.get_attr("type"), Some("result"), "{what}: {reply}");
}

fn roster_item(jid: &str, name: Option<&str>, groups: &[String]) -> Element {
    let mut i = Element::new("item", NS_ROSTER).attr("jid", jid);
    if let Some(n) = name {
        i.set_attr("name", n);
    }
    for g in groups {
        i = i.child(Element::new("group", NS_ROSTER).text(g.clone()));
    }
    i
}

async fn roster_set(c: &mut Client, item: Element) -> Element {
    c.iq("set", None, Element::new("query", NS_ROSTER).child(item))
        .await
}

async fn roster_count(ts: &TestServer, owner: &str) -> usize {
    ts.shared()
        .store
        .roster(&ts.jid(owner))
        .await
        .unwrap()
        .1
        .len()
}

// ---------------------------------------------------------------------------------------
// Roster item size (RFC 6121 §2.3.3)

#[tokio::test]
async fn roster_items_beyond_the_group_count_or_name_lengths_are_not_acceptable() {
    let ts = TestServer::start(|_| {}).await;
    let d = presenced::config::LimitsConfig::default();
    ts.user("alice").await;
    let mut c = ts.login("alice", "r").await;
    let bob = ts.jid("bob");
    let groups = |n: usize, len: usize| -> Vec<String> {
        (0..n)
            .map(|i| format!("{i:04}{}", "é".repeat(len - 4)))
            .collect()
    };
    // Positive control: exactly at every limit (lengths in characters, not bytes).
    let at_limit = roster_item(
        &bob,
        Some(&"ñ".repeat(d.max_roster_name_length)),
        &groups(d.max_roster_groups, d.max_roster_group_length),
    );
    assert_result(&roster_set(&mut c, at_limit).await, "every limit reached");
    let over: Vec<(&str, Element)> = vec![
        (
            "one group too many",
            roster_item(&bob, None, &groups(d.max_roster_groups + 1, 8)),
        ),
        (
            "group name one character too long",
            roster_item(&bob, None, &groups(1, d.max_roster_group_length + 1)),
        ),
        (
            "item name one character too long",
            roster_item(&bob, Some(&"n".repeat(d.max_roster_name_length + 1)), &[]),
        ),
    ];
    for (what, item) in over {
        // RFC 6121 §2.3.3: a name or group beyond a server-configured limit is
        // not-acceptable (type modify); the count of groups is bounded the same way.
        assert_error(
            &roster_set(&mut c, item).await,
            "not-acceptable",
            "modify",
            what,
        );
    }
    // The refused sets changed nothing: the stored item is still the one at the limits.
    let (_, items) = ts.shared().store.roster(&ts.jid("alice")).await.unwrap();
    assert_eq!(items.len(), 1);
    assert_eq!(items[0].groups.len(), d.max_roster_groups);
    assert_eq!(
        items[0].name.as_deref().map(|n| n.chars().count()),
        Some(d.max_roster_name_length)
    );
    ts.stop().await;
}

// ---------------------------------------------------------------------------------------
// Roster size on every path that creates an item

fn is_presence_error(e: &Element, from: &str, condition: &str) -> bool {
    e.name == "presence"
        && e.get_attr("type") == Some("error")
        && e.get_attr("from") == Some(from)
        && stanza_error(e) == condition
}

#[tokio::test]
async fn subscriptions_cannot_grow_a_roster_beyond_max_roster_items() {
    let ts = TestServer::start(|c| {
        c.limits.max_roster_items = 3;
        // Remote contacts bounce at once instead of asking DNS.
        c.s2s.nameserver = presenced::config::Nameserver::Disabled;
    })
    .await;
    ts.user("alice").await;
    ts.user("carol").await;
    let mut alice = ts.login("alice", "r").await;
    alice.presence(None, None).await;
    // Three outbound requests to contacts without accounts each create an item (RFC 6121
    // §3.1.2: the user's item gets ask='subscribe' whatever the contact's server does).
    for n in ["b1", "b2", "b3"] {
        alice.send(&presence_to("subscribe", &ts.jid(n))).await;
    }
    barrier(&ts, &mut alice).await;
    assert_eq!(roster_count(&ts, "alice").await, 3, "positive control");

    // A fourth, local or remote, is refused and creates nothing.
    let local = ts.jid("b4");
    let remote = "b5@remote.invalid".to_owned();
    for contact in [&local, &remote] {
        alice.send(&presence_to("subscribe", contact)).await;
        let e = alice
            .expect(|e| is_presence_error(e, contact, "not-allowed"))
            .await;
        assert_eq!(error_type(&e), "cancel", "{e}");
    }
    assert_eq!(roster_count(&ts, "alice").await, 3);

    // An inbound request needs no item (it waits in the pending table), so it still
    // reaches alice; approving it would create an item, which is refused the same way.
    let mut carol = ts.login("carol", "r").await;
    carol.presence(None, None).await;
    carol
        .send(&presence_to("subscribe", &ts.jid("alice")))
        .await;
    alice
        .expect(|e| is_presence(e, &ts.jid("carol"), Some("subscribe")))
        .await;
    alice
        .send(&presence_to("subscribed", &ts.jid("carol")))
        .await;
    alice
        .expect(|e| is_presence_error(e, &ts.jid("carol"), "not-allowed"))
        .await;
    assert_eq!(roster_count(&ts, "alice").await, 3);
    // Carol's request is still waiting for an answer alice can give once she has room.
    let pending = ts
        .shared()
        .store
        .pending_subscriptions(&ts.jid("alice"))
        .await
        .unwrap();
    assert_eq!(pending.len(), 1, "{pending:?}");

    // Room again: the same approval goes through.
    let r = roster_set(
        &mut alice,
        roster_item(&ts.jid("b1"), None, &[]).attr("subscription", "remove"),
    )
    .await;
    assert_result(&r, "remove b1");
    alice
        .send(&presence_to("subscribed", &ts.jid("carol")))
        .await;
    carol
        .expect(|e| is_presence(e, &ts.jid("alice"), Some("subscribed")))
        .await;
    assert_eq!(roster_count(&ts, "alice").await, 3);
    ts.stop().await;
}

// ---------------------------------------------------------------------------------------
// Stored inbound subscription requests (RFC 6121 §3.1.3)

#[tokio::test]
async fn stored_subscription_requests_are_bounded_per_user_and_stripped() {
    let ts = TestServer::start(|_| {}).await;
    let d = presenced::config::LimitsConfig::default();
    ts.user("alice").await;
    let store = &ts.shared().store;
    let alice = ts.jid("alice");
    let status = "s".repeat(20_000);
    let nick = "n".repeat(20_000);
    let big = |from: &str| {
        format!(
            "<presence xmlns='jabber:client' type='subscribe' from='{from}' to='{alice}' id='x1'>\
             <status>{status}</status><status xml:lang='de'>zwei</status>\
             <nick xmlns='{NS_NICK}'>{nick}</nick>\
             <junk xmlns='urn:example:junk'>{status}</junk><priority>5</priority></presence>"
        )
    };
    for i in 0..d.max_pending_subscriptions {
        let from = format!("s{i}@remote.example");
        assert!(
            store
                .add_pending_subscription(&alice, &from, &big(&from))
                .await
                .unwrap(),
            "request {i} within the limit is kept"
        );
    }
    let from = "over@remote.example";
    assert!(
        !store
            .add_pending_subscription(&alice, from, &big(from))
            .await
            .unwrap(),
        "the request beyond the limit is not kept"
    );
    let pending = store.pending_subscriptions(&alice).await.unwrap();
    assert_eq!(pending.len(), d.max_pending_subscriptions);
    assert!(pending.iter().all(|(f, _)| f != from));
    // What is kept is what RFC 6121 §3.1.3 delivers: the type, one status cut to the
    // configured length, and the XEP-0172 nick, cut the same way; nothing else.
    for (sender, xml) in &pending {
        let p = el(xml);
        assert_eq!(p.name, "presence");
        assert_eq!(p.get_attr("type"), Some("subscribe"), "{xml}");
        let kids: Vec<String> = p.elements().map(|c| c.name.clone()).collect();
        assert_eq!(kids, ["status", "nick"], "{sender}: {kids:?}");
        let s = p.get_child("status", NS_CLIENT).unwrap().text_content();
        assert_eq!(s.chars().count(), d.max_subscription_status_length);
        let n = p.get_child("nick", NS_NICK).unwrap().text_content();
        assert_eq!(n.chars().count(), d.max_subscription_status_length);
        assert!(
            xml.len() < 3 * d.max_subscription_status_length + 300,
            "{}",
            xml.len()
        );
    }
    // Answering one makes room for another.
    assert!(store
        .remove_pending_subscription(&alice, "s0@remote.example")
        .await
        .unwrap());
    assert!(store
        .add_pending_subscription(&alice, from, &big(from))
        .await
        .unwrap());
    ts.stop().await;
}

// ---------------------------------------------------------------------------------------
// Resources per account (RFC 6120 §7.6.2.1, §7.7.2.2)

#[tokio::test]
async fn binding_beyond_the_resources_per_account_is_a_resource_constraint() {
    let ts = TestServer::start(|_| {}).await;
    let max = presenced::config::LimitsConfig::default().max_resources_per_account;
    ts.user("alice").await;
    let mut sessions = Vec::new();
    for i in 0..max {
        sessions.push(ts.login("alice", &format!("r{i}")).await);
    }
    for (what, resource) in [("client-chosen", "one-more"), ("server-generated", "")] {
        let mut c = Client::authenticated(&ts, "alice").await;
        let err = c.bind(resource).await.expect_err(what);
        // RFC 6120 §7.6.2.1 (server-generated) and §7.7.2.2 (client-submitted): the
        // account has reached its limit of connected resources.
        assert_error(&err, "resource-constraint", "wait", what);
    }
    // Re-binding a resource already in use replaces it (RFC 6120 §7.7.2.1) and does not
    // add one, so it is allowed at the limit.
    let mut c = Client::authenticated(&ts, "alice").await;
    c.bind("r0")
        .await
        .expect("a resource in use may be taken over");
    // Another account is not affected.
    ts.user("bob").await;
    ts.login("bob", "r").await;
    drop(sessions);
    ts.stop().await;
}

// ---------------------------------------------------------------------------------------
// Block-list size (XEP-0191) and trailing dots (RFC 7622 §3.2)

async fn block(c: &mut Client, jids: &[String]) -> Element {
    let items: String = jids.iter().map(|j| format!("<item jid='{j}'/>")).collect();
    c.iq(
        "set",
        None,
        el(&format!("<block xmlns='{NS_BLOCKING}'>{items}</block>")),
    )
    .await
}

async fn blocklist(c: &mut Client) -> Vec<String> {
    let r = c
        .iq(
            "get",
            None,
            el(&format!("<blocklist xmlns='{NS_BLOCKING}'/>")),
        )
        .await;
    r.get_child("blocklist", NS_BLOCKING)
        .expect("blocklist")
        .elements()
        .filter_map(|i| i.get_attr("jid").map(str::to_owned))
        .collect()
}

#[tokio::test]
async fn a_block_list_cannot_grow_beyond_max_blocklist_items() {
    let ts = TestServer::start(|_| {}).await;
    let max = presenced::config::LimitsConfig::default().max_blocklist_items;
    ts.user("alice").await;
    let mut c = ts.login("alice", "r").await;
    let jids: Vec<String> = (0..max).map(|i| format!("u{i}@spam.example")).collect();
    assert_result(&block(&mut c, &jids[..max - 1]).await, "below the limit");
    assert_result(&block(&mut c, &jids[max - 1..]).await, "up to the limit");
    // One more is refused, whole, and changes nothing.
    let r = block(
        &mut c,
        &["one@more.example".to_owned(), "two@more.example".to_owned()],
    )
    .await;
    assert_error(&r, "not-acceptable", "modify", "beyond the limit");
    // Blocking an entry already on the list does not grow it.
    assert_result(&block(&mut c, &jids[..1]).await, "already blocked");
    let list = blocklist(&mut c).await;
    assert_eq!(list.len(), max);
    assert!(!list.iter().any(|j| j.ends_with("more.example")));
    ts.stop().await;
}

fn is_message_from(e: &Element, jid: &str) -> bool {
    e.name == "message"
        && e.get_attr("from")
            .is_some_and(|f| f.starts_with(&format!("{jid}/")))
}

fn chat(to: &str, body: &str) -> Element {
    Element::new("message", NS_CLIENT)
        .attr("type", "chat")
        .attr("to", to)
        .child(Element::new("body", NS_CLIENT).text(body))
}

#[tokio::test]
async fn a_trailing_dot_in_a_blocked_domain_is_removed_so_the_block_applies() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    ts.user("mallory").await;
    let mut alice = ts.login("alice", "r").await;
    alice.presence(None, None).await;
    let mut mallory = ts.login("mallory", "r").await;
    // Positive control: before the block, mallory's message arrives.
    mallory.send(&chat(&ts.jid("alice"), "before")).await;
    alice
        .expect(|e| is_message_from(e, &ts.jid("mallory")))
        .await;

    // RFC 7622 §3.2: a trailing dot in the domainpart is removed before comparison.
    let dotted = format!("{}.", ts.jid("mallory"));
    assert_result(&block(&mut alice, &[dotted]).await, "block");
    assert_eq!(blocklist(&mut alice).await, [ts.jid("mallory")]);
    barrier(&ts, &mut alice).await;
    mallory.send(&chat(&ts.jid("alice"), "after")).await;
    // Mallory's stanzas are handled in order: once the ping is answered, the message has
    // been routed (or refused).
    barrier(&ts, &mut mallory).await;
    barrier(&ts, &mut alice).await;
    alice
        .expect_none(
            |e| is_message_from(e, &ts.jid("mallory")),
            std::time::Duration::from_millis(300),
        )
        .await;
    // A roster item for a dotted JID is stored under the normalised one.
    let r = roster_set(
        &mut alice,
        roster_item(&format!("{}.", ts.jid("bob")), None, &[]),
    )
    .await;
    assert_result(&r, "roster set");
    let (_, items) = ts.shared().store.roster(&ts.jid("alice")).await.unwrap();
    assert_eq!(
        items.iter().map(|i| i.contact.as_str()).collect::<Vec<_>>(),
        [ts.jid("bob")]
    );
    ts.stop().await;
}

// ---------------------------------------------------------------------------------------
// The store's one check, and items stored before the limits

#[tokio::test]
async fn concurrent_writes_cannot_pass_the_roster_limit_together() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    let store = ts.shared().store.clone();
    let mut limits = store.limits();
    limits.max_roster_items = 5;
    store.set_limits(limits);
    let alice = ts.jid("alice");
    let writes = (0..20).map(|i| {
        let (store, alice) = (store.clone(), alice.clone());
        tokio::spawn(async move {
            let item = presenced::store::RosterItem::new(bare(&format!("c{i}@x.example")));
            // Half through each entry point: a roster set and a subscription change.
            if i % 2 == 0 {
                store.upsert_roster_item(&alice, &item).await.map(|_| ())
            } else {
                store
                    .apply_subscription_change(&[(alice, item)])
                    .await
                    .map(|_| ())
            }
        })
    });
    let mut ok = 0;
    for w in writes.collect::<Vec<_>>() {
        match w.await.unwrap() {
            Ok(()) => ok += 1,
            Err(presenced::store::StoreError::RosterFull) => {}
            Err(e) => panic!("unexpected error {e}"),
        }
    }
    assert_eq!(ok, 5);
    assert_eq!(store.roster(&alice).await.unwrap().1.len(), 5);
    ts.stop().await;
}

#[tokio::test]
async fn a_subscription_change_refused_for_one_side_changes_neither() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let store = ts.shared().store.clone();
    let mut limits = store.limits();
    limits.max_roster_items = 1;
    store.set_limits(limits);
    let (alice, bob) = (ts.jid("alice"), ts.jid("bob"));
    store
        .upsert_roster_item(
            &bob,
            &presenced::store::RosterItem::new(bare("x@x.example")),
        )
        .await
        .unwrap();
    let mut a = presenced::store::RosterItem::new(bare(&bob));
    a.subscription = presenced::store::Subscription::To;
    let mut b = presenced::store::RosterItem::new(bare(&alice));
    b.subscription = presenced::store::Subscription::From;
    let r = store
        .apply_subscription_change(&[(alice.clone(), a), (bob.clone(), b)])
        .await;
    assert!(
        matches!(r, Err(presenced::store::StoreError::RosterFull)),
        "{r:?}"
    );
    assert!(store.roster(&alice).await.unwrap().1.is_empty());
    assert_eq!(store.roster(&bob).await.unwrap().1.len(), 1);
    ts.stop().await;
}

#[tokio::test]
async fn an_item_stored_before_the_limits_is_served_cut_to_them() {
    let ts = TestServer::start(|_| {}).await;
    let d = presenced::config::LimitsConfig::default();
    ts.user("alice").await;
    let alice = ts.jid("alice");
    let bob = ts.jid("bob");
    // As an older server stored it: thousands of groups, long names.
    let groups: Vec<String> = (0..5000)
        .map(|i| format!("{i:05}{}", "g".repeat(300)))
        .collect();
    // The groups hold only digits and 'g', so neither list form needs quoting.
    ts.sql(
        "INSERT INTO roster_items (owner, contact, name, groups) VALUES ($1, $2, $3, $4::text[])",
        "INSERT INTO roster_items (owner, contact, name, groups) VALUES (?1, ?2, ?3, ?4)",
        &[
            &alice,
            &bob,
            &"n".repeat(1000),
            &match ts.shared().store.dialect() {
                presenced::store::Dialect::Postgres => format!("{{{}}}", groups.join(",")),
                presenced::store::Dialect::Sqlite => format!("[\"{}\"]", groups.join("\",\"")),
            },
        ],
    )
    .await
    .unwrap();
    let mut c = ts.login("alice", "r").await;
    let r = c.iq("get", None, Element::new("query", NS_ROSTER)).await;
    let items: Vec<&Element> = r
        .get_child("query", NS_ROSTER)
        .unwrap()
        .elements()
        .collect();
    assert_eq!(items.len(), 1, "{r}");
    let served: Vec<String> = items[0].elements().map(|g| g.text_content()).collect();
    assert_eq!(served.len(), d.max_roster_groups);
    for (g, want) in served.iter().zip(&groups) {
        assert_eq!(g.chars().count(), d.max_roster_group_length);
        assert!(want.starts_with(g.as_str()));
    }
    assert_eq!(
        items[0].get_attr("name").map(|n| n.chars().count()),
        Some(d.max_roster_name_length)
    );
    // The next change of the item stores it cut, so it converges to the limits.
    c.send(&presence_to("subscribe", &bob)).await;
    barrier(&ts, &mut c).await;
    // Read back without the limits that cut what is served: what is stored is cut.
    let store = &ts.shared().store;
    store.set_limits(presenced::store::StoreLimits {
        max_roster_groups: 100_000,
        max_roster_group_length: 100_000,
        max_roster_name_length: 100_000,
        ..store.limits()
    });
    let stored = store.roster_item(&alice, &bob).await.unwrap().unwrap();
    assert_eq!(stored.groups, served);
    ts.stop().await;
}

fn is_unavailable_from(e: &Element, full: &str) -> bool {
    e.name == "presence"
        && e.get_attr("type") == Some("unavailable")
        && e.get_attr("from") == Some(full)
}

#[tokio::test]
async fn directed_presence_beyond_max_directed_presences_is_refused_and_logout_reaches_every_tracked_target(
) {
    let ts = TestServer::start(|c| {
        fast_liveness(c);
        c.limits.max_directed_presences = 3;
    })
    .await;
    // "aaron" sorts before the tracked targets, so when the last of them has its
    // unavailable, an unavailable to aaron would already have been queued.
    for u in ["alice", "aaron", "bob", "carol", "dave"] {
        ts.user(u).await;
    }
    let mut alice = ts.login("alice", "r").await;
    alice.presence(None, None).await;
    let alice_full = format!("{}/r", ts.jid("alice"));
    let mut targets = Vec::new();
    for u in ["bob", "carol", "dave"] {
        let mut c = ts.login(u, "r").await;
        c.presence(None, None).await;
        // The target is available (its own presence came back) before alice's directed
        // presence to its bare JID is sent; otherwise it could find no available resource.
        let own = format!("{}/r", ts.jid(u));
        c.expect(|e| is_presence(e, &own, None)).await;
        alice.presence(None, Some(&ts.jid(u))).await;
        c.expect(|e| is_presence(e, &alice_full, None)).await;
        targets.push(c);
    }
    let mut aaron = ts.login("aaron", "r").await;
    aaron.presence(None, None).await;
    let own = format!("{}/r", ts.jid("aaron"));
    aaron.expect(|e| is_presence(e, &own, None)).await;
    // The fourth target is one too many: refused to the sender, not delivered.
    alice.presence(None, Some(&ts.jid("aaron"))).await;
    let err = alice
        .expect(|e| e.name == "presence" && e.get_attr("type") == Some("error"))
        .await;
    assert_error(
        &err,
        "resource-constraint",
        "wait",
        "fourth directed presence",
    );
    assert_eq!(err.get_attr("from"), Some(ts.jid("aaron").as_str()));
    // Barrier: a message alice sends after the refused presence reaches aaron first.
    alice.send(&chat(&ts.jid("aaron"), "after")).await;
    let from_alice = |e: &Element| {
        e.get_attr("from")
            .is_some_and(|f| f.starts_with(&ts.jid("alice")))
    };
    let first = aaron
        .watch(&from_alice, WAIT)
        .await
        .expect("aaron gets the message");
    assert!(is_message_from(&first, &ts.jid("alice")), "{first}");
    // The set stays at the bound, each tracked target shown once.
    let h = ts.shared().sessions.of_user_str(&ts.jid("alice"))[0].clone();
    assert_eq!(h.read(|p| (p.directed_len(), p.tracked())), (3, 6));

    alice.close().await;
    for c in &mut targets {
        c.expect(|e| is_unavailable_from(e, &alice_full)).await;
    }
    // Barrier: dave got the last tracked unavailable, then tells aaron.
    let dave = targets.last_mut().unwrap();
    dave.send(&chat(&ts.jid("aaron"), "done")).await;
    let alice_or_dave = |e: &Element| from_alice(e) || is_message_from(e, &ts.jid("dave"));
    let next = aaron
        .watch(&alice_or_dave, WAIT)
        .await
        .expect("aaron gets dave's message");
    assert!(is_message_from(&next, &ts.jid("dave")), "{next}");
    ts.stop().await;
}

#[tokio::test]
async fn directed_presence_to_900_remote_domains_leaves_nothing_after_logout() {
    let ts = TestServer::start(|c| {
        fast_liveness(c);
        // The remote domains are never contacted: only the session's bookkeeping is measured.
        c.s2s.enabled = false;
        c.limits.stanza_burst = 2000;
    })
    .await;
    ts.user("alice").await;
    let mut alice = ts.login("alice", "r").await;
    alice.presence(None, None).await;
    for i in 0..900 {
        alice
            .presence(None, Some(&format!("u@d{i}.remote.example")))
            .await;
    }
    barrier(&ts, &mut alice).await;
    let h = ts.shared().sessions.of_user_str(&ts.jid("alice"))[0].clone();
    assert_eq!(h.read(|p| p.tracked()), 900);
    assert_eq!(ts.shared().sessions.tracked(), 900);
    alice.close().await;
    // The session ends after the grace period (0.6 s here); its state is emptied then,
    // even though this test still holds a copy of its handle.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while h.read(|p| p.tracked()) != 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "session state still holds {} entries",
            h.read(|p| p.tracked())
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(ts
        .shared()
        .sessions
        .of_user_str(&ts.jid("alice"))
        .is_empty());
    assert_eq!(ts.shared().sessions.tracked(), 0);
    ts.stop().await;
}

/// XEP-0077 registration from `ip`, on a fresh connection after STARTTLS; the answer's
/// type and, for an error, its condition.
async fn register_from(ts: &TestServer, ip: &str, user: &str) -> (String, String) {
    let mut c = Client::tcp_from(ts, ip.parse().expect("an address")).await;
    c.open(&ts.domain).await.expect("stream");
    let mut c = c.starttls(ts).await;
    c.send(&el(&format!(
        "<iq xmlns='jabber:client' type='set' id='reg'><query xmlns='jabber:iq:register'>\
         <username>{user}</username><password>pw</password></query></iq>"
    )))
    .await;
    let r = c
        .expect(|e| e.name == "iq" && e.get_attr("id") == Some("reg"))
        .await;
    let ty = r.get_attr("type").unwrap_or("").to_owned();
    let cond = if ty == "error" {
        stanza_error(&r)
    } else {
        String::new()
    };
    (ty, cond)
}

/// In-band registration is budgeted per source address and for the whole node: one
/// connection (or one address opening many) cannot create accounts without end. Beyond a
/// budget the answer is resource-constraint (type wait) and no account is created.
#[tokio::test]
async fn in_band_registration_is_rate_limited_per_address_and_per_node() {
    let ts = TestServer::start(|c| {
        c.auth.allow_registration = true;
        c.auth.registrations_per_ip_per_hour = 3;
        c.auth.registrations_per_hour = 5;
    })
    .await;
    for i in 0..3 {
        let r = register_from(&ts, "127.0.0.1", &format!("a{i}")).await;
        assert_eq!(r.0, "result", "registration {i} from .1: {r:?}");
    }
    let r = register_from(&ts, "127.0.0.1", "a3").await;
    assert_eq!(
        r,
        ("error".into(), "resource-constraint".into()),
        "4th from .1"
    );
    // Another address has its own budget, until the node's is spent.
    for i in 0..2 {
        let r = register_from(&ts, "127.0.0.2", &format!("b{i}")).await;
        assert_eq!(r.0, "result", "registration {i} from .2: {r:?}");
    }
    let r = register_from(&ts, "127.0.0.3", "c0").await;
    assert_eq!(
        r,
        ("error".into(), "resource-constraint".into()),
        "6th on the node"
    );
    // Refused registrations created nothing.
    for u in ["a3", "c0"] {
        assert!(
            !ts.shared()
                .store
                .account_exists(u, &ts.domain)
                .await
                .unwrap(),
            "{u} was not created"
        );
    }
    ts.stop().await;
}

/// One source address cannot hold every place under `max_connections`: beyond
/// `[limits] max_connections_per_ip` open at once it is refused with policy-violation,
/// while another address still gets in, and a closed connection gives its place back.
#[tokio::test]
async fn connections_open_from_one_address_are_capped() {
    let ts = TestServer::start(|c| c.limits.max_connections_per_ip = 2).await;
    let from = |ip: &str| ip.parse::<std::net::IpAddr>().unwrap();
    let mut first = Client::tcp_from(&ts, from("127.0.0.7")).await;
    first.open(&ts.domain).await.expect("first");
    let mut second = Client::tcp_from(&ts, from("127.0.0.7")).await;
    second.open(&ts.domain).await.expect("second");
    let mut third = Client::tcp_from(&ts, from("127.0.0.7")).await;
    // RFC 6120 §4.9.3.14: a local policy on what one address may hold.
    match third.open(&ts.domain).await {
        Err(Ended::StreamError(cond)) => assert_eq!(cond, "policy-violation"),
        other => panic!("expected policy-violation, got {other:?}"),
    }
    let mut other = Client::tcp_from(&ts, from("127.0.0.8")).await;
    other
        .open(&ts.domain)
        .await
        .expect("another address gets in");
    drop(first);
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let mut again = Client::tcp_from(&ts, from("127.0.0.7")).await;
        if again.open(&ts.domain).await.is_ok() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the place was not given back"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    drop((second, other));
    ts.stop().await;
}
