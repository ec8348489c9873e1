//! The one HTTP(S) listener: the RFC 7395 WebSocket endpoint, XEP-0156 discovery
//! (`/.well-known/host-meta` and `host-meta.json`); and the operators' `[admin]` listener
//! (Prometheus `/metrics`, the status page).
//!
//! Only GET of those paths is served, so a tiny request-head parser (httparse) is enough;
//! a WebSocket upgrade hands the connection, with the head replayed, to tokio-tungstenite.
//! TLS uses the same certificates as c2s (`[tls]`).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

use crate::node::io::BoxIo;
use crate::node::Shared;
use crate::services::Services;
use crate::transport::listener::{Answer, Handler, Listener, ListenerPolicy, Refusal, StartError};

/// Binds the listener (if enabled) and starts accepting. Returns the bound address.
pub(crate) async fn start(
    shared: &Arc<Shared>,
    services: &Arc<Services>,
    policy: Arc<ListenerPolicy>,
) -> Result<Option<SocketAddr>, StartError> {
    let c = &shared.config.http;
    if !c.enabled {
        return Ok(None);
    }
    let addr = SocketAddr::new(c.bind, c.port);
    let (listener, local) = crate::transport::listener::bind(addr).await?;
    tracing::info!(addr = %local, tls = c.tls, path = %c.websocket_path, "http listening");
    let handler = Client {
        shared: shared.clone(),
        services: services.clone(),
    };
    Listener::new("http", listener, Some(policy), shared).spawn(handler);
    Ok(Some(local))
}

/// The client listener's connections: host-meta, or a WebSocket stream whose session ends
/// with the connection's task.
struct Client {
    shared: Arc<Shared>,
    services: Arc<Services>,
}

impl Handler<TcpListener> for Client {
    fn serve(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
    ) -> impl Future<Output = ()> + Send + 'static {
        let (shared, services) = (self.shared.clone(), self.services.clone());
        let port = stream.local_addr().map(|a| a.port()).unwrap_or(0);
        handle(shared, services, Box::new(stream), peer, port)
    }

    fn refuse(&self, stream: TcpStream, _: SocketAddr, why: Refusal) -> Option<Answer> {
        // RFC 6585 §4 for the rate, RFC 9110 §15.6.4 for the cap; a WebSocket client sees
        // its handshake refused with the same status.
        let (status, text) = match why {
            Refusal::Rate => (429, "too many connections from your address"),
            Refusal::Full => (503, "the server is full"),
            Refusal::SourceFull => (429, "too many connections open from your address"),
        };
        Some(Box::pin(respond(
            Box::new(stream),
            status,
            "text/plain",
            text,
        )))
    }
}

/// Binds the operators' HTTP listener (`[admin]`, loopback by default, never the client
/// port): `/metrics`, the status page `/status` and the figures it polls, `/status.json`.
/// No cross-origin header: a web page a user visits must not read them. With `[admin]
/// token` set, every request must carry it.
pub(crate) async fn start_admin(shared: &Arc<Shared>) -> Result<Option<SocketAddr>, StartError> {
    let c = &shared.config.admin;
    if !c.enabled {
        return Ok(None);
    }
    let addr = SocketAddr::new(c.bind, c.port);
    let (listener, local) = crate::transport::listener::bind(addr).await?;
    tracing::info!(addr = %local, "admin http listening (/metrics, /status)");
    let policy = ListenerPolicy::with(
        c.max_connections.max(1),
        "admin listener: connection limit reached",
    );
    let handler = Operators {
        shared: shared.clone(),
    };
    Listener::new("admin", listener, Some(Arc::new(policy)), shared).spawn(handler);
    Ok(Some(local))
}

/// The operators' listener's connections: one request each.
struct Operators {
    shared: Arc<Shared>,
}

impl Handler<TcpListener> for Operators {
    fn serve(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
    ) -> impl Future<Output = ()> + Send + 'static {
        admin_request(self.shared.clone(), Box::new(stream), peer)
    }
}

/// Reads one request of the operators' listener and answers it.
async fn admin_request(shared: Arc<Shared>, mut io: BoxIo, peer: SocketAddr) {
    let deadline = tokio::time::Instant::now() + shared.live.get().limits.negotiation_timeout;
    let max = shared.config.http.max_request_head;
    let (status, ctype, body) = match read_head(&mut io, deadline, max, peer).await {
        Err(None) => return,
        Err(Some((status, text))) => (status, "text/plain", text.to_owned()),
        Ok((head, _)) if head.method != "GET" => (405, "text/plain", "only GET".into()),
        Ok((head, _)) if !admin_host_allowed(&shared, head.host.as_deref()) => {
            tracing::warn!(%peer, host = ?head.host, "admin listener: Host not answered");
            (
                421,
                "text/plain",
                "this Host is not answered here ([admin] hosts)".into(),
            )
        }
        // The page is the same static file for everyone; the figures it polls need the
        // token.
        Ok((head, _)) if head.path.split('?').next() == Some("/status") => (
            200,
            "text/html; charset=utf-8",
            crate::transport::status::PAGE.into(),
        ),
        Ok((head, _)) if !admin_authorized(&shared, &head) => {
            tracing::info!(%peer, path = %head.path, "admin listener: missing or wrong token");
            (401, "text/plain", "token required ([admin] token)".into())
        }
        Ok((head, _)) => match head.path.split('?').next().unwrap_or("") {
            "/metrics" => (200, crate::metrics::CONTENT_TYPE, shared.metrics.render()),
            "/status.json" => {
                let snapshot = crate::transport::status::snapshot(&shared).await;
                match serde_json::to_string(&snapshot) {
                    Ok(json) => (200, "application/json", json),
                    Err(e) => (500, "text/plain", e.to_string()),
                }
            }
            _ => (404, "text/plain", "not found".into()),
        },
    };
    respond_with(
        io,
        status,
        ctype,
        &body,
        "Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\n",
    )
    .await;
}

/// Whether a request for figures may be answered: always without `[admin] token`, else
/// when it carries the token as `Authorization: Bearer` (RFC 6750 §2.1), compared in
/// constant time. Not as a query parameter (§2.3): URLs end up in logs and histories.
fn admin_authorized(shared: &Shared, head: &Head) -> bool {
    use subtle::ConstantTimeEq;
    let Some(expected) = shared.config.admin.token.as_deref() else {
        return true;
    };
    head.authorization
        .as_deref()
        .and_then(|a| a.strip_prefix("Bearer "))
        .map(str::trim)
        .is_some_and(|given| bool::from(given.as_bytes().ct_eq(expected.as_bytes())))
}

/// Whether the admin listener answers a request for `host` (its Host header). With a
/// token, any: a page elsewhere cannot know it. Without one, an IP address, `localhost`, a
/// served domain or a name in `[admin] hosts`: a web page whose own name an attacker
/// points at 127.0.0.1 (DNS rebinding) is sent its Host, and is refused.
fn admin_host_allowed(shared: &Shared, host: Option<&str>) -> bool {
    if shared.config.admin.token.is_some() {
        return true;
    }
    let Some(host) = host else {
        // HTTP/1.0 without Host: no browser sends such a request.
        return true;
    };
    let Some(name) = host_name(host) else {
        return false;
    };
    name.parse::<std::net::IpAddr>().is_ok()
        || name == "localhost"
        || shared.config.serves(&name)
        || shared
            .config
            .admin
            .hosts
            .iter()
            .any(|h| h.eq_ignore_ascii_case(&name))
}

/// The name a Host header names, without its port (which must be a number) or a trailing
/// root dot, lower-cased; an IPv6 literal without its brackets. `None` for a malformed one.
fn host_name(host: &str) -> Option<String> {
    let (name, port) = match host.strip_prefix('[') {
        Some(v6) => {
            let (addr, rest) = v6.split_once(']')?;
            (addr, rest.strip_prefix(':'))
        }
        None => match host.rsplit_once(':') {
            Some((n, p)) => (n, Some(p)),
            None => (host, None),
        },
    };
    if port.is_some_and(|p| p.parse::<u16>().is_err()) {
        return None;
    }
    Some(name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase())
}

/// A parsed request head.
struct Head {
    method: String,
    path: String,
    upgrade_websocket: bool,
    host: Option<String>,
    authorization: Option<String>,
}

fn parse_head(buf: &[u8]) -> Result<Option<(Head, usize)>, ()> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => {
            let header = |name: &str| {
                req.headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case(name))
                    .and_then(|h| std::str::from_utf8(h.value).ok())
                    .map(str::to_owned)
            };
            let upgrade = header("upgrade").is_some_and(|u| u.eq_ignore_ascii_case("websocket"));
            Ok(Some((
                Head {
                    method: req.method.unwrap_or("").to_owned(),
                    path: req.path.unwrap_or("").to_owned(),
                    upgrade_websocket: upgrade,
                    host: header("host"),
                    authorization: header("authorization"),
                },
                n,
            )))
        }
        Ok(httparse::Status::Partial) => Ok(None),
        Err(_) => Err(()),
    }
}

/// Reads a request head within `deadline` and `max` bytes; returns it with the bytes read
/// (a WebSocket upgrade replays them). `Err(Some(..))` is the error response to send,
/// `Err(None)` a connection that went away.
async fn read_head(
    io: &mut BoxIo,
    deadline: tokio::time::Instant,
    max: usize,
    peer: SocketAddr,
) -> Result<(Head, Vec<u8>), Option<(u16, &'static str)>> {
    let mut buf = Vec::with_capacity(1024);
    loop {
        let mut chunk = [0u8; 1024];
        let n = match tokio::time::timeout_at(deadline, io.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Err(None),
            Ok(Ok(n)) => n,
            Err(_) => {
                tracing::info!(%peer, "http request head not complete within the negotiation timeout");
                return Err(Some((408, "request head too slow")));
            }
        };
        buf.extend_from_slice(&chunk[..n]);
        match parse_head(&buf) {
            Ok(Some((h, _))) => return Ok((h, buf)),
            Ok(None) if buf.len() < max => continue,
            Ok(None) => return Err(Some((431, "request head too large"))),
            Err(()) => return Err(Some((400, "bad request"))),
        }
    }
}

async fn handle(
    shared: Arc<Shared>,
    services: Arc<Services>,
    io: BoxIo,
    peer: SocketAddr,
    local_port: u16,
) {
    // The TLS handshake and the whole request head share one deadline: a bound on each read
    // alone lets a client trickle a byte per read and keep the connection for ever. The head
    // is HTTP's negotiation, so it gets the c2s negotiation time.
    let timeout = shared.live.get().limits.negotiation_timeout;
    let deadline = tokio::time::Instant::now() + timeout;
    let secure_listener = shared.config.http.tls;
    let mut io = if secure_listener {
        let acceptor = tokio_rustls::TlsAcceptor::from(shared.tls.clone());
        match tokio::time::timeout_at(deadline, acceptor.accept(io)).await {
            Ok(Ok(tls)) => Box::new(tls) as BoxIo,
            _ => {
                tracing::debug!(%peer, "https handshake failed");
                return;
            }
        }
    } else {
        io
    };
    let max = shared.config.http.max_request_head;
    let (head, buf) = match read_head(&mut io, deadline, max, peer).await {
        Ok(read) => read,
        Err(Some((status, text))) => return respond(io, status, "text/plain", text).await,
        Err(None) => return,
    };
    let c = &shared.config.http;
    if head.method != "GET" {
        return respond(io, 405, "text/plain", "only GET").await;
    }
    let path = head.path.split('?').next().unwrap_or("");
    if path == c.websocket_path && head.upgrade_websocket {
        let replay = Replay {
            head: buf,
            pos: 0,
            inner: io,
        };
        // Encrypted by us (wss) or, with tls = false, by the proxy in front (operator's
        // choice, see [http] tls).
        return crate::transport::websocket::serve(shared.clone(), services, replay, peer, true)
            .await;
    }
    let ws_url = || websocket_url(&shared, head.host.as_deref(), local_port);
    match path {
        "/.well-known/host-meta" => {
            respond(io, 200, "application/xrd+xml", &host_meta_xml(&ws_url())).await
        }
        "/.well-known/host-meta.json" => {
            respond(io, 200, "application/json", &host_meta_json(&ws_url())).await
        }
        // RFC 9110 §15.5.22: the resource is there, over the protocol named in Upgrade.
        p if p == c.websocket_path => {
            respond_with(
                io,
                426,
                "text/plain",
                "This is the XMPP WebSocket endpoint (RFC 7395): connect to it with a \
                 WebSocket client, subprotocol xmpp.\n",
                "Access-Control-Allow-Origin: *\r\nUpgrade: websocket\r\n",
            )
            .await
        }
        _ => respond(io, 404, "text/plain", "not found").await,
    }
}

/// The advertised WebSocket URL: the configured one, or derived from the request's Host
/// when that names a domain served here (with the port the client used); otherwise the
/// first served domain at the port this listener took (left out when it is the scheme's
/// default). Any other Host is never echoed, its port neither: the document tells a web
/// client where to log in, and a shared cache could serve a copy naming a stranger's host
/// to everyone. A client that came by IP address is so told the port it used.
fn websocket_url(shared: &Shared, host: Option<&str>, local_port: u16) -> String {
    let c = &shared.config.http;
    if let Some(url) = &c.websocket_url {
        return url.clone();
    }
    let scheme = if c.tls { "wss" } else { "ws" };
    let host = host
        .filter(|h| host_name(h).is_some_and(|name| shared.config.serves(&name)))
        .map(str::to_owned)
        .unwrap_or_else(|| {
            let default_port = if c.tls { 443 } else { 80 };
            let domain = &shared.config.domains[0];
            if local_port == 0 || local_port == default_port {
                domain.clone()
            } else {
                format!("{domain}:{local_port}")
            }
        });
    format!("{scheme}://{host}{}", c.websocket_path)
}

/// XEP-0156 §3.2 host-meta (XRD) with the RFC 7395 link relation.
pub(crate) fn host_meta_xml(ws_url: &str) -> String {
    format!(
        "<?xml version='1.0' encoding='utf-8'?>\n<XRD xmlns='http://docs.oasis-open.org/ns/xri/xrd-1.0'>\n  <Link rel='urn:xmpp:alt-connections:websocket' href='{}'/>\n</XRD>\n",
        crate::protocol::xml::escape(ws_url)
    )
}

/// XEP-0156 §3.2 host-meta.json (JRD).
pub(crate) fn host_meta_json(ws_url: &str) -> String {
    let escaped: String = ws_url
        .chars()
        .flat_map(|c| match c {
            '"' => vec!['\\', '"'],
            '\\' => vec!['\\', '\\'],
            c => vec![c],
        })
        .collect();
    format!("{{\"links\":[{{\"rel\":\"urn:xmpp:alt-connections:websocket\",\"href\":\"{escaped}\"}}]}}\n")
}

/// A response of the client-facing listener: readable cross-origin, as XEP-0156 §3.2 asks
/// of host-meta.
async fn respond(io: BoxIo, status: u16, ctype: &str, body: &str) {
    respond_with(
        io,
        status,
        ctype,
        body,
        "Access-Control-Allow-Origin: *\r\n",
    )
    .await
}

async fn respond_with(mut io: BoxIo, status: u16, ctype: &str, body: &str, extra: &str) {
    let reason = match status {
        200 => "OK",
        426 => "Upgrade Required",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        421 => "Misdirected Request",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Error",
    };
    let msg = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        let _ = io.write_all(msg.as_bytes()).await;
        let _ = io.shutdown().await;
    })
    .await;
}

/// A transport whose first bytes (an HTTP head we already read) are replayed before the
/// rest, so the WebSocket handshake can parse the request itself.
struct Replay {
    head: Vec<u8>,
    pos: usize,
    inner: BoxIo,
}

impl AsyncRead for Replay {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.pos < self.head.len() {
            let n = buf.remaining().min(self.head.len() - self.pos);
            let start = self.pos;
            buf.put_slice(&self.head[start..start + n]);
            self.pos += n;
            if self.pos == self.head.len() {
                self.head = Vec::new();
                self.pos = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Replay {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_meta_names_the_websocket_endpoint() {
        let x = host_meta_xml("wss://example.org/xmpp-websocket");
        assert!(x.contains("rel='urn:xmpp:alt-connections:websocket'"));
        assert!(x.contains("href='wss://example.org/xmpp-websocket'"));
        let j = host_meta_json("wss://example.org/xmpp-websocket");
        assert!(j.contains("\"href\":\"wss://example.org/xmpp-websocket\""));
    }

    #[test]
    fn request_head_is_parsed_only_when_complete() {
        assert!(matches!(parse_head(b"GET / HTTP/1.1\r\nHost: a"), Ok(None)));
        let (h, _) = parse_head(b"GET /x HTTP/1.1\r\nHost: a\r\nUpgrade: WebSocket\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(h.upgrade_websocket);
        assert_eq!(h.path, "/x");
        assert_eq!(h.host.as_deref(), Some("a"));
    }
}
