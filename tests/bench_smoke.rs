//! CI smoke run of the load generator against this server (issue 7): tiny N, so the
//! generator and its presenced provisioning cannot rot. No timing is asserted; the run fails
//! only if logins or presence deliveries fail entirely.

mod common;

use common::*;
use std::time::Duration;

#[tokio::test]
async fn load_generator_smoke_run_logs_in_and_delivers_presence() {
    let ts = TestServer::start(|c| {
        c.limits.stanzas_per_second = 10_000;
        c.limits.stanza_burst = 10_000;
    })
    .await;
    let bench = env!("CARGO_BIN_EXE_presenced-bench");
    let target = ts.addr.to_string();
    let common = [
        "--server",
        "presenced",
        "--target",
        &target,
        "--domain",
        &ts.domain,
        "--smoke",
    ];
    let provision = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new(bench)
            .args(common)
            .args(["--provision", "--provision-db", &database_url()])
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
    let run = tokio::time::timeout(
        Duration::from_secs(180),
        tokio::process::Command::new(bench).args(common).output(),
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
    ts.stop().await;
}
