//! The HT ("hashed token") SASL mechanisms XEP-0484 FAST logs in with
//! (draft-schmaus-kitten-sasl-ht), server side, and how the server makes the tokens they
//! carry. Pure: the c2s negotiation feeds it bytes, the store keeps the rows.
//!
//! HT-SHA-256-NONE: the client's only message is `authcid NUL initiator-hashed-token`,
//! where the hashed token is HMAC-SHA-256 keyed with the token over `"Initiator"`; the
//! server proves it holds the same token with HMAC-SHA-256 over `"Responder"` in its
//! success data. No PBKDF2 and no challenge: one round trip after TLS. (The -ENDP, -UNIQ
//! and -EXPR variants add channel-binding data after the label; only -NONE is offered.)
//!
//! Tokens are never stored. The store keeps a random nonce per token, and the token is an
//! HMAC, keyed with a server secret, over the nonce and what the token is bound to (the
//! account, the client's user-agent id and the mechanism, XEP-0484 "Token binding"): a
//! reader of the database learns nothing that logs in, and a row moved to another account
//! or client derives a different token. Because HT keys its HMAC with the token itself, a
//! plain hash of the token could not check a login; this derivation can.

use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64URL;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// The HT mechanisms offered, strongest first (only the one without channel binding).
pub const MECHANISMS: [&str; 1] = [HT_SHA_256_NONE];

/// HT-SHA-256 without channel binding.
pub const HT_SHA_256_NONE: &str = "HT-SHA-256-NONE";

/// Random bytes per stored token.
pub const NONCE_LEN: usize = 32;

/// Whether `mechanism` is an HT mechanism this server offers.
pub fn offered(mechanism: &str) -> bool {
    MECHANISMS.contains(&mechanism)
}

/// The client's message, split: the account's username and the initiator's hashed token.
#[derive(Debug, PartialEq, Eq)]
pub struct InitiatorMessage {
    /// `authcid`, as the client wrote it (the caller prepares it as a JID localpart).
    pub authcid: String,
    /// HMAC(token, "Initiator").
    pub hashed_token: Vec<u8>,
}

/// Splits the client's first (and only) message; `None` when it is not `authcid NUL
/// hashed-token` with a UTF-8 authcid and a SHA-256-sized hash.
pub fn initiator_message(msg: &[u8]) -> Option<InitiatorMessage> {
    let nul = msg.iter().position(|b| *b == 0)?;
    let (authcid, rest) = msg.split_at(nul);
    let hashed = &rest[1..];
    if authcid.is_empty() || hashed.len() != 32 {
        return None;
    }
    Some(InitiatorMessage {
        authcid: std::str::from_utf8(authcid).ok()?.to_owned(),
        hashed_token: hashed.to_vec(),
    })
}

fn hmac(key: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(key).expect("HMAC takes any key length");
    for p in parts {
        m.update(p);
    }
    m
}

/// Whether `hashed` is HMAC(token, "Initiator"), compared in constant time.
pub fn initiator_matches(token: &str, hashed: &[u8]) -> bool {
    hmac(token.as_bytes(), &[b"Initiator"])
        .verify_slice(hashed)
        .is_ok()
}

/// The server's proof for `<additional-data/>`: HMAC(token, "Responder").
pub fn responder(token: &str) -> Vec<u8> {
    hmac(token.as_bytes(), &[b"Responder"])
        .finalize()
        .into_bytes()
        .to_vec()
}

/// What a token is bound to (XEP-0484 "Token binding").
#[derive(Debug, Clone, Copy)]
pub struct Binding<'a> {
    /// The account's bare JID.
    pub account: &'a str,
    /// The client's XEP-0388 `<user-agent id/>`.
    pub user_agent: &'a str,
    /// The mechanism the client asked the token for.
    pub mechanism: &'a str,
}

/// The token of a stored `nonce` with `binding`, keyed with the server's `secret`: what the
/// client received and now keys its HMACs with.
pub fn token(secret: &[u8], nonce: &[u8], binding: Binding<'_>) -> String {
    let parts = [
        nonce,
        binding.account.as_bytes(),
        binding.user_agent.as_bytes(),
        binding.mechanism.as_bytes(),
    ];
    B64URL.encode(derive(secret, b"presenced FAST token", &parts))
}

/// A value derived from a server secret: HMAC-SHA-256 keyed with `secret` over `label`,
/// then each part preceded by its length, so no two lists of parts share an input.
pub fn derive(secret: &[u8], label: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut m = hmac(secret, &[label]);
    for part in parts {
        m.update(&(part.len() as u64).to_be_bytes());
        m.update(part);
    }
    m.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    const BINDING: Binding<'static> = Binding {
        account: "alice@example.org",
        user_agent: "d4565fa7-4d72-4749-b3d3-740edbf87770",
        mechanism: HT_SHA_256_NONE,
    };

    #[test]
    fn the_initiator_message_is_authcid_nul_then_a_sha256_sized_hash() {
        let mut msg = b"alice\0".to_vec();
        msg.extend([7u8; 32]);
        let m = initiator_message(&msg).unwrap();
        assert_eq!(m.authcid, "alice");
        assert_eq!(m.hashed_token, vec![7u8; 32]);
        assert!(initiator_message(b"alice").is_none());
        assert!(initiator_message(b"\0xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx").is_none());
        let mut short = b"alice\0".to_vec();
        short.extend([7u8; 31]);
        assert!(initiator_message(&short).is_none());
    }

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn the_hashes_are_hmac_sha256_keyed_with_the_token() {
        // Computed independently: python3 -c "import hmac,hashlib; print(hmac.new(
        // b'secret-token', b'Initiator', hashlib.sha256).hexdigest())", and 'Responder'.
        let initiator = unhex("3f6de92b45cddc50c601ad166458f7b5874565e399f3006b1afb03f0bb03ff88");
        let responder_hash =
            unhex("5572a63e0496195609273c23be8a50b9bee64e0369324079e73245bf4472a5b1");
        assert!(initiator_matches("secret-token", &initiator));
        assert!(!initiator_matches("other-token", &initiator));
        assert!(!initiator_matches("secret-token", &responder_hash));
        assert_eq!(responder("secret-token"), responder_hash);
    }

    #[test]
    fn a_token_depends_on_the_secret_the_nonce_and_each_part_of_its_binding() {
        let t = token(b"secret", b"nonce", BINDING);
        assert_eq!(t, token(b"secret", b"nonce", BINDING));
        assert_ne!(t, token(b"other", b"nonce", BINDING));
        assert_ne!(t, token(b"secret", b"nonce2", BINDING));
        for other in [
            Binding {
                account: "bob@example.org",
                ..BINDING
            },
            Binding {
                user_agent: "another-client",
                ..BINDING
            },
            Binding {
                mechanism: "HT-SHA-256-EXPR",
                ..BINDING
            },
        ] {
            assert_ne!(t, token(b"secret", b"nonce", other));
        }
    }
}
