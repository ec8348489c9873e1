//! XEP-0163 personal eventing: each account's nodes and items, tables `pep_nodes` and
//! `pep_items` (the SQLite twin: `sqlite/pep.rs`).
//!
//! One write decides the bounds: [`Store::pep_publish`] creates the node on first publish
//! unless the owner already has [`StoreLimits::max_pep_nodes`], replaces an item with the
//! same id, and keeps the node's newest [`StoreLimits::max_pep_items`] items (XEP-0060
//! §7.1.1: the oldest are deleted), all in one transaction serialised per owner. What a
//! publish means for whom (access models, notifications) is decided above the store
//! (`crate::services::pep`). The rows go with the account (`ON DELETE CASCADE`). The
//! publish's steps are written once ([`publish`]); each backend gives only its statements
//! ([`PepSql`]).
//!
//! [`StoreLimits::max_pep_nodes`]: super::StoreLimits::max_pep_nodes
//! [`StoreLimits::max_pep_items`]: super::StoreLimits::max_pep_items

use ::jid::BareJid;

use super::{pg_or_sqlite, Store, StoreError};

wire_enum! {
    /// Who may read a node and be notified of it: the XEP-0060 §4.5 access models served
    /// (the schema's `pep_nodes_access_model` admits these names only).
    pub enum AccessModel {
        /// Anyone not blocked.
        Open => "open",
        /// Whoever may see the owner's presence (XEP-0163 §4: the PEP default).
        Presence => "presence",
        /// The owner only (no whitelist can be edited, so it holds nobody else).
        Whitelist => "whitelist",
    }
}

/// The access model of `owner`'s `node` as read. A name the schema should have refused
/// is `None`, with a warning naming the row, and the row is left out, as
/// [`super::stored_jid`] leaves out a row whose JID does not parse: a node nobody can
/// tell the readers of is read by nobody.
pub(super) fn stored_access(owner: &str, node: &str, value: &str) -> Option<AccessModel> {
    let model = AccessModel::parse(value);
    if model.is_none() {
        tracing::warn!(
            owner,
            node,
            value,
            "stored PEP access model unknown; node left out"
        );
    }
    model
}

/// One stored item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PepItem {
    /// The item's id.
    pub id: String,
    /// The payload element, serialised for a client stream.
    pub payload: String,
}

/// What a publish did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Published {
    /// The item is stored; the node has this access model.
    Stored {
        /// The node's access model.
        access_model: AccessModel,
    },
    /// The node exists with another access model than the publish asked for
    /// (XEP-0060 §7.1.5: `precondition-not-met`); nothing was stored.
    AccessModelDiffers,
    /// The owner already has `max_pep_nodes` nodes; nothing was stored.
    TooManyNodes,
    /// The owner's payloads would exceed `max_pep_bytes`; nothing was stored.
    OverBudget,
}

/// The bounds one publish is checked against (`[limits] max_pep_*`), as the store's
/// integers.
#[derive(Debug, Clone, Copy)]
pub(super) struct PepBounds {
    /// Nodes per account.
    pub nodes: i64,
    /// Items per node.
    pub items: i64,
    /// Payload bytes per account.
    pub bytes: i64,
}

/// What a publish does with the node, given its stored access model (`None`: no node)
/// and the one publish-options asked (`None`: none asked). The one rule for both stores.
pub(super) enum Settle {
    /// The node exists with an acceptable model.
    Keep(AccessModel),
    /// The node exists with another model (XEP-0060 §7.1.5).
    Differs,
    /// Create the node with this model (`presence` unless asked otherwise, XEP-0163 §4).
    Create(AccessModel),
}

/// [`Settle`] for the stored name `existing`; a name the schema should have refused
/// fails the publish ([`StoreError::Corrupt`]): the node is there, so it can be neither
/// kept with a model nobody knows nor created again.
pub(super) fn settle(
    existing: Option<String>,
    asked: Option<AccessModel>,
) -> Result<Settle, StoreError> {
    let existing = existing
        .map(|m| {
            AccessModel::parse(&m).ok_or_else(|| StoreError::Corrupt(format!("access model {m:?}")))
        })
        .transpose()?;
    Ok(match existing {
        Some(m) if asked.is_some_and(|a| a != m) => Settle::Differs,
        Some(m) => Settle::Keep(m),
        None => Settle::Create(asked.unwrap_or(AccessModel::Presence)),
    })
}

/// The statements of a publish on one backend's connection, inside the caller's
/// transaction; [`publish`] is the rule that uses them.
pub(super) trait PepSql {
    /// Holds `owner`'s other publishes off until the transaction ends, so the node count
    /// cannot change before the insert and the item sequence strictly increases.
    async fn lock_owner(&mut self, owner: &str) -> Result<(), StoreError>;
    /// The stored access model of `owner`'s `node`, `None` when there is no such node.
    async fn access_model(&mut self, owner: &str, node: &str)
        -> Result<Option<String>, StoreError>;
    /// How many nodes `owner` has.
    async fn node_count(&mut self, owner: &str) -> Result<i64, StoreError>;
    /// Creates `owner`'s `node` with `model`.
    async fn create_node(
        &mut self,
        owner: &str,
        node: &str,
        model: AccessModel,
    ) -> Result<(), StoreError>;
    /// Stores `item` as the node's newest, replacing one with the same id.
    async fn put_item(&mut self, owner: &str, node: &str, item: &PepItem)
        -> Result<(), StoreError>;
    /// Deletes all but the node's newest `keep` items.
    async fn trim(&mut self, owner: &str, node: &str, keep: i64) -> Result<(), StoreError>;
    /// The bytes of all `owner`'s payloads.
    async fn payload_bytes(&mut self, owner: &str) -> Result<i64, StoreError>;
}

/// One publish inside the caller's transaction (see [`Store::pep_publish`]): what it did.
/// The caller commits only [`Published::Stored`]; for the others the transaction is
/// dropped, so nothing of it stays.
pub(super) async fn publish<C: PepSql>(
    conn: &mut C,
    owner: &str,
    node: &str,
    access_model: Option<AccessModel>,
    item: &PepItem,
    bounds: PepBounds,
) -> Result<Published, StoreError> {
    conn.lock_owner(owner).await?;
    let existing = conn.access_model(owner, node).await?;
    let model = match settle(existing, access_model)? {
        Settle::Keep(m) => m,
        Settle::Differs => return Ok(Published::AccessModelDiffers),
        Settle::Create(m) => {
            if conn.node_count(owner).await? >= bounds.nodes {
                return Ok(Published::TooManyNodes);
            }
            conn.create_node(owner, node, m).await?;
            m
        }
    };
    conn.put_item(owner, node, item).await?;
    conn.trim(owner, node, bounds.items).await?;
    // Counted after the item replaced and the oldest trimmed, so a publish that frees as
    // much as it takes always passes.
    if conn.payload_bytes(owner).await? > bounds.bytes {
        return Ok(Published::OverBudget);
    }
    Ok(Published::Stored {
        access_model: model,
    })
}

impl PepSql for sqlx::PgConnection {
    async fn lock_owner(&mut self, owner: &str) -> Result<(), StoreError> {
        // An advisory lock, so nothing else about the account is held.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('pep:' || $1, 0))")
            .bind(owner)
            .execute(&mut *self)
            .await?;
        Ok(())
    }

    async fn access_model(
        &mut self,
        owner: &str,
        node: &str,
    ) -> Result<Option<String>, StoreError> {
        Ok(
            sqlx::query_scalar("SELECT access_model FROM pep_nodes WHERE owner = $1 AND node = $2")
                .bind(owner)
                .bind(node)
                .fetch_optional(&mut *self)
                .await?,
        )
    }

    async fn node_count(&mut self, owner: &str) -> Result<i64, StoreError> {
        Ok(
            sqlx::query_scalar("SELECT count(*) FROM pep_nodes WHERE owner = $1")
                .bind(owner)
                .fetch_one(&mut *self)
                .await?,
        )
    }

    async fn create_node(
        &mut self,
        owner: &str,
        node: &str,
        model: AccessModel,
    ) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO pep_nodes (owner, node, access_model) VALUES ($1, $2, $3)")
            .bind(owner)
            .bind(node)
            .bind(model.as_str())
            .execute(&mut *self)
            .await?;
        Ok(())
    }

    async fn put_item(
        &mut self,
        owner: &str,
        node: &str,
        item: &PepItem,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO pep_items (owner, node, item_id, payload, seq)
             VALUES ($1, $2, $3, $4, (SELECT coalesce(max(seq), 0) + 1 FROM pep_items
                                      WHERE owner = $1 AND node = $2))
             ON CONFLICT (owner, node, item_id) DO UPDATE
             SET payload = excluded.payload, seq = excluded.seq, published_at = now()",
        )
        .bind(owner)
        .bind(node)
        .bind(&item.id)
        .bind(&item.payload)
        .execute(&mut *self)
        .await?;
        Ok(())
    }

    async fn trim(&mut self, owner: &str, node: &str, keep: i64) -> Result<(), StoreError> {
        sqlx::query(
            "DELETE FROM pep_items WHERE owner = $1 AND node = $2 AND item_id NOT IN
             (SELECT item_id FROM pep_items WHERE owner = $1 AND node = $2
              ORDER BY seq DESC LIMIT $3)",
        )
        .bind(owner)
        .bind(node)
        .bind(keep)
        .execute(&mut *self)
        .await?;
        Ok(())
    }

    async fn payload_bytes(&mut self, owner: &str) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar(
            "SELECT coalesce(sum(octet_length(payload)), 0)::bigint FROM pep_items WHERE owner = $1",
        )
        .bind(owner)
        .fetch_one(&mut *self)
        .await?)
    }
}

impl Store {
    /// Publishes `item` to `owner`'s `node`, creating the node with `access_model` (or
    /// `presence` when `None`) if it does not exist. An existing node must have the asked
    /// access model, when one is asked.
    pub async fn pep_publish(
        &self,
        owner: &str,
        node: &str,
        access_model: Option<AccessModel>,
        item: &PepItem,
    ) -> Result<Published, StoreError> {
        let limits = self.limits();
        let int = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        let bounds = PepBounds {
            nodes: int(limits.max_pep_nodes),
            items: int(limits.max_pep_items),
            bytes: int(limits.max_pep_bytes),
        };
        let pool = pg_or_sqlite!(self, |db| db.pep_publish(
            owner,
            node,
            access_model,
            item,
            bounds
        ));
        let mut tx = pool.begin().await?;
        let published = publish(&mut *tx, owner, node, access_model, item, bounds).await?;
        if matches!(published, Published::Stored { .. }) {
            tx.commit().await?;
        }
        Ok(published)
    }

    /// The access model of `owner`'s `node`, `None` when there is no such node.
    pub async fn pep_node(
        &self,
        owner: &str,
        node: &str,
    ) -> Result<Option<AccessModel>, StoreError> {
        let pool = pg_or_sqlite!(self, |db| db.pep_node(owner, node));
        let model: Option<String> =
            sqlx::query_scalar("SELECT access_model FROM pep_nodes WHERE owner = $1 AND node = $2")
                .bind(owner)
                .bind(node)
                .fetch_optional(pool)
                .await?;
        Ok(model.and_then(|m| stored_access(owner, node, &m)))
    }

    /// Every node of `owner` with its access model, by name.
    pub async fn pep_nodes(&self, owner: &str) -> Result<Vec<(String, AccessModel)>, StoreError> {
        let pool = pg_or_sqlite!(self, |db| db.pep_nodes(owner));
        let rows: Vec<(String, String)> = sqlx::query_as(
            "SELECT node, access_model FROM pep_nodes WHERE owner = $1 ORDER BY node",
        )
        .bind(owner)
        .fetch_all(pool)
        .await?;
        Ok(nodes_of(owner, rows))
    }

    /// Items of `owner`'s `node`, newest first: those with the given ids (all when `ids`
    /// is empty), at most `max` of them.
    pub async fn pep_items(
        &self,
        owner: &str,
        node: &str,
        ids: &[String],
        max: usize,
    ) -> Result<Vec<PepItem>, StoreError> {
        let max = i64::try_from(max).unwrap_or(i64::MAX);
        let pool = pg_or_sqlite!(self, |db| db.pep_items(owner, node, ids, max));
        let rows: Vec<(String, String)> = sqlx::query_as(
            "SELECT item_id, payload FROM pep_items
             WHERE owner = $1 AND node = $2 AND (cardinality($3::text[]) = 0 OR item_id = ANY($3))
             ORDER BY seq DESC LIMIT $4",
        )
        .bind(owner)
        .bind(node)
        .bind(ids)
        .bind(max)
        .fetch_all(pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(id, payload)| PepItem { id, payload })
            .collect())
    }

    /// The newest item of each node of each of `owners`, in one statement (a login reads
    /// its contacts' together): (owner, node, access model, item), by owner and node.
    pub async fn pep_last_items(
        &self,
        owners: &[BareJid],
    ) -> Result<Vec<(BareJid, String, AccessModel, PepItem)>, StoreError> {
        let pool = pg_or_sqlite!(self, |db| db.pep_last_items(owners));
        let names: Vec<&str> = owners.iter().map(|j| j.as_str()).collect();
        let rows: Vec<(String, String, String, String, String)> = sqlx::query_as(
            "SELECT DISTINCT ON (i.owner, i.node) i.owner, i.node, n.access_model, i.item_id,
                    i.payload
             FROM pep_items i JOIN pep_nodes n ON n.owner = i.owner AND n.node = i.node
             WHERE i.owner = ANY($1) ORDER BY i.owner, i.node, i.seq DESC",
        )
        .bind(&names)
        .fetch_all(pool)
        .await?;
        Ok(last_items_of(owners, rows))
    }

    /// Deletes one item; false when there was none.
    pub async fn pep_retract(&self, owner: &str, node: &str, id: &str) -> Result<bool, StoreError> {
        let pool = pg_or_sqlite!(self, |db| db.pep_retract(owner, node, id));
        let r =
            sqlx::query("DELETE FROM pep_items WHERE owner = $1 AND node = $2 AND item_id = $3")
                .bind(owner)
                .bind(node)
                .bind(id)
                .execute(pool)
                .await?;
        Ok(r.rows_affected() > 0)
    }

    /// Deletes every item of a node, keeping the node; false when there is no such node.
    pub async fn pep_purge(&self, owner: &str, node: &str) -> Result<bool, StoreError> {
        if self.pep_node(owner, node).await?.is_none() {
            return Ok(false);
        }
        let pool = pg_or_sqlite!(self, |db| db.pep_purge(owner, node));
        sqlx::query("DELETE FROM pep_items WHERE owner = $1 AND node = $2")
            .bind(owner)
            .bind(node)
            .execute(pool)
            .await?;
        Ok(true)
    }

    /// Deletes a node and its items; false when there was none.
    pub async fn pep_delete_node(&self, owner: &str, node: &str) -> Result<bool, StoreError> {
        let pool = pg_or_sqlite!(self, |db| db.pep_delete_node(owner, node));
        let r = sqlx::query("DELETE FROM pep_nodes WHERE owner = $1 AND node = $2")
            .bind(owner)
            .bind(node)
            .execute(pool)
            .await?;
        Ok(r.rows_affected() > 0)
    }
}

/// The rows of a nodes read, each with its access model ([`stored_access`]).
pub(super) fn nodes_of(owner: &str, rows: Vec<(String, String)>) -> Vec<(String, AccessModel)> {
    rows.into_iter()
        .filter_map(|(node, model)| {
            let model = stored_access(owner, &node, &model)?;
            Some((node, model))
        })
        .collect()
}

/// The rows of a last-items read with each owner as the caller passed it: the statement
/// selects only those owners, so every row names one of them.
pub(super) fn last_items_of(
    owners: &[BareJid],
    rows: Vec<(String, String, String, String, String)>,
) -> Vec<(BareJid, String, AccessModel, PepItem)> {
    let by_name: std::collections::HashMap<&str, &BareJid> =
        owners.iter().map(|o| (o.as_str(), o)).collect();
    rows.into_iter()
        .filter_map(|(owner, node, model, id, payload)| {
            let model = stored_access(&owner, &node, &model)?;
            let owner = (*by_name.get(owner.as_str())?).clone();
            Some((owner, node, model, PepItem { id, payload }))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One owner's nodes and items in memory (items oldest first), with the statements'
    /// meaning.
    #[derive(Default)]
    struct Rows {
        nodes: Vec<(String, String)>,
        items: Vec<(String, PepItem)>,
    }

    impl PepSql for Rows {
        async fn lock_owner(&mut self, _owner: &str) -> Result<(), StoreError> {
            Ok(())
        }

        async fn access_model(
            &mut self,
            _owner: &str,
            node: &str,
        ) -> Result<Option<String>, StoreError> {
            Ok(self
                .nodes
                .iter()
                .find(|(n, _)| n == node)
                .map(|(_, m)| m.clone()))
        }

        async fn node_count(&mut self, _owner: &str) -> Result<i64, StoreError> {
            Ok(i64::try_from(self.nodes.len()).unwrap())
        }

        async fn create_node(
            &mut self,
            _owner: &str,
            node: &str,
            model: AccessModel,
        ) -> Result<(), StoreError> {
            self.nodes
                .push((node.to_owned(), model.as_str().to_owned()));
            Ok(())
        }

        async fn put_item(
            &mut self,
            _owner: &str,
            node: &str,
            item: &PepItem,
        ) -> Result<(), StoreError> {
            self.items.retain(|(n, i)| !(n == node && i.id == item.id));
            self.items.push((node.to_owned(), item.clone()));
            Ok(())
        }

        async fn trim(&mut self, _owner: &str, node: &str, keep: i64) -> Result<(), StoreError> {
            let mut kept = usize::try_from(keep).unwrap();
            let mut items = std::mem::take(&mut self.items);
            items.reverse();
            items.retain(|(n, _)| {
                if n != node {
                    return true;
                }
                let stays = kept > 0;
                kept = kept.saturating_sub(1);
                stays
            });
            items.reverse();
            self.items = items;
            Ok(())
        }

        async fn payload_bytes(&mut self, _owner: &str) -> Result<i64, StoreError> {
            let bytes: usize = self.items.iter().map(|(_, i)| i.payload.len()).sum();
            Ok(i64::try_from(bytes).unwrap())
        }
    }

    fn item(id: &str, bytes: usize) -> PepItem {
        PepItem {
            id: id.to_owned(),
            payload: "x".repeat(bytes),
        }
    }

    const BOUNDS: PepBounds = PepBounds {
        nodes: 1,
        items: 1,
        bytes: 15,
    };

    #[tokio::test]
    async fn a_first_publish_creates_the_node_with_presence_unless_asked_otherwise() {
        let mut rows = Rows::default();
        let done = publish(&mut rows, "u@h", "n", None, &item("1", 5), BOUNDS).await;
        assert_eq!(
            done.unwrap(),
            Published::Stored {
                access_model: AccessModel::Presence
            }
        );
        let asked = Some(AccessModel::Open);
        let done = publish(&mut rows, "u@h", "n", asked, &item("2", 5), BOUNDS).await;
        assert_eq!(done.unwrap(), Published::AccessModelDiffers);
    }

    #[tokio::test]
    async fn a_node_beyond_the_count_is_refused_and_bytes_count_after_the_trim() {
        let mut rows = Rows::default();
        let first = publish(&mut rows, "u@h", "a", None, &item("1", 10), BOUNDS).await;
        assert!(matches!(first.unwrap(), Published::Stored { .. }));
        let other = publish(&mut rows, "u@h", "b", None, &item("1", 1), BOUNDS).await;
        assert_eq!(other.unwrap(), Published::TooManyNodes);
        // One item per node: the newer replaces the older before the bytes are counted.
        let next = publish(&mut rows, "u@h", "a", None, &item("2", 15), BOUNDS).await;
        assert!(matches!(next.unwrap(), Published::Stored { .. }));
        let big = publish(&mut rows, "u@h", "a", None, &item("3", 16), BOUNDS).await;
        assert_eq!(big.unwrap(), Published::OverBudget);
    }
}
