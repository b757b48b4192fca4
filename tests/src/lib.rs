//! Test support shared by the end-to-end tests (`tests/`), the fault tests' worker process
//! (`src/bin/`) and other crates' tests: a real nats-server per test.

pub mod nats;
pub mod process;

/// The README's Rust examples, compiled as doctests so the README cannot drift from the API.
#[doc = include_str!("../../README.md")]
mod readme {}
