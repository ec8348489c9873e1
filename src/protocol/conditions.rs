//! RFC 6120's error vocabulary as types: the stream error conditions (§4.9.3), the SASL
//! failure conditions (§6.5), the stanza error types (§8.3.2) and the stanza error
//! conditions (§8.3.3), each with its wire name written once, in the table that declares it.
//!
//! The XML reader names the condition a malformed stream earns and `error.rs` builds the
//! elements; both take these types, so this module imports nothing.

wire_enum! {
    /// A defined stream error condition (RFC 6120 §4.9.3), the child of `<stream:error/>`.
    pub enum StreamCondition {
        /// §4.9.3.1.
        BadFormat => "bad-format",
        /// §4.9.3.2.
        BadNamespacePrefix => "bad-namespace-prefix",
        /// §4.9.3.3.
        Conflict => "conflict",
        /// §4.9.3.4.
        ConnectionTimeout => "connection-timeout",
        /// §4.9.3.5.
        HostGone => "host-gone",
        /// §4.9.3.6.
        HostUnknown => "host-unknown",
        /// §4.9.3.7.
        ImproperAddressing => "improper-addressing",
        /// §4.9.3.8.
        InternalServerError => "internal-server-error",
        /// §4.9.3.9.
        InvalidFrom => "invalid-from",
        /// §4.9.3.10.
        InvalidNamespace => "invalid-namespace",
        /// §4.9.3.11.
        InvalidXml => "invalid-xml",
        /// §4.9.3.12.
        NotAuthorized => "not-authorized",
        /// §4.9.3.13.
        NotWellFormed => "not-well-formed",
        /// §4.9.3.14.
        PolicyViolation => "policy-violation",
        /// §4.9.3.15.
        RemoteConnectionFailed => "remote-connection-failed",
        /// §4.9.3.16.
        Reset => "reset",
        /// §4.9.3.17.
        ResourceConstraint => "resource-constraint",
        /// §4.9.3.18.
        RestrictedXml => "restricted-xml",
        /// §4.9.3.19.
        SeeOtherHost => "see-other-host",
        /// §4.9.3.20.
        SystemShutdown => "system-shutdown",
        /// §4.9.3.21.
        UndefinedCondition => "undefined-condition",
        /// §4.9.3.22.
        UnsupportedEncoding => "unsupported-encoding",
        /// §4.9.3.23.
        UnsupportedFeature => "unsupported-feature",
        /// §4.9.3.24.
        UnsupportedStanzaType => "unsupported-stanza-type",
        /// §4.9.3.25.
        UnsupportedVersion => "unsupported-version",
    }
}

wire_enum! {
    /// A defined SASL failure condition (RFC 6120 §6.5), the child of `<failure/>`.
    pub enum SaslCondition {
        /// §6.5.1.
        Aborted => "aborted",
        /// §6.5.2.
        AccountDisabled => "account-disabled",
        /// §6.5.3.
        CredentialsExpired => "credentials-expired",
        /// §6.5.4.
        EncryptionRequired => "encryption-required",
        /// §6.5.5.
        IncorrectEncoding => "incorrect-encoding",
        /// §6.5.6.
        InvalidAuthzid => "invalid-authzid",
        /// §6.5.7.
        InvalidMechanism => "invalid-mechanism",
        /// §6.5.8.
        MalformedRequest => "malformed-request",
        /// §6.5.9.
        MechanismTooWeak => "mechanism-too-weak",
        /// §6.5.10.
        NotAuthorized => "not-authorized",
        /// §6.5.11.
        TemporaryAuthFailure => "temporary-auth-failure",
    }
}

wire_enum! {
    /// The `type` of a stanza error (RFC 6120 §8.3.2).
    pub enum ErrorType {
        /// Retry after providing credentials.
        Auth => "auth",
        /// Do not retry.
        Cancel => "cancel",
        /// Proceed; the condition was only a warning.
        Continue => "continue",
        /// Retry after changing the data sent.
        Modify => "modify",
        /// Retry after waiting.
        Wait => "wait",
    }
}

wire_enum! {
    /// A defined stanza error condition (RFC 6120 §8.3.3), the child of `<error/>`.
    pub enum StanzaCondition {
        /// §8.3.3.1.
        BadRequest => "bad-request",
        /// §8.3.3.2.
        Conflict => "conflict",
        /// §8.3.3.3.
        FeatureNotImplemented => "feature-not-implemented",
        /// §8.3.3.4.
        Forbidden => "forbidden",
        /// §8.3.3.5.
        Gone => "gone",
        /// §8.3.3.6.
        InternalServerError => "internal-server-error",
        /// §8.3.3.7.
        ItemNotFound => "item-not-found",
        /// §8.3.3.8.
        JidMalformed => "jid-malformed",
        /// §8.3.3.9.
        NotAcceptable => "not-acceptable",
        /// §8.3.3.10.
        NotAllowed => "not-allowed",
        /// §8.3.3.11.
        NotAuthorized => "not-authorized",
        /// §8.3.3.12.
        PolicyViolation => "policy-violation",
        /// §8.3.3.13.
        RecipientUnavailable => "recipient-unavailable",
        /// §8.3.3.14.
        Redirect => "redirect",
        /// §8.3.3.15.
        RegistrationRequired => "registration-required",
        /// §8.3.3.16.
        RemoteServerNotFound => "remote-server-not-found",
        /// §8.3.3.17.
        RemoteServerTimeout => "remote-server-timeout",
        /// §8.3.3.18.
        ResourceConstraint => "resource-constraint",
        /// §8.3.3.19.
        ServiceUnavailable => "service-unavailable",
        /// §8.3.3.20.
        SubscriptionRequired => "subscription-required",
        /// §8.3.3.21.
        UndefinedCondition => "undefined-condition",
        /// §8.3.3.22.
        UnexpectedRequest => "unexpected-request",
    }
}

impl StanzaCondition {
    /// The error type this server sends the condition with (§8.3.2): the type the
    /// condition's subsection of §8.3.3 shows it with, `cancel` for `undefined-condition`,
    /// which carries no advice of its own.
    pub(crate) fn default_type(self) -> ErrorType {
        use StanzaCondition::*;
        match self {
            BadRequest | JidMalformed | NotAcceptable | PolicyViolation | Redirect => {
                ErrorType::Modify
            }
            Forbidden | NotAuthorized | RegistrationRequired | SubscriptionRequired => {
                ErrorType::Auth
            }
            RecipientUnavailable | RemoteServerTimeout | ResourceConstraint | UnexpectedRequest => {
                ErrorType::Wait
            }
            Conflict
            | FeatureNotImplemented
            | Gone
            | InternalServerError
            | ItemNotFound
            | NotAllowed
            | RemoteServerNotFound
            | ServiceUnavailable
            | UndefinedCondition => ErrorType::Cancel,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every wire name parses back to its value, and the names are those of the RFC's
    /// subsections, in its order.
    #[test]
    fn wire_names_round_trip() {
        let stream = [
            "bad-format",
            "bad-namespace-prefix",
            "conflict",
            "connection-timeout",
            "host-gone",
            "host-unknown",
            "improper-addressing",
            "internal-server-error",
            "invalid-from",
            "invalid-namespace",
            "invalid-xml",
            "not-authorized",
            "not-well-formed",
            "policy-violation",
            "remote-connection-failed",
            "reset",
            "resource-constraint",
            "restricted-xml",
            "see-other-host",
            "system-shutdown",
            "undefined-condition",
            "unsupported-encoding",
            "unsupported-feature",
            "unsupported-stanza-type",
            "unsupported-version",
        ];
        let names: Vec<&str> = StreamCondition::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(names, stream);
        for c in StreamCondition::ALL {
            assert_eq!(StreamCondition::parse(c.as_str()), Some(*c));
            assert_eq!(c.to_string(), c.as_str());
        }

        let stanza = [
            "bad-request",
            "conflict",
            "feature-not-implemented",
            "forbidden",
            "gone",
            "internal-server-error",
            "item-not-found",
            "jid-malformed",
            "not-acceptable",
            "not-allowed",
            "not-authorized",
            "policy-violation",
            "recipient-unavailable",
            "redirect",
            "registration-required",
            "remote-server-not-found",
            "remote-server-timeout",
            "resource-constraint",
            "service-unavailable",
            "subscription-required",
            "undefined-condition",
            "unexpected-request",
        ];
        let names: Vec<&str> = StanzaCondition::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(names, stanza);
        for c in StanzaCondition::ALL {
            assert_eq!(StanzaCondition::parse(c.as_str()), Some(*c));
        }

        let sasl = [
            "aborted",
            "account-disabled",
            "credentials-expired",
            "encryption-required",
            "incorrect-encoding",
            "invalid-authzid",
            "invalid-mechanism",
            "malformed-request",
            "mechanism-too-weak",
            "not-authorized",
            "temporary-auth-failure",
        ];
        let names: Vec<&str> = SaslCondition::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(names, sasl);
        for c in SaslCondition::ALL {
            assert_eq!(SaslCondition::parse(c.as_str()), Some(*c));
        }

        for t in ErrorType::ALL {
            assert_eq!(ErrorType::parse(t.as_str()), Some(*t));
        }
    }

    #[test]
    fn names_outside_the_rfc_are_not_conditions() {
        for bad in [
            "",
            "Not-Well-Formed",
            "not-well-formed ",
            "xml-not-well-formed",
            "text",
        ] {
            assert_eq!(StreamCondition::parse(bad), None, "{bad:?}");
            assert_eq!(StanzaCondition::parse(bad), None, "{bad:?}");
            assert_eq!(SaslCondition::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn default_types_follow_the_rfc_examples() {
        use ErrorType::*;
        use StanzaCondition as C;
        for (c, t) in [
            (C::BadRequest, Modify),
            (C::Conflict, Cancel),
            (C::FeatureNotImplemented, Cancel),
            (C::Forbidden, Auth),
            (C::Gone, Cancel),
            (C::InternalServerError, Cancel),
            (C::ItemNotFound, Cancel),
            (C::JidMalformed, Modify),
            (C::NotAcceptable, Modify),
            (C::NotAllowed, Cancel),
            (C::NotAuthorized, Auth),
            (C::PolicyViolation, Modify),
            (C::RecipientUnavailable, Wait),
            (C::Redirect, Modify),
            (C::RegistrationRequired, Auth),
            (C::RemoteServerNotFound, Cancel),
            (C::RemoteServerTimeout, Wait),
            (C::ResourceConstraint, Wait),
            (C::ServiceUnavailable, Cancel),
            (C::SubscriptionRequired, Auth),
            (C::UndefinedCondition, Cancel),
            (C::UnexpectedRequest, Wait),
        ] {
            assert_eq!(c.default_type(), t, "{c}");
        }
    }
}
