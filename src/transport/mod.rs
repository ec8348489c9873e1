//! Bytes to stanzas and back: the one [`listener`] every socket is accepted by, [`tls`],
//! the XML [`stream`], client streams ([`c2s`], and [`websocket`] over [`http`]), server
//! streams ([`s2s`]) and the operators' [`status`] page. A stanza leaves this layer for
//! `routing`; what goes out to a socket comes from a session's mailbox.

pub mod c2s;
pub(crate) mod http;
pub(crate) mod listener;
pub mod s2s;
pub(crate) mod status;
pub(crate) mod stream;
pub mod tls;
pub(crate) mod websocket;
