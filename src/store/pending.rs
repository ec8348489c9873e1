//! Inbound subscription requests for users who were offline (RFC 6121 §3.1.3: the server
//! must deliver them when the user next becomes available), table
//! `pending_subscriptions`.
//!
//! Bounded per user: at most `max_pending_subscriptions` wait, and each keeps only what
//! §3.1.3 delivers and a client shows to decide, its type, one status and the XEP-0172
//! nick, each cut to `max_subscription_status_length` characters ([`stored_request`]).
//! A request beyond the count is not kept and nobody is told: an error to the sender would
//! tell a stranger that the account exists (RFC 6121 §8.5.1 answers requests to
//! non-existent accounts with silence) and how many requests wait. The sender's own item
//! keeps its pending request, which RFC 6121 allows to stay unanswered, and a resource of
//! the user that is online at that moment still gets it delivered.

use super::roster::truncate_chars;
use super::{pg_or_sqlite, Store, StoreError};
use crate::protocol::xml::{Element, NS_CLIENT};

/// XEP-0172 user nickname, the one extension a waiting request keeps.
const NS_NICK: &str = "http://jabber.org/protocol/nick";

/// The part of a subscription request stanza that is kept while it waits: `from`, `to`,
/// type subscribe, the first `<status/>` and the XEP-0172 `<nick/>`, texts cut to
/// `max_text` characters. Anything else (other languages' statuses, priority, unknown
/// extensions) is dropped: only these are shown to the user deciding.
pub(super) fn stored_request(xml: &str, max_text: usize) -> String {
    let mut kept = Element::new("presence", NS_CLIENT).attr("type", "subscribe");
    let Some(el) = crate::protocol::xml::parse_element(xml) else {
        return kept.to_xml();
    };
    for a in ["from", "to"] {
        if let Some(v) = el.get_attr(a) {
            kept.set_attr(a, v);
        }
    }
    let mut text_child = |child: Option<&Element>, name: &str, ns: &str| {
        let mut text = child.map(Element::text_content).unwrap_or_default();
        truncate_chars(&mut text, max_text);
        if !text.is_empty() {
            kept.children.push(crate::protocol::xml::Node::Element(
                Element::new(name, ns).text(text),
            ));
        }
    };
    // A status is in the stanza's own namespace (jabber:client, or jabber:server when the
    // request came over federation); it is delivered to a client.
    text_child(
        el.elements().find(|c| c.name == "status" && c.ns == el.ns),
        "status",
        NS_CLIENT,
    );
    text_child(el.get_child("nick", NS_NICK), "nick", NS_NICK);
    kept.to_xml()
}

/// Says that a request was refused for the count (not because one from `from` waits).
pub(super) fn log_not_kept(owner: &str, from: &str, max: i64) {
    tracing::info!(
        user = owner,
        sender = from,
        max,
        "subscription request not kept: too many waiting"
    );
}

/// A change of the waiting requests made in the transaction of one subscription change,
/// so a request and the roster items it goes with change together or not at all.
#[derive(Debug, Clone, Copy)]
pub enum PendingChange<'a> {
    /// Keep the request stanza from `sender` (a bare JID) for `owner` until answered
    /// (RFC 6121 §3.1.3), cut to what [`stored_request`] keeps; the first one stays.
    Keep {
        owner: &'a str,
        sender: &'a str,
        stanza: &'a str,
    },
    /// Drop the request from `sender`: answered, or withdrawn by its sender.
    Drop { owner: &'a str, sender: &'a str },
}

/// A [`PendingChange`] ready for either backend: the stanza cut (`None`: drop).
pub(super) struct PendingWrite<'a> {
    pub owner: &'a str,
    pub sender: &'a str,
    pub keep: Option<String>,
}

impl Store {
    /// `changes` cut to what is kept, with the bound of waiting requests per owner.
    pub(super) fn pending_writes<'a>(
        &self,
        changes: &[PendingChange<'a>],
    ) -> (Vec<PendingWrite<'a>>, i64) {
        let limits = self.limits();
        let max = i64::try_from(limits.max_pending_subscriptions).unwrap_or(i64::MAX);
        let writes = changes
            .iter()
            .map(|c| match *c {
                PendingChange::Keep {
                    owner,
                    sender,
                    stanza,
                } => PendingWrite {
                    owner,
                    sender,
                    keep: Some(stored_request(
                        stanza,
                        limits.max_subscription_status_length,
                    )),
                },
                PendingChange::Drop { owner, sender } => PendingWrite {
                    owner,
                    sender,
                    keep: None,
                },
            })
            .collect();
        (writes, max)
    }

    /// Keeps the request stanza from `from` (a bare JID) for `owner`, cut to what
    /// [`stored_request`] keeps. Returns false, keeping nothing new, if a request from
    /// `from` is already waiting (the first one stays) or `owner` already has
    /// `max_pending_subscriptions` waiting.
    pub async fn add_pending_subscription(
        &self,
        owner: &str,
        from: &str,
        stanza_xml: &str,
    ) -> Result<bool, StoreError> {
        let (writes, max) = self.pending_writes(&[PendingChange::Keep {
            owner,
            sender: from,
            stanza: stanza_xml,
        }]);
        let stanza = writes[0].keep.as_deref().unwrap_or_default();
        let pool = pg_or_sqlite!(self, |db| db
            .add_pending_subscription(owner, from, stanza, max));
        let mut tx = pool.begin().await?;
        let added = keep(&mut *tx, owner, from, stanza, max).await?;
        tx.commit().await?;
        Ok(added)
    }

    /// Whether a request from `from` waits for `owner`.
    pub async fn has_pending_subscription(
        &self,
        owner: &str,
        from: &str,
    ) -> Result<bool, StoreError> {
        let pool = pg_or_sqlite!(self, |db| db.has_pending_subscription(owner, from));
        let mut conn = pool.acquire().await?;
        conn.is_waiting(owner, from).await
    }

    /// Requests waiting for `owner`, oldest first, as (from, stanza_xml); at most
    /// `max_pending_subscriptions` of them (more can only be left from before that limit
    /// existed; they come in turn as the older ones are answered).
    pub async fn pending_subscriptions(
        &self,
        owner: &str,
    ) -> Result<Vec<(String, String)>, StoreError> {
        let max = i64::try_from(self.limits().max_pending_subscriptions).unwrap_or(i64::MAX);
        let pool = pg_or_sqlite!(self, |db| db.pending_subscriptions(owner, max));
        let rows = sqlx::query_as(
            "SELECT sender, stanza FROM pending_subscriptions
             WHERE owner = $1 ORDER BY received_at, sender LIMIT $2",
        )
        .bind(owner)
        .bind(max)
        .fetch_all(pool)
        .await?;
        Ok(rows)
    }

    /// Drops the request from `from` once the user answered it (subscribed/unsubscribed)
    /// or the contact cancelled it. Returns false if none was waiting.
    pub async fn remove_pending_subscription(
        &self,
        owner: &str,
        from: &str,
    ) -> Result<bool, StoreError> {
        let pool = pg_or_sqlite!(self, |db| db.remove_pending_subscription(owner, from));
        let mut conn = pool.acquire().await?;
        conn.delete(owner, from).await
    }
}

/// The statements on waiting requests of one backend's connection; the rules that use
/// them are written once ([`keep`], [`write_all`]).
pub(super) trait PendingSql {
    /// Holds `owner`'s other writers off until the transaction ends, so the count
    /// [`PendingSql::insert_if_room`] reads cannot change before its insert.
    async fn lock_owner(&mut self, owner: &str) -> Result<(), StoreError>;
    /// Inserts the request from `sender` unless one from `sender` waits already (the first
    /// one stays) or `owner` has `max` waiting; whether it was inserted.
    async fn insert_if_room(
        &mut self,
        owner: &str,
        sender: &str,
        stanza: &str,
        max: i64,
    ) -> Result<bool, StoreError>;
    /// Whether a request from `sender` waits for `owner`.
    async fn is_waiting(&mut self, owner: &str, sender: &str) -> Result<bool, StoreError>;
    /// Drops the request from `sender`; whether one was waiting.
    async fn delete(&mut self, owner: &str, sender: &str) -> Result<bool, StoreError>;
}

/// Keeps one request (already cut, [`stored_request`]) inside the caller's transaction
/// (see [`Store::add_pending_subscription`]); whether it was added. A request not kept
/// for the count, not because one from `from` waits, is logged ([`log_not_kept`]).
pub(super) async fn keep<C: PendingSql>(
    conn: &mut C,
    owner: &str,
    from: &str,
    stanza: &str,
    max: i64,
) -> Result<bool, StoreError> {
    conn.lock_owner(owner).await?;
    let added = conn.insert_if_room(owner, from, stanza, max).await?;
    if !added && !conn.is_waiting(owner, from).await? {
        log_not_kept(owner, from, max);
    }
    Ok(added)
}

/// Applies `writes` inside the caller's transaction, in order.
pub(super) async fn write_all<C: PendingSql>(
    conn: &mut C,
    writes: &[PendingWrite<'_>],
    max: i64,
) -> Result<(), StoreError> {
    for w in writes {
        match &w.keep {
            Some(stanza) => keep(conn, w.owner, w.sender, stanza, max).await?,
            None => conn.delete(w.owner, w.sender).await?,
        };
    }
    Ok(())
}

impl PendingSql for sqlx::PgConnection {
    async fn lock_owner(&mut self, owner: &str) -> Result<(), StoreError> {
        // The owner's version row, which serialises writers of the same owner.
        sqlx::query("SELECT 1 FROM roster_versions WHERE owner = $1 FOR UPDATE")
            .bind(owner)
            .execute(&mut *self)
            .await?;
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
             SELECT $1, $2, $3
             WHERE (SELECT count(*) FROM pending_subscriptions WHERE owner = $1) < $4
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
        let found: Option<i32> = sqlx::query_scalar(
            "SELECT 1 FROM pending_subscriptions WHERE owner = $1 AND sender = $2",
        )
        .bind(owner)
        .bind(sender)
        .fetch_optional(&mut *self)
        .await?;
        Ok(found.is_some())
    }

    async fn delete(&mut self, owner: &str, sender: &str) -> Result<bool, StoreError> {
        let result =
            sqlx::query("DELETE FROM pending_subscriptions WHERE owner = $1 AND sender = $2")
                .bind(owner)
                .bind(sender)
                .execute(&mut *self)
                .await?;
        Ok(result.rows_affected() > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Waiting requests in memory, with the statements' meaning, and what was asked in
    /// which order.
    #[derive(Default)]
    struct Rows {
        waiting: Vec<(String, String)>,
        asked: Vec<String>,
    }

    impl PendingSql for Rows {
        async fn lock_owner(&mut self, owner: &str) -> Result<(), StoreError> {
            self.asked.push(format!("lock {owner}"));
            Ok(())
        }

        async fn insert_if_room(
            &mut self,
            owner: &str,
            sender: &str,
            _stanza: &str,
            max: i64,
        ) -> Result<bool, StoreError> {
            self.asked.push(format!("insert {owner} {sender}"));
            let held = self.waiting.iter().filter(|(o, _)| o == owner).count();
            let there = self.waiting.iter().any(|(o, s)| o == owner && s == sender);
            if there || i64::try_from(held).unwrap() >= max {
                return Ok(false);
            }
            self.waiting.push((owner.to_owned(), sender.to_owned()));
            Ok(true)
        }

        async fn is_waiting(&mut self, owner: &str, sender: &str) -> Result<bool, StoreError> {
            self.asked.push(format!("waiting {owner} {sender}"));
            Ok(self.waiting.iter().any(|(o, s)| o == owner && s == sender))
        }

        async fn delete(&mut self, owner: &str, sender: &str) -> Result<bool, StoreError> {
            self.asked.push(format!("delete {owner} {sender}"));
            let before = self.waiting.len();
            self.waiting.retain(|(o, s)| !(o == owner && s == sender));
            Ok(self.waiting.len() < before)
        }
    }

    #[tokio::test]
    async fn a_request_is_counted_under_the_owners_lock_and_a_refusal_asks_why() {
        let mut rows = Rows::default();
        assert!(keep(&mut rows, "u@h", "a@x", "<presence/>", 1)
            .await
            .unwrap());
        assert_eq!(rows.asked, ["lock u@h", "insert u@h a@x"]);
        // Not kept: whether one from the sender waits tells the count from a repeat.
        rows.asked.clear();
        assert!(!keep(&mut rows, "u@h", "b@x", "<presence/>", 1)
            .await
            .unwrap());
        assert_eq!(
            rows.asked,
            ["lock u@h", "insert u@h b@x", "waiting u@h b@x"]
        );
    }

    #[tokio::test]
    async fn writes_are_applied_in_order_keeps_and_drops_alike() {
        let mut rows = Rows::default();
        let writes = [
            PendingWrite {
                owner: "u@h",
                sender: "a@x",
                keep: Some("<presence/>".to_owned()),
            },
            PendingWrite {
                owner: "u@h",
                sender: "a@x",
                keep: None,
            },
            PendingWrite {
                owner: "u@h",
                sender: "b@x",
                keep: Some("<presence/>".to_owned()),
            },
        ];
        write_all(&mut rows, &writes, 5).await.unwrap();
        assert_eq!(rows.waiting, [("u@h".to_owned(), "b@x".to_owned())]);
        assert_eq!(
            rows.asked,
            [
                "lock u@h",
                "insert u@h a@x",
                "delete u@h a@x",
                "lock u@h",
                "insert u@h b@x"
            ]
        );
    }

    #[test]
    fn a_stored_request_keeps_type_one_status_and_the_nick_cut_to_length() {
        let xml = "<presence xmlns='jabber:server' type='subscribe' from='a@b.example' \
                   to='c@d.example' id='x'><status>héllo wörld</status><status xml:lang='de'>\
                   zwei</status><nick xmlns='http://jabber.org/protocol/nick'>ñickname</nick>\
                   <x xmlns='urn:example'>big</x><priority>3</priority></presence>";
        let kept = crate::protocol::xml::parse_element(&stored_request(xml, 5)).unwrap();
        assert_eq!(kept.ns, NS_CLIENT);
        assert_eq!(kept.get_attr("type"), Some("subscribe"));
        assert_eq!(kept.get_attr("from"), Some("a@b.example"));
        assert_eq!(kept.get_attr("to"), Some("c@d.example"));
        let kids: Vec<(String, String)> = kept
            .elements()
            .map(|c| (c.name.clone(), c.text_content()))
            .collect();
        assert_eq!(
            kids,
            [
                ("status".to_owned(), "héllo".to_owned()),
                ("nick".to_owned(), "ñickn".to_owned())
            ]
        );
    }

    #[test]
    fn a_request_without_status_or_unparseable_keeps_only_its_type() {
        let bare = stored_request("<presence type='subscribe'/>", 10);
        assert_eq!(
            crate::protocol::xml::parse_element(&bare)
                .unwrap()
                .elements()
                .count(),
            0
        );
        let junk = crate::protocol::xml::parse_element(&stored_request("<presence", 10)).unwrap();
        assert_eq!(junk.get_attr("type"), Some("subscribe"));
    }
}
