//! XEP-0163 personal eventing against the real server, store and TLS: who is notified of
//! a publish (the owner's and contacts' resources whose XEP-0115 capabilities ask for the
//! node, never a stranger, a blocked contact or one the privacy settings hide), the last
//! item on coming online, items across a restart, the XEP-0060 subset and its bounds;
//! the XEP-0054 vCard built on the XEP-0084 avatar (XEP-0398) and who may read it.
//! The same with slixmpp's own plugins is `slixmpp_pep_plugins` at the end.

mod common;

use std::time::Duration;

use base64::Engine;
use common::*;
use presenced::protocol::xml::{parse_element, Element, NS_CLIENT};
use sha1::Digest;

const NS_PUBSUB: &str = "http://jabber.org/protocol/pubsub";
const NS_PUBSUB_OWNER: &str = "http://jabber.org/protocol/pubsub#owner";
const NS_EVENT: &str = "http://jabber.org/protocol/pubsub#event";
const NS_ERRORS: &str = "http://jabber.org/protocol/pubsub#errors";
const NS_CAPS: &str = "http://jabber.org/protocol/caps";
const NS_DISCO_INFO: &str = "http://jabber.org/protocol/disco#info";
const NS_DISCO_ITEMS: &str = "http://jabber.org/protocol/disco#items";
const NS_BLOCKING: &str = "urn:xmpp:blocking";
const NS_PRIVACY: &str = "urn:presenced:privacy:0";
const META: &str = "urn:xmpp:avatar:metadata";
const NICK: &str = "http://jabber.org/protocol/nick";
const DEVICES: &str = "eu.siacs.conversations.axolotl.devicelist";
const CLIENT_NODE: &str = "https://presenced.test/client";

/// How long a negative expectation watches (after a barrier, so anything sent is there).
const QUIET: Duration = Duration::from_millis(300);

fn el(xml: &str) -> Element {
    parse_element(xml).unwrap_or_else(|| panic!("test XML parses: {xml}"))
}

/// The disco#info features of a test client interested in `interests`.
fn features(interests: &[&str]) -> Vec<String> {
    let mut f = vec![NS_DISCO_INFO.to_owned(), NS_CAPS.to_owned()];
    f.extend(interests.iter().map(|i| format!("{i}+notify")));
    f
}

/// XEP-0115 §5.1 for one identity `client/pc//test` and `features`.
fn ver_of(features: &[String]) -> String {
    let mut sorted = features.to_vec();
    sorted.sort();
    let mut s = "client/pc//test<".to_owned();
    for f in sorted {
        s.push_str(&f);
        s.push('<');
    }
    base64::engine::general_purpose::STANDARD.encode(sha1::Sha1::digest(s.as_bytes()))
}

/// Logs in `name/res` and sends available presence with caps naming `interests`. When
/// `asked`, the server must ask for the `ver`'s disco#info (first sight of it), which is
/// answered (with `wrong_hash`, features that do not hash to the ver); otherwise it must
/// not ask. Ends with a barrier, so what the server learnt is in place.
async fn caps_online_with(
    ts: &TestServer,
    name: &str,
    res: &str,
    interests: &[&str],
    asked: bool,
    wrong_hash: bool,
) -> Client {
    let mut c = ts.login(name, res).await;
    let feats = features(interests);
    let ver = ver_of(&feats);
    c.send(&el(&format!(
        "<presence xmlns='jabber:client'><c xmlns='{NS_CAPS}' hash='sha-1' node='{CLIENT_NODE}' ver='{ver}'/></presence>"
    )))
    .await;
    let me = format!("{}/{res}", ts.jid(name));
    c.expect(|e| is_presence(e, &me, None)).await;
    let is_query = |e: &Element| {
        e.name == "iq"
            && e.get_attr("type") == Some("get")
            && e.get_child("query", NS_DISCO_INFO)
                .and_then(|q| q.get_attr("node"))
                == Some(format!("{CLIENT_NODE}#{ver}").as_str())
    };
    if asked {
        let q = c.expect(is_query).await;
        assert_eq!(q.get_attr("from"), Some(ts.domain.as_str()), "{q}");
        let mut query = Element::new("query", NS_DISCO_INFO)
            .attr("node", format!("{CLIENT_NODE}#{ver}"))
            .child(
                Element::new("identity", NS_DISCO_INFO)
                    .attr("category", "client")
                    .attr("type", "pc")
                    .attr("name", "test"),
            );
        let mut answered = feats.clone();
        if wrong_hash {
            answered.push("urn:example:extra".to_owned());
        }
        for f in &answered {
            query = query.child(Element::new("feature", NS_DISCO_INFO).attr("var", f.clone()));
        }
        let reply = Element::new("iq", NS_CLIENT)
            .attr("type", "result")
            .attr("id", q.get_attr("id").unwrap())
            .attr("to", ts.domain.clone())
            .child(query);
        c.send(&reply).await;
    }
    barrier(ts, &mut c).await;
    if !asked {
        c.expect_none(is_query, Duration::ZERO).await;
    }
    c
}

async fn caps_online(
    ts: &TestServer,
    name: &str,
    res: &str,
    interests: &[&str],
    asked: bool,
) -> Client {
    caps_online_with(ts, name, res, interests, asked, false).await
}

/// One session announcing many `ver`s and answering none of the server's disco#info
/// queries must not use up the node's outstanding queries: a later client with a new
/// `ver` is still asked (else nobody's PEP notifications reach it). Each session has at
/// most `[limits] max_caps_queries_per_session` queries outstanding.
#[tokio::test]
async fn a_session_that_never_answers_caps_queries_does_not_stop_others_being_asked() {
    let ts = TestServer::start(|c| {
        c.limits.max_caps_entries = 10;
    })
    .await;
    ts.user("mallory").await;
    ts.user("alice").await;
    let mut mallory = ts.login("mallory", "pc").await;
    let me = format!("{}/pc", ts.jid("mallory"));
    for i in 0..40 {
        mallory
            .send(&el(&format!(
                "<presence xmlns='jabber:client'><c xmlns='{NS_CAPS}' hash='sha-1' \
                 node='{CLIENT_NODE}' ver='bogus{i}='/></presence>"
            )))
            .await;
    }
    barrier(&ts, &mut mallory).await;
    let asked = mallory
        .backlog
        .iter()
        .filter(|e| e.name == "iq" && e.get_child("query", NS_DISCO_INFO).is_some())
        .count();
    assert!(
        asked <= ts.config.limits.max_caps_queries_per_session,
        "{asked} queries outstanding for {me}"
    );
    // alice announces a ver nobody has: she is asked, and her answer is learnt.
    let alice = caps_online(&ts, "alice", "pc", &[NICK], true).await;
    drop((alice, mallory));
    ts.stop().await;
}

fn publish_iq(node: &str, id: &str, payload: &str, options: &[(&str, &str)]) -> Element {
    let mut xml = format!(
        "<pubsub xmlns='{NS_PUBSUB}'><publish node='{node}'><item id='{id}'>{payload}</item></publish>"
    );
    if !options.is_empty() {
        xml.push_str("<publish-options><x xmlns='jabber:x:data' type='submit'><field var='FORM_TYPE' type='hidden'><value>http://jabber.org/protocol/pubsub#publish-options</value></field>");
        for (var, value) in options {
            xml.push_str(&format!(
                "<field var='{var}'><value>{value}</value></field>"
            ));
        }
        xml.push_str("</x></publish-options>");
    }
    xml.push_str("</pubsub>");
    el(&xml)
}

fn metadata(id: &str) -> String {
    format!("<metadata xmlns='{META}'><info id='{id}' bytes='12345' type='image/png' height='64' width='64'/></metadata>")
}

async fn publish(c: &mut Client, node: &str, id: &str, payload: &str) {
    let r = c.iq("set", None, publish_iq(node, id, payload, &[])).await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
}

/// Whether `e` is an event from `owner` about `node` carrying item `id`.
fn is_event(e: &Element, owner: &str, node: &str, id: &str) -> bool {
    e.name == "message"
        && e.get_attr("type") == Some("headline")
        && e.get_attr("from") == Some(owner)
        && e.get_child("event", NS_EVENT)
            .and_then(|ev| ev.get_child("items", NS_EVENT))
            .filter(|i| i.get_attr("node") == Some(node))
            .and_then(|i| i.get_child("item", NS_EVENT))
            .is_some_and(|i| i.get_attr("id") == Some(id))
}

fn is_any_event(e: &Element) -> bool {
    e.name == "message" && e.get_child("event", NS_EVENT).is_some()
}

/// The pubsub application condition of an error reply.
fn app_condition(e: &Element) -> Option<String> {
    e.get_child("error", NS_CLIENT)?
        .elements()
        .find(|c| c.ns == NS_ERRORS)
        .map(|c| c.name.clone())
}

async fn items(c: &mut Client, owner: &str, node: &str, extra: &str) -> Element {
    c.iq(
        "get",
        Some(owner),
        el(&format!(
            "<pubsub xmlns='{NS_PUBSUB}'><items node='{node}'{extra}/></pubsub>"
        )),
    )
    .await
}

fn item_ids(r: &Element) -> Vec<String> {
    r.get_child("pubsub", NS_PUBSUB)
        .and_then(|p| p.get_child("items", NS_PUBSUB))
        .map(|i| {
            i.elements()
                .filter_map(|it| it.get_attr("id").map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The owner blocks eve (XEP-0191) and hides its online status from frank (the privacy
/// settings): both stay mutual contacts.
async fn block_eve_and_hide_from_frank(ts: &TestServer, owner: &mut Client) {
    iq_ok(
        owner,
        el(&format!(
            "<block xmlns='{NS_BLOCKING}'><item jid='{}'/></block>",
            ts.jid("eve")
        )),
    )
    .await;
    iq_ok(
        owner,
        el(&format!(
            "<privacy xmlns='{NS_PRIVACY}'><online mode='contacts_except'><except jid='{}'/></online></privacy>",
            ts.jid("frank")
        )),
    )
    .await;
}

async fn iq_ok(c: &mut Client, payload: Element) {
    let r = c.iq("set", None, payload).await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
}

#[tokio::test]
async fn a_publish_reaches_subscribed_resources_that_asked_and_nobody_else() {
    let ts = TestServer::start(|_| {}).await;
    for u in ["alice", "bob", "carol", "dave", "eve", "frank"] {
        ts.user(u).await;
    }
    for u in ["bob", "carol", "eve", "frank"] {
        ts.make_mutual("alice", u).await;
    }
    let alice_bare = ts.jid("alice");
    let mut alice = caps_online(&ts, "alice", "pc", &[META], true).await;
    // The same capabilities: known by their `ver`, not asked again.
    let mut bob = caps_online(&ts, "bob", "desk", &[META], false).await;
    let mut carol = caps_online(&ts, "carol", "web", &[], true).await;
    let mut dave = caps_online(&ts, "dave", "x", &[META], false).await;
    let mut eve = caps_online(&ts, "eve", "x", &[META], false).await;
    let mut frank = caps_online(&ts, "frank", "x", &[META], false).await;
    block_eve_and_hide_from_frank(&ts, &mut alice).await;

    let r = alice
        .iq("set", None, publish_iq(META, "av1", &metadata("av1"), &[]))
        .await;
    let published = r
        .get_child("pubsub", NS_PUBSUB)
        .and_then(|p| p.get_child("publish", NS_PUBSUB))
        .and_then(|p| p.get_child("item", NS_PUBSUB))
        .and_then(|i| i.get_attr("id"));
    assert_eq!(published, Some("av1"), "{r}");

    // Positive controls: the subscribed contact and the owner's own resource.
    let ev = bob.expect(|e| is_event(e, &alice_bare, META, "av1")).await;
    assert_eq!(
        ev.get_attr("to"),
        Some(format!("{}/desk", ts.jid("bob")).as_str())
    );
    let payload = ev
        .get_child("event", NS_EVENT)
        .and_then(|e| e.get_child("items", NS_EVENT))
        .and_then(|i| i.get_child("item", NS_EVENT))
        .and_then(|i| i.get_child("metadata", META));
    assert!(payload.is_some(), "payload travels with the event: {ev}");
    alice
        .expect(|e| is_event(e, &alice_bare, META, "av1"))
        .await;
    // No +notify, a stranger, a blocked contact, a contact the settings hide: nothing.
    for c in [&mut carol, &mut dave, &mut eve, &mut frank] {
        barrier(&ts, c).await;
        c.expect_none(is_any_event, QUIET).await;
    }
}

#[tokio::test]
async fn the_last_item_reaches_a_contact_coming_online_and_the_owners_new_resource() {
    let ts = TestServer::start(|_| {}).await;
    for u in ["alice", "bob", "carol", "dave", "eve", "frank"] {
        ts.user(u).await;
    }
    for u in ["bob", "carol", "eve", "frank"] {
        ts.make_mutual("alice", u).await;
    }
    let alice_bare = ts.jid("alice");
    let mut alice = ts.login("alice", "pc").await;
    alice.presence(None, None).await;
    block_eve_and_hide_from_frank(&ts, &mut alice).await;
    publish(
        &mut alice,
        NICK,
        "n1",
        &format!("<nick xmlns='{NICK}'>Al</nick>"),
    )
    .await;
    publish(
        &mut alice,
        NICK,
        "n2",
        &format!("<nick xmlns='{NICK}'>Alice</nick>"),
    )
    .await;

    // First sight of the ver: the item comes once the server learnt what it means.
    let mut bob = caps_online(&ts, "bob", "desk", &[NICK], true).await;
    let ev = bob.expect(|e| is_event(e, &alice_bare, NICK, "n2")).await;
    assert!(ev.to_xml().contains(">Alice<"), "{ev}");
    // A known ver: at once on initial presence.
    let mut phone = caps_online(&ts, "bob", "phone", &[NICK], false).await;
    phone.expect(|e| is_event(e, &alice_bare, NICK, "n2")).await;
    // The owner's own new resource gets its own last item (XEP-0163 §4.3.1).
    let mut tablet = caps_online(&ts, "alice", "tablet", &[NICK], false).await;
    tablet
        .expect(|e| is_event(e, &alice_bare, NICK, "n2"))
        .await;
    // Only the last one, once.
    barrier(&ts, &mut bob).await;
    bob.expect_none(|e| is_event(e, &alice_bare, NICK, "n1"), Duration::ZERO)
        .await;
    bob.expect_none(|e| is_event(e, &alice_bare, NICK, "n2"), Duration::ZERO)
        .await;
    // A contact without +notify, and with it a stranger, a blocked contact and one the
    // settings hide, get nothing.
    let mut carol = caps_online(&ts, "carol", "web", &[], true).await;
    let mut dave = caps_online(&ts, "dave", "x", &[NICK], false).await;
    let mut eve = caps_online(&ts, "eve", "x", &[NICK], false).await;
    let mut frank = caps_online(&ts, "frank", "x", &[NICK], false).await;
    for c in [&mut carol, &mut dave, &mut eve, &mut frank] {
        barrier(&ts, c).await;
        c.expect_none(is_any_event, QUIET).await;
    }
}

#[tokio::test]
async fn an_answer_that_does_not_hash_to_its_ver_is_not_believed_for_others() {
    let ts = TestServer::start(|_| {}).await;
    for u in ["alice", "bob"] {
        ts.user(u).await;
    }
    ts.make_mutual("alice", "bob").await;
    // Bob's client claims +notify for nicks but answers with a feature set of another
    // hash: the server keeps it for bob's session only, and asks the next client again.
    let mut desk = caps_online_with(&ts, "bob", "desk", &[NICK], true, true).await;
    let mut phone = caps_online(&ts, "bob", "phone", &[NICK], true).await;
    // Each session is notified as its own answer says.
    let alice_bare = ts.jid("alice");
    let mut alice = ts.login("alice", "pc").await;
    publish(
        &mut alice,
        NICK,
        "n1",
        &format!("<nick xmlns='{NICK}'>Al</nick>"),
    )
    .await;
    desk.expect(|e| is_event(e, &alice_bare, NICK, "n1")).await;
    phone.expect(|e| is_event(e, &alice_bare, NICK, "n1")).await;
}

#[tokio::test]
async fn items_are_kept_across_a_restart_and_read_as_the_access_model_says() {
    let domain = format!("t{}.example", unique());
    let ts = TestServer::start_with_domain(&domain, |_| {}).await;
    for u in ["alice", "bob", "dave"] {
        ts.user(u).await;
    }
    ts.make_mutual("alice", "bob").await;
    let alice_bare = ts.jid("alice");
    let mut alice = ts.login("alice", "pc").await;
    publish(&mut alice, META, "av1", &metadata("av1")).await;
    let bundle = "<bundle xmlns='eu.siacs.conversations.axolotl'><signedPreKeyPublic signedPreKeyId='1'>AAAA</signedPreKeyPublic></bundle>";
    let r = alice
        .iq(
            "set",
            None,
            publish_iq(
                "eu.siacs.conversations.axolotl.bundles:42",
                "current",
                bundle,
                &[("pubsub#access_model", "open")],
            ),
        )
        .await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    alice.close().await;
    ts.stop().await;

    let ts = TestServer::start_with_domain(&domain, |_| {}).await;
    let mut alice = ts.login("alice", "pc").await;
    assert_eq!(
        item_ids(&items(&mut alice, &alice_bare, META, "").await),
        ["av1"]
    );
    let mut bob = ts.login("bob", "desk").await;
    let r = bob
        .iq(
            "get",
            Some(&alice_bare),
            el(&format!(
                "<pubsub xmlns='{NS_PUBSUB}'><items node='{META}'><item id='av1'/></items></pubsub>"
            )),
        )
        .await;
    assert_eq!(item_ids(&r), ["av1"], "{r}");
    // A stranger: not a presence subscriber (XEP-0060 §6.5.9.4), but an open node is his.
    let mut dave = ts.login("dave", "x").await;
    let r = items(&mut dave, &alice_bare, META, "").await;
    assert_error(
        &r,
        "not-authorized",
        "auth",
        "stranger reads a presence node",
    );
    assert_eq!(
        app_condition(&r).as_deref(),
        Some("presence-subscription-required")
    );
    let r = items(
        &mut dave,
        &alice_bare,
        "eu.siacs.conversations.axolotl.bundles:42",
        "",
    )
    .await;
    assert_eq!(item_ids(&r), ["current"], "{r}");
    // disco#items lists what the asker may read; disco#info says the account is PEP.
    let list = |r: &Element| -> Vec<String> {
        r.get_child("query", NS_DISCO_ITEMS)
            .map(|q| {
                q.elements()
                    .filter_map(|i| i.get_attr("node").map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let r = dave
        .iq(
            "get",
            Some(&alice_bare),
            Element::new("query", NS_DISCO_ITEMS),
        )
        .await;
    assert_eq!(
        list(&r),
        ["eu.siacs.conversations.axolotl.bundles:42"],
        "{r}"
    );
    let r = bob
        .iq(
            "get",
            Some(&alice_bare),
            Element::new("query", NS_DISCO_ITEMS),
        )
        .await;
    assert_eq!(list(&r).len(), 2, "{r}");
    let r = bob
        .iq(
            "get",
            Some(&alice_bare),
            Element::new("query", NS_DISCO_INFO),
        )
        .await;
    let pep = r.get_child("query", NS_DISCO_INFO).is_some_and(|q| {
        q.elements().any(|i| {
            i.name == "identity"
                && i.get_attr("category") == Some("pubsub")
                && i.get_attr("type") == Some("pep")
        })
    });
    assert!(pep, "{r}");
    // Only the owner publishes.
    let r = bob
        .iq(
            "set",
            Some(&alice_bare),
            publish_iq(META, "x", &metadata("x"), &[]),
        )
        .await;
    assert_error(
        &r,
        "forbidden",
        "auth",
        "a contact publishes to the owner's node",
    );
}

/// An account's PEP storage is bounded in bytes, not only in nodes, items and item size
/// (64 nodes × 32 items × 128 KiB was 256 MiB): a publish that would take the account's
/// stored payloads beyond `[limits] max_pep_bytes` is refused with resource-constraint
/// and stores nothing; replacing items within the budget still works.
#[tokio::test]
async fn an_accounts_pep_storage_is_bounded_in_bytes() {
    let ts = TestServer::start(|c| {
        c.limits.max_pep_item_size = 4000;
        c.limits.max_pep_bytes = 10_000;
    })
    .await;
    ts.user("alice").await;
    let alice_bare = ts.jid("alice");
    let mut alice = ts.login("alice", "pc").await;
    let payload = |id: &str| format!("<x xmlns='urn:example'>{id}{}</x>", "A".repeat(3000));
    for node in ["n1", "n2", "n3"] {
        publish(&mut alice, node, "a", &payload(node)).await;
    }
    let r = alice
        .iq("set", None, publish_iq("n4", "a", &payload("n4"), &[]))
        .await;
    assert_error(
        &r,
        "resource-constraint",
        "wait",
        "a publish beyond max_pep_bytes",
    );
    assert!(
        items(&mut alice, &alice_bare, "n4", "")
            .await
            .get_attr("type")
            == Some("error"),
        "nothing was stored"
    );
    // Replacing an item of the same size stays within the budget.
    publish(&mut alice, "n1", "a", &payload("n1")).await;
    ts.stop().await;
}

#[tokio::test]
async fn bounds_and_options_are_answered_with_their_errors() {
    let ts = TestServer::start(|c| {
        c.limits.max_pep_nodes = 2;
        c.limits.max_pep_items = 2;
        c.limits.max_pep_item_size = 200;
    })
    .await;
    ts.user("alice").await;
    let alice_bare = ts.jid("alice");
    let mut alice = ts.login("alice", "pc").await;
    for id in ["a", "b", "c"] {
        publish(
            &mut alice,
            "n1",
            id,
            &format!("<x xmlns='urn:example'>{id}</x>"),
        )
        .await;
    }
    // XEP-0060 §7.1.1: beyond max_items the oldest goes.
    assert_eq!(
        item_ids(&items(&mut alice, &alice_bare, "n1", "").await),
        ["b", "c"]
    );
    assert_eq!(
        item_ids(&items(&mut alice, &alice_bare, "n1", " max_items='1'").await),
        ["c"]
    );
    // Republishing an id makes it the newest.
    publish(&mut alice, "n1", "b", "<x xmlns='urn:example'>b2</x>").await;
    assert_eq!(
        item_ids(&items(&mut alice, &alice_bare, "n1", "").await),
        ["c", "b"]
    );
    publish(&mut alice, "n2", "a", "<x xmlns='urn:example'/>").await;
    let r = alice
        .iq(
            "set",
            None,
            publish_iq("n3", "a", "<x xmlns='urn:example'/>", &[]),
        )
        .await;
    assert_error(&r, "not-allowed", "cancel", "a node beyond max_pep_nodes");
    assert_eq!(app_condition(&r).as_deref(), Some("max-nodes-exceeded"));
    let big = format!("<x xmlns='urn:example'>{}</x>", "A".repeat(300));
    let r = alice
        .iq("set", None, publish_iq("n1", "big", &big, &[]))
        .await;
    assert_error(
        &r,
        "not-acceptable",
        "modify",
        "a payload beyond max_pep_item_size",
    );
    assert_eq!(app_condition(&r).as_deref(), Some("payload-too-big"));
    for (options, what) in [
        (
            &[("pubsub#access_model", "authorize")][..],
            "an unsupported access model",
        ),
        (
            &[("pubsub#access_model", "open")][..],
            "another model than the node's",
        ),
        (
            &[("pubsub#max_items", "5")][..],
            "max_items beyond the limit",
        ),
    ] {
        let r = alice
            .iq(
                "set",
                None,
                publish_iq("n1", "o", "<x xmlns='urn:example'/>", options),
            )
            .await;
        assert_error(&r, "conflict", "cancel", what);
        assert_eq!(
            app_condition(&r).as_deref(),
            Some("precondition-not-met"),
            "{what}"
        );
    }
    // Nothing of the refused publishes was kept.
    assert_eq!(
        item_ids(&items(&mut alice, &alice_bare, "n1", "").await),
        ["c", "b"]
    );
    let r = items(&mut alice, &alice_bare, "n3", "").await;
    assert_error(&r, "item-not-found", "cancel", "a node never created");
}

#[tokio::test]
async fn retract_purge_and_delete_notify_and_take_effect() {
    let ts = TestServer::start(|_| {}).await;
    for u in ["alice", "bob"] {
        ts.user(u).await;
    }
    ts.make_mutual("alice", "bob").await;
    let alice_bare = ts.jid("alice");
    let mut alice = ts.login("alice", "pc").await;
    let mut bob = caps_online(&ts, "bob", "desk", &[DEVICES], true).await;
    let list = "<list xmlns='eu.siacs.conversations.axolotl'><device id='1'/></list>";
    publish(&mut alice, DEVICES, "current", list).await;
    bob.expect(|e| is_event(e, &alice_bare, DEVICES, "current"))
        .await;
    publish(&mut alice, DEVICES, "old", list).await;
    bob.expect(|e| is_event(e, &alice_bare, DEVICES, "old"))
        .await;

    iq_ok(
        &mut alice,
        el(&format!(
            "<pubsub xmlns='{NS_PUBSUB}'><retract node='{DEVICES}' notify='true'><item id='old'/></retract></pubsub>"
        )),
    )
    .await;
    let retracted = |e: &Element| {
        e.get_child("event", NS_EVENT)
            .and_then(|ev| ev.get_child("items", NS_EVENT))
            .and_then(|i| i.get_child("retract", NS_EVENT))
            .is_some_and(|r| r.get_attr("id") == Some("old"))
    };
    bob.expect(retracted).await;
    assert_eq!(
        item_ids(&items(&mut bob, &alice_bare, DEVICES, "").await),
        ["current"]
    );
    let r = alice
        .iq(
            "set",
            None,
            el(&format!(
                "<pubsub xmlns='{NS_PUBSUB}'><retract node='{DEVICES}'><item id='old'/></retract></pubsub>"
            )),
        )
        .await;
    assert_error(&r, "item-not-found", "cancel", "retracting twice");

    iq_ok(
        &mut alice,
        el(&format!(
            "<pubsub xmlns='{NS_PUBSUB_OWNER}'><purge node='{DEVICES}'/></pubsub>"
        )),
    )
    .await;
    bob.expect(|e| {
        e.get_child("event", NS_EVENT)
            .and_then(|ev| ev.get_child("purge", NS_EVENT))
            .is_some()
    })
    .await;
    assert!(item_ids(&items(&mut alice, &alice_bare, DEVICES, "").await).is_empty());

    iq_ok(
        &mut alice,
        el(&format!(
            "<pubsub xmlns='{NS_PUBSUB_OWNER}'><delete node='{DEVICES}'/></pubsub>"
        )),
    )
    .await;
    bob.expect(|e| {
        e.get_child("event", NS_EVENT)
            .and_then(|ev| ev.get_child("delete", NS_EVENT))
            .is_some_and(|d| d.get_attr("node") == Some(DEVICES))
    })
    .await;
    let r = items(&mut alice, &alice_bare, DEVICES, "").await;
    assert_error(&r, "item-not-found", "cancel", "items of a deleted node");
    // A deleted account takes its nodes with it; a block deletes nothing.
    publish(&mut alice, META, "av", &metadata("av")).await;
    let shared = ts.shared();
    assert_eq!(shared.store.pep_nodes(&alice_bare).await.unwrap().len(), 1);
    alice.close().await;
    assert!(shared
        .store
        .delete_account("alice", &ts.domain, std::slice::from_ref(&ts.domain))
        .await
        .unwrap()
        .is_some());
    assert!(shared
        .store
        .pep_nodes(&alice_bare)
        .await
        .unwrap()
        .is_empty());
}

const VCARD: &str = "vcard-temp";
const VCARD_UPDATE: &str = "vcard-temp:x:update";
const DATA: &str = "urn:xmpp:avatar:data";

/// An image's bytes (a PNG header and `tag`), base64 and SHA-1 (hex, the XEP-0084 id).
fn image(tag: &str) -> (String, String) {
    let mut bytes = b"\x89PNG\r\n\x1a\n".to_vec();
    bytes.extend_from_slice(tag.as_bytes());
    let b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
    let id = sha1::Sha1::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    (b64, id)
}

async fn vcard_get(c: &mut Client, to: Option<&str>) -> Element {
    c.iq("get", to, el(&format!("<vCard xmlns='{VCARD}'/>")))
        .await
}

async fn vcard_set(c: &mut Client, inner: &str) -> Element {
    c.iq(
        "set",
        None,
        el(&format!("<vCard xmlns='{VCARD}'>{inner}</vCard>")),
    )
    .await
}

/// The vCard of a result.
fn card(r: &Element) -> &Element {
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    r.get_child("vCard", VCARD)
        .unwrap_or_else(|| panic!("a vCard in {r}"))
}

/// A vCard's PHOTO as (TYPE, BINVAL).
fn photo(card: &Element) -> Option<(String, String)> {
    let p = card.get_child("PHOTO", VCARD)?;
    Some((
        p.get_child("TYPE", VCARD)?.text_content(),
        p.get_child("BINVAL", VCARD)?.text_content(),
    ))
}

/// The XEP-0153 hash a presence carries (`Some("")`: an empty `<photo/>`).
fn presence_hash(p: &Element) -> Option<String> {
    p.get_child("x", VCARD_UPDATE)?
        .get_child("photo", VCARD_UPDATE)
        .map(|p| p.text_content())
}

/// XEP-0054 with XEP-0398: a vCard PHOTO becomes the XEP-0084 avatar (data, then metadata
/// with its notification), a XEP-0084 avatar shows as the vCard's PHOTO, available
/// presence carries the hash, a vCard without a picture disables the avatar, and a vCard
/// over `max_vcard_size` is refused with nothing stored.
#[tokio::test]
async fn vcard_photos_and_pep_avatars_are_one_picture() {
    let ts = TestServer::start(|c| c.limits.max_vcard_size = 4096).await;
    for u in ["alice", "bob"] {
        ts.user(u).await;
    }
    ts.make_mutual("alice", "bob").await;
    let (alice_bare, bob_bare) = (ts.jid("alice"), ts.jid("bob"));
    let mut bob = caps_online(&ts, "bob", "desk", &[META], true).await;
    let mut alice = ts.login("alice", "pc").await;

    // Nothing yet: the own account's empty vCard (XEP-0054 §3.1).
    let r = vcard_get(&mut alice, None).await;
    assert_eq!(card(&r).elements().count(), 0, "{r}");
    let big = format!("<DESC>{}</DESC>", "d".repeat(5000));
    let r = vcard_set(&mut alice, &big).await;
    assert_error(
        &r,
        "not-acceptable",
        "modify",
        "a vCard beyond max_vcard_size",
    );
    let r = vcard_get(&mut alice, None).await;
    assert_eq!(card(&r).elements().count(), 0, "nothing stored: {r}");

    // A vCard set with a picture (BINVAL folded over lines, as vCard clients send it).
    let (b64, id) = image("alice");
    let folded = format!("{}\n {}", &b64[..10], &b64[10..]);
    let r = vcard_set(
        &mut alice,
        &format!("<FN>Alice A</FN><PHOTO><TYPE>image/png</TYPE><BINVAL>{folded}</BINVAL></PHOTO>"),
    )
    .await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    // XEP-0398 §3.2: published as the avatar, the contact told of the new metadata.
    let ev = bob.expect(|e| is_event(e, &alice_bare, META, &id)).await;
    let info = ev
        .get_child("event", NS_EVENT)
        .and_then(|e| e.get_child("items", NS_EVENT))
        .and_then(|i| i.get_child("item", NS_EVENT))
        .and_then(|i| i.get_child("metadata", META))
        .and_then(|m| m.get_child("info", META))
        .unwrap_or_else(|| panic!("metadata info in {ev}"));
    assert_eq!(info.get_attr("type"), Some("image/png"), "{ev}");
    assert_eq!(info.get_attr("bytes"), Some("13"), "{ev}");
    let r = items(&mut bob, &alice_bare, DATA, "").await;
    assert_eq!(item_ids(&r), std::slice::from_ref(&id), "{r}");
    assert!(
        r.to_xml().contains(&b64),
        "the data item holds the image: {r}"
    );
    // The vCard: what was set, the PHOTO from the avatar.
    let r = vcard_get(&mut bob, Some(&alice_bare)).await;
    let c = card(&r);
    assert_eq!(
        c.get_child("FN", VCARD)
            .map(|f| f.text_content())
            .as_deref(),
        Some("Alice A"),
        "{r}"
    );
    assert_eq!(photo(c), Some(("image/png".to_owned(), b64.clone())), "{r}");
    // XEP-0398 §4: available presence carries the hash, also where the client's <x/> had
    // no <photo/>.
    alice
        .send(&el(&format!(
            "<presence xmlns='jabber:client'><x xmlns='{VCARD_UPDATE}'/></presence>"
        )))
        .await;
    let p = bob.expect(|e| is_presence(e, &alice_bare, None)).await;
    assert_eq!(presence_hash(&p), Some(id.clone()), "{p}");
    // An empty <photo/> is the client's "no avatar to show": left as it is.
    alice
        .send(&el(&format!(
            "<presence xmlns='jabber:client'><x xmlns='{VCARD_UPDATE}'><photo/></x></presence>"
        )))
        .await;
    let p = bob.expect(|e| is_presence(e, &alice_bare, None)).await;
    assert_eq!(presence_hash(&p).as_deref(), Some(""), "{p}");

    // XEP-0398 §3.1: an image that does not hash to its id is not shown (bob has no
    // vCard either, so there is nothing to show).
    let (bob_b64, bob_id) = image("bob");
    let (_, other_id) = image("other");
    publish(
        &mut bob,
        DATA,
        &other_id,
        &format!("<data xmlns='{DATA}'>{bob_b64}</data>"),
    )
    .await;
    publish(
        &mut bob,
        META,
        &other_id,
        &format!("<metadata xmlns='{META}'><info id='{other_id}' bytes='11' type='image/png'/></metadata>"),
    )
    .await;
    let r = vcard_get(&mut alice, Some(&bob_bare)).await;
    assert_error(
        &r,
        "service-unavailable",
        "cancel",
        "an image that does not hash to its id",
    );
    // An avatar published over XEP-0084 is the vCard's PHOTO.
    publish(
        &mut bob,
        DATA,
        &bob_id,
        &format!("<data xmlns='{DATA}'>{bob_b64}</data>"),
    )
    .await;
    publish(
        &mut bob,
        META,
        &bob_id,
        &format!(
            "<metadata xmlns='{META}'><info id='{bob_id}' bytes='11' type='image/png'/></metadata>"
        ),
    )
    .await;
    let r = vcard_get(&mut alice, Some(&bob_bare)).await;
    assert_eq!(
        photo(card(&r)),
        Some(("image/png".to_owned(), bob_b64.clone())),
        "{r}"
    );
    let r = vcard_get(&mut bob, None).await;
    assert_eq!(
        photo(card(&r)),
        Some(("image/png".to_owned(), bob_b64)),
        "{r}"
    );
    bob.presence(None, None).await;
    // This presence (without caps), not the one alice's probe brought.
    let p = alice
        .expect(|e| is_presence(e, &bob_bare, None) && e.get_child("c", NS_CAPS).is_none())
        .await;
    assert_eq!(presence_hash(&p), Some(bob_id), "{p}");

    // A vCard without a picture disables the avatar (XEP-0084 §4.5): no PHOTO, an empty
    // hash in presence.
    let r = vcard_set(&mut alice, "<FN>Alice B</FN>").await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    let r = vcard_get(&mut bob, Some(&alice_bare)).await;
    let c = card(&r);
    assert_eq!(photo(c), None, "{r}");
    assert!(r.to_xml().contains("Alice B"), "{r}");
    let r = items(&mut bob, &alice_bare, META, " max_items='1'").await;
    assert!(
        !r.to_xml().contains("<info"),
        "the newest metadata is empty: {r}"
    );
    alice.presence(None, None).await;
    let p = bob.expect(|e| is_presence(e, &alice_bare, None)).await;
    assert_eq!(presence_hash(&p).as_deref(), Some(""), "{p}");
    // Setting another user's vCard (XEP-0054 §3.2).
    let r = bob
        .iq(
            "set",
            Some(&alice_bare),
            el(&format!("<vCard xmlns='{VCARD}'><FN>x</FN></vCard>")),
        )
        .await;
    assert_error(&r, "forbidden", "auth", "a vCard set for another user");
}

/// An error reply without what differs by request (id, addresses), to compare answers.
fn shape(r: &Element) -> String {
    let mut r = r.clone();
    for a in ["id", "from", "to"] {
        r.remove_attr(a);
    }
    r.to_xml()
}

/// Who may read a vCard: a contact may; a stranger, a viewer the owner blocks and one the
/// owner's settings hide from get exactly the answer of a
/// contact without a vCard and of an account that does not exist (XEP-0054 §3.3:
/// service-unavailable), so nothing tells them apart.
#[tokio::test]
async fn a_vcard_hidden_from_a_viewer_is_answered_like_no_vcard() {
    let ts = TestServer::start(|_| {}).await;
    for u in ["alice", "bob", "carol", "dave", "eve", "frank"] {
        ts.user(u).await;
    }
    for u in ["bob", "carol", "eve", "frank"] {
        ts.make_mutual("alice", u).await;
    }
    ts.make_mutual("bob", "carol").await;
    let alice_bare = ts.jid("alice");
    let mut alice = ts.login("alice", "pc").await;
    let (b64, _) = image("alice");
    let r = vcard_set(
        &mut alice,
        &format!("<FN>Alice</FN><PHOTO><TYPE>image/png</TYPE><BINVAL>{b64}</BINVAL></PHOTO>"),
    )
    .await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    block_eve_and_hide_from_frank(&ts, &mut alice).await;

    // Positive control: a contact sees the vCard and its picture.
    let mut bob = ts.login("bob", "x").await;
    let r = vcard_get(&mut bob, Some(&alice_bare)).await;
    assert_eq!(photo(card(&r)), Some(("image/png".to_owned(), b64)), "{r}");
    // What "no vCard" looks like: a contact who never set one, an account that is not.
    let none = vcard_get(&mut bob, Some(&ts.jid("carol"))).await;
    assert_error(
        &none,
        "service-unavailable",
        "cancel",
        "a contact without a vCard",
    );
    let no_account = vcard_get(&mut bob, Some(&ts.jid("nobody"))).await;
    assert_eq!(shape(&no_account), shape(&none), "no such account");
    for (name, what) in [
        ("dave", "a stranger"),
        ("eve", "a contact the owner blocks"),
        ("frank", "a contact the owner's settings hide from"),
    ] {
        let mut c = ts.login(name, "x").await;
        let r = vcard_get(&mut c, Some(&alice_bare)).await;
        assert_eq!(shape(&r), shape(&none), "{what}: {r}");
    }
}

#[tokio::test]
async fn slixmpp_pep_plugins() {
    let ts = TestServer::start(|_| {}).await;
    for u in ["alice", "bob", "carol", "dave", "eve"] {
        ts.user(u).await;
    }
    for u in ["bob", "carol", "eve"] {
        ts.make_mutual("alice", u).await;
    }
    let args = client_script_args(&ts, &["alice", "bob", "carol", "dave", "eve", "pw"]);
    let out = run_client_script("pep.py", &args, Duration::from_secs(90)).await;
    assert_eq!(out.code, Some(0), "pep.py failed: {out:?}");
    let avatar_id = out.get("avatar_id").expect("avatar id");
    let expect = [
        ("bob_event_from", ts.jid("alice")),
        ("bob_event_id", avatar_id.clone()),
        ("bob_data_matches", "true".to_owned()),
        ("carol_events", "0".to_owned()),
        ("dave_events", "0".to_owned()),
        ("eve_events", "0".to_owned()),
        ("phone_event_id", avatar_id),
    ];
    for (key, want) in expect {
        assert_eq!(
            out.get(key).as_deref(),
            Some(want.as_str()),
            "{key}: {out:?}"
        );
    }
}

/// Waits (bounded) until `node` reads `jid` from the cluster directory as available on
/// another node.
async fn available_elsewhere(node: &TestServer, jid: &str) {
    let full = presenced::protocol::jid::FullJid::new(jid).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !node
        .shared()
        .cluster
        .holder_of(&full)
        .await
        .is_some_and(|h| h.entry.available)
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{jid} not in the directory"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn events_reach_resources_that_asked_on_another_node_of_the_cluster() {
    let domain = format!("c{}.example", unique());
    let n1 = TestServer::start_with_domain(&domain, |c| {
        c.cluster.node_id = Some(format!("n1-{}", unique()));
    })
    .await;
    let n2 = TestServer::start_with_domain(&domain, |c| {
        c.cluster.node_id = Some(format!("n2-{}", unique()));
    })
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while n1.shared().cluster.peers().is_empty() || n2.shared().cluster.peers().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "nodes did not see each other"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for u in ["alice", "bob", "carol"] {
        n1.user(u).await;
    }
    n1.make_mutual("alice", "bob").await;
    n1.make_mutual("alice", "carol").await;
    let alice_bare = n1.jid("alice");
    let mut alice = n1.login("alice", "pc").await;
    // Bob's and Carol's clients are known only on node 2, which asked them.
    let mut bob = caps_online(&n2, "bob", "desk", &[META], true).await;
    let mut carol = caps_online(&n2, "carol", "web", &[], true).await;
    available_elsewhere(&n1, &format!("{}/desk", n1.jid("bob"))).await;
    available_elsewhere(&n1, &format!("{}/web", n1.jid("carol"))).await;
    publish(&mut alice, META, "av1", &metadata("av1")).await;
    bob.expect(|e| is_event(e, &alice_bare, META, "av1")).await;
    // Node 2 got one message naming both recipients and hands it out in one pass without
    // a pause (bob, then carol): once bob has read his copy and carol's ping has crossed
    // the network, that pass is over, and carol's barrier shows anything queued for her.
    barrier(&n2, &mut carol).await;
    carol.expect_none(is_any_event, QUIET).await;
}

/// A reload applies `[limits]` checked per request at once: the PEP bounds are read when a
/// publish is handled, not copied at start (as the README's reload row says).
#[tokio::test]
async fn a_reload_applies_the_pep_bounds_to_the_next_publish() {
    let ts = TestServer::start(|c| {
        c.limits.max_pep_items = 1;
        c.limits.max_pep_item_size = 200;
    })
    .await;
    ts.user("alice").await;
    let alice_bare = ts.jid("alice");
    let mut alice = ts.login("alice", "pc").await;
    let big = format!("<x xmlns='urn:example'>{}</x>", "A".repeat(300));
    let r = alice
        .iq("set", None, publish_iq("n1", "big", &big, &[]))
        .await;
    assert_error(&r, "not-acceptable", "modify", "before the reload");

    let running = ts.running.as_ref().unwrap();
    let mut changed = ts.config.clone();
    changed.limits.max_pep_items = 3;
    changed.limits.max_pep_item_size = 4000;
    let checked = changed.check().expect("valid");
    let outcome = presenced::app::control::reload::apply(&ts.config, &checked, running)
        .await
        .expect("reloads");
    assert!(
        outcome.reloaded.iter().any(|r| r == "[limits]"),
        "{outcome:?}"
    );

    publish(&mut alice, "n1", "big", &big).await;
    for id in ["b", "c"] {
        publish(&mut alice, "n1", id, "<x xmlns='urn:example'/>").await;
    }
    // Three items kept: the new max_pep_items, where the old one kept one.
    assert_eq!(
        item_ids(&items(&mut alice, &alice_bare, "n1", "").await),
        ["big", "b", "c"]
    );
    ts.stop().await;
}
