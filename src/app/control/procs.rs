//! Finding the running server: `presenced reload` looks through `/proc` for a `presenced
//! … serve` process whose `--config` is the same file as its own, resolved against that
//! process's working directory. No pid file to keep right across crashes and containers;
//! the cost is that the server must run on the same machine under a user whose `/proc`
//! entries the caller may read (the same user, or root).

use std::path::{Path, PathBuf};

/// The pid of the one server using `config_path`.
pub fn server_for(config_path: &Path) -> Result<i32, String> {
    let want = std::fs::canonicalize(config_path)
        .map_err(|e| format!("{}: {e}", config_path.display()))?;
    let me = std::process::id() as i32;
    let mut found = Vec::new();
    let entries = std::fs::read_dir("/proc").map_err(|e| format!("/proc: {e}"))?;
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let Some(config) = serve_config(&cmdline) else {
            continue;
        };
        let cwd = std::fs::read_link(entry.path().join("cwd")).unwrap_or_default();
        if std::fs::canonicalize(cwd.join(config)).ok().as_deref() == Some(want.as_path()) {
            found.push(pid);
        }
    }
    match found.as_slice() {
        [pid] => Ok(*pid),
        [] => Err(format!(
            "no running `presenced serve` uses {} (looked in /proc)",
            want.display()
        )),
        many => Err(format!(
            "several servers use {}: pids {many:?}; send SIGHUP to the one you mean",
            want.display()
        )),
    }
}

/// The configuration file of a `presenced … serve` command line (NUL-separated, as in
/// `/proc/PID/cmdline`), or `None` for any other process.
pub fn serve_config(cmdline: &[u8]) -> Option<PathBuf> {
    let args: Vec<&str> = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| std::str::from_utf8(a).ok())
        .collect::<Option<_>>()?;
    let program = Path::new(args.first()?).file_name()?.to_str()?;
    if program != "presenced" {
        return None;
    }
    let mut config = PathBuf::from("presenced.toml");
    let mut serve = false;
    let mut rest = args[1..].iter();
    while let Some(arg) = rest.next() {
        match *arg {
            "--config" | "-c" => config = PathBuf::from(rest.next()?),
            "serve" => serve = true,
            a => {
                if let Some(v) = a.strip_prefix("--config=") {
                    config = PathBuf::from(v);
                } else if let Some(v) = a.strip_prefix("-c").filter(|v| !v.is_empty()) {
                    // clap reads `-cFILE` and `-c=FILE` alike.
                    config = PathBuf::from(v.strip_prefix('=').unwrap_or(v));
                }
            }
        }
    }
    serve.then_some(config)
}

/// Sends SIGHUP.
pub fn hangup(pid: i32) -> Result<(), String> {
    // SAFETY: kill(2) takes plain integers and touches no memory of ours.
    if unsafe { libc::kill(pid, libc::SIGHUP) } == 0 {
        Ok(())
    } else {
        Err(format!(
            "SIGHUP to pid {pid}: {}",
            std::io::Error::last_os_error()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_serve_command_lines_name_a_config() {
        let line = |s: &str| s.replace(' ', "\0").into_bytes();
        assert_eq!(
            serve_config(&line("/usr/bin/presenced --config /etc/p.toml serve")),
            Some(PathBuf::from("/etc/p.toml"))
        );
        assert_eq!(
            serve_config(&line("presenced -c=x serve")),
            Some(PathBuf::from("x"))
        );
        assert_eq!(
            serve_config(&line("target/debug/presenced serve --config=a.toml")),
            Some(PathBuf::from("a.toml"))
        );
        assert_eq!(
            serve_config(&line("presenced serve")),
            Some(PathBuf::from("presenced.toml"))
        );
        assert_eq!(
            serve_config(&line("presenced --config a.toml reload")),
            None
        );
        assert_eq!(serve_config(&line("vim serve --config a.toml")), None);
    }
}
