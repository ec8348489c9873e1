//! jid
