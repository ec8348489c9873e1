//! Many nodes on one PostgreSQL database and one Redis key prefix: the session directory
//! (which node holds which full JID, [`directory`]) and one pub/sub channel per node
//! ([`envelope`]).
//!
//! ```text
//! bind ─▶ Op::Claim ─▶ directory entry; a previous holder on another node gets `kick`
//! presence change ─▶ Op::Update (availability, priority, visible presence)
//! session end ─▶ Op::Release (only if this instance still holds the entry)
//! a stanza for a user with sessions elsewhere ─▶ Op::Forward / Op::Send
//!     ─▶ the task reads the recipients' directory entries (one pipeline per batch)
//!     ─▶ ONE publish per node holding recipients: their JIDs + the stanza once
//!        (`PUBLISH` on a single Redis, sharded `SPUBLISH` on a Redis Cluster)
//! channel of this node ─▶ [`listen`] ─▶ the delivery module delivers to local sessions
//! directory writes ─▶ `invalidate` to every other node ─▶ its copy ([`cache`]) drops them
//! ```
//!
//! Decisions (privacy gate, blocks, RFC 6121 §8.5 target choice) are taken on the node
//! where the stanza is produced, before anything is sent here; a receiving node only
//! delivers to its sessions. Every change and every forward goes through one task in
//! order, so two stanzas one node sends to another arrive in the order they were sent.
//! With no other live instance (one node) nothing is read or published: only the
//! directory writes happen, so a node that joins later finds the sessions.
//!
//! This module knows nothing above it: it is handed JIDs and serialised stanzas, and
//! hands received envelopes to a callback ([`listen`]).

pub mod cache;
pub mod directory;
pub mod envelope;
pub(crate) mod pubsub;
pub mod redis_conn;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::cluster::redis_conn::{Conn, SlotPipe, Target};
use crate::config::Config;
use crate::protocol::jid::{FullJid, SharedJid};
pub use directory::Entry;
pub use envelope::{Envelope, Kind};

/// A session of a user on another live node, from the directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// The bound full JID.
    pub jid: String,
    /// What the directory says about it.
    pub entry: Entry,
}

impl Holder {
    /// The node holding it.
    pub fn node(&self) -> &str {
        self.entry.node()
    }
}

/// Work for the cluster task, applied in order.
#[derive(Debug)]
enum Op {
    // A session's own resources carry its shared JID (no copy per change).
    Claim(SharedJid, Entry),
    Update(SharedJid, Entry),
    Release(SharedJid),
    /// Drop an entry if the instance that wrote it is no longer live.
    ForgetDead(FullJid),
    /// Deliver to JIDs wherever they are on other nodes: bare JIDs to every node with a
    /// session of the user, full JIDs to the node holding them. Answers with the JIDs
    /// that had somewhere to go.
    Forward {
        to: Vec<String>,
        xml: Arc<String>,
        kind: Kind,
        reached: Option<oneshot::Sender<HashSet<String>>>,
        /// Read the recipients' rows from Redis, not this node's copy (see
        /// [`Cluster::forward_reaching`]).
        fresh: bool,
    },
    /// An envelope for a node already chosen.
    Send(String, Envelope),
}

/// Counters for tests and /metrics-style reading.
#[derive(Debug, Default)]
pub struct Counters {
    /// Messages published to other nodes.
    pub published: AtomicU64,
    /// Messages received from other nodes.
    pub received: AtomicU64,
    /// Directory reads (one per user looked up).
    pub lookups: AtomicU64,
    /// Redis failures.
    pub errors: AtomicU64,
}

struct Inner {
    node: String,
    instance: Arc<str>,
    keys: directory::Keys,
    client: Option<Target>,
    conn: tokio::sync::Mutex<Option<Conn>>,
    timeout: Duration,
    ttl: Duration,
    /// Without a heartbeat for this long an instance is dead ([`node_timeout`]).
    node_timeout: Duration,
    max_recipients: usize,
    /// Live instances other than this one, as of the last heartbeat.
    peers: RwLock<HashSet<String>>,
    /// This instance's entries, rewritten after Redis comes back and kept from expiring.
    local: Mutex<HashMap<SharedJid, Entry>>,
    ops: mpsc::Sender<Op>,
    ops_rx: Mutex<Option<mpsc::Receiver<Op>>>,
    counters: Counters,
    /// Notified when this instance is back in Redis after being cut off from it.
    rejoined: tokio::sync::Notify,
    /// Releases that could not be written (Redis down), written again when it returns.
    unreleased: Mutex<Vec<SharedJid>>,
    /// This node's copy of directory rows.
    cache: cache::Cache,
    /// Where heartbeat and directory stamps read wall time (the node's one clock).
    clock: Clock,
}

/// How often an instance heartbeats: often enough that a dead one drops out of the live
/// set soon after [`node_timeout`], and that a started node is seen within a fraction of T.
fn heartbeat_period(ttl: Duration) -> Duration {
    (ttl / 4).min(Duration::from_secs(5))
}

/// How long an instance may go without a heartbeat before the others count it dead:
/// T − redis_refresh, and never less than three heartbeat periods.
///
/// Why not T: a killed node's resource beats go stale from T − redis_refresh after the
/// kill on (each was last written up to one refresh before it), spread over one refresh
/// interval. While the node still counts as live, the sweeper puts those beats back (a
/// node that heartbeats but does not listen is re-making its subscription); with a
/// timeout of T every one of them waited for T and was then announced in one burst, which
/// no sweeper can work through within one sweep once a node holds thousands. Dead by the
/// time its first beats go stale, the node's sessions are announced as their beats go
/// stale, each within T plus one sweep of the kill. Nothing is announced for a live node
/// either way: only a resource whose beat is older than T is, and only when its node has
/// neither listened nor heartbeated for this long.
fn node_timeout(ttl: Duration, redis_refresh: Duration) -> Duration {
    ttl.saturating_sub(redis_refresh)
        .max(heartbeat_period(ttl) * 3)
        .min(ttl)
}

/// The cluster state of one node. Cheap to clone.
#[derive(Clone)]
pub struct Cluster {
    inner: Arc<Inner>,
}

impl Cluster {
    /// State for a checked config, reading wall time from `clock`; nothing connects until
    /// [`Cluster::start`].
    pub fn new(config: &Config, clock: Clock) -> Cluster {
        let node = config.cluster.node().to_owned();
        let instance = format!("{node}#{:016x}", rand::random::<u64>());
        let (tx, rx) = mpsc::channel(65_536);
        // Without Redis (no `[redis] url` nor `[cluster] redis_nodes`: the in-process
        // liveness of a single node) there is no cluster: nothing is queued or written.
        let client = Target::from_config(config).ok().flatten();
        Cluster {
            inner: Arc::new(Inner {
                node,
                instance: instance.into(),
                keys: directory::Keys::new(&config.redis.key_prefix),
                client,
                conn: tokio::sync::Mutex::new(None),
                timeout: config.redis.timeout,
                ttl: config.liveness.ttl,
                node_timeout: node_timeout(config.liveness.ttl, config.liveness.redis_refresh),
                max_recipients: config.cluster.max_recipients_per_message,
                peers: RwLock::default(),
                local: Mutex::default(),
                ops: tx,
                ops_rx: Mutex::new(Some(rx)),
                counters: Counters::default(),
                rejoined: tokio::sync::Notify::new(),
                unreleased: Mutex::default(),
                cache: cache::Cache::new(
                    config.cluster.directory_cache_entries,
                    config.cluster.directory_cache_ttl,
                ),
                clock,
            }),
        }
    }

    /// This node's id.
    pub fn node_id(&self) -> &str {
        &self.inner.node
    }

    /// This run of the node (`<node id>#<nonce>`).
    pub fn instance(&self) -> &str {
        &self.inner.instance
    }

    /// The counters.
    pub fn counters(&self) -> &Counters {
        &self.inner.counters
    }

    /// This node's copy of directory rows (its hit and miss counters).
    pub fn cache(&self) -> &cache::Cache {
        &self.inner.cache
    }

    /// Waits until this node reaches Redis again after having lost it (not its first
    /// connection). Meanwhile the other nodes may have declared its sessions dead and told
    /// their contacts; the caller shows them again.
    pub async fn rejoined(&self) {
        self.inner.rejoined.notified().await
    }

    /// The other live instances, as of the last heartbeat.
    pub fn peers(&self) -> Vec<String> {
        let p = self.inner.peers.read().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<String> = p.iter().cloned().collect();
        v.sort();
        v
    }

    /// Whether another node is live: if not, nothing needs to be looked up or sent.
    pub fn has_peers(&self) -> bool {
        !self
            .inner
            .peers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    /// Whether an instance of `node` is live, as of the last heartbeat (this node is).
    pub fn node_is_live(&self, node: &str) -> bool {
        node == self.inner.node
            || self
                .inner
                .peers
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .any(|i| directory::node_of(i) == node)
    }

    fn is_live(&self, instance: &str) -> bool {
        *instance == *self.inner.instance
            || self
                .inner
                .peers
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .contains(instance)
    }

    fn queue(&self, op: Op) {
        if self.inner.client.is_none() {
            return;
        }
        if self.inner.ops.try_send(op).is_err() {
            self.inner.counters.errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Waits until the queue of this node's directory writes and messages has room for
    /// `ops` more. What is queued beyond its capacity is dropped (and counted as an error),
    /// which a session's own change can afford and a producer of thousands at once, the
    /// sweeper announcing a dead node's sessions, cannot: it paces itself by this.
    pub async fn wait_for_room(&self, ops: usize) {
        if self.inner.client.is_none() {
            return;
        }
        let ops = ops.min(self.inner.ops.max_capacity());
        // The permits are given back at once: this only waits for the room.
        let _ = self.inner.ops.reserve_many(ops).await;
    }

    /// A resource was bound here: it is this node's now, cluster-wide. A session bound to
    /// the same full JID on another node is ended there (RFC 6120 §7.7.2.2, the same
    /// override policy as a local conflict).
    pub fn claim(&self, jid: &SharedJid) {
        let entry = Entry::bound(Arc::clone(&self.inner.instance));
        self.remember(jid, &entry);
        self.queue(Op::Claim(jid.clone(), entry));
    }

    /// The resource's presence changed (availability, priority, visibility, or the stanza
    /// shown to probes, carbons, block-list pushes): `entry` as this instance's. Ignored once
    /// the session was released: the unavailable broadcast
    /// at the end of a grace period must not bring a finished session back.
    pub fn update(&self, jid: &SharedJid, entry: Entry) {
        let entry = Entry {
            instance: Arc::clone(&self.inner.instance),
            ..entry
        };
        {
            let mut local = self.inner.local.lock().unwrap_or_else(|e| e.into_inner());
            match local.get_mut(jid.as_str()) {
                Some(held) => *held = entry.clone(),
                None => return,
            }
        }
        self.queue(Op::Update(jid.clone(), entry));
    }

    /// The resource's session ended here.
    pub fn release(&self, jid: &SharedJid) {
        self.inner
            .local
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(jid.as_str());
        self.queue(Op::Release(jid.clone()));
    }

    /// The directory forgets `jid` if the node that held it is dead.
    pub fn forget_if_dead(&self, jid: &FullJid) {
        self.queue(Op::ForgetDead(jid.clone()));
    }

    fn remember(&self, jid: &SharedJid, entry: &Entry) {
        self.inner
            .local
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(jid.clone(), entry.clone());
    }

    /// Sends `xml` (unchanged, or addressed to each recipient for [`Kind::Address`]) to
    /// the sessions of `to` on other nodes: a bare JID's available sessions on every
    /// node, a full JID's one session. In order with everything else this node sends.
    pub fn forward(&self, to: Vec<String>, xml: Arc<String>, kind: Kind) {
        if !self.has_peers() || to.is_empty() {
            return;
        }
        self.queue(Op::Forward {
            to,
            xml,
            kind,
            reached: None,
            fresh: false,
        });
    }

    /// [`Self::forward`], answering with the recipients that have sessions on another
    /// node (so the caller can record whom it showed presence to). Waits at most twice
    /// the Redis timeout.
    ///
    /// `fresh`: the recipients' rows are read from Redis, not from this node's copy, for a
    /// session's initial presence. A copy can lag a write on another node by the time its
    /// invalidation takes to arrive, and in that window a contact who has just come online
    /// there would read as offline here; its own probe may have read this session before
    /// it was available, and neither would tell the other (see [`Cluster::apply`]). Later
    /// changes use the copy: an unavailable that missed such a contact is sent when the
    /// record of its showing arrives ([`Kind::Reveal`], after the invalidation); a status
    /// change in that window reaches it only with the next (ARCHITECTURE.md, "Copy of the
    /// directory").
    pub async fn forward_reaching(
        &self,
        to: Vec<String>,
        xml: Arc<String>,
        kind: Kind,
        fresh: bool,
    ) -> HashSet<String> {
        if !self.has_peers() || to.is_empty() {
            return HashSet::new();
        }
        let (tx, rx) = oneshot::channel();
        self.queue(Op::Forward {
            to,
            xml,
            kind,
            reached: Some(tx),
            fresh,
        });
        tokio::time::timeout(self.inner.timeout * 2, rx)
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default()
    }

    /// Sends `xml` to full JIDs `to` held by `node` (the caller chose them from
    /// [`Self::holders`]).
    pub fn send(&self, node: &str, to: Vec<String>, xml: Arc<String>) {
        self.queue(Op::Send(
            node.to_owned(),
            Envelope {
                kind: Kind::Deliver,
                to,
                xml,
            },
        ));
    }

    /// Tells `node` that this one showed the presence of `subjects` (full JIDs bound there)
    /// to `viewer` ([`Kind::Reveal`]).
    pub fn reveal(&self, node: &str, subjects: Vec<String>, viewer: &str) {
        self.queue(Op::Send(
            node.to_owned(),
            Envelope {
                kind: Kind::Reveal,
                to: subjects,
                xml: Arc::new(viewer.to_owned()),
            },
        ));
    }

    /// Tells every other live node that a session of `bare` ended here at `at_ms`
    /// ([`Kind::Seen`]).
    pub fn seen(&self, bare: &str, at_ms: i64) {
        let mut nodes: Vec<String> = self
            .peers()
            .iter()
            .map(|p| directory::node_of(p).to_owned())
            .collect();
        nodes.dedup();
        for node in nodes {
            self.queue(Op::Send(
                node,
                Envelope {
                    kind: Kind::Seen,
                    to: vec![bare.to_owned()],
                    xml: Arc::new(at_ms.to_string()),
                },
            ));
        }
    }

    /// Asks `node`, which holds a session of `bare`, to hand `bare`'s kept messages to a
    /// session there that takes messages ([`Kind::Collect`]).
    pub fn collect_there(&self, node: &str, bare: &str) {
        self.queue(Op::Send(
            node.to_owned(),
            Envelope {
                kind: Kind::Collect,
                to: vec![bare.to_owned()],
                xml: Arc::new(String::new()),
            },
        ));
    }

    /// Hands a message or iq for full JID `to`, bound on `node`, to that node for the
    /// delivery decision ([`Kind::Decide`]).
    pub fn decide_there(&self, node: &str, to: String, xml: Arc<String>) {
        self.queue(Op::Send(
            node.to_owned(),
            Envelope {
                kind: Kind::Decide,
                to: vec![to],
                xml,
            },
        ));
    }

    /// The sessions of each user in `bares` held by other live instances. Empty at once
    /// with no other node; a Redis failure reads as "none elsewhere".
    pub async fn holders(&self, bares: &[&str]) -> HashMap<String, Vec<Holder>> {
        self.holders_read(bares, Copy::Use).await
    }

    /// [`Self::holders`] read from Redis, not from this node's copy: for a login's probes,
    /// which must see every contact's directory write that landed before them. A copy of a
    /// row whose invalidation is still on its way would show a contact who has just come
    /// online on another node as not yet available, and that node's forward of its
    /// presence may have read this session before it was available (see
    /// [`Cluster::apply`]): neither side would tell the other.
    pub async fn holders_fresh(&self, bares: &[&str]) -> HashMap<String, Vec<Holder>> {
        self.holders_read(bares, Copy::Bypass).await
    }

    async fn holders_read(&self, bares: &[&str], copy: Copy<'_>) -> HashMap<String, Vec<Holder>> {
        if !self.has_peers() || bares.is_empty() {
            return HashMap::new();
        }
        let Some(mut conn) = self.conn().await else {
            return HashMap::new();
        };
        match self.read_entries(&mut conn, bares, copy).await {
            Ok(m) => m,
            Err(e) => {
                self.failed(&e).await;
                HashMap::new()
            }
        }
    }

    /// The other live node holding exactly `jid`, if any.
    pub async fn holder_of(&self, jid: &FullJid) -> Option<Holder> {
        let bare = jid.to_bare();
        self.holders(&[bare.as_str()])
            .await
            .remove(bare.as_str())?
            .into_iter()
            .find(|h| h.jid == jid.as_str())
    }

    /// The read of what the directory last held for `jid`, whichever instance wrote it and
    /// whether it is live (for a resource whose node died: whether it had been available
    /// and visible): the key and the command, for a caller that sends it in one pipeline
    /// with the user's other keys (the bare JID is their common hash tag, so on a Redis
    /// Cluster they share a slot). [`Self::last_entry_of`] reads its reply.
    pub fn last_entry_read(&self, jid: &FullJid) -> (String, redis::Cmd) {
        let key = self.inner.keys.user(jid.to_bare().as_str());
        let mut cmd = redis::cmd("HGET");
        cmd.arg(&key).arg(jid.resource().as_str());
        (key, cmd)
    }

    /// The entry in a reply to [`Self::last_entry_read`]; `None` when there is none.
    pub fn last_entry_of(reply: &redis::Value) -> Option<Entry> {
        let raw: Option<String> = redis::from_redis_value(reply).ok()?;
        Entry::decode(&raw?)
    }

    async fn read_entries(
        &self,
        conn: &mut Conn,
        bares: &[&str],
        copy: Copy<'_>,
    ) -> redis::RedisResult<HashMap<String, Vec<Holder>>> {
        // This node's copy first; one pipeline of HGETALL (split per slot) for the rest.
        let mut rows: Vec<Option<cache::Rows>> = Vec::with_capacity(bares.len());
        let mut misses: Vec<(usize, cache::Generation)> = Vec::new();
        for (i, b) in bares.iter().enumerate() {
            let fresh = match copy {
                Copy::Use => false,
                Copy::Bypass => true,
                Copy::BypassFor(fresh) => fresh.contains(*b),
            };
            let cached = if fresh {
                Err(self.inner.cache.generation(b))
            } else {
                self.inner.cache.get(b)
            };
            match cached {
                Ok(r) => rows.push(Some(r)),
                Err(g) => {
                    rows.push(None);
                    misses.push((i, g));
                }
            }
        }
        if !misses.is_empty() {
            let mut pipe = SlotPipe::new();
            for (i, _) in &misses {
                let key = self.inner.keys.user(bares[*i]);
                let mut c = redis::cmd("HGETALL");
                c.arg(&key);
                pipe.add(&key, c);
            }
            self.inner
                .counters
                .lookups
                .fetch_add(misses.len() as u64, Ordering::Relaxed);
            let read = pipe.query(conn).await?;
            for ((i, g), value) in misses.into_iter().zip(read) {
                let row: HashMap<String, String> = redis::from_redis_value(&value)?;
                let row: cache::Rows = Arc::new(row.into_iter().collect());
                self.inner.cache.put(bares[i], g, Arc::clone(&row));
                rows[i] = Some(row);
            }
        }
        let mut out = HashMap::new();
        for (bare, row) in bares.iter().zip(rows) {
            let mut holders: Vec<Holder> =
                row.iter()
                    .flat_map(|r| r.iter())
                    .filter_map(|(res, v)| {
                        let entry = Entry::decode(v)?;
                        (entry.instance != self.inner.instance && self.is_live(&entry.instance))
                            .then(|| Holder {
                                jid: format!("{bare}/{res}"),
                                entry,
                            })
                    })
                    .collect();
            if !holders.is_empty() {
                holders.sort_by(|a, b| a.jid.cmp(&b.jid));
                out.insert(bare.to_string(), holders);
            }
        }
        Ok(out)
    }

    async fn conn(&self) -> Option<Conn> {
        let client = self.inner.client.as_ref()?;
        let mut slot = self.inner.conn.lock().await;
        if let Some(c) = &*slot {
            return Some(c.clone());
        }
        match client.connect(self.inner.timeout).await {
            Ok(c) => {
                *slot = Some(c.clone());
                Some(c)
            }
            Err(_) => None,
        }
    }

    async fn failed(&self, e: &redis::RedisError) {
        self.inner.counters.errors.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(error = %e, "cluster: Redis command failed");
        *self.inner.conn.lock().await = None;
        self.alone();
    }

    /// Without Redis no other node can be reached: until the next heartbeat succeeds,
    /// nothing waits for a directory read or a publish.
    fn alone(&self) {
        self.inner
            .peers
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        // Invalidations may be lost from here on: nothing copied is trusted any more.
        self.inner.cache.clear();
    }

    /// The expiry of the live-instance set: a cluster whose every node is gone leaves it
    /// behind for 3T at most.
    fn nodes_expire_at(&self, now_ms: i64) -> i64 {
        now_ms + 3 * self.inner.ttl.as_millis() as i64
    }

    /// The expiry of a user's directory hash written or extended now.
    fn user_expire_at(now_ms: i64) -> i64 {
        now_ms + directory::HORIZON.as_millis() as i64
    }

    /// Starts the task that applies changes and forwards, and the heartbeat that keeps
    /// this instance live and its entries from expiring.
    pub fn start(&self, tracker: &tokio_util::task::TaskTracker, shutdown: CancellationToken) {
        let rx = self
            .inner
            .ops_rx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(rx) = rx {
            tracker.spawn(self.clone().run(rx, shutdown.clone()));
        }
        tracker.spawn(self.clone().heartbeat_loop(shutdown));
    }

    /// One heartbeat: records this instance as live, reads the others, and (with `extend`,
    /// every half [`directory::HORIZON`]) moves the expiry of this node's users' directory
    /// keys forward. Returns whether Redis answered. Public so a starting node (and tests)
    /// can know its peers at once.
    pub async fn heartbeat(&self, extend: bool) -> bool {
        let Some(mut conn) = self.conn().await else {
            self.alone();
            return false;
        };
        let now = self.inner.clock.now_ms();
        let ttl = self.inner.ttl.as_millis() as i64;
        let dead_after = self.inner.node_timeout.as_millis() as i64;
        let live: redis::RedisResult<Vec<String>> = redis::cmd("EVAL")
            .arg(directory::HEARTBEAT)
            .arg(1)
            .arg(self.inner.keys.nodes())
            .arg(&*self.inner.instance)
            .arg(now)
            .arg(now - dead_after)
            .arg(now - 3 * ttl)
            .arg(self.nodes_expire_at(now))
            .query_async(&mut conn)
            .await;
        let live = match live {
            Ok(l) => l,
            Err(e) => {
                self.failed(&e).await;
                return false;
            }
        };
        let peers: HashSet<String> = live
            .into_iter()
            .filter(|i| **i != *self.inner.instance)
            .collect();
        *self.inner.peers.write().unwrap_or_else(|e| e.into_inner()) = peers;
        if extend {
            let users: HashSet<String> = {
                let local = self.inner.local.lock().unwrap_or_else(|e| e.into_inner());
                local.keys().map(|j| j.to_bare().to_string()).collect()
            };
            if !users.is_empty() {
                let mut pipe = SlotPipe::new();
                for u in &users {
                    let key = self.inner.keys.user(u);
                    let mut c = redis::cmd("PEXPIREAT");
                    c.arg(&key).arg(Self::user_expire_at(now)).arg("GT");
                    pipe.add(&key, c);
                }
                if let Err(e) = pipe.query(&mut conn).await {
                    self.failed(&e).await;
                    return false;
                }
            }
        }
        true
    }

    async fn heartbeat_loop(self, shutdown: CancellationToken) {
        let period = heartbeat_period(self.inner.ttl);
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Every write sets a hash's expiry a horizon ahead: the users written since start
        // need nothing before half of it has passed.
        let mut extended = tokio::time::Instant::now();
        let mut was_up = false;
        let mut ever_up = false;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.cancelled() => break,
            }
            let extend = extended.elapsed() >= directory::HORIZON / 2;
            let up = self.heartbeat(extend).await;
            if up && extend {
                extended = tokio::time::Instant::now();
            }
            if up && !was_up {
                // Redis is (back) up: rewrite what this node holds, and tell the others it
                // is here so they look it up at once.
                self.rewrite_local();
                for peer in self.peers() {
                    self.queue(Op::Send(
                        directory::node_of(&peer).to_owned(),
                        Envelope {
                            kind: Kind::Join,
                            to: Vec::new(),
                            xml: Arc::default(),
                        },
                    ));
                }
                if ever_up {
                    tracing::info!("cluster: Redis is back; showing this node's sessions again");
                    self.inner.rejoined.notify_waiters();
                }
                ever_up = true;
            }
            was_up = up;
        }
        // A clean stop: this instance is gone at once for every other node.
        if let Some(mut conn) = self.conn().await {
            let _: redis::RedisResult<i64> = redis::cmd("ZREM")
                .arg(self.inner.keys.nodes())
                .arg(&*self.inner.instance)
                .query_async(&mut conn)
                .await;
        }
    }

    /// Writes this node's entries again, and the releases that were lost meanwhile.
    fn rewrite_local(&self) {
        let (all, gone): (Vec<(SharedJid, Entry)>, Vec<SharedJid>) = {
            let local = self.inner.local.lock().unwrap_or_else(|e| e.into_inner());
            let mut unreleased = self
                .inner
                .unreleased
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let gone = std::mem::take(&mut *unreleased)
                .into_iter()
                .filter(|j| !local.contains_key(j.as_str()))
                .collect();
            let all = local.iter().map(|(j, e)| (j.clone(), e.clone())).collect();
            (all, gone)
        };
        for (jid, entry) in all {
            self.queue(Op::Update(jid, entry));
        }
        for jid in gone {
            self.queue(Op::Release(jid));
        }
    }

    /// Keeps the releases of a batch that could not be written, for [`Self::rewrite_local`].
    fn keep_unreleased(&self, ops: &[Op]) {
        let mut unreleased = self
            .inner
            .unreleased
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for op in ops {
            if let Op::Release(j) = op {
                unreleased.push(j.clone());
            }
        }
    }

    async fn run(self, mut rx: mpsc::Receiver<Op>, shutdown: CancellationToken) {
        let mut batch = Vec::with_capacity(256);
        loop {
            tokio::select! {
                n = rx.recv_many(&mut batch, 256) => if n == 0 { return },
                _ = shutdown.cancelled() => return,
            }
            let Some(mut conn) = self.conn().await else {
                self.inner
                    .counters
                    .errors
                    .fetch_add(batch.len() as u64, Ordering::Relaxed);
                self.keep_unreleased(&batch);
                batch.clear();
                continue;
            };
            // Claims and updates lost to a failure are rewritten from the local map when
            // Redis is back; releases are kept for then.
            self.keep_unreleased(&batch);
            let releases = batch.iter().filter(|o| matches!(o, Op::Release(_))).count();
            match self.apply(&mut conn, std::mem::take(&mut batch)).await {
                Ok(()) => {
                    let mut unreleased = self
                        .inner
                        .unreleased
                        .lock()
                        .unwrap_or_else(|e| e.into_inner());
                    let keep = unreleased.len().saturating_sub(releases);
                    unreleased.truncate(keep);
                }
                Err(e) => self.failed(&e).await,
            }
        }
    }

    /// Applies one batch: the writes in the order they were queued (one pipeline, one per
    /// slot on a Redis Cluster; per slot, the order within a user's keys is kept), then
    /// the directory reads every forward in it needs (from this node's copy, or a second
    /// pipeline), then the kicks that the claims call for, the invalidations of the rows
    /// written, and the stanzas in the order they were queued (a batch without writes
    /// reads first and publishes its stanzas with the one pipeline).
    ///
    /// Why a forward reads only after the batch's writes: a session's own directory write
    /// (its claim at bind, its availability at initial presence) is queued before the
    /// broadcast that forwards its presence, and must be in Redis before that forward
    /// reads the contacts' entries. A contact logging in on another node at the same
    /// moment does the same, so of the two reads (an initial presence's from Redis, not
    /// from this node's copy, which may lag the other node's write: `forward_reaching`)
    /// at least one sees the other's write:
    /// either the presence is forwarded to a node where the contact is already
    /// available (its write came after its local record), or the contact's probe, which
    /// reads after its own write landed, finds this session available. Reading before the
    /// writes, both could miss each other, and two users logging in on two nodes at once
    /// would never see each other online (BENCHMARKS-ARCHIVE.md, "Cluster", has the login storm
    /// in which some did not).
    async fn apply(&self, conn: &mut Conn, ops: Vec<Op>) -> redis::RedisResult<()> {
        let Some(target) = self.inner.client.as_ref() else {
            return Ok(());
        };
        let reads = Reads::of(&ops);
        let must_read = !reads.bares.is_empty() && self.has_peers();
        let mut holders = if must_read && !reads.writes {
            self.read_forwarded(conn, &reads).await?
        } else {
            HashMap::new()
        };
        let mut writes = self.queue_writes(ops);
        // With writes in the batch, they land first and the forwards read after them (see
        // above); without, the entries were read before and the stanzas go in this one
        // pipeline (no round trip added).
        let results: Vec<redis::Value> = if reads.writes {
            let results = writes.pipe.query(conn).await?;
            writes.pipe = SlotPipe::new();
            if must_read {
                holders = self.read_forwarded(conn, &reads).await?;
            }
            results
        } else {
            Vec::new()
        };
        let (mut stanzas, replies, published) =
            self.queue_stanzas(target, writes.outgoing, &holders);
        // A stanza must not reach another node before the invalidation of rows this batch
        // wrote: a presence announcing a new priority, say, would let its recipient reply
        // to the bare JID while its node still routes by the old copy (RFC 6121 §8.5.2.1.1).
        // With writes in the batch the stanzas follow the invalidations (same channel, so
        // in order); without, they go in the one pipeline.
        if !reads.writes {
            for (channel, c) in stanzas.drain(..) {
                writes.pipe.add(&channel, c);
            }
            let _: Vec<redis::Value> = writes.pipe.query(conn).await?;
        }
        self.inner
            .counters
            .published
            .fetch_add(published, Ordering::Relaxed);
        for (tx, got) in replies {
            let _ = tx.send(got);
        }
        let mut after = SlotPipe::new();
        self.queue_claim_outcomes(target, &mut after, writes.claims, &results);
        self.queue_invalidations(target, &mut after, &writes.written);
        for (channel, c) in stanzas {
            after.add(&channel, c);
        }
        after.query(conn).await?;
        Ok(())
    }

    /// The directory entries of a batch's forwarded recipients.
    async fn read_forwarded(
        &self,
        conn: &mut Conn,
        reads: &Reads,
    ) -> redis::RedisResult<HashMap<String, Vec<Holder>>> {
        let refs: Vec<&str> = reads.bares.iter().map(String::as_str).collect();
        self.read_entries(conn, &refs, Copy::BypassFor(&reads.fresh))
            .await
    }

    /// The batch's writes in one pipeline, in the order queued; its stanzas are kept for
    /// once the entries they need have been read.
    fn queue_writes(&self, ops: Vec<Op>) -> Writes {
        let now = self.inner.clock.now_ms();
        let expire = Self::user_expire_at(now);
        let live: Vec<String> = std::iter::once(self.inner.instance.to_string())
            .chain(self.peers())
            .collect();
        let mut w = Writes {
            pipe: SlotPipe::new(),
            claims: Vec::new(),
            written: Vec::new(),
            outgoing: Vec::new(),
        };
        let mut idx = 0usize;
        for op in ops {
            if let Op::Claim(jid, _) | Op::Update(jid, _) | Op::Release(jid) = &op {
                w.written.push(jid.to_bare().to_string());
            }
            // What the answer is read for: a claim's outcome, or whether a dead entry goes.
            let (key, c, read) = match op {
                Op::Claim(jid, entry) => {
                    let key = self.inner.keys.user(jid.to_bare().as_str());
                    let mut c = redis::cmd("EVAL");
                    c.arg(directory::CLAIM)
                        .arg(1)
                        .arg(&key)
                        .arg(jid.resource().as_str())
                        .arg(entry.encode())
                        .arg(expire)
                        .arg(&live);
                    (key, c, Some((FullJid::clone(&jid), false)))
                }
                Op::Update(jid, entry) => {
                    let key = self.inner.keys.user(jid.to_bare().as_str());
                    let mut c = redis::cmd("EVAL");
                    c.arg(directory::UPDATE)
                        .arg(1)
                        .arg(&key)
                        .arg(jid.resource().as_str())
                        .arg(entry.encode())
                        .arg(expire)
                        .arg(&*self.inner.instance);
                    (key, c, None)
                }
                Op::Release(jid) => {
                    let key = self.inner.keys.user(jid.to_bare().as_str());
                    let mut c = redis::cmd("EVAL");
                    c.arg(directory::RELEASE)
                        .arg(1)
                        .arg(&key)
                        .arg(jid.resource().as_str())
                        .arg(&*self.inner.instance);
                    (key, c, None)
                }
                Op::ForgetDead(jid) => {
                    // Read now, decided below: only an entry of a dead instance goes.
                    let key = self.inner.keys.user(jid.to_bare().as_str());
                    let mut c = redis::cmd("HGET");
                    c.arg(&key).arg(jid.resource().as_str());
                    (key, c, Some((jid, true)))
                }
                // Routed once the entries they need have been read.
                op @ (Op::Forward { .. } | Op::Send(..)) => {
                    w.outgoing.push(op);
                    continue;
                }
            };
            w.pipe.add(&key, c);
            if let Some((jid, forget)) = read {
                w.claims.push((idx, jid, forget));
            }
            idx += 1;
        }
        w.written.sort();
        w.written.dedup();
        w
    }

    /// The publications of a batch's stanzas, in the order queued, the answers its
    /// forwards are owed (the recipients that had somewhere to go), and their count.
    #[allow(clippy::type_complexity)]
    fn queue_stanzas(
        &self,
        target: &Target,
        outgoing: Vec<Op>,
        holders: &HashMap<String, Vec<Holder>>,
    ) -> (
        Vec<(String, redis::Cmd)>,
        Vec<(oneshot::Sender<HashSet<String>>, HashSet<String>)>,
        u64,
    ) {
        let mut stanzas = Vec::new();
        let mut replies = Vec::new();
        let mut published = 0u64;
        for out in outgoing {
            match out {
                Op::Forward {
                    to,
                    xml,
                    kind,
                    reached,
                    ..
                } => {
                    let (per_node, got) = route(&to, holders);
                    for (node, recipients) in per_node {
                        for chunk in recipients.chunks(self.inner.max_recipients) {
                            let env = Envelope {
                                kind,
                                to: chunk.to_vec(),
                                xml: xml.clone(),
                            };
                            let channel = self.inner.keys.channel(&node);
                            stanzas
                                .push((channel.clone(), target.publish(&channel, &env.encode())));
                            published += 1;
                        }
                    }
                    if let Some(tx) = reached {
                        replies.push((tx, got));
                    }
                }
                Op::Send(node, env) => {
                    let channel = self.inner.keys.channel(&node);
                    stanzas.push((channel.clone(), target.publish(&channel, &env.encode())));
                    published += 1;
                }
                // Only stanzas were kept; the writes went into the first pipeline.
                Op::Claim(..) | Op::Update(..) | Op::Release(_) | Op::ForgetDead(_) => {}
            }
        }
        (stanzas, replies, published)
    }

    /// Kicks of sessions a claim took over on other nodes, and directory entries of dead
    /// instances to forget, from the first pipeline's `results`.
    fn queue_claim_outcomes(
        &self,
        target: &Target,
        after: &mut SlotPipe,
        claims: Vec<(usize, FullJid, bool)>,
        results: &[redis::Value],
    ) {
        for (i, jid, forget) in claims {
            let Some(redis::Value::BulkString(old)) = results.get(i) else {
                continue;
            };
            let Some(old) = std::str::from_utf8(old).ok().and_then(Entry::decode) else {
                continue;
            };
            if old.instance == self.inner.instance {
                continue;
            }
            let live = self.is_live(&old.instance);
            // A previous run of this node (restarted under the same id) holds nothing any
            // more: its entry was simply overwritten, and a kick would reach this run.
            let previous_run = old.node() == self.inner.node;
            if !forget && live && !previous_run {
                // The resource was bound on a live node: end that session there.
                let env = Envelope {
                    kind: Kind::Kick,
                    to: vec![jid.to_string()],
                    xml: Arc::default(),
                };
                let channel = self.inner.keys.channel(old.node());
                after.add(&channel, target.publish(&channel, &env.encode()));
                self.inner
                    .counters
                    .published
                    .fetch_add(1, Ordering::Relaxed);
            } else if forget && !live {
                let key = self.inner.keys.user(jid.to_bare().as_str());
                let mut c = redis::cmd("EVAL");
                c.arg(directory::RELEASE)
                    .arg(1)
                    .arg(&key)
                    .arg(jid.resource().as_str())
                    .arg(&*old.instance);
                after.add(&key, c);
            }
        }
    }

    /// After the writes have landed (on a Redis Cluster the first pipeline's slots run in
    /// parallel, so only its reply orders them): every other live node is told which
    /// users' rows changed, one message per node for the whole batch.
    fn queue_invalidations(&self, target: &Target, after: &mut SlotPipe, written: &[String]) {
        if written.is_empty() {
            return;
        }
        let mut nodes: Vec<String> = self
            .peers()
            .iter()
            .map(|p| directory::node_of(p).to_owned())
            .collect();
        nodes.sort();
        nodes.dedup();
        for node in nodes {
            let env = Envelope {
                kind: Kind::Invalidate,
                to: written.to_vec(),
                xml: Arc::default(),
            };
            let channel = self.inner.keys.channel(&node);
            after.add(&channel, target.publish(&channel, &env.encode()));
            self.inner
                .counters
                .published
                .fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// What a batch reads from the directory: the users its forwards go to (sorted, once
/// each), those of them that must not be read from this node's copy, and whether the
/// batch writes (then it reads only after its writes landed).
struct Reads {
    bares: Vec<String>,
    fresh: HashSet<String>,
    writes: bool,
}

impl Reads {
    fn of(ops: &[Op]) -> Self {
        let mut bares: Vec<String> = Vec::new();
        // The recipients of forwards that must not read this node's copy.
        let mut fresh: HashSet<String> = HashSet::new();
        let mut writes = false;
        for op in ops {
            match op {
                Op::Forward { to, fresh: f, .. } => {
                    for t in to {
                        let bare = bare_of(t).to_owned();
                        if *f {
                            fresh.insert(bare.clone());
                        }
                        bares.push(bare);
                    }
                }
                Op::Claim(..) | Op::Update(..) | Op::Release(_) | Op::ForgetDead(_) => {
                    writes = true
                }
                Op::Send(..) => {}
            }
        }
        bares.sort();
        bares.dedup();
        Reads {
            bares,
            fresh,
            writes,
        }
    }
}

/// A batch's writes, queued in their pipeline.
struct Writes {
    pipe: SlotPipe,
    /// Results to act on after the pipeline: (index, JID, whether it is a ForgetDead).
    claims: Vec<(usize, FullJid, bool)>,
    /// Users whose rows this batch writes: the other nodes drop their copies.
    written: Vec<String>,
    /// The stanzas, in the order queued.
    outgoing: Vec<Op>,
}

/// Whether a directory read may be answered from this node's copy of the rows.
#[derive(Clone, Copy)]
enum Copy<'a> {
    Use,
    Bypass,
    /// From Redis for these users, from the copy for the others.
    BypassFor(&'a HashSet<String>),
}

/// The bare part of a JID string.
fn bare_of(jid: &str) -> &str {
    jid.split_once('/').map_or(jid, |(b, _)| b)
}

/// Groups recipients by the node that holds them: a bare JID goes to every node with a
/// session of the user, a full JID to the node holding it. Returns the groups and the
/// recipients that had somewhere to go.
fn route(
    to: &[String],
    holders: &HashMap<String, Vec<Holder>>,
) -> (Vec<(String, Vec<String>)>, HashSet<String>) {
    let mut per_node: HashMap<String, Vec<String>> = HashMap::new();
    let mut got = HashSet::new();
    for t in to {
        let bare = bare_of(t);
        let Some(hs) = holders.get(bare) else {
            continue;
        };
        let full = bare.len() != t.len();
        let mut nodes: Vec<&str> = hs
            .iter()
            .filter(|h| !full || h.jid == *t)
            .map(Holder::node)
            .collect();
        nodes.sort_unstable();
        nodes.dedup();
        for n in nodes {
            per_node.entry(n.to_owned()).or_default().push(t.clone());
            got.insert(t.clone());
        }
    }
    let mut v: Vec<(String, Vec<String>)> = per_node.into_iter().collect();
    v.sort();
    (v, got)
}

/// Receives this node's channel until shutdown and hands each envelope to `deliver`
/// (a `join` is handled here: the live nodes are read again). Reconnects with back-off.
pub async fn listen(
    cluster: Cluster,
    shutdown: CancellationToken,
    reconnect_max: Duration,
    deliver: impl Fn(Envelope),
) {
    let Some(target) = cluster.inner.client.clone() else {
        return;
    };
    let channel = cluster.inner.keys.channel(&cluster.inner.node);
    let timeout = cluster.inner.timeout;
    let deliver = &deliver;
    let cluster = &cluster;
    crate::cluster::pubsub::subscribe(
        target,
        channel,
        timeout,
        reconnect_max,
        shutdown,
        |text| async move {
            let Some(env) = Envelope::decode(&text) else {
                tracing::warn!(bytes = text.len(), "cluster: malformed message dropped");
                return;
            };
            cluster
                .inner
                .counters
                .received
                .fetch_add(1, Ordering::Relaxed);
            if env.kind == Kind::Join {
                cluster.heartbeat(false).await;
                return;
            }
            if env.kind == Kind::Invalidate {
                for bare in &env.to {
                    cluster.inner.cache.invalidate(bare);
                }
                return;
            }
            deliver(env);
        },
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_is_dead_before_its_first_resource_beats_can_go_stale() {
        let s = Duration::from_secs;
        // The defaults: beats go stale from T - refresh = 67 s after a kill.
        assert_eq!(node_timeout(s(100), s(33)), s(67));
        // bench/cluster.sh's timings.
        assert_eq!(node_timeout(s(45), s(15)), s(30));
        // Never fewer than three heartbeats missed, never more than T.
        assert_eq!(
            node_timeout(Duration::from_secs(2), Duration::from_millis(600)),
            Duration::from_millis(1500)
        );
        assert_eq!(node_timeout(s(100), s(99)), s(15));
        assert!(node_timeout(s(1), s(0)) <= s(1));
    }

    fn holder(jid: &str, instance: &str) -> Holder {
        let mut entry = Entry::bound(instance);
        entry.available = true;
        Holder {
            jid: jid.into(),
            entry,
        }
    }

    #[test]
    fn recipients_are_grouped_into_one_message_per_node_holding_them() {
        let mut holders = HashMap::new();
        holders.insert(
            "a@x".to_owned(),
            vec![holder("a@x/1", "n2#p"), holder("a@x/2", "n3#q")],
        );
        holders.insert("b@x".to_owned(), vec![holder("b@x/1", "n2#p")]);
        let to: Vec<String> = ["a@x", "b@x", "b@x/other", "b@x/1", "c@x"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let (per_node, reached) = route(&to, &holders);
        assert_eq!(
            per_node,
            vec![
                (
                    "n2".to_owned(),
                    vec!["a@x".to_owned(), "b@x".to_owned(), "b@x/1".to_owned()]
                ),
                ("n3".to_owned(), vec!["a@x".to_owned()]),
            ]
        );
        // A full JID bound nowhere and a user with no session elsewhere reach nothing.
        let mut reached: Vec<String> = reached.into_iter().collect();
        reached.sort();
        assert_eq!(reached, ["a@x", "b@x", "b@x/1"]);
    }
}
