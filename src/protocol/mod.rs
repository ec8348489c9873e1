//! XMPP itself, below every other layer: [`jid`] (RFC 7622), [`xml`] (the bounded
//! incremental reader and the element type), [`stanza`] kinds and attributes,
//! [`conditions`] and [`error`] (RFC 6120 §4.9 and §8.3), [`sasl`] (RFC 4422 and SCRAM).

// First: the macro it declares is used by the modules below (and by the crate).
#[macro_use]
mod wire;

pub mod conditions;
pub mod error;
pub mod jid;
pub mod sasl;
pub(crate) mod stanza;
pub mod xml;
