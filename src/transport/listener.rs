//! Every listener of the node: the reasons a start fails, admission (a cap on open
//! connections, per-source budgets) and the one accept loop, which runs each admitted
//! connection's task on the node's task tracker, the one shutdown waits for. What a
//! listener does with a connection is its [`Handler`]'s: c2s (STARTTLS and direct TLS), the
//! client HTTP/WebSocket listener, the operators' HTTP listener, s2s inbound and the admin
//! Unix socket.

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Binding a listener failed.
    #[error("cannot listen on {0}: {1}")]
    Bind(SocketAddr, std::io::Error),
    /// Certificates.
    #[error(transparent)]
    Tls(#[from] crate::transport::tls::TlsError),
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

/// A listener's admission policy: a cap on open connections, and per source (an IPv4
/// address or an IPv6 /64) a budget of new connections per minute and of open ones.
///
/// The client-facing listeners (c2s STARTTLS, c2s direct TLS and the HTTP listener that
/// carries WebSocket) share one policy, `[limits]`, so a client cannot double its share by
/// spreading its connections over transports. s2s inbound has its own (`[s2s]`), the
/// operators' HTTP listener only a cap (`[admin]`).
pub struct ListenerPolicy {
    /// One permit per open connection.
    connections: Arc<Semaphore>,
    /// What is logged when the cap refuses a connection.
    full: &'static str,
    /// The budget of new connections per source and minute; `None`: none.
    per_ip: Option<PerMinute>,
    /// Connections open per source now.
    open: Arc<Mutex<HashMap<IpAddr, usize>>>,
    open_max: usize,
}

/// New connections per source within the current minute, against `max`.
struct PerMinute {
    seen: Mutex<HashMap<IpAddr, (Instant, u32)>>,
    max: u32,
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
    /// The source address opened more connections this minute than its budget allows
    /// (`[limits] connections_per_ip_per_minute`).
    Rate,
    /// The listener's cap of open connections is reached (`[limits] max_connections`,
    /// `[s2s] max_connections`, `[admin] max_connections`).
    Full,
    /// The source has its budget of open connections (`[limits] max_connections_per_ip`,
    /// `[s2s] max_connections_per_ip`).
    SourceFull,
}

impl ListenerPolicy {
    /// The client-facing listeners' policy, `[limits]`.
    pub fn new(config: &Config) -> Self {
        let l = &config.limits;
        Self::with(l.max_connections, "connection limit reached")
            .per_minute(l.connections_per_ip_per_minute)
            .per_source(l.max_connections_per_ip)
    }

    /// s2s inbound's policy, `[s2s]`: a cap and a budget of open connections per source; no
    /// per-minute budget (a peer reconnects after a lost link, and has one each way).
    pub(crate) fn s2s(config: &Config) -> Self {
        let s = &config.s2s;
        Self::with(s.max_connections, "s2s connection limit reached")
            .per_source(s.max_connections_per_ip)
    }

    /// A cap of `max` open connections and no per-source budget; `full` is logged when it
    /// refuses one.
    pub(crate) fn with(max: usize, full: &'static str) -> Self {
        ListenerPolicy {
            connections: Arc::new(Semaphore::new(max)),
            full,
            per_ip: None,
            open: Arc::default(),
            open_max: usize::MAX,
        }
    }

    fn per_minute(mut self, max: u32) -> Self {
        self.per_ip = Some(PerMinute {
            seen: Mutex::new(HashMap::new()),
            max,
        });
        self
    }

    fn per_source(mut self, max: usize) -> Self {
        self.open_max = max;
        self
    }

    /// Admits a new connection from `peer`, or says why not. The permit is the connection's
    /// place under the cap: hold it for as long as the connection lives.
    pub fn admit(&self, peer: SocketAddr) -> Result<Admitted, Refusal> {
        if !self.within_rate(peer.ip()) {
            tracing::warn!(%peer, "connection rate from this address exceeded");
            return Err(Refusal::Rate);
        }
        let permit = self.connections.clone().try_acquire_owned().map_err(|_| {
            tracing::warn!(%peer, "{}", self.full);
            Refusal::Full
        })?;
        // One host (an IPv6 host holds a /64) may not take every place.
        let source = crate::policy::rate_limit::source_of(peer.ip());
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
        let Some(PerMinute { seen, max }) = &self.per_ip else {
            return true;
        };
        let now = Instant::now();
        let mut map = seen.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() > 100_000 {
            map.retain(|_, (start, _)| now.duration_since(*start) < Duration::from_secs(60));
        }
        // An IPv6 host commonly holds a whole /64: the budget is the /64's.
        let entry = map
            .entry(crate::policy::rate_limit::source_of(ip))
            .or_insert((now, 0));
        if now.duration_since(entry.0) >= Duration::from_secs(60) {
            *entry = (now, 0);
        }
        entry.1 += 1;
        entry.1 <= *max
    }
}

/// A socket a [`Listener`] accepts on.
pub(crate) trait Socket: Send + Sync + 'static {
    /// One accepted connection.
    type Stream: Send + 'static;
    /// Where it comes from.
    type Peer: Send + 'static;
    /// The next connection.
    fn accept(&self) -> impl Future<Output = std::io::Result<(Self::Stream, Self::Peer)>> + Send;
    /// The address admission counts `peer` by; `None` where addresses mean nothing.
    fn source(peer: &Self::Peer) -> Option<SocketAddr>;
}

impl Socket for TcpListener {
    type Stream = TcpStream;
    type Peer = SocketAddr;
    async fn accept(&self) -> std::io::Result<(TcpStream, SocketAddr)> {
        let (stream, peer) = TcpListener::accept(self).await?;
        // Nagle plus delayed ACK stalls small TLS records; stanzas are small.
        let _ = stream.set_nodelay(true);
        Ok((stream, peer))
    }
    fn source(peer: &SocketAddr) -> Option<SocketAddr> {
        Some(*peer)
    }
}

impl Socket for UnixListener {
    type Stream = UnixStream;
    type Peer = tokio::net::unix::SocketAddr;
    async fn accept(&self) -> std::io::Result<(UnixStream, Self::Peer)> {
        UnixListener::accept(self).await
    }
    /// Only the socket file's owner can connect (mode 0600): no per-source budget.
    fn source(_: &Self::Peer) -> Option<SocketAddr> {
        None
    }
}

/// A task a refused connection still gets (to be told why).
pub(crate) type Answer = Pin<Box<dyn Future<Output = ()> + Send>>;

/// What a listener does with its connections.
pub(crate) trait Handler<S: Socket>: Send + Sync + 'static {
    /// Serves one admitted connection: the connection's task, run on the node's tracker
    /// while the connection holds its place under the listener's policy.
    fn serve(&self, stream: S::Stream, peer: S::Peer) -> impl Future<Output = ()> + Send + 'static;

    /// What a connection the policy refused gets before it is closed; by default nothing.
    fn refuse(&self, _stream: S::Stream, _peer: S::Peer, _why: Refusal) -> Option<Answer> {
        None
    }

    /// Whether connections are taken now; one that is not is closed unanswered.
    fn accepts(&self) -> bool {
        true
    }
}

/// One listening socket of the node: accepts until shutdown, admits under its policy and
/// runs each connection's task, and each refusal's answer, on the node's tracker.
pub(crate) struct Listener<S> {
    /// Names the listener in log lines (`c2s`, `http`, `admin`, `s2s`, `admin socket`).
    name: &'static str,
    socket: S,
    policy: Option<Arc<ListenerPolicy>>,
    shutdown: CancellationToken,
    tasks: TaskTracker,
}

impl<S: Socket> Listener<S> {
    /// A listener on `socket` for the node `shared`; without a policy every connection is
    /// taken.
    pub(crate) fn new(
        name: &'static str,
        socket: S,
        policy: Option<Arc<ListenerPolicy>>,
        shared: &crate::node::Shared,
    ) -> Self {
        Listener {
            name,
            socket,
            policy,
            shutdown: shared.shutdown.clone(),
            tasks: shared.tasks.clone(),
        }
    }

    /// Accepts on the node's tracker until shutdown.
    pub(crate) fn spawn(self, handler: impl Handler<S>) {
        self.tasks.clone().spawn(self.run(handler));
    }

    /// Accepts until shutdown.
    pub(crate) async fn run(self, handler: impl Handler<S>) {
        while let Some((stream, peer)) = self.next().await {
            if !handler.accepts() {
                continue;
            }
            let place = match (&self.policy, S::source(&peer)) {
                (Some(policy), Some(addr)) => match policy.admit(addr) {
                    Ok(place) => Some(place),
                    Err(why) => {
                        if let Some(answer) = handler.refuse(stream, peer, why) {
                            self.tasks.spawn(answer);
                        }
                        continue;
                    }
                },
                _ => None,
            };
            self.tasks
                .spawn(holding(handler.serve(stream, peer), place));
        }
    }

    /// The next connection, or `None` once the server shuts down. Accept errors (EMFILE
    /// and friends) are logged and backed off instead of spinning.
    async fn next(&self) -> Option<(S::Stream, S::Peer)> {
        loop {
            let accepted = tokio::select! {
                _ = self.shutdown.cancelled() => return None,
                a = self.socket.accept() => a,
            };
            match accepted {
                Ok(a) => return Some(a),
                Err(e) => {
                    tracing::warn!(listener = self.name, error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}

/// Runs `task` and then gives back the connection's place. `map` keeps the task's future
/// once; an `async move { task.await; drop(place) }` block would hold it twice (the
/// captured value and the awaited one), doubling the memory of every idle connection.
fn holding<F: Future<Output = ()>>(task: F, place: Option<Admitted>) -> impl Future<Output = ()> {
    task.map(move |()| drop(place))
}

/// Binds a TCP listener; returns it with the address it got (port 0 picks one). The error
/// names the address.
pub(crate) async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), StartError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| StartError::Bind(addr, e))?;
    let local = listener
        .local_addr()
        .map_err(|e| StartError::Bind(addr, e))?;
    Ok((listener, local))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s2s_admission_counts_open_connections_per_source_and_not_per_minute() {
        let mut config = Config::default();
        config.s2s.max_connections = 10;
        config.s2s.max_connections_per_ip = 2;
        let policy = ListenerPolicy::s2s(&config);
        let peer: SocketAddr = "192.0.2.1:5269".parse().unwrap();
        let other: SocketAddr = "192.0.2.2:5269".parse().unwrap();
        let first = policy.admit(peer).unwrap();
        let _second = policy.admit(peer).unwrap();
        assert_eq!(policy.admit(peer).err(), Some(Refusal::SourceFull));
        assert!(
            policy.admit(other).is_ok(),
            "another source has its own budget"
        );
        drop(first);
        // A place given back is free again, however many connections came this minute.
        for _ in 0..200 {
            drop(policy.admit(peer).unwrap());
        }
    }

    #[test]
    fn a_connection_task_holds_its_future_once() {
        let policy = ListenerPolicy::with(1, "full");
        let place = policy.admit("192.0.2.1:1".parse().unwrap()).ok();
        let state = [7u8; 4096];
        let task = async move {
            tokio::task::yield_now().await;
            std::hint::black_box(&state);
        };
        let alone = std::mem::size_of_val(&task);
        let held = holding(task, place);
        assert!(
            std::mem::size_of_val(&held) < alone + 256,
            "{} B held against {alone} B alone",
            std::mem::size_of_val(&held)
        );
    }

    #[test]
    fn a_cap_only_policy_refuses_past_the_cap_and_nothing_else() {
        let policy = ListenerPolicy::with(1, "full");
        let peer: SocketAddr = "[2001:db8::1]:80".parse().unwrap();
        let held = policy.admit(peer).unwrap();
        assert_eq!(policy.admit(peer).err(), Some(Refusal::Full));
        drop(held);
        assert!(policy.admit(peer).is_ok());
    }
}
