//! The node's metrics: one prometheus-client registry, rendered at `GET /metrics` in the
//! OpenMetrics text format (which Prometheus reads; every name keeps the `presenced_` prefix
//! and counters their `_total` suffix).
//!
//! Two kinds of figures live in it:
//!
//! * counters incremented where things happen (logins, SASL failures, messages routed,
//!   stanzas dropped by policy): each label value's counter is created once up front and
//!   kept, so an increment on the hot path is one relaxed atomic add, with no label lookup;
//! * figures read at scrape time from the state that already holds them (the liveness
//!   counters, bound sessions, Redis health, federation authentications), through one
//!   collector, so their owners keep plain atomics.
//!
//! The endpoint has no authentication, so no figure here may be finer than what it already
//! shows (the number of bound sessions): counters move on a client's own acts or on decisions
//! that do not depend on whether the other party is online. For that reason the process's
//! memory is not here: it grows with every session, invisible ones included, so the
//! allocator's figures go to operators through the admin socket's `stats`.

use std::sync::{Arc, OnceLock};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

/// The Content-Type of [`Metrics::render`]'s output.
pub(crate) const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A single-label set, as the families here use.
type Label = [(&'static str, &'static str); 1];

/// Why a stanza from a client was dropped or refused by policy rather than routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// The sender's own XEP-0191 block list holds the recipient (the sender is told, §3.6).
    /// A recipient's block is not counted while this endpoint is public: the sender is
    /// answered as if the recipient were absent (§3.5), and a counter must not say otherwise.
    BlockedBySender,
    /// The client sent faster than `[limits] stanzas_per_second` and its burst allow; the
    /// stanza is dropped and the stream closed with policy-violation.
    StanzaRate,
}
// Drops decided after the recipient's block list is read (the privacy gate's, a message
// left empty by filtering) are not counted while this endpoint is public, for the reason
// given at `BlockedBySender`: whether they happen tells a sender whether it is blocked.

impl DropReason {
    const ALL: [DropReason; 2] = [DropReason::BlockedBySender, DropReason::StanzaRate];

    fn label(self) -> &'static str {
        match self {
            DropReason::BlockedBySender => "blocked_by_sender",
            DropReason::StanzaRate => "stanza_rate",
        }
    }
}

/// The registry and the counters call sites increment.
pub struct Metrics {
    registry: Registry,
    logins_tcp: Counter,
    logins_websocket: Counter,
    auth_failures: Counter,
    messages_routed: Counter,
    dropped: [Counter; DropReason::ALL.len()],
    node: Arc<NodeCollector>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// An empty registry with every counter at zero; [`Metrics::attach`] adds the figures
    /// read from the running server.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("presenced");
        let logins = Family::<Label, Counter>::default();
        let logins_tcp = logins.get_or_create_owned(&[("transport", "tcp")]);
        let logins_websocket = logins.get_or_create_owned(&[("transport", "websocket")]);
        registry.register(
            "logins",
            "Client sessions bound (RFC 6120 section 7), by transport.",
            logins,
        );
        let auth_failures = Counter::default();
        registry.register(
            "auth_failures",
            "Failed SASL authentication attempts of clients.",
            auth_failures.clone(),
        );
        let messages_routed = Counter::default();
        registry.register(
            "messages_routed",
            "Messages from local clients taken for routing to a user (counted before block \
             and privacy checks, whatever the recipient's state).",
            messages_routed.clone(),
        );
        let dropped_family = Family::<Label, Counter>::default();
        let dropped =
            DropReason::ALL.map(|r| dropped_family.get_or_create_owned(&[("reason", r.label())]));
        registry.register(
            "stanzas_dropped",
            "Stanzas from clients dropped or refused by policy, by reason.",
            dropped_family,
        );
        let node = Arc::new(NodeCollector::default());
        registry.register_collector(Box::new(node.clone()));
        Metrics {
            registry,
            logins_tcp,
            logins_websocket,
            auth_failures,
            messages_routed,
            dropped,
            node,
        }
    }

    /// Lets the registry read the running server's own figures at scrape time (called once by
    /// [`crate::app::server::start`]). The server hands in the reader, so this module knows
    /// nothing of the server's state and sits below everything that counts.
    pub fn attach(&self, read: NodeFigures) {
        let _ = self.node.read.set(read);
    }

    /// A client session was bound over TCP (STARTTLS or direct TLS).
    pub fn login_tcp(&self) {
        self.logins_tcp.inc();
    }

    /// A client session was bound over WebSocket (RFC 7395).
    pub fn login_websocket(&self) {
        self.logins_websocket.inc();
    }

    /// A SASL attempt failed.
    pub fn auth_failure(&self) {
        self.auth_failures.inc();
    }

    /// A message from a local client was taken for routing to a user.
    pub fn message_routed(&self) {
        self.messages_routed.inc();
    }

    /// A stanza from a client was dropped or refused by policy.
    pub fn dropped(&self, reason: DropReason) {
        self.dropped[reason as usize].inc();
    }

    /// Sessions bound so far over TCP and over WebSocket (the status page's login rate).
    pub fn logins(&self) -> (u64, u64) {
        (self.logins_tcp.get(), self.logins_websocket.get())
    }

    /// Messages taken for routing so far.
    pub fn messages_routed_total(&self) -> u64 {
        self.messages_routed.get()
    }

    /// Failed SASL attempts so far.
    pub fn auth_failures_total(&self) -> u64 {
        self.auth_failures.get()
    }

    /// The OpenMetrics text exposition of every figure.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!(error = %e, "metrics encoding failed");
        }
        out
    }
}

/// Writes, at scrape time, the figures whose owners keep them as plain state (the server's
/// sessions, liveness counters, federation counts): given by [`Metrics::attach`].
pub(crate) type NodeFigures =
    Box<dyn Fn(&mut DescriptorEncoder) -> Result<(), std::fmt::Error> + Send + Sync>;

/// Reads, at scrape time, the figures whose owners keep them as plain state.
#[derive(Default)]
struct NodeCollector {
    read: OnceLock<NodeFigures>,
}

impl std::fmt::Debug for NodeCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeCollector").finish_non_exhaustive()
    }
}

impl Collector for NodeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        match self.read.get() {
            Some(read) => read(&mut encoder),
            None => Ok(()),
        }
    }
}

/// Encodes one counter read from an atomic owned elsewhere (`name` without `_total`).
pub(crate) fn counter(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let c = ConstCounter::new(value);
    c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)
}

/// Encodes one gauge read from state owned elsewhere.
pub(crate) fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: i64,
) -> Result<(), std::fmt::Error> {
    let g = ConstGauge::new(value);
    g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_render_with_their_prefix_suffix_and_labels() {
        let m = Metrics::new();
        m.login_tcp();
        m.login_tcp();
        m.login_websocket();
        m.auth_failure();
        m.message_routed();
        m.dropped(DropReason::BlockedBySender);
        let text = m.render();
        for line in [
            "presenced_logins_total{transport=\"tcp\"} 2",
            "presenced_logins_total{transport=\"websocket\"} 1",
            "presenced_auth_failures_total 1",
            "presenced_messages_routed_total 1",
            "presenced_stanzas_dropped_total{reason=\"blocked_by_sender\"} 1",
            // Every reason is exported from the start, so a rate over it is defined.
            "presenced_stanzas_dropped_total{reason=\"stanza_rate\"} 0",
            "# EOF",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing in:\n{text}"
            );
        }
    }
}
