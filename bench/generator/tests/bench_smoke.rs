//! CI smoke runs of the load generator against this server: tiny N, so the
//! generator, its presenced provisioning and its multi-process mode cannot rot. No timing
//! is asserted; the runs fail only if logins or deliveries fail or their counts do not add up.

// The server's own test harness: a real presenced on loopback ports.
#[path = "../../../tests/common/mod.rs"]
mod common;

use common::*;
use std::time::Duration;

/// Provisions the server's users through the generator's store path.
async fn provision<S: AsRef<std::ffi::OsStr>>(bench: &str, common: &[S]) {
    provision_into(bench, common, &database_url()).await
}

/// [`provision`] into the database at `db_url`.
async fn provision_into<S: AsRef<std::ffi::OsStr>>(bench: &str, common: &[S], db_url: &str) {
    let provision = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new(bench)
            .args(common)
            .args(["--provision", "--provision-db", db_url])
            .output(),
    )
    .await
    .expect("provisioning finishes")
    .expect("bench runs");
    assert!(
        provision.status.success(),
        "provisioning failed: {}",
        String::from_utf8_lossy(&provision.stderr)
    );
}

/// A server without stanza rate limits, its users provisioned at the smoke size, and the
/// generator's arguments that name it.
async fn smoke_server() -> (TestServer, Vec<String>) {
    let ts = TestServer::start(|c| {
        c.limits.stanzas_per_second = 10_000;
        c.limits.stanza_burst = 10_000;
    })
    .await;
    let common = server_args(&ts, &["--smoke"]);
    provision(env!("CARGO_BIN_EXE_presenced-bench"), &common).await;
    (ts, common)
}

/// The generator's arguments that name the server under test, then `size` (the users).
fn server_args(ts: &TestServer, size: &[&str]) -> Vec<String> {
    let target = ts.addr.to_string();
    let mut args = [
        "--server",
        "presenced",
        "--target",
        &target,
        "--domain",
        &ts.domain,
    ]
    .map(str::to_owned)
    .to_vec();
    args.extend(size.iter().map(|a| (*a).to_owned()));
    args
}

/// Runs the generator with `args` (at most 180 s) and its JSON report written to a file of
/// its own; requires success and returns the report and the generator's stderr.
async fn run_for_json(bench: &str, name: &str, args: &[&str]) -> (String, String) {
    let dir = std::env::temp_dir().join(format!("bench-smoke-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let json_path = dir.join("report.json");
    let run = tokio::time::timeout(
        Duration::from_secs(180),
        tokio::process::Command::new(bench)
            .args(args)
            .arg("--json")
            .arg(&json_path)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("run finishes")
    .expect("bench runs");
    let out = String::from_utf8_lossy(&run.stdout);
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{name} run failed:\n{out}\n{err}");
    let json = std::fs::read_to_string(&json_path).expect("json report");
    let _ = std::fs::remove_dir_all(&dir);
    (json, err.into_owned())
}

/// The value of a top-level number field in the generator's JSON report.
fn json_num(json: &str, key: &str) -> Option<f64> {
    let at = json.find(&format!("\"{key}\": "))? + key.len() + 4;
    let rest = &json[at..];
    let end = rest.find([',', '\n']).unwrap_or(rest.len());
    rest[..end].trim().parse().ok()
}

/// The latency ladder's points in the generator's JSON report, one line each.
fn ladder_points(json: &str) -> Vec<&str> {
    json.lines()
        .filter(|l| l.trim_start().starts_with("{\"rate_changes_per_s\": "))
        .collect()
}

/// Each ladder point of `json` offered its rate (`rates`, changes/s) for `secs` and every
/// change reached its `k` watchers.
fn assert_ladder_delivered(json: &str, rates: &[f64], secs: f64, k: f64, what: &str) {
    let points = ladder_points(json);
    assert_eq!(points.len(), rates.len(), "{what}: {json}");
    for (line, &rate) in points.iter().zip(rates) {
        let n = |key: &str| json_num(line, key).unwrap_or_else(|| panic!("{key} in {line}"));
        assert_eq!(n("rate_changes_per_s"), rate, "{what}: {line}");
        assert_eq!(n("sent"), rate * secs, "{what}: {line}");
        assert_eq!(n("delivered"), n("sent") * k, "{what}: {line}");
        assert!(line.contains("\"sustained\": true"), "{what}: {line}");
        assert!(n("p99_ms") >= n("p50_ms"), "{what}: {line}");
    }
}

#[tokio::test]
async fn load_generator_smoke_run_logs_in_and_delivers_presence() {
    let (ts, common) = smoke_server().await;
    let bench = env!("CARGO_BIN_EXE_presenced-bench");
    let dir = std::env::temp_dir().join(format!("bench-smoke1-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let json_path = dir.join("smoke.json");
    // No write-rate source (as for the peers): the idle window is still kept, so every
    // server's load phases start at the same offset after logins.
    let run = tokio::time::timeout(
        Duration::from_secs(180),
        tokio::process::Command::new(bench)
            .args(common)
            .args(["--rest-secs", "2"])
            // The latency ladder: a quarter and half of 120 deliveries/s at K = 3.
            .args([
                "--fixed-fractions",
                "0.25,0.5",
                "--fractions-of",
                "120",
                "--json",
            ])
            .arg(&json_path)
            .output(),
    )
    .await
    .expect("smoke run finishes")
    .expect("bench runs");
    let out = String::from_utf8_lossy(&run.stdout);
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "smoke run failed:\n{out}\n{err}");
    assert!(
        out.contains("smoke: OK") || err.contains("smoke: OK"),
        "{out}\n{err}"
    );
    let json = std::fs::read_to_string(&json_path).expect("json report");
    let _ = std::fs::remove_dir_all(&dir);
    let rest = json_num(&json, "rest_secs").expect("rest_secs");
    assert!((2.0..10.0).contains(&rest), "idle window kept: {json}");
    assert!(
        json.contains("\"redis_writes_per_session_per_min\": null"),
        "{json}"
    );
    // Saturation: every delivery owed arrived, once.
    let n = |k: &str| json_num(&json, k).unwrap_or_else(|| panic!("{k} in {json}"));
    assert!(n("sat_expected") > 0.0, "{json}");
    assert_eq!(n("sat_received"), n("sat_expected"), "{json}");
    assert_eq!((n("sat_missing"), n("sat_repeated")), (0.0, 0.0), "{json}");
    // --smoke: 2 s per rate; 10 and 20 changes/s, each reaching all 3 watchers.
    assert_ladder_delivered(&json, &[10.0, 20.0], 2.0, 3.0, "presenced");
    assert!(
        json.contains("\"fraction\": 0.25, \"fraction_of_deliveries_per_s\": 120,"),
        "{json}"
    );
    ts.stop().await;
}

/// A server without stanza rate limits whose liveness works throughout a window at rest:
/// idle clients are pinged after 1 s of silence and their answers refresh Redis at most
/// every 0.5 s, the sweeper runs every 0.5 s and last seen is flushed every 0.2 s; T = 8 s
/// leaves slow (loaded, debug-built) clients time to answer.
fn liveness_at_work(c: &mut presenced::config::Config) {
    c.limits.stanzas_per_second = 10_000;
    c.limits.stanza_burst = 10_000;
    c.liveness.heartbeat_interval = Duration::from_secs(1);
    c.liveness.ttl = Duration::from_secs(8);
    c.liveness.grace = Duration::from_secs(1);
    c.liveness.redis_refresh = Duration::from_millis(500);
    c.liveness.sweep_interval = Duration::from_millis(500);
    c.liveness.last_seen_flush = Duration::from_millis(200);
}

/// `--procs 2`: two worker processes each own half of the users. With N = 20 and K = 3 every
/// user's third contact is the user opposite in the ring, i.e. in the other process, so all
/// sessions seeing all their contacts and every change reaching its K watchers proves that
/// presences cross the process boundary and that the parent merges the counts. The idle
/// window at rest reads the server's /metrics and Redis/PostgreSQL statistics.
#[tokio::test]
async fn load_generator_split_over_two_processes_merges_their_counts() {
    let ts = TestServer::start(liveness_at_work).await;
    let bench = env!("CARGO_BIN_EXE_presenced-bench");
    let common = server_args(&ts, &["--smoke"]);
    provision(bench, &common).await;
    let metrics = format!("http://{}/metrics", ts.admin_addr());
    let db_url = database_url();
    let db_name = db_url.rsplit('/').next().expect("db name").to_string();
    let redis = redis_url();
    let mut args: Vec<&str> = common.iter().map(String::as_str).collect();
    args.extend([
        "--procs",
        "2",
        "--rest-secs",
        "3",
        "--metrics-url",
        &metrics,
    ]);
    args.extend([
        "--redis-stats",
        &redis,
        "--pg-stats",
        &db_url,
        "--pg-stats-db",
        &db_name,
    ]);
    let (json, err) = run_for_json(bench, "split", &args).await;
    let n = |k: &str| json_num(&json, k).unwrap_or_else(|| panic!("{k} in {json}\n{err}"));
    assert_eq!(n("procs"), 2.0);
    // What the logins negotiated crosses the worker pipe: TLS 1.3 and a SCRAM mechanism.
    assert!(
        json.contains("\"negotiated\": [\"TLSv1_3 TLS13_") && json.contains(" SCRAM-SHA-"),
        "{json}"
    );
    assert_eq!(n("logins_ok"), 20.0, "{json}\n{err}");
    assert_eq!(n("sessions_all_contacts_seen"), 20.0, "{json}\n{err}");
    // --smoke offers 20 changes/s for 2 s, split between the processes: exactly 40.
    assert_eq!(n("fixed_sent"), 40.0, "{json}");
    // Every change fans out to K = 3 watchers, some in the other process, and every one
    // must arrive: a broken merge of the two processes' counts would lose about half.
    let (sent, delivered) = (n("fixed_sent"), n("fixed_delivered"));
    assert_eq!(delivered, sent * 3.0, "{json}\n{err}");
    assert!(n("sat_delivered") > 0.0, "{json}");
    assert!(n("redis_writes_per_session_per_min") > 0.0, "{json}\n{err}");
    // A shared Redis: commandstats count other clients too, so only "at least presenced's".
    assert!(
        n("redis_write_cmds_per_session_per_min") > 0.0,
        "{json}\n{err}"
    );
    // PostgreSQL at rest is reported (the figure the benchmark compares); its value is the
    // benchmark's business, its presence and sanity the smoke test's. (Its commits need a
    // longer window: they are read once the database has settled for 11 s.)
    let pg = n("pg_statements_per_session_per_min");
    assert!(pg.is_finite() && pg >= 0.0, "{json}\n{err}");
    ts.stop().await;
}

/// The PostgreSQL figures at rest count what the server does at rest, and nothing of the
/// login storm before it. PostgreSQL publishes an idle backend's `pg_stat_database`
/// counters up to 10 s after its last transaction; read at the start of the window, the
/// logins' commits arrived inside it and were counted as work at rest, while a statement
/// log showed none. The server has a database of its own here, so everything counted is
/// its, and its liveness runs fast (pings, refreshes, sweeps, last-seen flushes many times
/// over the window), none of which may touch PostgreSQL.
#[tokio::test]
async fn the_window_at_rest_counts_no_postgresql_work_of_the_logins() {
    let base = database_url();
    let own = format!(
        "{}_rest_{}",
        base.rsplit('/').next().expect("db name"),
        unique()
    );
    let db_url = stores::postgres_url_for(&own);
    let maintenance = stores::postgres_url_for("postgres");
    let ts = TestServer::start(|c| {
        liveness_at_work(c);
        c.database.url = db_url.clone();
    })
    .await;
    let bench = env!("CARGO_BIN_EXE_presenced-bench");
    let common = server_args(&ts, &["-n", "20", "-k", "3"]);
    provision_into(bench, &common, &db_url).await;
    // 20 s at rest: the counters' part of the window starts once every backend has been
    // idle for 11 s, which leaves several seconds of it.
    let mut args: Vec<&str> = common.iter().map(String::as_str).collect();
    args.extend([
        "--idle-secs",
        "0",
        "--settle-secs",
        "10",
        "--rest-secs",
        "20",
    ]);
    args.extend(["--fixed-rate", "20", "--fixed-secs", "1", "--sat-secs", "0"]);
    args.extend(["--pg-stats", &maintenance, "--pg-stats-db", &own]);
    let (json, err) = run_for_json(bench, "rest", &args).await;
    let n = |k: &str| json_num(&json, k).unwrap_or_else(|| panic!("{k} in {json}\n{err}"));
    assert_eq!(n("logins_ok"), 20.0, "{json}\n{err}");
    assert_eq!(n("pg_xacts_per_session_per_min"), 0.0, "{json}\n{err}");
    assert_eq!(n("pg_rows_per_session_per_min"), 0.0, "{json}\n{err}");
    assert_eq!(n("pg_statements_at_rest"), 0.0, "{json}\n{err}");
    ts.stop().await;
    use sqlx::Connection;
    let mut c = sqlx::PgConnection::connect(&maintenance)
        .await
        .expect("maintenance database");
    sqlx::query(&format!("DROP DATABASE IF EXISTS {own} WITH (FORCE)"))
        .execute(&mut c)
        .await
        .expect("drop the test's database");
}

/// A number field of one line of the soak's counter log.
fn line_num(line: &str, key: &str) -> u64 {
    let at = line
        .find(&format!("\"{key}\":"))
        .unwrap_or_else(|| panic!("{key} in {line}"))
        + key.len()
        + 3;
    let rest = &line[at..];
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    rest[..end]
        .parse()
        .unwrap_or_else(|_| panic!("{key} in {line}"))
}

/// `--soak-secs`: the soak mode of reliability/soak.sh at N = 20. Sessions reconnect by
/// closing their stream (drop fraction 0) while messages and presence flow; the leaving
/// client reads until the server's stream close, and a message for a user between two
/// sessions is kept offline and handed out at the next login, so every message sent must be
/// received or bounced: the soak's message accounting adds up and loses nothing.
#[tokio::test]
async fn soak_mode_reconnects_and_accounts_for_every_message() {
    let ts = TestServer::start(|c| {
        c.limits.stanzas_per_second = 10_000;
        c.limits.stanza_burst = 10_000;
        c.limits.connections_per_ip_per_minute = 100_000;
    })
    .await;
    let bench = env!("CARGO_BIN_EXE_presenced-bench");
    let common = server_args(&ts, &["-n", "20", "-k", "3"]);
    provision(bench, &common).await;
    let dir = std::env::temp_dir().join(format!("bench-soak-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let log = dir.join("soak.jsonl");
    let run = tokio::time::timeout(
        Duration::from_secs(180),
        tokio::process::Command::new(bench)
            .args(common)
            .args([
                "--soak-secs",
                "8",
                "--churn-per-min",
                "3",
                "--drop-fraction",
                "0",
            ])
            .args(["--soak-presence-rate", "5", "--soak-message-rate", "10"])
            .args([
                "--probe-rate",
                "2",
                "--sample-secs",
                "2",
                "--drain-secs",
                "10",
            ])
            .arg("--soak-log")
            .arg(&log)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("soak run finishes")
    .expect("bench runs");
    let err = String::from_utf8_lossy(&run.stderr);
    let text = std::fs::read_to_string(&log).expect("soak log");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(run.status.success(), "soak run failed:\n{text}\n{err}");
    let end = text
        .lines()
        .find(|l| l.contains("\"kind\":\"end\""))
        .unwrap_or_else(|| panic!("no end line:\n{text}"));
    let n = |k: &str| line_num(end, k);
    assert_eq!(n("online"), 20, "{end}");
    // 20 sessions × 3 per minute for 8 s: about 8 reconnects.
    assert!(n("reconnects") >= 2, "{end}");
    assert_eq!(n("logins"), 20 + n("reconnects"), "{end}");
    assert_eq!(n("sessions_lost"), 0, "{end}");
    assert!(n("msg_sent") >= 40, "{end}");
    assert!(n("presence_delivered") > 0, "{end}");
    assert_eq!(
        n("msg_sent"),
        n("msg_received") + n("msg_bounced"),
        "every message received or bounced: {end}"
    );
    assert!(
        text.lines()
            .filter(|l| l.contains("\"kind\":\"sample\""))
            .count()
            >= 3
    );
    ts.stop().await;
}

/// `--csi`: the client state indication workload at N = 20, K = 3. Every other user goes
/// inactive (XEP-0352) while the others change presence: presenced holds all of it (an
/// inactive client receives none while idle, fewer than when all were active), and after
/// `<active/>` each inactive client has the latest presence of every contact that changed.
/// In the third window the inactive clients name one changing contact in an interest list:
/// its presence passes at once, the rest is held.
#[tokio::test]
async fn csi_mode_holds_presence_for_inactive_clients_and_loses_none() {
    let (ts, common) = smoke_server().await;
    let bench = env!("CARGO_BIN_EXE_presenced-bench");
    let dir = std::env::temp_dir().join(format!("bench-csi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let json_path = dir.join("csi.json");
    let run = tokio::time::timeout(
        Duration::from_secs(180),
        tokio::process::Command::new(bench)
            .args(common)
            .args(["--rest-secs", "0", "--csi", "--csi-interest", "1", "--json"])
            .arg(&json_path)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("csi run finishes")
    .expect("bench runs");
    let out = String::from_utf8_lossy(&run.stdout);
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "csi run failed:\n{out}\n{err}");
    assert!(out.contains("csi: OK"), "{out}\n{err}");
    let json = std::fs::read_to_string(&json_path).expect("json report");
    let _ = std::fs::remove_dir_all(&dir);
    let n = |k: &str| json_num(&json, k).unwrap_or_else(|| panic!("{k} in {json}\n{err}"));
    // --smoke: 20 changes/s for 2 s from the 10 odd users; an even user has 2 odd contacts.
    let baseline = n("csi_baseline_per_client");
    assert!(baseline > 0.0, "{json}");
    assert_eq!(n("csi_inactive_per_client"), 0.0, "all held: {json}");
    assert!(n("csi_active_per_client") > 0.0, "{json}");
    assert_eq!(n("csi_reduction_pct"), 100.0, "{json}");
    assert!(n("csi_flushed_per_inactive_client") > 0.0, "{json}");
    assert!(n("csi_checked") > 0.0, "{json}");
    assert_eq!(n("csi_lost"), 0.0, "{json}\n{err}");
    // Interest lists: accepted by every inactive client; the named contact passes at once.
    assert_eq!(n("csi_interest_lists_ok"), 10.0, "{json}\n{err}");
    let interest = n("csi_interest_inactive_per_client");
    assert!(interest > 0.0 && interest < baseline, "{json}");
    assert!(n("csi_interest_checked") > 0.0, "{json}");
    assert_eq!(n("csi_interest_lost"), 0.0, "{json}\n{err}");
    ts.stop().await;
}

/// The peers provisioned by writing their storage (`--provision-files`: Prosody's data
/// directory, and the same files imported into ejabberd's Mnesia) serve exactly the
/// workload's users: bench/run.sh's smoke run against a real Prosody and a real ejabberd
/// demands every login (SCRAM with the written credentials), every contact seen available
/// (the written rosters, mutual) and every presence change delivered to its K watchers.
#[tokio::test]
async fn peers_provisioned_by_written_storage_pass_the_smoke_run() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let work = std::env::temp_dir().join(format!("bench-peers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let run = tokio::time::timeout(
        Duration::from_secs(600),
        tokio::process::Command::new("bash")
            .arg(repo.join("bench/run.sh"))
            .arg("--smoke")
            .env("BENCH_BIN", env!("CARGO_BIN_EXE_presenced-bench"))
            .env("BENCH_WORK", &work)
            .env("SERVERS", "prosody ejabberd")
            .env("PROSODY_PORT", free_port().to_string())
            .env("EJABBERD_PORT", free_port().to_string())
            .env(
                "EJABBERD_NODE",
                format!("ejabberd-smoke-{}@localhost", std::process::id()),
            )
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("smoke run against the peers finishes")
    .expect("bash runs");
    let out = String::from_utf8_lossy(&run.stdout);
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "peers' smoke run failed:\n{out}\n{err}"
    );
    // bench/ratio.py prints the ladder's rows for the peers.
    assert!(
        out.contains("| 10 changes/s (30 deliveries/s, 25 %) | p99 (ms) |"),
        "{out}"
    );
    for peer in ["prosody", "ejabberd"] {
        let path = work.join(format!("results/{peer}.json"));
        let json = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}\n{err}", path.display()));
        let n = |k: &str| json_num(&json, k).unwrap_or_else(|| panic!("{k} in {json}"));
        assert_eq!(n("logins_ok"), 20.0, "{peer}: {json}\n{err}");
        assert_eq!(
            n("sessions_all_contacts_seen"),
            20.0,
            "{peer}: {json}\n{err}"
        );
        assert_eq!(
            n("fixed_delivered"),
            n("fixed_sent") * 3.0,
            "{peer}: {json}"
        );
        // bench/run.sh --smoke's latency ladder: 25, 50 and 75 % of 120 deliveries/s.
        assert_ladder_delivered(&json, &[10.0, 20.0, 30.0], 2.0, 3.0, peer);
        // Provisioning wrote the files; no registration over XMPP took place.
        assert!(
            err.contains(&format!("{peer}: provisioning N=20 K=3")) && err.contains("written to"),
            "{peer}: {err}"
        );
    }
    let _ = std::fs::remove_dir_all(&work);
}

/// `--storm cut,restart` at N = 20, K = 3: every client socket closed at once, then the
/// server stopped and started again on the same port, database and Redis (this test plays
/// bench/run.sh's part: the stop time, the restart, the new listener). Every session must
/// come back with its presence of that storm at each of its watchers. No returning client
/// tries before the back-off's minimum of 1 s, so a restore counted sooner would be a
/// presence from before the storm.
#[tokio::test]
async fn storm_mode_brings_every_session_back_after_a_cut_and_a_restart() {
    let port = free_port();
    let tweak = move |c: &mut presenced::config::Config| {
        c.limits.stanzas_per_second = 10_000;
        c.limits.stanza_burst = 10_000;
        c.limits.connections_per_ip_per_minute = 100_000;
        c.c2s.port = port;
    };
    let ts = TestServer::start(tweak).await;
    let domain = ts.domain.clone();
    let bench = env!("CARGO_BIN_EXE_presenced-bench");
    let common = server_args(&ts, &["--smoke"]);
    provision(bench, &common).await;
    let dir = std::env::temp_dir().join(format!("bench-storm-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let json_path = dir.join("storm.json");
    let storm_dir = dir.join("storm");
    let mut gen = tokio::process::Command::new(bench)
        .args(&common)
        .args(["--storm", "cut,restart", "--storm-dir"])
        .arg(&storm_dir)
        .arg("--json")
        .arg(&json_path)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("bench runs");
    // The restart, when the generator asks for it (after the cut storm).
    let restart = storm_dir.join("restart");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(150);
    let mut ts = Some(ts);
    while !restart.exists() {
        assert!(tokio::time::Instant::now() < deadline, "no restart request");
        if let Ok(Some(status)) = gen.try_wait() {
            panic!("the generator ended before asking for the restart: {status}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let now_ns = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    };
    std::fs::write(storm_dir.join("stop_ns"), format!("{}\n", now_ns())).expect("stop_ns");
    ts.take().expect("running").stop().await;
    let ts = TestServer::start_with_domain(&domain, tweak).await;
    assert_eq!(ts.addr.port(), port);
    // No PID: the server runs in this test's process, whose RSS is not the server's.
    std::fs::write(storm_dir.join("pids"), format!("{}\n", now_ns())).expect("pids");
    let run = tokio::time::timeout(Duration::from_secs(200), gen.wait_with_output())
        .await
        .expect("storm run finishes")
        .expect("bench runs");
    let out = String::from_utf8_lossy(&run.stdout);
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "storm run failed:\n{out}\n{err}");
    let json = std::fs::read_to_string(&json_path).expect("json report");
    let _ = std::fs::remove_dir_all(&dir);
    let n = |k: &str| json_num(&json, k).unwrap_or_else(|| panic!("{k} in {json}\n{err}"));
    assert_eq!(n("logins_ok"), 20.0, "{json}");
    for cause in ["cut", "restart"] {
        let f = |k: &str| n(&format!("{cause}_{k}"));
        assert_eq!(f("back"), 20.0, "{cause}: {json}\n{err}");
        assert_eq!(f("restored"), 20.0, "{cause}: {json}\n{err}");
        assert!(f("attempts") >= 20.0, "{cause}: {json}");
        let (p99, all) = (f("restored_99_s"), f("restored_100_s"));
        assert!(p99 >= 1.0 && p99 <= all, "{cause}: {json}");
        assert!(f("back_100_s") >= 1.0, "{cause}: {json}");
        // Watched past the 1 s grace after the last restore.
        assert_eq!(f("watched_s"), 3.0, "{cause}: {json}");
    }
    // A client back within the grace period is never announced gone.
    assert_eq!(n("cut_taken_back"), 0.0, "{json}\n{err}");
    assert!(n("restart_server_down_s") >= 0.0, "{json}");
    ts.stop().await;
}

/// `--login fast --storm relogin` at N = 6, K = 2: the first logins are SASL2 with the
/// password asking for a XEP-0484 token, then every client closes its stream and logs in
/// again with its token (HT-SHA-256-NONE, Bind 2 inline) over a TLS 1.3 session resumed
/// with a ticket, and comes back with its presence at each of its watchers.
#[tokio::test]
async fn fast_login_mode_reconnects_with_its_token_over_a_resumed_tls_session() {
    let ts = TestServer::start(|c| {
        c.limits.stanzas_per_second = 10_000;
        c.limits.stanza_burst = 10_000;
    })
    .await;
    let bench = env!("CARGO_BIN_EXE_presenced-bench");
    let common = server_args(&ts, &["-n", "6", "-k", "2"]);
    provision(bench, &common).await;
    let mut args: Vec<&str> = common.iter().map(String::as_str).collect();
    args.extend(["--storm", "relogin", "--login", "fast"]);
    args.extend(["--storm-wait", "60", "--settle-secs", "10"]);
    let (json, err) = run_for_json(bench, "fast", &args).await;
    let n = |k: &str| json_num(&json, k).unwrap_or_else(|| panic!("{k} in {json}\n{err}"));
    assert_eq!(n("logins_ok"), 6.0, "{json}");
    // The first logins used the password (and a full handshake: no ticket yet).
    assert_eq!(n("first_logins"), 6.0, "{json}");
    assert_eq!(n("first_fast"), 0.0, "{json}");
    assert_eq!(n("first_resumed"), 0.0, "{json}");
    // Every reconnect: the token, over a resumed session, and presence restored.
    assert_eq!(n("relogin_logins"), 6.0, "{json}\n{err}");
    assert_eq!(n("relogin_fast"), 6.0, "{json}\n{err}");
    assert_eq!(n("relogin_resumed"), 6.0, "{json}\n{err}");
    assert_eq!(n("relogin_restored"), 6.0, "{json}\n{err}");
    assert!(json.contains("HT-SHA-256-NONE"), "{json}");
    ts.stop().await;
}

/// `--login fast-resume --storm cut,relogin` at N = 6, K = 2: the first logins enable
/// XEP-0198 with resumption inside Bind 2; after the cut and again in the relogin window
/// (sockets closed without a stream close, then a pause past the grace and the liveness
/// TTL) every client authenticates with its FAST token over a resumed TLS session and
/// resumes its session inline, sends no roster get and no presence, and no watcher is told
/// of an end: every session counts as restored by its resumption alone, none taken back.
#[tokio::test]
async fn fast_resume_login_mode_resumes_every_session_inline_with_no_presence_flap() {
    let ts = TestServer::start(|c| {
        c.limits.stanzas_per_second = 10_000;
        c.limits.stanza_burst = 10_000;
    })
    .await;
    let bench = env!("CARGO_BIN_EXE_presenced-bench");
    let common = server_args(&ts, &["-n", "6", "-k", "2"]);
    provision(bench, &common).await;
    let mut args: Vec<&str> = common.iter().map(String::as_str).collect();
    args.extend(["--storm", "cut,relogin", "--login", "fast-resume"]);
    args.extend([
        "--storm-wait",
        "60",
        "--settle-secs",
        "10",
        "--storm-watch",
        "3",
    ]);
    args.extend(["--backoff-min", "0.5", "--backoff-max", "1"]);
    let (json, err) = run_for_json(bench, "fast-resume", &args).await;
    let n = |k: &str| json_num(&json, k).unwrap_or_else(|| panic!("{k} in {json}\n{err}"));
    assert_eq!(n("logins_ok"), 6.0, "{json}");
    assert_eq!(n("first_logins"), 6.0, "{json}");
    assert_eq!(n("first_sm_resumed"), 0.0, "{json}");
    assert!(n("sm_window_s") > 12.0, "{json}");
    for storm in ["cut", "relogin"] {
        let m = |k: &str| n(&format!("{storm}_{k}"));
        assert_eq!(m("logins"), 6.0, "{storm}: {json}\n{err}");
        assert_eq!(m("fast"), 6.0, "{storm}: {json}\n{err}");
        assert_eq!(m("resumed"), 6.0, "{storm}: {json}\n{err}");
        assert_eq!(m("sm_resumed"), 6.0, "{storm}: {json}\n{err}");
        assert_eq!(m("sm_failed"), 0.0, "{storm}: {json}\n{err}");
        assert_eq!(m("restored"), 6.0, "{storm}: {json}\n{err}");
        // Watched past the grace after the last resumption: nobody was told of an end.
        assert_eq!(m("taken_back"), 0.0, "{storm}: {json}\n{err}");
    }
    ts.stop().await;
}
