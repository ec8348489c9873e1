//! One `jabber:server` XML stream over any transport, shared by both directions: writing
//! raw strings and stanzas, reading elements, restarting after TLS or SASL.

use tokio::io::{AsyncWriteExt, ReadHalf, WriteHalf};

use crate::error::StreamCondition;
use crate::error::StreamError;
use crate::tls::BoxIo;
use crate::xml::reader::{ReaderLimits, StreamEvent, StreamHeader, StreamReader, XmlError};
use crate::xml::{Element, NS_SERVER, NS_STREAM};

use super::dialback::NS_DIALBACK;

/// How reading a stream ended early.
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

/// A server stream: the reader half parsed into events, the writer half raw.
pub struct S2sStream {
    reader: StreamReader<ReadHalf<BoxIo>>,
    writer: WriteHalf<BoxIo>,
    limits: ReaderLimits,
}

/// The opening tag of a server stream (RFC 6120 §4.7) declaring the dialback prefix
/// (XEP-0220 §2.1: peers look for it to know dialback is spoken).
pub fn header(from: Option<&str>, to: Option<&str>, id: Option<&str>) -> String {
    let mut out = format!(
        "<?xml version='1.0'?><stream:stream xmlns='{NS_SERVER}' xmlns:stream='{NS_STREAM}' \
         xmlns:db='{NS_DIALBACK}' version='1.0'"
    );
    for (k, v) in [("from", from), ("to", to), ("id", id)] {
        if let Some(v) = v {
            out.push_str(&format!(" {k}='{}'", crate::xml::escape(v)));
        }
    }
    out.push_str(" xml:lang='en'>");
    out
}

impl S2sStream {
    /// Wraps a transport (TCP or TLS).
    pub fn new(io: BoxIo, limits: ReaderLimits) -> Self {
        let (r, w) = tokio::io::split(io);
        S2sStream {
            reader: StreamReader::new(r, limits),
            writer: w,
            limits,
        }
    }

    /// The transport back, for a TLS upgrade.
    pub fn into_io(self) -> BoxIo {
        self.reader.into_inner().unsplit(self.writer)
    }

    /// The halves, for a reader task and a writer that run independently (reading is not
    /// cancel-safe, so it never shares a `select!` with writing).
    pub fn split(self) -> (StreamReader<ReadHalf<BoxIo>>, WriteHalf<BoxIo>) {
        (self.reader, self.writer)
    }

    /// A fresh parser on the same transport (RFC 6120 §4.3.3 stream restart).
    pub fn restart(self) -> Self {
        let limits = self.limits;
        S2sStream::new(self.into_io(), limits)
    }

    /// Writes and flushes raw XML.
    pub async fn write(&mut self, s: &str) -> std::io::Result<()> {
        self.writer.write_all(s.as_bytes()).await?;
        self.writer.flush().await
    }

    /// Writes a stanza in the `jabber:server` namespace.
    pub async fn write_stanza(&mut self, el: &Element) -> std::io::Result<()> {
        let mut out = String::new();
        el.write_to(&mut out, NS_SERVER, NS_SERVER);
        self.write(&out).await
    }

    /// Writes a stream error and closes the stream (RFC 6120 §4.9.1).
    pub async fn fail(&mut self, err: &StreamError) {
        let out = format!("{}</stream:stream>", err.to_xml());
        let _ = tokio::time::timeout(std::time::Duration::from_secs(2), self.write(&out)).await;
        let _ = self.writer.shutdown().await;
    }

    /// Closes the stream cleanly.
    pub async fn close(&mut self) {
        let _ = tokio::time::timeout(
            std::time::Duration::from_secs(2),
            self.write("</stream:stream>"),
        )
        .await;
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
    /// the stream as [`Fail::Stream`].
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
