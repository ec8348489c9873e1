//! Server-to-server federation (RFC 6120 over `jabber:server`, XEP-0220 dialback,
//! XEP-0178 SASL EXTERNAL). Not wired yet: every remote stanza is refused here, in one
//! place, so the router and presence code already call the function federation will fill.

use crate::error::StanzaError;
use crate::server::Shared;
use crate::xml::Element;

/// Sends a stanza whose `to` is on a domain this server does not host. `from` is already
/// stamped. `Err` is the stanza error to bounce to the sender (RFC 6120 §8.3.3.16).
pub fn route_remote(shared: &Shared, stanza: Element) -> Result<(), StanzaError> {
    let _ = (shared, stanza);
    Err(StanzaError::remote_server_not_found())
}
