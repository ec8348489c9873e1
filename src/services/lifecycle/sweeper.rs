//! The sweeper: takes resources whose last beat is older than T out of the beat ZSETs with
//! one Lua script per batch, then announces them unavailable.
//!
//! Redis runs a script atomically (nothing else runs meanwhile), and the script removes what
//! it returns, so when several nodes sweep at once each stale resource is returned to exactly
//! one of them. A full batch means there may be more: the script is called again.
//!
//! The member names the node holding the session. A resource of this node is handled here;
//! those of another node are handed to it on its pub/sub channel, one message per resource
//! and every hand-off of a batch in one pipeline (it knows whether the client is really
//! silent, owns the socket and ends the session, announcing through the normal presence
//! path). When nobody listens on that channel (the node crashed), the sweeper announces
//! the resources itself.
//!
//! "Nobody listens" is the publish's receiver count: `PUBLISH` on a single Redis, `SPUBLISH`
//! on a Redis Cluster (there `PUBLISH` counts only the subscribers of the node that
//! received it, while `SPUBLISH` goes to the channel's shard, where the node subscribes).
//! A count of 0 from a node that still heartbeats in the cluster directory is a subscriber
//! being re-made (a Redis failover, a reconnect), not a death: its beats are put back at the
//! end of the sweep, and a later sweep hands them over again or, once the node has stopped
//! heartbeating (T − redis_refresh after its last heartbeat, before its first beats can go
//! stale), announces them. A node that received none of
//! a batch is decided for the rest of the sweep, so a dead node costs one pipeline of
//! publishes per sweep, not one round trip per resource.
//!
//! A count above 0 says the node heard the hand-off, not that it acted: it may die before
//! it writes the beat again or ends the session, and the beat is already out of the ZSET.
//! So the sweeper follows what it handed ([`follow_up_handed`]) until the node has acted,
//! and announces it once the node is no longer live without having done so.
//!
//! A crashed node's sessions all go stale within one refresh interval, thousands a second:
//! the resource keys and directory entries of a batch's orphans are read in one pipeline
//! (per slot on a Redis Cluster), and `sweep_concurrency` of them are announced at a time
//! (each one read of the user's audience, one cluster message and local deliveries), so
//! they are all told within the sweep that finds them rather than one round trip after
//! another.
//!
//! Without Redis the sweeper takes the same stale resources (beat at or before now − T, in
//! batches of `sweep_batch`) from the in-process table, every one of them this node's, and
//! hands each to the same decision ([`super::Liveness::swept_local`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::cluster::redis_conn::{Conn, SlotPipe};
use crate::cluster::{Cluster, Entry};
use crate::liveness::redis_link::RedisLink;
use crate::liveness::stale::{stale_here, sweep_table, Orphan, Stale};
use crate::liveness::{keys, Backend, Handed};
use crate::services::lifecycle::Lifecycle;

/// KEYS[1]: beats ZSET. ARGV[1]: cutoff score (ms), ARGV[2]: batch size, ARGV[3]: the
/// calling node's member prefix (`"<node> "`), ARGV[4]: stale members to skip (the
/// caller's own, returned earlier in the same sweep and still there).
/// Returns member, score, member, score, ... and removes those of other nodes. The
/// caller's own stay until its decision is written (the beat again, or the session's
/// end): taken out before that, a node dying between the take and the write would take
/// its resource along unannounced, while left in, the other nodes' sweepers find it.
pub const SWEEP: &str = r"
local stale = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'WITHSCORES', 'LIMIT', tonumber(ARGV[4]), tonumber(ARGV[2]))
local own = ARGV[3]
local members = {}
for i = 1, #stale, 2 do
  if string.sub(stale[i], 1, #own) ~= own then members[#members + 1] = stale[i] end
end
if #members > 0 then redis.call('ZREM', KEYS[1], unpack(members)) end
return stale
";

/// KEYS[1]: beats ZSET. ARGV: member, score, member, score, ... Removes each member whose
/// score is still the one given (a newer beat written meanwhile stays). Returns how many.
const REMOVE_UNCHANGED: &str = r"
local n = 0
for i = 1, #ARGV, 2 do
  local s = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if s and tonumber(s) == tonumber(ARGV[i + 1]) then n = n + redis.call('ZREM', KEYS[1], ARGV[i]) end
end
return n
";

/// One sweeper call on one ZSET for node `own`: the stale members (full JID, last beat
/// ms) after the first `skip`, those of other nodes now removed ([`SWEEP`]).
pub async fn sweep_once(
    conn: &mut Conn,
    beats_key: &str,
    cutoff_ms: i64,
    batch: usize,
    own: &str,
    skip: usize,
) -> redis::RedisResult<Vec<(String, i64)>> {
    let flat: Vec<String> = redis::cmd("EVAL")
        .arg(SWEEP)
        .arg(1)
        .arg(beats_key)
        .arg(cutoff_ms)
        .arg(batch)
        .arg(format!("{own} "))
        .arg(skip)
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
pub async fn run(life: Arc<Lifecycle>) {
    if !life.sweeper {
        return;
    }
    let period = life.liveness.timings.sweep;
    let jitter = period.mul_f64(rand::random::<f64>());
    tokio::select! {
        _ = tokio::time::sleep(jitter) => {}
        _ = life.shutdown.cancelled() => return,
    }
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = life.shutdown.cancelled() => return,
        }
        sweep_all(&life).await;
    }
}

/// One sweep of the backend (every shard in Redis, the table in process). Public so tests
/// can drive it without waiting for the timer.
pub async fn sweep_all(life: &Arc<Lifecycle>) -> usize {
    match &life.liveness.backend {
        Backend::Redis(link) => sweep_redis(life, link).await,
        Backend::InProcess(table) => sweep_table(&life.liveness, table),
    }
}

async fn sweep_redis(life: &Arc<Lifecycle>, link: &RedisLink) -> usize {
    let live = &life.liveness;
    let Some(mut conn) = link.conn().await else {
        return 0;
    };
    live.metrics.sweeps.fetch_add(1, Ordering::Relaxed);
    let cutoff = live.sweep_cutoff_ms();
    let batch = live.sweep_batch();
    let mut sweep = Sweep::default();
    if let Err(e) = follow_up_handed(life, link, &mut conn, &mut sweep).await {
        link.failed(&e).await;
        return 0;
    }
    let mut total = 0;
    'shards: for shard in 0..live.keys.shards {
        let key = live.keys.beats(shard);
        // This node's own stale members stay in the ZSET: later calls skip past them.
        let mut own = 0;
        loop {
            let got = match sweep_once(&mut conn, &key, cutoff, batch, &live.node_id, own).await {
                Ok(g) => g,
                Err(e) => {
                    link.failed(&e).await;
                    break 'shards;
                }
            };
            let full = got.len() >= batch;
            total += got.len();
            live.metrics
                .swept
                .fetch_add(got.len() as u64, Ordering::Relaxed);
            match handle_batch(life, link, &mut conn, &key, got, &mut sweep).await {
                Ok(own_in_batch) => own += own_in_batch,
                Err(e) => {
                    link.failed(&e).await;
                    break 'shards;
                }
            }
            if !full {
                break;
            }
        }
    }
    // Only now: a member put back is still stale, so the same sweep would take it again.
    if !sweep.put_back.is_empty() {
        let mut pipe = SlotPipe::new();
        for (key, members) in &sweep.put_back {
            let mut c = redis::cmd("ZADD");
            c.arg(key).arg("GT");
            for (member, score) in members {
                c.arg(*score).arg(member);
            }
            pipe.add(key, c);
        }
        if let Err(e) = pipe.query(&mut conn).await {
            link.failed(&e).await;
        }
    }
    total
}

/// What one sweep learnt about other nodes, and what it gives back at its end.
#[derive(Default)]
struct Sweep {
    /// Nodes found not to listen in this sweep: their other members are not offered again.
    verdicts: HashMap<String, Verdict>,
    /// Beat ZSET → members (with their beat) of nodes that heartbeat but do not listen.
    put_back: HashMap<String, Vec<(String, i64)>>,
    /// Whether this sweep read the set of live instances afresh.
    live_set_read: bool,
}

/// Whether `node`, which did not listen, still heartbeats. The set of live instances is
/// read afresh once per sweep before a node is called deaf: the copy the heartbeat keeps
/// may be up to a heartbeat period old, which would delay a dead node's announcement by
/// that much. A failed read decides nothing (the node counts as live, its beats go back).
async fn still_live(life: &Lifecycle, node: &str, live_set_read: &mut bool) -> bool {
    if !life.cluster.node_is_live(node) {
        return false;
    }
    if *live_set_read {
        return true;
    }
    *live_set_read = true;
    !life.cluster.heartbeat(false).await || life.cluster.node_is_live(node)
}

/// What a node that received none of its stale resources' hand-offs is taken to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// Nobody, but the node still heartbeats: its subscriber is being re-made.
    Deaf,
    /// Nobody, and the node no longer heartbeats: it is gone, and so are its sessions.
    Dead,
}

/// One batch of stale members from beat ZSET `key`: this node's are decided here; the
/// others are handed to their node, every hand-off of the batch in one pipeline, and a
/// node that receives none of them is decided once for the whole sweep. What is left
/// (resources of dead nodes, and of this node's earlier runs) is announced together.
/// Returns how many of the batch were this node's (left in the ZSET by the script).
async fn handle_batch(
    life: &Arc<Lifecycle>,
    link: &RedisLink,
    conn: &mut Conn,
    key: &str,
    got: Vec<(String, i64)>,
    sweep: &mut Sweep,
) -> redis::RedisResult<usize> {
    let live = &life.liveness;
    let mut own = 0;
    let mut orphans = Vec::new();
    // This node's members with no session here: removed once decided (announced as
    // orphans, or already ended here), unless a newer beat was written meanwhile.
    let mut own_done: Vec<(&str, i64)> = Vec::new();
    let mut by_node: BTreeMap<&str, Vec<(&str, i64, &str)>> = BTreeMap::new();
    for (member, score) in &got {
        let Some((node, jid)) = keys::parse_member(member) else {
            tracing::warn!(member, "malformed beat member dropped");
            continue;
        };
        if node == live.node_id {
            own += 1;
            match stale_here(live, jid, *score) {
                Stale::Here => {}
                Stale::EndedHere => own_done.push((member, *score)),
                Stale::Orphan(o) => {
                    orphans.push(o);
                    own_done.push((member, *score));
                }
            }
        } else {
            by_node.entry(node).or_default().push((jid, *score, member));
        }
    }
    // The hand-offs to every node not decided yet in this sweep, one message per resource
    // (the format every version reads) and all in one pipeline.
    let mut decided: HashMap<&str, Verdict> = by_node
        .keys()
        .filter_map(|n| sweep.verdicts.get(*n).map(|v| (*n, *v)))
        .collect();
    let undecided: Vec<&str> = by_node
        .keys()
        .copied()
        .filter(|n| !decided.contains_key(n))
        .collect();
    if let (false, Some(target)) = (undecided.is_empty(), link.target()) {
        let mut pipe = SlotPipe::new();
        for node in &undecided {
            let channel = live.keys.node_channel(node);
            for (jid, score, _) in &by_node[node] {
                pipe.add(
                    &channel,
                    target.publish(&channel, &format!("{score} {jid}")),
                );
            }
        }
        let mut heard = pipe.query(conn).await?.into_iter();
        for node in undecided {
            let members = by_node
                .get_mut(node)
                .expect("an undecided node has members");
            let before = members.len();
            keep_unheard(live, node, members, &mut heard);
            if members.is_empty() {
                tracing::debug!(%node, resources = before, "stale resources handed to their node");
                continue;
            }
            let verdict = if still_live(life, node, &mut sweep.live_set_read).await {
                Verdict::Deaf
            } else {
                Verdict::Dead
            };
            // A node that heard none of them is decided for the rest of the sweep; one that
            // heard some is in the middle of a change and is offered the next batch again.
            if members.len() == before {
                sweep.verdicts.insert(node.to_owned(), verdict);
            }
            decided.insert(node, verdict);
        }
    }
    for (node, members) in by_node {
        match decided.get(node) {
            Some(Verdict::Deaf) => {
                tracing::debug!(%node, resources = members.len(),
                    "node heartbeats but does not listen; beats put back after the sweep");
                sweep.put_back.entry(key.to_owned()).or_default().extend(
                    members
                        .iter()
                        .map(|(_, score, m)| ((*m).to_owned(), *score)),
                );
            }
            Some(Verdict::Dead) => orphans.extend(members.iter().filter_map(|(jid, score, _)| {
                Some(Orphan {
                    node: node.to_owned(),
                    jid: crate::protocol::jid::parse_full(jid).ok()?,
                    score: *score,
                })
            })),
            None => {}
        }
    }
    announce_orphans(life, link, conn, orphans).await;
    if !own_done.is_empty() {
        let mut c = redis::cmd("EVAL");
        c.arg(REMOVE_UNCHANGED).arg(1).arg(key);
        for (member, score) in own_done {
            c.arg(member).arg(score);
        }
        c.query_async::<i64>(conn).await?;
    }
    Ok(own)
}

/// Of the hand-offs to `node` (its `members`, in the order published), those its node
/// received are its node's now, followed until it acts on them; the members left are those
/// it did not hear. `heard`: the publications' replies (how many received each).
fn keep_unheard(
    live: &crate::liveness::Liveness,
    node: &str,
    members: &mut Vec<(&str, i64, &str)>,
    heard: &mut impl Iterator<Item = redis::Value>,
) {
    let before = members.len();
    let now = live.clock.now_ms();
    let mut unheard = Vec::with_capacity(before);
    let mut handed = Vec::new();
    for m in members.drain(..) {
        let n = heard.next().map(|v| redis::from_redis_value::<i64>(&v));
        if !matches!(n, Some(Ok(n)) if n > 0) {
            unheard.push(m);
        } else if let Ok(jid) = crate::protocol::jid::parse_full(m.0) {
            handed.push(Handed {
                node: node.to_owned(),
                jid,
                score: m.1,
                at_ms: now,
            });
        }
    }
    *members = unheard;
    live.metrics
        .handed_off
        .fetch_add((before - members.len()) as u64, Ordering::Relaxed);
    live.note_handed(handed);
}

/// The hand-offs of earlier sweeps (their node heard them; the sweep took their beats out
/// of Redis). One settles when its node has acted on it: its beat is back in the ZSET (the
/// sweeps own it again) or its directory entry is gone or names another node (its session
/// ended, and was announced there, or moved). One whose node is no longer live without
/// having acted is announced here, as the resource of a dead node it is; one whose node
/// stays live is followed for at most 3T. One pipeline per sweep while any are open.
async fn follow_up_handed(
    life: &Arc<Lifecycle>,
    link: &RedisLink,
    conn: &mut Conn,
    sweep: &mut Sweep,
) -> redis::RedisResult<()> {
    let live = &life.liveness;
    let open = live.take_handed();
    if open.is_empty() {
        return Ok(());
    }
    let mut pipe = SlotPipe::new();
    for h in &open {
        let beats = live.keys.beats_for(h.jid.to_bare().as_str());
        let mut c = redis::cmd("ZSCORE");
        c.arg(&beats).arg(live.keys.member(&h.node, &h.jid));
        pipe.add(&beats, c);
        let (key, c) = life.cluster.last_entry_read(&h.jid);
        pipe.add(&key, c);
    }
    let replies = match pipe.query(conn).await {
        Ok(values) => values,
        Err(e) => {
            live.note_handed(open);
            return Err(e);
        }
    };
    let horizon = live.clock.now_ms() - 3 * live.timings.ttl.as_millis() as i64;
    let mut still_open = Vec::new();
    let mut orphans = Vec::new();
    for (i, h) in open.into_iter().enumerate() {
        let beat: Option<f64> = replies
            .get(2 * i)
            .and_then(|v| redis::from_redis_value(v).ok().flatten());
        if beat.is_some() {
            continue;
        }
        let Some(entry) = replies.get(2 * i + 1).and_then(Cluster::last_entry_of) else {
            continue;
        };
        if crate::cluster::directory::node_of(&entry.instance) != h.node {
            continue;
        }
        if still_live(life, &h.node, &mut sweep.live_set_read).await {
            if h.at_ms >= horizon {
                still_open.push(h);
            }
            continue;
        }
        tracing::debug!(jid = %h.jid, node = %h.node,
            "sweeper: node died after hearing a stale resource, before acting on it");
        orphans.push(Orphan {
            node: h.node,
            jid: h.jid,
            score: h.score,
        });
    }
    live.note_handed(still_open);
    announce_orphans(life, link, conn, orphans).await;
    Ok(())
}

/// Listens on this node's channel for stale resources other nodes' sweepers found
/// (`<last beat> <full JID>`), and handles them like its own. Reconnects with backoff.
pub async fn listen(life: Arc<Lifecycle>) {
    let live = &life.liveness;
    let Some(link) = live.redis() else {
        return;
    };
    let Some(target) = link.target().cloned() else {
        return;
    };
    let channel = live.keys.node_channel(&live.node_id);
    let handler = life.clone();
    crate::cluster::pubsub::subscribe(
        target,
        channel,
        link.timeout(),
        life.reconnect_max,
        life.shutdown.clone(),
        |text| {
            let life = handler.clone();
            async move {
                let mut orphans = Vec::new();
                for line in text.lines() {
                    let Some((score, jid)) = line.split_once(' ') else {
                        continue;
                    };
                    let Ok(score) = score.parse::<i64>() else {
                        continue;
                    };
                    if let Stale::Orphan(o) = stale_here(&life.liveness, jid, score) {
                        orphans.push(o);
                    }
                }
                if orphans.is_empty() {
                    return;
                }
                let Some(link) = life.liveness.redis() else {
                    return;
                };
                if let Some(mut conn) = link.conn().await {
                    announce_orphans(&life, link, &mut conn, orphans).await;
                }
            }
        },
    )
    .await;
}

/// Stale resources with no session on this node (their node crashed): tell each user's
/// local contacts and resources that it is unavailable, and record its last beat as last
/// seen. RFC 6121 §4.5.2: the server generates the unavailable when the client could not.
///
/// Nothing is said for a resource that is back, here or on a live node (its resource key,
/// read for the whole batch in one pipeline per slot, names another node than the dead
/// one): it is online, and an unavailable would contradict what its contacts were just
/// shown. The rest are announced `sweep_concurrency` at a time; who receives each
/// unavailable is [`crate::services::presence::unavailable_of_lost`]'s decision, from inputs read
/// for the whole batch: the directory entries in the same pipeline as the resource keys.
/// So a batch costs one Redis round trip per slot for those, and each announcement its
/// own gate read.
async fn announce_orphans(
    life: &Arc<Lifecycle>,
    link: &RedisLink,
    conn: &mut Conn,
    mut orphans: Vec<Orphan>,
) {
    orphans.retain(|o| {
        let back = life.sessions.get(&o.jid).is_some();
        if back {
            tracing::debug!(jid = %o.jid, "sweeper: stale beat of a resource that is back here");
        }
        !back
    });
    if orphans.is_empty() {
        return;
    }
    // Per orphan its resource key and its directory entry: both have the user's bare JID
    // as hash tag, so a batch is one pipeline per slot on a Redis Cluster.
    let keys = &life.liveness.keys;
    let mut pipe = SlotPipe::new();
    for o in &orphans {
        let key = keys.resource(&o.jid);
        let mut c = redis::cmd("GET");
        c.arg(&key);
        pipe.add(&key, c);
        let (key, c) = life.cluster.last_entry_read(&o.jid);
        pipe.add(&key, c);
    }
    let replies = match pipe.query(conn).await {
        Ok(values) => values,
        Err(e) => {
            // Unknown: announcing is what the resources' own node would have done.
            link.failed(&e).await;
            Vec::new()
        }
    };
    let lost: Vec<(Orphan, Option<Entry>)> = orphans
        .into_iter()
        .enumerate()
        .filter_map(|(i, o)| {
            let holder: Option<String> = replies
                .get(2 * i)
                .and_then(|v| redis::from_redis_value(v).ok().flatten());
            match holder {
                Some(n) if n != o.node => {
                    tracing::debug!(jid = %o.jid, holder = %n, "sweeper: stale beat of a resource back on a live node");
                    None
                }
                _ => {
                    let last = replies.get(2 * i + 1).and_then(Cluster::last_entry_of);
                    Some((o, last))
                }
            }
        })
        .collect();
    if lost.is_empty() {
        return;
    }
    // Each announcement reads its own gate inputs, `sweep_concurrency` at a time, under its
    // subject's lock: the reads run on the pool's connections side by side, where one
    // statement for the whole batch made every announcement wait for one backend
    // (BENCHMARKS-ARCHIVE.md, "Cluster").
    // Tasks, not futures of this one: the announcements run on every worker thread.
    let limit = life.liveness.sweep_concurrency();
    let mut running = tokio::task::JoinSet::new();
    for (o, last) in lost {
        if running.len() >= limit {
            running.join_next().await;
        }
        running.spawn(announce_lost(life.clone(), o, last));
    }
    while running.join_next().await.is_some() {}
}

async fn announce_lost(life: Arc<Lifecycle>, o: Orphan, last: Option<Entry>) {
    let Orphan { jid, score, .. } = o;
    tracing::info!(%jid, last_beat = score, "sweeper: resource of no live node");
    let bare = jid.to_bare();
    // Its last seen to each other node, its directory entry, one message of unavailables.
    let ops = life.cluster.peers().len() + 2;
    life.cluster.wait_for_room(ops).await;
    life.cluster.seen(bare.as_str(), score);
    life.presence.unavailable_of_lost(&jid, last.as_ref()).await;
    life.liveness.last_seen.push(crate::store::LastSeen {
        jid: bare,
        at: chrono::DateTime::from_timestamp_millis(score).unwrap_or_else(chrono::Utc::now),
        status: None,
    });
}
