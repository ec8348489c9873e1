//! XEP-0186 invisible command: a session that is online but appears offline.
//!
//! `<invisible xmlns='urn:xmpp:invisible:0'/>` (iq set, to the user's own account) makes
//! the session invisible; `<visible/>` makes it visible again. While invisible:
//!
//! * its presence is broadcast to nobody but the user's own resources;
//! * probes for the user are answered as if this session did not exist (unavailable when
//!   it is the only one, with a last-seen stamp only where last seen may be shown);
//! * iq requests to its full JID get `service-unavailable` and messages that only carry
//!   chat states or receipts from it are not relayed (see [`crate::routing::router`]), exactly as
//!   for an offline resource;
//! * it can still send directed presence (XEP-0186 §3.1), which reveals it to that one
//!   recipient until it sends unavailable or blocks the recipient;
//! * probes to local contacts are still answered for it (that tells the contacts
//!   nothing); probes to remote contacts, which tell their servers the user logged in,
//!   are sent only when the command says `probe='true'`.
//!
//! Becoming invisible withdraws what was shown: every viewer this resource's presence
//! reached (subscribers and directed recipients) gets unavailable from it. Becoming visible
//! shows the session's last presence, if it sent one, to everyone the privacy settings
//! admit, as a broadcast would.

use crate::node::session::Client;
use crate::protocol::error::{iq_result, StanzaError};
use crate::protocol::stanza::IqType;
use crate::protocol::xml::Element;
use crate::services::presence::Presence;

/// The XEP-0186 namespace.
pub(crate) const NS_INVISIBLE: &str = "urn:xmpp:invisible:0";

/// Handles an `urn:xmpp:invisible:0` iq the user sent to their own account; presence
/// withdraws or shows the session.
pub(crate) async fn handle(
    presence: &Presence,
    client: &Client,
    iq: &Element,
    ty: IqType,
    payload: &Element,
) -> Element {
    if ty != IqType::Set {
        // XEP-0186 defines only set.
        return error(iq, StanzaError::bad_request());
    }
    match payload.name.as_str() {
        "invisible" => {
            let probe = matches!(payload.get_attr("probe"), Some("true") | Some("1"));
            presence.become_invisible(client, probe).await;
            iq_result(iq)
        }
        "visible" => {
            presence.become_visible(client).await;
            iq_result(iq)
        }
        _ => error(iq, StanzaError::bad_request()),
    }
}

fn error(iq: &Element, e: StanzaError) -> Element {
    e.reply_to(iq).unwrap_or_else(|| iq_result(iq))
}
