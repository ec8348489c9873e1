//! A session's mailbox: the queue from everyone who sends to a session (routing, presence,
//! its own handlers) to the one task that writes to its client. Bounded in items (`[limits]
//! session_queue`) and in bytes (`session_queue_bytes`, [`Outbound::weight`]), both counted
//! here under the lock that guards the items; what a session does when a send is refused
//! is [`crate::node::sessions::SessionHandle`]'s rule.
//!
//! Why not tokio's `mpsc` channel, which this was until 2026-12-07: every idle session has
//! a mailbox, and that channel kept, for the session's whole life, its 512 B of shared
//! state, a first block of 32 slots (544 B), and every further block a burst made it
//! allocate. A login with 300 contacts online queues 600 presences at once, so an idle
//! session at K = 300 held 2.7 kB in its channel (the heap profile in BENCHMARKS.md,
//! "Where an idle session's bytes are"). Here the items are a `VecDeque` behind a mutex,
//! and the writer gives the buffer back when it empties one that grew past
//! [`KEEP_ITEMS`]: an idle session holds the shared part and no buffer at all.
//!
//! The mutex is held only to check the bounds and push or pop one item (no await, no
//! allocation but the buffer's growth), by the senders and the one receiver; a send takes
//! it once, as tokio's channel took its atomics once.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

use crate::protocol::error::StreamError;
use crate::protocol::xml::Element;

/// What can be sent to a session task.
#[derive(Debug)]
pub enum Outbound {
    /// A stanza to write to the client as it is. Boxed, like the error below, to keep this
    /// type one pointer wide: a burst queued in a mailbox takes a slot per item, so an
    /// inline 100-byte element would multiply what a burst costs.
    Stanza(Box<Element>),
    /// A stanza already serialised, shared by every resource that receives the same bytes
    /// (a presence broadcast to a contact's sessions): one `Arc`, no deep clone per copy.
    /// `Arc<String>` rather than `Arc<str>` keeps this variant one pointer wide too.
    Xml(Arc<String>),
    /// End the stream with this error (e.g. `conflict` when a newer session binds the same
    /// full JID, RFC 6120 §7.7.2.2).
    Close(Box<StreamError>),
    /// Answer the client's `</stream:stream>` with ours (RFC 6120 §4.4).
    End,
    /// Stop the writer once everything queued before this is written.
    Finish,
    /// The client said it is active (`true`) or inactive (XEP-0352): what follows is
    /// written or held by [`crate::services::csi::Filter`]. Never written itself.
    ClientState(bool),
    /// The contacts whose presence passes [`crate::services::csi::Filter`] at once, replacing any
    /// earlier list. Never written itself.
    Interest(Arc<InterestList>),
    /// XEP-0198 `<enabled/>`: written in its place, and the stanzas after it are counted
    /// and kept until acknowledged ([`crate::node::stream_management::Outgoing`]).
    SmEnabled(Box<crate::node::stream_management::Enabled>),
    /// Another XEP-0198 element (`<a/>`, `<failed/>`): written in its place, never counted
    /// as a stanza (it is none) and never held by the client-state filter.
    SmNonza(Arc<String>),
}

impl Outbound {
    /// The bytes this item holds while it waits in a mailbox: what the session's byte
    /// budget (`[limits] session_queue_bytes`) counts. Control items count nothing.
    pub fn weight(&self) -> usize {
        match self {
            Outbound::Stanza(el) => el.weight(),
            Outbound::Xml(xml) | Outbound::SmNonza(xml) => xml.len(),
            Outbound::SmEnabled(enabled) => enabled.xml.len(),
            Outbound::Close(_)
            | Outbound::End
            | Outbound::Finish
            | Outbound::ClientState(_)
            | Outbound::Interest(_) => 0,
        }
    }
}

/// A session's interest list (`urn:presenced:interest:0`): bare JIDs of contacts whose
/// presence the client shows now, valid until `expires`.
#[derive(Debug, Clone)]
pub struct InterestList {
    /// Normalised bare JIDs.
    pub contacts: std::collections::HashSet<String>,
    /// After this the list counts as empty.
    pub expires: tokio::time::Instant,
}

/// A buffer of up to this many items is kept when it empties (a steady trickle of
/// stanzas does not reallocate); a larger one, grown by a burst, is given back.
const KEEP_ITEMS: usize = 8;

/// The rule of the byte budget: an item of `weight` bytes does not fit when it would take
/// the `queued` bytes beyond `budget`, unless nothing is queued (any one item fits, or an
/// oversized stanza could never be delivered).
fn over_budget(queued: usize, weight: usize, budget: usize) -> bool {
    queued > 0 && queued.saturating_add(weight) > budget
}

#[derive(Debug, Default)]
struct Queue {
    items: VecDeque<Outbound>,
    /// The bytes of `items` ([`Outbound::weight`]).
    bytes: usize,
    /// The [`Mailbox`] was dropped: sends fail, and nothing is kept.
    receiver_gone: bool,
}

#[derive(Debug)]
struct Shared {
    queue: Mutex<Queue>,
    /// Most items the queue holds.
    limit: usize,
    /// [`Sender`]s alive; at zero the receiver, once it has taken everything, sees the end.
    senders: AtomicUsize,
    /// Woken when an item is queued or the last sender goes. One receiver waits on it, so
    /// `notify_one`'s stored permit means a wake-up between its check and its wait is kept.
    arrived: Notify,
    /// Most bytes the queue holds (`session_queue_bytes`), by [`over_budget`].
    budget: usize,
    /// Woken when the receiver takes an item that weighs something.
    drained: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A new mailbox holding at most `limit` items and meant to hold at most `budget` bytes.
pub fn mailbox(limit: usize, budget: usize) -> (Sender, Mailbox) {
    let shared = Arc::new(Shared {
        queue: Mutex::new(Queue::default()),
        limit,
        senders: AtomicUsize::new(1),
        arrived: Notify::new(),
        budget,
        drained: Notify::new(),
    });
    (
        Sender {
            shared: Arc::clone(&shared),
        },
        Mailbox { shared },
    )
}

/// Why [`Sender::try_send`] did not queue an item (which is dropped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrySendError {
    /// The item's bytes do not fit beside the `queued` ones ([`over_budget`]).
    OverBudget { queued: usize },
    /// The mailbox holds its limit of items.
    Full,
    /// The receiver is gone (the session ended).
    Closed,
}

/// The sending end; cloned for every holder of the session's handle.
#[derive(Debug)]
pub struct Sender {
    shared: Arc<Shared>,
}

impl Clone for Sender {
    fn clone(&self) -> Self {
        self.shared.senders.fetch_add(1, Ordering::Relaxed);
        Sender {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        if self.shared.senders.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.shared.arrived.notify_one();
        }
    }
}

impl Sender {
    /// Queues `item` within both bounds: its bytes must fit the budget, and the mailbox
    /// must have room for one more item.
    pub fn try_send(&self, item: Outbound) -> Result<(), TrySendError> {
        self.queue(item, true)
    }

    /// Queues a control item (end or close the stream, stop the writer) whatever the
    /// bytes queued, so that a session over its budget can still be ended in order; the
    /// limit of items still holds.
    pub fn try_send_control(&self, item: Outbound) -> Result<(), TrySendError> {
        self.queue(item, false)
    }

    fn queue(&self, item: Outbound, within_budget: bool) -> Result<(), TrySendError> {
        let w = item.weight();
        let mut q = self.shared.lock();
        if within_budget && over_budget(q.bytes, w, self.shared.budget) {
            return Err(TrySendError::OverBudget { queued: q.bytes });
        }
        if q.receiver_gone {
            return Err(TrySendError::Closed);
        }
        if q.items.len() >= self.shared.limit {
            return Err(TrySendError::Full);
        }
        q.items.push_back(item);
        q.bytes += w;
        drop(q);
        self.shared.arrived.notify_one();
        Ok(())
    }

    /// Whether an item of `weight` bytes would fit the byte budget now, or the receiver
    /// is gone (a send fails at once then, so there is nothing to wait for).
    pub fn fits_or_closed(&self, weight: usize) -> bool {
        let q = self.shared.lock();
        q.receiver_gone || !over_budget(q.bytes, weight, self.shared.budget)
    }

    /// Whether the receiver is gone.
    #[cfg(test)]
    fn is_closed(&self) -> bool {
        self.shared.lock().receiver_gone
    }

    /// The byte budget the mailbox was made with.
    #[cfg(test)]
    fn budget(&self) -> usize {
        self.shared.budget
    }

    /// Woken when the receiver takes an item that weighs something.
    pub fn drained(&self) -> &Notify {
        &self.shared.drained
    }
}

/// The receiving end of a session's mailbox, which gives back each item's bytes to the
/// budget as it takes the item.
#[derive(Debug)]
pub struct Mailbox {
    shared: Arc<Shared>,
}

impl Drop for Mailbox {
    fn drop(&mut self) {
        let mut q = self.shared.lock();
        q.receiver_gone = true;
        // What nobody will write is dropped now, not when the last handle goes (and not
        // under the lock).
        let items = std::mem::take(&mut q.items);
        drop(q);
        drop(items);
    }
}

/// What [`Mailbox::take`] found.
enum Taken {
    Item(Outbound),
    Empty,
    /// Empty, and every sender is gone.
    Ended,
}

impl Mailbox {
    fn take(&self) -> Taken {
        let mut q = self.shared.lock();
        let Some(item) = q.items.pop_front() else {
            return if self.shared.senders.load(Ordering::Acquire) == 0 {
                Taken::Ended
            } else {
                Taken::Empty
            };
        };
        if q.items.is_empty() && q.items.capacity() > KEEP_ITEMS {
            q.items = VecDeque::new();
        }
        let w = item.weight();
        q.bytes -= w;
        drop(q);
        if w > 0 {
            self.shared.drained.notify_waiters();
        }
        Taken::Item(item)
    }

    /// The next item; `None` once the mailbox is empty and every sender is gone.
    /// Cancel-safe: an item leaves the queue only when this returns it.
    pub async fn recv(&mut self) -> Option<Outbound> {
        loop {
            match self.take() {
                Taken::Item(item) => return Some(item),
                Taken::Ended => return None,
                Taken::Empty => self.shared.arrived.notified().await,
            }
        }
    }

    /// The next item if one is queued.
    pub fn try_recv(&mut self) -> Option<Outbound> {
        match self.take() {
            Taken::Item(item) => Some(item),
            Taken::Empty | Taken::Ended => None,
        }
    }

    /// Bytes queued and not yet received.
    #[cfg(test)]
    fn queued_bytes(&self) -> usize {
        self.shared.lock().bytes
    }

    /// Room the queue's buffer has now, in items.
    #[cfg(test)]
    fn buffer_capacity(&self) -> usize {
        self.shared.lock().items.capacity()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xml(s: &str) -> Outbound {
        Outbound::Xml(Arc::new(s.to_owned()))
    }

    fn text(item: Outbound) -> String {
        match item {
            Outbound::Xml(x) => x.to_string(),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[tokio::test]
    async fn items_arrive_in_order_and_the_end_after_the_last() {
        let (tx, mut rx) = mailbox(10, usize::MAX);
        let tx2 = tx.clone();
        tx.try_send(xml("a")).unwrap();
        tx2.try_send(xml("b")).unwrap();
        drop(tx);
        assert_eq!(text(rx.recv().await.unwrap()), "a");
        drop(tx2);
        // Every sender is gone, but what they queued is still delivered, then the end.
        assert_eq!(text(rx.recv().await.unwrap()), "b");
        assert!(rx.recv().await.is_none());
    }

    #[tokio::test]
    async fn a_waiting_receiver_wakes_for_an_item_and_for_the_end() {
        let (tx, mut rx) = mailbox(10, usize::MAX);
        let waiting = tokio::spawn(async move {
            let first = rx.recv().await.map(text);
            let second = rx.recv().await.map(text);
            (first, second)
        });
        tokio::task::yield_now().await;
        tx.try_send(xml("x")).unwrap();
        drop(tx);
        let (first, second) = tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .expect("the receiver woke")
            .unwrap();
        assert_eq!(first.as_deref(), Some("x"));
        assert_eq!(second, None);
    }

    #[test]
    fn a_full_mailbox_refuses_and_a_dropped_receiver_closes() {
        let (tx, rx) = mailbox(2, usize::MAX);
        tx.try_send(Outbound::End).unwrap();
        tx.try_send(Outbound::End).unwrap();
        assert_eq!(tx.try_send(Outbound::End), Err(TrySendError::Full));
        assert!(!tx.is_closed());
        drop(rx);
        assert!(tx.is_closed());
        assert_eq!(tx.try_send(Outbound::End), Err(TrySendError::Closed));
    }

    #[test]
    fn taking_an_item_gives_back_its_bytes() {
        let (tx, mut rx) = mailbox(10, 100);
        tx.try_send(xml("abc")).unwrap();
        assert_eq!(rx.queued_bytes(), 3);
        rx.try_recv().unwrap();
        assert_eq!(rx.queued_bytes(), 0);
        assert!(rx.try_recv().is_none());
        assert_eq!(tx.budget(), 100);
    }

    #[test]
    fn a_burst_s_buffer_is_given_back_once_emptied() {
        let (tx, mut rx) = mailbox(1000, usize::MAX);
        for _ in 0..600 {
            tx.try_send(Outbound::End).unwrap();
        }
        assert!(rx.buffer_capacity() >= 600);
        while rx.try_recv().is_some() {}
        assert_eq!(rx.buffer_capacity(), 0, "an idle mailbox holds no buffer");
        // A trickle keeps its small buffer rather than reallocating for every item.
        for _ in 0..3 {
            tx.try_send(Outbound::End).unwrap();
            rx.try_recv().unwrap();
        }
        assert!(rx.buffer_capacity() > 0 && rx.buffer_capacity() <= KEEP_ITEMS);
    }
}
