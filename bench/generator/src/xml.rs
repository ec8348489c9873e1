//! Just enough XMPP stream XML for a load generator.
//!
//! The bench has to keep the bytes it has read under its own control: after `<proceed/>`
//! (RFC 6120 §5.4.2.3) the same socket is handed to TLS, and after SASL success the stream
//! restarts (RFC 6120 §6.4.6). So instead of a reader that owns the socket, [`Framer`] is
//! fed bytes and cuts them into frames (stream header, complete top-level element, stream
//! close); each complete element is then parsed with quick-xml from a complete slice.
//! The framer only needs to understand tags, quotes and depth: RFC 6120 §11.1 forbids
//! comments, processing instructions and DTDs inside a stream.

use quick_xml::events::{BytesStart, Event};
use quick_xml::Reader;

/// A parsed XML element with local names; enough to inspect stanzas and features.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Element {
    /// Local name (prefix stripped: `stream:features` becomes `features`).
    pub name: String,
    /// Attributes as written (keys keep any prefix, e.g. `xml:lang`), values unescaped.
    pub attrs: Vec<(String, String)>,
    /// Child elements in document order.
    pub children: Vec<Element>,
    /// Concatenated character data directly inside this element.
    pub text: String,
}

impl Element {
    /// Value of attribute `key`, if present.
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attrs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// First child with local name `name`.
    pub fn child(&self, name: &str) -> Option<&Element> {
        self.children.iter().find(|c| c.name == name)
    }

    /// Parses one complete element from `src`.
    pub fn parse(src: &str) -> Result<Element, String> {
        let mut reader = Reader::from_str(src);
        let mut stack: Vec<Element> = Vec::new();
        loop {
            match reader.read_event().map_err(|e| format!("xml: {e}"))? {
                Event::Start(s) => stack.push(start_to_element(&s)?),
                Event::Empty(s) => {
                    let el = start_to_element(&s)?;
                    match stack.last_mut() {
                        Some(parent) => parent.children.push(el),
                        None => return Ok(el),
                    }
                }
                Event::End(_) => {
                    let el = stack.pop().ok_or("xml: unbalanced end tag")?;
                    match stack.last_mut() {
                        Some(parent) => parent.children.push(el),
                        None => return Ok(el),
                    }
                }
                Event::Text(t) => {
                    if let Some(top) = stack.last_mut() {
                        let s = t.unescape().map_err(|e| format!("xml text: {e}"))?;
                        top.text.push_str(&s);
                    }
                }
                Event::CData(c) => {
                    if let Some(top) = stack.last_mut() {
                        top.text.push_str(&String::from_utf8_lossy(&c.into_inner()));
                    }
                }
                Event::Eof => return Err("xml: element ended early".into()),
                _ => {}
            }
        }
    }
}

fn start_to_element(s: &BytesStart<'_>) -> Result<Element, String> {
    let name = String::from_utf8_lossy(s.local_name().as_ref()).into_owned();
    let mut attrs = Vec::new();
    for a in s.attributes() {
        let a = a.map_err(|e| format!("xml attr: {e}"))?;
        let key = String::from_utf8_lossy(a.key.as_ref()).into_owned();
        let value = a
            .unescape_value()
            .map_err(|e| format!("xml attr value: {e}"))?
            .into_owned();
        attrs.push((key, value));
    }
    Ok(Element {
        name,
        attrs,
        children: Vec::new(),
        text: String::new(),
    })
}

/// One unit cut from the incoming byte stream.
#[derive(Debug, PartialEq)]
pub enum Frame {
    /// `<stream:stream ...>`: the header's attributes, as an element without children.
    StreamOpen(Element),
    /// A complete top-level element (stanza, features, SASL or TLS negotiation element).
    Element(Element),
    /// `</stream:stream>`.
    StreamClose,
}

/// Cuts a byte stream into [`Frame`]s; see the module comment for why it exists.
#[derive(Debug, Default)]
pub struct Framer {
    /// Bytes received and not yet consumed by a returned frame.
    buf: Vec<u8>,
    /// Where scanning resumes inside `buf` (everything before it is inside the current element).
    scan: usize,
    /// Element depth: 0 outside the stream, 1 directly inside `<stream:stream>`.
    depth: u32,
    /// Start offset of the top-level element being accumulated.
    elem_start: usize,
    /// Largest top-level element accepted, so a broken peer cannot grow the buffer forever.
    max_element: usize,
}

impl Framer {
    /// A framer refusing elements larger than `max_element` bytes.
    pub fn new(max_element: usize) -> Self {
        Framer {
            max_element,
            ..Framer::default()
        }
    }

    /// Appends received bytes.
    pub fn feed(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// True when no unconsumed bytes are buffered (needed before handing the socket to TLS).
    pub fn is_empty(&self) -> bool {
        self.buf.iter().all(|b| b.is_ascii_whitespace())
    }

    /// Forgets everything: a new stream starts (RFC 6120 §4.3.3 stream restart).
    pub fn reset(&mut self) {
        self.buf.clear();
        self.scan = 0;
        self.depth = 0;
        self.elem_start = 0;
    }

    /// The next complete frame, `Ok(None)` if more bytes are needed.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, String> {
        loop {
            let Some(rel) = self.buf[self.scan..].iter().position(|&b| b == b'<') else {
                if self.depth <= 1 {
                    // Only whitespace keepalives (RFC 6120 §4.6.1) between stanzas: drop them.
                    self.buf.clear();
                    self.scan = 0;
                } else {
                    self.scan = self.buf.len();
                }
                return self.check_size().map(|_| None);
            };
            let lt = self.scan + rel;
            let Some(gt) = find_tag_end(&self.buf, lt) else {
                self.scan = lt;
                return self.check_size().map(|_| None);
            };
            let tag = &self.buf[lt..=gt];
            if tag.starts_with(b"<?") || tag.starts_with(b"<!") {
                self.consume_or_skip(lt, gt);
                continue;
            }
            if tag.starts_with(b"</") {
                if self.depth == 1 {
                    self.consume(gt);
                    self.depth = 0;
                    return Ok(Some(Frame::StreamClose));
                }
                self.depth = self.depth.saturating_sub(1);
                if self.depth == 1 {
                    let el = self.parse_range(self.elem_start, gt)?;
                    self.consume(gt);
                    return Ok(Some(Frame::Element(el)));
                }
                self.scan = gt + 1;
                continue;
            }
            let empty = tag.ends_with(b"/>");
            if self.depth == 0 {
                // The stream header is a start tag that never closes inside the frame; parse
                // its attributes by closing it artificially.
                let mut s = String::from_utf8_lossy(&tag[..tag.len() - 1]).into_owned();
                s.push_str("/>");
                let header = Element::parse(&s)?;
                self.consume(gt);
                self.depth = 1;
                return Ok(Some(Frame::StreamOpen(header)));
            }
            if empty {
                if self.depth == 1 {
                    let el = self.parse_range(lt, gt)?;
                    self.consume(gt);
                    return Ok(Some(Frame::Element(el)));
                }
            } else {
                if self.depth == 1 {
                    self.elem_start = lt;
                }
                self.depth += 1;
            }
            self.scan = gt + 1;
        }
    }

    fn check_size(&self) -> Result<(), String> {
        if self.buf.len() > self.max_element {
            Err(format!("element larger than {} bytes", self.max_element))
        } else {
            Ok(())
        }
    }

    fn consume_or_skip(&mut self, _lt: usize, gt: usize) {
        if self.depth <= 1 {
            self.consume(gt);
        } else {
            self.scan = gt + 1;
        }
    }

    fn consume(&mut self, gt: usize) {
        self.buf.drain(..=gt);
        self.scan = 0;
        self.elem_start = 0;
    }

    fn parse_range(&self, start: usize, gt: usize) -> Result<Element, String> {
        let s = std::str::from_utf8(&self.buf[start..=gt]).map_err(|e| format!("utf-8: {e}"))?;
        Element::parse(s)
    }
}

/// Index of the `>` closing the tag opened at `lt`, skipping quoted attribute values.
fn find_tag_end(buf: &[u8], lt: usize) -> Option<usize> {
    let mut quote: Option<u8> = None;
    for (i, &b) in buf.iter().enumerate().skip(lt + 1) {
        match quote {
            Some(q) if b == q => quote = None,
            Some(_) => {}
            None if b == b'"' || b == b'\'' => quote = Some(b),
            None if b == b'>' => return Some(i),
            None => {}
        }
    }
    None
}

/// Escapes character data / attribute values for output.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '\'' => out.push_str("&apos;"),
            '"' => out.push_str("&quot;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(input: &[&[u8]]) -> Vec<Frame> {
        let mut f = Framer::new(1 << 20);
        let mut out = Vec::new();
        for chunk in input {
            f.feed(chunk);
            while let Some(fr) = f.next_frame().expect("valid xml") {
                out.push(fr);
            }
        }
        out
    }

    #[test]
    fn framer_cuts_header_elements_and_close_across_arbitrary_chunk_boundaries() {
        let doc = b"<?xml version='1.0'?><stream:stream xmlns='jabber:client' from='a.example' id='x' version='1.0'><stream:features><starttls xmlns='urn:ietf:params:xml:ns:xmpp-tls'><required/></starttls></stream:features> <presence from='b@a.example/r'><status>x &gt; y &amp; 'q'</status></presence></stream:stream>";
        let whole = frames(&[doc]);
        for split in 1..doc.len() {
            let (a, b) = doc.split_at(split);
            assert_eq!(frames(&[a, b]), whole, "split at {split}");
        }
        assert_eq!(whole.len(), 4);
        match &whole[0] {
            Frame::StreamOpen(h) => assert_eq!(h.attr("id"), Some("x")),
            other => panic!("expected header, got {other:?}"),
        }
        match &whole[1] {
            Frame::Element(e) => {
                assert_eq!(e.name, "features");
                assert!(e
                    .child("starttls")
                    .and_then(|s| s.child("required"))
                    .is_some());
            }
            other => panic!("expected features, got {other:?}"),
        }
        match &whole[2] {
            Frame::Element(e) => {
                assert_eq!(e.attr("from"), Some("b@a.example/r"));
                assert_eq!(
                    e.child("status").map(|s| s.text.as_str()),
                    Some("x > y & 'q'")
                );
            }
            other => panic!("expected presence, got {other:?}"),
        }
        assert_eq!(whole[3], Frame::StreamClose);
    }

    #[test]
    fn framer_keeps_a_greater_than_sign_inside_a_quoted_attribute() {
        let out = frames(&[b"<stream:stream version='1.0'><iq id='a>b' type='result'/>"]);
        match &out[1] {
            Frame::Element(e) => assert_eq!(e.attr("id"), Some("a>b")),
            other => panic!("expected iq, got {other:?}"),
        }
    }

    #[test]
    fn framer_refuses_an_element_beyond_the_size_limit() {
        let mut f = Framer::new(64);
        f.feed(b"<stream:stream version='1.0'>");
        assert!(matches!(f.next_frame(), Ok(Some(Frame::StreamOpen(_)))));
        f.feed(b"<a>");
        f.feed(&[b'x'; 100]);
        assert!(f.next_frame().is_err());
    }

    #[test]
    fn escape_covers_the_five_xml_special_characters() {
        assert_eq!(escape("a<b>&'\""), "a&lt;b&gt;&amp;&apos;&quot;");
    }
}
