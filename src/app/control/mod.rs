//! Running the server as an operator's process: signals, reload, and (with `presenced
//! reload`) finding the running server from the command line.
//!
//! | signal | effect |
//! |---|---|
//! | SIGTERM, SIGINT, SIGQUIT | graceful stop: every session gets `system-shutdown`, grace timers and last seen are flushed |
//! | SIGHUP | reload ([`reload`]): certificates, TLS session ticket settings, the log filter, `[limits]`, `[s2s]` routes and policies, `[privacy]` defaults; other changes are named as needing a restart |
//! | SIGUSR1, SIGUSR2 | logged and ignored |
//!
//! SIGPIPE is ignored by the Rust runtime, so a closed pipe is a write error, never a kill.
//! The handlers are installed before the server starts, so no signal that arrives during
//! start-up (migrations, binding) takes the default action of killing the process.

pub mod check;
pub mod procs;
pub mod reload;

use std::path::{Path, PathBuf};

use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::app::server::StartError;
use crate::config::CheckedConfig;

/// Serves until SIGTERM, SIGINT or SIGQUIT; SIGHUP reloads from `config_path`.
pub async fn run(config: CheckedConfig, config_path: PathBuf) -> Result<(), StartError> {
    let mut signals = Signals::install().map_err(StartError::Signal)?;
    let start = crate::app::server::start(config);
    tokio::pin!(start);
    let running = loop {
        tokio::select! {
            r = &mut start => break r?,
            s = signals.next() => match s {
                Sig::Stop(name) => {
                    tracing::info!(signal = name, "stopped before the server had started");
                    return Ok(());
                }
                Sig::Hup => tracing::info!(signal = "SIGHUP", "ignored while starting"),
                Sig::Ignored(name) => tracing::info!(signal = name, "signal ignored"),
            },
        }
    };
    if let Err(e) = crate::app::admin::start(&running.shared, &running.services).await {
        running.shutdown().await;
        return Err(StartError::Admin(e));
    }
    loop {
        match signals.next().await {
            Sig::Stop(name) => {
                tracing::info!(signal = name, "shutting down");
                break;
            }
            Sig::Hup => reload::reload(&config_path, &running).await,
            Sig::Ignored(name) => tracing::info!(signal = name, "signal ignored"),
        }
    }
    running.shutdown().await;
    tracing::info!("stopped");
    Ok(())
}

enum Sig {
    Stop(&'static str),
    Hup,
    Ignored(&'static str),
}

struct Signals {
    term: Signal,
    int: Signal,
    quit: Signal,
    hup: Signal,
    usr1: Signal,
    usr2: Signal,
}

impl Signals {
    fn install() -> std::io::Result<Signals> {
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            quit: signal(SignalKind::quit())?,
            hup: signal(SignalKind::hangup())?,
            usr1: signal(SignalKind::user_defined1())?,
            usr2: signal(SignalKind::user_defined2())?,
        })
    }

    async fn next(&mut self) -> Sig {
        tokio::select! {
            _ = self.term.recv() => Sig::Stop("SIGTERM"),
            _ = self.int.recv() => Sig::Stop("SIGINT"),
            _ = self.quit.recv() => Sig::Stop("SIGQUIT"),
            _ = self.hup.recv() => Sig::Hup,
            _ = self.usr1.recv() => Sig::Ignored("SIGUSR1"),
            _ = self.usr2.recv() => Sig::Ignored("SIGUSR2"),
        }
    }
}

/// `presenced reload`: SIGHUP to the server started with the same configuration file.
pub fn send_reload(config_path: &Path) -> Result<i32, String> {
    let pid = procs::server_for(config_path)?;
    procs::hangup(pid)?;
    Ok(pid)
}
