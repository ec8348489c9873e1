//! XEP-0352 client state indication: while a client says it is inactive (a phone with its
//! screen off), presence to it is held and coalesced instead of waking its radio for each
//! contact's change. Offered as the `<csi xmlns='urn:xmpp:csi:0'/>` stream feature.
//!
//! The client sends the nonzas `<inactive/>` and `<active/>` (§5) after binding; the
//! session puts [`Outbound::ClientState`] into its own mailbox, so the switch takes effect
//! exactly between the stanzas queued before and after it. The session's writer passes
//! every outgoing item through one [`Filter`]:
//!
//! - while active, everything is written as it comes;
//! - while inactive, an available or unavailable presence is held, only the latest per
//!   sender full JID (an older one from the same resource is dropped: the client would only
//!   have overwritten it);
//! - a message, and any other presence (subscription requests and answers, errors), is
//!   written at once, after everything held, so the client sees presence and messages in
//!   the order they happened;
//! - an iq is written at once and leaves the held presence held (answers and pings are
//!   not news for the user);
//! - a presence from a contact the client named in its interest list (`crate::services::interest`)
//!   is written at once, replacing anything held from the same resource; the list lapses
//!   `[limits] interest_ttl` after it was last set;
//! - one sender holds at most `[limits] max_csi_held_bytes_per_sender` bytes: beyond its
//!   share, the sender's oldest held presence is written at once (not dropped: the client
//!   still learns everything, in the sender's order), and a presence larger than the share
//!   is never held. A sender is a bare JID of the session's own domain, or a whole remote
//!   domain, whose server names its JIDs at will: so neither one remote server nor one
//!   local account can take the session's holding for itself;
//! - more than `[limits] max_csi_held_presences` held, or more than `max_csi_held_bytes`
//!   bytes, flushes them all (one wake-up of the client for the lot, as the count did),
//!   which bounds what a session holds; so does `<active/>`, which writes them in the order
//!   of their latest update.
//!
//! Held presence is not shown to anyone else and changes nothing in the server's view of
//! the session; it only delays bytes on one socket. This module imports only the model
//! and the session registry's types.

use std::collections::{BTreeMap, HashMap};

use crate::node::sessions::Outbound;
use crate::protocol::jid::SharedJid;
use crate::protocol::stanza::PresenceType;
use crate::protocol::xml::Element;

/// The XEP-0352 namespace.
pub(crate) const NS_CSI: &str = "urn:xmpp:csi:0";

/// What a nonza in [`NS_CSI`] asks for: `Some(true)` for `<active/>`, `Some(false)` for
/// `<inactive/>`, `None` for anything else.
pub(crate) fn nonza(el: &Element) -> Option<bool> {
    if el.ns != NS_CSI {
        return None;
    }
    match el.name.as_str() {
        "active" => Some(true),
        "inactive" => Some(false),
        _ => None,
    }
}

/// How one outgoing item is treated while the client is inactive.
#[derive(Debug, PartialEq, Eq)]
enum Class {
    /// A presence that may wait, coalesced under its sender's full JID.
    Hold(String),
    /// Written at once, after everything held.
    Urgent,
    /// Written at once; what is held stays held.
    Pass,
}

fn classify_element(el: &Element) -> Class {
    match el.name.as_str() {
        "presence" => match (PresenceType::of(el), el.get_attr("from")) {
            (Some(ty), Some(from)) if ty.is_availability() => Class::Hold(from.to_owned()),
            _ => Class::Urgent,
        },
        "message" => Class::Urgent,
        _ => Class::Pass,
    }
}

fn classify(item: &Outbound) -> Class {
    match item {
        Outbound::Stanza(el) => classify_element(el),
        // A broadcast's shared bytes: only presence needs a closer look (and is read back
        // only while the client is inactive).
        Outbound::Xml(xml) if xml.starts_with("<presence") => {
            crate::protocol::xml::parse_element(xml)
                .map_or(Class::Urgent, |el| classify_element(&el))
        }
        Outbound::Xml(xml) if xml.starts_with("<message") => Class::Urgent,
        _ => Class::Pass,
    }
}

/// What a [`Filter`] may hold (`[limits]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Budget {
    /// Presences (`max_csi_held_presences`).
    pub presences: usize,
    /// Bytes, every sender together (`max_csi_held_bytes`).
    pub bytes: usize,
    /// Bytes of one sender ([`share_key`]; `max_csi_held_bytes_per_sender`).
    pub per_sender: usize,
}

#[cfg(test)]
impl Budget {
    /// At most `presences`, with no bound on bytes.
    pub(crate) fn presences(presences: usize) -> Budget {
        Budget {
            presences,
            bytes: usize::MAX,
            per_sender: usize::MAX,
        }
    }
}

/// Whose share of the holding a presence from full JID `sender` counts against, for a
/// session of `own_domain`: the sender's bare JID in the session's own domain (an account
/// the server knows), the sender's domain otherwise (a remote server makes up JIDs at will).
pub(crate) fn share_key<'a>(sender: &'a str, own_domain: &str) -> &'a str {
    let bare = crate::protocol::jid::bare_of(sender);
    let domain = bare.rsplit_once('@').map_or(bare, |(_, d)| d);
    if domain.eq_ignore_ascii_case(own_domain) {
        bare
    } else {
        domain
    }
}

/// The per-session filter the writer applies (see the module documentation). Holds
/// nothing and allocates nothing while the client has never been inactive.
#[derive(Debug)]
pub(crate) struct Filter {
    budget: Budget,
    /// The session's own JID, shared with the session (its domain keys [`share_key`]).
    own: SharedJid,
    held: Option<Box<Held>>,
    /// The client's interest list, if it set one (`crate::services::interest`).
    interest: Option<std::sync::Arc<crate::node::sessions::InterestList>>,
}

#[derive(Debug, Default)]
struct Held {
    /// Held items by the order of their latest update, with their sender's full JID and
    /// their bytes.
    order: BTreeMap<u64, (Outbound, String, usize)>,
    /// The sequence number of each sender's held presence.
    by_sender: HashMap<String, u64>,
    /// Bytes held per share ([`share_key`]).
    shares: HashMap<String, usize>,
    /// Bytes held.
    bytes: usize,
    next: u64,
}

impl Held {
    /// Takes the held item `seq` out, giving back its bytes.
    fn take(&mut self, seq: u64, own_domain: &str) -> Option<Outbound> {
        let (item, sender, w) = self.order.remove(&seq)?;
        if self.by_sender.get(&sender) == Some(&seq) {
            self.by_sender.remove(&sender);
        }
        self.bytes -= w;
        let key = share_key(&sender, own_domain);
        if let Some(share) = self.shares.get_mut(key) {
            *share -= w;
            if *share == 0 {
                self.shares.remove(key);
            }
        }
        Some(item)
    }

    /// Takes out what `sender` holds (superseded by a newer presence of the same resource).
    fn supersede(&mut self, sender: &str, own_domain: &str) {
        if let Some(older) = self.by_sender.get(sender).copied() {
            self.take(older, own_domain);
        }
    }

    /// The oldest held item counted against `key`.
    fn oldest_of(&self, key: &str, own_domain: &str) -> Option<u64> {
        self.order
            .iter()
            .find(|(_, (_, sender, _))| share_key(sender, own_domain) == key)
            .map(|(seq, _)| *seq)
    }
}

impl Filter {
    /// A filter for an active client of the session `own` that holds at most `budget`.
    pub(crate) fn new(budget: Budget, own: SharedJid) -> Filter {
        Filter {
            budget,
            own,
            held: None,
            interest: None,
        }
    }

    /// Bytes held now.
    #[cfg(test)]
    pub(crate) fn held_bytes(&self) -> usize {
        self.held.as_ref().map_or(0, |h| h.bytes)
    }

    /// Whether the client is inactive.
    #[cfg(test)]
    fn inactive(&self) -> bool {
        self.held.is_some()
    }

    /// Takes one outgoing item and calls `write` with what goes on the wire now, in order.
    /// [`Outbound::ClientState`] switches the filter and [`Outbound::Interest`] replaces
    /// its interest list; neither is written.
    pub(crate) fn pass(&mut self, item: Outbound, mut write: impl FnMut(Outbound)) {
        if let Outbound::Interest(list) = item {
            self.interest = (!list.contacts.is_empty()).then_some(list);
            return;
        }
        if let Outbound::ClientState(active) = item {
            if active {
                self.flush(&mut write);
                self.held = None;
            } else if self.held.is_none() {
                self.held = Some(Box::default());
            }
            return;
        }
        if self.held.is_none() {
            return write(item);
        }
        match classify(&item) {
            Class::Pass => write(item),
            Class::Urgent => {
                self.flush(&mut write);
                write(item);
            }
            Class::Hold(sender)
                if self.interested(&sender) || item.weight() > self.budget.per_sender =>
            {
                // Shown now (a listed contact, or too large to hold within any share); an
                // older held presence of the same resource is superseded.
                let own = self.own.domain().as_str();
                if let Some(held) = self.held.as_deref_mut() {
                    held.supersede(&sender, own);
                }
                write(item);
            }
            Class::Hold(sender) => {
                let w = item.weight();
                let own = self.own.domain().as_str();
                let held = self.held.get_or_insert_with(Box::default);
                held.supersede(&sender, own);
                let key = share_key(&sender, own).to_owned();
                // Beyond the sender's share its oldest held presence goes out now: the
                // client learns it (nothing is dropped), and the sender cannot take the
                // holding of everyone else.
                while held.shares.get(&key).copied().unwrap_or(0) + w > self.budget.per_sender {
                    let Some(oldest) = held.oldest_of(&key, own) else {
                        break;
                    };
                    if let Some(out) = held.take(oldest, own) {
                        write(out);
                    }
                }
                let seq = held.next;
                held.next += 1;
                held.by_sender.insert(sender.clone(), seq);
                *held.shares.entry(key).or_default() += w;
                held.bytes += w;
                held.order.insert(seq, (item, sender, w));
                if held.order.len() > self.budget.presences || held.bytes > self.budget.bytes {
                    self.flush(&mut write);
                }
            }
        }
    }

    /// Whether the client's unexpired interest list names the contact of full JID `sender`.
    fn interested(&self, sender: &str) -> bool {
        self.interest.as_ref().is_some_and(|list| {
            tokio::time::Instant::now() < list.expires
                && list
                    .contacts
                    .contains(crate::protocol::jid::bare_of(sender))
        })
    }

    /// Writes everything held, oldest update first.
    fn flush(&mut self, write: &mut impl FnMut(Outbound)) {
        if let Some(held) = self.held.as_deref_mut() {
            held.by_sender.clear();
            held.shares.clear();
            held.bytes = 0;
            for (_, (item, _, _)) in std::mem::take(&mut held.order) {
                write(item);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::xml::parse_element;
    use std::sync::Arc;

    /// The filtered session's JID, of domain `x`.
    fn own() -> SharedJid {
        SharedJid::share(crate::protocol::jid::parse_full("me@x/p").unwrap())
    }

    fn stanza(xml: &str) -> Outbound {
        Outbound::Stanza(Box::new(parse_element(xml).expect("test stanza parses")))
    }

    fn shared(xml: &str) -> Outbound {
        Outbound::Xml(Arc::new(xml.to_owned()))
    }

    /// What goes on the wire, as XML, after feeding `items`.
    fn run(filter: &mut Filter, items: Vec<Outbound>) -> Vec<String> {
        let mut out = Vec::new();
        for item in items {
            filter.pass(item, |o| {
                out.push(match o {
                    Outbound::Stanza(el) => el.to_xml(),
                    Outbound::Xml(x) => x.to_string(),
                    other => format!("{other:?}"),
                })
            });
        }
        out
    }

    fn presence(from: &str, show: &str) -> String {
        format!("<presence from='{from}' to='me@x/p'><show>{show}</show></presence>")
    }

    #[test]
    fn active_clients_get_everything_at_once() {
        let mut f = Filter::new(Budget::presences(10), own());
        let p = presence("a@x/1", "away");
        assert_eq!(run(&mut f, vec![stanza(&p)]), [p]);
        assert!(!f.inactive());
    }

    #[test]
    fn inactive_clients_get_the_latest_presence_per_resource_on_active_in_order() {
        let mut f = Filter::new(Budget::presences(10), own());
        let a1 = presence("a@x/1", "away");
        let b1 = presence("b@x/1", "dnd");
        let a2 = presence("a@x/1", "xa");
        let a_other = presence("a@x/2", "chat");
        let gone = "<presence from='b@x/1' to='me@x/p' type='unavailable'/>".to_owned();
        let out = run(
            &mut f,
            vec![
                Outbound::ClientState(false),
                stanza(&a1),
                shared(&b1),
                stanza(&a2),
                stanza(&a_other),
                stanza(&gone),
            ],
        );
        assert!(out.is_empty(), "{out:?}");
        let out = run(&mut f, vec![Outbound::ClientState(true)]);
        // a@x/1's latest, a@x/2, then b@x/1's unavailable (which replaced its dnd).
        assert_eq!(out, [a2, a_other, gone]);
        assert!(!f.inactive());
    }

    #[test]
    fn a_message_flushes_held_presence_first_and_an_iq_passes_without_flushing() {
        let mut f = Filter::new(Budget::presences(10), own());
        let p = presence("a@x/1", "away");
        let iq = "<iq type='get' id='1' from='x' to='me@x/p'><ping xmlns='urn:xmpp:ping'/></iq>";
        let msg = "<message from='a@x/1' to='me@x/p' type='chat'><body>hi</body></message>";
        let sub = "<presence from='c@x' to='me@x' type='subscribe'/>";
        let out = run(
            &mut f,
            vec![
                Outbound::ClientState(false),
                stanza(&p),
                stanza(iq),
                shared(msg),
            ],
        );
        assert_eq!(out, [iq.to_owned(), p.clone(), msg.to_owned()]);
        // Subscription presence is news too, and flushes like a message.
        let out = run(&mut f, vec![stanza(&p), stanza(sub)]);
        assert_eq!(out, [p, sub.to_owned()]);
    }

    #[test]
    fn holding_more_than_the_limit_flushes_everything() {
        let mut f = Filter::new(Budget::presences(2), own());
        let ps: Vec<String> = (0..3)
            .map(|i| presence(&format!("u{i}@x/r"), "away"))
            .collect();
        let mut items = vec![Outbound::ClientState(false)];
        items.extend(ps.iter().take(2).map(|p| stanza(p)));
        assert!(run(&mut f, items).is_empty());
        assert_eq!(run(&mut f, vec![stanza(&ps[2])]), ps);
        assert!(f.inactive(), "still inactive after the flush");
    }

    #[test]
    fn a_sender_is_a_local_bare_jid_or_a_remote_domain() {
        assert_eq!(share_key("a@x/1", "x"), "a@x");
        assert_eq!(share_key("a@X/1", "x"), "a@X");
        assert_eq!(share_key("u1@evil.example/r", "x"), "evil.example");
        assert_eq!(share_key("evil.example", "x"), "evil.example");
    }

    /// The bytes one held presence of `presence(from, …)` counts.
    fn weight_of(xml: &str) -> usize {
        stanza(xml).weight()
    }

    #[test]
    fn beyond_its_share_a_senders_oldest_held_presence_is_written_and_others_stay_held() {
        let one = weight_of(&presence("u0@evil.example/r", "away"));
        let mut f = Filter::new(
            Budget {
                presences: 100,
                bytes: 100 * one,
                per_sender: 2 * one + 10,
            },
            own(),
        );
        let local = presence("a@x/1", "dnd");
        let remote: Vec<String> = (0..4)
            .map(|i| presence(&format!("u{i}@evil.example/r"), "away"))
            .collect();
        let mut items = vec![Outbound::ClientState(false), stanza(&local)];
        items.extend(remote.iter().map(|p| stanza(p)));
        // Two fit the remote domain's share; each further one writes its oldest.
        assert_eq!(run(&mut f, items), [remote[0].clone(), remote[1].clone()]);
        assert_eq!(f.held_bytes(), weight_of(&local) + 2 * one);
        // The local account's share is its own; <active/> writes the rest in order.
        assert_eq!(
            run(&mut f, vec![Outbound::ClientState(true)]),
            [local, remote[2].clone(), remote[3].clone()]
        );
        assert_eq!(f.held_bytes(), 0);
    }

    #[test]
    fn a_presence_larger_than_a_share_is_never_held_and_supersedes_what_was() {
        let small = presence("a@x/1", "away");
        let big = format!(
            "<presence from='a@x/1' to='me@x/p'><status>{}</status></presence>",
            "s".repeat(2000)
        );
        let mut f = Filter::new(
            Budget {
                presences: 100,
                bytes: 10_000,
                per_sender: 1000,
            },
            own(),
        );
        let out = run(
            &mut f,
            vec![Outbound::ClientState(false), stanza(&small), shared(&big)],
        );
        assert_eq!(out, [big]);
        assert_eq!(
            run(&mut f, vec![Outbound::ClientState(true)]),
            Vec::<String>::new()
        );
    }

    #[test]
    fn holding_more_bytes_than_the_budget_flushes_everything() {
        let ps: Vec<String> = (0..3)
            .map(|i| presence(&format!("u{i}@s{i}.example/r"), "away"))
            .collect();
        let one = weight_of(&ps[0]);
        let mut f = Filter::new(
            Budget {
                presences: 100,
                bytes: 2 * one + 1,
                per_sender: one + 1,
            },
            own(),
        );
        let mut items = vec![Outbound::ClientState(false)];
        items.extend(ps.iter().take(2).map(|p| stanza(p)));
        assert!(run(&mut f, items).is_empty());
        assert_eq!(run(&mut f, vec![stanza(&ps[2])]), ps);
        assert_eq!(f.held_bytes(), 0);
        assert!(f.inactive(), "still inactive after the flush");
    }

    #[tokio::test(start_paused = true)]
    async fn listed_contacts_pass_while_the_list_lasts_and_supersede_what_is_held() {
        use std::time::Duration;
        let mut f = Filter::new(Budget::presences(10), own());
        let list = |jids: &[&str], ttl: u64| {
            Outbound::Interest(Arc::new(crate::node::sessions::InterestList {
                contacts: jids.iter().map(|j| j.to_string()).collect(),
                expires: tokio::time::Instant::now() + Duration::from_secs(ttl),
            }))
        };
        let a1 = presence("a@x/1", "away");
        let a2 = presence("a@x/1", "xa");
        let b1 = presence("b@x/1", "dnd");
        // a@x/1 is held before the list names a@x; its next presence replaces it.
        let out = run(
            &mut f,
            vec![
                Outbound::ClientState(false),
                stanza(&a1),
                list(&["a@x"], 300),
                stanza(&a2),
                stanza(&b1),
            ],
        );
        assert_eq!(out, std::slice::from_ref(&a2));
        assert_eq!(run(&mut f, vec![Outbound::ClientState(true)]), [b1]);
        // The list lapses after its time: a@x is held like anyone else.
        tokio::time::advance(Duration::from_secs(301)).await;
        let out = run(&mut f, vec![Outbound::ClientState(false), stanza(&a2)]);
        assert!(out.is_empty(), "{out:?}");
        // Setting it again (here: empty, which clears it) replaces it.
        let out = run(&mut f, vec![list(&["a@x"], 300), stanza(&a1)]);
        assert_eq!(out, std::slice::from_ref(&a1));
        let out = run(&mut f, vec![list(&[], 300), stanza(&a2)]);
        assert!(out.is_empty(), "{out:?}");
    }

    #[test]
    fn only_active_and_inactive_are_csi_nonzas() {
        let el = |x: &str| parse_element(x).unwrap();
        assert_eq!(nonza(&el("<active xmlns='urn:xmpp:csi:0'/>")), Some(true));
        assert_eq!(
            nonza(&el("<inactive xmlns='urn:xmpp:csi:0'/>")),
            Some(false)
        );
        assert_eq!(nonza(&el("<other xmlns='urn:xmpp:csi:0'/>")), None);
        assert_eq!(nonza(&el("<active xmlns='jabber:client'/>")), None);
    }
}
