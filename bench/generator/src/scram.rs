//! SCRAM client (RFC 5802; SCRAM-SHA-256 per RFC 7677) for the load generator.
//!
//! Written for the bench rather than shared with the server's SCRAM so that the bench tests
//! the server against an independent implementation. Channel binding is not used: the
//! GS2 header is `n,,` ("client does not support channel binding", RFC 5802 §7), which
//! every server accepts even when it also offers the -PLUS variants.
//!
//! Computing SaltedPassword (PBKDF2, 4096 iterations by default) costs the client more CPU
//! than the login costs a server that stores salted keys; on a 2-core machine that would
//! cap the measured login rate at the client's speed. RFC 5802 §5.1 lets a client cache
//! SaltedPassword (or ClientKey/ServerKey) for a given salt and iteration count, which is
//! what [`SaltCache`] does: the untimed provisioning pass fills it, the timed run reuses it.

use std::collections::HashMap;
use std::sync::Mutex;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha1::Sha1;
use sha2::{Digest, Sha256};

/// Hash function of a SCRAM mechanism.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScramHash {
    /// SCRAM-SHA-1 (RFC 5802).
    Sha1,
    /// SCRAM-SHA-256 (RFC 7677).
    Sha256,
}

impl ScramHash {
    /// The SASL mechanism name.
    pub fn mechanism(self) -> &'static str {
        match self {
            ScramHash::Sha1 => "SCRAM-SHA-1",
            ScramHash::Sha256 => "SCRAM-SHA-256",
        }
    }

    fn hmac(self, key: &[u8], data: &[u8]) -> Vec<u8> {
        match self {
            ScramHash::Sha1 => {
                let mut m = <Hmac<Sha1> as Mac>::new_from_slice(key).expect("hmac takes any key");
                m.update(data);
                m.finalize().into_bytes().to_vec()
            }
            ScramHash::Sha256 => {
                let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("hmac takes any key");
                m.update(data);
                m.finalize().into_bytes().to_vec()
            }
        }
    }

    fn hash(self, data: &[u8]) -> Vec<u8> {
        match self {
            ScramHash::Sha1 => Sha1::digest(data).to_vec(),
            ScramHash::Sha256 => Sha256::digest(data).to_vec(),
        }
    }

    /// StoredKey and ServerKey of a SaltedPassword (RFC 5802 §3): what a server keeps of a
    /// password, and what provisioning writes into a peer's storage.
    pub fn server_keys(self, salted: &[u8]) -> (Vec<u8>, Vec<u8>) {
        let client_key = self.hmac(salted, b"Client Key");
        (self.hash(&client_key), self.hmac(salted, b"Server Key"))
    }

    fn salted_password(self, password: &str, salt: &[u8], iterations: u32) -> Vec<u8> {
        match self {
            ScramHash::Sha1 => {
                let mut out = vec![0u8; 20];
                pbkdf2::pbkdf2_hmac::<Sha1>(password.as_bytes(), salt, iterations, &mut out);
                out
            }
            ScramHash::Sha256 => {
                let mut out = vec![0u8; 32];
                pbkdf2::pbkdf2_hmac::<Sha256>(password.as_bytes(), salt, iterations, &mut out);
                out
            }
        }
    }
}

/// Cache of SaltedPassword per (user, mechanism, salt, iterations); see the module comment.
#[derive(Debug, Default)]
pub struct SaltCache {
    /// key: "user mech salt-b64 iterations" → SaltedPassword.
    map: Mutex<HashMap<String, Vec<u8>>>,
}

impl SaltCache {
    fn key(user: &str, hash: ScramHash, salt: &[u8], iterations: u32) -> String {
        format!(
            "{user} {} {} {iterations}",
            hash.mechanism(),
            B64.encode(salt)
        )
    }

    /// The SaltedPassword for this salt and count, derived once and cached.
    pub fn salted(
        &self,
        user: &str,
        password: &str,
        hash: ScramHash,
        salt: &[u8],
        iterations: u32,
    ) -> Vec<u8> {
        let key = Self::key(user, hash, salt, iterations);
        if let Some(v) = self.map.lock().map(|m| m.get(&key).cloned()).ok().flatten() {
            return v;
        }
        let v = hash.salted_password(password, salt, iterations);
        if let Ok(mut m) = self.map.lock() {
            m.insert(key, v.clone());
        }
        v
    }

    /// Derives and caches the SaltedPassword for a salt the server is known to send.
    pub fn warm(&self, user: &str, password: &str, hash: ScramHash, salt: &[u8], iterations: u32) {
        self.salted(user, password, hash, salt, iterations);
    }

    /// Number of cached entries.
    pub fn len(&self) -> usize {
        self.map.lock().map(|m| m.len()).unwrap_or(0)
    }

    /// Loads a cache file written by [`SaltCache::save`]; a missing file is an empty cache.
    pub fn load(path: &std::path::Path) -> std::io::Result<Self> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e),
        };
        let mut map = HashMap::new();
        for line in text.lines() {
            // user mech salt iterations value
            let parts: Vec<&str> = line.split(' ').collect();
            if parts.len() != 5 {
                continue;
            }
            if let Ok(v) = B64.decode(parts[4]) {
                map.insert(parts[..4].join(" "), v);
            }
        }
        Ok(SaltCache {
            map: Mutex::new(map),
        })
    }

    /// Writes the cache, one entry per line.
    pub fn save(&self, path: &std::path::Path) -> std::io::Result<()> {
        let mut out = String::new();
        if let Ok(m) = self.map.lock() {
            for (k, v) in m.iter() {
                out.push_str(k);
                out.push(' ');
                out.push_str(&B64.encode(v));
                out.push('\n');
            }
        }
        std::fs::write(path, out)
    }
}

/// Errors of the client side of a SCRAM exchange.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ScramError {
    /// The server-first-message was not `r=...,s=...,i=...` as RFC 5802 §5.1 requires.
    #[error("malformed server-first-message: {0}")]
    BadServerFirst(String),
    /// The server nonce did not start with ours (RFC 5802 §5.1, "r").
    #[error("server nonce does not extend the client nonce")]
    NonceMismatch,
    /// The server-final-message carried an error or a wrong signature (RFC 5802 §5.1, "v"/"e").
    #[error("server signature rejected: {0}")]
    BadServerFinal(String),
}

/// One SCRAM client exchange: `first()`, then `respond()`, then `verify()`.
#[derive(Debug)]
pub struct ScramClient {
    hash: ScramHash,
    user: String,
    password: String,
    client_nonce: String,
    client_first_bare: String,
    expected_server_signature: Vec<u8>,
}

impl ScramClient {
    /// A client for `user`/`password` using `client_nonce` (random printable, no comma).
    pub fn new(hash: ScramHash, user: &str, password: &str, client_nonce: &str) -> Self {
        // RFC 5802 §5.1: "=" and "," in the username are escaped as =3D and =2C.
        let saslname = user.replace('=', "=3D").replace(',', "=2C");
        ScramClient {
            hash,
            user: user.to_string(),
            password: password.to_string(),
            client_nonce: client_nonce.to_string(),
            client_first_bare: format!("n={saslname},r={client_nonce}"),
            expected_server_signature: Vec::new(),
        }
    }

    /// A client with a fresh random nonce.
    pub fn with_random_nonce(hash: ScramHash, user: &str, password: &str) -> Self {
        use rand::Rng;
        let bytes: [u8; 18] = rand::thread_rng().gen();
        Self::new(hash, user, password, &B64.encode(bytes))
    }

    /// client-first-message (GS2 header `n,,` + bare message).
    pub fn first(&self) -> String {
        format!("n,,{}", self.client_first_bare)
    }

    /// client-final-message for the given server-first-message.
    pub fn respond(&mut self, server_first: &str, cache: &SaltCache) -> Result<String, ScramError> {
        let mut nonce = None;
        let mut salt = None;
        let mut iterations = None;
        for part in server_first.split(',') {
            if let Some(v) = part.strip_prefix("r=") {
                nonce = Some(v);
            } else if let Some(v) = part.strip_prefix("s=") {
                salt = B64.decode(v).ok();
            } else if let Some(v) = part.strip_prefix("i=") {
                iterations = v.parse::<u32>().ok();
            } else if part.starts_with("m=") {
                // RFC 5802 §5.1: a mandatory extension we do not know means we must fail.
                return Err(ScramError::BadServerFirst(server_first.to_string()));
            }
        }
        let (Some(nonce), Some(salt), Some(iterations)) = (nonce, salt, iterations) else {
            return Err(ScramError::BadServerFirst(server_first.to_string()));
        };
        if iterations == 0 {
            return Err(ScramError::BadServerFirst(server_first.to_string()));
        }
        if !nonce.starts_with(&self.client_nonce) || nonce.len() <= self.client_nonce.len() {
            return Err(ScramError::NonceMismatch);
        }
        let h = self.hash;
        let salted = cache.salted(&self.user, &self.password, h, &salt, iterations);
        let client_key = h.hmac(&salted, b"Client Key");
        let (stored_key, server_key) = h.server_keys(&salted);
        // c= is base64 of the GS2 header "n,," (RFC 5802 §7, cbind-input without data).
        let without_proof = format!("c=biws,r={nonce}");
        let auth_message = format!(
            "{},{},{}",
            self.client_first_bare, server_first, without_proof
        );
        let client_signature = h.hmac(&stored_key, auth_message.as_bytes());
        let proof: Vec<u8> = client_key
            .iter()
            .zip(client_signature.iter())
            .map(|(a, b)| a ^ b)
            .collect();
        self.expected_server_signature = h.hmac(&server_key, auth_message.as_bytes());
        Ok(format!("{without_proof},p={}", B64.encode(proof)))
    }

    /// Checks the server-final-message (`v=<signature>`), proving the server knew our key.
    pub fn verify(&self, server_final: &str) -> Result<(), ScramError> {
        if let Some(e) = server_final.strip_prefix("e=") {
            return Err(ScramError::BadServerFinal(e.to_string()));
        }
        let v = server_final
            .split(',')
            .find_map(|p| p.strip_prefix("v="))
            .ok_or_else(|| ScramError::BadServerFinal(server_final.to_string()))?;
        let got = B64
            .decode(v)
            .map_err(|_| ScramError::BadServerFinal(server_final.to_string()))?;
        if got == self.expected_server_signature {
            Ok(())
        } else {
            Err(ScramError::BadServerFinal("signature mismatch".into()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha1_exchange_matches_rfc5802_section5_example() {
        let cache = SaltCache::default();
        let mut c = ScramClient::new(
            ScramHash::Sha1,
            "user",
            "pencil",
            "fyko+d2lbbFgONRv9qkxdawL",
        );
        assert_eq!(c.first(), "n,,n=user,r=fyko+d2lbbFgONRv9qkxdawL");
        let fin = c
            .respond(
                "r=fyko+d2lbbFgONRv9qkxdawL3rfcNHYJY1ZVvWVs7j,s=QSXCR+Q6sek8bf92,i=4096",
                &cache,
            )
            .expect("valid server-first");
        assert_eq!(
            fin,
            "c=biws,r=fyko+d2lbbFgONRv9qkxdawL3rfcNHYJY1ZVvWVs7j,p=v0X8v3Bz2T0CJGbJQyF0X+HI4Ts="
        );
        assert_eq!(c.verify("v=rmF9pqV8S7suAoZWja4dJRkFsKQ="), Ok(()));
        assert!(c.verify("v=AAAAAAAAAAAAAAAAAAAAAAAAAAA=").is_err());
    }

    #[test]
    fn sha256_exchange_matches_rfc7677_section3_example() {
        let cache = SaltCache::default();
        let mut c = ScramClient::new(ScramHash::Sha256, "user", "pencil", "rOprNGfwEbeRWgbNEkqO");
        let fin = c
            .respond(
                "r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096",
                &cache,
            )
            .expect("valid server-first");
        assert_eq!(
            fin,
            "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
        );
        assert_eq!(
            c.verify("v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="),
            Ok(())
        );
    }

    /// A server holding only what `server_keys` derives (StoredKey, ServerKey) accepts the
    /// RFC 5802 §5 example's proof and signs as the example does: the credentials that
    /// provisioning writes into a peer's storage are the ones a real login checks.
    #[test]
    fn server_keys_verify_the_rfc5802_section5_example() {
        let salt = B64.decode("QSXCR+Q6sek8bf92").expect("b64");
        let salted = SaltCache::default().salted("user", "pencil", ScramHash::Sha1, &salt, 4096);
        let (stored_key, server_key) = ScramHash::Sha1.server_keys(&salted);
        let auth_message = "n=user,r=fyko+d2lbbFgONRv9qkxdawL,\
            r=fyko+d2lbbFgONRv9qkxdawL3rfcNHYJY1ZVvWVs7j,s=QSXCR+Q6sek8bf92,i=4096,\
            c=biws,r=fyko+d2lbbFgONRv9qkxdawL3rfcNHYJY1ZVvWVs7j";
        let proof = B64.decode("v0X8v3Bz2T0CJGbJQyF0X+HI4Ts=").expect("b64");
        // RFC 5802 §3: ClientKey = ClientProof XOR ClientSignature; H(ClientKey) = StoredKey.
        let signature = ScramHash::Sha1.hmac(&stored_key, auth_message.as_bytes());
        let client_key: Vec<u8> = proof.iter().zip(&signature).map(|(a, b)| a ^ b).collect();
        assert_eq!(ScramHash::Sha1.hash(&client_key), stored_key);
        let server_signature = ScramHash::Sha1.hmac(&server_key, auth_message.as_bytes());
        assert_eq!(B64.encode(server_signature), "rmF9pqV8S7suAoZWja4dJRkFsKQ=");
    }

    #[test]
    fn server_nonce_not_extending_ours_is_refused() {
        let mut c = ScramClient::new(ScramHash::Sha1, "user", "pencil", "abc");
        assert_eq!(
            c.respond("r=xyz123,s=QSXCR+Q6sek8bf92,i=4096", &SaltCache::default()),
            Err(ScramError::NonceMismatch)
        );
    }

    #[test]
    fn cache_reuses_salted_password_and_survives_a_file_round_trip() {
        let cache = SaltCache::default();
        let mut a = ScramClient::new(
            ScramHash::Sha1,
            "user",
            "pencil",
            "fyko+d2lbbFgONRv9qkxdawL",
        );
        let sf = "r=fyko+d2lbbFgONRv9qkxdawL3rfcNHYJY1ZVvWVs7j,s=QSXCR+Q6sek8bf92,i=4096";
        let first = a.respond(sf, &cache).expect("valid");
        assert_eq!(cache.len(), 1);
        let dir = std::env::temp_dir().join(format!("scram-cache-{}", std::process::id()));
        cache.save(&dir).expect("write cache");
        let loaded = SaltCache::load(&dir).expect("read cache");
        let _ = std::fs::remove_file(&dir);
        assert_eq!(loaded.len(), 1);
        let mut b = ScramClient::new(
            ScramHash::Sha1,
            "user",
            "pencil",
            "fyko+d2lbbFgONRv9qkxdawL",
        );
        assert_eq!(b.respond(sf, &loaded).expect("valid"), first);
    }
}
