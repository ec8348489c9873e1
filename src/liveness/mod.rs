//! Liveness: how silence becomes "unavailable".
//!
//! ```text
//! socket traffic ─▶ Beat (in memory, per connection; any inbound byte counts)
//!   session tick every redis_refresh ─▶ Op::Refresh (only if a newer beat exists)
//!     writer task ─▶ Redis: SET presence:{bare}:res:<r> PXAT beat+T, ZADD beats ZSET
//!   sweeper (any node, every sweep_interval) ─▶ Lua: ZRANGEBYSCORE beats < now−T,
//!       ZREM of other nodes' members (this node's stay until its decision is written)
//!     session of this node ─▶ ended as a silent death (last seen = last beat), unavailable now
//!     session of another node ─▶ (S)PUBLISH node:<id>; that node ends it the same way
//!       (followed by the sweeper until that node has acted on it)
//!     nobody listens (crashed node) ─▶ unavailable to local contacts from here
//! clean close / dropped socket ─▶ grace G ─▶ unavailable unless the resource came back
//! every session end ─▶ last-seen batcher ─▶ one PostgreSQL statement per flush
//! ```
//!
//! Decisions worth knowing:
//! - Beats are downsampled in memory: Redis sees at most one write per resource per
//!   `redis_refresh`, and the write carries the time of the newest beat, so the key expires
//!   exactly T after the last beat even though it was written later (`PXAT`).
//! - A resource key is written with its expiry in one command (`SET ... PXAT`), so it can
//!   never be left with TTL −1; the shared beat ZSETs get theirs from each writing node at
//!   most once per T ([`redis_link::ShardExpiry`]): two write commands per refresh.
//! - Keyspace expiry notifications are not used: they fire when Redis gets round to deleting
//!   a key, which can be minutes late. The sweeper reads the beat ZSET instead.
//! - Redis is optional at run time: every Redis call goes through [`redis_link::RedisLink`]
//!   with a timeout, failures mark it down and reconnect with backoff, and after a reconnect
//!   the writer rewrites every local resource ("repair"). Sessions never wait for Redis.
//! - Without a `[redis] url` the same state lives in this process ([`Backend::InProcess`],
//!   [`in_process`]): sessions, refresh, grace, sweeps and last seen run the same code on
//!   the same timings, and only the writer and the sweep's source differ, so a single node
//!   without Redis announces a silent death within the same bounds.
//! - Wall-clock times (beats, expiry scores, last seen) come from one [`crate::clock::Clock`] and
//!   timers from `tokio::time`, so the decisions below can be tested on paused time.

pub mod in_process;
pub mod keys;
pub mod last_seen;
pub mod metrics;
pub mod redis_link;
pub(crate) mod stale;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::protocol::jid::{FullJid, SharedJid};

pub use crate::clock::Clock;
pub use metrics::Metrics;

/// The `[liveness]` timings as durations.
#[derive(Debug, Clone, Copy)]
pub struct Timings {
    /// H: inbound silence after which the server pings.
    pub heartbeat: Duration,
    /// T: beat age at which a resource is dead.
    pub ttl: Duration,
    /// G: wait after a close before announcing unavailable.
    pub grace: Duration,
    /// Sweeper period.
    pub sweep: Duration,
    /// Minimum time between two Redis writes for one resource.
    pub refresh: Duration,
    /// Last-seen flush period.
    pub flush: Duration,
}

impl Timings {
    /// From a validated config.
    pub fn from_config(c: &Config) -> Timings {
        let l = &c.liveness;
        Timings {
            heartbeat: l.heartbeat_interval,
            ttl: l.ttl,
            grace: l.grace,
            sweep: l.sweep_interval,
            refresh: l.redis_refresh,
            flush: l.last_seen_flush,
        }
    }

    fn ttl_ms(&self) -> i64 {
        self.ttl.as_millis() as i64
    }
}

/// The time of the last inbound traffic on one connection. Shared by the task that reads
/// the socket (every XML event), the WebSocket adapter (Pong frames) and the session loop
/// that decides when to ping and when to write to Redis.
#[derive(Debug)]
pub struct Beat {
    last: AtomicI64,
    /// Stanzas of this peer the server is handling right now ([`Beat::busy`]).
    busy: AtomicU32,
    metrics: Arc<Metrics>,
    clock: Clock,
}

impl Beat {
    /// A beat stamped now (a connection that just spoke); see [`Liveness::beat`].
    fn new(metrics: Arc<Metrics>, clock: Clock) -> Arc<Beat> {
        Arc::new(Beat {
            last: AtomicI64::new(clock.now_ms()),
            busy: AtomicU32::new(0),
            metrics,
            clock,
        })
    }

    /// Records inbound traffic: the peer is alive now.
    pub fn touch(&self) {
        self.last.fetch_max(self.clock.now_ms(), Ordering::Relaxed);
        self.metrics.heartbeats.fetch_add(1, Ordering::Relaxed);
    }

    /// When the peer last sent anything (ms since the epoch).
    pub fn last_ms(&self) -> i64 {
        self.last.load(Ordering::Relaxed)
    }

    /// Whether the peer has sent nothing for `d`: the one test behind keepalive pings (both
    /// transports), the sweeper's check with the session's node and the local death
    /// fallback. Never while the server is handling one of the peer's stanzas: the session
    /// reads nothing meanwhile, so the silence would be the server's, not the peer's.
    pub fn silent_for(&self, d: Duration) -> bool {
        !self.is_busy() && self.clock.now_ms() - self.last_ms() >= d.as_millis() as i64
    }

    /// Marks one of the peer's stanzas as being handled until the guard drops. The drop
    /// counts as a beat: time the server spent on the stanza (waiting for the database pool
    /// or a row lock on a loaded node) is not time the peer was silent, and what it sent
    /// meanwhile is read only now.
    pub fn busy(self: &Arc<Self>) -> BusyGuard {
        self.busy.fetch_add(1, Ordering::Relaxed);
        BusyGuard(Arc::clone(self))
    }

    /// Whether one of the peer's stanzas is being handled now.
    pub fn is_busy(&self) -> bool {
        self.busy.load(Ordering::Relaxed) > 0
    }
}

/// See [`Beat::busy`].
#[derive(Debug)]
pub struct BusyGuard(Arc<Beat>);

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.0
            .last
            .fetch_max(self.0.clock.now_ms(), Ordering::Relaxed);
        self.0.busy.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a connection runs over, as far as liveness is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportKind {
    /// TCP (STARTTLS or direct TLS): the session sends XEP-0199 pings.
    Tcp,
    /// RFC 7395 WebSocket: the adapter sends WebSocket Ping frames.
    WebSocket,
}

/// The transport abstraction c2s is given: how the connection is kept alive and whether it
/// is already encrypted below XMPP (wss, or a TLS-terminating proxy in front of ws).
#[derive(Debug, Clone)]
pub struct Transport {
    /// Which keepalive the transport uses.
    pub kind: TransportKind,
    /// Inbound traffic time, touched by whoever reads the socket.
    pub beat: Arc<Beat>,
    /// Encrypted below the stream: STARTTLS is then not offered (RFC 7395 §3.6).
    pub secure: bool,
}

impl Transport {
    /// A plain TCP connection (TLS, if any, is negotiated by c2s).
    pub fn tcp(live: &Liveness) -> Transport {
        Transport {
            kind: TransportKind::Tcp,
            beat: live.beat(),
            secure: false,
        }
    }
}

/// A change to a resource's Redis state, queued by sessions and applied by the writer task
/// so that no session ever waits for Redis.
#[derive(Debug, Clone)]
pub enum Op {
    /// The resource is alive; its newest beat was at `beat_ms`.
    Refresh {
        /// Full JID (the session's own copy: a refresh allocates nothing).
        jid: SharedJid,
        /// Newest beat (ms); the keys expire at `beat_ms + T`.
        beat_ms: i64,
    },
    /// The resource is gone: delete its keys and its beat.
    Remove {
        /// Full JID.
        jid: FullJid,
    },
}

/// A bound resource on this node, as the sweeper and the repair see it.
#[derive(Debug)]
struct Local {
    /// Session id (tells a session from a later one with the same full JID).
    id: u64,
    beat: Arc<Beat>,
    /// Cancelled by the sweeper to end the session as a silent death.
    end: CancellationToken,
    /// Set (to the last beat, ms) when the session was found dead.
    swept: Arc<AtomicI64>,
    /// The session closed and waits out its grace period.
    in_grace: AtomicBool,
}

/// Where the per-resource TTL entries and the beat set live. Both keep the same semantics
/// (expiry T after the newest beat, beats never moved back, a sweep takes each stale resource
/// once, in batches), so the bounds on announcing a silent death are the same.
pub enum Backend {
    /// Redis, shared by every node of a cluster (may be down; see [`redis_link`]). Boxed:
    /// the link is several times the size of the table, and there is one per node.
    Redis(Box<redis_link::RedisLink>),
    /// This process's memory: a single node without Redis (see [`in_process`]).
    InProcess(in_process::Table),
}

impl Backend {
    /// Redis when `[redis] url` or `[cluster] redis_nodes` is set, in process otherwise.
    /// The Redis link's back-off reads `clock`.
    fn from_config(config: &Config, metrics: &Arc<Metrics>, clock: Clock) -> Backend {
        if config.uses_redis() {
            Backend::Redis(Box::new(redis_link::RedisLink::new(
                config,
                metrics.clone(),
                clock,
            )))
        } else {
            metrics.in_process.store(true, Ordering::Relaxed);
            Backend::InProcess(in_process::Table::default())
        }
    }

    /// The backend's name, as the startup log states it (`backend=redis|in-process`).
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Redis(_) => "redis",
            Backend::InProcess(_) => "in-process",
        }
    }
}

/// Liveness state of one node. Lives in [`crate::node::Shared`]; its tasks are started by
/// [`crate::services::lifecycle::start`].
pub struct Liveness {
    /// The timings.
    pub timings: Timings,
    /// Wall-clock time for beats, expiry scores and last seen.
    pub clock: Clock,
    /// Counters for logs and /metrics.
    pub metrics: Arc<Metrics>,
    /// This node's identity, written as the value of resource keys.
    pub node_id: String,
    /// Key names.
    pub keys: keys::Keys,
    /// Where the resource state lives: Redis, or this process.
    pub backend: Backend,
    ops: mpsc::Sender<Op>,
    ops_rx: Mutex<Option<mpsc::Receiver<Op>>>,
    local: Mutex<HashMap<SharedJid, Local>>,
    /// Full JIDs whose session ended here recently, with the end time, so a stale beat
    /// left in Redis (a Remove lost while Redis was down) is not announced twice.
    recently_ended: Mutex<HashMap<String, i64>>,
    /// Stale resources this node's sweeper handed to another node, which heard them, not
    /// yet seen acted on (their beat back in Redis, or their directory entry gone).
    handed: Mutex<Vec<Handed>>,
    /// Last-seen entries waiting for the next flush.
    pub last_seen: last_seen::Batcher,
    sweep_batch: usize,
    sweep_concurrency: usize,
    /// Grace tasks, waited for at shutdown so their last-seen entries are flushed.
    grace_tasks: TaskTracker,
}

impl Liveness {
    /// State for a checked config on the system clock; nothing connects until
    /// [`crate::services::lifecycle::start`].
    pub fn new(config: &Config) -> Liveness {
        Liveness::with_clock(config, Clock::system())
    }

    /// State reading wall-clock time from `clock` (tests: [`Clock::tokio`]).
    pub fn with_clock(config: &Config, clock: Clock) -> Liveness {
        let (tx, rx) = mpsc::channel(65_536);
        let metrics = Arc::new(Metrics::default());
        Liveness {
            timings: Timings::from_config(config),
            clock,
            node_id: config.cluster.node().to_owned(),
            keys: keys::Keys::new(&config.redis.key_prefix, config.liveness.beat_shards),
            backend: Backend::from_config(config, &metrics, clock),
            metrics,
            ops: tx,
            ops_rx: Mutex::new(Some(rx)),
            local: Mutex::default(),
            recently_ended: Mutex::default(),
            handed: Mutex::default(),
            last_seen: last_seen::Batcher::default(),
            sweep_batch: config.liveness.sweep_batch,
            sweep_concurrency: config.liveness.sweep_concurrency,
            grace_tasks: TaskTracker::new(),
        }
    }

    /// The Redis link, when liveness runs on Redis.
    pub fn redis(&self) -> Option<&redis_link::RedisLink> {
        match &self.backend {
            Backend::Redis(link) => Some(&**link),
            Backend::InProcess(_) => None,
        }
    }

    /// A beat for a new connection, stamped now.
    pub fn beat(&self) -> Arc<Beat> {
        Beat::new(self.metrics.clone(), self.clock)
    }

    /// Until when Redis keeps what a beat at `beat_ms` wrote: the resource key and its
    /// user's set expire T after the beat; the beat ZSET outlives any member by 2T more (and
    /// is never moved before now + 3T) so the sweeper always finds stale members in it.
    pub(crate) fn expiry_ms(&self, beat_ms: i64) -> (i64, i64) {
        let ttl = self.timings.ttl_ms();
        (beat_ms + ttl, self.clock.now_ms().max(beat_ms) + 3 * ttl)
    }

    /// Beats at or before this score are older than T: the sweeper takes them.
    pub(crate) fn sweep_cutoff_ms(&self) -> i64 {
        self.clock.now_ms() - self.timings.ttl_ms()
    }

    pub(crate) fn queue(&self, op: Op) {
        if self.ops.try_send(op).is_err() {
            // The writer is behind or Redis is down for long: the repair rewrites everything
            // once it is back, a beating session's next refresh rewrites its entry (either
            // backend), and the sweep rewrites an entry it finds behind a live beat, so
            // dropping here loses nothing that matters.
            self.metrics.redis_errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Registers a freshly bound resource and writes its first beat to Redis at once, so
    /// watchers see it online without waiting for a refresh.
    pub fn bind(&self, jid: &SharedJid, id: u64, beat: Arc<Beat>) -> LiveSession {
        let end = CancellationToken::new();
        let swept = Arc::new(AtomicI64::new(0));
        let entry = Local {
            id,
            beat: beat.clone(),
            end: end.clone(),
            swept: swept.clone(),
            in_grace: AtomicBool::new(false),
        };
        let mut map = self.local.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = map.insert(jid.clone(), entry) {
            if old.in_grace.load(Ordering::Relaxed) {
                self.metrics.grace_resumed.fetch_add(1, Ordering::Relaxed);
            }
        }
        drop(map);
        let written = beat.last_ms();
        self.queue(Op::Refresh {
            jid: jid.clone(),
            beat_ms: written,
        });
        LiveSession {
            jid: jid.clone(),
            id,
            beat,
            end,
            swept,
            written_ms: written,
            last_write: tokio::time::Instant::now(),
        }
    }

    /// Every local resource with its newest beat (for the repair after Redis returns).
    pub(crate) fn local_beats(&self) -> Vec<(SharedJid, i64)> {
        let map = self.local.lock().unwrap_or_else(|e| e.into_inner());
        map.iter()
            .map(|(j, l)| (j.clone(), l.beat.last_ms()))
            .collect()
    }

    /// Whether a session of `jid` is bound here or still inside its grace period: once this
    /// is false, its end (and any unavailable it caused) has been handled.
    pub fn is_tracked(&self, jid: &FullJid) -> bool {
        let map = self.local.lock().unwrap_or_else(|e| e.into_inner());
        map.contains_key(jid.as_str())
    }

    /// The bound session still using `jid` here, if it is `id`.
    pub(crate) fn forget(&self, jid: &FullJid, id: u64) -> bool {
        let mut map = self.local.lock().unwrap_or_else(|e| e.into_inner());
        let key = jid.as_str();
        if map.get(key).is_some_and(|l| l.id == id) {
            map.remove(key);
        }
        map.contains_key(key)
    }

    pub(crate) fn mark_grace(&self, jid: &FullJid, id: u64) {
        let map = self.local.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(l) = map.get(jid.as_str()).filter(|l| l.id == id) {
            l.in_grace.store(true, Ordering::Relaxed);
        }
    }

    /// A session of `jid` is over for good at `at_ms`: drop its Redis state (unless a newer
    /// session took the resource over) and queue its last-seen time.
    pub(crate) fn finished(&self, jid: &FullJid, id: u64, at_ms: i64) {
        let taken_over = self.forget(jid, id);
        if !taken_over {
            self.queue(Op::Remove { jid: jid.clone() });
        }
        let mut ended = self
            .recently_ended
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        ended.insert(jid.to_string(), at_ms);
        if ended.len() > 4096 {
            // Only leftovers younger than 3T can still be swept; forget older ends.
            let horizon = self.clock.now_ms() - 3 * self.timings.ttl_ms();
            ended.retain(|_, at| *at >= horizon);
        }
        drop(ended);
        self.last_seen.push(crate::store::LastSeen {
            jid: jid.to_bare(),
            at: crate::clock::to_datetime(at_ms),
            status: None,
        });
    }
}

/// One bound session's liveness, owned by its task in c2s.
#[derive(Debug)]
pub struct LiveSession {
    pub(crate) jid: SharedJid,
    pub(crate) id: u64,
    /// Inbound traffic time.
    pub beat: Arc<Beat>,
    /// Cancelled when the sweeper found this session dead.
    pub end: CancellationToken,
    swept: Arc<AtomicI64>,
    /// The beat time last sent to Redis.
    written_ms: i64,
    last_write: tokio::time::Instant,
}

impl LiveSession {
    /// Called every `redis_refresh`: writes the newest beat if there is one newer than what
    /// Redis has. At most one write per call, so at most one per `redis_refresh`.
    pub fn refresh(&mut self, live: &Liveness) {
        let beat = self.beat.last_ms();
        let due = self.last_write.elapsed() >= live.timings.refresh.mul_f64(0.9);
        if beat > self.written_ms && due {
            self.written_ms = beat;
            self.last_write = tokio::time::Instant::now();
            live.queue(Op::Refresh {
                jid: self.jid.clone(),
                beat_ms: beat,
            });
        }
    }

    /// Whether the peer has been silent for `d`.
    pub fn silent_for(&self, d: Duration) -> bool {
        self.beat.silent_for(d)
    }

    /// Local fallback when no sweeper acted (Redis down): silent for T plus two sweeps.
    pub fn locally_dead(&self, live: &Liveness) -> bool {
        self.silent_for(live.timings.ttl + live.timings.sweep * 2)
    }

    /// Marks the session as a silent death at its last beat.
    pub fn mark_dead(&self) {
        let _ = self.swept.compare_exchange(
            0,
            self.beat.last_ms(),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }

    /// Marks the session dead as of `at_ms`, when its client was last heard: a session
    /// kept past its client's silence (a XEP-0357 hibernation) ends as a silent death
    /// then, not at its end.
    pub fn mark_dead_at(&self, at_ms: i64) {
        let _ = self
            .swept
            .compare_exchange(0, at_ms.max(1), Ordering::Relaxed, Ordering::Relaxed);
    }

    /// The last beat, if the session was found dead (sweeper or local fallback).
    pub fn dead_at(&self) -> Option<i64> {
        Some(self.swept.load(Ordering::Relaxed)).filter(|&v| v > 0)
    }
}

/// Hands an `Op` list to Redis (used by the writer and the repair).
pub(crate) fn ops_for_repair(live: &Liveness) -> Vec<Op> {
    live.local_beats()
        .into_iter()
        .map(|(jid, beat_ms)| Op::Refresh { jid, beat_ms })
        .collect()
}

/// Whether the sweeper may announce `jid` (last beat `score`) as a silent death, and what
/// to do: see [`sweeper`].
pub(crate) enum SweptLocal {
    /// Not bound here: a resource of a crashed or other node.
    NotLocal,
    /// Bound here and beating; its beat had not reached Redis (a failed write): rewrite it.
    Alive(i64),
    /// Bound here, silent: the session was told to end.
    Ended,
    /// Closed and in its grace period: the grace task owns it.
    InGrace,
}

/// A stale resource the sweeper handed to the node its beat names, which heard it. The
/// sweep took the beat out of Redis; until that node acts on it (writes the beat again,
/// or ends the session and with it the directory entry) the resource is followed here,
/// so a node that dies between hearing and acting does not take it along unannounced.
#[derive(Debug, Clone)]
pub(crate) struct Handed {
    /// The node it was handed to (with `jid`, its member of the beat ZSET of `jid`'s
    /// shard: [`keys::Keys::member`], [`keys::Keys::beats_for`]).
    pub node: String,
    pub jid: FullJid,
    /// Its last beat (ms): its last seen if it must be announced.
    pub score: i64,
    /// When it was handed (ms): followed for at most 3T, the life of a directory entry
    /// whose node no longer moves its expiry.
    pub at_ms: i64,
}

impl Liveness {
    pub(crate) fn swept_local(&self, jid: &str, score: i64) -> SweptLocal {
        let map = self.local.lock().unwrap_or_else(|e| e.into_inner());
        let Some(l) = map.get(jid) else {
            return SweptLocal::NotLocal;
        };
        if l.in_grace.load(Ordering::Relaxed) {
            return SweptLocal::InGrace;
        }
        let beat = l.beat.last_ms();
        if l.beat.is_busy() {
            // The server itself has not read the peer for a while: not the peer's silence.
            return SweptLocal::Alive(beat.max(self.clock.now_ms()));
        }
        if beat > score && !l.beat.silent_for(self.timings.ttl) {
            return SweptLocal::Alive(beat);
        }
        let _ = l
            .swept
            .compare_exchange(0, beat.max(score), Ordering::Relaxed, Ordering::Relaxed);
        l.end.cancel();
        SweptLocal::Ended
    }

    /// Whether a session of `jid` ended here at or after `score` (so a leftover beat must
    /// not be announced again). Prunes entries older than 3T.
    pub(crate) fn ended_here_after(&self, jid: &str, score: i64) -> bool {
        let mut map = self
            .recently_ended
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let horizon = self.clock.now_ms() - 3 * self.timings.ttl_ms();
        map.retain(|_, at| *at >= horizon);
        map.get(jid).is_some_and(|&at| at >= score)
    }

    /// Remembers hand-offs heard by their node, to follow them up at the next sweeps.
    pub(crate) fn note_handed(&self, handed: impl IntoIterator<Item = Handed>) {
        self.handed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(handed);
    }

    /// The hand-offs to follow up, leaving none: those still open go back through
    /// [`Self::note_handed`].
    pub(crate) fn take_handed(&self) -> Vec<Handed> {
        std::mem::take(&mut *self.handed.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub(crate) fn queue_op(&self, op: Op) {
        self.queue(op)
    }

    pub(crate) fn sweep_batch(&self) -> usize {
        self.sweep_batch
    }

    pub(crate) fn sweep_concurrency(&self) -> usize {
        self.sweep_concurrency
    }

    /// The writer's end of the op queue; `None` once taken (the writer runs once).
    pub(crate) fn take_ops_rx(&self) -> Option<mpsc::Receiver<Op>> {
        self.ops_rx.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Runs `task` as a grace period, waited for by [`Liveness::wait_grace`].
    pub(crate) fn spawn_grace<F>(&self, task: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.grace_tasks.spawn(task);
    }

    /// Waits (bounded) for running grace periods, at shutdown.
    pub(crate) async fn wait_grace(&self, bound: Duration) {
        self.grace_tasks.close();
        let _ = tokio::time::timeout(bound, self.grace_tasks.wait()).await;
    }
}

/// The grace, TTL, sweep and refresh decisions on paused tokio time, with the wall clock
/// following it ([`Clock::tokio`]): no Redis, no sockets, nothing waits for real time.
#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        let mut c = Config::default();
        c.liveness.heartbeat_interval = Duration::from_millis(400);
        c.liveness.ttl = Duration::from_secs(2);
        c.liveness.grace = Duration::from_millis(600);
        c.liveness.sweep_interval = Duration::from_millis(200);
        c.liveness.redis_refresh = Duration::from_millis(600);
        c.validate().expect("valid");
        c
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn jid(s: &str) -> SharedJid {
        crate::protocol::jid::parse_full(s).unwrap().into()
    }

    /// Everything queued for Redis so far.
    fn drain(rx: &mut mpsc::Receiver<Op>) -> Vec<Op> {
        let mut out = Vec::new();
        while let Ok(op) = rx.try_recv() {
            out.push(op);
        }
        out
    }

    fn setup() -> (Liveness, mpsc::Receiver<Op>) {
        let live = Liveness::with_clock(&config(), Clock::tokio());
        let rx = live.ops_rx.lock().unwrap().take().unwrap();
        (live, rx)
    }

    #[tokio::test(start_paused = true)]
    async fn a_chatty_session_is_written_to_redis_once_per_refresh_with_its_newest_beat() {
        let (live, mut rx) = setup();
        let j = jid("a@x/r");
        let beat = live.beat();
        let mut s = live.bind(&j, 1, beat.clone());
        let bound = drain(&mut rx);
        assert!(
            matches!(&bound[..], [Op::Refresh { beat_ms, .. }] if *beat_ms == live.clock.now_ms()),
            "the bind writes its first beat at once: {bound:?}"
        );
        // Traffic every 50 ms for 3 s, the refresh tick every 600 ms (as c2s runs it).
        let refresh = live.timings.refresh;
        let mut writes = Vec::new();
        let mut since_tick = Duration::ZERO;
        for _ in 0..60 {
            tokio::time::advance(ms(50)).await;
            beat.touch();
            since_tick += ms(50);
            if since_tick >= refresh {
                since_tick = Duration::ZERO;
                s.refresh(&live);
                writes.extend(drain(&mut rx));
            }
        }
        assert_eq!(writes.len(), 5, "3 s / 600 ms refresh ticks: {writes:?}");
        for (i, op) in writes.iter().enumerate() {
            let Op::Refresh { beat_ms, .. } = op else {
                panic!("{op:?}")
            };
            // Each write carries the newest beat, the one of its own tick.
            assert_eq!(
                *beat_ms,
                beat.last_ms() - 600 * (4 - i as i64),
                "{writes:?}"
            );
        }
        assert_eq!(live.metrics.heartbeats.load(Ordering::Relaxed), 60);
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_session_is_not_rewritten_and_refresh_never_writes_twice_within_the_interval() {
        let (live, mut rx) = setup();
        let beat = live.beat();
        let mut s = live.bind(&jid("a@x/r"), 1, beat.clone());
        drain(&mut rx);
        tokio::time::advance(ms(600)).await;
        s.refresh(&live);
        assert!(drain(&mut rx).is_empty(), "no newer beat, no write");
        beat.touch();
        tokio::time::advance(ms(100)).await;
        s.refresh(&live);
        assert_eq!(drain(&mut rx).len(), 1, "a newer beat is written");
        beat.touch();
        // 90% of the interval is the earliest next write (ticks may come a little early).
        tokio::time::advance(ms(530)).await;
        s.refresh(&live);
        assert!(drain(&mut rx).is_empty(), "written 530 ms ago: too soon");
        tokio::time::advance(ms(10)).await;
        s.refresh(&live);
        assert_eq!(drain(&mut rx).len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn silence_means_a_ping_after_h_and_a_local_death_only_after_t_plus_two_sweeps() {
        let (live, _rx) = setup();
        let beat = live.beat();
        let s = live.bind(&jid("a@x/r"), 1, beat.clone());
        tokio::time::advance(ms(399)).await;
        assert!(!beat.silent_for(live.timings.heartbeat));
        tokio::time::advance(ms(1)).await;
        assert!(
            beat.silent_for(live.timings.heartbeat),
            "H of silence: ping"
        );
        // T + 2 sweeps = 2.4 s after the last beat.
        tokio::time::advance(ms(1999)).await;
        assert!(!s.locally_dead(&live));
        tokio::time::advance(ms(1)).await;
        assert!(s.locally_dead(&live));
        beat.touch();
        assert!(!s.locally_dead(&live), "traffic revives it");
    }

    #[tokio::test(start_paused = true)]
    async fn redis_keys_expire_t_after_the_beat_and_the_sweeper_takes_beats_older_than_t() {
        let (live, _rx) = setup();
        let beat = live.beat();
        let b = beat.last_ms();
        let (key, zset) = live.expiry_ms(b);
        assert_eq!(key, b + 2000, "resource key: beat + T");
        assert_eq!(zset, b + 6000, "beat ZSET: now + 3T");
        // A refresh written late still expires T after the beat; the ZSET's own expiry
        // stays 3T ahead of now.
        tokio::time::advance(ms(500)).await;
        assert_eq!(live.expiry_ms(b), (b + 2000, b + 500 + 6000));
        // The sweep cutoff: a beat is stale once it is T old, not before.
        tokio::time::advance(ms(1499)).await;
        assert!(b > live.sweep_cutoff_ms(), "1999 ms old: not swept");
        tokio::time::advance(ms(1)).await;
        assert!(b <= live.sweep_cutoff_ms(), "T old: swept");
    }

    #[tokio::test(start_paused = true)]
    async fn the_sweeper_ends_a_silent_local_session_at_its_last_beat_but_spares_a_live_one() {
        let (live, mut rx) = setup();
        let j = jid("a@x/r");
        let beat = live.beat();
        let s = live.bind(&j, 1, beat.clone());
        let first = beat.last_ms();
        // The beat in Redis is old, but the client spoke since (a write was lost): rewrite.
        tokio::time::advance(ms(1500)).await;
        beat.touch();
        let newer = beat.last_ms();
        assert!(matches!(
            live.swept_local(j.as_str(), first),
            SweptLocal::Alive(b) if b == newer
        ));
        assert!(!s.end.is_cancelled() && s.dead_at().is_none());
        // Silent for T since that beat: ended, dead at the last beat, not at detection.
        tokio::time::advance(ms(2000)).await;
        assert!(matches!(
            live.swept_local(j.as_str(), newer),
            SweptLocal::Ended
        ));
        assert!(s.end.is_cancelled());
        assert_eq!(s.dead_at(), Some(newer));
        // The session ends as a silent death: its keys go, last seen is the last beat.
        drain(&mut rx);
        live.finished(&j, 1, s.dead_at().unwrap());
        assert!(matches!(&drain(&mut rx)[..], [Op::Remove { .. }]));
        assert_eq!(
            live.last_seen.get("a@x").map(|e| e.at.timestamp_millis()),
            Some(newer)
        );
        assert!(matches!(
            live.swept_local(j.as_str(), newer),
            SweptLocal::NotLocal
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_resource_in_grace_is_left_to_its_grace_task_and_a_reconnect_takes_it_over() {
        let (live, mut rx) = setup();
        let j = jid("a@x/r");
        let _old = live.bind(&j, 1, live.beat());
        live.mark_grace(&j, 1);
        tokio::time::advance(ms(2500)).await;
        assert!(
            matches!(live.swept_local(j.as_str(), 0), SweptLocal::InGrace),
            "the sweeper leaves a closed session in its grace period alone"
        );
        // The same resource binds again within G: counted, and when the old session's
        // grace ends it neither removes the new session's keys nor stays tracked.
        tokio::time::advance(live.timings.grace / 2).await;
        let _new = live.bind(&j, 2, live.beat());
        assert_eq!(live.metrics.grace_resumed.load(Ordering::Relaxed), 1);
        drain(&mut rx);
        assert!(live.forget(&j, 1), "the new session holds the resource");
        assert!(drain(&mut rx).is_empty());
        assert!(live.is_tracked(&j));
        // Without a reconnect the grace task finishes it: keys removed, last seen at the
        // close time.
        let k = jid("b@x/r");
        let _b = live.bind(&k, 3, live.beat());
        let closed = live.clock.now_ms();
        live.mark_grace(&k, 3);
        tokio::time::advance(live.timings.grace).await;
        drain(&mut rx);
        live.finished(&k, 3, closed);
        assert!(matches!(&drain(&mut rx)[..], [Op::Remove { jid }] if k == *jid));
        assert!(!live.is_tracked(&k));
        assert_eq!(
            live.last_seen.get("b@x").map(|e| e.at.timestamp_millis()),
            Some(closed)
        );
    }

    /// The in-process table of `live` (the default config has no Redis url).
    fn table(live: &Liveness) -> &in_process::Table {
        match &live.backend {
            Backend::InProcess(t) => t,
            Backend::Redis(_) => panic!("no [redis] url: the backend is in process"),
        }
    }

    /// What the in-process writer and sweeper do, one sweep period at a time: apply the
    /// queued writes, then hand every entry older than T to the sweep decision.
    fn sweep_in_process(live: &Liveness, rx: &mut mpsc::Receiver<Op>) -> Vec<SweptLocal> {
        for op in drain(rx) {
            table(live).apply(&op);
        }
        table(live)
            .take_stale(live.sweep_cutoff_ms(), live.sweep_batch())
            .into_iter()
            .map(|(j, score)| live.swept_local(&j, score))
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn in_process_a_silent_death_is_found_t_to_t_plus_one_sweep_after_the_last_beat() {
        let (live, mut rx) = setup();
        assert_eq!(live.backend.name(), "in-process");
        assert!(live.redis().is_none());
        let j = jid("a@x/r");
        let beat = live.beat();
        let mut s = live.bind(&j, 1, beat.clone());
        // A live client for 3 T: traffic every H, refresh and sweep on their own periods.
        // It is never taken, though its entry is rewritten only once per refresh.
        let (h, sweep, refresh) = (ms(400), live.timings.sweep, live.timings.refresh);
        let mut t = Duration::ZERO;
        while t < live.timings.ttl * 3 {
            tokio::time::advance(sweep).await;
            t += sweep;
            if t.as_millis() % h.as_millis() == 0 {
                beat.touch();
            }
            if t.as_millis() % refresh.as_millis() == 0 {
                s.refresh(&live);
            }
            assert!(sweep_in_process(&live, &mut rx).is_empty(), "live at {t:?}");
        }
        // Then silence. The sweep that runs once T has passed ends it, at its last beat.
        let last = beat.last_ms();
        let mut found = None;
        for _ in 0..100 {
            tokio::time::advance(sweep).await;
            s.refresh(&live);
            let got = sweep_in_process(&live, &mut rx);
            if !got.is_empty() {
                assert!(matches!(&got[..], [SweptLocal::Ended]));
                found = Some(live.clock.now_ms() - last);
                break;
            }
        }
        let after = found.expect("the silent session was swept") as u128;
        let (ttl, sweep) = (live.timings.ttl.as_millis(), sweep.as_millis());
        assert!(
            after >= ttl && after <= ttl + sweep,
            "found {after} ms after"
        );
        assert!(s.end.is_cancelled());
        assert_eq!(
            s.dead_at(),
            Some(last),
            "dead at the last beat, not at detection"
        );
        live.finished(&j, 1, last);
        sweep_in_process(&live, &mut rx);
        assert!(table(&live).is_empty(), "the session end removed the entry");
    }

    #[tokio::test(start_paused = true)]
    async fn in_process_a_closed_session_in_grace_is_not_swept_and_its_close_is_its_last_beat() {
        let (live, mut rx) = setup();
        let j = jid("a@x/r");
        let beat = live.beat();
        let _s = live.bind(&j, 1, beat.clone());
        // Silent for most of T, then closed: the close time is written as the final beat
        // (as `session_over` queues it), so the entry outlives G.
        tokio::time::advance(ms(1900)).await;
        live.mark_grace(&j, 1);
        live.queue(Op::Refresh {
            jid: j.clone(),
            beat_ms: live.clock.now_ms(),
        });
        let mut t = Duration::ZERO;
        while t < live.timings.grace {
            tokio::time::advance(live.timings.sweep).await;
            t += live.timings.sweep;
            assert!(sweep_in_process(&live, &mut rx).is_empty());
        }
        // Were it swept while in grace, the grace task would still own it.
        assert!(matches!(
            live.swept_local(j.as_str(), 0),
            SweptLocal::InGrace
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_leftover_beat_of_a_session_ended_here_is_not_announced_again_for_3t() {
        let (live, _rx) = setup();
        let j = jid("a@x/r");
        let _s = live.bind(&j, 1, live.beat());
        let score = live.clock.now_ms();
        tokio::time::advance(ms(100)).await;
        live.finished(&j, 1, live.clock.now_ms());
        assert!(live.ended_here_after(j.as_str(), score));
        assert!(
            !live.ended_here_after(j.as_str(), live.clock.now_ms() + 1),
            "a beat newer than the end is another session's"
        );
        // Entries older than 3T are forgotten: no leftover can be that old.
        tokio::time::advance(ms(6000)).await;
        assert!(live.ended_here_after(j.as_str(), score));
        tokio::time::advance(ms(101)).await;
        assert!(!live.ended_here_after(j.as_str(), score));
    }

    /// What the session loop of [`run_session`] saw at its end.
    struct Ended {
        /// When it ended, on the node's clock.
        at_ms: i64,
        /// Whether the sweeper ended it (rather than the local fallback).
        by_sweeper: bool,
        dead_at: Option<i64>,
    }

    /// Starts the tasks of an in-process node: the real writer, and the sweeper's sweep
    /// (`stale::sweep_table`) every sweep period from `phase` on, as `sweeper::run` does
    /// after its random start. Both stop with `stop`.
    fn start_in_process_node(live: &Arc<Liveness>, phase: Duration, stop: &CancellationToken) {
        let rx = live.take_ops_rx().expect("the writer runs once");
        let (l, s) = (live.clone(), stop.clone());
        tokio::spawn(async move { in_process::writer(&l, table(&l), rx, s).await });
        let (l, s) = (live.clone(), stop.clone());
        tokio::spawn(async move {
            tokio::time::sleep(phase).await;
            let mut tick = tokio::time::interval(l.timings.sweep);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = s.cancelled() => return,
                }
                super::stale::sweep_table(&l, table(&l));
            }
        });
    }

    /// Binds `j` and runs the liveness part of the c2s session loop: a refresh every
    /// `redis_refresh` with the local fallback checked then, and the end when the sweeper
    /// says so. A silent death is then finished at its last beat, as `session_over`
    /// announces it (at once: T has been waited). Returns the end token to watch.
    fn run_session(
        live: &Arc<Liveness>,
        j: SharedJid,
        beat: Arc<Beat>,
    ) -> (CancellationToken, tokio::task::JoinHandle<Ended>) {
        let mut s = live.bind(&j, 1, beat);
        let end = s.end.clone();
        let (l, told) = (live.clone(), end.clone());
        let task = tokio::spawn(async move {
            let mut refresh = tokio::time::interval(l.timings.refresh);
            refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            refresh.reset();
            loop {
                tokio::select! {
                    _ = told.cancelled() => break,
                    _ = refresh.tick() => {
                        s.refresh(&l);
                        if s.locally_dead(&l) {
                            s.mark_dead();
                            break;
                        }
                    }
                }
            }
            let by_sweeper = told.is_cancelled();
            if by_sweeper {
                s.mark_dead();
            }
            if let Some(at) = s.dead_at() {
                l.finished(&j, 1, at);
            }
            Ended {
                at_ms: l.clock.now_ms(),
                by_sweeper,
                dead_at: s.dead_at(),
            }
        });
        (end, task)
    }

    /// Bounds, with H = 400 ms, T = 2 s, sweep = 200 ms, refresh = 600 ms: a client that
    /// talks every 100 ms is never ended in 3 T (longer than the T + sweep of silence that
    /// ends one), and once silent it is ended no sooner than T and no later than T + one
    /// sweep after its last beat, by the sweeper (the local fallback would take T + 2
    /// sweeps), dead at its last beat. Checked for four phases of the sweeper against the
    /// traffic, since a node's sweeper starts at a random point of its period.
    #[tokio::test(start_paused = true)]
    async fn in_process_a_client_gone_silent_is_ended_after_t_and_within_t_plus_a_sweep_of_its_last_beat(
    ) {
        for quarter in 0..4u32 {
            let live = Arc::new(Liveness::with_clock(&config(), Clock::tokio()));
            let (ttl, sweep) = (live.timings.ttl, live.timings.sweep);
            let stop = CancellationToken::new();
            start_in_process_node(&live, sweep * quarter / 4, &stop);
            let beat = live.beat();
            let (end, session) = run_session(&live, jid("a@x/r"), beat.clone());
            let mut talked = Duration::ZERO;
            while talked < ttl * 3 {
                tokio::time::sleep(ms(100)).await;
                talked += ms(100);
                beat.touch();
                assert!(
                    !end.is_cancelled(),
                    "phase {quarter}/4: ended while talking, at {talked:?}"
                );
            }
            let last = beat.last_ms();
            tokio::time::sleep(ttl - ms(1)).await;
            assert!(
                !end.is_cancelled(),
                "phase {quarter}/4: ended {} ms after the last beat, before T",
                live.clock.now_ms() - last
            );
            let ended = session.await.expect("the session task");
            let after = ended.at_ms - last;
            let (t, s) = (ttl.as_millis() as i64, sweep.as_millis() as i64);
            assert!(
                ended.by_sweeper,
                "phase {quarter}/4: the local fallback, not the sweeper, ended it"
            );
            assert!(
                after >= t && after <= t + s,
                "phase {quarter}/4: ended {after} ms after the last beat"
            );
            assert_eq!(ended.dead_at, Some(last), "dead at the last beat");
            // The end is written: the entry goes, and last seen is the last beat.
            tokio::time::sleep(ms(1)).await;
            assert!(table(&live).is_empty(), "phase {quarter}/4");
            assert_eq!(
                live.last_seen.get("a@x").map(|e| e.at.timestamp_millis()),
                Some(last)
            );
            stop.cancel();
        }
    }
}
