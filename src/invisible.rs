//! XEP-0186 invisible command: a session that is online but appears offline.
//!
//! `<invisible xmlns='urn:xmpp:invisible:0'/>` (iq set, to the user's own account) makes
//! the session invisible; `<visible/>` makes it visible again. While invisible:
//!
//! * its presence is broadcast to nobody but the user's own resources;
//! * probes for the user are answered as if this session did not exist (unavailable when
//!   it is the only one, with a last-seen stamp only where last seen may be shown);
//! * iq requests to its full JID get `service-unavailable` and messages that only carry
//!   chat states or receipts from it are not relayed (see [`crate::router`]), exactly as
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

use crate::error::{iq_result, StanzaError};
use crate::node::session::Session;
use crate::stanza::IqType;
use crate::xml::Element;

/// The XEP-0186 namespace.
pub const NS_INVISIBLE: &str = "urn:xmpp:invisible:0";

/// Handles an `urn:xmpp:invisible:0` iq the user sent to their own account.
pub async fn handle(session: &mut Session, iq: &Element, ty: IqType, payload: &Element) -> Element {
    if ty != IqType::Set {
        // XEP-0186 defines only set.
        return error(iq, StanzaError::bad_request());
    }
    let shared = session.shared.clone();
    let me = session.jid().to_string();
    match payload.name.as_str() {
        "invisible" => {
            let probe = matches!(payload.get_attr("probe"), Some("true") | Some("1"));
            {
                let _guard = shared
                    .subject_locks
                    .lock_subject(crate::jid::bare_of(&me))
                    .await;
                // Withdraw what this resource had shown (subscribers and directed); the
                // directed set goes with it, so its later unavailable repeats nothing.
                let revealed = session.handle.write(|p| {
                    p.invisible = true;
                    p.probe_remote = probe;
                    p.take_directed();
                    p.take_revealed()
                });
                crate::presence::to_directory(&shared, &session.handle);
                for (viewer, _) in revealed {
                    let p = crate::node::send::unavailable(&me, &viewer);
                    crate::node::send::presence_to(&shared, &viewer, p);
                }
            }
            iq_result(iq)
        }
        "visible" => {
            session.handle.write(|p| {
                p.invisible = false;
                p.probe_remote = false;
            });
            crate::presence::to_directory(&shared, &session.handle);
            crate::presence::gate::reconcile_subject(&shared, &session.jid().to_bare()).await;
            iq_result(iq)
        }
        _ => error(iq, StanzaError::bad_request()),
    }
}

fn error(iq: &Element, e: StanzaError) -> Element {
    e.reply_to(iq).unwrap_or_else(|| iq_result(iq))
}
