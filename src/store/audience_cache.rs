//! The privacy gate's broadcast inputs ([`AudienceInputs`]), kept between broadcasts of a
//! user who changes presence while online, so a presence change is not a database round
//! trip (BENCHMARKS.md: that read was two thirds of the CPU, server plus PostgreSQL, of every
//! delivered presence).
//!
//! Correctness rests on invalidation, not on expiry:
//!
//! * Every [`Store`] method that writes a roster item, a block list, privacy settings or an
//!   account drops the affected entries before it returns, so on this node nothing reads
//!   a cached value older than a committed local change. Roster and settings changes drop
//!   their owner's entries; a block-list or account change of X drops X's entries and
//!   every entry whose roster lists X (X's block decides whether X sees its contacts).
//! * Changes made elsewhere (another node, an operator's SQL) arrive as the
//!   `presenced_roster` / `presenced_block` / `presenced_privacy` notifications the triggers
//!   send; their consumers drop entries before acting (for a roster change the owner's and
//!   every entry listing the owner, since the two sides of a subscription notify apart),
//!   and drop everything when the LISTEN connection was lost. Between another node's commit and its
//!   notification (milliseconds) a broadcast may still use the old inputs; that is the same
//!   as the broadcast having happened just before the change, and the consumer's withdrawal
//!   (which follows the invalidation) then takes the presence back from whoever lost it.
//! * A read that raced an invalidation is not stored: each invalidation bumps an epoch,
//!   and a value read under an older epoch is returned to its caller but not kept.
//! * `ttl` bounds the age of any entry regardless, for the case where notifications
//!   cannot be received at all. Ages are measured on the node's clock
//!   ([`Store::set_clock`]; the system's until it is set), which a test can pause.
//!
//! Entries are per session whose presence goes out (a contact may block one resource,
//! XEP-0016 §2.1), keyed by the session's id (`sessions::SessionHandle::id`) under its
//! user, and filled only by presence changes of an already available resource and by a
//! roster get before the session's initial presence (RFC 6121 §2.2), whose read that
//! initial presence then uses and drops ([`Store::login_roster_for`]): an idle session
//! costs no cache memory. The session's entry goes when it ends; a later session
//! that binds the same full JID has another id, so it neither reads nor loses it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::gate_inputs::AudienceInputs;
use super::{Store, StoreError};
use crate::clock::Clock;

/// Bare JID → (session id, when read, inputs).
type Entries = HashMap<String, Vec<(u64, Instant, Arc<AudienceInputs>)>>;

/// The entries, and the clock their read times are taken on and aged by (under one lock,
/// since every read of an entry reads the time too).
#[derive(Debug, Default)]
struct Table {
    entries: Entries,
    clock: Clock,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub struct AudienceCache {
    /// Longest time an entry is used, in milliseconds; 0 turns the cache off.
    ttl_ms: AtomicU64,
    /// Bumped (under `table`'s lock) by every invalidation.
    epoch: AtomicU64,
    table: Mutex<Table>,
}

impl AudienceCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_clock(&self, clock: Clock) {
        self.lock().clock = clock;
    }

    fn ttl(&self) -> Option<Duration> {
        match self.ttl_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    fn get(&self, bare: &str, session: u64) -> Option<Arc<AudienceInputs>> {
        let ttl = self.ttl()?;
        let table = self.lock();
        let now = table.clock.instant();
        table
            .entries
            .get(bare)?
            .iter()
            .find(|(s, at, _)| *s == session && now.saturating_duration_since(*at) < ttl)
            .map(|(_, _, inputs)| Arc::clone(inputs))
    }

    fn put(&self, epoch: u64, bare: &str, session: u64, inputs: &Arc<AudienceInputs>) {
        if self.ttl().is_none() {
            return;
        }
        let mut table = self.lock();
        if self.epoch.load(Ordering::Relaxed) != epoch {
            return; // invalidated while it was being read
        }
        let now = table.clock.instant();
        let list = table.entries.entry(bare.to_owned()).or_default();
        list.retain(|(s, _, _)| *s != session);
        list.push((session, now, Arc::clone(inputs)));
    }

    fn invalidate(&self, bare: Option<&str>) {
        let mut table = self.lock();
        let map = &mut table.entries;
        self.epoch.fetch_add(1, Ordering::Relaxed);
        match bare {
            Some(b) => {
                map.remove(b);
            }
            None => map.clear(),
        }
    }

    /// Drops `jid`'s own entries and every entry whose roster lists `jid`: the inputs a
    /// change of `jid`'s block list (or account) can alter.
    fn invalidate_naming(&self, jid: &str) {
        let mut table = self.lock();
        let map = &mut table.entries;
        self.epoch.fetch_add(1, Ordering::Relaxed);
        map.remove(jid);
        map.retain(|_, list| {
            list.retain(|(_, _, inputs)| !inputs.roster.iter().any(|c| c.contact.as_str() == jid));
            !list.is_empty()
        });
    }

    fn remove_session(&self, bare: &str, session: u64) {
        let mut table = self.lock();
        let map = &mut table.entries;
        if let Some(list) = map.get_mut(bare) {
            list.retain(|(s, _, _)| *s != session);
            if list.is_empty() {
                map.remove(bare);
            }
        }
    }

    /// Number of cached resources (for tests and metrics).
    pub fn len(&self) -> usize {
        self.lock().entries.values().map(Vec::len).sum()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Held by a [`Store`] method that writes gate inputs: when the method returns, on every
/// path (success, error, a cancelled future), the cached entries the write may have
/// altered are dropped. Declared first in the method, it is dropped after the commit.
pub(crate) struct Forget<'a> {
    cache: &'a AudienceCache,
    scope: Scope<'a>,
}

enum Scope<'a> {
    /// Roster or settings of these owners changed: their own entries.
    Owners(Vec<&'a str>),
    /// This JID's block list or account changed: its entries and every entry listing it.
    Naming(String),
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        match &self.scope {
            Scope::Owners(owners) => {
                for owner in owners {
                    self.cache.invalidate(Some(owner));
                }
            }
            Scope::Naming(jid) => self.cache.invalidate_naming(jid),
        }
    }
}

impl Store {
    /// See [`Forget`]: the entries of `owners`.
    pub(crate) fn forget_owners<'a>(
        &'a self,
        owners: impl IntoIterator<Item = &'a str>,
    ) -> Forget<'a> {
        Forget {
            cache: &self.audience,
            scope: Scope::Owners(owners.into_iter().collect()),
        }
    }

    /// See [`Forget`]: the entries naming `jid`.
    pub(crate) fn forget_naming(&self, jid: String) -> Forget<'_> {
        Forget {
            cache: &self.audience,
            scope: Scope::Naming(jid),
        }
    }

    /// Sets how long a cached entry may be used (zero: no caching, every broadcast reads).
    pub fn set_audience_cache_ttl(&self, ttl: Duration) {
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        self.audience.ttl_ms.store(ms, Ordering::Relaxed);
        if ms == 0 {
            self.audience.invalidate(None);
        }
    }

    /// Reads the time on `clock` (the node's) from now on: the audience cache's entry ages.
    pub fn set_clock(&self, clock: Clock) {
        self.audience.set_clock(clock);
    }

    /// The cache itself (for tests).
    pub fn audience_cache(&self) -> &AudienceCache {
        &self.audience
    }

    /// [`Store::audience_inputs`] for the presence of local user `subject_bare`, from the
    /// cache when `session` (the id of the session whose presence goes out) has an entry;
    /// when `keep` is set, a value read from the database is cached for that session's
    /// next change. Without a session nothing is cached.
    pub async fn audience_inputs_cached(
        &self,
        subject_bare: &str,
        session: Option<u64>,
        subject_forms: &[String],
        keep: bool,
    ) -> Result<Arc<AudienceInputs>, StoreError> {
        if let Some(hit) = session.and_then(|s| self.audience.get(subject_bare, s)) {
            return Ok(hit);
        }
        let epoch = self.audience.epoch.load(Ordering::Relaxed);
        let inputs = Arc::new(self.audience_inputs(subject_bare, subject_forms).await?);
        if let Some(session) = session.filter(|_| keep) {
            self.audience.put(epoch, subject_bare, session, &inputs);
        }
        Ok(inputs)
    }

    /// What `reply` makes of the version and items of [`Store::login_roster`] of local
    /// user `subject_bare` (the roster result), for the session `session`, whose presence
    /// goes out as `subject_forms`; when `keep` is set, the gate's part of the same read is
    /// then cached for that session as a presence change's would be, so the initial
    /// presence that follows the roster get (RFC 6121 §2.2) decides on the same read
    /// instead of reading the roster again. The items become those inputs after `reply`
    /// ([`super::gate_inputs::LoginRoster::into_inputs`]): one copy of each contact. The
    /// initial presence drops the entry once it used it ([`Store::forget_audience_of`]),
    /// so an idle session still costs no cache memory.
    pub async fn login_roster_for<R>(
        &self,
        subject_bare: &str,
        session: u64,
        subject_forms: &[String],
        keep: bool,
        reply: impl FnOnce(i64, &[super::RosterItem]) -> R,
    ) -> Result<R, StoreError> {
        let epoch = self.audience.epoch.load(Ordering::Relaxed);
        let login = self.login_roster(subject_bare, subject_forms).await?;
        let answer = reply(login.version, &login.items);
        if keep {
            let inputs = Arc::new(login.into_inputs());
            self.audience.put(epoch, subject_bare, session, &inputs);
        }
        Ok(answer)
    }

    /// Drops the cached inputs of local user `owner` (its roster or settings changed).
    pub fn forget_audience(&self, owner: &str) {
        self.audience.invalidate(Some(owner));
    }

    /// Drops the cached inputs that name `jid` (local user whose block list changed, or
    /// account that went): its own and those of everyone with it on their roster.
    pub fn forget_audiences_naming(&self, jid: &str) {
        self.audience.invalidate_naming(jid);
    }

    /// Drops every cached input (notifications may have been missed).
    pub fn forget_all_audiences(&self) {
        self.audience.invalidate(None);
    }

    /// Drops the entry of session `session` of `owner`, which ended.
    pub fn forget_audience_of(&self, owner: &str, session: u64) {
        self.audience.remove_session(owner, session);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A session id per test resource name.
    fn id(full: &str) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        full.hash(&mut h);
        h.finish()
    }

    fn inputs() -> Arc<AudienceInputs> {
        Arc::new(AudienceInputs::default())
    }

    fn on(ttl_ms: u64) -> AudienceCache {
        let c = AudienceCache::default();
        c.ttl_ms.store(ttl_ms, Ordering::Relaxed);
        c
    }

    #[test]
    fn a_read_that_raced_an_invalidation_is_not_kept() {
        let c = on(60_000);
        let epoch = c.epoch.load(Ordering::Relaxed);
        c.invalidate(Some("a@x"));
        c.put(epoch, "a@x", id("a@x/r"), &inputs());
        assert!(c.get("a@x", id("a@x/r")).is_none());
        let epoch = c.epoch.load(Ordering::Relaxed);
        c.put(epoch, "a@x", id("a@x/r"), &inputs());
        assert!(c.get("a@x", id("a@x/r")).is_some());
    }

    #[test]
    fn invalidation_drops_only_the_owner_unless_everything_is_asked() {
        let c = on(60_000);
        for (b, f) in [("a@x", "a@x/1"), ("a@x", "a@x/2"), ("b@x", "b@x/1")] {
            let epoch = c.epoch.load(Ordering::Relaxed);
            c.put(epoch, b, id(f), &inputs());
        }
        assert_eq!(c.len(), 3);
        c.invalidate(Some("a@x"));
        assert!(c.get("a@x", id("a@x/1")).is_none());
        assert!(c.get("b@x", id("b@x/1")).is_some());
        c.invalidate(None);
        assert!(c.is_empty());
    }

    #[test]
    fn a_block_list_change_drops_the_entries_that_list_its_owner() {
        use crate::policy::subscription::Subscription;
        use crate::store::gate_inputs::AudienceContact;
        let c = on(60_000);
        let with = |contact: &str| {
            Arc::new(AudienceInputs {
                roster: vec![AudienceContact {
                    contact: crate::protocol::jid::parse_bare(contact).unwrap(),
                    subscription: Subscription::Both,
                    blocks_subject: false,
                    blocked_by_subject: false,
                }],
                ..AudienceInputs::default()
            })
        };
        for (b, contact) in [("a@x", "c@x"), ("b@x", "d@x"), ("c@x", "a@x")] {
            let epoch = c.epoch.load(Ordering::Relaxed);
            c.put(epoch, b, id(&format!("{b}/r")), &with(contact));
        }
        c.invalidate_naming("c@x");
        assert!(c.get("a@x", id("a@x/r")).is_none(), "lists c@x");
        assert!(c.get("c@x", id("c@x/r")).is_none(), "c@x's own");
        assert!(c.get("b@x", id("b@x/r")).is_some(), "unrelated");
    }

    #[test]
    fn entries_are_per_session_and_go_with_it() {
        let c = on(60_000);
        let epoch = c.epoch.load(Ordering::Relaxed);
        c.put(epoch, "a@x", id("a@x/1"), &inputs());
        assert!(c.get("a@x", id("a@x/1")).is_some());
        assert!(c.get("a@x", id("a@x/2")).is_none());
        c.remove_session("a@x", id("a@x/1"));
        assert!(c.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn an_entry_ages_out_once_the_ttl_has_passed_on_the_nodes_clock() {
        let c = on(60_000);
        c.set_clock(Clock::tokio());
        let epoch = c.epoch.load(Ordering::Relaxed);
        c.put(epoch, "a@x", id("a@x/1"), &inputs());
        tokio::time::advance(Duration::from_millis(59_999)).await;
        assert!(c.get("a@x", id("a@x/1")).is_some(), "younger than the TTL");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(c.get("a@x", id("a@x/1")).is_none(), "as old as the TTL");
        // A new read starts a new age.
        let epoch = c.epoch.load(Ordering::Relaxed);
        c.put(epoch, "a@x", id("a@x/1"), &inputs());
        assert!(c.get("a@x", id("a@x/1")).is_some());
    }

    #[test]
    fn a_zero_ttl_caches_nothing() {
        let c = on(0);
        c.put(0, "a@x", id("a@x/1"), &inputs());
        assert!(c.is_empty());
    }
}
