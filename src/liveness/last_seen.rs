//! Last seen: queued once per ended session, written to PostgreSQL in one statement per
//! flush (at most one per `last_seen_flush`, default 1 s, per node), read back for XEP-0012
//! jabber:iq:last and the XEP-0203 delay on unavailable probe answers.
//!
//! Entries not yet flushed are served from memory, so a query right after a session ended
//! already sees it. A failed flush keeps its entries (newer wins) and retries next time, so a
//! PostgreSQL outage delays last seen but never blocks a session.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::c2s::Session;
use crate::error::{iq_result, StanzaError};
use crate::jid::BareJid;
use crate::server::Shared;
use crate::store::LastSeen;
use crate::xml::Element;

/// XEP-0012 namespace.
pub const NS_LAST: &str = "jabber:iq:last";

/// Most entries kept while PostgreSQL is down; beyond this the oldest news is dropped.
const MAX_PENDING: usize = 100_000;

/// Pending last-seen entries, keyed by bare JID (newest wins).
#[derive(Debug, Default)]
pub struct Batcher {
    pending: Mutex<HashMap<String, LastSeen>>,
    inflight: Mutex<HashMap<String, LastSeen>>,
}

fn merge(map: &mut HashMap<String, LastSeen>, e: LastSeen) {
    match map.get(&e.jid) {
        Some(old) if old.at >= e.at => {}
        _ => {
            map.insert(e.jid.clone(), e);
        }
    }
}

impl Batcher {
    /// Queues one session end.
    pub fn push(&self, e: LastSeen) {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if p.len() >= MAX_PENDING && !p.contains_key(&e.jid) {
            tracing::warn!("last-seen queue full; dropping an entry");
            return;
        }
        merge(&mut p, e);
    }

    /// The newest not-yet-written entry for `bare`.
    pub fn get(&self, bare: &str) -> Option<LastSeen> {
        let a = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(bare)
            .cloned();
        let b = self
            .inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(bare)
            .cloned();
        match (a, b) {
            (Some(a), Some(b)) => Some(if a.at >= b.at { a } else { b }),
            (a, b) => a.or(b),
        }
    }

    /// Writes everything pending in one statement. Returns the number of entries written.
    pub async fn flush(&self, shared: &Shared) -> usize {
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
        let m = &shared.liveness.metrics;
        let res = tokio::time::timeout(
            Duration::from_secs(10),
            shared.store.record_last_seen_batch(&batch),
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

/// Flushes every `last_seen_flush`; at shutdown waits for grace periods, then flushes.
pub async fn run(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(shared.liveness.timings.flush);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shared.shutdown.cancelled() => break,
        }
        shared.liveness.last_seen.flush(&shared).await;
        shared
            .liveness
            .metrics
            .flush_rounds
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    shared.liveness.wait_grace(Duration::from_secs(3)).await;
    shared.liveness.last_seen.flush(&shared).await;
}

/// When local user `bare` was last seen: the newest of what waits to be written and what
/// PostgreSQL has. `None` if unknown or the database cannot be asked.
pub async fn when(shared: &Shared, bare: &str) -> Option<LastSeen> {
    let mem = shared.liveness.last_seen.get(bare);
    let db = match tokio::time::timeout(Duration::from_secs(2), shared.store.last_seen(bare)).await
    {
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

/// THE permission check for last activity: may `viewer` learn when `subject` was last
/// online? XEP-0012 §3: only an entity authorised to see the user's presence, normally via
/// a subscription (the subject's roster item for the viewer says `from` or `both`). The
/// user may always ask about their own account. The privacy gate adds the `last-seen`
/// setting, blocks and reciprocity (README, "Privacy").
pub async fn may_see_last_activity(shared: &Shared, viewer: &BareJid, subject: &BareJid) -> bool {
    // Settings, blocks and reciprocity, read fresh (subscription included).
    crate::presence::gate::may_see_last_seen(shared, viewer.as_str(), subject.as_str()).await
}

/// Answers `<iq type='get'><query xmlns='jabber:iq:last'/></iq>` addressed to local account
/// `subject` (XEP-0012 §3, offline user query).
pub async fn handle_iq(session: &Session, iq: &Element, subject: &BareJid) -> Element {
    let shared = &session.shared;
    let viewer = session.jid().to_bare();
    if !may_see_last_activity(shared, &viewer, subject).await {
        // XEP-0012 §3: not authorised → forbidden (also for unknown accounts, so existence
        // does not leak).
        return StanzaError::forbidden()
            .reply_to(iq)
            .unwrap_or_else(|| iq_result(iq));
    }
    // "Online now" (seconds='0') is the online signal: only for a viewer who may see it,
    // and never because of an invisible session; anyone else gets the offline answer.
    let online =
        crate::presence::gate::visible_to(shared, session.jid().as_str(), subject.as_str()).await;
    let query = Element::new("query", NS_LAST);
    if online {
        // XEP-0012 §3: a user with an available resource has been idle for 0 seconds here.
        return iq_result(iq).child(query.attr("seconds", "0"));
    }
    match when(shared, subject.as_str()).await {
        Some(ls) => {
            let secs = (shared.liveness.clock.now() - ls.at).num_seconds().max(0);
            let mut q = query.attr("seconds", secs.to_string());
            if let Some(status) = ls.status {
                q = q.text(status);
            }
            iq_result(iq).child(q)
        }
        None => StanzaError::item_not_found()
            .reply_to(iq)
            .unwrap_or_else(|| iq_result(iq)),
    }
}
