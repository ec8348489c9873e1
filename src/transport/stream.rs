//! One XML stream over any transport, the same for clients (`jabber:client`) and servers
//! (`jabber:server`): the reader half parsed into events, the writer half raw; writing
//! strings and elements, reading elements, and the restart after TLS or SASL (RFC 6120
//! §4.3.3), which hands the transport back by value so it can be upgraded and a new stream
//! built on what the upgrade returns.
//!
//! c2s and s2s both import it; it imports neither.

use std::time::Duration;

use tokio::io::{AsyncWriteExt, ReadHalf, WriteHalf};

use crate::node::io::BoxIo;
use crate::protocol::error::{StreamCondition, StreamError};
use crate::protocol::xml::reader::{
    ReaderLimits, StreamEvent, StreamHeader, StreamReader, XmlError,
};
use crate::protocol::xml::{Element, NS_STREAM};

/// How reading or writing a stream ended early.
#[derive(Debug)]
pub enum Fail {
    /// Send (or we received) this stream error; the stream is over.
    Stream(StreamError),
    /// The peer closed the stream cleanly (`</stream:stream>`).
    Closed,
    /// The transport broke or the peer vanished without closing the stream.
    Gone,
}

impl From<XmlError> for Fail {
    fn from(e: XmlError) -> Self {
        StreamError::of_xml(&e).map_or(Fail::Gone, Fail::Stream)
    }
}

impl From<std::io::Error> for Fail {
    fn from(_: std::io::Error) -> Self {
        Fail::Gone
    }
}

/// The reader half. Boxed: the reader is a few hundred bytes and is moved from a
/// negotiation into a session loop's read future; inline, each async frame it passes
/// through would reserve room for it (async-fn arguments are stored next to the locals
/// they are moved into).
pub(crate) type Reader = Box<StreamReader<ReadHalf<BoxIo>>>;

/// An XML stream: the parsed reader half, the raw writer half, and the stream's content
/// namespace (the one elements are written in without an `xmlns`).
pub struct XmlStream {
    reader: Reader,
    writer: WriteHalf<BoxIo>,
    limits: ReaderLimits,
    content_ns: &'static str,
}

/// How long closing a stream may take before the transport is shut down regardless.
const CLOSE_WRITE: Duration = Duration::from_secs(2);

impl XmlStream {
    /// Wraps a transport (TCP, TLS, or the byte stream of a WebSocket adapter).
    pub fn new(io: BoxIo, limits: ReaderLimits, content_ns: &'static str) -> Self {
        let (r, w) = tokio::io::split(io);
        Self::from_halves(
            Box::new(StreamReader::new(r, limits)),
            w,
            limits,
            content_ns,
        )
    }

    /// Puts back together what [`XmlStream::split`] took apart.
    pub fn from_halves(
        reader: Reader,
        writer: WriteHalf<BoxIo>,
        limits: ReaderLimits,
        content_ns: &'static str,
    ) -> Self {
        XmlStream {
            reader,
            writer,
            limits,
            content_ns,
        }
    }

    /// The transport back, for a TLS upgrade.
    pub fn into_io(self) -> BoxIo {
        self.reader.into_inner().unsplit(self.writer)
    }

    /// The halves, for a reader and a writer that run independently (reading is not
    /// cancel-safe, so it never shares a `select!` with writing).
    pub fn split(self) -> (Reader, WriteHalf<BoxIo>) {
        (self.reader, self.writer)
    }

    /// The reader's limits.
    pub fn limits(&self) -> ReaderLimits {
        self.limits
    }

    /// A fresh parser on the same transport (RFC 6120 §4.3.3 stream restart).
    pub fn restart(self) -> Self {
        let limits = self.limits;
        self.restart_with(limits)
    }

    /// A restart whose parser has other limits (after authentication, RFC 6120 §6.4.6).
    pub fn restart_with(self, limits: ReaderLimits) -> Self {
        let ns = self.content_ns;
        XmlStream::new(self.into_io(), limits, ns)
    }

    /// The same stream and parser with other limits from the next stanza on: an
    /// authentication that continues the stream rather than restarting it (XEP-0388).
    pub fn set_limits(&mut self, limits: ReaderLimits) {
        self.reader.set_limits(limits);
        self.limits = limits;
    }

    /// Writes and flushes raw XML.
    pub async fn write(&mut self, s: &str) -> std::io::Result<()> {
        self.writer.write_all(s.as_bytes()).await?;
        self.writer.flush().await
    }

    /// Writes an element, in the stream's content namespace where it is in `jabber:client`.
    pub async fn write_element(&mut self, el: &Element) -> std::io::Result<()> {
        let mut out = String::new();
        el.write_to(&mut out, self.content_ns, self.content_ns);
        self.write(&out).await
    }

    /// Writes a stream error and closes the stream (RFC 6120 §4.9.1).
    pub async fn fail(&mut self, err: &StreamError) {
        let out = format!("{}</stream:stream>", err.to_xml());
        let _ = tokio::time::timeout(CLOSE_WRITE, self.write(&out)).await;
        let _ = self.writer.shutdown().await;
    }

    /// Closes the stream cleanly.
    pub async fn close(&mut self) {
        let _ = tokio::time::timeout(CLOSE_WRITE, self.write("</stream:stream>")).await;
        let _ = self.writer.shutdown().await;
    }

    /// The next raw event.
    pub async fn next(&mut self) -> Result<StreamEvent, Fail> {
        Ok(self.reader.next().await?)
    }

    /// The peer's stream header.
    pub async fn read_header(&mut self) -> Result<StreamHeader, Fail> {
        loop {
            match self.next().await? {
                StreamEvent::Open(h) => return Ok(h),
                StreamEvent::Whitespace => continue,
                StreamEvent::Close => return Err(Fail::Closed),
                StreamEvent::Stanza(_) => {
                    return Err(Fail::Stream(StreamError::new(
                        StreamCondition::NotWellFormed,
                        "element before the stream header",
                    )))
                }
            }
        }
    }

    /// The next top-level element, skipping keepalives. A received `<stream:error/>` ends
    /// the stream as [`Fail::Stream`] (RFC 6120 §4.9.1.1: a stream error is unrecoverable).
    pub async fn next_element(&mut self) -> Result<Element, Fail> {
        loop {
            match self.next().await? {
                StreamEvent::Stanza(el) if el.is("error", NS_STREAM) => {
                    let cond = el
                        .elements()
                        .find(|c| c.name != "text")
                        .map(|c| c.name.clone())
                        .unwrap_or_default();
                    tracing::info!(condition = %cond, "peer sent a stream error");
                    return Err(Fail::Stream(StreamError::new(
                        StreamCondition::UndefinedCondition,
                        format!("peer error: {cond}"),
                    )));
                }
                StreamEvent::Stanza(el) => return Ok(el),
                StreamEvent::Whitespace => continue,
                StreamEvent::Close => return Err(Fail::Closed),
                StreamEvent::Open(_) => {
                    return Err(Fail::Stream(StreamError::new(
                        StreamCondition::NotWellFormed,
                        "second stream header",
                    )))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    use super::*;
    use crate::protocol::xml::{NS_CLIENT, NS_SERVER};

    const HEADER: &str = "<stream:stream xmlns='jabber:client' \
        xmlns:stream='http://etherx.jabber.org/streams' to='a.example' version='1.0'>";

    fn pair(content_ns: &'static str) -> (XmlStream, DuplexStream) {
        let (ours, theirs) = tokio::io::duplex(1 << 16);
        let stream = XmlStream::new(Box::new(ours), ReaderLimits::default(), content_ns);
        (stream, theirs)
    }

    #[tokio::test]
    async fn a_restart_reads_a_new_header_on_the_same_transport() {
        let (stream, mut peer) = pair(NS_CLIENT);
        let mut stream = stream;
        peer.write_all(HEADER.as_bytes()).await.unwrap();
        assert_eq!(stream.read_header().await.unwrap().name, "stream");
        // RFC 6120 §4.3.3: after the restart the peer sends a whole new header, read by
        // a fresh parser on the transport the first one read from.
        let mut stream = stream.restart();
        peer.write_all(HEADER.as_bytes()).await.unwrap();
        peer.write_all(b"<presence/>").await.unwrap();
        assert_eq!(stream.read_header().await.unwrap().name, "stream");
        assert_eq!(stream.next_element().await.unwrap().name, "presence");
        // And the transport comes back whole, for an upgrade.
        let mut io = stream.into_io();
        io.write_all(b"x").await.unwrap();
        let mut got = [0u8; 1];
        peer.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"x");
    }

    #[tokio::test]
    async fn a_close_and_a_peer_stream_error_each_end_reading() {
        let (mut stream, mut peer) = pair(NS_CLIENT);
        peer.write_all(HEADER.as_bytes()).await.unwrap();
        peer.write_all(b"</stream:stream>").await.unwrap();
        stream.read_header().await.unwrap();
        assert!(matches!(stream.next_element().await, Err(Fail::Closed)));

        let (mut stream, mut peer) = pair(NS_SERVER);
        peer.write_all(HEADER.as_bytes()).await.unwrap();
        peer.write_all(
            b"<stream:error><host-unknown xmlns='urn:ietf:params:xml:ns:xmpp-streams'/>\
              </stream:error>",
        )
        .await
        .unwrap();
        stream.read_header().await.unwrap();
        match stream.next_element().await {
            Err(Fail::Stream(e)) => assert!(e.to_xml().contains("undefined-condition")),
            other => panic!("expected the end of the stream, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn elements_are_written_in_the_stream_content_namespace() {
        let message = Element::new("message", NS_CLIENT).attr("to", "b@b.example");
        for ns in [NS_CLIENT, NS_SERVER] {
            let (mut stream, mut peer) = pair(ns);
            stream.write_element(&message).await.unwrap();
            drop(stream);
            let mut out = String::new();
            peer.read_to_string(&mut out).await.unwrap();
            assert_eq!(out, "<message to='b@b.example'/>", "on a {ns} stream");
        }
    }
}
