//! SQLite twin of `store/pep.rs` (XEP-0163 nodes and items).

use super::Pools;
use crate::protocol::jid::BareJid;
use crate::store::pep::{
    last_items_of, nodes_of, publish, stored_access, AccessModel, PepBounds, PepItem, PepSql,
    Published,
};
use crate::store::StoreError;

/// The statements of a publish (`store/pep.rs` holds the rule).
impl PepSql for sqlx::SqliteConnection {
    async fn lock_owner(&mut self, _owner: &str) -> Result<(), StoreError> {
        // One writer: the caller's write transaction holds the file's write lock already.
        Ok(())
    }

    async fn access_model(
        &mut self,
        owner: &str,
        node: &str,
    ) -> Result<Option<String>, StoreError> {
        Ok(
            sqlx::query_scalar("SELECT access_model FROM pep_nodes WHERE owner = ?1 AND node = ?2")
                .bind(owner)
                .bind(node)
                .fetch_optional(&mut *self)
                .await?,
        )
    }

    async fn node_count(&mut self, owner: &str) -> Result<i64, StoreError> {
        Ok(
            sqlx::query_scalar("SELECT count(*) FROM pep_nodes WHERE owner = ?1")
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
        sqlx::query("INSERT INTO pep_nodes (owner, node, access_model) VALUES (?1, ?2, ?3)")
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
             VALUES (?1, ?2, ?3, ?4, (SELECT coalesce(max(seq), 0) + 1 FROM pep_items
                                      WHERE owner = ?1 AND node = ?2))
             ON CONFLICT (owner, node, item_id) DO UPDATE
             SET payload = excluded.payload, seq = excluded.seq,
                 published_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')",
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
            "DELETE FROM pep_items WHERE owner = ?1 AND node = ?2 AND item_id NOT IN
             (SELECT item_id FROM pep_items WHERE owner = ?1 AND node = ?2
              ORDER BY seq DESC LIMIT ?3)",
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
            "SELECT coalesce(sum(length(CAST(payload AS BLOB))), 0) FROM pep_items WHERE owner = ?1",
        )
        .bind(owner)
        .fetch_one(&mut *self)
        .await?)
    }
}

impl Pools {
    pub(in crate::store) async fn pep_publish(
        &self,
        owner: &str,
        node: &str,
        access_model: Option<AccessModel>,
        item: &PepItem,
        bounds: PepBounds,
    ) -> Result<Published, StoreError> {
        let mut tx = self.begin_write().await?;
        let published = publish(&mut *tx, owner, node, access_model, item, bounds).await?;
        if matches!(published, Published::Stored { .. }) {
            tx.commit().await?;
        }
        Ok(published)
    }

    pub(in crate::store) async fn pep_node(
        &self,
        owner: &str,
        node: &str,
    ) -> Result<Option<AccessModel>, StoreError> {
        let model: Option<String> =
            sqlx::query_scalar("SELECT access_model FROM pep_nodes WHERE owner = ?1 AND node = ?2")
                .bind(owner)
                .bind(node)
                .fetch_optional(&self.read)
                .await?;
        Ok(model.and_then(|m| stored_access(owner, node, &m)))
    }

    pub(in crate::store) async fn pep_nodes(
        &self,
        owner: &str,
    ) -> Result<Vec<(String, AccessModel)>, StoreError> {
        let rows: Vec<(String, String)> = sqlx::query_as(
            "SELECT node, access_model FROM pep_nodes WHERE owner = ?1 ORDER BY node",
        )
        .bind(owner)
        .fetch_all(&self.read)
        .await?;
        Ok(nodes_of(owner, rows))
    }

    pub(in crate::store) async fn pep_items(
        &self,
        owner: &str,
        node: &str,
        ids: &[String],
        max: i64,
    ) -> Result<Vec<PepItem>, StoreError> {
        let ids_json = serde_json::to_string(ids).unwrap_or_else(|_| "[]".to_owned());
        let rows: Vec<(String, String)> = sqlx::query_as(
            "SELECT item_id, payload FROM pep_items
             WHERE owner = ?1 AND node = ?2
               AND (json_array_length(?3) = 0 OR item_id IN (SELECT value FROM json_each(?3)))
             ORDER BY seq DESC LIMIT ?4",
        )
        .bind(owner)
        .bind(node)
        .bind(ids_json)
        .bind(max)
        .fetch_all(&self.read)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(id, payload)| PepItem { id, payload })
            .collect())
    }

    pub(in crate::store) async fn pep_last_items(
        &self,
        owners: &[BareJid],
    ) -> Result<Vec<(BareJid, String, AccessModel, PepItem)>, StoreError> {
        let names: Vec<&str> = owners.iter().map(|j| j.as_str()).collect();
        let owners_json = serde_json::to_string(&names).unwrap_or_else(|_| "[]".to_owned());
        let rows: Vec<(String, String, String, String, String)> = sqlx::query_as(
            "SELECT i.owner, i.node, n.access_model, i.item_id, i.payload
             FROM pep_items i JOIN pep_nodes n ON n.owner = i.owner AND n.node = i.node
             WHERE i.owner IN (SELECT value FROM json_each(?1))
               AND i.seq = (SELECT max(seq) FROM pep_items j
                            WHERE j.owner = i.owner AND j.node = i.node)
             ORDER BY i.owner, i.node",
        )
        .bind(owners_json)
        .fetch_all(&self.read)
        .await?;
        Ok(last_items_of(owners, rows))
    }

    pub(in crate::store) async fn pep_retract(
        &self,
        owner: &str,
        node: &str,
        id: &str,
    ) -> Result<bool, StoreError> {
        let r =
            sqlx::query("DELETE FROM pep_items WHERE owner = ?1 AND node = ?2 AND item_id = ?3")
                .bind(owner)
                .bind(node)
                .bind(id)
                .execute(&self.write)
                .await?;
        Ok(r.rows_affected() > 0)
    }

    pub(in crate::store) async fn pep_purge(
        &self,
        owner: &str,
        node: &str,
    ) -> Result<bool, StoreError> {
        sqlx::query("DELETE FROM pep_items WHERE owner = ?1 AND node = ?2")
            .bind(owner)
            .bind(node)
            .execute(&self.write)
            .await?;
        Ok(true)
    }

    pub(in crate::store) async fn pep_delete_node(
        &self,
        owner: &str,
        node: &str,
    ) -> Result<bool, StoreError> {
        let r = sqlx::query("DELETE FROM pep_nodes WHERE owner = ?1 AND node = ?2")
            .bind(owner)
            .bind(node)
            .execute(&self.write)
            .await?;
        Ok(r.rows_affected() > 0)
    }
}
