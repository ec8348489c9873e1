//! Durable state in PostgreSQL.
