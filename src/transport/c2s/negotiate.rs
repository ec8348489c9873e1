//! Opening a client stream (RFC 6120 §4.7, §4.8), the features each state offers, STARTTLS
//! (§5), and how a negotiation ends: the stream error after our header (§4.9.1.1).

use super::{limits, BoxIo, Connected, Fail, Halt, Link, Secured};
use crate::node::stream_management as sm;
use crate::protocol::error::{StreamCondition, StreamError};
use crate::protocol::xml::reader::StreamEvent;
use crate::protocol::xml::{self as x, new_id, Element};
use crate::transport::stream::XmlStream;

/// What a stream's features offer: one step of negotiation at a time (RFC 6120 §4.3.2).
#[derive(Debug, Clone, Copy)]
pub(super) enum Offer {
    /// STARTTLS, required.
    Tls,
    /// The SASL mechanisms (RFC 6120 and XEP-0388 SASL2), and XEP-0077 registration if
    /// configured.
    Sasl,
    /// Resource binding and what a bound session may enable.
    Bind,
}

impl Link {
    /// Reads and checks the initiating stream header, answers with ours and the features
    /// (RFC 6120 §4.7, §4.8).
    pub(super) async fn open(&mut self, offer: Offer) -> Result<(), Fail> {
        self.header_sent = false;
        let header = match self.stream.next().await? {
            StreamEvent::Open(h) => {
                tracing::trace!(peer = %self.peer, ?offer, "stream header");
                h
            }
            _ => return Err(Fail::Gone),
        };
        if header.name != "stream" || header.ns != x::NS_STREAM {
            // RFC 6120 §4.8.1: the stream element must be qualified by the streams namespace.
            return Err(Fail::Stream(StreamError::new(
                StreamCondition::InvalidNamespace,
                "the stream element must be in http://etherx.jabber.org/streams",
            )));
        }
        // RFC 7622 §3.2: the domain is compared after normalisation (case-folded), so
        // 'to' is prepared like any JID before it is looked up.
        let to = header.get_attr("to").map(|t| {
            crate::protocol::jid::parse_bare(t)
                .ok()
                .filter(|j| j.node().is_none())
                .map(|j| j.domain().as_str().to_owned())
                .unwrap_or_else(|| t.to_owned())
        });
        match (&to, &self.domain) {
            (Some(to), _) if !self.shared.config.serves(to) => {
                // RFC 6120 §4.9.3.6.
                return Err(Fail::Stream(StreamError::new(
                    StreamCondition::HostUnknown,
                    format!("this server does not serve {to}"),
                )));
            }
            (None, _) => {
                return Err(Fail::Stream(StreamError::new(
                    StreamCondition::HostUnknown,
                    "the stream header has no 'to' address",
                )));
            }
            (Some(to), Some(prev)) if to != prev => {
                return Err(Fail::Stream(StreamError::new(
                    StreamCondition::HostUnknown,
                    "the domain changed across a stream restart",
                )));
            }
            _ => {}
        }
        self.domain = to;
        if header.default_ns.as_deref() != Some(x::NS_CLIENT) {
            // RFC 6120 §4.8.2 / §4.9.3.10.
            return Err(Fail::Stream(StreamError::new(
                StreamCondition::InvalidNamespace,
                "the content namespace of a client stream must be jabber:client",
            )));
        }
        let version = header.get_attr("version").unwrap_or("0.9");
        let major = version
            .split('.')
            .next()
            .and_then(|m| m.parse::<u32>().ok());
        if major != Some(1) {
            // RFC 6120 §4.7.5 / §4.9.3.25: we speak 1.x only.
            return Err(Fail::Stream(StreamError::new(
                StreamCondition::UnsupportedVersion,
                "version 1.0 is required",
            )));
        }
        let domain = self.domain.clone().unwrap_or_default();
        let head = x::stream_header(&domain, header.get_attr("from"), &new_id(), x::NS_CLIENT);
        self.write(&head).await?;
        self.header_sent = true;
        let features = self.features(offer);
        self.write(&features).await
    }

    fn features(&self, offer: Offer) -> String {
        let mut f = Element::new("features", x::NS_STREAM);
        match offer {
            Offer::Tls => {
                // RFC 6120 §5.3.1: TLS is mandatory-to-negotiate here, so only STARTTLS is offered.
                f = f.child(
                    Element::new("starttls", x::NS_TLS).child(Element::new("required", x::NS_TLS)),
                );
            }
            Offer::Sasl => {
                let names = self.mechanisms();
                let mut mechs = Element::new("mechanisms", x::NS_SASL);
                for m in &names {
                    mechs = mechs.child(Element::new("mechanism", x::NS_SASL).text(*m));
                }
                // XEP-0388 "Discovering Support": SASL2 beside SASL1, the same mechanisms;
                // XEP-0484 FAST inside it.
                let fast: &[&str] = if self.shared.config.auth.fast {
                    &crate::protocol::sasl::ht::MECHANISMS
                } else {
                    &[]
                };
                f = f.child(mechs).child(super::sasl2::feature(&names, fast));
                // XEP-0440: the channel-binding types, when -PLUS is offered.
                if let Some(cb) = self.channel_binding_feature() {
                    f = f.child(cb);
                }
                if self.shared.config.auth.allow_registration {
                    f = f.child(Element::new("register", x::NS_REGISTER_FEATURE));
                }
            }
            Offer::Bind => {
                f = f
                    .child(Element::new("bind", x::NS_BIND))
                    .child(
                        Element::new("session", x::NS_SESSION)
                            .child(Element::new("optional", x::NS_SESSION)),
                    )
                    .child(Element::new("ver", x::NS_ROSTER_VER))
                    .child(Element::new("sub", x::NS_PREAPPROVAL))
                    // XEP-0352 §4: client state indication is offered after authentication.
                    .child(Element::new("csi", crate::services::csi::NS_CSI))
                    // XEP-0198 §2: stream management, once the client is authenticated.
                    .child(Element::new("sm", sm::NS_SM));
            }
        }
        let mut out = String::new();
        // Written with the stream prefix, which is what every client expects.
        out.push_str("<stream:features>");
        for child in f.elements() {
            child.write_to(&mut out, x::NS_CLIENT, x::NS_CLIENT);
        }
        out.push_str("</stream:features>");
        out
    }

    /// Ends the stream as `fail` says: a stream error after our header if none was sent
    /// (RFC 6120 §4.9.1.1), our closing tag for the client's (§4.4), nothing for a transport
    /// that is gone.
    pub(super) async fn end(mut self: Box<Self>, fail: Fail) {
        match fail {
            Fail::Stream(err) => {
                tracing::info!(peer = %self.peer, error = %err, "closing stream with error");
                if !self.header_sent {
                    let from = self
                        .domain
                        .clone()
                        .unwrap_or_else(|| self.shared.config.domains[0].clone());
                    let header = x::stream_header(&from, None, &new_id(), x::NS_CLIENT);
                    let _ = self.write(&header).await;
                }
                self.stream.fail(&err).await;
            }
            Fail::Closed => self.stream.close().await,
            Fail::Gone => {}
        }
    }
}

impl Connected {
    /// RFC 6120 §5: the features offer STARTTLS only; after `<proceed/>` the TLS handshake
    /// takes the transport, and the stream starts afresh over what it returns (§5.4.3.3).
    pub(super) async fn starttls(mut self) -> Result<Secured, Halt> {
        step!(self.link, self.link.open(Offer::Tls));
        step!(self.link, self.await_starttls());
        let Connected { mut link } = self;
        let plain = link.stream.into_io();
        let acceptor = tokio_rustls::TlsAcceptor::from(link.shared.tls.clone());
        let tls = match tokio::time::timeout_at(link.deadline, acceptor.accept(plain)).await {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                // RFC 6120 §5.4.3.2: on handshake failure the TCP connection is just closed.
                tracing::info!(peer = %link.peer, error = %e, "STARTTLS handshake failed");
                return Err(Halt::Gone);
            }
            Err(_) => {
                tracing::info!(peer = %link.peer, "STARTTLS handshake timed out");
                return Err(Halt::Gone);
            }
        };
        link.channel_binding = super::binding::TlsExporter::of(tls.get_ref().1);
        let io = Box::new(tls) as BoxIo;
        link.stream = XmlStream::new(io, limits(&link.shared, false), x::NS_CLIENT);
        Ok(Secured { link })
    }

    /// RFC 6120 §5.4.2: waits for `<starttls/>` and answers `<proceed/>`.
    async fn await_starttls(&mut self) -> Result<(), Fail> {
        loop {
            let el = self.link.next_element().await?;
            if el.is("starttls", x::NS_TLS) {
                break;
            }
            if el.is("auth", x::NS_SASL) {
                // RFC 6120 §6.5.4: no authentication in the clear.
                let f = Element::new("failure", x::NS_SASL)
                    .child(Element::new("encryption-required", x::NS_SASL));
                self.link.write_el(&f).await?;
                continue;
            }
            return Err(Fail::Stream(StreamError::new(
                StreamCondition::PolicyViolation,
                "STARTTLS is required before anything else (RFC 6120 §5.3.1)",
            )));
        }
        self.link
            .write_el(&Element::new("proceed", x::NS_TLS))
            .await
    }
}
