//! The operators' roster operations (`presenced roster add|remove`): the same SQL
//! operations an operator's migration uses (`presenced_roster_make_mutual`,
//! `presenced_roster_unpair`, migrations/0004 and their SQLite views), so the rule of what
//! "mutual contacts" means is written once, in the schema. The roster triggers bump both
//! owners' versions and announce the change like any other.
//!
//! What runs around those operations (the room check on both rosters, the name and groups,
//! what is returned) is written once too, in [`make_mutual`] and [`unpair`]; each backend
//! gives only its statements ([`AdminSql`], SQLite's in `sqlite/roster.rs`).

use super::{Backend, Store, StoreError};

/// The statements of the operators' roster operations on one backend's connection, inside
/// the caller's transaction.
pub(super) trait AdminSql {
    /// Holds both owners' roster writers off until the transaction ends, so a room check
    /// stays true until the write.
    async fn lock_owners(&mut self, a: &str, b: &str) -> Result<(), StoreError>;
    /// Whether `owner` may hold an item for `contact` ([`room_query`]).
    async fn has_room(&mut self, owner: &str, contact: &str, max: i64) -> Result<bool, StoreError>;
    /// `presenced_roster_make_mutual(a, b)`.
    async fn make_mutual(&mut self, a: &str, b: &str) -> Result<(), StoreError>;
    /// Sets the name `a` files `b` under.
    async fn set_name(&mut self, a: &str, b: &str, name: &str) -> Result<(), StoreError>;
    /// Sets the groups `a` files `b` under.
    async fn set_groups(&mut self, a: &str, b: &str, groups: &[String]) -> Result<(), StoreError>;
    /// How many items `a` has for `b` ([`HAD_ITEM`]).
    async fn items_for(&mut self, a: &str, b: &str) -> Result<i64, StoreError>;
    /// `presenced_roster_unpair(a, b)`.
    async fn unpair(&mut self, a: &str, b: &str) -> Result<(), StoreError>;
}

/// The roster-size rule ([`super::roster::roster_has_room`]) as one query over owner,
/// contact and bound. Both backends run this text: sqlx binds SQLite's `$N` parameters by
/// their number, as PostgreSQL does.
pub(super) fn room_query() -> String {
    format!(
        "SELECT {}",
        super::roster::roster_has_room("$1", "$2", "$3")
    )
}

/// How many items owner `$1` has for contact `$2` (0 or 1); both backends run this text.
pub(super) const HAD_ITEM: &str =
    "SELECT count(*) FROM roster_items WHERE owner = $1 AND contact = $2";

/// [`Store::roster_make_mutual`] inside the caller's transaction: a new item on a full
/// roster is refused by the rule every other roster write applies, read after the owners'
/// writers are held off.
async fn make_mutual<C: AdminSql>(
    conn: &mut C,
    a: &str,
    b: &str,
    name: Option<&str>,
    groups: &[String],
    max_items: i64,
) -> Result<(), StoreError> {
    conn.lock_owners(a, b).await?;
    for (owner, contact) in [(a, b), (b, a)] {
        if !conn.has_room(owner, contact, max_items).await? {
            return Err(StoreError::RosterFull);
        }
    }
    conn.make_mutual(a, b).await?;
    if let Some(name) = name {
        conn.set_name(a, b, name).await?;
    }
    if !groups.is_empty() {
        conn.set_groups(a, b, groups).await?;
    }
    Ok(())
}

/// [`Store::roster_unpair`] inside the caller's transaction.
async fn unpair<C: AdminSql>(conn: &mut C, a: &str, b: &str) -> Result<bool, StoreError> {
    let had = conn.items_for(a, b).await?;
    conn.unpair(a, b).await?;
    Ok(had > 0)
}

impl AdminSql for sqlx::PgConnection {
    async fn lock_owners(&mut self, a: &str, b: &str) -> Result<(), StoreError> {
        // The owners' version rows, which every roster writer of an owner takes first.
        sqlx::query(
            "SELECT 1 FROM roster_versions WHERE owner IN ($1, $2) ORDER BY owner FOR UPDATE",
        )
        .bind(a)
        .bind(b)
        .execute(&mut *self)
        .await?;
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
        sqlx::query("SELECT presenced_roster_make_mutual($1, $2)")
            .bind(a)
            .bind(b)
            .execute(&mut *self)
            .await?;
        Ok(())
    }

    async fn set_name(&mut self, a: &str, b: &str, name: &str) -> Result<(), StoreError> {
        sqlx::query("UPDATE roster_items SET name = $3 WHERE owner = $1 AND contact = $2")
            .bind(a)
            .bind(b)
            .bind(name)
            .execute(&mut *self)
            .await?;
        Ok(())
    }

    async fn set_groups(&mut self, a: &str, b: &str, groups: &[String]) -> Result<(), StoreError> {
        sqlx::query("UPDATE roster_items SET groups = $3 WHERE owner = $1 AND contact = $2")
            .bind(a)
            .bind(b)
            .bind(groups)
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
        sqlx::query("SELECT presenced_roster_unpair($1, $2)")
            .bind(a)
            .bind(b)
            .execute(&mut *self)
            .await?;
        Ok(())
    }
}

impl Store {
    /// Makes two local accounts mutual contacts (subscription `both` on each side, no
    /// request left waiting) in one transaction and, when given, sets the name and groups
    /// `a` files `b` under (`None` keeps the item's name, an empty list its groups). Fails
    /// with [`StoreError::RosterFull`] when either side would get a new item beyond
    /// `max_roster_items`.
    pub async fn roster_make_mutual(
        &self,
        a: &str,
        b: &str,
        name: Option<&str>,
        groups: &[String],
    ) -> Result<(), StoreError> {
        let _forget = self.forget_owners([a, b]);
        self.calls.count("roster_make_mutual");
        let max_items = self.limits().max_roster_items;
        match &self.backend {
            Backend::Postgres(pool) => {
                let mut tx = pool.begin().await?;
                make_mutual(&mut *tx, a, b, name, groups, max_items).await?;
                tx.commit().await?;
                Ok(())
            }
            Backend::Sqlite(db) => {
                let run = async {
                    let mut tx = db.begin_write().await?;
                    make_mutual(&mut *tx, a, b, name, groups, max_items).await?;
                    tx.commit().await?;
                    Ok::<(), StoreError>(())
                };
                run.await.map_err(|e| db.name_file(e))
            }
        }
    }

    /// Removes two accounts from each other's rosters and drops their waiting requests
    /// (`presenced_roster_unpair`). Returns whether `a` had `b` on its roster.
    pub async fn roster_unpair(&self, a: &str, b: &str) -> Result<bool, StoreError> {
        let _forget = self.forget_owners([a, b]);
        self.calls.count("roster_unpair");
        match &self.backend {
            Backend::Postgres(pool) => {
                let mut tx = pool.begin().await?;
                let had = unpair(&mut *tx, a, b).await?;
                tx.commit().await?;
                Ok(had)
            }
            Backend::Sqlite(db) => {
                let run = async {
                    let mut tx = db.begin_write().await?;
                    let had = unpair(&mut *tx, a, b).await?;
                    tx.commit().await?;
                    Ok::<bool, StoreError>(had)
                };
                run.await.map_err(|e| db.name_file(e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What was asked, in order, of rosters where `full` has no room.
    #[derive(Default)]
    struct Rows {
        full: Option<&'static str>,
        asked: Vec<String>,
    }

    impl AdminSql for Rows {
        async fn lock_owners(&mut self, a: &str, b: &str) -> Result<(), StoreError> {
            self.asked.push(format!("lock {a} {b}"));
            Ok(())
        }

        async fn has_room(
            &mut self,
            owner: &str,
            contact: &str,
            _max: i64,
        ) -> Result<bool, StoreError> {
            self.asked.push(format!("room {owner} {contact}"));
            Ok(self.full != Some(owner))
        }

        async fn make_mutual(&mut self, a: &str, b: &str) -> Result<(), StoreError> {
            self.asked.push(format!("mutual {a} {b}"));
            Ok(())
        }

        async fn set_name(&mut self, a: &str, b: &str, name: &str) -> Result<(), StoreError> {
            self.asked.push(format!("name {a} {b} {name}"));
            Ok(())
        }

        async fn set_groups(
            &mut self,
            a: &str,
            b: &str,
            groups: &[String],
        ) -> Result<(), StoreError> {
            self.asked
                .push(format!("groups {a} {b} {}", groups.join(",")));
            Ok(())
        }

        async fn items_for(&mut self, _a: &str, _b: &str) -> Result<i64, StoreError> {
            self.asked.push("items".to_owned());
            Ok(1)
        }

        async fn unpair(&mut self, a: &str, b: &str) -> Result<(), StoreError> {
            self.asked.push(format!("unpair {a} {b}"));
            Ok(())
        }
    }

    #[tokio::test]
    async fn both_rosters_are_checked_for_room_before_anything_is_written() {
        let mut rows = Rows::default();
        let groups = ["g".to_owned()];
        make_mutual(&mut rows, "a@h", "b@h", Some("B"), &groups, 10)
            .await
            .unwrap();
        assert_eq!(
            rows.asked,
            [
                "lock a@h b@h",
                "room a@h b@h",
                "room b@h a@h",
                "mutual a@h b@h",
                "name a@h b@h B",
                "groups a@h b@h g"
            ]
        );
        let mut rows = Rows {
            full: Some("b@h"),
            ..Rows::default()
        };
        let refused = make_mutual(&mut rows, "a@h", "b@h", None, &[], 10).await;
        assert!(matches!(refused, Err(StoreError::RosterFull)));
        assert_eq!(rows.asked, ["lock a@h b@h", "room a@h b@h", "room b@h a@h"]);
    }

    #[tokio::test]
    async fn unpairing_tells_whether_the_item_was_there_before() {
        let mut rows = Rows::default();
        assert!(unpair(&mut rows, "a@h", "b@h").await.unwrap());
        assert_eq!(rows.asked, ["items", "unpair a@h b@h"]);
    }
}
