//! A bound client session's state as the services see it, and where an address points
//! from this node. The session's task (the transport, [`crate::transport::c2s`]) owns the value and
//! lends it to the router and the services, which therefore need nothing from the
//! transport.

use std::net::SocketAddr;

use crate::node::sessions::SessionHandle;
use crate::protocol::error::StanzaError;
use crate::protocol::jid::{BareJid, FullJid, Jid};

/// The bound session a handler acts for: its registry entry (the JID, the session's one
/// [`crate::node::sessions::SessionState`], and the mailbox its own stanzas go to) and its remote
/// address. This, the services it uses and what it was sent are all a service handler is
/// given (see [`crate::services::Services`]).
pub struct Client {
    /// This session's registry entry.
    pub handle: SessionHandle,
    /// Remote address, for logs.
    pub peer: SocketAddr,
}

impl Client {
    /// The bound full JID.
    pub fn jid(&self) -> &FullJid {
        &self.handle.jid
    }

    /// Delivers a stanza to this session's own client (a reply to its request, or what
    /// the server tells it), through the outbox: an element, or one already serialised as
    /// the client stream carries it.
    pub fn deliver(&self, stanza: impl super::outbox::Payload) {
        super::outbox::to_handle(&self.handle, stanza);
    }
}

/// Where a `to` address points, as seen from this server.
#[derive(Debug)]
pub enum Target {
    /// No `to`: the sender's own account (RFC 6120 §10.3).
    OwnAccount,
    /// A domain this server hosts.
    LocalDomain,
    /// An account (existing or not) on a local domain.
    LocalBare(BareJid),
    /// A resource of an account on a local domain.
    LocalFull(crate::protocol::jid::FullJid),
    /// Another domain.
    Remote(Jid),
}

/// Classifies a `to` attribute. `Err` means jid-malformed (RFC 6120 §8.3.3.8).
///
/// `serves`: whether this server hosts a domain.
pub fn classify(serves: impl Fn(&str) -> bool, to: Option<&str>) -> Result<Target, StanzaError> {
    let Some(to) = to else {
        return Ok(Target::OwnAccount);
    };
    let jid = crate::protocol::jid::parse(to).map_err(|_| StanzaError::jid_malformed())?;
    if !serves(jid.domain().as_str()) {
        return Ok(Target::Remote(jid));
    }
    if jid.node().is_none() {
        return Ok(Target::LocalDomain);
    }
    match jid.try_into_full() {
        Ok(full) => Ok(Target::LocalFull(full)),
        Err(bare) => Ok(Target::LocalBare(bare)),
    }
}
