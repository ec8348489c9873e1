//! The session directory in Redis: which node holds each bound full JID, and what a probe
//! answer or a message to a bare JID needs to know about it without asking that node.
//!
//! ```text
//! <prefix>dir:{user@domain}      HASH resource → entry; PXAT now + HORIZON on every write
//! <prefix>cluster:nodes          ZSET instance → last refresh (ms); PXAT now + 3T
//! <prefix>cluster:<node>         pub/sub channel of one node (cross-node stanzas)
//! ```
//!
//! An entry names the *instance* that wrote it (`<node id>#<boot nonce>`), not just the
//! node: a node restarted under the same id is a new instance, and the entries its previous
//! run left behind are ignored by every reader (they are not in the live instances) and
//! pruned by the next write to the same user. One hash per user, with the bare JID as hash
//! tag like the liveness keys, so one script touches one slot. Every write sets the key's
//! expiry in the same script (PEXPIREAT NX then GT: never without one, never shortened), and
//! every node moves the expiry of its own users' keys forward every half [`HORIZON`].
//!
//! Why a day and not a few T: the expiry is not what tells a live entry from a dead one
//! (the live-instance set does that, for every reader), it only bounds how long a crashed
//! instance's leftovers take memory. An expiry a few T ahead had to be moved every T for
//! every online user, one Redis write per user per T with nothing changed; a day ahead,
//! moved every half day, costs one write per user per half day. A released entry is
//! deleted at once (`HDEL`, and Redis drops the emptied hash), and the sweeper forgets the
//! entries of the dead instance's resources it announces, so what waits for the expiry is
//! only what was neither released nor announced (a whole cluster gone at once, say).

use std::sync::Arc;
use std::time::Duration;

/// How far ahead of its last write or extension a user's directory hash expires.
pub const HORIZON: Duration = Duration::from_secs(24 * 60 * 60);

/// One bound resource as the directory holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The instance holding the session: this node's own entries share one copy of its
    /// name (every session here has an entry).
    pub instance: Arc<str>,
    /// Initial presence sent and no unavailable since (RFC 6121 §4.2).
    pub available: bool,
    /// Priority of the last available presence (RFC 6121 §4.7.2.3).
    pub priority: i8,
    /// Not invisible (XEP-0186).
    pub visible: bool,
    /// Asked for XEP-0280 carbon copies: the node delivering a message to another of the
    /// user's resources sends this one its copy.
    pub carbons: bool,
    /// Retrieved its XEP-0191 block list: the node that changes the list pushes the change
    /// to this resource too (§3.3–§3.5).
    pub blocklist: bool,
    /// The last available presence as broadcast, while available: what another node shows
    /// the user's other resources and, if `visible`, a probe answer (RFC 6121 §4.3.2).
    pub presence: Option<String>,
}

impl Entry {
    /// A freshly bound resource: not available yet.
    pub fn bound(instance: impl Into<Arc<str>>) -> Entry {
        Entry {
            instance: instance.into(),
            available: false,
            priority: 0,
            visible: true,
            carbons: false,
            blocklist: false,
            presence: None,
        }
    }

    /// The node id part of the instance.
    pub fn node(&self) -> &str {
        node_of(&self.instance)
    }

    /// `instance \n flags \n priority \n presence`; flags are `a` available, `v` visible,
    /// `c` carbons, `b` block-list pushes, each `-` when not.
    pub fn encode(&self) -> String {
        let flags = format!(
            "{}{}{}{}",
            if self.available { 'a' } else { '-' },
            if self.visible { 'v' } else { '-' },
            if self.carbons { 'c' } else { '-' },
            if self.blocklist { 'b' } else { '-' }
        );
        format!(
            "{}\n{}\n{}\n{}",
            self.instance,
            flags,
            self.priority,
            self.presence.as_deref().unwrap_or("")
        )
    }

    /// Parses [`Self::encode`]'s output.
    pub fn decode(s: &str) -> Option<Entry> {
        let mut parts = s.splitn(4, '\n');
        let instance: Arc<str> = parts.next()?.into();
        let flags = parts.next()?;
        let priority = parts.next()?.parse().ok()?;
        let presence = parts.next()?;
        // Two flags were written before carbons and block-list pushes crossed nodes: such
        // an entry has neither. Flags past the four known here were added by a newer node
        // and are ignored, so nodes of two versions can share a directory during a rolling
        // upgrade (README, "Upgrades").
        let flags = flags.as_bytes();
        if instance.is_empty() || flags.len() < 2 {
            return None;
        }
        Some(Entry {
            instance,
            available: flags[0] == b'a',
            visible: flags[1] == b'v',
            carbons: flags.get(2) == Some(&b'c'),
            blocklist: flags.get(3) == Some(&b'b'),
            priority,
            presence: (!presence.is_empty()).then(|| presence.to_owned()),
        })
    }
}

/// The node id of an instance name.
pub fn node_of(instance: &str) -> &str {
    instance.split_once('#').map_or(instance, |(n, _)| n)
}

/// Writes an entry and returns the one it replaced (nil if none); drops entries of
/// instances that are not live any more.
/// KEYS: user hash. ARGV: resource, entry, expire-at ms, live instances...
pub const CLAIM: &str = r"
local old = redis.call('HGET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local live = {}
for i = 4, #ARGV do live[ARGV[i]] = true end
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local inst = string.match(all[i + 1], '^[^\n]*')
  if not live[inst] then redis.call('HDEL', KEYS[1], all[i]) end
end
redis.call('PEXPIREAT', KEYS[1], ARGV[3], 'NX')
redis.call('PEXPIREAT', KEYS[1], ARGV[3], 'GT')
return old
";

/// Rewrites an entry only while the instance still holds it (another node may have taken
/// the resource over since).
/// KEYS: user hash. ARGV: resource, entry, expire-at ms, instance.
pub const UPDATE: &str = r"
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur and string.match(cur, '^[^\n]*') ~= ARGV[4] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIREAT', KEYS[1], ARGV[3], 'NX')
redis.call('PEXPIREAT', KEYS[1], ARGV[3], 'GT')
return 1
";

/// Deletes an entry if it is `instance`'s (HDEL keeps the key's expiry).
/// KEYS: user hash. ARGV: resource, instance.
pub const RELEASE: &str = r"
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur and string.match(cur, '^[^\n]*') == ARGV[2] then
  redis.call('HDEL', KEYS[1], ARGV[1])
  return 1
end
return 0
";

/// Records this instance as live and returns every live instance.
/// KEYS: nodes ZSET. ARGV: instance, now ms, live-after ms, forget-before ms, expire-at ms.
pub const HEARTBEAT: &str = r"
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[4])
redis.call('PEXPIREAT', KEYS[1], ARGV[5], 'NX')
redis.call('PEXPIREAT', KEYS[1], ARGV[5], 'GT')
return redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[3], '+inf')
";

/// Key names under one prefix.
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// Keys under `prefix` (`[redis] key_prefix`).
    pub fn new(prefix: &str) -> Keys {
        Keys {
            prefix: prefix.to_owned(),
        }
    }

    /// The directory hash of one user.
    pub fn user(&self, bare: &str) -> String {
        format!("{}dir:{{{}}}", self.prefix, bare)
    }

    /// The ZSET of live instances.
    pub fn nodes(&self) -> String {
        format!("{}cluster:nodes", self.prefix)
    }

    /// The channel of `node`.
    pub fn channel(&self, node: &str) -> String {
        format!("{}cluster:{}", self.prefix, node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_round_trips_and_names_its_node() {
        let e = Entry {
            instance: "host-5222#ab12".into(),
            available: true,
            priority: -3,
            visible: false,
            carbons: true,
            blocklist: true,
            presence: Some("<presence from='a@x/r'><status>x\ny</status></presence>".into()),
        };
        assert_eq!(Entry::decode(&e.encode()), Some(e.clone()));
        // An entry written with two flags (before carbons) reads as without carbons.
        let old = Entry::decode("n#1\nav\n0\n").unwrap();
        assert!(old.available && old.visible && !old.carbons && !old.blocklist);
        assert_eq!(e.node(), "host-5222");
        let b = Entry::bound("n#1");
        assert_eq!(Entry::decode(&b.encode()), Some(b));
        assert_eq!(Entry::decode("n#1\nav\nnot a number\n"), None);
        assert_eq!(Entry::decode("n#1\na\n0\n"), None);
    }

    #[test]
    fn an_entry_from_a_newer_node_reads_by_the_flags_known_here() {
        let newer = Entry::decode("n#1\na-cbx\n2\n<presence/>").unwrap();
        assert!(newer.available && !newer.visible && newer.carbons && newer.blocklist);
        assert_eq!(newer.priority, 2);
        assert_eq!(newer.presence.as_deref(), Some("<presence/>"));
    }

    #[test]
    fn a_users_keys_carry_the_bare_jid_hash_tag() {
        let k = Keys::new("p:");
        assert_eq!(k.user("a@x"), "p:dir:{a@x}");
        assert_eq!(k.channel("n1"), "p:cluster:n1");
    }
}
