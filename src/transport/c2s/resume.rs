//! XEP-0198 on a client stream: enabling, acknowledgements, a session detached from its
//! dead connection, the resumption of it by a new stream, and what becomes of the stanzas
//! never acknowledged.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::writer::{serialized, WriterOut};
use super::{Authenticated, Halt};
use crate::node::outbox;
use crate::node::sessions::Outbound;
use crate::node::stream_management as sm;
use crate::node::Shared;
use crate::protocol::error::{StanzaCondition, StreamCondition, StreamError};
use crate::protocol::jid::FullJid;
use crate::protocol::xml as x;
use crate::transport::stream::XmlStream;

impl Authenticated {
    /// XEP-0198 §5: hands this stream to the session `previd` of the authenticated account,
    /// which answers `<resumed/>` on it; this task then has nothing left ([`Halt::Gone`]).
    /// The stream comes back when there is no such session here (`<failed/>` was written
    /// and the client may bind instead): expired, never issued, another account's, or held
    /// by another node of the cluster, which this node cannot resume, so the client binds a
    /// new resource.
    pub(super) async fn resume(self, previd: &str, h: u32) -> Result<Self, Halt> {
        let (mut me, failed) = self.hand_over(previd, h, None).await?;
        step!(me.link, me.link.write(&failed));
        Ok(me)
    }

    /// The hand-over of [`Self::resume`], for the stream itself or inline in a XEP-0388
    /// authentication (`frame` wraps `<resumed/>` in its `<success/>`). When the stream
    /// comes back, the `<failed/>` to answer with, not yet written.
    pub(super) async fn hand_over(
        self,
        previd: &str,
        h: u32,
        frame: Option<sm::Frame>,
    ) -> Result<(Self, String), Halt> {
        let Some(account) = self.link.account(&self.user) else {
            return Err(Halt::Gone);
        };
        let tx = match self.link.shared.resumable.find(previd, account.as_str(), h) {
            Ok(tx) => tx,
            Err(refused) => {
                tracing::info!(peer = %self.link.peer, %account, ?refused, "stream resumption refused");
                return Ok((self, sm::failed(refused.condition(), None)));
            }
        };
        let Authenticated {
            mut link,
            user,
            sasl2,
        } = self;
        let limits = link.stream.limits();
        let (reader, writer) = link.stream.split();
        let (taken, was_taken) = tokio::sync::oneshot::channel();
        let handoff = Box::new(sm::Handoff {
            h,
            reader,
            writer,
            peer: link.peer,
            transport: link.transport.clone(),
            taken,
            frame,
        });
        let deadline = link.deadline;
        match tokio::time::timeout_at(deadline, tx.send(handoff)).await {
            Ok(Ok(())) => {}
            Ok(Err(back)) => {
                // The session ended meanwhile.
                let sm::Handoff { reader, writer, .. } = *back.0;
                link.stream = XmlStream::from_halves(reader, writer, limits, x::NS_CLIENT);
                let me = Authenticated { link, user, sasl2 };
                return Ok((me, sm::failed(StanzaCondition::ItemNotFound, None)));
            }
            Err(_) => return Err(Halt::Gone),
        }
        // Either the session took the stream (and answers on it), or it ended with the
        // stream unanswered; then the connection closes and the client starts afresh.
        let _ = tokio::time::timeout_at(deadline, was_taken).await;
        Err(Halt::Gone)
    }
}

/// A resumable XEP-0198 session's id (in [`Shared::resumable`]) and the channel a resuming
/// stream is handed over on.
pub(super) struct Resumption {
    pub(super) id: String,
    pub(super) rx: mpsc::Receiver<Box<sm::Handoff>>,
    pub(super) window: Duration,
}

/// A session whose connection died and that waits for its client to resume it: the
/// mailbox this task now drains into the unacknowledged stanzas, the client-state filter
/// they pass, and when the window ends.
pub(super) struct Detached {
    pub(super) rx: crate::node::sessions::Mailbox,
    pub(super) csi: crate::services::csi::Filter,
    /// Boxed: the timer is large and only a detached session needs one.
    pub(super) until: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// With push enabled (XEP-0357), when the session hibernates: T after its client was
    /// last heard. `None` without push, or once it hibernates.
    pub(super) hibernate: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    /// The push registration to wake the client through while detached.
    pub(super) push: Option<Arc<crate::node::sessions::PushTarget>>,
    /// When its client was last heard (ms since the epoch): its last seen if it
    /// hibernates (the session's own beat goes on while it is kept).
    pub(super) last_heard: i64,
    pub(super) _counted: sm::DetachedCount,
    /// Boxed, as the timer: a handle is large and only a detached session needs one.
    pub(super) _marked: Box<DetachedMark>,
}

/// Marks the session detached in its state while it lives (operators' session list, the
/// status page), and no longer once the session is resumed or ends.
pub(super) struct DetachedMark(crate::node::sessions::SessionHandle);

impl Drop for DetachedMark {
    fn drop(&mut self) {
        self.0.write(|p| p.detached = false);
    }
}

/// How a session is kept once detached: how long it stays resumable, and with push
/// enabled, the registration and when it hibernates.
pub(super) struct Keep {
    pub(super) window: Duration,
    pub(super) last_heard: i64,
    pub(super) push: Option<(Arc<crate::node::sessions::PushTarget>, Duration)>,
}

impl Keep {
    /// XEP-0198's window; with a push registration (XEP-0357) the push hibernation time
    /// if longer, hibernating once the client has been silent for `ttl` (it was silent
    /// for `silent` already when its connection was found dead).
    pub(super) fn of(
        r: &Option<Resumption>,
        push: Option<Arc<crate::node::sessions::PushTarget>>,
        hibernation: Duration,
        ttl: Duration,
        (last_heard, now): (i64, i64),
    ) -> Keep {
        let window = r.as_ref().map_or(Duration::ZERO, |r| r.window);
        let silent = Duration::from_millis(u64::try_from(now - last_heard).unwrap_or(0));
        match push {
            Some(target) if !window.is_zero() => Keep {
                window: window.max(hibernation),
                last_heard,
                push: Some((target, ttl.saturating_sub(silent))),
            },
            _ => Keep {
                window,
                last_heard,
                push: None,
            },
        }
    }
}

impl Detached {
    pub(super) fn new(
        shared: &Shared,
        handle: &crate::node::sessions::SessionHandle,
        w: WriterOut,
        keep: Keep,
        peer: &SocketAddr,
        jid: &FullJid,
    ) -> Detached {
        let Keep {
            window,
            push,
            last_heard,
        } = keep;
        tracing::info!(%peer, %jid, ?window, push = push.is_some(), "connection lost; session kept for resumption (XEP-0198)");
        let (push, hibernate) = match push {
            Some((target, after)) => (Some(target), Some(Box::pin(tokio::time::sleep(after)))),
            None => (None, None),
        };
        Detached {
            rx: w.rx,
            csi: w.csi,
            until: Box::pin(tokio::time::sleep(window)),
            hibernate,
            push,
            last_heard,
            _counted: shared.resumable.count_detached(),
            _marked: {
                handle.write(|p| p.detached = true);
                Box::new(DetachedMark(handle.clone()))
            },
        }
    }
}

/// Enables XEP-0198 for a bound session (§3), asked by `<enable/>` on the stream or inline
/// in a XEP-0386 bind: the counters, a resumption if asked for and configured, and the
/// `<enabled/>` to answer with, which the caller writes before any counted stanza.
pub(super) fn enable(
    shared: &Shared,
    handle: &crate::node::sessions::SessionHandle,
    out: &mut Option<sm::SharedOutgoing>,
    handled: &mut Option<u32>,
    resumable: &mut Option<Resumption>,
    resume: bool,
    max: Option<u64>,
) -> (String, sm::SharedOutgoing) {
    *handled = Some(0);
    let limits = &shared.live.get().limits;
    let kept: sm::SharedOutgoing = Arc::new(std::sync::Mutex::new(sm::Outgoing::new(
        limits.sm_max_unacked,
        limits.sm_max_unacked_bytes,
    )));
    *out = Some(kept.clone());
    let configured = shared.live.get().limits.sm_resume_timeout;
    // §3: the client's `max` is its preference; the shorter window wins.
    let window = match max.filter(|&m| m > 0) {
        Some(m) => configured.min(Duration::from_secs(m)),
        None => configured,
    };
    let xml = if resume && !window.is_zero() {
        let (tx, rx) = mpsc::channel(1);
        let account = handle.jid.to_bare();
        let id = shared
            .resumable
            .register(account.as_str(), tx, kept.clone());
        let xml = sm::enabled(Some((&id, window.as_secs().max(1))));
        *resumable = Some(Resumption { id, rx, window });
        xml
    } else {
        sm::enabled(None)
    };
    tracing::debug!(jid = %handle.jid, resume, ?window, "stream management enabled");
    (xml, kept)
}

/// Handles a XEP-0198 element of a bound session's client; `Err` ends the stream.
pub(super) fn stream_management(
    shared: &Shared,
    handle: &crate::node::sessions::SessionHandle,
    out: &mut Option<sm::SharedOutgoing>,
    handled: &mut Option<u32>,
    resumable: &mut Option<Resumption>,
    nonza: Result<sm::Nonza, sm::Malformed>,
) -> Result<(), StreamError> {
    let failed = |condition| Outbound::SmNonza(Arc::new(sm::failed(condition, None)));
    match nonza {
        // RFC 6120 §4.9.3.1: XML the server cannot process.
        Err(sm::Malformed(why)) => return Err(StreamError::new(StreamCondition::BadFormat, why)),
        Ok(sm::Nonza::Enable { .. }) if handled.is_some() => {
            // §3: enabled once per stream.
            outbox::nonza(handle, failed(StanzaCondition::UnexpectedRequest));
        }
        Ok(sm::Nonza::Enable { resume, max }) => {
            let (xml, kept) = enable(shared, handle, out, handled, resumable, resume, max);
            outbox::nonza(
                handle,
                Outbound::SmEnabled(Box::new(sm::Enabled { xml, out: kept })),
            );
        }
        // §5: a bound stream resumes nothing.
        Ok(sm::Nonza::Resume { .. }) => {
            outbox::nonza(handle, failed(StanzaCondition::UnexpectedRequest));
        }
        Ok(sm::Nonza::Request) => match handled {
            Some(h) => {
                outbox::nonza(handle, Outbound::SmNonza(Arc::new(sm::ack(*h))));
            }
            None => {
                outbox::nonza(handle, failed(StanzaCondition::UnexpectedRequest));
            }
        },
        Ok(sm::Nonza::Ack { h }) => {
            let Some(kept) = out.as_ref() else {
                outbox::nonza(handle, failed(StanzaCondition::UnexpectedRequest));
                return Ok(());
            };
            if let Err(too) = sm::lock(kept).ack(h) {
                // §4: more acknowledged than was sent.
                return Err(StreamError::new(
                    StreamCondition::UndefinedCondition,
                    format!(
                        "handled-count-too-high: h={} send-count={}",
                        too.h, too.sent
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// The stanzas a XEP-0198 session's client never acknowledged (written, or still in the
/// mailbox), after the session ended: each is handled as RFC 6121 §8 handles a stanza for
/// a resource that went away ([`crate::routing::delivery::unacked`]).
pub(super) async fn return_unacked(
    presence: &crate::services::presence::Presence,
    jid: &FullJid,
    out: &sm::SharedOutgoing,
    rest: Option<crate::node::sessions::Mailbox>,
) {
    let mut items: Vec<Arc<String>> = sm::lock(out).take_unacked().into();
    if let Some(mut rx) = rest {
        while let Some(item) = rx.try_recv() {
            items.extend(serialized(item));
        }
    }
    let owner = jid.to_bare();
    let mut handled = 0usize;
    for xml in items {
        // Presence is dropped (§8.5.3.2.1); only messages and iq are read back.
        if !(xml.starts_with("<message") || xml.starts_with("<iq")) {
            continue;
        }
        let Some(el) = x::parse_element(&xml) else {
            continue;
        };
        crate::routing::delivery::unacked(presence, &owner, el).await;
        handled += 1;
    }
    if handled > 0 {
        tracing::info!(%jid, handled, "unacknowledged stanzas of an ended session re-routed");
    }
}

/// The next stream handed over to resume this session; never completes without resumption.
pub(super) async fn next_handoff(r: &mut Option<Resumption>) -> Box<sm::Handoff> {
    match r.as_mut() {
        Some(r) => match r.rx.recv().await {
            Some(h) => h,
            None => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}

/// What happens to a detached session next.
pub(super) enum DetachedEvent {
    /// An item for it, or `None` when the window is over.
    Item(Option<Outbound>),
    /// With push enabled, it is due to hibernate (once).
    Hibernate,
}

/// While detached: the next item of the mailbox, the end of the window, or the
/// hibernation; never completes while attached.
pub(super) async fn next_detached(d: &mut Option<Detached>) -> DetachedEvent {
    let Some(d) = d.as_mut() else {
        return std::future::pending().await;
    };
    let hibernate = async {
        match d.hibernate.as_mut() {
            Some(at) => at.as_mut().await,
            None => std::future::pending().await,
        }
    };
    let ev = tokio::select! {
        m = d.rx.recv() => DetachedEvent::Item(m),
        _ = d.until.as_mut() => DetachedEvent::Item(None),
        _ = hibernate => DetachedEvent::Hibernate,
    };
    if matches!(ev, DetachedEvent::Hibernate) {
        d.hibernate = None;
    }
    ev
}
