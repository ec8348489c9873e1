//! Applies roster changes made outside this process — by an operator's SQL migration, the
//! `presenced_roster_*` SQL functions, or another node — to the sessions on this node.
//!
//! Every roster change fires `NOTIFY presenced_roster, '<version> <owner>'` from a trigger
//! (migrations/0002; on SQLite the trigger writes the same to `presenced_changes`, which
//! `store::notify` polls). Each session remembers the newest roster version it was sent
//! ([`crate::sessions::PresenceInfo::roster_ver`]); a notification newer than that means the
//! session missed a change, so it gets the roster pushes (RFC 6121 §2.1.6) for exactly the
//! changes since its version. Changes this node pushed itself are already at the session's
//! version and are skipped.
//!
//! The presence a client-made change would have produced follows whatever the client
//! fetched: a contact that became visible (`to`/`both`) sends its current presence, one
//! that stopped being visible sends unavailable from each resource the user was shown
//! (RFC 6121 §3.2.2 / §3.3.3), as the privacy gate re-decides for the owner.

use std::sync::Arc;

use crate::node::Shared;
use crate::store::notify::{self, parse_roster_notification, ROSTER_CHANNEL};
use crate::store::RosterChange;
use crate::xml::Element;

/// Listens for roster notifications until shutdown.
pub async fn run(shared: Arc<Shared>) {
    let db = &shared.config.database;
    let options = notify::ListenOptions::from_config(db);
    let mut rx = match notify::listen_with(&db.url, &[ROSTER_CHANNEL], options).await {
        Ok(rx) => rx,
        Err(e) => {
            tracing::error!(error = %e, "cannot LISTEN for roster changes; SQL-made changes reach clients at their next login");
            // Without notifications another node's roster change would not reach the gate's
            // cached inputs: read them for every presence change instead.
            shared
                .store
                .set_audience_cache_ttl(std::time::Duration::ZERO);
            return;
        }
    };
    loop {
        let n = tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            n = rx.recv() => n,
        };
        let Some(n) = n else { return };
        if n.is_resync() {
            // Notifications may have been lost while disconnected: check everyone online.
            shared.store.forget_all_audiences();
            for owner in shared.sessions.users() {
                sync_user(&shared, &owner, i64::MAX).await;
                sync_presence(&shared, &owner).await;
            }
            continue;
        }
        if let Some((version, owner)) = parse_roster_notification(&n.payload) {
            // Before anything acts on the change, the gate's inputs it may alter go: the
            // owner's, and those of everyone with the owner on their roster, since a
            // subscription changes both sides' items and the two notifications may be
            // handled apart (the contact's first).
            shared.store.forget_audiences_naming(&owner);
            sync_user(&shared, &owner, version).await;
            sync_presence(&shared, &owner).await;
        }
    }
}

/// Brings every session of `owner` up to `version` (or to the current version for
/// `i64::MAX`).
pub async fn sync_user(shared: &Shared, owner: &str, version: i64) {
    let _lock = shared.roster_locks.lock(&[owner]).await;
    let sessions = shared.sessions.of_user_str(owner);
    // The oldest version any session of the user has seen; presence effects are computed
    // once per user from there.
    let Some(seen) = sessions
        .iter()
        .filter_map(|s| s.read(|p| p.roster_ver))
        .min()
    else {
        return;
    };
    if seen >= version {
        return;
    }
    let (current, changes) = match shared.store.roster_since(owner, seen).await {
        Ok(Some(r)) => r,
        Ok(None) => return,
        Err(e) => {
            tracing::warn!(owner, error = %e, "roster sync failed");
            return;
        }
    };
    if changes.is_empty() {
        return;
    }
    tracing::info!(
        owner,
        changes = changes.len(),
        version = current,
        seen,
        notified = version,
        "pushing roster changes made outside this node"
    );
    tracing::debug!(owner, ?changes, "roster changes");
    for s in &sessions {
        let Some(ver) = s.read(|p| p.roster_ver) else {
            continue;
        };
        if ver >= current {
            continue;
        }
        for change in &changes {
            let item = match change {
                RosterChange::Upsert(i) => crate::roster_push::item_element(i),
                RosterChange::Removed(c) => Element::new("item", crate::xml::NS_ROSTER)
                    .attr("jid", c.clone())
                    .attr("subscription", "remove"),
            };
            crate::roster_push::push_to(s, current, item);
        }
    }
}

/// The presence consequences of a roster change made outside this node: withdrawn from
/// each viewer that lost permission, from the resources it was shown, and granted to
/// those that gained it ([`crate::presence::gate::reconcile_user`]). They follow the
/// stored rosters, not the versions a client fetched: a client that never asked for its
/// roster sees its contacts' presence come and go all the same.
///
/// Under the owner's roster lock, like every subscription change: a change this node made
/// itself has delivered its stanzas in RFC 6121 order (e.g. `subscribed` before the
/// presence that follows it, §3.1.5) before this re-decides, and then finds nothing to do.
async fn sync_presence(shared: &Shared, owner: &str) {
    if shared.sessions.of_user_str(owner).is_empty() {
        return;
    }
    let _lock = shared.roster_locks.lock(&[owner]).await;
    crate::presence::gate::reconcile_user(shared, owner).await;
}
