//! What SIGHUP changes in a running server.
//!
//! Reloaded:
//!
//! * the TLS certificate and key (c2s, direct TLS, HTTPS, s2s listeners and the client
//!   certificate of new outgoing s2s streams; a handshake takes the certificate current
//!   when it starts, so established sessions are untouched);
//! * the TLS session ticket settings (`[tls] tickets`, `ticket_secret`, `ticket_rotation`,
//!   [`crate::transport::tls::tickets`]): a changed secret or rotation refuses the tickets
//!   issued before, whose clients then make one full handshake;
//! * `[log] level`;
//! * `[limits]` ([`crate::node::live`]): what a connection copies at its start (stanza size,
//!   depth, rates, queue) applies to new connections, what is checked per request (roster,
//!   block list, pending requests, resources, interest lists) at once; the few limits held
//!   in state built at start are named as needing a restart
//!   ([`crate::node::live::restart_only_limits`]);
//! * the `[s2s]` routes, default policy and per-domain policies, for streams negotiated and
//!   links dialled after the reload (an authenticated stream keeps the policy it was
//!   admitted under);
//! * `[privacy]` defaults: the gate's cached inputs are dropped and every online user's
//!   presence is re-decided, so presence a stricter default withholds is withdrawn at once
//!   (RFC 6121 §4.4 unavailable from what each viewer was shown).
//!
//! Every other table is read by tasks that started with it (listeners bound, pools sized),
//! so a change there is logged as needing a restart rather than half applied. A file that
//! does not load or check changes nothing.

use std::path::Path;

use crate::app::server::Running;
use crate::config::{CheckedConfig, Config};

/// What one reload did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// What was applied, in words.
    pub reloaded: Vec<String>,
    /// Tables that changed but only take effect after a restart.
    pub need_restart: Vec<&'static str>,
}

/// Re-reads `path`, applies what can change at run time, and logs what it did.
pub async fn reload(path: &Path, running: &Running) {
    tracing::info!(config = %path.display(), "SIGHUP: reloading");
    let new = match Config::load(path) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(config = %path.display(), error = %e, "reload failed; the running configuration stays");
            return;
        }
    };
    match apply(&running.shared.config, &new, running).await {
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
pub async fn apply(
    old: &Config,
    new: &CheckedConfig,
    running: &Running,
) -> Result<Outcome, String> {
    let shared = &running.shared;
    // Both loads first, so a bad key leaves everything as it was.
    running
        .certificates
        .reload(new)
        .map_err(|e| format!("TLS: {e}"))?;
    let identity = crate::transport::tls::identity(new).map_err(|e| format!("TLS: {e}"))?;
    shared.s2s.set_client_identity(identity);
    let mut outcome = Outcome::default();
    outcome.reloaded.push(format!(
        "TLS certificate ({})",
        new.tls
            .cert
            .as_deref()
            .unwrap_or(&new.tls.certs_dir)
            .display()
    ));
    if running.tickets.reload(&new.tls) {
        outcome.reloaded.push(format!(
            "TLS session tickets ({}, rotation {} s)",
            if new.tls.tickets { "on" } else { "off" },
            new.tls.ticket_rotation.as_secs()
        ));
    }
    if let Some(filter) = crate::app::logging::reload(&new.log) {
        outcome.reloaded.push(format!("log filter `{filter}`"));
    }
    let before = shared.live.reload(new);
    let now = shared.live.get();
    if format!("{:?}", before.limits) != format!("{:?}", now.limits) {
        shared
            .store
            .set_limits(crate::store::StoreLimits::from_config(&now.limits));
        outcome.reloaded.push("[limits]".into());
    }
    if format!("{:?}", before.s2s) != format!("{:?}", now.s2s) {
        outcome.reloaded.push("[s2s] routes and policies".into());
    }
    let defaults_before = shared.store.privacy_defaults();
    shared.store.set_privacy_defaults(&new.privacy);
    if shared.store.privacy_defaults() != defaults_before {
        // Whatever was decided under the old default is decided again: cached inputs go,
        // and each online user's presence is reconciled with what its viewers may see now.
        shared.store.forget_all_audiences();
        let users = shared.sessions.users().len();
        crate::services::presence::gate::reconcile_all(&running.services.presence).await;
        outcome.reloaded.push(format!(
            "[privacy] defaults (online {:?}, last seen {:?}; {users} online users re-decided)",
            new.privacy.online, new.privacy.last_seen,
        ));
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
        (
            "[limits] (listener admission, SASL back-off, per-session presence bounds)",
            &crate::node::live::restart_only_limits(&old.limits),
            &crate::node::live::restart_only_limits(&new.limits),
        ),
        ("[liveness]", &old.liveness, &new.liveness),
        ("[http]", &old.http, &new.http),
        (
            "[s2s] (other than routes and policies)",
            &crate::node::live::restart_only_s2s(&old.s2s),
            &crate::node::live::restart_only_s2s(&new.s2s),
        ),
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
        // Reloaded at run time: not named.
        new.limits.max_stanza_size += 1;
        new.log.level = "debug".into();
        new.tls.cert = Some("/elsewhere.pem".into());
        new.privacy.online = crate::config::DefaultVisibility::Nobody;
        new.s2s.default_policy.allow_dialback = !new.s2s.default_policy.allow_dialback;
        assert!(restart_needed(&old, &new).is_empty());
        new.limits.max_connections += 1;
        new.s2s.port += 1;
        assert_eq!(
            restart_needed(&old, &new),
            vec![
                "[limits] (listener admission, SASL back-off, per-session presence bounds)",
                "[s2s] (other than routes and policies)"
            ]
        );
    }
}
