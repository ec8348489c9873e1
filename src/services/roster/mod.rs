//! RFC 6121 §2 roster management: get (with XEP-0237 versioning), set, remove, and roster
//! pushes to every interested resource of the owner. One store transaction per change.

pub(crate) mod push;
pub(crate) mod sync;

pub(crate) use crate::services::roster::push::{item_element, push_item, push_removed};
pub(crate) use crate::services::roster::push::{note_version, store_failed};

use std::sync::Arc;

use crate::node::live::Live;
use crate::node::session::Client;
use crate::node::sessions::Sessions;
use crate::node::RosterLocks;
use crate::protocol::error::{iq_result, StanzaError};
use crate::protocol::jid::BareJid;
use crate::protocol::stanza::IqType;
use crate::protocol::xml::{Element, NS_CLIENT, NS_ROSTER};
use crate::services::presence::Presence;
use crate::store::blocks::match_candidates;
use crate::store::{RosterChange, RosterItem, Store};

/// The RFC 6121 §2 roster service: the owner's items in the store, written under the
/// owner's roster lock, pushed to the owner's interested resources, and the subscription
/// consequences of a removal.
pub struct Roster {
    store: Store,
    sessions: Arc<Sessions>,
    live: Arc<Live>,
    roster_locks: Arc<RosterLocks>,
    presence: Arc<Presence>,
}

impl Roster {
    /// The service over the node's store, session registry, limits, roster locks and
    /// presence.
    pub fn new(
        store: Store,
        sessions: Arc<Sessions>,
        live: Arc<Live>,
        roster_locks: Arc<RosterLocks>,
        presence: Arc<Presence>,
    ) -> Self {
        Roster {
            store,
            sessions,
            live,
            roster_locks,
            presence,
        }
    }

    /// Handles a `jabber:iq:roster` iq request of type `ty` from the owner's own session.
    /// Returns the reply, or `None` when it was already sent (versioned get: result first,
    /// then the pushes).
    pub async fn handle(
        &self,
        session: &Client,
        iq: &Element,
        ty: IqType,
        query: &Element,
    ) -> Option<Element> {
        let result = match ty {
            IqType::Get => self.get(session, iq, query).await,
            IqType::Set => self.set(session, iq, query).await,
            _ => Err(StanzaError::bad_request()),
        };
        match result {
            Ok(reply) => reply,
            Err(e) => e.reply_to(iq),
        }
    }

    async fn get(
        &self,
        session: &Client,
        iq: &Element,
        query: &Element,
    ) -> Result<Option<Element>, StanzaError> {
        let owner = session.jid().to_bare().to_string();
        // RFC 6121 §2.1.6: a resource that requested the roster is "interested".
        session.handle.write(|p| p.interested = true);
        let store = &self.store;
        if let Some(ver) = query.get_attr("ver") {
            // XEP-0237 §2.3: with a known version, answer empty and push only the changes.
            if let Ok(v) = ver.parse::<i64>() {
                if let Some((current, changes)) =
                    store.roster_since(&owner, v).await.map_err(store_failed)?
                {
                    // The session has the roster at `current` now: a change made in SQL or
                    // on another node after it is replayed from there (roster sync).
                    note_version(&session.handle, current);
                    let reply = iq_result(iq);
                    session.deliver(reply);
                    for change in changes {
                        let item = match &change {
                            RosterChange::Upsert(i) => item_element(i),
                            RosterChange::Removed(c) => Element::new("item", NS_ROSTER)
                                .attr("jid", c.as_str())
                                .attr("subscription", "remove"),
                        };
                        let iq = Element::new("iq", NS_CLIENT)
                            .attr("type", "set")
                            .attr("id", format!("push{}", crate::protocol::xml::new_id()))
                            .attr("to", session.jid().to_string())
                            .child(
                                Element::new("query", NS_ROSTER)
                                    .attr("ver", current.to_string())
                                    .child(item),
                            );
                        session.deliver(iq);
                    }
                    return Ok(None);
                }
            }
        }
        // RFC 6121 §2.2: a client asks for the roster before its initial presence, so a
        // session not yet available keeps the privacy gate's part of this one read for
        // that broadcast and its probes (the store's cache drops it on any change).
        let keep = !session.handle.is_available();
        let result = store
            .login_roster_for(
                &owner,
                session.handle.id,
                &match_candidates(session.jid().as_str()),
                keep,
                |version, items| {
                    note_version(&session.handle, version);
                    roster_result_xml(iq, version, items)
                },
            )
            .await
            .map_err(store_failed)?;
        session.deliver(result);
        Ok(None)
    }

    async fn set(
        &self,
        session: &Client,
        iq: &Element,
        query: &Element,
    ) -> Result<Option<Element>, StanzaError> {
        // RFC 6121 §2.3.3: exactly one item.
        let mut items = query.elements().filter(|e| e.is("item", NS_ROSTER));
        let (Some(item), None) = (items.next(), items.next()) else {
            return Err(
                StanzaError::bad_request().with_text("a roster set carries exactly one item")
            );
        };
        let Some(jid) = item.get_attr("jid") else {
            return Err(StanzaError::bad_request().with_text("item without jid"));
        };
        let contact = match crate::protocol::jid::parse(jid) {
            Ok(j) if j.resource().is_none() => j,
            Ok(_) => return Err(StanzaError::bad_request().with_text("roster items are bare JIDs")),
            Err(_) => return Err(StanzaError::jid_malformed()),
        };
        let owner = session.jid().to_bare();
        if contact.as_str() == owner.as_str() {
            return Err(StanzaError::not_allowed().with_text("you cannot add yourself"));
        }
        let subscription = item.get_attr("subscription");
        if subscription == Some("remove") {
            self.remove(session, &owner, contact.as_str()).await?;
            return Ok(Some(iq_result(iq)));
        }
        // RFC 6121 §2.1.2.5: in a roster set the server MUST ignore every 'subscription' value
        // other than "remove" (stock clients such as slixmpp send subscription='none'), so any
        // other value leaves the stored state as it is. §2.1.2.2: a client MUST NOT send 'ask'.
        if item.get_attr("ask").is_some() {
            return Err(StanzaError::bad_request()
                .with_text("'ask' is managed by the server (RFC 6121 §2.1.2.2)"));
        }
        let (name, groups) = name_and_groups(item, &self.live.get().limits).inspect_err(|e| {
            tracing::info!(peer = %session.peer, user = %owner, error = ?e, "roster set refused");
        })?;
        let _lock = self.roster_locks.lock(&[owner.as_str()]).await;
        let store = &self.store;
        let existing = store
            .roster_item(owner.as_str(), contact.as_str())
            .await
            .map_err(store_failed)?;
        // A new item beyond max_roster_items is refused by the store write itself.
        let mut new = existing.unwrap_or_else(|| RosterItem::new(contact.to_bare()));
        new.name = name;
        new.groups = groups;
        let version = store
            .upsert_roster_item(owner.as_str(), &new)
            .await
            .map_err(store_failed)?;
        push_item(&self.sessions, owner.as_str(), version, &new);
        Ok(Some(iq_result(iq)))
    }

    /// RFC 6121 §2.5: removal cancels subscriptions in both directions on the user's behalf.
    async fn remove(
        &self,
        session: &Client,
        owner: &BareJid,
        contact: &str,
    ) -> Result<(), StanzaError> {
        // Both users' locks, as for any subscription change: the item read, the cancel and
        // revoke it implies and its removal are one change of the pair.
        let _lock = self.roster_locks.lock(&[owner.as_str(), contact]).await;
        let Some(existing) = self
            .store
            .roster_item(owner.as_str(), contact)
            .await
            .map_err(store_failed)?
        else {
            // RFC 6121 §2.5.3.
            return Err(StanzaError::item_not_found());
        };
        self.presence.roster_removed(session, &existing).await;
        match self.store.remove_roster_item(owner.as_str(), contact).await {
            Ok(Some(version)) => push_removed(&self.sessions, owner.as_str(), version, contact),
            Ok(None) => {}
            Err(e) => return Err(store_failed(e)),
        }
        Ok(())
    }
}

/// The result of roster get `iq` (RFC 6121 §2.1.4): roster version `version` (XEP-0237)
/// and every item, serialised as the client stream carries it. One string, not an element
/// per item: a login of K contacts would otherwise allocate about eight short-lived
/// pieces per contact between the read and the write.
fn roster_result_xml(iq: &Element, version: i64, items: &[RosterItem]) -> String {
    let query = Element::new("query", NS_ROSTER).attr("ver", version.to_string());
    let mut xml = String::with_capacity(128 + 64 * items.len());
    iq_result(iq).write_wrapping(&mut xml, NS_CLIENT, NS_CLIENT, &mut |out| {
        query.write_wrapping(out, NS_CLIENT, NS_CLIENT, &mut |out| {
            for item in items {
                push::write_item(out, item);
            }
        })
    });
    xml
}

/// Why an item's name or groups are refused: beyond a per-item limit of `[limits]`, or
/// against RFC 6121 §2.1.2.3 (group names are non-empty and distinct).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ItemRefused {
    NameTooLong(usize),
    TooManyGroups(usize),
    EmptyGroup,
    GroupTooLong(usize),
    DuplicateGroup,
}

impl ItemRefused {
    /// RFC 6121 §2.3.3 answers a 'name' or a group longer than a server-configured limit,
    /// and an empty group, with not-acceptable (type modify), and duplicate groups with
    /// bad-request. It sets no bound on the number of groups; one item with thousands of
    /// them costs every roster get, so that count is a server-configured limit too and
    /// gets the same not-acceptable as the lengths. Lengths are in characters.
    fn stanza_error(&self) -> StanzaError {
        match self {
            ItemRefused::NameTooLong(max) => StanzaError::not_acceptable()
                .with_text(format!("an item name has at most {max} characters")),
            ItemRefused::TooManyGroups(max) => StanzaError::not_acceptable()
                .with_text(format!("an item is in at most {max} groups")),
            ItemRefused::EmptyGroup => StanzaError::not_acceptable().with_text("empty group name"),
            ItemRefused::GroupTooLong(max) => StanzaError::not_acceptable()
                .with_text(format!("a group name has at most {max} characters")),
            ItemRefused::DuplicateGroup => StanzaError::bad_request().with_text("duplicate group"),
        }
    }
}

/// The one check of an item's name and groups against the per-item limits, for every
/// way a client or an operator names them (the roster set, `presenced roster add`).
pub(crate) fn check_item(
    name: Option<&str>,
    groups: &[String],
    limits: &crate::store::StoreLimits,
) -> Result<(), ItemRefused> {
    if name.is_some_and(|n| n.chars().count() > limits.max_roster_name_length) {
        return Err(ItemRefused::NameTooLong(limits.max_roster_name_length));
    }
    for (i, g) in groups.iter().enumerate() {
        if i == limits.max_roster_groups {
            return Err(ItemRefused::TooManyGroups(limits.max_roster_groups));
        }
        if g.is_empty() {
            return Err(ItemRefused::EmptyGroup);
        }
        if g.chars().count() > limits.max_roster_group_length {
            return Err(ItemRefused::GroupTooLong(limits.max_roster_group_length));
        }
        if groups[..i].contains(g) {
            return Err(ItemRefused::DuplicateGroup);
        }
    }
    Ok(())
}

/// The name and groups of a roster-set item, within the per-item limits of `[limits]`
/// ([`check_item`]).
fn name_and_groups(
    item: &Element,
    limits: &crate::config::LimitsConfig,
) -> Result<(Option<String>, Vec<String>), StanzaError> {
    let name = item.get_attr("name").map(str::to_owned);
    let groups: Vec<String> = item
        .elements()
        .filter(|e| e.is("group", NS_ROSTER))
        .map(Element::text_content)
        .collect();
    let limits = crate::store::StoreLimits::from_config(limits);
    check_item(name.as_deref(), &groups, &limits).map_err(|e| e.stanza_error())?;
    Ok((name, groups))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::subscription::Subscription;
    use crate::protocol::xml::parse_element;

    fn item(contact: &str) -> RosterItem {
        RosterItem::new(crate::protocol::jid::parse_bare(contact).unwrap())
    }

    /// The roster result as it was built before it was written in place: an element per
    /// item under the query, under the iq result.
    fn built(iq: &Element, version: i64, items: &[RosterItem]) -> Element {
        let mut q = Element::new("query", NS_ROSTER).attr("ver", version.to_string());
        for i in items {
            q = q.child(item_element(i));
        }
        iq_result(iq).child(q)
    }

    fn roster_get() -> Element {
        Element::new("iq", NS_CLIENT)
            .attr("type", "get")
            .attr("id", "r<1>")
            .attr("from", "juliet@example.com/balcony")
    }

    #[test]
    fn the_written_roster_result_is_the_element_a_push_would_carry_per_item() {
        let mut plain = item("romeo@example.net");
        plain.subscription = Subscription::Both;
        let mut full = item("nurse@example.com");
        full.name = Some("Nurse & <'Angela'>".into());
        full.groups = vec!["Servants".into(), "a\"b".into()];
        full.pending_out = true;
        full.preapproved = true;
        let items = [plain, full];
        let iq = roster_get();
        let xml = roster_result_xml(&iq, 42, &items);
        assert_eq!(parse_element(&xml), Some(built(&iq, 42, &items)), "{xml}");
        assert!(xml.contains(" to='juliet@example.com/balcony'"), "{xml}");
        assert!(
            xml.contains("<query xmlns='jabber:iq:roster' ver='42'>"),
            "{xml}"
        );
    }

    #[test]
    fn an_empty_roster_result_is_an_empty_query() {
        let iq = roster_get();
        let xml = roster_result_xml(&iq, 0, &[]);
        assert_eq!(parse_element(&xml), Some(built(&iq, 0, &[])), "{xml}");
    }
}
