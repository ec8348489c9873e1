//! presenced-bench: an XMPP load generator that speaks to ANY server (presenced, Prosody,
//! ejabberd) and measures logins, presence fan-out, latency and server cost.
//!
//! A run has an untimed part and a timed part:
//!
//! * `--provision` (untimed, run once per server): creates users 0..N and their contact
//!   graph by the server's own means. For Prosody and ejabberd that is in-band
//!   registration (XEP-0077) and a subscribe/subscribed exchange over XMPP between all
//!   users online at once (RFC 6121 §3), or with `--provision-files DIR` their storage
//!   written directly ([`peer_store`]); for presenced it is its own store code
//!   ([`provision_presenced_store`]) or a SQL file ([`provision_presenced`]). It also fills the SCRAM SaltedPassword cache (`--scram-cache`).
//! * the timed run: N logins at a controlled rate, the idle RSS reading, presence changes
//!   at a fixed offered load (latency), then at saturation (throughput), then close.
//!
//! Only loopback targets are accepted, every phase is bounded in count and time, and the
//! whole run stops at `--time-limit`.

mod graph;
mod peer_store;
mod procfs;
mod report;
mod rest;
mod scram;
mod session;
mod soak;
mod stats;
mod storm;
mod worker;
mod xml;

use std::net::SocketAddr;
use std::ops::Range;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use tokio::sync::{mpsc, Semaphore};

use graph::ContactGraph;
use procfs::{cpu_between, ServerProbe, StoreProbe};
use report::Report;
use scram::{SaltCache, ScramHash};
use session::{
    Command, MechPref, Mode, Shared, Target, FIXED_PHASE, LADDER_PHASE, PHASES, SAT_PHASE,
};
use stats::Histogram;
use worker::{Cmd, Reply, Worker, Workers};

/// Which server is under test; decides how `--provision` creates users and rosters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ServerKind {
    /// Prosody: in-band registration + subscriptions over XMPP.
    Prosody,
    /// ejabberd: in-band registration + subscriptions over XMPP.
    Ejabberd,
    /// presenced: SQL file given by --provision-sql.
    Presenced,
    /// Any other server: same as Prosody/ejabberd (XEP-0077 must be enabled).
    Other,
}

/// XMPP load generator for presenced, Prosody and ejabberd (loopback targets only).
#[derive(Debug, Parser)]
#[command(name = "presenced-bench", version)]
struct Cli {
    /// c2s address of the server under test (an IP literal on loopback).
    #[arg(long, default_value = "127.0.0.1:29222")]
    target: SocketAddr,
    /// XMPP domain of the test users.
    #[arg(long, default_value = "bench.example")]
    domain: String,
    /// Server kind (decides provisioning).
    #[arg(long, value_enum, default_value = "prosody")]
    server: ServerKind,
    /// Label in reports (defaults to the server kind).
    #[arg(long)]
    label: Option<String>,
    /// Number of users / sessions N.
    #[arg(long, short = 'n', default_value_t = 1000)]
    users: u32,
    /// Mutual contacts per user K.
    #[arg(long, short = 'k', default_value_t = 10)]
    contacts: u32,
    /// Shuffle the ring with this seed (random-looking K-regular graph); plain ring if absent.
    #[arg(long)]
    graph_seed: Option<u64>,
    /// User i is <user-prefix><i>.
    #[arg(long, default_value = "bench")]
    user_prefix: String,
    /// User i's password is <password-prefix><i>.
    #[arg(long, default_value = "bench-pass-")]
    password_prefix: String,
    /// SCRAM variant.
    #[arg(long, value_enum, default_value = "auto")]
    mech: MechPref,
    /// File caching SCRAM SaltedPassword per user (filled by --provision, RFC 5802 §5.1).
    #[arg(long)]
    scram_cache: Option<PathBuf>,
    /// Number of source addresses 127.0.0.2, 127.0.0.3, ... to spread connections over.
    #[arg(long, default_value_t = 64)]
    source_addrs: u32,
    /// Offered login rate in sessions/s; 0 = as fast as --login-concurrency allows.
    #[arg(long, default_value_t = 0.0)]
    login_rate: f64,
    /// Logins in flight at most.
    #[arg(long, default_value_t = 50)]
    login_concurrency: u32,
    /// Give up on one login after this many seconds.
    #[arg(long, default_value_t = 30)]
    login_timeout: u64,
    /// Longest wait for the post-login presence storm to go quiet, s.
    #[arg(long, default_value_t = 30)]
    settle_secs: u64,
    /// Seconds of idleness before the RSS reading at N sessions.
    #[arg(long, default_value_t = 3)]
    idle_secs: u64,
    /// Fixed offered load: presence changes per second (each fans out to K watchers).
    #[arg(long, default_value_t = 100.0)]
    fixed_rate: f64,
    /// Length of the fixed-load phase, s.
    #[arg(long, default_value_t = 10)]
    fixed_secs: u64,
    /// Latency ladder: after the saturation phase, one fixed-load phase per rate
    /// (presence changes/s, comma-separated, at most 6), each with its own counts and
    /// latency histogram (`ladder` in the JSON).
    #[arg(long, value_delimiter = ',', conflicts_with = "fixed_fractions")]
    fixed_rates: Vec<f64>,
    /// Latency ladder by fractions of a saturation rate given with --fractions-of: rate
    /// = fraction × that many deliveries/s ÷ K changes/s (comma-separated, at most 6).
    #[arg(long, value_delimiter = ',', requires = "fractions_of")]
    fixed_fractions: Vec<f64>,
    /// The saturation the --fixed-fractions are fractions of, in deliveries/s (e.g. the
    /// best peer's at this N and K in earlier runs: the same offered load for every server).
    #[arg(long)]
    fractions_of: Option<f64>,
    /// Length of each phase of the latency ladder, s.
    #[arg(long, default_value_t = 10)]
    ladder_secs: u64,
    /// Length of the saturation phase, s (0 skips it).
    #[arg(long, default_value_t = 10)]
    sat_secs: u64,
    /// Deliveries allowed in flight during the saturation phase.
    #[arg(long, default_value_t = 4000)]
    sat_window: u64,
    /// Longest wait for outstanding deliveries after a phase, s.
    #[arg(long, default_value_t = 10)]
    drain_secs: u64,
    /// PID(s) of the server process(es), for RSS and CPU from /proc (repeatable).
    #[arg(long = "server-pid")]
    server_pids: Vec<u32>,
    /// PID(s) of processes that are the server's own storage (presenced's private Redis):
    /// their CPU is added to the server's in the "server + stores" figures (repeatable).
    #[arg(long = "store-pid")]
    store_pids: Vec<u32>,
    /// With --pg-stats: also charge the CPU of PostgreSQL backends connected to
    /// --pg-stats-db to the server.
    #[arg(long)]
    pg_backends: bool,
    /// Write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Hard limit on the whole run, s.
    #[arg(long, default_value_t = 1800)]
    time_limit: u64,
    /// Provision users and contacts (untimed) and exit.
    #[arg(long)]
    provision: bool,
    /// Provisioning: users per second that send their subscription requests.
    #[arg(long, default_value_t = 500.0)]
    provision_rate: f64,
    /// Provisioning: longest wait for the server to work through the subscriptions, s.
    #[arg(long, default_value_t = 300)]
    provision_wait: u64,
    /// Prosody and ejabberd: write the users and rosters into DIR in Prosody's file storage
    /// layout (DIR/<host>/accounts, DIR/<host>/roster; see peer_store.rs) instead of
    /// registering them over XMPP. Prosody reads DIR as its data_path; ejabberd imports it
    /// with `ejabberdctl import_prosody DIR`. No server needs to run.
    #[arg(long)]
    provision_files: Option<PathBuf>,
    /// SCRAM iteration count of the accounts --provision-files writes (each server's own
    /// default for a registration: Prosody 10000, ejabberd 4096).
    #[arg(long, default_value_t = 4096)]
    scram_iterations: u32,
    /// presenced only: SQL file that creates users and contacts (see provision_presenced).
    #[arg(long)]
    provision_sql: Option<PathBuf>,
    /// presenced only: PostgreSQL URL given to psql for --provision-sql.
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/presenced")]
    provision_db: String,
    /// CI mode: N=20, K=3, short phases; fails only if logins or deliveries fail entirely.
    #[arg(long)]
    smoke: bool,
    /// Generator processes for the timed run. A process may hold at most ~19k sessions
    /// (20,000 descriptors here): with P > 1 this process spawns P workers that own
    /// contiguous slices of the users and drives their phases over pipes.
    #[arg(long, default_value_t = 1)]
    procs: u32,
    /// Internal: run as worker I of --procs (commands on stdin, replies on stdout).
    #[arg(long, hide = true)]
    worker: Option<u32>,
    /// Idle window after the idle-memory reading, s (0 skips it). Every server gets it, so
    /// the load phases start at the same offset after logins; the write rates at rest are
    /// read over it when a --metrics-url, --redis-stats or --pg-stats source is given.
    #[arg(long, default_value_t = 60)]
    rest_secs: u64,
    /// presenced's Prometheus endpoint, e.g. http://127.0.0.1:29280/metrics (loopback).
    #[arg(long)]
    metrics_url: Option<String>,
    /// presenced's admin socket, for the allocator's figures at the memory samples.
    #[arg(long)]
    admin_socket: Option<String>,
    /// Redis the server writes to, for INFO commandstats deltas (exact only if private).
    #[arg(long)]
    redis_stats: Option<String>,
    /// PostgreSQL URL to watch the server's database through at rest (e.g. .../postgres):
    /// statements from pg_stat_activity, commits and rows from pg_stat_database.
    #[arg(long)]
    pg_stats: Option<String>,
    /// The server's database, watched at rest.
    #[arg(long, default_value = "presenced_bench")]
    pg_stats_db: String,
    /// Client state indication run instead of the fixed-load and saturation phases
    /// (XEP-0352; BENCHMARKS.md, "Client state indication and interest lists"): after the
    /// idle window, a baseline window with every client active, then one with every other
    /// client inactive, at the same --fixed-rate of changes from the active half, then
    /// `<active/>` and the check that each inactive client has every changed contact's
    /// latest presence. Needs --procs 1 (the check compares sessions of one process).
    #[arg(long)]
    csi: bool,
    /// CSI: length of each window, s.
    #[arg(long, default_value_t = 20)]
    csi_secs: u64,
    /// CSI: a third window in which the inactive clients first set an interest list
    /// naming this many of their changing contacts (presenced's urn:presenced:interest:0);
    /// 0 skips it.
    #[arg(long, default_value_t = 0)]
    csi_interest: u32,
    /// Soak run instead of the timed run: N sessions under churn for this many seconds
    /// (reliability/soak.sh and reliability/faults.sh; see soak.rs).
    #[arg(long, default_value_t = 0)]
    soak_secs: u64,
    /// Soak: fraction of the sessions that reconnect per minute.
    #[arg(long, default_value_t = 0.10)]
    churn_per_min: f64,
    /// Soak: fraction of the reconnects made by dropping the connection (no stream close).
    #[arg(long, default_value_t = 0.5)]
    drop_fraction: f64,
    /// Soak: presence changes per second.
    #[arg(long, default_value_t = 20.0)]
    soak_presence_rate: f64,
    /// Soak: chat messages per second, each to a random contact of the sender.
    #[arg(long, default_value_t = 20.0)]
    soak_message_rate: f64,
    /// Soak: probe presence changes per second (their watchers are counted per change).
    #[arg(long, default_value_t = 1.0)]
    probe_rate: f64,
    /// Soak: seconds between counter lines.
    #[arg(long, default_value_t = 60)]
    sample_secs: u64,
    /// Soak: file for the counter lines (JSON, one per line); stdout if absent.
    #[arg(long)]
    soak_log: Option<PathBuf>,
    /// Further c2s addresses of the same cluster (timed run and soak); user i logs in to
    /// address (i + failed attempts) mod the number of addresses, --target being the
    /// first (the timed run makes one attempt).
    #[arg(long = "also-target")]
    also_targets: Vec<SocketAddr>,
    /// Timed run, after the load phases: SIGKILL this process (the cluster node at address
    /// --kill-target) and time, for each of its sessions, how long until its unavailable
    /// reached its contacts' sessions on the other nodes.
    #[arg(long)]
    kill_pid: Option<u32>,
    /// Index of the killed node's address: 0 is --target, then each --also-target in order.
    #[arg(long, default_value_t = 0)]
    kill_target: usize,
    /// Longest wait for the announcements after the kill, s.
    #[arg(long, default_value_t = 180)]
    kill_wait: u64,
    /// The bound the announcements are counted against (T + one sweep of the servers), s.
    #[arg(long, default_value_t = 105.0)]
    kill_bound_secs: f64,
    /// Reconnect storms instead of the timed run, in this order (`cut`, `restart`, or
    /// `cut,restart`): every session dropped at once and every client back on its
    /// back-off (storm.rs; BENCHMARKS.md, "Reconnect storm"). Needs --procs 1.
    #[arg(long, value_enum, value_delimiter = ',')]
    storm: Vec<storm::Cause>,
    /// Storm: the directory where a restart is asked for (`restart`) and told about
    /// (`stop_ns`, then `pids`) by whoever runs the server (bench/run.sh).
    #[arg(long)]
    storm_dir: Option<PathBuf>,
    /// Storm: longest wait for every session to be restored, s.
    #[arg(long, default_value_t = 300)]
    storm_wait: u64,
    /// Storm: after the last restore, seconds to go on watching for a restored presence
    /// taken back by an unavailable (a server's grace period, 10 s for presenced, and a
    /// margin).
    #[arg(long, default_value_t = 15)]
    storm_watch: u64,
    /// Storm: a client's first reconnection delay is uniform between this …, s.
    #[arg(long, default_value_t = 1.0)]
    backoff_min: f64,
    /// … and this, s; it doubles after each failed attempt …
    #[arg(long, default_value_t = 5.0)]
    backoff_max: f64,
    /// … up to this, s.
    #[arg(long, default_value_t = 60.0)]
    backoff_cap: f64,
    /// How clients log in (storm runs): `sasl1` (SCRAM, stream restart, bind: every login
    /// the same), `sasl2` (SASL2 SCRAM with Bind 2 inline, full TLS handshake every time)
    /// `fast` (first login `sasl2` asking for a XEP-0484 token, every reconnect with
    /// the token over a resumed TLS 1.3 session) or `fast-resume` (`fast`, with XEP-0198
    /// enabled in the first login's Bind 2 and every reconnect resuming the session inline
    /// in its SASL2 authentication: no roster get, no initial presence).
    #[arg(long, value_enum, default_value = "sasl1")]
    login: session::LoginMode,
}

impl Cli {
    /// The server's storage processes whose CPU and memory are charged to it: its private
    /// Redis (--store-pid) and, with --pg-backends, the backends of its database.
    fn store_probe(&self) -> StoreProbe {
        StoreProbe {
            pids: self.store_pids.clone(),
            pg: self
                .pg_stats
                .clone()
                .filter(|_| self.pg_backends)
                .map(|u| (u, self.pg_stats_db.clone())),
        }
    }

    fn apply_smoke(&mut self) {
        if self.smoke {
            self.users = 20;
            self.contacts = 3;
            self.fixed_rate = 20.0;
            self.fixed_secs = 2;
            self.sat_secs = 2;
            self.sat_window = 200;
            self.ladder_secs = self.ladder_secs.min(2);
            self.idle_secs = 0;
            self.settle_secs = 10;
            self.drain_secs = 5;
            self.rest_secs = self.rest_secs.min(3);
            self.csi_secs = self.csi_secs.min(2);
            self.storm_wait = self.storm_wait.min(60);
            self.storm_watch = self.storm_watch.min(3);
            self.time_limit = self
                .time_limit
                .min(if self.storm.is_empty() { 120 } else { 240 });
        }
    }

    /// The latency ladder's rates (changes/s) with the fraction each stands for, if it was
    /// derived from --fractions-of. The one place the derivation is written.
    fn ladder(&self) -> Vec<(f64, Option<f64>)> {
        match self.fractions_of {
            Some(sat) if !self.fixed_fractions.is_empty() => self
                .fixed_fractions
                .iter()
                .map(|&f| (f * sat / f64::from(self.contacts.max(1)), Some(f)))
                .collect(),
            _ => self.fixed_rates.iter().map(|&r| (r, None)).collect(),
        }
    }
}

fn main() -> ExitCode {
    let mut cli = Cli::parse();
    cli.apply_smoke();
    // Loopback only: the bench must never load anything but a local test server.
    if !cli.target.ip().is_loopback() {
        eprintln!("refusing non-loopback target {}", cli.target);
        return ExitCode::from(2);
    }
    if cli.procs == 0 || cli.procs > cli.users.max(1) {
        eprintln!("--procs must be between 1 and N");
        return ExitCode::from(2);
    }
    let ladder = cli.ladder();
    if ladder.len() > session::LADDER_MAX || ladder.iter().any(|&(r, _)| r <= 0.0 || !r.is_finite())
    {
        eprintln!(
            "the latency ladder takes at most {} rates, each above 0",
            session::LADDER_MAX
        );
        return ExitCode::from(2);
    }
    if !cli.storm.is_empty() && cli.procs != 1 {
        eprintln!("--storm needs --procs 1 (a watcher's view is kept in one process)");
        return ExitCode::from(2);
    }
    if cli.login != session::LoginMode::Sasl1 && cli.storm.is_empty() {
        // The other modes measure one login each; reconnects happen in the storms.
        eprintln!("--login sasl2|fast|fast-resume needs --storm");
        return ExitCode::from(2);
    }
    if cli.csi && cli.procs != 1 && cli.worker.is_none() {
        eprintln!(
            "--csi needs --procs 1 (the nothing-lost check compares sessions of one process)"
        );
        return ExitCode::from(2);
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let limit = Duration::from_secs(cli.time_limit);
    let outcome = rt.block_on(async {
        match tokio::time::timeout(limit, real_main(cli)).await {
            Ok(r) => r,
            Err(_) => Err(format!("time limit of {} s reached", limit.as_secs())),
        }
    });
    // Sessions still running are abandoned here, not awaited.
    rt.shutdown_timeout(Duration::from_secs(1));
    match outcome {
        Ok(code) => code,
        Err(e) => {
            eprintln!("presenced-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn real_main(cli: Cli) -> Result<ExitCode, String> {
    let cli = Arc::new(cli);
    let graph = Arc::new(ContactGraph::new(cli.users, cli.contacts, cli.graph_seed)?);
    let cache = match &cli.scram_cache {
        Some(p) => SaltCache::load(p).map_err(|e| format!("{}: {e}", p.display()))?,
        None => SaltCache::default(),
    };
    let target = Target {
        addr: cli.target,
        addrs: Arc::new(
            std::iter::once(cli.target)
                .chain(cli.also_targets.iter().copied())
                .collect(),
        ),
        domain: cli.domain.clone(),
        tls: session::tls_config()?,
        mech: cli.mech,
        cache: Arc::new(cache),
        user_prefix: cli.user_prefix.clone(),
        password_prefix: cli.password_prefix.clone(),
        resource: "bench".into(),
    };
    if let Some(index) = cli.worker {
        let w = Worker::new(cli.clone(), target, graph, index, cli.procs);
        worker::serve_stdio(w).await?;
        return Ok(ExitCode::SUCCESS);
    }
    if cli.provision {
        if let Some(dir) = &cli.provision_files {
            let accounts = peer_store::Accounts {
                domain: &cli.domain,
                user_prefix: &cli.user_prefix,
                password_prefix: &cli.password_prefix,
                iterations: cli.scram_iterations,
            };
            let started = Instant::now();
            let host = peer_store::write_prosody_store(dir, &accounts, &graph, &target.cache)?;
            eprintln!(
                "provision: {} users with {} contacts each written to {} in {:.1} s",
                cli.users,
                cli.contacts,
                host.display(),
                started.elapsed().as_secs_f64()
            );
        } else if cli.server == ServerKind::Presenced {
            match &cli.provision_sql {
                Some(_) => provision_presenced(&cli)?,
                None => provision_presenced_store(&cli, &target.cache).await?,
            }
        } else {
            provision_over_xmpp(&cli, &target, &graph).await?;
        }
        if let Some(p) = &cli.scram_cache {
            target
                .cache
                .save(p)
                .map_err(|e| format!("{}: {e}", p.display()))?;
        }
        eprintln!(
            "provision: {} SCRAM salted passwords cached",
            target.cache.len()
        );
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(bad) = cli.also_targets.iter().find(|a| !a.ip().is_loopback()) {
        return Err(format!("refusing non-loopback target {bad}"));
    }
    if !cli.storm.is_empty() {
        return storm_main(&cli, target, graph).await;
    }
    if cli.soak_secs > 0 {
        let plan = soak::Plan {
            secs: cli.soak_secs,
            churn_per_min: cli.churn_per_min,
            drop_fraction: cli.drop_fraction,
            presence_rate: cli.soak_presence_rate,
            message_rate: cli.soak_message_rate,
            probe_rate: cli.probe_rate,
            sample_secs: cli.sample_secs,
            log: cli.soak_log.clone(),
            login_concurrency: cli.login_concurrency,
            login_timeout: Duration::from_secs(cli.login_timeout),
            drain_secs: cli.drain_secs,
            source_addrs: cli.source_addrs,
        };
        let all_online = soak::run(plan, target, graph).await?;
        return Ok(if all_online {
            ExitCode::SUCCESS
        } else {
            eprintln!("soak: not every session was online when the load ended");
            ExitCode::FAILURE
        });
    }
    let report = timed_run(&cli, &target, &graph).await?;
    println!("{}", report.to_table());
    if let Some(p) = &cli.json {
        std::fs::write(p, report.to_json()).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    if cli.csi {
        return Ok(csi_verdict(&cli, &report));
    }
    let total_delivered = report.fixed_delivered
        + report.sat_delivered
        + report.ladder.iter().map(|p| p.delivered).sum::<u64>();
    if report.logins_ok == 0 || total_delivered == 0 {
        eprintln!(
            "FAIL: logins ok {} , presences delivered {}",
            report.logins_ok, total_delivered
        );
        return Ok(ExitCode::FAILURE);
    }
    if cli.smoke {
        // A smoke run is small enough to demand everything: every user logged in and saw
        // every contact, and every change of the fixed load reached each of its K watchers.
        // One login and one delivery would pass the check above with most of the run lost.
        let users = u64::from(report.users);
        let want_delivered = report.fixed_sent * u64::from(report.contacts);
        // Every rate of the latency ladder was offered, and delivered in full.
        let ladder_short = report.ladder.len() != cli.ladder().len()
            || report
                .ladder
                .iter()
                .any(|p| p.sent == 0 || p.delivered != p.sent * u64::from(report.contacts));
        if report.logins_ok != users
            || report.sessions_all_contacts_seen != users
            || report.fixed_sent == 0
            || report.fixed_delivered != want_delivered
            || ladder_short
        {
            eprintln!(
                "smoke: FAIL: logins {}/{users}, sessions seeing all contacts {}/{users}, \
                 fixed-load deliveries {}/{want_delivered}, latency ladder (sent, delivered) {:?}",
                report.logins_ok,
                report.sessions_all_contacts_seen,
                report.fixed_delivered,
                report
                    .ladder
                    .iter()
                    .map(|p| (p.sent, p.delivered))
                    .collect::<Vec<_>>()
            );
            return Ok(ExitCode::FAILURE);
        }
        println!(
            "smoke: OK ({} logins, {total_delivered} deliveries)",
            report.logins_ok
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The reconnect storms (`--storm`): their table, their JSON, and the verdict: a smoke run
/// demands every session restored after every storm, a full run at least one.
async fn storm_main(
    cli: &Cli,
    target: Target,
    graph: Arc<ContactGraph>,
) -> Result<ExitCode, String> {
    let plan = storm::Plan {
        causes: cli.storm.clone(),
        backoff: storm::Backoff {
            min: cli.backoff_min,
            max: cli.backoff_max,
            cap: cli.backoff_cap,
        },
        login_concurrency: cli.login_concurrency,
        login_timeout: Duration::from_secs(cli.login_timeout),
        settle_secs: cli.settle_secs,
        wait_secs: cli.storm_wait,
        watch_secs: cli.storm_watch,
        source_addrs: cli.source_addrs,
        dir: cli.storm_dir.clone(),
        server_pids: cli.server_pids.clone(),
        stores: cli.store_probe(),
        login: cli.login,
    };
    let mut rep = storm::run(plan, target, graph).await?;
    rep.label = cli
        .label
        .clone()
        .unwrap_or_else(|| format!("{:?}", cli.server).to_lowercase());
    println!("{}", storm::to_table(&rep));
    if let Some(p) = &cli.json {
        std::fs::write(p, storm::to_json(&rep)).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    let users = u64::from(rep.users);
    let short: Vec<String> = rep
        .storms
        .iter()
        .filter(|(_, s)| s.restored < users && (cli.smoke || s.restored == 0))
        .map(|(c, s)| format!("{}: {} of {users} restored", c.name(), s.restored))
        .collect();
    if short.is_empty() {
        println!("storm: OK");
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!("storm: FAIL: {}; errors {:?}", short.join(", "), rep.errors);
        Ok(ExitCode::FAILURE)
    }
}

/// A CSI run fails when the nothing-lost check found a missing presence, checked nothing,
/// or (as a smoke run) when an inactive client got as many presences as when it was
/// active, or any login or interest list failed.
fn csi_verdict(cli: &Cli, r: &Report) -> ExitCode {
    let c = &r.csi;
    let mut fail = Vec::new();
    if r.logins_ok == 0 || c.baseline_per_client.unwrap_or(0.0) <= 0.0 {
        fail.push("no presence reached the clients in the baseline window".to_string());
    }
    for (name, w) in [
        ("inactive", Some(&c.inactive)),
        ("interest", c.interest.as_ref()),
    ] {
        let Some(w) = w else { continue };
        if w.checked == 0 || w.lost > 0 {
            fail.push(format!(
                "{name} window: {} of {} latest presences missing after <active/>",
                w.lost, w.checked
            ));
        }
    }
    if cli.smoke {
        let users = u64::from(r.users);
        if r.logins_ok != users || r.sessions_all_contacts_seen != users {
            fail.push(format!(
                "logins {}/{users}, sessions seeing all contacts {}/{users}",
                r.logins_ok, r.sessions_all_contacts_seen
            ));
        }
        for (name, w) in [
            ("inactive", Some(&c.inactive)),
            ("interest", c.interest.as_ref()),
        ] {
            let Some(w) = w else { continue };
            if w.per_inactive_client >= c.baseline_per_client.unwrap_or(0.0) {
                fail.push(format!(
                    "{name} window: an inactive client got {:.2} presences, all active {:.2}",
                    w.per_inactive_client,
                    c.baseline_per_client.unwrap_or(0.0)
                ));
            }
            if w.interest_refused > 0 {
                fail.push(format!("{} interest lists refused", w.interest_refused));
            }
        }
    }
    if fail.is_empty() {
        println!("csi: OK");
        ExitCode::SUCCESS
    } else {
        eprintln!("csi: FAIL: {}", fail.join("; "));
        ExitCode::FAILURE
    }
}

/// ==== PROVISIONING HOOK FOR PRESENCED (to be completed by the lead) ====
///
/// presenced keeps accounts and rosters in PostgreSQL, so users and the contact graph are
/// created by SQL, outside the timed part. This runs `psql` on the file given by
/// `--provision-sql` against `--provision-db`, passing the workload as psql variables:
/// `users` (N), `contacts` (K), `domain`, `user_prefix`, `password_prefix`. The SQL must
/// create users `<user_prefix>0 .. <user_prefix>N-1` with password `<password_prefix><i>`
/// (as SCRAM credentials) and, for each user, mutual (`both`) roster items with the K
/// contacts of the ring: offsets ±1..±K/2 (plus N/2 when K is odd) — the same graph as
/// [`ContactGraph`] without `--graph-seed`.
fn provision_presenced(cli: &Cli) -> Result<(), String> {
    let sql = cli
        .provision_sql
        .as_ref()
        .ok_or("--server presenced --provision needs --provision-sql FILE")?;
    if cli.graph_seed.is_some() {
        return Err("--graph-seed is not supported with SQL provisioning (plain ring only)".into());
    }
    let status = std::process::Command::new("psql")
        .arg(&cli.provision_db)
        .args(["-v", "ON_ERROR_STOP=1", "-q"])
        .args(["-v", &format!("users={}", cli.users)])
        .args(["-v", &format!("contacts={}", cli.contacts)])
        .args(["-v", &format!("domain={}", cli.domain)])
        .args(["-v", &format!("user_prefix={}", cli.user_prefix)])
        .args(["-v", &format!("password_prefix={}", cli.password_prefix)])
        .arg("-f")
        .arg(sql)
        .status()
        .map_err(|e| format!("psql: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("psql -f {} failed: {status}", sql.display()))
    }
}

/// Provisions presenced through its own store code (no SQL file needed): accounts with
/// SCRAM credentials as `presenced user add` creates them, then the ring contact graph as
/// mutual (`both`) roster items in one statement. Existing accounts are kept, so a second
/// run only fills what is missing.
async fn provision_presenced_store(cli: &Cli, cache: &SaltCache) -> Result<(), String> {
    if cli.graph_seed.is_some() {
        return Err(
            "--graph-seed is not supported for presenced provisioning (plain ring only)".into(),
        );
    }
    let store = presenced::store::Store::connect(&cli.provision_db, 8)
        .await
        .map_err(|e| format!("{}: {e}", cli.provision_db))?;
    // The server's schema is compiled into its library; there are no operator migrations
    // (a path that is no directory), so a build never meets a schema newer than itself.
    store
        .migrate(std::path::Path::new(""))
        .await
        .map_err(|e| format!("migrations: {e}"))?;
    let store = Arc::new(store);
    let started = std::time::Instant::now();
    let domain = cli.domain.clone();
    let prefix = cli.user_prefix.clone();
    let pw_prefix = cli.password_prefix.clone();
    let errors = for_each_bounded(cli.users, 8, |i| {
        let store = store.clone();
        let (domain, user, pw) = (
            domain.clone(),
            format!("{prefix}{i}"),
            format!("{pw_prefix}{i}"),
        );
        async move {
            match store.create_account(&user, &domain, &pw, 4096).await {
                Ok(()) | Err(presenced::store::StoreError::AccountExists) => Ok(()),
                Err(e) => Err(format!("{user}: {e}")),
            }
        }
    })
    .await;
    if let Some(e) = errors.first() {
        return Err(format!("{} account(s) failed, first: {e}", errors.len()));
    }
    let half = (cli.contacts / 2) as i32;
    let mut offsets: Vec<i32> = (1..=half).flat_map(|o| [o, -o]).collect();
    if cli.contacts % 2 == 1 {
        offsets.push((cli.users / 2) as i32);
    }
    let n = cli.users as i32;
    // The roster graph and the salt cache are written in PostgreSQL's SQL.
    if store.dialect() != presenced::store::Dialect::Postgres {
        return Err("provisioning needs a PostgreSQL store (postgres://...)".into());
    }
    sqlx::query(
        "INSERT INTO roster_items (owner, contact, subscription)
         SELECT $1 || i || '@' || $2, $1 || ((i + o + $3) % $3) || '@' || $2, 'both'
         FROM generate_series(0, $3 - 1) AS i, unnest($4::int[]) AS o
         WHERE (i + o + $3) % $3 <> i
         ON CONFLICT (owner, contact) DO UPDATE
             SET subscription = 'both', ask = NULL, pending_in = false, preapproved = false",
    )
    .bind(&cli.user_prefix)
    .bind(&cli.domain)
    .bind(n)
    .bind(&offsets)
    .execute(store.pool())
    .await
    .map_err(|e| format!("roster graph: {e}"))?;
    // Fill the SaltedPassword cache from the salts the store chose, as the peers' cache is
    // filled by their provisioning logins: otherwise the generator would derive PBKDF2 on
    // every timed presenced login and compete with the server for the same cores.
    let creds: Vec<(String, String, Vec<u8>, i32)> = sqlx::query_as(
        "SELECT a.username, c.hash, c.salt, c.iterations
         FROM scram_credentials c JOIN accounts a ON a.id = c.account_id
         WHERE a.domain = $1 AND starts_with(a.username, $2)",
    )
    .bind(&cli.domain)
    .bind(&cli.user_prefix)
    .fetch_all(store.pool())
    .await
    .map_err(|e| format!("reading salts: {e}"))?;
    for (user, hash, salt, iterations) in creds {
        let Some(i) = user.strip_prefix(&cli.user_prefix) else {
            continue;
        };
        let hash = match hash.as_str() {
            "sha1" => ScramHash::Sha1,
            "sha256" => ScramHash::Sha256,
            _ => continue,
        };
        let password = format!("{}{i}", cli.password_prefix);
        cache.warm(&user, &password, hash, &salt, iterations as u32);
    }
    eprintln!(
        "provisioned {} presenced users with {} contacts each in {:.1}s",
        cli.users,
        cli.contacts,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Runs `f(i)` for i in 0..n with at most `concurrency` in flight; returns failures.
async fn for_each_bounded<F, Fut>(n: u32, concurrency: u32, f: F) -> Vec<String>
where
    F: Fn(u32) -> Fut,
    Fut: std::future::Future<Output = Result<(), String>> + Send + 'static,
{
    let sem = Arc::new(Semaphore::new(concurrency.max(1) as usize));
    let mut handles = Vec::with_capacity(n as usize);
    for i in 0..n {
        let Ok(permit) = sem.clone().acquire_owned().await else {
            break;
        };
        let fut = f(i);
        handles.push(tokio::spawn(async move {
            let r = fut.await;
            drop(permit);
            r
        }));
    }
    let mut errors = Vec::new();
    for h in handles {
        match h.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => errors.push(e),
            Err(e) => errors.push(format!("task: {e}")),
        }
    }
    errors
}

/// Provisioning for servers without SQL access: XEP-0077 registration of every user, then
/// all users online at once, each sending `subscribe` to its K contacts and approving every
/// request it receives, until every roster holds K items with subscription "both".
async fn provision_over_xmpp(
    cli: &Cli,
    target: &Target,
    graph: &Arc<ContactGraph>,
) -> Result<(), String> {
    let n = cli.users;
    let started = Instant::now();
    let created = Arc::new(AtomicU64::new(0));
    let errs = {
        let created = created.clone();
        for_each_bounded(n, cli.login_concurrency, |i| {
            let t = target.clone();
            let created = created.clone();
            let src = session::source_addr(i, cli.source_addrs);
            async move {
                if session::register(&t, i, src).await? {
                    created.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            }
        })
        .await
    };
    if !errs.is_empty() {
        return Err(format!(
            "registration: {} failures, first: {}",
            errs.len(),
            errs[0]
        ));
    }
    eprintln!(
        "provision: {} users ({} new) registered in {:.1} s",
        n,
        created.load(Ordering::Relaxed),
        started.elapsed().as_secs_f64()
    );

    let shared = Arc::new(Shared::default());
    let (sessions, login_errors, _) = login_all(
        cli,
        target,
        graph,
        &shared,
        Mode::Provision,
        None,
        LoginPlan {
            users: 0..cli.users,
            concurrency: cli.login_concurrency,
        },
    )
    .await;
    if login_errors > 0 {
        return Err(format!(
            "provision: {login_errors} logins failed: {:?}",
            shared.errors.lock().map(|e| e.clone()).unwrap_or_default()
        ));
    }
    let k = graph.k();
    for round in 1..=3 {
        // Ask each session for its roster and subscribe to the contacts still missing.
        let mut incomplete = 0u32;
        let mut missing_edges = 0u64;
        for (i, tx) in &sessions {
            let (otx, orx) = tokio::sync::oneshot::channel();
            if tx.send(Command::Roster(otx)).await.is_err() {
                return Err(format!(
                    "provision: session {i} ended: {:?}",
                    errors_of(&shared)
                ));
            }
            let both = tokio::time::timeout(Duration::from_secs(cli.provision_wait), orx)
                .await
                .map_err(|_| format!("provision: roster of user {i} timed out"))?
                .map_err(|_| format!("provision: session {i} ended: {:?}", errors_of(&shared)))?;
            if both.len() > k as usize {
                return Err(format!(
                    "provision: user {i} has {} mutual contacts, more than K={k}: \
                     the server holds rosters of another N/K; wipe its data first",
                    both.len()
                ));
            }
            let missing: Vec<String> = graph
                .contacts(*i)
                .into_iter()
                .map(|c| target.bare(c))
                .filter(|j| !both.contains(j))
                .collect();
            if !missing.is_empty() {
                incomplete += 1;
                missing_edges += missing.len() as u64;
                let _ = tx.send(Command::Subscribe(missing)).await;
                // Paced so that the server is not handed N×K subscriptions in one burst.
                tokio::time::sleep(Duration::from_secs_f64(1.0 / cli.provision_rate.max(1.0)))
                    .await;
            }
        }
        eprintln!(
            "provision: round {round}: {incomplete} users lacked {missing_edges} mutual contacts"
        );
        if incomplete == 0 {
            break;
        }
        wait_quiet(
            &shared,
            Duration::from_secs(3),
            Duration::from_secs(cli.provision_wait),
        )
        .await;
        if round == 3 {
            return Err("provision: rosters did not converge after 3 rounds".into());
        }
    }
    close_all(&sessions).await;
    eprintln!(
        "provision: done in {:.1} s ({} subscription approvals)",
        started.elapsed().as_secs_f64(),
        shared.subscriptions_approved.load(Ordering::Relaxed)
    );
    Ok(())
}

fn errors_of(shared: &Shared) -> Vec<String> {
    shared.errors.lock().map(|e| e.clone()).unwrap_or_default()
}

/// Waits until no presence has arrived for `quiet`, at most `max` (pings and their
/// answers are not a presence storm: `Shared::last_presence_ns`).
async fn wait_quiet(shared: &Shared, quiet: Duration, max: Duration) {
    let until = Instant::now() + max;
    shared
        .last_presence_ns
        .store(session::now_ns(), Ordering::Relaxed);
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let last = shared.last_presence_ns.load(Ordering::Relaxed);
        if session::now_ns().saturating_sub(last) >= quiet.as_nanos() as u64 {
            return;
        }
    }
}

async fn close_all(sessions: &[(u32, mpsc::Sender<Command>)]) {
    for (_, tx) in sessions {
        let _ = tx.send(Command::Close).await;
    }
    // Give the sessions a moment to write their stream close.
    tokio::time::sleep(Duration::from_millis(500)).await;
}

/// Which users one process logs in, and how many logins it keeps in flight.
struct LoginPlan {
    users: Range<u32>,
    concurrency: u32,
}

/// Logs in all N users at the configured rate and starts their session loops.
/// Returns the live sessions, the number of failed logins, and the login span.
async fn login_all(
    cli: &Cli,
    target: &Target,
    graph: &Arc<ContactGraph>,
    shared: &Arc<Shared>,
    mode: Mode,
    hist: Option<Arc<Histogram>>,
    plan: LoginPlan,
) -> (Vec<(u32, mpsc::Sender<Command>)>, u64, Duration) {
    let LoginPlan { users, concurrency } = plan;
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<(u32, Option<mpsc::Sender<Command>>)>();
    let sem = Arc::new(Semaphore::new(concurrency.max(1) as usize));
    let first = users.start;
    let attempts = users.len();
    let started = Instant::now();
    let last_done = Arc::new(AtomicU64::new(0));
    let timeout = Duration::from_secs(cli.login_timeout);
    // With several generator processes each offers its share of the login rate.
    let rate = worker::share(cli.login_rate, cli.procs);
    for i in users {
        if rate > 0.0 {
            let due = started + Duration::from_secs_f64(f64::from(i - first) / rate);
            tokio::time::sleep_until(due.into()).await;
        }
        let Ok(permit) = sem.clone().acquire_owned().await else {
            break;
        };
        let t = target.for_user(i, 0);
        let shared = shared.clone();
        let done_tx = done_tx.clone();
        let hist = hist.clone();
        let last_done = last_done.clone();
        let src = session::source_addr(i, cli.source_addrs);
        let k = graph.k() as usize;
        tokio::spawn(async move {
            let t0 = Instant::now();
            let r = tokio::time::timeout(timeout, session::login(&t, i, src)).await;
            let r = r.unwrap_or_else(|_| Err("login timed out".into()));
            drop(permit);
            match r {
                Ok(logged) => {
                    if logged.roster.both as usize >= k {
                        shared.rosters_complete.fetch_add(1, Ordering::Relaxed);
                    }
                    shared.note_negotiated(&logged.negotiated);
                    if let Some(h) = &hist {
                        h.record(t0.elapsed().as_micros() as u64);
                    }
                    last_done.fetch_max(started.elapsed().as_micros() as u64, Ordering::Relaxed);
                    let (tx, rx) = mpsc::channel(64);
                    let _ = done_tx.send((i, Some(tx)));
                    drop(done_tx);
                    session::run(logged, t.bare(i), k, mode, shared, rx).await;
                }
                Err(e) => {
                    shared.note_error(format!("login {}: {e}", t.user(i)));
                    let _ = done_tx.send((i, None));
                }
            }
        });
    }
    drop(done_tx);
    let mut sessions = Vec::with_capacity(attempts);
    let mut failed = 0;
    // Each task reports exactly once (and keeps its sender while its session runs, so the
    // channel never closes by itself): count the reports.
    while sessions.len() + (failed as usize) < attempts {
        let Some((i, tx)) = done_rx.recv().await else {
            break;
        };
        match tx {
            Some(tx) => sessions.push((i, tx)),
            None => failed += 1,
        }
    }
    sessions.sort_by_key(|(i, _)| *i);
    let span = Duration::from_micros(last_done.load(Ordering::Relaxed));
    (sessions, failed, span)
}

fn ms(us: Option<u64>) -> Option<f64> {
    us.map(|v| v as f64 / 1000.0)
}

/// Sums the `Count` replies: (sent, delivered) per phase.
fn sum_counts(replies: &[Reply]) -> ([u64; PHASES], [u64; PHASES]) {
    let (mut sent, mut delivered) = ([0u64; PHASES], [0u64; PHASES]);
    for r in replies {
        if let Reply::Count {
            sent: s,
            delivered: d,
            ..
        } = r
        {
            for p in 0..PHASES {
                sent[p] += s[p];
                delivered[p] += d[p];
            }
        }
    }
    (sent, delivered)
}

/// Sums the `Count` replies' repeated deliveries of `phase`.
fn sum_repeated(replies: &[Reply], phase: usize) -> u64 {
    replies
        .iter()
        .map(|r| match r {
            Reply::Count { repeated, .. } => repeated[phase],
            _ => 0,
        })
        .sum()
}

/// Sums the `Phase` replies: (issued, drops, longest seconds).
fn sum_phase(replies: &[Reply]) -> (u64, u64, f64) {
    let (mut issued, mut drops, mut secs) = (0, 0, 0.0f64);
    for r in replies {
        if let Reply::Phase {
            issued: i,
            drops: d,
            secs: s,
        } = r
        {
            issued += i;
            drops += d;
            secs = secs.max(*s);
        }
    }
    (issued, drops, secs)
}

/// Waits until the deliveries of `phase` over all workers reach `expected` or stop
/// progressing for 2 s (lost presences never arrive), at most `max`.
async fn drain(
    workers: &mut Workers,
    phase: usize,
    expected: u64,
    max: Duration,
) -> Result<(), String> {
    let until = Instant::now() + max;
    let mut last = u64::MAX;
    let mut last_change = Instant::now();
    while Instant::now() < until {
        let (_, delivered) = sum_counts(&workers.all(Cmd::Count).await?);
        let d = delivered[phase];
        if d >= expected {
            break;
        }
        if d != last {
            last = d;
            last_change = Instant::now();
        } else if last_change.elapsed() > Duration::from_secs(2) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// CPU seconds per 1,000 operations over a phase: the server's, its stores' (None when no
/// store is watched) and both together, the figure compared with in-process servers.
fn cpu_per_1000(
    server: f64,
    stores: &StoreProbe,
    before: &procfs::CpuByPid,
    after: &procfs::CpuByPid,
    ops: u64,
) -> [Option<f64>; 3] {
    let store = cpu_between(before, after);
    let per_1000 = |cpu: f64| Some(cpu / ops as f64 * 1000.0);
    [
        per_1000(server),
        per_1000(store).filter(|_| stores.enabled()),
        per_1000(server + store),
    ]
}

async fn timed_run(
    cli: &Arc<Cli>,
    target: &Target,
    graph: &Arc<ContactGraph>,
) -> Result<Report, String> {
    let probe = ServerProbe::new(cli.server_pids.clone())?;
    let stores = cli.store_probe();
    let k = u64::from(graph.k());
    let mut rep = Report {
        label: cli
            .label
            .clone()
            .unwrap_or_else(|| format!("{:?}", cli.server).to_lowercase()),
        target: cli.target.to_string(),
        users: cli.users,
        contacts: cli.contacts,
        login_rate_offered: cli.login_rate,
        login_concurrency: cli.login_concurrency,
        fixed_rate: cli.fixed_rate,
        sat_window: cli.sat_window,
        procs: cli.procs,
        ..Report::default()
    };
    let mut workers = if cli.procs > 1 {
        let args: Vec<String> = std::env::args().skip(1).collect();
        Workers::spawn(cli.procs, &args)?
    } else {
        Workers::Local(Box::new(Worker::new(
            cli.clone(),
            target.clone(),
            graph.clone(),
            0,
            1,
        )))
    };
    let p = workers.len() as u32;

    // --- logins ---
    let s0 = probe.sample();
    let alloc0 = match &cli.admin_socket {
        Some(path) => rest::allocator_bytes(path).await,
        None => None,
    };
    let store_rss0 = stores.fixed_rss_kb();
    let pg_private0 = stores.pg_private_kb().await;
    let st0 = stores.sample().await;
    let login_hist = Histogram::default();
    eprintln!("logging in {} sessions from {p} process(es)...", cli.users);
    let (mut start_ns, mut last_ns) = (u64::MAX, 0u64);
    for r in workers.all(Cmd::Login).await? {
        if let Reply::Logins {
            ok,
            failed,
            start_ns: s,
            last_ns: l,
            rosters_complete,
            hist,
            negotiated,
        } = r
        {
            for n in negotiated {
                if !rep.negotiated.contains(&n) {
                    rep.negotiated.push(n);
                }
            }
            rep.logins_ok += ok;
            rep.logins_failed += failed;
            rep.rosters_complete += rosters_complete;
            start_ns = start_ns.min(s);
            last_ns = last_ns.max(l);
            login_hist.merge(&hist);
        }
    }
    // First attempt in any process to the last completion in any (same machine's clock).
    let span = Duration::from_nanos(last_ns.saturating_sub(start_ns));
    if rep.logins_ok > 0 && span.as_secs_f64() > 0.0 {
        rep.login_rate = Some(rep.logins_ok as f64 / span.as_secs_f64());
    }
    rep.login_p50_ms = ms(login_hist.quantile(0.5));
    rep.login_p99_ms = ms(login_hist.quantile(0.99));
    rep.login_max_ms = ms((login_hist.count() > 0).then(|| login_hist.max()));
    eprintln!(
        "logins: {} ok, {} failed in {:.2} s; waiting for presence to settle",
        rep.logins_ok,
        rep.logins_failed,
        span.as_secs_f64()
    );
    workers
        .all(Cmd::Settle {
            secs: cli.settle_secs,
        })
        .await?;
    // CPU is read as soon as the storm is over: an idle Erlang VM spins its schedulers, so
    // waiting longer would charge idle spinning to the logins.
    let s1 = probe.sample();
    let st1 = stores.sample().await;
    let settled = workers
        .all(Cmd::Quiet {
            ms: 500,
            max_secs: cli.settle_secs,
        })
        .await?;
    rep.sessions_all_contacts_seen = settled
        .iter()
        .map(|r| match r {
            Reply::Settled { seen } => *seen,
            _ => 0,
        })
        .sum();
    tokio::time::sleep(Duration::from_secs(cli.idle_secs)).await;
    let s_idle = probe.sample();
    // Where the RSS growth sits in the allocator: live bytes, the rest of the pages that
    // hold them, pages kept with nothing live, bookkeeping (presenced's admin socket).
    if let (Some(a0), Some(u), true) = (alloc0, &cli.admin_socket, rep.logins_ok > 0) {
        if let Some(a1) = rest::allocator_bytes(u).await {
            let per = |i: usize| Some((a1[i] - a0[i]) / 1024.0 / rep.logins_ok as f64);
            rep.alloc_allocated_kb_per_session = per(0);
            rep.alloc_active_kb_per_session = per(1);
            rep.alloc_resident_kb_per_session = per(2);
            rep.alloc_metadata_kb_per_session = per(3);
        }
    }
    if probe.enabled() && rep.logins_ok > 0 {
        rep.rss_kb_idle_0 = Some(s0.rss_kb);
        rep.rss_kb_idle_n = Some(s_idle.rss_kb);
        rep.rss_kb_per_session =
            Some((s_idle.rss_kb as f64 - s0.rss_kb as f64) / rep.logins_ok as f64);
        // The server's own Redis holds each session's liveness keys: memory per session too.
        let store_rss = stores.fixed_rss_kb() as f64 - store_rss0 as f64;
        rep.total_rss_kb_per_session = rep
            .rss_kb_per_session
            .map(|server| server + store_rss / rep.logins_ok as f64);
        // Its PostgreSQL backends' private memory too (their shared buffers are the
        // database's, not the sessions').
        if let (Some(p0), Some(p1)) = (pg_private0, stores.pg_private_kb().await) {
            rep.pg_private_kb_per_session = Some((p1 as f64 - p0 as f64) / rep.logins_ok as f64);
            rep.all_rss_kb_per_session = rep
                .total_rss_kb_per_session
                .zip(rep.pg_private_kb_per_session)
                .map(|(t, pg)| t + pg);
        }
        [
            rep.cpu_s_per_1000_logins,
            rep.store_cpu_s_per_1000_logins,
            rep.total_cpu_s_per_1000_logins,
        ] = cpu_per_1000(
            s1.cpu_secs - s0.cpu_secs,
            &stores,
            &st0,
            &st1,
            rep.logins_ok,
        );
    }

    // --- at rest: the sessions sit idle for --rest-secs ---
    // Every server gets this window, whether or not it has write counters to read (the
    // peers have none): the load phases then start at the same offset after the login
    // storm for every server, so a server's background work after logins (an idle VM's
    // garbage collection, a store's flush) falls on the same part of the timeline.
    let sources = rest::Sources {
        metrics_url: cli.metrics_url.clone(),
        redis_url: cli.redis_stats.clone(),
        pg: cli.pg_stats.clone().map(|u| (u, cli.pg_stats_db.clone())),
    };
    let any_source =
        sources.metrics_url.is_some() || sources.redis_url.is_some() || sources.pg.is_some();
    let mut rest_redis = None;
    if cli.rest_secs > 0 && rep.logins_ok > 0 {
        eprintln!(
            "at rest: {} idle sessions for {} s",
            rep.logins_ok, cli.rest_secs
        );
        let a = if any_source {
            Some(rest::read(&sources).await)
        } else {
            None
        };
        let redis0 = redis_totals(cli).await;
        let t = Instant::now();
        // PostgreSQL is watched over the window (its counters publish late; see rest.rs).
        let window = Duration::from_secs(cli.rest_secs);
        let pg = sources.pg.clone().map(|(url, db)| {
            tokio::spawn(async move {
                rest::pg_watch(&url, &db, window, Duration::from_millis(500)).await
            })
        });
        tokio::time::sleep(window).await;
        let pg = match pg {
            Some(task) => match task.await {
                Ok(Ok(seen)) => Some(seen),
                Ok(Err(e)) => {
                    eprintln!("warning: postgres: {e}");
                    None
                }
                Err(e) => {
                    eprintln!("warning: postgres watcher: {e}");
                    None
                }
            },
            None => None,
        };
        let secs = t.elapsed().as_secs_f64();
        rest_redis = redis0
            .zip(redis_totals(cli).await)
            .map(|(a, b)| (a, b, secs));
        rep.rest_secs = secs;
        if let Some(a) = a {
            let b = rest::read(&sources).await;
            rep.rest = rest::rates(&a, &b, pg.as_ref(), rep.logins_ok, secs);
        }
    }

    if rep.logins_ok == 0 {
        collect_stats(&mut workers, &mut rep).await?;
        return Ok(rep);
    }
    if cli.csi {
        csi_phases(cli, &mut workers, &mut rep, k).await?;
        collect_stats(&mut workers, &mut rep).await?;
        workers.all(Cmd::Close).await?;
        workers.finish().await;
        return Ok(rep);
    }

    // --- fixed offered load: latency ---
    eprintln!(
        "fixed load: {} changes/s for {} s",
        cli.fixed_rate, cli.fixed_secs
    );
    let fixed_redis0 = redis_totals(cli).await;
    let fixed_t0 = Instant::now();
    let (_, drops0, secs) = sum_phase(
        &workers
            .all(Cmd::Fixed {
                rate: worker::share(cli.fixed_rate, p),
                secs: cli.fixed_secs,
                phase: FIXED_PHASE as u8,
            })
            .await?,
    );
    rep.fixed_secs = secs;
    let (sent, _) = sum_counts(&workers.all(Cmd::Count).await?);
    drain(
        &mut workers,
        FIXED_PHASE,
        sent[FIXED_PHASE] * k,
        Duration::from_secs(cli.drain_secs),
    )
    .await?;
    let (sent, delivered) = sum_counts(&workers.all(Cmd::Count).await?);
    rep.fixed_sent = sent[FIXED_PHASE];
    rep.fixed_delivered = delivered[FIXED_PHASE];
    if let (Some((r0, r1, rest_secs)), Some(f0), Some(f1)) =
        (&rest_redis, &fixed_redis0, redis_totals(cli).await)
    {
        rep.fixed_redis = rest::per_change(
            (r0, r1, *rest_secs),
            (f0, &f1, fixed_t0.elapsed().as_secs_f64()),
            rep.fixed_sent,
        );
    }

    // --- saturation: as many changes as a window of in-flight deliveries allows ---
    let mut drops1 = 0;
    if cli.sat_secs > 0 {
        eprintln!(
            "saturation: window {} deliveries for {} s",
            cli.sat_window, cli.sat_secs
        );
        let c0 = probe.sample();
        let sc0 = stores.sample().await;
        let (issued, d1, elapsed) = sum_phase(
            &workers
                .all(Cmd::Sat {
                    window: (cli.sat_window / u64::from(p)).max(k),
                    secs: cli.sat_secs,
                })
                .await?,
        );
        drops1 = d1;
        let (_, delivered) = sum_counts(&workers.all(Cmd::Count).await?);
        let c1 = probe.sample();
        let sc1 = stores.sample().await;
        let delivered = delivered[SAT_PHASE];
        rep.sat_secs = elapsed;
        rep.sat_delivered = delivered;
        rep.sat_deliveries_per_s = Some(delivered as f64 / elapsed);
        if probe.enabled() && delivered > 0 {
            [
                rep.cpu_s_per_1000_deliveries,
                rep.store_cpu_s_per_1000_deliveries,
                rep.total_cpu_s_per_1000_deliveries,
            ] = cpu_per_1000(c1.cpu_secs - c0.cpu_secs, &stores, &sc0, &sc1, delivered);
        }
        drain(
            &mut workers,
            SAT_PHASE,
            issued * k,
            Duration::from_secs(cli.drain_secs),
        )
        .await?;
        // Every delivery accounted for: each change is owed to the sender's K watchers.
        let counts = workers.all(Cmd::Count).await?;
        let (sent, delivered) = sum_counts(&counts);
        rep.sat_sent = sent[SAT_PHASE];
        rep.sat_expected = sent[SAT_PHASE] * k;
        rep.sat_received = delivered[SAT_PHASE];
        rep.sat_repeated = sum_repeated(&counts, SAT_PHASE);
        rep.sat_missing = rep
            .sat_expected
            .saturating_sub(rep.sat_received - rep.sat_repeated.min(rep.sat_received));
    }
    let drops2 = latency_ladder(cli, &mut workers, &mut rep, k).await?;
    rep.client_backlog_drops = drops0 + drops1 + drops2;
    if let Some(pid) = cli.kill_pid {
        rep.kill = kill_phase(cli, &mut workers, target, graph, pid).await?;
    }
    collect_stats(&mut workers, &mut rep).await?;
    workers.all(Cmd::Close).await?;
    workers.finish().await;
    Ok(rep)
}

/// The latency ladder (--fixed-rates or --fixed-fractions): one open-loop phase per rate,
/// lowest first, each drained before the next so that its deliveries are its own. A rate
/// the server did not sustain (a delivery still missing after the drain, or a change the
/// client could not even queue) ends the ladder: its backlog would still be draining
/// into the next phase and charge that rate's latency with this one's queue. Returns the
/// client-side drops.
async fn latency_ladder(
    cli: &Cli,
    workers: &mut Workers,
    rep: &mut Report,
    k: u64,
) -> Result<u64, String> {
    let p = workers.len() as u32;
    let mut all_drops = 0;
    for (i, (rate, fraction)) in cli.ladder().into_iter().enumerate() {
        let phase = LADDER_PHASE + i;
        eprintln!(
            "latency ladder: {rate:.1} changes/s ({:.0} deliveries/s) for {} s",
            rate * k as f64,
            cli.ladder_secs
        );
        let (_, drops, secs) = sum_phase(
            &workers
                .all(Cmd::Fixed {
                    rate: worker::share(rate, p),
                    secs: cli.ladder_secs,
                    phase: phase as u8,
                })
                .await?,
        );
        let (sent, _) = sum_counts(&workers.all(Cmd::Count).await?);
        drain(
            workers,
            phase,
            sent[phase] * k,
            Duration::from_secs(cli.drain_secs),
        )
        .await?;
        let (sent, delivered) = sum_counts(&workers.all(Cmd::Count).await?);
        let point = report::LadderPoint {
            rate,
            fraction,
            of_deliveries_per_s: cli.fractions_of.filter(|_| fraction.is_some()),
            secs,
            sent: sent[phase],
            delivered: delivered[phase],
            drops,
            ..Default::default()
        };
        all_drops += drops;
        let sustained = point.sustained(k);
        rep.ladder.push(point);
        if !sustained {
            eprintln!(
                "latency ladder: not sustained at {rate:.1} changes/s; higher rates not offered"
            );
            break;
        }
    }
    Ok(all_drops)
}

/// `--redis-stats`' totals now, or None (no source, or it failed: said on stderr).
async fn redis_totals(cli: &Cli) -> Option<rest::RedisTotals> {
    let url = cli.redis_stats.as_ref()?;
    rest::redis_totals(url)
        .await
        .map_err(|e| eprintln!("warning: redis: {e}"))
        .ok()
}

/// The kill phase: SIGKILL of node `pid` (address index `--kill-target`), then, every two
/// seconds until every one of its sessions was announced to all of its watchers on the
/// other nodes or `--kill-wait` passed, the unavailable presences the watchers received.
/// A session's announcement time is the kill to the arrival at its last watcher.
async fn kill_phase(
    cli: &Cli,
    workers: &mut Workers,
    target: &Target,
    graph: &ContactGraph,
    pid: u32,
) -> Result<report::KillFigures, String> {
    let nodes = target.addrs.len().max(1);
    let on_killed = |i: u32| i as usize % nodes == cli.kill_target;
    let dead: std::collections::HashSet<String> = (0..cli.users)
        .filter(|&i| on_killed(i))
        .map(|i| target.bare(i))
        .collect();
    let watchers_expected: u64 = (0..cli.users)
        .filter(|&i| on_killed(i))
        .map(|i| graph.contacts(i).iter().filter(|&&c| !on_killed(c)).count() as u64)
        .sum();
    eprintln!(
        "kill: SIGKILL of pid {pid} ({} sessions, {watchers_expected} watchers elsewhere)",
        dead.len()
    );
    let killed_ns = session::now_ns();
    let status = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .map_err(|e| format!("kill: {e}"))?;
    if !status.success() {
        return Err(format!("kill -KILL {pid}: {status}"));
    }
    let started = Instant::now();
    let mut last: std::collections::HashMap<String, (u64, u64)> = Default::default();
    let mut repeated_total;
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        last.clear();
        repeated_total = 0;
        for r in workers.all(Cmd::Unavailables).await? {
            if let Reply::Unavailables { seen, repeated } = r {
                repeated_total += repeated;
                for (jid, n, ns) in seen {
                    if dead.contains(&jid) && ns >= killed_ns {
                        let e = last.entry(jid).or_default();
                        e.0 += u64::from(n);
                        e.1 = e.1.max(ns);
                    }
                }
            }
        }
        let reached: u64 = last.values().map(|v| v.0).sum();
        if (last.len() == dead.len() && reached >= watchers_expected)
            || started.elapsed() > Duration::from_secs(cli.kill_wait)
        {
            break;
        }
    }
    let mut times: Vec<f64> = last
        .values()
        .map(|&(_, ns)| (ns - killed_ns) as f64 / 1e6)
        .collect();
    times.sort_by(f64::total_cmp);
    let q = |p: f64| {
        (!times.is_empty()).then(|| times[((times.len() - 1) as f64 * p).round() as usize])
    };
    Ok(report::KillFigures {
        sessions: dead.len() as u64,
        announced: times.len() as u64,
        watchers_expected,
        watchers_reached: last.values().map(|v| v.0).sum(),
        repeated: repeated_total,
        min_ms: q(0.0),
        p50_ms: q(0.5),
        p99_ms: q(0.99),
        max_ms: q(1.0),
        within_bound: times
            .iter()
            .filter(|&&t| t <= cli.kill_bound_secs * 1000.0)
            .count() as u64,
        bound_secs: cli.kill_bound_secs,
    })
}

/// Sums the `CsiCount` replies: (inactive group, active group, their sizes, the most one
/// inactive client received).
fn sum_csi(replies: &[Reply]) -> [u64; 5] {
    let mut t = [0u64; 5];
    for r in replies {
        if let Reply::CsiCount {
            inactive,
            active,
            inactive_clients,
            active_clients,
            inactive_max,
        } = r
        {
            t[0] += inactive;
            t[1] += active;
            t[2] += inactive_clients;
            t[3] += active_clients;
            t[4] = t[4].max(*inactive_max);
        }
    }
    t
}

/// Presences per client: `total / clients` (0 without clients).
fn per(total: u64, clients: u64) -> f64 {
    if clients == 0 {
        0.0
    } else {
        total as f64 / clients as f64
    }
}

/// One window of changes from the active group at --fixed-rate, then the drain: until the
/// expected deliveries arrived (`expected`, baseline) or none came for 2 s. Returns the
/// `CsiCount` sums over the window and the window's length.
async fn csi_window(
    cli: &Cli,
    workers: &mut Workers,
    expected: Option<u64>,
) -> Result<([u64; 5], f64), String> {
    let p = workers.len() as u32;
    sum_csi(&workers.all(Cmd::CsiCount).await?); // resets the marks
    let (sent_before, _) = sum_counts(&workers.all(Cmd::Count).await?);
    let (_, _, secs) = sum_phase(
        &workers
            .all(Cmd::CsiWindow {
                rate: worker::share(cli.fixed_rate, p),
                secs: cli.csi_secs,
            })
            .await?,
    );
    let want = match expected {
        Some(k) => {
            let (sent, delivered) = sum_counts(&workers.all(Cmd::Count).await?);
            delivered[0] + (sent[0] - sent_before[0]) * k
        }
        None => u64::MAX,
    };
    drain(workers, 0, want, Duration::from_secs(cli.drain_secs)).await?;
    Ok((sum_csi(&workers.all(Cmd::CsiCount).await?), secs))
}

/// The client state indication phases (see `--csi`).
async fn csi_phases(
    cli: &Cli,
    workers: &mut Workers,
    rep: &mut Report,
    k: u64,
) -> Result<(), String> {
    rep.csi.secs = cli.csi_secs as f64;
    rep.csi.rate = cli.fixed_rate;
    eprintln!(
        "csi baseline: every client active, {} changes/s from the odd users for {} s",
        cli.fixed_rate, cli.csi_secs
    );
    // The baseline drain waits for all K deliveries of every change: everyone is active.
    let (b, secs) = csi_window(cli, workers, Some(k)).await?;
    rep.csi.baseline_per_client = Some(per(b[0], b[2]));
    rep.csi.baseline_active_per_client = Some(per(b[1], b[3]));
    rep.csi.baseline_deliveries_per_s = Some((b[0] + b[1]) as f64 / secs.max(1e-9));
    let mut variants = vec![0];
    if cli.csi_interest > 0 {
        variants.push(cli.csi_interest);
    }
    for interest in variants {
        let mut w = report::CsiWindow {
            interest_items: interest,
            ..report::CsiWindow::default()
        };
        eprintln!(
            "csi: even users inactive{}; {} changes/s from the odd users for {} s",
            if interest > 0 {
                format!(" with interest lists of {interest} contacts")
            } else {
                String::new()
            },
            cli.fixed_rate,
            cli.csi_secs
        );
        for r in workers
            .all(Cmd::CsiState {
                active: false,
                interest,
            })
            .await?
        {
            if let Reply::CsiStateDone { ok, refused, .. } = r {
                w.interest_ok += ok;
                w.interest_refused += refused;
            }
        }
        let (c, secs) = csi_window(cli, workers, None).await?;
        w.per_inactive_client = per(c[0], c[2]);
        w.max_inactive_client = c[4];
        w.per_active_client = per(c[1], c[3]);
        w.deliveries_per_s = (c[0] + c[1]) as f64 / secs.max(1e-9);
        w.reduction_pct = rep
            .csi
            .baseline_per_client
            .filter(|b| *b > 0.0)
            .map(|b| 100.0 * (1.0 - w.per_inactive_client / b));
        // <active/>: what was held comes now; then the check once nothing more arrives.
        workers
            .all(Cmd::CsiState {
                active: true,
                interest: 0,
            })
            .await?;
        workers
            .all(Cmd::Quiet {
                ms: 1000,
                max_secs: cli.drain_secs,
            })
            .await?;
        let f = sum_csi(&workers.all(Cmd::CsiCount).await?);
        w.flushed_per_inactive_client = per(f[0], f[2]);
        for r in workers.all(Cmd::CsiCheck).await? {
            if let Reply::CsiCheck { checked, lost } = r {
                w.checked += checked;
                w.lost += lost;
            }
        }
        eprintln!(
            "csi: per inactive client {:.2} (all active {:.2}), {} of {} latest presences missing after <active/>",
            w.per_inactive_client,
            rep.csi.baseline_per_client.unwrap_or(0.0),
            w.lost,
            w.checked
        );
        if interest == 0 {
            rep.csi.inactive = w;
        } else {
            rep.csi.interest = Some(w);
        }
    }
    Ok(())
}

/// Merges the workers' latency histograms, lost sessions and errors into the report.
async fn collect_stats(workers: &mut Workers, rep: &mut Report) -> Result<(), String> {
    let lat: [Histogram; PHASES] = Default::default();
    for r in workers.all(Cmd::Stats).await? {
        if let Reply::Stats {
            lat: l,
            lost,
            errors,
        } = r
        {
            for (a, b) in lat.iter().zip(&l) {
                a.merge(b);
            }
            rep.sessions_lost += lost;
            for e in errors {
                if rep.errors.len() < 10 && !rep.errors.contains(&e) {
                    rep.errors.push(e);
                }
            }
        }
    }
    let fixed = &lat[FIXED_PHASE];
    rep.fixed_p50_ms = ms(fixed.quantile(0.5));
    rep.fixed_p99_ms = ms(fixed.quantile(0.99));
    rep.fixed_max_ms = ms((fixed.count() > 0).then(|| fixed.max()));
    rep.sat_p50_ms = ms(lat[SAT_PHASE].quantile(0.5));
    rep.sat_p99_ms = ms(lat[SAT_PHASE].quantile(0.99));
    for (i, point) in rep.ladder.iter_mut().enumerate() {
        let h = &lat[LADDER_PHASE + i];
        point.p50_ms = ms(h.quantile(0.5));
        point.p99_ms = ms(h.quantile(0.99));
        point.max_ms = ms((h.count() > 0).then(|| h.max()));
    }
    Ok(())
}
