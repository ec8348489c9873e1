//! The tasks and handlers of liveness ([`crate::liveness`] holds its state and decisions):
//! the Redis writer, the sweeper, the last-seen flush, the counter log, the end of a
//! session (grace period, then unavailable through presence) and `jabber:iq:last`. They
//! run on [`Lifecycle`], which holds the [`crate::liveness::Liveness`] they work on and
//! the few other parts of the node they reach; `jabber:iq:last` is its own service,
//! [`last_seen::LastSeen`].

pub mod last_seen;
pub mod sweeper;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::task::TaskTracker;

use tokio_util::sync::CancellationToken;

use crate::cluster::Cluster;
use crate::liveness::{Backend, LiveSession, Liveness, Op};
use crate::node::session::Client;
use crate::node::sessions::Sessions;
use crate::services::presence::Presence;
use crate::store::Store;

/// What the tasks around a session's life use: the liveness state they work on, the
/// cluster (the directory, last seen to the other nodes, the rejoin signal), this node's
/// sessions, the store (last seen), presence (the unavailable of an ended or lost
/// resource), the node's shutdown and the liveness settings the server started with.
pub struct Lifecycle {
    liveness: Arc<Liveness>,
    cluster: Cluster,
    sessions: Arc<Sessions>,
    store: Store,
    presence: Arc<Presence>,
    shutdown: CancellationToken,
    /// `[liveness] sweeper`.
    sweeper: bool,
    /// `[liveness] metrics_log_interval`.
    metrics_log_interval: Duration,
    /// `[redis] reconnect_max`.
    reconnect_max: Duration,
}

/// The settings [`Lifecycle`] reads from the configuration the server started with.
pub struct LifecycleSettings {
    /// `[liveness] sweeper`.
    pub sweeper: bool,
    /// `[liveness] metrics_log_interval`.
    pub metrics_log_interval: Duration,
    /// `[redis] reconnect_max`.
    pub reconnect_max: Duration,
}

impl Lifecycle {
    /// The service over these parts of the node.
    pub fn new(
        liveness: Arc<Liveness>,
        cluster: Cluster,
        sessions: Arc<Sessions>,
        store: Store,
        presence: Arc<Presence>,
        shutdown: CancellationToken,
        settings: LifecycleSettings,
    ) -> Self {
        Lifecycle {
            liveness,
            cluster,
            sessions,
            store,
            presence,
            shutdown,
            sweeper: settings.sweeper,
            metrics_log_interval: settings.metrics_log_interval,
            reconnect_max: settings.reconnect_max,
        }
    }
}

/// Called by c2s once the session's read loop is over and it left the session registry.
///
/// A silent death (found by the sweeper or the local fallback) is announced at once: T has
/// already been waited. A clean close or a dropped connection waits the grace period G;
/// if the same resource is available again by then, contacts hear nothing (they already got
/// its new presence), otherwise they get unavailable through the normal presence path.
/// Either way the session's last-seen time is queued once.
pub async fn session_over(life: Arc<Lifecycle>, client: Client, live: LiveSession) {
    let l = &life.liveness;
    if let Some(at) = live.dead_at() {
        l.metrics.silent_deaths.fetch_add(1, Ordering::Relaxed);
        tracing::info!(jid = %live.jid, last_beat = at, "silent death: announcing unavailable");
        // Other nodes know the last seen before their users hear of the end.
        life.cluster.seen(live.jid.to_bare().as_str(), at);
        life.presence.session_ended(&client).await;
        l.finished(&live.jid, live.id, at);
        return;
    }
    let closed = l.clock.now_ms();
    l.metrics.grace_started.fetch_add(1, Ordering::Relaxed);
    l.mark_grace(&live.jid, live.id);
    // The close time is the final beat: the sweeper leaves the resource alone during G.
    l.queue(Op::Refresh {
        jid: live.jid.clone(),
        beat_ms: closed,
    });
    let grace = l.timings.grace;
    let waiting = life.clone();
    l.spawn_grace(async move {
        let life = waiting;
        tokio::select! {
            _ = tokio::time::sleep(grace) => {}
            _ = life.shutdown.cancelled() => {}
        }
        // Back here, or bound again on another node of the cluster (the directory).
        let back = life
            .sessions
            .get(&live.jid)
            .is_some_and(|s| s.is_available())
            || life.cluster.holder_of(&live.jid).await.is_some();
        if back {
            tracing::debug!(jid = %live.jid, "resource came back within the grace period");
            life.liveness.forget(&live.jid, live.id);
            return;
        }
        life.cluster.seen(live.jid.to_bare().as_str(), closed);
        life.presence.session_ended(&client).await;
        life.liveness.finished(&live.jid, live.id, closed);
    });
}

/// Starts the writer, the sweeper, the last-seen batcher, the counter log, the receiver of
/// this node's cluster channel and what follows a return to Redis.
pub fn start(life: &Arc<Lifecycle>, tracker: &TaskTracker) {
    let rx = life.liveness.take_ops_rx();
    // The mode, stated once per start: the README's mode table names this line.
    let backend = &life.liveness.backend;
    let mode = match backend {
        Backend::Redis(_) => "resource state in Redis (any number of nodes)",
        Backend::InProcess(_) => "no [redis] url: resource state in process (single node)",
    };
    tracing::info!(backend = backend.name(), "liveness: {mode}");
    if matches!(backend, Backend::InProcess(_)) && !life.sweeper {
        // No other node can sweep for this one: only each session's own fallback is left.
        tracing::warn!(
            "liveness: sweeper = false without Redis: silent deaths are found only after \
             ttl + 2 sweep intervals, at a refresh tick"
        );
    }
    if let Some(rx) = rx {
        let s = life.clone();
        tracker.spawn(async move {
            match &s.liveness.backend {
                Backend::Redis(_) => writer(s.clone(), rx).await,
                Backend::InProcess(table) => {
                    crate::liveness::in_process::writer(&s.liveness, table, rx, s.shutdown.clone())
                        .await
                }
            }
        });
    }
    tracker.spawn(sweeper::run(life.clone()));
    tracker.spawn(sweeper::listen(life.clone()));
    let rejoin = life.clone();
    tracker.spawn(async move {
        loop {
            tokio::select! {
                _ = rejoin.cluster.rejoined() => {}
                _ = rejoin.shutdown.cancelled() => return,
            }
            rejoin.presence.show_again_to_other_nodes().await;
        }
    });
    tracker.spawn(last_seen::run(life.clone()));
    tracker.spawn(log_loop(life.clone()));
}

/// Applies queued ops in pipelines (one round trip for whatever is queued). Each op is one
/// resource write in the counters. Ops that cannot be written are dropped: the repair after
/// the reconnect rewrites the live state, and stale beats of ended sessions are ignored by
/// the sweeper (`Liveness::ended_here_after`).
pub async fn writer(life: Arc<Lifecycle>, mut rx: mpsc::Receiver<Op>) {
    let Some(link) = life.liveness.redis() else {
        return;
    };
    let mut batch = Vec::with_capacity(256);
    let mut shard_expiry = crate::liveness::redis_link::ShardExpiry::default();
    let mut repair_tick = tokio::time::interval(Duration::from_millis(250));
    repair_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            n = rx.recv_many(&mut batch, 256) => {
                if n == 0 {
                    return;
                }
            }
            _ = repair_tick.tick() => {
                // Reconnect while there is nothing to write, so the repair does not wait for
                // the next session event.
                if !link.is_up() {
                    let _ = link.conn().await;
                }
            }
            _ = life.shutdown.cancelled() => return,
        }
        let live = &life.liveness;
        let Some(mut conn) = link.conn().await else {
            if !batch.is_empty() {
                live.metrics
                    .redis_errors
                    .fetch_add(batch.len() as u64, Ordering::Relaxed);
            }
            batch.clear();
            continue;
        };
        if link.take_repair() {
            shard_expiry.reset();
            let repair = crate::liveness::ops_for_repair(live);
            if !repair.is_empty() {
                tracing::info!(
                    resources = repair.len(),
                    "rewriting local liveness to Redis"
                );
            }
            batch.extend(repair);
        }
        if batch.is_empty() {
            continue;
        }
        let mut pipe = crate::cluster::redis_conn::SlotPipe::new();
        for op in &batch {
            crate::liveness::redis_link::add_op(&mut pipe, live, op);
        }
        shard_expiry.add_due(&mut pipe, live, &batch);
        match pipe.query(&mut conn).await {
            Ok(_) => {
                let n = batch.len() as u64;
                let m = &live.metrics;
                m.redis_writes.fetch_add(n, Ordering::Relaxed);
                m.liveness_writes.fetch_add(n, Ordering::Relaxed);
            }
            Err(e) => {
                shard_expiry.reset();
                link.failed(&e).await
            }
        }
        batch.clear();
    }
}

/// Logs the counters every `metrics_log_interval` (0 = never).
pub async fn log_loop(life: Arc<Lifecycle>) {
    let every = life.metrics_log_interval;
    if every.is_zero() {
        return;
    }
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = life.shutdown.cancelled() => return,
        }
        let m = &life.liveness.metrics;
        tracing::info!(
            liveness_writes = crate::liveness::metrics::get(&m.liveness_writes),
            redis_writes = crate::liveness::metrics::get(&m.redis_writes),
            redis_errors = crate::liveness::metrics::get(&m.redis_errors),
            pg_writes = crate::liveness::metrics::get(&m.pg_writes),
            pg_rows = crate::liveness::metrics::get(&m.pg_rows),
            heartbeats = crate::liveness::metrics::get(&m.heartbeats),
            pings_sent = crate::liveness::metrics::get(&m.pings_sent),
            sweeps = crate::liveness::metrics::get(&m.sweeps),
            swept = crate::liveness::metrics::get(&m.swept),
            sessions = life.sessions.count(),
            "liveness counters"
        );
    }
}
