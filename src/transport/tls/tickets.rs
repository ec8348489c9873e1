//! Stateless TLS session tickets that every node of a cluster accepts (RFC 8446 §4.6.1; the
//! same tickets serve TLS 1.2 clients that ask for them, RFC 5077).
//!
//! A ticket is the resumption state rustls hands over, sealed with AES-256-GCM:
//!
//! ```text
//! key id (1 byte) ‖ nonce (12 random bytes) ‖ ciphertext ‖ tag (16 bytes)
//! ```
//!
//! The key is derived (HKDF-SHA-256, RFC 5869) from a cluster-wide secret and the number of
//! the current rotation period, `floor(unix_time / rotation)`: every node that shares the
//! secret and a synchronised clock derives the same key without talking to the others.
//! Tickets are sealed under the current period's key and opened under the current or the
//! previous one, so a ticket is accepted for at most two periods and then fails like any
//! unknown ticket: the client makes a full handshake (RFC 8446 §4.6.1: a ticket is only a
//! hint). The key id is the period number's low byte, which picks the key without trying
//! both. Forward secrecy for a resumed session rests on the key being forgotten, so keys
//! live only as long as their period (RFC 8446 §4.6.1, `ProducesTickets::lifetime`).
//!
//! The secret is `[tls] ticket_secret` when the operator sets one, otherwise one generated
//! once and kept in the store (every node on one database shares it). A reload
//! ([`Tickets::reload`]) takes a new secret, rotation or on/off at once; tickets sealed
//! under the old secret then fail and their clients make one full handshake.

use std::sync::RwLock;

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::hkdf::{Prk, Salt, HKDF_SHA256};
use ring::rand::{SecureRandom, SystemRandom};

use crate::clock::Clock;
use crate::config::TlsConfig;

/// Bytes before the sealed state: the key id and the nonce.
const HEADER: usize = 1 + NONCE_LEN;
/// AES-GCM's tag.
const TAG: usize = 16;
/// HKDF salt: separates these keys from anything else derived from the same secret.
const SALT: &[u8] = b"presenced TLS session ticket key";

/// The ticketer of the client listeners' TLS configuration.
pub struct Tickets {
    clock: Clock,
    /// The secret kept in the store, used while `[tls] ticket_secret` is unset.
    stored: Vec<u8>,
    rng: SystemRandom,
    state: RwLock<State>,
}

/// What the settings in force derive.
struct State {
    enabled: bool,
    rotation_secs: u64,
    prk: Prk,
    /// The period `keys` belong to.
    keys: Option<Keys>,
}

/// The keys of one period and of the one before it.
struct Keys {
    period: u64,
    current: LessSafeKey,
    previous: LessSafeKey,
}

impl Keys {
    /// The key that sealed a ticket with key id `id`, if it is one of the two still open.
    fn for_id(&self, id: u8) -> Option<&LessSafeKey> {
        if id == key_id(self.period) {
            Some(&self.current)
        } else if id == key_id(self.period.wrapping_sub(1)) {
            Some(&self.previous)
        } else {
            None
        }
    }
}

fn key_id(period: u64) -> u8 {
    period as u8
}

impl std::fmt::Debug for Tickets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state.read().unwrap_or_else(|p| p.into_inner());
        f.debug_struct("Tickets")
            .field("enabled", &state.enabled)
            .field("rotation_secs", &state.rotation_secs)
            .finish_non_exhaustive()
    }
}

impl Tickets {
    /// A ticketer on `config`'s settings; `stored` is the store's secret, used while the
    /// configuration names none. Times are read from `clock`.
    pub fn new(config: &TlsConfig, stored: Vec<u8>, clock: Clock) -> Tickets {
        let state = State::from_config(config, &stored);
        Tickets {
            clock,
            stored,
            rng: SystemRandom::new(),
            state: RwLock::new(state),
        }
    }

    /// Takes the ticket settings of a reloaded configuration. Says whether they changed
    /// (then tickets sealed before no longer open).
    pub fn reload(&self, config: &TlsConfig) -> bool {
        let new = State::from_config(config, &self.stored);
        let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
        let changed = state.enabled != new.enabled
            || state.rotation_secs != new.rotation_secs
            || state.prk_fingerprint() != new.prk_fingerprint();
        if changed {
            *state = new;
        }
        changed
    }

    fn now_secs(&self) -> u64 {
        u64::try_from(self.clock.now_ms() / 1000).unwrap_or(0)
    }

    /// Runs `f` on the keys of the period `now` (Unix seconds) falls in, deriving them
    /// first when the period has changed since the last ticket.
    fn with_keys<T>(&self, now: u64, f: impl FnOnce(&Keys) -> Option<T>) -> Option<T> {
        {
            let state = self.state.read().unwrap_or_else(|p| p.into_inner());
            let period = now / state.rotation_secs;
            if let Some(keys) = state.keys.as_ref().filter(|k| k.period == period) {
                return f(keys);
            }
        }
        let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
        let period = now / state.rotation_secs;
        if state.keys.as_ref().is_none_or(|k| k.period != period) {
            state.keys = Some(Keys {
                period,
                current: state.key(period),
                previous: state.key(period.wrapping_sub(1)),
            });
        }
        f(state.keys.as_ref()?)
    }

    /// Seals `plain` under the key of the period `now` falls in.
    fn encrypt_at(&self, now: u64, plain: &[u8]) -> Option<Vec<u8>> {
        let mut nonce = [0u8; NONCE_LEN];
        self.rng.fill(&mut nonce).ok()?;
        self.with_keys(now, |keys| {
            let id = key_id(keys.period);
            let mut out = Vec::with_capacity(HEADER + plain.len() + TAG);
            out.push(id);
            out.extend_from_slice(&nonce);
            out.extend_from_slice(plain);
            let tag = keys
                .current
                .seal_in_place_separate_tag(
                    Nonce::assume_unique_for_key(nonce),
                    Aad::from([id]),
                    &mut out[HEADER..],
                )
                .ok()?;
            out.extend_from_slice(tag.as_ref());
            Some(out)
        })
    }

    /// Opens a ticket sealed in the period `now` falls in or the one before; `None` for
    /// anything else (older, forged, altered, truncated).
    fn decrypt_at(&self, now: u64, ticket: &[u8]) -> Option<Vec<u8>> {
        if ticket.len() < HEADER + TAG {
            return None;
        }
        let (header, sealed) = ticket.split_at(HEADER);
        let id = header[0];
        let nonce = Nonce::try_assume_unique_for_key(&header[1..]).ok()?;
        self.with_keys(now, |keys| {
            let key = keys.for_id(id)?;
            let mut out = sealed.to_vec();
            let len = key
                .open_in_place(nonce, Aad::from([id]), &mut out)
                .ok()?
                .len();
            out.truncate(len);
            Some(out)
        })
    }
}

impl State {
    fn from_config(config: &TlsConfig, stored: &[u8]) -> State {
        let secret = config
            .ticket_secret
            .as_deref()
            .map_or(stored, str::as_bytes);
        State {
            enabled: config.tickets,
            // Validated to be at least a minute; never zero here.
            rotation_secs: config.ticket_rotation.as_secs().max(1),
            prk: Salt::new(HKDF_SHA256, SALT).extract(secret),
            keys: None,
        }
    }

    /// The AES-256-GCM key of `period`.
    fn key(&self, period: u64) -> LessSafeKey {
        let info = period.to_be_bytes();
        let info = [b"ticket key".as_slice(), info.as_slice()];
        let okm = self
            .prk
            .expand(&info, &AES_256_GCM)
            .expect("32 bytes is within HKDF-SHA-256's output limit");
        LessSafeKey::new(UnboundKey::from(okm))
    }

    /// A value that differs when the secret does (the PRK itself cannot be compared).
    fn prk_fingerprint(&self) -> [u8; 32] {
        let mut out = [0u8; 32];
        self.prk
            .expand(&[b"fingerprint".as_slice()], FingerprintLen)
            .and_then(|okm| okm.fill(&mut out))
            .expect("32 bytes is within HKDF-SHA-256's output limit");
        out
    }
}

/// Output length of [`State::prk_fingerprint`].
struct FingerprintLen;

impl ring::hkdf::KeyType for FingerprintLen {
    fn len(&self) -> usize {
        32
    }
}

impl rustls::server::ProducesTickets for Tickets {
    fn enabled(&self) -> bool {
        self.state.read().unwrap_or_else(|p| p.into_inner()).enabled
    }

    /// The rotation period: a ticket sealed at any moment of a period opens until the end
    /// of the next, so it is good for at least this long.
    fn lifetime(&self) -> u32 {
        let state = self.state.read().unwrap_or_else(|p| p.into_inner());
        u32::try_from(state.rotation_secs).unwrap_or(u32::MAX)
    }

    fn encrypt(&self, plain: &[u8]) -> Option<Vec<u8>> {
        self.encrypt_at(self.now_secs(), plain)
    }

    fn decrypt(&self, cipher: &[u8]) -> Option<Vec<u8>> {
        self.decrypt_at(self.now_secs(), cipher)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const HOUR: u64 = 3600;

    fn config(secret: Option<&str>, rotation: u64) -> TlsConfig {
        TlsConfig {
            ticket_secret: secret.map(str::to_owned),
            ticket_rotation: Duration::from_secs(rotation),
            ..TlsConfig::default()
        }
    }

    fn tickets(secret: Option<&str>) -> Tickets {
        Tickets::new(
            &config(secret, HOUR),
            b"stored secret of this database".to_vec(),
            Clock::system(),
        )
    }

    /// The start of period `p` of an hour's rotation, and some seconds into it.
    fn at(p: u64, into: u64) -> u64 {
        p * HOUR + into
    }

    #[test]
    fn a_ticket_opens_in_its_period_and_the_next_not_later() {
        let t = tickets(None);
        let p = 490_000;
        let sealed = t.encrypt_at(at(p, 10), b"session state").unwrap();
        assert_eq!(sealed.len(), HEADER + b"session state".len() + TAG);
        assert_eq!(
            t.decrypt_at(at(p, 3599), &sealed).unwrap(),
            b"session state"
        );
        assert_eq!(
            t.decrypt_at(at(p + 1, 0), &sealed).unwrap(),
            b"session state"
        );
        assert_eq!(
            t.decrypt_at(at(p + 1, 3599), &sealed).unwrap(),
            b"session state"
        );
        assert_eq!(t.decrypt_at(at(p + 2, 0), &sealed), None);
        // 256 periods on, the key id is the same byte: the key still differs.
        assert_eq!(t.decrypt_at(at(p + 256, 0), &sealed), None);
        // Nor does a ticket from the future open (a node's clock running behind).
        assert_eq!(t.decrypt_at(at(p - 1, 0), &sealed), None);
    }

    #[test]
    fn a_tampered_ticket_does_not_open() {
        let t = tickets(None);
        let now = at(490_000, 0);
        let sealed = t.encrypt_at(now, b"session state").unwrap();
        for i in 0..sealed.len() {
            let mut bad = sealed.clone();
            bad[i] ^= 0x01;
            assert_eq!(t.decrypt_at(now, &bad), None, "byte {i} flipped");
        }
        assert_eq!(t.decrypt_at(now, &sealed[..sealed.len() - 1]), None);
        assert_eq!(t.decrypt_at(now, &sealed[..HEADER + TAG - 1]), None);
        assert_eq!(t.decrypt_at(now, &[]), None);
        let mut longer = sealed.clone();
        longer.push(0);
        assert_eq!(t.decrypt_at(now, &longer), None);
    }

    #[test]
    fn nodes_with_one_secret_open_each_others_tickets_and_a_new_secret_refuses_them() {
        let now = at(490_000, 100);
        // Two nodes on one database: the stored secret is the same.
        let (a, b) = (tickets(None), tickets(None));
        let sealed = a.encrypt_at(now, b"state").unwrap();
        assert_eq!(b.decrypt_at(now, &sealed).unwrap(), b"state");
        // Every ticket has a fresh nonce.
        assert_ne!(a.encrypt_at(now, b"state").unwrap(), sealed);
        // The operator's secret replaces the stored one.
        let configured = tickets(Some("an operator's secret, long enough"));
        assert_eq!(configured.decrypt_at(now, &sealed), None);
        // And a reload with another secret refuses what was sealed before.
        assert!(b.reload(&config(Some("an operator's secret, long enough"), HOUR)));
        assert_eq!(b.decrypt_at(now, &sealed), None);
        let resealed = b.encrypt_at(now, b"state").unwrap();
        assert_eq!(configured.decrypt_at(now, &resealed).unwrap(), b"state");
        // The same settings again change nothing.
        assert!(!b.reload(&config(Some("an operator's secret, long enough"), HOUR)));
        assert_eq!(b.decrypt_at(now, &resealed).unwrap(), b"state");
    }

    #[test]
    fn lifetime_is_the_rotation_and_the_switch_is_reloadable() {
        use rustls::server::ProducesTickets;
        let t = tickets(None);
        assert!(t.enabled());
        assert_eq!(t.lifetime(), 3600);
        let mut off = config(None, 7200);
        off.tickets = false;
        assert!(t.reload(&off));
        assert!(!t.enabled());
        assert_eq!(t.lifetime(), 7200);
    }

    #[tokio::test(start_paused = true)]
    async fn on_the_nodes_clock_a_ticket_opens_for_two_periods_at_most() {
        use rustls::server::ProducesTickets;
        let t = Tickets::new(&config(None, HOUR), b"stored".to_vec(), Clock::tokio());
        let sealed = t.encrypt(b"state").unwrap();
        tokio::time::advance(Duration::from_secs(HOUR)).await;
        assert_eq!(t.decrypt(&sealed).unwrap(), b"state", "the next period");
        tokio::time::advance(Duration::from_secs(HOUR)).await;
        assert_eq!(t.decrypt(&sealed), None, "two periods on");
    }

    #[test]
    fn the_system_clock_seals_tickets_that_open() {
        use rustls::server::ProducesTickets;
        let t = tickets(None);
        let sealed = t.encrypt(b"now").unwrap();
        assert_eq!(t.decrypt(&sealed).unwrap(), b"now");
    }
}
