//! XEP-0077 in-band registration, answered before authentication when configured.

use super::{iq_result, Fail, Secured};
use crate::protocol::error::StanzaError;
use crate::protocol::jid::Jid;
use crate::protocol::stanza::IqType;
use crate::protocol::xml::{self as x, Element};

impl Secured {
    /// XEP-0077 in-band registration before authentication (off unless configured).
    pub(super) async fn register(&mut self, iq: &Element, query: &Element) -> Result<(), Fail> {
        let reply = if !self.link.shared.config.auth.allow_registration {
            StanzaError::service_unavailable().reply_to(iq)
        } else {
            match IqType::of(iq) {
                Some(IqType::Get) => Some(
                    iq_result(iq).child(
                        Element::new("query", x::NS_REGISTER)
                            .child(
                                Element::new("instructions", x::NS_REGISTER)
                                    .text("Choose a username and password."),
                            )
                            .child(Element::new("username", x::NS_REGISTER))
                            .child(Element::new("password", x::NS_REGISTER)),
                    ),
                ),
                Some(IqType::Set) => Some(self.register_set(iq, query).await),
                _ => StanzaError::bad_request().reply_to(iq),
            }
        };
        if let Some(r) = reply {
            self.link.write_el(&r).await?;
        }
        Ok(())
    }

    async fn register_set(&mut self, iq: &Element, query: &Element) -> Element {
        let field = |n: &str| query.get_child(n, x::NS_REGISTER).map(|e| e.text_content());
        let (Some(user), Some(pass)) = (field("username"), field("password")) else {
            return StanzaError::not_acceptable()
                .reply_to(iq)
                .unwrap_or_else(|| iq_result(iq));
        };
        let Some(jid) = self.link.account(&user).filter(|_| !pass.is_empty()) else {
            return StanzaError::not_acceptable()
                .reply_to(iq)
                .unwrap_or_else(|| iq_result(iq));
        };
        // Taken only for a well-formed request, before the store is asked whether the name is
        // free, so a refused attempt tells nothing about the name either.
        let shared = &self.link.shared;
        if !shared
            .registrations
            .take(self.link.peer.ip(), shared.liveness.clock.instant())
        {
            tracing::warn!(peer = %self.link.peer, "in-band registration budget spent; refused");
            // XEP-0077 §3.1 lets the server refuse when it is too busy: resource-constraint,
            // type wait (RFC 6120 §8.3.3.18), so the client may try again later.
            return StanzaError::resource_constraint()
                .reply_to(iq)
                .unwrap_or_else(|| iq_result(iq));
        }
        let local = crate::protocol::jid::node_str(&Jid::from(jid.clone())).to_owned();
        let iterations = self.link.shared.config.auth.scram_iterations;
        match self
            .link
            .shared
            .store
            .create_account(&local, jid.domain().as_str(), &pass, iterations)
            .await
        {
            Ok(()) => {
                tracing::info!(peer = %self.link.peer, %jid, "registered account in-band");
                iq_result(iq)
            }
            Err(crate::store::StoreError::AccountExists) => StanzaError::conflict()
                .reply_to(iq)
                .unwrap_or_else(|| iq_result(iq)),
            Err(e) => {
                tracing::error!(peer = %self.link.peer, error = %e, "registration failed");
                StanzaError::internal_server_error()
                    .reply_to(iq)
                    .unwrap_or_else(|| iq_result(iq))
            }
        }
    }
}
