//! Last seen: queued once per ended session, written to PostgreSQL in one statement per
//! flush (at most one per `last_seen_flush`, default 1 s, per node), read back for XEP-0012
//! jabber:iq:last and the XEP-0203 delay on unavailable probe answers.
//!
//! Entries not yet flushed are served from memory, so a query right after a session ended
//! already sees it. A failed flush keeps its entries (newer wins) and retries next time, so a
//! PostgreSQL outage delays last seen but never blocks a session.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::Duration;

use crate::store::LastSeen;

/// XEP-0012 namespace.
pub const NS_LAST: &str = "jabber:iq:last";

/// Most entries kept while PostgreSQL is down; beyond this the oldest news is dropped.
const MAX_PENDING: usize = 100_000;

/// Pending last-seen entries, keyed by bare JID (newest wins).
#[derive(Debug, Default)]
pub struct Batcher {
    pending: Mutex<HashMap<String, LastSeen>>,
    inflight: Mutex<HashMap<String, LastSeen>>,
    /// Session ends another node of the cluster reported: served like pending ones (that
    /// node writes them), so a query here right after such an end sees it before the other
    /// node's flush reaches PostgreSQL. Bounded; never written from here.
    elsewhere: Mutex<HashMap<String, LastSeen>>,
}

fn merge(map: &mut HashMap<String, LastSeen>, e: LastSeen) {
    match map.get(e.jid.as_str()) {
        Some(old) if old.at >= e.at => {}
        _ => {
            map.insert(e.jid.to_string(), e);
        }
    }
}

impl Batcher {
    /// Queues one session end.
    pub fn push(&self, e: LastSeen) {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if p.len() >= MAX_PENDING && !p.contains_key(e.jid.as_str()) {
            tracing::warn!("last-seen queue full; dropping an entry");
            return;
        }
        merge(&mut p, e);
    }

    /// A session end another node reported (it queues and writes the entry itself).
    pub fn note_elsewhere(&self, e: LastSeen) {
        let mut m = self.elsewhere.lock().unwrap_or_else(|e| e.into_inner());
        if m.len() >= MAX_PENDING && !m.contains_key(e.jid.as_str()) {
            // Long written by their nodes by now: PostgreSQL has them.
            m.clear();
        }
        merge(&mut m, e);
    }

    /// The newest not-yet-written entry for `bare` (or one another node reported).
    pub fn get(&self, bare: &str) -> Option<LastSeen> {
        [&self.pending, &self.inflight, &self.elsewhere]
            .iter()
            .filter_map(|m| {
                m.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(bare)
                    .cloned()
            })
            .max_by_key(|e| e.at)
    }

    /// Writes everything pending in one statement. Returns the number of entries written.
    pub async fn flush(&self, store: &crate::store::Store, m: &super::Metrics) -> usize {
        let batch: Vec<LastSeen> = {
            let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            if p.is_empty() {
                return 0;
            }
            let taken = std::mem::take(&mut *p);
            let mut inf = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
            for (_, e) in taken {
                merge(&mut inf, e);
            }
            inf.values().cloned().collect()
        };
        let res = tokio::time::timeout(
            Duration::from_secs(10),
            store.record_last_seen_batch(&batch),
        )
        .await;
        match res {
            Ok(Ok(_)) => {
                m.pg_writes.fetch_add(1, Ordering::Relaxed);
                m.pg_rows.fetch_add(batch.len() as u64, Ordering::Relaxed);
                self.inflight
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clear();
                batch.len()
            }
            failed => {
                m.pg_errors.fetch_add(1, Ordering::Relaxed);
                let why = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => "timed out".into(),
                };
                tracing::warn!(entries = batch.len(), error = %why, "last-seen flush failed; will retry");
                // Keep them in flight; the next flush sends them again with newer ones.
                0
            }
        }
    }
}

/// When local user `bare` was last seen: the newest of what waits to be written and what
/// PostgreSQL has. `None` if unknown or the database cannot be asked.
pub async fn when(
    live: &super::Liveness,
    store: &crate::store::Store,
    bare: &str,
) -> Option<LastSeen> {
    let mem = live.last_seen.get(bare);
    let db = match tokio::time::timeout(Duration::from_secs(2), store.last_seen(bare)).await {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            tracing::warn!(user = bare, error = %e, "last seen unavailable");
            None
        }
        Err(_) => None,
    };
    match (mem, db) {
        (Some(a), Some(b)) => Some(if a.at >= b.at { a } else { b }),
        (a, b) => a.or(b),
    }
}
