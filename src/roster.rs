//! RFC 6121 §2 roster management: get (with XEP-0237 versioning), set, remove, and roster
//! pushes to every interested resource of the owner. One store transaction per change.

use crate::c2s::Session;
use crate::error::{iq_result, StanzaError};
use crate::jid::BareJid;
use crate::server::Shared;
use crate::sessions::SessionHandle;
use crate::store::{RosterChange, RosterItem, StoreError};
use crate::xml::{Element, NS_CLIENT, NS_ROSTER};

/// `<item/>` for a roster result or push (RFC 6121 §2.1.2).
pub fn item_element(item: &RosterItem) -> Element {
    let mut e = Element::new("item", NS_ROSTER)
        .attr("jid", item.contact.clone())
        .attr("subscription", item.subscription.as_str());
    if let Some(name) = &item.name {
        e.set_attr("name", name.clone());
    }
    if let Some(ask) = item.sub_state().ask() {
        e.set_attr("ask", ask);
    }
    if item.preapproved {
        // RFC 6121 §3.4: approved='true' tells the client a pre-approval is in place.
        e.set_attr("approved", "true");
    }
    for g in &item.groups {
        e = e.child(Element::new("group", NS_ROSTER).text(g.clone()));
    }
    e
}

/// Sends a roster push (RFC 6121 §2.1.6) for `item` to every interested resource of `owner`.
pub fn push(shared: &Shared, owner: &str, version: i64, item: Element) {
    for s in shared.sessions.of_user_str(owner) {
        if s.read(|p| p.interested) {
            push_to(&s, version, item.clone());
        }
    }
}

/// Sends one roster push to one session and records the version it now has.
pub fn push_to(session: &SessionHandle, version: i64, item: Element) {
    let iq = Element::new("iq", NS_CLIENT)
        .attr("type", "set")
        .attr("id", format!("push{}", crate::xml::new_id()))
        .attr("to", session.jid.to_string())
        .child(
            Element::new("query", NS_ROSTER)
                .attr("ver", version.to_string())
                .child(item),
        );
    note_version(session, version);
    session.send(iq);
}

/// Records that `session` has seen roster version `version`.
pub(crate) fn note_version(session: &SessionHandle, version: i64) {
    if let Ok(mut p) = session.info.lock() {
        p.roster_ver = Some(p.roster_ver.map_or(version, |v| v.max(version)));
    }
}

/// Push for an item that changed.
pub fn push_item(shared: &Shared, owner: &str, version: i64, item: &RosterItem) {
    push(shared, owner, version, item_element(item));
}

/// Push for an item that was removed (`subscription='remove'`, RFC 6121 §2.5.2).
pub fn push_removed(shared: &Shared, owner: &str, version: i64, contact: &str) {
    let item = Element::new("item", NS_ROSTER)
        .attr("jid", contact)
        .attr("subscription", "remove");
    push(shared, owner, version, item);
}

/// The stanza error for a roster write the store refused; subscription paths that create
/// items answer a full roster with it too ([`subscription_refused`]).
pub(crate) fn store_failed(e: StoreError) -> StanzaError {
    match e {
        StoreError::Constraint(c) => StanzaError::bad_request().with_text(c),
        // The roster size limit is a policy of this server, the same for every way an item
        // is created; not-allowed (cancel) says retrying will not help.
        StoreError::RosterFull => StanzaError::not_allowed().with_text("roster is full"),
        other => {
            tracing::error!(error = %other, "roster store failure");
            StanzaError::internal_server_error()
        }
    }
}

/// Handles a `jabber:iq:roster` iq from the owner's own session. Returns the reply, or
/// `None` when it was already sent (versioned get: result first, then the pushes).
pub async fn handle(session: &mut Session, iq: &Element, query: &Element) -> Option<Element> {
    let result = match iq.get_attr("type") {
        Some("get") => get(session, iq, query).await,
        Some("set") => set(session, iq, query).await,
        _ => Err(StanzaError::bad_request()),
    };
    match result {
        Ok(reply) => reply,
        Err(e) => e.reply_to(iq),
    }
}

async fn get(
    session: &mut Session,
    iq: &Element,
    query: &Element,
) -> Result<Option<Element>, StanzaError> {
    let owner = session.jid().to_bare().to_string();
    if let Ok(mut p) = session.handle.info.lock() {
        // RFC 6121 §2.1.6: a resource that requested the roster is "interested".
        p.interested = true;
    }
    let store = &session.shared.store;
    if let Some(ver) = query.get_attr("ver") {
        // XEP-0237 §2.3: with a known version, answer empty and push only the changes.
        if let Ok(v) = ver.parse::<i64>() {
            if let Some((current, changes)) =
                store.roster_since(&owner, v).await.map_err(store_failed)?
            {
                let reply = iq_result(iq);
                session.deliver(reply);
                for change in changes {
                    let item = match &change {
                        RosterChange::Upsert(i) => item_element(i),
                        RosterChange::Removed(c) => Element::new("item", NS_ROSTER)
                            .attr("jid", c.clone())
                            .attr("subscription", "remove"),
                    };
                    let iq = Element::new("iq", NS_CLIENT)
                        .attr("type", "set")
                        .attr("id", format!("push{}", crate::xml::new_id()))
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
    let (version, items) = store.roster(&owner).await.map_err(store_failed)?;
    note_version(&session.handle, version);
    let mut q = Element::new("query", NS_ROSTER).attr("ver", version.to_string());
    for item in &items {
        q = q.child(item_element(item));
    }
    Ok(Some(iq_result(iq).child(q)))
}

async fn set(
    session: &mut Session,
    iq: &Element,
    query: &Element,
) -> Result<Option<Element>, StanzaError> {
    // RFC 6121 §2.3.3: exactly one item.
    let mut items = query.elements().filter(|e| e.is("item", NS_ROSTER));
    let (Some(item), None) = (items.next(), items.next()) else {
        return Err(StanzaError::bad_request().with_text("a roster set carries exactly one item"));
    };
    let Some(jid) = item.get_attr("jid") else {
        return Err(StanzaError::bad_request().with_text("item without jid"));
    };
    let contact = match crate::jid::parse(jid) {
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
        remove(session, &owner, contact.as_str()).await?;
        return Ok(Some(iq_result(iq)));
    }
    // RFC 6121 §2.1.2.5: in a roster set the server MUST ignore every 'subscription' value
    // other than "remove" (stock clients such as slixmpp send subscription='none'), so any
    // other value leaves the stored state as it is. §2.1.2.2: a client MUST NOT send 'ask'.
    if item.get_attr("ask").is_some() {
        return Err(StanzaError::bad_request()
            .with_text("'ask' is managed by the server (RFC 6121 §2.1.2.2)"));
    }
    let (name, groups) = name_and_groups(item, &session.shared.config.limits).inspect_err(|e| {
        tracing::info!(peer = %session.peer, user = %owner, error = ?e, "roster set refused");
    })?;
    let shared = session.shared.clone();
    let _lock = shared.roster_locks.lock(&[owner.as_str()]).await;
    let store = &shared.store;
    let existing = store
        .roster_item(owner.as_str(), contact.as_str())
        .await
        .map_err(store_failed)?;
    // A new item beyond max_roster_items is refused by the store write itself.
    let mut new = existing.unwrap_or_else(|| RosterItem::new(contact.as_str()));
    new.name = name;
    new.groups = groups;
    let version = store
        .upsert_roster_item(owner.as_str(), &new)
        .await
        .map_err(store_failed)?;
    push_item(&shared, owner.as_str(), version, &new);
    Ok(Some(iq_result(iq)))
}

/// The name and groups of a roster-set item, within the per-item limits of `[limits]`.
///
/// RFC 6121 §2.3.3 answers a 'name' or a group longer than a server-configured limit, and
/// an empty group, with not-acceptable (type modify), and duplicate groups with
/// bad-request. It sets no bound on the number of groups; one item with thousands of them
/// costs every roster get, so that count is a server-configured limit too and gets the
/// same not-acceptable as the lengths. Lengths are in characters.
fn name_and_groups(
    item: &Element,
    limits: &crate::config::LimitsConfig,
) -> Result<(Option<String>, Vec<String>), StanzaError> {
    let name = item.get_attr("name").map(str::to_owned);
    if name
        .as_ref()
        .is_some_and(|n| n.chars().count() > limits.max_roster_name_length)
    {
        return Err(StanzaError::not_acceptable().with_text(format!(
            "an item name has at most {} characters",
            limits.max_roster_name_length
        )));
    }
    let mut groups: Vec<String> = Vec::new();
    for g in item.elements().filter(|e| e.is("group", NS_ROSTER)) {
        if groups.len() == limits.max_roster_groups {
            return Err(StanzaError::not_acceptable().with_text(format!(
                "an item is in at most {} groups",
                limits.max_roster_groups
            )));
        }
        let g = g.text_content();
        if g.is_empty() {
            return Err(StanzaError::not_acceptable().with_text("empty group name"));
        }
        if g.chars().count() > limits.max_roster_group_length {
            return Err(StanzaError::not_acceptable().with_text(format!(
                "a group name has at most {} characters",
                limits.max_roster_group_length
            )));
        }
        if groups.contains(&g) {
            return Err(StanzaError::bad_request().with_text("duplicate group"));
        }
        groups.push(g);
    }
    Ok((name, groups))
}

/// A subscription stanza from the user that the store refused: logged, and a full roster
/// is answered to the user's session with a presence error from the contact (RFC 6120
/// §8.3: an error stanza in reply to the stanza that caused it), the same not-allowed a
/// roster set gets. `contact` is the bare JID the stanza was addressed to.
pub fn subscription_refused(session: &Session, contact: &str, kind: &str, e: &StoreError) {
    if !matches!(e, StoreError::RosterFull) {
        tracing::warn!(user = %session.jid(), %contact, kind, error = %e, "subscription change failed");
        return;
    }
    tracing::info!(
        peer = %session.peer, user = %session.jid(), %contact, kind,
        "subscription refused: roster is full"
    );
    let stanza = Element::new("presence", NS_CLIENT)
        .attr("type", kind)
        .attr("from", session.jid().to_string())
        .attr("to", contact);
    if let Some(reply) = store_failed(StoreError::RosterFull).reply_to(&stanza) {
        session.handle.send(reply);
    }
}

/// RFC 6121 §2.5: removal cancels subscriptions in both directions on the user's behalf.
async fn remove(session: &mut Session, owner: &BareJid, contact: &str) -> Result<(), StanzaError> {
    let shared = session.shared.clone();
    let Some(existing) = shared
        .store
        .roster_item(owner.as_str(), contact)
        .await
        .map_err(store_failed)?
    else {
        // RFC 6121 §2.5.3.
        return Err(StanzaError::item_not_found());
    };
    crate::presence::roster_removed(session, &existing).await;
    let _lock = shared.roster_locks.lock(&[owner.as_str()]).await;
    match shared
        .store
        .remove_roster_item(owner.as_str(), contact)
        .await
    {
        Ok(Some(version)) => push_removed(&shared, owner.as_str(), version, contact),
        Ok(None) => {}
        Err(e) => return Err(store_failed(e)),
    }
    Ok(())
}
