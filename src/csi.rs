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
//! - a presence from a contact the client named in its interest list (`crate::interest`)
//!   is written at once, replacing anything held from the same resource; the list lapses
//!   `[limits] interest_ttl` after it was last set;
//! - more than `[limits] max_csi_held_presences` held flushes them all, which bounds what
//!   a session holds; so does `<active/>`, which writes them in the order of their latest
//!   update.
//!
//! Held presence is not shown to anyone else and changes nothing in the server's view of
//! the session; it only delays bytes on one socket. This module imports only the model
//! and the session registry's types.

use std::collections::{BTreeMap, HashMap};

use crate::sessions::Outbound;
use crate::stanza::PresenceType;
use crate::xml::Element;

/// The XEP-0352 namespace.
pub const NS_CSI: &str = "urn:xmpp:csi:0";

/// What a nonza in [`NS_CSI`] asks for: `Some(true)` for `<active/>`, `Some(false)` for
/// `<inactive/>`, `None` for anything else.
pub fn nonza(el: &Element) -> Option<bool> {
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
            crate::xml::parse_element(xml).map_or(Class::Urgent, |el| classify_element(&el))
        }
        Outbound::Xml(xml) if xml.starts_with("<message") => Class::Urgent,
        _ => Class::Pass,
    }
}

/// The per-session filter the writer applies (see the module documentation). Holds
/// nothing and allocates nothing while the client has never been inactive.
#[derive(Debug)]
pub struct Filter {
    max_held: usize,
    held: Option<Box<Held>>,
    /// The client's interest list, if it set one (`crate::interest`).
    interest: Option<std::sync::Arc<crate::sessions::InterestList>>,
}

#[derive(Debug, Default)]
struct Held {
    /// Held items by the order of their latest update.
    order: BTreeMap<u64, Outbound>,
    /// The sequence number of each sender's held presence.
    by_sender: HashMap<String, u64>,
    next: u64,
}

impl Filter {
    /// A filter for an active client that holds at most `max_held` presences.
    pub fn new(max_held: usize) -> Filter {
        Filter {
            max_held,
            held: None,
            interest: None,
        }
    }

    /// Whether the client is inactive.
    #[cfg(test)]
    fn inactive(&self) -> bool {
        self.held.is_some()
    }

    /// Takes one outgoing item and calls `write` with what goes on the wire now, in order.
    /// [`Outbound::ClientState`] switches the filter and [`Outbound::Interest`] replaces
    /// its interest list; neither is written.
    pub fn pass(&mut self, item: Outbound, mut write: impl FnMut(Outbound)) {
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
            Class::Hold(sender) if self.interested(&sender) => {
                // Shown now; an older held presence of the same resource is superseded.
                if let Some(held) = self.held.as_deref_mut() {
                    if let Some(older) = held.by_sender.remove(&sender) {
                        held.order.remove(&older);
                    }
                }
                write(item);
            }
            Class::Hold(sender) => {
                let held = self.held.get_or_insert_with(Box::default);
                let seq = held.next;
                held.next += 1;
                if let Some(older) = held.by_sender.insert(sender, seq) {
                    held.order.remove(&older);
                }
                held.order.insert(seq, item);
                if held.order.len() > self.max_held {
                    self.flush(&mut write);
                }
            }
        }
    }

    /// Whether the client's unexpired interest list names the contact of full JID `sender`.
    fn interested(&self, sender: &str) -> bool {
        self.interest.as_ref().is_some_and(|list| {
            tokio::time::Instant::now() < list.expires
                && list.contacts.contains(crate::jid::bare_of(sender))
        })
    }

    /// Writes everything held, oldest update first.
    fn flush(&mut self, write: &mut impl FnMut(Outbound)) {
        if let Some(held) = self.held.as_deref_mut() {
            held.by_sender.clear();
            for (_, item) in std::mem::take(&mut held.order) {
                write(item);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::xml::parse_element;
    use std::sync::Arc;

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
        let mut f = Filter::new(10);
        let p = presence("a@x/1", "away");
        assert_eq!(run(&mut f, vec![stanza(&p)]), [p]);
        assert!(!f.inactive());
    }

    #[test]
    fn inactive_clients_get_the_latest_presence_per_resource_on_active_in_order() {
        let mut f = Filter::new(10);
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
        let mut f = Filter::new(10);
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
        let mut f = Filter::new(2);
        let ps: Vec<String> = (0..3)
            .map(|i| presence(&format!("u{i}@x/r"), "away"))
            .collect();
        let mut items = vec![Outbound::ClientState(false)];
        items.extend(ps.iter().take(2).map(|p| stanza(p)));
        assert!(run(&mut f, items).is_empty());
        assert_eq!(run(&mut f, vec![stanza(&ps[2])]), ps);
        assert!(f.inactive(), "still inactive after the flush");
    }

    #[tokio::test(start_paused = true)]
    async fn listed_contacts_pass_while_the_list_lasts_and_supersede_what_is_held() {
        use std::time::Duration;
        let mut f = Filter::new(10);
        let list = |jids: &[&str], ttl: u64| {
            Outbound::Interest(Arc::new(crate::sessions::InterestList {
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
