//! Reconnect storms (`--storm cut,restart`): every session dropped at once, every client
//! coming back on its own back-off, and the time until each session is back with its
//! presence restored at every watcher (BENCHMARKS.md, "Reconnect storm").
//!
//! N users log in (at most `--login-concurrency` at a time, as in the timed run) and
//! settle (each has seen its K contacts available). Then, for each cause in turn:
//!
//! * **cut**: the generator closes every client socket at once, without
//!   `</stream:stream>` (a network cut as the clients see it; the server sees the TCP
//!   connections end);
//! * **restart**: the generator writes `<storm-dir>/restart`, and whoever runs the server
//!   (bench/run.sh, the smoke test) writes the stop time to `<storm-dir>/stop_ns`, stops the
//!   server process (SIGTERM), starts it again and, once it listens, writes
//!   `<storm-dir>/pids`: `<listening ns> <pid>…`. The clients find their streams ended.
//!
//! * **relogin**: every client closes its stream (`</stream:stream>`); once the server is
//!   quiet, all log in again through `--login-concurrency` as the first logins did, with
//!   no back-off. This is the window for the CPU per reconnect (server and stores, from
//!   /proc), free of the work of dropped connections. With `--login fast-resume` every
//!   client socket is closed instead, without `</stream:stream>` (a phone losing its
//!   network), so the server keeps each session detached for its XEP-0198 window; after
//!   the same pause all come back through the same concurrency and resume inline.
//!
//! With `--login fast` a client's first login is SASL2 with its password and a token
//! request, and every later one a FAST login with that token over a resumed TLS session
//! (session.rs, [`Installation`](crate::session::Installation)); `fast-resume` adds
//! XEP-0198: enabled with resumption in the first login's Bind 2, resumed inline in every
//! later `<authenticate/>`. The logins, resumed handshakes, FAST logins, XEP-0198
//! resumptions and refused resumptions of each window are counted.
//!
//! The client model is that of XEP-0198-less clients: a client that lost its connection
//! waits a random delay in `[--backoff-min, --backoff-max]` s (1–5 s) before its first
//! attempt and doubles the delay after each failed one (a refused connection, a login that
//! did not complete within `--login-timeout`, a stream ended by the server), capped at
//! `--backoff-cap` (60 s); every attempt draws its own random factor. No generator-side
//! limit on logins in flight during a storm: each client is on its own.
//!
//! A returning session's initial presence carries the status `s1 <storm>`; a watcher's
//! session notes the arrival of a contact's presence of the current storm on the
//! [`StormBoard`](crate::session::StormBoard) (only on its current connection; an
//! unavailable from the contact's full JID takes it back). A session is **restored** when
//! it is logged in again and each of its K watchers has its presence of this storm: the
//! time is the arrival at the last of them, counted from the drop (the cut, or the stop
//! of the server). Presences of sessions from before the storm (a probe answered from a
//! session the server still holds) do not count. A session resumed with XEP-0198 sends no
//! new presence: its watchers keep the one they had, so it is restored when it is resumed,
//! unless an unavailable of it reached any watcher since the storm began (its contacts
//! were told it was gone: then only a new presence of this storm restores it).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{mpsc, Semaphore};

use crate::graph::ContactGraph;
use crate::procfs::{cpu_between, ServerProbe, StoreProbe};
use crate::report::{json_str, json_strs, num};
use crate::session::{self, Command, Installation, LoginMode, Mode, Shared, Target};

/// The pause between the last stream closed and the relogin window (see [`Cause::Relogin`]).
const RELOGIN_PAUSE: Duration = Duration::from_secs(12);

/// What drops every session at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Cause {
    /// The generator closes every client socket at once (no stream close).
    Cut,
    /// The server process is stopped and started again (by whoever runs it).
    Restart,
    /// Every client closes its stream; once the server is quiet all log in again through
    /// the login concurrency (the CPU per reconnect).
    Relogin,
}

impl Cause {
    /// The prefix of this cause's figures in the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Cause::Cut => "cut",
            Cause::Restart => "restart",
            Cause::Relogin => "relogin",
        }
    }
}

/// The clients' reconnection delays.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    /// Lower end of the first delay, s.
    pub min: f64,
    /// Upper end of the first delay, s.
    pub max: f64,
    /// No delay is longer, s.
    pub cap: f64,
}

impl Backoff {
    /// The wait before attempt `failed` + 1 after a loss (`failed` attempts have failed
    /// since): `[min, max]` at `u` ∈ [0, 1), doubled per failure, capped.
    pub fn delay(&self, failed: u32, u: f64) -> Duration {
        let first = self.min + u.clamp(0.0, 1.0) * (self.max - self.min);
        let d = first * 2f64.powi(failed.min(30) as i32);
        Duration::from_secs_f64(d.min(self.cap).max(0.0))
    }
}

/// Why a login attempt failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Nothing accepted the TCP connection (the server is down).
    Refused,
    /// The login did not complete within `--login-timeout`.
    Timeout,
    /// The server ended the stream or the connection during the login (a stream error,
    /// a close, a reset, a failed TLS handshake).
    Stream,
    /// Anything else (SASL refused, an unexpected answer).
    Other,
}

impl Failure {
    const ALL: [Failure; 4] = [
        Failure::Refused,
        Failure::Timeout,
        Failure::Stream,
        Failure::Other,
    ];

    /// Classifies one of session.rs's login errors.
    pub fn of(error: &str) -> Failure {
        if error.contains("login timed out") {
            Failure::Timeout
        } else if error.starts_with("connect ") && error.contains("refused") {
            Failure::Refused
        } else if error.contains("stream error")
            || error.contains("closed")
            || error.contains("reset")
            || error.contains("tls handshake")
            || error.contains("broken pipe")
            || error.starts_with("read:")
            || error.starts_with("write:")
        {
            Failure::Stream
        } else {
            Failure::Other
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    /// The suffix of this reason's count in the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Failure::Refused => "refused",
            Failure::Timeout => "timeout",
            Failure::Stream => "stream",
            Failure::Other => "other",
        }
    }
}

/// What one storm run does.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The storms, in this order.
    pub causes: Vec<Cause>,
    /// The clients' back-off.
    pub backoff: Backoff,
    /// First logins in flight at most (as the timed run's logins).
    pub login_concurrency: u32,
    /// One login attempt's time limit.
    pub login_timeout: Duration,
    /// Longest wait for the first logins' presence to settle, s.
    pub settle_secs: u64,
    /// Longest wait for one storm to be over, s.
    pub wait_secs: u64,
    /// After the last session is restored, how long to go on watching for a presence that
    /// is taken back (an unavailable of a restored session), s: a server's grace period
    /// and a margin, so a wrong announcement of a session that came back in time is seen.
    pub watch_secs: u64,
    /// Source addresses to spread connections over.
    pub source_addrs: u32,
    /// Where the restart is asked for and told about (see the module documentation).
    pub dir: Option<PathBuf>,
    /// The server's process(es) before any restart, for RSS and CPU.
    pub server_pids: Vec<u32>,
    /// The server's storage processes, whose CPU is charged to it too.
    pub stores: StoreProbe,
    /// How the clients log in.
    pub login: LoginMode,
}

/// CPU of a window and the logins in it.
#[derive(Debug, Clone, Default)]
pub struct LoginCost {
    /// Logins completed in the window.
    pub logins: u64,
    /// Of those, over a resumed TLS session, and with a FAST token.
    pub resumed: u64,
    pub fast: u64,
    /// Of those, resuming a XEP-0198 session, and asking to resume but refused (bound
    /// anew instead).
    pub sm_resumed: u64,
    pub sm_failed: u64,
    /// CPU seconds of the server and of its stores (None: not watched) over the window.
    pub cpu_s: Option<f64>,
    pub store_cpu_s: Option<f64>,
}

impl LoginCost {
    /// Server plus stores, ms per completed login.
    pub fn total_ms_per_login(&self) -> Option<f64> {
        let cpu = self.cpu_s? + self.store_cpu_s.unwrap_or(0.0);
        (self.logins > 0).then(|| cpu * 1000.0 / self.logins as f64)
    }
}

/// Readings at the start of a window, for [`LoginCost`].
struct Mark {
    server: Option<f64>,
    stores: crate::procfs::CpuByPid,
    logins: u64,
    resumed: u64,
    fast: u64,
    sm_resumed: u64,
    sm_failed: u64,
}

async fn mark(probe: &Option<ServerProbe>, stores: &StoreProbe, counts: &Counts) -> Mark {
    Mark {
        server: probe.as_ref().map(|p| p.sample().cpu_secs),
        stores: stores.sample().await,
        logins: counts.logins.load(Ordering::Relaxed),
        resumed: counts.resumed.load(Ordering::Relaxed),
        fast: counts.fast.load(Ordering::Relaxed),
        sm_resumed: counts.sm_resumed.load(Ordering::Relaxed),
        sm_failed: counts.sm_failed.load(Ordering::Relaxed),
    }
}

async fn cost_since(
    m: &Mark,
    probe: &Option<ServerProbe>,
    stores: &StoreProbe,
    counts: &Counts,
) -> LoginCost {
    let now = mark(probe, stores, counts).await;
    LoginCost {
        logins: now.logins - m.logins,
        resumed: now.resumed - m.resumed,
        fast: now.fast - m.fast,
        sm_resumed: now.sm_resumed - m.sm_resumed,
        sm_failed: now.sm_failed - m.sm_failed,
        cpu_s: now.server.zip(m.server).map(|(a, b)| a - b),
        store_cpu_s: stores
            .enabled()
            .then(|| cpu_between(&m.stores, &now.stores)),
    }
}

/// The figures of one storm.
#[derive(Debug, Clone, Default)]
pub struct StormFigures {
    /// The drop (cut, or stop of the server), ns since the epoch.
    pub t0_ns: u64,
    /// Seconds the storm was watched.
    pub secs: f64,
    /// Restart: from the stop to the new process listening, s.
    pub server_down_s: Option<f64>,
    /// Sessions logged in again, and the times by which 99 % and 100 % were.
    pub back: u64,
    pub back_99_s: Option<f64>,
    pub back_100_s: Option<f64>,
    /// Sessions restored at every watcher, and the times by which 50, 99 and 100 % were.
    pub restored: u64,
    pub restored_50_s: Option<f64>,
    pub restored_99_s: Option<f64>,
    pub restored_100_s: Option<f64>,
    /// Restored sessions whose presence an unavailable then took back at some watcher
    /// within [`Plan::watch_secs`] after the last restore: contacts told of an end that
    /// did not happen (a session back within the grace period must not be announced).
    pub taken_back: u64,
    /// Seconds watched after the last restore (0: not watched, not all were restored).
    pub watched_s: f64,
    /// Login attempts during the storm, and the failed ones per [`Failure`].
    pub attempts: u64,
    pub failed: [u64; 4],
    /// Server RSS just before the drop, and its peak during the storm (kB; restart: the
    /// new process).
    pub rss_kb_before: Option<u64>,
    pub peak_rss_kb: Option<u64>,
    /// The logins of this storm and their CPU (cut and relogin; a restart's new process
    /// has no CPU reading from before the drop).
    pub cost: LoginCost,
}

/// The whole storm run.
#[derive(Debug, Clone, Default)]
pub struct StormReport {
    pub label: String,
    pub users: u32,
    pub contacts: u32,
    pub backoff: Option<(f64, f64, f64)>,
    pub login_timeout_s: f64,
    /// First logins: ok, and sessions that saw all K contacts after settling.
    pub logins_ok: u64,
    pub sessions_all_contacts_seen: u64,
    /// How the clients logged in, and the first logins' CPU.
    pub login: Option<LoginMode>,
    pub first: LoginCost,
    /// The shortest XEP-0198 resumption window the server granted a client (`<enabled
    /// max/>`, s), when they enabled it: the relogin pause and the back-off fit in it.
    pub sm_window_s: Option<u64>,
    /// What the logins negotiated (TLS version, cipher suite, SASL mechanism).
    pub negotiated: Vec<String>,
    pub storms: Vec<(Cause, StormFigures)>,
    pub errors: Vec<String>,
}

/// The time by which `share` of `n` events had happened, from their times (any order);
/// None when fewer happened.
pub fn time_by(times: &[f64], n: u64, share: f64) -> Option<f64> {
    let need = ((n as f64 * share).ceil() as usize).max(1);
    if times.len() < need {
        return None;
    }
    let mut t = times.to_vec();
    t.sort_by(f64::total_cmp);
    Some(t[need - 1])
}

/// A driver's order to one user's task.
#[derive(Debug, Clone, Copy)]
enum UserCmd {
    Cut,
    Close,
    /// Close the stream and wait for Resume.
    Park,
    /// Close the socket without closing the stream (as Cut) and wait for Resume.
    CutPark,
    Resume,
}

/// Counters of the user tasks.
struct Counts {
    online: AtomicU64,
    attempts: AtomicU64,
    failed: [AtomicU64; 4],
    /// Per user: `now_ns()` of its latest completed login.
    back_at: Vec<AtomicU64>,
    /// Completed logins; of those over a resumed TLS session, with a FAST token,
    /// resuming a XEP-0198 session, and refused a XEP-0198 resumption.
    logins: AtomicU64,
    resumed: AtomicU64,
    fast: AtomicU64,
    sm_resumed: AtomicU64,
    sm_failed: AtomicU64,
    /// Per user: `now_ns()` of its latest login if that login resumed its XEP-0198
    /// session, else 0.
    sm_resumed_at: Vec<AtomicU64>,
    /// The shortest XEP-0198 window granted (s; u64::MAX: none).
    sm_window_s: AtomicU64,
}

/// Runs the storms and returns their figures.
pub async fn run(
    plan: Plan,
    target: Target,
    graph: Arc<ContactGraph>,
) -> Result<StormReport, String> {
    let n = graph.len();
    let k = graph.k() as usize;
    let shared = Arc::new(Shared::default());
    let counts = Arc::new(Counts {
        online: AtomicU64::new(0),
        attempts: AtomicU64::new(0),
        failed: Default::default(),
        back_at: (0..n).map(|_| AtomicU64::new(0)).collect(),
        logins: AtomicU64::new(0),
        resumed: AtomicU64::new(0),
        fast: AtomicU64::new(0),
        sm_resumed: AtomicU64::new(0),
        sm_failed: AtomicU64::new(0),
        sm_resumed_at: (0..n).map(|_| AtomicU64::new(0)).collect(),
        sm_window_s: AtomicU64::new(u64::MAX),
    });
    // A vanished server process (a restart) must not end the run: no probe, no CPU.
    let probe = ServerProbe::new(plan.server_pids.clone())
        .ok()
        .filter(|p| p.enabled());
    let first_mark = mark(&probe, &plan.stores, &counts).await;
    if plan.causes.contains(&Cause::Restart) && plan.dir.is_none() {
        return Err("--storm restart needs --storm-dir (where the restart is asked for)".into());
    }
    if let Some(d) = &plan.dir {
        std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
        for f in ["restart", "stop_ns", "pids"] {
            let _ = std::fs::remove_file(d.join(f));
        }
    }
    let sem = Arc::new(Semaphore::new(plan.login_concurrency.max(1) as usize));
    let mut users = Vec::with_capacity(n as usize);
    let started = Instant::now();
    for i in 0..n {
        let (tx, rx) = mpsc::channel(4);
        users.push(tx);
        let u = User {
            i,
            target: target.clone(),
            k,
            shared: shared.clone(),
            counts: counts.clone(),
            sem: sem.clone(),
            login_timeout: plan.login_timeout,
            backoff: plan.backoff,
            source: session::source_addr(i, plan.source_addrs),
            login: plan.login,
        };
        tokio::spawn(u.run(rx));
    }
    let mut rep = StormReport {
        users: n,
        contacts: graph.k(),
        backoff: Some((plan.backoff.min, plan.backoff.max, plan.backoff.cap)),
        login_timeout_s: plan.login_timeout.as_secs_f64(),
        ..StormReport::default()
    };
    // First logins: every user in (a failed one retries on the back-off), bounded.
    let limit = Duration::from_secs(60) + plan.login_timeout * (n / 100 + 1);
    while counts.online.load(Ordering::Relaxed) < u64::from(n) && started.elapsed() < limit {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    rep.logins_ok = counts.online.load(Ordering::Relaxed);
    eprintln!(
        "storm: {} of {n} sessions logged in after {:.1} s; waiting for presence to settle",
        rep.logins_ok,
        started.elapsed().as_secs_f64()
    );
    let until = Instant::now() + Duration::from_secs(plan.settle_secs);
    while shared.sessions_all_contacts_seen.load(Ordering::Relaxed) < u64::from(n)
        && Instant::now() < until
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Read as soon as presence has settled, as the timed run's logins.
    rep.first = cost_since(&first_mark, &probe, &plan.stores, &counts).await;
    rep.login = Some(plan.login);
    rep.sm_window_s = Some(counts.sm_window_s.load(Ordering::Relaxed)).filter(|&w| w != u64::MAX);
    if let Some(w) = rep.sm_window_s {
        if Duration::from_secs(w) <= RELOGIN_PAUSE + plan.login_timeout {
            eprintln!(
                "storm: the server keeps a lost session {w} s, not past the relogin pause \
                 and a login: resumptions will be refused"
            );
        }
    }
    crate::wait_quiet(
        &shared,
        Duration::from_millis(500),
        Duration::from_secs(plan.settle_secs),
    )
    .await;
    rep.sessions_all_contacts_seen = shared.sessions_all_contacts_seen.load(Ordering::Relaxed);
    if rep.logins_ok < u64::from(n) {
        close(&users).await;
        rep.errors = crate::errors_of(&shared);
        return Err(format!(
            "storm: only {} of {n} first logins succeeded: {:?}",
            rep.logins_ok, rep.errors
        ));
    }
    let bares: Vec<String> = (0..n).map(|i| target.bare(i)).collect();
    let mut pids = plan.server_pids.clone();
    for (epoch, cause) in plan.causes.iter().enumerate() {
        let fig = storm(
            &plan,
            *cause,
            epoch as u64 + 1,
            &users,
            &shared,
            &counts,
            &graph,
            &bares,
            &mut pids,
            &probe,
        )
        .await?;
        eprintln!(
            "storm {}: {} of {n} back, {} restored at every watcher; 99 % restored after {}, 100 % after {}",
            cause.name(),
            fig.back,
            fig.restored,
            secs(fig.restored_99_s),
            secs(fig.restored_100_s)
        );
        rep.storms.push((*cause, fig));
        // The next storm starts from quiet: every session back, nothing in flight.
        crate::wait_quiet(
            &shared,
            Duration::from_millis(1000),
            Duration::from_secs(10),
        )
        .await;
    }
    close(&users).await;
    rep.errors = crate::errors_of(&shared);
    rep.negotiated = shared
        .negotiated
        .lock()
        .map(|v| v.clone())
        .unwrap_or_default();
    Ok(rep)
}

fn secs(v: Option<f64>) -> String {
    v.map_or("— (not all)".into(), |s| format!("{s:.2} s"))
}

async fn close(users: &[mpsc::Sender<UserCmd>]) {
    for tx in users {
        let _ = tx.send(UserCmd::Close).await;
    }
    // The sessions write their stream close.
    tokio::time::sleep(Duration::from_millis(500)).await;
}

/// Reads `path` when it exists and parses it (whitespace-separated numbers).
fn read_numbers(path: &Path) -> Option<Vec<u64>> {
    let text = std::fs::read_to_string(path).ok()?;
    let v: Vec<u64> = text
        .split_whitespace()
        .map(|w| w.parse().ok())
        .collect::<Option<_>>()?;
    (!v.is_empty()).then_some(v)
}

/// One storm: the drop, then watching until every session is restored or `wait_secs`.
#[allow(clippy::too_many_arguments)]
async fn storm(
    plan: &Plan,
    cause: Cause,
    epoch: u64,
    users: &[mpsc::Sender<UserCmd>],
    shared: &Shared,
    counts: &Counts,
    graph: &ContactGraph,
    bares: &[String],
    pids: &mut Vec<u32>,
    probe: &Option<ServerProbe>,
) -> Result<StormFigures, String> {
    let n = bares.len() as u64;
    let mut fig = StormFigures::default();
    let rss = |pids: &[u32]| {
        ServerProbe::new(pids.to_vec())
            .ok()
            .filter(|p| p.enabled())
            .map(|p| p.sample().rss_kb)
    };
    fig.rss_kb_before = rss(pids.as_slice());
    // With XEP-0198 the relogin's sockets are cut and the sessions resumed: the storm
    // begins before the cut, so an unavailable of a session in the pause (a session the
    // server did not keep) is seen.
    let resuming = cause == Cause::Relogin && plan.login == LoginMode::FastResume;
    // Returning sessions name this storm in their initial presence from now on.
    if cause != Cause::Relogin || resuming {
        shared.storm.begin(epoch);
    }
    let mut restarted = false;
    if cause == Cause::Relogin {
        // Every stream closed and the server done with them before the window opens, so
        // it holds the logins' work only. fast-resume: every socket closed without a
        // stream close, the sessions detached and kept (XEP-0198 §5), none announced.
        let park = if resuming {
            eprintln!("storm relogin: closing every client socket (sessions kept for resumption)");
            UserCmd::CutPark
        } else {
            eprintln!("storm relogin: closing every stream");
            UserCmd::Park
        };
        for tx in users {
            let _ = tx.send(park).await;
        }
        let until = Instant::now() + Duration::from_secs(60);
        while counts.online.load(Ordering::Relaxed) > 0 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Longer than a server's grace before it tells contacts of a close (presenced's
        // [liveness] grace, 10 s by default): every login of the window is then a return
        // the contacts hear of, however fast the logins of a mode are. fast-resume: the
        // same pause, well within the XEP-0198 window (presenced's sm_resume_timeout,
        // 300 s by default), past the grace, so a session the server failed to keep
        // would have been announced by then.
        tokio::time::sleep(RELOGIN_PAUSE).await;
        if !resuming {
            shared.storm.begin(epoch);
        }
    }
    let m = mark(probe, &plan.stores, counts).await;
    let attempts0 = counts.attempts.load(Ordering::Relaxed);
    let failed0: Vec<u64> = counts
        .failed
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .collect();
    match cause {
        Cause::Relogin => {
            eprintln!("storm relogin: every client logs in again");
            fig.t0_ns = session::now_ns();
            for tx in users {
                let _ = tx.send(UserCmd::Resume).await;
            }
        }
        Cause::Cut => {
            eprintln!("storm cut: closing every client socket");
            fig.t0_ns = session::now_ns();
            for tx in users {
                let _ = tx.try_send(UserCmd::Cut);
            }
        }
        Cause::Restart => {
            let dir = plan.dir.as_ref().ok_or("no --storm-dir")?;
            eprintln!(
                "storm restart: asking for the server's restart ({})",
                dir.display()
            );
            std::fs::write(dir.join("restart"), format!("{}\n", session::now_ns()))
                .map_err(|e| format!("{}: {e}", dir.display()))?;
            let until = Instant::now() + Duration::from_secs(120);
            fig.t0_ns = loop {
                if let Some(v) = read_numbers(&dir.join("stop_ns")) {
                    break v[0];
                }
                if Instant::now() > until {
                    return Err("storm restart: no stop_ns within 120 s".into());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            };
        }
    }
    let t0 = Instant::now();
    let wait = Duration::from_secs(plan.wait_secs);
    let mut peak: Option<u64> = None;
    loop {
        if cause == Cause::Restart && !restarted {
            let dir = plan.dir.as_ref().ok_or("no --storm-dir")?;
            if let Some(v) = read_numbers(&dir.join("pids")) {
                restarted = true;
                fig.server_down_s = Some(v[0].saturating_sub(fig.t0_ns) as f64 / 1e9);
                *pids = v[1..].iter().map(|&p| p as u32).collect();
            }
        }
        if cause != Cause::Restart || restarted {
            if let Some(r) = rss(pids.as_slice()) {
                peak = Some(peak.map_or(r, |p| p.max(r)));
            }
        }
        let restored = restore_times(shared, counts, graph, bares, fig.t0_ns).len() as u64;
        if restored == n || t0.elapsed() > wait {
            if cause != Cause::Restart {
                fig.cost = cost_since(&m, probe, &plan.stores, counts).await;
            } else {
                fig.cost = cost_since(&m, &None, &StoreProbe::default(), counts).await;
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    fig.secs = t0.elapsed().as_secs_f64();
    fig.peak_rss_kb = peak;
    let back: Vec<f64> = counts
        .back_at
        .iter()
        .map(|a| a.load(Ordering::Relaxed))
        .filter(|&a| a > fig.t0_ns)
        .map(|a| (a - fig.t0_ns) as f64 / 1e9)
        .collect();
    fig.back = back.len() as u64;
    fig.back_99_s = time_by(&back, n, 0.99);
    fig.back_100_s = time_by(&back, n, 1.0);
    let restored = restore_times(shared, counts, graph, bares, fig.t0_ns);
    fig.restored = restored.len() as u64;
    fig.restored_50_s = time_by(&restored, n, 0.5);
    fig.restored_99_s = time_by(&restored, n, 0.99);
    fig.restored_100_s = time_by(&restored, n, 1.0);
    if fig.restored == n && plan.watch_secs > 0 {
        eprintln!(
            "storm {}: every session restored; watching {} s for presences taken back",
            cause.name(),
            plan.watch_secs
        );
        tokio::time::sleep(Duration::from_secs(plan.watch_secs)).await;
        let still = restore_times(shared, counts, graph, bares, fig.t0_ns).len() as u64;
        fig.taken_back = fig.restored.saturating_sub(still);
        fig.watched_s = plan.watch_secs as f64;
    }
    fig.attempts = counts.attempts.load(Ordering::Relaxed) - attempts0;
    for f in Failure::ALL {
        fig.failed[f.index()] =
            counts.failed[f.index()].load(Ordering::Relaxed) - failed0[f.index()];
    }
    Ok(fig)
}

/// For each restored session, the seconds from `t0_ns` to its presence's arrival at the
/// last of its watchers (a session of the mutual graph is watched by its contacts), or,
/// for a session resumed with XEP-0198 since `t0_ns` whose watchers were told of no end
/// of it in this storm, to its resumption (its watchers kept the presence they had).
fn restore_times(
    shared: &Shared,
    counts: &Counts,
    graph: &ContactGraph,
    bares: &[String],
    t0_ns: u64,
) -> Vec<f64> {
    let Ok(seen) = shared.storm.seen.lock() else {
        return Vec::new();
    };
    let Ok(gone) = shared.storm.gone.lock() else {
        return Vec::new();
    };
    let empty = HashMap::new();
    let mut out = Vec::new();
    'users: for (i, bare) in bares.iter().enumerate() {
        let resumed_at = counts.sm_resumed_at[i].load(Ordering::Relaxed);
        if resumed_at > t0_ns && !gone.contains(bare) {
            out.push((resumed_at - t0_ns) as f64 / 1e9);
            continue;
        }
        let mut last = 0u64;
        for w in graph.contacts(i as u32) {
            let at = seen
                .get(&bares[w as usize])
                .unwrap_or(&empty)
                .get(bare)
                .copied();
            match at {
                Some(at) => last = last.max(at),
                None => continue 'users,
            }
        }
        out.push(last.saturating_sub(t0_ns) as f64 / 1e9);
    }
    out
}

/// One user's client: logs in, runs its session, and after a loss or a cut comes back on
/// the back-off until Close.
struct User {
    i: u32,
    target: Target,
    k: usize,
    shared: Arc<Shared>,
    counts: Arc<Counts>,
    sem: Arc<Semaphore>,
    login_timeout: Duration,
    backoff: Backoff,
    source: std::net::IpAddr,
    login: LoginMode,
}

impl User {
    async fn run(self, mut rx: mpsc::Receiver<UserCmd>) {
        let mut rng = StdRng::from_entropy();
        // Before the first login succeeds the logins go through the semaphore, as the
        // timed run's; after that each client is on its own.
        let mut first = true;
        // Attempts failed since the last loss (0: the next is the first after it).
        let mut failed: u32 = 0;
        let mut lost = false;
        let bare = self.target.bare(self.i);
        let mut inst = Installation::new(&self.target.tls, self.i, self.login);
        loop {
            if lost || failed > 0 {
                let wait = tokio::time::sleep(self.backoff.delay(failed, rng.gen()));
                tokio::pin!(wait);
                loop {
                    tokio::select! {
                        _ = &mut wait => break,
                        cmd = rx.recv() => match cmd {
                            Some(UserCmd::Close) | None => return,
                            Some(UserCmd::Cut | UserCmd::Park | UserCmd::CutPark | UserCmd::Resume) => {} // already down
                        }
                    }
                }
            }
            let epoch = self.shared.storm.epoch.load(Ordering::Relaxed);
            let presence = if epoch == 0 {
                "<presence/>".to_string()
            } else {
                format!(
                    "<presence><status>{}</status></presence>",
                    session::storm_status(epoch)
                )
            };
            self.counts.attempts.fetch_add(1, Ordering::Relaxed);
            let attempt = tokio::time::timeout(
                self.login_timeout,
                session::login_as(
                    &self.target,
                    self.login,
                    self.i,
                    self.source,
                    &presence,
                    &mut inst,
                ),
            );
            let r = if first {
                let Ok(_permit) = self.sem.acquire().await else {
                    return;
                };
                attempt.await
            } else {
                attempt.await
            }
            .unwrap_or_else(|_| Err("login timed out".into()));
            let logged = match r {
                Ok(l) => l,
                Err(e) => {
                    let why = Failure::of(&e);
                    self.counts.failed[why.index()].fetch_add(1, Ordering::Relaxed);
                    if why == Failure::Other {
                        self.shared.note_error(format!("login {bare}: {e}"));
                    }
                    failed += 1;
                    continue;
                }
            };
            first = false;
            failed = 0;
            self.shared.note_negotiated(&logged.negotiated);
            self.counts.logins.fetch_add(1, Ordering::Relaxed);
            if logged.resumed {
                self.counts.resumed.fetch_add(1, Ordering::Relaxed);
            }
            if logged.fast {
                self.counts.fast.fetch_add(1, Ordering::Relaxed);
            }
            if logged.sm_resumed {
                self.counts.sm_resumed.fetch_add(1, Ordering::Relaxed);
            }
            if logged.sm_failed {
                self.counts.sm_failed.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(w) = inst.sm_window() {
                self.counts.sm_window_s.fetch_min(w, Ordering::Relaxed);
            }
            let resumed_at = if logged.sm_resumed {
                session::now_ns()
            } else {
                0
            };
            self.counts.sm_resumed_at[self.i as usize].store(resumed_at, Ordering::Relaxed);
            self.counts.back_at[self.i as usize].store(session::now_ns(), Ordering::Relaxed);
            self.counts.online.fetch_add(1, Ordering::Relaxed);
            let (tx, srx) = mpsc::channel(4);
            let mut h = tokio::spawn(session::run(
                logged,
                bare.clone(),
                self.k,
                Mode::Storm,
                self.shared.clone(),
                srx,
            ));
            let (closing, parked) = loop {
                tokio::select! {
                    _ = &mut h => break (None, false), // lost: the server ended it
                    cmd = rx.recv() => match cmd {
                        Some(UserCmd::Cut) => break (Some(Command::Leave { drop: true }), false),
                        Some(UserCmd::Park) => break (Some(Command::Leave { drop: false }), true),
                        Some(UserCmd::CutPark) => break (Some(Command::Leave { drop: true }), true),
                        Some(UserCmd::Close) | None => break (Some(Command::Close), false),
                        Some(UserCmd::Resume) => {} // not parked: nothing to do
                    }
                }
            };
            self.counts.online.fetch_sub(1, Ordering::Relaxed);
            lost = true;
            match closing {
                None => {}
                Some(Command::Close) => {
                    let _ = tx.send(Command::Leave { drop: false }).await;
                    let _ = h.await;
                    return;
                }
                Some(leave) => {
                    let _ = tx.send(leave).await;
                    let _ = h.await;
                }
            }
            if parked {
                // Back at once on Resume, through the login concurrency as a first login.
                loop {
                    match rx.recv().await {
                        Some(UserCmd::Resume) => break,
                        Some(UserCmd::Close) | None => return,
                        Some(UserCmd::Cut | UserCmd::Park | UserCmd::CutPark) => {}
                    }
                }
                lost = false;
                first = true;
            }
        }
    }
}

/// The JSON of a storm run (flat: `<cause>_<figure>`, as bench/ratio.py reads it).
pub fn to_json(r: &StormReport) -> String {
    let mut f: Vec<(String, String)> = vec![
        ("label".into(), json_str(&r.label)),
        ("users".into(), r.users.to_string()),
        ("contacts".into(), r.contacts.to_string()),
        ("storm".into(), "true".into()),
        (
            "storm_causes".into(),
            format!(
                "[{}]",
                r.storms
                    .iter()
                    .map(|(c, _)| json_str(c.name()))
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        ),
        ("storm_backoff_min_s".into(), num(r.backoff.map(|b| b.0))),
        ("storm_backoff_max_s".into(), num(r.backoff.map(|b| b.1))),
        ("storm_backoff_cap_s".into(), num(r.backoff.map(|b| b.2))),
        ("storm_login_timeout_s".into(), num(Some(r.login_timeout_s))),
        ("logins_ok".into(), r.logins_ok.to_string()),
        (
            "sessions_all_contacts_seen".into(),
            r.sessions_all_contacts_seen.to_string(),
        ),
        (
            "login".into(),
            json_str(r.login.map_or("sasl1", login_name)),
        ),
        ("negotiated".into(), json_strs(&r.negotiated)),
        ("sm_window_s".into(), num(r.sm_window_s.map(|w| w as f64))),
    ];
    cost_json(&mut f, "first", &r.first);
    for (cause, s) in &r.storms {
        let c = cause.name();
        let u = |v: Option<u64>| num(v.map(|x| x as f64));
        let mut add = |k: &str, v: String| f.push((format!("{c}_{k}"), v));
        add("t0_unix_ns", s.t0_ns.to_string());
        add("secs", num(Some(s.secs)));
        add("server_down_s", num(s.server_down_s));
        add("back", s.back.to_string());
        add("back_99_s", num(s.back_99_s));
        add("back_100_s", num(s.back_100_s));
        add("restored", s.restored.to_string());
        add("restored_50_s", num(s.restored_50_s));
        add("restored_99_s", num(s.restored_99_s));
        add("restored_100_s", num(s.restored_100_s));
        add("taken_back", s.taken_back.to_string());
        add("watched_s", num(Some(s.watched_s)));
        add("attempts", s.attempts.to_string());
        for why in Failure::ALL {
            add(
                &format!("failed_{}", why.name()),
                s.failed[why.index()].to_string(),
            );
        }
        add("failed", s.failed.iter().sum::<u64>().to_string());
        add("rss_kb_before", u(s.rss_kb_before));
        add("peak_rss_kb", u(s.peak_rss_kb));
        cost_json(&mut f, c, &s.cost);
    }
    f.push(("errors".into(), json_strs(&r.errors)));
    let body: Vec<String> = f.iter().map(|(k, v)| format!("  \"{k}\": {v}")).collect();
    format!("{{\n{}\n}}\n", body.join(",\n"))
}

/// The `--login` value's name, as the JSON records it.
pub fn login_name(m: LoginMode) -> &'static str {
    match m {
        LoginMode::Sasl1 => "sasl1",
        LoginMode::Sasl2 => "sasl2",
        LoginMode::Fast => "fast",
        LoginMode::FastResume => "fast-resume",
    }
}

/// `<prefix>_logins`, `_resumed` (TLS), `_fast`, `_sm_resumed` and `_sm_failed`
/// (XEP-0198), `_cpu_s`, `_store_cpu_s` and `_total_cpu_ms_per_login` (server plus stores).
fn cost_json(f: &mut Vec<(String, String)>, prefix: &str, c: &LoginCost) {
    let mut add = |k: &str, v: String| f.push((format!("{prefix}_{k}"), v));
    add("logins", c.logins.to_string());
    add("resumed", c.resumed.to_string());
    add("fast", c.fast.to_string());
    add("sm_resumed", c.sm_resumed.to_string());
    add("sm_failed", c.sm_failed.to_string());
    add("cpu_s", num(c.cpu_s));
    add("store_cpu_s", num(c.store_cpu_s));
    add("total_cpu_ms_per_login", num(c.total_ms_per_login()));
}

fn cost_text(c: &LoginCost) -> String {
    format!(
        "{} logins ({} resumed TLS, {} FAST, {} XEP-0198 resumed, {} refused), \
         CPU server {} s + stores {} s = {} ms per login",
        c.logins,
        c.resumed,
        c.fast,
        c.sm_resumed,
        c.sm_failed,
        c.cpu_s.map_or("?".into(), |v| format!("{v:.2}")),
        c.store_cpu_s.map_or("?".into(), |v| format!("{v:.2}")),
        c.total_ms_per_login()
            .map_or("?".into(), |v| format!("{v:.3}"))
    )
}

/// A short table of a storm run for the terminal.
pub fn to_table(r: &StormReport) -> String {
    let mut out = format!(
        "{}: N = {}, K = {}, login {}, first logins {}, sessions seeing all contacts {}{}\nfirst logins: {}\n",
        r.label,
        r.users,
        r.contacts,
        r.login.map_or("sasl1", login_name),
        r.logins_ok,
        r.sessions_all_contacts_seen,
        r.sm_window_s
            .map_or(String::new(), |w| format!(", XEP-0198 window {w} s")),
        cost_text(&r.first)
    );
    for (cause, s) in &r.storms {
        out.push_str(&format!(
            "{}: back {} (99 % {}, 100 % {}); restored {} (50 % {}, 99 % {}, 100 % {}); \
             taken back within {} s after: {}; \
             attempts {}, failed: refused {} timeout {} stream {} other {}; \
             RSS before {} kB, peak {} kB{}\n",
            cause.name(),
            s.back,
            secs(s.back_99_s),
            secs(s.back_100_s),
            s.restored,
            secs(s.restored_50_s),
            secs(s.restored_99_s),
            secs(s.restored_100_s),
            s.watched_s,
            s.taken_back,
            s.attempts,
            s.failed[0],
            s.failed[1],
            s.failed[2],
            s.failed[3],
            s.rss_kb_before.map_or("?".into(), |v| v.to_string()),
            s.peak_rss_kb.map_or("?".into(), |v| v.to_string()),
            s.server_down_s
                .map_or(String::new(), |d| format!("; server down {d:.2} s")),
        ));
        out.push_str(&format!("{}: {}\n", cause.name(), cost_text(&s.cost)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_back_off_starts_between_min_and_max_doubles_per_failure_and_is_capped() {
        let b = Backoff {
            min: 1.0,
            max: 5.0,
            cap: 60.0,
        };
        assert_eq!(b.delay(0, 0.0), Duration::from_secs(1));
        assert_eq!(b.delay(0, 1.0), Duration::from_secs(5));
        assert_eq!(b.delay(0, 0.5), Duration::from_secs(3));
        assert_eq!(b.delay(1, 0.5), Duration::from_secs(6));
        assert_eq!(b.delay(3, 0.5), Duration::from_secs(24));
        assert_eq!(b.delay(4, 0.5), Duration::from_secs(48));
        assert_eq!(b.delay(5, 0.0), Duration::from_secs(32));
        assert_eq!(b.delay(5, 0.5), Duration::from_secs(60));
        assert_eq!(b.delay(1000, 0.9), Duration::from_secs(60));
    }

    #[test]
    fn login_errors_are_classified_by_what_the_server_did() {
        let cases = [
            (
                "connect 127.0.0.1:38322 from 127.0.0.2: Connection refused (os error 111)",
                Failure::Refused,
            ),
            ("login timed out", Failure::Timeout),
            ("stream error: system-shutdown", Failure::Stream),
            ("connection closed by server", Failure::Stream),
            ("server closed the stream", Failure::Stream),
            (
                "read: Connection reset by peer (os error 104)",
                Failure::Stream,
            ),
            ("tls handshake: unexpected end of file", Failure::Stream),
            ("sasl: failure not-authorized", Failure::Other),
        ];
        for (e, want) in cases {
            assert_eq!(Failure::of(e), want, "{e}");
        }
    }

    #[test]
    fn the_time_by_a_share_is_the_event_that_completes_it() {
        let t = [3.0, 1.0, 2.0, 10.0];
        assert_eq!(time_by(&t, 4, 1.0), Some(10.0));
        assert_eq!(time_by(&t, 4, 0.5), Some(2.0));
        assert_eq!(time_by(&t, 4, 0.99), Some(10.0));
        // One of five never came: no 100 %, and 99 % of five is all five.
        assert_eq!(time_by(&t, 5, 1.0), None);
        assert_eq!(time_by(&t, 5, 0.99), None);
        assert_eq!(time_by(&t, 5, 0.8), Some(10.0));
        let many: Vec<f64> = (1..=1000).map(f64::from).collect();
        assert_eq!(time_by(&many, 1000, 0.99), Some(990.0));
        assert_eq!(time_by(&many[..995], 1000, 0.99), Some(990.0));
        assert_eq!(time_by(&many[..989], 1000, 0.99), None);
    }
}
