//! The local session registry: which resources of which users are connected to this node, and
//! the bounded mailbox of each.
//!
//! Every connection is one task that owns its socket; everything else reaches it through its
//! mailbox ([`Outbound`]). The registry lock is held only to look up or change entries, never
//! across an await or a socket write.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::node::mailbox::{self, TrySendError};
pub use crate::node::mailbox::{InterestList, Mailbox, Outbound};
use crate::node::names::{NameId, Names};
use crate::node::revealed::RevealedSet;
use crate::policy::privacy::Relation;
use crate::protocol::error::{StreamCondition, StreamError};
use crate::protocol::jid::{bare_of, BareJid, FullJid, SharedJid};
use crate::protocol::xml::{parse_element, Addressed, Element};

/// How much one session's mailbox may hold: `[limits] session_queue` items and
/// `session_queue_bytes` bytes ([`Outbound::weight`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueBudget {
    /// Items.
    pub stanzas: usize,
    /// Bytes.
    pub bytes: usize,
}

impl QueueBudget {
    /// A budget of `stanzas` items and no bound on bytes (tests of the count).
    pub fn stanzas(stanzas: usize) -> QueueBudget {
        QueueBudget {
            stanzas,
            bytes: usize::MAX,
        }
    }
}

/// How long [`SessionHandle::send_paced`] waits for room: the writer's own bound on one
/// write, after which a client that reads nothing has lost its connection anyway.
const PACE_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Bounds of the per-session sets ([`SessionState`]); from `[limits]`.
#[derive(Debug, Clone, Copy)]
pub struct StateLimits {
    /// Targets of directed available presence one session tracks (RFC 6121 §4.6).
    pub max_directed: usize,
    /// Viewers one session records as shown its presence.
    pub max_revealed: usize,
}

impl Default for StateLimits {
    fn default() -> Self {
        StateLimits {
            max_directed: 1000,
            max_revealed: 5000,
        }
    }
}

/// Everything other tasks need to know about one session, in one place behind its handle:
/// its presence as last broadcast, its roster interest, its privacy state, and whom its
/// presence reached. Written by the session task and by whoever holds the subject lock
/// (`node::visibility::SubjectLocks::lock_subject`) for the session's user; the decisions about
/// it are the gate's (`presence::gate`), this only remembers. It lives exactly as long as
/// the session: nothing about it is kept in a node-wide map.
#[derive(Debug, Default)]
pub struct SessionState {
    /// Whether initial presence was sent and no unavailable since (RFC 6121 §4.2).
    pub available: bool,
    /// Priority of the last available presence (RFC 6121 §4.7.2.3), -128..=127.
    pub priority: i8,
    /// The last available presence stanza as broadcast, for probe answers (RFC 6121 §4.3.2):
    /// the broadcast's own serialisation without `to`, shared with it, not an element tree
    /// (one allocation kept per available session, and each answer is two slices copied).
    pub last: Option<Arc<Addressed>>,
    /// Whether the client requested the roster, so it gets roster pushes (RFC 6121 §2.1.6).
    pub interested: bool,
    /// The newest roster version this session was sent (result or push), so changes made
    /// outside this node can be pushed exactly once (`roster_sync`).
    pub roster_ver: Option<i64>,
    /// Whether this resource enabled XEP-0280 carbons ([`crate::services::carbons`]).
    pub carbons: bool,
    /// XEP-0186 invisible: no broadcast, probes answered as unavailable.
    pub invisible: bool,
    /// While invisible, whether probes still go to remote contacts (XEP-0186 `probe`).
    pub probe_remote: bool,
    /// Its connection died and it waits for its client to resume it (XEP-0198 §5): bound,
    /// and shown to contacts as before, but no client is there; operators see it marked.
    pub detached: bool,
    /// Detached for longer than T with push enabled: kept resumable for `[push]
    /// hibernation`, shown unavailable to contacts meanwhile. `hid` says whether its
    /// presence was withdrawn for it (not when the user was invisible already), so that a
    /// resume shows it again.
    pub hibernated: Option<Hibernated>,
    /// The XEP-0357 registration this session's client enabled, if any: whom to notify
    /// while it is detached ([`crate::services::push`]).
    pub push: Option<Arc<PushTarget>>,
    /// The session retrieved its block list, so it gets block/unblock pushes
    /// (XEP-0191 §3.3: pushes go to resources that requested the list).
    pub blocklist_interested: bool,
    /// XEP-0388 `<user-agent id/>` of the client installation that authenticated this
    /// session with SASL2: stable across its logins, what per-installation credentials are
    /// bound to.
    pub user_agent: Option<Box<str>>,
    /// The features of its client (XEP-0115), as the server last learnt them: shared with
    /// the node's cache of `ver`s when verified (`caps::CapsCache`).
    pub caps: Option<crate::node::caps::Features>,
    /// Viewer JID (bare for a roster contact, as addressed for directed presence) → how
    /// the viewer came to see this resource. At most `limits.max_revealed` entries. The
    /// JIDs are ids in the node's [`Names`] (K contacts are K entries in each of their
    /// sessions: 4 bytes each in a sorted vector instead of a string of their own).
    revealed: RevealedSet,
    /// JIDs this session sent directed available presence to and that must get its
    /// unavailable (RFC 6121 §4.6.3). At most `limits.max_directed` entries.
    directed: BTreeSet<String>,
    limits: StateLimits,
    /// Where the ids of `revealed` name their JIDs.
    names: Arc<Names>,
}

impl Drop for SessionState {
    fn drop(&mut self) {
        self.names
            .release_all(std::mem::take(&mut self.revealed).into_ids());
    }
}

impl SessionState {
    fn new(limits: StateLimits, names: Arc<Names>) -> Self {
        SessionState {
            available: false,
            priority: 0,
            last: None,
            interested: false,
            roster_ver: None,
            carbons: false,
            invisible: false,
            probe_remote: false,
            detached: false,
            hibernated: None,
            push: None,
            blocklist_interested: false,
            user_agent: None,
            caps: None,
            revealed: RevealedSet::default(),
            directed: BTreeSet::new(),
            limits,
            names,
        }
    }

    /// The entry of `viewer` in `revealed`, if it has one.
    fn revealed_id(&self, viewer: &str) -> Option<NameId> {
        let id = self.names.find(viewer)?;
        self.revealed.contains(id).then_some(id)
    }

    /// Whether `viewer` may be recorded as shown (it is already, or there is room): a
    /// presence is delivered only to a viewer it can be withdrawn from later.
    pub fn can_reveal(&self, viewer: &str) -> bool {
        self.revealed.len() < self.limits.max_revealed || self.revealed_id(viewer).is_some()
    }

    /// How many more new viewers can be recorded.
    pub fn room(&self) -> usize {
        self.limits.max_revealed.saturating_sub(self.revealed.len())
    }

    /// Records that this session's available presence reached `viewer`; false, recording
    /// nothing, when the set is full and `viewer` is new.
    pub fn reveal(&mut self, viewer: &str, relation: Relation) -> bool {
        match self.revealed_id(viewer) {
            // A subscriber relation is not downgraded by a later directed presence.
            Some(id) if relation == Relation::Subscriber => self.revealed.insert(id, relation),
            Some(_) => {}
            None if self.revealed.len() < self.limits.max_revealed => {
                let id = self.names.acquire(viewer);
                self.revealed.insert(id, relation);
            }
            None => return false,
        }
        true
    }

    /// Forgets that this session was shown to `viewer`; true if it had been.
    pub fn forget(&mut self, viewer: &str) -> bool {
        let Some(id) = self.revealed_id(viewer) else {
            return false;
        };
        self.revealed.remove(id);
        self.names.release(id);
        true
    }

    /// How this session came to be shown to `viewer`, if it was.
    pub fn revealed_relation(&self, viewer: &str) -> Option<Relation> {
        self.revealed.get(self.names.find(viewer)?)
    }

    /// The viewers this session was shown to, and how.
    pub fn revealed(&self) -> Vec<(Arc<str>, Relation)> {
        self.names.names(self.revealed.iter())
    }

    /// Whether this session was shown to a viewer whose JID satisfies `pred`.
    pub fn revealed_any(&self, pred: impl Fn(&str) -> bool) -> bool {
        self.names.any(self.revealed.ids(), pred)
    }

    /// Takes (and clears) the set of viewers this session was shown to.
    pub fn take_revealed(&mut self) -> Vec<(Arc<str>, Relation)> {
        let taken = std::mem::take(&mut self.revealed);
        let named = self.names.names(taken.iter());
        self.names.release_all(taken.into_ids());
        named
    }

    /// Tracks `to` as a directed-presence recipient; false, tracking nothing, when the set
    /// is full and `to` is new.
    pub fn add_directed(&mut self, to: &str) -> bool {
        if self.directed.contains(to) {
            return true;
        }
        if self.directed.len() >= self.limits.max_directed {
            return false;
        }
        self.directed.insert(to.to_owned())
    }

    /// Whether `to` is tracked as a directed-presence recipient.
    pub fn is_directed(&self, to: &str) -> bool {
        self.directed.contains(to)
    }

    /// Stops tracking `to` (it got unavailable, or no longer may).
    pub fn remove_directed(&mut self, to: &str) {
        self.directed.remove(to);
    }

    /// How many directed-presence recipients are tracked.
    pub fn directed_len(&self) -> usize {
        self.directed.len()
    }

    /// Whether any directed-presence recipient is tracked.
    pub fn has_directed(&self) -> bool {
        !self.directed.is_empty()
    }

    /// Takes (and clears) the directed-presence recipients.
    pub fn take_directed(&mut self) -> BTreeSet<String> {
        std::mem::take(&mut self.directed)
    }

    /// Keeps only the directed-presence recipients `keep` accepts.
    pub fn retain_directed(&mut self, keep: impl FnMut(&String) -> bool) {
        self.directed.retain(keep);
    }

    /// Entries held in the bounded sets (directed recipients and viewers shown).
    pub fn tracked(&self) -> usize {
        self.directed.len() + self.revealed.len()
    }

    /// Invisible because the user chose it (XEP-0186), not only for a hibernation: what
    /// no public figure may count, and what operators see as "invisible".
    pub fn invisible_by_choice(&self) -> bool {
        self.invisible && !self.hibernated.is_some_and(|h| h.hid)
    }

    /// Drops everything the session remembers about others (it ended).
    pub fn clear(&mut self) {
        let taken = std::mem::take(&mut self.revealed);
        self.names.release_all(taken.into_ids());
        self.directed = BTreeSet::new();
        self.caps = None;
    }
}

/// A session's hibernation ([`SessionState::hibernated`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hibernated {
    /// Whether its presence was withdrawn from its viewers when it began.
    pub hid: bool,
}

/// Where a XEP-0357 notification goes: the app server, its node for the device, and the
/// publish options (the client's secret form, serialized) sent with each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushTarget {
    /// The app server's JID.
    pub app_jid: String,
    /// The node on it.
    pub node: String,
    /// The publish options, or empty.
    pub options: String,
}

/// One connected resource.
#[derive(Debug, Clone)]
pub struct SessionHandle {
    /// The bound full JID (shared with every clone and with liveness and the cluster).
    pub jid: SharedJid,
    /// Distinguishes a session from a later one that bound the same full JID.
    pub id: u64,
    /// The session's mailbox, with the bytes in it against its budget.
    tx: mailbox::Sender,
    /// Cancelled to end the session at once (stalled mailbox, shutdown).
    pub kill: CancellationToken,
    /// The session's state ([`SessionState`]), shared with every task that reads it.
    state: Arc<Mutex<SessionState>>,
    /// Where and when the session came from, for operators (`presenced session list`).
    pub origin: Origin,
}

/// [`Sessions::visible_counts`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct VisibleCounts {
    /// Users with at least one visible session.
    pub users: usize,
    /// Visible sessions over TCP.
    pub tcp: usize,
    /// Visible sessions over WebSocket.
    pub websocket: usize,
    /// Of the visible sessions, those detached and waiting for their client to resume them
    /// (XEP-0198): counted above, since their contacts still see them, but no client is
    /// connected.
    pub detached: usize,
    /// Sessions hibernated (XEP-0357): asleep, woken by push, shown offline to their
    /// contacts, so not counted above. Sessions the user made invisible are left out.
    pub hibernated: usize,
}

impl VisibleCounts {
    /// Visible sessions.
    pub fn sessions(&self) -> usize {
        self.tcp + self.websocket
    }
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

    /// Queues a stanza once its bytes fit the mailbox's budget, waiting (at most
    /// [`PACE_WAIT`]) for the writer to take what is queued: for a burst the session asked
    /// for and whose size the server does not choose, such as the messages kept offline
    /// (XEP-0160), which must not end the session they are handed to. Then as
    /// [`Self::send`].
    pub async fn send_paced(&self, stanza: Element) -> bool {
        let w = stanza.weight();
        let deadline = tokio::time::Instant::now() + PACE_WAIT;
        loop {
            let drained = self.tx.drained().notified();
            let mut drained = std::pin::pin!(drained);
            // Registered before the check, so a receive in between is not missed.
            drained.as_mut().enable();
            if self.tx.fits_or_closed(w) {
                break;
            }
            tokio::select! {
                _ = drained => {}
                _ = self.kill.cancelled() => return false,
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
        self.send(stanza)
    }

    /// What a session does when its mailbox refuses an item for its count or its bytes
    /// (the mailbox's bounds, [`mailbox::Sender::try_send`]): it ends. The client is not
    /// reading what is written to it; holding more for it would let one slow or stalled
    /// client take memory from everyone.
    fn push(&self, msg: Outbound) -> bool {
        match self.tx.try_send(msg) {
            Ok(()) => true,
            Err(TrySendError::OverBudget { queued }) => {
                tracing::warn!(
                    jid = %self.jid,
                    peer = ?self.origin.peer,
                    queued,
                    "session mailbox over its byte budget (session_queue_bytes); disconnecting"
                );
                self.kill.cancel();
                false
            }
            Err(TrySendError::Full) => {
                tracing::warn!(
                    jid = %self.jid,
                    peer = ?self.origin.peer,
                    "session mailbox full (session_queue); disconnecting"
                );
                self.kill.cancel();
                false
            }
            Err(TrySendError::Closed) => false,
        }
    }

    /// Asks the session to end its stream with `error`.
    pub fn close(&self, error: StreamError) {
        if self
            .tx
            .try_send_control(Outbound::Close(Box::new(error)))
            .is_err()
        {
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

    /// Queues a XEP-0198 element ([`Outbound::SmEnabled`], [`Outbound::SmNonza`]); the same
    /// rules as [`Self::send`].
    pub fn send_sm(&self, msg: Outbound) -> bool {
        self.push(msg)
    }

    /// Asks the session to close its stream cleanly.
    pub fn try_end(&self) -> bool {
        self.tx.try_send_control(Outbound::End).is_ok()
    }

    /// Asks the writer to stop after flushing; kills the session if the mailbox is full.
    pub fn finish(&self) {
        if self.tx.try_send_control(Outbound::Finish).is_err() {
            self.kill.cancel();
        }
    }

    /// The last available presence as broadcast (parsed back from its serialisation), if
    /// the session is available.
    pub fn last_presence(&self) -> Option<Element> {
        self.read(|p| p.last.clone())
            .and_then(|l| parse_element(l.unaddressed()))
    }

    /// [`Self::last_presence`] as a client stream carries it to `to` (one allocation).
    pub fn last_presence_to(&self, to: &str) -> Option<String> {
        self.read(|p| p.last.as_ref().map(|l| l.to(to)))
    }

    /// Reads the state under its lock without copying it. `f` must not block.
    pub fn read<T>(&self, f: impl FnOnce(&SessionState) -> T) -> T {
        match self.state.lock() {
            Ok(p) => f(&p),
            Err(poisoned) => f(&poisoned.into_inner()),
        }
    }

    /// Changes the state under its lock. `f` must not block.
    pub fn write<T>(&self, f: impl FnOnce(&mut SessionState) -> T) -> T {
        match self.state.lock() {
            Ok(mut p) => f(&mut p),
            Err(poisoned) => f(&mut poisoned.into_inner()),
        }
    }

    /// Whether this resource has sent initial presence and no unavailable since.
    pub fn is_available(&self) -> bool {
        self.read(|p| p.available)
    }

    /// Whether this session is invisible (XEP-0186).
    pub fn is_invisible(&self) -> bool {
        self.read(|p| p.invisible)
    }

    /// Whether the session hibernates: detached for longer than T with push enabled.
    pub fn is_hibernated(&self) -> bool {
        self.read(|p| p.hibernated.is_some())
    }

    /// Whether the session waits, detached, for its client to resume it (XEP-0198).
    pub fn is_detached(&self) -> bool {
        self.read(|p| p.detached)
    }

    /// See [`SessionState::reveal`].
    pub fn reveal(&self, viewer: &str, relation: Relation) -> bool {
        self.write(|p| p.reveal(viewer, relation))
    }

    /// See [`SessionState::forget`].
    pub fn forget(&self, viewer: &str) -> bool {
        self.write(|p| p.forget(viewer))
    }

    /// See [`SessionState::revealed_relation`].
    pub fn revealed_relation(&self, viewer: &str) -> Option<Relation> {
        self.read(|p| p.revealed_relation(viewer))
    }

    /// Whether this session's presence reached `viewer`.
    pub fn was_revealed(&self, viewer: &str) -> bool {
        self.revealed_relation(viewer).is_some()
    }

    /// The viewers this session was shown to, and how (a copy).
    pub fn revealed(&self) -> Vec<(Arc<str>, Relation)> {
        self.read(|p| p.revealed())
    }
}

/// A registry key: a user's bare JID, the bare part of the session's shared full JID that
/// made the entry (no string of its own). It hashes, compares and borrows as that bare
/// part, so the registry is looked up with a `&str`.
#[derive(Debug, Clone)]
struct UserKey(SharedJid);

impl UserKey {
    fn as_str(&self) -> &str {
        bare_of(self.0.as_str())
    }
}

impl PartialEq for UserKey {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for UserKey {}

impl std::hash::Hash for UserKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_str().hash(state)
    }
}

impl std::borrow::Borrow<str> for UserKey {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

/// Registry of the sessions on this node, keyed by bare JID.
#[derive(Debug, Default)]
pub struct Sessions {
    by_user: RwLock<HashMap<UserKey, Vec<SessionHandle>>>,
    next_id: AtomicU64,
    limits: StateLimits,
    /// The JIDs the sessions' `revealed` sets name by id.
    names: Arc<Names>,
    /// Where the time a session bound is read (the node's one clock).
    clock: Clock,
}

/// A new session's handle plus the receiving end of its mailbox.
pub struct Registered {
    /// The handle stored in the registry.
    pub handle: SessionHandle,
    /// The mailbox the session task drains.
    pub rx: Mailbox,
    /// A session that bound the same full JID before and has been told to close.
    pub replaced: Option<SessionHandle>,
}

impl Sessions {
    /// An empty registry whose sessions' sets are bounded by `limits`, reading wall time
    /// from `clock`.
    pub fn new(limits: StateLimits, clock: Clock) -> Self {
        Sessions {
            limits,
            clock,
            ..Default::default()
        }
    }

    /// A session binding now over `transport` from `peer`.
    pub fn origin(&self, transport: &'static str, peer: Option<std::net::SocketAddr>) -> Origin {
        Origin {
            transport,
            peer,
            since_ms: self.clock.now_ms(),
        }
    }

    /// Registers a bound resource. An older session with the same full JID is asked to close
    /// with the `conflict` stream error (RFC 6120 §7.7.2.2, the "override" policy).
    pub fn register(
        &self,
        jid: impl Into<SharedJid>,
        queue: QueueBudget,
        parent: &CancellationToken,
    ) -> Registered {
        self.register_from(jid, queue, parent, self.origin("tcp", None))
    }

    /// [`Sessions::register`], recording where the session came from.
    pub fn register_from(
        &self,
        jid: impl Into<SharedJid>,
        queue: QueueBudget,
        parent: &CancellationToken,
        origin: Origin,
    ) -> Registered {
        let jid = jid.into();
        let (tx, rx) = mailbox::mailbox(queue.stanzas, queue.bytes);
        let handle = SessionHandle {
            jid: jid.clone(),
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            tx,
            kill: parent.child_token(),
            state: Arc::new(Mutex::new(SessionState::new(
                self.limits,
                Arc::clone(&self.names),
            ))),
            origin,
        };
        let mut map = self.by_user.write().unwrap_or_else(|e| e.into_inner());
        // Most users have one resource: start the list at one slot, not four.
        let list = map
            .entry(UserKey(jid.clone()))
            .or_insert_with(|| Vec::with_capacity(1));
        let replaced = list
            .iter()
            .position(|h| h.jid == jid)
            .map(|i| list.swap_remove(i));
        list.push(handle.clone());
        drop(map);
        if let Some(old) = &replaced {
            old.close(StreamError::new(
                StreamCondition::Conflict,
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
        let bare = bare_of(handle.jid.as_str());
        let mut map = self.by_user.write().unwrap_or_else(|e| e.into_inner());
        if let Some(list) = map.get_mut(bare) {
            list.retain(|h| h.id != handle.id);
            if list.is_empty() {
                map.remove(bare);
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

    /// Whether the user has a resource here that is available and not invisible
    /// (XEP-0186): one a contact may be shown. Reads under the map's lock, no clone.
    pub fn shows_online_here(&self, bare: &str) -> bool {
        let map = self.by_user.read().unwrap_or_else(|e| e.into_inner());
        map.get(bare)
            .is_some_and(|v| v.iter().any(|s| s.is_available() && !s.is_invisible()))
    }

    /// Bare JIDs of every user with a session here.
    pub fn users(&self) -> Vec<String> {
        let map = self.by_user.read().unwrap_or_else(|e| e.into_inner());
        map.keys().map(|k| k.as_str().to_owned()).collect()
    }

    /// Sessions and users that are not invisible (XEP-0186), by transport: the only session
    /// figures any report outside the admin socket shows, since a count that rises when an
    /// invisible user logs in tells its reader what the user's contacts may not learn.
    pub fn visible_counts(&self) -> VisibleCounts {
        let map = self.by_user.read().unwrap_or_else(|e| e.into_inner());
        let mut c = VisibleCounts::default();
        for list in map.values() {
            let mut any = false;
            for h in list {
                let (invisible, hid, detached) =
                    h.read(|p| (p.invisible, p.hibernated.is_some_and(|h| h.hid), p.detached));
                if hid {
                    c.hibernated += 1;
                }
                if invisible {
                    continue;
                }
                any = true;
                c.detached += usize::from(detached);
                match h.origin.transport {
                    "websocket" => c.websocket += 1,
                    _ => c.tcp += 1,
                }
            }
            c.users += usize::from(any);
        }
        c
    }

    /// Asks each of `sessions` to end with `error` and waits, at most `within`, until
    /// they are gone from the registry (a later session that bound the same full JID does
    /// not count as theirs). Returns how many there were.
    pub async fn close_and_wait(
        &self,
        sessions: &[SessionHandle],
        error: &StreamError,
        within: std::time::Duration,
    ) -> usize {
        for s in sessions {
            tracing::info!(jid = %s.jid, condition = %error.condition, "ending session");
            s.close(error.clone());
        }
        let gone = |s: &SessionHandle| self.get(&s.jid).is_none_or(|h| h.id != s.id);
        let deadline = tokio::time::Instant::now() + within;
        while !sessions.iter().all(gone) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        sessions.len()
    }

    /// Number of connected sessions.
    pub fn count(&self) -> usize {
        let map = self.by_user.read().unwrap_or_else(|e| e.into_inner());
        map.values().map(Vec::len).sum()
    }

    /// Bare JIDs of users whose sessions have revealed presence to `viewer_bare` (or to
    /// one of its full JIDs).
    pub fn subjects_revealed_to(&self, viewer_bare: &str) -> HashSet<String> {
        let map = self.by_user.read().unwrap_or_else(|e| e.into_inner());
        map.iter()
            .filter(|(_, list)| {
                list.iter()
                    .any(|h| h.read(|p| p.revealed_any(|v| bare_of(v) == viewer_bare)))
            })
            .map(|(user, _)| user.as_str().to_owned())
            .collect()
    }

    /// Entries held in every registered session's bounded sets.
    pub fn tracked(&self) -> usize {
        let map = self.by_user.read().unwrap_or_else(|e| e.into_inner());
        map.values()
            .flatten()
            .map(|h| h.read(SessionState::tracked))
            .sum()
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
        crate::protocol::jid::parse_full(s).unwrap()
    }

    #[tokio::test]
    async fn second_bind_of_same_full_jid_replaces_and_closes_the_first() {
        let s = Sessions::default();
        let root = CancellationToken::new();
        let mut first = s.register(full("a@x/r"), QueueBudget::stanzas(4), &root);
        let second = s.register(full("a@x/r"), QueueBudget::stanzas(4), &root);
        assert_eq!(
            second.replaced.as_ref().map(|h| h.id),
            Some(first.handle.id)
        );
        match first.rx.recv().await {
            Some(Outbound::Close(e)) => assert_eq!(e.condition.as_str(), "conflict"),
            other => panic!("{other:?}"),
        }
        assert_eq!(s.count(), 1);
        // The old session unregistering must not remove the new one.
        s.unregister(&first.handle);
        assert_eq!(s.get(&full("a@x/r")).map(|h| h.id), Some(second.handle.id));
    }

    #[test]
    fn the_stored_presence_answers_probes_addressed_to_each_prober_with_all_it_carried() {
        // RFC 6121 §4.3.2: a probe is answered with the last presence as broadcast, to the
        // prober. It is kept as the broadcast's serialisation; both ways of reading it
        // must give back every child and attribute, and only the new `to`.
        let s = Sessions::default();
        let root = CancellationToken::new();
        let r = s.register(full("a@x/r"), QueueBudget::stanzas(4), &root);
        let sent = crate::protocol::xml::parse_element(
            "<presence from='a@x/r' to='old@x' xml:lang='en'><show>away</show>\
             <status>it&apos;s &lt;late&gt;</status>\
             <c xmlns='http://jabber.org/protocol/caps' hash='sha-1' node='n' ver='v'/>\
             </presence>",
        )
        .unwrap();
        r.handle
            .write(|p| p.last = Some(Arc::new(Addressed::new(&sent))));
        // Attribute order carries no meaning (XML 1.0 §3.1).
        let sorted = |mut e: Element| {
            e.attrs.sort();
            e
        };
        let mut expected = sent.clone();
        expected.set_attr("to", "b@y/p");
        let answered = r.handle.last_presence_to("b@y/p").unwrap();
        assert_eq!(
            crate::protocol::xml::parse_element(&answered).map(sorted),
            Some(sorted(expected))
        );
        let mut unaddressed = sent.clone();
        unaddressed.remove_attr("to");
        assert_eq!(r.handle.last_presence(), Some(unaddressed));
        r.handle.write(|p| p.last = None);
        assert_eq!(r.handle.last_presence_to("b@y/p"), None);
    }

    #[test]
    fn a_user_stays_registered_under_its_bare_jid_after_the_session_that_keyed_it_ends() {
        // The registry's key is the bare part of the first session's JID: it must still
        // find the user once that session is gone and another remains, and only then.
        let s = Sessions::default();
        let root = CancellationToken::new();
        let first = s.register(full("a@x/one"), QueueBudget::stanzas(4), &root);
        let second = s.register(full("a@x/two"), QueueBudget::stanzas(4), &root);
        s.unregister(&first.handle);
        let left: Vec<u64> = s.of_user_str("a@x").iter().map(|h| h.id).collect();
        assert_eq!(left, [second.handle.id]);
        assert_eq!(s.users(), ["a@x"]);
        assert!(s.get(&full("a@x/one")).is_none());
        s.unregister(&second.handle);
        assert!(s.of_user_str("a@x").is_empty());
        assert!(s.users().is_empty());
        let again = s.register(full("a@x/one"), QueueBudget::stanzas(4), &root);
        assert_eq!(s.get(&full("a@x/one")).map(|h| h.id), Some(again.handle.id));
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
            let reg = s.register(full(&format!("u@x/{r}")), QueueBudget::stanzas(4), &root);
            reg.handle.write(|p| {
                p.available = avail;
                p.priority = prio;
            });
            handles.push(reg.handle);
        }
        let chosen: Vec<&str> = message_targets(&handles)
            .iter()
            .map(|h| h.jid.resource().as_str())
            .collect();
        assert_eq!(chosen, ["b", "c"]);
        for h in &handles {
            h.write(|p| p.priority = -1);
        }
        assert!(message_targets(&handles).is_empty());
    }

    #[tokio::test]
    async fn full_mailbox_kills_the_session() {
        let s = Sessions::default();
        let root = CancellationToken::new();
        let reg = s.register(full("a@x/r"), QueueBudget::stanzas(1), &root);
        assert!(reg
            .handle
            .send(Element::new("message", crate::protocol::xml::NS_CLIENT)));
        assert!(!reg
            .handle
            .send(Element::new("message", crate::protocol::xml::NS_CLIENT)));
        assert!(reg.handle.kill.is_cancelled());
    }

    #[test]
    fn the_revealed_and_directed_sets_stop_at_their_bounds() {
        let names = Arc::new(Names::default());
        let mut st = SessionState::new(
            StateLimits {
                max_directed: 2,
                max_revealed: 2,
            },
            Arc::clone(&names),
        );
        assert!(st.reveal("a@x", Relation::DirectedPresence));
        assert!(st.reveal("b@x", Relation::Subscriber));
        // Full: a new viewer is refused, a known one is still updated (never downgraded).
        assert!(!st.can_reveal("c@x"));
        assert!(!st.reveal("c@x", Relation::Subscriber));
        assert!(st.reveal("a@x", Relation::Subscriber));
        assert!(st.reveal("b@x", Relation::DirectedPresence));
        assert_eq!(st.revealed_relation("a@x"), Some(Relation::Subscriber));
        assert_eq!(st.revealed_relation("b@x"), Some(Relation::Subscriber));
        assert_eq!(st.revealed_relation("c@x"), None);
        assert!(st.forget("a@x"));
        assert!(st.reveal("c@x", Relation::Subscriber));

        assert!(st.add_directed("p@x/r"));
        assert!(st.add_directed("q@x/r"));
        assert!(!st.add_directed("r@x/r"));
        assert!(st.add_directed("p@x/r"));
        assert_eq!(st.directed_len(), 2);
        assert_eq!(st.tracked(), 4);
        st.clear();
        assert_eq!(st.tracked(), 0);
        assert!(names.is_empty(), "clearing gives back the viewers' ids");
    }

    #[test]
    fn sessions_share_a_viewer_until_the_last_of_them_forgets_it() {
        let names = Arc::new(Names::default());
        let mut a = SessionState::new(StateLimits::default(), Arc::clone(&names));
        let mut b = SessionState::new(StateLimits::default(), Arc::clone(&names));
        assert!(a.reveal("v@x", Relation::Subscriber));
        assert!(b.reveal("v@x", Relation::DirectedPresence));
        assert!(a.reveal("w@x", Relation::Subscriber));
        assert_eq!(
            names.len(),
            2,
            "one string per viewer, however many sessions"
        );
        // One session's entry says nothing about the other's.
        assert_eq!(b.revealed_relation("w@x"), None);
        assert!(!b.forget("w@x"));
        let taken = a.take_revealed();
        assert_eq!(taken.len(), 2);
        assert_eq!(a.revealed_relation("v@x"), None);
        assert_eq!(
            b.revealed_relation("v@x"),
            Some(Relation::DirectedPresence),
            "b still holds v"
        );
        assert_eq!(names.len(), 1);
        drop(b);
        assert!(
            names.is_empty(),
            "a session's end gives back its viewers' ids"
        );
    }
}
