//! Opening a client stream (RFC 6120 §4.7, §4.8), the features offered in each state, the
//! stream restart, STARTTLS (§5) and the stream error that ends a negotiation (§4.9.1.1).

use tokio::io::AsyncWriteExt;

use super::{empty_half, empty_io, new_reader, BoxIo, Conn, Fail};
use crate::error::StreamError;
use crate::jid::FullJid;
use crate::stream_management as sm;
use crate::xml::reader::StreamEvent;
use crate::xml::{self as x, new_id, Element};

impl Conn {
    /// Writes `err` (after our header if none was sent, RFC 6120 §4.9.1.1) and closes.
    pub(super) async fn fail(&mut self, err: StreamError) {
        tracing::info!(peer = %self.peer, user = ?self.user, error = %err, "closing stream with error");
        let mut out = String::new();
        if !self.header_sent {
            let from = self
                .domain
                .clone()
                .unwrap_or_else(|| self.shared.config.domains[0].clone());
            out.push_str(&x::stream_header(&from, None, &new_id(), x::NS_CLIENT));
        }
        out.push_str(&err.to_xml());
        out.push_str("</stream:stream>");
        let _ = self.write(&out).await;
        let _ = self.writer.shutdown().await;
    }

    /// The next top-level element of the current stream, skipping keepalives.
    pub(super) async fn next_element(&mut self) -> Result<Element, Fail> {
        loop {
            match self.next().await? {
                StreamEvent::Stanza(el) => {
                    tracing::trace!(peer = %self.peer, element = %el.name, "negotiation element");
                    return Ok(el);
                }
                StreamEvent::Whitespace => continue,
                StreamEvent::Close => {
                    let _ = self.write("</stream:stream>").await;
                    return Err(Fail::Gone);
                }
                StreamEvent::Open(_) => {
                    return Err(Fail::Stream(StreamError::new(
                        "not-well-formed",
                        "second stream header",
                    )))
                }
            }
        }
    }

    /// Reads and checks the initiating stream header, answers with ours and the features
    /// (RFC 6120 §4.7, §4.8).
    pub(super) async fn open(&mut self) -> Result<(), Fail> {
        self.header_sent = false;
        let header = match self.next().await? {
            StreamEvent::Open(h) => {
                tracing::trace!(peer = %self.peer, secure = self.secure, "stream header");
                h
            }
            _ => return Err(Fail::Gone),
        };
        if header.name != "stream" || header.ns != x::NS_STREAM {
            // RFC 6120 §4.8.1: the stream element must be qualified by the streams namespace.
            return Err(Fail::Stream(StreamError::new(
                "invalid-namespace",
                "the stream element must be in http://etherx.jabber.org/streams",
            )));
        }
        // RFC 7622 §3.2: the domain is compared after normalisation (case-folded), so
        // 'to' is prepared like any JID before it is looked up.
        let to = header.get_attr("to").map(|t| {
            crate::jid::BareJid::new(t)
                .ok()
                .filter(|j| j.node().is_none())
                .map(|j| j.domain().as_str().to_owned())
                .unwrap_or_else(|| t.to_owned())
        });
        match (&to, &self.domain) {
            (Some(to), _) if !self.shared.config.serves(to) => {
                // RFC 6120 §4.9.3.6.
                return Err(Fail::Stream(StreamError::new(
                    "host-unknown",
                    format!("this server does not serve {to}"),
                )));
            }
            (None, _) => {
                return Err(Fail::Stream(StreamError::new(
                    "host-unknown",
                    "the stream header has no 'to' address",
                )));
            }
            (Some(to), Some(prev)) if to != prev => {
                return Err(Fail::Stream(StreamError::new(
                    "host-unknown",
                    "the domain changed across a stream restart",
                )));
            }
            _ => {}
        }
        self.domain = to;
        if header.default_ns.as_deref() != Some(x::NS_CLIENT) {
            // RFC 6120 §4.8.2 / §4.9.3.10.
            return Err(Fail::Stream(StreamError::new(
                "invalid-namespace",
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
                "unsupported-version",
                "version 1.0 is required",
            )));
        }
        let domain = self.domain.clone().unwrap_or_default();
        let head = x::stream_header(&domain, header.get_attr("from"), &new_id(), x::NS_CLIENT);
        self.write(&head).await?;
        self.header_sent = true;
        let features = self.features();
        self.write(&features).await
    }

    pub(super) fn features(&self) -> String {
        let mut f = Element::new("features", x::NS_STREAM);
        if !self.secure {
            // RFC 6120 §5.3.1: TLS is mandatory-to-negotiate here, so only STARTTLS is offered.
            f = f.child(
                Element::new("starttls", x::NS_TLS).child(Element::new("required", x::NS_TLS)),
            );
        } else if self.user.is_none() {
            let mut mechs = Element::new("mechanisms", x::NS_SASL);
            for m in ["SCRAM-SHA-256", "SCRAM-SHA-1"] {
                mechs = mechs.child(Element::new("mechanism", x::NS_SASL).text(m));
            }
            if self.shared.config.auth.allow_plain {
                mechs = mechs.child(Element::new("mechanism", x::NS_SASL).text("PLAIN"));
            }
            f = f.child(mechs);
            if self.shared.config.auth.allow_registration {
                f = f.child(Element::new("register", x::NS_REGISTER_FEATURE));
            }
        } else {
            f = f
                .child(Element::new("bind", x::NS_BIND))
                .child(
                    Element::new("session", x::NS_SESSION)
                        .child(Element::new("optional", x::NS_SESSION)),
                )
                .child(Element::new("ver", x::NS_ROSTER_VER))
                .child(Element::new("sub", x::NS_PREAPPROVAL))
                // XEP-0352 §4: client state indication is offered after authentication.
                .child(Element::new("csi", crate::csi::NS_CSI))
                // XEP-0198 §2: stream management, once the client is authenticated.
                .child(Element::new("sm", sm::NS_SM));
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

    /// Runs every phase up to a bound resource.
    pub(super) async fn negotiate(&mut self) -> Result<FullJid, Fail> {
        self.open().await?;
        if !self.secure {
            self.starttls().await?;
            self.open().await?;
        }
        self.authenticate().await?;
        self.restart();
        self.open().await?;
        self.bind().await
    }

    /// A fresh parser for a restarted stream (RFC 6120 §4.3.3).
    pub(super) fn restart(&mut self) {
        let authenticated = self.user.is_some();
        let empty = new_reader(empty_half(), &self.shared, authenticated);
        let reader = std::mem::replace(&mut self.reader, empty);
        self.reader = new_reader((*reader).into_inner(), &self.shared, authenticated);
    }

    /// RFC 6120 §5.4: wait for `<starttls/>`, answer `<proceed/>`, handshake.
    pub(super) async fn starttls(&mut self) -> Result<(), Fail> {
        loop {
            let el = self.next_element().await?;
            if el.is("starttls", x::NS_TLS) {
                break;
            }
            if el.is("auth", x::NS_SASL) {
                // RFC 6120 §6.5.4: no authentication in the clear.
                let f = Element::new("failure", x::NS_SASL)
                    .child(Element::new("encryption-required", x::NS_SASL));
                self.write_el(&f).await?;
                continue;
            }
            return Err(Fail::Stream(StreamError::new(
                "policy-violation",
                "STARTTLS is required before anything else (RFC 6120 §5.3.1)",
            )));
        }
        self.write_el(&Element::new("proceed", x::NS_TLS)).await?;
        let empty = new_reader(empty_half(), &self.shared, false);
        let reader = std::mem::replace(&mut self.reader, empty);
        let writer = std::mem::replace(&mut self.writer, tokio::io::split(empty_io()).1);
        let plain = (*reader).into_inner().unsplit(writer);
        let acceptor = tokio_rustls::TlsAcceptor::from(self.shared.tls.clone());
        let tls = match acceptor.accept(plain).await {
            Ok(tls) => tls,
            Err(e) => {
                // RFC 6120 §5.4.3.2: on handshake failure the TCP connection is just closed.
                tracing::info!(peer = %self.peer, error = %e, "STARTTLS handshake failed");
                return Err(Fail::Gone);
            }
        };
        let (r, w) = tokio::io::split(Box::new(tls) as BoxIo);
        self.reader = new_reader(r, &self.shared, false);
        self.writer = w;
        self.secure = true;
        Ok(())
    }
}
