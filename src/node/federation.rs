//! Federation state of this node: the outgoing queues by domain pair, which remote
//! presence local users see (for the stale-link rules), the dialback secret, the peer
//! roots and the authentication counters. The s2s transport ([`crate::transport::s2s`]) runs the
//! links; it learns of a new one through [`S2s::take_new_links`], so this state, and every
//! service that routes a stanza to another server, needs nothing from the transport.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use crate::config::Config;
use crate::protocol::error::StanzaError;
use crate::protocol::jid::{bare_of, domain_of};
use crate::protocol::stanza::PresenceType;
use crate::protocol::xml::Element;

/// The outgoing queue of one domain pair.
struct Link {
    tx: mpsc::Sender<Element>,
    /// Distinguishes this link from a later one for the same pair.
    id: u64,
    /// Stanzas accepted for this link and not yet written or bounced, wherever they are
    /// (channel, the task's own queue, a batch being written). `[s2s] queue_size` bounds
    /// this, not the channel alone: the task takes stanzas out of the channel before it
    /// connects, so a bound on the channel would let up to twice as many wait.
    pending: Arc<AtomicUsize>,
}

/// A link whose task is to be started: its pair, id, queue and pending count.
pub struct NewLink {
    /// (local domain, remote domain).
    pub key: (String, String),
    /// Distinguishes this link from a later one for the same pair.
    pub id: u64,
    /// The queue the task drains.
    pub rx: mpsc::Receiver<Element>,
    /// Stanzas accepted for this link and not yet written or bounced.
    pub pending: Arc<AtomicUsize>,
}

/// Federation state shared by every s2s task; lives in [`crate::node::Shared::s2s`].
pub struct S2s {
    /// Requests for new outgoing links, drained by the s2s transport, which starts their
    /// tasks (so this state needs nothing from the transport).
    new_links: mpsc::UnboundedSender<NewLink>,
    new_links_rx: Mutex<Option<mpsc::UnboundedReceiver<NewLink>>>,
    /// Set once the transport took `new_links_rx`: before that nothing is routed.
    attached: AtomicBool,
    /// `[s2s] queue_size`.
    queue_size: usize,
    /// Outgoing queues by (local domain, remote domain).
    links: Mutex<HashMap<(String, String), Link>>,
    next_link: AtomicU64,
    /// Dialback secret.
    pub secret: Secret,
    /// SRV / address resolver; `None` when `[s2s] nameserver = "none"`.
    pub resolver: Option<hickory_resolver::TokioResolver>,
    /// Presence state of remote domains, for the stale-link rules.
    presence: Mutex<RemotePresence>,
    /// Set by [`S2s::sever`]: no new streams, everything refused.
    severed: AtomicBool,
    /// Cancelled to drop every federation stream without closing it ([`S2s::sever`]).
    cut: tokio_util::sync::CancellationToken,
    /// Roots from `[s2s] ca_file` that peers' certificates must chain to.
    pub roots: Option<Arc<rustls::client::WebPkiServerVerifier>>,
    /// Our certificate chain and key, presented as TLS client on outgoing streams;
    /// replaced on reload ([`S2s::set_client_identity`]), read once per new stream.
    identity: Mutex<(
        Vec<rustls_pki_types::CertificateDer<'static>>,
        rustls_pki_types::PrivateKeyDer<'static>,
    )>,
    /// How streams authenticated, for tests and metrics.
    auth: AuthCounters,
}

/// Streams authenticated per method and direction since start.
#[derive(Debug, Default)]
struct AuthCounters {
    external_in: AtomicU64,
    external_out: AtomicU64,
    dialback_in: AtomicU64,
    dialback_out: AtomicU64,
}

/// A snapshot of [`S2s::auth_counts`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AuthCounts {
    /// Inbound streams authenticated by SASL EXTERNAL.
    pub external_in: u64,
    /// Outgoing streams authenticated by SASL EXTERNAL.
    pub external_out: u64,
    /// Inbound (domain, domain) pairs authenticated by dialback.
    pub dialback_in: u64,
    /// Outgoing streams authenticated by dialback.
    pub dialback_out: u64,
}

/// How a stream authenticated (for [`S2s::authenticated`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthMethod {
    /// SASL EXTERNAL with a certificate (XEP-0178).
    External,
    /// Server dialback (XEP-0220).
    Dialback,
}

/// What local users see of remote domains.
#[derive(Default)]
struct RemotePresence {
    /// remote domain → remote full JID → local recipients (bare or full JIDs) that
    /// received its available presence and have not received its unavailable since.
    seen: HashMap<String, HashMap<String, BTreeSet<String>>>,
    /// remote domain → (local bare JID, remote bare JID) to probe when the link returns.
    reprobe: HashMap<String, BTreeSet<(String, String)>>,
    /// remote domain → generation of the loss being timed (a newer loss or a recovery
    /// makes an older timer moot).
    lost: HashMap<String, u64>,
    next_loss: u64,
}

impl S2s {
    /// Builds the federation state from the configuration and this server's certificate
    /// chain and key ([`crate::transport::tls::identity`]).
    pub fn new(
        config: &Config,
        identity: (
            Vec<rustls_pki_types::CertificateDer<'static>>,
            rustls_pki_types::PrivateKeyDer<'static>,
        ),
        resolver: Option<hickory_resolver::TokioResolver>,
        roots: Option<Arc<rustls::client::WebPkiServerVerifier>>,
    ) -> S2s {
        let (new_links, new_links_rx) = mpsc::unbounded_channel();
        S2s {
            new_links,
            new_links_rx: Mutex::new(Some(new_links_rx)),
            attached: AtomicBool::new(false),
            queue_size: config.s2s.queue_size,
            links: Mutex::new(HashMap::new()),
            next_link: AtomicU64::new(1),
            secret: config
                .s2s
                .secret
                .as_deref()
                .map_or_else(Secret::random, Secret::new),
            resolver,
            presence: Mutex::new(RemotePresence::default()),
            severed: AtomicBool::new(false),
            cut: tokio_util::sync::CancellationToken::new(),
            roots,
            identity: Mutex::new(identity),
            auth: AuthCounters::default(),
        }
    }

    /// Our certificate chain and key for outgoing TLS.
    pub fn client_identity(
        &self,
    ) -> (
        Vec<rustls_pki_types::CertificateDer<'static>>,
        rustls_pki_types::PrivateKeyDer<'static>,
    ) {
        let identity = self.identity.lock().unwrap_or_else(|p| p.into_inner());
        (identity.0.clone(), identity.1.clone_key())
    }

    /// Replaces the certificate chain and key later outgoing streams present (a reloaded
    /// certificate); streams already established keep theirs.
    pub fn set_client_identity(
        &self,
        identity: (
            Vec<rustls_pki_types::CertificateDer<'static>>,
            rustls_pki_types::PrivateKeyDer<'static>,
        ),
    ) {
        *self.identity.lock().unwrap_or_else(|p| p.into_inner()) = identity;
    }

    /// Counts a stream authenticated with `method`; `inbound` is the direction.
    pub fn authenticated(&self, method: AuthMethod, inbound: bool) {
        let c = match (method, inbound) {
            (AuthMethod::External, true) => &self.auth.external_in,
            (AuthMethod::External, false) => &self.auth.external_out,
            (AuthMethod::Dialback, true) => &self.auth.dialback_in,
            (AuthMethod::Dialback, false) => &self.auth.dialback_out,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// How many streams authenticated by which method since start.
    pub fn auth_counts(&self) -> AuthCounts {
        let a = &self.auth;
        AuthCounts {
            external_in: a.external_in.load(Ordering::Relaxed),
            external_out: a.external_out.load(Ordering::Relaxed),
            dialback_in: a.dialback_in.load(Ordering::Relaxed),
            dialback_out: a.dialback_out.load(Ordering::Relaxed),
        }
    }

    /// The receiving end of the requests for new outgoing links, taken once by the s2s
    /// transport ([`crate::transport::s2s::attach`]); until then nothing is routed.
    pub fn take_new_links(&self) -> Option<mpsc::UnboundedReceiver<NewLink>> {
        let rx = self
            .new_links_rx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if rx.is_some() {
            self.attached.store(true, Ordering::SeqCst);
        }
        rx
    }

    /// A new link's queue; its task is started by whoever drains [`S2s::take_new_links`].
    fn new_link(&self, key: (String, String), id: u64) -> Link {
        let (tx, rx) = mpsc::channel(self.queue_size);
        let pending = Arc::new(AtomicUsize::new(0));
        let _ = self.new_links.send(NewLink {
            key,
            id,
            rx,
            pending: pending.clone(),
        });
        Link { tx, id, pending }
    }

    /// Drops every federation stream at once without closing it, and refuses federation
    /// from then on: what a crashed server or a cut cable looks like to its peers. For
    /// tests of the stale-link rules and for operators isolating a node.
    pub fn sever(&self) {
        self.severed.store(true, Ordering::SeqCst);
        self.cut.cancel();
        self.links.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Whether [`S2s::sever`] was called.
    pub fn is_severed(&self) -> bool {
        self.severed.load(Ordering::SeqCst)
    }

    /// A token cancelled by [`S2s::sever`].
    pub fn cut_token(&self) -> tokio_util::sync::CancellationToken {
        self.cut.clone()
    }

    /// Number of live outgoing links (tests and metrics).
    pub fn outgoing_links(&self) -> usize {
        self.links.lock().map(|l| l.len()).unwrap_or(0)
    }

    /// Forgets the link `id` for a pair, if it is still the current one.
    pub(crate) fn remove_link(&self, key: &(String, String), id: u64) {
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        if links.get(key).is_some_and(|l| l.id == id) {
            links.remove(key);
        }
    }

    /// Queues `el` on the link for its pair, creating the link when there is none.
    pub(crate) fn enqueue(
        &self,
        local: &str,
        remote: &str,
        el: Element,
    ) -> Result<(), StanzaError> {
        let key = (local.to_owned(), remote.to_owned());
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        let mut el = Some(el);
        for _ in 0..2 {
            let link = links.entry(key.clone()).or_insert_with(|| {
                let id = self.next_link.fetch_add(1, Ordering::Relaxed);
                self.new_link(key.clone(), id)
            });
            let Some(stanza) = el.take() else { break };
            let limit = self.queue_size;
            if link.pending.fetch_add(1, Ordering::SeqCst) >= limit {
                link.pending.fetch_sub(1, Ordering::SeqCst);
                // RFC 6120 §8.3.3.17: the remote server was resolved but we cannot reach
                // it in time for this stanza.
                tracing::warn!(%local, %remote, limit, "s2s queue full; bouncing");
                return Err(StanzaError::remote_server_timeout());
            }
            match link.tx.try_send(stanza) {
                Ok(()) => return Ok(()),
                Err(mpsc::error::TrySendError::Full(_)) => {
                    // Unreachable while `pending` bounds the channel; kept as a safe answer.
                    link.pending.fetch_sub(1, Ordering::SeqCst);
                    tracing::warn!(%local, %remote, "s2s queue full; bouncing");
                    return Err(StanzaError::remote_server_timeout());
                }
                Err(mpsc::error::TrySendError::Closed(back)) => {
                    link.pending.fetch_sub(1, Ordering::SeqCst);
                    // The task just ended (idle); start a new one.
                    links.remove(&key);
                    el = Some(back);
                }
            }
        }
        Err(StanzaError::remote_server_not_found())
    }

    /// Makes sure an outgoing link exists for the pair, so it reconnects (stale rules).
    pub(crate) fn ensure_link(&self, local: &str, remote: &str) {
        let key = (local.to_owned(), remote.to_owned());
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        links.entry(key.clone()).or_insert_with(|| {
            let id = self.next_link.fetch_add(1, Ordering::Relaxed);
            self.new_link(key, id)
        });
    }

    /// Whether a link to `remote` should keep reconnecting with nothing queued: local users
    /// still see (or wait to re-see) contacts there.
    pub fn wants_link(&self, remote: &str) -> bool {
        let p = self.presence.lock().unwrap_or_else(|e| e.into_inner());
        p.lost.contains_key(remote)
            && (p.seen.get(remote).is_some_and(|m| !m.is_empty())
                || p.reprobe.get(remote).is_some_and(|s| !s.is_empty()))
    }

    /// A local recipient received available presence from a remote full JID.
    pub fn saw_available(&self, remote_full: &str, local: &str) {
        let domain = domain_of(remote_full).to_owned();
        let mut p = self.presence.lock().unwrap_or_else(|e| e.into_inner());
        p.seen
            .entry(domain)
            .or_default()
            .entry(remote_full.to_owned())
            .or_default()
            .insert(local.to_owned());
    }

    /// A local recipient received unavailable presence from a remote JID (full, or bare for
    /// every resource).
    pub fn saw_unavailable(&self, remote: &str, local: &str) {
        let domain = domain_of(remote).to_owned();
        let mut p = self.presence.lock().unwrap_or_else(|e| e.into_inner());
        let Some(map) = p.seen.get_mut(&domain) else {
            return;
        };
        let local_bare = bare_of(local);
        let bare_sender = !remote.contains('/');
        map.retain(|full, locals| {
            if full == remote || (bare_sender && bare_of(full) == remote) {
                locals.retain(|l| l != local && bare_of(l) != local_bare);
            }
            !locals.is_empty()
        });
    }

    /// The remote full JIDs whose available presence reached a resource of local user
    /// `local_bare` and was not withdrawn since, each with the recipient it reached.
    pub fn seen_by(&self, local_bare: &str) -> Vec<(String, String)> {
        let p = self.presence.lock().unwrap_or_else(|e| e.into_inner());
        p.seen
            .values()
            .flatten()
            .flat_map(|(full, locals)| {
                locals
                    .iter()
                    .filter(|l| bare_of(l) == local_bare)
                    .map(move |l| (full.clone(), l.clone()))
            })
            .collect()
    }

    /// A probe from `local_bare` to `remote_bare` could not be sent: retry it when the link
    /// to that domain returns.
    pub fn probe_failed(&self, local_bare: &str, remote_bare: &str) {
        let domain = domain_of(remote_bare).to_owned();
        let mut p = self.presence.lock().unwrap_or_else(|e| e.into_inner());
        p.reprobe
            .entry(domain)
            .or_default()
            .insert((local_bare.to_owned(), remote_bare.to_owned()));
    }

    /// The link to `remote` broke: the generation of this loss if it is a new one (the
    /// grace timer is then started by the caller), `None` if already lost or severed.
    pub(crate) fn mark_lost(&self, remote: &str) -> Option<u64> {
        if self.is_severed() {
            return None;
        }
        let mut p = self.presence.lock().unwrap_or_else(|e| e.into_inner());
        if p.lost.contains_key(remote) {
            return None;
        }
        p.next_loss += 1;
        let g = p.next_loss;
        p.lost.insert(remote.to_owned(), g);
        Some(g)
    }

    /// The grace after loss `generation` of `remote` ended: if it is still the current
    /// loss, takes what local users were seeing there (remote full JID → local recipients)
    /// and remembers to probe those contacts again when the link returns.
    pub(crate) fn take_stale(
        &self,
        remote: &str,
        generation: u64,
    ) -> Option<HashMap<String, BTreeSet<String>>> {
        let mut p = self.presence.lock().unwrap_or_else(|e| e.into_inner());
        if p.lost.get(remote) != Some(&generation) {
            return None;
        }
        let seen = p.seen.remove(remote).unwrap_or_default();
        let mut again = BTreeSet::new();
        for (full, locals) in &seen {
            for l in locals {
                again.insert((bare_of(l).to_owned(), bare_of(full).to_owned()));
            }
        }
        p.reprobe
            .entry(remote.to_owned())
            .or_default()
            .extend(again);
        Some(seen)
    }

    /// A stream with `remote` authenticated again: the (local bare, contact bare) pairs to
    /// probe. After a loss within the grace, what is still shown is probed too, as the peer
    /// may have restarted and forgotten to tell us who went away.
    pub(crate) fn take_reprobes(&self, remote: &str) -> BTreeSet<(String, String)> {
        let mut p = self.presence.lock().unwrap_or_else(|e| e.into_inner());
        let was_lost = p.lost.remove(remote).is_some();
        let mut probes = p.reprobe.remove(remote).unwrap_or_default();
        if was_lost {
            for (full, locals) in p.seen.get(remote).into_iter().flatten() {
                for l in locals {
                    probes.insert((bare_of(l).to_owned(), bare_of(full).to_owned()));
                }
            }
        }
        probes
    }

    /// Sends a stanza whose `to` is on a domain this server does not host. `from` is already
    /// stamped with a local JID. `Err` is the stanza error to bounce to the sender now
    /// (RFC 6120 §8.3.3.16); later failures are bounced by the link's task.
    pub fn route(&self, config: &Config, stanza: Element) -> Result<(), StanzaError> {
        if !config.s2s.enabled || self.is_severed() || !self.attached.load(Ordering::SeqCst) {
            return Err(StanzaError::remote_server_not_found());
        }
        let (Some(from), Some(to)) = (stanza.get_attr("from"), stanza.get_attr("to")) else {
            return Err(StanzaError::bad_request());
        };
        let local = domain_of(from).to_owned();
        let remote = match crate::protocol::jid::parse(to) {
            Ok(j) => j.domain().to_string(),
            Err(_) => return Err(StanzaError::jid_malformed()),
        };
        if !config.serves(&local) || config.serves(&remote) {
            return Err(StanzaError::bad_request());
        }
        let is_probe =
            stanza.name == "presence" && PresenceType::of(&stanza) == Some(PresenceType::Probe);
        let probe_pair = is_probe.then(|| (bare_of(from).to_owned(), bare_of(to).to_owned()));
        let r = self.enqueue(&local, &remote, stanza);
        if r.is_err() {
            if let Some((l, c)) = probe_pair {
                self.probe_failed(&l, &c);
            }
        }
        r
    }
}

/// The per-server dialback secret, already hashed as XEP-0185 prescribes.
#[derive(Clone)]
pub struct Secret {
    /// hex(SHA-256(secret)): the HMAC key.
    hmac_key: String,
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// From the configured secret.
    pub fn new(configured: &str) -> Secret {
        Secret {
            hmac_key: hex(&Sha256::digest(configured.as_bytes())),
        }
    }

    /// From random bytes, when none is configured (single node).
    pub fn random() -> Secret {
        use rand::RngCore;
        let mut b = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut b);
        Secret::new(&hex(&b))
    }

    /// The key the originating server `originating` sends to `receiving` on the stream
    /// whose id `receiving` chose (XEP-0185 §3).
    pub fn key(&self, receiving: &str, originating: &str, stream_id: &str) -> String {
        // new_from_slice accepts keys of any length for HMAC.
        let mut mac = match Hmac::<Sha256>::new_from_slice(self.hmac_key.as_bytes()) {
            Ok(m) => m,
            Err(_) => return String::new(),
        };
        mac.update(receiving.as_bytes());
        mac.update(b" ");
        mac.update(originating.as_bytes());
        mac.update(b" ");
        mac.update(stream_id.as_bytes());
        hex(&mac.finalize().into_bytes())
    }

    /// Whether `key` is the one this server would have issued (constant time).
    pub fn verify(&self, receiving: &str, originating: &str, stream_id: &str, key: &str) -> bool {
        use subtle::ConstantTimeEq;
        let expected = self.key(receiving, originating, stream_id);
        !expected.is_empty() && expected.as_bytes().ct_eq(key.trim().as_bytes()).into()
    }
}

/// Lower-case hex of `bytes` (XEP-0185 keys are hex strings).
pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}
