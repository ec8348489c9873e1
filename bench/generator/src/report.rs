//! The figures a run produces, printed as a table and written as JSON.

use std::fmt::Write as _;

use crate::rest::Rates;

/// One window of a client state indication run in which the inactive group (every
/// other user) was inactive.
#[derive(Debug, Default, Clone)]
pub struct CsiWindow {
    /// Contacts named in each inactive client's interest list (0: none set).
    pub interest_items: u32,
    /// Interest lists the server accepted.
    pub interest_ok: u64,
    /// Interest lists the server refused.
    pub interest_refused: u64,
    /// Presences received per inactive client over the window (and its drain).
    pub per_inactive_client: f64,
    /// The most one inactive client received.
    pub max_inactive_client: u64,
    /// Presences received per active client over the same window.
    pub per_active_client: f64,
    /// 100 × (1 − per inactive client ÷ the same clients' figure when all were active).
    pub reduction_pct: Option<f64>,
    /// Presences received by all clients per second of the window.
    pub deliveries_per_s: f64,
    /// Presences per inactive client that arrived after `<active/>`.
    pub flushed_per_inactive_client: f64,
    /// (inactive client, changed contact) pairs checked after `<active/>`.
    pub checked: u64,
    /// Of those, the pairs whose latest presence at the client was not the contact's last.
    pub lost: u64,
}

/// The figures of a client state indication run (`--csi`).
#[derive(Debug, Default, Clone)]
pub struct CsiFigures {
    /// Window length, s (0: no CSI run).
    pub secs: f64,
    /// Presence changes per second, from the active group only, in every window.
    pub rate: f64,
    /// Presences per client of the (later) inactive group with every client active.
    pub baseline_per_client: Option<f64>,
    /// Presences per client of the active group in the baseline window.
    pub baseline_active_per_client: Option<f64>,
    /// Presences received by all clients per second of the baseline window.
    pub baseline_deliveries_per_s: Option<f64>,
    /// Half the clients inactive.
    pub inactive: CsiWindow,
    /// Half the clients inactive with interest lists (presenced only).
    pub interest: Option<CsiWindow>,
}

/// One rate of the latency ladder: an open-loop phase at a fixed offered load.
#[derive(Debug, Default, Clone)]
pub struct LadderPoint {
    /// Offered presence changes per second (each fans out to K watchers).
    pub rate: f64,
    /// The fraction of --fractions-of this rate stands for (None: given as a rate).
    pub fraction: Option<f64>,
    /// The saturation (deliveries/s) the fraction is of.
    pub of_deliveries_per_s: Option<f64>,
    /// Phase length, s.
    pub secs: f64,
    /// Changes written to the server.
    pub sent: u64,
    /// Deliveries received (by the end of the drain).
    pub delivered: u64,
    /// Changes the client could not queue (a session's queue was full).
    pub drops: u64,
    /// Delivery latency p50, ms.
    pub p50_ms: Option<f64>,
    /// p99, ms.
    pub p99_ms: Option<f64>,
    /// max, ms.
    pub max_ms: Option<f64>,
}

impl LadderPoint {
    /// The server kept up with this rate: every change was queued and every one of its K
    /// deliveries arrived by the end of the drain.
    pub fn sustained(&self, k: u64) -> bool {
        self.drops == 0 && self.delivered >= self.sent * k
    }

    fn to_json(&self, k: u64) -> String {
        format!(
            "{{\"rate_changes_per_s\": {}, \"offered_deliveries_per_s\": {}, \"fraction\": {}, \
             \"fraction_of_deliveries_per_s\": {}, \"secs\": {}, \"sent\": {}, \
             \"delivered\": {}, \"drops\": {}, \"sustained\": {}, \"p50_ms\": {}, \
             \"p99_ms\": {}, \"max_ms\": {}}}",
            num(Some(self.rate)),
            num(Some(self.rate * k as f64)),
            num(self.fraction),
            num(self.of_deliveries_per_s),
            num(Some(self.secs)),
            self.sent,
            self.delivered,
            self.drops,
            self.sustained(k),
            num(self.p50_ms),
            num(self.p99_ms),
            num(self.max_ms)
        )
    }
}

/// Figures of one timed run against one server.
#[derive(Debug, Default, Clone)]
pub struct Report {
    /// Free-form label (server name).
    pub label: String,
    /// Target address.
    pub target: String,
    /// Sessions attempted (N).
    pub users: u32,
    /// Contacts per user (K).
    pub contacts: u32,
    /// Offered login rate (0 = as fast as the concurrency allows).
    pub login_rate_offered: f64,
    /// Logins in flight at most.
    pub login_concurrency: u32,
    /// Successful logins.
    pub logins_ok: u64,
    /// Failed logins.
    pub logins_failed: u64,
    /// Achieved login rate, sessions/s (first attempt to last completion).
    pub login_rate: Option<f64>,
    /// Login latency p50, ms (TCP connect to initial presence sent).
    pub login_p50_ms: Option<f64>,
    /// Login latency p99, ms.
    pub login_p99_ms: Option<f64>,
    /// Login latency max, ms.
    pub login_max_ms: Option<f64>,
    /// Sessions whose roster at login held all K contacts as "both" (provisioning check).
    pub rosters_complete: u64,
    /// Sessions that saw all K contacts available after login.
    pub sessions_all_contacts_seen: u64,
    /// Server RSS with no bench session, kB.
    pub rss_kb_idle_0: Option<u64>,
    /// Server RSS with all sessions connected and idle, kB.
    pub rss_kb_idle_n: Option<u64>,
    /// (rss_n - rss_0) / logins_ok, kB.
    pub rss_kb_per_session: Option<f64>,
    /// The same plus the growth of the server's private Redis (--store-pid) per session:
    /// for presenced, whose liveness keys live there.
    pub total_rss_kb_per_session: Option<f64>,
    /// Growth of the private memory of the server's PostgreSQL backends (--pg-backends)
    /// per session, kB, and the total with it.
    pub pg_private_kb_per_session: Option<f64>,
    pub all_rss_kb_per_session: Option<f64>,
    /// Growth of the server's allocator figures per idle session, kB (presenced's admin
    /// `stats`, its `allocator` figures): live allocations; the pages that hold them; the
    /// allocator's resident pages; its bookkeeping.
    pub alloc_allocated_kb_per_session: Option<f64>,
    pub alloc_active_kb_per_session: Option<f64>,
    pub alloc_resident_kb_per_session: Option<f64>,
    pub alloc_metadata_kb_per_session: Option<f64>,
    /// Server CPU seconds per 1,000 logins (login phase incl. initial presence fan-out).
    pub cpu_s_per_1000_logins: Option<f64>,
    /// CPU seconds of the server's storage processes (--store-pid, --pg-backends) per
    /// 1,000 logins; None when none are watched.
    pub store_cpu_s_per_1000_logins: Option<f64>,
    /// Server plus storage CPU seconds per 1,000 logins: the figure to compare between
    /// servers whose storage is in-process and those whose storage is not.
    pub total_cpu_s_per_1000_logins: Option<f64>,
    /// Fixed offered load: presence changes per second.
    pub fixed_rate: f64,
    /// Fixed-load phase length, s.
    pub fixed_secs: f64,
    /// Changes sent in the fixed-load phase.
    pub fixed_sent: u64,
    /// Deliveries received in the fixed-load phase.
    pub fixed_delivered: u64,
    /// Delivery latency at fixed load, ms.
    pub fixed_p50_ms: Option<f64>,
    /// p99, ms.
    pub fixed_p99_ms: Option<f64>,
    /// max, ms.
    pub fixed_max_ms: Option<f64>,
    /// Saturation phase: deliveries allowed in flight.
    pub sat_window: u64,
    /// Saturation phase length, s.
    pub sat_secs: f64,
    /// Changes sent at saturation.
    pub sat_sent: u64,
    /// Deliveries received during the saturation phase.
    pub sat_delivered: u64,
    /// Deliveries per second at saturation.
    pub sat_deliveries_per_s: Option<f64>,
    /// After the drain: deliveries owed (changes sent × K), received, received again
    /// (duplicates), and owed but never received.
    pub sat_expected: u64,
    pub sat_received: u64,
    pub sat_repeated: u64,
    pub sat_missing: u64,
    /// Latency at saturation p50, ms (queueing included, for orientation only).
    pub sat_p50_ms: Option<f64>,
    /// p99 at saturation, ms.
    pub sat_p99_ms: Option<f64>,
    /// The latency ladder's rates, lowest first, up to the first one not sustained.
    pub ladder: Vec<LadderPoint>,
    /// Server CPU seconds per 1,000 deliveries at saturation.
    pub cpu_s_per_1000_deliveries: Option<f64>,
    /// Storage CPU seconds per 1,000 deliveries at saturation (see the logins figure).
    pub store_cpu_s_per_1000_deliveries: Option<f64>,
    /// Server plus storage CPU seconds per 1,000 deliveries at saturation.
    pub total_cpu_s_per_1000_deliveries: Option<f64>,
    /// Sessions that ended unexpectedly.
    pub sessions_lost: u64,
    /// Presence commands dropped because a session's queue was full (client-side backlog).
    pub client_backlog_drops: u64,
    /// Generator processes the sessions were spread over.
    pub procs: u32,
    /// Length of the idle window the write rates at rest were read over, s (0: not read).
    pub rest_secs: f64,
    /// Writes per session per minute at rest (presenced only; None where not measured).
    pub rest: Rates,
    /// Fixed-load phase, from Redis `INFO` (--redis-stats) with the at-rest rate over the
    /// same length subtracted: commands of any kind, `PUBLISH`/`SPUBLISH` calls, and
    /// network bytes in + out, per presence change.
    pub fixed_redis: crate::rest::PerChange,
    /// Kill phase (--kill-pid): what became of the sessions on the killed node.
    pub kill: KillFigures,
    /// Distinct `<TLS version> <cipher suite> <SASL mechanism>` of the timed logins.
    pub negotiated: Vec<String>,
    /// Client state indication figures (`--csi` runs only).
    pub csi: CsiFigures,
    /// First few errors.
    pub errors: Vec<String>,
}

/// The kill phase: one cluster node SIGKILLed after the load phases; for each session on
/// it, the time from the kill until its unavailable reached the last of its contacts'
/// sessions on the other nodes that got it.
#[derive(Debug, Default, Clone)]
pub struct KillFigures {
    /// Sessions of the killed node (users logged in there).
    pub sessions: u64,
    /// Of those, announced to at least one watcher within the wait.
    pub announced: u64,
    /// Watchers on other nodes that should hear of a death, and those that did.
    pub watchers_expected: u64,
    /// Watchers that got an unavailable.
    pub watchers_reached: u64,
    /// Unavailables a watcher received again for the same contact (any contact).
    pub repeated: u64,
    /// Announcement time per session (kill → last watcher), ms: min, p50, p99, max.
    pub min_ms: Option<f64>,
    /// Median, ms.
    pub p50_ms: Option<f64>,
    /// p99, ms.
    pub p99_ms: Option<f64>,
    /// Max, ms.
    pub max_ms: Option<f64>,
    /// Sessions announced within --kill-bound-secs of the kill.
    pub within_bound: u64,
    /// The bound, s.
    pub bound_secs: f64,
}

/// Full precision: Rust's shortest representation that reads back as the same f64, so a
/// per-session write rate of 0.0004 is not rounded to 0 in the JSON.
/// A JSON number, or null (none, or not finite).
pub(crate) fn num(v: Option<f64>) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{x}"),
        _ => "null".into(),
    }
}

fn cell(v: Option<f64>) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{x:.2}"),
        _ => "-".into(),
    }
}

/// Rates at rest are small numbers (a fraction of a write per minute): more digits.
fn rate(v: Option<f64>) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{x:.4}"),
        _ => "-".into(),
    }
}

/// A JSON array of strings.
pub(crate) fn json_strs(items: &[String]) -> String {
    let items: Vec<String> = items.iter().map(|e| json_str(e)).collect();
    format!("[{}]", items.join(", "))
}

/// A JSON string.
pub(crate) fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

impl Report {
    /// The report as a JSON object (hand-written: the crate has no JSON dependency).
    pub fn to_json(&self) -> String {
        let f = |v: u64| Some(v as f64);
        let fields: Vec<(&str, String)> = vec![
            ("label", json_str(&self.label)),
            ("target", json_str(&self.target)),
            ("users", self.users.to_string()),
            ("contacts", self.contacts.to_string()),
            ("login_rate_offered", num(Some(self.login_rate_offered))),
            ("login_concurrency", self.login_concurrency.to_string()),
            ("logins_ok", self.logins_ok.to_string()),
            ("logins_failed", self.logins_failed.to_string()),
            ("login_rate_per_s", num(self.login_rate)),
            ("login_p50_ms", num(self.login_p50_ms)),
            ("login_p99_ms", num(self.login_p99_ms)),
            ("login_max_ms", num(self.login_max_ms)),
            ("rosters_complete", self.rosters_complete.to_string()),
            (
                "sessions_all_contacts_seen",
                self.sessions_all_contacts_seen.to_string(),
            ),
            ("rss_kb_idle_0", num(self.rss_kb_idle_0.and_then(f))),
            ("rss_kb_idle_n", num(self.rss_kb_idle_n.and_then(f))),
            ("rss_kb_per_session", num(self.rss_kb_per_session)),
            (
                "total_rss_kb_per_session",
                num(self.total_rss_kb_per_session),
            ),
            (
                "pg_private_kb_per_session",
                num(self.pg_private_kb_per_session),
            ),
            ("all_rss_kb_per_session", num(self.all_rss_kb_per_session)),
            (
                "alloc_allocated_kb_per_session",
                num(self.alloc_allocated_kb_per_session),
            ),
            (
                "alloc_active_kb_per_session",
                num(self.alloc_active_kb_per_session),
            ),
            (
                "alloc_resident_kb_per_session",
                num(self.alloc_resident_kb_per_session),
            ),
            (
                "alloc_metadata_kb_per_session",
                num(self.alloc_metadata_kb_per_session),
            ),
            ("cpu_s_per_1000_logins", num(self.cpu_s_per_1000_logins)),
            (
                "store_cpu_s_per_1000_logins",
                num(self.store_cpu_s_per_1000_logins),
            ),
            (
                "total_cpu_s_per_1000_logins",
                num(self.total_cpu_s_per_1000_logins),
            ),
            ("fixed_rate_changes_per_s", num(Some(self.fixed_rate))),
            ("fixed_secs", num(Some(self.fixed_secs))),
            ("fixed_sent", self.fixed_sent.to_string()),
            ("fixed_delivered", self.fixed_delivered.to_string()),
            ("fixed_p50_ms", num(self.fixed_p50_ms)),
            ("fixed_p99_ms", num(self.fixed_p99_ms)),
            ("fixed_max_ms", num(self.fixed_max_ms)),
            ("sat_window", self.sat_window.to_string()),
            ("sat_secs", num(Some(self.sat_secs))),
            ("sat_sent", self.sat_sent.to_string()),
            ("sat_delivered", self.sat_delivered.to_string()),
            ("sat_deliveries_per_s", num(self.sat_deliveries_per_s)),
            ("sat_expected", self.sat_expected.to_string()),
            ("sat_received", self.sat_received.to_string()),
            ("sat_repeated", self.sat_repeated.to_string()),
            ("sat_missing", self.sat_missing.to_string()),
            ("sat_p50_ms", num(self.sat_p50_ms)),
            ("sat_p99_ms", num(self.sat_p99_ms)),
            (
                "ladder",
                format!(
                    "[{}]",
                    self.ladder
                        .iter()
                        .map(|p| format!("\n    {}", p.to_json(u64::from(self.contacts))))
                        .collect::<Vec<_>>()
                        .join(",")
                ),
            ),
            (
                "cpu_s_per_1000_deliveries",
                num(self.cpu_s_per_1000_deliveries),
            ),
            (
                "store_cpu_s_per_1000_deliveries",
                num(self.store_cpu_s_per_1000_deliveries),
            ),
            (
                "total_cpu_s_per_1000_deliveries",
                num(self.total_cpu_s_per_1000_deliveries),
            ),
            ("sessions_lost", self.sessions_lost.to_string()),
            (
                "client_backlog_drops",
                self.client_backlog_drops.to_string(),
            ),
            ("procs", self.procs.to_string()),
            ("rest_secs", num(Some(self.rest_secs))),
            (
                "redis_writes_per_session_per_min",
                num(self.rest.redis_writes),
            ),
            (
                "redis_write_cmds_per_session_per_min",
                num(self.rest.redis_write_cmds),
            ),
            (
                "redis_write_cmds_seen",
                format!(
                    "{{{}}}",
                    self.rest
                        .redis_cmds_seen
                        .iter()
                        .map(|(c, n)| format!("{}: {n}", json_str(c)))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ),
            ("fixed_redis_cmds_per_change", num(self.fixed_redis.cmds)),
            (
                "fixed_redis_publish_per_change",
                num(self.fixed_redis.publish),
            ),
            (
                "fixed_redis_cluster_cmds_per_change",
                num(self.fixed_redis.cluster_cmds),
            ),
            ("fixed_redis_bytes_per_change", num(self.fixed_redis.bytes)),
            ("kill_sessions", self.kill.sessions.to_string()),
            ("kill_announced", self.kill.announced.to_string()),
            (
                "kill_watchers_expected",
                self.kill.watchers_expected.to_string(),
            ),
            (
                "kill_watchers_reached",
                self.kill.watchers_reached.to_string(),
            ),
            ("kill_repeated_unavailables", self.kill.repeated.to_string()),
            ("kill_min_ms", num(self.kill.min_ms)),
            ("kill_p50_ms", num(self.kill.p50_ms)),
            ("kill_p99_ms", num(self.kill.p99_ms)),
            ("kill_max_ms", num(self.kill.max_ms)),
            ("kill_within_bound", self.kill.within_bound.to_string()),
            ("kill_bound_secs", num(Some(self.kill.bound_secs))),
            ("pg_writes_per_session_per_min", num(self.rest.pg_writes)),
            (
                "pg_statements_per_session_per_min",
                num(self.rest.pg_statements),
            ),
            (
                "pg_statements_at_rest",
                num(self.rest.pg_statements_seen.map(|n| n as f64)),
            ),
            ("pg_xacts_per_session_per_min", num(self.rest.pg_xacts)),
            ("pg_rows_per_session_per_min", num(self.rest.pg_rows)),
            ("negotiated", json_strs(&self.negotiated)),
            ("errors", json_strs(&self.errors)),
        ];
        let mut fields: Vec<(String, String)> = fields
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        if self.csi.secs > 0.0 {
            let c = &self.csi;
            fields.extend(
                [
                    ("csi_secs", num(Some(c.secs))),
                    ("csi_rate_changes_per_s", num(Some(c.rate))),
                    ("csi_baseline_per_client", num(c.baseline_per_client)),
                    (
                        "csi_baseline_active_per_client",
                        num(c.baseline_active_per_client),
                    ),
                    (
                        "csi_baseline_deliveries_per_s",
                        num(c.baseline_deliveries_per_s),
                    ),
                ]
                .map(|(k, v)| (k.to_string(), v)),
            );
            for (prefix, w) in [
                ("csi", Some(&c.inactive)),
                ("csi_interest", c.interest.as_ref()),
            ] {
                let Some(w) = w else { continue };
                let key = |k: &str| format!("{prefix}_{k}");
                fields.extend([
                    (key("items"), w.interest_items.to_string()),
                    (key("lists_ok"), w.interest_ok.to_string()),
                    (key("lists_refused"), w.interest_refused.to_string()),
                    (key("inactive_per_client"), num(Some(w.per_inactive_client))),
                    (
                        key("inactive_max_client"),
                        w.max_inactive_client.to_string(),
                    ),
                    (key("active_per_client"), num(Some(w.per_active_client))),
                    (key("reduction_pct"), num(w.reduction_pct)),
                    (key("deliveries_per_s"), num(Some(w.deliveries_per_s))),
                    (
                        key("flushed_per_inactive_client"),
                        num(Some(w.flushed_per_inactive_client)),
                    ),
                    (key("checked"), w.checked.to_string()),
                    (key("lost"), w.lost.to_string()),
                ]);
            }
        }
        let body: Vec<String> = fields
            .into_iter()
            .map(|(k, v)| format!("  {}: {v}", json_str(&k)))
            .collect();
        format!("{{\n{}\n}}\n", body.join(",\n"))
    }

    /// The report as an aligned text table.
    pub fn to_table(&self) -> String {
        let expected_fixed = self.fixed_sent * u64::from(self.contacts);
        let rows: Vec<(String, String)> = vec![
            ("server".into(), format!("{} ({})", self.label, self.target)),
            ("generator processes".into(), self.procs.to_string()),
            (
                "sessions N / contacts K".into(),
                format!("{} / {}", self.users, self.contacts),
            ),
            (
                "logins ok / failed".into(),
                format!("{} / {}", self.logins_ok, self.logins_failed),
            ),
            ("login rate (sessions/s)".into(), cell(self.login_rate)),
            (
                "login latency p50 / p99 / max (ms)".into(),
                format!(
                    "{} / {} / {}",
                    cell(self.login_p50_ms),
                    cell(self.login_p99_ms),
                    cell(self.login_max_ms)
                ),
            ),
            (
                "rosters complete / saw all contacts online".into(),
                format!(
                    "{} / {}",
                    self.rosters_complete, self.sessions_all_contacts_seen
                ),
            ),
            (
                "server RSS at 0 / N sessions (kB)".into(),
                format!(
                    "{} / {}",
                    cell(self.rss_kb_idle_0.map(|v| v as f64)),
                    cell(self.rss_kb_idle_n.map(|v| v as f64))
                ),
            ),
            (
                "RSS per idle session (kB; with its Redis; and its PostgreSQL backends' private memory)".into(),
                format!(
                    "{} ; {} ; {}",
                    cell(self.rss_kb_per_session),
                    cell(self.total_rss_kb_per_session),
                    cell(self.all_rss_kb_per_session)
                ),
            ),
            (
                "CPU s per 1,000 logins (server / its stores)".into(),
                format!(
                    "{} / {}",
                    cell(self.cpu_s_per_1000_logins),
                    cell(self.store_cpu_s_per_1000_logins)
                ),
            ),
            (
                format!("fixed load {}/s: delivered/expected", self.fixed_rate),
                format!("{} / {}", self.fixed_delivered, expected_fixed),
            ),
            (
                "delivery latency p50 / p99 / max (ms)".into(),
                format!(
                    "{} / {} / {}",
                    cell(self.fixed_p50_ms),
                    cell(self.fixed_p99_ms),
                    cell(self.fixed_max_ms)
                ),
            ),
            (
                "deliveries/s at saturation".into(),
                cell(self.sat_deliveries_per_s),
            ),
            (
                "saturation, after the drain: owed / received / duplicates / missing".into(),
                format!(
                    "{} / {} / {} / {}",
                    self.sat_expected, self.sat_received, self.sat_repeated, self.sat_missing
                ),
            ),
            (
                "saturation latency p50 / p99 (ms)".into(),
                format!("{} / {}", cell(self.sat_p50_ms), cell(self.sat_p99_ms)),
            ),
            (
                "CPU s per 1,000 deliveries (server / its stores)".into(),
                format!(
                    "{} / {}",
                    cell(self.cpu_s_per_1000_deliveries),
                    cell(self.store_cpu_s_per_1000_deliveries)
                ),
            ),
            (
                format!(
                    "at rest {:.0} s: Redis writes/session/min (server / commandstats)",
                    self.rest_secs
                ),
                format!(
                    "{} / {}",
                    rate(self.rest.redis_writes),
                    rate(self.rest.redis_write_cmds)
                ),
            ),
            (
                "at rest: PG writes/session/min (server / xacts / rows)".into(),
                format!(
                    "{} / {} / {}",
                    rate(self.rest.pg_writes),
                    rate(self.rest.pg_xacts),
                    rate(self.rest.pg_rows)
                ),
            ),
            (
                "at rest: PG statements (count; /session/min)".into(),
                format!(
                    "{} ; {}",
                    self.rest
                        .pg_statements_seen
                        .map_or_else(|| "-".to_string(), |n| n.to_string()),
                    rate(self.rest.pg_statements)
                ),
            ),
            (
                "negotiated (TLS version, cipher suite, SASL)".into(),
                self.negotiated.join("; "),
            ),
            (
                "sessions lost / client drops".into(),
                format!("{} / {}", self.sessions_lost, self.client_backlog_drops),
            ),
        ];
        let mut rows = rows;
        let k = u64::from(self.contacts);
        for p in &self.ladder {
            let of = match (p.fraction, p.of_deliveries_per_s) {
                (Some(f), Some(sat)) => format!(" ({:.0} % of {sat:.0} deliveries/s)", f * 100.0),
                _ => String::new(),
            };
            rows.push((
                format!("ladder {:.1} changes/s{of}: delivered/expected", p.rate),
                format!(
                    "{} / {}{}",
                    p.delivered,
                    p.sent * k,
                    if p.sustained(k) {
                        ""
                    } else {
                        " (not sustained)"
                    }
                ),
            ));
            rows.push((
                "  delivery latency p50 / p99 / max (ms)".into(),
                format!(
                    "{} / {} / {}",
                    cell(p.p50_ms),
                    cell(p.p99_ms),
                    cell(p.max_ms)
                ),
            ));
        }
        if self.csi.secs > 0.0 {
            let c = &self.csi;
            rows.push((
                format!(
                    "CSI {}/s for {:.0} s: all active, per client (even / odd)",
                    c.rate, c.secs
                ),
                format!(
                    "{} / {}",
                    cell(c.baseline_per_client),
                    cell(c.baseline_active_per_client)
                ),
            ));
            rows.push((
                "CSI baseline deliveries/s".into(),
                cell(c.baseline_deliveries_per_s),
            ));
            for w in std::iter::once(&c.inactive).chain(c.interest.as_ref()) {
                let name = if w.interest_items > 0 {
                    format!("CSI + interest lists of {}", w.interest_items)
                } else {
                    "CSI half inactive".to_string()
                };
                rows.push((
                    format!("{name}: per inactive (max) / active client"),
                    format!(
                        "{} ({}) / {}",
                        cell(Some(w.per_inactive_client)),
                        w.max_inactive_client,
                        cell(Some(w.per_active_client))
                    ),
                ));
                rows.push((
                    format!("{name}: reduction % / deliveries/s"),
                    format!(
                        "{} / {}",
                        cell(w.reduction_pct),
                        cell(Some(w.deliveries_per_s))
                    ),
                ));
                rows.push((
                    format!("{name}: after <active/>: per client / missing of checked"),
                    format!(
                        "{} / {} of {}",
                        cell(Some(w.flushed_per_inactive_client)),
                        w.lost,
                        w.checked
                    ),
                ));
            }
        }
        let w = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        let mut out = String::new();
        for (k, v) in rows {
            let _ = writeln!(out, "{k:<w$}  {v}");
        }
        for e in &self.errors {
            let _ = writeln!(out, "error: {e}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_has_nulls_for_missing_figures_and_escapes_strings() {
        let r = Report {
            label: "pro\"sody".into(),
            login_rate: Some(12.5),
            rss_kb_per_session: Some(0.000_123_456_789),
            negotiated: vec!["TLSv1_3 TLS13_AES_128_GCM_SHA256 SCRAM-SHA-256".into()],
            errors: vec!["a\nb".into()],
            ..Report::default()
        };
        let j = r.to_json();
        assert!(j.contains("\"label\": \"pro\\\"sody\""));
        assert!(j.contains("\"login_rate_per_s\": 12.5"));
        assert!(j.contains("\"login_p50_ms\": null"));
        // Full precision: a small figure is not rounded away.
        assert!(j.contains("\"rss_kb_per_session\": 0.000123456789"));
        assert!(j.contains("\"negotiated\": [\"TLSv1_3 TLS13_AES_128_GCM_SHA256 SCRAM-SHA-256\"]"));
        assert!(j.contains("\"errors\": [\"a\\u000ab\"]"));
        assert!(j.contains("\"redis_writes_per_session_per_min\": null"));
        assert!(j.contains("\"redis_write_cmds_seen\": {}"));
        assert!(j.contains("\"ladder\": []"));
    }

    #[test]
    fn ladder_points_say_their_rate_fraction_and_whether_sustained() {
        let r = Report {
            contacts: 10,
            ladder: vec![
                LadderPoint {
                    rate: 550.0,
                    fraction: Some(0.25),
                    of_deliveries_per_s: Some(22_000.0),
                    secs: 10.0,
                    sent: 5500,
                    delivered: 55_000,
                    p99_ms: Some(3.5),
                    ..LadderPoint::default()
                },
                LadderPoint {
                    rate: 1100.0,
                    sent: 11_000,
                    delivered: 109_999,
                    ..LadderPoint::default()
                },
            ],
            ..Report::default()
        };
        let j = r.to_json();
        assert!(
            j.contains("{\"rate_changes_per_s\": 550, \"offered_deliveries_per_s\": 5500, \"fraction\": 0.25, \"fraction_of_deliveries_per_s\": 22000,"),
            "{j}"
        );
        assert!(j.contains("\"delivered\": 55000, \"drops\": 0, \"sustained\": true, \"p50_ms\": null, \"p99_ms\": 3.5,"), "{j}");
        // One delivery missing after the drain: not sustained.
        assert!(
            j.contains("\"delivered\": 109999, \"drops\": 0, \"sustained\": false,"),
            "{j}"
        );
        let t = r.to_table();
        assert!(
            t.contains("ladder 550.0 changes/s (25 % of 22000 deliveries/s)"),
            "{t}"
        );
        assert!(t.contains("109999 / 110000 (not sustained)"), "{t}");
    }
}
