//! XEP-0198 stream management: what the c2s session counts and keeps so that a client can
//! confirm what it received (`<r/>` / `<a/>`) and resume a stream whose connection died.
//!
//! This module holds the rules; [`crate::transport::c2s`] applies them to the socket:
//!
//! - [`Outgoing`]: the stanzas written to the client since `<enabled/>` and not yet
//!   acknowledged, with the server's 32-bit counter (XEP-0198 §4: counters wrap at 2^32).
//!   Bounded by `[limits] sm_max_unacked` stanzas and `sm_max_unacked_bytes` bytes; one
//!   more of either ends the stream with `resource-constraint` (the session is then over, and what was not acknowledged is
//!   handled like any stanza for a resource that went away, RFC 6121 §8). A client's `h`
//!   ahead by no more than the stanzas written between the bind and `<enabled/>`, or behind
//!   its last one, keeps the stream ([`Outgoing::read`] says why); further ahead is §4's
//!   `handled-count-too-high`.
//! - [`Nonza`]: the parsed `<enable/>`, `<resume/>`, `<r/>`, `<a/>`, and the elements the
//!   server answers with ([`enabled`], [`failed`], [`resumed`], [`ack`], [`REQUEST`]).
//! - [`Resumable`]: this node's detached (or still attached) resumable sessions, keyed by
//!   an unguessable id that is bound to the account that enabled it. A `<resume/>` on
//!   another node of a cluster finds nothing here and is answered `item-not-found`
//!   (§5), so the client binds a fresh resource.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{ReadHalf, WriteHalf};
use tokio::sync::{mpsc, oneshot};

use crate::liveness::Transport;
use crate::node::io::BoxIo;
use crate::protocol::conditions::StanzaCondition;
use crate::protocol::xml::reader::StreamReader;
use crate::protocol::xml::{Element, NS_STANZAS};

/// The XEP-0198 namespace (version 3).
pub(crate) const NS_SM: &str = "urn:xmpp:sm:3";

/// `<r/>`: the server asks the client how many stanzas it handled (§4).
pub(crate) const REQUEST: &str = "<r xmlns='urn:xmpp:sm:3'/>";

/// A stream-management element from the client. These are nonzas, not stanzas: they are
/// never counted (§4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Nonza {
    /// `<enable/>`: start counting; `resume` asks for a resumable session, `max` is the
    /// client's preferred resumption time in seconds (§3).
    Enable { resume: bool, max: Option<u64> },
    /// `<resume previd h/>`: take over the session `previd`, having handled `h` of its
    /// stanzas (§5).
    Resume { previd: String, h: u32 },
    /// `<r/>`: how many of the client's stanzas did the server handle?
    Request,
    /// `<a h/>`: the client handled `h` of the server's stanzas.
    Ack { h: u32 },
}

/// Why a stream-management element could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Malformed(pub String);

impl Nonza {
    /// Reads `el` if it is in the XEP-0198 namespace: `None` for anything else, an error for
    /// an element of the namespace the server does not take or with an unusable attribute.
    pub(crate) fn parse(el: &Element) -> Option<Result<Nonza, Malformed>> {
        if el.ns != NS_SM {
            return None;
        }
        let h = || -> Result<u32, Malformed> {
            let raw = el
                .get_attr("h")
                .ok_or_else(|| Malformed(format!("<{}/> without 'h'", el.name)))?;
            // §4: h is an unsigned 32-bit integer.
            raw.parse::<u32>()
                .map_err(|_| Malformed(format!("'h' is not a 32-bit unsigned integer: {raw}")))
        };
        Some(match el.name.as_str() {
            "enable" => Ok(Nonza::Enable {
                resume: matches!(el.get_attr("resume"), Some("true" | "1")),
                max: el.get_attr("max").and_then(|m| m.parse().ok()),
            }),
            "resume" => match el.get_attr("previd") {
                Some(previd) => h().map(|h| Nonza::Resume {
                    previd: previd.to_owned(),
                    h,
                }),
                None => Err(Malformed("<resume/> without 'previd'".into())),
            },
            "r" => Ok(Nonza::Request),
            "a" => h().map(|h| Nonza::Ack { h }),
            other => Err(Malformed(format!("<{other}/> is not a client's element"))),
        })
    }
}

/// `<enabled/>`: with an id, resumable for `max` seconds (§3).
pub(crate) fn enabled(resumable: Option<(&str, u64)>) -> String {
    match resumable {
        Some((id, max)) => format!(
            "<enabled xmlns='{NS_SM}' id='{}' resume='true' max='{max}'/>",
            crate::protocol::xml::escape(id)
        ),
        None => format!("<enabled xmlns='{NS_SM}'/>"),
    }
}

/// `<failed/>` with a stanza error condition (§3, §5), and the server's `h` when the
/// session is known (§5: the client can then tell which of its stanzas arrived).
pub(crate) fn failed(condition: StanzaCondition, h: Option<u32>) -> String {
    let h = h.map(|h| format!(" h='{h}'")).unwrap_or_default();
    format!("<failed xmlns='{NS_SM}'{h}><{condition} xmlns='{NS_STANZAS}'/></failed>")
}

/// `<resumed/>`: the server handled `h` of the client's stanzas (§5).
pub(crate) fn resumed(previd: &str, h: u32) -> String {
    format!(
        "<resumed xmlns='{NS_SM}' previd='{}' h='{h}'/>",
        crate::protocol::xml::escape(previd)
    )
}

/// `<a h/>`.
pub(crate) fn ack(h: u32) -> String {
    format!("<a xmlns='{NS_SM}' h='{h}'/>")
}

/// The server's side of the counting (§4): every stanza written after `<enabled/>` is
/// kept until the client's `h` covers it.
#[derive(Debug)]
pub struct Outgoing {
    /// Whether `<enabled/>` was written: only stanzas after it are counted.
    enabled: bool,
    /// Stanzas written since `<enabled/>`, modulo 2^32.
    sent: u32,
    /// The client's last `h`, modulo 2^32.
    acked: u32,
    /// Written and not acknowledged, oldest first: always `sent - acked` of them.
    queue: VecDeque<Arc<String>>,
    /// Bytes of the stanzas in `queue`.
    bytes: usize,
    /// Most kept at once (`[limits] sm_max_unacked`).
    max: usize,
    /// Most bytes kept at once (`[limits] sm_max_unacked_bytes`).
    max_bytes: usize,
    /// An `<r/>` was written and no `<a/>` came since.
    requested: bool,
    /// Stanzas written on this stream after the bind and before `<enabled/>`, which a
    /// client counting from its own `<enable/>` may include in its `h`
    /// ([`Outgoing::read`]); zero once such a count has been taken in.
    crossing: u32,
}

/// One stanza more than `[limits] sm_max_unacked`, or one byte more than
/// `sm_max_unacked_bytes`, would be kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overflow;

/// What a client's `h` means against the server's count ([`Outgoing::read`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reading {
    /// It acknowledges this many more stanzas (zero: the same `h` again).
    New(usize),
    /// It is behind the last `h` by this many: it acknowledges nothing.
    Behind(u32),
    /// It is ahead of the count by this many, no more than the stanzas that crossed the
    /// client's `<enable/>`: it acknowledges every stanza written.
    Crossed(u32),
    /// It is beyond anything the client can have counted.
    TooHigh,
}

/// The client acknowledged more stanzas than were sent (§4: `handled-count-too-high`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooHigh {
    /// The client's `h`.
    pub h: u32,
    /// The server's count.
    pub sent: u32,
}

impl Outgoing {
    /// Not counting yet; at most `max` unacknowledged stanzas of `max_bytes` bytes together
    /// once enabled.
    pub fn new(max: usize, max_bytes: usize) -> Self {
        Outgoing {
            enabled: false,
            sent: 0,
            acked: 0,
            queue: VecDeque::new(),
            bytes: 0,
            max,
            max_bytes,
            requested: false,
            crossing: 0,
        }
    }

    /// `<enabled/>` is being written: counting starts at zero (§4). `crossing` stanzas were
    /// written since the bind ([`Outgoing::read`]).
    pub fn enable(&mut self, crossing: u32) {
        self.enabled = true;
        self.sent = 0;
        self.acked = 0;
        self.queue.clear();
        self.bytes = 0;
        self.crossing = crossing;
    }

    /// Whether stanzas are counted.
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// Keeps a stanza being written. Counting goes on past the bound, which only tells the
    /// caller to end the stream. The bytes are counted whole even when the string is shared
    /// with other sessions (a broadcast): it stays allocated as long as this queue holds it.
    /// One stanza alone never overflows the bytes (the configuration keeps the budget above
    /// any one stanza).
    pub fn push(&mut self, stanza: Arc<String>) -> Result<(), Overflow> {
        self.sent = self.sent.wrapping_add(1);
        self.bytes += stanza.len();
        self.queue.push_back(stanza);
        if self.queue.len() > self.max || (self.bytes > self.max_bytes && self.queue.len() > 1) {
            return Err(Overflow);
        }
        Ok(())
    }

    /// Bytes of the stanzas not yet acknowledged.
    pub fn unacked_bytes(&self) -> usize {
        self.bytes
    }

    /// Reads the client's `h` against the count, modulo 2^32 (§4).
    ///
    /// The XEP has both sides start counting at `<enabled/>`, but earlier versions had the
    /// client start when it sends `<enable/>`, and @xmpp/client resets its count only
    /// after handling `<enabled/>` and whatever arrived with it. Such a client's `h` is
    /// ahead by up to the stanzas written between the bind and `<enabled/>` (a client may
    /// enable only after binding, §3), and later, once it resets, behind. Neither costs
    /// the client its stream: ahead within those crossing stanzas acknowledges all that
    /// was written, and the count goes on in the client's numbering; behind acknowledges
    /// nothing. Anything further ahead is the §4 error. An `h` is behind when it is less
    /// than half the counter's range below the last one.
    pub fn read(&self, h: u32) -> Reading {
        let ahead = h.wrapping_sub(self.acked);
        // Never more than 2^32 - 1: the queue holds `sent - acked` of the 32-bit counter.
        let unacked = u32::try_from(self.queue.len()).unwrap_or(u32::MAX);
        if ahead <= unacked {
            Reading::New(ahead as usize)
        } else if ahead > u32::MAX / 2 {
            Reading::Behind(ahead.wrapping_neg())
        } else if ahead - unacked <= self.crossing {
            Reading::Crossed(ahead - unacked)
        } else {
            Reading::TooHigh
        }
    }

    /// The client handled `h` stanzas ([`Outgoing::read`]): drops those, and returns how
    /// many. An `h` beyond the count is an error and changes nothing.
    pub fn ack(&mut self, h: u32) -> Result<usize, TooHigh> {
        let newly = match self.read(h) {
            Reading::New(n) => {
                self.acked = h;
                n
            }
            Reading::Behind(_) => 0,
            Reading::Crossed(extra) => {
                // The crossing happened once: from here the count is the client's.
                self.sent = self.sent.wrapping_add(extra);
                self.acked = h;
                self.crossing = 0;
                self.queue.len()
            }
            Reading::TooHigh => return Err(TooHigh { h, sent: self.sent }),
        };
        self.bytes -= self.queue.drain(..newly).map(|s| s.len()).sum::<usize>();
        self.requested = false;
        Ok(newly)
    }

    /// Whether `h` is one the client may send ([`Outgoing::read`]).
    pub fn acceptable(&self, h: u32) -> bool {
        self.read(h) != Reading::TooHigh
    }

    /// The stanzas not yet acknowledged, oldest first.
    pub fn unacked(&self) -> impl Iterator<Item = &Arc<String>> {
        self.queue.iter()
    }

    /// How many are not acknowledged.
    pub fn unacked_len(&self) -> usize {
        self.queue.len()
    }

    /// Takes the stanzas not yet acknowledged (the session is over).
    pub fn take_unacked(&mut self) -> VecDeque<Arc<String>> {
        self.bytes = 0;
        std::mem::take(&mut self.queue)
    }

    /// Whether to ask the client for an ack after a write: there is something to confirm
    /// and no request is outstanding. Marks the request as made.
    pub fn should_request(&mut self) -> bool {
        if !self.enabled || self.queue.is_empty() || self.requested {
            return false;
        }
        self.requested = true;
        true
    }

    /// The server's count.
    pub fn sent(&self) -> u32 {
        self.sent
    }
}

/// The outgoing side shared by the session's reader (acks) and writer (what is written).
pub(crate) type SharedOutgoing = Arc<Mutex<Outgoing>>;

/// What the writer is handed with `<enabled/>`: the element, and the counters it keeps
/// from then on. Created only when a client enables stream management, so a session
/// without it carries none of this.
#[derive(Debug)]
pub struct Enabled {
    /// `<enabled/>` as written.
    pub xml: String,
    /// The counters the writer pushes to.
    pub out: SharedOutgoing,
}

/// Locks `out`, whatever a panicking holder left.
pub(crate) fn lock(out: &SharedOutgoing) -> std::sync::MutexGuard<'_, Outgoing> {
    out.lock().unwrap_or_else(|e| e.into_inner())
}

/// A new connection taking over a resumable session: its stream, authenticated as the
/// session's account, and the client's `h`. The session's task answers `<resumed/>` on it.
pub struct Handoff {
    /// The client's count of stanzas it handled.
    pub h: u32,
    /// The new stream's reader, after the restart that followed SASL.
    pub reader: Box<StreamReader<ReadHalf<BoxIo>>>,
    /// The new stream's writer.
    pub writer: WriteHalf<BoxIo>,
    /// The new connection's address.
    pub peer: SocketAddr,
    /// The new connection's transport (its beat and keepalive).
    pub transport: Transport,
    /// Told when the session took the stream over.
    pub taken: oneshot::Sender<()>,
    /// For a resumption asked inline in another exchange (XEP-0388 SASL2 authentication):
    /// what the session writes in place of `<resumed/>`, from its full JID and the
    /// `<resumed/>` element.
    pub frame: Option<Frame>,
}

/// Wraps `<resumed/>` for a resumption that answers another exchange ([`Handoff::frame`]).
pub(crate) type Frame = Box<dyn FnOnce(&str, &str) -> String + Send>;

/// One resumable session as the registry knows it.
struct Entry {
    /// The account that enabled it: only that account may resume it.
    account: String,
    /// The session's task.
    tx: mpsc::Sender<Box<Handoff>>,
    /// Its counters, to check the client's `h` before the hand-off.
    out: SharedOutgoing,
}

/// This node's resumable sessions by resume id.
#[derive(Default)]
pub struct Resumable {
    map: Mutex<HashMap<String, Entry>>,
    /// Sessions whose connection is gone and that wait for a resumption.
    detached: Arc<AtomicUsize>,
}

/// Counts one detached session while it lives ([`Resumable::detached`]).
pub struct DetachedCount(Arc<AtomicUsize>);

impl Drop for DetachedCount {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Why a `<resume/>` cannot be granted, as the `<failed/>` condition says it (§5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// No such session here for this account (expired, never existed, another node's or
    /// another account's): `item-not-found`.
    NotFound,
    /// The client's `h` exceeds what the session sent: `undefined-condition` with the
    /// server's `h`.
    TooHigh(u32),
}

impl Refused {
    /// The stanza error condition of the `<failed/>` that refuses (§5).
    pub fn condition(self) -> StanzaCondition {
        match self {
            Refused::NotFound => StanzaCondition::ItemNotFound,
            // §4: the client claims more than was sent.
            Refused::TooHigh(_) => StanzaCondition::UndefinedCondition,
        }
    }
}

impl Resumable {
    /// Registers a session of `account` and returns its id: 128 random bits from the
    /// operating system, so an id cannot be guessed.
    pub fn register(
        &self,
        account: &str,
        tx: mpsc::Sender<Box<Handoff>>,
        out: SharedOutgoing,
    ) -> String {
        use rand::RngCore as _;
        let mut bytes = [0u8; 16];
        rand::rngs::OsRng.fill_bytes(&mut bytes);
        let id: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.insert(
            id.clone(),
            Entry {
                account: account.to_owned(),
                tx,
                out,
            },
        );
        id
    }

    /// Forgets `id` (the session is over).
    pub fn remove(&self, id: &str) {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.remove(id);
    }

    /// The channel to hand `account`'s session `id` a new stream, once `h` is checked.
    pub fn find(
        &self,
        id: &str,
        account: &str,
        h: u32,
    ) -> Result<mpsc::Sender<Box<Handoff>>, Refused> {
        let map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let entry = map
            .get(id)
            .filter(|e| e.account == account)
            .ok_or(Refused::NotFound)?;
        let out = lock(&entry.out);
        if !out.acceptable(h) {
            return Err(Refused::TooHigh(out.sent()));
        }
        Ok(entry.tx.clone())
    }

    /// Counts a session as detached until the returned value is dropped.
    pub fn count_detached(&self) -> DetachedCount {
        self.detached.fetch_add(1, Ordering::Relaxed);
        DetachedCount(self.detached.clone())
    }

    /// How many sessions have no connection and wait for a resumption: bound, but no
    /// live socket.
    pub fn detached(&self) -> usize {
        self.detached.load(Ordering::Relaxed)
    }

    /// How many sessions are resumable here.
    pub fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::xml::parse_element;

    fn s(x: &str) -> Arc<String> {
        Arc::new(x.to_owned())
    }

    #[test]
    fn client_elements_parse_and_bad_counts_are_refused() {
        let table: [(&str, Option<Result<Nonza, ()>>); 9] = [
            (
                "<enable xmlns='urn:xmpp:sm:3'/>",
                Some(Ok(Nonza::Enable {
                    resume: false,
                    max: None,
                })),
            ),
            (
                "<enable xmlns='urn:xmpp:sm:3' resume='true' max='60'/>",
                Some(Ok(Nonza::Enable {
                    resume: true,
                    max: Some(60),
                })),
            ),
            (
                "<resume xmlns='urn:xmpp:sm:3' previd='x' h='4294967295'/>",
                Some(Ok(Nonza::Resume {
                    previd: "x".into(),
                    h: u32::MAX,
                })),
            ),
            ("<resume xmlns='urn:xmpp:sm:3' h='1'/>", Some(Err(()))),
            ("<r xmlns='urn:xmpp:sm:3'/>", Some(Ok(Nonza::Request))),
            (
                "<a xmlns='urn:xmpp:sm:3' h='7'/>",
                Some(Ok(Nonza::Ack { h: 7 })),
            ),
            ("<a xmlns='urn:xmpp:sm:3' h='4294967296'/>", Some(Err(()))),
            ("<a xmlns='urn:xmpp:sm:3' h='-1'/>", Some(Err(()))),
            ("<a xmlns='urn:xmpp:sm:2' h='1'/>", None),
        ];
        for (xml, want) in table {
            let el = parse_element(xml).expect("parses");
            let got = Nonza::parse(&el).map(|r| r.map_err(|_| ()));
            assert_eq!(got, want, "{xml}");
        }
    }

    #[test]
    fn nothing_is_counted_before_enabled_and_acks_drop_the_oldest() {
        let mut out = Outgoing::new(10, usize::MAX);
        assert!(!out.should_request());
        out.enable(0);
        for i in 0..5 {
            out.push(s(&format!("m{i}"))).unwrap();
        }
        assert_eq!(out.sent(), 5);
        assert_eq!(out.ack(2), Ok(2));
        let left: Vec<_> = out.unacked().map(|m| m.as_str().to_owned()).collect();
        assert_eq!(left, ["m2", "m3", "m4"]);
        // The same h again acknowledges nothing new.
        assert_eq!(out.ack(2), Ok(0));
        assert_eq!(out.ack(6), Err(TooHigh { h: 6, sent: 5 }));
        assert!(out.acceptable(5) && !out.acceptable(6));
        assert_eq!(out.ack(5), Ok(3));
        assert_eq!(out.unacked_len(), 0);
    }

    #[test]
    fn counters_wrap_at_two_to_the_thirty_second() {
        let mut out = Outgoing::new(10, usize::MAX);
        out.enable(0);
        // As if 2^32 - 2 stanzas had been sent and acknowledged already.
        out.sent = u32::MAX - 1;
        out.acked = u32::MAX - 1;
        for i in 0..4 {
            out.push(s(&format!("m{i}"))).unwrap();
        }
        assert_eq!(out.sent(), 2, "wrapped past zero");
        assert_eq!(out.ack(u32::MAX), Ok(1));
        assert_eq!(out.ack(1), Ok(2));
        assert_eq!(out.unacked().next().map(|m| m.as_str()), Some("m3"));
        assert_eq!(out.ack(3), Err(TooHigh { h: 3, sent: 2 }));
        assert_eq!(out.ack(2), Ok(1));
    }

    #[test]
    fn a_count_ahead_by_the_stanzas_crossing_enable_acknowledges_all_and_is_adopted() {
        let mut out = Outgoing::new(10, usize::MAX);
        // Two stanzas were written between the bind and <enabled/>.
        out.enable(2);
        out.push(s("m0")).unwrap();
        assert_eq!(out.read(4), Reading::TooHigh, "beyond the crossing stanzas");
        assert_eq!(out.read(3), Reading::Crossed(2));
        assert!(out.acceptable(3) && !out.acceptable(4));
        assert_eq!(out.ack(3), Ok(1));
        assert_eq!((out.sent(), out.unacked_len()), (3, 0));
        // The crossing is taken in once: the count is the client's from here.
        out.push(s("m1")).unwrap();
        assert_eq!(out.read(5), Reading::TooHigh);
        assert_eq!(out.ack(4), Ok(1));
    }

    #[test]
    fn a_count_behind_the_last_acknowledges_nothing() {
        let mut out = Outgoing::new(10, usize::MAX);
        out.enable(0);
        for i in 0..3 {
            out.push(s(&format!("m{i}"))).unwrap();
        }
        assert_eq!(out.ack(2), Ok(2));
        // A client that reset its count late goes on below the server's.
        assert_eq!(out.read(0), Reading::Behind(2));
        assert_eq!(out.ack(0), Ok(0));
        assert_eq!(out.unacked_len(), 1);
        assert_eq!(out.ack(1), Ok(0), "still behind");
        assert_eq!(out.ack(3), Ok(1));
        // Half the counter's range ahead is ahead, not behind.
        assert_eq!(out.read(3 + u32::MAX / 2), Reading::TooHigh);
        assert_eq!(
            out.read(3 + u32::MAX / 2 + 1),
            Reading::Behind(u32::MAX / 2 + 1)
        );
    }

    #[test]
    fn the_queue_is_bounded() {
        let mut out = Outgoing::new(2, usize::MAX);
        out.enable(0);
        assert_eq!(out.push(s("a")), Ok(()));
        assert_eq!(out.push(s("b")), Ok(()));
        assert_eq!(out.push(s("c")), Err(Overflow));
    }

    #[test]
    fn the_queue_is_bounded_in_bytes_and_acks_give_them_back() {
        let mut out = Outgoing::new(100, 10);
        out.enable(0);
        // One stanza alone fits, whatever its size.
        assert_eq!(out.push(s("0123456789ab")), Ok(()));
        assert_eq!(out.unacked_bytes(), 12);
        assert_eq!(out.ack(1), Ok(1));
        assert_eq!(out.unacked_bytes(), 0);
        assert_eq!(out.push(s("01234")), Ok(()));
        assert_eq!(out.push(s("56789")), Ok(()));
        assert_eq!(out.unacked_bytes(), 10);
        assert_eq!(out.push(s("x")), Err(Overflow));
        assert_eq!(out.take_unacked().len(), 3);
        assert_eq!(out.unacked_bytes(), 0);
    }

    #[test]
    fn one_request_is_outstanding_until_an_ack() {
        let mut out = Outgoing::new(10, usize::MAX);
        out.enable(0);
        assert!(!out.should_request(), "nothing to confirm");
        out.push(s("a")).unwrap();
        assert!(out.should_request());
        out.push(s("b")).unwrap();
        assert!(!out.should_request(), "one is outstanding");
        out.ack(1).unwrap();
        assert!(out.should_request());
    }

    #[test]
    fn resume_ids_are_random_and_bound_to_their_account() {
        let reg = Resumable::default();
        let out = Arc::new(Mutex::new(Outgoing::new(10, usize::MAX)));
        let (tx, _rx) = mpsc::channel(1);
        let a = reg.register("alice@x", tx.clone(), out.clone());
        let b = reg.register("alice@x", tx, out.clone());
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
        assert!(reg.find(&a, "alice@x", 0).is_ok());
        assert_eq!(reg.find(&a, "mallory@x", 0).err(), Some(Refused::NotFound));
        assert_eq!(
            reg.find("nope", "alice@x", 0).err(),
            Some(Refused::NotFound)
        );
        lock(&out).enable(0);
        assert_eq!(reg.find(&a, "alice@x", 1).err(), Some(Refused::TooHigh(0)));
        reg.remove(&a);
        assert_eq!(reg.find(&a, "alice@x", 0).err(), Some(Refused::NotFound));
        assert_eq!(reg.len(), 1);
    }

    #[test]
    fn answers_are_in_the_namespace() {
        assert_eq!(
            failed(StanzaCondition::ItemNotFound, None),
            "<failed xmlns='urn:xmpp:sm:3'><item-not-found xmlns='urn:ietf:params:xml:ns:xmpp-stanzas'/></failed>"
        );
        assert!(enabled(Some(("i", 300))).contains("resume='true' max='300'"));
        assert_eq!(ack(3), "<a xmlns='urn:xmpp:sm:3' h='3'/>");
    }
}
