//! The writer of a client connection: drains the session's mailbox onto the socket.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncWriteExt, WriteHalf};
use tokio_util::sync::CancellationToken;

use super::BoxIo;
use crate::node::sessions::Outbound;
use crate::node::stream_management as sm;
use crate::protocol::error::{StreamCondition, StreamError};
use crate::protocol::xml as x;

/// The stanza an outbound item writes, as the bytes kept for XEP-0198; `None` for what is
/// not a stanza.
pub(super) fn serialized(item: Outbound) -> Option<Arc<String>> {
    match item {
        Outbound::Stanza(el) => {
            let mut s = String::new();
            el.write_to(&mut s, x::NS_CLIENT, x::NS_CLIENT);
            Some(Arc::new(s))
        }
        Outbound::Xml(xml) => Some(xml),
        _ => None,
    }
}

/// Bytes gathered into one write before it is made.
const BATCH: usize = 64 * 1024;

/// How a writer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WriterEnd {
    /// It wrote the end of the stream (or was told to finish).
    Closed,
    /// The socket failed or stalled: the connection is gone.
    Failed,
    /// The session stopped it (detached, resumed elsewhere, killed).
    Stopped,
}

/// What a writer task is given.
pub(super) struct Writing {
    pub(super) writer: WriteHalf<BoxIo>,
    pub(super) rx: crate::node::sessions::Mailbox,
    /// The session's end.
    pub(super) kill: CancellationToken,
    /// This writer's end (a detach or a resume).
    pub(super) stop: CancellationToken,
    pub(super) csi: crate::services::csi::Filter,
    /// The XEP-0198 counters, once `<enabled/>` was written.
    pub(super) out: Option<sm::SharedOutgoing>,
    /// Written before anything from the mailbox (a resumption's `<resumed/>`).
    pub(super) prelude: String,
    /// Written after the prelude, before anything from the mailbox: the stanzas a
    /// resumption sends again (XEP-0198 §5), shared with the unacknowledged queue that
    /// still holds them, written in batches as the mailbox's items are, never copied into
    /// one string.
    pub(super) resend: Vec<Arc<String>>,
    /// `[limits] write_timeout`: how long one write may wait for the client to read.
    pub(super) write_timeout: Duration,
}

/// What a writer hands back: the mailbox and filter, for the session to go on with.
pub(super) struct WriterOut {
    pub(super) rx: crate::node::sessions::Mailbox,
    pub(super) csi: crate::services::csi::Filter,
    pub(super) end: WriterEnd,
}

/// Drains a session's mailbox onto the socket, batching what is already queued into one
/// write so a burst of presence costs one TLS record and one syscall, not one per stanza.
///
/// Stanzas pass the session's XEP-0352 filter ([`crate::services::csi::Filter`]) on the way, which
/// holds presence while the client says it is inactive. Once XEP-0198 is enabled every
/// stanza written is kept until the client acknowledges it ([`sm::Outgoing`]), and a batch
/// that leaves some unacknowledged ends with `<r/>` unless one is outstanding; more than
/// `[limits] sm_max_unacked` stanzas or `sm_max_unacked_bytes` bytes ends the stream with
/// `resource-constraint` (RFC 6120 §4.9.3.17: the server cannot keep more for this client).
///
/// The session's `kill` stops it at once, even in the middle of a write: a session ended
/// for a full mailbox has a client that reads nothing, and what this task holds (its batch
/// and the mailbox) is given back now rather than after the write's timeout.
pub(super) async fn write_loop(w: Writing) -> WriterOut {
    let Writing {
        mut writer,
        mut rx,
        kill,
        stop,
        mut csi,
        mut out,
        prelude,
        resend,
        write_timeout,
    } = w;
    let mut buf = prelude;
    let mut resend = resend.into_iter().peekable();
    let mut end = WriterEnd::Closed;
    // Stanzas written before `<enabled/>`: a client may count some of them
    // ([`sm::Outgoing::read`]).
    let mut crossing: u32 = 0;
    loop {
        let mut closing = false;
        if resend.peek().is_some() {
            while let Some(s) = resend.next_if(|_| buf.len() <= BATCH) {
                buf.push_str(&s);
            }
        } else if buf.is_empty() {
            let first = tokio::select! {
                biased;
                m = rx.recv() => m,
                _ = kill.cancelled() => None,
                _ = stop.cancelled() => None,
            };
            let Some(first) = first else {
                end = WriterEnd::Stopped;
                break;
            };
            let mut next = Some(first);
            let mut overflow = false;
            while let Some(msg) = next.take() {
                closing = batch_item(
                    msg,
                    &mut buf,
                    &mut csi,
                    &mut out,
                    &mut crossing,
                    &mut overflow,
                );
                if closing || overflow || buf.len() > BATCH {
                    break;
                }
                next = rx.try_recv();
            }
            if overflow {
                let err = StreamError::new(
                    StreamCondition::ResourceConstraint,
                    "too many stanzas not acknowledged (XEP-0198)",
                );
                buf.push_str(&err.to_xml());
                buf.push_str("</stream:stream>");
                closing = true;
            } else if !closing && out.as_ref().is_some_and(|o| sm::lock(o).should_request()) {
                buf.push_str(sm::REQUEST);
            }
        }
        if !buf.is_empty() {
            let wrote = tokio::select! {
                // A client that reads nothing is a dropped connection: its socket, its
                // mailbox and its place under max_connections go.
                r = tokio::time::timeout(write_timeout, async {
                    writer.write_all(buf.as_bytes()).await?;
                    writer.flush().await
                }) => r,
                _ = stop.cancelled() => {
                    end = WriterEnd::Stopped;
                    break;
                }
                _ = kill.cancelled() => {
                    end = WriterEnd::Stopped;
                    break;
                }
            };
            if !matches!(wrote, Ok(Ok(()))) {
                end = WriterEnd::Failed;
                break;
            }
            // Free the batch buffer after each write: most sessions write rarely, and a
            // buffer kept at the size of the last burst is held by every idle session.
            buf = String::new();
        }
        if closing {
            break;
        }
    }
    if end == WriterEnd::Closed {
        let _ = tokio::time::timeout(Duration::from_secs(2), writer.shutdown()).await;
    }
    WriterOut { rx, csi, end }
}

/// Adds one mailbox item to the batch in `buf`: a stanza through the CSI filter (kept for
/// XEP-0198 once enabled, `overflow` set when too many are unacknowledged, counted in
/// `crossing` before), stream management's own nonzas, or the end of the stream. Whether
/// the stream closes after this batch.
fn batch_item(
    msg: Outbound,
    buf: &mut String,
    csi: &mut crate::services::csi::Filter,
    out: &mut Option<sm::SharedOutgoing>,
    crossing: &mut u32,
    overflow: &mut bool,
) -> bool {
    match msg {
        item @ (Outbound::Stanza(_)
        | Outbound::Xml(_)
        | Outbound::ClientState(_)
        | Outbound::Interest(_)) => csi.pass(item, |item| match (&*out, item) {
            (None, item) => {
                match item {
                    Outbound::Stanza(el) => el.write_to(buf, x::NS_CLIENT, x::NS_CLIENT),
                    Outbound::Xml(xml) => buf.push_str(&xml),
                    _ => return,
                }
                *crossing = crossing.saturating_add(1);
            }
            (Some(kept), item) => {
                if let Some(s) = serialized(item) {
                    buf.push_str(&s);
                    *overflow |= sm::lock(kept).push(s).is_err();
                }
            }
        }),
        Outbound::SmEnabled(enabled) => {
            let sm::Enabled { xml, out: kept } = *enabled;
            buf.push_str(&xml);
            // §4: the count starts with the first stanza after <enabled/>.
            sm::lock(&kept).enable(*crossing);
            *out = Some(kept);
        }
        Outbound::SmNonza(xml) => buf.push_str(&xml),
        Outbound::Close(err) => {
            buf.push_str(&err.to_xml());
            buf.push_str("</stream:stream>");
            return true;
        }
        Outbound::End => {
            buf.push_str("</stream:stream>");
            return true;
        }
        Outbound::Finish => return true,
    }
    false
}
