//! Splitting one timed run across several generator processes (`--procs P`).
//!
//! A process may open at most 20,000 descriptors on the benchmark machine, so ~19k sessions
//! is the most one generator process holds. With `--procs P` the parent process spawns P
//! children of the same binary (`--worker I`), each owning the contiguous slice
//! `I*N/P .. (I+1)*N/P` of the users. The parent alone reads the server's /proc figures and
//! drives the phases: it writes one command line to every child's stdin and waits for one
//! reply line from each before the next step, so every phase starts behind a barrier.
//!
//! The same [`Worker`] also runs in-process when P = 1 (no pipe), so the single-process and
//! the split run go through the same phase code.
//!
//! Merging is exact for counts and histograms: latency is computed at the receiver from the
//! wall-clock send time carried in the stanza, and all processes read the same machine's
//! clock, so a delivery sent by one process and received by another is timed correctly.
//! Contiguous slices keep most contacts of the ring graph inside one process, which matters
//! for the saturation window (see [`Worker::saturate`]).

use std::ops::Range;
use std::process::Stdio;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout};
use tokio::sync::mpsc;

use crate::graph::ContactGraph;
use crate::session::{
    self, Command, CsiState, Mode, Shared, Target, FIXED_PHASE, PHASES, SAT_PHASE,
};
use crate::stats::Histogram;
use crate::Cli;

/// Users owned by worker `index` of `procs`: a contiguous slice, sizes differing by ≤ 1.
pub fn slice(users: u32, index: u32, procs: u32) -> Range<u32> {
    let p = u64::from(procs.max(1));
    let n = u64::from(users);
    let at = |i: u64| (n * i / p) as u32;
    at(u64::from(index))..at(u64::from(index) + 1)
}

/// One worker's share of a total (login concurrency, offered rate) split across `procs`.
pub fn share(total: f64, procs: u32) -> f64 {
    total / f64::from(procs.max(1))
}

/// A step of the timed run, sent from the parent to each worker.
#[derive(Debug, Clone, PartialEq)]
pub enum Cmd {
    /// Log in the worker's users.
    Login,
    /// Wait until the worker's sessions saw all their contacts, at most `secs`.
    Settle { secs: u64 },
    /// Wait until `ms` without any stanza, at most `max_secs`.
    Quiet { ms: u64, max_secs: u64 },
    /// Fixed offered load: `rate` changes/s from this worker for `secs`, counted in
    /// `phase` (the fixed-load phase or one of the latency ladder's).
    Fixed { rate: f64, secs: u64, phase: u8 },
    /// Saturation: `window` deliveries in flight from this worker for `secs`.
    Sat { window: u64, secs: u64 },
    /// Report the phase counters.
    Count,
    /// Report histograms, lost sessions and errors.
    Stats,
    /// Report the unavailable presences received from contacts.
    Unavailables,
    /// Client state indication: the inactive group (even users) sends `<active/>` or, with
    /// `interest` > 0 first an interest list naming that many of its changing contacts,
    /// `<inactive/>`.
    CsiState { active: bool, interest: u32 },
    /// Fixed offered load from the active group (odd users) only: `rate` changes/s for
    /// `secs` (phase 0).
    CsiWindow { rate: f64, secs: u64 },
    /// Presences received per group since the previous `CsiCount`.
    CsiCount,
    /// The nothing-lost check of the inactive group (one process only, see `--csi`).
    CsiCheck,
    /// Close every session.
    Close,
}

/// A worker's answer to one [`Cmd`]. A few replies per run cross the pipe, so the size of
/// the largest variant (one histogram per phase) costs nothing worth a box.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Reply {
    /// After Login: counts, wall-clock start and last completion (ns), histogram.
    Logins {
        ok: u64,
        failed: u64,
        start_ns: u64,
        last_ns: u64,
        rosters_complete: u64,
        hist: Histogram,
        /// Distinct TLS version / cipher suite / SASL mechanism combinations seen.
        negotiated: Vec<String>,
    },
    /// After Settle / Quiet: sessions that have seen all their contacts.
    Settled { seen: u64 },
    /// After Fixed / Sat: changes issued, commands dropped, seconds spent.
    Phase { issued: u64, drops: u64, secs: f64 },
    /// Counters per phase.
    Count {
        sent: [u64; PHASES],
        delivered: [u64; PHASES],
        repeated: [u64; PHASES],
    },
    /// Latency histograms per phase, lost sessions, first errors.
    Stats {
        lat: [Histogram; PHASES],
        lost: u64,
        errors: Vec<String>,
    },
    /// Per contact (bare JID): watchers here that got its unavailable, latest first
    /// arrival (ns); and the unavailables a watcher got again for the same contact.
    Unavailables {
        seen: Vec<(String, u32, u64)>,
        repeated: u64,
    },
    /// After CsiState: interest lists sent, accepted, refused.
    CsiStateDone { sent: u64, ok: u64, refused: u64 },
    /// After CsiCount: presences received by the inactive group and by the active group
    /// since the previous count, the group sizes, and the most one inactive client got.
    CsiCount {
        inactive: u64,
        active: u64,
        inactive_clients: u64,
        active_clients: u64,
        inactive_max: u64,
    },
    /// After CsiCheck: (inactive client, changed contact) pairs checked, and of those the
    /// pairs whose latest presence at the client differs from what the contact last sent.
    CsiCheck { checked: u64, lost: u64 },
    /// After Close.
    Closed,
}

impl Cmd {
    /// One line of the pipe protocol.
    pub fn encode(&self) -> String {
        match self {
            Cmd::Login => "login".into(),
            Cmd::Settle { secs } => format!("settle {secs}"),
            Cmd::Quiet { ms, max_secs } => format!("quiet {ms} {max_secs}"),
            Cmd::Fixed { rate, secs, phase } => format!("fixed {rate} {secs} {phase}"),
            Cmd::Sat { window, secs } => format!("sat {window} {secs}"),
            Cmd::CsiState { active, interest } => {
                format!("csistate {} {interest}", u8::from(*active))
            }
            Cmd::CsiWindow { rate, secs } => format!("csiwindow {rate} {secs}"),
            Cmd::CsiCount => "csicount".into(),
            Cmd::CsiCheck => "csicheck".into(),
            Cmd::Count => "count".into(),
            Cmd::Stats => "stats".into(),
            Cmd::Unavailables => "unavailables".into(),
            Cmd::Close => "close".into(),
        }
    }

    /// Parses [`Cmd::encode`]'s output.
    pub fn decode(line: &str) -> Result<Cmd, String> {
        let w: Vec<&str> = line.split_whitespace().collect();
        let bad = || format!("bad command {line:?}");
        let num = |i: usize| -> Result<u64, String> {
            w.get(i).and_then(|s| s.parse().ok()).ok_or_else(bad)
        };
        Ok(match w.first().copied() {
            Some("login") => Cmd::Login,
            Some("settle") => Cmd::Settle { secs: num(1)? },
            Some("quiet") => Cmd::Quiet {
                ms: num(1)?,
                max_secs: num(2)?,
            },
            Some("fixed") => Cmd::Fixed {
                rate: w.get(1).and_then(|s| s.parse().ok()).ok_or_else(bad)?,
                secs: num(2)?,
                phase: u8::try_from(num(3)?)
                    .ok()
                    .filter(|&p| usize::from(p) < PHASES)
                    .ok_or_else(bad)?,
            },
            Some("sat") => Cmd::Sat {
                window: num(1)?,
                secs: num(2)?,
            },
            Some("csistate") => Cmd::CsiState {
                active: num(1)? == 1,
                interest: u32::try_from(num(2)?).map_err(|_| bad())?,
            },
            Some("csiwindow") => Cmd::CsiWindow {
                rate: w.get(1).and_then(|s| s.parse().ok()).ok_or_else(bad)?,
                secs: num(2)?,
            },
            Some("csicount") => Cmd::CsiCount,
            Some("csicheck") => Cmd::CsiCheck,
            Some("count") => Cmd::Count,
            Some("stats") => Cmd::Stats,
            Some("unavailables") => Cmd::Unavailables,
            Some("close") => Cmd::Close,
            _ => return Err(bad()),
        })
    }
}

/// Errors travel as tab-separated fields: escape what would break the line.
fn esc(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('\t', "\\t")
        .replace('\n', "\\n")
        .replace('\r', "\\r")
}

fn unesc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars();
    while let Some(c) = it.next() {
        if c == '\\' {
            match it.next() {
                Some('t') => out.push('\t'),
                Some('n') => out.push('\n'),
                Some('r') => out.push('\r'),
                Some(o) => out.push(o),
                None => {}
            }
        } else {
            out.push(c);
        }
    }
    out
}

impl Reply {
    /// One line of the pipe protocol (fields separated by tabs).
    pub fn encode(&self) -> String {
        match self {
            Reply::Logins {
                ok,
                failed,
                start_ns,
                last_ns,
                rosters_complete,
                hist,
                negotiated,
            } => {
                let mut s = format!(
                    "logins\t{ok}\t{failed}\t{start_ns}\t{last_ns}\t{rosters_complete}\t{}",
                    hist.encode()
                );
                for n in negotiated {
                    s.push('\t');
                    s.push_str(&esc(n));
                }
                s
            }
            Reply::Settled { seen } => format!("settled\t{seen}"),
            Reply::Phase {
                issued,
                drops,
                secs,
            } => format!("phase\t{issued}\t{drops}\t{secs}"),
            Reply::Count {
                sent,
                delivered,
                repeated,
            } => {
                let mut s = "count".to_string();
                for v in sent.iter().chain(delivered).chain(repeated) {
                    s.push_str(&format!("\t{v}"));
                }
                s
            }
            Reply::Stats { lat, lost, errors } => {
                let mut s = "stats".to_string();
                for h in lat {
                    s.push('\t');
                    s.push_str(&h.encode());
                }
                s.push_str(&format!("\t{lost}"));
                for e in errors {
                    s.push('\t');
                    s.push_str(&esc(e));
                }
                s
            }
            Reply::Unavailables { seen, repeated } => {
                let mut s = format!("unavailables\t{repeated}");
                for (jid, watchers, ns) in seen {
                    s.push_str(&format!("\t{} {watchers} {ns}", esc(jid)));
                }
                s
            }
            Reply::CsiStateDone { sent, ok, refused } => format!("csistate\t{sent}\t{ok}\t{refused}"),
            Reply::CsiCount {
                inactive,
                active,
                inactive_clients,
                active_clients,
                inactive_max,
            } => format!(
                "csicount\t{inactive}\t{active}\t{inactive_clients}\t{active_clients}\t{inactive_max}"
            ),
            Reply::CsiCheck { checked, lost } => format!("csicheck\t{checked}\t{lost}"),
            Reply::Closed => "closed".into(),
        }
    }

    /// Parses [`Reply::encode`]'s output.
    pub fn decode(line: &str) -> Result<Reply, String> {
        let f: Vec<&str> = line.trim_end_matches(['\n', '\r']).split('\t').collect();
        let bad = || format!("bad reply {line:?}");
        let num = |i: usize| -> Result<u64, String> {
            f.get(i).and_then(|s| s.parse().ok()).ok_or_else(bad)
        };
        let hist = |i: usize| Histogram::decode(f.get(i).ok_or_else(bad)?);
        Ok(match f[0] {
            "logins" => Reply::Logins {
                ok: num(1)?,
                failed: num(2)?,
                start_ns: num(3)?,
                last_ns: num(4)?,
                rosters_complete: num(5)?,
                hist: hist(6)?,
                negotiated: f[7.min(f.len())..].iter().map(|e| unesc(e)).collect(),
            },
            "settled" => Reply::Settled { seen: num(1)? },
            "phase" => Reply::Phase {
                issued: num(1)?,
                drops: num(2)?,
                secs: f.get(3).and_then(|s| s.parse().ok()).ok_or_else(bad)?,
            },
            "count" => {
                let (mut sent, mut delivered, mut repeated) =
                    ([0; PHASES], [0; PHASES], [0; PHASES]);
                for i in 0..PHASES {
                    sent[i] = num(1 + i)?;
                    delivered[i] = num(1 + PHASES + i)?;
                    repeated[i] = num(1 + 2 * PHASES + i)?;
                }
                Reply::Count {
                    sent,
                    delivered,
                    repeated,
                }
            }
            "stats" => {
                let mut lat: [Histogram; PHASES] = Default::default();
                for (i, h) in lat.iter_mut().enumerate() {
                    *h = hist(1 + i)?;
                }
                Reply::Stats {
                    lat,
                    lost: num(1 + PHASES)?,
                    errors: f[(2 + PHASES).min(f.len())..]
                        .iter()
                        .map(|e| unesc(e))
                        .collect(),
                }
            }
            "unavailables" => Reply::Unavailables {
                repeated: num(1)?,
                seen: f[2.min(f.len())..]
                    .iter()
                    .map(|e| {
                        let w: Vec<&str> = e.split(' ').collect();
                        match (w.first(), w.get(1), w.get(2)) {
                            (Some(j), Some(n), Some(t)) => Ok((
                                unesc(j),
                                n.parse().map_err(|_| bad())?,
                                t.parse().map_err(|_| bad())?,
                            )),
                            _ => Err(bad()),
                        }
                    })
                    .collect::<Result<_, _>>()?,
            },
            "csistate" => Reply::CsiStateDone {
                sent: num(1)?,
                ok: num(2)?,
                refused: num(3)?,
            },
            "csicount" => Reply::CsiCount {
                inactive: num(1)?,
                active: num(2)?,
                inactive_clients: num(3)?,
                active_clients: num(4)?,
                inactive_max: num(5)?,
            },
            "csicheck" => Reply::CsiCheck {
                checked: num(1)?,
                lost: num(2)?,
            },
            "closed" => Reply::Closed,
            _ => return Err(bad()),
        })
    }
}

/// The sessions of one slice of users and the phase code that drives them.
pub struct Worker {
    cli: Arc<Cli>,
    target: Target,
    graph: Arc<ContactGraph>,
    users: Range<u32>,
    procs: u32,
    shared: Arc<Shared>,
    sessions: Vec<(u32, mpsc::Sender<Command>)>,
    seq: u64,
    /// Each session's presences received at the previous `CsiCount`.
    csi_mark: std::collections::HashMap<u32, u64>,
}

impl Worker {
    /// Worker `index` of `procs`.
    pub fn new(
        cli: Arc<Cli>,
        target: Target,
        graph: Arc<ContactGraph>,
        index: u32,
        procs: u32,
    ) -> Self {
        let users = slice(cli.users, index, procs);
        Worker {
            cli,
            target,
            graph,
            users,
            procs,
            shared: Arc::new(Shared::default()),
            sessions: Vec::new(),
            // Distinct sequence numbers across workers (they only label stanzas).
            seq: u64::from(index) << 48,
            csi_mark: std::collections::HashMap::new(),
        }
    }

    /// Executes one step.
    pub async fn handle(&mut self, cmd: Cmd) -> Reply {
        match cmd {
            Cmd::Login => self.login().await,
            Cmd::Settle { secs } => {
                // The initial-presence storm (RFC 6121 §4.2.2 broadcast + §4.3 probes) is
                // part of a login's cost: wait until every session saw all its contacts.
                let until = Instant::now() + Duration::from_secs(secs);
                let want = self.sessions.len() as u64;
                while Instant::now() < until && self.seen() < want {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Reply::Settled { seen: self.seen() }
            }
            Cmd::Quiet { ms, max_secs } => {
                crate::wait_quiet(
                    &self.shared,
                    Duration::from_millis(ms),
                    Duration::from_secs(max_secs),
                )
                .await;
                Reply::Settled { seen: self.seen() }
            }
            Cmd::Fixed { rate, secs, phase } => {
                self.fixed(rate, secs, usize::from(phase), false).await
            }
            Cmd::CsiWindow { rate, secs } => self.fixed(rate, secs, FIXED_PHASE, true).await,
            Cmd::CsiState { active, interest } => self.csi_state(active, interest).await,
            Cmd::CsiCount => self.csi_count().await,
            Cmd::CsiCheck => self.csi_check().await,
            Cmd::Sat { window, secs } => self.saturate(window, secs).await,
            Cmd::Count => {
                let p = &self.shared.phases;
                Reply::Count {
                    sent: std::array::from_fn(|i| p[i].sent.load(Ordering::Relaxed)),
                    delivered: std::array::from_fn(|i| p[i].delivered.load(Ordering::Relaxed)),
                    repeated: std::array::from_fn(|i| p[i].repeated.load(Ordering::Relaxed)),
                }
            }
            Cmd::Stats => {
                let lat: [Histogram; PHASES] = Default::default();
                for (h, p) in lat.iter().zip(&self.shared.phases) {
                    h.merge(&p.latency);
                }
                Reply::Stats {
                    lat,
                    lost: self.shared.sessions_lost.load(Ordering::Relaxed),
                    errors: crate::errors_of(&self.shared),
                }
            }
            Cmd::Unavailables => Reply::Unavailables {
                seen: self
                    .shared
                    .unavailable
                    .lock()
                    .map(|u| u.iter().map(|(j, &(n, t))| (j.clone(), n, t)).collect())
                    .unwrap_or_default(),
                repeated: self
                    .shared
                    .unavailable_pairs
                    .lock()
                    .map(|p| p.1)
                    .unwrap_or_default(),
            },
            Cmd::Close => {
                crate::close_all(&self.sessions).await;
                self.sessions.clear();
                Reply::Closed
            }
        }
    }

    fn seen(&self) -> u64 {
        self.shared
            .sessions_all_contacts_seen
            .load(Ordering::Relaxed)
    }

    async fn login(&mut self) -> Reply {
        let hist = Arc::new(Histogram::default());
        let start_ns = session::now_ns();
        let concurrency = share(f64::from(self.cli.login_concurrency), self.procs).ceil() as u32;
        let mode = if self.cli.csi {
            Mode::Csi
        } else {
            Mode::Measure
        };
        let (sessions, failed, span) = crate::login_all(
            &self.cli,
            &self.target,
            &self.graph,
            &self.shared,
            mode,
            Some(hist.clone()),
            crate::LoginPlan {
                users: self.users.clone(),
                concurrency,
            },
        )
        .await;
        self.sessions = sessions;
        let h = Histogram::default();
        h.merge(&hist);
        Reply::Logins {
            ok: self.sessions.len() as u64,
            failed,
            start_ns,
            last_ns: start_ns + span.as_nanos() as u64,
            rosters_complete: self.shared.rosters_complete.load(Ordering::Relaxed),
            hist: h,
            negotiated: self
                .shared
                .negotiated
                .lock()
                .map(|v| v.clone())
                .unwrap_or_default(),
        }
    }

    /// Open loop: `rate` changes per second from random users of this slice, counted in
    /// `phase` (with `active_group`, from the odd users only: a CSI run's inactive clients
    /// stay silent).
    async fn fixed(&mut self, rate: f64, secs: u64, phase: usize, active_group: bool) -> Reply {
        let mut rng = rand::rngs::StdRng::from_entropy();
        let senders: Vec<usize> = (0..self.sessions.len())
            .filter(|&s| !active_group || !inactive_group(self.sessions[s].0))
            .collect();
        let (mut issued, mut drops) = (0u64, 0u64);
        let sent_before = self.shared.phases[phase].sent.load(Ordering::Relaxed);
        let t0 = Instant::now();
        // Exactly rate × secs changes, the last one due at `secs`: stopping the clock at
        // `secs` instead would drop the final change whenever the last tick falls just
        // short of it (this was the "one change of 1,000 missing" in earlier runs).
        let total = (rate * secs as f64).round() as u64;
        let mut tick = tokio::time::interval(Duration::from_millis(1));
        while issued < total && !senders.is_empty() {
            tick.tick().await;
            let due = ((t0.elapsed().as_secs_f64() * rate) as u64 + 1).min(total);
            while issued < due {
                let (_, tx) = &self.sessions[senders[rng.gen_range(0..senders.len())]];
                self.seq += 1;
                issued += 1;
                if tx
                    .try_send(Command::Presence {
                        phase: phase as u8,
                        seq: self.seq,
                    })
                    .is_err()
                {
                    drops += 1;
                }
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        self.until_sent(phase, sent_before + issued - drops).await;
        Reply::Phase {
            issued,
            drops,
            secs,
        }
    }

    /// Sends the inactive group `<active/>`, or (with `interest` > 0, first an interest
    /// list naming that many of each client's changing contacts, then) `<inactive/>`.
    /// Waits for the interest lists' answers (at most 10 s), then 1 s for the servers to
    /// take the nonzas in: XEP-0352 has no answer to wait for, and any traffic from the
    /// client (a ping) would itself end Prosody's holding.
    async fn csi_state(&mut self, active: bool, interest: u32) -> Reply {
        let answered = |s: &Shared| {
            s.interest_results.load(Ordering::Relaxed) + s.interest_errors.load(Ordering::Relaxed)
        };
        let (ok0, refused0) = (
            self.shared.interest_results.load(Ordering::Relaxed),
            self.shared.interest_errors.load(Ordering::Relaxed),
        );
        let before = answered(&self.shared);
        let mut sent = 0u64;
        for (i, tx) in &self.sessions {
            if !inactive_group(*i) {
                continue;
            }
            if !active && interest > 0 {
                let named: Vec<String> = self
                    .graph
                    .contacts(*i)
                    .into_iter()
                    .filter(|&c| !inactive_group(c))
                    .take(interest as usize)
                    .map(|c| self.target.bare(c))
                    .collect();
                if tx.send(Command::Interest(named)).await.is_ok() {
                    sent += 1;
                }
            }
            let _ = tx.send(Command::ClientState(active)).await;
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while answered(&self.shared) < before + sent && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        Reply::CsiStateDone {
            sent,
            ok: self.shared.interest_results.load(Ordering::Relaxed) - ok0,
            refused: self.shared.interest_errors.load(Ordering::Relaxed) - refused0,
        }
    }

    /// Every live session's CSI state, by user.
    async fn csi_states(&self) -> Vec<(u32, CsiState)> {
        let mut out = Vec::with_capacity(self.sessions.len());
        for (i, tx) in &self.sessions {
            let (otx, orx) = tokio::sync::oneshot::channel();
            if tx.send(Command::CsiReport(otx)).await.is_err() {
                continue;
            }
            if let Ok(Ok(st)) = tokio::time::timeout(Duration::from_secs(10), orx).await {
                out.push((*i, st));
            }
        }
        out
    }

    async fn csi_count(&mut self) -> Reply {
        let (mut inactive, mut active, mut ic, mut ac, mut imax) = (0, 0, 0, 0, 0);
        for (i, st) in self.csi_states().await {
            let prev = self.csi_mark.insert(i, st.presences_in).unwrap_or(0);
            let d = st.presences_in.saturating_sub(prev);
            if inactive_group(i) {
                inactive += d;
                ic += 1;
                imax = imax.max(d);
            } else {
                active += d;
                ac += 1;
            }
        }
        Reply::CsiCount {
            inactive,
            active,
            inactive_clients: ic,
            active_clients: ac,
            inactive_max: imax,
        }
    }

    /// For each inactive-group client and each contact that sent a change: the latest
    /// presence the client has from the contact's full JID must be the one it last sent.
    async fn csi_check(&mut self) -> Reply {
        let states = self.csi_states().await;
        let last_sent: std::collections::HashMap<u32, (String, String)> = states
            .iter()
            .filter_map(|(i, st)| st.last_sent.clone().map(|v| (*i, v)))
            .collect();
        let (mut checked, mut lost) = (0u64, 0u64);
        for (i, st) in states.iter().filter(|(i, _)| inactive_group(*i)) {
            for c in self.graph.contacts(*i) {
                let Some(want) = last_sent.get(&c) else {
                    continue;
                };
                checked += 1;
                let full = format!("{}/{}", self.target.bare(c), self.target.resource);
                let have = st.last_from.get(&full);
                if have != Some(want) {
                    lost += 1;
                    self.shared.note_error(format!(
                        "csi: {} has {have:?} from {full}, which last sent {want:?}",
                        self.target.bare(*i)
                    ));
                }
            }
        }
        Reply::CsiCheck { checked, lost }
    }

    /// Waits (at most 5 s) until the sessions have written `target` changes of `phase`:
    /// the last command issued may still sit in its session's queue, and counting before
    /// it is written would leave it (and its deliveries) out of the phase's figures. That,
    /// not a lost presence, was the "one change of 1,000 missing" of earlier runs.
    async fn until_sent(&self, phase: usize, target: u64) {
        let deadline = Instant::now() + Duration::from_secs(5);
        let sent = &self.shared.phases[phase].sent;
        while sent.load(Ordering::Relaxed) < target && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Closed loop: changes as fast as `window` deliveries in flight allow. In flight is
    /// estimated from this process's own counts (issued × K − delivered here). Deliveries
    /// to watchers in other processes are not seen here, but with contiguous slices of the
    /// ring only the K/2 users at each slice border have such watchers, and the flows
    /// between two neighbouring slices are symmetric (both send round-robin at the same
    /// rate), so the estimate stays balanced; with one process it is exact.
    async fn saturate(&mut self, window: u64, secs: u64) -> Reply {
        let k = u64::from(self.graph.k());
        let p = &self.shared.phases[SAT_PHASE];
        let sent_before = p.sent.load(Ordering::Relaxed);
        let (mut issued, mut drops) = (0u64, 0u64);
        let mut next = 0usize;
        let t0 = Instant::now();
        let len = Duration::from_secs(secs);
        while t0.elapsed() < len && !self.sessions.is_empty() {
            let in_flight = (issued * k).saturating_sub(p.delivered.load(Ordering::Relaxed));
            if in_flight + k > window {
                tokio::time::sleep(Duration::from_micros(500)).await;
                continue;
            }
            let (_, tx) = &self.sessions[next % self.sessions.len()];
            next += 1;
            self.seq += 1;
            if tx
                .try_send(Command::Presence {
                    phase: SAT_PHASE as u8,
                    seq: self.seq,
                })
                .is_ok()
            {
                issued += 1;
            } else {
                drops += 1;
                tokio::task::yield_now().await;
            }
        }
        // The wait counts as phase time: deliveries made meanwhile are counted too.
        self.until_sent(SAT_PHASE, sent_before + issued).await;
        let secs = t0.elapsed().as_secs_f64();
        Reply::Phase {
            issued,
            drops,
            secs,
        }
    }
}

/// A CSI run's inactive group: every other user (the even ones).
pub fn inactive_group(user: u32) -> bool {
    user % 2 == 0
}

/// Runs as child `index`: reads commands from stdin, answers on stdout, until `close` or EOF.
pub async fn serve_stdio(mut worker: Worker) -> Result<(), String> {
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    let mut out = tokio::io::stdout();
    while let Some(line) = lines.next_line().await.map_err(|e| format!("stdin: {e}"))? {
        let cmd = Cmd::decode(&line)?;
        let close = cmd == Cmd::Close;
        let reply = worker.handle(cmd).await;
        out.write_all(format!("{}\n", reply.encode()).as_bytes())
            .await
            .map_err(|e| format!("stdout: {e}"))?;
        out.flush().await.map_err(|e| format!("stdout: {e}"))?;
        if close {
            return Ok(());
        }
    }
    // The parent went away: end the sessions cleanly anyway.
    worker.handle(Cmd::Close).await;
    Ok(())
}

/// One child process and its pipes.
pub struct ChildLink {
    child: Child,
    stdin: ChildStdin,
    stdout: tokio::io::Lines<BufReader<ChildStdout>>,
}

/// The workers of one run, in-process or child processes.
pub enum Workers {
    /// P = 1: one worker in this process.
    Local(Box<Worker>),
    /// P > 1: child processes over pipes.
    Children(Vec<ChildLink>),
}

impl Workers {
    /// Spawns `procs` children running this binary with `args` plus `--worker I`.
    pub fn spawn(procs: u32, args: &[String]) -> Result<Workers, String> {
        let exe = std::env::current_exe().map_err(|e| format!("own executable: {e}"))?;
        let mut links = Vec::new();
        for i in 0..procs {
            let mut child = tokio::process::Command::new(&exe)
                .args(args)
                .args(["--worker", &i.to_string()])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                // A parent that fails or hits its time limit must not leave sessions behind.
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| format!("spawning worker {i}: {e}"))?;
            let stdin = child.stdin.take().ok_or("worker stdin")?;
            let stdout = BufReader::new(child.stdout.take().ok_or("worker stdout")?).lines();
            links.push(ChildLink {
                child,
                stdin,
                stdout,
            });
        }
        Ok(Workers::Children(links))
    }

    /// Number of workers.
    pub fn len(&self) -> usize {
        match self {
            Workers::Local(_) => 1,
            Workers::Children(c) => c.len(),
        }
    }

    /// Sends `cmd` to every worker, then collects one reply from each: a barrier.
    pub async fn all(&mut self, cmd: Cmd) -> Result<Vec<Reply>, String> {
        match self {
            Workers::Local(w) => Ok(vec![w.handle(cmd).await]),
            Workers::Children(links) => {
                let line = format!("{}\n", cmd.encode());
                for (i, l) in links.iter_mut().enumerate() {
                    l.stdin
                        .write_all(line.as_bytes())
                        .await
                        .map_err(|e| format!("worker {i}: {e}"))?;
                    l.stdin
                        .flush()
                        .await
                        .map_err(|e| format!("worker {i}: {e}"))?;
                }
                let mut replies = Vec::with_capacity(links.len());
                for (i, l) in links.iter_mut().enumerate() {
                    let r = l
                        .stdout
                        .next_line()
                        .await
                        .map_err(|e| format!("worker {i}: {e}"))?
                        .ok_or_else(|| format!("worker {i} exited during {}", cmd.encode()))?;
                    replies.push(Reply::decode(&r)?);
                }
                Ok(replies)
            }
        }
    }

    /// Waits for the children to exit after `close` (bounded).
    pub async fn finish(self) {
        if let Workers::Children(links) = self {
            for mut l in links {
                drop(l.stdin);
                let _ = tokio::time::timeout(Duration::from_secs(10), l.child.wait()).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_cover_every_user_once_with_sizes_within_one() {
        for (n, p) in [(20, 2), (19_000, 2), (10, 3), (3, 4), (1000, 7)] {
            let s: Vec<Range<u32>> = (0..p).map(|i| slice(n, i, p)).collect();
            assert_eq!(s[0].start, 0);
            assert_eq!(s[p as usize - 1].end, n);
            for w in s.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            let sizes: Vec<u32> = s.iter().map(|r| r.len() as u32).collect();
            let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            assert!(hi - lo <= 1, "n={n} p={p} {sizes:?}");
        }
    }

    #[test]
    fn commands_survive_the_pipe() {
        for c in [
            Cmd::Login,
            Cmd::Settle { secs: 30 },
            Cmd::Quiet {
                ms: 500,
                max_secs: 30,
            },
            Cmd::Fixed {
                rate: 33.5,
                secs: 10,
                phase: 0,
            },
            Cmd::Fixed {
                rate: 1100.0,
                secs: 5,
                phase: (PHASES - 1) as u8,
            },
            Cmd::Sat {
                window: 2000,
                secs: 10,
            },
            Cmd::CsiState {
                active: false,
                interest: 2,
            },
            Cmd::CsiState {
                active: true,
                interest: 0,
            },
            Cmd::CsiWindow {
                rate: 12.5,
                secs: 20,
            },
            Cmd::CsiCount,
            Cmd::CsiCheck,
            Cmd::Count,
            Cmd::Stats,
            Cmd::Unavailables,
            Cmd::Close,
        ] {
            assert_eq!(Cmd::decode(&c.encode()).expect("decodes"), c);
        }
        assert!(Cmd::decode("settle").is_err());
        assert!(Cmd::decode(&format!("fixed 10 5 {PHASES}")).is_err());
        assert!(Cmd::decode("reboot").is_err());
    }

    #[test]
    fn replies_survive_the_pipe_including_errors_with_tabs_and_newlines() {
        let h = Histogram::default();
        h.record(1500);
        h.record(2);
        let r = Reply::Logins {
            ok: 9,
            failed: 1,
            start_ns: 5,
            last_ns: 7,
            rosters_complete: 9,
            hist: h,
            negotiated: vec!["TLSv1_3 TLS13_AES_256_GCM_SHA384 SCRAM-SHA-1".into()],
        };
        match Reply::decode(&r.encode()).expect("decodes") {
            Reply::Logins {
                ok: 9,
                failed: 1,
                start_ns: 5,
                last_ns: 7,
                rosters_complete: 9,
                hist,
                negotiated,
            } => {
                assert_eq!(
                    negotiated,
                    vec!["TLSv1_3 TLS13_AES_256_GCM_SHA384 SCRAM-SHA-1".to_string()]
                );
                assert_eq!(hist.count(), 2);
                assert_eq!(hist.max(), 1500);
            }
            other => panic!("{other:?}"),
        }
        let u = Reply::Unavailables {
            seen: vec![("u1@d".into(), 3, 17), ("u2@d".into(), 1, 5)],
            repeated: 2,
        };
        match Reply::decode(&u.encode()).expect("decodes") {
            Reply::Unavailables { seen, repeated: 2 } => assert_eq!(
                seen,
                vec![("u1@d".to_string(), 3, 17), ("u2@d".to_string(), 1, 5)]
            ),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            Reply::decode("unavailables\t0").expect("decodes"),
            Reply::Unavailables { seen, repeated: 0 } if seen.is_empty()
        ));
        let s = Reply::Stats {
            lat: Default::default(),
            lost: 3,
            errors: vec!["a\tb\nc\\d".into(), "e".into()],
        };
        let line = s.encode();
        assert!(!line.contains('\n'));
        match Reply::decode(&line).expect("decodes") {
            Reply::Stats {
                lost: 3, errors, ..
            } => {
                assert_eq!(errors, vec!["a\tb\nc\\d".to_string(), "e".to_string()])
            }
            other => panic!("{other:?}"),
        }
        // Every phase's counts and histogram cross the pipe, the ladder's last one too.
        let sent: [u64; PHASES] = std::array::from_fn(|i| i as u64 + 1);
        let delivered: [u64; PHASES] = std::array::from_fn(|i| 100 + i as u64);
        let repeated: [u64; PHASES] = std::array::from_fn(|i| 200 + i as u64);
        let count = Reply::Count {
            sent,
            delivered,
            repeated,
        };
        match Reply::decode(&count.encode()) {
            Ok(Reply::Count {
                sent: s,
                delivered: d,
                repeated: r,
            }) => assert_eq!((s, d, r), (sent, delivered, repeated)),
            other => panic!("{other:?}"),
        }
        let lat: [Histogram; PHASES] = Default::default();
        lat[PHASES - 1].record(4200);
        match Reply::decode(
            &Reply::Stats {
                lat,
                lost: 0,
                errors: vec![],
            }
            .encode(),
        ) {
            Ok(Reply::Stats { lat, lost: 0, .. }) => {
                assert_eq!(lat[PHASES - 1].max(), 4200);
                assert_eq!(lat[0].count(), 0);
            }
            other => panic!("{other:?}"),
        }
        assert!(Reply::decode("logins\t1").is_err());
    }
}
