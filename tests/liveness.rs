//! Liveness against the real server, PostgreSQL and Redis, with scaled-down
//! timings (`fast_liveness`: H = 0.4 s, T = 2 s, G = 0.6 s, sweep 0.2 s, refresh 0.6 s).
//! Every wait has an explicit bound derived from those numbers.
//!
//! The behaviours that do not depend on where the resource state lives (silent death within
//! T plus one sweep, nothing announced for a reconnect within G, last seen written once, one
//! write per refresh) run once per backend: on Redis and in process (no `[redis] url`).
//! Cross-node handover, crashed nodes, key expiries and Redis outages are Redis's own.
//!
//! These tests keep real time: they run real sockets, PostgreSQL and Redis (which expires
//! keys on its own clock), and on paused tokio time the runtime would jump to the next timer
//! whenever it waits for them, firing timeouts early. The grace, TTL, sweep and refresh
//! decisions themselves are tested on paused time next to the code (`liveness::tests`).

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use presenced::protocol::xml::{Element, NS_CLIENT, NS_DELAY, NS_PING};

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

/// The server's `[liveness]` timings in seconds, for the bounds arithmetic below.
struct Timings {
    heartbeat_interval: f64,
    ttl: f64,
    grace: f64,
    sweep_interval: f64,
    redis_refresh: f64,
    last_seen_flush: f64,
}

fn timings(ts: &TestServer) -> Timings {
    let l = &ts.config.liveness;
    Timings {
        heartbeat_interval: l.heartbeat_interval.as_secs_f64(),
        ttl: l.ttl.as_secs_f64(),
        grace: l.grace.as_secs_f64(),
        sweep_interval: l.sweep_interval.as_secs_f64(),
        redis_refresh: l.redis_refresh.as_secs_f64(),
        last_seen_flush: l.last_seen_flush.as_secs_f64(),
    }
}

/// Logs in `name`/`res`, sends initial presence and waits for its own echo.
async fn online(ts: &TestServer, name: &str, res: &str) -> Client {
    let mut c = ts.login(name, res).await;
    c.presence(None, None).await;
    c.expect(|e| is_presence(e, &c_jid(ts, name, res), None))
        .await;
    c
}

fn c_jid(ts: &TestServer, name: &str, res: &str) -> String {
    format!("{}/{res}", ts.jid(name))
}

/// Where a test server keeps its liveness state.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Backend {
    Redis,
    InProcess,
}

/// Fast liveness timings on `backend`.
fn fast_on(backend: Backend) -> impl FnOnce(&mut presenced::config::Config) {
    move |c| {
        fast_liveness(c);
        if backend == Backend::InProcess {
            without_redis(c);
        }
    }
}

/// Starts a test server on `backend` and checks it runs there.
async fn start_on(backend: Backend) -> TestServer {
    let ts = TestServer::start(fast_on(backend)).await;
    let on_redis = ts.shared().liveness.redis().is_some();
    assert_eq!(on_redis, backend == Backend::Redis, "{backend:?}");
    ts
}

/// Declares `$redis` and `$in_process` tests running `$body(backend)`.
macro_rules! on_both_backends {
    ($body:ident, $redis:ident, $in_process:ident) => {
        #[tokio::test]
        async fn $redis() {
            $body(Backend::Redis).await
        }
        #[tokio::test]
        async fn $in_process() {
            $body(Backend::InProcess).await
        }
    };
}

/// The newest beat the in-process table holds for `full`.
fn in_process_beat(ts: &TestServer, full: &str) -> Option<i64> {
    match &ts.shared().liveness.backend {
        presenced::liveness::Backend::InProcess(t) => t.beat_of(full),
        presenced::liveness::Backend::Redis(_) => None,
    }
}

/// Sends a ping to the server and waits for the answer; returns the instant just before
/// sending, which bounds the server's record of this client's last beat from below.
async fn last_words(c: &mut Client) -> Instant {
    let before = Instant::now();
    let r = c.iq("get", None, Element::new("ping", NS_PING)).await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    before
}

/// Alice and bob, mutually subscribed and both online, bob having seen alice come online.
async fn alice_watched_by_bob(ts: &TestServer) -> (Client, Client) {
    ts.user("alice").await;
    ts.user("bob").await;
    ts.make_mutual("alice", "bob").await;
    let mut bob = online(ts, "bob", "pc").await;
    let alice = online(ts, "alice", "phone").await;
    bob.expect(|e| is_presence(e, &alice.jid, None)).await;
    (alice, bob)
}

/// A silent client is announced between T-H and T plus one sweep period after its last beat
/// (the bounds README.md promises), plus `slack` seconds for the round trips of the test.
fn assert_announced_in_time(l: &Timings, after: f64, slack: f64) {
    assert!(
        after >= l.ttl - l.heartbeat_interval,
        "announced {after:.2}s after the last beat, before T-H"
    );
    assert!(
        after <= l.ttl + l.sweep_interval + slack,
        "announced {after:.2}s after the last beat, later than T + one sweep"
    );
}

on_both_backends!(silent_client, silent_client_is_announced_between_t_minus_h_and_t_plus_a_sweep_with_last_seen_at_last_beat, in_process_silent_client_is_announced_between_t_minus_h_and_t_plus_a_sweep_with_last_seen_at_last_beat);

async fn silent_client(backend: Backend) {
    let ts = start_on(backend).await;
    let l = timings(&ts);
    let (mut alice, mut bob) = alice_watched_by_bob(&ts).await;
    let silent_since = last_words(&mut alice).await;
    let chrono_silent = chrono::Utc::now();
    // Alice's socket now goes silent: no reads, no writes, no close.
    let bound = l.ttl + l.sweep_interval + 1.0;
    let got = bob
        .watch(
            &|e| is_presence(e, &alice.jid, Some("unavailable")),
            secs(bound),
        )
        .await
        .expect("unavailable announced for the silent client");
    let after = silent_since.elapsed().as_secs_f64();
    assert_eq!(got.get_attr("from"), Some(alice.jid.as_str()));
    assert_announced_in_time(&l, after, 0.3);
    assert!(ts.metric(|m| m.silent_deaths.load(Ordering::Relaxed)) == 1);

    // Last seen is the last beat (the ping), not the detection time: within a second.
    let bare = ts.jid("alice");
    let deadline = Instant::now() + secs(l.last_seen_flush * 5.0 + 2.0);
    let row = loop {
        if let Some(r) = ts.shared().store.last_seen(&bare).await.unwrap() {
            break r;
        }
        assert!(Instant::now() < deadline, "last seen never written");
        tokio::time::sleep(secs(l.last_seen_flush / 2.0)).await;
    };
    let diff = (row.at - chrono_silent).num_milliseconds().abs();
    assert!(
        diff < 1000,
        "last seen {} is {diff} ms from the last beat",
        row.at
    );
    eprintln!("measured: unavailable {after:.3}s after the last beat; last seen off by {diff} ms");
    let detect_gap = (chrono::Utc::now() - row.at).num_milliseconds();
    assert!(detect_gap as f64 >= (l.ttl - l.heartbeat_interval) * 1000.0);

    // Exactly one PostgreSQL write for the one ended session, and it stays one.
    flush_rounds(&ts, 3).await;
    assert_eq!(ts.metric(|m| m.pg_rows.load(Ordering::Relaxed)), 1);
    assert_eq!(ts.metric(|m| m.pg_writes.load(Ordering::Relaxed)), 1);

    // A new resource of bob probes alice: unavailable with the last seen as XEP-0203 delay.
    let mut bob2 = ts.login("bob", "tablet").await;
    bob2.presence(None, None).await;
    let probe = bob2
        .expect(|e| is_presence(e, &bare, Some("unavailable")))
        .await;
    let stamp = probe
        .get_child("delay", NS_DELAY)
        .and_then(|d| d.get_attr("stamp"))
        .expect("delay stamp on the probe answer")
        .to_owned();
    let stamp = chrono::DateTime::parse_from_rfc3339(&stamp).unwrap();
    assert!(
        (stamp.with_timezone(&chrono::Utc) - row.at)
            .num_milliseconds()
            .abs()
            < 1000
    );

    // XEP-0012 to a subscribed contact: seconds since then.
    let q = bob2
        .iq(
            "get",
            Some(&bare),
            Element::new("query", presenced::liveness::last_seen::NS_LAST),
        )
        .await;
    assert_eq!(q.get_attr("type"), Some("result"), "{q}");
    let seconds: i64 = q
        .elements()
        .next()
        .and_then(|x| x.get_attr("seconds"))
        .and_then(|s| s.parse().ok())
        .expect("seconds");
    let expect = (chrono::Utc::now() - row.at).num_seconds();
    assert!((seconds - expect).abs() <= 1, "{seconds} vs {expect}");
    drop(alice);
    ts.stop().await;
}

on_both_backends!(
    whitespace_keepalives,
    a_client_sending_only_whitespace_keepalives_stays_bound_and_is_announced_once_it_stops,
    in_process_a_client_sending_only_whitespace_keepalives_stays_bound_and_is_announced_once_it_stops
);

/// RFC 6120 §4.6.1: whitespace between stanzas is a keepalive. A client that answers none of
/// the server's pings and sends nothing but a space every T/4 is sending, hence alive: it is
/// not announced for 3T. Once the same socket goes silent it is announced as any silent
/// client is, within T plus one sweep.
async fn whitespace_keepalives(backend: Backend) {
    let ts = start_on(backend).await;
    let l = timings(&ts);
    let (mut alice, mut bob) = alice_watched_by_bob(&ts).await;
    let alice_jid = alice.jid.clone();
    // Alice reads nothing (the server's pings go unanswered) and writes only spaces.
    let window = secs(3.0 * l.ttl);
    let every = secs(l.ttl / 4.0);
    let keepalives = async {
        let end = Instant::now() + window;
        let mut last = Instant::now();
        while Instant::now() < end {
            alice.send_raw(" ").await;
            last = Instant::now();
            tokio::time::sleep(every).await;
        }
        last
    };
    let (last_space, ()) = tokio::join!(
        keepalives,
        bob.watch_none(|e| is_presence(e, &alice_jid, Some("unavailable")), window)
    );
    assert_eq!(ts.metric(|m| m.silent_deaths.load(Ordering::Relaxed)), 0);
    // Now alice is silent, spaces included.
    let bound = l.ttl + l.sweep_interval + 1.0;
    let got = bob
        .watch(
            &|e| is_presence(e, &alice_jid, Some("unavailable")),
            secs(bound),
        )
        .await
        .expect("unavailable announced once the keepalives stopped");
    let after = last_space.elapsed().as_secs_f64();
    assert_announced_in_time(&l, after, 0.3);
    assert_eq!(got.get_attr("from"), Some(alice_jid.as_str()));
    assert_eq!(ts.metric(|m| m.silent_deaths.load(Ordering::Relaxed)), 1);
    eprintln!("measured: {backend:?}, unavailable {after:.3}s after the last of the spaces");
    drop(alice);
    ts.stop().await;
}

/// Drops `client`'s connection without a closing tag and waits (at most G) until the
/// server has seen the drop and started the session's grace period.
async fn drop_and_see_grace_start(ts: &TestServer, client: Client) {
    let g = timings(ts).grace;
    let started = ts.metric(|m| m.grace_started.load(Ordering::Relaxed));
    drop(client);
    let t = Instant::now();
    while ts.metric(|m| m.grace_started.load(Ordering::Relaxed)) == started {
        assert!(
            t.elapsed() < secs(g),
            "the server did not see the drop within G"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

on_both_backends!(
    reconnect_within_grace,
    reconnect_within_grace_announces_nothing_and_idle_and_away_pass_through,
    in_process_reconnect_within_grace_announces_nothing_and_idle_and_away_pass_through
);

async fn reconnect_within_grace(backend: Backend) {
    let ts = start_on(backend).await;
    let g = timings(&ts).grace;
    ts.user("alice").await;
    ts.user("bob").await;
    ts.make_mutual("alice", "bob").await;
    let mut bob = online(&ts, "bob", "pc").await;
    let mut alice = ts.login("alice", "phone").await;
    // XEP-0319 idle and show=away are the client's; the server passes them on untouched.
    let away = presenced::protocol::xml::parse_element(
        "<presence><show>away</show><idle xmlns='urn:xmpp:idle:1' since='2026-01-01T00:00:00Z'/></presence>",
    )
    .unwrap();
    alice.send(&away).await;
    let seen = bob.expect(|e| is_presence(e, &alice.jid, None)).await;
    assert_eq!(
        seen.get_child("show", NS_CLIENT).map(|s| s.text_content()),
        Some("away".into())
    );
    assert_eq!(
        seen.get_child("idle", "urn:xmpp:idle:1")
            .and_then(|i| i.get_attr("since")),
        Some("2026-01-01T00:00:00Z")
    );
    let jid = alice.jid.clone();
    // The connection drops (no </stream:stream>) and the phone is back at once: as soon as
    // the server has seen the drop (before that, a new bind would simply replace a live
    // session and no grace period would be involved).
    drop_and_see_grace_start(&ts, alice).await;
    let mut again = ts.login("alice", "phone").await;
    again.presence(None, None).await;
    // Nothing unavailable reaches bob within G plus a generous margin.
    bob.watch_none(|e| is_presence(e, &jid, Some("unavailable")), secs(g + 1.0))
        .await;
    assert!(ts.metric(|m| m.grace_resumed.load(Ordering::Relaxed)) >= 1);
    // No last seen either: the session did not end for good.
    assert_eq!(ts.metric(|m| m.pg_rows.load(Ordering::Relaxed)), 0);

    // Control: a drop with no reconnect IS announced, no sooner than G.
    let dropped = Instant::now();
    drop(again);
    bob.watch(
        &|e| is_presence(e, &jid, Some("unavailable")),
        secs(g + 2.0),
    )
    .await
    .expect("unavailable after the grace period");
    assert!(dropped.elapsed() >= secs(g), "announced before G elapsed");
    ts.stop().await;
}

on_both_backends!(
    old_end_after_new_presence,
    an_old_session_ending_after_its_successors_presence_does_not_announce_the_resource_unavailable,
    in_process_an_old_session_ending_after_its_successors_presence_does_not_announce_the_resource_unavailable
);

/// A connection drops and the client comes back with the same resource within G, the way
/// every client of a network cut does. The old session's grace ends just before the new
/// session's initial presence is recorded, so it finds the resource not back and goes on to
/// announce it; both then queue for the subject's lock, the new presence first. The old
/// session's unavailable must not follow the new presence to the contact: the resource is
/// the new session's now, and a contact that applied that unavailable would show a user who
/// is online as offline (the reconnect storm after a cut of 10,000 sessions left 14-19 %
/// of them shown offline at some watcher for minutes this way).
///
/// The interleaving is set up, not waited for: the test holds alice's subject lock and
/// counts the tasks queued behind it (`SubjectLocks::holders_and_waiters`).
async fn old_end_after_new_presence(backend: Backend) {
    let ts = TestServer::start(move |c| {
        fast_on(backend)(c);
        // A grace long enough that a login after the drop fits well inside it on a loaded
        // machine; T above it, so the sweeper never gets to the old resource first.
        c.liveness.grace = Duration::from_secs(3);
        c.liveness.heartbeat_interval = Duration::from_secs(1);
        c.liveness.redis_refresh = Duration::from_secs(2);
        c.liveness.ttl = Duration::from_secs(8);
    })
    .await;
    let g = timings(&ts).grace;
    ts.user("alice").await;
    ts.user("bob").await;
    ts.make_mutual("alice", "bob").await;
    let mut bob = online(&ts, "bob", "pc").await;
    let alice = online(&ts, "alice", "phone").await;
    let jid = alice.jid.clone();
    bob.expect(|e| is_presence(e, &jid, None)).await;
    drop_and_see_grace_start(&ts, alice).await;
    // Back with the same resource, bound but not yet available.
    let mut again = ts.login("alice", "phone").await;
    let locks = &ts.shared().subject_locks;
    let subject = ts.jid("alice");
    let held = locks.lock_subject(&subject).await;
    let back =
        presenced::protocol::xml::parse_element("<presence><status>back</status></presence>")
            .unwrap();
    again.send(&back).await;
    let until_queued = |n: usize, within: f64| {
        let locks = &ts.shared().subject_locks;
        let subject = subject.clone();
        async move {
            let t = Instant::now();
            while locks.holders_and_waiters(&subject) < n {
                assert!(
                    t.elapsed() < secs(within),
                    "{} tasks at alice's lock after {within}s, expected {n}",
                    locks.holders_and_waiters(&subject)
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    // The new presence waits for the lock (it is recorded under it) ...
    until_queued(2, g).await;
    // ... and the old session's end, which found the resource not available, behind it.
    until_queued(3, g + 2.0).await;
    drop(held);
    let new = bob
        .expect(|e| {
            is_presence(e, &jid, None)
                && e.get_child("status", NS_CLIENT).map(|s| s.text_content()) == Some("back".into())
        })
        .await;
    assert_eq!(new.get_attr("type"), None);
    // Both have had the lock once nobody holds or waits for it; a ping round trip to bob
    // then brings everything they sent him.
    let t = Instant::now();
    while locks.holders_and_waiters(&subject) > 0 {
        assert!(t.elapsed() < secs(g), "alice's lock still in use");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    barrier(&ts, &mut bob).await;
    let after: Vec<_> = bob
        .backlog
        .iter()
        .filter(|e| is_presence(e, &jid, Some("unavailable")))
        .map(|e| e.to_xml())
        .collect();
    assert!(
        after.is_empty(),
        "bob was told the resource alice is back on is unavailable: {after:?}"
    );
    // The resource is still available to a new viewer's probe as well.
    let mut bob2 = online(&ts, "bob", "tablet").await;
    bob2.expect(|e| is_presence(e, &jid, None)).await;
    drop(again);
    ts.stop().await;
}

on_both_backends!(
    clean_close,
    clean_close_writes_last_seen_once_at_close_time,
    in_process_clean_close_writes_last_seen_once_at_close_time
);

async fn clean_close(backend: Backend) {
    let ts = start_on(backend).await;
    let l = timings(&ts);
    ts.user("alice").await;
    let alice = online(&ts, "alice", "phone").await;
    let closed = chrono::Utc::now();
    alice.close().await;
    let bare = ts.jid("alice");
    let deadline = Instant::now() + secs(l.grace + l.last_seen_flush * 5.0 + 2.0);
    while ts.metric(|m| m.pg_rows.load(Ordering::Relaxed)) == 0 {
        assert!(Instant::now() < deadline, "no last-seen write");
        tokio::time::sleep(secs(0.05)).await;
    }
    let row = ts.shared().store.last_seen(&bare).await.unwrap().unwrap();
    assert!((row.at - closed).num_milliseconds().abs() < 1000);
    flush_rounds(&ts, 3).await;
    assert_eq!(ts.metric(|m| m.pg_rows.load(Ordering::Relaxed)), 1);
    ts.stop().await;
}

on_both_backends!(
    idle_resource,
    idle_resource_costs_at_most_one_redis_write_per_refresh_and_no_key_lacks_a_ttl,
    in_process_idle_resource_costs_at_most_one_write_per_refresh_and_keeps_its_entry
);

async fn idle_resource(backend: Backend) {
    let ts = start_on(backend).await;
    let l = timings(&ts);
    ts.user("alice").await;
    let mut alice = online(&ts, "alice", "phone").await;
    let before = ts.metric(|m| m.liveness_writes.load(Ordering::Relaxed));
    let beats_before = ts.metric(|m| m.heartbeats.load(Ordering::Relaxed));
    // Idle for 3 T, answering the server's pings like a live client.
    let window = l.ttl * 3.0;
    let started = Instant::now();
    alice.idle_answering_pings(secs(window)).await;
    let writes = ts.metric(|m| m.liveness_writes.load(Ordering::Relaxed)) - before;
    let beats = ts.metric(|m| m.heartbeats.load(Ordering::Relaxed)) - beats_before;
    // One write per refresh interval of the time that actually passed (a loaded machine
    // can stretch the idle window), plus the one in flight at the start.
    let elapsed = started.elapsed().as_secs_f64();
    let bound = (elapsed / l.redis_refresh).ceil() as u64 + 1;
    eprintln!(
        "measured: {writes} {backend:?} writes, {beats} heartbeats in {elapsed:.2}s idle (bound {bound})"
    );
    assert!(
        writes <= bound,
        "{writes} {backend:?} writes in {elapsed:.2}s, bound {bound}"
    );
    assert!(
        beats as f64 >= window / l.heartbeat_interval / 2.0,
        "only {beats} heartbeats: pings not answered?"
    );
    // Still alive after 3 T: the downsampled refreshes kept the key (the entry).
    if backend == Backend::InProcess {
        let Some(beat) = in_process_beat(&ts, &alice.jid) else {
            panic!("alice's entry is gone from the in-process table");
        };
        let age = ts.shared().liveness.clock.now_ms() - beat;
        assert!(
            age < (l.ttl * 1000.0) as i64,
            "entry {age} ms old: would expire"
        );
        alice.close().await;
        ts.stop().await;
        return;
    }
    let mut r = ts.redis().await;
    let key = format!(
        "{}presence:{{{}}}:res:phone",
        ts.config.redis.key_prefix,
        ts.jid("alice")
    );
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&key)
        .query_async(&mut r)
        .await
        .unwrap();
    assert!(pttl > 0, "resource key missing or without TTL: {pttl}");
    // Every presence key of this server has an expiry (TTL -1 would be "online forever").
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{}presence:*", ts.config.redis.key_prefix))
        .query_async(&mut r)
        .await
        .unwrap();
    assert!(keys.len() >= 2, "expected res and beats keys: {keys:?}");
    for k in &keys {
        let t: i64 = redis::cmd("PTTL").arg(k).query_async(&mut r).await.unwrap();
        assert!(t > 0, "{k} has PTTL {t}");
    }
    alice.close().await;
    ts.stop().await;
}

#[tokio::test]
async fn concurrent_sweepers_take_each_stale_resource_exactly_once() {
    let url = redis_url();
    let client = redis::Client::open(url.as_str()).unwrap();
    let key = format!("test:sweep:{}:presence:beats:0", unique());
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let now = presenced::liveness::Clock::system().now_ms();
    let n = 300;
    let mut members: Vec<(String, i64)> = (0..n)
        .map(|i| (format!("u{i}@x/r"), now - 10_000 - i))
        .collect();
    // A fresh one that must stay.
    members.push(("fresh@x/r".into(), now));
    write_beats(&mut c, &key, &members).await;
    let sweeper = |conn: redis::aio::MultiplexedConnection, key: String| async move {
        let mut conn = presenced::cluster::redis_conn::Conn::Single(conn);
        let mut got = Vec::new();
        loop {
            let batch = presenced::services::lifecycle::sweeper::sweep_once(
                &mut conn,
                &key,
                now - 5000,
                7,
                "me",
                0,
            )
            .await
            .unwrap();
            if batch.is_empty() {
                return got;
            }
            got.extend(batch.into_iter().map(|(m, _)| m));
        }
    };
    let a = tokio::spawn(sweeper(
        client.get_multiplexed_async_connection().await.unwrap(),
        key.clone(),
    ));
    let b = tokio::spawn(sweeper(
        client.get_multiplexed_async_connection().await.unwrap(),
        key.clone(),
    ));
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    let mut all: Vec<String> = a.iter().chain(b.iter()).cloned().collect();
    let total = all.len();
    all.sort();
    all.dedup();
    assert_eq!(total, n as usize, "a resource was returned twice or lost");
    assert_eq!(all.len(), n as usize);
    assert_eq!(take_left(&mut c, &key).await, vec!["fresh@x/r".to_owned()]);
}

/// Writes `members` (member, score) into the beat ZSET `key`, which expires in a minute.
async fn write_beats(
    c: &mut redis::aio::MultiplexedConnection,
    key: &str,
    members: &[(String, i64)],
) {
    let mut zadd = redis::cmd("ZADD");
    zadd.arg(key);
    for (m, score) in members {
        zadd.arg(score).arg(m);
    }
    let _: () = zadd.query_async(c).await.unwrap();
    let _: () = redis::cmd("PEXPIRE")
        .arg(key)
        .arg(60_000)
        .query_async(c)
        .await
        .unwrap();
}

/// The members left in ZSET `key`, sorted; deletes it.
async fn take_left(c: &mut redis::aio::MultiplexedConnection, key: &str) -> Vec<String> {
    let mut left: Vec<String> = redis::cmd("ZRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .query_async(c)
        .await
        .unwrap();
    left.sort();
    let _: () = redis::cmd("DEL").arg(key).query_async(c).await.unwrap();
    left
}

/// The sweep leaves the calling node's own stale members in the ZSET (it removes them only
/// once its decision is written, so its death before that does not lose them) and returns
/// each of them once per sweep by skipping past them; other nodes' members it takes.
#[tokio::test]
async fn a_sweep_returns_every_stale_member_once_and_leaves_the_callers_own_in_place() {
    let client = redis::Client::open(redis_url().as_str()).unwrap();
    let key = format!("test:sweep:{}:presence:beats:0", unique());
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let now = presenced::liveness::Clock::system().now_ms();
    let mut stale = Vec::new();
    for i in 0..5 {
        stale.push((format!("a x{i}@x/r"), now - 10_000 - i));
        stale.push((format!("b y{i}@x/r"), now - 10_000 - i));
    }
    write_beats(&mut c, &key, &stale).await;
    let mut conn = presenced::cluster::redis_conn::Conn::Single(
        client.get_multiplexed_async_connection().await.unwrap(),
    );
    let (mut got, mut own) = (Vec::new(), 0);
    loop {
        let batch = presenced::services::lifecycle::sweeper::sweep_once(
            &mut conn,
            &key,
            now - 5000,
            3,
            "a",
            own,
        )
        .await
        .unwrap();
        own += batch.iter().filter(|(m, _)| m.starts_with("a ")).count();
        let full = batch.len() >= 3;
        got.extend(batch);
        if !full {
            break;
        }
    }
    got.sort();
    stale.sort();
    assert_eq!(got, stale, "each stale member once, with its score");
    let own: Vec<String> = (0..5).map(|i| format!("a x{i}@x/r")).collect();
    assert_eq!(
        take_left(&mut c, &key).await,
        own,
        "only the caller's own members are left"
    );
}

#[tokio::test]
async fn last_activity_is_forbidden_without_a_subscription() {
    let ts = TestServer::start(fast_liveness).await;
    ts.user("alice").await;
    ts.user("carol").await;
    let alice = online(&ts, "alice", "phone").await;
    alice.close().await;
    let mut carol = online(&ts, "carol", "pc").await;
    let q = carol
        .iq(
            "get",
            Some(&ts.jid("alice")),
            Element::new("query", presenced::liveness::last_seen::NS_LAST),
        )
        .await;
    assert_eq!(q.get_attr("type"), Some("error"));
    assert_eq!(stanza_error(&q), "forbidden");
    ts.stop().await;
}

on_both_backends!(
    metrics_endpoint,
    metrics_endpoint_serves_the_counters_in_prometheus_text,
    in_process_metrics_endpoint_serves_the_counters_and_no_redis_gauge
);

async fn metrics_endpoint(backend: Backend) {
    let ts = start_on(backend).await;
    ts.user("alice").await;
    let alice = online(&ts, "alice", "phone").await;
    let body = ts.admin_get("/metrics").await;
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    for name in [
        "presenced_redis_writes_total",
        "presenced_liveness_writes_total",
        "presenced_pg_last_seen_writes_total",
        "presenced_heartbeats_total",
        "presenced_sweeps_total",
    ] {
        assert!(
            body.contains(&format!("\n{name} ")),
            "{name} missing: {body}"
        );
    }
    assert!(body.contains("\npresenced_sessions 1\n"), "{body}");
    // "Redis down" would be a false alarm on a node that has no Redis.
    assert_eq!(
        body.contains("\npresenced_redis_up "),
        backend == Backend::Redis,
        "{body}"
    );
    alice.close().await;
    ts.stop().await;
}

/// Redis commands that write, as `MONITOR` names them (scripts count by the commands
/// they run, which MONITOR also shows).
const WRITES: &[&str] = &[
    "SET",
    "SADD",
    "SREM",
    "ZADD",
    "ZREM",
    "DEL",
    "PEXPIRE",
    "PEXPIREAT",
    "EXPIRE",
    "HSET",
    "HDEL",
    "ZREMRANGEBYSCORE",
];

/// The write commands in `MONITOR` lines (`<time> [db addr] "CMD" "key" ...`) on keys under
/// `prefix`, as (command, key without the prefix).
fn writes_under(lines: &[String], prefix: &str) -> Vec<(String, String)> {
    lines
        .iter()
        .filter_map(|l| {
            let mut args = l.split('"').skip(1).step_by(2);
            let cmd = args.next()?.to_ascii_uppercase();
            let key = args.next()?.strip_prefix(prefix)?;
            WRITES
                .contains(&cmd.as_str())
                .then(|| (cmd, key.to_owned()))
        })
        .collect()
}

/// Cost at rest on a Redis of its own, watched with `MONITOR`: a resource idle for 3 T
/// (answering pings) costs two write commands per refresh (its key with its expiry, its
/// beat), plus at most one beat-set expiry per T; its session directory entry costs
/// nothing (the hash's expiry is a day ahead, moved every half day); the node's own
/// heartbeat (the live-instance set) is per node, whatever its number of sessions.
#[tokio::test]
async fn an_idle_resource_costs_two_redis_write_commands_per_refresh() {
    let port = free_port();
    let own = OwnRedis::start(port).await;
    let ts = TestServer::start(|c| {
        fast_liveness(c);
        c.redis.url = format!("redis://127.0.0.1:{port}");
    })
    .await;
    let l = timings(&ts);
    ts.user("alice").await;
    let mut alice = online(&ts, "alice", "phone").await;
    let mut monitor = tokio::process::Command::new("redis-cli")
        .args(["-p", &port.to_string(), "monitor"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("redis-cli runs");
    let out = monitor.stdout.take().unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    tokio::spawn(async move {
        use tokio::io::AsyncBufReadExt;
        let mut r = tokio::io::BufReader::new(out).lines();
        while let Ok(Some(l)) = r.next_line().await {
            if tx.send(l).is_err() {
                return;
            }
        }
    });
    // MONITOR answers OK before it streams: every command after that line is shown.
    assert_eq!(next_line(&mut rx).await, "OK");
    let before = ts.metric(|m| m.liveness_writes.load(Ordering::Relaxed));
    let window = l.ttl * 3.0;
    alice.idle_answering_pings(secs(window)).await;
    let refreshes = ts.metric(|m| m.liveness_writes.load(Ordering::Relaxed)) - before;
    // A marker command after the window: once MONITOR shows it, it has shown every
    // command the server sent before it.
    const MARKER: &str = "presenced-test-end-of-window";
    let echoed = tokio::process::Command::new("redis-cli")
        .args(["-p", &port.to_string(), "ECHO", MARKER])
        .stdout(std::process::Stdio::null())
        .status()
        .await
        .expect("redis-cli runs");
    assert!(echoed.success());
    let mut lines = Vec::new();
    loop {
        let line = next_line(&mut rx).await;
        if line.contains(MARKER) {
            break;
        }
        lines.push(line);
    }
    let _ = monitor.kill().await;
    let all = writes_under(&lines, &ts.config.redis.key_prefix);
    let class = |k: &'static str| all.iter().filter(move |(_, key)| key.starts_with(k));
    let writes: Vec<&String> = class("presence:").map(|(c, _)| c).collect();
    let directory: Vec<_> = class("dir:").collect();
    let heartbeat = class("cluster:nodes").count() as u64;
    let count = |c: &str| writes.iter().filter(|w| **w == c).count() as u64;
    eprintln!(
        "measured: {refreshes} refreshes in {window:.1} s idle: {} write commands on presence keys \
         ({} SET, {} ZADD, {} PEXPIREAT, {} other); {} on the directory, {heartbeat} by the \
         node's heartbeat",
        writes.len(),
        count("SET"),
        count("ZADD"),
        count("PEXPIREAT"),
        writes.len() as u64 - count("SET") - count("ZADD") - count("PEXPIREAT"),
        directory.len(),
    );
    assert!(
        refreshes >= 3,
        "the idle resource was refreshed: {refreshes}"
    );
    assert_eq!(
        count("SET"),
        refreshes,
        "one key write per refresh: {writes:?}"
    );
    assert_eq!(count("ZADD"), refreshes, "one beat per refresh: {writes:?}");
    let extensions = (window / l.ttl).ceil() as u64 + 1;
    assert!(
        count("PEXPIREAT") <= extensions,
        "beat-set expiry at most once per T: {writes:?}"
    );
    assert_eq!(
        writes.len() as u64,
        count("SET") + count("ZADD") + count("PEXPIREAT"),
        "nothing else is written on presence keys at rest: {writes:?}"
    );
    assert!(
        directory.is_empty(),
        "the session directory is not written at rest: {directory:?}"
    );
    // The heartbeat script: ZADD, ZREMRANGEBYSCORE and two PEXPIREAT every period (T / 4).
    let heartbeats = (window / (l.ttl / 4.0)).ceil() as u64 + 1;
    assert!(
        heartbeat <= 4 * heartbeats,
        "{heartbeat} heartbeat writes in {window:.1} s: {all:?}"
    );
    assert_eq!(
        all.len() as u64,
        writes.len() as u64 + heartbeat,
        "nothing else is written at rest: {all:?}"
    );
    alice.close().await;
    ts.stop().await;
    own.stop().await;
}

/// The next line `MONITOR` printed, failing after 10 s of silence.
async fn next_line(rx: &mut tokio::sync::mpsc::UnboundedReceiver<String>) -> String {
    tokio::time::timeout(secs(10.0), rx.recv())
        .await
        .expect("MONITOR printed nothing for 10 s")
        .expect("MONITOR ended")
}

/// A redis-server of the test's own on a free loopback port, killed on drop.
struct OwnRedis {
    child: tokio::process::Child,
}

impl OwnRedis {
    async fn start(port: u16) -> OwnRedis {
        let child = tokio::process::Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("redis-server runs");
        let deadline = Instant::now() + secs(5.0);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            assert!(Instant::now() < deadline, "redis-server did not start");
            tokio::time::sleep(secs(0.02)).await;
        }
        OwnRedis { child }
    }

    async fn stop(mut self) {
        let _ = self.child.kill().await;
        let _ = self.child.wait().await;
    }
}

async fn pttl(port: u16, key: &str) -> i64 {
    let c = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
    let mut c = c.get_multiplexed_async_connection().await.unwrap();
    redis::cmd("PTTL")
        .arg(key)
        .query_async(&mut c)
        .await
        .unwrap()
}

#[tokio::test]
async fn redis_outage_keeps_logins_and_messages_and_liveness_is_repaired_after_restart() {
    let port = free_port();
    let own = OwnRedis::start(port).await;
    let ts = TestServer::start(|c| {
        fast_liveness(c);
        c.redis.url = format!("redis://127.0.0.1:{port}");
        c.redis.timeout = secs(0.3);
        c.redis.reconnect_max = secs(0.5);
    })
    .await;
    let l = timings(&ts);
    ts.user("alice").await;
    ts.user("bob").await;
    ts.user("carol").await;
    ts.make_mutual("alice", "bob").await;
    let mut alice = online(&ts, "alice", "phone").await;
    let mut bob = online(&ts, "bob", "pc").await;
    alice
        .watch(&|e| is_presence(e, &bob.jid, None), WAIT)
        .await
        .unwrap();
    let key = |who: &str, res: &str| {
        format!(
            "{}presence:{{{}}}:res:{res}",
            ts.config.redis.key_prefix,
            ts.jid(who)
        )
    };
    let deadline = Instant::now() + secs(2.0);
    while pttl(port, &key("alice", "phone")).await <= 0 {
        assert!(Instant::now() < deadline, "alice never reached Redis");
        tokio::time::sleep(secs(0.05)).await;
    }

    own.stop().await;
    // Redis is gone. A message still arrives promptly.
    let sent = Instant::now();
    bob.send(
        &presenced::protocol::xml::parse_element(&format!(
            "<message to='{}' type='chat'><body>still here</body></message>",
            ts.jid("alice")
        ))
        .unwrap(),
    )
    .await;
    alice
        .watch(&|e| e.name == "message", secs(1.0))
        .await
        .expect("message routed with Redis down");
    eprintln!(
        "measured: message latency with Redis down {:?}",
        sent.elapsed()
    );
    // A new login works and gets the online contact's presence from this node.
    let mut carol = ts.login("carol", "pc").await;
    carol.presence(None, None).await;
    let cj = carol.jid.clone();
    carol.expect(|e| is_presence(e, &cj, None)).await;
    // Beating sessions are not declared dead for lack of Redis, for longer than T.
    let window = secs(l.ttl * 1.5);
    let (a, b) = (alice.jid.clone(), bob.jid.clone());
    tokio::join!(
        bob.watch_none(|e| is_presence(e, &a, Some("unavailable")), window),
        alice.watch_none(|e| is_presence(e, &b, Some("unavailable")), window),
    );
    assert!(ts.metric(|m| m.redis_errors.load(Ordering::Relaxed)) > 0);

    // Redis comes back empty: the node reconnects and rewrites its resources.
    let own = OwnRedis::start(port).await;
    let deadline = Instant::now() + ts.config.redis.reconnect_max + secs(l.redis_refresh + 2.0);
    let (ka, kb) = (key("alice", "phone"), key("bob", "pc"));
    let (ja, jb) = (alice.jid.clone(), bob.jid.clone());
    let repaired = async {
        loop {
            let (ta, tb) = (pttl(port, &ka).await, pttl(port, &kb).await);
            if ta > 0 && tb > 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "liveness not repaired: {ta} {tb}"
            );
            tokio::time::sleep(secs(0.05)).await;
        }
    };
    // A false unavailable could come from any sweep while the keys are still missing: the
    // watch lasts until the repair's own deadline, then T and a sweep beyond it, so it is
    // longer than the latest moment a missed repair would show.
    let quiet =
        deadline.saturating_duration_since(Instant::now()) + secs(l.ttl + l.sweep_interval + 1.0);
    tokio::join!(
        repaired,
        bob.watch_none(|e| is_presence(e, &ja, Some("unavailable")), quiet),
        alice.watch_none(|e| is_presence(e, &jb, Some("unavailable")), quiet),
    );
    // And silence is detected through Redis again: alice goes quiet, bob hears of it, and
    // not before her last beat could have expired (an earlier one would be a false one).
    let quiet_from = last_words(&mut alice).await;
    bob.watch(
        &|e| is_presence(e, &alice.jid, Some("unavailable")),
        secs(l.ttl + l.sweep_interval + 1.0),
    )
    .await
    .expect("silent death detected after Redis returned");
    let earliest = secs(l.ttl - l.redis_refresh - l.heartbeat_interval);
    assert!(
        quiet_from.elapsed() >= earliest,
        "unavailable {:?} after alice's last words, before her beat could expire ({earliest:?})",
        quiet_from.elapsed()
    );
    assert!(ts.metric(|m| m.swept.load(Ordering::Relaxed)) >= 1);
    drop(alice);
    ts.stop().await;
    own.stop().await;
}

#[tokio::test]
async fn postgres_outage_keeps_existing_sessions_routing_and_last_seen_waits() {
    let ts = TestServer::start(fast_liveness).await;
    let l = timings(&ts);
    ts.user("alice").await;
    ts.user("bob").await;
    ts.make_mutual("alice", "bob").await;
    let mut alice = online(&ts, "alice", "phone").await;
    let mut bob = online(&ts, "bob", "pc").await;
    alice
        .watch(&|e| is_presence(e, &bob.jid, None), WAIT)
        .await
        .unwrap();
    // The database becomes unreachable: every query now fails at once.
    ts.shared().store.close().await;
    let msg = |to: &str, body: &str| {
        presenced::protocol::xml::parse_element(&format!(
            "<message to='{to}' type='chat'><body>{body}</body></message>"
        ))
        .unwrap()
    };
    let sent = Instant::now();
    bob.send(&msg(&ts.jid("alice"), "db down")).await;
    alice
        .watch(&|e| e.name == "message", secs(1.0))
        .await
        .expect("message routed with PostgreSQL down");
    eprintln!(
        "measured: message latency with PostgreSQL down {:?}",
        sent.elapsed()
    );
    // A presence update does not stall the sender either.
    bob.presence(None, None).await;
    let ping = bob.iq("get", None, Element::new("ping", NS_PING)).await;
    assert_eq!(ping.get_attr("type"), Some("result"));
    // A session end queues last seen; the flush fails and is retried, nothing blocks.
    let closed = chrono::Utc::now();
    alice.close().await;
    let deadline = Instant::now() + secs(l.grace + l.last_seen_flush * 5.0 + 2.0);
    while ts.metric(|m| m.pg_errors.load(Ordering::Relaxed)) == 0 {
        assert!(Instant::now() < deadline, "no failed flush recorded");
        tokio::time::sleep(secs(0.05)).await;
    }
    assert_eq!(ts.metric(|m| m.pg_rows.load(Ordering::Relaxed)), 0);
    // The pending value is still served from memory.
    let at = presenced::services::presence::last_seen(&ts.services().presence, &ts.jid("alice"))
        .await
        .expect("last seen kept in memory");
    assert!((at - closed).num_milliseconds().abs() < 1000);
    bob.send(&msg(&bob.jid.clone(), "to myself")).await;
    bob.watch(&|e| e.name == "message", secs(1.0))
        .await
        .expect("bob's session still routes");
    ts.stop().await;
}

#[tokio::test]
async fn another_nodes_sweeper_hands_the_silent_resource_to_its_node_which_announces_it_once() {
    // Node A holds the sessions and does not sweep; node B (same domain, same Redis keys)
    // sweeps. B's sweeper finds A's silent resource and A ends it.
    let a = TestServer::start(|c| {
        fast_liveness(c);
        c.liveness.sweeper = false;
        // Pushes A's own no-Redis fallback (T + 2 sweeps of silence) well past B's sweep.
        c.liveness.sweep_interval = secs(2.0);
    })
    .await;
    let (domain, prefix) = (a.domain.clone(), a.config.redis.key_prefix.clone());
    let b = TestServer::start(move |c| {
        fast_liveness(c);
        c.domains = vec![domain];
        c.redis.key_prefix = prefix;
    })
    .await;
    let l = timings(&b);
    a.user("alice").await;
    a.user("bob").await;
    a.make_mutual("alice", "bob").await;
    let mut bob = online(&a, "bob", "pc").await;
    let mut alice = online(&a, "alice", "phone").await;
    bob.watch(&|e| is_presence(e, &alice.jid, None), WAIT)
        .await
        .unwrap();
    let silent_since = last_words(&mut alice).await;
    bob.watch(
        &|e| is_presence(e, &alice.jid, Some("unavailable")),
        secs(l.ttl + l.sweep_interval + 1.0),
    )
    .await
    .expect("announced by the node holding the session");
    let after = silent_since.elapsed().as_secs_f64();
    eprintln!("measured: two nodes, unavailable {after:.3}s after the last beat");
    assert_announced_in_time(&l, after, 0.3);
    let count = |ts: &TestServer, f: fn(&presenced::liveness::Metrics) -> u64| ts.metric(f);
    assert_eq!(count(&a, |m| m.swept.load(Ordering::Relaxed)), 0);
    assert_eq!(count(&b, |m| m.swept.load(Ordering::Relaxed)), 1);
    assert_eq!(count(&a, |m| m.silent_deaths.load(Ordering::Relaxed)), 1);
    // One last-seen row, written by A only.
    let deadline = Instant::now() + secs(l.last_seen_flush * 5.0 + 2.0);
    while count(&a, |m| m.pg_rows.load(Ordering::Relaxed)) == 0 {
        assert!(Instant::now() < deadline, "no last seen");
        tokio::time::sleep(secs(0.05)).await;
    }
    flush_rounds(&a, 3).await;
    assert_eq!(count(&a, |m| m.pg_rows.load(Ordering::Relaxed)), 1);
    assert_eq!(count(&b, |m| m.pg_rows.load(Ordering::Relaxed)), 0);
    drop(alice);
    b.stop().await;
    a.stop().await;
}

#[tokio::test]
async fn resource_of_a_crashed_node_is_announced_by_the_sweeper_with_its_last_beat() {
    let ts = TestServer::start(fast_liveness).await;
    let l = timings(&ts);
    ts.user("alice").await;
    ts.user("bob").await;
    ts.make_mutual("alice", "bob").await;
    let mut bob = online(&ts, "bob", "pc").await;
    // A beat left by a node that no longer exists: nobody listens on its channel.
    let bare = ts.jid("alice");
    let full = c_jid(&ts, "alice", "phone");
    let last_beat = plant_crashed_beat(&ts, "alice", "phone").await;
    bob.watch(
        &|e| is_presence(e, full.as_str(), Some("unavailable")),
        secs(l.sweep_interval * 2.0 + 1.0),
    )
    .await
    .expect("orphan announced");
    let deadline = Instant::now() + secs(l.last_seen_flush * 5.0 + 2.0);
    let row = loop {
        if let Some(r) = ts.shared().store.last_seen(&bare).await.unwrap() {
            break r;
        }
        assert!(Instant::now() < deadline, "no last seen for the orphan");
        tokio::time::sleep(secs(0.05)).await;
    };
    assert!((row.at.timestamp_millis() - last_beat).abs() < 1000);
    ts.stop().await;
}

on_both_backends!(
    chatty_client,
    chatty_client_beats_often_but_redis_sees_one_write_per_refresh,
    in_process_chatty_client_beats_often_but_the_table_sees_one_write_per_refresh
);

async fn chatty_client(backend: Backend) {
    let ts = start_on(backend).await;
    let l = timings(&ts);
    ts.user("alice").await;
    let mut alice = online(&ts, "alice", "phone").await;
    let writes_before = ts.metric(|m| m.liveness_writes.load(Ordering::Relaxed));
    let beats_before = ts.metric(|m| m.heartbeats.load(Ordering::Relaxed));
    // Traffic every 50 ms for 3 s: every stanza is a heartbeat.
    let window = 3.0;
    let start = Instant::now();
    while start.elapsed() < secs(window) {
        let _ = last_words(&mut alice).await;
        tokio::time::sleep(secs(0.05)).await;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let writes = ts.metric(|m| m.liveness_writes.load(Ordering::Relaxed)) - writes_before;
    let beats = ts.metric(|m| m.heartbeats.load(Ordering::Relaxed)) - beats_before;
    let bound = (elapsed / l.redis_refresh).ceil() as u64 + 1;
    eprintln!("measured: chatty client, {beats} heartbeats, {writes} {backend:?} writes in {elapsed:.2}s (bound {bound})");
    assert!(beats >= 30, "{beats}");
    assert!(writes <= bound, "{writes} > {bound}");
    assert!(writes >= 1, "the refresh never reached the backend");
    alice.close().await;
    ts.stop().await;
}

/// Waits until the last-seen batcher of `ts` has run `n` more times (bounded), so "still
/// one write" is checked after real flushes rather than after a sleep.
async fn flush_rounds(ts: &TestServer, n: u64) {
    let rounds = |ts: &TestServer| ts.metric(|m| m.flush_rounds.load(Ordering::Relaxed));
    let target = rounds(ts) + n;
    let bound = secs(timings(ts).last_seen_flush * (n as f64 + 2.0) + 2.0);
    let deadline = Instant::now() + bound;
    while rounds(ts) < target {
        assert!(Instant::now() < deadline, "last-seen batcher stalled");
        tokio::time::sleep(secs(0.01)).await;
    }
}

/// Plants the beat of `name/res` held by a node that no longer exists, older than T.
async fn plant_crashed_beat(ts: &TestServer, name: &str, res: &str) -> i64 {
    let bare = ts.jid(name);
    let full = presenced::protocol::jid::FullJid::new(&format!("{bare}/{res}")).unwrap();
    let keys = &ts.shared().liveness.keys;
    let last_beat =
        ts.shared().liveness.clock.now_ms() - ts.config.liveness.ttl.as_millis() as i64 - 500;
    let mut r = ts.redis().await;
    let _: () = redis::cmd("ZADD")
        .arg(keys.beats_for(&bare))
        .arg(last_beat)
        .arg(keys.member("node-crashed", &full))
        .query_async(&mut r)
        .await
        .unwrap();
    let _: () = redis::cmd("PEXPIRE")
        .arg(keys.beats_for(&bare))
        .arg(60_000)
        .query_async(&mut r)
        .await
        .unwrap();
    last_beat
}

#[tokio::test]
async fn orphan_announcement_reaches_only_viewers_the_gate_admits() {
    // The sweeper is driven by hand, so each sweep is known to have finished.
    let ts = TestServer::start(|c| {
        fast_liveness(c);
        c.liveness.sweeper = false;
    })
    .await;
    for u in ["alice", "bob", "carol", "dave"] {
        ts.user(u).await;
    }
    for v in ["bob", "carol", "dave"] {
        ts.make_mutual("alice", v).await;
    }
    let alice = ts.jid("alice");
    let store = &ts.shared().store;
    store
        .block(&alice, std::slice::from_ref(&ts.jid("carol")))
        .await
        .unwrap();
    let except: std::collections::BTreeSet<_> =
        [::jid::BareJid::new(&ts.jid("dave")).unwrap()].into();
    let settings = presenced::services::presence::privacy::PrivacySettings {
        online: presenced::services::presence::privacy::Visibility::ContactsExcept(except),
        ..Default::default()
    };
    store.set_privacy_settings(&alice, &settings).await.unwrap();
    let mut bob = online(&ts, "bob", "pc").await;
    let mut carol = online(&ts, "carol", "pc").await;
    let mut dave = online(&ts, "dave", "pc").await;
    plant_crashed_beat(&ts, "alice", "phone").await;
    let swept = presenced::services::lifecycle::sweeper::sweep_all(&ts.services().lifecycle).await;
    assert!(swept >= 1, "the planted beat was not swept");
    let full = c_jid(&ts, "alice", "phone");
    // Control: the permitted subscriber is told.
    bob.watch(&|e| is_presence(e, &full, Some("unavailable")), secs(2.0))
        .await
        .expect("bob is told");
    for (who, c) in [
        ("carol (blocked)", &mut carol),
        ("dave (hidden)", &mut dave),
    ] {
        barrier(&ts, c).await;
        assert!(
            !c.backlog
                .iter()
                .any(|e| e.get_attr("from") == Some(full.as_str())),
            "{who} learnt that alice had been online: {:#?}",
            c.backlog
        );
    }
    ts.stop().await;
}

#[tokio::test]
async fn orphan_of_a_resource_that_reconnected_is_not_announced() {
    let ts = TestServer::start(|c| {
        fast_liveness(c);
        c.liveness.sweeper = false;
    })
    .await;
    ts.user("alice").await;
    ts.user("bob").await;
    ts.make_mutual("alice", "bob").await;
    let mut bob = online(&ts, "bob", "pc").await;
    // alice/phone is back, on this node, before the dead node's beat is swept.
    let mut alice = online(&ts, "alice", "phone").await;
    let full = c_jid(&ts, "alice", "phone");
    bob.watch(&|e| is_presence(e, &full, None), secs(2.0))
        .await
        .expect("bob sees alice/phone online");
    plant_crashed_beat(&ts, "alice", "phone").await;
    let swept = presenced::services::lifecycle::sweeper::sweep_all(&ts.services().lifecycle).await;
    assert!(swept >= 1, "the planted beat was not swept");
    barrier(&ts, &mut bob).await;
    barrier(&ts, &mut alice).await;
    assert!(
        !bob.backlog
            .iter()
            .any(|e| is_presence(e, &full, Some("unavailable"))),
        "a live resource was announced unavailable: {:#?}",
        bob.backlog
    );
    assert!(
        !alice
            .backlog
            .iter()
            .any(|e| is_presence(e, &full, Some("unavailable"))),
        "alice's own live resource was announced unavailable to her"
    );
    ts.stop().await;
}

#[tokio::test]
async fn with_nothing_installed_slixmpp_contacts_see_each_other_and_a_silent_death_within_t_plus_a_sweep(
) {
    // The embedded mode: no PostgreSQL and no Redis URL at all (not an unreachable one): the
    // store is an SQLite file the server creates and liveness runs in process.
    let db = common::stores::Db::sqlite();
    let ts = TestServer::start(|c| {
        fast_liveness(c);
        without_redis(c);
        c.database.url = db.url();
    })
    .await;
    assert!(ts.shared().liveness.redis().is_none());
    assert!(
        ts.shared().store.sqlite_pool().is_some(),
        "the store is the SQLite file"
    );
    let l = timings(&ts);
    ts.add_user("alice", "pa").await;
    ts.add_user("bob", "pb").await;
    let wait = l.ttl + l.sweep_interval + 5.0;
    let wait_arg = wait.to_string();
    let args = client_script_args(&ts, &["alice", "pa", "bob", "pb", &wait_arg]);
    let out = run_client_script("silent.py", &args, secs(wait + 40.0)).await;
    assert_eq!(out.code, Some(0), "silent.py failed: {out:?}");
    assert_eq!(out.get("alice_sub").as_deref(), Some("both"), "{out:?}");
    assert_eq!(out.get("bob_sub").as_deref(), Some("both"), "{out:?}");
    assert_eq!(out.get("unavailable_from"), out.get("alice_full"));
    assert_eq!(out.get("bob_sees_alice_resources").as_deref(), Some("0"));
    let after: f64 = out
        .get("after")
        .and_then(|a| a.parse().ok())
        .expect("after");
    eprintln!("measured: in process, slixmpp saw the silent death {after:.3}s after the last beat");
    // 0.5 s for the client's own round trips and event loop.
    assert_announced_in_time(&l, after, 0.5);
    // The in-process sweeper found it; the session ended as a silent death, once.
    assert!(ts.metric(|m| m.swept.load(Ordering::Relaxed)) >= 1);
    assert_eq!(ts.metric(|m| m.silent_deaths.load(Ordering::Relaxed)), 1);
    ts.stop().await;
}

/// A stanza the server takes longer than T to handle is the server's delay, not the
/// client's silence. Here Alice's roster set waits for a row lock another transaction holds
/// for 2 T (on a loaded server the same happens to a stanza waiting for the database pool);
/// meanwhile Alice keeps talking (whitespace keepalives, RFC 6120 §4.6.1), which the server
/// does not read while it is busy with her stanza. The session must not be ended as silent
/// (connection-timeout) and her contacts must not be told she left: after the lock is
/// released her roster set is answered and her session still answers pings.
#[tokio::test]
async fn a_client_whose_stanza_the_server_is_still_handling_is_not_declared_silent() {
    if database_url().starts_with("sqlite") {
        // The row lock below is PostgreSQL's; SQLite has one writer and a busy timeout.
        skip(
            "a_client_whose_stanza_the_server_is_still_handling_is_not_declared_silent",
            "on SQLite (the held row lock is PostgreSQL's)",
        );
        return;
    }
    let ts = start_on(Backend::Redis).await;
    let l = timings(&ts);
    ts.user("alice").await;
    ts.user("bob").await;
    ts.make_mutual("alice", "bob").await;
    let mut bob = online(&ts, "bob", "pc").await;
    let mut alice = online(&ts, "alice", "phone").await;
    bob.expect(|e| is_presence(e, &alice.jid, None)).await;
    let roster_set = |contact: &str| {
        Element::new("query", presenced::protocol::xml::NS_ROSTER)
            .child(Element::new("item", presenced::protocol::xml::NS_ROSTER).attr("jid", contact))
    };
    // Alice's version row exists (make_mutual wrote her roster); hold its lock.
    let pool = sqlx::PgPool::connect(&database_url()).await.expect("pg");
    let mut tx = pool.begin().await.expect("begin");
    let owner = ts.jid("alice");
    let locked = sqlx::query("SELECT 1 FROM roster_versions WHERE owner = $1 FOR UPDATE")
        .bind(&owner)
        .execute(&mut *tx)
        .await
        .expect("lock")
        .rows_affected();
    assert_eq!(locked, 1, "alice's roster version row");
    let id = unique();
    let mut iq = Element::new("iq", NS_CLIENT)
        .attr("type", "set")
        .attr("id", id.clone())
        .child(roster_set(&format!("carol@{}", ts.domain)));
    alice.send(&iq).await;
    let busy_for = secs(2.0 * l.ttl + 2.0 * l.sweep_interval);
    let until = Instant::now() + busy_for;
    let keepalives = async {
        while Instant::now() < until {
            alice.send_raw(" ").await;
            tokio::time::sleep(secs(l.heartbeat_interval / 2.0)).await;
        }
    };
    // Bob is an ordinary live client meanwhile; what he receives stays in his backlog.
    tokio::join!(keepalives, bob.idle_answering_pings(busy_for));
    tx.rollback().await.expect("release the lock");
    let answer = alice
        .try_expect(
            &|e: &Element| e.name == "iq" && e.get_attr("id") == Some(id.as_str()),
            secs(l.ttl),
        )
        .await;
    match answer {
        Ok(r) => assert_eq!(r.get_attr("type"), Some("result"), "{r}"),
        Err(e) => panic!("alice's session ended while the server handled her stanza: {e:?}"),
    }
    last_words(&mut alice).await;
    // Positive control for the negative check below: bob still hears alice's changes.
    iq = Element::new("presence", NS_CLIENT)
        .child(Element::new("status", NS_CLIENT).text("still here"));
    alice.send(&iq).await;
    // The first presence from her session after the busy time: an unavailable had she been
    // taken for silent, else this one.
    let seen = bob
        .watch(
            &|e| e.name == "presence" && e.get_attr("from") == Some(alice.jid.as_str()),
            secs(l.ttl),
        )
        .await
        .expect("bob sees alice's next presence");
    assert!(
        is_presence(&seen, &alice.jid, None),
        "bob was told alice left while the server handled her stanza: {seen}"
    );
    ts.stop().await;
}

/// After a clean stop nothing of the node stays in Redis for ever: every key under its
/// prefix is gone or expires (a key without a TTL, PTTL -1, would be kept until someone
/// deletes it by hand, and a beat ZSET with members would be swept by nobody).
#[tokio::test]
async fn a_clean_stop_leaves_no_key_without_an_expiry() {
    let ts = start_on(Backend::Redis).await;
    ts.user("alice").await;
    ts.user("bob").await;
    ts.make_mutual("alice", "bob").await;
    let mut alice = online(&ts, "alice", "phone").await;
    let _bob = online(&ts, "bob", "pc").await;
    alice.presence(None, None).await;
    let mut r = ts.redis().await;
    let prefix = ts.config.redis.key_prefix.clone();
    // Until the node's beats are in Redis (its refreshes run every redis_refresh).
    let deadline = Instant::now() + secs(timings(&ts).redis_refresh * 4.0 + 2.0);
    loop {
        let beats: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}presence:beats:*"))
            .query_async(&mut r)
            .await
            .unwrap();
        if !beats.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "no beats written");
        tokio::time::sleep(secs(0.05)).await;
    }
    ts.stop().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(&mut r)
        .await
        .unwrap();
    let mut forever = Vec::new();
    for k in &keys {
        let t: i64 = redis::cmd("PTTL").arg(k).query_async(&mut r).await.unwrap();
        if t == -1 {
            forever.push(k.clone());
        }
    }
    assert!(
        forever.is_empty(),
        "keys without an expiry after a clean stop: {forever:?}"
    );
}
