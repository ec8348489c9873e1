//! The privacy gate: loads what [`crate::policy::privacy::may_see`] needs and asks it, for every
//! path that could reveal a user's online status or last seen.
//!
//! [`super::privacy`] is pure; this module does the reading. Every decision reads the
//! subject's settings, the subject's roster item for the viewer and both block lists
//! fresh from PostgreSQL, except a broadcast by a resource that was already available, and
//! an initial presence that follows the roster get (whose read it uses), whose inputs come
//! from [`crate::store::audience_cache`]: every store write drops what it
//! alters before returning, so a block or a settings change is out of the cache before the
//! iq that made it is answered and the very next stanza on this node sees it; another
//! node's change reaches it by NOTIFY (that module says why the gap is safe).
//!
//! The reads are batched where one event needs many decisions, because round trips to
//! PostgreSQL were most of the server's CPU (a login with K contacts cost about 8 K
//! statements): a broadcast reads the subject's roster, settings and the blocks with
//! every contact in one statement ([`session_inputs`]), and a login's probes read
//! every probed contact's inputs in one statement ([`probe_answers`]). The decision itself
//! is the same pure call ([`decide_with`] → [`privacy::may_see`]) whichever way the inputs
//! were read. (The `presenced_block` / `presenced_privacy` NOTIFY channels are used for the
//! other half of "caches cannot outlive permissions": presence a viewer has *already been
//! shown* is withdrawn, see [`reconcile_user`].)
//!
//! What a viewer has already been shown is the one thing kept in memory, per session, in
//! [`Registry`]: the set of viewers each resource's available presence reached ("revealed
//! to"). When permissions change, [`reconcile_user`] re-asks the decision for every viewer
//! in that set and sends unavailable to those who lost permission, and current presence to
//! subscribers who gained it. The set is also how a block sends unavailable only to a
//! contact who had actually seen the user online (XEP-0191 §3.3) and nothing to one who
//! never had: an unavailable from a full JID would itself reveal that the resource was
//! online.
//!
//! Store failures fail closed: a viewer whose permission cannot be read sees nothing
//! (presence degrades, chat does not stall: a wrong "online" is a leak, a missing one is
//! corrected by the next change).
//!
//! The decisions take addresses as JIDs, not strings: a party in any form (a full JID
//! also matches full-JID block entries) is a [`Jid`], a local account a [`BareJid`], and
//! an audience is a set of bare JIDs. The store's rows hold strings; a roster contact or a
//! probed subject is parsed where it enters a decision, and one that is no JID is nobody's
//! audience (fails closed).
//!
//! Broadcast, probe answers, sending current presence and reconciling are serialised per
//! subject by [`Registry::lock_subject`], so a decision read just before a block was
//! committed cannot deliver after the reconcile that follows the block has run.

use std::collections::HashSet;
use std::sync::Arc;

use super::privacy::{self, Blocks, Party, PrivacySettings, Relation, Signal};
use super::subscription::{SubState, Subscription};
use super::Presence;
use crate::node::outbox::unavailable;
pub use crate::node::visibility::{SubjectGuard, SubjectLocks};
use crate::protocol::stanza::MessageType;
use crate::protocol::xml::{Element, NS_CLIENT};
use crate::store::blocks::match_candidates;
use crate::store::gate_inputs::AudienceInputs;
use crate::store::StoreError;

/// `user@domain` of a JID string in any form.
pub use crate::protocol::jid::bare_of;
use crate::protocol::jid::{domain_of, BareJid, FullJid, Jid};

/// Whether `jid` is an account on a domain this server hosts (as opposed to a remote
/// user, whose settings and block list we cannot read).
fn is_local(pres: &Presence, jid: &Jid) -> bool {
    pres.outbox.is_local(jid.as_str())
}

/// Settings of a user; the defaults for a remote one (their server applies its own rules).
async fn settings_of(pres: &Presence, jid: &BareJid) -> Result<PrivacySettings, StoreError> {
    if is_local(pres, jid) {
        pres.store.privacy_settings(jid.as_str()).await
    } else {
        Ok(PrivacySettings::default())
    }
}

/// Whether local user `owner` blocks `jid` (XEP-0016 §2.1 matching); false for a remote
/// owner, whose block list is not ours to read.
async fn owner_blocks(pres: &Presence, owner: &Jid, jid: &Jid) -> Result<bool, StoreError> {
    if is_local(pres, owner) {
        pres.store
            .is_blocked(bare_of(owner.as_str()), jid.as_str())
            .await
    } else {
        Ok(false)
    }
}

/// The block flags between `viewer` and `subject` (JIDs in any form: a full JID also
/// matches full-JID and domain/resource entries).
pub async fn blocks_between(
    pres: &Presence,
    viewer: &Jid,
    subject: &Jid,
) -> Result<Blocks, StoreError> {
    let (by_subject, by_viewer) = tokio::try_join!(
        owner_blocks(pres, subject, viewer),
        owner_blocks(pres, viewer, subject)
    )?;
    Ok(Blocks {
        by_subject,
        by_viewer,
    })
}

/// Whether either party blocks the other; a store failure counts as blocked.
pub async fn blocked_either(pres: &Presence, a: &Jid, b: &Jid) -> bool {
    match blocks_between(pres, a, b).await {
        Ok(b) => b.by_subject || b.by_viewer,
        Err(e) => {
            tracing::warn!(error = %e, "block lists unavailable; treating as blocked");
            true
        }
    }
}

/// Everything one decision needs, read fresh.
async fn decide(
    pres: &Presence,
    signal: Signal,
    viewer: &Jid,
    subject: &Jid,
    directed: bool,
) -> Result<bool, StoreError> {
    let viewer_bare = viewer.to_bare();
    let subject_bare = subject.to_bare();
    if viewer_bare == subject_bare {
        return Ok(true);
    }
    let viewer_settings = async {
        if signal == Signal::LastSeen {
            settings_of(pres, &viewer_bare).await
        } else {
            // Reciprocity concerns last seen only; online never reads the viewer's row.
            Ok(PrivacySettings::default())
        }
    };
    let item = async {
        if is_local(pres, &subject_bare) {
            pres.store
                .roster_item(subject_bare.as_str(), viewer_bare.as_str())
                .await
        } else {
            Ok(None)
        }
    };
    let (subject_settings, viewer_settings, item, blocks) = tokio::try_join!(
        settings_of(pres, &subject_bare),
        viewer_settings,
        item,
        blocks_between(pres, viewer, subject)
    )?;
    Ok(decide_with(
        signal,
        Inputs {
            viewer: &viewer_bare,
            viewer_settings: &viewer_settings,
            subject: &subject_bare,
            subject_settings: &subject_settings,
            subscription: item.map(|i| i.subscription),
            directed,
            blocks,
        },
    ))
}

/// The inputs of one decision, already read: the bare JIDs, both parties' settings (the
/// viewer's matter for last-seen reciprocity only), the subject's subscription state with
/// the viewer (`None`: no roster item), whether the subject sent the viewer directed
/// presence, and the blocks in both directions.
#[derive(Clone, Copy)]
struct Inputs<'a> {
    viewer: &'a BareJid,
    viewer_settings: &'a PrivacySettings,
    subject: &'a BareJid,
    subject_settings: &'a PrivacySettings,
    subscription: Option<Subscription>,
    directed: bool,
    blocks: Blocks,
}

/// Turns read inputs into the call of [`privacy::may_see`]; no I/O, so the single reads,
/// the per-broadcast read and the per-login probe read all end in the same decision.
fn decide_with(signal: Signal, i: Inputs<'_>) -> bool {
    if i.viewer == i.subject {
        return true;
    }
    let mut relation = Relation::from_item(i.subscription.map(|subscription| SubState {
        subscription,
        ..SubState::default()
    }));
    if relation == Relation::Other && i.directed {
        relation = Relation::DirectedPresence;
    }
    privacy::may_see(
        signal,
        Party {
            jid: i.viewer,
            settings: i.viewer_settings,
        },
        Party {
            jid: i.subject,
            settings: i.subject_settings,
        },
        relation,
        i.blocks,
    )
}

/// May `viewer` learn that `subject` is online? `directed` is true when the subject's
/// session sent the viewer directed presence (RFC 6121 §4.6). Fails closed.
pub async fn may_see_online(pres: &Presence, viewer: &Jid, subject: &Jid, directed: bool) -> bool {
    decide(pres, Signal::Online, viewer, subject, directed)
        .await
        .unwrap_or_else(|e| {
            tracing::warn!(error = %e, "privacy inputs unavailable; hiding online status");
            false
        })
}

/// Whether `viewer` may be told that local user `subject` is online right now: the gate
/// admits it and at least one of the subject's resources, on any node, is available and
/// not invisible.
/// For answers such as XEP-0012 `seconds='0'`; anyone for whom this is false must get the
/// answer an offline subject gives.
pub async fn visible_to(pres: &Presence, viewer: &Jid, subject: &BareJid) -> bool {
    // The decision is taken whether the subject is online or not: a short cut on "offline"
    // would answer faster, and the delay alone would tell the viewer which.
    let permitted = may_see_online(pres, viewer, subject, false).await;
    let subject = subject.as_str();
    let here = pres.sessions.shows_online_here(subject);
    // The user's resources on other nodes, as the directory has them (read either way).
    let elsewhere = pres
        .cluster
        .holders(&[subject])
        .await
        .remove(subject)
        .is_some_and(|hs| hs.iter().any(|h| h.entry.available && h.entry.visible));
    permitted && (here || elsewhere)
}

/// May `viewer` learn when `subject` was last seen (XEP-0012, delay stamps on
/// unavailable)? Applies reciprocity. Fails closed.
pub async fn may_see_last_seen(pres: &Presence, viewer: &Jid, subject: &Jid) -> bool {
    decide(pres, Signal::LastSeen, viewer, subject, false)
        .await
        .unwrap_or_else(|e| {
            tracing::warn!(error = %e, "privacy inputs unavailable; hiding last seen");
            false
        })
}

/// The roster contacts of `subject` (full JID of the resource whose presence goes out)
/// that may see it online now: approved subscribers the settings admit and no block in
/// either direction separates. Fails closed (empty).
pub async fn online_audience(pres: &Presence, subject: &Jid) -> HashSet<BareJid> {
    let inputs = inputs_of(pres, subject, None, false).await;
    audience(&subject.to_bare(), &inputs).cloned().collect()
}

/// [`online_audience`] of a session on this node, from its cached inputs if it has them.
pub async fn session_audience(
    pres: &Presence,
    session: &crate::node::sessions::SessionHandle,
) -> HashSet<BareJid> {
    let inputs = session_inputs(pres, session, false).await;
    audience(&session.jid.to_bare(), &inputs).cloned().collect()
}

/// The roster of the user of `session` (the resource here whose presence goes out) and
/// the privacy inputs of [`audience`], from ONE statement
/// ([`crate::store::Store::audience_inputs`]: settings, roster and both directions of
/// blocks for every contact) read by the caller under the subject's lock, or from the
/// cache of those inputs, which every write and change notification empties before acting
/// ([`crate::store::audience_cache`]); `keep` caches a fresh read for the next change. A
/// failed read gives an empty roster, and so an empty audience: with no roster we tell
/// nobody, never everybody.
pub async fn session_inputs(
    pres: &Presence,
    session: &crate::node::sessions::SessionHandle,
    keep: bool,
) -> Arc<AudienceInputs> {
    inputs_of(pres, &session.jid, Some(session.id), keep).await
}

/// [`session_inputs`] of `subject`, through the cache entry of `session` (the id of the
/// session whose presence goes out) when there is one.
async fn inputs_of(
    pres: &Presence,
    subject: &Jid,
    session: Option<u64>,
    keep: bool,
) -> Arc<AudienceInputs> {
    let subject_bare = subject.to_bare();
    pres.store
        .audience_inputs_cached(
            subject_bare.as_str(),
            session,
            &match_candidates(subject.as_str()),
            keep,
        )
        .await
        .unwrap_or_else(|e| {
            tracing::warn!(user = %subject_bare, error = %e,
                "roster or privacy inputs unavailable; presence not broadcast");
            Arc::default()
        })
}

/// The audience from read inputs: each approved subscriber (RFC 6121 §4.2.2) of
/// `subject_bare` the one decision admits, borrowed from the inputs (a login's broadcast
/// names every contact, and copying each name cost a small allocation per contact).
pub fn audience<'a>(
    subject_bare: &'a BareJid,
    inputs: &'a AudienceInputs,
) -> impl Iterator<Item = &'a BareJid> + 'a {
    let default = PrivacySettings::default();
    inputs
        .roster
        .iter()
        .filter(|c| c.subscription.has_from())
        .filter(move |c| {
            decide_with(
                Signal::Online,
                Inputs {
                    viewer: &c.contact,
                    // Reciprocity concerns last seen only; online never reads the viewer's.
                    viewer_settings: &default,
                    subject: subject_bare,
                    subject_settings: &inputs.settings,
                    subscription: Some(c.subscription),
                    directed: false,
                    blocks: Blocks {
                        by_subject: c.blocked_by_subject,
                        by_viewer: c.blocks_subject,
                    },
                },
            )
        })
        .map(|c| &c.contact)
}

/// Answers a probe from `prober` for local user `subject` (RFC 6121 §4.3.2), handing each
/// stanza to `deliver` while the subject's lock is held (so a concurrent withdrawal cannot
/// overtake it). `prober` is a local full JID or, for a probe from a remote server, the
/// remote user's bare JID (§4.3.1); the answers are addressed to it.
///
/// Only an approved subscriber that no block separates from the subject gets anything at
/// all (no unavailable, no error: the Openfire OF-820 leak). Such a subscriber gets each
/// visible resource's presence if the gate admits it; otherwise, and when no resource is
/// online, exactly what an offline subject gives: unavailable from the bare JID, stamped
/// with the last seen only where [`may_see_last_seen`] allows.
pub async fn probe_answer(
    pres: &Presence,
    prober: &Jid,
    subject: &BareJid,
    deliver: impl FnMut(Answer),
) {
    probe_answers(pres, prober, vec![subject], None, deliver).await;
}

/// One probe answer: built for this prober, or, for a local prober, a session's stored
/// presence already serialised for the prober's stream (no clone of the stored element:
/// a login's probes answer every online contact).
#[derive(Debug)]
pub enum Answer {
    /// A stanza built for the prober.
    Built(Element),
    /// A client-stream serialisation, addressed to the prober (local probers only).
    Serialised(String),
}

impl Answer {
    /// The answer as an element (what federation routes): a local prober's is parsed
    /// back, which no caller needs, but an answer is never dropped for its form.
    pub fn into_element(self) -> Option<Element> {
        match self {
            Answer::Built(el) => Some(el),
            Answer::Serialised(xml) => crate::protocol::xml::parse_element(&xml),
        }
    }
}

impl crate::node::outbox::Payload for Answer {
    fn queue_on(self, handle: &crate::node::sessions::SessionHandle) -> bool {
        match self {
            Answer::Built(el) => el.queue_on(handle),
            Answer::Serialised(xml) => xml.queue_on(handle),
        }
    }
}

/// [`probe_answer`] for several local subjects at once, as at the prober's login
/// (RFC 6121 §4.2.2: one probe per contact): the inputs of every decision come from ONE
/// statement ([`crate::store::Store::probe_inputs`]) plus, only if a last-seen stamp is
/// in question, the prober's own settings. The subjects' locks are all taken, in sorted
/// order, before that read and held until the answers are handed over, so no block or
/// settings change can commit and be reconciled between a decision and its delivery.
/// (Every other holder takes one subject lock at a time, and the multi-lockers all take
/// them in the same order, so this cannot deadlock.) `prober_settings`: the local
/// prober's own settings when the caller read them already (a login, with its roster);
/// otherwise they are read if a stamp is in question.
pub async fn probe_answers(
    pres: &Presence,
    prober: &Jid,
    mut subjects: Vec<&BareJid>,
    prober_settings: Option<&PrivacySettings>,
    mut deliver: impl FnMut(Answer),
) {
    let prober_bare_jid = prober.to_bare();
    let prober_bare = prober_bare_jid.as_str();
    subjects.sort();
    subjects.dedup();
    let mut guards = Vec::with_capacity(subjects.len());
    for s in &subjects {
        guards.push(pres.subject_locks.lock_subject(s.as_str()).await);
    }
    let rows = match pres
        .store
        .probe_inputs(prober_bare, &match_candidates(prober.as_str()), &subjects)
        .await
    {
        Ok(rows) => rows,
        Err(e) => {
            tracing::warn!(%prober, error = %e, "probe: privacy inputs unavailable");
            return;
        }
    };
    let prober_local = is_local(pres, prober);
    let subject_refs: Vec<&str> = subjects.iter().map(|j| j.as_str()).collect();
    // From Redis, not the node's copy: a login's probes must see a contact who came
    // online on another node a moment ago (`Cluster::holders_fresh`).
    let mut elsewhere = remote_presences(pres, &subject_refs, true).await;
    // Read at most once, and only when an unavailable may carry a stamp.
    let mut prober_settings: Option<Option<PrivacySettings>> =
        prober_settings.map(|s| Some(s.clone()));
    let default = PrivacySettings::default();
    let mut offline: Option<OfflineAnswers> = None;
    // Sessions on other nodes shown to the prober, one message per node.
    let mut reveals: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    // One row per subject, in order (`Store::probe_inputs`).
    for (subject, row) in subjects.iter().zip(rows) {
        // Only an approved subscriber gets anything (the Openfire OF-820 leak).
        if !row.subscription.is_some_and(|s| s.has_from()) {
            continue;
        }
        let blocks = Blocks {
            by_subject: row.blocks_prober,
            // A remote prober's block list is not ours to read.
            by_viewer: prober_local && row.blocked_by_prober,
        };
        // XEP-0191 §3.5: a blocked prober gets nothing at all, online or not.
        if blocks.by_subject || blocks.by_viewer {
            continue;
        }
        let online = Inputs {
            viewer: &prober_bare_jid,
            viewer_settings: &default,
            subject,
            subject_settings: &row.settings,
            subscription: row.subscription,
            directed: false,
            blocks,
        };
        let mut sent = false;
        if decide_with(Signal::Online, online) {
            for s in visible_sessions(pres, subject.as_str()) {
                let answer = if prober_local {
                    s.last_presence_to(prober.as_str()).map(Answer::Serialised)
                } else {
                    s.last_presence().map(|mut last| {
                        last.set_attr("to", prober.as_str());
                        Answer::Built(last)
                    })
                };
                if let Some(answer) = answer {
                    if !s.reveal(prober_bare, Relation::Subscriber) {
                        continue;
                    }
                    deliver(answer);
                    sent = true;
                }
            }
            for (h, mut p) in elsewhere.remove(subject.as_str()).unwrap_or_default() {
                p.set_attr("to", prober.as_str());
                deliver(Answer::Built(p));
                reveals.entry(h.node().to_owned()).or_default().push(h.jid);
                sent = true;
            }
        }
        if sent {
            continue;
        }
        // As offline: unavailable from the bare JID, stamped only where last seen is
        // visible (settings, reciprocity). A prober whose settings cannot be read gets
        // no stamp (fails closed).
        if prober_settings.is_none() {
            prober_settings =
                Some(settings_for_stamp(pres, prober, prober_bare, prober_local).await);
        }
        let last_seen = match &prober_settings {
            Some(Some(vs))
                if decide_with(
                    Signal::LastSeen,
                    Inputs {
                        viewer_settings: vs,
                        ..online
                    },
                ) =>
            {
                last_seen_at(pres, subject.as_str(), row.last_seen)
            }
            _ => None,
        };
        let answers = offline.get_or_insert_with(|| OfflineAnswers::new(prober, prober_local));
        deliver(answers.answer(subject, last_seen));
    }
    for (node, subjects) in reveals {
        pres.cluster.reveal(&node, subjects, prober_bare);
    }
    drop(guards);
}

/// What every offline subject of one probe call answers with (RFC 6121 §4.3.2): one
/// unavailable to the prober, re-addressed from each subject in place (a login's probes
/// may answer hundreds of offline contacts, and an element per answer was about nine
/// small allocations); a local prober gets the bytes its stream carries, as it does for
/// an online contact.
struct OfflineAnswers {
    unavailable: Element,
    local: bool,
}

impl OfflineAnswers {
    fn new(prober: &Jid, local: bool) -> Self {
        OfflineAnswers {
            unavailable: unavailable("", prober.as_str()),
            local,
        }
    }

    /// `subject`'s answer, stamped with `last_seen` when the gate admitted it (XEP-0203)
    /// and with nothing left of the answer before it.
    fn answer(
        &mut self,
        subject: &BareJid,
        last_seen: Option<chrono::DateTime<chrono::Utc>>,
    ) -> Answer {
        let p = &mut self.unavailable;
        p.set_attr_str("from", subject.as_str());
        p.children.clear();
        if let Some(at) = last_seen {
            stamp(p, subject.as_str(), at);
        }
        if self.local {
            Answer::Serialised(p.to_xml())
        } else {
            Answer::Built(p.clone())
        }
    }
}

/// The prober's settings, for the last-seen stamp of an unavailable it is sent: a remote
/// user's are applied by its own server; `None` when they cannot be read (no stamp: fails
/// closed).
async fn settings_for_stamp(
    pres: &Presence,
    prober: &Jid,
    prober_bare: &str,
    prober_local: bool,
) -> Option<PrivacySettings> {
    if !prober_local {
        // A remote user's settings are applied by its own server.
        return Some(PrivacySettings::default());
    }
    match pres.store.privacy_settings(prober_bare).await {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(%prober, error = %e, "privacy inputs unavailable; hiding last seen");
            None
        }
    }
}

/// When local user `subject` was last seen: the newest of what waits to be written and what
/// PostgreSQL has (`stored`), as `liveness::last_seen::when` merges them.
fn last_seen_at(
    pres: &Presence,
    subject: &str,
    stored: Option<chrono::DateTime<chrono::Utc>>,
) -> Option<chrono::DateTime<chrono::Utc>> {
    let mem = pres.liveness.last_seen.get(subject).map(|l| l.at);
    match (mem, stored) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// The current presence of every visible resource of local user `subject`, for `viewer`
/// (a local bare JID, or a remote one), if the gate admits it: RFC 6121 §3.1.5 after an
/// approval, and anything else that shows presence on demand. Delivered through `deliver`
/// under the subject's lock; the viewer is recorded as shown.
pub async fn current_presence(
    pres: &Presence,
    subject: &BareJid,
    viewer_jid: &Jid,
    mut deliver: impl FnMut(Element),
) {
    let _guard = pres.subject_locks.lock_subject(subject.as_str()).await;
    if !may_see_online(pres, viewer_jid, subject, false).await {
        return;
    }
    let (subject, viewer) = (subject.as_str(), viewer_jid.as_str());
    for s in visible_sessions(pres, subject) {
        // Shown already as to a subscriber (a reconciliation after the same roster change
        // got here first): every update since reached the viewer, so it has this presence.
        if s.revealed_relation(viewer) == Some(Relation::Subscriber) {
            continue;
        }
        if let Some(mut last) = s.last_presence() {
            if !s.reveal(viewer, Relation::Subscriber) {
                continue;
            }
            last.set_attr("to", viewer);
            deliver(last);
        }
    }
    for (h, mut p) in remote_presences(pres, &[subject], false)
        .await
        .remove(subject)
        .unwrap_or_default()
    {
        p.set_attr("to", viewer);
        deliver(p);
        let node = h.node().to_owned();
        pres.cluster.reveal(&node, vec![h.jid], viewer);
    }
}

/// Adds the XEP-0203 `<delay/>` saying when `subject` was last seen.
fn stamp(p: &mut Element, subject: &str, at: chrono::DateTime<chrono::Utc>) {
    p.children.push(crate::protocol::xml::Node::Element(
        crate::protocol::xml::delay(domain_of(subject), at),
    ));
}

/// Available sessions of local user `subject` that are not invisible (XEP-0186).
fn visible_sessions(pres: &Presence, subject: &str) -> Vec<crate::node::sessions::SessionHandle> {
    pres.sessions
        .of_user_str(subject)
        .into_iter()
        .filter(|s| s.is_available() && !s.is_invisible())
        .collect()
}

/// Withdraws and grants, after `user`'s permissions (settings, block list) or invisibility
/// changed, what their sessions' presence shows, and what is shown to them:
///
/// * as subject: every viewer a resource of `user` was shown to and that may no longer
///   see it gets unavailable from that resource; approved subscribers who may now see it
///   and had not been shown it get its current presence;
/// * as viewer: the same for every subject whose presence reached `user`, and for the
///   local contacts `user` is subscribed to.
///
/// Idempotent; called by the iq handlers right after their write and by the NOTIFY
/// consumer for changes made elsewhere (another node, an operator's SQL).
pub async fn reconcile_user(pres: &Presence, user_jid: &BareJid) {
    reconcile_subject(pres, user_jid).await;
    let user = user_jid.to_string();
    // Addresses of sessions; one that is no JID has no session whose presence could need
    // withdrawing.
    let mut subjects: HashSet<BareJid> = pres
        .sessions
        .subjects_revealed_to(&user)
        .iter()
        .filter_map(|s| crate::protocol::jid::parse_bare(s).ok())
        .collect();
    if pres
        .sessions
        .of_user_str(&user)
        .iter()
        .any(|s| s.is_available())
    {
        if let Ok((_, roster)) = pres.store.roster(&user).await {
            for item in roster.into_iter().filter(|i| i.subscription.has_to()) {
                if pres.outbox.is_local(item.contact.as_str()) {
                    subjects.insert(item.contact);
                }
            }
        }
    }
    subjects.remove(user_jid);
    for s in &subjects {
        reconcile_subject(pres, s).await;
    }
    withdraw_blocked_remote(pres, user_jid).await;
}

/// The viewer half for remote subjects: what they show is their server's decision, but a
/// block here is this server's to apply. Each remote resource whose presence reached
/// `user` and that a block now separates from them gets its unavailable delivered to the
/// recipient it reached (XEP-0191 §3.3: the blocker's resources get unavailable from the
/// blocked contact's), and later presence from it is dropped on arrival.
async fn withdraw_blocked_remote(pres: &Presence, user: &BareJid) {
    for (remote, local) in pres.s2s.seen_by(user.as_str()) {
        // Recorded from a checked `from`; one that is no JID is withdrawn (fails closed).
        let blocked = match crate::protocol::jid::parse(&remote) {
            Ok(remote) => blocked_either(pres, user, &remote).await,
            Err(_) => true,
        };
        if blocked {
            pres.s2s.saw_unavailable(&remote, &local);
            pres.outbox
                .presence_to(&local, unavailable(&remote, &local));
        }
    }
}

/// Re-checks everything after the LISTEN connection was lost (notifications may be gone).
pub async fn reconcile_all(pres: &Presence) {
    for s in pres.sessions.users() {
        if let Ok(user) = crate::protocol::jid::parse_bare(&s) {
            reconcile_user(pres, &user).await;
        }
    }
}

/// The subject half of [`reconcile_user`].
pub async fn reconcile_subject(pres: &Presence, subject: &BareJid) {
    let subject = subject.as_str();
    let sessions = pres.sessions.of_user_str(subject);
    if sessions.is_empty() {
        return;
    }
    let _guard = pres.subject_locks.lock_subject(subject).await;
    for s in sessions {
        let me = s.jid.to_string();
        let invisible = s.is_invisible();
        let audience = if invisible {
            HashSet::new()
        } else {
            session_audience(pres, &s).await
        };
        let revealed = s.revealed();
        for (viewer, relation) in revealed {
            // Recorded from addresses the server checked; one that is no JID is withdrawn.
            let viewer_jid = crate::protocol::jid::parse(&viewer).ok();
            let keep = match (relation, &viewer_jid) {
                (_, None) => false,
                (Relation::Subscriber, Some(v)) => audience.contains(v),
                // Directed presence was the user's own act; only a block withdraws it
                // (invisibility does not: XEP-0186 keeps directed presence working).
                (_, Some(v)) => !blocked_either(pres, v, &s.jid).await,
            };
            if !keep && s.forget(&viewer) {
                pres.outbox.presence_to(&viewer, unavailable(&me, &viewer));
            }
        }
        let (available, last) = s.read(|p| (p.available, p.last.clone()));
        if invisible || !available {
            continue;
        }
        let Some(last) = last.and_then(|l| crate::protocol::xml::parse_element(l.unaddressed()))
        else {
            continue;
        };
        for viewer in audience {
            let viewer = viewer.to_string();
            if s.was_revealed(&viewer) {
                continue;
            }
            if !s.reveal(&viewer, Relation::Subscriber) {
                continue;
            }
            let mut p = last.clone();
            p.set_attr("to", viewer.clone());
            pres.outbox.presence_to(&viewer, p);
        }
    }
}

/// Spawns the consumer of the `presenced_block` and `presenced_privacy` channels: each
/// change, wherever it was made, reconciles its owner on this node; a lost connection
/// reconciles everyone.
pub async fn spawn_listener(
    pres: Arc<Presence>,
    db: &crate::config::DatabaseConfig,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<(), StoreError> {
    use crate::store::notify::{listen_with, ListenOptions, BLOCK_CHANNEL, PRIVACY_CHANNEL};
    let mut rx = listen_with(
        &db.url,
        &[BLOCK_CHANNEL, PRIVACY_CHANNEL],
        ListenOptions::from_config(db),
    )
    .await?;
    tokio::spawn(async move {
        loop {
            let n = tokio::select! {
                _ = shutdown.cancelled() => return,
                n = rx.recv() => n,
            };
            let Some(n) = n else { return };
            // The gate's cached inputs go before anything re-decides: all of them after
            // possibly missed notifications; for a block change the owner's and those of
            // everyone with the owner on their roster; for a settings change the owner's.
            if n.is_resync() {
                pres.store.forget_all_audiences();
                reconcile_all(&pres).await;
                continue;
            }
            if n.channel == BLOCK_CHANNEL {
                pres.store.forget_audiences_naming(&n.payload);
            } else {
                pres.store.forget_audience(&n.payload);
            }
            // The owner column of the changed row: a local bare JID, or nobody here.
            match crate::protocol::jid::parse_bare(&n.payload) {
                Ok(owner) if is_local(&pres, &owner) => reconcile_user(&pres, &owner).await,
                _ => {}
            }
        }
    });
    Ok(())
}

/// XEP-0085 chat states.
pub const NS_CHATSTATES: &str = "http://jabber.org/protocol/chatstates";
/// XEP-0184 delivery receipts.
pub const NS_RECEIPTS: &str = "urn:xmpp:receipts";
/// XEP-0333 chat markers.
pub const NS_CHAT_MARKERS: &str = "urn:xmpp:chat-markers:0";

/// Whether a message child is a signal that the sender's client is online right now and
/// that a client emits on its own, without the user writing anything: any XEP-0085 chat
/// state, an XEP-0184 `<received/>`, an XEP-0333 `<received/>`/`<displayed/>`/
/// `<acknowledged/>`.
pub fn is_presence_signal(child: &Element) -> bool {
    child.ns == NS_CHATSTATES
        || child.is("received", NS_RECEIPTS)
        || (child.ns == NS_CHAT_MARKERS && child.name != "markable")
}

/// Whether a message child carries something of its own (a body, a subject, any payload)
/// rather than only routing metadata: the thread, processing hints (XEP-0334), stanza
/// ids (XEP-0359), a receipt request, a markable flag.
fn is_content(child: &Element) -> bool {
    !(child.is("thread", NS_CLIENT)
        || child.ns == "urn:xmpp:hints"
        || child.ns == "urn:xmpp:sid:0"
        || child.is("request", NS_RECEIPTS)
        || child.is("markable", NS_CHAT_MARKERS)
        || is_presence_signal(child))
}

/// The side-channel filter for a message from local session `sender_session` (`sender`, full
/// JID) to `recipient`. Chat states, receipts and markers reveal that the sender is online
/// at that moment, so they are relayed only when the recipient may see the sender online
/// (the privacy gate, and the session is not invisible) or the session revealed itself to
/// the recipient by directed presence (`directed`). Otherwise they are removed, and a
/// message left with no content is not relayed at all; a message with a body is the
/// user's own act and goes through without them. Checks the database only for messages
/// that carry such a signal. Fails closed.
pub async fn filter_signals(
    pres: &Presence,
    sender_session: &crate::node::sessions::SessionHandle,
    sender: &Jid,
    recipient: &Jid,
    directed: bool,
    mut el: Element,
) -> Option<Element> {
    if MessageType::of(&el) == MessageType::Error || !el.elements().any(is_presence_signal) {
        return Some(el);
    }
    let allowed = directed
        || (!sender_session.is_invisible() && may_see_online(pres, recipient, sender, false).await);
    if allowed {
        return Some(el);
    }
    el.children
        .retain(|n| !matches!(n, crate::protocol::xml::Node::Element(c) if is_presence_signal(c)));
    if el.elements().any(is_content) {
        Some(el)
    } else {
        None
    }
}

/// Whether an iq request from `sender` (full JID) may reach the local session `target`:
/// the target revealed itself to the sender by its own act (directed presence, an iq it
/// sent there), or it is a visible, available resource the sender may see online. An iq
/// delivered where the sender could not know the resource is online would be answered by
/// the client, which tells online from offline.
pub async fn may_reach_resource(
    pres: &Presence,
    sender: &Jid,
    target: &crate::node::sessions::SessionHandle,
) -> bool {
    may_reach(pres, sender, &target.jid, Some(target)).await
}

/// [`may_reach_resource`] for a full JID that may have no session: `target` is its session
/// if there is one. With none the answer is `false`, but the same decision is taken first,
/// so a sender who may not know the resource is online cannot tell online from offline by
/// how long the answer takes.
pub async fn may_reach(
    pres: &Presence,
    sender: &Jid,
    full: &FullJid,
    target: Option<&crate::node::sessions::SessionHandle>,
) -> bool {
    let Some(target) = target else {
        may_see_online(pres, sender, full, false).await;
        return false;
    };
    let own_act = [sender.as_str(), bare_of(sender.as_str())]
        .iter()
        .any(|v| target.revealed_relation(v) == Some(Relation::DirectedPresence));
    if own_act {
        return !blocked_either(pres, sender, &target.jid).await;
    }
    !target.is_invisible()
        && target.is_available()
        && may_see_online(pres, sender, &target.jid, false).await
}

/// [`may_reach_resource`] for a session on another node, from its directory entry. What
/// that node's session revealed by its own act (directed presence) is not in the entry, so
/// only a visible, available resource the sender may see online is reached.
pub async fn may_reach_holder(
    pres: &Presence,
    sender: &Jid,
    target: &crate::cluster::Holder,
) -> bool {
    // The directory's full JID, written by the holding node; one that is no JID is reached
    // by nobody.
    let Ok(holder) = crate::protocol::jid::parse(&target.jid) else {
        return false;
    };
    target.entry.visible
        && target.entry.available
        && may_see_online(pres, sender, &holder, false).await
}

/// The presence each visible, available resource of `subject` on other nodes shows, from
/// the directory (RFC 6121 §4.3.2 answers for sessions this node does not hold), with the
/// session it is of. Whoever shows one to a viewer tells the holding node
/// ([`crate::cluster::Cluster::reveal`]), which records it as for a probe answer of its
/// own, so that a later block or privacy change withdraws it there.
async fn remote_presences(
    pres: &Presence,
    subjects: &[&str],
    fresh: bool,
) -> std::collections::HashMap<String, Vec<(crate::cluster::Holder, Element)>> {
    let mut out: std::collections::HashMap<String, Vec<(crate::cluster::Holder, Element)>> =
        Default::default();
    let holders = if fresh {
        pres.cluster.holders_fresh(subjects).await
    } else {
        pres.cluster.holders(subjects).await
    };
    for (subject, holders) in holders {
        for h in holders {
            let shown = h
                .entry
                .presence
                .as_deref()
                .filter(|_| h.entry.available && h.entry.visible);
            if let Some(p) = shown.and_then(crate::protocol::xml::parse_element) {
                out.entry(subject.clone()).or_default().push((h, p));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::xml::parse_element;

    #[test]
    fn signals_and_content_are_told_apart() {
        let cases = [
            (
                "<active xmlns='http://jabber.org/protocol/chatstates'/>",
                true,
                false,
            ),
            (
                "<composing xmlns='http://jabber.org/protocol/chatstates'/>",
                true,
                false,
            ),
            (
                "<gone xmlns='http://jabber.org/protocol/chatstates'/>",
                true,
                false,
            ),
            ("<received xmlns='urn:xmpp:receipts' id='1'/>", true, false),
            ("<request xmlns='urn:xmpp:receipts'/>", false, false),
            (
                "<displayed xmlns='urn:xmpp:chat-markers:0' id='1'/>",
                true,
                false,
            ),
            ("<markable xmlns='urn:xmpp:chat-markers:0'/>", false, false),
            ("<thread xmlns='jabber:client'>t</thread>", false, false),
            ("<no-store xmlns='urn:xmpp:hints'/>", false, false),
            ("<origin-id xmlns='urn:xmpp:sid:0' id='1'/>", false, false),
            ("<body xmlns='jabber:client'>hi</body>", false, true),
            ("<x xmlns='jabber:x:oob'><url>u</url></x>", false, true),
        ];
        for (xml, signal, content) in cases {
            let e = parse_element(xml).expect("test XML parses");
            assert_eq!(is_presence_signal(&e), signal, "{xml}");
            assert_eq!(is_content(&e), content, "{xml}");
        }
    }
}
