//! A heap profile of idle client sessions by allocation site, for BENCHMARKS.md ("Where an
//! idle session's bytes are"): which code holds the bytes an idle session costs.
//!
//! Not a check (it asserts only that the profile was taken): it is run by hand,
//!
//! ```sh
//! HEAP_PROFILE_DIR=bench/results/<dir> cargo test --test heap_profile -- --ignored --nocapture
//! ```
//!
//! The server runs in this process with dhat's allocator; the clients in a child process
//! (`tests/fleet`). `WARM` sessions log in first, so the pools, caches and maps that grow
//! once are in place; then dhat starts, `HEAP_PROFILE_SESSIONS` more sessions (default 500)
//! log in, fetch the roster, send initial presence and go idle, and dhat stops while they
//! are all still connected. With `HEAP_PROFILE_CONTACTS=K` (even, default 0) each profiled
//! session has K mutual contacts among the others (a ring: the K/2 users after it and the
//! K/2 before), all online, and dhat stops once every one has been shown to each of its
//! contacts. Its `eb` per allocation site (bytes still allocated at the end,
//! allocated while it ran) is therefore what those idle sessions hold, plus whatever the
//! node's shared structures grew by meanwhile. `bench/heap_table.py` turns the written
//! `dhat-heap.json` into the table, per session.

mod common;
mod fleet;

use std::path::PathBuf;

use fleet::Fleet;

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

/// Sessions logged in before the profile starts (as `tests/session_memory.rs`).
const WARM: usize = 20;

/// Run as a child process by the profile below ([`fleet::client_fleet`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run as a child process by the heap profile"]
async fn client_fleet() {
    fleet::client_fleet().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a profile, not a check: run by hand (see the module's comment)"]
async fn heap_profile_of_idle_sessions() {
    let sessions: usize = common::env_or("HEAP_PROFILE_SESSIONS", 500);
    let dir = PathBuf::from(
        std::env::var("HEAP_PROFILE_DIR").unwrap_or_else(|_| "target/heap-profile".into()),
    );
    let contacts: usize = common::env_or("HEAP_PROFILE_CONTACTS", 0);
    assert!(
        contacts % 2 == 0 && contacts < sessions,
        "HEAP_PROFILE_CONTACTS must be even and below the number of sessions"
    );
    std::fs::create_dir_all(&dir).unwrap();
    let mut fleet = Fleet::start(&[("u", WARM), ("u", sessions)]).await;
    fleet.ring("u", WARM, sessions, contacts).await;
    fleet.batch_done(WARM, 0).await;
    let profiler = dhat::Profiler::builder()
        .file_name(dir.join("dhat-heap.json"))
        .trim_backtraces(Some(40))
        .build();
    fleet.next_batch();
    // Every profiled session was shown to each of its contacts (its broadcast or their
    // probes) before the profile ends.
    fleet.batch_done(WARM + sessions, sessions * contacts).await;
    let stats = dhat::HeapStats::get();
    let build = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let per = stats.curr_bytes as f64 / sessions as f64;
    println!(
        "{sessions} idle sessions with {contacts} contacts each: {} B live allocated while profiling, {per:.0} B per session ({build} build)",
        stats.curr_bytes
    );
    std::fs::write(
        dir.join("profile.json"),
        format!(
            "{{\"sessions\": {sessions}, \"contacts\": {contacts}, \"warm\": {WARM}, \"build\": \"{build}\", \"live_bytes\": {}, \"live_blocks\": {}}}\n",
            stats.curr_bytes, stats.curr_blocks
        ),
    )
    .unwrap();
    // Written on drop, while every profiled session is still connected.
    drop(profiler);
    fleet.stop().await;
    assert!(dir.join("dhat-heap.json").exists());
    assert!(stats.curr_bytes > 0);
}
