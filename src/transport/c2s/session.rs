//! The bound session: one task reads the client's stanzas and hands them to the router,
//! pings a silent client, keeps its liveness, and detaches or resumes it (XEP-0198).

use std::net::SocketAddr;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::resume::{
    next_detached, next_handoff, return_unacked, stream_management, Detached, DetachedEvent, Keep,
    Resumption,
};
use super::writer::{serialized, write_loop, WriterEnd, WriterOut, Writing};
use super::{new_id, Bound, Link};
use crate::liveness::{LiveSession, Timings, Transport, TransportKind};
use crate::node::session::Client;
use crate::node::sessions::{Outbound, SessionHandle};
use crate::node::stream_management as sm;
use crate::node::Shared;
use crate::protocol::error::{StreamCondition, StreamError};
use crate::protocol::jid::{FullJid, SharedJid};
use crate::protocol::xml::reader::{StreamEvent, XmlError};
use crate::protocol::xml::{self as x, Element};
use crate::routing::router;
use crate::services::Services;
use crate::transport::stream::Reader;

impl Bound {
    /// The bound session: register, spawn the writer, then read and handle stanzas until the
    /// stream ends, pinging the client when it is silent and keeping its liveness in Redis
    /// (see [`crate::liveness`]).
    ///
    /// Reading happens in this task: [`crate::protocol::xml::reader::StreamReader::next`] is not cancel-safe, so its
    /// future is kept pinned across `select!` iterations and only replaced once it has
    /// produced an event; a timer or token firing never drops a half-read stanza. One task
    /// fewer and no event channel per session is what an idle session saves (BENCHMARKS.md).
    ///
    /// XEP-0198: once the client enabled resumption, a connection that dies (the socket
    /// fails; not a `</stream:stream>`, not a stream error) detaches the session instead of
    /// ending it: it stays registered, available and in the directory, this task keeps its
    /// liveness beating and keeps what arrives for it, and a new stream that resumes it
    /// ([`Authenticated::resume`]) is attached in place of the old one. The window ends it as a
    /// disconnect ends a session.
    pub(super) async fn run_session(self) {
        let (mut s, reader) = SessionLoop::start(self);
        let timings = s.timings;
        // Checked four times per H so that a ping goes out within H/4 of H of silence.
        let mut ping_tick = tokio::time::interval(timings.heartbeat / 4);
        ping_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ping_tick.reset();
        let mut refresh_tick = tokio::time::interval(timings.refresh);
        refresh_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        refresh_tick.reset();
        // The pending read lives here, pinned, rather than in the loop's state: the loop's
        // steps are plain methods, and only this function replaces the read.
        let mut read = std::pin::pin!(next_event(Some(reader)));
        let end = loop {
            let ev = tokio::select! {
                _ = s.handle.kill.cancelled() => break None,
                _ = s.live.end.cancelled(), if s.detached.is_none() => {
                    // The sweeper found no beat for T: the client is gone without a word.
                    break Some(liveness_timeout());
                }
                _ = ping_tick.tick() => {
                    s.on_ping_tick();
                    continue;
                }
                _ = refresh_tick.tick() => match s.on_refresh_tick() {
                    ControlFlow::Continue(()) => continue,
                    ControlFlow::Break(end) => break end,
                },
                (reader, ev) = read.as_mut() => {
                    s.on_traffic(&ev);
                    // Start the next read before handling this event, so the completed future
                    // is never polled again; after a close or an error nothing follows and
                    // the reader is dropped.
                    let more = matches!(ev, Ok(StreamEvent::Stanza(_)) | Ok(StreamEvent::Whitespace));
                    read.set(next_event(more.then_some(reader)));
                    ev
                }
                done = wait_writer(&mut s.writer_task) => match s.on_writer_end(done) {
                    Some(failed) => {
                        read.set(next_event(None));
                        s.detach(failed);
                        continue;
                    }
                    None => break None,
                },
                handoff = next_handoff(&mut s.resumable) => {
                    // The old connection, if one is still attached, is read no more (when
                    // detached, nothing is being read already).
                    read.set(next_event(None));
                    match s.on_resume(handoff).await {
                        Some(reader) => {
                            read.set(next_event(Some(reader)));
                            continue;
                        }
                        None => break None,
                    }
                }
                event = next_detached(&mut s.detached) => match event {
                    DetachedEvent::Hibernate => {
                        s.on_hibernate().await;
                        continue;
                    }
                    DetachedEvent::Item(item) => match s.on_detached_item(item) {
                        ControlFlow::Continue(()) => continue,
                        ControlFlow::Break(()) => break None,
                    },
                },
            };
            if let ControlFlow::Break(end) = s.on_event(ev).await {
                break end;
            }
        };
        if s.live.end.is_cancelled() {
            s.live.mark_dead();
        }
        if let Some(at) = s.hibernated_at {
            // Its contacts heard it leave when it began; its last seen stays then.
            s.live.mark_dead_at(at);
        }
        // Stop reading; the reader (and with it the read half of the socket) goes now.
        read.set(next_event(None));
        // Boxed: the end's future holds the loop's state moved out of this frame; inline, it
        // would size this long-lived future twice over for its whole life.
        Box::pin(s.end(end)).await;
    }
}

/// The stream error of a client that went silent for the liveness timeout.
fn liveness_timeout() -> StreamError {
    StreamError::new(
        StreamCondition::ConnectionTimeout,
        "no traffic within the liveness timeout",
    )
}

/// XEP-0198 as a session starts with it: nothing, or enabled inline (XEP-0386).
#[derive(Default)]
struct SmState {
    handled: Option<u32>,
    out: Option<sm::SharedOutgoing>,
    resumable: Option<Resumption>,
}

/// The state of one bound session's task, with one step per thing that can happen to it:
/// a stream event read, a timer, the writer ending, a resumption, an item kept while
/// detached, and the end.
struct SessionLoop {
    shared: Arc<Shared>,
    services: Arc<Services>,
    peer: SocketAddr,
    transport: Transport,
    jid: SharedJid,
    handle: SessionHandle,
    client: Client,
    /// Stops the current writer (a resumption or a detach replaces it).
    stop: CancellationToken,
    writer_task: Option<tokio::task::JoinHandle<WriterOut>>,
    live: LiveSession,
    rate: crate::policy::rate_limit::ClientRate,
    timings: Timings,
    last_ping: tokio::time::Instant,
    // XEP-0198 on the reading side: the client's stanzas handled since <enable/> (None:
    // not enabled), what was written and not acknowledged, the resumption this session
    // offers, and the detached state.
    handled: Option<u32>,
    out: Option<sm::SharedOutgoing>,
    resumable: Option<Resumption>,
    detached: Option<Detached>,
    /// What the writer left in the mailbox when it ended.
    leftover: Option<crate::node::sessions::Mailbox>,
    /// While hibernated (XEP-0357): when its client was last heard, its last seen.
    hibernated_at: Option<i64>,
}

impl SessionLoop {
    /// Registers the session and spawns its writer; the reader is handed back for the loop.
    fn start(bound: Bound) -> (Self, Reader) {
        let Bound {
            link:
                Link {
                    shared,
                    services,
                    stream,
                    peer,
                    transport,
                    user_agent,
                    ..
                },
            jid,
            inline,
        } = bound;
        // One copy of the address for the session's lifetime, shared by every map below.
        let jid = SharedJid::share(jid);
        let (reader, writer) = stream.split();
        let origin = shared.sessions.origin(
            match transport.kind {
                TransportKind::Tcp => "tcp",
                TransportKind::WebSocket => "websocket",
            },
            Some(peer),
        );
        let reg = shared.sessions.register_from(
            jid.clone(),
            crate::node::sessions::QueueBudget {
                stanzas: shared.live.get().limits.session_queue,
                bytes: shared.live.get().limits.session_queue_bytes,
            },
            &shared.shutdown,
            origin,
        );
        if reg.replaced.is_some() {
            tracing::info!(%peer, %jid, "resource conflict: older session replaced");
        }
        let handle = reg.handle;
        if user_agent.is_some() {
            tracing::debug!(%peer, %jid, ?user_agent, "client installation (XEP-0388)");
            handle.write(|p| p.user_agent = user_agent);
        }
        // The resource is this node's cluster-wide now: a session of the same full JID on
        // another node is ended there, as a local one was just above.
        shared.cluster.claim(&jid);
        tracing::info!(%peer, %jid, kind = ?transport.kind, "session bound");
        match transport.kind {
            TransportKind::Tcp => shared.metrics.login_tcp(),
            TransportKind::WebSocket => shared.metrics.login_websocket(),
        }
        let csi = {
            let limits = &shared.live.get().limits;
            crate::services::csi::Filter::new(
                crate::services::csi::Budget {
                    presences: limits.max_csi_held_presences,
                    bytes: limits.max_csi_held_bytes,
                    per_sender: limits.max_csi_held_bytes_per_sender,
                },
                jid.clone(),
            )
        };
        let mut sm = SmState::default();
        let prelude = match inline {
            Some(inline) => Self::inline(&shared, &handle, &jid, *inline, &mut sm),
            None => String::new(),
        };
        let stop = CancellationToken::new();
        let writer_task = Some(tokio::spawn(write_loop(Writing {
            writer,
            rx: reg.rx,
            kill: handle.kill.clone(),
            stop: stop.clone(),
            csi,
            out: sm.out.clone(),
            prelude,
            resend: Vec::new(),
            write_timeout: shared.live.get().limits.write_timeout,
        })));
        let live = shared
            .liveness
            .bind(&jid, handle.id, transport.beat.clone());
        let client = Client {
            handle: handle.clone(),
            peer,
        };
        let rate = crate::policy::rate_limit::ClientRate::new(&shared.live.get().limits);
        let timings = shared.liveness.timings;
        let session = SessionLoop {
            shared,
            services,
            peer,
            transport,
            jid,
            handle,
            client,
            stop,
            writer_task,
            live,
            rate,
            timings,
            last_ping: tokio::time::Instant::now(),
            handled: sm.handled,
            out: sm.out,
            resumable: sm.resumable,
            detached: None,
            leftover: None,
            hibernated_at: None,
        };
        (session, reader)
    }

    /// XEP-0386: what a bind inline in a XEP-0388 authentication enabled, applied as the
    /// stanza forms are (XEP-0198 `enable`, XEP-0280 `carbons::switch`, XEP-0352's client
    /// state, queued before anything else), and the SASL2 `<success/>` the writer starts
    /// with: the full JID, and `<bound/>` with XEP-0198's `<enabled/>`. Counting starts
    /// after it, with the first stanza written.
    fn inline(
        shared: &Shared,
        handle: &SessionHandle,
        jid: &FullJid,
        inline: super::Inline,
        sm: &mut SmState,
    ) -> String {
        let super::Inline {
            additional,
            before,
            bind,
        } = inline;
        let mut results = String::new();
        if let Some((resume, max)) = bind.sm {
            let (xml, kept) = super::resume::enable(
                shared,
                handle,
                &mut sm.out,
                &mut sm.handled,
                &mut sm.resumable,
                resume,
                max,
            );
            sm::lock(&kept).enable(0);
            results.push_str(&xml);
        }
        if bind.carbons {
            crate::services::carbons::switch(handle, true);
        }
        if let Some(active) = bind.csi {
            handle.set_client_state(active);
        }
        tracing::debug!(%jid, carbons = bind.carbons, csi = ?bind.csi, "bound inline (XEP-0386)");
        let inner = format!("{before}{}", super::sasl2::bound(&results));
        super::sasl2::success(additional.as_deref(), jid.as_str(), &inner)
    }

    /// The ping timer: keeps a detached session's liveness, follows a resumed transport's own
    /// keepalives, and pings a silent client.
    fn on_ping_tick(&mut self) {
        if self.detached.is_some() {
            // Nobody is connected, and the server vouches for the session until
            // its window ends: no sweeper, here or on another node, announces it.
            self.live.beat.touch();
            return;
        }
        if !Arc::ptr_eq(&self.transport.beat, &self.live.beat)
            && self.transport.beat.last_ms() > self.live.beat.last_ms()
        {
            // A resumed stream's transport counts its own keepalives (WebSocket
            // Pongs); the session's liveness follows them.
            self.live.beat.touch();
        }
        // XEP-0199 §4.1 server-to-client ping after H of inbound silence; the
        // answer (result or error, either will do) is traffic, hence a beat.
        // RFC 7395 streams are pinged with WebSocket Ping frames by the adapter.
        if self.transport.kind == TransportKind::Tcp
            && self.live.silent_for(self.timings.heartbeat)
            && self.last_ping.elapsed() >= self.timings.heartbeat
        {
            self.last_ping = tokio::time::Instant::now();
            let ping = Element::new("iq", x::NS_CLIENT)
                .attr("type", "get")
                .attr("id", format!("lv-{}", new_id()))
                .attr("from", self.jid.domain().as_str())
                .attr("to", self.jid.as_str())
                .child(Element::new("ping", x::NS_PING));
            crate::node::outbox::to_handle(&self.handle, ping);
            self.shared
                .liveness
                .metrics
                .pings_sent
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The refresh timer: renews the liveness entry, and ends the session here when no
    /// sweeper could.
    fn on_refresh_tick(&mut self) -> ControlFlow<Option<StreamError>> {
        self.live.refresh(&self.shared.liveness);
        if self.detached.is_none() && self.live.locally_dead(&self.shared.liveness) {
            // No sweeper acted (Redis unreachable): end it here.
            self.live.mark_dead();
            return ControlFlow::Break(Some(liveness_timeout()));
        }
        ControlFlow::Continue(())
    }

    /// Any inbound traffic is a heartbeat, whitespace keepalives included: the
    /// reader reports those as soon as it reads them (RFC 6120 §4.6.1).
    fn on_traffic(&self, ev: &Result<StreamEvent, XmlError>) {
        if ev.is_ok() {
            self.transport.beat.touch();
            if !Arc::ptr_eq(&self.transport.beat, &self.live.beat) {
                self.live.beat.touch();
            }
        }
    }

    /// The writer ended by itself: it wrote the end of the stream, or the socket failed
    /// under it. The writer's end when the session is to be detached (the socket failed and
    /// the client can resume); `None` when the session ends.
    fn on_writer_end(&mut self, done: Option<WriterOut>) -> Option<WriterOut> {
        match done {
            Some(w) if w.end == WriterEnd::Failed && self.resumable.is_some() => Some(w),
            Some(w) => {
                self.leftover = Some(w.rx);
                None
            }
            None => None,
        }
    }

    /// Detaches the session from a connection that died (XEP-0198 §5), for longer with
    /// push enabled (XEP-0357).
    fn detach(&mut self, w: WriterOut) {
        let push = &self.services.push;
        let target = self
            .handle
            .read(|p| p.push.clone())
            .filter(|_| push.enabled());
        let heard = (
            self.transport.beat.last_ms(),
            self.shared.liveness.clock.now_ms(),
        );
        let keep = Keep::of(
            &self.resumable,
            target,
            push.hibernation(),
            self.timings.ttl,
            heard,
        );
        self.detached = Some(Detached::new(
            &self.shared,
            &self.handle,
            w,
            keep,
            &self.peer,
            &self.jid,
        ));
    }

    /// A push-enabled session detached for T: its contacts see it unavailable, with the
    /// last time its client was heard as its last seen; it stays resumable.
    async fn on_hibernate(&mut self) {
        let jid = &self.jid;
        tracing::info!(%jid, "client silent for the liveness timeout; session hibernates (XEP-0357)");
        let Some(at) = self.detached.as_ref().map(|d| d.last_heard) else {
            return;
        };
        self.hibernated_at = Some(at);
        // Boxed: a presence change is a deep future, which would otherwise size this
        // long-lived session future for as long as the session lives.
        Box::pin(self.services.presence.hibernate(&self.client, at)).await;
    }

    /// XEP-0198 §5: a new stream of the same account resumes this session. Its reader, to be
    /// read from now on; `None` when the session ends instead.
    async fn on_resume(&mut self, handoff: Box<sm::Handoff>) -> Option<Reader> {
        let (rx, csi) = match self.detached.take() {
            Some(Detached { rx, csi, .. }) => (rx, csi),
            None => {
                // The old connection still looked alive here; the client knows
                // better. It is dropped for the new one.
                self.stop.cancel();
                match wait_writer(&mut self.writer_task).await {
                    Some(w) => (w.rx, w.csi),
                    None => return None,
                }
            }
        };
        let sm::Handoff {
            h,
            reader,
            writer,
            peer: from,
            transport: over,
            taken,
            frame,
        } = *handoff;
        let kept = self.out.clone()?;
        let (prelude, resend) = {
            let mut o = sm::lock(&kept);
            // The registry checked h against the count; an h the count has
            // passed since acknowledges nothing more.
            let _ = o.ack(h);
            let id = self
                .resumable
                .as_ref()
                .map(|r| r.id.as_str())
                .unwrap_or_default();
            let resumed = sm::resumed(id, self.handled.unwrap_or(0));
            // The stanzas go again as they are kept: shared, not copied.
            (
                match frame {
                    Some(frame) => frame(self.jid.as_str(), &resumed),
                    None => resumed,
                },
                o.unacked().cloned().collect::<Vec<_>>(),
            )
        };
        let resent = resend.len();
        self.stop = CancellationToken::new();
        self.writer_task = Some(tokio::spawn(write_loop(Writing {
            writer,
            rx,
            kill: self.handle.kill.clone(),
            stop: self.stop.clone(),
            csi,
            out: Some(kept),
            prelude,
            resend,
            write_timeout: self.shared.live.get().limits.write_timeout,
        })));
        self.peer = from;
        self.client.peer = from;
        self.transport = over;
        self.live.beat.touch();
        self.last_ping = tokio::time::Instant::now();
        let _ = taken.send(());
        let (peer, jid) = (&self.peer, &self.jid);
        tracing::info!(%peer, %jid, resent, "stream resumed (XEP-0198)");
        // Seen unavailable while it hibernated: shown again to everyone who may see it.
        self.hibernated_at = None;
        Box::pin(self.services.presence.wake(&self.client)).await;
        Some(reader)
    }

    /// An item for a detached session: kept, through its CSI filter, for the stream that
    /// resumes it. `Break` when the session ends.
    fn on_detached_item(&mut self, event: Option<Outbound>) -> ControlFlow<()> {
        let jid = &self.jid;
        let Some(item) = event else {
            tracing::info!(%jid, "resumption window over; ending the session");
            return ControlFlow::Break(());
        };
        match item {
            // Replaced by a new bind of the resource, kicked, or shut down.
            Outbound::Close(_) | Outbound::End | Outbound::Finish => return ControlFlow::Break(()),
            Outbound::SmEnabled(_) | Outbound::SmNonza(_) => {}
            item => {
                let Some(d) = self.detached.as_mut() else {
                    return ControlFlow::Continue(());
                };
                let mut overflow = false;
                let Some(kept) = self.out.as_ref() else {
                    return ControlFlow::Break(());
                };
                if let Some(target) = &d.push {
                    // XEP-0357: the client sleeps; wake it for what would wake a person.
                    wake_for(&self.services.push, jid, target, &item);
                }
                d.csi.pass(item, |o| {
                    if let Some(s) = serialized(o) {
                        overflow |= sm::lock(kept).push(s).is_err();
                    }
                });
                if overflow {
                    tracing::info!(%jid, "too many unacknowledged stanzas for a detached session; ending it");
                    return ControlFlow::Break(());
                }
            }
        }
        ControlFlow::Continue(())
    }

    /// One event read from the client's stream. `Break` with the stream error to close with,
    /// if any, when the session ends.
    async fn on_event(
        &mut self,
        ev: Result<StreamEvent, XmlError>,
    ) -> ControlFlow<Option<StreamError>> {
        match ev {
            Ok(StreamEvent::Stanza(el)) => return self.on_stanza(el).await,
            Ok(StreamEvent::Whitespace) => {}
            Ok(StreamEvent::Close) => {
                // RFC 6120 §4.4: answer the closing tag with ours.
                let _ = self.handle.try_end();
                return ControlFlow::Break(None);
            }
            Ok(StreamEvent::Open(_)) => {
                return ControlFlow::Break(Some(StreamError::new(
                    StreamCondition::NotWellFormed,
                    "second stream header",
                )));
            }
            Err(e) => match StreamError::of_xml(&e) {
                Some(err) => return ControlFlow::Break(Some(err)),
                // The connection died without a closing tag: XEP-0198 §5 lets the
                // client resume, if it asked to be able to.
                None if self.resumable.is_some() => {
                    self.stop.cancel();
                    match wait_writer(&mut self.writer_task).await {
                        Some(w) => self.detach(w),
                        None => return ControlFlow::Break(None),
                    }
                }
                None => return ControlFlow::Break(None),
            },
        }
        ControlFlow::Continue(())
    }

    /// One stanza or nonza from the client: within its rate, a stream management nonza is
    /// answered here, anything else is routed and counted (XEP-0198).
    async fn on_stanza(&mut self, el: Element) -> ControlFlow<Option<StreamError>> {
        let now = self.shared.liveness.clock.instant();
        if let Err(err) = self.rate.take(&self.shared.metrics, now) {
            return ControlFlow::Break(Some(err));
        }
        if let Some(nonza) = sm::Nonza::parse(&el) {
            let answer = stream_management(
                &self.shared,
                &self.handle,
                &mut self.out,
                &mut self.handled,
                &mut self.resumable,
                nonza,
            );
            return match answer {
                Err(err) => ControlFlow::Break(Some(err)),
                Ok(_) => ControlFlow::Continue(()),
            };
        }
        // XEP-0198 §4: only stanzas are counted, not nonzas such as XEP-0352's.
        let stanza =
            el.ns == x::NS_CLIENT && matches!(el.name.as_str(), "message" | "presence" | "iq");
        // Boxed: routing a stanza can be a deep future (store queries, fan-out);
        // boxing keeps that state out of this long-lived future while idle.
        // Nothing is read while it runs: the client is not silent meanwhile.
        let busy = self.transport.beat.busy();
        let outcome = Box::pin(handle_stanza(&self.services, &self.client, el)).await;
        drop(busy);
        if let Err(err) = outcome {
            return ControlFlow::Break(Some(err));
        }
        if let Some(h) = self.handled.as_mut().filter(|_| stanza) {
            *h = h.wrapping_add(1);
        }
        ControlFlow::Continue(())
    }

    /// The end of the session, once nothing is read any more: no resumption, the stream
    /// error if any, out of the registry, the writer flushed and stopped, unacknowledged
    /// stanzas returned, and the presence consequences.
    async fn end(self, end: Option<StreamError>) {
        let SessionLoop {
            shared,
            services,
            peer,
            jid,
            handle,
            client,
            mut writer_task,
            live,
            out,
            mut resumable,
            detached,
            leftover,
            ..
        } = self;
        // No new stream can take this session over any more.
        if let Some(r) = resumable.take() {
            shared.resumable.remove(&r.id);
        }
        if let Some(err) = end {
            tracing::info!(%peer, %jid, error = %err, "closing session with stream error");
            handle.close(err);
        }
        shared.sessions.unregister(&handle);
        if shared.sessions.get(&jid).is_none() {
            // Not taken over by a newer session here (that one holds the entry now).
            shared.cluster.release(&jid);
        }
        // Let the writer flush what is queued (bounded by the mailbox), then stop it. A
        // silent peer is not waited for: its contacts must hear about it now.
        let flush = if live.dead_at().is_some() {
            Duration::from_millis(200)
        } else {
            Duration::from_secs(5)
        };
        let mut rest = leftover.or(detached.map(|Detached { rx, .. }| rx));
        if writer_task.is_some() {
            let _ = tokio::time::timeout(flush, async {
                handle.finish();
                if let Some(w) = wait_writer(&mut writer_task).await {
                    rest = Some(w.rx);
                }
            })
            .await;
        }
        handle.kill.cancel();
        tracing::info!(%peer, %jid, "session ended");
        if let Some(kept) = &out {
            // XEP-0198: what the client did not acknowledge is not lost with the session.
            Box::pin(return_unacked(&services.presence, &jid, kept, rest)).await;
        }
        // Unavailable now (silent death) or after the grace period (close or drop).
        Box::pin(crate::services::lifecycle::session_over(
            services.lifecycle.clone(),
            client,
            live,
        ))
        .await;
    }
}

/// Notifies `target` if `item`, queued for detached session `jid`, is worth waking its
/// client for ([`crate::services::push::Trigger`]).
fn wake_for(
    push: &crate::services::push::Push,
    jid: &FullJid,
    target: &Arc<crate::node::sessions::PushTarget>,
    item: &Outbound,
) {
    let parsed;
    let el = match item {
        Outbound::Stanza(el) => &**el,
        Outbound::Xml(xml) if xml.starts_with("<message") || xml.starts_with("<presence") => {
            match x::parse_element(xml) {
                Some(el) => {
                    parsed = el;
                    &parsed
                }
                None => return,
            }
        }
        _ => return,
    };
    if let Some(trigger) = crate::services::push::Trigger::of(el) {
        push.notify(&jid.to_bare(), target.clone(), &trigger);
    }
}

/// Waits for the writer task, if there is one, and clears it; never completes without one.
pub(super) async fn wait_writer(
    task: &mut Option<tokio::task::JoinHandle<WriterOut>>,
) -> Option<WriterOut> {
    let Some(t) = task.as_mut() else {
        return std::future::pending().await;
    };
    let done = t.await;
    *task = None;
    done.ok()
}

/// The next event of a bound session's stream, with the reader handed back so the session
/// loop can start the next read. Owning the reader (rather than borrowing it) is what lets
/// the loop keep this future pinned across `select!` iterations. Without a reader (the
/// stream ended) it never completes.
pub(super) async fn next_event(reader: Option<Reader>) -> (Reader, Result<StreamEvent, XmlError>) {
    let Some(mut reader) = reader else {
        return std::future::pending().await;
    };
    let ev = reader.next().await;
    (reader, ev)
}

/// Checks and stamps one stanza from the client (RFC 6120 §8.1.2.1), then routes it.
pub(super) async fn handle_stanza(
    services: &crate::services::Services,
    session: &Client,
    mut el: Element,
) -> Result<(), StreamError> {
    if let Some(active) = crate::services::csi::nonza(&el) {
        // XEP-0352 §5: a nonza, not a stanza; it is never answered.
        tracing::debug!(peer = %session.peer, jid = %session.jid(), active, "client state");
        session.handle.set_client_state(active);
        return Ok(());
    }
    if el.ns != x::NS_CLIENT || !matches!(el.name.as_str(), "message" | "presence" | "iq") {
        // RFC 6120 §4.9.3.22.
        return Err(StreamError::new(
            StreamCondition::UnsupportedStanzaType,
            format!("<{}/> in {} is not a stanza", el.name, el.ns),
        ));
    }
    if let Some(from) = el.get_attr("from") {
        // RFC 6120 §8.1.2.1: a from that is not this session's JID is an invalid-from.
        let ok = crate::protocol::jid::parse(from).is_ok_and(|j| {
            j.as_str() == session.jid().as_str() || j.as_str() == session.jid().to_bare().as_str()
        });
        if !ok {
            return Err(StreamError::new(
                StreamCondition::InvalidFrom,
                "the from address is not this session's",
            ));
        }
    }
    el.set_attr("from", session.jid().to_string());
    router::from_client(services, session, el).await;
    Ok(())
}
