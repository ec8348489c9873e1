//! Last activity (XEP-0012) as a service: the flush task of the last-seen batcher and the
//! answer to `jabber:iq:last`, which asks the privacy gate first.

use std::sync::Arc;
use std::time::Duration;

use crate::liveness::last_seen::NS_LAST;
use crate::liveness::Liveness;
use crate::node::session::Client;
use crate::protocol::error::{iq_result, StanzaError};
use crate::protocol::jid::BareJid;
use crate::protocol::xml::Element;
use crate::services::lifecycle::Lifecycle;
use crate::services::presence::Presence;
use crate::store::Store;

/// Flushes every `last_seen_flush`; at shutdown waits for grace periods, then flushes.
pub async fn run(life: Arc<Lifecycle>) {
    let mut tick = tokio::time::interval(life.liveness.timings.flush);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = life.shutdown.cancelled() => break,
        }
        life.liveness
            .last_seen
            .flush(&life.store, &life.liveness.metrics)
            .await;
        life.liveness
            .metrics
            .flush_rounds
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    life.liveness.wait_grace(Duration::from_secs(3)).await;
    life.liveness
        .last_seen
        .flush(&life.store, &life.liveness.metrics)
        .await;
}

/// The XEP-0012 service: last activity of local accounts, from the liveness state's
/// last-seen batcher and the store, behind the privacy gate.
pub struct LastSeen {
    liveness: Arc<Liveness>,
    store: Store,
    presence: Arc<Presence>,
}

impl LastSeen {
    /// The service over the node's liveness state, store and presence.
    pub fn new(liveness: Arc<Liveness>, store: Store, presence: Arc<Presence>) -> Self {
        LastSeen {
            liveness,
            store,
            presence,
        }
    }

    /// THE permission check for last activity: may `viewer` learn when `subject` was last
    /// online? XEP-0012 §3: only an entity authorised to see the user's presence, normally
    /// via a subscription (the subject's roster item for the viewer says `from` or `both`).
    /// The user may always ask about their own account. The privacy gate adds the
    /// `last-seen` setting, blocks and reciprocity (README, "Privacy").
    pub async fn may_see_last_activity(&self, viewer: &BareJid, subject: &BareJid) -> bool {
        // Settings, blocks and reciprocity, read fresh (subscription included).
        self.presence.may_see_last_seen(viewer, subject).await
    }

    /// Answers `<iq type='get'><query xmlns='jabber:iq:last'/></iq>` addressed to local
    /// account `subject` (XEP-0012 §3, offline user query).
    pub async fn handle_iq(&self, session: &Client, iq: &Element, subject: &BareJid) -> Element {
        let viewer = session.jid().to_bare();
        if !self.may_see_last_activity(&viewer, subject).await {
            // XEP-0012 §3: not authorised → forbidden (also for unknown accounts, so
            // existence does not leak).
            return StanzaError::forbidden()
                .reply_to(iq)
                .unwrap_or_else(|| iq_result(iq));
        }
        // "Online now" (seconds='0') is the online signal: only for a viewer who may see
        // it, and never because of an invisible session; anyone else gets the offline
        // answer.
        let online = self.presence.visible_to(session.jid(), subject).await;
        let query = Element::new("query", NS_LAST);
        if online {
            // XEP-0012 §3: a user with an available resource has been idle for 0 seconds
            // here.
            return iq_result(iq).child(query.attr("seconds", "0"));
        }
        match crate::liveness::last_seen::when(&self.liveness, &self.store, subject.as_str()).await
        {
            Some(ls) => {
                let secs = (self.liveness.clock.now() - ls.at).num_seconds().max(0);
                let mut q = query.attr("seconds", secs.to_string());
                if let Some(status) = ls.status {
                    q = q.text(status);
                }
                iq_result(iq).child(q)
            }
            None => StanzaError::item_not_found()
                .reply_to(iq)
                .unwrap_or_else(|| iq_result(iq)),
        }
    }
}
