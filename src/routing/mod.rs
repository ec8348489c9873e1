//! Where a stanza goes: [`router`] dispatches a client's stanza by kind and namespace;
//! [`delivery`] hands a message or iq to a local user after the recipient's block list and
//! the privacy gate.

pub(crate) mod delivery;
pub(crate) mod router;
