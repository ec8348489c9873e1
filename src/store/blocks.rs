//! Block lists (XEP-0191), table `blocklist`.
//!
//! Entries are normalised JID strings of any form XEP-0191 allows: full JID, bare JID,
//! domain, or domain/resource. Whether a given sender is blocked is decided by the JID
//! matching rules of XEP-0016 §2.1, which XEP-0191 §6 adopts; see [`match_candidates`].
//!
//! Each change is one transaction (a block's bound is checked in it, [`add`], the one rule
//! for both stores over their [`BlockSql`] statements); a trigger sends
//! `NOTIFY presenced_block, '<owner>'` for every change so other nodes drop their caches.
//! Empty item lists change nothing here: XEP-0191 gives `<unblock/>` without items the
//! meaning "unblock all", and the caller picks [`Store::unblock_all`] for that.

use ::jid::Jid;

use super::{pg_or_sqlite, stored_jid, Store, StoreError};

/// Block-list entries of `owner` as read, in their order; one that is no JID is left out
/// ([`stored_jid`]). The one reading of entries for both stores.
pub(super) fn entries(owner: &str, rows: Vec<String>) -> Vec<Jid> {
    rows.iter()
        .filter_map(|e| stored_jid("blocklist", owner, e))
        .collect()
}

/// The block-list entries that would match `jid`, in the order XEP-0016 §2.1 checks
/// them: the full JID, the bare JID, domain/resource, the domain. An entry blocks `jid`
/// exactly when it equals one of these strings.
///
/// So a domain entry blocks the domain and every user and resource on it, a bare entry
/// blocks every resource of that user, and a full entry only that resource. A
/// domain/resource entry matches that resource of any JID on the domain, following the
/// order list of §2.1 literally (so `conference.example/nick` blocks that nickname in
/// every room of the service). `jid` must be normalised (as stored); it is split at the
/// first '/' (the resource may contain '@' and '/') and then at '@'.
pub fn match_candidates(jid: &str) -> Vec<String> {
    let (bare, resource) = match jid.split_once('/') {
        Some((bare, resource)) => (bare, Some(resource)),
        None => (jid, None),
    };
    let domain = match bare.split_once('@') {
        Some((_, domain)) => domain,
        None => bare,
    };
    let mut out: Vec<String> = Vec::with_capacity(4);
    let mut push = |s: String| {
        if !out.contains(&s) {
            out.push(s);
        }
    };
    push(jid.to_owned());
    push(bare.to_owned());
    if let Some(resource) = resource {
        push(format!("{domain}/{resource}"));
    }
    push(domain.to_owned());
    out
}

/// The statements of a block on one backend's connection, inside the caller's
/// transaction; [`add`] is the rule that uses them.
pub(super) trait BlockSql {
    /// Holds `owner`'s other writers off until the transaction ends, so the count cannot
    /// change between the check and the insert.
    async fn lock_owner(&mut self, owner: &str) -> Result<(), StoreError>;
    /// How many entries `owner`'s list would hold with `jids` added.
    async fn count_with(&mut self, owner: &str, jids: &[String]) -> Result<i64, StoreError>;
    /// Adds those of `jids` not on the list yet; those, in any order.
    async fn insert_new(&mut self, owner: &str, jids: &[String])
        -> Result<Vec<String>, StoreError>;
}

/// [`Store::block`] inside the caller's transaction: the entries added, in any order, or
/// [`StoreError::BlocklistFull`] (nothing added) when the list would hold more than `max`.
pub(super) async fn add<C: BlockSql>(
    conn: &mut C,
    owner: &str,
    jids: &[String],
    max: i64,
) -> Result<Vec<String>, StoreError> {
    conn.lock_owner(owner).await?;
    if conn.count_with(owner, jids).await? > max {
        return Err(StoreError::BlocklistFull);
    }
    conn.insert_new(owner, jids).await
}

impl BlockSql for sqlx::PgConnection {
    async fn lock_owner(&mut self, owner: &str) -> Result<(), StoreError> {
        // The owner's version row, which serialises writers of the same owner.
        sqlx::query("SELECT 1 FROM roster_versions WHERE owner = $1 FOR UPDATE")
            .bind(owner)
            .execute(&mut *self)
            .await?;
        Ok(())
    }

    async fn count_with(&mut self, owner: &str, jids: &[String]) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM blocklist WHERE owner = $1)
                  + (SELECT count(DISTINCT b) FROM unnest($2::text[]) AS b
                     WHERE NOT EXISTS (SELECT 1 FROM blocklist
                                       WHERE owner = $1 AND blocked = b))",
        )
        .bind(owner)
        .bind(jids)
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
             SELECT DISTINCT $1, b FROM unnest($2::text[]) AS b
             ON CONFLICT (owner, blocked) DO NOTHING
             RETURNING blocked",
        )
        .bind(owner)
        .bind(jids)
        .fetch_all(&mut *self)
        .await?)
    }
}

impl Store {
    /// Adds `jids` to `owner`'s block list and returns those that were not on it yet
    /// (sorted), which are the ones to announce in the XEP-0191 §3.3 block push.
    /// A JID the schema refuses fails the whole call with [`StoreError::Constraint`];
    /// an owner that is no account gives [`StoreError::NoSuchAccount`]; a list that would
    /// hold more than `max_blocklist_items` entries gives [`StoreError::BlocklistFull`]
    /// and nothing is added.
    pub async fn block(&self, owner: &str, jids: &[String]) -> Result<Vec<Jid>, StoreError> {
        // Drops the gate's cached inputs this write may alter, on every way out.
        let _forget = self.forget_naming(owner.to_owned());
        if jids.is_empty() {
            return Ok(Vec::new());
        }
        let max = i64::try_from(self.limits().max_blocklist_items).unwrap_or(i64::MAX);
        let pool = pg_or_sqlite!(self, |db| db.block(owner, jids, max));
        let mut tx = pool.begin().await?;
        let mut added = add(&mut *tx, owner, jids, max).await?;
        tx.commit().await?;
        added.sort();
        Ok(entries(owner, added))
    }

    /// Removes `jids` from `owner`'s block list and returns those that were on it
    /// (sorted), for the XEP-0191 §3.4 unblock push.
    pub async fn unblock(&self, owner: &str, jids: &[String]) -> Result<Vec<Jid>, StoreError> {
        // Drops the gate's cached inputs this write may alter, on every way out.
        let _forget = self.forget_naming(owner.to_owned());
        if jids.is_empty() {
            return Ok(Vec::new());
        }
        let pool = pg_or_sqlite!(self, |db| db.unblock(owner, jids));
        let mut removed: Vec<String> = sqlx::query_scalar(
            "DELETE FROM blocklist WHERE owner = $1 AND blocked = ANY($2::text[])
             RETURNING blocked",
        )
        .bind(owner)
        .bind(jids)
        .fetch_all(pool)
        .await?;
        removed.sort();
        Ok(entries(owner, removed))
    }

    /// Empties `owner`'s block list (XEP-0191 §3.5, `<unblock/>` without items) and
    /// returns what it held (sorted).
    pub async fn unblock_all(&self, owner: &str) -> Result<Vec<Jid>, StoreError> {
        // Drops the gate's cached inputs this write may alter, on every way out.
        let _forget = self.forget_naming(owner.to_owned());
        let pool = pg_or_sqlite!(self, |db| db.unblock_all(owner));
        let mut removed: Vec<String> =
            sqlx::query_scalar("DELETE FROM blocklist WHERE owner = $1 RETURNING blocked")
                .bind(owner)
                .fetch_all(pool)
                .await?;
        removed.sort();
        Ok(entries(owner, removed))
    }

    /// `owner`'s block list, sorted (the XEP-0191 §3.2 answer, and what nodes cache).
    pub async fn blocklist(&self, owner: &str) -> Result<Vec<Jid>, StoreError> {
        let pool = pg_or_sqlite!(self, |db| db.blocklist(owner));
        let list =
            sqlx::query_scalar("SELECT blocked FROM blocklist WHERE owner = $1 ORDER BY blocked")
                .bind(owner)
                .fetch_all(pool)
                .await?;
        Ok(entries(owner, list))
    }

    /// Whether `owner` blocks `candidate` (a normalised full, bare or domain JID), by the
    /// XEP-0016 §2.1 matching rules of [`match_candidates`]. Asked in both directions it
    /// gives the two flags of `policy::privacy::Blocks`.
    pub async fn is_blocked(&self, owner: &str, candidate: &str) -> Result<bool, StoreError> {
        let forms = match_candidates(candidate);
        let pool = pg_or_sqlite!(self, |db| db.is_blocked(owner, &forms));
        let blocked: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM blocklist WHERE owner = $1 AND blocked = ANY($2::text[]))",
        )
        .bind(owner)
        .bind(&forms)
        .fetch_one(pool)
        .await?;
        Ok(blocked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block list in memory, and what was asked in which order.
    #[derive(Default)]
    struct Rows {
        list: Vec<String>,
        asked: Vec<&'static str>,
    }

    impl BlockSql for Rows {
        async fn lock_owner(&mut self, _owner: &str) -> Result<(), StoreError> {
            self.asked.push("lock");
            Ok(())
        }

        async fn count_with(&mut self, _owner: &str, jids: &[String]) -> Result<i64, StoreError> {
            self.asked.push("count");
            let mut all = self.list.clone();
            all.extend(jids.iter().cloned());
            all.sort();
            all.dedup();
            Ok(i64::try_from(all.len()).unwrap())
        }

        async fn insert_new(
            &mut self,
            _owner: &str,
            jids: &[String],
        ) -> Result<Vec<String>, StoreError> {
            self.asked.push("insert");
            let mut added = Vec::new();
            for j in jids {
                if !self.list.contains(j) && !added.contains(j) {
                    added.push(j.clone());
                }
            }
            self.list.extend(added.iter().cloned());
            Ok(added)
        }
    }

    #[tokio::test]
    async fn a_block_is_counted_under_the_owners_lock_and_one_that_overfills_adds_nothing() {
        let mut rows = Rows::default();
        let jids = ["a@x".to_owned(), "b@x".to_owned()];
        assert_eq!(add(&mut rows, "u@h", &jids, 2).await.unwrap(), jids);
        assert_eq!(rows.asked, ["lock", "count", "insert"]);
        // Entries already there count once.
        let again = ["b@x".to_owned()];
        assert!(add(&mut rows, "u@h", &again, 2).await.unwrap().is_empty());
        rows.asked.clear();
        let third = ["c@x".to_owned()];
        let full = add(&mut rows, "u@h", &third, 2).await;
        assert!(matches!(full, Err(StoreError::BlocklistFull)));
        assert_eq!(rows.asked, ["lock", "count"]);
        assert_eq!(rows.list, jids);
    }

    #[test]
    fn candidates_follow_the_xep0016_order_for_every_jid_form() {
        let cases: [(&str, &[&str]); 4] = [
            (
                "juliet@capulet.example/balcony",
                &[
                    "juliet@capulet.example/balcony",
                    "juliet@capulet.example",
                    "capulet.example/balcony",
                    "capulet.example",
                ],
            ),
            (
                "juliet@capulet.example",
                &["juliet@capulet.example", "capulet.example"],
            ),
            (
                "capulet.example/admin",
                &["capulet.example/admin", "capulet.example"],
            ),
            ("capulet.example", &["capulet.example"]),
        ];
        for (jid, want) in cases {
            assert_eq!(match_candidates(jid), want.to_vec(), "{jid}");
        }
    }

    #[test]
    fn a_resource_containing_at_and_slash_stays_one_resource() {
        assert_eq!(
            match_candidates("romeo@montague.example/a@b/c"),
            vec![
                "romeo@montague.example/a@b/c",
                "romeo@montague.example",
                "montague.example/a@b/c",
                "montague.example",
            ]
        );
    }
}
