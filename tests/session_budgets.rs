//! What one session can make the server hold, measured: the mailbox of a client that reads
//! nothing, the XEP-0198 queue of a client that never acknowledges (attached and detached),
//! and the presence held for a XEP-0352 inactive client, from local senders and from one
//! remote domain over a dialback-authenticated server stream.
//!
//! The server runs in this process and a counting global allocator measures its heap
//! (tests/session_memory.rs does the same for idle sessions). The clients run here too, so
//! each test keeps their part small and transient: the senders write one string again and
//! again, the readers drop what they read. The tests of this file take one lock, so no
//! other test's allocations land in a measurement. The bounds are the default budgets of
//! `[limits]` plus a fixed margin for what is in flight (a stanza being read, routed and
//! written); each flood holds several times that on a server without the budgets.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Duration;

use common::*;
use presenced::protocol::jid::FullJid;
use presenced::protocol::xml::{Element, NS_CLIENT};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

fn count(delta: isize) {
    let now = LIVE.fetch_add(delta, Ordering::Relaxed) + delta;
    if delta > 0 {
        PEAK.fetch_max(now, Ordering::Relaxed);
    }
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        count(-(layout.size() as isize));
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            count(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// One measurement at a time in this process.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Heap bytes now, and the peak is restarted from here.
fn baseline() -> isize {
    let now = LIVE.load(Ordering::Relaxed);
    PEAK.store(now, Ordering::Relaxed);
    now
}

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

fn peak() -> isize {
    PEAK.load(Ordering::Relaxed)
}

const KIB: isize = 1024;
const MIB: isize = 1024 * 1024;
/// Heap the server and the test's clients use for what is in flight during a flood: a
/// stanza being read (reader buffer and element), routed, serialised and written by the
/// server, read by a client, and, at a session's end, each unacknowledged stanza parsed
/// again and stored offline; several copies of a 200 kB stanza at once.
const IN_FLIGHT: isize = 3 * MIB;

const NS_SM: &str = "urn:xmpp:sm:3";

/// The default budgets of `[limits]`: `sm_max_unacked_bytes`, `session_queue_bytes`,
/// `max_csi_held_bytes_per_sender`.
const SM_BUDGET: isize = 2 * MIB;
const MAILBOX_BUDGET: isize = 2 * MIB;
const CSI_SHARE: isize = 64 * KIB;

/// A fast sender: the flood is not what is tested, so the rate limit is out of the way.
fn unthrottled(c: &mut presenced::config::Config) {
    c.limits.stanzas_per_second = 100_000;
    c.limits.stanza_burst = 100_000;
}

/// A chat message of about `size` bytes to `to`, serialised.
fn big_message(to: &str, size: usize) -> String {
    let body = "x".repeat(size);
    Element::new("message", NS_CLIENT)
        .attr("to", to)
        .attr("type", "chat")
        .child(Element::new("body", NS_CLIENT).text(body))
        .to_xml()
}

async fn enable(c: &mut Client, resume: bool) {
    let resume = if resume { " resume='true'" } else { "" };
    c.send_raw(&format!("<enable xmlns='{NS_SM}'{resume}/>"))
        .await;
    let on = c
        .expect(|e| e.ns == NS_SM && (e.name == "enabled" || e.name == "failed"))
        .await;
    assert_eq!(on.name, "enabled", "{on}");
}

async fn online(ts: &TestServer, name: &str, res: &str) -> Client {
    let mut c = ts.login(name, res).await;
    c.presence(None, None).await;
    let me = c.jid.clone();
    c.expect(|e| is_presence(e, &me, None)).await;
    c
}

/// Reads and drops everything until the stream ends; the stream error's condition, if any.
async fn sink(mut c: Client) -> Ended {
    loop {
        match c.next_stanza(Duration::from_secs(20)).await {
            Ok(_) => {}
            Err(e) => return e,
        }
    }
}

#[test]
fn the_budgets_measured_against_are_the_defaults() {
    let l = presenced::config::LimitsConfig::default();
    assert_eq!(l.sm_max_unacked_bytes as isize, SM_BUDGET);
    assert_eq!(l.session_queue_bytes as isize, MAILBOX_BUDGET);
    assert_eq!(l.max_csi_held_bytes_per_sender as isize, CSI_SHARE);
}

// ---------------------------------------------------------------------------------------
// The XEP-0198 unacknowledged queue

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_acknowledges_is_closed_at_the_byte_budget_of_its_xep_0198_queue() {
    let _serial = SERIAL.lock().await;
    let ts = TestServer::start(unthrottled).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let mut bob = online(&ts, "bob", "desk").await;
    // Bound, not available: messages to its full JID reach it (none to the bare JID).
    let mut alice = ts.login("alice", "sink").await;
    enable(&mut alice, false).await;
    let alice_jid = alice.jid.clone();
    barrier(&ts, &mut bob).await;
    let before = baseline();
    // It reads everything and acknowledges nothing.
    let sink = tokio::spawn(sink(alice));
    // 60 messages of 200 kB: 12 MB, far below the 500 stanzas sm_max_unacked counts.
    let m = big_message(&alice_jid, 200_000);
    for _ in 0..60 {
        bob.send_raw(&m).await;
    }
    barrier(&ts, &mut bob).await;
    let ended = tokio::time::timeout(Duration::from_secs(20), sink).await;
    let held = peak() - before;
    println!(
        "peak held during the flood: {} KiB (budget {} KiB)",
        held / KIB,
        SM_BUDGET / KIB
    );
    match ended {
        Ok(Ok(Ended::StreamError(cond))) => assert_eq!(cond, "resource-constraint"),
        other => panic!("the stream ends with resource-constraint: {other:?}"),
    }
    // What the session kept: its unacknowledged stanzas, and what arrived in its mailbox
    // while it was ending (handled as unacknowledged too).
    assert!(
        held <= SM_BUDGET + MAILBOX_BUDGET + IN_FLIGHT,
        "the server held {} KiB for one client that never acknowledged",
        held / KIB
    );
    // Nobody else paid for it.
    barrier(&ts, &mut bob).await;
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_detached_session_holds_no_more_than_the_byte_budget_while_it_waits_for_resumption() {
    let _serial = SERIAL.lock().await;
    let ts = TestServer::start(unthrottled).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let mut bob = online(&ts, "bob", "desk").await;
    let mut alice = ts.login("alice", "phone").await;
    enable(&mut alice, true).await;
    let alice_jid = alice.jid.clone();
    // The connection dies; the session waits its window (300 s) for a resumption.
    drop(alice);
    until("detached", WAIT, || ts.shared().resumable.detached() == 1).await;
    barrier(&ts, &mut bob).await;
    let before = baseline();
    let m = big_message(&alice_jid, 200_000);
    for _ in 0..60 {
        bob.send_raw(&m).await;
    }
    barrier(&ts, &mut bob).await;
    // What the server goes on holding for the rest of the window.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let held = live() - before;
    let peaked = peak() - before;
    println!(
        "held after the flood: {} KiB, peak {} KiB (budget {} KiB)",
        held / KIB,
        peaked / KIB,
        SM_BUDGET / KIB
    );
    assert!(
        peaked <= SM_BUDGET + MAILBOX_BUDGET + IN_FLIGHT,
        "a detached session made the server hold {} KiB",
        peaked / KIB
    );
    // Beyond the budget the session ended: nothing is held for the window.
    until("the session ended", WAIT, || {
        ts.shared().resumable.detached() == 0
    })
    .await;
    let full = FullJid::new(&alice_jid).unwrap();
    until("unregistered", WAIT, || {
        ts.shared().sessions.get(&full).is_none()
    })
    .await;
    // Its stanzas went to offline storage; the heap is given back, not held for 300 s
    // (buffers that grew with the 200 kB stanzas, such as the sender's stream reader and
    // the database connections', keep their capacity: about 1.8 MiB here).
    until("the heap given back", Duration::from_secs(20), || {
        live() - before < IN_FLIGHT
    })
    .await;
    barrier(&ts, &mut bob).await;
    ts.stop().await;
}

// ---------------------------------------------------------------------------------------
// The mailbox

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_nothing_is_disconnected_at_the_byte_budget_of_its_mailbox() {
    let _serial = SERIAL.lock().await;
    let ts = TestServer::start(unthrottled).await;
    ts.user("alice").await;
    ts.user("bob").await;
    let mut bob = online(&ts, "bob", "desk").await;
    // No stream management: what cannot be written waits in the mailbox.
    let alice = ts.login("alice", "asleep").await;
    let alice_jid = alice.jid.clone();
    let full = FullJid::new(&alice_jid).unwrap();
    barrier(&ts, &mut bob).await;
    let before = baseline();
    // 30 MB: more than loopback's socket buffers take (at most 4 MB sent, 32 MB received
    // only for a reader that reads), far below the 1,024 stanzas of session_queue.
    let m = big_message(&alice_jid, 200_000);
    for _ in 0..150 {
        bob.send_raw(&m).await;
    }
    barrier(&ts, &mut bob).await;
    let peaked = peak() - before;
    println!(
        "peak held during the flood: {} KiB (budget {} KiB)",
        peaked / KIB,
        MAILBOX_BUDGET / KIB
    );
    assert!(
        peaked <= MAILBOX_BUDGET + IN_FLIGHT,
        "the server held {} KiB for one client that reads nothing",
        peaked / KIB
    );
    until("the stalled session ended", WAIT, || {
        ts.shared().sessions.get(&full).is_none()
    })
    .await;
    barrier(&ts, &mut bob).await;
    drop(alice);
    ts.stop().await;
}

// ---------------------------------------------------------------------------------------
// XEP-0352 holding

const NS_CSI: &str = "urn:xmpp:csi:0";
const NS_INTEREST: &str = "urn:presenced:interest:0";

/// An available presence from `from` (when given: the raw s2s sender names it) to `to`
/// with a status of `size` bytes.
fn big_presence(from: Option<&str>, to: &str, size: usize) -> String {
    let mut p = Element::new("presence", NS_CLIENT)
        .attr("to", to)
        .child(Element::new("status", NS_CLIENT).text("s".repeat(size)));
    if let Some(from) = from {
        p.set_attr("from", from);
    }
    p.to_xml()
}

/// Makes `c` inactive, with `stop` (a bare JID) on its interest list: a presence from
/// it is written at once without releasing what is held, which tells the reader the
/// flood before it was handled.
async fn inactive_listening_for(c: &mut Client, stop: &str) {
    let list = Element::new("interest", NS_INTEREST)
        .child(Element::new("item", NS_INTEREST).attr("jid", stop));
    let r = c.iq("set", None, list).await;
    assert_eq!(r.get_attr("type"), Some("result"), "{r}");
    c.send_raw(&format!("<inactive xmlns='{NS_CSI}'/>")).await;
}

/// Reads (dropping them) until the presence from `stop`'s bare JID; the full JIDs whose
/// presence arrived meanwhile.
async fn read_until_presence_of(
    mut c: Client,
    stop: String,
) -> (Client, std::collections::HashSet<String>) {
    let mut seen = std::collections::HashSet::new();
    loop {
        let el = c
            .next_stanza(Duration::from_secs(20))
            .await
            .expect("the reader's stream goes on");
        if el.name != "presence" {
            continue;
        }
        let from = el.get_attr("from").unwrap_or_default().to_owned();
        if presenced::protocol::jid::bare_of(&from) == stop {
            return (c, seen);
        }
        seen.insert(from);
    }
}

/// After `<active/>`: the full JIDs whose held presence is written, up to a barrier.
async fn released(ts: &TestServer, c: &mut Client) -> std::collections::HashSet<String> {
    c.send_raw(&format!("<active xmlns='{NS_CSI}'/>")).await;
    barrier(ts, c).await;
    c.backlog
        .drain(..)
        .filter(|e| e.name == "presence")
        .filter_map(|e| e.get_attr("from").map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presence_held_for_an_inactive_client_from_local_senders_is_bounded_by_each_senders_share()
{
    let _serial = SERIAL.lock().await;
    let ts = TestServer::start(unthrottled).await;
    for u in ["victim", "m1", "m2", "stop"] {
        ts.user(u).await;
    }
    let mut victim = online(&ts, "victim", "phone").await;
    let victim_jid = victim.jid.clone();
    let mut senders = Vec::new();
    for u in ["m1", "m2"] {
        for r in 0..8 {
            senders.push(ts.login(u, &format!("r{r}")).await);
        }
    }
    let mut stop = ts.login("stop", "r").await;
    inactive_listening_for(&mut victim, &ts.jid("stop")).await;
    barrier(&ts, &mut victim).await;
    let before = baseline();
    let reader = tokio::spawn(read_until_presence_of(victim, ts.jid("stop")));
    // 16 resources of two accounts, 60 kB each: 960 kB held without a share per sender.
    let p = big_presence(None, &victim_jid, 60_000);
    for s in senders.iter_mut() {
        s.send_raw(&p).await;
    }
    for s in senders.iter_mut() {
        barrier(&ts, s).await;
    }
    stop.send_raw(&big_presence(None, &victim_jid, 10)).await;
    let (mut victim, early) = tokio::time::timeout(Duration::from_secs(20), reader)
        .await
        .expect("the flood was handled")
        .expect("reader");
    let held = live() - before;
    let share = CSI_SHARE;
    println!(
        "held while inactive: {} KiB ({} presences written early; share {} KiB per sender)",
        held / KIB,
        early.len(),
        share / KIB
    );
    assert!(
        held <= 2 * share + 256 * KIB,
        "two local senders made the server hold {} KiB for one inactive client",
        held / KIB
    );
    // Nothing is lost: what was not written early is written on <active/>.
    let mut all = early;
    all.extend(released(&ts, &mut victim).await);
    let want: std::collections::HashSet<String> = senders.iter().map(|s| s.jid.clone()).collect();
    assert!(want.is_subset(&all), "every sender's presence arrived");
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presence_held_for_an_inactive_client_from_one_remote_domain_is_bounded_by_its_share() {
    let _serial = SERIAL.lock().await;
    let p = s2s_pair(unthrottled).await;
    p.a.user("victim").await;
    let mut victim = online(&p.a, "victim", "phone").await;
    let victim_jid = victim.jid.clone();
    let stop = format!("stop@{}", p.b_domain);
    inactive_listening_for(&mut victim, &stop).await;
    barrier(&p.a, &mut victim).await;
    // Authenticated as b for real (dialback, b's key): b's server names its JIDs at will.
    let mut raw = RawS2s::connect(p.a.s2s_addr(), &p.a, &p.b_domain).await;
    let key = presenced::transport::s2s::dialback::Secret::new(SECRET_B).key(
        &p.a.domain,
        &p.b_domain,
        &raw.stream_id,
    );
    assert_eq!(raw.dialback(&p.b_domain, &p.a.domain, &key).await, "valid");
    let before = baseline();
    let reader = tokio::spawn(read_until_presence_of(victim, stop.clone()));
    // 60 distinct remote JIDs, 40 kB each: 2.4 MB held without a share per sender.
    let n = 60;
    for i in 0..n {
        let from = format!("u{i}@{}/r", p.b_domain);
        raw.send(&big_presence(Some(&from), &victim_jid, 40_000))
            .await;
    }
    raw.send(&big_presence(Some(&format!("{stop}/r")), &victim_jid, 10))
        .await;
    let (mut victim, early) = tokio::time::timeout(Duration::from_secs(30), reader)
        .await
        .expect("the flood was handled")
        .expect("reader");
    let held = live() - before;
    let share = CSI_SHARE;
    println!(
        "held while inactive: {} KiB ({} presences written early; share {} KiB per domain)",
        held / KIB,
        early.len(),
        share / KIB
    );
    assert!(
        held <= share + 256 * KIB,
        "one remote domain made the server hold {} KiB for one inactive client",
        held / KIB
    );
    let mut all = early;
    all.extend(released(&p.a, &mut victim).await);
    assert_eq!(all.len(), n, "every remote sender's presence arrived");
    p.a.stop().await;
    p.b.stop().await;
}

// ---------------------------------------------------------------------------------------
// Federation (as tests/s2s.rs does it)

const SECRET_A: &str = "dialback-secret-a";
const SECRET_B: &str = "dialback-secret-b";

struct Pair {
    a: TestServer,
    b: TestServer,
    b_domain: String,
}

/// Two federated servers: `a` on 127.0.0.2, `b` on 127.0.0.3.
async fn s2s_pair(tweak: impl Fn(&mut presenced::config::Config)) -> Pair {
    let a_domain = format!("a{}.example", unique());
    let b_domain = format!("b{}.example", unique());
    let a_port = listen_port("127.0.0.2");
    let b_port = listen_port("127.0.0.3");
    let b_addr = format!("127.0.0.3:{b_port}");
    let a_addr = format!("127.0.0.2:{a_port}");
    let a = TestServer::start_with_domain(&a_domain, |c| {
        s2s_config(c, "127.0.0.2", a_port, SECRET_A, &b_domain, b_addr);
        tweak(c);
    })
    .await;
    let b = TestServer::start_with_domain(&b_domain, |c| {
        s2s_config(c, "127.0.0.3", b_port, SECRET_B, &a_domain, a_addr);
        tweak(c);
    })
    .await;
    Pair { a, b, b_domain }
}

/// A raw server-to-server client that plays the originating server by hand.
struct RawS2s {
    reader: presenced::protocol::xml::reader::StreamReader<tokio::io::ReadHalf<Box<dyn Io>>>,
    writer: tokio::io::WriteHalf<Box<dyn Io>>,
    stream_id: String,
}

impl RawS2s {
    /// Connects to `target` at `addr` claiming to be `from_domain`, STARTTLS, and returns
    /// with the secured stream opened.
    async fn connect(addr: std::net::SocketAddr, target: &TestServer, from_domain: &str) -> RawS2s {
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let mut raw = RawS2s::over(Box::new(tcp));
        raw.open(from_domain, &target.domain).await;
        raw.send("<starttls xmlns='urn:ietf:params:xml:ns:xmpp-tls'/>")
            .await;
        let proceed = raw.next_element().await.expect("proceed");
        assert_eq!(proceed.name, "proceed");
        let RawS2s { reader, writer, .. } = raw;
        let io = reader.into_inner().unsplit(writer);
        let connector = tokio_rustls::TlsConnector::from(tls_client(&target.cert));
        let name = rustls_pki_types::ServerName::try_from(target.domain.clone()).unwrap();
        let tls = connector.connect(name, io).await.expect("TLS");
        let mut raw = RawS2s::over(Box::new(tls));
        raw.open(from_domain, &target.domain).await;
        raw
    }

    fn over(io: Box<dyn Io>) -> RawS2s {
        let (r, w) = tokio::io::split(io);
        RawS2s {
            reader: presenced::protocol::xml::reader::StreamReader::new(
                r,
                presenced::protocol::xml::reader::ReaderLimits::default(),
            ),
            writer: w,
            stream_id: String::new(),
        }
    }

    async fn send(&mut self, s: &str) {
        use tokio::io::AsyncWriteExt;
        self.writer
            .write_all(s.as_bytes())
            .await
            .expect("s2s write");
        self.writer.flush().await.expect("s2s flush");
    }

    async fn open(&mut self, from: &str, to: &str) {
        use presenced::protocol::xml::reader::StreamEvent;
        self.send(&format!(
            "<?xml version='1.0'?><stream:stream xmlns='jabber:server' \
             xmlns:stream='http://etherx.jabber.org/streams' xmlns:db='jabber:server:dialback' \
             from='{from}' to='{to}' version='1.0'>"
        ))
        .await;
        loop {
            match tokio::time::timeout(WAIT, self.reader.next()).await {
                Ok(Ok(StreamEvent::Open(h))) => {
                    self.stream_id = h.get_attr("id").unwrap_or_default().to_owned()
                }
                Ok(Ok(StreamEvent::Stanza(el))) if el.name == "features" => return,
                Ok(Ok(_)) => {}
                other => panic!("no stream features: {other:?}"),
            }
        }
    }

    async fn next_element(&mut self) -> Result<Element, String> {
        use presenced::protocol::xml::reader::StreamEvent;
        loop {
            match tokio::time::timeout(WAIT, self.reader.next()).await {
                Ok(Ok(StreamEvent::Stanza(el))) if el.name == "error" => {
                    return Err(condition(&el))
                }
                Ok(Ok(StreamEvent::Stanza(el))) => return Ok(el),
                Ok(Ok(StreamEvent::Whitespace)) => {}
                Ok(Ok(_)) | Ok(Err(_)) => return Err("closed".into()),
                Err(_) => return Err("timeout".into()),
            }
        }
    }

    /// Sends a dialback key for `from` → `to` and returns the result's type.
    async fn dialback(&mut self, from: &str, to: &str, key: &str) -> String {
        self.send(&format!(
            "<db:result from='{from}' to='{to}'>{key}</db:result>"
        ))
        .await;
        let r = self.next_element().await.expect("db:result answer");
        assert_eq!(r.name, "result", "{r}");
        r.get_attr("type").unwrap_or_default().to_owned()
    }
}
