//! What the sweeper decides about a stale beat that names this node, from the liveness
//! state alone: the session here was ended (or is in its grace period, or is alive and only
//! its beat was late), or it ended here after that beat, or it died with an earlier run of
//! this node and is an orphan to announce. The in-process sweep is entirely this decision;
//! the Redis sweep (`services::lifecycle::sweeper`) makes it for this node's members and
//! announces the orphans, which needs the rest of the node.

use std::sync::atomic::Ordering;

use crate::protocol::jid::FullJid;

use super::{in_process, Liveness, Op, SweptLocal};

/// The in-process sweep: the same cutoff, batches and per-resource decision as in Redis.
/// Every entry is this node's, so each goes to [`handle_stale`] directly. It needs only the
/// liveness state (what it decides reaches the session through its end token), so the
/// liveness tests run it on paused time without a node. The sweeper
/// (`services::lifecycle::sweeper`) runs it every sweep period.
pub(crate) fn sweep_table(live: &Liveness, table: &in_process::Table) -> usize {
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
            handle_stale(live, &jid, score);
        }
        if !full {
            return total;
        }
    }
}

/// The in-process table's decision for one stale resource (every one is this node's).
fn handle_stale(live: &Liveness, jid: &str, score: i64) {
    if let Stale::Orphan(_) = stale_here(live, jid, score) {
        // In process every entry was written by this node for a session it tracks, so an
        // untracked one has no other node to belong to: its end was handled here.
        tracing::debug!(%jid, "sweeper: stale entry of a session no longer tracked");
    }
}

/// What became of a stale resource whose beat names this node.
pub(crate) enum Stale {
    /// A session here has it: ended, left to its grace task or rewritten (its beat is
    /// newer); that session's own write (end or refresh) takes care of the beat.
    Here,
    /// No session here has it, and one ended here after that beat (its unavailable went
    /// out then).
    EndedHere,
    /// No session here has it and none ended after that beat: its session died with an
    /// earlier run of this node.
    Orphan(Orphan),
}

/// Decides a stale resource whose beat names this node.
pub(crate) fn stale_here(live: &Liveness, jid: &str, score: i64) -> Stale {
    match live.swept_local(jid, score) {
        SweptLocal::Ended => {
            tracing::info!(%jid, last_beat = score, "sweeper: silent for longer than ttl");
            Stale::Here
        }
        SweptLocal::InGrace => Stale::Here,
        SweptLocal::Alive(beat) => {
            if let Ok(j) = crate::protocol::jid::parse_full(jid) {
                live.queue_op(Op::Refresh {
                    jid: j.into(),
                    beat_ms: beat,
                });
            }
            Stale::Here
        }
        SweptLocal::NotLocal if live.ended_here_after(jid, score) => Stale::EndedHere,
        SweptLocal::NotLocal => match crate::protocol::jid::parse_full(jid) {
            Ok(j) => Stale::Orphan(Orphan {
                node: live.node_id.clone(),
                jid: j,
                score,
            }),
            Err(_) => Stale::EndedHere,
        },
    }
}

/// A stale resource whose session is gone with its node (`node`: the one its beat named).
pub(crate) struct Orphan {
    pub(crate) node: String,
    pub(crate) jid: FullJid,
    pub(crate) score: i64,
}
