//! SASL (RFC 6120 §6).
pub mod scram;
