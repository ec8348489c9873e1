//! The settings a reload (SIGHUP) changes while the server runs: `[limits]` and the
//! federation routes and policies of `[s2s]`. Whoever needs one reads the current value
//! when it starts a piece of work ([`Live::get`]: a connection's reader limits, one roster
//! set, one outgoing dial), so a reload applies to what starts after it and never changes
//! the rules under a stream already negotiated.
//!
//! The few limits copied into long-lived state at start (the admission semaphore and
//! per-IP rate of the listeners, the SASL back-off policy, the per-session bounds of
//! revealed and directed presence) are not read from here; [`restart_only_limits`] names
//! them, and a reload that changes them says they need a restart.

use std::sync::{Arc, RwLock};

use crate::config::{Config, LimitsConfig, S2sConfig};

/// The current reloadable settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `[limits]`.
    pub limits: LimitsConfig,
    /// `[s2s]`, of which `routes`, `default_policy` and `domains` change on reload; the
    /// rest stays as at start.
    pub s2s: S2sConfig,
}

/// Holder of [`Settings`]; readers get a snapshot that a reload does not change.
#[derive(Debug)]
pub struct Live {
    current: RwLock<Arc<Settings>>,
}

impl Live {
    /// The settings of the configuration the server starts with.
    pub fn new(config: &Config) -> Live {
        Live {
            current: RwLock::new(Arc::new(Settings {
                limits: config.limits.clone(),
                s2s: config.s2s.clone(),
            })),
        }
    }

    /// The current settings.
    pub fn get(&self) -> Arc<Settings> {
        self.current
            .read()
            .map(|s| s.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    }

    /// Takes the reloadable parts of `new`; returns the settings before.
    pub fn reload(&self, new: &Config) -> Arc<Settings> {
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        let before = current.clone();
        let mut s2s = before.s2s.clone();
        s2s.routes = new.s2s.routes.clone();
        s2s.default_policy = new.s2s.default_policy.clone();
        s2s.domains = new.s2s.domains.clone();
        *current = Arc::new(Settings {
            limits: new.limits.clone(),
            s2s,
        });
        before
    }
}

/// The `[limits]` keys read once at start into long-lived state, so a change needs a
/// restart: as text, for comparing two configurations.
pub fn restart_only_limits(l: &LimitsConfig) -> String {
    format!(
        "{:?}",
        (
            l.max_connections,
            l.max_connections_per_ip,
            l.connections_per_ip_per_minute,
            l.max_directed_presences,
            l.max_revealed_per_session,
            // The capabilities cache is built once at start.
            (
                l.max_caps_entries,
                l.max_caps_queries_per_session,
                l.caps_query_timeout,
            ),
            (
                l.auth_backoff_failures,
                l.auth_backoff_window_ms,
                l.auth_backoff_base_ms,
                l.auth_backoff_max_ms,
                l.auth_backoff_max_entries,
            ),
        )
    )
}

/// `[s2s]` without what a reload changes (routes and policies), as text.
pub fn restart_only_s2s(s: &S2sConfig) -> String {
    let mut fixed = s.clone();
    fixed.routes = Default::default();
    fixed.default_policy = Default::default();
    fixed.domains = Default::default();
    format!("{fixed:?}")
}
