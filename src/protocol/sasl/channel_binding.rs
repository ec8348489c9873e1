//! SCRAM channel binding (RFC 5802 §6 and §7's gs2 header), and the mechanism and
//! channel-binding lists XEP-0474 protects against downgrades. No I/O: the transport hands
//! in the bytes of its TLS exporter (RFC 9266) and the lists it advertised.
//!
//! The gs2 channel-binding flag says what the client did and what it believes:
//! - `p=TYPE`: it binds to the channel with TYPE; only with a `-PLUS` mechanism.
//! - `n`: it does not support channel binding.
//! - `y`: it supports channel binding but thinks the server does not. If the server did
//!   offer a `-PLUS` mechanism, someone removed it on the way: the server must fail the
//!   exchange (RFC 5802 §6, "downgrade").
//!
//! client-final's `c=` must then be base64(gs2 header + cb-data), cb-data being empty
//! unless the flag is `p=` (RFC 5802 §7 `cbind-input`).

/// The channel-binding type this server offers: RFC 9266, the TLS 1.3 exporter.
pub const TLS_EXPORTER: &str = "tls-exporter";

/// The gs2 channel-binding flag of client-first (RFC 5802 §7 `gs2-cbind-flag`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Gs2Flag {
    /// `n`: the client does not support channel binding.
    NotSupported,
    /// `y`: the client supports it, but thinks the server does not.
    ServerLacksIt,
    /// `p=TYPE`: the client binds with this type.
    Binds(String),
}

/// client-first's gs2 header, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gs2Header {
    pub flag: Gs2Flag,
    /// `a=`, still in its `=2C`/`=3D` encoding; None when the client sent none.
    pub authzid: Option<String>,
    /// The header exactly as sent, both commas included: what `c=` must repeat.
    pub raw: String,
}

/// Why a gs2 header was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gs2Error {
    /// Not of the RFC 5802 §7 grammar.
    Malformed(&'static str),
    /// `p=` on a connection or mechanism without channel binding.
    NotSupported,
    /// `p=` with a type other than the one offered (RFC 5802 `e=unsupported-channel-binding-type`).
    UnsupportedType,
    /// A `-PLUS` mechanism with `n` or `y`: the mechanism is channel binding.
    BindingRequired,
    /// `y` although a `-PLUS` mechanism was offered (RFC 5802 `e=server-does-support-channel-binding`).
    Downgrade,
}

/// Splits client-first into its gs2 header and client-first-message-bare.
pub fn split_client_first(msg: &str) -> Result<(Gs2Header, &str), Gs2Error> {
    let mut parts = msg.splitn(3, ',');
    let flag = parts.next().unwrap_or_default();
    let authz = parts
        .next()
        .ok_or(Gs2Error::Malformed("missing gs2 header"))?;
    let bare = parts
        .next()
        .ok_or(Gs2Error::Malformed("missing gs2 header"))?;
    let flag = match flag {
        "n" => Gs2Flag::NotSupported,
        "y" => Gs2Flag::ServerLacksIt,
        f => match f.strip_prefix("p=") {
            // RFC 5802 §7: cb-name = 1*(ALPHA / DIGIT / "." / "-").
            Some(name)
                if !name.is_empty()
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-') =>
            {
                Gs2Flag::Binds(name.to_owned())
            }
            _ => return Err(Gs2Error::Malformed("bad gs2 channel binding flag")),
        },
    };
    let authzid = if authz.is_empty() {
        None
    } else {
        let name = authz
            .strip_prefix("a=")
            .ok_or(Gs2Error::Malformed("bad gs2 authzid"))?;
        Some(name.to_owned())
    };
    let raw = msg[..msg.len() - bare.len()].to_owned();
    Ok((Gs2Header { flag, authzid, raw }, bare))
}

/// What the server offers on this connection for the mechanism the client chose.
#[derive(Clone, PartialEq, Eq)]
pub enum Binding {
    /// No `-PLUS` mechanism was offered on this connection.
    NotOffered,
    /// A `-PLUS` mechanism was offered, and the client chose one without binding.
    Offered,
    /// The client chose a `-PLUS` mechanism: it must bind to this channel.
    Required {
        /// The type offered, [`TLS_EXPORTER`].
        cb_type: &'static str,
        /// The channel's binding data (for `tls-exporter`, the 32 exporter bytes).
        data: Vec<u8>,
    },
}

impl std::fmt::Debug for Binding {
    // The exporter bytes are keying material: never logged.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Binding::NotOffered => f.write_str("NotOffered"),
            Binding::Offered => f.write_str("Offered"),
            Binding::Required { cb_type, .. } => write!(f, "Required({cb_type})"),
        }
    }
}

impl Binding {
    /// Whether `flag` is acceptable (RFC 5802 §6), for this connection and mechanism.
    pub fn check(&self, flag: &Gs2Flag) -> Result<(), Gs2Error> {
        match (self, flag) {
            (Binding::Required { cb_type, .. }, Gs2Flag::Binds(name)) if name == cb_type => Ok(()),
            (Binding::Required { .. }, Gs2Flag::Binds(_)) => Err(Gs2Error::UnsupportedType),
            (Binding::Required { .. }, _) => Err(Gs2Error::BindingRequired),
            (_, Gs2Flag::Binds(_)) => Err(Gs2Error::NotSupported),
            (Binding::Offered, Gs2Flag::ServerLacksIt) => Err(Gs2Error::Downgrade),
            (_, Gs2Flag::NotSupported | Gs2Flag::ServerLacksIt) => Ok(()),
        }
    }

    /// The bytes client-final's `c=` must decode to (RFC 5802 §7 `cbind-input`): the gs2
    /// header, then the binding data when the client binds.
    pub fn cbind_input(&self, gs2_header: &str) -> Vec<u8> {
        let mut input = gs2_header.as_bytes().to_vec();
        if let Binding::Required { data, .. } = self {
            input.extend_from_slice(data);
        }
        input
    }
}

/// The string XEP-0474 (version 0.5.0, "Server Sends Downgrade Protection Hash") hashes:
/// the advertised mechanisms sorted by octet (RFC 4790 `i;octet`) and joined with 0x1E;
/// then, when XEP-0440 advertised channel-binding types, 0x1F and those types sorted and
/// joined the same way. The SCRAM mechanism in use hashes it for the `h=` attribute.
pub fn downgrade_protection_input(
    mechanisms: &[&str],
    channel_bindings: Option<&[&str]>,
) -> Vec<u8> {
    fn join_sorted(out: &mut Vec<u8>, items: &[&str]) {
        let mut sorted: Vec<&[u8]> = items.iter().map(|s| s.as_bytes()).collect();
        sorted.sort_unstable();
        for (i, item) in sorted.iter().enumerate() {
            if i > 0 {
                out.push(0x1E);
            }
            out.extend_from_slice(item);
        }
    }
    let mut out = Vec::new();
    join_sorted(&mut out, mechanisms);
    if let Some(types) = channel_bindings {
        out.push(0x1F);
        join_sorted(&mut out, types);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flag(msg: &str) -> Result<Gs2Flag, Gs2Error> {
        split_client_first(msg).map(|(h, _)| h.flag)
    }

    #[test]
    fn gs2_headers_parse_into_flag_authzid_and_the_raw_header() {
        let (h, bare) = split_client_first("p=tls-exporter,a=juliet,n=romeo,r=abc").unwrap();
        assert_eq!(h.flag, Gs2Flag::Binds("tls-exporter".into()));
        assert_eq!(h.authzid.as_deref(), Some("juliet"));
        assert_eq!(h.raw, "p=tls-exporter,a=juliet,");
        assert_eq!(bare, "n=romeo,r=abc");
        assert_eq!(flag("n,,n=u,r=a"), Ok(Gs2Flag::NotSupported));
        assert_eq!(flag("y,,n=u,r=a"), Ok(Gs2Flag::ServerLacksIt));
        let (h, bare) = split_client_first("y,,n=u,r=a").unwrap();
        assert_eq!((h.raw.as_str(), bare, h.authzid), ("y,,", "n=u,r=a", None));
    }

    #[test]
    fn malformed_gs2_headers_are_refused() {
        for msg in [
            "",
            "n",
            "n,",
            "x,,n=u,r=a",
            "p=,,n=u,r=a",
            "p=tls_exp,,n=u",
            "P=a,,n=u",
        ] {
            assert!(
                matches!(split_client_first(msg), Err(Gs2Error::Malformed(_))),
                "{msg}"
            );
        }
        assert_eq!(
            split_client_first("n,b=x,n=u,r=a").unwrap_err(),
            Gs2Error::Malformed("bad gs2 authzid")
        );
    }

    #[test]
    fn each_flag_against_each_offer_follows_rfc_5802_section_6() {
        let required = Binding::Required {
            cb_type: TLS_EXPORTER,
            data: vec![7; 32],
        };
        let p = |t: &str| Gs2Flag::Binds(t.into());
        let cases = [
            (Binding::NotOffered, Gs2Flag::NotSupported, Ok(())),
            (Binding::NotOffered, Gs2Flag::ServerLacksIt, Ok(())),
            (
                Binding::NotOffered,
                p(TLS_EXPORTER),
                Err(Gs2Error::NotSupported),
            ),
            (Binding::Offered, Gs2Flag::NotSupported, Ok(())),
            (
                Binding::Offered,
                Gs2Flag::ServerLacksIt,
                Err(Gs2Error::Downgrade),
            ),
            (
                Binding::Offered,
                p(TLS_EXPORTER),
                Err(Gs2Error::NotSupported),
            ),
            (required.clone(), p(TLS_EXPORTER), Ok(())),
            (
                required.clone(),
                p("tls-unique"),
                Err(Gs2Error::UnsupportedType),
            ),
            (
                required.clone(),
                Gs2Flag::NotSupported,
                Err(Gs2Error::BindingRequired),
            ),
            (
                required.clone(),
                Gs2Flag::ServerLacksIt,
                Err(Gs2Error::BindingRequired),
            ),
        ];
        for (binding, flag, want) in cases {
            assert_eq!(binding.check(&flag), want, "{binding:?} {flag:?}");
        }
    }

    #[test]
    fn cbind_input_appends_the_data_only_when_binding() {
        let required = Binding::Required {
            cb_type: TLS_EXPORTER,
            data: vec![1, 2, 3],
        };
        assert_eq!(
            required.cbind_input("p=tls-exporter,,"),
            b"p=tls-exporter,,\x01\x02\x03"
        );
        assert_eq!(Binding::Offered.cbind_input("n,,"), b"n,,");
        assert_eq!(Binding::NotOffered.cbind_input("y,,"), b"y,,");
        assert_eq!(format!("{required:?}"), "Required(tls-exporter)");
    }

    #[test]
    fn downgrade_protection_input_sorts_by_octet_and_separates_with_1e_and_1f() {
        // XEP-0474's example, its lists given out of order.
        assert_eq!(
            downgrade_protection_input(
                &["SCRAM-SHA-1-PLUS", "SCRAM-SHA-1"],
                Some(&["tls-server-end-point", "tls-exporter"])
            ),
            b"SCRAM-SHA-1\x1eSCRAM-SHA-1-PLUS\x1ftls-exporter\x1etls-server-end-point"
        );
        // '-' (0x2D) sorts before '2' (0x32): SCRAM-SHA-1-PLUS before SCRAM-SHA-256.
        assert_eq!(
            downgrade_protection_input(&["SCRAM-SHA-256", "SCRAM-SHA-1-PLUS", "PLAIN"], None),
            b"PLAIN\x1eSCRAM-SHA-1-PLUS\x1eSCRAM-SHA-256"
        );
    }
}
