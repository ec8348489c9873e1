//! The floor under memory per idle TLS session: a minimal tokio + rustls server that holds
//! N idle client connections and does nothing else, measured the way BENCHMARKS.md
//! measures presenced (resident memory of the server process, per connection, after the
//! connections have gone idle), with presenced's allocator and its settings.
//!
//! What presenced keeps per session on top of this floor is its own: the XML reader, the
//! session state, the writer's mailbox, the liveness entry. Whatever this program measures
//! cannot be beaten by any change to presenced that keeps tokio and rustls' buffered API.
//!
//! Two ways to wait for the next bytes, `--mode`:
//! - `buffer`: each connection's task owns a 4 KiB read buffer and awaits a read into it,
//!   as a straightforward session loop does (and presenced's did);
//! - `shared`: each task awaits the socket's readability with no buffer of its own, then
//!   reads into one buffer per thread, so an idle connection holds no read buffer (as
//!   presenced's reader, `IdleBuf`, frees its buffer while the peer is idle);
//! - `plain`: `shared` without TLS, which leaves tokio's own share: what rustls holds per
//!   connection is the difference between the two.
//!
//! Run (release): `cargo run --release --example tls_floor -- --connections 10000 --mode
//! buffer`; it starts itself again as the client process (`--client`), which opens the
//! connections over loopback, sends one small message on each and keeps them open. One
//! JSON line on standard output; `bench/tls_floor_table.py` makes the table.

use std::io::{Read as _, Write as _};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The same allocator and settings as the server (src/main.rs), so the floor is comparable.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[allow(non_upper_case_globals)]
#[export_name = "_rjem_malloc_conf"]
pub static malloc_conf: &[u8] = b"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0\0";

/// The message each client sends once and reads back: a stream header's size.
const HELLO: &[u8] = b"<?xml version='1.0'?><stream:stream to='example.org' version='1.0' xmlns='jabber:client' xmlns:stream='http://etherx.jabber.org/streams'>";

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn rss_bytes() -> u64 {
    let mut s = String::new();
    std::fs::File::open("/proc/self/status")
        .and_then(|mut f| f.read_to_string(&mut s))
        .expect("read /proc/self/status");
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmRSS")
        * 1024
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Buffer,
    Shared,
    Plain,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Buffer => "buffer",
            Mode::Shared => "shared",
            Mode::Plain => "plain",
        }
    }
}

thread_local! {
    static SHARED: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0; 16 * 1024]);
}

/// A plain TCP connection: echo what comes, reading into the thread's buffer on readiness.
async fn serve_plain(mut tcp: TcpStream) {
    loop {
        if tcp.readable().await.is_err() {
            return;
        }
        let got = SHARED.with(|b| {
            let mut b = b.borrow_mut();
            tcp.try_read(&mut b).map(|n| b[..n].to_vec())
        });
        match got {
            Ok(v) if v.is_empty() => return,
            Ok(v) => {
                if tcp.write_all(&v).await.is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(_) => return,
        }
    }
}

/// One connection: the TLS handshake, then echo what comes until the client closes.
async fn serve(tcp: TcpStream, acceptor: tokio_rustls::TlsAcceptor, mode: Mode) {
    if mode == Mode::Plain {
        return serve_plain(tcp).await;
    }
    let Ok(mut tls) = acceptor.accept(tcp).await else {
        return;
    };
    match mode {
        Mode::Buffer => {
            let mut buf = vec![0u8; 4096];
            while let Ok(n @ 1..) = tls.read(&mut buf).await {
                if tls.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
        Mode::Plain => unreachable!("served above"),
        Mode::Shared => loop {
            if tls.get_ref().0.readable().await.is_err() {
                return;
            }
            // Whatever the socket holds is read into the thread's buffer at once; rustls
            // keeps a partial record itself, so Pending here only means "wait again".
            let got = std::future::poll_fn(|cx| {
                SHARED.with(|b| {
                    let mut b = b.borrow_mut();
                    let mut rb = tokio::io::ReadBuf::new(&mut b);
                    match tokio::io::AsyncRead::poll_read(std::pin::Pin::new(&mut tls), cx, &mut rb)
                    {
                        std::task::Poll::Ready(Ok(())) => {
                            std::task::Poll::Ready(Some(rb.filled().to_vec()))
                        }
                        std::task::Poll::Ready(Err(_)) => std::task::Poll::Ready(None),
                        std::task::Poll::Pending => std::task::Poll::Ready(Some(Vec::new())),
                    }
                })
            })
            .await;
            match got {
                None => return,
                Some(v) if v.is_empty() => continue,
                Some(v) => {
                    if tls.write_all(&v).await.is_err() {
                        return;
                    }
                }
            }
        },
    }
}

fn server(args: &[String]) {
    let n: usize = arg(args, "--connections").map_or(10_000, |v| v.parse().unwrap());
    let mode = match arg(args, "--mode").as_deref() {
        Some("shared") => Mode::Shared,
        Some("plain") => Mode::Plain,
        _ => Mode::Buffer,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let cert = rcgen::generate_simple_self_signed(vec!["example.org".to_owned()]).unwrap();
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(cert.key_pair.serialize_der()));
        let der = CertificateDer::from(cert.cert.der().to_vec());
        let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![der.clone()], key)
        .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let dir = std::env::temp_dir().join(format!("tls-floor-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cert_path = dir.join("cert.der");
        std::fs::write(&cert_path, der.as_ref()).unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let base = rss_bytes();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = accepted.clone();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tokio::spawn(serve(tcp, acceptor.clone(), mode));
            }
        });
        let mut client = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--client",
                mode.name(),
                &addr.to_string(),
                &n.to_string(),
                cert_path.to_str().unwrap(),
            ])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("start the client process");
        // The client prints one line once every connection has had its echo.
        let mut out = client.stdout.take().unwrap();
        let ready = tokio::task::spawn_blocking(move || {
            let mut b = [0u8; 64];
            let n = out.read(&mut b).unwrap_or(0);
            (String::from_utf8_lossy(&b[..n]).trim().to_owned(), out)
        })
        .await
        .unwrap();
        assert_eq!(ready.0, "ready", "the client process failed");
        // Idle: past jemalloc's dirty-page decay (1 s) and then some.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let rss = rss_bytes();
        let per = (rss.saturating_sub(base)) as f64 / n as f64;
        println!(
            "{{\"mode\":\"{}\",\"connections\":{n},\"accepted\":{},\"rss_base\":{base},\"rss\":{rss},\"bytes_per_connection\":{per:.0}}}",
            mode.name(),
            accepted.load(std::sync::atomic::Ordering::Relaxed),
        );
        let _ = client.kill();
        let _ = client.wait();
        let _ = std::fs::remove_dir_all(&dir);
    });
}

fn client(plain: bool, addr: SocketAddr, n: usize, cert: &str) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from(std::fs::read(cert).unwrap()))
            .unwrap();
        let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
        let name = ServerName::try_from("example.org").unwrap();
        let started = Instant::now();
        let mut kept = Vec::with_capacity(n);
        let sem = Arc::new(tokio::sync::Semaphore::new(64));
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..n {
            let (connector, name, sem) = (connector.clone(), name.clone(), sem.clone());
            tasks.spawn(async move {
                let _permit = sem.acquire().await.unwrap();
                let mut tcp = TcpStream::connect(addr).await.unwrap();
                let mut back = vec![0u8; HELLO.len()];
                if plain {
                    tcp.write_all(HELLO).await.unwrap();
                    tcp.read_exact(&mut back).await.unwrap();
                    return Box::new(tcp) as Box<dyn Send>;
                }
                let mut tls = connector.connect(name, tcp).await.unwrap();
                tls.write_all(HELLO).await.unwrap();
                tls.read_exact(&mut back).await.unwrap();
                Box::new(tls)
            });
        }
        while let Some(t) = tasks.join_next().await {
            kept.push(t.unwrap());
        }
        eprintln!("{n} connections in {:?}", started.elapsed());
        let mut stdout = std::io::stdout();
        writeln!(stdout, "ready").unwrap();
        stdout.flush().unwrap();
        // Hold them until killed.
        std::future::pending::<()>().await;
        drop(kept);
    });
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--client") {
        client(
            args[i + 1] == "plain",
            args[i + 2].parse().unwrap(),
            args[i + 3].parse().unwrap(),
            &args[i + 4],
        );
    } else {
        server(&args);
    }
}
