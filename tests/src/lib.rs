//! End-to-end tests live in `tests/tests/`; the fault tests' worker process in `src/bin/`.

/// The README's Rust examples, compiled as doctests so the README cannot drift from the API.
#[doc = include_str!("../../README.md")]
mod readme {}
