//! The two kinds of XMPP error: stream errors, which end the stream (RFC 6120 §4.9), and stanza
//! errors, which answer one stanza (RFC 6120 §8.3).

pub use crate::protocol::conditions::{ErrorType, StanzaCondition, StreamCondition};
use crate::protocol::xml::reader::XmlError;
use crate::protocol::xml::{Element, NS_STANZAS, NS_STREAM_ERRORS};

/// A stream-level error (RFC 6120 §4.9.3). Sending one is always followed by closing the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamError {
    /// One of the defined conditions of RFC 6120 §4.9.3.
    pub condition: StreamCondition,
    /// Human-readable detail for the peer's logs.
    pub text: Option<String>,
}

impl StreamError {
    /// An error with a condition and an explanatory text.
    pub fn new(condition: StreamCondition, text: impl Into<String>) -> Self {
        StreamError {
            condition,
            text: Some(text.into()),
        }
    }

    /// The stream error to close a stream with after `e`, carrying its description; `None`
    /// when the transport is gone and nothing can be written. The reader only names the
    /// condition ([`XmlError::condition`]), so the model's XML layer needs no error type.
    pub fn of_xml(e: &XmlError) -> Option<Self> {
        e.condition()
            .map(|cond| StreamError::new(cond, e.to_string()))
    }

    /// `<stream:error>` as it goes on the wire.
    pub fn to_xml(&self) -> String {
        let mut out = String::from("<stream:error><");
        out.push_str(self.condition.as_str());
        out.push_str(" xmlns='");
        out.push_str(NS_STREAM_ERRORS);
        out.push_str("'/>");
        if let Some(t) = &self.text {
            out.push_str("<text xmlns='");
            out.push_str(NS_STREAM_ERRORS);
            out.push_str("' xml:lang='en'>");
            crate::protocol::xml::escape_into(&mut out, t);
            out.push_str("</text>");
        }
        out.push_str("</stream:error>");
        out
    }
}

impl std::fmt::Display for StreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.text {
            Some(t) => write!(f, "{}: {}", self.condition, t),
            None => write!(f, "{}", self.condition),
        }
    }
}

/// A stanza-level error (RFC 6120 §8.3.3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StanzaError {
    /// The error type.
    pub kind: ErrorType,
    /// One of the defined conditions of RFC 6120 §8.3.3.
    pub condition: StanzaCondition,
    /// Optional detail.
    pub text: Option<String>,
}

/// A constructor per condition the server sends, named after it, with the condition's
/// [`StanzaCondition::default_type`].
macro_rules! conditions {
    ($($(#[$doc:meta])* $fn:ident => $cond:ident;)*) => {
        impl StanzaError {
            $(
                $(#[$doc])*
                pub fn $fn() -> Self {
                    StanzaError::new(StanzaCondition::$cond)
                }
            )*
        }
    };
}

conditions! {
    /// RFC 6120 §8.3.3.1.
    bad_request => BadRequest;
    /// RFC 6120 §8.3.3.2.
    conflict => Conflict;
    /// RFC 6120 §8.3.3.3.
    feature_not_implemented => FeatureNotImplemented;
    /// RFC 6120 §8.3.3.4.
    forbidden => Forbidden;
    /// RFC 6120 §8.3.3.6.
    internal_server_error => InternalServerError;
    /// RFC 6120 §8.3.3.7.
    item_not_found => ItemNotFound;
    /// RFC 6120 §8.3.3.8.
    jid_malformed => JidMalformed;
    /// RFC 6120 §8.3.3.9.
    not_acceptable => NotAcceptable;
    /// RFC 6120 §8.3.3.10.
    not_allowed => NotAllowed;
    /// RFC 6120 §8.3.3.11.
    not_authorized => NotAuthorized;
    /// RFC 6120 §8.3.3.12.
    policy_violation => PolicyViolation;
    /// RFC 6120 §8.3.3.13.
    recipient_unavailable => RecipientUnavailable;
    /// RFC 6120 §8.3.3.16.
    remote_server_not_found => RemoteServerNotFound;
    /// RFC 6120 §8.3.3.17.
    remote_server_timeout => RemoteServerTimeout;
    /// RFC 6120 §8.3.3.18.
    resource_constraint => ResourceConstraint;
    /// RFC 6120 §8.3.3.19.
    service_unavailable => ServiceUnavailable;
    /// RFC 6120 §8.3.3.21.
    undefined_condition => UndefinedCondition;
    /// RFC 6120 §8.3.3.22.
    unexpected_request => UnexpectedRequest;
}

impl StanzaError {
    /// An error of `condition` with the type the server sends it with.
    pub fn new(condition: StanzaCondition) -> Self {
        StanzaError {
            kind: condition.default_type(),
            condition,
            text: None,
        }
    }

    /// Adds a human-readable text.
    pub fn with_text(mut self, text: impl Into<String>) -> Self {
        self.text = Some(text.into());
        self
    }

    /// The `<error/>` child.
    pub fn to_element(&self) -> Element {
        let mut e = Element::new("error", crate::protocol::xml::NS_CLIENT)
            .attr("type", self.kind.as_str())
            .child(Element::new(self.condition.as_str(), NS_STANZAS));
        if let Some(t) = &self.text {
            e = e.child(
                Element::new("text", NS_STANZAS)
                    .attr("xml:lang", "en")
                    .text(t.clone()),
            );
        }
        e
    }

    /// The error reply to `stanza` (RFC 6120 §8.3.1): same name and id, `to` and `from`
    /// swapped, type `error`. `None` for a stanza that is itself an error: an error is never
    /// answered with an error (RFC 6120 §8.3.1 item 3), which is what stops error loops.
    pub fn reply_to(&self, stanza: &Element) -> Option<Element> {
        if stanza.get_attr("type") == Some("error") {
            return None;
        }
        let mut reply = reply_skeleton(stanza, "error");
        // §8.3.1 lets the original payload be included; iq payloads help clients correlate.
        if stanza.name == "iq" {
            reply.children = stanza.children.clone();
        }
        reply
            .children
            .push(crate::protocol::xml::Node::Element(self.to_element()));
        Some(reply)
    }
}

/// An iq result addressed back to the requester (RFC 6120 §8.2.3).
pub fn iq_result(iq: &Element) -> Element {
    reply_skeleton(iq, "result")
}

/// An empty reply to `stanza` of type `ty`: same name and id, `to` and `from` swapped
/// (RFC 6120 §8.2.3 for iq results, §8.3.1 for errors).
pub(crate) fn reply_skeleton(stanza: &Element, ty: &str) -> Element {
    let mut reply = Element::new(&stanza.name, &stanza.ns).attr("type", ty);
    if let Some(id) = stanza.get_attr("id") {
        reply.set_attr("id", id);
    }
    if let Some(from) = stanza.get_attr("from") {
        reply.set_attr("to", from);
    }
    if let Some(to) = stanza.get_attr("to") {
        reply.set_attr("from", to);
    }
    reply
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::xml::NS_CLIENT;

    #[test]
    fn error_reply_swaps_addresses_and_keeps_id() {
        let iq = Element::new("iq", NS_CLIENT)
            .attr("type", "get")
            .attr("id", "7")
            .attr("from", "a@x/r")
            .attr("to", "b@x");
        let r = StanzaError::service_unavailable().reply_to(&iq).unwrap();
        assert_eq!(r.get_attr("to"), Some("a@x/r"));
        assert_eq!(r.get_attr("from"), Some("b@x"));
        assert_eq!(r.get_attr("id"), Some("7"));
        let err = r.get_child("error", NS_CLIENT).unwrap();
        assert_eq!(err.get_attr("type"), Some("cancel"));
        assert!(err.get_child("service-unavailable", NS_STANZAS).is_some());
    }

    #[test]
    fn errors_are_never_answered_with_errors() {
        let e = Element::new("message", NS_CLIENT).attr("type", "error");
        assert!(StanzaError::bad_request().reply_to(&e).is_none());
    }

    #[test]
    fn stream_error_xml_escapes_text() {
        let e = StreamError::new(StreamCondition::PolicyViolation, "a<b");
        assert_eq!(
            e.to_xml(),
            "<stream:error><policy-violation xmlns='urn:ietf:params:xml:ns:xmpp-streams'/>\
             <text xmlns='urn:ietf:params:xml:ns:xmpp-streams' xml:lang='en'>a&lt;b</text></stream:error>"
        );
    }
}
