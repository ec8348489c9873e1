//! The `type` attribute of the three stanzas as values: read once where a stanza is
//! dispatched, so that decisions match on a variant instead of comparing strings.

use crate::protocol::xml::Element;

/// The type of a presence stanza (RFC 6120 §8.2.3 leaves it to RFC 6121 §4.7.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PresenceType {
    /// No `type` attribute: the sender is available (RFC 6121 §4.7.1).
    Available,
    /// The sender is no longer available.
    Unavailable,
    /// A subscription request (RFC 6121 §3.1).
    Subscribe,
    /// A subscription approval (RFC 6121 §3.1.5).
    Subscribed,
    /// An unsubscription (RFC 6121 §3.3).
    Unsubscribe,
    /// A subscription cancellation or denial (RFC 6121 §3.2).
    Unsubscribed,
    /// A request for the contact's current presence (RFC 6121 §4.3).
    Probe,
    /// An error about a presence stanza sent earlier (RFC 6120 §8.3).
    Error,
}

impl PresenceType {
    /// Every value, `Available` first.
    pub const ALL: [PresenceType; 8] = [
        PresenceType::Available,
        PresenceType::Unavailable,
        PresenceType::Subscribe,
        PresenceType::Subscribed,
        PresenceType::Unsubscribe,
        PresenceType::Unsubscribed,
        PresenceType::Probe,
        PresenceType::Error,
    ];

    /// The type's name: its `type` attribute, or `available` for the presence that has none.
    pub fn name(self) -> &'static str {
        match self {
            PresenceType::Available => "available",
            PresenceType::Unavailable => "unavailable",
            PresenceType::Subscribe => "subscribe",
            PresenceType::Subscribed => "subscribed",
            PresenceType::Unsubscribe => "unsubscribe",
            PresenceType::Unsubscribed => "unsubscribed",
            PresenceType::Probe => "probe",
            PresenceType::Error => "error",
        }
    }

    /// The `type` attribute this value is written with; `None` for `Available`, which has
    /// none.
    pub fn as_attr(self) -> Option<&'static str> {
        (self != PresenceType::Available).then(|| self.name())
    }

    /// The value of a `type` attribute (`None`: absent). An unknown value is `None`: RFC
    /// 6121 defines no meaning for it, and each caller says what it does with one.
    pub fn parse(attr: Option<&str>) -> Option<Self> {
        PresenceType::ALL.into_iter().find(|t| t.as_attr() == attr)
    }

    /// The type of a presence stanza (see [`PresenceType::parse`]).
    pub fn of(el: &Element) -> Option<Self> {
        PresenceType::parse(el.get_attr("type"))
    }

    /// Available or unavailable: presence proper, what RFC 6121 §4 broadcasts, rather than
    /// a subscription, a probe or an error.
    pub fn is_availability(self) -> bool {
        matches!(self, PresenceType::Available | PresenceType::Unavailable)
    }
}

wire_enum! {
    /// The type of a message stanza (RFC 6121 §5.2.2).
    pub(crate) enum MessageType {
        /// One-to-one conversation.
        Chat => "chat",
        /// An error about a message sent earlier.
        Error => "error",
        /// Multi-user chat.
        Groupchat => "groupchat",
        /// An alert or notice that expects no reply.
        Headline => "headline",
        /// A standalone message; also what no or an unknown `type` means.
        Normal => "normal",
    }
}

impl MessageType {
    /// The value of a `type` attribute: RFC 6121 §5.2.2, a message with no type or one the
    /// application does not understand is `normal`.
    pub(crate) fn of_attr(attr: Option<&str>) -> Self {
        attr.and_then(MessageType::parse)
            .unwrap_or(MessageType::Normal)
    }

    /// The type of a message stanza (see [`MessageType::of_attr`]).
    pub(crate) fn of(el: &Element) -> Self {
        MessageType::of_attr(el.get_attr("type"))
    }

    /// Chat or normal: the messages RFC 6121 §8.5.2 delivers to a bare JID's resources and
    /// keeps for an offline user.
    pub(crate) fn is_chat_or_normal(self) -> bool {
        matches!(self, MessageType::Chat | MessageType::Normal)
    }
}

wire_enum! {
    /// The type of an iq stanza (RFC 6120 §8.2.3).
    pub enum IqType {
        /// A request for information.
        Get => "get",
        /// A request that provides data or changes state.
        Set => "set",
        /// A successful answer.
        Result => "result",
        /// An error answer.
        Error => "error",
    }
}

impl IqType {
    /// The type of an iq stanza; `None` when it has none or one RFC 6120 §8.2.3 does not
    /// define (the stanza is then a bad request).
    pub(crate) fn of(el: &Element) -> Option<Self> {
        el.get_attr("type").and_then(IqType::parse)
    }

    /// A request (`get` or `set`), which must be answered (RFC 6120 §8.2.3 item 2); a
    /// `result` or `error` is an answer, which must not be.
    pub(crate) fn is_request(self) -> bool {
        matches!(self, IqType::Get | IqType::Set)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presence_types_round_trip_and_unknown_values_are_none() {
        for (attr, want) in [
            (None, Some(PresenceType::Available)),
            (Some("unavailable"), Some(PresenceType::Unavailable)),
            (Some("subscribe"), Some(PresenceType::Subscribe)),
            (Some("subscribed"), Some(PresenceType::Subscribed)),
            (Some("unsubscribe"), Some(PresenceType::Unsubscribe)),
            (Some("unsubscribed"), Some(PresenceType::Unsubscribed)),
            (Some("probe"), Some(PresenceType::Probe)),
            (Some("error"), Some(PresenceType::Error)),
            // "available" is the absence of the attribute, not a value of it.
            (Some("available"), None),
            (Some(""), None),
            (Some("Unavailable"), None),
            (Some("invisible"), None),
        ] {
            assert_eq!(PresenceType::parse(attr), want, "{attr:?}");
        }
        for t in PresenceType::ALL {
            assert_eq!(PresenceType::parse(t.as_attr()), Some(t));
            assert_eq!(t.as_attr().unwrap_or("available"), t.name());
        }
        let availability: Vec<_> = PresenceType::ALL
            .into_iter()
            .filter(|t| t.is_availability())
            .collect();
        assert_eq!(
            availability,
            [PresenceType::Available, PresenceType::Unavailable]
        );
    }

    #[test]
    fn message_types_round_trip_and_the_rest_is_normal() {
        for (attr, want) in [
            (Some("chat"), MessageType::Chat),
            (Some("error"), MessageType::Error),
            (Some("groupchat"), MessageType::Groupchat),
            (Some("headline"), MessageType::Headline),
            (Some("normal"), MessageType::Normal),
            // RFC 6121 §5.2.2: absent or not understood means normal.
            (None, MessageType::Normal),
            (Some(""), MessageType::Normal),
            (Some("Chat"), MessageType::Normal),
            (Some("sms"), MessageType::Normal),
        ] {
            assert_eq!(MessageType::of_attr(attr), want, "{attr:?}");
        }
        for t in MessageType::ALL {
            assert_eq!(MessageType::of_attr(Some(t.as_str())), *t);
        }
    }

    #[test]
    fn iq_types_round_trip_and_unknown_values_are_none() {
        let iq = |ty: Option<&str>| {
            let e = Element::new("iq", crate::protocol::xml::NS_CLIENT);
            match ty {
                Some(t) => e.attr("type", t),
                None => e,
            }
        };
        for (attr, want) in [
            (Some("get"), Some(IqType::Get)),
            (Some("set"), Some(IqType::Set)),
            (Some("result"), Some(IqType::Result)),
            (Some("error"), Some(IqType::Error)),
            (None, None),
            (Some(""), None),
            (Some("GET"), None),
            (Some("query"), None),
        ] {
            assert_eq!(IqType::of(&iq(attr)), want, "{attr:?}");
        }
        for t in IqType::ALL {
            assert_eq!(IqType::parse(t.as_str()), Some(*t));
        }
        let requests: Vec<_> = IqType::ALL.iter().filter(|t| t.is_request()).collect();
        assert_eq!(requests, [&IqType::Get, &IqType::Set]);
    }
}
