//! Redis key names (ARCHITECTURE.md, "Redis"). The bare JID is the hash tag, so all keys of one
//! user live in one Redis Cluster slot and one Lua script may touch them together. A beat
//! ZSET and a node channel are one key each, so each lives in one slot too.
//!
//! ```text
//! <prefix>presence:{user@domain}:res:<resource>   node id, PXAT last beat + T
//! <prefix>presence:beats:<shard>                  ZSET "<node> <full JID>" → last beat (ms)
//! <prefix>node:<node>                             pub/sub channel of one node
//! ```
//!
//! The beat member names the node holding the session, so a sweeper on any node can hand a
//! stale resource to its owner (which knows whether the client is really silent and owns
//! the socket) and announce it itself only when no owner listens (a crashed node).

use crate::protocol::jid::FullJid;

/// Builds key names under one prefix.
#[derive(Debug, Clone)]
pub struct Keys {
    /// Prepended to every key (`[redis] key_prefix`).
    pub prefix: String,
    /// Number of beat ZSETs.
    pub shards: u32,
}

impl Keys {
    /// Keys under `prefix`, beats spread over `shards` ZSETs.
    pub fn new(prefix: &str, shards: u32) -> Keys {
        Keys {
            prefix: prefix.to_owned(),
            shards: shards.max(1),
        }
    }

    /// The per-resource liveness key.
    pub fn resource(&self, jid: &FullJid) -> String {
        format!(
            "{}presence:{{{}}}:res:{}",
            self.prefix,
            jid.to_bare(),
            jid.resource()
        )
    }

    /// The beat ZSET a user's resources are in.
    pub fn beats_for(&self, bare: &str) -> String {
        self.beats(shard_of(bare, self.shards))
    }

    /// Beat ZSET number `shard`.
    pub fn beats(&self, shard: u32) -> String {
        format!("{}presence:beats:{}", self.prefix, shard)
    }

    /// The beat ZSET member for `jid` held by `node` (node ids contain no spaces).
    pub fn member(&self, node: &str, jid: &FullJid) -> String {
        format!("{node} {jid}")
    }

    /// The pub/sub channel of `node`.
    pub fn node_channel(&self, node: &str) -> String {
        format!("{}node:{}", self.prefix, node)
    }

    /// Pattern matching every presence key under this prefix (for tests and operators).
    pub fn pattern(&self) -> String {
        format!("{}presence:*", self.prefix)
    }
}

/// Splits a beat member into node id and full JID.
pub fn parse_member(member: &str) -> Option<(&str, &str)> {
    member.split_once(' ')
}

/// FNV-1a of the bare JID: stable across nodes and builds (unlike `DefaultHasher`).
pub fn shard_of(bare: &str, shards: u32) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in bare.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h % shards.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_of_one_user_share_the_bare_jid_hash_tag() {
        let k = Keys::new("p:", 4);
        let j = crate::protocol::jid::parse_full("alice@example.org/phone").unwrap();
        assert_eq!(k.resource(&j), "p:presence:{alice@example.org}:res:phone");
        assert_eq!(
            crate::cluster::redis_conn::slot(k.resource(&j).as_bytes()),
            crate::cluster::redis_conn::slot(b"alice@example.org"),
            "one slot per user"
        );
        assert!(k
            .beats_for("alice@example.org")
            .starts_with("p:presence:beats:"));
    }

    #[test]
    fn member_names_the_node_and_splits_back() {
        let k = Keys::new("", 1);
        let j = crate::protocol::jid::parse_full("a@b/my phone").unwrap();
        let m = k.member("node-1", &j);
        assert_eq!(parse_member(&m), Some(("node-1", "a@b/my phone")));
    }

    #[test]
    fn shard_is_stable_and_in_range() {
        for s in 1..10 {
            assert!(shard_of("a@b", s) < s);
        }
        assert_eq!(shard_of("a@b", 16), shard_of("a@b", 16));
    }
}
