//! Incremental, bounded XML for XMPP streams.
