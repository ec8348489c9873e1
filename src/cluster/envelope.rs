//! What one node sends another on its channel: one message per receiving node, carrying
//! the recipients on that node and the serialised stanza once.
//!
//! ```text
//! presenced-cluster 1\n
//! <kind>\n                 deliver | address | notify | kick | join | reveal | decide | invalidate | seen
//! <n>\n
//! <recipient>\n × n        full JID: that session; bare JID: the user's available sessions
//! <stanza>                 client-stream XML (the rest of the message, may hold newlines)
//! ```
//!
//! `deliver` hands the stanza over as it is; `address` sets `to` to each recipient first
//! (a presence broadcast, serialised once without `to`); `notify` hands a XEP-0163 event
//! to the recipients' sessions there whose client asked for its node; `reveal` carries a
//! viewer's JID instead of a stanza; `decide` a message or iq whose admission only the
//! receiving node can decide. JIDs cannot hold a newline
//! (RFC 7622 prohibits control characters in every part), so one per line is unambiguous.

use std::sync::Arc;

const MAGIC: &str = "presenced-cluster 1";

/// What the receiving node does with the stanza.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Deliver the stanza unchanged to each recipient.
    Deliver,
    /// Deliver the stanza with `to` set to each recipient.
    Address,
    /// A XEP-0163 event the sending node admitted for each recipient (bare JIDs): deliver
    /// it to their sessions whose client asked for notifications of its node (XEP-0115
    /// capabilities are known on the node holding the session).
    Notify,
    /// A newer session bound this full JID on the sending node: end the local one with the
    /// `conflict` stream error (RFC 6120 §7.7.2.2).
    Kick,
    /// The sending node has just started: re-read the live nodes.
    Join,
    /// The sending node showed the presence of each recipient (a full JID bound on the
    /// receiving node) to the viewer the message carries instead of a stanza, from the
    /// directory: the receiving node records the viewer as shown, so that a later block or
    /// privacy change withdraws it there.
    Reveal,
    /// A message or iq to a full JID bound on the receiving node, whose admission depends
    /// on what only that node knows (the session's directed presence): the receiving node
    /// takes the delivery decision, for the sender in the stanza's `from`.
    Decide,
    /// The sending node wrote the directory rows of these users (bare JIDs): drop any copy
    /// of them ([`super::cache`]).
    Invalidate,
    /// A session of the recipient (a bare JID) ended on the sending node at the time the
    /// message carries (milliseconds since the epoch): its last seen, until the sending
    /// node's flush reaches PostgreSQL (XEP-0012).
    Seen,
    /// A message to the recipient (a bare JID with a session bound on the receiving node)
    /// was kept offline on the sending node: a session here that takes messages by now
    /// takes what is kept (XEP-0160), as a session on the storing node would.
    Collect,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Deliver => "deliver",
            Kind::Address => "address",
            Kind::Notify => "notify",
            Kind::Kick => "kick",
            Kind::Join => "join",
            Kind::Reveal => "reveal",
            Kind::Decide => "decide",
            Kind::Invalidate => "invalidate",
            Kind::Seen => "seen",
            Kind::Collect => "collect",
        }
    }

    fn parse(s: &str) -> Option<Kind> {
        Some(match s {
            "deliver" => Kind::Deliver,
            "address" => Kind::Address,
            "notify" => Kind::Notify,
            "kick" => Kind::Kick,
            "join" => Kind::Join,
            "reveal" => Kind::Reveal,
            "decide" => Kind::Decide,
            "invalidate" => Kind::Invalidate,
            "seen" => Kind::Seen,
            "collect" => Kind::Collect,
            _ => return None,
        })
    }
}

/// One cross-node message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    /// What to do.
    pub kind: Kind,
    /// Full or bare JIDs of recipients on the receiving node.
    pub to: Vec<String>,
    /// The stanza (empty for `kick` and `join`).
    pub xml: Arc<String>,
}

impl Envelope {
    /// The wire form.
    pub fn encode(&self) -> String {
        let mut out = String::with_capacity(
            MAGIC.len() + 16 + self.to.iter().map(|t| t.len() + 1).sum::<usize>() + self.xml.len(),
        );
        out.push_str(MAGIC);
        out.push('\n');
        out.push_str(self.kind.as_str());
        out.push('\n');
        out.push_str(&self.to.len().to_string());
        out.push('\n');
        for t in &self.to {
            out.push_str(t);
            out.push('\n');
        }
        out.push_str(&self.xml);
        out
    }

    /// Parses the wire form; `None` for anything else (logged by the caller).
    pub fn decode(text: &str) -> Option<Envelope> {
        let rest = text.strip_prefix(MAGIC)?.strip_prefix('\n')?;
        let (kind, rest) = rest.split_once('\n')?;
        let kind = Kind::parse(kind)?;
        let (n, mut rest) = rest.split_once('\n')?;
        let n: usize = n.parse().ok()?;
        // Each recipient takes at least two bytes: a count beyond that is a lie.
        if n > rest.len() / 2 + 1 {
            return None;
        }
        let mut to = Vec::with_capacity(n);
        for _ in 0..n {
            let (jid, r) = rest.split_once('\n')?;
            if jid.is_empty() {
                return None;
            }
            to.push(jid.to_owned());
            rest = r;
        }
        Some(Envelope {
            kind,
            to,
            xml: Arc::new(rest.to_owned()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_envelope_survives_the_wire_with_spaces_in_resources_and_newlines_in_the_stanza() {
        let e = Envelope {
            kind: Kind::Address,
            to: vec!["a@x".into(), "b@x/my phone".into()],
            xml: Arc::new("<presence from='c@x/r'><status>two\nlines</status></presence>".into()),
        };
        assert_eq!(Envelope::decode(&e.encode()), Some(e));
        let kick = Envelope {
            kind: Kind::Kick,
            to: vec!["a@x/r".into()],
            xml: Arc::default(),
        };
        assert_eq!(Envelope::decode(&kick.encode()), Some(kick));
    }

    #[test]
    fn anything_else_on_the_channel_is_refused() {
        for bad in [
            "",
            "1700000000000 a@x/r",
            "presenced-cluster 2\ndeliver\n0\n",
            "presenced-cluster 1\nshout\n0\n<x/>",
            "presenced-cluster 1\ndeliver\n3\na@x\n",
            "presenced-cluster 1\ndeliver\n99999999\na@x\n",
            "presenced-cluster 1\ndeliver\n1\n\n<x/>",
        ] {
            assert_eq!(Envelope::decode(bad), None, "{bad:?}");
        }
    }
}
