//! One Redis pub/sub channel, kept subscribed: every node listens on its own channels
//! (the sweeper's hand-offs, the cluster's stanzas) this way.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Subscribes to `channel` and hands each text message to `handle`, one at a time, until
/// `shutdown`. A failed connection or subscription is retried with back-off doubling from
/// 0.1 s up to `reconnect_max`; connecting may take at most twice `timeout`. Messages
/// published while disconnected are lost (Redis pub/sub keeps nothing).
pub async fn subscribe<F, Fut>(
    client: redis::Client,
    channel: String,
    timeout: Duration,
    reconnect_max: Duration,
    shutdown: CancellationToken,
    mut handle: F,
) where
    F: FnMut(String) -> Fut,
    Fut: Future<Output = ()>,
{
    use futures_util::StreamExt;
    let mut backoff = Duration::from_millis(100);
    loop {
        let connected = tokio::time::timeout(timeout * 2, async {
            let mut ps = client.get_async_pubsub().await?;
            ps.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(ps)
        })
        .await;
        if let Ok(Ok(mut ps)) = connected {
            backoff = Duration::from_millis(100);
            let mut messages = ps.on_message();
            loop {
                let msg = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    m = messages.next() => m,
                };
                let Some(msg) = msg else { break };
                if let Ok(text) = msg.get_payload::<String>() {
                    handle(text).await;
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown.cancelled() => return,
        }
        backoff = (backoff * 2).min(reconnect_max);
    }
}
