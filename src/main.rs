//! The `presenced` command line. Operators and scripts rely on these subcommands and flags:
//! they are a stable interface.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use presenced::app::admin::{ClientError, Request};
use presenced::config::{CheckedConfig, Config};
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

/// jemalloc's figures for the admin socket's `stats` (`allocator`), read through its
/// `mallctl` interface. tikv-jemalloc-ctl would wrap this, but it pulls in the unmaintained
/// `paste`; the four reads are all this needs.
fn allocator_figures() -> Option<presenced::app::admin::AllocatorFigures> {
    use std::ffi::{c_void, CStr};
    fn read(name: &CStr) -> Option<u64> {
        let mut value: libc::size_t = 0;
        let mut len = std::mem::size_of::<libc::size_t>();
        // SAFETY: every name read here is a `size_t` statistic (jemalloc's manual, MALLCTL
        // NAMESPACE); `value` and `len` are that size and outlive the call; nothing is written.
        let rc = unsafe {
            tikv_jemalloc_sys::mallctl(
                name.as_ptr(),
                (&raw mut value).cast::<c_void>(),
                &mut len,
                std::ptr::null_mut(),
                0,
            )
        };
        (rc == 0).then_some(value as u64)
    }
    // The stats are a snapshot taken when the epoch advances; writing any value advances it.
    let mut epoch: u64 = 1;
    let mut len = std::mem::size_of::<u64>();
    // SAFETY: "epoch" reads and writes a `uint64_t`; both buffers are that size and live.
    let rc = unsafe {
        tikv_jemalloc_sys::mallctl(
            c"epoch".as_ptr(),
            (&raw mut epoch).cast::<c_void>(),
            &mut len,
            (&raw mut epoch).cast::<c_void>(),
            std::mem::size_of::<u64>(),
        )
    };
    if rc != 0 {
        return None;
    }
    Some(presenced::app::admin::AllocatorFigures {
        allocated: read(c"stats.allocated")?,
        active: read(c"stats.active")?,
        resident: read(c"stats.resident")?,
        metadata: read(c"stats.metadata")?,
    })
}

/// `println!` that stops quietly when standard output is closed (`presenced … | head`).
macro_rules! out {
    ($($t:tt)*) => { presenced::app::logging::println_safe(&format!($($t)*)) };
}

use presenced::app::logging::eprintln_safe;

/// A federated XMPP server whose centre is presence.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    /// Configuration file (see presenced.example.toml).
    #[arg(long, short, global = true, default_value = "presenced.toml")]
    config: PathBuf,
    /// Print the answer of an admin command (user list, session …, stats, roster …) as JSON.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Apply migrations and serve clients until SIGTERM/SIGINT/SIGQUIT; SIGHUP reloads.
    Serve,
    /// Make the server running with this --config reload it (sends it SIGHUP).
    Reload,
    /// Apply the SQL migrations in [database] migrations and exit.
    Migrate,
    /// Validate the configuration, check the files and certificate it names, print the
    /// effective values. Exit status: 0 fine, 1 a check failed, 2 the file is invalid.
    CheckConfig {
        /// Also reach PostgreSQL and Redis and say what answered; an unusable store is
        /// then a failure rather than a warning.
        #[arg(long)]
        connect: bool,
    },
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
    /// Sessions on the running server (over the admin socket).
    Session {
        #[command(subcommand)]
        action: SessionAction,
    },
    /// Figures of the running server (over the admin socket).
    Stats,
    /// Rosters of local accounts, changed on the running server (over the admin socket):
    /// online users get the roster pushes and presence a client-made change would give.
    Roster {
        #[command(subcommand)]
        action: RosterAction,
    },
}

#[derive(Subcommand)]
enum RosterAction {
    /// An account's roster: contact, subscription, name, groups.
    Show {
        /// The account's bare JID.
        jid: String,
    },
    /// Make two local accounts mutual contacts (subscription both, each way), as the SQL
    /// operation presenced_roster_make_mutual does.
    Add {
        /// The account's bare JID.
        jid: String,
        /// The contact's bare JID (a local account).
        contact: String,
        /// The name JID shows for the contact.
        #[arg(long)]
        name: Option<String>,
        /// A group JID files the contact under (repeat for several).
        #[arg(long = "group")]
        groups: Vec<String>,
    },
    /// Remove two accounts from each other's rosters (presenced_roster_unpair).
    Remove {
        /// The account's bare JID.
        jid: String,
        /// The contact's bare JID.
        contact: String,
    },
}

#[derive(Subcommand)]
enum SessionAction {
    /// Bound sessions: full JID, transport, IP, since; of one account or resource, or all.
    List {
        /// Bare JID (that account's sessions) or full JID (one resource).
        jid: Option<String>,
    },
    /// End sessions with a stream error (policy-violation); contacts see them go offline.
    Kick {
        /// Bare JID (every resource) or full JID (one).
        jid: String,
        /// Text sent with the stream error.
        #[arg(long)]
        reason: Option<String>,
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
    /// End an account's XEP-0484 FAST tokens, of one client installation or all: the
    /// client logs in with its password next time. Sessions already logged in go on
    /// (`presenced session kick` ends them).
    Revoke {
        /// The account's bare JID.
        jid: String,
        /// Only the tokens of this client (its XEP-0388 user-agent id).
        #[arg(long)]
        client: Option<String>,
    },
    /// Accounts, of one domain or all (over the admin socket).
    List {
        /// Only this domain.
        #[arg(long)]
        domain: Option<String>,
    },
    /// Delete an account, everything it owns and every other local user's roster item
    /// for it. A running server (over the admin socket) first ends its sessions and then
    /// tells its contacts (roster pushes; unsubscribe/unsubscribed to other servers).
    /// Without a server nothing can be sent to other servers, so an account with
    /// contacts there is refused unless --local-only says to delete it anyway.
    Del {
        /// The account's bare JID.
        jid: String,
        /// Without a running server: delete even though contacts on other servers keep
        /// their subscription (they are listed).
        #[arg(long)]
        local_only: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match Config::load(&cli.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln_safe(&format!("presenced: {e}"));
            return ExitCode::from(2);
        }
    };
    presenced::app::logging::init(&config.log);
    presenced::app::admin::report_allocator(allocator_figures);
    if let Command::Reload = cli.command {
        return match presenced::app::control::send_reload(&cli.config) {
            Ok(pid) => {
                out!("sent SIGHUP to pid {pid}; the server logs what it reloaded");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln_safe(&format!("presenced: {e}"));
                ExitCode::FAILURE
            }
        };
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln_safe(&format!("presenced: cannot start the runtime: {e}"));
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cli.command, config, cli.config, cli.json)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln_safe(&format!("presenced: {msg}"));
            ExitCode::FAILURE
        }
    }
}

async fn run(
    command: Command,
    config: CheckedConfig,
    path: PathBuf,
    json: bool,
) -> Result<(), String> {
    match command {
        Command::Serve => presenced::app::control::run(config, path)
            .await
            .map_err(|e| e.to_string()),
        Command::Reload => unreachable!("handled before the runtime starts"),
        Command::CheckConfig { connect } => {
            use presenced::app::control::check;
            let mut findings = check::files(&config).await;
            let store = check::store(&config, connect).await;
            let usable = store.level == check::Level::Ok;
            findings.push(store);
            if connect {
                findings.extend(check::connect(&config, usable).await);
            }
            let effective = check::effective(&config).map_err(|e| e.to_string())?;
            out!("{}", check::render(&findings, &effective).trim_end());
            match findings.iter().any(|f| f.level == check::Level::Fail) {
                true => Err("check-config: a check failed (FAIL lines above)".into()),
                false => Ok(()),
            }
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
            out!(
                "copied {} accounts, {} roster items, {} waiting subscription requests, \
                 {} block-list entries, {} privacy settings, {} last-seen values, {} PEP items, \
                 {} vCards, {} offline messages, {} secrets",
                n.accounts,
                n.roster_items,
                n.pending,
                n.blocks,
                n.privacy,
                n.last_seen,
                n.pep_items,
                n.vcards,
                n.offline_messages,
                n.secrets
            );
            Ok(())
        }
        Command::Migrate => {
            let store = connect(&config).await?;
            out!(
                "built-in schema applied, then migrations from {}",
                config.database.migrations.display()
            );
            drop(store);
            Ok(())
        }
        Command::User {
            action: UserAction::List { domain },
        } => admin(&config, Request::UserList { domain }, json).await,
        Command::User { action } => user(action, &config, json).await,
        Command::Session {
            action: SessionAction::List { jid },
        } => admin(&config, Request::SessionList { jid }, json).await,
        Command::Session {
            action: SessionAction::Kick { jid, reason },
        } => admin(&config, Request::SessionKick { jid, reason }, json).await,
        Command::Stats => admin(&config, Request::Stats, json).await,
        Command::Roster { action } => {
            let req = match action {
                RosterAction::Show { jid } => Request::RosterShow { jid },
                RosterAction::Add {
                    jid,
                    contact,
                    name,
                    groups,
                } => Request::RosterAdd {
                    jid,
                    contact,
                    name,
                    groups,
                },
                RosterAction::Remove { jid, contact } => Request::RosterRemove { jid, contact },
            };
            admin(&config, req, json).await
        }
    }
}

async fn connect(config: &Config) -> Result<Store, String> {
    let store = Store::open(&presenced::config::DatabaseConfig {
        max_connections: 2,
        ..config.database.clone()
    })
    .await
    .map_err(|e| e.to_string())?;
    store
        .migrate(&config.database.migrations)
        .await
        .map_err(|e| e.to_string())?;
    Ok(store)
}

fn account(jid: &str, config: &Config) -> Result<(String, String), String> {
    let bare = presenced::protocol::jid::parse_bare(jid)
        .map_err(|e| format!("{jid}: not a valid JID ({e})"))?;
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
            use std::io::IsTerminal;
            // rpassword reads the controlling terminal; without one it fails with the bare
            // "No such device or address". Say what works instead.
            if !std::io::stdin().is_terminal() {
                return Err(
                    "no terminal to prompt for the password: pass --password-file FILE \
                            (its first line), or --password-file - to read standard input"
                        .into(),
                );
            }
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

/// One admin command against the running server, its answer printed.
async fn admin(config: &Config, req: Request, json: bool) -> Result<(), String> {
    let path = admin_socket(config)?;
    let answer = presenced::app::admin::request(&path, &req)
        .await
        .map_err(|e| e.to_string())?;
    print_answer(&req, &answer, json);
    Ok(())
}

fn admin_socket(config: &Config) -> Result<PathBuf, String> {
    config
        .admin
        .socket
        .clone()
        .ok_or_else(|| "[admin] socket is not set: no admin commands".to_owned())
}

fn print_answer(req: &Request, answer: &serde_json::Value, json: bool) {
    if json {
        out!("{answer}");
    } else {
        out!("{}", presenced::app::admin::render(req, answer).trim_end());
    }
}

async fn user(action: UserAction, config: &Config, json: bool) -> Result<(), String> {
    let iterations = config.auth.scram_iterations;
    match action {
        UserAction::Add { jid, password_file } => {
            let (node, domain) = account(&jid, config)?;
            let pw = read_password(password_file)?;
            let store = connect(config).await?;
            match store.create_account(&node, &domain, &pw, iterations).await {
                Ok(()) => {
                    out!("created {node}@{domain}");
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
                    out!("password changed for {node}@{domain}");
                    // A running server ends the sessions that logged in with the old one.
                    if let Ok(path) = admin_socket(config) {
                        let req = Request::PasswordChanged {
                            jid: format!("{node}@{domain}"),
                        };
                        match presenced::app::admin::request(&path, &req).await {
                            Ok(answer) => print_answer(&req, &answer, json),
                            Err(ClientError::Unreachable(_)) => {}
                            Err(e) => return Err(format!("ending the account's sessions: {e}")),
                        }
                    }
                    Ok(())
                }
                Ok(false) => Err(format!("no account {node}@{domain}")),
                Err(e) => Err(e.to_string()),
            }
        }
        UserAction::Revoke { jid, client } => {
            let (node, domain) = account(&jid, config)?;
            let store = connect(config).await?;
            match store
                .revoke_fast_tokens(&node, &domain, client.as_deref())
                .await
            {
                Ok(Some(n)) => {
                    out!("revoked {n} FAST token(s) of {node}@{domain}");
                    Ok(())
                }
                Ok(None) => Err(format!("no account {node}@{domain}")),
                Err(e) => Err(e.to_string()),
            }
        }
        UserAction::List { .. } => unreachable!("an admin command"),
        UserAction::Del { jid, local_only } => {
            let (node, domain) = account(&jid, config)?;
            // A running server ends the account's sessions, deletes it and tells its
            // contacts (crate::services::account_deletion); without one there is no session to end.
            if let Ok(path) = admin_socket(config) {
                let req = Request::UserDel {
                    jid: format!("{node}@{domain}"),
                };
                match presenced::app::admin::request(&path, &req).await {
                    Ok(answer) => {
                        print_answer(&req, &answer, json);
                        return Ok(());
                    }
                    Err(ClientError::Unreachable(_)) => {}
                    Err(e) => return Err(e.to_string()),
                }
            }
            let store = connect(config).await?;
            let bare = format!("{node}@{domain}");
            // Nothing reaches another server from here: a contact there would keep its
            // subscription, and its server would approve the next owner of the name at
            // once (RFC 6121 §3.1.3), so such a deletion is the operator's explicit choice.
            let (_, items) = store.roster(&bare).await.map_err(|e| e.to_string())?;
            let waiting: Vec<String> = store
                .pending_subscriptions(&bare)
                .await
                .map_err(|e| e.to_string())?
                .into_iter()
                .map(|(sender, _)| sender)
                .collect();
            let remote =
                presenced::services::account_deletion::remote_contacts(&items, &waiting, |d| {
                    config.serves(d)
                });
            if !remote.is_empty() && !local_only {
                return Err(format!(
                    "{bare} has {} contact(s) on other servers ({}), which only a running \
                     server can tell (unsubscribe/unsubscribed): run this while the server runs \
                     with [admin] socket set, or pass --local-only to delete without telling them",
                    remote.len(),
                    remote.join(", ")
                ));
            }
            match store.delete_account(&node, &domain, &config.domains).await {
                Ok(Some(deleted)) => {
                    out!(
                        "deleted {bare} (removed from {} local roster(s))",
                        deleted.removed_from.len()
                    );
                    if !remote.is_empty() {
                        out!("not told (no server running): {}", remote.join(", "));
                    }
                    Ok(())
                }
                Ok(None) => Err(format!("no account {bare}")),
                Err(e) => Err(e.to_string()),
            }
        }
    }
}
