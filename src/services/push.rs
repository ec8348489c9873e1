//! XEP-0357 push notifications: a client that sleeps (iOS suspends an app seconds after it
//! leaves the screen, Android in Doze) names an app server, which wakes it through Apple's
//! or Google's service; this server tells that app server when something arrives that the
//! client would want to be woken for.
//!
//! - **Enabling** (§5): `<enable jid node/>` with an optional publish-options form (the
//!   client's secret for its app server) is kept per account in the store
//!   ([`crate::store::push`]) and on the session that sent it. It outlives the session: a
//!   phone whose session is gone is still woken. `<disable jid [node]/>` (§6) removes it.
//! - **When** a notification goes (§7): for a message worth waking for ([`wakes`]: one with
//!   a body or an encrypted payload) or a subscription request, when it is kept for the
//!   user because no resource takes it (offline storage: every registration of the
//!   account), or when it is queued for a push-enabled session whose connection died and
//!   that waits for its client to resume it (that session's registration only). A message
//!   delivered to a connected resource wakes nothing.
//! - **What** it says: the `urn:xmpp:push:summary` form, cut by `[push] summary`: by
//!   default the counts only, never the sender or the text, since the app server is a
//!   third party (and behind it Apple or Google). `message-count` counts the one message
//!   that triggered it, as Prosody does; the client fetches the rest when it connects.
//! - **Limits**: a registration sends at most `[push] burst` notifications at once, then
//!   `per_minute`: a flood of messages wakes a phone a few times, not once per message.
//!   `max_errors` error answers in a row from the app server remove the registration
//!   (§9 lets a server stop notifying a node that fails); an answer counts on the node
//!   that sent the notification, and a notification nobody answers counts nothing.
//!
//! A suspended session's presence (hibernation) is the c2s session's
//! (`transport/c2s/session.rs`) and presence's ([`crate::services::presence`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::config::{PushConfig, PushSummary};
use crate::node::outbox::Outbox;
use crate::node::session::Client;
use crate::node::sessions::{PushTarget, Sessions};
use crate::policy::rate_limit::TokenBucket;
use crate::protocol::error::{iq_result, StanzaError};
use crate::protocol::jid::BareJid;
use crate::protocol::stanza::{IqType, MessageType, PresenceType};
use crate::protocol::xml::{Element, NS_CLIENT};
use crate::store::push::Enable;
use crate::store::Store;

/// XEP-0357's namespace, and the feature an account advertises (§4).
pub const NS_PUSH: &str = "urn:xmpp:push:0";
const NS_SUMMARY: &str = "urn:xmpp:push:summary";
const NS_PUBSUB: &str = "http://jabber.org/protocol/pubsub";
const NS_DATA: &str = "jabber:x:data";

/// The prefix of a notification's iq id: an answer with another id is not ours.
const ID_PREFIX: &str = "push-";
/// Notifications awaiting an answer, at most; past it the oldest are forgotten.
const MAX_PENDING: usize = 10_000;
/// How long an answer is waited for before the notification is forgotten (uncounted).
const ANSWER_WINDOW: Duration = Duration::from_secs(60);
/// Registrations whose rate this node tracks at once; past it, full buckets are forgotten.
const MAX_BUCKETS: usize = 100_000;

/// What made a notification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trigger<'a> {
    /// A message worth waking for, from `from`, with its body if it has one.
    Message {
        /// The sender's JID as the message carries it.
        from: &'a str,
        /// The text, when there is a plain body.
        body: Option<String>,
    },
    /// A subscription request from `from`.
    Subscription {
        /// Who asks.
        from: &'a str,
    },
}

impl<'a> Trigger<'a> {
    /// The trigger a stanza for the user is, if it is worth waking a phone for.
    pub fn of(el: &'a Element) -> Option<Trigger<'a>> {
        let from = el.get_attr("from").unwrap_or_default();
        match el.name.as_str() {
            "message" if wakes(el) => Some(Trigger::Message {
                from,
                body: el
                    .get_child("body", NS_CLIENT)
                    .map(Element::text_content)
                    .filter(|t| !t.is_empty()),
            }),
            "presence" if PresenceType::of(el) == Some(PresenceType::Subscribe) => {
                Some(Trigger::Subscription { from })
            }
            _ => None,
        }
    }
}

/// Whether a message is one a person would want their phone woken for: a chat, normal or
/// groupchat message with a body, or with an encrypted payload whose body the server
/// cannot see (OMEMO). Chat states, receipts, markers and headlines wake nothing.
pub fn wakes(msg: &Element) -> bool {
    let kind = MessageType::of(msg);
    if matches!(kind, MessageType::Headline | MessageType::Error) {
        return false;
    }
    msg.elements()
        .any(|c| (c.name == "body" && c.ns == NS_CLIENT) || c.name == "encrypted")
}

/// The summary form a notification carries, cut by `level` (XEP-0357 §7); `None` sends
/// none.
pub fn summary(level: PushSummary, trigger: &Trigger<'_>) -> Option<Element> {
    let field = |var: &str, value: &str| {
        Element::new("field", NS_DATA)
            .attr("var", var)
            .child(Element::new("value", NS_DATA).text(value))
    };
    if level == PushSummary::None {
        return None;
    }
    let mut form = Element::new("x", NS_DATA)
        .attr("type", "submit")
        .child(field("FORM_TYPE", NS_SUMMARY));
    match trigger {
        Trigger::Message { from, body } => {
            form = form.child(field("message-count", "1"));
            if matches!(level, PushSummary::Sender | PushSummary::Body) {
                form = form.child(field("last-message-sender", from));
            }
            if let (PushSummary::Body, Some(body)) = (level, body.as_deref()) {
                form = form.child(field("last-message-body", body));
            }
        }
        Trigger::Subscription { .. } => {
            form = form.child(field("pending-subscription-count", "1"));
        }
    }
    Some(form)
}

/// The `<iq type='set'/>` that publishes one notification to `target`'s node for `owner`
/// (XEP-0357 §7): from the user's bare JID, with the client's publish options.
pub fn notification(owner: &str, target: &PushTarget, id: &str, form: Option<Element>) -> Element {
    let mut note = Element::new("notification", NS_PUSH);
    if let Some(form) = form {
        note = note.child(form);
    }
    let mut pubsub = Element::new("pubsub", NS_PUBSUB).child(
        Element::new("publish", NS_PUBSUB)
            .attr("node", target.node.as_str())
            .child(Element::new("item", NS_PUBSUB).child(note)),
    );
    if let Some(options) = crate::protocol::xml::parse_element(&target.options) {
        pubsub = pubsub.child(Element::new("publish-options", NS_PUBSUB).child(options));
    }
    Element::new("iq", NS_CLIENT)
        .attr("type", "set")
        .attr("from", owner)
        .attr("to", target.app_jid.as_str())
        .attr("id", id)
        .child(pubsub)
}

/// Counters of the service (`/metrics`).
#[derive(Debug, Default)]
pub struct PushCounters {
    /// Notifications sent.
    pub sent: AtomicU64,
    /// Notifications not sent: the registration was over its rate.
    pub limited: AtomicU64,
    /// Error answers from app servers.
    pub errors: AtomicU64,
    /// Registrations removed after `max_errors` errors in a row.
    pub removed: AtomicU64,
}

/// One notification awaiting its answer.
struct Pending {
    owner: BareJid,
    target: Arc<PushTarget>,
    sent: Instant,
}

#[derive(Default)]
struct State {
    /// Per registration ([`key`]): the rate bucket.
    buckets: HashMap<String, TokenBucket>,
    /// Per registration: error answers in a row.
    errors: HashMap<String, u32>,
    /// Notification id → what it was sent for.
    pending: HashMap<String, Pending>,
    next_id: u64,
}

/// The service: the iq a client enables and disables push with, the notifications, and
/// the answers to them.
pub struct Push {
    store: Store,
    outbox: Arc<Outbox>,
    sessions: Arc<Sessions>,
    clock: crate::clock::Clock,
    settings: PushConfig,
    state: Mutex<State>,
    /// What was sent and refused.
    pub counters: PushCounters,
}

/// A registration's key on this node: account, app server, node.
fn key(owner: &str, target: &PushTarget) -> String {
    format!("{owner}\u{0}{}\u{0}{}", target.app_jid, target.node)
}

impl Push {
    /// The service over these parts of the node.
    pub fn new(
        store: Store,
        outbox: Arc<Outbox>,
        sessions: Arc<Sessions>,
        clock: crate::clock::Clock,
        settings: PushConfig,
    ) -> Self {
        Push {
            store,
            outbox,
            sessions,
            clock,
            settings,
            state: Mutex::default(),
            counters: PushCounters::default(),
        }
    }

    /// Whether clients may enable push (`[push] enabled`).
    pub fn enabled(&self) -> bool {
        self.settings.enabled
    }

    /// How long a push-enabled session whose connection died is kept (`[push] hibernation`).
    pub fn hibernation(&self) -> Duration {
        self.settings.hibernation
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// XEP-0357 §5–§6: `<enable/>` or `<disable/>` from `client` for its own account.
    pub async fn handle_iq(
        &self,
        client: &Client,
        iq: &Element,
        ty: IqType,
        payload: &Element,
    ) -> Element {
        let refuse = |e: StanzaError| e.reply_to(iq).unwrap_or_else(|| iq_result(iq));
        if !self.settings.enabled {
            return refuse(StanzaError::service_unavailable());
        }
        if ty != IqType::Set {
            // §5: both are sets.
            return refuse(StanzaError::bad_request());
        }
        let Some(app_jid) = payload
            .get_attr("jid")
            .and_then(|j| crate::protocol::jid::parse(j).ok())
        else {
            // RFC 6120 §8.3.3.8: the app server's address is missing or no JID.
            return refuse(StanzaError::jid_malformed());
        };
        let node = payload.get_attr("node").filter(|n| !n.is_empty());
        let owner = client.jid().to_bare();
        let (Some(user), domain) = (owner.node(), owner.domain()) else {
            return refuse(StanzaError::bad_request());
        };
        match payload.name.as_str() {
            "enable" => {
                let Some(node) = node else {
                    // §5: the node is required.
                    return refuse(StanzaError::bad_request());
                };
                let options = payload
                    .get_child("x", NS_DATA)
                    .map(Element::to_xml)
                    .unwrap_or_default();
                if options.len() > self.settings.max_options_bytes
                    || node.len() > 1024
                    || app_jid.as_str().len() > 3071
                {
                    // RFC 6120 §8.3.3.9: more than this server keeps.
                    return refuse(StanzaError::not_acceptable());
                }
                let e = Enable {
                    app_jid: app_jid.as_str(),
                    node,
                    resource: client.jid().resource().as_str(),
                    options: &options,
                    now: self.clock.now_ms() / 1000,
                    max: i64::from(self.settings.max_registrations),
                };
                match self
                    .store
                    .enable_push(user.as_str(), domain.as_str(), e)
                    .await
                {
                    Ok(true) => {}
                    Ok(false) => return refuse(StanzaError::item_not_found()),
                    Err(e) => {
                        tracing::warn!(jid = %client.jid(), error = %e, "push registration not kept");
                        return refuse(StanzaError::internal_server_error());
                    }
                }
                let target = Arc::new(PushTarget {
                    app_jid: app_jid.to_string(),
                    node: node.to_owned(),
                    options,
                });
                self.forget(&key(owner.as_str(), &target));
                client.handle.write(|p| p.push = Some(target));
                tracing::info!(jid = %client.jid(), app = %app_jid, "push enabled (XEP-0357)");
                iq_result(iq)
            }
            "disable" => {
                let gone = self
                    .store
                    .disable_push(user.as_str(), domain.as_str(), app_jid.as_str(), node)
                    .await;
                if let Err(e) = gone {
                    tracing::warn!(jid = %client.jid(), error = %e, "push registration not removed");
                    return refuse(StanzaError::internal_server_error());
                }
                self.drop_targets(&owner, app_jid.as_str(), node);
                tracing::info!(jid = %client.jid(), app = %app_jid, "push disabled (XEP-0357)");
                iq_result(iq)
            }
            _ => refuse(StanzaError::feature_not_implemented()),
        }
    }

    /// The sessions here of `owner` that enabled `app_jid` (and `node`, or any) forget it.
    fn drop_targets(&self, owner: &BareJid, app_jid: &str, node: Option<&str>) {
        for s in self.sessions.of_user(owner) {
            s.write(|p| {
                if p.push
                    .as_ref()
                    .is_some_and(|t| t.app_jid == app_jid && node.is_none_or(|n| t.node == n))
                {
                    p.push = None;
                }
            });
        }
    }

    /// Something was kept for `owner` because no resource takes it (offline storage, a
    /// subscription request while offline): every registration of the account is told.
    pub async fn kept_for(&self, owner: &BareJid, trigger: &Trigger<'_>) {
        if !self.settings.enabled {
            return;
        }
        let Some(user) = owner.node() else {
            return;
        };
        let regs = match self
            .store
            .push_registrations(user.as_str(), owner.domain().as_str())
            .await
        {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(%owner, error = %e, "push registrations unreadable; no notification");
                return;
            }
        };
        for r in regs {
            let target = PushTarget {
                app_jid: r.app_jid,
                node: r.node,
                options: r.options,
            };
            self.notify(owner, Arc::new(target), trigger);
        }
    }

    /// Sends one notification for `owner` to `target`, within its rate.
    pub fn notify(&self, owner: &BareJid, target: Arc<PushTarget>, trigger: &Trigger<'_>) {
        if !self.settings.enabled {
            return;
        }
        let now = self.clock.instant();
        let k = key(owner.as_str(), &target);
        let id = {
            let mut st = self.lock();
            if st.buckets.len() >= MAX_BUCKETS {
                st.buckets.retain(|_, b| !b.is_full_at(now));
            }
            let bucket = st.buckets.entry(k).or_insert_with(|| {
                TokenBucket::per_minute(self.settings.per_minute, self.settings.burst)
            });
            if !bucket.take(now) {
                drop(st);
                self.counters.limited.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%owner, app = %target.app_jid, "push over its rate; not sent");
                return;
            }
            if st.pending.len() >= MAX_PENDING {
                st.pending
                    .retain(|_, p| now.saturating_duration_since(p.sent) < ANSWER_WINDOW);
                if st.pending.len() >= MAX_PENDING {
                    st.pending.clear();
                }
            }
            st.next_id += 1;
            // Unguessable as well as unique: only the app server should answer it.
            let id = format!("{ID_PREFIX}{}-{:016x}", st.next_id, rand::random::<u64>());
            st.pending.insert(
                id.clone(),
                Pending {
                    owner: owner.clone(),
                    target: target.clone(),
                    sent: now,
                },
            );
            id
        };
        let iq = notification(
            owner.as_str(),
            &target,
            &id,
            summary(self.settings.summary, trigger),
        );
        self.counters.sent.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(%owner, app = %target.app_jid, "push notification sent (XEP-0357)");
        if self.outbox.is_local(&target.app_jid) {
            // An app server that is an account here takes the notifications of whoever
            // named it, unless it blocks them (XEP-0191 §3.3, as for any iq to it): an
            // account cannot be made a target of another's notifications against its will.
            // A remote app server's own server applies its rules.
            let (store, outbox) = (self.store.clone(), self.outbox.clone());
            let app = target.app_jid.clone();
            let owner = owner.to_string();
            tokio::spawn(async move {
                let blocked = store
                    .is_blocked(crate::protocol::jid::bare_of(&app), &owner)
                    .await
                    .unwrap_or(true);
                if !blocked {
                    outbox.to_local(&app, iq);
                }
            });
        } else if let Err(e) = self.outbox.route_remote(iq) {
            tracing::info!(%owner, app = %target.app_jid, error = ?e, "push notification not routed");
            self.answered_with(&id, None, false);
        }
    }

    /// An iq result or error addressed to a local account: if it answers a notification,
    /// it is counted (and `true` returned), else it is not ours.
    pub fn answer(&self, el: &Element) -> bool {
        let Some(id) = el.get_attr("id").filter(|i| i.starts_with(ID_PREFIX)) else {
            return false;
        };
        let ok = match IqType::of(el) {
            Some(IqType::Result) => true,
            Some(IqType::Error) => false,
            _ => return false,
        };
        let from = el.get_attr("from").unwrap_or_default();
        self.answered_with(id, Some(from), ok)
    }

    /// Counts the answer to notification `id` from `from` (`None`: this server itself, for a
    /// notification it could not route).
    fn answered_with(&self, id: &str, from: Option<&str>, ok: bool) -> bool {
        let (owner, target, errors) = {
            let mut st = self.lock();
            let Some(p) = st.pending.get(id) else {
                return false;
            };
            // Only the app server answers for itself (or its own server for it, with
            // the server's address): anyone else could end a registration with errors.
            let app = p.target.app_jid.as_str();
            let by_app = |f: &str| {
                use crate::protocol::jid::{bare_of, domain_of};
                bare_of(f) == bare_of(app) || f == domain_of(app)
            };
            if from.is_some_and(|f| !by_app(f)) {
                return false;
            }
            let Some(p) = st.pending.remove(id) else {
                return false;
            };
            let k = key(p.owner.as_str(), &p.target);
            if ok {
                st.errors.remove(&k);
                return true;
            }
            let n = st.errors.entry(k.clone()).or_insert(0);
            *n += 1;
            let n = *n;
            if n >= self.settings.max_errors.max(1) {
                st.errors.remove(&k);
                st.buckets.remove(&k);
            }
            (p.owner, p.target, n)
        };
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        tracing::info!(%owner, app = %target.app_jid, errors, "push notification refused by the app server");
        if errors >= self.settings.max_errors.max(1) {
            self.counters.removed.fetch_add(1, Ordering::Relaxed);
            self.drop_targets(&owner, &target.app_jid, Some(&target.node));
            let store = self.store.clone();
            tokio::spawn(async move {
                let Some(user) = owner.node() else { return };
                let removed = store
                    .disable_push(
                        user.as_str(),
                        owner.domain().as_str(),
                        &target.app_jid,
                        Some(&target.node),
                    )
                    .await;
                match removed {
                    Ok(_) => {
                        tracing::warn!(%owner, app = %target.app_jid, "push registration removed after repeated errors")
                    }
                    Err(e) => tracing::warn!(%owner, error = %e, "push registration not removed"),
                }
            });
        }
        true
    }

    /// The counters, as `/metrics` shows them.
    pub fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        let c = &self.counters;
        for (name, help, v) in [
            (
                "push_notifications",
                "XEP-0357 notifications sent to app servers.",
                &c.sent,
            ),
            (
                "push_rate_limited",
                "Notifications not sent: the registration was over its rate.",
                &c.limited,
            ),
            ("push_errors", "Error answers from app servers.", &c.errors),
            (
                "push_registrations_removed",
                "Registrations removed after repeated errors.",
                &c.removed,
            ),
        ] {
            crate::metrics::counter(encoder, name, help, v.load(Ordering::Relaxed))?;
        }
        Ok(())
    }

    /// A registration enabled again starts with no errors and a full bucket.
    fn forget(&self, k: &str) {
        let mut st = self.lock();
        st.errors.remove(k);
        st.buckets.remove(k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::xml::parse_element;

    fn msg(xml: &str) -> Element {
        parse_element(xml).expect("xml")
    }

    #[test]
    fn a_body_or_an_encrypted_payload_wakes_and_chat_states_do_not() {
        assert!(wakes(&msg(
            "<message xmlns='jabber:client' type='chat'><body>hi</body></message>"
        )));
        assert!(wakes(&msg(
            "<message xmlns='jabber:client'><encrypted xmlns='eu.siacs.conversations.axolotl'/></message>"
        )));
        assert!(!wakes(&msg(
            "<message xmlns='jabber:client' type='chat'><active xmlns='http://jabber.org/protocol/chatstates'/></message>"
        )));
        assert!(!wakes(&msg(
            "<message xmlns='jabber:client' type='headline'><body>news</body></message>"
        )));
    }

    #[test]
    fn the_default_summary_names_neither_sender_nor_text() {
        let el = msg("<message xmlns='jabber:client' from='juliet@capulet.lit/balcony'><body>Wherefore</body></message>");
        let t = Trigger::of(&el).expect("wakes");
        let counts = summary(PushSummary::Counts, &t).expect("form").to_xml();
        assert!(counts.contains("message-count"));
        assert!(!counts.contains("juliet") && !counts.contains("Wherefore"));
        let sender = summary(PushSummary::Sender, &t).expect("form").to_xml();
        assert!(sender.contains("juliet@capulet.lit/balcony") && !sender.contains("Wherefore"));
        let body = summary(PushSummary::Body, &t).expect("form").to_xml();
        assert!(body.contains("juliet") && body.contains("Wherefore"));
        assert!(summary(PushSummary::None, &t).is_none());
    }

    #[test]
    fn a_subscription_request_is_a_trigger_and_other_presence_is_not() {
        let sub =
            msg("<presence xmlns='jabber:client' from='romeo@montague.lit' type='subscribe'/>");
        assert_eq!(
            Trigger::of(&sub),
            Some(Trigger::Subscription {
                from: "romeo@montague.lit"
            })
        );
        let form = summary(PushSummary::Counts, &Trigger::of(&sub).unwrap())
            .unwrap()
            .to_xml();
        assert!(form.contains("pending-subscription-count") && !form.contains("romeo"));
        assert!(Trigger::of(&msg("<presence xmlns='jabber:client' from='a@b'/>")).is_none());
    }

    #[test]
    fn a_notification_carries_the_node_and_the_clients_publish_options() {
        let target = PushTarget {
            app_jid: "push.example.org".into(),
            node: "yxs32".into(),
            options: "<x xmlns='jabber:x:data' type='submit'><field var='secret'><value>s3</value></field></x>".into(),
        };
        let iq = notification("romeo@montague.lit", &target, "push-1", None);
        let xml = iq.to_xml();
        assert_eq!(iq.get_attr("to"), Some("push.example.org"));
        assert_eq!(iq.get_attr("from"), Some("romeo@montague.lit"));
        assert!(xml.contains("node=\"yxs32\"") || xml.contains("node='yxs32'"));
        assert!(xml.contains("publish-options") && xml.contains("s3"));
        assert!(xml.contains(NS_PUSH));
    }
}
