//! Channel binding of a client stream: the RFC 9266 `tls-exporter` value of its TLS
//! connection, taken once when the handshake completes and kept on the [`Link`]; the
//! mechanisms the stream offers (the same list for RFC 6120 SASL and XEP-0388 SASL2); the
//! XEP-0440 feature; and the SCRAM exchange configured for both (RFC 5802 §6 gs2 rules,
//! XEP-0474 `h=`).
//!
//! When `-PLUS` is offered: only over a TLS 1.3 connection this process terminates
//! (STARTTLS or XEP-0368 direct TLS). RFC 9266 §3 forbids `tls-exporter` on TLS 1.2
//! without the extended master secret, and TLS 1.2 is not worth a second rule here.
//!
//! WebSocket (RFC 7395) streams never offer `-PLUS`: their TLS is often terminated by a
//! reverse proxy in front of the HTTP listener, whose TLS session the server cannot see,
//! so any binding a client computed would fail to match; and browsers, the clients of
//! that transport, cannot read a TLS exporter at all. A WebSocket stream therefore
//! advertises neither `-PLUS` nor XEP-0440, and a client's `y` there is accepted.

use super::Link;
use crate::protocol::sasl::channel_binding::{Binding, TLS_EXPORTER};
use crate::protocol::sasl::scram::{ScramHash, ScramServer};
use crate::protocol::xml::Element;

/// XEP-0440 namespace of `<sasl-channel-binding/>`.
pub(super) const NS_SASL_CB: &str = "urn:xmpp:sasl-cb:0";

/// RFC 9266 §2: the exporter label; the context is empty and the output 32 bytes.
const EXPORTER_LABEL: &[u8] = b"EXPORTER-Channel-Binding";

/// The `tls-exporter` channel binding of one TLS 1.3 connection (RFC 9266).
pub(super) struct TlsExporter([u8; 32]);

impl std::fmt::Debug for TlsExporter {
    // Keying material of the connection: never logged.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsExporter(..)")
    }
}

impl TlsExporter {
    /// The binding of a finished server handshake; `None` below TLS 1.3 (see the module
    /// doc) or if the exporter fails.
    pub(super) fn of(conn: &rustls::ServerConnection) -> Option<TlsExporter> {
        if conn.protocol_version() != Some(rustls::ProtocolVersion::TLSv1_3) {
            return None;
        }
        conn.export_keying_material([0u8; 32], EXPORTER_LABEL, Some(&[]))
            .ok()
            .map(TlsExporter)
    }
}

impl Link {
    /// The SASL mechanisms this stream offers, strongest first: `-PLUS` with channel
    /// binding, then SCRAM, then PLAIN when allowed. SASL1 and SASL2 offer the same list,
    /// and XEP-0474's hash is taken over it.
    pub(super) fn mechanisms(&self) -> Vec<&'static str> {
        let mut names = Vec::with_capacity(5);
        if self.channel_binding.is_some() {
            names.extend(ScramHash::ALL.iter().map(|h| h.plus_mechanism()));
        }
        names.extend(ScramHash::ALL.iter().map(|h| h.mechanism()));
        if self.shared.config.auth.allow_plain {
            names.push("PLAIN");
        }
        names
    }

    /// The channel-binding types XEP-0440 advertises on this stream, if any.
    fn channel_binding_types(&self) -> Option<&'static [&'static str]> {
        self.channel_binding.as_ref().map(|_| &[TLS_EXPORTER][..])
    }

    /// XEP-0440 `<sasl-channel-binding/>` for the stream features, when `-PLUS` is offered.
    pub(super) fn channel_binding_feature(&self) -> Option<Element> {
        let types = self.channel_binding_types()?;
        let mut f = Element::new("sasl-channel-binding", NS_SASL_CB);
        for t in types {
            f = f.child(Element::new("channel-binding", NS_SASL_CB).attr("type", *t));
        }
        Some(f)
    }

    /// The SCRAM exchange for `mechanism`, or `None` when it is no SCRAM mechanism this
    /// stream offers (a `-PLUS` one without channel binding here). Unknown users get a salt
    /// and iteration count as an account would (RFC 5802 §9 leaves this to the server).
    pub(super) fn scram_server(&self, mechanism: &str) -> Option<ScramServer> {
        let (hash, plus) = ScramHash::from_any_mechanism(mechanism)?;
        let binding = match (&self.channel_binding, plus) {
            (Some(exporter), true) => Binding::Required {
                cb_type: TLS_EXPORTER,
                data: exporter.0.to_vec(),
            },
            (None, true) => return None,
            (Some(_), false) => Binding::Offered,
            (None, false) => Binding::NotOffered,
        };
        let server = ScramServer::new(hash)
            .with_unknown_user_iterations(self.shared.config.auth.scram_iterations)
            .with_fake_salt_secret(&self.shared.fake_salt_secret)
            .with_channel_binding(binding)
            .with_downgrade_protection(&self.mechanisms(), self.channel_binding_types());
        Some(server)
    }
}
