//! Interest lists (`urn:presenced:interest:0`, advertised in the server's disco#info): a
//! client names the contacts whose presence it shows right now (the open chat, the visible
//! part of the contact list), so that while it is inactive (XEP-0352, [`crate::services::csi`]) their
//! presence still reaches it at once and everyone else's is held.
//!
//! ```xml
//! <iq type='set' id='i1'>
//!   <interest xmlns='urn:presenced:interest:0'>
//!     <item jid='bob@example.org'/>
//!     <item jid='carol@example.net'/>
//!   </interest>
//! </iq>
//! ```
//!
//! A set replaces the session's list (an empty one clears it) and answers with a result.
//! The list belongs to the one session that set it and lapses `[limits] interest_ttl`
//! (default 5 minutes) after it was last set, so a client that stops refreshing it falls
//! back to plain XEP-0352 holding. Items are bare JIDs (a full JID is `bad-request`, an
//! unparseable one `jid-malformed`); more than `[limits] max_interest_items` (default 500)
//! is `not-acceptable`, as are the other size limits of a list the server keeps for a
//! client; a get or any other payload is `bad-request`. The list changes only which held
//! presence is written early: it never lets anyone see more than the privacy gate allows.

use std::collections::HashSet;
use std::time::Duration;

use crate::node::sessions::{InterestList, SessionHandle};
use crate::protocol::error::{reply_skeleton, StanzaError};
use crate::protocol::jid::Jid;
use crate::protocol::stanza::IqType;
use crate::protocol::xml::Element;

/// The interest-list namespace.
pub(crate) const NS_INTEREST: &str = "urn:presenced:interest:0";

/// Handles an iq in [`NS_INTEREST`] a session sent to its own account: checks the list,
/// then hands it to the session's writer, valid for `ttl`.
pub(crate) fn handle_iq(
    session: &SessionHandle,
    iq: &Element,
    ty: IqType,
    payload: &Element,
    max_items: usize,
    ttl: Duration,
) -> Element {
    let error = |e: StanzaError| {
        e.reply_to(iq)
            .unwrap_or_else(|| reply_skeleton(iq, "result"))
    };
    if ty != IqType::Set || payload.name != "interest" {
        return error(StanzaError::bad_request());
    }
    let mut contacts = HashSet::new();
    for item in payload.elements() {
        if item.name != "item" || item.ns != NS_INTEREST {
            return error(StanzaError::bad_request().with_text("only <item/> is allowed"));
        }
        let Some(jid) = item.get_attr("jid") else {
            return error(StanzaError::bad_request().with_text("an item needs a jid"));
        };
        let bare = match crate::protocol::jid::parse(jid).map(Jid::try_into_full) {
            Ok(Err(bare)) => bare,
            Ok(Ok(_)) => return error(StanzaError::bad_request().with_text("items are bare JIDs")),
            Err(_) => return error(StanzaError::jid_malformed()),
        };
        contacts.insert(bare.to_string());
        if contacts.len() > max_items {
            return error(
                StanzaError::not_acceptable().with_text(format!("at most {max_items} items")),
            );
        }
    }
    let expires = tokio::time::Instant::now() + ttl;
    tracing::debug!(jid = %session.jid, items = contacts.len(), "interest list set");
    session.set_interest(InterestList { contacts, expires });
    reply_skeleton(iq, "result")
}
