//! Block lists, privacy settings, waiting subscription requests, last seen and the
//! privacy gate's batched reads on SQLite (twins of `store/blocks.rs`, `privacy.rs`,
//! `pending.rs`, `last_seen.rs` and `gate_inputs.rs`). Lists travel as JSON arrays and are
//! expanded with `json_each`, where PostgreSQL takes a `text[]`. What is done with waiting
//! requests is decided in `pending.rs`; here are only their statements ([`PendingSql`]).

use super::{json_list, parse_list, parse_time, time_text, Pools};
use crate::policy::privacy::PrivacySettings;
use crate::protocol::jid::{BareJid, Jid};
use crate::store::blocks::{add, entries, BlockSql};
use crate::store::gate_inputs::{
    audience_roster, probe_rows, settings_from, subscription_from, AudienceInputs, ProbeSubject,
};
use crate::store::pending::{keep, PendingSql};
use crate::store::{stored_jid, LastSeen, StoreError};

/// The four settings columns as stored (lists as JSON).
type SettingsText = (
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
);

/// `owner`'s settings inside a read transaction (the defaults without a row of its own).
pub(super) async fn settings_of(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    owner: &str,
    defaults: &PrivacySettings,
) -> Result<PrivacySettings, StoreError> {
    let row: Option<(String, String, String, String)> = sqlx::query_as(
        "SELECT online, online_except, last_seen, last_seen_except
         FROM privacy_settings WHERE owner = ?1",
    )
    .bind(owner)
    .fetch_optional(&mut **tx)
    .await?;
    match row {
        None => Ok(defaults.clone()),
        Some((a, b, c, d)) => settings_from_text((Some(a), Some(b), Some(c), Some(d)), defaults),
    }
}

fn settings_from_text(
    cols: SettingsText,
    defaults: &PrivacySettings,
) -> Result<PrivacySettings, StoreError> {
    let list = |l: Option<String>| l.map(|t| parse_list(&t, "privacy exceptions")).transpose();
    settings_from((cols.0, list(cols.1)?, cols.2, list(cols.3)?), defaults)
}

/// The statements of a block (`store/blocks.rs` holds the rule).
impl BlockSql for sqlx::SqliteConnection {
    async fn lock_owner(&mut self, _owner: &str) -> Result<(), StoreError> {
        // The caller's write transaction holds the file's write lock already.
        Ok(())
    }

    async fn count_with(&mut self, owner: &str, jids: &[String]) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM blocklist WHERE owner = ?1)
                  + (SELECT count(DISTINCT j.value) FROM json_each(?2) j
                     WHERE NOT EXISTS (SELECT 1 FROM blocklist
                                       WHERE owner = ?1 AND blocked = j.value))",
        )
        .bind(owner)
        .bind(json_list(jids))
        .fetch_one(&mut *self)
        .await?)
    }

    async fn insert_new(
        &mut self,
        owner: &str,
        jids: &[String],
    ) -> Result<Vec<String>, StoreError> {
        Ok(sqlx::query_scalar(
            "INSERT INTO blocklist (owner, blocked)
             SELECT DISTINCT ?1, j.value FROM json_each(?2) j WHERE true
             ON CONFLICT (owner, blocked) DO NOTHING
             RETURNING blocked",
        )
        .bind(owner)
        .bind(json_list(jids))
        .fetch_all(&mut *self)
        .await?)
    }
}

impl Pools {
    pub(in crate::store) async fn block(
        &self,
        owner: &str,
        jids: &[String],
        max: i64,
    ) -> Result<Vec<Jid>, StoreError> {
        let mut tx = self.begin_write().await?;
        let mut added = add(&mut *tx, owner, jids, max).await?;
        tx.commit().await?;
        added.sort();
        Ok(entries(owner, added))
    }

    pub(in crate::store) async fn unblock(
        &self,
        owner: &str,
        jids: &[String],
    ) -> Result<Vec<Jid>, StoreError> {
        let mut removed: Vec<String> = sqlx::query_scalar(
            "DELETE FROM blocklist
             WHERE owner = ?1 AND blocked IN (SELECT value FROM json_each(?2))
             RETURNING blocked",
        )
        .bind(owner)
        .bind(json_list(jids))
        .fetch_all(&self.write)
        .await?;
        removed.sort();
        Ok(entries(owner, removed))
    }

    pub(in crate::store) async fn unblock_all(&self, owner: &str) -> Result<Vec<Jid>, StoreError> {
        let mut removed: Vec<String> =
            sqlx::query_scalar("DELETE FROM blocklist WHERE owner = ?1 RETURNING blocked")
                .bind(owner)
                .fetch_all(&self.write)
                .await?;
        removed.sort();
        Ok(entries(owner, removed))
    }

    pub(in crate::store) async fn blocklist(&self, owner: &str) -> Result<Vec<Jid>, StoreError> {
        let list =
            sqlx::query_scalar("SELECT blocked FROM blocklist WHERE owner = ?1 ORDER BY blocked")
                .bind(owner)
                .fetch_all(&self.read)
                .await?;
        Ok(entries(owner, list))
    }

    pub(in crate::store) async fn is_blocked(
        &self,
        owner: &str,
        forms: &[String],
    ) -> Result<bool, StoreError> {
        let blocked: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM blocklist
                            WHERE owner = ?1 AND blocked IN (SELECT value FROM json_each(?2)))",
        )
        .bind(owner)
        .bind(json_list(forms))
        .fetch_one(&self.read)
        .await?;
        Ok(blocked)
    }

    pub(in crate::store) async fn privacy_settings(
        &self,
        owner: &str,
        defaults: &PrivacySettings,
    ) -> Result<PrivacySettings, StoreError> {
        let row: Option<(String, String, String, String)> = sqlx::query_as(
            "SELECT online, online_except, last_seen, last_seen_except
             FROM privacy_settings WHERE owner = ?1",
        )
        .bind(owner)
        .fetch_optional(&self.read)
        .await?;
        match row {
            None => Ok(defaults.clone()),
            Some((a, b, c, d)) => {
                settings_from_text((Some(a), Some(b), Some(c), Some(d)), defaults)
            }
        }
    }

    pub(in crate::store) async fn set_privacy_settings(
        &self,
        owner: &str,
        online: (&str, Vec<&str>),
        last_seen: (&str, Vec<&str>),
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO privacy_settings (owner, online, online_except, last_seen, last_seen_except)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (owner) DO UPDATE
                 SET online = excluded.online, online_except = excluded.online_except,
                     last_seen = excluded.last_seen, last_seen_except = excluded.last_seen_except",
        )
        .bind(owner)
        .bind(online.0)
        .bind(json_list(&online.1))
        .bind(last_seen.0)
        .bind(json_list(&last_seen.1))
        .execute(&self.write)
        .await?;
        Ok(())
    }

    pub(in crate::store) async fn add_pending_subscription(
        &self,
        owner: &str,
        from: &str,
        stanza: &str,
        max: i64,
    ) -> Result<bool, StoreError> {
        let mut tx = self.begin_write().await?;
        let added = keep(&mut *tx, owner, from, stanza, max).await?;
        tx.commit().await?;
        Ok(added)
    }

    pub(in crate::store) async fn has_pending_subscription(
        &self,
        owner: &str,
        from: &str,
    ) -> Result<bool, StoreError> {
        let mut conn = self.read.acquire().await?;
        conn.is_waiting(owner, from).await
    }

    pub(in crate::store) async fn pending_subscriptions(
        &self,
        owner: &str,
        max: i64,
    ) -> Result<Vec<(String, String)>, StoreError> {
        // Times have millisecond precision here; the row id breaks ties in arrival order.
        let rows = sqlx::query_as(
            "SELECT sender, stanza FROM pending_subscriptions
             WHERE owner = ?1 ORDER BY received_at, rowid LIMIT ?2",
        )
        .bind(owner)
        .bind(max)
        .fetch_all(&self.read)
        .await?;
        Ok(rows)
    }

    pub(in crate::store) async fn remove_pending_subscription(
        &self,
        owner: &str,
        from: &str,
    ) -> Result<bool, StoreError> {
        let mut conn = self.write.acquire().await?;
        conn.delete(owner, from).await
    }

    pub(in crate::store) async fn record_last_seen_batch(
        &self,
        entries: &[LastSeen],
    ) -> Result<u64, StoreError> {
        let batch: Vec<(&str, String, Option<&str>)> = entries
            .iter()
            .map(|e| (e.jid.as_str(), time_text(e.at), e.status.as_deref()))
            .collect();
        let batch = serde_json::to_string(&batch)
            .map_err(|e| StoreError::Corrupt(format!("last-seen batch: {e}")))?;
        // One row per JID, the latest of the batch (SQLite takes the bare `status` from the
        // row that holds the max()); a row only ever moves forward in time.
        let result = sqlx::query(
            "WITH e AS (SELECT json_extract(value, '$[0]') AS jid,
                               json_extract(value, '$[1]') AS seen_at,
                               json_extract(value, '$[2]') AS status
                        FROM json_each(?1)),
                  latest AS (SELECT jid, max(seen_at) AS seen_at, status FROM e GROUP BY jid)
             INSERT INTO last_activity (jid, seen_at, status)
             SELECT l.jid, l.seen_at, l.status FROM latest l JOIN accounts a ON a.jid = l.jid
             WHERE true
             ON CONFLICT (jid) DO UPDATE
                 SET seen_at = excluded.seen_at, status = excluded.status
                 WHERE excluded.seen_at > last_activity.seen_at",
        )
        .bind(batch)
        .execute(&self.write)
        .await?;
        Ok(result.rows_affected())
    }

    pub(in crate::store) async fn last_seen(
        &self,
        jid: &str,
    ) -> Result<Option<LastSeen>, StoreError> {
        let row: Option<(String, String, Option<String>)> =
            sqlx::query_as("SELECT jid, seen_at, status FROM last_activity WHERE jid = ?1")
                .bind(jid)
                .fetch_optional(&self.read)
                .await?;
        let Some((stored, at, status)) = row else {
            return Ok(None);
        };
        let Some(jid) = stored_jid("last_activity", &stored, &stored) else {
            return Ok(None);
        };
        Ok(Some(LastSeen {
            jid,
            at: parse_time(&at)?,
            status,
        }))
    }

    pub(in crate::store) async fn audience_inputs(
        &self,
        subject: &str,
        subject_forms: &[String],
        defaults: &PrivacySettings,
    ) -> Result<AudienceInputs, StoreError> {
        let mut tx = self.read.begin().await?;
        let settings = settings_of(&mut tx, subject, defaults).await?;
        // substr(c, instr(c, '@') + 1) is the domain of a bare JID and the whole of a
        // domain JID, as match_candidates splits them.
        let rows: Vec<(String, String, bool, bool)> = sqlx::query_as(
            "SELECT ri.contact, ri.subscription,
                    EXISTS (SELECT 1 FROM blocklist b
                            WHERE b.owner = ri.contact
                              AND b.blocked IN (SELECT value FROM json_each(?2))),
                    EXISTS (SELECT 1 FROM blocklist b
                            WHERE b.owner = ri.owner
                              AND b.blocked IN (ri.contact,
                                                substr(ri.contact, instr(ri.contact, '@') + 1)))
             FROM roster_items ri WHERE ri.owner = ?1 ORDER BY ri.contact",
        )
        .bind(subject)
        .bind(json_list(subject_forms))
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        let roster = audience_roster(subject, rows)?;
        Ok(AudienceInputs { settings, roster })
    }

    pub(in crate::store) async fn probe_inputs(
        &self,
        prober: &str,
        prober_forms: &[String],
        subjects: &[&BareJid],
        defaults: &PrivacySettings,
    ) -> Result<Vec<ProbeSubject>, StoreError> {
        type Row = (
            Option<String>,
            Option<String>,
            Option<String>,
            Option<String>,
            Option<String>,
            bool,
            bool,
            Option<String>,
        );
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT ri.subscription,
                    ps.online, ps.online_except, ps.last_seen, ps.last_seen_except,
                    EXISTS (SELECT 1 FROM blocklist b
                            WHERE b.owner = s.value
                              AND b.blocked IN (SELECT value FROM json_each(?2))),
                    EXISTS (SELECT 1 FROM blocklist b
                            WHERE b.owner = ?1
                              AND b.blocked IN (s.value, substr(s.value, instr(s.value, '@') + 1))),
                    la.seen_at
             FROM json_each(?3) s
             LEFT JOIN roster_items ri ON ri.owner = s.value AND ri.contact = ?1
             LEFT JOIN privacy_settings ps ON ps.owner = s.value
             LEFT JOIN last_activity la ON la.jid = s.value
             ORDER BY s.key",
        )
        .bind(prober)
        .bind(json_list(prober_forms))
        .bind(json_list(
            &subjects.iter().map(|j| j.as_str()).collect::<Vec<_>>(),
        ))
        .fetch_all(&self.read)
        .await?;
        probe_rows(subjects, rows.len())?;
        rows.into_iter()
            .map(|(sub, a, b, c, d, bp, bbp, la)| {
                Ok(ProbeSubject {
                    subscription: sub.as_deref().map(subscription_from).transpose()?,
                    settings: settings_from_text((a, b, c, d), defaults)?,
                    blocks_prober: bp,
                    blocked_by_prober: bbp,
                    last_seen: la.as_deref().map(parse_time).transpose()?,
                })
            })
            .collect()
    }
}

/// The statements on waiting requests (`store/pending.rs` holds the rules).
impl PendingSql for sqlx::SqliteConnection {
    async fn lock_owner(&mut self, _owner: &str) -> Result<(), StoreError> {
        // The caller's write transaction holds the file's write lock already.
        Ok(())
    }

    async fn insert_if_room(
        &mut self,
        owner: &str,
        sender: &str,
        stanza: &str,
        max: i64,
    ) -> Result<bool, StoreError> {
        let result = sqlx::query(
            "INSERT INTO pending_subscriptions (owner, sender, stanza)
             SELECT ?1, ?2, ?3
             WHERE (SELECT count(*) FROM pending_subscriptions WHERE owner = ?1) < ?4
             ON CONFLICT (owner, sender) DO NOTHING",
        )
        .bind(owner)
        .bind(sender)
        .bind(stanza)
        .bind(max)
        .execute(&mut *self)
        .await?;
        Ok(result.rows_affected() == 1)
    }

    async fn is_waiting(&mut self, owner: &str, sender: &str) -> Result<bool, StoreError> {
        let found: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pending_subscriptions WHERE owner = ?1 AND sender = ?2)",
        )
        .bind(owner)
        .bind(sender)
        .fetch_one(&mut *self)
        .await?;
        Ok(found)
    }

    async fn delete(&mut self, owner: &str, sender: &str) -> Result<bool, StoreError> {
        let result =
            sqlx::query("DELETE FROM pending_subscriptions WHERE owner = ?1 AND sender = ?2")
                .bind(owner)
                .bind(sender)
                .execute(&mut *self)
                .await?;
        Ok(result.rows_affected() > 0)
    }
}
