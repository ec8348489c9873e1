//! The sweeper: takes resources whose last beat is older than T out of the beat ZSETs with
//! one Lua script per batch, then announces them unavailable.
//!
//! Redis runs a script atomically (nothing else runs meanwhile), and the script removes what
//! it returns, so when several nodes sweep at once each stale resource is returned to exactly
//! one of them. A full batch means there may be more: the script is called again.
//!
//! The member names the node holding the session. A resource of this node is handled here;
//! one of another node is handed to it on its pub/sub channel (it knows whether the client
//! is really silent, owns the socket and ends the session, announcing through the normal
//! presence path); when no node listens on that channel (the node crashed), the sweeper
//! announces the resource unavailable itself.
//!
//! "Nobody listens" is the publish's receiver count: `PUBLISH` on a single Redis, `SPUBLISH`
//! on a Redis Cluster (there `PUBLISH` counts only the subscribers of the node that
//! received it, while `SPUBLISH` goes to the channel's shard, where the node subscribes).
//! A count of 0 from a node that still heartbeats in the cluster directory is a subscriber
//! being re-made (a Redis failover, a reconnect), not a death: the beat is put back, and a
//! later sweep hands it over again or, once the node has stopped heartbeating (T after its
//! last heartbeat), announces it.
//!
//! Without Redis the sweeper takes the same stale resources (beat at or before now − T, in
//! batches of `sweep_batch`) from the in-process table, every one of them this node's, and
//! hands each to the same decision ([`super::Liveness::swept_local`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::jid::FullJid;
use crate::liveness::redis_link::RedisLink;
use crate::liveness::{in_process, keys, Backend, Op, SweptLocal};
use crate::node::Shared;
use crate::redis_conn::Conn;

/// KEYS[1]: beats ZSET. ARGV[1]: cutoff score (ms), ARGV[2]: batch size.
/// Returns member, score, member, score, ... and removes them.
pub const SWEEP: &str = r"
local stale = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[2]))
local members = {}
for i = 1, #stale, 2 do members[#members + 1] = stale[i] end
if #members > 0 then redis.call('ZREM', KEYS[1], unpack(members)) end
return stale
";

/// One sweeper call on one ZSET: the stale members (full JID, last beat ms), now removed.
pub async fn sweep_once(
    conn: &mut Conn,
    beats_key: &str,
    cutoff_ms: i64,
    batch: usize,
) -> redis::RedisResult<Vec<(String, i64)>> {
    let flat: Vec<String> = redis::cmd("EVAL")
        .arg(SWEEP)
        .arg(1)
        .arg(beats_key)
        .arg(cutoff_ms)
        .arg(batch)
        .query_async(conn)
        .await?;
    Ok(flat
        .chunks_exact(2)
        .map(|p| {
            let score = p[1].parse::<f64>().map(|s| s as i64).unwrap_or(0);
            (p[0].clone(), score)
        })
        .collect())
}

/// Sweeps every `sweep_interval` (first run after a random fraction of it, so nodes started
/// together do not sweep in lockstep).
pub async fn run(shared: Arc<Shared>) {
    if !shared.config.liveness.sweeper {
        return;
    }
    let period = shared.liveness.timings.sweep;
    let jitter = period.mul_f64(rand::random::<f64>());
    tokio::select! {
        _ = tokio::time::sleep(jitter) => {}
        _ = shared.shutdown.cancelled() => return,
    }
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shared.shutdown.cancelled() => return,
        }
        sweep_all(&shared).await;
    }
}

/// One sweep of the backend (every shard in Redis, the table in process). Public so tests
/// can drive it without waiting for the timer.
pub async fn sweep_all(shared: &Arc<Shared>) -> usize {
    match &shared.liveness.backend {
        Backend::Redis(link) => sweep_redis(shared, link).await,
        Backend::InProcess(table) => sweep_table(shared, table).await,
    }
}

/// The in-process sweep: the same cutoff, batches and per-resource decision as in Redis.
/// Every entry is this node's, so each goes to [`handle_stale`] directly.
async fn sweep_table(shared: &Arc<Shared>, table: &in_process::Table) -> usize {
    let live = &shared.liveness;
    live.metrics.sweeps.fetch_add(1, Ordering::Relaxed);
    let cutoff = live.sweep_cutoff_ms();
    let batch = live.sweep_batch();
    let mut total = 0;
    loop {
        let got = table.take_stale(cutoff, batch);
        let full = got.len() >= batch;
        total += got.len();
        live.metrics
            .swept
            .fetch_add(got.len() as u64, Ordering::Relaxed);
        for (jid, score) in got {
            handle_stale(shared, &jid, score).await;
        }
        if !full {
            return total;
        }
    }
}

async fn sweep_redis(shared: &Arc<Shared>, link: &RedisLink) -> usize {
    let live = &shared.liveness;
    let Some(mut conn) = link.conn().await else {
        return 0;
    };
    live.metrics.sweeps.fetch_add(1, Ordering::Relaxed);
    let cutoff = live.sweep_cutoff_ms();
    let batch = live.sweep_batch();
    let mut total = 0;
    for shard in 0..live.keys.shards {
        let key = live.keys.beats(shard);
        loop {
            let got = match sweep_once(&mut conn, &key, cutoff, batch).await {
                Ok(g) => g,
                Err(e) => {
                    link.failed(&e).await;
                    return total;
                }
            };
            let full = got.len() >= batch;
            total += got.len();
            live.metrics
                .swept
                .fetch_add(got.len() as u64, Ordering::Relaxed);
            for (member, score) in got {
                handle_member(shared, link, &mut conn, &member, score).await;
            }
            if !full {
                break;
            }
        }
    }
    total
}

async fn handle_member(
    shared: &Arc<Shared>,
    link: &RedisLink,
    conn: &mut Conn,
    member: &str,
    score: i64,
) {
    let live = &shared.liveness;
    let Some((node, jid)) = keys::parse_member(member) else {
        tracing::warn!(member, "malformed beat member dropped");
        return;
    };
    if node == live.node_id {
        return handle_stale(shared, jid, score).await;
    }
    let Some(target) = link.target() else {
        return;
    };
    let notice = format!("{score} {jid}");
    let heard: redis::RedisResult<i64> = target
        .publish(&live.keys.node_channel(node), &notice)
        .query_async(conn)
        .await;
    match heard {
        Ok(n) if n > 0 => {
            tracing::debug!(%jid, %node, "stale resource handed to its node");
        }
        Ok(_) if shared.cluster.node_is_live(node) => {
            // Its subscriber is being re-made: try again at a later sweep.
            tracing::debug!(%jid, %node, "node heartbeats but does not listen; beat put back");
            let bare = jid.split_once('/').map_or(jid, |(b, _)| b);
            let back: redis::RedisResult<i64> = redis::cmd("ZADD")
                .arg(live.keys.beats_for(bare))
                .arg("GT")
                .arg(score)
                .arg(member)
                .query_async(conn)
                .await;
            if let Err(e) = back {
                link.failed(&e).await;
            }
        }
        Ok(_) => {
            // Nobody listens for that node: it is gone, and so is the session.
            if let Ok(j) = FullJid::new(jid) {
                announce_orphan(shared, link, conn, node, &j, score).await;
            }
        }
        Err(e) => link.failed(&e).await,
    }
}

/// Listens on this node's channel for stale resources other nodes' sweepers found, and
/// handles them like its own. Reconnects with backoff.
pub async fn listen(shared: Arc<Shared>) {
    let live = &shared.liveness;
    let Some(link) = live.redis() else {
        return;
    };
    let Some(target) = link.target().cloned() else {
        return;
    };
    let channel = live.keys.node_channel(&live.node_id);
    let handler = shared.clone();
    crate::pubsub::subscribe(
        target,
        channel,
        link.timeout(),
        shared.config.redis.reconnect_max,
        shared.shutdown.clone(),
        |text| {
            let shared = handler.clone();
            async move {
                let Some((score, jid)) = text.split_once(' ') else {
                    return;
                };
                let Ok(score) = score.parse::<i64>() else {
                    return;
                };
                handle_stale(&shared, jid, score).await;
            }
        },
    )
    .await;
}

async fn handle_stale(shared: &Arc<Shared>, jid: &str, score: i64) {
    let live = &shared.liveness;
    match live.swept_local(jid, score) {
        SweptLocal::Ended => {
            tracing::info!(%jid, last_beat = score, "sweeper: silent for longer than ttl");
        }
        SweptLocal::InGrace => {}
        SweptLocal::Alive(beat) => {
            if let Ok(j) = FullJid::new(jid) {
                live.queue_op(Op::Refresh {
                    jid: j,
                    beat_ms: beat,
                });
            }
        }
        SweptLocal::NotLocal => {
            if live.ended_here_after(jid, score) {
                return;
            }
            // In process every entry was written by this node for a session it tracks, so
            // an untracked one has no other node to belong to: its end was handled here.
            let Some(link) = live.redis() else {
                tracing::debug!(%jid, "sweeper: stale entry of a session no longer tracked");
                return;
            };
            if let Ok(j) = FullJid::new(jid) {
                if let Some(mut conn) = link.conn().await {
                    announce_orphan(shared, link, &mut conn, &live.node_id, &j, score).await;
                }
            }
        }
    }
}

/// A stale resource with no session on this node (its node crashed): tell the user's local
/// contacts and resources that it is unavailable, and record its last beat as last seen.
/// RFC 6121 §4.5.2: the server generates the unavailable when the client could not.
///
/// Nothing is said when the same resource is back, here or on a live node (its resource
/// key names another node than `node`, the dead one): it is online, and an unavailable
/// would contradict what its contacts were just shown. Who receives the unavailable is
/// [`crate::delivery::unavailable_of_lost`]'s decision.
async fn announce_orphan(
    shared: &Arc<Shared>,
    link: &RedisLink,
    conn: &mut Conn,
    node: &str,
    jid: &FullJid,
    score: i64,
) {
    if shared.sessions.get(jid).is_some() {
        tracing::debug!(%jid, "sweeper: stale beat of a resource that is back here");
        return;
    }
    let holder: redis::RedisResult<Option<String>> = redis::cmd("GET")
        .arg(shared.liveness.keys.resource(jid))
        .query_async(conn)
        .await;
    match holder {
        Ok(Some(n)) if n != node => {
            tracing::debug!(%jid, holder = %n, "sweeper: stale beat of a resource back on a live node");
            return;
        }
        Ok(_) => {}
        // Unknown: announcing is what the resource's own node would have done.
        Err(e) => link.failed(&e).await,
    }
    tracing::info!(%jid, last_beat = score, "sweeper: resource of no live node");
    crate::delivery::unavailable_of_lost(shared, jid).await;
    shared.liveness.last_seen.push(crate::store::LastSeen {
        jid: jid.to_bare().to_string(),
        at: chrono::DateTime::from_timestamp_millis(score).unwrap_or_else(chrono::Utc::now),
        status: None,
    });
}
