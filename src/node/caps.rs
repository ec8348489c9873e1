//! XEP-0115 entity capabilities: what a client's `<c/>` in presence says it supports, so
//! that personal eventing (XEP-0163 §4.4, `crate::services::pep`) notifies only resources that asked
//! for a node with `<node>+notify`.
//!
//! A `ver` names a set of features: the server asks one client with that `ver` for its
//! disco#info once, checks that the answer hashes to the `ver` (XEP-0115 §5.1 and §5.4,
//! `sha-1` or `sha-256`), and remembers the features for every client that announces
//! the same `ver`. An answer that does not hash to its `ver` is used for the session
//! that gave it and never remembered for others (§5.4 item 3.8: do not cache it).
//!
//! Bounded: at most `[limits] max_caps_entries` `ver`s are remembered (the oldest is
//! forgotten first) and as many queries may be outstanding; each session also keeps the
//! features it was answered with ([`CapsCache::session_features`]) so that a forgotten
//! `ver` costs a new query, never a lost notification.
//!
//! A client that announces `ver` after `ver` and answers nothing must not use up the
//! outstanding queries the node's other clients need: one session has at most
//! `[limits] max_caps_queries_per_session` queries outstanding (a further `ver` is not
//! asked; its next presence asks again once one is answered), and a query unanswered
//! after `[limits] caps_query_timeout` is dropped, so the next client announcing that
//! `ver` is asked instead of waiting for a session that never answers. That timeout is
//! measured on the node's clock ([`Clock::instant`]), which a test can pause.
//!
//! This is node state (one cache per node); nothing here sends a stanza.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use sha1::Digest;

use crate::clock::Clock;
use crate::protocol::jid::FullJid;
use crate::protocol::xml::{Element, NS_DISCO_INFO};

/// XEP-0115 namespace of the `<c/>` element.
pub(crate) const NS_CAPS: &str = "http://jabber.org/protocol/caps";
/// XEP-0004 data forms (XEP-0128 extended disco info, part of the hashed string).
const NS_DATA: &str = "jabber:x:data";

/// The `<c/>` of a presence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caps {
    /// The client's software URI.
    pub node: String,
    /// The verification string's hash, base64.
    pub ver: String,
    /// The hash function (IANA name: `sha-1`, `sha-256`).
    pub hash: String,
}

impl Caps {
    /// The `<c/>` of `presence`, if it has one with `node`, `ver` and `hash` (the legacy
    /// form without `hash` is not supported: its `ver` names no verifiable set).
    pub fn of_presence(presence: &Element) -> Option<Caps> {
        let c = presence.get_child("c", NS_CAPS)?;
        Some(Caps {
            node: c.get_attr("node")?.to_owned(),
            ver: c.get_attr("ver")?.to_owned(),
            hash: c.get_attr("hash")?.to_owned(),
        })
    }
}

/// A data-form field of an extended disco#info answer: its `var` and values.
type Field = (String, Vec<String>);

/// The XEP-0115 §5.1 verification string of a disco#info `<query/>`, `None` when §5.4
/// item 3 says the answer is unusable (duplicate identities or features, two forms of
/// one FORM_TYPE, a form whose FORM_TYPE is not hidden).
pub(crate) fn verification_string(query: &Element) -> Option<String> {
    let mut identities = Vec::new();
    let mut features = Vec::new();
    let mut forms: Vec<(String, Vec<Field>)> = Vec::new();
    for child in query.elements() {
        if child.is("identity", NS_DISCO_INFO) {
            identities.push(format!(
                "{}/{}/{}/{}",
                child.get_attr("category").unwrap_or(""),
                child.get_attr("type").unwrap_or(""),
                child.get_attr("xml:lang").unwrap_or(""),
                child.get_attr("name").unwrap_or("")
            ));
        } else if child.is("feature", NS_DISCO_INFO) {
            features.push(child.get_attr("var").unwrap_or("").to_owned());
        } else if child.is("x", NS_DATA) && child.get_attr("type") == Some("result") {
            let mut form_type = None;
            let mut fields = Vec::new();
            for f in child.elements().filter(|f| f.is("field", NS_DATA)) {
                let var = f.get_attr("var").unwrap_or("").to_owned();
                let mut values: Vec<String> = f
                    .elements()
                    .filter(|v| v.is("value", NS_DATA))
                    .map(|v| v.text_content())
                    .collect();
                if var == "FORM_TYPE" {
                    if f.get_attr("type") != Some("hidden") || values.len() != 1 {
                        return None;
                    }
                    form_type = values.pop();
                } else {
                    values.sort();
                    fields.push((var, values));
                }
            }
            // §5.4 3.6: a form without FORM_TYPE is ignored.
            if let Some(t) = form_type {
                fields.sort();
                forms.push((t, fields));
            }
        }
    }
    identities.sort();
    features.sort();
    forms.sort_by(|a, b| a.0.cmp(&b.0));
    let dup = |v: &[String]| v.windows(2).any(|w| w[0] == w[1]);
    if dup(&identities) || dup(&features) || forms.windows(2).any(|w| w[0].0 == w[1].0) {
        return None;
    }
    let mut s = String::new();
    for i in identities {
        s.push_str(&i);
        s.push('<');
    }
    for f in features {
        s.push_str(&f);
        s.push('<');
    }
    for (t, fields) in forms {
        s.push_str(&t);
        s.push('<');
        for (var, values) in fields {
            s.push_str(&var);
            s.push('<');
            for v in values {
                s.push_str(&v);
                s.push('<');
            }
        }
    }
    Some(s)
}

/// Whether `query` hashes to `caps.ver` with `caps.hash` (XEP-0115 §5.4 item 3).
pub(crate) fn verify(caps: &Caps, query: &Element) -> bool {
    let Some(s) = verification_string(query) else {
        return false;
    };
    let digest = match caps.hash.as_str() {
        "sha-1" => sha1::Sha1::digest(s.as_bytes()).to_vec(),
        "sha-256" => sha2::Sha256::digest(s.as_bytes()).to_vec(),
        _ => return false,
    };
    base64::engine::general_purpose::STANDARD.encode(digest) == caps.ver
}

/// The features of a disco#info `<query/>`.
pub(crate) fn features_of(query: &Element) -> HashSet<String> {
    query
        .elements()
        .filter(|f| f.is("feature", NS_DISCO_INFO))
        .filter_map(|f| f.get_attr("var").map(str::to_owned))
        .collect()
}

/// A set of features.
pub(crate) type Features = Arc<HashSet<String>>;

/// A session a query was asked of or waits for: its full JID (where the query goes and
/// who may answer it) and its id, since a later session that binds the same full JID is
/// another session (`sessions::SessionHandle::id`) and learns nothing meant for this one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Asker {
    /// The bound full JID.
    pub full: FullJid,
    /// The session's id.
    pub session: u64,
}

impl Asker {
    /// The session `session` bound to `full`.
    pub fn new(full: &FullJid, session: u64) -> Asker {
        Asker {
            full: full.clone(),
            session,
        }
    }
}

/// One outstanding disco#info query: the `ver` it should confirm and the sessions
/// waiting for its answer.
#[derive(Debug, Clone)]
pub struct Pending {
    /// The `<c/>` that made the server ask.
    pub caps: Caps,
    /// The session asked.
    pub asked: Asker,
    /// Sessions that announced the same `ver` meanwhile.
    pub waiting: Vec<Asker>,
    /// When the query was sent; past the timeout it no longer holds the `ver`.
    pub asked_at: Instant,
}

/// What [`CapsCache::lookup`] found for a presence's `<c/>`.
#[derive(Debug)]
pub enum Lookup {
    /// The `ver`'s features are known.
    Known(Features),
    /// Unknown: ask `full` for its disco#info with this query id.
    Ask(String),
    /// Unknown, and a query for the `ver` is outstanding (or no room for another).
    Waiting,
}

#[derive(Default)]
struct Inner {
    by_ver: HashMap<String, Features>,
    order: VecDeque<String>,
    pending: HashMap<String, Pending>,
    pending_ver: HashMap<String, String>,
    next_id: u64,
}

/// The node's capabilities cache: what each `ver` stands for, and the queries out. A
/// session's own features live in its state (`sessions::SessionState::caps`), set by
/// the caller from what [`CapsCache::lookup`] and [`CapsCache::learn`] return, and go
/// with it.
pub struct CapsCache {
    max: usize,
    per_session: usize,
    timeout: Duration,
    /// Where the time a query was sent, and its age, are read (the node's one clock).
    clock: Clock,
    inner: Mutex<Inner>,
}

impl CapsCache {
    /// A cache remembering at most `max` `ver`s, with at most as many queries outstanding,
    /// `per_session` of them asked of one session, each dropped `timeout` after it was sent
    /// (as `clock` measures it).
    pub fn new(max: usize, per_session: usize, timeout: Duration, clock: Clock) -> CapsCache {
        CapsCache {
            max: max.max(1),
            per_session: per_session.max(1),
            timeout,
            clock,
            inner: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What is known about `caps` announced by the session `who`.
    pub fn lookup(&self, who: &Asker, caps: &Caps) -> Lookup {
        self.lookup_at(who, caps, self.clock.instant())
    }

    /// [`Self::lookup`] at time `now`.
    fn lookup_at(&self, who: &Asker, caps: &Caps, now: Instant) -> Lookup {
        let mut g = self.lock();
        if let Some(f) = g.by_ver.get(&caps.ver) {
            return Lookup::Known(Arc::clone(f));
        }
        // Whoever waited for an expired query of this `ver` waits for the new one.
        let mut waiting = Vec::new();
        if let Some(id) = g.pending_ver.get(&caps.ver).cloned() {
            match g.pending.get_mut(&id) {
                Some(p) if now.duration_since(p.asked_at) < self.timeout => {
                    if p.waiting.len() < self.max && !p.waiting.contains(who) {
                        p.waiting.push(who.clone());
                    }
                    return Lookup::Waiting;
                }
                _ => {
                    if let Some(p) = g.pending.remove(&id) {
                        waiting = p.waiting;
                    }
                    g.pending_ver.remove(&caps.ver);
                }
            }
        }
        if g.pending.len() >= self.max {
            self.drop_expired(&mut g, now);
        }
        let asked_of_this_session = g.pending.values().filter(|p| p.asked == *who).count();
        if g.pending.len() >= self.max || asked_of_this_session >= self.per_session {
            return Lookup::Waiting;
        }
        if !waiting.contains(who) {
            waiting.push(who.clone());
        }
        g.next_id += 1;
        let id = format!("caps-{}", g.next_id);
        g.pending_ver.insert(caps.ver.clone(), id.clone());
        g.pending.insert(
            id.clone(),
            Pending {
                caps: caps.clone(),
                asked: who.clone(),
                waiting,
                asked_at: now,
            },
        );
        Lookup::Ask(id)
    }

    /// Drops the queries unanswered for longer than the timeout.
    fn drop_expired(&self, g: &mut Inner, now: Instant) {
        let expired: Vec<String> = g
            .pending
            .iter()
            .filter(|(_, p)| now.duration_since(p.asked_at) >= self.timeout)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            if let Some(p) = g.pending.remove(&id) {
                g.pending_ver.remove(&p.caps.ver);
            }
        }
    }

    /// An answer (result or error) to query `id` from the session `from`: the pending
    /// query, if `id` is one of ours and `from` is the session asked. The caller verifies
    /// and [`Self::learn`]s.
    pub fn answered(&self, id: &str, from: &Asker) -> Option<Pending> {
        let mut g = self.lock();
        if g.pending.get(id).is_none_or(|p| p.asked != *from) {
            return None;
        }
        let p = g.pending.remove(id)?;
        g.pending_ver.remove(&p.caps.ver);
        Some(p)
    }

    /// Records `features` for the `ver` when the answer was `verified`, and returns the
    /// sessions of `pending` they describe: every one that waited when verified, else
    /// only the one that answered.
    #[must_use]
    pub fn learn(&self, pending: &Pending, features: Features, verified: bool) -> Vec<Asker> {
        let mut g = self.lock();
        if verified {
            if g.by_ver
                .insert(pending.caps.ver.clone(), Arc::clone(&features))
                .is_none()
            {
                g.order.push_back(pending.caps.ver.clone());
            }
            while g.order.len() > self.max {
                if let Some(old) = g.order.pop_front() {
                    g.by_ver.remove(&old);
                }
            }
            pending.waiting.clone()
        } else {
            // Unverified: only the session that answered is believed about itself.
            vec![pending.asked.clone()]
        }
    }

    /// Forgets the queries session `session` was asked and never answered, when it ended
    /// (the next client with that `ver` is asked instead).
    pub fn forget_session(&self, session: u64) {
        let mut g = self.lock();
        let unanswered: Vec<String> = g
            .pending
            .iter()
            .filter(|(_, p)| p.asked.session == session)
            .map(|(id, _)| id.clone())
            .collect();
        for id in unanswered {
            if let Some(p) = g.pending.remove(&id) {
                g.pending_ver.remove(&p.caps.ver);
            }
        }
    }

    /// `ver`s remembered (for tests and metrics).
    pub fn len(&self) -> usize {
        self.lock().by_ver.len()
    }

    /// Whether no `ver` is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(x: &str) -> Element {
        crate::protocol::xml::parse_element(x).expect("xml")
    }

    /// XEP-0115 §5.2, the simple example.
    #[test]
    fn the_simple_example_of_the_xep_verifies() {
        let q = parse(
            "<query xmlns='http://jabber.org/protocol/disco#info'>\
             <identity category='client' name='Exodus 0.9.1' type='pc'/>\
             <feature var='http://jabber.org/protocol/caps'/>\
             <feature var='http://jabber.org/protocol/disco#info'/>\
             <feature var='http://jabber.org/protocol/disco#items'/>\
             <feature var='http://jabber.org/protocol/muc'/></query>",
        );
        let caps = |ver: &str| Caps {
            node: "http://code.google.com/p/exodus".into(),
            ver: ver.into(),
            hash: "sha-1".into(),
        };
        assert!(verify(&caps("QgayPKawpkPSDYmwT/WM94uAlu0="), &q));
        assert!(!verify(&caps("QgayPKawpkPSDYmwT/WM94uAlu1="), &q));
    }

    /// XEP-0115 §5.3, the complex example with an extended form.
    #[test]
    fn the_complex_example_of_the_xep_verifies() {
        let q = parse(
            "<query xmlns='http://jabber.org/protocol/disco#info'>\
             <identity xml:lang='en' category='client' name='Psi 0.11' type='pc'/>\
             <identity xml:lang='el' category='client' name='Ψ 0.11' type='pc'/>\
             <feature var='http://jabber.org/protocol/caps'/>\
             <feature var='http://jabber.org/protocol/disco#info'/>\
             <feature var='http://jabber.org/protocol/disco#items'/>\
             <feature var='http://jabber.org/protocol/muc'/>\
             <x xmlns='jabber:x:data' type='result'>\
             <field var='FORM_TYPE' type='hidden'><value>urn:xmpp:dataforms:softwareinfo</value></field>\
             <field var='ip_version'><value>ipv4</value><value>ipv6</value></field>\
             <field var='os'><value>Mac</value></field>\
             <field var='os_version'><value>10.5.1</value></field>\
             <field var='software'><value>Psi</value></field>\
             <field var='software_version'><value>0.11</value></field>\
             </x></query>",
        );
        let caps = Caps {
            node: "http://psi-im.org".into(),
            ver: "q07IKJEyjvHSyhy//CH0CxmKi8w=".into(),
            hash: "sha-1".into(),
        };
        assert!(verify(&caps, &q));
    }

    #[test]
    fn duplicate_features_make_an_answer_unusable() {
        let q = parse(
            "<query xmlns='http://jabber.org/protocol/disco#info'>\
             <feature var='a'/><feature var='a'/></query>",
        );
        assert_eq!(verification_string(&q), None);
    }

    /// Session `letter@x/1`, whose id is its letter.
    fn who(letter: &str) -> Asker {
        let full = crate::protocol::jid::parse_full(&format!("{letter}@x/1")).unwrap();
        Asker::new(&full, u64::from(letter.as_bytes()[0]))
    }

    #[test]
    fn a_later_session_of_the_same_full_jid_is_another_asker() {
        let cache = CapsCache::new(4, 4, Duration::from_secs(30), Clock::system());
        let caps = Caps {
            node: "n".into(),
            ver: "v".into(),
            hash: "sha-1".into(),
        };
        let full = crate::protocol::jid::parse_full("a@x/1").unwrap();
        let (old, new) = (Asker::new(&full, 1), Asker::new(&full, 2));
        let Lookup::Ask(id) = cache.lookup(&old, &caps) else {
            panic!("ask");
        };
        // The old session's end drops its query even though the new one holds the JID,
        // and an answer from the new session is not the old one's.
        assert!(cache.answered(&id, &new).is_none());
        cache.forget_session(old.session);
        assert!(cache.answered(&id, &old).is_none());
        assert!(matches!(cache.lookup(&new, &caps), Lookup::Ask(_)));
    }

    #[test]
    fn one_query_per_ver_and_the_cache_is_bounded() {
        let cache = CapsCache::new(2, 4, Duration::from_secs(30), Clock::system());
        let caps = |v: &str| Caps {
            node: "n".into(),
            ver: v.into(),
            hash: "sha-1".into(),
        };
        let Lookup::Ask(id) = cache.lookup(&who("a"), &caps("v1")) else {
            panic!("first sight of a ver asks");
        };
        assert!(matches!(
            cache.lookup(&who("b"), &caps("v1")),
            Lookup::Waiting
        ));
        // An answer from anyone but the JID asked is not taken.
        assert!(cache.answered(&id, &who("c")).is_none());
        let p = cache.answered(&id, &who("a")).expect("pending");
        let f: Features = Arc::new(["x+notify".to_owned()].into());
        assert!(cache.learn(&p, Arc::clone(&f), true).contains(&who("b")));
        assert!(matches!(
            cache.lookup(&who("d"), &caps("v1")),
            Lookup::Known(_)
        ));
        for v in ["v2", "v3"] {
            let Lookup::Ask(id) = cache.lookup(&who("a"), &caps(v)) else {
                panic!("ask");
            };
            let p = cache.answered(&id, &who("a")).expect("pending");
            let _ = cache.learn(&p, Arc::clone(&f), true);
        }
        assert_eq!(cache.len(), 2);
        assert!(matches!(
            cache.lookup(&who("e"), &caps("v1")),
            Lookup::Ask(_)
        ));
    }

    #[test]
    fn an_unverified_answer_is_believed_only_about_its_own_session() {
        let cache = CapsCache::new(4, 4, Duration::from_secs(30), Clock::system());
        let caps = Caps {
            node: "n".into(),
            ver: "v".into(),
            hash: "sha-1".into(),
        };
        let Lookup::Ask(id) = cache.lookup(&who("a"), &caps) else {
            panic!("ask");
        };
        cache.lookup(&who("b"), &caps);
        let p = cache.answered(&id, &who("a")).expect("pending");
        let told = cache.learn(&p, Arc::new(HashSet::new()), false);
        assert!(told.contains(&who("a")));
        assert!(!told.contains(&who("b")));
        assert!(cache.is_empty());
    }

    #[test]
    fn a_query_never_answered_is_dropped_with_its_session() {
        let cache = CapsCache::new(1, 4, Duration::from_secs(30), Clock::system());
        let caps = |v: &str| Caps {
            node: "n".into(),
            ver: v.into(),
            hash: "sha-1".into(),
        };
        assert!(matches!(
            cache.lookup(&who("a"), &caps("v1")),
            Lookup::Ask(_)
        ));
        // No room for a second outstanding query.
        assert!(matches!(
            cache.lookup(&who("b"), &caps("v2")),
            Lookup::Waiting
        ));
        cache.forget_session(who("a").session);
        assert!(matches!(
            cache.lookup(&who("b"), &caps("v1")),
            Lookup::Ask(_)
        ));
    }

    #[test]
    fn one_session_has_at_most_its_share_of_outstanding_queries() {
        let cache = CapsCache::new(10, 2, Duration::from_secs(30), Clock::system());
        let caps = |v: &str| Caps {
            node: "n".into(),
            ver: v.into(),
            hash: "sha-1".into(),
        };
        let t = Instant::now();
        assert!(matches!(
            cache.lookup_at(&who("m"), &caps("v1"), t),
            Lookup::Ask(_)
        ));
        assert!(matches!(
            cache.lookup_at(&who("m"), &caps("v2"), t),
            Lookup::Ask(_)
        ));
        for i in 3..20 {
            assert!(matches!(
                cache.lookup_at(&who("m"), &caps(&format!("v{i}")), t),
                Lookup::Waiting
            ));
        }
        // Room is left for everyone else.
        assert!(matches!(
            cache.lookup_at(&who("a"), &caps("w"), t),
            Lookup::Ask(_)
        ));
    }

    #[test]
    fn a_query_unanswered_past_the_timeout_is_asked_of_the_next_client() {
        let timeout = Duration::from_secs(30);
        let cache = CapsCache::new(2, 1, timeout, Clock::system());
        let caps = |v: &str| Caps {
            node: "n".into(),
            ver: v.into(),
            hash: "sha-1".into(),
        };
        let t = Instant::now();
        let Lookup::Ask(old) = cache.lookup_at(&who("m"), &caps("v1"), t) else {
            panic!("first sight asks");
        };
        // Within the timeout the same ver waits for the query sent.
        let soon = t + timeout - Duration::from_millis(1);
        assert!(matches!(
            cache.lookup_at(&who("b"), &caps("v1"), soon),
            Lookup::Waiting
        ));
        // Past it: the next client with that ver is asked, and whoever waited still waits
        // for the answer; the late answer to the dropped query is not taken.
        let late = t + timeout;
        let Lookup::Ask(id) = cache.lookup_at(&who("d"), &caps("v1"), late) else {
            panic!("an expired query is asked again");
        };
        assert!(cache.answered(&old, &who("m")).is_none());
        let p = cache.answered(&id, &who("d")).expect("pending");
        assert!(p.waiting.contains(&who("b")), "{:?}", p.waiting);
        // A full table asks nobody else until a query in it expires.
        assert!(matches!(
            cache.lookup_at(&who("c"), &caps("v2"), late),
            Lookup::Ask(_)
        ));
        assert!(matches!(
            cache.lookup_at(&who("f"), &caps("v3"), late),
            Lookup::Ask(_)
        ));
        assert!(matches!(
            cache.lookup_at(&who("g"), &caps("v4"), late),
            Lookup::Waiting
        ));
        assert!(matches!(
            cache.lookup_at(&who("g"), &caps("v4"), late + timeout),
            Lookup::Ask(_)
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_query_unanswered_for_the_timeout_on_the_nodes_clock_is_asked_of_the_next_client() {
        let timeout = Duration::from_secs(30);
        let cache = CapsCache::new(4, 4, timeout, Clock::tokio());
        let caps = Caps {
            node: "n".into(),
            ver: "v".into(),
            hash: "sha-1".into(),
        };
        let Lookup::Ask(first) = cache.lookup(&who("a"), &caps) else {
            panic!("first sight asks");
        };
        tokio::time::advance(timeout - Duration::from_millis(1)).await;
        assert!(
            matches!(cache.lookup(&who("b"), &caps), Lookup::Waiting),
            "within the timeout the query sent holds the ver"
        );
        tokio::time::advance(Duration::from_millis(1)).await;
        let Lookup::Ask(second) = cache.lookup(&who("c"), &caps) else {
            panic!("a query as old as the timeout is asked again");
        };
        assert_ne!(first, second);
        assert!(cache.answered(&first, &who("a")).is_none(), "dropped");
        let p = cache.answered(&second, &who("c")).expect("pending");
        assert!(p.waiting.contains(&who("b")), "{:?}", p.waiting);
    }
}
