//! Soak and fault runs (`--soak-secs S`): N sessions held for S seconds under continuous
//! churn, for RELIABILITY.md (reliability/soak.sh, reliability/faults.sh).
//!
//! Each user has one task that logs in, runs the session, and logs in again whenever the
//! driver asks it to reconnect or its connection is lost (a refused login is retried every
//! second, each retry on the next `--target`, so clients of a dead cluster node move to a
//! live one). The driver, ten times a second, spends its budgets:
//!
//! * reconnects: `--churn-per-min` of the sessions per minute, a `--drop-fraction` of them by
//!   dropping the TCP connection without closing the stream (the server's grace path), the
//!   rest by a clean stream close;
//! * presence changes (`--soak-presence-rate` per second) by random online users;
//! * chat messages (`--soak-message-rate` per second) from a random online user to a random
//!   contact, online or not (an offline one's are kept by the server, RFC 6121 §8.5.2.2);
//! * probes (`--probe-rate` per second): a presence change whose watchers are counted per
//!   change, so a fault run can tell from when on every online watcher sees changes again.
//!
//! Every `--sample-secs` one JSON line of the client-side counters goes to `--soak-log`.
//! At the end the load stops, the run waits until nothing arrives for 3 s (at most
//! `--drain-secs`), writes the final counters and closes every session cleanly.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, Semaphore};

use crate::graph::ContactGraph;
use crate::session::{self, Command, Mode, Shared, Target, PROBE_PHASE};

/// What one soak run does.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Seconds of load after every user's first login.
    pub secs: u64,
    /// Fraction of the sessions reconnecting per minute.
    pub churn_per_min: f64,
    /// Fraction of the reconnects made by dropping the connection.
    pub drop_fraction: f64,
    /// Presence changes per second.
    pub presence_rate: f64,
    /// Chat messages per second.
    pub message_rate: f64,
    /// Probes per second.
    pub probe_rate: f64,
    /// Seconds between counter lines.
    pub sample_secs: u64,
    /// Where the counter lines go (stdout when absent).
    pub log: Option<PathBuf>,
    /// Logins in flight at most.
    pub login_concurrency: u32,
    /// One login attempt's time limit.
    pub login_timeout: Duration,
    /// Longest wait for the last deliveries after the load stops.
    pub drain_secs: u64,
    /// Source addresses to spread connections over.
    pub source_addrs: u32,
}

/// A driver's order to one user's task.
enum UserCmd {
    Send(Command),
    Reconnect { drop: bool },
    Close,
}

/// Counters of the user tasks (the sessions' own are in [`Shared`]).
#[derive(Default)]
struct Counts {
    logins: AtomicU64,
    login_failures: AtomicU64,
    reconnects: AtomicU64,
    online: AtomicU64,
    commands_skipped: AtomicU64,
}

/// One probe: when it was sent and how many of the sender's contacts were online then.
struct Probe {
    seq: u64,
    sent_at: f64,
    expected: u32,
}

/// Runs the soak and returns whether every session was logged in at the end.
pub async fn run(plan: Plan, target: Target, graph: Arc<ContactGraph>) -> Result<bool, String> {
    let n = graph.len();
    let k = graph.k() as usize;
    let shared = Arc::new(Shared::default());
    let counts = Arc::new(Counts::default());
    let online: Arc<Vec<AtomicBool>> = Arc::new((0..n).map(|_| AtomicBool::new(false)).collect());
    let sem = Arc::new(Semaphore::new(plan.login_concurrency.max(1) as usize));
    let mut users = Vec::with_capacity(n as usize);
    let mut handles = Vec::with_capacity(n as usize);
    let started = Instant::now();
    for i in 0..n {
        let (tx, rx) = mpsc::channel(64);
        users.push(tx);
        let u = UserTask {
            i,
            target: target.clone(),
            k,
            shared: shared.clone(),
            counts: counts.clone(),
            online: online.clone(),
            sem: sem.clone(),
            login_timeout: plan.login_timeout,
            source: session::source_addr(i, plan.source_addrs),
        };
        handles.push(tokio::spawn(u.run(rx)));
    }
    let mut log: Box<dyn tokio::io::AsyncWrite + Unpin + Send> = match &plan.log {
        Some(p) => Box::new(
            tokio::fs::File::create(p)
                .await
                .map_err(|e| format!("{}: {e}", p.display()))?,
        ),
        None => Box::new(tokio::io::stdout()),
    };
    // First logins: wait until all are in (bounded by the login timeout per user).
    let login_limit = Duration::from_secs(60) + plan.login_timeout * (n / 100 + 1);
    while counts.online.load(Ordering::Relaxed) < u64::from(n) && started.elapsed() < login_limit {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let first_logins = started.elapsed().as_secs_f64();
    eprintln!(
        "soak: {} of {n} sessions online after {first_logins:.1} s",
        counts.online.load(Ordering::Relaxed)
    );
    let t0 = Instant::now();
    let line =
        |kind: &str, t: f64, probes: &[Probe]| counter_line(kind, t, &counts, &shared, probes);
    write_line(&mut log, &line("start", 0.0, &[])).await?;

    let mut rng = StdRng::from_entropy();
    let tick = Duration::from_millis(100);
    let per_tick = |rate: f64| rate * tick.as_secs_f64();
    let reconnect_rate = plan.churn_per_min * f64::from(n) / 60.0;
    let mut budget = [0.0f64; 4];
    let (mut seq, mut probe_seq) = (0u64, 0u64);
    let mut probes: Vec<Probe> = Vec::new();
    let mut next_sample = Duration::from_secs(plan.sample_secs.max(1));
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let pick_online = |rng: &mut StdRng| -> Option<u32> {
        (0..20)
            .map(|_| rng.gen_range(0..n))
            .find(|&u| online[u as usize].load(Ordering::Relaxed))
    };
    while t0.elapsed() < Duration::from_secs(plan.secs) {
        interval.tick().await;
        budget[0] += per_tick(reconnect_rate);
        budget[1] += per_tick(plan.presence_rate);
        budget[2] += per_tick(plan.message_rate);
        budget[3] += per_tick(plan.probe_rate);
        while budget[0] >= 1.0 {
            budget[0] -= 1.0;
            if let Some(u) = pick_online(&mut rng) {
                let drop = rng.gen_bool(plan.drop_fraction.clamp(0.0, 1.0));
                send(&users[u as usize], UserCmd::Reconnect { drop }, &counts);
            }
        }
        while budget[1] >= 1.0 {
            budget[1] -= 1.0;
            if let Some(u) = pick_online(&mut rng) {
                seq += 1;
                send(
                    &users[u as usize],
                    UserCmd::Send(Command::Presence { phase: 0, seq }),
                    &counts,
                );
            }
        }
        while budget[2] >= 1.0 {
            budget[2] -= 1.0;
            if let Some(u) = pick_online(&mut rng) {
                let contacts = graph.contacts(u);
                let to = contacts[rng.gen_range(0..contacts.len())];
                seq += 1;
                let cmd = Command::Message {
                    to: target.bare(to),
                    seq,
                };
                send(&users[u as usize], UserCmd::Send(cmd), &counts);
            }
        }
        while budget[3] >= 1.0 {
            budget[3] -= 1.0;
            if let Some(u) = pick_online(&mut rng) {
                probe_seq += 1;
                let expected = graph
                    .contacts(u)
                    .iter()
                    .filter(|&&c| online[c as usize].load(Ordering::Relaxed))
                    .count() as u32;
                probes.push(Probe {
                    seq: probe_seq,
                    sent_at: t0.elapsed().as_secs_f64(),
                    expected,
                });
                let cmd = Command::Presence {
                    phase: PROBE_PHASE as u8,
                    seq: probe_seq,
                };
                send(&users[u as usize], UserCmd::Send(cmd), &counts);
            }
        }
        if t0.elapsed() >= next_sample {
            next_sample += Duration::from_secs(plan.sample_secs.max(1));
            write_line(
                &mut log,
                &line("sample", t0.elapsed().as_secs_f64(), &probes),
            )
            .await?;
        }
    }
    // Drain: nothing more is sent; wait until nothing arrives for 3 s.
    let load_end = t0.elapsed().as_secs_f64();
    crate::wait_quiet(
        &shared,
        Duration::from_secs(3),
        Duration::from_secs(plan.drain_secs),
    )
    .await;
    let all_online = counts.online.load(Ordering::Relaxed) == u64::from(n);
    write_line(&mut log, &line("end", load_end, &probes)).await?;
    for u in &users {
        let _ = u.send(UserCmd::Close).await;
    }
    for h in handles {
        let _ = tokio::time::timeout(Duration::from_secs(10), h).await;
    }
    write_line(
        &mut log,
        &line("closed", t0.elapsed().as_secs_f64(), &probes),
    )
    .await?;
    log.flush().await.map_err(|e| format!("log: {e}"))?;
    Ok(all_online)
}

/// Hands a command to a user's task; a full queue (the task is busy logging in) skips it.
fn send(tx: &mpsc::Sender<UserCmd>, cmd: UserCmd, counts: &Counts) {
    if tx.try_send(cmd).is_err() {
        counts.commands_skipped.fetch_add(1, Ordering::Relaxed);
    }
}

async fn write_line(
    log: &mut (dyn tokio::io::AsyncWrite + Unpin + Send),
    line: &str,
) -> Result<(), String> {
    log.write_all(format!("{line}\n").as_bytes())
        .await
        .map_err(|e| format!("log: {e}"))?;
    log.flush().await.map_err(|e| format!("log: {e}"))
}

/// One JSON line of counters. `probes_complete_since`: the send time of the earliest probe
/// from which on every probe (sent at least 5 s ago) reached all the watchers online when it
/// was sent; `probes_incomplete`: probes that did not, with their send times (first 20).
fn counter_line(kind: &str, t: f64, c: &Counts, s: &Shared, probes: &[Probe]) -> String {
    let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let hits = s.probe_hits.lock().map(|h| h.clone()).unwrap_or_default();
    let settled: Vec<&Probe> = probes.iter().filter(|p| p.sent_at + 5.0 <= t).collect();
    let incomplete: Vec<&&Probe> = settled
        .iter()
        .filter(|p| hits.get(&p.seq).copied().unwrap_or(0) < p.expected)
        .collect();
    let complete_since = match incomplete.last() {
        Some(last) => settled
            .iter()
            .find(|p| p.sent_at > last.sent_at)
            .map(|p| format!("{:.1}", p.sent_at))
            .unwrap_or_else(|| "null".into()),
        None => settled
            .first()
            .map(|p| format!("{:.1}", p.sent_at))
            .unwrap_or_else(|| "null".into()),
    };
    let incomplete_at: Vec<String> = incomplete
        .iter()
        .take(20)
        .map(|p| {
            format!(
                "[{:.1},{},{}]",
                p.sent_at,
                hits.get(&p.seq).copied().unwrap_or(0),
                p.expected
            )
        })
        .collect();
    let m = &s.messages;
    let errors = s
        .errors
        .lock()
        .map(|e| {
            e.iter()
                .map(|x| format!("\"{}\"", x.replace('\\', "\\\\").replace('"', "'")))
                .collect::<Vec<_>>()
                .join(",")
        })
        .unwrap_or_default();
    format!(
        "{{\"kind\":\"{kind}\",\"t\":{t:.1},\"unix\":{},\"online\":{},\"logins\":{},\
         \"login_failures\":{},\"reconnects\":{},\"sessions_lost\":{},\"skipped\":{},\
         \"presence_sent\":{},\"presence_delivered\":{},\"msg_sent\":{},\"msg_received\":{},\
         \"msg_delayed\":{},\"msg_bounced\":{},\"probes\":{},\"probes_incomplete\":{},\
         \"probes_complete_since\":{complete_since},\"incomplete\":[{}],\"errors\":[{errors}]}}",
        session::now_ns() / 1_000_000_000,
        l(&c.online),
        l(&c.logins),
        l(&c.login_failures),
        l(&c.reconnects),
        l(&s.sessions_lost),
        l(&c.commands_skipped),
        l(&s.phases[0].sent),
        l(&s.phases[0].delivered),
        l(&m.sent),
        l(&m.received),
        l(&m.delayed),
        l(&m.bounced),
        settled.len(),
        incomplete.len(),
        incomplete_at.join(","),
    )
}

/// One user's task: log in, run, log in again on request or loss, until Close.
struct UserTask {
    i: u32,
    target: Target,
    k: usize,
    shared: Arc<Shared>,
    counts: Arc<Counts>,
    online: Arc<Vec<AtomicBool>>,
    sem: Arc<Semaphore>,
    login_timeout: Duration,
    source: std::net::IpAddr,
}

impl UserTask {
    async fn run(self, mut rx: mpsc::Receiver<UserCmd>) {
        let mut attempt = 0usize;
        loop {
            let mut t;
            let logged = loop {
                // Every c2s address in turn (the nodes of a cluster): Target::for_user.
                t = self.target.for_user(self.i, attempt);
                let r = {
                    let Ok(_permit) = self.sem.acquire().await else {
                        return;
                    };
                    tokio::time::timeout(
                        self.login_timeout,
                        session::login(&t, self.i, self.source),
                    )
                    .await
                    .unwrap_or_else(|_| Err("login timed out".into()))
                };
                match r {
                    Ok(l) => break l,
                    Err(e) => {
                        self.counts.login_failures.fetch_add(1, Ordering::Relaxed);
                        self.shared.note_error(format!(
                            "login {} at {}: {e}",
                            t.user(self.i),
                            t.addr
                        ));
                        attempt += 1;
                        // Orders that arrive meanwhile are dropped; Close ends the task.
                        let wait = tokio::time::sleep(Duration::from_secs(1));
                        tokio::pin!(wait);
                        loop {
                            tokio::select! {
                                _ = &mut wait => break,
                                cmd = rx.recv() => match cmd {
                                    Some(UserCmd::Close) | None => return,
                                    Some(_) => {}
                                }
                            }
                        }
                    }
                }
            };
            self.counts.logins.fetch_add(1, Ordering::Relaxed);
            self.counts.online.fetch_add(1, Ordering::Relaxed);
            self.online[self.i as usize].store(true, Ordering::Relaxed);
            let (tx, srx) = mpsc::channel(64);
            let mut h = tokio::spawn(session::run(
                logged,
                t.bare(self.i),
                self.k,
                Mode::Soak,
                self.shared.clone(),
                srx,
            ));
            let closing = loop {
                tokio::select! {
                    _ = &mut h => break None, // lost: the session recorded why
                    cmd = rx.recv() => match cmd {
                        Some(UserCmd::Send(c)) => {
                            if tx.try_send(c).is_err() {
                                self.counts.commands_skipped.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        Some(UserCmd::Reconnect { drop }) => break Some(Command::Leave { drop }),
                        Some(UserCmd::Close) | None => break Some(Command::Close),
                    }
                }
            };
            self.online[self.i as usize].store(false, Ordering::Relaxed);
            self.counts.online.fetch_sub(1, Ordering::Relaxed);
            match closing {
                None => attempt += 1,
                Some(Command::Close) => {
                    let _ = tx.send(Command::Leave { drop: false }).await;
                    let _ = h.await;
                    return;
                }
                Some(leave) => {
                    self.counts.reconnects.fetch_add(1, Ordering::Relaxed);
                    let _ = tx.send(leave).await;
                    let _ = h.await;
                }
            }
        }
    }
}
