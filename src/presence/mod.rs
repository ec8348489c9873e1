//! RFC 6121 presence.
pub mod subscription;
