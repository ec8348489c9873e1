//! The admin socket: operators' commands against the running server (`presenced user
//! list`, `user del`, `session list`, `session kick`, `stats`, `roster show|add|remove`).
//!
//! A Unix socket at `[admin] socket`, mode 0600: the file system decides who is an
//! operator (the server's user and root), so there is no password to configure or leak.
//! One request per connection, one JSON line each way: the request is a [`Request`], the
//! answer `{"Ok": …}` or `{"Err": "why"}`. The command line renders the answer as text, or
//! prints it as it came with `--json`.
//!
//! Sessions are ended the way the server ends any session: a stream error on the stream
//! (RFC 6120 §4.9), then the session's own end path, so contacts learn of it as of any
//! closed connection, through the privacy gate, after `[liveness] grace`. `user del` is
//! [`AccountDeletion::delete`], which tells the account's contacts at once.
//!
//! Roster changes are the schema's own operator operations (`presenced_roster_make_mutual`
//! and `presenced_roster_unpair`, through [`crate::store::Store::roster_make_mutual`]); the
//! subscription executor then gives both users' online sessions the roster pushes (RFC 6121
//! §2.1.6) and the presence the privacy gate decides, as for a change made in SQL.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use crate::node::sessions::SessionHandle;
use crate::node::Shared;
use crate::protocol::error::{StreamCondition, StreamError};
use crate::protocol::jid::BareJid;
use crate::services::account_deletion::AccountDeletion;
use crate::services::presence::Presence;
use crate::transport::listener::{Handler, Listener};

/// Longest request line read; every request is far shorter.
const MAX_REQUEST: u64 = 64 * 1024;

/// One command.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "snake_case")]
pub enum Request {
    /// Accounts, of one domain or all.
    UserList {
        /// Only this domain.
        domain: Option<String>,
    },
    /// End the account's sessions, then delete it and tell its contacts
    /// ([`crate::services::account_deletion`]).
    UserDel {
        /// Bare JID.
        jid: String,
    },
    /// The account's password was changed in the store: end every session of it, which
    /// authenticated with the old one.
    PasswordChanged {
        /// Bare JID.
        jid: String,
    },
    /// Bound sessions, of one account (bare JID), one resource (full JID) or all.
    SessionList {
        /// Bare or full JID.
        jid: Option<String>,
    },
    /// End sessions with a stream error.
    SessionKick {
        /// Bare JID (every resource) or full JID (one).
        jid: String,
        /// Text of the stream error.
        reason: Option<String>,
    },
    /// Figures of this node.
    Stats,
    /// One account's roster.
    RosterShow {
        /// Bare JID of a local account.
        jid: String,
    },
    /// Makes two local accounts mutual contacts (subscription `both` each way).
    RosterAdd {
        /// Bare JID of a local account.
        jid: String,
        /// Bare JID of another local account.
        contact: String,
        /// The name `jid` shows for the contact (unset: kept).
        name: Option<String>,
        /// The groups `jid` files the contact under (empty: kept).
        #[serde(default)]
        groups: Vec<String>,
    },
    /// Removes two accounts from each other's rosters.
    RosterRemove {
        /// Bare JID of a local account.
        jid: String,
        /// Bare JID of the contact.
        contact: String,
    },
}

/// One bound session.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SessionInfo {
    /// Full JID.
    pub jid: String,
    /// `tcp` or `websocket`.
    pub transport: String,
    /// Client address.
    pub ip: Option<String>,
    /// When it bound (RFC 3339, UTC).
    pub since: String,
    /// Invisible (XEP-0186): shown to operators, never counted publicly.
    pub invisible: bool,
    /// Detached (XEP-0198): the connection died and the session waits for its client to
    /// resume it; contacts still see it online meanwhile.
    #[serde(default)]
    pub detached: bool,
    /// Hibernated (XEP-0357): detached for longer than T with push enabled; resumable,
    /// woken by push, shown unavailable to contacts meanwhile.
    #[serde(default)]
    pub hibernated: bool,
}

/// `stats`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Stats {
    /// Server version.
    pub version: String,
    /// Seconds since start.
    pub uptime_secs: u64,
    /// Accounts with at least one session.
    pub users_online: usize,
    /// Bound sessions, invisible ones included.
    pub sessions: usize,
    /// Of which invisible.
    pub invisible_sessions: usize,
    /// Of which detached, waiting for their client to resume them (XEP-0198).
    #[serde(default)]
    pub detached_sessions: usize,
    /// Of the detached, hibernated: shown unavailable, woken by push (XEP-0357).
    #[serde(default)]
    pub hibernated_sessions: usize,
    /// Over TCP.
    pub sessions_tcp: usize,
    /// Over WebSocket.
    pub sessions_websocket: usize,
    /// Live outgoing federation links.
    pub s2s_outgoing_links: usize,
    /// Liveness backend (`redis` or `in-process`).
    pub liveness: String,
    /// What the memory allocator holds, when the process runs on one that counts it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocator: Option<AllocatorFigures>,
}

/// What the memory allocator holds, in bytes (jemalloc's `stats.*` figures, read by the
/// binary that installs it and handed in with [`report_allocator`]). The gaps between them
/// say where memory that is not live data goes: `active − allocated` is free room inside
/// pages that still hold live data, which the allocator cannot give back; `resident −
/// active` its own bookkeeping and pages it keeps with nothing live. Operators' figures:
/// they grow with every session, invisible ones included, so `/metrics` does not show them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocatorFigures {
    /// Bytes in live allocations.
    pub allocated: u64,
    /// Bytes in pages that hold at least one live allocation.
    pub active: u64,
    /// Bytes of the allocator's pages resident in memory.
    pub resident: u64,
    /// Bytes of the allocator's own bookkeeping.
    pub metadata: u64,
}

/// The reader of the allocator's figures: set by the `presenced` binary, which installs
/// jemalloc; the tests run on the system allocator and report none.
static ALLOCATOR: std::sync::OnceLock<fn() -> Option<AllocatorFigures>> =
    std::sync::OnceLock::new();

/// Makes `stats` report the allocator's figures, read by `read` at each request.
pub fn report_allocator(read: fn() -> Option<AllocatorFigures>) {
    let _ = ALLOCATOR.set(read);
}

/// Binds `[admin] socket` (if set) and serves it until shutdown. A socket file left by a
/// crashed server is replaced; one a running server answers on is not.
pub async fn start(
    shared: &Arc<Shared>,
    services: &crate::services::Services,
) -> std::io::Result<Option<PathBuf>> {
    let Some(path) = shared.config.admin.socket.clone() else {
        return Ok(None);
    };
    let fail =
        |e: std::io::Error| std::io::Error::new(e.kind(), format!("{}: {e}", path.display()));
    if path.exists() {
        if UnixStream::connect(&path).await.is_ok() {
            return Err(fail(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                "another server answers on this admin socket",
            )));
        }
        std::fs::remove_file(&path).map_err(fail)?;
    }
    let listener = UnixListener::bind(&path).map_err(fail)?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).map_err(fail)?;
    }
    tracing::info!(socket = %path.display(), "admin socket listening");
    let handler = Commands {
        shared: shared.clone(),
        deletion: services.account_deletion.clone(),
        presence: services.presence.clone(),
        started: std::time::Instant::now(),
    };
    let served = path.clone();
    // No per-source budget: only the socket file's owner can connect.
    let listener = Listener::new("admin socket", listener, None, shared);
    shared.tasks.spawn(async move {
        listener.run(handler).await;
        let _ = std::fs::remove_file(&served);
    });
    Ok(Some(path))
}

/// The admin socket's connections: one command each.
struct Commands {
    shared: Arc<Shared>,
    deletion: Arc<AccountDeletion>,
    presence: Arc<Presence>,
    started: std::time::Instant,
}

impl Handler<UnixListener> for Commands {
    fn serve(
        &self,
        stream: UnixStream,
        _: tokio::net::unix::SocketAddr,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        serve(
            self.shared.clone(),
            self.deletion.clone(),
            self.presence.clone(),
            stream,
            self.started,
        )
    }
}

async fn serve(
    shared: Arc<Shared>,
    deletion: Arc<AccountDeletion>,
    presence: Arc<Presence>,
    stream: UnixStream,
    started: std::time::Instant,
) {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    let mut reader = BufReader::new(read).take(MAX_REQUEST);
    let answer = match reader.read_line(&mut line).await {
        Ok(_) => match serde_json::from_str::<Request>(&line) {
            Ok(req) => {
                tracing::info!(request = ?req, "admin command");
                execute(&shared, &deletion, &presence, req, started).await
            }
            Err(e) => Err(format!("bad request: {e}")),
        },
        Err(e) => Err(format!("reading the request: {e}")),
    };
    let mut out = serde_json::to_string(&answer).unwrap_or_else(|e| format!("{{\"Err\":\"{e}\"}}"));
    out.push('\n');
    let _ = write.write_all(out.as_bytes()).await;
}

async fn execute(
    shared: &Shared,
    deletion: &AccountDeletion,
    presence: &Presence,
    req: Request,
    started: std::time::Instant,
) -> Result<serde_json::Value, String> {
    let json = |v: &dyn erased::Ser| v.to_value();
    match req {
        Request::UserList { domain } => {
            let users = shared
                .store
                .list_accounts(domain.as_deref())
                .await
                .map_err(|e| e.to_string())?;
            Ok(json(&users))
        }
        Request::UserDel { jid } => {
            let bare = crate::protocol::jid::parse_bare(&jid).map_err(|e| format!("{jid}: {e}"))?;
            if bare.node().is_none() {
                return Err(format!("{jid}: an account JID needs a localpart"));
            }
            if !shared.config.serves(bare.domain().as_str()) {
                return Err(format!("{jid}: not a domain of this server"));
            }
            // RFC 6120 §4.9.3.12 not-authorized: the account the stream authenticated as is
            // going.
            let ended_by =
                StreamError::new(StreamCondition::NotAuthorized, "the account was deleted");
            let deleted = deletion
                .delete(&bare, ended_by)
                .await
                .map_err(|e| e.to_string())?
                .ok_or_else(|| format!("no account {bare}"))?;
            Ok(serde_json::json!({
                "deleted": bare.to_string(),
                "sessions_ended": deleted.sessions_ended,
                "local_contacts": deleted.local_contacts,
                "remote_contacts": deleted.remote_contacts,
            }))
        }
        Request::PasswordChanged { jid } => {
            let bare = crate::protocol::jid::parse_bare(&jid).map_err(|e| format!("{jid}: {e}"))?;
            // RFC 6120 §4.9.3.16 reset: a security-critical change; each client logs in again,
            // and one holding only the old password no longer can.
            let ended = shared
                .sessions
                .close_and_wait(
                    &shared.sessions.of_user(&bare),
                    &StreamError::new(StreamCondition::Reset, "the account's password was changed"),
                    crate::services::account_deletion::SESSIONS_END_WITHIN,
                )
                .await;
            Ok(serde_json::json!({ "sessions_ended": ended }))
        }
        Request::SessionList { jid } => {
            let sessions = select(shared, jid.as_deref())?;
            let list: Vec<SessionInfo> = sessions.iter().map(info).collect();
            Ok(json(&list))
        }
        Request::SessionKick { jid, reason } => {
            let sessions = select(shared, Some(&jid))?;
            if sessions.is_empty() {
                return Err(format!("no session of {jid}"));
            }
            let text = reason.unwrap_or_else(|| "disconnected by the administrator".into());
            // RFC 6120 §4.9.3.14 policy-violation: the entity broke a local service policy,
            // which is what an operator ending a session says.
            let ended = shared
                .sessions
                .close_and_wait(
                    &sessions,
                    &StreamError::new(StreamCondition::PolicyViolation, &text),
                    crate::services::account_deletion::SESSIONS_END_WITHIN,
                )
                .await;
            Ok(serde_json::json!({ "sessions_ended": ended }))
        }
        Request::Stats => Ok(json(&stats(shared, started))),
        Request::RosterShow { jid } => roster_show(shared, &jid).await,
        Request::RosterAdd {
            jid,
            contact,
            name,
            groups,
        } => {
            roster_change(
                shared,
                presence,
                &jid,
                &contact,
                Some((name.as_deref(), groups.as_slice())),
            )
            .await
        }
        Request::RosterRemove { jid, contact } => {
            roster_change(shared, presence, &jid, &contact, None).await
        }
    }
}

/// The `stats` command's figures.
fn stats(shared: &Shared, started: std::time::Instant) -> Stats {
    let mut s = Stats {
        version: env!("CARGO_PKG_VERSION").into(),
        uptime_secs: started.elapsed().as_secs(),
        users_online: shared.sessions.users().len(),
        sessions: 0,
        invisible_sessions: 0,
        detached_sessions: 0,
        hibernated_sessions: 0,
        sessions_tcp: 0,
        sessions_websocket: 0,
        s2s_outgoing_links: shared.s2s.outgoing_links(),
        liveness: shared.liveness.backend.name().into(),
        allocator: ALLOCATOR.get().and_then(|read| read()),
    };
    shared.sessions.for_each(|h| {
        s.sessions += 1;
        if h.is_invisible() {
            s.invisible_sessions += 1;
        }
        if h.is_detached() {
            s.detached_sessions += 1;
        }
        if h.is_hibernated() {
            s.hibernated_sessions += 1;
        }
        match h.origin.transport {
            "websocket" => s.sessions_websocket += 1,
            _ => s.sessions_tcp += 1,
        }
    });
    s
}

/// A local account's bare JID, or why `jid` is not one.
async fn local_account(shared: &Shared, jid: &str) -> Result<BareJid, String> {
    let bare = crate::protocol::jid::parse_bare(jid).map_err(|e| format!("{jid}: {e}"))?;
    let node = bare
        .node()
        .ok_or_else(|| format!("{jid}: an account JID needs a localpart"))?;
    let exists = shared
        .store
        .account_exists(node.as_str(), bare.domain().as_str())
        .await
        .map_err(|e| e.to_string())?;
    if !exists {
        return Err(format!("no account {bare}"));
    }
    Ok(bare)
}

/// `roster show`: the items as JSON objects, with the roster version.
async fn roster_show(shared: &Shared, jid: &str) -> Result<serde_json::Value, String> {
    let owner = local_account(shared, jid).await?;
    let (version, items) = shared
        .store
        .roster(owner.as_str())
        .await
        .map_err(|e| e.to_string())?;
    let items: Vec<serde_json::Value> = items
        .iter()
        .map(|i| {
            serde_json::json!({
                "contact": i.contact.as_str(),
                "name": i.name,
                "groups": i.groups,
                "subscription": i.subscription.as_str(),
                "ask": i.sub_state().ask(),
                "pending_in": i.pending_in,
                "preapproved": i.preapproved,
            })
        })
        .collect();
    Ok(serde_json::json!({ "jid": owner.to_string(), "version": version, "items": items }))
}

/// `roster add` / `roster remove`, then the pushes and presence that follow, to both users'
/// sessions on this node (other nodes hear of it through the store's announcement).
async fn roster_change(
    shared: &Shared,
    presence: &Presence,
    jid: &str,
    contact: &str,
    add: Option<(Option<&str>, &[String])>,
) -> Result<serde_json::Value, String> {
    let owner = local_account(shared, jid).await?;
    let other = local_account(shared, contact).await?;
    if owner == other {
        return Err(format!("{owner} cannot be its own contact"));
    }
    let (a, b) = (owner.as_str(), other.as_str());
    let changed = match add {
        Some((name, groups)) => {
            let limits = shared.store.limits();
            if let Err(refused) = crate::services::roster::check_item(name, groups, &limits) {
                if refused == crate::services::roster::ItemRefused::DuplicateGroup {
                    return Err("a group is named twice (RFC 6121 §2.1.2.3)".to_owned());
                }
                return Err(format!(
                    "name or groups beyond [limits] (name up to {} characters, up to {} \
                     non-empty groups of up to {} characters)",
                    limits.max_roster_name_length,
                    limits.max_roster_groups,
                    limits.max_roster_group_length
                ));
            }
            shared
                .store
                .roster_make_mutual(a, b, name, groups)
                .await
                .map_err(|e| match e {
                    crate::store::StoreError::RosterFull => format!(
                        "a roster would exceed [limits] max_roster_items ({})",
                        limits.max_roster_items
                    ),
                    e => e.to_string(),
                })?;
            true
        }
        None => shared
            .store
            .roster_unpair(a, b)
            .await
            .map_err(|e| e.to_string())?,
    };
    crate::services::presence::executor::apply_external_pair(presence, a, b).await;
    Ok(serde_json::json!({ "jid": a, "contact": b, "changed": changed }))
}

/// Serialising the answers without naming their types twice.
mod erased {
    pub(super) trait Ser {
        fn to_value(&self) -> serde_json::Value;
    }
    impl<T: serde::Serialize> Ser for T {
        fn to_value(&self) -> serde_json::Value {
            serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
        }
    }
}

/// The sessions a JID names: a full JID its one session, a bare JID all of the account's,
/// none every session.
fn select(shared: &Shared, jid: Option<&str>) -> Result<Vec<SessionHandle>, String> {
    let Some(jid) = jid else {
        let mut all = Vec::new();
        shared.sessions.for_each(|h| all.push(h.clone()));
        all.sort_by_key(|a| a.jid.to_string());
        return Ok(all);
    };
    if let Ok(full) = crate::protocol::jid::parse_full(jid) {
        return Ok(shared.sessions.get(&full).into_iter().collect());
    }
    let bare = crate::protocol::jid::parse_bare(jid).map_err(|e| format!("{jid}: {e}"))?;
    Ok(shared.sessions.of_user(&bare))
}

fn info(s: &SessionHandle) -> SessionInfo {
    SessionInfo {
        jid: s.jid.to_string(),
        transport: s.origin.transport.into(),
        ip: s.origin.peer.map(|p| p.ip().to_string()),
        since: chrono::DateTime::from_timestamp_millis(s.origin.since_ms)
            .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
            .unwrap_or_default(),
        invisible: s.read(|p| p.invisible_by_choice()),
        detached: s.is_detached(),
        hibernated: s.is_hibernated(),
    }
}

/// Sends `req` to the admin socket at `path` and returns the answer.
pub async fn request(path: &Path, req: &Request) -> Result<serde_json::Value, ClientError> {
    let stream = UnixStream::connect(path)
        .await
        .map_err(|e| ClientError::Unreachable(format!("{}: {e}", path.display())))?;
    let (read, mut write) = stream.into_split();
    let mut line = serde_json::to_string(req).map_err(|e| ClientError::Failed(e.to_string()))?;
    line.push('\n');
    write
        .write_all(line.as_bytes())
        .await
        .map_err(|e| ClientError::Failed(format!("{}: {e}", path.display())))?;
    let mut answer = String::new();
    tokio::time::timeout(
        Duration::from_secs(30),
        BufReader::new(read).read_line(&mut answer),
    )
    .await
    .map_err(|_| ClientError::Failed(format!("{}: no answer within 30 s", path.display())))?
    .map_err(|e| ClientError::Failed(format!("{}: {e}", path.display())))?;
    let answer: Result<serde_json::Value, String> = serde_json::from_str(&answer)
        .map_err(|e| ClientError::Failed(format!("{}: bad answer: {e}", path.display())))?;
    answer.map_err(ClientError::Failed)
}

/// Why an admin request failed.
#[derive(Debug)]
pub enum ClientError {
    /// No server answers on the socket (not running, or another path).
    Unreachable(String),
    /// The server answered with an error, or the exchange broke.
    Failed(String),
}

impl std::fmt::Display for ClientError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClientError::Unreachable(m) => write!(f, "no server on the admin socket {m}"),
            ClientError::Failed(m) => f.write_str(m),
        }
    }
}

/// An answer as text for a terminal.
pub fn render(req: &Request, answer: &serde_json::Value) -> String {
    let mut out = String::new();
    match req {
        Request::UserList { .. } => {
            for u in answer.as_array().into_iter().flatten() {
                out.push_str(u.as_str().unwrap_or_default());
                out.push('\n');
            }
        }
        Request::SessionList { .. } => {
            let list: Vec<SessionInfo> = serde_json::from_value(answer.clone()).unwrap_or_default();
            for s in list {
                out.push_str(&format!(
                    "{}\t{}\t{}\t{}{}{}{}\n",
                    s.jid,
                    s.transport,
                    s.ip.as_deref().unwrap_or("-"),
                    s.since,
                    if s.invisible { "\tinvisible" } else { "" },
                    if s.detached { "\tdetached" } else { "" },
                    if s.hibernated { "\thibernated" } else { "" },
                ));
            }
        }
        Request::SessionKick { jid, .. } | Request::PasswordChanged { jid } => {
            out.push_str(&format!(
                "ended {} session(s) of {jid}\n",
                answer["sessions_ended"]
            ));
        }
        Request::UserDel { .. } => {
            out.push_str(&format!(
                "deleted {} ({} session(s) ended; removed from {} local roster(s); {} contact(s) \
                 on other servers sent unsubscribe/unsubscribed)\n",
                answer["deleted"].as_str().unwrap_or_default(),
                answer["sessions_ended"],
                answer["local_contacts"],
                answer["remote_contacts"],
            ));
        }
        Request::RosterShow { .. } => {
            for i in answer["items"].as_array().into_iter().flatten() {
                let groups: Vec<&str> = i["groups"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|g| g.as_str())
                    .collect();
                out.push_str(&format!(
                    "{}\t{}\t{}\t{}{}\n",
                    i["contact"].as_str().unwrap_or_default(),
                    i["subscription"].as_str().unwrap_or_default(),
                    i["name"].as_str().unwrap_or("-"),
                    if groups.is_empty() {
                        "-".to_owned()
                    } else {
                        groups.join(",")
                    },
                    i["ask"]
                        .as_str()
                        .map(|a| format!("\task={a}"))
                        .unwrap_or_default(),
                ));
            }
        }
        Request::RosterAdd { .. } => {
            out.push_str(&format!(
                "{} and {} are mutual contacts\n",
                answer["jid"].as_str().unwrap_or_default(),
                answer["contact"].as_str().unwrap_or_default()
            ));
        }
        Request::RosterRemove { .. } => {
            let (a, b) = (
                answer["jid"].as_str().unwrap_or_default(),
                answer["contact"].as_str().unwrap_or_default(),
            );
            match answer["changed"].as_bool() {
                Some(true) => out.push_str(&format!(
                    "removed {b} from {a}'s roster and {a} from {b}'s\n"
                )),
                _ => out.push_str(&format!(
                    "{b} was not on {a}'s roster (nothing left waiting either way)\n"
                )),
            }
        }
        Request::Stats => {
            if let Some(map) = answer.as_object() {
                for (k, v) in map {
                    // A group of figures (the allocator's) gets a line each: `allocator.active: …`.
                    if let Some(group) = v.as_object() {
                        for (part, v) in group {
                            out.push_str(&format!("{k}.{part}: {v}\n"));
                        }
                        continue;
                    }
                    let v = v.as_str().map_or_else(|| v.to_string(), str::to_owned);
                    out.push_str(&format!("{k}: {v}\n"));
                }
            }
        }
    }
    out
}
