//! `presenced copy-store`: every account (with its SCRAM credentials, never a password),
//! roster item, waiting subscription request, block-list entry, privacy setting, last
//! seen, XEP-0163 node and item, XEP-0054 vCard, XEP-0160 offline message (with its time
//! and sender, so it is handed out as it would have been) and server secret from one store
//! to another, in either direction between PostgreSQL and SQLite.
//!
//! It goes through the store's own reads and writes, so each side's schema checks what
//! arrives and its triggers version the copied rosters afresh (a client's cached roster
//! version from the old store is then older than the new floor and it gets the full
//! roster, XEP-0237 §2.3). Limits are lifted on both sides for the copy: what the source
//! holds is copied whole, even data stored before a limit existed.
//!
//! The destination must not hold any of the source's accounts: an account that exists
//! there stops the copy ([`StoreError::AccountExists`]) rather than mixing two rosters.
//! The copy is not one transaction; run it while no server uses either store.

use super::{RosterItem, Store, StoreError, StoreLimits};
use crate::protocol::sasl::scram::ScramHash;

/// How much [`copy`] moved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CopyCounts {
    /// Accounts, with their credentials.
    pub accounts: usize,
    /// Roster items.
    pub roster_items: usize,
    /// Waiting inbound subscription requests.
    pub pending: usize,
    /// Block-list entries.
    pub blocks: usize,
    /// Accounts with privacy settings other than the defaults.
    pub privacy: usize,
    /// Last-seen values.
    pub last_seen: usize,
    /// Server secrets.
    pub secrets: usize,
    /// XEP-0163 items (their nodes come with them).
    pub pep_items: usize,
    /// XEP-0054 vCards.
    pub vcards: usize,
    /// XEP-0160 offline messages.
    pub offline_messages: usize,
}

/// Limits that refuse and cut nothing, for a copy.
fn unlimited() -> StoreLimits {
    StoreLimits {
        max_roster_items: i64::MAX,
        // PostgreSQL array subscripts are 32-bit.
        max_roster_groups: i32::MAX as usize,
        max_roster_group_length: usize::MAX,
        max_roster_name_length: usize::MAX,
        max_pending_subscriptions: usize::MAX,
        max_subscription_status_length: usize::MAX,
        max_blocklist_items: usize::MAX,
        offline: super::offline::OfflineQuota {
            messages: usize::MAX,
            bytes: usize::MAX,
            contact_messages: usize::MAX,
            contact_bytes: usize::MAX,
            stranger_messages: usize::MAX,
            stranger_bytes: usize::MAX,
        },
        max_pep_nodes: usize::MAX,
        max_pep_items: usize::MAX,
        max_pep_bytes: usize::MAX,
    }
}

/// Copies everything `from` holds into `to` (see the module documentation).
pub async fn copy(from: &Store, to: &Store) -> Result<CopyCounts, StoreError> {
    let (from_limits, to_limits) = (from.limits(), to.limits());
    from.set_limits(unlimited());
    to.set_limits(unlimited());
    let result = copy_unlimited(from, to).await;
    from.set_limits(from_limits);
    to.set_limits(to_limits);
    result
}

async fn copy_unlimited(from: &Store, to: &Store) -> Result<CopyCounts, StoreError> {
    let mut n = CopyCounts::default();
    for (name, value) in from.server_secrets().await? {
        to.import_server_secret(&name, &value).await?;
        n.secrets += 1;
    }
    let accounts = from.accounts().await?;
    // Accounts first: roster items and requests of one account may name another.
    for (username, domain) in &accounts {
        let mut creds = Vec::new();
        for hash in ScramHash::ALL {
            if let Some(c) = from.scram_credentials(username, domain, hash).await? {
                creds.push((hash, c));
            }
        }
        to.import_account(username, domain, &creds).await?;
        n.accounts += 1;
    }
    let mut seen = Vec::new();
    for (username, domain) in &accounts {
        let jid = format!("{username}@{domain}");
        let (_, items) = from.roster(&jid).await?;
        n.roster_items += items.len();
        // The store's many-item upsert, so one transaction per roster: one per item made
        // SQLite commit (and sync) the file once per item, about 240 items/s, hours for a
        // store of millions of items.
        let roster: Vec<(String, RosterItem)> =
            items.into_iter().map(|item| (jid.clone(), item)).collect();
        if !roster.is_empty() {
            to.apply_subscription_change(&roster).await?;
        }
        // Oldest first, so the destination keeps their order.
        for (sender, stanza) in from.pending_subscriptions(&jid).await? {
            to.add_pending_subscription(&jid, &sender, &stanza).await?;
            n.pending += 1;
        }
        let blocked: Vec<String> = from
            .blocklist(&jid)
            .await?
            .iter()
            .map(|b| b.to_string())
            .collect();
        to.block(&jid, &blocked).await?;
        n.blocks += blocked.len();
        let settings = from.privacy_settings(&jid).await?;
        if settings != Default::default() {
            to.set_privacy_settings(&jid, &settings).await?;
            n.privacy += 1;
        }
        for (node, model) in from.pep_nodes(&jid).await? {
            let mut items = from.pep_items(&jid, &node, &[], usize::MAX).await?;
            // Oldest first, so the newest stays the newest (the last item sent).
            items.reverse();
            for item in &items {
                to.pep_publish(&jid, &node, Some(model), item).await?;
            }
            n.pep_items += items.len();
        }
        if let Some(vcard) = from.vcard(&jid).await? {
            to.set_vcard(&jid, &vcard).await?;
            n.vcards += 1;
        }
        for (message, from_contact) in from.offline_messages(&jid).await? {
            to.import_offline_message(&jid, &message, from_contact)
                .await?;
            n.offline_messages += 1;
        }
        if let Some(seen_there) = from.last_seen(&jid).await? {
            seen.push(seen_there);
        }
    }
    n.last_seen = usize::try_from(to.record_last_seen_batch(&seen).await?).unwrap_or(0);
    Ok(n)
}
