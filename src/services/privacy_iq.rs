//! The visibility-settings iq of this server, namespace `urn:presenced:privacy:0`: how a
//! client reads and changes who may see its user's online status and last seen (README, "Privacy").
//! Advertised as a server feature in disco#info.
//!
//! ```xml
//! <!-- read -->
//! <iq type='get' id='p1'><privacy xmlns='urn:presenced:privacy:0'/></iq>
//! <iq type='result' id='p1'>
//!   <privacy xmlns='urn:presenced:privacy:0'>
//!     <online mode='subscribers'/>
//!     <last-seen mode='contacts_except'><except jid='boss@example.org'/></last-seen>
//!   </privacy>
//! </iq>
//!
//! <!-- change: each of <online/> and <last-seen/> is optional; an absent one is kept -->
//! <iq type='set' id='p2'>
//!   <privacy xmlns='urn:presenced:privacy:0'><online mode='nobody'/></privacy>
//! </iq>
//! <iq type='result' id='p2'/>
//! ```
//!
//! `mode` is `subscribers` (approved subscribers, plain RFC 6121, the default),
//! `contacts_except` (subscribers minus the `<except jid='…'/>` bare JIDs) or `nobody`.
//! Errors: an unknown mode, `<except/>` with another mode or a full JID →
//! `bad-request`; an unparseable JID → `jid-malformed`; more exceptions than
//! `[limits] max_roster_items` (an exception names a contact, so a list never needs to be
//! longer than a roster) → `not-acceptable`. The iq must be sent to the user's own
//! account (no `to`, or the bare JID).
//!
//! The change is committed before the result is sent, and presence already shown to a
//! viewer who lost permission is withdrawn at once (unavailable), on this node directly
//! and on every other through `NOTIFY presenced_privacy`.

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::node::live::Live;
use crate::node::session::Client;
use crate::policy::privacy::{PrivacySettings, Visibility};
use crate::protocol::error::{iq_result, StanzaError};
use crate::protocol::stanza::IqType;
use crate::protocol::xml::Element;
use crate::services::presence::Presence;
use crate::store::{Store, StoreError};

/// The namespace of the settings iq.
pub(crate) const NS_PRIVACY: &str = "urn:presenced:privacy:0";

/// The service behind the settings iq: the settings in the store, the roster limit that
/// bounds their exception lists, and the withdrawal of presence a change makes unseen.
pub struct Privacy {
    store: Store,
    live: Arc<Live>,
    presence: Arc<Presence>,
}

impl Privacy {
    /// The service over the node's store, limits and presence.
    pub fn new(store: Store, live: Arc<Live>, presence: Arc<Presence>) -> Self {
        Privacy {
            store,
            live,
            presence,
        }
    }

    /// Handles an `urn:presenced:privacy:0` iq the user sent to their own account.
    pub async fn handle(
        &self,
        session: &Client,
        iq: &Element,
        ty: IqType,
        payload: &Element,
    ) -> Element {
        match self.handle_inner(session, iq, ty, payload).await {
            Ok(r) => r,
            Err(e) => e.reply_to(iq).unwrap_or_else(|| iq_result(iq)),
        }
    }

    async fn handle_inner(
        &self,
        session: &Client,
        iq: &Element,
        ty: IqType,
        payload: &Element,
    ) -> Result<Element, StanzaError> {
        if payload.name != "privacy" {
            return Err(StanzaError::bad_request());
        }
        let owner_jid = session.jid().to_bare();
        let owner = owner_jid.to_string();
        let current = self.store.privacy_settings(&owner).await.map_err(failed)?;
        match ty {
            IqType::Get => Ok(iq_result(iq).child(to_element(&current))),
            IqType::Set => {
                let limit = usize::try_from(self.live.get().limits.max_roster_items).unwrap_or(0);
                let new = apply(&current, payload, limit)?;
                if new != current {
                    self.store
                        .set_privacy_settings(&owner, &new)
                        .await
                        .map_err(failed)?;
                    self.presence.reconcile_user(&owner_jid).await;
                }
                Ok(iq_result(iq))
            }
            _ => Err(StanzaError::bad_request()),
        }
    }
}

fn failed(e: StoreError) -> StanzaError {
    match e {
        StoreError::Constraint(c) => StanzaError::bad_request().with_text(c),
        other => {
            tracing::error!(error = %other, "privacy settings store failure");
            StanzaError::internal_server_error()
        }
    }
}

/// The `<privacy/>` element describing `settings`.
pub(crate) fn to_element(settings: &PrivacySettings) -> Element {
    Element::new("privacy", NS_PRIVACY)
        .child(signal_element("online", &settings.online))
        .child(signal_element("last-seen", &settings.last_seen))
}

fn signal_element(name: &str, v: &Visibility) -> Element {
    let (mode, except) = match v {
        Visibility::Subscribers => ("subscribers", None),
        Visibility::ContactsExcept(list) => ("contacts_except", Some(list)),
        Visibility::Nobody => ("nobody", None),
    };
    let mut e = Element::new(name, NS_PRIVACY).attr("mode", mode);
    for j in except.into_iter().flatten() {
        e = e.child(Element::new("except", NS_PRIVACY).attr("jid", j.to_string()));
    }
    e
}

/// `current` with the changes `payload` asks for; pure, so it is tested on its own.
pub(crate) fn apply(
    current: &PrivacySettings,
    payload: &Element,
    max_exceptions: usize,
) -> Result<PrivacySettings, StanzaError> {
    let mut out = current.clone();
    for child in payload.elements() {
        if child.ns != NS_PRIVACY {
            return Err(StanzaError::bad_request().with_text("unknown element"));
        }
        let v = parse_visibility(child, max_exceptions)?;
        match child.name.as_str() {
            "online" => out.online = v,
            "last-seen" => out.last_seen = v,
            _ => return Err(StanzaError::bad_request().with_text("unknown element")),
        }
    }
    Ok(out)
}

fn parse_visibility(el: &Element, max_exceptions: usize) -> Result<Visibility, StanzaError> {
    let excepts: Vec<&Element> = el
        .elements()
        .filter(|e| e.is("except", NS_PRIVACY))
        .collect();
    if el.elements().count() != excepts.len() {
        return Err(StanzaError::bad_request().with_text("unknown element"));
    }
    let mode = el.get_attr("mode").unwrap_or("");
    if mode != "contacts_except" && !excepts.is_empty() {
        return Err(
            StanzaError::bad_request().with_text("<except/> is only allowed with contacts_except")
        );
    }
    match mode {
        "subscribers" => Ok(Visibility::Subscribers),
        "nobody" => Ok(Visibility::Nobody),
        "contacts_except" => {
            if excepts.len() > max_exceptions {
                return Err(StanzaError::not_acceptable().with_text("too many exceptions"));
            }
            let mut set = BTreeSet::new();
            for e in excepts {
                let Some(j) = e.get_attr("jid") else {
                    return Err(StanzaError::bad_request().with_text("<except/> without jid"));
                };
                let jid =
                    crate::protocol::jid::parse(j).map_err(|_| StanzaError::jid_malformed())?;
                if jid.resource().is_some() {
                    return Err(StanzaError::bad_request().with_text("exceptions are bare JIDs"));
                }
                let bare = jid.into_bare();
                set.insert(bare);
            }
            Ok(Visibility::ContactsExcept(set))
        }
        _ => {
            Err(StanzaError::bad_request()
                .with_text("mode is subscribers, contacts_except or nobody"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::xml::parse_element;

    fn el(xml: &str) -> Element {
        parse_element(xml).expect("test XML parses")
    }

    #[test]
    fn partial_set_keeps_the_other_signal_and_round_trips() {
        let current = PrivacySettings {
            online: Visibility::Nobody,
            last_seen: Visibility::Subscribers,
        };
        let new = apply(
            &current,
            &el(
                "<privacy xmlns='urn:presenced:privacy:0'><last-seen mode='contacts_except'>\
                 <except jid='Bob@Example.org'/></last-seen></privacy>",
            ),
            10,
        )
        .unwrap();
        assert_eq!(new.online, Visibility::Nobody);
        let Visibility::ContactsExcept(list) = &new.last_seen else {
            panic!("{new:?}");
        };
        assert_eq!(
            list.iter().map(|j| j.as_str()).collect::<Vec<_>>(),
            ["bob@example.org"]
        );
        assert_eq!(
            apply(&PrivacySettings::default(), &to_element(&new), 10).unwrap(),
            new
        );
    }

    #[test]
    fn malformed_settings_get_the_documented_errors() {
        let cases = [
            ("<online mode='everyone'/>", "bad-request"),
            (
                "<online mode='nobody'><except jid='a@b'/></online>",
                "bad-request",
            ),
            (
                "<online mode='contacts_except'><except jid='a@b/r'/></online>",
                "bad-request",
            ),
            (
                "<online mode='contacts_except'><except jid='@@'/></online>",
                "jid-malformed",
            ),
            (
                "<online mode='contacts_except'><except/></online>",
                "bad-request",
            ),
            (
                "<online mode='contacts_except'><except jid='a@b'/><except jid='c@d'/></online>",
                "not-acceptable",
            ),
            ("<status mode='nobody'/>", "bad-request"),
        ];
        for (inner, want) in cases {
            let payload = el(&format!(
                "<privacy xmlns='urn:presenced:privacy:0'>{inner}</privacy>"
            ));
            let err = apply(&PrivacySettings::default(), &payload, 1).unwrap_err();
            assert_eq!(err.condition.as_str(), want, "{inner}");
        }
    }
}
