//! The in-process liveness backend: what Redis holds for a cluster, held in this process for
//! a single node that runs without Redis (no `[redis] url`).
//!
//! It keeps the Redis backend's semantics with the same numbers, so a silent death is
//! announced within the same bounds (between T − H and T plus one sweep after the last
//! beat):
//!
//! ```text
//! Redis                                         in process
//! presence:{bare}:res:<r>  PXAT beat+T          entry <full JID> → last beat; expires at beat+T
//! presence:beats:<shard>   ZADD GT beat         the same entry, ordered by beat (never moved back)
//! sweeper: ZRANGEBYSCORE+ZREM ≤ now−T, batches  take_stale: entries ≤ now−T, same batches
//! ```
//!
//! Sessions still queue [`Op`]s (so the downsampling in [`super::LiveSession::refresh`] is
//! the same code for both backends) and a writer task applies them here; the sweeper takes
//! stale entries and hands each to the same decision as a Redis sweep
//! ([`super::Liveness::swept_local`]). What the table does not need: key expiry as such
//! (the sweeper removes what expired, and a session end removes its entry), pub/sub (there
//! is no other node) and repair (the table cannot be lost while the process lives; after a
//! restart every session reconnects and binds again).

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Mutex;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{Liveness, Op};

/// Live resources of this node with their newest beat (ms since the epoch).
#[derive(Debug, Default)]
pub struct Table {
    inner: Mutex<Entries>,
}

#[derive(Debug, Default)]
struct Entries {
    /// Full JID → newest beat: the resource key, alive until beat + T.
    beat: HashMap<String, i64>,
    /// The same entries ordered by beat: the beat set the sweeper reads oldest first.
    by_beat: BTreeSet<(i64, String)>,
}

impl Table {
    /// Applies one queued change. A refresh never moves a beat back (`ZADD GT`): a late
    /// write of an older beat cannot make a resource look staler than it is.
    pub fn apply(&self, op: &Op) {
        let mut e = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        match op {
            Op::Refresh { jid, beat_ms } => {
                let key = jid.as_str();
                match e.beat.get(key).copied() {
                    Some(old) if old >= *beat_ms => {}
                    old => {
                        if let Some(old) = old {
                            e.by_beat.remove(&(old, key.to_owned()));
                        }
                        e.beat.insert(key.to_owned(), *beat_ms);
                        e.by_beat.insert((*beat_ms, key.to_owned()));
                    }
                }
            }
            Op::Remove { jid } => {
                if let Some(old) = e.beat.remove(jid.as_str()) {
                    e.by_beat.remove(&(old, jid.to_string()));
                }
            }
        }
    }

    /// Takes out at most `batch` entries whose beat is at or before `cutoff_ms` (older than
    /// T), oldest first, as the Redis sweep script does: what is returned is removed, so
    /// each stale resource is handled once.
    pub fn take_stale(&self, cutoff_ms: i64, batch: usize) -> Vec<(String, i64)> {
        let mut e = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::new();
        while out.len() < batch {
            let Some((score, jid)) = e.by_beat.first().cloned() else {
                break;
            };
            if score > cutoff_ms {
                break;
            }
            e.by_beat.pop_first();
            e.beat.remove(&jid);
            out.push((jid, score));
        }
        out
    }

    /// The newest beat recorded for `jid`, if it has an entry.
    pub fn beat_of(&self, jid: &str) -> Option<i64> {
        let e = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        e.beat.get(jid).copied()
    }

    /// Number of entries (resources alive or not yet swept).
    pub fn len(&self) -> usize {
        let e = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        e.beat.len()
    }

    /// Whether the table holds no entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Applies queued ops to `table` until the queue closes or `stop` is cancelled. Each op is
/// one resource write in the counters, as for Redis.
pub async fn writer(
    live: &Liveness,
    table: &Table,
    mut rx: mpsc::Receiver<Op>,
    stop: CancellationToken,
) {
    let mut batch = Vec::with_capacity(256);
    loop {
        tokio::select! {
            n = rx.recv_many(&mut batch, 256) => {
                if n == 0 {
                    return;
                }
            }
            _ = stop.cancelled() => return,
        }
        for op in &batch {
            table.apply(op);
        }
        live.metrics
            .liveness_writes
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        batch.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refresh(j: &str, beat_ms: i64) -> Op {
        Op::Refresh {
            jid: crate::protocol::jid::parse_full(j).unwrap().into(),
            beat_ms,
        }
    }

    #[test]
    fn a_refresh_never_moves_a_beat_back_and_remove_forgets_the_entry() {
        let t = Table::default();
        t.apply(&refresh("a@x/r", 1000));
        t.apply(&refresh("a@x/r", 900));
        assert_eq!(t.beat_of("a@x/r"), Some(1000));
        t.apply(&refresh("a@x/r", 1500));
        assert_eq!(t.beat_of("a@x/r"), Some(1500));
        assert_eq!(
            t.len(),
            1,
            "one entry per resource, however often refreshed"
        );
        assert!(
            t.take_stale(1499, 10).is_empty(),
            "the old beat left no entry"
        );
        t.apply(&Op::Remove {
            jid: crate::protocol::jid::parse_full("a@x/r").unwrap(),
        });
        assert!(t.is_empty());
        assert!(t.take_stale(i64::MAX, 10).is_empty());
    }

    #[test]
    fn take_stale_returns_each_stale_entry_once_oldest_first_in_batches() {
        let t = Table::default();
        for i in 0..25 {
            t.apply(&refresh(&format!("u{i}@x/r"), 1000 + i));
        }
        t.apply(&refresh("fresh@x/r", 5000));
        let mut all = Vec::new();
        loop {
            let got = t.take_stale(2000, 7);
            assert!(got.len() <= 7);
            let full = got.len() == 7;
            all.extend(got);
            if !full {
                break;
            }
        }
        assert_eq!(all.len(), 25);
        assert!(all.windows(2).all(|w| w[0].1 <= w[1].1), "oldest first");
        assert_eq!(all[0], ("u0@x/r".to_owned(), 1000));
        assert_eq!(t.len(), 1);
        assert_eq!(t.beat_of("fresh@x/r"), Some(5000));
    }
}
