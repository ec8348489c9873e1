//! The `presenced` command line. Operators and scripts rely on these subcommands and flags:
//! they are a stable interface.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use presenced::config::{CheckedConfig, Config};
use presenced::jid::BareJid;
use presenced::store::{Store, StoreError};

/// jemalloc rather than glibc's malloc: a login allocates tens of kilobytes that are freed
/// after bind, between the few kilobytes each idle session keeps, and glibc keeps those
/// holes resident (26 kB RSS per idle session in the benchmark; `malloc_trim` won back
/// only 2 kB of it). jemalloc with a background thread that returns dirty pages after a
/// second holds 19 kB, at no cost in CPU per login or per delivery (BENCHMARKS.md).
/// `_RJEM_MALLOC_CONF` in the environment still overrides these settings.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[allow(non_upper_case_globals)]
#[export_name = "_rjem_malloc_conf"]
pub static malloc_conf: &[u8] = b"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0\0";

/// A federated XMPP server whose centre is presence.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    /// Configuration file (see presenced.example.toml).
    #[arg(long, short, global = true, default_value = "presenced.toml")]
    config: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Apply migrations and serve clients until SIGINT/SIGTERM.
    Serve,
    /// Apply the SQL migrations in [database] migrations and exit.
    Migrate,
    /// Parse and validate the configuration, print the effective values and whether the
    /// store can be reached, exit.
    CheckConfig,
    /// Copy every account, roster, waiting subscription request, block list, privacy
    /// setting, last seen and server secret from one store to another (PostgreSQL or
    /// SQLite, either way). The destination gets the schema first and must not hold any
    /// of the source's accounts. Run it while no server uses either store.
    CopyStore {
        /// Source database URL (postgres://... or sqlite://path).
        #[arg(long)]
        from: String,
        /// Destination database URL (created if missing).
        #[arg(long)]
        to: String,
    },
    /// Manage accounts.
    User {
        #[command(subcommand)]
        action: UserAction,
    },
}

#[derive(Subcommand)]
enum UserAction {
    /// Create an account. The password is read from --password-file or prompted for;
    /// it is never taken from the command line.
    Add {
        /// The account's bare JID, e.g. alice@example.org.
        jid: String,
        /// File whose first line is the password ("-" reads standard input).
        #[arg(long)]
        password_file: Option<PathBuf>,
    },
    /// Change an account's password.
    Passwd {
        /// The account's bare JID.
        jid: String,
        /// File whose first line is the password ("-" reads standard input).
        #[arg(long)]
        password_file: Option<PathBuf>,
    },
    /// Delete an account and everything it owns.
    Del {
        /// The account's bare JID.
        jid: String,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let config = match Config::load(&cli.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("presenced: {e}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("presenced: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cli.command, config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("presenced: {msg}");
            ExitCode::FAILURE
        }
    }
}

async fn run(command: Command, config: CheckedConfig) -> Result<(), String> {
    match command {
        Command::Serve => presenced::server::run(config)
            .await
            .map_err(|e| e.to_string()),
        Command::CheckConfig => {
            println!("configuration OK");
            println!("domains: {}", config.domains.join(", "));
            println!(
                "c2s: {}:{} (STARTTLS), direct TLS {} on port {}",
                config.c2s.bind,
                config.c2s.port,
                if config.c2s.direct_tls { "on" } else { "off" },
                config.c2s.direct_tls_port
            );
            let (store, found) = presenced::store::probe(&config.database.url).await;
            match found {
                Ok(state) => println!("store: {store}: {state}"),
                Err(e) => {
                    println!("store: {store}: NOT USABLE: {e}");
                    eprintln!("presenced: store {store}: {e}");
                }
            }
            println!("migrations: {}", config.database.migrations.display());
            println!("limits: {:?}", config.limits);
            Ok(())
        }
        Command::CopyStore { from, to } => {
            // The built-in schema only: the operator's files are for the configured store
            // and its dialect, and the copy brings their data along.
            let open = |url: String| async move {
                let store = Store::connect(&url, 2)
                    .await
                    .map_err(|e| format!("{url}: {e}"))?;
                store
                    .migrate(std::path::Path::new(""))
                    .await
                    .map_err(|e| format!("{url}: migrations: {e}"))?;
                Ok::<Store, String>(store)
            };
            let source = open(from.clone()).await?;
            let destination = open(to.clone()).await?;
            let n = presenced::store::copy::copy(&source, &destination)
                .await
                .map_err(|e| format!("copying {from} to {to}: {e}"))?;
            println!(
                "copied {} accounts, {} roster items, {} waiting subscription requests, \
                 {} block-list entries, {} privacy settings, {} last-seen values, {} secrets",
                n.accounts, n.roster_items, n.pending, n.blocks, n.privacy, n.last_seen, n.secrets
            );
            Ok(())
        }
        Command::Migrate => {
            let store = connect(&config).await?;
            println!(
                "built-in schema applied, then migrations from {}",
                config.database.migrations.display()
            );
            drop(store);
            Ok(())
        }
        Command::User { action } => user(action, &config).await,
    }
}

async fn connect(config: &Config) -> Result<Store, String> {
    let store = Store::open(&presenced::config::DatabaseConfig {
        max_connections: 2,
        ..config.database.clone()
    })
    .await
    .map_err(|e| format!("database: {e}"))?;
    store
        .migrate(&config.database.migrations)
        .await
        .map_err(|e| format!("migrations: {e}"))?;
    Ok(store)
}

fn account(jid: &str, config: &Config) -> Result<(String, String), String> {
    let bare = BareJid::new(jid).map_err(|e| format!("{jid}: not a valid JID ({e})"))?;
    let node = bare
        .node()
        .map(|n| n.as_str().to_owned())
        .ok_or_else(|| format!("{jid}: an account JID needs a localpart (user@domain)"))?;
    let domain = bare.domain().as_str().to_owned();
    if !config.serves(&domain) {
        return Err(format!("{domain} is not one of the configured domains"));
    }
    Ok((node, domain))
}

/// Reads a password from a file ("-": stdin), or prompts twice on the terminal.
fn read_password(file: Option<PathBuf>) -> Result<String, String> {
    let pw = match file {
        Some(p) if p.as_os_str() == "-" => {
            let mut line = String::new();
            std::io::stdin()
                .read_line(&mut line)
                .map_err(|e| format!("stdin: {e}"))?;
            line
        }
        Some(p) => std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?,
        None => {
            let a = rpassword::prompt_password("Password: ").map_err(|e| e.to_string())?;
            let b = rpassword::prompt_password("Again: ").map_err(|e| e.to_string())?;
            if a != b {
                return Err("the passwords differ".into());
            }
            a
        }
    };
    let pw = pw.lines().next().unwrap_or("").to_owned();
    if pw.is_empty() {
        return Err("empty password".into());
    }
    Ok(pw)
}

async fn user(action: UserAction, config: &Config) -> Result<(), String> {
    let iterations = config.auth.scram_iterations;
    match action {
        UserAction::Add { jid, password_file } => {
            let (node, domain) = account(&jid, config)?;
            let pw = read_password(password_file)?;
            let store = connect(config).await?;
            match store.create_account(&node, &domain, &pw, iterations).await {
                Ok(()) => {
                    println!("created {node}@{domain}");
                    Ok(())
                }
                Err(StoreError::AccountExists) => Err(format!("{node}@{domain} already exists")),
                Err(e) => Err(e.to_string()),
            }
        }
        UserAction::Passwd { jid, password_file } => {
            let (node, domain) = account(&jid, config)?;
            let pw = read_password(password_file)?;
            let store = connect(config).await?;
            match store.set_password(&node, &domain, &pw, iterations).await {
                Ok(true) => {
                    println!("password changed for {node}@{domain}");
                    Ok(())
                }
                Ok(false) => Err(format!("no account {node}@{domain}")),
                Err(e) => Err(e.to_string()),
            }
        }
        UserAction::Del { jid } => {
            let (node, domain) = account(&jid, config)?;
            let store = connect(config).await?;
            match store.delete_account(&node, &domain).await {
                Ok(true) => {
                    println!("deleted {node}@{domain}");
                    Ok(())
                }
                Ok(false) => Err(format!("no account {node}@{domain}")),
                Err(e) => Err(e.to_string()),
            }
        }
    }
}
