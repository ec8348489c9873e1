//! Durable last activity (XEP-0012), table `last_activity`.
//!
//! Liveness lives in Redis while a user is online; when a session ends for good (after
//! the grace period, or when the sweeper finds a silent death) the liveness code queues a
//! [`LastSeen`] and flushes the queue with [`Store::record_last_seen_batch`]: one
//! statement per flush, however many users it carries, so writes follow session ends and
//! not heartbeats.

use chrono::{DateTime, Utc};

use ::jid::BareJid;

use super::{pg_or_sqlite, stored_jid, Store, StoreError};

/// When one account was last online, for XEP-0012 answers and last-seen stamps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastSeen {
    /// The account's bare JID.
    pub jid: BareJid,
    /// The close time of a clean close, or the last heartbeat of a silent death.
    pub at: DateTime<Utc>,
    /// Status text of the last unavailable presence (XEP-0012 §4 returns it as the
    /// query's text), if there was one.
    pub status: Option<String>,
}

impl Store {
    /// Writes a batch of session ends in ONE statement and returns how many accounts'
    /// rows changed.
    ///
    /// Newer wins: a row only moves forward in time, so a late or retried batch never
    /// replaces a newer value another node already wrote; within one batch the latest
    /// entry per JID is used. JIDs that are not accounts here (deleted meanwhile, or never
    /// local) are skipped, not an error, so one stale entry cannot sink a whole batch.
    pub async fn record_last_seen_batch(&self, entries: &[LastSeen]) -> Result<u64, StoreError> {
        if entries.is_empty() {
            return Ok(0);
        }
        let pool = pg_or_sqlite!(self, |db| db.record_last_seen_batch(entries));
        let jids: Vec<&str> = entries.iter().map(|e| e.jid.as_str()).collect();
        let times: Vec<DateTime<Utc>> = entries.iter().map(|e| e.at).collect();
        let statuses: Vec<Option<&str>> = entries.iter().map(|e| e.status.as_deref()).collect();
        // DISTINCT ON keeps one row per JID: ON CONFLICT DO UPDATE may not touch the same
        // row twice in one statement.
        let result = sqlx::query(
            "INSERT INTO last_activity AS la (jid, seen_at, status)
             SELECT DISTINCT ON (e.jid) e.jid, e.seen_at, e.status
             FROM unnest($1::text[], $2::timestamptz[], $3::text[]) AS e (jid, seen_at, status)
             JOIN accounts a ON a.jid = e.jid
             ORDER BY e.jid, e.seen_at DESC
             ON CONFLICT (jid) DO UPDATE
                 SET seen_at = EXCLUDED.seen_at, status = EXCLUDED.status
                 WHERE EXCLUDED.seen_at > la.seen_at",
        )
        .bind(&jids)
        .bind(&times)
        .bind(&statuses)
        .execute(pool)
        .await?;
        Ok(result.rows_affected())
    }

    /// When `jid` was last online, or `None` if it never ended a session (or is not an
    /// account). The caller decides with `policy::privacy` whether the asker may know.
    pub async fn last_seen(&self, jid: &str) -> Result<Option<LastSeen>, StoreError> {
        let pool = pg_or_sqlite!(self, |db| db.last_seen(jid));
        let row: Option<(String, DateTime<Utc>, Option<String>)> =
            sqlx::query_as("SELECT jid, seen_at, status FROM last_activity WHERE jid = $1")
                .bind(jid)
                .fetch_optional(pool)
                .await?;
        let Some((stored, at, status)) = row else {
            return Ok(None);
        };
        Ok(stored_jid("last_activity", &stored, &stored).map(|jid| LastSeen { jid, at, status }))
    }
}
