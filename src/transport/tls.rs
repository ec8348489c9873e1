//! rustls server configuration from PEM files (rustls-pki-types' `PemObject`), or a generated
//! self-signed certificate for development.
//!
//! One certificate serves every configured domain (its subject alternative names list them
//! all), so SNI needs no per-domain lookup; production deployments point `[tls] cert/key`
//! at a certificate covering their domains (certs/README.md).
//!
//! Client listeners resume TLS 1.3 sessions from stateless tickets that every node of a
//! cluster opens ([`tickets`]); TLS 1.2 clients that do not ask for tickets, and s2s
//! listeners, resume from a small per-node session-ID cache.

pub mod tickets;

use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::CryptoProvider;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, ServerConfig, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, UnixTime};

use crate::config::Config;

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file was missing or unreadable.
    #[error("{0}: {1}")]
    Pem(String, rustls_pki_types::pem::Error),
    /// The certificate and key did not make a valid rustls configuration.
    #[error("rustls: {0}")]
    Rustls(#[from] rustls::Error),
    /// Generating the development certificate failed.
    #[error("generating a self-signed certificate: {0}")]
    Generate(String),
    /// Writing the development certificate failed.
    #[error("writing {0}: {1}")]
    Write(String, std::io::Error),
}

/// Loads the configured certificate, or generates and reuses a self-signed one (no
/// session tickets: resumption from the in-memory cache only).
pub fn server_config(config: &Config) -> Result<Arc<ServerConfig>, TlsError> {
    Ok(c2s_server_config(&Certificates::load(config)?, None)?)
}

/// The TLS configuration of client listeners, presenting whatever `certs` holds at each
/// handshake and issuing session tickets from `tickets` while they are enabled.
pub fn c2s_server_config(
    certs: &Arc<Certificates>,
    tickets: Option<Arc<tickets::Tickets>>,
) -> Result<Arc<ServerConfig>, rustls::Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut server = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(certs.clone());
    // Small session cache: resumption helps reconnect storms, memory stays bounded. With
    // tickets on it serves only TLS 1.2 clients that do not ask for a ticket.
    server.session_storage = rustls::server::ServerSessionMemoryCache::new(1024);
    if let Some(tickets) = tickets {
        server.ticketer = tickets;
    }
    Ok(Arc::new(server))
}

/// The TLS configuration of server-to-server listeners: the same certificate as c2s, and a
/// request (not a requirement) for the peer's certificate. Which domain that certificate
/// must cover is only known from the stream header sent after the handshake, so any
/// certificate is accepted here and checked later for SASL EXTERNAL (XEP-0178 §2,
/// RFC 6120 §13.7.2); a peer without one still gets TLS and may use dialback.
pub fn s2s_server_config(config: &Config) -> Result<Arc<ServerConfig>, TlsError> {
    Ok(s2s_server_config_with(&Certificates::load(config)?)?)
}

/// [`s2s_server_config`] presenting whatever `certs` holds at each handshake.
pub fn s2s_server_config_with(
    certs: &Arc<Certificates>,
) -> Result<Arc<ServerConfig>, rustls::Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = Arc::new(AnyClientCert {
        signatures: HandshakeSignatures(provider.clone()),
    });
    let mut server = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(certs.clone());
    server.session_storage = rustls::server::ServerSessionMemoryCache::new(1024);
    Ok(Arc::new(server))
}

/// The certificate every listener presents, replaceable while the server runs: a handshake
/// takes the one current when it starts, so a reload (SIGHUP) changes what new
/// connections see and leaves established ones alone.
#[derive(Debug)]
pub struct Certificates {
    current: std::sync::RwLock<Arc<CertifiedKey>>,
}

impl Certificates {
    /// Loads the configured certificate and key (or the development certificate).
    pub fn load(config: &Config) -> Result<Arc<Certificates>, TlsError> {
        Ok(Arc::new(Certificates {
            current: std::sync::RwLock::new(certified_key(config)?),
        }))
    }

    /// Loads the configured certificate and key again and presents them from the next
    /// handshake on. On error the current certificate stays.
    pub fn reload(&self, config: &Config) -> Result<(), TlsError> {
        let new = certified_key(config)?;
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = new;
        Ok(())
    }

    /// The end-entity certificate presented now.
    pub fn end_entity(&self) -> Option<CertificateDer<'static>> {
        let current = self.current.read().unwrap_or_else(|p| p.into_inner());
        current.cert.first().cloned()
    }
}

impl rustls::server::ResolvesServerCert for Certificates {
    fn resolve(&self, _hello: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        )
    }
}

/// The configured identity as rustls presents it; refuses a key that does not belong to
/// the certificate (rustls would otherwise only fail at the first handshake).
fn certified_key(config: &Config) -> Result<Arc<CertifiedKey>, TlsError> {
    let (chain, key) = identity(config)?;
    let provider = rustls::crypto::ring::default_provider();
    let certified = CertifiedKey::from_der(chain, key, &provider)?;
    Ok(Arc::new(certified))
}

/// The certificate chain and key this server presents, as TLS server and as TLS client of
/// outgoing server streams.
pub fn identity(
    config: &Config,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsError> {
    let (cert, key) = match (&config.tls.cert, &config.tls.key) {
        (Some(cert), Some(key)) => (
            cert.to_string_lossy().into_owned(),
            key.to_string_lossy().into_owned(),
        ),
        _ => ensure_self_signed(&config.tls.certs_dir, &config.domains)?,
    };
    let chain = CertificateDer::pem_file_iter(&cert)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| TlsError::Pem(cert.clone(), e))?;
    let key = PrivateKeyDer::from_pem_file(&key).map_err(|e| TlsError::Pem(key.clone(), e))?;
    Ok((chain, key))
}

/// Asks for a client certificate, accepts whichever one comes (or none); the handshake
/// signature still proves the peer holds its key.
#[derive(Debug)]
struct AnyClientCert {
    signatures: HandshakeSignatures,
}

impl ClientCertVerifier for AnyClientCert {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        Ok(ClientCertVerified::assertion())
    }

    crate::verify_handshake_signatures_with!(signatures);
}

/// Writes, inside an `impl` of rustls' `ServerCertVerifier` or `ClientCertVerifier`, the
/// three handshake-signature methods both traits require, delegating them to the
/// [`HandshakeSignatures`] in field `$field` (`signatures`, or `0` for a newtype).
#[macro_export]
macro_rules! verify_handshake_signatures_with {
    ($field:tt) => {
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &::rustls::pki_types::CertificateDer<'_>,
            dss: &::rustls::DigitallySignedStruct,
        ) -> Result<::rustls::client::danger::HandshakeSignatureValid, ::rustls::Error> {
            self.$field.tls12(message, cert, dss)
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &::rustls::pki_types::CertificateDer<'_>,
            dss: &::rustls::DigitallySignedStruct,
        ) -> Result<::rustls::client::danger::HandshakeSignatureValid, ::rustls::Error> {
            self.$field.tls13(message, cert, dss)
        }

        fn supported_verify_schemes(&self) -> Vec<::rustls::SignatureScheme> {
            self.$field.schemes()
        }
    };
}

/// The handshake-signature half of a custom certificate verifier: whatever a verifier
/// decides about the certificate itself, the peer's signature over the handshake is always
/// checked with the provider's algorithms, so the peer proves it holds the key. Shared by
/// every verifier in this crate (s2s inbound and outbound, the bench client).
#[derive(Debug, Clone)]
pub struct HandshakeSignatures(pub Arc<CryptoProvider>);

impl HandshakeSignatures {
    /// TLS 1.2 `CertificateVerify` / `ServerKeyExchange` signature.
    pub fn tls12(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    /// TLS 1.3 `CertificateVerify` signature.
    pub fn tls13(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    /// The signature schemes the provider verifies.
    pub fn schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// Paths of the development certificate for `domains` in `dir`, generating it when absent.
/// The file name carries the domain list so a changed list gets a fresh certificate.
pub fn ensure_self_signed(dir: &Path, domains: &[String]) -> Result<(String, String), TlsError> {
    let (cert, key) = self_signed_paths(dir, domains);
    if cert.exists() && key.exists() {
        return Ok((path_str(&cert), path_str(&key)));
    }
    tracing::warn!(
        dir = %dir.display(),
        ?domains,
        "NO CERTIFICATE CONFIGURED: generating a SELF-SIGNED certificate. Clients will not \
         trust it; configure [tls] cert and key for production (see certs/README.md)"
    );
    let mut names = domains.to_vec();
    // Subdomains such as conference.example are not covered; a wildcard helps dev setups.
    names.extend(domains.iter().map(|d| format!("*.{d}")));
    let generated =
        rcgen::generate_simple_self_signed(names).map_err(|e| TlsError::Generate(e.to_string()))?;
    std::fs::create_dir_all(dir).map_err(|e| TlsError::Write(path_str(dir), e))?;
    std::fs::write(&cert, generated.cert.pem()).map_err(|e| TlsError::Write(path_str(&cert), e))?;
    write_private(&key, generated.key_pair.serialize_pem().as_bytes())
        .map_err(|e| TlsError::Write(path_str(&key), e))?;
    Ok((path_str(&cert), path_str(&key)))
}

/// Where the development certificate for `domains` lives in `dir` (certificate, key).
pub fn self_signed_paths(
    dir: &Path,
    domains: &[String],
) -> (std::path::PathBuf, std::path::PathBuf) {
    let stem = domains.join("+");
    (
        dir.join(format!("selfsigned-{stem}.pem")),
        dir.join(format!("selfsigned-{stem}.key")),
    )
}

fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(bytes)
}

fn path_str(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_certificate_loads_and_is_reused() {
        let dir = std::env::temp_dir().join(format!("presenced-tls-{}", std::process::id()));
        let mut config = Config {
            domains: vec!["a.example".into()],
            ..Config::default()
        };
        config.tls.certs_dir = dir.clone();
        server_config(&config).expect("first start generates");
        let before = std::fs::read(dir.join("selfsigned-a.example.pem")).unwrap();
        server_config(&config).expect("second start reuses");
        let after = std::fs::read(dir.join("selfsigned-a.example.pem")).unwrap();
        assert_eq!(before, after);
        let _ = std::fs::remove_dir_all(dir);
    }
}
