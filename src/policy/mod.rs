//! Pure decisions, table-tested without a database: the RFC 6121 Appendix A subscription
//! table ([`subscription`]) and who may see whose presence or last seen ([`privacy`]).
//!
//! Nothing here does I/O or imports anything above the model, so the store can hold these
//! types in its rows and the services above it can ask the same functions.

pub(crate) mod auth_backoff;
pub mod privacy;
pub(crate) mod rate_limit;
pub mod subscription;
