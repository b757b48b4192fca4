//! Where a scenario's CPU went: the database server's processes, the broker's, and the bench with its
//! worker processes, read from /proc before and after. On 2 cores the drain is bound by CPU shared three
//! ways, so these split a figure into the part each process costs per record. A database that runs in
//! the bench process (a file) is counted with the bench.

use procfs::CurrentSI;
use procfs::process::{Process, Stat};
use serde_json::json;

/// The processes whose CPU a scenario is charged: found once, read at each [`CpuMeter::sample`].
pub struct CpuMeter {
    /// The database server's parent process, when it runs on this machine.
    database: Option<i32>,
    ticks_per_second: f64,
}

/// CPU seconds used so far, by group.
#[derive(Clone, Copy, Default)]
pub struct CpuSample {
    database: f64,
    broker: f64,
    bench: f64,
    /// The whole machine, busy and in total (every core).
    machine_busy: f64,
    machine_total: f64,
}

impl CpuMeter {
    /// `backend` is the pid of one of the database server's processes serving a connection (a child of
    /// the server's parent process), or `None` when the server is not a process here.
    pub fn new(backend: Option<i32>) -> CpuMeter {
        let database = backend.and_then(|pid| Process::new(pid).ok()?.stat().ok()).map(|stat| stat.ppid);
        CpuMeter { database, ticks_per_second: procfs::ticks_per_second() as f64 }
    }

    /// CPU used so far by the database (its parent, its live children and the children it reaped), the
    /// broker (every `nats-server`) and this process (with its live and reaped children).
    pub fn sample(&self) -> CpuSample {
        let me = std::process::id() as i32;
        let stats: Vec<Stat> = procfs::process::all_processes()
            .map(|all| all.filter_map(|p| p.ok()?.stat().ok()).collect())
            .unwrap_or_default();
        let own = |s: &Stat| (s.utime + s.stime) as f64;
        let reaped = |s: &Stat| (s.cutime + s.cstime) as f64;
        let mut sample = CpuSample::default();
        for stat in &stats {
            if stat.pid == me {
                sample.bench += own(stat) + reaped(stat);
            } else if Some(stat.pid) == self.database {
                sample.database += own(stat) + reaped(stat);
            } else if Some(stat.ppid) == self.database {
                sample.database += own(stat);
            } else if stat.ppid == me {
                sample.bench += own(stat) + reaped(stat);
            } else if stat.comm == "nats-server" {
                sample.broker += own(stat);
            }
        }
        if let Ok(total) = procfs::KernelStats::current().map(|k| k.total) {
            let idle = total.idle + total.iowait.unwrap_or(0);
            let all = total.user + total.nice + total.system + total.irq.unwrap_or(0) + total.softirq.unwrap_or(0);
            sample.machine_busy = all as f64;
            sample.machine_total = (all + idle) as f64;
        }
        let tick = self.ticks_per_second;
        CpuSample {
            database: sample.database / tick,
            broker: sample.broker / tick,
            bench: sample.bench / tick,
            machine_busy: sample.machine_busy / tick,
            machine_total: sample.machine_total / tick,
        }
    }

    /// The CPU milliseconds per 1,000 records each group used between `before` and now, and the
    /// machine's idle share, as the bench's extra figures.
    pub fn per_thousand(&self, before: CpuSample, records: usize) -> serde_json::Value {
        let after = self.sample();
        let per = |a: f64, b: f64| ((a - b) * 1000.0 / (records as f64 / 1000.0) * 10.0).round() / 10.0;
        let total = after.machine_total - before.machine_total;
        let idle = if total > 0.0 { 1.0 - (after.machine_busy - before.machine_busy) / total } else { f64::NAN };
        json!({
            "cpu_ms_per_1k": {
                "database": if self.database.is_some() { json!(per(after.database, before.database)) } else { json!(null) },
                "broker": per(after.broker, before.broker),
                "bench_and_workers": per(after.bench, before.bench),
                "machine": per(after.machine_busy, before.machine_busy),
            },
            "machine_idle_share": (idle * 1000.0).round() / 1000.0,
        })
    }
}
