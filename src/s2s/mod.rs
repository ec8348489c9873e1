//! Server-to-server federation: RFC 6120 streams in `jabber:server`, STARTTLS, SASL
//! EXTERNAL (XEP-0178), XEP-0220 dialback (XEP-0185 keys), resolution by static route or
//! DNS SRV.
//!
//! # How a stream authenticates
//!
//! Every stream is TLS first (STARTTLS or XEP-0368 direct TLS; RFC 7590). Both sides
//! present the `[tls]` certificate: the receiving server as TLS server, the originating
//! server as TLS client (the s2s listeners ask for, but do not require, a client
//! certificate). Then, per remote domain and its `[s2s]` policy ([`cert`] decides):
//!
//! - **SASL EXTERNAL** when the peer's certificate proves its domain: it chains to
//!   `ca_file` and names the domain, or (`allow_self_signed`) merely names it. The
//!   receiving server offers EXTERNAL only then; the originating server always uses it
//!   when offered, restarts the stream, and needs nothing else.
//! - **Dialback** otherwise, when `allow_dialback` and not `require_verified_cert`:
//!   inbound, the dialback feature is offered and `<db:result>` accepted; outbound, a key
//!   is sent when EXTERNAL is not offered or failed.
//! - With `require_verified_cert`, a peer whose certificate does not verify gets neither:
//!   outbound the TLS handshake itself fails, inbound `<db:result>` is refused with
//!   policy-violation; queued stanzas bounce with remote-server-not-found.
//!
//! [`S2s::auth_counts`] counts which method each stream used (exported on `/metrics` as
//! `presenced_s2s_authenticated_total`).
//!
//! # Shape
//!
//! - **Outgoing** ([`outbound`]): one task and one bounded queue per (local domain, remote
//!   domain) pair, created by the first stanza for that pair ([`route_remote`]). The task
//!   connects (a static route `host:port` means STARTTLS, `xmpps://host:port` direct TLS
//!   per XEP-0368), secures and authenticates the stream, then drains the queue onto it;
//!   it closes the stream with `</stream:stream>` after `[s2s] idle_timeout` without
//!   stanzas, and the next stanza starts a new link. At most `queue_size` stanzas wait per
//!   pair (counted until written or bounced); one more is bounced at once with
//!   remote-server-timeout. When connecting fails every queued stanza is bounced to its
//!   local sender with remote-server-not-found or, after `connect_timeout`,
//!   remote-server-timeout (RFC 6120 §8.3.3.16/17), and the next attempt waits a growing,
//!   jittered delay between `reconnect_min_ms` and `reconnect_max_ms`
//!   ([`outbound::reconnect_delay`]).
//! - **Incoming** ([`inbound`]): a listener on the s2s port (and optionally direct TLS).
//!   Each stream learns which remote domains it may speak for, by SASL EXTERNAL or
//!   dialback; every stanza's
//!   `from` must be one of them and its `to` one of ours, or the stream ends with the
//!   RFC 6120 §4.9.3 error.
//! - **Stale remote presence**: which remote resources local users currently see as
//!   available is tracked here. When the link to a domain breaks and is not back within
//!   `stale_grace`, local users get a locally generated unavailable (marked with
//!   [`NS_STALE`]) for each, and when the link returns their contacts are probed again,
//!   so nobody shows green forever because federation broke.

pub mod cert;
pub mod dialback;
pub mod inbound;
pub mod outbound;
pub mod stream;

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use tokio::sync::mpsc;

use crate::error::{ErrorType, StanzaError};
use crate::server::Shared;
use crate::xml::{Element, NS_CLIENT};

/// Marks presence this server generated because a federation link was lost, not because
/// the contact went offline.
pub const NS_STALE: &str = "urn:presenced:s2s:link-lost";

/// The remote-server-timeout stanza error (RFC 6120 §8.3.3.17).
pub fn remote_server_timeout() -> StanzaError {
    StanzaError {
        kind: ErrorType::Wait,
        condition: "remote-server-timeout",
        text: None,
    }
}

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

impl Link {
    /// Spawns the task for `key` and returns its queue.
    fn spawn(shared: &Arc<Shared>, key: (String, String), id: u64) -> Link {
        let (tx, rx) = mpsc::channel(shared.config.s2s.queue_size);
        let pending = Arc::new(AtomicUsize::new(0));
        tokio::spawn(outbound::run(shared.clone(), key, id, rx, pending.clone()));
        Link { tx, id, pending }
    }
}

/// Federation state shared by every s2s task; lives in [`Shared::s2s`].
pub struct S2s {
    /// Back-reference so synchronous callers ([`route_remote`]) can spawn tasks.
    shared: OnceLock<Weak<Shared>>,
    /// Outgoing queues by (local domain, remote domain).
    links: Mutex<HashMap<(String, String), Link>>,
    next_link: AtomicU64,
    /// Dialback secret.
    pub secret: dialback::Secret,
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
    /// chain and key ([`crate::tls::identity`]).
    pub fn new(
        config: &crate::config::Config,
        identity: (
            Vec<rustls_pki_types::CertificateDer<'static>>,
            rustls_pki_types::PrivateKeyDer<'static>,
        ),
    ) -> S2s {
        let resolver = outbound::build_resolver(&config.s2s.nameserver);
        S2s {
            shared: OnceLock::new(),
            links: Mutex::new(HashMap::new()),
            next_link: AtomicU64::new(1),
            secret: config
                .s2s
                .secret
                .as_deref()
                .map_or_else(dialback::Secret::random, dialback::Secret::new),
            resolver,
            presence: Mutex::new(RemotePresence::default()),
            severed: AtomicBool::new(false),
            cut: tokio_util::sync::CancellationToken::new(),
            roots: config.s2s.ca_file.as_deref().and_then(cert::load_roots),
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

    /// Records the server this state belongs to (called once by [`crate::server::start`]).
    pub fn attach(&self, shared: &Arc<Shared>) {
        let _ = self.shared.set(Arc::downgrade(shared));
    }

    fn shared(&self) -> Option<Arc<Shared>> {
        self.shared.get().and_then(Weak::upgrade)
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
    fn remove_link(&self, key: &(String, String), id: u64) {
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        if links.get(key).is_some_and(|l| l.id == id) {
            links.remove(key);
        }
    }

    /// Queues `el` on the link for its pair, creating the link when there is none.
    fn enqueue(
        &self,
        shared: &Arc<Shared>,
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
                Link::spawn(shared, key.clone(), id)
            });
            let Some(stanza) = el.take() else { break };
            let limit = shared.config.s2s.queue_size;
            if link.pending.fetch_add(1, Ordering::SeqCst) >= limit {
                link.pending.fetch_sub(1, Ordering::SeqCst);
                // RFC 6120 §8.3.3.17: the remote server was resolved but we cannot reach
                // it in time for this stanza.
                tracing::warn!(%local, %remote, limit, "s2s queue full; bouncing");
                return Err(remote_server_timeout());
            }
            match link.tx.try_send(stanza) {
                Ok(()) => return Ok(()),
                Err(mpsc::error::TrySendError::Full(_)) => {
                    // Unreachable while `pending` bounds the channel; kept as a safe answer.
                    link.pending.fetch_sub(1, Ordering::SeqCst);
                    tracing::warn!(%local, %remote, "s2s queue full; bouncing");
                    return Err(remote_server_timeout());
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
    fn ensure_link(&self, shared: &Arc<Shared>, local: &str, remote: &str) {
        let key = (local.to_owned(), remote.to_owned());
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        links.entry(key.clone()).or_insert_with(|| {
            let id = self.next_link.fetch_add(1, Ordering::Relaxed);
            Link::spawn(shared, key, id)
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

    /// The link to `remote` broke (stream error, EOF without a close, reconnect failure).
    /// Starts the grace timer and keeps an outgoing link reconnecting.
    pub fn link_lost(&self, local: &str, remote: &str) {
        let Some(shared) = self.shared() else { return };
        if self.is_severed() {
            return;
        }
        let generation = {
            let mut p = self.presence.lock().unwrap_or_else(|e| e.into_inner());
            if p.lost.contains_key(remote) {
                return;
            }
            p.next_loss += 1;
            let g = p.next_loss;
            p.lost.insert(remote.to_owned(), g);
            g
        };
        tracing::info!(%remote, "federation link lost");
        let grace = shared.config.s2s.stale_grace;
        let remote_owned = remote.to_owned();
        let weak = Arc::downgrade(&shared);
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            if let Some(shared) = weak.upgrade() {
                shared.s2s.grace_expired(&shared, &remote_owned, generation);
            }
        });
        if self.wants_link(remote) {
            self.ensure_link(&shared, local, remote);
        }
    }

    /// The grace period after a loss ended: if the link is still down, every local user who
    /// sees a contact there gets an unavailable generated here, marked as such.
    fn grace_expired(&self, shared: &Shared, remote: &str, generation: u64) {
        let seen = {
            let mut p = self.presence.lock().unwrap_or_else(|e| e.into_inner());
            if p.lost.get(remote) != Some(&generation) {
                return;
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
            seen
        };
        tracing::warn!(%remote, contacts = seen.len(), "federation link still down after grace; marking contacts unavailable");
        for (full, locals) in seen {
            for local in locals {
                let p = Element::new("presence", NS_CLIENT)
                    .attr("type", "unavailable")
                    .attr("from", full.clone())
                    .attr("to", local.clone())
                    .child(
                        Element::new("status", NS_CLIENT)
                            .text(format!("Connection to {remote} lost")),
                    )
                    .child(Element::new("link-lost", NS_STALE).attr("domain", remote));
                crate::delivery::to_local(shared, &local, p);
            }
        }
    }

    /// A stream with `remote` authenticated again. After a loss, local users' contacts there
    /// are probed again (RFC 6121 §4.3: the answers replace whatever we showed meanwhile).
    pub fn link_up(&self, remote: &str) {
        let Some(shared) = self.shared() else { return };
        let probes = {
            let mut p = self.presence.lock().unwrap_or_else(|e| e.into_inner());
            let was_lost = p.lost.remove(remote).is_some();
            let mut probes = p.reprobe.remove(remote).unwrap_or_default();
            if was_lost {
                // Back within the grace: re-probe what is shown, as the peer may have
                // restarted and forgotten to tell us who went away.
                for (full, locals) in p.seen.get(remote).into_iter().flatten() {
                    for l in locals {
                        probes.insert((bare_of(l).to_owned(), bare_of(full).to_owned()));
                    }
                }
            }
            probes
        };
        if probes.is_empty() {
            return;
        }
        tracing::info!(%remote, probes = probes.len(), "federation link back; probing contacts again");
        for (local, contact) in probes {
            let probe = Element::new("presence", NS_CLIENT)
                .attr("type", "probe")
                .attr("from", local)
                .attr("to", contact);
            let _ = route_remote(&shared, probe);
        }
    }
}

/// The bare part of a JID string.
pub fn bare_of(jid: &str) -> &str {
    jid.split_once('/').map(|(b, _)| b).unwrap_or(jid)
}

/// The domain of a JID string.
pub fn domain_of(jid: &str) -> &str {
    let bare = bare_of(jid);
    bare.rsplit_once('@').map(|(_, d)| d).unwrap_or(bare)
}

/// Sends a stanza whose `to` is on a domain this server does not host. `from` is already
/// stamped with a local JID. `Err` is the stanza error to bounce to the sender now
/// (RFC 6120 §8.3.3.16); later failures are bounced by the link's task.
pub fn route_remote(shared: &Shared, stanza: Element) -> Result<(), StanzaError> {
    if !shared.config.s2s.enabled || shared.s2s.is_severed() {
        return Err(StanzaError::remote_server_not_found());
    }
    let (Some(from), Some(to)) = (stanza.get_attr("from"), stanza.get_attr("to")) else {
        return Err(StanzaError::bad_request());
    };
    let local = domain_of(from).to_owned();
    let remote = match crate::jid::Jid::new(to) {
        Ok(j) => j.domain().to_string(),
        Err(_) => return Err(StanzaError::jid_malformed()),
    };
    if !shared.config.serves(&local) || shared.config.serves(&remote) {
        return Err(StanzaError::bad_request());
    }
    let Some(arc) = shared.s2s.shared() else {
        return Err(StanzaError::remote_server_not_found());
    };
    let is_probe = stanza.name == "presence" && stanza.get_attr("type") == Some("probe");
    let probe_pair = is_probe.then(|| (bare_of(from).to_owned(), bare_of(to).to_owned()));
    let r = shared.s2s.enqueue(&arc, &local, &remote, stanza);
    if r.is_err() {
        if let Some((l, c)) = probe_pair {
            shared.s2s.probe_failed(&l, &c);
        }
    }
    r
}

/// Returns a stanza that could not be sent to its local sender as an error (RFC 6120
/// §8.3.1). Presence is not bounced except subscription requests: a failed broadcast is
/// nothing the user can act on; a failed probe is remembered and repeated instead.
pub(crate) fn bounce(shared: &Shared, el: &Element, err: StanzaError) {
    let ty = el.get_attr("type");
    if el.name == "presence" {
        if ty == Some("probe") {
            if let (Some(f), Some(t)) = (el.get_attr("from"), el.get_attr("to")) {
                shared.s2s.probe_failed(bare_of(f), bare_of(t));
            }
        }
        if ty != Some("subscribe") {
            return;
        }
    }
    crate::delivery::bounce(shared, el, err);
}

/// An authenticated inbound stanza, already checked for addressing: hands it to presence,
/// or delivers it like a local one (RFC 6120 §10.5, RFC 6121 §8.5).
pub(crate) async fn deliver_inbound(shared: &Arc<Shared>, el: Element) {
    match el.name.as_str() {
        "presence" => crate::presence::remote::inbound(shared, el).await,
        "message" => inbound::message(shared, el).await,
        _ => inbound::iq(shared, el).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn domain_and_bare_of_jid_strings() {
        assert_eq!(domain_of("a@b.example/r"), "b.example");
        assert_eq!(domain_of("b.example"), "b.example");
        assert_eq!(bare_of("a@b.example/r/x"), "a@b.example");
    }
}
