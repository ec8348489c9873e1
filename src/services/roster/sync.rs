//! Hears of roster changes made outside this process — by an operator's SQL migration, the
//! `presenced_roster_*` SQL functions, or another node — and has the subscription executor
//! apply them to the sessions on this node ([`crate::services::presence::executor::apply_external`]).
//!
//! Every roster change fires `NOTIFY presenced_roster, '<version> <owner>'` from a trigger
//! (migrations/0002; on SQLite the trigger writes the same to `presenced_changes`, which
//! `store::notify` polls). Each session remembers the newest roster version it was sent
//! ([`crate::node::sessions::SessionState::roster_ver`]); a notification newer than that means the
//! session missed a change, so it gets the roster pushes (RFC 6121 §2.1.6) for exactly the
//! changes since its version. Changes this node pushed itself are already at the session's
//! version and are skipped.
//!
//! The presence a client-made change would have produced follows whatever the client
//! fetched: a contact that became visible (`to`/`both`) sends its current presence, one
//! that stopped being visible sends unavailable from each resource the user was shown
//! (RFC 6121 §3.2.2 / §3.3.3), as the privacy gate re-decides for the owner.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::config::DatabaseConfig;
use crate::node::sessions::Sessions;
use crate::services::presence::Presence;
use crate::store::notify::{self, parse_roster_notification, ROSTER_CHANNEL};
use crate::store::Store;

/// Listens for roster notifications on `db` until `shutdown`, and has `presence` apply each
/// change to this node's `sessions`; `store` holds the gate's cached inputs it invalidates.
pub(crate) async fn run(
    db: DatabaseConfig,
    store: Store,
    sessions: Arc<Sessions>,
    presence: Arc<Presence>,
    shutdown: CancellationToken,
) {
    let options = notify::ListenOptions::from_config(&db);
    let mut rx = match notify::listen_with(&db.url, &[ROSTER_CHANNEL], options).await {
        Ok(rx) => rx,
        Err(e) => {
            tracing::error!(error = %e, "cannot LISTEN for roster changes; SQL-made changes reach clients at their next login");
            // Without notifications another node's roster change would not reach the gate's
            // cached inputs: read them for every presence change instead.
            store.set_audience_cache_ttl(std::time::Duration::ZERO);
            return;
        }
    };
    loop {
        let n = tokio::select! {
            _ = shutdown.cancelled() => return,
            n = rx.recv() => n,
        };
        let Some(n) = n else { return };
        if n.is_resync() {
            // Notifications may have been lost while disconnected: check everyone online.
            store.forget_all_audiences();
            for owner in sessions.users() {
                presence.apply_external(&owner, i64::MAX).await;
            }
            continue;
        }
        if let Some((version, owner)) = parse_roster_notification(&n.payload) {
            // Before anything acts on the change, the gate's inputs it may alter go: the
            // owner's, and those of everyone with the owner on their roster, since a
            // subscription changes both sides' items and the two notifications may be
            // handled apart (the contact's first).
            store.forget_audiences_naming(&owner);
            presence.apply_external(&owner, version).await;
        }
    }
}
