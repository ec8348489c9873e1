//! The process's log: one tracing subscriber, text or JSON on standard error, its filter
//! replaceable at run time (SIGHUP).
//!
//! The filter comes from `RUST_LOG` when that is set and otherwise from `[log] level`; a
//! reload re-reads `[log] level` only when `RUST_LOG` is unset, so an operator who started
//! the server with `RUST_LOG` keeps exactly what they asked for. Colour codes are written
//! only when standard error is a terminal: files, pipes and journald get plain text.
//!
//! Writing the log never fails the process: tracing-subscriber drops a line it cannot write
//! (a closed pipe, a full disk) instead of panicking, which keeps SIGTERM's last-seen flush
//! running even when whatever read standard error is gone.

use std::io::IsTerminal;
use std::sync::OnceLock;

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{reload, EnvFilter, Layer, Registry};

use crate::config::{LogConfig, LogFormat};

/// sqlx logs every PostgreSQL NOTICE at info, among them the "relation _sqlx_migrations
/// already exists, skipping" of every start; notices that matter come as warnings.
const QUIET: &str = "sqlx::postgres::notice=warn";

static FILTER: OnceLock<reload::Handle<EnvFilter, Registry>> = OnceLock::new();

/// Where the filter came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `RUST_LOG` in the environment.
    Environment,
    /// `[log] level`.
    Config,
}

fn env_directives() -> Option<String> {
    std::env::var("RUST_LOG")
        .ok()
        .filter(|s| !s.trim().is_empty())
}

/// The filter in force for this configuration, and where it came from.
pub fn directives(config: &LogConfig) -> (String, Source) {
    match env_directives() {
        Some(env) => (env, Source::Environment),
        None => (format!("{},{QUIET}", config.level), Source::Config),
    }
}

fn filter(directives: &str) -> EnvFilter {
    EnvFilter::try_new(directives).unwrap_or_else(|e| {
        // Only RUST_LOG can get here ([log] level is checked with the config).
        eprintln_safe(&format!(
            "presenced: RUST_LOG ignored ({e}); logging at info"
        ));
        EnvFilter::new(format!("info,{QUIET}"))
    })
}

/// Installs the subscriber. Called once, before anything logs.
pub fn init(config: &LogConfig) {
    let (directives, _) = directives(config);
    let (filter, handle) = reload::Layer::new(filter(&directives));
    let ansi = std::io::stderr().is_terminal();
    let output: Box<dyn Layer<_> + Send + Sync> = match config.format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_ansi(ansi)
            .with_writer(std::io::stderr)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_ansi(false)
            .with_writer(std::io::stderr)
            .boxed(),
    };
    if Registry::default()
        .with(filter)
        .with(output)
        .try_init()
        .is_ok()
    {
        let _ = FILTER.set(handle);
    }
}

/// Applies `[log] level` of a reloaded configuration. Returns the filter now in force, or
/// `None` when it did not change (`RUST_LOG` is set, or this process did not install the
/// log, as in tests that run the server in process).
pub fn reload(config: &LogConfig) -> Option<String> {
    let handle = FILTER.get()?;
    let (directives, source) = directives(config);
    if source == Source::Environment {
        return None;
    }
    let before = handle.with_current(|f| f.to_string()).ok();
    let new = filter(&directives);
    let after = new.to_string();
    if before.as_deref() == Some(after.as_str()) {
        return None;
    }
    handle.reload(new).ok()?;
    Some(directives)
}

/// `eprintln!` without its panic when standard error is closed.
pub fn eprintln_safe(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// `println!` without its panic when standard output is closed (`presenced … | head`).
/// A reader that went away is not an error of ours: the process stops writing.
pub fn println_safe(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout(), "{line}");
}
