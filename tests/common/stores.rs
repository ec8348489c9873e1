//! The store a store test runs on: each test body is an `async fn(Db)`, and
//! `on_both_stores!(name, ...)` runs it once on PostgreSQL (`DATABASE_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`; module `postgres`) and once on a fresh
//! SQLite file (module `sqlite`). Included with `#[path]` by the store test binaries.
#![allow(dead_code)]

use std::path::Path;

use presenced::store::Store;

/// The database a test runs on; [`Db::open`] may be called again for another handle on
/// the same data (as after a restart).
pub enum Db {
    Postgres(String),
    Sqlite(std::path::PathBuf),
}

impl Db {
    pub fn postgres() -> Db {
        Db::Postgres(
            std::env::var("DATABASE_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned()),
        )
    }

    /// A file of its own under the temporary directory.
    pub fn sqlite() -> Db {
        let dir = std::env::temp_dir().join("sqlite-presenced-store-tests");
        std::fs::create_dir_all(&dir).expect("temporary directory");
        Db::Sqlite(dir.join(format!("{}.db", uuid::Uuid::new_v4().simple())))
    }

    pub fn url(&self) -> String {
        match self {
            Db::Postgres(url) => url.clone(),
            Db::Sqlite(path) => format!("sqlite://{}", path.display()),
        }
    }

    pub async fn open(&self) -> Store {
        let store = Store::connect(&self.url(), 4)
            .await
            .expect("connect to the store");
        // No operator migrations: the schema is the one compiled in.
        store
            .migrate(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/no-such-dir"))
            .await
            .expect("migrations apply");
        store
    }
}

/// The URL of database `db` on the PostgreSQL server of `DATABASE_URL`.
pub fn postgres_url_for(db: &str) -> String {
    let Db::Postgres(u) = Db::postgres() else {
        unreachable!("Db::postgres is PostgreSQL")
    };
    let (base, query) = match u.split_once('?') {
        Some((b, q)) => (b.to_owned(), format!("?{q}")),
        None => (u.clone(), String::new()),
    };
    let (server, _) = base.rsplit_once('/').expect("DATABASE_URL has a database");
    format!("{server}/{db}{query}")
}

/// Makes `a` and `b` (bare JIDs) mutual contacts with the operators' SQL operation.
pub async fn make_mutual(store: &Store, a: &str, b: &str) -> Result<u64, sqlx::Error> {
    exec(
        store,
        "SELECT presenced_roster_make_mutual($1, $2)",
        "INSERT INTO presenced_roster_make_mutual (a, b) VALUES (?1, ?2)",
        &[a, b],
    )
    .await
}

/// Runs `sql` in the store's own dialect (`pg` or `lite`) with text `binds`, as an
/// operator's SQL would.
pub async fn exec(store: &Store, pg: &str, lite: &str, binds: &[&str]) -> Result<u64, sqlx::Error> {
    match store.sqlite_pool() {
        None => {
            let mut q = sqlx::query(pg);
            for b in binds {
                q = q.bind(*b);
            }
            Ok(q.execute(store.pool()).await?.rows_affected())
        }
        Some(pool) => {
            let mut q = sqlx::query(lite);
            for b in binds {
                q = q.bind(*b);
            }
            Ok(q.execute(pool).await?.rows_affected())
        }
    }
}

/// Each test body, once per store.
#[macro_export]
macro_rules! on_both_stores {
    ($($name:ident),* $(,)?) => {
        mod postgres {
            $(#[tokio::test]
            async fn $name() {
                super::$name(super::Db::postgres()).await
            })*
        }
        mod sqlite {
            $(#[tokio::test]
            async fn $name() {
                super::$name(super::Db::sqlite()).await
            })*
        }
    };
}
