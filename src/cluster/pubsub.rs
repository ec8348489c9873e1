//! One Redis pub/sub channel, kept subscribed: every node listens on its own channels
//! (the sweeper's hand-offs, the cluster's stanzas) this way.
//!
//! On a single Redis the channel is a plain one (`SUBSCRIBE`). On a Redis Cluster it is a
//! sharded channel (`SSUBSCRIBE`, Redis 7): the subscription lives on the master owning the
//! channel's slot, read from `CLUSTER SLOTS` on any start node, over a RESP3 connection of its
//! own. It is made again on that slot's current master when
//! - the server ends it (`sunsubscribe` push: the slot moved away),
//! - the connection drops (the master died; the cluster promotes a replica), or
//! - the check every `[redis] timeout` finds the node is no longer a master (a manual
//!   `CLUSTER FAILOVER` turned it into a replica).
//!
//! Messages published while no subscription exists are lost, as with any Redis pub/sub:
//! on a failover, what was published between the promotion and the resubscription
//! (at most one check period plus the reconnect) — README, "Redis Cluster".

use std::future::Future;
use std::time::Duration;

use redis::{ConnectionAddr, ConnectionInfo, PushKind, Value};
use tokio_util::sync::CancellationToken;

use crate::cluster::redis_conn::{backoff, slot, Target};

/// Subscribes to `channel` and hands each text message to `handle`, one at a time, until
/// `shutdown`. A failed connection or subscription is retried with jittered back-off
/// doubling from 0.1 s up to `reconnect_max`; connecting may take at most twice `timeout`.
pub(crate) async fn subscribe<F, Fut>(
    target: Target,
    channel: String,
    timeout: Duration,
    reconnect_max: Duration,
    shutdown: CancellationToken,
    mut handle: F,
) where
    F: FnMut(String) -> Fut,
    Fut: Future<Output = ()>,
{
    let mut attempt = 0u32;
    loop {
        let subscribed = match &target {
            Target::Single(client) => {
                plain(client, &channel, timeout, &shutdown, &mut handle).await
            }
            Target::Cluster { start_nodes, .. } => {
                sharded(start_nodes, &channel, timeout, &shutdown, &mut handle).await
            }
        };
        if shutdown.is_cancelled() {
            return;
        }
        match subscribed {
            Ok(()) => attempt = 0,
            Err(e) => {
                tracing::warn!(%channel, error = %e, "Redis subscription failed; retrying");
                attempt = attempt.saturating_add(1);
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff(attempt, reconnect_max)) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}

/// One plain subscription until the connection ends (`Ok`) or shutdown.
async fn plain<F, Fut>(
    client: &redis::Client,
    channel: &str,
    timeout: Duration,
    shutdown: &CancellationToken,
    handle: &mut F,
) -> redis::RedisResult<()>
where
    F: FnMut(String) -> Fut,
    Fut: Future<Output = ()>,
{
    use futures_util::StreamExt;
    let mut ps = with_timeout(timeout * 2, async {
        let mut ps = client.get_async_pubsub().await?;
        ps.subscribe(channel).await?;
        Ok(ps)
    })
    .await?;
    let mut messages = ps.on_message();
    loop {
        let msg = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            m = messages.next() => m,
        };
        let Some(msg) = msg else { return Ok(()) };
        if let Ok(text) = msg.get_payload::<String>() {
            handle(text).await;
        }
    }
}

/// One sharded subscription on the master owning `channel`'s slot, until it must be made
/// again (`Ok`) or shutdown.
async fn sharded<F, Fut>(
    start_nodes: &[ConnectionInfo],
    channel: &str,
    timeout: Duration,
    shutdown: &CancellationToken,
    handle: &mut F,
) -> redis::RedisResult<()>
where
    F: FnMut(String) -> Fut,
    Fut: Future<Output = ()>,
{
    let (host, port) = master_of(start_nodes, slot(channel.as_bytes()), timeout).await?;
    let mut info = start_nodes[0].clone();
    info.addr = match info.addr {
        ConnectionAddr::TcpTls {
            insecure,
            tls_params,
            ..
        } => ConnectionAddr::TcpTls {
            host: host.clone(),
            port,
            insecure,
            tls_params,
        },
        _ => ConnectionAddr::Tcp(host.clone(), port),
    };
    // Pushes (the messages) need RESP3 on a multiplexed connection.
    info.redis.protocol = redis::ProtocolVersion::RESP3;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let cfg = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(timeout)
        .set_response_timeout(timeout)
        .set_push_sender(tx);
    let mut conn = with_timeout(timeout * 2, async {
        let client = redis::Client::open(info)?;
        let mut conn = client
            .get_multiplexed_async_connection_with_config(&cfg)
            .await?;
        redis::cmd("SSUBSCRIBE")
            .arg(channel)
            .exec_async(&mut conn)
            .await?;
        Ok(conn)
    })
    .await?;
    tracing::debug!(%channel, master = %format!("{host}:{port}"), "sharded subscription");
    let mut check = tokio::time::interval(timeout);
    check.tick().await;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            push = rx.recv() => {
                let Some(push) = push else { return Ok(()) };
                match push.kind {
                    PushKind::SMessage => {
                        if let Some(Value::BulkString(b)) = push.data.get(1) {
                            if let Ok(text) = String::from_utf8(b.clone()) {
                                handle(text).await;
                            }
                        }
                    }
                    PushKind::SUnsubscribe | PushKind::Disconnection => {
                        tracing::info!(%channel, "sharded subscription ended by Redis; resubscribing");
                        return Ok(());
                    }
                    _ => {}
                }
            }
            _ = check.tick() => {
                let role: redis::RedisResult<Vec<Value>> =
                    redis::cmd("ROLE").query_async(&mut conn).await;
                let master = matches!(
                    role.as_deref(),
                    Ok([Value::BulkString(r), ..]) if r.as_slice() == b"master"
                );
                if !master {
                    tracing::info!(%channel, "sharded subscription's node is no longer a master; resubscribing");
                    return Ok(());
                }
            }
        }
    }
}

/// `host` and port of the master serving `slot`, from the first start node that answers
/// `CLUSTER SLOTS`.
async fn master_of(
    start_nodes: &[ConnectionInfo],
    slot: u16,
    timeout: Duration,
) -> redis::RedisResult<(String, u16)> {
    let mut last = None;
    for node_url in start_nodes {
        let asked = with_timeout(timeout * 2, async {
            let client = redis::Client::open(node_url.clone())?;
            let cfg = redis::AsyncConnectionConfig::new()
                .set_connection_timeout(timeout)
                .set_response_timeout(timeout);
            let mut c = client
                .get_multiplexed_async_connection_with_config(&cfg)
                .await?;
            redis::cmd("CLUSTER")
                .arg("SLOTS")
                .query_async::<Value>(&mut c)
                .await
        })
        .await;
        match asked {
            Ok(v) => {
                if let Some(m) = slot_master(&v, slot) {
                    return Ok(m);
                }
                last = Some(redis::RedisError::from((
                    redis::ErrorKind::ClusterDown,
                    "no master serves the slot",
                )));
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        redis::RedisError::from((redis::ErrorKind::InvalidClientConfig, "no start nodes"))
    }))
}

/// Finds `slot` in a `CLUSTER SLOTS` reply: `[[start, end, [host, port, id], replicas...]...]`.
fn slot_master(reply: &Value, slot: u16) -> Option<(String, u16)> {
    let Value::Array(ranges) = reply else {
        return None;
    };
    ranges.iter().find_map(|r| {
        let Value::Array(r) = r else { return None };
        let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(master))) =
            (r.first(), r.get(1), r.get(2))
        else {
            return None;
        };
        if !(*start..=*end).contains(&i64::from(slot)) {
            return None;
        }
        let host = match master.first()? {
            Value::BulkString(h) => String::from_utf8(h.clone()).ok()?,
            Value::SimpleString(h) => h.clone(),
            _ => return None,
        };
        let Value::Int(port) = master.get(1)? else {
            return None;
        };
        Some((host, u16::try_from(*port).ok()?))
    })
}

async fn with_timeout<T>(
    d: Duration,
    f: impl Future<Output = redis::RedisResult<T>>,
) -> redis::RedisResult<T> {
    tokio::time::timeout(d, f).await.unwrap_or_else(|_| {
        Err(redis::RedisError::from((
            redis::ErrorKind::IoError,
            "timed out",
        )))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn the_master_of_a_slot_is_read_from_cluster_slots() {
        let range = |a, b, port| {
            Value::Array(vec![
                Value::Int(a),
                Value::Int(b),
                Value::Array(vec![bulk("127.0.0.1"), Value::Int(port), bulk("id")]),
                Value::Array(vec![bulk("127.0.0.1"), Value::Int(port + 3), bulk("r")]),
            ])
        };
        let reply = Value::Array(vec![range(0, 5460, 30301), range(5461, 10922, 30302)]);
        assert_eq!(slot_master(&reply, 0), Some(("127.0.0.1".into(), 30301)));
        assert_eq!(slot_master(&reply, 5461), Some(("127.0.0.1".into(), 30302)));
        assert_eq!(slot_master(&reply, 16000), None, "an unserved slot");
        assert_eq!(slot_master(&Value::Nil, 1), None);
    }
}
