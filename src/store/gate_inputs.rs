//! The privacy gate's inputs for many decisions, each set read in ONE statement.
//!
//! `presence::gate` asks the pure `policy::privacy::may_see` for every viewer a presence
//! could reach. Reading its inputs one decision at a time (settings, a roster item, two
//! block lookups, the viewer's settings, last seen) cost about ten round trips per contact
//! per login and eight per presence broadcast, and those round trips were most of the
//! server's CPU under load. These two queries read the same rows in one statement
//! (so also in one snapshot), for:
//!
//! * [`Store::audience_inputs`]: a subject's presence broadcast (RFC 6121 §4.2.2, §4.4.2)
//!   to everyone on its roster;
//! * [`Store::probe_inputs`]: the answers to one prober's probes of several subjects
//!   (RFC 6121 §4.3.2), as at the prober's login.
//!
//! Every call reads the committed state, as the single-decision reads did (what is kept
//! between broadcasts is [`super::audience_cache`]'s business). Block matching is the XEP-0016 §2.1 rule of [`super::blocks::match_candidates`]:
//! the JID whose presence goes out is matched in all its forms (passed in, computed by
//! that function), and a bare roster contact `user@domain` in its two forms, the bare JID
//! and the domain (`substr(c, strpos(c, '@') + 1)` is the domain of a bare JID, and the
//! whole string for a domain JID, exactly as `match_candidates` splits it).

use chrono::{DateTime, Utc};

use ::jid::BareJid;

use super::privacy::from_columns;
use sqlx::Row;

use super::{pg_or_sqlite, stored_jid, RosterItem, Store, StoreError, Subscription};
use crate::policy::privacy::PrivacySettings;

/// One roster item of a subject, with the blocks between the subject and that contact.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AudienceContact {
    /// The contact's bare JID.
    pub contact: BareJid,
    /// The subject's subscription state with the contact.
    pub subscription: Subscription,
    /// The contact's block list matches the subject's JID (only local contacts have one).
    pub blocks_subject: bool,
    /// The subject's block list matches the contact.
    pub blocked_by_subject: bool,
}

impl AudienceContact {
    /// One contact of `subject` as read: its subscription is the stored text. A contact
    /// that is no JID ([`super::stored_jid`]) is `None`: it is left out of the inputs, so
    /// it is shown nothing and probed by no one, the gate failing closed.
    pub(super) fn from_columns(
        subject: &str,
        contact: &str,
        subscription: &str,
        blocks_subject: bool,
        blocked_by_subject: bool,
    ) -> Result<Option<AudienceContact>, StoreError> {
        let subscription = subscription_from(subscription)?;
        let Some(contact) = stored_jid("roster_items", subject, contact) else {
            return Ok(None);
        };
        Ok(Some(AudienceContact {
            contact,
            subscription,
            blocks_subject,
            blocked_by_subject,
        }))
    }
}

/// A subject's roster as read, one `(contact, subscription, blocks_subject,
/// blocked_by_subject)` a row in contact order: the contacts that are JIDs
/// ([`AudienceContact::from_columns`]), in that order. The one reading for both stores.
pub(super) fn audience_roster(
    subject: &str,
    rows: impl IntoIterator<Item = (String, String, bool, bool)>,
) -> Result<Vec<AudienceContact>, StoreError> {
    rows.into_iter()
        .map(|(contact, sub, blocks_subject, blocked_by_subject)| {
            AudienceContact::from_columns(
                subject,
                &contact,
                &sub,
                blocks_subject,
                blocked_by_subject,
            )
        })
        .filter_map(Result::transpose)
        .collect()
}

/// Everything a subject's broadcast decision needs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AudienceInputs {
    /// The subject's settings (defaults when it never changed them).
    pub settings: PrivacySettings,
    /// The subject's whole roster, ordered by contact.
    pub roster: Vec<AudienceContact>,
}

/// One login's read of a user's roster ([`Store::login_roster`]): what the roster result
/// shows and what the privacy gate decides the initial broadcast and the probes on, from
/// the same rows. The items come first (the roster result is built from them); the gate's
/// inputs are then made from the same items ([`LoginRoster::into_inputs`]), each contact's
/// JID moved rather than copied: a login holds those inputs until its initial presence,
/// and a copy per contact was most of its short-lived memory at K = 300 (BENCHMARKS.md).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoginRoster {
    /// The roster's XEP-0237 version (0 without a roster row).
    pub version: i64,
    /// The items, ordered by contact, cut to the limits.
    pub items: Vec<RosterItem>,
    /// The user's settings (defaults when it never changed them).
    pub settings: PrivacySettings,
    /// For each item, in order: (the contact's block list matches the user's JID, the
    /// user's block list matches the contact).
    pub(super) blocks: Vec<(bool, bool)>,
}

impl LoginRoster {
    /// Room for `rows` rows, taken once (grown by doubling, the lists would hold up to
    /// twice what they use until the login's initial presence).
    pub(super) fn reserve(&mut self, rows: usize) {
        self.items.reserve_exact(rows);
        self.blocks.reserve_exact(rows);
    }

    /// Adds one row as read: its item (`None`: its contact is no JID, left out of both)
    /// with the block flags between the user and that contact.
    pub(super) fn push(
        &mut self,
        item: Option<RosterItem>,
        blocks_subject: bool,
        blocked_by_subject: bool,
    ) {
        let Some(item) = item else { return };
        self.items.push(item);
        self.blocks.push((blocks_subject, blocked_by_subject));
    }

    /// The gate's inputs for the user's presence: [`Store::audience_inputs`] as this read
    /// has them, the items' contacts moved into them.
    pub fn into_inputs(self) -> AudienceInputs {
        let roster = self
            .items
            .into_iter()
            .zip(self.blocks)
            .map(
                |(item, (blocks_subject, blocked_by_subject))| AudienceContact {
                    contact: item.contact,
                    subscription: item.subscription,
                    blocks_subject,
                    blocked_by_subject,
                },
            )
            .collect();
        AudienceInputs {
            settings: self.settings,
            roster,
        }
    }
}

/// One probed subject, as seen from the prober: [`Store::probe_inputs`] gives one for each
/// subject asked for, in the order asked (the subject's JID is not copied into it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeSubject {
    /// The subject's roster item for the prober, if any.
    pub subscription: Option<Subscription>,
    /// The subject's settings (defaults when it never changed them or is no account).
    pub settings: PrivacySettings,
    /// The subject's block list matches the prober's JID.
    pub blocks_prober: bool,
    /// The prober's block list (a local prober only) matches the subject.
    pub blocked_by_prober: bool,
    /// When the subject was last seen, as PostgreSQL has it.
    pub last_seen: Option<DateTime<Utc>>,
}

/// The settings columns of a row read with a LEFT JOIN: all `None` means no row, i.e. the
/// defaults.
type SettingsColumns = (
    Option<String>,
    Option<Vec<String>>,
    Option<String>,
    Option<Vec<String>>,
);

pub(super) fn settings_from(
    cols: SettingsColumns,
    defaults: &PrivacySettings,
) -> Result<PrivacySettings, StoreError> {
    match cols {
        (Some(online), online_except, Some(last_seen), last_seen_except) => Ok(PrivacySettings {
            online: from_columns(&online, online_except.unwrap_or_default())?,
            last_seen: from_columns(&last_seen, last_seen_except.unwrap_or_default())?,
        }),
        _ => Ok(defaults.clone()),
    }
}

/// The probe statements give one row per subject, in order; the rows are paired with the
/// subjects asked for, so a count that differs is a broken statement.
pub(super) fn probe_rows(subjects: &[&BareJid], rows: usize) -> Result<(), StoreError> {
    if rows != subjects.len() {
        return Err(StoreError::Corrupt(format!(
            "{rows} probe rows for {} subjects",
            subjects.len()
        )));
    }
    Ok(())
}

pub(super) fn subscription_from(s: &str) -> Result<Subscription, StoreError> {
    Subscription::parse(s)
        .ok()
        .ok_or_else(|| StoreError::Corrupt(format!("subscription {s:?}")))
}

impl Store {
    /// The settings and whole roster of local user `subject` (bare JID), each contact with
    /// the block flags between it and `subject_forms` (the [`super::blocks::match_candidates`]
    /// of the JID whose presence goes out). One statement, one row: the roster comes as
    /// parallel arrays so the settings (and their exception lists) are sent once.
    pub async fn audience_inputs(
        &self,
        subject: &str,
        subject_forms: &[String],
    ) -> Result<AudienceInputs, StoreError> {
        let defaults = self.privacy_defaults();
        let pool = pg_or_sqlite!(self, |db| db.audience_inputs(
            subject,
            subject_forms,
            &defaults
        ));
        type Row = (
            Option<String>,
            Option<Vec<String>>,
            Option<String>,
            Option<Vec<String>>,
            Vec<String>,
            Vec<String>,
            Vec<bool>,
            Vec<bool>,
        );
        let row: Row = sqlx::query_as(
            "SELECT ps.online, ps.online_except, ps.last_seen, ps.last_seen_except,
                    coalesce(r.contacts, '{}'), coalesce(r.subs, '{}'),
                    coalesce(r.blocks_subject, '{}'), coalesce(r.blocked_by_subject, '{}')
             FROM (SELECT $1::text AS owner) o
             LEFT JOIN privacy_settings ps ON ps.owner = o.owner
             CROSS JOIN LATERAL (
                 SELECT array_agg(ri.contact ORDER BY ri.contact) AS contacts,
                        array_agg(ri.subscription ORDER BY ri.contact) AS subs,
                        array_agg(EXISTS (
                            SELECT 1 FROM blocklist b
                            WHERE b.owner = ri.contact AND b.blocked = ANY($2::text[])
                        ) ORDER BY ri.contact) AS blocks_subject,
                        array_agg(EXISTS (
                            SELECT 1 FROM blocklist b
                            WHERE b.owner = o.owner
                              AND b.blocked IN (ri.contact,
                                                substr(ri.contact, strpos(ri.contact, '@') + 1))
                        ) ORDER BY ri.contact) AS blocked_by_subject
                 FROM roster_items ri WHERE ri.owner = o.owner
             ) r",
        )
        .bind(subject)
        .bind(subject_forms)
        .fetch_one(pool)
        .await?;
        let (online, online_except, last_seen, last_seen_except, contacts, subs, by_c, by_s) = row;
        let settings = settings_from(
            (online, online_except, last_seen, last_seen_except),
            &defaults,
        )?;
        if subs.len() != contacts.len()
            || by_c.len() != contacts.len()
            || by_s.len() != contacts.len()
        {
            return Err(StoreError::Corrupt(
                "audience arrays differ in length".into(),
            ));
        }
        let rows = contacts
            .into_iter()
            .zip(subs)
            .zip(by_c.into_iter().zip(by_s))
            .map(|((contact, sub), (blocks, blocked))| (contact, sub, blocks, blocked));
        let roster = audience_roster(subject, rows)?;
        Ok(AudienceInputs { settings, roster })
    }

    /// What a login reads of local user `subject` (bare JID), in ONE statement: the whole
    /// roster with its version, for the roster result, and [`Store::audience_inputs`]
    /// (settings, and the blocks between each contact and `subject_forms`) from the same
    /// rows, for the initial broadcast and the choice of whom to probe. A row whose
    /// contact is no JID is left out of both.
    pub async fn login_roster(
        &self,
        subject: &str,
        subject_forms: &[String],
    ) -> Result<LoginRoster, StoreError> {
        let defaults = self.privacy_defaults();
        let limits = self.limits();
        let pool = pg_or_sqlite!(self, |db| db.login_roster(
            subject,
            subject_forms,
            &defaults,
            &limits
        ));
        // The settings ride on every row (a login's exception lists are short next to a
        // second round trip); the outer joins give one row for an empty roster.
        let rows = sqlx::query(&format!(
            "SELECT v.roster_version, ps.online, ps.online_except, ps.last_seen,
                    ps.last_seen_except, {},
                    EXISTS (SELECT 1 FROM blocklist b
                            WHERE b.owner = ri.contact AND b.blocked = ANY($2::text[]))
                        AS blocks_subject,
                    EXISTS (SELECT 1 FROM blocklist b
                            WHERE b.owner = $1
                              AND b.blocked IN (ri.contact,
                                                substr(ri.contact, strpos(ri.contact, '@') + 1)))
                        AS blocked_by_subject
             FROM (SELECT coalesce((SELECT version FROM roster_versions WHERE owner = $1), 0)
                          AS roster_version) v
             LEFT JOIN privacy_settings ps ON ps.owner = $1
             LEFT JOIN roster_items ri ON ri.owner = $1
             ORDER BY ri.contact",
            super::roster::item_columns(&limits)
        ))
        .bind(subject)
        .bind(subject_forms)
        .fetch_all(pool)
        .await?;
        let mut login = LoginRoster::default();
        login.reserve(rows.len());
        if let Some(first) = rows.first() {
            login.version = first.try_get("roster_version")?;
            login.settings = settings_from(
                (
                    first.try_get("online")?,
                    first.try_get("online_except")?,
                    first.try_get("last_seen")?,
                    first.try_get("last_seen_except")?,
                ),
                &defaults,
            )?;
        } else {
            login.settings = defaults;
        }
        for row in &rows {
            if row.try_get::<Option<&str>, _>("contact")?.is_none() {
                continue;
            }
            let item = super::roster::item_from_row(subject, row, &limits)?;
            login.push(
                item,
                row.try_get("blocks_subject")?,
                row.try_get("blocked_by_subject")?,
            );
        }
        Ok(login)
    }

    /// For each of `subjects` (local bare JIDs): its roster item for `prober` (bare JID),
    /// its settings, the blocks between it and the prober (`prober_forms`: the
    /// [`super::blocks::match_candidates`] of the prober's JID as the probe came from it),
    /// and its stored last seen. One statement; rows in the order of `subjects`.
    pub async fn probe_inputs(
        &self,
        prober: &str,
        prober_forms: &[String],
        subjects: &[&BareJid],
    ) -> Result<Vec<ProbeSubject>, StoreError> {
        type Row = (
            Option<String>,
            Option<String>,
            Option<Vec<String>>,
            Option<String>,
            Option<Vec<String>>,
            bool,
            bool,
            Option<DateTime<Utc>>,
        );
        if subjects.is_empty() {
            return Ok(Vec::new());
        }
        let defaults = self.privacy_defaults();
        let pool = pg_or_sqlite!(self, |db| db.probe_inputs(
            prober,
            prober_forms,
            subjects,
            &defaults
        ));
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT ri.subscription,
                    ps.online, ps.online_except, ps.last_seen, ps.last_seen_except,
                    EXISTS (SELECT 1 FROM blocklist b
                            WHERE b.owner = s.subject AND b.blocked = ANY($2::text[])),
                    EXISTS (SELECT 1 FROM blocklist b
                            WHERE b.owner = $1
                              AND b.blocked IN (s.subject,
                                                substr(s.subject, strpos(s.subject, '@') + 1))),
                    la.seen_at
             FROM unnest($3::text[]) WITH ORDINALITY AS s (subject, n)
             LEFT JOIN roster_items ri ON ri.owner = s.subject AND ri.contact = $1
             LEFT JOIN privacy_settings ps ON ps.owner = s.subject
             LEFT JOIN last_activity la ON la.jid = s.subject
             ORDER BY s.n",
        )
        .bind(prober)
        .bind(prober_forms)
        .bind(subjects.iter().map(|j| j.as_str()).collect::<Vec<_>>())
        .fetch_all(pool)
        .await?;
        probe_rows(subjects, rows.len())?;
        rows.into_iter()
            .map(
                |(sub, online, online_except, last_seen, last_seen_except, bp, bbp, la)| {
                    Ok(ProbeSubject {
                        subscription: sub.as_deref().map(subscription_from).transpose()?,
                        settings: settings_from(
                            (online, online_except, last_seen, last_seen_except),
                            &defaults,
                        )?,
                        blocks_prober: bp,
                        blocked_by_prober: bbp,
                        last_seen: la,
                    })
                },
            )
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_audience_keeps_its_order_and_leaves_out_a_contact_that_is_no_jid() {
        let row = |c: &str, s: &str, blocks| (c.to_owned(), s.to_owned(), blocks, false);
        let rows = [
            row("a@x", "both", false),
            row("not a jid@@", "both", false),
            row("c@x", "to", true),
        ];
        let roster = audience_roster("u@h", rows).unwrap();
        let read: Vec<(&str, Subscription, bool)> = roster
            .iter()
            .map(|c| (c.contact.as_str(), c.subscription, c.blocks_subject))
            .collect();
        assert_eq!(
            read,
            [
                ("a@x", Subscription::Both, false),
                ("c@x", Subscription::To, true)
            ]
        );
        let corrupt = audience_roster("u@h", [row("a@x", "sometimes", false)]);
        assert!(matches!(corrupt, Err(StoreError::Corrupt(_))));
    }
}
