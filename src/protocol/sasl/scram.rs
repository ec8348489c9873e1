//! SCRAM-SHA-1 / SCRAM-SHA-256 (RFC 5802, RFC 7677), server side.
//!
//! Written directly on RustCrypto primitives because the server must accept the
//! standard `n,,` client-first that every XMPP client sends. The server never sees
//! a password: it works from [`StoredCredentials`] (salt, iteration count, StoredKey,
//! ServerKey), which is all the store keeps.
//!
//! Decisions worth knowing:
//! - Channel binding (`-PLUS`, RFC 5802 §6) is what the caller says it is for this
//!   connection ([`Binding`], see [`super::channel_binding`]): with none offered, `p=`
//!   fails and `y` is accepted; with a `-PLUS` mechanism offered, `y` is a downgrade and
//!   fails; with a `-PLUS` mechanism chosen, `c=` must carry the channel's binding data.
//! - XEP-0474 (0.5.0): given the lists the server advertised, server-first carries their
//!   hash in `h=` ([`ScramServer::with_downgrade_protection`]), which the client proof signs.
//! - An unknown user gets a server-first with a salt derived from the username and a
//!   secret the caller keeps across restarts (the server stores it in the database), and
//!   the iteration count real accounts use, so the exchange looks the same as for an
//!   existing account, today and after a restart, until the proof fails (RFC 5802 §9
//!   leaves this to the server; not revealing accounts is our choice). PLAIN derives
//!   against the same [`fake_credentials`] so it costs the same work either way.
//! - The username is returned decoded (`=2C`/`=3D`) but not otherwise prepared: the
//!   caller turns it into a JID localpart with the JID rules (RFC 7622), which is what
//!   it must match in the store.
//! - Passwords are SASLprep'd (RFC 4013). A password SASLprep rejects is used as its
//!   raw UTF-8 bytes, so PLAIN and SCRAM agree on it; the store refuses to set such
//!   passwords in the first place.

use std::borrow::Cow;
use std::sync::OnceLock;

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use rand::RngCore;
use sha1::Sha1;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::protocol::conditions::SaslCondition;
use crate::protocol::sasl::channel_binding::{self as cb, Binding, Gs2Error};

/// Salt length in bytes used for new credentials and for fake salts of unknown users,
/// so the two cannot be told apart by length.
pub const SALT_LEN: usize = 16;

/// Iteration count a [`ScramServer`] answers unknown users with unless told otherwise.
/// RFC 7677 §4 asks for at least 4096.
pub const DEFAULT_ITERATIONS: u32 = 4096;

/// Random bytes in the server's part of the nonce (RFC 5802 §5.1 `r=`).
const SERVER_NONCE_LEN: usize = 24;

/// The hash a SCRAM mechanism is built on. The store keeps one set of credentials per variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScramHash {
    /// SCRAM-SHA-1 (RFC 5802): still what many deployed clients use.
    Sha1,
    /// SCRAM-SHA-256 (RFC 7677): preferred.
    Sha256,
}

impl ScramHash {
    /// Every supported hash, strongest first: the order mechanisms are offered in.
    pub const ALL: [ScramHash; 2] = [ScramHash::Sha256, ScramHash::Sha1];

    /// The SASL mechanism name advertised in `<mechanisms/>` (RFC 6120 §6.4.1).
    pub fn mechanism(&self) -> &'static str {
        match self {
            ScramHash::Sha1 => "SCRAM-SHA-1",
            ScramHash::Sha256 => "SCRAM-SHA-256",
        }
    }

    /// The channel-binding variant's name (RFC 5802 §4: the name with `-PLUS`).
    pub fn plus_mechanism(&self) -> &'static str {
        match self {
            ScramHash::Sha1 => "SCRAM-SHA-1-PLUS",
            ScramHash::Sha256 => "SCRAM-SHA-256-PLUS",
        }
    }

    /// Maps any SCRAM mechanism name, `-PLUS` or not, to its hash and whether it binds.
    pub fn from_any_mechanism(name: &str) -> Option<(ScramHash, bool)> {
        match name.strip_suffix("-PLUS") {
            Some(base) => ScramHash::from_mechanism(base).map(|h| (h, true)),
            None => ScramHash::from_mechanism(name).map(|h| (h, false)),
        }
    }

    /// Maps a mechanism name chosen by the client back to the hash; None for anything else.
    pub fn from_mechanism(name: &str) -> Option<ScramHash> {
        match name {
            "SCRAM-SHA-1" => Some(ScramHash::Sha1),
            "SCRAM-SHA-256" => Some(ScramHash::Sha256),
            _ => None,
        }
    }

    /// Output length of the hash in bytes, which is also the length of keys and proofs.
    pub fn output_len(&self) -> usize {
        match self {
            ScramHash::Sha1 => 20,
            ScramHash::Sha256 => 32,
        }
    }

    fn hash(&self, data: &[u8]) -> Vec<u8> {
        match self {
            ScramHash::Sha1 => Sha1::digest(data).to_vec(),
            ScramHash::Sha256 => Sha256::digest(data).to_vec(),
        }
    }

    fn hmac(&self, key: &[u8], data: &[u8]) -> Vec<u8> {
        // HMAC is defined for keys of any length, so new_from_slice cannot fail.
        match self {
            ScramHash::Sha1 => {
                let mut mac = <Hmac<Sha1> as Mac>::new_from_slice(key)
                    .expect("HMAC accepts keys of any length");
                mac.update(data);
                mac.finalize().into_bytes().to_vec()
            }
            ScramHash::Sha256 => {
                let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key)
                    .expect("HMAC accepts keys of any length");
                mac.update(data);
                mac.finalize().into_bytes().to_vec()
            }
        }
    }

    /// RFC 5802 §2.2 Hi(): PBKDF2 with HMAC as the PRF and one output block.
    fn hi(&self, password: &[u8], salt: &[u8], iterations: u32) -> Vec<u8> {
        let mut out = vec![0u8; self.output_len()];
        match self {
            ScramHash::Sha1 => pbkdf2::pbkdf2_hmac::<Sha1>(password, salt, iterations, &mut out),
            ScramHash::Sha256 => {
                pbkdf2::pbkdf2_hmac::<Sha256>(password, salt, iterations, &mut out)
            }
        }
        out
    }
}

/// What the server keeps per account and mechanism (RFC 5802 §3): enough to verify a
/// proof and to prove itself, not enough to log in as the user elsewhere without the
/// password.
#[derive(Clone, PartialEq, Eq)]
pub struct StoredCredentials {
    /// Random salt given to PBKDF2; sent to the client in server-first.
    pub salt: Vec<u8>,
    /// PBKDF2 iteration count; sent to the client in server-first.
    pub iterations: u32,
    /// H(ClientKey): checks the client's proof.
    pub stored_key: Vec<u8>,
    /// HMAC(SaltedPassword, "Server Key"): signs server-final so the client can check us.
    pub server_key: Vec<u8>,
}

impl std::fmt::Debug for StoredCredentials {
    // Keys are secrets (the server key lets anyone impersonate the server to the user).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoredCredentials")
            .field("salt_len", &self.salt.len())
            .field("iterations", &self.iterations)
            .finish_non_exhaustive()
    }
}

/// RFC 4013 SASLprep of a password, falling back to the raw string when SASLprep
/// rejects it (see the module doc).
fn prepare_password(password: &str) -> Cow<'_, str> {
    stringprep::saslprep(password).unwrap_or(Cow::Borrowed(password))
}

/// Whether a password passes SASLprep (RFC 4013) and is not empty: the store only sets
/// passwords for which this holds, so every standard SCRAM client can use them.
pub fn password_is_preparable(password: &str) -> bool {
    matches!(stringprep::saslprep(password), Ok(p) if !p.is_empty())
}

/// Computes SaltedPassword, StoredKey and ServerKey for a password (RFC 5802 §3), for
/// account creation and password changes. An iteration count of 0 is raised to 1.
pub fn derive_credentials(
    hash: ScramHash,
    password: &str,
    salt: &[u8],
    iterations: u32,
) -> StoredCredentials {
    let iterations = iterations.max(1);
    let salted = hash.hi(prepare_password(password).as_bytes(), salt, iterations);
    let client_key = hash.hmac(&salted, b"Client Key");
    StoredCredentials {
        salt: salt.to_vec(),
        iterations,
        stored_key: hash.hash(&client_key),
        server_key: hash.hmac(&salted, b"Server Key"),
    }
}

/// Checks a SASL PLAIN password against stored SCRAM credentials, so PLAIN needs no
/// separate password hash. Compares in constant time.
pub fn verify_plain(hash: ScramHash, creds: &StoredCredentials, password: &str) -> bool {
    let salted = hash.hi(
        prepare_password(password).as_bytes(),
        &creds.salt,
        creds.iterations.max(1),
    );
    let stored_key = hash.hash(&hash.hmac(&salted, b"Client Key"));
    stored_key.ct_eq(&creds.stored_key).into()
}

/// Why a SCRAM exchange failed. [`ScramError::condition`] gives the RFC 6120 §6.5
/// condition to put in `<failure/>`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScramError {
    /// The message does not follow the RFC 5802 §7 grammar.
    #[error("malformed SCRAM message: {0}")]
    MalformedRequest(&'static str),
    /// The client asked for channel binding (`p=`) but no -PLUS mechanism is offered.
    #[error("channel binding requested but not supported")]
    ChannelBindingNotSupported,
    /// `p=` names a channel-binding type other than the one offered.
    #[error("unsupported channel binding type")]
    UnsupportedChannelBindingType,
    /// A -PLUS mechanism without `p=` in the gs2 header.
    #[error("a -PLUS mechanism requires channel binding")]
    ChannelBindingRequired,
    /// `y` although the server offered a -PLUS mechanism: someone removed it on the way.
    #[error("client thinks the server lacks channel binding, but it was offered")]
    ChannelBindingDowngrade,
    /// A mandatory extension (`m=`) was sent; RFC 5802 §5.1 says the server must fail.
    #[error("mandatory SCRAM extension not supported")]
    ExtensionsNotSupported,
    /// The `c=` of client-final does not repeat the gs2 header of client-first.
    #[error("channel binding data does not match")]
    ChannelBindingMismatch,
    /// The `r=` of client-final is not the nonce the server sent.
    #[error("nonce does not match")]
    NonceMismatch,
    /// Wrong password, unknown user, or a proof of the wrong length.
    #[error("invalid proof")]
    InvalidProof,
    /// A step was called out of order, or after the exchange had ended.
    #[error("unexpected SCRAM step")]
    UnexpectedStep,
}

impl ScramError {
    /// The RFC 6120 §6.5 SASL failure condition for this error.
    pub fn condition(&self) -> SaslCondition {
        match self {
            ScramError::MalformedRequest(_)
            | ScramError::ExtensionsNotSupported
            | ScramError::ChannelBindingRequired
            | ScramError::UnexpectedStep => SaslCondition::MalformedRequest,
            // §6.5.7: the client used a mechanism variant (-PLUS) we did not offer.
            ScramError::ChannelBindingNotSupported => SaslCondition::InvalidMechanism,
            // §6.5.10: authentication failed; tampering looks the same as a bad password.
            // RFC 5802 would say e=channel-bindings-dont-match, e=server-does-support-
            // channel-binding, e=unsupported-channel-binding-type; RFC 6120 has no closer
            // condition than not-authorized.
            ScramError::ChannelBindingMismatch
            | ScramError::ChannelBindingDowngrade
            | ScramError::UnsupportedChannelBindingType
            | ScramError::NonceMismatch
            | ScramError::InvalidProof => SaslCondition::NotAuthorized,
        }
    }
}

/// What client-first tells the server: who wants to log in, and as whom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientFirst {
    /// The authentication identity, `=2C`/`=3D` decoded; the caller maps it to a localpart.
    pub username: String,
    /// The authorization identity (`a=`), if the client sent one; the caller decides
    /// whether the user may act as it (RFC 6120 §6.3.8).
    pub authzid: Option<String>,
}

/// Where a [`ScramServer`] is in the exchange; each step moves it forward or to Failed.
enum State {
    /// Waiting for client-first.
    Initial,
    /// client-first parsed; waiting for the caller to look up credentials.
    GotClientFirst {
        /// What client-final's `c=` must decode to.
        cbind_input: Vec<u8>,
        client_first_bare: String,
        client_nonce: String,
        username: String,
    },
    /// server-first sent; waiting for client-final.
    SentServerFirst {
        cbind_input: Vec<u8>,
        client_first_bare: String,
        server_first: String,
        nonce: String,
        creds: StoredCredentials,
        /// True when `creds` are made up for an unknown user: the proof must fail.
        fake: bool,
    },
    /// Authenticated; nothing more to do.
    Done,
    /// An error was returned; the exchange cannot continue.
    Failed,
}

/// One SCRAM exchange on the server side. Create one per `<auth/>`, feed it the
/// client's messages in order, and send back what it returns.
pub struct ScramServer {
    /// Which SCRAM variant this exchange is.
    hash: ScramHash,
    /// Iteration count announced to unknown users; should equal the one accounts use.
    unknown_user_iterations: u32,
    /// Key for fake salts; None: a random per-process one (changes at restart).
    fake_salt_secret: Option<Vec<u8>>,
    /// Name the fake salt is derived from; None: the username as sent.
    fake_salt_name: Option<String>,
    /// Server part of the nonce: random, or fixed by tests.
    server_nonce: String,
    /// Channel binding on this connection for this mechanism.
    binding: Binding,
    /// XEP-0474 `h=` for server-first, when the caller gave the advertised lists.
    downgrade_hash: Option<String>,
    /// Progress of the exchange.
    state: State,
}

impl ScramServer {
    /// Starts an exchange for the mechanism the client chose.
    pub fn new(hash: ScramHash) -> Self {
        let mut bytes = [0u8; SERVER_NONCE_LEN];
        rand::thread_rng().fill_bytes(&mut bytes);
        // Base64 is printable and has no ',' so it is a valid nonce (RFC 5802 §7).
        Self::with_server_nonce(hash, BASE64.encode(bytes))
    }

    fn with_server_nonce(hash: ScramHash, server_nonce: String) -> Self {
        ScramServer {
            hash,
            unknown_user_iterations: DEFAULT_ITERATIONS,
            fake_salt_secret: None,
            fake_salt_name: None,
            server_nonce,
            binding: Binding::NotOffered,
            downgrade_hash: None,
            state: State::Initial,
        }
    }

    /// Sets what channel binding this connection offers for the chosen mechanism (RFC 5802
    /// §6); without it none is offered.
    pub fn with_channel_binding(mut self, binding: Binding) -> Self {
        self.binding = binding;
        self
    }

    /// XEP-0474 (0.5.0): server-first carries `h=`, the base64 hash (with this mechanism's
    /// hash function) of the advertised mechanisms and, when XEP-0440 advertised any, the
    /// channel-binding types ([`cb::downgrade_protection_input`]).
    pub fn with_downgrade_protection(
        mut self,
        mechanisms: &[&str],
        channel_bindings: Option<&[&str]>,
    ) -> Self {
        let input = cb::downgrade_protection_input(mechanisms, channel_bindings);
        self.downgrade_hash = Some(BASE64.encode(self.hash.hash(&input)));
        self
    }

    /// Sets the iteration count told to unknown users; pass the count real accounts are
    /// created with so the answer does not reveal whether an account exists.
    pub fn with_unknown_user_iterations(mut self, iterations: u32) -> Self {
        self.unknown_user_iterations = iterations.max(1);
        self
    }

    /// Sets the key fake salts of unknown users are derived from; pass one that persists
    /// across restarts (the store's) so they stay stable as real salts do.
    pub fn with_fake_salt_secret(mut self, secret: &[u8]) -> Self {
        self.fake_salt_secret = Some(secret.to_vec());
        self
    }

    /// Derives a fake salt from `name` instead of the username as sent: pass the
    /// normalised account name, so spellings that reach one real account (and its one
    /// salt) also share one fake salt, and comparing them reveals nothing.
    pub fn set_fake_salt_name(&mut self, name: &str) {
        self.fake_salt_name = Some(name.to_owned());
    }

    /// Test constructor with a fixed server nonce, to replay the RFC example exchanges.
    #[cfg(test)]
    pub(crate) fn with_fixed_nonce(hash: ScramHash, server_nonce: &str) -> Self {
        Self::with_server_nonce(hash, server_nonce.to_owned())
    }

    /// The mechanism this exchange runs.
    pub fn hash(&self) -> ScramHash {
        self.hash
    }

    /// Parses client-first (RFC 5802 §7): gs2 header `n,,` or `y,,` (optionally with
    /// `a=authzid`), then `n=username,r=nonce`. Returns who is logging in.
    pub fn client_first(&mut self, msg: &[u8]) -> Result<ClientFirst, ScramError> {
        if !matches!(self.state, State::Initial) {
            self.state = State::Failed;
            return Err(ScramError::UnexpectedStep);
        }
        match parse_client_first(msg, &self.binding) {
            Ok((parsed, state)) => {
                self.state = state;
                Ok(parsed)
            }
            Err(e) => {
                self.state = State::Failed;
                Err(e)
            }
        }
    }

    /// Builds server-first `r=...,s=...,i=...`. With `creds` None (unknown user) it
    /// answers with a salt derived from the username so the reply looks like a real one;
    /// the exchange then fails at [`ScramServer::client_final`].
    pub fn server_first(&mut self, creds: Option<&StoredCredentials>) -> Vec<u8> {
        let state = std::mem::replace(&mut self.state, State::Failed);
        let State::GotClientFirst {
            cbind_input,
            client_first_bare,
            client_nonce,
            username,
        } = state
        else {
            // Misuse by the caller: the state stays Failed and client_final will refuse.
            return Vec::new();
        };
        let (creds, fake) = match creds {
            Some(c) => (c.clone(), false),
            None => (self.fake_credentials(&username), true),
        };
        let nonce = format!("{client_nonce}{}", self.server_nonce);
        let mut server_first = format!(
            "r={nonce},s={},i={}",
            BASE64.encode(&creds.salt),
            creds.iterations
        );
        if let Some(h) = &self.downgrade_hash {
            // RFC 5802 §7: extensions follow the iteration count.
            server_first.push_str(",h=");
            server_first.push_str(h);
        }
        let out = server_first.clone().into_bytes();
        self.state = State::SentServerFirst {
            cbind_input,
            client_first_bare,
            server_first,
            nonce,
            creds,
            fake,
        };
        out
    }

    /// Credentials for a user that does not exist (see [`fake_credentials`]).
    fn fake_credentials(&self, username: &str) -> StoredCredentials {
        let secret = match &self.fake_salt_secret {
            Some(s) => s.as_slice(),
            None => process_secret(),
        };
        let name = self.fake_salt_name.as_deref().unwrap_or(username);
        fake_credentials(self.hash, name, secret, self.unknown_user_iterations)
    }

    /// Verifies client-final `c=...,r=...,p=...` (channel-binding echo, nonce, proof)
    /// and returns server-final `v=...` on success.
    pub fn client_final(&mut self, msg: &[u8]) -> Result<Vec<u8>, ScramError> {
        let state = std::mem::replace(&mut self.state, State::Failed);
        let State::SentServerFirst {
            cbind_input,
            client_first_bare,
            server_first,
            nonce,
            creds,
            fake,
        } = state
        else {
            return Err(ScramError::UnexpectedStep);
        };
        let msg = std::str::from_utf8(msg)
            .map_err(|_| ScramError::MalformedRequest("client-final is not UTF-8"))?;
        let (without_proof, proof_attr) = msg
            .rsplit_once(',')
            .ok_or(ScramError::MalformedRequest("client-final has no proof"))?;
        let proof = proof_attr
            .strip_prefix("p=")
            .ok_or(ScramError::MalformedRequest(
                "client-final must end with p=",
            ))?;
        let proof = BASE64
            .decode(proof)
            .map_err(|_| ScramError::MalformedRequest("proof is not base64"))?;

        let mut attrs = without_proof.split(',');
        let cbind =
            attrs
                .next()
                .and_then(|a| a.strip_prefix("c="))
                .ok_or(ScramError::MalformedRequest(
                    "client-final must start with c=",
                ))?;
        let cbind = BASE64
            .decode(cbind)
            .map_err(|_| ScramError::MalformedRequest("channel binding is not base64"))?;
        let client_nonce = attrs
            .next()
            .and_then(|a| a.strip_prefix("r="))
            .ok_or(ScramError::MalformedRequest("client-final lacks r="))?;
        for ext in attrs {
            check_extension(ext)?;
        }
        // RFC 5802 §7: c= carries the gs2 header, then with -PLUS the channel's binding data.
        if !bool::from(cbind.ct_eq(&cbind_input)) {
            return Err(ScramError::ChannelBindingMismatch);
        }
        if client_nonce != nonce {
            return Err(ScramError::NonceMismatch);
        }

        // RFC 5802 §3: AuthMessage, ClientSignature, ClientKey = proof XOR signature.
        let auth_message = format!("{client_first_bare},{server_first},{without_proof}");
        let hash = self.hash;
        if proof.len() != hash.output_len() {
            return Err(ScramError::InvalidProof);
        }
        let client_signature = hash.hmac(&creds.stored_key, auth_message.as_bytes());
        let client_key: Vec<u8> = proof
            .iter()
            .zip(&client_signature)
            .map(|(p, s)| p ^ s)
            .collect();
        let matches: bool = hash.hash(&client_key).ct_eq(&creds.stored_key).into();
        if !matches || fake {
            return Err(ScramError::InvalidProof);
        }
        let server_signature = hash.hmac(&creds.server_key, auth_message.as_bytes());
        self.state = State::Done;
        Ok(format!("v={}", BASE64.encode(server_signature)).into_bytes())
    }
}

impl From<Gs2Error> for ScramError {
    fn from(e: Gs2Error) -> Self {
        match e {
            Gs2Error::Malformed(why) => ScramError::MalformedRequest(why),
            Gs2Error::NotSupported => ScramError::ChannelBindingNotSupported,
            Gs2Error::UnsupportedType => ScramError::UnsupportedChannelBindingType,
            Gs2Error::BindingRequired => ScramError::ChannelBindingRequired,
            Gs2Error::Downgrade => ScramError::ChannelBindingDowngrade,
        }
    }
}

/// Credentials for a user that does not exist, so the server can answer exactly as for
/// a real one: a salt derived with HMAC from `secret` and the username (the same at every
/// start when the secret persists, different per user, unpredictable without the secret),
/// the iteration count real accounts get, and random keys no proof or password can match.
/// SCRAM announces them; PLAIN derives against them so an unknown user costs the same
/// PBKDF2 work as a real one.
pub fn fake_credentials(
    hash: ScramHash,
    username: &str,
    secret: &[u8],
    iterations: u32,
) -> StoredCredentials {
    let mut data = Vec::with_capacity(username.len() + 16);
    data.extend_from_slice(hash.mechanism().as_bytes());
    data.push(0);
    data.extend_from_slice(username.as_bytes());
    let mut salt = ScramHash::Sha256.hmac(secret, &data);
    salt.truncate(SALT_LEN);
    let mut stored_key = vec![0u8; hash.output_len()];
    let mut server_key = vec![0u8; hash.output_len()];
    rand::thread_rng().fill_bytes(&mut stored_key);
    rand::thread_rng().fill_bytes(&mut server_key);
    StoredCredentials {
        salt,
        iterations: iterations.max(1),
        stored_key,
        server_key,
    }
}

/// Fallback secret for fake salts when the caller gives none: random per process.
fn process_secret() -> &'static [u8] {
    static SECRET: OnceLock<[u8; 32]> = OnceLock::new();
    SECRET.get_or_init(|| {
        let mut s = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut s);
        s
    })
}

fn parse_client_first(msg: &[u8], binding: &Binding) -> Result<(ClientFirst, State), ScramError> {
    let msg = std::str::from_utf8(msg)
        .map_err(|_| ScramError::MalformedRequest("client-first is not UTF-8"))?;
    let (gs2, bare) = cb::split_client_first(msg)?;
    binding.check(&gs2.flag)?;
    let authzid = gs2.authzid.as_deref().map(decode_saslname).transpose()?;
    let cbind_input = binding.cbind_input(&gs2.raw);

    let mut attrs = bare.split(',');
    let first = attrs.next().unwrap_or_default();
    if first.starts_with("m=") {
        return Err(ScramError::ExtensionsNotSupported);
    }
    let username = first
        .strip_prefix("n=")
        .ok_or(ScramError::MalformedRequest("client-first lacks n="))?;
    let username = decode_saslname(username)?;
    let client_nonce = attrs
        .next()
        .and_then(|a| a.strip_prefix("r="))
        .ok_or(ScramError::MalformedRequest("client-first lacks r="))?;
    // RFC 5802 §7: printable = %x21-2B / %x2D-7E, at least one.
    if client_nonce.is_empty()
        || !client_nonce
            .bytes()
            .all(|b| (0x21..=0x7e).contains(&b) && b != b',')
    {
        return Err(ScramError::MalformedRequest("bad client nonce"));
    }
    for ext in attrs {
        check_extension(ext)?;
    }
    Ok((
        ClientFirst {
            username: username.clone(),
            authzid,
        },
        State::GotClientFirst {
            cbind_input,
            client_first_bare: bare.to_owned(),
            client_nonce: client_nonce.to_owned(),
            username,
        },
    ))
}

/// Optional extensions (RFC 5802 §7 `attr-val`) are ignored, but must be well formed.
fn check_extension(ext: &str) -> Result<(), ScramError> {
    let mut chars = ext.chars();
    match (chars.next(), chars.next()) {
        (Some(a), Some('=')) if a.is_ascii_alphabetic() => Ok(()),
        _ => Err(ScramError::MalformedRequest("bad attribute")),
    }
}

/// RFC 5802 §5.1 saslname: `=2C` is ',', `=3D` is '=', any other '=' is an error, and
/// the name is not empty.
fn decode_saslname(s: &str) -> Result<String, ScramError> {
    if s.is_empty() {
        return Err(ScramError::MalformedRequest("empty name"));
    }
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(pos) = rest.find('=') {
        out.push_str(&rest[..pos]);
        let escape = rest.get(pos..pos + 3);
        match escape {
            Some("=2C") => out.push(','),
            Some("=3D") => out.push('='),
            _ => return Err(ScramError::MalformedRequest("bad name encoding")),
        }
        rest = &rest[pos + 3..];
    }
    out.push_str(rest);
    if out.contains('\0') {
        return Err(ScramError::MalformedRequest("NUL in name"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Minimal SCRAM client (RFC 5802 §3), the other half of the round trips below.
    struct Client {
        hash: ScramHash,
        password: String,
        gs2_header: String,
        /// Channel-binding data sent after the gs2 header in `c=` (empty without -PLUS).
        cb_data: Vec<u8>,
        client_first_bare: String,
        client_nonce: String,
        server_signature: Vec<u8>,
    }

    fn encode_saslname(s: &str) -> String {
        s.replace('=', "=3D").replace(',', "=2C")
    }

    impl Client {
        fn new(hash: ScramHash, username: &str, password: &str, authzid: Option<&str>) -> Self {
            let mut nonce = [0u8; 18];
            rand::thread_rng().fill_bytes(&mut nonce);
            let client_nonce = BASE64.encode(nonce);
            let gs2_header = match authzid {
                Some(a) => format!("n,a={},", encode_saslname(a)),
                None => "n,,".to_owned(),
            };
            Client {
                hash,
                password: password.to_owned(),
                gs2_header,
                cb_data: Vec::new(),
                client_first_bare: format!("n={},r={client_nonce}", encode_saslname(username)),
                client_nonce,
                server_signature: Vec::new(),
            }
        }

        fn first(&self) -> Vec<u8> {
            format!("{}{}", self.gs2_header, self.client_first_bare).into_bytes()
        }

        fn final_message(&mut self, server_first: &[u8]) -> Vec<u8> {
            let sf = std::str::from_utf8(server_first).unwrap();
            let mut nonce = "";
            let mut salt = Vec::new();
            let mut iterations = 0;
            for attr in sf.split(',') {
                let (k, v) = attr.split_once('=').unwrap();
                match k {
                    "r" => nonce = v,
                    "s" => salt = BASE64.decode(v).unwrap(),
                    "i" => iterations = v.parse().unwrap(),
                    _ => {}
                }
            }
            assert!(nonce.starts_with(&self.client_nonce));
            let h = self.hash;
            let salted = h.hi(
                stringprep::saslprep(&self.password).unwrap().as_bytes(),
                &salt,
                iterations,
            );
            let client_key = h.hmac(&salted, b"Client Key");
            let stored_key = h.hash(&client_key);
            let mut cbind_input = self.gs2_header.as_bytes().to_vec();
            cbind_input.extend_from_slice(&self.cb_data);
            let without_proof = format!("c={},r={nonce}", BASE64.encode(cbind_input));
            let auth_message = format!("{},{sf},{without_proof}", self.client_first_bare);
            let signature = h.hmac(&stored_key, auth_message.as_bytes());
            let proof: Vec<u8> = client_key
                .iter()
                .zip(&signature)
                .map(|(a, b)| a ^ b)
                .collect();
            let server_key = h.hmac(&salted, b"Server Key");
            self.server_signature = h.hmac(&server_key, auth_message.as_bytes());
            format!("{without_proof},p={}", BASE64.encode(proof)).into_bytes()
        }

        fn verify_server(&self, server_final: &[u8]) -> bool {
            server_final == format!("v={}", BASE64.encode(&self.server_signature)).as_bytes()
        }
    }

    /// Runs a whole exchange; returns the server's verdict and whether the client
    /// accepted server-final.
    fn run(
        hash: ScramHash,
        stored: Option<&StoredCredentials>,
        username: &str,
        password: &str,
        authzid: Option<&str>,
    ) -> (Result<ClientFirst, ScramError>, Result<bool, ScramError>) {
        let mut client = Client::new(hash, username, password, authzid);
        let mut server = ScramServer::new(hash);
        let first = server.client_first(&client.first());
        let server_first = server.server_first(stored);
        let client_final = client.final_message(&server_first);
        let result = server
            .client_final(&client_final)
            .map(|sf| client.verify_server(&sf));
        (first, result)
    }

    #[test]
    fn rfc5802_sha1_example_exchange() {
        let salt = BASE64.decode("QSXCR+Q6sek8bf92").unwrap();
        let creds = derive_credentials(ScramHash::Sha1, "pencil", &salt, 4096);
        let mut server = ScramServer::with_fixed_nonce(ScramHash::Sha1, "3rfcNHYJY1ZVvWVs7j");
        let first = server
            .client_first(b"n,,n=user,r=fyko+d2lbbFgONRv9qkxdawL")
            .unwrap();
        assert_eq!(first.username, "user");
        assert_eq!(first.authzid, None);
        assert_eq!(
            server.server_first(Some(&creds)),
            b"r=fyko+d2lbbFgONRv9qkxdawL3rfcNHYJY1ZVvWVs7j,s=QSXCR+Q6sek8bf92,i=4096"
        );
        let server_final = server
            .client_final(
                b"c=biws,r=fyko+d2lbbFgONRv9qkxdawL3rfcNHYJY1ZVvWVs7j,p=v0X8v3Bz2T0CJGbJQyF0X+HI4Ts=",
            )
            .unwrap();
        assert_eq!(server_final, b"v=rmF9pqV8S7suAoZWja4dJRkFsKQ=");
    }

    #[test]
    fn rfc7677_sha256_example_exchange() {
        let salt = BASE64.decode("W22ZaJ0SNY7soEsUEjb6gQ==").unwrap();
        let creds = derive_credentials(ScramHash::Sha256, "pencil", &salt, 4096);
        let mut server =
            ScramServer::with_fixed_nonce(ScramHash::Sha256, "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0");
        server
            .client_first(b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO")
            .unwrap();
        assert_eq!(
            server.server_first(Some(&creds)),
            b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
        );
        let server_final = server
            .client_final(
                b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=",
            )
            .unwrap();
        assert_eq!(
            server_final,
            b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="
        );
    }

    #[test]
    fn rfc5802_example_with_wrong_stored_password_is_not_authorized() {
        let salt = BASE64.decode("QSXCR+Q6sek8bf92").unwrap();
        let creds = derive_credentials(ScramHash::Sha1, "pencil2", &salt, 4096);
        let mut server = ScramServer::with_fixed_nonce(ScramHash::Sha1, "3rfcNHYJY1ZVvWVs7j");
        server
            .client_first(b"n,,n=user,r=fyko+d2lbbFgONRv9qkxdawL")
            .unwrap();
        server.server_first(Some(&creds));
        let err = server
            .client_final(
                b"c=biws,r=fyko+d2lbbFgONRv9qkxdawL3rfcNHYJY1ZVvWVs7j,p=v0X8v3Bz2T0CJGbJQyF0X+HI4Ts=",
            )
            .unwrap_err();
        assert_eq!(err, ScramError::InvalidProof);
        assert_eq!(err.condition(), SaslCondition::NotAuthorized);
    }

    #[test]
    fn round_trip_succeeds_for_both_hashes_and_client_verifies_server() {
        for hash in ScramHash::ALL {
            let creds = derive_credentials(hash, "s3cr\u{e9}t pass", b"0123456789abcdef", 4096);
            let (first, result) = run(hash, Some(&creds), "juliet", "s3cr\u{e9}t pass", None);
            assert_eq!(first.unwrap().username, "juliet");
            assert_eq!(result, Ok(true), "{hash:?}");
        }
    }

    #[test]
    fn round_trip_decodes_escaped_username_and_authzid() {
        let creds = derive_credentials(ScramHash::Sha256, "pw", b"saltsaltsaltsalt", 4096);
        let (first, result) = run(
            ScramHash::Sha256,
            Some(&creds),
            "we,ird=name",
            "pw",
            Some("admin@example.org"),
        );
        let first = first.unwrap();
        assert_eq!(first.username, "we,ird=name");
        assert_eq!(first.authzid.as_deref(), Some("admin@example.org"));
        assert_eq!(result, Ok(true));
    }

    #[test]
    fn wrong_password_is_invalid_proof() {
        for hash in ScramHash::ALL {
            let creds = derive_credentials(hash, "right", b"0123456789abcdef", 4096);
            let (_, result) = run(hash, Some(&creds), "romeo", "wrong", None);
            assert_eq!(result, Err(ScramError::InvalidProof));
        }
    }

    #[test]
    fn password_is_saslprepped_so_equivalent_forms_match() {
        // RFC 4013 §3 examples: soft hyphen maps to nothing, U+00AA normalises to "a".
        let creds = derive_credentials(ScramHash::Sha256, "IX", b"0123456789abcdef", 4096);
        let (_, result) = run(ScramHash::Sha256, Some(&creds), "u", "I\u{00AD}X", None);
        assert_eq!(result, Ok(true));
        assert!(verify_plain(ScramHash::Sha256, &creds, "I\u{00AD}X"));
        let creds = derive_credentials(ScramHash::Sha1, "\u{00AA}", b"0123456789abcdef", 4096);
        assert!(verify_plain(ScramHash::Sha1, &creds, "a"));
    }

    #[test]
    fn verify_plain_accepts_right_and_rejects_wrong_password() {
        for hash in ScramHash::ALL {
            let creds = derive_credentials(hash, "pencil", b"0123456789abcdef", 4096);
            assert!(verify_plain(hash, &creds, "pencil"));
            assert!(!verify_plain(hash, &creds, "pencil "));
            assert!(!verify_plain(hash, &creds, ""));
        }
    }

    #[test]
    fn unknown_user_gets_stable_fake_salt_and_fails_even_with_any_password() {
        let mut a = ScramServer::new(ScramHash::Sha256).with_unknown_user_iterations(10000);
        a.client_first(b"n,,n=ghost,r=abc").unwrap();
        let sf_a = String::from_utf8(a.server_first(None)).unwrap();
        let mut b = ScramServer::new(ScramHash::Sha256).with_unknown_user_iterations(10000);
        b.client_first(b"n,,n=ghost,r=abc").unwrap();
        let sf_b = String::from_utf8(b.server_first(None)).unwrap();
        let mut c = ScramServer::new(ScramHash::Sha256).with_unknown_user_iterations(10000);
        c.client_first(b"n,,n=other,r=abc").unwrap();
        let sf_c = String::from_utf8(c.server_first(None)).unwrap();

        let salt = |sf: &str| sf.split(',').nth(1).unwrap().to_owned();
        assert_eq!(salt(&sf_a), salt(&sf_b), "same user, same salt");
        assert_ne!(salt(&sf_a), salt(&sf_c), "different users, different salts");
        let decoded = BASE64.decode(&salt(&sf_a)[2..]).unwrap();
        assert_eq!(decoded.len(), SALT_LEN);
        assert!(sf_a.ends_with(",i=10000"));

        let (_, result) = run(ScramHash::Sha1, None, "ghost", "anything", None);
        assert_eq!(result, Err(ScramError::InvalidProof));
    }

    #[test]
    fn fake_credentials_follow_the_secret_and_the_iterations_and_match_no_password() {
        let fake =
            |user: &str, secret: &[u8]| fake_credentials(ScramHash::Sha256, user, secret, 12_345);
        let a = fake("ghost", b"secret one");
        assert_eq!(a.salt, fake("ghost", b"secret one").salt, "stable");
        assert_ne!(a.salt, fake("other", b"secret one").salt, "per user");
        assert_ne!(a.salt, fake("ghost", b"secret two").salt, "per secret");
        assert_eq!(a.salt.len(), SALT_LEN);
        assert_eq!(a.iterations, 12_345);
        for pw in ["", "pw", "ghost"] {
            assert!(!verify_plain(ScramHash::Sha256, &a, pw));
        }
        // A server given the secret announces the same salt.
        let mut server = ScramServer::new(ScramHash::Sha256)
            .with_unknown_user_iterations(12_345)
            .with_fake_salt_secret(b"secret one");
        server.client_first(b"n,,n=ghost,r=abc").unwrap();
        let sf = String::from_utf8(server.server_first(None)).unwrap();
        assert!(
            sf.ends_with(&format!(",s={},i=12345", BASE64.encode(&a.salt))),
            "{sf}"
        );
    }

    #[test]
    fn malformed_client_first_is_rejected_with_the_right_error() {
        use ScramError::*;
        let cases: &[(&[u8], ScramError)] = &[
            (b"", MalformedRequest("missing gs2 header")),
            (b"n,,", MalformedRequest("client-first lacks n=")),
            (
                b"x,,n=user,r=abc",
                MalformedRequest("bad gs2 channel binding flag"),
            ),
            (b"p=tls-unique,,n=user,r=abc", ChannelBindingNotSupported),
            (
                b"n,b=user,n=user,r=abc",
                MalformedRequest("bad gs2 authzid"),
            ),
            (b"n,a=,n=user,r=abc", MalformedRequest("empty name")),
            (b"n,,m=foo,n=user,r=abc", ExtensionsNotSupported),
            (b"n,,n=user", MalformedRequest("client-first lacks r=")),
            (
                b"n,,r=abc,n=user",
                MalformedRequest("client-first lacks n="),
            ),
            (b"n,,n=,r=abc", MalformedRequest("empty name")),
            (
                b"n,,n=us=2Cer=,r=abc",
                MalformedRequest("bad name encoding"),
            ),
            (b"n,,n=us=2cer,r=abc", MalformedRequest("bad name encoding")),
            (b"n,,n=user,r=", MalformedRequest("bad client nonce")),
            (b"n,,n=user,r=a b", MalformedRequest("bad client nonce")),
            (b"n,,n=user,r=abc,,", MalformedRequest("bad attribute")),
            (
                b"n,,n=us\xffer,r=abc",
                MalformedRequest("client-first is not UTF-8"),
            ),
        ];
        for (msg, want) in cases {
            let mut server = ScramServer::new(ScramHash::Sha256);
            let got = server.client_first(msg);
            assert_eq!(
                got.as_ref().err(),
                Some(want),
                "{}",
                String::from_utf8_lossy(msg)
            );
            // A failed exchange stays failed.
            assert_eq!(
                server.client_final(b"c=biws,r=x,p=AA=="),
                Err(UnexpectedStep)
            );
        }
        assert_eq!(
            ChannelBindingNotSupported.condition(),
            SaslCondition::InvalidMechanism
        );
        assert_eq!(
            MalformedRequest("x").condition(),
            SaslCondition::MalformedRequest
        );
    }

    #[test]
    fn y_flag_and_extensions_are_accepted_in_client_first() {
        let mut server = ScramServer::new(ScramHash::Sha1);
        let first = server.client_first(b"y,,n=user,r=abc,x=ignored").unwrap();
        assert_eq!(first.username, "user");
    }

    /// Server that has answered client-first `n,,n=user,r=abc` for password "pw".
    fn server_after_first(hash: ScramHash, gs2: &str) -> (ScramServer, String) {
        let creds = derive_credentials(hash, "pw", b"0123456789abcdef", 4096);
        let mut server = ScramServer::with_fixed_nonce(hash, "SRV");
        server
            .client_first(format!("{gs2}n=user,r=abc").as_bytes())
            .unwrap();
        let sf = String::from_utf8(server.server_first(Some(&creds))).unwrap();
        (server, sf)
    }

    #[test]
    fn malformed_or_tampered_client_final_is_rejected() {
        use ScramError::*;
        let proof20 = BASE64.encode([0u8; 20]);
        let cases: Vec<(String, ScramError)> = vec![
            ("".into(), MalformedRequest("client-final has no proof")),
            (
                "c=biws,r=abcSRV".into(),
                MalformedRequest("client-final must end with p="),
            ),
            (
                "c=biws,r=abcSRV,p=!!".into(),
                MalformedRequest("proof is not base64"),
            ),
            (
                format!("r=abcSRV,p={proof20}"),
                MalformedRequest("client-final must start with c="),
            ),
            (
                format!("c=biws,p={proof20}"),
                MalformedRequest("client-final lacks r="),
            ),
            (
                format!("c=b!ws,r=abcSRV,p={proof20}"),
                MalformedRequest("channel binding is not base64"),
            ),
            // c= says "y,," though client-first said "n,,": a downgrade attempt.
            (
                format!("c=eSws,r=abcSRV,p={proof20}"),
                ChannelBindingMismatch,
            ),
            (format!("c=biws,r=abcXXX,p={proof20}"), NonceMismatch),
            (
                format!("c=biws,r=abcSRV,p={}", BASE64.encode([0u8; 19])),
                InvalidProof,
            ),
            (format!("c=biws,r=abcSRV,p={proof20}"), InvalidProof),
        ];
        for (msg, want) in cases {
            let (mut server, _) = server_after_first(ScramHash::Sha1, "n,,");
            assert_eq!(server.client_final(msg.as_bytes()), Err(want), "{msg}");
        }
        assert_eq!(NonceMismatch.condition(), SaslCondition::NotAuthorized);
    }

    #[test]
    fn steps_out_of_order_fail() {
        let mut server = ScramServer::new(ScramHash::Sha256);
        assert_eq!(
            server.client_final(b"c=biws,r=abc,p=AA=="),
            Err(ScramError::UnexpectedStep)
        );
        let mut server = ScramServer::new(ScramHash::Sha256);
        assert!(server.server_first(None).is_empty());

        // A completed exchange cannot be replayed on the same server.
        let (mut server, sf) = server_after_first(ScramHash::Sha256, "n,,");
        let mut client = Client::new(ScramHash::Sha256, "user", "pw", None);
        client.client_nonce = "abc".into();
        client.client_first_bare = "n=user,r=abc".into();
        let cf = client.final_message(sf.as_bytes());
        assert!(server.client_final(&cf).is_ok());
        assert_eq!(server.client_final(&cf), Err(ScramError::UnexpectedStep));
        assert_eq!(
            server.client_first(b"n,,n=user,r=abc"),
            Err(ScramError::UnexpectedStep)
        );
    }

    #[test]
    fn mechanism_names_round_trip() {
        for hash in ScramHash::ALL {
            assert_eq!(ScramHash::from_mechanism(hash.mechanism()), Some(hash));
        }
        assert_eq!(ScramHash::from_mechanism("SCRAM-SHA-1-PLUS"), None);
        assert!(password_is_preparable("pencil"));
        assert!(!password_is_preparable(""));
        assert!(!password_is_preparable("a\u{0007}b"));
    }

    fn exporter(byte: u8) -> Binding {
        Binding::Required {
            cb_type: cb::TLS_EXPORTER,
            data: vec![byte; 32],
        }
    }

    /// A whole exchange against a server with `binding`, the client sending `gs2` and
    /// binding `cb_data`.
    fn run_bound(
        hash: ScramHash,
        binding: Binding,
        gs2: &str,
        cb_data: &[u8],
    ) -> Result<bool, ScramError> {
        let creds = derive_credentials(hash, "pw", b"0123456789abcdef", 4096);
        let mut client = Client::new(hash, "user", "pw", None);
        client.gs2_header = gs2.to_owned();
        client.cb_data = cb_data.to_vec();
        let mut server = ScramServer::new(hash).with_channel_binding(binding);
        server.client_first(&client.first())?;
        let sf = server.server_first(Some(&creds));
        let cf = client.final_message(&sf);
        server.client_final(&cf).map(|v| client.verify_server(&v))
    }

    #[test]
    fn plus_succeeds_only_with_the_channels_binding_data() {
        for hash in ScramHash::ALL {
            let right = run_bound(hash, exporter(7), "p=tls-exporter,,", &[7; 32]);
            assert_eq!(right, Ok(true), "{hash:?}");
            let wrong = run_bound(hash, exporter(7), "p=tls-exporter,,", &[8; 32]);
            assert_eq!(wrong, Err(ScramError::ChannelBindingMismatch));
            // The gs2 header alone in c=, as a client not binding would send it.
            let missing = run_bound(hash, exporter(7), "p=tls-exporter,,", &[]);
            assert_eq!(missing, Err(ScramError::ChannelBindingMismatch));
        }
        assert_eq!(
            ScramError::ChannelBindingMismatch.condition(),
            SaslCondition::NotAuthorized
        );
    }

    #[test]
    fn plus_refuses_other_types_and_unbound_flags() {
        let h = ScramHash::Sha256;
        assert_eq!(
            run_bound(h, exporter(1), "p=tls-unique,,", &[1; 32]),
            Err(ScramError::UnsupportedChannelBindingType)
        );
        for gs2 in ["n,,", "y,,"] {
            assert_eq!(
                run_bound(h, exporter(1), gs2, &[]),
                Err(ScramError::ChannelBindingRequired)
            );
        }
        assert_eq!(
            ScramError::UnsupportedChannelBindingType.condition(),
            SaslCondition::NotAuthorized
        );
    }

    #[test]
    fn y_is_a_downgrade_only_when_plus_was_offered() {
        let h = ScramHash::Sha1;
        assert_eq!(
            run_bound(h, Binding::Offered, "y,,", &[]),
            Err(ScramError::ChannelBindingDowngrade)
        );
        assert_eq!(
            ScramError::ChannelBindingDowngrade.condition(),
            SaslCondition::NotAuthorized
        );
        assert_eq!(run_bound(h, Binding::Offered, "n,,", &[]), Ok(true));
        assert_eq!(run_bound(h, Binding::NotOffered, "y,,", &[]), Ok(true));
        assert_eq!(
            run_bound(h, Binding::Offered, "p=tls-exporter,,", &[]),
            Err(ScramError::ChannelBindingNotSupported)
        );
    }

    /// The lists a TLS 1.3 connection with PLAIN allowed advertises.
    const ADVERTISED: [&str; 5] = [
        "SCRAM-SHA-256-PLUS",
        "SCRAM-SHA-1-PLUS",
        "SCRAM-SHA-256",
        "SCRAM-SHA-1",
        "PLAIN",
    ];

    fn h_attr(server_first: &[u8]) -> Option<String> {
        std::str::from_utf8(server_first)
            .unwrap()
            .split(',')
            .find_map(|a| a.strip_prefix("h="))
            .map(str::to_owned)
    }

    #[test]
    fn server_first_carries_the_xep_0474_hash_of_the_advertised_lists() {
        // Expected values computed independently (Python's hashlib over
        // b"PLAIN\x1eSCRAM-SHA-1\x1eSCRAM-SHA-1-PLUS\x1eSCRAM-SHA-256\x1eSCRAM-SHA-256-PLUS\x1ftls-exporter").
        let cases = [
            (
                ScramHash::Sha256,
                "HOCahVXz+V8p+Esg88C95qG5k09nEAJUDMu7QMK43gY=",
            ),
            (ScramHash::Sha1, "hop3N83xH2iyA6y2T5aMBtq/Wjo="),
        ];
        for (hash, want) in cases {
            let mut server = ScramServer::new(hash)
                .with_downgrade_protection(&ADVERTISED, Some(&[cb::TLS_EXPORTER]));
            server.client_first(b"n,,n=user,r=abc").unwrap();
            let sf = server.server_first(None);
            assert_eq!(h_attr(&sf).as_deref(), Some(want), "{hash:?}");
            assert!(String::from_utf8(sf).unwrap().contains(",i=4096,h="));
        }
        // Without XEP-0440 lists there is no 0x1F part: SHA-256 of
        // b"SCRAM-SHA-1\x1eSCRAM-SHA-256".
        let mut server = ScramServer::new(ScramHash::Sha256)
            .with_downgrade_protection(&["SCRAM-SHA-256", "SCRAM-SHA-1"], None);
        server.client_first(b"n,,n=user,r=abc").unwrap();
        assert_eq!(
            h_attr(&server.server_first(None)).as_deref(),
            Some("0/NIECGLXv63MqTb7NyUI9Tqxi40YVZyx61umRrH924=")
        );
        // XEP-0474's own example: SHA-1 of its lists.
        let mut server = ScramServer::new(ScramHash::Sha1).with_downgrade_protection(
            &["SCRAM-SHA-1", "SCRAM-SHA-1-PLUS"],
            Some(&["tls-exporter", "tls-server-end-point"]),
        );
        server.client_first(b"n,,n=user,r=abc").unwrap();
        assert_eq!(
            h_attr(&server.server_first(None)).as_deref(),
            Some("G6k/rBLDqgOhRRaCuuatSDFkJ08=")
        );
        // No lists given: no h=.
        let mut server = ScramServer::new(ScramHash::Sha1);
        server.client_first(b"n,,n=user,r=abc").unwrap();
        assert_eq!(h_attr(&server.server_first(None)), None);
    }

    #[test]
    fn the_client_proof_signs_the_hash_so_the_exchange_still_succeeds() {
        for hash in ScramHash::ALL {
            let creds = derive_credentials(hash, "pw", b"0123456789abcdef", 4096);
            let mut client = Client::new(hash, "user", "pw", None);
            client.gs2_header = "p=tls-exporter,,".into();
            client.cb_data = vec![9; 32];
            let mut server = ScramServer::new(hash)
                .with_channel_binding(exporter(9))
                .with_downgrade_protection(&ADVERTISED, Some(&[cb::TLS_EXPORTER]));
            server.client_first(&client.first()).unwrap();
            let sf = server.server_first(Some(&creds));
            let cf = client.final_message(&sf);
            let v = server.client_final(&cf).unwrap();
            assert!(client.verify_server(&v), "{hash:?}");
        }
    }

    #[test]
    fn plus_mechanism_names_map_to_their_hash() {
        for hash in ScramHash::ALL {
            assert_eq!(
                ScramHash::from_any_mechanism(hash.plus_mechanism()),
                Some((hash, true))
            );
            assert_eq!(
                ScramHash::from_any_mechanism(hash.mechanism()),
                Some((hash, false))
            );
        }
        assert_eq!(ScramHash::from_any_mechanism("PLAIN-PLUS"), None);
        assert_eq!(ScramHash::from_any_mechanism("SCRAM-SHA-512"), None);
    }
}
