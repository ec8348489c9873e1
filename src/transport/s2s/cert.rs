//! Peer certificates and SASL EXTERNAL (XEP-0178): the pure decisions, no I/O.
//!
//! - [`proves_domain`]: does a certificate chain prove that its holder is a domain?
//!   RFC 6120 §13.7.1.2 and RFC 6125: it chains to a configured root and names the domain
//!   in a DNS subject alternative name; or, for domains whose policy has
//!   `allow_self_signed`, it merely names the domain (the TLS handshake already proved the
//!   peer holds the key). `id-on-xmppAddr` names are not read: the webpki crate does not
//!   expose otherName SANs, and every server we federate with also puts the domain in a
//!   DNS SAN (RFC 6120 §13.7.1.2 recommends it).
//! - [`decide_external`]: the receiving server's answer to `<auth mechanism='EXTERNAL'>`.

use std::sync::Arc;

use base64::Engine;
use rustls::client::danger::ServerCertVerifier;
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

/// Certificate authorities trusted for peers, from `[s2s] ca_file`; `None` when unreadable
/// (then, as without a `ca_file`, only `allow_self_signed` domains can verify).
pub fn load_roots(ca_file: &std::path::Path) -> Option<Arc<WebPkiServerVerifier>> {
    use rustls_pki_types::pem::PemObject;
    let certs = match CertificateDer::pem_file_iter(ca_file) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(ca_file = %ca_file.display(), error = %e, "[s2s] ca_file unreadable; no peer certificate will verify by CA");
            return None;
        }
    };
    let mut store = rustls::RootCertStore::empty();
    for c in certs.flatten() {
        let _ = store.add(c);
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    WebPkiServerVerifier::builder_with_provider(Arc::new(store), provider)
        .build()
        .map_err(|e| tracing::warn!(ca_file = %ca_file.display(), error = %e, "[s2s] ca_file has no usable root"))
        .ok()
}

/// Whether `chain` (end entity first) proves `domain`.
///
/// Chains are checked as TLS *server* certificates (serverAuth usage, or no extended key
/// usage at all) in both directions: a server presents the same certificate whichever side
/// of the connection it is on, and public CAs no longer issue the clientAuth usage.
pub fn proves_domain(
    roots: Option<&WebPkiServerVerifier>,
    allow_self_signed: bool,
    chain: &[CertificateDer<'_>],
    domain: &str,
) -> bool {
    let Some((end_entity, intermediates)) = chain.split_first() else {
        return false;
    };
    let Ok(name) = ServerName::try_from(domain.to_owned()) else {
        return false;
    };
    proves_name(
        roots,
        allow_self_signed,
        end_entity,
        intermediates,
        &name,
        &[],
        UnixTime::now(),
    )
}

/// [`proves_domain`] for a certificate already split as rustls hands it to a verifier
/// (the outgoing side checks the peer inside the handshake, with its OCSP response).
pub fn proves_name(
    roots: Option<&WebPkiServerVerifier>,
    allow_self_signed: bool,
    end_entity: &CertificateDer<'_>,
    intermediates: &[CertificateDer<'_>],
    name: &ServerName<'_>,
    ocsp: &[u8],
    now: UnixTime,
) -> bool {
    let by_roots = roots.is_some_and(|v| {
        v.verify_server_cert(end_entity, intermediates, name, ocsp, now)
            .is_ok()
    });
    by_roots || (allow_self_signed && names_domain(end_entity, name))
}

/// Whether the certificate's subject alternative names cover `name` (RFC 6125 §6.4).
pub fn names_domain(cert: &CertificateDer<'_>, name: &ServerName<'_>) -> bool {
    webpki::EndEntityCert::try_from(cert)
        .is_ok_and(|c| c.verify_is_valid_for_subject_name(name).is_ok())
}

/// The receiving server's decision on `<auth mechanism='…'>` (RFC 6120 §6.4, XEP-0178 §3).
///
/// `offered`: EXTERNAL was offered on this stream, i.e. the certificate proves `from`.
/// `response`: the initial response (or the response to our empty challenge): `=` or
/// empty for "the identity of my certificate", else base64 of the authorization identity.
/// `Ok` is the authenticated domain; `Err` the RFC 6120 §6.5 failure condition.
pub fn decide_external(
    mechanism: &str,
    offered: bool,
    from: Option<&str>,
    response: &str,
) -> Result<String, &'static str> {
    if mechanism != "EXTERNAL" {
        // RFC 6120 §6.5.5: the only mechanism a server stream offers.
        return Err("invalid-mechanism");
    }
    let Some(from) = from.filter(|_| offered) else {
        // XEP-0178 §3: the certificate does not prove the domain in the stream header
        // (or there is no header 'from' to prove).
        return Err("not-authorized");
    };
    let response = response.trim();
    if response.is_empty() || response == "=" {
        return Ok(from.to_owned());
    }
    // RFC 6120 §6.5.2: not base64, or not UTF-8 once decoded.
    let Ok(bytes) = base64::engine::general_purpose::STANDARD.decode(response) else {
        return Err("incorrect-encoding");
    };
    let Ok(authzid) = String::from_utf8(bytes) else {
        return Err("incorrect-encoding");
    };
    if authzid.eq_ignore_ascii_case(from) {
        Ok(from.to_owned())
    } else {
        // RFC 6120 §6.5.6 / XEP-0178 §3: a server may only authorize as the domain its
        // certificate and stream header name.
        Err("invalid-authzid")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn external_accepts_empty_or_matching_authzid_only() {
        let ok = |r| decide_external("EXTERNAL", true, Some("b.example"), r);
        assert_eq!(ok("="), Ok("b.example".into()));
        assert_eq!(ok(""), Ok("b.example".into()));
        assert_eq!(
            ok("Yi5leGFtcGxl"),
            Ok("b.example".into()),
            "base64 of b.example"
        );
        assert_eq!(
            ok("Yy5leGFtcGxl"),
            Err("invalid-authzid"),
            "base64 of c.example"
        );
        assert_eq!(ok("not base64!"), Err("incorrect-encoding"));
        assert_eq!(ok("/w=="), Err("incorrect-encoding"), "0xff is not UTF-8");
    }

    #[test]
    fn external_without_a_proving_certificate_is_not_authorized() {
        assert_eq!(
            decide_external("EXTERNAL", false, Some("b.example"), "="),
            Err("not-authorized")
        );
        assert_eq!(
            decide_external("EXTERNAL", true, None, "="),
            Err("not-authorized")
        );
        assert_eq!(
            decide_external("PLAIN", true, Some("b.example"), "="),
            Err("invalid-mechanism")
        );
    }

    #[test]
    fn certificate_proves_only_the_domains_it_names() {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let leaf_key = rcgen::KeyPair::generate().unwrap();
        let leaf = rcgen::CertificateParams::new(vec!["b.example".to_owned()])
            .unwrap()
            .signed_by(&leaf_key, &ca, &ca_key)
            .unwrap();
        let mut store = rustls::RootCertStore::empty();
        store.add(ca.der().clone()).unwrap();
        let roots = WebPkiServerVerifier::builder_with_provider(
            Arc::new(store),
            Arc::new(rustls::crypto::ring::default_provider()),
        )
        .build()
        .unwrap();
        let chain = [leaf.der().clone()];
        assert!(proves_domain(Some(&roots), false, &chain, "b.example"));
        assert!(!proves_domain(Some(&roots), false, &chain, "c.example"));
        assert!(!proves_domain(None, false, &chain, "b.example"), "no roots");
        assert!(
            proves_domain(None, true, &chain, "b.example"),
            "self-signed allowed"
        );
        assert!(!proves_domain(None, true, &chain, "c.example"));
        assert!(
            !proves_domain(Some(&roots), true, &[], "b.example"),
            "no certificate"
        );
    }
}
