//! The embedded store's file going wrong: not a database, nowhere to create it, locked
//! by another process. Each gives an error naming the file, and nothing committed is
//! lost. Files live under the temporary directory, one per test.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use presenced::store::{Store, StoreError};
use sqlx::Connection as _;

/// The default `[database] sqlite_busy_timeout`, which `Store::connect` uses.
/// Block-list entries as the strings they are on the wire.
fn names(v: Vec<presenced::protocol::jid::Jid>) -> Vec<String> {
    v.iter().map(|j| j.to_string()).collect()
}

fn busy_timeout() -> Duration {
    presenced::config::DatabaseConfig::default().sqlite_busy_timeout
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir()
        .join("sqlite-presenced-file-tests")
        .join(uuid::Uuid::new_v4().simple().to_string());
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

async fn open(path: &std::path::Path) -> Result<Store, StoreError> {
    let store = Store::connect(&format!("sqlite://{}", path.display()), 2).await?;
    store.migrate(std::path::Path::new("")).await?;
    Ok(store)
}

/// The error names the file and says `what` about it.
fn assert_names_file(r: Result<Store, StoreError>, path: &std::path::Path, what: &str) {
    match r {
        Err(e @ StoreError::File { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains(&path.display().to_string()), "{msg}");
            assert!(msg.contains(what), "{msg}");
        }
        Err(other) => panic!("not a file error: {other:?}"),
        Ok(_) => panic!("{} opened", path.display()),
    }
}

#[tokio::test]
async fn a_file_that_is_not_a_database_is_refused_by_name_and_left_as_it_was() {
    let path = scratch("notes.db");
    let text = b"These are someone's notes, not a database.\n".repeat(200);
    std::fs::write(&path, &text).unwrap();
    assert_names_file(open(&path).await, &path, "not an SQLite database");
    assert_eq!(std::fs::read(&path).unwrap(), text, "the file is untouched");
}

#[tokio::test]
async fn a_file_that_cannot_be_created_is_refused_by_name() {
    // A directory that does not exist, and a "directory" that is a file. (Permissions
    // cannot stand for a read-only directory here: tests may run as root.)
    let missing = scratch("x").with_file_name("no-such-dir").join("p.db");
    assert_names_file(
        open(&missing).await,
        &missing,
        "cannot be opened or created",
    );
    let file = scratch("plain-file");
    std::fs::write(&file, b"").unwrap();
    let under_file = file.join("p.db");
    assert_names_file(
        open(&under_file).await,
        &under_file,
        "cannot be opened or created",
    );
}

#[tokio::test]
async fn a_write_blocked_by_another_process_fails_by_name_and_nothing_committed_is_lost() {
    let path = scratch("locked.db");
    let store = open(&path).await.unwrap();
    store
        .create_account("alice", "l.example", "pw", 1)
        .await
        .unwrap();
    let alice = "alice@l.example";
    store.block(alice, &["a.example".to_owned()]).await.unwrap();

    // Another process (an operator's shell) holds the write lock.
    let mut other = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut other)
        .await
        .unwrap();
    sqlx::query("INSERT INTO blocklist (owner, blocked) VALUES (?1, 'c.example')")
        .bind(alice)
        .execute(&mut other)
        .await
        .unwrap();

    let started = Instant::now();
    let err = store
        .block(alice, &["b.example".to_owned()])
        .await
        .unwrap_err();
    let waited = started.elapsed();
    let msg = err.to_string();
    assert!(matches!(err, StoreError::File { .. }), "{err:?}");
    assert!(
        msg.contains(&path.display().to_string()) && msg.contains("locked"),
        "{msg}"
    );
    // It waited for the lock first, not much longer.
    assert!(
        waited >= busy_timeout() - Duration::from_millis(100),
        "{waited:?}"
    );
    assert!(waited < busy_timeout() * 3, "{waited:?}");
    // Readers are not blocked meanwhile (WAL), and see only what was committed.
    assert_eq!(names(store.blocklist(alice).await.unwrap()), ["a.example"]);

    sqlx::query("COMMIT").execute(&mut other).await.unwrap();
    other.close().await.unwrap();
    // Once the lock is gone, writes work again; both committed changes are there and the
    // refused one left nothing.
    store.block(alice, &["b.example".to_owned()]).await.unwrap();
    assert_eq!(
        names(store.blocklist(alice).await.unwrap()),
        ["a.example", "b.example", "c.example"]
    );
    store.close().await;
    let reopened = open(&path).await.unwrap();
    assert_eq!(reopened.blocklist(alice).await.unwrap().len(), 3);
}

#[tokio::test]
async fn servers_starting_together_on_a_new_file_apply_the_schema_once() {
    let path = scratch("together.db");
    let opened = futures_util::future::join_all((0..6).map(|_| open(&path))).await;
    for r in opened {
        r.expect("every start succeeds");
    }
    let store = open(&path).await.unwrap();
    store
        .create_account("a", "t.example", "pw", 1)
        .await
        .unwrap();
    assert!(store.account_exists("a", "t.example").await.unwrap());
}

/// `[database] sqlite_readers` and `sqlite_cache_kib` are what every connection gets: the
/// readers' pool holds at most that many connections, and each connection's page cache
/// (writer and readers alike) is bounded by the configured size instead of SQLite's
/// 2 MiB default, which is what a server held per connection once its logins had read
/// the file.
#[tokio::test]
async fn every_connection_gets_the_configured_page_cache_and_the_readers_their_count() {
    let path = scratch("sized.db");
    let config = presenced::config::DatabaseConfig {
        url: format!("sqlite://{}", path.display()),
        sqlite_readers: 3,
        sqlite_cache_kib: 200,
        ..Default::default()
    };
    let store = Store::open(&config).await.expect("open");
    store.migrate(std::path::Path::new("")).await.unwrap();
    let readers = store.sqlite_readers().expect("an SQLite store");
    assert_eq!(readers.options().get_max_connections(), 3);
    let writer = store.sqlite_pool().expect("an SQLite store");
    for (name, pool) in [("writer", writer), ("reader", readers)] {
        let cache: i64 = sqlx::query_scalar("PRAGMA cache_size")
            .fetch_one(pool)
            .await
            .unwrap();
        assert_eq!(cache, -200, "{name}: a negative cache_size is KiB");
    }
    // Every reader, not only the first one opened: hold three at once.
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(readers.acquire().await.unwrap());
    }
    for conn in &mut held {
        let cache: i64 = sqlx::query_scalar("PRAGMA cache_size")
            .fetch_one(&mut **conn)
            .await
            .unwrap();
        assert_eq!(cache, -200);
    }
}

/// The file holds every account's SCRAM StoredKey and ServerKey: a new one, and the WAL
/// beside it, are readable by the server's user only.
#[tokio::test]
async fn a_new_database_file_and_its_wal_are_private_to_the_servers_user() {
    use std::os::unix::fs::PermissionsExt;
    let path = scratch("private.db");
    let store = open(&path).await.expect("open");
    store
        .create_account("alice", "example.org", "pw", 4096)
        .await
        .expect("a write, so the WAL exists");
    for p in [
        path.clone(),
        PathBuf::from(format!("{}-wal", path.display())),
    ] {
        let mode = std::fs::metadata(&p)
            .expect("file exists")
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "{}: mode {:o}", p.display(), mode & 0o777);
    }
}

/// As sshd does with its files: an operator's migrations directory, or a file in it, that
/// another local user may write would let that user run SQL as the server (as root, when
/// `migrate` runs as root). It is refused, naming the path, and nothing is applied.
#[tokio::test]
async fn operator_migrations_that_others_may_write_are_refused() {
    use std::os::unix::fs::PermissionsExt;
    let path = scratch("migrations.db");
    let store = Store::connect(&format!("sqlite://{}", path.display()), 2)
        .await
        .expect("open");
    let dir = path.parent().unwrap().join("migrations.d");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("1000_mine.sql");
    std::fs::write(&file, "CREATE TABLE mine (x INTEGER);").unwrap();
    for (what, target, mode) in [("directory", &dir, 0o777), ("file", &file, 0o666)] {
        std::fs::set_permissions(target, std::fs::Permissions::from_mode(mode)).unwrap();
        let err = store.migrate(&dir).await.expect_err(what).to_string();
        assert!(
            err.contains(&target.display().to_string()) && err.contains("writable"),
            "{what}: {err}"
        );
        let safe = if what == "directory" { 0o755 } else { 0o644 };
        std::fs::set_permissions(target, std::fs::Permissions::from_mode(safe)).unwrap();
    }
    store.migrate(&dir).await.expect("applied once private");
    sqlx::query("SELECT x FROM mine")
        .execute(store.sqlite_pool().expect("SQLite"))
        .await
        .expect("the operator's table exists");
}
