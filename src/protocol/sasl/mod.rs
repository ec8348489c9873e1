//! SASL (RFC 6120 §6): the mechanisms the server offers, kept free of I/O so the c2s
//! negotiation feeds them bytes and sends back what they return.
//!
//! - [`scram`]: SCRAM-SHA-1 and SCRAM-SHA-256 and their `-PLUS` variants, plus
//!   [`scram::verify_plain`] so PLAIN checks a password against the same stored SCRAM
//!   credentials.
//! - [`channel_binding`]: the gs2 header's channel-binding rules (RFC 5802 §6) and the
//!   XEP-0474 downgrade-protection input.
//! - [`backoff`]: per-account back-off after repeated failures, shared by every stream.
//! - [`ht`]: HT-SHA-256-NONE, the XEP-0484 FAST token mechanism, and how tokens are
//!   derived from what the store keeps.
pub mod channel_binding;
pub mod ht;
pub mod scram;
