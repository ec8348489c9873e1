//! The local session registry: which resources of which users are connected to this node, and
//! the bounded mailbox of each.
//!
//! Every connection is one task that owns its socket; everything else reaches it through its
//! mailbox ([`Outbound`]). The registry lock is held only to look up or change entries, never
//! across an await or a socket write.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::error::StreamError;
use crate::jid::{BareJid, FullJid};
use crate::xml::Element;

/// What can be sent to a session task.
#[derive(Debug)]
pub enum Outbound {
    /// A stanza to write to the client as it is. Boxed, like the error below, to keep this
    /// type one pointer wide: the mailbox allocates its slots 32 at a time per session, so
    /// an inline 100-byte element would cost every idle session kilobytes (RSS per idle session is a benchmark figure, BENCHMARKS.md).
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
    /// written or held by [`crate::csi::Filter`]. Never written itself.
    ClientState(bool),
    /// The contacts whose presence passes [`crate::csi::Filter`] at once, replacing any
    /// earlier list. Never written itself.
    Interest(Arc<InterestList>),
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

/// What other tasks may read about a session: its presence as last broadcast.
#[derive(Debug, Default, Clone)]
pub struct PresenceInfo {
    /// Whether initial presence was sent and no unavailable since (RFC 6121 §4.2).
    pub available: bool,
    /// Priority of the last available presence (RFC 6121 §4.7.2.3), -128..=127.
    pub priority: i8,
    /// The last available presence stanza as broadcast, for probe answers (RFC 6121 §4.3.2).
    pub last: Option<Element>,
    /// Whether the client requested the roster, so it gets roster pushes (RFC 6121 §2.1.6).
    pub interested: bool,
    /// The newest roster version this session was sent (result or push), so changes made
    /// outside this node can be pushed exactly once (`roster_sync`).
    pub roster_ver: Option<i64>,
    /// Whether this resource enabled XEP-0280 carbons ([`crate::carbons`]).
    pub carbons: bool,
}

/// One connected resource.
#[derive(Debug, Clone)]
pub struct SessionHandle {
    /// The bound full JID.
    pub jid: FullJid,
    /// Distinguishes a session from a later one that bound the same full JID.
    pub id: u64,
    /// The session's mailbox.
    tx: mpsc::Sender<Outbound>,
    /// Cancelled to end the session at once (stalled mailbox, shutdown).
    pub kill: CancellationToken,
    /// Presence state, written by the session task, read by routers and probe answers.
    pub info: Arc<Mutex<PresenceInfo>>,
    /// Where and when the session came from, for operators (`presenced session list`).
    pub origin: Origin,
}

/// Where a session came from.
#[derive(Debug, Clone, Copy)]
pub struct Origin {
    /// `tcp` or `websocket`.
    pub transport: &'static str,
    /// The client's address, when the session has a socket.
    pub peer: Option<std::net::SocketAddr>,
    /// When it bound, milliseconds since the Unix epoch.
    pub since_ms: i64,
}

impl Origin {
    /// A session binding now over `transport` from `peer`.
    pub fn now(transport: &'static str, peer: Option<std::net::SocketAddr>) -> Origin {
        Origin {
            transport,
            peer,
            since_ms: chrono::Utc::now().timestamp_millis(),
        }
    }
}

impl SessionHandle {
    /// Queues a stanza. A session whose mailbox is full is not keeping up with its socket:
    /// it is ended rather than letting one slow client hold memory for everyone.
    pub fn send(&self, stanza: Element) -> bool {
        self.push(Outbound::Stanza(Box::new(stanza)))
    }

    /// Queues a serialised stanza (see [`Outbound::Xml`]); the same rules as [`Self::send`].
    pub fn send_xml(&self, xml: Arc<String>) -> bool {
        self.push(Outbound::Xml(xml))
    }

    fn push(&self, msg: Outbound) -> bool {
        match self.tx.try_send(msg) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                tracing::warn!(jid = %self.jid, "session mailbox full; disconnecting");
                self.kill.cancel();
                false
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }

    /// Asks the session to end its stream with `error`.
    pub fn close(&self, error: StreamError) {
        if self.tx.try_send(Outbound::Close(Box::new(error))).is_err() {
            self.kill.cancel();
        }
    }

    /// Records the client's XEP-0352 state in the mailbox, between the stanzas queued
    /// before and after it; the same rules as [`Self::send`].
    pub fn set_client_state(&self, active: bool) -> bool {
        self.push(Outbound::ClientState(active))
    }

    /// Replaces the session's interest list, in order with the stanzas queued around it;
    /// the same rules as [`Self::send`].
    pub fn set_interest(&self, list: InterestList) -> bool {
        self.push(Outbound::Interest(Arc::new(list)))
    }

    /// Asks the session to close its stream cleanly.
    pub fn try_end(&self) -> bool {
        self.tx.try_send(Outbound::End).is_ok()
    }

    /// Asks the writer to stop after flushing; kills the session if the mailbox is full.
    pub fn finish(&self) {
        if self.tx.try_send(Outbound::Finish).is_err() {
            self.kill.cancel();
        }
    }

    /// A copy of the presence state, last presence stanza included. Fan-out paths that only
    /// need a flag use [`SessionHandle::read`] or [`SessionHandle::is_available`] instead,
    /// so no stanza is cloned per recipient.
    pub fn presence(&self) -> PresenceInfo {
        self.read(PresenceInfo::clone)
    }

    /// Reads the presence state under its lock without copying it.
    pub fn read<T>(&self, f: impl FnOnce(&PresenceInfo) -> T) -> T {
        match self.info.lock() {
            Ok(p) => f(&p),
            Err(poisoned) => f(&poisoned.into_inner()),
        }
    }

    /// Whether this resource has sent initial presence and no unavailable since.
    pub fn is_available(&self) -> bool {
        self.read(|p| p.available)
    }
}

/// Registry of the sessions on this node, keyed by bare JID.
#[derive(Debug, Default)]
pub struct Sessions {
    by_user: RwLock<HashMap<String, Vec<SessionHandle>>>,
    next_id: AtomicU64,
}

/// A new session's handle plus the receiving end of its mailbox.
pub struct Registered {
    /// The handle stored in the registry.
    pub handle: SessionHandle,
    /// The mailbox the session task drains.
    pub rx: mpsc::Receiver<Outbound>,
    /// A session that bound the same full JID before and has been told to close.
    pub replaced: Option<SessionHandle>,
}

impl Sessions {
    /// Registers a bound resource. An older session with the same full JID is asked to close
    /// with the `conflict` stream error (RFC 6120 §7.7.2.2, the "override" policy).
    pub fn register(&self, jid: FullJid, queue: usize, parent: &CancellationToken) -> Registered {
        self.register_from(jid, queue, parent, Origin::now("tcp", None))
    }

    /// [`Sessions::register`], recording where the session came from.
    pub fn register_from(
        &self,
        jid: FullJid,
        queue: usize,
        parent: &CancellationToken,
        origin: Origin,
    ) -> Registered {
        let (tx, rx) = mpsc::channel(queue);
        let handle = SessionHandle {
            jid: jid.clone(),
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            tx,
            kill: parent.child_token(),
            info: Arc::default(),
            origin,
        };
        let bare = jid.to_bare().to_string();
        let mut map = self.by_user.write().unwrap_or_else(|e| e.into_inner());
        // Most users have one resource: start the list at one slot, not four.
        let list = map.entry(bare).or_insert_with(|| Vec::with_capacity(1));
        let replaced = list
            .iter()
            .position(|h| h.jid == jid)
            .map(|i| list.swap_remove(i));
        list.push(handle.clone());
        drop(map);
        if let Some(old) = &replaced {
            old.close(StreamError::new(
                "conflict",
                "Replaced by a new session with the same resource",
            ));
        }
        Registered {
            handle,
            rx,
            replaced,
        }
    }

    /// Removes a session if it is still the registered one for its JID.
    pub fn unregister(&self, handle: &SessionHandle) {
        let bare = handle.jid.to_bare().to_string();
        let mut map = self.by_user.write().unwrap_or_else(|e| e.into_inner());
        if let Some(list) = map.get_mut(&bare) {
            list.retain(|h| h.id != handle.id);
            if list.is_empty() {
                map.remove(&bare);
            }
        }
    }

    /// Calls `f` for every bound session, under the registry's read lock (keep `f` short).
    pub fn for_each(&self, f: impl FnMut(&SessionHandle)) {
        let map = self.by_user.read().unwrap_or_else(|e| e.into_inner());
        map.values().flatten().for_each(f);
    }

    /// The session bound to exactly this full JID.
    pub fn get(&self, jid: &FullJid) -> Option<SessionHandle> {
        let map = self.by_user.read().unwrap_or_else(|e| e.into_inner());
        map.get(jid.to_bare().as_str())?
            .iter()
            .find(|h| h.jid == *jid)
            .cloned()
    }

    /// Every session of a user.
    pub fn of_user(&self, bare: &BareJid) -> Vec<SessionHandle> {
        self.of_user_str(bare.as_str())
    }

    /// Calls `f` on every session of a user under the registry's read lock, without
    /// copying handles: the fan-out path. `f` must not block or touch the registry.
    pub fn for_each_of(&self, bare: &str, mut f: impl FnMut(&SessionHandle)) {
        let map = self.by_user.read().unwrap_or_else(|e| e.into_inner());
        for h in map.get(bare).into_iter().flatten() {
            f(h);
        }
    }

    /// Every session of a user, by bare JID string.
    pub fn of_user_str(&self, bare: &str) -> Vec<SessionHandle> {
        let map = self.by_user.read().unwrap_or_else(|e| e.into_inner());
        map.get(bare).cloned().unwrap_or_default()
    }

    /// Bare JIDs of every user with a session here.
    pub fn users(&self) -> Vec<String> {
        let map = self.by_user.read().unwrap_or_else(|e| e.into_inner());
        map.keys().cloned().collect()
    }

    /// Number of connected sessions.
    pub fn count(&self) -> usize {
        let map = self.by_user.read().unwrap_or_else(|e| e.into_inner());
        map.values().map(Vec::len).sum()
    }

    /// Ends every session (shutdown).
    pub fn close_all(&self, error: StreamError) {
        let map = self.by_user.read().unwrap_or_else(|e| e.into_inner());
        for h in map.values().flatten() {
            h.close(error.clone());
        }
    }
}

/// Chooses the resources a message to a bare JID goes to (RFC 6121 §8.5.2.1.1): the available
/// resources with the highest non-negative priority, all of them if several tie.
pub fn message_targets(sessions: &[SessionHandle]) -> Vec<&SessionHandle> {
    // Only the priority is read: no presence stanza is copied per candidate.
    let chosen = highest_priority(
        sessions
            .iter()
            .map(|s| s.read(|p| p.available.then_some(p.priority))),
    );
    sessions
        .iter()
        .zip(chosen)
        .filter_map(|(s, c)| c.then_some(s))
        .collect()
}

/// The rule of [`message_targets`] over any resources, wherever they are: given each one's
/// priority if it is available (`None` if not), which ones take the message.
pub fn highest_priority(priorities: impl Iterator<Item = Option<i8>>) -> Vec<bool> {
    let prios: Vec<Option<i8>> = priorities.collect();
    let best = prios.iter().flatten().copied().filter(|&p| p >= 0).max();
    prios
        .into_iter()
        .map(|p| best.is_some() && p == best)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full(s: &str) -> FullJid {
        FullJid::new(s).unwrap()
    }

    #[tokio::test]
    async fn second_bind_of_same_full_jid_replaces_and_closes_the_first() {
        let s = Sessions::default();
        let root = CancellationToken::new();
        let mut first = s.register(full("a@x/r"), 4, &root);
        let second = s.register(full("a@x/r"), 4, &root);
        assert_eq!(
            second.replaced.as_ref().map(|h| h.id),
            Some(first.handle.id)
        );
        match first.rx.recv().await {
            Some(Outbound::Close(e)) => assert_eq!(e.condition, "conflict"),
            other => panic!("{other:?}"),
        }
        assert_eq!(s.count(), 1);
        // The old session unregistering must not remove the new one.
        s.unregister(&first.handle);
        assert_eq!(s.get(&full("a@x/r")).map(|h| h.id), Some(second.handle.id));
    }

    #[test]
    fn bare_jid_messages_go_to_highest_non_negative_priority() {
        let s = Sessions::default();
        let root = CancellationToken::new();
        let mut handles = Vec::new();
        for (r, prio, avail) in [
            ("a", 1, true),
            ("b", 5, true),
            ("c", 5, true),
            ("d", 9, false),
        ] {
            let reg = s.register(full(&format!("u@x/{r}")), 4, &root);
            {
                let mut p = reg.handle.info.lock().unwrap();
                p.available = avail;
                p.priority = prio;
            }
            handles.push(reg.handle);
        }
        let chosen: Vec<&str> = message_targets(&handles)
            .iter()
            .map(|h| h.jid.resource().as_str())
            .collect();
        assert_eq!(chosen, ["b", "c"]);
        for h in &handles {
            h.info.lock().unwrap().priority = -1;
        }
        assert!(message_targets(&handles).is_empty());
    }

    #[tokio::test]
    async fn full_mailbox_kills_the_session() {
        let s = Sessions::default();
        let root = CancellationToken::new();
        let reg = s.register(full("a@x/r"), 1, &root);
        assert!(reg
            .handle
            .send(Element::new("message", crate::xml::NS_CLIENT)));
        assert!(!reg
            .handle
            .send(Element::new("message", crate::xml::NS_CLIENT)));
        assert!(reg.handle.kill.is_cancelled());
    }
}
