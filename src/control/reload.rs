//! What SIGHUP changes in a running server.
//!
//! Reloaded: the TLS certificate and key (c2s, direct TLS, HTTPS, s2s listeners and the
//! client certificate of new outgoing s2s streams; a handshake takes the certificate
//! current when it starts, so established sessions are untouched) and `[log] level`.
//! Every other table is read by tasks that started with it (listeners bound, pools sized,
//! limits copied into per-connection state), so a change there is logged as needing a
//! restart rather than half applied. A file that does not load or check changes nothing.

use std::path::Path;

use crate::config::{CheckedConfig, Config};
use crate::server::Running;

/// What one reload did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// What was applied, in words.
    pub reloaded: Vec<String>,
    /// Tables that changed but only take effect after a restart.
    pub need_restart: Vec<&'static str>,
}

/// Re-reads `path`, applies what can change at run time, and logs what it did.
pub fn reload(path: &Path, running: &Running) {
    tracing::info!(config = %path.display(), "SIGHUP: reloading");
    let new = match Config::load(path) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(config = %path.display(), error = %e, "reload failed; the running configuration stays");
            return;
        }
    };
    match apply(&running.shared.config, &new, running) {
        Ok(outcome) => {
            for what in &outcome.reloaded {
                tracing::info!("reloaded {what}");
            }
            if !outcome.need_restart.is_empty() {
                tracing::warn!(
                    tables = %outcome.need_restart.join(" "),
                    "changed in the file; takes effect after a restart"
                );
            }
            tracing::info!("reload done");
        }
        Err(e) => {
            tracing::error!(error = %e, "reload failed; the running configuration stays")
        }
    }
}

/// Applies `new` over the server started with `old`.
pub fn apply(old: &Config, new: &CheckedConfig, running: &Running) -> Result<Outcome, String> {
    // Both loads first, so a bad key leaves everything as it was.
    running
        .certificates
        .reload(new)
        .map_err(|e| format!("TLS: {e}"))?;
    let identity = crate::tls::identity(new).map_err(|e| format!("TLS: {e}"))?;
    running.shared.s2s.set_client_identity(identity);
    let mut outcome = Outcome::default();
    outcome.reloaded.push(format!(
        "TLS certificate ({})",
        new.tls
            .cert
            .as_deref()
            .unwrap_or(&new.tls.certs_dir)
            .display()
    ));
    if let Some(filter) = crate::logging::reload(&new.log) {
        outcome.reloaded.push(format!("log filter `{filter}`"));
    }
    outcome.need_restart = restart_needed(old, new);
    Ok(outcome)
}

/// The tables whose change only a restart applies.
pub fn restart_needed(old: &Config, new: &Config) -> Vec<&'static str> {
    let same =
        |a: &dyn std::fmt::Debug, b: &dyn std::fmt::Debug| format!("{a:?}") == format!("{b:?}");
    let mut out = Vec::new();
    let tables: [(&'static str, &dyn std::fmt::Debug, &dyn std::fmt::Debug); 11] = [
        ("domains", &old.domains, &new.domains),
        ("[c2s]", &old.c2s, &new.c2s),
        ("[database]", &old.database, &new.database),
        ("[redis]", &old.redis, &new.redis),
        ("[auth]", &old.auth, &new.auth),
        ("[limits]", &old.limits, &new.limits),
        ("[liveness]", &old.liveness, &new.liveness),
        ("[http]", &old.http, &new.http),
        ("[s2s]", &old.s2s, &new.s2s),
        ("[log] format", &old.log.format, &new.log.format),
        ("[admin]", &old.admin, &new.admin),
        // [cluster] is left out: an unset node_id is derived anew at every load (with a
        // random part on port 0), so comparing it would warn about a change nobody made.
    ];
    for (name, a, b) in tables {
        if !same(a, b) {
            out.push(name);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_changed_tables_are_named() {
        let old = Config::default();
        let mut new = Config::default();
        assert!(restart_needed(&old, &new).is_empty());
        new.limits.max_stanza_size += 1;
        new.log.level = "debug".into();
        new.tls.cert = Some("/elsewhere.pem".into());
        assert_eq!(restart_needed(&old, &new), vec!["[limits]"]);
    }
}
