//! The invariants the fuzz targets check on `presenced::protocol::xml::reader::parse_chunks`.
//!
//! Kept in a library so both targets (classic stream, RFC 7395 framed) and the seed replay test
//! share one definition of "correct".
//!
//! Input layout (so libFuzzer's mutations reach limits and split points as well as the XML):
//!
//! | byte      | meaning                                                              |
//! |-----------|----------------------------------------------------------------------|
//! | 0         | bits 0-2: `max_stanza_size` from [`STANZA_SIZES`]; bits 3-5: `max_depth` from [`DEPTHS`]; bits 6-7: cost limits from [`COSTS`] |
//! | 1         | number of split points `k` = byte % 9                                 |
//! | 2..2+2k   | split points, u16 little-endian, each taken modulo (document length + 1) |
//! | rest      | the document                                                          |
//!
//! Missing header bytes read as zero, so every byte string is a valid input.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use presenced::protocol::xml::reader::{parse_chunks, ReaderLimits, StreamEvent, StreamReader, XmlError};
use presenced::protocol::xml::Element;
use tokio::io::{AsyncRead, ReadBuf};

/// Stanza size limits the first byte chooses between; small ones so the limit path is hit.
pub const STANZA_SIZES: [usize; 8] = [8, 32, 64, 128, 512, 4096, 65536, 256 * 1024];
/// Depth limits the first byte chooses between.
pub const DEPTHS: [usize; 8] = [0, 1, 2, 3, 4, 8, 16, 64];
/// Stanza cost limits (elements plus attributes per stanza, attributes per element, namespace
/// declarations in scope) the first byte's bits 6-7 choose between; `None` keeps the
/// server's defaults. Small ones so each limit's path is hit.
pub const COSTS: [Option<(usize, usize, usize)>; 4] =
    [None, Some((4, 2, 3)), Some((16, 4, 4)), Some((64, 8, 6))];

/// The stream header a classic-mode stanza is re-parsed inside.
pub const SYNTHETIC_HEADER: &str = "<stream:stream xmlns='jabber:client' \
    xmlns:stream='http://etherx.jabber.org/streams'>";

/// A fuzz input decoded into limits, split points and document.
#[derive(Debug)]
pub struct Case<'a> {
    /// Limits for the parse under test.
    pub limits: ReaderLimits,
    /// Sorted, deduplicated split offsets into `doc`, each in `0..=doc.len()`.
    pub splits: Vec<usize>,
    /// The bytes of the stream.
    pub doc: &'a [u8],
}

impl<'a> Case<'a> {
    /// Decodes raw fuzzer bytes (see the module docs for the layout).
    pub fn decode(data: &'a [u8]) -> Self {
        let b0 = data.first().copied().unwrap_or(0);
        let limits = ReaderLimits {
            max_stanza_size: STANZA_SIZES[usize::from(b0 & 7)],
            max_depth: DEPTHS[usize::from((b0 >> 3) & 7)],
            ..ReaderLimits::default()
        };
        let limits = match COSTS[usize::from(b0 >> 6)] {
            None => limits,
            Some((nodes, attributes, namespaces)) => ReaderLimits {
                max_stanza_nodes: nodes,
                max_attributes: attributes,
                max_namespace_declarations: namespaces,
                ..limits
            },
        };
        let k = usize::from(data.get(1).copied().unwrap_or(0) % 9);
        let head = (2 + 2 * k).min(data.len());
        let doc = &data[head..];
        let mut splits: Vec<usize> = data[2.min(data.len())..head]
            .chunks(2)
            .map(|p| {
                let v = u16::from_le_bytes([p[0], p.get(1).copied().unwrap_or(0)]);
                usize::from(v) % (doc.len() + 1)
            })
            .collect();
        splits.sort_unstable();
        splits.dedup();
        Case {
            limits,
            splits,
            doc,
        }
    }

    /// The document cut at the split points (empty chunks included: the reader must skip them).
    pub fn chunks(&self) -> Vec<&'a [u8]> {
        let mut out = Vec::with_capacity(self.splits.len() + 1);
        let mut at = 0;
        for &s in &self.splits {
            out.push(&self.doc[at..s]);
            at = s;
        }
        out.push(&self.doc[at..]);
        out
    }
}

/// Errors compared for split invariance: variant and payload, via `Debug`.
fn err_key(e: &Option<XmlError>) -> Option<String> {
    e.as_ref().map(|e| format!("{e:?}"))
}

/// Checks the error maps to a condition, and to none only for transport loss. That the
/// condition is one RFC 6120 §4.9.3 defines is `StreamCondition`'s type.
pub fn check_error(e: &XmlError) {
    match (e, e.condition()) {
        (XmlError::Eof | XmlError::Io(_), Some(c)) => {
            panic!("transport loss {e:?} mapped to condition {c}")
        }
        (XmlError::Eof | XmlError::Io(_), None) | (_, Some(_)) => {}
        (_, None) => panic!("stream error {e:?} has no condition"),
    }
}

/// Checks a stanza survives `to_xml` and a re-parse inside [`SYNTHETIC_HEADER`] unchanged.
pub fn check_roundtrip(el: &Element, max_depth: usize) {
    let doc = format!("{SYNTHETIC_HEADER}{}", el.to_xml());
    // Escaping may make the re-serialisation larger than the original, so no size limit here.
    // Nor a cost limit: re-serialising may declare a namespace the original inherited.
    let limits = ReaderLimits::trusted(usize::MAX / 2, max_depth);
    let (evs, err) = parse_chunks(&[doc.as_bytes()], limits, false);
    assert!(
        err.is_none(),
        "re-parse of {el:?} failed: {err:?}\nserialised: {doc}"
    );
    assert_eq!(
        evs.len(),
        2,
        "re-parse of {el:?} gave {evs:?}\nserialised: {doc}"
    );
    assert!(matches!(evs[0], StreamEvent::Open(_)), "{evs:?}");
    match &evs[1] {
        StreamEvent::Stanza(back) => {
            assert_eq!(back, el, "round trip changed the stanza\nserialised: {doc}")
        }
        other => panic!("re-parse of {el:?} gave {other:?}\nserialised: {doc}"),
    }
}

/// Bugs already reported, with a failing (`#[ignore]`d) unit test in `src/protocol/xml/reader.rs`.
///
/// Without the `strict` feature the targets step around exactly these input classes so a run
/// can find something new instead of rediscovering them; `--features strict` checks everything.
/// Remove an entry when its bug is fixed. None is open at present (fuzz/README.md).
pub mod known {
    use presenced::protocol::xml::Element;

    /// Stanza shapes whose `to_xml` does not re-parse to an equal element.
    pub fn roundtrip_breaker(_el: &Element) -> bool {
        false
    }
}

/// An in-memory transport that hands out the chunks one read at a time, like a socket would.
struct ChunkedIo<'a> {
    chunks: Vec<&'a [u8]>,
    next: usize,
}

impl AsyncRead for ChunkedIo<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        while let Some(chunk) = self.chunks.get(self.next).copied() {
            if chunk.is_empty() {
                self.next += 1;
                continue;
            }
            let n = chunk.len().min(buf.remaining());
            buf.put_slice(&chunk[..n]);
            if n == chunk.len() {
                self.next += 1;
            } else {
                let i = self.next;
                self.chunks[i] = &chunk[n..];
            }
            return Poll::Ready(Ok(()));
        }
        Poll::Ready(Ok(()))
    }
}

thread_local! {
    static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a current-thread runtime needs no resources that can be missing");
}

/// Reads the chunks through the async socket reader (`StreamReader`) until its first error.
/// End of input reads as `Eof` there, where `parse_chunks` reports no error.
pub fn read_async(chunks: &[&[u8]], limits: ReaderLimits) -> (Vec<StreamEvent>, XmlError) {
    let io = ChunkedIo {
        chunks: chunks.to_vec(),
        next: 0,
    };
    RUNTIME.with(|rt| {
        rt.block_on(async {
            let mut reader = StreamReader::new(io, limits);
            let mut out = Vec::new();
            loop {
                match reader.next().await {
                    Ok(ev) => out.push(ev),
                    Err(e) => return (out, e),
                }
            }
        })
    })
}

/// The socket reader must agree with `parse_chunks`, which the rest of the checks rely on:
/// same events, and the same error, with `Eof` standing for "no error". Allowed differences:
/// the socket reader may report policy-violation (its read budget of stanza limit plus one
/// read buffer ran out) where `parse_chunks` had not yet seen the error it reports; and it
/// reports whitespace between stanzas as soon as it has read it (RFC 6120 §4.6.1: a
/// keepalive is traffic when it arrives), so one run of whitespace may be several events,
/// and the whitespace before text that is refused at stream level is reported before the
/// error where `parse_chunks` saw one refused text run.
pub fn check_async_agrees(
    chunks: &[&[u8]],
    limits: ReaderLimits,
    evs: &[StreamEvent],
    err: &Option<XmlError>,
) {
    let (a_evs, a_err) = read_async(chunks, limits);
    let mut a_evs = whitespace_runs_as_one(&a_evs);
    let evs = whitespace_runs_as_one(evs);
    let evs = evs.as_slice();
    let a_key = match a_err {
        XmlError::Eof => None,
        e => Some(format!("{e:?}")),
    };
    if a_err_is_text(&a_key)
        && a_evs.last() == Some(&StreamEvent::Whitespace)
        && evs.last() != Some(&StreamEvent::Whitespace)
    {
        a_evs.pop();
    }
    if matches!(a_key.as_deref(), Some(k) if k.starts_with("TooBig")) && a_key != err_key(err) {
        assert!(
            evs.starts_with(&a_evs),
            "socket reader events {a_evs:?} are not a prefix of {evs:?}"
        );
        return;
    }
    assert_eq!(
        (a_evs.as_slice(), a_key),
        (evs, err_key(err)),
        "socket reader differs from parse_chunks"
    );
}

/// Events with every run of consecutive whitespace events as one.
fn whitespace_runs_as_one(evs: &[StreamEvent]) -> Vec<StreamEvent> {
    let mut out: Vec<StreamEvent> = Vec::with_capacity(evs.len());
    for ev in evs {
        if *ev == StreamEvent::Whitespace && out.last() == Some(&StreamEvent::Whitespace) {
            continue;
        }
        out.push(ev.clone());
    }
    out
}

/// Whether the socket reader ended on text refused at stream level.
fn a_err_is_text(key: &Option<String>) -> bool {
    key.as_deref() == Some("TextAtStreamLevel")
}

/// Runs every invariant on one fuzz input. Panics (so libFuzzer records a crash) on violation.
pub fn check(data: &[u8], framed: bool) {
    let case = Case::decode(data);
    let (whole_evs, whole_err) = parse_chunks(&[case.doc], case.limits, framed);

    // Split invariance: the fuzzer-chosen split points...
    let chunks = case.chunks();
    {
        let (evs, err) = parse_chunks(&chunks, case.limits, framed);
        assert_eq!(
            (&evs, err_key(&err)),
            (&whole_evs, err_key(&whole_err)),
            "split at {:?} differs from the unsplit parse",
            case.splits
        );
    }
    // ...and the worst case, one byte per read.
    let bytes: Vec<&[u8]> = case.doc.chunks(1).collect();
    {
        let (evs, err) = parse_chunks(&bytes, case.limits, framed);
        assert_eq!(
            (&evs, err_key(&err)),
            (&whole_evs, err_key(&whole_err)),
            "byte-at-a-time parse differs from the unsplit parse"
        );
    }

    // The socket reader has no framed mode (RFC 7395 frames arrive whole from the WebSocket).
    if !framed {
        check_async_agrees(&chunks, case.limits, &whole_evs, &whole_err);
    }

    if let Some(e) = &whole_err {
        check_error(e);
    }
    for ev in &whole_evs {
        if let StreamEvent::Stanza(el) = ev {
            if !known::roundtrip_breaker(el) {
                check_roundtrip(el, case.limits.max_depth);
            }
        }
    }
}

/// Prefixes a document with a header choosing `limits_byte` and no split points.
pub fn seed(limits_byte: u8, doc: &[u8]) -> Vec<u8> {
    let mut v = vec![limits_byte, 0];
    v.extend_from_slice(doc);
    v
}

/// Limits byte for the largest stanza size and depth (the server defaults).
pub const DEFAULT_LIMITS: u8 = 0b111_111;

const HEADER: &str = "<?xml version='1.0'?><stream:stream xmlns='jabber:client' \
    xmlns:stream='http://etherx.jabber.org/streams' to='a.example' version='1.0' xml:lang='en'>";

/// Small documents covering the reader's paths: the starting corpus for each target.
pub fn seed_docs(framed: bool) -> Vec<Vec<u8>> {
    if framed {
        return [
            "<open xmlns='urn:ietf:params:xml:ns:xmpp-framing' to='a.example' version='1.0'/>",
            "<open xmlns='urn:ietf:params:xml:ns:xmpp-framing' to='a.example' version='1.0'/>\
             <message xmlns='jabber:client' to='b@a.example'><body>hi &amp; bye</body></message>\
             <close xmlns='urn:ietf:params:xml:ns:xmpp-framing'/>",
            "<auth xmlns='urn:ietf:params:xml:ns:xmpp-sasl' mechanism='PLAIN'>AGEAYg==</auth>",
            "<iq xmlns='jabber:client' type='set' id='b'><bind xmlns='urn:ietf:params:xml:ns:xmpp-bind'>\
             <resource>r</resource></bind></iq>",
            "<presence xmlns='jabber:client'><x:c xmlns:x='http://jabber.org/protocol/caps' \
             hash='sha-1' node='n' ver='v'/></presence> ",
        ]
        .map(|d| d.as_bytes().to_vec())
        .to_vec();
    }
    [
        format!("{HEADER}<message to='b@a.example'><body>hi &amp; bye</body></message> \n</stream:stream>"),
        format!(
            "{HEADER}<iq type='get' id='1'><query xmlns='jabber:iq:roster' ver='v1'/></iq>\
             <p:iq xmlns:p='jabber:client' type='result' id='2'><p:query xmlns:p='urn:x'/></p:iq>"
        ),
        format!(
            "{HEADER}<message xml:lang='de'><body>&lt;&gt;&apos;&quot;&#233;&#x1F600; \u{e9}\u{1F600}</body></message>"
        ),
        format!("{HEADER}<message><body>a<![CDATA[<b>&]]>c</body></message>"),
        format!("{HEADER}{}{}", "<a>".repeat(10), "</a>".repeat(10)),
        format!("{HEADER}<message><body>{}</body></message>", "x".repeat(300)),
        format!("{HEADER}<!-- c --><message/>"),
        format!("{HEADER}<?pi x?><message/>"),
        "<?xml version='1.0'?><!DOCTYPE x [<!ENTITY a 'b'>]><stream:stream/>".to_owned(),
        "<stream:stream xmlns='jabber:server' xmlns:stream='http://etherx.jabber.org/streams' \
         xmlns:db='jabber:server:dialback'><db:result from='a' to='b'>k</db:result><presence/>"
            .to_owned(),
        format!("{HEADER}<message><body>\u{0}\r\n</body></message>"),
        "<stream:stream xmlns:stream='http://etherx.jabber.org/streams'/>".to_owned(),
        format!("{HEADER} hello <message/>"),
        format!("{HEADER}<message a='1' a='2'/><x:y/>"),
        format!("{HEADER}<message><body>\u{1}\u{FFFE}</body></message>"),
    ]
    .map(String::into_bytes)
    .into_iter()
    .chain([[HEADER.as_bytes(), b"<message><body>\xC3\x28</body></message>"].concat()])
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_takes_limits_and_splits_from_the_header() {
        // byte 0 = 0b101_010: size index 2 (64), depth index 5 (8); two splits: 3 and 696 % 8 = 0.
        let data = [
            0b101_010, 2, 3, 0, 0xB8, 0x02, b'<', b'a', b'>', b'<', b'/', b'a', b'>',
        ];
        let c = Case::decode(&data);
        assert_eq!(c.limits.max_stanza_size, 64);
        assert_eq!(c.limits.max_depth, 8);
        assert_eq!(c.doc, b"<a></a>");
        assert_eq!(c.splits, vec![0, 3]);
        assert_eq!(c.chunks(), vec![&b""[..], b"<a>", b"</a>"]);
    }

    #[test]
    fn seeds_satisfy_the_invariants_under_every_limit() {
        // Every value of the limits byte: size, depth and cost limits.
        for framed in [false, true] {
            for doc in seed_docs(framed) {
                for limits in 0..=255 {
                    check(&seed(limits, &doc), framed);
                }
            }
        }
    }

    #[test]
    fn decode_accepts_short_inputs() {
        for n in 0..4 {
            let c = Case::decode(&[1u8, 8, 5][..n.min(3)]);
            assert!(c.doc.is_empty());
        }
    }
}
