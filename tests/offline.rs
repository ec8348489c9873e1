//! XEP-0160 offline storage as an attacker sees it: a stranger must not learn from the
//! answers to its messages whether an account exists or whether its user is online
//! (visible or XEP-0186 invisible), and no sender, stranger or contact, can fill a user's
//! store so that the user's contacts are refused. The budgets are `[limits]`
//! `max_offline_*`; the rules are `presenced::services::offline`'s module documentation.

mod common;

use common::*;
use presenced::protocol::xml::{parse_element, Element, NS_CLIENT};
use presenced::services::presence::privacy::{PrivacySettings, Visibility};

const NS_HINTS: &str = "urn:xmpp:hints";
const NS_RECEIPTS: &str = "urn:xmpp:receipts";
const NS_MARKERS: &str = "urn:xmpp:chat-markers:0";
const NS_INVISIBLE: &str = "urn:xmpp:invisible:0";

fn el(xml: &str) -> Element {
    parse_element(xml).unwrap_or_else(|| panic!("test XML parses: {xml}"))
}

/// Logs in and sends initial presence, waiting for the server's echo.
async fn online(ts: &TestServer, name: &str, res: &str) -> Client {
    let mut c = ts.login(name, res).await;
    c.presence(None, None).await;
    let me = format!("{}/{res}", ts.jid(name));
    c.expect(|e| is_presence(e, &me, None)).await;
    c
}

/// The messages the server sent `c` before it answered a ping sent now: the answers to
/// the messages `c` sent before (one task per session, handled in order).
async fn answers_so_far(ts: &TestServer, c: &mut Client) -> Vec<Element> {
    let id = unique();
    let ping = Element::new("iq", NS_CLIENT)
        .attr("type", "get")
        .attr("id", id.clone())
        .attr("to", ts.domain.clone())
        .child(Element::new("ping", "urn:xmpp:ping"));
    c.send(&ping).await;
    let mut before = std::mem::take(&mut c.backlog);
    loop {
        let e = c.next_stanza(WAIT).await.expect("stanza before ping reply");
        if e.name == "iq" && e.get_attr("id") == Some(id.as_str()) {
            before.retain(|e| e.name == "message");
            return before;
        }
        before.push(e);
    }
}

/// A body-less chat message carrying only the XEP-0334 `<store/>` hint.
fn hinted(to: &str, id: usize) -> Element {
    el(&format!(
        "<message xmlns='jabber:client' type='chat' id='h{id}' to='{to}'><store xmlns='{NS_HINTS}'/></message>"
    ))
}

/// A chat message with `body` and id `id`.
fn with_body(to: &str, id: &str, body: &str) -> Element {
    el(&format!(
        "<message xmlns='jabber:client' type='chat' id='{id}' to='{to}'><body>{body}</body></message>"
    ))
}

/// The messages kept for `owner`: how many, and their bytes as stored.
async fn kept(ts: &TestServer, owner: &str) -> (i64, i64) {
    let store = &ts.shared().store;
    let row: Result<(i64, i64), _> = match store.sqlite_pool() {
        Some(file) => {
            sqlx::query_as(
                "SELECT count(*), coalesce(sum(length(CAST(stanza AS BLOB))), 0)
                 FROM offline_messages WHERE owner = ?1",
            )
            .bind(owner)
            .fetch_one(file)
            .await
        }
        None => {
            sqlx::query_as(
                "SELECT count(*), coalesce(sum(octet_length(stanza)), 0)::bigint
                 FROM offline_messages WHERE owner = $1",
            )
            .bind(owner)
            .fetch_one(store.pool())
            .await
        }
    };
    row.expect("offline messages counted")
}

/// What a stranger sees when it sends `to` (a bare JID) what the adversarial run sent: 101
/// body-less messages with the `<store/>` hint (one more than the default store holds), a
/// message with a body to the bare JID and one to a resource that is not there. The
/// transcript is normalised so that the recipient's name does not show.
async fn stranger_transcript(ts: &TestServer, stranger: &mut Client, name: &str) -> Vec<String> {
    let to = ts.jid(name);
    for i in 0..101 {
        stranger.send(&hinted(&to, i)).await;
    }
    stranger.send(&with_body(&to, "b1", "hello")).await;
    stranger
        .send(&with_body(&format!("{to}/gone"), "b2", "hello?"))
        .await;
    answers_so_far(ts, stranger)
        .await
        .iter()
        .map(|e| e.to_xml().replace(&to, "TARGET"))
        .collect()
}

#[tokio::test]
async fn a_stranger_gets_the_same_silence_from_a_missing_offline_online_invisible_or_full_account()
{
    // The attacker sends faster than the per-session rate; that limit is not under test.
    let ts = TestServer::start(|c| c.limits.stanzas_per_second = 100_000).await;
    for u in ["stranger", "contact", "off", "on", "inv", "full"] {
        ts.user(u).await;
    }
    ts.user("contact2").await;
    ts.make_mutual("full", "contact").await;
    ts.make_mutual("full", "contact2").await;
    // "full": offline, and its store is full of its two contacts' messages.
    let full = ts.jid("full");
    let max = ts.config.limits.max_offline_messages;
    for who in ["contact", "contact2"] {
        let mut contact = online(&ts, who, "c").await;
        for i in 0..max / 2 {
            contact
                .send(&with_body(&full, &format!("c{i}"), "from a contact"))
                .await;
        }
        let refused = answers_so_far(&ts, &mut contact).await;
        assert!(refused.is_empty(), "{who} was refused: {refused:?}");
    }
    assert_eq!(kept(&ts, &full).await.0, max as i64);
    let _on = online(&ts, "on", "r").await;
    let mut inv = ts.login("inv", "r").await;
    let r = inv
        .iq(
            "set",
            None,
            el(&format!("<invisible xmlns='{NS_INVISIBLE}'/>")),
        )
        .await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    inv.presence(None, None).await;
    barrier(&ts, &mut inv).await;

    let mut stranger = online(&ts, "stranger", "s").await;
    let mut seen = Vec::new();
    for name in ["nobody", "off", "on", "inv", "full"] {
        seen.push((name, stranger_transcript(&ts, &mut stranger, name).await));
    }
    let answered: Vec<(&str, usize, Option<&String>)> = seen
        .iter()
        .map(|(name, t)| (*name, t.len(), t.first()))
        .collect();
    assert!(
        seen.iter().all(|(_, t)| t.is_empty()),
        "the stranger was answered (target, answers, first answer): {answered:#?}"
    );
    // Nothing body-less of a stranger's is kept, and the full store kept nothing more.
    assert_eq!(kept(&ts, &ts.jid("off")).await.0, 2);
    assert_eq!(kept(&ts, &full).await.0, max as i64);
    ts.stop().await;
}

#[tokio::test]
async fn a_remote_stranger_gets_the_same_silence_from_a_missing_offline_or_full_account() {
    let a_domain = format!("a{}.example", unique());
    let b_domain = format!("b{}.example", unique());
    let a_port = listen_port("127.0.0.2");
    let b_port = listen_port("127.0.0.3");
    let (a_addr, b_addr) = (format!("127.0.0.2:{a_port}"), format!("127.0.0.3:{b_port}"));
    let a = TestServer::start_with_domain(&a_domain, |c| {
        s2s_config(c, "127.0.0.2", a_port, "secret-a", &b_domain, b_addr);
        c.limits.max_offline_messages = 3;
    })
    .await;
    let b = TestServer::start_with_domain(&b_domain, |c| {
        s2s_config(c, "127.0.0.3", b_port, "secret-b", &a_domain, a_addr)
    })
    .await;
    for u in ["off", "full", "contact"] {
        a.user(u).await;
    }
    b.user("carol").await;
    a.make_mutual("full", "contact").await;
    let mut contact = online(&a, "contact", "c").await;
    let full = a.jid("full");
    for i in 0..3 {
        contact.send(&with_body(&full, &format!("c{i}"), "x")).await;
    }
    barrier(&a, &mut contact).await;
    assert_eq!(kept(&a, &full).await.0, 3);

    let mut carol = online(&b, "carol", "r").await;
    for name in ["nobody", "off", "full"] {
        let to = a.jid(name);
        carol.send(&with_body(&to, name, "hello")).await;
        carol.send(&hinted(&to, 0)).await;
        // An iq to server a comes back over the same stream as any error would, after it.
        let r = carol
            .iq(
                "get",
                Some(&a_domain),
                Element::new("ping", "urn:xmpp:ping"),
            )
            .await;
        assert!(r.get_attr("type").is_some(), "{r}");
        let answered = std::mem::take(&mut carol.backlog);
        assert!(
            !answered.iter().any(|e| e.name == "message"),
            "{name}: the remote stranger was answered: {answered:#?}"
        );
    }
    assert_eq!(kept(&a, &a.jid("off")).await.0, 1);
    assert_eq!(kept(&a, &full).await.0, 3);
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn a_strangers_flood_neither_pushes_out_nor_blocks_a_contacts_messages() {
    let ts = TestServer::start(|_| {}).await;
    for u in ["alice", "bob", "mallory"] {
        ts.user(u).await;
    }
    ts.make_mutual("alice", "bob").await;
    let alice = ts.jid("alice");
    let mut bob = online(&ts, "bob", "b").await;
    bob.send(&with_body(&alice, "early", "before the flood"))
        .await;
    barrier(&ts, &mut bob).await;
    // The adversarial run: as many messages as the store holds, each near the stanza
    // limit. Here 100 of 20 KB: 2 MB from one stranger.
    let mut mallory = online(&ts, "mallory", "m").await;
    let big = "x".repeat(20_000);
    let started = std::time::Instant::now();
    for i in 0..ts.config.limits.max_offline_messages {
        mallory
            .send(&with_body(&alice, &format!("f{i}"), &big))
            .await;
    }
    let answered = answers_so_far(&ts, &mut mallory).await;
    println!(
        "flood of 100 x 20 KB handled in {:?}; kept for alice: {:?}",
        started.elapsed(),
        kept(&ts, &alice).await
    );
    assert!(answered.is_empty(), "mallory was answered: {answered:?}");
    // Bob's messages are still kept, not refused.
    for i in 0..3 {
        bob.send(&with_body(&alice, &format!("late{i}"), "after the flood"))
            .await;
    }
    let refused = answers_so_far(&ts, &mut bob).await;
    assert!(refused.is_empty(), "bob was refused: {refused:#?}");
    let (count, bytes) = kept(&ts, &alice).await;
    println!("kept for alice after bob's messages: {count} messages, {bytes} bytes");
    let limits = &ts.config.limits;
    assert!(
        bytes <= limits.max_offline_bytes as i64,
        "kept {bytes} bytes, over the budget"
    );
    // At login alice gets every one of bob's, and at most a stranger's share of mallory's.
    let mut a = online(&ts, "alice", "phone").await;
    let got = answers_so_far(&ts, &mut a).await;
    let from = |who: &str, e: &Element| {
        e.name == "message" && e.get_attr("from").is_some_and(|f| f.starts_with(who))
    };
    let from_bob: Vec<String> = got
        .iter()
        .filter(|e| from(&ts.jid("bob"), e))
        .filter_map(|e| e.get_attr("id").map(str::to_owned))
        .collect();
    assert_eq!(from_bob, ["early", "late0", "late1", "late2"]);
    let from_mallory = got.iter().filter(|e| from(&ts.jid("mallory"), e)).count();
    assert!(
        from_mallory <= limits.max_offline_messages_per_stranger,
        "{from_mallory} of mallory's messages kept"
    );
    ts.stop().await;
}

#[tokio::test]
async fn a_users_offline_store_is_bounded_in_bytes_per_sender_and_in_all() {
    let ts = TestServer::start(|_| {}).await;
    for u in ["alice", "bob", "carol"] {
        ts.user(u).await;
    }
    ts.make_mutual("alice", "bob").await;
    ts.make_mutual("alice", "carol").await;
    let alice = ts.jid("alice");
    let limits = ts.config.limits.clone();
    // Bob sends 200 KB messages until one is refused; what is kept stays within his share.
    let mut bob = online(&ts, "bob", "b").await;
    let big = "y".repeat(200_000);
    let mut refused_at = None;
    for i in 0..10 {
        bob.send(&with_body(&alice, &format!("b{i}"), &big)).await;
        let answered = answers_so_far(&ts, &mut bob).await;
        if let Some(err) = answered.first() {
            // A contact who may see alice's presence may be told she is offline.
            assert_error(err, "service-unavailable", "cancel", "over bob's share");
            refused_at = Some(i);
            break;
        }
    }
    let (count, bytes) = kept(&ts, &alice).await;
    println!(
        "bob's share: refused at message {refused_at:?}; kept {count} messages, {bytes} bytes"
    );
    assert!(refused_at.is_some(), "nothing of bob's was refused");
    assert!(
        bytes <= limits.max_offline_bytes_per_sender as i64,
        "{bytes}"
    );
    // Carol, another contact, still has her own share.
    let mut carol = online(&ts, "carol", "c").await;
    carol.send(&with_body(&alice, "c0", &big)).await;
    let answered = answers_so_far(&ts, &mut carol).await;
    assert!(answered.is_empty(), "carol was refused: {answered:#?}");
    let (_, bytes) = kept(&ts, &alice).await;
    assert!(bytes <= limits.max_offline_bytes as i64, "{bytes}");
    ts.stop().await;
}

#[tokio::test]
async fn a_contact_who_may_not_see_the_user_online_is_not_told_the_store_is_full() {
    let ts = TestServer::start(|c| c.limits.max_offline_messages = 3).await;
    for u in ["sub", "hidden", "seer"] {
        ts.user(u).await;
    }
    ts.make_mutual("sub", "hidden").await;
    ts.make_mutual("sub", "seer").await;
    let sub = ts.jid("sub");
    let except = [::jid::BareJid::new(&ts.jid("hidden")).unwrap()].into();
    let settings = PrivacySettings {
        online: Visibility::ContactsExcept(except),
        last_seen: Visibility::Subscribers,
    };
    ts.shared()
        .store
        .set_privacy_settings(&sub, &settings)
        .await
        .unwrap();
    // Control: the contact the gate admits fills the store and is told it is full.
    let mut seer = online(&ts, "seer", "s").await;
    for i in 0..4 {
        seer.send(&with_body(&sub, &format!("s{i}"), "x")).await;
    }
    let answered = answers_so_far(&ts, &mut seer).await;
    assert_eq!(answered.len(), 1, "{answered:#?}");
    assert_error(&answered[0], "service-unavailable", "cancel", "full store");
    // The hidden contact gets what a user who is online gives: nothing.
    let mut hidden = online(&ts, "hidden", "h").await;
    for i in 0..4 {
        hidden.send(&with_body(&sub, &format!("h{i}"), "x")).await;
    }
    let answered = answers_so_far(&ts, &mut hidden).await;
    assert!(
        answered.is_empty(),
        "the hidden contact was told: {answered:#?}"
    );
    ts.stop().await;
}

#[tokio::test]
async fn body_less_messages_are_kept_only_for_a_contacts_receipts_and_markers() {
    let ts = TestServer::start(|_| {}).await;
    for u in ["alice", "bob", "mallory"] {
        ts.user(u).await;
    }
    ts.make_mutual("alice", "bob").await;
    let alice = ts.jid("alice");
    let signals = [
        format!("<store xmlns='{NS_HINTS}'/>"),
        format!("<received xmlns='{NS_RECEIPTS}' id='r1'/>"),
        format!("<displayed xmlns='{NS_MARKERS}' id='r1'/>"),
    ];
    for who in ["mallory", "bob"] {
        let mut c = online(&ts, who, "x").await;
        for (i, s) in signals.iter().enumerate() {
            c.send(&el(&format!(
                "<message xmlns='jabber:client' type='chat' id='{who}{i}' to='{alice}'>{s}</message>"
            )))
            .await;
        }
        let answered = answers_so_far(&ts, &mut c).await;
        assert!(answered.is_empty(), "{who}: {answered:#?}");
    }
    let mut a = online(&ts, "alice", "phone").await;
    let got: Vec<String> = answers_so_far(&ts, &mut a)
        .await
        .iter()
        .filter(|e| e.name == "message")
        .filter_map(|e| e.get_attr("id").map(str::to_owned))
        .collect();
    // The receipt and the marker of bob's; nothing of mallory's, no body-less hint.
    assert_eq!(got, ["bob1", "bob2"]);
    ts.stop().await;
}

#[tokio::test]
async fn a_contacts_message_displaces_the_oldest_strangers_messages_from_a_full_store() {
    let ts = TestServer::start(|c| {
        c.limits.max_offline_messages = 4;
        c.limits.max_offline_messages_per_stranger = 2;
    })
    .await;
    for u in ["alice", "bob", "s1", "s2", "s3"] {
        ts.user(u).await;
    }
    ts.make_mutual("alice", "bob").await;
    let alice = ts.jid("alice");
    // Two strangers fill the store within their shares; a third finds no room.
    for who in ["s1", "s2", "s3"] {
        let mut s = online(&ts, who, "r").await;
        for i in 0..3 {
            s.send(&with_body(&alice, &format!("{who}-{i}"), "hi"))
                .await;
        }
        let answered = answers_so_far(&ts, &mut s).await;
        assert!(answered.is_empty(), "{who} was answered: {answered:#?}");
    }
    assert_eq!(kept(&ts, &alice).await.0, 4);
    // Bob's two messages take the places of s1's, the oldest.
    let mut bob = online(&ts, "bob", "b").await;
    for i in 0..2 {
        bob.send(&with_body(&alice, &format!("bob-{i}"), "hi"))
            .await;
    }
    let answered = answers_so_far(&ts, &mut bob).await;
    assert!(answered.is_empty(), "bob was refused: {answered:#?}");
    let mut a = online(&ts, "alice", "phone").await;
    let mut got: Vec<String> = answers_so_far(&ts, &mut a)
        .await
        .iter()
        .filter_map(|e| e.get_attr("id").map(str::to_owned))
        .collect();
    got.sort();
    assert_eq!(got, ["bob-0", "bob-1", "s2-0", "s2-1"]);
    ts.stop().await;
}

/// The cluster path takes the same decision: a stranger on node 1 writing to users whose
/// sessions are on node 2 (visible, invisible), to an offline user with a full store and to
/// no account gets the same silence as on the users' own node.
#[tokio::test]
async fn a_stranger_on_another_cluster_node_gets_the_same_silence() {
    let domain = format!("c{}.example", unique());
    let node = |id: &'static str| {
        move |c: &mut presenced::config::Config| {
            fast_liveness(c);
            c.cluster.node_id = Some(format!("{id}-{}", unique()));
            c.limits.max_offline_messages = 3;
            c.limits.stanzas_per_second = 100_000;
        }
    };
    let n1 = TestServer::start_with_domain(&domain, node("n1")).await;
    let n2 = TestServer::start_with_domain(&domain, node("n2")).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while n1.shared().cluster.peers().is_empty() || n2.shared().cluster.peers().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "nodes did not see each other"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    for u in ["stranger", "contact", "off", "on", "inv", "full"] {
        n1.user(u).await;
    }
    n1.make_mutual("full", "contact").await;
    let full = n1.jid("full");
    let mut contact = online(&n2, "contact", "c").await;
    for i in 0..3 {
        contact.send(&with_body(&full, &format!("c{i}"), "x")).await;
    }
    barrier(&n2, &mut contact).await;
    assert_eq!(kept(&n1, &full).await.0, 3);
    let _on = online(&n2, "on", "r").await;
    let mut inv = n2.login("inv", "r").await;
    let r = inv
        .iq(
            "set",
            None,
            el(&format!("<invisible xmlns='{NS_INVISIBLE}'/>")),
        )
        .await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    inv.presence(None, None).await;
    barrier(&n2, &mut inv).await;
    // Node 1 reads where "on" and "inv" are from the directory.
    for name in ["on", "inv"] {
        let full = presenced::protocol::jid::FullJid::new(&format!("{}/r", n1.jid(name))).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !n1
            .shared()
            .cluster
            .holder_of(&full)
            .await
            .is_some_and(|h| h.entry.available)
        {
            assert!(
                std::time::Instant::now() < deadline,
                "{full} not in the directory"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    let mut stranger = online(&n1, "stranger", "s").await;
    let mut seen = Vec::new();
    for name in ["nobody", "off", "on", "inv", "full"] {
        seen.push((name, stranger_transcript(&n1, &mut stranger, name).await));
    }
    let answered: Vec<(&str, usize)> = seen.iter().map(|(n, t)| (*n, t.len())).collect();
    assert!(
        seen.iter().all(|(_, t)| t.is_empty()),
        "the stranger was answered (target, answers): {answered:?}"
    );
    // The messages to "on" and "inv" reached them on node 2 (delivered, not kept).
    assert_eq!(kept(&n1, &n1.jid("on")).await.0, 0);
    assert_eq!(kept(&n1, &n1.jid("inv")).await.0, 0);
    n1.stop().await;
    n2.stop().await;
}
