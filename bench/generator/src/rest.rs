//! Write rates at rest (presenced only): how many Redis and PostgreSQL writes the
//! server makes per connected session per minute while N sessions sit idle.
//!
//! Three sources are read at the start and the end of the idle window and their deltas
//! divided by sessions and minutes:
//!
//! * the server's own counters at `/metrics` (`presenced_redis_writes_total`,
//!   `presenced_pg_last_seen_writes_total`);
//! * Redis `INFO commandstats`: the calls of every command whose `COMMAND INFO` flags
//!   include `write` (commands run inside EVAL scripts are counted by Redis under their own
//!   names, so HSET/ZADD/PEXPIRE inside a script count; EVAL itself is not flagged `write`).
//!   This is exact only when the server has the Redis instance to itself: bench/run.sh
//!   starts a private redis-server for the run;
//! * PostgreSQL, watched through a maintenance database ([`pg_watch`]) for the server's
//!   database: the statements its connections start (`pg_stat_activity`, polled), and
//!   `pg_stat_database`'s committed transactions and rows inserted+updated+deleted.
//!
//! PostgreSQL 15 publishes a backend's `pg_stat_database` counters late: at most once a
//! second while it works, and up to 10 s (`PGSTAT_IDLE_INTERVAL`) after its last
//! transaction once it is idle. Read at the start of the window, the counters missed the
//! tail of the login storm, which then arrived inside the window and was counted as work at
//! rest (0.1–1.7 commits per session per minute at N = 1,000, while a statement log showed
//! none). So the counters' window starts only once every backend of the database has been
//! idle for [`PG_STATS_SETTLED`], and the statements are counted from `pg_stat_activity`,
//! which a backend updates when a statement starts, without delay: each poll counts every
//! backend whose `query_start` moved (or that is new and started one in the window). It is
//! a lower bound (two statements of one backend between two polls count once), and exact
//! for the figure that matters at rest: 0 means no statement at all.
//!
//! The cross-checks exist because a server's own counters could lie (or miss a write path).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long every backend of the server's database must have been idle before its
/// `pg_stat_database` counters are complete: PostgreSQL 15 publishes an idle backend's
/// pending counters at most 10 s after its last transaction (`PGSTAT_IDLE_INTERVAL`).
pub const PG_STATS_SETTLED: Duration = Duration::from_secs(11);

/// Where the at-rest figures come from; every source is optional.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    /// `http://127.0.0.1:PORT/metrics` of the server under test.
    pub metrics_url: Option<String>,
    /// Redis URL of the (private) instance the server writes to.
    pub redis_url: Option<String>,
    /// PostgreSQL URL of a maintenance database to watch through, and the server's
    /// database (see [`pg_watch`]).
    pub pg: Option<(String, String)>,
}

/// One reading of all sources; a source that failed is None.
#[derive(Debug, Clone, Default)]
pub struct Reading {
    /// Prometheus samples by metric name.
    pub metrics: Option<HashMap<String, f64>>,
    /// Calls per write command (from INFO commandstats).
    pub redis_write_calls: Option<HashMap<String, u64>>,
}

/// What [`pg_watch`] saw of the server's database over the window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PgRest {
    /// Statements the server's connections started (a lower bound; see the module).
    pub statements: u64,
    /// Length of the polled window, s.
    pub secs: f64,
    /// `pg_stat_database` (xact_commit, rows inserted + updated + deleted) deltas and the
    /// seconds between the two readings; None when the database never settled.
    pub counters: Option<(i64, i64, f64)>,
}

/// Per-session-per-minute rates from two readings.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rates {
    /// presenced_redis_writes_total delta.
    pub redis_writes: Option<f64>,
    /// Write-flagged Redis command calls (commandstats delta).
    pub redis_write_cmds: Option<f64>,
    /// The write commands seen in the window, with their call deltas.
    pub redis_cmds_seen: Vec<(String, u64)>,
    /// presenced_pg_last_seen_writes_total delta (statements).
    pub pg_writes: Option<f64>,
    /// Statements started by the server's connections (pg_stat_activity).
    pub pg_statements: Option<f64>,
    /// The same, as counted in the window.
    pub pg_statements_seen: Option<u64>,
    /// pg_stat_database xact_commit delta, over the settled part of the window.
    pub pg_xacts: Option<f64>,
    /// pg_stat_database tup_inserted+tup_updated+tup_deleted delta.
    pub pg_rows: Option<f64>,
}

/// Redis figures per presence change over a load phase (see [`per_change`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PerChange {
    /// Commands of any kind.
    pub cmds: Option<f64>,
    /// `PUBLISH` + `SPUBLISH` calls.
    pub publish: Option<f64>,
    /// The cluster's own commands: its directory scripts and reads (`EVAL`, `EVALSHA`,
    /// `HGETALL`, `HGET`) and its channel messages (`PUBLISH`, `SPUBLISH`), so without the
    /// liveness refreshes (`SET`, `ZADD`, `PEXPIREAT`), which come in bursts per refresh
    /// interval and make the all-commands figure noisy.
    pub cluster_cmds: Option<f64>,
    /// Network bytes in + out (`total_net_input_bytes` + `total_net_output_bytes`).
    pub bytes: Option<f64>,
}

/// One reading of a Redis server's totals: calls per command, network bytes in + out.
#[derive(Debug, Clone, Default)]
pub struct RedisTotals {
    /// Calls per command (`INFO commandstats`).
    pub calls: HashMap<String, u64>,
    /// `total_net_input_bytes` + `total_net_output_bytes` (`INFO stats`).
    pub bytes: u64,
}

impl RedisTotals {
    fn all_calls(&self) -> u64 {
        self.calls.values().sum()
    }

    fn cluster_calls(&self) -> u64 {
        ["eval", "evalsha", "hgetall", "hget", "publish", "spublish"]
            .iter()
            .filter_map(|c| self.calls.get(*c))
            .sum()
    }

    fn publishes(&self) -> u64 {
        ["publish", "spublish"]
            .iter()
            .filter_map(|c| self.calls.get(*c))
            .sum()
    }
}

/// Reads [`RedisTotals`] (the reading's own `INFO` calls are counted by the next one: two
/// commands per reading, negligible next to a phase's thousands).
pub async fn redis_totals(url: &str) -> Result<RedisTotals, String> {
    let client = redis::Client::open(url).map_err(|e| format!("{url}: {e}"))?;
    let mut con = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut con)
        .await
        .map_err(|e| format!("INFO commandstats: {e}"))?;
    let net: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(&mut con)
        .await
        .map_err(|e| format!("INFO stats: {e}"))?;
    let bytes = net
        .lines()
        .filter_map(|l| {
            l.strip_prefix("total_net_input_bytes:")
                .or_else(|| l.strip_prefix("total_net_output_bytes:"))
        })
        .filter_map(|v| v.trim().parse::<u64>().ok())
        .sum();
    Ok(RedisTotals {
        calls: parse_commandstats(&stats),
        bytes,
    })
}

/// Redis work per change over a load phase: the phase's deltas (`phase`, lasting
/// `phase_secs`) minus the background rate measured at rest (`rest`, `rest_secs`) over
/// the same length, divided by the `changes` made.
pub fn per_change(
    rest: (&RedisTotals, &RedisTotals, f64),
    phase: (&RedisTotals, &RedisTotals, f64),
    changes: u64,
) -> PerChange {
    let (r0, r1, rest_secs) = rest;
    let (p0, p1, phase_secs) = phase;
    if changes == 0 || rest_secs <= 0.0 {
        return PerChange::default();
    }
    let scale = phase_secs / rest_secs;
    let one = |f: fn(&RedisTotals) -> u64| {
        let background = f(r1).saturating_sub(f(r0)) as f64 * scale;
        Some((f(p1).saturating_sub(f(p0)) as f64 - background) / changes as f64)
    };
    PerChange {
        cmds: one(RedisTotals::all_calls),
        publish: one(RedisTotals::publishes),
        cluster_cmds: one(RedisTotals::cluster_calls),
        bytes: one(|t| t.bytes),
    }
}

/// The allocator's figures presenced's admin socket gives in its `stats` answer
/// (`"allocator":{"allocated":…,"active":…,"resident":…,"metadata":…}`, bytes), in that
/// order, or None when the answer has none (a build on another allocator) or the socket
/// cannot be read. They are not on /metrics: they grow with invisible sessions too.
pub async fn allocator_bytes(admin_socket: &str) -> Option<[f64; 4]> {
    use tokio::io::AsyncBufReadExt;
    let mut s = tokio::net::UnixStream::connect(admin_socket).await.ok()?;
    s.write_all(b"{\"command\":\"stats\"}\n").await.ok()?;
    let mut answer = String::new();
    tokio::io::BufReader::new(s.take(1 << 20))
        .read_line(&mut answer)
        .await
        .ok()?;
    parse_allocator(&answer)
}

/// The four figures of the `"allocator"` object in a `stats` answer (see [`allocator_bytes`]).
fn parse_allocator(answer: &str) -> Option<[f64; 4]> {
    let group = &answer[answer.find("\"allocator\":{")?..];
    let group = &group[..group.find('}')?];
    let get = |what: &str| -> Option<f64> {
        let at = group.find(&format!("\"{what}\":"))? + what.len() + 3;
        let digits: String = group[at..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse().ok()
    };
    Some([
        get("allocated")?,
        get("active")?,
        get("resident")?,
        get("metadata")?,
    ])
}

/// Parses Prometheus text exposition into name → value (labels kept in the name).
pub fn parse_prometheus(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.trim().rsplit_once(' ')?;
            Some((name.trim().to_string(), value.parse().ok()?))
        })
        .collect()
}

/// Parses `INFO commandstats` into command → calls (`cmdstat_hset:calls=3,usec=...`).
pub fn parse_commandstats(info: &str) -> HashMap<String, u64> {
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.trim().strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))?
                .parse()
                .ok()?;
            Some((name.to_string(), calls))
        })
        .collect()
}

/// Splits `http://host:port/path` into (host:port, path); only loopback IP literals.
pub fn parse_http_url(url: &str) -> Result<(std::net::SocketAddr, String), String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("{url}: only http:// metrics URLs"))?;
    let (hostport, path) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].to_string()),
        None => (rest, "/".to_string()),
    };
    let addr: std::net::SocketAddr = hostport
        .parse()
        .map_err(|_| format!("{url}: host must be an IP literal with a port"))?;
    if !addr.ip().is_loopback() {
        return Err(format!("{url}: refusing a non-loopback address"));
    }
    Ok((addr, path))
}

/// GET of a loopback HTTP/1.1 URL (no TLS), returning the body of a 200 answer.
async fn http_get(url: &str) -> Result<String, String> {
    let (addr, path) = parse_http_url(url)?;
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .map_err(|e| format!("{url}: {e}"))?;
    let mut buf = Vec::new();
    s.take(16 << 20)
        .read_to_end(&mut buf)
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("{url}: no HTTP header"))?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        return Err(format!("{url}: {}", head.lines().next().unwrap_or("")));
    }
    if head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    }) {
        return Err(format!("{url}: chunked answers are not supported"));
    }
    Ok(body.to_string())
}

async fn redis_write_calls(url: &str) -> Result<HashMap<String, u64>, String> {
    let client = redis::Client::open(url).map_err(|e| format!("{url}: {e}"))?;
    let mut con = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut con)
        .await
        .map_err(|e| format!("INFO commandstats: {e}"))?;
    let mut out = HashMap::new();
    for (name, calls) in parse_commandstats(&info) {
        // Subcommands appear as `config|get`; their flags are the container's business
        // and none of the liveness writes are subcommands.
        if name.contains('|') {
            continue;
        }
        let v: redis::Value = redis::cmd("COMMAND")
            .arg("INFO")
            .arg(&name)
            .query_async(&mut con)
            .await
            .map_err(|e| format!("COMMAND INFO {name}: {e}"))?;
        if command_is_write(&v) {
            out.insert(name, calls);
        }
    }
    Ok(out)
}

/// True when a `COMMAND INFO name` answer lists the `write` flag (third field).
fn command_is_write(v: &redis::Value) -> bool {
    let redis::Value::Array(outer) = v else {
        return false;
    };
    let Some(redis::Value::Array(entry)) = outer.first() else {
        return false;
    };
    let Some(redis::Value::Array(flags)) = entry.get(2) else {
        return false;
    };
    flags.iter().any(|f| match f {
        redis::Value::SimpleString(s) => s == "write",
        redis::Value::BulkString(b) => b == b"write",
        _ => false,
    })
}

async fn pg_counters(c: &mut sqlx::PgConnection, db: &str) -> Result<(i64, i64), String> {
    sqlx::query_as(
        "SELECT xact_commit, tup_inserted + tup_updated + tup_deleted
         FROM pg_stat_database WHERE datname = $1",
    )
    .bind(db)
    .fetch_one(c)
    .await
    .map_err(|e| format!("pg_stat_database {db}: {e}"))
}

/// One backend of the watched database: (pid, `query_start` in ms or 0, busy, ms since its
/// state last changed). Busy: not an idle client backend (running, in a transaction, or
/// autovacuum at work on the database).
type Backend = (i32, i64, bool, i64);

async fn pg_activity(c: &mut sqlx::PgConnection, db: &str) -> Result<Vec<Backend>, String> {
    sqlx::query_as(
        "SELECT pid,
                COALESCE((EXTRACT(EPOCH FROM query_start) * 1000)::bigint, 0),
                state IS DISTINCT FROM 'idle' OR backend_type <> 'client backend',
                (EXTRACT(EPOCH FROM clock_timestamp()
                   - COALESCE(state_change, backend_start)) * 1000)::bigint
         FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
    )
    .bind(db)
    .fetch_all(c)
    .await
    .map_err(|e| format!("pg_stat_activity {db}: {e}"))
}

/// Watches database `db` through the maintenance database at `url` for `window`, polling
/// every `poll` (see the module documentation): the statements its backends start, and its
/// `pg_stat_database` counters from the moment every backend has been idle for
/// [`PG_STATS_SETTLED`] to the end of the window. The watcher's own queries run in the
/// maintenance database and are not counted (nor is the watcher's own connection, should
/// `url` name `db` itself).
pub async fn pg_watch(
    url: &str,
    db: &str,
    window: Duration,
    poll: Duration,
) -> Result<PgRest, String> {
    use sqlx::Connection;
    let mut c = sqlx::PgConnection::connect(url)
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    let started = Instant::now();
    let (t0,): (i64,) =
        sqlx::query_as("SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::bigint")
            .fetch_one(&mut c)
            .await
            .map_err(|e| format!("{url}: {e}"))?;
    let mut last: HashMap<i32, i64> = pg_activity(&mut c, db)
        .await?
        .into_iter()
        .map(|(pid, q, _, _)| (pid, q))
        .collect();
    let mut statements = 0;
    let mut base: Option<((i64, i64), Instant)> = None;
    loop {
        let now = pg_activity(&mut c, db).await?;
        statements += started_statements(&mut last, &now, t0);
        let settled = now
            .iter()
            .all(|&(_, _, busy, idle_ms)| !busy && idle_ms >= PG_STATS_SETTLED.as_millis() as i64);
        if base.is_none() && settled {
            base = Some((pg_counters(&mut c, db).await?, Instant::now()));
        }
        let left = window.saturating_sub(started.elapsed());
        if left.is_zero() {
            break;
        }
        tokio::time::sleep(left.min(poll)).await;
    }
    let counters = match base {
        Some(((x0, r0), at)) => {
            let (x1, r1) = pg_counters(&mut c, db).await?;
            Some((x1 - x0, r1 - r0, at.elapsed().as_secs_f64()))
        }
        None => None,
    };
    let _ = c.close().await;
    Ok(PgRest {
        statements,
        secs: started.elapsed().as_secs_f64(),
        counters,
    })
}

/// Statements started since the previous poll `last` (updated): a backend whose
/// `query_start` moved, or a new one whose `query_start` is at or after `t0` (ms).
fn started_statements(last: &mut HashMap<i32, i64>, now: &[Backend], t0: i64) -> u64 {
    let mut n = 0;
    for &(pid, q, _, _) in now {
        let moved = match last.insert(pid, q) {
            Some(before) => q > before,
            None => q >= t0,
        };
        n += u64::from(moved);
    }
    n
}

/// Reads every configured source; failures are reported on stderr and leave that part None.
pub async fn read(src: &Sources) -> Reading {
    let mut r = Reading::default();
    if let Some(u) = &src.metrics_url {
        match http_get(u).await {
            Ok(body) => r.metrics = Some(parse_prometheus(&body)),
            Err(e) => eprintln!("warning: metrics: {e}"),
        }
    }
    if let Some(u) = &src.redis_url {
        match redis_write_calls(u).await {
            Ok(m) => r.redis_write_calls = Some(m),
            Err(e) => eprintln!("warning: redis: {e}"),
        }
    }
    r
}

/// Deltas between two readings (and what [`pg_watch`] saw) as writes per session per
/// minute.
pub fn rates(a: &Reading, b: &Reading, pg: Option<&PgRest>, sessions: u64, secs: f64) -> Rates {
    let per_over = |d: f64, secs: f64| {
        if sessions == 0 || secs <= 0.0 {
            None
        } else {
            Some(d / sessions as f64 / (secs / 60.0))
        }
    };
    let per = |d: f64| per_over(d, secs);
    let metric = |name: &str| -> Option<f64> {
        let x = a.metrics.as_ref()?.get(name)?;
        let y = b.metrics.as_ref()?.get(name)?;
        per(y - x)
    };
    let mut r = Rates {
        redis_writes: metric("presenced_redis_writes_total"),
        pg_writes: metric("presenced_pg_last_seen_writes_total"),
        ..Rates::default()
    };
    if let (Some(x), Some(y)) = (&a.redis_write_calls, &b.redis_write_calls) {
        let mut seen: Vec<(String, u64)> = y
            .iter()
            .map(|(k, v)| (k.clone(), v.saturating_sub(*x.get(k).unwrap_or(&0))))
            .filter(|(_, d)| *d > 0)
            .collect();
        seen.sort();
        // fold from +0.0: an empty f64 sum is -0.0.
        r.redis_write_cmds = per(seen.iter().fold(0.0, |acc, (_, d)| acc + *d as f64));
        r.redis_cmds_seen = seen;
    }
    if let Some(pg) = pg {
        r.pg_statements = per_over(pg.statements as f64, pg.secs);
        r.pg_statements_seen = Some(pg.statements);
        if let Some((xacts, rows, secs)) = pg.counters {
            r.pg_xacts = per_over(xacts as f64, secs);
            r.pg_rows = per_over(rows as f64, secs);
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_text_is_read_without_comments() {
        let m = parse_prometheus(
            "# HELP presenced_redis_writes_total x\n# TYPE presenced_redis_writes_total counter\n\
             presenced_redis_writes_total 42\npresenced_redis_up 1\nbroken\n",
        );
        assert_eq!(m.get("presenced_redis_writes_total"), Some(&42.0));
        assert_eq!(m.get("presenced_redis_up"), Some(&1.0));
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn allocator_figures_are_read_from_the_stats_answer() {
        let answer = "{\"Ok\":{\"version\":\"0.1.0\",\"sessions\":3,\"allocator\":\
            {\"allocated\":1000,\"active\":4096,\"resident\":8192,\"metadata\":512}}}\n";
        assert_eq!(
            parse_allocator(answer),
            Some([1000.0, 4096.0, 8192.0, 512.0])
        );
        assert_eq!(parse_allocator("{\"Ok\":{\"sessions\":3}}\n"), None);
    }

    #[test]
    fn commandstats_calls_are_read_per_command() {
        let m = parse_commandstats(
            "# Commandstats\r\ncmdstat_hset:calls=12,usec=30,usec_per_call=2.5,rejected_calls=0\r\n\
             cmdstat_config|get:calls=2,usec=1\r\n",
        );
        assert_eq!(m.get("hset"), Some(&12));
        assert_eq!(m.get("config|get"), Some(&2));
    }

    #[test]
    fn metrics_urls_must_be_loopback_http() {
        let (a, p) = parse_http_url("http://127.0.0.1:35280/metrics").expect("valid");
        assert_eq!(a.port(), 35280);
        assert_eq!(p, "/metrics");
        assert!(parse_http_url("http://10.0.0.1:80/metrics").is_err());
        assert!(parse_http_url("https://127.0.0.1:80/metrics").is_err());
        assert!(parse_http_url("http://localhost:80/metrics").is_err());
    }

    #[test]
    fn rates_are_deltas_per_session_per_minute_and_missing_sources_stay_none() {
        let m = |r: f64, p: f64| {
            Some(HashMap::from([
                ("presenced_redis_writes_total".to_string(), r),
                ("presenced_pg_last_seen_writes_total".to_string(), p),
            ]))
        };
        let a = Reading {
            metrics: m(100.0, 10.0),
            redis_write_calls: Some(HashMap::from([("hset".into(), 5)])),
        };
        let b = Reading {
            metrics: m(400.0, 70.0),
            redis_write_calls: Some(HashMap::from([("hset".into(), 305), ("zadd".into(), 300)])),
        };
        // 100 sessions over 30 s: 300 writes = 6 per session per minute.
        let r = rates(&a, &b, None, 100, 30.0);
        assert_eq!(r.redis_writes, Some(6.0));
        assert_eq!(r.pg_writes, Some(1.2));
        assert_eq!(r.redis_write_cmds, Some(12.0));
        assert_eq!(
            r.redis_cmds_seen,
            vec![("hset".to_string(), 300), ("zadd".to_string(), 300)]
        );
        assert_eq!(r.pg_xacts, None);
        assert_eq!(r.pg_statements, None);
        assert_eq!(rates(&a, &b, None, 0, 30.0).redis_writes, None);
        // PostgreSQL: statements over the whole window, counters over their settled part.
        let pg = PgRest {
            statements: 50,
            secs: 30.0,
            counters: Some((20, 0, 12.0)),
        };
        let r = rates(&a, &b, Some(&pg), 100, 30.0);
        assert_eq!(r.pg_statements, Some(1.0));
        assert_eq!(r.pg_statements_seen, Some(50));
        assert_eq!(r.pg_xacts, Some(1.0));
        assert_eq!(r.pg_rows, Some(0.0));
        let unsettled = PgRest {
            counters: None,
            ..pg
        };
        assert_eq!(rates(&a, &b, Some(&unsettled), 100, 30.0).pg_xacts, None);
    }

    #[test]
    fn a_statement_is_a_moved_query_start_or_a_new_backend_that_started_one_in_the_window() {
        let t0 = 1_000;
        let mut last = HashMap::from([(1, 900), (2, 950)]);
        // Backend 1 idle since before the window, 2 ran one, 3 is new and ran one, 4 is
        // new but its last statement is older than the window, 5 is new and never ran one.
        let now = [
            (1, 900, false, 0),
            (2, 1_200, false, 0),
            (3, 1_100, false, 0),
            (4, 800, false, 0),
            (5, 0, false, 0),
        ];
        assert_eq!(started_statements(&mut last, &now, t0), 2);
        assert_eq!(
            started_statements(&mut last, &now, t0),
            0,
            "nothing moved since"
        );
    }

    #[test]
    fn per_change_subtracts_the_rest_rate_over_the_phase_length() {
        let t = |calls: &[(&str, u64)], bytes| RedisTotals {
            calls: calls.iter().map(|(c, n)| (c.to_string(), *n)).collect(),
            bytes,
        };
        // At rest 10 s: 100 SETs, 20 sweeper EVALs, 1,000 bytes. Phase 5 s: 50 SETs and 10
        // EVALs of background, 200 PUBLISH, 100 HGETALL, 4,500 bytes; 100 changes.
        let (r0, r1) = (
            t(&[("set", 0), ("eval", 0)], 0),
            t(&[("set", 100), ("eval", 20)], 1000),
        );
        let (p0, p1) = (
            t(&[("set", 100), ("eval", 20)], 1000),
            t(
                &[
                    ("set", 150),
                    ("eval", 30),
                    ("publish", 200),
                    ("hgetall", 100),
                ],
                5500,
            ),
        );
        let pc = per_change((&r0, &r1, 10.0), (&p0, &p1, 5.0), 100);
        assert_eq!(pc.cmds, Some(3.0));
        assert_eq!(pc.publish, Some(2.0));
        assert_eq!(pc.cluster_cmds, Some(3.0));
        assert_eq!(pc.bytes, Some(40.0));
        assert_eq!(
            per_change((&r0, &r1, 10.0), (&p0, &p1, 5.0), 0),
            PerChange::default()
        );
    }

    #[test]
    fn only_commands_flagged_write_count() {
        use redis::Value::{Array, Int, SimpleString};
        let info = |flag: &str| {
            Array(vec![Array(vec![
                SimpleString("x".into()),
                Int(-3),
                Array(vec![SimpleString(flag.into()), SimpleString("fast".into())]),
            ])])
        };
        assert!(command_is_write(&info("write")));
        assert!(!command_is_write(&info("readonly")));
        assert!(!command_is_write(&Array(vec![redis::Value::Nil])));
    }
}
