//! `presenced check-config`: whether a configuration will start, in words an operator can
//! act on, and the effective values it will run with.
//!
//! Exit status: 0 when every check passed (warnings allowed), 1 when one failed, 2 when the
//! file does not parse or validate (then nothing else is checked).

use std::fmt::Write as _;
use std::time::Duration;

use crate::config::Config;

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// Passed.
    Ok,
    /// Works, but probably not what production wants.
    Warn,
    /// The server would not start or not work.
    Fail,
}

/// One line of the report.
#[derive(Debug, Clone)]
pub struct Finding {
    /// The outcome.
    pub level: Level,
    /// What was checked and what was found.
    pub text: String,
}

fn ok(text: String) -> Finding {
    Finding {
        level: Level::Ok,
        text,
    }
}
fn warn(text: String) -> Finding {
    Finding {
        level: Level::Warn,
        text,
    }
}
fn fail(text: String) -> Finding {
    Finding {
        level: Level::Fail,
        text,
    }
}

/// Files and directories the configuration names, and the certificate.
pub async fn files(config: &Config) -> Vec<Finding> {
    let mut out = Vec::new();
    let dir = &config.database.migrations;
    if !dir.exists() {
        out.push(ok(format!(
            "[database] migrations {}: absent; the built-in schema only",
            dir.display()
        )));
    } else if !dir.is_dir() {
        out.push(fail(format!(
            "[database] migrations {}: not a directory",
            dir.display()
        )));
    } else if let Err(e) = crate::store::refuse_writable_by_others(dir) {
        out.push(fail(format!("[database] migrations: {e}")));
    } else {
        match sqlx::migrate::Migrator::new(dir.as_path()).await {
            Ok(m) => out.push(ok(format!(
                "[database] migrations {}: {} files",
                dir.display(),
                m.iter().count()
            ))),
            Err(e) => out.push(fail(format!(
                "[database] migrations {}: {e}",
                dir.display()
            ))),
        }
    }
    out.push(certificate(config));
    if let Some(ca) = &config.s2s.ca_file {
        out.push(
            match rustls_pki_types::CertificateDer::pem_file_iter(ca).map(|c| c.flatten().count()) {
                Ok(0) => fail(format!(
                    "[s2s] ca_file {}: no certificate in it",
                    ca.display()
                )),
                Ok(n) => ok(format!("[s2s] ca_file {}: {n} certificates", ca.display())),
                Err(e) => fail(format!("[s2s] ca_file {}: {e}", ca.display())),
            },
        );
    }
    out
}

use rustls_pki_types::pem::PemObject;

/// The certificate loads, its key belongs to it, and it names every domain.
fn certificate(config: &Config) -> Finding {
    let path = match &config.tls.cert {
        Some(cert) => cert.clone(),
        None => {
            let (cert, _) =
                crate::transport::tls::self_signed_paths(&config.tls.certs_dir, &config.domains);
            if !cert.exists() {
                return warn(format!(
                    "[tls] no cert configured: a self-signed development certificate will be \
                     generated as {} at start (clients will not trust it)",
                    cert.display()
                ));
            }
            cert
        }
    };
    let certs = match crate::transport::tls::Certificates::load(config) {
        Ok(c) => c,
        Err(e) => return fail(format!("[tls] {e}")),
    };
    let Some(end_entity) = certs.end_entity() else {
        return fail(format!("[tls] {}: no certificate", path.display()));
    };
    let missing: Vec<&str> = config
        .domains
        .iter()
        .filter(|d| {
            rustls_pki_types::ServerName::try_from(d.as_str())
                .map(|name| !crate::transport::s2s::cert::names_domain(&end_entity, &name))
                .unwrap_or(true)
        })
        .map(String::as_str)
        .collect();
    let dev = if config.tls.cert.is_none() {
        " (self-signed development certificate)"
    } else {
        ""
    };
    if missing.is_empty() {
        let f = format!(
            "[tls] {}{dev}: key matches, names {}",
            path.display(),
            config.domains.join(", ")
        );
        if dev.is_empty() {
            ok(f)
        } else {
            warn(f)
        }
    } else {
        fail(format!(
            "[tls] {}: does not name {} (clients will refuse it)",
            path.display(),
            missing.join(", ")
        ))
    }
}

/// Which store is configured and whether it can be used. Unusable is a failure when the
/// operator asked to `--connect`, a warning otherwise (a server may start before its
/// database, and check-config runs before start).
pub async fn store(config: &Config, connect: bool) -> Finding {
    let (what, found) = crate::store::probe(&config.database.url).await;
    match found {
        Ok(state) => ok(format!("store: {what}: {state}")),
        Err(e) if connect => fail(format!("store: {what}: NOT USABLE: {e}")),
        Err(e) => warn(format!("store: {what}: NOT USABLE: {e}")),
    }
}

/// Reaches PostgreSQL (its version, migrations applied; when [`store`] found it usable)
/// and, when configured, Redis.
pub async fn connect(config: &Config, store_usable: bool) -> Vec<Finding> {
    const LIMIT: Duration = Duration::from_secs(5);
    let mut out = Vec::new();
    if store_usable && crate::config::sqlite_path(&config.database.url).is_none() {
        let target = crate::store::database_target(&config.database.url);
        out.push(
            match tokio::time::timeout(LIMIT, postgres(&config.database.url)).await {
                Ok(Ok(what)) => ok(format!("PostgreSQL {target}: {what}")),
                Ok(Err(f)) => Finding {
                    text: format!("PostgreSQL {target}: {}", f.text),
                    ..f
                },
                Err(_) => fail(format!("PostgreSQL {target}: no answer within {LIMIT:?}")),
            },
        );
    }
    if store_usable {
        out.push(operator_migrations(config).await);
    }
    match crate::cluster::redis_conn::Target::from_config(config) {
        Ok(None) => out.push(ok(
            "Redis: none configured; liveness runs in process (single node)".into(),
        )),
        Err(e) => out.push(fail(format!("Redis: {e}"))),
        Ok(Some(redis)) => {
            let target = redis.describe();
            out.push(
                match tokio::time::timeout(LIMIT, redis_info(&redis)).await {
                    Ok(Ok(what)) => ok(format!("Redis {target}: reached, {what}")),
                    Ok(Err(e)) => fail(format!("Redis {target}: {e}")),
                    Err(_) => fail(format!("Redis {target}: no answer within {LIMIT:?}")),
                },
            );
        }
    }
    out
}

/// Whether the operator's migrations not applied yet would run on the configured store
/// (tried and rolled back): a directory written for the other dialect, as after
/// `copy-store` from SQLite to PostgreSQL, is found here rather than at the next start.
async fn operator_migrations(config: &Config) -> Finding {
    let dir = &config.database.migrations;
    match crate::store::trial_operator_migrations(&config.database.url, dir).await {
        Ok(crate::store::Trial::Runs(0)) => ok(format!(
            "[database] migrations {}: nothing to apply",
            dir.display()
        )),
        Ok(crate::store::Trial::Runs(n)) => ok(format!(
            "[database] migrations {}: {n} not applied yet; they run on this store (tried, rolled back)",
            dir.display()
        )),
        Ok(crate::store::Trial::NoSchemaYet) => ok(format!(
            "[database] migrations {}: the store has no schema yet; tried at the first start",
            dir.display()
        )),
        Err(e) => fail(format!("[database] migrations: {e}")),
    }
}

async fn postgres(url: &str) -> Result<String, Finding> {
    use sqlx::Connection;
    let mut conn = match sqlx::PgConnection::connect(url).await {
        Ok(c) => c,
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("3D000") => {
            return Err(warn(
                "reached; the database does not exist yet (`serve` and `migrate` create it)".into(),
            ))
        }
        Err(e) => return Err(fail(e.to_string())),
    };
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(&mut conn)
        .await
        .map_err(|e| fail(e.to_string()))?;
    let applied: Option<i64> =
        sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations WHERE success")
            .fetch_one(&mut conn)
            .await
            .ok();
    let _ = conn.close().await;
    Ok(match applied {
        Some(n) => format!("reached, version {version}, {n} migrations applied"),
        None => format!("reached, version {version}, no migrations applied yet"),
    })
}

/// `version <v>` of a single Redis, `cluster_state:<ok|fail>` of a Redis Cluster.
async fn redis_info(
    redis: &crate::cluster::redis_conn::Target,
) -> Result<String, redis::RedisError> {
    let mut conn = redis.connect(Duration::from_secs(2)).await?;
    let (cmd, field) = if redis.is_cluster() {
        (redis::cmd("CLUSTER").arg("INFO").clone(), "cluster_state:")
    } else {
        (redis::cmd("INFO").arg("server").clone(), "redis_version:")
    };
    let info: String = cmd.query_async(&mut conn).await?;
    let value = info
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .unwrap_or("unknown")
        .trim()
        .to_owned();
    Ok(if redis.is_cluster() {
        format!("cluster_state {value}")
    } else {
        format!("version {value}")
    })
}

/// The configuration as TOML, every table and key, with passwords and secrets elided.
pub fn effective(config: &Config) -> Result<String, toml::ser::Error> {
    let mut shown = config.clone();
    shown.database.url = elide_password(&shown.database.url);
    shown.redis.url = elide_password(&shown.redis.url);
    for node_url in &mut shown.cluster.redis_nodes {
        *node_url = elide_password(node_url);
    }
    if shown.s2s.secret.is_some() {
        shown.s2s.secret = Some("(set, not shown)".into());
    }
    if shown.admin.token.is_some() {
        shown.admin.token = Some("(set, not shown)".into());
    }
    toml::to_string(&shown)
}

/// `scheme://user:password@host…` → `scheme://user:***@host…`.
fn elide_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let Some((userinfo, host)) = rest.rsplit_once('@') else {
        return url.to_owned();
    };
    match userinfo.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_owned(),
    }
}

/// The report as printed: one line per finding, then the effective configuration.
pub fn render(findings: &[Finding], effective: &str) -> String {
    let mut out = String::new();
    for f in findings {
        let tag = match f.level {
            Level::Ok => "ok  ",
            Level::Warn => "warn",
            Level::Fail => "FAIL",
        };
        let _ = writeln!(out, "{tag}  {}", f.text);
    }
    let failed = findings.iter().filter(|f| f.level == Level::Fail).count();
    if failed == 0 {
        let _ = writeln!(out, "configuration OK");
    } else {
        let _ = writeln!(out, "{failed} check(s) failed");
    }
    let _ = writeln!(
        out,
        "\n# effective configuration (passwords and secrets elided)"
    );
    out.push_str(effective);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_elided_and_the_rest_kept() {
        assert_eq!(
            elide_password("postgres://u:s3cr@t@db.example:5432/p"),
            "postgres://u:***@db.example:5432/p"
        );
        assert_eq!(
            elide_password("redis://127.0.0.1:6379"),
            "redis://127.0.0.1:6379"
        );
        assert_eq!(elide_password(""), "");
    }

    #[test]
    fn the_effective_configuration_reads_back_as_the_same_configuration() {
        let mut c = Config::default();
        c.s2s.routes.insert(
            "other.example".into(),
            "xmpps://[::1]:5270".parse().unwrap(),
        );
        c.s2s.nameserver = crate::config::Nameserver::Disabled;
        c.liveness.ttl = Duration::from_millis(2500);
        let text = effective(&c).expect("serialises");
        let back = Config::parse(&text).expect("parses back");
        assert_eq!(format!("{back:?}"), format!("{c:?}"));
        for table in [
            "[c2s]",
            "[tls]",
            "[database]",
            "[redis]",
            "[auth]",
            "[limits]",
            "[liveness]",
            "[http]",
            "[s2s]",
            "[log]",
        ] {
            assert!(text.contains(table), "{table} in\n{text}");
        }
        c.s2s.secret = Some("hunter2".into());
        assert!(!effective(&c).unwrap().contains("hunter2"));
    }
}
