//! XEP-0388 Extensible SASL Profile (SASL2) and XEP-0386 Bind 2 on a client stream: what
//! the features offer, what an `<authenticate/>` asks for, and the `<success/>` that answers
//! it. The mechanism exchange itself is the one of `sasl` (one implementation, two framings);
//! binding, XEP-0198, XEP-0280 and XEP-0352 keep their own rules (`bind`, `resume`,
//! `session`), this module only reads and writes their inline form.

use crate::node::stream_management as sm;
use crate::protocol::xml::{self as x, escape, Element};
use crate::services::{carbons::NS_CARBONS, csi::NS_CSI};

/// The XEP-0388 namespace.
pub(super) const NS_SASL2: &str = "urn:xmpp:sasl:2";
/// The XEP-0386 namespace.
pub(super) const NS_BIND2: &str = "urn:xmpp:bind:0";
/// The XEP-0484 namespace.
pub(super) const NS_FAST: &str = "urn:xmpp:fast:0";

/// The longest `<user-agent id/>` kept (XEP-0388 suggests a UUID, 36 characters): it is
/// stored with each FAST token and kept in the session's state.
pub(super) const MAX_USER_AGENT_ID: usize = 256;

/// The longest `<tag/>` a client's resource starts with (XEP-0386: the server may
/// shorten it); the random part follows it.
const MAX_TAG: usize = 64;

/// The `<authentication/>` feature (XEP-0388 "Discovering Support"): the mechanisms SASL1
/// offers, and what may come inline: Bind 2 with the features it can enable (XEP-0386),
/// XEP-0198 resumption, and the XEP-0484 FAST mechanisms (`fast`, offered only here: a
/// token is only ever used inside a SASL2 authentication).
pub(super) fn feature(mechanisms: &[&str], fast: &[&str]) -> Element {
    let mut f = Element::new("authentication", NS_SASL2);
    for m in mechanisms {
        f = f.child(Element::new("mechanism", NS_SASL2).text(*m));
    }
    let mut bind = Element::new("inline", NS_BIND2);
    for var in [sm::NS_SM, NS_CARBONS, NS_CSI] {
        bind = bind.child(Element::new("feature", NS_BIND2).attr("var", var));
    }
    let mut inline = Element::new("inline", NS_SASL2)
        .child(Element::new("bind", NS_BIND2).child(bind))
        .child(Element::new("sm", sm::NS_SM));
    if !fast.is_empty() {
        let mut offer = Element::new("fast", NS_FAST);
        for m in fast {
            offer = offer.child(Element::new("mechanism", NS_FAST).text(*m));
        }
        inline = inline.child(offer);
    }
    f.child(inline)
}

/// What a client's `<authenticate/>` asks for (XEP-0388 "Initiation").
pub(super) struct Request {
    pub(super) mechanism: String,
    /// The base64 `<initial-response/>`, empty when there is none.
    pub(super) initial: String,
    /// `<user-agent id/>` (XEP-0388 "Initiation"): the client installation, stable across its
    /// logins.
    pub(super) user_agent: Option<String>,
    /// XEP-0198 `<resume/>` inline.
    pub(super) resume: Option<(String, u32)>,
    /// XEP-0386 `<bind/>`.
    pub(super) bind: Option<Bind>,
    /// XEP-0484 `<request-token mechanism/>`: the mechanism the client wants a token for.
    pub(super) request_token: Option<String>,
    /// XEP-0484 `<fast/>`, sent with an authentication by token.
    pub(super) fast: Option<Fast>,
}

/// XEP-0484 `<fast/>` in an authentication by token.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Fast {
    /// `count`: higher on every use of the token, so a replay is refused.
    pub(super) count: Option<i64>,
    /// `invalidate='true'`: the token ends with this login (the client is logging out).
    pub(super) invalidate: bool,
}

/// A XEP-0386 `<bind/>` request and what it enables inline.
#[derive(Default)]
pub(super) struct Bind {
    /// `<tag/>`: what the server's resource starts with (XEP-0386).
    pub(super) tag: Option<String>,
    /// XEP-0198 `<enable/>`: resumable, and the client's preferred window.
    pub(super) sm: Option<(bool, Option<u64>)>,
    /// XEP-0280 `<enable/>`.
    pub(super) carbons: bool,
    /// XEP-0352 `<active/>` or `<inactive/>`.
    pub(super) csi: Option<bool>,
}

impl Request {
    /// Reads `<authenticate/>`; `Err` for a malformed inline XEP-0198 element.
    pub(super) fn parse(el: &Element) -> Result<Request, sm::Malformed> {
        let resume = match el.get_child("resume", sm::NS_SM).map(sm::Nonza::parse) {
            Some(Some(Ok(sm::Nonza::Resume { previd, h }))) => Some((previd, h)),
            Some(Some(Err(e))) => return Err(e),
            _ => None,
        };
        let bind = match el.get_child("bind", NS_BIND2) {
            Some(b) => Some(Bind::parse(b)?),
            None => None,
        };
        Ok(Request {
            mechanism: el.get_attr("mechanism").unwrap_or("").to_owned(),
            initial: el
                .get_child("initial-response", NS_SASL2)
                .map(|r| r.text_content())
                .unwrap_or_default(),
            user_agent: el
                .get_child("user-agent", NS_SASL2)
                .and_then(|u| u.get_attr("id"))
                .map(str::to_owned),
            resume,
            bind,
            request_token: el
                .get_child("request-token", NS_FAST)
                .map(|r| r.get_attr("mechanism").unwrap_or("").to_owned()),
            fast: el.get_child("fast", NS_FAST).map(|f| Fast {
                count: f.get_attr("count").and_then(|c| c.parse().ok()),
                invalidate: matches!(f.get_attr("invalidate"), Some("true" | "1")),
            }),
        })
    }
}

impl Bind {
    fn parse(el: &Element) -> Result<Bind, sm::Malformed> {
        let mut bind = Bind {
            tag: el
                .get_child("tag", NS_BIND2)
                .map(|t| t.text_content().trim().chars().take(MAX_TAG).collect())
                .filter(|t: &String| !t.is_empty()),
            ..Bind::default()
        };
        for child in el.elements() {
            let nonza = sm::Nonza::parse(child).transpose()?;
            if let Some(sm::Nonza::Enable { resume, max }) = nonza {
                bind.sm = Some((resume, max));
            } else if child.is("enable", NS_CARBONS) {
                bind.carbons = true;
            } else if let Some(active) = crate::services::csi::nonza(child) {
                bind.csi = Some(active);
            }
        }
        Ok(bind)
    }

    /// XEP-0386 "Resource identifier generation": the resource is the server's, the
    /// client's tag a prefix of it, so two installations with the same tag never take each
    /// other's resource. With the client's `<user-agent id/>` (`stable`, see
    /// [`stable_id`]) the server's part is the same on every login of that installation,
    /// so a reconnect binds the resource it had: a session still in its grace period
    /// goes on with no unavailable seen, and a session of the same installation that is
    /// still bound is replaced (XEP-0386: earlier sessions of the same client end).
    /// Without an id, a random part.
    pub(super) fn resource(&self, stable: Option<String>) -> String {
        let id = stable.unwrap_or_else(x::new_id);
        match &self.tag {
            Some(tag) => format!("{tag}.{id}"),
            None => id,
        }
    }
}

/// The server's part of a stable XEP-0386 resource: an HMAC, keyed with a server secret
/// every node shares, over the account, the installation's `<user-agent id/>` and the tag,
/// so it is the same on every node and restart, says nothing of the id (XEP-0386: the id
/// MUST NOT be exposed), and differs between accounts and tags of one installation.
pub(super) fn stable_id(secret: &[u8], account: &str, agent: &str, tag: Option<&str>) -> String {
    use base64::Engine as _;
    let parts = [account, agent, tag.unwrap_or("")].map(str::as_bytes);
    let digest = crate::protocol::sasl::ht::derive(secret, b"", &parts);
    // 72 bits: no two installations of an account meet by chance.
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&digest[..9])
}

/// XEP-0388 "Success": the mechanism's additional data (SCRAM's server-final), the
/// authorization identifier (the full JID once a resource is bound, else the bare JID),
/// then what the inline requests gave (`inner`, already XML).
pub(super) fn success(additional: Option<&[u8]>, authzid: &str, inner: &str) -> String {
    use base64::Engine as _;
    let additional = additional
        .map(|a| {
            let b64 = base64::engine::general_purpose::STANDARD.encode(a);
            format!("<additional-data>{b64}</additional-data>")
        })
        .unwrap_or_default();
    format!(
        "<success xmlns='{NS_SASL2}'>{additional}<authorization-identifier>{}</authorization-identifier>{inner}</success>",
        escape(authzid)
    )
}

/// XEP-0484 `<token/>` for `<success/>`: the token, and when it stops logging in (an
/// XEP-0082 date-time).
pub(super) fn token(token: &str, expiry: chrono::DateTime<chrono::Utc>) -> String {
    format!(
        "<token xmlns='{NS_FAST}' expiry='{}' token='{}'/>",
        expiry.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        escape(token)
    )
}

/// XEP-0386 `<bound/>` with what was enabled inline (XEP-0198's `<enabled/>`).
pub(super) fn bound(inner: &str) -> String {
    format!("<bound xmlns='{NS_BIND2}'>{inner}</bound>")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::xml::parse_element;

    #[test]
    fn an_authenticate_with_bind_and_its_inline_features_is_read() {
        let el = parse_element(
            "<authenticate xmlns='urn:xmpp:sasl:2' mechanism='SCRAM-SHA-256'>\
             <initial-response>biwsbj1q</initial-response>\
             <user-agent id='d4565fa7-4d72-4749-b3d3-740edbf87770'><software>x</software></user-agent>\
             <bind xmlns='urn:xmpp:bind:0'><tag>Phone</tag>\
             <enable xmlns='urn:xmpp:sm:3' resume='true' max='60'/>\
             <enable xmlns='urn:xmpp:carbons:2'/><inactive xmlns='urn:xmpp:csi:0'/></bind>\
             </authenticate>",
        )
        .unwrap();
        let r = Request::parse(&el).unwrap();
        assert_eq!(r.mechanism, "SCRAM-SHA-256");
        assert_eq!(r.initial, "biwsbj1q");
        assert_eq!(
            r.user_agent.as_deref(),
            Some("d4565fa7-4d72-4749-b3d3-740edbf87770")
        );
        assert!(r.resume.is_none());
        let b = r.bind.unwrap();
        assert_eq!(b.tag.as_deref(), Some("Phone"));
        assert_eq!(b.sm, Some((true, Some(60))));
        assert!(b.carbons);
        assert_eq!(b.csi, Some(false));
        assert!(b.resource(None).starts_with("Phone."));
        assert_ne!(b.resource(None), b.resource(None));
        assert_eq!(b.resource(Some("abc".into())), "Phone.abc");
    }

    #[test]
    fn a_fast_authentication_and_a_token_request_are_read() {
        let el = parse_element(
            "<authenticate xmlns='urn:xmpp:sasl:2' mechanism='HT-SHA-256-NONE'>\
             <initial-response>YQ==</initial-response>\
             <fast xmlns='urn:xmpp:fast:0' count='7' invalidate='true'/>\
             <request-token xmlns='urn:xmpp:fast:0' mechanism='HT-SHA-256-NONE'/>\
             </authenticate>",
        )
        .unwrap();
        let r = Request::parse(&el).unwrap();
        assert_eq!(
            r.fast,
            Some(Fast {
                count: Some(7),
                invalidate: true
            })
        );
        assert_eq!(r.request_token.as_deref(), Some("HT-SHA-256-NONE"));
        let plain = parse_element(
            "<authenticate xmlns='urn:xmpp:sasl:2' mechanism='PLAIN'><fast xmlns='urn:xmpp:fast:0'/></authenticate>",
        )
        .unwrap();
        let r = Request::parse(&plain).unwrap();
        assert_eq!(r.fast, Some(Fast::default()));
        assert!(r.request_token.is_none());
    }

    #[test]
    fn the_feature_offers_fast_mechanisms_only_inline() {
        let f = feature(&["SCRAM-SHA-256"], &["HT-SHA-256-NONE"]);
        let mechs: Vec<String> = f
            .elements()
            .filter(|m| m.is("mechanism", NS_SASL2))
            .map(|m| m.text_content())
            .collect();
        assert_eq!(mechs, ["SCRAM-SHA-256"]);
        let fast = f
            .get_child("inline", NS_SASL2)
            .and_then(|i| i.get_child("fast", NS_FAST))
            .unwrap();
        assert_eq!(
            fast.get_child("mechanism", NS_FAST).unwrap().text_content(),
            "HT-SHA-256-NONE"
        );
        let without = feature(&["SCRAM-SHA-256"], &[]);
        assert!(without
            .get_child("inline", NS_SASL2)
            .unwrap()
            .get_child("fast", NS_FAST)
            .is_none());
    }

    #[test]
    fn an_inline_resume_without_h_is_malformed() {
        let el = parse_element(
            "<authenticate xmlns='urn:xmpp:sasl:2' mechanism='PLAIN'>\
             <resume xmlns='urn:xmpp:sm:3' previd='x'/></authenticate>",
        )
        .unwrap();
        assert!(Request::parse(&el).is_err());
    }

    #[test]
    fn success_carries_additional_data_then_the_identifier() {
        assert_eq!(
            success(Some(b"v=abc"), "a@b/c", "<x/>"),
            "<success xmlns='urn:xmpp:sasl:2'><additional-data>dj1hYmM=</additional-data>\
             <authorization-identifier>a@b/c</authorization-identifier><x/></success>"
        );
    }
}
