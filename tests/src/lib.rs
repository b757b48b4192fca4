//! Test support shared by the end-to-end tests (`tests/`), the fault tests' worker process
//! (`src/bin/`) and other crates' tests: a real nats-server per test, a PostgreSQL cluster of a test's own, certificates for it, a TCP proxy that adds latency.

pub mod calls;
pub mod nats;
pub mod postgres;
pub mod process;
pub mod proxy;
pub mod spans;
pub mod tls;

/// Wall-clock microseconds since the Unix epoch: the processes of one host share this clock, so a test
/// can compare the times its worker processes log.
pub fn wall_micros() -> i64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    i64::try_from(since.as_micros()).unwrap_or(i64::MAX)
}

/// The README's Rust examples, compiled as doctests so the README cannot drift from the API.
#[doc = include_str!("../../README.md")]
mod readme {}
