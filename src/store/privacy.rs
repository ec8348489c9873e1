//! Presence and last-seen visibility settings (README, "Privacy"), table `privacy_settings`.
//!
//! Stores the [`PrivacySettings`] that `policy::privacy::may_see` reads. An account
//! with no row has the defaults (both signals visible to approved subscribers), so
//! nothing is written until a user changes something. A trigger sends
//! `NOTIFY presenced_privacy, '<owner>'` on every change so other nodes drop caches.
//!
//! The size of an exception list is a config limit checked by the caller before
//! [`Store::set_privacy_settings`]; the schema only checks the entries are distinct bare
//! JIDs.

use std::collections::BTreeSet;

use ::jid::BareJid;

use super::{pg_or_sqlite, Store, StoreError};
use crate::policy::privacy::{PrivacySettings, Visibility};

/// Database form of one [`Visibility`]: the mode column and the exception list.
fn to_columns(v: &Visibility) -> (&'static str, Vec<&str>) {
    match v {
        Visibility::Subscribers => ("subscribers", Vec::new()),
        Visibility::ContactsExcept(except) => (
            "contacts_except",
            except.iter().map(|j| j.as_str()).collect(),
        ),
        Visibility::Nobody => ("nobody", Vec::new()),
    }
}

/// Reads one [`Visibility`] back; anything the schema should have refused is
/// [`StoreError::Corrupt`].
pub(super) fn from_columns(mode: &str, except: Vec<String>) -> Result<Visibility, StoreError> {
    match mode {
        "subscribers" => Ok(Visibility::Subscribers),
        "nobody" => Ok(Visibility::Nobody),
        "contacts_except" => {
            let set = except
                .iter()
                .map(|s| {
                    crate::protocol::jid::parse_bare(s)
                        .map_err(|e| StoreError::Corrupt(format!("privacy exception {s:?}: {e}")))
                })
                .collect::<Result<BTreeSet<BareJid>, StoreError>>()?;
            Ok(Visibility::ContactsExcept(set))
        }
        other => Err(StoreError::Corrupt(format!("privacy mode {other:?}"))),
    }
}

impl Store {
    /// `owner`'s settings; the defaults when the owner never changed them (or is not an
    /// account, which the caller has ruled out already).
    pub async fn privacy_settings(&self, owner: &str) -> Result<PrivacySettings, StoreError> {
        let defaults = self.privacy_defaults();
        let pool = pg_or_sqlite!(self, |db| db.privacy_settings(owner, &defaults));
        let row: Option<(String, Vec<String>, String, Vec<String>)> = sqlx::query_as(
            "SELECT online, online_except, last_seen, last_seen_except
             FROM privacy_settings WHERE owner = $1",
        )
        .bind(owner)
        .fetch_optional(pool)
        .await?;
        match row {
            None => Ok(defaults),
            Some((online, online_except, last_seen, last_seen_except)) => Ok(PrivacySettings {
                online: from_columns(&online, online_except)?,
                last_seen: from_columns(&last_seen, last_seen_except)?,
            }),
        }
    }

    /// Replaces `owner`'s settings with `settings` (both signals at once, one statement).
    /// An owner that is no account gives [`StoreError::NoSuchAccount`].
    pub async fn set_privacy_settings(
        &self,
        owner: &str,
        settings: &PrivacySettings,
    ) -> Result<(), StoreError> {
        // Drops the gate's cached inputs this write may alter, on every way out.
        let _forget = self.forget_owners([owner]);
        let (online, online_except) = to_columns(&settings.online);
        let (last_seen, last_seen_except) = to_columns(&settings.last_seen);
        let pool = pg_or_sqlite!(self, |db| db.set_privacy_settings(
            owner,
            (online, online_except.clone()),
            (last_seen, last_seen_except.clone())
        ));
        sqlx::query(
            "INSERT INTO privacy_settings (owner, online, online_except, last_seen, last_seen_except)
             VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (owner) DO UPDATE
                 SET online = EXCLUDED.online, online_except = EXCLUDED.online_except,
                     last_seen = EXCLUDED.last_seen, last_seen_except = EXCLUDED.last_seen_except",
        )
        .bind(owner)
        .bind(online)
        .bind(&online_except)
        .bind(last_seen)
        .bind(&last_seen_except)
        .execute(pool)
        .await?;
        Ok(())
    }
}
