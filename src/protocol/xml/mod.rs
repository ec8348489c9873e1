//! Incremental, bounded XML for XMPP streams.
//!
//! An XMPP stream is one long XML document whose top-level children are stanzas (RFC 6120 §4).
//! [`reader`] turns bytes into [`reader::StreamEvent`]s, building each stanza as an owned
//! [`Element`]; [`Element::write_to`] serialises one back. Namespaces are resolved once at the
//! edge: every element carries its namespace URI, so nothing downstream sees prefixes.

pub mod reader;

use std::fmt::Write as _;

/// A fresh random id for a stream, a stanza or a node (RFC 6120 §4.7.3 wants stream ids
/// unpredictable).
pub fn new_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// Namespace of the stream element (RFC 6120 §4.8.1).
pub const NS_STREAM: &str = "http://etherx.jabber.org/streams";
/// Default content namespace of client streams (RFC 6120 §4.8.3).
pub const NS_CLIENT: &str = "jabber:client";
/// Default content namespace of server streams (RFC 6120 §4.8.3).
pub const NS_SERVER: &str = "jabber:server";
/// Stream error conditions (RFC 6120 §4.9.2).
pub const NS_STREAM_ERRORS: &str = "urn:ietf:params:xml:ns:xmpp-streams";
/// Stanza error conditions (RFC 6120 §8.3.2).
pub const NS_STANZAS: &str = "urn:ietf:params:xml:ns:xmpp-stanzas";
/// STARTTLS (RFC 6120 §5).
pub const NS_TLS: &str = "urn:ietf:params:xml:ns:xmpp-tls";
/// SASL (RFC 6120 §6).
pub const NS_SASL: &str = "urn:ietf:params:xml:ns:xmpp-sasl";
/// Resource binding (RFC 6120 §7).
pub const NS_BIND: &str = "urn:ietf:params:xml:ns:xmpp-bind";
/// Legacy session establishment (RFC 3921 §3, kept optional by RFC 6121 Appendix E).
pub const NS_SESSION: &str = "urn:ietf:params:xml:ns:xmpp-session";
/// Roster (RFC 6121 §2).
pub const NS_ROSTER: &str = "jabber:iq:roster";
/// Roster versioning stream feature (XEP-0237 / RFC 6121 §2.6).
pub const NS_ROSTER_VER: &str = "urn:xmpp:features:rosterver";
/// Subscription pre-approval stream feature (RFC 6121 §3.4).
pub const NS_PREAPPROVAL: &str = "urn:xmpp:features:pre-approval";
/// Service discovery (XEP-0030).
pub const NS_DISCO_INFO: &str = "http://jabber.org/protocol/disco#info";
/// Service discovery items (XEP-0030).
pub const NS_DISCO_ITEMS: &str = "http://jabber.org/protocol/disco#items";
/// XMPP ping (XEP-0199).
pub const NS_PING: &str = "urn:xmpp:ping";
/// Delayed delivery (XEP-0203).
pub const NS_DELAY: &str = "urn:xmpp:delay";
/// In-band registration (XEP-0077).
pub const NS_REGISTER: &str = "jabber:iq:register";
/// In-band registration stream feature (XEP-0077 §4).
pub const NS_REGISTER_FEATURE: &str = "http://jabber.org/features/iq-register";

/// A child of an element: another element or character data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    /// A nested element.
    Element(Element),
    /// Unescaped character data.
    Text(String),
}

/// An owned XML element with its namespace resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Element {
    /// Local name (no prefix).
    pub name: String,
    /// Namespace URI; stanzas of either content namespace are stored as [`NS_CLIENT`].
    pub ns: String,
    /// Attributes other than namespace declarations, in document order. `xml:lang` keeps its
    /// prefix because the `xml` prefix is bound by definition.
    pub attrs: Vec<(String, String)>,
    /// Child nodes in document order.
    pub children: Vec<Node>,
}

impl Element {
    /// A new element with no attributes or children.
    pub fn new(name: &str, ns: &str) -> Self {
        Element {
            name: name.to_owned(),
            ns: ns.to_owned(),
            attrs: Vec::new(),
            children: Vec::new(),
        }
    }

    /// Builder: adds or replaces an attribute.
    pub fn attr(mut self, name: &str, value: impl Into<String>) -> Self {
        self.set_attr(name, value);
        self
    }

    /// Builder: appends a child element.
    pub fn child(mut self, child: Element) -> Self {
        self.children.push(Node::Element(child));
        self
    }

    /// Builder: appends character data.
    pub fn text(mut self, text: impl Into<String>) -> Self {
        self.children.push(Node::Text(text.into()));
        self
    }

    /// Whether this element has the given name and namespace.
    pub fn is(&self, name: &str, ns: &str) -> bool {
        self.name == name && self.ns == ns
    }

    /// The value of an attribute.
    pub fn get_attr(&self, name: &str) -> Option<&str> {
        self.attrs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Sets (or replaces) an attribute.
    pub fn set_attr(&mut self, name: &str, value: impl Into<String>) {
        let value = value.into();
        match self.attrs.iter_mut().find(|(k, _)| k == name) {
            Some(slot) => slot.1 = value,
            None => self.attrs.push((name.to_owned(), value)),
        }
    }

    /// [`Self::set_attr`] from a borrowed value, written into the old value's buffer: for
    /// one element re-addressed in a loop, without a string per pass.
    pub fn set_attr_str(&mut self, name: &str, value: &str) {
        match self.attrs.iter_mut().find(|(k, _)| k == name) {
            Some(slot) => {
                slot.1.clear();
                slot.1.push_str(value);
            }
            None => self.attrs.push((name.to_owned(), value.to_owned())),
        }
    }

    /// Removes an attribute, returning its value.
    pub fn remove_attr(&mut self, name: &str) -> Option<String> {
        let i = self.attrs.iter().position(|(k, _)| k == name)?;
        Some(self.attrs.remove(i).1)
    }

    /// Child elements in order.
    pub fn elements(&self) -> impl Iterator<Item = &Element> {
        self.children.iter().filter_map(|n| match n {
            Node::Element(e) => Some(e),
            Node::Text(_) => None,
        })
    }

    /// The first child element with this name and namespace.
    pub fn get_child(&self, name: &str, ns: &str) -> Option<&Element> {
        self.elements().find(|e| e.is(name, ns))
    }

    /// Mutable access to the first child element with this name and namespace.
    pub fn get_child_mut(&mut self, name: &str, ns: &str) -> Option<&mut Element> {
        self.children.iter_mut().find_map(|n| match n {
            Node::Element(e) if e.is(name, ns) => Some(e),
            _ => None,
        })
    }

    /// Removes every child element with this name and namespace.
    pub fn remove_children(&mut self, name: &str, ns: &str) {
        self.children
            .retain(|n| !matches!(n, Node::Element(e) if e.is(name, ns)));
    }

    /// Concatenated character data of the direct children.
    pub fn text_content(&self) -> String {
        let mut out = String::new();
        for n in &self.children {
            if let Node::Text(t) = n {
                out.push_str(t);
            }
        }
        out
    }

    /// Serialises the element. `parent_ns` is the namespace in scope where it is written (the
    /// stream's content namespace for a stanza): an `xmlns` is emitted only where it changes.
    /// `stream_ns` replaces [`NS_CLIENT`] so the same stanza can go on a server stream.
    pub fn write_to(&self, out: &mut String, parent_ns: &str, stream_ns: &str) {
        self.write_parts(out, parent_ns, stream_ns, None);
    }

    /// [`Self::write_to`] with `body` writing more children after this element's own:
    /// text already serialised, in this element's namespace (on a client stream, where
    /// [`NS_CLIENT`] is written as itself). For a large reply made from rows, so that its
    /// children need not each become an `Element` first (a roster result). The element
    /// is always written with an end tag, even if `body` writes nothing.
    pub fn write_wrapping(
        &self,
        out: &mut String,
        parent_ns: &str,
        stream_ns: &str,
        body: &mut dyn FnMut(&mut String),
    ) {
        self.write_parts(out, parent_ns, stream_ns, Some(body));
    }

    /// [`Self::write_to`], with `body` (if given) as [`Self::write_wrapping`] says.
    fn write_parts(
        &self,
        out: &mut String,
        parent_ns: &str,
        stream_ns: &str,
        body: Option<&mut dyn FnMut(&mut String)>,
    ) {
        let ns = if self.ns == NS_CLIENT {
            stream_ns
        } else {
            self.ns.as_str()
        };
        out.push('<');
        out.push_str(&self.name);
        if ns != parent_ns {
            out.push_str(" xmlns='");
            escape_into(out, ns);
            out.push('\'');
        }
        for (k, v) in &self.attrs {
            out.push(' ');
            out.push_str(k);
            out.push_str("='");
            escape_into(out, v);
            out.push('\'');
        }
        if self.children.is_empty() && body.is_none() {
            out.push_str("/>");
            return;
        }
        out.push('>');
        for child in &self.children {
            match child {
                Node::Element(e) => e.write_to(out, ns, stream_ns),
                Node::Text(t) => escape_into(out, t),
            }
        }
        if let Some(body) = body {
            body(out);
        }
        out.push_str("</");
        out.push_str(&self.name);
        out.push('>');
    }

    /// About the bytes this element holds: its strings plus a fixed cost per element,
    /// attribute and text node for the structures around them (a little more than its
    /// serialised length for a stanza of many small parts). What byte budgets count for an
    /// element that is not serialised yet; a walk, without allocating.
    pub fn weight(&self) -> usize {
        const NODE: usize = std::mem::size_of::<Node>();
        let attrs: usize = self
            .attrs
            .iter()
            .map(|(k, v)| k.len() + v.len() + std::mem::size_of::<(String, String)>())
            .sum();
        let children: usize = self
            .children
            .iter()
            .map(|c| match c {
                Node::Element(e) => e.weight(),
                Node::Text(t) => t.len() + NODE,
            })
            .sum();
        NODE + self.name.len() + self.ns.len() + attrs + children
    }

    /// Serialises the element as a stanza of a client stream.
    pub fn to_xml(&self) -> String {
        let mut out = String::with_capacity(128);
        self.write_to(&mut out, NS_CLIENT, NS_CLIENT);
        out
    }
}

/// A stanza serialised once for many recipients that differ only in `to` (a presence
/// broadcast to every contact, RFC 6121 §4.2.2): each copy is then one string built from
/// two slices, not a deep clone of the element followed by its own serialisation.
#[derive(Debug)]
pub struct Addressed {
    xml: String,
    /// Where ` to='…'` goes: just after the element's name.
    split: usize,
}

impl Addressed {
    /// Serialises `el` without any `to` it carries. The text is trimmed to its length: a
    /// session keeps its last presence this way for as long as it stays available.
    pub fn new(el: &Element) -> Self {
        let mut xml = String::with_capacity(128);
        if el.get_attr("to").is_some() {
            let mut el = el.clone();
            el.remove_attr("to");
            el.write_to(&mut xml, NS_CLIENT, NS_CLIENT);
        } else {
            el.write_to(&mut xml, NS_CLIENT, NS_CLIENT);
        }
        xml.shrink_to_fit();
        Addressed {
            xml,
            split: 1 + el.name.len(),
        }
    }

    /// An `Addressed` from the text [`Self::unaddressed`] gave (a stanza that crossed to
    /// another node): the `to` goes after the element's name again.
    pub fn from_unaddressed(xml: String) -> Self {
        let split = xml
            .char_indices()
            .skip(1)
            .find(|&(_, c)| c == ' ' || c == '/' || c == '>')
            .map(|(i, _)| i)
            .unwrap_or(xml.len());
        Addressed { xml, split }
    }

    /// The serialised stanza without any `to`.
    pub fn unaddressed(&self) -> &str {
        &self.xml
    }

    /// The stanza as a client stream would carry it, addressed to `to`.
    pub fn to(&self, to: &str) -> String {
        let (head, tail) = self.xml.split_at(self.split);
        let mut out = String::with_capacity(self.xml.len() + to.len() + 6);
        out.push_str(head);
        out.push_str(" to='");
        escape_into(&mut out, to);
        out.push('\'');
        out.push_str(tail);
        out
    }
}

impl std::fmt::Display for Element {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_xml())
    }
}

/// Escapes character data or an attribute value (both quote kinds, so either delimiter works).
pub fn escape_into(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '\'' => out.push_str("&apos;"),
            '"' => out.push_str("&quot;"),
            _ => out.push(c),
        }
    }
}

/// Escapes into a new string.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    escape_into(&mut out, s);
    out
}

/// A XEP-0203 `<delay/>` from `from` (a JID, usually a domain) saying a stanza dates from
/// `at`, stamped in the XEP-0082 DateTime profile (UTC, whole seconds).
pub fn delay(from: &str, at: chrono::DateTime<chrono::Utc>) -> Element {
    Element::new("delay", NS_DELAY).attr("from", from).attr(
        "stamp",
        at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
    )
}

/// Parses one standalone element (e.g. a stanza stored as text). Namespace-less stanzas are
/// read as `jabber:client`.
pub fn parse_element(text: &str) -> Option<Element> {
    let wrapped = format!(
        "<stream:stream xmlns='{NS_CLIENT}' xmlns:stream='{NS_STREAM}'>{text}</stream:stream>"
    );
    let (events, err) = reader::parse_chunks(
        &[wrapped.as_bytes()],
        reader::ReaderLimits::default(),
        false,
    );
    if err.is_some() {
        return None;
    }
    events.into_iter().find_map(|e| match e {
        reader::StreamEvent::Stanza(el) => Some(el),
        _ => None,
    })
}

/// Builds the opening tag of a stream header (RFC 6120 §4.7). The stream is never closed
/// by this string: `</stream:stream>` is written separately.
pub fn stream_header(from: &str, to: Option<&str>, id: &str, content_ns: &str) -> String {
    let mut out = String::with_capacity(200);
    out.push_str("<?xml version='1.0'?><stream:stream xmlns='");
    out.push_str(content_ns);
    out.push_str("' xmlns:stream='");
    out.push_str(NS_STREAM);
    out.push_str("' version='1.0' from='");
    escape_into(&mut out, from);
    out.push('\'');
    if let Some(to) = to {
        out.push_str(" to='");
        escape_into(&mut out, to);
        out.push('\'');
    }
    let _ = write!(out, " id='{}' xml:lang='en'>", escape(id));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stanza_written_without_redundant_xmlns_and_escaped() {
        let e = Element::new("message", NS_CLIENT)
            .attr("to", "a@b")
            .child(Element::new("body", NS_CLIENT).text("1 < 2 & 'q'"))
            .child(Element::new("x", "urn:x"));
        assert_eq!(
            e.to_xml(),
            "<message to='a@b'><body>1 &lt; 2 &amp; &apos;q&apos;</body><x xmlns='urn:x'/></message>"
        );
    }

    #[test]
    fn an_attribute_set_from_a_borrowed_value_replaces_in_place_or_is_appended() {
        let mut el = Element::new("presence", NS_CLIENT)
            .attr("type", "unavailable")
            .attr("from", "a-much-longer-sender@a.example");
        el.set_attr_str("from", "b@a.example");
        el.set_attr_str("to", "c@a.example/r");
        assert_eq!(
            el.to_xml(),
            "<presence type='unavailable' from='b@a.example' to='c@a.example/r'/>"
        );
    }

    #[test]
    fn client_namespace_becomes_server_namespace_on_server_streams() {
        let e = Element::new("presence", NS_CLIENT);
        let mut out = String::new();
        e.write_to(&mut out, NS_SERVER, NS_SERVER);
        assert_eq!(out, "<presence/>");
    }

    #[test]
    fn addressed_copy_is_the_stanza_with_only_its_to_changed() {
        let el = Element::new("presence", NS_CLIENT)
            .attr("from", "a@x/r")
            .attr("to", "old@x")
            .child(Element::new("status", NS_CLIENT).text("out & <about>"))
            .child(Element::new("c", "http://jabber.org/protocol/caps").attr("ver", "v'1"));
        let once = Addressed::new(&el);
        let crossed = Addressed::from_unaddressed(once.unaddressed().to_owned());
        assert_eq!(crossed.to("b@x"), once.to("b@x"));
        for to in ["b@x", "o'brien@x", "c@y/res"] {
            let mut stamped = el.clone();
            stamped.set_attr("to", to);
            let parsed = parse_element(&once.to(to)).expect("well-formed");
            assert_eq!(parsed.get_attr("to"), Some(to));
            assert_eq!(parsed.get_attr("from"), Some("a@x/r"));
            assert_eq!(parsed.children, stamped.children);
            assert_eq!(parsed.attrs.len(), stamped.attrs.len());
        }
    }

    #[test]
    fn a_stanza_serialised_once_and_addressed_equals_an_addressed_clone() {
        let el = Element::new("presence", NS_CLIENT)
            .attr("from", "a@x/r")
            .attr("to", "old@x")
            .child(Element::new("show", NS_CLIENT).text("away"))
            .child(Element::new("c", "http://jabber.org/protocol/caps").attr("ver", "v'1"));
        let once = Addressed::new(&el);
        for to in ["b@x", "o'brien@x/<r>"] {
            let mut clone = el.clone();
            clone.set_attr("to", to);
            let xml = once.to(to);
            // The same element, its attributes in another order (`to` first).
            let sorted = |e: Option<Element>| {
                let mut e = e.expect("well-formed");
                e.attrs.sort();
                e
            };
            assert_eq!(sorted(parse_element(&xml)), sorted(Some(clone)), "{xml}");
            assert_eq!(xml.matches(" to=").count(), 1, "{xml}");
        }
        let bare = Element::new("presence", NS_CLIENT).attr("from", "a@x/r");
        assert_eq!(
            Addressed::new(&bare).to("b@x"),
            "<presence to='b@x' from='a@x/r'/>"
        );
    }
}
