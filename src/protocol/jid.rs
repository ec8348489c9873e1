//! JIDs (RFC 7622), normalised once at the edge.
//!
//! The maintained `jid` crate (xmpp-rs) parses and applies the stringprep profiles
//! (nodeprep lower-cases the localpart, nameprep the domain) and the length limits of
//! each part; everything after the edge compares the normalised strings. This module is
//! the one way text from the wire, the configuration, the store or an operator becomes a
//! JID ([`parse`], [`parse_bare`], [`parse_full`], [`bare`]), so every edge applies the
//! same rules; `tests/jid_parser.rs` fails on a parse of the crate's anywhere else.

use std::borrow::{Borrow, Cow};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

pub use jid::{BareJid, Error as JidError, FullJid, Jid};

/// A session's full JID, held once and shared by every map that keeps it (the node's
/// registry and each handle, liveness, the cluster's routing map): cloning it counts a
/// reference instead of copying the string. Each copy was a small block that lived as
/// long as the session, and at login such blocks land among the login's short-lived ones
/// and keep their pages from being reused.
///
/// It hashes, compares and borrows as its string, so a map keyed by it is looked up with
/// a `&str` (the JID crate's own hash is its normalised string's too).
#[derive(Clone, PartialEq, Eq)]
pub struct SharedJid(Arc<FullJid>);

impl SharedJid {
    /// Shares `jid`.
    pub fn share(jid: FullJid) -> Self {
        SharedJid(Arc::new(jid))
    }
}

impl From<FullJid> for SharedJid {
    fn from(jid: FullJid) -> Self {
        SharedJid::share(jid)
    }
}

impl std::ops::Deref for SharedJid {
    type Target = FullJid;
    fn deref(&self) -> &FullJid {
        &self.0
    }
}

impl Hash for SharedJid {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.as_str().hash(state)
    }
}

impl Borrow<str> for SharedJid {
    fn borrow(&self) -> &str {
        self.0.as_str()
    }
}

impl PartialEq<FullJid> for SharedJid {
    fn eq(&self, other: &FullJid) -> bool {
        *self.0 == *other
    }
}

impl std::fmt::Display for SharedJid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&*self.0, f)
    }
}

impl std::fmt::Debug for SharedJid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&*self.0, f)
    }
}

/// The bare part (`user@domain`) of a JID string in any form, unchecked: for strings
/// that were validated when they entered the server.
pub fn bare_of(jid: &str) -> &str {
    jid.split_once('/').map(|(b, _)| b).unwrap_or(jid)
}

/// The domain of a JID string in any form, unchecked (see [`bare_of`]).
pub fn domain_of(jid: &str) -> &str {
    let bare = bare_of(jid);
    bare.rsplit_once('@').map(|(_, d)| d).unwrap_or(bare)
}

/// Parses and normalises a JID received from outside: the `jid` crate's preparation plus
/// RFC 7622 §3.2, "a trailing dot in the domainpart is removed before comparison". The
/// crate accepts such a domain but keeps the dot in the string it compares, so
/// `mallory@sec.example.` would be a different JID from `mallory@sec.example` (and a
/// block of it would block nobody). Only one dot is the root label: a domainpart that
/// still ends with one after it is removed has an empty label and is malformed.
pub fn parse(s: &str) -> Result<Jid, JidError> {
    Jid::new(&without_root_dot(s)?)
}

/// [`parse`] for a place that takes only a bare JID (`user@domain` or `domain`): one with
/// a resource is an error.
pub fn parse_bare(s: &str) -> Result<BareJid, JidError> {
    BareJid::new(&without_root_dot(s)?)
}

/// [`parse`] for a place that takes only a full JID: one without a resource is an error.
pub fn parse_full(s: &str) -> Result<FullJid, JidError> {
    FullJid::new(&without_root_dot(s)?)
}

/// `s` without the trailing dot of its domainpart, if it has one.
fn without_root_dot(s: &str) -> Result<Cow<'_, str>, JidError> {
    // The domainpart ends at the first '/' (a resource may contain '@', '/' and dots).
    let end = s.find('/').unwrap_or(s.len());
    let Some(bare) = s[..end].strip_suffix('.') else {
        return Ok(Cow::Borrowed(s));
    };
    if bare.ends_with('.') {
        return Err(JidError::Idna);
    }
    Ok(Cow::Owned(format!("{bare}{}", &s[end..])))
}

/// Parses a JID from an attribute value; `None` when absent, `Some(Err)` when malformed
/// (RFC 6120 §8.3.3.8: a malformed address gets jid-malformed).
pub fn parse_opt(value: Option<&str>) -> Option<Result<Jid, JidError>> {
    value.map(parse)
}

/// The localpart of a JID as a plain string ("" for a domain JID).
pub fn node_str(jid: &Jid) -> &str {
    jid.node().map(|n| n.as_str()).unwrap_or("")
}

/// `user@domain` for an account.
pub fn bare(username: &str, domain: &str) -> Result<BareJid, JidError> {
    parse_bare(&format!("{username}@{domain}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn localpart_and_domain_are_case_folded_resource_is_not() {
        let j = parse("Alice@A.Example/Phone").unwrap();
        assert_eq!(j.as_str(), "alice@a.example/Phone");
        assert_eq!(node_str(&j), "alice");
    }

    #[test]
    fn a_trailing_dot_in_the_domainpart_is_removed() {
        // RFC 7622 §3.2: "a.example." and "a.example" are the same domain.
        for (input, want) in [
            ("mallory@sec.example.", "mallory@sec.example"),
            ("Mallory@Sec.Example.", "mallory@sec.example"),
            ("sec.example.", "sec.example"),
            ("mallory@sec.example./phone.", "mallory@sec.example/phone."),
            ("sec.example./res@x.", "sec.example/res@x."),
            ("mallory@sec.example", "mallory@sec.example"),
        ] {
            let j = parse_opt(Some(input)).unwrap().unwrap();
            assert_eq!(j.as_str(), want, "{input}");
            assert_eq!(j.domain().as_str(), "sec.example", "{input}");
        }
        for bad in ["mallory@.", "mallory@sec.example..", "."] {
            assert!(parse_opt(Some(bad)).unwrap().is_err(), "{bad}");
            assert!(parse_bare(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bare_and_full_parse_with_the_same_rules_and_refuse_the_other_form() {
        let b = parse_bare("Mallory@Sec.Example.").unwrap();
        assert_eq!(b.as_str(), "mallory@sec.example");
        assert_eq!(parse_bare("sec.example.").unwrap().as_str(), "sec.example");
        let f = parse_full("Mallory@Sec.Example./Phone.").unwrap();
        assert_eq!(f.as_str(), "mallory@sec.example/Phone.");
        assert_eq!(bare("Mallory", "sec.example.").unwrap(), b);
        assert!(parse_bare("mallory@sec.example/phone").is_err());
        assert!(parse_full("mallory@sec.example.").is_err());
        assert!(parse_full("mallory@sec.example../r").is_err());
        // The crate's length limit: 1023 bytes per part (RFC 7622 §3.3.1, §3.2.1).
        let long = format!("{}@sec.example", "a".repeat(1024));
        assert!(parse_bare(&long).is_err());
    }

    #[test]
    fn a_shared_jid_is_one_copy_found_by_its_string() {
        let a = SharedJid::share(parse_full("Alice@A.Example/Phone").unwrap());
        let b = a.clone();
        assert!(
            std::ptr::eq(a.as_str(), b.as_str()),
            "a clone copied the string"
        );
        let mut map = std::collections::HashMap::new();
        map.insert(a.clone(), 1);
        assert_eq!(map.get("alice@a.example/Phone"), Some(&1));
        assert_eq!(map.get("alice@a.example/phone"), None);
        assert_eq!(a, parse_full("alice@a.example/Phone").unwrap());
        assert_eq!(a.to_string(), "alice@a.example/Phone");
    }

    #[test]
    fn malformed_jids_are_rejected() {
        for bad in ["a@b@c", "@a.example", "a@", "a b@c.example", ""] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
