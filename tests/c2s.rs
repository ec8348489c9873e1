//! Client-to-server core (issue 2) against the real server, PostgreSQL and TLS.

mod common;

use common::*;
use presenced::xml::{Element, NS_CLIENT};

#[tokio::test]
async fn message_between_two_users_is_delivered_with_stamped_from() {
    let ts = TestServer::start(|_| {}).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let mut alice = ts.login("alice", "phone").await;
    let mut bob = ts.login("bob", "pc").await;
    bob.presence(None, None).await;
    bob.expect(|e| is_presence(e, &ts.jid("bob"), None)).await;
    let msg = Element::new("message", NS_CLIENT)
        .attr("to", ts.jid("bob"))
        .attr("type", "chat")
        .child(Element::new("body", NS_CLIENT).text("hi bob"));
    alice.send(&msg).await;
    let got = bob.expect(|e| e.name == "message").await;
    assert_eq!(got.get_attr("from"), Some(alice.jid.as_str()));
    assert_eq!(
        got.get_child("body", NS_CLIENT).map(|b| b.text_content()),
        Some("hi bob".into())
    );
    ts.stop().await;
}
