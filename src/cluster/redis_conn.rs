//! The Redis transport: one connection type over the two deployments the server supports.
//!
//! - A single Redis (`[redis] url`): one multiplexed connection, pipelines as they are
//!   built, plain `PUBLISH`/`SUBSCRIBE` channels.
//! - A Redis Cluster (`[cluster] redis_nodes`): the redis crate's cluster connection, which
//!   follows `MOVED`/`ASK` and refreshes the slot map itself. A pipeline must stay within
//!   one slot there, so [`SlotPipe`] splits one per slot (Redis Cluster specification, "Keys
//!   distribution model"); node channels are sharded (`SPUBLISH`/`SSUBSCRIBE`, Redis 7), so a
//!   message travels to the one shard owning the channel's slot instead of every node, and
//!   the receiver count `SPUBLISH` returns is that shard's subscribers: the same meaning as
//!   `PUBLISH`'s on a single Redis, which the sweeper relies on (a node with no subscriber
//!   is dead).
//!
//! Everything above this module calls [`Target`], [`Conn`] and [`SlotPipe`] and does not
//! know which of the two it runs on, except through [`Target::publish`].
//! Keys that one script touches together carry the same hash tag (the bare JID), and
//! every script names each key it touches in `KEYS`.

use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{AsyncConnectionConfig, Cmd, ConnectionInfo, RedisFuture, RedisResult, Value};

use crate::config::Config;

/// Where Redis is: one server, or the start nodes of a cluster.
#[derive(Clone)]
pub enum Target {
    /// One Redis server.
    Single(redis::Client),
    /// A Redis Cluster, reached through any of its start nodes.
    Cluster {
        /// The cluster client (slot map, redirections, reconnects); boxed, it is large.
        client: Box<ClusterClient>,
        /// The start nodes as given: credentials and TLS settings for the sharded subscribers'
        /// own connections.
        start_nodes: Vec<ConnectionInfo>,
    },
}

impl Target {
    /// The Redis of `config`: `[cluster] redis_nodes` if any, else `[redis] url`, else
    /// none (liveness in process). A malformed URL is an error (the config check
    /// rejects it before this runs).
    pub fn from_config(config: &Config) -> Result<Option<Target>, redis::RedisError> {
        let start_nodes = &config.cluster.redis_nodes;
        if !start_nodes.is_empty() {
            let infos = start_nodes
                .iter()
                .map(|s| redis::IntoConnectionInfo::into_connection_info(s.as_str()))
                .collect::<RedisResult<Vec<ConnectionInfo>>>()?;
            let client = ClusterClient::builder(infos.clone())
                .connection_timeout(config.redis.timeout)
                .response_timeout(config.redis.timeout)
                // The link retries with its own back-off; a command fails fast.
                .retries(2)
                .build()?;
            return Ok(Some(Target::Cluster {
                client: Box::new(client),
                start_nodes: infos,
            }));
        }
        if config.redis.url.is_empty() {
            return Ok(None);
        }
        Ok(Some(Target::Single(redis::Client::open(
            config.redis.url.as_str(),
        )?)))
    }

    /// `host:port` of the server, or `cluster(host:port,...)` of the start nodes: named in
    /// every log line about Redis.
    pub fn describe(&self) -> String {
        match self {
            Target::Single(c) => c.get_connection_info().addr.to_string(),
            Target::Cluster { start_nodes, .. } => {
                let s: Vec<String> = start_nodes.iter().map(|i| i.addr.to_string()).collect();
                format!("cluster({})", s.join(","))
            }
        }
    }

    /// Whether this is a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self, Target::Cluster { .. })
    }

    /// A multiplexed connection; connecting takes at most twice `timeout`.
    pub async fn connect(&self, timeout: Duration) -> RedisResult<Conn> {
        let run = async {
            match self {
                Target::Single(client) => {
                    let cfg = AsyncConnectionConfig::new()
                        .set_connection_timeout(timeout)
                        .set_response_timeout(timeout);
                    client
                        .get_multiplexed_async_connection_with_config(&cfg)
                        .await
                        .map(Conn::Single)
                }
                Target::Cluster { client, .. } => {
                    client.get_async_connection().await.map(Conn::Cluster)
                }
            }
        };
        match tokio::time::timeout(timeout * 2, run).await {
            Ok(r) => r,
            Err(_) => Err(redis::RedisError::from((
                redis::ErrorKind::IoError,
                "connect timed out",
            ))),
        }
    }

    /// A command publishing `message` on `channel`: `SPUBLISH` on a cluster (routed to the
    /// shard owning the channel's slot), `PUBLISH` on a single Redis. Both answer with the
    /// number of subscribers that received it.
    pub fn publish(&self, channel: &str, message: &str) -> Cmd {
        let mut c = redis::cmd(if self.is_cluster() {
            "SPUBLISH"
        } else {
            "PUBLISH"
        });
        c.arg(channel).arg(message);
        c
    }
}

/// A connection to either deployment. Cheap to clone (both are multiplexed).
#[derive(Clone)]
pub enum Conn {
    /// One Redis server.
    Single(MultiplexedConnection),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// The Redis Cluster slot of `key`: CRC16 (XMODEM) of the hash tag (the part between the
/// first `{` and the next `}`, when not empty) or of the whole key, modulo 16384
/// (Redis Cluster specification, "Hash tags").
pub fn slot(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    crc16::State::<crc16::XMODEM>::calculate(tagged) % 16384
}

/// Commands sent together: one pipeline on a single Redis, one pipeline per slot on a
/// cluster (sent concurrently; commands of one slot keep their order, which is all the
/// callers need: one user's keys, one node's channel). Every command names the key (or
/// channel) it is routed by.
#[derive(Default)]
pub struct SlotPipe {
    cmds: Vec<(u16, Cmd)>,
}

impl SlotPipe {
    /// An empty batch.
    pub fn new() -> SlotPipe {
        SlotPipe::default()
    }

    /// Adds `cmd`, which touches `key` (a script: its first key; every key of one script
    /// shares a hash tag).
    pub fn add(&mut self, key: &str, cmd: Cmd) -> &mut SlotPipe {
        self.cmds.push((slot(key.as_bytes()), cmd));
        self
    }

    /// Number of commands.
    pub fn len(&self) -> usize {
        self.cmds.len()
    }

    /// Whether there is nothing to send.
    pub fn is_empty(&self) -> bool {
        self.cmds.is_empty()
    }

    /// Number of pipelines a cluster needs for this batch (distinct slots).
    pub fn slots(&self) -> usize {
        let mut s: Vec<u16> = self.cmds.iter().map(|(s, _)| *s).collect();
        s.sort_unstable();
        s.dedup();
        s.len()
    }

    /// Sends everything; the replies in the order the commands were added. An error in any
    /// pipeline fails the whole call (what was sent may have been applied).
    pub async fn query(self, conn: &mut Conn) -> RedisResult<Vec<Value>> {
        if self.cmds.is_empty() {
            return Ok(Vec::new());
        }
        match conn {
            Conn::Single(c) => {
                let mut pipe = redis::pipe();
                for (_, cmd) in &self.cmds {
                    pipe.add_command(cmd.clone());
                }
                pipe.query_async(c).await
            }
            Conn::Cluster(c) => {
                // Group by slot, remembering each command's place.
                let mut groups: Vec<(u16, redis::Pipeline, Vec<usize>)> = Vec::new();
                for (i, (s, cmd)) in self.cmds.iter().enumerate() {
                    let g = match groups.iter().position(|(gs, _, _)| gs == s) {
                        Some(g) => g,
                        None => {
                            groups.push((*s, redis::pipe(), Vec::new()));
                            groups.len() - 1
                        }
                    };
                    groups[g].1.add_command(cmd.clone());
                    groups[g].2.push(i);
                }
                let sent = groups.iter().map(|(_, pipe, _)| {
                    let mut c = c.clone();
                    async move { pipe.query_async::<Vec<Value>>(&mut c).await }
                });
                let replies = futures_util::future::join_all(sent).await;
                let mut out = vec![Value::Nil; self.cmds.len()];
                for ((_, _, places), reply) in groups.iter().zip(replies) {
                    for (&i, v) in places.iter().zip(reply?) {
                        out[i] = v;
                    }
                }
                Ok(out)
            }
        }
    }
}

/// Back-off before reconnect attempt `attempt` (0-based): doubling from 0.1 s up to `max`,
/// then a random 50–100 % of it, so nodes that lost Redis together do not all come back in
/// the same instant.
pub fn backoff(attempt: u32, max: Duration) -> Duration {
    let base = Duration::from_millis(100)
        .saturating_mul(1u32 << attempt.min(16))
        .min(max);
    base.mul_f64(0.5 + rand::random::<f64>() * 0.5)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_the_cluster_specification() {
        // The specification's example: CRC16("123456789") = 0x31C3.
        assert_eq!(
            crc16::State::<crc16::XMODEM>::calculate(b"123456789"),
            0x31c3
        );
        // Values CLUSTER KEYSLOT answers.
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"bar"), 5061);
        // A hash tag decides alone; an empty one does not count.
        assert_eq!(slot(b"p:presence:{a@b}:res:x"), slot(b"a@b"));
        assert_eq!(slot(b"dir:{a@b}"), slot(b"p:presence:{a@b}:res:y"));
        assert_eq!(
            slot(b"{}foo"),
            crc16::State::<crc16::XMODEM>::calculate(b"{}foo") % 16384
        );
        assert_eq!(slot(b"x{foo}{bar}"), slot(b"foo"));
    }

    #[test]
    fn a_batch_counts_its_slots() {
        let mut p = SlotPipe::new();
        p.add("{a@b}:1", redis::cmd("GET"))
            .add("{a@b}:2", redis::cmd("GET"))
            .add("{c@d}:1", redis::cmd("GET"));
        assert_eq!((p.len(), p.slots()), (3, 2));
    }

    #[test]
    fn backoff_doubles_up_to_the_maximum_with_jitter_below_it() {
        let max = Duration::from_secs(5);
        for attempt in 0..20 {
            let b = backoff(attempt, max);
            let full = Duration::from_millis(100 << attempt.min(16)).min(max);
            assert!(b >= full / 2 && b <= full, "{attempt}: {b:?}");
        }
    }
}
