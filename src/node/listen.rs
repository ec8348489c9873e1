//! What every listener shares: the reasons a start fails, the admission policy of the
//! client-facing listeners and the accept loop's next connection.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::config::Config;

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Binding a listener failed.
    #[error("cannot listen on {0}: {1}")]
    Bind(SocketAddr, std::io::Error),
    /// Certificates.
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    /// Database.
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    /// The admin socket could not be set up.
    #[error("admin socket {0}")]
    Admin(std::io::Error),
    /// Installing a signal handler failed.
    #[error("signal handlers: {0}")]
    Signal(std::io::Error),
}

/// The admission policy of every client-facing listener (c2s STARTTLS, c2s direct TLS and the
/// HTTP listener that carries WebSocket): one per-IP budget of new connections per minute and
/// one cap on open connections, shared by all of them, so a client cannot double its share by
/// spreading its connections over transports.
pub struct ListenerPolicy {
    /// One permit per open client connection (`[limits] max_connections`).
    connections: Arc<Semaphore>,
    /// Accept times per source (an IPv4 address or an IPv6 /64) within the current minute.
    per_ip: Mutex<HashMap<IpAddr, (Instant, u32)>>,
    per_ip_max: u32,
    /// Connections open per source now, against `[limits] max_connections_per_ip`.
    open: Arc<Mutex<HashMap<IpAddr, usize>>>,
    open_max: usize,
}

/// A connection's place: under the cap of all connections and under its source's; both
/// are given back when it is dropped, with the connection.
pub struct Admitted {
    _permit: OwnedSemaphorePermit,
    source: IpAddr,
    open: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = open.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.source);
            }
        }
    }
}

/// Why [`ListenerPolicy::admit`] refused a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The source address opened more connections this minute than
    /// `[limits] connections_per_ip_per_minute` allows.
    Rate,
    /// `[limits] max_connections` connections are open.
    Full,
    /// The source has `[limits] max_connections_per_ip` connections open.
    SourceFull,
}

impl ListenerPolicy {
    /// The policy `[limits]` describes.
    pub fn new(config: &Config) -> Self {
        ListenerPolicy {
            connections: Arc::new(Semaphore::new(config.limits.max_connections)),
            per_ip: Mutex::new(HashMap::new()),
            per_ip_max: config.limits.connections_per_ip_per_minute,
            open: Arc::default(),
            open_max: config.limits.max_connections_per_ip,
        }
    }

    /// Admits a new connection from `peer`, or says why not. The permit is the connection's
    /// place under the cap: hold it for as long as the connection lives.
    pub fn admit(&self, peer: SocketAddr) -> Result<Admitted, Refusal> {
        if !self.within_rate(peer.ip()) {
            tracing::warn!(%peer, "connection rate from this address exceeded");
            return Err(Refusal::Rate);
        }
        let permit = self.connections.clone().try_acquire_owned().map_err(|_| {
            tracing::warn!(%peer, "connection limit reached");
            Refusal::Full
        })?;
        // One host (an IPv6 host holds a /64) may not take every place.
        let source = crate::rate_limit::source_of(peer.ip());
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let n = open.entry(source).or_insert(0);
        if *n >= self.open_max {
            tracing::warn!(%peer, "connections open from this address at the limit");
            return Err(Refusal::SourceFull);
        }
        *n += 1;
        Ok(Admitted {
            _permit: permit,
            source,
            open: self.open.clone(),
        })
    }

    /// Counts a new connection from `ip`; false when it is over the per-minute budget.
    fn within_rate(&self, ip: IpAddr) -> bool {
        let now = Instant::now();
        let mut map = self.per_ip.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() > 100_000 {
            map.retain(|_, (start, _)| now.duration_since(*start) < Duration::from_secs(60));
        }
        // An IPv6 host commonly holds a whole /64: the budget is the /64's.
        let entry = map
            .entry(crate::rate_limit::source_of(ip))
            .or_insert((now, 0));
        if now.duration_since(entry.0) >= Duration::from_secs(60) {
            *entry = (now, 0);
        }
        entry.1 += 1;
        entry.1 <= self.per_ip_max
    }
}

/// The next connection on `listener`, or `None` once the server shuts down. Accept errors
/// (EMFILE and friends) are logged and backed off instead of spinning; every listener
/// (c2s, s2s, http) accepts through here.
pub async fn next_connection(
    listener: &TcpListener,
    shutdown: &CancellationToken,
    what: &str,
) -> Option<(TcpStream, SocketAddr)> {
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => return None,
            a = listener.accept() => a,
        };
        match accepted {
            Ok(a) => return Some(a),
            Err(e) => {
                tracing::warn!(listener = what, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Binds a TCP listener; returns it with the address it got (port 0 picks one). The error
/// names the address.
pub async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), StartError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| StartError::Bind(addr, e))?;
    let local = listener
        .local_addr()
        .map_err(|e| StartError::Bind(addr, e))?;
    Ok((listener, local))
}
