//! Messages waiting for a user with no available resource (XEP-0160), table
//! `offline_messages` (the SQLite twin: `sqlite/offline.rs`).
//!
//! Two operations, each one transaction: [`Store::store_offline_message`] keeps a message
//! if it fits the owner's [`OfflineQuota`] ([`make_room`] decides, the same for both
//! backends), and [`Store::take_offline_messages`] hands them all out, oldest first, and
//! deletes them in the same statement, so two resources coming online together never both
//! get one. Which messages are kept, who counts as a contact and what a refused sender is
//! told is decided above the store (`crate::services::offline`, `crate::routing::delivery`).
//! The steps of keeping one are written once ([`keep_if_room`]); each backend gives only its
//! statements ([`OfflineSql`]).

use chrono::{DateTime, Utc};

use ::jid::Jid;

use super::{pg_or_sqlite, stored_jid, Store, StoreError};

/// A message handed out of offline storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OfflineMessage {
    /// The sender as stamped on the message: a full JID, or a bare or domain JID from
    /// another server.
    pub sender: Jid,
    /// The message as stored (client-stream XML).
    pub stanza: String,
    /// When it was stored: the XEP-0203 stamp of its delivery.
    pub stored_at: DateTime<Utc>,
}

/// What one user's offline store may hold (`[limits] max_offline_*`): in all, per contact
/// and per stranger, in messages and in bytes (the stanza as stored). A sender's share is
/// never more than the whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OfflineQuota {
    /// Messages kept for one user.
    pub messages: usize,
    /// Bytes kept for one user.
    pub bytes: usize,
    /// Messages one contact may have kept for one user.
    pub contact_messages: usize,
    /// Bytes one contact may have kept for one user.
    pub contact_bytes: usize,
    /// Messages one stranger may have kept for one user (0: none).
    pub stranger_messages: usize,
    /// Bytes one stranger may have kept for one user (0: none).
    pub stranger_bytes: usize,
}

/// What an owner's store holds, read under the owner's lock: in all, and of the sender at
/// hand (by bare JID).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Held {
    pub items: i64,
    pub bytes: i64,
    pub sender_items: i64,
    pub sender_bytes: i64,
}

fn int(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Whether a message of `size` bytes from a sender (a contact or not) fits `quota` given
/// what is `held`, and which kept strangers' messages must go to make room: `None` when it
/// does not fit; otherwise the ids to delete first (empty when it fits as is).
///
/// `strangers` lists the owner's kept messages from strangers, oldest first, as `(id,
/// bytes)`; it is asked for only when a contact's message does not fit as is. The rules:
/// a sender's own share (contact or stranger) is never exceeded; the whole is never
/// exceeded; and only a contact's message displaces anything, and only strangers'
/// messages, oldest first. So a stranger can neither push out nor block a contact's
/// message, and no sender can push out a contact's.
pub(crate) fn make_room(
    quota: &OfflineQuota,
    held: Held,
    size: i64,
    from_contact: bool,
    strangers: impl FnOnce() -> Vec<(i64, i64)>,
) -> Option<Vec<i64>> {
    let (share_items, share_bytes) = if from_contact {
        (quota.contact_messages, quota.contact_bytes)
    } else {
        (quota.stranger_messages, quota.stranger_bytes)
    };
    let share_items = int(share_items.min(quota.messages));
    let share_bytes = int(share_bytes.min(quota.bytes));
    if held.sender_items + 1 > share_items || held.sender_bytes.saturating_add(size) > share_bytes {
        return None;
    }
    let mut over_items = held.items + 1 - int(quota.messages);
    let mut over_bytes = held.bytes.saturating_add(size) - int(quota.bytes);
    if over_items <= 0 && over_bytes <= 0 {
        return Some(Vec::new());
    }
    if !from_contact {
        return None;
    }
    let mut evicted = Vec::new();
    for (id, bytes) in strangers() {
        if over_items <= 0 && over_bytes <= 0 {
            break;
        }
        evicted.push(id);
        over_items -= 1;
        over_bytes -= bytes;
    }
    (over_items <= 0 && over_bytes <= 0).then_some(evicted)
}

/// The statements of keeping one message on one backend's connection, inside the caller's
/// transaction; [`keep_if_room`] is the rule that uses them.
pub(super) trait OfflineSql {
    /// Holds `owner`'s other writers off until the transaction ends, so what is read
    /// cannot change before the insert.
    async fn lock_owner(&mut self, owner: &str) -> Result<(), StoreError>;
    /// What `owner`'s store holds, in all and from `sender_bare`.
    async fn held(&mut self, owner: &str, sender_bare: &str) -> Result<Held, StoreError>;
    /// `owner`'s kept messages from strangers, oldest first, as `(id, bytes)`.
    async fn strangers(&mut self, owner: &str) -> Result<Vec<(i64, i64)>, StoreError>;
    /// Deletes the messages `ids`.
    async fn evict(&mut self, ids: &[i64]) -> Result<(), StoreError>;
    /// Inserts one message of `size` bytes.
    async fn insert(
        &mut self,
        owner: &str,
        sender: &str,
        stanza: &str,
        size: i64,
        from_contact: bool,
    ) -> Result<(), StoreError>;
}

/// [`Store::store_offline_message`] inside the caller's transaction: whether the message
/// was kept. When it was not, nothing was written.
pub(super) async fn keep_if_room<C: OfflineSql>(
    conn: &mut C,
    quota: &OfflineQuota,
    owner: &str,
    sender: &str,
    stanza: &str,
    from_contact: bool,
) -> Result<bool, StoreError> {
    let sender_bare = crate::protocol::jid::bare_of(sender);
    let size = int(stanza.len());
    conn.lock_owner(owner).await?;
    let held = conn.held(owner, sender_bare).await?;
    // Read only when a contact's message needs room (at most `messages` rows).
    let strangers = if from_contact && make_room(quota, held, size, true, Vec::new).is_none() {
        conn.strangers(owner).await?
    } else {
        Vec::new()
    };
    let Some(evicted) = make_room(quota, held, size, from_contact, || strangers) else {
        return Ok(false);
    };
    if !evicted.is_empty() {
        conn.evict(&evicted).await?;
    }
    conn.insert(owner, sender, stanza, size, from_contact)
        .await?;
    Ok(true)
}

impl OfflineSql for sqlx::PgConnection {
    async fn lock_owner(&mut self, owner: &str) -> Result<(), StoreError> {
        // An advisory lock, so nothing else about the account is held.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('offline:' || $1, 0))")
            .bind(owner)
            .execute(&mut *self)
            .await?;
        Ok(())
    }

    async fn held(&mut self, owner: &str, sender_bare: &str) -> Result<Held, StoreError> {
        let (items, bytes, sender_items, sender_bytes): (i64, i64, i64, i64) = sqlx::query_as(
            "SELECT count(*), coalesce(sum(bytes), 0)::bigint,
                    count(*) FILTER (WHERE sender_bare = $2),
                    coalesce(sum(bytes) FILTER (WHERE sender_bare = $2), 0)::bigint
             FROM offline_messages WHERE owner = $1",
        )
        .bind(owner)
        .bind(sender_bare)
        .fetch_one(&mut *self)
        .await?;
        Ok(Held {
            items,
            bytes,
            sender_items,
            sender_bytes,
        })
    }

    async fn strangers(&mut self, owner: &str) -> Result<Vec<(i64, i64)>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT id, bytes::bigint FROM offline_messages
             WHERE owner = $1 AND NOT from_contact ORDER BY id",
        )
        .bind(owner)
        .fetch_all(&mut *self)
        .await?)
    }

    async fn evict(&mut self, ids: &[i64]) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM offline_messages WHERE id = ANY($1)")
            .bind(ids)
            .execute(&mut *self)
            .await?;
        Ok(())
    }

    async fn insert(
        &mut self,
        owner: &str,
        sender: &str,
        stanza: &str,
        size: i64,
        from_contact: bool,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO offline_messages (owner, sender, sender_bare, stanza, bytes, from_contact)
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(owner)
        .bind(sender)
        .bind(crate::protocol::jid::bare_of(sender))
        .bind(stanza)
        .bind(i32::try_from(size).unwrap_or(i32::MAX))
        .bind(from_contact)
        .execute(&mut *self)
        .await?;
        Ok(())
    }
}

impl Store {
    /// Keeps `stanza` from `sender` for `owner` (a bare JID) if it fits the owner's
    /// [`OfflineQuota`] as [`make_room`] decides, deleting the strangers' messages it
    /// displaces; `from_contact` says whether the sender is one of the owner's contacts.
    /// Returns false, keeping and deleting nothing, when it does not fit;
    /// [`StoreError::NoSuchAccount`] when `owner` is not an account.
    pub async fn store_offline_message(
        &self,
        owner: &str,
        sender: &str,
        stanza: &str,
        from_contact: bool,
    ) -> Result<bool, StoreError> {
        let quota = self.limits().offline;
        let pool = pg_or_sqlite!(self, |db| db.store_offline_message(
            owner,
            sender,
            stanza,
            from_contact,
            &quota
        ));
        let mut tx = pool.begin().await?;
        let kept = keep_if_room(&mut *tx, &quota, owner, sender, stanza, from_contact).await?;
        if kept {
            tx.commit().await?;
        }
        Ok(kept)
    }

    /// Every message waiting for `owner`, oldest first, with whether its sender was a
    /// contact when it was kept; nothing is deleted (for `copy-store`).
    pub async fn offline_messages(
        &self,
        owner: &str,
    ) -> Result<Vec<(OfflineMessage, bool)>, StoreError> {
        let pool = pg_or_sqlite!(self, |db| db.offline_messages(owner));
        let rows: Vec<(String, String, DateTime<Utc>, bool)> = sqlx::query_as(
            "SELECT sender, stanza, stored_at, from_contact FROM offline_messages
             WHERE owner = $1 ORDER BY id",
        )
        .bind(owner)
        .fetch_all(pool)
        .await?;
        Ok(rows
            .into_iter()
            .filter_map(|(sender, stanza, stored_at, contact)| {
                let sender = stored_jid("offline_messages", owner, &sender)?;
                Some((
                    OfflineMessage {
                        sender,
                        stanza,
                        stored_at,
                    },
                    contact,
                ))
            })
            .collect())
    }

    /// Keeps `message` for `owner` as it was kept elsewhere, its time and contact flag
    /// included, past every quota (for `copy-store`, which copies what the source holds).
    pub async fn import_offline_message(
        &self,
        owner: &str,
        message: &OfflineMessage,
        from_contact: bool,
    ) -> Result<(), StoreError> {
        let pool = pg_or_sqlite!(self, |db| db.import_offline_message(
            owner,
            message,
            from_contact
        ));
        let sender = message.sender.as_str();
        sqlx::query(
            "INSERT INTO offline_messages
                 (owner, sender, sender_bare, stanza, bytes, from_contact, stored_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(owner)
        .bind(sender)
        .bind(crate::protocol::jid::bare_of(sender))
        .bind(&message.stanza)
        .bind(i32::try_from(message.stanza.len()).unwrap_or(i32::MAX))
        .bind(from_contact)
        .bind(message.stored_at)
        .execute(pool)
        .await?;
        Ok(())
    }

    /// Every message waiting for `owner`, oldest first, deleted as they are returned.
    pub async fn take_offline_messages(
        &self,
        owner: &str,
    ) -> Result<Vec<OfflineMessage>, StoreError> {
        let pool = pg_or_sqlite!(self, |db| db.take_offline_messages(owner));
        let mut rows: Vec<(i64, String, String, DateTime<Utc>)> = sqlx::query_as(
            "DELETE FROM offline_messages WHERE owner = $1
             RETURNING id, sender, stanza, stored_at",
        )
        .bind(owner)
        .fetch_all(pool)
        .await?;
        // RETURNING has no order of its own.
        rows.sort_unstable_by_key(|r| r.0);
        Ok(rows
            .into_iter()
            .filter_map(|(_, sender, stanza, stored_at)| {
                Some(OfflineMessage {
                    sender: stored_jid("offline_messages", owner, &sender)?,
                    stanza,
                    stored_at,
                })
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const Q: OfflineQuota = OfflineQuota {
        messages: 4,
        bytes: 1000,
        contact_messages: 3,
        contact_bytes: 600,
        stranger_messages: 1,
        stranger_bytes: 100,
    };

    fn held(items: i64, bytes: i64, sender_items: i64, sender_bytes: i64) -> Held {
        Held {
            items,
            bytes,
            sender_items,
            sender_bytes,
        }
    }

    /// One owner's messages in memory as `(id, sender_bare, bytes, from_contact)`, and
    /// what was asked in which order.
    #[derive(Default)]
    struct Rows {
        kept: Vec<(i64, String, i64, bool)>,
        asked: Vec<&'static str>,
    }

    impl OfflineSql for Rows {
        async fn lock_owner(&mut self, _owner: &str) -> Result<(), StoreError> {
            self.asked.push("lock");
            Ok(())
        }

        async fn held(&mut self, _owner: &str, sender_bare: &str) -> Result<Held, StoreError> {
            self.asked.push("held");
            let from: Vec<_> = self.kept.iter().filter(|m| m.1 == sender_bare).collect();
            Ok(Held {
                items: i64::try_from(self.kept.len()).unwrap(),
                bytes: self.kept.iter().map(|m| m.2).sum(),
                sender_items: i64::try_from(from.len()).unwrap(),
                sender_bytes: from.iter().map(|m| m.2).sum(),
            })
        }

        async fn strangers(&mut self, _owner: &str) -> Result<Vec<(i64, i64)>, StoreError> {
            self.asked.push("strangers");
            Ok(self
                .kept
                .iter()
                .filter(|m| !m.3)
                .map(|m| (m.0, m.2))
                .collect())
        }

        async fn evict(&mut self, ids: &[i64]) -> Result<(), StoreError> {
            self.asked.push("evict");
            self.kept.retain(|m| !ids.contains(&m.0));
            Ok(())
        }

        async fn insert(
            &mut self,
            _owner: &str,
            sender: &str,
            _stanza: &str,
            size: i64,
            from_contact: bool,
        ) -> Result<(), StoreError> {
            self.asked.push("insert");
            let id = self.kept.iter().map(|m| m.0).max().unwrap_or(0) + 1;
            let bare = crate::protocol::jid::bare_of(sender).to_owned();
            self.kept.push((id, bare, size, from_contact));
            Ok(())
        }
    }

    #[tokio::test]
    async fn strangers_are_read_and_displaced_only_for_a_contact_that_does_not_fit() {
        let mut rows = Rows::default();
        let stanza = "x".repeat(100);
        for (sender, contact) in [("s@x/r", false), ("c@y/r", true), ("d@y/r", true)] {
            assert!(keep_if_room(&mut rows, &Q, "u@h", sender, &stanza, contact)
                .await
                .unwrap());
        }
        assert_eq!(rows.asked, ["lock", "held", "insert"].repeat(3));
        // Full by count: another stranger is refused, nothing written.
        rows.kept.push((9, "c@y".to_owned(), 100, true));
        rows.asked.clear();
        assert!(!keep_if_room(&mut rows, &Q, "u@h", "t@x", &stanza, false)
            .await
            .unwrap());
        assert_eq!(rows.asked, ["lock", "held"]);
        // A contact's message displaces the stranger's, which goes before it is kept.
        rows.asked.clear();
        assert!(keep_if_room(&mut rows, &Q, "u@h", "e@y/r", &stanza, true)
            .await
            .unwrap());
        assert_eq!(rows.asked, ["lock", "held", "strangers", "evict", "insert"]);
        assert!(rows.kept.iter().all(|m| m.3));
    }

    #[test]
    fn each_sender_keeps_to_its_share() {
        let none = Vec::new;
        assert_eq!(
            make_room(&Q, held(0, 0, 0, 0), 50, false, none),
            Some(vec![])
        );
        // A stranger's second message, or one over its bytes, is not kept.
        assert_eq!(make_room(&Q, held(1, 50, 1, 50), 10, false, none), None);
        assert_eq!(make_room(&Q, held(0, 0, 0, 0), 101, false, none), None);
        // A contact's share, in messages and in bytes.
        assert_eq!(
            make_room(&Q, held(2, 200, 2, 200), 100, true, none),
            Some(vec![])
        );
        assert_eq!(make_room(&Q, held(3, 300, 3, 300), 10, true, none), None);
        assert_eq!(make_room(&Q, held(1, 500, 1, 500), 101, true, none), None);
        // A share larger than the whole is the whole.
        let small = OfflineQuota { messages: 1, ..Q };
        assert_eq!(make_room(&small, held(1, 10, 0, 0), 10, true, none), None);
    }

    #[test]
    fn only_a_contact_displaces_and_only_strangers_oldest_first() {
        // Full by count: two strangers' messages and two contacts'.
        let full = held(4, 400, 0, 0);
        let strangers = || vec![(1, 100), (3, 100)];
        assert_eq!(make_room(&Q, full, 10, true, strangers), Some(vec![1]));
        assert_eq!(make_room(&Q, full, 10, false, strangers), None);
        // Full by bytes: as many of the oldest as it takes.
        let heavy = held(3, 950, 0, 0);
        assert_eq!(make_room(&Q, heavy, 200, true, strangers), Some(vec![1, 3]));
        // Not enough strangers' messages to make room: nothing is deleted, nothing kept.
        assert_eq!(make_room(&Q, heavy, 300, true, strangers), None);
        assert_eq!(make_room(&Q, full, 10, true, Vec::new), None);
    }
}
