//! The operators' roster operations (`presenced roster add|remove`): the same SQL
//! operations an operator's migration uses (`presenced_roster_make_mutual`,
//! `presenced_roster_unpair`, migrations/0004 and their SQLite views), so the rule of what
//! "mutual contacts" means is written once, in the schema. The roster triggers bump both
//! owners' versions and announce the change like any other.

use super::{Backend, Store, StoreError};

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
        let max_items = self.limits().max_roster_items;
        // A new item on a full roster is refused by the rule every other roster write
        // applies; it is read in the writing transaction, after the owners' version rows
        // (PostgreSQL) or the file's write lock (SQLite) are held.
        let room_sql = format!(
            "SELECT {}",
            super::roster::roster_has_room("$1", "$2", "$3")
        );
        match &self.backend {
            Backend::Postgres(pool) => {
                let mut tx = pool.begin().await?;
                sqlx::query(
                    "SELECT 1 FROM roster_versions WHERE owner IN ($1, $2) ORDER BY owner FOR UPDATE",
                )
                .bind(a)
                .bind(b)
                .execute(&mut *tx)
                .await?;
                for (owner, contact) in [(a, b), (b, a)] {
                    let room: bool = sqlx::query_scalar(&room_sql)
                        .bind(owner)
                        .bind(contact)
                        .bind(max_items)
                        .fetch_one(&mut *tx)
                        .await?;
                    if !room {
                        return Err(StoreError::RosterFull);
                    }
                }
                sqlx::query("SELECT presenced_roster_make_mutual($1, $2)")
                    .bind(a)
                    .bind(b)
                    .execute(&mut *tx)
                    .await?;
                if let Some(name) = name {
                    sqlx::query(
                        "UPDATE roster_items SET name = $3 WHERE owner = $1 AND contact = $2",
                    )
                    .bind(a)
                    .bind(b)
                    .bind(name)
                    .execute(&mut *tx)
                    .await?;
                }
                if !groups.is_empty() {
                    sqlx::query(
                        "UPDATE roster_items SET groups = $3 WHERE owner = $1 AND contact = $2",
                    )
                    .bind(a)
                    .bind(b)
                    .bind(groups)
                    .execute(&mut *tx)
                    .await?;
                }
                tx.commit().await?;
                Ok(())
            }
            Backend::Sqlite(db) => {
                let run = async {
                    let mut tx = db.begin_write().await?;
                    for (owner, contact) in [(a, b), (b, a)] {
                        let room: bool = sqlx::query_scalar(&room_sql.replace('$', "?"))
                            .bind(owner)
                            .bind(contact)
                            .bind(max_items)
                            .fetch_one(&mut *tx)
                            .await?;
                        if !room {
                            return Err(StoreError::RosterFull);
                        }
                    }
                    sqlx::query("INSERT INTO presenced_roster_make_mutual (a, b) VALUES (?1, ?2)")
                        .bind(a)
                        .bind(b)
                        .execute(&mut *tx)
                        .await?;
                    if let Some(name) = name {
                        sqlx::query(
                            "UPDATE roster_items SET name = ?3 WHERE owner = ?1 AND contact = ?2",
                        )
                        .bind(a)
                        .bind(b)
                        .bind(name)
                        .execute(&mut *tx)
                        .await?;
                    }
                    if !groups.is_empty() {
                        sqlx::query(
                            "UPDATE roster_items SET groups = ?3 WHERE owner = ?1 AND contact = ?2",
                        )
                        .bind(a)
                        .bind(b)
                        .bind(super::sqlite::json_list(groups))
                        .execute(&mut *tx)
                        .await?;
                    }
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
        let had = "SELECT count(*) FROM roster_items WHERE owner = $1 AND contact = $2";
        match &self.backend {
            Backend::Postgres(pool) => {
                let mut tx = pool.begin().await?;
                let n: i64 = sqlx::query_scalar(had)
                    .bind(a)
                    .bind(b)
                    .fetch_one(&mut *tx)
                    .await?;
                sqlx::query("SELECT presenced_roster_unpair($1, $2)")
                    .bind(a)
                    .bind(b)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(n > 0)
            }
            Backend::Sqlite(db) => {
                let run = async {
                    let mut tx = db.begin_write().await?;
                    let n: i64 = sqlx::query_scalar(&had.replace('$', "?"))
                        .bind(a)
                        .bind(b)
                        .fetch_one(&mut *tx)
                        .await?;
                    sqlx::query("INSERT INTO presenced_roster_unpair (a, b) VALUES (?1, ?2)")
                        .bind(a)
                        .bind(b)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    Ok::<bool, StoreError>(n > 0)
                };
                run.await.map_err(|e| db.name_file(e))
            }
        }
    }
}
