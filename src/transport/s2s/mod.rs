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
//!   domain) pair, created by the first stanza for that pair ([`crate::node::outbox::Outbox::route_remote`]). The task
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

use std::sync::Arc;

use crate::node::Shared;
use crate::protocol::jid::Jid;
use crate::protocol::xml::{Element, NS_CLIENT, NS_SERVER, NS_STREAM};

use dialback::NS_DIALBACK;

/// Marks presence this server generated because a federation link was lost, not because
/// the contact went offline.
pub const NS_STALE: &str = "urn:presenced:s2s:link-lost";

/// The opening tag of a server stream (RFC 6120 §4.7) declaring the dialback prefix
/// (XEP-0220 §2.1: peers look for it to know dialback is spoken).
pub fn header(from: Option<&str>, to: Option<&str>, id: Option<&str>) -> String {
    let mut out = format!(
        "<?xml version='1.0'?><stream:stream xmlns='{NS_SERVER}' xmlns:stream='{NS_STREAM}' \
         xmlns:db='{NS_DIALBACK}' version='1.0'"
    );
    for (k, v) in [("from", from), ("to", to), ("id", id)] {
        if let Some(v) = v {
            out.push_str(&format!(" {k}='{}'", crate::protocol::xml::escape(v)));
        }
    }
    out.push_str(" xml:lang='en'>");
    out
}

pub use crate::node::federation::{AuthCounts, AuthMethod, S2s};

/// The federation state for a checked configuration and this server's certificate chain
/// and key ([`crate::transport::tls::identity`]).
pub fn new_state(
    config: &crate::config::Config,
    identity: (
        Vec<rustls_pki_types::CertificateDer<'static>>,
        rustls_pki_types::PrivateKeyDer<'static>,
    ),
) -> S2s {
    let resolver = outbound::build_resolver(&config.s2s.nameserver);
    let roots = config.s2s.ca_file.as_deref().and_then(cert::load_roots);
    S2s::new(config, identity, resolver, roots)
}

/// Starts the outgoing link of every pair the federation state asks for (called once by
/// [`crate::app::server::start`]). Holds the server weakly: the requests end with the state.
pub fn attach(shared: &Arc<Shared>) {
    let Some(mut rx) = shared.s2s.take_new_links() else {
        return;
    };
    let weak = Arc::downgrade(shared);
    tokio::spawn(async move {
        while let Some(link) = rx.recv().await {
            let Some(shared) = weak.upgrade() else { return };
            tokio::spawn(outbound::run(
                shared,
                link.key,
                link.id,
                link.rx,
                link.pending,
            ));
        }
    });
}

/// The link to `remote` broke (stream error, EOF without a close, reconnect failure).
/// Starts the grace timer and keeps an outgoing link reconnecting.
pub(crate) fn link_lost(shared: &Arc<Shared>, local: &str, remote: &str) {
    let Some(generation) = shared.s2s.mark_lost(remote) else {
        return;
    };
    tracing::info!(%remote, "federation link lost");
    let grace = shared.config.s2s.stale_grace;
    let remote_owned = remote.to_owned();
    let weak = Arc::downgrade(shared);
    tokio::spawn(async move {
        tokio::time::sleep(grace).await;
        if let Some(shared) = weak.upgrade() {
            grace_expired(&shared, &remote_owned, generation);
        }
    });
    if shared.s2s.wants_link(remote) {
        shared.s2s.ensure_link(local, remote);
    }
}

/// The grace period after a loss ended: if the link is still down, every local user who
/// sees a contact there gets an unavailable generated here, marked as such.
fn grace_expired(shared: &Shared, remote: &str, generation: u64) {
    let Some(seen) = shared.s2s.take_stale(remote, generation) else {
        return;
    };
    tracing::warn!(%remote, contacts = seen.len(), "federation link still down after grace; marking contacts unavailable");
    for (full, locals) in seen {
        for local in locals {
            let p = Element::new("presence", NS_CLIENT)
                .attr("type", "unavailable")
                .attr("from", full.clone())
                .attr("to", local.clone())
                .child(
                    Element::new("status", NS_CLIENT).text(format!("Connection to {remote} lost")),
                )
                .child(Element::new("link-lost", NS_STALE).attr("domain", remote));
            shared.outbox.to_local(&local, p);
        }
    }
}

/// A stream with `remote` authenticated again. After a loss, local users' contacts there
/// are probed again (RFC 6121 §4.3: the answers replace whatever we showed meanwhile).
pub(crate) fn link_up(shared: &Shared, remote: &str) {
    let probes = shared.s2s.take_reprobes(remote);
    if probes.is_empty() {
        return;
    }
    tracing::info!(%remote, probes = probes.len(), "federation link back; probing contacts again");
    for (local, contact) in probes {
        let probe = Element::new("presence", NS_CLIENT)
            .attr("type", "probe")
            .attr("from", local)
            .attr("to", contact);
        let _ = shared.s2s.route(&shared.config, probe);
    }
}

pub use crate::protocol::jid::{bare_of, domain_of};

/// An authenticated inbound stanza, already checked for addressing: hands it to presence,
/// or delivers it like a local one (RFC 6120 §10.5, RFC 6121 §8.5).
pub(crate) async fn deliver_inbound(
    presence: &crate::services::presence::Presence,
    from: Jid,
    to: Jid,
    el: Element,
) {
    match el.name.as_str() {
        "presence" => crate::services::presence::remote::inbound(presence, from, to, el).await,
        "message" => inbound::message(presence, from, to, el).await,
        _ => inbound::iq(presence, from, to, el).await,
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
