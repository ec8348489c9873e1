//! RFC 6121 presence.
pub mod privacy;
pub mod subscription;
