//! The handler-call log of the fault tests' worker processes: one line per call, appended to a file of
//! the worker's own, so logging adds no write to the database under test (on SQLite, one autocommit
//! write per call to the shared file would be most of its write load).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};

use uuid::Uuid;

/// One handler call as a worker logged it; times are wall-clock microseconds ([`crate::wall_micros`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// The worker's name.
    pub instance: String,
    /// The record delivered.
    pub record_id: Uuid,
    /// Its key.
    pub key: String,
    /// Its sequence number.
    pub seq: i64,
    /// Its partition.
    pub partition: outbox_core::Partition,
    /// The epoch it was delivered under.
    pub epoch: outbox_core::Epoch,
    /// When the call started.
    pub started_us: i64,
    /// When it ended: before it returned `Ok`, or when it was dropped unfinished.
    pub ended_us: i64,
    /// Whether it returned; `false` for a call dropped before it did (cancelled at a lease's end, a
    /// fence, a stop), which a user's handler may still have acted on.
    pub finished: bool,
}

/// A worker's log file. Each call is one `write` to a file opened for appending, so a line is either
/// whole or absent, even if the process is killed.
pub struct CallLog(Mutex<File>);

impl CallLog {
    /// Opens (creating if missing) the log at `path` for appending.
    pub fn create(path: &Path) -> std::io::Result<CallLog> {
        Ok(CallLog(Mutex::new(OpenOptions::new().create(true).append(true).open(path)?)))
    }

    /// Appends one call.
    pub fn append(&self, call: &Call) -> std::io::Result<()> {
        let line = format!(
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\n",
            call.instance,
            call.record_id,
            call.key,
            call.seq,
            call.partition,
            call.epoch,
            call.started_us,
            call.ended_us,
            u8::from(call.finished)
        );
        let mut file = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        file.write_all(line.as_bytes())
    }
}

/// A call under way: logged when [`finish`](Ongoing::finish)ed, or as unfinished when dropped before.
pub struct Ongoing {
    log: Arc<CallLog>,
    call: Call,
    logged: bool,
}

impl Ongoing {
    /// Starts `call` now (its times are set here).
    pub fn start(log: Arc<CallLog>, call: Call) -> Ongoing {
        Ongoing {
            log,
            call: Call { started_us: crate::wall_micros(), ended_us: 0, finished: false, ..call },
            logged: false,
        }
    }

    /// Logs the call as returned.
    pub fn finish(mut self) -> std::io::Result<()> {
        self.logged = true;
        self.call.finished = true;
        self.call.ended_us = crate::wall_micros();
        self.log.append(&self.call)
    }
}

impl Drop for Ongoing {
    fn drop(&mut self) {
        if !self.logged {
            self.call.ended_us = crate::wall_micros();
            if let Err(e) = self.log.append(&self.call) {
                eprintln!("cannot log the unfinished call of record {}: {e}", self.call.record_id);
            }
        }
    }
}

/// Every call logged in the `*.calls` files of `dir`.
pub fn read_dir(dir: &Path) -> std::io::Result<Vec<Call>> {
    let mut calls = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "calls") {
            for line in std::fs::read_to_string(&path)?.lines() {
                calls.push(
                    parse(line)
                        .ok_or_else(|| std::io::Error::other(format!("{}: bad line {line:?}", path.display())))?,
                );
            }
        }
    }
    Ok(calls)
}

fn parse(line: &str) -> Option<Call> {
    let f: Vec<&str> = line.split('\t').collect();
    let [instance, record_id, key, seq, partition, epoch, started_us, ended_us, finished] = f[..] else { return None };
    Some(Call {
        instance: instance.into(),
        record_id: record_id.parse().ok()?,
        key: key.into(),
        seq: seq.parse().ok()?,
        partition: partition.parse().ok()?,
        epoch: outbox_core::Epoch(epoch.parse().ok()?),
        started_us: started_us.parse().ok()?,
        ended_us: ended_us.parse().ok()?,
        finished: finished == "1",
    })
}
