//! Roster items and XEP-0237 versions on SQLite (twin of `store/roster.rs`). Versions
//! and tombstones are kept by the schema's triggers, as in PostgreSQL.

use std::time::Duration;

use sqlx::sqlite::SqliteRow;
use sqlx::Row;

use super::{json_list, parse_list, Pools};
use crate::store::gate_inputs::LoginRoster;
use crate::store::pending::PendingWrite;
use crate::store::roster::{
    changes_since, item_from_columns, roster_has_room, write_items, DiffSql, ItemSql,
};
use crate::store::roster_admin::{room_query, AdminSql, HAD_ITEM};
use crate::store::{RosterChange, RosterItem, StoreError, StoreLimits};

pub(super) const ITEM_COLUMNS: &str =
    "ri.contact, ri.name, ri.groups, ri.subscription, ri.ask, ri.pending_in, ri.preapproved";

pub(super) fn item_from_row(
    owner: &str,
    row: &SqliteRow,
    limits: &StoreLimits,
) -> Result<Option<RosterItem>, StoreError> {
    let groups: String = row.try_get("groups")?;
    item_from_columns(owner, row, parse_list(&groups, "roster groups")?, limits)
}

/// Inserts or replaces one item inside a write transaction (which holds the file's write
/// lock, so the count cannot change before the insert); returns the owner's version
/// after it, or [`StoreError::RosterFull`] for a new item beyond `max_items`.
async fn upsert(
    conn: &mut sqlx::SqliteConnection,
    owner: &str,
    item: &RosterItem,
    max_items: i64,
) -> Result<i64, StoreError> {
    let written = sqlx::query(&format!(
        "INSERT INTO roster_items
             (owner, contact, name, groups, subscription, ask, pending_in, preapproved)
         SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8
         WHERE {}
         ON CONFLICT (owner, contact) DO UPDATE
             SET name = excluded.name, groups = excluded.groups,
                 subscription = excluded.subscription, ask = excluded.ask,
                 pending_in = excluded.pending_in, preapproved = excluded.preapproved",
        roster_has_room("?1", "?2", "?9")
    ))
    .bind(owner)
    .bind(item.contact.as_str())
    .bind(&item.name)
    .bind(json_list(&item.groups))
    .bind(item.subscription.as_str())
    .bind(item.pending_out.then_some("subscribe"))
    .bind(item.pending_in)
    .bind(item.preapproved)
    .bind(max_items)
    .execute(&mut *conn)
    .await?;
    if written.rows_affected() == 0 {
        return Err(StoreError::RosterFull);
    }
    // RETURNING would report the row as inserted, before the trigger set its version.
    let version: i64 =
        sqlx::query_scalar("SELECT version FROM roster_items WHERE owner = ?1 AND contact = ?2")
            .bind(owner)
            .bind(item.contact.as_str())
            .fetch_one(&mut *conn)
            .await?;
    Ok(version)
}

/// The item writes of a subscription change (`store/roster.rs` holds the rule).
impl ItemSql for sqlx::SqliteConnection {
    async fn lock_owners(&mut self, _owners: &[&str]) -> Result<(), StoreError> {
        // The caller's write transaction holds the file's write lock already.
        Ok(())
    }

    async fn upsert_item(
        &mut self,
        owner: &str,
        item: &RosterItem,
        max_items: i64,
    ) -> Result<i64, StoreError> {
        upsert(self, owner, item, max_items).await
    }
}

/// The reads of a roster diff (`store/roster.rs` holds the rule).
impl DiffSql for sqlx::SqliteConnection {
    async fn bounds(&mut self, owner: &str) -> Result<Option<(i64, i64)>, StoreError> {
        Ok(
            sqlx::query_as("SELECT version, floor FROM roster_versions WHERE owner = ?1")
                .bind(owner)
                .fetch_optional(&mut *self)
                .await?,
        )
    }

    async fn changed_since(
        &mut self,
        owner: &str,
        version: i64,
        limits: &StoreLimits,
    ) -> Result<Vec<(i64, RosterItem)>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {ITEM_COLUMNS}, ri.version FROM roster_items ri
             WHERE ri.owner = ?1 AND ri.version > ?2"
        ))
        .bind(owner)
        .bind(version)
        .fetch_all(&mut *self)
        .await?;
        let mut changed = Vec::with_capacity(rows.len());
        for row in &rows {
            if let Some(item) = item_from_row(owner, row, limits)? {
                changed.push((row.try_get("version")?, item));
            }
        }
        Ok(changed)
    }

    async fn removed_since(
        &mut self,
        owner: &str,
        version: i64,
    ) -> Result<Vec<(String, i64)>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT contact, version FROM roster_tombstones WHERE owner = ?1 AND version > ?2",
        )
        .bind(owner)
        .bind(version)
        .fetch_all(&mut *self)
        .await?)
    }
}

impl Pools {
    pub(in crate::store) async fn roster(
        &self,
        owner: &str,
        limits: &StoreLimits,
    ) -> Result<(i64, Vec<RosterItem>), StoreError> {
        // One read transaction is one snapshot: the version and the items agree.
        let mut tx = self.read.begin().await?;
        let version: Option<i64> =
            sqlx::query_scalar("SELECT version FROM roster_versions WHERE owner = ?1")
                .bind(owner)
                .fetch_optional(&mut *tx)
                .await?;
        let rows = sqlx::query(&format!(
            "SELECT {ITEM_COLUMNS} FROM roster_items ri WHERE ri.owner = ?1 ORDER BY ri.contact"
        ))
        .bind(owner)
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        let mut items = Vec::with_capacity(rows.len());
        for row in &rows {
            items.extend(item_from_row(owner, row, limits)?);
        }
        Ok((version.unwrap_or(0), items))
    }

    pub(in crate::store) async fn login_roster(
        &self,
        owner: &str,
        subject_forms: &[String],
        defaults: &crate::policy::privacy::PrivacySettings,
        limits: &StoreLimits,
    ) -> Result<LoginRoster, StoreError> {
        // One read transaction is one snapshot: version, settings and items agree.
        let mut tx = self.read.begin().await?;
        let version: Option<i64> =
            sqlx::query_scalar("SELECT version FROM roster_versions WHERE owner = ?1")
                .bind(owner)
                .fetch_optional(&mut *tx)
                .await?;
        let settings = super::lists::settings_of(&mut tx, owner, defaults).await?;
        // substr(c, instr(c, '@') + 1) is the domain of a bare JID and the whole of a
        // domain JID, as match_candidates splits them.
        let rows = sqlx::query(&format!(
            "SELECT {ITEM_COLUMNS},
                    EXISTS (SELECT 1 FROM blocklist b
                            WHERE b.owner = ri.contact
                              AND b.blocked IN (SELECT value FROM json_each(?2)))
                        AS blocks_subject,
                    EXISTS (SELECT 1 FROM blocklist b
                            WHERE b.owner = ri.owner
                              AND b.blocked IN (ri.contact,
                                                substr(ri.contact, instr(ri.contact, '@') + 1)))
                        AS blocked_by_subject
             FROM roster_items ri WHERE ri.owner = ?1 ORDER BY ri.contact"
        ))
        .bind(owner)
        .bind(super::json_list(subject_forms))
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        let mut login = LoginRoster {
            version: version.unwrap_or(0),
            ..LoginRoster::default()
        };
        login.settings = settings;
        login.reserve(rows.len());
        for row in &rows {
            login.push(
                item_from_row(owner, row, limits)?,
                row.try_get("blocks_subject")?,
                row.try_get("blocked_by_subject")?,
            );
        }
        Ok(login)
    }

    pub(in crate::store) async fn roster_version(
        &self,
        owner: &str,
    ) -> Result<Option<(i64, i64)>, StoreError> {
        let mut conn = self.read.acquire().await?;
        conn.bounds(owner).await
    }

    pub(in crate::store) async fn roster_since(
        &self,
        owner: &str,
        version: i64,
        limits: &StoreLimits,
    ) -> Result<Option<(i64, Vec<RosterChange>)>, StoreError> {
        let mut tx = self.read.begin().await?;
        let since = changes_since(&mut *tx, owner, version, limits).await?;
        if since.is_some() {
            tx.commit().await?;
        }
        Ok(since)
    }

    pub(in crate::store) async fn roster_item(
        &self,
        owner: &str,
        contact: &str,
        limits: &StoreLimits,
    ) -> Result<Option<RosterItem>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {ITEM_COLUMNS} FROM roster_items ri WHERE ri.owner = ?1 AND ri.contact = ?2"
        ))
        .bind(owner)
        .bind(contact)
        .fetch_optional(&self.read)
        .await?;
        Ok(match row {
            Some(r) => item_from_row(owner, &r, limits)?,
            None => None,
        })
    }

    pub(in crate::store) async fn roster_count(&self, owner: &str) -> Result<i64, StoreError> {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM roster_items WHERE owner = ?1")
            .bind(owner)
            .fetch_one(&self.read)
            .await?;
        Ok(n)
    }

    /// Upserts `changes` (already in lock order) and applies `pending` in one
    /// transaction; the version after each change, in the same order.
    pub(in crate::store) async fn upsert_roster_items(
        &self,
        changes: &[(&str, &RosterItem)],
        max_items: i64,
        pending: &[PendingWrite<'_>],
        max_pending: i64,
    ) -> Result<Vec<i64>, StoreError> {
        let mut tx = self.begin_write().await?;
        let versions = write_items(&mut *tx, changes, max_items, pending, max_pending).await?;
        tx.commit().await?;
        Ok(versions)
    }

    pub(in crate::store) async fn remove_roster_item(
        &self,
        owner: &str,
        contact: &str,
    ) -> Result<Option<i64>, StoreError> {
        let mut tx = self.begin_write().await?;
        let deleted = sqlx::query("DELETE FROM roster_items WHERE owner = ?1 AND contact = ?2")
            .bind(owner)
            .bind(contact)
            .execute(&mut *tx)
            .await?;
        if deleted.rows_affected() == 0 {
            return Ok(None);
        }
        let version: i64 =
            sqlx::query_scalar("SELECT version FROM roster_versions WHERE owner = ?1")
                .bind(owner)
                .fetch_one(&mut *tx)
                .await?;
        tx.commit().await?;
        Ok(Some(version))
    }

    pub(in crate::store) async fn prune_roster_tombstones(
        &self,
        older_than: Duration,
    ) -> Result<u64, StoreError> {
        let mut tx = self.begin_write().await?;
        // Stored removal times are the schema's default, strftime('%Y-%m-%dT%H:%M:%fZ').
        let cutoff: String = sqlx::query_scalar("SELECT strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?1)")
            .bind(format!("-{:.3} seconds", older_than.as_secs_f64()))
            .fetch_one(&mut *tx)
            .await?;
        sqlx::query(
            "UPDATE roster_versions
             SET floor = max(floor, (SELECT max(t.version) FROM roster_tombstones t
                                     WHERE t.owner = roster_versions.owner
                                       AND t.removed_at < ?1))
             WHERE owner IN (SELECT owner FROM roster_tombstones WHERE removed_at < ?1)",
        )
        .bind(&cutoff)
        .execute(&mut *tx)
        .await?;
        let pruned = sqlx::query("DELETE FROM roster_tombstones WHERE removed_at < ?1")
            .bind(&cutoff)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(pruned.rows_affected())
    }
}

/// The operators' roster operations' statements (`store/roster_admin.rs`); the file's
/// write lock, held by the caller's write transaction, holds every other writer off.
impl AdminSql for sqlx::SqliteConnection {
    async fn lock_owners(&mut self, _a: &str, _b: &str) -> Result<(), StoreError> {
        Ok(())
    }

    async fn has_room(&mut self, owner: &str, contact: &str, max: i64) -> Result<bool, StoreError> {
        Ok(sqlx::query_scalar(&room_query())
            .bind(owner)
            .bind(contact)
            .bind(max)
            .fetch_one(&mut *self)
            .await?)
    }

    async fn make_mutual(&mut self, a: &str, b: &str) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO presenced_roster_make_mutual (a, b) VALUES (?1, ?2)")
            .bind(a)
            .bind(b)
            .execute(&mut *self)
            .await?;
        Ok(())
    }

    async fn set_name(&mut self, a: &str, b: &str, name: &str) -> Result<(), StoreError> {
        sqlx::query("UPDATE roster_items SET name = ?3 WHERE owner = ?1 AND contact = ?2")
            .bind(a)
            .bind(b)
            .bind(name)
            .execute(&mut *self)
            .await?;
        Ok(())
    }

    async fn set_groups(&mut self, a: &str, b: &str, groups: &[String]) -> Result<(), StoreError> {
        sqlx::query("UPDATE roster_items SET groups = ?3 WHERE owner = ?1 AND contact = ?2")
            .bind(a)
            .bind(b)
            .bind(json_list(groups))
            .execute(&mut *self)
            .await?;
        Ok(())
    }

    async fn items_for(&mut self, a: &str, b: &str) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar(HAD_ITEM)
            .bind(a)
            .bind(b)
            .fetch_one(&mut *self)
            .await?)
    }

    async fn unpair(&mut self, a: &str, b: &str) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO presenced_roster_unpair (a, b) VALUES (?1, ?2)")
            .bind(a)
            .bind(b)
            .execute(&mut *self)
            .await?;
        Ok(())
    }
}
