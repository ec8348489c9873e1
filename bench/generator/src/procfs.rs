//! Server cost read from /proc: resident memory and CPU time of the server's processes.
//!
//! Several PIDs may be given (ejabberd is beam.smp plus helpers); their figures are summed.
//!
//! A server that keeps its state in other processes (presenced: PostgreSQL and Redis) makes
//! them work for every login and delivery; [`StoreProbe`] charges their CPU to it too, so
//! it is compared with servers whose storage runs inside their own process on equal terms.

use std::collections::HashMap;

/// USER_HZ: the unit of utime/stime in /proc/PID/stat. Linux fixes it at 100 for user
/// space on every architecture the bench runs on (see proc(5), "clock ticks").
const CLOCK_TICKS_PER_SEC: f64 = 100.0;

/// One reading of the server's cost.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sample {
    /// Sum of VmRSS over the PIDs, in kB.
    pub rss_kb: u64,
    /// Sum of utime+stime over the PIDs, in seconds.
    pub cpu_secs: f64,
}

/// Reads `Sample`s for a fixed set of PIDs; with no PIDs every sample is zero.
#[derive(Debug, Clone, Default)]
pub struct ServerProbe {
    pids: Vec<u32>,
}

impl ServerProbe {
    /// A probe for `pids`; fails early if one cannot be read.
    pub fn new(pids: Vec<u32>) -> Result<Self, String> {
        let p = ServerProbe { pids };
        for pid in &p.pids {
            read_pid(*pid).map_err(|e| format!("server pid {pid}: {e}"))?;
        }
        Ok(p)
    }

    /// True when at least one PID is watched.
    pub fn enabled(&self) -> bool {
        !self.pids.is_empty()
    }

    /// Current cost; a PID that vanished counts as zero (and is reported on stderr).
    pub fn sample(&self) -> Sample {
        let mut s = Sample::default();
        for pid in &self.pids {
            match read_pid(*pid) {
                Ok(one) => {
                    s.rss_kb += one.rss_kb;
                    s.cpu_secs += one.cpu_secs;
                }
                Err(e) => eprintln!("warning: server pid {pid}: {e}"),
            }
        }
        s
    }
}

/// CPU of the processes backing a server: fixed PIDs (its private Redis) and the
/// PostgreSQL backends connected to its database, found afresh at every sample.
#[derive(Debug, Clone, Default)]
pub struct StoreProbe {
    /// Fixed PIDs.
    pub pids: Vec<u32>,
    /// (URL of a maintenance database, the server's database name): every backend with
    /// that `datname` in pg_stat_activity is counted.
    pub pg: Option<(String, String)>,
}

/// CPU seconds per PID at one instant.
pub type CpuByPid = HashMap<u32, f64>;

impl StoreProbe {
    /// True when there is anything to watch.
    pub fn enabled(&self) -> bool {
        !self.pids.is_empty() || self.pg.is_some()
    }

    /// Resident memory of the fixed PIDs (the server's private Redis), kB. PostgreSQL's
    /// backends are left out: their memory is mostly shared buffers, not per session.
    pub fn fixed_rss_kb(&self) -> u64 {
        self.pids
            .iter()
            .filter_map(|pid| read_pid(*pid).ok())
            .map(|s| s.rss_kb)
            .sum()
    }

    /// Private memory (not shared: no shared buffers, no code) of the PostgreSQL backends
    /// connected to the server's database now, kB; None without them. What the backends
    /// keep for the server's sessions (catalog and plan caches, work memory) shows here.
    pub async fn pg_private_kb(&self) -> Option<u64> {
        let (url, db) = self.pg.as_ref()?;
        let pids = pg_backends(url, db).await.ok()?;
        Some(
            pids.iter()
                .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok())
                .map(|t| parse_private_kb(&t))
                .sum(),
        )
    }

    /// CPU seconds of each backing process now. A backend that starts during a phase counts
    /// from zero; one that exits during it is lost (the server's pool keeps them for minutes,
    /// far longer than a phase).
    pub async fn sample(&self) -> CpuByPid {
        let mut pids = self.pids.clone();
        if let Some((url, db)) = &self.pg {
            match pg_backends(url, db).await {
                Ok(found) => pids.extend(found),
                Err(e) => eprintln!("warning: PostgreSQL backends of {db}: {e}"),
            }
        }
        pids.into_iter()
            .filter_map(|pid| read_pid(pid).ok().map(|s| (pid, s.cpu_secs)))
            .collect()
    }
}

/// CPU seconds the backing processes spent between two samples.
pub fn cpu_between(before: &CpuByPid, after: &CpuByPid) -> f64 {
    after
        .iter()
        .map(|(pid, cpu)| cpu - before.get(pid).copied().unwrap_or(0.0))
        .sum()
}

async fn pg_backends(url: &str, db: &str) -> Result<Vec<u32>, String> {
    use sqlx::Connection;
    let mut c = sqlx::PgConnection::connect(url)
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    let rows: Vec<(i32,)> = sqlx::query_as("SELECT pid FROM pg_stat_activity WHERE datname = $1")
        .bind(db)
        .fetch_all(&mut c)
        .await
        .map_err(|e| format!("pg_stat_activity: {e}"))?;
    let _ = c.close().await;
    Ok(rows.into_iter().map(|(p,)| p as u32).collect())
}

fn read_pid(pid: u32) -> Result<Sample, String> {
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| e.to_string())?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|e| e.to_string())?;
    Ok(Sample {
        rss_kb: parse_vm_rss(&status).ok_or("no VmRSS line")?,
        cpu_secs: parse_cpu_ticks(&stat).ok_or("malformed stat")? as f64 / CLOCK_TICKS_PER_SEC,
    })
}

/// Private_Clean + Private_Dirty in kB from the text of /proc/PID/smaps_rollup.
fn parse_private_kb(smaps: &str) -> u64 {
    smaps
        .lines()
        .filter(|l| l.starts_with("Private_Clean:") || l.starts_with("Private_Dirty:"))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum()
}

/// VmRSS in kB from the text of /proc/PID/status.
fn parse_vm_rss(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

/// utime + stime (fields 14 and 15) in clock ticks from the text of /proc/PID/stat.
/// The command name (field 2) may contain spaces and parentheses, so fields are counted
/// after the last ')'.
fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let after = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // after ')' the first field is field 3 (state); utime is field 14 → index 11.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_memory_is_the_clean_and_dirty_private_pages() {
        let smaps = "Rss:                5000 kB\nPss:                 900 kB\n\
                     Shared_Clean:       3000 kB\nShared_Dirty:       1200 kB\n\
                     Private_Clean:       300 kB\nPrivate_Dirty:       500 kB\n";
        assert_eq!(parse_private_kb(smaps), 800);
        assert_eq!(parse_private_kb(""), 0);
    }

    #[test]
    fn cpu_ticks_are_counted_after_a_command_name_with_spaces_and_parens() {
        let stat =
            "1234 (a b) c) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 70 0 0 20 0 1 0 5 1000 10";
        assert_eq!(parse_cpu_ticks(stat), Some(320));
    }

    #[test]
    fn vm_rss_is_read_in_kilobytes() {
        let status = "Name:\tprosody\nVmPeak:\t  9000 kB\nVmRSS:\t   16544 kB\nThreads: 1\n";
        assert_eq!(parse_vm_rss(status), Some(16544));
    }

    #[test]
    fn store_cpu_counts_new_processes_from_zero_and_ignores_vanished_ones() {
        let before = CpuByPid::from([(1, 2.0), (2, 5.0)]);
        let after = CpuByPid::from([(1, 3.5), (3, 0.25)]);
        assert_eq!(cpu_between(&before, &after), 1.75);
    }

    #[test]
    fn own_process_can_be_sampled() {
        let p = ServerProbe::new(vec![std::process::id()]).expect("own pid readable");
        assert!(p.sample().rss_kb > 0);
    }
}
