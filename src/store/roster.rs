//! Roster items and XEP-0237 versions (tables `roster_items`, `roster_versions`,
//! `roster_tombstones`).
//!
//! Versions and tombstones are maintained by triggers in the schema; the methods here
//! read the version the trigger produced in the same transaction as the change. What a
//! diff since a version holds, and the order of a subscription change's writes, are
//! decided once for both stores ([`changes_since`] over their [`DiffSql`] reads,
//! [`write_items`] over their [`ItemSql`] writes).
//!
//! Size: every write that creates an item goes through [`upsert`], which refuses one
//! beyond `max_roster_items`, so a roster set, an outbound subscribe and an approval share
//! one check. The size of one item is checked where a client supplies it (the roster set,
//! `crate::services::roster`); items stored before those limits existed are served cut to them (the
//! first `max_roster_groups` groups, names cut to their length), so what one roster get
//! costs stays bounded, and the next change of such an item stores it cut.

use std::time::Duration;

use sqlx::postgres::PgRow;
use sqlx::Row;

use super::pending::{PendingChange, PendingSql, PendingWrite};
use super::{
    pg_or_sqlite, stored_jid, RosterChange, RosterItem, Store, StoreError, StoreLimits,
    Subscription,
};

/// The columns [`item_from_row`] reads, of the table aliased `ri`. Only the first
/// `max_roster_groups` groups leave the database: an item stored before that limit existed
/// may hold thousands.
pub(super) fn item_columns(limits: &StoreLimits) -> String {
    format!(
        "ri.contact, ri.name, (ri.groups)[1:{}] AS groups, ri.subscription, ri.ask, \
         ri.pending_in, ri.preapproved",
        limits.max_roster_groups
    )
}

pub(super) fn item_from_row(
    owner: &str,
    row: &PgRow,
    limits: &StoreLimits,
) -> Result<Option<RosterItem>, StoreError> {
    let groups: Vec<String> = row.try_get("groups")?;
    item_from_columns(owner, row, groups, limits)
}

/// An item of `owner` from the columns both backends name alike (`groups` is decoded by
/// the caller, its column type being the dialect's), cut to the limits; `None` (left out)
/// when its contact is no JID ([`super::stored_jid`]).
pub(super) fn item_from_columns<'r, R>(
    owner: &str,
    row: &'r R,
    groups: Vec<String>,
    limits: &StoreLimits,
) -> Result<Option<RosterItem>, StoreError>
where
    R: Row,
    usize: sqlx::ColumnIndex<R>,
    for<'a> &'a str: sqlx::ColumnIndex<R>,
    String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    &'r str: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    bool: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    // Borrowed from the row: the parsed JID is the item's only copy of the contact (a
    // K = 300 login reads 300 of these, and each short-lived copy is an allocation).
    let contact: &str = row.try_get("contact")?;
    let Some(contact) = stored_jid("roster_items", owner, contact) else {
        return Ok(None);
    };
    let subscription: &str = row.try_get("subscription")?;
    let ask: Option<&str> = row.try_get("ask")?;
    let mut item = RosterItem {
        contact,
        name: row.try_get("name")?,
        groups,
        subscription: Subscription::parse(subscription)
            .ok()
            .ok_or_else(|| StoreError::Corrupt(format!("subscription {subscription:?}")))?,
        pending_out: ask.is_some(),
        pending_in: row.try_get("pending_in")?,
        preapproved: row.try_get("preapproved")?,
    };
    item.clamp_to(limits);
    Ok(Some(item))
}

/// Items changed and removed since a version, each with its version, as the changes
/// XEP-0237 §2.4 pushes: oldest first. A tombstone whose contact is no JID is left out
/// ([`super::stored_jid`]), as its item was.
pub(super) fn in_version_order(
    owner: &str,
    changed: Vec<(i64, RosterItem)>,
    removed: Vec<(String, i64)>,
) -> Vec<RosterChange> {
    let mut changes: Vec<(i64, RosterChange)> = Vec::with_capacity(changed.len() + removed.len());
    changes.extend(
        changed
            .into_iter()
            .map(|(v, i)| (v, RosterChange::Upsert(i))),
    );
    changes.extend(removed.into_iter().filter_map(|(contact, v)| {
        let contact = stored_jid("roster_tombstones", owner, &contact)?;
        Some((v, RosterChange::Removed(contact)))
    }));
    changes.sort_by_key(|(v, _)| *v);
    changes.into_iter().map(|(_, c)| c).collect()
}

/// Whether changes since a client's `version` can be told (XEP-0237 §2.4) from a roster
/// at version `current` whose tombstones below `floor` are pruned: not newer than the
/// roster, nor older than what its tombstones still cover. Otherwise the client gets the
/// whole roster.
pub(super) fn diffable(version: i64, floor: i64, current: i64) -> bool {
    floor <= version && version <= current
}

/// `s` cut to at most `max` characters.
pub(crate) fn truncate_chars(s: &mut String, max: usize) {
    if let Some((at, _)) = s.char_indices().nth(max) {
        s.truncate(at);
    }
}

impl RosterItem {
    /// Cuts an item to the per-item limits: at most `max_roster_groups` groups, each name
    /// cut to its length (a cut that makes two groups equal keeps one, RFC 6121 §2.1.2.3
    /// groups being distinct).
    pub fn clamp_to(&mut self, limits: &StoreLimits) {
        if let Some(name) = &mut self.name {
            truncate_chars(name, limits.max_roster_name_length);
        }
        self.groups.truncate(limits.max_roster_groups);
        let mut kept: Vec<String> = Vec::with_capacity(self.groups.len());
        for mut g in std::mem::take(&mut self.groups) {
            truncate_chars(&mut g, limits.max_roster_group_length);
            if !kept.contains(&g) {
                kept.push(g);
            }
        }
        self.groups = kept;
    }
}

/// The one rule of the roster size, as SQL over the placeholders given (both dialects):
/// an item may be written when it exists already or the owner's roster has room for one
/// more than `max_roster_items` allows; otherwise the write fails with
/// [`StoreError::RosterFull`], whoever makes it (RFC 6121 §2.3.3 leaves the size to the
/// server).
pub(super) fn roster_has_room(owner: &str, contact: &str, max: &str) -> String {
    format!(
        "(EXISTS (SELECT 1 FROM roster_items WHERE owner = {owner} AND contact = {contact}) \
          OR (SELECT count(*) FROM roster_items WHERE owner = {owner}) < {max})"
    )
}

/// Inserts or replaces one item; returns the owner's roster version after the change.
/// Must run inside a transaction: it locks the owner's version row first, so the count it
/// checks cannot change before the insert (a concurrent write of the same owner waits).
/// Fails with [`StoreError::RosterFull`] when the item is new and the roster already holds
/// `max_items`.
async fn upsert(
    conn: &mut sqlx::PgConnection,
    owner: &str,
    item: &RosterItem,
    max_items: i64,
) -> Result<i64, StoreError> {
    // The same row the version trigger updates, so this adds no new lock order.
    sqlx::query("SELECT 1 FROM roster_versions WHERE owner = $1 FOR UPDATE")
        .bind(owner)
        .execute(&mut *conn)
        .await?;
    let version: Option<i64> = sqlx::query_scalar(&format!(
        "INSERT INTO roster_items
             (owner, contact, name, groups, subscription, ask, pending_in, preapproved)
         SELECT $1, $2, $3, $4, $5, $6, $7, $8
         WHERE {}
         ON CONFLICT (owner, contact) DO UPDATE
             SET name = EXCLUDED.name, groups = EXCLUDED.groups,
                 subscription = EXCLUDED.subscription, ask = EXCLUDED.ask,
                 pending_in = EXCLUDED.pending_in, preapproved = EXCLUDED.preapproved
         RETURNING version",
        roster_has_room("$1", "$2", "$9")
    ))
    .bind(owner)
    .bind(item.contact.as_str())
    .bind(&item.name)
    .bind(item.groups.as_slice())
    .bind(item.subscription.as_str())
    .bind(item.pending_out.then_some("subscribe"))
    .bind(item.pending_in)
    .bind(item.preapproved)
    .bind(max_items)
    .fetch_optional(&mut *conn)
    .await?;
    version.ok_or(StoreError::RosterFull)
}

/// The reads of a roster diff (XEP-0237 §2.4) on one backend's connection, inside the
/// caller's snapshot; [`changes_since`] is the rule that uses them.
pub(super) trait DiffSql {
    /// `owner`'s current version and floor, `None` when it has no roster row.
    async fn bounds(&mut self, owner: &str) -> Result<Option<(i64, i64)>, StoreError>;
    /// `owner`'s items changed after `version`, each with its version, cut to `limits`.
    async fn changed_since(
        &mut self,
        owner: &str,
        version: i64,
        limits: &StoreLimits,
    ) -> Result<Vec<(i64, RosterItem)>, StoreError>;
    /// `owner`'s tombstones after `version`, as (contact, version).
    async fn removed_since(
        &mut self,
        owner: &str,
        version: i64,
    ) -> Result<Vec<(String, i64)>, StoreError>;
}

/// What a client holding roster `version` is told (XEP-0237 §2.3), from the roster's
/// `(current, floor)` bounds alone ([`DiffSql::bounds`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Since {
    /// The whole roster: no roster row, or a version that cannot be diffed ([`diffable`]).
    Whole,
    /// Nothing: its version is the current one. This is the usual login of a client that
    /// keeps the roster, so it reads no item and no tombstone.
    Unchanged(i64),
    /// The items and tombstones after its version, up to the current one.
    Diff(i64),
}

/// The one rule of [`Since`].
pub(super) fn since(version: i64, bounds: Option<(i64, i64)>) -> Since {
    match bounds {
        Some((current, floor)) if diffable(version, floor, current) => {
            if version == current {
                Since::Unchanged(current)
            } else {
                Since::Diff(current)
            }
        }
        _ => Since::Whole,
    }
}

/// [`Store::roster_since`] inside the caller's snapshot.
pub(super) async fn changes_since<C: DiffSql>(
    conn: &mut C,
    owner: &str,
    version: i64,
    limits: &StoreLimits,
) -> Result<Option<(i64, Vec<RosterChange>)>, StoreError> {
    let current = match since(version, conn.bounds(owner).await?) {
        Since::Whole => return Ok(None),
        Since::Unchanged(current) => return Ok(Some((current, Vec::new()))),
        Since::Diff(current) => current,
    };
    let changed = conn.changed_since(owner, version, limits).await?;
    let removed = conn.removed_since(owner, version).await?;
    Ok(Some((current, in_version_order(owner, changed, removed))))
}

impl DiffSql for sqlx::PgConnection {
    async fn bounds(&mut self, owner: &str) -> Result<Option<(i64, i64)>, StoreError> {
        Ok(
            sqlx::query_as("SELECT version, floor FROM roster_versions WHERE owner = $1")
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
            "SELECT {}, ri.version FROM roster_items ri
             WHERE ri.owner = $1 AND ri.version > $2",
            item_columns(limits)
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
            "SELECT contact, version FROM roster_tombstones WHERE owner = $1 AND version > $2",
        )
        .bind(owner)
        .bind(version)
        .fetch_all(&mut *self)
        .await?)
    }
}

/// The item writes of a subscription change on one backend's connection, inside the
/// caller's transaction; [`write_items`] is the rule that uses them.
pub(super) trait ItemSql {
    /// Holds the writers of each of `owners` (sorted, distinct) off until the transaction
    /// ends, taken in that order so two opposite changes between the same users cannot
    /// deadlock.
    async fn lock_owners(&mut self, owners: &[&str]) -> Result<(), StoreError>;
    /// Inserts or replaces one item; the owner's version after it, or
    /// [`StoreError::RosterFull`] for a new item beyond `max_items` ([`roster_has_room`]).
    async fn upsert_item(
        &mut self,
        owner: &str,
        item: &RosterItem,
        max_items: i64,
    ) -> Result<i64, StoreError>;
}

/// Upserts `changes` (in lock order) and applies `pending` inside the caller's
/// transaction, every owner concerned held first; the version after each change, in the
/// same order.
pub(super) async fn write_items<C: ItemSql + PendingSql>(
    conn: &mut C,
    changes: &[(&str, &RosterItem)],
    max_items: i64,
    pending: &[PendingWrite<'_>],
    max_pending: i64,
) -> Result<Vec<i64>, StoreError> {
    // Every owner's writers, the pending requests' owners' too, in one order.
    let mut owners: Vec<&str> = changes.iter().map(|(o, _)| *o).collect();
    owners.extend(pending.iter().map(|p| p.owner));
    owners.sort_unstable();
    owners.dedup();
    conn.lock_owners(&owners).await?;
    let mut versions = Vec::with_capacity(changes.len());
    for (owner, item) in changes {
        versions.push(conn.upsert_item(owner, item, max_items).await?);
    }
    super::pending::write_all(conn, pending, max_pending).await?;
    Ok(versions)
}

impl ItemSql for sqlx::PgConnection {
    async fn lock_owners(&mut self, owners: &[&str]) -> Result<(), StoreError> {
        sqlx::query(
            "SELECT 1 FROM roster_versions WHERE owner = ANY($1) ORDER BY owner FOR UPDATE",
        )
        .bind(owners)
        .execute(&mut *self)
        .await?;
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

/// Starts a read-only transaction that sees one snapshot, so a version and the items
/// read after it agree.
async fn snapshot(
    pool: &sqlx::PgPool,
) -> Result<sqlx::Transaction<'_, sqlx::Postgres>, StoreError> {
    let mut tx = pool.begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .execute(&mut *tx)
        .await?;
    Ok(tx)
}

impl Store {
    /// The whole roster of `owner` and its current version (0 and no items if the owner
    /// has no account). Items are ordered by contact.
    pub async fn roster(&self, owner: &str) -> Result<(i64, Vec<RosterItem>), StoreError> {
        // One statement sees one snapshot, so the version and the items agree without a
        // transaction (it was five round trips: begin, set isolation, two selects, commit).
        // A login's roster get reads `Store::login_roster` instead, which is this with the
        // gate's inputs. The outer join yields one row with NULL item
        // columns for an empty roster.
        let limits = self.limits();
        let pool = pg_or_sqlite!(self, |db| db.roster(owner, &limits));
        let rows = sqlx::query(&format!(
            "SELECT v.roster_version, {}
             FROM (SELECT coalesce((SELECT version FROM roster_versions WHERE owner = $1), 0)
                          AS roster_version) v
             LEFT JOIN roster_items ri ON ri.owner = $1
             ORDER BY ri.contact",
            item_columns(&limits)
        ))
        .bind(owner)
        .fetch_all(pool)
        .await?;
        let version: i64 = match rows.first() {
            Some(r) => r.try_get("roster_version")?,
            None => 0,
        };
        let mut items = Vec::with_capacity(rows.len());
        for row in &rows {
            let contact: Option<String> = row.try_get("contact")?;
            if contact.is_some() {
                items.extend(item_from_row(owner, row, &limits)?);
            }
        }
        Ok((version, items))
    }

    /// Changes after `version` (XEP-0237 §2.4), oldest first, with the current version.
    /// None when `version` is not one this roster can diff from (newer than current,
    /// older than the tombstone floor, or from a previous incarnation of the account):
    /// the caller then sends the full roster.
    pub async fn roster_since(
        &self,
        owner: &str,
        version: i64,
    ) -> Result<Option<(i64, Vec<RosterChange>)>, StoreError> {
        // The bounds first, in one statement: a client whose version is current (XEP-0237
        // §2.3, RFC 6121 §2.6.3: the usual login of a client that keeps its roster) is
        // answered from them, and one that gets the whole roster needs no snapshot either.
        // Only a diff opens the snapshot, which reads the bounds again with the changes.
        match since(version, self.roster_version(owner).await?) {
            Since::Whole => return Ok(None),
            Since::Unchanged(current) => return Ok(Some((current, Vec::new()))),
            Since::Diff(_) => {}
        }
        let limits = self.limits();
        let pool = pg_or_sqlite!(self, |db| db.roster_since(owner, version, &limits));
        let mut tx = snapshot(pool).await?;
        let since = changes_since(&mut *tx, owner, version, &limits).await?;
        if since.is_some() {
            tx.commit().await?;
        }
        Ok(since)
    }

    /// The current version and the tombstone floor of `owner`'s roster (XEP-0237), `None`
    /// when it has no roster row (no account). One statement.
    pub async fn roster_version(&self, owner: &str) -> Result<Option<(i64, i64)>, StoreError> {
        let pool = pg_or_sqlite!(self, |db| db.roster_version(owner));
        let mut conn = pool.acquire().await?;
        conn.bounds(owner).await
    }

    /// One item of `owner`'s roster, if present.
    pub async fn roster_item(
        &self,
        owner: &str,
        contact: &str,
    ) -> Result<Option<RosterItem>, StoreError> {
        let limits = self.limits();
        let pool = pg_or_sqlite!(self, |db| db.roster_item(owner, contact, &limits));
        let row = sqlx::query(&format!(
            "SELECT {} FROM roster_items ri WHERE ri.owner = $1 AND ri.contact = $2",
            item_columns(&limits)
        ))
        .bind(owner)
        .bind(contact)
        .fetch_optional(pool)
        .await?;
        Ok(match row {
            Some(r) => item_from_row(owner, &r, &limits)?,
            None => None,
        })
    }

    /// Number of items, so the caller can enforce the configured roster size limit.
    pub async fn roster_count(&self, owner: &str) -> Result<i64, StoreError> {
        let pool = pg_or_sqlite!(self, |db| db.roster_count(owner));
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM roster_items WHERE owner = $1")
            .bind(owner)
            .fetch_one(pool)
            .await?;
        Ok(n)
    }

    /// Adds or replaces an item and returns the new roster version. Fails with
    /// [`StoreError::NoSuchAccount`] for a non-local owner, [`StoreError::Constraint`]
    /// for a state RFC 6121 Appendix A does not have and [`StoreError::RosterFull`] for a
    /// new item beyond `max_roster_items`.
    pub async fn upsert_roster_item(
        &self,
        owner: &str,
        item: &RosterItem,
    ) -> Result<i64, StoreError> {
        // Drops the gate's cached inputs this write may alter, on every way out.
        let _forget = self.forget_owners([owner]);
        let max_items = self.limits().max_roster_items;
        let pool = pg_or_sqlite!(self, "upsert_roster_item", |db| async {
            Ok(db
                .upsert_roster_items(&[(owner, item)], max_items, &[], 0)
                .await?[0])
        });
        let mut tx = pool.begin().await?;
        let version = upsert(&mut tx, owner, item, max_items).await?;
        tx.commit().await?;
        Ok(version)
    }

    /// Removes an item, leaving a tombstone; returns the new roster version, or None if
    /// there was no such item (nothing changes then).
    pub async fn remove_roster_item(
        &self,
        owner: &str,
        contact: &str,
    ) -> Result<Option<i64>, StoreError> {
        // Drops the gate's cached inputs this write may alter, on every way out.
        let _forget = self.forget_owners([owner]);
        let pool = pg_or_sqlite!(self, |db| db.remove_roster_item(owner, contact));
        let mut tx = pool.begin().await?;
        let deleted = sqlx::query("DELETE FROM roster_items WHERE owner = $1 AND contact = $2")
            .bind(owner)
            .bind(contact)
            .execute(&mut *tx)
            .await?;
        if deleted.rows_affected() == 0 {
            return Ok(None);
        }
        let version: i64 =
            sqlx::query_scalar("SELECT version FROM roster_versions WHERE owner = $1")
                .bind(owner)
                .fetch_one(&mut *tx)
                .await?;
        tx.commit().await?;
        Ok(Some(version))
    }

    /// Deletes tombstones of items removed more than `older_than` ago, and raises each
    /// affected owner's floor to the newest version pruned, so clients holding an older
    /// version get the full roster instead of a diff that misses removals. Returns the
    /// number of tombstones deleted. Run it periodically with the configured retention.
    pub async fn prune_roster_tombstones(&self, older_than: Duration) -> Result<u64, StoreError> {
        let pool = pg_or_sqlite!(self, |db| db.prune_roster_tombstones(older_than));
        let pruned: i64 = sqlx::query_scalar(
            "WITH pruned AS (
                 DELETE FROM roster_tombstones
                 WHERE removed_at < now() - $1 * interval '1 second'
                 RETURNING owner, version
             ), raised AS (
                 UPDATE roster_versions rv SET floor = GREATEST(rv.floor, p.version)
                 FROM (SELECT owner, max(version) AS version FROM pruned GROUP BY owner) p
                 WHERE rv.owner = p.owner
             )
             SELECT count(*) FROM pruned",
        )
        .bind(older_than.as_secs_f64())
        .fetch_one(pool)
        .await?;
        Ok(u64::try_from(pruned).unwrap_or(0))
    }

    /// Upserts several items, possibly of several owners, in ONE transaction: for a
    /// subscription between two local users both sides change together or not at all.
    /// Returns each distinct owner (in order of first appearance) with its roster version
    /// after all of its changes. A change that would add an item to a full roster fails
    /// the whole call with [`StoreError::RosterFull`], so neither side changes.
    pub async fn apply_subscription_change(
        &self,
        changes: &[(String, RosterItem)],
    ) -> Result<Vec<(String, i64)>, StoreError> {
        self.write_subscription_change(changes, &[]).await
    }

    /// [`Store::apply_subscription_change`] with the waiting requests that go with it
    /// (RFC 6121 §3.1.3), in the same transaction: a request is kept or dropped exactly
    /// when the items change.
    pub async fn write_subscription_change(
        &self,
        changes: &[(String, RosterItem)],
        pending: &[PendingChange<'_>],
    ) -> Result<Vec<(String, i64)>, StoreError> {
        // Drops the gate's cached inputs this write may alter, on every way out.
        let _forget = self.forget_owners(changes.iter().map(|(o, _)| o.as_str()));
        self.calls.count("write_subscription_change");
        // Lock owners' version rows in a fixed order so two opposite changes between the
        // same users cannot deadlock; a stable sort keeps each owner's changes in order.
        let mut order: Vec<usize> = (0..changes.len()).collect();
        order.sort_by(|&a, &b| changes[a].0.cmp(&changes[b].0));

        let max_items = self.limits().max_roster_items;
        let (pending, max_pending) = self.pending_writes(pending);
        let mut versions: Vec<Option<i64>> = vec![None; changes.len()];
        let ordered: Vec<(&str, &RosterItem)> = order
            .iter()
            .map(|&i| (changes[i].0.as_str(), &changes[i].1))
            .collect();
        let written = match &self.backend {
            super::Backend::Postgres(pool) => {
                let mut tx = pool.begin().await?;
                let written =
                    write_items(&mut *tx, &ordered, max_items, &pending, max_pending).await?;
                tx.commit().await?;
                written
            }
            super::Backend::Sqlite(db) => db
                .upsert_roster_items(&ordered, max_items, &pending, max_pending)
                .await
                .map_err(|e| db.name_file(e))?,
        };
        for (&i, v) in order.iter().zip(written) {
            versions[i] = Some(v);
        }

        let mut result: Vec<(String, i64)> = Vec::new();
        for &i in &order {
            let Some(v) = versions[i] else { continue };
            let owner = &changes[i].0;
            match result.iter_mut().find(|(o, _)| o == owner) {
                // Later changes of the same owner carry higher versions.
                Some(entry) => entry.1 = entry.1.max(v),
                None => result.push((owner.clone(), v)),
            }
        }
        // Report in order of first appearance in `changes`.
        result.sort_by_key(|(o, _)| changes.iter().position(|(c, _)| c == o));
        Ok(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A roster at version 7 with floor 3, one changed item and one tombstone after 5;
    /// what was read, in order.
    #[derive(Default)]
    struct Rows {
        asked: Vec<&'static str>,
    }

    impl DiffSql for Rows {
        async fn bounds(&mut self, owner: &str) -> Result<Option<(i64, i64)>, StoreError> {
            self.asked.push("bounds");
            Ok((owner == "u@h").then_some((7, 3)))
        }

        async fn changed_since(
            &mut self,
            _owner: &str,
            _version: i64,
            _limits: &StoreLimits,
        ) -> Result<Vec<(i64, RosterItem)>, StoreError> {
            self.asked.push("changed");
            let contact = crate::protocol::jid::parse_bare("c@x").unwrap();
            Ok(vec![(7, RosterItem::new(contact))])
        }

        async fn removed_since(
            &mut self,
            _owner: &str,
            _version: i64,
        ) -> Result<Vec<(String, i64)>, StoreError> {
            self.asked.push("removed");
            Ok(vec![("r@x".to_owned(), 6)])
        }
    }

    /// Writes of items and requests in memory: what was asked, in order.
    #[derive(Default)]
    struct Writes {
        asked: Vec<String>,
    }

    impl ItemSql for Writes {
        async fn lock_owners(&mut self, owners: &[&str]) -> Result<(), StoreError> {
            self.asked.push(format!("lock {}", owners.join(" ")));
            Ok(())
        }

        async fn upsert_item(
            &mut self,
            owner: &str,
            _item: &RosterItem,
            _max_items: i64,
        ) -> Result<i64, StoreError> {
            self.asked.push(format!("upsert {owner}"));
            Ok(i64::try_from(self.asked.len()).unwrap())
        }
    }

    impl PendingSql for Writes {
        async fn lock_owner(&mut self, _owner: &str) -> Result<(), StoreError> {
            Ok(())
        }

        async fn insert_if_room(
            &mut self,
            owner: &str,
            sender: &str,
            _stanza: &str,
            _max: i64,
        ) -> Result<bool, StoreError> {
            self.asked.push(format!("keep {owner} {sender}"));
            Ok(true)
        }

        async fn is_waiting(&mut self, _owner: &str, _sender: &str) -> Result<bool, StoreError> {
            Ok(false)
        }

        async fn delete(&mut self, owner: &str, sender: &str) -> Result<bool, StoreError> {
            self.asked.push(format!("drop {owner} {sender}"));
            Ok(true)
        }
    }

    #[tokio::test]
    async fn every_owner_is_held_once_in_order_before_items_then_requests_are_written() {
        let item = RosterItem::new(crate::protocol::jid::parse_bare("c@x").unwrap());
        let changes = [("b@h", &item), ("b@h", &item), ("c@h", &item)];
        let pending = [PendingWrite {
            owner: "a@h",
            sender: "c@x",
            keep: Some("<presence/>".to_owned()),
        }];
        let mut w = Writes::default();
        let versions = write_items(&mut w, &changes, 10, &pending, 10)
            .await
            .unwrap();
        assert_eq!(versions, [2, 3, 4]);
        assert_eq!(
            w.asked,
            [
                "lock a@h b@h c@h",
                "upsert b@h",
                "upsert b@h",
                "upsert c@h",
                "keep a@h c@x"
            ]
        );
    }

    #[tokio::test]
    async fn a_diff_is_read_only_for_a_diffable_version_and_comes_oldest_first() {
        let limits = StoreLimits::default();
        let mut rows = Rows::default();
        let (current, changes) = changes_since(&mut rows, "u@h", 5, &limits)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(current, 7);
        assert!(matches!(
            &changes[..],
            [RosterChange::Removed(_), RosterChange::Upsert(_)]
        ));
        assert_eq!(rows.asked, ["bounds", "changed", "removed"]);
        // The current version: nothing to tell, and nothing read but the bounds.
        let mut rows = Rows::default();
        let (current, changes) = changes_since(&mut rows, "u@h", 7, &limits)
            .await
            .unwrap()
            .unwrap();
        assert_eq!((current, changes.len()), (7, 0));
        assert_eq!(rows.asked, ["bounds"]);
        for (owner, version) in [("u@h", 2), ("u@h", 8), ("nobody@h", 5)] {
            let mut rows = Rows::default();
            let since = changes_since(&mut rows, owner, version, &limits).await;
            assert!(since.unwrap().is_none(), "{owner} {version}");
            assert_eq!(rows.asked, ["bounds"]);
        }
    }

    #[test]
    fn a_version_is_diffed_only_from_the_floor_up_to_the_current_version() {
        // Floor 3, current 7: 3 ..= 7 can be told their changes.
        for v in 3..=7 {
            assert!(diffable(v, 3, 7), "{v}");
        }
        // Older than the pruned tombstones, or newer than the roster (another
        // incarnation of the account): the whole roster.
        assert!(!diffable(2, 3, 7));
        assert!(!diffable(8, 3, 7));
        assert!(diffable(0, 0, 0));
    }

    #[test]
    fn only_the_current_version_is_unchanged() {
        assert_eq!(since(7, Some((7, 3))), Since::Unchanged(7));
        assert_eq!(since(5, Some((7, 3))), Since::Diff(7));
        assert_eq!(since(2, Some((7, 3))), Since::Whole);
        assert_eq!(since(8, Some((7, 3))), Since::Whole);
        assert_eq!(since(0, None), Since::Whole, "no roster row");
    }
}
